"""Build-level checks of the CUDA code (need nvcc, not a GPU): the multicast variants hold the
multimem instructions, no kernel spills registers to local memory (one measured exception,
SPILL_ALLOWED), and only the multicast
transport creates a multicast object, each of its entry points behind the environment interlock
(multicast must never run on shared machines unless enabled)."""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def nvcc(*args):
    p = subprocess.run([NVCC, "-std=c++17", "-I", os.path.join(ROOT, "csrc"), *args],
                       capture_output=True, text=True, timeout=900, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout + p.stderr


# The all-reduce translation units (the fused kernels with a float32 weight and 16-bit x have
# one of their own) and their multicast kernels: {one-shot, two-shot} x {f32, bf16, f16} x
# {plain, fused, FP8}, and {one-shot, two-shot} x {bf16, f16} x {fused, FP8}.
AR_UNITS = {"csrc/cuda/allreduce.cu": 18, "csrc/cuda/allreduce_wf32.cu": 8}


@needs_nvcc
def test_multicast_variants_hold_multimem(tmp_path):
    for unit in AR_UNITS:
        ptx = tmp_path / "allreduce.ptx"
        nvcc("-ptx", "-arch=compute_90a", os.path.join(ROOT, unit), "-o", str(ptx))
        text = ptx.read_text()
        assert "multimem.st" in text, unit
        assert "multimem.ld_reduce" in text, unit


# The emulation build of the multicast kernels (-DNVC_MULTICAST_EMULATE,
# csrc/kernels/allreduce_multicast.cuh): what the GPU runs them as, with virtual ranks
# (tests/cuda_harness/allreduce_harness.cu --multicast, scripts/gpu_check.sh part mcemu).
EMULATE = "NVC_MULTICAST_EMULATE"
# In SASS, multimem.ld_reduce is LDGMC.* and multimem.st.relaxed.sys.v4 is STG.E.128.STRONG.SYS
# (sm_90a, nvcc 13: the package build's multicast kernels hold both, no unicast kernel holds
# either); "multimem" itself never appears there, so a SASS check must look for these.
SASS_MULTIMEM = re.compile(r"multimem|LDGMC|STG\.E\.128\.STRONG\.SYS", re.IGNORECASE)


@needs_nvcc
def test_multicast_emulation_build_holds_no_multimem(tmp_path):
    """The emulation build compiles (one TU, the front end only: PTX), keeps every multicast
    kernel and names no multimem instruction; where cuobjdump exists, its SASS holds none of the
    spellings multimem has there either."""
    for unit, mc_kernels in AR_UNITS.items():
        ptx = tmp_path / "allreduce_emulated.ptx"
        nvcc("-ptx", "-arch=compute_90a", "-D" + EMULATE, "-diag-suppress", "128,177",
             os.path.join(ROOT, unit), "-o", str(ptx))
        text = ptx.read_text()
        assert "multimem" not in text, unit
        kernels = set(re.findall(r"\.entry\s+(\w+_mc_kernel\w*)", text))
        assert len(kernels) == mc_kernels, (unit, sorted(kernels))
        cuobjdump = shutil.which("cuobjdump")
        if cuobjdump is None:
            continue
        cubin = tmp_path / "allreduce_emulated.cubin"
        ptxas = shutil.which("ptxas") or os.path.join(os.path.dirname(os.path.realpath(NVCC)),
                                                      "ptxas")
        p = subprocess.run([ptxas, "-arch=sm_90a", str(ptx), "-o", str(cubin)],
                           capture_output=True, text=True, timeout=900, check=False)
        assert p.returncode == 0, p.stderr[-3000:]
        sass = subprocess.run([cuobjdump, "--dump-sass", str(cubin)], capture_output=True,
                              text=True, timeout=300, check=True).stdout
        assert len(re.findall(r"Function : \w+_mc_kernel", sass)) == mc_kernels, unit
        hits = [l.strip() for l in sass.splitlines() if SASS_MULTIMEM.search(l)]
        assert not hits, (unit, hits[:5])


def test_multicast_emulation_stays_out_of_the_package():
    """Only the multicast kernels' header and the harness read the switch; the multicast
    transport refuses to compile under it; no build file or Python module sets it."""
    users = sorted(path for path, text in _sources() if EMULATE in text)
    assert users == ["csrc/kernels/allreduce_multicast.cuh", "csrc/transport/cuda_multicast.h"], users
    with open(os.path.join(ROOT, "csrc/transport/cuda_multicast.h")) as f:
        head = f.read()
    guard = head[head.index("#ifdef " + EMULATE):]
    assert guard.splitlines()[1].startswith("#error"), guard[:200]
    for build_file in ("CMakeLists.txt", "pyproject.toml"):
        with open(os.path.join(ROOT, build_file)) as f:
            assert EMULATE not in f.read(), build_file
    # the emulated kernels' host side and harness touch no driver multicast API
    for path in (*AR_UNITS, "csrc/cuda/allreduce_launch.h", "csrc/kernels/allreduce_multicast.cuh",
                 "tests/cuda_harness/allreduce_harness.cu"):
        with open(os.path.join(ROOT, path)) as f:
            assert "cuMulticast" not in f.read(), path


# The one measured exception: the world-1 fused epilogue (local_kernel<T, fused, not quant>,
# either weight form) runs two blocks per SM at 64 registers and spills 16-20 bytes (36 loaded)
# doing so, faster than one block per SM without a spill (70-72% against 59-63% of the copy
# bandwidth, 2 x H200, csrc/kernels/allreduce_local.cuh). It may spill up to this many bytes;
# nothing else may (the float32-weight forms are instances of their own: rmsnorm.cuh).
SPILL_ALLOWED = [(re.compile(r"local_kernel\w*Lb1ELb0E"), 40)]


def _spills_per_function(out):
    """(mangled name, stack frame bytes, spill store bytes, spill load bytes) per function."""
    return [(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))) for m in re.finditer(
        r"Function properties for (\S+)\s*\n.*?(\d+) bytes stack frame, (\d+) bytes spill "
        r"stores, (\d+) bytes spill loads", out)]


