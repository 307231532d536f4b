"""The gather / scatter patterns of the rewrite: lax's all_gather, psum_scatter, all_to_all and
ragged_all_to_all inside a shard_map body, bound as our ops (`rewrite._collective` calls these
with the communicator of the collective's axes; each returns the new value, or None with
`site.reason` saying why lax's collective stays).

Forms matched, and refused (the reason `explain` prints):
  - `lax.all_gather(x, axis, axis=d, tiled=...)`, any d, tiled or not -> `all_gather`.
    Refused: a gathered message over the communicator's buffers (fixable: a larger
    max_message_bytes).
  - `lax.psum_scatter(x, axis, scatter_dimension=d, tiled=...)`, any d, tiled or not, float32 /
    bfloat16 / float16 -> `reduce_scatter_v` with equal segments. The kernel reduces along rows
    (dim 0): for d > 0 dim d is moved to the front (`jnp.moveaxis`) and the result moved back,
    a layout change XLA fuses with the producer and the consumer (no copy of its own where the
    dims before d are all 1, as in a [1, tokens, hidden] prefill). The kernel's addressing is
    not changed for it: its rows are contiguous segments, the API takes no stride.
    Not tiled, x's dim d (of size world) is the rank's index and leaves the result; a 1-D x is
    taken as [world, n] rows (tiled) or refused (not tiled: rows of one element).
    Refused: integer types (ours sums floats); rows (the product of the other dims of each
    device's share) not a multiple of 16 bytes, the kernel's unit of transfer; a call over the
    buffers (fixable); a communicator on XLA's collectives.
    Our sum is float32 in rank order: within float32 summation order of lax's, bitwise where
    the summands' order does not matter.
  - `lax.all_to_all(x, axis, split_axis=0, concat_axis=0)` -> `ragged_all_to_all` of equal
    slices (a copy: bitwise). Refused: other split / concat axes (they would need transposes
    on both sides), rows not a multiple of the group, a call over the buffers (fixable).
  - `lax.ragged_all_to_all` -> `ragged_all_to_all` (any index dtype: the op brings them to one).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _local(comm, x, dims):
    from .. import _shard
    return _shard.local_shape(comm, x, dims)


def _on_xla(comm, site) -> bool:
    if comm.xla_fallback:
        site.reason = f"the communicator runs XLA's collectives: {comm.transport_reason}"
        return True
    return False


def all_gather(eqn, invals, comm, site):
    from .. import allgather
    p = eqn.params
    (x,) = invals
    if _on_xla(comm, site):
        return None
    shape = _local(comm, x, tuple(d for d in range(x.ndim)
                                  if d != p["all_gather_dimension"] or not p["tiled"]))
    if allgather._too_big(comm, shape, x.dtype):
        site.reason = (f"the gathered {int(np.prod(shape)) * x.dtype.itemsize * comm.world_size}"
                       f" bytes exceed the buffers (max_message_bytes={comm.max_message_bytes})")
        site.fixable = True
        return None
    site.became = "all_gather"
    return allgather.all_gather(x, comm, axis=p["all_gather_dimension"], tiled=p["tiled"])


def reduce_scatter(eqn, invals, comm, site):
    """lax.psum_scatter along any dimension, tiled or not -> reduce_scatter_v (docstring)."""
    from .. import varlen
    p = eqn.params
    (x,) = invals
    W = comm.world_size
    d, tiled = int(p["scatter_dimension"]), bool(p["tiled"])
    if jnp.dtype(x.dtype) not in _FLOATS:
        site.reason = f"{x.dtype} is not a float type reduce_scatter_v takes"
        return None
    if _on_xla(comm, site):
        return None
    moved = f"dim {d} moved to the front, " if d else ""
    y = jnp.moveaxis(x, d, 0) if d else x
    if y.ndim == 1:
        if not tiled:
            site.reason = (f"a 1-D operand not tiled: rows of one {x.dtype} element; our "
                           "reduce-scatter moves rows of a multiple of 16 bytes")
            return None
        y = y.reshape(W, -1)
    rows = y.shape[0] // W
    shape = _local(comm, y, tuple(range(1, y.ndim)))
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * y.dtype.itemsize
    if row_bytes % 16 or row_bytes == 0:
        site.reason = (f"scatter_dimension={d}: {moved}rows of {row_bytes} bytes (each device's "
                       f"share of {list(shape[1:])} {x.dtype}); our reduce-scatter moves rows "
                       "of a multiple of 16 bytes")
        return None
    if not varlen.fits(comm, rows, row_bytes):
        site.reason = (f"{W} x {rows} rows of {row_bytes} bytes are over the buffers "
                       f"(max_message_bytes={comm.max_message_bytes})")
        site.fixable = True
        return None
    offsets = jnp.arange(W + 1, dtype=jnp.int32) * jnp.int32(rows)
    out = varlen.reduce_scatter_v(y, offsets, comm)
    site.became = "reduce_scatter_v"
    if d:
        site.reason = (f"scatter_dimension={d}: {moved}reduce-scattered as rows of {row_bytes} "
                       "bytes, moved back (a layout change XLA fuses)")
    out_shape = eqn.outvars[0].aval.shape
    if tiled and d:
        out = jnp.moveaxis(out, 0, d)
    return out.reshape(out_shape)


def all_to_all(eqn, invals, comm, site):
    """lax.all_to_all with split_axis == concat_axis == 0 as a ragged_all_to_all of equal
    slices (a copy: bitwise); other axes stay XLA's (they would need transposes)."""
    from .. import ragged
    p = eqn.params
    (x,) = invals
    W = comm.world_size
    if p["split_axis"] != 0 or p["concat_axis"] != 0:
        site.reason = (f"split_axis={p['split_axis']}, concat_axis={p['concat_axis']}: taken "
                       "for 0, 0 only")
        return None
    if _on_xla(comm, site):
        return None
    y = x if x.ndim >= 2 else x.reshape(-1, 1)  # chunks along dim 0 (tiled or not: W rows)
    if y.ndim < 1 or y.shape[0] % W or y.dtype.itemsize == 0:
        site.reason = f"rows {y.shape} not a multiple of the group of {W}"
        return None
    m = y.shape[0] // W
    row = int(np.prod(y.shape[1:], dtype=np.int64)) * y.dtype.itemsize
    if ragged.chunk_bytes(comm, y.shape[0], row, 1) < 0:  # any size: one round or chunked
        site.reason = f"over the buffers (max_message_bytes={comm.max_message_bytes})"
        site.fixable = True
        return None
    me = lax.axis_index(comm.axis_name).astype(jnp.int32)
    i = jnp.arange(W, dtype=jnp.int32)
    sizes = jnp.full((W,), m, jnp.int32)
    out = ragged.ragged_all_to_all(y, jnp.zeros_like(y), i * m, sizes,
                                   jnp.full((W,), m, jnp.int32) * me, sizes, comm)
    site.became = "ragged_all_to_all (equal slices)"
    return out.reshape(eqn.outvars[0].aval.shape)


def ragged_all_to_all(eqn, invals, comm, site):
    from .. import ragged
    operand, output, io, ss, oo, rs = invals
    if _on_xla(comm, site):
        return None
    site.became = "ragged_all_to_all"
    return ragged.ragged_all_to_all(operand, output, io, ss, oo, rs, comm)
