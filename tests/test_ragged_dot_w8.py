"""nvc.ragged_dot / ragged_dot_swiglu with 8-bit weights (int8, float8_e4m3fn) on the host
backend (8 CPU devices): our custom call serves them (in the lowered text, no fallback warning);
equal to lax.ragged_dot on the weights converted to lhs's dtype (int8 x bf16: every product
exact, sums within float32 rounding of a float64 numpy reference); per-channel and per-block
scales against float64; empty groups, one group holding every row, rows past the groups zero,
a sum of sizes past M; swiglu; gradients and vmap as lax's; bad inputs' messages."""
import importlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_nvcomm as nvc

rd = importlib.import_module("jax_nvcomm.ragged_dot")
W8 = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def weights(rng, kind, shape):
    if kind == "int8":
        return jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
    return jnp.asarray(rng.standard_normal(shape) * 4, jnp.float8_e4m3fn)  # normals, subnormals


def f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def np_ref(lhs, rhs, sizes, scale=None, mode=0):
    """float64: out[r] = lhs[r] @ (rhs[g] * s[g]) for the rows r of group g; later rows 0."""
    lhs, w = f64(lhs), f64(rhs)
    if mode == 1:
        w = w * f64(scale)[:, None, :]
    elif mode == 2:
        s = np.repeat(np.repeat(f64(scale), 128, 1), 128, 2)
        w = w * s[:, :w.shape[1], :w.shape[2]]
    out = np.zeros((lhs.shape[0], w.shape[2]))
    start = 0
    for g, n in enumerate(np.asarray(sizes)):
        end = min(start + max(int(n), 0), lhs.shape[0])
        out[start:end] = lhs[start:end] @ w[g]
        start = end
    return out


def called(fn, *args):
    return re.findall(r"custom_call @(nvc_\w+)", jax.jit(fn).lower(*args).as_text())


