"""Split-phase MoE (moe_dispatch_send / _recv, moe_combine_send / _recv) on 8 CPU devices (host
backend): bitwise equal to the fused calls and to a float64 numpy reference, ragged num_tokens,
-1 ids, FP8 with scales, two micro-batches in flight, compute between the halves unchanged,
many calls in a loop, halves in separate programs, gradients, and the in-flight / order rules
(trace-time errors, device errors)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from helpers import clear_error_tokens, mesh1d, np_moe_reference

MOES = {}


def get_moe(world, E, K, T, H, dtype=jnp.float32, S=0, m=2):
    key = (world, E, K, T, H, jnp.dtype(dtype).name, S, m)
    if key not in MOES:
        MOES[key] = nvc.MoECommunicator(mesh1d(world), "x", num_experts=E, top_k=K, max_tokens=T,
                                        hidden=H, dtype=dtype, scale_cols=S, max_in_flight=m)
    return MOES[key]


@pytest.fixture(scope="module", autouse=True)
def _close_all():
    yield
    for m in MOES.values():
        m.close()
    MOES.clear()


def routing(rng, n, E, K, unused=0.0):
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    ids[rng.random(ids.shape) < unused] = -1
    return ids


def bits(a):
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.kind == "f" or a.dtype.itemsize == 1 else a


def ey_of(d):
    """A stand-in expert: float32 math on the rows, back to bf16 / the payload's float type."""
    ex = d.expert_x.astype(jnp.float32)
    return (jnp.tanh(ex) * 1.5 + 0.25).astype(jnp.bfloat16)


def valid_rows(a, cnt):
    """Rows 0 .. cnt[e]-1 of each expert e of a [W, L, R, ...] array (the rest is unspecified)."""
    return [a[r, e, :cnt[r, e]] for r in range(a.shape[0]) for e in range(a.shape[1])]


def fused_and_split(moe, x, ids, w, nt, scales=None, shared_w=None):
    """One program: the fused calls, then the split ones on the same inputs, with a 'shared
    expert' (x @ shared_w) computed between the send and the receive of the dispatch and of
    the combine (also once outside them, for comparison)."""
    S = moe.scale_cols

    def f(x, ids, w, nt, sc, sw):
        xs = sc if S else None
        d = nvc.moe_dispatch(x, ids, moe, num_tokens=nt[0], x_scale=xs)
        y = nvc.moe_combine(ey_of(d), w, d.handle, moe)
        shared_ref = jnp.dot(x.astype(jnp.float32), sw)

        sent = nvc.moe_dispatch_send(x, ids, moe, num_tokens=nt[0], x_scale=xs)
        (xo,) = nvc.moe_overlap(sent, x)
        shared = jnp.dot(xo.astype(jnp.float32), sw)          # between send and receive
        d2 = nvc.moe_dispatch_recv(sent, moe, after=shared)
        cs = nvc.moe_combine_send(ey_of(d2), d2.handle, moe)
        (sh2,) = nvc.moe_overlap(cs, shared)
        shared2 = jnp.tanh(sh2)                                 # between send and receive
        y2 = nvc.moe_combine_recv(cs, w, moe, after=shared2)
        exs = (d.expert_x_scale, d2.expert_x_scale) if S else (jnp.zeros((1,)),) * 2
        return (d.expert_x[None], d.expert_counts[None], exs[0][None], d.handle.token_dest,
                d.handle.expert_src[None], y, d2.expert_x[None], d2.expert_counts[None],
                exs[1][None], d2.handle.token_dest, d2.handle.expert_src[None], y2,
                shared_ref, shared, shared2)

    sc = scales if scales is not None else np.zeros((x.shape[0], 1), np.float32)
    g = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * 5 + (P(),),
                              out_specs=(P("x"),) * 15))
    return g, (x, ids, w, nt, sc, shared_w)


