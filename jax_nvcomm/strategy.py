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
# Provenance (docs/perf/README.md; docs/perf/bench_h200x2_allreduce.txt):
#   2: 2 x H200 (NVLink), bf16, one process, 2026-11-29, from the sweep of
#      `bench allreduce --hidden 4096` (docs/perf/bench_h200x2_allreduce.json; tests/test_bench.py
#      recomputes it with `crossovers`, the rule `--tune` applies): one-shot beats lax.psum up
#      to its Lamport slot (1 MiB: 12.5 vs 19.2 us); the plain two-shot beats psum up to 32 MiB,
#      but the fused two-shot loses to psum + XLA's RMSNorm from 16 MiB (112.0 vs 111.3 us), and
#      the table serves both ops: two-shot up to 8 MiB.
#   1: no communication: "auto" picks "xla". Our world-1 kernel (allreduce_local.cuh) runs the
#      fused epilogue at 1.9-2.2 TB/s on one H200, XLA's add + RMSNorm at 2.3-2.6 TB/s.
#   4, 8, 16: not measured (4/8-GPU machines were not lent): published crossovers for
#      8 x H100/H200 (one-shot to ~128-256 KiB) until `bench allreduce --tune` replaces them.
THRESHOLDS: dict[int, tuple[int, int]] = {
    1: (0, 0),
    2: (1 << 20, 8 << 20),
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
    """The strategy "auto" picks for an all-reduce of `shape`/`dtype` on `comm`.

    A pure function of the static shape, dtype and world size: one-shot up to the first
    threshold (and `comm.lamport_slot_bytes`), two-shot up to the second, "xla" above it, for
    empty messages and above `comm.max_message_bytes`.

    Args:
      comm: a `Communicator`.
      shape: the per-rank shape of x.
      dtype: x's dtype.
      oneshot_max_bytes, twoshot_max_bytes: override the thresholds (default: the world size's
        table, or JAX_NVCOMM_ONESHOT_MAX_BYTES / JAX_NVCOMM_TWOSHOT_MAX_BYTES).

    Returns:
      "oneshot", "twoshot" or "xla".
    """
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