@needs_nvcc
@pytest.mark.parametrize("src", [*AR_UNITS, "csrc/cuda/moe.cu",
                                 "csrc/cuda/allgather.cu", "csrc/cuda/varlen.cu",
                                 "csrc/cuda/ragged.cu"])
def test_no_register_spills(tmp_path, src):
    out = nvcc("-c", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
               os.path.join(ROOT, src), "-o", str(tmp_path / "k.o"))
    funcs = _spills_per_function(out)
    assert funcs, out[-2000:]
    def limit(name):
        return max([lim for pattern, lim in SPILL_ALLOWED if pattern.search(name)], default=0)
    bad = [f for f in funcs if max(f[1:]) > limit(f[0])]
    assert not bad, bad[:10]


# The 8-bit kernels' wgmma loop with register A (csrc/kernels/ragged_dot_w8_wgmma.cuh), an A/B
# build (NVC_W8_R64_WG, csrc/cuda/ragged_dot_family.cuh) until measured faster: its overlap of
# the conversion with the running MMAs holds only while ptxas keeps the wgmma pipeline, i.e.
# prints no C75xx note ("wgmma.mma_async instructions are serialized", warpgroup waits
# injected: registers it cannot prove untouched in flight), and nothing spills. Value 2 builds
# the loop into the R 64 and R 16 tiles of both forms and both out dtypes: 8 kernels.
@needs_nvcc
def test_w8_wgmma_variant_keeps_its_pipeline(tmp_path):
    unit = os.path.join(ROOT, "csrc/cuda/ragged_dot_w8_bf16_i8.cu")
    out = nvcc("-c", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
               "-DNVC_W8_R64_WG=2", "-Xptxas", "-v", unit, "-o", str(tmp_path / "k.o"))
    funcs = _spills_per_function(out)
    # option bits kSpecRows | kTma | kCtaSync | kWgmmaRA (402), at R 16 with kSplitK (434)
    wg = [f for f in funcs if re.search(r"ragged_dot_kernel\w*ELi(402|434)E", f[0])]
    assert len(wg) == 8, [f[0] for f in funcs]
    assert not [f for f in funcs if max(f[1:]) > 0], funcs
    notes = re.findall(r".*\(C75\d\d\).*", out)
    assert not notes, notes[:5]


def test_installed_cuda_module_holds_hopper_code():
    """The installed CUDA module is compiled for Hopper (sm_90a), not for nvcc's default target:
    CMake fills in sm_52 (CUDA 12) or sm_75 (CUDA 13) unless told otherwise, and then every
    H100/H200 JIT-compiles old PTX without Hopper's instructions (CMakeLists.txt,
    JAX_NVCOMM_CUDA_ARCHS)."""
    from jax_nvcomm import _ffi
    if _ffi._cuda is None:
        pytest.skip("built without the CUDA part")
    archs = _ffi._cuda.compiled_archs()
    assert 900 in archs, f"compiled for {archs}, not sm_90a"
    assert all(a >= 900 for a in archs), archs


MULTICAST_CU = "csrc/transport/cuda_multicast.cu"
# Calls that create, import, export, join, bind, map or size a multicast object.
GUARDED = ("cuMulticastCreate(", "cuMulticastAddDevice(", "cuMulticastBindMem(",
           "cuMulticastGetGranularity(", "import_handle(", "export_handle(", "map_handle(")


