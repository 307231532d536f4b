"""Profiler traces of jitted steps: record a few executions, then read where the host and the
device spent them (Perfetto JSON from `jax.profiler.start_trace(dir, create_perfetto_trace=True)`).

Used by `python -m jax_nvcomm.bench step` (and `bench allreduce` / `bench moe` for kernels'
device time). Standard library only for the reading part; traces stay on the machine that made
them and only the summary travels.

Per execution of the program (device 0's host thread, `...Execute(<program>)` events):
  - host_us: the execution's wall time on the host thread;
  - first_kernel_us: when device 0's first kernel of that execution started, from the start of
    the host's execute call (host work before the GPU has anything to run: argument handling,
    command-buffer update and launch);
  - busy_us: the sum of device 0's kernel times in the execution; span_us: first kernel start
    to last kernel end; kernels: count; top: the kernels that took most device time;
  - host_top: the host events of that thread that took longest (command_buffer::update,
    cuGraphLaunch, thunks ...).
"""
from __future__ import annotations

import collections
import functools
import glob
import gzip
import json
import os
import statistics


def record(fn, args, out_dir, steps=3):
    """Run fn(*args) `steps` times under the profiler (after the caller's warm-up); returns
    the Perfetto trace path (None when no trace was written)."""
    import jax
    os.makedirs(out_dir, exist_ok=True)
    jax.profiler.start_trace(out_dir, create_perfetto_trace=True)
    try:
        for _ in range(steps):
            jax.block_until_ready(fn(*args))
    finally:
        jax.profiler.stop_trace()
    paths = sorted(glob.glob(os.path.join(out_dir, "**", "perfetto_trace.json.gz"),
                             recursive=True), key=os.path.getmtime)
    return paths[-1] if paths else None


