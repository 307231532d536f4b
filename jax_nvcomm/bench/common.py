"""What every benchmark shares: the job (`Env`: devices, world, platform, the reporting
process), the loop program that chains calls (`_program`), timing (`_time`, device time from a
profiler trace: `_device_time`), tables (`_pivot`, `_cell`, `_ratio`), JSON and plots.
The method of the loop benchmarks is described in jax_nvcomm/bench/__init__.py.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

# --------------------------------------------------------------------------- environment


def _setup_env():
    """CPU fallback (8 host devices) when no GPU is visible and no platform was chosen; never
    touches NCCL or multicast settings. Runs before any backend starts (`python -m` has
    imported jax through the package already, so the platform goes through jax.config)."""
    if os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_NVCOMM_LAUNCHED"):
        return  # chosen by the user or by the launcher
    try:
        import subprocess
        has_gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                 timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        has_gpu = False
    if has_gpu:
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")


class Env:
    """The job: devices, world, platform, whether this process reports."""

    def __init__(self):
        import jax

        import jax_nvcomm as nvc
        nvc.distributed_initialize()
        self.jax = jax
        self.nvc = nvc
        self.devices = jax.devices()
        self.world = len(self.devices)
        self.platform = self.devices[0].platform
        self.is_main = jax.process_index() == 0
        self.nprocs = jax.process_count()
        # ranks sharing one GPU (launcher --share-gpu): NCCL refuses, no XLA collectives
        self.shared_gpu = os.environ.get("JAX_NVCOMM_SHARE_GPU") == "1" and self.nprocs > 1
        self.mem_limit = None
        try:
            stats = self.devices[0].memory_stats() or {}
            self.mem_limit = int(stats.get("bytes_limit", 0)) or None
        except Exception:
            pass

    def topology(self) -> dict:
        """This process's GPUs (names, PCI ids, SMs) and the link of each pair, through
        cuda-python (topology.report), recorded with the results; {"host": ...} on CPU."""
        if not hasattr(self, "_topology"):
            from .. import topology
            if self.platform == "cpu":
                self._topology = {"host": topology.host_id()}
            else:
                ords = sorted({int(d.local_hardware_id) for d in self.jax.local_devices()})
                self._topology = topology.report(ords)
        return self._topology

    def mesh(self, n=None, axis="x"):
        import numpy as np
        devs = self.devices if n is None else self.devices[:n]
        return self.jax.sharding.Mesh(np.array(devs), (axis,))

    def log(self, *a):
        if self.is_main:
            print(*a, flush=True)

    def header(self, what, args):
        import jax
        self.log(f"# jax_nvcomm bench {what}: {self.world} x {self.devices[0].device_kind} "
                 f"({self.platform}), {self.nprocs} process(es), jax {jax.__version__}")
        from .._platform import platform_lines
        for line in platform_lines(self.devices):
            self.log(f"# {line}")
        from .. import _ffi
        if _ffi._cuda is not None:
            self.log(f"# CUDA build targets (__CUDA_ARCH_LIST__): {_ffi._cuda.compiled_archs()}")
        for d in self.topology().get("devices", []):
            self.log(f"# GPU {d['ordinal']}: {d['name']} ({d['pci_bus_id']}, {d['sm_count']} SMs)")
        if self.topology().get("links"):
            self.log(f"# links: {self.topology()['links']}")
        self.log(f"# timing: {args.unroll} unrolled x {args.steps} loop steps per program, "
                 f"{args.reps} programs; us per call: median (p10-p90) over the programs")
        if getattr(args, "device_time_on", False):
            self.log("# device time (dN): a profiler trace of 2 more runs of each program; "
                     "device 0's kernel time in the last run / calls (the loop's own small "
                     "kernels included)")
        if self.platform == "cpu":
            self.log("# NOTE: CPU devices: these numbers are meaningless for performance; the "
                     "run only shows that the benchmark works")
        if self.shared_gpu:
            self.log("# NOTE: ranks share one GPU: XLA collectives (lax.psum, reference "
                     "impls) cannot run (NCCL refuses) and are skipped")


# --------------------------------------------------------------------------- timing


def _put(env, mesh, host, spec):
    """Global host array -> array sharded over mesh by spec (works multi-process)."""
    import jax
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _varying(x, axis="x"):
    from .. import _shard
    return _shard.varying(x, axis)


def _row0(dst, src):
    """dst with its first row replaced by src's first row (one small in-place update): ties
    the next call to this call's output without a pass over the data."""
    from jax import lax
    r = src.reshape(-1, src.shape[-1])[:1].astype(dst.dtype)
    return lax.dynamic_update_slice(dst, r.reshape((1,) * (dst.ndim - 1) + r.shape[-1:]),
                                    (0,) * dst.ndim)


