"""The layer rows of `python -m jax_nvcomm.bench moelayer`: the whole routed-expert layer
(nvc.moe_layer) against the same layer composed from the public ops and against XLA's.

Shapes (defaults; world = the job's devices, meant for world 1 on one GPU): hidden 7168,
ffn 2048, 32 and 256 local experts per rank, top-8, 8 / 32 / 128 tokens per rank, bf16,
random routing (top_k distinct experts per token, uniform). Methods:
  layer     nvc.moe_layer (its docstring says what it runs: composed on packed rows today)
  layer two-dot  the same with gate and up as two nvc.ragged_dot instead of one fused
            gate/up/SwiGLU pass: which of the two the layer should use
  composed  nvc.moe_dispatch + three ragged_dot on the padded dispatch layout (rows gathered
            into ragged_dot's form and back) + nvc.moe_combine; the
            ragged_dot is nvc.ragged_dot where the package has it, else lax.ragged_dot (the
            row's `dot` says which)
  xla       sort by expert + lax.ragged_all_to_all + three lax.ragged_dot + the way back + unsort
            (the example EP layer of jax_nvcomm.models.moe_ragged with XLA's collectives)
Weights: `bench moelayer --weights` (bf16; int8 with per-channel scales; fp8 with 128 x 128
block scales); with 8-bit weights the layer and composed rows pass the scales, and xla
dequantises the weights to bf16 inside the jit (XLA's path on the same weights).
Every row has the weight-read bound: bytes of the three matrices (and their scales) of every
expert that gets at least one token (over all ranks, per rank when world > 1: the busiest rank)
/ the GPU's peak memory bandwidth (`--hbm-bytes-per-s`, default the device's: bench moelayer's
docstring), and the ratio time / bound (device time where there is one, else loop time).
At the smallest token count of each expert count, one call of each method on the same inputs
is compared with the layer's output (rel_diff_to_layer; they round differently, so ~1e-2 in
bf16 is agreement).
Timing: the loop programs of the other loop benchmarks: 1 + unroll x steps calls per
program, each call's x with one row of the previous call's output; default unroll 1, steps 3,
reps 3 (a call takes milliseconds: the per-call host cost does not matter here).
"""
from __future__ import annotations

from . import common as B

METHODS = ["layer", "layer two-dot", "composed", "xla"]


def add_layer_arguments(s):
    """The layer rows' own flags (`bench moelayer` adds them to its subcommand; the shapes
    come from its --hidden / --ffn / --experts / --tokens / --top-k / --quick, `layer_shapes`)."""
    s.add_argument("--layer-rows", choices=("on", "off"), default="on",
                   help="also time the whole MoE layer (--layer-methods) after the ragged_dot "
                        "rows (default on)")
    s.add_argument("--layer-methods", nargs="+", default=METHODS, choices=METHODS,
                   help="methods of the layer rows (default all): layer = nvc.moe_layer; "
                        "'layer two-dot' = the same with gate and up as two ragged_dot; "
                        "composed = moe_dispatch + three ragged_dot + moe_combine; xla = "
                        "XLA's collectives with lax.ragged_dot")
    s.add_argument("--layer-unroll", type=int, default=1, metavar="N",
                   help="calls unrolled per loop step in the layer programs (default 1)")
    s.add_argument("--layer-steps", type=int, default=3, metavar="N",
                   help="loop steps per layer program (default 3)")
    s.add_argument("--layer-reps", type=int, default=3, metavar="N",
                   help="timed runs of each layer program (default 3)")


def layer_shapes(a, gpu):
    """(hidden, ffn, experts list, tokens list, top_k) of the layer rows from the subcommand's
    flags; unset ones: the decode shapes on GPUs (7168, 2048, [32, 256], [8, 32, 128];
    --quick: [32], [8, 128]), small ones on CPU devices, --quick or not (256, 128, [8], [8]:
    a layer of 32 experts x 128 tokens takes seconds a call there)."""
    hidden = a.hidden or (7168 if gpu else 256)
    ffn = a.ffn or (2048 if gpu else 128)
    experts = a.experts or (([32] if a.quick else [32, 256]) if gpu else [8])
    tokens = a.tokens or (([8, 128] if a.quick else [8, 32, 128]) if gpu else [8])
    return hidden, ffn, experts, tokens, a.top_k


