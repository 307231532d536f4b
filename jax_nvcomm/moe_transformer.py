"""A small MoE decoder stack run with jax_nvcomm and with XLA's collectives, side by side.

`python -m jax_nvcomm.demo [flags]` (or `python examples/moe_transformer.py [flags]`) builds a few
decoder layers shaped like today's MoE LLMs, with seeded random weights, and runs one decode step
and one prefill step in each of two layouts, once with jax_nvcomm's collectives and once with
XLA's only, then checks that both give the same final hidden states and prints the timings.

Model (per layer, pre-norm, residual stream in the working dtype):
    h = RMSNorm(x)                       (fused into the previous layer's last collective)
    x = x + Attention(h)                 causal softmax attention, RoPE, q/k/v/o projections
    h = RMSNorm(x)
    x = x + MoE(h)                       softmax router, top-k (weights renormalised), SwiGLU experts
    ...  final RMSNorm -> the "final hidden states" that are compared.
Attention, simplified (no KV cache management):
  - prefill: each sequence's tokens attend causally to each other (one sequence of `--tokens`
    tokens);
  - decode: every token is the next token of its own sequence (batch = `--decode-tokens`); it
    attends to a fixed, seeded random K/V context of `--context` positions plus itself.

Layouts (a 1-D mesh over the devices; W ranks):
  low-latency (tensor parallel, axis "tp"): every rank holds the same tokens. q/k/v are
    column-parallel (each rank a slice of the heads), o is row-parallel; every expert's SwiGLU is
    split over the ranks (gate/up column-parallel, down row-parallel; tokens grouped by expert
    with `lax.ragged_dot`). Each attention and each MoE ends with partial sums that are reduced
    together with the residual add and the next sub-layer's RMSNorm:
        jax_nvcomm: nvc.all_reduce_rms_norm(partial, residual, norm_weight, comm)
        XLA:        lax.psum(partial) + residual, then the same RMSNorm in XLA
  high-throughput (data-parallel attention + expert parallel MoE, axis "ep"): every rank its
    own tokens and a full copy of the attention weights; rank r owns experts
    [r*E/W, (r+1)*E/W). Tokens go to their experts' ranks and back:
        jax_nvcomm: nvc.moe_dispatch / nvc.moe_combine (MoECommunicator)
        XLA:        jax_nvcomm.reference.moe_dispatch_xla / moe_combine_xla (impl="ragged",
                    lax.ragged_all_to_all)
    and the local experts run over the dispatched rows [E/W, W*tokens, hidden] with a batched
    einsum, rows past each expert's count masked to zero.

Agreement: relative L2 error ||a - b|| / ||b|| of the final hidden states, below 1e-4 in
float32 and 2e-2 in bfloat16/float16 (see TOLERANCE). In low precision the two all-reduces may
round differently, which can flip a near-tied top-k choice for a token; the bound allows for it.

Timing: each step is jitted (the whole stack in one program), compiled, run `--warmup` times,
then `--iters` times with a host sync after each call; the median wall time is reported. On GPUs
this includes ~60 us of host dispatch per call.

Multi-process: works under `python -m jax_nvcomm.launch -n N [--share-gpu] -m jax_nvcomm.demo
--nvcomm-only --ref FILE.npz ...` (the mesh spans jax.devices() of every process; inputs are
built with jax.make_array_from_callback, weights with jax.random inside a jit whose
out_shardings place each shard where it lives; results are gathered to process 0 through the
distributed key-value store, never through XLA collectives, so `--nvcomm-only` needs no NCCL).
NCCL refuses several ranks on one GPU, so with --share-gpu the XLA side cannot run: compare
against a stored reference made by a run that can (`--save-ref FILE.npz`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

EPS = 1e-6
ROPE_THETA = 10000.0
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
LAYOUTS = ("low-latency", "high-throughput")
PHASES = ("decode", "prefill")
IMPLS = ("jax_nvcomm", "xla")


class Unavailable(RuntimeError):
    """A part of the package that a requested layout needs is not available."""


class ConfigError(ValueError):
    """Sizes or flags that cannot work together."""


# --------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass
class Config:
    """Sizes and switches. None means "platform default" (see `resolve`)."""
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    experts: int | None = None
    top_k: int | None = None
    ffn: int | None = None          # intermediate size of one expert
    tokens: int | None = None       # prefill tokens per rank
    decode_tokens: int | None = None
    context: int | None = None      # decode: fixed K/V context length
    devices: int | None = None      # use the first N devices
    dtype: str | None = None
    iters: int | None = None
    warmup: int = 2
    seed: int = 0
    layouts: tuple = LAYOUTS
    phases: tuple = PHASES
    impls: tuple = IMPLS
    ref: str | None = None          # compare against this stored reference
    save_ref: str | None = None     # store final hidden states here
    plot: str | None = None
    quiet: bool = False             # no progress lines

    def model_dict(self):
        keys = ("layers", "hidden", "heads", "experts", "top_k", "ffn", "tokens",
                "decode_tokens", "context", "seed")
        return {k: getattr(self, k) for k in keys}


GPU_DEFAULTS = dict(layers=4, hidden=2048, heads=16, experts=128, top_k=8, ffn=768, tokens=256,
                    decode_tokens=4, context=256, dtype="bfloat16", iters=20)
CPU_DEFAULTS = dict(layers=2, hidden=128, heads=None, experts=16, top_k=4, ffn=64, tokens=64,
                    decode_tokens=4, context=32, dtype="float32", iters=5)


def resolve(cfg: Config, platform: str, world: int) -> Config:
    """Fill platform defaults and check the sizes against the world size."""
    d = CPU_DEFAULTS if platform == "cpu" else GPU_DEFAULTS
    vals = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for k, v in d.items():
        if vals.get(k) is None:
            vals[k] = v
    if vals["heads"] is None:  # head_dim up to 128, heads a multiple of the world size
        h = max(world, vals["hidden"] // 128)
        vals["heads"] = -(-h // world) * world
    c = Config(**vals)
    errs = []
    if c.hidden % c.heads:
        errs.append(f"--hidden {c.hidden} must be a multiple of --heads {c.heads}")
    elif (c.hidden // c.heads) % 2:
        errs.append(f"head_dim {c.hidden // c.heads} must be even (RoPE)")
    if "low-latency" in c.layouts:
        if c.heads % world:
            errs.append(f"--heads {c.heads} must be a multiple of the {world} ranks (TP)")
        if c.ffn % world:
            errs.append(f"--ffn {c.ffn} must be a multiple of the {world} ranks (TP experts)")
    if "high-throughput" in c.layouts and c.experts % world:
        errs.append(f"--experts {c.experts} must be a multiple of the {world} ranks (EP)")
    if not 1 <= c.top_k <= c.experts:
        errs.append(f"--top-k {c.top_k} must be in [1, --experts {c.experts}]")
    vec = {"float32": 4, "bfloat16": 8, "float16": 8}.get(c.dtype)
    if vec is None:
        errs.append(f"--dtype must be float32, bfloat16 or float16, got {c.dtype}")
    elif c.hidden % vec:
        errs.append(f"--hidden {c.hidden} must be a multiple of {vec} for {c.dtype}")
    for k in ("layers", "tokens", "decode_tokens", "context", "iters"):
        if getattr(c, k) < 1:
            errs.append(f"--{k.replace('_', '-')} must be >= 1")
    if errs:
        raise ConfigError("; ".join(errs))
    return c


# --------------------------------------------------------------------------------------------
# the model (runs inside shard_map on one rank's shard)

def _jnp():
    import jax.numpy as jnp
    return jnp


def rms_norm(r32, w, eps=EPS):
    """RMSNorm of a float32 array (the math of nvc.all_reduce_rms_norm's epilogue)."""
    from jax import lax
    jnp = _jnp()
    return r32 * lax.rsqrt(jnp.mean(r32 * r32, axis=-1, keepdims=True) + eps) * \
        w.astype(jnp.float32)


def add_rms_norm(x, residual, w, eps=EPS):
    """Local residual add + RMSNorm, same contract as nvc.all_reduce_rms_norm without the sum."""
    jnp = _jnp()
    r = x.astype(jnp.float32) + residual.astype(jnp.float32)
    return rms_norm(r, w, eps).astype(x.dtype), r.astype(residual.dtype)


def psum_rms_norm(x, residual, w, axis, eps=EPS):
    """XLA side of the low-latency layout: lax.psum, then the residual add and RMSNorm."""
    from jax import lax
    jnp = _jnp()
    r = lax.psum(x, axis).astype(jnp.float32) + residual.astype(jnp.float32)
    return rms_norm(r, w, eps).astype(x.dtype), r.astype(residual.dtype)


def rope(x, pos):
    """Rotary embedding; x: [S, heads, head_dim], pos: [S]."""
    jnp = _jnp()
    half = x.shape[-1] // 2
    freq = 1.0 / (ROPE_THETA ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = pos.astype(jnp.float32)[:, None, None] * freq          # [S, 1, half]
    c, s = jnp.cos(ang), jnp.sin(ang)
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def attention(h, p, cache, head_dim, phase):
    """Attention over the heads whose projections this rank holds; returns h @ ... @ wo
    (partial sums over ranks in the TP layout, the full output in the DP layout)."""
    import jax
    jnp = _jnp()
    f32 = jnp.float32
    t = h.shape[0]
    nh = p["wq"].shape[1] // head_dim
    q = (h @ p["wq"]).reshape(t, nh, head_dim)
    k = (h @ p["wk"]).reshape(t, nh, head_dim)
    v = (h @ p["wv"]).reshape(t, nh, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    if phase == "prefill":  # one sequence of t tokens, causal
        pos = jnp.arange(t)
        q, k = rope(q, pos), rope(k, pos)
        s = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=f32) * scale
        causal = jnp.tril(jnp.ones((t, t), bool))
        s = jnp.where(causal[None], s, -jnp.inf)
        pr = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        o = jnp.einsum("hqk,khd->qhd", pr, v)
    else:  # t sequences, one new token each at position `context`, after a fixed context
        ck, cv = cache                                              # [t, C, nh, hd]
        pos = jnp.full((t,), ck.shape[1])
        q, k = rope(q, pos), rope(k, pos)
        keys = jnp.concatenate([ck, k[:, None]], axis=1)            # [t, C+1, nh, hd]
        vals = jnp.concatenate([cv, v[:, None]], axis=1)
        s = jnp.einsum("bhd,bshd->bhs", q, keys, preferred_element_type=f32) * scale
        pr = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        o = jnp.einsum("bhs,bshd->bhd", pr, vals)
    return o.reshape(t, nh * head_dim) @ p["wo"]


def route(h, w_router, top_k):
    """Softmax router, top-k, weights renormalised: (float32 [t, k], int32 [t, k])."""
    import jax
    from jax import lax
    jnp = _jnp()
    logits = jnp.dot(h.astype(jnp.float32), w_router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    w, ids = lax.top_k(probs, top_k)
    return w / jnp.sum(w, axis=-1, keepdims=True), ids.astype(jnp.int32)


def swiglu(x, wg, wu, wd, dot):
    import jax
    jnp = _jnp()
    g = dot(x, wg).astype(jnp.float32)
    u = dot(x, wu).astype(jnp.float32)
    return dot((jax.nn.silu(g) * u).astype(x.dtype), wd)


def experts_grouped(h, topk_w, topk_ids, wg, wu, wd):
    """Every expert on the tokens routed to it (low-latency layout: this rank's slice of each
    expert's intermediate dimension, so the result is a partial sum). Dropless: the t*k
    (token, expert) pairs are sorted by expert and multiplied with lax.ragged_dot."""
    from jax import lax
    jnp = _jnp()
    t, k = topk_ids.shape
    n_exp = wg.shape[0]
    flat = topk_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat, length=n_exp).astype(jnp.int32)
    y = swiglu(h[tok], wg, wu, wd, lambda a, b: lax.ragged_dot(a, b, sizes))
    y = y.astype(jnp.float32) * topk_w.reshape(-1)[order][:, None]
    out = jnp.zeros((t, h.shape[1]), jnp.float32).at[tok].add(y)
    return out.astype(h.dtype)


def experts_dispatched(expert_x, expert_counts, wg, wu, wd):
    """This rank's experts over the dispatched rows [E_local, rows, hidden] (batched einsum);
    rows >= expert_counts[e] are unspecified on input and zeroed."""
    jnp = _jnp()
    rows = expert_x.shape[1]
    mask = (jnp.arange(rows, dtype=jnp.int32)[None, :] < expert_counts[:, None])[..., None]
    x = jnp.where(mask, expert_x, jnp.zeros((), expert_x.dtype))
    y = swiglu(x, wg, wu, wd, lambda a, b: jnp.einsum("erh,ehf->erf", a, b))
    return jnp.where(mask, y, jnp.zeros((), y.dtype))


def forward(x, params, caches, *, cfg, phase, layout, ar_norm, moe):
    """The decoder stack on one rank. ar_norm(partial, residual, w) -> (normed, residual) ends
    every sub-layer; moe(h, topk_w, topk_ids, layer_params) -> MoE output (a partial sum in the
    low-latency layout). Returns the final normed hidden states."""
    jnp = _jnp()
    hd = cfg.hidden // cfg.heads
    layers = params["layers"]
    residual = x
    h = rms_norm(x.astype(jnp.float32), layers[0]["attn_norm"]).astype(x.dtype)
    for i, p in enumerate(layers):
        a = attention(h, p, caches[i] if phase == "decode" else None, hd, phase)
        h, residual = ar_norm(a, residual, p["moe_norm"])
        tw, ti = route(h, p["router"], cfg.top_k)
        m = moe(h, tw, ti, p)
        nxt = layers[i + 1]["attn_norm"] if i + 1 < len(layers) else params["final_norm"]
        h, residual = ar_norm(m, residual, nxt)
    return h


# --------------------------------------------------------------------------------------------
# weights, inputs, shardings

def param_specs(cfg, layout):
    from jax.sharding import PartitionSpec as P
    if layout == "low-latency":
        a = "tp"
        layer = dict(attn_norm=P(), moe_norm=P(), wq=P(None, a), wk=P(None, a), wv=P(None, a),
                     wo=P(a, None), router=P(), wg=P(None, None, a), wu=P(None, None, a),
                     wd=P(None, a, None))
    else:
        a = "ep"
        layer = dict(attn_norm=P(), moe_norm=P(), wq=P(), wk=P(), wv=P(), wo=P(), router=P(),
                     wg=P(a), wu=P(a), wd=P(a))
    return dict(layers=[dict(layer) for _ in range(cfg.layers)], final_norm=P())


def init_params(cfg, mesh, layout):
    """Seeded random weights, generated on the devices (jax.random inside one jit whose
    out_shardings place each shard; threefry is partitionable, so the values do not depend on
    the layout or the number of devices). Same logical model in both layouts."""
    import jax
    jnp = _jnp()
    from jax.sharding import NamedSharding
    H, E, F, L = cfg.hidden, cfg.experts, cfg.ffn, cfg.layers
    dt = jnp.dtype(cfg.dtype)

    def gen():
        key = jax.random.key(cfg.seed)

        def normal(k, shape, fan_in):
            return (jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(dt)

        layers = []
        for i in range(L):
            ks = jax.random.split(jax.random.fold_in(key, i), 10)
            layers.append(dict(
                attn_norm=(1.0 + 0.1 * jax.random.normal(ks[0], (H,))).astype(dt),
                moe_norm=(1.0 + 0.1 * jax.random.normal(ks[1], (H,))).astype(dt),
                wq=normal(ks[2], (H, H), H), wk=normal(ks[3], (H, H), H),
                wv=normal(ks[4], (H, H), H), wo=normal(ks[5], (H, H), H),
                router=normal(ks[6], (H, E), H).astype(jnp.float32),
                wg=normal(ks[7], (E, H, F), H), wu=normal(ks[8], (E, H, F), H),
                wd=normal(ks[9], (E, F, H), F)))
        fk = jax.random.fold_in(key, 1 << 20)
        return dict(layers=layers,
                    final_norm=(1.0 + 0.1 * jax.random.normal(fk, (H,))).astype(dt))

    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg, layout))
    return jax.jit(gen, out_shardings=shard)()


def init_caches(cfg, mesh, layout, world):
    """Decode context: per layer (k, v) [batch, context, heads, head_dim], seeded random.
    Low-latency: batch = decode tokens, split over heads; high-throughput: batch =
    world * decode tokens, split over the batch (each rank its own sequences)."""
    import jax
    jnp = _jnp()
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    hd = cfg.hidden // cfg.heads
    if layout == "low-latency":
        b, spec = cfg.decode_tokens, P(None, None, "tp", None)
    else:
        b, spec = world * cfg.decode_tokens, P("ep")
    shape = (b, cfg.context, cfg.heads, hd)
    dt = jnp.dtype(cfg.dtype)

    def gen():
        key = jax.random.fold_in(jax.random.key(cfg.seed), 2 << 20)
        ks = jax.random.split(key, 2 * cfg.layers)
        return [(jax.random.normal(ks[2 * i], shape).astype(dt),
                 jax.random.normal(ks[2 * i + 1], shape).astype(dt)) for i in range(cfg.layers)]

    sh = NamedSharding(mesh, spec)
    caches = jax.jit(gen, out_shardings=[(sh, sh)] * cfg.layers)()
    return caches, [(spec, spec)] * cfg.layers


def make_input(cfg, mesh, layout, phase, world):
    """Token hidden states (seeded numpy, the same in every process), as a global array built
    with jax.make_array_from_callback (works with several processes)."""
    import jax
    import numpy as np
    jnp = _jnp()
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    t = cfg.tokens if phase == "prefill" else cfg.decode_tokens
    rows, spec = (t, P()) if layout == "low-latency" else (world * t, P("ep"))
    seed = [cfg.seed, LAYOUTS.index(layout), PHASES.index(phase)]
    host = np.random.default_rng(seed).standard_normal((rows, cfg.hidden), np.float32)
    host = host.astype(jnp.dtype(cfg.dtype))
    arr = jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec),
                                       lambda idx: host[idx])
    return arr, spec


