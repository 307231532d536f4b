"""nvc.ragged_dot (and the private ragged_dot_swiglu) on CPU devices (the host backend; on GPUs,
JAX_NVCOMM_TEST_GPU=1, the CUDA kernel) against a float64 numpy reference written here and
against lax.ragged_dot: float32 to 1e-5 relative, bfloat16 / float16 to their rounding; empty
groups, all rows in one group, rows past the sum of the sizes, a sum past M, gradients against
lax's, jit / vmap / shard_map, the strategy rule and its errors."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm import _ffi
from jax_nvcomm.ragged_dot import ragged_dot_swiglu

_rdm = importlib.import_module("jax_nvcomm.ragged_dot")  # (the package exports the function)

ON_GPU = jax.devices()[0].platform == "gpu"


def np_ragged_dot(lhs, rhs, sizes):
    """float64 reference of lax.ragged_dot's MoE form: group g owns rows [start_g, end_g), the
    running sum of the sizes clipped to M; rows past the last group are zero."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    m = lhs.shape[0]
    out = np.zeros((m, rhs.shape[2]))
    start = 0
    for g, s in enumerate(np.asarray(sizes)):
        end = min(start + int(s), m)
        out[start:end] = lhs[start:end] @ rhs[g]
        start = end
    return out


def np_swiglu(lhs, wg, wu, sizes):
    a = np_ragged_dot(lhs, wg, sizes)
    b = np_ragged_dot(lhs, wu, sizes)
    return a / (1.0 + np.exp(-a)) * b


def rand(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32).astype(dtype)


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def rounding_ok(got, ref64, dtype):
    """got (dtype) within one rounding of the float64 reference, plus the float32 sum's error."""
    eps = float(jnp.finfo(dtype).eps)
    g = f64(got)
    tol = eps * np.abs(ref64) + 1e-5 * (1 + np.abs(ref64))
    return bool(np.all(np.abs(g - ref64) <= tol)), float(np.max(np.abs(g - ref64) - tol))


SIZE_CASES = {
    "random with empty groups, tail rows": (40, [3, 0, 9, 0, 14, 5, 0]),
    "all rows in one group": (24, [0, 0, 24, 0]),
    "one group": (17, [17]),
    "rows past the sum": (30, [2, 4, 0, 1]),
    "sum past M (clipped)": (20, [8, 9, 10]),
    "all groups empty": (12, [0, 0, 0]),
}