def _program(env, mesh, body, in_specs, carry_n, unroll, steps, init=None):
    """jit(shard_map(f)) where f runs `body` 1 + unroll*steps times.

    body(carry, consts) -> (next_carry, keep): next_carry has carry's types and depends on
    this call's result, and passes through `lax.optimization_barrier` (no fusion across
    calls); `keep` (outputs not fully consumed by next_carry) goes into one loop-carried slot
    per unrolled call, so every call's outputs are materialised.
    `init(args) -> (carry, consts)`; default: the first carry_n arguments are the carry, the
    rest constants. Everything the program returns is per-device, concatenated over "x"."""
    import jax
    from jax import lax

    def f(*args):
        c, k = init(args) if init else (tuple(args[:carry_n]), tuple(args[carry_n:]))
        c, keep = body(c, k)  # call 0 (also gives the slots their types)
        slots = tuple(keep for _ in range(unroll)) if keep else ()

        def block(_, st):
            c, slots = st
            slots = list(slots)
            for j in range(unroll):
                c, keep = body(c, k)
                # no fusion across calls: without a collective in between (one device),
                # XLA would otherwise fuse the row-local chains of several calls into one
                # kernel and read the data once for all of them
                c = lax.optimization_barrier(c)
                if slots:
                    slots[j] = keep
            return c, tuple(slots)

        st = lax.fori_loop(0, steps, block, (c, slots))
        return jax.tree.map(lambda v: v.reshape(-1) if v.ndim == 0 else v, st)

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=tuple(in_specs),
                                 out_specs=jax.sharding.PartitionSpec("x")))


def _compile(fn, args, options=None):
    """Compile with XLA's all-reduce simplifier off (it would fold psum(psum(x))) and the
    given XLA debug options (bench/xla_best.py); an option XLA refuses raises."""
    lowered = fn.lower(*args)
    extra = dict(options or {})
    try:
        return lowered.compile(compiler_options={"xla_disable_hlo_passes": "all-reduce-simp",
                                                 **extra})
    except Exception:  # noqa: BLE001 - an XLA without that option
        return lowered.compile(compiler_options=extra) if extra else lowered.compile()


_OP_RE = re.compile(r"=\s.*?\s([a-z][a-z0-9-]*)\(")  # "%name = type opcode(" in HLO text
_OPS = ("all-reduce", "all-to-all", "ragged-all-to-all", "all-gather", "reduce-scatter",
        "collective-permute", "custom-call", "while", "sort")


def _hlo_ops(compiled):
    """Opcode counts of the optimised program for collectives, custom calls, loops and sorts
    (async -start/-done pairs count once): a check that nothing was merged or dropped; expect
    one per call in the loop body plus one before the loop, per op the method uses."""
    try:
        txt = compiled.as_text()
    except Exception:  # noqa: BLE001
        return {}
    counts = {}
    for line in txt.splitlines():
        m = _OP_RE.search(line)
        if not m:
            continue
        op = m.group(1)
        base = op[:-6] if op.endswith("-start") else op
        if op.endswith("-done") or base not in _OPS:
            continue
        counts[base] = counts.get(base, 0) + 1
    return counts


