"""nvc.jit on unchanged model code: a JetStream-style tensor-parallel decoder (tests/tp_decoder.py)
and the MaxText-style expert-parallel MoE layer (jax_nvcomm/models/moe_ragged.py on lax's
collectives), on 8 CPU devices, against jax.jit of the same code and a dense reference:
our custom calls in the program, no XLA collective left where we have a kernel, every
psum -> add -> RMSNorm one fused call, the results (bitwise for the plain swaps, within the
kernel's rounding for the fused ones), forward and jax.grad, bf16 and f32 activations."""
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
import tp_decoder as tpd

OUR_TARGETS = re.compile(r"custom_call @(nvc_\w+)")
XLA_COLLECTIVES = re.compile(r"stablehlo\.(all_reduce|all_gather|reduce_scatter|all_to_all|"
                             r"collective_permute)|\"stablehlo\.(all_reduce|all_gather|"
                             r"reduce_scatter)\"")


def targets(text):
    """{our ffi target: count} in a lowered program's text."""
    out = {}
    for t in OUR_TARGETS.findall(text):
        out[t] = out.get(t, 0) + 1
    return out


def xla_collectives(text):
    return [m.group(0) for m in XLA_COLLECTIVES.finditer(text)]


def mesh_of(shape, names):
    return jax.sharding.Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


@pytest.fixture(autouse=True)
def _closed_after():
    yield
    nvc.close_all()


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


# --------------------------------------------------------------------------- small forms
def _rms(x, w, eps=1e-6):
    xf = x.astype(jnp.float32)
    v = jnp.mean(xf * xf, axis=-1, keepdims=True)
    return (xf * lax.rsqrt(v + eps) * w).astype(x.dtype)


def _data(shape, dtype, n=3, seed=0):
    ks = jax.random.split(jax.random.key(seed), n)
    return [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in ks]


def test_psum_all_gather_swapped_bitwise():
    mesh = mesh_of((8,), ("tp",))

    def body(x):
        return lax.psum(x, "tp"), lax.all_gather(x, "tp", axis=0, tiled=True), \
            lax.pmean(x, "tp")

    f = jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=(P(), P("tp"), P()))
    (x,) = _data((64, 32), jnp.float32, 1)
    want = jax.jit(f)(x)
    j = nvc.jit(f)
    got = j(x)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = j.lower(x).as_text()
    assert targets(text) == {"nvc_all_reduce": 2, "nvc_all_gather": 1}, targets(text)
    assert xla_collectives(text) == []


def test_psum_scatter_to_reduce_scatter_v_bitwise():
    mesh = mesh_of((8,), ("tp",))

    def body(x):
        return (lax.psum_scatter(x, "tp", scatter_dimension=0, tiled=True),
                lax.psum_scatter(x.reshape(8, -1, 8), "tp", scatter_dimension=0, tiled=False))

    f = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=(P("tp"), P("tp")))
    (x,) = _data((64, 8), jnp.float32, 1)
    j = nvc.jit(f)
    assert targets(j.lower(x).as_text()) == {"nvc_reduce_scatter_v": 2}
    for a, b in zip(j(x), jax.jit(f)(x)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_ragged_mixed_index_dtypes():
    """lax takes int32 offsets with int64 sizes; so does the rewrite (the op brings them to
    one dtype). XLA:CPU has no ragged all-to-all: the reference is numpy."""
    mesh = mesh_of((8,), ("ep",))
    W, n = 8, 2   # every rank sends n rows to every rank

    def body(op, out):
        i32 = jnp.arange(W, dtype=jnp.int32)
        me = lax.axis_index("ep").astype(jnp.int32)
        sizes = jnp.full((W,), n, jnp.int16)
        return lax.ragged_all_to_all(op, out, i32 * n, sizes, jnp.full((W,), me * n,
                                                                       jnp.int32), sizes,
                                     axis_name="ep")

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
    op = jnp.arange(W * W * n * 4, dtype=jnp.float32).reshape(W * W * n, 4)
    out = jnp.zeros_like(op)
    got = np.asarray(nvc.jit(f)(op, out)).reshape(W, W, n, 4)
    src = np.asarray(op).reshape(W, W, n, 4)
    np.testing.assert_array_equal(got, src.transpose(1, 0, 2, 3))


def test_all_to_all_of_equal_chunks_bitwise():
    mesh = mesh_of((8,), ("ep",))

    def body(x, n):
        return (lax.all_to_all(x, "ep", 0, 0, tiled=True),
                lax.all_to_all(n.reshape(8, 2), "ep", 0, 0, tiled=False))

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=(P("ep"),
                                                                             P("ep")))
    (x,) = _data((8 * 16, 4), jnp.float32, 1)
    n = jnp.arange(8 * 16, dtype=jnp.int32)
    j = nvc.jit(f)
    assert targets(j.lower(x, n).as_text()) == {"nvc_ragged_all_to_all": 2}
    assert xla_collectives(j.lower(x, n).as_text()) == []
    for a, b in zip(j(x, n), jax.jit(f)(x, n)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_integer_psum_stays_xla_and_explain_says_why():
    mesh = mesh_of((8,), ("tp",))

    def body(x, n):
        return lax.psum(x, "tp"), lax.psum(n, "tp")

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=(P(), P()))
    x = jnp.ones((64, 32), jnp.float32)
    n = jnp.arange(8, dtype=jnp.int32)
    a, b = nvc.jit(f)(x, n)
    np.testing.assert_array_equal(np.asarray(b), np.asarray(jax.jit(f)(x, n)[1]))
    text = nvc.jit(f).lower(x, n).as_text()
    assert targets(text) == {"nvc_all_reduce": 1}
    assert len(xla_collectives(text)) == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("form", ["mean_xx", "square", "pow", "one_over_sqrt", "no_upcast",
                                  "weight_after_cast", "no_weight", "odd_width"])
