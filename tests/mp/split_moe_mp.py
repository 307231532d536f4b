"""Split-phase MoE across processes (or one process over every local device): the send and
receive halves against the fused calls (bitwise) and a float64 numpy reference, two
micro-batches in flight with a "shared expert" computed between the halves, ragged num_tokens,
-1 ids, FP8 with scales; a fori_loop of split calls (with --graph: inside XLA command buffers,
i.e. CUDA-graph replays on GPUs, the FFI handlers then run fewer times than the kernels); and
where XLA scheduled the shared expert (between the send and the receive custom calls).
  python tests/mp/split_moe_mp.py                       # one process, all local devices
  python -m jax_nvcomm.launch -n 2 [--share-gpu] tests/mp/split_moe_mp.py [--rounds=N] [--graph]
"""
import os
import sys

if "--graph" in sys.argv:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,"
                                   "WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1").strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from common import arg, check_shards, global_array, init, mesh1d, rank_print  # noqa: E402

nvc = init()
from jax_nvcomm.moe_split import scheduled_order  # noqa: E402

rounds = arg("rounds", 20)
iters = arg("iters", 20)
mesh = mesh1d()
W = mesh.shape["x"]
rng = np.random.default_rng(1234)


def routing(n, E, K):
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    ids[rng.random(ids.shape) < 0.1] = -1
    return ids


def expert(ex):
    return (jnp.tanh(ex.astype(jnp.float32)) * 1.5 + 0.25).astype(jnp.bfloat16)


def shared_expert(h, sw, scope):
    with jax.named_scope(scope):
        return jnp.tanh(jnp.dot(h.astype(jnp.bfloat16), sw)).astype(jnp.float32)


def blocks(arr):
    """{rank: numpy block} of this process's shards of an array sharded over 'x'."""
    out = {}
    for s in arr.addressable_shards:
        start = s.index[0].start or 0
        out[start // (arr.shape[0] // W)] = np.asarray(s.data)
    return out


def program(moe):
    S = moe.scale_cols

    def f(xa, xb, ia, ib, w, nta, ntb, sca, scb, sw):
        xsa, xsb = (sca, scb) if S else (None, None)
        # fused, for comparison
        da = nvc.moe_dispatch(xa, ia, moe, num_tokens=nta[0], x_scale=xsa)
        fa = nvc.moe_combine(expert(da.expert_x), w, da.handle, moe)
        db = nvc.moe_dispatch(xb, ib, moe, num_tokens=ntb[0], x_scale=xsb)
        fb = nvc.moe_combine(expert(db.expert_x), w, db.handle, moe)
        alone = shared_expert(xa, sw, "shared_alone")
        # split, two micro-batches; the shared expert of A between its dispatch halves
        sa = nvc.moe_dispatch_send(xa, ia, moe, num_tokens=nta[0], x_scale=xsa)
        sb = nvc.moe_dispatch_send(xb, ib, moe, num_tokens=ntb[0], x_scale=xsb)
        (ha,) = nvc.moe_overlap(sb, xa)
        between = shared_expert(ha, sw, "shared_between")
        ra = nvc.moe_dispatch_recv(sa, moe, after=between)
        ca = nvc.moe_combine_send(expert(ra.expert_x), ra.handle, moe)
        rb = nvc.moe_dispatch_recv(sb, moe)
        cb = nvc.moe_combine_send(expert(rb.expert_x), rb.handle, moe)
        ya = nvc.moe_combine_recv(ca, w, moe)
        yb = nvc.moe_combine_recv(cb, w, moe)
        return ya, yb, fa, fb, ra.expert_counts[None], rb.expert_counts[None], between, alone

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 9 + (P(),),
                                 out_specs=(P("x"),) * 8))


