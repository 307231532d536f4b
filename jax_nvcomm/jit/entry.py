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

import jax
from jax._src import core
from jax._src.interpreters import ad

from . import pool as _pool, regions as _regions, rewrite as _rewrite


class _NotPrepared(Exception):
    """Raised inside the trace of a call whose communicators are missing or too small: the
    call sets the trace aside, makes them (`_pool.ensure`, outside any trace) and runs again.
    Never seen by users."""

    def __init__(self, needs):
        super().__init__("jax_nvcomm.jit: communicators not prepared")
        self.needs = needs


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


class Jitted:
    """What `jit` returns: call it like the `jax.jit` function of `fun` (also `.lower`,
    `.trace`, `.eval_shape`)."""

    def __init__(self, fun, jit_kwargs):
        self._fun = fun
        self._kw = dict(jit_kwargs)
        names = self._kw.get("static_argnames") or ()
        self._static_names = (names,) if isinstance(names, str) else tuple(names)
        self._static_nums = self._kw.get("static_argnums")
        try:
            self._params = list(inspect.signature(fun).parameters.values())
        except (TypeError, ValueError):
            self._params = []
        self._needs: dict = {}
        self._jits: dict = {}
        self._vjp = None  # (forward, backward) Jitted for calls under jax.grad
        functools.update_wrapper(self, fun)

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
        closed, shape = jax.make_jaxpr(g, return_shape=True)(*dyn)
        closed = _regions.cut(closed)  # products sharded by type -> shard_map regions
        return closed, jax.tree.structure(shape), dyn

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
        if needs is None:
            closed, _, _ = self._trace(args, kwargs)
            needs = _rewrite.needs(closed.jaxpr)
            if sig is not None:
                self._needs[sig] = needs
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

        @functools.wraps(self._fun)
        def run(*args, **kwargs):
            return self._run(records, args, kwargs)

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
        for _ in range(3):
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

    def __repr__(self):
        return f"jax_nvcomm.jit({getattr(self._fun, '__name__', self._fun)!r})"


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
    return Jitted(fun, jax_jit_kwargs)

