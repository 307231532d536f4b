"""Property tests (hypothesis) on CPU devices: random shapes, dtypes, world sizes, routings
(degenerate ones included) and values with -0.0, subnormals, huge and tiny magnitudes, each
compared with an independent float64 reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from helpers import f64, mesh1d, np_moe_reference

# derandomize=True: examples come from a fixed seed, so every run (CI included) tests the same
# cases and a failure reproduces; hypothesis prints the falsifying example.
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
COMMS = {}


def comm(world):
    if world not in COMMS:
        COMMS[world] = nvc.Communicator(mesh1d(world), "x", max_message_bytes=1 << 20)
    return COMMS[world]


@pytest.fixture(scope="module", autouse=True)
def _close():
    yield
    for c in COMMS.values():
        c.close()
    COMMS.clear()


def ftz(a):
    a = np.array(a, np.float32)
    a[np.abs(a) < np.finfo(np.float32).tiny] = 0.0
    return a


def values(rng, shape, kind):
    """Random data of a given character: normal, mixed magnitudes, or special values."""
    x = rng.standard_normal(shape)
    if kind == "magnitudes":
        x = x * 10.0 ** rng.integers(-30, 30, size=shape)
    elif kind == "special":
        pick = rng.random(shape)
        x = np.where(pick < 0.15, -0.0, x)
        x = np.where((pick >= 0.15) & (pick < 0.3), -1e-40 * rng.random(shape), x)  # subnormal
        x = np.where((pick >= 0.3) & (pick < 0.35), 3e38 * np.sign(x), x)
    return x.astype(np.float32)


@SETTINGS
@given(world=st.sampled_from([1, 2, 3, 4, 8]), rows=st.integers(1, 9),
       cols=st.sampled_from([8, 16, 40, 128]), dtype=st.sampled_from(["float32", "bfloat16",
                                                                     "float16"]),
       kind=st.sampled_from(["normal", "magnitudes", "special"]),
       strategy=st.sampled_from(["oneshot", "twoshot"]), seed=st.integers(0, 2**31 - 1))
def test_all_reduce_property(world, rows, cols, dtype, kind, strategy, seed):
    rng = np.random.default_rng(seed)
    c = comm(world)
    dt = jnp.dtype(dtype)
    host = values(rng, (world * rows, cols), kind)
    if dt != jnp.float32:
        host = np.clip(host, -1e4, 1e4)  # stay inside the 16-bit range
    x = jnp.asarray(host, dt)
    out = jax.jit(jax.shard_map(lambda v: nvc.all_reduce(v, c, strategy=strategy)[None],
                                mesh=c.mesh, in_specs=P("x"), out_specs=P("x")))(x)
    got = f64(out)
    xs = f64(x).reshape(world, rows, cols)
    ref = np.zeros((rows, cols), np.float32)
    for r in range(world):  # float32 accumulation in rank order, like the contract; XLA:CPU
        # runs host code with subnormals flushed (DAZ + FTZ), as its own lax.psum does there
        ref = ftz(ref + ftz(xs[r].astype(np.float32)))
    ref = f64(jnp.asarray(ref, jnp.float32).astype(dt))
    for r in range(world):
        np.testing.assert_array_equal(got[r], ref)


@SETTINGS
@given(world=st.sampled_from([1, 2, 4, 8]), n0=st.integers(1, 5), inner=st.integers(1, 7),
       dtype=st.sampled_from(["float32", "int8", "bfloat16", "int32"]), tiled=st.booleans(),
       axis_pick=st.integers(0, 10), seed=st.integers(0, 2**31 - 1))
def test_all_gather_property(world, n0, inner, dtype, tiled, axis_pick, seed):
    rng = np.random.default_rng(seed)
    c = comm(world)
    x = jnp.asarray(rng.integers(-100, 100, size=(world * n0, inner)), dtype)
    axis = axis_pick % (2 if tiled else 3)
    f = lambda v: (nvc.all_gather(v, c, axis=axis, tiled=tiled),
                   lax.all_gather(v, "x", axis=axis, tiled=tiled))
    a, b = jax.jit(jax.shard_map(f, mesh=c.mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))))(x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and against numpy: at world 1 both sides above are lax.all_gather (our fallback)
    parts = np.split(np.asarray(x), world, axis=0)
    want = np.concatenate(parts, axis=axis) if tiled else np.stack(parts, axis=axis)
    got = np.asarray(a)
    lead = want.shape[0]
    for r in range(world):  # out_specs=P("x"): rank r's copy is block r of the leading axis
        np.testing.assert_array_equal(got[r * lead:(r + 1) * lead], want)


@SETTINGS
@given(world=st.sampled_from([1, 2, 4]), tokens=st.integers(1, 6),
       hidden=st.sampled_from([8, 64, 256]), kind=st.sampled_from(["normal", "magnitudes"]),
       eps=st.sampled_from([1e-6, 1e-3]), seed=st.integers(0, 2**31 - 1))
def test_fused_property(world, tokens, hidden, kind, eps, seed):
    rng = np.random.default_rng(seed)
    c = comm(world)
    x = values(rng, (world * tokens, hidden), kind)
    res = values(rng, (tokens, hidden), kind)
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    # every rank's own copy (out_specs=P("x") over a leading axis), not only rank 0's
    f = lambda v, r, ww: tuple(o[None] for o in nvc.all_reduce_rms_norm(v, r, ww, c, eps=eps))
    n, ro = jax.jit(jax.shard_map(f, mesh=c.mesh, in_specs=(P("x"), P(), P()),
                                  out_specs=(P("x"), P("x"))))(x, res, w)
    n, ro = np.asarray(n, np.float64), np.asarray(ro, np.float64)
    assert n.shape == ro.shape == (world, tokens, hidden)
    r64 = x.astype(np.float64).reshape(world, tokens, hidden).sum(0) + res
    with np.errstate(over="ignore", invalid="ignore"):
        n64 = r64 / np.sqrt(np.mean(r64 * r64, -1, keepdims=True) + eps) * w
    finite = np.isfinite(n64).all(-1) & (np.abs(r64).max(-1) < 1e18)  # float32 r*r overflows
    for r in range(world):
        np.testing.assert_allclose(ro[r], r64, rtol=1e-5, atol=1e-5 * np.abs(r64).max(),
                                   err_msg=f"residual_out of rank {r}")
        np.testing.assert_allclose(n[r][finite], n64[finite], rtol=1e-4, atol=1e-4,
                                   err_msg=f"normed of rank {r}")
        # and bitwise the same on every rank (rank-ordered float32 sum, API.md)
        np.testing.assert_array_equal(ro[r], ro[0])
        np.testing.assert_array_equal(n[r], n[0])


MOES = {}


@SETTINGS
@given(world=st.sampled_from([1, 2, 4]), per_rank=st.sampled_from([1, 2, 4]),
       top_k=st.integers(1, 4), tokens=st.integers(1, 6),
       routing=st.sampled_from(["random", "one_expert", "one_rank", "all_unused", "some_unused"]),
       seed=st.integers(0, 2**31 - 1))
def test_moe_property(world, per_rank, top_k, tokens, routing, seed):
    rng = np.random.default_rng(seed)
    E = world * per_rank
    top_k = min(top_k, E)
    H = 16
    key = (world, E, top_k, tokens)
    if key not in MOES:
        MOES[key] = nvc.MoECommunicator(mesh1d(world), "x", num_experts=E, top_k=top_k,
                                        max_tokens=tokens, hidden=H, dtype=jnp.float32)
    moe = MOES[key]
    N = world * tokens
    if routing == "one_rank":   # every token only to rank 0's experts (when enough of them)
        pool = np.arange(per_rank) if per_rank >= top_k else np.arange(E)
        ids = np.stack([rng.choice(pool, top_k, replace=False) for _ in range(N)])
    elif routing == "one_expert":
        ids = np.stack([np.r_[0, rng.choice(np.arange(1, E), top_k - 1, replace=False)]
                        for _ in range(N)]) if top_k > 1 else np.zeros((N, 1))
    else:
        ids = np.stack([rng.choice(E, top_k, replace=False) for _ in range(N)])
    ids = ids.astype(np.int32)
    if routing == "all_unused":
        ids[:] = -1
    elif routing == "some_unused":
        ids[rng.random(ids.shape) < 0.4] = -1
    x = values(rng, (N, H), "normal")
    w = rng.random((N, top_k)).astype(np.float32)
    nt = rng.integers(0, tokens + 1, size=world).astype(np.int32)

    def f(x, ids, w, nt):
        d = nvc.moe_dispatch(x, ids, moe, num_tokens=nt[0])
        return d.expert_x[None], d.expert_counts[None], nvc.moe_combine(d.expert_x, w, d.handle,
                                                                        moe)
    ex, cnt, y = jax.jit(jax.shard_map(f, mesh=moe.mesh, in_specs=(P("x"),) * 4,
                                       out_specs=(P("x"),) * 3))(x, ids, w, nt)
    ex, cnt = np.asarray(ex), np.asarray(cnt)
    ref = np_moe_reference(x.astype(np.float64), ids, nt, E, world,
                           weights=w, expert_y=[ex[r] for r in range(world)])
    for r in range(world):
        for e in range(per_rank):
            rows = ref["rows"][r][e]
            assert cnt[r, e] == len(rows)
            if rows:
                np.testing.assert_array_equal(ex[r, e, :len(rows)],
                                              np.stack([x[s * tokens + t] for s, t in rows]))
    np.testing.assert_allclose(np.asarray(y), ref["y"], rtol=1e-5, atol=1e-5)


def teardown_module(module):
    for m in MOES.values():
        m.close()
    MOES.clear()
