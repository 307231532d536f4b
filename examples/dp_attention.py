#!/usr/bin/env python
"""Data-parallel attention in front of a tensor-parallel MLP, with `nvc.all_gather_v` and
`nvc.reduce_scatter_v`.

Every rank runs attention on its own sequence, and the ranks hold different numbers of tokens
(one prefilling, the others decoding: `num_rows` per rank, a traced value, below a static
capacity `max_rows`). The MLP after it is tensor-parallel (every rank holds `ffn / world`
columns), so every rank needs every rank's rows: `all_gather_v` sends each rank's valid rows
only (never the padding), every rank computes its partial MLP on all of them, and
`reduce_scatter_v` returns to each rank the sums of its own rows. The lax version gathers the
padded buffers (`lax.all_gather`) and sums them back with `lax.psum_scatter`, moving
`world * max_rows` rows both ways; the script runs both and compares the valid rows.

    python examples/dp_attention.py      # 8 CPU devices without a GPU, else every local GPU
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

MAX_ROWS, HIDDEN, FFN = 32, 128, 256


def attention(x, n, wqkv, wo):
    """Causal single-head self-attention over the first n rows of x ([MAX_ROWS, H]); rows from
    n on are padding (zero out)."""
    q, k, v = jnp.split(x @ wqkv, 3, axis=-1)
    pos = jnp.arange(x.shape[0])
    keep = (pos[None, :] <= pos[:, None]) & (pos[None, :] < n)
    s = jnp.where(keep, q @ k.T / np.sqrt(HIDDEN), -jnp.inf)
    out = x + (jax.nn.softmax(s, axis=-1) @ v) @ wo
    return jnp.where((pos < n)[:, None], out, 0)


def partial_mlp(h, w_gate, w_up, w_down):
    return (jax.nn.silu(h @ w_gate) * (h @ w_up)) @ w_down


def make_layers(mesh, comm):
    specs = dict(mesh=mesh, in_specs=(P("dp"), P("dp"), P(), P(), P(None, "dp"), P(None, "dp"),
                                      P("dp", None)), out_specs=P("dp"))

    @jax.jit
    @jax.shard_map(**specs)
    def nvcomm_layer(x, num_rows, wqkv, wo, w_gate, w_up, w_down):
        n = num_rows[0]
        h = attention(x, n, wqkv, wo)                           # this rank's rows only
        gathered, offsets, _ = nvc.all_gather_v(h, n, comm)     # every rank's valid rows
        y = partial_mlp(gathered, w_gate, w_up, w_down)         # this rank's ffn columns
        return h + nvc.reduce_scatter_v(y, offsets, comm)      # sums of this rank's rows

    @jax.jit
    @jax.shard_map(**specs)
    def lax_layer(x, num_rows, wqkv, wo, w_gate, w_up, w_down):
        n = num_rows[0]
        h = attention(x, n, wqkv, wo)
        padded = lax.all_gather(h, "dp", tiled=True)           # world * MAX_ROWS rows
        y = partial_mlp(padded, w_gate, w_up, w_down)
        out = h + lax.psum_scatter(y, "dp", tiled=True)
        return jnp.where((jnp.arange(MAX_ROWS) < n)[:, None], out, 0)

    return nvcomm_layer, lax_layer


def main() -> int:
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("dp",))
    world = mesh.size
    # rank 0 prefills a full buffer, the others decode a few tokens each
    counts = np.array([MAX_ROWS] + [1 + r % 4 for r in range(1, world)], np.int32)
    keys = jax.random.split(jax.random.key(0), 6)
    args = (jax.random.normal(keys[0], (world * MAX_ROWS, HIDDEN)), counts,
            jax.random.normal(keys[1], (HIDDEN, 3 * HIDDEN)) * HIDDEN ** -0.5,
            jax.random.normal(keys[2], (HIDDEN, HIDDEN)) * HIDDEN ** -0.5,
            jax.random.normal(keys[3], (HIDDEN, FFN)) * HIDDEN ** -0.5,
            jax.random.normal(keys[4], (HIDDEN, FFN)) * HIDDEN ** -0.5,
            jax.random.normal(keys[5], (FFN, HIDDEN)) * FFN ** -0.5)
    specs = (P("dp"), P("dp"), P(), P(), P(None, "dp"), P(None, "dp"), P("dp", None))
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]

    with nvc.Communicator(mesh, "dp") as comm:
        nvcomm_layer, lax_layer = make_layers(mesh, comm)
        ours = np.asarray(nvcomm_layer(*args)).reshape(world, MAX_ROWS, HIDDEN)
        ref = np.asarray(lax_layer(*args)).reshape(world, MAX_ROWS, HIDDEN)
        print(f"DP attention + TP MLP over {world} x {devices[0].platform} devices, rows per "
              f"rank {counts.tolist()} (capacity {MAX_ROWS}); backend {comm.backend}")
    valid = np.arange(MAX_ROWS)[None, :] < counts[:, None]
    err = float(np.linalg.norm((ours - ref)[valid]) / np.linalg.norm(ref[valid]))
    ok = bool(np.all(np.isfinite(ours))) and err < 1e-3 and not np.any(ours[~valid])
    print(f"all_gather_v + reduce_scatter_v vs lax.all_gather + lax.psum_scatter: relative L2 "
          f"difference {err:.1e} on the valid rows, padding rows zero "
          f"({'agree' if ok else 'DISAGREE'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
