"""all_reduce_rms_norm_quant on the CUDA kernels (the quantising epilogue of rmsnorm.cuh in the
one-shot, two-shot and world-1 kernels), through JAX in this process on every local GPU and on
one GPU (world 1). References (tests/quant_ref.py, written from API.md / csrc/common/fp8.h):
- float32 inputs: q and scale bit for bit equal to numpy float32 + ml_dtypes' round-to-nearest-
  even e4m3fn of all_reduce_rms_norm's float32 normed (same strategy, same program);
- every dtype: against float64 from the kernels' own T-rounded cross-rank sum (nvc.all_reduce,
  the value the fused kernels add the residual to): dequantised error bound everywhere, exact q
  wherever the float64 quotient is unambiguous; residual_out equal to all_reduce_rms_norm's;
- one-shot and two-shot bitwise equal; special rows; e4m3fn subnormals; a loop of 100 calls.
Shapes cover every row configuration of make_row_cfg (1, 2 and 4 rows per thread group; 1 to
16 warps per row). Run: JAX_NVCOMM_TEST_GPU=1 python -m pytest -m gpu tests/gpu/test_gpu_quant.py
(skipped elsewhere, with the reason). Never uses multicast."""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import gpu_env
import jax_nvcomm as nvc

sys.path.insert(0, gpu_env.TESTS)
import quant_ref  # noqa: E402

pytestmark = gpu_env.MARKS

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# (tokens, hidden): tpr 32 .. 512 threads per row; bf16 (600, 1024) -> 2 rows per group,
# (1024, 1024) -> 4 (rmsnorm.cuh, make_row_cfg)
SHAPES = [(1, 64), (33, 1024), (8, 8192), (600, 1024), (1024, 1024)]


def mesh_of(n):
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))


@pytest.fixture(scope="module")
def comms():
    n = len(jax.devices())
    out = {w: nvc.Communicator(mesh_of(w), "x", max_message_bytes=4 << 20)
           for w in sorted({1, n})}
    yield out
    for c in out.values():
        c.close()


def f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _strategies(c, tokens, hidden, dtype):
    nbytes = tokens * hidden * jnp.dtype(dtype).itemsize
    return [s for s in ("oneshot", "twoshot") if s == "twoshot" or nbytes <= c.lamport_slot_bytes]


def _run(c, strats, eps, x, res, w):
    """Per rank [world, ...]: for each strategy (q, scale, residual_out, normed, residual_out
    of all_reduce_rms_norm, all_reduce(x)), all in one program."""
    def f(v, r, ww):
        outs = []
        for s in strats:
            outs += nvc.all_reduce_rms_norm_quant(v, r, ww, c, eps=eps, strategy=s)
            outs += nvc.all_reduce_rms_norm(v, r, ww, c, eps=eps, strategy=s)
            outs.append(nvc.all_reduce(v, c, strategy=s))
        return tuple(o[None] for o in outs)

    n_out = 6 * len(strats)
    outs = jax.jit(jax.shard_map(f, mesh=c.mesh, in_specs=(P("x"), P("x"), P()),
                                 out_specs=(P("x"),) * n_out))(x, res, w)
    outs = [np.asarray(o) for o in outs]
    return {s: outs[6 * i:6 * i + 6] for i, s in enumerate(strats)}


