"""A Communicator over a tuple of mesh axes (docs/API.md "Communicator"): the group is the
product of the axes, the rank the linearised index as `lax.axis_index(tuple)` gives it; the ops
equal lax's collectives over the same tuple (psum, all_gather, psum + add + RMSNorm, the
varlen pair, ragged all-to-all) on 8 CPU devices, with our kernels in the program."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm import _symmetric
from conftest import make_mesh

SMALL = dict(max_message_bytes=1 << 20)


@pytest.fixture(scope="module")
def mesh24():
    return make_mesh((2, 4), ("X", "Y"))


@pytest.fixture(autouse=True)
def _clean():
    yield
    nvc.close_all()


def smap(f, mesh, in_specs, out_specs, **kw):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kw))


def test_properties_and_refusals(mesh24):
    with nvc.Communicator(mesh24, ("X", "Y"), **SMALL) as c:
        assert c.world_size == 8 and c.axis_name == ("X", "Y")
    with nvc.Communicator(mesh24, ("Y",), **SMALL) as c:  # a 1-tuple is its one axis
        assert c.world_size == 4 and c.axis_name == "Y"
    with pytest.raises(ValueError, match=r"axis 'Z' of axis_name \('X', 'Z'\) is not an axis of "
                                         r"the mesh \(axes: \('X', 'Y'\)\)"):
        nvc.Communicator(mesh24, ("X", "Z"))
    with pytest.raises(ValueError, match=r"names an axis twice"):
        nvc.Communicator(mesh24, ("X", "X"))


def test_ranks_are_lax_axis_index_of_the_tuple():
    """The groups' rank order is lax.axis_index over the tuple, on a 3-axis mesh where the
    tuple leaves one axis as the group axis, in both tuple orders."""
    mesh = make_mesh((2, 2, 2), ("a", "b", "c"))
    dev_ids = jnp.arange(8, dtype=jnp.int32)
    for axes in [("a", "c"), ("c", "a"), ("b", "c"), ("a", "b", "c")]:
        idx = smap(lambda d: jnp.stack([lax.axis_index(axes), d[0]])[None], mesh,
                   P(("a", "b", "c")), P(("a", "b", "c")))(dev_ids)
        groups = _symmetric.groups_of(mesh, axes)
        flat = list(np.asarray(mesh.devices).flat)
        for rank, pos in np.asarray(idx):
            dev = flat[pos]
            g = [i for i in range(groups.shape[0]) if dev in list(groups[i])]
            assert len(g) == 1 and list(groups[g[0]]).index(dev) == rank, (axes, pos)


@pytest.mark.parametrize("axes", [("X", "Y"), ("Y", "X")])
def test_all_reduce_over_two_axes_equals_psum(mesh24, rng, axes):
    x = rng.standard_normal((8, 3, 64)).astype(np.float32)
    with nvc.communicators(mesh24, axes=axes, **SMALL) as comms:
        c = comms[axes]
        ours = smap(lambda v: nvc.all_reduce(v[0], c)[None], mesh24, P(("X", "Y")),
                    P(("X", "Y")))
        by_name = smap(lambda v: nvc.all_reduce(v[0], axis_name=axes)[None], mesh24,
                       P(("X", "Y")), P(("X", "Y")))
        ref = smap(lambda v: lax.psum(v[0], axes)[None], mesh24, P(("X", "Y")), P(("X", "Y")))
        text = ours.lower(x).as_text()
        assert "nvc_all_reduce" in text and "stablehlo.all_reduce" not in text
        got, got_n = np.asarray(ours(x)), np.asarray(by_name(x))
    want = x.astype(np.float64).sum(0)
    for r in range(8):
        np.testing.assert_allclose(got[r], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got, got_n)
    np.testing.assert_allclose(got, np.asarray(ref(x)), rtol=1e-6, atol=1e-6)
    # integer-valued floats: exact in any order, so bitwise lax.psum's
    xi = rng.integers(-50, 50, (8, 2, 16)).astype(np.float32)
    with nvc.communicators(mesh24, axes=axes, **SMALL):
        f = smap(lambda v: nvc.all_reduce(v[0], axis_name=axes)[None], mesh24, P(("X", "Y")),
                 P(("X", "Y")))
        got_i = np.asarray(f(xi))
    np.testing.assert_array_equal(got_i, np.asarray(ref(xi)))


def test_psum_over_tuple_with_invariant_output_type(mesh24, rng):
    """check_vma: the result is typed invariant over both axes (out_specs=P() accepted), as
    lax.psum's."""
    x = rng.standard_normal((8, 4, 16)).astype(np.float32)
    with nvc.communicators(mesh24, axes=("X", "Y"), **SMALL):
        f = smap(lambda v: nvc.all_reduce(v[0], axis_name=("X", "Y")), mesh24, P(("X", "Y")),
                 P())
        np.testing.assert_allclose(np.asarray(f(x)), x.astype(np.float64).sum(0), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("axes", [("X", "Y"), ("Y", "X")])
@pytest.mark.parametrize("tiled,axis", [(True, 0), (False, 1), (True, 1)])
def test_all_gather_over_tuple_equals_lax(mesh24, rng, axes, tiled, axis):
    x = rng.standard_normal((8, 3, 8)).astype(np.float32)
    with nvc.communicators(mesh24, axes=axes, **SMALL):
        ours = smap(lambda v: nvc.all_gather(v[0], axis_name=axes, axis=axis, tiled=tiled)[None],
                    mesh24, P(("X", "Y")), P(("X", "Y")))
        ref = smap(lambda v: lax.all_gather(v[0], axes, axis=axis, tiled=tiled)[None],
                   mesh24, P(("X", "Y")), P(("X", "Y")))
        assert "nvc_all_gather" in ours.lower(x).as_text()
        np.testing.assert_array_equal(np.asarray(ours(x)), np.asarray(ref(x)))


def test_fused_over_tuple(mesh24, rng):
    """The JetStream form: psum over ("X", "Y"), add, RMSNorm with a float32 weight; one fused
    call, against float64."""
    T, H, eps = 4, 96, 1e-6
    x = jnp.asarray(rng.standard_normal((8, T, H)), jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    w = jnp.asarray(0.5 + rng.random(H), jnp.float32)
    with nvc.communicators(mesh24, axes=("X", "Y"), **SMALL):
        f = smap(lambda v, r, g: nvc.all_reduce_rms_norm(v[0], r, g, axis_name=("X", "Y"),
                                                         eps=eps),
                 mesh24, (P(("X", "Y")), P(), P()), (P(), P()))
        assert "nvc_all_reduce_rms" in f.lower(x, res, w).as_text()
        normed, r_out = f(x, res, w)
        normed, r_out = np.asarray(normed, np.float64), np.asarray(r_out, np.float64)
    s = np.asarray(jnp.asarray(np.asarray(x, np.float64).sum(0)).astype(jnp.bfloat16), np.float64)
    r = s + np.asarray(res, np.float64)
    n = r / np.sqrt(np.mean(r * r, -1, keepdims=True) + eps) * np.asarray(w, np.float64)
    np.testing.assert_allclose(r_out, r, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(normed, n, rtol=2e-2, atol=2e-2)


def test_gradients_over_tuple(mesh24, rng):
    x = rng.standard_normal((8, 2, 16)).astype(np.float32)
    with nvc.communicators(mesh24, axes=("X", "Y"), **SMALL):
        def loss(op):
            g = jax.grad(lambda v: jnp.sum(jax.shard_map(
                lambda a: op(a[0])[None] ** 2, mesh=mesh24, in_specs=P(("X", "Y")),
                out_specs=P(("X", "Y")))(v)))
            return np.asarray(jax.jit(g)(x))
        ours = loss(lambda a: nvc.all_reduce(a, axis_name=("X", "Y")))
        ref = loss(lambda a: lax.psum(a, ("X", "Y")))
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


def test_one_axis_of_a_2d_mesh_unchanged(mesh24, rng):
    """Per-axis communicators keep their behaviour: over "Y" within each X row."""
    x = rng.standard_normal((8, 2, 16)).astype(np.float32)
    with nvc.communicators(mesh24, **SMALL):
        f = smap(lambda v: nvc.all_reduce(v[0], axis_name="Y")[None], mesh24, P(("X", "Y")),
                 P(("X", "Y")))
        got = np.asarray(f(x))
    want = x.reshape(2, 4, 2, 16).astype(np.float64).sum(1)
    for i in range(2):
        for j in range(4):
            np.testing.assert_allclose(got[i * 4 + j], want[i], rtol=1e-5, atol=1e-5)


def test_varlen_over_tuple(mesh24, rng):
    max_rows, H = 3, 8
    counts = rng.integers(0, max_rows + 1, 8).astype(np.int32)
    x = rng.standard_normal((8 * max_rows, H)).astype(np.float32)
    with nvc.communicators(mesh24, axes=("X", "Y"), **SMALL):
        def f(v, n):
            g, off, tot = nvc.all_gather_v(v, n[0], axis_name=("X", "Y"))
            return g[None], off[None]
        g, off = jax.block_until_ready(
            smap(f, mesh24, (P(("X", "Y")), P(("X", "Y"))), (P(("X", "Y")),) * 2)(x, counts))
    rows = np.concatenate([x[r * max_rows: r * max_rows + counts[r]] for r in range(8)])
    np.testing.assert_array_equal(np.asarray(g)[6][:int(counts.sum())], rows)
    np.testing.assert_array_equal(np.asarray(off)[0], np.r_[0, np.cumsum(counts)])


def test_ragged_over_tuple(mesh24, rng):
    """ragged_all_to_all over ("X", "Y"): peer i is rank i of lax.axis_index(("X", "Y"))."""
    n, Wd = 2, 8
    op = rng.standard_normal((Wd, Wd * n, 4)).astype(np.float32)
    io = np.tile(np.arange(Wd, dtype=np.int32) * n, (Wd, 1))
    ss = np.full((Wd, Wd), n, np.int32)
    oo = np.broadcast_to((np.arange(Wd, dtype=np.int32) * n)[:, None], (Wd, Wd)).copy()

    def body(fn):
        def f(a, b, c, d, e):
            return fn(a[0], jnp.zeros_like(a[0]), b[0], c[0], d[0], e[0])[None]
        return smap(f, mesh24, (P(("X", "Y")),) * 5, P(("X", "Y")))

    with nvc.communicators(mesh24, axes=("X", "Y"), **SMALL):
        ours = body(lambda *a: nvc.ragged_all_to_all(*a, axis_name=("X", "Y")))
        assert "nvc_ragged" in ours.lower(op, io, ss, oo, ss).as_text()
        got = np.asarray(ours(op, io, ss, oo, ss))
    for r in range(Wd):
        for s in range(Wd):
            np.testing.assert_array_equal(got[r, s * n:(s + 1) * n], op[s, r * n:(r + 1) * n])


def test_moe_over_tuple(rng):
    """A MoECommunicator over ("X", "Y") of a 2 x 2 mesh: dispatch + combine equal the dense
    float64 sum over the routed experts."""
    mesh = make_mesh((2, 2), ("X", "Y"))
    T, K, E, H = 4, 2, 8, 16
    moe = nvc.register(nvc.MoECommunicator(mesh, ("X", "Y"), num_experts=E, top_k=K,
                                           max_tokens=T, hidden=H, dtype=jnp.float32))
    assert moe.world_size == 4 and moe.num_local_experts == 2
    x = rng.standard_normal((4 * T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(4 * T)]).astype(np.int32)
    w = rng.random((4 * T, K)).astype(np.float32)

    def f(x, ids, w):
        d = nvc.moe_dispatch(x, ids, axis_name=("X", "Y"))
        return nvc.moe_combine(d.expert_x * 3.0, w, d.handle, axis_name=("X", "Y"))

    y = smap(f, mesh, (P(("X", "Y")),) * 3, P(("X", "Y")))(x, ids, w)
    want = 3.0 * (w[..., None] * x[:, None, :].astype(np.float64)).sum(1)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
