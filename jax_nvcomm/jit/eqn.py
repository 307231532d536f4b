"""Small facts about jaxpr equations the rewrite needs: the user's source line of an equation,
and a replacement value typed like the one it replaces (weak type)."""
from __future__ import annotations

import os

import jax
from jax._src import source_info_util


def source_of(eqn) -> str:
    """file:line of the user frame that made `eqn` (jax's own frames skipped), or "?"."""
    tb = eqn.source_info.traceback
    if tb is None:
        return "?"
    frame = source_info_util.user_frame(tb)
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.file_name)}:{frame.start_line}"


def site_of(eqn) -> tuple[str, int] | None:
    """(file name, line) of the user frame that made `eqn`, or None."""
    tb = eqn.source_info.traceback
    frame = None if tb is None else source_info_util.user_frame(tb)
    return None if frame is None else (frame.file_name, frame.start_line)


def like(y, aval):
    """y with the weak type of the value it replaces (loop carries and branches compare
    types exactly)."""
    if getattr(aval, "weak_type", False) and not getattr(jax.typeof(y), "weak_type", False):
        from jax._src.lax import lax as lax_internal
        y = lax_internal._convert_element_type(y, aval.dtype, weak_type=True)
    return y
