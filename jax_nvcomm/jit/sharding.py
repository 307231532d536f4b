"""Which equations of a jaxpr outside any shard_map need a collective, read from the shardings
the avals carry (Explicit mesh axes: `f32[8@data,64@tensor]`).

The form found (the row-parallel product: sglang-jax's `LinearBase` with `out_sharding`,
jax-llm-examples' `einsum` helper, an NNX-style row-parallel module):
    out = dot_general(lhs, rhs)   with a contracting dimension sharded on mesh axes A, the same
                                  axes on both operands' paired contracting dimensions, and no
                                  dimension of `out` sharded on an axis of A
XLA's partitioner computes it as a local product and an all-reduce over A; `psum_axes` names A.
The same for `reduce_sum` of floats over dimensions sharded on axes A the output is not sharded
on (the norm weights' gradient: a sum over the data-sharded tokens).

Refused (the product stays XLA's; the reason is what `explain` prints):
  - contracting dims sharded differently on the two operands (XLA moves an operand first);
  - an axis of A held `unreduced` by the output (the user asked for no reduction there);
  - an axis of A that is not Explicit (Auto: XLA chooses the shardings; Manual: inside a
    shard_map, which the rewrite serves itself).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import AxisType


@dataclasses.dataclass(frozen=True)
class Reduction:
    """A product that needs an all-reduce: its axes (mesh order), or why it is left to XLA."""
    axes: tuple
    mesh: object          # the operands' abstract mesh
    reason: str = ""      # non-empty: not cut (the reason explain prints)


def spec_axes(entry) -> tuple:
    """The mesh axes one PartitionSpec entry names (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(a for a in entry if a is not None)
    return (entry,)


def sharding_of(aval):
    """aval's NamedSharding when it carries one on a non-empty mesh, else None."""
    s = getattr(aval, "sharding", None)
    if s is None or getattr(s, "mesh", None) is None or s.mesh.empty:
        return None
    return s


def axes_of(aval) -> frozenset:
    """The mesh axes any dimension of aval is sharded on (empty when it carries none)."""
    s = sharding_of(aval)
    if s is None:
        return frozenset()
    return frozenset(a for e in s.spec for a in spec_axes(e))


def _dim_axes(spec, ndim, d):
    return spec_axes(spec[d]) if d < len(spec) else ()


def psum_axes(eqn) -> Reduction | None:
    """For a `dot_general` (or `reduce_sum`) outside any shard_map: the all-reduce its
    shardings imply (module docstring), or None when it needs none."""
    if eqn.primitive.name == "reduce_sum":
        return _sum_axes(eqn)
    if eqn.primitive.name != "dot_general":
        return None
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    out = eqn.outvars[0].aval
    sl, sr, so = sharding_of(lhs), sharding_of(rhs), sharding_of(out)
    if sl is None or sr is None or so is None:
        return None
    (lc, rc), _ = eqn.params["dimension_numbers"]
    la = [_dim_axes(sl.spec, lhs.ndim, d) for d in lc]
    ra = [_dim_axes(sr.spec, rhs.ndim, d) for d in rc]
    contracted = [a for axs in la + ra for a in axs]
    if not contracted:
        return None
    out_axes = {a for e in so.spec for a in spec_axes(e)}
    mesh = sl.mesh
    red = tuple(a for a in mesh.axis_names if a in contracted and a not in out_axes
                and mesh.shape[a] > 1)
    if not red:
        return None
    if la != ra:
        return Reduction(red, mesh, f"contracting dimensions sharded differently "
                                    f"({sl.spec} . {sr.spec}): XLA moves an operand first")
    return _checked(red, mesh, so)


def _sum_axes(eqn) -> Reduction | None:
    x, out = eqn.invars[0].aval, eqn.outvars[0].aval
    sx, so = sharding_of(x), sharding_of(out)
    if sx is None or so is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return None
    summed = [a for d in eqn.params["axes"] for a in _dim_axes(sx.spec, x.ndim, d)]
    out_axes = {a for e in so.spec for a in spec_axes(e)}
    mesh = sx.mesh
    red = tuple(a for a in mesh.axis_names if a in summed and a not in out_axes
                and mesh.shape[a] > 1)
    if not red:
        return None
    return _checked(red, mesh, so)


def _checked(red, mesh, so) -> Reduction:
    unreduced = set(getattr(so.spec, "unreduced", ()) or ())
    if unreduced & set(red):
        return Reduction(red, mesh, f"the output holds {sorted(unreduced & set(red))} "
                                    "unreduced: no all-reduce is asked for here")
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    not_explicit = [a for a in red if types[a] != AxisType.Explicit]
    if not_explicit:
        kind = {a: str(types[a]).split(".")[-1] for a in not_explicit}
        return Reduction(red, mesh, f"mesh axes {kind} are not Explicit: their shardings are "
                                    "chosen by XLA after the trace")
    return Reduction(red, mesh)
