"""`all_gather`: gather along a mesh axis through the communicator's symmetric buffers
(= `lax.all_gather(x, axis_name, axis=axis, tiled=tiled)`). Messages whose gathered size
exceeds `max_message_bytes` use `lax.all_gather`.

The kernel call (`gather_call`) gathers along a leading block; under `jax.vmap` the batch goes
into the same message (each rank's batch contiguous, ONE call) and the gathered blocks are put
in place after it; `_shard.per_device` splits the non-gathered dims over auto mesh axes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _fallback, _order, _registry, _shard, _warn


def _gather0(x, tok, comm):
    """Kernel call: concatenate every rank's x along a new leading block: [W * x.shape[0], ...].
    Returns (that, the call's order token)."""
    axis = comm.axis_name
    x = _shard.varying(x, axis)
    out_shape = (comm.world_size * x.shape[0],) + tuple(x.shape[1:])
    rt = _shard.result_type(x, out_shape, x.dtype, _shard.vma_of(x))
    return _shard.ffi_call(comm, "all_gather", rt, x, order=tok)


def _too_big(comm, shape, dtype) -> bool:
    """Whether gathering a share of `shape` from every rank exceeds comm.max_message_bytes."""
    n = int(np.prod(shape, dtype=np.int64))
    return n * jnp.dtype(dtype).itemsize * comm.world_size > comm.max_message_bytes


def _local_gather(v, tok, comm, nb):
    """One device's gather of v [*batch, n, ...] (nb batch dims) along n: [*batch, W * n, ...].
    The batch goes into the one message: [W, *batch, n, ...] comes back, then moves in place.
    Returns (that, the order token)."""
    W = comm.world_size
    if _too_big(comm, v.shape, v.dtype):  # a vmapped batch outgrew the buffers
        return lax.all_gather(v, comm.axis_name, axis=nb, tiled=True), tok
    if nb == 0:
        return _gather0(v, tok, comm)
    lead, n, rest = v.shape[:nb], v.shape[nb], v.shape[nb + 1:]
    g, tok = _gather0(v.reshape((-1,) + rest), tok, comm)
    g = jnp.moveaxis(g.reshape((W,) + lead + (n,) + rest), 0, nb)
    return g.reshape(lead + (W * n,) + rest), tok


def gather_call(comm, nb=0):
    """The kernel call of all_gather, `(v, tok) -> (gathered, tok)`: v [*batch, n, ...] with
    nb batch dims, gathered along n. Per device (`_shard.per_device`: every other dim
    independent); under vmap the call for nb + 1 batch dims."""
    def call(v, tok):
        dims = tuple(d for d in range(v.ndim) if d != nb)
        return _shard.per_device(comm, lambda a, t: _local_gather(a, t, comm, nb), (v,), tok,
                                 (dims,), (dims,))

    def rule(size, batched, v, tok):
        g, tok = gather_call(comm, nb + 1)(v, tok)
        return (g,), (True,), tok

    return _shard.batching(call, rule)


def all_gather(x, comm=None, *, axis_name=None, axis: int = 0, tiled: bool = True):
    """Gather `x` from every rank of `comm`'s axis (= `lax.all_gather(x, comm.axis_name,
    axis=axis, tiled=tiled)`), through the communicator's buffers.

    Gathered sizes above `comm.max_message_bytes` (each device's: in a partially manual
    shard_map its share of x), groups of one rank and empty arrays use `lax.all_gather`.
    Gradients: the tangent is `lax.all_gather` of the input tangent.
    On a communicator in XLA fallback mode (`comm.xla_fallback`: groups over several hosts)
    it runs `lax.all_gather` instead, with the same results.
    Partially manual shard_map: the non-gathered dims split over the auto mesh axes where they
    divide, else whole. jax.vmap: each rank's batch goes in ONE message, the gathered blocks
    are moved in place after it (a transpose of the result).

    Args:
      x: the local shard, any dtype; rank >= 1 when tiled.
      comm: a `Communicator` over an axis (or a tuple of axes) of the surrounding
        shard_map's mesh; an axis name (a str or tuple of str) here counts as axis_name.
      axis_name: in place of comm (exactly one of the two): the mesh axis or tuple of axes,
        as lax takes it; the communicator is the one registered for it (the innermost
        `jax_nvcomm.communicators` block, or jax_nvcomm.jit's).
      axis: where the ranks' pieces go, in [-x.ndim, x.ndim) (tiled) or [-x.ndim - 1, x.ndim]
        (not tiled).
      tiled: concatenate along `axis` (True) or stack on a new axis there (False).

    Returns:
      The gathered array, rank order along `axis`; varies across the axis (typed as
      `lax.all_gather`'s result).

    Raises:
      ValueError: a scalar with tiled=True, or `axis` out of range.
    """
    what = "all_gather"
    comm = _registry.resolve(comm, axis_name, what=what)
    _shard.check_context(comm, what)
    x = jnp.asarray(x)
    if x.ndim == 0:
        if tiled:
            raise ValueError("jax_nvcomm: all_gather: x must have rank >= 1 when tiled=True, "
                             "got a scalar")
    nd = x.ndim
    if not isinstance(axis, (int, np.integer)) or not (-nd - (0 if tiled else 1) <= axis <
                                                        nd + (0 if tiled else 1)):
        raise ValueError(f"jax_nvcomm: all_gather: axis must be an int in "
                         f"[{-nd}, {nd}) for x of shape {x.shape}, got {axis!r}")
    axis = int(axis) % (nd + (0 if tiled else 1))
    if comm.xla_fallback:  # groups beyond one host / peer access: _fallback.py
        return _fallback.all_gather(x, comm, axis, tiled)
    if x.size == 0:  # nothing to move; XLA refuses to lower an all-gather of a zero-size axis
        shape = list(x.shape)
        if tiled:
            shape[axis] *= comm.world_size
        else:
            shape.insert(axis, comm.world_size)
        return jnp.zeros(shape, x.dtype)
    # what each device's call gathers: its share of x (the dims other than the gathered one
    # split over auto mesh axes where they divide, as gather_call splits them)
    local = _shard.local_shape(comm, x, tuple(d for d in range(nd) if d != axis or not tiled))
    if comm.world_size == 1 or _too_big(comm, local, x.dtype):
        if comm.world_size > 1:
            n = int(np.prod(local, dtype=np.int64)) * x.dtype.itemsize * comm.world_size
            _warn.warn_once(f"jax_nvcomm: all_gather: gathering {n} bytes per device exceeds "
                            f"the communicator's max_message_bytes {comm.max_message_bytes}: "
                            "lax.all_gather runs instead of the kernel (a Communicator with "
                            f"max_message_bytes >= {n} serves it)")
        return lax.all_gather(x, comm.axis_name, axis=axis, tiled=tiled)

    call = gather_call(comm)

    @jax.custom_jvp
    def gather(v, tok):
        g, tok = call(jnp.moveaxis(v, axis, 0) if tiled else v[None], tok)
        return jnp.moveaxis(g, 0, axis), tok

    @gather.defjvp
    def gather_jvp(primals, tangents):
        (v, tok), (t, _) = primals, tangents
        g, tok = gather(v, tok)
        return ((g, tok), (lax.all_gather(t, comm.axis_name, axis=axis, tiled=tiled),
                           _order.zero_tangent(tok)))

    g, tok = gather(x, _order.token(comm.axis_name))
    _order.record(tok)
    return g
