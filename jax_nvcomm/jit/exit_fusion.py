"""Fusion across a shard_map's exit: a body that ends in a psum, and the residual add and the
RMSNorm after the shard_map, outside it, become one `all_reduce_rms_norm` in the body.

Matched (in the jaxpr that holds the shard_map; `norm` names the forms of the norm):
    body:    ... s = psum(x, axes), maybe reshaped / sliced (`norm.sum_transparent`), is the
             body's output j (nothing else in the body reads them); out_specs[j] shards on
             none of `axes` (s is replicated over them) and not on the hidden (last) dim;
    outside: o = the shard_map's output j, then ops that commute with the sum and keep the
             hidden dim last and whole (`norm.sum_transparent`: reshapes / squeezes of the
             leading dims, slices of them with stride 1, `reshard`, sharding constraints),
             then `+ residual` and an RMSNorm the matcher takes (`norm._Matcher.match_sum`).
How the region is cut: ONE new shard_map replaces the old one. It takes the old inputs, the
residual (taken back to o's shape: the reshapes undone, the slices padded with zeros; in_spec
out_specs[j], so it lines up elementwise with o) and the [H] weight (in_spec P()); its body is
the old body without the psum (its reshapes / slices applied to each rank's part), then
psum -> add -> norm, which the body's rewrite makes one
`all_reduce_rms_norm` (or, where that op is refused, the psum, the add and a float32 RMSNorm).
It returns the old outputs with o replaced by the new residual, and the normed value, both
with out_specs[j]; outside, the same reshapes / slices / reshards as before are applied to
both. So what leaves has the shardings jax.jit gives: the same out_spec, then the same ops.
Padded rows are normed too and sliced away (a norm is per row).

Where the norm after the exit is norm-like but does not match (a `norm.Miss`), the shard_map
runs as it was and its psum's `explain` reason names the step, warned once per site, as in a
body. Refused (the shard_map and the ops after it stay as they were; `explain` shows the psum
as a plain all_reduce):
  - a float convert between the output and the add (the sum would be rounded in another type
    than XLA's), unless the add is of both upcast, `f32(out) + f32(residual)` (`norm`);
  - a psum output the body also reads, an out_spec sharded on the psum's axes (the output is
    not the sum) or on the hidden dim (the norm outside is over all of it, the body holds a
    part), a psum of several operands or over axis_index_groups;
  - a residual or weight computed after the shard_map's outputs are first read (the new
    region runs where the old one did, once both exist);
  - an FP8 quantisation after the norm (matched inside bodies only).
One psum output per shard_map is fused this way.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core, source_info_util
from jax.sharding import PartitionSpec as P

from . import norm as _norm
from .eqn import like as _like


@dataclasses.dataclass
class Exit:
    """A matched shard_map exit: the shard_map at eqn `k`, its output `j`, the body's psum,
    the outer ops before the add (`pre`), the outer match (`fused`, x None)."""
    k: int
    j: int
    psum: object
    pre: tuple
    fused: object        # a norm.Fused, or a norm.Miss (the psum stays, with its note)
    skip: frozenset


@dataclasses.dataclass
class Hooks:
    """What the exit region needs from the rewrite (passed in: no import circle)."""
    evaluate: object     # evaluate(jaxpr, consts, args, ctx) -> outs
    decide: object       # _fused_decision(eqn, fused, ctx, jaxpr) -> (Site, Fire | None)
    collective: object   # _collective(eqn, invals, ctx, note, fixable) -> outs
    record: object       # _record(ctx, site)
    bind: object         # _bind(eqn, invals) -> outs
    concrete_mesh: object


def _spec_axes(spec) -> set:
    out = set()
    for p in tuple(spec):
        if p is None:
            continue
        out.update(p if isinstance(p, (tuple, list)) else (p,))
    return out


def _exit_of(m, jaxpr, k):
    """An `Exit` for the shard_map at eqn k, or None."""
    E = jaxpr.eqns
    sm = E[k]
    body = sm.params["jaxpr"]
    prod = {v: i for i, e in enumerate(body.eqns) for v in e.outvars}
    readers: dict = {}
    for e in body.eqns:
        for v in e.invars:
            if isinstance(v, core.Var):
                readers[v] = readers.get(v, 0) + 1
    miss = None
    for j, bo in enumerate(body.outvars):
        if not isinstance(bo, core.Var) or bo not in prod or bo in readers or \
                sum(1 for o in body.outvars if o is bo) != 1 or bo.aval.ndim < 1:
            continue
        # the psum, maybe behind reshapes / slices in the body (each read once)
        v = bo
        while body.eqns[prod[v]].primitive.name not in _norm.PSUMS:
            e = body.eqns[prod[v]]
            if not _norm.sum_transparent(e, v.aval.shape[-1]) or \
                    not isinstance(e.invars[0], core.Var) or e.invars[0] not in prod or \
                    readers.get(e.invars[0]) != 1:
                break
            v = e.invars[0]
        p = body.eqns[prod[v]]
        spec = tuple(sm.params["out_specs"][j])
        if len(spec) >= bo.aval.ndim and spec[bo.aval.ndim - 1] is not None:
            continue  # the hidden dim sharded: the norm outside is over all of it
        axes = p.params.get("axes", ())
        axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
        if p.primitive.name not in _norm.PSUMS or len(p.invars) != 1 or \
                p.params.get("axis_index_groups") is not None or \
                not all(isinstance(a, str) for a in axes) or \
                jnp.dtype(bo.aval.dtype) not in _norm._FLOATS or bo.aval.ndim < 1:
            continue
        if _spec_axes(sm.params["out_specs"][j]) & set(axes):
            continue
        o = sm.outvars[j]
        t, pre = m.pre_ops(o)
        if any(E[i].primitive.name == "slice" and E[i].params.get("strides") is not None and
               any(s != 1 for s in E[i].params["strides"]) for i in pre):
            continue
        f = m.match_sum(t)
        if isinstance(f, _norm.Miss):  # the body as it was; its psum's Site names the step
            miss = miss or Exit(k, j, p, (), f, frozenset({k}))
            continue
        if f is None:
            continue
        skip = frozenset(f.skip | set(pre) | {k})
        outs = [v for i, v in enumerate(sm.outvars) if i != j] + [f.r, f.n]
        readers = [u for v in outs for u in m.users.get(v, []) if u not in skip]
        first = min(readers, default=len(E))
        if any(m.prod.get(v, -1) >= first for v in (f.res, f.w) if v is not None):
            continue
        return Exit(k, j, p, tuple(E[i] for i in pre), f, skip)
    return miss


def plan(jaxpr) -> dict:
    """{eqn index of a shard_map: Exit} for every shard_map of `jaxpr` whose psum output is
    followed, outside, by an add and an RMSNorm (module docstring)."""
    if not any(e.primitive.name == "shard_map" for e in jaxpr.eqns):
        return {}
    m = _norm.matcher(jaxpr)
    found = {}
    for k, e in enumerate(jaxpr.eqns):
        if e.primitive.name == "shard_map":
            ex = _exit_of(m, jaxpr, k)
            if ex is not None:
                found[k] = ex
    return found


def _undo(pre, res):
    """The residual taken back through the ops between the shard_map's output and the add:
    reshapes undone, slices padded with zeros (their rows are normed and sliced away)."""
    for e in reversed(pre):
        shape = tuple(e.invars[0].aval.shape)
        name = e.primitive.name
        if name == "slice":
            lo = e.params["start_indices"]
            hi = e.params["limit_indices"]
            res = lax.pad(res, jnp.zeros((), res.dtype),
                          [(int(a), int(n - b), 0) for a, b, n in zip(lo, hi, shape)])
        elif name in ("reshape", "squeeze", "expand_dims"):
            res = jnp.reshape(res, shape)
    return res


def _fit(a, mesh, spec):
    """a resharded to `spec` where the mesh has Explicit axes (shard_map asks its inputs'
    shardings to be its in_specs there); as it is otherwise."""
    types = getattr(mesh, "axis_types", ())
    if not any(t == jax.sharding.AxisType.Explicit for t in types):
        return a
    return jax.sharding.reshard(a, spec)


class _V:
    """A stand-in var of the body's local values (for `norm.Fire`)."""

    def __init__(self, shape, dtype):
        self.aval = core.ShapedArray(tuple(shape), jnp.dtype(dtype))


