"""The multicast gate (jax_nvcomm/_multicast.py) as pure functions, every condition on its own,
plus what can be checked of the transport without a GPU: the C++ environment rule agrees with
the Python one, the C++ interlock refuses with multicast unset, fds cross processes with
pidfd_getfd, and a Communicator reports multicast off by default.

SAFETY: no test sets JAX_NVCOMM_MULTICAST=1 in any process. The gate is tested on plain
mappings; the interlock test runs in a child process whose environment has the variable
removed and no GPU visible.
"""
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest
from helpers import mesh1d

import jax_nvcomm as nvc
from jax_nvcomm import _ffi, _multicast, communicator
from jax_nvcomm._multicast import RankFacts, alloc_mode, decide, requested

ON = {"JAX_NVCOMM_MULTICAST": "1"}
needs_cuda_module = pytest.mark.skipif(not _ffi.CUDA_BUILT,
                                       reason="built without the CUDA part")


def facts(world=4, groups=1, supported=True, gpus=None, nodes=None):
    out = []
    for g in range(groups):
        for r in range(world):
            gpu = gpus[g * world + r] if gpus else f"gpu-{g}-{r}"
            node = nodes[g * world + r] if nodes else "host-a/boot/pid:[1]"
            sup = supported if isinstance(supported, bool) else supported[g * world + r]
            out.append(RankFacts(g, r, node, gpu, sup))
    return out


# ---- all true -> on ----

@pytest.mark.parametrize("env", [ON, dict(ON, NCCL_NVLS_ENABLE="1"),
                                 dict(ON, NCCL_NVLS_ENABLE=""), dict(ON, OTHER="0")])
def test_every_condition_holds_gives_multicast(env):
    assert requested(env, "cuda", 4) == (True, "")
    on, why = decide(env, "cuda", 4, facts())
    assert on is True and "every condition holds" in why


def test_several_groups_all_true():
    assert decide(ON, "cuda", 2, facts(world=2, groups=4))[0] is True


# ---- each condition false -> off, with a reason naming it ----

@pytest.mark.parametrize("value", [None, "0", "", "true", "yes", " 1", "1 ", "2", "on"])
def test_off_unless_jax_nvcomm_multicast_is_exactly_1(value):
    env = {} if value is None else {"JAX_NVCOMM_MULTICAST": value}
    on, why = decide(env, "cuda", 4, facts())
    assert on is False and "JAX_NVCOMM_MULTICAST" in why
    assert requested(env, "cuda", 4)[0] is False


@pytest.mark.parametrize("value", ["0", " 0 ", "00", "+0", "-0", "0\n"])
def test_off_when_nccl_nvls_enable_is_0(value):
    on, why = decide(dict(ON, NCCL_NVLS_ENABLE=value), "cuda", 4, facts())
    assert on is False and "NCCL_NVLS_ENABLE" in why


@pytest.mark.parametrize("value", ["1", "2", "", "abc", "0x0", "0.0"])
def test_nccl_nvls_enable_other_values_do_not_block(value):
    assert decide(dict(ON, NCCL_NVLS_ENABLE=value), "cuda", 4, facts())[0] is True


@pytest.mark.parametrize("backend", ["host", "cpu", "auto"])
def test_off_without_the_cuda_backend(backend):
    on, why = decide(ON, backend, 4, facts())
    assert on is False and "backend" in why and "CUDA" in why


def test_off_for_a_group_of_one():
    on, why = decide(ON, "cuda", 1, facts(world=1))
    assert on is False and "world size 1" in why


def test_off_when_one_device_lacks_multicast_support():
    sup = [True] * 8
    sup[5] = False  # group 1, rank 1
    on, why = decide(ON, "cuda", 4, facts(world=4, groups=2, supported=sup))
    assert on is False
    assert "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED" in why and "rank 1 of group 1" in why


