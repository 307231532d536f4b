"""The MoE transformer example (jax_nvcomm.models.moe_transformer, `python -m jax_nvcomm.demo`) on the
8 CPU devices, small sizes: both layouts, decode and prefill, agree with the XLA-only version
and (test_one_layer_matches_numpy_forward) with an independent float64 numpy forward pass of
one layer written here from the model's definition; the command line's reference file round
trip, plot and exit codes."""
import numpy as np
import pytest

from jax_nvcomm.models import moe_transformer as mt

SMALL = dict(layers=1, hidden=64, experts=8, top_k=2, ffn=32, tokens=16, decode_tokens=2,
             context=8, iters=1, warmup=0, quiet=True)
SMALL_ARGS = ["--layers", "1", "--hidden", "64", "--experts", "8", "--top-k", "2", "--ffn", "32",
              "--tokens", "16", "--decode-tokens", "2", "--context", "8", "--iters", "1",
              "--warmup", "0", "--quiet"]


def _run(**kw):
    return mt.run(mt.Config(**{**SMALL, **kw}))


# ---------------------------------------------------------------- float64 numpy forward pass
# One decoder layer of moe_transformer.forward(), written here from its definition (module
# docstring and forward()): pre-norm; attention with RoPE (halves rotated), causal prefill over
# each rank's sequence or decode of one new token at position `context` after a fixed K/V
# context; residual add; RMSNorm; softmax router, top-k, weights renormalised over the k;
# SwiGLU experts silu(h @ wg) * (h @ wu) @ wd; residual add; final RMSNorm.

def _np_rms(r, w, eps=mt.EPS):
    return r / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + eps) * w


def _np_rope(x, pos):
    half = x.shape[-1] // 2
    freq = 1.0 / (mt.ROPE_THETA ** (np.arange(half) / half))
    ang = pos[:, None, None] * freq
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                           x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def _np_softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_attention(h, p, cache, heads, phase):
    t, H = h.shape
    hd = H // heads
    q, k, v = ((h @ p[n]).reshape(t, heads, hd) for n in ("wq", "wk", "wv"))
    if phase == "prefill":                      # one causal sequence of t tokens
        pos = np.arange(t, dtype=np.float64)
        q, k = _np_rope(q, pos), _np_rope(k, pos)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
        o = np.einsum("hqk,khd->qhd", _np_softmax(s), v)
    else:                                       # t sequences, each: context + the new token
        ck, cv = cache                          # [t, C, heads, hd]
        pos = np.full(t, float(ck.shape[1]))
        q, k = _np_rope(q, pos), _np_rope(k, pos)
        keys = np.concatenate([ck, k[:, None]], axis=1)
        vals = np.concatenate([cv, v[:, None]], axis=1)
        s = np.einsum("bhd,bshd->bhs", q, keys) / np.sqrt(hd)
        o = np.einsum("bhs,bshd->bhd", _np_softmax(s), vals)
    return o.reshape(t, H) @ p["wo"]


def _np_layer(x, p, final_norm, cache, heads, top_k, phase, forced_ids=None):
    """One layer on one sequence group; returns (final normed hidden states, top-k ids, router
    probabilities)."""
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    h = _np_rms(x, p["attn_norm"])
    r = _np_attention(h, p, cache, heads, phase) + x
    h = _np_rms(r, p["moe_norm"])
    probs = _np_softmax(h @ p["router"])
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k] if forced_ids is None \
        else forced_ids
    w = np.take_along_axis(probs, ids, axis=-1)
    w = w / w.sum(-1, keepdims=True)
    m = np.zeros_like(h)
    for t in range(h.shape[0]):
        for k in range(top_k):
            e = ids[t, k]
            m[t] += w[t, k] * ((silu(h[t] @ p["wg"][e]) * (h[t] @ p["wu"][e])) @ p["wd"][e])
    if "sg" in p:  # the shared expert: every token, beside the routed ones
        m += (silu(h @ p["sg"]) * (h @ p["su"])) @ p["sd"]
    return _np_rms(m + r, final_norm), ids, probs


@pytest.mark.parametrize("layout,phase", [("low-latency", "prefill"),
                                          ("high-throughput", "decode"),
                                          ("dp-attn-tp-moe", "prefill")])