def _time(env, fn, args, calls, reps, device_time=False, compiler_options=None):
    """Per-call microseconds over `reps` runs of fn(*args); device_time: also the kernels'
    device time per call from a profiler trace of 2 more runs (`_device_time`);
    compiler_options: XLA debug options of this compilation (bench/xla_best.py)."""
    import numpy as np
    jax = env.jax
    fn = _compile(fn, args, compiler_options)
    ops = _hlo_ops(fn)
    jax.block_until_ready(fn(*args))  # warm up
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        per.append((time.perf_counter() - t0) * 1e6 / calls)
    per = np.asarray(per)
    out = dict(median_us=float(np.median(per)), p10_us=float(np.percentile(per, 10)),
               p90_us=float(np.percentile(per, 90)), calls=int(calls), reps=int(reps),
               hlo_ops=ops)
    if device_time:
        out.update(_device_time(env, fn, args, calls))
    return out


def _device_time(env, fn, args, calls, runs=2):
    """The kernels' device time per call: a profiler trace of `runs` more runs of the compiled
    program; device 0's kernel time in the last run (jax_nvcomm/_trace.py) / calls. Every
    process runs the program `runs` times (collectives); only process 0 records. Returns the
    row's keys device_us, device_kernels_per_call, device_top, op_device_us (our kernels
    only: names in namespace nvc::) (None when the trace has no
    device kernels, as on CPU), and device_note when something is missing. Never raises; the
    trace goes to a temporary directory that is deleted here."""
    import shutil
    import tempfile
    jax = env.jax
    out = dict(device_us=None, device_kernels_per_call=None, device_top=None)
    started = []

    def counted(*xs):
        started.append(1)
        return fn(*xs)
    tmp = None
    try:
        if not env.is_main:
            for _ in range(runs):
                jax.block_until_ready(counted(*args))
            return out
        from .. import _trace
        tmp = tempfile.mkdtemp(prefix="jax_nvcomm_trace_")
        path = _trace.record(counted, args, tmp, steps=runs)
        s = _trace.device_time(path, device=0) if path else None
        if path is None:
            out["device_note"] = "no profiler trace was written"
        elif s is None:
            out["device_note"] = "no execution of the program found in the trace"
        elif s["busy_us"] is None:
            out["device_note"] = "no device kernels in the trace (device 0)"
        else:
            ours = [t["us"] for t in s["top"] if "nvc::" in t["name"]]
            out.update(device_us=round(s["busy_us"] / calls, 3),
                       device_kernels_per_call=round(s["kernels"] / calls, 3),
                       device_top=[dict(t, name=t["name"][:60]) for t in s["top"]],
                       # our kernels alone (names in namespace nvc::), without the loop's
                       # copies and fusions; None for XLA's methods
                       op_device_us=round(sum(ours) / calls, 3) if ours else None)
    except Exception as e:  # noqa: BLE001 - the loop time stands without it
        text = str(e).strip().splitlines()
        out["device_note"] = (f"trace failed: {type(e).__name__}: "
                              f"{text[0][:200] if text else ''}")
        for _ in range(runs - len(started)):  # the other processes run it `runs` times
            try:
                jax.block_until_ready(fn(*args))
            except Exception:  # noqa: BLE001
                break
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def switch(mode: str, auto: bool) -> bool:
    """A benchmark's on / off / auto option (--device-time, --xla-best): "on" is on, "auto" is
    on where `auto` holds, anything else is off."""
    return mode == "on" or (mode == "auto" and auto)


def _device_time_on(env, a) -> bool:
    """--device-time: on, off, or auto (on for GPUs)."""
    return switch(getattr(a, "device_time", "off") or "off", env.platform == "gpu")


