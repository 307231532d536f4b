"""`all_reduce_rms_norm_quant` (docs/API.md): `all_reduce_rms_norm` whose normalised rows come
out as float8_e4m3fn with one float32 scale per token, from the same kernel pass (the
quantising epilogue of csrc/kernels/rmsnorm.cuh; host backend: csrc/host/collectives_host.cc;
the definition both share: csrc/common/fp8.h). The "xla" strategy computes the same in JAX.

Inference only: differentiating through it raises (`NO_GRADIENT`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _order, _registry, _shard
from .allreduce import (_STRATEGY_CODE, _resolve, check_fused_args, fused_call,
                        fused_result_vmas, fused_unfit, local_rows, pad_cols, warn_xla_path)
from .reference import rms_norm_reference

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = np.float32(448.0)  # largest finite float8_e4m3fn
INV_FP8_MAX = np.float32(1.0 / 448.0)  # rounded to float32 once
# amax floor: m = max(amax, AMAX_FLOOR) keeps scale = m * INV_FP8_MAX and 448 / m positive and
# finite (csrc/common/fp8.h, kAmaxFloorBits).
AMAX_FLOOR = np.float32(448.0 * 2.0 ** -126)

NO_GRADIENT = ("jax_nvcomm: all_reduce_rms_norm_quant has no gradient (an inference op: its FP8 "
               "output is not differentiable); differentiate all_reduce_rms_norm instead")


def quantize_rows(normed):
    """(q, scale) of float32 normed [tokens, hidden], as csrc/common/fp8.h defines them:
    m = max(amax(|row|), AMAX_FLOOR) (NaN-propagating), scale = m * INV_FP8_MAX,
    q = float8_e4m3fn(normed * (448 / m)), round to nearest even. Only multiplications per
    element, and one division whose divisor is not a broadcast: XLA rewrites x / broadcast(s)
    into x * broadcast(1 / s), which would not be the kernels' arithmetic."""
    amax = jnp.max(jnp.abs(normed), axis=-1, keepdims=True)
    m = jnp.maximum(amax, AMAX_FLOOR)
    return (normed * (FP8_MAX / m)).astype(FP8_DTYPE), m * INV_FP8_MAX


def xla_all_reduce_rms_norm_quant(x, residual, weight, axis, eps):
    """The "xla" strategy: `lax.psum` in x.dtype, residual add + RMSNorm in float32 (as the
    "xla" strategy of all_reduce_rms_norm), then quantize_rows of the float32 normed."""
    return _add_rms_norm_quant(lax.psum(x, axis), residual, weight, eps)


def _add_rms_norm_quant(s, residual, weight, eps):
    """XLA's add + RMSNorm + quantisation of an all-reduced sum s (the "xla" strategy's
    arithmetic, for a vmapped batched weight): (q, scale, residual_out)."""
    r = s.astype(jnp.float32) + residual.astype(jnp.float32)
    q, scale = quantize_rows(rms_norm_reference(r, weight, eps))
    return q, scale, r.astype(residual.dtype)


def _no_grad(fn):
    f = jax.custom_jvp(fn)

    @f.defjvp
    def _jvp(primals, tangents):
        raise TypeError(NO_GRADIENT)

    return f


