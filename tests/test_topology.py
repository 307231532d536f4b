"""Topology facts and the transport decision (jax_nvcomm/topology/), on fake facts: which
groups keep our buffers, which fall back to XLA's collectives, which are refused."""
from __future__ import annotations

import numpy as np
import pytest

from jax_nvcomm import topology
from jax_nvcomm.topology import XLA, SYMMETRIC, DeviceFacts, RankFacts


def dev(i, mc=False):
    return DeviceFacts(name="NVIDIA H200", uuid=f"{i:032x}", pci_bus_id=f"0000:{i:02x}:00.0",
                       sm_count=132, multicast_supported=mc)


def ranks(hosts, devices=None, world=None):
    """Facts of ranks laid out group-major: hosts[i] / devices[i] of flat rank i."""
    world = world or len(hosts)
    return [RankFacts(i // world, i % world, i, h, None if devices is None else devices[i])
            for i, h in enumerate(hosts)]


def all_links(devs, kind):
    return {(a.uuid, b.uuid): kind for a in devs for b in devs if a.uuid != b.uuid}


def test_one_host_keeps_the_buffers():
    mode, why = topology.decide("host", ranks(["a"] * 4), {})
    assert mode == SYMMETRIC and "one host" in why


def test_group_over_two_hosts_falls_back_and_names_them():
    mode, why = topology.decide("host", ranks(["nodeB", "nodeA", "nodeB", "nodeA"]), {})
    assert mode == XLA
    assert "group 0" in why and "nodeA, nodeB" in why


def test_mixed_mesh_groups_inside_hosts_keep_the_buffers():
    # axis "local" (world 2): groups (0,1) on host a, (2,3) on host b
    facts = ranks(["a", "a", "b", "b"], world=2)
    assert topology.decide("host", facts, {})[0] == SYMMETRIC
    # axis "node" (world 2): groups (0,2) and (1,3) each span both hosts
    facts = ranks(["a", "b", "a", "b"], world=2)
    mode, why = topology.decide("host", facts, {})
    assert mode == XLA and "a, b" in why


@pytest.mark.parametrize("kind, expect", [("nvlink", SYMMETRIC), ("pcie", SYMMETRIC),
                                          ("unknown", SYMMETRIC), ("none", XLA)])
def test_cuda_pairs_need_peer_access(kind, expect):
    devs = [dev(i) for i in range(4)]
    links = all_links(devs, "nvlink")
    links[(devs[1].uuid, devs[3].uuid)] = kind
    links[(devs[3].uuid, devs[1].uuid)] = kind
    mode, why = topology.decide("cuda", ranks(["h"] * 4, devs), links)
    assert mode == expect
    if expect == XLA:
        assert "0000:01:00.0" in why and "0000:03:00.0" in why and "ranks 1 and 3" in why


def test_missing_links_are_unknown_not_refused():
    devs = [dev(i) for i in range(2)]
    assert topology.decide("cuda", ranks(["h", "h"], devs), {})[0] == SYMMETRIC


def test_ranks_sharing_one_gpu_need_no_link():
    d = dev(0)
    assert topology.decide("cuda", ranks(["h"] * 3, [d, d, d]), {})[0] == SYMMETRIC


def test_host_backend_ignores_links():
    devs = [dev(i) for i in range(2)]
    assert topology.decide("host", ranks(["h", "h"], devs), all_links(devs, "none"))[0] == \
        SYMMETRIC


def test_describe_links():
    devs = [dev(i) for i in range(3)]
    facts = ranks(["h"] * 3, devs)
    assert topology.describe_links(facts, all_links(devs, "nvlink")) == "nvlink"
    links = all_links(devs, "nvlink")
    links[(devs[0].uuid, devs[2].uuid)] = "pcie"
    assert topology.describe_links(facts, links) == "mixed (nvlink, pcie)"
    assert topology.describe_links(ranks(["h"]), {}) == "none (one device per group)"


def test_host_id_override_is_read_from_the_environment():
    assert topology.host_id({topology.ENV_TEST_HOSTNAME: "fake-7"}) == "fake-7"
    import socket
    assert topology.host_id({}) == socket.gethostname()


class _Dev:
    def __init__(self, ordinal, process):
        self.local_hardware_id = ordinal
        self.process_index = process


def test_local_facts_query_only_this_process_and_link_its_pairs():
    groups = np.array([[_Dev(0, 0), _Dev(1, 0), _Dev(0, 1)],
                       [_Dev(2, 0), _Dev(3, 0), _Dev(1, 1)]], dtype=object)
    asked = []

    def query(o):
        asked.append(o)
        return dev(o)

    def link(a, b):
        return "nvlink" if {a, b} == {0, 1} else "pcie"

    facts, links = topology.local_facts(groups, "cuda", 0, "hostX", query=query, link=link)
    assert [(f.group, f.rank, f.host, f.device.uuid) for f in facts] == [
        (0, 0, "hostX", dev(0).uuid), (0, 1, "hostX", dev(1).uuid),
        (1, 0, "hostX", dev(2).uuid), (1, 1, "hostX", dev(3).uuid)]
    assert sorted(set(asked)) == [0, 1, 2, 3]
    assert links == {(dev(0).uuid, dev(1).uuid): "nvlink", (dev(1).uuid, dev(0).uuid): "nvlink",
                     (dev(2).uuid, dev(3).uuid): "pcie", (dev(3).uuid, dev(2).uuid): "pcie"}
    host_facts, host_links = topology.local_facts(groups, "host", 1, "hostY", query=query)
    assert [(f.group, f.rank, f.device) for f in host_facts] == [(0, 2, None), (1, 2, None)]
    assert host_links == {}


def test_facts_survive_the_exchange_encoding():
    devs = [dev(i, mc=i % 2 == 0) for i in range(2)]
    facts = ranks(["a", "b"], devs) + ranks(["c"])
    links = all_links(devs, "pcie")
    f2, l2 = topology._decode(topology._encode(facts, links))
    assert f2 == facts and l2 == links


def test_driver_queries_need_cuda_python_and_say_how_to_install(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_cuda(name, *a, **k):
        if name.startswith("cuda"):
            raise ImportError("No module named 'cuda'")
        return real(name, *a, **k)

    topology._driver.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_cuda)
    try:
        with pytest.raises(topology.CudaPythonMissing,
                           match=r"cuda-python.*pip install .cuda-python>=13"):
            topology.query_device.__wrapped__(0)
        rep = topology.report()
        assert "cuda-python" in rep["error"] and rep["devices"] == []
    finally:
        topology._driver.cache_clear()


# ---- the platform line of the example and the bench (jax_nvcomm/_platform.py) ----
class _Device:
    def __init__(self, platform, kind):
        self.platform, self.device_kind = platform, kind


def test_platform_line_names_the_platform():
    from jax_nvcomm._platform import platform_lines
    assert platform_lines([_Device("gpu", "NVIDIA H200")] * 2, env={}, gpus=["GPU 0: x"]) == [
        "platform: gpu (2 x NVIDIA H200)"]
    assert platform_lines([_Device("cpu", "cpu")] * 8, env={}, gpus=[]) == [
        "platform: cpu (8 x cpu)"]


def test_gpus_present_but_jax_on_cpu_says_so_and_how_to_fix(tmp_path, monkeypatch):
    from jax_nvcomm._platform import nvidia_gpus, platform_lines
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\n"
                   "echo 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert len(nvidia_gpus()) == 2
    cpu = [_Device("cpu", "cpu")]
    lines = platform_lines(cpu, env={})
    assert lines[0] == "platform: cpu (1 x cpu)"
    assert "2 NVIDIA GPU(s)" in lines[1] and "no CUDA plugin" in lines[1]
    assert "jax[cuda13]" in lines[1] and "dev.sh deps" in lines[1]
    lines = platform_lines(cpu, env={"JAX_PLATFORMS": "cpu"})
    assert "JAX_PLATFORMS=cpu" in lines[1] and "unset" in lines[1]
