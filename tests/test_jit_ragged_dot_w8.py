"""nvc.jit on the 8-bit-weight forms of lax.ragged_dot (8 CPU devices, host backend): an MoE
block written as quantized public MoE code writes it (int8 experts with a per-channel scale
gathered per row and multiplied after `lax.ragged_dot(x, w_int8, sizes)`; FP8 experts
dequantised before the product) under nvc.jit: its products become the 8-bit-weight custom
calls, each listed by `nvc.explain`; one product equals jax.jit's within float32 rounding of
its sum (int8: the same arithmetic), the whole block within the bf16 roundings that a flipped
last bit carries through it (most outputs bitwise equal), and the dequantised form within one
bf16 rounding of the weights (the kernel keeps w * s in float32); forms that are not matched
stay lax's."""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc

OUR = re.compile(r"custom_call @(nvc_\w+)")
W, T, TOPK, E_LOCAL, H, F = 8, 6, 2, 2, 128, 64


def ours(f, *args):
    return OUR.findall(f.lower(*args).as_text())


def mesh8():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("ep",))


def f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


def quant_params(rng, kind):
    """Per device (stacked): gate, up [E_LOCAL, H, F], down [E_LOCAL, F, H] 8-bit, and a bf16
    per-output-channel scale of each."""
    def one(k, n):
        if kind == "int8":
            q = jnp.asarray(rng.integers(-127, 128, (W * E_LOCAL, k, n)), jnp.int8)
        else:
            q = jnp.asarray(rng.standard_normal((W * E_LOCAL, k, n)) * 8, jnp.float8_e4m3fn)
        s = jnp.asarray(rng.uniform(0.5, 2, (W * E_LOCAL, n)) / (100 * np.sqrt(k)),
                        jnp.bfloat16)
        return q, s
    return one(H, F) + one(H, F) + one(F, H)


def _sorted_rows(x, topk_idx):
    """Each token repeated top-k times, sorted by its local expert (the dispatch of a one-device
    MoE block): rows, expert per row, group sizes."""
    flat = topk_idx.reshape(-1)
    order = jnp.argsort(flat)
    rows = jnp.repeat(x, TOPK, axis=0)[order]
    sizes = jnp.bincount(flat, length=E_LOCAL).astype(jnp.int32)
    return rows, flat[order], sizes, order


def moe_block_int8(x, topk_idx, wg, sg, wu, su, wd, sd):
    """int8 experts as quantized MoE code writes them: lax.ragged_dot on the int8 weights,
    then the per-channel scale gathered by each row's expert id."""
    rows, expert, sizes, order = _sorted_rows(x, topk_idx)

    def gmm(lhs, q, s):
        scale = jnp.take_along_axis(s, expert[:, None], axis=-2)
        return (lax.ragged_dot(lhs, q, sizes) * scale).astype(jnp.bfloat16)

    h = jax.nn.silu(gmm(rows, wg, sg)) * gmm(rows, wu, su)
    out = gmm(h, wd, sd)
    return jnp.zeros_like(out).at[order].set(out).reshape(x.shape[0], TOPK, H).sum(1)


def moe_block_dequant(x, topk_idx, wg, sg, wu, su, wd, sd):
    """8-bit experts dequantised to bf16 before the product (the weights feed nothing else)."""
    rows, _, sizes, order = _sorted_rows(x, topk_idx)

    def gmm(lhs, q, s):
        return lax.ragged_dot(lhs, q.astype(jnp.bfloat16) * s[:, None, :], sizes)

    h = jax.nn.silu(gmm(rows, wg, sg)) * gmm(rows, wu, su)
    out = gmm(h, wd, sd)
    return jnp.zeros_like(out).at[order].set(out).reshape(x.shape[0], TOPK, H).sum(1)


def sharded(block):
    return jax.shard_map(block, mesh=mesh8(), in_specs=(P("ep"),) * 8, out_specs=P("ep"))


def inputs(rng, kind):
    x = jnp.asarray(rng.standard_normal((W * T, H)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([rng.choice(E_LOCAL, TOPK, replace=False)
                                for _ in range(W * T)]), jnp.int32)
    return (x, idx) + quant_params(rng, kind)


def no_warning(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args)


def test_int8_then_scale_form(rng):
    args = inputs(rng, "int8")
    f = sharded(moe_block_int8)
    j = nvc.jit(f)
    assert ours(j, *args) == ["nvc_ragged_dot_w8"] * 3
    assert ours(jax.jit(f), *args) == []
    got, want = f32(no_warning(j, *args)), f32(jax.jit(f)(*args))
    # the same arithmetic (int8 -> bf16 exact, float32 sums, one rounding per product): the
    # float32 summation order may flip a bf16 rounding, which the next products carry on
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * scale)
    assert np.mean(got == want) > 0.5   # most outputs bitwise the same
    rows = nvc.explain(j, *args).rows
    mine = [r for r in rows if r["op"] == "ragged_dot"]
    assert len(mine) == 3, rows
    for r in mine:
        assert r["became"] == "ragged_dot_w8 (int8, no scale)"
        assert r["dtype"] == "bfloat16 x int8"
        assert r["source"].startswith("test_jit_ragged_dot_w8.py:")


