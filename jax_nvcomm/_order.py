"""Program order of jax_nvcomm calls: every call depends on the one traced before it.

Why: our protocols pair the n-th call of every rank (sequence numbers, rotating buffers), and a
device runs one call at a time. XLA may run two calls that share no data in either order, or at
once: XLA:CPU's thunk executor runs independent ops concurrently on its thread pool, and a CUDA
graph built from a command buffer may hold independent nodes as parallel branches. Ranks would
then pair different calls (a disagreement error) or wait on each other forever.

How: every FFI target takes one more operand and returns one more result, a 4-byte order token
that carries no data (never read nor written by the handlers). Each call takes the token of the
call traced before it in the same trace. Both executors order work by the buffers it reads and
writes (XLA:CPU's thunk executor, and the CUDA-graph edges XLA derives for a command buffer), so
call n+1, which reads the buffer call n "writes", runs after it, in every executor and on every
rank alike. A data dependence through `lax.optimization_barrier` is not enough: the barrier
emits no work and aliases its buffers, so executors that look at buffers do not see it. One
chain per trace, shared by all communicators: two communicators' calls must also run in one
order, since a device blocked in one call cannot serve a peer waiting in the other.

The order is the order in which the Python code traced the calls, the same on every rank (every
rank traces the same program). This is a data dependence, not a declared side effect: our calls
are declared without `has_side_effect`, which keeps JAX's fast dispatch path (a declared effect
costs each step the Python dispatch path and runtime tokens: docs/perf/step_speed.md). Without it,
XLA may drop a call whose results are unused, merge identical calls or hoist a call out of a
loop; it does so alike on every rank, so ranks stay paired.

Scope: the chain links the calls traced in one trace (a `jit`/`shard_map` body, one loop or
branch body, one `custom_vjp` rule). A nested scope (a `lax.fori_loop`/`scan` body, a `cond`
branch, an inner `jax.jit`) starts its own chain: its calls are ordered against calls outside it
by the data between them only, since a token of an enclosing trace cannot safely be captured
(traced functions are cached, and a captured tracer would outlive its trace). A program whose
loop of jax_nvcomm calls shares no data with a jax_nvcomm call before or after the loop should
make one depend on the other; on one GPU stream, without command buffers, program order holds
anyway.
"""
from __future__ import annotations

import collections
import weakref

import jax
import jax.numpy as jnp

try:  # the current trace; internal API, looked up once
    from jax._src.core import trace_ctx as _trace_ctx
except ImportError:  # pragma: no cover - a jax without it: no chaining (documented fallback)
    _trace_ctx = None

# id(trace) -> (weak reference to the trace, its latest order token), newest last. The token is
# held strongly (nothing else may refer to it until the next call uses it); it refers to its
# trace, so the table is bounded instead of keyed weakly: only traces being traced now matter,
# and they nest far less deep than _MAX_TRACES.
_latest: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()
_MAX_TRACES = 64


def _current_trace():
    return None if _trace_ctx is None else _trace_ctx.trace


def _is_tracer_of(x, trace) -> bool:
    return isinstance(x, jax.core.Tracer) and getattr(x, "_trace", None) is trace


def _latest_alive(trace):
    entry = _latest.get(id(trace))
    if entry is None or entry[0]() is not trace:
        return None
    return entry[1]


def _parent(trace):
    """The trace an AD trace (JAX's JVP / linearize traces) builds on, else None."""
    return getattr(trace, "parent_trace", None)


def _lineage(trace):
    """trace, its parent, the parent's parent, ... (the traces whose values are valid inputs of
    an op bound in `trace`)."""
    out = []
    while trace is not None:
        out.append(trace)
        trace = _parent(trace)
    return out


def _of_any(x, traces) -> bool:
    return any(_is_tracer_of(x, t) for t in traces)


def token(axis_name):
    """The order token for the next call traced in the current trace: the latest call's (kept
    for this trace or, where it has none, for a trace an AD trace builds on: a value of a parent
    trace is a valid input here), or a fresh one (float32[1], varying over `axis_name`) for a
    chain's first call."""
    from . import _shard
    lineage = _lineage(_current_trace())
    tok = None
    for t in lineage:
        cand = _latest_alive(t)
        if cand is not None and _of_any(cand, lineage):
            tok = cand
            break
    if tok is None:
        tok = jnp.zeros((1,), jnp.float32)
    return _shard.varying(tok, axis_name)


def _put(trace, tok):
    try:
        _latest[id(trace)] = (weakref.ref(trace), tok)
    except TypeError:
        return
    _latest.move_to_end(id(trace))
    while len(_latest) > _MAX_TRACES:
        _latest.popitem(last=False)


def record(tok):
    """Make `tok` (a call's order-token result) the one the next call of this trace takes.
    Under JAX's AD traces: a call whose inputs carry no tangent is evaluated in the parent
    trace, so its token is the parent's (kept for the current trace and the parent both); a
    token of the AD trace passes its primal down to the parent (and so on), so the calls traced
    after the AD scope (a psum of the gradients) follow the calls traced in it."""
    lineage = _lineage(_current_trace())
    owner = next((i for i, t in enumerate(lineage) if _is_tracer_of(tok, t)), None)
    if owner is None:  # eager, or a token of no trace here: nothing to order
        return
    for t in lineage[:owner + 1]:
        _put(t, tok)
    x = tok
    for t in lineage[owner + 1:]:
        x = getattr(x, "primal", None)
        if x is None or not _is_tracer_of(x, t):
            break
        _put(t, x)


def zero_tangent(tok):
    """The zero tangent of an order token (typed like the token, varying axes included), for
    custom_jvp rules. The token is float32 rather than an integer type so that this is an
    ordinary zero array: JAX types integer tangents as float0, which under check_vma=False
    loses the varying axes the primal has."""
    return jnp.zeros_like(tok)
