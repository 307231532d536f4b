#!/usr/bin/env python
"""Tensor-parallel MLP blocks that end in `nvc.all_reduce_rms_norm`.

Each block: a column-parallel SwiGLU up-projection (every rank holds `ffn / world` columns),
a row-parallel down-projection whose per-rank partial sums are added across ranks, the
residual add and the next block's RMSNorm. With lax that end is `lax.psum` + add + RMSNorm;
here it is one call (one kernel on GPUs). The script runs both versions on the same inputs and
prints how far apart they are.

    python examples/tp_mlp.py            # 8 CPU devices without a GPU, else every local GPU
"""
import os

# 8 CPU devices when jax runs on the CPU (set before jax is imported; no effect on GPUs)
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_nvcomm as nvc  # noqa: E402

TOKENS, HIDDEN, FFN, LAYERS, EPS = 16, 256, 512, 2, 1e-6


def rms_norm(r, w):
    r32 = r.astype(jnp.float32)
    return (r32 * lax.rsqrt(jnp.mean(r32 * r32, -1, keepdims=True) + EPS) * w).astype(r.dtype)


def partial_mlp(h, w_gate, w_up, w_down):
    """This rank's share of SwiGLU(h): its ffn columns, then its rows of the down-projection."""
    return (jax.nn.silu(h @ w_gate) * (h @ w_up)) @ w_down


def make_forward(mesh, comm):
    weights = P(None, None, "tp"), P(None, None, "tp"), P(None, "tp", None), P()
    specs = dict(mesh=mesh, in_specs=(P(),) + weights, out_specs=P())

    @jax.jit
    @jax.shard_map(**specs)
    def nvcomm_forward(x, w_gate, w_up, w_down, norm_w):
        residual, h = x, rms_norm(x, norm_w[0])
        for i in range(LAYERS):
            part = partial_mlp(h, w_gate[i], w_up[i], w_down[i])
            # sum over the ranks + residual add + RMSNorm, in one call
            h, residual = nvc.all_reduce_rms_norm(part, residual, norm_w[i + 1], comm, eps=EPS)
        return h

    @jax.jit
    @jax.shard_map(**specs)
    def lax_forward(x, w_gate, w_up, w_down, norm_w):
        residual, h = x, rms_norm(x, norm_w[0])
        for i in range(LAYERS):
            part = partial_mlp(h, w_gate[i], w_up[i], w_down[i])
            residual = lax.psum(part, "tp") + residual
            h = rms_norm(residual, norm_w[i + 1])
        return h

    return nvcomm_forward, lax_forward


def main() -> int:
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("tp",))
    world = mesh.size
    keys = jax.random.split(jax.random.key(0), 5)
    scale = HIDDEN ** -0.5
    args = (jax.random.normal(keys[0], (TOKENS, HIDDEN)),
            jax.random.normal(keys[1], (LAYERS, HIDDEN, FFN)) * scale,
            jax.random.normal(keys[2], (LAYERS, HIDDEN, FFN)) * scale,
            jax.random.normal(keys[3], (LAYERS, FFN, HIDDEN)) * FFN ** -0.5,
            1 + 0.1 * jax.random.normal(keys[4], (LAYERS + 1, HIDDEN)))
    specs = (P(), P(None, None, "tp"), P(None, None, "tp"), P(None, "tp", None), P())
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]

    with nvc.Communicator(mesh, "tp") as comm:
        nvcomm_forward, lax_forward = make_forward(mesh, comm)
        ours = np.asarray(nvcomm_forward(*args))
        ref = np.asarray(lax_forward(*args))
        strategy = nvc.select_strategy(comm, (TOKENS, HIDDEN), jnp.float32)
        print(f"TP MLP, {LAYERS} layers, {TOKENS} tokens x hidden {HIDDEN}, ffn {FFN} over "
              f"{world} x {devices[0].platform} devices; backend {comm.backend}, strategy "
              f"{strategy}")
    err = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    ok = bool(np.all(np.isfinite(ours))) and err < 1e-3
    print(f"all_reduce_rms_norm vs lax.psum + add + RMSNorm: relative L2 difference "
          f"{err:.1e} ({'agree' if ok else 'DISAGREE'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
