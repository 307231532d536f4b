"""bench's threshold tuning, on the rows measured on 2 x H200 (docs/perf/bench_h200x2_allreduce.json):
the table serves the plain and the fused op, so --tune takes the smaller crossover of the two.
The kernels' device time per call (--device-time): on a synthetic profiler trace, and on CPU."""
import json
import os
import pathlib

import numpy as np
import pytest

from jax_nvcomm.bench import allreduce as bench_ar, cli, common

ROWS = json.loads((pathlib.Path(__file__).parents[1] / "docs" / "perf" /
                   "bench_h200x2_allreduce.json").read_text())["rows"]
PLAIN = set(bench_ar.AR_METHODS)


def test_plain_rows_give_the_plain_crossovers():
    # one-shot wins to its 1 MiB slot; two-shot beats lax.psum up to 32 MiB, loses at 64 MiB
    rows = [r for r in ROWS if r["method"] in PLAIN]
    assert bench_ar.crossovers(rows) == (1 << 20, 32 << 20)


def test_fused_rows_lower_the_two_shot_threshold():
    # the fused two-shot loses to psum + XLA's RMSNorm from 16 MiB (112.0 vs 111.3 us)
    assert bench_ar.crossovers(ROWS) == (1 << 20, 8 << 20)


def test_a_method_missing_at_a_size_counts_as_a_loss():
    rows = [dict(method=m, bytes=b, median_us=us) for m, b, us in [
        ("nvc oneshot", 4096, 5.0), ("nvc twoshot", 4096, 9.0), ("lax.psum", 4096, 8.0),
        ("nvc twoshot", 8192, 9.0), ("lax.psum", 8192, 10.0),          # no one-shot at 8 KiB
        ("nvc twoshot", 16384, 12.0), ("lax.psum", 16384, 11.0)]]
    assert bench_ar.crossovers(rows) == (4096, 8192)


def test_tune_rows_are_tuning_file_rows():
    from jax_nvcomm import tuning
    rows = bench_ar.tuning_rows({2: (1 << 20, 8 << 20), 4: (256 << 10, 32 << 20)})
    parsed = tuning.parse_rows(rows, "bench --tune")
    assert [(r.world_size, r.oneshot_max_bytes, r.twoshot_max_bytes) for r in parsed] == [
        (2, 1 << 20, 8 << 20), (4, 256 << 10, 32 << 20)]
    assert tuning.pick(parsed, 2, "all_reduce_rms_norm", "bfloat16").twoshot_max_bytes == 8 << 20


# ---- kernels' device time per call from a profiler trace (_trace.device_time, --device-time)

LONG = "void kernel_b<" + "x" * 90 + ">"  # longer than the table's 60 characters