def weight_bound_us(ids_all, L, H, F, itemsize, world, bytes_per_s, scale_bytes=0):
    """Weight-read bound of one call in us: the busiest rank's experts that get a token, each
    reading its three [H, F] matrices of `itemsize` bytes an element and `scale_bytes` of
    scales, at `bytes_per_s`. Returns (us, experts counted)."""
    import numpy as np
    E = L * world
    used = np.zeros(E, bool)
    used[np.asarray(ids_all).reshape(-1)] = True
    per_rank = used.reshape(world, L).sum(1)
    nbytes = int(per_rank.max()) * (3 * H * F * itemsize + scale_bytes)
    return nbytes / bytes_per_s * 1e6, int(per_rank.max())


def _dot_name(nvc):
    return "nvc.ragged_dot" if hasattr(nvc, "ragged_dot") else "lax.ragged_dot"


def _bodies(env, moe, L, K, dtype):
    """{method: body(carry, consts) -> (carry, keep)} for B._measure; carry (x,), consts
    (ids, w, wg, wu, wd), all per rank; each weight a (weights, scale or None) pair."""
    import importlib

    import jax.numpy as jnp
    from jax import lax

    from .. import moe_experts
    from ..models import moe_ragged as mr
    rd = importlib.import_module("jax_nvcomm.ragged_dot")
    nvc = env.nvc
    dot = getattr(nvc, "ragged_dot", None)

    def layer(c, k):
        (x,), (ids, w, wg, wu, wd) = c, k
        y = nvc.moe_layer(x, ids, w, wg[0], wu[0], wd[0], moe, w_gate_scale=wg[1],
                          w_up_scale=wu[1], w_down_scale=wd[1])
        return (B._row0(x, y),), (y,)

    def composed(c, k):
        (x,), (ids, w, wg, wu, wd) = c, k
        d = nvc.moe_dispatch(x, ids, moe)
        rows = moe.world_size * moe.max_tokens * min(K, L)  # a token reaches <= min(K, L)
        if dot is None:
            ey = moe_experts.expert_block(d.expert_x, d.expert_counts, wg[0], wu[0], wd[0],
                                          x.dtype, rows, (wg[1], wu[1], wd[1]))
        else:
            ey = _expert_block_with(dot, d.expert_x, d.expert_counts, wg, wu, wd, x.dtype,
                                    rows)
        y = nvc.moe_combine(ey, w, d.handle, moe)
        return (B._row0(x, y),), (y,)

    coll = mr.collectives("lax", axis_name="x")

    def plain(x, pair):  # XLA's path on 8-bit weights: dequantised in the jit
        q, s = pair
        if s is None:
            return q if q.dtype == x.dtype else q.astype(x.dtype)
        return rd.dequantize(q, s, 1 if s.ndim == 2 else 2, x.dtype)

    def xla(c, k):
        (x,), (ids, w, wg, wu, wd) = c, k
        y = mr.moe_experts(x, w, ids, plain(x, wg), plain(x, wu), plain(x, wd),
                           axis_name="x", coll=coll)
        return (B._row0(x, y),), (y,)

    del lax, jnp
    def layer_two(c, k):
        from .. import moe_experts as me
        old, me.GATE_UP = me.GATE_UP, "two"  # read while this body is traced
        try:
            return layer(c, k)
        finally:
            me.GATE_UP = old

    return {"layer": layer, "layer two-dot": layer_two, "composed": composed, "xla": xla}


def _expert_block_with(dot, expert_x, counts, wg, wu, wd, out_dtype, max_rows):
    """moe_experts.expert_block's gathers (into max_rows packed rows) around a given
    ragged_dot (nvc.ragged_dot), gate, up and down as three calls; each weight a (weights,
    scale or None) pair."""
    import jax
    import jax.numpy as jnp
    L, R, H = expert_x.shape
    ends = jnp.cumsum(counts)
    starts = ends - counts
    M = min(int(max_rows), L * R)
    p = jnp.arange(M, dtype=jnp.int32)
    e = jnp.minimum(jnp.searchsorted(ends, p, side="right").astype(jnp.int32), L - 1)
    valid = p < ends[-1]
    xs = expert_x.reshape(L * R, H)[jnp.where(valid, e * R + (p - starts[e]), 0)]
    xs = jnp.where(valid[:, None], xs, jnp.zeros((), xs.dtype))
    def d(a, pair):
        kw = {} if pair[1] is None else {"rhs_scale": pair[1]}
        return dot(a, pair[0], counts, preferred_element_type=jnp.float32, **kw)
    h = (jax.nn.silu(d(xs, wg)) * d(xs, wu)).astype(xs.dtype)
    ys = d(h, wd).astype(out_dtype)
    return ys[jnp.clip(starts[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :], 0, M - 1)]