# --------------------------------------------------------------------------------------------
# the two implementations of each layout's communication

def nvc_moe_api():
    """(moe_dispatch, moe_combine, MoECommunicator) from jax_nvcomm, or Unavailable."""
    import jax_nvcomm as nvc
    missing = [n for n in ("MoECommunicator", "moe_dispatch", "moe_combine")
               if not hasattr(nvc, n)]
    if missing:
        raise Unavailable("the high-throughput layout needs jax_nvcomm." + ", jax_nvcomm.".join(
            missing) + ", which this build of jax_nvcomm does not have yet; run with "
            "--layouts low-latency")
    return nvc.moe_dispatch, nvc.moe_combine, nvc.MoECommunicator


def xla_moe_api():
    """(moe_dispatch_xla, moe_combine_xla) from jax_nvcomm.reference, or Unavailable."""
    try:
        from . import reference
    except ImportError as e:
        raise Unavailable("the XLA side of the high-throughput layout needs "
                          f"jax_nvcomm.reference (moe_dispatch_xla / moe_combine_xla): {e}; run "
                          "with --layouts low-latency or --nvcomm-only") from e
    missing = [n for n in ("moe_dispatch_xla", "moe_combine_xla") if not hasattr(reference, n)]
    if missing:
        raise Unavailable(f"jax_nvcomm.reference lacks {', '.join(missing)}; run with "
                          "--layouts low-latency or --nvcomm-only")
    return reference.moe_dispatch_xla, reference.moe_combine_xla


