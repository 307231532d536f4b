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

Also found: a product whose output is sharded along one dim on exactly the one axis it
contracts (a reduce-scatter: `Reduction.scatter_dim`) and the vocab-parallel embedding's row
gather from a table resharded off its vocab axis (`embedding_axes`). The all-gathers that
shardings imply are `type_gather.py`'s.

Auto axes (MaxText's logical rules + with_sharding_constraint: shardings chosen by XLA's
propagation): `auto_reductions` reads the shardings the program states (the constraints, carried
through elementwise ops): a product whose lhs is stated sharded on A in its contracting dims and
whose output reaches a constraint not sharded on A is the same psum over A. Where the output's
sharding is stated nowhere, XLA chooses it after the trace: the product is listed with that
reason and left to XLA.

Refused (the product stays XLA's; the reason is what `explain` prints):
  - contracting dims sharded differently on the two operands (XLA moves an operand first);
  - an axis of A held `unreduced` by the output (the user asked for no reduction there);
  - an axis of A that is not Explicit (Auto: XLA chooses the shardings; Manual: inside a
    shard_map, which the rewrite serves itself).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax._src import core
from jax.sharding import AxisType


@dataclasses.dataclass(frozen=True)
class Reduction:
    """A product that needs an all-reduce: its axes (mesh order), or why it is left to XLA."""
    axes: tuple
    mesh: object          # the operands' abstract mesh
    reason: str = ""      # non-empty: not cut (the reason explain prints)
    in_specs: dict | None = None  # Auto axes: operand var -> its spec entries on the axes
    scatter_dim: int | None = None  # a reduce-scatter: the output dim sharded on the axes


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
        return _scatter(contracted, so, mesh, la, ra, out)
    if la != ra:
        return Reduction(red, mesh, f"contracting dimensions sharded differently "
                                    f"({sl.spec} . {sr.spec}): XLA moves an operand first")
    return _checked(red, mesh, so)


def _scatter(contracted, so, mesh, la, ra, out) -> Reduction | None:
    """A product whose output is sharded, along one dim, on exactly the one contracted axis
    (sequence parallelism: tokens sharded on the tensor axis): a reduce-scatter there."""
    axes = {a for a in contracted if mesh.shape[a] > 1}
    if len(axes) != 1 or la != ra:
        return None
    (a,) = axes
    dims = [d for d, e in enumerate(tuple(so.spec)[:out.ndim]) if a in spec_axes(e)]
    if len(dims) != 1 or spec_axes(so.spec[dims[0]]) != (a,):
        return None
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if types[a] != AxisType.Explicit or out.shape[dims[0]] % mesh.shape[a]:
        return None
    return Reduction((a,), mesh, scatter_dim=dims[0])


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


# ---------------------------------------------------------------------------------------------
# Auto axes: the shardings the program states (with_sharding_constraint), propagated simply

_SAME_SHAPE = frozenset((
    "add", "sub", "mul", "div", "neg", "max", "min", "abs", "exp", "log", "tanh", "logistic",
    "sqrt", "rsqrt", "integer_pow", "square", "erf", "select_n", "convert_element_type",
    "copy", "copy_p", "reduce_precision", "sign", "pow",
    "custom_jvp_call", "custom_vjp_call"))  # (activations: jax.nn.relu is a custom_jvp)


def _padded(spec, ndim):
    ents = tuple(spec)[:ndim]
    return ents + (None,) * (ndim - len(ents))


def _constraint_spec(eqn):
    s = eqn.params.get("sharding")
    spec = getattr(s, "spec", None)
    if spec is None or eqn.params.get("unconstrained_dims"):
        return None
    return _padded(spec, eqn.outvars[0].aval.ndim)


def known_specs(jaxpr) -> dict:
    """var -> the PartitionSpec entries the program states for it: a with_sharding_constraint's
    output (and its input), carried forward through same-shape elementwise ops whose known
    inputs agree. What XLA's propagation would choose for the rest is not guessed."""
    known: dict = {}
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name == "sharding_constraint":
            spec = _constraint_spec(e)
            if spec is not None:
                known[e.outvars[0]] = spec
                known.setdefault(e.invars[0], spec)
        elif name in _SAME_SHAPE and len(e.outvars) == 1:
            out = e.outvars[0].aval
            ins = {known[v] for v in e.invars if isinstance(v, core.Var) and v in known
                   and getattr(v.aval, "shape", None) == out.shape}
            if len(ins) == 1:
                known[e.outvars[0]] = ins.pop()
    return known


def _out_spec_after(jaxpr, i, users):
    """The spec of eqn i's output from the first sharding constraint it reaches through
    same-shape elementwise ops (None: XLA chooses it)."""
    v = jaxpr.eqns[i].outvars[0]
    for _ in range(16):
        nxt = users.get(v, [])
        cons = [k for k in nxt if jaxpr.eqns[k].primitive.name == "sharding_constraint"]
        if cons:
            return _constraint_spec(jaxpr.eqns[cons[0]])
        flow = [k for k in nxt if jaxpr.eqns[k].primitive.name in _SAME_SHAPE and
                jaxpr.eqns[k].outvars[0].aval.shape == v.aval.shape]
        if len(flow) != 1:
            return None
        v = jaxpr.eqns[flow[0]].outvars[0]
    return None


def auto_reductions(jaxpr, known=None) -> dict:
    """eqn index -> Reduction for the products on Auto mesh axes whose lhs sharding the
    program states (`known_specs`): contracting dims sharded on axes A, the output's stated
    sharding without them -> a psum over A (`Reduction.in_specs` names the operands' layouts
    on A). A product with a stated lhs but no stated output gets a reason (XLA chooses)."""
    known = known_specs(jaxpr) if known is None else known
    users: dict = {}
    for k, e in enumerate(jaxpr.eqns):
        for v in e.invars:
            if isinstance(v, core.Var):
                users.setdefault(v, []).append(k)
    found = {}
    for i, e in enumerate(jaxpr.eqns):
        if e.primitive.name != "dot_general":
            continue
        lhs, rhs = e.invars[:2]
        s = sharding_of(lhs.aval)
        if s is None or not isinstance(lhs, core.Var) or lhs not in known:
            continue
        mesh = s.mesh
        types = dict(zip(mesh.axis_names, mesh.axis_types))
        (lc, rc), _ = e.params["dimension_numbers"]
        ls = known[lhs]
        A = [a for d in lc for a in spec_axes(ls[d])
             if types.get(a) == AxisType.Auto and mesh.shape[a] > 1]
        if not A:
            continue
        out = _out_spec_after(jaxpr, i, users)
        red = tuple(a for a in mesh.axis_names if a in A and
                    (out is None or a not in {b for x in out for b in spec_axes(x)}))
        if not red:
            continue
        if out is None:
            found[i] = Reduction(red, mesh, "Auto mesh axes: the product's output sharding is "
                                            "chosen by XLA (no with_sharding_constraint after "
                                            "it): whether it all-reduces is not known before")
            continue
        keep = set(red)

        def on(ent):
            axs = tuple(a for a in spec_axes(ent) if a in keep)
            return None if not axs else axs[0] if len(axs) == 1 else axs

        lspec = [None] * lhs.aval.ndim
        rspec = [None] * rhs.aval.ndim
        for dl, dr in zip(lc, rc):
            lspec[dl] = rspec[dr] = on(ls[dl])
        found[i] = Reduction(red, mesh, in_specs={lhs: tuple(lspec), rhs: tuple(rspec)})
    return found


# ---------------------------------------------------------------------------------------------
# the vocab-parallel embedding: table.at[ids].get(out_sharding=...) of a vocab-sharded table

def embedding_axes(eqn, producer) -> tuple | None:
    """For a row `gather` (ids -> rows of a [V, H] table) whose table is a `reshard` that
    removes one Explicit axis A from the vocab dim (jax writes `.at[ids].get(out_sharding=)` of
    a vocab-sharded table so; XLA makes it a masked local gather + all-reduce over A):
    (A, the table before the reshard, the reshard's eqn). None otherwise. `producer(var)` is
    the eqn that made var, or None."""
    if eqn.primitive.name != "gather":
        return None
    p = eqn.params
    dn = p["dimension_numbers"]
    table, idx = eqn.invars[:2]
    if (dn.collapsed_slice_dims != (0,) or dn.start_index_map != (0,) or
            dn.operand_batching_dims or table.aval.ndim != 2 or
            tuple(p["slice_sizes"]) != (1, table.aval.shape[1]) or
            "PROMISE_IN_BOUNDS" not in str(p["mode"]) or idx.aval.shape[-1:] != (1,)):
        return None
    rs = producer(table)
    if rs is None or rs.primitive.name != "reshard":
        return None
    src = rs.invars[0]
    s = sharding_of(src.aval)
    if s is None or axes_of(table.aval) or axes_of(idx.aval):
        return None
    vocab = spec_axes(s.spec[0]) if len(s.spec) else ()
    rest = {a for e in tuple(s.spec)[1:] for a in spec_axes(e)}
    types = dict(zip(s.mesh.axis_names, s.mesh.axis_types))
    if len(vocab) != 1 or rest or types[vocab[0]] != AxisType.Explicit or \
            s.mesh.shape[vocab[0]] <= 1 or src.aval.shape[0] % s.mesh.shape[vocab[0]]:
        return None
    return vocab, src, rs

