"""nvc.jit fuses psum -> residual add -> RMSNorm as public model code writes the norm (the
weight before or after the division or folded into the rsqrt, x / sqrt, x * (1 / sqrt),
(x - 0), Gemma's (1 + w), the mean as sum / n or sum * (1 / n), f32 upcasts anywhere), inside
a shard_map body and across its exit (the psum ends the body; the add and the norm come after
it, outside, behind reshape / reshard / slice), on 8 CPU devices: exactly one
all_reduce_rms_norm in the program, no XLA all-reduce left, values within the kernel's
rounding of jax.jit's, output shardings jax.jit's, gradients through it; a norm-like tail that
does not match names the step in `explain` and warns once."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm import _warn
from jax_nvcomm.jit import rewrite
from test_jit import mesh_of, targets, xla_collectives

EPS = 1e-6


@pytest.fixture(autouse=True)
def _closed_after():
    yield
    nvc.close_all()


def f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def close(got, want, dtype):
    """Within the kernel's rounding: bf16 a few ulps (of the largest value in the row; the
    weight may be applied in bf16 before the division), f32 ~1e-6 relative."""
    g, w = f64(got), f64(want)
    if jnp.dtype(dtype) == jnp.bfloat16:
        scale = np.abs(w).max(axis=-1, keepdims=True) + 1e-3
        np.testing.assert_array_less(np.abs(g - w) / scale, 3 * 2.0 ** -8)
    else:
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * np.abs(w).max())


def data(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32) * scale).astype(dtype)


# --------------------------------------------------------------------------- the norm forms
def _mean_sq(xf, how):
    H = xf.shape[-1]
    if how == "mean":
        return jnp.mean(xf * xf, axis=-1, keepdims=True)
    if how == "sum_div":
        return jnp.sum(lax.square(xf), axis=-1, keepdims=True) / H
    if how == "sum_mul":
        return jnp.sum(xf ** 2, axis=-1, keepdims=True) * (1.0 / H)
    raise AssertionError(how)


def norm_form(form, x, w):
    """RMSNorm of x [..., H] with weight w [H], written as `form`."""
    dt = x.dtype
    if form == "gamma_x_over_sqrt":  # jax-llm-examples' rms_norm: the weight before the /
        rms = jnp.sqrt(jnp.mean(jnp.astype(x, jnp.float32) ** 2, axis=-1, keepdims=True) + EPS)
        return jnp.astype(w * x / rms, dt)
    if form == "one_times_x_over_sqrt":  # the same without a weight: `1 * x / rms`
        rms = jnp.sqrt(jnp.mean(jnp.astype(x, jnp.float32) ** 2, axis=-1, keepdims=True) + EPS)
        return jnp.astype(1 * x / rms, dt)
    if form == "weight_in_rsqrt":  # Flax nnx.RMSNorm: mul = rsqrt(var + eps) * scale; y * mul
        xf = jnp.asarray(x, jnp.float32)
        var = jnp.mean(lax.square(xf), axis=-1)
        mean = jnp.zeros_like(var)
        y = xf - mean.reshape(var.shape + (1,))
        mul = lax.rsqrt(var.reshape(var.shape + (1,)) + EPS)
        mul = mul * w.reshape((1,) * (x.ndim - 1) + (-1,))
        return jnp.asarray(y * mul, dt)
    if form == "minus_zero":  # a literal zero mean subtracted
        xf = x.astype(jnp.float32)
        mean = 0.0
        var = jnp.mean(lax.square(xf - mean), axis=-1, keepdims=True)
        return ((xf - mean) * (lax.rsqrt(var + EPS) * w.astype(jnp.float32))).astype(dt)
    if form == "x_over_sqrt":
        xf = x.astype(jnp.float32)
        return (xf / jnp.sqrt(_mean_sq(xf, "sum_div") + EPS) * w).astype(dt)
    if form == "x_times_one_over_sqrt":
        xf = x.astype(jnp.float32)
        return (w * (xf * (1 / jnp.sqrt(_mean_sq(xf, "sum_mul") + EPS)))).astype(dt)
    if form == "gemma_one_plus_w":
        xf = x.astype(jnp.float32)
        n = xf * lax.rsqrt(_mean_sq(xf, "mean") + EPS)
        return (n * (1.0 + w.astype(jnp.float32))).astype(dt)
    if form == "pow_half":
        xf = x.astype(jnp.float32)
        return (xf * (_mean_sq(xf, "mean") + EPS) ** -0.5 * w).astype(dt)
    if form == "upcast_after_weight":  # no upcast before the square; the weight in x's type
        return (x * lax.rsqrt(_mean_sq(x, "mean") + EPS) * w.astype(dt)).astype(jnp.float32)
    if form == "no_weight_no_cast":
        xf = x.astype(jnp.float32)
        return xf * lax.rsqrt(_mean_sq(xf, "sum_div") + EPS)
    raise AssertionError(form)


FORMS = ["gamma_x_over_sqrt", "one_times_x_over_sqrt", "weight_in_rsqrt", "minus_zero", "x_over_sqrt",
         "x_times_one_over_sqrt", "gemma_one_plus_w", "pow_half", "upcast_after_weight",
         "no_weight_no_cast"]


@pytest.mark.parametrize("dtype, wdtype", [(jnp.bfloat16, jnp.bfloat16),
                                           (jnp.bfloat16, jnp.float32),
                                           (jnp.float32, jnp.float32)])
@pytest.mark.parametrize("form", FORMS)
def test_form_in_body_is_one_fused_call(rng, form, dtype, wdtype):
    mesh = mesh_of((8,), ("tp",))
    H = 64

    def body(x, res, w):
        h = lax.psum(x, "tp") + res
        return norm_form(form, h, w), h

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, None, "tp"), P(), P()),
                      out_specs=(P(), P()))
    x = data(rng, (2, 3, 8 * H), dtype)
    res = data(rng, (2, 3, H), dtype)
    w = data(rng, (H,), wdtype, 0.5)
    j = nvc.jit(f)
    text = j.lower(x, res, w).as_text()
    assert targets(text) == {"nvc_all_reduce_rms": 1}, targets(text)
    assert xla_collectives(text) == []
    (n, h), (n0, h0) = j(x, res, w), jax.jit(f)(x, res, w)
    assert n.dtype == n0.dtype and n.shape == n0.shape
    close(h, h0, dtype)
    close(n, n0, dtype if jnp.dtype(n0.dtype) != jnp.float32 else jnp.bfloat16
          if dtype == jnp.bfloat16 else jnp.float32)


def test_reshape_and_slice_between_psum_and_add(rng):
    """psum -> reshape of the leading dims -> slice of rows -> add: the reshape and slice are
    applied to each rank's part before the fused call."""
    mesh = mesh_of((8,), ("tp",))

    def body(x, res, w):
        s = lax.psum(x, "tp").reshape(2, 4, 32)[:, :3]
        h = s + res
        return norm_form("gamma_x_over_sqrt", h, w), h

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P()))
    x, res = data(rng, (8, 32), jnp.float32), data(rng, (2, 3, 32), jnp.float32)
    w = data(rng, (32,), jnp.float32)
    j = nvc.jit(f)
    assert targets(j.lower(x, res, w).as_text()) == {"nvc_all_reduce_rms": 1}
    for a, b in zip(j(x, res, w), jax.jit(f)(x, res, w)):
        close(a, b, jnp.float32)