def test_off_when_ranks_share_a_physical_gpu():
    # launch --share-gpu: every rank on GPU 0
    on, why = decide(ON, "cuda", 4, facts(gpus=["GPU-0"] * 4))
    assert on is False and "share one physical GPU" in why and "ranks 0 and 1" in why


def test_off_when_two_of_several_ranks_share_a_gpu():
    on, why = decide(ON, "cuda", 4, facts(gpus=["a", "b", "c", "b"]))
    assert on is False and "ranks 1 and 3 of group 0" in why


def test_same_gpu_in_different_groups_is_not_sharing():
    # a GPU appears once per group: distinct within each group is what counts
    gpus = ["a", "b", "c", "d", "e", "f", "g", "h"]
    assert decide(ON, "cuda", 4, facts(world=4, groups=2, gpus=gpus))[0] is True


def test_off_when_a_group_spans_hosts():
    nodes = ["host-a"] * 2 + ["host-b"] * 2
    on, why = decide(ON, "cuda", 4, facts(nodes=nodes))
    assert on is False and "several hosts" in why and "host-a" in why and "host-b" in why


@pytest.mark.parametrize("drop", [0, 3])
def test_off_when_facts_are_incomplete(drop):
    f = facts()
    del f[drop]
    on, why = decide(ON, "cuda", 4, f)
    assert on is False and "incomplete" in why
    assert decide(ON, "cuda", 4, [])[0] is False


def test_first_failing_condition_is_reported():
    # env before backend before devices before sharing
    bad = facts(supported=False, gpus=["x"] * 4)
    assert "JAX_NVCOMM_MULTICAST" in decide({}, "host", 1, bad)[1]
    assert "NCCL_NVLS_ENABLE" in decide(dict(ON, NCCL_NVLS_ENABLE="0"), "host", 1, bad)[1]
    assert "backend" in decide(ON, "host", 1, bad)[1]
    assert "MULTICAST_SUPPORTED" in decide(ON, "cuda", 4, bad)[1]


def test_decision_does_not_depend_on_the_order_of_facts():
    f = facts(world=4, groups=2)
    assert decide(ON, "cuda", 4, f) == decide(ON, "cuda", 4, list(reversed(f)))
    g = facts(world=4, groups=2, gpus=["a", "b", "a", "c", "d", "e", "f", "g"])
    assert decide(ON, "cuda", 4, g) == decide(ON, "cuda", 4, list(reversed(g)))


def test_gate_reads_only_the_mapping_it_is_given(monkeypatch):
    # a pure function of its arguments: the process environment plays no part
    monkeypatch.delenv("JAX_NVCOMM_MULTICAST", raising=False)
    assert decide(ON, "cuda", 2, facts(world=2))[0] is True
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    assert decide(ON, "cuda", 2, facts(world=2))[0] is True


# ---- allocation mode ----

@pytest.mark.parametrize("env,mode", [({}, "cudamalloc"), ({"JAX_NVCOMM_ALLOC": ""}, "cudamalloc"),
                                      ({"JAX_NVCOMM_ALLOC": "cudamalloc"}, "cudamalloc"),
                                      ({"JAX_NVCOMM_ALLOC": "vmm"}, "vmm"),
                                      ({"JAX_NVCOMM_ALLOC": " VMM "}, "vmm")])
def test_alloc_mode(env, mode):
    assert alloc_mode(env) == mode


def test_alloc_mode_rejects_unknown_values():
    with pytest.raises(ValueError, match="JAX_NVCOMM_ALLOC"):
        alloc_mode({"JAX_NVCOMM_ALLOC": "ipc"})


# ---- C++ side (no GPU needed) ----

ENV_CASES = [(None, None), ("1", None), ("1", "0"), ("1", " 00 "), ("1", "1"), ("1", ""),
             ("1", "-0"), ("1", "0x0"), ("0", None), ("", "1"), ("true", None), (" 1", None)]