def assert_split_equals_fused(outs):
    o = [np.asarray(a) for a in outs]
    fused, split = o[0:6], o[6:12]
    np.testing.assert_array_equal(fused[1], split[1], "expert_counts")
    cnt = fused[1]
    for a, b in zip(valid_rows(fused[0], cnt), valid_rows(split[0], cnt)):
        np.testing.assert_array_equal(bits(a), bits(b), "expert_x rows")
    if fused[2].ndim == 4:
        for a, b in zip(valid_rows(fused[2], cnt), valid_rows(split[2], cnt)):
            np.testing.assert_array_equal(bits(a), bits(b), "expert_x_scale rows")
    np.testing.assert_array_equal(fused[3], split[3], "handle.token_dest")
    for a, b in zip(valid_rows(fused[4][:, :, :, None], cnt), valid_rows(split[4][:, :, :, None], cnt)):
        np.testing.assert_array_equal(a, b, "handle.expert_src")
    np.testing.assert_array_equal(bits(fused[5]), bits(split[5]), "y")
    # the shared expert computed between the halves is bitwise what it is alone
    np.testing.assert_array_equal(bits(o[12]), bits(o[13]), "shared expert")


def check_reference(moe, x, ids, w, nt, outs, scales=None):
    """Split results against the float64 numpy reference (rows exact, y to rounding)."""
    W, T, E, L = moe.world_size, moe.max_tokens, moe.num_experts, moe.num_local_experts
    cnt = np.asarray(outs[7])
    # rows past each expert's count are unspecified (any bit pattern, signalling NaNs too, which
    # numpy's cast reports as invalid values): zero them before any arithmetic
    ex = np.array(jnp.asarray(outs[6]))
    ex[np.arange(ex.shape[2])[None, None, :] >= cnt[:, :, None]] = 0
    ex = ex.astype(np.float32).astype(np.float64)
    xf = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    ref = np_moe_reference(xf, ids, nt, E, W)
    for r in range(W):
        for e in range(L):
            rows = ref["rows"][r][e]
            assert cnt[r, e] == len(rows), f"count rank {r} expert {e}"
            if rows:
                np.testing.assert_array_equal(ex[r, e, :len(rows)],
                                              np.stack([xf[s * T + t] for s, t in rows]))
                if scales is not None:
                    np.testing.assert_array_equal(np.asarray(outs[8])[r, e, :len(rows)],
                                                  np.stack([scales[s * T + t] for s, t in rows]))
    ey = [np.asarray(jnp.asarray((np.tanh(ex[r].astype(np.float32)) * 1.5 + 0.25)).astype(
        jnp.bfloat16).astype(jnp.float32), np.float64) for r in range(W)]
    yref = np_moe_reference(xf, ids, nt, E, W, weights=w, expert_y=ey)["y"]
    y = np.asarray(jnp.asarray(outs[11]).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(y, yref, rtol=1e-2, atol=1e-2 * max(1.0, np.abs(yref).max()))
    for s in range(W):
        assert not np.any(y[s * T + int(nt[s]):(s + 1) * T]), "rows >= num_tokens must be zero"


@pytest.mark.parametrize("world,E,K,dtype,S", [
    (8, 32, 8, jnp.bfloat16, 0),
    (4, 16, 4, jnp.float32, 0),
    (4, 8, 2, jnp.float8_e4m3fn, 2),
    (2, 4, 2, jnp.float16, 1),
])
def test_split_equals_fused_bitwise(rng, world, E, K, dtype, S):
    T, H = 7, 64
    moe = get_moe(world, E, K, T, H, dtype, S)
    x = jnp.asarray(rng.standard_normal((world * T, H)), dtype)
    ids = routing(rng, world * T, E, K, unused=0.2)
    w = rng.random((world * T, K)).astype(np.float32)
    nt = rng.integers(0, T + 1, size=world).astype(np.int32)
    nt[0] = T
    nt[-1] = 0 if world > 1 else nt[-1]
    scales = rng.random((world * T, S)).astype(np.float32) if S else None
    sw = rng.standard_normal((H, 16)).astype(np.float32)
    g, args = fused_and_split(moe, x, ids, w, nt, scales, sw)
    outs = g(*args)
    assert_split_equals_fused(outs)
    check_reference(moe, x, ids, w, nt, outs, scales)
    # shared expert against numpy
    np.testing.assert_allclose(np.asarray(outs[13]),
                               np.asarray(jnp.asarray(x).astype(jnp.float32)) @ sw, rtol=1e-4,
                               atol=1e-4)


def test_two_micro_batches_in_flight_many_rounds(rng):
    """Two micro-batches interleaved as a pipeline would: send A, send B, recv A, combine-send A,
    recv B, combine-send B, combine-recv A, combine-recv B; 30 runs on fresh data."""
    world, E, K, T, H = 8, 16, 2, 5, 32
    moe = get_moe(world, E, K, T, H, jnp.bfloat16)

    def f(xa, xb, ia, ib, w, nta, ntb):
        sa = nvc.moe_dispatch_send(xa, ia, moe, num_tokens=nta[0])
        sb = nvc.moe_dispatch_send(xb, ib, moe, num_tokens=ntb[0])
        da = nvc.moe_dispatch_recv(sa, moe)
        ca = nvc.moe_combine_send(ey_of(da), da.handle, moe)
        db = nvc.moe_dispatch_recv(sb, moe)
        cb = nvc.moe_combine_send(ey_of(db), db.handle, moe)
        ya = nvc.moe_combine_recv(ca, w, moe)
        yb = nvc.moe_combine_recv(cb, w, moe)
        # the fused calls on the same data, after
        fa = nvc.moe_combine(ey_of(d := nvc.moe_dispatch(xa, ia, moe, num_tokens=nta[0])), w,
                             d.handle, moe)
        fb = nvc.moe_combine(ey_of(d := nvc.moe_dispatch(xb, ib, moe, num_tokens=ntb[0])), w,
                             d.handle, moe)
        return ya, yb, fa, fb, da.expert_counts[None], db.expert_counts[None]

    g = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * 7,
                              out_specs=(P("x"),) * 6))
    for i in range(30):
        xa, xb = (jnp.asarray(rng.standard_normal((world * T, H)), jnp.bfloat16) for _ in "ab")
        ia, ib = (routing(rng, world * T, E, K, unused=0.1) for _ in "ab")
        w = rng.random((world * T, K)).astype(np.float32)
        nta, ntb = (rng.integers(0, T + 1, size=world).astype(np.int32) for _ in "ab")
        ya, yb, fa, fb, ca, cb = g(xa, xb, ia, ib, w, nta, ntb)
        np.testing.assert_array_equal(bits(ya), bits(fa), f"round {i} micro-batch A")
        np.testing.assert_array_equal(bits(yb), bits(fb), f"round {i} micro-batch B")
        for x_, ids_, nt_, cnt in ((xa, ia, nta, ca), (xb, ib, ntb, cb)):
            ref = np_moe_reference(np.asarray(x_.astype(jnp.float32)), ids_, nt_, E, world)
            want = [[len(ref["rows"][r][e]) for e in range(E // world)] for r in range(world)]
            np.testing.assert_array_equal(np.asarray(cnt), want, f"round {i} counts")
    # A against numpy (last round): y = sum_k w * expert(x)
    xf = np.asarray(xa.astype(jnp.float32), np.float64)
    ex = np.asarray(jnp.asarray((np.tanh(xf.astype(np.float32)) * 1.5 + 0.25)).astype(
        jnp.bfloat16).astype(jnp.float32), np.float64)
    valid = (ia >= 0) & (np.arange(world * T)[:, None] % T < np.repeat(nta, T)[:, None])
    yref = (np.where(valid, w, 0).sum(1, keepdims=True)) * ex
    np.testing.assert_allclose(np.asarray(ya.astype(jnp.float32)), yref, rtol=2e-2, atol=2e-2)


def test_split_calls_in_a_loop_with_other_collectives(rng):
    """fori_loop of split calls (two in flight) with an all_gather of another communicator
    between the halves: 20 iterations, each checked against its fused counterpart."""
    world, E, K, T, H = 4, 8, 2, 4, 16
    moe = get_moe(world, E, K, T, H)
    comm = nvc.Communicator(moe.mesh, "x")
    try:
        def f(x, ids, w):
            def body(i, acc):
                y_acc, f_acc = acc
                xi = x * (1.0 + i.astype(jnp.float32))
                sa = nvc.moe_dispatch_send(xi, ids, moe)
                sb = nvc.moe_dispatch_send(-xi, ids, moe)
                g = nvc.all_gather(xi[:1], comm)
                da = nvc.moe_dispatch_recv(sa, moe)
                db = nvc.moe_dispatch_recv(sb, moe)
                ca = nvc.moe_combine_send(da.expert_x * 2.0, da.handle, moe)
                cb = nvc.moe_combine_send(db.expert_x * 3.0, db.handle, moe)
                ya = nvc.moe_combine_recv(ca, w, moe)
                yb = nvc.moe_combine_recv(cb, w, moe)
                d = nvc.moe_dispatch(xi, ids, moe)
                fa = nvc.moe_combine(d.expert_x * 2.0, w, d.handle, moe)
                return y_acc + ya + yb + g.sum(), f_acc + fa - 1.5 * fa + g.sum()
            z = jnp.zeros_like(x)
            return jax.lax.fori_loop(0, 20, body, (z, z))

        x = rng.standard_normal((world * T, H)).astype(np.float32)
        ids = routing(rng, world * T, E, K)
        w = rng.random((world * T, K)).astype(np.float32)
        ys, fs = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * 3,
                                       out_specs=(P("x"), P("x"))))(x, ids, w)
        # ya + yb = (2 - 3) * combine of x_i = -fa: y_acc and f_acc (= -0.5 fa) differ by 2x
        gsum = sum(np.float64(i + 1) * x.reshape(world, T, H)[:, 0].sum() for i in range(20))
        ref = -(w.sum(1, keepdims=True) * x) * sum(1.0 + i for i in range(20))
        np.testing.assert_allclose(np.asarray(ys), ref * 1.0 + gsum, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(np.asarray(fs), -0.5 * (-2.0) * ref * 1.0 + gsum, rtol=1e-4,
                                   atol=1e-3)
    finally:
        comm.close()


def test_halves_in_separate_programs(rng):
    """Send in one jitted program, receive in another (the Sent pytree crosses the boundary):
    two in flight across programs, same results as the fused call."""
    world, E, K, T, H = 4, 8, 2, 4, 16
    moe = get_moe(world, E, K, T, H)
    sm = lambda f, n_in: jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * n_in,
                                               out_specs=P("x")))
    send = sm(lambda x, i: nvc.moe_dispatch_send(x, i, moe), 2)
    recv = sm(lambda s: nvc.moe_dispatch_recv(s, moe).expert_counts[None], 1)
    fused = sm(lambda x, i: nvc.moe_dispatch(x, i, moe).expert_counts[None], 2)
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    i1, i2 = routing(rng, world * T, E, K), routing(rng, world * T, E, K)
    s1, s2 = send(x, i1), send(x, i2)
    c1, c2 = recv(s1), recv(s2)
    np.testing.assert_array_equal(np.asarray(c1), np.asarray(fused(x, i1)))
    np.testing.assert_array_equal(np.asarray(c2), np.asarray(fused(x, i2)))


