"""`all_reduce` and `all_reduce_rms_norm` (docs/API.md): sum over the communicator's axis through
the symmetric buffers, optionally fused with the residual add and RMSNorm that follow it.

Gradients: `jax.custom_jvp` whose tangent rule uses `lax.psum` (linear, and JAX transposes it
correctly under both check_vma settings) while the primal runs our kernel.

Inside it, the kernel call is a `custom_vmap` function (`_shard.batching`): under `jax.vmap`
the batch is folded into ONE call (all_reduce: the batch is more elements; the fused ops: more
rows, `fused_call`). Each call runs through `_shard.per_device` (partially manual shard_maps).
The strategy is decided on what one device's call moves: by the public function on its share
of x (`_shard.local_shape`: a split over auto mesh axes makes it smaller), taking XLA's path
without the kernel call when that says "xla", and again in the call (`_pick`), where a vmapped
batch folded in makes the message larger.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _fallback, _order, _registry, _shard, _warn
from .reference import add_rms_norm, rms_norm_reference, xla_all_reduce_rms_norm
from .strategy import select_strategy

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_STRATEGY_CODE = {"oneshot": 0, "twoshot": 1}
MAX_FUSED_HIDDEN = 32768  # csrc/cuda/allreduce.h max_fused_hidden (after padding, below)


def _check_dtype(x, name, what):
    if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
        raise TypeError(f"jax_nvcomm: {what}: {name} must be bfloat16, float16 or float32, got "
                        f"{x.dtype}")


def _resolve(comm, strategy, shape, dtype, what):
    if strategy not in ("auto", "oneshot", "twoshot", "xla"):
        raise ValueError(f"jax_nvcomm: {what}: strategy must be 'auto', 'oneshot', 'twoshot' or "
                         f"'xla', got {strategy!r}")
    nbytes = int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize
    if strategy != "xla" and nbytes > comm.max_message_bytes:
        # API.md: messages larger than max_message_bytes use "xla"; the caller can fix that
        _warn.warn_once(f"jax_nvcomm: {what}: a message of {nbytes} bytes per device exceeds the "
                        f"communicator's max_message_bytes {comm.max_message_bytes}: XLA's "
                        "collective runs instead of the kernel (a Communicator with "
                        f"max_message_bytes >= {nbytes} serves it)")
        return "xla"
    if strategy == "auto":
        return select_strategy(comm, shape, dtype, op=what)
    if strategy == "oneshot" and nbytes > comm.lamport_slot_bytes:
        raise ValueError(f"jax_nvcomm: {what}: strategy='oneshot' takes messages up to "
                         f"{comm.lamport_slot_bytes} bytes on this communicator, got {nbytes}")
    if nbytes == 0:
        return "xla"
    return strategy


def _pick(comm, requested, shape, dtype, what):
    """The strategy of one device's call on `shape`: `_resolve` of the requested one, except
    that a "oneshot" request whose message outgrew the Lamport slot (a vmapped batch folded in:
    without one the public function has refused it) takes what "auto" picks (every strategy
    gives the same bits)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize
    if requested == "oneshot" and nbytes > comm.lamport_slot_bytes:
        requested = "auto"
    return _resolve(comm, requested, shape, dtype, what)


def _local_all_reduce(v, tok, comm, strategy):
    """One device's all-reduce of v (any shape, its own shard): (sum, order token)."""
    strat = _pick(comm, strategy, v.shape, v.dtype, "all_reduce")
    if strat == "xla":
        return lax.psum(v, comm.axis_name), tok
    v2, undo = _as_rows(v)
    out, tok = _kernel_all_reduce(v2, tok, comm, strat)
    return undo(out), tok


def all_reduce_call(comm, strategy):
    """The kernel call of all_reduce, `(v, tok) -> (sum, tok)`, for `strategy` (a name
    `_resolve` takes): per device (`_shard.per_device`, every dim of v independent) and, under
    vmap, once for the whole batch (elementwise: the batch is more elements)."""
    def call(v, tok):
        dims = tuple(range(v.ndim))
        return _shard.per_device(comm, lambda a, t: _local_all_reduce(a, t, comm, strategy),
                                 (v,), tok, (dims,), (dims,))

    def rule(size, batched, v, tok):
        out, tok = f(v, tok)
        return (out,), (True,), tok

    f = _shard.batching(call, rule)
    return f


