"""`python -m jax_nvcomm.bench moelayer` runs on CPU devices at small shapes: every row has its
bound and every method's time, the JSON is written, and each nvc method's result equals lax's
(`rel_diff_to_xla`) within bf16 rounding; the routing gives top_k distinct experts per token."""
import json

import numpy as np

from jax_nvcomm.bench import cli
from jax_nvcomm.bench import moelayer as bm


def test_routing_sizes_count_top_k_distinct_experts_per_token():
    rng = np.random.default_rng(0)
    sizes = bm.routing_sizes(rng, 50, 16, 4)
    assert sizes.dtype == np.int32 and sizes.shape == (16,)
    assert sizes.sum() == 200 and sizes.max() <= 50


def test_bench_moelayer_runs_and_agrees_with_lax(tmp_path):
    rc = cli.main(["moelayer", "--hidden", "64", "--ffn", "32", "--experts", "8",
                   "--tokens", "4", "16", "--calls", "2", "--reps", "1", "--device-time", "off",
                   "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "moelayer.json").read_text())
    rows = data["rows"]
    assert {(r["op"], r["tokens"]) for r in rows} == {(o, t) for o in ("gate", "down", "block")
                                                      for t in (4, 16)}
    for r in rows:
        assert r["bound_us"] > 0 and 0 < r["active_experts"] <= 8
        methods = ("nvc", "nvc swiglu", "xla") if r["op"] == "block" else ("nvc", "xla")
        for m in methods:
            assert r[m]["median_us"] > 0, (r["op"], m, r[m])
        for m in methods[:-1]:
            assert r[m]["rel_diff_to_xla"] < 2e-2, (r["op"], m, r[m]["rel_diff_to_xla"])
