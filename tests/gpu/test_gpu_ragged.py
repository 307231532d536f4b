"""ragged_all_to_all's CUDA kernel on the local GPUs, bitwise against the numpy reference of
lax.ragged_all_to_all (tests/ragged_cases.py): in this process over every local GPU and over
one GPU (world 1), where it must also equal XLA's own lax.ragged_all_to_all; every dtype, k > 1
slices per peer, nothing sent / everything to one rank / full operands, a prefill-sized call,
gradients and one vmapped call; then tests/mp/ragged_mp.py with 2 and 4 processes sharing GPU 0
(CUDA IPC), one process per GPU when there are 2 or more, and runs with XLA command buffers
(the loop of calls replays a CUDA graph). Never multicast.
Run: JAX_NVCOMM_TEST_GPU=1 python -m pytest -m gpu tests/gpu/test_gpu_ragged.py (skipped
elsewhere, with the reason)."""
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gpu_env
import jax_nvcomm as nvc

sys.path.insert(0, gpu_env.TESTS)
from ragged_cases import make_call, np_grads, np_ragged_all_to_all  # noqa: E402

pytestmark = gpu_env.MARKS


def _comm(n):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
    return nvc.Communicator(mesh, "x", max_message_bytes=64 << 20)


@pytest.fixture(scope="module")
def comm():
    c = _comm(len(jax.devices()))
    yield c
    c.close()


@pytest.fixture(scope="module")
def comm1():
    c = _comm(1)
    yield c
    c.close()


@functools.lru_cache(maxsize=None)
def runner(c, strategy="auto"):
    def f(x, out, io, ss, oo, rs):
        return nvc.ragged_all_to_all(x[0], out[0], io[0], ss[0], oo[0], rs[0], c,
                                     strategy=strategy)[None]
    return jax.jit(jax.shard_map(f, mesh=c.mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))


def data(rng, shape, dtype):
    dt = jnp.dtype(dtype)
    return rng.integers(0, 256, shape + (dt.itemsize,), dtype=np.uint8).view(dt).reshape(shape)


def call(rng, W, dtype, row, k, N, M, mode):
    idx = [a.astype(np.int32) for a in make_call(rng, W, k, N, M, mode)]
    return [data(rng, (W, N) + row, dtype), data(rng, (W, M) + row, dtype)] + idx


CASES = [(jnp.bfloat16, (2048,), 1, 4096, 4096),    # a prefill-sized exchange, 16 MiB out
         (jnp.float32, (64,), 3, 100, 120),
         (jnp.float8_e4m3fn, (7,), 2, 33, 40),      # 7-byte rows: the unaligned copy path
         (jnp.float8_e5m2, (), 1, 50, 50),          # 1-D, one byte per row
         (jnp.float16, (5,), 4, 64, 64),
         (jnp.int32, (3,), 1, 17, 19)]


@pytest.mark.parametrize("case", CASES, ids=[f"{jnp.dtype(c[0]).name}-k{c[2]}" for c in CASES])
def test_matches_numpy(comm, rng, case):
    dtype, row, k, N, M = case
    for mode in ("random", "zero", "all_to_one", "full"):
        args = call(rng, comm.world_size, dtype, row, k, N, M, mode)
        got = np.asarray(runner(comm)(*args))
        assert got.tobytes() == np_ragged_all_to_all(*args).tobytes(), mode


@pytest.mark.parametrize("world", ["one", "all"])
def test_equals_xla(comm, comm1, rng, world):
    """The kernel equals XLA's lax.ragged_all_to_all (strategy="xla") on the same call: on one
    GPU (world 1), and over every local GPU (NCCL, distinct GPUs only)."""
    c = comm1 if world == "one" else comm
    for dtype, row, k, N, M in CASES[1:4]:
        idx = [a.astype(np.int32) for a in make_call(rng, c.world_size, k, N, M)]
        args = [(rng.standard_normal((c.world_size, n) + row) * 8).astype(jnp.dtype(dtype))
                for n in (N, M)] + idx
        ours = np.asarray(runner(c)(*args))
        xla = np.asarray(runner(c, "xla")(*args))
        assert ours.tobytes() == xla.tobytes(), (dtype, k)
        assert ours.tobytes() == np_ragged_all_to_all(*args).tobytes(), (dtype, k)


