"""The MoE transformer example (jax_nvcomm.moe_transformer, `python -m jax_nvcomm.demo`) on the
8 CPU devices, small sizes: both layouts, decode and prefill, agree with the XLA-only version;
the command line's reference file round trip, plot and exit codes.

Issue 17, open: "agree" is computed against the package's own baselines (jax_nvcomm.reference);
an independent float64 numpy forward pass of one small layer is not written yet."""
import numpy as np
import pytest

from jax_nvcomm import moe_transformer as mt

SMALL = dict(layers=1, hidden=64, experts=8, top_k=2, ffn=32, tokens=16, decode_tokens=2,
             context=8, iters=1, warmup=0, quiet=True)
SMALL_ARGS = ["--layers", "1", "--hidden", "64", "--experts", "8", "--top-k", "2", "--ffn", "32",
              "--tokens", "16", "--decode-tokens", "2", "--context", "8", "--iters", "1",
              "--warmup", "0", "--quiet"]


def _run(**kw):
    return mt.run(mt.Config(**{**SMALL, **kw}))


def _check_rows(res, layout, tol):
    rows = [r for r in res["rows"] if r["layout"] == layout]
    assert [r["phase"] for r in rows] == ["decode", "prefill"]
    for r in rows:
        assert set(r["ms"]) == {"jax_nvcomm", "xla"}
        assert all(v > 0 for v in r["ms"].values())
        assert r["err"] is not None and r["err"] < tol, r
        assert r["agree"] is True, r
    assert res["ok"]


def test_low_latency_agrees_with_xla():
    res = _run(layouts=("low-latency",))
    assert res["world"] == 8
    _check_rows(res, "low-latency", 1e-4)
    assert {r["op"] for r in res["rows"]} <= {"AR+norm oneshot", "AR+norm twoshot"}
    assert all(r["routing"] == 0 for r in res["rows"])  # float32: same routing


def test_forced_routing_reproduces_the_free_run():
    """The comparison under a baseline's routing: forcing a run's own routing gives back
    exactly its output; forcing another routing changes it."""
    import jax
    import jax_nvcomm as nvc
    cfg = mt.resolve(mt.Config(**SMALL, layouts=("low-latency",)), "cpu", 4)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("tp",))
    params = mt.init_params(cfg, mesh, "low-latency")
    x, _ = mt.make_input(cfg, mesh, "low-latency", "prefill", 4)
    with nvc.Communicator(mesh, "tp", max_message_bytes=1 << 16) as comm:
        free = mt.make_step(cfg, mesh, "low-latency", "prefill", "jax_nvcomm", {"tp": comm})
        forced = mt.make_step(cfg, mesh, "low-latency", "prefill", "jax_nvcomm", {"tp": comm},
                              forced=True)
        h, ids = free(x, params, (), ())
        assert ids.shape == (cfg.layers, cfg.tokens, cfg.top_k)
        h2, ids2 = forced(x, params, (), ids)
        np.testing.assert_array_equal(np.asarray(ids2), np.asarray(ids))
        np.testing.assert_array_equal(np.asarray(h2), np.asarray(h))
        other = (ids + 1) % cfg.experts
        h3, ids3 = forced(x, params, (), other)
        np.testing.assert_array_equal(np.asarray(ids3), np.asarray(other))
        assert mt.compare(np.asarray(h3), np.asarray(h))[0] > 1e-3


def test_low_latency_bfloat16_agrees_with_xla():
    res = _run(layouts=("low-latency",), dtype="bfloat16", devices=4)
    assert res["world"] == 4
    _check_rows(res, "low-latency", 2e-2)


def test_high_throughput_agrees_with_xla():
    ok, why = mt.ep_available()
    if not ok:
        pytest.skip(why)
    res = _run(layouts=("high-throughput",))
    _check_rows(res, "high-throughput", 1e-4)


