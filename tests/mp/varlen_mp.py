"""all_gather_v / reduce_scatter_v across processes (or one process over several GPUs) against
float64 numpy: a data-parallel-attention -> tensor-parallel layer round trip (gather every
rank's rows, multiply by this rank's weight shard, reduce-scatter the partial results) on fresh
random counts each round (zero rows on some ranks, all rows on one, full), float32 and bfloat16,
a loop of calls inside one program, and gradients.
  python -m jax_nvcomm.launch -n 4 [--share-gpu] tests/mp/varlen_mp.py [--rounds=200] [--grad=1]
--grad=0 skips the gradient check (its psum runs on XLA's collectives, which ranks sharing one
GPU cannot run). --graph=1 turns on XLA command buffers for custom calls and loops (on GPUs the
loop then replays a CUDA graph: the handler runs fewer times than the kernels, checked).
"""
import os
import sys

if "--graph=1" in sys.argv and "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
                               "FUSION,CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1").strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from common import arg, global_array, init, mesh1d, rank_print

nvc = init()
# GPU float32 matmuls default to TF32 (10-bit mantissa): the float64 references below need the
# full float32 product, forward and backward
jax.config.update("jax_default_matmul_precision", "highest")
rounds = arg("rounds", 200)
grad = arg("grad", 1)
graph = arg("graph", 0)
max_rows = arg("max_rows", 24)
hidden = arg("hidden", 64)
mesh = mesh1d()
W = mesh.shape["x"]
rng = np.random.default_rng(1234)


def counts_for(i):
    if i == 0:
        return np.zeros(W, np.int32)                      # nobody has rows
    if i == 1:
        c = np.zeros(W, np.int32)
        c[W - 1] = max_rows                               # all rows on one rank
        return c
    if i == 2:
        return np.full(W, max_rows, np.int32)
    c = rng.integers(0, max_rows + 1, W).astype(np.int32)
    c[rng.random(W) < 0.25] = 0
    return c


def blocks(arr, per):
    """{rank: numpy block} of this process's shards of an array sharded over 'x'."""
    return {(s.index[0].start or 0) // per: np.asarray(s.data) for s in arr.addressable_shards}


with nvc.Communicator(mesh, "x", max_message_bytes=4 << 20) as comm:
    def layer(x, n, w):
        g, off, tot = nvc.all_gather_v(x, n[0], comm)
        y = (g.astype(jnp.float32) @ w[0]).astype(x.dtype)
        return nvc.reduce_scatter_v(y, off, comm), g[None], off[None], tot[None]

    f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P("x"),) * 3,
                              out_specs=(P("x"),) * 4))
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)):
        for i in range(rounds if dtype == jnp.float32 else max(10, rounds // 10)):
            c = counts_for(i)
            off = np.concatenate([[0], np.cumsum(c)]).astype(np.int32)
            x = np.asarray(jnp.asarray(rng.standard_normal((W * max_rows, hidden)), dtype)
                           .astype(jnp.float32))
            w = (rng.standard_normal((W, hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
            args = [global_array(mesh, P("x"), a) for a in
                    (np.asarray(jnp.asarray(x, dtype)), c, w)]
            out, g, o, t = f(*args)
            want_g = np.concatenate([x[r * max_rows: r * max_rows + c[r]] for r in range(W)])
            for r, gb in blocks(g, 1).items():
                assert np.array_equal(blocks(o, 1)[r][0], off), f"round {i} offsets on rank {r}"
                assert int(blocks(t, 1)[r][0]) == off[-1], f"round {i} total on rank {r}"
                got = np.asarray(jnp.asarray(gb[0]).astype(jnp.float32))
                assert np.array_equal(got[:off[-1]], want_g), f"round {i} gathered rows rank {r}"
                assert not got[off[-1]:].any(), f"round {i} rows past the total rank {r}"
            wsum = w.astype(np.float64).sum(0)
            for r, ob in blocks(out, max_rows).items():
                got = np.asarray(jnp.asarray(ob).astype(jnp.float32), np.float64)
                ref = x[r * max_rows: r * max_rows + c[r]].astype(np.float64) @ wsum
                np.testing.assert_allclose(got[:c[r]], ref, rtol=tol,
                                           atol=tol * max(1.0, np.abs(ref).max(initial=0)),
                                           err_msg=f"round {i} {dtype.__name__} rank {r}")
                assert not got[c[r]:].any(), f"round {i} rows past the count on rank {r}"
        rank_print(f"{jnp.dtype(dtype).name}: {rounds} rounds of gather -> layer -> scatter OK")

    # a loop of calls in one program (a CUDA-graph replay under command buffers on GPUs)
    def loop(x, n):
        def step(_, v):
            g, off, _ = nvc.all_gather_v(v, n[0], comm)
            return nvc.reduce_scatter_v(g * (1.0 / W), off, comm)
        return jax.lax.fori_loop(0, 40, step, x)
    fl = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
    execs = 3
    before = sum(comm.host_calls().values())
    for e in range(execs):
        c = counts_for(5 + e)
        x = rng.integers(-4, 5, (W * max_rows, hidden)).astype(np.float32)
        out = fl(global_array(mesh, P("x"), x), global_array(mesh, P("x"), c))
        for r, ob in blocks(out, max_rows).items():
            want = x[r * max_rows:(r + 1) * max_rows].copy()
            want[c[r]:] = 0
            assert np.array_equal(ob, want), f"loop {e}: rank {r}"
    calls = sum(comm.host_calls().values()) - before
    kernels = execs * 2 * 40 * len(comm.host_calls())
    replay = " (CUDA graph replay)" if calls < kernels else ""
    rank_print(f"loop of 40 gather + scatter pairs OK; graph check: {calls} handler runs for "
               f"{kernels} kernel calls{replay}")
    if graph and jax.devices()[0].platform == "gpu":
        assert calls < kernels, "command buffers on, but every kernel call ran the handler"

    if grad:
        def loss(x, n, w, t):
            out = layer(x, n, w)[0]
            return jnp.sum(out * t)[None]
        fl = jax.shard_map(loss, mesh=mesh, in_specs=(P("x"),) * 4, out_specs=P("x"))
        gfun = jax.jit(jax.grad(lambda *a: fl(*a).sum(), argnums=(0, 2)))
        c = counts_for(7)
        x = rng.standard_normal((W * max_rows, hidden)).astype(np.float32)
        w = (rng.standard_normal((W, hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
        t = rng.standard_normal((W * max_rows, hidden)).astype(np.float32)
        dx, dw = gfun(*[global_array(mesh, P("x"), a) for a in (x, c, w, t)])
        wsum = w.astype(np.float64).sum(0)
        xv = np.concatenate([x[r * max_rows: r * max_rows + c[r]] for r in range(W)])
        tv = np.concatenate([t[r * max_rows: r * max_rows + c[r]] for r in range(W)])
        dw_ref = xv.astype(np.float64).T @ tv
        for r, b in blocks(dx, max_rows).items():
            ref = np.zeros((max_rows, hidden))
            ref[:c[r]] = t[r * max_rows: r * max_rows + c[r]] @ wsum.T
            np.testing.assert_allclose(b, ref, rtol=1e-4, atol=1e-4, err_msg=f"dx rank {r}")
        for r, b in blocks(dw, 1).items():
            np.testing.assert_allclose(b[0], dw_ref, rtol=1e-4, atol=1e-4, err_msg=f"dw {r}")
        rank_print("gradients OK")
    assert not comm.errors(), comm.errors()
rank_print("PASS varlen")
