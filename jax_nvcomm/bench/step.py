"""`python -m jax_nvcomm.bench step`: the whole jitted model step, jax_nvcomm against XLA's
collectives, in one run: what a user of the package feels.

Runs the example's steps (examples/moe_transformer.py: low-latency TP layout with the fused
all-reduce + RMSNorm, high-throughput DP-attention + EP layout with dispatch/combine,
dp-attn-tp-moe DP-attention + TP-MoE layout with all_gather_v / reduce_scatter_v against padded
lax.all_gather + lax.psum_scatter, prefill unbalanced (rank 0 `tokens`, the others
`decode_tokens`), ep-ragged DP-attention + the dropless EP layer of examples/moe_ragged.py with
nvc.ragged_all_to_all against lax.ragged_all_to_all; decode and prefill) for one or more
presets:
  - example: the example's own dimensions (GPU defaults: hidden 2048, 128 experts top-8);
  - moe-slice: a slice of a published large MoE model's dimensions (hidden 7168, 256 experts
    top-8, expert ffn 2048, 56 heads of 128), with as many layers (1-4) as fit in about 60 GB
    of expert weights per GPU.
For every (preset, layout, phase) row and each implementation:
  - ms: the median wall time of a step (`block_until_ready` after each step; the same compiled
    program and arguments every step), host dispatch included; the implementations' steps run
    in turns, so drift of the machine falls on each alike;
  - bound_ms (unless --no-bound): the same step with its collectives removed (same compute,
    wrong numbers; high-throughput: every local expert gets this rank's tokens in the
    dispatched [world * tokens] layout, no combine exchange; ep-ragged: every rank's group
    sizes taken to be its own, each exchange a local copy), timed in the same turns.
    XLA/bound is the most any collective library could gain over XLA in that row; capture =
    (XLA best - ours) / (XLA best - bound), the share of that gain jax_nvcomm takes (rows with
    XLA/bound >= 1.02 only);
  - from one profiler trace of 4 more steps, the median of the last 3:
    first_kernel_us (when device 0's first kernel starts after the host starts the execution)
    and busy_us (device 0's summed kernel time per step);
  - agreement of the two implementations' outputs (as the example checks it);
  - XLA best (--xla-best): the XLA step compiled with each fast-path flag
    of this XLA that concerns its collectives, timed in the same turns; the fastest of them
    and XLA's default is `xla_best_ms` (`xla_best_flags` names it), `best_ratio` = it / ours;
    on CPU devices it equals XLA's default (the flags do not apply);
  - with several local GPUs, from the same trace, each other device against device 0
    (`<impl>_skew`: when its first kernel starts and its last one ends relative to device 0's,
    and its busy time): a device that starts late makes its peers wait inside collectives.
Writes OUT/bench_<machine>_step.json ({"rows": [...], "meta": {...}}), a text table and a PNG.
On CPU devices the numbers only show that the code runs. Ranks sharing one GPU (launcher
--share-gpu) run jax_nvcomm's steps only (--nvcomm-only): NCCL refuses them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

from . import xla_best
from .common import _hlo_ops, add_xla_best_argument

PRESETS = {
    "example": {},
    "moe-slice": dict(hidden=7168, heads=56, experts=256, top_k=8, ffn=2048, tokens=128,
                      decode_tokens=4, context=256),
}
_SLICE_EXPERT_BYTES_PER_LAYER = 256 * 3 * 7168 * 2048 * 2  # bf16 expert weights, whole model
_WEIGHT_BUDGET_PER_GPU = 60e9


def machine_name(devs) -> str:
    """'h200x2' from the devices' kind and count (cpu8 on 8 CPU devices)."""
    kind = devs[0].device_kind if devs[0].platform != "cpu" else "cpu"
    short = kind.replace("NVIDIA", "").strip().split()[0].lower() if kind != "cpu" else "cpu"
    return f"{short}x{len(devs)}"


