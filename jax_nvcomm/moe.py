"""MoE expert-parallel dispatch / combine (docs/API.md): `MoECommunicator`, `moe_dispatch`,
`moe_combine`, and the `Dispatched` / `MoEHandle` pytrees. The split halves
(`moe_dispatch_send` ...): moe_split.py.

Protocol, buffer layout and handle: csrc/common/moe_layout.h. Per-rank buffer (`nbytes`):
64 KiB + 2 * max_in_flight * align256(max(W * (hdr + T * row), T * K * H * 4)) with
row = align16(H * D) + align16(4 * S) + align16(8 + 8 * min(K, L)) bytes: it scales with
world * max_tokens rows and max_tokens * top_k combine slots, never with num_experts * max_tokens.
Where that exceeds `max_buffer_bytes` (default 256 MiB), the buffer is two bounded slots of
(max_buffer_bytes - 64 KiB) / 2 bytes and each call runs in rounds of as many tokens as a slot
holds (moe_layout.h BOUNDED SLOTS): `nbytes <= max_buffer_bytes` at any max_tokens.

Gradients (custom_vjp): the forward passes run our kernels; the backward passes are written
with XLA collectives (`lax.psum_scatter`, `lax.all_gather`) from the handle, so they need a
backend where XLA's collectives run (not several ranks sharing one GPU).

Every kernel call (here and in moe_split.py) goes through `moe_call`: whole over the auto
axes of a partially manual shard_map (`_shard.per_device`), and a named error under jax.vmap.
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _fallback, _ffi, _inflight, _order, _registry, _shard
from .communicator import _Base, axis_size
from .moe_types import Dispatched, MoEHandle

DEFAULT_MAX_BUFFER_BYTES = 256 << 20  # MoECommunicator(max_buffer_bytes=) default
_PAYLOAD = {jnp.dtype(jnp.float32): 0, jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2,
            jnp.dtype(jnp.float8_e4m3fn): 3}
_Y_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _int(v, name, what, lo=None):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"jax_nvcomm: {what}: {name} must be an int, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise ValueError(f"jax_nvcomm: {what}: {name} must be >= {lo}, got {v}")
    return int(v)


class MoECommunicator(_Base):
    """Symmetric buffers for moe_dispatch / moe_combine over `axis_name`; rank r owns experts
    [r * num_local_experts, (r + 1) * num_local_experts).

    Created outside jit, collectively, like `Communicator` (same transport decision and XLA
    fallback: `xla_fallback`). Per-rank buffer bytes: `nbytes` (module docstring).

    Args:
      mesh, axis_name, backend, timeout_s: as for `Communicator` (a tuple of axes too).
      num_experts: >= 1, divisible by the axis size.
      top_k: experts per token, 1 <= top_k <= min(num_experts, 32).
      max_tokens: static per-rank token capacity (>= 1).
      hidden: token width, a multiple of 8 elements and of 16 bytes.
      dtype: payload dtype: bfloat16, float16, float32 or float8_e4m3fn.
      scale_cols: float32 scales carried with each token (0: none).
      max_in_flight: split sends (`moe_dispatch_send` / `moe_combine_send`) that may be
        outstanding (sent, not yet received) at once: 1, 2 or 4 (default 2: two
        micro-batches).
        The buffer holds 2 * max_in_flight call slots (module docstring).
      max_buffer_bytes: the most buffer bytes per rank (`nbytes <= max_buffer_bytes`; default
        256 MiB; None: no bound, slots that hold a whole call at any size). Where the slots
        for whole calls would exceed it, the buffer is two bounded slots and `moe_dispatch` /
        `moe_combine` run each call in rounds of `dispatch_round_tokens` /
        `combine_round_tokens` tokens (same results); the split halves then need their op in
        one round (else a ValueError names the budget that would do) and allow one
        outstanding send.

    Raises:
      TypeError / ValueError: an argument outside the above (named, with expected and actual
        value), a max_buffer_bytes below one token's rows (the minimum is named); as for
        `Communicator` otherwise.
    """

    _kind = "moe"

    def __init__(self, mesh, axis_name, *, num_experts, top_k, max_tokens, hidden, dtype,
                 scale_cols=0, max_in_flight=2, max_buffer_bytes=DEFAULT_MAX_BUFFER_BYTES,
                 backend="auto", timeout_s=None):
        what = "MoECommunicator"
        self._closed = True
        num_experts = _int(num_experts, "num_experts", what, 1)
        top_k = _int(top_k, "top_k", what, 1)
        max_tokens = _int(max_tokens, "max_tokens", what, 1)
        hidden = _int(hidden, "hidden", what, 1)
        scale_cols = _int(scale_cols, "scale_cols", what, 0)
        max_in_flight = _int(max_in_flight, "max_in_flight", what, 1)
        if max_buffer_bytes is not None:
            max_buffer_bytes = _int(max_buffer_bytes, "max_buffer_bytes", what, 1)
        if max_in_flight not in (1, 2, 4):  # 2 * max_in_flight slots, a power of two
            raise ValueError(f"jax_nvcomm: {what}: max_in_flight must be 1, 2 or 4, got "
                             f"{max_in_flight}")
        try:
            dt = jnp.dtype(dtype)
        except TypeError as e:
            raise TypeError(f"jax_nvcomm: {what}: dtype must be a dtype, got {dtype!r}") from e
        if dt not in _PAYLOAD:
            raise TypeError(f"jax_nvcomm: {what}: dtype must be bfloat16, float16, float32 or "
                            f"float8_e4m3fn, got {dt}")
        world = axis_size(mesh, axis_name)
        if num_experts % world:
            raise ValueError(f"jax_nvcomm: {what}: num_experts must be divisible by the axis "
                             f"size {world}, got {num_experts}")
        if top_k > num_experts:
            raise ValueError(f"jax_nvcomm: {what}: top_k must be <= num_experts "
                             f"({num_experts}), got {top_k}")
        if top_k > 32:
            raise ValueError(f"jax_nvcomm: {what}: top_k must be <= 32, got {top_k}")
        if (hidden * dt.itemsize) % 16 or hidden % 8:
            raise ValueError(f"jax_nvcomm: {what}: hidden must be a multiple of 8 elements and of "
                             f"16 bytes for {dt}, got {hidden}")
        self.num_experts, self.top_k, self.max_tokens = num_experts, top_k, max_tokens
        self.hidden, self.dtype, self.scale_cols = hidden, dt, scale_cols
        self.max_in_flight = max_in_flight
        self.max_buffer_bytes = max_buffer_bytes
        lay = moe_layout(world, num_experts, top_k, max_tokens, hidden, dt, scale_cols,
                         max_in_flight, max_buffer_bytes, what)
        self._layout = lay
        self._slot_bytes = int(lay["slot_bytes"]) if lay["bounded"] else 0
        self._nbytes = int(lay["total"])
        self._setup(mesh, axis_name, backend, self._nbytes, 0, timeout_s,
                    dict(num_experts=num_experts, top_k=top_k, max_tokens=max_tokens,
                         hidden=hidden, dtype=str(dt), scale_cols=scale_cols,
                         max_in_flight=max_in_flight, max_buffer_bytes=max_buffer_bytes),
                    zero_bytes=65536)
        params = [num_experts, top_k, max_tokens, hidden, _PAYLOAD[dt], scale_cols, max_in_flight,
                  self._slot_bytes]
        for slot in self._sym.slots:
            self._sym.mod.set_params(self._id, slot, params)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self._world

    @property
    def nbytes(self) -> int:
        """Bytes of communication buffer held per rank (per device)."""
        return self._nbytes

    @property
    def bounded(self) -> bool:
        """True when the buffer is two bounded slots (calls run in rounds; module docstring)."""
        return self._slot_bytes > 0

    @property
    def dispatch_round_tokens(self) -> int:
        """Source tokens a dispatch round moves (max_tokens: one round)."""
        return int(self._layout["dispatch_round_tokens"])

    @property
    def combine_round_tokens(self) -> int:
        """Destination tokens a combine round moves with a float32 expert_y (max_tokens: one
        round); `combine_rounds_for` gives a 16-bit expert_y's (twice as many per round)."""
        return int(self._layout["combine_round_tokens"])

    @property
    def dispatch_rounds(self) -> int:
        """Rounds of one moe_dispatch (1 unless bounded)."""
        return int(self._layout["dispatch_rounds"])

    @property
    def combine_rounds(self) -> int:
        """Rounds of one moe_combine of a float32 expert_y (1 unless bounded)."""
        return int(self._layout["combine_rounds"])

    def combine_rounds_for(self, dtype) -> int:
        """Rounds of one moe_combine of an expert_y of `dtype` (landing rows of its size)."""
        wide = jnp.dtype(dtype).itemsize == 4
        return int(self._layout["combine_rounds" if wide else "combine_rounds_16"])

    @property
    def split_in_flight(self) -> int:
        """Split sends that may be outstanding: max_in_flight, 1 with bounded slots."""
        return 1 if self.bounded else self.max_in_flight

    def __repr__(self):
        return (f"MoECommunicator(axis={self._axis_name!r}, world_size={self._world}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, "
                f"max_tokens={self.max_tokens}, hidden={self.hidden}, dtype={self.dtype}, "
                f"scale_cols={self.scale_cols}, max_in_flight={self.max_in_flight}, "
                f"max_buffer_bytes={self.max_buffer_bytes}, "
                f"{'rounds=' + str((self.dispatch_rounds, self.combine_rounds)) + ', ' if self.bounded else ''}"
                f"backend={self._backend!r}"
                f"{', closed' if self._closed else ''})")


