"""`ragged_dot`: `lax.ragged_dot`'s MoE form (lhs [M, K] rows sorted by group, rhs [G, K, N],
int32 group_sizes [G]) on our grouped-product kernel where it is faster (decode and small
prefill: few rows per group), XLA's elsewhere; and the private `ragged_dot_swiglu`, the
gate and up products with SwiGLU from one pass (the MoE layer's first half). Both also take
8-bit weights (int8 / float8_e4m3fn rhs with 16-bit lhs) with an optional float32 scale per
output channel or per 128 x 128 block (the section at the end: targets `*_w8`).

A local op: no communicator, no order token; it runs where `lax.ragged_dot` would, inside or
outside `jax.shard_map` (inside: on each device's shard, every mesh axis manual). CPU devices
run the host backend (csrc/host/ragged_dot_host.cc), CUDA devices the kernel
(csrc/kernels/ragged_dot.cuh); the platform is picked at lowering (`lax.platform_dependent`).

Gradients: `jax.custom_jvp` whose tangent rule is lax's (`lax.ragged_dot` of the tangents,
linear), so reverse mode uses lax's transposes (dlhs = ragged_dot(g, rhs^T), drhs = the grouped
lhs^T g) while the primal runs our kernel. `jax.vmap` runs one call per batch element.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import _ffi, _shard

STRATEGIES = ("auto", "kernel", "xla")
# the kernel's limits (csrc/cuda/ragged_dot.h ragged_dot_check)
MAX_GROUPS = 1024
MAX_ROWS = 1 << 20
# "auto" takes the kernel up to this many rows per group on average (M / G): beyond it the
# product is compute-bound and XLA's GEMM wins (kernels/ragged_dot.cuh: the two numbers)
KERNEL_MAX_ROWS_PER_GROUP = 64
# ... and on CUDA devices from this many bytes of weights (G x K x N x the weight's itemsize):
# below it the product is bound by latency, not by reading the weights, and XLA's one small
# GEMM takes less (measured on one H100, docs/perf/ragged_dot.md "Small products")
KERNEL_MIN_WEIGHT_BYTES = 8 << 20
_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# 8-bit expert weights (module `ragged_dot_w8`): these weight dtypes with 16-bit activations
W8_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
_W8_LHS_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class RaggedDotChoice:
    """What `select_ragged_dot_strategy(..., explain=True)` returns.

    Attributes:
      strategy: "kernel" (ours) or "xla" (`lax.ragged_dot`).
      platform: the platform it was decided for ("cpu" or "cuda").
      reason: one sentence.
    """
    strategy: str
    platform: str
    reason: str

    def __str__(self):
        return f"{self.strategy}: {self.reason}"


def _out_dtype(lhs_dtype, preferred_element_type):
    return jnp.dtype(lhs_dtype if preferred_element_type is None else preferred_element_type)


def _operands_dtype(lhs_dtype, rhs_dtype):
    """The result dtype lax gives the operands: lhs's with 8-bit weights (lax promotes int8 x
    bf16 to bf16 and refuses float8 x bf16, which here means lhs's dtype too)."""
    if jnp.dtype(rhs_dtype) in W8_DTYPES:
        return jnp.dtype(lhs_dtype)
    return jnp.result_type(lhs_dtype, rhs_dtype)


def _w8_served(platform) -> bool:
    """Whether `platform`'s backend registers the 8-bit-weight targets."""
    if platform == "cpu":
        return "nvc_ragged_dot_w8" in _ffi.HOST_TARGETS
    return _ffi.CUDA_BUILT and "nvc_cuda_ragged_dot_w8" in _ffi.CUDA_TARGETS


# the CUDA kernel's multiples for 8-bit weights (16-byte rows of int8 / e4m3 tiles)
W8_CUDA_MULTIPLE = 16


def _mib(nbytes) -> str:
    return f"{nbytes / (1 << 20):.3g} MiB"


def _decide_w8(m, k, g, n, dt, rdt, odt, platform):
    """`_decide` for 8-bit weights (rdt in W8_DTYPES), without the rows rule."""
    if dt not in _W8_LHS_DTYPES:
        return "xla", (f"operands {dt.name} x {rdt.name} (8-bit weights take bfloat16 or "
                       "float16 activations)"), True
    if odt not in (dt, jnp.dtype(jnp.float32)):
        return "xla", f"result dtype {odt.name} (the kernel gives {dt.name} or float32)", True
    if not _w8_served(platform):
        return "xla", f"this build has no 8-bit-weight kernel for {platform}", False
    if platform == "cuda" and (k % W8_CUDA_MULTIPLE or n % W8_CUDA_MULTIPLE):
        return "xla", f"K {k} or N {n} not a multiple of {W8_CUDA_MULTIPLE}", True
    return None


