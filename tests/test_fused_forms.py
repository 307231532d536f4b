"""all_reduce_rms_norm(_quant) in the forms model code has (docs/API.md "Fused forms"): x
[..., hidden], a float32 weight with bfloat16 / float16 x, any hidden width (padded inside,
the mean over the true width), against a float64 numpy reference on 8 CPU devices (host
backend); the kernel call in the program, not XLA's psum; what still takes XLA's path warns
once per call site."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm import _warn
from conftest import make_mesh

W = 8
EPS = 1e-6


@pytest.fixture(scope="module")
def comm():
    with nvc.Communicator(make_mesh((W,), ("x",)), "x", max_message_bytes=1 << 22) as c:
        yield c


def f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def reference(xs, res, w, eps=EPS):
    """float64: r = sum over ranks of x (rounded to x's dtype, as psum) + residual; normed."""
    dt = xs.dtype
    s = np.asarray(jnp.asarray(f64(xs).sum(0)).astype(dt).astype(jnp.float32), np.float64)
    r = s + f64(res)
    n = r / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + eps) * f64(w)
    return n, r


def run_fused(comm, xs, res, w, quant=False):
    """xs [W, ...] (rank r's partial sums), res and w replicated."""
    op = nvc.all_reduce_rms_norm_quant if quant else nvc.all_reduce_rms_norm
    n_out = 3 if quant else 2

    def f(x, r, g):
        return op(x[0], r, g, comm, eps=EPS)

    fn = jax.jit(jax.shard_map(f, mesh=comm.mesh, in_specs=(P("x"), P(), P()),
                               out_specs=(P(),) * n_out))
    text = fn.lower(xs, res, w).as_text()
    return fn(xs, res, w), text


def rand(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def tol(dtype):
    return {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2,
            jnp.dtype(jnp.float16): 3e-3}[jnp.dtype(dtype)]


@pytest.mark.parametrize("shape", [(2, 3, 64), (2, 2, 2, 16), (64,)])
def test_nd_x(comm, rng, shape):
    """x [B, S, H] (and more dims, and one row [H]): rows are the leading dims."""
    dt = jnp.bfloat16
    xs = rand(rng, (W,) + shape, dt)
    res = rand(rng, shape, dt)
    w = rand(rng, shape[-1:], dt)
    (normed, r_out), text = run_fused(comm, xs, res, w)
    assert "nvc_all_reduce_rms" in text and "stablehlo.all_reduce" not in text
    assert normed.shape == shape and r_out.shape == shape
    n_ref, r_ref = reference(xs, res, w)
    np.testing.assert_allclose(f64(r_out), r_ref, rtol=tol(dt), atol=tol(dt))
    np.testing.assert_allclose(f64(normed), n_ref, rtol=tol(dt), atol=tol(dt))
    # the same rows as the 2-D call, bitwise
    (n2, r2), _ = run_fused(comm, xs.reshape(W, -1, shape[-1]), res.reshape(-1, shape[-1]), w)
    np.testing.assert_array_equal(np.asarray(n2).reshape(shape), np.asarray(normed))
    np.testing.assert_array_equal(np.asarray(r2).reshape(shape), np.asarray(r_out))


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float16])
def test_float32_weight_with_16_bit_x_takes_the_kernel(comm, rng, dt):
    """JetStream-style norm weights (float32) with bf16 / f16 activations: the kernel, with the
    weight read unrounded; no warning."""
    T, H = 5, 128
    xs = rand(rng, (W, T, H), dt)
    res = rand(rng, (T, H), dt)
    w = jnp.asarray(1.0 + 0.01 * rng.standard_normal(H), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (normed, r_out), text = run_fused(comm, xs, res, w)
    assert "nvc_all_reduce_rms" in text and "stablehlo.all_reduce" not in text
    assert normed.dtype == dt and r_out.dtype == dt
    n_ref, r_ref = reference(xs, res, w)
    np.testing.assert_allclose(f64(normed), n_ref, rtol=tol(dt), atol=tol(dt))
    # the weight is used as float32: against the same call with the weight rounded to x's
    # dtype first, the float32 one is closer to the float64 reference
    (n_rounded, _), _ = run_fused(comm, xs, res, w.astype(dt))
    err32 = np.abs(f64(normed) - n_ref).sum()
    err16 = np.abs(f64(n_rounded) - n_ref).sum()
    assert err32 < err16, (err32, err16)
    # and the JetStream computation (psum in dt, add, f32 upcast, f32 weight, cast) agrees
    # within one rounding of dt
    hidden = (jnp.asarray(f64(xs).sum(0)).astype(dt) + res).astype(jnp.float32)
    js = (hidden * lax.rsqrt(jnp.mean(hidden * hidden, -1, keepdims=True) + EPS) * w).astype(dt)
    np.testing.assert_allclose(f64(normed), f64(js), rtol=2 * tol(dt), atol=2 * tol(dt))


def test_weight_dtypes_widen_exactly(comm, rng):
    """A bf16 weight with f32 x (and an f16 weight with bf16 x) is widened exactly: the same
    bits as passing the widened weight."""
    T, H = 3, 64
    for dt, wdt in [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float16)]:
        xs, res = rand(rng, (W, T, H), dt), rand(rng, (T, H), dt)
        w = rand(rng, (H,), wdt)
        (a, ra), text = run_fused(comm, xs, res, w)
        assert "nvc_all_reduce_rms" in text
        (b, rb), _ = run_fused(comm, xs, res, w.astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(ra), np.asarray(rb))


