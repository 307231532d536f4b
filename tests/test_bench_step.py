"""`python -m jax_nvcomm.bench step` on 8 CPU devices (the numbers mean nothing here; the
structure does): every layout's decode row has both implementations' times from the pass in
turns, the sequential pass beside it, the no-communication bound, and agreement; and the bound's
step really has no communication in it (no collective, no jax_nvcomm call in its program)."""
import json

import jax
import numpy as np
import pytest

from jax_nvcomm.bench import cli
from jax_nvcomm.models import moe_transformer as mt

LAYOUTS = ("low-latency", "high-throughput", "dp-attn-tp-moe", "ep-ragged")


def test_bench_step_rows_have_turns_bound_and_agreement(tmp_path, capsys):
    rc = cli.main(["step", "--presets", "example", "--phases", "decode", "--iters", "2",
                     "--warmup", "1", "--no-trace", "--quiet", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads(next(tmp_path.glob("bench_*_step.json")).read_text())
    rows = data["rows"]
    assert sorted(r["layout"] for r in rows) == sorted(LAYOUTS)
    for r in rows:
        assert r["phase"] == "decode" and r["agree"] is True, r
        for k in ("nvcomm_ms", "xla_ms", "bound_ms"):
            assert r[k] is not None and r[k] > 0, (k, r)
        assert r["ratio"] == pytest.approx(r["xla_ms"] / r["nvcomm_ms"])
        assert r["bound_ratio"] == pytest.approx(r["xla_ms"] / r["bound_ms"])
        # the first (sequential) pass is kept beside the medians of the pass in turns
        assert set(r["sequential_ms"]) == {"jax_nvcomm", "xla"}, r
        # XLA best on CPU devices: XLA's default (the flags do not apply), said so
        assert r["xla_best_ms"] == r["xla_ms"] and r["xla_best_flags"] == "default", r
        assert "not tried" in r["xla_best_note"] and r["best_ratio"] == pytest.approx(r["ratio"])
    assert "env" in data["meta"]
    text = capsys.readouterr().out
    assert "XLA/bound" in text and "wrote" in text and "ms XLA best" in text


def test_xla_variants_are_timed_in_turns_and_the_fastest_kept():
    """cfg.xla_variants (what bench step passes on GPUs): the XLA step compiled with each
    flag set joins the turns; one XLA refuses is reported, not fatal. On CPU the options are
    accepted (one DebugOptions for every backend) and change nothing that matters here."""
    asked = []

    def variants(compiled):
        asked.append(compiled)
        return [("nccl-symmetric", {"xla_gpu_experimental_enable_nccl_symmetric_buffers": True}),
                ("bogus", {"xla_gpu_no_such_flag_here": True})]
    cfg = mt.Config(layouts=("low-latency",), phases=("decode",), impls=("xla",), iters=2,
                    warmup=1, quiet=True, layers=1, xla_variants=variants)
    res = mt.run(cfg)
    (row,) = res["rows"]
    assert len(asked) == 1
    best = row["xla_best"]
    assert set(best["variants"]) == {"xla", "xla+nccl-symmetric"}
    assert set(row["ms"]) >= {"xla", "xla+nccl-symmetric"}
    assert best["ms"] == min(best["variants"].values())
    fastest = min(best["variants"], key=best["variants"].get)   # "xla" or "xla+<label>"
    assert best["flags"] == ("default" if fastest == "xla" else fastest[len("xla+"):])
    assert "No such compile option" in best["errors"]["bogus"]


_COMM_OPS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute",
             "ragged-all-to-all", "nvc_")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_bound_step_has_no_communication(layout):
    """impl "none": the same shapes as the real step, and not one collective or custom call
    of ours in its compiled program; the jax_nvcomm and XLA steps of the same layout have
    theirs (so the check can fail)."""
    cfg = mt.resolve(mt.Config(layouts=(layout,), phases=("decode",)), "cpu", 8)
    world = len(jax.devices())
    mesh = jax.sharding.Mesh(np.array(jax.devices()), (mt.AXES[layout],))
    params = mt.init_params(cfg, mesh, layout)
    caches = mt.init_caches(cfg, mesh, layout, world)
    x, _ = mt.make_input(cfg, mesh, layout, "decode", world)
    comms = {}
    import jax_nvcomm as nvc
    try:
        if layout == "low-latency":
            comms["tp"] = nvc.Communicator(mesh, "tp", max_message_bytes=1 << 20)
        elif layout == "dp-attn-tp-moe":
            comms["dp"] = nvc.Communicator(mesh, "dp", max_message_bytes=1 << 20)
        elif layout == "ep-ragged":
            comms["ragged"] = nvc.Communicator(mesh, "ep", max_message_bytes=1 << 20)
        else:
            comms[("ep", "decode")] = nvc.MoECommunicator(
                mesh, "ep", num_experts=cfg.experts, top_k=cfg.top_k,
                max_tokens=cfg.decode_tokens, hidden=cfg.hidden, dtype=cfg.dtype)
        texts = {impl: mt.make_step(cfg, mesh, layout, "decode", impl, comms)
                 .lower(x, params, caches, ()).compile().as_text()
                 for impl in ("none", "jax_nvcomm", "xla")}
        out = mt.make_step(cfg, mesh, layout, "decode", "none", comms)(x, params, caches, ())
    finally:
        for c in comms.values():
            c.close()
    for op in _COMM_OPS:
        assert op not in texts["none"], op
    # the patterns do find communication: ours in our step, XLA's collectives in XLA's
    assert 'custom_call_target="nvc_' in texts["jax_nvcomm"]
    assert any(op in texts["xla"] for op in _COMM_OPS[:-1])
    h, _ = out
    assert np.isfinite(np.asarray(h, np.float32)).all()


def test_capture_share():
    """capture = (xla - ours) / (xla - bound), only where XLA is 2% or more above the bound."""
    from jax_nvcomm.bench import step
    assert step.capture(2.0, 1.5, 1.0) == 0.5
    assert step.capture(2.0, 1.0, 1.0) == 1.0
    assert step.capture(2.0, 2.2, 1.0) < 0           # slower than XLA
    assert step.capture(1.01, 1.0, 1.0) is None      # XLA within 2% of the bound
    assert step.capture(2.0, None, 1.0) is None and step.capture(2.0, 1.5, None) is None
