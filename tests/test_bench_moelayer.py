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


def test_bench_moelayer_8_bit_weights(tmp_path):
    """--weights int8 / fp8: the bound counts one byte an element plus the scales' float32 bytes
    at the given bandwidth; nvc's results agree with XLA's on the same weights."""
    for kind, scale_bytes in (("int8", lambda k, n: 4 * n),
                              ("fp8", lambda k, n: 4 * -(-k // 128) * -(-n // 128))):
        out = tmp_path / kind
        rc = cli.main(["moelayer", "--weights", kind, "--hidden", "256", "--ffn", "192",
                       "--experts", "4", "--tokens", "4", "--calls", "1", "--reps", "1",
                       "--device-time", "off", "--layer-rows", "off",
                       "--hbm-bytes-per-s", "2e12", "--out", str(out)])
        assert rc == 0
        data = json.loads((out / "moelayer.json").read_text())
        assert data["weights"] == kind and data["hbm_bytes_per_s"] == 2e12
        for r in data["rows"]:
            mats = {"gate": [(256, 192)], "down": [(192, 256)],
                    "block": [(256, 192)] * 2 + [(192, 256)]}[r["op"]]
            want = sum(r["active_experts"] * (k * n + scale_bytes(k, n)) for k, n in mats)
            assert np.isclose(r["bound_us"], round(want / 2e12 * 1e6, 2))
            methods = ("nvc", "nvc swiglu", "xla") if r["op"] == "block" else ("nvc", "xla")
            for m in methods:
                assert "error" not in r[m], (kind, r["op"], m, r[m])
            for m in methods[:-1]:
                assert r[m]["rel_diff_to_xla"] < 2e-2, (kind, r["op"], m)


def test_hbm_table_by_device_name():
    from jax_nvcomm.topology import hbm
    assert hbm.from_table("NVIDIA H100 80GB HBM3")[0] == 3.35e12
    assert hbm.from_table("NVIDIA H100 PCIe")[0] == 2.0e12
    assert hbm.from_table("NVIDIA H200")[0] == 4.8e12
    assert hbm.from_table("NVIDIA B200")[0] == 8.0e12
    assert hbm.from_table("NVIDIA A100-SXM4-80GB") is None
    assert hbm.peak_bytes_per_s(None, 1.5e12) == (1.5e12, "--hbm-bytes-per-s")
