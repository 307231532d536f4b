"""`python -m jax_nvcomm.bench moe`: moe_dispatch / moe_combine (and the split halves with
--split) against the XLA references (ragged_all_to_all and dense all_to_all) over tokens per
rank, bf16 and fp8 dispatch."""
from __future__ import annotations

from . import xla_best
from .common import (Env, _cell, _device_time_on, _human, _measure, _pivot, _plot, _put,
                     _ratio, _row0, _units, _write_json, add_loop_arguments,
                     add_xla_best_argument)


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
    from .. import reference
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
    try:
        moe = env.nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                                      dtype=dtype, scale_cols=(H // 128) if fp8 else 0)
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

                def run(opts=None, dev=None, body=body, args=args, specs=specs, init=init,
                        op=op):
                    return _measure(env, f"{name} {op}", mesh, body, args, specs, 3, a,
                                    unroll=unroll, steps=steps, init=init,
                                    compiler_options=opts, device_time=dev)
                row.update(run())
                if W == 1 and "median_us" in row:
                    pairs = T * K
                    moved = {"dispatch": T * H * isz + pairs * H * isz,
                             "combine": pairs * H * 2 + T * H * 2}
                    moved["dispatch+combine"] = moved["dispatch"] + moved["combine"]
                    row["min_bytes"] = moved[op]
                    row["GBps"] = moved[op] / (row["median_us"] * 1e-6) / 1e9
                rows.append(row)
                env.log(f"#   T={T} {dtype_name} {name} {op}: {_cell(row)}")
                if name.startswith("xla") and xla_best.wanted(getattr(a, "xla_best", "off")):
                    b = xla_best.best(env, f"{name} best", lambda o: run(o, False),
                                      default=row, mode=a.xla_best)
                    rows.append(b)
                    if len(b["xla_variants"]) > 1:
                        env.log(f"#   T={T} {dtype_name} {name} best {op}: {_cell(b)} "
                                f"[{b['xla_flags']}; {b['xla_variants']}]")
    finally:
        if moe is not None:
            moe.close()
    return rows


def run_moe(a):
    env = Env()
    a.device_time_on = _device_time_on(env, a)
    env.header("moe", a)
    for line in xla_best.header_lines(env.platform, a.xla_best):
        env.log(f"# {line}")
    cfg = _moe_config(env, a)
    env.log(f"# config: world {env.world}, experts {cfg['experts']} "
            f"({cfg['experts'] // env.world} per rank), top-{cfg['top_k']}, hidden "
            f"{cfg['hidden']}, tokens/rank {cfg['tokens']}; dispatch bf16 and fp8 "
            f"(float8_e4m3fn + float32 scales, hidden/128 cols), combine bf16")
    mesh = env.mesh()
    rows = []
    for dtype_name in getattr(a, "dtypes", None) or ("bf16", "fp8"):
        for T in cfg["tokens"]:
            rows += _moe_point(env, mesh, cfg, T, dtype_name, a)
    env.log(f"\n## MoE dispatch/combine, world {env.world}: {_units(a)}; "
            "speedup = faster XLA reference / jax_nvcomm (loop times); vs best = the fastest "
            "XLA reference with XLA's flags (header) / jax_nvcomm")
    methods = ["nvc"] + (["nvc split"] if getattr(a, "split", False) else []) + [
        "xla ragged", "xla dense", "xla ragged best", "xla dense best"]

    def fastest(g, names):
        return min(names, key=lambda m: g.get(m, {}).get("median_us", 1e300))
    extra = [("speedup", lambda g: _ratio(g, fastest(g, ("xla ragged", "xla dense")), ["nvc"])),
             ("vs best", lambda g: _ratio(g, fastest(g, ("xla ragged best", "xla dense best")),
                                          ["nvc"])),
             ("XLA flags", lambda g: flags_cell(g))]

    def flags_cell(g):
        m = fastest(g, ("xla ragged best", "xla dense best"))
        return f"{m[4:-5]}: {g[m]['xla_flags']}" if m in g else "-"
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
    env.log(xla_best.summary_line(rows, env.platform, a.xla_best))
    _write_json(env, a.out, "moe.json", dict(
        meta=dict(platform=env.platform, topology=env.topology(), world=env.world,
                  processes=env.nprocs,
                  device_kind=env.devices[0].device_kind, unroll=a.unroll, steps=a.steps,
                  reps=a.reps, xla_best=xla_best.meta(rows, env.platform, a.xla_best),
                  **{k: v for k, v in cfg.items()}), rows=rows))
    series = {}
    for r in rows:
        if "median_us" in r:
            series.setdefault(f"{r['dtype']} {r['op']}", {}).setdefault(r["method"], []).append(
                (r["tokens"], r["median_us"]))
    _plot(env, a.out, "moe.png", series, f"MoE world {env.world} ({env.platform})",
          "tokens per rank")
    return 0


def add_arguments(s):
    """The flags of `bench moe`."""
    add_loop_arguments(s, quick="fewer sizes: 1, 8 and 32 tokens per rank")
    add_xla_best_argument(s)
    s.add_argument("--tokens", type=int, nargs="*", metavar="T",
                   help="tokens per rank (default: 1 8 32 128 512 4096)")
    s.add_argument("--methods", nargs="*", metavar="METHOD",
                   choices=("nvc", "nvc split", "xla ragged", "xla dense"),
                   help="only these methods (default: all): 'nvc' (moe_dispatch / moe_combine), "
                        "'nvc split' (needs --split), 'xla ragged' (lax.ragged_all_to_all), "
                        "'xla dense' (lax.all_to_all of capacity-padded buffers)")
    s.add_argument("--dtypes", nargs="*", choices=("bf16", "fp8"),
                   help="dispatch payload dtypes (default: both; combine is bf16)")
    s.add_argument("--moe-hidden", type=int, default=None, metavar="H",
                   help="hidden size (default: 7168 on GPUs, 256 on CPU)")
    s.add_argument("--experts", type=int, default=None, metavar="E",
                   help="number of experts, top-8 routing (default: 32 per rank, 256 from 8 "
                        "ranks on; 4 per rank on CPU)")
    s.add_argument("--split", action="store_true",
                   help="also the split halves (moe_dispatch_send + _recv, "
                        "moe_combine_send + _recv) back to back, beside the fused calls")
