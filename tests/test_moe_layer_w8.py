"""nvc.moe_layer with 8-bit experts (int8 / float8_e4m3fn weights, with per-channel, per-block
or no scales) on 8 CPU devices (host backend) or, with JAX_NVCOMM_TEST_GPU=1, the GPUs of the
process (world 1 on one GPU; shapes within the CUDA kernel's contract: H and F multiples of 16):
the layer's products are the 8-bit-weight custom calls and the output equals a float64 numpy
reference of the dequantised weights within the error its documented roundings allow
(`layer_bound`); F off the CUDA contract: lax's path with the warning on a GPU, ours on the
host; bad scale arguments are refused by name."""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from conftest import make_mesh
from helpers import np_moe_layer_reference
from w8_bounds import ours, rounded, sum_bound, swiglu_bound


def f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def quantised(rng, kind, shape, mode):
    """(8-bit weights, scale or None, the float64 weights they stand for)."""
    E, K, N = shape
    if kind == "int8":
        w = jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        unit = 1.0 / (127 * np.sqrt(K))
    else:
        w = jnp.asarray(rng.standard_normal(shape) * 16, jnp.float8_e4m3fn)
        unit = 1.0 / (16 * np.sqrt(K))
    sshape = {0: None, 1: (E, N), 2: (E, -(-K // 128), -(-N // 128))}[mode]
    if sshape is None:
        return w, None, f64(w)
    s = jnp.asarray(rng.uniform(0.5, 2.0, sshape) * unit, jnp.float32)
    if mode == 1:
        return w, s, f64(w) * f64(s)[:, None, :]
    full = np.repeat(np.repeat(f64(s), 128, 1), 128, 2)[:, :K, :N]
    return w, s, f64(w) * full


def layer_bound(x, ids, w, rg, ru, rdn, dtype):
    """Per element, the error the layer's roundings (jax_nvcomm/moe_experts.py "Rounding")
    allow against the float64 layer: gate and up float32 sums of H terms, the SwiGLU in float32
    rounded to x's dtype, the down product's float32 sum of F terms on that rounded input, each
    expert's row rounded to x's dtype, the top-k rows times their float32 weights summed in
    float32 and rounded to x's dtype (w8_bounds: the sums' rounding on this platform)."""
    xs = f64(x)
    H, F = rg.shape[1], rg.shape[2]
    err = np.zeros_like(xs)
    for r in range(xs.shape[0]):
        acc, acc_err, acc_mag = 0.0, 0.0, 0.0
        for k, e in enumerate(ids[r]):
            ax = np.abs(xs[r])
            a, b = xs[r] @ rg[e], xs[r] @ ru[e]
            h = a / (1 + np.exp(-a)) * b
            eh = rounded(swiglu_bound(a, b, sum_bound(ax @ np.abs(rg[e]), H),
                                      sum_bound(ax @ np.abs(ru[e]), H)), h, dtype)
            y = h @ rdn[e]
            ey = rounded(eh @ np.abs(rdn[e]) + sum_bound((np.abs(h) + eh) @ np.abs(rdn[e]), F),
                         y, dtype)
            acc = acc + w[r, k] * y
            acc_err = acc_err + abs(w[r, k]) * ey
            acc_mag = acc_mag + abs(w[r, k]) * (np.abs(y) + ey)
        err[r] = rounded(acc_err + sum_bound(acc_mag, len(ids[r])), acc, dtype)
    return err


def within(got, ref, err):
    d = np.abs(f64(got) - ref)
    bad = np.argwhere(~(d <= err))
    assert bad.size == 0, (f"{len(bad)} outside the bound, first {bad[0].tolist()}: got "
                           f"{f64(got)[tuple(bad[0])]}, want {ref[tuple(bad[0])]}, bound "
                           f"{err[tuple(bad[0])]}")


def run(moe, x, ids, w, weights, scales, world):
    def f(x, ids, w, wg, wu, wd, sg, su, sd):
        return nvc.moe_layer(x, ids, w, wg, wu, wd, moe, w_gate_scale=sg, w_up_scale=su,
                             w_down_scale=sd)

    spec = P("x")
    sspec = tuple(None if s is None else spec for s in scales)
    fn = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(spec,) * 6 + sspec,
                               out_specs=spec))
    return fn, (x, ids, w, *weights, *scales)


@pytest.mark.parametrize("world", [1, 8])
@pytest.mark.parametrize("kind,mode", [("int8", 1), ("fp8", 2), ("int8", 0)])
def test_layer_against_float64(rng, world, kind, mode):
    E, K, T, H, F = 2 * world, 2, 6, 256, 144
    mesh = make_mesh((world,), ("x",))
    moe = nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                              dtype=jnp.bfloat16)
    try:
        x = jnp.asarray(rng.standard_normal((world * T, H)), jnp.bfloat16)
        wg, sg, rg = quantised(rng, kind, (E, H, F), mode)
        wu, su, ru = quantised(rng, kind, (E, H, F), mode)
        wd, sd, rdn = quantised(rng, kind, (E, F, H), mode)
        if mode == 0:  # no scales: keep the products ~1
            x = (x.astype(jnp.float32) / (127 * 16 if kind == "int8" else 64)).astype(
                jnp.bfloat16)
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(world * T)]
                       ).astype(np.int32)
        w = rng.random((world * T, K)).astype(np.float32)
        fn, args = run(moe, x, ids, w, (wg, wu, wd), (sg, su, sd), world)
        text = fn.lower(*args).as_text()
        assert {"ragged_dot_swiglu_w8", "ragged_dot_w8"} <= set(ours(text)), ours(text)
        y = fn(*args)
        assert y.dtype == jnp.bfloat16 and y.shape == (world * T, H)
        nt = np.full((world,), T)
        ref = np_moe_layer_reference(f64(x), ids, w, nt, rg, ru, rdn, world)
        within(y, ref, layer_bound(x, ids, w, rg, ru, rdn, jnp.bfloat16))
    finally:
        moe.close()


