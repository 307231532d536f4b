"""nvc.jit on lax.ragged_dot (8 CPU devices, the host backend): the MoE form becomes
nvc.ragged_dot where its rule picks the kernel (inside shard_map bodies, also in a scan body and
in a gradient program), stays lax's where the rule says XLA, outside shard_map on several
devices and for the transposed forms a gradient adds; results against a float64 reference and
against jax.jit of the same function; a fallback the caller can fix warns once at its line."""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm.jit import rewrite as _rewrite

OUR = re.compile(r"custom_call @(nvc_\w+)")


def ours(f, *args):
    return OUR.findall(f.lower(*args).as_text())


def mesh8():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]), ("ep",))


def np_ragged_dot(lhs, rhs, sizes):
    lhs = np.asarray(jnp.asarray(lhs, jnp.float32), np.float64)
    rhs = np.asarray(jnp.asarray(rhs, jnp.float32), np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, s in enumerate(np.asarray(sizes)):
        end = min(start + int(s), lhs.shape[0])
        out[start:end] = lhs[start:end] @ rhs[g]
        start = end
    return out


def data(seed, w, m, k, g, n, dtype, rdtype=None):
    """Per device: lhs [m, k], rhs [g, k, n], random sizes (empty groups, a tail of unrouted
    rows); stacked over w devices."""
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((w * m, k)).astype(np.float32)
    rhs = (rng.standard_normal((w * g, k, n)) / np.sqrt(k)).astype(np.float32)
    sizes = []
    for _ in range(w):
        cut = np.sort(rng.integers(0, m - 2, g - 1))  # the last 2+ rows belong to no group
        s = np.diff(np.concatenate([[0], cut, [m - 2 - rng.integers(0, 3)]]))
        s[rng.integers(0, g)] = 0
        sizes.append(np.maximum(s, 0))
    sizes = np.concatenate(sizes).astype(np.int32)
    return (jnp.asarray(lhs, dtype), jnp.asarray(rhs, rdtype or dtype), jnp.asarray(sizes))


def moe_fn(mesh, pet=None):
    def body(lhs, rhs, sizes):
        return lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=pet)
    return jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep")),
                         out_specs=P("ep"))


def reference(lhs, rhs, sizes, w):
    m, g = lhs.shape[0] // w, rhs.shape[0] // w
    return np.concatenate([np_ragged_dot(lhs[i * m:(i + 1) * m], rhs[i * g:(i + 1) * g],
                                         sizes[i * g:(i + 1) * g]) for i in range(w)])


@pytest.mark.parametrize("dtype,pet", [(jnp.bfloat16, None), (jnp.bfloat16, jnp.float32),
                                       (jnp.float32, None)])
def test_moe_form_becomes_ours(dtype, pet):
    mesh = mesh8()
    lhs, rhs, sizes = data(0, 8, 24, 64, 4, 48, dtype)
    f = moe_fn(mesh, pet)
    j = nvc.jit(f)
    assert ours(j, lhs, rhs, sizes) == ["nvc_ragged_dot"]
    assert ours(jax.jit(f), lhs, rhs, sizes) == []
    got = j(lhs, rhs, sizes)
    assert got.dtype == jax.jit(f)(lhs, rhs, sizes).dtype
    ref = reference(lhs, rhs, sizes, 8)
    g = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    eps = 1e-5 if got.dtype == jnp.float32 else float(jnp.finfo(got.dtype).eps)
    assert np.all(np.abs(g - ref) <= eps * np.abs(ref) + 1e-5 * (1 + np.abs(ref)))
    # the same as the op called by hand
    hand = jax.jit(jax.shard_map(
        lambda a, b, c: nvc.ragged_dot(a, b, c, preferred_element_type=pet), mesh=mesh,
        in_specs=(P("ep"), P("ep"), P("ep")), out_specs=P("ep")))
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(hand(lhs, rhs, sizes), np.float32))


def test_rule_says_xla_stays_lax():
    mesh = mesh8()
    lhs, rhs, sizes = data(1, 8, 160, 16, 2, 16, jnp.bfloat16)  # 80 rows per group > 64
    f = moe_fn(mesh)
    j = nvc.jit(f)
    assert ours(j, lhs, rhs, sizes) == []
    np.testing.assert_array_equal(np.asarray(j(lhs, rhs, sizes), np.float32),
                                  np.asarray(jax.jit(f)(lhs, rhs, sizes), np.float32))


