"""moe_dispatch / moe_combine on a MoECommunicator whose buffer is bounded by max_buffer_bytes
(csrc/common/moe_layout.h BOUNDED SLOTS: calls in rounds through two slots) on 8 CPU devices:
4096 tokens per rank against a vectorised numpy reference (dispatch bitwise, combine against
float64), nbytes within the budget and unchanged by the calls, gradients against pure JAX,
rounds that cut num_tokens, repeated calls in a loop, bad ids in a later round, the split
halves' refusal, and the layout of the real sizes (hidden 7168) within the default budget."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from helpers import clear_error_tokens, mesh1d, tanh_expert_losses
from jax_nvcomm import moe as moe_mod


def routing(rng, n, E, K):
    """Distinct top-k ids per token, uniformly random."""
    return np.argsort(rng.random((n, E)), axis=1)[:, :K].astype(np.int32)


def np_reference(x, ids, nt, E, W, scale, w):
    """float64 numpy: per rank r the [L, W*T] expert rows (x rows; the counted ones) and counts,
    and y = sum_k w[t, k] * scale[e] * x[t] over the valid (t, k)."""
    WT, K = ids.shape
    T, L = WT // W, E // W
    st = np.repeat(np.arange(WT), K)
    e = ids.reshape(-1)
    valid = (e >= 0) & ((st % T) < np.repeat(nt, T)[st])
    st, e, k = st[valid], e[valid], np.tile(np.arange(K), WT)[valid]
    order = np.lexsort((st, e))  # by expert, then (source rank, token)
    st, e, k = st[order], e[order], k[order]
    counts = np.bincount(e, minlength=E).reshape(W, L)
    first = np.r_[0, np.cumsum(np.bincount(e, minlength=E))[:-1]]
    idx = np.arange(len(e)) - first[e]
    rows = np.zeros((W, L, W * T), np.int64) - 1  # source row of expert row (r, le, i)
    rows[e // L, e % L, idx] = st
    xf = np.asarray(x, np.float64)
    y = np.zeros((WT, x.shape[1]))
    np.add.at(y, st, (np.float64(1) * w[st, k] * scale[e])[:, None] * xf[st])
    return rows, counts, y


def shifted(ids, i, E):
    """The routing of loop iteration i: every id moved by i (mod E), -1 kept."""
    return np.where(ids >= 0, (ids + i) % E, -1).astype(np.int32)


def run(moe, x, ids, w, nt, scale, loops=1):
    """dispatch, expert_y = expert_x * scale[expert], combine; with loops > 1, that many times
    in a fori_loop, iteration i routing by shifted(ids, i): the outputs are the last one's."""
    L, E = moe.num_local_experts, moe.num_experts

    def f(x, ids, w, nt):
        def body(i, carry):
            ids_i = jnp.where(ids >= 0, (ids + i) % E, -1)
            d = nvc.moe_dispatch(x, ids_i, moe, num_tokens=nt[0])
            r = jax.lax.axis_index("x")
            s = jax.lax.dynamic_slice(scale, (r * L,), (L,))
            ey = d.expert_x.astype(jnp.float32) * s[:, None, None]
            return nvc.moe_combine(ey, w, d.handle, moe), d.expert_counts, d.expert_x
        init = (jnp.zeros((moe.max_tokens, moe.hidden), jnp.float32),
                jnp.zeros((L,), jnp.int32),
                jnp.zeros((L, moe.world_size * moe.max_tokens, moe.hidden), moe.dtype))
        if loops == 1:
            y, cnt, ex = body(0, init)
        else:
            init = jax.tree.map(lambda a: jax.lax.pcast(a, ("x",), to="varying"), init)
            y, cnt, ex = jax.lax.fori_loop(0, loops, body, init)
        return ex[None], cnt[None], y

    return jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * 4,
                                 out_specs=(P("x"),) * 3))(x, ids, w, nt)


