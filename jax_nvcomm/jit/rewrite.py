"""The jaxpr pass behind `jax_nvcomm.jit`: evaluate a program's jaxpr, re-binding every
primitive as it is, except XLA's collectives inside `shard_map` bodies, which are bound as our
ops where we have a kernel for them (the custom-interpreter pattern of jax's docs; nothing in
lax is patched).

What is replaced (inside a shard_map body, at any depth of pjit / scan / cond / while /
checkpoint / custom_jvp / custom_vjp nesting):
  - `psum` / `psum_invariant` of floats over one axis or a tuple of axes -> `all_reduce`
    (pmean is psum + a division: the division stays);
  - psum -> add of a residual -> RMSNorm (`norm`) -> one `all_reduce_rms_norm` (with a
    per-token FP8 cast after it: `all_reduce_rms_norm_quant`); also where the psum ends a
    shard_map body and the add and the norm come after it, outside (`exit_fusion`);
  - `all_gather`, `reduce_scatter` (lax.psum_scatter, any dim), `all_to_all`,
    `ragged_all_to_all` -> our ops (`gather_scatter`: the forms and what it refuses);
  - `lax.ragged_dot` in its MoE form (lhs [M, K] rows by group, rhs [G, K, N]) -> `ragged_dot`
    where `select_ragged_dot_strategy` picks the kernel, and its 8-bit-weight forms (int8 rhs,
    a dequantised weight feeding only the product) -> the 8-bit-weight call (`jit/ragged_dot.py`
    says which forms; a local op: each replaced one is a Site with op "ragged_dot").
Everything else, and every collective our ops cannot serve (integers, sizes XLA does better by
the strategy table, messages over the buffers, axis_index_groups, ...), is bound as it was;
each decision is a `Site` (op, source line, shape, dtype, axes, what it became and why) that
`explain` prints.

Two walks share the decisions' inputs: `needs(jaxpr)` (outside any trace: which communicators
the program wants and how large, for `_pool`) and `evaluate(...)` (inside jax.jit's trace: the
rewrite itself, given the communicators).
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core, source_info_util
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe

from . import gather_scatter as _gs
from .axes import mesh_label
from . import exit_fusion as _exit
from . import norm as _norm
from . import ragged_dot as _rdot
from . import rebind as _rb
from .eqn import like as _like
from .eqn import site_of, source_of, stack_of

PSUMS = ("psum", "psum_invariant")
_CALLS = _rb.CALLS
SERVED = PSUMS + ("all_gather", "reduce_scatter", "ragged_all_to_all", "all_to_all")
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_LAX_NAME = {"psum": "psum", "psum_invariant": "psum", "all_gather": "all_gather",
             "reduce_scatter": "psum_scatter", "ragged_all_to_all": "ragged_all_to_all",
             "all_to_all": "all_to_all", "ppermute": "ppermute"}
# collectives inside a shard_map body that no op of ours takes: listed by explain, ordered
# against our calls (`_ordered`)
UNSERVED = ("ppermute", "pbroadcast", "psum_scatter", "all_gather_invariant", "pgather")
_GATHER_SCATTER = {"all_gather": _gs.all_gather, "reduce_scatter": _gs.reduce_scatter,
                   "ragged_all_to_all": _gs.ragged_all_to_all, "all_to_all": _gs.all_to_all}


# ---------------------------------------------------------------------------------------------
# what a decision records

@dataclasses.dataclass
class Site:
    """One collective of the program and what became of it (a row of `explain`)."""
    op: str                 # lax's name: psum, all_gather, psum_scatter, ragged_all_to_all, ...
    source: str             # file:line of the user's call
    shape: tuple
    dtype: str
    axes: tuple
    became: str = "xla"     # our op (+ strategy), or "xla"
    fused_with: str = ""    # e.g. "add (model.py:12) + rms_norm (norm.py:30)"
    reason: str = ""
    fixable: bool = False   # a reason the user can act on (warned once per call site)
    mesh: str = ""          # the shard_map's own mesh, with its axis names and sizes
    stack: tuple = ()       # every user frame of the call, innermost first ("file:line (fn)")
    where: tuple | None = dataclasses.field(default=None, repr=False)  # (file, line)
    mesh_obj: object = dataclasses.field(default=None, repr=False)  # for explain's HLO rows

    def row(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.pop("where")
        d.pop("mesh_obj")
        return d


_warned: set = set()


def _warn(site: Site) -> None:
    """A fallback the user could fix: one warning per call site (JAX_NVCOMM_QUIET=1: none),
    issued at the collective's own source line."""
    from .. import _warn as warn
    if not site.fixable or warn.quiet():
        return
    file, line = site.where or ("<unknown>", 0)
    key = (file, line, site.op, site.reason)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn_explicit(
        f"jax_nvcomm.jit: {site.op} at {site.source} ({site.dtype}{list(site.shape)} over "
        f"{site.axes}) stays XLA's: {site.reason} (JAX_NVCOMM_QUIET=1 silences this)",
        warn.XlaPathWarning, file, line)


