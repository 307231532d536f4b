"""Pure-JAX baselines (XLA collectives only) with exactly the semantics of `nvc.moe_dispatch`,
`nvc.moe_combine`, `nvc.all_reduce_rms_norm` and `nvc.ragged_all_to_all` (API.md), plus float64
numpy references.

Used by the benchmark (`python -m jax_nvcomm.bench`), the examples and the tests. The JAX
functions run inside `jax.shard_map` over `axis_name`, one call per device on its local shard,
under either `check_vma` setting, and are differentiable (`jax.grad` to `x`, `expert_y`,
`topk_weights`).

MoE layout (API.md): rank r owns experts [r*L, (r+1)*L), L = num_experts // world.
`expert_x[e, 0:expert_counts[e]]` are the tokens routed to local expert e ordered by
(source rank, source token index); rows past the count are zero here (unspecified in API.md).

How the token exchange works (both impls share everything but the exchange):
  sender:   every valid (token, k) pair gets the key (expert id, token); a stable argsort orders
            the pairs by (destination rank, local expert, token) -> per destination one
            contiguous chunk, inside it one segment per local expert. Counts per (destination,
            local expert) go out first with `lax.all_to_all`.
  exchange: impl="ragged": `lax.ragged_all_to_all` of the sorted pair rows (one copy per
            (token, k) pair: the usual JAX way, and what the DeepEP-style kernels improve on).
            Each destination chunk goes as `ragged_pieces` consecutive updates: XLA's GPU
            kernel (jaxlib 0.11.2) runs one 128-thread block per update and peer, so the
            plain one-update-per-peer call (ragged_pieces=1) copies at a few GB/s (measured
            on H200: 3-4 ms for 15 MB); ~512 updates in all reach NVLink/HBM speed.
            impl="dense":  `lax.all_to_all` of a [world, capacity, hidden] buffer per rank,
            capacity = max_tokens * min(top_k, L) (= max_tokens * top_k whenever top_k <= L):
            a token sends at most min(top_k, L) pairs to one rank, so nothing is ever dropped.
  receiver: a local gather moves the received rows into the expert_x layout.
Combine runs the same exchange backwards and sums the top_k contributions per token in float32
in k order with the router weights, then casts to expert_y's dtype.

XLA:CPU (jaxlib 0.11.2) does not implement `ragged-all-to-all` ("HLO opcode
`ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter"). impl="ragged" therefore goes
through `lax.platform_dependent`: on CPU an emulation built from `lax.all_to_all` of
per-destination chunks padded to the static bound (`_ragged_all_to_all_emulated`; it moves the
same rows to the same places, so results are identical: pure data movement, no arithmetic); on
every other platform (GPU) the real `lax.ragged_all_to_all`.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _shard

__all__ = ["moe_dispatch_xla", "moe_combine_xla", "all_reduce_rms_norm_xla",
           "xla_all_reduce_rms_norm", "rms_norm_reference", "ragged_all_to_all_reference",
           "np_moe_dispatch", "np_moe_combine", "np_moe_rows"]

_IMPLS = ("ragged", "dense")


# ----------------------------------------------------------------------------- helpers
def rms_norm_reference(r, weight, eps):
    """float32 RMSNorm of r (float32) with weight; the math of the fused epilogue."""
    r = r.astype(jnp.float32)
    inv = lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + jnp.float32(eps))
    return r * inv * weight.astype(jnp.float32)


def add_rms_norm(s, residual, weight, eps):
    """Residual add + RMSNorm in float32 of an all-reduced sum s: (normed in s.dtype,
    residual_out in residual.dtype)."""
    r = s.astype(jnp.float32) + residual.astype(jnp.float32)
    return rms_norm_reference(r, weight, eps).astype(s.dtype), r.astype(residual.dtype)


def xla_all_reduce_rms_norm(x, residual, weight, axis, eps):
    """The "xla" strategy of all_reduce_rms_norm (also `all_reduce_rms_norm_xla`):
    lax.psum in x.dtype, then residual add + RMSNorm in float32."""
    return add_rms_norm(lax.psum(x, axis), residual, weight, eps)


def _excl_cumsum(a, axis=0):
    return jnp.cumsum(a, axis=axis) - a


def _as_bits(a):
    """1-byte floats (fp8) travel as uint8: gathers and collectives then only move bytes."""
    if a.dtype.itemsize == 1 and jnp.issubdtype(a.dtype, jnp.floating):
        return lax.bitcast_convert_type(a, jnp.uint8), a.dtype
    return a, None


def _from_bits(a, dtype):
    return a if dtype is None else lax.bitcast_convert_type(a, dtype)


def _take_rows(a, idx):
    """a[idx] along axis 0 with out-of-range indices giving zero rows (gather; its transpose
    is a scatter-add, so gradients flow)."""
    return a.at[idx].get(mode="fill", fill_value=0)


def _a2a(a, axis_name):
    return lax.all_to_all(a, axis_name, 0, 0, tiled=True)


def _ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name, chunk):
    """`lax.ragged_all_to_all` from dense collectives, for platforms without it (XLA:CPU).

    Same result as the real op for updates of at most `chunk` rows (static bound) that land in
    disjoint output regions: every update goes through `lax.all_to_all` padded to `chunk`
    rows, then every output row covered by a received update takes that row, the others keep
    `output`'s value."""
    n = input_offsets.shape[0]                                        # world * updates/peer
    c = jnp.arange(chunk, dtype=jnp.int32)
    rows = jnp.where(c[None, :] < send_sizes[:, None], input_offsets[:, None] + c[None, :],
                     operand.shape[0])
    buf = _take_rows(operand, rows.reshape(-1))                       # [n*chunk, ...]
    got = _a2a(buf, axis_name)                                        # updates by source
    where_to = _a2a(output_offsets, axis_name)                        # their output offsets
    m = jnp.arange(output.shape[0], dtype=jnp.int32)
    hit = (m[None, :] >= where_to[:, None]) & (m[None, :] < (where_to + recv_sizes)[:, None])
    covered = hit.any(axis=0)
    src = jnp.argmax(hit, axis=0).astype(jnp.int32)
    idx = jnp.where(covered, src * chunk + m - where_to[src], n * chunk)
    vals = _take_rows(got, idx)
    mask = covered.reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(mask, vals, output)


