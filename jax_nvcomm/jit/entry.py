"""`jax_nvcomm.jit`: `jax.jit` with XLA's collectives inside shard_map bodies replaced by ours
where we have a kernel (the jaxpr pass: `_rewrite`), and `close_all`.

How a call runs: the function is traced to a jaxpr (once per input signature); the pass lists
the communicators its collectives want (`_rewrite.needs`); the pool makes those that are
missing, outside the trace and collectively (`_pool.ensure`); then a `jax.jit` of "evaluate the
jaxpr, re-binding its collectives as our ops" runs the call. jax.jit's own cache, donation,
static arguments and `.lower()` apply to that function unchanged.
"""
from __future__ import annotations

import functools
import inspect
import threading
import weakref

import jax
from jax._src import core
from jax._src.interpreters import ad

from .. import _registry
from . import pool as _pool, regions as _regions, rewrite as _rewrite

_GEN = _pool._generation  # the pool's generation counter (a one-element list), read per call
_TC = core.trace_ctx      # JAX's tracing context: .trace is its eval trace (or None) when no
_EVAL = core.eval_trace   # trace is around the call (a linearize tracer needs the slow path)


_MAX_RETRACES = 8  # traces of a call that may each find communicators missing (one per
                   # communicator an op of ours asks for by axis name, at most)


class _NotPrepared(Exception):
    """Raised inside the trace of a call whose communicators are missing or too small: the
    call sets the trace aside, makes them (`_pool.ensure`, outside any trace) and runs again.
    Never seen by users."""

    def __init__(self, needs):
        super().__init__("jax_nvcomm.jit: communicators not prepared")
        self.needs = needs


def _op_without_communicator(axes, kind):
    """An op of ours called with axis_name= inside the program found no communicator: have the
    pool make one over those axes of the shard_map's mesh, of a default Communicator's size
    (raises _NotPrepared: made outside the trace, the call traced again). Returns (the op's
    own error follows) where no mesh is known, the axes are not its, the pool refused, or
    the op wants a MoECommunicator (made with the layer's sizes: the caller's to make)."""
    if kind != "tp":
        return
    mesh = _pool.concrete_mesh_here()
    if mesh is None or not all(a in mesh.axis_names for a in axes):
        return
    if _pool.refused(mesh, axes) or _pool.lookup(mesh, axes)[0] is not None:
        return
    raise _NotPrepared([_rewrite.Need(mesh, tuple(axes), _pool.OP_BYTES, 0)])


def _with_dynamic(args, kwargs, dyn_idx, dyn_args, dyn_kwargs):
    """(args, kwargs) of a call with its dynamic arguments replaced (`Jitted._split`'s)."""
    full = list(args)
    for i, a in zip(dyn_idx, dyn_args):
        full[i] = a
    kw = dict(kwargs)
    kw.update(dyn_kwargs)
    return full, kw


def _normalize_argnums(nums, n):
    if nums is None:
        return ()
    if isinstance(nums, int):
        nums = (nums,)
    return tuple(sorted({i % n if n else i for i in nums if -n <= i < n}))


