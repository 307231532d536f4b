"""A small MoE decoder stack run with jax_nvcomm and with XLA's collectives, side by side.

`python -m jax_nvcomm.demo [flags]` (or `python examples/moe_transformer.py [flags]`) builds a few
decoder layers shaped like today's MoE LLMs, with seeded random weights, and runs one decode step
and one prefill step in each of two layouts, once with jax_nvcomm's collectives and once with
XLA's only, then checks that both give the same final hidden states and prints the timings.

Model (per layer, pre-norm, residual stream in the working dtype):
    h = RMSNorm(x)                       (fused into the previous layer's last collective)
    x = x + Attention(h)                 causal softmax attention, RoPE, q/k/v/o projections
    h = RMSNorm(x)
    x = x + MoE(h)                       softmax router, top-k (renormalised), SwiGLU experts
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
        jax_nvcomm: nvc.moe_dispatch / nvc.moe_combine (MoECommunicator); the shared expert
                    (--shared-ffn) runs between nvc.moe_dispatch_send and moe_dispatch_recv
                    (--no-split: fused moe_dispatch, the shared expert outside it)
        XLA:        jax_nvcomm.reference.moe_dispatch_xla / moe_combine_xla (impl="ragged",
                    lax.ragged_all_to_all)
    and the local experts run over the dispatched rows [E/W, W*tokens, hidden] with a batched
    einsum, rows past each expert's count masked to zero.
  dp-attn-tp-moe (opt-in: --layouts; data-parallel attention + tensor-parallel MoE, axis "dp"):
    every rank its own tokens and full attention weights, as in high-throughput, but a slice of
    every expert's (and the shared expert's) ffn, as in low-latency. Token counts per rank are
    an int32 input (one compiled program for any counts) over a static capacity max_rows:
    prefill is unbalanced, rank 0 `--tokens` tokens, the others `--decode-tokens` (ranks that
    decode beside one that prefills), in buffers of `--tokens` rows; decode is balanced. Per
    MoE every rank needs every rank's rows, and afterwards the sum of the partial results of
    its own rows:
        jax_nvcomm: nvc.all_gather_v(h, num_rows, comm) -> router + TP experts on the gathered
                    rows -> nvc.reduce_scatter_v(y, offsets, comm) (only valid rows travel)
        XLA:        padded lax.all_gather (max_rows of every rank) -> the same -> padded
                    lax.psum_scatter (dp_tp_collectives says why this baseline)
    then the residual add + RMSNorm locally. Outputs and routing are zero past each rank's
    count on both sides; only valid rows are compared.
  ep-ragged (opt-in: --layouts; data-parallel attention + expert-parallel MoE, axis "ep", as
    high-throughput): the MoE is the dropless layer of jax_nvcomm/models/moe_ragged.py, written
    the way JAX MoE code writes it (pairs sorted by expert, all-gathered group sizes,
    ragged_all_to_all into a W*T*min(K, L)-row buffer, lax.ragged_dot SwiGLU over the local
    experts, ragged_all_to_all back), shared expert beside it. The two sides differ only in
    that layer's collectives (moe_ragged.collectives):
        jax_nvcomm: nvc.ragged_all_to_all (x2) and nvc.all_gather of the group sizes
        XLA:        lax.ragged_all_to_all (x2; jax_nvcomm.reference's emulation on CPU) and
                    lax.all_gather

Agreement: relative L2 error ||a - b|| / ||b|| of the final hidden states, below 1e-4 in
float32 and 2e-2 in bfloat16/float16 (see TOLERANCE). In low precision the two all-reduces
round differently (jax_nvcomm sums in float32, XLA's psum in the working dtype), which flips
near-tied top-k choices of a few tokens (measured on CPU, bf16, 4 layers, 32 experts top-4:
4-7% of (layer, token) choices); such a token then differs by ~10%, which no tolerance on the
whole output should hide. Each step therefore also returns its routing; when the candidate's
differs from the baseline's, the candidate is run once more with the baseline's routing forced
(the router still computes its weights) and that output is compared. The table reports the
share of differing routing choices next to the error.

Timing: each step is jitted (the whole stack in one program), compiled, run `--warmup` times,
then `--iters` times with a host sync after each call; when both implementations run, the
reported medians come from a second pass that runs one step of each in turns (order reversed
every other round), so that drift of the machine falls on both alike (the first pass's medians
stay in the row as `ms_sequential`). Host dispatch is included (what a user's loop pays).

Multi-process: works under `python -m jax_nvcomm.launch -n N [--share-gpu] -m jax_nvcomm.demo
--nvcomm-only --ref FILE.npz ...`: the table is printed by process 0; the mesh spans
jax.devices() of every process; inputs are built with jax.make_array_from_callback, weights
with jax.random inside a jit whose out_shardings place each shard where it lives; results go to
process 0 through the distributed key-value store, never through XLA collectives, so
`--nvcomm-only` needs no NCCL.
NCCL refuses several ranks on one GPU, so with --share-gpu the XLA side cannot run: compare
against a stored reference made by a run that can (`--save-ref FILE.npz`, same model flags).
The reference may come from another world size: the low-latency layout's results do not depend
on it, and in the high-throughput layout rank r's tokens (and decode context) are seeded by r,
so the first min(world, reference world) ranks' tokens are compared. E.g. on one GPU:
    python -m jax_nvcomm.demo --devices 1 --save-ref ref.npz
    python -m jax_nvcomm.launch -n 4 --share-gpu -m jax_nvcomm.demo --nvcomm-only --ref ref.npz
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time

EPS = 1e-6
ROPE_THETA = 10000.0
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
LAYOUTS = ("low-latency", "high-throughput", "dp-attn-tp-moe", "ep-ragged")
# dp-attn-tp-moe is opt-in (--layouts): with it the CPU default run takes about twice as long
# (its prefill runs the TP experts over all world * tokens gathered rows, on 2 cores ~3 s/step)
DEFAULT_LAYOUTS = ("low-latency", "high-throughput")
AXES = {"low-latency": "tp", "high-throughput": "ep", "dp-attn-tp-moe": "dp",
        "ep-ragged": "ep"}
PHASES = ("decode", "prefill")
IMPLS = ("jax_nvcomm", "xla")
# version of the --save-ref file. 2: the high-throughput decode context of a 1-device run is
# seeded like rank 0's of any world size (format 1 files of world 1 have another context).
REF_FORMAT = 2


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
    shared_ffn: int | None = None   # intermediate size of the shared expert (0: none)
    tokens: int | None = None       # prefill tokens per rank
    decode_tokens: int | None = None
    context: int | None = None      # decode: fixed K/V context length
    devices: int | None = None      # use the first N devices
    dtype: str | None = None
    iters: int | None = None
    warmup: int = 2
    seed: int = 0
    layouts: tuple = DEFAULT_LAYOUTS
    phases: tuple = PHASES
    impls: tuple = IMPLS
    ref: str | None = None          # compare against this stored reference
    save_ref: str | None = None     # store final hidden states here
    plot: str | None = None
    quiet: bool = False             # no progress lines
    trace_dir: str | None = None    # profile a few steps of each row here (bench step)
    split: bool | None = None       # high-throughput, jax_nvcomm: shared expert between the
                                    # dispatch send and receive halves (False: fused dispatch;
                                    # None: the platform default, see CPU_/GPU_DEFAULTS)
    bound: bool = False             # also time the step with no communication at all
                                    # (impl "none": wrong numbers, same compute; the least a
                                    # step can cost with any collectives)
    xla_variants: object = None     # bench step: callable(compiled XLA step) -> [(label, XLA
                                    # compiler options)]: the XLA step compiled with each is
                                    # timed in the same turns; the fastest is "XLA best"

    def model_dict(self):
        keys = ("layers", "hidden", "heads", "experts", "top_k", "ffn", "shared_ffn", "tokens",
                "decode_tokens", "context", "seed")
        return {k: getattr(self, k) for k in keys}


GPU_DEFAULTS = dict(layers=4, hidden=2048, heads=16, experts=128, top_k=8, ffn=768,
                    shared_ffn=768, tokens=256, decode_tokens=4, context=256, dtype="bfloat16",
                    iters=20, split=True)
# CPU: scaled down so that the default run (8 host devices, both layouts and phases, both
# implementations) takes well under a minute on 2 cores.
CPU_DEFAULTS = dict(layers=2, hidden=256, heads=None, experts=32, top_k=4, ffn=128,
                    shared_ffn=128, tokens=128, decode_tokens=4, context=64, dtype="float32",
                    iters=5, split=True)


def resolve(cfg: Config, platform: str, world: int) -> Config:
    """Fill platform defaults and check the sizes against the world size."""
    d = CPU_DEFAULTS if platform == "cpu" else GPU_DEFAULTS
    vals = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    for k, v in d.items():
        if vals.get(k) is None:
            vals[k] = v
    if vals["heads"] is None:  # head_dim up to 128 (the same for every world size up to 8)
        h = max(8, vals["hidden"] // 128)
        if "low-latency" in vals["layouts"] and h % world:
            h = -(-h // world) * world
        vals["heads"] = h
    c = Config(**vals)
    errs = []
    if c.hidden % c.heads:
        errs.append(f"--hidden must be a multiple of --heads={c.heads}, got {c.hidden}")
    elif (c.hidden // c.heads) % 2:
        errs.append(f"--hidden / --heads (the head size) must be even (RoPE), got "
                    f"{c.hidden // c.heads}")
    if "low-latency" in c.layouts:
        if c.heads % world:
            errs.append(f"--heads must be a multiple of the {world} ranks (TP), got {c.heads}")
        if c.ffn % world:
            errs.append(f"--ffn must be a multiple of the {world} ranks (TP experts), got {c.ffn}")
    if "dp-attn-tp-moe" in c.layouts:
        if c.ffn % world:
            errs.append(f"--ffn must be a multiple of the {world} ranks (TP experts of "
                        f"dp-attn-tp-moe), got {c.ffn}")
        if c.shared_ffn % world:
            errs.append(f"--shared-ffn must be a multiple of the {world} ranks (TP shared "
                        f"expert of dp-attn-tp-moe), got {c.shared_ffn}")
    for lay in ("high-throughput", "ep-ragged"):
        if lay in c.layouts and c.experts % world:
            errs.append(f"--experts must be a multiple of the {world} ranks (EP, {lay}), got "
                        f"{c.experts}")
    if not 1 <= c.top_k <= c.experts:
        errs.append(f"--top-k must be in [1, --experts={c.experts}], got {c.top_k}")
    vec = {"float32": 4, "bfloat16": 8, "float16": 8}.get(c.dtype)
    if vec is None:
        errs.append(f"--dtype must be float32, bfloat16 or float16, got {c.dtype}")
    elif c.hidden % vec:
        errs.append(f"--hidden must be a multiple of {vec} for {c.dtype}, got {c.hidden}")
    for k in ("layers", "tokens", "decode_tokens", "context", "iters"):
        if getattr(c, k) < 1:
            errs.append(f"--{k.replace('_', '-')} must be >= 1, got {getattr(c, k)}")
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


def route(h, w_router, top_k, forced_ids=None):
    """Softmax router, top-k, weights renormalised: (float32 [t, k], int32 [t, k]).
    forced_ids (int32 [t, k]) replaces the top-k choice (the weights are still this run's
    probabilities of those experts): used to compare two runs under the same routing."""
    import jax
    from jax import lax
    jnp = _jnp()
    logits = jnp.dot(h.astype(jnp.float32), w_router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    if forced_ids is None:
        w, ids = lax.top_k(probs, top_k)
    else:
        ids = forced_ids
        w = jnp.take_along_axis(probs, ids, axis=-1)
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


def shared_expert(h, p):
    """The shared expert (every token, as in DeepSeek-V2/V3 and Qwen2-MoE): a SwiGLU of
    intermediate size cfg.shared_ffn; zero when the model has none. Low-latency layout: this
    rank's slice of the intermediate dimension (a partial sum, like the routed experts)."""
    if "sg" not in p:
        return 0
    jnp = _jnp()
    return swiglu(h, p["sg"], p["su"], p["sd"], jnp.dot)


