"""Small facts about jaxpr equations the rewrite needs: the user's source line of an equation
(the rule is `userline`'s), and a replacement value typed like the one it replaces (weak
type)."""
from __future__ import annotations

import functools

import jax

from . import userline


def user_frame(eqn):
    """(the frame a row names, every user frame innermost first) of the call that made
    `eqn`: jax's and jax_nvcomm's frames and thin helpers skipped (`userline`)."""
    tb = eqn.source_info.traceback
    if tb is None:
        return None, ()
    return _chosen(tb)


@functools.lru_cache(maxsize=1024)
def _chosen(tb):
    return userline.choose(userline.frames_of_traceback(tb))


def source_of(eqn) -> str:
    """file:line of the user's line that made `eqn` (`userline`), or "?"."""
    frame, _ = user_frame(eqn)
    return "?" if frame is None else frame.short()


def site_of(eqn) -> tuple[str, int] | None:
    """(file name, line) of the user's line that made `eqn`, or None."""
    frame, _ = user_frame(eqn)
    return None if frame is None else (frame.file, frame.line)


def stack_of(eqn) -> tuple[str, ...]:
    """Every user frame of the call that made `eqn`, innermost first, as
    "file:line (function)"."""
    return tuple(f.long() for f in user_frame(eqn)[1])


def like(y, aval):
    """y with the weak type of the value it replaces (loop carries and branches compare
    types exactly)."""
    if getattr(aval, "weak_type", False) and not getattr(jax.typeof(y), "weak_type", False):
        from jax._src.lax import lax as lax_internal
        y = lax_internal._convert_element_type(y, aval.dtype, weak_type=True)
    return y
