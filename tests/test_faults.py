"""The fault matrix on CPU devices (scripts/faults.py, one job per row, the ranks started
directly or through the launcher): a killed, raising or stalled peer, ranks calling other sizes
or ops, a bad expert id, a bad row count, a ragged slice out of range, and NaN/inf inputs (no
error). Every row must pass:
the ranks that must notice do, naming the op, call, rank and peer within the timeout + 5 s,
nothing wrong is returned silently, every live process runs a fresh jitted computation, closes
the communicator, and (when every process is alive) runs a new one. The GPU rows run the same
script on one GPU: tests/gpu/test_gpu_processes.py, scripts/gpu_check.sh faults."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def matrix(tmp_path, *args):
    out = tmp_path / "rows.json"
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "faults.py"),
                        "--timeout", "2", "--json", str(out), *args], env=env,
                       capture_output=True, text=True, timeout=900)
    rows = json.loads(out.read_text()) if out.exists() else []
    return p.returncode, p.stdout + p.stderr, {r["case"]: r for r in rows}


def reports(row):
    return {int(r): rep for r, rep in row["reports"].items()}


@pytest.mark.multiprocess
def test_fault_matrix_two_processes(tmp_path):
    rc, out, rows = matrix(tmp_path, "-n", "2")
    assert rc == 0, out[-6000:]
    assert sorted(rows) == sorted(["kill", "kill-twoshot", "raise", "stall", "ragged-stall",
                                   "sizes-oneshot", "sizes-twoshot", "order", "expert", "rows",
                                   "ragged", "nan"]), out
    # the survivor names the op, its call number, itself and the dead peer, within the deadline
    for case in ("kill", "kill-twoshot", "raise", "stall"):
        rep = reports(rows[case])[0]
        assert "all_reduce call #2: rank 0 timed out waiting for rank 1" in rep["error"], rep
        assert 1.5 < rep["seconds"] < 2 + 5, rep
        assert rep["next"].startswith("refused (call)") and "unusable after this error" in \
            rep["next"], rep
    # a peer stalled in ragged_all_to_all's chunked path: named after one timeout too
    rep = reports(rows["ragged-stall"])[0]
    assert "ragged_all_to_all call #2: rank 0 timed out waiting for rank 1" in rep["error"], rep
    assert 1.5 < rep["seconds"] < 2 + 5 and rep["next"].startswith("refused"), rep
    # the bad rank's own record names token, slot and id; its peer names the bad rank
    exp = reports(rows["expert"])
    assert "topk_ids[1, 0] = 4, outside" in exp[1]["next"], exp[1]
    assert "rank 1 failed this call" in exp[0]["error"], exp[0]
    for case in ("sizes-oneshot", "sizes-twoshot", "order"):
        for rep in reports(rows[case]).values():
            assert "ranks disagree on the op or its sizes" in rep["error"], rep
    nan = reports(rows["nan"])
    assert all(not r["noticed"] and not r["wrong"] for r in nan.values()), nan


@pytest.mark.multiprocess
def test_fault_matrix_four_processes(tmp_path):
    rc, out, rows = matrix(tmp_path, "-n", "4", "--cases", "kill", "raise", "sizes-oneshot",
                           "expert")
    assert rc == 0, out[-6000:]
    for r in range(3):  # every survivor names the dead rank 3
        assert "timed out waiting for rank 3" in reports(rows["kill"])[r]["error"]


@pytest.mark.multiprocess
def test_fault_matrix_through_the_launcher(tmp_path):
    rc, out, rows = matrix(tmp_path, "-n", "2", "--start", "launcher", "--cases", "kill",
                           "stall", "expert")
    assert rc == 0, out[-6000:]
    assert all(r["result"] == "PASS" for r in rows.values()) and len(rows) == 3, out
