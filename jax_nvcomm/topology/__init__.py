"""Which ranks of a communicator's groups can reach each other, decided once at setup.

Facts (gathered by `gather`, never on the per-call path):
- the host of every rank: `host_id()`, i.e. `socket.gethostname()`; tests may override it with
  ``JAX_NVCOMM_TEST_HOSTNAME`` (test-only: it makes processes of one machine look like several
  hosts, to exercise the fallback without a second machine);
- on the CUDA backend, through cuda-python's driver bindings (`cuda.bindings.driver`, imported
  lazily, so that CPU-only installs need no cuda-python): each device's name, UUID, PCI bus id,
  SM count and multicast support (`DeviceFacts`), and the link between each pair of devices that
  one process sees (`link_between`: "nvlink", "pcie", "none").

Decision (`decide`, a pure function of the facts, so tests use fake ones): the communicator's
NVLink / shared-memory buffers serve a group only when all its ranks sit on one host and, on
CUDA, every pair of distinct GPUs has peer access. Otherwise the communicator runs every op with
XLA's collectives (`lax.psum`, `lax.all_gather`, the `ragged_all_to_all` path of `reference`),
which go over NCCL and the network (backend="auto"), or is refused (an explicit backend).
Every process publishes its own ranks' facts and reads all others', so all decide alike.

Limits: a process sees only its own GPUs (the launcher gives each process one), so the link
between GPUs of two processes of one host is "unknown" here; CUDA IPC then maps the peer's
buffer and a missing P2P path fails there (named). NVLink is told from PCIe by the driver's
P2P attribute NATIVE_ATOMIC_SUPPORTED (peer atomics: NVLink yes, PCIe no), a proxy that NVML's
per-link query would replace.

`python -m jax_nvcomm.topology` prints the facts of this process's GPUs and their links
(`topology/__main__.py`).
"""
from __future__ import annotations

import functools
import json
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

ENV_TEST_HOSTNAME = "JAX_NVCOMM_TEST_HOSTNAME"
SYMMETRIC, XLA = "symmetric", "xla"
LINKS = ("same", "nvlink", "pcie", "none", "unknown")
# how to get cuda-python (the same pins as pyproject's extras cuda13 / cuda12)
INSTALL_CUDA_PYTHON = ("pip install 'cuda-python>=13,<14' (driver CUDA 12: "
                       "'cuda-python>=12.8,<13'); `bash scripts/dev.sh install` and "
                       "pip install '.[cuda13]' in the checkout include it")


def host_id(env: Mapping[str, str] | None = None) -> str:
    """This process's host: socket.gethostname(), or JAX_NVCOMM_TEST_HOSTNAME (tests only)."""
    env = os.environ if env is None else env
    return env.get(ENV_TEST_HOSTNAME) or socket.gethostname()


@dataclass(frozen=True)
class DeviceFacts:
    """Driver-level facts of one CUDA device (`query_device`)."""
    name: str
    uuid: str
    pci_bus_id: str
    sm_count: int
    multicast_supported: bool


@dataclass(frozen=True)
class RankFacts:
    """Where rank `rank` of group `group` runs. `device` is None on the host backend."""
    group: int
    rank: int
    process: int
    host: str
    device: DeviceFacts | None = None


# ------------------------------------------------------------------------------ the decision
def decide(backend: str, facts: Sequence[RankFacts],
           links: Mapping[tuple[str, str], str]) -> tuple[str, str]:
    """(SYMMETRIC or XLA, reason) for a communicator whose groups' ranks are `facts`.
    `links[(uuid_a, uuid_b)]`: the link between two GPUs (missing = "unknown")."""
    groups: dict[int, dict[int, RankFacts]] = {}
    for f in facts:
        groups.setdefault(f.group, {})[f.rank] = f
    for g in sorted(groups):
        hosts = sorted({f.host for f in groups[g].values()})
        if len(hosts) > 1:
            return XLA, (f"group {g} spans {len(hosts)} hosts ({', '.join(hosts)}): NVLink "
                         "buffers cannot reach across hosts")
    if backend == "cuda":
        for g in sorted(groups):
            ranks = groups[g]
            for a in sorted(ranks):
                for b in sorted(ranks):
                    da, db = ranks[a].device, ranks[b].device
                    if b <= a or da is None or db is None or da.uuid == db.uuid:
                        continue
                    link = links.get((da.uuid, db.uuid), "unknown")
                    if link == "none":
                        return XLA, (f"GPUs {da.pci_bus_id} and {db.pci_bus_id} (ranks {a} and "
                                     f"{b} of group {g}, host {ranks[a].host}) have no peer "
                                     "access (no NVLink/P2P path)")
    n = max((len(r) for r in groups.values()), default=0)
    return SYMMETRIC, f"every group's {n} ranks on one host" + (
        " with peer access" if backend == "cuda" else "")


def describe_links(facts: Sequence[RankFacts], links: Mapping[tuple[str, str], str]) -> str:
    """'nvlink', 'pcie', 'mixed (...)' or 'unknown': the links inside the groups, for reports."""
    seen = set()
    by_group: dict[int, list[RankFacts]] = {}
    for f in facts:
        by_group.setdefault(f.group, []).append(f)
    for rs in by_group.values():
        for a in rs:
            for b in rs:
                if a.device and b.device and a.device.uuid < b.device.uuid:
                    seen.add(links.get((a.device.uuid, b.device.uuid), "unknown"))
    if not seen:
        return "none (one device per group)" if facts else "unknown"
    return seen.pop() if len(seen) == 1 else f"mixed ({', '.join(sorted(seen))})"