def moe_layout(world, num_experts, top_k, max_tokens, hidden, dtype, scale_cols, max_in_flight,
               max_buffer_bytes, what="MoECommunicator") -> dict:
    """The buffer layout of a MoECommunicator of these arguments (`_host.moe_layout`'s dict:
    total bytes, slot_bytes, slots, tokens and rounds per call of each op): slots for whole
    calls where they fit max_buffer_bytes (or it is None), else the two bounded slots that do.
    Raises ValueError naming max_buffer_bytes when it cannot hold one token's rows."""
    dt = _PAYLOAD[jnp.dtype(dtype)]
    args = (world, num_experts, top_k, max_tokens, hidden, dt, scale_cols, max_in_flight)
    try:
        full = _ffi._host.moe_layout(*args, 0)
        if max_buffer_bytes is None or full["total"] <= max_buffer_bytes:
            return full
        smallest = full["ctrl_bytes"] + 2 * full["min_slot_bytes"]
        if max_buffer_bytes < smallest:
            raise ValueError(f"max_buffer_bytes must be >= {smallest} (room for one "
                             f"token's rows in each half of the buffer), got {max_buffer_bytes}")
        slot = (max_buffer_bytes - full["ctrl_bytes"]) // 2 // 256 * 256
        return _ffi._host.moe_layout(*args, slot)
    except ValueError as e:
        raise ValueError(f"jax_nvcomm: {what}: {e}") from None