def _write_trace(path, host_names=None, kernels=True):
    """A small Perfetto trace as jax.profiler writes it (gzip'd JSON): two executions of
    jit_f on device 0 (and one on device 1), kernels on GPU:0 and GPU:1."""
    import gzip
    host_names = host_names or ["[0] PjRtStreamExecutorLoadedExecutable::Execute(jit_f)"] * 2
    ev = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:1"}},
          {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}}]

    def x(pid, name, ts, dur, tid=1):
        ev.append({"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur})
    x(7, host_names[0], 0, 50)
    x(7, host_names[1], 100, 50)
    x(7, "[1] PjRtStreamExecutorLoadedExecutable::Execute(jit_f)", 100, 50, tid=2)
    x(7, "cuGraphLaunch", 105, 3)
    # GPU:0: the first execution's kernels (40 + 30 us: not counted), then the last one's:
    # kernel_a 5 + 7 us, kernel_b 6 us = 18 us in 3 kernels
    for ts, name, dur in ((10, "kernel_a", 40), (20, LONG, 30), (110, "kernel_a", 5),
                          (120, "kernel_a", 7), (130, LONG, 6)):
        if kernels:
            x(1, name, ts, dur)
    x(2, "kernel_a", 115, 1000)  # device 1: not counted
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return str(path)


def test_device_time_is_device_0s_kernels_in_the_last_execution(tmp_path):
    from jax_nvcomm import _trace
    s = _trace.device_time(_write_trace(tmp_path / "t.json.gz"))
    assert s["program"] == "jit_f" and s["executions"] == 2
    assert s["busy_us"] == 18.0 and s["kernels"] == 3
    assert s["top"] == [dict(name="kernel_a", count=2, us=12.0),
                        dict(name=LONG[:80], count=1, us=6.0)]


def test_device_skew_against_device_0(tmp_path):
    """Device 1 in the same executions as device 0: its first kernel 5 us after device 0's
    (115 vs 110), its last one ending 979 us later (1115 vs 136); the first execution has no
    device-1 kernel, so only the second counts."""
    from jax_nvcomm import _trace
    skew = _trace.device_skew(_write_trace(tmp_path / "t.json.gz"), [0, 1])
    assert skew == {1: dict(first_us=5.0, end_us=979.0, busy_us=1000.0)}
    assert _trace.device_skew(_write_trace(tmp_path / "n.json.gz", host_names=[
        "ExecutePrepare", "ExecutePrepare"]), [0, 1]) is None


def test_device_time_without_device_kernels_or_executions(tmp_path):
    from jax_nvcomm import _trace
    p = _write_trace(tmp_path / "t.json.gz", kernels=False)  # none on GPU:0 (as on CPU)
    assert _trace.device_time(p) == dict(program="jit_f", executions=2, busy_us=None,
                                         kernels=0, top=[])
    # the CPU client's names carry no "(program)": no execution, no crash
    p = _write_trace(tmp_path / "cpu.json.gz",
                     ["CommonPjRtLoadedExecutable::ExecutePrepare"] * 2)
    assert _trace.device_time(p) is None


class _Env:
    def __init__(self, is_main=True):
        import jax
        self.jax, self.is_main = jax, is_main


def _counting_fn():
    runs = []

    def fn(v):
        runs.append(v)
        return np.zeros(1)
    return fn, runs


def test_device_time_per_call_from_the_trace(tmp_path, monkeypatch):
    import tempfile
    from jax_nvcomm import _trace
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = []

    def record(fn, args, out_dir, steps):
        for _ in range(steps):
            fn(*args)
        made.append(out_dir)
        return _write_trace(os.path.join(out_dir, "perfetto_trace.json.gz"))
    monkeypatch.setattr(_trace, "record", record)
    fn, runs = _counting_fn()
    out = common._device_time(_Env(), fn, (1,), calls=9)
    assert len(runs) == 2 and len(made) == 1
    assert out["device_us"] == 2.0 and out["device_kernels_per_call"] == 0.333
    assert [t["name"] for t in out["device_top"]] == ["kernel_a", LONG[:60]]
    assert "device_note" not in out and out["op_device_us"] is None  # no nvc:: kernel
    assert not os.path.exists(made[0])  # the trace directory is deleted
    row = dict(method="m", median_us=12.34, p10_us=11.9, p90_us=13.0, **out)
    assert common._cell(row) == "12.3 (11.9-13.0) d2.0"
    assert common._cell(dict(row, device_us=None)) == "12.3 (11.9-13.0)"


def test_op_device_time_is_our_kernels_only(tmp_path, monkeypatch):
    """op_device_us sums the kernels in namespace nvc:: (not the loop's copies): 9 + 3 us
    over 4 calls."""
    from jax_nvcomm import _trace
    monkeypatch.setattr(_trace, "record", lambda fn, args, d, steps: [fn(*args) for _ in
                                                                    range(steps)] and "p")
    top = [dict(name="void nvc::dev::oneshot_kernel<bf16>", count=4, us=9.0),
           dict(name="copy_fusion", count=8, us=5.0),
           dict(name="void nvc::moe::combine_recv_kernel<1>", count=4, us=3.0)]
    monkeypatch.setattr(_trace, "device_time", lambda path, device=0: dict(
        program="p", executions=2, busy_us=17.0, kernels=16, top=top))
    fn, runs = _counting_fn()
    out = common._device_time(_Env(), fn, (1,), calls=4)
    assert out["device_us"] == 4.25 and out["op_device_us"] == 3.0 and len(runs) == 2


def test_device_time_other_processes_and_failures(tmp_path, monkeypatch):
    import tempfile
    from jax_nvcomm import _trace
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    calls = []
    monkeypatch.setattr(_trace, "record", lambda *a, **k: calls.append(a))
    fn, runs = _counting_fn()
    # not process 0: the same 2 runs (collectives), no trace
    out = common._device_time(_Env(is_main=False), fn, (1,), calls=9)
    assert len(runs) == 2 and not calls and out["device_us"] is None

    def broken(fn, args, out_dir, steps):
        fn(*args)
        raise RuntimeError("profiler broke\nmore")
    monkeypatch.setattr(_trace, "record", broken)
    fn, runs = _counting_fn()
    out = common._device_time(_Env(), fn, (1,), calls=9)
    assert len(runs) == 2  # the run the profiler missed is made up
    assert out["device_us"] is None and out["device_note"] == (
        "trace failed: RuntimeError: profiler broke")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mode", ["on", "off"])
def test_bench_allreduce_device_time_on_cpu(tmp_path, monkeypatch, capsys, mode):
    """`bench allreduce --quick --device-time on|off` on 8 CPU devices (one 4 KiB shape):
    on: each measured row traced, device_us None (no GPU kernels); off: no trace at all."""
    import tempfile
    from jax_nvcomm import _trace
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    traced = []
    real = _trace.record

    def record(*a, **k):
        traced.append(1)
        return real(*a, **k)
    monkeypatch.setattr(_trace, "record", record)
    rc = cli.main(["allreduce", "--quick", "--hidden", "512", "--max-bytes", "4096",
                     "--reps", "1", "--unroll", "1", "--steps", "1", "--device-time", mode,
                     "--out", str(tmp_path / "out")])
    assert rc == 0
    data = json.loads((tmp_path / "out" / "allreduce.json").read_text())
    # measured rows; the "<XLA method> best" rows are copies of XLA's default on CPU devices
    rows = [r for r in data["rows"] if "median_us" in r and "xla_variants" not in r]
    assert rows
    best = {r["method"]: r for r in data["rows"] if "xla_variants" in r}
    for m, b in bench_ar.BEST.items():
        base = next(r for r in rows if r["method"] == m and r["bytes"] == 4096)
        assert best[b]["median_us"] == base["median_us"] and best[b]["xla_flags"] == "default"
        assert "CPU devices" in best[b]["xla_best_note"]
    assert data["meta"]["xla_best"]["enabled"] is False
    text = capsys.readouterr().out
    assert "lax.psum best" in text and "XLA best: CPU devices" in text
    if mode == "on":
        assert len(traced) == len(rows)
        assert all(r["device_us"] is None and r["device_note"] for r in rows), rows
        assert "dN = kernels' device time per call" in text
    else:
        assert not traced
        assert not any("device_us" in r or "device_note" in r for r in rows)
        assert "dN" not in text
    assert os.listdir(tmp_path / "tmp") == []  # no trace left behind