def no_warning(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return jax.jit(fn)(*args)


def sizes_of(rng, m, g, empty=True):
    cut = np.sort(rng.integers(0, m - 2, g - 1))
    s = np.diff(np.concatenate([[0], cut, [m - 2]])).astype(np.int32)
    if empty:
        s[rng.integers(0, g)] = 0
    return jnp.asarray(np.maximum(s, 0))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("pet", [None, jnp.float32])
def test_equals_lax_on_converted_weights(rng, kind, dtype, pet):
    m, k, g, n = 40, 96, 5, 72
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = weights(rng, kind, (g, k, n))
    sizes = sizes_of(rng, m, g)
    fn = lambda a, b, c: nvc.ragged_dot(a, b, c, preferred_element_type=pet)  # noqa: E731
    assert called(fn, lhs, rhs, sizes) == ["nvc_ragged_dot_w8"]
    got = no_warning(fn, lhs, rhs, sizes)
    assert got.dtype == (dtype if pet is None else jnp.float32) and got.shape == (m, n)
    # lax on the converted weights (exact conversion), float32 result
    want = lax.ragged_dot(lhs, rhs.astype(dtype), sizes, preferred_element_type=jnp.float32)
    ref = np_ref(lhs, rhs, sizes)
    # every product is exact in float32 (bf16/f16 x 8-bit); the sum's error <= K eps32 sum|.|
    bound = np.abs(f64(lhs)) @ np.abs(f64(rhs)).max(0) * k * 2.0 ** -24
    if pet is None:  # one rounding to dtype
        bound = bound + np.abs(ref) * float(jnp.finfo(dtype).eps)
        np.testing.assert_array_less(np.abs(f64(got) - f64(want.astype(dtype))),
                                     2 * bound + 1e-30)
    assert np.all(np.abs(f64(got) - ref) <= bound + 1e-30)
    assert not np.any(f64(got)[int(sizes.sum()):])


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("mode", [1, 2])
def test_scales_against_float64(rng, kind, mode):
    m, k, g, n = 24, 300, 3, 260   # K and N off multiples of 128: partial blocks
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = weights(rng, kind, (g, k, n))
    shape = (g, n) if mode == 1 else (g, 3, 3)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, shape) * 1e-2, jnp.float32)
    sizes = jnp.asarray([10, 0, 12], jnp.int32)
    fn = lambda a, b, c, s: nvc.ragged_dot(a, b, c, rhs_scale=s,  # noqa: E731
                                           preferred_element_type=jnp.float32)
    assert called(fn, lhs, rhs, sizes, scale) == ["nvc_ragged_dot_w8"]
    got = f64(no_warning(fn, lhs, rhs, sizes, scale))
    ref = np_ref(lhs, rhs, sizes, scale, mode)
    # w * s rounds once in float32, then the float32 sum
    mag = np_ref(np.abs(f64(lhs)), np.abs(f64(rhs)), sizes, np.abs(f64(scale)), mode)
    np.testing.assert_array_less(np.abs(got - ref), mag * (k + 2) * 2.0 ** -24 + 1e-30)
    assert not np.any(got[22:])
    # a bf16 scale is taken too (converted to float32)
    got16 = f64(jax.jit(fn)(lhs, rhs, sizes, scale.astype(jnp.bfloat16)))
    ref16 = np_ref(lhs, rhs, sizes, scale.astype(jnp.bfloat16), mode)
    np.testing.assert_allclose(got16, ref16, rtol=1e-5, atol=1e-5 * np.abs(ref16).max())


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_one_group_all_rows_and_sizes_past_m(rng, kind):
    m, k, g, n = 17, 64, 4, 48
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = weights(rng, kind, (g, k, n))
    for sizes in ([0, 0, m, 0], [0, 5, m, 9], [-3, m, 0, 0]):
        sizes = jnp.asarray(sizes, jnp.int32)
        got = no_warning(lambda a, b, c: nvc.ragged_dot(a, b, c, preferred_element_type=
                                                         jnp.float32), lhs, rhs, sizes)
        want = lax.ragged_dot(lhs, rhs.astype(jnp.bfloat16), jnp.maximum(sizes, 0),
                              preferred_element_type=jnp.float32)
        np.testing.assert_allclose(f64(got), f64(want), rtol=1e-5,
                                   atol=1e-5 * float(np.abs(f64(want)).max()))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_swiglu(rng, kind, mode):
    m, k, g, n = 30, 160, 4, 136
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    wg, wu = weights(rng, kind, (g, k, n)), weights(rng, kind, (g, k, n))
    shape = {0: None, 1: (g, n), 2: (g, 2, 2)}[mode]
    sg = None if shape is None else jnp.asarray(rng.uniform(0.5, 2, shape) * 1e-2, jnp.float32)
    su = None if shape is None else jnp.asarray(rng.uniform(0.5, 2, shape) * 1e-2, jnp.float32)
    if mode == 0:
        lhs = lhs * 1e-2 if kind == "int8" else lhs
    sizes = sizes_of(rng, m, g)
    fn = lambda a, b, c, d, e, f: rd.ragged_dot_swiglu(  # noqa: E731
        a, b, c, f, gate_scale=d, up_scale=e, preferred_element_type=jnp.float32)
    assert called(fn, lhs, wg, wu, sg, su, sizes) == ["nvc_ragged_dot_swiglu_w8"]
    got = f64(no_warning(fn, lhs, wg, wu, sg, su, sizes))
    a, b = np_ref(lhs, wg, sizes, sg, mode), np_ref(lhs, wu, sizes, su, mode)
    ref = a / (1 + np.exp(-a)) * b
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    # bf16 result: the same, rounded once
    got16 = f64(jax.jit(lambda *v: rd.ragged_dot_swiglu(v[0], v[1], v[2], v[5], gate_scale=v[3],
                                                        up_scale=v[4]))(lhs, wg, wu, sg, su,
                                                                        sizes))
    np.testing.assert_allclose(got16, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


def test_gradient_and_vmap_as_lax(rng):
    m, k, g, n = 12, 32, 3, 16
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = weights(rng, "int8", (g, k, n))
    scale = jnp.asarray(rng.uniform(0.5, 2, (g, n)), jnp.float32)
    sizes = jnp.asarray([4, 0, 7], jnp.int32)

    def loss(f):
        return lambda a, s: jnp.sum(f(a, s) ** 2)
    ours = loss(lambda a, s: nvc.ragged_dot(a, rhs, sizes, rhs_scale=s,
                                            preferred_element_type=jnp.float32))
    ref = loss(lambda a, s: lax.ragged_dot(a.astype(jnp.float32),
                                           rhs.astype(jnp.float32) * s[:, None, :], sizes,
                                           precision=lax.Precision.HIGHEST))
    ga, gs_ = jax.jit(jax.grad(ours, argnums=(0, 1)))(lhs, scale)
    ra, rs = jax.jit(jax.grad(ref, argnums=(0, 1)))(lhs, scale)
    np.testing.assert_allclose(f64(ga), f64(ra), rtol=2e-2, atol=1e-2 * np.abs(f64(ra)).max())
    np.testing.assert_allclose(f64(gs_), f64(rs), rtol=1e-3, atol=1e-4 * np.abs(f64(rs)).max())
    # integer weights have no derivative (float0), as jax's rules
    gw = jax.grad(lambda w: jnp.sum(nvc.ragged_dot(lhs, w, sizes).astype(jnp.float32)),
                  allow_int=True)(rhs)
    assert gw.dtype == jax.dtypes.float0
    # vmap: one call per batch element
    xs = jnp.stack([lhs, -lhs])
    ys = jax.jit(jax.vmap(lambda a: nvc.ragged_dot(a, rhs, sizes, rhs_scale=scale,
                                                   preferred_element_type=jnp.float32)))(xs)
    for i in range(2):
        want = np_ref(xs[i], rhs, sizes, scale, 1)
        np.testing.assert_allclose(f64(ys[i]), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_fixable_fallback_warns_float32_lhs(rng):
    lhs = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    rhs = weights(rng, "int8", (2, 16, 8))
    sizes = jnp.asarray([3, 5], jnp.int32)
    with pytest.warns(UserWarning, match=r"float32 x int8 .*8-bit weights take bfloat16"):
        got = rd.ragged_dot(lhs, rhs, sizes, strategy="kernel")
    np.testing.assert_allclose(f64(got), np_ref(lhs, rhs, sizes), rtol=1e-5, atol=1e-4)
    assert rd.select_ragged_dot_strategy((8, 16), (2, 16, 8), jnp.bfloat16, rhs_dtype=jnp.int8,
                                         platform="cpu") == "kernel"


def test_bad_inputs(rng):
    lhs = jnp.asarray(rng.standard_normal((8, 256)), jnp.bfloat16)
    rhs = weights(rng, "fp8", (2, 256, 136))
    sizes = jnp.asarray([3, 5], jnp.int32)
    with pytest.raises(ValueError, match=re.escape(
            "ragged_dot: rhs_scale: expected [G, N] = [2, 136] or [G, ceil(K/128), "
            "ceil(N/128)] = [2, 2, 2], got [2, 256]")):
        nvc.ragged_dot(lhs, rhs, sizes, rhs_scale=jnp.ones((2, 256)))
    with pytest.raises(TypeError, match="rhs_scale: expected a float dtype, got int32"):
        nvc.ragged_dot(lhs, rhs, sizes, rhs_scale=jnp.ones((2, 136), jnp.int32))
    with pytest.raises(TypeError, match="rhs_scale: expected None for rhs of dtype bfloat16"):
        nvc.ragged_dot(lhs, rhs.astype(jnp.bfloat16), sizes, rhs_scale=jnp.ones((2, 136)))
    with pytest.raises(ValueError, match="gate_scale, up_scale: expected both or neither"):
        rd.ragged_dot_swiglu(lhs, rhs, rhs, sizes, gate_scale=jnp.ones((2, 136)))
    with pytest.raises(ValueError, match=re.escape("up_scale: expected gate_scale's shape "
                                                   "[2, 136], got [2, 2, 2]")):
        rd.ragged_dot_swiglu(lhs, rhs, rhs, sizes, gate_scale=jnp.ones((2, 136)),
                             up_scale=jnp.ones((2, 2, 2)))


def test_host_target_refuses_bad_operands(rng):
    """The host handler's own checks (called directly, past the Python checks)."""
    lhs = jnp.asarray(rng.standard_normal((8, 32)), jnp.bfloat16)
    rhs = weights(rng, "int8", (2, 32, 16))
    sizes = jnp.asarray([3, 5], jnp.int32)
    out = jax.ShapeDtypeStruct((8, 16), jnp.bfloat16)
    call = jax.ffi.ffi_call("nvc_ragged_dot_w8", out)
    with pytest.raises(Exception, match=re.escape(
            "jax_nvcomm: ragged_dot_w8: rhs_scale: expected [2, 16] for scale_mode 1, got "
            "[2, 15]")):
        jax.block_until_ready(call(lhs, rhs, jnp.ones((2, 15), jnp.float32), sizes,
                                   scale_mode=np.int64(1)))
    with pytest.raises(Exception, match=re.escape(
            "jax_nvcomm: ragged_dot_w8: rhs: expected int8 or float8_e4m3fn, got bfloat16")):
        jax.block_until_ready(call(lhs, rhs.astype(jnp.bfloat16), jnp.ones((1,), jnp.float32),
                                   sizes, scale_mode=np.int64(0)))
