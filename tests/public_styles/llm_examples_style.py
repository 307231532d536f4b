"""A Qwen3 model (MoE and dense layers) written the way Google's jax-ml/jax-llm-examples writes
its models (`qwen3/qwen3_jax/model.py`; its other families share the MoE block and the norm);
our own code in that style, at small sizes.

What it imitates:
- An Explicit (x, y, z) mesh (`jax.make_mesh((1, 4, devices // 4), ("x", "y", "z"))`), a
  `ShardingRules` table of logical axes -> mesh axes (batch "x", attention heads "y", the dense
  MLP's ffw ("y", "z"), experts "z", the MoE's tensor axis "y") and `logical_to_physical`.
- The `einsum` helper (`jnp.einsum(..., out_sharding=...)`, also for an int8 `QuantArray`
  weight with its scale): attention's output projection and the MLP's down projection contract
  a sharded dimension into an output asked to be `P("x", None, None)`: XLA's partitioner
  inserts the all-reduce.
- `rms_norm`: `gamma * x / sqrt(mean(f32(x) ** 2) + eps)` cast to bfloat16 (the weight before
  the division).
- `moe_block`: the router under its own `jax.jit` (replicated routing), then `_expert_fn`, a
  `shard_map` over the model's mesh in which every device sees all tokens, masks the routed
  copies to its local experts, argsorts them, runs `lax.ragged_dot` on its local experts
  (`quant_moe`: int8 weights, the per-expert scale taken along the sorted rows), unpermutes,
  and ends in `psum` over ("z", "y") (`ep_strategy="decode"`) or, for `"prefill"`, a
  `psum_scatter(scatter_dimension=1, tiled=True)` over "y" of the padded hidden dim, a
  scatter-add unpermute and `psum` over "z"; outside, the slice to the hidden width and a
  `reshard`; the residual add and the next norm in `forward_layer`.
- `prefill()`: `jax.jit(forward, donate_argnums=..., out_shardings=...)(...)` written inline at
  every call (here `jit` is an argument, so that the same line runs with `nvc.jit`).

Left out: rotary embeddings, the KV cache and its quantization, the attention kernels, GQA
(as many kv heads as q heads), sampling, checkpoints. `forward` returns the logits and each
layer's k, v (what it returns without a cache).
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, reshard
from jax.sharding import PartitionSpec as P

BATCH_AXIS_NAME = "x"
EXPERT_AXIS_NAME = "z"
TENSOR_ONLY_AXIS_NAME = "y"
ATTN_HEADS_AXIS_NAME = "y"
TENSOR_AXIS_NAME = ("y", "z")
PAD_ID = 0

TRACES = {"forward": 0}   # how many times `forward` was traced (a Python side effect)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    batch: object = BATCH_AXIS_NAME
    sequence: object = None
    act_embed: object = None
    act_heads: object = None
    head_dim: object = None
    qkv_embed: object = None
    q_heads: object = ATTN_HEADS_AXIS_NAME
    o_heads: object = ATTN_HEADS_AXIS_NAME
    o_embed: object = None
    mlp_up_embed: object = None
    mlp_up_ffw: object = TENSOR_AXIS_NAME
    mlp_down_ffw: object = TENSOR_AXIS_NAME
    mlp_down_embed: object = None
    moe_e_experts: object = EXPERT_AXIS_NAME
    moe_e_up_embed: object = None
    moe_e_up_ffw: object = TENSOR_ONLY_AXIS_NAME
    moe_e_down_ffw: object = TENSOR_ONLY_AXIS_NAME
    moe_e_down_embed: object = None
    moe_e_tp: object = TENSOR_ONLY_AXIS_NAME
    moe_e_ep: object = EXPERT_AXIS_NAME
    vocab_in: object = None
    vocab_out: object = TENSOR_AXIS_NAME


def logical_to_physical(logical, rules: ShardingRules) -> P:
    spec = [getattr(rules, axis) if axis is not None else None for axis in logical]
    flat = jax.tree.leaves(spec)
    if len(set(flat)) != len(flat):
        raise ValueError(f"Colliding physical axes from translating logical spec {logical} -> "
                         f"{spec}")
    return P(*spec)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Config:
    embed: int = 256
    q_heads: int = 8
    num_layers: int = 2
    head_dim: int = 32
    vocab_size: int = 512
    moe_ffw_size: int = 128
    moe_experts_per_tok: int = 2
    moe_num_experts: int = 8
    ep_strategy: str = "decode"
    mlp_ffw_size: int = 512
    mlp_layer_idxs: tuple = ()          # the dense layers; the others MoE
    dtype: object = jnp.bfloat16
    norm_eps: float = 1e-6
    rules: ShardingRules = ShardingRules()
    mesh: object = None
    quant_moe: bool = False


def make_mesh(devices=None):
    devices = jax.devices() if devices is None else list(devices)
    n = len(devices)
    y = 4 if n % 4 == 0 else n
    return jax.make_mesh((1, y, n // y), ("x", "y", "z"), devices=devices,
                         axis_types=(AxisType.Explicit,) * 3)


# --------------------------------------------------------------------------- weights
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantArray:
    quant: jax.Array
    scale: jax.Array
    out_scaling: bool = dataclasses.field(default=False, metadata=dict(static=True))
    scale_expand_dims: tuple = dataclasses.field(default=(), metadata=dict(static=True))
    shape = property(lambda self: self.quant.shape)
    ndim = property(lambda self: self.quant.ndim)


def quantize(x, axis, scale_dtype=jnp.bfloat16):
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    axis = tuple(a % x.ndim for a in axis)
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    scale = (amax / 127.0 + jnp.finfo(scale_dtype).tiny).astype(scale_dtype)
    quant = jnp.round(x / scale).astype(jnp.int8)
    return quant, scale.reshape([z for i, z in enumerate(scale.shape) if i not in axis])


def einsum(subscripts, lhs, rhs, out_sharding=None):
    """jnp.einsum for plain arrays and QuantArrays."""
    if isinstance(rhs, QuantArray):
        scale = jnp.expand_dims(rhs.scale, rhs.scale_expand_dims)
        if rhs.out_scaling:
            return jnp.einsum(subscripts, lhs, rhs.quant, out_sharding=out_sharding) * scale
        return jnp.einsum(subscripts, lhs * scale, rhs.quant, out_sharding=out_sharding)
    return jnp.einsum(subscripts, lhs, rhs, out_sharding=out_sharding)


# logical axes of every weight
_ATTN = {"q": ("qkv_embed", "q_heads", "head_dim"), "k": ("qkv_embed", "q_heads", "head_dim"),
         "v": ("qkv_embed", "q_heads", "head_dim"), "o": ("o_heads", "head_dim", "o_embed"),
         "q_gamma": ("head_dim",), "k_gamma": ("head_dim",)}
_MLP = {"w_gate": ("mlp_up_embed", "mlp_up_ffw"), "w_up": ("mlp_up_embed", "mlp_up_ffw"),
        "w_down": ("mlp_down_ffw", "mlp_down_embed")}
_MOE = {"w_router": ("moe_e_up_embed", None),
        "we_gate": ("moe_e_experts", "moe_e_up_embed", "moe_e_up_ffw"),
        "we_up": ("moe_e_experts", "moe_e_up_embed", "moe_e_up_ffw"),
        "we_down": ("moe_e_experts", "moe_e_down_ffw", "moe_e_down_embed")}


def init_weights_host(key, cfg: Config):
    """init_weights' values as numpy arrays, and the NamedSharding of each (two trees of the
    same structure): the same in every process, made without a collective (call it outside a
    mesh context); place them with `jax.make_array_from_callback` or `jax.device_put`."""
    d, h, q = cfg.embed, cfg.q_heads, cfg.head_dim
    keys = iter(jax.random.split(key, 8 + 16 * cfg.num_layers))

    def put(shape, logical, scale, dtype=None):
        host = np.asarray(jax.random.normal(next(keys), shape, jnp.float32)) * scale
        sh = jax.sharding.NamedSharding(cfg.mesh, logical_to_physical(logical, cfg.rules))
        return host.astype(dtype or cfg.dtype), sh

    def gamma(n, logical):
        host, sh = put((n,), logical, 0.1)
        return host + np.ones((), cfg.dtype), sh

    shapes = {"q": (d, h, q), "k": (d, h, q), "v": (d, h, q), "o": (h, q, d)}
    w = {"embedding": put((cfg.vocab_size, d), ("vocab_in", "act_embed"), 1.0),
         "gamma_final": gamma(d, ("act_embed",)),
         "lm_head": put((d, cfg.vocab_size), ("act_embed", "vocab_out"), d ** -0.5),
         "layers": []}
    for idx in range(cfg.num_layers):
        lp = {k: put(s, _ATTN[k], s[0] ** -0.5 if k != "o" else (h * q) ** -0.5)
              for k, s in shapes.items()}
        lp["q_gamma"], lp["k_gamma"] = gamma(q, ("head_dim",)), gamma(q, ("head_dim",))
        lp["attn_pre_gamma"] = gamma(d, ("act_embed",))
        lp["attn_post_gamma"] = gamma(d, ("act_embed",))
        if idx in cfg.mlp_layer_idxs:
            f = cfg.mlp_ffw_size
            lp["ffw"] = {"w_gate": put((d, f), _MLP["w_gate"], d ** -0.5),
                         "w_up": put((d, f), _MLP["w_up"], d ** -0.5),
                         "w_down": put((f, d), _MLP["w_down"], f ** -0.5)}
        else:
            e, f = cfg.moe_num_experts, cfg.moe_ffw_size
            ffw = {"w_router": put((d, e), _MOE["w_router"], d ** -0.5),
                   "we_gate": put((e, d, f), _MOE["we_gate"], d ** -0.5),
                   "we_up": put((e, d, f), _MOE["we_up"], d ** -0.5),
                   "we_down": put((e, f, d), _MOE["we_down"], f ** -0.5)}
            if cfg.quant_moe:
                for k in ("we_gate", "we_up", "we_down"):
                    host, sh = ffw[k]
                    quant, scale = (np.asarray(a) for a in quantize(jnp.asarray(host), 1))
                    logical = _MOE[k]
                    scale_sh = jax.sharding.NamedSharding(
                        cfg.mesh, logical_to_physical((logical[0], logical[2]), cfg.rules))
                    ffw[k] = QuantArray(quant, scale), QuantArray(sh, scale_sh)
            lp["ffw"] = ffw
        w["layers"].append(lp)
    pair = lambda a: isinstance(a, tuple) and len(a) == 2 and not isinstance(a[0], tuple)
    return (jax.tree.map(lambda a: a[0], w, is_leaf=pair),
            jax.tree.map(lambda a: a[1], w, is_leaf=pair))


def init_weights(key, cfg: Config):
    """{"embedding", "gamma_final", "lm_head", "layers": [{attn..., ffw...}]} placed by the
    rules on cfg.mesh (MoE weights int8 QuantArrays with `quant_moe`)."""
    return jax.tree.map(jax.device_put, *init_weights_host(key, cfg))


# --------------------------------------------------------------------------- the model
def rms_norm(x, gamma, eps):
    rms = jnp.sqrt(jnp.mean(jnp.astype(x, jnp.float32) ** 2, axis=-1, keepdims=True) + eps)
    return jnp.astype((gamma if gamma is not None else 1) * x / rms, jnp.bfloat16)


def attention_block(x, segment_ids, layer, cfg: Config):
    l2p = lambda *specs: logical_to_physical(specs, cfg.rules)
    x = x.astype(cfg.dtype)
    with jax.named_scope("qkv_matmul"):
        q = einsum("btd,dhq->bhtq", x, layer["q"]).astype(cfg.dtype)
        k = einsum("btd,dhq->bhtq", x, layer["k"]).astype(cfg.dtype)
        v = einsum("btd,dhq->bhtq", x, layer["v"]).astype(cfg.dtype)
    with jax.named_scope("qk_norm"):
        q = rms_norm(q, layer["q_gamma"], cfg.norm_eps).astype(cfg.dtype)
        k = rms_norm(k, layer["k_gamma"], cfg.norm_eps).astype(cfg.dtype)
    with jax.named_scope("attention"):
        t = q.shape[-2]
        qk = jnp.einsum("bhtq,bhsq->bhts", q, k, preferred_element_type=jnp.float32)
        qk = qk * cfg.head_dim ** -0.5
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = same & jnp.tril(jnp.ones((t, t), bool))[None]
        qk = jnp.where(mask[:, None], qk, -1e30)
        attn_out = jnp.einsum("bhts,bhsq->bhtq", jax.nn.softmax(qk, axis=-1).astype(cfg.dtype),
                              v)
    with jax.named_scope("projection"):
        attn_out = einsum("bhtq,hqd->btd", attn_out, layer["o"],
                          out_sharding=l2p("batch", "sequence", "act_embed")).astype(cfg.dtype)
    return attn_out, (k, v)


@partial(jax.jit, static_argnames=("replicated_routing",))
def _route_tokens_to_moe_experts(x, weight, replicated_routing: bool, cfg: Config):
    l2p = lambda *spec: logical_to_physical(spec, cfg.rules)
    x_shape = x.shape
    x = x.reshape((-1, x.shape[-1]))
    x = reshard(x, l2p(None, None)) if replicated_routing else reshard(x, P(TENSOR_AXIS_NAME,
                                                                             None))
    weight = reshard(weight, l2p(None, None))
    scores = jnp.einsum("Sk,kj->Sj", x, weight).astype(jnp.float32)
    topk_weights, topk_idx = jax.lax.top_k(jax.nn.softmax(scores, axis=-1),
                                           cfg.moe_experts_per_tok)
    topk_weights = topk_weights / jnp.sum(topk_weights, axis=-1, keepdims=True)
    topk_weights = topk_weights.reshape(x_shape[:-1] + (cfg.moe_experts_per_tok,),
                                        out_sharding=l2p("batch", "sequence", None))
    topk_idx = topk_idx.reshape(x_shape[:-1] + (cfg.moe_experts_per_tok,),
                                out_sharding=l2p("batch", "sequence", None))
    return topk_weights, topk_idx


def _moe_gmm(lhs, rhs, group_sizes, topk_idx, cfg: Config):
    group_sizes = group_sizes.astype(jnp.int32)
    with jax.named_scope("jax.lax.ragged_dot"):
        if isinstance(rhs, QuantArray):
            scale = jnp.take_along_axis(rhs.scale, topk_idx[:, None], axis=-2)
            ret = jax.lax.ragged_dot(lhs, rhs.quant, group_sizes) * scale
        else:
            ret = jax.lax.ragged_dot(lhs, rhs, group_sizes)
    return ret.astype(cfg.dtype)


def moe_block(x, layer, cfg: Config):
    l2p = lambda *axes: logical_to_physical(axes, cfg.rules)
    _psc = lambda z, spec: reshard(z, P(*spec))
    _qpsc = lambda z, spec: dataclasses.replace(z, quant=_psc(z.quant, spec.quant),
                                                scale=_psc(z.scale, spec.scale))
    psc = lambda z, spec: _qpsc(z, spec) if isinstance(z, QuantArray) else _psc(z, spec)

    replicated_routing = (x.shape[-2] == 1
                          or (x.shape[-2] * x.shape[-3]) % jax.device_count() != 0)
    topk_weights, topk_idx = _route_tokens_to_moe_experts(x, layer["w_router"],
                                                          replicated_routing, cfg)
    tensor_axname, expert_axname = l2p("moe_e_tp")[0], l2p("moe_e_ep")[0]

    x_spec = l2p("batch", "sequence", None)
    topk_weights_spec, topk_idx_spec = l2p("batch", "sequence", None), l2p("batch", "sequence",
                                                                           None)
    out_spec = l2p("batch", "sequence", None)
    we_gate_spec = l2p("moe_e_ep", None, "moe_e_tp")
    we_up_spec = l2p("moe_e_ep", None, "moe_e_tp")
    we_down_spec = l2p("moe_e_ep", "moe_e_tp", None)
    if cfg.quant_moe:
        we_gate_spec = dataclasses.replace(layer["we_gate"], quant=we_gate_spec,
                                           scale=P(we_gate_spec[0], we_gate_spec[2]))
        we_up_spec = dataclasses.replace(layer["we_up"], quant=we_up_spec,
                                         scale=P(we_up_spec[0], we_up_spec[2]))
        we_down_spec = dataclasses.replace(layer["we_down"], quant=we_down_spec,
                                           scale=P(we_down_spec[0], we_down_spec[2]))
    we_gate = psc(layer["we_gate"], we_gate_spec)
    we_up = psc(layer["we_up"], we_up_spec)
    we_down = psc(layer["we_down"], we_down_spec)
    in_specs = (x_spec, we_gate_spec, we_up_spec, we_down_spec, topk_weights_spec, topk_idx_spec)
    if cfg.ep_strategy == "prefill":
        out_spec = P(*(out_spec[:-1] + (tensor_axname,)))

    mesh = cfg.mesh
    expert_count = mesh.shape[expert_axname]
    tensor_count = mesh.shape[tensor_axname]
    if cfg.moe_num_experts % expert_count:
        raise ValueError(f"moe_num_experts={cfg.moe_num_experts} must be a multiple of the "
                         f"{expert_axname!r} axis size {expert_count}")
    expert_size = cfg.moe_num_experts // expert_count

    @partial(jax.shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)
    def _expert_fn(x, we_gate, we_up, we_down, topk_weights, topk_idx):
        (b, s, d), e = x.shape, cfg.moe_experts_per_tok
        expert_idx = jax.lax.axis_index(expert_axname)
        topk_idx_ = topk_idx.reshape(-1)
        valid_group_mask_ = ((topk_idx_ >= expert_size * expert_idx)
                             & (topk_idx_ < expert_size * (expert_idx + 1)))
        expert_mapped_topk_idx_ = jnp.where(valid_group_mask_,
                                            topk_idx_ - expert_idx * expert_size, 2 ** 30)
        sort_idx_ = jnp.argsort(expert_mapped_topk_idx_, axis=-1)
        isort_idx_ = jnp.argsort(sort_idx_)
        if cfg.ep_strategy == "prefill":
            truncate_size = round(2 * sort_idx_.size / expert_count)
            sort_idx_, isort_idx_ = sort_idx_[:truncate_size], isort_idx_[:truncate_size]
        topk_idx_sort_ = topk_idx_[sort_idx_]
        expert_mapped_topk_idx_sort_ = expert_mapped_topk_idx_[sort_idx_]
        valid_group_mask_sort_ = expert_mapped_topk_idx_sort_ < 2 ** 30
        expert_mapped_topk_idx_sort_ = jnp.where(valid_group_mask_sort_,
                                                 expert_mapped_topk_idx_sort_, 0)
        x_repeat_sort_ = jnp.take_along_axis(x.reshape((-1, x.shape[-1])),
                                             sort_idx_[:, None] // e, axis=-2)
        group_sizes = jnp.bincount(topk_idx_sort_, length=cfg.moe_num_experts)
        group_sizes_shard = jax.lax.dynamic_slice_in_dim(group_sizes, expert_idx * expert_size,
                                                         expert_size, 0)
        with jax.named_scope("we_gate"):
            ff_gate = _moe_gmm(x_repeat_sort_, we_gate, group_sizes_shard,
                               expert_mapped_topk_idx_sort_, cfg)
            ff_gate = jax.nn.silu(ff_gate)
            ff_gate = jnp.where(valid_group_mask_sort_[..., None], ff_gate, 0)
        with jax.named_scope("we_up"):
            ff_up = _moe_gmm(x_repeat_sort_, we_up, group_sizes_shard,
                             expert_mapped_topk_idx_sort_, cfg)
        ff_gate_up = jnp.where(valid_group_mask_sort_[..., None], ff_gate * ff_up, 0)
        with jax.named_scope("we_down"):
            ff_out = _moe_gmm(ff_gate_up, we_down, group_sizes_shard,
                              expert_mapped_topk_idx_sort_, cfg)
            ff_out = jnp.where(valid_group_mask_sort_[..., None], ff_out, 0)
        if cfg.ep_strategy == "prefill":
            rs_shape = math.ceil((ff_out.shape[-1] // tensor_count) / 256) * 256 * tensor_count
            ff_out = jnp.pad(ff_out, ((0, 0), (0, rs_shape - ff_out.shape[-1])))
            ff_out = jax.lax.psum_scatter(ff_out, axis_name=tensor_axname, scatter_dimension=1,
                                          tiled=True)
        ff_out = ff_out * topk_weights.reshape(-1)[sort_idx_][:, None]
        if cfg.ep_strategy == "prefill":
            with jax.named_scope("unpermute"):
                dim_nums = jax.lax.ScatterDimensionNumbers(
                    update_window_dims=(1,), inserted_window_dims=(0,),
                    scatter_dims_to_operand_dims=(0,))
                ff_out_expert = jax.lax.scatter_add(
                    jnp.zeros((b * s, ff_out.shape[-1]), dtype=cfg.dtype),
                    sort_idx_[..., None] // e, ff_out.astype(cfg.dtype), dim_nums)
        else:
            with jax.named_scope("unpermute"):
                ff_out = jnp.take_along_axis(ff_out, isort_idx_[..., None], axis=-2)
            with jax.named_scope("expert_summing"):
                ff_out_expert = jnp.sum(ff_out.reshape((b * s, e, d)), -2).astype(cfg.dtype)
        with jax.named_scope("experts_collective"):
            if cfg.ep_strategy == "prefill":
                ff_out_expert = jax.lax.psum(ff_out_expert, expert_axname)
            else:
                ff_out_expert = jax.lax.psum(ff_out_expert, (expert_axname, tensor_axname))
            return ff_out_expert.reshape((b, s, ff_out_expert.shape[-1]))

    with jax.named_scope("moe_routed_expert"):
        x_ = psc(x, x_spec)
        ff_out_expert = _expert_fn(x_, we_gate, we_up, we_down, topk_weights,
                                   topk_idx)[..., : x.shape[-1]]
    return psc(ff_out_expert, l2p("batch", "sequence", "act_embed"))


def mlp_block(x, layer, cfg: Config):
    l2p = lambda *specs: logical_to_physical(specs, cfg.rules)
    dtype = cfg.dtype
    with jax.named_scope("gate"):
        ff_gate = jax.nn.silu(einsum("btd,df->btf", x, layer["w_gate"])).astype(dtype)
    with jax.named_scope("up_proj"):
        ff_up = einsum("btd,df->btf", x, layer["w_up"]).astype(dtype)
    with jax.named_scope("down_proj"):
        ff_out = einsum("btf,fd->btd", ff_gate * ff_up, layer["w_down"],
                        out_sharding=l2p("batch", "sequence", "act_embed")).astype(dtype)
    return ff_out


def forward_layer(x, segment_ids, layer, idx, cfg: Config):
    x = x.astype(cfg.dtype)
    with jax.named_scope("attn_pre_norm"):
        attn_in = rms_norm(x, layer["attn_pre_gamma"], cfg.norm_eps)
    attn_out, cache_updates = attention_block(attn_in, segment_ids, layer, cfg)
    with jax.named_scope("residual"):
        x = x + attn_out.astype(cfg.dtype)
    with jax.named_scope("attn_post_norm"):
        ff_in = rms_norm(x, layer["attn_post_gamma"], cfg.norm_eps)
    with jax.named_scope("ffn"):
        block = mlp_block if idx in cfg.mlp_layer_idxs else moe_block
        ff_out = block(ff_in, layer["ffw"], cfg)
    with jax.named_scope("residual"):
        x = x + ff_out.astype(cfg.dtype)
    return x, cache_updates


def forward(x, segment_ids, weights, cfg: Config):
    """tokens [B, T] int32 -> (logits [B, T, vocab], [(k, v) per layer])."""
    TRACES["forward"] += 1
    l2p = lambda *args: logical_to_physical(args, cfg.rules)
    x = weights["embedding"].at[x, :].get(out_sharding=l2p("batch", "sequence", "act_embed"))
    all_cache_updates = []
    for idx, layer in enumerate(weights["layers"]):
        x, cache_updates = forward_layer(x, segment_ids, layer, idx, cfg)
        all_cache_updates.append(cache_updates)
    x = rms_norm(x, weights["gamma_final"], cfg.norm_eps)
    logits = einsum("btd,dv->btv", x, weights["lm_head"])
    return logits, all_cache_updates


@partial(jax.jit, static_argnums=(1, 2))
def prepare_chunk(chunk, pad_to: int, pad_id: int):
    if chunk.ndim == 1:
        chunk = chunk[None, :]
    chunk = jnp.pad(chunk, [(0, 0), (0, pad_to - chunk.shape[-1])], mode="constant",
                    constant_values=pad_id)
    segment_ids = jnp.where(chunk != pad_id, 1, 0).astype(jnp.int32)
    return chunk, segment_ids


def prefill(tokens, weights, cfg: Config, pad_id: int = PAD_ID, jit=jax.jit):
    """The prompt's logits and next tokens; `jit(forward, ...)` made at every call, as there."""
    pad_to = 2 ** math.ceil(math.log2(tokens.shape[-1]))
    l2p = lambda *axes: logical_to_physical(axes, cfg.rules)
    prompt, prompt_segment_ids = prepare_chunk(tokens, pad_to=pad_to, pad_id=pad_id)
    prompt = reshard(prompt, l2p("batch", "sequence"))
    prompt_segment_ids = reshard(prompt_segment_ids, l2p("batch", "sequence"))
    logits_shardings = jax.sharding.NamedSharding(cfg.mesh, P(BATCH_AXIS_NAME, None,
                                                              TENSOR_AXIS_NAME))
    kv_sharding = jax.sharding.NamedSharding(cfg.mesh, P(BATCH_AXIS_NAME, ATTN_HEADS_AXIS_NAME))
    cache_shardings = [(kv_sharding, kv_sharding)] * cfg.num_layers
    logits, cache = jit(forward, donate_argnums=(0, 1),
                        out_shardings=(logits_shardings, cache_shardings))(
        prompt, prompt_segment_ids, weights, cfg)
    next_tokens = jax.jit(partial(jnp.argmax, axis=-1))(logits)
    return next_tokens, logits, cache