def _decide(m, k, g, n, dt, rdt, odt, platform, rows_rule):
    """(strategy, why, fixable) of `select_ragged_dot_strategy`; rows_rule=False skips the
    rows-per-group rule (strategy="kernel"). fixable: XLA's path for a reason the caller can
    change (a dtype mix, a result dtype, K or N off a multiple of 8)."""
    if platform not in ("cpu", "cuda"):
        return "xla", f"platform {platform!r} has no kernel", False
    if rdt in W8_DTYPES:
        no = _decide_w8(m, k, g, n, dt, rdt, odt, platform)
        if no is not None:
            return no
    elif dt != rdt or dt not in _KERNEL_DTYPES:
        return "xla", (f"operands {dt.name} x {rdt.name} (the kernel takes one dtype of "
                       "bfloat16, float16, float32)"), True
    elif platform == "cuda" and dt == jnp.float32:
        return "xla", "float32 operands on CUDA devices (XLA's GEMM)", False
    elif odt not in (dt, jnp.dtype(jnp.float32)):
        return "xla", f"result dtype {odt.name} (the kernel gives {dt.name} or float32)", True
    elif platform == "cuda" and (k % 8 or n % 8):
        return "xla", f"K {k} or N {n} not a multiple of 8", True
    if not 1 <= g <= MAX_GROUPS or m > MAX_ROWS:
        return "xla", f"G {g} outside [1, {MAX_GROUPS}] or M {m} > {MAX_ROWS}", False
    if m == 0 or n == 0:
        return "xla", "an empty product", False
    wbytes = g * k * n * rdt.itemsize
    if rows_rule and platform == "cuda" and wbytes < KERNEL_MIN_WEIGHT_BYTES:
        return "xla", (f"weights of {_mib(wbytes)} < {_mib(KERNEL_MIN_WEIGHT_BYTES)} (a small "
                       "product, bound by latency: XLA's GEMM)"), False
    if rows_rule and m > KERNEL_MAX_ROWS_PER_GROUP * g:
        return "xla", (f"{m / g:.1f} rows per group on average > {KERNEL_MAX_ROWS_PER_GROUP} "
                       "(compute-bound: XLA's GEMM)"), False
    return "kernel", (f"{m / g:.1f} rows per group on average" +
                      (f" <= {KERNEL_MAX_ROWS_PER_GROUP} (bound by reading the weights)"
                       if rows_rule else " (strategy='kernel')")), False


def select_ragged_dot_strategy(lhs_shape, rhs_shape, dtype, *, preferred_element_type=None,
                               platform: str = "cuda", rhs_dtype=None, explain: bool = False):
    """The strategy `ragged_dot(..., strategy="auto")` picks: a pure function of the static
    shapes, dtypes and platform.

    "kernel" when the kernel takes the call (operands of one dtype: bfloat16 or float16, and on
    CPU devices float32 too; or 8-bit weights, int8 / float8_e4m3fn, with bfloat16 / float16
    lhs where the build has the 8-bit kernel; result of lhs's dtype or float32; on CUDA
    devices K and N multiples of 8, 16 for 8-bit weights; 1 <= G <= 1024; M <= 2^20) and the
    rows per group are few: M / G <= 64 (decode and small prefill, where the product is bound
    by reading the weights of the groups that have rows) and, on CUDA devices, the weights
    hold at least KERNEL_MIN_WEIGHT_BYTES (G x K x N x the weight's itemsize: a smaller
    product is bound by latency, where XLA's one GEMM takes less); "xla" otherwise (`lax.ragged_dot`; on CUDA devices float32 operands too: XLA's GEMM
    with its own precision rules). Only static sizes are read: a call whose rows crowd into
    few groups still takes the kernel (correct, slower: a group past the kernel's row tile
    re-reads its weights).

    Args:
      lhs_shape, rhs_shape: [M, K] and [G, K, N].
      dtype: lhs's dtype; rhs_dtype: rhs's (default: the same).
      preferred_element_type: the result dtype asked for (None: the operands').
      platform: "cuda" or "cpu".
      explain: return a `RaggedDotChoice` instead of the name.

    Returns:
      "kernel" or "xla"; with explain=True a `RaggedDotChoice`.
    """
    m, k = (int(d) for d in lhs_shape)
    g, _, n = (int(d) for d in rhs_shape)
    dt = jnp.dtype(dtype)
    rdt = jnp.dtype(rhs_dtype) if rhs_dtype is not None else dt
    odt = _out_dtype(_operands_dtype(dt, rdt), preferred_element_type)
    strat, why, _ = _decide(m, k, g, n, dt, rdt, odt, platform, True)
    if not explain:
        return strat
    return RaggedDotChoice(strat, platform, f"ragged_dot [{m}, {k}] x [{g}, {k}, {n}] "
                                            f"{dt.name} -> {odt.name} on {platform}: {why}")