def run_layer_rows(env, a):
    """Measure every (experts, tokens, method) of the flags (`layer_shapes`); returns the
    rows (dicts with experts, tokens, method, the timing keys of B._measure, bound_us,
    active_experts, ratio, rel_diff_to_layer at the smallest token count)."""
    import argparse

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from .moelayer import quantise, scale_bytes
    H, F, experts, tokens, K = layer_shapes(a, env.platform == "gpu")
    W = env.world
    kind = getattr(a, "weights", "bf16")
    bw, _ = B.hbm_bytes_per_s(env, getattr(a, "hbm_bytes_per_s", None))
    la = argparse.Namespace(**vars(a))
    la.reps, la.unroll, la.steps = a.layer_reps, a.layer_unroll, a.layer_steps
    la.device_time_on = B._device_time_on(env, a)
    dtype = jnp.dtype(jnp.bfloat16)
    mesh = env.mesh()
    spec = P("x")
    rows = []
    rng = np.random.default_rng(0)
    for L in experts:
        E = L * W
        if K > E:
            env.log(f"# layer rows: top-{K} > {E} experts: L={L} skipped")
            continue
        # the weights on the devices, sharded over the expert axis (made there: 22 GB at
        # 256 experts would not pass through the host quickly)
        shard = jax.sharding.NamedSharding(mesh, spec)

        def make(k, shape, fan):  # one expert at a time (vmap): no counter past 2^32 elements
            one = lambda kk: (jax.random.normal(kk, shape, jnp.float32)  # noqa: E731
                              / np.sqrt(fan)).astype(dtype)
            return quantise(jax.vmap(one)(jax.random.split(k, E)), kind)

        try:  # one matrix per program: the float32 temporaries of one at a time
            keys = jax.random.split(jax.random.key(L), 3)
            wg, wu, wd = (jax.jit(make, static_argnums=(1, 2), out_shardings=shard)(kk, sh, fan)
                          for kk, sh, fan in ((keys[0], (H, F), H), (keys[1], (H, F), H),
                                              (keys[2], (F, H), F)))
        except Exception as e:  # noqa: BLE001 - too large for this device
            env.log(f"# layer rows: weights for L={L} failed ({type(e).__name__}: "
                    f"{str(e)[:160]}): skipped")
            continue
        for T in tokens:
            ids = np.stack([rng.choice(E, K, replace=False) for _ in range(W * T)]
                           ).astype(np.int32)
            w = rng.random((W * T, K)).astype(np.float32)
            w /= w.sum(1, keepdims=True)
            x = rng.standard_normal((W * T, H)).astype(np.float32)
            bound, active = weight_bound_us(
                ids.reshape(W, T, K), L, H, F, 2 if kind == "bf16" else 1, W, bw,
                2 * scale_bytes(kind, H, F) + scale_bytes(kind, F, H))
            args = (B._put(env, mesh, jnp.asarray(x, dtype), spec),
                    B._put(env, mesh, ids, spec), B._put(env, mesh, w, spec), wg, wu, wd)
            moe = None
            try:
                moe = env.nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T,
                                              hidden=H, dtype=dtype)
            except Exception as e:  # noqa: BLE001
                env.log(f"# layer rows: MoECommunicator failed ({type(e).__name__}: "
                        f"{str(e)[:160]}): layer / composed skipped")
            bodies = _bodies(env, moe, L, K, dtype)
            for m in a.layer_methods:
                if m != "xla" and moe is None:
                    continue
                if m == "xla" and env.shared_gpu:
                    continue  # NCCL refuses ranks sharing a GPU
                name = f"layer L={L} T={T} {m}"
                r = B._measure(env, name, mesh, bodies[m], args, (spec,) * 6, 1, la)
                t = r.get("device_us") or r.get("median_us")
                r.update(experts=L, tokens=T, method=m, bound_us=round(bound, 3), weights=kind,
                         hbm_bytes_per_s=bw,
                         active_experts=active, world=W, hidden=H, ffn=F, top_k=K,
                         dot=_dot_name(env.nvc) if m == "composed" else None,
                         ratio=round(t / bound, 2) if t else None)
                rows.append(r)
                env.log(f"#   {name}: {B._cell(r)} us, bound {bound:.1f} us "
                        f"({active} experts), x{r['ratio']}" if t else f"#   {name}: -")
            if T == min(tokens):
                _agreement(env, mesh, bodies, args, spec, L, T, a.layer_methods,
                           moe is not None, rows)
            if moe is not None:
                moe.close()
        del wg, wu, wd
    return rows