def check_one_round(moe, op, what, y_dtype=jnp.float32):
    """Raise when a split half of `op` ("dispatch" / "combine" of an expert_y of y_dtype)
    would need several rounds: its SEND could not finish before its RECV runs (moe_layout.h
    BOUNDED SLOTS)."""
    rounds = moe.dispatch_rounds if op == "dispatch" else moe.combine_rounds_for(y_dtype)
    if rounds == 1:
        return
    need = moe_layout(moe.world_size, moe.num_experts, moe.top_k, moe.max_tokens, moe.hidden,
                      moe.dtype, moe.scale_cols, moe.max_in_flight, None)["total"]
    raise ValueError(
        f"jax_nvcomm: {what}: the split halves need the call in one round, but this "
        f"communicator's buffer (max_buffer_bytes={moe.max_buffer_bytes}, nbytes={moe.nbytes}) "
        f"takes {rounds} rounds of {op} at max_tokens={moe.max_tokens}: use moe_{op} (fused, "
        f"any number of rounds) or a MoECommunicator with max_buffer_bytes >= {need}")


# ---------------------------------------------------------------------------------------------
# validation

def resolve_moe(moe, axis_name, what, *, max_tokens=None, hidden=None, top_k=None, dtype=None,
                num_local_experts=None):
    """The MoECommunicator of a call: `moe`, or the registered one for `axis_name`
    (`_registry.find`, kind "moe") whose sizes fit the call's arrays (the facts given here;
    None: not checked). Then checks that it is a MoECommunicator."""
    def fits(c):
        return ((max_tokens is None or c.max_tokens == max_tokens)
                and (hidden is None or c.hidden == hidden)
                and (top_k is None or c.top_k == top_k)
                and (dtype is None or c.dtype == jnp.dtype(dtype))
                and (num_local_experts is None or c.num_local_experts == num_local_experts))

    moe = _registry.resolve(moe, axis_name, kind="moe", what=what, accept=fits,
                            comm_name="moe")
    if not isinstance(moe, MoECommunicator):
        raise TypeError(f"jax_nvcomm: {what}: moe must be a MoECommunicator, got "
                        f"{type(moe).__name__}")
    return moe