def _kernel_platforms(strategy, lhs, rhs, out_dtype) -> tuple:
    """The platforms ("cpu", "cuda") whose devices run our kernel for this call."""
    if strategy == "xla":
        return ()
    m, k = lhs.shape
    g, _, n = rhs.shape
    out = []
    for p in ("cpu", "cuda"):
        if p == "cuda" and not _ffi.CUDA_BUILT:
            continue
        s, _, _ = _decide(m, k, g, n, jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype),
                          jnp.dtype(out_dtype), p, strategy == "auto")
        if s == "kernel":
            out.append(p)
    return tuple(out)


def _default_platform() -> str:
    """The platform ("cpu" / "cuda") of the default backend, the one a fallback is reported for."""
    try:
        b = jax.default_backend()
    except RuntimeError:
        return "cpu"
    return "cuda" if b in ("gpu", "cuda") else b


def fallback(strategy, lhs_shape, rhs_shape, lhs_dtype, rhs_dtype, out_dtype):
    """(why, fixable) when a call with `strategy` takes lax's path on the default backend's
    platform although the kernel could serve it there; None when the kernel runs there or the
    caller asked for XLA (strategy="xla"), or there is no kernel for the platform (a build
    without CUDA: nothing the call can change)."""
    if strategy == "xla":
        return None
    p = _default_platform()
    if p not in ("cpu", "cuda") or (p == "cuda" and not _ffi.CUDA_BUILT):
        return None
    m, k = (int(d) for d in lhs_shape)
    g, _, n = (int(d) for d in rhs_shape)
    s, why, fixable = _decide(m, k, g, n, jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype),
                              jnp.dtype(out_dtype), p, strategy == "auto")
    if s == "kernel":
        return None
    return (f"ragged_dot [{m}, {k}] x [{g}, {k}, {n}] {jnp.dtype(lhs_dtype).name} x "
            f"{jnp.dtype(rhs_dtype).name} -> {jnp.dtype(out_dtype).name} takes "
            f"lax.ragged_dot on {p}: {why}"), fixable


def _warn_fallback(strategy, lhs, rhs, out_dtype):
    """Once per call site: the call takes lax's path for a reason the caller can fix."""
    f = fallback(strategy, lhs.shape, rhs.shape, lhs.dtype, rhs.dtype, out_dtype)
    if f is not None and f[1]:
        from . import _warn
        _warn.warn_once(f"jax_nvcomm: {f[0]} (JAX_NVCOMM_QUIET=1 silences this)")


def _check(lhs, rhs, group_sizes, what):
    if jnp.ndim(lhs) != 2:
        raise ValueError(f"jax_nvcomm: {what}: lhs must be [M, K], got shape {jnp.shape(lhs)}")
    if jnp.ndim(rhs) != 3 or rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"jax_nvcomm: {what}: rhs must be [G, K, N] with K = {lhs.shape[1]} "
                         f"(lhs's), got shape {jnp.shape(rhs)}")
    if jnp.ndim(group_sizes) != 1 or group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(f"jax_nvcomm: {what}: group_sizes must be [G] with G = {rhs.shape[0]} "
                         f"(rhs's), got shape {jnp.shape(group_sizes)}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"jax_nvcomm: {what}: group_sizes must be integers, got "
                        f"{group_sizes.dtype}")


def _vma(*xs) -> frozenset:
    out = frozenset()
    for x in xs:
        out |= _shard.vma_of(x)
    return out


def _as_varying(x, vma):
    for axis in sorted(vma - _shard.vma_of(x)):
        x = _shard.varying(x, axis)
    return x


def _target(name, platform, graph):
    if platform == "cpu":
        return f"nvc_{name}"
    return f"nvc_cuda_{name}" + ("" if graph else "_nograph")


_LOADED = set()


def _load_cuda_kernels():
    """Load the kernels on every local CUDA device once per process (at trace time, outside
    any CUDA-graph capture XLA may record the first call into)."""
    try:
        devices = [d for d in jax.local_devices() if d.platform == "gpu"]
    except RuntimeError:
        return
    for d in devices:
        if d.id not in _LOADED and hasattr(_ffi._cuda, "ragged_dot_load_kernels"):
            _ffi._cuda.ragged_dot_load_kernels(int(d.local_hardware_id))
            _LOADED.add(d.id)


