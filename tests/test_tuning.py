"""Tuning tables (jax_nvcomm/tuning.py, docs/tuning.md): a file named by JAX_NVCOMM_TUNING
applies as given, the cache file only with this machine's fingerprint, else the built-in table;
the environment's thresholds (read at setup) and select_strategy's keywords override rows;
explain=True says which source decided. CPU devices, one process (several:
tests/mp/tuning_mp.py)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm import tuning
from helpers import f64, mesh1d, rel_err, rms_ref, run_sharded, tol


def _write(path, rows, machine=None, fmt=tuning.FORMAT):
    path.write_text(json.dumps({"format": fmt, "machine": machine, "allreduce": rows}))
    return str(path)


def _row(world, op, dtype, one, two, local=None):
    return dict(world_size=world, op=op, dtype=dtype, oneshot_max_bytes=one,
                twoshot_max_bytes=two, local_min_bytes=local)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No tuning variables from the caller; the cache under tmp_path."""
    for var in (tuning.ENV_FILE, tuning.ENV_CACHE_DIR, *tuning.ENV_OVERRIDES.values()):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return monkeypatch


def test_file_thresholds_decide_on_8_devices(clean_env, tmp_path):
    path = _write(tmp_path / "t.json", [_row(8, "all_reduce", "bfloat16", 1024, 2048)])
    clean_env.setenv(tuning.ENV_FILE, path)
    with nvc.Communicator(mesh1d(8), "x", max_message_bytes=1 << 20) as c:
        assert c.tuning.source == "file" and c.tuning.path == path
        assert nvc.select_strategy(c, (1, 256), jnp.bfloat16) == "oneshot"   # 512 B
        assert nvc.select_strategy(c, (1, 768), jnp.bfloat16) == "twoshot"   # 1536 B
        assert nvc.select_strategy(c, (1, 4096), jnp.bfloat16) == "xla"      # 8 KiB
        assert nvc.select_strategy(c, (1, 512), jnp.bfloat16) == "oneshot"   # 1024 B: <=
        assert nvc.select_strategy(c, (1, 1024), jnp.bfloat16) == "twoshot"  # 2048 B: <=
        why = nvc.select_strategy(c, (1, 768), jnp.bfloat16, explain=True)
        assert why.strategy == "twoshot" and why.nbytes == 1536
        assert path in why.source and tuning.ENV_FILE in why.source
        assert why.thresholds["oneshot_max_bytes"] == 1024
        # a row the file lacks (float32, the fused op) comes from the built-in table, and
        # explain says so
        one_8, two_8 = 128 << 10, 32 << 20
        f32 = nvc.select_strategy(c, (1, 768), jnp.float32, explain=True)
        assert f32.strategy == "oneshot" and f32.thresholds["oneshot_max_bytes"] == one_8
        assert "built-in table (the file has no row" in f32.source
        fused = nvc.select_strategy(c, (1, 4096), jnp.bfloat16, op="all_reduce_rms_norm",
                                    explain=True)
        assert fused.strategy == "oneshot" and "built-in" in fused.source
        assert fused.thresholds["twoshot_max_bytes"] == two_8


def test_file_of_fewer_worlds_says_nothing_about_more(clean_env, tmp_path):
    path = _write(tmp_path / "t.json", [_row(2, "all_reduce", "bfloat16", 8, 16)])
    clean_env.setenv(tuning.ENV_FILE, path)
    comms = [nvc.Communicator(mesh1d(w), "x", max_message_bytes=1 << 20) for w in (2, 4)]
    try:
        assert nvc.select_strategy(comms[0], (1, 64), jnp.bfloat16) == "xla"  # 128 B > 16
        four = nvc.select_strategy(comms[1], (1, 64), jnp.bfloat16, explain=True)
        assert four.strategy == "oneshot" and "built-in" in four.source
    finally:
        for c in comms:
            c.close()


def test_the_environment_at_setup_and_keywords_override_rows(clean_env, tmp_path):
    path = _write(tmp_path / "t.json", [_row(2, "*", "*", 1 << 20, 8 << 20)])
    clean_env.setenv(tuning.ENV_FILE, path)
    clean_env.setenv("JAX_NVCOMM_ONESHOT_MAX_BYTES", "0")
    c = nvc.Communicator(mesh1d(2), "x", max_message_bytes=1 << 20)
    # read once at setup: later changes of the environment do not move the choice
    clean_env.setenv("JAX_NVCOMM_TWOSHOT_MAX_BYTES", "16")
    try:
        why = nvc.select_strategy(c, (4, 64), jnp.float32, explain=True)
        assert why.strategy == "twoshot"
        assert why.sources["oneshot_max_bytes"].startswith("env JAX_NVCOMM_ONESHOT_MAX_BYTES")
        assert why.source.startswith("tuning file")  # the decisive one: twoshot_max_bytes
        kw = nvc.select_strategy(c, (4, 64), jnp.float32, oneshot_max_bytes=4096,
                                 explain=True)
        assert kw.strategy == "oneshot" and kw.source == "keyword"
        assert nvc.select_strategy(c, (4, 64), jnp.float32, twoshot_max_bytes=16) == "xla"
    finally:
        c.close()
    with nvc.Communicator(mesh1d(2), "x", max_message_bytes=1 << 20) as c2:  # the new env
        assert nvc.select_strategy(c2, (4, 64), jnp.float32) == "xla"  # 1 KiB > 16 B


