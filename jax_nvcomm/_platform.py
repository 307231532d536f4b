"""The platform a program runs on, and a note when the machine's NVIDIA GPUs go unused
(jax without its CUDA plugin, or JAX_PLATFORMS=cpu): printed by the example and the bench."""
from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence

FIX = ("install jax's CUDA plugin: pip install 'jax[cuda13]' (driver CUDA >= 13, see "
       "`nvidia-smi`; else 'jax[cuda12]'), or `bash scripts/dev.sh install`, whose list "
       "`bash scripts/dev.sh deps` prints")


def nvidia_gpus() -> list[str]:
    """The GPU lines of `nvidia-smi -L` (empty without nvidia-smi or a GPU)."""
    try:
        p = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if p.returncode != 0:
        return []
    return [ln.strip() for ln in p.stdout.splitlines() if ln.startswith("GPU ")]


def platform_lines(devices: Sequence, env: Mapping[str, str] | None = None,
                   gpus: Sequence[str] | None = None) -> list[str]:
    """'platform: ...' and, when GPUs are present but jax sees only CPU devices, a note saying
    so and how to fix it."""
    env = os.environ if env is None else env
    d0 = devices[0]
    lines = [f"platform: {d0.platform} ({len(devices)} x {d0.device_kind})"]
    if d0.platform != "cpu":
        return lines
    gpus = nvidia_gpus() if gpus is None else list(gpus)
    if not gpus:
        return lines
    chosen = env.get("JAX_PLATFORMS", env.get("JAX_PLATFORM_NAME", "")).strip().lower()
    if chosen == "cpu":
        why = "JAX_PLATFORMS=cpu is set"
        fix = "unset JAX_PLATFORMS to use them"
    else:
        why = "jax has no CUDA plugin (or it failed to load)"
        fix = FIX
    lines.append(f"note: this machine has {len(gpus)} NVIDIA GPU(s) (nvidia-smi -L) but jax runs "
                 f"on CPU devices: {why}; {fix}")
    return lines