def add_loop_arguments(s, quick: str):
    """The flags of every loop benchmark (allreduce, moe, varlen, ragged): output, sizes of the timed
    programs (defaults chosen in `loop_defaults`), --device-time. `quick`: what --quick does."""
    s.add_argument("--out", default="bench_out", metavar="DIR",
                   help="directory for the JSON results and the PNG plot (default: bench_out)")
    s.add_argument("--quick", action="store_true", help=quick)
    s.add_argument("--reps", type=int, default=None, metavar="N",
                   help="timed runs of each program; the tables show their median and p10-p90 "
                        "(default: 15 on GPUs, 7 with --quick, 3 on CPU devices)")
    s.add_argument("--unroll", type=int, default=None, metavar="N",
                   help="calls unrolled in one loop step (default: 25 on GPUs, 4 on CPU)")
    s.add_argument("--steps", type=int, default=None, metavar="N",
                   help="loop steps per program, so 1 + unroll x steps calls per program "
                        "(default: 8 on GPUs, 2 on CPU)")
    s.add_argument("--device-time", choices=("auto", "on", "off"), default="auto",
                   help="also the kernels' device time per call, from a profiler trace of "
                        "2 more runs of each program (device 0); auto (default): on for GPUs")


def loop_defaults(a) -> None:
    """Fill in --reps / --unroll / --steps left unset (see `add_loop_arguments`)."""
    cpu_like = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    a.reps = a.reps or (3 if cpu_like else 7 if a.quick else 15)
    a.unroll = a.unroll or (4 if cpu_like else 25)
    a.steps = a.steps or (2 if cpu_like else 8)


def add_xla_best_argument(s):
    """--xla-best, for every bench subcommand with an "XLA best" column (bench/xla_best.py)."""
    s.add_argument("--xla-best", choices=("auto", "on", "off"), default="auto",
                   help="also each XLA method compiled with each fast-path flag of this XLA "
                        "that concerns its collectives; the fastest is the 'best' column "
                        "(auto: on for GPUs; on CPU the column equals XLA's default)")


def _units(a) -> str:
    """What a table cell holds (see `_cell`)."""
    s = "loop us per call, median (p10-p90)"
    if getattr(a, "device_time_on", False):
        s += "; dN = kernels' device time per call from a profiler trace, device 0"
    return s


def _measure(env, name, mesh, body, args, in_specs, carry_n, a, unroll=None, steps=None,
             init=None, compiler_options=None, device_time=None):
    """Build, run and time one method; errors become a row note instead of a crash.
    compiler_options: XLA debug options (bench/xla_best.py); device_time: None = --device-time."""
    unroll, steps = unroll or a.unroll, steps or a.steps
    if device_time is None:
        device_time = getattr(a, "device_time_on", False)
    try:
        fn = _program(env, mesh, body, in_specs, carry_n, unroll, steps, init)
        return _time(env, fn, args, 1 + unroll * steps, a.reps, device_time=device_time,
                     compiler_options=compiler_options)
    except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
        return _failed(env, name, e)


def _failed(env, name, e):
    text = str(e).strip().splitlines()
    msg = f"{type(e).__name__}: {text[0][:200] if text else ''}"
    env.log(f"#   {name}: FAILED ({msg})")
    return dict(error=msg)


def _open_comm(env, mesh, max_bytes, **kw):
    """A Communicator (keyword arguments passed on), or None (with a note) when this
    build/machine cannot make one."""
    try:
        return env.nvc.Communicator(mesh, "x", max_message_bytes=max(4096, max_bytes), **kw)
    except Exception as e:  # noqa: BLE001
        env.log(f"# NOTE: nvc.Communicator failed ({type(e).__name__}: {str(e)[:200]}): "
                "jax_nvcomm rows skipped")
        return None


def _close(comm):
    if comm is not None:
        comm.close()



# --------------------------------------------------------------------------- output


def _cell(r):
    if r is None or "skipped" in r:
        return "-"
    if "error" in r:
        return "error"
    cell = f"{r['median_us']:.1f} ({r['p10_us']:.1f}-{r['p90_us']:.1f})"
    if r.get("device_us") is not None:
        cell += f" d{r['device_us']:.1f}"
    return cell


