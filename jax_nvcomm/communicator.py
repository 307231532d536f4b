"""`Communicator`: the symmetric communication buffers of one mesh axis, set up collectively
outside jit and held until close(). Contract: docs/API.md of the repository and the
docstrings here."""
from __future__ import annotations

import dataclasses
import itertools
import os
import sys

import jax
import numpy as np
from jax._src import core as _core

from . import _exchange, _ffi, _multicast, _report, topology, tuning
from ._symmetric import SymmetricBuffers

_ids = itertools.count(1)
DEFAULT_TIMEOUT_S = float(os.environ.get("JAX_NVCOMM_TIMEOUT_S", "30"))
DEFAULT_SETUP_TIMEOUT_S = float(os.environ.get("JAX_NVCOMM_SETUP_TIMEOUT_S", "120"))


class CommunicatorError(RuntimeError):
    """A call on a communicator failed on a rank of this process: a peer that never arrived
    (dead, stalled past `timeout_s`, or calling another collective), ranks that disagree on the
    op or its sizes, bad data (an expert id, a row count, a slice) found on the device.

    Raised by `check()`. The message starts with the record of the rank that found the cause
    (the one whose input was bad, or that first gave up on a peer), then names the other ranks
    of this process that saw the failure ("seen by ranks ..."); each record names the op, the
    call number (`#n`: that rank's n-th call of this protocol), the rank and the peer.
    `records` holds every failed rank's record of this process, the root cause's first (the
    same list that an XLA runtime error of a failed call carries as `e.records`). The
    communicator is unusable
    afterwards: every later call is refused with the same text (an XLA runtime error at the
    call), and its results since the failure are unspecified. `close()` it (bounded, also
    after a dead peer) and create a new one.
    """

    def __init__(self, records: list[str], summary: str | None = None):
        self.records = list(records)
        super().__init__((summary or "\n".join(self.records)) + "\n(jax_nvcomm: the "
                         "communicator is unusable after this error: close() it and create a "
                         "new one)")


def _check_not_traced(what):
    if not _core.trace_state_clean():
        raise RuntimeError(f"jax_nvcomm: {what} must be created outside jax.jit / shard_map "
                           "(it allocates and exchanges buffers collectively)")