def reset_warnings() -> None:
    """Forget which call sites warned (tests)."""
    _warned.clear()
    _rdot.reset_warnings()


# ---------------------------------------------------------------------------------------------
# walking jaxprs

def sub_jaxprs(params):
    """(name, index or None, jaxpr) of every jaxpr-valued parameter (a jaxpr may carry
    constants: jax's Jaxpr holds them since ClosedJaxpr was folded into it)."""
    for k, v in params.items():
        if isinstance(v, core.Jaxpr):
            yield k, None, v
        elif isinstance(v, (tuple, list)):
            for i, b in enumerate(v):
                if isinstance(b, core.Jaxpr):
                    yield k, i, b


_has_cache: dict = {}


def has_collectives(jaxpr) -> bool:
    """Whether `jaxpr` (or a sub-jaxpr) holds a collective we might replace (or a ragged_dot
    of the MoE form: the walks reach it the same way)."""
    key = id(jaxpr)
    hit = _has_cache.get(key)
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    found = any(e.primitive.name in SERVED or e.primitive.name in UNSERVED or
                _rdot.is_moe_form(e) or
                any(has_collectives(j) for _, _, j in sub_jaxprs(e.params))
                for e in jaxpr.eqns)
    if len(_has_cache) > 4096:
        _has_cache.clear()
    _has_cache[key] = (jaxpr, found)
    return found


