"""CUDA kernels in multi-process jobs and loops (tests/mp/ scripts through the launcher): one
process per GPU (2 or more GPUs) and two processes sharing GPU 0 (always), plus one process
over every local GPU for the CUDA-graph (XLA command buffer) loop, and the fault matrix
(scripts/faults.py) on GPU 0.
Run: JAX_NVCOMM_TEST_GPU=1 python -m pytest -m gpu tests  (skipped elsewhere, with the reason)."""
import json
import os
import re
import subprocess
import sys

import pytest

import gpu_env

pytestmark = gpu_env.MARKS
SETUPS = gpu_env.setups()
IDS = [s[0] for s in SETUPS]


def passed(rc, out, n):
    assert rc == 0, out[-6000:]
    assert out.count("PASS") >= n, out[-6000:]


@pytest.mark.parametrize("name,n,share", SETUPS, ids=IDS)
def test_collectives(name, n, share):
    """all_gather, one-shot / two-shot all-reduce and the fused op, all dtypes, float64
    reference, bitwise equal across strategies, then consecutive calls."""
    rc, out = gpu_env.launch(n, "collectives_mp.py", "--calls=60", share_gpu=share)
    passed(rc, out, n)


@pytest.mark.parametrize("name,n,share", SETUPS, ids=IDS)
def test_moe(name, n, share):
    rc, out = gpu_env.launch(n, "moe_mp.py", "--rounds=10", share_gpu=share)
    passed(rc, out, n)


@pytest.mark.parametrize("name,n,share", [("sp", 0, False)] + SETUPS[-1:],
                         ids=["sp"] + IDS[-1:])
def test_cuda_graph_replay(name, n, share):
    """fori_loops of all-reduce / fused / all-gather and of MoE dispatch + combine under XLA
    command buffers: every iteration's expected value differs, and the handler must run fewer
    times than the kernels (the loop body was replayed from a CUDA graph, not re-launched)."""
    rc, out = gpu_env.launch(n, "graph_mp.py", "--iters=40", share_gpu=share)
    passed(rc, out, max(n, 1))
    assert "graph check:" in out and "(CUDA graph replay)" in out, out[-6000:]


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fault_matrix(tmp_path, *args, timeout=900):
    """scripts/faults.py with args; (exit status, output, rows by case)."""
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "faults.py"), "--json",
                        str(out), *args], env=env, capture_output=True, text=True,
                       timeout=timeout)
    rows = json.loads(out.read_text()) if out.exists() else []
    return p.returncode, p.stdout + p.stderr, {r["case"]: r for r in rows}


def test_dead_or_raising_peer_leaves_the_gpu_usable(tmp_path):
    """Two processes on GPU 0, started directly, timeout 10 s: a peer that exits (os._exit) or
    raises after its first call. The survivor's comm.check() names the op, call, itself and the
    peer within the timeout + 5 s, its CUDA context is healthy (a fresh jitted computation runs,
    close() returns), and it exits 0. (Kernels used to trap here: an anonymous CUDA launch
    failure and an abort.)"""
    rc, out, rows = fault_matrix(tmp_path, "--platform", "gpu", "-n", "2", "--timeout", "10",
                                 "--cases", "kill", "raise")
    print(out)
    assert rc == 0, out[-6000:]
    for case in ("kill", "raise"):
        rep = rows[case]["reports"]["0"]
        assert re.search(r"all_reduce call #2: rank 0 timed out waiting for rank 1", rep["error"])
        assert rep["seconds"] <= 15 and rep["usable"] and rep["closed"], rep


def test_fault_matrix_on_one_gpu(tmp_path):
    """A few rows of the fault matrix (scripts/faults.py) with 2 processes sharing GPU 0,
    timeout 5 s: ranks calling other sizes (the one-shot tag), a bad expert id (poison flags),
    NaN/inf inputs (no error): every row passes (the named error where it must be, nothing
    wrong returned silently, the process usable, close() and a new communicator working). The
    whole matrix: scripts/gpu_check.sh faults / faults4."""
    rc, out, rows = fault_matrix(tmp_path, "--platform", "gpu", "-n", "2", "--timeout", "5",
                                 "--cases", "sizes-oneshot", "expert", "nan")
    print(out)
    assert rc == 0, out[-6000:]
    assert len(rows) == 3 and all(r["result"] == "PASS" for r in rows.values()), out[-6000:]