def _shape(a, i):
    """Dim i of a's shape, None when a has no such dim (the argument checks name it later)."""
    try:
        return np.shape(a)[i]
    except (IndexError, TypeError, ValueError):
        return None


def _check_dispatch_args(x, topk_ids, moe, num_tokens, x_scale, what="moe_dispatch"):
    T, H, K = moe.max_tokens, moe.hidden, moe.top_k
    if x.shape != (T, H):
        raise ValueError(f"jax_nvcomm: {what}: x must have shape (max_tokens, hidden) = "
                         f"({T}, {H}), got {x.shape}")
    if x.dtype != moe.dtype:
        raise TypeError(f"jax_nvcomm: {what}: x must have the communicator's dtype {moe.dtype}, "
                        f"got {x.dtype}")
    if topk_ids.shape != (T, K):
        raise ValueError(f"jax_nvcomm: {what}: topk_ids must have shape (max_tokens, top_k) = "
                         f"({T}, {K}), got {topk_ids.shape}")
    if topk_ids.dtype != jnp.int32:
        raise TypeError(f"jax_nvcomm: {what}: topk_ids must be int32, got {topk_ids.dtype}")
    if moe.scale_cols > 0:
        if x_scale is None:
            raise ValueError(f"jax_nvcomm: {what}: x_scale is required (scale_cols="
                             f"{moe.scale_cols})")
        if x_scale.shape != (T, moe.scale_cols) or x_scale.dtype != jnp.float32:
            raise ValueError(f"jax_nvcomm: {what}: x_scale must be float32 of shape "
                             f"({T}, {moe.scale_cols}), got {x_scale.dtype}{x_scale.shape}")
    elif x_scale is not None:
        raise ValueError(f"jax_nvcomm: {what}: x_scale given but the communicator has "
                         "scale_cols=0")
    if num_tokens is not None:
        if jnp.shape(num_tokens) != () or not jnp.issubdtype(jnp.result_type(num_tokens),
                                                              jnp.integer):
            raise ValueError(f"jax_nvcomm: {what}: num_tokens must be an integer scalar, got "
                             f"{jnp.result_type(num_tokens)}{jnp.shape(num_tokens)}")
        if isinstance(num_tokens, (int, np.integer)) and not 0 <= num_tokens <= T:
            raise ValueError(f"jax_nvcomm: {what}: num_tokens must be in [0, max_tokens={T}], "
                             f"got {num_tokens}")


# ---------------------------------------------------------------------------------------------
# kernel calls

_NO_VMAP = (
    "jax_nvcomm: {what}: jax.vmap is not supported: a MoECommunicator's call carries "
    "max_tokens tokens, and each micro-batch's expert rows are counted and ordered on their "
    "own, so a batch cannot fold into one call. Fold the micro-batches into the tokens (a "
    "communicator with max_tokens = batch * tokens) and call it once, or call it once per "
    "micro-batch (a loop, lax.map, or the split halves to overlap them)")


