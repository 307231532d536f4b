"""CUDA kernels through JAX in this process, on every local GPU (one process driving them; world
1 on a one-GPU machine): one-shot and two-shot all-reduce, the fused all-reduce + RMSNorm, world
1 (allreduce_local.cuh), all_gather, MoE dispatch/combine, the -0.0 Lamport sentinel, specials,
the padding path; jax_nvcomm.reference's impl="ragged" MoE path, which runs XLA's real
ragged_all_to_all only here (the CPU suite runs its lax.all_to_all emulation). References:
float64 numpy written in the tests from the API's definitions.
Run: JAX_NVCOMM_TEST_GPU=1 python -m pytest -m gpu tests  (skipped elsewhere, with the reason)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gpu_env
import jax_nvcomm as nvc

pytestmark = gpu_env.MARKS

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}


def mesh_of(n):
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))


@pytest.fixture(scope="module")
def comms():
    n = len(jax.devices())
    worlds = sorted({1, n})
    out = {w: nvc.Communicator(mesh_of(w), "x", max_message_bytes=4 << 20) for w in worlds}
    yield out
    for c in out.values():
        c.close()


@pytest.fixture(scope="module")
def world(comms):
    return max(comms)


def per_rank(out, w):
    """f64 [w, ...] from a result returned with out_specs=P('x') and a leading [None] axis."""
    a = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    assert a.shape[0] == w, (a.shape, w)
    return a


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def run(c, f, in_specs, *args):
    return jax.jit(jax.shard_map(f, mesh=c.mesh, in_specs=in_specs,
                                 out_specs=P("x")))(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (16, 1024), (200, 4096)])
def test_all_reduce_oneshot_twoshot(comms, world, rng, dtype, shape):
    """Both kernels against float64; each bitwise equal on every rank and to the other (the
    Lamport sanitising keeps one summation order: lamport.cuh)."""
    c = comms[world]
    x = jnp.asarray(rng.standard_normal((world * shape[0],) + shape[1:]), dtype)
    ref = np.asarray(x.astype(jnp.float32), np.float64).reshape((world,) + shape).sum(0)
    got = {}
    for strat in ["oneshot", "twoshot"]:
        nbytes = int(np.prod(shape)) * jnp.dtype(dtype).itemsize
        if strat == "oneshot" and nbytes > c.lamport_slot_bytes:
            continue
        out = run(c, lambda v: nvc.all_reduce(v, c, strategy=strat)[None], P("x"), x)
        got[strat] = np.asarray(out).reshape((world,) + shape)
        g = per_rank(out, world)
        for r in range(world):
            err = np.linalg.norm(g[r] - ref) / np.linalg.norm(ref)
            assert err < TOL[jnp.dtype(dtype)], (strat, r, err)
            np.testing.assert_array_equal(bits(got[strat][r]), bits(got[strat][0]))
    if len(got) == 2:
        np.testing.assert_array_equal(bits(got["oneshot"]), bits(got["twoshot"]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strategy", ["oneshot", "twoshot"])
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (8, 4096), (33, 1024)])
def test_fused_all_reduce_rms_norm(comms, world, rng, dtype, strategy, tokens, hidden):
    c = comms[world]
    eps = 1e-6
    x = jnp.asarray(rng.standard_normal((world * tokens, hidden)), dtype)
    res = jnp.asarray(rng.standard_normal((world * tokens, hidden)), dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), dtype)
    n, ro = jax.jit(jax.shard_map(
        lambda v, r, ww: tuple(o[None] for o in nvc.all_reduce_rms_norm(v, r, ww, c, eps=eps,
                                                                         strategy=strategy)),
        mesh=c.mesh, in_specs=(P("x"), P("x"), P()), out_specs=(P("x"), P("x"))))(x, res, w)
    f = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)
    # the CUDA path rounds the cross-rank sum to x.dtype before the residual add (docs/DESIGN.md,
    # "Decisions"): the reference does the same, in float64 otherwise
    s = f(jnp.asarray(f(x).reshape(world, tokens, hidden).sum(0), dtype))
    tol = TOL[jnp.dtype(dtype)]
    for r in range(world):
        rr = s + f(res).reshape(world, tokens, hidden)[r]
        nr = rr / np.sqrt((rr * rr).mean(-1, keepdims=True) + eps) * f(w)
        np.testing.assert_allclose(per_rank(ro, world)[r], rr, rtol=tol,
                                   atol=tol * np.abs(rr).max())
        np.testing.assert_allclose(per_rank(n, world)[r], nr, rtol=2 * tol,
                                   atol=2 * tol * np.abs(nr).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 256), (9, 4096), (2, 7168)])
def test_world_one(comms, rng, dtype, shape):
    """A group of one (allreduce_local.cuh): the sum is x itself (with -0.0 read as +0.0), the
    fused op the reference RMSNorm of x + residual; both strategies alike. Hidden 4096 (every
    dtype) and 7168 (16-bit) run the row kernel (local_rows_kernel), 256 the one-block one."""
    c = comms[1]
    x = rng.standard_normal(shape)
    x[0, :4] = -0.0
    xs = jnp.asarray(x, dtype)
    res = jnp.asarray(rng.standard_normal(shape), dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(shape[1]), dtype)
    want = np.asarray(xs.astype(jnp.float32), np.float64) + 0.0  # -0.0 + 0.0 = +0.0
    for strat in ["oneshot", "twoshot"]:
        out = run(c, lambda v: nvc.all_reduce(v, c, strategy=strat)[None], P("x"), xs)
        got = per_rank(out, 1)[0]
        np.testing.assert_array_equal(got, want)
        assert not np.signbit(got[0, :4]).any(), "-0.0 must come back as +0.0"
        n, ro = jax.jit(jax.shard_map(
            lambda v, r, ww: tuple(o[None] for o in nvc.all_reduce_rms_norm(v, r, ww, c,
                                                                             strategy=strat)),
            mesh=c.mesh, in_specs=(P("x"), P("x"), P()), out_specs=(P("x"), P("x"))))(xs, res, w)
        rr = want + np.asarray(res.astype(jnp.float32), np.float64)
        nr = rr / np.sqrt((rr * rr).mean(-1, keepdims=True) + 1e-6) * \
            np.asarray(w.astype(jnp.float32), np.float64)
        tol = TOL[jnp.dtype(dtype)]
        np.testing.assert_allclose(per_rank(ro, 1)[0], rr, rtol=tol, atol=tol * 4)
        np.testing.assert_allclose(per_rank(n, 1)[0], nr, rtol=2 * tol, atol=2 * tol * 4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.int32])
@pytest.mark.parametrize("shape,axis,tiled", [((3, 64), 0, True), ((5, 24), 1, True),
                                              ((2, 16), 0, False), ((7,), 0, True)])
def test_all_gather(comms, world, rng, dtype, shape, axis, tiled):
    c = comms[world]
    host = rng.integers(-100, 100, size=(world * shape[0],) + shape[1:])
    x = jnp.asarray(host, dtype)
    out = run(c, lambda v: nvc.all_gather(v, c, axis=axis, tiled=tiled)[None], P("x"), x)
    parts = np.split(np.asarray(x), world, axis=0)
    want = np.concatenate(parts, axis=axis) if tiled else np.stack(parts, axis=axis)
    got = np.asarray(out).reshape((world,) + want.shape)
    for r in range(world):
        np.testing.assert_array_equal(got[r], want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strategy", ["oneshot", "twoshot"])
def test_negative_zero_sentinel_and_specials(comms, world, dtype, strategy):
    """Words equal to the Lamport 'empty' pattern 0x80000000 (f32 -0.0; in 16-bit types the pair
    (+0.0, -0.0)) must be sent, not waited for: no hang, the sum is +0.0; inf/NaN propagate."""
    c = comms[world]
    item = jnp.dtype(dtype).itemsize
    row = np.zeros(64, np.float64)
    if item == 2:
        row[0:8:2], row[1:8:2] = 0.0, -0.0  # low half +0.0, high half -0.0: word 0x80000000
    else:
        row[0:8] = -0.0
    row[8:16] = -0.0
    row[16], row[17], row[18] = np.inf, -np.inf, np.nan
    row[19:] = np.arange(45) % 16 + 1  # sums up to 8 x 16: exact in every dtype
    x = np.tile(row, (world * 4, 1))
    xs = jnp.asarray(x, dtype)
    out = run(c, lambda v: nvc.all_reduce(v, c, strategy=strategy)[None], P("x"), xs)
    got = per_rank(out, world)
    for r in range(world):
        g = got[r]
        assert (g[:, :16] == 0).all() and not np.signbit(g[:, :16]).any(), g[0, :16]
        assert np.isposinf(g[:, 16]).all() and np.isneginf(g[:, 17]).all()
        assert np.isnan(g[:, 18]).all()
        np.testing.assert_array_equal(g[:, 19:], np.tile(world * (np.arange(45.0) % 16 + 1), (4, 1)))


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (0, 64), (2, 3, 3)])
def test_padding_path_and_empty(comms, world, rng, shape):
    """Shapes whose last axis is not a multiple of 16 bytes go through the padding of
    allreduce.py; zero-size inputs come back empty."""
    c = comms[world]
    x = jnp.asarray(rng.standard_normal((world,) + shape), jnp.float32)
    out = run(c, lambda v: nvc.all_reduce(v[0], c, strategy="twoshot")[None], P("x"), x)
    want = np.asarray(x, np.float64).sum(0)
    got = np.asarray(out, np.float64).reshape((world,) + shape)
    for r in range(world):
        np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-5)


def moe_oracle(x, ids, nt, E, W, w, ey_scale):
    """From API.md: expert e's rows in (source rank, token) order; y[t] = sum_k w[t,k] *
    expert_y[row of (t,k)], here expert_y = ey_scale * expert_x."""
    T = x.shape[0] // W
    rows = {e: [] for e in range(E)}
    y = np.zeros(x.shape)
    for s in range(W):
        for t in range(int(nt[s])):
            for k in range(ids.shape[1]):
                e = int(ids[s * T + t, k])
                if e >= 0:
                    rows[e].append(x[s * T + t])
                    y[s * T + t] += float(w[s * T + t, k]) * ey_scale * x[s * T + t]
    return rows, y


@pytest.mark.parametrize("dtype,K,E_per", [(jnp.bfloat16, 2, 2), (jnp.float32, 4, 4),
                                           (jnp.bfloat16, 8, 8)])
def test_moe_dispatch_combine(world, rng, dtype, K, E_per):
    W, T, H = world, 16, 256
    E = E_per * W
    with nvc.MoECommunicator(mesh_of(W), "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                             dtype=dtype) as moe:
        L = E // W
        for rnd in range(3):
            x = jnp.asarray(rng.standard_normal((W * T, H)), dtype)
            ids = np.stack([rng.choice(E, K, replace=False) for _ in range(W * T)]).astype(np.int32)
            ids[rng.random(ids.shape) < 0.1] = -1
            w = rng.random((W * T, K)).astype(np.float32)
            nt = rng.integers(0, T + 1, size=W).astype(np.int32)

            def f(x, ids, w, nt):
                d = nvc.moe_dispatch(x, ids, moe, num_tokens=nt[0])
                y = nvc.moe_combine((d.expert_x.astype(jnp.float32) * 2.0).astype(dtype), w,
                                    d.handle, moe)
                return d.expert_x[None], d.expert_counts[None], y
            ex, cnt, y = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * 4,
                                               out_specs=(P("x"),) * 3))(x, ids, w, nt)
            xf = np.asarray(x.astype(jnp.float32), np.float64)
            rows, yref = moe_oracle(xf, ids, nt, E, W, w, 2.0)
            ex = np.asarray(ex.astype(jnp.float32), np.float64)
            cnt = np.asarray(cnt)
            for e in range(E):
                r, le = divmod(e, L)
                assert cnt[r, le] == len(rows[e]), (rnd, e)
                if rows[e]:
                    np.testing.assert_array_equal(ex[r, le, :len(rows[e])], np.stack(rows[e]))
            tol = 1e-5 if dtype == jnp.float32 else 2e-2
            np.testing.assert_allclose(np.asarray(y.astype(jnp.float32), np.float64), yref,
                                       rtol=tol, atol=tol * max(1.0, np.abs(yref).max()))
        assert not moe.errors(), moe.errors()


def ragged_reference_case(W, rng, pieces, *, expect_ragged_op=True):
    """jax_nvcomm.reference.moe_dispatch_xla / moe_combine_xla with impl="ragged" over the first
    W devices against the float64 oracles of tests/helpers.py (written from API.md). On a GPU
    the compiled program must hold XLA's ragged-all-to-all (on CPU reference.py emulates it
    from lax.all_to_all, which is what the CPU suite runs)."""
    from jax_nvcomm import reference as ref
    from helpers import oracle_combine, oracle_dispatch
    T, H, K, L, S = 16, 256, 4, 4, 2
    E = L * W
    mesh = mesh_of(W)
    x = jnp.asarray(rng.standard_normal((W * T, H)), jnp.bfloat16)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(W * T)]).astype(np.int32)
    ids[rng.random(ids.shape) < 0.15] = -1
    nt = rng.integers(1, T + 1, size=W).astype(np.int32)
    if W > 1:
        nt[1] = 0                       # a rank that sends nothing
    w = rng.random((W * T, K)).astype(np.float32)
    ey = rng.standard_normal((W * L, W * T, H)).astype(np.float32)
    sc = rng.random((W * T, S)).astype(np.float32)

    def f(x, ids, nt, w, ey, sc):
        ex, cnt, exs, h = ref.moe_dispatch_xla(x, ids, axis_name="x", num_experts=E,
                                               num_tokens=nt, x_scale=sc, impl="ragged",
                                               ragged_pieces=pieces)
        y = ref.moe_combine_xla(ey, w, h, axis_name="x", num_experts=E, impl="ragged",
                                ragged_pieces=pieces)
        return ex, cnt, exs, y

    args = (x, jnp.asarray(ids), jnp.asarray(nt), jnp.asarray(w), jnp.asarray(ey),
            jnp.asarray(sc))
    compiled = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 6,
                                     out_specs=(P("x"),) * 4)).lower(*args).compile()
    if expect_ragged_op:
        assert "ragged-all-to-all" in compiled.as_text(), "XLA's ragged_all_to_all did not run"
    ex, cnt, exs, y = compiled(*args)
    ex = np.asarray(ex.astype(jnp.float32), np.float64).reshape(W, L, W * T, H)
    exs = np.asarray(exs, np.float64).reshape(W, L, W * T, S)
    cnt = np.asarray(cnt).reshape(W, L)
    x3 = np.asarray(x.astype(jnp.float32), np.float64).reshape(W, T, H)
    ids3 = ids.reshape(W, T, K)
    want = oracle_dispatch(x3, ids3, nt, E)
    want_sc = oracle_dispatch(sc.reshape(W, T, S), ids3, nt, E)
    for d in range(W):
        np.testing.assert_array_equal(cnt[d], want[d][1])
        for e in range(L):
            c = int(cnt[d, e])
            np.testing.assert_array_equal(ex[d, e, :c], want[d][0][e])      # exact movement
            np.testing.assert_array_equal(exs[d, e, :c], want_sc[d][0][e])
    got = np.asarray(y, np.float64).reshape(W, T, H)
    yref = oracle_combine(ey.reshape(W, L, W * T, H), w.reshape(W, T, K), ids3, nt, E)
    for s in range(W):
        assert not got[s, nt[s]:].any(), "rows >= num_tokens must be zero"
    np.testing.assert_allclose(got, yref, rtol=1e-5, atol=1e-5 * np.abs(yref).max())
    return cnt


@pytest.mark.parametrize("pieces", [None, 1])
def test_reference_ragged_on_gpu(rng, pieces):
    """XLA's real ragged_all_to_all (the "xla" side of the example's and the benchmark's MoE
    rows) against the oracle, on one GPU (world 1: XLA runs the op over a group of one, as the
    one-GPU example run does) and on all local GPUs; `pieces` None: ~512 updates in all, 1:
    one update per peer."""
    for W in sorted({1, len(jax.devices())}):
        cnt = ragged_reference_case(W, rng, pieces)
        assert cnt.sum() > 0
