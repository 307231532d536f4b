"""Benchmarks: `python -m jax_nvcomm.bench allreduce [--tune] [--out DIR] [--quick]`,
`python -m jax_nvcomm.bench moe [--out DIR] [--quick]` (loop benchmarks: many calls inside one
jitted program, per-call time; described below), `python -m jax_nvcomm.bench varlen`
(all_gather_v / reduce_scatter_v against padded all_gather and zero-filled psum:
jax_nvcomm/bench_varlen.py) and `python -m jax_nvcomm.bench step` (whole jitted model steps
against XLA: jax_nvcomm/bench_step.py).

Runs on every device of the job: one process driving all local devices (mesh over
`jax.devices()`), or the processes of `python -m jax_nvcomm.launch -n N` (rank 0 reports).
Without a GPU it runs on 8 CPU devices; the numbers then only show that the code runs.

Timing is done on the device, not from Python: one jitted program runs the op
1 + unroll x steps times (once, then an unrolled block inside a `lax.fori_loop`), each call
consuming the previous call's result:
  - all-reduce: the output is the next input (no extra pass over the data; XLA's all-reduce
    simplifier, which would fold psum(psum(x)) into a multiply, is off for these programs);
  - MoE: one row of the output goes into the next call's input (a one-row update), the
    routing moves by one expert per call (ids + 1 mod E), and every call's full outputs stay
    live in loop-carried slots;
  - the values carried from call to call pass through `lax.optimization_barrier`,
so XLA can neither merge, drop, hoist, partially compute nor fuse together any calls (the
optimised program's op counts are saved as `hlo_ops` in the JSON). The program runs `reps`
times; each run gives one per-call time = wall time / calls. Reported: median, p10 and p90
over the runs, in microseconds per call. The host's launch cost of one run (tens of us on a
GPU machine) is spread over all calls of that run.

Device time (`--device-time {auto,on,off}`, auto = on for GPUs): after the timed runs, a
profiler trace of 2 more runs of the program (jax_nvcomm/_trace.py; every process runs them,
process 0 records into a temporary directory deleted afterwards); the sum of device 0's kernel
durations in the last run / calls is the row's `device_us` (with `device_kernels_per_call` and
`device_top`, the kernels that took most time), shown as "dN" after the loop time in the
tables. It counts the loop's own small kernels (row updates, loop control) too, and none of
the gaps between kernels. None (with `device_note`) when the trace has no device kernels, as on
CPU devices.

This module is not imported by the package (`import jax_nvcomm` does not load it).
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
            from . import topology
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
        from ._platform import platform_lines
        for line in platform_lines(self.devices):
            self.log(f"# {line}")
        from . import _ffi
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
    from . import _shard
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


def _compile(fn, args):
    """Compile with XLA's all-reduce simplifier off (it would fold psum(psum(x)))."""
    lowered = fn.lower(*args)
    try:
        return lowered.compile(compiler_options={"xla_disable_hlo_passes": "all-reduce-simp"})
    except Exception:  # noqa: BLE001 - an XLA without that option
        return lowered.compile()


_OP_RE = re.compile(r"=\s.*?\s([a-z][a-z0-9-]*)\(")  # "%name = type opcode(" in HLO text
_OPS = ("all-reduce", "all-to-all", "ragged-all-to-all", "custom-call", "while", "sort")


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


def _time(env, fn, args, calls, reps, device_time=False):
    """Per-call microseconds over `reps` runs of fn(*args); device_time: also the kernels'
    device time per call from a profiler trace of 2 more runs (`_device_time`)."""
    import numpy as np
    jax = env.jax
    fn = _compile(fn, args)
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
        from . import _trace
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


def _device_time_on(env, a) -> bool:
    """--device-time: on, off, or auto (on for GPUs)."""
    mode = getattr(a, "device_time", "off") or "off"
    return mode == "on" or (mode == "auto" and env.platform == "gpu")


def add_device_time_argument(s):
    """--device-time, for every bench subcommand that times loop programs."""
    s.add_argument("--device-time", choices=("auto", "on", "off"), default="auto",
                   help="also the kernels' device time per call, from a profiler trace of "
                        "2 more runs of each program (device 0); auto: on for GPUs")


def _units(a) -> str:
    """What a table cell holds (see `_cell`)."""
    s = "loop us per call, median (p10-p90)"
    if getattr(a, "device_time_on", False):
        s += "; dN = kernels' device time per call from a profiler trace, device 0"
    return s