def test_outside_shard_map_on_several_devices_stays_lax():
    lhs, rhs, sizes = data(2, 1, 24, 32, 4, 16, jnp.bfloat16)
    f = lambda a, b, c: lax.ragged_dot(a, b, c)  # noqa: E731
    assert ours(nvc.jit(f), lhs, rhs, sizes) == []
    np.testing.assert_array_equal(np.asarray(nvc.jit(f)(lhs, rhs, sizes), np.float32),
                                  np.asarray(jax.jit(f)(lhs, rhs, sizes), np.float32))


def test_scan_body_and_gradient():
    mesh = mesh8()
    lhs, rhs, sizes = data(3, 8, 16, 32, 4, 32, jnp.float32)
    tgt = jax.random.normal(jax.random.key(0), (8 * 16, 32), jnp.float32)

    def body(a, w, s):
        def step(h, _):
            return jnp.tanh(lax.ragged_dot(h, w, s)), None   # K == N: the layer repeats
        h, _ = lax.scan(step, a, None, length=2)
        return h

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep")), out_specs=P("ep"))
    j = nvc.jit(f)
    assert ours(j, lhs, rhs, sizes) == ["nvc_ragged_dot"]   # one call in the scan body
    np.testing.assert_allclose(np.asarray(j(lhs, rhs, sizes)),
                               np.asarray(jax.jit(f)(lhs, rhs, sizes)), rtol=1e-5, atol=1e-5)

    def loss(a, w, s):
        return jnp.mean(jnp.square(f(a, w, s) - tgt))

    grad = jax.grad(loss, argnums=(0, 1))
    jg = nvc.jit(grad)
    calls = ours(jg, lhs, rhs, sizes)
    assert calls and set(calls) == {"nvc_ragged_dot"}, calls   # the forward products
    want = jax.jit(grad)(lhs, rhs, sizes)
    for got in (jg(lhs, rhs, sizes), jax.grad(nvc.jit(loss), argnums=(0, 1))(lhs, rhs, sizes)):
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_fixable_fallback_warns_once_at_its_line(monkeypatch):
    monkeypatch.delenv("JAX_NVCOMM_QUIET", raising=False)
    _rewrite.reset_warnings()
    mesh = mesh8()
    lhs, rhs, sizes = data(4, 8, 24, 32, 4, 16, jnp.bfloat16, rdtype=jnp.float32)
    f = moe_fn(mesh)
    with pytest.warns(UserWarning, match=r"bfloat16 x float32 .* takes lax.ragged_dot on cpu: "
                                         r"operands bfloat16 x float32") as rec:
        got = nvc.jit(f)(lhs, rhs, sizes)
    assert any(w.filename.endswith("test_jit_ragged_dot.py") for w in rec)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(f)(lhs, rhs, sizes)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nvc.jit(moe_fn(mesh))(lhs, rhs, sizes)   # the same site: no second warning
        # the rows rule is no fault of the caller's: no warning
        a, b, c = data(5, 8, 160, 16, 2, 16, jnp.bfloat16)
        nvc.jit(moe_fn(mesh))(a, b, c)
    _rewrite.reset_warnings()
    monkeypatch.setenv("JAX_NVCOMM_QUIET", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nvc.jit(moe_fn(mesh))(lhs, rhs, sizes)


def test_one_device_program_outside_shard_map(monkeypatch):
    """A program of one device (world 1) needs no shard_map: its ragged_dot becomes ours."""
    monkeypatch.setattr(jax, "device_count", lambda *a: 1)
    lhs, rhs, sizes = data(6, 1, 24, 32, 4, 16, jnp.bfloat16)
    f = lambda a, b, c: lax.ragged_dot(a, b, c)  # noqa: E731
    j = nvc.jit(f)
    assert ours(j, lhs, rhs, sizes) == ["nvc_ragged_dot"]
    np.testing.assert_array_equal(np.asarray(j(lhs, rhs, sizes), np.float32),
                                  np.asarray(jax.jit(nvc.ragged_dot)(lhs, rhs, sizes), np.float32))