def test_cli_reference_round_trip(tmp_path, capsys):
    ref = str(tmp_path / "ref.npz")
    args = SMALL_ARGS + ["--layouts", "low-latency", "--phases", "decode"]
    assert mt.main(args + ["--xla-only", "--save-ref", ref]) == 0
    png = tmp_path / "bars.png"
    plot = ["--plot", str(png)] if _has_matplotlib() else []
    assert mt.main(args + ["--nvcomm-only", "--ref", ref] + plot) == 0
    out = capsys.readouterr().out
    assert "vs ref" in out and " yes" in out
    if plot:
        assert png.stat().st_size > 0

    # a corrupted reference must fail the comparison (exit code 1)
    with np.load(ref) as z:
        data = {k: z[k] for k in z.files}
    data["low-latency/decode/hidden"] = data["low-latency/decode/hidden"] * 1.01
    bad = str(tmp_path / "bad.npz")
    np.savez(bad, **data)
    assert mt.main(args + ["--nvcomm-only", "--ref", bad]) == 1
    assert "NO" in capsys.readouterr().out

    # a reference of another configuration is refused (exit code 2)
    other = [a if a != "64" else "128" for a in args]
    assert mt.main(other + ["--nvcomm-only", "--ref", ref]) == 2
    assert "another configuration" in capsys.readouterr().err


def test_inputs_of_rank_r_do_not_depend_on_the_world_size():
    """What makes a reference of another world size comparable: rank r's tokens and decode
    context are the same for every world size (a 1-device world included)."""
    import jax
    cfg = {w: mt.resolve(mt.Config(**SMALL), "cpu", w) for w in (1, 2, 4)}
    for layout in mt.LAYOUTS:
        caches, xs = {}, {}
        for w in (1, 2, 4):
            mesh = jax.sharding.Mesh(np.array(jax.devices()[:w]), ("tp",) if
                                     layout == "low-latency" else ("ep",))
            caches[w] = [[np.asarray(a) for a in pair] for pair in
                         mt.init_caches(cfg[w], mesh, layout, w)]
            xs[w] = {ph: mt.input_host(cfg[w], layout, ph, w) for ph in mt.PHASES}
        for w in (1, 2):
            for pair_w, pair_4 in zip(caches[w], caches[4]):
                for a, b in zip(pair_w, pair_4):
                    np.testing.assert_array_equal(a, b[:len(a)], err_msg=f"{layout} w={w}")
            for ph in mt.PHASES:
                np.testing.assert_array_equal(xs[w][ph], xs[4][ph][:len(xs[w][ph])])


def test_reference_of_one_device_matches_two_devices(tmp_path):
    """A reference stored by a 1-device run agrees with a 2-device jax_nvcomm-only run, in both
    layouts and phases (high-throughput: rank 0's tokens compared, and the table says so)."""
    ok, why = mt.ep_available()
    if not ok:
        pytest.skip(why)
    ref = str(tmp_path / "ref1.npz")
    res1 = _run(devices=1, save_ref=ref)
    assert res1["world"] == 1 and res1["ok"]
    res2 = _run(devices=2, impls=("jax_nvcomm",), ref=ref)
    assert res2["world"] == 2
    assert [(r["layout"], r["phase"]) for r in res2["rows"]] == [
        (lay, ph) for lay in mt.LAYOUTS for ph in mt.PHASES]
    for r in res2["rows"]:
        assert r["ref_err"] is not None and r["ref_err"] < 1e-4, r
        assert r["ref_routing"] == 0, r
        assert r["agree"] is True, r
        assert r["ref_note"] == (None if r["layout"] == "low-latency" else "ranks 0-0"), r
    assert res2["ok"]
    assert "only those ranks' tokens" in mt.format_table(res2)

    # a 1-device reference of the older format (another high-throughput decode context) is
    # refused rather than compared
    import json
    with np.load(ref) as z:
        data = {k: z[k] for k in z.files}
    meta = json.loads(str(data["__meta__"]))
    del meta["format"]
    data["__meta__"] = np.array(json.dumps(meta))
    old = str(tmp_path / "old.npz")
    np.savez(old, **data)
    with pytest.raises(mt.ConfigError, match="older version"):
        mt.load_ref(old, res2["config"])


def test_bad_sizes_are_clear_errors(capsys):
    assert mt.main(SMALL_ARGS + ["--heads", "3"]) == 2
    err = capsys.readouterr().err
    assert "--heads 3" in err
    with pytest.raises(mt.ConfigError, match="--experts 12 must be a multiple"):
        _run(experts=12, layouts=("high-throughput",), impls=())


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False
