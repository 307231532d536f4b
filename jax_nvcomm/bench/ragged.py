"""`python -m jax_nvcomm.bench ragged`: nvc.ragged_all_to_all against lax.ragged_all_to_all at
MoE shapes: the token exchange of a dropless expert-parallel layer (examples/moe_ragged.py).

Shapes: hidden 2048 (128 experts) and 7168 (256 experts), bf16 rows, 128 / 512 / 4096 tokens
per rank, top-8; routing balanced (K distinct experts per token, uniform) or skewed (K distinct
experts drawn by a Zipf popularity p_e ~ 1 / rank(e), experts ranked in a seeded random order:
some ranks receive several times the mean). Each rank's T*K (token, expert) rows are sorted by
expert, so one slice per peer, as JAX MoE code sends them:
  dispatch  operand [T*K, H] -> output [M, H], rows ordered by source, M by the sizing:
            busiest: the busiest rank's received rows (rounded up to 128: the buffer a
              capacity-sized engine would hold);
            worst: MaxText's worst case, T*K x min(W, E/K) rows (local rows x min(EP, E/top_k):
              whatever the routing, nothing can be dropped), far beyond a default
              Communicator's max_message_bytes at training sizes;
  combine   the way back: operand [M, H] -> output [T*K, H].
The offsets and sizes are computed on the host from the routing and passed in (no
group-size exchange in the timed call). Methods:
  nvc         nvc.ragged_all_to_all: busiest sizing on a Communicator sized for the call (one
              round); worst sizing on a Communicator of --budget max_message_bytes (default:
              the Communicator's default, 32 MiB), where the output exceeds it: the chunked path
  nvc chunk=C the chunked path (strategy="chunked") on the --budget Communicator with
              ragged_chunk_bytes=C, one column per --chunks value: the chunk-size sweep
  xla         lax.ragged_all_to_all (on CPU devices jax_nvcomm.reference's emulation)
  xla pieces  the same with each slice split into ~512/W consecutive updates (XLA's GPU
              kernel runs one thread block per update and peer)
  <xla method> best  (unless --xla-best off) the fastest of that method compiled with XLA's
              defaults and with each ragged-all-to-all fast-path flag of this XLA
              (on CPU devices XLA's default: the flags do not apply)
Times: loop us per call and device time (`python -m jax_nvcomm.bench --help`). Writes OUT/ragged.json, the tables
and OUT/ragged.png.
"""
from __future__ import annotations

from . import common as B
from . import xla_best

XLA_METHODS = ["xla", "xla pieces"]
METHODS = ["nvc"] + XLA_METHODS
COLUMNS = METHODS + [f"{m} best" for m in XLA_METHODS]  # the tables' columns (+ chunk sweep)
ROUTINGS = ("balanced", "skewed")
SIZINGS = ("busiest", "worst")
DEFAULT_BUDGET = 32 << 20        # Communicator's default max_message_bytes


def chunk_method(c: int) -> str:
    """The column of the chunk sweep for slot size c bytes."""
    return f"nvc chunk={c >> 10}K" if c % 1024 == 0 else f"nvc chunk={c}"