@needs_cuda_module
@pytest.mark.parametrize("mc,nvls", ENV_CASES)
def test_cxx_interlock_rule_matches_the_python_gate(mc, nvls):
    env = {k: v for k, v in (("JAX_NVCOMM_MULTICAST", mc), ("NCCL_NVLS_ENABLE", nvls))
           if v is not None}
    ok_cxx, why_cxx = _ffi._cuda.multicast_env_allows(mc, nvls)
    ok_py, why_py = requested(env, "cuda", 2)
    assert ok_cxx == ok_py
    if not ok_cxx:
        var = "JAX_NVCOMM_MULTICAST" if "JAX_NVCOMM_MULTICAST" in why_py else "NCCL_NVLS_ENABLE"
        assert var in why_cxx


INTERLOCK_CHILD = textwrap.dedent("""
    import os
    assert os.environ.get("JAX_NVCOMM_MULTICAST") != "1"
    from jax_nvcomm import _ffi
    m = _ffi._cuda
    calls = {
        "create": lambda: m.Multicast.create(0, 2 << 20, 2, False),
        "import": lambda: m.Multicast.import_from(0, os.getpid(), 0, 2 << 20, 2),
        "granularity": lambda: m.multicast_granularity(0, 1 << 20, 2, False),
        # a rank context with a multicast address (what selects the multicast kernels)
        "register": lambda: m.register_rank(987654, 0, 0, 2, [1 << 30, 1 << 31], 1, 4096,
                                            1 << 40),
    }
    for name, call in calls.items():
        try:
            call()
        except RuntimeError as e:
            assert "refused" in str(e) and "JAX_NVCOMM_MULTICAST" in str(e), str(e)
            print("REFUSED", name)
        else:
            print("NOT REFUSED", name)
""")


@needs_cuda_module
@pytest.mark.parametrize("setting", [None, "0"])
def test_cxx_interlock_refuses_when_multicast_is_not_enabled(setting):
    """The C++ entry points refuse before touching the driver. Run in a child with the
    variable removed (or 0) and no GPU visible, so nothing can reach a device either way."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NVCOMM_MULTICAST"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["NCCL_NVLS_ENABLE"] = "0"
    env["JAX_PLATFORMS"] = "cpu"
    if setting is not None:
        env["JAX_NVCOMM_MULTICAST"] = setting  # "0": explicitly off
    p = subprocess.run([sys.executable, "-c", INTERLOCK_CHILD], env=env, capture_output=True,
                       text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    # exactly the four "REFUSED <name>" lines: a "NOT REFUSED <name>" line fails the test
    assert sorted(ln for ln in lines if ln.startswith("REFUSED ")) == [
        "REFUSED create", "REFUSED granularity", "REFUSED import", "REFUSED register"], p.stdout
    assert not [ln for ln in lines if ln.startswith("NOT REFUSED")], p.stdout


FD_CHILD = textwrap.dedent("""
    import os, sys
    r, w = os.pipe()
    os.write(w, b"through pidfd_getfd")
    os.close(w)
    print(os.getpid(), r, flush=True)
    sys.stdin.read()