@pytest.mark.parametrize("world_kind", ["all", "one"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", SHAPES)
def test_quant_kernels(comms, rng, world_kind, dtype, tokens, hidden):
    c = comms[max(comms) if world_kind == "all" else 1]
    W = c.world_size
    eps = 1e-6
    x = jnp.asarray(rng.standard_normal((W * tokens, hidden)), dtype)
    res = jnp.asarray(rng.standard_normal((W * tokens, hidden)), dtype)  # one per rank
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), dtype)
    strats = _strategies(c, tokens, hidden, dtype)
    got = _run(c, strats, eps, x, res, w)
    parts = f64(x).reshape(W, tokens, hidden)
    res64 = f64(res).reshape(W, tokens, hidden)
    for s in strats:
        q, sc, ro, n, ro2, total = got[s]
        assert q.dtype == jnp.float8_e4m3fn and sc.shape == (W, tokens, 1)
        np.testing.assert_array_equal(ro.view(np.uint8), ro2.view(np.uint8))
        for rank in range(W):
            r64 = f64(total[rank]) + res64[rank]  # the kernels' T-rounded sum + residual
            n64 = r64 / np.sqrt(np.mean(r64 * r64, -1, keepdims=True) + eps) * f64(w)
            err = quant_ref.normed_err(parts, res64[rank], f64(w), r64, n64, 0.0, W)
            quant_ref.check(q[rank], sc[rank], n64, err)
            if dtype == jnp.float32:
                quant_ref.assert_exact(q[rank], sc[rank], n[rank])
    if len(strats) == 2:  # one-shot and two-shot: the same bits
        for a, b in zip(got["oneshot"][:3], got["twoshot"][:3]):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_special_rows_and_subnormals(comms, rng, dtype):
    """NaN row, inf row -> scale NaN and q NaN over the row; zero row -> scale 2^-126, q 0;
    a row spanning 2^-24 .. 2^4 (e4m3fn subnormals and values rounding to zero: the hardware
    cvt against ml_dtypes, float32 only) and ordinary rows exact."""
    c = comms[max(comms)]
    W, tokens, hidden = c.world_size, 6, 256
    x = rng.standard_normal((W * tokens, hidden)).astype(np.float32)
    res = rng.standard_normal((W * tokens, hidden)).astype(np.float32)
    x[0, 3], x[1, 5] = np.nan, np.inf
    x[2::tokens], res[2::tokens] = 0.0, 0.0
    mag = 2.0 ** rng.uniform(-24, 4, size=hidden) * rng.choice([-1.0, 1.0], size=hidden)
    x[3::tokens] *= 2.0 ** -30
    res[3::tokens] = mag
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    got = _run(c, ["oneshot", "twoshot"], 1e-6, jnp.asarray(x, dtype), jnp.asarray(res, dtype),
               jnp.asarray(w, dtype))
    for s in ("oneshot", "twoshot"):
        q, sc, _, n, _, _ = got[s]
        qf = q.astype(np.float32)
        for rank in range(W):
            assert np.isnan(sc[rank, :2]).all() and np.isnan(qf[rank, :2]).all(), s
            assert sc[rank, 2, 0] == np.float32(2.0 ** -126) and (qf[rank, 2] == 0).all(), s
            if dtype == jnp.float32:
                quant_ref.assert_exact(q[rank, 3:], sc[rank, 3:], n[rank, 3:])
        if dtype == jnp.float32:
            row = qf[:, 3]
            assert (row == 0).any() and ((row != 0) & (np.abs(row) < 2.0 ** -6)).any()


def test_xla_strategy_on_gpu(comms, rng):
    """The "xla" strategy (lax.psum + XLA's RMSNorm and quantisation) against float64 from the
    same lax.psum."""
    c = comms[max(comms)]
    W, tokens, hidden = c.world_size, 16, 1024
    x = jnp.asarray(rng.standard_normal((W * tokens, hidden)), jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((W * tokens, hidden)), jnp.bfloat16)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), jnp.bfloat16)

    def f(v, r, ww):
        q, sc, ro = nvc.all_reduce_rms_norm_quant(v, r, ww, c, strategy="xla")
        return tuple(o[None] for o in (q, sc, ro, lax.psum(v, "x")))

    q, sc, ro, ps = (np.asarray(o) for o in jax.jit(jax.shard_map(
        f, mesh=c.mesh, in_specs=(P("x"), P("x"), P()), out_specs=(P("x"),) * 4))(x, res, w))
    parts = f64(x).reshape(W, tokens, hidden)
    for rank in range(W):
        r64 = f64(ps[rank]) + f64(res).reshape(W, tokens, hidden)[rank]
        n64 = r64 / np.sqrt(np.mean(r64 * r64, -1, keepdims=True) + 1e-6) * f64(w)
        err = quant_ref.normed_err(parts, f64(res).reshape(W, tokens, hidden)[rank], f64(w),
                                   r64, n64, 0.0, W)
        quant_ref.check(q[rank], sc[rank], n64, err)