def upcast_add_norm(x, residual, weight):
    """sglang-jax's rmsnorm with a residual: the add of both upcast to float32, the norm on
    that float32 sum, the new residual rounded back."""
    dt = x.dtype
    h = jnp.asarray(x, jnp.float32) + jnp.asarray(residual, jnp.float32)
    new_res = h.astype(dt)
    ms = jnp.mean(lax.square(h), axis=-1, keepdims=True)
    y = jnp.asarray(h * lax.rsqrt(ms + EPS), jnp.float32)
    return (y * jnp.asarray(weight, jnp.float32)).astype(dt), new_res


def test_add_of_upcasts_in_body(rng):
    mesh = mesh_of((8,), ("tp",))

    def body(x, res, w):
        return upcast_add_norm(lax.psum(x, "tp"), res, w)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(), P()),
                      out_specs=(P(), P()))
    x, res = data(rng, (5, 8 * 64), jnp.bfloat16), data(rng, (5, 64), jnp.bfloat16)
    w = data(rng, (64,), jnp.bfloat16)
    j = nvc.jit(f)
    text = j.lower(x, res, w).as_text()
    assert targets(text) == {"nvc_all_reduce_rms": 1} and xla_collectives(text) == []
    for a, b in zip(j(x, res, w), jax.jit(f)(x, res, w)):
        assert a.dtype == b.dtype == jnp.bfloat16
        close(a, b, jnp.bfloat16)