def moe_call(moe, what, fn):
    """A MoE kernel call `fn(*arrays, tok) -> (*outs, tok)` as the ops call it: per device with
    every argument and result whole over auto mesh axes (`_shard.per_device`: routing
    orders rows across all tokens, so every group along an auto axis makes the same call on
    all of them), and a custom_vmap whose rule refuses vmap with the reason (`_NO_VMAP`)."""
    def call(*args):
        *arrays, tok = args
        return _shard.per_device(moe, fn, tuple(arrays), tok, None, None)

    return _shard.batching(call, _NO_VMAP.format(what=what))


def scales_in(x_scale):
    """The x_scale operands of a dispatch kernel function: none when there are no scales (a
    zero-size operand is made inside: passed into a nested shard_map, jax 0.11's partitioner
    crashes on it)."""
    return () if x_scale is None else (x_scale,)


def scales_of(moe, rest):
    """(x_scale, tok) of a dispatch kernel function's trailing operands (`scales_in`, token)."""
    *scale, tok = rest
    return (scale[0] if scale else jnp.zeros((moe.max_tokens, moe.scale_cols), jnp.float32),
            tok)


def packed_rows(moe) -> int:
    """Rows of a packed expert_x (csrc/common/moe_layout.h PACKED EXPERT ROWS): a token
    reaches at most min(top_k, L) local experts, so W * T * min(K, L) rows hold any routing."""
    return moe.world_size * moe.max_tokens * min(moe.top_k, moe.num_local_experts)


def _dispatch_kernel(x, topk_ids, nt, *rest, moe, packed=False):
    """The dispatch kernel call on (x, topk_ids, nt, *scales_in(x_scale), tok): (expert_x,
    counts, expert_x_scale, token_dest, expert_src, the call's order token). packed:
    expert_x [P, H] and expert_x_scale [P, S] in the packed form (`packed_rows`: the rows of
    local expert e at [sum(counts[:e]), sum(counts[:e + 1])), lax.ragged_dot's lhs form)."""
    axis = moe.axis_name
    W, T, H, K, S = moe.world_size, moe.max_tokens, moe.hidden, moe.top_k, moe.scale_cols
    L, R = moe.num_local_experts, W * T
    scale, tok = scales_of(moe, rest)
    x = _shard.varying(x, axis)  # varies over the axis now, when check_vma tracks it
    vma = _shard.vma_of(x) | _shard.vma_of(topk_ids)
    rt = lambda shape, dt: _shard.result_type(x, shape, dt, vma)
    rows = (packed_rows(moe),) if packed else (L, R)
    results = (rt(rows + (H,), moe.dtype), rt((L,), jnp.int32), rt(rows + (S,), jnp.float32),
               rt((T, K), jnp.int32), rt((L, R), jnp.int32))
    args = [_shard.varying(a, axis) for a in (x, scale, topk_ids, nt)]
    outs, tok = _shard.ffi_call(moe, "moe_dispatch", results, *args, order=tok)
    return (*outs, tok)


def _combine_kernel(expert_y, topk_weights, token_dest, expert_src, counts, tok, *, moe):
    """The combine kernel call: (y, the call's order token). expert_y [L, W*T, H], or packed
    [P, H] (`packed_rows`; the kernels tell the forms apart by the rank)."""
    axis = moe.axis_name
    args = [_shard.varying(a, axis) for a in
            (expert_y, topk_weights, token_dest, expert_src, counts)]
    vma = frozenset().union(*[_shard.vma_of(a) for a in args])
    rt = _shard.result_type(args[0], (moe.max_tokens, moe.hidden), expert_y.dtype, vma)
    return _shard.ffi_call(moe, "moe_combine", rt, *args, order=tok)


# ---------------------------------------------------------------------------------------------
# backward passes (XLA collectives, from the handle)

