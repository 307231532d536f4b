"""nvc.moe_layer across processes (or the GPUs of one process) against the float64 layer
reference (tests/helpers.py): random routing, every token on the last rank's experts, ranks
with no tokens, num_tokens < max_tokens, bfloat16 and float32, `rounds` rounds of fresh
routing per config; then a CUDA-graph loop (--graph_iters calls of the layer in one jitted
fori_loop, recorded into XLA's command buffers on GPUs) against the reference applied as
many times.
  python -m jax_nvcomm.launch -n 4 --share-gpu tests/mp/moe_layer_mp.py [--rounds=3]
  python tests/mp/moe_layer_mp.py --small=1   (one small config, one round: for memcheck)
  --configs=N runs the last N of the four configs (2: the skewed bf16 and the float32 one)
"""
import os
import sys

flags = os.environ.get("XLA_FLAGS", "")
if "xla_gpu_enable_command_buffer" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,"
                               "CONDITIONAL --xla_gpu_graph_min_graph_size=1").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from common import arg, check_shards, global_array, init, mesh1d, rank_print  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import np_moe_layer_reference  # noqa: E402

nvc = init()
rounds = arg("rounds", 3)
graph_iters = arg("graph_iters", 20)
small = arg("small", 0)
configs = arg("configs", 4)
mesh = mesh1d()
W = mesh.shape["x"]
rank_print(f"layout: {jax.process_count()} processes x {jax.local_device_count()} devices = "
           f"world {W}")
rng = np.random.default_rng(2024)
TOL = {"float32": (1e-4, 1e-4), "bfloat16": (3e-2, 2e-2)}


def f64(a):
    return np.asarray(a, np.float64)


def weights(E, H, F, dtype):
    cast = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731
    return (cast(rng.standard_normal((E, H, F)) / np.sqrt(H)),
            cast(rng.standard_normal((E, H, F)) / np.sqrt(H)),
            cast(rng.standard_normal((E, F, H)) / np.sqrt(F)))


def routing(T, E, K, mode):
    L = E // W
    if mode == "one_rank":
        return np.stack([(W - 1) * L + rng.choice(L, K, replace=False)
                         for _ in range(W * T)]).astype(np.int32)
    return np.stack([rng.choice(E, K, replace=False) for _ in range(W * T)]).astype(np.int32)


def one_config(E, K, T, H, F, dtype, mode, nt_mode, n_rounds):
    name = f"E={E} K={K} T={T} H={H} F={F} {dtype} {mode} nt={nt_mode}"
    dt = jnp.dtype(dtype)
    with nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                             dtype=dt) as moe:
        def f(x, ids, w, nt, wg, wu, wd):
            return nvc.moe_layer(x.astype(dt), ids, w, wg.astype(dt), wu.astype(dt),
                                 wd.astype(dt), moe, num_tokens=nt[0]).astype(jnp.float32)

        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 7, out_specs=P("x")))
        wg, wu, wd = weights(E, H, F, dt)
        gw = [global_array(mesh, P("x"), a) for a in (wg, wu, wd)]
        for _ in range(n_rounds):
            x = np.asarray(jnp.asarray(rng.standard_normal((W * T, H)), dt).astype(jnp.float32))
            ids = routing(T, E, K, mode)
            w = rng.random((W * T, K)).astype(np.float32)
            if nt_mode == "full":
                nt = np.full((W,), T, np.int32)
            else:  # some ranks send nothing, the others part of their rows
                nt = rng.integers(0, T + 1, size=W).astype(np.int32)
                nt[rng.random(W) < 0.5] = 0
            ref = np_moe_layer_reference(f64(x), ids, w, nt, f64(wg), f64(wu), f64(wd), W)
            y = g(*(global_array(mesh, P("x"), a) for a in (x, ids, w, nt)), *gw)
            rtol, atol = TOL[dt.name]
            # the output's scale over the rows that have tokens (rows past num_tokens are exact
            # zeros, checked below: counted in, they would shrink the bfloat16 tolerance)
            live = ref[np.any(ref != 0, axis=1)]
            scale = float(np.sqrt(np.mean(live ** 2))) if live.size else 1.0
            check_shards(y, ref, rtol=rtol, atol=atol * scale, what=name)
            for sh in y.addressable_shards:  # rows past num_tokens: exactly zero
                r = (sh.index[0].start or 0) // T
                tail = np.asarray(sh.data)[int(nt[r]):]
                if np.any(tail != 0):
                    raise AssertionError(f"{name}: rank {r} rows >= num_tokens not zero")
        rank_print(f"PASS moe_layer {name} x{n_rounds}")


def graph_loop(E, K, T, H, F, iters):
    """iters layer calls in one jitted fori_loop, x <- layer(x) / norm: XLA records the loop
    body (our dispatch and combine kernels, the expert products) into a command buffer on
    GPUs and replays it; every call's per-call state lives on the device."""
    dt = jnp.dtype(jnp.float32)
    with nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                             dtype=dt) as moe:
        def body(x, ids, w, wg, wu, wd):
            def step(i, x):
                y = nvc.moe_layer(x, ids, w, wg, wu, wd, moe)
                return y * lax.rsqrt(jnp.mean(y * y, axis=1, keepdims=True) + 1e-6)
            return lax.fori_loop(0, iters, step, x)

        g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
        wg, wu, wd = weights(E, H, F, dt)
        x = rng.standard_normal((W * T, H)).astype(np.float32)
        ids = routing(T, E, K, "random")
        w = rng.random((W * T, K)).astype(np.float32)
        ref = f64(x)
        nt = np.full((W,), T)
        for _ in range(iters):
            y = np_moe_layer_reference(ref, ids, w, nt, f64(wg), f64(wu), f64(wd), W)
            ref = y / np.sqrt(np.mean(y * y, axis=1, keepdims=True) + 1e-6)
        args = [global_array(mesh, P("x"), a) for a in (x, ids, w, wg, wu, wd)]
        for _ in range(2):  # the second run replays the recorded graph
            # float32 products in full float32 (XLA's default on GPUs is TF32, whose rounding
            # the loop compounds over its iterations past the tolerance)
            with jax.default_matmul_precision("highest"):
                out = g(*args)
            check_shards(out, ref, rtol=2e-3, atol=2e-3, what=f"graph loop x{iters}")
        rank_print(f"PASS moe_layer graph loop x{iters} (2 runs)")


if small:
    one_config(2 * W, 2, 4, 64, 32, "bfloat16", "random", "full", 1)
else:
    for E, K, T, H, F, dtype, mode, ntm in [
            (4 * W, 4, 8, 256, 128, "bfloat16", "random", "full"),
            (4 * W, 4, 8, 256, 128, "bfloat16", "random", "partial"),
            (2 * W, 2, 6, 128, 64, "bfloat16", "one_rank", "full"),
            (8 * W, 8, 5, 128, 96, "float32", "random", "partial")][4 - configs:]:
        one_config(E, K, T, H, F, dtype, mode, ntm, rounds)
    if graph_iters:
        graph_loop(4 * W, 2, 4, 128, 64, graph_iters)
rank_print("PASS moe_layer_mp")
