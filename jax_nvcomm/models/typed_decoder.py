"""Decoder layers (plain JAX, nothing of jax_nvcomm in them) written with tensor parallelism as sharding in types (Explicit mesh axes, no
shard_map, no psum), in the styles of public JAX serving and example code (our own code):

  - `SglStyle`: sglang-jax's way: a `Linear` module holding a weight with a PartitionSpec, its
    product `lax.dot_general(x, w, ..., out_sharding=NamedSharding(mesh, P("data", None)))`
    (row-parallel: weight P("tensor", None)); the decoder layer's `residual = hidden +
    residual` then an RMSNorm; a ("data", "tensor") mesh.
  - `EinsumStyle`: jax-llm-examples' way: an `einsum(subscripts, *ops, out_sharding=)` helper,
    weights with head dims ([hidden, heads, head_dim]), an Explicit ("x", "y", "z") mesh with
    the batch on "x" and tensor parallelism over ("y", "z").
  - `NnxStyle`: Flax-NNX-like modules (plain classes, no flax; parameters carry their sharding
    as metadata, as nnx.with_partitioning does), `jnp.dot(..., out_sharding=)`, a ("data",
    "model") mesh.
  - `MaxTextStyle`: MaxText's dense layers: Auto mesh axes ("data", "tensor"), logical axis
    names mapped by rules, `with_sharding_constraint` on the activations; XLA chooses the rest.

Each model maps hidden states [batch, seq, hidden] (or [tokens, hidden]) to the next hidden
states through `layers` decoder layers: attention (heads sharded), the o_proj row-parallel
product, `+ residual`, RMSNorm, the MLP (gate/up column-parallel, down row-parallel),
`+ residual`, RMSNorm. The RMSNorm is `(x * rsqrt(mean(x * x) + eps)) * w` with a float32 upcast.
tests/test_jit_types.py runs them under jax.jit and nvc.jit; `bench compile` times both.
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
    hidden: int = 256
    heads: int = 8
    head_dim: int = 32
    ffn: int = 512
    layers: int = 2
    eps: float = 1e-6
    dtype: object = jnp.float32


def explicit_mesh(shape, names):
    n = int(np.prod(shape))
    devs = np.array(jax.devices()[:n]).reshape(shape)
    return jax.sharding.Mesh(devs, names, axis_types=(AxisType.Explicit,) * len(names))


def rms_norm(x, w, eps):
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w).astype(x.dtype)


def _init(rng, shape, dtype, scale):
    return jnp.asarray(rng.normal(size=shape) * scale, dtype)


# ---------------------------------------------------------------------------------------------
# sglang-jax style

class Linear:
    """y = x @ w with the output sharding given (sglang-jax's LinearBase: out_sharding)."""

    def __init__(self, mesh, w, w_spec, out_spec):
        self.mesh = mesh
        self.w = jax.device_put(w, NamedSharding(mesh, w_spec))
        self.out_spec = out_spec

    def __call__(self, x, w):
        return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                               out_sharding=NamedSharding(self.mesh, self.out_spec))


class SglStyle:
    """Tokens [T, hidden] sharded on "data"; heads and the MLP's hidden units on "tensor"."""

    def __init__(self, cfg, mesh, rng):
        self.cfg, self.mesh = cfg, mesh
        H, F, QD = cfg.hidden, cfg.ffn, cfg.heads * cfg.head_dim
        s = 1 / np.sqrt(H)
        self.layers = []
        for _ in range(cfg.layers):
            self.layers.append(dict(
                **{n: Linear(mesh, _init(rng, (H, QD), cfg.dtype, s), P(None, "tensor"),
                             P("data", "tensor")) for n in ("q", "k", "v")},
                o=Linear(mesh, _init(rng, (QD, H), cfg.dtype, s), P("tensor", None),
                         P("data", None)),
                **{n: Linear(mesh, _init(rng, (H, F), cfg.dtype, s), P(None, "tensor"),
                             P("data", "tensor")) for n in ("gate", "up")},
                down=Linear(mesh, _init(rng, (F, H), cfg.dtype, 1 / np.sqrt(F)),
                            P("tensor", None), P("data", None)),
                ln1=jnp.asarray(1 + 0.1 * rng.normal(size=(H,)), jnp.float32),
                ln2=jnp.asarray(1 + 0.1 * rng.normal(size=(H,)), jnp.float32)))

    def params(self):
        return [{k: (v.w if isinstance(v, Linear) else v) for k, v in lay.items()}
                for lay in self.layers]

    def __call__(self, params, hidden, residual):
        cfg = self.cfg
        T = hidden.shape[0]
        for lay, p in zip(self.layers, params):
            # attention over each token's own heads (a decode step with no cache: enough to
            # give the o_proj its head-sharded input)
            heads = NamedSharding(self.mesh, P("data", "tensor", None))
            q, k, v = (lay[n](hidden, p[n]).reshape(T, cfg.heads, cfg.head_dim,
                                                     out_sharding=heads) for n in "qkv")
            a = jax.nn.softmax((q * k).astype(jnp.float32), axis=-1).astype(v.dtype) * v
            a = a.reshape(T, cfg.heads * cfg.head_dim,
                          out_sharding=NamedSharding(self.mesh, P("data", "tensor")))
            hidden = lay["o"](a, p["o"])
            residual = hidden + residual
            hidden = rms_norm(residual, p["ln2"], cfg.eps)
            g, u = lay["gate"](hidden, p["gate"]), lay["up"](hidden, p["up"])
            hidden = lay["down"](jax.nn.silu(g) * u, p["down"])
            residual = hidden + residual
            hidden = rms_norm(residual, p["ln1"], cfg.eps)
        return hidden, residual