def concrete_mesh(mesh):
    """A concrete `jax.sharding.Mesh` for a shard_map's mesh parameter, or None."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    try:
        from jax._src import mesh as mesh_lib
        m = mesh_lib.get_concrete_mesh()
        if m is not None and not m.empty and tuple(m.axis_names) == tuple(mesh.axis_names) \
                and tuple(m.axis_sizes) == tuple(mesh.axis_sizes):
            return m
    except Exception:  # pragma: no cover - a jax without it
        pass
    return None


def comm_axes(mesh, axes) -> tuple:
    """The mesh axes a collective over `axes` spans, as it names them: the key of its
    communicator (empty when they are not all mesh axes)."""
    axes = tuple(axes)
    if not axes or not all(isinstance(a, str) and a in mesh.axis_names for a in axes):
        return ()
    return axes


def _world(mesh, axes) -> int:
    """The number of devices a collective over `axes` (axes of `mesh`) spans."""
    return int(np.prod([int(mesh.shape[a]) for a in axes], dtype=np.int64))


def _axes_of(eqn) -> tuple:
    p = eqn.params
    a = p.get("axes", p.get("axis_name"))
    return tuple(a) if isinstance(a, (tuple, list)) else (a,)


# ---------------------------------------------------------------------------------------------
# needs: which communicators a program wants (outside any trace)

@dataclasses.dataclass
class Need:
    mesh: object            # jax.sharding.Mesh
    axes: tuple             # mesh axes, size-1 axes left out
    nbytes: int             # the largest message bytes per rank (ragged ones aside)
    order: int              # program order of its first collective
    allreduce_bytes: int = 0  # the largest all-reduce message (the one-shot slot should hold
                              # it, as it would on a default-sized Communicator)
    ragged_bytes: int = 0   # the max_message_bytes the largest ragged_all_to_all (or all_to_all)
                            # would need for one round; the chunked path serves it with less


def _message_bytes(eqn, mesh, axes) -> int:
    """Bytes per rank the buffers must hold for `eqn` (0: our ops do not take it)."""
    name = eqn.primitive.name
    world = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
    if name in PSUMS:
        return max((int(v.aval.size) * v.aval.dtype.itemsize for v in eqn.invars
                    if jnp.dtype(v.aval.dtype) in _FLOATS), default=0)
    av = eqn.invars[0].aval
    n = int(av.size) * av.dtype.itemsize
    if name == "all_gather":
        return n * world
    if name == "reduce_scatter":
        return n
    if name == "all_to_all":
        from .. import _ffi
        rows = max(int(av.shape[0]), 1) if av.ndim else 1
        row = n // rows
        need = 4096
        while not _ffi._host.ragged_fits(need, world, rows, row, 1) and need < (1 << 40):
            need *= 2
        return need
    if name == "ragged_all_to_all":
        from .. import _ffi
        out = eqn.invars[1].aval
        row = int(np.prod(av.shape[1:], dtype=np.int64)) * av.dtype.itemsize
        k = max(1, int(eqn.invars[2].aval.shape[0]) // max(world, 1))
        rows = max(int(av.shape[0]), int(out.shape[0]))  # the backward pass lands in operand
        need = 4096
        while not _ffi._host.ragged_fits(need, world, rows, row, k) and need < (1 << 40):
            need *= 2
        return need
    return 0


def needs(jaxpr) -> list[Need]:
    """The communicators `jaxpr`'s collectives inside shard_map want, in program order."""
    found: dict = {}
    counter = [0]

    def walk(jx, mesh):
        for eqn in jx.eqns:
            name = eqn.primitive.name
            counter[0] += 1
            if name == "shard_map":
                walk(eqn.params["jaxpr"], concrete_mesh(eqn.params["mesh"]) or mesh)
                continue
            if name in SERVED and mesh is not None:
                if eqn.params.get("axis_index_groups") is not None:
                    continue
                axes = comm_axes(mesh, _axes_of(eqn))
                if not axes or (name in PSUMS and _world(mesh, axes) == 1):
                    continue  # (a psum over axes of size 1 is the identity: XLA's)
                nb = _message_bytes(eqn, mesh, axes)
                if nb <= 0:
                    continue
                key = (mesh, axes)
                if key not in found:
                    found[key] = Need(mesh, axes, 0, counter[0])
                if name in ("ragged_all_to_all", "all_to_all"):
                    found[key].ragged_bytes = max(found[key].ragged_bytes, nb)
                else:
                    found[key].nbytes = max(found[key].nbytes, nb)
                if name in PSUMS:
                    found[key].allreduce_bytes = max(found[key].allreduce_bytes, nb)
                continue
            for _, _, sub in sub_jaxprs(eqn.params):
                if has_collectives(sub):
                    walk(sub, mesh)

    walk(jaxpr, None)
    return sorted(found.values(), key=lambda n: n.order)


# ---------------------------------------------------------------------------------------------
# the rewrite (inside jax.jit's trace)

@dataclasses.dataclass
class Ctx:
    """The state of one rewrite: the communicators (`lookup(mesh, axes) -> (comm, reason)`),
    the records (a list of Site, or None), and the innermost shard_map's mesh."""
    lookup: object
    records: list | None
    mesh: object = None
    manual: frozenset = frozenset()
    ordered: bool = True    # XLA's collectives tied into our calls' order (`_xla`)

    def inside(self, mesh, manual, ordered=True):
        return dataclasses.replace(self, mesh=mesh, manual=self.manual | frozenset(manual),
                                   ordered=ordered)


_bind = _rb.bind


def _retrace(jaxpr, ctx):
    """A new jaxpr computing `jaxpr` (with its constants) with the rewrite applied, taking
    the same inputs; constants the rewrite adds are attached to it."""
    avals = [v.aval for v in jaxpr.invars]
    consts = list(jaxpr.consts)

    def fn(*args):
        return evaluate(jaxpr, consts, args, ctx)

    new, _, new_consts = pe.trace_to_jaxpr_dynamic(
        lu.wrap_init(fn, debug_info=jaxpr.debug_info), avals)
    if new_consts:
        new = core.Jaxpr(new, list(new_consts))
    return new