def _decode_rows(handle, moe):
    """For every expert row (e, i): (valid, src rank, token, k)."""
    T, K = moe.max_tokens, moe.top_k
    R = moe.world_size * T
    code = handle.expert_src
    valid = jnp.arange(R, dtype=jnp.int32)[None, :] < handle.expert_counts[:, None]
    code = jnp.where(valid, code, 0)
    k = code % K
    st = code // K
    return valid, st // T, st % T, k


def _dispatch_cotangents(cts, handle, moe, x, x_scale):
    """(dx, dx_scale) of a dispatch (fused or its receive half) from the cotangents of its
    (expert_x, expert_counts, expert_x_scale): each token's rows summed back to it. A non-float
    or FP8 x gets zeros (no gradient flows into quantised inputs)."""
    float_x = jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != jnp.float8_e4m3fn
    dx = (_rows_to_tokens(cts[0], handle, moe).astype(x.dtype) if float_x
          else jnp.zeros(x.shape, x.dtype))
    return dx, (None if x_scale is None else _rows_to_tokens(cts[2], handle, moe))


def _rows_to_tokens(rows, handle, moe):
    """sum over (e, i) of rows[e, i] into [T, H] at its (src, t), summed over ranks: the
    transpose of 'expert row = x[src][t]'. float32."""
    W, T, H = moe.world_size, moe.max_tokens, rows.shape[-1]
    valid, src, t, _ = _decode_rows(handle, moe)
    vals = jnp.where(valid[..., None], rows.astype(jnp.float32), 0.0)
    flat = (src * T + t).reshape(-1)
    acc = jnp.zeros((W * T, H), jnp.float32).at[flat].add(vals.reshape(-1, H))
    return lax.psum_scatter(acc.reshape(W, T, H), moe.axis_name, scatter_dimension=0, tiled=True
                            ).reshape(T, H)


def _tokens_to_rows(tok, w, handle, moe):
    """expert row (e, i) <- w[src][t, k] * tok[src][t] (all_gather of tok and w)."""
    valid, src, t, k = _decode_rows(handle, moe)
    tok_all = lax.all_gather(tok.astype(jnp.float32), moe.axis_name)  # [W, T, H]
    w_all = lax.all_gather(w.astype(jnp.float32), moe.axis_name)      # [W, T, K]
    rows = tok_all[src, t] * w_all[src, t, k][..., None]
    return jnp.where(valid[..., None], rows, 0.0)


def _combine_grads(ey, w, handle, ct_y, moe):
    """(d expert_y, d topk_weights) of y = combine(ey, w, handle) for the cotangent ct_y."""
    T, K = moe.max_tokens, moe.top_k
    # expert row (e,i) for (src,t,k) gets w[src][t,k] * ct_y[src][t]
    d_ey = _tokens_to_rows(ct_y, w, handle, moe).astype(ey.dtype)
    # d w[t,k] = <ct_y[t], expert_y[row(t,k)]>: computed at the expert side, sent home
    valid, src, t, k = _decode_rows(handle, moe)
    ct_all = lax.all_gather(ct_y.astype(jnp.float32), moe.axis_name)  # [W, T, H]
    dots = jnp.sum(ey.astype(jnp.float32) * ct_all[src, t], axis=-1)
    dots = jnp.where(valid, dots, 0.0)
    W = moe.world_size
    acc = jnp.zeros((W * T * K,), jnp.float32).at[((src * T + t) * K + k).reshape(-1)].add(
        dots.reshape(-1))
    dw = lax.psum_scatter(acc.reshape(W, T * K), moe.axis_name, scatter_dimension=0,
                          tiled=True).reshape(T, K)
    return d_ey, dw