class _Program:
    """The state of `jit(fun, **kw)` that costs a trace to rebuild: the communicators' needs
    per signature, the jax.jit functions per pool generation, the reverse-mode pair. Shared by
    every `Jitted` of the same function and jit arguments (`_cache`), so `jit(f, **kw)(x)`
    written inline at each call traces and compiles once, as `jax.jit(f, **kw)(x)` does.

    It holds the function weakly (the `Jitted` the caller has holds it strongly; a partial or
    bound method equal to the first is re-bound by each new `Jitted`: `bind`)."""

    def __init__(self, fun, jit_kwargs):
        self._ref = _weak(fun)
        self._kw = dict(jit_kwargs)
        names = self._kw.get("static_argnames") or ()
        self._static_names = (names,) if isinstance(names, str) else tuple(names)
        self._static_nums = self._kw.get("static_argnums")
        try:
            self._sig = inspect.signature(fun)
        except (TypeError, ValueError):
            self._sig = None
        self._params = [] if self._sig is None else list(self._sig.parameters.values())
        self._needs: dict = {}
        self._jits: dict = {}
        self._last = None  # (signature and pool generation, jaxpr, output tree) of the last trace
        self._vjp = None  # (forward, backward) Jitted for calls under jax.grad

    @property
    def _fun(self):
        fun = self._ref()
        if fun is None:  # pragma: no cover - a Jitted holds it while it runs
            raise RuntimeError("jax_nvcomm.jit: the function was garbage collected")
        return fun

    def bind(self, fun) -> None:
        """Run `fun` (equal to the one this program was made for) from now on."""
        if self._ref() is not fun:
            self._ref = _weak(fun)

    # -- which arguments are static ------------------------------------------------------------
    def _static_positions(self, n):
        pos = set(_normalize_argnums(self._static_nums, n))
        for i, p in enumerate(self._params[:n]):
            if p.name in self._static_names and p.kind in (p.POSITIONAL_ONLY,
                                                           p.POSITIONAL_OR_KEYWORD):
                pos.add(i)
        return pos

    def _static_kw(self, kwargs):
        names = set(self._static_names)
        nums = set(_normalize_argnums(self._static_nums, len(self._params)))
        for i, p in enumerate(self._params):
            if i in nums:
                names.add(p.name)
        return {k for k in kwargs if k in names}

    def _split(self, args, kwargs):
        static = self._static_positions(len(args))
        skw = self._static_kw(kwargs)
        dyn_idx = [i for i in range(len(args)) if i not in static]
        dyn = ([args[i] for i in dyn_idx], {k: v for k, v in kwargs.items() if k not in skw})
        return dyn_idx, dyn, skw

    def _trace(self, args, kwargs):
        """(the ClosedJaxpr of fun on these arguments, the output tree, the dynamic
        arguments as one pytree)."""
        dyn_idx, dyn, _ = self._split(args, kwargs)

        def g(dyn_args, dyn_kwargs):
            full, kw = _with_dynamic(args, kwargs, dyn_idx, dyn_args, dyn_kwargs)
            return self._fun(*full, **kw)

        g.__name__ = getattr(self._fun, "__name__", "fun")
        try:
            key = (self._signature(args, kwargs), _pool.generation())
        except TypeError:
            key = None
        last, self._last = self._last, None
        if key is not None and last is not None and last[0] == key:
            return last[1], last[2], dyn
        with _registry.on_miss(_op_without_communicator):
            closed, shape = jax.make_jaxpr(g, return_shape=True)(*dyn)
        closed = _regions.cut(closed)  # products sharded by type -> shard_map regions
        tree = jax.tree.structure(shape)
        if key is not None and not any(isinstance(c, core.Tracer) for c in closed.consts):
            # the next trace of the same signature (the retry after the communicators were
            # made, or `lower` after `_prepare`) takes this jaxpr instead of tracing fun again
            # (and cutting its regions again)
            self._last = (key, closed, tree)
        return closed, tree, dyn

    def _signature(self, args, kwargs):
        dyn_idx, dyn, skw = self._split(args, kwargs)
        leaves, tree = jax.tree.flatten(dyn)
        static = (tuple((i, args[i]) for i in range(len(args)) if i not in dyn_idx),
                  tuple(sorted((k, kwargs[k]) for k in skw)))
        try:
            hash(static)
        except TypeError:
            static = repr(static)
        return (tree, tuple(jax.typeof(x) for x in leaves), static)

    # -- preparing the communicators -----------------------------------------------------------
    def _prepare(self, args, kwargs):
        try:
            sig = self._signature(args, kwargs)
        except TypeError:
            sig = None
        needs = self._needs.get(sig) if sig is not None else None
        for _ in range(_MAX_RETRACES):
            if needs is not None:
                break
            try:
                closed, _, _ = self._trace(args, kwargs)
            except _NotPrepared as e:  # an op of ours called with axis_name=: made, again
                _pool.ensure(e.needs)
                continue
            needs = _rewrite.needs(closed.jaxpr)
            if sig is not None:
                self._needs[sig] = needs
        if needs is None:  # pragma: no cover - the pool refused to settle: the call says why
            needs = []
        if not _pool.ready(needs):
            _pool.ensure(needs)

    def _run(self, records, args, kwargs):
        closed, tree, dyn = self._trace(args, kwargs)
        needs = _rewrite.needs(closed.jaxpr)
        if not _pool.ready(needs):
            raise _NotPrepared(needs)
        ctx = _rewrite.Ctx(lookup=_pool.lookup, records=records)
        outs = _rewrite.evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(dyn), ctx)
        return jax.tree.unflatten(tree, outs)

    def _jitted(self, records=None):
        """The jax.jit function of the current pool generation (a new function object per
        generation, so that programs holding a replaced communicator are traced again)."""
        gen = _pool.generation()
        if records is None and gen in self._jits:
            return self._jits[gen]

        def run(*args, **kwargs):
            return self._run(records, args, kwargs)

        # the function's names, not the function (functools.wraps would keep it alive through
        # __wrapped__: the cache holds the program weakly keyed on it)
        for attr in ("__name__", "__qualname__", "__module__", "__doc__"):
            try:
                setattr(run, attr, getattr(self._fun, attr))
            except (AttributeError, TypeError):
                pass
        if self._sig is not None:  # jax.jit reads static_argnames / donate_argnames from it
            run.__signature__ = self._sig

        f = jax.jit(run, **self._kw)
        if records is None:
            self._jits = {gen: f}
        return f


    # -- reverse mode: the backward program rewritten too ----------------------------------------
    def _call_linearized(self, args, kwargs):
        """A call under jax.grad / vjp / linearize (its arguments are linearize tracers):
        JAX would transpose the rewritten forward program itself, leaving the collectives
        its transposition makes (a psum per pvary, say) XLA's. Here the forward is the
        rewrite of `jax.vjp(fun)` (its residuals come out as a pytree) and the backward the
        rewrite of applying them, joined by a custom_vjp, so both programs run our kernels."""
        if self._vjp is None:
            kw = dict(self._kw)

            def forward(*a, **k):
                dyn_idx, (dyn, dyn_kw), _ = self._split(a, k)
                leaves, tree = jax.tree.flatten((dyn, dyn_kw))

                def g(*ls):
                    full, kk = _with_dynamic(a, k, dyn_idx, *jax.tree.unflatten(tree, ls))
                    return self._fun(*full, **kk)

                return jax.vjp(g, *leaves)

            def backward(vjp_fn, ct):
                return tuple(None if c.dtype == jax.dtypes.float0 else c for c in vjp_fn(ct))

            self._vjp = (Jitted(forward, kw), Jitted(backward, {}))
        fwd_j, bwd_j = self._vjp
        dyn_idx, (dyn, dyn_kw), _ = self._split(args, kwargs)
        leaves, tree = jax.tree.flatten((dyn, dyn_kw))

        def rebuilt(ls):  # the call's arguments with the dynamic leaves ls
            return _with_dynamic(args, kwargs, dyn_idx, *jax.tree.unflatten(tree, ls))

        @jax.custom_vjp
        def call(*ls):
            a, k = rebuilt(ls)
            return fwd_j(*a, **k)[0]

        def fwd(*ls):
            a, k = rebuilt(ls)
            return fwd_j(*a, **k)

        def bwd(vjp_fn, ct):
            return bwd_j(vjp_fn, ct)

        call.defvjp(fwd, bwd)
        return call(*leaves)

    # -- the jax.jit surface -------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if not core.trace_state_clean() and any(  # (no trace: nothing to look for)
                isinstance(x, ad.LinearizeTracer) for x in jax.tree.leaves((args, kwargs))):
            return self._call_linearized(args, kwargs)
        # The hot path is jax.jit's own dispatch: a signature seen before runs its compiled
        # program with no Python work here. A new signature is traced by jax.jit; when its
        # communicators are missing the trace raises _NotPrepared, they are made outside the
        # trace, and the call runs again on a NEW jax.jit function: one whose trace raised
        # keeps taking jax's Python dispatch path for that signature (measured: 170-230 us
        # per call instead of 5-15), so it is dropped (its other signatures compile again).
        for _ in range(_MAX_RETRACES):
            try:
                return self._jitted()(*args, **kwargs)
            except _NotPrepared as e:
                _pool.ensure(e.needs)
                self._jits = {}
        self._prepare(args, kwargs)  # pragma: no cover - the pool refused to settle
        return self._jitted()(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """`jax.jit(...).lower`: the rewritten program, lowered (its communicators made)."""
        self._prepare(args, kwargs)
        return self._jitted().lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        """`jax.jit(...).trace` of the rewritten program."""
        self._prepare(args, kwargs)
        return self._jitted().trace(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        """`jax.eval_shape` of fun (nothing is rewritten or made)."""
        return jax.eval_shape(self._fun, *args, **kwargs)

    def explain_rows(self, *args, **kwargs):
        """(the Sites of the rewrite of this call, its lowered program): for `explain`."""
        self._prepare(args, kwargs)
        records: list = []
        lowered = self._jitted(records).lower(*args, **kwargs)
        return records, lowered


class Jitted:
    """What `jit` returns: call it like the `jax.jit` function of `fun` (also `.lower`,
    `.trace`, `.eval_shape`). Holds `fun`; what was traced and compiled lives in a `_Program`
    shared by every Jitted of the same function and jit arguments."""

    def __init__(self, fun, jit_kwargs, program=None):
        self._fun = fun
        self._program = _Program(fun, jit_kwargs) if program is None else program
        functools.update_wrapper(self, fun)

    def _p(self):
        p = self._program
        p.bind(self._fun)
        return p

    def __call__(self, *args, **kwargs):
        # The hot path: with no trace around the call, the jax.jit function of the pool's
        # current generation runs it straight away (a signature seen before: jax.jit's own
        # C++ dispatch, plus these few attribute tests)
        p = self._program
        if p._ref() is not self._fun:
            p.bind(self._fun)
        f = p._jits.get(_GEN[0])
        t = _TC.trace
        if f is not None and (t is _EVAL or t is None):
            try:
                return f(*args, **kwargs)
            except _NotPrepared as e:  # a new signature whose communicators are missing
                _pool.ensure(e.needs)
                p._jits = {}
        return p(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """`jax.jit(...).lower`: the rewritten program, lowered (its communicators made)."""
        return self._p().lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        """`jax.jit(...).trace` of the rewritten program."""
        return self._p().trace(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        """`jax.eval_shape` of fun (nothing is rewritten or made)."""
        return jax.eval_shape(self._fun, *args, **kwargs)

    def explain_rows(self, *args, **kwargs):
        """(the Sites of the rewrite of this call, its lowered program): for `explain`."""
        return self._p().explain_rows(*args, **kwargs)

    def __repr__(self):
        return f"jax_nvcomm.jit({getattr(self._fun, '__name__', self._fun)!r})"


# ---------------------------------------------------------------------------------------------
# the cache of programs: jit(f, **kw) written inline at every call finds the program of the
# first call, as jax.jit(f, **kw) finds its traces (keyed on the function, held weakly)

class _Strong:
    """A strong reference with weakref.ref's call (for callables that refuse weak ones)."""
    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __call__(self):
        return self.obj


def _weak(obj):
    try:
        return weakref.ref(obj)
    except TypeError:
        return _Strong(obj)


_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # anchor -> {key: _Program}
_cache_lock = threading.Lock()
_PER_ANCHOR = 64  # programs kept per anchor, the oldest dropped first


def _hashable(v):
    """v with lists / tuples / dicts / sets made hashable, recursively (TypeError: it cannot
    be)."""
    if isinstance(v, (list, tuple)):
        return (type(v).__name__,) + tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return ("dict",) + tuple(sorted(((k, _hashable(x)) for k, x in v.items()),
                                        key=lambda kv: repr(kv[0])))
    if isinstance(v, (set, frozenset)):
        return ("set", frozenset(_hashable(x) for x in v))
    hash(v)
    return v


def _anchor_and_key(fun, jit_kwargs):
    """(the object the cache entry lives as long as, the key under it), or None: no caching.
    A function is its own anchor; a functools.partial is anchored on the function it wraps
    and keyed by its arguments (equal partials share a program); a bound method on the
    object it is bound to, keyed by the function."""
    try:
        kw = _hashable(jit_kwargs)
        if isinstance(fun, functools.partial):
            parts = []
            while isinstance(fun, functools.partial):
                parts.append((_hashable(fun.args), _hashable(fun.keywords or {})))
                fun = fun.func
            anchor, key = _anchor_and_key(fun, {})
            return anchor, ("partial", key, tuple(parts), kw)
        if inspect.ismethod(fun):
            return fun.__self__, ("method", fun.__func__, kw)
        return fun, ("fun", kw)
    except TypeError:
        return None


def _program(fun, jit_kwargs):
    """The cached `_Program` of (fun, jit_kwargs), made at the first request (None: these
    cannot be cached)."""
    found = _anchor_and_key(fun, jit_kwargs)
    if found is None:
        return None
    anchor, key = found
    with _cache_lock:
        try:
            per = _cache.get(anchor)
            if per is None:
                per = _cache[anchor] = {}
        except TypeError:  # the anchor refuses weak references (or hashing)
            return None
        prog = per.get(key)
        if prog is None:
            if len(per) >= _PER_ANCHOR:  # (partials of one function with ever new arguments)
                per.pop(next(iter(per)))
            prog = per[key] = _Program(fun, jit_kwargs)
    return prog


def jit(fun=None, **jax_jit_kwargs):
    """`jax.jit` with our kernels in place of XLA's collectives inside `shard_map` bodies.

    A drop-in for `jax.jit` (same call, `.lower()`, `donate_argnums`, `static_argnums`,
    `static_argnames`, one compiled program per input signature): `fun` is traced to a jaxpr
    and evaluated with, inside every shard_map body (also in scan, cond, while, checkpoint,
    custom_jvp / custom_vjp, inner jits, partially manual shard_maps, and in what jax.grad
    made of it):
      - `lax.psum` / `pmean` of floats -> `all_reduce`;
      - psum -> add of a residual -> RMSNorm (float32 upcast or not, mean of x*x / square /
        x**2, rsqrt or 1/sqrt, any eps, a weight of x's dtype or float32, the norm in another
        function or jitted helper, the new residual used later) -> one `all_reduce_rms_norm`
        (followed by a per-token FP8 scaling and cast -> `all_reduce_rms_norm_quant`);
      - `lax.all_gather` -> `all_gather`; `lax.psum_scatter` along dim 0 -> `reduce_scatter_v`;
        `lax.ragged_all_to_all` -> `ragged_all_to_all`.
    Collectives our ops cannot serve (integers, sizes XLA does better per the strategy table,
    messages over the buffers, axis_index_groups) stay XLA's; `explain(fun, *args)` lists every
    one and why, and a fallback the user can fix warns once per call site
    (`JAX_NVCOMM_QUIET=1` silences). Programs sharded by type (Explicit mesh axes, or Auto
    ones with stated constraints) get the same: a product whose contraction XLA would
    all-reduce becomes a shard_map region (`jit/regions.py`), so it runs on our all-reduce,
    fused with the add + RMSNorm after it. Other collectives XLA's partitioner inserts outside
    shard_map are out of its reach (`explain` lists them too).

    Written inline, `jit(f, **kw)(x)` at every call, it costs what `jax.jit(f, **kw)(x)` does:
    what was traced and compiled is cached on the function (held weakly: the cache keeps no
    function or object alive) and the jit arguments; equal `functools.partial`s of a function
    share it, a bound method's is kept per object; jit arguments or partial arguments that
    cannot be hashed are not cached (each such call traces again, still correct).

    Communicators are made at the first call with concrete arguments (or `.lower()`), from
    the program's messages, collectively over the job's processes in program order; they are
    reused by later calls and programs, and closed by `close_all()` or at exit. Calling the
    function under `jax.grad` / `jax.vmap` or inside an outer `jax.jit` works (the
    communicators are made outside those traces; under `jax.grad` / `vjp` the backward
    program is rewritten too); inside a `shard_map` it raises.

    Args:
      fun: the function, as for `jax.jit` (also usable as `@jit` or `@jit(**kwargs)`).
      **jax_jit_kwargs: passed to `jax.jit` unchanged.

    Returns:
      A `Jitted` callable.
    """
    if fun is None:
        return functools.partial(jit, **jax_jit_kwargs)
    return Jitted(fun, jax_jit_kwargs, _program(fun, jax_jit_kwargs))