def _check_mesh_axis(mesh, axis_name, what):
    """axis_name as the communicator keeps it (a str, or a tuple of two or more str; a 1-tuple
    becomes its one axis), checked against the mesh."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"jax_nvcomm: {what}: mesh must be a jax.sharding.Mesh, got "
                        f"{type(mesh).__name__}")
    if isinstance(axis_name, list):
        axis_name = tuple(axis_name)
    if isinstance(axis_name, tuple):
        if not axis_name or not all(isinstance(a, str) for a in axis_name):
            raise TypeError(f"jax_nvcomm: {what}: axis_name must be a mesh axis name or a "
                            f"non-empty tuple of them, got {axis_name!r}")
        if len(set(axis_name)) != len(axis_name):
            raise ValueError(f"jax_nvcomm: {what}: axis_name {axis_name!r} names an axis twice")
        for a in axis_name:
            if a not in mesh.axis_names:
                raise ValueError(f"jax_nvcomm: {what}: axis {a!r} of axis_name {axis_name!r} is "
                                 f"not an axis of the mesh (axes: {tuple(mesh.axis_names)})")
        return axis_name[0] if len(axis_name) == 1 else axis_name
    if axis_name not in mesh.axis_names:
        raise ValueError(f"jax_nvcomm: {what}: axis_name {axis_name!r} is not an axis of the mesh "
                         f"(axes: {tuple(mesh.axis_names)})")
    return axis_name


def axis_size(mesh, axis_name) -> int:
    """Devices along axis_name (the product over a tuple of axes); 1 when mesh is not a Mesh
    or names none of them (the setup checks report that)."""
    if not isinstance(mesh, jax.sharding.Mesh):
        return 1
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    try:
        return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
    except (KeyError, TypeError):
        return 1


def resolve_backend(mesh, backend, what):
    if backend not in ("auto", "cuda", "host"):
        raise ValueError(f"jax_nvcomm: {what}: backend must be 'auto', 'cuda' or 'host', got "
                         f"{backend!r}")
    platforms = {d.platform for d in np.asarray(mesh.devices).flat}
    if len(platforms) != 1:
        raise ValueError(f"jax_nvcomm: {what}: mesh mixes platforms {sorted(platforms)}")
    platform = platforms.pop()
    natural = "host" if platform == "cpu" else "cuda" if platform in ("gpu", "cuda") else None
    if natural is None:
        raise ValueError(f"jax_nvcomm: {what}: unsupported device platform {platform!r}")
    if backend == "auto":
        backend = natural
    if backend != natural:
        raise ValueError(f"jax_nvcomm: {what}: backend={backend!r} does not match the mesh's "
                         f"{platform} devices (expected {natural!r})")
    if backend == "cuda":
        _ffi.require_cuda()
    return backend


class _NoBuffers:
    """The buffers of a communicator in XLA fallback mode: none."""
    slots: list = []
    mod = None

    def local_devices(self) -> list[int]:
        return []

    def close(self, sync=True, keep_own=False) -> None:
        pass


class _Base:
    """Shared lifecycle of the communicators: id, collective setup, close(), context manager."""

    _kind = "base"
    _multicast = False
    _multicast_reason = "not set up"
    _xla_fallback = False
    _transport_reason = "not set up"
    _final_errors: list = []  # the records close() found (errors() after close)
    _final_failures = None    # _report._failures() as close() found it (check() after close)
    _topology = ((), {})
    _tuning = None
    # CUDA: may XLA record this communicator's calls into its command buffers (CUDA graphs)?
    # None: JAX_NVCOMM_GRAPH_CAPTURE (default yes). Set True/False before tracing a program;
    # False keeps our calls out of the graphs (XLA cuts them there, as at NCCL collectives),
    # so the first graph of a step starts sooner: docs/perf/step_speed.md, variant D.
    graph_capture: bool | None = None

    def _setup(self, mesh, axis_name, backend, nbytes, max_message_bytes, timeout_s, config,
               lamport_range=(0, 0), zero_bytes=None, multicast_capable=False, tuned=False):
        what = type(self).__name__
        _check_not_traced(what)
        axis_name = _check_mesh_axis(mesh, axis_name, what)
        self._mesh = mesh
        self._axis_name = axis_name
        self._backend = resolve_backend(mesh, backend, what)
        self._world = axis_size(mesh, axis_name)
        self._timeout_s = float(DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        if not self._timeout_s > 0:
            raise ValueError(f"jax_nvcomm: {what}: timeout_s must be > 0, got {timeout_s!r}")
        from ._symmetric import groups_of
        if self._world > int(_ffi._host.layout(1 << 20, 1)["max_world"]):
            raise ValueError(f"jax_nvcomm: {what}: axis {axis_name!r} has {self._world} devices; "
                             f"at most {_ffi._host.layout(1 << 20, 1)['max_world']} supported")
        self._id = next(_ids)
        self._closed = True
        prefix = f"jax_nvcomm/{self._id}"
        # Transport (_multicast.py): the allocation mode and the environment's multicast verdict
        # are compared across processes with the arguments; device facts are exchanged after.
        alloc = _multicast.alloc_mode(os.environ)
        if multicast_capable:
            mc_req, mc_why = _multicast.requested(os.environ, self._backend, self._world)
        else:
            mc_req, mc_why = False, f"{what} does not use multicast"
        full = dict(config, kind=self._kind, axis_name=str(axis_name),
                    mesh_shape=[int(mesh.shape[a]) for a in mesh.axis_names],
                    mesh_axes=[str(a) for a in mesh.axis_names], backend=self._backend,
                    devices=[int(d.id) for d in np.asarray(mesh.devices).flat],
                    cuda_alloc=alloc if self._backend == "cuda" else None,
                    multicast_requested=mc_req, requested_backend=backend)
        _exchange.agree(prefix, full, DEFAULT_SETUP_TIMEOUT_S)
        if tuned:  # process 0's strategy table, in every process (tuning.py)
            platform = np.asarray(mesh.devices).flat[0].platform
            self._tuning = tuning.shared(prefix, DEFAULT_SETUP_TIMEOUT_S,
                                         jax.local_devices(backend=platform))
        self._groups = groups_of(mesh, axis_name)
        if self._setup_topology(prefix, backend, what):
            return  # XLA fallback: no buffers
        if mc_req:
            facts = _multicast.gather_facts(prefix, topology.DriverQueries, self._groups,
                                            DEFAULT_SETUP_TIMEOUT_S)
            mc_req, mc_why = _multicast.decide(os.environ, self._backend, self._world, facts)
        self._multicast, self._multicast_reason = mc_req, mc_why
        self._sym = SymmetricBuffers(self._id, mesh, axis_name, self._backend, nbytes,
                                     max_message_bytes, self._timeout_s,
                                     DEFAULT_SETUP_TIMEOUT_S, lamport_range, zero_bytes,
                                     alloc=alloc, multicast=mc_req)
        self._closed = False
        _report._open.add(self)
        _report.watch()

    def _setup_topology(self, prefix, requested, what) -> bool:
        """Gather every rank's host and device facts and decide the transport (topology/).
        True when the groups cannot use our buffers and the communicator falls back to XLA's
        collectives (backend="auto"); an explicit backend is refused instead."""
        facts, links = topology.gather(prefix, self._groups, self._backend,
                                       DEFAULT_SETUP_TIMEOUT_S)
        self._topology = (tuple(facts), dict(links))
        transport, why = topology.decide(self._backend, facts, links)
        self._transport_reason = why
        if transport == topology.SYMMETRIC:
            return False
        if requested != "auto":
            raise ValueError(f"jax_nvcomm: {what}: backend={requested!r} cannot serve axis "
                             f"{self._axis_name!r}: {why}; backend='auto' runs it with XLA's "
                             "collectives (lax.psum, lax.all_gather, ragged_all_to_all)")
        self._xla_fallback = True
        self._multicast_reason = "XLA fallback (no buffers)"
        self._sym = _NoBuffers()
        self._closed = False
        topology._say_once(f"jax_nvcomm: {what} over axis {self._axis_name!r} uses XLA's "
                           f"collectives for every op: {why}")
        return True

    # ---- properties (API.md) ----
    @property
    def world_size(self) -> int:
        return self._world

    @property
    def axis_name(self):
        return self._axis_name

    @property
    def mesh(self):
        return self._mesh

    @property
    def backend(self) -> str:
        return self._backend

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def comm_id(self) -> int:
        return self._id

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @property
    def multicast(self) -> bool:
        """True when this communicator's all-reduce uses the NVLink SHARP (multicast) kernels.

        Opt-in: only with JAX_NVCOMM_MULTICAST=1, NCCL_NVLS_ENABLE not 0, the CUDA backend, and
        every group on distinct physical GPUs that all report multicast support, on one host
        (jax_nvcomm/_multicast.py). Decided identically in every process; `multicast_reason`
        says why it is off. Otherwise the unicast kernels run (the default)."""
        return self._multicast

    @property
    def multicast_reason(self) -> str:
        """Why `multicast` is on or off (the first condition that failed)."""
        return self._multicast_reason

    @property
    def xla_fallback(self) -> bool:
        """True when this communicator holds no buffers and every op runs XLA's collectives
        (lax.psum, lax.all_gather, reference's ragged_all_to_all path): its groups span
        several hosts or GPUs without peer access (jax_nvcomm/topology/). Only with
        backend="auto"; decided alike in every process at setup."""
        return self._xla_fallback

    @property
    def transport_reason(self) -> str:
        """Why the communicator uses its own buffers or falls back to XLA (`xla_fallback`)."""
        return self._transport_reason

    @property
    def topology(self) -> dict:
        """The facts the transport was chosen from: per rank (group, rank, process, host and,
        on CUDA with cuda-python, the GPU's name / UUID / PCI bus id / SMs / multicast) and
        the link of every GPU pair one process sees ("nvlink", "pcie", "none")."""
        facts, links = self._topology
        return {"ranks": [dataclasses.asdict(f) for f in facts],
                "links": {f"{a}-{b}": v for (a, b), v in links.items()},
                "link_summary": topology.describe_links(facts, links)}

    def check_usable(self, what: str) -> None:
        """Raise if closed; print (once) a failure of an earlier call that nobody read."""
        if self._closed:
            raise RuntimeError(f"jax_nvcomm: {what}: the {type(self).__name__} was closed")
        _report.report(self._sym.mod, self._id, f"while tracing {what}")

    def errors(self) -> list[str]:
        """Error records of this process's ranks, one line each (empty if none): what `check()`
        raises. A record is readable as soon as the failing kernel wrote it (host-mapped
        memory), also while the call still runs. After `close()`: the records it had then.
        Records read here (or through `check()`) are not printed again at the next call, at
        close() or at exit."""
        if self._closed:
            return list(self._final_errors)
        out = self._records()
        if out:
            self._sym.mod.take_unreported(self._id)  # read by the caller: no report on stderr
        return out

    def _records(self) -> list[str]:
        out = []
        for slot in self._sym.slots:
            t = self._sym.mod.error_text(self._id, slot)
            if t:
                out.append(t)
        return out

    def check(self) -> None:
        """Raise `CommunicatorError` if a call on this communicator failed on any rank of this
        process (like NCCL's asynchronous error query); return None otherwise.

        Reads the ranks' error records from host memory: no device synchronisation, no
        collective, cheap enough for every step. A kernel never traps: a failed call ends
        normally with poisoned results (NaN where a one-shot all-reduce missed data, else
        unspecified) and leaves its record, so call `check()` after a result is ready
        (`block_until_ready`) to know that the result is good, in particular after programs
        that XLA may replay as a CUDA graph (no host code runs there, so no call raises).

        Raises:
          CommunicatorError: one line per failed rank of this process, naming the op, the
            call number, the rank and the peer (also after `close()`, for the records the
            communicator had when it was closed).
        """
        errs = self.errors()
        if not errs:
            return
        found = self._final_failures if self._closed else _report._failures(self._id)
        if found is None:
            raise CommunicatorError(errs)
        raise CommunicatorError([r for _, recs, *_ in found[0] for r in recs],
                                "\n".join(text for text, *_ in found[0]))

    def host_calls(self) -> dict[int, int]:
        """How many times the FFI handler ran per local slot (debug: CUDA-graph replays do not
        run the handler, so a count below the number of calls proves a replay)."""
        return {s: int(self._sym.mod.host_calls(self._id, s)) for s in self._sym.slots}

    def close(self) -> None:
        """Release the buffers (collective: every process of the job calls it).

        On GPUs it first waits for the local devices (every kernel ends within `timeout_s`:
        none traps or waits forever), then meets the other processes at a barrier so no buffer
        is freed while a peer may still write into it, then frees. After an error on this
        process (`errors()` not empty) the barrier waits at most `timeout_s` (a dead or
        failed peer does not come; its kernels ended within their own deadline) and close()
        returns without raising; the records stay readable (`errors()`, `check()`). When a
        peer did not come, GPU buffers of this process are left allocated until it exits (the
        peer may still map them, and freeing under its mapping is undefined for it).

        Raises:
          RuntimeError: without an error on this process, a process that does not reach
            close() within JAX_NVCOMM_SETUP_TIMEOUT_S (the communicator is closed anyway;
            GPU buffers as above).
        """
        if self._closed:
            return
        self._final_errors = self._records()
        self._final_failures = _report._failures(self._id) if self._final_errors else None
        self._closed = True
        for hook in getattr(self, "_close_hooks", ()):
            hook()  # e.g. nvc.jit's pool: programs holding this communicator trace again
        if self._backend == "cuda":
            for dev in self._sym.local_devices():
                try:
                    self._sym.mod.synchronize(dev)
                except RuntimeError:
                    pass
        _report.report(self._sym.mod, self._id, "at close()")  # before the records go
        failed = bool(self._final_errors)
        met = False
        try:
            _exchange.barrier(f"jax_nvcomm/{self._id}/close",
                              min(self._timeout_s, DEFAULT_SETUP_TIMEOUT_S) if failed
                              else DEFAULT_SETUP_TIMEOUT_S, f"{type(self).__name__}.close()")
            met = True
        except RuntimeError as e:
            if not failed:
                raise
            print(f"jax_nvcomm: {type(self).__name__}.close() after an error: {e}; "
                  + ("this process's buffers stay allocated until it exits (a peer may still "
                     "map them)" if self._backend == "cuda" else "buffers released"),
                  file=sys.stderr, flush=True)
        finally:
            self._sym.close(sync=False, keep_own=not met)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        # Best effort for single-process jobs; multi-process jobs must close() collectively.
        try:
            if not self._closed and jax.process_count() == 1:
                self.close()
        except Exception:
            pass


class Communicator(_Base):
    """Symmetric buffers for all_reduce / all_reduce_rms_norm / all_gather over `axis_name` (one
    mesh axis or a tuple of them).

    Per-rank memory (`nbytes`): 64 KiB control block + 2 halves of
    (W * align256(ceil(M / W)) + align256(M)) + 3 * W * L Lamport slots, with M =
    max_message_bytes and L = min(M, 4M / (3W), 1 MiB) rounded down to 256 B; at most
    8 * M + 64 KiB. (VMM allocations, JAX_NVCOMM_ALLOC=vmm or multicast, round it up to the
    allocation / multicast granularity that the driver reports.)

    Transport: unicast stores over NVLink by default; the NVLink SHARP (multicast) kernels only
    when `multicast` is True (opt-in, see that property and docs/DESIGN.md "Multicast").
    Groups whose ranks span several hosts (or GPUs without peer access) get no buffers: with
    backend="auto" every op runs XLA's collectives (`xla_fallback`), an explicit backend is
    refused.

    Create it outside jit, collectively: every process of the job, same arguments, same order.

    Args:
      mesh: a `jax.sharding.Mesh`.
      axis_name: the mesh axis to reduce / gather over, or a tuple of mesh axes (the group is
        their product, as for `lax.psum(x, ("X", "Y"))`; a rank's number is
        `lax.axis_index(axis_name)`, the first axis major); the other axes give one
        independent group per coordinate.
      max_message_bytes: largest message (bytes per rank) through the buffers, >= 4096; larger
        ones use XLA's collective.
      backend: "auto" (CUDA on GPU devices, host memory on CPU devices), "cuda" or "host".
      timeout_s: bound on every wait for a peer, > 0 (default JAX_NVCOMM_TIMEOUT_S or 30 s).
      ragged_chunk_bytes: slot size (bytes per sender and receiver, two slots a pair) of
        `ragged_all_to_all`'s chunked path, which serves calls whose output exceeds the landing
        frame: None (default) the largest the buffers hold (about max_message_bytes / W),
        else rounded down to a multiple of 256 and capped at that. Changes no memory: the
        buffers are `nbytes` whatever the calls (smaller slots, more rounds).

    Raises:
      TypeError / ValueError: an argument outside the above (named, with expected and actual
        value), processes passing different arguments, an explicit backend that cannot serve
        the groups (naming the hosts).
      RuntimeError: created inside a trace; a process that never arrives (after
        JAX_NVCOMM_SETUP_TIMEOUT_S).
    """

    _kind = "communicator"

    def __init__(self, mesh, axis_name, *, max_message_bytes: int = 32 << 20,
                 backend: str = "auto", timeout_s: float | None = None,
                 ragged_chunk_bytes: int | None = None):
        if ragged_chunk_bytes is not None and (
                isinstance(ragged_chunk_bytes, bool) or
                not isinstance(ragged_chunk_bytes, (int, np.integer)) or ragged_chunk_bytes < 256):
            raise ValueError("jax_nvcomm: Communicator: ragged_chunk_bytes must be None or an "
                             f"int >= 256, got {ragged_chunk_bytes!r}")
        self._ragged_chunk_bytes = None if ragged_chunk_bytes is None else int(ragged_chunk_bytes)
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes,
                                                                   (int, np.integer)):
            raise TypeError("jax_nvcomm: Communicator: max_message_bytes must be an int, got "
                            f"{type(max_message_bytes).__name__}")
        if max_message_bytes < 4096:
            raise ValueError("jax_nvcomm: Communicator: max_message_bytes must be >= 4096, got "
                             f"{max_message_bytes}")
        self._closed = True
        self._max_message_bytes = int(max_message_bytes)
        world = axis_size(mesh, axis_name)
        lay = _ffi._host.layout(self._max_message_bytes, max(world, 1))
        self._layout = dict(lay)
        self._setup(mesh, axis_name, backend, lay["total"], self._max_message_bytes, timeout_s,
                    dict(max_message_bytes=self._max_message_bytes,
                         ragged_chunk_bytes=self._ragged_chunk_bytes),
                    lamport_range=(lay["lamport_offset"], lay["total"] - lay["lamport_offset"]),
                    zero_bytes=lay["ctrl_bytes"], multicast_capable=True, tuned=True)

    @property
    def max_message_bytes(self) -> int:
        return self._max_message_bytes

    @property
    def ragged_chunk_bytes(self) -> int | None:
        """The slot size asked for `ragged_all_to_all`'s chunked path (None: the largest)."""
        return self._ragged_chunk_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of communication buffer held per rank (per device)."""
        return int(self._layout["total"])

    @property
    def tuning(self) -> tuning.Table:
        """The all-reduce strategy table of this communicator (`select_strategy`), fixed at
        setup by process 0 and the same in every process: from JAX_NVCOMM_TUNING, this
        machine's tuning cache, or the built-in table, with the environment's threshold
        overrides (docs/tuning.md). `tuning.describe()` names the source."""
        return self._tuning

    @property
    def lamport_slot_bytes(self) -> int:
        """Largest message the one-shot (Lamport) path can carry."""
        return int(self._layout["lamport_slot"])

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return (f"Communicator(axis={self._axis_name!r}, world_size={self._world}, "
                f"backend={self._backend!r}, max_message_bytes={self._max_message_bytes}, "
                f"{state})")
