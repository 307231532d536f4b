"""A Qwen3-MoE decoder written the way sglang-jax (sgl-project/sglang-jax, `python/sgl_jax/srt/`)
writes its JAX serving models; our own code in that style, at small sizes.

What it imitates:
- `LinearBase` (layers/linear.py): a weight sharded by `kernel_axes` on an Explicit
  ("data", "tensor") mesh and `lax.dot_general(..., out_sharding=...)`: a column-parallel layer
  (`kernel_axes=(None, "tensor")`) leaves its output sharded on "tensor"; a row-parallel one
  (`("tensor", None)`) asks for `P("data", None)`, and XLA's partitioner inserts the all-reduce.
  No shard_map, no psum.
- `RMSNorm` (layers/layernorm.py, Flax's statistics code): the mean square in float32,
  `y = x - mean` with a zero mean, `mul = rsqrt(var + eps) * scale`, `y * mul`.
- `Embed` (layers/embeddings.py): a vocab-parallel table (`("tensor", None)`) read with
  `.at[ids].get(out_sharding=...)`.
- `EPMoE` (layers/moe.py): a second `Mesh` ("expert", "tensor") over the same devices, its
  weights sharded there, a `shard_map` run under `use_abstract_mesh` of that mesh with the
  tokens replicated (`reshard(x, P(None))`), a local argsort of the routed copies, the grouped
  products on the local experts (`lax.ragged_dot` here: sglang-jax calls its megablox `gmm`
  with a group offset; we rotate the sorted rows so the local groups come first), the weighted
  unpermute, `psum("tensor")` then `psum("expert")`, and `reshard` back to the model's mesh.
- The decoder layer (models/qwen3_moe.py): `hidden += residual`, `residual = hidden`, the
  norm; `hidden += reshard(residual, reduce_sharding)` after attention; the residual carried
  into the next layer; the final `hidden += residual` and norm.

Left out: rotary embeddings, the KV cache and paged attention (attention here is causal over
the step's tokens), quantization, expert-location metadata, sequence parallelism's
reduce-scatter, the fused-MoE backends and the weight loaders. Tokens are [T, hidden] as there.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 512
    hidden_size: int = 256
    num_heads: int = 8
    head_dim: int = 32
    intermediate_size: int = 512          # the dense MLP's
    moe_intermediate_size: int = 128      # each expert's
    num_experts: int = 16
    num_experts_per_tok: int = 2
    num_hidden_layers: int = 2
    moe: bool = True                      # every layer MoE, or every layer dense
    ep_size: int = 8                      # the MoE mesh: (ep_size, devices // ep_size)
    rms_norm_eps: float = 1e-6
    dtype: object = jnp.bfloat16


def make_mesh(devices=None, data=1):
    devices = np.array(jax.devices() if devices is None else devices)
    return jax.sharding.Mesh(devices.reshape(data, -1), ("data", "tensor"),
                             axis_types=(AxisType.Explicit, AxisType.Explicit))


def _moe_mesh(mesh, ep_size):
    devices = mesh.devices.flatten()
    return jax.sharding.Mesh(devices.reshape(ep_size, devices.size // ep_size),
                             axis_names=("expert", "tensor"),
                             axis_types=(AxisType.Explicit, AxisType.Explicit))


class _Host(tuple):
    """(numpy value, NamedSharding) of one weight; `+ 1` adds to the value."""

    def __add__(self, one):
        return _Host((self[0] + np.asarray(one, self[0].dtype), self[1]))


def _normal(key, shape, dtype, sharding, scale):
    host = np.asarray(jax.random.normal(key, shape, jnp.float32) * scale)
    return _Host((host.astype(dtype), sharding))


def init_params(key, cfg: Config, mesh):
    """The weights as the modules hold them, each placed with its layer's sharding."""
    return jax.tree.map(jax.device_put, *init_params_host(key, cfg, mesh))


