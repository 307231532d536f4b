"""The type stubs of the compiled modules (_host.pyi, _cuda.pyi) name exactly what the modules
export, with the modules' arity; py.typed ships with them."""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import jax_nvcomm

PKG = Path(jax_nvcomm.__file__).parent


def _stub(name):
    tree = ast.parse((PKG / f"{name}.pyi").read_text())
    funcs, classes = {}, set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            a = node.args
            funcs[node.name] = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
        elif isinstance(node, ast.ClassDef):
            classes.add(node.name)
    return funcs, classes


def _arity(fn) -> int | None:
    """Parameter count from nanobind's signature text ('name(a: int, b: int, /) -> ...')."""
    sig = getattr(fn, "__nb_signature__", None)
    text = sig[0][0] if sig else (fn.__doc__ or "").splitlines()[0]
    inside = text[text.index("(") + 1:text.index(")")]
    return len([p for p in inside.split(",") if p.strip() and p.strip() not in ("/", "*")])


@pytest.mark.parametrize("name", ["_host", "_cuda"])
def test_stub_matches_the_compiled_module(name):
    if name == "_cuda" and not jax_nvcomm.CUDA_BUILT:
        pytest.skip("built without the CUDA part")
    mod = importlib.import_module(f"jax_nvcomm.{name}")
    funcs, classes = _stub(name)
    exported = {n for n in dir(mod) if not n.startswith("_")}
    assert exported == set(funcs) | classes
    for n, count in funcs.items():
        assert _arity(getattr(mod, n)) == count, n
    for c in classes:
        assert inspect.isclass(getattr(mod, c))


def test_package_is_marked_typed():
    assert (PKG / "py.typed").exists()
