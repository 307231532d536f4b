"""Multi-process correctness of all_gather / all_reduce / all_reduce_rms_norm (one device per
process: CPU, one GPU each, or every process sharing GPU 0; on CPU also several devices per
process with JAX_NVCOMM_CPU_DEVICES=K). Usage:
  python -m jax_nvcomm.launch -n 4 [--share-gpu] tests/mp/collectives_mp.py [--calls=1000]
On CPU devices the strategies run one host protocol (the strategy is a CUDA-only attribute;
host_handlers.cc ignores it): "bitwise equal across strategies" proves the kernels agree only
on GPUs.
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from common import backend_name, check_shards, global_array, init, mesh1d, rank_print, arg

nvc = init()
calls = arg("calls", 1000)
mesh = mesh1d()
W = mesh.shape["x"]
rank_print(f"layout: {jax.process_count()} processes x {jax.local_device_count()} devices = "
           f"world {W}")
assert W % jax.process_count() == 0, (W, jax.process_count())
rng = np.random.default_rng(1234)  # same stream in every process
strategies = ["oneshot", "twoshot"]

with nvc.Communicator(mesh, "x", max_message_bytes=4 << 20) as comm:
    assert comm.backend == backend_name()
    # ---- all_gather, many consecutive calls with changing shapes ----
    shapes = [(1, 8), (3, 64), (16, 256), (5, 24)]
    ag = {s: jax.jit(jax.shard_map(lambda v: nvc.all_gather(v, comm), mesh=mesh,
                                   in_specs=P("x"), out_specs=P("x"))) for s in shapes}
    for i in range(calls):
        s = shapes[i % len(shapes)] if i < 8 else shapes[int(rng.integers(len(shapes)))]
        host = rng.standard_normal((W * s[0], s[1])).astype(np.float32)
        out = ag[s](global_array(mesh, P("x"), host))
        check_shards(out, np.tile(host, (W, 1)), what=f"all_gather call {i} {s}")
    rank_print(f"all_gather: {calls} calls OK")

    # ---- all_reduce and fused, every dtype and strategy, against float64 ----
    def ar_fn(strategy):
        return jax.jit(jax.shard_map(
            lambda v, r, w: (nvc.all_reduce(v, comm, strategy=strategy)[None],
                             *[o[None] for o in nvc.all_reduce_rms_norm(v, r, w, comm,
                                                                       strategy=strategy)]),
            mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=(P("x"), P("x"), P("x"))))

    fns = {s: ar_fn(s) for s in strategies}
    for dtype, tol in [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)]:
        outs = {}
        for T, H in [(1, 64), (8, 1024), (33, 4096)]:
            x = rng.standard_normal((W * T, H)).astype(np.float32)
            res = rng.standard_normal((T, H)).astype(np.float32)
            w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
            xs, rs, ws = (jnp.asarray(a, dtype) for a in (x, res, w))
            x64 = np.asarray(xs.astype(jnp.float32), np.float64)
            sum_ref = x64.reshape(W, T, H).sum(0)
            r_ref = sum_ref + np.asarray(rs.astype(jnp.float32), np.float64)
            n_ref = r_ref / np.sqrt((r_ref ** 2).mean(-1, keepdims=True) + 1e-6) * \
                np.asarray(ws.astype(jnp.float32), np.float64)
            for strat in strategies:
                a, n, r = fns[strat](global_array(mesh, P("x"), np.asarray(xs)),
                                     global_array(mesh, P(), np.asarray(rs)),
                                     global_array(mesh, P(), np.asarray(ws)))
                scale = lambda ref: tol * max(1.0, float(np.abs(ref).max()))
                check_shards(a, np.tile(sum_ref[None], (W, 1, 1)), rtol=tol, atol=scale(sum_ref),
                             what=f"all_reduce {strat} {dtype.__name__} {T}x{H}")
                check_shards(r, np.tile(r_ref[None], (W, 1, 1)), rtol=tol, atol=scale(r_ref),
                             what=f"residual_out {strat} {dtype.__name__} {T}x{H}")
                check_shards(n, np.tile(n_ref[None], (W, 1, 1)), rtol=2 * tol,
                             atol=2 * scale(n_ref), what=f"normed {strat} {dtype.__name__}")
                outs[(strat, T)] = [np.asarray(o.addressable_shards[0].data) for o in (a, n, r)]
        for T in [1, 8, 33]:  # strategies bitwise identical
            for u, v in zip(outs[("oneshot", T)], outs[("twoshot", T)]):
                assert np.array_equal(u.view(np.uint8), v.view(np.uint8)), \
                    f"oneshot != twoshot bits {dtype.__name__} T={T}"
    rank_print("all_reduce / fused: all dtypes, strategies, shapes OK (bitwise equal across strategies)")

    # ---- many consecutive all-reduce calls, alternating strategies and sizes ----
    seqs = [(s, T) for s in strategies for T in (1, 4, 16)]
    fns2 = {s: jax.jit(jax.shard_map(lambda v: nvc.all_reduce(v, comm, strategy=s)[None],
                                     mesh=mesh, in_specs=P("x"), out_specs=P("x")))
            for s in strategies}
    for i in range(calls):
        strat, T = seqs[int(rng.integers(len(seqs)))]
        x = rng.integers(-8, 8, size=(W * T, 512)).astype(np.float32)  # exact sums
        out = fns2[strat](global_array(mesh, P("x"), x))
        check_shards(out, np.tile(x.reshape(W, T, 512).sum(0)[None], (W, 1, 1)),
                     what=f"all_reduce call {i} {strat} T={T}")
    rank_print(f"all_reduce: {calls} consecutive calls OK")
    errs = comm.errors()
    assert not errs, errs
rank_print("PASS")