def init_params_host(key, cfg: Config, mesh):
    """init_params' values as numpy arrays and the NamedSharding of each (two trees of the same
    structure), made without a collective (call it outside a mesh context)."""
    ns = lambda *spec: NamedSharding(mesh, P(*spec))
    moe_mesh = _moe_mesh(mesh, cfg.ep_size)
    ms = lambda *spec: NamedSharding(moe_mesh, P(*spec))
    H, D, nh = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    keys = iter(jax.random.split(key, 4 + 16 * cfg.num_hidden_layers))
    wd = cfg.dtype
    p = {"embed": _normal(next(keys), (cfg.vocab_size, H), wd, ns("tensor", None), 1.0),
         "norm": _normal(next(keys), (H,), wd, ns(None), 0.1) + 1, "layers": []}
    for _ in range(cfg.num_hidden_layers):
        lp = {"input_layernorm": _normal(next(keys), (H,), wd, ns(None), 0.1) + 1,
              "post_attention_layernorm": _normal(next(keys), (H,), wd, ns(None), 0.1) + 1,
              "q_norm": _normal(next(keys), (D,), wd, ns(None), 0.1) + 1,
              "k_norm": _normal(next(keys), (D,), wd, ns(None), 0.1) + 1,
              "q_proj": _normal(next(keys), (H, nh * D), wd, ns(None, "tensor"), H ** -0.5),
              "k_proj": _normal(next(keys), (H, nh * D), wd, ns(None, "tensor"), H ** -0.5),
              "v_proj": _normal(next(keys), (H, nh * D), wd, ns(None, "tensor"), H ** -0.5),
              "c_proj": _normal(next(keys), (nh * D, H), wd, ns("tensor", None),
                                (nh * D) ** -0.5)}
        if cfg.moe:
            E, F = cfg.num_experts, cfg.moe_intermediate_size
            lp["gate"] = _normal(next(keys), (H, E), wd, ns(None, None), H ** -0.5)
            lp["wi_0"] = _normal(next(keys), (E, H, F), wd, ms("expert", None, "tensor"),
                                 H ** -0.5)
            lp["wi_1"] = _normal(next(keys), (E, H, F), wd, ms("expert", None, "tensor"),
                                 H ** -0.5)
            lp["wo"] = _normal(next(keys), (E, F, H), wd, ms("expert", "tensor", None),
                               F ** -0.5)
        else:
            F = cfg.intermediate_size
            lp["gate_proj"] = _normal(next(keys), (H, F), wd, ns(None, "tensor"), H ** -0.5)
            lp["up_proj"] = _normal(next(keys), (H, F), wd, ns(None, "tensor"), H ** -0.5)
            lp["down_proj"] = _normal(next(keys), (F, H), wd, ns("tensor", None), F ** -0.5)
        p["layers"].append(lp)
    pair = lambda a: isinstance(a, _Host)
    return (jax.tree.map(lambda a: a[0], p, is_leaf=pair),
            jax.tree.map(lambda a: a[1], p, is_leaf=pair))


# --------------------------------------------------------------------------- layers
class LinearBase:
    def __init__(self, weight, mesh, kernel_axes, params_dtype):
        self.weight, self.mesh = weight, mesh
        self.kernel_axes, self.params_dtype = kernel_axes, params_dtype

    def __call__(self, x, *, out_sharding=None):
        target = out_sharding or NamedSharding(
            self.mesh, P("data", *([None] * (x.ndim - 2)), self.kernel_axes[-1]))
        out = lax.dot_general(x, self.weight, (((x.ndim - 1,), (0,)), ((), ())),
                              preferred_element_type=self.params_dtype, out_sharding=target)
        return out, None


def _compute_stats(x, axes):
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    x = jnp.asarray(x, dtype)
    var = jnp.mean(lax.square(x), axes)
    return jnp.zeros_like(var), var


