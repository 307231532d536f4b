"""XLA at its best: the fast paths the installed XLA offers for the collectives a program uses
(debug options passed per compilation, `compiled = lowered.compile(compiler_options={...})`),
found out once per process (`available`) and tried per program (`best`), so that a benchmark
compares jax_nvcomm with the best a JAX user gets from XLA's own flags, not only its defaults.

Candidates (`CANDIDATES`; names and values as jaxlib 0.11.2 and 0.12 accept them, probed with
compiler_options: an unknown name raises "No such compile option", a repeated enum takes one
full enum name per compilation):
  collective-kernels  xla_gpu_experimental_use_collective_kernels=COLLECTIVE_KERNEL_ALL_REDUCE:
                      XLA's own one-shot / two-shot all-reduce kernels instead of NCCL
  one-shot-ar         xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true: the deprecated
                      name of the same (adds ALL_REDUCE to the filter); tried only where the
                      first is missing
  ag-kernels          the same filter with COLLECTIVE_KERNEL_ALL_GATHER (all-gather)
  nccl-symmetric      xla_gpu_experimental_enable_nccl_symmetric_buffers=true: NCCL symmetric
                      buffer registration for the collectives' buffers
  ragged-one-shot     xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=true (XLA's
                      one-process ragged all-to-all kernel; on by default in these versions)
  ragged-device       xla_gpu_experimental_ragged_all_to_all_use_device_kernel=true: the
                      device-initiated (NCCL GIN + LSA) ragged all-to-all, needs NCCL >= 2.29
  ragged-symmetric    xla_gpu_ragged_all_to_all_mode=COLLECTIVES_SYMMETRIC_MEMORY: the
                      put/signal path of ragged all-to-all
A program is compiled with XLA's defaults, with each available flag that concerns one of its
collectives, and with all of those together (one value per option name); the fastest counts.
On CPU devices the flags do not apply: the best is the default, with a note. A flag that only
acts when set in XLA_FLAGS at process start would show here as no gain: set it in XLA_FLAGS
for the whole run to measure that (the header records XLA_FLAGS).

Each process runs every variant in the same order (collectives), so every variant is
measured by every process; which one was fastest is only reported.

Use from a benchmark (one call per XLA method and point):
    row = _measure(env, name, ...)                                   # XLA's defaults
    best_row = xla_best.best(env, name + " best", lambda opts: _measure(
        env, name, ..., compiler_options=opts, device_time=False), default=row, mode=a.xla_best)
"""
from __future__ import annotations

import dataclasses
import os

from .common import switch

