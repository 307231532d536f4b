"""A dense Llama-style decoder written the way MaxText (AI-Hypercomputer/maxtext,
`MaxText/layers/`: the dense decoder layer, `DenseGeneral`, `RMSNorm`, logical axis rules) writes
one; our own plain-JAX code in that style, at small sizes.

What it imitates:
- A mesh of Auto axes ("data", "fsdp", "tensor"): XLA chooses the shardings of intermediates.
- Logical axis rules (`logical_axis_rules`: activation_batch -> ("data", "fsdp"), heads / mlp
  -> "tensor", embed -> "fsdp", ...) turned into PartitionSpecs (`logical_to_mesh_axes`), the
  parameters placed by their logical names, and `with_logical_constraint` (a
  `with_sharding_constraint`) on the activations where MaxText puts `nn.with_logical_constraint`
  (the layer's input, the attention output, the MLP output, the layer's output).
- `DenseGeneral`: `lax.dot_general` over one or several contracting axes (the attention output
  projection contracts (heads, head_dim)) into one or several feature axes.
- `RMSNorm`: the mean square in float32, `y = asarray(x * rsqrt(mean2 + eps), dtype)`, then
  `y * scale` (the scale cast to dtype).
- The decoder layer: pre-attention norm, attention, `intermediate_inputs = inputs +
  attention_lnx`, the post-attention norm, the gated MLP (`wi_0`, `wi_1`, `wo`),
  `layer_output = mlp_lnx + intermediate_inputs`; the final `decoder_norm`.

Left out: rotary embeddings, the KV cache, the attention kernels, scan over layers, remat,
quantization, the MoE layer (jax_nvcomm/models/moe_ragged.py is a MaxText-style MoE layer on
lax's collectives; tests/test_jit.py runs it under nvc.jit).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

LOGICAL_AXIS_RULES = (
    ("activation_batch", ("data", "fsdp")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("norm", None),
)


@dataclasses.dataclass(frozen=True)
class Config:
    emb_dim: int = 256
    num_heads: int = 8
    head_dim: int = 32
    mlp_dim: int = 512
    num_layers: int = 2
    normalization_layer_epsilon: float = 1e-5
    dtype: object = jnp.bfloat16
    weight_dtype: object = jnp.float32


def make_mesh(devices=None, shape=(2, 1, 4)):
    devices = np.array(jax.devices() if devices is None else devices)
    return jax.sharding.Mesh(devices.reshape(shape), ("data", "fsdp", "tensor"),
                             axis_types=(AxisType.Auto,) * 3)


def logical_to_mesh_axes(names, rules=LOGICAL_AXIS_RULES):
    table = dict(rules)
    return P(*[table.get(n) if n is not None else None for n in names])


def with_logical_constraint(x, names, mesh):
    return lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_mesh_axes(names)))


# every parameter: (shape of cfg, logical names)
def _param_table(cfg: Config):
    d, h, k, m = cfg.emb_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    return {"pre_self_attention_norm": ((d,), ("norm",)),
            "query": ((d, h, k), ("embed", "heads", "kv")),
            "key": ((d, h, k), ("embed", "heads", "kv")),
            "value": ((d, h, k), ("embed", "heads", "kv")),
            "out": ((h, k, d), ("heads", "kv", "embed")),
            "post_self_attention_norm": ((d,), ("norm",)),
            "wi_0": ((d, m), ("embed", "mlp")),
            "wi_1": ((d, m), ("embed", "mlp")),
            "wo": ((m, d), ("mlp", "embed"))}


def init_params_host(key, cfg: Config, mesh):
    """init_params' values as numpy arrays and the NamedSharding of each (two trees of the same
    structure), made without a collective (call it outside a mesh context)."""
    table = _param_table(cfg)
    keys = iter(jax.random.split(key, len(table) * cfg.num_layers + 1))

    def make(shape, names):
        if names == ("norm",):
            host = 1 + 0.1 * np.asarray(jax.random.normal(next(keys), shape, jnp.float32))
        else:
            fan_in = shape[0] if names[0] != "heads" else shape[0] * shape[1]
            host = np.asarray(jax.random.normal(next(keys), shape, jnp.float32)) * fan_in ** -.5
        return host.astype(cfg.weight_dtype), NamedSharding(mesh, logical_to_mesh_axes(names))

    p = {"decoder_norm": make((cfg.emb_dim,), ("norm",)),
         "layers": [{n: make(*v) for n, v in table.items()} for _ in range(cfg.num_layers)]}
    pair = lambda a: isinstance(a, tuple)
    return (jax.tree.map(lambda a: a[0], p, is_leaf=pair),
            jax.tree.map(lambda a: a[1], p, is_leaf=pair))


def init_params(key, cfg: Config, mesh):
    return jax.tree.map(jax.device_put, *init_params_host(key, cfg, mesh))


# --------------------------------------------------------------------------- layers
class RMSNorm:
    def __init__(self, scale, epsilon, dtype):
        self.scale, self.epsilon, self.dtype = scale, epsilon, dtype

    def __call__(self, x):
        x = jnp.asarray(x, jnp.float32)
        mean2 = jnp.mean(lax.square(x), axis=-1, keepdims=True)
        y = jnp.asarray(x * lax.rsqrt(mean2 + self.epsilon), self.dtype)
        return y * jnp.asarray(self.scale, self.dtype)


class DenseGeneral:
    def __init__(self, kernel, axis=-1, dtype=jnp.float32):
        self.kernel, self.dtype = kernel, dtype
        self.axis = (axis,) if isinstance(axis, int) else tuple(axis)

    def __call__(self, inputs):
        inputs = jnp.asarray(inputs, self.dtype)
        axis = tuple(a % inputs.ndim for a in self.axis)
        kernel = jnp.asarray(self.kernel, self.dtype)
        contract_ind = tuple(range(len(axis)))
        return lax.dot_general(inputs, kernel, ((axis, contract_ind), ((), ())))


class Attention:
    def __init__(self, lp, cfg: Config, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.query = DenseGeneral(lp["query"], dtype=cfg.dtype)
        self.key = DenseGeneral(lp["key"], dtype=cfg.dtype)
        self.value = DenseGeneral(lp["value"], dtype=cfg.dtype)
        self.out = DenseGeneral(lp["out"], axis=(-2, -1), dtype=cfg.dtype)

    def __call__(self, x):
        names = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
        q = with_logical_constraint(self.query(x), names, self.mesh)
        k = with_logical_constraint(self.key(x), names, self.mesh)
        v = with_logical_constraint(self.value(x), names, self.mesh)
        t = x.shape[1]
        s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
        s = s * self.cfg.head_dim ** -0.5
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
        o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)
        o = with_logical_constraint(o, names, self.mesh)
        return self.out(o)


class MlpBlock:
    def __init__(self, lp, cfg: Config, mesh):
        self.mesh = mesh
        self.wi_0 = DenseGeneral(lp["wi_0"], dtype=cfg.dtype)
        self.wi_1 = DenseGeneral(lp["wi_1"], dtype=cfg.dtype)
        self.wo = DenseGeneral(lp["wo"], dtype=cfg.dtype)

    def __call__(self, x):
        h = jax.nn.silu(self.wi_0(x)) * self.wi_1(x)
        h = with_logical_constraint(h, ("activation_batch", "activation_length",
                                        "activation_mlp"), self.mesh)
        return self.wo(h)


class DecoderLayer:
    def __init__(self, lp, cfg: Config, mesh):
        self.mesh = mesh
        eps, dt = cfg.normalization_layer_epsilon, cfg.dtype
        self.pre_self_attention_norm = RMSNorm(lp["pre_self_attention_norm"], eps, dt)
        self.post_self_attention_norm = RMSNorm(lp["post_self_attention_norm"], eps, dt)
        self.self_attention = Attention(lp, cfg, mesh)
        self.mlp = MlpBlock(lp, cfg, mesh)

    def __call__(self, inputs):
        act = ("activation_batch", "activation_length", "activation_embed")
        inputs = with_logical_constraint(inputs, act, self.mesh)
        lnx = with_logical_constraint(self.pre_self_attention_norm(inputs), act, self.mesh)
        attention_lnx = with_logical_constraint(self.self_attention(lnx), act, self.mesh)
        intermediate_inputs = inputs + attention_lnx
        hidden_states = self.post_self_attention_norm(intermediate_inputs)
        hidden_states = with_logical_constraint(hidden_states, act, self.mesh)
        mlp_lnx = with_logical_constraint(self.mlp(hidden_states), act, self.mesh)
        layer_output = mlp_lnx + intermediate_inputs
        return with_logical_constraint(layer_output, act, self.mesh)


class Decoder:
    def __init__(self, params, cfg: Config, mesh):
        self.layers = [DecoderLayer(lp, cfg, mesh) for lp in params["layers"]]
        self.decoder_norm = RMSNorm(params["decoder_norm"], cfg.normalization_layer_epsilon,
                                    cfg.dtype)

    def __call__(self, y):
        for layer in self.layers:
            y = layer(y)
        return self.decoder_norm(y)


def forward_fn(cfg: Config, mesh):
    """forward(params, y [B, T, emb_dim]) -> [B, T, emb_dim]."""
    def forward(params, y):
        return Decoder(params, cfg, mesh)(y.astype(cfg.dtype))
    return forward


def dense_reference(params, y, cfg: Config):
    f = lambda a: np.asarray(jax.device_get(a)).astype(np.float64)
    p = jax.tree.map(f, params)
    x = f(y)
    eps = cfg.normalization_layer_epsilon

    def norm(v, w):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + eps) * w

    def silu(v):
        return v / (1 + np.exp(-v))

    t = x.shape[1]
    for lp in p["layers"]:
        a = norm(x, lp["pre_self_attention_norm"])
        q, k, v = (np.einsum("btd,dhk->bthk", a, lp[n]) for n in ("query", "key", "value"))
        s = np.einsum("bthd,bshd->bhts", q, k) * cfg.head_dim ** -0.5
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr = pr / pr.sum(-1, keepdims=True)
        x = x + np.einsum("bthk,hkd->btd", np.einsum("bhts,bshd->bthd", pr, v), lp["out"])
        h = norm(x, lp["post_self_attention_norm"])
        x = x + (silu(h @ lp["wi_0"]) * (h @ lp["wi_1"])) @ lp["wo"]
    return norm(x, p["decoder_norm"])
