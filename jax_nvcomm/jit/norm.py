"""Finding psum -> add of a residual -> RMSNorm in a jaxpr, in the forms model code writes, for
`_rewrite` to put one `all_reduce_rms_norm` there.

Matched (x the psum's operand, r = psum(x) + residual, any leading dims, hidden H last):
    v   = r, or r converted (to float32, say): the norm's input, once or several times
    sq  = v * v | square(v) | integer_pow(v, 2) | v ** 2
    ms  = sum(sq, last axis) then / H or * (1/H), converts and keepdims broadcasts anywhere
    inv = rsqrt(ms + eps) | 1 / sqrt(ms + eps);   n = v * inv | v / sqrt(ms + eps)
    out = n, converted or not, times the weight (a [H] array, converted and broadcast, not
          computed from r) or no weight, converted or not.
The new residual r may be used later; the norm's intermediates may not be (they are dropped).
What it becomes: normed, r = all_reduce_rms_norm(x, residual, weight, eps) (x [..., H], any
H up to the kernel's widest, a float32 weight as it is); `out` is normed in out's dtype. The kernel computes the norm in
float32 and rounds once, so a norm written in another precision or with the weight applied
after a cast matches to within that rounding.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax._src import core

from .eqn import like as _like
from .eqn import source_of

PSUMS = ("psum", "psum_invariant")
_VIEW = ("convert_element_type",)
_SHAPE = ("convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims")
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass
class Fused:
    """A matched psum -> add -> RMSNorm: the vars and the eqns the fused call replaces."""
    x: object            # the psum's operand
    res: object          # the residual added
    r: object            # the new residual (the add's result)
    n: object            # the norm's result
    w: object            # the weight's [H] root var, or None (no weight)
    eps: float
    skip: frozenset      # eqn indices the fused call replaces
    where: dict          # "add" / "norm" -> source line
    note: str = ""       # why it was not fused, when it was not
    q: object = None     # a per-token FP8 quantisation of n matched after it (`match_quant`):
    scale: object = None  # its float8 output and its float32 scale var

    def describe(self) -> str:
        w = "" if self.w is not None else ", no weight"
        q = f" + fp8 quantisation ({self.where['quant']})" if self.q is not None else ""
        return (f"add ({self.where['add']}) + rms_norm ({self.where['norm']}, eps={self.eps:g}"
                f"{w}){q}")


def _maps(jaxpr):
    prod, users = {}, {}
    for i, e in enumerate(jaxpr.eqns):
        for v in e.outvars:
            prod[v] = i
        for v in e.invars:
            if isinstance(v, core.Var):
                users.setdefault(v, []).append(i)
    outs = {v for v in jaxpr.outvars if isinstance(v, core.Var)}
    return prod, users, outs


def _lit(v):
    """The float value of a scalar literal operand, or None."""
    if isinstance(v, core.Literal):
        a = np.asarray(v.val)
        if a.size == 1:
            return float(a.reshape(()))
    return None


class _Matcher:
    def __init__(self, jaxpr):
        self.jaxpr = jaxpr
        self.eqns = jaxpr.eqns
        self.prod, self.users, self.outs = _maps(jaxpr)

    def single(self, v):
        """The one eqn index using v, or None (several users, or a program output)."""
        u = self.users.get(v, [])
        if len(u) != 1 or v in self.outs:
            return None
        return u[0]

    def through(self, v, names, chain):
        """Follow v's single users of the given primitives; returns the last var."""
        while True:
            i = self.single(v)
            if i is None or self.eqns[i].primitive.name not in names:
                return v
            e = self.eqns[i]
            if len(e.invars) != 1:
                return v
            chain.append(i)
            v = e.outvars[0]

    def depends(self, v, target, seen=None):
        """Whether var v is computed from target."""
        seen = set() if seen is None else seen
        stack = [v]
        while stack:
            a = stack.pop()
            if a is target:
                return True
            if not isinstance(a, core.Var) or a in seen:
                continue
            seen.add(a)
            i = self.prod.get(a)
            if i is not None:
                stack.extend(x for x in self.eqns[i].invars if isinstance(x, core.Var))
        return False

    def weight_root(self, v, hidden):
        """v traced back through converts / broadcasts / reshapes to a [hidden] var."""
        while True:
            if isinstance(v, core.Var) and tuple(v.aval.shape) == (hidden,):
                return v
            i = self.prod.get(v) if isinstance(v, core.Var) else None
            if i is None or self.eqns[i].primitive.name not in _SHAPE:
                return None
            if int(np.prod(v.aval.shape)) != hidden:
                return None
            v = self.eqns[i].invars[0]

    def match(self, k):
        """A `Fused` for the psum at eqn k, or None."""
        E = self.eqns
        psum = E[k]
        if psum.primitive.name not in PSUMS or len(psum.invars) != 1:
            return None
        x, s = psum.invars[0], psum.outvars[0]
        if not isinstance(x, core.Var) or jnp.dtype(x.aval.dtype) not in _FLOATS or \
                x.aval.ndim < 1:
            return None
        a_i = self.single(s)
        if a_i is None or E[a_i].primitive.name not in ("add", "add_any"):
            return None
        add = E[a_i]
        res = add.invars[1] if add.invars[0] is s else add.invars[0]
        r = add.outvars[0]
        if not isinstance(res, core.Var) or res is s or res.aval.shape != s.aval.shape or \
                res.aval.dtype != s.aval.dtype or r.aval.dtype != s.aval.dtype:
            return None
        H = int(r.aval.shape[-1])
        nd = r.aval.ndim
        chain = []
        # the norm's input: r or converts of r
        views = {r}
        view_eqns = []
        for i in self.users.get(r, []):
            e = E[i]
            if e.primitive.name in _VIEW and len(e.invars) == 1:
                views.add(e.outvars[0])
                view_eqns.append(i)

        def is_view(v):
            return isinstance(v, core.Var) and v in views

        # sq
        sq = None
        for vv in views:
            for i in self.users.get(vv, []):
                e = E[i]
                n = e.primitive.name
                ins = e.invars
                if (n == "mul" and is_view(ins[0]) and is_view(ins[1]) and
                    ins[0].aval.dtype == ins[1].aval.dtype) or \
                        (n == "square" and is_view(ins[0])) or \
                        (n == "integer_pow" and is_view(ins[0]) and e.params.get("y") == 2) or \
                        (n == "pow" and is_view(ins[0]) and _lit(ins[1]) == 2.0):
                    if sq is not None and sq != i:
                        return None
                    sq = i
        if sq is None:
            return None
        chain.append(sq)

        def find(v, pred):
            """The one user of v that pred accepts (other users: kept, see below)."""
            c = sorted({i for i in self.users.get(v, []) if pred(E[i])})
            return c[0] if len(c) == 1 else None

        def advance(v, pred, transparent):
            """Follow users of the transparent primitives until one that pred accepts."""
            for _ in range(8):
                i = find(v, pred)
                if i is not None:
                    return i
                i = find(v, lambda e: e.primitive.name in transparent and len(e.invars) == 1)
                if i is None:
                    return None
                chain.append(i)
                v = E[i].outvars[0]
            return None

        def mul_of_view(inv):
            def pred(e):
                if e.primitive.name != "mul":
                    return False
                a, b = e.invars
                return (b is inv and is_view(a)) or (a is inv and is_view(b))
            return pred

        i = advance(E[sq].outvars[0], lambda e: e.primitive.name == "reduce_sum" and
                    tuple(e.params.get("axes", ())) == (nd - 1,), _VIEW)
        if i is None:
            return None
        chain.append(i)

        def scale(e):
            n, ins = e.primitive.name, e.invars
            if n == "div":
                return _lit(ins[1]) is not None and abs(_lit(ins[1]) - H) <= 1e-6 * H
            return n == "mul" and any(_lit(o) is not None and abs(_lit(o) * H - 1) <= 1e-5
                                      for o in ins)
        i = advance(E[i].outvars[0], scale, _SHAPE)
        if i is None:
            return None
        chain.append(i)
        i = advance(E[i].outvars[0], lambda e: e.primitive.name == "add" and any(
            _lit(o) is not None for o in e.invars), _SHAPE)
        if i is None:
            return None
        chain.append(i)
        eps = next(_lit(o) for o in E[i].invars if _lit(o) is not None)
        if not eps >= 0:
            return None
        i = advance(E[i].outvars[0], lambda e: e.primitive.name in ("rsqrt", "sqrt"), _SHAPE)
        if i is None:
            return None
        chain.append(i)
        e = E[i]
        def follow(var, make_pred):
            """The eqn using `var` that make_pred(var) accepts, looked for through up to 8
            single-input shape ops (broadcasts, reshapes; each put on the chain); None if none."""
            for _ in range(8):
                j = find(var, make_pred(var))
                if j is not None:
                    return j
                t = find(var, lambda q: q.primitive.name in _SHAPE and len(q.invars) == 1)
                if t is None:
                    return None
                chain.append(t)
                var = E[t].outvars[0]
            return None

        def div_by(d):
            return lambda q: q.primitive.name == "div" and q.invars[1] is d

        if e.primitive.name == "rsqrt":  # rsqrt, broadcast: the mul by the input
            j = follow(e.outvars[0], mul_of_view)
            if j is None:
                return None
        else:  # sqrt, then x / sd, or 1 / sd and the mul by the input
            j = follow(e.outvars[0], div_by)
            if j is None:
                return None
            num = E[j].invars[0]
            if not is_view(num):
                if _lit(num) != 1.0:
                    return None
                chain.append(j)
                j = follow(E[j].outvars[0], mul_of_view)
                if j is None:
                    return None
        chain.append(j)
        norm_eqn = j
        v = E[j].outvars[0]
        w = None

        def weight_mul(e):
            if e.primitive.name != "mul":
                return False
            a, b = e.invars
            other = b if a in wset else a
            root = self.weight_root(other, H)
            return root is not None and not self.depends(root, r)

        # the weight: after converts of the normalised value (a unique mul by a [H] array)
        wset = {v}
        probe, k_chain = v, []
        i = None
        for _ in range(4):
            i = find(probe, lambda e: e.primitive.name == "mul" and
                     (e.invars[0] is probe or e.invars[1] is probe) and weight_mul(e))
            if i is not None:
                break
            t = find(probe, lambda e: e.primitive.name in _VIEW)
            if t is None or len(self.users.get(probe, [])) != 1:
                break
            k_chain.append(t)
            probe = E[t].outvars[0]
            wset = {probe}
        if i is not None:
            chain.extend(k_chain)
            e = E[i]
            other = e.invars[1] if e.invars[0] is probe else e.invars[0]
            w = self.weight_root(other, H)
            chain.append(i)
            norm_eqn = i
            v = self.through(e.outvars[0], _VIEW, chain)
        else:
            v = self.through(v, _VIEW, chain)
        out = v
        if jnp.dtype(out.aval.dtype) not in _FLOATS or tuple(out.aval.shape) != \
                tuple(r.aval.shape):
            return None
        chain_set = set(chain)
        # intermediates that feed something besides the chain (a gradient's residuals: the
        # rsqrt, the upcast input) keep the eqns that compute them, from the new residual;
        # the rest is dropped
        keep = set()
        todo = [i for i in chain for o in E[i].outvars if o is not out and
                (o in self.outs or any(u not in chain_set for u in self.users.get(o, [])))]
        while todo:
            i = todo.pop()
            if i in keep:
                continue
            keep.add(i)
            for a in E[i].invars:
                j = self.prod.get(a) if isinstance(a, core.Var) else None
                if j in chain_set:
                    todo.append(j)
        skip = (chain_set - keep) | {k, a_i}
        for i in view_eqns:
            o = E[i].outvars[0]
            if o not in self.outs and all(u in skip for u in self.users.get(o, [])):
                skip.add(i)
        # where the fused call fires: at the first reader of r or out left in the program;
        # the weight must exist by then
        readers = [u for vv in (r, out) for u in self.users.get(vv, []) if u not in skip]
        first = min(readers, default=len(E))
        if w is not None and self.prod.get(w, -1) >= first:
            return None
        fused = Fused(x=x, res=res, r=r, n=out, w=w, eps=float(eps), skip=frozenset(skip),
                      where={"add": source_of(add), "norm": source_of(E[norm_eqn])})
        quant = self.match_quant(out, H, nd, skip)
        if quant is not None:
            fused.q, fused.scale, qskip, fused.where["quant"] = quant
            fused.skip = frozenset(skip | qskip)
        return fused

    def match_quant(self, n, H, nd, skip):
        """A per-token FP8 quantisation of the normed value n, as model code writes it:
            v = n (converted or not);  amax = max(|v|, last axis) (keepdims or broadcast,
            maybe max(amax, tiny));  scale = amax / 448 (or * (1/448));
            q = (v / scale) (clipped or not) cast to float8_e4m3fn.
        Returns (q var, scale var, eqn indices, source line) or None. Everything between n
        and q but the scale feeds nothing else (n itself included)."""
        E = self.eqns
        views = {n}
        for i in self.users.get(n, []):
            if E[i].primitive.name in _VIEW:
                views.add(E[i].outvars[0])
        chain = set(i for v in views for i in self.users.get(v, []) if v is n and
                    E[i].primitive.name in _VIEW)
        absi = [i for v in views for i in self.users.get(v, []) if E[i].primitive.name == "abs"]
        if len(absi) != 1:
            return None
        chain.add(absi[0])
        v = E[absi[0]].outvars[0]

        def one(v, pred):
            c = [i for i in self.users.get(v, []) if pred(E[i])]
            return c[0] if len(c) == 1 and len(self.users.get(v, [])) == 1 and \
                v not in self.outs else None

        i = one(v, lambda e: e.primitive.name == "reduce_max" and
                tuple(e.params.get("axes", ())) == (nd - 1,))
        if i is None:
            return None
        chain.add(i)
        v = E[i].outvars[0]
        scale_i = None
        for _ in range(6):
            i = one(v, lambda e: True)
            if i is None:
                return None
            e = E[i]
            nm = e.primitive.name
            lit = next((_lit(o) for o in e.invars if _lit(o) is not None), None)
            if nm in _SHAPE or (nm == "max" and lit is not None and lit >= 0):
                chain.add(i)
                v = e.outvars[0]
                continue
            if (nm == "div" and e.invars[0] is v and lit is not None and abs(lit - 448) < 1e-3) \
                    or (nm == "mul" and lit is not None and abs(lit * 448 - 1) < 1e-6):
                scale_i = i
            break
        if scale_i is None:
            return None
        chain.add(scale_i)
        scale = E[scale_i].outvars[0]
        if tuple(scale.aval.shape) not in (tuple(n.aval.shape[:-1]) + (1,),
                                           tuple(n.aval.shape[:-1])):
            return None
        # q = view / scale (the scale broadcast or not), clipped or not, cast to float8
        sviews = {scale}
        for i in self.users.get(scale, []):
            if E[i].primitive.name in _SHAPE:
                sviews.add(E[i].outvars[0])
                chain.add(i)
        divs = [i for vv in views for i in self.users.get(vv, []) if E[i].primitive.name ==
                "div" and E[i].invars[0] is vv and E[i].invars[1] in sviews]
        if len(divs) != 1:
            return None
        chain.add(divs[0])
        v = E[divs[0]].outvars[0]
        for _ in range(4):
            i = one(v, lambda e: True)
            if i is None:
                return None
            e = E[i]
            chain.add(i)
            v = e.outvars[0]
            if e.primitive.name == "convert_element_type":
                if jnp.dtype(e.params["new_dtype"]) == jnp.dtype(jnp.float8_e4m3fn):
                    break
                continue
            if e.primitive.name not in ("clamp", "max", "min", "round"):
                return None
        else:
            return None
        q = v
        if q.aval.dtype != jnp.dtype(jnp.float8_e4m3fn):
            return None
        # nothing between n and q feeds anything else (the scale may: it is an output)
        for i in chain:
            for o in E[i].outvars:
                if o is q or o is scale:
                    continue
                if o in self.outs or any(u not in chain for u in self.users.get(o, [])):
                    return None
        if n in self.outs or any(u not in chain and u not in skip for u in
                                 self.users.get(n, [])):
            return None
        return q, scale, chain, source_of(E[divs[0]])


