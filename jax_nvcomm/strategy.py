"""Strategy choice for all-reduce: a pure function of (shape, dtype, world size, communicator
limits), decided at trace time and therefore identical on every rank.

    bytes <= oneshot_max(world)          -> "oneshot"  (Lamport push, one round trip)
    bytes <= twoshot_max(world)          -> "twoshot"  (reduce-scatter + all-gather)
    otherwise                            -> "xla"      (lax.psum: NCCL / XLA's own kernels)

The table below holds the crossovers. `python -m jax_nvcomm.bench allreduce --tune` measures
them on the machine at hand and prints a table in this format. Overrides, strongest first:
keyword arguments of `select_strategy`, then the environment variables
JAX_NVCOMM_ONESHOT_MAX_BYTES / JAX_NVCOMM_TWOSHOT_MAX_BYTES, then the table.
"""
from __future__ import annotations

import os

import numpy as np

# world size -> (oneshot_max_bytes, twoshot_max_bytes).
# Provenance (README "Performance"):
#   2: measured on 2 x H200 (NVLink), bf16, 2026-11-29: one-shot beats lax.psum up to the
#      largest size measured for it (512 KiB: 11.4 us vs 18.2 us) and is capped by the Lamport
#      slot (1 MiB); two-shot is on par with psum at 512 KiB and 56 MiB and behind it at 112 MiB
#      (473 vs 413 us); the fused two-shot is behind psum + XLA's RMSNorm at 56 MiB (380 vs
#      318 us); the kernel harness measured two-shot 16 MiB at 72 us.
#   1: no communication at all: "auto" picks "xla" (lax.psum over one device is the identity and
#      XLA's fused add + RMSNorm ran 6x faster than our fused epilogue on one H200).
#   4, 8, 16: not measured here yet (needs a 4/8-GPU machine): published crossovers for
#      8 x H100/H200 (one-shot to ~128-256 KiB) until `bench allreduce --tune` replaces them.
THRESHOLDS: dict[int, tuple[int, int]] = {
    1: (0, 0),
    2: (1 << 20, 16 << 20),
    4: (256 << 10, 32 << 20),
    8: (128 << 10, 32 << 20),
    16: (64 << 10, 32 << 20),
}


def _table(world: int) -> tuple[int, int]:
    keys = sorted(THRESHOLDS)
    best = keys[0]
    for k in keys:
        if k <= world:
            best = k
    return THRESHOLDS[best]


def thresholds(world: int, *, oneshot_max_bytes: int | None = None,
               twoshot_max_bytes: int | None = None) -> tuple[int, int]:
    one, two = _table(world)
    env_one = os.environ.get("JAX_NVCOMM_ONESHOT_MAX_BYTES")
    env_two = os.environ.get("JAX_NVCOMM_TWOSHOT_MAX_BYTES")
    if env_one:
        one = int(env_one)
    if env_two:
        two = int(env_two)
    if oneshot_max_bytes is not None:
        one = int(oneshot_max_bytes)
    if twoshot_max_bytes is not None:
        two = int(twoshot_max_bytes)
    return one, two


def select_strategy(comm, shape, dtype, *, oneshot_max_bytes: int | None = None,
                    twoshot_max_bytes: int | None = None) -> str:
    """"oneshot" | "twoshot" | "xla" for an all-reduce of `shape`/`dtype` on `comm`."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    one, two = thresholds(comm.world_size, oneshot_max_bytes=oneshot_max_bytes,
                          twoshot_max_bytes=twoshot_max_bytes)
    if nbytes > comm.max_message_bytes or nbytes == 0:
        return "xla"
    if nbytes <= min(one, comm.lamport_slot_bytes):
        return "oneshot"
    if nbytes <= two:
        return "twoshot"
    return "xla"
