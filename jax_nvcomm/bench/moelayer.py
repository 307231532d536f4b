"""`python -m jax_nvcomm.bench moelayer`: the expert compute of an MoE layer at decode shapes,
one device (world 1): nvc.ragged_dot against lax.ragged_dot, each row with its weight-read
bound.

Shapes (the defaults; --hidden, --ffn, --experts, --tokens change them): hidden 7168, F 2048,
32 and 256 local experts, top-8, 8 / 32 / 128 tokens, so M = tokens x 8 rows sorted by expert
(random routing: 8 distinct experts per token, uniform). Ops:
  gate      [M, hidden] x [E, hidden, F]     (the up product has the same shape)
  down      [M, F] x [E, F, hidden]
  block     the expert block: gate and up, silu(gate) * up, down (3 products)
Methods:
  nvc       nvc.ragged_dot(strategy="kernel"): the package's GPU kernel
  nvc swiglu  block only: gate and up in one pass with silu(gate) * up fused in, then down
  xla       lax.ragged_dot (XLA's GEMM over every group)
bound: the bytes of the weights of the experts that receive rows (each read once) / 4.8 TB/s,
the HBM datasheet bandwidth of an H200 (--bandwidth). Each row also records each nvc method's
result against lax's on the same inputs (`rel_diff_to_xla`: ||nvc - xla|| / ||xla||, bf16
rounding: ~1e-3). Times: `calls` chained calls in one jit (each call's input takes one element
of the previous output, so they run in order), loop us
per call (median over the programs) and, on GPUs, the kernels' device time per call from a
profiler trace (the table's dN columns, as in the other loop benchmarks). On CPU devices the shapes shrink (hidden 256,
F 128, experts 8 / 32) and the numbers only show that the benchmark runs. Writes
OUT/moelayer.json and the table.
"""
from __future__ import annotations

import os

from . import common as B

METHODS = ("nvc", "nvc swiglu", "xla")


def add_arguments(s):
    s.add_argument("--out", default="bench_out", metavar="DIR",
                   help="directory for moelayer.json (default: bench_out)")
    s.add_argument("--quick", action="store_true",
                   help="32 experts only, 8 and 128 tokens, fewer repetitions")
    s.add_argument("--hidden", type=int, default=None, help="hidden size (default 7168)")
    s.add_argument("--ffn", type=int, default=None, help="expert FFN size F (default 2048)")
    s.add_argument("--experts", type=int, nargs="+", default=None,
                   help="local expert counts (default 32 256)")
    s.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="token counts (default 8 32 128)")
    s.add_argument("--top-k", type=int, default=8, help="experts per token (default 8)")
    s.add_argument("--calls", type=int, default=None,
                   help="chained calls per program (default 10 on GPUs, 2 on CPU)")
    s.add_argument("--reps", type=int, default=None,
                   help="timed programs per row (default 10 on GPUs, 5 with --quick, 2 on CPU)")
    s.add_argument("--bandwidth", type=float, default=4.8e12,
                   help="memory bandwidth (bytes/s) of the weight-read bound (default 4.8e12: "
                        "the HBM3e datasheet figure of an H200)")
    s.add_argument("--device-time", choices=("auto", "on", "off"), default="auto",
                   help="device time per call from a profiler trace (default auto: on for "
                        "GPUs, off on CPU devices)")
    s.add_argument("--ops", nargs="+", default=["gate", "down", "block"],
                   choices=("gate", "down", "block"), help="which ops (default all three; "
                   "the list above says what each is)")


def routing_sizes(rng, tokens, experts, top_k):
    """Group sizes [experts] of `tokens` tokens routed to top_k distinct uniform experts."""
    import numpy as np
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(ids.reshape(-1), minlength=experts).astype(np.int32)


