"""nvc.jit through the forms programs nest their collectives in (scan, fori/while, cond,
checkpoint, custom_vjp / custom_jvp, inner jits, partially manual shard_map) and the jax.jit
surface (static arguments, donation, .lower, an outer jax.jit, jax.grad / vmap of it), the
communicator pool (made once, reused, grown, closed by close_all) and the once-per-site
warning; 8 CPU devices, results against jax.jit of the same function."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm.jit import pool as _pool
from test_jit import mesh_of, targets, xla_collectives


@pytest.fixture(autouse=True)
def _closed_after():
    yield
    nvc.close_all()


def _x(shape=(16, 32), seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _same(f, *args, want_targets=None):
    """nvc.jit(f) equals jax.jit(f) bitwise (float32 psums: the same sums) and holds our
    calls (`want_targets` of them) and no XLA collective."""
    j = nvc.jit(f)
    text = j.lower(*args).as_text()
    got, want = j(*args), jax.jit(f)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    t = targets(text)
    if want_targets is not None:
        assert t == want_targets, t
    assert xla_collectives(text) == [], xla_collectives(text)
    return t


MESH = None


def mesh():
    global MESH
    if MESH is None:
        MESH = mesh_of((8,), ("tp",))
    return MESH


def smap(body, in_specs=P("tp"), out_specs=P()):
    return jax.shard_map(body, mesh=mesh(), in_specs=in_specs, out_specs=out_specs)


def test_scan_over_layers():
    def body(x, ws):
        def layer(h, w):
            return lax.psum(h @ w, "tp") / 8.0, None
        h, _ = lax.scan(layer, x, ws)
        return h

    f = smap(body, in_specs=(P(), P()), out_specs=P())
    _same(f, _x((4, 16)), _x((3, 16, 16), 1), want_targets={"nvc_all_reduce": 1})


def test_fori_loop_and_while():
    def body(x):
        y = lax.fori_loop(0, 3, lambda i, h: lax.psum(h, "tp") * 0.125, x)
        z = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, lax.pmean(c[1], "tp")),
                           (0, x))[1]
        return y, z

    f = smap(body, in_specs=P(), out_specs=(P(), P()))
    _same(f, _x(), want_targets={"nvc_all_reduce": 2})


def test_cond_branches():
    def body(x, p):
        return lax.cond(p > 0, lambda v: lax.psum(v, "tp"), lambda v: lax.psum(2 * v, "tp"), x)

    f = smap(body, in_specs=(P(), P()), out_specs=P())
    for p in (1, -1):
        _same(f, _x(), jnp.int32(p), want_targets={"nvc_all_reduce": 2})


def test_checkpoint_and_grad():
    def body(x, w):
        @jax.checkpoint
        def block(h):
            return jnp.tanh(lax.psum(h @ w, "tp"))
        return jnp.sum(block(x) ** 2)

    def loss(x, w):
        return smap(body, in_specs=(P(None, "tp"), P("tp")), out_specs=P())(x, w)

    x, w = _x((4, 64)), _x((64, 16), 1)
    _same(loss, x, w)
    g = jax.grad(loss, argnums=1)
    t = _same(g, x, w)
    assert t.get("nvc_all_reduce", 0) >= 2, t  # the forward and its recomputation
    np.testing.assert_allclose(np.asarray(jax.grad(nvc.jit(loss), argnums=1)(x, w)),
                               np.asarray(jax.jit(g)(x, w)), rtol=1e-5, atol=1e-6)


def test_custom_vjp_and_custom_jvp():
    @jax.custom_vjp
    def reduce(v):
        return lax.psum(v, "tp")

    reduce.defvjp(lambda v: (lax.psum(v, "tp"), None), lambda _, g: (g,))

    @jax.custom_jvp
    def reduce2(v):
        return lax.psum(v, "tp")

    reduce2.defjvp(lambda p, t: (reduce2(p[0]), t[0]))

    def body(x):
        return reduce(x) + reduce2(x)

    f = smap(body, in_specs=P(), out_specs=P())
    _same(f, _x(), want_targets={"nvc_all_reduce": 2})


def test_inner_jit_and_outer_jit():
    inner = jax.jit(lambda v: lax.psum(v, "tp"))
    f = smap(lambda x: inner(x) * 2, in_specs=P(), out_specs=P())
    x = _x()
    _same(f, x, want_targets={"nvc_all_reduce": 1})
    j = nvc.jit(f)
    outer = jax.jit(lambda x: j(x) + 1)          # nvc.jit inside an outer jax.jit
    np.testing.assert_array_equal(np.asarray(outer(x)), np.asarray(jax.jit(f)(x) + 1))
    assert targets(outer.lower(x).as_text()) == {"nvc_all_reduce": 1}
    np.testing.assert_array_equal(np.asarray(jax.vmap(j)(jnp.stack([x, 2 * x]))),
                                  np.asarray(jax.vmap(jax.jit(f))(jnp.stack([x, 2 * x]))))


def test_inside_shard_map_runs_xla_and_warns():
    """nvc.jit applied inside a shard_map body: its collectives have no shard_map of their
    own to be rewritten in; they stay XLA's and it says where nvc.jit belongs."""
    from jax_nvcomm.jit import rewrite as _rewrite
    _rewrite.reset_warnings()
    j = nvc.jit(lambda v: lax.psum(v, "tp"))
    f = smap(lambda x: j(x), in_specs=P(), out_specs=P())
    x = _x()
    with pytest.warns(UserWarning, match="apply nvc.jit to the function that calls shard_map"):
        y = jax.jit(f)(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(
        smap(lambda v: lax.psum(v, "tp"), in_specs=P(), out_specs=P()))(x)))


