"""all_reduce_rms_norm_quant on 8 CPU devices (host backend and the "xla" strategy) against
float64 numpy references written from the definition (tests/quant_ref.py; API.md): per-rank
outputs (each rank its own residual), every strategy, bf16/f16/f32 inputs, world 1 and > 1,
the exact FP8 bytes and scales where the float32 normed is known exactly, special values,
argument errors, and that differentiating it raises.

As in test_allreduce.py, "oneshot" and "twoshot" run the one host protocol on CPU; the CUDA
kernels' quantising epilogue is tested by tests/gpu/test_gpu_quant.py (`pytest -m gpu`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm._warn import XlaPathWarning
import quant_ref
from helpers import f64, mesh1d, run_sharded

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
STRATS = ["oneshot", "twoshot", "xla", "auto"]


@pytest.fixture(scope="module")
def comms():
    out = {w: nvc.Communicator(mesh1d(w), "x", max_message_bytes=1 << 20) for w in (1, 2, 8)}
    yield out
    for c in out.values():
        c.close()


def _inputs(rng, world, tokens, hidden, dtype):
    x = jnp.asarray(rng.standard_normal((world * tokens, hidden)), dtype)
    res = jnp.asarray(rng.standard_normal((world * tokens, hidden)), dtype)  # one per rank
    w = jnp.asarray(1 + 0.1 * rng.standard_normal((hidden,)), dtype)
    return x, res, w


def _both(c, strategy, eps, x, res, w, with_psum=False):
    """Per rank ([world, ...] stacked): the quantised op and all_reduce_rms_norm, traced
    independently in one program (the order token keeps them paired on every rank); with_psum:
    also lax.psum(x) in x.dtype, the sum the "xla" strategy adds the residual to."""
    def f(v, r, ww):
        q, s, ro = nvc.all_reduce_rms_norm_quant(v, r, ww, c, eps=eps, strategy=strategy)
        n, ro2 = nvc.all_reduce_rms_norm(v, r, ww, c, eps=eps, strategy=strategy)
        outs = (q, s, ro, n, ro2) + ((lax.psum(v, "x"),) if with_psum else ())
        return tuple(o[None] for o in outs)

    outs = run_sharded(f, c.mesh, (P("x"), P("x"), P()), (P("x"),) * (5 + with_psum), x, res, w)
    return [np.asarray(o) for o in outs]


@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strategy", STRATS)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 512)])
def test_matches_reference(comms, rng, world, dtype, strategy, tokens, hidden):
    c = comms[world]
    eps = 1e-5
    x, res, w = _inputs(rng, world, tokens, hidden, dtype)
    q, s, ro, n, ro2, psum = _both(c, strategy, eps, x, res, w, with_psum=True)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (world, tokens, hidden)
    assert s.dtype == np.float32 and s.shape == (world, tokens, 1)
    assert ro.dtype == jnp.dtype(dtype)
    # residual_out: all_reduce_rms_norm's, bit for bit
    np.testing.assert_array_equal(ro.view(np.uint8), ro2.view(np.uint8))
    parts = f64(x).reshape(world, tokens, hidden)
    res64 = f64(res).reshape(world, tokens, hidden)
    # every strategy adds the residual to the sum rounded to x.dtype: the "xla" strategy to
    # lax.psum(x) (the reference takes it from lax.psum), the kernels to their float32 sum in
    # rank order rounded (XLA:CPU sums float16 in float16: another rounding)
    xla = (strategy if strategy != "auto" else
           nvc.select_strategy(c, (tokens, hidden), dtype,
                               op="all_reduce_rms_norm_quant")) == "xla"
    acc = np.zeros((tokens, hidden), np.float32)
    for part in np.asarray(jnp.asarray(x, jnp.float32)).reshape(world, tokens, hidden):
        acc = acc + part
    sums = f64(psum[0]) if xla else f64(jnp.asarray(acc, dtype))
    for rank in range(world):
        r64 = sums + res64[rank]
        n64 = r64 / np.sqrt(np.mean(r64 * r64, -1, keepdims=True) + eps) * f64(w)
        err = quant_ref.normed_err(parts, res64[rank], f64(w), r64, n64, 0.0, world)
        quant_ref.check(q[rank], s[rank], n64, err)
        if dtype == jnp.float32:  # all_reduce_rms_norm's normed is the float32 normed itself
            quant_ref.assert_exact(q[rank], s[rank], n[rank])


@pytest.mark.parametrize("strategy", ["oneshot", "xla"])
def test_wide_range_rows_exact(comms, rng, strategy):
    """Rows spanning 2^-24 .. 2^4 in magnitude: e4m3fn normals, subnormals (below 2^-6 of
    448) and values that round to zero, each byte checked against ml_dtypes."""
    c = comms[2]
    tokens, hidden = 6, 256
    mag = 2.0 ** rng.uniform(-24, 4, size=(tokens, hidden))
    sign = rng.choice([-1.0, 1.0], size=(tokens, hidden))
    res = np.tile(mag * sign, (2, 1)).astype(np.float32)
    x = (rng.standard_normal((2 * tokens, hidden)) * 2.0 ** -30).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    q, s, ro, n, _ = _both(c, strategy, 1e-6, jnp.asarray(x), jnp.asarray(res), jnp.asarray(w))
    qf = q.astype(np.float32)
    assert (qf == 0).any() and ((np.abs(qf) > 0) & (np.abs(qf) < 2.0 ** -6)).any()
    for rank in range(2):
        quant_ref.assert_exact(q[rank], s[rank], n[rank])


@pytest.mark.parametrize("world", [1, 8])
@pytest.mark.parametrize("strategy", ["oneshot", "xla"])
def test_special_rows(comms, rng, world, strategy):
    """A row holding NaN, one holding +inf, one of zeros, the rest finite: NaN and inf rows give
    a NaN scale and NaN in every q of the row; the zero row scale 2^-126 and q = 0; the other
    rows are unaffected (exact against all_reduce_rms_norm's float32 normed)."""
    c = comms[world]
    tokens, hidden = 5, 64
    x = rng.standard_normal((world * tokens, hidden)).astype(np.float32)
    res = rng.standard_normal((world * tokens, hidden)).astype(np.float32)
    x[0, 3] = np.nan
    x[1, 5] = np.inf
    x[2::tokens] = 0.0
    res[2::tokens] = 0.0
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    q, s, ro, n, _ = _both(c, strategy, 1e-6, jnp.asarray(x), jnp.asarray(res), jnp.asarray(w))
    qf = q.astype(np.float32)
    for rank in range(world):
        assert np.isnan(s[rank, :2]).all(), s[rank, :2]
        assert np.isnan(qf[rank, :2]).all()
        assert s[rank, 2, 0] == np.float32(2.0 ** -126)
        assert (qf[rank, 2] == 0).all()
        quant_ref.assert_exact(q[rank, 3:], s[rank, 3:], n[rank, 3:])


def test_check_vma_false_mixed_dtypes_and_empty(comms, rng):
    c = comms[2]
    x, res, w = _inputs(rng, 2, 3, 128, jnp.bfloat16)
    f = lambda v, r, ww: nvc.all_reduce_rms_norm_quant(v, r, ww, c, strategy="oneshot")
    q, s, ro = run_sharded(f, c.mesh, (P("x"), P(), P()), (P(), P(), P()), x, res[:3], w,
                           check_vma=False)
    q2, s2, ro2 = run_sharded(f, c.mesh, (P("x"), P(), P()), (P(), P(), P()), x, res[:3], w)
    for a, b in [(q, q2), (s, s2), (ro, ro2)]:
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    # mixed dtypes (float32 residual): not fused, the "xla" strategy's arithmetic (the residual
    # added to lax.psum(x) in bfloat16)
    res32 = res[:3].astype(jnp.float32)
    fm = lambda v, r, ww: f(v, r, ww) + (lax.psum(v, "x"),)
    with pytest.warns(XlaPathWarning, match=r"all_reduce_rms_norm_quant: residual's dtype "
                                            r"float32 differs from x's bfloat16"):
        qm, sm, rom, ps = run_sharded(fm, c.mesh, (P("x"), P(), P()), (P(),) * 4, x, res32, w)
    assert rom.dtype == jnp.float32 and qm.dtype == jnp.float8_e4m3fn
    parts = f64(x).reshape(2, 3, 128)
    r64 = f64(ps) + f64(res32)
    n64 = r64 / np.sqrt(np.mean(r64 * r64, -1, keepdims=True) + 1e-6) * f64(w)
    err = quant_ref.normed_err(parts, f64(res32), f64(w), r64, n64, 0.0, 2)
    quant_ref.check(np.asarray(qm), np.asarray(sm), n64, err)
    # no tokens
    z = jnp.zeros((0, 128), jnp.bfloat16)
    qe, se, re_ = run_sharded(f, c.mesh, (P("x"), P(), P()), (P(), P(), P()),
                              jnp.zeros((0, 128), jnp.bfloat16), z, w)
    assert qe.shape == (0, 128) and se.shape == (0, 1) and re_.shape == (0, 128)


@pytest.mark.parametrize("strategy", ["oneshot", "xla"])
def test_grad_raises(comms, rng, strategy):
    c = comms[2]
    x, res, w = _inputs(rng, 2, 2, 64, jnp.float32)

    def loss(v, r, ww):
        q, s, ro = nvc.all_reduce_rms_norm_quant(v, r, ww, c, strategy=strategy)
        return (q.astype(jnp.float32) * s).sum() + ro.sum()

    g = jax.grad(lambda v, r, ww: jax.shard_map(loss, mesh=c.mesh, in_specs=(P("x"), P(), P()),
                                                 out_specs=P())(v, r, ww))
    with pytest.raises(TypeError, match="no gradient"):
        jax.jit(g)(x, res[:2], w)


def _call(c, *args, **kw):
    f = lambda v, r, ww: nvc.all_reduce_rms_norm_quant(v, r, ww, c, **kw)
    return run_sharded(f, c.mesh, (P("x"), P(), P()), (P(), P(), P()), *args)


def test_argument_errors(comms, rng):
    c = comms[2]
    x, res, w = _inputs(rng, 2, 2, 64, jnp.bfloat16)
    res, ok = res[:2], (x, res[:2], w)
    with pytest.raises(TypeError, match=r"out_dtype must be float8_e4m3fn, got .*e5m2"):
        _call(c, *ok, out_dtype=jnp.float8_e5m2)
    with pytest.raises(TypeError, match="out_dtype must be float8_e4m3fn, got .*bfloat16"):
        _call(c, *ok, out_dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="out_dtype must be float8_e4m3fn, got 'fp8'"):
        _call(c, *ok, out_dtype="fp8")
    with pytest.raises(TypeError, match="x must be bfloat16, float16 or float32, got int32"):
        _call(c, x.astype(jnp.int32), res, w)
    with pytest.raises(ValueError, match=r"residual must have x's shape \(2, 64\), got \(2, 32\)"):
        _call(c, x, res[:, :32], w)
    with pytest.raises(ValueError, match=r"weight must have shape \(64,\), got \(32,\)"):
        _call(c, x, res, w[:32])
    with pytest.raises(ValueError, match=r"weight must have shape \(32,\), got \(64,\)"):
        _call(c, x.reshape(4, 2, 32), res.reshape(2, 2, 32), w)
    with pytest.raises(ValueError, match="eps must be >= 0, got -1.0"):
        _call(c, *ok, eps=-1.0)
    with pytest.raises(ValueError, match="strategy must be 'auto'"):
        _call(c, *ok, strategy="threeshot")
    with pytest.raises(ValueError, match="hidden must be > 0"):
        _call(c, x[:, :0], res[:, :0], w[:0])
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        nvc.all_reduce_rms_norm_quant(x, res, w, c)
