"""The error a caller catches names the root cause first: docs/guide.md's bad-input example (rank
2 of 8 CPU devices passes all_gather_v a row count above max_rows, a traced value). Whichever
device's error XLA raises, the exception's first line is rank 2's own record (its row count),
the next line names the other ranks that saw the failure, `e.records` holds every rank's
record (rank 2's first); records handed out that way are not printed again at close() or exit."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from helpers import mesh1d

W, BAD, H = 8, 2, 16
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(nvc.__file__)))


def _gather_total(comm):
    @jax.jit
    @jax.shard_map(mesh=comm.mesh, in_specs=(P("x"), P("x")), out_specs=P())
    def total(h, num_rows):
        return nvc.all_gather_v(h, num_rows[0], comm)[2]
    return total


def _expect_root_first(text, comm, bad_count, max_rows):
    lines = text.splitlines()
    root = (f"jax_nvcomm: all_gather_v call #1: rank {BAD}: rank {BAD}'s row count is "
            f"{bad_count}, outside [0, max_rows={max_rows}]")
    assert root in lines[0], text
    others = ", ".join(str(r) for r in range(W) if r != BAD)
    assert lines[1].startswith(f"seen by ranks {others} (communicator {comm.comm_id};"), text


@pytest.mark.parametrize("attempt", range(4))
def test_caught_error_names_the_bad_rank_first(rng, attempt, capfd):
    max_rows = int(rng.integers(2, 6))
    rows = rng.integers(0, max_rows + 1, size=W).astype(np.int32)
    rows[BAD] = bad_count = int(rng.integers(max_rows + 1, max_rows + 50))
    h = rng.standard_normal((W * max_rows, H)).astype(np.float32)
    comm = nvc.Communicator(mesh1d(W), "x", max_message_bytes=1 << 16, timeout_s=5)
    total = _gather_total(comm)
    with pytest.raises(jax.errors.JaxRuntimeError) as ei:
        jax.block_until_ready(total(h, rows))
    _expect_root_first(str(ei.value).removeprefix("FAILED_PRECONDITION: "), comm, bad_count,
                       max_rows)
    recs = ei.value.records
    assert len(recs) == W and f"rank {BAD}'s row count is {bad_count}" in recs[0], recs
    assert sorted(recs[1:]) == [f"jax_nvcomm: all_gather_v call #1: rank {r}: rank {BAD} failed "
                                "this call (bad input found there)" for r in range(W) if r != BAD]
    # the next call is refused, the root cause first again
    with pytest.raises(jax.errors.JaxRuntimeError) as ei2:
        jax.block_until_ready(total(h, np.minimum(rows, max_rows)))
    text = str(ei2.value).removeprefix("FAILED_PRECONDITION: ")
    _expect_root_first(text, comm, bad_count, max_rows)
    assert "unusable after this error" in text
    with pytest.raises(nvc.CommunicatorError) as ce:
        comm.check()
    _expect_root_first(str(ce.value), comm, bad_count, max_rows)
    assert ce.value.records == recs
    comm.close()
    assert "not read" not in capfd.readouterr().err  # handed out: not printed again


SCRIPT = textwrap.dedent('''
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    import jax_nvcomm as nvc

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("tp",))
    comm = nvc.Communicator(mesh, "tp", timeout_s=5)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=P())
    def total(h, num_rows):
        return nvc.all_gather_v(h, num_rows[0], comm)[2]

    rows = np.full(8, 2, np.int32)
    rows[2] = 5                                  # max_rows is 4
    try:
        jax.block_until_ready(total(np.ones((32, 16), np.float32), rows))
    except jax.errors.JaxRuntimeError as e:
        print("first line:", str(e).splitlines()[0], flush=True)
    if sys.argv[1] == "close":
        comm.close()
''')


@pytest.mark.parametrize("case", ["exit", "close"])
def test_caught_error_is_not_printed_again(tmp_path, case):
    """Run as a user would (a fresh process, JAX_NVCOMM_STRICT=1): the caught error's first line
    is rank 2's record, and nothing is printed on stderr at close() or at exit."""
    script = tmp_path / "caught.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PKG_PARENT, env.get("PYTHONPATH")) if p)
    env["JAX_NVCOMM_STRICT"] = "1"
    p = subprocess.run([sys.executable, str(script), case], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert ("first line: FAILED_PRECONDITION: jax_nvcomm: all_gather_v call #1: rank 2: rank 2's "
            "row count is 5, outside [0, max_rows=4]") in p.stdout, p.stdout
    assert "jax_nvcomm" not in p.stderr, p.stderr
