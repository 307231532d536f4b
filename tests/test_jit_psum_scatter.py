"""nvc.jit serves lax.psum_scatter along any scatter_dimension, tiled or not, with our
reduce_scatter_v: on 8 CPU devices, every rank's own random partial sums, against a float64
numpy reference (our sum is float32 in rank order) and against jax.jit of the same function;
the forms it refuses stay lax's and explain says why."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from test_jit import mesh_of, targets, xla_collectives

W = 8


@pytest.fixture(autouse=True)
def _closed_after():
    yield
    nvc.close_all()


def _ref(parts, d, tiled):
    """numpy float64: rank r's result of psum_scatter(parts[r], dim d)."""
    total = np.sum(np.asarray(parts, np.float64), axis=0)
    if tiled:
        return np.stack(np.split(total, W, axis=d))       # [W, ..., n/W at d, ...]
    return np.moveaxis(total, d, 0)                        # [W, ...without d]


@pytest.mark.parametrize("shape,d,tiled", [
    ((16, 8), 0, True),
    ((2, 16, 8), 1, True),          # a prefill's [batch, tokens, hidden] along tokens
    ((1, 32, 8), 1, True),          # leading dims of 1: the move is a reshape
    ((4, 2, 32), 2, True),          # the last dim
    ((4, W, 8), 1, False),
    ((4, 8, W), 2, False),
    ((W, 4, 8), 0, False),
    ((64,), 0, True),               # 1-D: taken as [W, 8] rows
])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_psum_scatter_any_dim(shape, d, tiled, dtype, tol):
    mesh = mesh_of((W,), ("tp",))
    body = lambda x: lax.psum_scatter(x[0], "tp", scatter_dimension=d, tiled=tiled)[None]
    f = jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    parts = jax.random.normal(jax.random.key(hash((shape, d, tiled)) % 1000), (W,) + shape,
                              jnp.float32).astype(dtype)
    j = nvc.jit(f)
    text = j.lower(parts).as_text()
    assert targets(text) == {"nvc_reduce_scatter_v": 1}, targets(text)
    assert xla_collectives(text) == []
    got = np.asarray(j(parts).astype(jnp.float32), np.float64)
    want = _ref(np.asarray(parts.astype(jnp.float32)), d, tiled)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 4)
    lax_out = np.asarray(jax.jit(f)(parts).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, lax_out, rtol=tol, atol=tol * 4)
    (row,) = nvc.explain(f, parts).rows
    assert row["op"] == "psum_scatter" and row["became"] == "reduce_scatter_v", row
    if d:
        assert f"dim {d} moved to the front" in row["reason"], row["reason"]


def test_psum_scatter_grad_through_the_kernel():
    """jax.grad of a scatter along dim 1: the cotangent goes back through our gather, equal to
    jax.jit's gradient."""
    mesh = mesh_of((W,), ("tp",))

    def loss(x, w):
        body = lambda a, b: jnp.sum(lax.psum_scatter(a * b, "tp", scatter_dimension=1,
                                                     tiled=True) ** 2)[None]
        return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()),
                                     out_specs=P("tp"))(x, w))

    x = jax.random.normal(jax.random.key(1), (2, 16, 8), jnp.float32)
    w = jax.random.normal(jax.random.key(2), (2, 16, 8), jnp.float32)
    got = nvc.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    want = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,d,tiled,dtype,why", [
    ((16, 3), 0, True, jnp.float32, "rows of 12 bytes"),
    ((3, 16), 1, True, jnp.float32, "dim 1 moved to the front, rows of 12 bytes"),
    ((16, 8), 1, True, jnp.int32, "int32 is not a float type"),
    ((W,), 0, False, jnp.float32, "a 1-D operand not tiled"),
])
def test_psum_scatter_refused_stays_lax_with_its_reason(shape, d, tiled, dtype, why):
    mesh = mesh_of((W,), ("tp",))
    body = lambda x: lax.psum_scatter(x[0], "tp", scatter_dimension=d, tiled=tiled)[None]
    f = jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    parts = (jax.random.normal(jax.random.key(5), (W,) + shape) * 8).astype(dtype)
    (row,) = nvc.explain(f, parts).rows
    assert row["became"] == "xla" and why in row["reason"], row
    np.testing.assert_array_equal(np.asarray(nvc.jit(f)(parts)), np.asarray(jax.jit(f)(parts)))