def worst_rows(tokens, top_k, experts, world):
    """MaxText's worst-case dispatch output rows: local rows x min(EP, E / top_k)."""
    return tokens * top_k * min(world, experts // top_k)
EXPERTS = {2048: 128, 7168: 256}


def routing_ids(rng, tokens, experts, top_k, routing):
    """int [tokens, top_k]: distinct experts per token; balanced (uniform) or skewed (Zipf
    popularity over a seeded random order of the experts), by Gumbel top-k sampling."""
    import numpy as np
    logp = np.zeros(experts)
    if routing == "skewed":
        rank = np.random.default_rng(12345).permutation(experts)
        logp = -np.log1p(rank)
    g = rng.gumbel(size=(tokens, experts)) + logp
    return np.argsort(-g, axis=1)[:, :top_k]


def exchange_plan(ids_all, experts, world):
    """The per-rank offsets of both exchanges from every rank's routing ids_all [W, T, K]:
    dict of int32 [W, W] arrays (row r: rank r's vector) disp_in/disp_send/disp_out/disp_recv,
    comb_in/comb_send/comb_out/comb_recv, and recv_rows [W] (rows each rank receives)."""
    import numpy as np
    W = world
    L = experts // W
    counts = np.stack([np.bincount(i.reshape(-1), minlength=experts) for i in ids_all])
    chunk = counts.reshape(W, W, L).sum(-1)                     # [source, destination]
    excl = lambda a, ax: np.cumsum(a, axis=ax) - a              # noqa: E731
    d = dict(disp_send=chunk, disp_in=excl(chunk, 1), disp_out=excl(chunk, 0),
             disp_recv=chunk.T)
    d.update(comb_send=chunk.T, comb_in=excl(chunk.T, 1), comb_out=excl(chunk, 1).T,
             comb_recv=chunk)
    out = {k: np.ascontiguousarray(v, dtype=np.int32) for k, v in d.items()}
    out["recv_rows"] = chunk.sum(0)
    return out


def _xla_methods(axis, world, M, N):
    """XLA's side: name -> fn(operand, output, in_off, send, out_off, recv) (each also timed
    with XLA's fast-path flags: --xla-best)."""
    from .. import reference
    chunk = max(1, min(M, N))

    def pieces(*args):
        return reference._ragged_all_to_all(
            *args, axis_name=axis, chunk=chunk,
            pieces=reference._auto_pieces(world, chunk, None))
    return {"xla": lambda *args: reference.ragged_all_to_all_xla(*args, axis_name=axis),
            "xla pieces": pieces}


def _point(env, mesh, hidden, experts, T, K, routing, a, sizing="busiest"):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P
    W = env.world
    row = hidden * 2
    rng = np.random.default_rng([hidden, T, ROUTINGS.index(routing)])
    ids = np.stack([routing_ids(rng, T, experts, K, routing) for _ in range(W)])
    plan = exchange_plan(ids, experts, W)
    N = T * K
    budget = a.budget or DEFAULT_BUDGET
    M = max(128, -(-int(plan["recv_rows"].max()) // 128) * 128)
    if sizing == "worst":
        M = max(int(plan["recv_rows"].max()), worst_rows(T, K, experts, W))
    mean_recv = float(plan["recv_rows"].mean())
    base = dict(hidden=hidden, experts=experts, tokens=T, top_k=K, routing=routing, world=W,
                recv_rows_max=int(plan["recv_rows"].max()), recv_rows_mean=mean_recv,
                capacity_rows=M, sizing=sizing, out_bytes=M * row,
                budget=budget if sizing == "worst" else None)
    self_rows = np.diag(plan["disp_send"])
    sent = (plan["disp_send"].sum(1) - self_rows) * row           # off-rank bytes per rank
    rows = []
    comm_bytes = (max(N, M) * row if sizing == "busiest" else budget) * 10
    need = 3 * (N + M) * row + comm_bytes                         # arrays + comm buffers
    if env.mem_limit and need > 0.45 * env.mem_limit:
        return [dict(base, method="*", op="*", skipped=f"needs ~{B._human(need)} per device")]
    comm, comms = None, {}
    chunks = list(a.chunks if a.chunks is not None else ([1024] if a.quick else
                                                        [256 << 10, 1 << 20, 4 << 20]))
    methods = METHODS + [chunk_method(c) for c in chunks]
    if "nvc" in (a.methods or METHODS):
        comm = B._open_comm(env, mesh, max(N, M) * row if sizing == "busiest" else budget)
    if not a.methods or "nvc" in a.methods:
        for c in chunks:
            comms[c] = B._open_comm(env, mesh, budget, ragged_chunk_bytes=c)
    try:
        for op in ("dispatch", "combine"):
            n_in, n_out = (N, M) if op == "dispatch" else (M, N)
            pre = "disp" if op == "dispatch" else "comb"
            host = rng.standard_normal((W * n_in, hidden)).astype(np.float32)
            x = B._put(env, mesh, np.asarray(jnp.asarray(host, jnp.bfloat16)), P("x"))
            offs = [B._put(env, mesh, plan[f"{pre}_{k}"].reshape(-1), P("x"))
                    for k in ("in", "send", "out", "recv")]
            fns = dict(_xla_methods("x", W, n_out, n_in))
            if comm is not None:
                fns["nvc"] = lambda *args: env.nvc.ragged_all_to_all(*args, comm)
            for c, cm in comms.items():
                if cm is not None:
                    fns[chunk_method(c)] = lambda *args, cm=cm: env.nvc.ragged_all_to_all(
                        *args, cm, strategy="chunked")
            first = {}  # one call of each method, compared with XLA's (pure data movement:
            # the rows must be bit for bit the same)
            for name in methods:
                if name not in fns or (a.methods and name not in a.methods and
                                       not name.startswith("nvc chunk")):
                    continue
                r = dict(base, op=op, method=name, busiest_rank_bytes=int(sent.max()))
                if name.startswith("nvc"):
                    cm = comm if name == "nvc" else comms[chunks[methods.index(name) - len(METHODS)]]
                    r["chunk_bytes"] = env.nvc.ragged.chunk_bytes(
                        cm, n_out, row, 1, chunked=name != "nvc")
                    r["comm_nbytes"] = cm.nbytes
                if name.startswith("xla") and env.shared_gpu:
                    rows.append(dict(r, skipped="ranks share one GPU: no XLA collectives"))
                    continue

                def call(x, *k, fn=fns[name], n_out=n_out):
                    return fn(x, B._varying(jnp.zeros((n_out, hidden), jnp.bfloat16)), *k)

                def body(c, k, call=call):
                    return (B._row0(c[0], call(c[0], *k)),), ()
                try:
                    out = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=(P("x"),) * 5,
                                                out_specs=P("x")))(x, *offs)
                    first[name] = [np.asarray(b.data).view(np.uint16)  # this process's rows
                                   for b in out.addressable_shards]
                except Exception as e:  # noqa: BLE001 - the timing says what failed
                    r["agree_error"] = f"{type(e).__name__}: {str(e)[:120]}"
                def run(opts=None, dev=None, body=body, what=f"{op} {routing} {sizing} T={T} "
                        f"H={hidden} {name}"):
                    return B._measure(env, what, mesh, body, (x, *offs), (P("x"),) * 5, 1, a,
                                      compiler_options=opts, device_time=dev)
                r.update(run())
                rows.append(r)
                env.log(f"#   H={hidden} T={T} {routing} {sizing} {op} {name}: {B._cell(r)}")
                if name.startswith("xla") and xla_best.wanted(getattr(a, "xla_best", "off")):
                    b = xla_best.best(env, f"{name} best", lambda o, run=run: run(o, False),
                                      default=r, mode=a.xla_best)
                    rows.append(b)
                    if len(b["xla_variants"]) > 1:
                        env.log(f"#   H={hidden} T={T} {routing} {op} {name} best: "
                                f"{B._cell(b)} [{b['xla_flags']}; {b['xla_variants']}]")
            for r in rows:
                if r.get("op") == op and r["method"] in first and r["method"] != "xla" \
                        and "xla" in first:
                    r["agree"] = all(np.array_equal(u, v) for u, v in zip(
                        first[r["method"]], first["xla"]))
    finally:
        B._close(comm)
        for cm in comms.values():
            B._close(cm)
    return rows


def run_ragged(a):
    from .. import _dist
    if _dist.is_launched():  # one process per GPU: XLA's side goes through NCCL send/recv
        from ..models.moe_transformer import allow_ragged_nccl_fallback
        allow_ragged_nccl_fallback()
    env = B.Env()
    a.device_time_on = B._device_time_on(env, a)
    env.header("ragged", a)
    for line in xla_best.header_lines(env.platform, a.xla_best):
        env.log(f"# {line}")
    cpu = env.platform == "cpu"
    W = env.world
    small = a.quick or cpu
    hiddens = a.hidden or ([256] if small else [2048, 7168])
    tokens = a.tokens or ([8, 32] if small else [128, 512, 4096])
    sizings = a.sizing or SIZINGS
    K = a.top_k
    env.log(f"# ragged_all_to_all at MoE shapes: world {W}, top-{K}, bf16 rows, one slice per "
            f"peer; experts {', '.join(f'{EXPERTS.get(h, 4 * W)} (hidden {h})' for h in hiddens)}")
    mesh = env.mesh()
    rows = []
    for h in hiddens:
        E = EXPERTS.get(h, max(K, 4 * W))
        E = max(W, E - E % W)
        for sizing in sizings:
            for routing in a.routing or ROUTINGS:
                for T in tokens:
                    rows += _point(env, mesh, h, E, T, min(K, E), routing, a, sizing)
    keys = [("hidden", lambda r: str(r["hidden"])), ("sizing", lambda r: r.get("sizing", "*")),
            ("routing", lambda r: r["routing"]), ("tokens", lambda r: str(r["tokens"])),
            ("op", lambda r: r["op"])]
    columns = COLUMNS + sorted({r["method"] for r in rows if r["method"].startswith("nvc ")},
                               key=lambda m: next(r.get("chunk_bytes", 0) for r in rows
                                                  if r["method"] == m))
    ours = [m for m in columns if m.startswith("nvc")]
    xla = [m for m in COLUMNS if m.startswith("xla")]
    env.log(f"\n## ragged_all_to_all, world {W}: {B._units(a)}; speedup = best XLA / nvc "
            "(loop time); recv max/mean: the busiest rank's received rows over the mean")
    B._pivot(env, [r for r in rows if "skipped" not in r or r["op"] != "*"], keys, columns, [
        ("speedup", lambda g: B._ratio(g, min(xla, key=lambda m: g.get(m, {}).get(
            "median_us", 1e300)), ["nvc"])),
        ("out MiB", lambda g: next((f"{r['out_bytes'] / 2**20:.1f}" for r in g.values()
                                    if "out_bytes" in r), "-")),
        ("recv max/mean", lambda g: next(
            (f"{r['recv_rows_max'] / max(r['recv_rows_mean'], 1):.2f}" for r in g.values()),
            "-")),
        ("agree", lambda g: "/".join(
            {True: "yes", False: "NO"}.get(g[m].get("agree"), "-") for m in columns
            if m != "xla" and m in g and not m.endswith(" best"))),
        ("MB sent, busiest rank", lambda g: next(
            (f"{r['busiest_rank_bytes'] / 1e6:.1f}" for r in g.values()), "-"))])
    for r in rows:
        if "skipped" in r:
            env.log(f"# skipped: H={r['hidden']} T={r['tokens']} {r['routing']} {r['method']}: "
                    f"{r['skipped']}")
    env.log("# agree: each method's output of one call equals XLA's bit for bit (nvc, xla "
            "pieces, then the chunk sweep); sizing worst: MaxText's buffer, T*K x min(W, E/K) "
            "rows; nvc there and the chunk sweep on a Communicator of max_message_bytes="
            f"{a.budget or DEFAULT_BUDGET} (nbytes unchanged by any call)")
    env.log(xla_best.summary_line(rows, env.platform, a.xla_best))
    bad = [r for r in rows if r.get("agree") is False]
    for r in bad:
        env.log(f"# DISAGREE: H={r['hidden']} T={r['tokens']} {r['routing']} {r['op']} "
                f"{r['method']} differs from xla")
    if cpu:
        env.log("# CPU devices: the times mean nothing for GPUs (host backend, XLA's side an "
                "emulation)")
    B._write_json(env, a.out, "ragged.json", dict(
        meta=dict(platform=env.platform, topology=env.topology(), world=W,
                  processes=env.nprocs, device_kind=env.devices[0].device_kind,
                  unroll=a.unroll, steps=a.steps, reps=a.reps, top_k=K, dtype="bfloat16",
                  xla_best=xla_best.meta(rows, env.platform, a.xla_best)),
        rows=rows))
    series = {}
    for r in rows:
        if "median_us" in r:
            series.setdefault(f"H={r['hidden']} {r['routing']} {r['op']}", {}).setdefault(
                r["method"], []).append((r["tokens"], r["median_us"]))
    B._plot(env, a.out, "ragged.png", series, f"ragged_all_to_all world {W} ({env.platform})",
            "tokens per rank")
    return 1 if bad else 0


def add_arguments(s):
    """The flags of `bench ragged`."""
    B.add_loop_arguments(s, quick="small shapes: hidden 256, 8 and 32 tokens per rank (also "
                                  "the default on CPU devices)")
    s.add_argument("--hidden", type=int, nargs="*", metavar="H",
                   help="row widths (default: 2048 7168; 256 with --quick or on CPU)")
    s.add_argument("--tokens", type=int, nargs="*", metavar="T",
                   help="tokens per rank (default: 128 512 4096; 8 32 with --quick or on CPU)")
    s.add_argument("--top-k", type=int, default=8, metavar="K",
                   help="experts per token (default: 8)")
    s.add_argument("--routing", nargs="*", choices=ROUTINGS,
                   help="balanced (uniform) and/or skewed (Zipf popularity) routing (default: "
                        "both)")
    s.add_argument("--methods", nargs="*", choices=METHODS,
                   help="only these methods (default: all; the chunk sweep runs with nvc)")
    s.add_argument("--sizing", nargs="*", choices=SIZINGS,
                   help="dispatch output rows: busiest (the busiest rank's rows, rounded up to "
                        "128) and/or worst (MaxText's T*K x min(W, E/K)) (default: both)")
    s.add_argument("--budget", type=int, metavar="BYTES",
                   help="max_message_bytes of the Communicator of worst sizing and of the chunk "
                        f"sweep (default: {DEFAULT_BUDGET}, the Communicator's default)")
    s.add_argument("--chunks", type=int, nargs="*", metavar="BYTES",
                   help="ragged_chunk_bytes of the chunk sweep, multiples of 256 (default: 262144 "
                        "1048576 4194304; 1024 with --quick; none: no sweep)")
    B.add_xla_best_argument(s)