""")


@needs_cuda_module
def test_fd_from_process_takes_a_file_descriptor_of_another_process():
    child = subprocess.Popen([sys.executable, "-c", FD_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        pid, fd = map(int, child.stdout.readline().split())
        try:
            mine = _ffi._cuda.fd_from_process(pid, fd)
        except RuntimeError as e:
            # Skip only for what the host forbids (no ptrace access: EPERM; a kernel or seccomp
            # profile without the syscall: ENOSYS), named by the error's own hint; any other
            # failure of fd_from_process is a regression and fails here.
            msg = str(e)
            host_limit = ("Operation not permitted" in msg and "ptrace" in msg) or \
                "Linux >= 5.6" in msg or "Function not implemented" in msg
            if not host_limit:
                raise
            pytest.skip(f"pidfd_getfd forbidden on this host: {msg}")
        try:
            assert os.read(mine, 100) == b"through pidfd_getfd"
        finally:
            os.close(mine)
        with pytest.raises(RuntimeError, match="pidfd_getfd"):
            _ffi._cuda.fd_from_process(pid, 1000)  # a descriptor the child does not have
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    with pytest.raises(RuntimeError, match="pidfd_open"):
        _ffi._cuda.fd_from_process(pid, fd)  # the process has exited


@needs_cuda_module
def test_fd_from_own_process_duplicates():
    r, w = os.pipe()
    try:
        d = _ffi._cuda.fd_from_process(os.getpid(), r)
        assert d not in (r, w)
        os.write(w, b"x")
        assert os.read(d, 1) == b"x"
        os.close(d)
    finally:
        os.close(r)
        os.close(w)


# ---- Communicator ----

def test_communicator_reports_unicast_by_default(monkeypatch):
    monkeypatch.delenv("JAX_NVCOMM_MULTICAST", raising=False)
    with nvc.Communicator(mesh1d(2), "x", max_message_bytes=1 << 16) as c:
        assert c.multicast is False
        assert "JAX_NVCOMM_MULTICAST" in c.multicast_reason


def test_moe_communicator_never_uses_multicast():
    with nvc.MoECommunicator(mesh1d(2), "x", num_experts=4, top_k=2, max_tokens=4, hidden=16,
                             dtype=jnp.float32) as m:
        assert m.multicast is False and "does not use multicast" in m.multicast_reason


def test_transport_choice_is_part_of_the_compared_configuration(monkeypatch):
    """Processes compare the allocation mode and the environment's multicast verdict with the
    other arguments (_exchange.agree), so they cannot silently pick different transports."""
    seen = []
    monkeypatch.setattr(communicator._exchange, "agree", lambda p, cfg, t: seen.append(cfg))
    monkeypatch.delenv("JAX_NVCOMM_MULTICAST", raising=False)
    with nvc.Communicator(mesh1d(2), "x", max_message_bytes=1 << 16):
        pass
    assert seen and seen[0]["multicast_requested"] is False
    assert "cuda_alloc" in seen[0]


def test_bad_alloc_mode_fails_communicator_setup(monkeypatch):
    monkeypatch.setenv("JAX_NVCOMM_ALLOC", "bogus")
    with pytest.raises(ValueError, match="JAX_NVCOMM_ALLOC"):
        nvc.Communicator(mesh1d(2), "x", max_message_bytes=1 << 16)


# ---- orchestration in Python, against a recording stand-in (never the real transport) ----

class _Dev:
    def __init__(self, i):
        self.id = i
        self.local_hardware_id = i
        self.process_index = 0


class _Mesh:
    def __init__(self, shape, names):
        import numpy as np
        self.devices = np.array([_Dev(i) for i in range(int(np.prod(shape)))],
                                dtype=object).reshape(shape)
        self.axis_names = names


class _Recorder:
    """Stands in for the _cuda module: records the order of the transport calls."""

    def __init__(self):
        self.log = []
        rec = self

        class Alloc:
            def __init__(self, device, bytes, align, exportable):
                self.device, self.size = device, max(bytes, align)
                self.ptr = 0x1000_0000 * (device + 1)
                rec.log.append(("alloc", device, align, exportable))

            def export_fd(self):
                raise AssertionError("single process: nothing is exported")

            def grant_access(self, device):
                rec.log.append(("grant", self.device, device))

            def release(self):
                rec.log.append(("release_alloc", self.device))

        class Mc:
            def __init__(self, device, size):
                self.size = size
                rec.log.append(("mc_create", device, size))

            @staticmethod
            def create(device, size, world, exportable):
                assert not exportable
                return Mc(device, size)

            @staticmethod
            def import_from(*a):
                raise AssertionError("single process: nothing is imported")

            def add_device(self, device):
                rec.log.append(("mc_add", device))

            def bind_and_map(self, alloc):
                rec.log.append(("mc_bind", alloc.device))
                return 0x9000_0000 + alloc.device

            def release(self):
                rec.log.append(("mc_release",))

        self.VmmAllocation, self.Multicast = Alloc, Mc

    def load_kernels(self, dev):
        pass

    def multicast_granularity(self, dev, nbytes, world, exportable):
        self.log.append(("mc_gran", dev))
        return 2 << 20

    def init_buffer(self, dev, ptr, zero, off, n, word):
        self.log.append(("init", dev))

    def enable_peer_access(self, dev, peer):
        pass

    def register_rank(self, comm_id, slot, r, world, bufs, timeout_ns, max_bytes,
                      multicast_base=0):
        self.log.append(("register", slot, multicast_base, tuple(bufs)))

    def unregister(self, comm_id):
        self.log.append(("unregister",))

    def synchronize(self, dev):
        pass


@pytest.mark.parametrize("multicast", [False, True])
def test_vmm_orchestration_order_single_process(monkeypatch, multicast):
    from jax_nvcomm import _symmetric
    rec = _Recorder()
    monkeypatch.setattr(_symmetric._ffi, "module", lambda backend: rec)
    sym = _symmetric.SymmetricBuffers(7, _Mesh((2, 2), ("dp", "tp")), "tp", "cuda", 100_000,
                                      1 << 16, 1.0, 1.0, (4096, 8192), 1024, alloc="vmm",
                                      multicast=multicast)
    kinds = [e[0] for e in rec.log]
    assert kinds.count("alloc") == 4 and kinds.count("init") == 4
    assert ("grant", 0, 1) in rec.log and ("grant", 1, 0) in rec.log
    assert ("grant", 2, 3) in rec.log and ("grant", 0, 2) not in rec.log  # within a group only
    regs = [e for e in rec.log if e[0] == "register"]
    assert [r[1] for r in regs] == [0, 1, 2, 3]
    assert regs[0][3] == (0x1000_0000, 0x2000_0000)  # group 0: devices 0 and 1
    if multicast:
        assert all(e[2] == 2 << 20 for e in rec.log if e[0] == "alloc")
        creates = [e for e in rec.log if e[0] == "mc_create"]
        assert [c[1] for c in creates] == [0, 2]  # one per group, by its rank 0
        # every device added before any binding (binding blocks until the team is complete)
        assert max(i for i, k in enumerate(kinds) if k == "mc_add") < kinds.index("mc_bind")
        assert [r[2] for r in regs] == [0x9000_0000 + d for d in range(4)]
    else:
        assert "mc_create" not in kinds and "mc_gran" not in kinds
        assert all(r[2] == 0 for r in regs)
    rec.log.clear()
    sym.close()
    kinds = [e[0] for e in rec.log]
    assert kinds[0] == "unregister"
    assert kinds.count("release_alloc") == 4
    if multicast:  # multicast objects go before the memory bound to them
        assert kinds.count("mc_release") == 2
        assert max(i for i, k in enumerate(kinds) if k == "mc_release") < \
            kinds.index("release_alloc")


def test_local_facts_from_the_module_queries():
    import numpy as np
    rec = _Recorder()
    rec.device_uuid = lambda d: f"uuid-{d}"
    rec.multicast_supported = lambda d: d != 3
    groups = np.array([[_Dev(0), _Dev(1)], [_Dev(2), _Dev(3)]], dtype=object)
    f = _multicast.gather_facts("p", rec, groups, 1.0)
    assert [(x.group, x.rank, x.gpu, x.multicast_supported) for x in f] == [
        (0, 0, "uuid-0", True), (0, 1, "uuid-1", True), (1, 0, "uuid-2", True),
        (1, 1, "uuid-3", False)]
    assert len({x.node for x in f}) == 1
    on, why = decide(ON, "cuda", 2, f)
    assert on is False and "rank 1 of group 1" in why