@pytest.mark.parametrize("check_vma", [True, False])
def test_gradients_equal_fused(rng, check_vma):
    world, E, K, T, H = 4, 8, 2, 5, 16
    moe = get_moe(world, E, K, T, H)
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = routing(rng, world * T, E, K, unused=0.1)
    w = rng.random((world * T, K)).astype(np.float32)
    nt = np.array([5, 4, 0, 5], np.int32)
    sw = rng.standard_normal((H, H)).astype(np.float32)

    def loss(split):
        def body(x, ids, w, nt):
            if split:
                s = nvc.moe_dispatch_send(x, ids, moe, num_tokens=nt[0])
                (xo,) = nvc.moe_overlap(s, x)
                shared = jnp.tanh(xo @ sw)
                d = nvc.moe_dispatch_recv(s, moe, after=shared)
                c = nvc.moe_combine_send(jnp.sin(d.expert_x), d.handle, moe)
                y = nvc.moe_combine_recv(c, w, moe)
            else:
                shared = jnp.tanh(x @ sw)
                d = nvc.moe_dispatch(x, ids, moe, num_tokens=nt[0])
                y = nvc.moe_combine(jnp.sin(d.expert_x), w, d.handle, moe)
            return jnp.sum((y + shared) ** 2)[None]

        return lambda x, w: jnp.sum(jax.shard_map(body, mesh=moe.mesh, in_specs=(P("x"),) * 4,
                                                  out_specs=P("x"), check_vma=check_vma)(
            x, ids, w, nt))

    g_split = jax.jit(jax.grad(loss(True), argnums=(0, 1)))(x, w)
    g_fused = jax.jit(jax.grad(loss(False), argnums=(0, 1)))(x, w)
    for a, b in zip(g_split, g_fused):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(g_split[1])).sum() > 0