def preset_config(name, world, platform, base):
    """The moe_transformer Config of a preset (base: the command line's run options)."""
    import dataclasses
    vals = dict(PRESETS[name])
    if name == "moe-slice":
        if platform == "cpu":  # same shape of model, CPU-sized
            vals = dict(hidden=512, heads=8, experts=64, top_k=8, ffn=128, tokens=32,
                        decode_tokens=4, context=64)
            vals["layers"] = 2
        else:
            fit = int(_WEIGHT_BUDGET_PER_GPU * world // _SLICE_EXPERT_BYTES_PER_LAYER)
            vals["layers"] = max(1, min(4, fit))
    return dataclasses.replace(base, **vals)


def _row(preset, r):
    """One JSON row from a moe_transformer result row."""
    ms = r["ms"]
    tr = r.get("trace") or {}
    out = dict(preset=preset, layout=r["layout"], phase=r["phase"], tokens=r["tokens"],
               counts=r.get("counts"),
               op=r["op"], nvcomm_ms=ms.get("jax_nvcomm"), xla_ms=ms.get("xla"),
               ratio=(ms["xla"] / ms["jax_nvcomm"] if ms.get("xla") and ms.get("jax_nvcomm")
                      else None),
               agree=r["agree"], rel_err=r["err"], bound_ms=ms.get("none"),
               bound_ratio=(ms["xla"] / ms["none"] if ms.get("xla") and ms.get("none")
                            else None),
               sequential_ms=r.get("ms_sequential"))
    # XLA at its best (bench/xla_best.py): the fastest of the XLA step with XLA's flags
    best = r.get("xla_best")
    if best and best.get("ms") is not None:
        out.update(xla_best_ms=best["ms"], xla_best_flags=best["flags"],
                   xla_variants=best.get("variants"), xla_variant_errors=best.get("errors"))
    elif ms.get("xla"):
        out.update(xla_best_ms=ms["xla"], xla_best_flags="default",
                   xla_best_note=("no flag concerns this step's collectives" if best else
                                  "XLA's flags not tried (CPU devices or --xla-best off)"))
    if out.get("xla_best_ms") and ms.get("jax_nvcomm"):
        out["best_ratio"] = out["xla_best_ms"] / ms["jax_nvcomm"]
    # against XLA at its best (XLA's default where no flag was tried)
    out["capture"] = capture(out.get("xla_best_ms"), ms.get("jax_nvcomm"), ms.get("none"))
    for impl, key in (("jax_nvcomm", "nvcomm"), ("xla", "xla")):
        s = tr.get(impl)
        if s:
            out[f"{key}_first_kernel_us"] = s.get("first_kernel_us")
            out[f"{key}_busy_us"] = s.get("busy_us")
            out[f"{key}_host_us"] = s.get("host_us")
            out[f"{key}_kernels"] = s.get("kernels")
            out[f"{key}_trace"] = {k: s[k] for k in ("top", "host_top", "span_us") if k in s}
            if s.get("skew"):
                out[f"{key}_skew"] = {str(d): v for d, v in s["skew"].items()}
    return out


# Rows whose XLA step is within this factor of the no-communication bound have nothing left to
# capture: their capture share is not computed (noise would dominate it).
CAPTURE_MIN_GAP = 1.02


def capture(xla_ms, nvc_ms, bound_ms):
    """The share of XLA's communication time that jax_nvcomm removes: (xla - nvc) / (xla -
    bound), 1.0 = down to the bound, 0 = no gain, < 0 = slower than XLA. None when a time is
    missing or XLA is within CAPTURE_MIN_GAP of the bound."""
    if not xla_ms or not nvc_ms or not bound_ms or xla_ms < CAPTURE_MIN_GAP * bound_ms:
        return None
    return (xla_ms - nvc_ms) / (xla_ms - bound_ms)


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _tok(r) -> str:
    """Tokens per rank: '128', or '128/4' (rank 0 / the others, dp-attn-tp-moe prefill)."""
    c = r.get("counts") or [r["tokens"]]
    return str(c[0]) if len(set(c)) == 1 else f"{c[0]}/{c[1]}"


def format_table(rows) -> str:
    head = (f"{'preset':10} {'layout':16} {'phase':8} {'tok':>5} {'ms nvcomm':>10} "
            f"{'ms XLA':>9} {'XLA/nvc':>8} {'ms XLA best':>11} {'best/nvc':>9} "
            f"{'1st kernel us nvc/XLA':>22} "
            f"{'busy us nvc/XLA':>18} {'agree':>6} {'XLA/bound':>10} {'capture':>8}"
            f"  XLA flags")
    lines = [head]
    for r in rows:
        fk = f"{_fmt(r.get('nvcomm_first_kernel_us'), '.0f')}/" \
             f"{_fmt(r.get('xla_first_kernel_us'), '.0f')}"
        busy = f"{_fmt(r.get('nvcomm_busy_us'), '.0f')}/{_fmt(r.get('xla_busy_us'), '.0f')}"
        bound = _fmt(r.get("bound_ratio"), ".2f") + "x" if r.get("bound_ratio") else "-"
        lines.append(f"{r['preset']:10} {r['layout']:16} {r['phase']:8} {_tok(r):>5} "
                     f"{_fmt(r['nvcomm_ms'], '.3f'):>10} {_fmt(r['xla_ms'], '.3f'):>9} "
                     f"{_fmt(r['ratio'], '.2f') + 'x' if r['ratio'] else '-':>8} "
                     f"{_fmt(r.get('xla_best_ms'), '.3f'):>11} "
                     f"{_fmt(r.get('best_ratio'), '.2f') + 'x' if r.get('best_ratio') else '-':>9} "
                     f"{fk:>22} {busy:>18} {str(r['agree']):>6} {bound:>10} "
                     f"{_fmt(r.get('capture'), '.0%'):>8}"
                     f"  {r.get('xla_best_flags', '-')}")
    return "\n".join(lines)


def plot(rows, path, title):
    from .common import pyplot
    plt = pyplot()
    if plt is None:
        return False
    labels = [f"{r['preset']}\n{r['layout']}\n{r['phase']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 4.5))
    xs = range(len(rows))
    w = 0.4
    ax.bar([x - w / 2 for x in xs], [r["nvcomm_ms"] or 0 for r in rows], w, label="jax_nvcomm")
    ax.bar([x + w / 2 for x in xs], [r["xla_ms"] or 0 for r in rows], w, label="XLA collectives")
    for x, r in zip(xs, rows):
        if r["ratio"]:
            ax.annotate(f"{r['ratio']:.2f}x", (x, max(r["nvcomm_ms"], r["xla_ms"])),
                        ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("ms per step (median wall time)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _variants_of(platform):
    """cfg.xla_variants of the model run: the flags of this XLA that concern the compiled XLA
    step's collectives (bench/xla_best.py)."""
    def variants(compiled):
        ops = xla_best.program_ops({"hlo_ops": _hlo_ops(compiled)})
        return xla_best.variants(ops, platform)
    return variants


def run_step(a) -> int:
    from ..models import moe_transformer as mt
    mt.setup_platform(8)
    import jax
    devs = jax.devices()
    world = len(devs)
    platform = devs[0].platform
    main_proc = jax.process_index() == 0
    if main_proc:
        print(f"bench step: {world} x {platform} ({devs[0].device_kind}), "
              f"{jax.process_count()} process(es), jax {jax.__version__}; "
              f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    machine = a.machine or machine_name(devs)
    os.makedirs(a.out, exist_ok=True)
    trace_root = None if a.no_trace else os.path.join(a.trace_dir or a.out, "traces")
    presets = a.presets or (["example"] if platform == "cpu" else ["example", "moe-slice"])
    # ranks sharing one GPU (launcher --share-gpu): NCCL refuses them, XLA's side cannot run
    shared_gpu = os.environ.get("JAX_NVCOMM_SHARE_GPU") == "1" and jax.process_count() > 1
    nvcomm_only = getattr(a, "nvcomm_only", False) or shared_gpu
    if nvcomm_only and main_proc:
        print("bench step: jax_nvcomm's steps only" + (" (ranks share a GPU: no NCCL)"
                                                        if shared_gpu else ""), flush=True)
    mode = getattr(a, "xla_best", "auto")
    if main_proc:
        for line in xla_best.header_lines(platform, mode):
            print(f"# {line}", flush=True)
    base = mt.Config(iters=a.iters, warmup=a.warmup, quiet=a.quiet, trace_dir=trace_root,
                     impls=("jax_nvcomm",) if nvcomm_only else mt.IMPLS,
                     layouts=tuple(a.layouts), phases=tuple(a.phases),
                     split=True if getattr(a, "split_compare", False) else None,
                     bound=not getattr(a, "no_bound", False),
                     xla_variants=(_variants_of(platform) if xla_best.enabled(mode, platform)
                                   else None))
    rows, ok = [], True
    for name in presets:
        cfg = preset_config(name, world, platform, base)
        if trace_root:
            cfg.trace_dir = os.path.join(trace_root, name)
        try:
            res = mt.run(cfg)
        except (mt.Unavailable, mt.ConfigError) as e:
            print(f"error: preset {name}: {e}", file=sys.stderr)
            return 2
        ok &= res["ok"]
        rows += [_row(name, r) for r in res["rows"]]
        if getattr(a, "split_compare", False) and "high-throughput" in cfg.layouts:
            # the same high-throughput rows with the fused dispatch (shared expert outside
            # it): beside the split rows above, the difference is what the overlap saves
            fused_cfg = dataclasses.replace(cfg, split=False, layouts=("high-throughput",))
            if trace_root:
                fused_cfg.trace_dir = os.path.join(trace_root, name + "-nosplit")
            res = mt.run(fused_cfg)
            ok &= res["ok"]
            rows += [_row(name + " no-split", r) for r in res["rows"]]
        if main_proc:
            rc = res["config"]
            print(f"preset {name}: {rc.layers} layers, hidden {rc.hidden}, {rc.experts} experts "
                  f"top-{rc.top_k}, ffn {rc.ffn}, {rc.dtype}", flush=True)
    if not main_proc:
        return 0 if ok else 1
    best_rows = [dict(r, median_us=r["xla_best_ms"], xla_flags=r["xla_best_flags"],
                      xla_variants={"default": r["xla_ms"], **(r.get("xla_variants") or {})})
                 for r in rows if r.get("xla_best_ms")]
    meta = dict(machine=machine, devices=world, platform=platform,
                xla_best=xla_best.meta(best_rows, platform, mode),
                device_kind=devs[0].device_kind, processes=jax.process_count(),
                jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
                env={k: v for k, v in os.environ.items() if k.startswith("JAX_NVCOMM_")},
                what="wall ms per jitted step (median); first kernel and busy time from a "
                     "profiler trace of 4 steps (median of the last 3), device 0")
    path = os.path.join(a.out, f"bench_{machine}_step.json")
    with open(path, "w") as f:
        json.dump({"rows": rows, "meta": meta}, f, indent=1)
    table = format_table(rows)
    with open(os.path.join(a.out, f"bench_{machine}_step.txt"), "w") as f:
        f.write(table + "\n")
    png = os.path.join(a.out, f"bench_{machine}_step.png")
    plot(rows, png, f"jitted step, {world} x {devs[0].device_kind}")
    if trace_root:
        from .. import _trace
        for r in rows:
            for key in ("nvcomm", "xla"):
                tr = r.get(f"{key}_trace")
                if tr:
                    print(f"{r['preset']} {r['layout']} {r['phase']} {key}: first kernel "
                          f"+{r.get(key + '_first_kernel_us')} us, busy "
                          f"{r.get(key + '_busy_us')} us, host {r.get(key + '_host_us')} us")
                    print(_trace.format_summary(dict(
                        program="step", executions=3, kernels=r.get(key + "_kernels"),
                        host_us=r.get(key + "_host_us"),
                        first_kernel_us=r.get(key + "_first_kernel_us"),
                        busy_us=r.get(key + "_busy_us"), span_us=tr.get("span_us"),
                        top=tr.get("top", []), host_top=tr.get("host_top", []))))
                    for d, v in (r.get(f"{key}_skew") or {}).items():
                        if v:
                            print(f"    device {d} against device 0: first kernel "
                                  f"{v['first_us']:+.0f} us, last kernel ends {v['end_us']:+.0f} us, "
                                  f"busy {v['busy_us']:.0f} us")
    print(f"wrote {path}")
    print(table, flush=True)
    print(xla_best.summary_line(best_rows, platform, mode), flush=True)
    if not ok:
        print("FAILED: jax_nvcomm and XLA disagree in some row (see 'agree')", flush=True)
    return 0 if ok else 1


def add_arguments(s):
    """The flags of `bench step`."""
    s.add_argument("--out", default="bench_out", metavar="DIR",
                   help="directory for the JSON, the text table and the PNG (default: "
                        "bench_out)")
    add_xla_best_argument(s)
    s.add_argument("--presets", nargs="*", choices=sorted(PRESETS),
                   help="model sizes: example (the example's own dimensions), moe-slice "
                        "(hidden 7168, 256 experts top-8, as many layers as fit); default: "
                        "both on GPUs, example on CPU")
    s.add_argument("--layouts", nargs="*", metavar="LAYOUT",
                   default=["low-latency", "high-throughput", "dp-attn-tp-moe", "ep-ragged"],
                   help="which of the example's layouts (default: all four: low-latency, "
                        "high-throughput, dp-attn-tp-moe, ep-ragged)")
    s.add_argument("--phases", nargs="*", default=["decode", "prefill"], metavar="PHASE",
                   help="decode and/or prefill (default: both)")
    s.add_argument("--iters", type=int, default=None, metavar="N",
                   help="timed steps per row and implementation (default: 20 on GPUs, 5 on "
                        "CPU)")
    s.add_argument("--warmup", type=int, default=3, metavar="N",
                   help="untimed steps before the timed ones (default: 3)")
    s.add_argument("--no-trace", action="store_true",
                   help="skip the profiler traces (no first-kernel and busy columns)")
    s.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="where the traces go (default: OUT/traces)")
    s.add_argument("--machine", default=None,
                   help="name in the JSON file name (default: from the devices, e.g. h200x2)")
    s.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    s.add_argument("--nvcomm-only", action="store_true",
                   help="only jax_nvcomm's steps (and the bound), no XLA collectives, so no "
                        "agreement column; the default when ranks share a GPU (NCCL refuses "
                        "them)")
    s.add_argument("--no-bound", action="store_true",
                   help="skip the no-communication bound (the step with its collectives "
                        "removed: the least any collective library could make it cost)")
    s.add_argument("--split-compare", action="store_true",
                   help="high-throughput rows twice: shared expert between the dispatch halves "
                        "(preset name) and with the fused dispatch (preset + ' no-split')")
