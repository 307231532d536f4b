"""Collectives nvc.jit leaves to XLA where no call of ours can run beside them are bound as
jax.jit binds them: a psum over axes of size 1 (the identity), and every collective of a
shard_map body that holds no call of ours. XLA then combines and drops them as under
jax.jit, so a gradient program compiles to no more collective ops than jax.jit's; where a
call of ours is in the body, XLA's collectives stay ordered against it."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc

COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|"
                        r"ragged-all-to-all|collective-permute|collective-broadcast)"
                        r"(-start)?\(")


@pytest.fixture(autouse=True)
def _closed_after():
    yield
    nvc.close_all()


def _collectives(compiled_text):
    return len(COLLECTIVE.findall(compiled_text))


def _params(rng, layers, d=32, f=64):
    out = []
    for _ in range(layers):
        out += [jnp.asarray(rng.standard_normal((d, f)) * 0.1, jnp.float32),
                jnp.asarray(rng.standard_normal((f, d)) * 0.1, jnp.float32)]
    return out


def _loss(mesh, tp):
    """A tensor-parallel MLP stack over `tp`, the batch over the mesh's other axis (size 1
    here: its psums, and those JAX's transposition adds for it, are over one device)."""
    dp = [a for a in mesh.axis_names if a != tp][0]

    def body(x, *ws):
        for i in range(0, len(ws), 2):
            h = jnp.tanh(x @ ws[i])
            x = x + jax.lax.psum(h @ ws[i + 1], tp)
        return jax.lax.psum(jnp.sum(x * x), dp)

    def loss(params, x):
        specs = tuple(s for _ in range(len(params) // 2)
                      for s in (P(None, tp), P(tp, None)))
        return jax.shard_map(body, mesh=mesh, in_specs=(P(dp),) + specs,
                             out_specs=P())(x, *params)
    return loss


@pytest.mark.parametrize("shape,names,tp", [((1, 8), ("data", "tensor"), "tensor"),
                                            ((8, 1), ("tensor", "data"), "data")])
def test_gradient_has_no_more_collectives_than_jax_jit(shape, names, tp, rng):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(shape), names)
    grad = jax.grad(_loss(mesh, tp))
    params, x = _params(rng, 3), jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    ours = nvc.jit(grad)
    want, got = jax.jit(grad)(params, x), ours(params, x)
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    n_xla = _collectives(jax.jit(grad).lower(params, x).compile().as_text())
    n_ours = _collectives(ours.lower(params, x).compile().as_text())
    assert n_ours <= n_xla, (n_ours, n_xla)


def test_size_one_psum_is_xlas_and_explained(rng):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(8, 1), ("x", "one"))

    def f(x):
        return jax.shard_map(lambda a: jax.lax.psum(jax.lax.psum(a, "one"), "x"), mesh=mesh,
                             in_specs=P("x"), out_specs=P())(x)

    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(nvc.jit(f)(x)), np.asarray(jax.jit(f)(x)))
    rows = {r["axes"]: r for r in nvc.explain(f, x).rows}
    assert rows[("one",)]["became"] == "xla" and "size 1" in rows[("one",)]["reason"]
    assert rows[("x",)]["became"].startswith("all_reduce")


def test_xla_collective_beside_our_call_stays_ordered(rng):
    # an integer psum (XLA's) in the same body as a served float psum keeps its tie into our
    # calls' order: the body's program holds the order-token arithmetic around it
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))

    def f(x, n):
        return jax.shard_map(lambda a, b: (jax.lax.psum(a, "x"), jax.lax.psum(b, "x")),
                             mesh=mesh, in_specs=(P("x"), P("x")), out_specs=(P(), P()))(x, n)

    def only_int(n):
        return jax.shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh, in_specs=P("x"),
                             out_specs=P())(n)

    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    n = jnp.asarray(rng.integers(0, 100, (16, 32)), jnp.int32)
    got = nvc.jit(f)(x, n)
    want = jax.jit(f)(x, n)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    tied = nvc.jit(f).lower(x, n).as_text()
    plain = nvc.jit(only_int).lower(n).as_text()
    assert "nvc_all_reduce" in tied and "is_finite" in tied  # the token's -0.0 tie
    assert "nvc_" not in plain and "is_finite" not in plain
    np.testing.assert_array_equal(np.asarray(nvc.jit(only_int)(n)),
                                  np.asarray(jax.jit(only_int)(n)))