def experts_dispatched(expert_x, expert_counts, wg, wu, wd):
    """This rank's experts over the dispatched rows [E_local, rows, hidden] (batched einsum);
    rows >= expert_counts[e] are unspecified on input and zeroed."""
    jnp = _jnp()
    rows = expert_x.shape[1]
    mask = (jnp.arange(rows, dtype=jnp.int32)[None, :] < expert_counts[:, None])[..., None]
    x = jnp.where(mask, expert_x, jnp.zeros((), expert_x.dtype))
    y = swiglu(x, wg, wu, wd, lambda a, b: jnp.einsum("erh,ehf->erf", a, b))
    return jnp.where(mask, y, jnp.zeros((), y.dtype))


def forward(x, params, caches, forced_ids=None, *, cfg, phase, ar_norm, moe):
    """The decoder stack on one rank. ar_norm(partial, residual, w) -> (normed, residual) ends
    every sub-layer; moe(h, topk_w, topk_ids, layer_params) -> MoE output (a partial sum in the
    low-latency layout). forced_ids: None, or int32 [layers, t, k] routing to use instead of
    the router's top-k. Returns (final normed hidden states, routing int32 [layers, t, k])."""
    jnp = _jnp()
    hd = cfg.hidden // cfg.heads
    layers = params["layers"]
    residual = x
    h = rms_norm(x.astype(jnp.float32), layers[0]["attn_norm"]).astype(x.dtype)
    routing = []
    for i, p in enumerate(layers):
        a = attention(h, p, caches[i] if phase == "decode" else None, hd, phase)
        h, residual = ar_norm(a, residual, p["moe_norm"])
        tw, ti = route(h, p["router"], cfg.top_k, None if forced_ids is None else forced_ids[i])
        routing.append(ti)
        m = moe(h, tw, ti, p)
        nxt = layers[i + 1]["attn_norm"] if i + 1 < len(layers) else params["final_norm"]
        h, residual = ar_norm(m, residual, nxt)
    return h, jnp.stack(routing)


def forward_dp_tp(x, num_rows, params, caches, forced_ids=None, *, cfg, phase, gather,
                  scatter, my_rows):
    """The decoder stack on one rank of the dp-attn-tp-moe layout: attention on this rank's
    own rows x [max_rows, hidden] (the first num_rows valid; prefill: causal, so the padding
    rows after them never reach a valid row), then per MoE:
        g, ctx = gather(h)            every rank's rows, [world * max_rows, hidden]
        router + this rank's slice of every expert (and of the shared expert) on g -> partial
        mine = scatter(y, ctx)        the sum over ranks of this rank's rows, [max_rows, hidden]
    then the residual add + RMSNorm locally. gather(a) -> (gathered, ctx), scatter(y, ctx) and
    my_rows(gathered_like, ctx) (this rank's rows of a gathered array) are the implementation's
    (dp_tp_collectives): rows of g past the valid ones are its business; every row's result
    depends only on that row.
    forced_ids: None or int32 [layers, max_rows, k] (this rank's rows). Returns (final normed
    hidden states, routing int32 [layers, max_rows, k]), both zero past num_rows so that two
    implementations compare on every row."""
    jnp = _jnp()
    hd = cfg.hidden // cfg.heads
    layers = params["layers"]
    max_rows = x.shape[0]
    valid = jnp.arange(max_rows, dtype=jnp.int32)[:, None] < num_rows
    residual = x
    h = rms_norm(x.astype(jnp.float32), layers[0]["attn_norm"]).astype(x.dtype)
    g_forced = None
    if forced_ids is not None:  # the forced routing of every rank's rows, gathered once
        g_forced, _ = gather(jnp.moveaxis(forced_ids, 0, 1))       # [W*max_rows, L, k]
    routing = []
    for i, p in enumerate(layers):
        a = attention(h, p, caches[i] if phase == "decode" else None, hd, phase)
        h, residual = add_rms_norm(a, residual, p["moe_norm"])
        g, ctx = gather(h)
        tw, ti = route(g, p["router"], cfg.top_k, None if g_forced is None else g_forced[:, i])
        y = experts_grouped(g, tw, ti, p["wg"], p["wu"], p["wd"]) + shared_expert(g, p)
        m = scatter(y, ctx)
        routing.append(jnp.where(valid, my_rows(ti, ctx), 0))
        nxt = layers[i + 1]["attn_norm"] if i + 1 < len(layers) else params["final_norm"]
        h, residual = add_rms_norm(m, residual, nxt)
    return jnp.where(valid, h, jnp.zeros((), h.dtype)), jnp.stack(routing)


