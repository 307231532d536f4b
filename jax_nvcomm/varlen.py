"""`all_gather_v` / `reduce_scatter_v` (docs/API.md): variable-length gather and reduce-scatter
for data-parallel attention in front of a tensor-parallel layer, where every rank holds its own
number of rows (`num_rows <= max_rows`, may be traced).

Kernels (csrc/kernels/varlen.cuh, host: csrc/host/varlen_host.cc): one flag-protocol phase on a
`Communicator`'s buffers. all_gather_v: each rank pushes exactly its `num_rows` rows (and its
count) to its slot in every peer's buffer; each receiver places them at their final offsets
(prefix sums of the counts, in rank order) in the gathered output. reduce_scatter_v: each rank
pushes the rows of segment r of its partial results to rank r's slot [src]; the owner sums them
in float32 in rank order. Bytes moved per rank: its own rows times (world - 1), never the
padding up to max_rows.

XLA path (`lax` collectives, same results): communicators in XLA fallback mode, groups of one,
and calls whose `world * max_rows * row bytes` does not fit `max_message_bytes` (or, for
reduce_scatter_v, rows that are not a multiple of 16 bytes): all_gather_v gathers the padded
rows (`lax.all_gather`) and compacts them; reduce_scatter_v pads the segments to
[world, max_rows] and runs `lax.psum_scatter` in float32.

Typing and gradients: gathered, offsets and total are invariant across the axis (one copy of
every row everywhere, as `lax.all_gather(..., to="invarying")`); y and y_mine vary. Gradients
(custom_vjp) are the transposes under that typing:
- reduce_scatter_v: the cotangent of y is all_gather_v of y_mine's cotangent (rows past the
  total zero), i.e. our gather kernel.
- all_gather_v, check_vma=True: the cotangent of x is this rank's rows of the (invariant)
  cotangent of gathered, a local slice (JAX adds the psum of a varying use of gathered itself,
  as it does for `lax.all_gather(to="invarying")`).
- all_gather_v, check_vma=False (nothing tracked, so the cotangent of gathered is per rank):
  reduce_scatter_v of it, i.e. our reduce-scatter kernel, as for `lax.all_gather`.
Forward-mode (`jax.jvp`) is not supported (custom_vjp).

Kernel calls (`gather_v_call`, `scatter_v_call`): per device through `_shard.per_device`
(the dims after the rows split over the auto axes of a partially manual shard_map), and
custom_vmap functions: a batch with one count (or one offsets array) for every element widens
every row, ONE call; batched counts are refused by name.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _order, _registry, _shard, _warn

_RS_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_HEADER = 256  # kVarlenHeaderBytes (csrc/common/varlen_layout.h)


def _align256(n: int) -> int:
    return (n + 255) // 256 * 256


def fits(comm, max_rows: int, row_bytes: int) -> bool:
    """csrc/common/varlen_layout.h varlen_fits: whether a call of this size goes through the
    communicator's buffers."""
    W = comm.world_size
    half = int(comm._layout["flag_half"])
    return (W * max_rows * row_bytes <= comm.max_message_bytes
            and _HEADER + W * _align256(max_rows * row_bytes) <= half
            and W * max_rows < 2 ** 31)


def _check_count(num_rows, max_rows, what):
    if jnp.shape(num_rows) != () or not jnp.issubdtype(jnp.result_type(num_rows), jnp.integer):
        raise ValueError(f"jax_nvcomm: {what}: num_rows must be an integer scalar, got "
                         f"{jnp.result_type(num_rows)}{list(jnp.shape(num_rows))}")
    if isinstance(num_rows, (int, np.integer)) and not 0 <= int(num_rows) <= max_rows:
        raise ValueError(f"jax_nvcomm: {what}: num_rows must be in [0, max_rows={max_rows}], "
                         f"got {int(num_rows)}")
    return jnp.asarray(num_rows).astype(jnp.int32)


def _row_bytes(x, shape=None) -> int:
    """Bytes of one row of x (of `shape` when given: each device's share of x)."""
    shape = x.shape if shape is None else shape
    return int(np.prod(shape[1:], dtype=np.int64)) * x.dtype.itemsize


def _local_row_bytes(comm, x) -> int:
    """Bytes of one row of each device's share of x [rows, ...]: the dims after the rows split
    over auto mesh axes where they divide, as the kernel calls split them (all of a row unless
    they do)."""
    return _row_bytes(x, _shard.local_shape(comm, x, tuple(range(1, x.ndim))))