def _pieces(offsets, sizes, pieces):
    """Split each chunk (offsets[i], sizes[i]) into `pieces` consecutive near-equal updates:
    ([n * pieces] offsets, [n * pieces] sizes), chunk-major."""
    q = (sizes + pieces - 1) // pieces
    p = jnp.arange(pieces, dtype=jnp.int32)
    start = jnp.minimum(p[None, :] * q[:, None], sizes[:, None])
    size = jnp.minimum(q[:, None], sizes[:, None] - start)
    return (offsets[:, None] + start).reshape(-1), size.reshape(-1)


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                       *, axis_name, chunk, pieces=1):
    """Chunk i of `operand` (input_offsets[i], send_sizes[i]) to rank i at output_offsets[i];
    recv_sizes[s]: rows from rank s. Each chunk travels as `pieces` updates (XLA's GPU kernel
    gives each update one 128-thread block per peer, so one update per peer copies at a few
    GB/s); the real `lax.ragged_all_to_all` where XLA has it, the emulation on CPU."""
    if pieces > 1:
        in_off, send = _pieces(input_offsets, send_sizes, pieces)
        out_off, _ = _pieces(output_offsets, send_sizes, pieces)
        _, recv = _pieces(jnp.zeros_like(recv_sizes), recv_sizes, pieces)
        input_offsets, send_sizes, output_offsets, recv_sizes = in_off, send, out_off, recv
        chunk = -(-chunk // pieces)
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)

    def real(*a):
        return lax.ragged_all_to_all(*a, axis_name=axis_name)

    def emulated(*a):
        return _ragged_all_to_all_emulated(*a, axis_name=axis_name, chunk=chunk)

    return lax.platform_dependent(*args, cpu=emulated, default=real)


def ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name):
    """`lax.ragged_all_to_all`'s semantics from `lax.all_gather` and a scatter: runs on every
    platform (XLA:CPU has no ragged-all-to-all) and shares no code with the emulation above
    or with `nvc.ragged_all_to_all`, so tests can hold either against it.

    Every rank gathers every rank's operand and index arrays; with K = len(input_offsets) and
    k = K // world, slice me * k + j of rank r (rows input_offsets[.] .. + send_sizes[.] of
    r's operand) is written into `output` at rows output_offsets[.] .. (offsets in this
    receiver's frame, given by the sender). Rows no slice lands on keep output's values. The
    row counts are the senders' send_sizes; `recv_sizes` must agree (lax's contract) and is
    not read. Differentiable in operand and output by JAX's autodiff (gather, scatter,
    all_gather), under either check_vma setting: the output's cotangent is zero where slices
    land, and an operand row sent in several slices gets the sum of their cotangents. Each rank
    receives world x N rows: a reference, not a fast path.

    Args:
      operand: [N, ...] rows to send.
      output: [M, ...], same dtype and trailing dims.
      input_offsets, send_sizes, output_offsets, recv_sizes: integer [K], K a multiple of the
        size of axis_name.
      axis_name: the shard_map axis to exchange over.

    Returns:
      [M, ...]: output with the received slices written in.
    """
    del recv_sizes
    W = int(lax.axis_size(axis_name))
    K = int(input_offsets.shape[0])
    if K % W:
        raise ValueError(f"jax_nvcomm.reference: ragged_all_to_all_reference: {K} slices are "
                         f"not a multiple of the size of axis {axis_name!r} ({W})")
    k = K // W
    N, M = int(operand.shape[0]), int(output.shape[0])
    operand = _shard.varying(operand, axis_name)
    output = _shard.varying(output, axis_name)
    idx = jnp.stack([jnp.asarray(a).astype(jnp.int32) for a in
                     (input_offsets, send_sizes, output_offsets)])            # [3, K]
    everyone = lax.all_gather(operand, axis_name)                              # [W, N, ...]
    idx = lax.all_gather(_shard.varying(idx, axis_name), axis_name)            # [W, 3, K]
    mine = lax.dynamic_slice_in_dim(idx, lax.axis_index(axis_name) * k, k, axis=2)
    io, ss, oo = mine[:, 0], mine[:, 1], mine[:, 2]                            # [W, k]
    c = jnp.arange(max(N, 1), dtype=jnp.int32)
    src = jnp.clip(io[:, :, None] + c, 0, max(N - 1, 0))                       # [W, k, N]
    dst = jnp.where(c < ss[:, :, None], oo[:, :, None] + c, M)                 # M: dropped
    if N == 0:
        return output
    rows = everyone[jnp.arange(W)[:, None, None], src]                         # [W, k, N, ...]
    return output.at[dst.reshape(-1)].set(rows.reshape((-1,) + operand.shape[1:]), mode="drop")