def _trace(moe, fn, n_in=2):
    x = jnp.ones((moe.world_size * moe.max_tokens, moe.hidden), moe.dtype)
    ids = jnp.tile(jnp.arange(moe.top_k, dtype=jnp.int32), (x.shape[0], 1))
    jax.jit(jax.shard_map(fn, mesh=moe.mesh, in_specs=(P("x"),) * n_in,
                          out_specs=P("x"))).lower(x, ids)


def test_trace_time_rules():
    moe = get_moe(2, 4, 2, 3, 16)
    s = lambda x, i: nvc.moe_dispatch_send(x, i, moe)
    r = lambda sent: nvc.moe_dispatch_recv(sent, moe).expert_x

    def three(x, i):
        s(x, i), s(x, i)
        return s(x, i).token_dest
    with pytest.raises(ValueError, match=r"moe_dispatch_send: 2 split sends of this communicator "
                                         r"are already outstanding .* max_in_flight=2"):
        _trace(moe, three)

    def out_of_order(x, i):
        a, b = s(x, i), s(x, i)
        return r(b)
    with pytest.raises(ValueError, match="receives must come in the order of their sends"):
        _trace(moe, out_of_order)

    def twice(x, i):
        a = s(x, i)
        r(a)
        return r(a)
    with pytest.raises(ValueError, match="this send was received already"):
        _trace(moe, twice)

    def fused_between(x, i):
        a = s(x, i)
        nvc.moe_dispatch(x, i, moe)
        return r(a)
    with pytest.raises(ValueError, match=r"moe_dispatch: 1 split sends of this communicator are "
                                         r"outstanding; receive them"):
        _trace(moe, fused_between)

    def ok(x, i):  # two in flight, received in order, then fused again
        a, b = s(x, i), s(x, i)
        r(a), r(b)
        return nvc.moe_dispatch(x, i, moe).expert_x
    _trace(moe, ok)

    one = get_moe(2, 4, 2, 3, 16, m=1)
    assert one.nbytes < moe.nbytes
    with pytest.raises(ValueError, match="max_in_flight=1"):
        _trace(one, lambda x, i: (nvc.moe_dispatch_send(x, i, one),
                                  nvc.moe_dispatch_send(x, i, one))[1].token_dest)
    with pytest.raises(TypeError, match="sent must be the DispatchSent of moe_dispatch_send"):
        _trace(moe, lambda x, i: nvc.moe_dispatch_recv(nvc.moe_dispatch(x, i, moe), moe).expert_x)
    with pytest.raises(ValueError, match=r"max_in_flight must be 1, 2 or 4, got 3"):
        nvc.MoECommunicator(moe.mesh, "x", num_experts=4, top_k=2, max_tokens=3, hidden=16,
                            dtype=jnp.float32, max_in_flight=3)