def test_one_layer_matches_numpy_forward(layout, phase):
    """jax_nvcomm's step (all_reduce_rms_norm, moe_dispatch/moe_combine, or all_gather_v /
    reduce_scatter_v around TP experts with unbalanced rows per rank) of a 1-layer model
    on 4 devices against the float64 numpy forward above, with the weights, inputs and decode
    context the example generates (dp-attn-tp-moe: each rank's valid rows are its own
    sequence; the rows past its count must come back zero). Routing: the free run's top-k must equal numpy's wherever
    numpy's k-th and (k+1)-th probabilities are apart (> 1e-5); the output is then compared
    with the step run under numpy's routing forced (near ties cannot flip a token)."""
    import jax
    import jax_nvcomm as nvc
    if layout == "high-throughput":
        ok, why = mt.ep_available(("jax_nvcomm",))
        if not ok:
            pytest.skip(why)
    W = 4
    cfg = mt.resolve(mt.Config(**SMALL, layouts=(layout,)), "cpu", W)
    axis = mt.AXES[layout]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:W]), (axis,))
    params = mt.init_params(cfg, mesh, layout)
    x, _ = mt.make_input(cfg, mesh, layout, phase, W)
    counts, t = mt.row_counts(cfg, layout, phase, W)
    caches = mt.init_caches(cfg, mesh, layout, W) if phase == "decode" else ()
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    p = {k: f64(v) for k, v in params["layers"][0].items()}
    fn = f64(params["final_norm"])
    xh = f64(x[0] if layout == "dp-attn-tp-moe" else x)
    # the sequences: all tokens are one group in the low-latency layout (every rank the same
    # tokens); otherwise each rank its own counts[r] tokens (data parallel)
    groups = [slice(0, len(xh))] if layout == "low-latency" else \
        [slice(r * t, r * t + counts[r]) for r in range(W)]
    if layout == "dp-attn-tp-moe":
        assert phase == "decode" or counts[0] > counts[1] == counts[W - 1] > 0
        assert not xh[W * t - 1].any()  # padding rows (zero) follow each rank's own
    out, ids, probs = [], [], []
    for g in groups:
        cache = tuple(f64(c)[g] for c in caches[0]) if phase == "decode" else None
        o, i, pr = _np_layer(xh[g], p, fn, cache, cfg.heads, cfg.top_k, phase)
        out.append(o), ids.append(i), probs.append(pr)
    want, want_ids, probs = np.concatenate(out), np.concatenate(ids), np.concatenate(probs)
    valid = np.concatenate([np.arange(g.start, g.stop) for g in groups])
    assert want.shape == (len(valid), xh.shape[1]) and np.abs(want).max() > 0.1
    forced_ids = np.zeros((1, len(xh), cfg.top_k), np.int32)
    forced_ids[0, valid] = want_ids

    if layout == "low-latency":
        comm = nvc.Communicator(mesh, "tp", max_message_bytes=1 << 16)
        comms = {"tp": comm}
    elif layout == "dp-attn-tp-moe":  # the gathered rows must fit: the kernel path
        comm = nvc.Communicator(mesh, "dp", max_message_bytes=W * t * cfg.hidden * 4)
        comms = {"dp": comm}
        from jax_nvcomm import varlen
        assert varlen.fits(comm, t, cfg.hidden * 4)
    else:
        comm = nvc.MoECommunicator(mesh, "ep", num_experts=cfg.experts, top_k=cfg.top_k,
                                   max_tokens=t, hidden=cfg.hidden, dtype=np.float32)
        comms = {("ep", phase): comm}
    with comm:
        free = mt.make_step(cfg, mesh, layout, phase, "jax_nvcomm", comms)
        forced = mt.make_step(cfg, mesh, layout, phase, "jax_nvcomm", comms, forced=True)
        h, got_ids = free(x, params, caches, ())
        h_f, _ = forced(x, params, caches, forced_ids)
        h, got_ids, h_f = f64(h), np.asarray(got_ids)[0], f64(h_f)
    pad = np.ones(len(xh), bool)
    pad[valid] = False
    assert not h[pad].any() and not h_f[pad].any() and not got_ids[pad].any()
    h, got_ids, h_f = h[valid], got_ids[valid], h_f[valid]
    srt = np.sort(probs, axis=-1)[:, ::-1]
    clear = srt[:, cfg.top_k - 1] - srt[:, cfg.top_k] > 1e-5
    assert clear.mean() > 0.8, clear.mean()
    np.testing.assert_array_equal(np.sort(got_ids[clear], -1), np.sort(want_ids[clear], -1))
    err = np.linalg.norm(h_f - want) / np.linalg.norm(want)
    assert err < 1e-4, err
    np.testing.assert_allclose(h_f, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    if clear.all():  # no near tie: the free run is the same computation
        np.testing.assert_allclose(h, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


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


def test_dp_attn_tp_moe_agrees_with_xla():
    """DP attention + TP MoE with unbalanced rows (prefill: rank 0 `tokens`, the others
    `decode_tokens`): all_gather_v / reduce_scatter_v (kernel path) against padded
    lax.all_gather + lax.psum_scatter, compared on the valid rows, 4 devices."""
    res = _run(layouts=("dp-attn-tp-moe",), devices=4)
    assert res["world"] == 4
    _check_rows(res, "dp-attn-tp-moe", 1e-4)
    dec, pre = res["rows"]
    assert dec["counts"] == [SMALL["decode_tokens"]] * 4
    assert pre["counts"] == [SMALL["tokens"]] + [SMALL["decode_tokens"]] * 3
    assert pre["tokens"] == SMALL["tokens"]
    assert {r["op"] for r in res["rows"]} == {"AG_v+RS_v"}  # not the XLA fallback
    assert f"{SMALL['tokens']}/{SMALL['decode_tokens']}" in mt.format_table(res)


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
            mesh = jax.sharding.Mesh(np.array(jax.devices()[:w]), (mt.AXES[layout],))
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
        (lay, ph) for lay in mt.DEFAULT_LAYOUTS for ph in mt.PHASES]
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
    assert "--heads must be a multiple of the 8 ranks (TP), got 3" in err
    with pytest.raises(mt.ConfigError, match=r"--experts must be a multiple of the 8 ranks "
                                             r"\(EP, high-throughput\), got 12"):
        _run(experts=12, layouts=("high-throughput",), impls=())


def _has_matplotlib():
    try:
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False