def _auto_pieces(world, chunk, ragged_pieces):
    if ragged_pieces is not None:
        p = int(ragged_pieces)
        if p < 1:
            raise ValueError(f"jax_nvcomm.reference: ragged_pieces must be >= 1, got {p}")
        return p
    return max(1, min(chunk, 512 // world))  # ~512 blocks over all peers: HBM/NVLink speed


def ragged_all_to_all_xla(operand, output, input_offsets, send_sizes, output_offsets,
                          recv_sizes, *, axis_name):
    """`lax.ragged_all_to_all(..., axis_name=axis_name)` wherever XLA implements it (GPU), and
    on XLA:CPU, which has no ragged-all-to-all, an emulation from `lax.all_to_all` that moves
    the same rows to the same places (each slice padded to min(operand rows, output rows), so
    it moves world x that many rows per call: a stand-in for tests and CPU runs). 1-byte
    floats travel as uint8, so every bit pattern (NaN payloads of float8_e5m2) arrives.

    Args:
      operand, output, input_offsets, send_sizes, output_offsets, recv_sizes: as
        `lax.ragged_all_to_all` (slices of one call must land in disjoint output rows).
      axis_name: the mapped axis (inside `jax.shard_map`).

    Returns:
      `output` with the received slices written in, as `lax.ragged_all_to_all`.
    """
    chunk = max(1, min(int(operand.shape[0]), int(output.shape[0])))  # no valid slice is longer
    (operand, dt), (output, _) = _as_bits(operand), _as_bits(output)
    res = _ragged_all_to_all(_shard.varying(operand, axis_name), _shard.varying(output, axis_name),
                             input_offsets, send_sizes, output_offsets, recv_sizes,
                             axis_name=axis_name, chunk=chunk)
    return _from_bits(res, dt)


def _num_tokens(num_tokens, max_tokens):
    if num_tokens is None:
        return jnp.int32(max_tokens)
    return jnp.asarray(num_tokens).astype(jnp.int32).reshape(-1)[0]


def _check(x, topk_ids, axis_name, num_experts, impl, what):
    if impl not in _IMPLS:
        raise ValueError(f"jax_nvcomm.reference: {what}: impl must be one of {_IMPLS}, got "
                         f"{impl!r}")
    world = int(lax.axis_size(axis_name))
    if num_experts % world:
        raise ValueError(f"jax_nvcomm.reference: {what}: num_experts ({num_experts}) must be "
                         f"divisible by the size of axis {axis_name!r} ({world})")
    if x is not None and x.ndim != 2:
        raise ValueError(f"jax_nvcomm.reference: {what}: x must be [max_tokens, hidden], got "
                         f"shape {x.shape}")
    if topk_ids.ndim != 2 or (x is not None and topk_ids.shape[0] != x.shape[0]):
        raise ValueError(f"jax_nvcomm.reference: {what}: topk_ids must be [max_tokens, top_k]"
                         f", got shape {topk_ids.shape}")
    return world


# ----------------------------------------------------------------------------- dispatch
def moe_dispatch_xla(x, topk_ids, *, axis_name, num_experts, num_tokens=None, x_scale=None,
                     impl="ragged", ragged_pieces=None):
    """Pure-JAX `nvc.moe_dispatch`: returns (expert_x, expert_counts, expert_x_scale or None,
    handle). `handle` (a dict of int32 arrays) is what `moe_combine_xla` needs; pass the same
    `impl` to both. See the module docstring for the algorithm. `ragged_pieces` (impl="ragged"):
    updates per destination chunk (default: about 512 in all); 1 = one update per peer, the
    plain way, which XLA's GPU kernel copies with one thread block per peer."""
    what = "moe_dispatch_xla"
    x = jnp.asarray(x)
    topk_ids = jnp.asarray(topk_ids)
    W = _check(x, topk_ids, axis_name, num_experts, impl, what)
    T, K = topk_ids.shape
    E = int(num_experts)
    L = E // W
    C = T * min(K, L)          # most pairs one source can send one destination
    R = W * C                  # receive rows
    N = T * K                  # pairs per source
    WT = W * T                 # expert_x rows per local expert

    x = _shard.varying(x, axis_name)
    ids = _shard.varying(topk_ids.astype(jnp.int32), axis_name)
    n = _num_tokens(num_tokens, T)
    tok = jnp.arange(T, dtype=jnp.int32)[:, None]
    valid = (ids >= 0) & (ids < E) & (tok < n)                        # [T, K]
    ids_c = jnp.where(valid, ids, 0)

    # sender: order pairs by (destination, local expert, token) == (expert id, token)
    key = jnp.where(valid, ids_c * T + tok, E * T).reshape(-1)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)           # sorted -> pair
    pos = jnp.zeros((N,), jnp.int32).at[order].set(jnp.arange(N, dtype=jnp.int32))
    pos = pos.reshape(T, K)                                           # pair -> sorted
    send_counts = jnp.zeros((E,), jnp.int32).at[ids_c.reshape(-1)].add(
        valid.reshape(-1).astype(jnp.int32)).reshape(W, L)
    send_sizes = send_counts.sum(1)
    send_off = _excl_cumsum(send_sizes)

    # sizes first: recv_counts[s, e] = pairs source s sends to my local expert e
    recv_counts = _a2a(send_counts, axis_name)
    recv_sizes = recv_counts.sum(1)
    pieces = _auto_pieces(W, C, ragged_pieces)
    if impl == "ragged":
        recv_off = _excl_cumsum(recv_sizes)
        out_off = _a2a(recv_off, axis_name)        # where my chunk lands on each destination
        src_send_off = _a2a(send_off, axis_name)   # where each source's chunk to me starts
        pair_row = pos                             # row of a pair in the returned buffer
    else:
        recv_off = jnp.arange(W, dtype=jnp.int32) * C
        dest = ids_c // L
        pair_row = dest * C + pos - send_off[dest]

    # receiver: expert_x[e, r] <- received row recv_row[e, r]
    counts = recv_counts.sum(0)                                       # [L]
    src_prefix = _excl_cumsum(recv_counts, 0)                         # [W, L]
    seg_start = _excl_cumsum(recv_counts, 1)                          # [W, L]
    r = jnp.arange(WT, dtype=jnp.int32)
    incl = (src_prefix + recv_counts).T                               # [L, W]
    s = jnp.minimum((incl[:, None, :] <= r[None, :, None]).sum(-1), W - 1).astype(jnp.int32)
    e = jnp.arange(L, dtype=jnp.int32)[:, None]
    recv_row = recv_off[s] + seg_start[s, e] + r[None, :] - src_prefix[s, e]
    slot_valid = r[None, :] < counts[:, None]
    recv_row = jnp.where(slot_valid, recv_row, R)                     # [L, WT]
    recv_to_slot = jnp.full((R,), L * WT, jnp.int32).at[recv_row.reshape(-1)].set(
        jnp.arange(L * WT, dtype=jnp.int32), mode="drop")

    def exchange(a):
        """a: [T, cols] per token -> received rows [R, cols] in the receive layout."""
        bits, dt = _as_bits(a)
        if impl == "ragged":
            operand = _take_rows(bits, order // K)                    # [N, cols] sorted pairs
            out = _shard.varying(jnp.zeros((R,) + bits.shape[1:], bits.dtype), axis_name)
            got = _ragged_all_to_all(operand, out, send_off, send_sizes, out_off, recv_sizes,
                                     axis_name=axis_name, chunk=C, pieces=pieces)
        else:
            c = jnp.arange(C, dtype=jnp.int32)
            srt = jnp.minimum(send_off[:, None] + c[None, :], N - 1)
            tok_of = jnp.where(c[None, :] < send_sizes[:, None], order[srt] // K, T)
            got = _a2a(_take_rows(bits, tok_of.reshape(-1)), axis_name)   # [W*C, cols]
        return _take_rows(got, recv_row.reshape(-1)).reshape((L, WT) + bits.shape[1:]), dt

    ex, dt = exchange(x)
    expert_x = _from_bits(ex, dt)
    expert_x_scale = None
    if x_scale is not None:
        x_scale = _shard.varying(jnp.asarray(x_scale).astype(jnp.float32), axis_name)
        if x_scale.ndim != 2 or x_scale.shape[0] != T:
            raise ValueError(f"jax_nvcomm.reference: {what}: x_scale must be [max_tokens "
                             f"({T}), scale_cols], got shape {x_scale.shape}")
        expert_x_scale = exchange(x_scale)[0]
    handle = dict(valid=valid, pair_row=pair_row, recv_to_slot=recv_to_slot,
                  send_off=send_off, send_sizes=send_sizes, recv_off=recv_off,
                  recv_sizes=recv_sizes, src_send_off=src_send_off if impl == "ragged"
                  else send_off)
    return expert_x, counts, expert_x_scale, handle


# ----------------------------------------------------------------------------- combine
def moe_combine_xla(expert_y, topk_weights, handle, *, axis_name, num_experts, impl="ragged",
                    ragged_pieces=None):
    """Pure-JAX `nvc.moe_combine`: y[t] = sum_k topk_weights[t, k] * expert_y[row of (t, k)],
    float32 in k order, cast to expert_y.dtype; rows >= num_tokens and -1 slots give 0.
    `ragged_pieces`: as in `moe_dispatch_xla`."""
    what = "moe_combine_xla"
    expert_y = jnp.asarray(expert_y)
    topk_weights = jnp.asarray(topk_weights)
    valid = handle["valid"]
    W = _check(None, valid, axis_name, num_experts, impl, what)
    T, K = valid.shape
    L = int(num_experts) // W
    C = T * min(K, L)
    N = T * K
    if expert_y.ndim != 3 or expert_y.shape[:2] != (L, W * T):
        raise ValueError(f"jax_nvcomm.reference: {what}: expert_y must be [{L}, {W * T}, "
                         f"hidden], got shape {expert_y.shape}")
    if topk_weights.shape != (T, K):
        raise ValueError(f"jax_nvcomm.reference: {what}: topk_weights must be [{T}, {K}], "
                         f"got shape {topk_weights.shape}")
    H = expert_y.shape[2]
    expert_y = _shard.varying(expert_y, axis_name)
    y_recv = _take_rows(expert_y.reshape(L * W * T, H), handle["recv_to_slot"])   # [R, H]
    if impl == "ragged":
        out = _shard.varying(jnp.zeros((N, H), expert_y.dtype), axis_name)
        back = _ragged_all_to_all(y_recv, out, handle["recv_off"], handle["recv_sizes"],
                                  handle["src_send_off"], handle["send_sizes"],
                                  axis_name=axis_name, chunk=C,
                                  pieces=_auto_pieces(W, C, ragged_pieces))       # [N, H]
    else:
        back = _a2a(y_recv, axis_name)                                             # [W*C, H]
    rows = jnp.where(valid, handle["pair_row"], back.shape[0])
    yk = _take_rows(back, rows.reshape(-1)).reshape(T, K, H).astype(jnp.float32)
    w = topk_weights.astype(jnp.float32)
    acc = jnp.zeros((T, H), jnp.float32)
    for k in range(K):  # float32, k order; a -1 slot is skipped (not even +0.0 added)
        acc = jnp.where(valid[:, k:k + 1], acc + w[:, k:k + 1] * yk[:, k], acc)
    return acc.astype(expert_y.dtype)


# ----------------------------------------------------------------------------- all-reduce
def all_reduce_rms_norm_xla(x, residual, weight, *, axis_name, eps=1e-6):
    """`nvc.all_reduce_rms_norm` the XLA way: `lax.psum(x)` (in x.dtype, as JAX code and the
    "xla" strategy do it: NCCL sums bf16 in bf16), then residual add + RMSNorm in float32.
    Returns (normed in x.dtype, residual_out in residual.dtype)."""
    return xla_all_reduce_rms_norm(x, residual, weight, axis_name, eps)


# ----------------------------------------------------------------------------- numpy (float64)
def np_moe_rows(ids_all, num_tokens_all, num_experts):
    """(valid [W,T,K] bool, row [W,T,K] int: row of pair (s,t,k) inside its expert's block,
    counts [E]) for the routing of a whole job."""
    ids_all = np.asarray(ids_all)
    W, T, K = ids_all.shape
    E = int(num_experts)
    nt = np.broadcast_to(np.asarray(T if num_tokens_all is None else num_tokens_all), (W,))
    valid = (ids_all >= 0) & (ids_all < E) & (np.arange(T)[None, :, None] < nt[:, None, None])
    flat = np.where(valid, ids_all, 0).reshape(W * T, K)
    onehot = np.zeros((W * T, E), np.int64)
    np.add.at(onehot, (np.repeat(np.arange(W * T), K), flat.reshape(-1)),
              valid.reshape(-1).astype(np.int64))
    cum = np.cumsum(onehot, axis=0) - onehot                  # pairs before (s, t), per expert
    row = np.take_along_axis(cum, flat, axis=1).reshape(W, T, K)
    return valid, np.where(valid, row, -1), onehot.sum(0)


def np_moe_dispatch(x_all, ids_all, num_tokens_all, num_experts):
    """float64 reference: x_all [W, T, H] (or [W, T, cols] scales), ids_all [W, T, K],
    num_tokens_all [W] (None: all) -> list over ranks of (expert_x [L, W*T, H] with zeros
    past the counts, counts [L])."""
    x_all = np.asarray(x_all, np.float64)
    W, T, H = x_all.shape
    E = int(num_experts)
    L = E // W
    valid, row, counts = np_moe_rows(ids_all, num_tokens_all, E)
    out = [np.zeros((L, W * T, H)) for _ in range(W)]
    for s, t, k in zip(*np.nonzero(valid)):
        e = int(ids_all[s, t, k])
        out[e // L][e % L, row[s, t, k]] = x_all[s, t]
    return [(out[d], counts[d * L:(d + 1) * L].astype(np.int32)) for d in range(W)]


def np_moe_combine(expert_y_all, topk_weights_all, ids_all, num_tokens_all, num_experts):
    """float64 reference: expert_y_all [W, L, W*T, H], topk_weights_all [W, T, K] ->
    y_all [W, T, H] = sum_k w * expert_y[row of (t, k)] over valid slots (else 0)."""
    ey = np.asarray(expert_y_all, np.float64)
    w = np.asarray(topk_weights_all, np.float64)
    W, T, K = w.shape
    L = int(num_experts) // W
    valid, row, _ = np_moe_rows(ids_all, num_tokens_all, num_experts)
    y = np.zeros((W, T, ey.shape[-1]))
    for s, t, k in zip(*np.nonzero(valid)):
        e = int(ids_all[s, t, k])
        y[s, t] += w[s, t, k] * ey[e // L, e % L, row[s, t, k]]
    return y
