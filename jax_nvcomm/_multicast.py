"""The multicast (NVLink SHARP) gate and the CUDA allocation mode of a communicator.

Multicast is opt-in. A `Communicator` uses it only when every condition holds (DESIGN.md,
"All-reduce"), checked in this order, the first that fails naming the reason:

1. ``JAX_NVCOMM_MULTICAST=1`` in the environment (exactly ``1``);
2. ``NCCL_NVLS_ENABLE`` is not ``0`` (machines that switch NVLink SHARP off set it to 0);
3. the CUDA backend, and a group of at least 2 ranks;
4. every device of every group reports ``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED``;
5. every group spans distinct physical GPUs, one per rank (with ``launch --share-gpu`` all
   ranks sit on GPU 0: no);
6. every rank of a group runs on one host, in one PID namespace: the transport passes its
   handles as POSIX file descriptors (pidfd_getfd), which cannot leave a host.

`requested` (1-3) and `decide` (1-6) are pure functions of the environment mapping and the
per-rank facts, so tests cover every branch without a GPU. Agreement: the verdict of 1-3 is
part of the configuration every process compares (`_exchange.agree`; processes whose
environments disagree get a ValueError), and 4-6 are decided from facts that every process
publishes for its own ranks and reads for all others, so every process decides alike.

Whatever is decided here, the C++ transport (csrc/transport/cuda_multicast.cu) re-reads
conditions 1 and 2 itself before it creates, joins or maps a multicast object.

`alloc_mode`: ``JAX_NVCOMM_ALLOC`` = ``cudamalloc`` (default: cudaMalloc + CUDA IPC) or ``vmm``
(cuMemCreate + POSIX file descriptors, the allocation multicast needs; multicast implies it).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import jax

from . import _exchange

ENV_MULTICAST = "JAX_NVCOMM_MULTICAST"
ENV_NVLS = "NCCL_NVLS_ENABLE"
ENV_ALLOC = "JAX_NVCOMM_ALLOC"
ALLOC_MODES = ("cudamalloc", "vmm")


@dataclass(frozen=True)
class RankFacts:
    """What one rank's process knows about that rank's device."""
    group: int
    rank: int
    node: str                  # host + PID namespace: ranks that can pass fds to each other
    gpu: str                   # physical identity (UUID) of the device
    multicast_supported: bool  # CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED


def _integer_zero(value: str) -> bool:
    # Same rule as the C++ interlock: a decimal integer equal to 0, blanks around allowed.
    return re.fullmatch(r"\s*[+-]?[0-9]+\s*", value) is not None and int(value) == 0


def requested(env: Mapping[str, str], backend: str, world: int) -> tuple[bool, str]:
    """Conditions 1-3 (environment, backend, world size): (True, "") or (False, reason)."""
    if env.get(ENV_MULTICAST) != "1":
        return False, f"{ENV_MULTICAST} is not 1 (multicast is opt-in)"
    nvls = env.get(ENV_NVLS)
    if nvls is not None and _integer_zero(nvls):
        return False, f"{ENV_NVLS}={nvls.strip()}: NVLink SHARP is switched off on this machine"
    if backend != "cuda":
        return False, f"backend is {backend!r}: multicast needs the CUDA backend"
    if world < 2:
        return False, f"world size {world}: multicast needs a group of at least 2 GPUs"
    return True, ""


def decide(env: Mapping[str, str], backend: str, world: int,
           facts: Sequence[RankFacts]) -> tuple[bool, str]:
    """Every condition (1-6) over the facts of every rank of every group: (on, reason)."""
    ok, why = requested(env, backend, world)
    if not ok:
        return False, why
    by_group: dict[int, dict[int, RankFacts]] = {}
    for f in facts:
        by_group.setdefault(f.group, {})[f.rank] = f
    if not by_group or any(sorted(ranks) != list(range(world)) for ranks in by_group.values()):
        return False, "incomplete device facts (every rank of every group is needed)"
    for g in sorted(by_group):
        for r in range(world):
            f = by_group[g][r]
            if not f.multicast_supported:
                return False, (f"GPU {f.gpu} (rank {r} of group {g}) does not report "
                               "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED")
    for g in sorted(by_group):
        first: dict[str, int] = {}
        for r in range(world):
            gpu = by_group[g][r].gpu
            if gpu in first:
                return False, (f"ranks {first[gpu]} and {r} of group {g} share one physical GPU "
                               f"({gpu}); multicast needs one GPU per rank (with --share-gpu "
                               "every rank sits on GPU 0)")
            first[gpu] = r
    for g in sorted(by_group):
        nodes = sorted({by_group[g][r].node for r in range(world)})
        if len(nodes) > 1:
            return False, (f"group {g} spans several hosts or PID namespaces ({', '.join(nodes)}): "
                           "multicast handles travel as POSIX file descriptors, which cannot "
                           "leave one")
    return True, f"every condition holds ({world} GPUs per group, NVLink SHARP)"


def alloc_mode(env: Mapping[str, str]) -> str:
    """The CUDA allocation mode asked for by JAX_NVCOMM_ALLOC (ValueError when unknown)."""
    raw = env.get(ENV_ALLOC, "")
    mode = raw.strip().lower() or "cudamalloc"
    if mode not in ALLOC_MODES:
        raise ValueError(f"jax_nvcomm: {ENV_ALLOC} must be one of {ALLOC_MODES} (default "
                         f"'cudamalloc'), got {raw!r}")
    return mode


def _node() -> str:
    from .topology import host_id  # the host identity (tests may override it)
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "?"
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = "?"
    return f"{host_id()}/{boot}/{pidns}"


def local_facts(mod, groups) -> list[RankFacts]:
    """Facts of this process's ranks (queries only: UUID and the multicast attribute). `mod`
    answers device_uuid(ordinal) and multicast_supported(ordinal): topology.DriverQueries
    (cuda-python), or a fake in tests."""
    me = jax.process_index()
    node = _node()
    out = []
    for g in range(groups.shape[0]):
        for r in range(groups.shape[1]):
            d = groups[g, r]
            if d.process_index == me:
                dev = int(d.local_hardware_id)
                out.append(RankFacts(g, r, node, str(mod.device_uuid(dev)),
                                     bool(mod.multicast_supported(dev))))
    return out


def gather_facts(prefix: str, mod, groups, timeout_s: float) -> list[RankFacts]:
    """Every rank's facts, identical in every process (collective over the job)."""
    mine = local_facts(mod, groups)
    if jax.process_count() == 1:
        return mine
    raws = _exchange.gather(f"{prefix}/mcfacts", json.dumps([asdict(f) for f in mine]).encode(),
                            timeout_s, "device facts (multicast gate)")
    out = [RankFacts(**d) for raw in raws for d in json.loads(raw)]
    return sorted(out, key=lambda f: (f.group, f.rank))
