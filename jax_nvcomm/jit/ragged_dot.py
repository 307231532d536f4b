"""The `lax.ragged_dot` pattern of the rewrite: which ragged_dots become `nvc.ragged_dot` and
how (a local op, not a collective: it needs no communicator).

Forms matched (inside shard_map bodies, and outside them in a program of one device; outside
shard_map on several devices lax's stays: our op is per device, XLA would gather its operands):
  - `lax.ragged_dot(lhs, rhs, group_sizes)` in its MoE form (lhs [M, K] ragged along M, rhs
    [G, K, N] grouped along G, contracting K, no batch dimension, no group offset) with rhs of
    lhs's dtype -> `nvc.ragged_dot` (strategy "auto": the kernel on the platforms its rule
    picks, lax's elsewhere);
  - the same with int8 rhs and bfloat16 / float16 lhs (lax promotes the weights; public
    quantized MoE code writes `lax.ragged_dot(x, w_int8, sizes) * scale_per_row`) -> the
    8-bit-weight call (`ragged_dot_w8`) without a scale; a multiply after it stays as written
    (a scale gathered per row by a routing index is not provably the row's group's scale);
  - dequantise-then-ragged_dot: rhs computed only for the product as `w.astype(dt)` (w int8 or
    float8_e4m3fn, converts between float dtypes allowed) or `w.astype(dt) * s[:, None, :]`
    (s [G, N] broadcast or reshaped to [G, 1, N] or broadcast to [G, K, N]; either operand
    order; converts around each part) -> the 8-bit-weight call on w with s as its per-channel
    scale (s as the multiply saw it, converted to float32 exactly). The
    kernel multiplies w * s in float32 instead of rounding it to the multiply's dtype: results
    differ from jax.jit's by that one rounding of the weights.
Refused (lax's as written): other dimension numbers (the transposes a gradient adds), a
dequantised weight used elsewhere too, other scale layouts (per-block scales written with
repeats), and calls the 8-bit kernel cannot serve on any platform of the program.
Each replaced ragged_dot gives `rewrite.Site` fields (op "ragged_dot", what it became, the
source line, shapes, dtypes) that the rewrite records, so `explain` lists it.
"""
from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp
from jax._src import core, source_info_util

from .eqn import like as _like
from .eqn import site_of, source_of

RAGGED_DOT = "ragged_dot_general"
_CONVERT = "convert_element_type"
_FLOATS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

_warned: set = set()


def reset_warnings() -> None:
    _warned.clear()


def is_moe_form(eqn) -> bool:
    """Whether `eqn` is lax.ragged_dot's MoE form: lhs [M, K] ragged along M, rhs [G, K, N]
    grouped along G, contracting K, no batch dimension, no group offset (the form
    `nvc.ragged_dot` takes; the transposes a gradient adds have other dimension numbers)."""
    if eqn.primitive.name != RAGGED_DOT or eqn.params.get("group_offset") is not None:
        return False
    dn = eqn.params.get("ragged_dot_dimension_numbers")
    if dn is None or len(eqn.invars) != 3:
        return False
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    return (tuple(lc) == (1,) and tuple(rc) == (1,) and not tuple(lb) and not tuple(rb) and
            tuple(dn.lhs_ragged_dimensions) == (0,) and tuple(dn.rhs_group_dimensions) == (0,)
            and eqn.invars[0].aval.ndim == 2 and eqn.invars[1].aval.ndim == 3)


# ---- the definitions and uses of a jaxpr's variables (per jaxpr, cached) ----

_facts: dict = {}


