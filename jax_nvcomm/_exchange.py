"""Collective setup helpers over the jax.distributed key-value store (multi-process jobs).

Every wait is bounded: a process that never arrives (crashed, or did not create the same
communicator) becomes a RuntimeError after `timeout_s`, never a hang. Single-process jobs need
no exchange and every function degrades to a local no-op.
"""
from __future__ import annotations

import hashlib
import json

import jax


def client():
    """The distributed runtime client, or None when the job has one process."""
    if jax.process_count() == 1:
        return None
    from jax._src import distributed
    c = distributed.global_state.client
    if c is None:
        raise RuntimeError("jax_nvcomm: several processes but no jax.distributed client; "
                           "call jax_nvcomm.distributed_initialize() first")
    return c


def _ms(timeout_s: float) -> int:
    return max(1, int(timeout_s * 1000))


def put(key: str, value: bytes) -> None:
    c = client()
    if c is not None:
        c.key_value_set_bytes(key, value)


def get(key: str, timeout_s: float, what: str) -> bytes:
    c = client()
    try:
        return c.blocking_key_value_get_bytes(key, _ms(timeout_s))
    except Exception as e:  # the runtime raises its own error type on deadline
        raise RuntimeError(f"jax_nvcomm: timed out after {timeout_s:.0f} s waiting for {what} "
                           f"(key {key!r}); did every process create the same communicator?"
                           ) from e


def barrier(name: str, timeout_s: float, what: str) -> None:
    c = client()
    if c is None:
        return
    try:
        c.wait_at_barrier(name, _ms(timeout_s))
    except Exception as e:
        raise RuntimeError(f"jax_nvcomm: timed out after {timeout_s:.0f} s at {what}; "
                           "a process is missing or failed") from e


def gather(key: str, value: bytes, timeout_s: float, what: str) -> list[bytes]:
    """Every process's `value`, in process order: each process puts its own under
    `key/<process index>` and reads every other's, each read bounded by `timeout_s` (a
    RuntimeError naming the process and `what` when one never comes). One process: [value]."""
    if client() is None:
        return [value]
    me = jax.process_index()
    put(f"{key}/{me}", value)
    return [value if p == me else get(f"{key}/{p}", timeout_s, f"process {p}'s {what}")
            for p in range(jax.process_count())]


def agree(prefix: str, config: dict, timeout_s: float) -> None:
    """Check that every process passed the same configuration (ValueError naming the first
    difference), bounded by `timeout_s`."""
    text = json.dumps(config, sort_keys=True).encode()
    me = jax.process_index()
    for p, other in enumerate(gather(f"{prefix}/cfg", text, timeout_s,
                                     "communicator arguments")):
        if other != text:
            mine = json.loads(text)
            theirs = json.loads(other)
            diff = [k for k in mine if mine.get(k) != theirs.get(k)]
            k = diff[0] if diff else "?"
            raise ValueError(
                f"jax_nvcomm: processes disagree on the communicator arguments: {k}="
                f"{mine.get(k)!r} in process {me} but {theirs.get(k)!r} in process {p}")


_FAILED = "\0failed\0"


def from_process0(key: str, make, timeout_s: float, what: str) -> str:
    """Process 0's `make()` (a str) in every process: process 0 computes and publishes it, the
    others read it (bounded by `timeout_s`) and never call `make`. An exception in process 0's
    `make` is published too and raised in every process as a RuntimeError naming it (and the
    original in process 0)."""
    c = client()
    if c is None:
        return make()
    if jax.process_index() == 0:
        try:
            value = make()
        except Exception as e:
            put(key, (_FAILED + f"{type(e).__name__}: {e}").encode())
            raise
        put(key, value.encode())
        return value
    value = get(key, timeout_s, what).decode()
    if value.startswith(_FAILED):
        raise RuntimeError(f"jax_nvcomm: process 0 failed to make {what}: "
                           f"{value[len(_FAILED):]}")
    return value


def digest(*parts) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:12]