def _rebind_with_rewrite(eqn, invals, ctx):
    """Bind a higher-order primitive with each of its sub-jaxprs that hold collectives
    rewritten (the rest of its parameters as they were)."""
    params = dict(eqn.params)
    for k, i, sub in list(sub_jaxprs(eqn.params)):
        if not has_collectives(sub):
            continue
        new = _retrace(sub, ctx)
        if i is None:
            params[k] = new
        else:
            seq = list(params[k])
            seq[i] = new
            params[k] = type(eqn.params[k])(seq)
    return _bind(eqn, invals, params)


def _shard_map(eqn, invals, ctx):
    p = eqn.params
    mesh = concrete_mesh(p["mesh"])
    body = p["jaxpr"]
    inner = ctx.inside(mesh, p.get("newly_manual_axes", frozenset()),
                       ordered=mesh is not None and _may_call_ours(body, mesh, ctx.lookup))

    def fn(*args):
        return tuple(evaluate(body, (), args, inner))

    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    # eqn.ctx holds the abstract mesh the shard_map was traced under: a shard_map over a
    # second Mesh of the same devices (under `use_abstract_mesh`) is bound under its own
    # mesh, not the program's outer one
    with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
          eqn.ctx.manager):
        outs = jax.shard_map(fn, mesh=p["mesh"], in_specs=tuple(p["in_specs"]),
                             out_specs=tuple(p["out_specs"]),
                             axis_names=frozenset(p.get("newly_manual_axes", frozenset())),
                             check_vma=p["check_vma"])(*invals)
    return list(outs)


_worth_cache: dict = {}


def _worth_inlining(jaxpr) -> bool:
    """Whether a jitted helper may take part in a rewrite: it holds a collective, or the ops
    of an add + RMSNorm (so that a psum in one helper and the norm in another fuse). Others
    (a sort, the routing) keep their call, so the program XLA sees, and so its schedule, stay
    those of jax.jit."""
    hit = _worth_cache.get(id(jaxpr))
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    names = set()

    def walk(j):
        for e in j.eqns:
            names.add(e.primitive.name)
            for _, _, sub in sub_jaxprs(e.params):
                walk(sub)
            if e.primitive.name in _CALLS:
                walk(_call_jaxpr(e))

    walk(jaxpr)
    worth = has_collectives(jaxpr) or bool(names & {"rsqrt", "sqrt"})
    if len(_worth_cache) > 4096:
        _worth_cache.clear()
    _worth_cache[id(jaxpr)] = (jaxpr, worth)
    return worth


def _inline_eval(jaxpr, consts, args):
    """Evaluate jaxpr with the pjit calls in it that may take part in a rewrite inlined
    (recursively, `_worth_inlining`), nothing else changed."""
    return _rb.inline_eval(jaxpr, consts, args, _worth_inlining)


def _flatten(jaxpr, consts):
    """(jaxpr with its pjit calls inlined, traced in the current context, its constants):
    so that a psum in one jitted helper and the add + norm in another are one body."""
    avals = [v.aval for v in jaxpr.invars]
    consts = list(consts or jaxpr.consts)

    def fn(*args):
        return _inline_eval(jaxpr, consts, args)

    new, _, new_consts = pe.trace_to_jaxpr_dynamic(
        lu.wrap_init(fn, debug_info=jaxpr.debug_info), avals)
    return new, list(new_consts)


