"""The ops' `axis_name=` form (docs/API.md "Communicators by axis name"): every op called as lax
calls its collective, with the communicator found from a `communicators(...)` block or the
registry; same results as with the communicator passed, against numpy references; our kernel
in the program (not XLA's collective); both / neither given -> TypeError naming them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from conftest import make_mesh

W = 8


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((W,), ("x",))


@pytest.fixture(autouse=True)
def _clean():
    yield
    nvc.close_all()


def smap(f, mesh, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def custom_calls(jitted, *args):
    return jitted.lower(*args).as_text()


def test_all_reduce_by_axis_name_keyword_and_positional(mesh, rng):
    x = rng.standard_normal((W * 4, 64)).astype(np.float32)
    want = x.reshape(W, 4, 64).astype(np.float64).sum(0)
    with nvc.communicators(mesh, max_message_bytes=1 << 20):
        f_kw = smap(lambda v: nvc.all_reduce(v, axis_name="x"), mesh, P("x"), P())
        f_pos = smap(lambda v: nvc.all_reduce(v, "x"), mesh, P("x"), P())
        assert "nvc_all_reduce" in custom_calls(f_kw, x)
        for f in (f_kw, f_pos):
            np.testing.assert_allclose(np.asarray(f(x)), want, rtol=1e-5, atol=1e-5)
        # the same bits as lax.psum's own (float32 in rank order)
        ref = smap(lambda v: lax.psum(v, "x"), mesh, P("x"), P())(x)
        np.testing.assert_allclose(np.asarray(f_kw(x)), np.asarray(ref), rtol=1e-6, atol=1e-6)


def test_both_or_neither_is_a_type_error(mesh):
    with nvc.communicators(mesh, max_message_bytes=1 << 16) as comms:
        c = comms["x"]

        def both(v):
            return nvc.all_reduce(v, c, axis_name="x")

        with pytest.raises(TypeError, match=r"all_reduce: pass comm or axis_name, not both"):
            smap(both, mesh, P("x"), P())(jnp.ones((W, 8)))
        with pytest.raises(TypeError, match=r"all_reduce: missing the communicator: pass comm "
                                            r"\(a Communicator\) or axis_name="):
            smap(lambda v: nvc.all_reduce(v), mesh, P("x"), P())(jnp.ones((W, 8)))
        with pytest.raises(TypeError, match=r"moe_dispatch: missing the communicator: pass moe"):
            nvc.moe_dispatch(jnp.ones((4, 8)), jnp.zeros((4, 1), jnp.int32))


def test_unregistered_axis_names_the_ones_that_have_one():
    mesh2 = make_mesh((2, 4), ("a", "b"))
    with nvc.communicators(mesh2, axes="b", max_message_bytes=1 << 16):
        f = smap(lambda v: nvc.all_gather(v, axis_name="a"), mesh2, P(("a", "b")),
                 P(("a", "b")))
        with pytest.raises(ValueError, match=r"all_gather: no Communicator for "
                                             r"axis_name 'a'; axes that have one: 'b'"):
            f(jnp.ones((8, 4)))


def test_fused_ops_by_axis_name(mesh, rng):
    T, H, eps = 4, 64, 1e-6
    x = rng.standard_normal((W * T, H)).astype(np.float32)
    res = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)
    with nvc.communicators(mesh, max_message_bytes=1 << 20) as comms:
        c = comms["x"]
        by_name = smap(lambda v, r, g: nvc.all_reduce_rms_norm(v, r, g, axis_name="x", eps=eps),
                       mesh, (P("x"), P(), P()), (P(), P()))
        by_comm = smap(lambda v, r, g: nvc.all_reduce_rms_norm(v, r, g, c, eps=eps),
                       mesh, (P("x"), P(), P()), (P(), P()))
        assert "nvc_all_reduce_rms" in custom_calls(by_name, x, res, w)
        for a, b in zip(by_name(x, res, w), by_comm(x, res, w)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        r64 = x.reshape(W, T, H).astype(np.float64).sum(0) + res
        n64 = r64 / np.sqrt(np.mean(r64 ** 2, -1, keepdims=True) + eps) * w
        normed, r_out = by_name(x, res, w)
        np.testing.assert_allclose(np.asarray(r_out), r64, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(normed), n64, rtol=1e-4, atol=1e-4)
        quant = smap(lambda v, r, g: nvc.all_reduce_rms_norm_quant(v, r, g, axis_name="x",
                                                                   eps=eps),
                     mesh, (P("x"), P(), P()), (P(), P(), P()))
        q, scale, r_q = quant(x, res, w)
        np.testing.assert_array_equal(np.asarray(r_q), np.asarray(r_out))
        deq = np.asarray(q.astype(jnp.float32), np.float64) * np.asarray(scale)
        np.testing.assert_allclose(deq, n64, rtol=0.07, atol=0.07 * np.abs(n64).max())


def test_all_gather_by_axis_name(mesh, rng):
    x = rng.standard_normal((W * 3, 8)).astype(np.float32)
    with nvc.communicators(mesh, max_message_bytes=1 << 20):
        f = smap(lambda v: nvc.all_gather(v, axis_name="x", axis=0, tiled=True)[None], mesh,
                 P("x"), P("x"))
        assert "nvc_all_gather" in custom_calls(f, x)
        got = np.asarray(f(x))
        for r in range(W):
            np.testing.assert_array_equal(got[r], x)
        g = smap(lambda v: nvc.all_gather(v, "x", axis=1, tiled=False)[None], mesh, P("x"),
                 P("x"))
        np.testing.assert_array_equal(np.asarray(g(x))[5],
                                      np.stack(np.split(x, W), axis=1))


def test_varlen_ops_by_axis_name(mesh, rng):
    max_rows, H = 5, 16
    counts = rng.integers(0, max_rows + 1, W).astype(np.int32)
    x = rng.standard_normal((W * max_rows, H)).astype(np.float32)
    with nvc.communicators(mesh, max_message_bytes=1 << 20):
        def f(v, n):
            g, off, tot = nvc.all_gather_v(v, n[0], axis_name="x")
            back = nvc.reduce_scatter_v(g * 1.0, off, axis_name="x")
            return g[None], off[None], back
        g, off, back = jax.block_until_ready(
            smap(f, mesh, (P("x"), P("x")), (P("x"), P("x"), P("x")))(x, counts))
    rows = np.concatenate([x[r * max_rows: r * max_rows + counts[r]] for r in range(W)])
    total = int(counts.sum())
    np.testing.assert_array_equal(np.asarray(g)[0][:total], rows)
    np.testing.assert_array_equal(np.asarray(off)[3], np.r_[0, np.cumsum(counts)])
    # reduce_scatter_v of the gathered rows (the same on every rank): W times each rank's rows
    back = np.asarray(back).reshape(W, max_rows, H)
    for r in range(W):
        np.testing.assert_allclose(back[r, :counts[r]], W * x[r * max_rows:][:counts[r]],
                                   rtol=1e-6)
        assert not back[r, counts[r]:].any()


def test_ragged_all_to_all_by_axis_name(mesh, rng):
    """Each rank sends 2 rows to every peer; lax's call form, our kernel."""
    n = 2
    operand = rng.standard_normal((W, W * n, 4)).astype(np.float32)
    in_off = np.tile(np.arange(W, dtype=np.int32) * n, (W, 1))
    sizes = np.full((W, W), n, np.int32)
    out_off = np.broadcast_to((np.arange(W, dtype=np.int32) * n)[:, None], (W, W)).copy()

    def f(op, io, ss, oo, rs):
        out = jnp.zeros_like(op[0])
        return nvc.ragged_all_to_all(op[0], out, io[0], ss[0], oo[0], rs[0], axis_name="x")[None]

    with nvc.communicators(mesh, max_message_bytes=1 << 20):
        fn = smap(f, mesh, (P("x"),) * 5, P("x"))
        assert "nvc_ragged" in custom_calls(fn, operand, in_off, sizes, out_off, sizes)
        got = np.asarray(fn(operand, in_off, sizes, out_off, sizes))
    for r in range(W):  # rank r's rows from sender s sit at s * n: sender s's slice r
        for s in range(W):
            np.testing.assert_array_equal(got[r, s * n:(s + 1) * n],
                                          operand[s, r * n:(r + 1) * n])


