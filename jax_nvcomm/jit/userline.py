"""The user's line of an op: which frame of its call stack a row of `explain` (and the
warning of a fallback) names.

Frames of jax, of Python's standard library and of jax_nvcomm's own modules are never the
user's (jax_nvcomm/models/ is model code and counts as the user's). Of the user's frames,
innermost first, the row names the innermost one that is not a thin helper:

  A frame is a THIN HELPER when all three hold:
    1. the statement it is running is a `return` (the helper hands the op's result back:
       `return jnp.einsum(...)`, `return lax.psum(y, "tp")`, one branch of an if / else);
    2. its function is short: at most `HELPER_LINES` lines from the first statement after the
       docstring to the end of the `def`;
    3. its caller is a user frame whose statement calls it by its name (`einsum(`,
       `self.linear(`). A body that jax calls (a shard_map, scan or cond body, a lambda) is
       never a helper: no user line calls it by name.

Helpers are skipped one after another (a wrapper of a wrapper). So the model line that called
`einsum(...)` (jax-llm-examples wraps `jnp.einsum` so) is the row's line, not the wrapper's.
Every user frame stays in the row's `stack` ("file:line (function)", innermost first).

Works on two kinds of stacks: a jaxpr equation's traceback (`frames_of_traceback`) and the
stack frame chain of an HLO instruction (`explain`'s rows for XLA's own collectives), which
holds user frames only; condition 3 alone tells a helper from a body jax called there.
"""
from __future__ import annotations

import ast
import functools
import linecache
import os
import re
from typing import NamedTuple

HELPER_LINES = 10
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MODELS = os.path.join(_PKG, "models") + os.sep


class Frame(NamedTuple):
    file: str
    line: int
    function: str        # the code's qualified name ("einsum", "Layer.__call__", ...)

    def short(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}"

    def long(self) -> str:
        return f"{self.short()} ({self.function})"


def is_ours(file: str) -> bool:
    """A jax_nvcomm library file (its models/ aside)."""
    path = os.path.abspath(file)
    return path.startswith(_PKG) and not path.startswith(_MODELS)


def frames_of_traceback(tb) -> list[tuple[Frame, bool]]:
    """(frame, is a user frame) for every frame of a jax Traceback, innermost first."""
    if tb is None:
        return []
    from jax._src import source_info_util as siu
    codes, lastis = tb.raw_frames()
    out = []
    for code, lasti in zip(codes, lastis):
        f = siu.raw_frame_to_frame(code, lasti)
        user = siu.is_user_filename(f.file_name) and not is_ours(f.file_name)
        out.append((Frame(f.file_name, f.start_line or 0, f.function_name), user))
    return out


def choose(frames: list[tuple[Frame, bool]]) -> tuple[Frame | None, tuple[Frame, ...]]:
    """(the frame a row names, every user frame innermost first) of `frames` ((frame, is a
    user frame), innermost first): the rule of the module docstring."""
    users = [i for i, (_, u) in enumerate(frames) if u]
    stack = tuple(frames[i][0] for i in users)
    if not users:
        return None, stack
    k = 0
    while k + 1 < len(users):
        here, caller = frames[users[k]][0], frames[users[k] + 1]
        if not caller[1] or not is_thin_helper(here, caller[0]):
            break
        k += 1
    return frames[users[k]][0], stack


@functools.lru_cache(maxsize=4096)
def is_thin_helper(frame: Frame, caller: Frame) -> bool:
    """Conditions 1-3 of the module docstring for `frame` called from `caller` (cached: every
    trace of a model asks again for the same lines)."""
    name = frame.function.rsplit(".", 1)[-1]
    if not name.isidentifier():            # <lambda>, <module>, <genexpr>
        return False
    tree = _tree(frame.file)
    if tree is None:
        return False
    fn = _function_at(tree, name, frame.line)
    if fn is None:
        return False
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str) and len(body) > 1:
        body = body[1:]                    # the docstring
    if fn.end_lineno - body[0].lineno + 1 > HELPER_LINES:
        return False
    if not isinstance(_statement_at(fn, frame.line), ast.Return):
        return False
    ctree = _tree(caller.file)
    stmt = None if ctree is None else _statement_at(ctree, caller.line)
    if stmt is None:
        return False
    text = "".join(linecache.getline(caller.file, n) for n in
                   range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return re.search(rf"\b{re.escape(name)}\s*\(", text) is not None


@functools.lru_cache(maxsize=256)
def _tree(file: str):
    src = "".join(linecache.getlines(file))
    if not src:
        return None
    try:
        return ast.parse(src)
    except (SyntaxError, ValueError):
        return None


@functools.lru_cache(maxsize=256)
def _nodes(tree) -> tuple[tuple, tuple]:
    """(the defs, the other statements) of `tree`, walked once."""
    defs, stmts = [], []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs.append(node)
        elif isinstance(node, ast.stmt) and not isinstance(node, ast.ClassDef):
            stmts.append(node)
    return tuple(defs), tuple(stmts)


def _function_at(tree, name: str, line: int):
    """The innermost `def name` whose lines hold `line`."""
    best = None
    for node in _nodes(tree)[0]:
        if node.name == name and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno >= best.lineno:
                best = node
    return best


def _statement_at(tree, line: int):
    """The innermost statement (not a def or class) of `tree` whose lines hold `line`."""
    best = None
    for node in _nodes(tree)[1]:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or (node.end_lineno - node.lineno) <= (best.end_lineno -
                                                                    best.lineno):
                best = node
    return best