def _chain(fn, calls):
    """jit of `calls` calls of fn(x, *consts) -> y in order: the next call's x is x with its
    first element taken from y (a one-element in-place update), behind an optimization
    barrier so that nothing fuses across calls."""
    import jax
    from jax import lax

    def f(x, *consts):
        ys = []
        for _ in range(calls):
            y = fn(x, *consts)
            x = lax.optimization_barrier(x.at[0, 0].set(y[0, 0].astype(x.dtype)))
            ys.append(y[:1])
        return x, ys
    return jax.jit(f)


def _ops(env, nvc_rd, nvc_sw):
    """{op: {method: fn(x, *weights, gs)}} (methods that do not apply are left out)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def nvc(x, w, gs):
        return nvc_rd(x, w, gs, strategy="kernel")

    def xla(x, w, gs):
        return lax.ragged_dot(x, w, gs)

    def block(rd):
        def f(x, wg, wu, wd, gs):
            g = rd(x, wg, gs)
            u = rd(x, wu, gs)
            h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
            return rd(h, wd, gs)
        return f

    def block_swiglu(x, wg, wu, wd, gs):
        h = nvc_sw(x, wg, wu, gs, strategy="kernel")
        return nvc_rd(h, wd, gs, strategy="kernel")

    return {"gate": {"nvc": nvc, "xla": xla}, "down": {"nvc": nvc, "xla": xla},
            "block": {"nvc": block(nvc), "nvc swiglu": block_swiglu, "xla": block(xla)}}


def run_moelayer(a):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ..ragged_dot import ragged_dot, ragged_dot_swiglu
    env = B.Env()
    gpu = env.platform == "gpu"
    hidden = a.hidden or (7168 if gpu else 256)
    ffn = a.ffn or (2048 if gpu else 128)
    experts = a.experts or ([32] if a.quick else [32, 256] if gpu else [8, 32])
    tokens = a.tokens or ([8, 128] if a.quick else [8, 32, 128])
    calls = a.calls or (10 if gpu else 2)
    reps = a.reps or (2 if not gpu else 5 if a.quick else 10)
    device_time = B.switch(a.device_time, gpu)
    env.log(f"# jax_nvcomm bench moelayer: 1 x {env.devices[0].device_kind} ({env.platform}), "
            f"jax {jax.__version__}; hidden {hidden}, F {ffn}, top-{a.top_k}, bf16")
    env.log(f"# {calls} chained calls per program, {reps} programs; us per call: median; "
            f"dN: device time per call from a profiler trace" if device_time else
            f"# {calls} chained calls per program, {reps} programs; us per call: median")
    env.log(f"# bound: bytes of the weights of experts with rows / {a.bandwidth / 1e12:.2f} "
            "TB/s")
    if not gpu:
        env.log("# NOTE: CPU devices: these numbers are meaningless for performance")
    ops = _ops(env, ragged_dot, ragged_dot_swiglu)
    dev = env.devices[0]
    rng = np.random.default_rng(0)
    rows = []
    for e in experts:
        key = jax.random.PRNGKey(e)
        k1, k2, k3, k4 = jax.random.split(key, 4)

        def weights(k, shape):
            return jax.device_put(
                (jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[1])).astype(
                    jnp.bfloat16), dev)
        wg = weights(k1, (e, hidden, ffn))
        wu = weights(k2, (e, hidden, ffn)) if "block" in a.ops else None
        wd = weights(k3, (e, ffn, hidden))
        for t in tokens:
            m = t * a.top_k
            gs_np = routing_sizes(rng, t, e, a.top_k)
            active = int((gs_np > 0).sum())
            gs = jax.device_put(jnp.asarray(gs_np), dev)
            x_h = jax.device_put(jax.random.normal(k4, (m, hidden), jnp.bfloat16), dev)
            x_f = jax.device_put(jax.random.normal(k4, (m, ffn), jnp.bfloat16), dev)
            for op in a.ops:
                mats = {"gate": [(hidden, ffn)], "down": [(ffn, hidden)],
                        "block": [(hidden, ffn)] * 2 + [(ffn, hidden)]}[op]
                bound_us = sum(active * k * n * 2 for k, n in mats) / a.bandwidth * 1e6
                args = {"gate": (x_h, wg, gs), "down": (x_f, wd, gs),
                        "block": (x_h, wg, wu, wd, gs)}[op]
                row = dict(experts=e, tokens=t, m=m, op=op, active_experts=active,
                           bound_us=round(bound_us, 2))
                outs = {}
                for meth, fn in ops[op].items():
                    try:
                        r = B._time(env, _chain(fn, calls), args, calls, reps,
                                    device_time=device_time)
                        outs[meth] = jax.jit(fn)(*args)
                        row[meth] = r
                    except Exception as ex:  # noqa: BLE001 - one failing method keeps the rest
                        row[meth] = dict(error=f"{type(ex).__name__}: {str(ex)[:300]}")
                # each method's result on these inputs against lax's (one call each)
                if "xla" in outs:
                    ref = np.asarray(outs["xla"], np.float64)
                    for meth, y in outs.items():
                        if meth != "xla":
                            d = np.linalg.norm(np.asarray(y, np.float64) - ref)
                            row[meth]["rel_diff_to_xla"] = float(d / max(np.linalg.norm(ref),
                                                                         1e-30))
                rows.append(row)
                env.log(_line(row))
            del x_h, x_f
        del wg, wu, wd
    env.log(_table(rows))
    if env.is_main:
        os.makedirs(a.out, exist_ok=True)
        B._write_json(env, a.out, "moelayer.json", dict(hidden=hidden, ffn=ffn, top_k=a.top_k,
                                                   calls=calls, reps=reps, rows=rows))
    return 0


def _us(r):
    """(the time a row is judged by: device time when traced, else loop time; its text)."""
    if not r or "error" in r:
        return None, "error" if r else "-"
    dev = r.get("device_us")
    loop = r["median_us"]
    t = dev if dev else loop
    return t, (f"{loop:.1f} d{dev:.1f}" if dev else f"{loop:.1f}")


def _line(row):
    parts = [f"E {row['experts']:>3} T {row['tokens']:>3} {row['op']:<6} bound "
             f"{row['bound_us']:.1f} us"]
    for meth in METHODS:
        if meth in row:
            t, txt = _us(row[meth])
            parts.append(f"{meth}: {txt}" + (f" ({t / row['bound_us']:.2f}x)" if t else ""))
    diffs = [f"{m} {row[m]['rel_diff_to_xla']:.1e}" for m in METHODS
             if isinstance(row.get(m), dict) and "rel_diff_to_xla" in row[m]]
    return "# " + "; ".join(parts) + (f" | vs xla: {', '.join(diffs)}" if diffs else "")


def _table(rows):
    head = (f"{'E':>4} {'T':>4} {'M':>5} {'op':<6} {'bound':>8} | "
            + " | ".join(f"{m:>18}" for m in METHODS) + " | nvc/bound xla/nvc")
    out = [head, "-" * len(head)]
    for r in rows:
        cells, times = [], {}
        for m in METHODS:
            t, txt = _us(r.get(m))
            times[m] = t
            cells.append(f"{txt:>18}")
        best = min((times[m] for m in ("nvc", "nvc swiglu") if times.get(m)), default=None)
        ratio = f"{best / r['bound_us']:9.2f}" if best else f"{'-':>9}"
        speed = f"{times['xla'] / best:8.2f}" if best and times.get("xla") else f"{'-':>8}"
        out.append(f"{r['experts']:>4} {r['tokens']:>4} {r['m']:>5} {r['op']:<6} "
                   f"{r['bound_us']:>8.1f} | " + " | ".join(cells) + f" | {ratio} {speed}")
    out.append("(us per call: loop time, dN device time; ratios on device time when traced; "
               "nvc/bound: the better nvc method)")
    return "\n".join(out)