def _normalize(x, mean, var, scale, axes, dtype, epsilon):
    stats_shape = list(x.shape)
    for a in axes:
        stats_shape[a] = 1
    mean, var = mean.reshape(stats_shape), var.reshape(stats_shape)
    y = x - mean
    mul = lax.rsqrt(var + epsilon)
    if scale is not None:
        mul *= scale.reshape([1] * (x.ndim - 1) + [x.shape[-1]])
    y *= mul
    return jnp.asarray(y, dtype)


class RMSNorm:
    def __init__(self, scale, epsilon, dtype):
        self.scale, self.epsilon, self.dtype = scale, epsilon, dtype

    def __call__(self, x):
        axes = (x.ndim - 1,)
        mean, var = _compute_stats(x, axes)
        return _normalize(x, mean, var, self.scale, axes, self.dtype, self.epsilon)


class Embed:
    def __init__(self, embedding, mesh, kernel_axes=("tensor", None)):
        self.embedding, self.mesh, self.kernel_axes = embedding, mesh, kernel_axes

    def __call__(self, inputs):
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("Input type must be an integer or unsigned integer.")
        spec = P("data", *([None] * (inputs.ndim - 1)), self.kernel_axes[-1])
        return self.embedding.at[inputs].get(out_sharding=NamedSharding(self.mesh, spec))


class Attention:
    """q/k/v column-parallel, heads split over "tensor", per-head q/k norms, causal attention
    over the step's tokens, the output projection row-parallel."""

    def __init__(self, lp, cfg, mesh):
        self.mesh, self.cfg = mesh, cfg
        lin = lambda name, axes: LinearBase(lp[name], mesh, axes, cfg.dtype)
        self.q_proj, self.k_proj, self.v_proj = (lin(n, (None, "tensor"))
                                                 for n in ("q_proj", "k_proj", "v_proj"))
        self.c_proj = lin("c_proj", ("tensor", None))
        self.q_norm = RMSNorm(lp["q_norm"], cfg.rms_norm_eps, cfg.dtype)
        self.k_norm = RMSNorm(lp["k_norm"], cfg.rms_norm_eps, cfg.dtype)

    def __call__(self, hidden_states, *, out_sharding=None):
        cfg, heads = self.cfg, NamedSharding(self.mesh, P("data", "tensor"))
        q, _ = self.q_proj(hidden_states)
        k, _ = self.k_proj(hidden_states)
        v, _ = self.v_proj(hidden_states)
        q = q.reshape(-1, cfg.num_heads, cfg.head_dim, out_sharding=heads)
        k = k.reshape(-1, cfg.num_heads, cfg.head_dim, out_sharding=heads)
        v = v.reshape(-1, cfg.num_heads, cfg.head_dim, out_sharding=heads)
        q, k = self.q_norm(q), self.k_norm(k)
        # every query attends to all of the step's keys: the keys and values whole per head
        k = jax.sharding.reshard(k, P(None, "tensor", None))
        v = jax.sharding.reshard(v, P(None, "tensor", None))
        T = q.shape[0]
        s = jnp.einsum("thd,shd->hts", q, k, preferred_element_type=jnp.float32)
        s = s * cfg.head_dim ** -0.5
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e30)
        a = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        o = jnp.einsum("hts,shd->thd", a, v)
        o = o.reshape(T, cfg.num_heads * cfg.head_dim, out_sharding=heads)
        output, _ = self.c_proj(o, out_sharding=out_sharding)
        return output


class MLP:
    def __init__(self, lp, cfg, mesh):
        self.gate_proj = LinearBase(lp["gate_proj"], mesh, (None, "tensor"), cfg.dtype)
        self.up_proj = LinearBase(lp["up_proj"], mesh, (None, "tensor"), cfg.dtype)
        self.down_proj = LinearBase(lp["down_proj"], mesh, ("tensor", None), cfg.dtype)

    def __call__(self, x, *, out_sharding=None):
        g, _ = self.gate_proj(x)
        u, _ = self.up_proj(x)
        out, _ = self.down_proj(jax.nn.silu(g) * u, out_sharding=out_sharding)
        return out