def plan(jaxpr) -> dict:
    """{eqn index of a psum: Fused} for every psum -> add -> RMSNorm in `jaxpr` (its top
    level: the pattern is matched within one body; jitted helpers are inlined before)."""
    if not any(e.primitive.name in PSUMS for e in jaxpr.eqns):
        return {}
    m = _Matcher(jaxpr)
    found = {}
    for k, e in enumerate(jaxpr.eqns):
        if e.primitive.name in PSUMS:
            f = m.match(k)
            if f is not None:
                found[k] = f
    return found


def refuse(fused: Fused) -> str:
    """Why this match cannot take all_reduce_rms_norm ("" when it can)."""
    from .. import allreduce
    x = fused.x.aval
    H = int(x.shape[-1])
    if H == 0 or int(np.prod(x.shape)) == 0:
        return "an empty array"
    if allreduce.padded_cols(H, x.dtype) > allreduce.MAX_FUSED_HIDDEN:
        return f"hidden {H} is above the fused kernel's {allreduce.MAX_FUSED_HIDDEN}"
    return ""


class Fire:
    """The fused call of a match, made when the program first reads its new residual or its
    normed output (`_rewrite.evaluate`'s lazy entries)."""

    def __init__(self, fused: Fused, comm):
        self.fused, self.comm = fused, comm
        self.binds = (fused.r, fused.n) if fused.q is None else (fused.r, fused.q, fused.scale)

    def fire(self, read, env, lazy):
        from ..allreduce import all_reduce_rms_norm
        f = self.fused
        for v in self.binds:
            lazy.pop(v, None)
        x, res = read(f.x), read(f.res)
        H = x.shape[-1]
        if f.w is None:
            w = jnp.ones((H,), x.dtype)
        else:  # a float32 weight with 16-bit x goes in as it is (the kernel reads it so)
            w = read(f.w)
            if w.dtype != x.dtype and w.dtype != jnp.float32:
                w = w.astype(jnp.float32)
        if f.q is not None:
            from ..allreduce_quant import all_reduce_rms_norm_quant
            q, scale, r_out = all_reduce_rms_norm_quant(x, res, w, self.comm, eps=f.eps)
            env[f.r] = _like(r_out.reshape(f.r.aval.shape), f.r.aval)
            env[f.q] = q.reshape(f.q.aval.shape)
            env[f.scale] = _like(scale.reshape(f.scale.aval.shape).astype(f.scale.aval.dtype),
                                 f.scale.aval)
            return
        normed, r_out = all_reduce_rms_norm(x, res, w, self.comm, eps=f.eps)
        env[f.r] = _like(r_out.reshape(f.r.aval.shape), f.r.aval)
        env[f.n] = _like(normed.reshape(f.n.aval.shape).astype(f.n.aval.dtype), f.n.aval)

