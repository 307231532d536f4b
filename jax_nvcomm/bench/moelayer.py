"""`python -m jax_nvcomm.bench moelayer`: the expert compute of an MoE layer at decode shapes,
one device (world 1): nvc.ragged_dot against lax.ragged_dot, each row with its weight-read
bound.

Shapes (the defaults; --hidden, --ffn, --experts, --tokens change them): hidden 7168, F 2048,
32 and 256 local experts, top-8, 8 / 32 / 128 tokens, so M = tokens x 8 rows sorted by expert
(random routing: 8 distinct experts per token, uniform). Ops:
  gate      [M, hidden] x [E, hidden, F]     (the up product has the same shape)
  down      [M, F] x [E, F, hidden]
  block     the expert block: gate and up, silu(gate) * up, down (3 products)
Weights (--weights): bf16; int8 with a float32 scale per output channel (jax-llm-examples'
quantized MoE form); fp8 (float8_e4m3fn) with a float32 scale per 128 x 128 block (DeepSeek-V3's
form). The activations are bf16 in every case.
Methods:
  nvc       nvc.ragged_dot(strategy="kernel"): the package's GPU kernel (8-bit weights: the
            8-bit-weight kernel with the scales)
  nvc swiglu  block only: gate and up in one pass with silu(gate) * up fused in, then down
  xla       XLA on the same weights: bf16 lax.ragged_dot; int8 lax.ragged_dot(x, w_int8) times
            the scale gathered per row (the public code's form); fp8 the weights dequantised
            to bf16 in the jit, then lax.ragged_dot (lax refuses fp8 x bf16)
bound: the bytes of the weights (and their scales) of the experts that receive rows, each read
once, / the GPU's peak memory bandwidth: a table by device name (H100 SXM 3.35e12, H100 PCIe
2.0e12, H200 4.8e12, B200 8.0e12 bytes/s), else the device's memory clock x bus width x 2
(cuda-python), printed with the table; --hbm-bytes-per-s overrides it. Each row also records
each nvc method's result against XLA's on the same inputs (`rel_diff_to_xla`: ||nvc - xla|| /
||xla||, bf16 rounding: ~1e-3). Times: `calls` chained calls in one jit (each call's input
takes one element of the previous output, so they run in order), loop us per call (median
over the programs) and, on GPUs, the kernels' device time per call from a profiler trace (dN;
as the other loop benchmarks). On CPU devices the shapes shrink (hidden 256,
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
                   help="32 experts only, 8 and 128 tokens, fewer repetitions (the layer "
                        "rows on CPU devices keep their small shapes)")
    s.add_argument("--hidden", type=int, default=None,
                   help="model hidden size (default 7168 on GPUs, 256 on CPU devices)")
    s.add_argument("--ffn", type=int, default=None,
                   help="each expert's FFN size F (default 2048 on GPUs, 128 on CPU devices)")
    s.add_argument("--experts", type=int, nargs="+", default=None,
                   help="experts on the device, one row set per count (default 32 256 on "
                        "GPUs, 8 32 on CPU devices; --quick: 32)")
    s.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens per call, one row per count; each token goes to --top-k "
                        "experts (default 8 32 128; --quick: 8 128)")
    s.add_argument("--top-k", type=int, default=8,
                   help="experts per token: the rows of the products are tokens x top-k "
                        "(default 8)")
    s.add_argument("--calls", type=int, default=None,
                   help="chained calls per program (default 10 on GPUs, 2 on CPU)")
    s.add_argument("--reps", type=int, default=None,
                   help="timed programs per row (default 10 on GPUs, 5 with --quick, 2 on CPU)")
    s.add_argument("--weights", choices=("bf16", "int8", "fp8"), default="bf16",
                   help="expert weight format: bf16; int8 with a scale per output channel; "
                        "fp8 (e4m3) with a scale per 128 x 128 block (default bf16)")
    s.add_argument("--hbm-bytes-per-s", "--bandwidth", dest="hbm_bytes_per_s", type=float,
                   default=None, metavar="B",
                   help="memory bandwidth of the weight-read bound in bytes/s (default: the "
                        "device's peak, from a table by name or its memory clock x bus width "
                        "x 2; printed with the table)")
    s.add_argument("--device-time", choices=("auto", "on", "off"), default="auto",
                   help="also measure the kernels' device time per call from a profiler "
                        "trace (default auto: on for GPUs, off on CPU devices)")
    s.add_argument("--ops", nargs="+", default=["gate", "down", "block"],
                   choices=("gate", "down", "block"),
                   help="which products: gate [M, hidden] x [E, hidden, F], down [M, F] x "
                        "[E, F, hidden], block = gate, up, SwiGLU, down (default all three)")


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


def quantise(w, kind):
    """(weights, scale) of float weights w [G, K, N] in `kind`: "bf16" (w as bf16, no scale),
    "int8" (round(w / s), s = max |w| over K / 127 per output channel [G, N]) or "fp8"
    (e4m3(w / s), s = max |w| over each 128 x 128 block / 448, [G, ceil(K/128), ceil(N/128)])."""
    import jax.numpy as jnp
    if kind == "bf16":
        return w.astype(jnp.bfloat16), None
    w = w.astype(jnp.float32)
    if kind == "int8":
        s = jnp.maximum(jnp.max(jnp.abs(w), axis=1), 1e-30) / 127
        return jnp.clip(jnp.round(w / s[:, None, :]), -127, 127).astype(jnp.int8), s
    g, k, n = w.shape
    kb, nb = -(-k // 128), -(-n // 128)
    p = jnp.pad(jnp.abs(w), ((0, 0), (0, kb * 128 - k), (0, nb * 128 - n)))
    s = jnp.maximum(p.reshape(g, kb, 128, nb, 128).max(axis=(2, 4)), 1e-30) / 448
    full = jnp.repeat(jnp.repeat(s, 128, 1), 128, 2)[:, :k, :n]
    return (w / full).astype(jnp.float8_e4m3fn), s


def scale_bytes(kind, k, n):
    """Bytes of one expert's scale of a [K, N] matrix in `kind`."""
    if kind == "int8":
        return 4 * n
    if kind == "fp8":
        return 4 * -(-k // 128) * -(-n // 128)
    return 0


def _ops(env, nvc_rd, nvc_sw):
    """{op: {method: fn(x, *weights, gs)}} (methods that do not apply are left out); each weight
    is a (weights, scale or None) pair."""
    import importlib

    import jax
    import jax.numpy as jnp
    from jax import lax
    rd = importlib.import_module("jax_nvcomm.ragged_dot")

    def nvc(x, w, gs):
        q, s = w
        return nvc_rd(x, q, gs, rhs_scale=s, strategy="kernel")

    def xla(x, w, gs):
        q, s = w
        if s is None:
            return lax.ragged_dot(x, q, gs)
        if q.dtype == jnp.int8:  # the public quantized form: int8 product, scale per row
            y = lax.ragged_dot(x, q, gs, preferred_element_type=jnp.float32)
            return (y * s[rd._row_groups(gs, x.shape[0])]).astype(x.dtype)
        mode = 1 if s.ndim == 2 else 2
        return lax.ragged_dot(x, rd.dequantize(q, s, mode, x.dtype), gs)

    def block(rd_):
        def f(x, wg, wu, wd, gs):
            g = rd_(x, wg, gs)
            u = rd_(x, wu, gs)
            h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
            return rd_(h, wd, gs)
        return f

    def block_swiglu(x, wg, wu, wd, gs):
        h = nvc_sw(x, wg[0], wu[0], gs, gate_scale=wg[1], up_scale=wu[1], strategy="kernel")
        return nvc(h, wd, gs)

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
    bw, bw_src = B.hbm_bytes_per_s(env, a.hbm_bytes_per_s)
    env.log(f"# jax_nvcomm bench moelayer: 1 x {env.devices[0].device_kind} ({env.platform}), "
            f"jax {jax.__version__}; hidden {hidden}, F {ffn}, top-{a.top_k}, bf16 "
            f"activations, {a.weights} weights")
    env.log(f"# {calls} chained calls per program, {reps} programs; us per call: median; "
            f"dN: device time per call from a profiler trace" if device_time else
            f"# {calls} chained calls per program, {reps} programs; us per call: median")
    env.log(f"# bound: bytes of the weights (+ scales) of experts with rows / {bw / 1e12:.2f} "
            f"TB/s ({bw_src})")
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
            make = jax.jit(lambda kk: quantise(jax.random.normal(kk, shape, jnp.float32)
                                               / np.sqrt(shape[1]), a.weights))
            return jax.device_put(make(k), dev)
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
                itemsize = 2 if a.weights == "bf16" else 1
                bound_us = sum(active * (k * n * itemsize + scale_bytes(a.weights, k, n))
                               for k, n in mats) / bw * 1e6
                args = {"gate": (x_h, wg, gs), "down": (x_f, wd, gs),
                        "block": (x_h, wg, wu, wd, gs)}[op]
                row = dict(experts=e, tokens=t, m=m, op=op, active_experts=active,
                           weights=a.weights, bound_us=round(bound_us, 2),
                           hbm_bytes_per_s=bw)
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
    env.log(f"# bound bandwidth: {bw:.3g} bytes/s ({bw_src}); {a.weights} weights")
    if env.is_main:
        os.makedirs(a.out, exist_ok=True)
        B._write_json(env, a.out, "moelayer.json", dict(hidden=hidden, ffn=ffn, top_k=a.top_k,
                                                   calls=calls, reps=reps, weights=a.weights,
                                                   hbm_bytes_per_s=bw, hbm_source=bw_src,
                                                   rows=rows))
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
