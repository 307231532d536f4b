"""all_gather against lax.all_gather on 8 CPU devices (host backend)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm._warn import XlaPathWarning
from helpers import mesh1d, run_sharded


@pytest.fixture(scope="module")
def comm8():
    mesh = mesh1d(8)
    with nvc.Communicator(mesh, "x", max_message_bytes=1 << 20) as c:
        yield c


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.int8, jnp.float16])
@pytest.mark.parametrize("shape,axis,tiled", [((3, 5), 0, True), ((4, 6), 1, True),
                                              ((2, 3, 4), 2, True), ((7,), 0, False),
                                              ((2, 3), 1, False), ((1,), 0, True)])
@pytest.mark.parametrize("check_vma", [True, False])
def test_matches_lax(comm8, rng, dtype, shape, axis, tiled, check_vma):
    mesh = comm8.mesh
    full = (8 * shape[0],) + shape[1:]
    x = jnp.asarray(rng.integers(-100, 100, size=full), dtype)

    def f(v):
        return (nvc.all_gather(v, comm8, axis=axis, tiled=tiled),
                lax.all_gather(v, "x", axis=axis, tiled=tiled))

    a, b = run_sharded(f, mesh, P("x"), (P("x"), P("x")), x, check_vma=check_vma)
    assert a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_consecutive_calls_changing_shapes(comm8, rng):
    """1,000 calls in a row with sizes that change between calls, every result checked."""
    mesh = comm8.mesh
    shapes = [(1, 4), (3, 8), (16, 2), (2, 1), (5, 33)]
    fns = {}
    for s in shapes:
        fns[s] = jax.jit(jax.shard_map(lambda v: nvc.all_gather(v, comm8), mesh=mesh,
                                       in_specs=P("x"), out_specs=P("x")))
    for i in range(1000):
        s = shapes[int(rng.integers(len(shapes)))]
        x = rng.standard_normal((8 * s[0],) + s[1:]).astype(np.float32)
        out = np.asarray(fns[s](x)).reshape((8,) + x.shape)  # every rank's gathered copy
        for r in range(8):
            np.testing.assert_array_equal(out[r], x, err_msg=f"call {i} shape {s} rank {r}")


def test_two_axis_mesh_groups(rng):
    """Mesh ("dp", "tp"): one independent group per dp coordinate."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    with nvc.Communicator(mesh, "tp", max_message_bytes=1 << 16) as c:
        x = jnp.asarray(rng.standard_normal((2 * 3, 4 * 5)), jnp.float32)

        def f(v):
            return nvc.all_gather(v, c, axis=1), lax.all_gather(v, "tp", axis=1, tiled=True)

        a, b = run_sharded(f, mesh, P("dp", "tp"), (P("dp", "tp"), P("dp", "tp")), x)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_large_message_falls_back_to_lax(rng):
    mesh = mesh1d(4)
    with nvc.Communicator(mesh, "x", max_message_bytes=4096) as c:
        x = jnp.asarray(rng.standard_normal((4 * 512,)), jnp.float32)  # 8 KiB gathered
        f = lambda v: nvc.all_gather(v, c)
        with pytest.warns(XlaPathWarning, match=r"all_gather: gathering 8192 bytes"):
            txt = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
                          ).lower(x).as_text()
        assert "nvc_all_gather" not in txt
        a = run_sharded(f, mesh, P("x"), P("x"), x)
        np.testing.assert_array_equal(np.asarray(a).reshape(4, -1)[0], np.asarray(x))


def test_gradient_matches_lax(comm8, rng):
    mesh = comm8.mesh
    x = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 4)), jnp.float32)

    def loss(v, use):
        def body(v, w):
            g = nvc.all_gather(v, comm8) if use else lax.all_gather(v, "x", tiled=True)
            return jnp.sum(jnp.sin(g) * w)[None]
        return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()),
                                     out_specs=P("x"))(v, w))

    g1 = jax.jit(jax.grad(lambda v: loss(v, True)))(x)
    g2 = jax.jit(jax.grad(lambda v: loss(v, False)))(x)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tiled,axis", [(False, 0), (False, 1), (True, 1), (False, 2)])
def test_gradient_untiled_and_other_axis(comm8, rng, tiled, axis):
    """jax.grad through all_gather with tiled=False and along another axis, against float64
    numpy: loss = sum_r <G_r, all_gather(x)_r> -> dx_r = (sum_q G_q)'s block of rank r (the
    slice at index r of the new axis, or rank r's block of the tiled axis)."""
    W, shape = 8, (3, 4)
    x = jnp.asarray(rng.standard_normal((W * shape[0],) + shape[1:]), jnp.float32)
    parts = np.split(np.asarray(x), W, axis=0)
    gshape = (np.concatenate(parts, axis=axis) if tiled else np.stack(parts, axis=axis)).shape
    G = rng.standard_normal((W,) + gshape).astype(np.float32)

    def loss(v):
        body = lambda v, g: jnp.sum(jnp.sin(nvc.all_gather(v, comm8, axis=axis, tiled=tiled))
                                    * g[0])[None]
        return jnp.sum(jax.shard_map(body, mesh=comm8.mesh, in_specs=(P("x"), P("x")),
                                     out_specs=P("x"))(v, G))

    dx = np.asarray(jax.jit(jax.grad(loss))(x), np.float64)
    full = np.concatenate(parts, axis=axis) if tiled else np.stack(parts, axis=axis)
    ct = (G.astype(np.float64) * np.cos(full.astype(np.float64))[None]).sum(0)
    n = shape[axis] if tiled else 1
    for r in range(W):
        blk = np.take(ct, np.arange(r * n, (r + 1) * n), axis=axis)
        want = blk if tiled else np.squeeze(blk, axis)
        np.testing.assert_allclose(dx[r * shape[0]:(r + 1) * shape[0]], want, rtol=1e-5,
                                   atol=1e-5)
