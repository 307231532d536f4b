"""moe_dispatch / moe_combine on a MoECommunicator bounded by max_buffer_bytes (calls in rounds,
csrc/common/moe_layout.h BOUNDED SLOTS) across processes (or the devices of one process),
against a vectorised numpy reference: direct calls with fresh routing, then a jitted fori_loop
of calls whose routing changes every iteration (with --graph=1, under XLA command buffers: the
loop body recorded into a CUDA graph and replayed, the FFI handler running fewer times than
the kernels). nbytes within the budget and unchanged; no error recorded. Forward only (the
backward passes use XLA's collectives, which NCCL refuses on a shared GPU).
  python -m jax_nvcomm.launch -n 4 [--share-gpu] tests/mp/moe_bounded_mp.py [--graph=1]
"""
import os
import sys

_flags = os.environ.get("XLA_FLAGS", "")
if "--graph=1" in sys.argv and "xla_gpu_enable_command_buffer" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,"
                               "WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from common import arg, global_array, init, mesh1d, rank_print  # noqa: E402

nvc = init()
from jax_nvcomm import moe as moe_mod  # noqa: E402

mesh = mesh1d()
W = mesh.shape["x"]
iters = arg("iters", 20)
T, H, K = arg("tokens", 1024), arg("hidden", 1024), 4
E = 4 * W if W > 1 else 8
rng = np.random.default_rng(11)
rank_print(f"layout: {jax.process_count()} processes x {jax.local_device_count()} devices = "
           f"world {W}; T {T} H {H} E {E} top-{K} bf16")


def routing(n):
    return np.argsort(rng.random((n, E)), axis=1)[:, :K].astype(np.int32)


def shifted(ids, i):
    return np.where(ids >= 0, (ids + i) % E, -1).astype(np.int32)


def reference(xf, ids, nt, scale, w):
    """(source row of each expert row [W, L, W*T] (-1: none), counts [W, L], y [W*T, H])."""
    L = E // W
    st = np.repeat(np.arange(W * T), K)
    e = ids.reshape(-1)
    ok = (e >= 0) & ((st % T) < np.repeat(nt, T)[st])
    st, e, k = st[ok], e[ok], np.tile(np.arange(K), W * T)[ok]
    order = np.lexsort((st, e))
    st, e, k = st[order], e[order], k[order]
    counts = np.bincount(e, minlength=E).reshape(W, L)
    first = np.r_[0, np.cumsum(np.bincount(e, minlength=E))[:-1]]
    rows = np.full((W, L, W * T), -1, np.int64)
    rows[e // L, e % L, np.arange(len(e)) - first[e]] = st
    y = np.zeros((W * T, H))
    np.add.at(y, st, (w[st, k].astype(np.float64) * scale[e])[:, None] * xf[st])
    return rows, counts, y


def check(outs, xb, ids, nt, scale, w, what):
    ex, cnt, y = outs
    xf = np.asarray(jnp.asarray(xb, jnp.bfloat16).astype(jnp.float32), np.float64)
    rows, counts, yref = reference(xf, ids, nt, scale, w)
    xbits = np.asarray(jnp.asarray(xb, jnp.bfloat16)).view(np.uint16)
    for s in cnt.addressable_shards:
        r = s.index[0].start or 0
        np.testing.assert_array_equal(np.asarray(s.data)[0], counts[r], err_msg=f"{what} counts {r}")
    for s in ex.addressable_shards:
        r = s.index[0].start or 0
        got = np.asarray(s.data)[0].view(np.uint16)
        for le in range(E // W):
            n = counts[r, le]
            if not np.array_equal(got[le, :n], xbits[rows[r, le, :n]]):
                raise AssertionError(f"{what}: expert rows of rank {r} expert {le} differ")
    for s in y.addressable_shards:
        np.testing.assert_allclose(np.asarray(s.data, np.float64), yref[s.index], rtol=1e-5,
                                   atol=1e-5, err_msg=f"{what} y {s.index}")


full = moe_mod.moe_layout(W, E, K, T, H, jnp.bfloat16, 0, 2, None)
budget = full["ctrl_bytes"] + 2 * (min(full["dispatch_call_bytes"], full["combine_call_bytes"])
                                   // 3)
with nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                         dtype=jnp.bfloat16, max_buffer_bytes=budget) as moe:
    assert moe.bounded and moe.nbytes <= budget, moe
    assert moe.dispatch_rounds > 1 and moe.combine_rounds > 1, moe
    nb = moe.nbytes
    L = moe.num_local_experts
    rank_print(f"bounded: nbytes {nb} (whole-call slots {full['total']}), rounds "
               f"{moe.dispatch_rounds} + {moe.combine_rounds}")
    scale_h = rng.uniform(0.5, 2.0, E)
    scale = jnp.asarray(scale_h, jnp.float32)

    def layer(x, ids, w, nt, i):
        ids_i = jnp.where(ids >= 0, (ids + i) % E, -1)
        d = nvc.moe_dispatch(x, ids_i, moe, num_tokens=nt[0])
        s = jax.lax.dynamic_slice(scale, (jax.lax.axis_index("x") * L,), (L,))
        ey = d.expert_x.astype(jnp.float32) * s[:, None, None]
        return nvc.moe_combine(ey, w, d.handle, moe), d.expert_counts, d.expert_x

    def once(x, ids, w, nt):
        y, cnt, ex = layer(x, ids, w, nt, 0)
        return ex[None], cnt[None], y

    def loop(x, ids, w, nt):
        init = (jnp.zeros((T, H), jnp.float32), jnp.zeros((L,), jnp.int32),
                jnp.zeros((L, W * T, H), jnp.bfloat16))
        init = jax.tree.map(lambda a: jax.lax.pcast(a, ("x",), to="varying"), init)
        y, cnt, ex = jax.lax.fori_loop(0, iters, lambda i, c: layer(x, ids, w, nt, i), init)
        return ex[None], cnt[None], y

    spec = dict(mesh=mesh, in_specs=(P("x"),) * 4, out_specs=(P("x"),) * 3)
    f1 = jax.jit(jax.shard_map(once, **spec))
    fl = jax.jit(jax.shard_map(loop, **spec))
    for c in range(3):  # direct calls, fresh routing each
        xb = rng.standard_normal((W * T, H)).astype(np.float32)
        ids = routing(W * T)
        ids[rng.random(ids.shape) < 0.1] = -1
        w = rng.random((W * T, K)).astype(np.float32)
        nt = rng.integers(0, T + 1, size=W).astype(np.int32)
        nt[0] = T
        args = [global_array(mesh, P("x"), a) for a in
                (np.asarray(jnp.asarray(xb, jnp.bfloat16)), ids, w, nt)]
        check(f1(*args), xb, ids, nt, scale_h, w, f"call {c}")
    rank_print(f"3 direct calls: dispatch rows bitwise, combine within 1e-5 of float64 OK")
    before = sum(moe.host_calls().values())
    for e in range(2):
        outs = fl(*args)
        check(outs, xb, shifted(ids, iters - 1), nt, scale_h, w, f"loop {e}")
    handler = sum(moe.host_calls().values()) - before
    kernel_calls = 2 * iters * 2 * jax.local_device_count()
    rank_print(f"fori_loop of {iters} dispatch + combine pairs x2: last iteration OK; FFI handler "
               f"ran {handler} times for {kernel_calls} op calls of this process's devices "
               f"({'replayed in CUDA graphs' if handler < kernel_calls else 'no graph replay'})")
    assert moe.nbytes == nb and not moe.errors(), moe.errors()
    moe.check()
rank_print("moe_bounded_mp PASS")
