"""Joining a job started by ``python -m jax_nvcomm.launch``.

``distributed_initialize()`` reads ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (set by the launcher) and calls
``jax.distributed.initialize`` with them; outside the launcher it does nothing.
jax is imported lazily, so importing this module is cheap.
"""

from __future__ import annotations

import os
import threading

__all__ = ["distributed_initialize", "is_launched", "kv_client"]

_ENV_KEYS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_lock = threading.Lock()


def is_launched() -> bool:
    """True when this process was started as one rank of a multi-process job."""
    return all(os.environ.get(k) for k in _ENV_KEYS)


def _cpu_only() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", os.environ.get("JAX_PLATFORM_NAME", ""))
    return platforms.strip().lower() == "cpu"


def _single_visible_gpu() -> bool:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return False
    entries = [e for e in visible.split(",") if e.strip()]
    return len(entries) == 1


def distributed_initialize(*, initialization_timeout: int | None = None,
                           heartbeat_timeout_seconds: int | None = None,
                           shutdown_timeout_seconds: int | None = None) -> bool:
    """Join the launcher's ``jax.distributed`` job; return True if this call initialised it.

    Does nothing (returns False) outside the launcher, or when
    ``jax.distributed`` is already initialised (a second call is a no-op).
    Must run before anything touches JAX devices (``jax.devices()``, a
    computation, ...), as ``jax.distributed.initialize`` requires.

    * CPU ranks (``JAX_PLATFORMS=cpu``): selects the gloo CPU collectives so
      cross-process ``lax.psum`` etc. work.
    * GPU ranks with exactly one visible GPU (the launcher's ``--share-gpu`` or
      one-GPU-per-rank modes): ``local_device_ids=[0]`` so each process owns
      exactly that one device.
    """
    if not is_launched():
        return False
    with _lock:
        import jax
        from jax._src import distributed as _jd

        if _jd.global_state.client is not None:
            return False

        address = os.environ["JAX_COORDINATOR_ADDRESS"]
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
        process_id = int(os.environ["JAX_PROCESS_ID"])

        kwargs: dict = {}
        if "JAX_ENABLE_PREEMPTION_SERVICE" not in os.environ:
            # The preemption service installs a SIGTERM handler that only
            # records the signal, so the launcher's SIGTERM would not end a
            # rank (it would wait for SIGKILL).  It serves cloud preemption,
            # which does not apply to a local job.
            jax.config.update("jax_enable_preemption_service", False)
        if _cpu_only():
            # Default in jax 0.11.2 is already "gloo"; set it explicitly so a
            # user/env default of None (no cross-process CPU collectives)
            # cannot break lax.psum across processes.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        elif _single_visible_gpu():
            kwargs["local_device_ids"] = [0]
        bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS")
        if bind:
            kwargs["coordinator_bind_address"] = bind
        if initialization_timeout is not None:
            kwargs["initialization_timeout"] = int(initialization_timeout)
        if heartbeat_timeout_seconds is not None:
            kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout_seconds)
        if shutdown_timeout_seconds is not None:
            kwargs["shutdown_timeout_seconds"] = int(shutdown_timeout_seconds)

        try:
            jax.distributed.initialize(coordinator_address=address,
                                       num_processes=num_processes,
                                       process_id=process_id, **kwargs)
        except RuntimeError as e:
            if "before any JAX calls" in str(e):
                raise RuntimeError(
                    "distributed_initialize() must be called before anything touches "
                    "JAX devices (jax.devices(), a computation, device_put, ...): "
                    + str(e)) from e
            raise
        return True


def kv_client():
    """The distributed runtime client (key-value store, barriers), or None.

    None unless ``jax.distributed`` is initialised.  Methods include
    ``key_value_set(key, value)``, ``key_value_set_bytes``,
    ``blocking_key_value_get(key, timeout_ms)``,
    ``blocking_key_value_get_bytes`` and ``wait_at_barrier(name, timeout_ms)``.
    """
    try:
        from jax._src import distributed as _jd
    except ImportError:
        return None
    return _jd.global_state.client
