"""Multi-process jobs through the launcher (one CPU device per process; two per process in
test_several_devices_per_process)."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(n, script, *args, timeout=600, share_gpu=False, env_extra=None):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS", "cpu") if not share_gpu else ""
    env["PYTHONPATH"] = os.path.join(HERE, "mp") + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "jax_nvcomm.launch", "-n", str(n), "--timeout", str(timeout)]
    if share_gpu:
        cmd.append("--share-gpu")
    cmd += [os.path.join(HERE, "mp", script), *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout + 60)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("n,calls", [(2, 1000), (4, 1000)])
def test_collectives_across_processes(n, calls):
    rc, out = launch(n, "collectives_mp.py", f"--calls={calls}")
    assert rc == 0, out[-4000:]
    assert out.count("PASS") == n, out[-4000:]


@pytest.mark.multiprocess
def test_processes_disagree_on_arguments():
    rc, out = launch(2, "mismatch_mp.py", timeout=120)
    assert rc == 0, out[-4000:]
    assert out.count("GOT ValueError") == 2, out[-4000:]
    assert "max_message_bytes=1048576 in process" in out


@pytest.mark.multiprocess
def test_loop_of_calls_inside_one_program():
    """fori_loop of all-reduce calls in one jitted program (on GPU: a CUDA-graph replay)."""
    rc, out = launch(2, "graph_mp.py", "--iters=50", timeout=300)
    assert rc == 0, out[-4000:]
    assert out.count("PASS") == 2, out[-4000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("n,rounds", [(2, 300), (4, 100)])
def test_moe_across_processes(n, rounds):
    rc, out = launch(n, "moe_mp.py", f"--rounds={rounds}")
    assert rc == 0, out[-4000:]
    assert out.count("PASS") == n, out[-4000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_moe_bounded_slots_across_processes(n):
    """moe_bounded_mp.py: dispatch / combine in rounds (a MoECommunicator bounded by
    max_buffer_bytes), direct calls and a fori_loop, against numpy, in each process."""
    rc, out = launch(n, "moe_bounded_mp.py", "--tokens=256", "--hidden=64", "--iters=4",
                     timeout=300)
    assert rc == 0, out[-4000:]
    assert out.count("moe_bounded_mp PASS") == n, out[-4000:]


@pytest.mark.multiprocess
def test_independent_collectives_across_processes():
    """The 16-independent-collective programs of test_independent.py, 4 processes of one CPU
    device each, 100 runs each (flat and in a loop), every shard against numpy."""
    rc, out = launch(4, "independent_mp.py", "--runs=100", timeout=400)
    assert rc == 0, out[-4000:]
    assert out.count("PASS independent collectives") == 8, out[-4000:]


@pytest.mark.multiprocess
def test_several_devices_per_process():
    """2 processes x 2 CPU devices (the launcher's JAX_NVCOMM_CPU_DEVICES=2): one world of 4
    ranks, two of them in each process; collectives (every dtype, strategy name, 100 calls) and
    MoE dispatch/combine (all its cases, 20 rounds) against float64 numpy."""
    extra = {"JAX_NVCOMM_CPU_DEVICES": "2"}
    for script, args in [("collectives_mp.py", "--calls=100"), ("moe_mp.py", "--rounds=20")]:
        rc, out = launch(2, script, args, timeout=300, env_extra=extra)
        assert rc == 0, out[-4000:]
        assert out.count("layout: 2 processes x 2 devices = world 4") == 2, out[-4000:]
        assert out.count("PASS") == 2, out[-4000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3])
def test_every_process_takes_process_0s_tuning_table(n, tmp_path):
    """Each process names its own tuning file (and the others an override): every process
    chooses with process 0's (explain names its file), and "auto" calls at sizes where the
    files disagree run and are right (tests/mp/tuning_mp.py)."""
    rc, out = launch(n, "tuning_mp.py", "--case=agree", f"--dir={tmp_path}", timeout=180)
    assert rc == 0, out[-4000:]
    assert out.count("PASS tuning table of process 0") == n, out[-4000:]


@pytest.mark.multiprocess
def test_process_0s_bad_tuning_file_fails_every_process(tmp_path):
    rc, out = launch(2, "tuning_mp.py", "--case=bad", f"--dir={tmp_path}", timeout=120)
    assert rc == 0, out[-4000:]
    got = [l for l in out.splitlines() if "GOT" in l]
    assert len(got) == 2, out[-4000:]
    assert any("GOT ValueError" in l and "dtype must be one of" in l for l in got), got
    assert any("GOT RuntimeError: jax_nvcomm: process 0 failed to make process 0's tuning "
               "table: ValueError" in l for l in got), got


@pytest.mark.multiprocess
def test_parity_forms_across_processes():
    """Every op in the forward lax-parity forms on a (dp=2, tp=2) mesh of 4 processes
    (partially manual shard_map, vmap, scan, cond, Explicit axes, set_mesh) against numpy."""
    rc, out = launch(4, "parity_mp.py", timeout=400)
    assert rc == 0, out[-4000:]
    assert out.count("PASS") == 4, out[-4000:]
