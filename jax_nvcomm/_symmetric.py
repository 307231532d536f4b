"""Symmetric buffers: one buffer per rank of every group along a mesh axis, mapped into every
peer of the group, allocated once and held until close().

Groups: the mesh's devices with `axis_name` moved last and the other axes flattened in mesh
order: row g is group g, column r is rank r. A tuple of axes is moved last in the tuple's
order, so r is the linearised index over them as `lax.axis_index(tuple)` gives it (the first
axis major). The traced program computes the same (g, r) from `lax.axis_index`, so a host-backend handler finds its context by slot = g * world + r; a CUDA
handler finds it by device ordinal.

Transports: CUDA devices of this process: the pointer itself (+ peer access between devices);
CUDA devices of other processes: CUDA IPC handles through the key-value store; CPU devices:
POSIX shared memory named after a job-wide token.

CUDA allocation modes (`alloc`, agreed by every process, see _multicast.py): "cudamalloc"
(default) as above; "vmm": cuMemCreate allocations, peers of this process get access to the
owner's mapping, peers of other processes import it from (pid, POSIX fd) published in the
key-value store (csrc/transport/cuda_vmm.h). `multicast=True` (implies "vmm") adds one multicast
object per group (csrc/transport/cuda_multicast.h for the protocol): group rank 0's process
creates it, every process imports it, every rank adds its device, a barrier, every rank binds its
buffer and maps the object; the mapped address is the rank's `multicast_base`. close() releases
in reverse order: multicast objects, imported mappings, own allocations.
"""
from __future__ import annotations

import json
import os
import secrets

import jax
import numpy as np

from . import _exchange, _ffi


def groups_of(mesh, axis_name) -> np.ndarray:
    """[num_groups, world] array of devices; axis_name: one mesh axis or a tuple of them."""
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    idx = [mesh.axis_names.index(a) for a in axes]
    others = [i for i in range(len(mesh.axis_names)) if i not in idx]
    devs = np.transpose(np.asarray(mesh.devices), others + idx)
    world = int(np.prod([mesh.devices.shape[i] for i in idx], dtype=np.int64))
    return devs.reshape(-1, world)