def test_fused_forms(form, dtype):
    mesh = mesh_of((8,), ("tp",))
    H, eps = (60 if form == "odd_width" else 64), 1e-5

    def norm(r, w):
        if form in ("mean_xx", "odd_width"):
            return _rms(r, w, eps)
        rf = r.astype(jnp.float32)
        if form == "square":
            ms = jnp.mean(jnp.square(rf), -1, keepdims=True)
            return (rf * lax.rsqrt(ms + eps) * w).astype(r.dtype)
        if form == "pow":
            ms = jnp.mean(rf ** 2, -1, keepdims=True)
            return (rf * lax.rsqrt(ms + eps) * w).astype(r.dtype)
        if form == "one_over_sqrt":
            ms = jnp.mean(rf * rf, -1, keepdims=True)
            return (rf * (1.0 / jnp.sqrt(ms + eps)) * w).astype(r.dtype)
        if form == "no_upcast":
            ms = jnp.mean(r * r, -1, keepdims=True)
            return r * lax.rsqrt(ms + eps) * w.astype(r.dtype)
        if form == "weight_after_cast":
            ms = jnp.mean(lax.square(rf), -1, keepdims=True)
            return w * (rf * lax.rsqrt(ms + eps)).astype(r.dtype)
        if form == "no_weight":
            ms = jnp.mean(rf * rf, -1, keepdims=True)
            return (rf * lax.rsqrt(ms + eps)).astype(r.dtype)
        raise AssertionError(form)

    def body(x, res, w):
        h = lax.psum(x, "tp") + res
        return norm(h, w), h * 2

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(), P()),
                      out_specs=(P(), P()))
    (x,) = _data((6, 8 * H), dtype, 1)
    (res,) = _data((6, H), dtype, 1, seed=1)
    (w,) = _data((H,), jnp.float32, 1, seed=3)
    j = nvc.jit(f)
    text = j.lower(x, res, w).as_text()
    assert targets(text) == {"nvc_all_reduce_rms": 1}, targets(text)
    assert xla_collectives(text) == []
    want = jax.jit(f)(x, res, w)
    got = j(x, res, w)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    if dtype == jnp.float32:  # the new residual: bitwise where the sums are (float32)
        np.testing.assert_array_equal(np.asarray(want[1]), np.asarray(got[1]))
    else:  # XLA:CPU sums bfloat16 in bfloat16, ours in float32: within its rounding
        np.testing.assert_allclose(_f64(got[1]), _f64(want[1]), rtol=tol, atol=0.1)
    np.testing.assert_allclose(_f64(got[0]), _f64(want[0]), rtol=tol, atol=tol)


