"""The package's layout: no module imports, directly or through others, a module that imports
it back. Every import counts, also those inside functions (a lazy import is still a cycle: it
only hides it until the call). Read from the source files with `ast`, not by importing them."""
import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "jax_nvcomm"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports (a name imported from a package resolves to its
    submodule when there is one, else to the package)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in modules:
                    out.add(sub)
                elif mod in modules:
                    out.add(mod)
    out.discard(name)
    return out


def _graph():
    files = sorted(SRC.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): _imports(f, modules) for f in files}


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state = {}

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if n.startswith(m + "."):
                continue  # a package importing its own submodules is how packages are built
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n, stack)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [])
            if found:
                return found
    return None


def test_the_graph_sees_the_package():
    g = _graph()
    assert "jax_nvcomm.allreduce" in g and "jax_nvcomm.bench.cli" in g
    assert "jax_nvcomm._order" in g["jax_nvcomm.allreduce"]  # `from . import _order, ...`
    assert "jax_nvcomm.bench.common" in g["jax_nvcomm.bench.allreduce"]  # `from .common import`
    assert "jax_nvcomm.models.moe_transformer" in g["jax_nvcomm.bench.step"]  # inside a function


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("room", ["bench", "models"])
def test_rooms_are_packages(room):
    assert (SRC / room / "__init__.py").is_file()