def check(moe, x, ids, w, nt, scale, outs):
    W, E = moe.world_size, moe.num_experts
    ex, cnt, y = (np.asarray(o) for o in outs)
    rows, counts, yref = np_reference(np.asarray(jnp.asarray(x).astype(jnp.float32)), ids, nt,
                                      E, W, np.asarray(scale, np.float64), w)
    np.testing.assert_array_equal(cnt, counts)
    xb = np.asarray(x)
    for r in range(W):
        for le in range(moe.num_local_experts):
            n = counts[r, le]
            # dispatch is a copy: bitwise (compared as raw bits)
            np.testing.assert_array_equal(ex[r, le, :n].view(np.uint16 if xb.itemsize == 2
                                                             else np.uint32),
                                          xb[rows[r, le, :n]].view(np.uint16 if xb.itemsize == 2
                                                                   else np.uint32),
                                          err_msg=f"rank {r} expert {le}")
    np.testing.assert_allclose(np.asarray(y, np.float64), yref, rtol=1e-5, atol=1e-5)


def budget(W, E, K, T, H, dtype, frac):
    """A max_buffer_bytes whose two slots hold about frac of the smaller op's whole call."""
    lay = moe_mod.moe_layout(W, E, K, T, H, dtype, 0, 2, None)
    slot = int(min(lay["dispatch_call_bytes"], lay["combine_call_bytes"]) * frac)
    return lay["ctrl_bytes"] + 2 * slot


def bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


@pytest.mark.parametrize("budget_mib,E,K,H", [(4, 64, 8, 64), (6, 8, 2, 1024)])
def test_4096_tokens_per_rank_within_the_budget(rng, budget_mib, E, K, H):
    W, T = 8, 4096
    budget = budget_mib << 20
    with nvc.MoECommunicator(mesh1d(W), "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                             dtype=jnp.bfloat16, max_buffer_bytes=budget) as moe:
        unbounded = moe_mod.moe_layout(W, E, K, T, H, jnp.bfloat16, 0, 2, None)["total"]
        assert unbounded > 4 * budget  # the whole-call slots would be far over it
        assert moe.bounded and moe.nbytes <= budget
        assert moe.dispatch_rounds > 1 and moe.combine_rounds > 1
        before = moe.nbytes
        x = bf16(rng, (W * T, H))
        ids = routing(rng, W * T, E, K)
        w = rng.random((W * T, K)).astype(np.float32)
        nt = np.full((W,), T, np.int32)
        nt[3] = T - 1000  # a rank whose tokens end inside a round
        scale = jnp.asarray(rng.uniform(0.5, 2.0, E), jnp.float32)
        outs = run(moe, x, ids, w, nt, scale)
        check(moe, x, ids, w, nt, scale, outs)
        assert moe.nbytes == before
        moe.check()


def test_rounds_cut_num_tokens_and_unused_slots_loop(rng):
    """Rounds of under half the 100 tokens: num_tokens on, before and after round edges, a rank
    of none, -1 slots; five calls of each op in a fori_loop (the slots and flags reused)."""
    W, E, K, T, H = 8, 16, 4, 100, 32
    with nvc.MoECommunicator(mesh1d(W), "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                             dtype=jnp.float32,
                             max_buffer_bytes=budget(W, E, K, T, H, jnp.float32, 0.4)) as moe:
        assert moe.dispatch_rounds >= 2 and moe.combine_rounds >= 2, moe
        x = jnp.asarray(rng.standard_normal((W * T, H)), jnp.float32)
        ids = routing(rng, W * T, E, K)
        ids[rng.random(ids.shape) < 0.2] = -1
        w = rng.random((W * T, K)).astype(np.float32)
        Td, Tc = moe.dispatch_round_tokens, moe.combine_round_tokens
        nt = np.array([T, 0, Td, Td - 1, Td + 1, Tc, 1, T - 1], np.int32)
        scale = jnp.asarray(rng.uniform(0.5, 2.0, E), jnp.float32)
        outs = run(moe, x, ids, w, nt, scale, loops=5)
        check(moe, x, shifted(ids, 4, E), w, nt, scale, outs)


def test_gradients_match_pure_jax_in_rounds(rng):
    W, E, K, T, H = 8, 16, 4, 64, 16
    with nvc.MoECommunicator(mesh1d(W), "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                             dtype=jnp.float32,
                             max_buffer_bytes=budget(W, E, K, T, H, jnp.float32, 0.3)) as moe:
        assert moe.dispatch_rounds > 1 and moe.combine_rounds > 1
        x = rng.standard_normal((W * T, H)).astype(np.float32)
        ids = routing(rng, W * T, E, K)
        w = rng.random((W * T, K)).astype(np.float32)
        nt = np.array([T, 50, 0, T, 33, T, 1, T], np.int32)
        scale = jnp.asarray(rng.standard_normal((E,)), jnp.float32)
        loss, loss_ref = tanh_expert_losses(moe, scale, ids, nt)
        g1 = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
        g2 = jax.grad(loss_ref, argnums=(0, 1))(x, w)
        for a, b in zip(g1, g2):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_bad_id_in_a_later_round_fails_every_rank(rng):
    W, E, K, T, H = 8, 16, 2, 64, 16
    with nvc.MoECommunicator(mesh1d(W), "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                             dtype=jnp.float32,
                             max_buffer_bytes=budget(W, E, K, T, H, jnp.float32, 0.3),
                             timeout_s=5) as moe:
        assert moe.dispatch_rounds > 2
        x = rng.standard_normal((W * T, H)).astype(np.float32)
        ids = routing(rng, W * T, E, K)
        ids[5 * T + T - 2, 1] = E + 3  # rank 5, a token of the last round

        def f(x, ids):
            return nvc.moe_dispatch(x, ids, moe).expert_counts[None]

        g = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * 2, out_specs=P("x")))
        with pytest.raises(Exception, match=rf"^[^\n]*rank 5[^\n]*topk_ids\[{T - 2}, 1\] = "
                                            rf"{E + 3}, outside"):
            np.asarray(g(x, ids))
        with pytest.raises(nvc.CommunicatorError) as ei:
            moe.check()
        text = str(ei.value)
        # found in the call's first round (every id is checked there), every rank at once
        assert f"rank 5: topk_ids[{T - 2}, 1] = {E + 3}, outside" in text, text
        assert "call #1:" in text and "timed out" not in text, text
        assert text.splitlines()[0].startswith("jax_nvcomm: moe_dispatch call #1: rank 5: "), text
        assert "\n".join(ei.value.records).count("rank 5 failed this call") == W - 1, text
        clear_error_tokens()


