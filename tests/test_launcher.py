"""`python -m jax_nvcomm.launch`: environment, rank prefixes, a failing rank ends the job with its
code, a hung job ends with 124 at the timeout (both quickly, never waiting for the sleepers)."""
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "mp", "launcher_mp.py")


def launch(*args, timeout=120, env_extra=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env_extra or {}))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "jax_nvcomm.launch", *args], env=env,
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def test_environment_and_prefixes():
    rc, out, _ = launch("-n", "3", SCRIPT, "ok")
    assert rc == 0, out
    for r in range(3):
        line = [l for l in out.splitlines() if l.startswith(f"[rank {r}] env")]
        assert line and line[0].split()[3:5] == ["3", str(r)], out
        assert "127.0.0.1:" in line[0]


def test_failing_rank_ends_the_job():
    rc, out, dt = launch("-n", "2", SCRIPT, "fail")
    assert rc == 3, out
    assert "rank 1" in out and dt < 60, (dt, out)


def test_timeout_ends_a_hung_job():
    rc, out, dt = launch("-n", "2", "--timeout", "3", SCRIPT, "hang")
    assert rc == 124, out
    assert dt < 60, dt


def test_safe_path_keeps_the_pythonpath_order(tmp_path):
    """Under PYTHONSAFEPATH (python -P) a rank's sys.path starts with PYTHONPATH, as for
    `python script.py`: the launcher must not overwrite that entry with the script's folder
    (gpu_check.sh relies on it to put a fresh build ahead of a source checkout)."""
    first = tmp_path / "first"
    first.mkdir()
    script = tmp_path / "show_path.py"
    script.write_text("import sys\nprint('PATH0', sys.path[0], flush=True)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONSAFEPATH="1",
               PYTHONPATH=os.pathsep.join([str(first), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "jax_nvcomm.launch", "-n", "2", str(script)],
                       env=env, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stdout + p.stderr
    paths = [l.split()[-1] for l in p.stdout.splitlines() if "PATH0" in l]
    assert paths == [str(first)] * 2, p.stdout
    env.pop("PYTHONSAFEPATH")  # without it: the script's folder first, as `python script.py`
    p = subprocess.run([sys.executable, "-m", "jax_nvcomm.launch", "-n", "2", str(script)],
                       env=env, capture_output=True, text=True, timeout=120, check=False)
    assert [l.split()[-1] for l in p.stdout.splitlines() if "PATH0" in l] == [str(tmp_path)] * 2


def test_cpu_devices_per_rank_is_checked():
    rc, out, dt = launch("-n", "2", SCRIPT, "ok", env_extra={"JAX_NVCOMM_CPU_DEVICES": "two"})
    assert rc == 2 and "JAX_NVCOMM_CPU_DEVICES must be an integer >= 1" in out, out