# ------------------------------------------------------------------------------ driver queries
class CudaPythonMissing(RuntimeError):
    pass


_said: set[str] = set()


def _say_once(msg: str) -> None:
    """Print a note to stderr once per process and text."""
    if msg not in _said:
        _said.add(msg)
        print(msg, file=sys.stderr, flush=True)


@functools.lru_cache(maxsize=1)
def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise CudaPythonMissing(
            "jax_nvcomm: cuda-python is not installed (needed for the GPU topology facts at "
            f"setup): {INSTALL_CUDA_PYTHON} ({e})") from e
    _call(driver, driver.cuInit, 0)
    return driver


def _call(driver, fn, *args):
    out = fn(*args)
    err, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"jax_nvcomm: {fn.__name__}{args} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def _text(b) -> str:
    return bytes(b).split(b"\0", 1)[0].decode(errors="replace")


@functools.lru_cache(maxsize=None)
def query_device(ordinal: int) -> DeviceFacts:
    """Facts of CUDA device `ordinal` of this process (cached: asked once per process)."""
    d = _driver()
    dev = _call(d, d.cuDeviceGet, ordinal)
    attr = lambda a: int(_call(d, d.cuDeviceGetAttribute, a, dev))
    A = d.CUdevice_attribute
    return DeviceFacts(
        name=_text(_call(d, d.cuDeviceGetName, 256, dev)),
        uuid=bytes(_call(d, d.cuDeviceGetUuid, dev).bytes).hex(),
        pci_bus_id=_text(_call(d, d.cuDeviceGetPCIBusId, 32, dev)),
        sm_count=attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        multicast_supported=bool(attr(A.CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)))


@functools.lru_cache(maxsize=None)
def link_between(a: int, b: int) -> str:
    """'same', 'nvlink', 'pcie' or 'none' between CUDA devices a and b of this process."""
    if a == b:
        return "same"
    d = _driver()
    da, db = _call(d, d.cuDeviceGet, a), _call(d, d.cuDeviceGet, b)
    if not int(_call(d, d.cuDeviceCanAccessPeer, da, db)):
        return "none"
    P = d.CUdevice_P2PAttribute
    atomics = int(_call(d, d.cuDeviceGetP2PAttribute,
                        P.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, da, db))
    return "nvlink" if atomics else "pcie"


def device_count() -> int:
    d = _driver()
    return int(_call(d, d.cuDeviceGetCount))


class DriverQueries:
    """The device queries the multicast gate needs (`_multicast.gather_facts(mod=...)`)."""

    @staticmethod
    def device_uuid(ordinal: int) -> str:
        return query_device(ordinal).uuid

    @staticmethod
    def multicast_supported(ordinal: int) -> bool:
        return query_device(ordinal).multicast_supported


# ------------------------------------------------------------------------------ gathering
def local_facts(groups, backend: str, process: int, host: str,
                query=query_device, link=link_between):
    """(facts of this process's ranks, links among this process's devices of one group).
    Without cuda-python the devices stay None (unknown): only the hosts are then checked."""
    facts, links = [], {}
    if backend == "cuda" and query is query_device:
        try:
            _driver()
        except CudaPythonMissing as e:
            _say_once(f"{e}; the peer access of GPU pairs is not checked")
            backend = "host"
    for g in range(groups.shape[0]):
        mine = [(r, groups[g, r]) for r in range(groups.shape[1])
                if groups[g, r].process_index == process]
        dev = {r: (query(int(d.local_hardware_id)) if backend == "cuda" else None)
               for r, d in mine}
        facts += [RankFacts(g, r, process, host, dev[r]) for r, _ in mine]
        if backend == "cuda":
            for ra, a in mine:
                for rb, b in mine:
                    if dev[ra].uuid != dev[rb].uuid:
                        links[(dev[ra].uuid, dev[rb].uuid)] = link(
                            int(a.local_hardware_id), int(b.local_hardware_id))
    return facts, links


def _encode(facts, links) -> bytes:
    return json.dumps({"facts": [asdict(f) for f in facts],
                       "links": [[a, b, v] for (a, b), v in sorted(links.items())]}).encode()


def _decode(raw: bytes):
    d = json.loads(raw)
    facts = [RankFacts(**{**f, "device": DeviceFacts(**f["device"]) if f["device"] else None})
             for f in d["facts"]]
    return facts, {(a, b): v for a, b, v in d["links"]}


def gather(prefix: str, groups, backend: str, timeout_s: float):
    """(facts of every rank, links), identical in every process (collective over the job)."""
    import jax

    from .. import _exchange
    me = jax.process_index()
    facts, links = local_facts(groups, backend, me, host_id())
    for p, raw in enumerate(_exchange.gather(f"{prefix}/topo", _encode(facts, links),
                                             timeout_s, "topology facts")):
        if p != me:
            f, l = _decode(raw)
            facts += f
            links.update(l)
    return sorted(facts, key=lambda f: (f.group, f.rank)), links


# ------------------------------------------------------------------------------ report
def report(ordinals: Sequence[int] | None = None) -> dict:
    """This process's CUDA devices and the link of every pair: a JSON-able dict (bench, CLI)."""
    out = {"host": host_id(), "devices": [], "links": {}}
    try:
        n = device_count()
    except (CudaPythonMissing, RuntimeError) as e:
        out["error"] = str(e)
        return out
    ordinals = list(range(n)) if ordinals is None else list(ordinals)
    for i in ordinals:
        out["devices"].append(dict(ordinal=i, **asdict(query_device(i))))
    for a in ordinals:
        for b in ordinals:
            if a < b:
                out["links"][f"{a}-{b}"] = link_between(a, b)
    return out
