"""bench's threshold tuning, on the rows measured on 2 x H200 (docs/bench_h200x2_allreduce.json):
the table serves the plain and the fused op, so --tune takes the smaller crossover of the two."""
import json
import pathlib

from jax_nvcomm import bench

ROWS = json.loads((pathlib.Path(__file__).parents[1] / "docs" /
                   "bench_h200x2_allreduce.json").read_text())["rows"]
PLAIN = set(bench.AR_METHODS)


def test_plain_rows_give_the_plain_crossovers():
    # one-shot wins to its 1 MiB slot; two-shot beats lax.psum up to 32 MiB, loses at 64 MiB
    rows = [r for r in ROWS if r["method"] in PLAIN]
    assert bench.crossovers(rows) == (1 << 20, 32 << 20)


def test_fused_rows_lower_the_two_shot_threshold():
    # the fused two-shot loses to psum + XLA's RMSNorm from 16 MiB (112.0 vs 111.3 us)
    assert bench.crossovers(ROWS) == (1 << 20, 8 << 20)


def test_a_method_missing_at_a_size_counts_as_a_loss():
    rows = [dict(method=m, bytes=b, median_us=us) for m, b, us in [
        ("nvc oneshot", 4096, 5.0), ("nvc twoshot", 4096, 9.0), ("lax.psum", 4096, 8.0),
        ("nvc twoshot", 8192, 9.0), ("lax.psum", 8192, 10.0),          # no one-shot at 8 KiB
        ("nvc twoshot", 16384, 12.0), ("lax.psum", 16384, 11.0)]]
    assert bench.crossovers(rows) == (4096, 8192)


def test_thresholds_source_is_the_strategy_table_format():
    src = bench.thresholds_source({2: (1 << 20, 8 << 20)}, {2: (0, 0), 4: (256 << 10, 32 << 20)})
    ns = {}
    exec(src, ns)  # noqa: S102 - our own generated source
    assert ns["THRESHOLDS"] == {2: (1 << 20, 8 << 20), 4: (256 << 10, 32 << 20)}