def reference(xf, ids, nt, E, T, w):
    L = E // W
    counts = np.zeros((W, L), np.int64)
    ex = np.asarray(jnp.asarray(np.tanh(xf.astype(np.float32)) * 1.5 + 0.25).astype(
        jnp.bfloat16).astype(jnp.float32), np.float64)
    y = np.zeros_like(xf)
    for s in range(W):
        for t in range(int(nt[s])):
            for k in range(ids.shape[1]):
                e = int(ids[s * T + t, k])
                if e >= 0:
                    counts[e // L, e % L] += 1
                    y[s * T + t] += w[s * T + t, k] * ex[s * T + t]
    return counts, y


def one_config(E, K, T, H, dtype, S, n_rounds):
    with nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                             dtype=dtype, scale_cols=S, max_in_flight=2) as moe:
        g = program(moe)
        for i in range(n_rounds):
            xs = [jnp.asarray(rng.standard_normal((W * T, H)), dtype) for _ in "ab"]
            ids = [routing(W * T, E, K) for _ in "ab"]
            w = rng.random((W * T, K)).astype(np.float32)
            nts = [rng.integers(0, T + 1, size=W).astype(np.int32) for _ in "ab"]
            if i == 0:
                nts[0][:] = T
                nts[0][-1] = 0
            scs = [rng.random((W * T, max(S, 1))).astype(np.float32) for _ in "ab"]
            sw = rng.standard_normal((H, 64)).astype(np.float32) / np.sqrt(H)
            args = [global_array(mesh, P("x"), np.asarray(a))
                    for a in (*xs, *ids, w, *nts, *scs)]
            args.append(jnp.asarray(sw, jnp.bfloat16))
            ya, yb, fa, fb, cnta, cntb, between, alone = g(*args)
            for got, want, what in ((ya, fa, "A"), (yb, fb, "B")):
                for r, blk in blocks(got).items():
                    assert np.array_equal(blk.view(np.uint8), blocks(want)[r].view(np.uint8)), \
                        f"round {i}: split {what} differs from fused on rank {r}"
            # the shared expert between the halves: the same values as computed alone and as
            # float64 numpy. Not bitwise: XLA may compile the two copies of the GEMM differently
            # (GPU autotuning picks per fusion), which is XLA's business, not the split's
            swf = np.asarray(jnp.asarray(sw, jnp.bfloat16).astype(jnp.float32), np.float64)
            xaf = np.asarray(xs[0].astype(jnp.bfloat16).astype(jnp.float32), np.float64)
            for r, blk in blocks(between).items():
                sref = np.tanh(xaf[r * T:(r + 1) * T] @ swf)
                for got, what in ((blk, "between"), (blocks(alone)[r], "alone")):
                    np.testing.assert_allclose(np.asarray(got, np.float64), sref, rtol=0,
                                               atol=2e-2, err_msg=f"round {i} shared {what} rank {r}")
                np.testing.assert_allclose(blk, blocks(alone)[r], rtol=0, atol=1.6e-2,
                                           err_msg=f"round {i} shared between vs alone rank {r}")
            for x, idx, nt, y, cnt in ((xs[0], ids[0], nts[0], ya, cnta),
                                       (xs[1], ids[1], nts[1], yb, cntb)):
                xf = np.asarray(x.astype(jnp.float32), np.float64)
                cref, yref = reference(xf, idx, nt, E, T, w)
                for r, blk in blocks(cnt).items():
                    assert np.array_equal(blk[0], cref[r]), f"round {i} counts rank {r}"
                for r, blk in blocks(y).items():
                    exp = yref[r * T:(r + 1) * T]
                    np.testing.assert_allclose(np.asarray(blk, np.float64), exp, rtol=2e-2,
                                               atol=2e-2 * max(1.0, np.abs(exp).max()),
                                               err_msg=f"round {i} y rank {r}")
        assert not moe.errors(), moe.errors()
        return g, args


E = 4 * W
one_config(E, 2, 8, 128, jnp.bfloat16, 0, rounds)
rank_print(f"bf16 top-2: {rounds} rounds, split == fused bitwise, two in flight, shared expert "
           "between the halves unchanged OK")
