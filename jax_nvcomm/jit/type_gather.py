"""The all-gathers that shardings in types imply: which equations outside any shard_map XLA's
partitioner serves with an all-gather, read from the avals' shardings (Explicit mesh axes).

The forms found (`gather_of`):
    y = reshard(x, spec)                             (sequence parallelism's token gather)
    y = reshape(x, new_sizes, sharding=...)          (`x.reshape(..., out_sharding=...)`:
                                                      jax-llm-examples' router outputs)
    y = convert_element_type(x, sharding=...)        (`x.astype(..., out_sharding=...)`)
    y = broadcast_in_dim(x, ..., sharding=...)       (`jnp.broadcast_to(..., out_sharding=)`)
where one dim d of x is sharded on a group A of Explicit mesh axes (one axis, or a tuple such
as ("y", "z")), none of which shards y. XLA gathers x over A along d (tiled, the ranks in the
order the spec names A: the tuple's first axis the major one), then applies the equation
locally. A gather is exact, so the region (`regions.py`: a shard_map manual over A holding
`lax.all_gather(x, A, axis=d, tiled=True)` and the equation) gives jax.jit's values bit for bit.

Any dtype our all_gather moves (it moves bytes): floats and integers (top-k indices).
Not taken (left to XLA, which serves them with other collectives): axes leaving more than one
dim, part of a dim's group leaving (the rest staying), non-Explicit axes, and for the
same-shape forms (reshard, convert) any other dim's sharding changing too.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax._src import core
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from . import sharding as _sh

FORMS = ("reshard", "reshape", "convert_element_type", "broadcast_in_dim")
_SAME_SHAPE = ("reshard", "convert_element_type")


@dataclasses.dataclass(frozen=True)
class Gather:
    """The all-gather an equation implies: over `axes` (the input's spec order), along its
    input's dim `dim`."""
    axes: tuple
    dim: int


def _big(mesh, entry) -> tuple:
    """The axes of one spec entry of size > 1 (size-1 axes change no layout)."""
    return tuple(a for a in _sh.spec_axes(entry) if mesh.shape[a] > 1)


def gather_of(eqn) -> Gather | None:
    """The all-gather `eqn` implies (module docstring), or None."""
    name = eqn.primitive.name
    if name not in FORMS or len(eqn.invars) != 1 or len(eqn.outvars) != 1:
        return None
    if name != "reshard" and eqn.params.get("sharding") is None:
        return None  # (no out_sharding: the output's sharding follows the input's)
    (xv,) = eqn.invars
    if not isinstance(xv, core.Var):
        return None
    x, out = xv.aval, eqn.outvars[0].aval
    sx, so = _sh.sharding_of(x), _sh.sharding_of(out)
    if sx is None or so is None or x.ndim == 0 or out.ndim == 0:
        return None
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        return None
    mesh = sx.mesh
    if tuple(so.mesh.axis_names) != tuple(mesh.axis_names) or \
            tuple(so.mesh.axis_types) != tuple(mesh.axis_types):
        return None  # (a reshard onto other axis types: jax.grad's transposes write them)
    if getattr(so.spec, "unreduced", None) or getattr(sx.spec, "unreduced", None):
        return None
    a_in, a_out = _sh._padded(sx.spec, x.ndim), _sh._padded(so.spec, out.ndim)
    kept = {a for e in a_out for a in _sh.spec_axes(e)}
    gone = {a for e in a_in for a in _big(mesh, e) if a not in kept}
    dims = [d for d in range(x.ndim) if set(_big(mesh, a_in[d])) & gone]
    if len(dims) != 1:
        return None
    d = dims[0]
    group = _sh.spec_axes(a_in[d])
    if set(_big(mesh, a_in[d])) & kept:
        return None  # (part of the group stays: not one gather over the whole entry)
    group = tuple(a for a in group if a not in kept)  # (size-1 axes the output keeps: as
    #                                                    they were, they split nothing)
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if any(types[a] != AxisType.Explicit for a in group):
        return None
    if name in _SAME_SHAPE and (
            _big(mesh, a_out[d]) or
            any(_big(mesh, a_in[k]) != _big(mesh, a_out[k]) for k in range(x.ndim) if k != d)):
        return None  # (another dim moves too: more than a gather)
    return Gather(group, d)


# ---------------------------------------------------------------------------------------------
# equations each shard computes alone, for which XLA's partitioner gathers the operand anyway

LOCAL_ROWS = ("top_k",)  # (XLA's TopK custom call has no partitioning rule: it is replicated)


def local_axes(eqn) -> tuple | None:
    """For a `top_k` outside any shard_map whose operand is sharded only on dims other than
    the one it selects along (the router's scores: tokens sharded, experts whole), on Explicit
    axes: those axes (mesh order). Each shard's rows are its own, so a region manual over them
    computes it with no collective where XLA all-gathers the operand first. None otherwise."""
    if eqn.primitive.name not in LOCAL_ROWS:
        return None
    x = eqn.invars[0].aval
    sx = _sh.sharding_of(x)
    if sx is None or x.ndim == 0 or not isinstance(eqn.invars[0], core.Var):
        return None
    mesh = sx.mesh
    a_in = _sh._padded(sx.spec, x.ndim)
    along = eqn.params.get("axis", x.ndim - 1) % x.ndim
    if _big(mesh, a_in[along]):
        return None
    axes = {a for e in a_in for a in _big(mesh, e)}
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if not axes or any(types[a] != AxisType.Explicit for a in axes):
        return None
    for o in eqn.outvars:  # (the types give the outputs the operand's sharding)
        so = _sh.sharding_of(o.aval)
        if so is None or [_big(mesh, e) for e in _sh._padded(so.spec, o.aval.ndim)] != \
                [_big(mesh, e) for e in a_in]:
            return None
    return tuple(a for a in mesh.axis_names if a in axes)


def sharded_on_group(x, axes: tuple, dim: int):
    """x with its dim `dim` sharded on exactly `axes` (the region's in_spec): the size-1 axes
    the output keeps taken off that dim first (a reshard that moves nothing)."""
    import jax
    spec = list(_sh._padded(jax.typeof(x).sharding.spec, x.ndim))
    if _sh.spec_axes(spec[dim]) == tuple(axes):
        return x
    spec[dim] = axes[0] if len(axes) == 1 else tuple(axes)
    return jax.sharding.reshard(x, P(*spec))