def test_gradients_and_vmap(comm, rng):
    """grad to operand and output against numpy; a vmapped batch of 3 calls is one kernel call."""
    W, k, N, M, h = comm.world_size, 2, 40, 48, 128
    io, ss, oo, rs = (a.astype(np.int32) for a in make_call(rng, W, k, N, M))
    x = rng.standard_normal((W, N, h)).astype(np.float32)
    out = rng.standard_normal((W, M, h)).astype(np.float32)
    t = rng.standard_normal((W, M, h)).astype(np.float32)

    def loss(x, out, io, ss, oo, rs, t):
        r = nvc.ragged_all_to_all(x[0], out[0], io[0], ss[0], oo[0], rs[0], comm)
        return jnp.sum(r * t[0])[None]
    f = jax.shard_map(loss, mesh=comm.mesh, in_specs=(P("x"),) * 7, out_specs=P("x"))
    dx, dout = jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1)))(x, out, io, ss, oo,
                                                                         rs, t)
    want_dx, want_dout = np_grads(x, out, io, ss, oo, rs, t)
    np.testing.assert_array_equal(np.asarray(dx), want_dx)
    np.testing.assert_array_equal(np.asarray(dout), want_dout)

    B = 3
    calls = [[a.astype(np.int32) for a in make_call(rng, W, k, N, M)] for _ in range(B)]
    idx = [np.stack([c[a] for c in calls], 1) for a in range(4)]
    xb, ob = data(rng, (W, B, N, h), jnp.bfloat16), data(rng, (W, B, M, h), jnp.bfloat16)
    fv = jax.jit(jax.shard_map(
        lambda *a: jax.vmap(lambda *b: nvc.ragged_all_to_all(*b, comm))(*(v[0] for v in a))[None],
        mesh=comm.mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
    assert fv.lower(xb, ob, *idx).as_text().count("@nvc_cuda_ragged_all_to_all(") == 1
    got = np.asarray(fv(xb, ob, *idx))
    for b in range(B):
        want = np_ragged_all_to_all(xb[:, b], ob[:, b], *calls[b])
        assert got[:, b].tobytes() == want.tobytes(), b


@pytest.mark.parametrize("world", ["one", "all"])
def test_outputs_many_times_the_buffers(rng, world):
    """Outputs of 64+ x max_message_bytes on a 64 KiB communicator: our kernel (the chunked
    path, chunk_bytes > 0 in the program), bitwise numpy (and XLA's op at world 1), comm.nbytes
    unchanged; strategy="chunked" at a size one round serves equals it."""
    n = 1 if world == "one" else len(jax.devices())
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
    with nvc.Communicator(mesh, "x", max_message_bytes=1 << 16) as c:
        nb = c.nbytes
        for dtype, row, k, N, M in [(jnp.bfloat16, (2048,), 1, 1100, 1100),
                                    (jnp.float32, (7,), 3, 100000, 160000),
                                    (jnp.float8_e4m3fn, (4096,), 2, 1100, 1100)]:
            for mode in ("random", "full", "all_to_one"):
                args = call(rng, n, dtype, row, k, N, M, mode)
                assert M * args[1][0, 0].nbytes >= 64 * c.max_message_bytes
                f = runner(c)
                assert "chunk_bytes = 0" not in f.lower(*args).as_text()
                got = np.asarray(f(*args))
                assert got.tobytes() == np_ragged_all_to_all(*args).tobytes(), (dtype, mode)
                if n == 1 and mode == "random":
                    assert got.tobytes() == np.asarray(runner(c, "xla")(*args)).tobytes()
        args = call(rng, n, jnp.bfloat16, (64,), 2, 100, 120, "random")
        assert np.asarray(runner(c, "chunked")(*args)).tobytes() == \
            np.asarray(runner(c)(*args)).tobytes() == np_ragged_all_to_all(*args).tobytes()
        assert c.nbytes == nb
        c.check()


def test_world1_bad_send_size_is_named(rng):
    """World 1 runs the kernel and its checks like every world size: a send size 10^6 rows past
    the operand is the named error (the one-round and the chunked path), not a silent call."""
    for max_bytes, M in ((1 << 20, 64), (1 << 16, 4096)):   # one round; chunked
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
        c = nvc.Communicator(mesh, "x", max_message_bytes=max_bytes, timeout_s=10)
        idx = [np.zeros((1, 1), np.int32) for _ in range(4)]
        idx[1][0, 0] = idx[3][0, 0] = 10 ** 6
        x = np.zeros((1, 32, 256), np.float32)
        out = np.zeros((1, M, 256), np.float32)
        try:
            jax.block_until_ready(runner(c)(x, out, *idx))
        except Exception:  # noqa: BLE001 - the record is what is checked
            pass
        with pytest.raises(nvc.CommunicatorError,
                           match=r"slice i=0 of rank 0's call lies outside operand/output: "
                                 r"input_offsets\[i\] \+ send_sizes\[i\] > N"):
            c.check()
        c.close()


SETUPS = gpu_env.setups() + [("sh4", 4, True)]


@pytest.mark.parametrize("name,n,share", SETUPS, ids=[s[0] for s in SETUPS])
def test_ragged_processes(name, n, share):
    """ragged_mp.py: random calls, a loop, vmap, gradients (our op, so also on a shared GPU)."""
    rc, out = gpu_env.launch(n, "ragged_mp.py", "--rounds=16", share_gpu=share, timeout=300)
    assert rc == 0, out[-6000:]
    assert out.count("PASS ragged") == n, out[-6000:]


@pytest.mark.parametrize("n,share", [(0, False), (2, True)], ids=["one_process", "sh2"])
def test_ragged_command_buffers(n, share):
    """Custom calls and loops in XLA command buffers: the fori_loop of ragged_all_to_all calls
    replays a CUDA graph (fewer handler runs than kernel calls), results exact."""
    rc, out = gpu_env.launch(n, "ragged_mp.py", "--rounds=4", "--graph=1", share_gpu=share,
                             timeout=300)
    assert rc == 0, out[-6000:]
    assert out.count("PASS ragged") == max(n, 1), out[-6000:]
    assert "(CUDA graph replay)" in out, out[-6000:]


def test_ragged_bad_slice_shared_gpu():
    """ragged_mp.py --fault=1 with 2 processes sharing GPU 0: the kernel's record names the bad
    rank, its slice and the bound; the peer names that rank; later calls are refused."""
    rc, out = gpu_env.launch(2, "ragged_mp.py", "--fault=1", share_gpu=True, timeout=150)
    assert rc == 0, out[-6000:]
    assert out.count("PASS ragged fault") == 2, out[-6000:]