# ---------------------------------------------------------------------------------------------
# jax-llm-examples style

def einsum(subscripts, *operands, out_sharding=None):
    """The example code's helper: jnp.einsum with the output's sharding named."""
    return jnp.einsum(subscripts, *operands, out_sharding=out_sharding)


class EinsumStyle:
    """Activations [batch, seq, hidden] with the batch on "x"; heads and the MLP's hidden
    units over the tensor axes ("y", "z")."""

    TP = ("y", "z")

    def __init__(self, cfg, mesh, rng):
        self.cfg, self.mesh = cfg, mesh
        H, F, N, D = cfg.hidden, cfg.ffn, cfg.heads, cfg.head_dim
        s = 1 / np.sqrt(H)
        tp = self.TP

        def put(a, spec):
            return jax.device_put(a, NamedSharding(mesh, spec))

        self._params = [dict(
            q=put(_init(rng, (H, N, D), cfg.dtype, s), P(None, tp, None)),
            k=put(_init(rng, (H, N, D), cfg.dtype, s), P(None, tp, None)),
            v=put(_init(rng, (H, N, D), cfg.dtype, s), P(None, tp, None)),
            o=put(_init(rng, (N, D, H), cfg.dtype, s), P(tp, None, None)),
            gate=put(_init(rng, (H, F), cfg.dtype, s), P(None, tp)),
            up=put(_init(rng, (H, F), cfg.dtype, s), P(None, tp)),
            down=put(_init(rng, (F, H), cfg.dtype, 1 / np.sqrt(F)), P(tp, None)),
            attn_norm=jnp.asarray(1 + 0.1 * rng.normal(size=(H,)), jnp.float32),
            mlp_norm=jnp.asarray(1 + 0.1 * rng.normal(size=(H,)), jnp.float32))
            for _ in range(cfg.layers)]

    def params(self):
        return self._params

    def __call__(self, params, x, residual):
        cfg, tp = self.cfg, self.TP
        act = P("x", None, None)
        heads = P("x", None, tp, None)
        for p in params:
            q = einsum("btd,dnh->btnh", x, p["q"], out_sharding=heads)
            k = einsum("btd,dnh->btnh", x, p["k"], out_sharding=heads)
            v = einsum("btd,dnh->btnh", x, p["v"], out_sharding=heads)
            s = einsum("btnh,bsnh->bnts", q, k, out_sharding=P("x", tp, None, None))
            w = jax.nn.softmax(s.astype(jnp.float32) / np.sqrt(cfg.head_dim), axis=-1)
            a = einsum("bnts,bsnh->btnh", w.astype(v.dtype), v, out_sharding=heads)
            attn = einsum("btnh,nhd->btd", a, p["o"], out_sharding=act)
            residual = residual + attn
            x = rms_norm(residual, p["attn_norm"], cfg.eps)
            g = einsum("btd,df->btf", x, p["gate"], out_sharding=P("x", None, tp))
            u = einsum("btd,df->btf", x, p["up"], out_sharding=P("x", None, tp))
            ff = einsum("btf,fd->btd", jax.nn.silu(g) * u, p["down"], out_sharding=act)
            residual = residual + ff
            x = rms_norm(residual, p["mlp_norm"], cfg.eps)
        return x, residual


# ---------------------------------------------------------------------------------------------
# MaxText dense style (Auto axes)

RULES = (("activation_batch", "data"), ("activation_embed", None), ("activation_mlp", "tensor"),
         ("activation_heads", "tensor"), ("embed", None), ("mlp", "tensor"), ("heads", "tensor"),
         ("kv", None))


def logical_to_mesh(names, rules=RULES):
    """PartitionSpec of logical axis names by the rules (the first rule for a name wins)."""
    table = {}
    for k, v in rules:
        table.setdefault(k, v)
    return P(*[table.get(n) for n in names])


