"""`python -m jax_nvcomm.bench compile` runs on 8 CPU devices and reports, per model, dtype and
phase, both compile times and their ratio (the numbers mean nothing here; the rows do)."""
import json

import pytest

from jax_nvcomm.bench import cli


def test_bench_compile_rows(tmp_path, capsys):
    out = tmp_path / "compile.json"
    rc = cli.main(["compile", "--reps", "1", "--layers", "1", "--hidden", "256",
                   "--styles", "sglang", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["dtype"], r["phase"]) for r in rows) == sorted(
        (d, p) for d in ("float32", "bfloat16") for p in ("decode", "prefill"))
    for r in rows:
        assert r["jax_jit_ms"] > 0 and r["nvc_jit_ms"] > 0, r
        assert r["ratio"] == pytest.approx(r["nvc_jit_ms"] / r["jax_jit_ms"])
    assert "worst ratio nvc.jit / jax.jit" in capsys.readouterr().out
