"""`python -m jax_nvcomm.bench varlen`: variable-length gather and reduce-scatter (data-parallel
attention in front of a tensor-parallel layer) against the two classic XLA approaches.

Loads (tokens per rank, static capacity max_rows per rank; hidden 4096 bf16 by default):
  decode           every rank 10 tokens, capacity 16 (a decode-sized bucket)
  decode/cap4000   every rank 10 tokens, capacity 4000 (decode inside a prefill-sized buffer)
  unbalanced       rank 0 4000 tokens (prefill), the others 10, capacity 4000
  prefill          every rank 4000 tokens, capacity 4000
Methods, gather (every rank gets every rank's rows):
  nvc all_gather_v   each rank pushes exactly its rows to every peer (one kernel, counts
                     exchanged in it); zeroes the rows past the total (the default)
  nvc no zero_tail   the same with zero_tail=False (rows past the total left unspecified)
  xla padded         lax.all_gather of the [max_rows] padded buffer (the rows stay padded: the
                     cheapest form of that approach, no compaction)
  xla zero-filled    rows written at their offsets into a zero [W * max_rows] buffer, lax.psum
                     (the offsets given as an input: the host knows the counts)
reduce-scatter (each rank gets the sum of the partial results of its own rows):
  nvc reduce_scatter_v   each rank pushes segment r of its partials to rank r, owner sums
  xla padded             lax.psum_scatter of the partials in the padded [W, max_rows] layout
  xla psum+slice         lax.psum of the whole [W * max_rows] buffer, then this rank's rows
Times: us per call, median (p10-p90) over programs of many chained calls (the loop
programs of `python -m jax_nvcomm.bench --help`: host dispatch amortised), and with --device-time (on for GPUs by default) "dN", the
kernels' device time per call from a profiler trace (device 0). Bytes: what the busiest rank
sends per call (ring all-reduce: 2 (W-1)/W of the buffer), and the total over ranks.
Writes OUT/varlen.json, the tables on stdout and OUT/varlen.png.
"""
from __future__ import annotations

import os

from . import common as B

GATHER = ["nvc all_gather_v", "nvc no zero_tail", "xla padded", "xla zero-filled"]
SCATTER = ["nvc reduce_scatter_v", "xla padded", "xla psum+slice"]


def loads(W, quick, cpu):
    big, small = (400, 1) if (quick or cpu) else (4000, 10)
    dec_cap = 4 if (quick or cpu) else 16
    unb = [big] + [small] * (W - 1)
    return [("decode", [small] * W, dec_cap), (f"decode/cap{big}", [small] * W, big),
            ("unbalanced", unb, big), ("prefill", [big] * W, big)]


def bytes_moved(op, method, counts, max_rows, row):
    """(busiest rank's bytes sent, total bytes sent over all ranks) per call."""
    W, total = len(counts), sum(counts)
    if W == 1:
        return 0, 0
    ring = 2 * (W - 1) * max_rows * row  # all-reduce of W * max_rows rows: 2 (W-1)/W each
    if op == "gather":
        if method.startswith("nvc"):
            per = [c * row * (W - 1) for c in counts]
        elif method == "xla padded":
            per = [max_rows * row * (W - 1)] * W
        else:
            per = [ring] * W
    else:
        if method.startswith("nvc"):
            per = [(total - c) * row for c in counts]
        elif method == "xla padded":
            per = [max_rows * row * (W - 1)] * W
        else:
            per = [ring] * W
    return max(per), sum(per)


def _methods(env, comm, op, W, max_rows):
    import jax.numpy as jnp
    from jax import lax
    axis = "x"
    nvc = env.nvc

    if op == "gather":
        def ours(x, n, off):
            return nvc.all_gather_v(x, n, comm)[0]

        def ours_nz(x, n, off):
            return nvc.all_gather_v(x, n, comm, zero_tail=False)[0]

        def padded(x, n, off):
            return lax.all_gather(x, axis, tiled=True)

        def zero_filled(x, n, off):
            me = lax.axis_index(axis)
            keep = (jnp.arange(max_rows) < n)[:, None]
            buf = jnp.zeros((W * max_rows,) + x.shape[1:], x.dtype)
            buf = lax.dynamic_update_slice_in_dim(buf, jnp.where(keep, x, 0), off[me], axis=0)
            return lax.psum(buf, axis)
        return {"nvc all_gather_v": ours, "nvc no zero_tail": ours_nz, "xla padded": padded,
                "xla zero-filled": zero_filled}

    def rs_ours(y, n, off):
        return nvc.reduce_scatter_v(y, off, comm)

    def rs_padded(y, n, off):  # y already in the padded layout [W * max_rows]
        return lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)

    def rs_psum(y, n, off):
        s = lax.psum(y, axis)
        return lax.dynamic_slice_in_dim(s, off[lax.axis_index(axis)], max_rows, axis=0)
    return {"nvc reduce_scatter_v": rs_ours, "xla padded": rs_padded, "xla psum+slice": rs_psum}