def dp_tp_collectives(impl, axis, num_rows, max_rows, comm=None):
    """(gather, scatter, my_rows) of the dp-attn-tp-moe layout on one rank (inside shard_map
    over `axis`; num_rows: this rank's valid rows, traced int32; max_rows: the static capacity).
    jax_nvcomm: gathered, offsets, _ = nvc.all_gather_v(h, num_rows, comm) (each rank sends only
      its valid rows, packed in rank order; the tail is zero); nvc.reduce_scatter_v(y, offsets,
      comm) (each owner gets the float32 sum of its rows only).
    XLA: padded lax.all_gather (max_rows rows of every rank, rank r's at r * max_rows, padding
      included) and lax.psum_scatter of the partial results in that padded layout: what engines
      run when the buffers are sized to capacity (one all-gather and one reduce-scatter of
      world * max_rows rows; no count exchange, no compaction; the padding rows are computed and
      dropped). Of XLA's two choices it is the one to beat: zero-filled lax.psum of a
      [world * max_rows] buffer moves about twice the bytes of psum_scatter on the way back,
      and padded all_gather was XLA's best gather at every load of `bench varlen`
      (docs/perf/README.md)."""
    from jax import lax
    if impl == "jax_nvcomm":
        import jax_nvcomm as nvc

        def gather(a):
            g, offsets, _ = nvc.all_gather_v(a, num_rows, comm)
            return g, offsets

        def scatter(y, offsets):
            return nvc.reduce_scatter_v(y, offsets, comm)

        def my_rows(a, offsets):
            return lax.dynamic_slice_in_dim(a, offsets[lax.axis_index(axis)], max_rows, axis=0)
    elif impl == "none":  # the no-communication bound: the same shapes and compute, local
        import jax.numpy as jnp

        def gather(a):
            return jnp.concatenate([a] * lax.axis_size(axis), axis=0), None

        def my_rows(a, _):
            return lax.dynamic_slice_in_dim(a, lax.axis_index(axis) * max_rows, max_rows, axis=0)
        scatter = my_rows  # this rank's rows of the (locally complete) result
    else:
        def gather(a):
            return lax.all_gather(a, axis, tiled=True), None

        def scatter(y, _):
            return lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)

        def my_rows(a, _):
            return lax.dynamic_slice_in_dim(a, lax.axis_index(axis) * max_rows, max_rows, axis=0)
    return gather, scatter, my_rows


# --------------------------------------------------------------------------------------------
# weights, inputs, shardings

def param_specs(cfg, layout):
    from jax.sharding import PartitionSpec as P
    if layout == "low-latency":
        a = "tp"
        layer = dict(attn_norm=P(), moe_norm=P(), wq=P(None, a), wk=P(None, a), wv=P(None, a),
                     wo=P(a, None), router=P(), wg=P(None, None, a), wu=P(None, None, a),
                     wd=P(None, a, None))
        shared = dict(sg=P(None, a), su=P(None, a), sd=P(a, None))  # partial sums, like wd
    elif layout == "dp-attn-tp-moe":  # attention replicated (DP), experts sliced as in TP
        a = "dp"
        layer = dict(attn_norm=P(), moe_norm=P(), wq=P(), wk=P(), wv=P(), wo=P(), router=P(),
                     wg=P(None, None, a), wu=P(None, None, a), wd=P(None, a, None))
        shared = dict(sg=P(None, a), su=P(None, a), sd=P(a, None))
    else:
        a = "ep"
        layer = dict(attn_norm=P(), moe_norm=P(), wq=P(), wk=P(), wv=P(), wo=P(), router=P(),
                     wg=P(a), wu=P(a), wd=P(a))
        shared = dict(sg=P(), su=P(), sd=P())  # replicated: every rank its own tokens
    if cfg.shared_ffn:
        layer.update(shared)
    return dict(layers=[dict(layer) for _ in range(cfg.layers)], final_norm=P())


def init_params(cfg, mesh, layout):
    """Seeded random weights, generated on the devices (jax.random inside one jit whose
    out_shardings place each shard; threefry is partitionable, so the values depend neither on
    the layout nor on the number of devices). Same logical model in both layouts."""
    return _params_fn(_model_key(cfg), cfg.dtype, layout, mesh)()


def _model_key(cfg):
    return tuple(sorted(cfg.model_dict().items()))


@functools.lru_cache(maxsize=8)
def _params_fn(model, dtype, layout, mesh):
    import jax
    jnp = _jnp()
    from jax.sharding import NamedSharding
    m = dict(model)
    H, E, F, L = m["hidden"], m["experts"], m["ffn"], m["layers"]
    dt = jnp.dtype(dtype)

    def gen():
        key = jax.random.key(m["seed"])

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
            if m.get("shared_ffn"):  # own keys: the other weights keep their values
                Fs = m["shared_ffn"]
                kss = jax.random.split(jax.random.fold_in(key, (1 << 21) + i), 3)
                layers[-1].update(sg=normal(kss[0], (H, Fs), H), su=normal(kss[1], (H, Fs), H),
                                  sd=normal(kss[2], (Fs, H), Fs))
        fk = jax.random.fold_in(key, 1 << 20)
        return dict(layers=layers,
                    final_norm=(1.0 + 0.1 * jax.random.normal(fk, (H,))).astype(dt))

    cfg = Config(**m)
    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg, layout))
    return jax.jit(gen, out_shardings=shard)


def cache_specs(cfg, layout):
    from jax.sharding import PartitionSpec as P
    spec = P(None, None, "tp", None) if layout == "low-latency" else P(AXES[layout])
    return [(spec, spec)] * cfg.layers


def init_caches(cfg, mesh, layout, world):
    """Decode context: per layer (k, v) [batch, context, heads, head_dim], seeded random.
    Low-latency: batch = decode tokens (the same sequences on every rank), split over heads;
    high-throughput and dp-attn-tp-moe: batch = world * decode tokens, split over the batch (each rank its own
    sequences; rank r's block is drawn from the layer's key folded with r, for every world
    size including 1, so it does not depend on the world size: a reference stored by a run of
    another world size sees the same context on its ranks 0..min(world, ref world)-1)."""
    return _caches_fn(_model_key(cfg), cfg.dtype, layout, mesh, world)()


@functools.lru_cache(maxsize=8)
def _caches_fn(model, dtype, layout, mesh, world):
    import jax
    jnp = _jnp()
    from jax.sharding import NamedSharding
    m = dict(model)
    hd = m["hidden"] // m["heads"]
    shape = (m["decode_tokens"], m["context"], m["heads"], hd)
    dt = jnp.dtype(dtype)

    def gen():
        key = jax.random.fold_in(jax.random.key(m["seed"]), 2 << 20)
        out = []
        for i in range(m["layers"]):
            pair = []
            for j in range(2):
                k = jax.random.fold_in(key, 2 * i + j)
                if layout == "low-latency":  # one set of sequences, the same on every rank
                    v = jax.random.normal(k, shape)
                else:
                    # rank r's sequences from fold_in(k, r), also when world == 1 (a special
                    # case here made a 1-device reference's rank 0 differ from rank 0 of
                    # every larger world)
                    keys = jax.vmap(lambda r: jax.random.fold_in(k, r))(jnp.arange(world))
                    v = jax.vmap(lambda kk: jax.random.normal(kk, shape))(keys)
                    v = v.reshape((world * shape[0],) + shape[1:])
                pair.append(v.astype(dt))
            out.append(tuple(pair))
        return out

    specs = cache_specs(Config(**m), layout)
    shard = [tuple(NamedSharding(mesh, s) for s in pair) for pair in specs]
    return jax.jit(gen, out_shardings=shard)


