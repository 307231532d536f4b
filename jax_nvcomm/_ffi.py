"""Loads the extension modules and registers every XLA FFI target once, at import.

`_host` (CPU devices) always exists; `_cuda` exists when the package was built with nvcc.
Targets are plain (stateless) handlers, so registering them before any backend starts is safe.
"""
from __future__ import annotations

import glob
import importlib.machinery
import os
import re
import sys

import jax

_HERE = os.path.dirname(os.path.abspath(__file__))


def _missing_extension_message() -> str:
    """Why `_host` did not import, and what to do: a checkout's source folder (no compiled
    modules) that shadows an install, or no install at all."""
    root = os.path.dirname(_HERE)
    others = [p for p in sys.path if p and os.path.abspath(p) != root]
    spec = importlib.machinery.PathFinder.find_spec("jax_nvcomm", others)
    installed = os.path.dirname(spec.origin) if spec is not None and spec.origin else None
    if installed and glob.glob(os.path.join(installed, "_host*.so")):
        return (f"jax_nvcomm: Python imported the source folder {_HERE} (it comes first on "
                f"sys.path: the current directory or the script's), which holds no compiled "
                f"modules, instead of the install in {installed}. Install the checkout "
                "editable (pip install -e . in the checkout's root), or run from another folder")
    return (f"jax_nvcomm: the compiled extension _host is missing from {_HERE}: the package is "
            "not installed. Install the wheel, or build from the checkout's root: "
            "pip install -e .  (or bash scripts/dev.sh install)")


try:
    from . import _host
except ImportError as _e:
    raise ImportError(_missing_extension_message()) from _e


def _cudart_candidates(major: str) -> list[str]:
    """Where libcudart.so.<major> may lie when the module's RPATH (the nvidia wheel beside the
    package) does not hold it: the nvidia wheel in any sys.path entry (e.g. a venv made with
    --system-site-packages, jax's plugin installed outside it), then the CUDA toolkit."""
    name = f"libcudart.so.{major}"
    out = []
    for p in sys.path:
        for sub in (f"nvidia/cu{major}/lib", "nvidia/cuda_runtime/lib"):
            out.append(os.path.join(p or ".", sub, name))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            out.append(os.path.join(home, "lib64", name))
    return [c for c in dict.fromkeys(out) if os.path.isfile(c)]


def _import_cuda():
    """(the _cuda module or None, why not). The module needs the shared CUDA runtime
    (libcudart.so.12 or .13, whichever nvcc built it against), not a GPU or a driver."""
    try:
        from . import _cuda as mod
        return mod, None
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}._cuda":
            raise
        return None, "built without the CUDA part (no nvcc, or JAX_NVCOMM_CUDA=OFF)"
    except ImportError as e:
        m = re.search(r"libcudart\.so\.(\d+)", str(e))
        if m is None:
            return None, f"the CUDA module did not load: {e}"
        import ctypes
        for cand in _cudart_candidates(m.group(1)):
            try:
                ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
                from . import _cuda as mod
                return mod, None
            except (OSError, ImportError):
                continue
        major = m.group(1)
        return None, (f"the CUDA module needs the CUDA {major} runtime (libcudart.so.{major}), "
                      "found neither beside the package nor in the toolkit: install jax with "
                      f"its CUDA plugin (pip install 'jax[cuda{major}]', which brings "
                      f"nvidia-cuda-runtime), or put the toolkit's lib64 on LD_LIBRARY_PATH")


_cuda, CUDA_IMPORT_ERROR = _import_cuda()
CUDA_BUILT = _cuda is not None

HOST_TARGETS = dict(_host.targets())
CUDA_TARGETS = dict(_cuda.targets()) if _cuda is not None else {}

for _name, _capsule in HOST_TARGETS.items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
for _name, _capsule in CUDA_TARGETS.items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def require_cuda() -> None:
    if _cuda is None:
        raise RuntimeError(
            "jax_nvcomm: the CUDA backend is not available in this build "
            f"({CUDA_IMPORT_ERROR}); install a wheel with the CUDA part, or build on a machine with "
            "the CUDA toolkit (nvcc on PATH), or use backend='host' with CPU devices, or "
            "strategy='xla'")


def module(backend: str):
    if backend == "cuda":
        require_cuda()
        return _cuda
    return _host