def _agreement(env, mesh, bodies, args, spec, L, T, methods, have_moe, rows):
    """One call of each method on the same inputs: the relative difference of each to the
    layer's output (the methods round differently: xla rounds gate and up to bf16 before
    SwiGLU), recorded in that shape's rows as rel_diff_to_layer."""
    import jax
    import numpy as np
    outs = {}
    for m in methods:
        if (m != "xla" and not have_moe) or (m == "xla" and env.shared_gpu):
            continue
        try:
            f = jax.jit(jax.shard_map(lambda *v, m=m: bodies[m](v[:1], v[1:])[1][0],
                                      mesh=mesh, in_specs=(spec,) * 6, out_specs=spec))
            outs[m] = np.asarray(f(*args).astype(np.float32), np.float64)
        except Exception as e:  # noqa: BLE001 - the timings stand without it
            env.log(f"#   agreement {m}: FAILED ({type(e).__name__}: {str(e)[:160]})")
    if "layer" not in outs:
        return
    ref = outs["layer"]
    for m, o in outs.items():
        d = float(np.linalg.norm(o - ref) / max(np.linalg.norm(ref), 1e-30))
        env.log(f"#   L={L} T={T}: {m} vs layer: relative difference {d:.2e}")
        for r in rows:
            if r["experts"] == L and r["tokens"] == T and r["method"] == m:
                r["rel_diff_to_layer"] = d


def layer_table(env, rows, bw_text=""):
    """The layer rows as one table: per (experts, tokens) each method's time and its ratio to
    the bound."""
    def ratio(g, m):
        r = g.get(m, {})
        return f"x{r['ratio']:.2f}" if r.get("ratio") else "-"

    bw = rows[0]["hbm_bytes_per_s"] if rows else 0
    kind = rows[0].get("weights", "bf16") if rows else "bf16"
    env.log(f"# layer rows ({kind} weights): us per call; bound = weight (+ scale) reads of "
            f"the experts that get tokens at {bw / 1e12:.2f} TB/s ({bw_text}); xN = (device "
            "time, else loop time) / bound")
    B._pivot(env, rows, [("experts", lambda r: str(r["experts"])),
                         ("tokens", lambda r: str(r["tokens"])),
                         ("bound us", lambda r: f"{r['bound_us']:.1f}")],
             METHODS, extra=[(f"{m}/bound", lambda g, m=m: ratio(g, m)) for m in METHODS])


def run_layer(a, env=None):
    """The layer rows (header when alone, rows, table, OUT/moelayer_layer.json); `bench
    moelayer` calls it after its own rows with its Env."""
    import argparse
    alone = env is None
    env = env or B.Env()
    if a.layer_rows == "off":
        return []
    if alone:
        shown = argparse.Namespace(**vars(a))
        shown.reps, shown.unroll, shown.steps = a.layer_reps, a.layer_unroll, a.layer_steps
        shown.device_time_on = B._device_time_on(env, a)
        env.header("moelayer (layer rows)", shown)
    rows = run_layer_rows(env, a)
    layer_table(env, rows, B.hbm_bytes_per_s(env, getattr(a, "hbm_bytes_per_s", None))[1])
    B._write_json(env, a.out, "moelayer_layer.json", dict(rows=rows, topology=env.topology()))
    return rows


def main(argv=None):
    """`python -m jax_nvcomm.bench.moelayer_layer [flags]`: the layer rows alone, with the
    shape flags of `bench moelayer`."""
    import argparse
    B._setup_env()
    p = argparse.ArgumentParser(prog="python -m jax_nvcomm.bench.moelayer_layer",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_out", metavar="DIR")
    p.add_argument("--quick", action="store_true", help="32 experts, 8 and 128 tokens")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--experts", type=int, nargs="+", default=None)
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--device-time", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--weights", choices=("bf16", "int8", "fp8"), default="bf16")
    p.add_argument("--hbm-bytes-per-s", type=float, default=None)
    add_layer_arguments(p)
    return run_layer(p.parse_args(argv))


if __name__ == "__main__":
    main()