g, args = one_config(2 * E, min(8, 2 * E), 16, 256, jnp.float8_e4m3fn, 2, max(3, rounds // 4))
rank_print("fp8 + scales, top-8 OK")

# where XLA scheduled the shared expert: between the send of B and the receive of A
hlo = g.lower(*args).compile().as_text()
# At least one of the shared expert's GEMMs (its dot_general) must run after the last send and
# before the first receive, and every op of the scope before the first receive. Not "every op
# of the scope after the sends": ops that do not read the overlap's output may legally run
# earlier, and XLA shares (CSE) ops on the weight between the two copies of the shared expert
# (the dot's layout transpose of `sw` carries the dot's metadata into the other copy's fusion).
sends, gemms, recvs, scope = scheduled_order(
    hlo, ["moe_dispatch_send", "shared_between/dot_general", "moe_dispatch_recv",
          "shared_between"], positions=True)
rank_print(f"schedule: sends at {sends}, receives at {recvs}, shared expert GEMM ops at {gemms}, "
           f"all its ops at {scope} (positions in the compiled program's sequence)")
assert sends and recvs and gemms and scope, (sends, gemms, recvs, scope)
assert any(max(sends) < p < min(recvs) for p in gemms), (sends, gemms, recvs)
assert max(scope) < min(recvs), (scope, recvs)
rank_print("SCHEDULE shared expert between send and receive OK")

# fori_loop of split calls, two in flight (with --graph: command buffers / CUDA graphs);
# every iteration's rows differ (+1 per step, rotating routing) so a stale replay is caught
K, TM, HM = 2, 8, 128
with nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=TM, hidden=HM,
                         dtype=jnp.float32, max_in_flight=2) as moe:
    def loop_body(v, ids, split):
        w = jnp.full((TM, K), 1.0 / K, jnp.float32)

        def step(i, carry):
            a, b = carry
            if split:
                sa = nvc.moe_dispatch_send(a, (ids + i) % E, moe)
                sb = nvc.moe_dispatch_send(b, (ids + 2 * i) % E, moe)
                da = nvc.moe_dispatch_recv(sa, moe)
                ca = nvc.moe_combine_send(da.expert_x, da.handle, moe)
                db = nvc.moe_dispatch_recv(sb, moe)
                cb = nvc.moe_combine_send(db.expert_x, db.handle, moe)
                ya, yb = nvc.moe_combine_recv(ca, w, moe), nvc.moe_combine_recv(cb, w, moe)
            else:
                da = nvc.moe_dispatch(a, (ids + i) % E, moe)
                ya = nvc.moe_combine(da.expert_x, w, da.handle, moe)
                db = nvc.moe_dispatch(b, (ids + 2 * i) % E, moe)
                yb = nvc.moe_combine(db.expert_x, w, db.handle, moe)
            return ya + 1.0, yb + 2.0
        return lax.fori_loop(0, iters, step, (v, -v))

    hx = rng.integers(-8, 8, size=(W * TM, HM)).astype(np.float32)
    hids = np.stack([rng.choice(E, K, replace=False) for _ in range(W * TM)]).astype(np.int32)
    gx, gids = global_array(mesh, P("x"), hx), global_array(mesh, P("x"), hids)
    res = {}
    for split in (True, False):
        fm = jax.jit(jax.shard_map(lambda v, i: loop_body(v, i, split), mesh=mesh,
                                   in_specs=(P("x"), P("x")), out_specs=(P("x"), P("x"))))
        # several executions, as in graph_mp.py: XLA may record the command buffer (running
        # the handlers) on the first one; later ones replay it without the handlers
        execs = 3
        before = sum(moe.host_calls().values())
        for _ in range(execs):
            res[split] = fm(gx, gids)
            jax.block_until_ready(res[split])
        calls = sum(moe.host_calls().values()) - before
        kernel_calls = execs * (8 if split else 4) * iters * len(moe.host_calls())
        rank_print(f"{'split' if split else 'fused'} loop: {kernel_calls} MoE calls, FFI handlers "
                   f"ran {calls} times ({'CUDA graph replay' if calls < kernel_calls else 'no replay'})")
    for split in (True, False):  # identity experts, weights 1/K: y = x exactly per step
        check_shards(res[split][0], hx + iters, what=f"loop A split={split}")
        check_shards(res[split][1], -hx + 2 * iters, what=f"loop B split={split}")
    assert not moe.errors(), moe.errors()
rank_print("split loop OK")
rank_print("PASS")
