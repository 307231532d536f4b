"""nvc.ragged_dot / ragged_dot_swiglu with 8-bit weights (int8, float8_e4m3fn), on 8 CPU devices
(the host backend) or, with JAX_NVCOMM_TEST_GPU=1, a GPU (the CUDA kernel): our custom call
serves them (in the lowered text, no fallback warning; the shapes meet the CUDA kernel's
contract, K and N multiples of 16); equal to lax.ragged_dot on the weights converted to lhs's
dtype and to a float64 numpy reference within the float32 rounding of the K-term sums
(tests/w8_bounds.py: every product exact, the platform's accumulation); per-channel and
per-block scales; empty groups, one group holding every row, rows past the groups zero, a sum
of sizes past M, M a multiple of nothing; swiglu; gradients and vmap against float64; a shape
off the CUDA contract (lax's path with the warning naming it on GPUs, our call on the host);
bad inputs' messages, from Python and from the platform's FFI handler."""
import importlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_nvcomm as nvc
from jax_nvcomm import _warn
from w8_bounds import (F32_UNIT, ON_GPU, PLATFORM, ours, rounded, sum_bound, swiglu_bound,
                       unit)

rd = importlib.import_module("jax_nvcomm.ragged_dot")
W8 = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def weights(rng, kind, shape):
    if kind == "int8":
        return jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
    return jnp.asarray(rng.standard_normal(shape) * 4, jnp.float8_e4m3fn)  # normals, subnormals


def f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def np_ref(lhs, rhs, sizes, scale=None, mode=0):
    """float64: out[r] = lhs[r] @ (rhs[g] * s[g]) for the rows r of group g (negative sizes
    count as 0); later rows 0."""
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


def np_mag(lhs, rhs, sizes, scale=None, mode=0):
    """sum_k |lhs[r, k] * w[g, k, n] * s|: the size of the terms each output sums."""
    return np_ref(np.abs(f64(lhs)), np.abs(f64(rhs)), sizes,
                  None if scale is None else np.abs(f64(scale)), mode)


def within(got, ref, err, what=""):
    d = np.abs(f64(got) - ref)
    bad = np.argwhere(~(d <= err))
    assert bad.size == 0, (f"{what}: {len(bad)} outside the bound, first {bad[0].tolist()}: "
                           f"got {f64(got)[tuple(bad[0])]}, want {ref[tuple(bad[0])]}, bound "
                           f"{err[tuple(bad[0])]}")


