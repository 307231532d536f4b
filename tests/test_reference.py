"""jax_nvcomm.reference (pure-JAX baselines) against float64 numpy oracles written from API.md's
definitions in the tests (tests/helpers.py: oracle_dispatch / oracle_combine, not the package's
np_moe_*), on 8 CPU devices (or the GPUs with JAX_NVCOMM_TEST_GPU=1): MoE dispatch/combine
(impl "ragged" and "dense"), all_reduce_rms_norm_xla.

On CPU impl "ragged" is an emulation of ragged_all_to_all built from lax.all_to_all (XLA:CPU
has no ragged_all_to_all); XLA's real op is compared with the same oracles by the GPU suite,
tests/gpu/test_gpu_ops.py::test_reference_ragged_on_gpu (`pytest -m gpu`), which also checks
that the compiled program holds a ragged-all-to-all."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_nvcomm import reference as ref
from helpers import f64, mesh1d, oracle_combine, oracle_dispatch, rel_err, rms_ref, run_sharded

if len(jax.devices()) < 2:
    pytest.skip("needs at least 2 devices", allow_module_level=True)

W = 8 if len(jax.devices()) >= 8 else 4 if len(jax.devices()) >= 4 else 2
IMPLS = ["ragged", "dense"]


def _routing(rng, T, K, E, *, neg_frac=0.0):
    """ids [W, T, K]: distinct experts per row, a fraction of slots -1."""
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                    for _ in range(W)]).astype(np.int32)
    if neg_frac:
        ids[rng.random(ids.shape) < neg_frac] = -1
    return ids


def _run(impl, x_all, ids_all, nt_all, w_all, ey_all, E, *, scale_all=None, check_vma=True,
         pieces=None):
    T, K = ids_all.shape[1:]
    L = E // W
    mesh = mesh1d(W)

    def f(x, ids, nt, w, ey, *sc):
        ex, cnt, exs, h = ref.moe_dispatch_xla(x, ids, axis_name="x", num_experts=E,
                                               num_tokens=nt, x_scale=sc[0] if sc else None,
                                               impl=impl, ragged_pieces=pieces)
        y = ref.moe_combine_xla(ey, w, h, axis_name="x", num_experts=E, impl=impl,
                                ragged_pieces=pieces)
        return (ex, cnt, y) + ((exs,) if sc else ())

    args = [jnp.asarray(x_all.reshape(W * T, -1)), jnp.asarray(ids_all.reshape(W * T, K)),
            jnp.asarray(nt_all, jnp.int32), jnp.asarray(w_all.reshape(W * T, K)),
            jnp.asarray(ey_all.reshape((W * L,) + ey_all.shape[2:]))]
    if scale_all is not None:
        args.append(jnp.asarray(scale_all.reshape(W * T, -1)))
    n_out = 4 if scale_all is not None else 3
    outs = run_sharded(f, mesh, (P("x"),) * len(args), (P("x"),) * n_out, *args,
                       check_vma=check_vma)
    ex = f64(outs[0]).reshape((W, L) + outs[0].shape[1:])
    cnt = np.asarray(outs[1]).reshape(W, L)
    y = outs[2]
    exs = np.asarray(outs[3], np.float64).reshape((W, L) + outs[3].shape[1:]) \
        if scale_all is not None else None
    return ex, cnt, y, exs


def _check(rng, impl, T, H, K, E, ids, nt, *, dtype=jnp.bfloat16, ey_dtype=jnp.bfloat16,
           scale_cols=0, check_vma=True):
    L = E // W
    x = np.asarray(jnp.asarray(rng.standard_normal((W, T, H)), dtype))
    w = rng.random((W, T, K)).astype(np.float32)
    ey = np.asarray(jnp.asarray(rng.standard_normal((W, L, W * T, H)), ey_dtype))
    sc = rng.random((W, T, scale_cols)).astype(np.float32) if scale_cols else None
    ex, cnt, y, exs = _run(impl, x, ids, nt, w, ey, E, scale_all=sc, check_vma=check_vma)
    want = oracle_dispatch(f64(x), ids, nt, E)
    want_sc = oracle_dispatch(sc, ids, nt, E) if sc is not None else None
    for d in range(W):
        np.testing.assert_array_equal(cnt[d], want[d][1])
        for e in range(L):
            c = int(cnt[d, e])
            np.testing.assert_array_equal(ex[d, e, :c], want[d][0][e])  # exact data movement
            if sc is not None:
                np.testing.assert_array_equal(exs[d, e, :c], want_sc[d][0][e])
    assert y.dtype == jnp.dtype(ey_dtype)
    y_ref = oracle_combine(f64(ey), w, ids, nt, E)
    got = f64(y).reshape(W, T, H)
    tok = np.arange(T)[None, :] >= np.asarray(nt)[:, None]
    assert np.all(got[tok] == 0), "rows >= num_tokens must be zero"
    tol = 1e-5 if ey_dtype == jnp.float32 else 1e-2
    if np.any(y_ref):
        assert rel_err(got, y_ref) < tol
    else:
        assert not np.any(got)
    return ex, cnt, y


@pytest.mark.parametrize("impl", IMPLS)
def test_random_routing(rng, impl):
    """num_tokens < capacity on most ranks, rank 1 with 0 tokens, -1 slots."""
    T, H, K, E = 12, 32, 4, 32
    ids = _routing(rng, T, K, E, neg_frac=0.2)
    nt = np.array([12, 0, 9, 5, 12, 1, 7, 11])[:W]
    _check(rng, impl, T, H, K, E, ids, nt)


def test_impls_identical_and_check_vma_off(rng):
    """ragged (check_vma off), dense, ragged with one update per peer: identical results."""
    T, H, K, E = 8, 16, 2, 16
    ids = _routing(rng, T, K, E, neg_frac=0.1)
    nt = np.array([8, 0, 3, 8, 6, 8, 2, 8])[:W]
    x = np.asarray(jnp.asarray(rng.standard_normal((W, T, H)), jnp.bfloat16))
    w = rng.random((W, T, K)).astype(np.float32)
    ey = rng.standard_normal((W, E // W, W * T, H)).astype(np.float32)
    a = _run("ragged", x, ids, nt, w, ey, E, check_vma=False)
    b = _run("dense", x, ids, nt, w, ey, E, check_vma=True)
    c1 = _run("ragged", x, ids, nt, w, ey, E, pieces=1)  # one update per peer
    for o in (b, c1):
        np.testing.assert_array_equal(a[1], o[1])
        np.testing.assert_array_equal(np.asarray(a[2]), np.asarray(o[2]))
        for d in range(W):
            for e in range(E // W):
                c = int(a[1][d, e])
                np.testing.assert_array_equal(a[0][d, e, :c], o[0][d, e, :c])


@pytest.mark.parametrize("impl", IMPLS)
def test_all_tokens_to_one_expert(rng, impl):
    T, H, K, E = 16, 32, 2, 16
    ids = _routing(rng, T, K, E)
    ids[:, :, 0] = 5
    ids[:, :, 1] = np.where(ids[:, :, 1] == 5, 6, ids[:, :, 1])
    nt = np.full(W, T)
    ex, cnt, _ = _check(rng, impl, T, H, K, E, ids, nt, ey_dtype=jnp.float32)
    assert cnt[5 // (E // W), 5 % (E // W)] == W * T  # expert 5's block is full


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("K", [1, 8])
def test_top_k(rng, impl, K):
    """top_k 1; top_k 8 with 2 local experts per rank (capacity bound min(top_k, L))."""
    T, H, E = 8, 16, 16
    ids = _routing(rng, T, K, E, neg_frac=0.15)
    nt = np.array([8, 4, 8, 0, 8, 1, 8, 7])[:W]
    _check(rng, impl, T, H, K, E, ids, nt)


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_with_scales(rng, impl):
    T, H, K, E = 8, 256, 4, 32
    ids = _routing(rng, T, K, E, neg_frac=0.1)
    nt = np.array([8, 2, 8, 0, 5, 8, 8, 3])[:W]
    _check(rng, impl, T, H, K, E, ids, nt, dtype=jnp.float8_e4m3fn, scale_cols=H // 128)


def test_gradients(rng):
    """expert_y = expert_x * a[expert]: y[t] = x[t] * sum_k w[t,k] a[id_k], so the gradients
    of sum(y^2) to x and w equal those of that local formula; both impls, finite."""
    T, H, K, E = 8, 16, 4, 32
    ids = _routing(rng, T, K, E, neg_frac=0.2)
    nt = np.array([8, 0, 5, 8, 8, 3, 8, 8])[:W]
    x = jnp.asarray(rng.standard_normal((W * T, H)), jnp.float32)
    w = jnp.asarray(rng.random((W * T, K)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((E, H)), jnp.float32)
    ids_j = jnp.asarray(ids.reshape(W * T, K))
    nt_j = jnp.asarray(nt, jnp.int32)
    mesh = mesh1d(W)

    def loss(impl):
        def body(x, ids, nt, w, a_loc):
            ex, _, _, h = ref.moe_dispatch_xla(x, ids, axis_name="x", num_experts=E,
                                               num_tokens=nt, impl=impl)
            y = ref.moe_combine_xla(ex * a_loc[:, None, :], w, h, axis_name="x",
                                    num_experts=E, impl=impl)
            return jax.lax.psum(jnp.sum(y * y), "x")
        sm = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P())
        return jax.jit(jax.grad(lambda x, w, a: sm(x, ids_j, nt_j, w, a), argnums=(0, 1, 2)))

    def local(x, w, a):
        valid = (ids.reshape(W * T, K) >= 0) & (np.repeat(np.arange(T)[None], W, 0).reshape(
            -1, 1) < np.repeat(nt, T)[:, None])
        ak = a[np.where(valid, ids.reshape(W * T, K), 0)]                # [WT, K, H]
        y = x * jnp.sum(jnp.where(valid[..., None], w[..., None] * ak, 0), axis=1)
        return jnp.sum(y * y)

    want = jax.grad(local, argnums=(0, 1, 2))(x, w, a)
    for impl in IMPLS:
        got = loss(impl)(x, w, a)
        for g, gw in zip(got, want):
            assert np.all(np.isfinite(np.asarray(g)))
            np.testing.assert_allclose(np.asarray(g), np.asarray(gw), rtol=1e-4, atol=1e-4)


def test_all_reduce_rms_norm_xla(rng):
    T, H, eps = 4, 64, 1e-5
    x = jnp.asarray(rng.standard_normal((W * T, H)), jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    wt = jnp.asarray(1 + 0.1 * rng.standard_normal((H,)), jnp.bfloat16)
    f = lambda v, r, g: ref.all_reduce_rms_norm_xla(v, r, g, axis_name="x", eps=eps)  # noqa
    normed, res_out = run_sharded(f, mesh1d(W), (P("x"), P(), P()), (P(), P()), x, res, wt)
    assert normed.dtype == jnp.bfloat16 and res_out.dtype == jnp.float32
    r = f64(x).reshape(W, T, H).sum(0) + f64(res)
    assert rel_err(f64(res_out), r) < 1e-2  # psum in bf16, like lax.psum of bf16
    assert rel_err(f64(normed), rms_ref(r, f64(wt), eps)) < 1e-2