def test_loop_of_quant_and_fused_calls(comms, rng):
    """100 iterations of (quant one-shot, fused two-shot, quant two-shot) in a fori_loop (the
    protocols' counters and descriptors across the quantised and plain epilogues): the last
    outputs equal one call's, bitwise."""
    c = comms[max(comms)]
    W, tokens, hidden = c.world_size, 8, 2048
    x = jnp.asarray(rng.standard_normal((W * tokens, hidden)), jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), jnp.bfloat16)

    def calls(v, r, ww):
        q1, s1, _ = nvc.all_reduce_rms_norm_quant(v, r, ww, c, strategy="oneshot")
        n, _ = nvc.all_reduce_rms_norm(v, r, ww, c, strategy="twoshot")
        q2, s2, _ = nvc.all_reduce_rms_norm_quant(v, r, ww, c, strategy="twoshot")
        return q1, s1, n, q2, s2

    def looped(v, r, ww):
        def body(i, st):  # the inputs pass a barrier with the carry: no hoisting out of the loop
            vv, _ = lax.optimization_barrier((v, st))
            return calls(vv, r, ww)
        return lax.fori_loop(0, 100, body, calls(v, r, ww))

    spec = dict(mesh=c.mesh, in_specs=(P("x"), P(), P()), out_specs=(P(),) * 5)
    once = jax.jit(jax.shard_map(calls, **spec))(x, res, w)
    loop = jax.jit(jax.shard_map(looped, **spec))(x, res, w)
    for a, b in zip(once, loop):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(once[0]).view(np.uint8),
                                  np.asarray(once[3]).view(np.uint8))


# Shapes of the cluster-split fused one-shot (allreduce_oneshot_cluster.cuh: rows of more than
# 2048 16-bit / 1024 f32 elements, up to 16384 / 8192; clusters of 4 blocks up to about 33
# tokens on an H200, then of 2 blocks up to 64 (the default; JAX_NVCOMM_AR_CLUSTER); 1 to 4
# columns per virtual lane, polled in pairs) and past its token limits (the one-block epilogue).
CLUSTER_SHAPES = [(jnp.bfloat16, 1, 7168), (jnp.bfloat16, 3, 4096), (jnp.bfloat16, 32, 7168),
                  (jnp.bfloat16, 40, 4096), (jnp.bfloat16, 64, 7168), (jnp.bfloat16, 65, 4096),
                  (jnp.float16, 17, 16384), (jnp.float32, 5, 8192), (jnp.float32, 2, 2560)]


@pytest.mark.parametrize("dtype,tokens,hidden", CLUSTER_SHAPES)
def test_cluster_rows_bitwise_twoshot(comms, rng, dtype, tokens, hidden):
    """Fused and FP8 one-shot at the cluster kernel's shapes: every output bitwise equal to
    two-shot's (whose epilogue is the one-block rmsnorm.cuh), per rank; normed and q against
    float64; a NaN row (first token of rank 0's x) gives NaN normed and a NaN scale."""
    c = comms[max(comms)]
    W = c.world_size
    if W < 2:
        pytest.skip("the cluster kernel runs for groups of 2+ GPUs")
    eps = 1e-6
    x = rng.standard_normal((W * tokens, hidden)).astype(np.float32)
    x[0, 7] = np.nan
    x = jnp.asarray(x, dtype)
    res = jnp.asarray(rng.standard_normal((W * tokens, hidden)), dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), dtype)
    got = _run(c, ["oneshot", "twoshot"], eps, x, res, w)
    for a, b in zip(got["oneshot"], got["twoshot"]):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    q, sc, ro, n, _, total = got["oneshot"]
    parts = f64(x).reshape(W, tokens, hidden)
    res64 = f64(res).reshape(W, tokens, hidden)
    for rank in range(W):
        assert np.isnan(sc[rank, 0]).all() and np.isnan(f64(n[rank, 0])).all()
        r64 = f64(total[rank]) + res64[rank]
        n64 = r64 / np.sqrt(np.mean(r64 * r64, -1, keepdims=True) + eps) * f64(w)
        r32 = np.asarray(total[rank], np.float32) + np.asarray(res, np.float32).reshape(
            W, tokens, hidden)[rank]  # the kernels' float32 add, then rounded to dtype
        np.testing.assert_array_equal(ro[rank].view(np.uint8),
                                      np.asarray(jnp.asarray(r32, dtype)).view(np.uint8))
        tol = 1e-5 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(f64(n[rank, 1:]), n64[1:], rtol=tol,
                                   atol=tol * np.abs(n64[1:]).max())
        err = quant_ref.normed_err(parts[:, 1:], res64[rank, 1:], f64(w), r64[1:], n64[1:],
                                   0.0, W)
        quant_ref.check(q[rank, 1:], sc[rank, 1:], n64[1:], err)
