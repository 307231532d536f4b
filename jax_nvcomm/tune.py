"""`python -m jax_nvcomm.tune`: measure on the machine at hand where each all-reduce strategy
beats XLA, and write a tuning file that every `Communicator` of this machine then uses
(format and precedence: docs/tuning.md).

For each world size (powers of two from 1 to the local devices; a launcher job: the job's
world), op (all_reduce, all_reduce_rms_norm, all_reduce_rms_norm_quant) and dtype (bfloat16,
float16, float32), over message sizes from 4 KiB doubling up to --max-bytes (shapes
[tokens, hidden] with hidden 4096 elements, fewer for the smallest sizes), it times the
one-shot and the two-shot kernel against XLA's own path (lax.psum, + XLA's add + RMSNorm
(+ FP8 quantisation)) with the loop programs of `python -m jax_nvcomm.bench allreduce`,
and keeps per row:
  world size >= 2: one-shot up to the last size of the leading run where it is fastest,
    two-shot up to the last size after it where it beats XLA;
  world size 1 (no communication): local_min_bytes, the smallest size from which our kernel
    beats XLA by >= 5% at every larger measured size (plain all_reduce: never,
    lax.psum over one device is compiled away).
The baseline is XLA under this process's flags (XLA_FLAGS: tune with the flags your jobs
use); --baseline xla-best takes the fastest of XLA's fast-path flags instead.

Writes the file (default: this machine's cache file, named under --out), a summary
table and a PNG of the measurements beside the file. Ranks sharing a GPU are no timing basis:
it refuses to run there. On CPU devices it runs (--quick for tests) and marks the file as CPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from types import SimpleNamespace

from . import tuning
from .bench.allreduce import AR_METHODS, BEST, FUSED_METHODS, QUANT_METHODS, crossover
from .bench.common import _human, byte_size

SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
HIDDEN = 4096  # elements per row of the measured shapes
# (one-shot method, two-shot method, XLA's method) per op, as bench/allreduce.py names them
METHODS = dict(zip(tuning.OPS, (AR_METHODS, FUSED_METHODS, QUANT_METHODS)))


def sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """min_bytes, min_bytes * factor, ... up to max_bytes."""
    out, b = [], min_bytes
    while b <= max_bytes:
        out.append(b)
        b *= factor
    return out


def shape_of(nbytes: int, itemsize: int) -> tuple[int, int]:
    """(tokens, hidden) of a message of nbytes: hidden HIDDEN elements (the whole message below
    one row), tokens a power of two."""
    elems = nbytes // itemsize
    hidden = min(HIDDEN, elems)
    return elems // hidden, hidden


# World size 1: a point counts as ours only when ours is faster by this share. Small messages
# take a few microseconds either way and the loop's per-call overhead is of the same order, so
# a smaller lead is inside the noise: on one H200 (2026-12-01) single points at 32-128 KiB
# flipped between runs while every size from 512 KiB up won by 9% or more.
LOCAL_MARGIN = 0.05


def local_min(by: dict, ours: str, base: str, margin: float = LOCAL_MARGIN) -> int | None:
    """World size 1: the smallest measured size from which `ours` beats `base` by at least
    `margin` (a share of base's time) at every larger measured size; None when it does not at
    the largest (or was not measured there)."""
    inf = float("inf")
    best = None
    for s in sorted(by, reverse=True):
        t = by[s]
        o, b = t.get(ours, inf), t.get(base, inf)
        if o < inf and o <= b * (1.0 - margin):
            best = s
        else:
            break
    return best


def duplicated(devices_by_process: dict) -> list[str]:
    """The devices (UUIDs) that several processes or ranks use: {process: [uuid, ...]} ->
    ["GPU <uuid> in processes 0, 1", ...]."""
    seen: dict[str, list] = {}
    for p, uuids in sorted(devices_by_process.items()):
        for u in uuids:
            seen.setdefault(u, []).append(p)
    return [f"GPU {u} in processes {', '.join(map(str, ps))}" for u, ps in seen.items()
            if len(ps) > 1]


def sharing(env) -> str | None:
    """Why this job's ranks share a device (no timing basis), or None."""
    if os.environ.get("JAX_NVCOMM_SHARE_GPU") == "1":
        return ("JAX_NVCOMM_SHARE_GPU=1: the launcher's --share-gpu runs every rank on one GPU, "
                "time-sliced")
    if env.platform == "cpu":
        return None
    from . import _exchange, topology
    from .communicator import DEFAULT_SETUP_TIMEOUT_S
    import jax
    try:
        mine = [topology.query_device(int(d.local_hardware_id)).uuid
                for d in jax.local_devices()]
    except Exception as e:  # noqa: BLE001 - no cuda-python: cannot tell
        env.log(f"# NOTE: cannot check for ranks sharing a GPU ({type(e).__name__}: {e})")
        return None
    by = dict(enumerate(json.loads(raw) for raw in _exchange.gather(
        "jax_nvcomm/tune/devices", json.dumps(mine).encode(), DEFAULT_SETUP_TIMEOUT_S, "GPUs")))
    dup = duplicated(by)
    if len(set(mine)) < len(mine):
        dup.append("one process's devices repeat a GPU")
    return f"ranks share GPUs: {'; '.join(dup)}" if dup else None


def plan(env, a) -> list[tuple[int, str, str, int]]:
    """(world, op, dtype, bytes) to measure, in order."""
    worlds = a.worlds or ([env.world] if env.nprocs > 1 else
                          [w for w in (1, 2, 4, 8, 16, 32, 64) if w <= env.world])
    out = []
    for w in worlds:
        for dt in a.dtypes:  # the first dtype's rows of every op first (bf16 by default)
            for op in a.ops:
                if w == 1 and op == "all_reduce":
                    continue  # lax.psum over one device is compiled away: XLA always wins
                for b in sizes(a.min_bytes, a.max_bytes, a.factor):
                    out.append((w, op, dt, b))
    return out


def _timing(a, cpu):
    """The loop programs' sizes: 1 + unroll * steps calls each, `reps` runs. The host's cost
    of a run falls on both methods of a point alike, so a crossover (the sign of their
    difference) needs fewer calls than the absolute times of `bench allreduce`."""
    return SimpleNamespace(reps=a.reps or (3 if cpu or a.quick else 5),
                           unroll=a.unroll or (2 if cpu else 10),
                           steps=a.steps or (2 if cpu else 5), device_time_on=False,
                           xla_best="on" if a.baseline == "xla-best" else "off", methods=None)


def _base_method(op, baseline):
    m = METHODS[op][-1]
    return BEST[m] if baseline == "xla-best" else m


def measure(env, a, points, t, done=None) -> list[dict]:
    """Rows of bench/allreduce.py `_ar_point` for every planned point, one progress line
    each; done(rows, points measured) after each (world, op, dtype) group."""
    import jax.numpy as jnp

    from .bench.allreduce import _ar_point
    from .bench.common import _close, _open_comm
    rows, n = [], len(points)
    worlds = sorted({p[0] for p in points})
    i = 0
    for w in worlds:
        mesh = env.mesh(w)
        comm = _open_comm(env, mesh, a.max_bytes)
        if comm is None:
            raise RuntimeError(f"jax_nvcomm tune: no Communicator for world {w} (see above)")
        try:
            for k, (pw, op, dt, b) in enumerate(points):
                if pw != w:
                    continue
                i += 1
                tokens, hidden = shape_of(b, jnp.dtype(dt).itemsize)
                ms = METHODS[op]
                want = set(ms[1:] if w == 1 else ms)  # world 1: both names run one kernel
                got = _ar_point(env, comm, mesh, hidden, tokens, t, methods=want,
                                dtype=dt, quiet=True)
                for r in got:
                    r.update(op=op)
                rows += got
                cells = ", ".join(
                    f"{r['method']} {r['median_us']:.1f}" if "median_us" in r else
                    f"{r['method']} {'skipped' if 'skipped' in r else 'error'}"
                    for r in got)
                env.log(f"[{i}/{n}] world {w} {op} {SHORT.get(dt, dt)} {_human(b)} "
                        f"({tokens}x{hidden}): {cells} us")
                if done and (k + 1 == len(points) or points[k + 1][:3] != (pw, op, dt)):
                    done(rows, points[:k + 1])
        finally:
            _close(comm)
    return rows


def table_rows(rows, points, baseline) -> list[dict]:
    """The tuning file's rows from the measurements."""
    by: dict = {}
    for r in rows:
        if "median_us" in r:
            by.setdefault((r["world"], r["op"], r["dtype"]), {}).setdefault(
                r["bytes"], {})[r["method"]] = r["median_us"]
    keys = {(w, op, dt) for w, op, dt, _ in points}
    # the plain all_reduce at world 1: not measured, always XLA
    keys |= {(1, "all_reduce", dt) for w, _, dt in keys if w == 1}
    out = []
    for w, op, dt in sorted(keys, key=lambda k: (k[0], tuning.OPS.index(k[1]), k[2])):
        ms = METHODS[op]
        base = _base_method(op, baseline)
        t = by.get((w, op, dt), {})
        span = (f"{_human(min(t))} .. {_human(max(t))}" if t else "nothing measured")
        row = dict(world_size=w, op=op, dtype=dt, oneshot_max_bytes=0, twoshot_max_bytes=0,
                   local_min_bytes=None)
        if w == 1 and op == "all_reduce":
            row["note"] = "lax.psum over one device is compiled away: XLA always"
        elif w == 1:
            row["local_min_bytes"] = local_min(t, ms[1], base)
            lm = row["local_min_bytes"]
            row["note"] = (f"our kernel vs {base} over {span}: " +
                           ("never faster" if lm is None else f"faster from {_human(lm)}"))
        else:
            one, two = crossover(t, ms[0], ms[1], base)
            row.update(oneshot_max_bytes=int(one), twoshot_max_bytes=int(two))
            row["note"] = f"vs {base} over {span}"
        out.append(row)
    return out


def format_summary(rows) -> str:
    def b(v):
        return "-" if not v else _human(v)
    head = ["world", "op", "dtype", "one-shot <=", "two-shot <=", "ours from (world 1)"]
    body = [[str(r["world_size"]), r["op"], r["dtype"],
             b(r["oneshot_max_bytes"]) if r["world_size"] > 1 else "-",
             b(r["twoshot_max_bytes"]) if r["world_size"] > 1 else "-",
             ("-" if r["world_size"] > 1 else "never" if r["local_min_bytes"] is None
              else _human(r["local_min_bytes"]))] for r in rows]
    widths = [max(len(h), *(len(x[i]) for x in body)) if body else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(x, widths)).rstrip() for x in body]
    return "\n".join(lines)