class TopK:
    def __init__(self, gate, cfg, mesh):
        self.gate, self.cfg, self.mesh = gate, cfg, mesh

    def __call__(self, hidden_states, routing_sharding):
        logits = lax.dot_general(hidden_states, self.gate, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32,
                                 out_sharding=routing_sharding)
        weights, ids = lax.top_k(jax.nn.softmax(logits, axis=-1), self.cfg.num_experts_per_tok)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, ids


class EPMoE:
    def __init__(self, lp, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.ep_size = cfg.ep_size
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts({self.num_experts}) must be divisible by ep_size "
                             f"({self.ep_size})")
        self.tp_size = mesh.devices.size // self.ep_size
        self.experts_per_device = self.num_experts // self.ep_size
        self.moe_mesh = _moe_mesh(mesh, self.ep_size)
        self.updated_mesh = mesh.abstract_mesh.update(axis_sizes=(self.ep_size, self.tp_size),
                                                      axis_names=("expert", "tensor"))
        self.wi_0, self.wi_1, self.wo = lp["wi_0"], lp["wi_1"], lp["wo"]

    def __call__(self, hidden_states, topk_weights, topk_ids, *, out_sharding=None):
        if out_sharding is None:
            out_sharding = NamedSharding(self.mesh, P(*([None] * hidden_states.ndim)))
        out_specs = P(*["tensor" if s == "tensor" else None for s in out_sharding.spec])
        with jax.sharding.use_abstract_mesh(self.updated_mesh):
            x = jax.sharding.reshard(hidden_states, P(None))
            w = jax.sharding.reshard(topk_weights, P(None))
            ids = jax.sharding.reshard(topk_ids, P(None))
            result = jax.shard_map(
                self._forward, mesh=self.moe_mesh,
                in_specs=(P(None), P(None), P(None), P("expert", None, "tensor"),
                          P("expert", None, "tensor"), P("expert", "tensor", None)),
                out_specs=out_specs, check_vma=False)(x, w, ids, self.wi_0, self.wi_1, self.wo)
        return jax.sharding.reshard(result, out_sharding)

    def _forward(self, hidden_states, topk_weights, topk_ids, w0, w1, wo):
        expert_shard_id = lax.axis_index("expert")
        flat = jnp.ravel(topk_ids)
        order = jnp.argsort(flat, stable=True)
        token_indices = order // self.top_k
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        offset = expert_shard_id * self.experts_per_device
        local_sizes = lax.dynamic_slice_in_dim(group_sizes, offset, self.experts_per_device)
        start = jnp.sum(jnp.where(jnp.arange(self.num_experts) < offset, group_sizes, 0))
        x = hidden_states[token_indices].astype(self.cfg.dtype)
        x = jnp.roll(x, -start, axis=0)     # the local experts' rows first
        g = lax.ragged_dot(x, w0, local_sizes, preferred_element_type=self.cfg.dtype)
        u = lax.ragged_dot(x, w1, local_sizes, preferred_element_type=self.cfg.dtype)
        y = lax.ragged_dot(jax.nn.silu(g) * u, wo, local_sizes,
                           preferred_element_type=self.cfg.dtype)
        y = jnp.roll(y, start, axis=0)
        unsort = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
        y = jnp.take(y, unsort, axis=0).reshape(-1, self.top_k, y.shape[-1])
        out = jnp.einsum("BKE,BK -> BE", y.astype(jnp.float32),
                         topk_weights.astype(jnp.float32)).astype(self.cfg.dtype)
        if self.tp_size > 1:
            out = lax.psum(out, "tensor")
        if self.ep_size > 1:
            out = lax.psum(out, "expert")
        return out