def dense_reference(tokens, segment_ids, weights, cfg: Config, margins=None):
    """forward's logits in float64 numpy on the host (no mesh, no collective; not quantized).
    margins: a list that gets, per MoE layer, each token's router-score gap between its last
    chosen expert and the best one left out ([B, T]): where it is below the model's own bf16
    rounding of the scores, a last-bit difference upstream may choose another expert."""
    def f(a):
        if isinstance(a, QuantArray):  # int8 [e, k, n] and its scale [e, n]
            return f(a.quant) * f(a.scale)[:, None, :]
        return np.asarray(jax.device_get(a)).astype(np.float64)

    w = jax.tree.map(f, weights, is_leaf=lambda a: isinstance(a, QuantArray))
    eps = cfg.norm_eps

    def norm(x, g):
        return g * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)

    def silu(v):
        return v / (1 + np.exp(-v))

    tok, seg = np.asarray(tokens), np.asarray(segment_ids)
    x = w["embedding"][tok]
    b, t, _ = x.shape
    for idx, lp in enumerate(w["layers"]):
        a = norm(x, lp["attn_pre_gamma"])
        q = norm(np.einsum("btd,dhq->bhtq", a, lp["q"]), lp["q_gamma"])
        k = norm(np.einsum("btd,dhq->bhtq", a, lp["k"]), lp["k_gamma"])
        v = np.einsum("btd,dhq->bhtq", a, lp["v"])
        s = np.einsum("bhtq,bhsq->bhts", q, k) * cfg.head_dim ** -0.5
        mask = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((t, t), bool))[None]
        s = np.where(mask[:, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
        x = x + np.einsum("bhtq,hqd->btd", np.einsum("bhts,bhsq->bhtq", p, v), lp["o"])
        h = norm(x, lp["attn_post_gamma"])
        ffw = lp["ffw"]
        if idx in cfg.mlp_layer_idxs:
            out = (silu(h @ ffw["w_gate"]) * (h @ ffw["w_up"])) @ ffw["w_down"]
        else:
            hf = h.reshape(-1, h.shape[-1])
            sc = hf @ ffw["w_router"]
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr = pr / pr.sum(-1, keepdims=True)
            ids = np.argsort(-pr, -1, kind="stable")[:, :cfg.moe_experts_per_tok]
            if margins is not None:
                top = -np.sort(-sc, -1)
                k = cfg.moe_experts_per_tok
                margins.append((top[:, k - 1] - top[:, k]).reshape(h.shape[:-1]))
            wts = np.take_along_axis(pr, ids, -1)
            wts = wts / wts.sum(-1, keepdims=True)
            out = np.zeros_like(hf)
            for i in range(hf.shape[0]):
                for j, e in enumerate(ids[i]):
                    y = (silu(hf[i] @ ffw["we_gate"][e]) * (hf[i] @ ffw["we_up"][e])
                         @ ffw["we_down"][e])
                    out[i] += wts[i, j] * y
            out = out.reshape(h.shape)
        x = x + out
    return norm(x, w["gamma_final"]) @ w["lm_head"]