@pytest.mark.parametrize("case", list(SIZE_CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_matches_reference_and_lax(case, dtype):
    m, sizes = SIZE_CASES[case]
    if ON_GPU and dtype == "float32":
        pytest.skip("float32 takes XLA's path on GPUs")
    dt = jnp.dtype(dtype)
    rng = np.random.default_rng(len(case) * 7 + len(dtype))
    k, n, g = 48, 40, len(sizes)
    lhs = rand(rng, (m, k), dt)
    rhs = rand(rng, (g, k, n), dt, 1 / np.sqrt(k))
    gs = jnp.asarray(sizes, jnp.int32)
    f = jax.jit(lambda a, b, c: nvc.ragged_dot(a, b, c, strategy="kernel"))
    got = f(lhs, rhs, gs)
    assert got.dtype == dt and got.shape == (m, n)
    ref = np_ragged_dot(f64(lhs), f64(rhs), sizes)
    want = lax.ragged_dot(lhs, rhs, gs)
    total = min(sum(sizes), m)
    assert np.all(f64(got)[total:] == 0.0)
    if dt == jnp.float32:
        assert rel(got, ref) < 1e-5
        assert rel(got, want) < 1e-5
    else:
        ok, worst = rounding_ok(got, ref, dt)
        assert ok, worst
        # lax rounds the same float32 sums: at most one unit in the last place apart
        eps = float(jnp.finfo(dt).eps)
        assert np.all(np.abs(f64(got) - f64(want)) <= 2 * eps * np.abs(ref) + 1e-5)


def test_kernel_is_called():
    """strategy="kernel" lowers to our custom call on this platform; "auto" too on CPU
    devices (on CUDA devices these small weights take XLA's GEMM: the size rule);
    strategy="xla" to lax's dot."""
    rng = np.random.default_rng(0)
    dt = jnp.bfloat16
    lhs, rhs = rand(rng, (16, 64), dt), rand(rng, (4, 64, 32), dt)
    gs = jnp.asarray([4, 4, 4, 4], jnp.int32)
    target = "nvc_cuda_ragged_dot" if ON_GPU else "nvc_ragged_dot"
    for strategy, want in (("kernel", True), ("auto", not ON_GPU), ("xla", False)):
        txt = jax.jit(lambda a, b, c: nvc.ragged_dot(a, b, c, strategy=strategy)).lower(
            lhs, rhs, gs).as_text()
        assert (target in txt) == want, strategy


@pytest.mark.parametrize("preferred", [None, "float32"])
def test_preferred_element_type(preferred):
    rng = np.random.default_rng(3)
    lhs = rand(rng, (20, 32), jnp.bfloat16)
    rhs = rand(rng, (3, 32, 24), jnp.bfloat16, 0.2)
    sizes = [5, 0, 11]
    gs = jnp.asarray(sizes, jnp.int32)
    got = nvc.ragged_dot(lhs, rhs, gs, preferred_element_type=preferred, strategy="kernel")
    want = lax.ragged_dot(lhs, rhs, gs, preferred_element_type=preferred)
    assert got.dtype == want.dtype
    ref = np_ragged_dot(f64(lhs), f64(rhs), sizes)
    if preferred == "float32":
        assert rel(got, ref) < 1e-5
    else:
        assert rounding_ok(got, ref, jnp.bfloat16)[0]


def test_many_rows_per_group_takes_lax_and_matches():
    """'auto' above 64 rows per group is XLA's path; 'kernel' forces ours; both equal lax."""
    rng = np.random.default_rng(4)
    lhs = rand(rng, (300, 16), jnp.float32)
    rhs = rand(rng, (2, 16, 8), jnp.float32)
    gs = jnp.asarray([200, 100], jnp.int32)
    assert nvc.select_ragged_dot_strategy(lhs.shape, rhs.shape, lhs.dtype, platform="cpu") == "xla"
    txt = jax.jit(lambda a, b, c: nvc.ragged_dot(a, b, c)).lower(lhs, rhs, gs).as_text()
    assert "nvc_ragged_dot" not in txt
    want = lax.ragged_dot(lhs, rhs, gs)
    for strategy in ("auto", "kernel"):
        assert rel(nvc.ragged_dot(lhs, rhs, gs, strategy=strategy), want) < 1e-5


def test_mixed_dtypes_take_lax():
    rng = np.random.default_rng(5)
    lhs = rand(rng, (10, 16), jnp.bfloat16)
    rhs = rand(rng, (2, 16, 8), jnp.float32)
    gs = jnp.asarray([4, 6], jnp.int32)
    c = nvc.select_ragged_dot_strategy(lhs.shape, rhs.shape, lhs.dtype, rhs_dtype=rhs.dtype,
                                       platform="cpu", explain=True)
    assert c.strategy == "xla" and "bfloat16 x float32" in c.reason
    with pytest.warns(UserWarning, match="takes lax.ragged_dot"):   # a fixable fallback
        got = nvc.ragged_dot(lhs, rhs, gs)
    want = lax.ragged_dot(lhs, rhs, gs)
    assert got.dtype == want.dtype and np.array_equal(np.asarray(got), np.asarray(want))


def test_fixable_fallback_warns_once_per_call_site(monkeypatch):
    import warnings
    from jax_nvcomm import _warn
    monkeypatch.delenv("JAX_NVCOMM_QUIET", raising=False)
    _warn.reset()
    rng = np.random.default_rng(6)
    lhs = rand(rng, (10, 16), jnp.bfloat16)
    rhs = rand(rng, (2, 16, 8), jnp.float32)
    gs = jnp.asarray([4, 6], jnp.int32)
    plat = "cuda" if ON_GPU else "cpu"
    with pytest.warns(UserWarning, match=rf"ragged_dot \[10, 16\] x \[2, 16, 8\] bfloat16 x "
                                         rf"float32 -> float32 takes lax.ragged_dot on {plat}: "
                                         r"operands bfloat16 x float32") as rec:
        for _ in range(3):
            nvc.ragged_dot(lhs, rhs, gs)          # one line: one warning
    assert len(rec) == 1 and rec[0].filename.endswith("test_ragged_dot.py"), rec
    same = rand(rng, (2, 16, 8), jnp.bfloat16)
    many = rand(rng, (200, 16), jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nvc.ragged_dot(lhs, rhs, gs, strategy="xla")            # asked for XLA
        nvc.ragged_dot(lhs, same, gs)                           # the kernel's
        nvc.ragged_dot(many, same, jnp.asarray([100, 100], jnp.int32))  # rows rule: not a fault
    with pytest.warns(UserWarning, match="result dtype float16"):
        nvc.ragged_dot(lhs, same, gs, preferred_element_type=jnp.float16)
    _warn.reset()
    monkeypatch.setenv("JAX_NVCOMM_QUIET", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nvc.ragged_dot(lhs, rhs, gs)


def test_strategy_rule():
    s = nvc.select_ragged_dot_strategy
    bf = jnp.bfloat16
    assert s((64, 7168), (32, 7168, 2048), bf) == "kernel"      # decode
    assert s((1024, 7168), (32, 7168, 2048), bf) == "kernel"    # 32 rows per group
    assert s((1024, 7168), (256, 7168, 2048), bf) == "kernel"
    assert s((4096, 7168), (32, 7168, 2048), bf) == "xla"       # 128 rows per group
    assert s((64, 7168), (32, 7168, 2048), jnp.float32) == "xla"   # CUDA float32: XLA
    assert s((64, 7168), (32, 7168, 2048), jnp.float32, platform="cpu") == "kernel"
    assert s((64, 7166), (32, 7166, 2048), bf) == "xla"         # K % 8
    assert s((64, 64), (2000, 64, 64), bf) == "xla"             # G > 1024
    c = s((64, 7168), (32, 7168, 2048), bf, explain=True)
    assert c.strategy == "kernel" and "2.0 rows per group" in c.reason


def test_strategy_size_rule():
    """On CUDA devices "auto" takes the kernel from KERNEL_MIN_WEIGHT_BYTES of weights (the
    bytes of the weight's own dtype: 8-bit weights count half); below, XLA's GEMM (latency-
    bound); CPU devices have no such rule."""
    s = nvc.select_ragged_dot_strategy
    edge = _rdm.KERNEL_MIN_WEIGHT_BYTES
    bf = jnp.bfloat16
    n = 256
    k = edge // (8 * n * 2)              # 8 experts of [k, 256] bf16: exactly the edge
    assert s((64, k), (8, k, n), bf) == "kernel"
    c = s((64, k - 8), (8, k - 8, n), bf, explain=True)
    assert c.strategy == "xla" and "small product" in c.reason and "MiB" in c.reason
    assert s((64, k - 8), (8, k - 8, n), bf, platform="cpu") == "kernel"
    assert s((64, k), (8, k, n), bf, rhs_dtype=jnp.int8) == "xla"  # half the bytes
    c = s((64, 2 * k), (8, 2 * k, n), bf, rhs_dtype=jnp.int8, explain=True)
    assert "small product" not in c.reason   # (the kernel where the build has the 8-bit one)


@pytest.mark.skipif(ON_GPU, reason="float32 gradients on GPUs are XLA's path on both sides")
def test_grads_match_lax():
    rng = np.random.default_rng(6)
    sizes = [3, 0, 7, 6]
    lhs = rand(rng, (19, 24), jnp.float32)
    rhs = rand(rng, (4, 24, 16), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    ct = rand(rng, (19, 16), jnp.float32)

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b, gs) * ct)
    ours = jax.grad(loss(lambda a, b, c: nvc.ragged_dot(a, b, c, strategy="kernel")),
                    argnums=(0, 1))(lhs, rhs)
    theirs = jax.grad(loss(lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
    for a, b in zip(ours, theirs):
        assert rel(a, b) < 1e-5
    # forward mode too
    t_l, t_r = rand(rng, lhs.shape, jnp.float32), rand(rng, rhs.shape, jnp.float32)
    _, jo = jax.jvp(lambda a, b: nvc.ragged_dot(a, b, gs, strategy="kernel"), (lhs, rhs),
                    (t_l, t_r))
    _, jl = jax.jvp(lambda a, b: lax.ragged_dot(a, b, gs), (lhs, rhs), (t_l, t_r))
    assert rel(jo, jl) < 1e-5


def test_grad_bf16_runs_and_matches_lax():
    rng = np.random.default_rng(7)
    lhs = rand(rng, (12, 16), jnp.bfloat16)
    rhs = rand(rng, (2, 16, 8), jnp.bfloat16)
    gs = jnp.asarray([5, 7], jnp.int32)
    f = lambda fn: jax.grad(lambda a, b: jnp.sum(fn(a, b, gs).astype(jnp.float32) ** 2),  # noqa
                            argnums=(0, 1))(lhs, rhs)
    ours = f(lambda a, b, c: nvc.ragged_dot(a, b, c, strategy="kernel"))
    theirs = f(lax.ragged_dot)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and rel(f64(a), f64(b)) < 2e-2


def test_vmap():
    rng = np.random.default_rng(8)
    # bfloat16: the kernel's dtype on GPUs too (float32 takes XLA's path there)
    lhs = rand(rng, (3, 14, 16), jnp.bfloat16)
    rhs = rand(rng, (2, 16, 8), jnp.bfloat16)
    gs = jnp.asarray([[4, 10], [14, 0], [0, 9]], jnp.int32)
    got = jax.vmap(lambda a, c: nvc.ragged_dot(a, rhs, c, strategy="kernel"))(lhs, gs)
    for i in range(3):
        # one call per batch element: the same bits as the unbatched call
        one = nvc.ragged_dot(lhs[i], rhs, gs[i], strategy="kernel")
        assert np.array_equal(f64(got[i]), f64(one))
        assert rel(got[i], np_ragged_dot(f64(lhs[i]), f64(rhs), np.asarray(gs[i]))) < 1e-2


@pytest.mark.parametrize("check_vma", [True, False])
def test_inside_shard_map(check_vma):
    """Each device its own rows, group sizes and experts (expert parallelism's local step)."""
    devs = jax.devices()
    w = min(8, len(devs))
    mesh = jax.sharding.Mesh(np.array(devs[:w]), ("x",))
    rng = np.random.default_rng(9)
    m, k, n, g = 16, 24, 8, 3
    lhs = rand(rng, (w * m, k), jnp.bfloat16)
    rhs = rand(rng, (w * g, k, n), jnp.bfloat16, 0.3)
    sizes = rng.integers(0, 7, size=(w, g)).astype(np.int32)
    gs = jnp.asarray(sizes.reshape(-1))

    def body(a, b, c):
        return nvc.ragged_dot(a, b, c, strategy="kernel")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x"), P("x")),
                              out_specs=P("x"), check_vma=check_vma))
    got = f64(f(lhs, rhs, gs))
    for d in range(w):
        ref = np_ragged_dot(f64(lhs[d * m:(d + 1) * m]), f64(rhs[d * g:(d + 1) * g]), sizes[d])
        assert rounding_ok(got[d * m:(d + 1) * m], ref, jnp.bfloat16)[0], d


def test_deterministic():
    rng = np.random.default_rng(10)
    lhs = rand(rng, (33, 64), jnp.bfloat16)
    rhs = rand(rng, (3, 64, 48), jnp.bfloat16)
    gs = jnp.asarray([10, 13, 10], jnp.int32)
    f = jax.jit(lambda a, b, c: nvc.ragged_dot(a, b, c, strategy="kernel"))
    a, b = np.asarray(f(lhs, rhs, gs)), np.asarray(f(lhs, rhs, gs))
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.parametrize("args, exc, text", [
    (((4, 8, 2), (2, 8, 4), (2,)), ValueError, "lhs must be [M, K]"),
    (((4, 8), (2, 6, 4), (2,)), ValueError, "rhs must be [G, K, N] with K = 8"),
    (((4, 8), (2, 8, 4), (3,)), ValueError, "group_sizes must be [G] with G = 2"),
])
def test_bad_shapes(args, exc, text):
    ls, rs, gs = args
    with pytest.raises(exc, match=text.replace("[", r"\[").replace("]", r"\]")):
        nvc.ragged_dot(jnp.zeros(ls), jnp.zeros(rs), jnp.zeros(gs, jnp.int32))


def test_bad_group_sizes_dtype_and_strategy():
    with pytest.raises(TypeError, match="group_sizes must be integers, got float32"):
        nvc.ragged_dot(jnp.zeros((4, 8)), jnp.zeros((2, 8, 4)), jnp.zeros((2,)))
    with pytest.raises(ValueError, match="strategy must be one of .* got 'fast'"):
        nvc.ragged_dot(jnp.zeros((4, 8)), jnp.zeros((2, 8, 4)), jnp.zeros((2,), jnp.int32),
                       strategy="fast")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swiglu(dtype):
    if ON_GPU and dtype == "float32":
        pytest.skip("float32 takes XLA's path on GPUs")
    dt = jnp.dtype(dtype)
    rng = np.random.default_rng(11)
    sizes = [6, 0, 12, 3]
    m, k, f = 25, 32, 24
    lhs = rand(rng, (m, k), dt)
    wg, wu = rand(rng, (4, k, f), dt, 0.3), rand(rng, (4, k, f), dt, 0.3)
    gs = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(lambda *a: ragged_dot_swiglu(*a, strategy="kernel"))(lhs, wg, wu, gs)
    ref = np_swiglu(f64(lhs), f64(wg), f64(wu), sizes)
    assert got.dtype == dt
    assert np.all(f64(got)[21:] == 0.0)
    if dt == jnp.float32:
        assert rel(got, ref) < 1e-5
    else:
        assert rounding_ok(got, ref, dt)[0]
    xla = ragged_dot_swiglu(lhs, wg, wu, gs, strategy="xla")
    assert rel(f64(xla), ref) < (1e-5 if dt == jnp.float32 else 1e-2)


@pytest.mark.skipif(ON_GPU, reason="float32 gradients on GPUs are XLA's path")
def test_swiglu_grads_match_reference():
    rng = np.random.default_rng(12)
    sizes = [4, 5, 0]
    lhs = rand(rng, (11, 16), jnp.float32)
    wg, wu = rand(rng, (3, 16, 8), jnp.float32, 0.3), rand(rng, (3, 16, 8), jnp.float32, 0.3)
    gs = jnp.asarray(sizes, jnp.int32)

    def loss(fn):
        return lambda a, b, c: jnp.sum(fn(a, b, c) ** 2)
    ours = jax.grad(loss(lambda a, b, c: ragged_dot_swiglu(a, b, c, gs,
                                                                 strategy="kernel")),
                    argnums=(0, 1, 2))(lhs, wg, wu)
    theirs = jax.grad(loss(lambda a, b, c: ragged_dot_swiglu(a, b, c, gs, strategy="xla")),
                      argnums=(0, 1, 2))(lhs, wg, wu)
    for a, b in zip(ours, theirs):
        assert rel(a, b) < 1e-5


def test_chained_calls_in_a_loop():
    """20 calls chained in one jitted fori_loop (on GPUs: one command buffer, replayed as a CUDA
    graph; the group sizes change every step, read on the device) give the bits of the same
    calls made one by one."""
    rng = np.random.default_rng(13)
    m, k, g = 24, 32, 4
    x0 = rand(rng, (m, k), jnp.bfloat16)
    rhs = rand(rng, (g, k, k), jnp.bfloat16, 1 / np.sqrt(k))
    sizes = jnp.asarray(rng.integers(0, 8, size=(20, g)), jnp.int32)

    def step(x, gs):
        y = nvc.ragged_dot(x, rhs, gs, strategy="kernel")
        return (x + y).astype(jnp.bfloat16)

    @jax.jit
    def looped(x):
        return lax.fori_loop(0, 20, lambda i, x: step(x, sizes[i]), x)
    one = jax.jit(step)
    want = x0
    for i in range(20):
        want = one(want, sizes[i])
    got = looped(x0)
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


@pytest.mark.skipif(_ffi._cuda is None, reason="the CUDA part is not built")
def test_workspace_size_matches_the_cuda_launcher():
    """The split-K workspace the op asks XLA for is the launcher's own layout (a smaller one
    would only cost splits; this keeps the two formulas one)."""
    import importlib
    rd = importlib.import_module("jax_nvcomm.ragged_dot")  # the module (the package's name is the op)
    for m, n, g, sw in [(64, 2048, 32, True), (64, 7168, 32, False), (256, 7168, 32, False),
                        (1024, 7168, 32, False), (1024, 2048, 256, True), (8, 8, 1, False),
                        (0, 64, 4, False), (100000, 64, 3, True)]:
        assert rd._workspace_bytes(m, n, g, sw) == _ffi._cuda.ragged_dot_workspace_bytes(m, n, g, sw)