def called(fn, *args):
    """Our custom calls in fn's lowered program, by op name (w8_bounds.ours)."""
    return ours(jax.jit(fn).lower(*args).as_text())


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
    m, k, g, n = 37, 96, 5, 80
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = weights(rng, kind, (g, k, n))
    sizes = sizes_of(rng, m, g)
    fn = lambda a, b, c: nvc.ragged_dot(a, b, c, preferred_element_type=pet)  # noqa: E731
    assert called(fn, lhs, rhs, sizes) == ["ragged_dot_w8"]
    got = no_warning(fn, lhs, rhs, sizes)
    assert got.dtype == (dtype if pet is None else jnp.float32) and got.shape == (m, n)
    ref, err32 = np_ref(lhs, rhs, sizes), sum_bound(np_mag(lhs, rhs, sizes), k)
    err = err32 if pet is not None else rounded(err32, ref, dtype)   # one rounding to dtype
    within(got, ref, err, "against float64")
    # lax on the converted weights (exact conversion), float32 result: the same sum in
    # another order, so within err32 of ref too
    want = lax.ragged_dot(lhs, rhs.astype(dtype), sizes, preferred_element_type=jnp.float32)
    within(got, f64(want), err + err32, "against lax")
    assert not np.any(f64(got)[int(sizes.sum()):])


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("mode", [1, 2])
def test_scales_against_float64(rng, kind, mode):
    m, k, g, n = 24, 304, 3, 272   # K and N multiples of 16, off multiples of 128: partial blocks
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = weights(rng, kind, (g, k, n))
    shape = (g, n) if mode == 1 else (g, 3, 3)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, shape) * 1e-2, jnp.float32)
    sizes = jnp.asarray([10, 0, 12], jnp.int32)
    fn = lambda a, b, c, s: nvc.ragged_dot(a, b, c, rhs_scale=s,  # noqa: E731
                                           preferred_element_type=jnp.float32)
    assert called(fn, lhs, rhs, sizes, scale) == ["ragged_dot_w8"]
    got = no_warning(fn, lhs, rhs, sizes, scale)
    within(got, np_ref(lhs, rhs, sizes, scale, mode),
           sum_bound(np_mag(lhs, rhs, sizes, scale, mode), k), "float32 scale")
    assert not np.any(f64(got)[22:])
    # a bf16 scale is taken too (converted to float32, exact)
    s16 = scale.astype(jnp.bfloat16)
    within(jax.jit(fn)(lhs, rhs, sizes, s16), np_ref(lhs, rhs, sizes, s16, mode),
           sum_bound(np_mag(lhs, rhs, sizes, s16, mode), k), "bfloat16 scale")


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_one_group_all_rows_and_sizes_past_m(rng, kind):
    m, k, g, n = 17, 64, 4, 48
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = weights(rng, kind, (g, k, n))
    fn = lambda a, b, c: nvc.ragged_dot(a, b, c, preferred_element_type=jnp.float32)  # noqa
    for sizes in ([0, 0, m, 0], [0, 5, m, 9], [-3, m, 0, 0]):
        sizes = jnp.asarray(sizes, jnp.int32)
        assert called(fn, lhs, rhs, sizes) == ["ragged_dot_w8"]
        got = no_warning(fn, lhs, rhs, sizes)
        ref, err = np_ref(lhs, rhs, sizes), sum_bound(np_mag(lhs, rhs, sizes), k)
        within(got, ref, err, f"sizes {sizes.tolist()}")
        want = lax.ragged_dot(lhs, rhs.astype(jnp.bfloat16), jnp.maximum(sizes, 0),
                              preferred_element_type=jnp.float32)
        within(got, f64(want), 2 * err, f"sizes {sizes.tolist()} against lax")


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_swiglu(rng, kind, mode):
    m, k, g, n = 30, 160, 4, 144
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
    assert called(fn, lhs, wg, wu, sg, su, sizes) == ["ragged_dot_swiglu_w8"]
    got = no_warning(fn, lhs, wg, wu, sg, su, sizes)
    a, b = np_ref(lhs, wg, sizes, sg, mode), np_ref(lhs, wu, sizes, su, mode)
    ea = sum_bound(np_mag(lhs, wg, sizes, sg, mode), k)
    eb = sum_bound(np_mag(lhs, wu, sizes, su, mode), k)
    ref, err = a / (1 + np.exp(-a)) * b, swiglu_bound(a, b, ea, eb)
    within(got, ref, err, "float32 result")
    # bf16 result: the same, rounded once
    got16 = jax.jit(lambda *v: rd.ragged_dot_swiglu(v[0], v[1], v[2], v[5], gate_scale=v[3],
                                                    up_scale=v[4]))(lhs, wg, wu, sg, su, sizes)
    assert got16.dtype == jnp.bfloat16
    within(got16, ref, rounded(err, ref, jnp.bfloat16), "bfloat16 result")


