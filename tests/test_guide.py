"""docs/guide.md's code runs: its ```python blocks, top to bottom in one process on 8 CPU
devices (as the guide says they run), each printing what it checks; the launcher script block
in a 2-process job on CPU devices. Blocks that cannot run here are marked with a reason, and
there are few of them."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from doc_blocks import ROOT, python_blocks

GUIDE = ROOT / "docs" / "guide.md"
HERE = Path(__file__).resolve().parent
BLOCKS = python_blocks(GUIDE)


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the guide sets its own
    env["JAX_PLATFORMS"] = "cpu"
    return env


def test_guide_blocks_run_in_order_on_8_cpu_devices():
    out = subprocess.run([sys.executable, str(HERE / "doc_blocks.py"), str(GUIDE)],
                         capture_output=True, text=True, cwd=HERE, env=_env(), timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-6000:]
    text = out.stdout
    ran = sum(b.mode == "run" for b in BLOCKS)
    assert text.count("--- guide.md:") == ran
    # what each block prints it checked
    assert "2-D mesh, groups of 4 | backend host | equal: True" in text
    for label in ("TP layer: relative difference", "MoE layer: relative difference",
                  "moe_layer: relative difference",
                  "DP -> TP: total rows", "gradient: relative difference",
                  "partial-manual TP layer: relative difference",
                  "vmap over 4 micro-batches: 1 kernel call | relative difference"):
        err = float(re.search(re.escape(label) + r"[^\n]*?(\d\.\d+e[-+]\d+)", text).group(1))
        assert err < 1e-4, (label, text)
    assert "other rows zero: True" in text
    assert "bitwise equal to the fused calls': True" in text
    assert "ragged_all_to_all: equal to the exchange done in numpy: True" in text
    assert "FP8 output: float8_e4m3fn" in text
    assert re.search(r"^oneshot: all_reduce_rms_norm \(8, 256\) float32", text, re.M), text
    assert "error: jax_nvcomm: all_reduce: x must be" in text
    # a failure found on the device: named at the call (CPU devices), refused after, check()
    # the root cause first, whichever rank's error XLA raises
    assert re.search(r"^failed call: JaxRuntimeError FAILED_PRECONDITION: jax_nvcomm: "
                     r"all_gather_v call #1: rank 2: rank 2's row count is 17", text, re.M), text
    assert "next call refused: True" in text
    assert ("comm.check(): 8 records; jax_nvcomm: all_gather_v call #1: rank 2: rank 2's row "
            "count is 17, outside [0, max_rows=16]") in text, text
    assert "new communicator: total rows 30 | equal to the counts' sum: True" in text
    assert "Warning" not in out.stderr, out.stderr[-4000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mode == "launch"],
                         ids=lambda b: f"guide.md:{b.line}")
def test_guide_launcher_script_runs_in_a_multiprocess_job(block, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(block.code)
    env = _env()
    env.pop("JAX_PLATFORMS")  # the launcher gives each rank one CPU device on this machine
    out = subprocess.run([sys.executable, "-m", "jax_nvcomm.launch", "-n", block.arg,
                          "--timeout", "240", str(script)], capture_output=True, text=True,
                         cwd=HERE, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert f"{block.arg} processes: all_reduce == the sum of all rows: True" in out.stdout


def test_guide_skips_few_blocks_and_says_why():
    skipped = [b for b in BLOCKS if b.mode == "skip"]
    assert len(skipped) <= 2, [b.line for b in skipped]
    for b in skipped:
        assert len(b.arg) > 20, f"guide.md:{b.line}: the skip needs a reason"
    assert sum(b.mode == "run" for b in BLOCKS) >= 8


def test_guide_lists_every_environment_variable_the_code_reads():
    """Every JAX_NVCOMM_* name in the package, its C++ sources, the build and the scripts has a
    row in the guide's table of environment variables."""
    text = GUIDE.read_text()
    table = text[text.index("## Environment variables"):]
    table = table[:table.index("\n## ", 1)]
    files = [ROOT / "CMakeLists.txt"]
    for folder, pattern in (("jax_nvcomm", "*.py"), ("csrc", "*.*"), ("scripts", "*.sh")):
        files += (ROOT / folder).rglob(pattern)
    names = {n for f in files for n in re.findall(r"JAX_NVCOMM_[A-Z0-9_]*[A-Z0-9]", f.read_text())}
    assert len(names) > 15
    missing = sorted(n for n in names if f"`{n}`" not in table)
    assert not missing, f"not in docs/guide.md's environment table: {missing}"
