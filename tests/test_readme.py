"""The README's first ```python block (its quickstart) runs as written, in a fresh process
outside the checkout, on the 8 CPU devices it asks for, and prints what the README says it
prints: the custom call of our fused kernel in the nvc.jit program of a product sharded by type
(the all-reduce XLA would insert, fused with the add and the RMSNorm), the output's sharding as
jax.jit's, agreement with jax.jit of the same code, and explain's account of the all-reduce."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from doc_blocks import ROOT, python_blocks


def test_readme_quickstart_runs_as_written(tmp_path):
    first = python_blocks(ROOT / "README.md")[0]
    assert first.mode == "run"
    script = tmp_path / "quickstart.py"
    script.write_text(first.code)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the block sets its own
    env["JAX_PLATFORMS"] = "cpu"                                     # even on a GPU machine
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "custom calls: ['nvc_all_reduce_rms']" in out.stdout, out.stdout
    assert "all_reduce_rms_norm (oneshot)" in out.stdout, out.stdout           # explain's row
    assert ("1 collectives: 1 on jax_nvcomm's kernels (1 fused with add + RMSNorm), 0 XLA's"
            in out.stdout), out.stdout
    assert "sharding: P('data', None) as jax.jit's: True" in out.stdout, out.stdout
    err = float(re.search(r"max \|ours - xla\|: (\S+)", out.stdout).group(1))
    assert err < 1e-4
    # the README shows this output
    readme = (ROOT / "README.md").read_text()
    for line in out.stdout.splitlines()[:1]:
        assert line in readme, line
    assert "max |ours - xla|: " in readme
