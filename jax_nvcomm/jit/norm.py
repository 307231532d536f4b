"""Finding psum -> add of a residual -> RMSNorm in a jaxpr, in the forms model code writes, for
`rewrite` to put one `all_reduce_rms_norm` there.

Matched (x the psum's operand, s = psum(x), any leading dims, hidden H last):
    t   = s, or s through reshapes / slices of the leading dims / sharding constraints
          (`sum_transparent`: applied to x before the fused call); r = t + residual, or
          r = f32(t) + f32(residual) (both upcast alike: the kernel's r, rounded to x's
          type, is handed on upcast; the norm is the kernel's, on its float32 sum)
    v   = r, or r converted, `r - 0`, `r - zeros` (a literal zero mean): the norm's input
    sq  = v * v | square(v) | integer_pow(v, 2) | v ** 2
    ms  = sum(sq, last axis) then / H or * (1/H) (jnp.mean is that), converts and keepdims
          broadcasts anywhere
    inv = rsqrt(ms + eps) | sqrt(ms + eps) (to divide by) | (ms + eps) ** -0.5
    out = any product / quotient of v, inv and at most one weight, with casts and broadcasts
          anywhere: v * inv * w, w * v / sqrt(..) (the weight first), v * (inv * w) (folded
          into the rsqrt), w * (v * (1 / sqrt(..))), no weight. The weight is an array of H
          elements not computed from r ([H] or [1, .., H], converted or broadcast), e.g.
          Gemma's `1 + w`: the kernel is handed it as it is.
The new residual r may be used later; intermediates of the norm used elsewhere are computed
again from it; a factor applied to `out` later is applied to the fused call's result.
What it becomes: normed, r = all_reduce_rms_norm(x, residual, weight, eps) (x [..., H], any
H up to the kernel's widest, a float32 weight as it is); `out` is normed in out's dtype. The
kernel computes the norm in float32 and rounds once, so a norm written in another precision
or with the weight applied after a cast matches to within that rounding.
Where r goes through a mean of squares into an rsqrt / sqrt and the rest does not match, the
result is a `Miss` naming the step (`explain` prints it; warned once per site). A LayerNorm
(r - mean(r)) squares no view of r: not norm-like, no note.
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
# scalar vars that hold a literal's value (pvary / convert / reshape of a literal: check_vma
# bodies write `div sum (pvary 256.0)`), filled per matched jaxpr (`_Matcher`); pvary marks a
# value varying over manual axes and changes no value
_CONST_OPS = _SHAPE + ("pvary",)
_CONST_VARS: dict = {}
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
    pre: tuple = ()      # eqns between the psum and the add (`sum_transparent`): applied to x

    def describe(self) -> str:
        w = "" if self.w is not None else ", no weight"
        q = f" + fp8 quantisation ({self.where['quant']})" if self.q is not None else ""
        return (f"add ({self.where['add']}) + rms_norm ({self.where['norm']}, eps={self.eps:g}"
                f"{w}){q}")


class Miss:
    """A psum -> add whose norm-like tail did not match: which step, where (`note`, for the
    psum's Site: "not fused with the add + RMSNorm after it: <note>"). A fallback the user can
    fix (they can write the norm in a form above): warned once per site."""
    fixable = True

    def __init__(self, step, eqn):
        self.step = step
        self.note = f"{step} at {source_of(eqn)}"


class _No(Exception):
    def __init__(self, step, eqn=None):
        super().__init__(step)
        self.step, self.eqn = step, eqn


_ROOTS = ("rsqrt", "sqrt", "pow")
# what the normalised value may go through: products, quotients, casts, broadcasts, `- 0`
_PRODUCT = ("mul", "div", "sub", "add") + _SHAPE
_MOVES = ("reshape", "squeeze", "expand_dims", "slice", "sharding_constraint", "reshard",
          "copy", "copy_p")


def _wider(a, b) -> bool:
    """Whether float dtype a holds every value of float dtype b, and is another type."""
    a, b = jnp.dtype(a), jnp.dtype(b)
    return a != b and a in _FLOATS and b in _FLOATS and a.itemsize > b.itemsize


def sum_transparent(e, hidden) -> bool:
    """Whether eqn e, applied to a sum over ranks, equals the sum of it applied to each
    rank's part, keeping the hidden dim last and whole: a reshape / squeeze / expand_dims of
    the leading dims, a slice of them, a sharding constraint or reshard (not a convert: the
    sum would be rounded in another type than XLA's)."""
    n = e.primitive.name
    if len(e.invars) != 1 or len(e.outvars) != 1 or hidden is None:
        return False
    a, b = e.invars[0].aval, e.outvars[0].aval
    if b.ndim < 1 or b.shape[-1] != hidden:
        return False
    if n not in _MOVES:  # a convert is not: the sum would be rounded otherwise than XLA's
        return False
    if a.dtype != b.dtype:
        return False
    if n == "reshape":
        return e.params.get("dimensions") is None and \
            int(np.prod(a.shape[:-1], dtype=np.int64)) == int(np.prod(b.shape[:-1],
                                                                      dtype=np.int64))
    if n == "slice":
        st = e.params.get("strides")
        return e.params["start_indices"][-1] == 0 and e.params["limit_indices"][-1] == hidden \
            and (st is None or st[-1] == 1)
    return True


@dataclasses.dataclass
class _Factors:
    """A product of the sum's view (x), the rsqrt (inv), [H] weights, as powers."""
    x: int = 0
    inv: int = 0
    w: tuple = ()           # ((root var, power), ...)
    eqns: frozenset = frozenset()

    def __add__(self, o):
        return _Factors(self.x + o.x, self.inv + o.inv, self.w + o.w, self.eqns | o.eqns)

    def __neg__(self):
        return _Factors(-self.x, -self.inv, tuple((v, -p) for v, p in self.w), self.eqns)

    def partial(self):
        return self.x in (0, 1) and self.inv in (0, 1) and len(self.w) <= 1 and \
            all(p == 1 for _, p in self.w) and (self.x or self.inv)

    def complete(self):
        return self.partial() and self.x == 1 and self.inv == 1

    def weight(self):
        return self.w[0][0] if self.w else None


class _Decompose:
    """v as a product of the sum's views, the rsqrt and a weight (`_Factors`), or `_No`
    naming the step that is something else."""

    def __init__(self, m, r, views, d, sign, hidden):
        self.m, self.r, self.views, self.d, self.sign, self.H = m, r, views, d, sign, hidden
        self.memo = {}

    def __call__(self, v, depth=0):
        if isinstance(v, core.Var) and v in self.memo:
            return self.memo[v]
        f = self._of(v, depth)
        if isinstance(v, core.Var):
            self.memo[v] = f
        return f

    def _of(self, v, depth):
        m, H = self.m, self.H
        if depth > 24:
            raise _No("the normalised value: too many steps")
        if isinstance(v, core.Literal):
            c = _lit(v)
            if c == 1.0:
                return _Factors()
            raise _No(f"the normalised value: a constant factor {c}")
        if v in self.views:
            return _Factors(x=1)
        if v is self.d:
            return _Factors(inv=self.sign)
        i = m.prod.get(v)
        if not m.depends(v, self.r):  # a weight
            root = m.weight_root(v, H)
            if root is None:
                raise _No(f"the weight: a factor {v.aval.str_short()} that is not a [{H}] "
                          "vector", i)
            return _Factors(w=((root, 1),))
        e = m.eqns[i]
        n, ins = e.primitive.name, e.invars
        here = _Factors(eqns=frozenset({i}))
        if n in _SHAPE and len(ins) == 1:
            return self(ins[0], depth + 1) + here
        if n == "mul":
            return self(ins[0], depth + 1) + self(ins[1], depth + 1) + here
        if n == "div":
            return self(ins[0], depth + 1) + -self(ins[1], depth + 1) + here
        if n == "sub" and m.is_zero(ins[1]):
            return self(ins[0], depth + 1) + here
        raise _No(f"the normalised value: {n} where x * rsqrt(ms + eps) (times a weight) was "
                  "expected", i)


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
    return _CONST_VARS.get(v)


def _note_consts(jaxpr) -> None:
    """Record the scalar vars of `jaxpr` that are a literal seen through value-keeping ops."""
    _CONST_VARS.clear()
    for e in jaxpr.eqns:
        if e.primitive.name in _CONST_OPS and len(e.invars) == 1 and len(e.outvars) == 1 and \
                getattr(e.outvars[0].aval, "size", 0) == 1:
            c = _lit(e.invars[0])
            if c is not None:
                _CONST_VARS[e.outvars[0]] = c


class _Matcher:
    def __init__(self, jaxpr):
        _note_consts(jaxpr)
        self.jaxpr = jaxpr
        self.eqns = jaxpr.eqns
        self.prod, self.users, self.outs = _maps(jaxpr)

    def single(self, v):
        """The one eqn index using v, or None (several users, or a program output)."""
        u = self.users.get(v, [])
        if len(u) != 1 or v in self.outs:
            return None
        return u[0]

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
        """v traced back through converts / broadcasts / reshapes to the earliest var of
        `hidden` elements, hidden last ([hidden] or [1, ..., hidden]), or None."""
        root = None
        while True:
            if not isinstance(v, core.Var):
                return root
            if v.aval.ndim >= 1 and v.aval.shape[-1] == hidden and \
                    int(np.prod(v.aval.shape)) == hidden:
                root = v
            elif root is not None or int(np.prod(v.aval.shape)) != hidden and \
                    v.aval.shape[-1:] != (hidden,):
                return root
            i = self.prod.get(v)
            if i is None or self.eqns[i].primitive.name not in _SHAPE or \
                    len(self.eqns[i].invars) != 1:
                return root
            v = self.eqns[i].invars[0]

    def match(self, k):
        """A `Fused` for the psum at eqn k, a `Miss` (a norm-like tail that did not match), or
        None."""
        psum = self.eqns[k]
        if psum.primitive.name not in PSUMS or len(psum.invars) != 1:
            return None
        x, s = psum.invars[0], psum.outvars[0]
        if not isinstance(x, core.Var) or jnp.dtype(x.aval.dtype) not in _FLOATS or \
                x.aval.ndim < 1:
            return None
        t, pre = self.pre_ops(s)
        f = self.match_sum(t, quant=True)
        if isinstance(f, Fused):
            f.x, f.pre = x, tuple(self.eqns[i] for i in pre)
            f.skip = frozenset(f.skip | {k} | set(pre))
        return f

    def pre_ops(self, s):
        """(t, eqn indices): s followed through single-user ops that commute with a sum over
        ranks and keep the hidden dim last and whole (`sum_transparent`); t is the last
        var."""
        chain = []
        H = s.aval.shape[-1] if s.aval.ndim else None
        while True:
            i = self.single(s)
            if i is None or not sum_transparent(self.eqns[i], H):
                return s, chain
            chain.append(i)
            s = self.eqns[i].outvars[0]

    def views_of(self, r):
        """r and what computes the same values from it (float converts, `- 0`, `+ 0`), and
        the eqns making them."""
        views, eqns, todo = {r}, [], [r]
        while todo:
            v = todo.pop()
            for i in self.users.get(v, []):
                e = self.eqns[i]
                n, ins = e.primitive.name, e.invars
                same = (n in _VIEW and len(ins) == 1 and
                        jnp.dtype(e.outvars[0].aval.dtype) in _FLOATS) or \
                    (n == "sub" and ins[0] is v and self.is_zero(ins[1])) or \
                    (n in ("add", "add_any") and any(o is v for o in ins) and
                     any(self.is_zero(o) for o in ins if o is not v))
                if same and e.outvars[0].aval.shape == r.aval.shape and \
                        e.outvars[0] not in views:
                    views.add(e.outvars[0])
                    eqns.append(i)
                    todo.append(e.outvars[0])
        return views, eqns

    def is_zero(self, v, depth=0):
        """Whether v is a literal 0 (broadcast, reshaped or converted: `jnp.zeros_like`)."""
        if isinstance(v, core.Literal):
            return _lit(v) == 0.0
        i = self.prod.get(v)
        if i is None or depth > 6:
            return False
        e = self.eqns[i]
        return e.primitive.name in _CONST_OPS and len(e.invars) == 1 and \
            self.is_zero(e.invars[0], depth + 1)

    def reaches(self, v, names, limit=64):
        """Whether an eqn of one of `names` is computed from v (within `limit` eqns)."""
        seen, todo = set(), [v]
        while todo and len(seen) < limit:
            a = todo.pop()
            for i in self.users.get(a, []):
                if i in seen:
                    continue
                seen.add(i)
                if self.eqns[i].primitive.name in names:
                    return True
                todo.extend(self.eqns[i].outvars)
        return False

    def match_sum(self, s, quant=False):
        """From s, the sum over ranks (or what `pre_ops` made of it): add of a residual ->
        RMSNorm. A `Fused` (x and pre left to the caller), a `Miss` naming the step that did
        not match when the add's result goes through a mean of squares into an rsqrt / sqrt,
        or None."""
        E = self.eqns
        a_i = self.single(s)
        ups = []  # the add of both upcast: f32(s) + f32(residual) (sglang-jax's rmsnorm)
        if a_i is not None and E[a_i].primitive.name == "convert_element_type" and \
                _wider(E[a_i].outvars[0].aval.dtype, s.aval.dtype):
            ups.append(a_i)
            s_up = E[a_i].outvars[0]
            a_i = self.single(s_up)
        else:
            s_up = s
        if a_i is None or E[a_i].primitive.name not in ("add", "add_any"):
            return None
        add = E[a_i]
        res = add.invars[1] if add.invars[0] is s_up else add.invars[0]
        r = add.outvars[0]
        if ups:  # the residual upcast alike: the kernel takes it as it was
            j = self.prod.get(res) if isinstance(res, core.Var) else None
            if j is None or E[j].primitive.name != "convert_element_type" or \
                    E[j].invars[0].aval.dtype != s.aval.dtype or \
                    not isinstance(E[j].invars[0], core.Var):
                return None
            if self.single(res) == a_i:
                ups.append(j)
            res = E[j].invars[0]
        if not isinstance(res, core.Var) or res is s or res.aval.shape != s.aval.shape or \
                res.aval.dtype != s.aval.dtype or \
                (r.aval.dtype != s.aval.dtype and not ups) or \
                jnp.dtype(r.aval.dtype) not in _FLOATS or r.aval.ndim < 1:
            return None
        H = int(r.aval.shape[-1])
        nd = r.aval.ndim
        chain = []
        views, view_eqns = self.views_of(r)

        def is_view(v):
            return isinstance(v, core.Var) and v in views

        sqs = []
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
                    if self.reaches(e.outvars[0], _ROOTS) and i not in sqs:
                        sqs.append(i)
        if not sqs:  # nothing norm-like: no mean of squares of the sum into an rsqrt / sqrt
            return None
        if len(sqs) > 1:
            return Miss("the sum is squared more than once", E[sqs[1]])
        sq = sqs[0]
        chain.append(sq)

        def find(v, pred):
            """The one user of v that pred accepts (other users: kept, see below)."""
            c = sorted({i for i in self.users.get(v, []) if pred(E[i])})
            return c[0] if len(c) == 1 else None

        def advance(v, pred, transparent):
            """Follow users of the transparent primitives until one that pred accepts; returns
            (eqn index or None, the last var reached)."""
            for _ in range(8):
                i = find(v, pred)
                if i is not None:
                    return i, v
                i = find(v, lambda e: e.primitive.name in transparent and len(e.invars) == 1)
                if i is None:
                    return None, v
                chain.append(i)
                v = E[i].outvars[0]
            return None, v

        def user_of(v):
            u = self.users.get(v, [])
            return E[u[0]] if u else E[sq]

        i, v = advance(E[sq].outvars[0], lambda e: e.primitive.name == "reduce_sum" and
                       tuple(e.params.get("axes", ())) == (nd - 1,), _VIEW)
        if i is None:
            u = user_of(v)
            over = f" over axes {tuple(u.params['axes'])}" if "axes" in u.params else ""
            return Miss(f"the mean of squares: {u.primitive.name}{over} where a sum over the "
                        f"last axis ({nd - 1}) was expected", u)
        chain.append(i)

        def scale(e):
            n, ins = e.primitive.name, e.invars
            if n == "div":
                return ins[0] is not ins[1] and _lit(ins[1]) is not None and \
                    abs(_lit(ins[1]) - H) <= 1e-6 * H
            return n == "mul" and any(_lit(o) is not None and abs(_lit(o) * H - 1) <= 1e-5
                                      for o in ins)
        i, v = advance(E[i].outvars[0], scale, _SHAPE)
        if i is None:
            return Miss(f"the mean of squares: the sum of squares is not divided by the hidden "
                        f"size {H}", user_of(v))
        chain.append(i)
        i, v = advance(E[i].outvars[0], lambda e: e.primitive.name == "add" and any(
            _lit(o) is not None for o in e.invars), _SHAPE)
        if i is None:
            return Miss("eps: no constant is added to the mean of squares", user_of(v))
        chain.append(i)
        eps = next(_lit(o) for o in E[i].invars if _lit(o) is not None)
        if not eps >= 0:
            return Miss(f"eps: {eps:g} is negative", E[i])
        i, v = advance(E[i].outvars[0], lambda e: e.primitive.name in ("rsqrt", "sqrt") or (
            e.primitive.name == "pow" and _lit(e.invars[1]) == -0.5), _SHAPE)
        if i is None:
            u = user_of(v)
            return Miss(f"rsqrt: the mean of squares + eps goes to {u.primitive.name}, not "
                        "rsqrt, sqrt or ** -0.5", u)
        chain.append(i)
        d = E[i].outvars[0]
        sign = -1 if E[i].primitive.name == "sqrt" else 1
        dec = _Decompose(self, r, views, d, sign, H)
        # the normalised value: from d forwards through products, quotients, casts and
        # broadcasts while the value stays x * inv (* w); `out` is the last complete one
        cur, path, best, why = d, [], None, None
        for _ in range(16):
            good, why_here = [], None
            for j in sorted(set(self.users.get(cur, []))):
                e = E[j]
                if e.primitive.name not in _PRODUCT or len(e.outvars) != 1:
                    continue
                try:
                    f = dec(e.outvars[0])
                except _No as no:
                    why_here = why_here or no
                    continue
                if f.partial():
                    good.append((j, f))
            if len(good) != 1:
                why = why_here if why is None and best is None else why
                break
            j, f = good[0]
            path.append(j)
            cur = E[j].outvars[0]
            if f.complete():
                best = (cur, f, j)
        if best is None:
            if why is not None:
                return Miss(why.step, E[why.eqn] if why.eqn is not None else E[i])
            u = user_of(cur)
            return Miss(f"the normalised value: {u.primitive.name} where x * rsqrt(ms + eps) "
                        "(times a weight) was expected", u)
        out, f, norm_eqn = best
        w = f.weight()
        chain.extend(sorted(f.eqns))
        if jnp.dtype(out.aval.dtype) not in _FLOATS or tuple(out.aval.shape) != \
                tuple(r.aval.shape):
            return Miss(f"the normalised value: shape {tuple(out.aval.shape)} is not the sum's "
                        f"{tuple(r.aval.shape)}", E[norm_eqn])
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
        skip = (chain_set - keep) | {a_i} | set(ups)
        for i in reversed(view_eqns):  # views feeding only what is dropped (later ones first)
            o = E[i].outvars[0]
            if o not in self.outs and all(u in skip for u in self.users.get(o, [])):
                skip.add(i)
        # where the fused call fires: at the first reader of r or out left in the program;
        # the weight must exist by then
        readers = [u for vv in (r, out) for u in self.users.get(vv, []) if u not in skip]
        first = min(readers, default=len(E))
        if w is not None and self.prod.get(w, -1) >= first:
            return Miss("the weight is computed after the sum is first read", E[norm_eqn])
        fused = Fused(x=None, res=res, r=r, n=out, w=w, eps=float(eps), skip=frozenset(skip),
                      where={"add": source_of(add), "norm": source_of(E[norm_eqn])})
        if quant:
            q = self.match_quant(out, H, nd, skip)
            if q is not None:
                fused.q, fused.scale, qskip, fused.where["quant"] = q
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
    """{eqn index of a psum: Fused or Miss} for every psum -> add -> RMSNorm in `jaxpr` (its
    top level: the pattern is matched within one body; jitted helpers are inlined before),
    and every psum -> add -> norm-like tail that did not match (a `Miss`)."""
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


def matcher(jaxpr):
    """A matcher of `jaxpr`'s eqns (`exit_fusion` starts it at a shard_map's output)."""
    return _Matcher(jaxpr)


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
        for e in f.pre:  # what was applied to the sum, applied to each rank's part
            x = e.primitive.bind(x, **e.params)
        H = x.shape[-1]
        if f.w is None:
            w = jnp.ones((H,), x.dtype)
        else:  # a float32 weight with 16-bit x goes in as it is (the kernel reads it so)
            w = read(f.w).reshape(H)
            if w.dtype != x.dtype and w.dtype != jnp.float32:
                w = w.astype(jnp.float32)
        if f.q is not None:
            from ..allreduce_quant import all_reduce_rms_norm_quant
            q, scale, r_out = all_reduce_rms_norm_quant(x, res, w, self.comm, eps=f.eps)
            env[f.r] = _like(r_out.reshape(f.r.aval.shape).astype(f.r.aval.dtype), f.r.aval)
            env[f.q] = q.reshape(f.q.aval.shape)
            env[f.scale] = _like(scale.reshape(f.scale.aval.shape).astype(f.scale.aval.dtype),
                                 f.scale.aval)
            return
        normed, r_out = all_reduce_rms_norm(x, res, w, self.comm, eps=f.eps)
        env[f.r] = _like(r_out.reshape(f.r.aval.shape).astype(f.r.aval.dtype), f.r.aval)
        env[f.n] = _like(normed.reshape(f.n.aval.shape).astype(f.n.aval.dtype), f.n.aval)