def _defs_and_uses(jaxpr):
    hit = _facts.get(id(jaxpr))
    if hit is not None and hit[0] is jaxpr:
        return hit[1], hit[2]
    defs, uses = {}, {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if isinstance(v, core.Var):
                uses[v] = uses.get(v, 0) + 1
        for v in e.outvars:
            defs[v] = e
    for v in jaxpr.outvars:
        if isinstance(v, core.Var):
            uses[v] = uses.get(v, 0) + 1
    if len(_facts) > 1024:
        _facts.clear()
    _facts[id(jaxpr)] = (jaxpr, defs, uses)
    return defs, uses


def _strip_converts(v, defs, uses):
    """(v's source through float converts each used once, the vars passed)."""
    while True:
        e = defs.get(v)
        if e is None or e.primitive.name != _CONVERT or uses.get(v, 0) != 1:
            return v
        src = e.invars[0]
        if not isinstance(src, core.Var):
            return v
        v = src


def _eight_bit(v) -> bool:
    from ..ragged_dot import W8_DTYPES
    return isinstance(v, core.Var) and jnp.dtype(v.aval.dtype) in W8_DTYPES


def _channel_scale(v, defs, uses, g, k, n):
    """The var s [G, N] that `v` broadcasts over K (through float converts), or None."""
    v = _strip_converts(v, defs, uses)
    e = defs.get(v)
    if e is None or uses.get(v, 0) != 1 or tuple(v.aval.shape) not in ((g, k, n), (g, 1, n)):
        return None
    name = e.primitive.name
    if name == "broadcast_in_dim" and tuple(e.params["broadcast_dimensions"]) != (0, 2):
        return None
    if name not in ("broadcast_in_dim", "reshape"):
        return None
    s = _strip_converts(e.invars[0], defs, uses) if isinstance(e.invars[0], core.Var) else None
    if s is None or tuple(s.aval.shape) != (g, n) or jnp.dtype(s.aval.dtype) not in _FLOATS:
        return None
    return e.invars[0]


def match_dequantised(jaxpr, eqn):
    """(w var, scale var or None) when rhs of `eqn` is a dequantised 8-bit weight feeding only
    this product (module docstring), else None."""
    defs, uses = _defs_and_uses(jaxpr)
    rhs = eqn.invars[1]
    if not isinstance(rhs, core.Var) or uses.get(rhs, 0) != 1:
        return None
    g, k, n = rhs.aval.shape
    src = _strip_converts(rhs, defs, uses)
    if src is not rhs and _eight_bit(src):
        return src, None
    e = defs.get(src)
    if e is None or e.primitive.name != "mul" or (src is not rhs and uses.get(src, 0) != 1):
        return None
    a, b = e.invars
    for w, s in ((a, b), (b, a)):
        if not isinstance(w, core.Var):
            continue
        wsrc = _strip_converts(w, defs, uses)
        if wsrc is w or not _eight_bit(wsrc) or uses.get(w, 0) != 1:
            continue
        if tuple(wsrc.aval.shape) != (g, k, n):
            continue
        scale = _channel_scale(s, defs, uses, g, k, n) if isinstance(s, core.Var) else None
        if scale is not None:
            return wsrc, scale
    return None


def _warn_fallback(eqn, lhs, rhs, out_dtype):
    from .. import _warn as warn
    from ..ragged_dot import fallback
    f = fallback("auto", lhs.shape, rhs.shape, lhs.dtype, rhs.dtype, out_dtype)
    if f is not None and f[1] and not warn.quiet():
        file, line = site_of(eqn) or ("<unknown>", 0)
        key = (file, line, f[0])
        if key not in _warned:
            _warned.add(key)
            warnings.warn_explicit(f"jax_nvcomm.jit: {f[0]} (JAX_NVCOMM_QUIET=1 silences "
                                   "this)", warn.XlaPathWarning, file, line)


def _row(eqn, lhs, rhs, became, reason):
    return dict(op="ragged_dot", source=source_of(eqn),
                shape=(tuple(lhs.shape), tuple(rhs.shape)),
                dtype=f"{jnp.dtype(lhs.dtype).name} x {jnp.dtype(rhs.dtype).name}", axes=(),
                became=became, reason=reason, where=site_of(eqn))


def rewrite(eqn, jaxpr, read, in_shard_map):
    """The replacement of the MoE-form ragged_dot `eqn` of `jaxpr` (whose earlier variables
    `read` gives): (outputs, Site fields) when it becomes our op, None to bind it as it is."""
    import importlib
    rd = importlib.import_module("jax_nvcomm.ragged_dot")  # the package's name is the function
    if not in_shard_map and jax.device_count() > 1:
        return None
    lhs, rhs, gs = (read(v) for v in eqn.invars)
    pet = eqn.params.get("preferred_element_type")
    precision = eqn.params.get("precision")
    out_aval = eqn.outvars[0].aval
    out_dtype = jnp.dtype(out_aval.dtype)
    gs = gs.astype(jnp.int32)
    dq = None if _eight_bit(eqn.invars[1]) else match_dequantised(jaxpr, eqn)
    if dq is not None:
        w = read(dq[0])
        scale = None if dq[1] is None else read(dq[1]).astype(jnp.float32)
        mode = 0 if scale is None else 1
        if not rd._kernel_platforms("auto", lhs, w, out_dtype):
            dq = None  # the 8-bit kernel serves no platform here: the program as written
    if dq is None:
        _warn_fallback(eqn, lhs, rhs, out_dtype)
        platforms = rd._kernel_platforms("auto", lhs, rhs, out_dtype)
        w8 = jnp.dtype(rhs.dtype) in rd.W8_DTYPES
        if not platforms:
            return None
        with _user_context(eqn):
            out = rd._ragged_dot(lhs, rhs, gs, pet, precision, "auto", False)
        became = (f"ragged_dot_w8 ({jnp.dtype(rhs.dtype).name}, no scale)" if w8 else
                  "ragged_dot (kernel)")
        return [_like(out, out_aval)], _row(eqn, lhs, rhs, became,
                                            f"kernel on {', '.join(platforms)}")
    with _user_context(eqn):
        out = rd._ragged_dot_w8(lhs, w, scale, mode, gs, out_dtype, precision, "auto", False)
    what = "no scale" if scale is None else "per-channel scale"
    return [_like(out, out_aval)], _row(
        eqn, lhs, w, f"ragged_dot_w8 ({jnp.dtype(w.dtype).name}, {what})",
        "the dequantised weight feeds only this product: the 8-bit weight and its scale go "
        "to the kernel")


@contextlib.contextmanager
def _user_context(eqn):
    """The user's source line and name stack around the binding of our op."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
          eqn.ctx.manager):
        yield