def test_layer_off_the_cuda_contract(rng, monkeypatch):
    """F = 136 (a multiple of 8, not of 16): on a GPU the layer's expert products take lax's
    path (no 8-bit-weight custom call), each with the fallback warning naming the CUDA
    kernel's contract; on CPU devices the host backend takes them (no warning). Both within
    the layer's bound of the float64 layer."""
    from jax_nvcomm import _warn
    from w8_bounds import ON_GPU
    world, E, K, T, H, F = 1, 2, 2, 6, 256, 136
    mesh = make_mesh((world,), ("x",))
    moe = nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                              dtype=jnp.bfloat16)
    try:
        x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
        wg, sg, rg = quantised(rng, "int8", (E, H, F), 1)
        wu, su, ru = quantised(rng, "int8", (E, H, F), 1)
        wd, sd, rdn = quantised(rng, "int8", (E, F, H), 1)
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
        w = rng.random((T, K)).astype(np.float32)
        fn, args = run(moe, x, ids, w, (wg, wu, wd), (sg, su, sd), world)
        if ON_GPU:
            monkeypatch.delenv("JAX_NVCOMM_QUIET", raising=False)
            _warn.reset()
            with pytest.warns(UserWarning) as rec:
                text = fn.lower(*args).as_text()
            why = [str(r.message) for r in rec if "takes lax.ragged_dot on cuda" in
                   str(r.message)]
            assert any(f"x [2, {H}, {F}] bfloat16 x int8 -> bfloat16 takes lax.ragged_dot on "
                       f"cuda: K {H} or N {F} not a multiple of 16" in m for m in why), why
            assert any(f"x [2, {F}, {H}] bfloat16 x int8 -> bfloat16 takes lax.ragged_dot on "
                       f"cuda: K {F} or N {H} not a multiple of 16" in m for m in why), why
            assert not [t for t in ours(text) if "ragged_dot" in t], ours(text)
            y = fn(*args)
        else:
            text = fn.lower(*args).as_text()
            assert {"ragged_dot_swiglu_w8", "ragged_dot_w8"} <= set(ours(text)), ours(text)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                y = fn(*args)
        ref = np_moe_layer_reference(f64(x), ids, w, np.full((world,), T), rg, ru, rdn, world)
        within(y, ref, layer_bound(x, ids, w, rg, ru, rdn, jnp.bfloat16))
    finally:
        moe.close()


