"""all_gather_v / reduce_scatter_v CUDA kernels on the local GPUs, against float64 numpy written
here: in this process over every local GPU (world 1 on a one-GPU machine takes the XLA path),
random / zero / all-on-one / unbalanced prefill-vs-decode counts, unaligned rows, the three
float dtypes, gradients; then tests/mp/varlen_mp.py one process per GPU, two processes sharing
GPU 0, and one process over every GPU with XLA command buffers (CUDA-graph replay of a loop).
Never multicast. Run: JAX_NVCOMM_TEST_GPU=1 python -m pytest -m gpu tests/gpu/test_gpu_varlen.py
(skipped elsewhere, with the reason)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gpu_env
import jax_nvcomm as nvc

pytestmark = gpu_env.MARKS


@pytest.fixture(scope="module")
def comm():
    n = len(jax.devices())
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    c = nvc.Communicator(mesh, "x", max_message_bytes=64 << 20)
    yield c
    c.close()


def gather(c, x, counts):
    def f(v, n):
        g, off, tot = nvc.all_gather_v(v, n[0], c)
        return g[None], off[None], tot[None]
    return [np.asarray(a) for a in jax.jit(jax.shard_map(
        f, mesh=c.mesh, in_specs=(P("x"), P("x")), out_specs=(P("x"),) * 3))(x, counts)]


def scatter(c, y, off):
    return np.asarray(jax.jit(jax.shard_map(
        lambda v, o: nvc.reduce_scatter_v(v[0], o, c)[None], mesh=c.mesh,
        in_specs=(P("x"), P()), out_specs=P("x")))(y, off))


def count_cases(W, max_rows, rng):
    out = {"zero": np.zeros(W, np.int32), "full": np.full(W, max_rows, np.int32),
           "one": np.eye(W, dtype=np.int32)[0] * max_rows,
           "random": rng.integers(0, max_rows + 1, W).astype(np.int32)}
    unb = np.full(W, min(10, max_rows), np.int32)
    unb[0] = max_rows
    out["prefill+decode"] = unb
    return out


@pytest.mark.parametrize("dtype,row_shape,max_rows", [
    (jnp.bfloat16, (2048,), 4000),   # one rank prefilling 4000 tokens, the others decoding
    (jnp.float32, (64,), 33),
    (jnp.int8, (5,), 17),            # 5-byte rows: the unaligned copy path
])
def test_all_gather_v(comm, rng, dtype, row_shape, max_rows):
    W = comm.world_size
    x = jnp.asarray(rng.integers(-100, 100, (W * max_rows,) + row_shape), dtype)
    xh = np.asarray(x)
    for name, c in count_cases(W, max_rows, rng).items():
        g, off, tot = gather(comm, x, c)
        want_off = np.concatenate([[0], np.cumsum(c)])
        want = np.concatenate([xh[r * max_rows: r * max_rows + c[r]] for r in range(W)])
        for r in range(W):
            np.testing.assert_array_equal(off[r], want_off, err_msg=f"{name}: offsets rank {r}")
            assert int(tot[r]) == want_off[-1], name
            np.testing.assert_array_equal(g[r][:want_off[-1]], want, err_msg=f"{name} rank {r}")
            assert not np.asarray(g[r][want_off[-1]:], np.float64).any(), f"{name}: tail"


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2),
                                       (jnp.float16, 2e-3)])
@pytest.mark.parametrize("max_rows,hidden", [(4000, 2048), (7, 64)])
def test_reduce_scatter_v(comm, rng, dtype, tol, max_rows, hidden):
    W = comm.world_size
    if dtype == jnp.float32 and max_rows * hidden * 4 * W > comm.max_message_bytes:
        pytest.skip("larger than the communicator's buffers (XLA path)")
    y = jnp.asarray(rng.standard_normal((W, W * max_rows, hidden)), dtype)
    yh = np.asarray(y.astype(jnp.float32), np.float64)
    for name, c in count_cases(W, max_rows, rng).items():
        off = np.concatenate([[0], np.cumsum(c)]).astype(np.int32)
        got = np.asarray(jnp.asarray(scatter(comm, y, off)).astype(jnp.float32), np.float64)
        for r in range(W):
            ref = yh[:, off[r]:off[r + 1]].sum(0)
            np.testing.assert_allclose(got[r, :c[r]], ref, rtol=tol, atol=tol * 4,
                                       err_msg=f"{name} rank {r}")
            assert not got[r, c[r]:].any(), f"{name}: rows past the count on rank {r}"


def test_gradients_match_xla(comm, rng):
    """grad through gather -> per-rank weight -> reduce-scatter equals JAX's autodiff of the
    XLA path (padded lax.all_gather + psum_scatter)."""
    from jax_nvcomm import varlen
    W, max_rows, h = comm.world_size, 12, 256
    c = rng.integers(0, max_rows + 1, W).astype(np.int32)
    x = rng.standard_normal((W * max_rows, h)).astype(np.float32)
    w = (rng.standard_normal((W, h, h)) / 16).astype(np.float32)
    t = rng.standard_normal((W * max_rows, h)).astype(np.float32)

    def make(ours):
        def body(x, n, w, t):
            if ours:
                g, off, _ = nvc.all_gather_v(x, n[0], comm)
                out = nvc.reduce_scatter_v(g @ w[0], off, comm)
            else:
                g, off, _ = varlen.xla_all_gather_v(x, n[0], "x", W)
                out = varlen.xla_reduce_scatter_v(g @ w[0], off, "x", W)
            return jnp.sum(out * t)[None]
        f = jax.shard_map(body, mesh=comm.mesh, in_specs=(P("x"),) * 4, out_specs=P("x"))
        return jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 2)))

    got = make(True)(x, c, w, t)
    ref = make(False)(x, c, w, t)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-3)


SETUPS = gpu_env.setups()


@pytest.mark.parametrize("name,n,share", SETUPS, ids=[s[0] for s in SETUPS])
def test_varlen_processes(name, n, share):
    """varlen_mp.py: gather -> layer -> scatter rounds, a loop, gradients (not when sharing a
    GPU: XLA's collectives cannot run there)."""
    rc, out = gpu_env.launch(n, "varlen_mp.py", "--rounds=20", f"--grad={0 if share else 1}",
                             share_gpu=share)
    assert rc == 0, out[-6000:]
    assert out.count("PASS varlen") == n, out[-6000:]


def test_varlen_command_buffers():
    """One process over every local GPU with custom calls and loops in XLA command buffers: the
    loop of gather + scatter pairs replays a CUDA graph, results exact."""
    rc, out = gpu_env.launch(0, "varlen_mp.py", "--rounds=5", "--graph=1")
    assert rc == 0, out[-6000:]
    assert "PASS varlen" in out and "(CUDA graph replay)" in out, out[-6000:]
