"""nvc.jit on the 8-bit-weight forms of lax.ragged_dot (8 CPU devices, host backend; with
JAX_NVCOMM_TEST_GPU=1 the GPUs of the process, up to 8, and the CUDA kernel): an MoE
block written as quantized public MoE code writes it (int8 experts with a per-channel scale
gathered per row and multiplied after `lax.ragged_dot(x, w_int8, sizes)`; FP8 experts
dequantised before the product) under nvc.jit: its products become the 8-bit-weight custom
calls, each listed by `nvc.explain`; one product equals jax.jit's within float32 rounding of
its sum (int8: the same arithmetic), the whole block within the bf16 roundings that a flipped
last bit carries through it (most outputs bitwise equal), and the dequantised form within one
bf16 rounding of the weights (the kernel keeps w * s in float32); forms that are not matched
stay lax's; a product off the CUDA kernel's contract (N not a multiple of 16) stays lax's on a
GPU with the warning at the program's line and is ours on the host."""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
import w8_bounds

W = min(8, len(jax.devices()))   # devices of the mesh; H and F within the CUDA contract
T, TOPK, E_LOCAL, H, F = 6, 2, 2, 128, 64


def ours(f, *args):
    """Our custom calls in f's lowered program, by op name (w8_bounds.ours)."""
    return w8_bounds.ours(f.lower(*args).as_text())


def mesh8():
    return jax.sharding.Mesh(np.array(jax.devices()[:W]), ("ep",))


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


