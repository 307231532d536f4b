"""A source folder without compiled modules that comes first on sys.path (Python started in a
checkout's root after a plain `pip install .`) fails with an error naming both folders and the
fix, instead of a bare ModuleNotFoundError of `_host`."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import jax_nvcomm

PKG = os.path.dirname(os.path.abspath(jax_nvcomm.__file__))


def test_a_shadowing_source_folder_names_the_install_and_the_fix(tmp_path):
    import glob
    if not glob.glob(os.path.join(PKG, "_host*.so")):
        pytest.skip("an editable install: its import hook goes before any folder on sys.path")
    shutil.copytree(PKG, tmp_path / "jax_nvcomm",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(PKG), "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", "import jax_nvcomm"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert f"imported the source folder {tmp_path / 'jax_nvcomm'}" in last, p.stderr
    assert f"instead of the install in {PKG}" in last and "pip install -e ." in last, last
