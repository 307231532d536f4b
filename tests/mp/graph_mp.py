"""CUDA-graph (XLA command buffer) check: a jitted fori_loop of all_reduce / fused / all_gather
calls. With --xla_gpu_enable_command_buffer including CUSTOM_CALL and WHILE, XLA records the
loop body into a CUDA graph once and replays it on the device, so our FFI handler runs far fewer
times than the kernels do; correct results then prove that the per-call state advances on the
device. Prints the handler count against the number of calls. Also runs on CPU (no graphs).
  python -m jax_nvcomm.launch -n 2 --share-gpu tests/mp/graph_mp.py
"""
import os

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

nvc = init()
iters = arg("iters", 200)
mesh = mesh1d()
W = mesh.shape["x"]
rng = np.random.default_rng(7)

with nvc.Communicator(mesh, "x", max_message_bytes=1 << 20) as comm:
    T, H = 4, 256

    def body(v):
        def step(i, carry):
            a, b = carry
            a = nvc.all_reduce(a, comm, strategy="oneshot") * (1.0 / W) + 1.0
            n, b = nvc.all_reduce_rms_norm(a * 0.0 + b, b * 0.0, jnp.ones((H,), a.dtype), comm,
                                           strategy="twoshot")           # b <- sum_r b_r
            b = b * (1.0 / W) + 2.0
            return lax.pcast(a, "x", to="varying"), b
        a, b = lax.fori_loop(0, iters, step, (v, v))
        g = nvc.all_gather(a, comm)
        return a[None], b[None], g[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P("x"),) * 3))
    host = rng.integers(-4, 4, size=(W * T, H)).astype(np.float32)
    x = global_array(mesh, P("x"), host)
    before = sum(comm.host_calls().values())
    execs = 3
    for _ in range(execs):
        a, b, g = f(x)
        jax.block_until_ready((a, b, g))
    calls = sum(comm.host_calls().values()) - before
    kernel_calls = execs * (2 * iters + 1) * len(comm.host_calls())
    # Every iteration: a <- sum_r a_r / W + 1 and b <- sum_r b_r / W + 2. Rank r starts with
    # x_r; after step i (1-based) every rank holds mean_r(x_r) + i (a) and + 2i (b): each
    # iteration's value differs from every earlier one, so a kernel that read a stale or
    # replayed buffer (the previous iteration's data) ends off by at least 1 (atol 1e-3 leaves room
    # for the rounding of 1/W when W is not a power of two).
    mean = host.reshape(W, T, H).astype(np.float64).mean(0)
    exp_a = np.tile((mean + iters)[None], (W, 1, 1))
    exp_b = np.tile((mean + 2 * iters)[None], (W, 1, 1))
    check_shards(a, exp_a, rtol=0, atol=1e-3, what="fori_loop all_reduce")
    check_shards(b, exp_b, rtol=0, atol=1e-3, what="fori_loop fused residual_out")
    check_shards(g, np.tile(np.tile(mean + iters, (W, 1))[None], (W, 1, 1)), rtol=0, atol=1e-3,
                 what="all_gather after loop")
    rank_print(f"graph check: {kernel_calls} kernel calls, FFI handler ran {calls} times "
               f"({'CUDA graph replay' if calls < kernel_calls else 'no replay (handler per call)'})")
    assert not comm.errors(), comm.errors()

# MoE dispatch + combine in the same kind of loop: identity experts, combine weights 1/K, so each
# step maps x -> x exactly; adding 1 per step makes every step's rows distinct, so a replay that
# read a stale round's rows (or a stale count) would be caught. Routing rotates every step.
E, K, TM, HM = 4 * W, 2, 8, 128
with nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=TM, hidden=HM,
                         dtype=jnp.float32) as moe:
    def moe_body(v, ids):
        w = jnp.full((TM, K), 1.0 / K, jnp.float32)

        def step(i, x):
            d = nvc.moe_dispatch(x, (ids + i) % E, moe)
            y = nvc.moe_combine(d.expert_x, w, d.handle, moe)
            return y + 1.0
        return lax.fori_loop(0, iters, step, v)

    fm = jax.jit(jax.shard_map(moe_body, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
    hx = rng.integers(-8, 8, size=(W * TM, HM)).astype(np.float32)
    hids = np.stack([rng.choice(E, K, replace=False) for _ in range(W * TM)]).astype(np.int32)
    before = sum(moe.host_calls().values())
    out = fm(global_array(mesh, P("x"), hx), global_array(mesh, P("x"), hids))
    jax.block_until_ready(out)
    calls = sum(moe.host_calls().values()) - before
    kernel_calls = 2 * iters * len(moe.host_calls())
    check_shards(out, hx + iters, rtol=0, atol=0, what="fori_loop moe dispatch+combine")
    rank_print(f"moe graph check: {kernel_calls} dispatch/combine calls, FFI handlers ran {calls} "
               f"times ({'CUDA graph replay' if calls < kernel_calls else 'no replay'})")
    assert not moe.errors(), moe.errors()
rank_print("PASS")
