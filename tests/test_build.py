"""Build-level checks of the CUDA code (need nvcc, not a GPU): the multicast variants hold the
multimem instructions, no kernel spills registers to local memory, and nothing in the package
creates a multicast object (multicast must never run on shared machines unless enabled)."""
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
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout + p.stderr


@needs_nvcc
def test_multicast_variants_hold_multimem(tmp_path):
    ptx = tmp_path / "allreduce.ptx"
    nvcc("-ptx", "-arch=compute_90a", os.path.join(ROOT, "csrc/cuda/allreduce.cu"), "-o",
         str(ptx))
    text = ptx.read_text()
    assert "multimem.st" in text
    assert "multimem.ld_reduce" in text


@needs_nvcc
@pytest.mark.parametrize("src", ["csrc/cuda/allreduce.cu", "csrc/cuda/moe.cu",
                                 "csrc/cuda/allgather.cu"])
def test_no_register_spills(tmp_path, src):
    out = nvcc("-c", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
               os.path.join(ROOT, src), "-o", str(tmp_path / "k.o"))
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", out)]
    assert spills and max(spills) == 0, [l for l in out.splitlines() if "spill" in l][:10]
    frames = [int(n) for n in re.findall(r"(\d+) bytes stack frame", out)]
    assert max(frames, default=0) == 0, "a kernel uses a stack frame (local memory)"


def test_nothing_creates_multicast_objects():
    hits = []
    for d in ("csrc", "jax_nvcomm"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, d)):
            for f in files:
                if f.endswith((".cu", ".cuh", ".cc", ".h", ".py")):
                    text = open(os.path.join(dirpath, f), errors="ignore").read()
                    if "cuMulticastCreate" in text:
                        hits.append(os.path.join(dirpath, f))
    assert not hits, hits
