"""Which communicator serves an axis name: the registry behind the ops' `axis_name=` form,
`communicators(...)` and `close_all()` (docs/API.md, "Communicators by axis name").

A communicator is registered under (its mesh, its axes as a tuple of str, its kind): kind "tp"
for a `Communicator` (all_reduce, the fused ops, all_gather, the varlen ops, ragged all-to-all),
"moe" for a `MoECommunicator`. Two places hold registrations:
  - scopes: one per open `with communicators(...)` block, innermost last;
  - the pool: `register()` outside any block (nvc.jit's communicators).
`find()` looks in the innermost scope first, then outward, then the pool; the first place with
a match answers, and two matches there are an ambiguity (a ValueError naming both). Inside a
shard_map the candidates are also filtered by the surrounding mesh (axis names and sizes), so
equal axis names on two meshes of different shape do not clash.

Registration is process-wide (not per thread): a program is traced in the thread that calls it,
and communicators are collective objects of the whole job anyway. Closed communicators are
never returned (they drop out of the registry when found closed).
"""
from __future__ import annotations

import contextlib
import threading

import jax

from .communicator import Communicator

_KINDS = ("tp", "moe")
_lock = threading.RLock()
_pool: list = []        # register(): outside any communicators() block (nvc.jit's pool)
_scopes: list = []      # one list per open communicators() block, innermost last
_on_miss: list = []     # callables (axes, kind) run when find() has no match, innermost last:
                        # jax_nvcomm.jit's trace has the pool make the communicator (it raises
                        # and traces again); a hook that returns lets find() raise its error


def axes_of(axis_name, what: str = "axis_name") -> tuple[str, ...]:
    """`axis_name` (a str or a tuple / list of str) as a tuple of str; a 1-tuple names the same
    group as its one axis."""
    if isinstance(axis_name, str):
        return (axis_name,)
    if isinstance(axis_name, (tuple, list)) and axis_name and \
            all(isinstance(a, str) for a in axis_name):
        if len(set(axis_name)) != len(axis_name):
            raise ValueError(f"jax_nvcomm: {what}: axis_name {tuple(axis_name)!r} names an axis "
                             "twice")
        return tuple(axis_name)
    raise TypeError(f"jax_nvcomm: {what}: axis_name must be a str or a non-empty tuple of str, "
                    f"got {axis_name!r}")


def kind_of(comm) -> str:
    """"moe" for a MoECommunicator, "tp" for a Communicator."""
    k = getattr(comm, "_kind", None)
    if k == "moe":
        return "moe"
    if k == "communicator":
        return "tp"
    raise TypeError(f"jax_nvcomm: register: expected a Communicator or MoECommunicator, got "
                    f"{type(comm).__name__}")


def key_of(comm) -> tuple:
    """(mesh, axes, kind): what a communicator is registered under."""
    return (comm.mesh, axes_of(comm.axis_name), kind_of(comm))


def _check_kind(kind, what):
    if kind not in _KINDS:
        raise ValueError(f"jax_nvcomm: {what}: kind must be 'tp' or 'moe', got {kind!r}")


def register(comm):
    """Make `comm` (a Communicator or MoECommunicator) findable by its axis name for the ops'
    `axis_name=` form; inside a `communicators(...)` block it joins that block (and is closed
    with it), else the pool (closed by `close_all()`). Registering a communicator twice is a
    no-op. Returns comm."""
    kind_of(comm)
    with _lock:
        if any(c is comm for c in _pool) or any(c is comm for s in _scopes for c in s):
            return comm
        (_scopes[-1] if _scopes else _pool).append(comm)
    return comm


def unregister(comm) -> None:
    """Forget `comm` (it is not closed). Unknown communicators are ignored."""
    with _lock:
        for place in [_pool, *_scopes]:
            place[:] = [c for c in place if c is not comm]


def registered() -> list:
    """Every registered communicator, the pool's first, then each block's, in registration
    order."""
    with _lock:
        return [*_pool, *(c for s in _scopes for c in s)]