def test_bad_scales(rng):
    mesh = make_mesh((1,), ("x",))
    E, K, T, H, F = 2, 2, 4, 128, 64
    moe = nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                              dtype=jnp.bfloat16)
    try:
        x = jnp.zeros((T, H), jnp.bfloat16)
        ids = jnp.zeros((T, K), jnp.int32).at[:, 1].set(1)
        w = jnp.zeros((T, K), jnp.float32)
        wg = wu = jnp.zeros((E, H, F), jnp.int8)
        wd = jnp.zeros((E, F, H), jnp.int8)

        def call(_w=(wg, wu, wd), **kw):
            return jax.jit(jax.shard_map(lambda *a: nvc.moe_layer(*a, moe, **kw), mesh=mesh,
                                         in_specs=(P("x"),) * 6, out_specs=P("x")))(
                x, ids, w, *_w)

        with pytest.raises(ValueError, match=re.escape(
                "moe_layer: w_down_scale: expected [G, N] = [2, 128] or")):
            call(w_down_scale=jnp.ones((2, 64)))
        with pytest.raises(ValueError, match="w_gate_scale, w_up_scale: expected both or "
                                             "neither"):
            call(w_gate_scale=jnp.ones((2, 64)))
        with pytest.raises(TypeError, match="w_down must have w_gate's 8-bit dtype int8, got "
                                            "float8_e4m3fn"):
            call(_w=(wg, wu, wd.astype(jnp.float8_e4m3fn)))
        with pytest.raises(TypeError, match="w_gate_scale: expected None for weights of dtype "
                                            "bfloat16"):
            call(_w=tuple(a.astype(jnp.bfloat16) for a in (wg, wu, wd)),
                 w_gate_scale=jnp.ones((2, 64)), w_up_scale=jnp.ones((2, 64)))
    finally:
        moe.close()


def test_xla_fallback_communicator(rng, monkeypatch):
    """A communicator across two (fake) hosts takes XLA's exchange: the 8-bit experts run on
    the padded layout (expert_block) with their scales, still equal to the reference."""
    from jax_nvcomm import topology

    def gather(prefix, groups, backend, timeout_s):
        facts = [topology.RankFacts(g, r, 0, f"node{int(groups[g, r].id) % 2}")
                 for g in range(groups.shape[0]) for r in range(groups.shape[1])]
        return facts, {}

    monkeypatch.setattr(topology, "gather", gather)
    world, K, T, H, F = 4, 2, 4, 128, 64
    E = 2 * world
    moe = nvc.MoECommunicator(make_mesh((world,), ("x",)), "x", num_experts=E, top_k=K,
                              max_tokens=T, hidden=H, dtype=jnp.bfloat16)
    try:
        assert moe.xla_fallback
        x = jnp.asarray(rng.standard_normal((world * T, H)), jnp.bfloat16)
        wg, sg, rg = quantised(rng, "int8", (E, H, F), 1)
        wu, su, ru = quantised(rng, "int8", (E, H, F), 1)
        wd, sd, rdn = quantised(rng, "int8", (E, F, H), 1)
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(world * T)]
                       ).astype(np.int32)
        w = rng.random((world * T, K)).astype(np.float32)
        fn, args = run(moe, x, ids, w, (wg, wu, wd), (sg, su, sd), world)
        ref = np_moe_layer_reference(f64(x), ids, w, np.full((world,), T), rg, ru, rdn, world)
        within(fn(*args), ref, layer_bound(x, ids, w, rg, ru, rdn, jnp.bfloat16))
    finally:
        moe.close()