def test_partially_manual_shard_map():
    m = mesh_of((2, 4), ("dp", "tp"))

    def body(x):
        return lax.psum(x, "tp")

    f = jax.shard_map(body, mesh=m, in_specs=P(None, "tp"), out_specs=P(), axis_names={"tp"})
    x = _x((16, 64))
    j = nvc.jit(f)
    np.testing.assert_array_equal(np.asarray(j(x)), np.asarray(jax.jit(f)(x)))
    assert targets(j.lower(x).as_text()).get("nvc_all_reduce") == 1


def test_static_args_donation_and_cache():
    calls = []

    def f(x, n, *, scale):
        calls.append(n)
        return smap(lambda v: lax.psum(v, "tp") * scale + n, in_specs=P(), out_specs=P())(x)

    j = nvc.jit(f, static_argnums=(1,), static_argnames=("scale",), donate_argnums=(0,))
    x = _x()
    y0 = np.asarray(jax.jit(f, static_argnums=(1,), static_argnames=("scale",))(x, 3, scale=2.0))
    x2 = jnp.array(x)
    y = j(x2, 3, scale=2.0)
    np.testing.assert_array_equal(np.asarray(y), y0)
    assert x2.is_deleted()                        # donated as jax.jit donates
    n = len(calls)
    j(jnp.array(x), 3, scale=2.0)                 # same signature: no new trace
    assert len(calls) == n
    j(jnp.array(x), 4, scale=2.0)                 # a new static value: traced again
    assert len(calls) > n


def test_pool_reused_grown_and_closed():
    f = smap(lambda v: lax.psum(v, "tp"), in_specs=P(), out_specs=P())
    small, big = _x((16, 32)), _x((1024, 256))
    nvc.jit(f)(small)
    held = _pool.held()
    assert len(held) == 1
    comm = held[0]
    nvc.jit(lambda v: f(v) * 2)(small)            # another program, same axis: reused
    assert _pool.held() == [comm]
    j = nvc.jit(f)
    np.testing.assert_array_equal(np.asarray(j(big)), np.asarray(jax.jit(f)(big)))
    (grown,) = _pool.held()
    assert grown is not comm and comm.closed and grown.max_message_bytes >= big.nbytes
    np.testing.assert_array_equal(np.asarray(j(small)), np.asarray(jax.jit(f)(small)))
    nvc.close_all()
    assert grown.closed and _pool.held() == []
    np.testing.assert_array_equal(np.asarray(j(small)), np.asarray(jax.jit(f)(small)))
    assert len(_pool.held()) == 1                 # made again after close_all


def test_pool_communicator_closed_by_hand_is_made_again():
    """A compiled program holding a pool communicator that is closed by anyone (not only
    close_all) is traced again on its next call, not run on the closed buffers: the fast path
    (jax.jit's own dispatch) must not serve a stale program."""
    f = smap(lambda v: lax.psum(v, "tp"), in_specs=P(), out_specs=P())
    x = _x((16, 32))
    j = nvc.jit(f)
    want = np.asarray(jax.jit(f)(x))
    np.testing.assert_array_equal(np.asarray(j(x)), want)
    (comm,) = _pool.held()
    comm.close()
    np.testing.assert_array_equal(np.asarray(j(x)), want)   # same signature, new communicator
    (again,) = _pool.held()
    assert again is not comm and not again.closed
    nvc.close_all()