def _current_mesh_axes():
    """{axis: size} of the mesh of the surrounding shard_map / mesh context, or None."""
    try:
        am = jax.sharding.get_abstract_mesh()
    except Exception:
        return None
    if am is None or getattr(am, "empty", True):
        return None
    return dict(zip(am.axis_names, am.axis_sizes))


def _fits_mesh(comm, axes_sizes) -> bool:
    if axes_sizes is None:
        return True
    mesh = comm.mesh
    return all(a in axes_sizes and axes_sizes[a] == int(mesh.shape[a]) for a in mesh.axis_names)


def _describe(comm) -> str:
    return f"{type(comm).__name__} over {axes_of(comm.axis_name)!r} (mesh {dict(comm.mesh.shape)})"


def find(axis_name, *, kind: str = "tp", what: str = "find", accept=None):
    """The communicator that serves `axis_name` for an op.

    Args:
      axis_name: a mesh axis name or a tuple of them (as lax takes it).
      kind: "tp" (a Communicator) or "moe" (a MoECommunicator).
      what: the op's name, for the error messages.
      accept: optional predicate on a candidate (e.g. a MoE op checks hidden / dtype); a
        candidate it refuses is not a match.

    Returns:
      The communicator of the innermost `communicators(...)` block that has one for these axes
      and kind, else the one of the pool (`register`).

    Raises:
      ValueError: none matches (naming the axes, the kind and the axes that do have one), or
        two match in the same place (naming both).
    """
    axes = axes_of(axis_name, what)
    _check_kind(kind, what)
    mesh_axes = _current_mesh_axes()
    with _lock:
        for place in [_pool, *_scopes]:   # drop closed ones
            place[:] = [c for c in place if not c.closed]
        places = [*reversed(_scopes), _pool]
        for place in places:
            hits = [c for c in place if axes_of(c.axis_name) == axes and kind_of(c) == kind
                    and _fits_mesh(c, mesh_axes) and (accept is None or accept(c))]
            if len(hits) == 1:
                return hits[0]
            if len(hits) > 1:
                raise ValueError(
                    f"jax_nvcomm: {what}: axis_name {_show(axes)} is ambiguous: "
                    + "; ".join(_describe(c) for c in hits)
                    + " are registered for it in the same place; pass comm= explicitly or "
                    "register only one")
        have = sorted({_show(axes_of(c.axis_name)) for p in places for c in p
                       if kind_of(c) == kind})
        near = [c for p in places for c in p if axes_of(c.axis_name) == axes
                and kind_of(c) == kind]
    for hook in reversed(list(_on_miss)):
        hook(axes, kind)
    hint = ""
    if near and mesh_axes is not None and not any(_fits_mesh(c, mesh_axes) for c in near):
        hint = (f"; those for {_show(axes)} are on another mesh than the surrounding "
                f"shard_map's {mesh_axes}")
    elif near and accept is not None:
        hint = (f"; those for {_show(axes)} do not fit this call: "
                + "; ".join(repr(c) for c in near))
    noun = "Communicator" if kind == "tp" else "MoECommunicator"
    raise ValueError(
        f"jax_nvcomm: {what}: no {noun} for axis_name {_show(axes)}; "
        + (f"axes that have one: {', '.join(have)}" if have else "none is registered")
        + hint + ". Create them outside jit with `with jax_nvcomm.communicators(mesh):`, run "
        "the program under jax_nvcomm.jit, or pass the communicator itself")


@contextlib.contextmanager
def on_miss(hook):
    """Within the block, `find()` calls hook(axes, kind) before it raises for want of a match
    (nvc.jit's trace: the hook raises to have the communicator made)."""
    with _lock:
        _on_miss.append(hook)
    try:
        yield
    finally:
        with _lock:
            if hook in _on_miss:
                _on_miss.remove(hook)


def _show(axes) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