class DecoderLayer:
    def __init__(self, lp, cfg, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.input_layernorm = RMSNorm(lp["input_layernorm"], cfg.rms_norm_eps, cfg.dtype)
        self.post_attention_layernorm = RMSNorm(lp["post_attention_layernorm"],
                                                cfg.rms_norm_eps, cfg.dtype)
        self.self_attn = Attention(lp, cfg, mesh)
        if cfg.moe:
            self.topk = TopK(lp["gate"], cfg, mesh)
            self.mlp = EPMoE(lp, cfg, mesh)
        else:
            self.mlp = MLP(lp, cfg, mesh)

    def __call__(self, hidden_states, residual=None):
        reduce_sharding = NamedSharding(self.mesh, P("data", None))
        if residual is not None:
            hidden_states += residual
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, out_sharding=reduce_sharding)
        hidden_states += jax.sharding.reshard(residual, reduce_sharding)
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        if self.cfg.moe:
            topk_weights, topk_ids = self.topk(hidden_states, reduce_sharding)
            hidden_states = self.mlp(hidden_states, topk_weights, topk_ids,
                                     out_sharding=reduce_sharding)
        else:
            hidden_states = self.mlp(hidden_states, out_sharding=reduce_sharding)
        residual = jax.sharding.reshard(residual, reduce_sharding)
        return hidden_states, residual


class Qwen3MoeModel:
    def __init__(self, params, cfg, mesh):
        self.embed_tokens = Embed(params["embed"], mesh)
        self.layers = [DecoderLayer(lp, cfg, mesh) for lp in params["layers"]]
        self.norm = RMSNorm(params["norm"], cfg.rms_norm_eps, cfg.dtype)

    def __call__(self, input_ids):
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual)
        if residual is not None:
            hidden_states += residual
        return self.norm(hidden_states)


def forward_fn(cfg: Config, mesh):
    """forward(params, input_ids [T] int32) -> hidden [T, hidden]: the model built from its
    weights at each trace (as `nnx.merge` does) and called. Run it under `jax.set_mesh(mesh)`."""
    def forward(params, input_ids):
        return Qwen3MoeModel(params, cfg, mesh)(input_ids)
    return forward


def dense_reference(params, input_ids, cfg: Config):
    """The same model in float64 numpy on the host: no mesh, no collective."""
    f = lambda a: np.asarray(jax.device_get(a)).astype(np.float64)
    p = jax.tree.map(f, params)
    eps = cfg.rms_norm_eps

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

    def silu(v):
        return v / (1 + np.exp(-v))

    nh, D = cfg.num_heads, cfg.head_dim
    h = p["embed"][np.asarray(input_ids)]
    T = h.shape[0]
    residual = None
    for lp in p["layers"]:
        if residual is not None:
            h = h + residual
        residual = h
        x = norm(h, lp["input_layernorm"])
        q = norm((x @ lp["q_proj"]).reshape(T, nh, D), lp["q_norm"])
        k = norm((x @ lp["k_proj"]).reshape(T, nh, D), lp["k_norm"])
        v = (x @ lp["v_proj"]).reshape(T, nh, D)
        s = np.einsum("thd,shd->hts", q, k) * D ** -0.5
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = a / a.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", a, v).reshape(T, nh * D)
        h = o @ lp["c_proj"] + residual
        residual = h
        x = norm(h, lp["post_attention_layernorm"])
        if cfg.moe:
            logits = x @ lp["gate"]
            pr = np.exp(logits - logits.max(-1, keepdims=True))
            pr = pr / pr.sum(-1, keepdims=True)
            ids = np.argsort(-pr, -1, kind="stable")[:, :cfg.num_experts_per_tok]
            wts = np.take_along_axis(pr, ids, -1)
            wts = wts / wts.sum(-1, keepdims=True)
            out = np.zeros_like(x)
            for t in range(T):
                for j, e in enumerate(ids[t]):
                    y = silu(x[t] @ lp["wi_0"][e]) * (x[t] @ lp["wi_1"][e]) @ lp["wo"][e]
                    out[t] += wts[t, j] * y
            h = out
        else:
            h = (silu(x @ lp["gate_proj"]) * (x @ lp["up_proj"])) @ lp["down_proj"]
    h = h + residual
    return norm(h, p["norm"])
