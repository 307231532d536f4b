"""moe_dispatch / moe_combine against a float64 numpy reference on 8 CPU devices (host
backend): exact counts and row order, scales, num_tokens, -1 ids, degenerate routings, top_k 1
and 8, fp8 payloads, many rounds, two dispatches in flight, gradients, validation."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from helpers import clear_error_tokens, mesh1d, np_moe_reference, tanh_expert_losses

MOES = {}


def get_moe(world, E, K, T, H, dtype=jnp.float32, S=0):
    key = (world, E, K, T, H, jnp.dtype(dtype).name, S)
    if key not in MOES:
        MOES[key] = nvc.MoECommunicator(mesh1d(world), "x", num_experts=E, top_k=K, max_tokens=T,
                                        hidden=H, dtype=dtype, scale_cols=S)
    return MOES[key]


@pytest.fixture(scope="module", autouse=True)
def _close_all():
    yield
    for m in MOES.values():
        m.close()
    MOES.clear()


def routing(rng, n, E, K, mode="random"):
    if mode == "random":
        return np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    if mode == "one_expert":  # every token to expert 0 (+ distinct others to fill top_k)
        return np.stack([np.r_[0, rng.choice(np.arange(1, E), K - 1, replace=False)]
                         for _ in range(n)]).astype(np.int32)
    raise ValueError(mode)


def run_round(moe, x, ids, w, nt, ey_scale=2.0, scales=None):

    def f(x, ids, w, nt, *sc):
        d = nvc.moe_dispatch(x, ids, moe, num_tokens=nt[0], x_scale=sc[0] if sc else None)
        ey = (d.expert_x.astype(jnp.float32) * ey_scale).astype(jnp.float32)
        y = nvc.moe_combine(ey, w, d.handle, moe)
        outs = (d.expert_x[None], d.expert_counts[None], y)
        if sc:
            outs += (d.expert_x_scale[None],)
        return outs

    n_in = 4 + (1 if scales is not None else 0)
    args = (x, ids, w, nt) + ((scales,) if scales is not None else ())
    return jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * n_in,
                                 out_specs=(P("x"),) * (n_in - 1)))(*args)


def check(moe, x, ids, w, nt, outs, ey_scale=2.0, scales=None):
    W, T, E = moe.world_size, moe.max_tokens, moe.num_experts
    ex, cnt, y = (np.asarray(jnp.asarray(o).astype(jnp.float32)) for o in outs[:3])
    xf = np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    ref = np_moe_reference(xf, ids, nt, E, W)
    L = moe.num_local_experts
    # rows past an expert's count are unspecified (whatever the buffer held): only the counted
    # rows enter the reference (scaling the others could overflow: meaningless warnings)
    counted = np.arange(ex.shape[2])[None, :, None] < cnt[:, :, None, None]
    expert_y = [np.where(counted[r], ex[r], 0.0) * ey_scale for r in range(W)]
    for r in range(W):
        for e in range(L):
            rows = ref["rows"][r][e]
            assert cnt[r, e] == len(rows), f"count rank {r} expert {e}"
            if rows:
                want = np.stack([xf[s * T + t] for s, t in rows])
                np.testing.assert_array_equal(ex[r, e, :len(rows)], want)
                if scales is not None:
                    np.testing.assert_array_equal(
                        np.asarray(outs[3])[r, e, :len(rows)],
                        np.stack([scales[s * T + t] for s, t in rows]))
    yref = np_moe_reference(xf, ids, nt, E, W, weights=w, expert_y=expert_y)["y"]
    np.testing.assert_allclose(y, yref, rtol=1e-5, atol=1e-5)
    for s in range(W):  # rows >= num_tokens are zero
        assert not np.any(y[s * T + int(nt[s]):(s + 1) * T])


@pytest.mark.parametrize("world,E,K", [(2, 4, 2), (4, 16, 4), (8, 32, 8), (8, 8, 1), (1, 4, 2)])
def test_dispatch_combine_random(rng, world, E, K):
    T, H = 6, 32
    moe = get_moe(world, E, K, T, H)
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = routing(rng, world * T, E, K)
    w = rng.random((world * T, K)).astype(np.float32)
    nt = np.full((world,), T, np.int32)
    check(moe, x, ids, w, nt, run_round(moe, x, ids, w, nt))


def test_num_tokens_zero_rank_and_unused_slots(rng):
    world, E, K, T, H = 4, 16, 4, 7, 16
    moe = get_moe(world, E, K, T, H)
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = routing(rng, world * T, E, K)
    ids[rng.random(ids.shape) < 0.3] = -1
    w = rng.random((world * T, K)).astype(np.float32)
    nt = np.array([7, 3, 0, 1], np.int32)
    check(moe, x, ids, w, nt, run_round(moe, x, ids, w, nt))


def test_all_tokens_to_one_expert(rng):
    world, E, K, T, H = 8, 16, 2, 8, 16
    moe = get_moe(world, E, K, T, H)
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = routing(rng, world * T, E, K, mode="one_expert")
    w = rng.random((world * T, K)).astype(np.float32)
    nt = np.full((world,), T, np.int32)
    outs = run_round(moe, x, ids, w, nt)
    assert int(np.asarray(outs[1])[0, 0]) == world * T  # capacity of expert 0 reached
    check(moe, x, ids, w, nt, outs)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_payload_dtypes_with_scales(rng, dtype):
    world, E, K, T, H, S = 4, 8, 2, 5, 64, 2
    moe = get_moe(world, E, K, T, H, dtype=dtype, S=S)
    x = jnp.asarray(rng.standard_normal((world * T, H)), dtype)
    scales = rng.random((world * T, S)).astype(np.float32)
    ids = routing(rng, world * T, E, K)
    w = rng.random((world * T, K)).astype(np.float32)
    nt = np.array([5, 2, 5, 0], np.int32)
    outs = run_round(moe, x, ids, w, nt, scales=scales)
    check(moe, x, ids, w, nt, outs, scales=scales)


@pytest.mark.slow
def test_1000_rounds_changing_routing(rng):
    world, E, K, T, H = 8, 16, 2, 4, 16
    moe = get_moe(world, E, K, T, H)

    def f(x, ids, w, nt):
        d = nvc.moe_dispatch(x, ids, moe, num_tokens=nt[0])
        return d.expert_counts[None], nvc.moe_combine(d.expert_x, w, d.handle, moe)

    g = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * 4,
                              out_specs=(P("x"), P("x"))))
    for i in range(1000):
        x = rng.integers(-3, 4, size=(world * T, H)).astype(np.float32)
        ids = routing(rng, world * T, E, K)
        w = np.ones((world * T, K), np.float32)
        nt = rng.integers(0, T + 1, size=world).astype(np.int32)
        cnt, y = g(x, ids, w, nt)
        valid = np.arange(world * T) % T < np.repeat(nt, T)
        # expert_y = expert_x, weights 1: y = top_k * x for valid tokens, 0 otherwise
        np.testing.assert_array_equal(np.asarray(y), np.where(valid[:, None], K * x, 0),
                                      err_msg=f"round {i}")
        assert int(np.asarray(cnt).sum()) == int(K * valid.sum()), f"round {i}"


def test_two_dispatches_in_flight(rng):
    world, E, K, T, H = 4, 8, 2, 4, 16
    moe = get_moe(world, E, K, T, H)

    def f(x1, x2, i1, i2, w):
        d1 = nvc.moe_dispatch(x1, i1, moe)
        d2 = nvc.moe_dispatch(x2, i2, moe)
        y2 = nvc.moe_combine(d2.expert_x * 3.0, w, d2.handle, moe)
        y1 = nvc.moe_combine(d1.expert_x * 2.0, w, d1.handle, moe)
        return y1, y2

    x1, x2 = (rng.standard_normal((world * T, H)).astype(np.float32) for _ in range(2))
    i1, i2 = (routing(rng, world * T, E, K) for _ in range(2))
    w = rng.random((world * T, K)).astype(np.float32)
    y1, y2 = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * 5,
                                   out_specs=(P("x"), P("x"))))(x1, x2, i1, i2, w)
    np.testing.assert_allclose(np.asarray(y1), 2 * w.sum(1, keepdims=True) * x1, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(y2), 3 * w.sum(1, keepdims=True) * x2, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("check_vma", [True, False])
def test_gradients_match_pure_jax(rng, check_vma):
    world, E, K, T, H = 4, 8, 2, 5, 16
    moe = get_moe(world, E, K, T, H)
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = routing(rng, world * T, E, K)
    ids[2, 1] = -1
    w = rng.random((world * T, K)).astype(np.float32)
    nt = np.array([5, 4, 0, 5], np.int32)
    scale = jnp.asarray(rng.standard_normal((E,)), jnp.float32)  # per-expert "FFN"
    loss, loss_ref = tanh_expert_losses(moe, scale, ids, nt, check_vma=check_vma)
    g1 = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    g2 = jax.grad(loss_ref, argnums=(0, 1))(x, w)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_bad_expert_id_is_an_error(rng):
    world, E, K, T, H = 2, 4, 2, 3, 16
    moe = nvc.MoECommunicator(mesh1d(world), "x", num_experts=E, top_k=K, max_tokens=T,
                              hidden=H, dtype=jnp.float32, timeout_s=5)
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = routing(rng, world * T, E, K)
    ids[4, 0] = E + 3
    f = jax.jit(jax.shard_map(lambda x, i: nvc.moe_dispatch(x, i, moe).expert_x[None],
                              mesh=moe.mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
    # rank 1's finding first, whichever rank's error XLA raises
    with pytest.raises(Exception, match=r"^[^\n]*rank 1[^\n]*topk_ids\[1, 0\] = 7, outside"):
        jax.block_until_ready(f(x, ids))
    clear_error_tokens()
    # The records: rank 1 (rows 3..5, the bad id at its token 1, column 0) names token, column
    # and id; rank 0 names the rank that failed the call. (The record once printed the token
    # index as the expert id: "expert id 1".)
    errs = moe.errors()
    bad = [e for e in errs if "rank 1: topk_ids" in e]
    assert bad == ["jax_nvcomm: moe_dispatch call #1: rank 1: topk_ids[1, 0] = 7, outside "
                   "[-1, num_experts)"], errs
    assert any("rank 0: rank 1 failed this call" in e for e in errs), errs
    # the next call is refused with the recorded text, before any data moves
    with pytest.raises(Exception, match=r"^[^\n]*rank 1: topk_ids\[1, 0\] = 7, outside[\s\S]*"
                                        r"\(communicator is unusable after this error"):
        jax.block_until_ready(f(x, routing(rng, world * T, E, K)))
    clear_error_tokens()
    moe.close()


def test_repeated_expert_id_record_names_token_slot_and_id(rng):
    world, E, K, T, H = 2, 8, 3, 4, 16
    moe = nvc.MoECommunicator(mesh1d(world), "x", num_experts=E, top_k=K, max_tokens=T,
                              hidden=H, dtype=jnp.float32, timeout_s=5)
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = routing(rng, world * T, E, K)
    ids[2, 2] = ids[2, 0]  # rank 0, token 2: slot 2 repeats slot 0's expert
    f = jax.jit(jax.shard_map(lambda x, i: nvc.moe_dispatch(x, i, moe).expert_x[None],
                              mesh=moe.mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
    with pytest.raises(Exception, match=r"^[^\n]*rank 0[^\n]*topk_ids\[2, 2\] = \d+ repeats"):
        jax.block_until_ready(f(x, ids))
    clear_error_tokens()
    want = (f"jax_nvcomm: moe_dispatch call #1: rank 0: topk_ids[2, 2] = {ids[2, 0]} repeats "
            f"an expert id of an earlier column of that row")
    assert want in moe.errors(), moe.errors()
    moe.close()


def test_validation_messages():
    moe = get_moe(2, 4, 2, 3, 16)
    mesh = moe.mesh

    def trace(fn, *args):
        jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * len(args),
                              out_specs=P("x"))).lower(*args)

    x = jnp.ones((6, 16), jnp.float32)
    ids = jnp.zeros((6, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"x must have shape \(max_tokens, hidden\) = \(3, 16\), "
                                         r"got \(3, 8\)"):
        trace(lambda a, b: nvc.moe_dispatch(a[:, :8], b, moe).expert_x, x, ids)
    with pytest.raises(TypeError, match="x must have the communicator's dtype float32, got bfloat16"):
        trace(lambda a, b: nvc.moe_dispatch(a.astype(jnp.bfloat16), b, moe).expert_x, x, ids)
    with pytest.raises(TypeError, match="topk_ids must be int32, got float32"):
        trace(lambda a, b: nvc.moe_dispatch(a, b.astype(jnp.float32), moe).expert_x, x, ids)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[0, max_tokens=3\], got 4"):
        trace(lambda a, b: nvc.moe_dispatch(a, b, moe, num_tokens=4).expert_x, x, ids)
    with pytest.raises(ValueError, match=r"expert_y must have shape"):
        trace(lambda a, b: nvc.moe_combine(a, jnp.ones((3, 2)), nvc.moe_dispatch(a, b, moe).handle,
                                           moe), x, ids)
    with pytest.raises(ValueError, match="num_experts must be divisible by the axis size 2, got 3"):
        nvc.MoECommunicator(mesh, "x", num_experts=3, top_k=1, max_tokens=2, hidden=16,
                            dtype=jnp.float32)
    with pytest.raises(TypeError, match="dtype must be bfloat16, float16, float32 or "
                                        "float8_e4m3fn, got int8"):
        nvc.MoECommunicator(mesh, "x", num_experts=4, top_k=1, max_tokens=2, hidden=16,
                            dtype=jnp.int8)
    with pytest.raises(ValueError, match="hidden must be a multiple of 8"):
        nvc.MoECommunicator(mesh, "x", num_experts=4, top_k=1, max_tokens=2, hidden=12,
                            dtype=jnp.float32)


def test_host_protocol_harness(tmp_path):
    """The C++ host MoE protocol alone (tests/cuda_harness/moe_host_test.cc: W threads over
    malloc'd buffers), against the reference shared with the GPU harness (moe_check.h): exact
    rows/counts/handles, bitwise combine, error cases. Needs a C++ compiler, not a GPU."""
    import pathlib
    import shutil
    import subprocess
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    root = pathlib.Path(__file__).resolve().parents[1]
    exe = tmp_path / "moe_host_test"
    subprocess.run([cxx, "-std=c++17", "-O2", "-pthread", "-I", str(root / "csrc"),
                    str(root / "tests/cuda_harness/moe_host_test.cc"),
                    str(root / "csrc/host/moe_host.cc"), "-o", str(exe)],
                   check=True, capture_output=True, timeout=300)
    p = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0 and "PASS: 0 failure(s)" in p.stdout, p.stdout[-3000:]


def _rows_of(ids, nt, W, T, E):
    """API.md order: pair (s, t, k) -> its row in expert ids[s*T+t, k]'s block, counting the
    pairs sent to that expert in (source rank, token) order; -1 slots and t >= nt[s]: none."""
    seen, where = np.zeros(E, int), {}
    for s in range(W):
        for t in range(int(nt[s])):
            for k in range(ids.shape[1]):
                e = int(ids[s * T + t, k])
                if e >= 0:
                    where[(s, t, k)] = (e, seen[e])
                    seen[e] += 1
    return where, seen


def test_gradients_bf16_and_x_scale(rng):
    """jax.grad in bfloat16 through dispatch (to x and to the FP8-style x_scale) and combine
    (to expert_y and topk_weights), against float64 numpy written from the definitions:
    loss = sum(Gx * expert_x) + sum(Gs * expert_x_scale) (rows below the counts) +
    sum(Gy * y): dx[s,t] = sum_k Gx[row(s,t,k)], dscale likewise, dexpert_y[row(s,t,k)] =
    w[s,t,k] Gy[s,t], dw[s,t,k] = <expert_y[row(s,t,k)], Gy[s,t]>."""
    W, E, K, T, H, S = 4, 8, 2, 5, 16, 2
    L = E // W
    moe = get_moe(W, E, K, T, H, jnp.bfloat16, S)
    ids = routing(rng, W * T, E, K)
    ids[rng.random(ids.shape) < 0.2] = -1
    nt = np.array([5, 3, 0, 5], np.int32)
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)  # noqa
    x = jnp.asarray(rng.standard_normal((W * T, H)), jnp.bfloat16)
    sc = jnp.asarray(rng.random((W * T, S)) + 0.5, jnp.float32)
    w = jnp.asarray(rng.random((W * T, K)), jnp.float32)
    ey = jnp.asarray(rng.standard_normal((W * L, W * T, H)), jnp.bfloat16)
    gx = rng.standard_normal((W * L, W * T, H)).astype(np.float32)
    gs = rng.standard_normal((W * L, W * T, S)).astype(np.float32)
    gy = rng.standard_normal((W * T, H)).astype(np.float32)

    def loss(x, sc, ey, w):
        def body(x, sc, ey, w, ids, nt, gx, gs, gy):
            d = nvc.moe_dispatch(x, ids, moe, num_tokens=nt[0], x_scale=sc)
            m = (jnp.arange(W * T)[None, :] < d.expert_counts[:, None])[..., None]
            y = nvc.moe_combine(ey, w, d.handle, moe)
            out = (jnp.sum(jnp.where(m, d.expert_x.astype(jnp.float32), 0) * gx) +
                   jnp.sum(jnp.where(m, d.expert_x_scale, 0) * gs) +
                   jnp.sum(y.astype(jnp.float32) * gy))
            return out[None]
        return jnp.sum(jax.shard_map(body, mesh=moe.mesh, in_specs=(P("x"),) * 9,
                                     out_specs=P("x"))(x, sc, ey, w, ids, nt, gx, gs, gy))

    dx, dsc, dey, dw = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, sc, ey, w)
    assert dx.dtype == jnp.bfloat16 and dey.dtype == jnp.bfloat16 and dsc.dtype == jnp.float32
    where, _ = _rows_of(ids, nt, W, T, E)
    ey64 = bf(ey).reshape(E, W * T, H)
    gx3, gs3 = gx.reshape(E, W * T, H), gs.reshape(E, W * T, S)
    want_dx, want_ds = np.zeros((W * T, H)), np.zeros((W * T, S))
    want_dey, want_dw = np.zeros((E, W * T, H)), np.zeros((W * T, K))
    for (s, t, k), (e, row) in where.items():
        i = s * T + t
        want_dx[i] += gx3[e, row]
        want_ds[i] += gs3[e, row]
        want_dey[e, row] += float(w[i, k]) * gy[i]
        want_dw[i, k] = ey64[e, row] @ bf(gy[i])  # y is bfloat16: so is its cotangent
    assert np.abs(want_ds).max() > 0 and np.abs(want_dw).max() > 0
    np.testing.assert_allclose(bf(dx), want_dx, rtol=1e-2, atol=1e-2 * np.abs(want_dx).max())
    np.testing.assert_allclose(np.asarray(dsc, np.float64), want_ds, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bf(dey).reshape(E, W * T, H), want_dey, rtol=1e-2,
                               atol=1e-2 * np.abs(want_dey).max())
    np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw, rtol=1e-2,
                               atol=1e-2 * np.abs(want_dw).max())


def test_on_one_axis_of_a_2d_mesh(rng):
    """Mesh ("dp", "ep") 2 x 4, MoECommunicator over "ep": each dp row is its own group of 4
    ranks (experts 0..7 in each), same routing semantics, groups independent; checked against
    the oracle per group."""
    from conftest import make_mesh
    from helpers import oracle_combine, oracle_dispatch
    D, W, E, K, T, H = 2, 4, 8, 2, 6, 32
    L = E // W
    mesh = make_mesh((D, W), ("dp", "ep"))
    with nvc.MoECommunicator(mesh, "ep", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                             dtype=jnp.float32) as moe:
        assert moe.world_size == W
        x = rng.standard_normal((D * W * T, H)).astype(np.float32)
        ids = routing(rng, D * W * T, E, K)
        ids[rng.random(ids.shape) < 0.15] = -1
        w = rng.random((D * W * T, K)).astype(np.float32)
        nt = rng.integers(0, T + 1, size=D * W).astype(np.int32)
        ey = rng.standard_normal((D * W * L, W * T, H)).astype(np.float32)

        def f(x, ids, w, nt, ey):
            d = nvc.moe_dispatch(x, ids, moe, num_tokens=nt[0])
            return d.expert_x[None], d.expert_counts[None], nvc.moe_combine(ey, w, d.handle, moe)
        spec = P(("dp", "ep"))
        ex, cnt, y = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 5,
                                           out_specs=(spec,) * 3))(x, ids, w, nt, ey)
        ex = np.asarray(ex).reshape(D, W, L, W * T, H)
        cnt = np.asarray(cnt).reshape(D, W, L)
        y = np.asarray(y, np.float64).reshape(D, W, T, H)
        for g in range(D):
            sl = slice(g * W * T, (g + 1) * W * T)
            ids3 = ids[sl].reshape(W, T, K)
            want = oracle_dispatch(x[sl].reshape(W, T, H), ids3, nt[g * W:(g + 1) * W], E)
            for d in range(W):
                np.testing.assert_array_equal(cnt[g, d], want[d][1])
                for e in range(L):
                    np.testing.assert_array_equal(ex[g, d, e, :cnt[g, d, e]], want[d][0][e])
            yref = oracle_combine(ey.reshape(D, W, L, W * T, H)[g], w[sl].reshape(W, T, K),
                                  ids3, nt[g * W:(g + 1) * W], E)
            np.testing.assert_allclose(y[g], yref, rtol=1e-5, atol=1e-5)


def test_vmap_with_only_the_order_token_batched_makes_one_call(rng):
    """custom_vmap runs an op's batching rule when any operand carries the batch, the order
    token included. With only the token batched nothing of the call is: ONE unbatched kernel
    call per op (its results broadcast by vmap), even for the MoE ops, which refuse batched
    arguments by name. A user's jax.vmap does not batch our tokens (each op makes its own in
    its trace: even a lax.cond with a batched predicate, which batches every operand, batches
    the MoE arguments with it), so this batches the token of the MoE ops' kernel calls
    directly; a batched x still gets the named error."""
    import jax_nvcomm._order as order
    import jax_nvcomm.moe as moe_mod
    world, E, K, T, H, B = 4, 8, 2, 6, 16, 3
    moe = get_moe(world, E, K, T, H)
    disp = moe_mod.moe_call(moe, "moe_dispatch",
                            lambda *a: moe_mod._dispatch_kernel(*a, moe=moe))
    comb = moe_mod.moe_call(moe, "moe_combine", lambda *a: moe_mod._combine_kernel(*a, moe=moe))
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = routing(rng, world * T, E, K)
    w = rng.random((world * T, K)).astype(np.float32)
    nt = rng.integers(0, T + 1, size=world).astype(np.int32)

    def f(x, ids, w, nt):
        def one(t_disp, t_comb):  # only the tokens carry the batch
            ex, cnt, _, td, es, _ = disp(x, ids, nt[0], t_disp)
            y, _ = comb(ex * 2.0, w, td, es, cnt, t_comb)
            return ex[None], cnt[None], y
        tok = order.token(moe.axis_name)
        toks = jnp.broadcast_to(tok, (B,) + tok.shape)
        return jax.vmap(one)(toks, toks)

    spec = P(None, "x")
    prog = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * 4,
                                 out_specs=(spec,) * 3))
    hlo = prog.lower(x, ids, w, nt).as_text()
    assert len(re.findall(r"custom_call @nvc_moe_dispatch", hlo)) == 1, hlo
    assert len(re.findall(r"custom_call @nvc_moe_combine", hlo)) == 1, hlo
    ex, cnt, y = prog(x, ids, w, nt)
    assert ex.shape[0] == cnt.shape[0] == y.shape[0] == B
    for b in range(B):
        check(moe, x, ids, w, nt, (ex[b], cnt[b], y[b]))

    def batched_x(xb, ids, nt):
        return jax.vmap(lambda v: disp(v, ids, nt[0], order.token(moe.axis_name))[0])(xb)

    with pytest.raises(NotImplementedError, match="moe_dispatch: jax.vmap is not supported"):
        jax.jit(jax.shard_map(batched_x, mesh=moe.mesh, in_specs=(P(None, "x"), P("x"), P("x")),
                              out_specs=P(None, "x"))).lower(np.stack([x] * B), ids, nt)