def test_fused_norm_in_jitted_helper_and_residual_used_later():
    mesh = mesh_of((8,), ("tp",))

    @jax.jit
    def row_parallel(a, w):
        return lax.psum(a @ w, "tp")

    @jax.jit
    def norm(h, w):
        return _rms(h, w)

    def body(a, wl, res, wn):
        h = row_parallel(a, wl) + res
        y = norm(h, wn)
        return y + h  # the new residual used after the norm

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp"), P(), P()),
                      out_specs=P())
    (a,) = _data((4, 64), jnp.float32, 1)
    (wl,) = _data((64, 32), jnp.float32, 1, seed=4)
    res, = _data((4, 32), jnp.float32, 1, seed=1)
    wn, = _data((32,), jnp.float32, 1, seed=2)
    j = nvc.jit(f)
    assert targets(j.lower(a, wl, res, wn).as_text()) == {"nvc_all_reduce_rms": 1}
    np.testing.assert_allclose(np.asarray(j(a, wl, res, wn)),
                               np.asarray(jax.jit(f)(a, wl, res, wn)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_cast_after_the_norm_is_the_quant_op(dtype):
    """psum -> add -> RMSNorm -> per-token FP8 scaling and cast: one
    all_reduce_rms_norm_quant; q * scale equals XLA's within FP8's rounding."""
    mesh = mesh_of((8,), ("tp",))

    def body(x, res, w):
        h = lax.psum(x, "tp") + res
        n = _rms(h, w).astype(jnp.float32)
        amax = jnp.max(jnp.abs(n), axis=-1, keepdims=True)
        scale = jnp.maximum(amax, 1e-12) / 448.0
        q = (n / scale).astype(jnp.float8_e4m3fn)
        return q, scale, h

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P(), P()))
    x, res = _data((8, 64), dtype, 2)
    (w,) = _data((64,), jnp.float32, 1, seed=2)
    j = nvc.jit(f)
    assert targets(j.lower(x, res, w).as_text()) == {"nvc_all_reduce_rms_quant": 1}, \
        targets(j.lower(x, res, w).as_text())
    (q, s, h), (q0, s0, h0) = j(x, res, w), jax.jit(f)(x, res, w)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == s0.shape == (8, 1)
    tol = 3e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(_f64(s), _f64(s0), rtol=tol)
    deq, deq0 = _f64(q) * _f64(s), _f64(q0) * _f64(s0)
    np.testing.assert_allclose(deq, deq0, rtol=0, atol=2 ** -3 * np.abs(deq0).max())
    np.testing.assert_allclose(_f64(h), _f64(h0), rtol=tol, atol=tol)


def test_residual_of_another_dtype_is_a_plain_all_reduce():
    mesh = mesh_of((8,), ("tp",))

    def body(x, res, w):
        return _rms(lax.psum(x, "tp") + res, w)   # bf16 sum + f32 residual: promoted

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=P())
    (x,) = _data((4, 32), jnp.bfloat16, 1)
    (res, w) = _data((4, 32), jnp.float32, 2, seed=1)
    w = w[0]
    j = nvc.jit(f)
    assert targets(j.lower(x, res, w).as_text()) == {"nvc_all_reduce": 1}
    np.testing.assert_allclose(_f64(j(x, res, w)), _f64(jax.jit(f)(x, res, w)), rtol=2e-2,
                               atol=2e-2)


def test_norm_intermediate_used_elsewhere_still_fused():
    """An intermediate of the norm used elsewhere (as jax.grad's residuals are) is computed
    from the fused call's new residual; the psum + add + norm is still one call."""
    mesh = mesh_of((8,), ("tp",))

    def body(x, res, w):
        h = lax.psum(x, "tp") + res
        hf = h.astype(jnp.float32)
        ms = jnp.mean(hf * hf, -1, keepdims=True)
        return (hf * lax.rsqrt(ms + 1e-6) * w), ms

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P()))
    x, res = _data((4, 32), jnp.float32, 2)
    (w,) = _data((32,), jnp.float32, 1, seed=5)
    j = nvc.jit(f)
    assert targets(j.lower(x, res, w).as_text()) == {"nvc_all_reduce_rms": 1}
    (y, ms), (y0, ms0) = j(x, res, w), jax.jit(f)(x, res, w)
    np.testing.assert_array_equal(np.asarray(ms), np.asarray(ms0))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y0), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the TP decoder