# --------------------------------------------------------------------------- near misses
@pytest.mark.parametrize("miss, step", [
    ("extra_factor", "the normalised value: a constant factor 2.0"),
    ("wrong_divisor", "the mean of squares: the sum of squares is not divided by the hidden "
                      "size 64"),
    ("eps_after_sqrt", "eps: no constant is added to the mean of squares"),
    ("row_weight", "the weight: a factor float32[4,64] that is not a [64] vector"),
    ("wrong_axis", "the mean of squares: reduce_sum over axes (0,) where a sum over the last "
                   "axis (1) was expected"),
])
def test_near_miss_names_the_step_and_warns_once(rng, monkeypatch, miss, step):
    monkeypatch.setattr(_warn, "quiet", lambda: False)
    rewrite.reset_warnings()
    mesh = mesh_of((8,), ("tp",))

    def body(x, res, w, rw):
        h = lax.psum(x, "tp") + res
        hf = h.astype(jnp.float32)
        if miss == "extra_factor":
            return hf * 2.0 * lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + EPS) * w
        if miss == "wrong_divisor":
            return hf * lax.rsqrt(jnp.sum(hf * hf, -1, keepdims=True) / 63 + EPS) * w
        if miss == "eps_after_sqrt":
            return hf / (jnp.sqrt(jnp.mean(hf * hf, -1, keepdims=True)) + EPS) * w
        if miss == "row_weight":  # a per-row factor, not a weight
            return (hf * rw) * lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + EPS)
        return hf * lax.rsqrt(jnp.mean(hf * hf, 0, keepdims=True) + EPS) * w

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), P()), out_specs=P())
    x, res, rw = (data(rng, (4, 64), jnp.float32) for _ in range(3))
    w = data(rng, (64,), jnp.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = nvc.explain(f, x, res, w, rw).rows
        got = nvc.jit(f)(x, res, w, rw)
    (row,) = rows
    assert row["became"].startswith("all_reduce (") and row["fused_with"] == ""
    assert f"not fused with the add + RMSNorm after it: {step} at test_jit_norm_forms.py:" \
        in row["reason"], row["reason"]
    assert row["fixable"]
    mine = [w_ for w_ in caught if step in str(w_.message)]
    assert len(mine) == 1, [str(w_.message) for w_ in caught]
    np.testing.assert_allclose(f64(got), f64(jax.jit(f)(x, res, w, rw)), rtol=1e-6, atol=1e-6)


def test_factor_after_the_norm_is_computed_after_the_fused_call(rng):
    """`norm(h) * w * 2.0` or `norm(h) * per_row`: the norm is fused, the rest applied to its
    result (the same maths)."""
    mesh = mesh_of((8,), ("tp",))

    def body(x, res, w, rw):
        h = lax.psum(x, "tp") + res
        hf = h.astype(jnp.float32)
        n = hf * lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + EPS)
        return n * w * 2.0, n * rw

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), P()), out_specs=(P(), P()))
    x, res, rw = (data(rng, (4, 64), jnp.float32) for _ in range(3))
    w = data(rng, (64,), jnp.float32)
    j = nvc.jit(f)
    assert targets(j.lower(x, res, w, rw).as_text()) == {"nvc_all_reduce_rms": 1}
    for a, b in zip(j(x, res, w, rw), jax.jit(f)(x, res, w, rw)):
        close(a, b, jnp.float32)