def test_bad_override_and_bad_explicit_file_are_named(clean_env, tmp_path):
    clean_env.setenv("JAX_NVCOMM_TWOSHOT_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="JAX_NVCOMM_TWOSHOT_MAX_BYTES must be an int >= 0"):
        nvc.Communicator(mesh1d(2), "x")
    clean_env.delenv("JAX_NVCOMM_TWOSHOT_MAX_BYTES")
    bad = _write(tmp_path / "bad.json", [_row(2, "all_reduce", "bf16", 0, 0)])
    clean_env.setenv(tuning.ENV_FILE, bad)
    with pytest.raises(ValueError, match=r"allreduce\[0\]: dtype must be one of .*got 'bf16'"):
        nvc.Communicator(mesh1d(2), "x")
    clean_env.setenv(tuning.ENV_FILE, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="missing.json: cannot read it"):
        nvc.Communicator(mesh1d(2), "x")


@pytest.mark.parametrize("doc,pattern", [
    ({"format": "other/1", "allreduce": []}, "format must be 'jax_nvcomm.tuning/1'"),
    ({"format": tuning.FORMAT, "machine": None}, "missing \"allreduce\""),
    ({"format": tuning.FORMAT, "allreduce": [_row(0, "*", "*", 0, 0)]},
     "world_size must be an int >= 1, got 0"),
    ({"format": tuning.FORMAT, "allreduce": [_row(2, "psum", "*", 0, 0)]},
     "op must be one of"),
    ({"format": tuning.FORMAT, "allreduce": [_row(2, "*", "*", -1, 0)]},
     "oneshot_max_bytes must be an int >= 0, got -1"),
    ({"format": tuning.FORMAT, "allreduce": [_row(2, "*", "*", 0, 0, local=True)]},
     "local_min_bytes must be an int >= 0 or null, got True"),
    ({"format": tuning.FORMAT, "allreduce": [_row(2, "*", "*", 0, 0), _row(2, "*", "*", 1, 1)]},
     r"allreduce\[1\] repeats allreduce\[0\]"),
])
def test_validation_names_the_field(doc, pattern):
    with pytest.raises(ValueError, match=pattern):
        tuning.validate(doc, "f.json")


def test_cache_of_another_machine_is_ignored_with_one_note(clean_env, tmp_path, capsys):
    here = tuning.fingerprint(jax.local_devices())
    other = dict(here, device_kind="NVIDIA H100 80GB HBM3", device_count=16)
    cache = tmp_path / "cache" / "jax_nvcomm" / "tuning.json"
    cache.parent.mkdir(parents=True)
    _write(cache, [_row(2, "*", "*", 0, 0)], machine=other)
    for _ in range(2):
        with nvc.Communicator(mesh1d(2), "x", max_message_bytes=1 << 20) as c:
            assert c.tuning.source == "built-in"
            why = nvc.select_strategy(c, (1, 64), jnp.bfloat16, explain=True)
            assert why.strategy == "oneshot" and why.source.startswith("built-in table")
    err = capsys.readouterr().err
    assert err.count(f"ignoring the tuning cache {cache}") == 1, err
    assert "device_kind 'NVIDIA H100 80GB HBM3' there, 'cpu' here" in err
    assert f"device_count 16 there, {len(jax.local_devices())} here" in err


def test_cache_of_this_machine_applies_and_builtin_keyword_skips_it(clean_env, tmp_path):
    cache = tmp_path / "cache" / "jax_nvcomm" / "tuning.json"
    cache.parent.mkdir(parents=True)
    assert tuning.cache_path() == str(cache)
    _write(cache, [_row(2, "all_reduce", "float32", 0, 0)],
           machine=tuning.fingerprint(jax.local_devices()))
    with nvc.Communicator(mesh1d(2), "x", max_message_bytes=1 << 20) as c:
        why = nvc.select_strategy(c, (1, 64), jnp.float32, explain=True)
        assert why.strategy == "xla" and why.source.startswith(f"tuning cache {cache}")
    clean_env.setenv(tuning.ENV_FILE, "builtin")
    with nvc.Communicator(mesh1d(2), "x", max_message_bytes=1 << 20) as c:
        assert c.tuning.source == "built-in"
        assert nvc.select_strategy(c, (1, 64), jnp.float32) == "oneshot"


def test_fingerprint_match_rules():
    fp = dict(platform="gpu", device_kind="NVIDIA H200", device_count=8, link="nvlink",
              driver="580.95.05", jax="0.11.2", jaxlib="0.11.2", jax_nvcomm="0.1.0")
    assert tuning.mismatch(fp, dict(fp)) == []
    # a process that sees one GPU (the launcher) cannot tell the link: not a difference
    assert tuning.mismatch(fp, dict(fp, link=tuning.UNKNOWN_LINK)) == []
    assert tuning.mismatch(fp, dict(fp, link="pcie")) == ["link 'nvlink' there, 'pcie' here"]
    assert tuning.mismatch(fp, dict(fp, jax="0.12.0")) == ["jax '0.11.2' there, '0.12.0' here"]
    cpu = tuning.fingerprint(jax.local_devices())
    assert cpu["platform"] == "cpu" and cpu["device_count"] == len(jax.local_devices())
    assert cpu["jax"] == jax.__version__ and cpu["jax_nvcomm"] == nvc.__version__


def test_pick_largest_world_below_and_most_specific_row():
    R = tuning.Row
    rows = (R(1, "*", "*", 0, 0), R(2, "*", "*", 10, 20), R(2, "all_reduce", "*", 11, 21),
            R(2, "all_reduce", "float32", 12, 22), R(4, "*", "bfloat16", 13, 23))
    assert tuning.pick(rows, 2, "all_reduce", "float32").oneshot_max_bytes == 12
    assert tuning.pick(rows, 2, "all_reduce", "float16").oneshot_max_bytes == 11
    assert tuning.pick(rows, 3, "all_reduce_rms_norm", "float16") is None  # beyond world 2
    assert tuning.pick(rows, 3, "all_reduce_rms_norm", "float16",
                       beyond=True).oneshot_max_bytes == 10
    assert tuning.pick(rows, 3, "all_reduce", "bfloat16").oneshot_max_bytes == 11
    assert tuning.pick(rows, 4, "all_reduce", "bfloat16").oneshot_max_bytes == 13
    assert tuning.pick(rows, 4, "all_reduce", "float16") is None
    assert tuning.pick(rows, 4, "all_reduce", "float16", beyond=True).oneshot_max_bytes == 11
    assert tuning.pick(rows, 8, "all_reduce", "bfloat16") is None  # beyond the file's worlds
    assert tuning.pick(rows, 8, "all_reduce", "bfloat16", beyond=True).oneshot_max_bytes == 13
    t = tuning.Table("file", "/x.json", rows, tuning.builtin_rows(), (("local_min_bytes", 5),))
    assert tuning.Table.from_json(json.loads(json.dumps(t.to_json()))) == t


def test_world_1_uses_our_kernel_where_the_table_says_it_wins(clean_env, tmp_path, rng):
    """Built-in: XLA below local_min_bytes (and always for the plain all_reduce); a file's
    world-1 row moves the fused op onto the kernel, whose result matches float64 numpy."""
    T, H = 4, 256
    with nvc.Communicator(mesh1d(1), "x", max_message_bytes=64 << 20) as c:
        fused = dict(op="all_reduce_rms_norm")
        assert nvc.select_strategy(c, (T, H), jnp.bfloat16, **fused) == "xla"
        assert nvc.select_strategy(c, (2048, 8192), jnp.bfloat16, **fused) == "twoshot"
        assert nvc.select_strategy(c, (2048, 8192), jnp.bfloat16) == "xla"  # plain: free
        assert nvc.select_strategy(c, (2048, 8192), jnp.float32, **fused) == "xla"
    path = _write(tmp_path / "w1.json",
                  [_row(1, "all_reduce_rms_norm", "float32", 0, 0, local=1024)])
    clean_env.setenv(tuning.ENV_FILE, path)
    mesh = mesh1d(1)
    with nvc.Communicator(mesh, "x", max_message_bytes=1 << 20) as c:
        why = nvc.select_strategy(c, (T, H), jnp.float32, op="all_reduce_rms_norm",
                                  explain=True)
        assert why.strategy == "twoshot" and "local_min_bytes 1024" in why.reason
        assert nvc.select_strategy(c, (1, 128), jnp.float32, op="all_reduce_rms_norm") == "xla"
        x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
        r = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
        w = jnp.asarray(1 + 0.1 * rng.standard_normal((H,)), jnp.float32)

        def f(v, res, ww):
            return nvc.all_reduce_rms_norm(v, res, ww, c)

        sm = jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P("x"), P()),
                           out_specs=(P("x"), P("x")))
        assert "nvc_all_reduce_rms" in jax.jit(sm).lower(x, r, w).as_text()
        n, r_out = run_sharded(f, mesh, (P("x"), P("x"), P()), (P("x"), P("x")), x, r, w)
        rr = f64(x) + f64(r)
        assert rel_err(f64(r_out), rr) < tol(jnp.float32)
        assert rel_err(f64(n), rms_ref(rr, f64(w), 1e-6)) < 2 * tol(jnp.float32)


def test_builtin_table_is_valid_data():
    rows = tuning.builtin_rows()
    assert {r.world_size for r in rows} >= {1, 2, 4, 8, 16}
    for w in (1, 2, 4, 8, 16):
        for op in tuning.OPS:
            for dt in tuning.DTYPES:
                assert tuning.pick(rows, w, op, dt, beyond=True) is not None, (w, op, dt)
    assert tuning.pick(rows, 1, "all_reduce", "bfloat16").local_min_bytes is None
    assert np.all([r.oneshot_max_bytes <= r.twoshot_max_bytes for r in rows])