def evaluate(jaxpr, consts, args, ctx):
    """Evaluate `jaxpr` on `args` (tracers of the current trace), rewriting its collectives
    inside shard_map bodies (module docstring). Returns the outputs as a list."""
    if ctx.mesh is not None and any(e.primitive.name in _CALLS for e in jaxpr.eqns) and \
            has_collectives(jaxpr):
        jaxpr, consts = _flatten(jaxpr, consts)
    env: dict = {}
    lazy: dict = {}   # var -> _norm.Fused whose firing binds it

    def read(v):
        if isinstance(v, core.Literal):
            return v.val
        if v in lazy:
            lazy.pop(v).fire(read, env, lazy)
        return env[v]

    for v, a in zip(jaxpr.constvars, consts or jaxpr.consts):
        env[v] = a
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    skip: set = set()
    fusions = {}
    if ctx.mesh is not None:
        fusions = _norm.plan(jaxpr)
    exits = _exit.plan(jaxpr)  # a psum ending a shard_map body + add + norm after it
    for i, eqn in enumerate(jaxpr.eqns):
        if i in skip:
            continue
        name = eqn.primitive.name
        if name in SERVED and ctx.mesh is not None:
            fused = fusions.get(i)
            if isinstance(fused, _norm.Fused) and name in PSUMS:
                site, fire = _fused_decision(eqn, fused, ctx, jaxpr)
                if fire is not None:
                    _record(ctx, site)
                    skip.update(fused.skip)
                    for v in fire.binds:
                        lazy[v] = fire
                    continue
            note = fused.note if fused is not None else ""
            outs = _collective(eqn, [read(v) for v in eqn.invars], ctx, note,
                               isinstance(fused, _norm.Miss))
        elif name in UNSERVED and ctx.mesh is not None:
            site = _site(eqn, eqn.invars[0].aval, ctx)
            site.reason = f"no jax_nvcomm kernel for {site.op}"
            _record(ctx, site)
            outs = _xla(eqn, [read(v) for v in eqn.invars], ctx)
        elif name in SERVED:  # no shard_map around it in this program: called inside one
            site = _site(eqn, eqn.invars[0].aval, ctx)
            site.reason = ("nvc.jit was applied inside a shard_map body, where its program has "
                           "no shard_map to rewrite: apply nvc.jit to the function that calls "
                           "shard_map")
            site.fixable = True
            _record(ctx, site)
            outs = _bind(eqn, [read(v) for v in eqn.invars])
        elif _rdot.is_moe_form(eqn):
            done = _rdot.rewrite(eqn, jaxpr, read, ctx.mesh is not None)
            if done is None:
                outs = _bind(eqn, [read(v) for v in eqn.invars])
            else:
                outs, row = done
                row.setdefault("mesh", mesh_label(ctx.mesh))
                row.setdefault("stack", stack_of(eqn))
                row.setdefault("mesh_obj", ctx.mesh)
                _record(ctx, Site(**row))
        elif name == "shard_map" and i in exits:
            fire = _exit.Fire(exits[i], eqn, ctx, _exit_hooks())
            skip.update(exits[i].skip)
            lazy.update(dict.fromkeys(fire.binds, fire))
            continue
        elif name == "shard_map" and has_collectives(eqn.params["jaxpr"]):
            outs = _shard_map(eqn, [read(v) for v in eqn.invars], ctx)
        elif name in _CALLS and ctx.mesh is not None and \
                has_collectives(_call_jaxpr(eqn)):
            # a jitted helper inside a shard_map body: inlined, so that a psum in one helper
            # and the add + norm in another still fuse (values are the same either way)
            sub = _call_jaxpr(eqn)
            outs = _inline(eqn, sub, sub.consts, [read(v) for v in eqn.invars], ctx)
        elif any(has_collectives(j) for _, _, j in sub_jaxprs(eqn.params)):
            outs = _rebind_with_rewrite(eqn, [read(v) for v in eqn.invars], ctx)
        else:
            outs = _bind(eqn, [read(v) for v in eqn.invars])
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _size_one(ctx, axes) -> bool:
    """Whether `axes` are axes of the current shard_map's mesh that span one device."""
    return ctx.mesh is not None and bool(comm_axes(ctx.mesh, axes)) and \
        _world(ctx.mesh, comm_axes(ctx.mesh, axes)) == 1


def _xla(eqn, invals, ctx):
    """Bind an XLA collective that stays: plainly where no call of ours can run beside it (over
    axes of size 1, or in a body with no call of ours: `_may_call_ours`), so that XLA combines
    and schedules it as under jax.jit; else tied into our calls' order (`_ordered`)."""
    if not ctx.ordered or _size_one(ctx, _axes_of(eqn)):
        return _bind(eqn, invals)
    return _ordered(eqn, invals)