@pytest.mark.parametrize("hidden", [4100, 7, 1, 13, 1030])
@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float32])
def test_any_hidden_width(comm, rng, hidden, dt):
    """Widths that are not whole 16-byte vectors: padded inside; the mean divides by the true
    width (a mean over the padded width would be off by hidden / padded)."""
    T = 3
    xs = rand(rng, (W, T, hidden), dt)
    res = rand(rng, (T, hidden), dt)
    w = jnp.asarray(0.5 + rng.random(hidden), jnp.float32)
    (normed, r_out), text = run_fused(comm, xs, res, w)
    assert "nvc_all_reduce_rms" in text and "stablehlo.all_reduce" not in text
    assert normed.shape == (T, hidden)
    n_ref, r_ref = reference(xs, res, w)
    np.testing.assert_allclose(f64(r_out), r_ref, rtol=tol(dt), atol=tol(dt))
    np.testing.assert_allclose(f64(normed), n_ref, rtol=tol(dt), atol=tol(dt))


@pytest.mark.parametrize("hidden", [4100, 7, 1])
def test_quant_any_width_nd_and_float32_weight(comm, rng, hidden):
    dt = jnp.bfloat16
    shape = (2, 3, hidden)
    xs = rand(rng, (W,) + shape, dt)
    res = rand(rng, shape, dt)
    w = jnp.asarray(0.5 + rng.random(hidden), jnp.float32)
    (q, scale, r_out), text = run_fused(comm, xs, res, w, quant=True)
    assert "nvc_all_reduce_rms_quant" in text
    assert q.shape == shape and scale.shape == shape[:-1] + (1,)
    n_ref, r_ref = reference(xs, res, w)
    np.testing.assert_allclose(f64(r_out), r_ref, rtol=tol(dt), atol=tol(dt))
    deq = f64(q) * np.asarray(scale, np.float64)
    amax = np.abs(n_ref).max(-1, keepdims=True)
    assert (np.abs(deq - n_ref) <= 0.07 * np.abs(n_ref) + amax * 2 ** -9 + 1e-6).all()
    # the same residual_out bits as the unquantised op
    (_, r_plain), _ = run_fused(comm, xs, res, w)
    np.testing.assert_array_equal(np.asarray(r_out), np.asarray(r_plain))