def _vma_tracked(x, axis) -> bool:
    """True when shard_map tracks varying axes here (check_vma=True)."""
    return axis in _shard.vma_of(_shard.varying(x, axis))


# ---------------------------------------------------------------------------------------------
# XLA paths (fallback, groups of one, capacity; also the reference of the tests and bench)

def xla_all_gather_v(x, nr, axis, world):
    """Padded `lax.all_gather` (invariant) of x and of the counts, then compaction."""
    max_rows = x.shape[0]  # (a group of one too: the results are typed as for any group)
    x = _shard.varying(x, axis)
    nr = _shard.varying(nr, axis)
    counts = lax.all_gather(nr, axis, to="invarying")                     # [W]
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
    total = offsets[world]
    g = lax.all_gather(x, axis, tiled=False, to="invarying")               # [W, max_rows, ...]
    i = jnp.arange(world * max_rows, dtype=jnp.int32)
    r = jnp.sum(i[:, None] >= offsets[None, 1:world], axis=1).astype(jnp.int32)
    j = jnp.clip(i - offsets[r], 0, max_rows - 1)
    rows = g[r, j]
    valid = (i < total).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(valid, rows, jnp.zeros((), x.dtype)), offsets, total


def xla_reduce_scatter_v(y, offsets, axis, world):
    """Segments padded to [W, max_rows, ...] (float32), `lax.psum_scatter`, cast back."""
    max_rows = y.shape[0] // world
    counts = offsets[1:] - offsets[:-1]
    j = jnp.arange(max_rows, dtype=jnp.int32)
    idx = jnp.clip(offsets[:-1, None] + j[None, :], 0, y.shape[0] - 1)     # [W, max_rows]
    valid = (j[None, :] < counts[:, None]).reshape((world, max_rows) + (1,) * (y.ndim - 1))
    rows = jnp.take(y, idx.reshape(-1), axis=0).reshape(idx.shape + y.shape[1:])  # (Explicit
    padded = jnp.where(valid, rows.astype(jnp.float32), 0.0)          # axes: a flat index)
    if world == 1:  # each rank's own rows: varying over the axis, as lax.psum_scatter types them
        return _shard.varying(padded[0].astype(y.dtype), axis)
    return lax.psum_scatter(_shard.varying(padded, axis), axis, scatter_dimension=0,
                            tiled=False).astype(y.dtype)


# ---------------------------------------------------------------------------------------------
# kernel calls

def _gather_call(x, nr, tok, comm, zero_tail=True):
    axis, W = comm.axis_name, comm.world_size
    x = _shard.varying(x, axis)
    nr = _shard.varying(nr, axis)
    vma_n = _shard.vma_of(nr) - _shard.axes(axis)  # the offsets and total depend on the counts only
    rts = (_shard.result_type(x, (W * x.shape[0],) + tuple(x.shape[1:]), x.dtype,
                              (_shard.vma_of(x) - _shard.axes(axis)) | vma_n),
           _shard.result_type(x, (W + 1,), jnp.int32, vma_n),
           _shard.result_type(x, (), jnp.int32, vma_n))
    return _shard.ffi_call(comm, "all_gather_v", rts, x, nr, order=tok,
                           zero_tail=np.int64(1 if zero_tail else 0))


