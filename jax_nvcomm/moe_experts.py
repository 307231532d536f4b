"""The whole routed-expert MoE layer as one op: `moe_layer` (docs/API.md).

What it is today: a composition inside one jitted op, not one fused kernel. Our dispatch
kernel delivers each local expert's tokens packed, in lax.ragged_dot's form: rows
[sum(counts[:e]), sum(counts[:e + 1])) of a [W*T*min(K, L), H] array for local expert e, in
(source rank, token) order (csrc/common/moe_layout.h PACKED EXPERT ROWS); the experts run on
those rows (`expert_rows`: for 16-bit experts nvc.ragged_dot's grouped kernel, gate and up with
SwiGLU in one pass then down; float32 experts lax.ragged_dot); our combine kernel
reads the result rows in the same packed form, sends each back to its token's rank and sums
the top_k rows there with the router weights. No gather or scatter between the parts. On CUDA
every part is a kernel XLA can record into one command buffer (CUDA graph); on CPU devices the
host backend runs the same composition. On a communicator in XLA fallback mode the layer uses
the public moe_dispatch / moe_combine (padded layout) around `expert_block`.

Rounding (every backend): gate and up products accumulate in float32, SwiGLU in float32, its
result rounded to the weights' dtype before the down product (float32 accumulation), each
expert's output row rounded to x's dtype (the bytes combine moves), the top_k rows summed in
float32 in k order and rounded to x's dtype.

Inference only: jax.jvp / jax.grad through it raise `NotImplementedError` naming the composed
path (moe_dispatch + ragged_dot + moe_combine), which has gradients.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import _inflight, _order, _shard
from . import moe as _moe
from . import ragged_dot as _rd
from .moe import MoECommunicator, _check_dispatch_args, moe_combine, moe_dispatch

_LAYER_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

# How the 16-bit experts' gate and up products run, read when a layer is traced: "swiglu" (one
# pass of ragged_dot_swiglu) or "two" (two nvc.ragged_dot with float32 results, SwiGLU in XLA;
# the same rounding). bench/moelayer_layer.py measures both ("layer" / "layer two-dot").
GATE_UP = "swiglu"

_NO_GRAD = (
    "jax_nvcomm: moe_layer is an inference op and has no derivative (jax.grad / jax.jvp / "
    "jax.vjp through it). For training, compose the layer from the differentiable ops: "
    "d = nvc.moe_dispatch(x, topk_ids, moe, num_tokens=n); expert_y = SwiGLU of "
    "d.expert_x[e, :d.expert_counts[e]] with lax.ragged_dot (gate, up, down); "
    "y = nvc.moe_combine(expert_y, topk_weights, d.handle, moe). docs/guide.md, 'MoE', shows "
    "it in full")


def _check_layer_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, moe, what,
                      scales=(None, None, None)):
    T, H, K, L = moe.max_tokens, moe.hidden, moe.top_k, moe.num_local_experts
    if moe.dtype not in _LAYER_DTYPES:
        raise TypeError(f"jax_nvcomm: {what}: the communicator's dtype must be bfloat16, "
                        f"float16 or float32 for the layer, got {moe.dtype}")
    if moe.scale_cols:
        raise ValueError(f"jax_nvcomm: {what}: the communicator must have scale_cols=0 (the "
                         f"layer carries no token scales), got {moe.scale_cols}")
    if topk_weights.shape != (T, K) or topk_weights.dtype != jnp.float32:
        raise ValueError(f"jax_nvcomm: {what}: topk_weights must be float32 of shape "
                         f"(max_tokens, top_k) = ({T}, {K}), got {topk_weights.dtype}"
                         f"{topk_weights.shape}")
    if w_gate.ndim != 3 or w_gate.shape[:2] != (L, H):
        raise ValueError(f"jax_nvcomm: {what}: w_gate must have shape (num_local_experts, "
                         f"hidden, ffn) = ({L}, {H}, F), got {w_gate.shape}")
    F = w_gate.shape[2]
    for name, w, want in (("w_up", w_up, (L, H, F)), ("w_down", w_down, (L, F, H))):
        if w.shape != want:
            raise ValueError(f"jax_nvcomm: {what}: {name} must have shape {want} (w_gate is "
                             f"{w_gate.shape}), got {w.shape}")
    eight = jnp.dtype(w_gate.dtype) in _rd.W8_DTYPES
    if eight and x.dtype not in (jnp.bfloat16, jnp.float16):
        raise TypeError(f"jax_nvcomm: {what}: w_gate: expected x's dtype {x.dtype} (8-bit "
                        f"weights take bfloat16 or float16 x), got {w_gate.dtype}")
    want = w_gate.dtype if eight else x.dtype
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if w.dtype != want:
            raise TypeError(f"jax_nvcomm: {what}: {name} must have "
                            + (f"w_gate's 8-bit dtype {want}" if eight else
                               f"x's dtype {x.dtype}") + f", got {w.dtype}")
    out = []
    for name, w, sc in zip(("w_gate_scale", "w_up_scale", "w_down_scale"),
                           (w_gate, w_up, w_down), scales):
        if sc is not None and not eight:
            raise TypeError(f"jax_nvcomm: {what}: {name}: expected None for weights of "
                            f"dtype {w.dtype} (scales go with int8 or float8_e4m3fn "
                            "weights), got an array")
        out.append(None if sc is None else _rd.check_scale(sc, w.shape, what, name)[0])
    if eight and (out[0] is None) != (out[1] is None):
        raise ValueError(f"jax_nvcomm: {what}: w_gate_scale, w_up_scale: expected both or "
                         "neither")
    return tuple(out)


def expert_rows(xp, counts, w_gate, w_up, w_down, out_dtype, scales=(None, None, None)):
    """SwiGLU experts on packed rows (lax.ragged_dot's form): row r of group e (the rows
    [sum(counts[:e]), sum(counts[:e + 1]))) gives (silu(x W_gate[e]) * (x W_up[e])) W_down[e];
    rows past sum(counts) are unspecified on input and output. Rounding: module docstring.

    Args:
      xp: [P, H], sum(counts) <= P.
      counts: int32 [L].
      w_gate, w_up: [L, H, F]; w_down: [L, F, H], xp's dtype, or all three int8 / all
        float8_e4m3fn (8-bit weights).
      out_dtype: the result's dtype.
      scales: (gate, up, down) scales of 8-bit weights (nvc.ragged_dot's rhs_scale forms),
        each None for none.

    Returns:
      [P, H] of out_dtype.
    """
    if xp.dtype == jnp.float32:  # float32 experts in full float32 (no TF32 on GPUs): lax
        dot = lambda a, w: lax.ragged_dot(a, w, counts,  # noqa: E731
                                          precision=lax.Precision.HIGHEST,
                                          preferred_element_type=jnp.float32)
        h = (jax.nn.silu(dot(xp, w_gate)) * dot(xp, w_up)).astype(w_down.dtype)
        return dot(h, w_down).astype(out_dtype)
    if jnp.dtype(w_gate.dtype) in _rd.W8_DTYPES:
        # 8-bit experts: as the 16-bit ones, with the SwiGLU rounded to xp's dtype (the
        # activations') before the down product
        sg, su, sd = scales
        if GATE_UP == "two":
            h = (jax.nn.silu(_rd.ragged_dot(xp, w_gate, counts, rhs_scale=sg,
                                            preferred_element_type=jnp.float32)) *
                 _rd.ragged_dot(xp, w_up, counts, rhs_scale=su,
                                preferred_element_type=jnp.float32)).astype(xp.dtype)
        else:
            h = _rd.ragged_dot_swiglu(xp, w_gate, w_up, counts, gate_scale=sg, up_scale=su,
                                      preferred_element_type=xp.dtype)
        return _rd.ragged_dot(h, w_down, counts, rhs_scale=sd, preferred_element_type=out_dtype)
    # 16-bit experts: gate and up in one pass of the grouped kernel (SwiGLU rounded once to
    # the weights' dtype), then down rounded once to out_dtype (nvc.ragged_dot's rule picks
    # the kernel or lax by the rows per expert)
    if GATE_UP == "two":
        dot = lambda a, w: _rd.ragged_dot(a, w, counts,  # noqa: E731
                                          preferred_element_type=jnp.float32)
        h = (jax.nn.silu(dot(xp, w_gate)) * dot(xp, w_up)).astype(w_down.dtype)
    else:
        h = _rd.ragged_dot_swiglu(xp, w_gate, w_up, counts,
                                  preferred_element_type=w_down.dtype)
    return _rd.ragged_dot(h, w_down, counts, preferred_element_type=out_dtype)


def expert_block(expert_x, counts, w_gate, w_up, w_down, out_dtype, max_rows=None,
                 scales=(None, None, None)):
    """`expert_rows` on the padded dispatch layout (moe_dispatch's expert_x): expert_y[e, i]
    for x = expert_x[e, i], i < counts[e]; later rows of expert_y are unspecified (combine
    reads only the counted rows). The counted rows are gathered into packed rows, multiplied,
    and gathered back: the layer's path on a communicator in XLA fallback mode, whose dispatch
    delivers only this layout.

    Args:
      expert_x: [L, R, H], rows past counts[e] unspecified (may hold anything, NaN included).
      counts: int32 [L], sum(counts) <= max_rows.
      w_gate, w_up, w_down, out_dtype: as `expert_rows`.
      max_rows: static bound on sum(counts) (default L * R).
      scales: as `expert_rows`.

    Returns:
      expert_y [L, R, H] of out_dtype.
    """
    L, R, H = expert_x.shape
    M = L * R if max_rows is None else min(int(max_rows), L * R)
    ends = jnp.cumsum(counts)
    starts = ends - counts
    p = jnp.arange(M, dtype=jnp.int32)
    e = jnp.minimum(jnp.searchsorted(ends, p, side="right").astype(jnp.int32), L - 1)
    valid = p < ends[-1]
    src = jnp.where(valid, e * R + (p - starts[e]), 0)
    xs = expert_x.reshape(L * R, H)[src]
    xs = jnp.where(valid[:, None], xs, jnp.zeros((), xs.dtype))  # uncounted rows: not NaN
    ys = expert_rows(xs, counts, w_gate, w_up, w_down, out_dtype, scales)
    back = jnp.clip(starts[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :], 0, M - 1)
    return ys[back]


def _layer_kernels(x, ids, w, wg, wu, wd, sc, nt, tok, *, moe):
    """The layer on our kernels: packed dispatch, expert_rows, combine of the packed rows.
    Returns (y, order token)."""
    what = "moe_layer"
    _inflight.check_fused(moe, what)
    dispatch = _moe.moe_call(moe, what, lambda *a: _moe._dispatch_kernel(*a, moe=moe,
                                                                          packed=True))
    combine = _moe.moe_call(moe, what, lambda *a: _moe._combine_kernel(*a, moe=moe))
    xp, counts, _, token_dest, expert_src, tok = dispatch(x, ids, nt.astype(jnp.int32), tok)
    ys = expert_rows(xp, counts, wg, wu, wd, x.dtype, sc)
    y, tok = combine(ys, w, token_dest, expert_src, counts, tok)
    return y, tok


def _layer_fallback(x, ids, w, wg, wu, wd, sc, nt, tok, *, moe):
    """The layer on a communicator in XLA fallback mode: the public ops (which take
    lax.ragged_all_to_all there) around expert_block on their padded layout."""
    _order.record(tok)
    d = moe_dispatch(x, ids, moe, num_tokens=nt)
    ey = expert_block(d.expert_x, d.expert_counts, wg, wu, wd, x.dtype, _moe.packed_rows(moe),
                      sc)
    y = moe_combine(ey, w, d.handle, moe)
    return y, _order.token(moe.axis_name)


def moe_layer(x, topk_ids, topk_weights, w_gate, w_up, w_down, moe=None, *, axis_name=None,
              num_tokens=None, w_gate_scale=None, w_up_scale=None, w_down_scale=None):
    """The routed experts of an MoE layer: dispatch, SwiGLU experts, combine, in one op.

    Call inside `jax.shard_map` over `moe.axis_name`; rank r holds experts
    [r * L, (r + 1) * L), L = moe.num_local_experts. For each token t < num_tokens:
    y[t] = sum_k topk_weights[t, k] * (silu(x[t] W_gate[e]) * (x[t] W_up[e])) W_down[e],
    e = topk_ids[t, k] (on the rank that owns it); -1 ids add nothing; rows >= num_tokens
    are zero. Rounding: module docstring. Composed today (module docstring): the layer runs
    moe_dispatch, `expert_block`, moe_combine in one jitted op, each a kernel on CUDA.

    Args:
      x: [max_tokens, hidden] of moe.dtype (bfloat16, float16 or float32).
      topk_ids: int32 [max_tokens, top_k], expert ids in [0, num_experts), distinct in a row;
        -1 marks an unused slot.
      topk_weights: float32 [max_tokens, top_k].
      w_gate, w_up: [L, hidden, F] of x's dtype: this rank's experts.
      w_down: [L, F, hidden] of x's dtype. 8-bit experts: all three int8 or all three
        float8_e4m3fn with bfloat16 / float16 x (each product as nvc.ragged_dot's with 8-bit
        weights; the SwiGLU result rounded to x's dtype before the down product).
      moe: a `MoECommunicator` over one axis of the surrounding shard_map's mesh, with
        scale_cols=0.
      axis_name: in place of moe (exactly one of the two): the axis of a registered
        MoECommunicator (`jax_nvcomm.register`) whose max_tokens, hidden, top_k, dtype and
        local expert count fit x, topk_ids and w_gate.
      num_tokens: optional int scalar (may be traced) in [0, max_tokens]: only rows
        < num_tokens are routed. Default: all.
      w_gate_scale, w_up_scale, w_down_scale: 8-bit weights only, optional (gate and up:
        both or neither): each weight's float scale as nvc.ragged_dot's rhs_scale, per output
        channel [L, N] or per 128 x 128 block [L, ceil(K/128), ceil(N/128)] of this rank's
        experts (N, K: the matrix's columns and rows).

    Returns:
      [max_tokens, hidden] of x's dtype, varying across the axis.

    Raises:
      TypeError / ValueError: shapes or dtypes other than the above (named, with expected and
        actual value), a communicator with scale_cols or an FP8 dtype.
      NotImplementedError: jax.grad / jax.jvp through it (names the composed path), and
        jax.vmap (as moe_dispatch).
    """
    what = "moe_layer"
    sh = _moe._shape
    moe = _moe.resolve_moe(moe, axis_name, what, max_tokens=sh(x, 0), hidden=sh(x, -1),
                           top_k=sh(topk_ids, -1), dtype=getattr(x, "dtype", None),
                           num_local_experts=sh(w_gate, 0))
    _shard.check_context(moe, what)
    x, topk_ids, topk_weights = (jnp.asarray(a) for a in (x, topk_ids, topk_weights))
    w_gate, w_up, w_down = (jnp.asarray(a) for a in (w_gate, w_up, w_down))
    _check_dispatch_args(x, topk_ids, moe, num_tokens, None, what)
    sc = _check_layer_args(x, topk_ids, topk_weights, w_gate, w_up, w_down, moe, what,
                           (w_gate_scale, w_up_scale, w_down_scale))
    axis = moe.axis_name
    nt = jnp.asarray(moe.max_tokens if num_tokens is None else num_tokens)

    body = _layer_fallback if moe.xla_fallback else _layer_kernels

    @jax.custom_jvp
    def layer(x, ids, w, wg, wu, wd, sc, n, tok):
        # tok: the caller's order token, passed in (a custom_jvp body is a nested trace)
        wg, wu, wd = (_shard.varying(a, axis) for a in (wg, wu, wd))
        sc = tuple(None if a is None else _shard.varying(a, axis) for a in sc)
        return body(x, ids, w, wg, wu, wd, sc, n, tok, moe=moe)

    @layer.defjvp
    def _no_jvp(primals, tangents):
        raise NotImplementedError(_NO_GRAD)

    y, tok = layer(x, topk_ids, topk_weights, w_gate, w_up, w_down, sc, nt,
                   _order.token(axis))
    _order.record(tok)
    return y
