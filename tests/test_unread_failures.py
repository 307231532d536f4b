"""No silent failures: a call that fails on the device (here: ranks whose ragged_all_to_all sizes
disagree, on 8 CPU devices) while nobody reads its result is reported on stderr once, with the
record's text, at the first of: the next call on that communicator (or the tracing of a program
that uses it), its close(), the process's exit; a record read through check() is not printed; a
compiled program run after close() says so instead of failing without a word. Each case runs as
a script in a fresh process, as a user would, and reads its stderr."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import jax_nvcomm

# the package this test run imports (an install, or a checkout built in place)
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(jax_nvcomm.__file__)))

SCRIPT = textwrap.dedent('''
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    import jax_nvcomm as nvc

    W = 8
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:W]), ("x",))
    comm = nvc.Communicator(mesh, "x", max_message_bytes=1 << 16, timeout_s=5)

    def f(x, out, io, ss, oo, rs):
        return nvc.ragged_all_to_all(x[0], out[0], io[0], ss[0], oo[0], rs[0], comm)[None]
    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))

    # every rank sends row d of its operand to rank d, which puts it at row s
    ranks = np.arange(W, dtype=np.int32)
    io = np.tile(ranks, (W, 1))
    ss = np.ones((W, W), np.int32)
    oo = np.tile(ranks[:, None], (1, W))
    rs = np.ones((W, W), np.int32)
    case = sys.argv[1]
    if case != "good":
        rs[0, 1] = 2          # rank 0 expects two rows from rank 1, which sends one
    x = np.random.default_rng(0).standard_normal((W, W, 4)).astype(np.float32)
    out = np.zeros((W, W, 4), np.float32)
    y = step(x, out, io, ss, oo, rs)
    print("shape", y.shape, flush=True)        # reads nothing: the call may have failed
    if case == "next":
        jax.block_until_ready(x)
        import time; time.sleep(1)
        z = step(x, out, io, ss, oo, rs)       # refused: the earlier failure is printed here
        print("second call made", flush=True)
        time.sleep(1)
        print("after the second call", flush=True)
    elif case in ("close", "after_close"):
        import time; time.sleep(1)
        comm.close()
        print("closed", flush=True)
        if case == "after_close":
            w = step(x, out, io, ss, oo, rs)   # the compiled program, run after close()
            time.sleep(1)
            print("after the call", flush=True)
    elif case == "retrace":
        import time; time.sleep(1)
        again = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
        again.lower(x, out, io, ss, oo, rs)   # traced, never run
        print("traced", flush=True)
    elif case == "checked":
        import time; time.sleep(1)
        try:
            comm.check()
        except nvc.CommunicatorError as e:
            print("check raised:", str(e).splitlines()[0], flush=True)
        comm.close()
''')

RECORD = "ragged_all_to_all call #1: rank 0: rank 1 sends 1 rows"
HEADER = "failed in a call whose result was not read"


def _run(tmp_path, case, **extra_env):
    script = tmp_path / "unread.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NVCOMM_STRICT")}
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PKG_PARENT, env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, str(script), case], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300)
    return p


def test_good_calls_print_nothing(tmp_path):
    p = _run(tmp_path, "good")
    assert p.returncode == 0, p.stderr
    assert "jax_nvcomm" not in p.stderr, p.stderr


def test_unread_failure_is_reported_at_exit(tmp_path):
    p = _run(tmp_path, "unread")
    assert p.returncode == 0, p.stderr
    assert "shape (8, 8, 4)" in p.stdout
    assert p.stderr.count(HEADER) == 1, p.stderr
    assert RECORD in p.stderr and "expects 2" in p.stderr, p.stderr
    assert "(reported at exit)" in p.stderr, p.stderr


def test_unread_failure_is_reported_at_the_next_call(tmp_path):
    p = _run(tmp_path, "next")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("failed in an earlier call whose result was not read") == 1, p.stderr
    assert RECORD in p.stderr, p.stderr
    assert HEADER not in p.stderr, p.stderr   # not again at exit


def test_unread_failure_is_reported_at_close(tmp_path):
    p = _run(tmp_path, "close")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count(HEADER) == 1 and "(reported at close())" in p.stderr, p.stderr
    assert RECORD in p.stderr, p.stderr


def test_compiled_program_after_close_says_so(tmp_path):
    p = _run(tmp_path, "after_close")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("which is closed") == 1, p.stderr
    assert p.stderr.count(HEADER) == 1, p.stderr    # the failure itself, once, at close()


def test_a_record_read_by_check_is_not_printed(tmp_path):
    p = _run(tmp_path, "checked")
    assert p.returncode == 0, p.stderr
    assert "check raised: " in p.stdout and RECORD in p.stdout, p.stdout
    assert "jax_nvcomm" not in p.stderr, p.stderr


def test_unread_failure_is_reported_while_tracing_the_next_program(tmp_path):
    p = _run(tmp_path, "retrace")
    assert p.returncode == 0, p.stderr
    assert p.stderr.count(HEADER) == 1 and "(reported while tracing" in p.stderr, p.stderr
    assert RECORD in p.stderr, p.stderr


def test_strict_makes_an_unread_failure_exit_nonzero(tmp_path):
    p = _run(tmp_path, "unread", JAX_NVCOMM_STRICT="1")
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "shape (8, 8, 4)" in p.stdout
    assert p.stderr.count(HEADER) == 1 and RECORD in p.stderr, p.stderr
    assert "JAX_NVCOMM_STRICT=1: exiting with status 1" in p.stderr, p.stderr


@pytest.mark.parametrize("case", ["next", "close"])
def test_strict_counts_a_failure_reported_before_exit(tmp_path, case):
    p = _run(tmp_path, case, JAX_NVCOMM_STRICT="1")
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "JAX_NVCOMM_STRICT=1: exiting with status 1" in p.stderr, p.stderr


@pytest.mark.parametrize("case", ["good", "checked"])
def test_strict_leaves_other_exits_alone(tmp_path, case):
    """Good calls, a failure read through check(): status 0 with JAX_NVCOMM_STRICT=1."""
    p = _run(tmp_path, case, JAX_NVCOMM_STRICT="1")
    assert p.returncode == 0, (p.returncode, p.stderr)
    assert "JAX_NVCOMM_STRICT" not in p.stderr, p.stderr
