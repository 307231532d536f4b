#!/usr/bin/env python
"""An expert-parallel MoE layer with `nvc.moe_dispatch` / `nvc.moe_combine`.

Every rank holds its own tokens and `experts / world` of the experts. The router picks top-k
experts per token; `moe_dispatch` sends each token once to every rank that owns one of its
experts and hands each local expert its rows; after the expert FFNs, `moe_combine` brings the
rows back and sums them with the router weights. The lax version of the same layer gathers
every rank's tokens (`lax.all_gather`), runs the local experts on all of them and returns each
rank its tokens' sums (`lax.psum_scatter`): the script runs both and prints how far apart they
are.

    python examples/ep_moe.py            # 8 CPU devices without a GPU, else every local GPU
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

TOKENS, HIDDEN, FFN, EXPERTS_PER_RANK, TOP_K = 8, 128, 64, 4, 2


def route(x, w_router):
    """Top-k experts of each token and their weights (softmax over the k)."""
    logits = x @ w_router
    top, ids = lax.top_k(logits, TOP_K)
    return ids.astype(jnp.int32), jax.nn.softmax(top, axis=-1)


def experts_ffn(rows, w_gate, w_up, w_down):
    """SwiGLU of every local expert on its rows: rows [L, n, H], weights [L, H, F] / [L, F, H]."""
    g = jnp.einsum("lnh,lhf->lnf", rows, w_gate)
    u = jnp.einsum("lnh,lhf->lnf", rows, w_up)
    return jnp.einsum("lnf,lfh->lnh", jax.nn.silu(g) * u, w_down)


def make_layers(mesh, moe):
    specs = dict(mesh=mesh, in_specs=(P("ep"), P(), P("ep"), P("ep"), P("ep")),
                 out_specs=P("ep"))

    @jax.jit
    @jax.shard_map(**specs)
    def nvcomm_layer(x, w_router, w_gate, w_up, w_down):
        ids, weights = route(x, w_router)
        d = nvc.moe_dispatch(x, ids, moe)   # d.expert_x: [local experts, world * tokens, H]
        # rows past d.expert_counts[e] are unspecified: zero them before the FFN
        valid = jnp.arange(d.expert_x.shape[1])[None, :] < d.expert_counts[:, None]
        rows = jnp.where(valid[..., None], d.expert_x, 0)
        return nvc.moe_combine(experts_ffn(rows, w_gate, w_up, w_down), weights, d.handle, moe)

    @jax.jit
    @jax.shard_map(**specs)
    def lax_layer(x, w_router, w_gate, w_up, w_down):
        ids, weights = route(x, w_router)
        rank = lax.axis_index("ep")
        local = EXPERTS_PER_RANK
        xs = lax.all_gather(x, "ep", tiled=True)            # every rank's tokens
        ids_all = lax.all_gather(ids, "ep", tiled=True)
        w_all = lax.all_gather(weights, "ep", tiled=True)
        y = experts_ffn(jnp.broadcast_to(xs, (local,) + xs.shape), w_gate, w_up, w_down)
        mine = ids_all[None] == rank * local + jnp.arange(local)[:, None, None]  # [L, n, K]
        gate = jnp.sum(jnp.where(mine, w_all[None], 0), axis=-1)            # [L, n]
        part = jnp.einsum("ln,lnh->nh", gate, y)
        return lax.psum_scatter(part, "ep", tiled=True)   # this rank's tokens, summed

    return nvcomm_layer, lax_layer


def main() -> int:
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("ep",))
    world = mesh.size
    experts = EXPERTS_PER_RANK * world
    keys = jax.random.split(jax.random.key(0), 5)
    args = (jax.random.normal(keys[0], (world * TOKENS, HIDDEN)),
            jax.random.normal(keys[1], (HIDDEN, experts)),
            jax.random.normal(keys[2], (experts, HIDDEN, FFN)) * HIDDEN ** -0.5,
            jax.random.normal(keys[3], (experts, HIDDEN, FFN)) * HIDDEN ** -0.5,
            jax.random.normal(keys[4], (experts, FFN, HIDDEN)) * FFN ** -0.5)
    specs = (P("ep"), P(), P("ep"), P("ep"), P("ep"))
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]

    with nvc.MoECommunicator(mesh, "ep", num_experts=experts, top_k=TOP_K, max_tokens=TOKENS,
                             hidden=HIDDEN, dtype=jnp.float32) as moe:
        nvcomm_layer, lax_layer = make_layers(mesh, moe)
        ours = np.asarray(nvcomm_layer(*args))
        ref = np.asarray(lax_layer(*args))
        print(f"EP MoE layer, {TOKENS} tokens per rank x hidden {HIDDEN}, {experts} experts "
              f"top-{TOP_K} over {world} x {devices[0].platform} devices; backend {moe.backend}")
    err = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    ok = bool(np.all(np.isfinite(ours))) and err < 1e-3
    print(f"moe_dispatch + moe_combine vs lax.all_gather + lax.psum_scatter: relative L2 "
          f"difference {err:.1e} ({'agree' if ok else 'DISAGREE'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