class MaxTextStyle:
    """Auto mesh axes ("data", "tensor"): weights placed by logical names, activations
    constrained with `with_sharding_constraint` of logical names; XLA chooses the rest."""

    def __init__(self, cfg, mesh, rng):
        self.cfg, self.mesh = cfg, mesh
        H, F, N, D = cfg.hidden, cfg.ffn, cfg.heads, cfg.head_dim
        s = 1 / np.sqrt(H)

        def put(a, *names):
            return jax.device_put(a, NamedSharding(mesh, logical_to_mesh(names)))

        self._params = [dict(
            query=put(_init(rng, (H, N, D), cfg.dtype, s), "embed", "heads", "kv"),
            key=put(_init(rng, (H, N, D), cfg.dtype, s), "embed", "heads", "kv"),
            value=put(_init(rng, (H, N, D), cfg.dtype, s), "embed", "heads", "kv"),
            out=put(_init(rng, (N, D, H), cfg.dtype, s), "heads", "kv", "embed"),
            wi_0=put(_init(rng, (H, F), cfg.dtype, s), "embed", "mlp"),
            wi_1=put(_init(rng, (H, F), cfg.dtype, s), "embed", "mlp"),
            wo=put(_init(rng, (F, H), cfg.dtype, 1 / np.sqrt(F)), "mlp", "embed"),
            pre_norm=jnp.asarray(1 + 0.1 * rng.normal(size=(H,)), jnp.float32),
            post_norm=jnp.asarray(1 + 0.1 * rng.normal(size=(H,)), jnp.float32))
            for _ in range(cfg.layers)]

    def params(self):
        return self._params

    def _c(self, x, *names):
        return lax.with_sharding_constraint(x, NamedSharding(self.mesh, logical_to_mesh(names)))

    def __call__(self, params, x, residual):
        cfg, c = self.cfg, self._c
        bte = ("activation_batch", None, "activation_embed")
        for p in params:
            q = c(jnp.einsum("btd,dnh->btnh", x, p["query"]), "activation_batch", None,
                  "activation_heads", None)
            k = c(jnp.einsum("btd,dnh->btnh", x, p["key"]), "activation_batch", None,
                  "activation_heads", None)
            v = c(jnp.einsum("btd,dnh->btnh", x, p["value"]), "activation_batch", None,
                  "activation_heads", None)
            w = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k).astype(jnp.float32)
                               / np.sqrt(cfg.head_dim), axis=-1)
            a = c(jnp.einsum("bnts,bsnh->btnh", w.astype(v.dtype), v), "activation_batch", None,
                  "activation_heads", None)
            attn = c(jnp.einsum("btnh,nhd->btd", a, p["out"]), *bte)
            residual = c(attn + residual, *bte)
            x = rms_norm(residual, p["post_norm"], cfg.eps)
            h = jax.nn.silu(jnp.einsum("btd,df->btf", x, p["wi_0"])) * \
                jnp.einsum("btd,df->btf", x, p["wi_1"])
            h = c(h, "activation_batch", None, "activation_mlp")
            mlp = c(jnp.einsum("btf,fd->btd", h, p["wo"]), *bte)
            residual = c(mlp + residual, *bte)
            x = rms_norm(residual, p["pre_norm"], cfg.eps)
        return x, residual


# ---------------------------------------------------------------------------------------------
# Flax-NNX style (no flax: plain classes; each parameter carries its sharding as metadata)

class Param:
    """A parameter with its logical sharding as metadata (nnx.Param + nnx.with_partitioning)."""

    def __init__(self, value, sharding):
        self.value, self.sharding = value, sharding


class NnxLinear:
    def __init__(self, mesh, rng, din, dout, dtype, sharding, out_sharding):
        self.kernel = Param(jax.device_put(_init(rng, (din, dout), dtype, 1 / np.sqrt(din)),
                                           NamedSharding(mesh, P(*sharding))), sharding)
        self.out_sharding = NamedSharding(mesh, P(*out_sharding))

    def __call__(self, x, kernel=None):  # (kernel: the value to use, as nnx.split/merge gives)
        k = self.kernel.value if kernel is None else kernel
        return jnp.dot(x, k, out_sharding=self.out_sharding)


class NnxRMSNorm:
    def __init__(self, dim, eps, rng):
        self.scale = Param(jnp.asarray(1 + 0.1 * rng.normal(size=(dim,)), jnp.float32),
                           (None,))
        self.eps = eps

    def __call__(self, x, scale=None):
        return rms_norm(x, self.scale.value if scale is None else scale, self.eps)


class NnxStyle:
    """A ("data", "model") mesh; an MLP block per layer: up (column-parallel), down
    (row-parallel), `x = x + mlp(norm(x))`-style residual with the norm after the add."""

    def __init__(self, cfg, mesh, rng):
        self.cfg = cfg
        H, F, dt = cfg.hidden, cfg.ffn, cfg.dtype
        self.blocks = [dict(
            up=NnxLinear(mesh, rng, H, F, dt, (None, "model"), ("data", "model")),
            down=NnxLinear(mesh, rng, F, H, dt, ("model", None), ("data", None)),
            norm=NnxRMSNorm(H, cfg.eps, rng)) for _ in range(cfg.layers)]

    def params(self):
        return [{k: (v.kernel.value if isinstance(v, NnxLinear) else v.scale.value)
                 for k, v in b.items()} for b in self.blocks]

    def __call__(self, params, x, residual):
        for b, p in zip(self.blocks, params):
            residual = b["down"](jax.nn.gelu(b["up"](x, p["up"])), p["down"]) + residual
            x = b["norm"](residual, p["norm"])
        return x, residual