def _point(env, comm, mesh, load, counts, max_rows, hidden, a):
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P
    W = env.world
    row = hidden * 2
    rng = np.random.default_rng(0)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    n_host = np.asarray(counts, np.int32)
    rows = []
    for op in ("gather", "scatter"):
        lead = max_rows if op == "gather" else W * max_rows
        host = rng.standard_normal((W * lead, hidden)).astype(np.float32)
        x = B._put(env, mesh, np.asarray(jnp.asarray(host, jnp.bfloat16)), P("x"))
        n_arr = B._put(env, mesh, n_host, P("x"))
        off_arr = B._put(env, mesh, np.tile(off, W), P("x"))
        for name, fn in _methods(env, comm, op, W, max_rows).items():
            base = dict(op=op, load=load, counts=[int(c) for c in counts], max_rows=max_rows,
                        hidden=hidden, world=W, method=name)
            sent, total = bytes_moved(op, name, counts, max_rows, row)
            base.update(busiest_rank_bytes=int(sent), total_bytes=int(total))
            if name.startswith("nvc") and comm is None:
                rows.append(dict(base, skipped="no communicator"))
                continue
            if name.startswith("xla") and env.shared_gpu:
                rows.append(dict(base, skipped="ranks share one GPU: no XLA collectives"))
                continue
            if name.startswith("nvc"):
                from ..varlen import fits
                if not fits(comm, max_rows, row):
                    base["note"] = "above max_message_bytes: ran the XLA path"

            def body(c, k, fn=fn):
                out = fn(c[0], k[0][0], k[1])
                return (B._row0(c[0], out),), ()

            r = dict(base)
            r.update(B._measure(env, f"{op} {load} {name}", mesh, body, (x, n_arr, off_arr),
                                (P("x"), P("x"), P("x")), 1, a))
            rows.append(r)
            env.log(f"#   {op} {load} {name}: {B._cell(r)}  busiest rank sends "
                    f"{B._human(sent) if sent else 0}")
    return rows


def _plot(env, out, rows):
    if not env.is_main:
        return None
    plt = B.pyplot(env.log)
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, (op, methods) in zip(axes, (("gather", GATHER), ("scatter", SCATTER))):
        sel = [r for r in rows if r["op"] == op]
        lds = list(dict.fromkeys(r["load"] for r in sel))
        wdt = 0.8 / len(methods)
        for i, m in enumerate(methods):
            ys = [next((r.get("median_us", 0) for r in sel if r["load"] == ld and
                        r["method"] == m), 0) for ld in lds]
            ax.bar([j + i * wdt for j in range(len(lds))], ys, wdt, label=m)
        ax.set_xticks([j + 0.4 - wdt / 2 for j in range(len(lds))], lds, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("us per call (median)")
        ax.set_title(f"{'all_gather_v' if op == 'gather' else 'reduce_scatter_v'}, world "
                     f"{env.world} ({env.platform})", fontsize=9)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "varlen.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    env.log(f"# wrote {path}")
    return path


def run_varlen(a):
    env = B.Env()
    a.device_time_on = B._device_time_on(env, a)  # before the header, which reports it
    env.header("varlen", a)
    cpu = env.platform == "cpu"
    hidden = a.varlen_hidden or (256 if (a.quick or cpu) else 4096)
    W = env.world
    cases = loads(W, a.quick, cpu)
    cap = max(m for _, _, m in cases)
    max_bytes = max(4 << 20, W * cap * hidden * 2 + (1 << 20))
    mesh = env.mesh()
    comm = B._open_comm(env, mesh, max_bytes)
    rows = []
    try:
        for load, counts, max_rows in cases:
            rows += _point(env, comm, mesh, load, counts, max_rows, hidden, a)
    finally:
        B._close(comm)
    keys = [("load", lambda r: r["load"]),
            ("tokens/rank", lambda r: "/".join(str(c) for c in r["counts"][:2]) +
             ("/..." if len(r["counts"]) > 2 else "")),
            ("cap", lambda r: str(r["max_rows"]))]
    for op, methods, label in (("gather", GATHER, "all_gather_v"),
                               ("scatter", SCATTER, "reduce_scatter_v")):
        sel = [r for r in rows if r["op"] == op]
        env.log(f"\n## {label}, bf16 hidden {hidden}, world {W}: {B._units(a)}; "
                f"speedup = best XLA / {methods[0]} (loop time)")
        B._pivot(env, sel, keys, methods, [
            ("speedup", lambda g, m=methods: B._ratio(g, min(
                [k for k in m if k.startswith("xla")],
                key=lambda k: g.get(k, {}).get("median_us", 1e300)), m[:1])),
            ("MB sent by busiest rank (nvc/padded/other)", lambda g, m=methods: "/".join(
                f"{g[k]['busiest_rank_bytes'] / 1e6:.2f}" if k in g else "-"
                for k in m if not k.startswith("nvc no")))])
    if cpu:
        env.log("# CPU devices: the times mean nothing for GPUs (host backend on shared cores)")
    B._write_json(env, a.out, "varlen.json", dict(
        meta=dict(platform=env.platform, topology=env.topology(), world=W,
                  processes=env.nprocs, device_kind=env.devices[0].device_kind,
                  unroll=a.unroll, steps=a.steps, reps=a.reps, hidden=hidden, dtype="bfloat16",
                  max_message_bytes=max_bytes), rows=rows))
    _plot(env, a.out, rows)
    return 0


def add_arguments(s):
    """The flags of `bench varlen`."""
    B.add_loop_arguments(s, quick="CPU-sized loads (400 / 1 tokens, decode capacity 4, row "
                                  "width 256) instead of 4000 / 10 tokens at width 4096")
    s.add_argument("--varlen-hidden", type=int, default=None, metavar="H",
                   help="row width in bf16 elements (default: 4096 on GPUs, 256 on CPU or "
                        "with --quick)")