def all_reduce_rms_norm_quant(x, residual, weight, comm=None, *, axis_name=None,
                              eps: float = 1e-6,
                              out_dtype=jnp.float8_e4m3fn, strategy: str = "auto"):
    """All-reduce + residual add + RMSNorm + per-token FP8 quantisation, in one device pass.

    r = sum_over_ranks(x) + residual and residual_out = r cast to residual.dtype, exactly as in
    `all_reduce_rms_norm` (same kernels, same bits); normed = r * rsqrt(mean(r**2, -1) + eps) *
    weight in float32, the value `all_reduce_rms_norm` would round to x.dtype, is NOT rounded to
    x.dtype here. Per token (row), each step one float32 operation rounded to nearest even:
      m     = max(amax(|normed|), 448 * 2**-126)   (amax NaN-propagating)
      scale = m * float32(1 / 448)                 (>= 2**-126: never zero or subnormal)
      q     = float8_e4m3fn(normed * (448 / m))    (round to nearest even; |q| <= 448)
    i.e. q = round(normed / scale) up to float32 rounding before the FP8 rounding, and
    q * scale approximates normed (what FP8 GEMMs take as input and row scales) within a
    relative error of about 2**-4 per element (e4m3fn normals; absolute 2**-10 * scale for its
    subnormals). No value saturates: |normed * 448 / m| < 464, which rounds to at most 448.
    Non-finite values: a row whose r holds a NaN or an inf has a NaN normed, so its scale and
    every q of the row are NaN (e4m3fn has no inf); an infinite weight gives scale = inf and
    q = NaN where normed is inf, 0 elsewhere. On a communicator in XLA fallback mode
    (`comm.xla_fallback`) it runs the "xla" strategy. Partially manual shard_map and jax.vmap
    as `all_reduce_rms_norm` (a batched weight: the kernel all-reduce, then XLA's add +
    RMSNorm + quantisation).

    Args:
      x: [..., hidden] partial sums of this rank; bfloat16, float16 or float32; hidden > 0
        (any width: as in `all_reduce_rms_norm`, padded inside and sliced back).
      residual: x's shape, float types as x (x's dtype for the kernel; another runs the "xla"
        strategy with a warning once per call site).
      weight: [hidden] RMSNorm weight, bfloat16, float16 or float32 (another dtype than x's is
        read by the kernel in float32, as in `all_reduce_rms_norm`).
      comm: a `Communicator` over an axis (or a tuple of axes) of the surrounding
        shard_map's mesh; an axis name (a str or tuple of str) here counts as axis_name.
      axis_name: in place of comm (exactly one of the two): the mesh axis or tuple of axes,
        as lax takes it; the communicator is the one registered for it (the innermost
        `jax_nvcomm.communicators` block, or jax_nvcomm.jit's).
      eps: >= 0, added to the mean square.
      out_dtype: jnp.float8_e4m3fn (the only one supported).
      strategy: as in `all_reduce`; "xla" computes the same definition with `lax.psum` and
        XLA's ops.

    Returns:
      (q, scale, residual_out): q float8_e4m3fn of x's shape, scale float32 [..., 1] (one per
      row), residual_out in residual.dtype of x's shape; all invariant across the axis.

    Raises:
      TypeError / ValueError: a dtype, out_dtype, shape, hidden width, eps or strategy outside
        the above (naming the argument, the expected and the actual value).
      TypeError: when differentiated (jax.grad, jax.jvp): it has no gradient.
    """
    what = "all_reduce_rms_norm_quant"
    comm = _registry.resolve(comm, axis_name, what=what)
    _shard.check_context(comm, what)
    try:
        od = jnp.dtype(out_dtype)
    except TypeError:
        od = None
    if od != FP8_DTYPE:
        raise TypeError(f"jax_nvcomm: {what}: out_dtype must be float8_e4m3fn, got {out_dtype!r}")
    x, residual, weight, eps = check_fused_args(x, residual, weight, eps, what)
    if x.shape[-1] == 0:
        raise ValueError(f"jax_nvcomm: {what}: hidden must be > 0, got shape {x.shape}")
    strat = _resolve(comm, strategy, local_rows(comm, x), x.dtype, what)
    axis = comm.axis_name
    unfit = None if strat == "xla" or comm.xla_fallback else fused_unfit(x, residual, what)
    if unfit:
        warn_xla_path(what, unfit, "lax.psum + the add + RMSNorm + quantisation")
    if comm.xla_fallback or strat == "xla" or unfit:
        # XLA fallback (groups beyond one host), "xla", or mixed dtypes (not fused): XLA's ops.
        return _no_grad(lambda v, res, w: xla_all_reduce_rms_norm_quant(v, res, w, axis, eps))(
            x, residual, weight)

    fused = _no_grad(fused_call(comm, strategy, eps, _kernel_fused_quant, _add_rms_norm_quant,
                                3, what))
    q, scale, res_out, tok = fused(x, residual, weight, _order.token(axis))
    _order.record(tok)
    return q, scale, res_out


def _kernel_fused_quant(x, residual, weight, tok, comm, strategy, eps):
    hidden = x.shape[-1]
    x, residual, weight = pad_cols(x, residual, weight)
    x, vma_norm, vma_res = fused_result_vmas(x, residual, weight, comm.axis_name)
    rt_q = _shard.result_type(x, x.shape, FP8_DTYPE, vma_norm)
    rt_s = _shard.result_type(x, (x.shape[0], 1), jnp.float32, vma_norm)
    rt_r = _shard.result_type(residual, residual.shape, residual.dtype, vma_res)
    (q, scale, res_out), tok = _shard.ffi_call(
        comm, "all_reduce_rms_quant", (rt_q, rt_s, rt_r), x, residual, weight, order=tok,
        eps=np.float32(eps), norm_hidden=np.int64(hidden),
        cuda_attrs={"strategy": np.int64(_STRATEGY_CODE[strategy])})
    return q[:, :hidden], scale, res_out[:, :hidden], tok