def _check_combine_args(expert_y, topk_weights, moe, what):
    L, R, H, T, K = (moe.num_local_experts, moe.world_size * moe.max_tokens, moe.hidden,
                     moe.max_tokens, moe.top_k)
    if expert_y is not None:
        if expert_y.shape != (L, R, H):
            raise ValueError(f"jax_nvcomm: {what}: expert_y must have shape (num_local_experts, "
                             f"world_size * max_tokens, hidden) = ({L}, {R}, {H}), got "
                             f"{expert_y.shape}")
        if jnp.dtype(expert_y.dtype) not in _Y_DTYPES:
            raise TypeError(f"jax_nvcomm: {what}: expert_y must be bfloat16, float16 or float32, "
                            f"got {expert_y.dtype}")
    if topk_weights is not None and (topk_weights.shape != (T, K)
                                     or topk_weights.dtype != jnp.float32):
        raise ValueError(f"jax_nvcomm: {what}: topk_weights must be float32 of shape "
                         f"(max_tokens, top_k) = ({T}, {K}), got {topk_weights.dtype}"
                         f"{topk_weights.shape}")


# ---------------------------------------------------------------------------------------------
# public functions

def moe_dispatch(x, topk_ids, moe=None, *, axis_name=None, num_tokens=None,
                 x_scale=None) -> Dispatched:
    """Send each token once to every rank that owns one of its top_k experts.

    Rank r owns experts [r * L, (r + 1) * L), L = moe.num_local_experts. A token goes once to
    each destination rank however many of its experts live there.
    On a communicator in XLA fallback mode (`comm.xla_fallback`: groups over several hosts)
    it runs `reference.moe_dispatch_xla` (`lax.ragged_all_to_all`) instead, with the same results.
    Its handle is then an `XlaMoEHandle` (expert_src not filled).
    Partially manual shard_map: every group along the auto mesh axes dispatches all the
    tokens (the routing orders rows across them: nothing splits); jax.vmap raises (below).

    Args:
      x: [max_tokens, hidden] of moe.dtype.
      topk_ids: int32 [max_tokens, top_k]: expert ids in [0, num_experts), distinct in a row;
        -1 marks an unused slot (sent nowhere).
      moe: a `MoECommunicator` over one axis of the surrounding shard_map's mesh.
      axis_name: in place of moe (exactly one of the two): the axis of a registered
        MoECommunicator (`jax_nvcomm.register`) whose max_tokens,
        hidden, top_k and dtype fit x and topk_ids.
      num_tokens: optional int32 scalar (may be traced) in [0, max_tokens]: only rows
        < num_tokens are sent. Default: all.
      x_scale: float32 [max_tokens, scale_cols], required when moe.scale_cols > 0 (e.g. FP8
        block scales), dispatched with the token.

    Returns:
      `Dispatched(expert_x, expert_counts, expert_x_scale, handle)`: expert_x
      [L, world_size * max_tokens, hidden] of moe.dtype, where rows 0 .. expert_counts[e] - 1
      of local expert e hold its tokens in (source rank, source token) order and later rows are
      unspecified; expert_counts int32 [L]; expert_x_scale float32
      [L, world_size * max_tokens, scale_cols] or None; handle, the `MoEHandle` that
      `moe_combine` needs (arrays only: several dispatches may be in flight).

    Raises:
      TypeError / ValueError: shapes or dtypes other than the above, x_scale missing or
        unexpected, a constant num_tokens out of range. Bad ids found on the device fail the
        call on that rank (and its peers at once) with a named error.
      NotImplementedError: under jax.vmap (a call carries max_tokens tokens, each
        micro-batch's rows are counted and ordered on their own): fold the micro-batches into
        the tokens, or call once per micro-batch. The same for moe_combine and the split halves.
    """
    what = "moe_dispatch"
    moe = resolve_moe(moe, axis_name, what, max_tokens=_shape(x, 0), hidden=_shape(x, -1),
                      top_k=_shape(topk_ids, -1), dtype=getattr(x, "dtype", None))
    _shard.check_context(moe, what)
    x, topk_ids = jnp.asarray(x), jnp.asarray(topk_ids)
    x_scale = None if x_scale is None else jnp.asarray(x_scale)
    _check_dispatch_args(x, topk_ids, moe, num_tokens, x_scale)
    if moe.xla_fallback:  # groups beyond one host / peer access: _fallback.py
        return _fallback.moe_dispatch(x, topk_ids, moe, num_tokens, x_scale)
    _inflight.check_fused(moe, what)

    nt = jnp.asarray(moe.max_tokens if num_tokens is None else num_tokens).astype(jnp.int32)

    call = moe_call(moe, what, lambda *a: _dispatch_kernel(*a, moe=moe))

    @jax.custom_vjp
    def dispatch(x, x_scale, ids, nt, tok):
        return call(x, ids, nt, *scales_in(x_scale), tok)

    def fwd(x, x_scale, ids, nt, tok):
        out = dispatch(x, x_scale, ids, nt, tok)
        _, cnt, _, td, es, _ = out
        return out, MoEHandle(td, es, cnt)

    def bwd(handle, cts):
        return (*_dispatch_cotangents(cts, handle, moe, x, x_scale), None, None, None)

    dispatch.defvjp(fwd, bwd)
    ex, cnt, exs, td, es, tok = dispatch(x, x_scale, topk_ids, nt, _order.token(moe.axis_name))
    _order.record(tok)
    return Dispatched(ex, cnt, exs if moe.scale_cols > 0 else None, MoEHandle(td, es, cnt))