def row_counts(cfg, layout, phase, world):
    """Valid rows per rank and the static capacity, (list of world ints, max_rows). Only the
    dp-attn-tp-moe prefill is unbalanced: rank 0 prefills `tokens` tokens while every other
    rank has min(decode_tokens, tokens) (standing in for ranks that decode), in buffers of
    `tokens` rows."""
    t = cfg.tokens if phase == "prefill" else cfg.decode_tokens
    if layout == "dp-attn-tp-moe" and phase == "prefill":
        return [t] + [min(cfg.decode_tokens, t)] * (world - 1), t
    return [t] * world, t


def input_host(cfg, layout, phase, world):
    """Token hidden states as float32 numpy (seeded; the same in every process). High-throughput
    and dp-attn-tp-moe layouts: rank r's rows are seeded by r, so they do not depend on the world
    size; dp-attn-tp-moe: rank r's valid rows (row_counts), then zeros up to max_rows."""
    import numpy as np
    counts, t = row_counts(cfg, layout, phase, world)
    seed = [cfg.seed, LAYOUTS.index(layout), PHASES.index(phase)]
    if layout == "low-latency":
        return np.random.default_rng(seed).standard_normal((t, cfg.hidden), np.float32)
    out = np.zeros((world, t, cfg.hidden), np.float32)
    for r in range(world):
        out[r, :counts[r]] = np.random.default_rng(seed + [r]).standard_normal(
            (counts[r], cfg.hidden), np.float32)
    return out.reshape(world * t, cfg.hidden)


def valid_rows(cfg, layout, phase, world):
    """Boolean mask of the valid rows of the global output (rank-major), or None (all)."""
    import numpy as np
    counts, t = row_counts(cfg, layout, phase, world)
    if layout == "low-latency" or min(counts) == t:
        return None
    return (np.arange(t)[None, :] < np.array(counts)[:, None]).reshape(-1)


def make_input(cfg, mesh, layout, phase, world):
    """The input as a global array built with jax.make_array_from_callback (works with several
    processes: each one fills its own shards); dp-attn-tp-moe: (rows, int32 [world] counts)."""
    import jax
    import numpy as np
    jnp = _jnp()
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    spec = P() if layout == "low-latency" else P(AXES[layout])
    host = input_host(cfg, layout, phase, world).astype(jnp.dtype(cfg.dtype))
    arr = jax.make_array_from_callback(host.shape, NamedSharding(mesh, spec),
                                       lambda idx: host[idx])
    if layout != "dp-attn-tp-moe":
        return arr, spec
    # (rows, per-rank row counts): the counts are an input, so one compiled program serves any
    counts = np.asarray(row_counts(cfg, layout, phase, world)[0], np.int32)
    nr = jax.make_array_from_callback(counts.shape, NamedSharding(mesh, spec),
                                      lambda idx: counts[idx])
    return (arr, nr), (spec, spec)


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
        from .. import reference
    except ImportError as e:
        raise Unavailable("the XLA side of the high-throughput layout needs "
                          f"jax_nvcomm.reference (moe_dispatch_xla / moe_combine_xla): {e}; run "
                          "with --layouts low-latency or --nvcomm-only") from e
    missing = [n for n in ("moe_dispatch_xla", "moe_combine_xla") if not hasattr(reference, n)]
    if missing:
        raise Unavailable(f"jax_nvcomm.reference lacks {', '.join(missing)}; run with "
                          "--layouts low-latency or --nvcomm-only")
    return reference.moe_dispatch_xla, reference.moe_combine_xla


def ragged_available(impls=IMPLS):
    """Unavailable unless the ep-ragged layout can run with `impls` (jax_nvcomm's side needs
    nvc.ragged_all_to_all)."""
    import jax_nvcomm as nvc
    if "jax_nvcomm" in impls and not hasattr(nvc, "ragged_all_to_all"):
        raise Unavailable("the ep-ragged layout needs jax_nvcomm.ragged_all_to_all, which this "
                          "build of jax_nvcomm does not have")


def ragged_collectives(impl, axis, comm):
    """The collectives of moe_ragged's layer in the ep-ragged layout: jax_nvcomm's, XLA's, or
    (impl "none", the no-communication bound) local stand-ins with the same shapes: every
    rank's group sizes taken to be this rank's, each exchange a local copy of the operand's
    leading rows into the output."""
    from jax import lax
    from . import moe_ragged
    if impl == "none":
        jnp = _jnp()

        def copy(operand, output, *_):
            n = min(operand.shape[0], output.shape[0])
            return lax.dynamic_update_slice_in_dim(output, operand[:n], 0, axis=0)
        return moe_ragged.Collectives(
            copy, lambda a: jnp.broadcast_to(a, (lax.axis_size(axis),) + a.shape),
            lambda a: a)
    return moe_ragged.collectives("nvc" if impl == "jax_nvcomm" else "lax", axis_name=axis,
                                  comm=comm)


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


def make_step(cfg, mesh, layout, phase, impl, comms, *, forced=False):
    """The step, jitted: (x, params, caches, forced_ids or ()) -> (final hidden states,
    routing [layers, tokens, top_k]), over the layout's mesh. forced: take the routing as an
    input instead of the router's top-k (for the comparison under identical routing)."""
    import jax
    import jax_nvcomm as nvc
    from jax.sharding import PartitionSpec as P
    if layout == "dp-attn-tp-moe":
        return _make_step_dp_tp(cfg, mesh, phase, impl, comms, forced)
    if layout == "ep-ragged":
        from . import moe_ragged
        axis, out_spec, r_spec = "ep", P("ep"), P(None, "ep")
        ar_norm = add_rms_norm  # data-parallel attention: no all-reduce
        coll = ragged_collectives(impl, axis, comms.get("ragged"))

        def moe(h, tw, ti, p):
            return moe_ragged.moe_experts(h, tw, ti, p["wg"], p["wu"], p["wd"], axis_name=axis,
                                          coll=coll) + shared_expert(h, p)
    elif layout == "low-latency":
        axis, out_spec, r_spec = "tp", P(), P()
        if impl == "jax_nvcomm":
            comm = comms["tp"]

            def ar_norm(x, r, w):
                return nvc.all_reduce_rms_norm(x, r, w, comm, eps=EPS)
        elif impl == "none":  # the no-communication bound (see Config.bound)
            ar_norm = add_rms_norm
        else:
            def ar_norm(x, r, w):
                return psum_rms_norm(x, r, w, axis)

        def moe(h, tw, ti, p):
            return experts_grouped(h, tw, ti, p["wg"], p["wu"], p["wd"]) + shared_expert(h, p)
    elif impl == "none":  # the no-communication bound (see Config.bound)
        axis, out_spec, r_spec = "ep", P("ep"), P(None, "ep")
        ar_norm = add_rms_norm

        def moe(h, tw, ti, p):
            # the dispatched layout's shapes, filled locally: every local expert gets this
            # rank's tokens in the first rows of its [world * tokens] capacity (the batched
            # expert einsum costs the same whatever the rows hold); no combine exchange
            from jax import lax
            jnp = _jnp()
            n_loc, (t, hid) = p["wg"].shape[0], h.shape
            rows = lax.axis_size(axis) * t
            ex = jnp.broadcast_to(jnp.pad(h, ((0, rows - t), (0, 0)))[None], (n_loc, rows, hid))
            y = experts_dispatched(ex, jnp.full((n_loc,), t, jnp.int32), p["wg"], p["wu"],
                                   p["wd"])
            return y[0, :t] + shared_expert(h, p)
    else:
        axis, out_spec, r_spec = "ep", P("ep"), P(None, "ep")
        ar_norm = add_rms_norm  # data-parallel attention: no all-reduce
        if impl == "jax_nvcomm":
            dispatch, combine, _ = nvc_moe_api()
            mc = comms[("ep", phase)]

            def moe(h, tw, ti, p):
                if cfg.split and cfg.shared_ffn:
                    # the shared expert runs while this rank's tokens travel: between the
                    # dispatch's send and receive halves (moe_overlap / after= tie it there)
                    sent = nvc.moe_dispatch_send(h, ti, mc)
                    (hs,) = nvc.moe_overlap(sent, h)
                    shared = shared_expert(hs, p)
                    d = nvc.moe_dispatch_recv(sent, mc, after=shared)
                else:
                    d = dispatch(h, ti, mc)
                    shared = shared_expert(h, p)
                y = experts_dispatched(d.expert_x, d.expert_counts, p["wg"], p["wu"], p["wd"])
                return combine(y, tw, d.handle, mc) + shared
        else:
            dispatch_xla, combine_xla = xla_moe_api()

            def moe(h, tw, ti, p):
                ex, counts, _, handle = dispatch_xla(h, ti, axis_name=axis,
                                                     num_experts=cfg.experts, impl="ragged")
                y = experts_dispatched(ex, counts, p["wg"], p["wu"], p["wd"])
                return combine_xla(y, tw, handle, axis_name=axis, num_experts=cfg.experts,
                                   impl="ragged") + shared_expert(h, p)

    def body(x, params, caches, forced_ids):
        return forward(x, params, caches, forced_ids if forced else None, cfg=cfg, phase=phase,
                       ar_norm=ar_norm, moe=moe)

    x_spec = P() if layout == "low-latency" else P("ep")
    in_specs = (x_spec, param_specs(cfg, layout),
                cache_specs(cfg, layout) if phase == "decode" else (), r_spec if forced else ())
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                                 out_specs=(out_spec, r_spec), check_vma=impl != "none"))


