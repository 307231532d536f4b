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


def _installed_copy() -> str | None:
    """The folder of an installed jax_nvcomm with compiled modules that this source folder
    shadows (it comes first on sys.path), or None."""
    root = os.path.dirname(_HERE)
    others = [p for p in sys.path if p and os.path.abspath(p) != root]
    spec = importlib.machinery.PathFinder.find_spec("jax_nvcomm", others)
    installed = os.path.dirname(spec.origin) if spec is not None and spec.origin else None
    if installed and glob.glob(os.path.join(installed, "_host*.so")):
        return installed
    return None


def _same_sources(installed: str) -> bool:
    """Whether every Python file of the installed copy equals this folder's (the wheel was built
    from this checkout as it is): then the install's compiled modules fit these sources."""
    def files(d):
        return sorted(os.path.relpath(p, d) for p in glob.glob(os.path.join(d, "**", "*.py"),
                                                                recursive=True))
    names = files(installed)
    if not names or names != files(_HERE):
        return False
    for n in names:
        with open(os.path.join(installed, n), "rb") as a, open(os.path.join(_HERE, n), "rb") as b:
            if a.read() != b.read():
                return False
    return True


def _missing_extension_message() -> str:
    """Why `_host` did not import, and what to do: a checkout's source folder (no compiled
    modules) that shadows an install of other sources, or no install at all."""
    installed = _installed_copy()
    if installed:
        return (f"jax_nvcomm: Python imported the source folder {_HERE} (it comes first on "
                f"sys.path: the current directory or the script's), which holds no compiled "
                f"modules, instead of the install in {installed}, whose sources differ. Run "
                "from another folder, or install the checkout editable (bash "
                "scripts/dev.sh install, or pip install -e . in the checkout's root)")
    return (f"jax_nvcomm: the compiled extension _host is missing from {_HERE}: the package is "
            "not installed. Install the wheel, or build from the checkout's root: "
            "pip install -e .  (or bash scripts/dev.sh install)")


try:
    from . import _host
except ImportError as _e:
    # A checkout's root as the current folder, the wheel built from it installed: the package
    # is the same, so it is served from the install (its compiled modules beside its sources).
    _inst = _installed_copy()
    if _inst is None or not _same_sources(_inst):
        raise ImportError(_missing_extension_message()) from _e
    sys.modules[__package__].__path__[:] = [_inst]
    from . import _host


def _wheel_runtimes(major: str, roots) -> list[str]:
    """libcudart.so.<major> of the nvidia-cuda-runtime wheel (the one jax's CUDA plugin loads)
    under each of `roots` (site-packages folders)."""
    out = [os.path.join(r or ".", sub, f"libcudart.so.{major}") for r in roots
           for sub in (f"nvidia/cu{major}/lib", "nvidia/cuda_runtime/lib")]
    return [c for c in dict.fromkeys(out) if os.path.isfile(c)]


def _toolkit_runtimes(major: str) -> list[str]:
    out = [os.path.join(h, "lib64", f"libcudart.so.{major}")
           for h in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")
           if h]
    return [c for c in dict.fromkeys(out) if os.path.isfile(c)]


def _import_cuda():
    """(the _cuda module or None, why not). The module needs the shared CUDA runtime
    (libcudart.so.12 or .13, whichever nvcc built it against), not a GPU or a driver. Its RPATH
    finds the nvidia-cuda-runtime wheel installed beside the package; where that wheel lies in
    another site-packages (a venv made with --system-site-packages) it is loaded from there
    first, so the process holds the runtime jax's plugin uses; the CUDA toolkit's comes last."""
    import ctypes
    import importlib.util
    spec = importlib.util.find_spec(f"{__package__}._cuda")
    if spec is None or not spec.origin:
        return None, "built without the CUDA part (no nvcc, or JAX_NVCOMM_CUDA=OFF)"
    with open(spec.origin, "rb") as f:
        m = re.search(rb"libcudart\.so\.(\d+)", f.read())
    major = m.group(1).decode() if m else None
    if major and not _wheel_runtimes(major, [os.path.dirname(os.path.dirname(spec.origin))]):
        for cand in _wheel_runtimes(major, sys.path)[:1]:
            try:
                ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass
    try:
        from . import _cuda as mod
        return mod, None
    except ImportError as e:
        if major is None or f"libcudart.so.{major}" not in str(e):
            return None, f"the CUDA module did not load: {e}"
    for cand in _toolkit_runtimes(major):
        try:
            ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
            from . import _cuda as mod
            return mod, None
        except (OSError, ImportError):
            continue
    return None, (f"the CUDA module needs the CUDA {major} runtime (libcudart.so.{major}), found "
                  "neither beside the package nor in the toolkit: install jax with its CUDA "
                  f"plugin (pip install 'jax[cuda{major}]', which brings nvidia-cuda-runtime), "
                  "or put the toolkit's lib64 on LD_LIBRARY_PATH")


_cuda, CUDA_IMPORT_ERROR = _import_cuda()
CUDA_BUILT = _cuda is not None

HOST_TARGETS = dict(_host.targets())
CUDA_TARGETS = dict(_cuda.targets()) if _cuda is not None else {}

for _name, _capsule in HOST_TARGETS.items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
for _name, _capsule in CUDA_TARGETS.items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def cuda_available() -> bool:
    """Whether the CUDA backend is usable here: the CUDA module is loaded (`CUDA_BUILT`: it was
    compiled in and its runtime found) and jax sees a CUDA device (its CUDA plugin installed, a
    GPU present, JAX_PLATFORMS not restricted to cpu)."""
    if _cuda is None:
        return False
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:  # no CUDA backend in this jax (plugin missing, no GPU, JAX_PLATFORMS)
        return False


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