def moe_combine(expert_y, topk_weights, handle, moe=None, *, axis_name=None):
    """Send the expert outputs back to their tokens and sum them with the router weights.

    y[t] = sum_k topk_weights[t, k] * expert_y[row of (t, k)], accumulated in float32 in k
    order and cast to expert_y.dtype; rows >= num_tokens are zero, -1 slots add nothing.
    On a communicator in XLA fallback mode (`comm.xla_fallback`: groups over several hosts)
    it runs `reference.moe_combine_xla` instead, with the same results.

    Args:
      expert_y: [L, world_size * max_tokens, hidden] in expert_x's layout; bfloat16, float16 or
        float32.
      topk_weights: float32 [max_tokens, top_k].
      handle: `d.handle` of the `moe_dispatch` whose rows expert_y holds.
      moe: the `MoECommunicator` of that dispatch.
      axis_name: in place of moe: its axis (the registered MoECommunicator that fits the
        arrays' sizes, as for `moe_dispatch`).

    Returns:
      y: [max_tokens, hidden] in expert_y.dtype, varying across the axis.

    Raises:
      TypeError / ValueError: shapes or dtypes other than the above, a handle that is not a
        `MoEHandle`.
      NotImplementedError: under jax.vmap (as moe_dispatch).
    """
    what = "moe_combine"
    moe = resolve_moe(moe, axis_name, what, max_tokens=_shape(topk_weights, 0),
                      top_k=_shape(topk_weights, -1), hidden=_shape(expert_y, -1),
                      num_local_experts=_shape(expert_y, 0))
    if not isinstance(handle, MoEHandle):
        raise TypeError(f"jax_nvcomm: {what}: handle must be the MoEHandle of a moe_dispatch "
                        f"(d.handle), got {type(handle).__name__}")
    _shard.check_context(moe, what)
    expert_y, topk_weights = jnp.asarray(expert_y), jnp.asarray(topk_weights)
    _check_combine_args(expert_y, topk_weights, moe, what)
    if moe.xla_fallback:  # groups beyond one host / peer access: _fallback.py
        return _fallback.moe_combine(expert_y, topk_weights, handle, moe)
    _inflight.check_fused(moe, what)

    call = moe_call(moe, what, lambda *a: _combine_kernel(*a, moe=moe))

    @jax.custom_vjp
    def combine(ey, w, handle, tok):
        return call(ey, w, handle.token_dest, handle.expert_src, handle.expert_counts, tok)

    def fwd(ey, w, handle, tok):
        return combine(ey, w, handle, tok), (ey, w, handle)

    def bwd(res, cts):
        ey, w, handle = res
        d_ey, dw = _combine_grads(ey, w, handle, cts[0], moe)
        none = jax.tree.map(lambda _: None, handle)
        return d_ey, dw, none, None

    combine.defvjp(fwd, bwd)
    y, tok = combine(expert_y, topk_weights, handle, _order.token(moe.axis_name))
    _order.record(tok)
    return y
