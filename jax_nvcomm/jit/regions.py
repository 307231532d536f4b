"""Cutting shard_map regions out of a program sharded by type, so that the rewrite
(`rewrite.evaluate`) serves the all-reduces XLA's partitioner would insert.

`cut(closed)` returns a program computing the same values. Every `dot_general` outside any
shard_map that `sharding.psum_axes` finds (a contraction over Explicit mesh axes A its output is
not sharded on) becomes a region:
    shard_map(manual over A only: axis_names=A, the other axes stay as the types have them)
        y = the local product;  y = lax.psum(y, A)
        then what follows while it stays local: elementwise ops, converts, broadcasts,
        reshapes, reductions, slices (the residual add, the RMSNorm, an FP8 cast), as long as
        no value it reads or makes is sharded on an axis of A
so that the rewrite's matcher sees psum -> add -> RMSNorm in one body (one fused call).
A region ends at the first equation that reads one of its values and cannot join (another
product, a gather, a collective, a call). Values leave it with out_specs replicated over A:
their types, and so their shardings, are the ones the program gave them (what jax.jit gives).
Pure calls (pjit) at the top level are inlined first, so a product in `jnp.einsum` or a norm in
a jitted helper take part. The bodies of higher-order primitives (scan, cond, while, remat)
that hold a product are cut the same way (`_cut_bodies`), and so is a pure call holding only
gathers (jax-llm-examples' router under its own jax.jit): it stays a call, so nothing after it
in the caller joins the region before it.
Also cut, each alone: the gathers `type_gather.gather_of` finds (a `reshard`, or a `reshape` /
`broadcast_in_dim` with out_sharding, taking one dim's group of axes off: an all-gather over
the group, then the equation), a `top_k` on rows sharded by type (`type_gather.local_axes`:
per shard, no collective, where XLA gathers its operand), a product whose output is sharded on
its one contracted axis (a reduce-scatter region), and the vocab-parallel embedding (a masked
local gather + psum).
On Auto axes the products `sharding.auto_reductions` finds are cut the same way, their operands
given the layouts the program states (in_specs), the sharding constraints the region carries
applied again to the values that leave it.
A product `psum_axes` refuses, or one outside any concrete mesh (no `jax.set_mesh`), stays as
it was; `refused(closed)` lists them for `explain`.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax import lax
from jax._src import core, source_info_util
from jax._src import linear_util as lu
from jax._src import mesh as mesh_lib
from jax._src.interpreters import partial_eval as pe
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import rebind as _rb
from . import sharding as _sh
from . import type_gather as _tg
from .eqn import source_of

_CALLS = _rb.CALLS
# equations a region may carry after its product: local on values replicated over its axes
LOCAL = frozenset((
    "add", "add_any", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "exp", "exp2",
    "log", "log1p", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "pow", "integer_pow",
    "square", "erf", "sin", "cos", "select_n", "clamp", "convert_element_type",
    "reduce_precision", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "reduce_sum",
    "reduce_max", "reduce_min", "slice", "copy", "copy_p", "transpose", "stop_gradient",
    "eq", "ne", "lt", "le", "gt", "ge", "is_finite", "round", "floor", "ceil", "reshard",
))


@dataclasses.dataclass
class Region:
    start: int                 # the product's index
    axes: tuple                # mesh axes made manual (the all-reduce's)
    mesh: object               # concrete mesh
    members: list              # eqn indices, in order (start first)
    close: int                 # index of the eqn the region is emitted before (len: at the end)
    in_specs: dict | None = None  # Auto axes: the product's operands' layouts on `axes`
    scatter_dim: int | None = None  # a reduce-scatter region (the product alone)
    gather_dim: int | None = None   # an all-gather region (the reshard / reshape alone)
    local: bool = False           # a region with no collective (a top_k per shard)
    table: object = None          # the embedding form: the vocab-sharded table var
    drop: int | None = None       # ... and its reshard's eqn index (neither emitted)
    inputs: list = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)
    consts: list = dataclasses.field(default_factory=list)  # eqns made again in the body


def _concrete(abstract):
    m = mesh_lib.get_concrete_mesh()
    if m is None or m.empty:
        return None
    if tuple(m.axis_names) != tuple(abstract.axis_names) or \
            tuple(m.axis_sizes) != tuple(abstract.axis_sizes):
        return None
    return m


def _holds_product(jaxpr, gathers=True) -> bool:
    """Whether jaxpr (or a pure call in it) holds a product sharded by type (or, with
    `gathers`, a gather `type_gather` finds), or both a product and a sharding constraint
    (Auto axes: `sharding.auto_reductions` decides)."""
    seen = set()

    def walk(j):
        for e in j.eqns:
            if _sh.psum_axes(e) is not None or (gathers and (
                    _tg.gather_of(e) is not None or _tg.local_axes(e) is not None)):
                return True
            seen.add(e.primitive.name)
            if e.primitive.name in _CALLS and walk(_call_jaxpr(e)):
                return True
            if e.primitive.name not in ("shard_map",) + _CALLS and any(
                    isinstance(j, core.Jaxpr) and _holds_product(j, gathers)
                    for v in e.params.values()
                    for j in (v if isinstance(v, (tuple, list)) else (v,))):
                return True
        return False

    return walk(jaxpr) or {"dot_general", "sharding_constraint"} <= seen or \
        {"gather", "reshard"} <= seen  # (the embedding form)


def _call_consts(eqn):
    return list(_call_jaxpr(eqn).consts)


_call_jaxpr = _rb.call_jaxpr
_bind = _rb.bind


def _inlined(jaxpr, consts, args):
    """Evaluate jaxpr with its pure calls that hold a product inlined (recursively). A call
    holding gathers only stays a call, cut inside (`_cut_bodies`): inlined, what follows it
    in the caller could join the region before it."""
    return _rb.inline_eval(jaxpr, consts, args, _inline)


def _inline(jaxpr) -> bool:
    return _holds_product(jaxpr, gathers=False)


def _trace(fn, jaxpr):
    avals = [v.aval for v in jaxpr.invars]
    new, _, consts = pe.trace_to_jaxpr_dynamic(
        lu.wrap_init(fn, debug_info=jaxpr.debug_info), avals)
    return new, list(consts)


def _axes(v, known) -> frozenset:
    """The mesh axes v is sharded on: by its type, or as the program states (Auto axes)."""
    got = _sh.axes_of(v.aval)
    if v in known:
        got = got | {a for e in known[v] for a in _sh.spec_axes(e)}
    return got


def _first_reader(eqns, i) -> int:
    outs = set(eqns[i].outvars)
    return next((k for k in range(i + 1, len(eqns))
                 if any(isinstance(v, core.Var) and v in outs for v in eqns[k].invars)),
                len(eqns))


def _joinable(eqn, inside: set, axes: frozenset, known: dict) -> bool:
    name = eqn.primitive.name
    if name == "sharding_constraint":  # (Auto axes) kept if it names none of the region's axes
        spec = _sh._constraint_spec(eqn)
        return spec is not None and not any(set(_sh.spec_axes(e)) & axes for e in spec)
    if name not in LOCAL or _sh.psum_axes(eqn) is not None:
        return False  # (a sum needing its own all-reduce starts a region of its own)
    if len({_mesh_types(v) for v in list(eqn.invars) + list(eqn.outvars)} - {None}) > 1:
        return False  # (a reshard onto other axis types, as jax.grad's transposes write:
        #               the body's mesh would retype its result)
    for v in list(eqn.invars) + list(eqn.outvars):
        if isinstance(v, core.Literal) or v in inside:
            continue
        if _axes(v, known) & axes:
            return False
    return not any(_axes(v, known) & axes for v in eqn.outvars)


def _mesh_types(v):
    s = _sh.sharding_of(getattr(v, "aval", None))
    return None if s is None else tuple(s.mesh.axis_types)


_FROM_LITERALS = ("broadcast_in_dim", "convert_element_type", "reshape")


def _from_literals(eqns, made_by, v, depth=0) -> list:
    """The eqns (in order) that make v from literals alone through broadcasts, converts and
    reshapes (`jnp.zeros_like(...).reshape(...)`); [] when v is not made so."""
    k = made_by.get(v)
    if k is None or depth > 4 or eqns[k].primitive.name not in _FROM_LITERALS:
        return []
    chain = []
    for a in eqns[k].invars:
        if isinstance(a, core.Literal):
            continue
        sub = _from_literals(eqns, made_by, a, depth + 1)
        if not sub:
            return []
        chain.extend(sub)
    return chain + [k]


def plan(jaxpr) -> tuple[list, list]:
    """(the regions of `jaxpr`'s top level, the refused products as (eqn, reason))."""
    eqns = jaxpr.eqns
    regions, refused, taken = [], [], set()
    known = _sh.known_specs(jaxpr)
    auto = _sh.auto_reductions(jaxpr, known)
    made_by = {v: k for k, e in enumerate(eqns) for v in e.outvars}
    nusers: dict = {}
    for e in eqns:
        for v in e.invars:
            if isinstance(v, core.Var):
                nusers[v] = nusers.get(v, 0) + 1
    for i, eqn in enumerate(eqns):
        if i in taken:
            continue
        emb = _sh.embedding_axes(eqn, lambda v: eqns[made_by[v]] if v in made_by else None)
        if emb is not None and nusers.get(eqn.invars[0], 0) == 1 and \
                eqn.invars[0] not in jaxpr.outvars:
            axes_e, table, rs = emb
            red = _sh.Reduction(axes_e, table.aval.sharding.mesh)
        else:
            emb = None
            red = _sh.psum_axes(eqn) or auto.get(i)
            ag = _tg.gather_of(eqn) if red is None else None
            if ag is not None and _concrete(eqn.invars[0].aval.sharding.mesh) is not None:
                regions.append(Region(i, ag.axes, _concrete(eqn.invars[0].aval.sharding.mesh),
                                      [i], _first_reader(eqns, i), gather_dim=ag.dim))
                taken.add(i)
                continue
            la = _tg.local_axes(eqn) if red is None and ag is None else None
            if la is not None and _concrete(eqn.invars[0].aval.sharding.mesh) is not None:
                regions.append(Region(i, la, _concrete(eqn.invars[0].aval.sharding.mesh),
                                      [i], _first_reader(eqns, i), local=True))
                taken.add(i)
                continue
        if red is None:
            continue
        if red.reason:
            refused.append((eqn, red))
            continue
        mesh = _concrete(red.mesh)
        if mesh is None:
            refused.append((eqn, dataclasses.replace(red, reason=(
                "no concrete mesh matching the arrays' is set: call it under "
                "jax.set_mesh(mesh)"))))
            continue
        axes = frozenset(red.axes)
        members, inside, close = [i], set(eqn.outvars), len(eqns)
        for k in range(i + 1, len(eqns)):
            e = eqns[k]
            if not any(isinstance(v, core.Var) and v in inside for v in e.invars):
                continue
            if k not in taken and red.scatter_dim is None and \
                    _joinable(e, inside, axes, known):
                members.append(k)
                inside.update(e.outvars)
            else:
                close = k
                break
        taken.update(members)
        reg = Region(i, red.axes, mesh, members, close, red.in_specs, red.scatter_dim)
        if emb is not None:
            reg.table, reg.drop = emb[1], made_by[eqn.invars[0]]
            taken.add(reg.drop)
        regions.append(reg)
    # inputs (defined outside, in first-use order) and outputs (used after) of each region
    for reg in regions:
        mem = set(reg.members)
        made = {v for k in reg.members for v in eqns[k].outvars}
        seen = [reg.table] if reg.table is not None else []
        for k in reg.members:
            for j, v in enumerate(eqns[k].invars):
                if k == reg.start and j == 0 and reg.table is not None:
                    continue
                if isinstance(v, core.Var) and v not in made and v not in seen:
                    chain = _from_literals(eqns, made_by, v)
                    if chain:  # (a zero mean: the matcher sees it as the literal it is)
                        reg.consts.extend(k2 for k2 in chain if k2 not in reg.consts)
                        made.update(o for k2 in chain for o in eqns[k2].outvars)
                    else:
                        seen.append(v)
        reg.inputs = seen
        used_after = set(v for v in jaxpr.outvars if isinstance(v, core.Var))
        for k, e in enumerate(eqns):
            if k not in mem and k != reg.drop:
                used_after.update(v for v in e.invars if isinstance(v, core.Var))
        reg.outputs = [v for k in reg.members for v in eqns[k].outvars
                       if v in used_after]
    return regions, refused


def _local_spec(aval, axes: frozenset):
    """The in_spec of a region input: its dims' sharding restricted to the manual axes."""
    s = _sh.sharding_of(aval)
    if s is None:
        return P()
    ents = []
    for e in tuple(s.spec) + (None,) * (aval.ndim - len(s.spec)):
        keep = tuple(a for a in _sh.spec_axes(e) if a in axes)
        ents.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return P(*ents)


def _params_inside(params):
    """Sharding parameters rebuilt on the mesh of the body (its manual axes marked)."""
    out = dict(params)
    am = mesh_lib.get_abstract_mesh()
    for k, v in params.items():
        if isinstance(v, NamedSharding) and am is not None and not am.empty:
            out[k] = NamedSharding(am, v.spec)
    return out


def _masked_rows(eqn, table, idx, axis):
    """This rank's part of the rows of a vocab-sharded table: rows it holds, zero elsewhere
    (the psum after it adds the parts)."""
    import jax.numpy as jnp
    rows = table.shape[0]
    loc = idx[..., 0] - lax.axis_index(axis).astype(idx.dtype) * rows
    ok = (loc >= 0) & (loc < rows)
    got = jnp.take(table, jnp.clip(loc, 0, rows - 1), axis=0)
    return jnp.where(ok[..., None], got, jnp.zeros((), got.dtype)).astype(eqn.outvars[0].aval.dtype)


def _emit(reg, jaxpr, read):
    """Bind the shard_map of one region; returns {outvar: value}."""
    eqns = jaxpr.eqns
    axes = frozenset(reg.axes)
    given = reg.in_specs or {}
    in_specs = tuple(P(*given[v]) if v in given else _local_spec(v.aval, axes)
                     for v in reg.inputs)
    out_specs = tuple(_local_spec(v.aval, axes) if reg.local else P() for v in reg.outputs)
    if reg.scatter_dim is not None:  # the product alone, sharded on the axis along that dim
        ents = [None] * eqns[reg.start].outvars[0].aval.ndim
        ents[reg.scatter_dim] = reg.axes[0]
        out_specs = (P(*ents),)

    def body(*args):
        env = dict(zip(reg.inputs, args))

        def rd(v):
            if isinstance(v, core.Literal):  # a scalar as a Python number: no reshard of it
                return v.val.item() if np.ndim(v.val) == 0 and hasattr(v.val, "item") \
                    else v.val                # onto the body's mesh (which hides eps)
            return env[v]

        if reg.gather_dim is not None:  # the gather, then the equation on what it gathered
            e, group = eqns[reg.start], reg.axes[0] if len(reg.axes) == 1 else reg.axes
            g = lax.all_gather(args[0], group, axis=reg.gather_dim, tiled=True)
            outs = (g,) if e.primitive.name == "reshard" else \
                tuple(_bind(e, [g], _params_inside(e.params), body=True))
            return outs if reg.outputs else ()  # (a result nothing reads)
        if reg.local:  # the equation on this shard's rows, nothing to move
            e = eqns[reg.start]
            env.update(zip(e.outvars, _bind(e, list(args), _params_inside(e.params), body=True)))
            return tuple(env[v] for v in reg.outputs)
        for k in reg.consts:
            e = eqns[k]
            env.update(zip(e.outvars, _bind(e, [rd(v) for v in e.invars],
                                            _params_inside(e.params), body=True)))
        for k in reg.members:
            e = eqns[k]
            if e.primitive.name == "sharding_constraint":  # stated again where it leaves
                env[e.outvars[0]] = rd(e.invars[0])
                continue
            if k == reg.start and reg.table is not None:
                outs = [_masked_rows(e, env[reg.table], rd(e.invars[1]), reg.axes[0])]
            else:
                outs = _bind(e, [rd(v) for v in e.invars], _params_inside(e.params), body=True)
            if k == reg.start:
                name_stack = source_info_util.current_name_stack() + e.source_info.name_stack
                with source_info_util.user_context(e.source_info.traceback,
                                                   name_stack=name_stack):
                    outs = [lax.psum(outs[0], reg.axes) if reg.scatter_dim is None else
                            lax.psum_scatter(outs[0], reg.axes[0], tiled=True,
                                             scatter_dimension=reg.scatter_dim)]
            env.update(zip(e.outvars, outs))
        return tuple(env[v] for v in reg.outputs)

    start = eqns[reg.start]
    name_stack = source_info_util.current_name_stack() + start.source_info.name_stack
    with source_info_util.user_context(start.source_info.traceback, name_stack=name_stack):
        outs = jax.shard_map(body, mesh=reg.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=axes,  # (all_gather's result is typed varying)
                             check_vma=reg.gather_dim is None and not reg.local)(
                                 *[read(v) if reg.gather_dim is None else
                                   _tg.sharded_on_group(read(v), reg.axes, reg.gather_dim)
                                   for v in reg.inputs])
    made = {v: k for k in reg.members for v in eqns[k].outvars}
    res = {}
    for v, o in zip(reg.outputs, outs):
        e = eqns[made[v]]
        res[v] = _bind(e, [o])[0] if e.primitive.name == "sharding_constraint" else o
        if reg.gather_dim is not None and jax.typeof(o).sharding.spec != v.aval.sharding.spec:
            res[v] = jax.sharding.reshard(o, v.aval.sharding.spec)  # (size-1 axes only)
    return res


def _cut_bodies(eqn):
    """eqn's parameters with the bodies of a scan / cond / while / remat that hold a product
    sharded by type cut too, and the jaxpr of a pure call left a call (one holding gathers
    only) cut (None: nothing to cut)."""
    if eqn.primitive.name in _CALLS:
        j = _call_jaxpr(eqn)
        key = "jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"
        new = cut(j) if _holds_product(j) else j
        return None if new is j else dict(eqn.params, **{key: new})
    if eqn.primitive.name == "shard_map":
        return None
    params, changed = dict(eqn.params), False
    for k, v in eqn.params.items():
        subs = v if isinstance(v, (tuple, list)) else (v,)
        if not all(isinstance(j, core.Jaxpr) for j in subs) or not subs:
            continue
        new = [cut(j) if _holds_product(j) else j for j in subs]
        if any(n is not j for n, j in zip(new, subs)):
            params[k] = type(v)(new) if isinstance(v, (tuple, list)) else new[0]
            changed = True
    return params if changed else None


def _evaluate(jaxpr, consts, args, regions):
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    at = {}
    for reg in regions:
        at.setdefault(reg.close, []).append(reg)
    member = {k for reg in regions for k in reg.members} | \
        {reg.drop for reg in regions if reg.drop is not None}
    for i, eqn in enumerate(jaxpr.eqns):
        for reg in at.get(i, ()):
            env.update(_emit(reg, jaxpr, read))
        if i in member:
            continue
        env.update(zip(eqn.outvars, _bind(eqn, [read(v) for v in eqn.invars],
                                          _cut_bodies(eqn))))
    for reg in at.get(len(jaxpr.eqns), ()):
        env.update(_emit(reg, jaxpr, read))
    return [read(v) for v in jaxpr.outvars]


def cut(closed):
    """`closed` (a jaxpr with its constants) with its type-sharded row-parallel products cut into shard_map
    regions (module docstring); `closed` itself when there is none."""
    jaxpr = closed.jaxpr
    if not _holds_product(jaxpr):
        return closed
    consts = list(closed.consts)
    if any(e.primitive.name in _CALLS and _inline(_call_jaxpr(e)) for e in jaxpr.eqns):
        flat, fconsts = _trace(lambda *a: _inlined(jaxpr, consts, a), jaxpr)
    else:  # nothing to inline: one trace fewer
        flat, fconsts = jaxpr, consts
    regions, _ = plan(flat)
    if not regions and not any(_cut_bodies(e) is not None for e in flat.eqns):
        return closed
    new, nconsts = _trace(lambda *a: _evaluate(flat, fconsts, a, regions), flat)
    return core.Jaxpr(new, nconsts) if nconsts else new


def refused(closed) -> dict:
    """{source line: reason} of the products of `closed` (as `cut` left it) that need an
    all-reduce and were not cut."""
    jaxpr = closed.jaxpr
    if not _holds_product(jaxpr):
        return {}
    consts = list(closed.consts)
    flat, _ = _trace(lambda *a: _inlined(jaxpr, consts, a), jaxpr)
    _, ref = plan(flat)
    return {source_of(e): f"a product sharded by type, left to XLA: {r.reason}" for e, r in ref}


def annotate(rows: list, closed) -> list:
    """explain's rows of the collectives XLA inserted, with the reason for those at the line of
    a product `cut` refused (in place of the general one)."""
    why = refused(closed)
    for r in rows:
        if r.get("source") in why:
            r["reason"] = why[r["source"]]
    return rows
