"""The communicators `jax_nvcomm.jit` makes: one per (mesh, axes), made outside any trace at a
program's first call from its messages, reused by later calls and programs, re-made larger only
when a message does not fit, closed by `close_all()` or at exit.

Made collectively: every process runs the same program, so every process asks for the same
communicators in the same order (the program order of their first collective, `_rewrite.needs`)
and makes them together. Sizes: `max_message_bytes` is the largest message of the program
rounded up to a power of two (at least 64 KiB, and enough for the one-shot slot to hold the
largest all-reduce as a default Communicator's would: `_size`), capped by
JAX_NVCOMM_JIT_MAX_MESSAGE_BYTES (default 256 MiB): larger messages stay XLA's, and `explain`
says so. A ragged_all_to_all (or an all_to_all taken as one) counts with what one round would
need only up to JAX_NVCOMM_JIT_RAGGED_MAX_MESSAGE_BYTES (default 32 MiB, a default
Communicator's): beyond it the call takes the chunked path (any output size in the
communicator's memory), so a large dispatch does not grow the communicator.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import threading

from jax._src import core

from ..communicator import Communicator

_lock = threading.RLock()
_comms: dict = {}      # (mesh, axes) -> Communicator
_refused: dict = {}    # (mesh, axes) -> why no communicator could be made
_MIN_BYTES = 64 << 10
OP_BYTES = 32 << 20    # max_message_bytes of one made for an op called with axis_name= (a
                       # default Communicator's: the op's messages are not known before it runs)
_generation = [0]      # bumped when a communicator is re-made: programs traced before hold
                       # the old one's id and are traced again (`generation`)


def _bump() -> None:
    _generation[0] += 1


def generation() -> int:
    """A number that changes whenever a communicator programs may hold was replaced."""
    return _generation[0]


def cap_bytes() -> int:
    """The largest max_message_bytes the pool gives a communicator."""
    return int(os.environ.get("JAX_NVCOMM_JIT_MAX_MESSAGE_BYTES", str(256 << 20)))


def ragged_cap_bytes() -> int:
    """The most a ragged message's one-round need adds to max_message_bytes (larger ones take
    the chunked path)."""
    return int(os.environ.get("JAX_NVCOMM_JIT_RAGGED_MAX_MESSAGE_BYTES", str(32 << 20)))


_SLOT_CAP = 1 << 20  # the one-shot (Lamport) slot of a default-sized Communicator


def _size(need) -> int:
    """max_message_bytes for a need: a power of two holding its largest message (a ragged
    one's one-round need counted up to ragged_cap_bytes(): past it the call is chunked), and
    large enough that the one-shot slot (about a sixth of it) holds its largest all-reduce up
    to the slot a default Communicator has, so nvc.jit picks the strategies hand-written code
    on a default Communicator gets; capped by cap_bytes()."""
    from .. import _ffi
    world = 1
    for a in need.axes:
        world *= int(need.mesh.shape[a])
    slot_want = min(need.allreduce_bytes, _SLOT_CAP)
    want = max(need.nbytes, min(getattr(need, "ragged_bytes", 0), ragged_cap_bytes()))
    size = _MIN_BYTES
    while size < want or \
            int(_ffi._host.layout(size, max(world, 1))["lamport_slot"]) < slot_want:
        size *= 2
    return min(size, max(cap_bytes(), 4096))


def _register(comm) -> None:
    """Make comm findable by axis name (the ops' `axis_name=` form) and closed by
    `jax_nvcomm.close_all()`, where the registry exists."""
    try:
        from .. import _registry
    except ImportError:  # pragma: no cover - the registry not in this build
        return
    _registry.register(comm)


def _unregister(comm) -> None:
    try:
        from .. import _registry
    except ImportError:  # pragma: no cover
        return
    _registry.unregister(comm)


@contextlib.contextmanager
def outside_trace():
    """Run the body at the top level of JAX's trace state (communicators refuse to be made
    inside a trace). Under an outer jax.jit or jax.grad this sets the trace aside for the
    collective setup, which stages nothing; inside a shard_map (a manual axis environment)
    it refuses."""
    ctx = core.trace_ctx
    if core.trace_state_clean():
        yield
        return
    if ctx.axis_env is not core.top_axis_env and ctx.axis_env.axis_sizes:
        raise RuntimeError(
            "jax_nvcomm.jit: a program run with nvc.jit was called inside shard_map (or "
            "pmap / vmap with a named axis), where its communicators cannot be made: apply "
            "nvc.jit to the function that calls shard_map, outside it")
    trace, env = ctx.trace, ctx.axis_env
    ctx.set_trace(core.eval_trace)
    ctx.set_axis_env(core.top_axis_env)
    try:
        yield
    finally:
        ctx.set_trace(trace)
        ctx.set_axis_env(env)


def _usable(comm) -> bool:
    return comm is not None and not comm.closed


def ensure(needs) -> None:
    """Make (or re-make larger) the communicators `needs` (a list of `_rewrite.Need` in
    program order) asks for. Collective: every process calls it with the same needs."""
    with _lock, outside_trace():
        for need in needs:
            key = (need.mesh, need.axes)
            comm = _comms.get(key)
            want = _size(need)
            if _usable(comm) and comm.max_message_bytes >= want:
                continue
            if key in _refused and not _usable(comm):
                continue
            if _usable(comm):  # too small: make it again, larger (close() bumps the
                _unregister(comm)  # generation through its hook, as any close of it does)
                comm.close()
            axis = need.axes[0] if len(need.axes) == 1 else tuple(need.axes)
            try:
                comm = Communicator(need.mesh, axis, max_message_bytes=want)
            except (ValueError, TypeError) as e:
                # the same on every process (argument checks come before anything collective)
                _refused[key] = f"no communicator over {axis!r}: {e}"
                _comms.pop(key, None)
                continue
            _comms[key] = comm
            comm._close_hooks = (_bump,)  # closed by anyone (close_all, the user): retrace
            _register(comm)


def _same_shape(mesh, abstract) -> bool:
    return (tuple(mesh.axis_names) == tuple(abstract.axis_names) and
            tuple(int(mesh.shape[a]) for a in mesh.axis_names) == tuple(
                int(s) for s in abstract.axis_sizes))


def concrete_mesh_here():
    """The concrete `Mesh` of the shard_map being traced now (its axis names and sizes those
    of the current abstract mesh), or None. Looked for where the trace has it: the innermost
    shard_map's own mesh argument (on the stack of jax's shard_map tracing), else the mesh of
    `jax.set_mesh`. (Not a mesh of the same names and sizes from elsewhere: its devices may
    be in another order.)"""
    import sys

    import jax
    from jax._src import mesh as mesh_lib
    try:
        am = jax.sharding.get_abstract_mesh()
    except Exception:  # pragma: no cover
        return None
    if am is None or am.empty:
        return None
    cands = []
    frame = sys._getframe(1)
    while frame is not None:  # jax's shard_map tracing holds its Mesh as a local: `mesh`
        if frame.f_code.co_name.startswith("_shard_map") and \
                frame.f_code.co_filename.endswith("shard_map.py"):
            m = frame.f_locals.get("mesh")
            if isinstance(m, jax.sharding.Mesh):
                cands.append(m)
                break
        frame = frame.f_back
    del frame
    try:
        cands.append(mesh_lib.get_concrete_mesh())
    except Exception:  # pragma: no cover
        pass
    for m in cands:
        if isinstance(m, jax.sharding.Mesh) and not m.empty and _same_shape(m, am):
            return m
    return None


def lookup(mesh, axes):
    """(the pool's communicator for mesh and axes, or None, and why none)."""
    key = (mesh, tuple(axes))
    with _lock:
        comm = _comms.get(key)
        if _usable(comm):
            return comm, ""
        if key in _refused:
            return None, _refused[key]
    return None, (f"no communicator for axes {tuple(axes)!r} (the program was not prepared: "
                  "call the nvc.jit function with arrays, or nvc.explain, before tracing it "
                  "inside another transformation)")


def refused(mesh, axes) -> bool:
    """Whether making a communicator for (mesh, axes) was refused (its reason: `lookup`)."""
    key = (mesh, tuple(axes))
    with _lock:
        return key in _refused and not _usable(_comms.get(key))


def ready(needs) -> bool:
    """Whether every need has a usable communicator large enough, or a standing refusal."""
    with _lock:
        for need in needs:
            key = (need.mesh, need.axes)
            comm = _comms.get(key)
            if _usable(comm) and comm.max_message_bytes >= _size(need):
                continue
            if key in _refused and not _usable(comm):
                continue
            return False
    return True


def held() -> list:
    """The pool's open communicators, in the order they were made."""
    with _lock:
        return [c for c in _comms.values() if _usable(c)]


def close() -> None:
    """Close the pool's communicators (collective, in the order they were made)."""
    with _lock:
        comms = [c for c in _comms.values() if _usable(c)]
        _comms.clear()
        _refused.clear()
        _generation[0] += 1
    errors = []
    for c in comms:
        _unregister(c)
        try:
            c.close()
        except Exception as e:  # close the others, then report
            errors.append(e)
    if errors:
        raise errors[0]


def _at_exit() -> None:
    try:
        close()
    except Exception:  # the job is ending: nothing to report to
        pass


atexit.register(_at_exit)
