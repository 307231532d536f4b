"""`python -m jax_nvcomm.bench allreduce`: all_reduce, all_reduce_rms_norm and
all_reduce_rms_norm_quant against lax.psum (+ XLA's add + RMSNorm (+ FP8 quantisation)) over a
sweep of message sizes; on one device also the fused epilogue's bandwidth against XLA's copy
kernel; `--tune`: the crossovers per world size."""
from __future__ import annotations

import json

from . import xla_best
from .common import (Env, _cell, _close, _device_time_on, _human, _measure, _open_comm,
                     _pivot, _plot, _put, _ratio, _units, _varying, _write_json,
                     add_loop_arguments, add_xla_best_argument, byte_size)


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
# XLA at its best (bench/xla_best.py): each XLA method with the fastest of its flags
BEST = {m[-1]: m[-1] + " best" for m in (AR_METHODS, FUSED_METHODS, QUANT_METHODS)}


def _ar_methods(env, comm, axis, eps, fused):
    """name -> (body, carry_n) with carry (x,) or (x, residual) and consts (weight,).
    fused: False (all_reduce), True (all_reduce_rms_norm) or "quant"
    (all_reduce_rms_norm_quant: carry (x, residual_out), q and scale kept)."""
    from jax import lax

    from .. import reference
    nvc = env.nvc
    V = _varying
    m = {}
    if fused == "quant":
        from ..allreduce_quant import xla_all_reduce_rms_norm_quant

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