def test_layer_norm_is_not_norm_like(rng):
    """x - mean(x) (a LayerNorm): no RMSNorm step is named, nothing warned."""
    mesh = mesh_of((8,), ("tp",))

    def body(x, res):
        h = lax.psum(x, "tp") + res
        c = h - jnp.mean(h, -1, keepdims=True)
        return c * lax.rsqrt(jnp.mean(c * c, -1, keepdims=True) + EPS)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    x, res = data(rng, (4, 64), jnp.float32), data(rng, (4, 64), jnp.float32)
    (row,) = nvc.explain(f, x, res).rows
    assert "not fused" not in row["reason"] and not row["fixable"]


# --------------------------------------------------------------------------- across the exit
def _mesh(names, shape, explicit):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names),
                         devices=jax.devices()[:int(np.prod(shape))])


def jle_model(mesh, B, S, H, inner_reshape=False):
    """jax-llm-examples' style: a MoE-ish shard_map over ("z", "y") ending in the psum, out
    replicated; outside: reshape, + residual, `gamma * x / sqrt(...)`. inner_reshape: as its
    `_expert_fn` does, the body reshapes the sum to [B, S, H] itself, and outside come
    `[..., :H]` and a sharding constraint (reshard under Explicit axes)."""

    def moe(x, w1, w2):
        def body(x, w1, w2):
            out = jnp.einsum("tf,fh->th", jax.nn.silu(jnp.einsum("th,hf->tf", x, w1)), w2)
            out = lax.psum(out, ("z", "y"))
            return out.reshape(B, S, H) if inner_reshape else out
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, ("z", "y")),
                                                         P(("z", "y"), None)),
                             out_specs=P(), check_vma=not inner_reshape)(x, w1, w2)

    def constrain(a):
        if mesh.axis_types[0] == AxisType.Explicit:
            return jax.sharding.reshard(a, P())
        return lax.with_sharding_constraint(a, NamedSharding(mesh, P()))

    def layer(x, res, w1, w2, gamma):
        if inner_reshape:
            out = constrain(moe(x.reshape(B * S, H), w1, w2)[..., :H])
        else:
            out = moe(x.reshape(B * S, H), w1, w2).reshape(B, S, H)
        h = res + out.astype(res.dtype)
        rms = jnp.sqrt(jnp.mean(jnp.astype(h, jnp.float32) ** 2, axis=-1, keepdims=True) +
                       EPS)
        return jnp.astype(gamma * h / rms, h.dtype), h

    return layer


def sglang_model(mesh, T, H, pad):
    """sglang-jax's style: an EPMoE over "expert" (rows sharded over "data") ending in the
    psum; outside: the padded rows sliced off, reshard, `hidden += residual`, an nnx-style
    norm `x * (rsqrt(var + eps) * scale)`."""

    def epmoe(x, w1, w2):
        def body(x, w1, w2):
            y = jnp.tanh(x @ w1[0]) @ w2[0]
            return lax.psum(y, "expert")
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("expert"), P("expert")),
                             out_specs=P("data"))(x, w1, w2)

    def layer(x, residual, w1, w2, scale):
        hidden = epmoe(x, w1, w2)[:T - pad]
        hidden = jax.sharding.reshard(hidden, P("data")) if \
            mesh.axis_types[0] == AxisType.Explicit else hidden
        hidden += residual
        xf = jnp.asarray(hidden, jnp.float32)
        var = jnp.mean(lax.square(xf), axis=-1, keepdims=True)
        mul = lax.rsqrt(var + EPS) * scale
        return jnp.asarray((xf - 0) * mul, hidden.dtype), hidden

    return layer