def test_split_halves_need_one_round():
    W, E, K, T, H = 8, 16, 2, 64, 16
    full = moe_mod.moe_layout(W, E, K, T, H, jnp.float32, 0, 2, None)["total"]
    b = budget(W, E, K, T, H, jnp.float32, 0.3)
    with nvc.MoECommunicator(mesh1d(W), "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                             dtype=jnp.float32, max_buffer_bytes=b) as moe:
        x = jnp.zeros((W * T, H), jnp.float32)
        ids = jnp.zeros((W * T, K), jnp.int32)

        def f(x, ids):
            return nvc.moe_dispatch_recv(nvc.moe_dispatch_send(x, ids, moe), moe).expert_x

        g = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * 2, out_specs=P("x")))
        with pytest.raises(ValueError, match=(
                rf"moe_dispatch_send: the split halves need the call in one round, but this "
                rf"communicator's buffer \(max_buffer_bytes={b}, nbytes={moe.nbytes}\) "
                rf"takes {moe.dispatch_rounds} rounds of dispatch at max_tokens={T}: use "
                rf"moe_dispatch .* max_buffer_bytes >= {full}")):
            g.lower(x, ids)


def test_budget_arguments_and_default():
    W = 8
    # the default keeps small communicators as they were: slots for whole calls
    small = moe_mod.moe_layout(W, 256, 8, 128, 7168, jnp.bfloat16, 0, 2,
                               moe_mod.DEFAULT_MAX_BUFFER_BYTES)
    assert not small["bounded"] and small["slots"] == 4
    assert small == moe_mod.moe_layout(W, 256, 8, 128, 7168, jnp.bfloat16, 0, 2, None)
    # the real training size: 3.5 GiB of whole-call slots, within 256 MiB in rounds
    for E, K, H in [(256, 8, 7168), (8, 2, 4096)]:
        full = moe_mod.moe_layout(W, E, K, 4096, H, jnp.bfloat16, 0, 2, None)
        lay = moe_mod.moe_layout(W, E, K, 4096, H, jnp.bfloat16, 0, 2,
                                 moe_mod.DEFAULT_MAX_BUFFER_BYTES)
        assert full["total"] > 2 * moe_mod.DEFAULT_MAX_BUFFER_BYTES
        assert lay["bounded"] and lay["total"] <= moe_mod.DEFAULT_MAX_BUFFER_BYTES
        assert lay["slots"] == 2 and lay["dispatch_rounds"] > 1 and lay["combine_rounds"] > 1
        # a round fills its slot: one more token would not fit
        assert lay["combine_round_tokens"] * K * H * 4 <= lay["slot_bytes"] < (
            lay["combine_round_tokens"] + 1) * K * H * 4
    with pytest.raises(ValueError, match=r"MoECommunicator: max_buffer_bytes must be >= \d+ "
                                         r"\(room for one token's rows in each half of the "
                                         r"buffer\), got 70000"):
        nvc.MoECommunicator(mesh1d(W), "x", num_experts=16, top_k=2, max_tokens=64, hidden=1024,
                            dtype=jnp.float32, max_buffer_bytes=70000)
    with pytest.raises(TypeError, match="max_buffer_bytes must be an int, got str"):
        nvc.MoECommunicator(mesh1d(W), "x", num_experts=16, top_k=2, max_tokens=64, hidden=16,
                            dtype=jnp.float32, max_buffer_bytes="1")