class SymmetricBuffers:
    """Allocates `nbytes` per rank on every local device of the mesh, maps the peers and
    registers one rank context per local rank in the backend's registry under `comm_id`."""

    def __init__(self, comm_id: int, mesh, axis_name, backend: str, nbytes: int,
                 max_message_bytes: int, timeout_s: float, setup_timeout_s: float,
                 lamport_range: tuple[int, int] = (0, 0), zero_bytes: int | None = None,
                 alloc: str = "cudamalloc", multicast: bool = False):
        self.comm_id = comm_id
        self.backend = backend
        self.nbytes = int(nbytes)
        self.multicast = bool(multicast) and backend == "cuda"
        self.alloc = "vmm" if self.multicast else alloc
        self.mod = _ffi.module(backend)
        self.groups = groups_of(mesh, axis_name)
        self.world = self.groups.shape[1]
        me = jax.process_index()
        self.local = [(g, r) for g in range(self.groups.shape[0]) for r in range(self.world)
                      if self.groups[g, r].process_index == me]
        self._owned = []     # (kind, handle...) to free on close
        self._imported = []  # CUDA IPC mappings to close
        self._shm = []       # (addr, nbytes) host mappings to unmap
        self._vmm = []       # own VMM allocations (release last)
        self._vmm_mapped = []  # peers' VMM allocations mapped here
        self._mc = []        # multicast objects (release first)
        self._mc_base = {}   # (g, r) -> multicast address of the rank's buffer
        self.slots = []      # registry slots of this process
        prefix = f"jax_nvcomm/{comm_id}"
        tmo = setup_timeout_s
        zero = self.nbytes if zero_bytes is None else zero_bytes
        try:
            if backend == "host":
                self._setup_host(prefix, tmo)
            elif self.alloc == "vmm":
                self._setup_cuda_vmm(prefix, tmo, zero, lamport_range)
            else:
                self._setup_cuda(prefix, tmo, zero, lamport_range)
            for g, r in self.local:
                bufs = self._bufs[(g, r)]
                slot = self._slot(g, r)
                extra = {"multicast_base": self._mc_base[(g, r)]} if self.multicast else {}
                self.mod.register_rank(comm_id, slot, r, self.world, bufs,
                                       int(timeout_s * 1e9), int(max_message_bytes), **extra)
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

    # ---- CUDA, VMM allocations (JAX_NVCOMM_ALLOC=vmm, and always with multicast) ----
    def _dev(self, g, r) -> int:
        return int(self.groups[g, r].local_hardware_id)

    def _setup_cuda_vmm(self, prefix, tmo, zero, lamport_range):
        mod = self.mod
        loff, llen = lamport_range
        multi = jax.process_count() > 1
        devs = sorted({self._dev(g, r) for g, r in self.local})
        for dev in devs:
            mod.load_kernels(dev)
        align = 0
        if self.multicast:  # the buffer is what gets bound: a multiple of the multicast granularity
            align = max([mod.multicast_granularity(d, self.nbytes, self.world, multi)
                         for d in devs], default=0)
        allocs = {}
        for g, r in self.local:
            dev = self._dev(g, r)
            a = mod.VmmAllocation(dev, self.nbytes, align, multi)
            self._vmm.append(a)
            allocs[(g, r)] = a
            mod.init_buffer(dev, a.ptr, zero, loff, llen, 0x80000000)
            if multi:
                _exchange.put(f"{prefix}/vmm/{g}/{r}", json.dumps(
                    {"pid": os.getpid(), "fd": a.export_fd(), "size": a.size}).encode())
        self._bufs = {}
        for g, r in self.local:
            dev = self._dev(g, r)
            row = []
            for rr in range(self.world):
                if (g, rr) in allocs:
                    peer = allocs[(g, rr)]
                    if rr != r:
                        mod.enable_peer_access(dev, peer.device)  # the path check, clear error
                        peer.grant_access(dev)
                    row.append(peer.ptr)
                else:
                    info = json.loads(_exchange.get(f"{prefix}/vmm/{g}/{rr}", tmo,
                                                    f"rank {rr}'s VMM handle (group {g})"))
                    m = mod.VmmMapping(dev, info["pid"], info["fd"], info["size"])
                    self._vmm_mapped.append(m)
                    row.append(m.ptr)
            self._bufs[(g, r)] = row
        if self.multicast:
            self._setup_multicast(prefix, tmo, allocs, multi)
        _exchange.barrier(f"{prefix}/vmm_mapped", tmo, "VMM mapping")

    def _setup_multicast(self, prefix, tmo, allocs, multi):
        mod = self.mod
        objs = {}
        for g in sorted({g for g, _ in self.local}):
            mine = [r for gg, r in self.local if gg == g]
            dev = self._dev(g, mine[0])
            if (g, 0) in allocs:  # this process holds group rank 0: it creates the object
                mc = mod.Multicast.create(self._dev(g, 0), allocs[(g, 0)].size, self.world,
                                          multi)
                self._mc.append(mc)
                if multi:
                    _exchange.put(f"{prefix}/mc/{g}", json.dumps(
                        {"pid": os.getpid(), "fd": mc.export_fd(), "size": mc.size}).encode())
            else:
                info = json.loads(_exchange.get(f"{prefix}/mc/{g}", tmo,
                                                f"group {g}'s multicast handle"))
                mc = mod.Multicast.import_from(dev, info["pid"], info["fd"], info["size"],
                                               self.world)
                self._mc.append(mc)
            for r in mine:
                mc.add_device(self._dev(g, r))
            objs[g] = mc
        # Binding blocks until every device of the team was added: all processes add first.
        _exchange.barrier(f"{prefix}/mc_added", tmo, "multicast device registration")
        for g, r in self.local:
            self._mc_base[(g, r)] = objs[g].bind_and_map(allocs[(g, r)])

    def buffers(self, g, r):
        return list(self._bufs[(g, r)])

    def local_devices(self) -> list[int]:
        """CUDA ordinals of this process's ranks (empty for the host backend)."""
        if self.backend != "cuda":
            return []
        return sorted({self._dev(g, r) for g, r in self.local})

    def close(self, sync=True, keep_own=False):
        """Unregister the ranks, unmap the peers' buffers, free this process's own. keep_own
        (CUDA): leave the own allocations allocated (until the process exits): a peer that
        did not reach the close barrier may still have them mapped, and CUDA leaves a free
        under a peer's mapping undefined for that peer (cudaIpcOpenMemHandle)."""
        mod = self.mod
        if sync and self.backend == "cuda":
            for dev in self.local_devices():
                try:
                    mod.synchronize(dev)
                except RuntimeError:
                    pass
        if self.backend != "cuda" and self._shm:
            # XLA:CPU may still be running a call of this communicator (asynchronous
            # dispatch): the last context released unmaps (module_host.cc)
            mod.unmap_after_last_use(self.comm_id, [a for a, _ in self._shm],
                                     [n for _, n in self._shm])
        mod.unregister(self.comm_id)
        if self.backend == "cuda":
            for mc in reversed(self._mc):        # unmap, unbind, release, close the fd
                mc.release()
            for m in reversed(self._vmm_mapped):
                m.release()
            for a in [] if keep_own else reversed(self._vmm):  # unmap, release, close the fd
                a.release()
            for dev, a in self._imported:
                mod.ipc_close(dev, a)
            for dev, p in [] if keep_own else self._owned:
                mod.free_buffer(dev, p)
        self._owned, self._imported, self._shm, self.slots = [], [], [], []
        self._vmm, self._vmm_mapped, self._mc, self._mc_base = [], [], [], {}