def _check_exit(f, args, dtype, grad_argnums=None):
    j = nvc.jit(f)
    text = j.lower(*args).as_text()
    assert targets(text) == {"nvc_all_reduce_rms": 1}, targets(text)
    assert not [c for c in xla_collectives(text) if "all_reduce" in c], xla_collectives(text)
    got, want = j(*args), jax.jit(f)(*args)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
        close(a, b, dtype)
    if grad_argnums is not None:
        def loss(fn):
            return lambda *a: sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in fn(*a))
        g = jax.grad(loss(j), grad_argnums)(*args)
        g0 = jax.grad(loss(jax.jit(f)), grad_argnums)(*args)
        for a, b in zip(g, g0):
            scale = np.abs(f64(b)).max()
            tol = 5e-2 if dtype == jnp.bfloat16 else 1e-4
            np.testing.assert_allclose(f64(a), f64(b), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("inner_reshape", [False, True])
@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("B, S", [(1, 1), (4, 2), (1, 128)])   # decode and prefill
def test_exit_jax_llm_examples_style(rng, explicit, dtype, B, S, inner_reshape):
    mesh = _mesh(("z", "y"), (2, 4), explicit)
    H, F = 64, 16 * 8
    f = jle_model(mesh, B, S, H, inner_reshape)
    x, res = data(rng, (B, S, H), dtype), data(rng, (B, S, H), dtype)
    w1 = jax.device_put(data(rng, (H, F), dtype, 0.2), NamedSharding(mesh, P(None, ("z", "y"))))
    w2 = jax.device_put(data(rng, (F, H), dtype, 0.2), NamedSharding(mesh, P(("z", "y"), None)))
    gamma = data(rng, (H,), dtype)
    with jax.set_mesh(mesh):
        _check_exit(f, (x, res, w1, w2, gamma), dtype,
                    grad_argnums=(0, 1, 4) if (B, S) == (4, 2) else None)


@pytest.mark.parametrize("explicit", [True, False])
def test_exit_sglang_jax_upcast_add(rng, explicit):
    """sglang-jax's decoder layer: the EPMoE's psum leaves the shard_map; the next layer's
    RMSNorm takes (hidden, residual) and adds them upcast to float32."""
    mesh = _mesh(("data", "expert"), (2, 4), explicit)
    T, H, F = 8, 64, 32

    def f(x, residual, w1, w2, weight):
        def body(x, w1, w2):
            return lax.psum(jnp.tanh(x @ w1[0]) @ w2[0], "expert")
        hidden = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("expert"), P("expert")),
                               out_specs=P("data"))(x, w1, w2)
        return upcast_add_norm(hidden, residual, weight)

    dt = jnp.bfloat16
    sh = NamedSharding(mesh, P("data"))
    x, residual = (jax.device_put(data(rng, (T, H), dt), sh) for _ in range(2))
    w1 = jax.device_put(data(rng, (4, H, F), dt, 0.2), NamedSharding(mesh, P("expert")))
    w2 = jax.device_put(data(rng, (4, F, H), dt, 0.2), NamedSharding(mesh, P("expert")))
    weight = data(rng, (H,), dt)
    with jax.set_mesh(mesh):
        _check_exit(f, (x, residual, w1, w2, weight), dt)