def _ar_point(env, comm, mesh, hidden, tokens, a, methods=None, fused_too=True,
              dtype="bfloat16", quiet=False):
    """Rows for one message shape [tokens, hidden] of `dtype` per rank (comm None: XLA only);
    with --xla-best (bench/xla_best.py) each XLA method also gets its "<method> best" row.
    quiet: no line per row (the caller reports)."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P
    axis = "x"
    W = int(mesh.shape[axis])
    dt = jnp.dtype(dtype)
    nbytes = tokens * hidden * dt.itemsize
    rng = np.random.default_rng(0)
    x = rng.standard_normal((W * tokens, hidden)).astype(dt)
    res = rng.standard_normal((W * tokens, hidden)).astype(dt)
    w = (1 + 0.1 * rng.standard_normal((hidden,))).astype(dt)
    xs, rs, ws = _put(env, mesh, x, P(axis)), _put(env, mesh, res, P(axis)), _put(env, mesh, w, P())
    rows = []
    for fused in ((False, True, "quant") if fused_too else (False,)):
        if methods is not None and fused == "quant" and not methods & set(QUANT_METHODS):
            continue
        for name, (body, carry_n) in _ar_methods(env, comm, axis, 1e-6, fused).items():
            if methods is not None and name not in methods:
                continue
            row = dict(method=name, hidden=hidden, tokens=tokens, bytes=nbytes, world=W,
                       dtype=dt.name)
            args = (xs, rs, ws) if carry_n == 2 else (xs, ws)
            specs = (P(axis), P(axis), P()) if carry_n == 2 else (P(axis), P())
            if "oneshot" in name and nbytes > comm.lamport_slot_bytes:
                row.update(skipped=f"> lamport_slot_bytes {comm.lamport_slot_bytes}")
            elif "nvc" in name and nbytes > comm.max_message_bytes:
                row.update(skipped=f"> max_message_bytes {comm.max_message_bytes}")
            elif W == 1 and name == "lax.psum":
                row.update(skipped="a psum over one device is compiled away")
            else:
                row.update(_measure(env, name, mesh, body, args, specs, carry_n, a))
                if not quiet:
                    env.log(f"#   {tokens}x{hidden} ({_human(nbytes)}) {name}: {_cell(row)}")
            rows.append(row)
            if (name in BEST and xla_best.wanted(getattr(a, "xla_best", "off"))
                    and "skipped" not in row):
                b = xla_best.best(env, BEST[name], lambda opts, body=body, args=args,
                                  specs=specs, carry_n=carry_n: _measure(
                                      env, name, mesh, body, args, specs, carry_n, a,
                                      compiler_options=opts, device_time=False),
                                  default=row, mode=a.xla_best)
                rows.append(b)
                if not quiet and len(b["xla_variants"]) > 1:
                    env.log(f"#   {tokens}x{hidden} ({_human(nbytes)}) {BEST[name]}: "
                            f"{_cell(b)} [{b['xla_flags']}; {b['xla_variants']}]")
    return rows


def crossover(by, one_m, two_m, base_m):
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
    return one, two


def crossovers(rows):
    """(oneshot_max, twoshot_max) of one world size (bf16 rows, `--tune`). The table
    serves all_reduce and all_reduce_rms_norm alike, so where fused rows were measured too each
    threshold is the smaller of the plain op's (vs lax.psum) and the fused op's (vs psum +
    XLA's add + RMSNorm) crossovers: no op is sent to a strategy that loses for it."""
    by = {}
    for r in rows:
        if "median_us" in r:
            by.setdefault(r["bytes"], {})[r["method"]] = r["median_us"]
    one, two = crossover(by, *AR_METHODS)
    if any(FUSED_METHODS[0] in t or FUSED_METHODS[1] in t for t in by.values()):
        f_one, f_two = crossover(by, *FUSED_METHODS)
        one, two = min(one, f_one), min(two, f_two)
    return one, two


def tuning_rows(measured, dtype="bfloat16"):
    """Rows of a tuning file (jax_nvcomm/tuning.py) from {world: (oneshot_max, twoshot_max)}:
    one per world size for every op (the smaller crossover of the plain and the fused op)."""
    return [dict(world_size=w, op="*", dtype=dtype, oneshot_max_bytes=int(one),
                 twoshot_max_bytes=int(two)) for w, (one, two) in sorted(measured.items())]


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
    for line in xla_best.header_lines(env.platform, a.xla_best):
        env.log(f"# {line}")
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
    best_note = ("; vs best = XLA best / best jax_nvcomm (XLA best: the fastest of XLA's "
                 "default and its flags, header)")

    def vs(methods):
        return [("speedup", lambda g: _ratio(g, methods[-1], methods[:2])),
                ("vs best", lambda g: _ratio(g, BEST[methods[-1]], methods[:2])),
                ("XLA flags", lambda g: g.get(BEST[methods[-1]], {}).get("xla_flags", "-"))]
    env.log(f"\n## all-reduce, bf16, world {env.world}: {_units(a)}; "
            "speedup = lax.psum / best jax_nvcomm (loop times)" + best_note)
    _pivot(env, rows, keys, AR_METHODS + [BEST["lax.psum"]], vs(AR_METHODS))
    env.log(f"\n## all-reduce + residual + RMSNorm, bf16, world {env.world}: {_units(a)}; "
            "speedup = psum+rmsnorm / best fused" + best_note)
    _pivot(env, rows, keys, FUSED_METHODS + [BEST["psum+rmsnorm"]], vs(FUSED_METHODS))
    env.log(f"\n## all-reduce + residual + RMSNorm + FP8 output (all_reduce_rms_norm_quant), "
            f"bf16 in, world {env.world}: {_units(a)}; fused/quant = the fused op's time / the "
            "quant op's, same strategy (>= 0.91: within 10%)" + best_note)
    _pivot(env, rows, keys, QUANT_METHODS + [BEST["psum+rmsnorm+quant"]],
           [(f"fused/quant {s}", lambda g, s=s: _ratio(g, f"nvc fused {s}", [f"nvc quant {s}"]))
            for s in ("oneshot", "twoshot")] + vs(QUANT_METHODS))
    env.log(xla_best.summary_line(rows, env.platform, a.xla_best))
    result["meta"]["xla_best"] = xla_best.meta(rows, env.platform, a.xla_best)
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
    """Crossovers per available world size; prints them as rows of a tuning file."""
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
    rows = tuning_rows(measured)
    if env.platform == "cpu":
        env.log("# NOTE: measured on CPU devices: meaningless as thresholds")
    env.log("\n# tuning-file rows (bf16, every op; `python -m jax_nvcomm.tune` measures each op "
            "and dtype and writes a file that communicators use, docs/tuning.md):")
    for r in rows:
        env.log("#   " + json.dumps(r))
    return dict(rows=rows_all, thresholds={str(k): list(v) for k, v in measured.items()},
                tuning_rows=rows)


def add_arguments(s):
    """The flags of `bench allreduce`."""
    add_loop_arguments(s, quick="a CPU smoke run: hidden 512, messages up to 64 KiB, 7 runs")
    add_xla_best_argument(s)
    s.add_argument("--tune", action="store_true",
                   help="also measure the one-shot / two-shot / psum crossovers of this world "
                        "size and print them as tuning-file rows (`python -m jax_nvcomm.tune` "
                        "measures every op and dtype and writes the file)")
    s.add_argument("--hidden", type=int, nargs="*", metavar="H",
                   help="hidden sizes (default: 4096 7168 8192; 512 with --quick)")
    s.add_argument("--max-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="largest message per rank, e.g. 1MiB or 1048576; sizes double from 4 KiB "
                        "up to it (default: 128 MiB; 64 KiB with --quick)")
    s.add_argument("--tokens", type=int, nargs="*", metavar="T",
                   help="only the shapes with these tokens per rank (default: every size)")
    s.add_argument("--methods", nargs="*", choices=AR_METHODS + FUSED_METHODS + QUANT_METHODS,
                   metavar="METHOD",
                   help="only these methods (default: all): " + ", ".join(
                       repr(m) for m in AR_METHODS + FUSED_METHODS + QUANT_METHODS))
