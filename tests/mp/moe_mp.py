"""Multi-process (or single-process multi-GPU) correctness of moe_dispatch / moe_combine
against a float64 numpy reference: random and degenerate routing, num_tokens, -1 ids, fp8 with
scales, top_k 1 and 8, many rounds, two dispatches in flight.
  python -m jax_nvcomm.launch -n 4 [--share-gpu] tests/mp/moe_mp.py [--rounds=1000]
"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from common import arg, global_array, init, mesh1d, rank_print

nvc = init()
rounds = arg("rounds", 300)
mesh = mesh1d()
W = mesh.shape["x"]
rank_print(f"layout: {jax.process_count()} processes x {jax.local_device_count()} devices = "
           f"world {W}")
rng = np.random.default_rng(99)


def routing(n, E, K, one_expert=False):
    if one_expert:
        return np.stack([np.r_[0, rng.choice(np.arange(1, E), K - 1, replace=False)]
                         for _ in range(n)]).astype(np.int32)
    return np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)


def reference(x, ids, nt, E, T, w):
    L = E // W
    rows = [[[] for _ in range(L)] for _ in range(W)]
    y = np.zeros((W * T, x.shape[1]))
    for s in range(W):
        for t in range(int(nt[s])):
            for k in range(ids.shape[1]):
                e = int(ids[s * T + t, k])
                if e < 0:
                    continue
                rows[e // L][e % L].append((s, t))
                y[s * T + t] += w[s * T + t, k] * 2.0 * x[s * T + t]
    return rows, y


def local_blocks(arr):
    """{rank: numpy block} of this process's shards of an array sharded [W*...] over 'x'."""
    out = {}
    for s in arr.addressable_shards:
        r = s.index[0].start // (arr.shape[0] // W) if s.index[0].start is not None else 0
        out[r] = np.asarray(s.data)
    return out


def one_config(E, K, T, H, dtype, S, n_rounds, degenerate=False):
    with nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                             dtype=dtype, scale_cols=S) as moe:
        def f(x, ids, w, nt, sc):
            d = nvc.moe_dispatch(x, ids, moe, num_tokens=nt[0], x_scale=sc if S else None)
            ey = d.expert_x.astype(jnp.float32) * 2.0
            y = nvc.moe_combine(ey.astype(jnp.bfloat16 if dtype != jnp.float32 else jnp.float32),
                                w, d.handle, moe)
            exs = d.expert_x_scale if S else jnp.zeros((1,), jnp.float32)
            return d.expert_x[None], d.expert_counts[None], y, exs[None]

        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"),) * 5,
                                  out_specs=(P("x"),) * 4))
        L = E // W
        for i in range(n_rounds):
            x = jnp.asarray(rng.standard_normal((W * T, H)), dtype)
            xf = np.asarray(x.astype(jnp.float32), np.float64)
            ids = routing(W * T, E, K, one_expert=degenerate)
            ids[rng.random(ids.shape) < 0.1] = -1
            w = rng.random((W * T, K)).astype(np.float32)
            nt = rng.integers(0, T + 1, size=W).astype(np.int32)
            if i == 0:
                nt[:] = T
                nt[-1] = 0  # a rank with no tokens
            sc = rng.random((W * T, max(S, 1))).astype(np.float32)[:, :max(S, 1)]
            args = [global_array(mesh, P("x"), np.asarray(a)) for a in (x, ids, w, nt, sc)]
            ex, cnt, y, exs = g(*args)
            rows, yref = reference(xf, ids, nt, E, T, w)
            exb, cntb, yb, exsb = (local_blocks(a) for a in (ex, cnt, y, exs))
            for r, blk in exb.items():
                for e in range(L):
                    want = rows[r][e]
                    assert int(cntb[r][0, e]) == len(want), f"round {i} rank {r} expert {e} count"
                    if want:
                        got = np.asarray(jnp.asarray(blk[0, e, :len(want)]).astype(jnp.float32))
                        exp = np.stack([xf[s * T + t] for s, t in want])
                        assert np.array_equal(got, exp), f"round {i} rank {r} expert {e} rows"
                        if S:
                            exp_s = np.stack([sc[s * T + t] for s, t in want])
                            assert np.array_equal(exsb[r][0, e, :len(want)], exp_s), "scales"
            tol = 1e-5 if dtype == jnp.float32 else 2e-2
            for r, yblk in yb.items():
                got = np.asarray(jnp.asarray(yblk).astype(jnp.float32), np.float64)
                exp = yref[r * T:(r + 1) * T]
                np.testing.assert_allclose(got, exp, rtol=tol, atol=tol * max(1, np.abs(exp).max()),
                                           err_msg=f"round {i} combine rank {r}")
        assert not moe.errors(), moe.errors()


E = 4 * W
one_config(E, 2, 8, 128, jnp.bfloat16, 0, rounds)
rank_print(f"bf16 top-2: {rounds} rounds OK")
one_config(2 * E, 8 if 2 * E >= 8 else 2 * E, 16, 256, jnp.float8_e4m3fn, 2, max(20, rounds // 10))
rank_print("fp8 + scales, top-8 OK")
one_config(E, 1, 8, 64, jnp.float32, 0, max(20, rounds // 10), degenerate=False)
one_config(E, 2, 8, 64, jnp.float32, 0, max(20, rounds // 10), degenerate=True)
rank_print("f32 top-1, all tokens to one expert OK")

# two dispatches in flight before their combines
with nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=2, max_tokens=4, hidden=64,
                         dtype=jnp.float32) as moe:
    def f2(x1, x2, i1, i2, w):
        d1 = nvc.moe_dispatch(x1, i1, moe)
        d2 = nvc.moe_dispatch(x2, i2, moe)
        y2 = nvc.moe_combine(d2.expert_x * 3.0, w, d2.handle, moe)
        y1 = nvc.moe_combine(d1.expert_x * 2.0, w, d1.handle, moe)
        return y1, y2
    host = [rng.standard_normal((W * 4, 64)).astype(np.float32) for _ in range(2)]
    ids = [routing(W * 4, E, 2) for _ in range(2)]
    w = rng.random((W * 4, 2)).astype(np.float32)
    y1, y2 = jax.jit(jax.shard_map(f2, mesh=mesh, in_specs=(P("x"),) * 5,
                                   out_specs=(P("x"), P("x"))))(
        *[global_array(mesh, P("x"), a) for a in (*host, *ids, w)])
    for arr, h, m in ((y1, host[0], 2.0), (y2, host[1], 3.0)):
        for s in arr.addressable_shards:
            np.testing.assert_allclose(np.asarray(s.data), (m * w.sum(1, keepdims=True) * h)[s.index],
                                       rtol=1e-5, atol=1e-5)
rank_print("two dispatches in flight OK")
rank_print("PASS")