def ep_available(impls=IMPLS):
    """(True, "") if the high-throughput layout can run with `impls`, else (False, reason)."""
    try:
        if "jax_nvcomm" in impls:
            nvc_moe_api()
        if "xla" in impls:
            xla_moe_api()
    except Unavailable as e:
        return False, str(e)
    return True, ""


def make_step(cfg, mesh, layout, phase, impl, comms):
    """The jitted step: x, params, caches -> final hidden states."""
    import jax
    import jax_nvcomm as nvc
    from jax.sharding import PartitionSpec as P
    if layout == "low-latency":
        axis, out_spec = "tp", P()
        if impl == "jax_nvcomm":
            comm = comms["tp"]

            def ar_norm(x, r, w):
                return nvc.all_reduce_rms_norm(x, r, w, comm, eps=EPS)
        else:
            def ar_norm(x, r, w):
                return psum_rms_norm(x, r, w, axis)

        def moe(h, tw, ti, p):
            return experts_grouped(h, tw, ti, p["wg"], p["wu"], p["wd"])
    else:
        axis, out_spec = "ep", P("ep")
        ar_norm = add_rms_norm  # data-parallel attention: no all-reduce
        if impl == "jax_nvcomm":
            dispatch, combine, _ = nvc_moe_api()
            mc = comms[("ep", phase)]

            def moe(h, tw, ti, p):
                d = dispatch(h, ti, mc)
                y = experts_dispatched(d.expert_x, d.expert_counts, p["wg"], p["wu"], p["wd"])
                return combine(y, tw, d.handle, mc)
        else:
            dispatch_xla, combine_xla = xla_moe_api()

            def moe(h, tw, ti, p):
                ex, counts, _, handle = dispatch_xla(h, ti, axis_name=axis,
                                                     num_experts=cfg.experts, impl="ragged")
                y = experts_dispatched(ex, counts, p["wg"], p["wu"], p["wd"])
                return combine_xla(y, tw, handle, axis_name=axis, num_experts=cfg.experts,
                                   impl="ragged")

    def body(x, params, caches):
        return forward(x, params, caches, cfg=cfg, phase=phase, layout=layout, ar_norm=ar_norm,
                       moe=moe)

    return body, axis, out_spec