@pytest.mark.parametrize("case", ["too_many", "out_of_order", "fused_between"])
def test_device_rules_across_programs(rng, case):
    """Across programs the trace cannot see the rules: the device refuses with a named error."""
    world, E, K, T, H = 2, 4, 2, 3, 16
    moe = nvc.MoECommunicator(mesh1d(world), "x", num_experts=E, top_k=K, max_tokens=T,
                              hidden=H, dtype=jnp.float32, max_in_flight=2, timeout_s=5)
    sm = lambda f, n_in: jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * n_in,
                                               out_specs=P("x")))
    send = sm(lambda x, i: nvc.moe_dispatch_send(x, i, moe), 2)
    recv = sm(lambda s: nvc.moe_dispatch_recv(s, moe).expert_counts[None], 1)
    fused = sm(lambda x, i: nvc.moe_dispatch(x, i, moe).expert_counts[None], 2)
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = routing(rng, world * T, E, K)
    try:
        a = send(x, ids)
        b = send(x, ids) if case != "fused_between" else a
        jax.block_until_ready((a, b))
        if case == "too_many":
            want = r"3 split sends outstanding, more than the communicator's max_in_flight=2"
            with pytest.raises(Exception, match=want):
                jax.block_until_ready(send(x, ids))
        elif case == "out_of_order":
            want = r"receive out of order: it belongs to send #2, the oldest outstanding send is #1"
            with pytest.raises(Exception, match=want):
                jax.block_until_ready(recv(b))
        else:
            want = r"a fused call while 1 split sends are outstanding"
            with pytest.raises(Exception, match=want):
                jax.block_until_ready(fused(x, ids))
        clear_error_tokens()
        assert any(re.search(want, e) for e in moe.errors()) or moe.errors(), moe.errors()
    finally:
        clear_error_tokens()
        moe.close()