@pytest.mark.parametrize("explicit", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("T, pad", [(8, 2), (128, 0)])   # decode (padded) and prefill
def test_exit_sglang_jax_style(rng, explicit, dtype, T, pad):
    mesh = _mesh(("data", "expert"), (2, 4), explicit)
    H, F = 64, 32
    f = sglang_model(mesh, T, H, pad)
    x = jax.device_put(data(rng, (T, H), dtype), NamedSharding(mesh, P("data")))
    residual = data(rng, (T - pad, H), dtype)
    if explicit:
        residual = jax.device_put(residual, NamedSharding(mesh, P("data")))
    w1 = jax.device_put(data(rng, (4, H, F), dtype, 0.2), NamedSharding(mesh, P("expert")))
    w2 = jax.device_put(data(rng, (4, F, H), dtype, 0.2), NamedSharding(mesh, P("expert")))
    scale = data(rng, (H,), jnp.float32)
    with jax.set_mesh(mesh):
        _check_exit(f, (x, residual, w1, w2, scale), dtype,
                    grad_argnums=(0, 1, 4) if T == 8 and dtype == jnp.float32 else None)


def test_exit_with_convert_before_the_add_stays_plain(rng):
    """A convert between the shard_map's output and the add is refused (the sum would be
    rounded in another type): the program is jax.jit's, the psum a plain all_reduce."""
    mesh = _mesh(("z", "y"), (2, 4), False)

    def f(x, res, w):
        out = jax.shard_map(lambda v: lax.psum(v, ("z", "y")), mesh=mesh, in_specs=P(),
                            out_specs=P())(x)
        h = out.astype(jnp.float32) + res
        return h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + EPS) * w

    x = data(rng, (4, 64), jnp.bfloat16)
    res, w = data(rng, (4, 64), jnp.float32), data(rng, (64,), jnp.float32)
    with jax.set_mesh(mesh):
        j = nvc.jit(f)
        assert targets(j.lower(x, res, w).as_text()) == {"nvc_all_reduce": 1}
        np.testing.assert_array_equal(np.asarray(j(x, res, w)),
                                      np.asarray(jax.jit(f)(x, res, w)))


def test_exit_with_the_hidden_dim_sharded_stays_plain(rng):
    """An out_spec sharding the hidden dim (the body holds part of each row; the norm outside
    is over all of it): refused, the results jax.jit's."""
    mesh = _mesh(("z", "y"), (2, 4), False)

    def f(x, res, w):
        out = jax.shard_map(lambda v: lax.psum(v, "z"), mesh=mesh, in_specs=P(None, "y"),
                            out_specs=P(None, "y"))(x)
        h = out + res
        return h * lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + EPS) * w, h

    x, res = data(rng, (4, 64), jnp.float32), data(rng, (4, 64), jnp.float32)
    w = data(rng, (64,), jnp.float32)
    with jax.set_mesh(mesh):
        j = nvc.jit(f)
        assert "nvc_all_reduce_rms" not in targets(j.lower(x, res, w).as_text())
        for a, b in zip(j(x, res, w), jax.jit(f)(x, res, w)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_exit_near_miss_names_the_step(rng, monkeypatch):
    """A norm after the exit that does not match: the shard_map runs as it was (bitwise jax.jit's
    result), its psum's row names the step, warned once."""
    monkeypatch.setattr(_warn, "quiet", lambda: False)
    rewrite.reset_warnings()
    mesh = _mesh(("z", "y"), (2, 4), False)

    def f(x, res, w):
        out = jax.shard_map(lambda v: lax.psum(v, ("z", "y")), mesh=mesh, in_specs=P(),
                            out_specs=P())(x)
        h = out.reshape(2, 2, 64) + res
        return h * lax.rsqrt(jnp.sum(h * h, -1, keepdims=True) / 32 + EPS) * w, h

    x = data(rng, (4, 64), jnp.float32)
    res, w = data(rng, (2, 2, 64), jnp.float32), data(rng, (64,), jnp.float32)
    step = "the mean of squares: the sum of squares is not divided by the hidden size 64"
    with jax.set_mesh(mesh), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (row,) = nvc.explain(f, x, res, w).rows
        j = nvc.jit(f)
        got, want = j(x, res, w), jax.jit(f)(x, res, w)
        assert targets(j.lower(x, res, w).as_text()) == {"nvc_all_reduce": 1}
    assert f"not fused with the add + RMSNorm after it: {step} at test_jit_norm_forms.py:" in \
        row["reason"], row["reason"]
    assert row["became"].startswith("all_reduce (") and row["fixable"]
    assert len([c for c in caught if step in str(c.message)]) == 1
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