def _may_call_ours(jaxpr, mesh, lookup) -> bool:
    """Whether a shard_map body over `mesh` may hold a call of ours: a collective the pass may
    serve (a communicator for its axes exists, more than one device), or an op of ours called
    directly (an FFI call or one of our primitives), at any depth. Conservative: True where
    unsure."""
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name.startswith("nvc_") or "ffi" in name or name == "custom_call":
            return True
        if name in SERVED and e.params.get("axis_index_groups") is None and (
                name not in PSUMS or any(jnp.dtype(v.aval.dtype) in _FLOATS
                                         for v in e.invars)):
            axes = comm_axes(mesh, _axes_of(e))
            if axes and _world(mesh, axes) > 1 and lookup(mesh, axes)[0] is not None:
                return True
        for _, _, sub in sub_jaxprs(e.params):
            if _may_call_ours(sub, mesh, lookup):
                return True
        if name in _CALLS and _call_jaxpr(e) is not None and \
                _may_call_ours(_call_jaxpr(e), mesh, lookup):
            return True
    return False
def _exit_hooks():
    return _exit.Hooks(evaluate=evaluate, decide=_fused_decision, collective=_collective,
                       record=_record, bind=_bind, concrete_mesh=concrete_mesh)


def _ordered(eqn, invals):
    """Bind an XLA collective that stays in a shard_map body, in the order chain of our calls
    (`_order`): its operands depend on the latest call's token and the next call's token on
    its result, through arithmetic that changes no value (x + -0.0 is x for every x; the
    token carries no data, so its value may change).
    Without this, a device may run it and one of our calls in the other order than its peers
    (XLA:CPU runs independent ops concurrently), each waiting for the other: a deadlock."""
    from .. import _order
    axes = [a for a in _axes_of(eqn) if isinstance(a, str)]
    if not axes or not invals:
        return _bind(eqn, invals)
    tok = _order.token(axes[0])
    # the token's bytes are never written (any value, NaN too): a -0.0 computed from it that
    # XLA cannot fold away, whatever the token holds (x + -0.0 is x for every x)
    t = tok[0]
    zero = -(jnp.abs(jnp.where(jnp.isfinite(t), t, jnp.float32(0))) * jnp.float32(0))

    def tie(x):
        if not hasattr(x, "dtype") or jnp.size(x) == 0:
            return x
        dt = jnp.dtype(x.dtype)
        if jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer):
            return x + zero.astype(dt)
        return x

    outs = _bind(eqn, [tie(x) for x in invals])
    first = next((o for o in outs if hasattr(o, "dtype") and jnp.size(o) > 0 and (
        jnp.issubdtype(o.dtype, jnp.floating) or jnp.issubdtype(o.dtype, jnp.integer))), None)
    if first is not None:
        _order.record(tok + jnp.reshape(first, (-1,))[:1].astype(jnp.float32))
    return outs


_call_jaxpr = _rb.call_jaxpr


def _inline(eqn, sub, consts, invals, ctx):
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        return evaluate(sub, consts, invals, ctx)


def _record(ctx, site):
    if ctx.records is not None:
        ctx.records.append(site)
    _warn(site)


def _site(eqn, aval, ctx):
    return Site(op=_LAX_NAME.get(eqn.primitive.name, eqn.primitive.name), source=source_of(eqn),
                shape=tuple(aval.shape), dtype=str(aval.dtype), axes=_axes_of(eqn),
                mesh=mesh_label(ctx.mesh), stack=stack_of(eqn), where=site_of(eqn),
                mesh_obj=ctx.mesh)


def _comm_for(eqn, site, ctx):
    """(the communicator for eqn's axes, or None with site.reason set)."""
    if eqn.params.get("axis_index_groups") is not None:
        site.reason = "axis_index_groups is not taken by the rewrite"
        return None
    if ctx.mesh is None:
        site.reason = ("the shard_map's mesh is abstract and no concrete mesh is set "
                       "(pass mesh= to shard_map or use jax.set_mesh)")
        return None
    axes = comm_axes(ctx.mesh, site.axes)
    if not axes:
        site.reason = f"axes {site.axes} are not all axes of the mesh {dict(ctx.mesh.shape)}"
        return None
    comm, why = ctx.lookup(ctx.mesh, axes)
    if comm is None:
        site.reason = why
        return None
    return comm