def test_gradients_with_float32_weight_and_odd_width(comm, rng):
    """Reverse mode through the padded, float32-weight call equals the XLA reference's."""
    dt, T, H = jnp.float32, 2, 7
    xs, res = rand(rng, (W, T, H), dt), rand(rng, (T, H), dt)
    w = jnp.asarray(0.5 + rng.random(H), jnp.float32)

    def loss(op):
        def f(x, r, g):
            n, ro = op(x[0], r, g)
            return jnp.sum(n * n) + jnp.sum(ro)
        return jax.jit(jax.grad(lambda *a: jax.shard_map(
            f, mesh=comm.mesh, in_specs=(P("x"), P(), P()), out_specs=P(),
            check_vma=False)(*a), argnums=(0, 1, 2)))

    ours = loss(lambda x, r, g: nvc.all_reduce_rms_norm(x, r, g, comm, eps=EPS))(xs, res, w)
    ref = loss(lambda x, r, g: nvc.all_reduce_rms_norm(x, r, g, comm, eps=EPS,
                                                       strategy="xla"))(xs, res, w)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_xla_path_warns_once_per_call_site(comm, rng, monkeypatch):
    """A residual of another dtype cannot take the kernel: XLA's path, with one warning per
    call site (not per trace); JAX_NVCOMM_QUIET=1 silences it."""
    _warn.reset()
    T, H = 2, 64
    xs = rand(rng, (W, T, H), jnp.bfloat16)
    res = rand(rng, (T, H), jnp.float32)
    w = rand(rng, (H,), jnp.float32)

    def f(x, r, g):
        return nvc.all_reduce_rms_norm(x[0], r, g, comm)  # one call site

    def lowered(xs_):
        return jax.jit(jax.shard_map(f, mesh=comm.mesh, in_specs=(P("x"), P(), P()),
                                     out_specs=(P(), P()))).lower(xs_, res, w).as_text()

    with pytest.warns(_warn.XlaPathWarning, match=r"all_reduce_rms_norm: residual's dtype "
                                                  r"float32 differs from x's bfloat16") as rec:
        text = lowered(xs)
    assert len([r for r in rec if issubclass(r.category, _warn.XlaPathWarning)]) == 1
    assert rec[0].filename == __file__  # the user's line, not the package's
    assert "stablehlo.all_reduce" in text and "nvc_all_reduce_rms" not in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowered(xs)  # another trace (a new jit) through the same line: no second warning
    _warn.reset()
    monkeypatch.setenv("JAX_NVCOMM_QUIET", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowered(xs)


def test_message_over_the_buffers_warns(rng):
    _warn.reset()
    with nvc.Communicator(make_mesh((W,), ("x",)), "x", max_message_bytes=4096) as c:
        x = rand(rng, (W, 64, 64), jnp.float32)  # 16 KiB per rank
        fn = jax.jit(jax.shard_map(lambda v: nvc.all_reduce(v[0], c), mesh=c.mesh,
                                   in_specs=P("x"), out_specs=P()))
        with pytest.warns(_warn.XlaPathWarning, match=r"all_reduce: a message of 16384 bytes "
                                                      r"per device exceeds the communicator's "
                                                      r"max_message_bytes 4096"):
            out = fn(x)
        np.testing.assert_allclose(np.asarray(out), f64(x).sum(0), rtol=1e-5, atol=1e-5)


def test_gathers_over_the_buffers_warn(rng):
    """all_gather and all_gather_v above max_message_bytes, and reduce_scatter_v of rows that
    are not whole 16-byte vectors, take XLA's path with a warning naming why (same results)."""
    _warn.reset()
    with nvc.Communicator(make_mesh((W,), ("x",)), "x", max_message_bytes=4096) as c:
        x = rand(rng, (W * 64, 8), jnp.float32)  # 2 KiB per rank, 16 KiB gathered
        f = jax.jit(jax.shard_map(lambda v: nvc.all_gather(v, c)[None], mesh=c.mesh,
                                  in_specs=P("x"), out_specs=P("x")))
        with pytest.warns(_warn.XlaPathWarning, match=r"all_gather: gathering 16384 bytes per "
                                                      r"device exceeds .*max_message_bytes 4096"):
            got = f(x)
        np.testing.assert_array_equal(np.asarray(got)[3], np.asarray(x))
        g = jax.jit(jax.shard_map(lambda v, n: nvc.all_gather_v(v, n[0], c)[0][None],
                                  mesh=c.mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
        with pytest.warns(_warn.XlaPathWarning, match=r"all_gather_v: 8 x 64 rows of 32 bytes "
                                                      r"do not fit"):
            got = g(x, jnp.full((W,), 64, jnp.int32))
        np.testing.assert_array_equal(np.asarray(got)[0], np.asarray(x))
    with nvc.Communicator(make_mesh((W,), ("x",)), "x", max_message_bytes=1 << 20) as c:
        y = rand(rng, (W, W * 2, 3), jnp.float32)  # rows of 12 bytes
        off = jnp.arange(W + 1, dtype=jnp.int32) * 2
        h = jax.jit(jax.shard_map(lambda v: nvc.reduce_scatter_v(v[0], off, c)[None],
                                  mesh=c.mesh, in_specs=P("x"), out_specs=P("x")))
        with pytest.warns(_warn.XlaPathWarning, match=r"reduce_scatter_v: rows of 12 bytes are "
                                                      r"not a multiple of 16"):
            got = np.asarray(jax.block_until_ready(h(y)))
        want = f64(y).sum(0).reshape(W, 2, 3)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
