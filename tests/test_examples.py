"""The small examples of examples/ (tp_mlp.py, ep_moe.py, dp_attention.py) run as a user runs
them (`python examples/NAME.py`, here on 8 CPU devices), print their comparison with the lax
version of the same layer, agree with it, and use only jax_nvcomm's public API."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import jax_nvcomm as nvc

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SMALL = ["tp_mlp.py", "ep_moe.py", "dp_attention.py"]


@pytest.mark.parametrize("name", SMALL)
def test_example_runs_and_agrees_with_lax(name):
    out = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(agree)" in out.stdout and " vs lax." in out.stdout, out.stdout
    assert "backend host" in out.stdout  # the CPU devices ran our host backend, not a fallback
    assert "Warning" not in out.stderr, out.stderr


@pytest.mark.parametrize("name", SMALL)
def test_example_uses_only_the_public_api(name):
    tree = ast.parse((EXAMPLES / name).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax_nvcomm"):
            pytest.fail(f"{name}: from {node.module} import ...: use `import jax_nvcomm as nvc`")
        if isinstance(node, ast.Import):
            for a in node.names:
                assert not a.name.startswith("jax_nvcomm."), f"{name}: import {a.name}"
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "nvc"):
            assert node.attr in nvc.__all__, f"{name}: nvc.{node.attr} is not public"
