"""The layer rows of `bench moelayer` (jax_nvcomm/bench/moelayer_layer.py): the weight-read
bound counts exactly the experts that get a token (the busiest rank's), and a tiny sweep
through the subcommand runs every method on 8 CPU devices with a row per (experts, tokens,
method), whose outputs agree with the layer's."""
import json

import numpy as np

from jax_nvcomm.bench import cli
from jax_nvcomm.bench import moelayer_layer as ml


def test_weight_bound_counts_the_busiest_ranks_used_experts():
    # world 2, 4 local experts: rank 0's experts 0, 1, 3 get tokens, rank 1's expert 5 only
    ids = np.array([[[0, 1], [3, 0]], [[5, 1], [1, 3]]])
    us, active = ml.weight_bound_us(ids, 4, 16, 8, 2, 2, 3.35e12)
    assert active == 3
    assert np.isclose(us, 3 * 3 * 16 * 8 * 2 / 3.35e12 * 1e6)
    # 8-bit weights: one byte an element plus the scales' bytes per expert
    us8, _ = ml.weight_bound_us(ids, 4, 16, 8, 1, 2, 3.35e12, scale_bytes=100)
    assert np.isclose(us8, 3 * (3 * 16 * 8 + 100) / 3.35e12 * 1e6)


def test_tiny_sweep_through_the_subcommand(tmp_path):
    cli.main(["moelayer", "--experts", "2", "--tokens", "4", "--hidden", "256", "--ffn", "128",
              "--top-k", "2", "--calls", "1", "--reps", "1", "--layer-steps", "1",
              "--layer-reps", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "moelayer_layer.json").read_text())["rows"]
    assert sorted(r["method"] for r in rows) == sorted(ml.METHODS)
    for r in rows:
        assert "error" not in r, r
        assert r["median_us"] > 0 and r["bound_us"] > 0 and r["experts"] == 2
        assert r["rel_diff_to_layer"] < 3e-2, r  # bf16: the methods round differently
    # the ragged_dot rows ran first (their file: moelayer.json, or "moelayer" as written now)
    assert (tmp_path / "moelayer.json").exists() or (tmp_path / "moelayer").exists()


def test_tiny_sweep_with_8_bit_weights(tmp_path):
    for kind in ("int8", "fp8"):
        out = tmp_path / kind
        cli.main(["moelayer", "--weights", kind, "--experts", "2", "--tokens", "4", "--hidden",
                  "256", "--ffn", "128", "--top-k", "2", "--calls", "1", "--reps", "1",
                  "--layer-steps", "1", "--layer-reps", "1", "--hbm-bytes-per-s", "1e12",
                  "--out", str(out)])
        rows = json.loads((out / "moelayer_layer.json").read_text())["rows"]
        assert sorted(r["method"] for r in rows) == sorted(ml.METHODS)
        for r in rows:
            assert "error" not in r, r
            assert r["weights"] == kind and r["hbm_bytes_per_s"] == 1e12
            assert r["rel_diff_to_layer"] < 3e-2, r
