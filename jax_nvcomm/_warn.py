"""Warnings the user can act on, once per call site: an op that takes XLA's path for a reason
the user can fix (a dtype mix, a size over the buffers) says so the first time a given line of
the user's code reaches it, not on every retrace. `JAX_NVCOMM_QUIET=1` silences them all.

The call site is the innermost frame outside this package and outside jax (the user's line
that called the op, also when the op is reached through jit / shard_map / scan tracing); the
warning is issued with that file and line (`warnings.warn_explicit`), so Python's warning
filters and pytest's `pytest.warns` see it as coming from there.
"""
from __future__ import annotations

import os
import sys
import threading
import warnings

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_seen: set = set()
_lock = threading.Lock()


class XlaPathWarning(UserWarning):
    """An op of jax_nvcomm ran XLA's collective instead of its kernel for a reason the caller
    can change (the message names it)."""


def quiet() -> bool:
    return os.environ.get("JAX_NVCOMM_QUIET", "") not in ("", "0")


def _internal(filename: str) -> bool:
    f = os.path.abspath(filename)
    if f.startswith(_PKG_DIR + os.sep):
        return True
    norm = f.replace(os.sep, "/")
    return ("/jax/_src/" in norm or "/jax/" in norm and "/site-packages/" in norm
            or "/jaxlib/" in norm or norm.endswith("/contextlib.py")
            or norm.endswith("/functools.py") or filename.startswith("<frozen"))


def call_site(skip: int = 1) -> tuple[str, int]:
    """(filename, lineno) of the innermost frame outside jax_nvcomm and jax."""
    frame = sys._getframe(skip)
    last = None
    while frame is not None:
        code = frame.f_code
        last = (code.co_filename, frame.f_lineno)
        if not _internal(code.co_filename):
            return last
        frame = frame.f_back
    return last or ("<unknown>", 0)


def warn_once(message: str, *, tag: str | None = None, category=XlaPathWarning,
              site: tuple[str, int] | None = None) -> bool:
    """Warn `message` once per (call site, tag) per process; `tag` defaults to the message
    (so two different reasons at one line both show). Returns True when it warned. Silent
    under JAX_NVCOMM_QUIET=1."""
    if quiet():
        return False
    filename, lineno = site or call_site(2)
    key = (filename, lineno, message if tag is None else tag)
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    # a fresh registry: the deduplication is ours (Python's own per-module registry would
    # also hide the warning from pytest.warns / catch_warnings after its first showing)
    warnings.warn_explicit(message, category, filename, lineno, registry={})
    return True


def reset() -> None:
    """Forget which call sites warned (tests)."""
    with _lock:
        _seen.clear()
