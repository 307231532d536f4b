"""`python -m jax_nvcomm.tune` (jax_nvcomm/tune.py) on 8 CPU devices: it writes a valid tuning
file marked as CPU that a Communicator of this machine then takes from the cache; it refuses
ranks sharing a GPU; its rules (world-1 crossover, adopting rows into the built-in table) on
synthetic measurements. And the "XLA best" machinery (bench/xla_best.py): which flags this
XLA accepts, and the choice of the fastest variant."""
import json
import shutil

import jax
import jax.numpy as jnp
import pytest

import jax_nvcomm as nvc
from jax_nvcomm import tune, tuning
from jax_nvcomm.bench import xla_best
from helpers import mesh1d


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for var in (tuning.ENV_FILE, "JAX_NVCOMM_SHARE_GPU", *tuning.ENV_OVERRIDES.values()):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(tuning.ENV_CACHE_DIR, str(tmp_path / "cache"))
    return monkeypatch


def test_quick_tune_on_cpu_writes_a_file_the_cache_then_serves(clean_env, tmp_path, capsys):
    out = tmp_path / "t" / "tuning.json"
    rc = tune.main(["--quick", "--worlds", "1", "2", "--max-bytes", "8192", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    checked = tuning.load(str(out))  # valid
    m = doc["machine"]
    assert m["platform"] == "cpu" and "CPU devices" in doc["note"] and doc["complete"]
    assert tuning.mismatch(m, tuning.fingerprint(jax.local_devices())) == []
    assert m["tuned_worlds"] == [1, 2]
    keys = {(r.world_size, r.op, r.dtype) for r in checked["rows"]}
    assert keys == {(w, op, "bfloat16") for w in (1, 2) for op in tuning.OPS}
    w1 = {r.op: r for r in checked["rows"] if r.world_size == 1}
    assert w1["all_reduce"].local_min_bytes is None  # psum over one device: XLA always
    # every row comes from measurements that are in the file
    meas = doc["measurements"]
    for r in checked["rows"]:
        if (r.world_size, r.op) != (1, "all_reduce"):
            got = {x["bytes"] for x in meas if (x["world"], x["op"]) == (r.world_size, r.op)
                   and "median_us" in x}
            assert got == {4096, 8192}, (r, got)
    assert (tmp_path / "t" / "tuning.png").exists()
    text = capsys.readouterr().out
    assert "[1/" in text and "## tuning rows" in text and "--adopt" in text
    # the cache file of this machine: a communicator takes its rows
    cache = tmp_path / "cache" / "tuning.json"
    cache.parent.mkdir(parents=True)
    shutil.copy(out, cache)
    two = next(r for r in checked["rows"] if (r.world_size, r.op) == (2, "all_reduce"))
    with nvc.Communicator(mesh1d(2), "x", max_message_bytes=1 << 20) as c:
        assert c.tuning.source == "cache"
        why = nvc.select_strategy(c, (1, 2048), jnp.bfloat16, explain=True)
        assert why.source.startswith(f"tuning cache {cache}")
        assert why.thresholds["oneshot_max_bytes"] == two.oneshot_max_bytes
        assert why.thresholds["twoshot_max_bytes"] == two.twoshot_max_bytes


def test_refuses_ranks_sharing_a_gpu(clean_env, tmp_path, capsys):
    clean_env.setenv("JAX_NVCOMM_SHARE_GPU", "1")
    out = tmp_path / "t.json"
    assert tune.main(["--quick", "--out", str(out)]) == 2
    assert "refusing to tune: JAX_NVCOMM_SHARE_GPU=1" in capsys.readouterr().out
    assert not out.exists()
    assert tune.duplicated({0: ["a", "b"], 1: ["c"], 2: ["a"]}) == ["GPU a in processes 0, 2"]
    assert tune.duplicated({0: ["a"], 1: ["b"]}) == []


def test_world_1_crossover_rule():
    by = {4096: {"ours": 3.5, "xla": 2.5}, 8192: {"ours": 3.6, "xla": 3.7},
          16384: {"ours": 3.9, "xla": 3.8}, 32768: {"ours": 4.0, "xla": 5.0},
          65536: {"ours": 6.0, "xla": 9.0}}
    assert tune.local_min(by, "ours", "xla") == 32768  # wins at 8 KiB, loses at 16: not then
    by[32768]["ours"] = 4.9  # ahead by 2%: inside the noise, no win
    assert tune.local_min(by, "ours", "xla") == 65536
    assert tune.local_min(by, "ours", "xla", margin=0.0) == 32768
    by[65536]["ours"] = 9.5
    assert tune.local_min(by, "ours", "xla") is None    # loses at the largest size
    assert tune.local_min({4096: {"xla": 1.0}}, "ours", "xla") is None  # ours not measured


def test_each_finished_group_is_handed_over(monkeypatch):
    """measure() calls done(rows, points) after each (world, op, dtype) group, so that a run
    stopped half-way leaves a file of the finished groups (bf16 of every op first)."""
    from jax_nvcomm.bench import allreduce as bench_ar, common

    class Comm:
        def close(self):
            pass

    class Env:
        def mesh(self, w):
            return w

        def log(self, *a):
            pass
    seen = []

    def fake_point(env, comm, mesh, hidden, tokens, a, methods, dtype, quiet):
        if dtype == "float32":
            raise KeyboardInterrupt  # stopped in the third group
        return [dict(method=m, bytes=tokens * hidden * 2, world=mesh, dtype=dtype,
                     median_us=1.0) for m in sorted(methods)]
    monkeypatch.setattr(bench_ar, "_ar_point", fake_point)
    monkeypatch.setattr(common, "_open_comm", lambda env, mesh, b: Comm())
    a = type("A", (), dict(worlds=[1], ops=["all_reduce_rms_norm"], dtypes=[
        "bfloat16", "float16", "float32"], min_bytes=4096, max_bytes=8192, factor=2))()
    points = tune.plan(None, a)
    assert [p[2] for p in points] == ["bfloat16"] * 2 + ["float16"] * 2 + ["float32"] * 2
    with pytest.raises(KeyboardInterrupt):
        tune.measure(Env(), a, points, None,
                     done=lambda rows, pts: seen.append((len(rows), pts)))
    assert [len(p) for _, p in seen] == [2, 4] and [n for n, _ in seen] == [4, 8]
    rows = tune.table_rows([], seen[-1][1], "xla")  # the finished groups' rows only
    assert {(r["op"], r["dtype"]) for r in rows} == {
        (op, dt) for op in ("all_reduce", "all_reduce_rms_norm")
        for dt in ("bfloat16", "float16")}


def test_table_rows_from_measurements():
    def m(w, op, method, b, us):
        return dict(world=w, op=op, dtype="bfloat16", bytes=b, method=method, median_us=us)
    meas = [m(2, "all_reduce", "nvc oneshot", 4096, 5.0), m(2, "all_reduce", "nvc twoshot",
                                                             4096, 8.0),
            m(2, "all_reduce", "lax.psum", 4096, 20.0), m(2, "all_reduce", "nvc twoshot",
                                                          8192, 9.0),
            m(2, "all_reduce", "lax.psum", 8192, 21.0), m(2, "all_reduce", "nvc twoshot",
                                                          16384, 30.0),
            m(2, "all_reduce", "lax.psum", 16384, 22.0),
            m(1, "all_reduce_rms_norm", "nvc fused twoshot", 4096, 6.0),
            m(1, "all_reduce_rms_norm", "psum+rmsnorm", 4096, 3.0),
            m(1, "all_reduce_rms_norm", "nvc fused twoshot", 8192, 6.0),
            m(1, "all_reduce_rms_norm", "psum+rmsnorm", 8192, 7.0)]
    points = [(2, "all_reduce", "bfloat16", b) for b in (4096, 8192, 16384)] + [
        (1, "all_reduce_rms_norm", "bfloat16", b) for b in (4096, 8192)]
    rows = {(r["world_size"], r["op"]): r for r in tune.table_rows(meas, points, "xla")}
    assert (rows[(2, "all_reduce")]["oneshot_max_bytes"],
            rows[(2, "all_reduce")]["twoshot_max_bytes"]) == (4096, 8192)
    assert rows[(1, "all_reduce_rms_norm")]["local_min_bytes"] == 8192
    assert rows[(1, "all_reduce")]["local_min_bytes"] is None
    assert tuning.parse_rows([{k: v for k, v in r.items() if k != "note"}
                              for r in rows.values()], "t")
    text = tune.format_summary(list(rows.values()))
    assert "8 KiB" in text and "never" in text


def test_adopt_puts_measured_world_1_rows_into_a_table(tmp_path):
    into = tmp_path / "builtin.json"
    shutil.copy(tuning._BUILTIN_FILE, into)
    measured = tmp_path / "m.json"
    measured.write_text(json.dumps(dict(
        format=tuning.FORMAT, created="2026-12-02T00:00:00+00:00",
        machine=dict(platform="gpu", device_kind="NVIDIA H200", device_count=1, link="unknown",
                     driver="580.95.05", jax="0.11.2"),
        allreduce=[dict(world_size=1, op="all_reduce_rms_norm", dtype="bfloat16",
                        oneshot_max_bytes=0, twoshot_max_bytes=0, local_min_bytes=1 << 20,
                        note="vs psum+rmsnorm"),
                   dict(world_size=1, op="all_reduce_rms_norm", dtype="float32",
                        oneshot_max_bytes=0, twoshot_max_bytes=0, local_min_bytes=4 << 20),
                   dict(world_size=2, op="all_reduce", dtype="bfloat16", oneshot_max_bytes=1,
                        twoshot_max_bytes=2)])))
    before = tuning.validate(json.loads(into.read_text()), "b")["rows"]
    assert tune.main(["--adopt", str(measured), "--worlds", "1", "--into", str(into)]) == 0
    doc = json.loads(into.read_text())
    rows = tuning.validate(doc, "after")["rows"]
    assert tuning.pick(rows, 1, "all_reduce_rms_norm", "bfloat16").local_min_bytes == 1 << 20
    assert tuning.pick(rows, 1, "all_reduce_rms_norm", "float32").local_min_bytes == 4 << 20
    assert tuning.pick(rows, 1, "all_reduce", "bfloat16").local_min_bytes is None
    # world 2 was not asked for: the table's world-2 row stays
    assert tuning.pick(rows, 2, "all_reduce", "bfloat16") == tuning.pick(
        before, 2, "all_reduce", "bfloat16")
    assert len(rows) == len(before) + 1  # bf16 replaced, f32 added
    note = next(r for r in doc["allreduce"] if r["dtype"] == "float32")["note"]
    assert "1 x NVIDIA H200" in note[0] and "2026-12-02" in note[0]
    cpu = json.loads(measured.read_text())
    cpu["machine"]["platform"] = "cpu"
    measured.write_text(json.dumps(cpu))
    with pytest.raises(ValueError, match="measured on CPU devices"):
        tune.adopt(str(measured), str(into), {1})


# ---------------------------------------------------------------- XLA best (bench/xla_best.py)

def test_flag_discovery_against_this_xla(monkeypatch):
    """The candidates' names are asked of the installed XLA (compile options are one
    DebugOptions for every backend, so the CPU client answers for the names); a name XLA does
    not know is reported as such, and the deprecated alias is folded into its successor."""
    bogus = xla_best.Flag("bogus", (("xla_gpu_no_such_flag_here", True),),
                          frozenset({"all-reduce"}), "test")
    monkeypatch.setattr(xla_best, "CANDIDATES", xla_best.CANDIDATES + (bogus,))
    monkeypatch.setattr(xla_best, "_found", {})
    got = xla_best.available("gpu")
    assert got["bogus"] == "not in this XLA"
    # both jax 0.11.2 and 0.12 know the collective-kernel filter and symmetric buffers
    assert got["collective-kernels"] == "ok" and got["nccl-symmetric"] == "ok"
    assert got["one-shot-ar"].startswith("same as collective-kernels")
    assert set(xla_best.available("cpu").values()) == {
        "CPU devices: XLA's GPU collective flags do not apply"}


class _Env:
    def __init__(self, platform):
        self.platform = platform


def test_best_takes_the_fastest_variant_of_the_programs_collectives(monkeypatch):
    ok = {f.label: "ok" for f in xla_best.CANDIDATES}
    ok["one-shot-ar"] = "same as collective-kernels in this XLA: not tried separately"
    monkeypatch.setattr(xla_best, "_found", {"gpu": ok})
    times = {(): 10.0, (("xla_gpu_experimental_use_collective_kernels",
                          "COLLECTIVE_KERNEL_ALL_REDUCE"),): 7.0,
             (("xla_gpu_experimental_enable_nccl_symmetric_buffers", True),): 12.0}
    asked = []

    def measure(opts):
        key = tuple(sorted((opts or {}).items()))
        asked.append(key)
        if key not in times:  # all of them together
            return dict(median_us=8.0, p10_us=8.0, p90_us=8.0, hlo_ops={"all-reduce": 2})
        return dict(median_us=times[key], p10_us=times[key], p90_us=times[key],
                    hlo_ops={"all-reduce": 2}, device_us=1.0)
    row = xla_best.best(_Env("gpu"), "lax.psum best", measure)
    assert row["method"] == "lax.psum best" and row["median_us"] == 7.0
    assert row["xla_flags"] == "collective-kernels" and "device_us" not in row
    assert row["xla_variants"] == {"default": 10.0, "collective-kernels": 7.0,
                                   "nccl-symmetric": 12.0,
                                   "collective-kernels+nccl-symmetric": 8.0}
    assert len(asked) == 4  # no ragged all-to-all flag for an all-reduce program
    m = xla_best.meta([row], "gpu", "on")
    assert m["helped"] == {"collective-kernels": 1} and m["fastest"] == {
        "collective-kernels": 1}
    # a program without collectives, and CPU devices: XLA's default, said why
    plain = dict(median_us=3.0, hlo_ops={"custom-call": 1})
    r = xla_best.best(_Env("gpu"), "b", lambda o: pytest.fail("measured"), default=plain)
    assert r["median_us"] == 3.0 and r["xla_best_note"] == "no collective in the program"
    r = xla_best.best(_Env("cpu"), "b", lambda o: pytest.fail("measured"),
                      default=dict(plain, hlo_ops={"all-reduce": 1}))
    assert r["xla_flags"] == "default" and "CPU devices" in r["xla_best_note"]
