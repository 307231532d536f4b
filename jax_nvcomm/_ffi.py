"""Loads the extension modules and registers every XLA FFI target once, at import.

`_host` (CPU devices) always exists; `_cuda` exists when the package was built with nvcc.
Targets are plain (stateless) handlers, so registering them before any backend starts is safe.
"""
from __future__ import annotations

import jax

try:
    from . import _host
except ImportError as _e:  # a source checkout without the compiled modules shadows the install
    import os as _os
    raise ImportError(
        f"jax_nvcomm: the compiled extension is missing from {_os.path.dirname(__file__)}: "
        "this is the source folder of a checkout (or a broken install). Install the package "
        "(bash scripts/dev.sh install, or pip install .) and run Python from outside the "
        "checkout's root, where the source folder would shadow the installed package") from _e

try:
    from . import _cuda  # noqa: F401
    CUDA_BUILT = True
    CUDA_IMPORT_ERROR = None
except ImportError as e:  # built without nvcc, or CUDA runtime unusable
    _cuda = None
    CUDA_BUILT = False
    CUDA_IMPORT_ERROR = str(e)

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
            f"({CUDA_IMPORT_ERROR or 'built without nvcc'}); reinstall on a machine with the CUDA "
            "toolkit (nvcc on PATH), or use backend='host' with CPU devices, or strategy='xla'")


def module(backend: str):
    if backend == "cuda":
        require_cuda()
        return _cuda
    return _host