def _make_step_dp_tp(cfg, mesh, phase, impl, comms, forced):
    """make_step of the dp-attn-tp-moe layout: x is (rows [world * max_rows, hidden], counts
    int32 [world]), both split over "dp"."""
    import jax
    from jax.sharding import PartitionSpec as P
    axis = AXES["dp-attn-tp-moe"]
    comm = comms.get("dp") if impl == "jax_nvcomm" else None

    def body(x, params, caches, forced_ids):
        rows, counts = x
        g, s, mine = dp_tp_collectives(impl, axis, counts[0], rows.shape[0], comm)
        return forward_dp_tp(rows, counts[0], params, caches, forced_ids if forced else None,
                             cfg=cfg, phase=phase, gather=g, scatter=s, my_rows=mine)

    spec, r_spec = P(axis), P(None, axis)
    in_specs = ((spec, spec), param_specs(cfg, "dp-attn-tp-moe"),
                cache_specs(cfg, "dp-attn-tp-moe") if phase == "decode" else (),
                r_spec if forced else ())
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                                 out_specs=(spec, r_spec), check_vma=impl != "none"))


def nvc_op_name(cfg, layout, phase, comms, world):
    """What jax_nvcomm runs for this step (for the table)."""
    import jax_nvcomm as nvc
    jnp = _jnp()
    if "jax_nvcomm" not in cfg.impls:
        return "-"
    if layout == "high-throughput":
        return ("split dispatch+combine" if cfg.split and cfg.shared_ffn
                else "dispatch+combine")
    if layout == "ep-ragged":
        return "ragged_all_to_all x2" + (" (xla)" if comms["ragged"].xla_fallback else "")
    if layout == "dp-attn-tp-moe":
        from .. import varlen
        comm = comms.get("dp")
        _, t = row_counts(cfg, layout, phase, world)
        row = cfg.hidden * jnp.dtype(cfg.dtype).itemsize
        kernel = (comm is not None and world > 1 and not comm.xla_fallback
                  and varlen.fits(comm, t, row) and row % 16 == 0)
        return "AG_v+RS_v" + ("" if kernel else " (xla)")
    comm = comms.get("tp")
    if comm is None:
        return "-"
    t = cfg.tokens if phase == "prefill" else cfg.decode_tokens
    return "AR+norm " + nvc.select_strategy(comm, (t, cfg.hidden), jnp.dtype(cfg.dtype),
                                            op="all_reduce_rms_norm")


# --------------------------------------------------------------------------------------------
# results to process 0 (no XLA collectives: works where NCCL cannot run)

_kv_seq = [0]


def _kv_prefix(what):
    _kv_seq[0] += 1  # every process makes the same calls in the same order
    return f"jax_nvcomm_demo/{_kv_seq[0]}/{what}"