def _measure(env, name, mesh, body, args, in_specs, carry_n, a, unroll=None, steps=None,
             init=None):
    """Build, run and time one method; errors become a row note instead of a crash."""
    unroll, steps = unroll or a.unroll, steps or a.steps
    try:
        fn = _program(env, mesh, body, in_specs, carry_n, unroll, steps, init)
        return _time(env, fn, args, 1 + unroll * steps, a.reps,
                     device_time=getattr(a, "device_time_on", False))
    except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
        return _failed(env, name, e)


def _failed(env, name, e):
    text = str(e).strip().splitlines()
    msg = f"{type(e).__name__}: {text[0][:200] if text else ''}"
    env.log(f"#   {name}: FAILED ({msg})")
    return dict(error=msg)


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


def _human(n):
    for unit, s in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << s and n % (1 << s) == 0:
            return f"{n >> s} {unit}"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"


# --------------------------------------------------------------------------- all-reduce


def _ar_shapes(hiddens, min_bytes, max_bytes):
    """(hidden, tokens) with tokens a power of two and min_bytes <= bf16 bytes <= max_bytes;
    sizes below one row of the first hidden use [1, bytes/2]."""
    out = []
    h0 = hiddens[0]
    b = min_bytes
    while b < 2 * h0 and b <= max_bytes:
        out.append((b // 2, 1))
        b *= 2
    for h in hiddens:
        t = 1
        while 2 * h * t <= max_bytes:
            if 2 * h * t >= min_bytes:
                out.append((h, t))
            t *= 2
    return out


AR_METHODS = ["nvc oneshot", "nvc twoshot", "lax.psum"]
FUSED_METHODS = ["nvc fused oneshot", "nvc fused twoshot", "psum+rmsnorm"]
# all_reduce_rms_norm_quant (FP8 output), next to the fused op it extends
QUANT_METHODS = ["nvc quant oneshot", "nvc quant twoshot", "psum+rmsnorm+quant"]


def _ar_methods(env, comm, axis, eps, fused):
    """name -> (body, carry_n) with carry (x,) or (x, residual) and consts (weight,).
    fused: False (all_reduce), True (all_reduce_rms_norm) or "quant"
    (all_reduce_rms_norm_quant: carry (x, residual_out), q and scale kept)."""
    from jax import lax

    from . import reference
    nvc = env.nvc
    V = _varying
    m = {}
    if fused == "quant":
        from .allreduce_quant import xla_all_reduce_rms_norm_quant

        def quant(op):
            def body(c, k):
                q, sc, ro = op(c[0], c[1], k[0])
                return (c[0], V(ro)), (q, sc)
            return body
        for s in ("oneshot", "twoshot"):
            if comm is not None:
                m[f"nvc quant {s}"] = (quant(lambda x, r, w, s=s: nvc.all_reduce_rms_norm_quant(
                    x, r, w, comm, eps=eps, strategy=s)), 2)
        if not env.shared_gpu:
            m["psum+rmsnorm+quant"] = (quant(lambda x, r, w: xla_all_reduce_rms_norm_quant(
                x, r, w, axis, eps)), 2)
    elif not fused:
        for s in ("oneshot", "twoshot"):
            if comm is not None:
                m[f"nvc {s}"] = (lambda c, k, s=s: (
                    (V(nvc.all_reduce(c[0], comm, strategy=s)),), ()), 1)
        if not env.shared_gpu:
            m["lax.psum"] = (lambda c, k: ((V(lax.psum(c[0], axis)),), ()), 1)
    else:
        for s in ("oneshot", "twoshot"):
            if comm is not None:
                m[f"nvc fused {s}"] = (lambda c, k, s=s: (tuple(map(V, nvc.all_reduce_rms_norm(
                    c[0], c[1], k[0], comm, eps=eps, strategy=s))), ()), 2)
        if not env.shared_gpu:
            m["psum+rmsnorm"] = (lambda c, k: (tuple(map(V, reference.all_reduce_rms_norm_xla(
                c[0], c[1], k[0], axis_name=axis, eps=eps))), ()), 2)
    return m


def _ar_point(env, comm, mesh, hidden, tokens, a, methods=None, fused_too=True):
    """Rows for one message shape [tokens, hidden] bf16 per rank (comm None: XLA only)."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P
    axis = "x"
    W = int(mesh.shape[axis])
    nbytes = tokens * hidden * 2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((W * tokens, hidden)).astype(jnp.bfloat16)
    res = rng.standard_normal((W * tokens, hidden)).astype(jnp.bfloat16)
    w = (1 + 0.1 * rng.standard_normal((hidden,))).astype(jnp.bfloat16)
    xs, rs, ws = _put(env, mesh, x, P(axis)), _put(env, mesh, res, P(axis)), _put(env, mesh, w, P())
    rows = []
    for fused in ((False, True, "quant") if fused_too else (False,)):
        if methods is not None and fused == "quant" and not methods & set(QUANT_METHODS):
            continue
        for name, (body, carry_n) in _ar_methods(env, comm, axis, 1e-6, fused).items():
            if methods is not None and name not in methods:
                continue
            row = dict(method=name, hidden=hidden, tokens=tokens, bytes=nbytes, world=W)
            if "oneshot" in name and nbytes > comm.lamport_slot_bytes:
                row.update(skipped=f"> lamport_slot_bytes {comm.lamport_slot_bytes}")
            elif "nvc" in name and nbytes > comm.max_message_bytes:
                row.update(skipped=f"> max_message_bytes {comm.max_message_bytes}")
            elif W == 1 and name == "lax.psum":
                row.update(skipped="a psum over one device is compiled away")
            else:
                args = (xs, rs, ws) if carry_n == 2 else (xs, ws)
                specs = (P(axis), P(axis), P()) if carry_n == 2 else (P(axis), P())
                row.update(_measure(env, name, mesh, body, args, specs, carry_n, a))
                env.log(f"#   {tokens}x{hidden} ({_human(nbytes)}) {name}: {_cell(row)}")
            rows.append(row)
    return rows


def _open_comm(env, mesh, max_bytes):
    """A Communicator, or None (with a note) when this build/machine cannot make one."""
    try:
        return env.nvc.Communicator(mesh, "x", max_message_bytes=max(4096, max_bytes))
    except Exception as e:  # noqa: BLE001
        env.log(f"# NOTE: nvc.Communicator failed ({type(e).__name__}: {str(e)[:200]}): "
                "jax_nvcomm rows skipped")
        return None


def _close(comm):
    if comm is not None:
        comm.close()


def _fmt_bytes_py(n):
    """An int as Python source in strategy.py's style (`512 << 10`)."""
    if n == 0:
        return "0"
    if n % (1 << 20) == 0:
        return f"{n >> 20} << 20"
    if n % (1 << 10) == 0:
        return f"{n >> 10} << 10"
    return str(n)


def _crossover(by, one_m, two_m, base_m):
    """(oneshot_max, twoshot_max) of one op from {bytes: {method: us}}: one-shot up to the last
    size of the leading run where it is fastest, two-shot up to the last size (beyond that) of
    the run where it beats the XLA baseline. A size with no measurement of a method is a loss."""
    sizes = sorted(by)
    inf = float("inf")
    one = 0
    for s in sizes:
        t = by[s]
        o = t.get(one_m, inf)
        if o < inf and o <= min(t.get(two_m, inf), t.get(base_m, inf)):
            one = s
        else:
            break
    two = one
    for s in sizes:
        if s <= one:
            continue
        t = by[s]
        tw = t.get(two_m, inf)
        if tw < inf and tw <= t.get(base_m, inf):
            two = s
        else:
            break
    if sizes and two == sizes[-1]:
        two = max(two, 64 << 20) if sizes[-1] >= 64 << 20 else two
    return one, two


def crossovers(rows):
    """(oneshot_max, twoshot_max) for strategy.THRESHOLDS from rows of one world size. The table
    serves all_reduce and all_reduce_rms_norm alike, so where fused rows were measured too each
    threshold is the smaller of the plain op's (vs lax.psum) and the fused op's (vs psum +
    XLA's add + RMSNorm) crossovers: no op is sent to a strategy that loses for it."""
    by = {}
    for r in rows:
        if "median_us" in r:
            by.setdefault(r["bytes"], {})[r["method"]] = r["median_us"]
    one, two = _crossover(by, *AR_METHODS)
    if any(FUSED_METHODS[0] in t or FUSED_METHODS[1] in t for t in by.values()):
        f_one, f_two = _crossover(by, *FUSED_METHODS)
        one, two = min(one, f_one), min(two, f_two)
    return one, two


def thresholds_source(measured, current):
    """strategy.THRESHOLDS as Python source: measured worlds replace the current entries."""
    lines = ["THRESHOLDS: dict[int, tuple[int, int]] = {"]
    for w in sorted(set(current) | set(measured)):
        one, two = measured.get(w, current.get(w))
        note = "  # measured" if w in measured else "  # not measured here: kept"
        lines.append(f"    {w}: ({_fmt_bytes_py(one)}, {_fmt_bytes_py(two)}),{note}")
    lines.append("}")
    return "\n".join(lines)


COPY_METHOD = "copy (XLA -x)"


def _copy_point(env, mesh, hidden, tokens, a):
    """The copy bandwidth of this device for a [tokens, hidden] bf16 array: an XLA elementwise
    kernel (y = -x) reading and writing every byte once. The reference for the epilogue."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P
    x = np.random.default_rng(1).standard_normal((tokens, hidden)).astype(jnp.bfloat16)
    xs = _put(env, mesh, x, P("x"))
    row = dict(method=COPY_METHOD, hidden=hidden, tokens=tokens, bytes=tokens * hidden * 2,
               world=1, bytes_moved=tokens * hidden * 2 * 2)
    row.update(_measure(env, COPY_METHOD, mesh, lambda c, k: ((_varying(-c[0]),), ()), (xs,),
                        (P("x"),), 1, a))
    if "median_us" in row:
        row["GBps"] = row["bytes_moved"] / (row["median_us"] * 1e-6) / 1e9
        env.log(f"#   {tokens}x{hidden} {COPY_METHOD}: {_cell(row)}")
    return row


def _single_device_report(env, a):
    """One device: the fused epilogue's HBM bandwidth vs XLA's add+RMSNorm, and the per-call
    overhead of the custom call in a jitted step."""
    mesh = env.mesh(1)
    cpu = env.platform == "cpu"
    shapes = [(8, 512), (64, 512)] if cpu else [(2048, 8192), (4096, 7168), (8192, 8192)]
    out, tiny = [], []
    comm = _open_comm(env, mesh, max(t * h * 2 for t, h in shapes))
    try:
        for tokens, hidden in shapes:
            moved = tokens * hidden * 2 * 4 + hidden * 2
            for r in _ar_point(env, comm, mesh, hidden, tokens, a, methods=set(FUSED_METHODS)):
                if "median_us" in r:
                    r["GBps"] = moved / (r["median_us"] * 1e-6) / 1e9
                r["bytes_moved"] = moved
                out.append(r)
            out.append(_copy_point(env, mesh, hidden, tokens, a))
        tiny = [r for r in _ar_point(env, comm, mesh, 8, 1, a) if r["method"] != "lax.psum"]
    finally:
        _close(comm)
    env.log("\n## one device: fused all_reduce_rms_norm epilogue vs XLA's add+RMSNorm: "
            f"{_units(a)}; GB/s from the loop time (bytes = read x, residual, weight + write "
            "normed, residual_out)")

    def gbps(m):
        return lambda g: f"{g[m]['GBps']:.0f}" if "GBps" in g.get(m, {}) else "-"
    methods = FUSED_METHODS + [COPY_METHOD]

    def pct(m):  # fraction of the copy bandwidth measured for the same shape
        return lambda g: (f"{100 * g[m]['GBps'] / g[COPY_METHOD]['GBps']:.0f}%"
                          if "GBps" in g.get(m, {}) and "GBps" in g.get(COPY_METHOD, {}) else "-")
    _pivot(env, out, [("shape", lambda r: f"{r['tokens']}x{r['hidden']}")], methods,
           [(f"GB/s {m}", gbps(m)) for m in methods]
           + [(f"{m} / copy", pct(m)) for m in FUSED_METHODS])
    env.log("\n## one device: per-call cost of a 1x8 bf16 message (the custom call's overhead "
            f"in a jitted step; psum+rmsnorm = XLA's own add+RMSNorm kernel): {_units(a)}")
    _pivot(env, tiny, [("shape", lambda r: f"{r['tokens']}x{r['hidden']}")],
           AR_METHODS + FUSED_METHODS)
    return dict(epilogue=out, tiny=tiny)


def run_allreduce(a):
    env = Env()
    a.device_time_on = _device_time_on(env, a)
    env.header("allreduce", a)
    hiddens = a.hidden or ([512] if a.quick else [4096, 7168, 8192])
    max_bytes = a.max_bytes or ((64 << 10) if a.quick else (128 << 20))
    min_bytes = 4 << 10
    shapes = _ar_shapes(hiddens, min_bytes, max_bytes)
    result = dict(meta=dict(platform=env.platform, topology=env.topology(), world=env.world,
                            processes=env.nprocs,
                            device_kind=env.devices[0].device_kind, unroll=a.unroll,
                            steps=a.steps, reps=a.reps, dtype="bfloat16"), rows=[])
    mesh = env.mesh()
    comm = _open_comm(env, mesh, max_bytes)
    try:
        if comm is not None:
            env.log(f"# communicator: world {comm.world_size}, max_message_bytes "
                    f"{_human(comm.max_message_bytes)}, oneshot up to "
                    f"{_human(comm.lamport_slot_bytes)}")
        only = set(a.methods) if getattr(a, "methods", None) else None
        for hidden, tokens in shapes:
            if getattr(a, "tokens", None) and tokens not in a.tokens:
                continue
            result["rows"] += _ar_point(env, comm, mesh, hidden, tokens, a, methods=only)
    finally:
        _close(comm)
    rows = result["rows"]
    keys = [("bytes", lambda r: _human(r["bytes"])),
            ("shape", lambda r: f"{r['tokens']}x{r['hidden']}")]
    env.log(f"\n## all-reduce, bf16, world {env.world}: {_units(a)}; "
            "speedup = lax.psum / best jax_nvcomm (loop times)")
    _pivot(env, rows, keys, AR_METHODS,
           [("speedup", lambda g: _ratio(g, "lax.psum", AR_METHODS[:2]))])
    env.log(f"\n## all-reduce + residual + RMSNorm, bf16, world {env.world}: {_units(a)}; "
            "speedup = psum+rmsnorm / best fused")
    _pivot(env, rows, keys, FUSED_METHODS,
           [("speedup", lambda g: _ratio(g, "psum+rmsnorm", FUSED_METHODS[:2]))])
    env.log(f"\n## all-reduce + residual + RMSNorm + FP8 output (all_reduce_rms_norm_quant), "
            f"bf16 in, world {env.world}: {_units(a)}; fused/quant = the fused op's time / the "
            "quant op's, same strategy (>= 0.91: within 10%)")
    _pivot(env, rows, keys, QUANT_METHODS,
           [(f"fused/quant {s}", lambda g, s=s: _ratio(g, f"nvc fused {s}", [f"nvc quant {s}"]))
            for s in ("oneshot", "twoshot")]
           + [("speedup", lambda g: _ratio(g, "psum+rmsnorm+quant", QUANT_METHODS[:2]))])
    if env.world == 1:
        result["single_device"] = _single_device_report(env, a)
    if a.tune:
        result["tune"] = _tune(env, a, min_bytes, max_bytes)
    _write_json(env, a.out, "allreduce.json", result)
    series = {}
    for r in rows:
        if "median_us" in r:
            h = r["hidden"] if r["hidden"] in hiddens else hiddens[0]  # sub-row sizes
            series.setdefault(f"hidden {h}, world {r['world']}", {}).setdefault(
                r["method"], []).append((r["bytes"], r["median_us"]))
    _plot(env, a.out, "allreduce.png", series, f"all-reduce bf16 ({env.platform})",
          "message bytes per rank")
    return 0


def _tune(env, a, min_bytes, max_bytes):
    """Crossovers per available world size; prints a THRESHOLDS table for strategy.py."""
    from . import strategy
    worlds = [w for w in (2, 4, 8, 16, 32, 64) if w <= env.world] or [env.world]
    if env.nprocs > 1:
        worlds = [env.world]  # the launcher's processes: only the whole job
    env.log("\n## --tune: oneshot / twoshot / lax.psum, plain and fused, per message size and "
            "world size")
    measured, rows_all = {}, []
    sizes = []
    b = min_bytes
    while b <= max_bytes:
        sizes.append(b)
        b *= 2
    for w in worlds:
        mesh = env.mesh(w)
        comm = _open_comm(env, mesh, max_bytes)
        if comm is None:
            break
        rows = []
        try:
            for b in sizes:
                hidden = 4096 if b % (2 * 4096) == 0 else b // 2
                rows += _ar_point(env, comm, mesh, hidden, b // (2 * hidden), a,
                                  methods=set(AR_METHODS + FUSED_METHODS))
        finally:
            _close(comm)
        rows_all += rows
        measured[w] = crossovers(rows)
        env.log(f"\n# world {w}:")
        _pivot(env, rows, [("bytes", lambda r: _human(r["bytes"]))], AR_METHODS + FUSED_METHODS)
        env.log(f"# world {w}: oneshot <= {_human(measured[w][0])}, twoshot <= "
                f"{_human(measured[w][1])}, then lax.psum")
    src = thresholds_source(measured, dict(strategy.THRESHOLDS))
    if env.platform == "cpu":
        env.log("# NOTE: measured on CPU devices: do NOT paste these into strategy.py")
    env.log("\n# paste into jax_nvcomm/strategy.py:\n" + src)
    return dict(rows=rows_all, thresholds={str(k): list(v) for k, v in measured.items()},
                source=src)


# --------------------------------------------------------------------------- MoE


def _moe_config(env, a):
    world = env.world
    cpu = env.platform == "cpu"
    tokens = [1, 8, 32] if a.quick else [1, 8, 32, 128, 512, 4096]
    if a.tokens:
        tokens = a.tokens
    hidden = a.moe_hidden or (256 if cpu else 7168)
    top_k = 8
    if a.experts:
        experts = a.experts
    elif cpu:
        experts = max(top_k, 4 * world)
    else:
        experts = 256 if world >= 8 else max(top_k, 32 * world)
    experts = max(world, experts - experts % world)
    return dict(tokens=tokens, hidden=hidden, top_k=min(top_k, experts), experts=experts)


def _moe_inputs(env, mesh, W, T, H, K, E, dtype, seed=0):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((W * T, E)), axis=1)[:, :K].astype(np.int32)
    wts = rng.random((W * T, K)).astype(np.float32)
    L = E // W
    sh = NamedSharding(mesh, P("x"))

    def gen(key):
        k1, k2, k3 = jax.random.split(key, 3)
        x = jax.random.normal(k1, (W * T, H), jnp.float32)
        sc = jax.random.uniform(k2, (W * T, max(1, H // 128)), jnp.float32)
        ey = jax.random.normal(k3, (W * L, W * T, H), jnp.bfloat16)
        return x.astype(dtype), sc, ey

    x, sc, ey = jax.jit(gen, out_shardings=(sh, sh, sh))(jax.random.key(seed))
    return x, sc, ey, _put(env, mesh, ids, P("x")), _put(env, mesh, wts, P("x"))


def _moe_methods(env, moe, E, fp8, split=False):
    """name -> (dispatch(x, ids, x_scale) -> (expert_x, counts, expert_x_scale, handle),
    combine(expert_y, weights, handle) -> y) for jax_nvcomm and the XLA references.
    split: also "nvc split", the send and receive halves back to back (nothing between: what
    the split costs against the fused call; the overlap itself shows in `bench step
    --split-compare`)."""
    from . import reference
    nvc = env.nvc
    impls = {}
    if moe is not None:
        def nd(x, ids, sc):
            d = nvc.moe_dispatch(x, ids, moe, x_scale=sc if fp8 else None)
            return d.expert_x, d.expert_counts, d.expert_x_scale, d.handle

        def nc(ey, w, h):
            return nvc.moe_combine(ey, w, h, moe)
        impls["nvc"] = (nd, nc)
        if split:
            def sd(x, ids, sc):
                d = nvc.moe_dispatch_recv(nvc.moe_dispatch_send(
                    x, ids, moe, x_scale=sc if fp8 else None), moe)
                return d.expert_x, d.expert_counts, d.expert_x_scale, d.handle

            def sc_(ey, w, h):
                return nvc.moe_combine_recv(nvc.moe_combine_send(ey, h, moe), w, moe)
            impls["nvc split"] = (sd, sc_)
    if not env.shared_gpu:
        for impl in ("ragged", "dense"):
            def rd(x, ids, sc, impl=impl):
                return reference.moe_dispatch_xla(x, ids, axis_name="x", num_experts=E,
                                                  x_scale=sc if fp8 else None, impl=impl)

            def rc(ey, w, h, impl=impl):
                return reference.moe_combine_xla(ey, w, h, axis_name="x", num_experts=E,
                                                 impl=impl)
            impls[f"xla {impl}"] = (rd, rc)
    return impls


def _moe_point(env, mesh, cfg, T, dtype_name, a):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    W, H, K, E = env.world, cfg["hidden"], cfg["top_k"], cfg["experts"]
    L = E // W
    fp8 = dtype_name == "fp8"
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    isz = jnp.dtype(dtype).itemsize
    rows = []
    base = dict(tokens=T, dtype=dtype_name, hidden=H, experts=E, top_k=K, world=W)
    # memory guard: expert_x + expert_y (+ reference receive buffers) per rank
    need = L * W * T * H * (isz + 2) + 3 * W * T * min(K, L) * H * 2
    if env.mem_limit and need > 0.45 * env.mem_limit:
        rows.append(dict(base, method="*", op="*", skipped=f"needs ~{_human(need)} per device"))
        return rows
    x, sc, ey, ids, wts = _moe_inputs(env, mesh, W, T, H, K, E, dtype)
    moe, note = None, None
    if not (hasattr(env.nvc, "MoECommunicator") and hasattr(env.nvc, "moe_dispatch")):
        note = "nvc.moe_dispatch not available in this build"
    else:
        try:
            moe = env.nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T,
                                          hidden=H, dtype=dtype,
                                          scale_cols=(H // 128) if fp8 else 0)
        except Exception as e:  # noqa: BLE001
            note = f"MoECommunicator failed: {type(e).__name__}: {str(e)[:120]}"
    if note:
        rows.append(dict(base, method="nvc", op="*", skipped=note))
    try:
        # loop-carried output slots cost one expert_x per unrolled call: fit them in memory
        ex_bytes = L * W * T * H * isz
        unroll = a.unroll
        if env.mem_limit:
            unroll = max(1, min(a.unroll, int(0.2 * env.mem_limit) // max(1, ex_bytes)))
        steps = max(2, -(-a.unroll * a.steps // unroll))
        for name, (disp, comb) in _moe_methods(env, moe, E, fp8,
                                               getattr(a, "split", False)).items():
            if getattr(a, "methods", None) and name not in a.methods:
                continue
            # carry (x, x_scale, topk_ids): the next call's x gets one row of this call's
            # output, its routing moves every id by one expert (ids + 1 mod E: rows stay
            # distinct), so no routing work can be hoisted out of the loop
            def nxt_ids(ids):
                return jnp.where(ids >= 0, (ids + 1) % E, ids)

            def b_disp(c, k, disp=disp):
                out = disp(c[0], c[2], c[1])
                return ((_row0(c[0], out[0]), c[1], nxt_ids(c[2])),
                        tuple(jax.tree.leaves(out)))

            def i_comb(args, disp=disp):
                x, sc, ids, ey, w = args
                return (ey, w, disp(x, ids, sc)[3]), ()

            def b_comb(c, k, comb=comb):
                y = comb(c[0], c[1], c[2])
                return (_row0(c[0], y), c[1], c[2]), (y,)

            def b_both(c, k, disp=disp, comb=comb):
                ex, cnt, exs, h = disp(c[0], c[2], c[1])
                y = comb(k[0], k[1], h)
                return ((_row0(c[0], y), c[1], nxt_ids(c[2])),
                        tuple(jax.tree.leaves((ex, cnt, exs, y))))

            specs3, specs5 = (P("x"),) * 3, (P("x"),) * 5
            progs = [("dispatch", b_disp, (x, sc, ids), specs3, None),
                     ("combine", b_comb, (x, sc, ids, ey, wts), specs5, i_comb),
                     ("dispatch+combine", b_both, (x, sc, ids, ey, wts), specs5, None)]
            for op, body, args, specs, init in progs:
                row = dict(base, method=name, op=op, unroll=unroll, steps=steps)
                row.update(_measure(env, f"{name} {op}", mesh, body, args, specs, 3, a,
                                    unroll=unroll, steps=steps, init=init))
                if W == 1 and "median_us" in row:
                    pairs = T * K
                    moved = {"dispatch": T * H * isz + pairs * H * isz,
                             "combine": pairs * H * 2 + T * H * 2}
                    moved["dispatch+combine"] = moved["dispatch"] + moved["combine"]
                    row["min_bytes"] = moved[op]
                    row["GBps"] = moved[op] / (row["median_us"] * 1e-6) / 1e9
                rows.append(row)
                env.log(f"#   T={T} {dtype_name} {name} {op}: {_cell(row)}")
    finally:
        if moe is not None:
            moe.close()
    return rows


def run_moe(a):
    env = Env()
    a.device_time_on = _device_time_on(env, a)
    env.header("moe", a)
    cfg = _moe_config(env, a)
    env.log(f"# config: world {env.world}, experts {cfg['experts']} "
            f"({cfg['experts'] // env.world} per rank), top-{cfg['top_k']}, hidden "
            f"{cfg['hidden']}, tokens/rank {cfg['tokens']}; dispatch bf16 and fp8 "
            f"(float8_e4m3fn + float32 scales, hidden/128 cols), combine bf16")
    if not hasattr(env.nvc, "moe_dispatch"):
        env.log("# NOTE: nvc.moe_dispatch is not in this build yet: its rows are skipped")
    mesh = env.mesh()
    rows = []
    for dtype_name in getattr(a, "dtypes", None) or ("bf16", "fp8"):
        for T in cfg["tokens"]:
            rows += _moe_point(env, mesh, cfg, T, dtype_name, a)
    env.log(f"\n## MoE dispatch/combine, world {env.world}: {_units(a)}; "
            "speedup = best XLA reference / jax_nvcomm (loop times)")
    methods = ["nvc"] + (["nvc split"] if getattr(a, "split", False) else []) + [
        "xla ragged", "xla dense"]
    extra = [("speedup", lambda g: _ratio(g, min(
        ("xla ragged", "xla dense"), key=lambda m: g.get(m, {}).get("median_us", 1e300)),
        ["nvc"]))]
    if env.world == 1:
        extra += [(f"GB/s {m}", lambda g, m=m: f"{g[m]['GBps']:.0f}"
                   if "GBps" in g.get(m, {}) else "-") for m in methods]
    _pivot(env, [r for r in rows if r["method"] in methods],
           [("dtype", lambda r: r["dtype"]), ("tokens", lambda r: str(r["tokens"])),
            ("op", lambda r: r["op"])], methods, extra)
    for r in rows:
        if r.get("op") == "*" and "skipped" in r:
            env.log(f"# skipped: {r['dtype']} tokens {r['tokens']} {r['method']}: "
                    f"{r['skipped']}")
    if env.world == 1:
        env.log("# one device: GB/s = minimal bytes / time: dispatch reads x and writes one row "
                "per (token, k); combine reads those rows and writes y: the local pack/unpack "
                "passes' achieved HBM bandwidth")
    _write_json(env, a.out, "moe.json", dict(
        meta=dict(platform=env.platform, topology=env.topology(), world=env.world,
                  processes=env.nprocs,
                  device_kind=env.devices[0].device_kind, unroll=a.unroll, steps=a.steps,
                  reps=a.reps, **{k: v for k, v in cfg.items()}), rows=rows))
    series = {}
    for r in rows:
        if "median_us" in r:
            series.setdefault(f"{r['dtype']} {r['op']}", {}).setdefault(r["method"], []).append(
                (r["tokens"], r["median_us"]))
    _plot(env, a.out, "moe.png", series, f"MoE world {env.world} ({env.platform})",
          "tokens per rank")
    return 0


# --------------------------------------------------------------------------- CLI


def _parser():
    p = argparse.ArgumentParser(prog="python -m jax_nvcomm.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("allreduce", "moe"):
        s = sub.add_parser(name)
        s.add_argument("--out", default="bench_out", help="directory for JSON and PNG")
        s.add_argument("--quick", action="store_true", help="few, small sizes (CPU smoke run)")
        s.add_argument("--reps", type=int, default=None, help="program runs per method")
        s.add_argument("--unroll", type=int, default=None, help="unrolled calls per loop step")
        s.add_argument("--steps", type=int, default=None, help="loop steps per program")
        add_device_time_argument(s)
        if name == "allreduce":
            s.add_argument("--tune", action="store_true",
                           help="measure crossovers per world size; print THRESHOLDS")
            s.add_argument("--hidden", type=int, nargs="*", help="hidden sizes")
            s.add_argument("--max-bytes", type=int, default=None)
            s.add_argument("--tokens", type=int, nargs="*",
                           help="only shapes with these tokens per rank")
            s.add_argument("--methods", nargs="*", choices=AR_METHODS + FUSED_METHODS
                           + QUANT_METHODS, help="only these methods (default: all)")
        else:
            s.add_argument("--tokens", type=int, nargs="*", help="tokens per rank")
            s.add_argument("--methods", nargs="*",
                           choices=("nvc", "nvc split", "xla ragged", "xla dense"),
                           help="only these methods (default: all; nvc split needs --split)")
            s.add_argument("--dtypes", nargs="*", choices=("bf16", "fp8"),
                           help="dispatch dtypes (default: both)")
            s.add_argument("--moe-hidden", type=int, default=None)
            s.add_argument("--experts", type=int, default=None)
            s.add_argument("--split", action="store_true",
                           help="also the split halves (moe_dispatch_send + _recv, "
                                "moe_combine_send + _recv) back to back, beside the fused calls")
    from . import bench_varlen
    bench_varlen.add_arguments(sub.add_parser(
        "varlen", help="all_gather_v / reduce_scatter_v vs padded all_gather and zero-filled "
                       "psum (jax_nvcomm/bench_varlen.py)"))
    from . import bench_step
    bench_step.add_arguments(sub.add_parser(
        "step", help="whole jitted model steps, jax_nvcomm vs XLA (jax_nvcomm/bench_step.py)"))
    return p


def main(argv=None):
    a = _parser().parse_args(argv)
    if a.what == "step":
        from .bench_step import run_step
        return run_step(a)
    _setup_env()
    cpu_like = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    a.reps = a.reps or (3 if cpu_like else 7 if a.quick else 15)
    a.unroll = a.unroll or (4 if cpu_like else 25)
    a.steps = a.steps or (2 if cpu_like else 8)
    if a.what == "allreduce":
        return run_allreduce(a)
    if a.what == "varlen":
        from .bench_varlen import run_varlen
        return run_varlen(a)
    return run_moe(a)


if __name__ == "__main__":
    sys.exit(main())