def test_gradient_and_vmap_against_float64(rng):
    """d/dlhs and d/dscale of sum(y ** 2), y = ragged_dot(lhs, w_int8, rhs_scale=s) in float32
    (the kernel's y, lax's tangent rules): against the float64 derivatives 2 y W^T and
    sum over the group's rows of 2 y (lhs @ w), within the float32 sums' rounding, the
    cotangent's possible rounding to bf16 on its way into the transposed product, and the
    lhs gradient's rounding to bf16."""
    m, k, g, n = 12, 32, 3, 16
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = weights(rng, "int8", (g, k, n))
    scale = jnp.asarray(rng.uniform(0.5, 2, (g, n)), jnp.float32)
    sizes = jnp.asarray([4, 0, 7], jnp.int32)
    loss = lambda a, s: jnp.sum(nvc.ragged_dot(  # noqa: E731
        a, rhs, sizes, rhs_scale=s, preferred_element_type=jnp.float32) ** 2)
    ga, gs_ = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, scale)
    assert ga.dtype == jnp.bfloat16 and gs_.dtype == jnp.float32
    # float64: y = z * s (z = lhs @ w per group), ct = 2 y
    x, w, s = f64(lhs), f64(rhs), f64(scale)
    z, mz = np_ref(lhs, rhs, sizes), np_mag(lhs, rhs, sizes)
    y = np_ref(lhs, rhs, sizes, scale, 1)
    ey = 2 * sum_bound(np_mag(lhs, rhs, sizes, scale, 1), k)   # of ct = 2 y, in float32
    ct, ws = 2 * y, w * s[:, None, :]
    ref_a, mag_a, prop_a = np.zeros((m, k)), np.zeros((m, k)), np.zeros((m, k))
    ref_s, mag_s, prop_s = np.zeros((g, n)), np.zeros((g, n)), np.zeros((g, n))
    start = 0
    for e, cnt in enumerate(np.asarray(sizes)):
        r = slice(start, start + int(cnt))
        ref_a[r] = ct[r] @ ws[e].T
        mag_a[r] = np.abs(ct[r]) @ np.abs(ws[e]).T
        prop_a[r] = ey[r] @ np.abs(ws[e]).T
        ref_s[e] = (ct[r] * z[r]).sum(0)
        mag_s[e] = np.abs(ct[r] * z[r]).sum(0)
        prop_s[e] = (ey[r] * np.abs(z[r]) + np.abs(ct[r]) * sum_bound(mz[r], k)).sum(0)
        start += int(cnt)
    err_a = prop_a + (unit(jnp.bfloat16) + 2 * F32_UNIT) * mag_a + sum_bound(mag_a, n)
    within(ga, ref_a, rounded(err_a, ref_a, jnp.bfloat16), "d/dlhs")
    within(gs_, ref_s, prop_s + sum_bound(mag_s, m), "d/dscale")
    assert not np.any(f64(ga)[11:])   # the row past the groups
    # integer weights have no derivative (float0), as jax's rules
    gw = jax.grad(lambda w: jnp.sum(nvc.ragged_dot(lhs, w, sizes).astype(jnp.float32)),
                  allow_int=True)(rhs)
    assert gw.dtype == jax.dtypes.float0
    # vmap: one call per batch element
    xs = jnp.stack([lhs, -lhs])
    ys = jax.jit(jax.vmap(lambda a: nvc.ragged_dot(a, rhs, sizes, rhs_scale=scale,
                                                   preferred_element_type=jnp.float32)))(xs)
    for i in range(2):
        within(ys[i], np_ref(xs[i], rhs, sizes, scale, 1),
               sum_bound(np_mag(xs[i], rhs, sizes, scale, 1), k), f"vmap element {i}")


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_shape_off_the_cuda_contract(rng, kind, monkeypatch):
    """N = 136 (a multiple of 8, not of W8_CUDA_MULTIPLE = 16): the CUDA kernel's contract
    refuses it, the host backend takes any K and N. On a GPU: lax's path (no custom call) with
    the fallback warning naming the reason, which select_ragged_dot_strategy's explanation
    gives too; on CPU devices: our call, no warning. Both equal the float64 reference."""
    m, k, g, n = 21, 96, 3, 136
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = weights(rng, kind, (g, k, n))
    scale = jnp.asarray(rng.uniform(0.5, 2, (g, n)), jnp.float32)
    sizes = jnp.asarray([6, 0, 13], jnp.int32)
    fn = lambda a, b, c, s: nvc.ragged_dot(a, b, c, rhs_scale=s,  # noqa: E731
                                           preferred_element_type=jnp.float32)
    args = (lhs, rhs, sizes, scale)
    wname = jnp.dtype(rhs.dtype).name
    choice = rd.select_ragged_dot_strategy((m, k), (g, k, n), jnp.bfloat16, rhs_dtype=rhs.dtype,
                                           preferred_element_type=jnp.float32,
                                           platform=PLATFORM, explain=True)
    why = f"K {k} or N {n} not a multiple of {rd.W8_CUDA_MULTIPLE}"
    assert rd.W8_CUDA_MULTIPLE == 16
    if ON_GPU:
        assert (choice.strategy, choice.reason.rpartition(": ")[2]) == ("xla", why), choice
        monkeypatch.delenv("JAX_NVCOMM_QUIET", raising=False)
        _warn.reset()
        with pytest.warns(UserWarning, match=re.escape(
                f"ragged_dot [{m}, {k}] x [{g}, {k}, {n}] bfloat16 x {wname} -> float32 takes "
                f"lax.ragged_dot on cuda: {why}")):
            text = jax.jit(fn).lower(*args).as_text()
        assert ours(text) == []
        got = jax.jit(fn)(*args)
    else:
        assert choice.strategy == "kernel", choice
        assert called(fn, *args) == ["ragged_dot_w8"]
        got = no_warning(fn, *args)
    within(got, np_ref(lhs, rhs, sizes, scale, 1),
           sum_bound(np_mag(lhs, rhs, sizes, scale, 1), k))