def to_host0(arr, dtype="float32"):
    """The full value of a global array as numpy `dtype` on process 0 (None elsewhere).
    Several processes: each one publishes the blocks it holds the primary copy of
    (replica_id 0), and a manifest of them, in the distributed key-value store."""
    import jax
    import numpy as np
    dtype = np.dtype(dtype)
    if jax.process_count() == 1:
        return np.asarray(arr).astype(dtype)
    from .. import _exchange
    prefix = _kv_prefix("gather")
    chunk = 1 << 20
    me = jax.process_index()
    if me != 0:
        manifest = []
        for j, s in enumerate(arr.addressable_shards):
            if s.replica_id != 0:
                continue
            data = np.ascontiguousarray(np.asarray(s.data).astype(dtype)).tobytes()
            n = max(1, -(-len(data) // chunk))
            for i in range(n):
                _exchange.put(f"{prefix}/{me}/{j}/{i}", data[i * chunk:(i + 1) * chunk])
            idx = [[sl.start, sl.stop] for sl in
                   (tuple(s.index) + (slice(None),) * (arr.ndim - len(s.index)))]
            manifest.append([j, n, idx])
        _exchange.put(f"{prefix}/{me}/manifest", json.dumps(manifest).encode())
        return None
    out = np.zeros(arr.shape, dtype)
    for s in arr.addressable_shards:
        out[s.index] = np.asarray(s.data).astype(dtype)
    for p in range(1, jax.process_count()):
        manifest = json.loads(_exchange.get(f"{prefix}/{p}/manifest", 300,
                                            f"process {p}'s results").decode())
        for j, n, idx in manifest:
            data = b"".join(_exchange.get(f"{prefix}/{p}/{j}/{i}", 300, "a result shard")
                            for i in range(n))
            sl = tuple(slice(lo, hi) for lo, hi in idx)
            out[sl] = np.frombuffer(data, dtype).reshape(out[sl].shape)
    return out


def from_host0(value):
    """A small JSON value decided on process 0, for every process."""
    import jax
    if jax.process_count() == 1:
        return value
    from .. import _exchange
    key = _kv_prefix("bcast")
    if jax.process_index() == 0:
        _exchange.put(key, json.dumps(value).encode())
        return value
    return json.loads(_exchange.get(key, 300, "process 0's decision").decode())


def compare(a, b):
    """(relative L2 error, max abs error) of a against b, in float64."""
    import numpy as np
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    den = max(float(np.linalg.norm(b)), 1e-30)
    return float(np.linalg.norm(a - b)) / den, float(np.max(np.abs(a - b)))


def routing_diff(a, b):
    """Fraction of (layer, token) routing decisions whose expert sets differ; a, b: [L, t, k]."""
    import numpy as np
    return float(np.mean(np.any(np.sort(a, -1) != np.sort(b, -1), axis=-1)))


# --------------------------------------------------------------------------------------------
# running

class Progress:
    def __init__(self, total, enabled):
        self.total, self.enabled, self.t0 = total, enabled, time.perf_counter()

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


def _time_interleaved(fns, args, warmup, iters):
    """{name: median ms} of compiled steps timed in turns (one step of each per round, the
    order reversed every other round), so that drift of the machine (clocks, the other
    process, the host) falls on every implementation alike."""
    import jax
    for _ in range(warmup):
        for f in fns.values():
            jax.block_until_ready(f(*args))
    ts = {k: [] for k in fns}
    order = list(fns)
    for i in range(iters):
        for k in (order if i % 2 == 0 else order[::-1]):
            t = time.perf_counter()
            jax.block_until_ready(fns[k](*args))
            ts[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in ts.items()}


def _trace_row(fn, args, trace_dir, name, main_proc):
    """Profile 4 steps (every process runs them; process 0 records) and summarise them
    (jax_nvcomm/_trace.py); None on the other processes."""
    import jax
    from .. import _trace
    if not main_proc:
        for _ in range(4):
            jax.block_until_ready(fn(*args))
        return None
    path = _trace.record(fn, args, os.path.join(trace_dir, name), steps=4)
    if not path:
        return None
    s = _trace.summarise(path)
    if s is not None:  # the other local devices against device 0 (one process, several GPUs)
        others = [d.id for d in jax.local_devices()][1:]
        if others:
            s["skew"] = _trace.device_skew(path, range(len(others) + 1))
    return s


def _xla_variants(cfg, timed, args, row, prog, make_xla):
    """The XLA step compiled with each of cfg.xla_variants' flag sets, run once (a flag that
    fails at run time is reported in row["xla_best"]["errors"] and left out), into `timed`
    as "xla+<label>"."""
    import jax
    row["xla_best"] = dict(errors={})
    tries = cfg.xla_variants(timed["xla"])
    if not tries:
        return
    fn = make_xla()
    for label, opts in tries:
        prog.line(f"compiling the XLA step with {label} ({opts})...")
        try:
            c = fn.lower(*args).compile(compiler_options=opts)
            jax.block_until_ready(c(*args))
            timed[f"xla+{label}"] = c
        except Exception as e:  # noqa: BLE001 - XLA's own errors; the others still run
            text = str(e).strip().splitlines()
            first = text[0][:200] if text else ""
            row["xla_best"]["errors"][label] = f"{type(e).__name__}: {first}"


def run(cfg: Config, *, devices=None):
    """Run every requested (layout, phase, impl) step, time it, and compare the results.

    Comparison: the candidate (jax_nvcomm, or the XLA side with --xla-only) against each
    baseline (the XLA side when both ran; the stored reference with --ref). When the two
    runs routed some token to other experts (near-tied top-k scores, rounded differently:
    expected in bfloat16), the candidate is run once more with the baseline's routing forced
    and that output is compared; the fraction of differing routing decisions is reported.

    Returns a dict: "rows" (one per layout x phase: ms per impl, errors, routing difference,
    agreement), "ok" (no comparison disagreed), "config" (resolved), "world", "platform",
    "processes", "elapsed". Prints only progress lines (stderr, process 0)."""
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
    if "ep-ragged" in cfg.layouts:
        ragged_available(cfg.impls)
    ref = load_ref(cfg.ref, cfg) if cfg.ref else None
    tol = TOLERANCE[cfg.dtype]
    if ref is not None:
        tol_ref = max(tol, TOLERANCE[ref["dtype"]])

    meshes = {lay: Mesh(np.array(all_devs), (AXES[lay],)) for lay in LAYOUTS}
    dt = jnp.dtype(cfg.dtype)
    comms = {}
    steps = [(lay, ph, impl) for lay in cfg.layouts for ph in cfg.phases for impl in cfg.impls]
    prog = Progress(len(steps), main_proc and not cfg.quiet)
    prog.line(f"{world} x {platform} devices, {jax.process_count()} process(es); "
              f"{cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, {cfg.experts} "
              f"experts top-{cfg.top_k}, ffn {cfg.ffn}, {cfg.dtype}")
    rows, saved = [], {}
    ok = True
    try:
        if "jax_nvcomm" in cfg.impls:
            tmax = max(cfg.tokens if "prefill" in cfg.phases else 0,
                       cfg.decode_tokens if "decode" in cfg.phases else 0)
            if "low-latency" in cfg.layouts:
                mmb = max(4096, -(-tmax * cfg.hidden * dt.itemsize // 4096) * 4096)
                comms["tp"] = nvc.Communicator(meshes["low-latency"], "tp",
                                               max_message_bytes=mmb)
            if "dp-attn-tp-moe" in cfg.layouts:
                # all_gather_v's gathered buffer, world * max_rows rows, must fit
                rmax = max(row_counts(cfg, "dp-attn-tp-moe", ph, world)[1] for ph in cfg.phases)
                need = world * rmax * cfg.hidden * dt.itemsize
                comms["dp"] = nvc.Communicator(
                    meshes["dp-attn-tp-moe"], "dp",
                    max_message_bytes=max(4096, -(-need // 4096) * 4096))
            if "ep-ragged" in cfg.layouts:
                from . import moe_ragged
                comms["ragged"] = nvc.Communicator(
                    meshes["ep-ragged"], "ep", max_message_bytes=moe_ragged.comm_bytes(
                        tmax, cfg.top_k, cfg.experts, world, cfg.hidden, dt))
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
            prog.line(f"initialising {layout} weights" +
                      (" and decode context" if "decode" in cfg.phases else "") + "...")
            params = init_params(cfg, mesh, layout)
            caches = init_caches(cfg, mesh, layout, world) if "decode" in cfg.phases else None
            for phase in cfg.phases:
                x, _ = make_input(cfg, mesh, layout, phase, world)
                cs = caches if phase == "decode" else ()
                counts, t = row_counts(cfg, layout, phase, world)
                vmask = valid_rows(cfg, layout, phase, world)
                row = dict(layout=layout, phase=phase, tokens=t, ms={}, err=None, maxabs=None,
                           counts=counts,
                           routing=None, ref_err=None, ref_routing=None, ref_note=None,
                           agree=None, op=nvc_op_name(cfg, layout, phase, comms, world))
                res, timed = {}, {}
                for impl in cfg.impls:
                    n += 1
                    what = f"{layout} {phase} ({impl})"
                    prog.line(f"compiling {what}...", n)
                    fn = make_step(cfg, mesh, layout, phase, impl, comms)
                    compiled = fn.lower(x, params, cs, ()).compile()
                    timed[impl] = compiled
                    prog.line(f"running {what}: {cfg.warmup} warm-up + {cfg.iters} timed "
                              "steps...", n)
                    (h, ids), sec = _time_step(compiled, (x, params, cs, ()), cfg.warmup,
                                               cfg.iters)
                    row["ms"][impl] = sec * 1e3
                    if cfg.trace_dir:
                        row.setdefault("trace", {})[impl] = _trace_row(
                            compiled, (x, params, cs, ()), cfg.trace_dir,
                            f"{layout}_{phase}_{impl}", main_proc)
                    res[impl] = dict(ids=ids, rows=h.shape[0], h_np=to_host0(h),
                                     ids_np=to_host0(ids, "int32"))
                    prog.line(f"{what}: {sec * 1e3:.3f} ms/step", n)
                if cfg.xla_variants is not None and "xla" in timed:
                    _xla_variants(cfg, timed, (x, params, cs, ()), row, prog,
                                  lambda: make_step(cfg, mesh, layout, phase, "xla", comms))
                if cfg.bound:
                    timed["none"] = make_step(cfg, mesh, layout, phase, "none", comms).lower(
                        x, params, cs, ()).compile()
                if len(timed) > 1:  # the reported times: all of the row's steps in turns
                    prog.line(f"{layout} {phase}: {' / '.join(timed)} in turns, "
                              f"{cfg.iters} steps each...")
                    row["ms_sequential"] = dict(row["ms"])
                    row["ms"].update(_time_interleaved(timed, (x, params, cs, ()),
                                                       cfg.warmup, cfg.iters))
                if "xla_best" in row:  # the fastest XLA step, flags or not
                    ks = [k for k in row["ms"] if k == "xla" or k.startswith("xla+")]
                    k = min(ks, key=row["ms"].get)
                    row["xla_best"].update(ms=row["ms"][k],
                                           flags="default" if k == "xla" else k[4:],
                                           variants={v: row["ms"][v] for v in ks})
                del timed
                cand = "jax_nvcomm" if "jax_nvcomm" in res else "xla"
                base = res[cand] if cand == "xla" or "xla" not in res else res["xla"]
                saved[(layout, phase)] = (base["h_np"], base["ids_np"])

                forced_fn = []  # compiled once per row, if needed

                def check(b_h, b_ids, b_ids_global, label):
                    """(rel L2 err, max abs err, routing diff) of the candidate vs a baseline
                    (process 0; None elsewhere), over the first rows both have."""
                    c = res[cand]
                    rows_n = from_host0(None if b_h is None else min(len(b_h), c["rows"]))
                    same = from_host0(None if c["ids_np"] is None else bool(np.array_equal(
                        c["ids_np"][:, :rows_n], b_ids[:, :rows_n])))
                    if same:
                        out = c["h_np"]
                    else:
                        prog.line(f"{layout} {phase}: routing differs from {label}; running "
                                  f"{cand} with {label}'s routing for the comparison...")
                        if not forced_fn:
                            forced_fn.append(make_step(cfg, mesh, layout, phase, cand, comms,
                                                       forced=True))
                        out = to_host0(forced_fn[0](x, params, cs, b_ids_global())[0])
                    if not main_proc:
                        return None
                    # only the valid rows (dp-attn-tp-moe: each rank's first counts[r])
                    v = slice(None) if vmask is None else vmask[:rows_n]
                    e, m = compare(out[:rows_n][v], b_h[:rows_n][v])
                    return e, m, routing_diff(c["ids_np"][:, :rows_n][:, v],
                                              b_ids[:, :rows_n][:, v])

                checks = []
                if cand == "jax_nvcomm" and "xla" in res:
                    r = check(res["xla"]["h_np"], res["xla"]["ids_np"], lambda: res["xla"]["ids"],
                              "XLA")
                    if r is not None:
                        row["err"], row["maxabs"], row["routing"] = r
                        checks.append(row["err"] < tol)
                if ref is not None:
                    r_h, r_ids = ref["out"][(layout, phase)]
                    own = res[cand]["ids"]

                    def ref_ids_global():
                        # the reference's routing for the rows it has, ours for the others
                        # (a high-throughput reference of fewer ranks)
                        full = np.zeros(own.shape, np.int32)
                        m = min(own.shape[1], r_ids.shape[1])
                        full[:, :m] = r_ids[:, :m]
                        arr = jax.make_array_from_callback(full.shape, own.sharding,
                                                           lambda idx: full[idx])
                        keep = jax.jit(lambda o, f: jnp.where(
                            jnp.arange(o.shape[1])[None, :, None] < m, f, o),
                            out_shardings=own.sharding)
                        return keep(own, arr)

                    r = check(r_h, r_ids, ref_ids_global, "the reference")
                    if r is not None:
                        row["ref_err"], _, row["ref_routing"] = r
                        m = min(len(r_h), res[cand]["rows"])
                        if m < max(len(r_h), res[cand]["rows"]):
                            row["ref_note"] = f"ranks 0-{m // t - 1}"
                        checks.append(row["ref_err"] < tol_ref)
                if main_proc and checks:
                    errs = [e for e in (row["err"], row["ref_err"]) if e is not None]
                    row["agree"] = all(checks) and all(math.isfinite(e) for e in errs)
                    ok &= row["agree"]
                rows.append(row)
                del res
    finally:
        for c in comms.values():
            c.close()

    if main_proc and cfg.save_ref:
        save_ref(cfg.save_ref, cfg, world, saved)
        prog.line(f"saved final hidden states and routing to {cfg.save_ref}")
    return dict(rows=rows, ok=ok, config=cfg, world=world, platform=platform,
                processes=jax.process_count(), elapsed=time.perf_counter() - prog.t0)


def save_ref(path, cfg, world, saved):
    """Final hidden states (float32) and routing (int32 [layers, tokens, top_k]) per layout
    and phase, from the XLA side when it ran, with the model configuration."""
    import numpy as np
    arrays = {}
    for (layout, phase), (h, ids) in saved.items():
        arrays[f"{layout}/{phase}/hidden"] = np.asarray(h, np.float32)
        arrays[f"{layout}/{phase}/routing"] = np.asarray(ids, np.int32)
    meta = dict(cfg.model_dict(), world=world, dtype=cfg.dtype, format=REF_FORMAT)
    with open(path, "wb") as f:  # np.savez would append .npz to a name without it
        np.savez(f, __meta__=np.array(json.dumps(meta)), **arrays)


def load_ref(path, cfg):
    """The stored reference, checked against this run's model configuration (the world size
    may differ: the low-latency layout's results do not depend on it, and the high-throughput
    layout's rank r tokens are seeded by r, so the first min(world, ref world) ranks compare)."""
    import numpy as np
    try:
        with np.load(path) as z:
            meta = json.loads(str(z["__meta__"]))
            arrays = {k: z[k] for k in z.files if k != "__meta__"}
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError(f"--ref {path}: not a reference file of this program ({e})") from e
    want = cfg.model_dict()
    diff = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
    if diff:
        raise ConfigError(f"--ref {path} was made with another configuration: " + ", ".join(
            f"{k} {a} (ref) vs {b} (now)" for k, (a, b) in diff.items()))
    out = {}
    for lay in cfg.layouts:
        for ph in cfg.phases:
            h, ids = arrays.get(f"{lay}/{ph}/hidden"), arrays.get(f"{lay}/{ph}/routing")
            if h is None or ids is None:
                raise ConfigError(f"--ref {path} has no {lay} {ph} results")
            out[(lay, ph)] = (h, ids)
    if (meta.get("format", 1) < 2 and meta.get("world") == 1 and "high-throughput" in cfg.layouts
            and "decode" in cfg.phases):
        raise ConfigError(f"--ref {path} is a 1-device reference made by an older version, "
                          "whose high-throughput decode context differs from rank 0's of other "
                          "world sizes; store it again with --save-ref")
    return dict(out=out, dtype=meta["dtype"], world=meta.get("world"))


# --------------------------------------------------------------------------------------------
# output

def tokens_label(r) -> str:
    """'128' (every rank), or '128/4' (rank 0 / the others: dp-attn-tp-moe prefill)."""
    c = r.get("counts") or [r["tokens"]]
    return str(c[0]) if len(set(c)) == 1 else f"{c[0]}/{c[1]}"


def format_table(res) -> str:
    cfg = res["config"]
    tol = TOLERANCE[cfg.dtype]
    rows = res["rows"]
    has_ref = any(r["ref_err"] is not None for r in rows)
    has_cmp = any(r["err"] is not None for r in rows)
    f = lambda v, fmt: "-" if v is None else format(v, fmt)
    pct = lambda v: "-" if v is None else "0" if v == 0 else f"{100 * v:.1f}%"
    head = ["layout", "phase", "tokens/rank", "jax_nvcomm op", "ms jax_nvcomm", "ms XLA",
            "XLA/nvcomm"]
    if has_cmp:
        head += ["rel L2 err", "max abs err", "routing diff"]
    if has_ref:
        head += ["vs ref", "routing diff vs ref"]
    head += ["agree"]
    body = []
    for r in rows:
        a, b = r["ms"].get("jax_nvcomm"), r["ms"].get("xla")
        cells = [r["layout"], r["phase"], tokens_label(r), r["op"], f(a, ".3f"), f(b, ".3f"),
                 f"{b / a:.2f}x" if a and b else "-"]
        if has_cmp:
            cells += [f(r["err"], ".1e"), f(r["maxabs"], ".1e"), pct(r["routing"])]
        if has_ref:
            cells += [f(r["ref_err"], ".1e") + (f" ({r['ref_note']})" if r["ref_note"] else ""),
                      pct(r["ref_routing"])]
        cells += ["-" if r["agree"] is None else "yes" if r["agree"] else "NO"]
        body.append(cells)
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
    out.append(f"ms: median of {cfg.iters} steps after {cfg.warmup} warm-up. XLA/nvcomm > 1: "
               "jax_nvcomm faster.")
    if res["platform"] == "cpu":
        out.append("CPU devices: these timings mean nothing for GPUs (the host backend and XLA "
                   "share this machine's cores); they show that the code runs. The agreement "
                   "columns hold on any device.")
    if not (has_cmp or has_ref):
        out.append("no comparison: only one side ran (--ref FILE.npz compares with a run stored "
                   "by --save-ref)")
    else:
        if any(r["ref_note"] for r in rows):
            out.append("vs ref (ranks a-b): the reference has another world size; only those "
                       "ranks' tokens (high-throughput: rank r's tokens and decode context are "
                       "seeded by r) are compared.")
        out.append(f"err: final hidden states, ||a-b||/||b||; agree: rel L2 err < {tol:g} "
                   f"({cfg.dtype}). routing diff: share of (layer, token) top-k choices that "
                   "differ; where any does, the errors are measured with the baseline's routing "
                   "forced on jax_nvcomm.")
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


RAGGED_NCCL_FLAG = "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true"


def allow_ragged_nccl_fallback() -> None:
    """One process per GPU: XLA runs `lax.ragged_all_to_all` through its own one-process
    kernel only when one process drives every GPU; across processes it refuses ("RaggedAllToAll
    fallback to NCCL is not allowed") unless this flag lets it use NCCL send/recv, which is
    what a multi-host user of XLA's path must set too. Set before the backend starts, unless
    the user's XLA_FLAGS already say otherwise."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "ragged_all_to_all_nccl_send_recv_fallback" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + RAGGED_NCCL_FLAG).strip()


def setup_platform(cpu_devices: int = 8) -> None:
    """Before any JAX backend starts: join the launcher's job if started by it; otherwise,
    without a GPU, use `cpu_devices` CPU host devices."""
    if os.environ.get("JAX_NVCOMM_LAUNCHED") == "1":  # a rank of `python -m jax_nvcomm.launch`
        import jax_nvcomm as nvc
        allow_ragged_nccl_fallback()
        nvc.distributed_initialize()
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


_NOT_SHOWN = ("iters", "dtype", "heads")


def arg_parser(prog=None) -> argparse.ArgumentParser:
    """The command line of the example (`python -m jax_nvcomm.demo --help`)."""
    p = argparse.ArgumentParser(
        prog=prog, description="MoE decoder stack with jax_nvcomm vs XLA's collectives "
        "(low-latency TP layout, high-throughput DP-attention + EP layout, and opt-in "
        "dp-attn-tp-moe DP-attention + TP-MoE layout with unbalanced tokens per rank and "
        "ep-ragged DP-attention + dropless EP-MoE on ragged_all_to_all; decode and prefill). "
        "Sizes default to a small model on CPU and a Qwen3-MoE-like one on GPU.")
    g = p.add_argument_group("model (defaults: CPU {} / GPU {})".format(
        " ".join(f"{k}={v}" for k, v in CPU_DEFAULTS.items() if k not in _NOT_SHOWN),
        " ".join(f"{k}={v}" for k, v in GPU_DEFAULTS.items() if k not in _NOT_SHOWN)))
    g.add_argument("--layers", type=int, help="decoder layers")
    g.add_argument("--hidden", type=int, help="hidden size (model width)")
    g.add_argument("--heads", type=int, help="attention heads (default: max(8, hidden/128), "
                   "rounded up to a multiple of the world size for the low-latency layout)")
    g.add_argument("--experts", type=int, help="routed experts (a multiple of the world size)")
    g.add_argument("--top-k", dest="top_k", type=int, help="experts per token")
    g.add_argument("--ffn", type=int, help="intermediate size of one expert")
    g.add_argument("--shared-ffn", dest="shared_ffn", type=int,
                   help="intermediate size of the shared expert (0: none; default: --ffn's "
                        "default)")
    g.add_argument("--tokens", type=int, help="prefill tokens per rank")
    g.add_argument("--decode-tokens", dest="decode_tokens", type=int,
                   help="decode tokens (sequences) per rank")
    g.add_argument("--context", type=int, help="decode: length of the fixed K/V context")
    g.add_argument("--dtype", choices=("bfloat16", "float32", "float16"),
                   help="default: bfloat16 on GPU, float32 on CPU")
    g.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default: 0)")
    r = p.add_argument_group("run")
    r.add_argument("--devices", type=int, help="use the first N devices (default: all; "
                   "max(8, N) CPU devices when no GPU is present)")
    r.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS),
                   help="comma list of low-latency,high-throughput,dp-attn-tp-moe,ep-ragged "
                        "(default: the first two; opt-in: dp-attn-tp-moe, DP attention + TP MoE "
                        "with unbalanced rows per rank through all_gather_v / "
                        "reduce_scatter_v, whose CPU prefill alone takes about as long as the "
                        "two others; ep-ragged, DP attention + the dropless EP layer of "
                        "examples/moe_ragged.py on ragged_all_to_all)")
    r.add_argument("--phases", default=",".join(PHASES), help="which phases to run, a comma list of decode and prefill "
                   "(default: both)")
    r.add_argument("--iters", type=int, help="timed steps (default: 20 GPU, 5 CPU)")
    r.add_argument("--warmup", type=int, default=2,
                   help="untimed steps before the timed ones (default: 2)")
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
    sp = r.add_mutually_exclusive_group()
    sp.add_argument("--split", dest="split", action="store_true", default=None,
                    help="high-throughput: the shared expert between moe_dispatch_send and "
                         "moe_dispatch_recv (the default)")
    sp.add_argument("--no-split", dest="split", action="store_false",
                    help="high-throughput: fused moe_dispatch, the shared expert outside it "
                         "(for comparison: docs/guide.md, 'Overlapping the dispatch with compute')")
    return p


def parse_args(argv=None, prog=None) -> Config:
    p = arg_parser(prog)
    a = p.parse_args(argv)

    def split(s, allowed, flag):
        items = tuple(v.strip() for v in s.split(",") if v.strip())
        bad = [v for v in items if v not in allowed]
        if bad or not items:
            p.error(f"{flag}: expected a comma list of {','.join(allowed)}, got {s!r}")
        return tuple(v for v in allowed if v in items)

    impls = ("xla",) if a.xla_only else ("jax_nvcomm",) if a.nvcomm_only else IMPLS
    return Config(layers=a.layers, hidden=a.hidden, heads=a.heads, experts=a.experts,
                  top_k=a.top_k, ffn=a.ffn, shared_ffn=a.shared_ffn, tokens=a.tokens,
                  decode_tokens=a.decode_tokens,
                  context=a.context, devices=a.devices, dtype=a.dtype, iters=a.iters,
                  warmup=a.warmup, seed=a.seed,
                  layouts=split(a.layouts, LAYOUTS, "--layouts"),
                  phases=split(a.phases, PHASES, "--phases"), impls=impls, ref=a.ref,
                  save_ref=a.save_ref, plot=a.plot, quiet=a.quiet, split=a.split)


def main(argv=None, prog=None) -> int:
    """Command line entry point; returns the exit code (0: every comparison agreed, 1: one
    disagreed, 2: bad arguments or a missing part of the package)."""
    cfg = parse_args(argv, prog)
    setup_platform(max(8, cfg.devices or 0))
    import jax

    from .._platform import platform_lines
    if jax.process_index() == 0:
        print("\n".join(platform_lines(jax.devices())), flush=True)
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
