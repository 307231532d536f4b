"""References for `all_reduce_rms_norm_quant` (docs/API.md; arithmetic: csrc/common/fp8.h),
written from the definition, shared by tests/test_allreduce_quant.py and tests/gpu/:

- `exact(n32)`: the (q, scale) the definition gives for a float32 normed, in numpy float32 and
  ml_dtypes' round-to-nearest-even float8_e4m3fn conversion: ops given the same float32 normed
  (float32 inputs, where all_reduce_rms_norm returns it unrounded) must match it bit for bit.
- `check(q, scale, n64, err)`: against a float64 normed whose float32 computation may be off by
  up to `err` per element (absolute): the dequantised q * scale within the FP8 rounding bound on
  every element, scale within err of the float64 one, and q equal to ml_dtypes' rounding of the
  float64 quotient wherever that quotient is farther than its error from an e4m3fn rounding
  midpoint (unambiguous elements).
"""
import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
FLOOR = np.float32(448.0 * 2.0 ** -126)  # amax floor: scale >= 2^-126
INV448 = np.float32(1.0 / 448.0)
_ALL = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float64)
_POS = np.unique(_ALL[np.isfinite(_ALL) & (_ALL >= 0)])  # 0 .. 448
MIDPOINTS = (_POS[1:] + _POS[:-1]) / 2


def unit(dtype):
    """Unit roundoff of a float dtype."""
    return float(ml_dtypes.finfo(np.dtype(dtype)).eps) / 2


def exact(n32):
    """(q as float8_e4m3fn, scale float32 [T, 1]) of float32 normed [T, H] by the definition."""
    n32 = np.asarray(n32, np.float32)
    amax = np.abs(n32).max(-1, keepdims=True)  # numpy's max propagates NaN
    m = np.maximum(amax, FLOOR)
    with np.errstate(all="ignore"):
        q = (n32 * (np.float32(448.0) / m)).astype(E4M3)
    return q, (m * INV448).astype(np.float32)


def assert_exact(q, scale, n32):
    q_ref, s_ref = exact(n32)
    np.testing.assert_array_equal(np.asarray(scale, np.float32).view(np.uint32),
                                  s_ref.view(np.uint32))
    qb, rb = np.asarray(q).view(np.uint8), q_ref.view(np.uint8)
    bad = np.argwhere(qb != rb)
    assert bad.size == 0, (f"{len(bad)} q bytes differ, first at {bad[:3].tolist()}: "
                           f"{qb[tuple(bad[0])]:#x} vs {rb[tuple(bad[0])]:#x}")


def normed_err(x_parts, res, w, r64, n64, sum_unit, world):
    """Absolute error bound of a float32 normed [T, H]: the cross-rank sum rounded to the input
    dtype (`sum_unit` = its unit roundoff, 0 when not rounded; up to `world` roundings), float32
    rounding of the sum, add and products, and their effect on the row's rsqrt."""
    sum_abs = np.abs(x_parts).sum(0)
    dr = sum_unit * world * sum_abs + 1e-6 * (sum_abs + np.abs(res))
    rms = np.sqrt(np.mean(r64 * r64, -1, keepdims=True))
    inv = 1.0 / np.maximum(rms, 1e-30)
    return inv * np.abs(w) * dr + np.abs(n64) * (dr.max(-1, keepdims=True) * inv + 1e-6)


def check(q, scale, n64, err, min_unambiguous=0.5):
    """Returns the fraction of elements checked exactly."""
    qf = np.asarray(q).astype(np.float64)
    s = np.asarray(scale, np.float64)
    assert s.shape == (n64.shape[0], 1), s.shape
    assert np.isfinite(qf).all() and np.abs(qf).max() <= 448
    m64 = np.maximum(np.abs(n64).max(-1, keepdims=True), float(FLOOR))
    np.testing.assert_array_less(np.abs(s * 448 - m64), err.max(-1, keepdims=True) + 1e-6 * m64)
    # dequantised: FP8 rounding (relative 2^-4 for normals, 2^-10 * scale for subnormals)
    deq_err = np.abs(qf * s - n64)
    bound = 2.0 ** -4 * np.abs(n64) + 2.0 ** -10 * s + 1.1 * err + 1e-6 * np.abs(n64)
    worst = np.unravel_index(np.argmax(deq_err - bound), n64.shape)
    assert (deq_err <= bound).all(), (worst, deq_err[worst], bound[worst], n64[worst])
    # exact where unambiguous: the float64 quotient is far from every rounding midpoint
    v = n64 / s
    margin = err / s + 1e-6 * np.abs(v)
    a = np.abs(v)
    i = np.clip(np.searchsorted(MIDPOINTS, a), 1, len(MIDPOINTS) - 1)
    dist = np.minimum(np.abs(a - MIDPOINTS[i - 1]), np.abs(a - MIDPOINTS[i]))
    ok = dist > margin
    want = v.astype(E4M3).astype(np.float64)
    bad = np.argwhere(ok & (qf != want))
    assert bad.size == 0, (f"{len(bad)} unambiguous q differ, first {bad[:3].tolist()}: "
                           f"{qf[tuple(bad[0])]} vs {want[tuple(bad[0])]} (v {v[tuple(bad[0])]})")
    frac = float(ok.mean())
    assert frac >= min_unambiguous, f"only {frac:.2f} of the elements were unambiguous"
    return frac
