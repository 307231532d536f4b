"""What the GPU tests (`pytest -m gpu`, tests/gpu/) need: the reason to skip them, the local
GPUs, and a launcher for multi-process GPU jobs (one process per GPU, or processes sharing
GPU 0) running the scripts of tests/mp/."""
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MP = os.path.join(TESTS, "mp")


def skip_reason():
    """None when the GPU tests can run here, else why not (the skip summary shows it)."""
    if os.environ.get("JAX_NVCOMM_TEST_GPU") != "1":
        return ("GPU test: needs JAX_NVCOMM_TEST_GPU=1 and a CUDA GPU "
                "(JAX_NVCOMM_TEST_GPU=1 python -m pytest -m gpu tests)")
    import jax
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        return f"GPU test: JAX sees no CUDA device ({e})"
    import jax_nvcomm
    if not jax_nvcomm.CUDA_BUILT:
        return "GPU test: jax_nvcomm was built without its CUDA part (no nvcc at build time)"
    return None if gpus else "GPU test: JAX sees no CUDA device"


_REASON = skip_reason()
# every GPU test module: `pytestmark = gpu_env.MARKS`
MARKS = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def num_gpus():
    import jax
    return len(jax.devices("gpu"))


def launch(n, script, *args, share_gpu=False, timeout=150, env_extra=None):
    """Run tests/mp/<script> under `python -m jax_nvcomm.launch -n n [--share-gpu]`, or as
    one process over every local GPU when n == 0. Returns (returncode, stdout + stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = MP + os.pathsep + env.get("PYTHONPATH", "")
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the pytest process holds GPU memory too
    env.setdefault("JAX_NVCOMM_TIMEOUT_S", "60")
    env.update(env_extra or {})
    if n == 0:
        cmd = [sys.executable, os.path.join(MP, script), *args]
    else:
        cmd = [sys.executable, "-m", "jax_nvcomm.launch", "-n", str(n), "--timeout",
               str(timeout - 10)] + (["--share-gpu"] if share_gpu else [])
        cmd += [os.path.join(MP, script), *args]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\n[timed out after {timeout} s: {' '.join(cmd)}]"
    return p.returncode, p.stdout + p.stderr


def setups():
    """The multi-process setups this machine offers: ("mp2", 2, False) one process per GPU when
    there are 2 or more GPUs, ("sh2", 2, True) two processes sharing GPU 0 always."""
    out = []
    if _REASON is None and num_gpus() >= 2:
        out.append(("mp2", 2, False))
    out.append(("sh2", 2, True))
    return out