def _decoder_case(tp_shape, tp_names, dtype):
    mesh = mesh_of(tp_shape, tp_names)
    cfg = tpd.Config(dtype=dtype)
    params = tpd.init_params(jax.random.key(1), cfg)
    x = jax.random.normal(jax.random.key(2), (2, 8, cfg.hidden), jnp.float32).astype(dtype)
    return mesh, cfg, params, x


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("tp_shape,tp_names", [((8,), ("tp",)), ((4, 2), ("X", "Y"))])
def test_tp_decoder_forward(tp_shape, tp_names, dtype):
    mesh, cfg, params, x = _decoder_case(tp_shape, tp_names, dtype)
    fwd = tpd.sharded_forward(mesh, cfg, tp_names)
    j = nvc.jit(fwd)
    text = j.lower(params, x).as_text()
    # 2 per layer: attention's psum + residual + post-attention norm, the MLP's psum +
    # residual + the next layer's input norm (the last layer's: the final norm)
    assert targets(text) == {"nvc_all_reduce_rms": 2 * cfg.layers}, targets(text)
    assert xla_collectives(text) == []
    got = j(params, x)
    want = jax.jit(fwd)(params, x)
    dense = jax.jit(tpd.dense_forward(cfg))(params, x)
    tol = 6e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(_f64(got), _f64(want), rtol=tol, atol=tol)
    np.testing.assert_allclose(_f64(got), _f64(dense), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("tp_shape,tp_names", [((8,), ("tp",)), ((2, 4), ("X", "Y"))])
def test_tp_decoder_grad(tp_shape, tp_names, dtype):
    mesh, cfg, params, x = _decoder_case(tp_shape, tp_names, dtype)
    fwd = tpd.sharded_forward(mesh, cfg, tp_names)

    def loss(params, x):
        return jnp.mean(jnp.square(fwd(params, x).astype(jnp.float32)))

    want = jax.jit(jax.grad(loss))(params, x)
    got_inner = nvc.jit(jax.grad(loss))(params, x)       # grad inside: its psums rewritten
    got_outer = jax.grad(nvc.jit(loss))(params, x)       # grad of the rewritten program
    text = nvc.jit(jax.grad(loss)).lower(params, x).as_text()
    assert "nvc_all_reduce_rms" in targets(text)
    assert xla_collectives(text) == []
    tol = 1e-1 if dtype == jnp.bfloat16 else 1e-4
    for got in (got_inner, got_outer):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(_f64(a), _f64(b), rtol=tol, atol=tol * np.abs(
                _f64(b)).max())


# --------------------------------------------------------------------------- MoE (MaxText style)
def _moe_setup(dtype=jnp.float32):
    from jax_nvcomm.models import moe_ragged as mr
    mesh = mesh_of((8,), ("ep",))
    T, H, F, E, K = 8, 32, 16, 16, 2
    params = mr.init_params(jax.random.key(3), hidden=H, ffn=F, experts=E, dtype=dtype)
    x = jax.random.normal(jax.random.key(4), (8 * T, H), jnp.float32).astype(dtype)
    coll = mr.Collectives(partial(lax.ragged_all_to_all, axis_name="ep"),
                          partial(lax.all_gather, axis_name="ep"),
                          partial(lax.psum, axis_name="ep"))
    specs = mr.param_specs("ep")
    layer = partial(mr.moe_layer, top_k=K, axis_name="ep", coll=coll)
    fwd = jax.shard_map(lambda p, x: layer(x, p), mesh=mesh, in_specs=(specs, P("ep")),
                        out_specs=P("ep"))
    dense = jax.shard_map(lambda p, x: mr.dense_reference(x, p, top_k=K, axis_name="ep"),
                          mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep"))
    return mr, mesh, params, x, fwd, dense, layer, specs


def test_moe_layer_forward():
    mr, mesh, params, x, fwd, dense, _, _ = _moe_setup()
    j = nvc.jit(fwd)
    text = j.lower(params, x).as_text()
    t = targets(text)
    assert t.get("nvc_ragged_all_to_all") == 2 and t.get("nvc_all_gather") == 1, t
    assert xla_collectives(text) == []
    np.testing.assert_allclose(np.asarray(j(params, x)), np.asarray(jax.jit(dense)(params, x)),
                               rtol=1e-5, atol=1e-5)


def test_moe_layer_grad():
    mr, mesh, params, x, fwd, dense, layer, specs = _moe_setup()
    target = jax.random.normal(jax.random.key(5), x.shape, jnp.float32)

    def loss(f):
        return lambda p, x: jnp.mean(jnp.square(f(p, x) - target))

    want = jax.jit(jax.grad(loss(dense), argnums=(0, 1)))(params, x)
    got_outer = jax.grad(nvc.jit(loss(fwd)), argnums=(0, 1))(params, x)
    for a, b in zip(jax.tree.leaves(got_outer), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    j = nvc.jit(jax.grad(loss(fwd), argnums=(0, 1)))
    text = j.lower(params, x).as_text()
    t = targets(text)
    assert t.get("nvc_ragged_all_to_all", 0) >= 4, t   # lax's transposes' all_to_alls too
    assert xla_collectives(text) == []
    for a, b in zip(jax.tree.leaves(j(params, x)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