def _sources():
    for d in ("csrc", "jax_nvcomm"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, d)):
            for f in files:
                if f.endswith((".cu", ".cuh", ".cc", ".h", ".py")):
                    path = os.path.join(dirpath, f)
                    with open(path, errors="ignore") as fh:
                        yield os.path.relpath(path, ROOT), fh.read()


def _functions(text):
    """(signature, body) of every function defined at column 0 whose body closes at column 0."""
    pat = re.compile(r"^(?![\s#/]|namespace|struct|class)([^\n;{}]*\([^;{}]*\)[^;{}]*)\{\n"
                     r"(.*?)^\}", re.MULTILINE | re.DOTALL)
    return [(m.group(1), m.group(2)) for m in pat.finditer(text)]


def test_only_the_multicast_transport_creates_multicast_objects():
    hits = sorted(path for path, text in _sources() if "cuMulticastCreate" in text)
    assert hits == [MULTICAST_CU], hits


def test_multicast_interlock_precedes_every_multicast_call():
    with open(os.path.join(ROOT, MULTICAST_CU)) as f:
        text = f.read()
    funcs = _functions(text)
    lock = [body for sig, body in funcs if "multicast_interlock(" in sig]
    assert len(lock) == 1, "one interlock function"
    # it re-reads both variables itself and refuses through the shared rule
    assert 'getenv("JAX_NVCOMM_MULTICAST")' in lock[0]
    assert 'getenv("NCCL_NVLS_ENABLE")' in lock[0]
    assert "env_allows(" in lock[0] and "throw" in lock[0]
    rule = [body for sig, body in funcs if sig.startswith("bool env_allows(")]
    assert len(rule) == 1 and 'strcmp(multicast, "1")' in rule[0]
    assert text.index("void multicast_interlock(") < text.index("cuMulticastCreate(&")
    calls = re.compile(r"(?<![\w])(?:" + "|".join(re.escape(g) for g in GUARDED) + ")")
    guarded = [(sig, body) for sig, body in funcs if calls.search(body)]
    names = " ".join(sig for sig, _ in guarded)
    for must in ("Multicast::create(", "Multicast::import(", "Multicast::add_device(",
                 "Multicast::bind_and_map(", "Multicast::export_fd(", "granularity("):
        assert must in names, f"{must} not found: the parser missed a function"
    for sig, body in guarded:
        first = body.strip().splitlines()[0].strip()
        assert first.startswith("multicast_interlock("), (sig.strip(), first)
    # every call of the creating function sits in such a function
    assert text.count("cuMulticastCreate(") == 1


def test_multicast_kernels_are_reached_only_through_a_multicast_base():
    """The multimem kernels are named only in the launch that takes a multicast base (mc != 0):
    not in the eager kernel loading, so without multicast they are never even loaded."""
    launch_code = "csrc/cuda/allreduce_launch.h"  # the launch code of both all-reduce units
    with open(os.path.join(ROOT, launch_code)) as f:
        text = f.read()
    uses = [l.strip() for l in text.splitlines() if "_mc_kernel<" in l]
    assert len(uses) == 2, uses
    assert all(u.startswith(": launch<") for u in uses), uses
    body = text[text.index("cudaError_t launch_one("):]
    body = body[:body.index("\n}\n")]
    assert body.count("mc == nullptr") == 2 and body.count("_mc_kernel<") == 2, body
    for path, src in _sources():
        if path != launch_code:
            assert "_mc_kernel<" not in src, path


def test_every_cuda_target_has_a_nograph_twin():
    """Each CUDA target is registered twice (NVC_CUDA_HANDLER): command-buffer compatible, and
    as "<name>_nograph" without the trait, for communicators with graph_capture off."""
    from jax_nvcomm import _ffi
    if not _ffi.CUDA_BUILT:
        pytest.skip("built without the CUDA part")
    names = set(_ffi.CUDA_TARGETS)
    plain = {n for n in names if not n.endswith("_nograph")}
    assert len(plain) >= 12, sorted(names)
    assert names == plain | {n + "_nograph" for n in plain}, sorted(names)


def test_graph_capture_choice(monkeypatch):
    """graph_capture(comm): the communicator's own setting wins; unset, the environment's."""
    from jax_nvcomm import _shard

    class C:
        graph_capture = None
    c = C()
    monkeypatch.setattr(_shard, "_GRAPH_CAPTURE", True)
    assert _shard.graph_capture(c) is True
    monkeypatch.setattr(_shard, "_GRAPH_CAPTURE", False)
    assert _shard.graph_capture(c) is False
    c.graph_capture = True
    assert _shard.graph_capture(c) is True
    monkeypatch.setattr(_shard, "_GRAPH_CAPTURE", True)
    c.graph_capture = False
    assert _shard.graph_capture(c) is False