@contextlib.contextmanager
def communicators(mesh, axes=None, **communicator_kwargs):
    """Create one `Communicator` per mesh axis (`axes=None`) or per given axis / tuple of axes,
    register them for the ops' `axis_name=` form, and close them on exit.

    Call it outside jit, collectively (every process of the job, same arguments, same order),
    like `Communicator`. Blocks nest: the innermost block that has a communicator for an
    axis serves it.

    Args:
      mesh: a `jax.sharding.Mesh`.
      axes: None (every axis of the mesh, one communicator each), an axis name, a tuple of
        axis names (ONE communicator over their product, as `lax.psum(x, ("X", "Y"))`), or a
        list of axis names / tuples (one communicator each).
      **communicator_kwargs: passed to every `Communicator` (max_message_bytes, backend,
        timeout_s).

    Yields:
      A dict from each given axis (a str or a tuple of str) to its Communicator.

    Raises:
      As `Communicator`; communicators made before a failing one are closed again.
    """
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError("jax_nvcomm: communicators: mesh must be a jax.sharding.Mesh, got "
                        f"{type(mesh).__name__}")
    if axes is None:
        wanted = list(mesh.axis_names)
    elif isinstance(axes, str) or (isinstance(axes, tuple)
                                   and all(isinstance(a, str) for a in axes)):
        wanted = [axes]
    elif isinstance(axes, list):
        wanted = list(axes)
    else:
        raise TypeError("jax_nvcomm: communicators: axes must be None, an axis name, a tuple of "
                        f"axis names or a list of those, got {axes!r}")
    for a in wanted:
        axes_of(a, "communicators")
    made: dict = {}
    scope: list = []
    try:
        for a in wanted:
            c = Communicator(mesh, a, **communicator_kwargs)
            made[a] = c
            scope.append(c)
    except BaseException:
        for c in reversed(scope):
            c.close()
        raise
    with _lock:
        _scopes.append(scope)
    try:
        yield made
    finally:
        with _lock:
            if scope in _scopes:
                _scopes.remove(scope)
        errors = []
        for c in scope:   # creation order: the same in every process
            try:
                c.close()
            except Exception as e:  # close the others anyway, then report
                errors.append(e)
        if errors:
            raise errors[0]


def close_all() -> None:
    """Close every registered communicator (the pool's and those of open `communicators`
    blocks), in registration order, and forget them. Collective, like `close()`: every process
    calls it."""
    with _lock:
        every = registered()
        _pool.clear()
        for s in _scopes:
            s.clear()
    errors = []
    for c in every:
        try:
            c.close()
        except Exception as e:
            errors.append(e)
    if errors:
        raise errors[0]


def resolve(comm, axis_name, *, kind: str = "tp", what: str, accept=None, comm_name="comm"):
    """The communicator of an op call: `comm` itself, or the one registered for `axis_name`
    (`find`). A str or tuple of str passed in `comm`'s place is an axis name (lax's positional
    form: `all_reduce(x, "tp")`).

    Raises:
      TypeError: both or neither given (naming them).
      ValueError: as `find`.
    """
    if axis_name is None and (isinstance(comm, str) or (
            isinstance(comm, tuple) and comm and all(isinstance(a, str) for a in comm))):
        comm, axis_name = None, comm
    if comm is not None and axis_name is not None:
        raise TypeError(f"jax_nvcomm: {what}: pass {comm_name} or axis_name, not both (got "
                        f"{comm_name}={comm!r} and axis_name={axis_name!r})")
    if comm is None and axis_name is None:
        raise TypeError(f"jax_nvcomm: {what}: missing the communicator: pass {comm_name} (a "
                        f"{'MoECommunicator' if kind == 'moe' else 'Communicator'}) or "
                        "axis_name= (a mesh axis or tuple of axes with a registered one: "
                        "jax_nvcomm.communicators, jax_nvcomm.jit)")
    if comm is not None:
        return comm
    return find(axis_name, kind=kind, what=what, accept=accept)
