"""Strategy choice for all-reduce: a pure function of (shape, dtype, op, world size, the
communicator's limits and tuning table), decided at trace time and therefore identical on every
rank. No file is read here: the table was fixed at communicator setup (jax_nvcomm/tuning.py).

  world size >= 2:
    bytes <= oneshot_max_bytes (and the Lamport slot) -> "oneshot"  (Lamport push, one round)
    bytes <= twoshot_max_bytes                        -> "twoshot"  (reduce-scatter + gather)
    otherwise                                         -> "xla"      (lax.psum: NCCL / XLA)
  world size 1 (no communication; both names run the local kernel):
    bytes >= local_min_bytes (not None)               -> "twoshot"
    otherwise                                         -> "xla"      (XLA's own ops)
  empty messages and messages above comm.max_message_bytes -> "xla".

Each threshold comes from, strongest first: a keyword argument of `select_strategy`, the
environment at setup (JAX_NVCOMM_ONESHOT_MAX_BYTES, JAX_NVCOMM_TWOSHOT_MAX_BYTES,
JAX_NVCOMM_LOCAL_MIN_BYTES), the communicator's tuning table (file, cache or built-in; a row the
file lacks comes from the built-in table). `explain=True` says which one decided.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from . import tuning

FIELDS = ("oneshot_max_bytes", "twoshot_max_bytes", "local_min_bytes")


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `select_strategy(..., explain=True)` returns: the strategy and why.

    Attributes:
      strategy: "oneshot", "twoshot" or "xla".
      nbytes: the message's bytes per rank.
      thresholds: {field: bytes or None} as applied (FIELDS).
      sources: {field: where it came from}: "keyword", "env VAR", or the table's row
        ("tuning file PATH (JAX_NVCOMM_TUNING)", "tuning cache PATH (...)", "built-in table").
      source: the source of the decisive threshold, or "limit" (empty message, above
        max_message_bytes).
      reason: one sentence.
    """
    strategy: str
    nbytes: int
    thresholds: dict
    sources: dict
    source: str
    reason: str

    def __str__(self):
        return f"{self.strategy}: {self.reason}"


@functools.cache
def _builtin_table() -> tuning.Table:
    """The built-in table, for communicators without a table of their own (read once)."""
    return tuning.Table("built-in", builtin=tuning.builtin_rows())


def _table(comm) -> tuning.Table:
    t = getattr(comm, "tuning", None)
    return t if t is not None else _builtin_table()


def _thresholds(comm, op, dtype_name, keywords, explain):
    """({field: value}, {field: source}) for the communicator's world, op and dtype; the
    sources only with `explain` (else None)."""
    table = _table(comm)
    world = int(comm.world_size)
    row, where = table.lookup(world, op, dtype_name)
    vals = {f: getattr(row, f) if row is not None else (None if f == "local_min_bytes" else 0)
            for f in FIELDS}
    srcs = None
    if explain:
        srcs = {f: (f"{where}, row {row.label()}" if row is not None
                    else f"{where}: no row (defaults)") for f in FIELDS}
    for f, v in table.overrides:
        vals[f] = v
        if explain:
            srcs[f] = f"env {tuning.ENV_OVERRIDES[f]} (at setup)"
    for f, v in keywords.items():
        if v is not None:
            vals[f] = int(v)
            if explain:
                srcs[f] = "keyword"
    return vals, srcs


def select_strategy(comm, shape, dtype, *, op: str = "all_reduce",
                    oneshot_max_bytes: int | None = None,
                    twoshot_max_bytes: int | None = None,
                    local_min_bytes: int | None = None, explain: bool = False):
    """The strategy "auto" picks for `op` on a message of `shape`/`dtype` on `comm`.

    A pure function of the static shape, dtype, op, world size and the communicator's limits
    and tuning table (fixed at setup: docs/tuning.md). World size >= 2: one-shot up to
    oneshot_max_bytes (and `comm.lamport_slot_bytes`), two-shot up to twoshot_max_bytes,
    "xla" above. World size 1: our (local) kernel from local_min_bytes on, "xla" below or
    when the table has none. Empty messages and those above `comm.max_message_bytes`: "xla".

    Args:
      comm: a `Communicator`.
      shape: the per-rank shape of x.
      dtype: x's dtype.
      op: "all_reduce", "all_reduce_rms_norm" or "all_reduce_rms_norm_quant": the table has a
        row per op (the fused ops' XLA baseline is psum + XLA's add + RMSNorm).
      oneshot_max_bytes, twoshot_max_bytes, local_min_bytes: override the thresholds (default:
        the environment's at setup, JAX_NVCOMM_ONESHOT_MAX_BYTES / _TWOSHOT_MAX_BYTES /
        _LOCAL_MIN_BYTES, else the table's row).
      explain: return a `Choice` (strategy, thresholds, where each came from, the reason)
        instead of the strategy name.

    Returns:
      "oneshot", "twoshot" or "xla"; with explain=True a `Choice`.

    Raises:
      ValueError: an op outside the three above.
    """
    if op not in tuning.OPS:
        raise ValueError(f"jax_nvcomm: select_strategy: op must be one of "
                         f"{', '.join(tuning.OPS)}, got {op!r}")
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    vals, srcs = _thresholds(comm, op, dt.name, dict(
        oneshot_max_bytes=oneshot_max_bytes, twoshot_max_bytes=twoshot_max_bytes,
        local_min_bytes=local_min_bytes), explain)
    one, two, local = (vals[f] for f in FIELDS)
    # why: a template, filled in only for explain=True
    if nbytes == 0:
        strat, field, why = "xla", None, "an empty message"
    elif nbytes > comm.max_message_bytes:
        strat, field, why = "xla", None, "{size} > max_message_bytes {limit}"
    elif comm.world_size == 1:
        field = "local_min_bytes"
        if local is not None and nbytes >= local:
            strat, why = "twoshot", "world 1: {size} >= local_min_bytes {local} (our kernel)"
        else:
            strat = "xla"
            why = ("world 1: no local_min_bytes (XLA's ops)" if local is None else
                   "world 1: {size} < local_min_bytes {local} (XLA's ops)")
    elif nbytes <= min(one, comm.lamport_slot_bytes):
        strat, field, why = "oneshot", "oneshot_max_bytes", "{size} <= oneshot_max_bytes {one}"
    elif nbytes <= two:
        field = "twoshot_max_bytes"
        strat, why = "twoshot", "{size} <= twoshot_max_bytes {two}" + (
            " (above lamport_slot_bytes {slot})" if nbytes <= one else
            ", > oneshot_max_bytes {one}")
    else:
        strat, field, why = "xla", "twoshot_max_bytes", "{size} > twoshot_max_bytes {two}"
    if not explain:
        return strat
    why = why.format(size=f"{nbytes} B", limit=comm.max_message_bytes, local=local, one=one,
                     two=two, slot=comm.lamport_slot_bytes)
    source = srcs[field] if field else "limit"
    return Choice(strat, nbytes, vals, srcs, source, f"{op} {tuple(shape)} {dt.name}: {why}; "
                  f"from {source}")