def _kernel_all_reduce(x2, tok, comm, strategy):
    """x2: [tokens, hidden] with hidden * itemsize % 16 == 0; tok: the order token. Returns
    (the sum, invariant over the axis; the call's order token)."""
    axis = comm.axis_name
    x2 = _shard.varying(x2, axis)
    vma = _shard.vma_of(x2) - _shard.axes(axis)
    rt = _shard.result_type(x2, x2.shape, x2.dtype, vma)
    return _shard.ffi_call(comm, "all_reduce", rt, x2, order=tok,
                           cuda_attrs={"strategy": np.int64(_STRATEGY_CODE[strategy])})


def _as_rows(x):
    """View x as [rows, cols] with cols * itemsize a multiple of 16 bytes (padding the flat
    array when needed). Returns (x2, undo)."""
    item = x.dtype.itemsize
    vec = 16 // item
    if x.ndim >= 1 and x.shape[-1] % vec == 0 and x.shape[-1] > 0:
        return x.reshape(-1, x.shape[-1]), lambda y: y.reshape(x.shape)
    n = x.size
    cols = vec * max(1, min(512, -(-n // vec)))
    rows = -(-n // cols)
    flat = jnp.pad(x.reshape(-1), (0, rows * cols - n))
    return flat.reshape(rows, cols), lambda y: y.reshape(-1)[:n].reshape(x.shape)


def all_reduce(x, comm=None, *, axis_name=None, strategy: str = "auto"):
    """Sum of `x` over the communicator's axis (= `lax.psum(x, comm.axis_name)`).

    Call inside `jax.shard_map` over `comm`'s mesh, one call per device on its local shard.
    Accumulates in float32 in rank order, so the result is bitwise identical on every rank and
    for every strategy. Gradients: the tangent is `lax.psum` of the input tangent.
    On a communicator in XLA fallback mode (`comm.xla_fallback`: groups over several hosts)
    it runs `lax.psum` instead, with the same results.
    Where lax.psum works, this works (docs/API.md, "lax parity"): in a partially manual
    shard_map each device calls the kernel on its share of x (split over the auto mesh axes
    along the first dim they divide, else whole); under jax.vmap the batch is more elements,
    ONE call.

    Args:
      x: the local shard, bfloat16, float16 or float32, any shape.
      comm: a `Communicator` over an axis (or a tuple of axes) of the surrounding
        shard_map's mesh; an axis name (a str or tuple of str) here counts as axis_name.
      axis_name: in place of comm (exactly one of the two): the mesh axis or tuple of axes,
        as lax takes it; the communicator is the one registered for it (the innermost
        `jax_nvcomm.communicators` block, or jax_nvcomm.jit's).
      strategy: "auto" (`select_strategy`, from the static shape, dtype, world size and the
        communicator's tuning table), "oneshot", "twoshot" or "xla" (`lax.psum`). Messages
        larger than `comm.max_message_bytes` use "xla". Sizes are those of each device's call
        (in a partially manual shard_map its share of x).

    Returns:
      An array of x's shape and dtype, invariant across the axis (typed as after `lax.psum`).

    Raises:
      TypeError: x's dtype is not one of the three float types.
      ValueError: a bad strategy, a oneshot message above `comm.lamport_slot_bytes`, a call
        outside shard_map over the communicator's axis, or a communicator of another mesh.
      RuntimeError: the communicator was closed.
    """
    what = "all_reduce"
    comm = _registry.resolve(comm, axis_name, what=what)
    _shard.check_context(comm, what)
    x = jnp.asarray(x)
    _check_dtype(x, "x", what)
    # decided on each device's share of x (all of x unless auto mesh axes split it)
    strat = _resolve(comm, strategy, _shard.local_shape(comm, x, tuple(range(x.ndim))), x.dtype,
                     what)
    if comm.xla_fallback:  # groups beyond one host / peer access: _fallback.py
        return _fallback.all_reduce(x, comm)
    axis = comm.axis_name
    if strat == "xla" or comm.world_size == 1 and x.size == 0:
        return lax.psum(x, axis)

    call = all_reduce_call(comm, strategy)

    @jax.custom_jvp
    def ar(v, tok):
        return call(v, tok)

    @ar.defjvp
    def ar_jvp(primals, tangents):
        (v, tok), (t, _) = primals, tangents
        out, tok = ar(v, tok)
        return (out, tok), (lax.psum(t, axis), _order.zero_tangent(tok))

    out, tok = ar(x, _order.token(axis))
    _order.record(tok)
    return out


def check_fused_args(x, residual, weight, eps, what):
    """The argument checks of the fused ops; returns (x, residual, weight) as arrays and eps as
    a float, or raises naming the argument, the expected and the actual value. A weight of
    another float dtype than x's comes back as float32 (an exact widening: the kernels read a
    float32 weight as it is)."""
    x, residual, weight = jnp.asarray(x), jnp.asarray(residual), jnp.asarray(weight)
    _check_dtype(x, "x", what)
    _check_dtype(residual, "residual", what)
    _check_dtype(weight, "weight", what)
    if x.ndim < 1:
        raise ValueError(f"jax_nvcomm: {what}: x must be [..., hidden], got a scalar")
    if residual.shape != x.shape:
        raise ValueError(f"jax_nvcomm: {what}: residual must have x's shape {x.shape}, got "
                         f"{residual.shape}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"jax_nvcomm: {what}: weight must have shape ({x.shape[-1]},), got "
                         f"{weight.shape}")
    eps = float(eps)
    if not eps >= 0:
        raise ValueError(f"jax_nvcomm: {what}: eps must be >= 0, got {eps}")
    if weight.dtype != x.dtype:
        weight = weight.astype(jnp.float32)
    return x, residual, weight, eps


def padded_cols(hidden: int, dtype) -> int:
    """hidden rounded up to whole 16-byte vectors of dtype: the width of the kernel's rows
    (`pad_cols`)."""
    vec = 16 // jnp.dtype(dtype).itemsize
    return -(-int(hidden) // vec) * vec


def pad_cols(x, residual, weight):
    """x, residual [rows, hidden] and weight [hidden], zero-padded to `padded_cols` columns
    (a no-op when hidden is a multiple of the vector width). The kernels divide the mean
    square by the true width (their norm_hidden), and a zero adds +0.0 to the sum of squares
    (exact), so the padded columns change nothing but come out as zeros, sliced off by the
    caller."""
    hidden = x.shape[-1]
    extra = padded_cols(hidden, x.dtype) - hidden
    if extra == 0:
        return x, residual, weight
    cols = [(0, 0)] * (x.ndim - 1) + [(0, extra)]
    return jnp.pad(x, cols), jnp.pad(residual, cols), jnp.pad(weight, [(0, extra)])


def fused_unfit(x, residual, what) -> str | None:
    """Why a fused call cannot take the kernel (XLA's path then, with a warning), or None."""
    if residual.dtype != x.dtype:
        return (f"residual's dtype {residual.dtype} differs from x's {x.dtype} (the kernel "
                "reads and writes the residual in x's dtype: cast one of them)")
    if padded_cols(x.shape[-1], x.dtype) > MAX_FUSED_HIDDEN:
        return (f"hidden {x.shape[-1]} is above the fused kernel's {MAX_FUSED_HIDDEN} (all_reduce"
                " and XLA's norm, or split the rows' columns)")
    return None


def warn_xla_path(what, why, ops):
    _warn.warn_once(f"jax_nvcomm: {what}: {why}; it runs {ops} in XLA instead of the fused "
                    "kernel (JAX_NVCOMM_QUIET=1 silences this)")


def all_reduce_rms_norm(x, residual, weight, comm=None, *, axis_name=None, eps: float = 1e-6,
                        strategy: str = "auto"):
    """All-reduce fused with the residual add and RMSNorm that follow it, in one device pass.

    r = sum_over_ranks(x) + residual (float32); residual_out = r cast to residual.dtype;
    normed = r * rsqrt(mean(r**2, axis=-1) + eps) * weight, cast to x.dtype. (The CUDA kernels
    round the sum to x.dtype before the add, as `lax.psum` + add does: docs/DESIGN.md "Decisions".)
    On a communicator in XLA fallback mode (`comm.xla_fallback`: groups over several hosts)
    it runs `lax.psum` + XLA's add + RMSNorm instead, with the same results.
    Partially manual shard_map: the rows split over the auto mesh axes where they divide,
    else whole. jax.vmap: with an unbatched weight the batch folds into rows, ONE fused call;
    with a batched weight (or an unbatched x and a batched residual) ONE all_reduce of x, then
    XLA's add + RMSNorm (the "xla" strategy's arithmetic, not fused).

    Shapes and dtypes as model code has them: x [..., hidden] (the leading dims are rows:
    reshaped to [rows, hidden] inside and back); any hidden >= 1 (a width that is not a whole
    number of 16-byte vectors is zero-padded inside to one and sliced back: the mean divides by
    the true hidden, and a zero adds exactly nothing to the sum of squares, so the results are
    those of the unpadded rows); a weight of another float dtype than x's, e.g. float32 norm
    weights with bfloat16 activations, is read by the kernel in float32 as it is (bf16 / f16
    weights widened exactly): normed = x.dtype((r * rsqrt(...)) * float32 weight), the float32
    upcast + float32 weight + cast of JetStream-style norms, except that r is the float32 sum,
    not the residual stream rounded to residual.dtype first (within one rounding of x.dtype).
    What the kernel cannot serve takes XLA's path (psum + add + RMSNorm) with a warning once
    per call site (JAX_NVCOMM_QUIET=1 silences it): a residual of another dtype than x's, a
    padded hidden above 32768, a message above `comm.max_message_bytes`.

    Args:
      x: [..., hidden] partial sums of this rank; bfloat16, float16 or float32.
      residual: x's shape, bfloat16, float16 or float32 (x's dtype for the kernel).
      weight: [hidden] RMSNorm weight, bfloat16, float16 or float32.
      comm: a `Communicator` over an axis (or a tuple of axes) of the surrounding
        shard_map's mesh; an axis name (a str or tuple of str) here counts as axis_name.
      axis_name: in place of comm (exactly one of the two): the mesh axis or tuple of axes,
        as lax takes it; the communicator is the one registered for it (the innermost
        `jax_nvcomm.communicators` block, or jax_nvcomm.jit's).
      eps: >= 0, added to the mean square.
      strategy: as in `all_reduce`.

    Returns:
      (normed, residual_out): normed in x.dtype, residual_out in residual.dtype, both of x's
      shape and invariant across the axis.

    Raises:
      TypeError / ValueError: a dtype, shape, hidden width, eps or strategy outside the above
        (the message names the argument, the expected and the actual value).
    """
    what = "all_reduce_rms_norm"
    comm = _registry.resolve(comm, axis_name, what=what)
    _shard.check_context(comm, what)
    x, residual, weight, eps = check_fused_args(x, residual, weight, eps, what)
    strat = _resolve(comm, strategy, local_rows(comm, x), x.dtype, what)
    if comm.xla_fallback:  # groups beyond one host / peer access: _fallback.py
        return _fallback.all_reduce_rms_norm(x, residual, weight, comm, eps)
    axis = comm.axis_name
    unfit = None if strat == "xla" else fused_unfit(x, residual, what)
    if unfit:
        warn_xla_path(what, unfit, "lax.psum + the add + RMSNorm")
    if strat == "xla" or unfit:  # psum + XLA's own add + RMSNorm
        return xla_all_reduce_rms_norm(x, residual, weight, axis, eps)

    call = fused_call(comm, strategy, eps, _kernel_fused, add_rms_norm, 2, what)

    @jax.custom_jvp
    def fused(v, res, w, tok):
        return call(v, res, w, tok)

    @fused.defjvp
    def fused_jvp(primals, tangents):
        (v, res, w, tok), (dv, dres, dw, _) = primals, tangents
        normed, res_out, tok = fused(v, res, w, tok)
        dr = lax.psum(dv, axis).astype(jnp.float32) + dres.astype(jnp.float32)
        r = res_out.astype(jnp.float32)
        _, dn = jax.jvp(lambda rr, ww: rms_norm_reference(rr, ww, eps), (r, w), (dr, dw))
        return ((normed, res_out, tok),
                (dn.astype(normed.dtype), dr.astype(res_out.dtype), _order.zero_tangent(tok)))

    normed, res_out, tok = fused(x, residual, weight, _order.token(axis))
    _order.record(tok)
    return normed, res_out


def _local_fused(x, res, w, tok, comm, strategy, eps, kernel, finish, what):
    """One device's fused call on x, res [..., tokens, hidden] (its own rows): the leading dims
    fold into rows. Returns (*outs, tok), outs shaped [..., tokens, last dim of the kernel's]."""
    lead, hidden = x.shape[:-1], x.shape[-1]
    x2, r2 = x.reshape(-1, hidden), res.reshape(-1, hidden)
    strat = _pick(comm, strategy, (x2.shape[0], padded_cols(hidden, x2.dtype)), x2.dtype, what)
    if strat == "xla":  # lax.psum, then XLA's add + norm
        outs = finish(lax.psum(x2, comm.axis_name), r2, w, eps)
    else:
        *outs, tok = kernel(x2, r2, w, tok, comm, strat, eps)
    return (*[o.reshape(lead + o.shape[1:]) for o in outs], tok)


def fused_call(comm, strategy, eps, kernel, finish, n_outs, what):
    """The kernel call of a fused op (all_reduce_rms_norm, all_reduce_rms_norm_quant),
    `(x, residual, weight, tok) -> (*outs, tok)`, x and residual [..., tokens, hidden] (rows
    independent: split over auto mesh axes by `_shard.per_device`).

    kernel(x2, r2, w, tok, comm, strategy, eps) -> (*outs, tok) makes the FFI call on
    [rows, hidden]; finish(s, residual, weight, eps) -> outs is XLA's add + norm
    (+ quantisation) of an all-reduced sum s (the "xla" strategy: finish of `lax.psum`);
    n_outs: how many outs (each [rows, ...]); what: the op's name (strategy table row, errors).

    Under vmap (`rule`): an unbatched weight folds the batch into rows, ONE fused call
    (an unbatched residual is broadcast: residual_out is per batch element anyway). A batched
    weight, or an unbatched x with a batched residual: ONE all_reduce of x (batched or not),
    then `finish` in XLA: not fused, same arithmetic as the "xla" strategy."""
    def call(x, res, w, tok):
        rows = tuple(range(x.ndim - 1))
        local = lambda a, b, c, t: _local_fused(a, b, c, t, comm, strategy, eps, kernel,
                                                finish, what)
        return _shard.per_device(comm, local, (x, res, w), tok, (rows, rows, ()),
                                 (rows,) * n_outs)

    def rule(size, batched, x, res, w, tok):
        bx, br, bw = batched
        if bx and not bw:  # fold: the batch is more rows
            *outs, tok = f(x, _shard.batched(size, br, res), w, tok)
            return tuple(outs), (True,) * n_outs, tok
        sum_, tok = all_reduce_call(comm, strategy)(x, tok)
        nd = x.ndim - bx  # dims of one batch element
        if bw:
            w = w.reshape((size,) + (1,) * (nd - 1) + w.shape[-1:])
        outs = [_shard.batched(size, o.ndim > nd, o) for o in finish(sum_, res, w, eps)]
        return tuple(outs), (True,) * n_outs, tok

    f = _shard.batching(call, rule)
    return f


def local_rows(comm, x):
    """The shape of each device's kernel message for the fused ops' x [..., hidden]: the rows
    split over auto mesh axes as `fused_call` splits them (all of x unless they do), the
    columns padded to whole 16-byte vectors (`pad_cols`)."""
    shape = _shard.local_shape(comm, x, tuple(range(x.ndim - 1)))
    return tuple(shape[:-1]) + (padded_cols(shape[-1], x.dtype),)


def fused_result_vmas(x, residual, weight, axis):
    """(x marked varying over `axis`, vma of the normed outputs, vma of residual_out) for the
    fused calls: the sum is invariant over `axis`, the residual and weight bring their own."""
    x = _shard.varying(x, axis)
    vma_res = (_shard.vma_of(x) - _shard.axes(axis)) | _shard.vma_of(residual)
    return x, vma_res | _shard.vma_of(weight), vma_res


def _kernel_fused(x, residual, weight, tok, comm, strategy, eps):
    hidden = x.shape[-1]
    x, residual, weight = pad_cols(x, residual, weight)
    x, vma_norm, vma_res = fused_result_vmas(x, residual, weight, comm.axis_name)
    rt_n = _shard.result_type(x, x.shape, x.dtype, vma_norm)
    rt_r = _shard.result_type(residual, residual.shape, residual.dtype, vma_res)
    (normed, res_out), tok = _shard.ffi_call(
        comm, "all_reduce_rms", (rt_n, rt_r), x, residual, weight, order=tok,
        eps=np.float32(eps), norm_hidden=np.int64(hidden),
        cuda_attrs={"strategy": np.int64(_STRATEGY_CODE[strategy])})
    return normed[:, :hidden], res_out[:, :hidden], tok