def _scatter_call(y, offsets, tok, comm):
    axis, W = comm.axis_name, comm.world_size
    y = _shard.varying(y, axis)
    offsets = _shard.varying(offsets, axis)
    vma = _shard.vma_of(y) | _shard.vma_of(offsets)
    rt = _shard.result_type(y, (y.shape[0] // W,) + tuple(y.shape[1:]), y.dtype, vma)
    return _shard.ffi_call(comm, "reduce_scatter_v", rt, y, offsets, order=tok)


def _rows_first(v, nb):
    """v [*batch, rows, ...] (nb batch dims) as [rows, *batch, ...]: a vmapped batch widens
    every row, so one call moves the whole batch."""
    return jnp.moveaxis(v, nb, 0) if nb else v


def _rows_back(v, nb):
    return jnp.moveaxis(v, 0, nb) if nb else v


def _local_gather_v(x, nr, tok, comm, zero_tail, nb):
    """One device's all_gather_v of x [*batch, max_rows, ...]: ((gathered, offsets, total),
    tok); the XLA path when the (widened or split) rows do not fit the buffers."""
    x = _rows_first(x, nb)
    if not fits(comm, x.shape[0], _row_bytes(x)):
        outs = xla_all_gather_v(x, jnp.clip(nr, 0, x.shape[0]), comm.axis_name,
                                comm.world_size)
    else:
        outs, tok = _gather_call(x, nr, tok, comm, zero_tail)
    g, off, tot = outs
    return _rows_back(g, nb), off, tot, tok


def _local_scatter_v(y, offsets, tok, comm, nb):
    """One device's reduce_scatter_v of y [*batch, W * max_rows, ...]: (y_mine, tok); the XLA
    path when the (widened or split) rows do not fit the buffers or 16-byte vectors."""
    y = _rows_first(y, nb)
    row = _row_bytes(y)
    if row % 16 or not fits(comm, y.shape[0] // comm.world_size, row):
        out = xla_reduce_scatter_v(y, offsets, comm.axis_name, comm.world_size)
    else:
        out, tok = _scatter_call(y, offsets, tok, comm)
    return _rows_back(out, nb), tok


_NO_BATCHED_COUNTS = (
    "jax_nvcomm: {what}: vmap with a batched {arg} is not supported: ONE call carries the "
    "whole batch only when every batch element has the same rows (one {arg}), and each "
    "element's own counts would need a second message. Pass {arg} unbatched, fold the batch "
    "into the rows yourself and call it once, or call it once per element (lax.map)")


def gather_v_call(comm, zero_tail, nb=0):
    """The kernel call of all_gather_v, `(x, nr, tok) -> (gathered, offsets, total, tok)`, x
    [*batch, max_rows, ...] with nb batch dims. Per device (`_shard.per_device`: the dims
    after the rows and the batch dims independent; the counts whole); under vmap (num_rows
    unbatched) the call for nb + 1 batch dims: ONE message, rows widened by the batch."""
    def call(x, nr, tok):
        dims = tuple(d for d in range(x.ndim) if d != nb)
        local = lambda a, n, t: _local_gather_v(a, n, t, comm, zero_tail, nb)
        return _shard.per_device(comm, local, (x, nr), tok, (dims, ()), (dims, (), ()))

    def rule(size, batched, x, nr, tok):
        if batched[1]:
            raise NotImplementedError(_NO_BATCHED_COUNTS.format(what="all_gather_v",
                                                                arg="num_rows"))
        *outs, tok = gather_v_call(comm, zero_tail, nb + 1)(x, nr, tok)
        return tuple(outs), (True, False, False), tok

    return _shard.batching(call, rule)


def scatter_v_call(comm, nb=0):
    """The kernel call of reduce_scatter_v, `(y, offsets, tok) -> (y_mine, tok)`, y
    [*batch, W * max_rows, ...] with nb batch dims; as `gather_v_call` (offsets unbatched)."""
    def call(y, offsets, tok):
        dims = tuple(d for d in range(y.ndim) if d != nb)
        local = lambda a, o, t: _local_scatter_v(a, o, t, comm, nb)
        return _shard.per_device(comm, local, (y, offsets), tok, (dims, ()), (dims,))

    def rule(size, batched, y, offsets, tok):
        if batched[1]:
            raise NotImplementedError(_NO_BATCHED_COUNTS.format(what="reduce_scatter_v",
                                                                arg="offsets"))
        out, tok = scatter_v_call(comm, nb + 1)(y, offsets, tok)
        return (out,), (True,), tok

    return _shard.batching(call, rule)


def _my_rows(ct, offsets, nr, axis):
    """Rows offsets[me] .. offsets[me] + nr of ct as [max_rows, ...], zero past nr."""
    max_rows = ct.shape[0] // (offsets.shape[0] - 1)
    start = offsets[lax.axis_index(axis)]
    sl = lax.dynamic_slice_in_dim(ct, start, max_rows, axis=0)
    keep = (jnp.arange(max_rows) < nr).reshape((-1,) + (1,) * (ct.ndim - 1))
    return jnp.where(keep, sl, jnp.zeros((), ct.dtype))


# ---------------------------------------------------------------------------------------------
# public functions

def all_gather_v(x, num_rows, comm=None, *, axis_name=None, zero_tail: bool = True):
    """Gather the first `num_rows` rows of every rank, concatenated in rank order.

    Call inside `jax.shard_map` over `comm`'s mesh. Each rank moves only its own rows (no
    padding to max_rows) through the communicator's buffers. On a communicator in XLA fallback
    mode, for groups of one, and when `world_size * max_rows * row bytes` exceeds what the
    buffers hold (`max_message_bytes`; the row bytes of each device's call: in a partially
    manual shard_map its share of a row), it runs `lax.all_gather` of the padded rows and
    compacts them instead, with the same results.

    Args:
      x: [max_rows, ...] rows of this rank, any dtype.
      num_rows: int32 scalar (may be traced), 0 <= num_rows <= max_rows: how many leading rows
        of x to send. A traced value out of range fails the call on the device with a named
        error (kernel path) or is clipped (XLA path).
      comm: a `Communicator` over an axis (or a tuple of axes) of the surrounding
        shard_map's mesh; an axis name (a str or tuple of str) here counts as axis_name.
      axis_name: in place of comm (exactly one of the two): the mesh axis or tuple of axes,
        as lax takes it; the communicator is the one registered for it (the innermost
        `jax_nvcomm.communicators` block, or jax_nvcomm.jit's).
      zero_tail: zero the rows of gathered from total on (default). False leaves them
        unspecified (API.md) and saves a local memset of (world * max_rows - total) rows, which
        dominates a decode step gathered into a prefill-sized buffer; only safe when nothing
        reads those rows (garbage, e.g. NaN, times a zero cotangent is still NaN).

    Partially manual shard_map: the dims after the rows split over the auto mesh axes where
    they divide, else whole. jax.vmap with num_rows unbatched: the batch widens every row, ONE
    call (a transpose in and out); a batched num_rows raises NotImplementedError.

    Returns:
      (gathered, offsets, total): gathered [world_size * max_rows, ...], rank r's rows at
      offsets[r] .. offsets[r+1] - 1, rows from total on zero (with zero_tail; API.md:
      unspecified); offsets int32
      [world_size + 1] (offsets[0] = 0, offsets[-1] = total); total int32 scalar. All
      invariant across the axis. Gradient: module docstring (reduce_scatter_v is its
      transpose).

    Raises:
      ValueError: x a scalar, num_rows not an integer scalar or (constant) out of range, a
        call outside shard_map over the communicator's axis.
      NotImplementedError: jax.vmap with a batched num_rows.
    """
    what = "all_gather_v"
    comm = _registry.resolve(comm, axis_name, what=what)
    _shard.check_context(comm, what)
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"jax_nvcomm: {what}: x must be [max_rows, ...] (rank >= 1), got a "
                         "scalar")
    max_rows = x.shape[0]
    nr = _check_count(num_rows, max_rows, what)
    axis, W = comm.axis_name, comm.world_size
    row = _local_row_bytes(comm, x)  # each device's call's
    if (comm.xla_fallback or W == 1 or max_rows == 0 or row == 0
            or not fits(comm, max_rows, row)):
        if not (comm.xla_fallback or W == 1 or max_rows == 0 or row == 0):
            _warn.warn_once(f"jax_nvcomm: {what}: {W} x {max_rows} rows of {row} bytes do not "
                            f"fit the communicator's buffers (max_message_bytes "
                            f"{comm.max_message_bytes}): a padded lax.all_gather runs instead "
                            "of the kernel")
        dims = tuple(range(1, x.ndim))
        return _shard.per_device(comm, lambda a, n: xla_all_gather_v(a, n, axis, W),
                                 (x, jnp.clip(nr, 0, max_rows)), None, (dims, ()),
                                 (dims, (), ()))
    tracked = _vma_tracked(x, axis)
    float_x = jnp.issubdtype(x.dtype, jnp.inexact)

    call = gather_v_call(comm, zero_tail)

    @jax.custom_vjp
    def gather(v, n, tok):
        return call(v, n, tok)

    def fwd(v, n, tok):
        out = gather(v, n, tok)
        return out, (out[1], n)

    def bwd(res, cts):
        offsets, n = res
        ct = cts[0]
        if not float_x:
            dx = jnp.zeros(x.shape, x.dtype)
        elif tracked:
            dx = _shard.varying(_my_rows(ct, offsets, n, axis), axis)
        else:
            dx = reduce_scatter_v(ct, offsets, comm)
        return _shard.like(dx, x), None, None

    gather.defvjp(fwd, bwd)
    g, off, tot, tok = gather(_shard.varying(x, axis), nr, _order.token(axis))
    _order.record(tok)
    return g, off, tot


def reduce_scatter_v(y, offsets, comm=None, *, axis_name=None):
    """Sum the ranks' partial results of every rank's rows and give each rank its own rows.

    The transpose of `all_gather_v`: y holds partial results in the gathered layout (rank r's
    rows at offsets[r] .. offsets[r+1] - 1); rank r gets, for its rows, the float32 sum over
    ranks in rank order, cast to y.dtype, and zeros past its count. Each rank sends only the
    rows of the other ranks' segments. On a communicator in XLA fallback mode, for groups of
    one, for calls larger than the buffers hold, or rows that are not a multiple of 16 bytes
    (each device's call's: in a partially manual shard_map its share of a row), it pads the
    segments and runs `lax.psum_scatter` in float32 instead.

    Args:
      y: [world_size * max_rows, ...], bfloat16, float16 or float32.
      offsets: int32 [world_size + 1] as returned by `all_gather_v` (the same on every rank;
        ranks passing different offsets fail with a named error on the kernel path).
      comm: a `Communicator` over an axis (or a tuple of axes) of the surrounding
        shard_map's mesh; an axis name (a str or tuple of str) here counts as axis_name.
      axis_name: in place of comm (exactly one of the two): the mesh axis or tuple of axes,
        as lax takes it; the communicator is the one registered for it (the innermost
        `jax_nvcomm.communicators` block, or jax_nvcomm.jit's).

    Partially manual shard_map and jax.vmap as `all_gather_v` (batched offsets:
    NotImplementedError).

    Returns:
      y_mine [max_rows, ...] in y.dtype, varying across the axis. Gradient: all_gather_v of
      the cotangent (rows past the total zero).

    Raises:
      TypeError / ValueError: y's dtype, a first dimension not a multiple of world_size, offsets
        not int32 [world_size + 1], a call outside shard_map over the communicator's axis.
      NotImplementedError: jax.vmap with batched offsets.
    """
    what = "reduce_scatter_v"
    comm = _registry.resolve(comm, axis_name, what=what)
    _shard.check_context(comm, what)
    y, offsets = jnp.asarray(y), jnp.asarray(offsets)
    axis, W = comm.axis_name, comm.world_size
    if jnp.dtype(y.dtype) not in _RS_DTYPES:
        raise TypeError(f"jax_nvcomm: {what}: y must be bfloat16, float16 or float32, got "
                        f"{y.dtype}")
    if y.ndim < 1 or y.shape[0] % W:
        raise ValueError(f"jax_nvcomm: {what}: y must be [world_size * max_rows, ...] with "
                         f"world_size={W}, got shape {y.shape}")
    if offsets.shape != (W + 1,) or offsets.dtype != jnp.int32:
        raise ValueError(f"jax_nvcomm: {what}: offsets must be int32 of shape ({W + 1},) "
                         f"(world_size + 1), got {offsets.dtype}{list(offsets.shape)}")
    max_rows = y.shape[0] // W
    row = _local_row_bytes(comm, y)  # each device's call's
    if (comm.xla_fallback or W == 1 or max_rows == 0 or row == 0 or row % 16
            or not fits(comm, max_rows, row)):
        if not (comm.xla_fallback or W == 1 or max_rows == 0 or row == 0):
            why = (f"rows of {row} bytes are not a multiple of 16" if row % 16 else
                   f"{W} x {max_rows} rows of {row} bytes do not fit the communicator's buffers "
                   f"(max_message_bytes {comm.max_message_bytes})")
            _warn.warn_once(f"jax_nvcomm: {what}: {why}: a padded lax.psum_scatter runs "
                            "instead of the kernel")
        dims = tuple(range(1, y.ndim))
        return _shard.per_device(comm, lambda a, o: (xla_reduce_scatter_v(a, o, axis, W),),
                                 (y, offsets), None, (dims, ()), (dims,))[0]

    call = scatter_v_call(comm)

    @jax.custom_vjp
    def scatter(v, off, tok):
        return call(v, off, tok)

    def fwd(v, off, tok):
        return scatter(v, off, tok), off

    def bwd(off, cts):
        ct = cts[0]
        me = lax.axis_index(axis)
        n = off[me + 1] - off[me]
        g, _, total = all_gather_v(ct, n, comm)
        keep = (jnp.arange(g.shape[0]) < total).reshape((-1,) + (1,) * (g.ndim - 1))
        dy = jnp.where(keep, g, jnp.zeros((), g.dtype))
        return _shard.like(_shard.varying(dy, axis), y), None, None

    scatter.defvjp(fwd, bwd)
    out, tok = scatter(_shard.varying(y, axis), offsets, _order.token(axis))
    _order.record(tok)
    return out
