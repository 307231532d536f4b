"""Symmetric buffers: one buffer per rank of every group along a mesh axis, mapped into every
peer of the group, allocated once and held until close().

Groups: the mesh's devices with `axis_name` moved last and the other axes flattened in mesh
order: row g is group g, column r is rank r. The traced program computes the same (g, r) from
`lax.axis_index`, so a host-backend handler finds its context by slot = g * world + r; a CUDA
handler finds it by device ordinal.

Transports: CUDA devices of this process: the pointer itself (+ peer access between devices);
CUDA devices of other processes: CUDA IPC handles through the key-value store; CPU devices:
POSIX shared memory named after a job-wide token.
"""
from __future__ import annotations

import secrets

import jax
import numpy as np

from . import _exchange, _ffi


def groups_of(mesh, axis_name) -> np.ndarray:
    """[num_groups, world] array of devices."""
    axis = mesh.axis_names.index(axis_name)
    devs = np.moveaxis(np.asarray(mesh.devices), axis, -1)
    return devs.reshape(-1, devs.shape[-1])


class SymmetricBuffers:
    """Allocates `nbytes` per rank on every local device of the mesh, maps the peers and
    registers one rank context per local rank in the backend's registry under `comm_id`."""

    def __init__(self, comm_id: int, mesh, axis_name, backend: str, nbytes: int,
                 max_message_bytes: int, timeout_s: float, setup_timeout_s: float,
                 lamport_range: tuple[int, int] = (0, 0), zero_bytes: int | None = None):
        self.comm_id = comm_id
        self.backend = backend
        self.nbytes = int(nbytes)
        self.mod = _ffi.module(backend)
        self.groups = groups_of(mesh, axis_name)
        self.world = self.groups.shape[1]
        me = jax.process_index()
        self.local = [(g, r) for g in range(self.groups.shape[0]) for r in range(self.world)
                      if self.groups[g, r].process_index == me]
        self._owned = []     # (kind, handle...) to free on close
        self._imported = []  # CUDA IPC mappings to close
        self._shm = []       # (addr, nbytes) host mappings to unmap
        self.slots = []      # registry slots of this process
        prefix = f"jax_nvcomm/{comm_id}"
        tmo = setup_timeout_s
        zero = self.nbytes if zero_bytes is None else zero_bytes
        try:
            if backend == "host":
                self._setup_host(prefix, tmo)
            else:
                self._setup_cuda(prefix, tmo, zero, lamport_range)
            for g, r in self.local:
                bufs = self._bufs[(g, r)]
                slot = self._slot(g, r)
                self.mod.register_rank(comm_id, slot, r, self.world, bufs,
                                       int(timeout_s * 1e9), int(max_message_bytes))
                self.slots.append(slot)
        except BaseException:
            self.close(sync=False)
            raise

    def _slot(self, g, r) -> int:
        if self.backend == "host":
            return g * self.world + r
        return int(self.groups[g, r].local_hardware_id)

    # ---- host: POSIX shared memory ----
    def _setup_host(self, prefix, tmo):
        if jax.process_count() > 1:
            if jax.process_index() == 0:
                _exchange.put(f"{prefix}/token", secrets.token_hex(6).encode())
            token = _exchange.get(f"{prefix}/token", tmo, "the shared-memory name").decode()
        else:
            token = secrets.token_hex(6)
        name = lambda g, r: f"/nvc_{token}_{self.comm_id}_{g}_{r}"
        addrs = {}
        created = []
        try:
            for g, r in self.local:
                addrs[(g, r)] = self.mod.shm_create(name(g, r), self.nbytes)
                created.append(name(g, r))
                self._shm.append((addrs[(g, r)], self.nbytes))
            _exchange.barrier(f"{prefix}/shm_created", tmo, "shared-memory creation")
            self._bufs = {}
            for g, r in self.local:
                row = []
                for rr in range(self.world):
                    if (g, rr) in addrs:
                        row.append(addrs[(g, rr)])
                    else:
                        a = self.mod.shm_map(name(g, rr), self.nbytes)
                        self._shm.append((a, self.nbytes))
                        addrs[(g, rr)] = a
                        row.append(a)
                self._bufs[(g, r)] = row
            _exchange.barrier(f"{prefix}/shm_mapped", tmo, "shared-memory mapping")
        finally:
            for n in created:  # mapped everywhere (or failed): the names are no longer needed
                self.mod.shm_unlink(n)

    # ---- CUDA: device memory, IPC between processes, peer access within one ----
    def _setup_cuda(self, prefix, tmo, zero, lamport_range):
        mod = self.mod
        loff, llen = lamport_range
        ptrs = {}
        for dev in sorted({int(self.groups[g, r].local_hardware_id) for g, r in self.local}):
            mod.load_kernels(dev)
        for g, r in self.local:
            dev = int(self.groups[g, r].local_hardware_id)
            p = mod.alloc_buffer(dev, self.nbytes, zero, loff, llen, 0x80000000)
            self._owned.append((dev, p))
            ptrs[(g, r)] = p
            if jax.process_count() > 1:
                _exchange.put(f"{prefix}/ipc/{g}/{r}", bytes(mod.ipc_export(dev, p)))
        self._bufs = {}
        for g, r in self.local:
            dev = int(self.groups[g, r].local_hardware_id)
            row = []
            for rr in range(self.world):
                if (g, rr) in ptrs:
                    peer_dev = int(self.groups[g, rr].local_hardware_id)
                    mod.enable_peer_access(dev, peer_dev)
                    row.append(ptrs[(g, rr)])
                else:
                    h = _exchange.get(f"{prefix}/ipc/{g}/{rr}", tmo,
                                      f"rank {rr}'s CUDA IPC handle (group {g})")
                    a = mod.ipc_import(dev, h)
                    self._imported.append((dev, a))
                    row.append(a)
            self._bufs[(g, r)] = row
        _exchange.barrier(f"{prefix}/ipc_mapped", tmo, "CUDA IPC mapping")

    def buffers(self, g, r):
        return list(self._bufs[(g, r)])

    def close(self, sync=True):
        mod = self.mod
        if sync and self.backend == "cuda":
            for dev, _ in self._owned:
                try:
                    mod.synchronize(dev)
                except RuntimeError:
                    pass
        mod.unregister(self.comm_id)
        if self.backend == "cuda":
            for dev, a in self._imported:
                mod.ipc_close(dev, a)
            for dev, p in self._owned:
                mod.free_buffer(dev, p)
        else:
            for a, n in self._shm:
                mod.shm_unmap(a, n)
        self._owned, self._imported, self._shm, self.slots = [], [], [], []