def test_grad_of_nvc_jit_rewrites_the_backward_too():
    """jax.grad(nvc.jit(f)) (JAX's idiom: the gradient of a jitted function): the backward's
    collectives (here the psum JAX makes by transposing the column-parallel layer's implicit
    broadcast of x) run our kernel as in nvc.jit(jax.grad(f)); a static argument, a keyword
    argument and an integer argument pass through; values equal jax.grad(jax.jit(f))."""
    m = mesh()

    def f(w, x, scale, *, steps, ids):
        def body(w, x):
            h = jnp.tanh(x @ w) * scale
            for _ in range(steps):
                h = h * h
            return lax.psum(jnp.sum(h[ids]), "tp")
        return jax.shard_map(body, mesh=m, in_specs=(P(None, "tp"), P()), out_specs=P())(w, x)

    w = jax.device_put(_x((32, 64), seed=1) * 0.1,
                       jax.sharding.NamedSharding(m, P(None, "tp")))
    x, ids = _x((16, 32), seed=2), jnp.arange(8, dtype=jnp.int32) * 2
    grad = jax.grad(nvc.jit(f, static_argnames=("steps",)), argnums=(0, 1))
    want = jax.grad(jax.jit(f, static_argnames=("steps",)), argnums=(0, 1))(
        w, x, 0.5, steps=2, ids=ids)
    got = grad(w, x, 0.5, steps=2, ids=ids)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    text = jax.jit(lambda w, x, ids: grad(w, x, 0.5, steps=2, ids=ids)).lower(
        w, x, ids).as_text()
    assert xla_collectives(text) == [], xla_collectives(text)
    assert targets(text).get("nvc_all_reduce", 0) >= 2, targets(text)  # forward + backward
    nvc.close_all()


def test_helpers_without_collectives_keep_their_call():
    """A jitted helper with no collective and no norm in it (a sort, the routing) stays a call
    in the program nvc.jit makes, as in jax.jit's: the program XLA schedules is the user's
    (inlining every helper changed XLA's schedule of an MoE layer by a few percent)."""
    @jax.jit
    def route(v):
        return jnp.argsort(v[:, 0])

    def body(v):
        order = route(v)
        return lax.psum(v[order], "tp")

    f = smap(body, in_specs=P(), out_specs=P())
    x = _x((16, 32))
    text = nvc.jit(f).lower(x).as_text()
    assert "func.func private @route" in text, text
    assert "nvc_all_reduce" in text
    np.testing.assert_array_equal(np.asarray(nvc.jit(f)(x)), np.asarray(jax.jit(f)(x)))
    nvc.close_all()


def test_fixable_fallback_warns_once_per_site(monkeypatch):
    from jax_nvcomm.jit import rewrite as _rewrite
    _rewrite.reset_warnings()
    monkeypatch.setenv("JAX_NVCOMM_JIT_MAX_MESSAGE_BYTES", str(1 << 16))
    f = smap(lambda v: lax.all_gather(v, "tp", tiled=True), in_specs=P("tp"),
             out_specs=P("tp"))
    x = _x((8 * 1024, 32))                        # gathered 1 MiB per rank > 64 KiB
    with pytest.warns(UserWarning, match="all_gather .* stays XLA's: the gathered"):
        y = nvc.jit(f)(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(f)(x)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nvc.jit(f)(x)                             # the same site: no second warning
    _rewrite.reset_warnings()
    monkeypatch.setenv("JAX_NVCOMM_QUIET", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nvc.jit(lambda v: f(v) + 1)(x)


def test_set_mesh_and_shard_map_without_mesh():
    """shard_map with the mesh from jax.set_mesh (its eqn holds an abstract mesh): the
    communicator is made on the concrete mesh in context."""
    f = jax.shard_map(lambda v: lax.psum(v, "tp"), in_specs=P(), out_specs=P())
    x = _x()
    with jax.set_mesh(mesh()):
        j = nvc.jit(f)
        np.testing.assert_array_equal(np.asarray(j(x)), np.asarray(jax.jit(f)(x)))
        assert targets(j.lower(x).as_text()) == {"nvc_all_reduce": 1}


def test_collective_without_kernel_listed_and_ordered():
    """A ppermute beside our calls: XLA's, listed by explain with its reason, results as
    jax.jit's (it runs in our calls' order on every device)."""
    perm = [(i, (i + 1) % 8) for i in range(8)]

    def body(x):
        y = lax.psum(x, "tp")
        return y + lax.ppermute(x, "tp", perm), lax.psum(2 * x, "tp")

    f = smap(body, in_specs=P("tp"), out_specs=(P("tp"), P()))
    x = _x((64, 32))
    for a, b in zip(nvc.jit(f)(x), jax.jit(f)(x)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rows = nvc.explain(f, x).rows
    (pp,) = [r for r in rows if r["op"] == "ppermute"]
    assert pp["became"] == "xla" and "no jax_nvcomm kernel" in pp["reason"]
    assert sum(r["became"].startswith("all_reduce") for r in rows) == 2