COLLECTIVES = frozenset(("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                         "ragged-all-to-all", "collective-permute"))
HELPED = 0.97  # a variant "helped" where its median is below 97% of the default's


@dataclasses.dataclass(frozen=True)
class Flag:
    """One fast path: its label, the compiler options that turn it on, the HLO collectives it
    concerns, and (alias_of) a candidate that does the same, tried instead when available."""
    label: str
    options: tuple
    ops: frozenset
    about: str
    alias_of: str | None = None

    @property
    def as_dict(self) -> dict:
        return dict(self.options)


CANDIDATES = (
    Flag("collective-kernels",
         (("xla_gpu_experimental_use_collective_kernels", "COLLECTIVE_KERNEL_ALL_REDUCE"),),
         frozenset({"all-reduce"}), "XLA's one-shot/two-shot all-reduce kernels"),
    Flag("one-shot-ar", (("xla_gpu_unsupported_use_all_reduce_one_shot_kernel", True),),
         frozenset({"all-reduce"}), "XLA's one-shot all-reduce kernel (deprecated name)",
         alias_of="collective-kernels"),
    Flag("ag-kernels",
         (("xla_gpu_experimental_use_collective_kernels", "COLLECTIVE_KERNEL_ALL_GATHER"),),
         frozenset({"all-gather"}), "XLA's all-gather kernels"),
    Flag("nccl-symmetric", (("xla_gpu_experimental_enable_nccl_symmetric_buffers", True),),
         COLLECTIVES, "NCCL symmetric buffer registration"),
    Flag("ragged-one-shot",
         (("xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel", True),),
         frozenset({"ragged-all-to-all"}), "XLA's one-shot ragged all-to-all kernel"),
    Flag("ragged-device",
         (("xla_gpu_experimental_ragged_all_to_all_use_device_kernel", True),),
         frozenset({"ragged-all-to-all"}), "device-initiated ragged all-to-all (NCCL >= 2.29)"),
    Flag("ragged-symmetric",
         (("xla_gpu_ragged_all_to_all_mode", "COLLECTIVES_SYMMETRIC_MEMORY"),),
         frozenset({"ragged-all-to-all"}), "symmetric-memory (put/signal) ragged all-to-all"),
)

_found: dict = {}


def _platform():
    import jax
    return jax.devices()[0].platform


def available(platform: str | None = None) -> dict[str, str]:
    """{label: "ok" or why it is not tried}, found out once per process: a tiny program
    compiled with each candidate's options; an unknown name or value is refused by XLA."""
    platform = platform or _platform()
    if platform in _found:
        return dict(_found[platform])
    out = {}
    if platform == "cpu":
        out = {f.label: "CPU devices: XLA's GPU collective flags do not apply"
               for f in CANDIDATES}
    else:
        import jax
        import jax.numpy as jnp
        lowered = jax.jit(lambda v: v + 1).lower(jnp.ones(8, jnp.float32))
        for f in CANDIDATES:
            try:
                lowered.compile(compiler_options=f.as_dict)
                out[f.label] = "ok"
            except Exception as e:  # noqa: BLE001 - XLA's own error type
                text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                out[f.label] = ("not in this XLA" if "No such compile option" in text
                                else f"refused: {text[:160]}")
        for f in CANDIDATES:
            if f.alias_of and out.get(f.alias_of) == "ok" and out[f.label] == "ok":
                out[f.label] = f"same as {f.alias_of} in this XLA: not tried separately"
    _found[platform] = out
    return dict(out)


def program_ops(row) -> set[str]:
    """The collectives of a measured program (its row's `hlo_ops`, bench/common.py)."""
    return {op for op, n in (row.get("hlo_ops") or {}).items() if n and op in COLLECTIVES}


def variants(ops, platform: str | None = None) -> list[tuple[str, dict]]:
    """[(label, compiler_options)] to try for a program with collectives `ops`, the defaults
    not included: each available flag that concerns one of them, then all of them together
    (one value per option name: the first flag's) when there are several."""
    ok = available(platform)
    flags = [f for f in CANDIDATES if ok.get(f.label) == "ok" and f.ops & set(ops)]
    out = [(f.label, f.as_dict) for f in flags]
    if len(flags) > 1:
        merged, labels = {}, []
        for f in flags:
            if not set(f.as_dict) & set(merged):
                merged.update(f.as_dict)
                labels.append(f.label)
        if len(labels) > 1:
            out.append(("+".join(labels), merged))
    return out


def enabled(mode: str | None, platform: str) -> bool:
    """--xla-best: "on", "off", or "auto" (on where the flags can apply: not CPU)."""
    return switch(mode or "auto", platform != "cpu")


def wanted(mode: str | None) -> bool:
    """Whether a benchmark adds the "<XLA method> best" row of each measured XLA method: unless
    --xla-best is off. Where no flag is tried (CPU devices, nothing that concerns the program's
    collectives) the row is XLA's default with a note (`best`)."""
    return (mode or "auto") != "off"


def best(env, name: str, measure, default: dict | None = None, mode: str | None = "auto"
         ) -> dict:
    """The "XLA best" row of one program: `measure(compiler_options or None) -> row` (a row
    of bench/common.py `_measure`: median_us or error, hlo_ops) run with XLA's defaults
    (unless `default`, that row, is given) and with each `variants` entry for the program's
    collectives; a copy of the fastest row, with method=name, xla_flags (the winner's label,
    "default" when no flag was faster), xla_options (its compiler options), xla_variants
    ({label: median us or "error: ..."}), and xla_best_note where no flag was tried."""
    if default is None:
        default = measure(None)
    row = dict(default, method=name, xla_flags="default", xla_options={},
               xla_variants={"default": _us(default)})
    if "median_us" not in default:
        row["xla_best_note"] = "XLA's default failed"
        return row
    if env.platform == "cpu":
        row["xla_best_note"] = "CPU devices: XLA's GPU collective flags do not apply"
        return row
    if not enabled(mode, env.platform):
        row["xla_best_note"] = "--xla-best off"
        return row
    ops = program_ops(default)
    tries = variants(ops, env.platform)
    if not tries:
        row["xla_best_note"] = ("no collective in the program" if not ops else
                                f"no available flag concerns {', '.join(sorted(ops))}")
        return row
    fastest = default
    for label, opts in tries:
        r = measure(opts)
        row["xla_variants"][label] = _us(r)
        if "median_us" in r and r["median_us"] < fastest["median_us"]:
            fastest, row["xla_flags"], row["xla_options"] = r, label, opts
    for k in ("median_us", "p10_us", "p90_us", "hlo_ops"):
        if k in fastest:
            row[k] = fastest[k]
    if fastest is not default:  # the default's device time is not the winner's
        for k in ("device_us", "device_kernels_per_call", "device_top", "op_device_us"):
            row.pop(k, None)
    return row


def _us(r):
    if "median_us" in r:
        return round(r["median_us"], 3)
    return f"error: {r.get('error', r.get('skipped', '?'))}"


def header_lines(platform: str, mode: str | None) -> list[str]:
    """What the benchmark's header says about the XLA-best column."""
    if platform == "cpu":
        return ["XLA best: CPU devices: XLA's GPU collective flags do not apply; the column "
                "equals XLA's default"]
    if not enabled(mode, platform):
        return ["XLA best: off (--xla-best off): the column equals XLA's default"]
    ok = available(platform)
    flags = {f.label: f for f in CANDIDATES}
    yes = [f"{k} ({', '.join(f'{n}={v}' for n, v in flags[k].options)})"
           for k, v in ok.items() if v == "ok"]
    no = [f"{k}: {v}" for k, v in ok.items() if v != "ok"]
    return ([f"XLA best: per program the fastest of XLA's default and these flags of this XLA "
             f"that concern its collectives (and all of them together): {'; '.join(yes) or 'none'}"]
            + ([f"XLA best: not tried: {'; '.join(no)}"] if no else [])
            + [f"XLA_FLAGS at start: {os.environ.get('XLA_FLAGS', '')!r}"])


def meta(rows, platform: str, mode: str | None) -> dict:
    """For the JSON: the candidates and their availability, and per flag how many of the
    rows it won and in how many it beat the default by more than 3% ("helped")."""
    won, helped = {}, {}
    for r in rows:
        if "xla_variants" not in r:
            continue
        won[r["xla_flags"]] = won.get(r["xla_flags"], 0) + 1
        base = r["xla_variants"].get("default")
        if r["xla_flags"] != "default" and isinstance(base, float) and \
                r["median_us"] < HELPED * base:
            helped[r["xla_flags"]] = helped.get(r["xla_flags"], 0) + 1
    return dict(mode=mode or "auto", enabled=enabled(mode, platform) and platform != "cpu",
                candidates={f.label: dict(f.options) for f in CANDIDATES},
                available=available(platform), fastest=won, helped=helped,
                xla_flags_env=os.environ.get("XLA_FLAGS", ""))


def summary_line(rows, platform: str, mode: str | None) -> str:
    """One line for the end of a benchmark: which flags were tried and which helped."""
    m = meta(rows, platform, mode)
    if not m["enabled"]:
        return "# XLA best: equals XLA's default here (" + (
            "CPU devices" if platform == "cpu" else "--xla-best off") + ")"
    tried = [k for k, v in m["available"].items() if v == "ok"]
    helped = ", ".join(f"{k} ({n} rows)" for k, n in sorted(m["helped"].items())) or "none"
    return (f"# XLA best: flags available here: {', '.join(tried) or 'none'}; faster than "
            f"XLA's default by > {100 - 100 * HELPED:.0f}%: {helped}")
