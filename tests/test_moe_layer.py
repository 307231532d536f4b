"""nvc.moe_layer against a dense float64 numpy reference written here (each token, each of its
experts, silu(x Wg) * (x Wu) Wd weighted and summed): random routing, every token on one rank's
experts, ranks with no tokens (num_tokens 0) and experts / ranks that receive none, num_tokens
< max_tokens (rows past it exactly zero), -1 slots, top_k 1 and top_k > local experts,
float32 / bfloat16 / float16; the expert block alone on a layout with garbage rows; the
gradient refusal; argument validation. 8 CPU devices (host backend) unless
JAX_NVCOMM_TEST_GPU=1 (then the GPUs of this process)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm import moe_experts as ml
from conftest import make_mesh
from helpers import np_moe_layer_reference

MOES = {}


def get_moe(world, E, K, T, H, dtype):
    key = (world, E, K, T, H, jnp.dtype(dtype).name)
    if key not in MOES:
        MOES[key] = nvc.MoECommunicator(make_mesh((world,), ("x",)), "x", num_experts=E, top_k=K,
                                        max_tokens=T, hidden=H, dtype=dtype)
    return MOES[key]


@pytest.fixture(scope="module", autouse=True)
def _close_all():
    yield
    for m in MOES.values():
        m.close()
    MOES.clear()


def upto(n):
    """n ranks, or as many as there are devices (the GPU run: world 1 on one GPU)."""
    return min(n, len(jax.devices()))


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def routing(rng, world, T, E, K, mode):
    n = world * T
    if mode == "random":
        return np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int32)
    if mode == "one_rank":  # every token to experts of the last rank only
        L = E // world
        return np.stack([(world - 1) * L + rng.choice(L, K, replace=False)
                         for _ in range(n)]).astype(np.int32)
    raise ValueError(mode)


def run_layer(moe, x, ids, w, nt, wg, wu, wd):
    def f(x, ids, w, nt, wg, wu, wd):
        return nvc.moe_layer(x, ids, w, wg, wu, wd, moe, num_tokens=nt[0])

    spec = P("x")
    return jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(spec,) * 7, out_specs=spec))(
        x, ids, w, nt, wg, wu, wd)


TOL = {"float32": (2e-5, 2e-5), "bfloat16": (3e-2, 2e-2), "float16": (4e-3, 3e-3)}


def case(rng, world, E, K, T, H, F, dtype, mode="random", nt=None, drop=0.0):
    moe = get_moe(world, E, K, T, H, dtype)
    dt = jnp.dtype(dtype)
    x = jnp.asarray(rng.standard_normal((world * T, H)), dt)
    # weights scaled so that g, u ~ 1 and the outputs ~ 1 (silu in its curved range)
    wg = jnp.asarray(rng.standard_normal((E, H, F)) / np.sqrt(H), dt)
    wu = jnp.asarray(rng.standard_normal((E, H, F)) / np.sqrt(H), dt)
    wd = jnp.asarray(rng.standard_normal((E, F, H)) / np.sqrt(F), dt)
    ids = routing(rng, world, T, E, K, mode)
    if drop:
        ids[rng.random(ids.shape) < drop] = -1
    w = rng.random((world * T, K)).astype(np.float32)
    nt = np.full((world,), T, np.int32) if nt is None else np.asarray(nt, np.int32)
    y = run_layer(moe, x, ids, w, nt, wg, wu, wd)
    assert y.dtype == dt and y.shape == (world * T, H)
    ref = np_moe_layer_reference(_f64(x), ids, w, nt, _f64(wg), _f64(wu), _f64(wd), world)
    got = _f64(y)
    rtol, atol = TOL[dt.name]
    # the scale over the rows that have tokens (rows past num_tokens are exact zeros)
    live = ref[np.any(ref != 0, axis=1)]
    scale = np.sqrt(np.mean(live ** 2)) if live.size else 1.0
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=atol * scale)
    T_ = T
    for s in range(world):  # rows past num_tokens: exactly zero
        assert not np.any(got[s * T_ + int(nt[s]):(s + 1) * T_]), f"rank {s} rows >= num_tokens"
    return got, ref


@pytest.mark.parametrize("world", [1, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_random_routing(rng, dtype, world):
    case(rng, world, 4 * world, 4, 6, 32, 48, dtype)


@pytest.mark.parametrize("world,E,K", [(1, 4, 2), (2, 8, 8), (4, 8, 1), (8, 16, 3)])
def test_worlds_and_top_k(rng, world, E, K):
    case(rng, world, E, K, 5, 16, 24, "float32")


@pytest.mark.parametrize("world", [2, 8])
def test_skewed_onto_one_rank(rng, world):
    # every token of every rank goes to the last rank's experts: the other ranks' experts get
    # nothing, the last rank's are full (W*T rows each when K = L)
    got, ref = case(rng, world, 2 * world, 2, 7, 32, 40, "bfloat16", mode="one_rank")
    assert np.all(np.any(ref != 0, axis=1))


@pytest.mark.parametrize("nt", [[6, 0, 3, 0, 1, 6, 0, 2], [3], [0, 5]])
def test_ranks_without_tokens_and_num_tokens(rng, nt):
    world = len(nt)
    case(rng, world, 4 * world, 4, 6, 16, 32, "bfloat16", nt=nt)


def test_unused_slots(rng):
    W = upto(4)
    case(rng, W, 4 * W, 4, 8, 16, 16, "float32", drop=0.3)


def test_all_ranks_empty(rng):
    # every rank sends nothing: every expert gets no rows, y is zero everywhere
    W = upto(4)
    got, _ = case(rng, W, 2 * W, 2, 4, 16, 16, "float32", nt=[0] * W)
    assert not np.any(got)


def test_repeated_calls_in_one_program(rng):
    # two layers back to back in one jit (the second on the first's output): the order chain
    # across the layer's nested trace keeps every rank's calls paired
    world = upto(4)
    E, K, T, H, F = 2 * world, 2, 4, 16, 16
    moe = get_moe(world, E, K, T, H, "float32")
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    wg, wu = (rng.standard_normal((E, H, F)).astype(np.float32) / 4 for _ in range(2))
    wd = rng.standard_normal((E, F, H)).astype(np.float32) / 4
    ids = routing(rng, world, T, E, K, "random")
    w = rng.random((world * T, K)).astype(np.float32)

    def f(x, ids, w, wg, wu, wd):
        y = nvc.moe_layer(x, ids, w, wg, wu, wd, moe)
        return nvc.moe_layer(y, ids, w, wg, wu, wd, moe)

    spec = P("x")
    y = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(spec,) * 6, out_specs=spec))(
        x, ids, w, wg, wu, wd)
    nt = np.full((world,), T)
    ref = np_moe_layer_reference(np.float64(x), ids, w, nt, np.float64(wg), np.float64(wu),
                          np.float64(wd), world)
    ref = np_moe_layer_reference(ref, ids, w, nt, np.float64(wg), np.float64(wu), np.float64(wd),
                          world)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-4, atol=1e-5)


def test_expert_block_ignores_uncounted_rows(rng):
    # the expert block alone: rows past each count hold NaN and must not reach counted rows
    L, R, H, F = 5, 6, 8, 12
    ex = rng.standard_normal((L, R, H)).astype(np.float32)
    counts = np.array([0, 6, 2, 0, 3], np.int32)
    for e in range(L):
        ex[e, counts[e]:] = np.nan
    wg, wu = (rng.standard_normal((L, H, F)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((L, F, H)).astype(np.float32)
    ey = np.asarray(jax.jit(lambda *a: ml.expert_block(*a, jnp.float32, max_rows=12))(
        ex, counts, wg, wu, wd))
    for e in range(L):
        for i in range(counts[e]):
            g, u = ex[e, i].astype(np.float64) @ wg[e], ex[e, i].astype(np.float64) @ wu[e]
            want = (g / (1 + np.exp(-g)) * u) @ wd[e]
            np.testing.assert_allclose(ey[e, i], want, rtol=1e-4, atol=1e-4)


def test_grad_raises_naming_composed_path(rng):
    world = upto(2)
    E, K, T, H, F = 2 * world, 2, 4, 16, 16
    moe = get_moe(world, E, K, T, H, "float32")
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    wg, wu = (rng.standard_normal((E, H, F)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((E, F, H)).astype(np.float32)
    ids = routing(rng, world, T, E, K, "random")
    w = rng.random((world * T, K)).astype(np.float32)

    def loss(wg, x, ids, w, wu, wd):
        f = jax.shard_map(lambda *a: nvc.moe_layer(*a, moe), mesh=moe.mesh,
                          in_specs=(P("x"),) * 6, out_specs=P("x"))
        return jnp.sum(f(x, ids, w, wg, wu, wd))

    with pytest.raises(NotImplementedError, match="moe_dispatch.*ragged_dot.*moe_combine"):
        jax.grad(loss)(wg, x, ids, w, wu, wd)


def _call(moe, **over):
    T, H, K, L = moe.max_tokens, moe.hidden, moe.top_k, moe.num_local_experts
    W = moe.world_size
    dt = moe.dtype
    a = dict(x=jnp.zeros((W * T, H), dt), ids=jnp.zeros((W * T, K), jnp.int32),
             w=jnp.zeros((W * T, K), jnp.float32), wg=jnp.zeros((W * L, H, 8), dt),
             wu=jnp.zeros((W * L, H, 8), dt), wd=jnp.zeros((W * L, 8, H), dt))
    a.update(over)
    kw = {"num_tokens": a.pop("nt")} if "nt" in a else {}
    names = ("x", "ids", "w", "wg", "wu", "wd")
    f = jax.shard_map(lambda *v: nvc.moe_layer(*v, moe, **kw), mesh=moe.mesh,
                      in_specs=(P("x"),) * 6, out_specs=P("x"))
    return jax.jit(f)(*(a[n] for n in names))


def test_validation():
    W = upto(2)
    moe = get_moe(W, 2 * W, 2, 4, 16, "bfloat16")
    bf = jnp.bfloat16
    with pytest.raises(ValueError, match=r"w_gate must have shape .*\(2, 16, F\)"):
        _call(moe, wg=jnp.zeros((2 * W, 8, 8), bf))
    with pytest.raises(ValueError, match=r"w_down must have shape \(2, 8, 16\)"):
        _call(moe, wd=jnp.zeros((2 * W, 16, 16), bf))
    with pytest.raises(TypeError, match="w_up must have x's dtype bfloat16, got float32"):
        _call(moe, wu=jnp.zeros((2 * W, 16, 8), jnp.float32))
    with pytest.raises(ValueError, match="topk_weights must be float32"):
        _call(moe, w=jnp.zeros((4 * W, 2), bf))
    with pytest.raises(TypeError, match="moe_layer: x must have the communicator's dtype"):
        _call(moe, x=jnp.zeros((4 * W, 16), jnp.float32))
    with pytest.raises(ValueError, match=r"moe_layer: num_tokens must be in \[0, max_tokens=4\]"):
        _call(moe, nt=5)
    with pytest.raises(TypeError, match="moe must be a MoECommunicator"):
        nvc.moe_layer(jnp.zeros((4, 16)), None, None, None, None, None, object())


def test_fp8_communicator_refused():
    W = upto(2)
    moe = get_moe(W, 2 * W, 2, 4, 16, "float8_e4m3fn")
    with pytest.raises(TypeError, match="dtype must be bfloat16, float16 or float32 for the "
                                        "layer, got float8_e4m3fn"):
        _call(moe)


def test_xla_fallback_over_hosts(rng, monkeypatch):
    # a communicator whose group spans two (fake) hosts takes XLA's path: the layer lowers to
    # no jax_nvcomm custom call and still equals the reference (padded layout + expert_block)
    from jax_nvcomm import topology

    def gather(prefix, groups, backend, timeout_s):
        facts = [topology.RankFacts(g, r, 0, f"node{int(groups[g, r].id) % 2}")
                 for g in range(groups.shape[0]) for r in range(groups.shape[1])]
        return facts, {}

    monkeypatch.setattr(topology, "gather", gather)
    world = upto(4)
    if world < 2:
        pytest.skip("needs 2 devices")
    E, K, T, H, F = 2 * world, 2, 4, 16, 24
    moe = nvc.MoECommunicator(make_mesh((world,), ("x",)), "x", num_experts=E, top_k=K,
                              max_tokens=T, hidden=H, dtype=jnp.float32)
    try:
        assert moe.xla_fallback
        x = rng.standard_normal((world * T, H)).astype(np.float32)
        wg, wu = (rng.standard_normal((E, H, F)).astype(np.float32) / 4 for _ in range(2))
        wd = rng.standard_normal((E, F, H)).astype(np.float32) / 4
        ids = routing(rng, world, T, E, K, "random")
        w = rng.random((world * T, K)).astype(np.float32)
        nt = np.array([T, 1] + [T] * (world - 2), np.int32)
        fn = jax.jit(jax.shard_map(
            lambda x, i, w, n, a, b, c: nvc.moe_layer(x, i, w, a, b, c, moe, num_tokens=n[0]),
            mesh=moe.mesh, in_specs=(P("x"),) * 7, out_specs=P("x")))
        args = (x, ids, w, nt, wg, wu, wd)
        assert "nvc_" not in fn.lower(*args).as_text()
        ref = np_moe_layer_reference(np.float64(x), ids, w, nt, np.float64(wg),
                                     np.float64(wu), np.float64(wd), world)
        np.testing.assert_allclose(np.asarray(fn(*args)), ref, rtol=1e-4, atol=1e-5)
    finally:
        moe.close()


def test_vmap_refused_and_check_vma_off(rng):
    world = upto(2)
    E, K, T, H, F = 2 * world, 2, 4, 16, 8
    moe = get_moe(world, E, K, T, H, "float32")
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    wg, wu = (rng.standard_normal((E, H, F)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((E, F, H)).astype(np.float32)
    ids = routing(rng, world, T, E, K, "random")
    w = rng.random((world * T, K)).astype(np.float32)
    layer = lambda *a: nvc.moe_layer(*a, moe)  # noqa: E731
    # check_vma=False: the same results as the tracked mode
    outs = [jax.jit(jax.shard_map(layer, mesh=moe.mesh, in_specs=(P("x"),) * 6,
                                  out_specs=P("x"), check_vma=cv))(x, ids, w, wg, wu, wd)
            for cv in (True, False)]
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    batched = jax.shard_map(jax.vmap(layer, in_axes=(0, 0, 0, None, None, None)),
                            mesh=moe.mesh, in_specs=(P(None, "x"),) * 3 + (P("x"),) * 3,
                            out_specs=P(None, "x"))
    with pytest.raises(NotImplementedError, match="jax.vmap is not supported"):
        jax.jit(batched)(np.stack([x, x]), np.stack([ids, ids]), np.stack([w, w]), wg, wu, wd)


def test_packed_dispatch_rows_are_ragged_dot_form(rng):
    # the layer's dispatch (moe_layout.h PACKED EXPERT ROWS): local expert e's rows at
    # [sum(counts[:e]), sum(counts[:e+1])) of the [W*T*min(K, L), H] array, in (source rank,
    # token) order, exactly the tokens' rows
    from helpers import np_moe_reference
    from jax_nvcomm import _order
    from jax_nvcomm import moe as moe_mod
    world = upto(4)
    E, K, T, H = 4 * world, 3, 5, 16
    moe = get_moe(world, E, K, T, H, "float32")
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = routing(rng, world, T, E, K, "random")
    nt = np.array([T] + [2] * (world - 1), np.int32)

    def f(x, ids, nt):
        call = moe_mod.moe_call(moe, "test", lambda *a: moe_mod._dispatch_kernel(
            *a, moe=moe, packed=True))
        xp, cnt, _, _, _, _ = call(x, ids, nt[0], _order.token("x"))
        return xp[None], cnt[None]

    xp, cnt = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * 3,
                                    out_specs=P("x")))(x, ids, nt)
    xp, cnt = np.asarray(xp), np.asarray(cnt)
    L = E // world
    assert xp.shape == (world, world * T * min(K, L), H)
    ref = np_moe_reference(np.float64(x), ids, nt, E, world)["rows"]
    for r in range(world):
        start = 0
        for e in range(L):
            rows = ref[r][e]
            assert cnt[r, e] == len(rows)
            for i, (s, t) in enumerate(rows):
                np.testing.assert_array_equal(xp[r, start + i], x[s * T + t])
            start += len(rows)


def test_gate_up_two_dots_equal_the_swiglu_pass(rng, monkeypatch):
    # moe_experts.GATE_UP "two" (two grouped products with float32 results) and "swiglu"
    # (one pass) give the same bf16 rows (both: float32 sums, SwiGLU in float32, rounded once)
    L, P_, H, F = 3, 10, 16, 24
    bf = jnp.bfloat16
    xp = jnp.asarray(rng.standard_normal((P_, H)), bf)
    counts = np.array([4, 0, 5], np.int32)
    wg, wu = (jnp.asarray(rng.standard_normal((L, H, F)) / 4, bf) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((L, F, H)) / 4, bf)
    outs = {}
    for mode in ("swiglu", "two"):
        monkeypatch.setattr(ml, "GATE_UP", mode)
        outs[mode] = np.asarray(jax.jit(lambda *a: ml.expert_rows(*a, bf))(
            xp, counts, wg, wu, wd).astype(jnp.float32))[:9]
    np.testing.assert_allclose(outs["two"], outs["swiglu"], rtol=1e-2, atol=1e-2)


def test_axis_name_form_finds_the_registered_communicator(rng):
    # moe_layer(..., axis_name="x") uses the registered MoECommunicator whose sizes fit (the
    # same results as passing it); none registered: the registry's named error
    world = upto(2)
    E, K, T, H, F = 2 * world, 2, 4, 16, 8
    mesh = make_mesh((world,), ("x",))
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    wg, wu = (rng.standard_normal((E, H, F)).astype(np.float32) for _ in range(2))
    wd = rng.standard_normal((E, F, H)).astype(np.float32)
    ids = routing(rng, world, T, E, K, "random")
    w = rng.random((world * T, K)).astype(np.float32)
    run = lambda **kw: jax.jit(jax.shard_map(  # noqa: E731
        lambda *a: nvc.moe_layer(*a, **kw), mesh=mesh, in_specs=(P("x"),) * 6,
        out_specs=P("x")))(x, ids, w, wg, wu, wd)
    with pytest.raises(ValueError, match="none is registered"):
        run(axis_name="x")
    moe = nvc.register(nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T,
                                           hidden=H, dtype=jnp.float32))
    try:
        np.testing.assert_array_equal(np.asarray(run(axis_name="x")), np.asarray(run(moe=moe)))
    finally:
        nvc.unregister(moe)
        moe.close()
