"""A tensor-parallel Llama-style decoder written the way JAX inference code writes one
(JetStream's experimental inference package is the model: small modules holding their weights,
a row-parallel `Linear` that ends in `lax.psum` over the TP axes, the residual add in the
decoder layer and the RMSNorm, with a float32 upcast and float32 weight, in the next module).
Plain lax: nothing of jax_nvcomm in it. tests/test_jit.py runs it under jax.jit and nvc.jit.

Inside `shard_map` over every TP axis: heads and the MLP's hidden units are split over the TP
group (`tp` = the tuple of its mesh axes); activations [batch, seq, hidden] are replicated.
`tp=None` is the dense model (no collective): the reference.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config:
    hidden: int = 64
    heads: int = 8
    head_dim: int = 8
    ffn: int = 128
    layers: int = 2
    eps: float = 1e-6
    dtype: object = jnp.bfloat16       # activations and linear weights
    norm_dtype: object = jnp.float32   # norm weights (JetStream keeps them float32)


class RMSNorm:
    """y = weight * (x / rms(x)) with the statistics in float32."""

    def __init__(self, weight, eps):
        self.weight, self.eps = weight, eps

    def __call__(self, x):
        in_dtype = x.dtype
        x = x.astype(jnp.float32)
        var = jnp.mean(lax.square(x), axis=-1, keepdims=True)
        x = x * lax.rsqrt(var + self.eps)
        return self.weight * x.astype(in_dtype)


class Linear:
    """x @ w; a row-parallel one (`reduce=True`) sums the partial products over `tp`."""

    def __init__(self, w, tp=None, reduce=False):
        self.w, self.tp, self.reduce = w, tp, reduce

    def __call__(self, x):
        x = x.astype(self.w.dtype)
        out = jnp.matmul(x, self.w, preferred_element_type=self.w.dtype)
        if self.reduce and self.tp is not None:
            out = lax.psum(out, self.tp)
        return out


class Attention:
    def __init__(self, p, cfg, tp, n_heads):
        self.cfg, self.n = cfg, n_heads
        self.q, self.k, self.v = (Linear(p[n], tp) for n in ("wq", "wk", "wv"))
        self.o = Linear(p["wo"], tp, reduce=True)

    def __call__(self, x):
        b, s, _ = x.shape
        d = self.cfg.head_dim
        q, k, v = (f(x).reshape(b, s, self.n, d) for f in (self.q, self.k, self.v))
        logits = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32) / d ** 0.5
        mask = jnp.tril(jnp.ones((s, s), bool))
        logits = jnp.where(mask, logits, -1e9)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        out = jnp.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, s, self.n * d)
        return self.o(out)


class MLP:
    def __init__(self, p, tp):
        self.gate, self.up = Linear(p["w_gate"], tp), Linear(p["w_up"], tp)
        self.down = Linear(p["w_down"], tp, reduce=True)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class DecoderLayer:
    def __init__(self, p, cfg, tp, n_heads):
        self.input_norm = RMSNorm(p["input_norm"], cfg.eps)
        self.attn = Attention(p, cfg, tp, n_heads)
        self.post_attn_norm = RMSNorm(p["post_attn_norm"], cfg.eps)
        self.mlp = MLP(p, tp)
        self.dtype = cfg.dtype

    def __call__(self, hidden, residual):
        """(hidden, residual) -> (hidden, residual): hidden is the previous layer's MLP
        output (already summed over tp), added to the residual here."""
        if residual is not None:
            hidden = hidden + residual
        residual = hidden
        hidden = self.input_norm(hidden).astype(self.dtype)
        hidden = self.attn(hidden)
        hidden = hidden + residual
        residual = hidden
        hidden = self.post_attn_norm(hidden).astype(self.dtype)
        return self.mlp(hidden), residual


class Decoder:
    def __init__(self, params, cfg, tp=None, tp_size=1):
        n_heads = cfg.heads // tp_size
        self.layers = [DecoderLayer(p, cfg, tp, n_heads) for p in params["layers"]]
        self.final_norm = RMSNorm(params["final_norm"], cfg.eps)
        self.dtype = cfg.dtype

    def __call__(self, x):
        hidden, residual = x, None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        return self.final_norm(hidden + residual).astype(self.dtype)


def init_params(key, cfg):
    """Random weights, global shapes."""
    H, F, HD = cfg.hidden, cfg.ffn, cfg.heads * cfg.head_dim
    layers = []
    for k in jax.random.split(key, cfg.layers):
        ks = jax.random.split(k, 9)

        def w(i, shape):
            return (jax.random.normal(ks[i], shape, jnp.float32) / shape[0] ** 0.5).astype(
                cfg.dtype)
        layers.append(dict(
            wq=w(0, (H, HD)), wk=w(1, (H, HD)), wv=w(2, (H, HD)), wo=w(3, (HD, H)),
            w_gate=w(4, (H, F)), w_up=w(5, (H, F)), w_down=w(6, (F, H)),
            input_norm=(1 + 0.1 * jax.random.normal(ks[7], (H,))).astype(cfg.norm_dtype),
            post_attn_norm=(1 + 0.1 * jax.random.normal(ks[8], (H,))).astype(cfg.norm_dtype)))
    final = (1 + 0.1 * jax.random.normal(jax.random.fold_in(key, 7), (H,))).astype(
        cfg.norm_dtype)
    return dict(layers=layers, final_norm=final)


def param_specs(params, tp):
    """Column-parallel q/k/v/gate/up (output dim split over tp), row-parallel o/down (input
    dim split), norms replicated."""
    col, row = P(None, tp), P(tp, None)
    spec = dict(wq=col, wk=col, wv=col, wo=row, w_gate=col, w_up=col, w_down=row,
                input_norm=P(), post_attn_norm=P())
    return dict(layers=[dict(spec) for _ in params["layers"]], final_norm=P())


def sharded_forward(mesh, cfg, tp):
    """(params, x) -> y: the decoder inside shard_map over the mesh, TP over `tp`."""
    tp_size = 1
    for a in tp:
        tp_size *= mesh.shape[a]

    def body(params, x):
        return Decoder(params, cfg, tp, tp_size)(x)

    def forward(params, x):
        return jax.shard_map(body, mesh=mesh, in_specs=(param_specs(params, tp), P()),
                             out_specs=P())(params, x)
    return forward


def dense_forward(cfg):
    return lambda params, x: Decoder(params, cfg)(x)