def test_scheduled_program_places_shared_expert_between_halves(rng):
    """In the compiled (scheduled) program the shared expert's dot sits between the send and
    the receive custom calls (moe_overlap + after=): what the GPU stream runs in this order."""
    world, E, K, T, H = 4, 8, 2, 4, 16
    moe = get_moe(world, E, K, T, H)

    def f(x, ids, sw):
        sent = nvc.moe_dispatch_send(x, ids, moe)
        (xo,) = nvc.moe_overlap(sent, x)
        shared = jnp.dot(xo, sw)
        d = nvc.moe_dispatch_recv(sent, moe, after=shared)
        return d.expert_x.sum() + shared

    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = routing(rng, world * T, E, K)
    sw = rng.standard_normal((H, H)).astype(np.float32)
    g = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"), P("x"), P()),
                              out_specs=P("x")))
    from jax_nvcomm import moe_split
    order = moe_split.scheduled_order(g.lower(x, ids, sw).compile().as_text(),
                                      ["moe_dispatch_send", "dot(", "moe_dispatch_recv"])
    assert order == sorted(order) and len(order) == 3, order


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_split_across_processes(n):
    """tests/mp/split_moe_mp.py through the launcher, one CPU device per process."""
    from test_multiprocess import launch
    rc, out = launch(n, "split_moe_mp.py", "--rounds=6", "--iters=10", timeout=400)
    assert rc == 0, out[-4000:]
    assert out.count("PASS") == n, out[-4000:]
    assert out.count("SCHEDULE shared expert between send and receive OK") == n, out[-4000:]


from test_fallback import fake_hosts  # noqa: E402,F401  (fixture)


def test_split_on_an_xla_fallback_communicator(fake_hosts, rng):  # noqa: F811
    """Groups over (fake) hosts: the split calls run the XLA path, equal to the fused calls."""
    fake_hosts(lambda d: f"node{d % 2}")
    from conftest import make_mesh
    mesh = make_mesh((4,), ("x",))
    W, T, H, E, K = 4, 4, 16, 8, 2
    moe = nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                              dtype=jnp.float32)
    try:
        assert moe.xla_fallback
        x = rng.standard_normal((W * T, H)).astype(np.float32)
        ids = routing(rng, W * T, E, K)
        w = rng.random((W * T, K)).astype(np.float32)

        def body(x, i, w):
            d = nvc.moe_dispatch(x, i, moe)
            y = nvc.moe_combine(d.expert_x * 2.0, w, d.handle, moe)
            s = nvc.moe_dispatch_send(x, i, moe)
            (xo,) = nvc.moe_overlap(s, x)
            d2 = nvc.moe_dispatch_recv(s, moe, after=xo)
            c = nvc.moe_combine_send(d2.expert_x * 2.0, d2.handle, moe)
            return y, nvc.moe_combine_recv(c, w, moe)

        y, y2 = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3,
                                      out_specs=(P("x"), P("x"))))(x, ids, w)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
        np.testing.assert_allclose(np.asarray(y2), 2 * w.sum(1, keepdims=True) * x, rtol=1e-5,
                                   atol=1e-5)
    finally:
        moe.close()