def test_moe_ops_by_axis_name_pick_the_fitting_communicator(rng):
    """Two MoECommunicators on one axis with different hidden widths: axis_name= finds the one
    whose sizes fit the arrays; split halves too."""
    mesh = make_mesh((4,), ("ep",))
    T, K, E = 8, 2, 8
    moes = [nvc.register(nvc.MoECommunicator(mesh, "ep", num_experts=E, top_k=K, max_tokens=T,
                                             hidden=h, dtype=jnp.float32)) for h in (16, 32)]
    x = rng.standard_normal((4 * T, 32)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(4 * T)]).astype(np.int32)
    w = rng.random((4 * T, K)).astype(np.float32)

    def f(x, ids, w):
        d = nvc.moe_dispatch(x, ids, axis_name="ep")
        y = nvc.moe_combine(d.expert_x * 2.0, w, d.handle, axis_name="ep")
        sent = nvc.moe_dispatch_send(x, ids, axis_name="ep")
        d2 = nvc.moe_dispatch_recv(sent, axis_name="ep")
        cs = nvc.moe_combine_send(d2.expert_x * 2.0, d2.handle, axis_name="ep")
        y2 = nvc.moe_combine_recv(cs, w, axis_name="ep")
        return y, y2

    y, y2 = smap(f, mesh, (P("ep"),) * 3, (P("ep"), P("ep")))(x, ids, w)
    want = 2.0 * (w[..., None] * x[:, None, :].astype(np.float64)).sum(1)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))
    x_bad = rng.standard_normal((4 * T, 24)).astype(np.float32)
    with pytest.raises(ValueError, match=r"moe_dispatch: no MoECommunicator for "
                                         r"axis_name 'ep'.*do not fit this call"):
        smap(lambda a, b: nvc.moe_dispatch(a, b, axis_name="ep").expert_counts, mesh,
             (P("ep"), P("ep")), P("ep"))(x_bad, ids)
    for m in moes:
        assert not m.closed


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 4])
def test_new_forms_across_processes(n):
    """tests/mp/opforms_mp.py: axis_name=, the tuple-axes communicator, the fused forms and the
    ragged forms, one CPU device per process (the script's GPU runs: scripts/gpu_check.sh
    opforms)."""
    from test_multiprocess import launch
    rc, out = launch(n, "opforms_mp.py", timeout=500)
    assert rc == 0, out[-4000:]
    assert out.count("PASS opforms") == n, out[-3000:]
