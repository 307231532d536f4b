"""`ragged_all_to_all` (docs/API.md): `lax.ragged_all_to_all`'s contract on a `Communicator`'s
buffers, the way JAX MoE layers move tokens to their experts and back, on GPUs (NVLink, ranks
sharing a GPU included) and on CPU devices (where XLA has no ragged all-to-all).

Semantics (lax's): with K = len(input_offsets) = k * world, slice i of a rank (rows
input_offsets[i] .. + send_sizes[i] of its operand) goes to rank i // k and lands there at
rows output_offsets[i] .. + send_sizes[i] (the receiver's frame, given by the sender); the
receiver's recv_sizes[r * k + j] is the row count of slice j from rank r. Rows of `output` no
slice lands on keep their values.

Kernels (csrc/common/ragged_layout.h; CUDA csrc/kernels/ragged.cuh, host
csrc/host/ragged_host.cc): one flag-protocol call; every sender pushes each slice's rows
straight into the receiver's landing frame at the slice's output offset, with a header entry
(offset, size) per slice that the receiver checks against its recv_sizes. The result buffer
aliases `output` (XLA input_output_aliases): only the rows slices land on are written.

Where it runs (the same results everywhere):
- the kernel at every output size, on the communicator's buffers as they are (comm.nbytes
  never grows with a call): in ONE round when the output fits the landing frame
  (`_host.ragged_fits`: M rows of output and the slice headers within one flag half,
  M * row bytes <= max_message_bytes; the row bytes of each device's call, in a partially
  manual shard_map its share of a row), else on the CHUNKED path (`chunk_bytes`): each
  sender streams its slices to each receiver in rounds of at most `chunk_bytes` bytes through
  two slots per pair, the receiver copying each landed round into the result and
  acknowledging it. strategy="chunked" takes the chunked path also where one round would do;
- XLA's `lax.ragged_all_to_all` (emulated on CPU: `reference._ragged_all_to_all`) with
  strategy="xla" and on communicators in XLA fallback mode; a call whose slice header alone
  (16 bytes x k x world) leaves no room in a flag half takes it on GPUs and raises a
  ValueError on CPU devices (XLA:CPU has no ragged all-to-all to fall back on).

Transformations:
- derivatives (`_with_gradient`: a custom_jvp; the op is linear in operand and output): its
  tangent is a linear primitive (`_ragged_linear`), the op on the tangents, whose transpose
  is lax's rule, run with this op itself (so on CPUs and on ranks sharing a GPU
  too): the operand's cotangent is ragged_all_to_all of the result's cotangent with the
  roles swapped (input and output offsets exchanged among the ranks, which is one more call
  of this op moving K two-integer rows); the output's cotangent is the result's, zeroed on
  the rows slices land on. Like lax's rule it assumes that the input slices do not overlap
  (an operand row sent twice gets one of the two cotangents). Forward mode where the call is
  traced under jax.jvp itself (jacfwd, check_grads' "fwd", eager or inside a jit:
  `_with_tangents`) makes ONE call whose rows carry primal and tangent. jax.jvp of a program
  traced before (jax.jvp(jax.jit(f))) runs the primitive: a second call per exchange, after
  the primal's and after the previous tangent call (the order token's tangent chains them);
  the next exchange's primal call is not ordered after it (a primal cannot depend on a
  tangent: JAX linearizes jitted programs from the same jvp), which XLA:CPU's concurrent
  executor or a CUDA graph's parallel branches could run in either order: with several
  exchanges in one such program, put the jvp inside the jit.
- axis_index_groups (lax's): one call over the communicator's axis in which the slots of
  ranks outside the caller's group have size 0 (`expand_groups`).
- jax.vmap (`_shard.batching` under the custom_jvp): one call for the whole batch, as lax's
  batching rule does it: the batch is folded into the slices per peer (k -> k * B, offsets
  shifted by b * N and b * M).
- partially manual shard_map (`axis_names` leaving mesh axes to the compiler): the kernel call
  runs through `_shard.per_device`, the dims after the rows split over those axes where they
  divide (docs/API.md, "lax parity").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.interpreters import ad

from . import _ffi, _order, _ragged_linear, _registry, _shard, _warn, reference
from .communicator import Communicator

_STRATEGIES = ("auto", "xla", "chunked")
_INDEX_NAMES = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
_WHAT = "ragged_all_to_all"


def fits(comm, m_rows: int, row_bytes: int, k: int) -> bool:
    """csrc/common/ragged_layout.h ragged_fits: whether a call with an output of m_rows rows of
    row_bytes and k slices per peer goes through the communicator's buffers."""
    return bool(_ffi._host.ragged_fits(int(comm.max_message_bytes), int(comm.world_size),
                                       int(m_rows), int(row_bytes), int(k)))