def document(env, a, t, rows, meas) -> dict:
    import jax
    from .bench import xla_best
    fp = tuning.fingerprint(jax.local_devices())
    machine = dict(fp, host=os.uname().nodename, processes=env.nprocs,
                   tuned_worlds=sorted({r["world_size"] for r in rows}),
                   xla_flags=os.environ.get("XLA_FLAGS", ""))
    doc = dict(format=tuning.FORMAT, machine=machine,
               created=datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds"),
               tool="python -m jax_nvcomm.tune " + " ".join(sys.argv[1:]),
               baseline=a.baseline, quick=bool(a.quick),
               timing=dict(unroll=t.unroll, steps=t.steps, reps=t.reps,
                           what="loop us per call, median over reps (bench/common.py)"),
               allreduce=rows)
    if env.platform == "cpu":
        doc["note"] = ("CPU devices: the host backend's numbers, meaningless for GPUs; the file "
                       "applies only to this CPU setup (its fingerprint)")
    if a.baseline == "xla-best":
        doc["xla_best"] = xla_best.meta(meas, env.platform, "on")
    doc["measurements"] = [
        {k: r[k] for k in ("world", "op", "dtype", "bytes", "tokens", "hidden", "method",
                           "median_us", "p10_us", "p90_us", "xla_flags", "skipped", "error")
         if k in r} for r in meas]
    return doc


