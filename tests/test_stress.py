"""Stress: 10,000 mixed calls (all-reduce of changing sizes, fused, all-gather, MoE dispatch +
combine) on 8 CPU devices, every result checked against numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from helpers import mesh1d


@pytest.mark.slow
def test_10000_mixed_calls():
    W, E, K, T, H = 8, 16, 2, 4, 32
    mesh = mesh1d(W)
    rng = np.random.default_rng(2024)
    with nvc.Communicator(mesh, "x", max_message_bytes=1 << 20) as c, \
            nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                                dtype=jnp.float32) as moe:
        def step(x, res, xm, ids, w, strat):
            a = nvc.all_reduce(x, c, strategy=strat)                     # call 1
            n, r = nvc.all_reduce_rms_norm(x, res, jnp.ones(x.shape[1]), c,
                                           strategy="twoshot" if strat == "oneshot"
                                           else "oneshot")               # call 2
            g = nvc.all_gather(x, c)                                     # call 3
            d = nvc.moe_dispatch(xm, ids, moe)                           # call 4
            y = nvc.moe_combine(d.expert_x, w, d.handle, moe)            # call 5
            return a[None], r[None], g[None], y

        shapes = [(1, 64), (3, 128), (8, 256)]
        progs = {(s, st): jax.jit(jax.shard_map(
            lambda *a, st=st: step(*a, st), mesh=mesh, in_specs=(P("x"), P(), P("x"), P("x"),
                                                                 P("x")),
            out_specs=(P("x"),) * 4)) for s in shapes for st in ("oneshot", "twoshot")}
        calls = 0
        for i in range(2000):
            s = shapes[int(rng.integers(len(shapes)))]
            st = "oneshot" if rng.random() < 0.5 else "twoshot"
            x = rng.integers(-8, 8, size=(W * s[0], s[1])).astype(np.float32)
            res = rng.integers(-8, 8, size=s).astype(np.float32)
            xm = rng.integers(-8, 8, size=(W * T, H)).astype(np.float32)
            ids = np.stack([rng.choice(E, K, replace=False) for _ in range(W * T)]).astype(np.int32)
            w = np.ones((W * T, K), np.float32)
            a, r, g, y = progs[(s, st)](x, res, xm, ids, w)
            calls += 5
            tot = x.reshape(W, *s).sum(0)
            np.testing.assert_array_equal(np.asarray(a).reshape(W, *s), np.tile(tot, (W, 1, 1)),
                                          err_msg=f"step {i}")
            np.testing.assert_array_equal(np.asarray(r).reshape(W, *s),
                                          np.tile(tot + res, (W, 1, 1)), err_msg=f"step {i}")
            np.testing.assert_array_equal(np.asarray(g).reshape(W, W * s[0], s[1]),
                                          np.tile(x, (W, 1, 1)), err_msg=f"step {i}")
            np.testing.assert_array_equal(np.asarray(y), K * xm, err_msg=f"step {i}")
        assert calls == 10000
        assert not c.errors() and not moe.errors()