def _load(path):
    """(complete events, {pid: process name}) of a trace. Cached per (path, mtime, size):
    summarise, device_time and device_skew read the same large file one after another.
    Callers must not mutate the result."""
    st = os.stat(path)
    return _load_file(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _load_file(path, _mtime_ns, _size):
    with gzip.open(path) as f:
        d = json.load(f)
    ev = d["traceEvents"] if isinstance(d, dict) else d
    pname = {e["pid"]: e["args"].get("name", "") for e in ev
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [e for e in ev if e.get("ph") == "X"], pname


def _top(events, n):
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        a = agg[e["name"][:80]]
        a[0] += 1
        a[1] += e["dur"]
    return [dict(name=k, count=c, us=round(s, 1))
            for k, (c, s) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:n]]


def summarise(path, device=0, skip_first=1):
    """Summary dict of the program executed most often in the trace (see the module doc):
    medians over its executions (the first `skip_first` dropped when more remain), and the
    per-execution list."""
    X, pname = _load(path)
    execs = [e for e in X if e["name"].startswith(f"[{device}] ")
             and "Execute" in e["name"] and "(" in e["name"]]
    if not execs:  # older naming: no device prefix
        execs = [e for e in X if "PjRtLoadedExecutable::Execute" in e["name"]]
    names = collections.Counter(e["name"].split("(", 1)[-1].rstrip(")") for e in execs)
    if not names:
        return None
    program = names.most_common(1)[0][0]
    execs = sorted((e for e in execs if e["name"].endswith(f"({program})")),
                   key=lambda e: e["ts"])
    if not execs:  # names without "(program)" (the CPU client's ExecutePrepare ...)
        return None
    gpu = sorted((k for k in X if pname.get(k["pid"], "").endswith(f"GPU:{device}")),
                 key=lambda k: k["ts"])
    per = []
    for i, ex in enumerate(execs):
        t0 = ex["ts"]
        t1 = execs[i + 1]["ts"] if i + 1 < len(execs) else float("inf")
        ks = [k for k in gpu if t0 <= k["ts"] < t1]
        host = [h for h in X if (h["pid"], h["tid"]) == (ex["pid"], ex["tid"])
                and t0 <= h["ts"] < t0 + ex["dur"] and h is not ex]
        row = dict(host_us=round(ex["dur"], 1), kernels=len(ks),
                   host_top=_top(host, 6))
        if ks:
            row.update(first_kernel_us=round(ks[0]["ts"] - t0, 1),
                       busy_us=round(sum(k["dur"] for k in ks), 1),
                       span_us=round(max(k["ts"] + k["dur"] for k in ks) - ks[0]["ts"], 1),
                       top=_top(ks, 8))
        per.append(row)
    use = per[skip_first:] if len(per) > skip_first else per
    med = {k: round(statistics.median(r[k] for r in use), 1)
           for k in ("host_us", "first_kernel_us", "busy_us", "span_us") if all(k in r for r in use)}
    return dict(program=program, executions=len(per), **med,
                kernels=use[-1]["kernels"], top=use[-1].get("top", []),
                host_top=use[-1]["host_top"], per_execution=per)


def device_skew(path, devices, ref=0, skip_first=1):
    """How far the other devices run behind (or ahead of) device `ref` in each execution of its
    most frequent program: per device d of `devices` (local ids), the medians over executions of
    first_us = d's first kernel start - ref's first kernel start, and end_us = d's last kernel
    end - ref's last kernel end (positive: d later), with d's busy_us. Kernels belong to an
    execution when they start between its host start and the next one's (one process driving
    several GPUs launches every device's part from the same execute call). None when the trace
    has no execution of `ref`."""
    X, pname = _load(path)
    s = summarise(path, device=ref, skip_first=0)
    if not s:
        return None
    execs = sorted((e for e in X if e["name"].startswith(f"[{ref}] ")
                    and e["name"].endswith(f"({s['program']})")), key=lambda e: e["ts"])
    starts = [e["ts"] for e in execs] + [float("inf")]

    def spans(dev):
        ks = [k for k in X if pname.get(k["pid"], "").endswith(f"GPU:{dev}")]
        out = []
        for i in range(len(execs)):
            w = [k for k in ks if starts[i] <= k["ts"] < starts[i + 1]]
            out.append((min(k["ts"] for k in w), max(k["ts"] + k["dur"] for k in w),
                        sum(k["dur"] for k in w)) if w else None)
        return out

    base = spans(ref)
    res = {}
    for d in devices:
        if d == ref:
            continue
        pairs = [(a, b) for a, b in zip(base, spans(d)) if a and b]
        pairs = pairs[skip_first:] if len(pairs) > skip_first else pairs
        if not pairs:
            res[d] = None
            continue
        res[d] = dict(first_us=round(statistics.median(b[0] - a[0] for a, b in pairs), 1),
                      end_us=round(statistics.median(b[1] - a[1] for a, b in pairs), 1),
                      busy_us=round(statistics.median(b[2] for _, b in pairs), 1))
    return res


def _num(v):
    return "-" if v is None else f"{v:.0f}"


def format_summary(s) -> str:
    """A few lines of text for a summary dict (missing numbers print as '-')."""
    if not s:
        return "    (no executions in the trace)"
    lines = [f"    {s['program']}: {s['executions']} executions; median host "
             f"{_num(s.get('host_us'))} us, first kernel at +{_num(s.get('first_kernel_us'))} us, "
             f"device busy {_num(s.get('busy_us'))} us over a span of {_num(s.get('span_us'))} us, "
             f"{s.get('kernels')} kernels"]
    lines.append("    host events: " + "; ".join(
        f"{h['name'][:40]} {h['us']:.0f} us x{h['count']}" for h in (s.get("host_top") or [])[:4]))
    lines.append("    kernels: " + "; ".join(
        f"{k['name'][:40]} {k['us']:.0f} us x{k['count']}" for k in (s.get("top") or [])[:4]))
    return "\n".join(lines)


def device_time(path, device=0):
    """Device `device`'s kernels in the LAST execution of the trace's most executed program
    (from `summarise`): dict(busy_us = sum of its kernel durations, kernels = their count,
    top = [{name, count, us}] of the kernels that took most time, executions, program).
    busy_us is None when that execution ran no kernel on the device (a CPU run: no device
    kernels in the trace); None when the trace has no execution of a program."""
    s = summarise(path, device=device, skip_first=0)
    if not s or not s.get("per_execution"):
        return None
    last = s["per_execution"][-1]
    return dict(program=s["program"], executions=s["executions"],
                busy_us=last.get("busy_us"), kernels=last["kernels"],
                top=last.get("top", []))
