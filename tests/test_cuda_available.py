"""`nvc.CUDA_BUILT` says the CUDA part is compiled in (and its module loaded), not that a GPU is
here; `nvc.cuda_available()` says the CUDA backend is usable here: compiled in and a CUDA device
that jax sees. Checked against what jax itself reports, in this process and in a fresh one
limited to CPU devices."""
from __future__ import annotations

import os
import subprocess
import sys

import jax

import jax_nvcomm as nvc
from jax_nvcomm import _ffi

PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(nvc.__file__)))


def _jax_cuda_devices() -> list:
    try:
        return [d for d in jax.devices("cuda")]
    except RuntimeError:
        return []


def test_cuda_available_is_built_and_a_cuda_device():
    assert nvc.CUDA_BUILT is (_ffi._cuda is not None)
    assert nvc.cuda_available() is (nvc.CUDA_BUILT and len(_jax_cuda_devices()) > 0)
    assert "cuda_available" in nvc.__all__


def test_cpu_only_process_is_not_cuda_available():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PKG_PARENT, env.get("PYTHONPATH")) if p)
    code = ("import jax_nvcomm as nvc, jax; "
            "print(nvc.CUDA_BUILT, nvc.cuda_available(), jax.devices()[0].platform)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    built, available, platform = p.stdout.split()
    assert built == str(nvc.CUDA_BUILT) and platform == "cpu"
    assert available == "False", p.stdout