def test_one_int8_product_as_jax_jit(rng):
    x = jnp.asarray(rng.standard_normal((W * 12, H)), jnp.bfloat16)
    q = jnp.asarray(rng.integers(-127, 128, (W * 3, H, F)), jnp.int8)
    sizes = jnp.asarray(np.tile([4, 0, 7], W), jnp.int32)
    f = jax.shard_map(lambda a, b, c: lax.ragged_dot(a, b, c, preferred_element_type=jnp.float32),
                      mesh=mesh8(), in_specs=(P("ep"),) * 3, out_specs=P("ep"))
    j = nvc.jit(f)
    assert ours(j, x, q, sizes) == ["nvc_ragged_dot_w8"]
    got, want = np.asarray(no_warning(j, x, q, sizes)), np.asarray(jax.jit(f)(x, q, sizes))
    # both sum exact float32 products in float32: they differ by the order of the sums only
    mag = np.abs(np.asarray(x, np.float64)).max() * 127 * H
    assert np.all(np.abs(got.astype(np.float64) - want) <= mag * H * 2.0 ** -24)
    assert not np.any(got.reshape(W, 12, F)[:, 11:])   # the row past the groups


def test_dequantise_then_ragged_dot_form(rng):
    for kind in ("int8", "fp8"):
        args = inputs(rng, kind)
        f = sharded(moe_block_dequant)
        j = nvc.jit(f)
        assert ours(j, *args) == ["nvc_ragged_dot_w8"] * 3
        got, want = f32(no_warning(j, *args)), f32(jax.jit(f)(*args))
        # jax.jit rounds w * s to bf16 before the product; the kernel keeps it in float32
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2 * scale)
        mine = [r for r in nvc.explain(j, *args).rows if r["op"] == "ragged_dot"]
        assert [r["became"] for r in mine] == [
            f"ragged_dot_w8 ({jnp.dtype(args[2].dtype).name}, per-channel scale)"] * 3


def test_float64_reference_of_the_dequantised_form(rng):
    """One product alone (no bf16 rounding between layers): within float32 rounding of the
    float64 product of x and w * s."""
    x = jnp.asarray(rng.standard_normal((W * 16, H)), jnp.bfloat16)
    q = jnp.asarray(rng.integers(-127, 128, (W * 3, H, F)), jnp.int8)
    s = jnp.asarray(rng.uniform(0.5, 2, (W * 3, F)), jnp.float32)
    sizes = jnp.asarray(np.tile([5, 0, 9], W), jnp.int32)

    def body(x, q, s, sizes):   # dequantised in float32, then converted for the product
        return lax.ragged_dot(x, (q.astype(jnp.float32) * s[:, None, :]).astype(jnp.bfloat16),
                              sizes, preferred_element_type=jnp.float32)

    f = jax.shard_map(body, mesh=mesh8(), in_specs=(P("ep"),) * 4, out_specs=P("ep"))
    j = nvc.jit(f)
    assert ours(j, x, q, s, sizes) == ["nvc_ragged_dot_w8"]
    got = np.asarray(j(x, q, s, sizes), np.float64)
    xf, wf = np.asarray(x, np.float64), np.asarray(q, np.float64) * np.asarray(s)[:, None, :]
    for d in range(W):
        ref = np.zeros((16, F))
        ref[:5] = xf[d * 16:d * 16 + 5] @ wf[d * 3]
        ref[5:14] = xf[d * 16 + 5:d * 16 + 14] @ wf[d * 3 + 2]
        mag = np.abs(xf[d * 16:(d + 1) * 16]) @ np.abs(wf[d * 3:(d + 1) * 3]).max(0)
        assert np.all(np.abs(got[d * 16:(d + 1) * 16] - ref) <= mag * (H + 2) * 2.0 ** -24)


def test_unmatched_forms_stay_lax(rng):
    x = jnp.asarray(rng.standard_normal((W * 8, H)), jnp.bfloat16)
    q = jnp.asarray(rng.integers(-127, 128, (W * 2, H, F)), jnp.int8)
    s = jnp.asarray(rng.uniform(0.5, 2, (W * 2, F)), jnp.bfloat16)
    sizes = jnp.asarray(np.tile([3, 4], W), jnp.int32)

    def used_twice(x, q, s, sizes):
        w = q.astype(jnp.bfloat16) * s[:, None, :]   # the dequantised weight is used again
        return lax.ragged_dot(x, w, sizes) + jnp.sum(w[:, :1, :], axis=(0, 1))

    def other_scale(x, q, s, sizes):
        return lax.ragged_dot(x, q.astype(jnp.bfloat16) * s[:, :, None][:, :1, :1], sizes)

    for body in (used_twice, other_scale):
        f = jax.shard_map(body, mesh=mesh8(), in_specs=(P("ep"),) * 4, out_specs=P("ep"))
        j = nvc.jit(f)
        assert ours(j, x, q, s, sizes) == ["nvc_ragged_dot"], body.__name__
        np.testing.assert_allclose(f32(j(x, q, s, sizes)), f32(jax.jit(f)(x, q, s, sizes)),
                                   rtol=2e-2, atol=1e-2)