# The split-K workspace of the CUDA kernel (csrc/cuda/ragged_dot.h ragged_dot_workspace_bytes,
# the same numbers): int32 arrival counters, one per possible item, rounded to 256 bytes, then
# up to 8 float32 planes of [M, N] (two per plane for swiglu) within 32 MiB; none when fewer
# than two fit. XLA allocates it as a second result of the call (as it does cuBLAS's workspace)
# and frees or reuses it after; its contents are never read by anyone else.
_WS_BUDGET = 32 << 20
_WS_MAX_SPLITS = 8


def _workspace_bytes(m, n, g, swiglu):
    plane = m * n * 4 * (2 if swiglu else 1)
    if plane <= 0:
        return 0
    k = min(_WS_MAX_SPLITS, _WS_BUDGET // plane)
    if k < 2:
        return 0
    counters = -(-n // 64) * (m // 16 + min(g, m) + 1)
    return -(-counters * 4 // 256) * 256 + k * plane


def _call(name, platform, out_dtype, lhs, *operands, **attrs):
    """One FFI call of `name` ("ragged_dot", "ragged_dot_swiglu" or their "_w8" forms, whose
    operands carry the scales after the weights and whose `attrs` hold scale_mode) for
    `platform` (CUDA: with its split-K workspace as a second, discarded result)."""
    if platform == "cuda":
        _load_cuda_kernels()
    vma = _vma(lhs, *operands)
    args = [_as_varying(a, vma) for a in (lhs, *operands)]
    m, n, g = lhs.shape[0], operands[0].shape[2], operands[0].shape[0]
    rt = _shard.result_type(lhs, (m, n), out_dtype, vma)
    if platform != "cuda":
        return jax.ffi.ffi_call(_target(name, platform, _shard._GRAPH_CAPTURE), rt,
                                vmap_method="sequential")(*args, **attrs)
    swiglu = name.startswith("ragged_dot_swiglu")
    ws = _shard.result_type(lhs, (max(16, _workspace_bytes(m, n, g, swiglu)),), jnp.uint8, vma)
    out, _ = jax.ffi.ffi_call(_target(name, platform, _shard._GRAPH_CAPTURE), (rt, ws),
                              vmap_method="sequential")(*args, **attrs)
    return out


def _on_platforms(name, out_dtype, platforms, fallback, *args, **attrs):
    """Our kernel `name` on the devices of `platforms`, `fallback` (lax) on any other."""
    branches = {p: functools.partial(_call, name, p, out_dtype, **attrs) for p in platforms}
    # lax.platform_dependent batches every branch under vmap, and lax.ragged_dot has no rule for
    # batched group sizes: the fallback then runs once per batch element, as the kernel does
    return lax.platform_dependent(*args, default=jax.custom_batching.sequential_vmap(fallback),
                                  **branches)


def _lax_ragged_dot(lhs, rhs, gs, out_dtype, precision):
    return lax.ragged_dot(lhs, rhs, gs, precision=precision, preferred_element_type=out_dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5))
def _kernel_ragged_dot(lhs, rhs, gs, out_dtype, precision, platforms):
    return _on_platforms("ragged_dot", out_dtype, platforms,
                         lambda a, b, c: _lax_ragged_dot(a, b, c, out_dtype, precision),
                         lhs, rhs, gs)


@_kernel_ragged_dot.defjvp
def _kernel_ragged_dot_jvp(out_dtype, precision, platforms, primals, tangents):
    lhs, rhs, gs = primals
    dl, dr, _ = tangents
    out = _kernel_ragged_dot(lhs, rhs, gs, out_dtype, precision, platforms)
    t = (_lax_ragged_dot(_instantiate(dl, lhs), rhs, gs, out_dtype, precision) +
         _lax_ragged_dot(lhs, _instantiate(dr, rhs), gs, out_dtype, precision))
    return out, t


def _instantiate(t, like):
    """A tangent as an array (a symbolic or float0 zero becomes zeros of `like`)."""
    if isinstance(t, jax.custom_derivatives.SymbolicZero) or \
            getattr(t, "dtype", None) == jax.dtypes.float0:
        return jnp.zeros_like(like)
    return t


def ragged_dot(lhs, rhs, group_sizes, *, rhs_scale=None, preferred_element_type=None,
               precision=None, strategy: str = "auto"):
    """`lax.ragged_dot(lhs, rhs, group_sizes)` for the MoE form, on our kernel where faster.

    out[r] = lhs[r] @ rhs[g] for the rows r of group g: group g owns rows [start_g, start_g +
    group_sizes[g]) of lhs, start_g the sum of the sizes before it; rows past the sum of
    group_sizes are zero; a sum past M is clipped at M (both as lax). Products accumulate in
    float32 (the kernel: in a fixed order, so results are bitwise reproducible) and are
    rounded once to the result dtype. Negative sizes are outside the contract (lax's groups
    then overlap; the kernel counts them as 0).

    8-bit weights (rhs int8 or float8_e4m3fn, lhs bfloat16 or float16): the product of the
    values, as `lax.ragged_dot` on rhs converted to lhs's dtype (exact for both), times
    rhs_scale where given: out[r, n] = sum_k lhs[r, k] * (float(rhs[g, k, n]) * s(g, k, n)),
    float32 accumulation, rounded once; s = rhs_scale[g, n] (per output channel) or
    rhs_scale[g, k // 128, n // 128] (per 128 x 128 block, DeepSeek-V3's FP8 form). On our
    kernel (host backend on CPU devices, the 8-bit-weight kernel on CUDA devices); XLA's path
    (convert, lax.ragged_dot, scale) where it cannot serve the call.

    Args:
      lhs: [M, K], rows sorted by group (bfloat16, float16 or float32).
      rhs: [G, K, N] of lhs's dtype (others: XLA's path, as lax promotes them), or int8 /
        float8_e4m3fn with bfloat16 / float16 lhs (8-bit weights).
      group_sizes: int [G] (cast to int32), traced: no host sync.
      rhs_scale: 8-bit rhs only, optional: float [G, N] (per output channel) or
        [G, ceil(K / 128), ceil(N / 128)] (per 128 x 128 block of rhs), the mode read from
        the shape (any float dtype, converted to float32). None: no scale.
      preferred_element_type: the result dtype (None: the operands'); the kernel gives the
        operands' dtype or float32, others take XLA's path.
      precision: passed to `lax.ragged_dot` on XLA's path and in the gradient; the kernel
        always multiplies the 16-bit operands exactly and sums in float32.
      strategy: "auto" (`select_ragged_dot_strategy`: the kernel for few rows per group),
        "kernel" (ours wherever it takes the call, whatever the rows per group), "xla"
        (`lax.ragged_dot`).

    Returns:
      [M, N] of preferred_element_type or the operands' dtype.

    Raises:
      ValueError / TypeError: shapes other than the MoE form, non-integer group_sizes, an
        unknown strategy, rhs_scale of another shape or with 16-bit rhs; each names the
        argument, the expected and the actual value.

    Warns:
      a UserWarning (XlaPathWarning), once per call site, when the call takes lax's path on the
      default backend for a reason the caller can change (operands of two dtypes, a result
      dtype the kernel does not give, K or N not a multiple of 8 on CUDA devices); not for the
      rows-per-group rule or strategy="xla". `JAX_NVCOMM_QUIET=1` silences it.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"jax_nvcomm: ragged_dot: strategy must be one of {STRATEGIES}, got "
                         f"{strategy!r}")
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    _check(lhs, rhs, group_sizes, "ragged_dot")
    gs = group_sizes.astype(jnp.int32)
    if jnp.dtype(rhs.dtype) in W8_DTYPES:
        scale, mode = check_scale(rhs_scale, rhs.shape, "ragged_dot", "rhs_scale")
        return _ragged_dot_w8(lhs, rhs, scale, mode, gs, preferred_element_type, precision,
                              strategy, True)
    if rhs_scale is not None:
        raise TypeError(f"jax_nvcomm: ragged_dot: rhs_scale: expected None for rhs of dtype "
                        f"{rhs.dtype} (scales go with int8 or float8_e4m3fn rhs), got an array "
                        f"of shape {jnp.shape(rhs_scale)}")
    return _ragged_dot(lhs, rhs, gs, preferred_element_type, precision, strategy, True)


def _ragged_dot(lhs, rhs, gs, preferred_element_type, precision, strategy, warn):
    """`ragged_dot` past its argument checks (gs int32); warn: a fixable fallback warns once
    per call site (nvc.jit's rewrite warns at the program's own line instead)."""
    if jnp.dtype(rhs.dtype) in W8_DTYPES:
        return _ragged_dot_w8(lhs, rhs, None, 0, gs, preferred_element_type, precision,
                              strategy, warn)
    out_dtype = _out_dtype(jnp.result_type(lhs.dtype, rhs.dtype), preferred_element_type)
    platforms = _kernel_platforms(strategy, lhs, rhs, out_dtype)
    if warn:
        _warn_fallback(strategy, lhs, rhs, out_dtype)
    if not platforms:
        return _lax_ragged_dot(lhs, rhs, gs, preferred_element_type, precision)
    return _kernel_ragged_dot(lhs, rhs, gs, out_dtype, precision, platforms)


# ---- private: gate and up products with SwiGLU in one pass (the MoE layer) ----

def _swiglu_reference(lhs, w_gate, w_up, gs, out_dtype):
    """silu(lhs @ w_gate) * (lhs @ w_up) through lax, each product in float32, rounded once."""
    a = lax.ragged_dot(lhs, w_gate, gs, preferred_element_type=jnp.float32)
    b = lax.ragged_dot(lhs, w_up, gs, preferred_element_type=jnp.float32)
    return (jax.nn.silu(a) * b).astype(out_dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _swiglu_kernel(lhs, w_gate, w_up, gs, out_dtype, platforms):
    return _on_platforms("ragged_dot_swiglu", out_dtype, platforms,
                         lambda a, b, c, d: _swiglu_reference(a, b, c, d, out_dtype),
                         lhs, w_gate, w_up, gs)


@_swiglu_kernel.defjvp
def _swiglu_kernel_jvp(out_dtype, platforms, primals, tangents):
    lhs, w_gate, w_up, gs = primals
    dl, dg, du, _ = tangents
    out = _swiglu_kernel(lhs, w_gate, w_up, gs, out_dtype, platforms)
    _, t = jax.jvp(lambda a, b, c: _swiglu_reference(a, b, c, gs, out_dtype),
                   (lhs, w_gate, w_up),
                   (_instantiate(dl, lhs), _instantiate(dg, w_gate), _instantiate(du, w_up)))
    return out, t


def ragged_dot_swiglu(lhs, w_gate, w_up, group_sizes, *, gate_scale=None, up_scale=None,
                      preferred_element_type=None, strategy: str = "auto"):
    """silu(lhs @ w_gate) * (lhs @ w_up) per group (private: the MoE layer's first half).

    Both products over the same rows of lhs in one pass of our kernel, summed in float32,
    silu in float32, rounded once; the rows as `ragged_dot`'s (rows past the groups: zero).

    Args:
      lhs: [M, K]; w_gate, w_up: [G, K, F] of lhs's dtype, or both int8 / both float8_e4m3fn
        with bfloat16 / float16 lhs (8-bit weights, as `ragged_dot`'s); group_sizes: int [G].
      gate_scale, up_scale: 8-bit weights only, both or neither: the scales of w_gate and
        w_up, each as `ragged_dot`'s rhs_scale, of one mode.
      preferred_element_type: the result dtype (None: lhs's).
      strategy: "auto" / "kernel" as `ragged_dot` (the same rule on the gate product), "xla":
        two `lax.ragged_dot` (float32 results) and the SwiGLU in XLA.

    Returns:
      [M, F].
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"jax_nvcomm: ragged_dot_swiglu: strategy must be one of "
                         f"{STRATEGIES}, got {strategy!r}")
    lhs, w_gate, w_up = jnp.asarray(lhs), jnp.asarray(w_gate), jnp.asarray(w_up)
    group_sizes = jnp.asarray(group_sizes)
    _check(lhs, w_gate, group_sizes, "ragged_dot_swiglu")
    if w_up.shape != w_gate.shape or w_up.dtype != w_gate.dtype:
        raise ValueError(f"jax_nvcomm: ragged_dot_swiglu: w_up must have w_gate's shape "
                         f"{w_gate.shape} and dtype {w_gate.dtype}, got {w_up.shape} "
                         f"{w_up.dtype}")
    gs = group_sizes.astype(jnp.int32)
    if jnp.dtype(w_gate.dtype) in W8_DTYPES:
        return _swiglu_w8(lhs, w_gate, w_up, gate_scale, up_scale, gs, preferred_element_type,
                          strategy)
    if gate_scale is not None or up_scale is not None:
        raise TypeError(f"jax_nvcomm: ragged_dot_swiglu: gate_scale / up_scale: expected None "
                        f"for weights of dtype {w_gate.dtype} (scales go with int8 or "
                        "float8_e4m3fn weights), got an array")
    out_dtype = _out_dtype(lhs.dtype, preferred_element_type)
    platforms = _kernel_platforms(strategy, lhs, w_gate, out_dtype)
    if not platforms:
        return _swiglu_reference(lhs, w_gate, w_up, gs, out_dtype)
    return _swiglu_kernel(lhs, w_gate, w_up, gs, out_dtype, platforms)


# ---- 8-bit expert weights: int8 / float8_e4m3fn rhs with optional scales ----
# The targets nvc_ragged_dot_w8 (lhs, rhs, rhs_scale, group_sizes) and
# nvc_ragged_dot_swiglu_w8 (lhs, w_gate, w_up, gate_scale, up_scale, group_sizes), attribute
# scale_mode: 0 none (scale f32[1], ignored), 1 per output channel f32[G, N], 2 per 128 x 128
# block f32[G, ceil(K/128), ceil(N/128)]. The kernels widen each weight exactly and multiply it
# by its scale in float32 (or apply a channel scale in the epilogue, a block scale per 128-wide
# K block: the same up to float32 order); float32 accumulation; one rounding.

SCALE_BLOCK = 128
_NO_SCALE, _PER_CHANNEL, _PER_BLOCK = 0, 1, 2


def check_scale(scale, rhs_shape, what, name):
    """(the scale as float32, scale_mode) for weights of `rhs_shape` [G, K, N]: None -> a
    float32 [1] one and mode 0; [G, N] -> mode 1; [G, ceil(K/128), ceil(N/128)] -> mode 2.
    Raises ValueError / TypeError naming `name` with the expected and the actual value."""
    g, k, n = (int(d) for d in rhs_shape)
    if scale is None:
        return jnp.ones((1,), jnp.float32), _NO_SCALE
    scale = jnp.asarray(scale)
    blocks = (g, -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK))
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise TypeError(f"jax_nvcomm: {what}: {name}: expected a float dtype, got "
                        f"{scale.dtype}")
    if scale.shape == (g, n):
        mode = _PER_CHANNEL
    elif scale.shape == blocks:
        mode = _PER_BLOCK
    else:
        raise ValueError(f"jax_nvcomm: {what}: {name}: expected [G, N] = [{g}, {n}] or "
                         f"[G, ceil(K/128), ceil(N/128)] = [{blocks[0]}, {blocks[1]}, "
                         f"{blocks[2]}], got {list(scale.shape)}")
    return scale.astype(jnp.float32), mode


def _row_groups(gs, m):
    """The group index of each of m rows (rows past the groups: the last group)."""
    ends = jnp.cumsum(jnp.maximum(gs, 0))
    rows = jnp.arange(m, dtype=ends.dtype)
    return jnp.minimum(jnp.searchsorted(ends, rows, side="right"), gs.shape[0] - 1)


def dequantize(rhs, scale, mode, dtype):
    """float(rhs) * s(g, k, n) (the weights' values the product uses) as `dtype`: mode 0 the
    plain conversion (exact into bfloat16 / float16 / float32)."""
    w = rhs.astype(jnp.float32)
    if mode == _PER_CHANNEL:
        w = w * scale[:, None, :]
    elif mode == _PER_BLOCK:
        g, k, n = rhs.shape
        s = jnp.repeat(jnp.repeat(scale, SCALE_BLOCK, axis=1)[:, :k], SCALE_BLOCK, axis=2)
        w = w * s[:, :, :n]
    return w.astype(dtype)


def _lax_w8(lhs, rhs, scale, mode, gs, out_dtype, precision):
    """XLA's path with the kernel's arithmetic: the weights converted (exact), lax.ragged_dot
    in float32, the channel scale per row after it (mode 1) or the weights dequantised to
    float32 first (mode 2, lhs widened: every product exact in float32)."""
    if mode == _PER_BLOCK:
        return lax.ragged_dot(lhs.astype(jnp.float32), dequantize(rhs, scale, mode,
                                                                  jnp.float32), gs,
                              precision=lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32).astype(out_dtype)
    y = lax.ragged_dot(lhs, rhs.astype(lhs.dtype), gs, precision=precision,
                       preferred_element_type=jnp.float32)
    if mode == _PER_CHANNEL:
        y = y * scale[_row_groups(gs, lhs.shape[0])]
    return y.astype(out_dtype)


def _jvp_lax(fn, primals, tangents):
    """jax.jvp of `fn` (XLA's path) in the differentiable primals only (integer weights have
    float0 tangents: no derivative, as jax's rules for integer inputs)."""
    idx = [i for i, p in enumerate(primals) if jnp.issubdtype(p.dtype, jnp.inexact)]

    def f(*diff):
        args = list(primals)
        for i, d in zip(idx, diff):
            args[i] = d
        return fn(*args)

    return jax.jvp(f, tuple(primals[i] for i in idx),
                   tuple(_instantiate(tangents[i], primals[i]) for i in idx))


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6, 7))
def _kernel_w8(lhs, rhs, scale, gs, mode, out_dtype, precision, platforms):
    return _on_platforms("ragged_dot_w8", out_dtype, platforms,
                         lambda a, b, c, d: _lax_w8(a, b, c, mode, d, out_dtype, precision),
                         lhs, rhs, scale, gs, scale_mode=mode)


@_kernel_w8.defjvp
def _kernel_w8_jvp(mode, out_dtype, precision, platforms, primals, tangents):
    lhs, rhs, scale, gs = primals
    out = _kernel_w8(lhs, rhs, scale, gs, mode, out_dtype, precision, platforms)
    _, t = _jvp_lax(lambda a, b, c: _lax_w8(a, b, c, mode, gs, out_dtype, precision),
                    (lhs, rhs, scale), tangents[:3])
    return out, t


def _ragged_dot_w8(lhs, rhs, scale, mode, gs, preferred_element_type, precision, strategy,
                   warn):
    """`ragged_dot` with 8-bit rhs past its checks (scale float32 of `mode`, gs int32)."""
    if scale is None:
        scale, mode = jnp.ones((1,), jnp.float32), _NO_SCALE
    out_dtype = _out_dtype(lhs.dtype, preferred_element_type)
    platforms = _kernel_platforms(strategy, lhs, rhs, out_dtype)
    if warn:
        _warn_fallback(strategy, lhs, rhs, out_dtype)
    if not platforms:
        return _lax_w8(lhs, rhs, scale, mode, gs, out_dtype, precision)
    return _kernel_w8(lhs, rhs, scale, gs, mode, out_dtype, precision, platforms)


def _swiglu_w8_reference(lhs, w_gate, w_up, gate_scale, up_scale, mode, gs, out_dtype):
    a = _lax_w8(lhs, w_gate, gate_scale, mode, gs, jnp.float32, None)
    b = _lax_w8(lhs, w_up, up_scale, mode, gs, jnp.float32, None)
    return (jax.nn.silu(a) * b).astype(out_dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(6, 7, 8))
def _swiglu_w8_kernel(lhs, w_gate, w_up, gate_scale, up_scale, gs, mode, out_dtype, platforms):
    return _on_platforms(
        "ragged_dot_swiglu_w8", out_dtype, platforms,
        lambda a, b, c, d, e, f: _swiglu_w8_reference(a, b, c, d, e, mode, f, out_dtype),
        lhs, w_gate, w_up, gate_scale, up_scale, gs, scale_mode=mode)


@_swiglu_w8_kernel.defjvp
def _swiglu_w8_kernel_jvp(mode, out_dtype, platforms, primals, tangents):
    lhs, w_gate, w_up, gate_scale, up_scale, gs = primals
    out = _swiglu_w8_kernel(*primals, mode, out_dtype, platforms)
    _, t = _jvp_lax(lambda a, b, c, d, e: _swiglu_w8_reference(a, b, c, d, e, mode, gs,
                                                               out_dtype),
                    primals[:5], tangents[:5])
    return out, t


def _swiglu_w8(lhs, w_gate, w_up, gate_scale, up_scale, gs, preferred_element_type, strategy):
    """`ragged_dot_swiglu` with 8-bit weights past the shape checks (gs int32)."""
    what = "ragged_dot_swiglu"
    if (gate_scale is None) != (up_scale is None):
        raise ValueError(f"jax_nvcomm: {what}: gate_scale, up_scale: expected both or neither, "
                         f"got gate_scale {'None' if gate_scale is None else 'an array'} and "
                         f"up_scale {'None' if up_scale is None else 'an array'}")
    gsc, mode = check_scale(gate_scale, w_gate.shape, what, "gate_scale")
    usc, umode = check_scale(up_scale, w_up.shape, what, "up_scale")
    if umode != mode:
        raise ValueError(f"jax_nvcomm: {what}: up_scale: expected gate_scale's shape "
                         f"{list(gsc.shape)}, got {list(usc.shape)}")
    out_dtype = _out_dtype(lhs.dtype, preferred_element_type)
    platforms = _kernel_platforms(strategy, lhs, w_gate, out_dtype)
    _warn_fallback(strategy, lhs, w_gate, out_dtype)
    if not platforms:
        return _swiglu_w8_reference(lhs, w_gate, w_up, gsc, usc, mode, gs, out_dtype)
    return _swiglu_w8_kernel(lhs, w_gate, w_up, gsc, usc, gs, mode, out_dtype, platforms)