def _rms(r, w, eps, dtype):
    rf = r.astype(jnp.float32)
    n = rf * lax.rsqrt(jnp.mean(rf * rf, axis=-1, keepdims=True) + jnp.float32(eps))
    if w is not None:
        n = n * w.astype(jnp.float32)
    return n.astype(dtype)


class Fire:
    """The new region of an `Exit`, run when the program first reads one of the shard_map's
    outputs, the new residual or the normed value (`rewrite.evaluate`'s lazy entries)."""

    def __init__(self, ex: Exit, eqn, ctx, hooks: Hooks):
        self.ex, self.eqn, self.ctx, self.hooks = ex, eqn, ctx, hooks
        if isinstance(ex.fused, _norm.Miss):
            self.binds = tuple(eqn.outvars)
        else:
            self.binds = tuple(v for i, v in enumerate(eqn.outvars) if i != ex.j) + \
                (ex.fused.r, ex.fused.n)

    def _partial_body(self):
        """The body without its psum: what read the sum (the output, or reshapes / slices
        before it) reads the psum's operand, each rank's part."""
        body, p = self.eqn.params["jaxpr"], self.ex.psum
        s, x = p.outvars[0], p.invars[0]
        eqns = [e if s not in e.invars else
                e.replace(invars=[x if a is s else a for a in e.invars])
                for e in body.eqns if e is not p]
        outvars = [x if o is s else o for o in body.outvars]
        return body.replace(eqns=eqns, outvars=outvars)

    def _bind(self, region, invals, in_specs, out_specs):
        eqn, prm = self.eqn, self.eqn.params
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        # under the mesh the shard_map was traced under (eqn.ctx: a second Mesh of the same
        # devices under `use_abstract_mesh` is its own, as in rewrite._shard_map)
        with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
              eqn.ctx.manager):
            return list(jax.shard_map(region, mesh=prm["mesh"], in_specs=in_specs,
                                      out_specs=out_specs,
                                      axis_names=frozenset(prm.get("newly_manual_axes",
                                                                   frozenset())),
                                      check_vma=prm["check_vma"])(*invals))

    def _noted(self, read, env):
        """The shard_map as it was, its psum's Site saying which step of the norm after the
        exit did not match."""
        ex, eqn, ctx, h = self.ex, self.eqn, self.ctx, self.hooks
        prm = eqn.params
        partial = self._partial_body()
        inner = ctx.inside(h.concrete_mesh(prm["mesh"]),
                           prm.get("newly_manual_axes", frozenset()))

        def region(*args):
            outs = list(h.evaluate(partial, (), args, inner))
            outs[ex.j] = h.collective(ex.psum, [outs[ex.j]], inner, ex.fused.note, True)[0]
            return tuple(outs)

        outs = self._bind(region, [read(v) for v in eqn.invars], tuple(prm["in_specs"]),
                          tuple(prm["out_specs"]))
        for v, o in zip(eqn.outvars, outs):
            env[v] = o

    def fire(self, read, env, lazy):
        ex, eqn, ctx, h = self.ex, self.eqn, self.ctx, self.hooks
        f, p, j = ex.fused, ex.psum, ex.j
        for v in self.binds:
            lazy.pop(v, None)
        if isinstance(f, _norm.Miss):
            return self._noted(read, env)
        prm = eqn.params
        invals = [read(v) for v in eqn.invars]
        spec = prm["out_specs"][j]
        res = _fit(_undo(ex.pre, read(f.res)), prm["mesh"], spec)
        extra = [res]
        in_specs = tuple(prm["in_specs"]) + (spec,)
        H = int(f.r.aval.shape[-1])
        if f.w is not None:
            extra.append(_fit(jnp.reshape(read(f.w), (H,)), prm["mesh"], P()))
            in_specs += (P(),)
        partial = self._partial_body()
        inner = ctx.inside(h.concrete_mesh(prm["mesh"]),
                           prm.get("newly_manual_axes", frozenset()))
        n_in = len(invals)
        n_dtype, r_dtype = f.n.aval.dtype, f.r.aval.dtype

        def region(*args):
            outs = list(h.evaluate(partial, (), args[:n_in], inner))
            x, res_l = outs[j], args[n_in]
            w_l = args[n_in + 1] if f.w is not None else None
            X, R = _V(x.shape, x.dtype), _V(res_l.shape, res_l.dtype)
            Rn, N = _V(x.shape, r_dtype), _V(x.shape, n_dtype)
            W = _V(w_l.shape, w_l.dtype) if w_l is not None else None
            local = _norm.Fused(x=X, res=R, r=Rn, n=N, w=W, eps=f.eps, skip=frozenset(),
                                where=dict(f.where))
            env_l = {X: x, R: res_l}
            if W is not None:
                env_l[W] = w_l
            site, fire = h.decide(p, local, inner, None)
            if fire is not None:
                h.record(inner, site)
                fire.fire(env_l.__getitem__, env_l, {})
                r_l, n_l = env_l[Rn], env_l[N]
            else:
                (s,) = h.collective(p, [x], inner, local.note)
                r_l = s.astype(r_dtype) + res_l.astype(r_dtype)
                n_l = _rms(r_l, w_l, f.eps, n_dtype)
            outs[j] = r_l
            return tuple(outs) + (n_l,)

        out_specs = tuple(prm["out_specs"])
        out_specs = out_specs[:j] + (spec,) + out_specs[j + 1:] + (spec,)
        outs = self._bind(region, invals + extra, in_specs, out_specs)
        r, n = outs[j], outs[-1]
        for e in ex.pre:  # what the program did to the sum, done to both
            r = h.bind(e, [r])[0]
            n = h.bind(e, [n])[0]
        for i, v in enumerate(eqn.outvars):
            if i != j:
                env[v] = outs[i]
        env[f.r] = _like(r, f.r.aval)
        env[f.n] = _like(n, f.n.aval)