def _local(comm, x, dims):
    from .. import _shard
    return _shard.local_shape(comm, x, dims)


def _collective(eqn, invals, ctx, note="", fixable=False):
    name = eqn.primitive.name
    if name in PSUMS:
        return _psum(eqn, invals, ctx, note, fixable)
    site = _site(eqn, eqn.invars[0].aval, ctx)
    comm = _comm_for(eqn, site, ctx)
    out = None
    if comm is not None:
        out = _GATHER_SCATTER[name](eqn, invals, comm, site)
    _record(ctx, site)
    if out is None:
        return _xla(eqn, invals, ctx)
    return [_like(out, eqn.outvars[0].aval)]


def _psum(eqn, invals, ctx, note="", fixable=False):
    """psum of several operands: each float one on our all_reduce where it is served."""
    from .. import strategy as _strategy
    from ..allreduce import all_reduce
    outs = [None] * len(invals)
    for j, (v, x) in enumerate(zip(eqn.invars, invals)):
        site = _site(eqn, v.aval, ctx)
        if jnp.dtype(v.aval.dtype) not in _FLOATS:
            site.reason = f"{v.aval.dtype} is not a float type our all_reduce takes"
        elif _size_one(ctx, site.axes):
            site.reason = ("over axes of size 1: the identity (XLA's psum, which XLA drops or "
                           "combines)")
        else:
            comm = _comm_for(eqn, site, ctx)
            if comm is not None:
                shape = _local(comm, x, tuple(range(x.ndim)))
                choice = _strategy.select_strategy(comm, shape, x.dtype, op="all_reduce",
                                                   explain=True)
                if comm.xla_fallback:
                    site.reason = f"the communicator runs XLA's collectives: " \
                                  f"{comm.transport_reason}"
                elif choice.strategy == "xla":
                    site.reason = str(choice)
                else:
                    outs[j] = _like(all_reduce(x, comm), eqn.outvars[j].aval)
                    site.became = f"all_reduce ({choice.strategy})"
                    site.reason = str(choice)
        if note:
            site.reason += f"; not fused with the add + RMSNorm after it: {note}"
            site.fixable = site.fixable or fixable
        _record(ctx, site)
    rest = [j for j, o in enumerate(outs) if o is None]
    if rest:
        sub = [invals[j] for j in rest]
        xla = _bind(eqn, sub) if len(rest) < len(invals) else _xla(eqn, sub, ctx)
        for j, o in zip(rest, xla):
            outs[j] = o
    return outs


def _fused_decision(eqn, fused, ctx, jaxpr):
    """(Site, a `_norm.Fire` or None): whether the matched psum -> add -> RMSNorm goes to
    all_reduce_rms_norm. None: the psum takes the plain path (its Site is made there)."""
    from .. import strategy as _strategy
    x_aval = fused.x.aval
    site = _site(eqn, x_aval, ctx)
    if len(eqn.invars) != 1 or jnp.dtype(x_aval.dtype) not in _FLOATS:
        return site, None
    comm = _comm_for(eqn, site, ctx)
    if comm is None or comm.xla_fallback:
        return site, None
    why = _norm.refuse(fused)
    if why:
        fused.note = why
        return site, None
    hidden = x_aval.shape[-1]
    rows = int(np.prod(x_aval.shape[:-1], dtype=np.int64))
    op = "all_reduce_rms_norm" if fused.q is None else "all_reduce_rms_norm_quant"
    choice = _strategy.select_strategy(comm, (rows, hidden), x_aval.dtype, op=op,
                                       explain=True)
    if choice.strategy == "xla":
        fused.note = str(choice)
        return site, None
    site.became = f"{op} ({choice.strategy})"
    site.fused_with = fused.describe()
    site.reason = str(choice)
    return site, _norm.Fire(fused, comm)