def test_moe_layer_packed_rows_in_rounds_bitwise_as_whole_calls(rng):
    """nvc.moe_layer (the packed dispatch / combine forms) on a bounded communicator gives the
    bits of the same layer on whole-call slots."""
    W, E, K, T, H, F = 8, 16, 4, 96, 32, 16
    L = E // W
    x = jnp.asarray(rng.standard_normal((W * T, H)), jnp.bfloat16)
    ids = routing(rng, W * T, E, K)
    w = rng.random((W * T, K)).astype(np.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((E, H, F)) * 0.2, jnp.bfloat16) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((E, F, H)) * 0.2, jnp.bfloat16)
    nt = np.array([T, 40, 0, T, 7, T, T - 1, 1], np.int32)
    outs = []
    for b in (None, budget(W, E, K, T, H, jnp.bfloat16, 0.3)):
        with nvc.MoECommunicator(mesh1d(W), "x", num_experts=E, top_k=K, max_tokens=T,
                                 hidden=H, dtype=jnp.bfloat16, max_buffer_bytes=b) as moe:
            assert moe.bounded == (b is not None)
            if b is not None:  # the combine of a bf16 expert_y: landing rows of 2 bytes
                assert moe.dispatch_rounds > 1 and moe.combine_rounds_for(jnp.bfloat16) > 1
                assert moe.combine_rounds_for(jnp.bfloat16) < moe.combine_rounds, moe

            def f(x, ids, w, nt, wg, wu, wd):
                return nvc.moe_layer(x, ids, w, wg, wu, wd, moe, num_tokens=nt[0])

            outs.append(np.asarray(jax.jit(jax.shard_map(
                f, mesh=moe.mesh, in_specs=(P("x"),) * 7, out_specs=P("x")))(
                    x, ids, w, nt, wg, wu, wd)).view(np.uint16))
    assert L * W == E
    np.testing.assert_array_equal(outs[0], outs[1])
    assert np.any(outs[0] != 0)