def block_reference(x, idx, wg, sg, wu, su, wd, sd):
    """float64 of both block forms (y[t] = sum_k silu(x Wg) * (x Wu)) Wd, W = float(q) * s of
    token t's k-th local expert) and a bound of the error of a bfloat16 program of it
    (w8_bounds): each product's float32 sum, the weights' rounding to bf16 (the dequantised
    form), two bf16 roundings after the sum (the product's result, its scale), silu and the
    SwiGLU product in bf16 (four roundings), the top-k sum rounded once. A worst case: every
    rounding's error carried through the next product with all signs aligned."""
    u = w8_bounds.unit(jnp.bfloat16)
    rnd = lambda e, v: w8_bounds.rounded(w8_bounds.rounded(e, v, jnp.bfloat16), v,  # noqa
                                         jnp.bfloat16)
    xs, ids = f32(x).astype(np.float64), np.asarray(idx)
    deq = [f32(q).astype(np.float64) * f32(s).astype(np.float64)[:, None, :]
           for q, s in ((wg, sg), (wu, su), (wd, sd))]

    def gmm(a, ea, w):
        z, mag = a @ w, (np.abs(a) + ea) @ np.abs(w)
        return z, rnd(ea @ np.abs(w) + w8_bounds.sum_bound(mag, w.shape[0]) + u * mag, z)

    ref, err = np.zeros_like(xs), np.zeros_like(xs)
    for t in range(xs.shape[0]):
        base = (t // T) * E_LOCAL   # the device's first expert
        for e in ids[t]:
            zero = np.zeros_like(xs[t])
            g, eg = gmm(xs[t], zero, deq[0][base + e])
            v, ev = gmm(xs[t], zero, deq[1][base + e])
            sg_ = g / (1 + np.exp(-g))
            h = sg_ * v
            eh = 1.1 * eg * (np.abs(v) + ev) + np.abs(sg_) * ev + 4 * u * np.abs(h)
            y, ey = gmm(h, eh, deq[2][base + e])
            ref[t] += y
            err[t] += ey
        err[t] = w8_bounds.rounded(err[t], ref[t], jnp.bfloat16)
    return ref, err


def within(got, ref, err, what):
    d = np.abs(np.asarray(got, np.float64) - ref)
    bad = np.argwhere(~(d <= err))
    assert bad.size == 0, (f"{what}: {len(bad)} outside the bound, first {bad[0].tolist()}: "
                           f"got {got[tuple(bad[0])]}, want {ref[tuple(bad[0])]}, bound "
                           f"{err[tuple(bad[0])]}")


def no_worse(got, want, ref, what):
    """The worst-case bound of block_reference is loose (bf16 roundings carried through two
    products of random signs); this one is not: nvc.jit's rms error against float64 at most
    twice jax.jit's own (the same roundings, or fewer, in another float32 order)."""
    rms = lambda a: float(np.sqrt(np.mean((np.asarray(a, np.float64) - ref) ** 2)))  # noqa
    assert rms(got) <= 2 * rms(want), (what, rms(got), rms(want))


def no_warning(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args)


def test_int8_then_scale_form(rng):
    args = inputs(rng, "int8")
    f = sharded(moe_block_int8)
    j = nvc.jit(f)
    assert ours(j, *args) == ["ragged_dot_w8"] * 3
    assert ours(jax.jit(f), *args) == []
    got, want = f32(no_warning(j, *args)), f32(jax.jit(f)(*args))
    # the same arithmetic (int8 -> bf16 exact, float32 sums, one rounding per product): both
    # within the bf16 program's bound of float64; the float32 summation order may flip a bf16
    # rounding, which the next products carry on, but most outputs are bitwise the same
    ref, err = block_reference(*args)
    within(got, ref, err, "nvc.jit against float64")
    within(want, ref, err, "jax.jit against float64")
    no_worse(got, want, ref, "int8 form")
    assert np.mean(got == want) > 0.5
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
    assert ours(j, x, q, sizes) == ["ragged_dot_w8"]
    got, want = np.asarray(no_warning(j, x, q, sizes)), np.asarray(jax.jit(f)(x, q, sizes))
    # both sum exact float32 products in float32: they differ by the order of the sums only,
    # each within the sum's rounding of the exact product
    xf, qf = np.asarray(x, np.float64), np.asarray(q, np.float64)
    mag = np.zeros((W * 12, F))
    for d in range(W):
        for r0, r1, e in ((0, 4, 0), (4, 11, 2)):
            rows = slice(d * 12 + r0, d * 12 + r1)
            mag[rows] = np.abs(xf[rows]) @ np.abs(qf[d * 3 + e])
    assert np.all(np.abs(got.astype(np.float64) - want) <= 2 * w8_bounds.sum_bound(mag, H))
    assert not np.any(got.reshape(W, 12, F)[:, 11:])   # the row past the groups


def test_dequantise_then_ragged_dot_form(rng):
    for kind in ("int8", "fp8"):
        args = inputs(rng, kind)
        f = sharded(moe_block_dequant)
        j = nvc.jit(f)
        assert ours(j, *args) == ["ragged_dot_w8"] * 3
        got, want = f32(no_warning(j, *args)), f32(jax.jit(f)(*args))
        # jax.jit rounds w * s to bf16 before the product; the kernel keeps it in float32:
        # both within the bf16 program's bound of float64
        ref, err = block_reference(*args)
        within(got, ref, err, f"{kind}: nvc.jit against float64")
        within(want, ref, err, f"{kind}: jax.jit against float64")
        no_worse(got, want, ref, f"{kind} dequantised form")
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
    assert ours(j, x, q, s, sizes) == ["ragged_dot_w8"]
    got = np.asarray(j(x, q, s, sizes), np.float64)
    xf, wf = np.asarray(x, np.float64), np.asarray(q, np.float64) * np.asarray(s)[:, None, :]
    for d in range(W):
        ref = np.zeros((16, F))
        ref[:5] = xf[d * 16:d * 16 + 5] @ wf[d * 3]
        ref[5:14] = xf[d * 16 + 5:d * 16 + 14] @ wf[d * 3 + 2]
        mag = np.abs(xf[d * 16:(d + 1) * 16]) @ np.abs(wf[d * 3:(d + 1) * 3]).max(0)
        assert np.all(np.abs(got[d * 16:(d + 1) * 16] - ref) <= w8_bounds.sum_bound(mag, H))


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

    def reference(body):
        """float64 of the program on its bf16 weights (the weights as jax computes them), and
        the bound of its bf16 roundings: the product's float32 sum rounded once, the added
        weight row's sum rounded once, the add rounded once."""
        xf = np.asarray(x, np.float64)
        ref, err = np.zeros((W * 8, F)), np.zeros((W * 8, F))
        for d in range(W):
            qd, sd = q[d * 2:(d + 1) * 2], s[d * 2:(d + 1) * 2]
            if body is used_twice:
                w = f32(qd.astype(jnp.bfloat16) * sd[:, None, :]).astype(np.float64)
                c = w[:, 0, :].sum(0)
            else:
                w = f32(qd.astype(jnp.bfloat16) * sd[:, :1, None]).astype(np.float64)
                c = np.zeros(F)
            for r0, r1, e in ((0, 3, 0), (3, 7, 1)):
                rows = slice(d * 8 + r0, d * 8 + r1)
                ref[rows] = xf[rows] @ w[e]
                err[rows] = w8_bounds.rounded(
                    w8_bounds.sum_bound(np.abs(xf[rows]) @ np.abs(w[e]), H), ref[rows],
                    jnp.bfloat16)
            rows = slice(d * 8, (d + 1) * 8)
            err[rows] += 2 * w8_bounds.unit(jnp.bfloat16) * np.abs(c)
            ref[rows] += c
            err[rows] = w8_bounds.rounded(err[rows], ref[rows], jnp.bfloat16)
        return ref, err

    for body in (used_twice, other_scale):
        f = jax.shard_map(body, mesh=mesh8(), in_specs=(P("ep"),) * 4, out_specs=P("ep"))
        j = nvc.jit(f)
        assert ours(j, x, q, s, sizes) == ["ragged_dot"], body.__name__
        ref, err = reference(body)
        within(f32(j(x, q, s, sizes)), ref, err, f"{body.__name__}: nvc.jit")
        within(f32(jax.jit(f)(x, q, s, sizes)), ref, err, f"{body.__name__}: jax.jit")


def test_product_off_the_cuda_contract(rng, monkeypatch):
    """lax.ragged_dot(x, w_int8, sizes) with N = 136 (not a multiple of 16, the CUDA kernel's
    8-bit contract; any N on the host): on a GPU the program's own product (no custom call)
    with the warning at the program's line naming the reason; on CPU devices ours, listed by
    explain. Both equal the float64 product within the float32 sum's rounding."""
    n = 136
    x = jnp.asarray(rng.standard_normal((W * 8, H)), jnp.bfloat16)
    q = jnp.asarray(rng.integers(-127, 128, (W * 2, H, n)), jnp.int8)
    sizes = jnp.asarray(np.tile([3, 4], W), jnp.int32)

    def body(x, q, sizes):
        return lax.ragged_dot(x, q, sizes, preferred_element_type=jnp.float32)

    f = jax.shard_map(body, mesh=mesh8(), in_specs=(P("ep"),) * 3, out_specs=P("ep"))
    j = nvc.jit(f)
    if w8_bounds.ON_GPU:
        monkeypatch.delenv("JAX_NVCOMM_QUIET", raising=False)
        with pytest.warns(UserWarning, match=re.escape(
                f"jax_nvcomm.jit: ragged_dot [8, {H}] x [2, {H}, {n}] bfloat16 x int8 -> "
                f"float32 takes lax.ragged_dot on cuda: K {H} or N {n} not a multiple of "
                "16")) as rec:
            assert ours(j, x, q, sizes) == []
        assert rec[0].filename.endswith("test_jit_ragged_dot_w8.py"), rec[0].filename
        got = j(x, q, sizes)
    else:
        assert ours(j, x, q, sizes) == ["ragged_dot_w8"]
        got = no_warning(j, x, q, sizes)
        mine = [r for r in nvc.explain(j, x, q, sizes).rows if r["op"] == "ragged_dot"]
        assert [r["became"] for r in mine] == ["ragged_dot_w8 (int8, no scale)"], mine
    xf, qf = np.asarray(x, np.float64), np.asarray(q, np.float64)
    ref, mag = np.zeros((W * 8, n)), np.zeros((W * 8, n))
    for d in range(W):
        for r0, r1, e in ((0, 3, 0), (3, 7, 1)):
            rows = slice(d * 8 + r0, d * 8 + r1)
            ref[rows] = xf[rows] @ qf[d * 2 + e]
            mag[rows] = np.abs(xf[rows]) @ np.abs(qf[d * 2 + e])
    within(np.asarray(got), ref, w8_bounds.sum_bound(mag, H), "against float64")