def nvc_op_name(cfg, layout, phase, comms, world):
    """What jax_nvcomm runs for this step (for the table)."""
    import jax_nvcomm as nvc
    jnp = _jnp()
    if layout == "high-throughput":
        return "dispatch+combine"
    comm = comms.get("tp")
    if comm is None:
        return "-"
    t = cfg.tokens if phase == "prefill" else cfg.decode_tokens
    return "AR+norm " + nvc.select_strategy(comm, (t, cfg.hidden), jnp.dtype(cfg.dtype))


# --------------------------------------------------------------------------------------------
# gathering results to process 0 (no XLA collectives: works where NCCL cannot run)

_gather_seq = [0]


def to_host0(arr):
    """The full value of a global array as float32 numpy on process 0 (None elsewhere)."""
    import jax
    import numpy as np
    if jax.process_count() == 1:
        return np.asarray(arr.astype("float32") if arr.dtype != np.float32 else arr)
    from . import _exchange
    _gather_seq[0] += 1
    prefix = f"jax_nvcomm_demo/gather/{_gather_seq[0]}"
    chunk = 1 << 20
    if jax.process_index() != 0:
        for s in arr.addressable_shards:
            if s.replica_id != 0:
                continue
            data = np.ascontiguousarray(np.asarray(s.data, np.float32)).tobytes()
            n = max(1, -(-len(data) // chunk))
            _exchange.put(f"{prefix}/{s.device.id}/n", str(n).encode())
            for i in range(n):
                _exchange.put(f"{prefix}/{s.device.id}/{i}", data[i * chunk:(i + 1) * chunk])
        return None
    out = np.zeros(arr.shape, np.float32)
    idx_map = arr.sharding.devices_indices_map(arr.shape)
    local = {s.device.id: s for s in arr.addressable_shards}
    done = set()
    for dev, idx in idx_map.items():
        key = tuple((sl.start, sl.stop) for sl in idx)
        if key in done:
            continue
        if dev.id in local:
            out[idx] = np.asarray(local[dev.id].data, np.float32)
            done.add(key)
    for dev, idx in idx_map.items():
        key = tuple((sl.start, sl.stop) for sl in idx)
        if key in done or dev.id in local:
            continue
        # the replica_id == 0 copy of this block lives on the first device holding it
        owner = min((d for d, i in idx_map.items()
                     if tuple((sl.start, sl.stop) for sl in i) == key), key=lambda d: d.id)
        if owner.id != dev.id:
            continue
        n = int(_exchange.get(f"{prefix}/{dev.id}/n", 120, "a result shard").decode())
        data = b"".join(_exchange.get(f"{prefix}/{dev.id}/{i}", 120, "a result shard")
                        for i in range(n))
        block = out[idx]
        out[idx] = np.frombuffer(data, np.float32).reshape(block.shape)
        done.add(key)
    return out


def compare(a, b):
    """(relative L2 error, max abs error) of a against b, in float64."""
    import numpy as np
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    den = max(float(np.linalg.norm(b)), 1e-30)
    return float(np.linalg.norm(a - b)) / den, float(np.max(np.abs(a - b)))


# --------------------------------------------------------------------------------------------
# running

class Progress:
    def __init__(self, total, enabled):
        self.total, self.enabled, self.n, self.t0 = total, enabled, 0, time.perf_counter()

    def line(self, msg, step=None):
        if self.enabled:
            tag = f"[{step}/{self.total}] " if step is not None else ""
            print(f"{tag}{msg} ({time.perf_counter() - self.t0:.1f} s)", file=sys.stderr,
                  flush=True)


def _time_step(fn, args, warmup, iters):
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    out = None
    for _ in range(iters):
        t = time.perf_counter()
        out = fn(*args)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t)
    return out, statistics.median(ts)


def run(cfg: Config, *, devices=None):
    """Run every requested (layout, phase, impl) step. Returns a dict with "rows" (one per
    layout x phase: timings, errors, agreement), "ok" (no comparison disagreed), "config"
    (the resolved Config), "world", "platform". Print nothing but progress (stderr, process 0)."""
    import jax
    import numpy as np
    import jax_nvcomm as nvc
    jnp = _jnp()
    from jax.sharding import Mesh

    all_devs = list(jax.devices()) if devices is None else list(devices)
    if cfg.devices is not None:
        if jax.process_count() > 1 and cfg.devices != len(all_devs):
            raise ConfigError("--devices must cover every device of a multi-process job")
        if not 1 <= cfg.devices <= len(all_devs):
            raise ConfigError(f"--devices {cfg.devices}: have {len(all_devs)} devices")
        all_devs = all_devs[:cfg.devices]
    world = len(all_devs)
    platform = all_devs[0].platform
    cfg = resolve(cfg, platform, world)
    main_proc = jax.process_index() == 0
    if "high-throughput" in cfg.layouts:
        ok_ep, why = ep_available(cfg.impls)
        if not ok_ep:
            raise Unavailable(why)

    ref = None
    if cfg.ref:
        ref = load_ref(cfg.ref, cfg, world)

    meshes = {"low-latency": Mesh(np.array(all_devs), ("tp",)),
              "high-throughput": Mesh(np.array(all_devs), ("ep",))}
    dt = jnp.dtype(cfg.dtype)
    comms = {}
    steps = [(lay, ph, impl) for lay in cfg.layouts for ph in cfg.phases for impl in cfg.impls]
    prog = Progress(len(steps), main_proc and not cfg.quiet)
    prog.line(f"{world} x {platform} devices, {jax.process_count()} process(es); "
              f"{cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, {cfg.experts} "
              f"experts top-{cfg.top_k}, ffn {cfg.ffn}, {cfg.dtype}")
    rows, outputs = [], {}
    try:
        if "jax_nvcomm" in cfg.impls:
            if "low-latency" in cfg.layouts:
                tmax = max(cfg.tokens if "prefill" in cfg.phases else 0,
                           cfg.decode_tokens if "decode" in cfg.phases else 0)
                mmb = max(4096, -(-tmax * cfg.hidden * dt.itemsize // 4096) * 4096)
                comms["tp"] = nvc.Communicator(meshes["low-latency"], "tp",
                                               max_message_bytes=mmb)
            if "high-throughput" in cfg.layouts:
                _, _, MoECommunicator = nvc_moe_api()
                for ph in cfg.phases:
                    t = cfg.tokens if ph == "prefill" else cfg.decode_tokens
                    comms[("ep", ph)] = MoECommunicator(
                        meshes["high-throughput"], "ep", num_experts=cfg.experts,
                        top_k=cfg.top_k, max_tokens=t, hidden=cfg.hidden, dtype=dt)
        n = 0
        for layout in cfg.layouts:
            mesh = meshes[layout]
            params = init_params(cfg, mesh, layout)
            pspecs = param_specs(cfg, layout)
            caches, cspecs = init_caches(cfg, mesh, layout, world) if "decode" in \
                cfg.phases else (None, None)
            for phase in cfg.phases:
                x, xspec = make_input(cfg, mesh, layout, phase, world)
                cs, csp = (caches, cspecs) if phase == "decode" else ((), ())
                t = cfg.tokens if phase == "prefill" else cfg.decode_tokens
                row = dict(layout=layout, phase=phase, tokens=t, ms={}, err=None, maxabs=None,
                           ref_err=None, agree=None,
                           op=nvc_op_name(cfg, layout, phase, comms, world))
                for impl in cfg.impls:
                    n += 1
                    what = f"{layout} {phase} ({impl})"
                    prog.line(f"compiling {what}...", n)
                    body, axis, out_spec = make_step(cfg, mesh, layout, phase, impl, comms)
                    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(xspec, pspecs, csp),
                                               out_specs=out_spec))
                    compiled = fn.lower(x, params, cs).compile()
                    prog.line(f"running {what}: {cfg.warmup} warm-up + {cfg.iters} timed "
                              "steps...", n)
                    out, sec = _time_step(compiled, (x, params, cs), cfg.warmup, cfg.iters)
                    row["ms"][impl] = sec * 1e3
                    outputs[(layout, phase, impl)] = to_host0(out)
                    prog.line(f"{what}: {sec * 1e3:.3f} ms/step", n)
                rows.append(row)
    finally:
        for c in comms.values():
            c.close()

    ok = True
    if main_proc:
        tol = TOLERANCE[cfg.dtype]
        for row in rows:
            k = (row["layout"], row["phase"])
            cand = outputs.get(k + ("jax_nvcomm",))
            base = outputs.get(k + ("xla",))
            checks = []
            if cand is not None and base is not None:
                row["err"], row["maxabs"] = compare(cand, base)
                checks.append(row["err"] < tol)
            if ref is not None:
                rtol = max(tol, TOLERANCE[ref["dtype"]])
                errs = [compare(o, ref["out"][k])[0] for o in (cand, base) if o is not None]
                row["ref_err"] = max(errs)
                checks.append(row["ref_err"] < rtol)
            if checks:
                row["agree"] = all(checks) and all(math.isfinite(e) for e in
                                                   (row["err"] or 0.0, row["ref_err"] or 0.0))
                ok &= row["agree"]
        if cfg.save_ref:
            save_ref(cfg.save_ref, cfg, world, outputs)
            prog.line(f"saved final hidden states to {cfg.save_ref}")
    return dict(rows=rows, ok=ok, config=cfg, world=world, platform=platform,
                processes=jax.process_count(), elapsed=time.perf_counter() - prog.t0)


def save_ref(path, cfg, world, outputs):
    import numpy as np
    arrays = {}
    for (layout, phase, impl), v in outputs.items():
        key = f"{layout}/{phase}"
        if impl == "xla" or key not in arrays:  # prefer the XLA side as the reference
            arrays[key] = np.asarray(v, np.float32)
    meta = dict(cfg.model_dict(), world=world, dtype=cfg.dtype)
    np.savez(path, __meta__=np.array(json.dumps(meta)), **arrays)


def load_ref(path, cfg, world):
    import numpy as np
    with np.load(path) as z:
        meta = json.loads(str(z["__meta__"]))
        out = {tuple(k.split("/")): z[k] for k in z.files if k != "__meta__"}
    want = dict(cfg.model_dict(), world=world)
    diff = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
    if diff:
        raise ConfigError(f"--ref {path} was made with another configuration: " + ", ".join(
            f"{k} {a} (ref) vs {b} (now)" for k, (a, b) in diff.items()))
    for lay in cfg.layouts:
        for ph in cfg.phases:
            if (lay, ph) not in out:
                raise ConfigError(f"--ref {path} has no {lay} {ph} results")
    return dict(out=out, dtype=meta["dtype"])


# --------------------------------------------------------------------------------------------
# output

def format_table(res) -> str:
    cfg = res["config"]
    tol = TOLERANCE[cfg.dtype]
    has_ref = any(r["ref_err"] is not None for r in res["rows"])
    head = ["layout", "phase", "tokens/rank", "jax_nvcomm op", "ms jax_nvcomm", "ms XLA",
            "XLA/nvcomm", "rel L2 err", "max abs err"] + (["vs ref"] if has_ref else []) + \
        ["agree"]
    body = []
    for r in res["rows"]:
        a, b = r["ms"].get("jax_nvcomm"), r["ms"].get("xla")
        f = lambda v, fmt: "-" if v is None else format(v, fmt)
        body.append([r["layout"], r["phase"], str(r["tokens"]), r["op"], f(a, ".3f"),
                     f(b, ".3f"), f(b / a if a and b else None, ".2f") + ("x" if a and b else ""),
                     f(r["err"], ".1e"), f(r["maxabs"], ".1e")] +
                    ([f(r["ref_err"], ".1e")] if has_ref else []) +
                    ["-" if r["agree"] is None else "yes" if r["agree"] else "NO"])
    w = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    line = lambda cells: "  ".join(c.rjust(w[i]) if i >= 2 else c.ljust(w[i])
                                   for i, c in enumerate(cells))
    out = [f"MoE transformer: {res['world']} x {res['platform']} ({res['processes']} process"
           f"{'es' if res['processes'] > 1 else ''}), {cfg.layers} layers, hidden {cfg.hidden}, "
           f"{cfg.heads} heads, {cfg.experts} experts top-{cfg.top_k}, expert ffn {cfg.ffn}, "
           f"{cfg.dtype}; decode: {cfg.decode_tokens} tokens/rank after a {cfg.context}-token "
           f"context; prefill: {cfg.tokens} tokens/rank",
           line(head), line(["-" * x for x in w])]
    out += [line(b) for b in body]
    out.append(f"ms: median of {cfg.iters} steps after {cfg.warmup} warm-up; XLA/nvcomm > 1: "
               f"jax_nvcomm faster; agree: rel L2 err < {tol:g} ({cfg.dtype})")
    return "\n".join(out)


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["rows"]
    labels = [f"{r['layout']}\n{r['phase']} ({r['tokens']} tok/rank)" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(rows)), 4.5))
    width = 0.38
    for j, (impl, name) in enumerate((("jax_nvcomm", "jax_nvcomm"), ("xla", "XLA collectives"))):
        vals = [r["ms"].get(impl, float("nan")) for r in rows]
        xs = [i + (j - 0.5) * width for i in range(len(rows))]
        bars = ax.bar(xs, vals, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("ms / step (median)")
    cfg = res["config"]
    ax.set_title(f"MoE transformer, {cfg.layers} layers, {res['world']} x {res['platform']}, "
                 f"{cfg.dtype}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# command line

def _gpu_present() -> bool:
    plats = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if plats:
        return "cpu" not in plats.split(",")[0]
    try:
        import subprocess
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                              timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def setup_platform(cpu_devices: int = 8) -> None:
    """Before any JAX backend starts: join the launcher's job if started by it; otherwise,
    without a GPU, use `cpu_devices` CPU host devices."""
    from . import _dist
    if _dist.is_launched():
        _dist.distributed_initialize()
        return
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized() or _gpu_present():
        return
    import jax
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={cpu_devices}"
                                   ).strip()
        jax.config.update("jax_num_cpu_devices", cpu_devices)


def parse_args(argv=None, prog=None) -> Config:
    p = argparse.ArgumentParser(
        prog=prog, description="MoE decoder stack with jax_nvcomm vs XLA's collectives "
        "(low-latency TP layout and high-throughput DP-attention + EP layout; decode and "
        "prefill). Sizes default to a small model on CPU and a Qwen3-MoE-like one on GPU.")
    g = p.add_argument_group("model (defaults: CPU {} / GPU {})".format(
        " ".join(f"{k}={v}" for k, v in CPU_DEFAULTS.items() if k not in ("iters", "dtype")),
        " ".join(f"{k}={v}" for k, v in GPU_DEFAULTS.items() if k not in ("iters", "dtype"))))
    g.add_argument("--layers", type=int)
    g.add_argument("--hidden", type=int)
    g.add_argument("--heads", type=int, help="attention heads (default: head_dim <= 128, a "
                   "multiple of the world size)")
    g.add_argument("--experts", type=int)
    g.add_argument("--top-k", dest="top_k", type=int)
    g.add_argument("--ffn", type=int, help="intermediate size of one expert")
    g.add_argument("--tokens", type=int, help="prefill tokens per rank")
    g.add_argument("--decode-tokens", dest="decode_tokens", type=int,
                   help="decode tokens (sequences) per rank")
    g.add_argument("--context", type=int, help="decode: length of the fixed K/V context")
    g.add_argument("--dtype", choices=("bfloat16", "float32", "float16"),
                   help="default: bfloat16 on GPU, float32 on CPU")
    g.add_argument("--seed", type=int, default=0)
    r = p.add_argument_group("run")
    r.add_argument("--devices", type=int, help="use the first N devices (default: all; 8 CPU "
                   "devices when no GPU is present)")
    r.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="comma list of low-latency,high-throughput")
    r.add_argument("--phases", default=",".join(PHASES), help="comma list of decode,prefill")
    r.add_argument("--iters", type=int, help="timed steps (default: 20 GPU, 5 CPU)")
    r.add_argument("--warmup", type=int, default=2)
    x = r.add_mutually_exclusive_group()
    x.add_argument("--xla-only", action="store_true", help="run only XLA's collectives")
    x.add_argument("--nvcomm-only", action="store_true",
                   help="run only jax_nvcomm (ranks sharing one GPU: NCCL cannot run there); "
                   "compare with --ref")
    r.add_argument("--save-ref", metavar="FILE.npz",
                   help="store the final hidden states (XLA side when it ran)")
    r.add_argument("--ref", metavar="FILE.npz", help="also compare against a stored reference")
    r.add_argument("--plot", metavar="FILE.png", help="bar chart of the timings (matplotlib)")
    r.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    a = p.parse_args(argv)

    def split(s, allowed, flag):
        items = tuple(v.strip() for v in s.split(",") if v.strip())
        bad = [v for v in items if v not in allowed]
        if bad or not items:
            p.error(f"{flag}: expected a comma list of {','.join(allowed)}, got {s!r}")
        return tuple(v for v in allowed if v in items)

    impls = ("xla",) if a.xla_only else ("jax_nvcomm",) if a.nvcomm_only else IMPLS
    return Config(layers=a.layers, hidden=a.hidden, heads=a.heads, experts=a.experts,
                  top_k=a.top_k, ffn=a.ffn, tokens=a.tokens, decode_tokens=a.decode_tokens,
                  context=a.context, devices=a.devices, dtype=a.dtype, iters=a.iters,
                  warmup=a.warmup, seed=a.seed,
                  layouts=split(a.layouts, LAYOUTS, "--layouts"),
                  phases=split(a.phases, PHASES, "--phases"), impls=impls, ref=a.ref,
                  save_ref=a.save_ref, plot=a.plot, quiet=a.quiet)


def main(argv=None, prog=None) -> int:
    """Command line entry point; returns the exit code (0: every comparison agreed, 1: one
    disagreed, 2: bad arguments or a missing part of the package)."""
    cfg = parse_args(argv, prog)
    setup_platform()
    import jax
    try:
        res = run(cfg)
    except (Unavailable, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if jax.process_index() == 0:
        print(format_table(res), flush=True)
        if cfg.plot:
            plot(res, cfg.plot)
            print(f"plot: {cfg.plot}")
        if not res["ok"]:
            print("FAILED: jax_nvcomm and the reference disagree (see 'agree')", flush=True)
    return 0 if res["ok"] else 1