def plot(env, path, meas):
    from .bench.common import _plot
    series: dict = {}
    for r in meas:
        if "median_us" in r:
            series.setdefault(f"world {r['world']}, {r['op']}", {}).setdefault(
                f"{r['method']} {SHORT.get(r['dtype'], r['dtype'])}", []).append(
                    (r["bytes"], r["median_us"]))
    d, name = os.path.split(os.path.splitext(os.path.abspath(path))[0] + ".png")
    return _plot(env, d, name, series, f"tune ({env.platform})", "message bytes per rank")


def adopt(src: str, into: str, worlds) -> dict:
    """`into` (a tuning file, e.g. the built-in table) with the rows of `src` of `worlds`
    (all when empty) in place of its rows of the same world, op and dtype, each with a note
    naming the machine and date they were measured on. Written back to `into`. A file
    measured on CPU devices is refused (ValueError)."""
    with open(into, encoding="utf-8") as f:
        doc = json.load(f)
    tuning.validate(doc, into)
    with open(src, encoding="utf-8") as f:
        new = json.load(f)
    rows = tuning.validate(new, src)["rows"]
    m = new.get("machine") or {}
    if m.get("platform") == "cpu":
        raise ValueError(f"{src}: measured on CPU devices (machine.platform 'cpu'): its rows "
                         "say nothing about GPUs; not adopted")
    where = (f"measured by `python -m jax_nvcomm.tune` on {m.get('device_count')} x "
             f"{m.get('device_kind')} ({m.get('platform')}, link {m.get('link')}, driver "
             f"{m.get('driver')}, jax {m.get('jax')}), {new.get('created', '?')}"
             + (" (a run stopped before its end)" if new.get("complete") is False else ""))
    take = [(r, raw) for r, raw in zip(rows, new["allreduce"])
            if not worlds or r.world_size in worlds]
    if not take:
        raise ValueError(f"{src}: no rows of world sizes {sorted(worlds)}")
    keys = {(r.world_size, r.op, r.dtype) for r, _ in take}
    kept = [raw for raw in doc["allreduce"]
            if (raw["world_size"], raw["op"], raw["dtype"]) not in keys]
    added = []
    for r, raw in take:
        note = raw.get("note")
        added.append(dict(r.to_dict(), note=[where] + ([note] if isinstance(note, str)
                                                       else list(note or []))))
    order = {op: i for i, op in enumerate((tuning.ANY,) + tuning.OPS)}
    doc["allreduce"] = sorted(kept + added, key=lambda x: (
        x["world_size"], order[x["op"]], "" if x["dtype"] == tuning.ANY else x["dtype"]))
    tuning.validate(doc, into)
    with open(into, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    return doc


def _parser():
    p = argparse.ArgumentParser(prog="python -m jax_nvcomm.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="bfloat16 only, sizes 4 KiB .. 1 MiB (x4 steps), fewer runs; on CPU "
                        "devices tiny sizes (a test run)")
    p.add_argument("--out", default=None,
                   help=f"the tuning file to write (default: this machine's cache file, "
                        f"{tuning.cache_path()}); the PNG goes beside it")
    p.add_argument("--worlds", type=int, nargs="*", help="world sizes (default: 1, 2, 4, ... "
                   "up to the local devices; a launcher job: the whole job)")
    p.add_argument("--ops", nargs="*", choices=tuning.OPS, default=None,
                   help="ops to measure (default: all three)")
    p.add_argument("--dtypes", nargs="*", choices=tuning.DTYPES, default=None,
                   help="dtypes to measure (default: all three; --quick: bfloat16)")
    p.add_argument("--min-bytes", type=byte_size, default=4 << 10, metavar="SIZE",
                   help="smallest message per rank, e.g. 4KiB or 4096 (default 4 KiB)")
    p.add_argument("--max-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="largest message, e.g. 1MiB (default 64 MiB; --quick 1 MiB; CPU 16 KiB)")
    p.add_argument("--baseline", choices=("xla", "xla-best"), default="xla",
                   help="default xla: XLA under this process's flags (what strategy 'xla' runs in "
                        "jobs with the same XLA_FLAGS); xla-best: the fastest of XLA's "
                        "fast-path flags per point (more compilations)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed runs of each program, median taken (default 5; --quick or "
                        "CPU: 3)")
    p.add_argument("--unroll", type=int, default=None,
                   help="calls unrolled in one loop step (default 10; CPU: 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="loop steps per program (default 5; CPU: 2)")
    # maintainers (docs/tuning.md, "The built-in table"): copy a tuning file's rows (of
    # --worlds) into a table, e.g. jax_nvcomm/tuning_builtin.json of a source checkout, replacing
    # rows of the same world, op and dtype; not shown in --help
    p.add_argument("--adopt", metavar="FILE", default=None, help=argparse.SUPPRESS)
    p.add_argument("--into", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    if a.adopt:
        if not a.into:
            print("jax_nvcomm tune: --adopt needs --into (the table to update)", file=sys.stderr)
            return 2
        doc = adopt(a.adopt, a.into, set(a.worlds or ()))
        print(f"updated {a.into}: {len(doc['allreduce'])} rows")
        return 0
    from .bench.common import Env, _setup_env
    _setup_env()
    env = Env()
    cpu = env.platform == "cpu"
    why = sharing(env)
    if why:
        env.log(f"jax_nvcomm tune: refusing to tune: {why}. Ranks sharing a GPU are no timing "
                "basis (their kernels are time-sliced); run it with one process per GPU, or "
                "one process driving all GPUs, and no --share-gpu")
        return 2
    a.ops = a.ops or list(tuning.OPS)
    a.dtypes = a.dtypes or (["bfloat16"] if a.quick or cpu else list(tuning.DTYPES))
    a.max_bytes = a.max_bytes or ((16 << 10) if cpu else (1 << 20) if a.quick else (64 << 20))
    a.factor = 4 if a.quick and not cpu else 2
    if a.max_bytes < a.min_bytes or a.min_bytes < 16:
        env.log(f"jax_nvcomm tune: need 16 <= --min-bytes <= --max-bytes, got {a.min_bytes} "
                f"and {a.max_bytes}")
        return 2
    bad = [w for w in (a.worlds or ()) if not 1 <= w <= env.world or
           (env.nprocs > 1 and w != env.world)]
    if bad:
        env.log(f"jax_nvcomm tune: --worlds {bad}: this job has {env.world} devices" + (
            f" in {env.nprocs} processes, which tune the whole job's world only"
            if env.nprocs > 1 else ""))
        return 2
    t = _timing(a, cpu)
    points = plan(env, a)
    out = a.out or tuning.cache_path()
    env.log(f"# jax_nvcomm tune: {env.world} x {env.devices[0].device_kind} ({env.platform}), "
            f"{env.nprocs} process(es); {len(points)} points (world, op, dtype, size), "
            f"{t.unroll} x {t.steps} calls per program, {t.reps} runs; baseline {a.baseline}; "
            f"writing {out}")
    if cpu:
        env.log("# NOTE: CPU devices: the numbers only show that tuning works; the file is "
                "marked as CPU and applies to nothing else")
    t0 = time.perf_counter()

    def save(meas, done_points, complete):
        """The file from the groups measured so far (rows of the others come from the
        built-in table when it is used before the run ends); process 0 only."""
        rows = table_rows(meas, done_points, a.baseline)
        if env.is_main:
            doc = document(env, a, t, rows, meas)
            doc["complete"] = complete
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out + ".tmp", "w", encoding="utf-8") as f:
                f.write(json.dumps(doc, indent=1) + "\n")
            os.replace(out + ".tmp", out)
        return rows

    meas = measure(env, a, points, t, done=lambda m, p: save(m, p, complete=False))
    rows = save(meas, points, complete=True)
    if not env.is_main:
        return 0
    env.log("\n## tuning rows (bytes per rank; world 1: from which size our kernel beats XLA)")
    env.log(format_summary(rows))
    w1 = [r for r in rows if r["world_size"] == 1]
    if w1 and cpu:
        env.log("\n# world-1 rows (measured on CPU devices: `--adopt` refuses this file for the "
                "built-in table, which holds GPU rows):")
    elif w1:
        env.log("\n# world-1 rows (the built-in table takes them with `python -m jax_nvcomm.tune "
                f"--adopt {out} --worlds 1 --into jax_nvcomm/tuning_builtin.json`):")
    for r in w1:
        env.log("#   " + json.dumps({k: v for k, v in r.items() if k != "note"}))
    plot(env, out, meas)
    env.log(f"# wrote {out} ({time.perf_counter() - t0:.0f} s of measuring)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