def chunk_max(comm, k: int) -> int:
    """csrc/common/ragged_layout.h ragged_chunk_max: the largest slot (bytes) of the chunked
    path for k slices per peer on this communicator (0: the slice header alone fills a flag
    half)."""
    return int(_ffi._host.ragged_chunk_max(int(comm.max_message_bytes), int(comm.world_size),
                                           int(k)))


def chunk_bytes(comm, m_rows: int, row_bytes: int, k: int, chunked: bool = False) -> int:
    """The kernel path's chunk_bytes attribute for a call (each device's share of a row): 0,
    the single round, when the output fits the landing frame (`fits`) and `chunked` is not
    asked for; else the chunked path's slot size: the communicator's `ragged_chunk_bytes`
    (rounded down to 256, at most `chunk_max`) or `chunk_max`. -1: no slot fits (k too large
    for the slice header)."""
    if not chunked and fits(comm, m_rows, row_bytes, k):
        return 0
    top = chunk_max(comm, k)
    if top < 256:
        return -1
    want = getattr(comm, "ragged_chunk_bytes", None)
    return top if want is None else max(256, min(top, int(want) // 256 * 256))


def _row_bytes(shape, dtype) -> int:
    return int(np.prod(shape[1:], dtype=np.int64)) * jnp.dtype(dtype).itemsize


def _enough_bytes(comm, k) -> int:
    """The smallest max_message_bytes (a power of two from 4 KiB) whose flag half holds the
    slice header of k slices per peer beside 256-byte slots (the chunked path's least)."""
    need = 4096
    while int(_ffi._host.ragged_chunk_max(need, comm.world_size, k)) < 256:
        need *= 2
    return need


def _too_big(comm, m_rows, row_bytes, k, batch=1):
    """Only the slice header can outgrow the buffers (the chunked path serves any output)."""
    batched = f" (a vmap batch of {batch} folded into one call)" if batch > 1 else ""
    need = _enough_bytes(comm, k)
    return ValueError(
        f"jax_nvcomm: {_WHAT}: the call{batched} does not fit the communicator's buffers: "
        f"k={k} slices per peer over {comm.world_size} ranks need a slice header of "
        f"{16 * k * comm.world_size} bytes, more than a flag half of max_message_bytes="
        f"{comm.max_message_bytes} leaves room for (output of {m_rows} rows x {row_bytes} "
        f"bytes); create the Communicator with max_message_bytes >= {need}. XLA:CPU has no "
        "ragged all-to-all to fall back on (on GPUs such calls take lax.ragged_all_to_all)")


# ---------------------------------------------------------------------------------------------
# argument checks

def check_index(index):
    """The four offset / size arrays checked as lax checks them, in lax's order and words
    (each an integer array, then each rank 1 with a positive size), and brought to one dtype
    the kernels take: int64 when any of them is 64-bit, else int32 (lax takes any integer
    dtypes, mixed; the values are the same)."""
    index = [jnp.asarray(a) for a in index]
    for name, a in zip(_INDEX_NAMES, index):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"jax_nvcomm: {_WHAT} {name} must be integer type. (got "
                             f"{a.dtype}{list(a.shape)})")
    for name, a in zip(_INDEX_NAMES, index):
        if a.ndim != 1 or a.shape[0] < 1:
            raise ValueError(f"jax_nvcomm: {_WHAT} {name} must be rank 1 with positive "
                             f"dimension size, but got shape {a.shape}")
    wide = any(jnp.dtype(a.dtype).itemsize == 8 for a in index)
    dt = jnp.dtype(jnp.int64 if wide else jnp.int32)
    return [a if a.dtype == dt else a.astype(dt) for a in index]


def check_groups(axis_index_groups, world):
    """axis_index_groups as lax takes them (a partition of the axis indices 0 .. world - 1
    into groups of one size), as a tuple of tuples; None stays None."""
    if axis_index_groups is None:
        return None
    try:
        groups = tuple(tuple(int(i) for i in g) for g in axis_index_groups)
    except TypeError:
        raise TypeError(f"jax_nvcomm: {_WHAT}: axis_index_groups must be a sequence of "
                        f"sequences of axis indices, got {axis_index_groups!r}") from None
    flat = sorted(i for g in groups for i in g)
    if not groups or flat != list(range(world)) or len({len(g) for g in groups}) != 1:
        raise ValueError(f"jax_nvcomm: {_WHAT}: axis_index_groups must split the {world} "
                         f"indices of the axis into groups of one size, each index once, got "
                         f"{axis_index_groups!r}")
    return groups


def expand_groups(index, groups, comm):
    """The group-local offset and size arrays ([k * group size]: slot j * k + t for the j-th
    rank of this rank's group) as arrays over the whole axis ([k * world_size]): the slots of
    ranks outside the group have size 0 (and offset 0), so one call over the communicator's
    axis moves exactly what the grouped call moves."""
    W, g = comm.world_size, len(groups[0])
    k = index[0].shape[0] // g
    grp = np.empty(W, np.int32)
    pos = np.empty(W, np.int32)
    for gi, members in enumerate(groups):
        for j, r in enumerate(members):
            grp[r], pos[r] = gi, j
    take = (pos[:, None] * k + np.arange(k)[None, :]).reshape(-1)        # [W * k], static
    me = lax.axis_index(comm.axis_name)
    mine = (jnp.asarray(grp)[me] == jnp.asarray(np.repeat(grp, k)))      # [W * k]
    return [jnp.where(mine, a[take], jnp.zeros((), a.dtype)) for a in index]


def _check_args(operand, output, index, comm, groups=None):
    if not isinstance(comm, Communicator):
        raise TypeError(f"jax_nvcomm: {_WHAT}: comm must be a jax_nvcomm.Communicator, got "
                        f"{type(comm).__name__}")
    operand, output = jnp.asarray(operand), jnp.asarray(output)
    if operand.ndim < 1 or output.ndim < 1:
        raise ValueError(f"jax_nvcomm: {_WHAT}: operand and output must be arrays [N, ...] and "
                         f"[M, ...] (rank >= 1), got shapes {operand.shape} and {output.shape}")
    if operand.dtype != output.dtype:
        raise TypeError(f"jax_nvcomm: {_WHAT}: output must have operand's dtype "
                        f"{operand.dtype}, got {output.dtype}")
    if operand.shape[1:] != output.shape[1:]:
        raise ValueError(f"jax_nvcomm: {_WHAT}: output must have operand's trailing dims "
                         f"{operand.shape[1:]}, got shape {output.shape} (operand "
                         f"{operand.shape})")
    dt = jnp.dtype(operand.dtype)
    bits = (jnp.iinfo(dt).bits if jnp.issubdtype(dt, jnp.integer) and dt != jnp.bool_ else
            jnp.finfo(dt).bits if jnp.issubdtype(dt, jnp.floating) else 8 * dt.itemsize)
    if bits % 8:
        raise TypeError(f"jax_nvcomm: {_WHAT}: operand's dtype must take whole bytes, got "
                        f"{operand.dtype} ({bits} bits)")
    index = check_index(index)
    K = index[0].shape[0]
    for name, a in zip(_INDEX_NAMES[1:], index[1:]):
        if a.shape[0] != K:
            raise ValueError(f"jax_nvcomm: {_WHAT}: {name} must have input_offsets' length {K},"
                             f" got {a.shape[0]}")
    W = comm.world_size if groups is None else len(groups[0])
    what_w = "world_size" if groups is None else "group size"
    if K % W:
        raise ValueError(f"jax_nvcomm: {_WHAT}: the offset and size arrays must hold k * "
                         f"{what_w} entries ({what_w}={W}, k >= 1 slices per peer), got {K}")
    if index[0].dtype == jnp.int32 and max(operand.shape[0], output.shape[0]) >= 2 ** 31:
        raise ValueError(f"jax_nvcomm: {_WHAT}: int32 offsets cannot address {operand.shape[0]}"
                         f" / {output.shape[0]} rows: pass int64 offsets and sizes (x64)")
    return operand, output, index


# ---------------------------------------------------------------------------------------------
# the XLA path and the kernel call

def _xla(operand, output, io, ss, oo, rs, comm):
    """lax.ragged_all_to_all on GPUs, its dense emulation on CPUs (reference.py), per device
    (`_shard.per_device`: its row indexing on per-device arrays)."""
    dims = tuple(range(1, operand.ndim))
    return _shard.per_device(
        comm, lambda *a: (reference.ragged_all_to_all_xla(*a, axis_name=comm.axis_name),),
        (operand, output, io, ss, oo, rs), None, (dims, dims, (), (), (), ()), (dims,))[0]


def _ffi_ragged(comm, chunked, operand, output, io, ss, oo, rs, tok):
    """The one kernel call (FFI target "ragged_all_to_all"): (result aliasing output, token).
    Its chunk_bytes attribute (`chunk_bytes`) from this device's shapes: the single round or
    the chunked path."""
    axis = comm.axis_name
    k = io.shape[0] // comm.world_size
    chunk = chunk_bytes(comm, output.shape[0], _row_bytes(output.shape, output.dtype), k,
                        chunked)
    if chunk < 0:  # _dispatch refused these sizes already
        raise _too_big(comm, output.shape[0], _row_bytes(output.shape, output.dtype), k)
    args = [_shard.varying(a, axis) for a in (operand, output, io, ss, oo, rs)]
    vma = frozenset().union(*map(_shard.vma_of, args))  # the axis included when tracked
    rt = _shard.result_type(args[1], output.shape, output.dtype, vma)
    return _shard.ffi_call(comm, "ragged_all_to_all", rt, *args, order=tok, aliases={1: 0},
                           chunk_bytes=np.int64(chunk))


def _dispatch(comm, kernel, operand, output, io, ss, oo, rs, tok, batch=1):
    """The kernel at every output size (one round when the output fits the landing frame, the
    chunked path else, `chunk_bytes`); only a slice header larger than the buffers (k * W
    slices) takes lax (GPUs) or raises a ValueError (CPU devices). Decided on each device's
    call: its rows are its share of a row (the dims after the rows split over auto mesh axes
    where they divide, as the kernel call splits them)."""
    k = io.shape[0] // comm.world_size
    m = output.shape[0]
    row = _row_bytes(_shard.local_shape(comm, operand, tuple(range(1, operand.ndim))),
                     output.dtype)
    if m == 0 or row == 0:  # nothing can land: the result is output
        return _shard.varying(output, comm.axis_name), tok
    if chunk_bytes(comm, m, row, k) >= 0:
        return kernel(operand, output, io, ss, oo, rs, tok)
    if comm.backend == "host":
        raise _too_big(comm, m, row, k, batch)
    _warn.warn_once(f"jax_nvcomm: {_WHAT}: the slice header of {k} slices per peer over "
                    f"{comm.world_size} ranks does not fit the communicator's buffers "
                    f"(max_message_bytes {comm.max_message_bytes}, >= "
                    f"{_enough_bytes(comm, k)} would): lax.ragged_all_to_all runs instead of "
                    "the kernel")
    return _xla(operand, output, io, ss, oo, rs, comm), tok


def _kernel(comm, chunked=False):
    """The kernel call `(operand, output, io, ss, oo, rs, tok) -> (result, tok)`: per device
    (`_shard.per_device`) and, under jax.vmap, ONE call for the whole batch (`_shard.batching`:
    `fold`). chunked: the chunked path also where one round would do (strategy="chunked")."""
    def call(operand, output, io, ss, oo, rs, tok):
        # per device (partially manual shard_maps): rows move, the dims after them are
        # independent (split over auto mesh axes where they divide), the index arrays whole
        dims = tuple(range(1, operand.ndim))
        return _shard.per_device(comm, lambda *a: _ffi_ragged(comm, chunked, *a),
                                 (operand, output, io, ss, oo, rs), tok,
                                 (dims, dims, (), (), (), ()), (dims,))

    def fold(B, batched, operand, output, io, ss, oo, rs, tok):
        """lax's batching: the batch folds into the slices per peer (k -> k * B)."""
        operand, output = (_shard.batched(B, b, a) for a, b in zip((operand, output), batched))
        N, M = operand.shape[1], output.shape[1]
        io, ss, oo, rs = _shard.fold_slices(
            B, N, M, *(_shard.batched(B, b, a) for a, b in zip((io, ss, oo, rs), batched[2:])),
            _WHAT)
        res, tok = _dispatch(comm, f, operand.reshape((B * N,) + operand.shape[2:]),
                             output.reshape((B * M,) + output.shape[2:]), io, ss, oo, rs, tok,
                             batch=B)
        return (res.reshape((B, M) + res.shape[1:]),), (True,), tok

    f = _shard.batching(call, fold)
    return f


# ---------------------------------------------------------------------------------------------
# gradients

def _exchange(comm, oo, io):
    """all_to_all (tiled) of output_offsets and input_offsets at once, with this op: row
    r * k + j of the result holds (output_offsets, input_offsets) of rank r's slice me * k + j.
    Returns (output_offsets_, input_offsets_) in this receiver's frame."""
    K = io.shape[0]
    k = K // comm.world_size
    pairs = jnp.stack([oo, io], axis=1)                                       # [K, 2]
    i = jnp.arange(K, dtype=io.dtype)
    me = lax.axis_index(comm.axis_name).astype(io.dtype)
    ones = jnp.ones((K,), io.dtype)
    got = ragged_all_to_all(pairs, jnp.zeros_like(pairs), i, ones, me * k + i % k, ones, comm)
    return got[:, 0], got[:, 1]


def _landed(oo_, rs, m_rows):
    """bool [M]: rows that some received slice covers."""
    edge = jnp.zeros((m_rows + 1,), jnp.int32)
    edge = edge.at[oo_].add(1, mode="drop").at[oo_ + rs].add(-1, mode="drop")
    return jnp.cumsum(edge)[:m_rows] > 0


def linear_map(*args, comm, n_rows, transposed):
    """The op's tangent map (`_ragged_linear`): not transposed, (t_operand, t_output, io, ss,
    oo, rs) -> [the op on the tangents]; transposed, (ct, io, ss, oo, rs) -> [d_operand,
    d_output] by lax's rule, run with this op (so on CPUs and ranks sharing a GPU too)."""
    if not transposed:
        t_op, t_out, io, ss, oo, rs = args
        return [ragged_all_to_all(t_op, t_out, io, ss, oo, rs, comm)]
    ct, io, ss, oo, rs = args
    oo_, io_ = _exchange(comm, oo, io)
    zeros = jnp.zeros((n_rows,) + ct.shape[1:], ct.dtype)
    d_operand = ragged_all_to_all(ct, zeros, oo_, rs, io_, ss, comm)
    keep = ~_landed(oo_, rs, ct.shape[0]).reshape((-1,) + (1,) * (ct.ndim - 1))
    return [d_operand, jnp.where(keep, ct, jnp.zeros((), ct.dtype))]


def _with_gradient(comm, kernel, n_rows):
    """The op with its derivatives: a `jax.custom_jvp` whose tangent is the op on the
    tangents as a linear primitive with lax's transpose rule (`_ragged_linear`). Reverse mode
    runs the kernel forward and the transposed exchange backward (the tangent map itself is
    never run); forward mode also works on programs traced before (jax.jvp(jax.jit(f))), where
    a custom_vjp is refused; jax.vmap of either folds into one call per exchange."""
    @jax.custom_jvp
    def op(operand, output, io, ss, oo, rs, tok):
        return _dispatch(comm, kernel, operand, output, io, ss, oo, rs, tok)

    @op.defjvp
    def rule(primals, tangents):
        operand, output, io, ss, oo, rs, tok = primals
        if not jnp.issubdtype(operand.dtype, jnp.inexact):  # integer rows: no tangents
            out, tok = op(*primals)
            return (out, tok), (np.zeros(out.shape, jax.dtypes.float0),
                                _order.zero_tangent(tok))
        # the tangent: the linear primitive, whose transpose the backward pass runs (never
        # the map itself there); in forward mode over a traced program (jax.jvp(jax.jit(f)))
        # it runs, after the primal's call and after the previous tangent call: the order
        # token's tangent carries that chain from call to call
        t_op, t_out = (t.astype(operand.dtype) for t in tangents[:2])
        out, tok = op(*primals)
        t, t_tok = _ragged_linear.tangent(linear_map, comm, n_rows, t_op, t_out, io, ss, oo,
                                          rs, tok + tangents[6])
        return (out, tok), (t, t_tok)

    return op


def _forward_mode(*args) -> bool:
    """Whether the call is traced under forward-mode differentiation (jax.jvp, jacfwd,
    check_grads' "fwd"): an argument is a JVP tracer. A custom_vjp function cannot be
    differentiated forward, so those calls take `_with_tangents`."""
    return any(isinstance(a, ad.JVPTracer) for a in args)


def _with_tangents(op):
    """op (the custom_vjp call) as a custom_jvp function for forward mode: the op is linear in
    (operand, output), so the tangent is the op on the tangents with the same offsets and
    sizes. Primal and tangent rows travel in ONE call (each row carries both: [N, 2, ...]),
    so the kernel calls stay one per op and in program order. The rule's call is the
    custom_vjp one: reverse mode over it (jacfwd of a gradient, ...) keeps working."""
    @jax.custom_jvp
    def fop(operand, output, io, ss, oo, rs, tok):
        return op(operand, output, io, ss, oo, rs, tok)

    @fop.defjvp
    def rule(primals, tangents):
        operand, output, io, ss, oo, rs, tok = primals
        t_op, t_out = tangents[:2]
        if not jnp.issubdtype(operand.dtype, jnp.inexact):  # integer rows: no tangents
            out, tok = op(*primals)
            return (out, tok), (np.zeros(out.shape, jax.dtypes.float0),
                                _order.zero_tangent(tok))
        both, tok = op(jnp.stack([operand, t_op.astype(operand.dtype)], axis=1),
                       jnp.stack([output, t_out.astype(output.dtype)], axis=1),
                       io, ss, oo, rs, tok)
        return (both[:, 0], tok), (both[:, 1], _order.zero_tangent(tok))

    return fop


# ---------------------------------------------------------------------------------------------
# public function

def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      comm=None, *, axis_name=None, axis_index_groups=None,
                      strategy: str = "auto"):
    """`lax.ragged_all_to_all` over `comm`'s axis, on the communicator's buffers.

    Call inside `jax.shard_map` over `comm`'s mesh (a Communicator over one axis of a larger
    mesh exchanges within each group along that axis). Every rank calls with the same shapes.
    With K = len(input_offsets) = k * world_size: slice i of this rank, rows
    operand[input_offsets[i] : input_offsets[i] + send_sizes[i]], goes to rank i // k and is
    written there at rows output_offsets[i] : output_offsets[i] + send_sizes[i] (offsets in the
    RECEIVER's frame, given by the sender); recv_sizes[r * k + j] is the row count this rank
    receives in slice j from rank r (send_sizes must equal `all_to_all(recv_sizes)`, as lax
    requires). Rows of `output` that no slice lands on keep their values; slices that overlap
    in a receiver's output leave those rows unspecified.

    Args:
      operand: [N, ...] rows to send; any dtype of whole bytes (bfloat16, float16, float32,
        float8_e4m3fn, float8_e5m2, int32, ...: rows travel as bytes); 1-D arrays are rows of
        one element.
      output: [M, ...] with operand's dtype and trailing dims: the values the result starts
        from (its buffer is reused for the result where XLA can).
      input_offsets: [K] integers, K a multiple of world_size (k slices per peer; with
        axis_index_groups a multiple of the group size, peers numbered within the group).
      send_sizes: [K] integers.
      output_offsets: [K] integers, in the receivers' frames.
      recv_sizes: [K] integers. The four may have different integer dtypes, as lax takes
        them: they are brought to int64 when one is 64-bit, else to int32 (checked in lax's
        order and words: integer type, then rank 1 with a positive size).
      comm: a `Communicator` over an axis (or a tuple of axes) of the surrounding
        shard_map's mesh; an axis name (a str or tuple of str) here counts as axis_name.
      axis_name: in place of comm (exactly one of the two): the mesh axis or tuple of axes,
        as lax takes it; the communicator is the one registered for it (the innermost
        `jax_nvcomm.communicators` block, or jax_nvcomm.jit's).
      axis_index_groups: as lax's: None, or a partition of the axis indices 0 .. world_size - 1
        into groups of one size; each group exchanges within itself (rank = position in its
        group). Also under jax.vmap (lax refuses that).
      strategy: "auto" (the kernel: one round when the output fits the landing frame, the
        chunked path else), "chunked" (the kernel's chunked path at every size: benchmarks)
        or "xla" (`lax.ragged_all_to_all`; on CPU devices its emulation from dense
        collectives).

    Returns:
      [M, ...] in output's dtype, varying across the axis. Differentiable in operand and output
      (reverse mode, lax's transpose rule; forward mode, also of jitted programs; see the
      module docstring), batched by jax.vmap into one call; in a partially manual shard_map the dims after the rows split over the auto
      mesh axes where they divide.

    Raises:
      TypeError / ValueError: an argument outside the above (naming it, the expected and the
        actual value), a call outside shard_map over the communicator's axis, or, on CPU
        devices, a call whose slice header (16 x k x world bytes) the buffers cannot hold
        (naming the sizes and the max_message_bytes that would hold it).
      JaxRuntimeError (at run time, kernel path): a slice outside operand/output on some rank
        (the error names the rank, the slice and the bound it breaks, the host backend also
        its offsets, size, N and M; its peers report that rank), or
        ranks disagreeing on the sizes (naming the receiver, the sender, the slice and both
        counts); a peer that never arrives fails after the communicator's timeout_s, naming it.
    """
    comm = _registry.resolve(comm, axis_name, what=_WHAT)
    if strategy not in _STRATEGIES:
        raise ValueError(f"jax_nvcomm: {_WHAT}: strategy must be one of {_STRATEGIES}, got "
                         f"{strategy!r}")
    groups = check_groups(axis_index_groups, getattr(comm, "world_size", 0))
    operand, output, index = _check_args(
        operand, output, (input_offsets, send_sizes, output_offsets, recv_sizes), comm, groups)
    _shard.check_context(comm, _WHAT)
    if groups is not None:  # one call over the whole axis, zero-size slots outside the group
        index = expand_groups(index, groups, comm)
    if strategy == "xla" or comm.xla_fallback:
        return _xla(operand, output, *index, comm)
    axis = comm.axis_name
    # operand and output vary over every axis any argument varies over (and the axis), like
    # the result, so that their cotangents come back typed like them (JAX adds the transposes
    # of these casts: psums over the axes they did not vary over)
    vma = _shard.axes(axis).union(*map(_shard.vma_of, [operand, output] + index))
    for a in sorted(vma, key=str):
        operand, output = _shard.varying(operand, a), _shard.varying(output, a)
    op = _with_gradient(comm, _kernel(comm, strategy == "chunked"), operand.shape[0])
    if _forward_mode(operand, output, *index):
        op = _with_tangents(op)
    out, tok = op(operand, output, *index, _order.token(axis))
    _order.record(tok)
    return out
