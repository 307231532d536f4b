"""Binding a jaxpr's equations again, as they were traced: the rewrite (`rewrite.py`) and the
region cutter (`regions.py`) both evaluate a jaxpr equation by equation into a new trace,
inlining the pure calls (`jax.jit` inside the function) that hold something they act on."""
from __future__ import annotations

import contextlib

from jax._src import core, source_info_util

# the call primitives of pure function calls (an inner jax.jit, closed calls)
CALLS = ("jit", "pjit", "closed_call", "core_call")


def call_jaxpr(eqn):
    """The ClosedJaxpr a call equation calls."""
    return eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))


def bind(eqn, invals, params=None, body=False):
    """Bind eqn's primitive on `invals` as it was traced: its parameters (or `params`), its
    source line and name stack, under the context it was traced in (body: under the
    caller's context instead: a region body's mesh)."""
    params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    ctx = contextlib.nullcontext() if body else eqn.ctx.manager
    with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
          ctx):
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def inline_eval(jaxpr, consts, args, worth):
    """Evaluate `jaxpr` on `args` (its constants `consts`, else the ClosedJaxpr's own), each
    equation bound as traced, the pure calls whose jaxpr `worth(jaxpr)` accepts inlined
    (recursively) under the call's source line and name stack."""
    env = dict(zip(jaxpr.constvars, consts if consts else getattr(jaxpr, "consts", ())))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive.name in CALLS and worth(call_jaxpr(eqn)):
            sub = call_jaxpr(eqn)
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with source_info_util.user_context(eqn.source_info.traceback,
                                               name_stack=name_stack):
                outs = inline_eval(sub, sub.consts, invals, worth)
        else:
            outs = bind(eqn, invals)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]