def _pivot(env, rows, keys, methods, extra=()):
    """One line per key, one column per method: 'median (p10-p90)' us per call (loop time),
    then ' dN' where the row has the kernels' device time per call.
    keys: [(header, fn(row) -> str)]; extra: [(header, fn({method: row}) -> str)]."""
    groups = {}
    for r in rows:
        groups.setdefault(tuple(f(r) for _, f in keys), {})[r["method"]] = r
    methods = [m for m in methods if any(m in g for g in groups.values())]
    cols = [h for h, _ in keys] + list(methods) + [h for h, _ in extra]
    table = [list(k) + [_cell(g.get(m)) for m in methods] + [f(g) for _, f in extra]
             for k, g in groups.items()]
    widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c)
              for i, c in enumerate(cols)]
    env.log("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
    env.log("  ".join("-" * w for w in widths))
    for t in table:
        env.log("  ".join(v.ljust(w) for v, w in zip(t, widths)).rstrip())


def _ratio(g, base, ours):
    """'x1.23' = base time / best of ours (>1: ours faster)."""
    b = g.get(base, {}).get("median_us")
    o = [g[m]["median_us"] for m in ours if "median_us" in g.get(m, {})]
    if b is None or not o:
        return "-"
    return f"x{b / min(o):.2f}"


def _write_json(env, out, name, data):
    if not env.is_main:
        return None
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    env.log(f"# wrote {path}")
    return path


def pyplot(log=print):
    """matplotlib.pyplot with the file-only Agg backend, or None (said through `log`) when
    matplotlib is not installed. Shared by every bench plot."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("# matplotlib not installed: skipping the plot (pip install matplotlib)")
        return None
    return plt


def _plot(env, out, name, series, title, xlabel):
    """series: {panel: {label: [(x, y_us), ...]}}; log-log, one line per label."""
    if not env.is_main:
        return None
    plt = pyplot(env.log)
    if plt is None:
        return None
    panels = [p for p in series if any(series[p].values())]
    if not panels:
        return None
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.5 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, p in zip(axes.flat, panels):
        for label, pts in sorted(series[p].items()):
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="o", ms=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("us per call (median)")
        ax.set_title(f"{title}: {p}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    env.log(f"# wrote {path}")
    return path


_UNITS = {"": 0, "k": 10, "m": 20, "g": 30}


def byte_size(text: str) -> int:
    """A size as people write it, for argparse: 4096, 64K, 64KiB, 64KB, 1M, 1MiB, 1.5MiB, 2G
    (K/M/G as powers of 1024, with or without "i" and "B"; case ignored)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(i?b)?\s*", text, re.IGNORECASE)
    if m is None or (m.group(3) and m.group(3).lower() == "ib" and not m.group(2)):
        raise argparse.ArgumentTypeError(
            f"expected a size such as 4096, 64KiB or 1MiB, got {text!r}")
    value = float(m.group(1)) * (1 << _UNITS[m.group(2).lower()])
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    return int(value)


def _human(n):
    for unit, s in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << s and n % (1 << s) == 0:
            return f"{n >> s} {unit}"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"


# --------------------------------------------------------------------------- memory bandwidth

def hbm_bytes_per_s(env, override=None):
    """(bytes/s, text) of the weight-read bounds: --hbm-bytes-per-s when given, else the
    device's peak (jax_nvcomm/topology/hbm.py: a table by name, else the device's memory clock
    x bus width x 2); CPU devices have none: the H200's 4.8e12 stands in (their ratios mean
    nothing)."""
    from ..topology import hbm
    bw, src = hbm.peak_bytes_per_s(env.devices[0], override)
    if bw is None:
        return 4.8e12, f"{src}: 4.8e12 (an H200's) stands in"
    return bw, src