def test_fixable_fallback_warns_float32_lhs(rng, monkeypatch):
    lhs = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    rhs = weights(rng, "int8", (2, 16, 8))
    sizes = jnp.asarray([3, 5], jnp.int32)
    monkeypatch.delenv("JAX_NVCOMM_QUIET", raising=False)
    _warn.reset()
    with pytest.warns(UserWarning, match=rf"float32 x int8 -> float32 takes lax.ragged_dot on "
                                         rf"{PLATFORM}: .*8-bit weights take bfloat16"):
        # full float32 products on lax's path (no TF32 on GPUs)
        got = rd.ragged_dot(lhs, rhs, sizes, strategy="kernel",
                            precision=lax.Precision.HIGHEST)
    # float32 x int8 products round once each (24 + 8 bits), then the float32 sum
    within(got, np_ref(lhs, rhs, sizes), sum_bound(np_mag(lhs, rhs, sizes), 16 + 1))
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


def test_ffi_handler_refuses_bad_operands(rng):
    """The platform's FFI handler checks its operands itself (called directly, past the Python
    checks; the host and CUDA handlers share one check, ragged_dot_ffi_common.h w8::check)."""
    lhs = jnp.asarray(rng.standard_normal((8, 32)), jnp.bfloat16)
    rhs = weights(rng, "int8", (2, 32, 16))
    sizes = jnp.asarray([3, 5], jnp.int32)

    def call(*operands, mode):
        return jax.block_until_ready(rd._call("ragged_dot_w8", PLATFORM, jnp.bfloat16, lhs,
                                              *operands, sizes, scale_mode=np.int64(mode)))

    with pytest.raises(Exception, match=re.escape(
            "jax_nvcomm: ragged_dot_w8: rhs_scale: expected [2, 16] for scale_mode 1, got "
            "[2, 15]")):
        call(rhs, jnp.ones((2, 15), jnp.float32), mode=1)
    with pytest.raises(Exception, match=re.escape(
            "jax_nvcomm: ragged_dot_w8: rhs: expected int8 or float8_e4m3fn, got bfloat16")):
        call(rhs.astype(jnp.bfloat16), jnp.ones((1,), jnp.float32), mode=0)
    # the same call with good operands runs
    got = call(rhs, jnp.ones((2, 16), jnp.float32), mode=1)
    within(got, np_ref(lhs, rhs, sizes),
           rounded(sum_bound(np_mag(lhs, rhs, sizes), 32), np_ref(lhs, rhs, sizes),
                   jnp.bfloat16))
