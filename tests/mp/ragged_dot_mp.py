"""nvc.ragged_dot and the private ragged_dot_swiglu in each process of a job (processes may
share one GPU: a local op, no communication), against a float64 numpy reference of lax's
semantics on each process's own random inputs (empty groups, rows past the sum, all rows in one
group, a sum past M), bf16 within its rounding; then a jitted fori_loop of chained calls (on
GPUs recorded into a CUDA graph: --xla_gpu_enable_command_buffer with CUSTOM_CALL) against
the same calls made one by one, bitwise. One PASS line per check.
  python -m jax_nvcomm.launch -n 2 --share-gpu tests/mp/ragged_dot_mp.py
"""
import os

flags = os.environ.get("XLA_FLAGS", "")
if "xla_gpu_enable_command_buffer" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,"
                               "CONDITIONAL --xla_gpu_graph_min_graph_size=1").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from common import arg, init, rank_print  # noqa: E402

nvc = init()
from jax_nvcomm.ragged_dot import ragged_dot_swiglu  # noqa: E402

iters = arg("iters", 20)
rng = np.random.default_rng(100 + jax.process_index())
dev = jax.local_devices()[0]


def np_ragged_dot(lhs, rhs, sizes):
    m = lhs.shape[0]
    out = np.zeros((m, rhs.shape[2]))
    start = 0
    for g, s in enumerate(sizes):
        end = min(start + int(s), m)
        out[start:end] = lhs[start:end] @ rhs[g]
        start = end
    return out


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def within_rounding(got, ref):
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    return bool(np.all(np.abs(f64(got) - ref) <= eps * np.abs(ref) + 1e-4 * (1 + np.abs(ref))))


failed = 0
cases = {"random, empty groups, tail rows": (72, [5, 0, 17, 3, 0, 30, 9, 0]),
         "all rows in one group": (40, [0, 40, 0, 0]),
         "sum past M": (30, [12, 9, 20])}
K, N = 256, 192
for name, (m, sizes) in cases.items():
    g = len(sizes)
    lhs = jax.device_put(jnp.asarray(rng.standard_normal((m, K)), jnp.bfloat16), dev)
    rhs = jax.device_put(jnp.asarray(rng.standard_normal((g, K, N)) / 16, jnp.bfloat16), dev)
    wu = jax.device_put(jnp.asarray(rng.standard_normal((g, K, N)) / 16, jnp.bfloat16), dev)
    gs = jax.device_put(jnp.asarray(sizes, jnp.int32), dev)
    got = jax.jit(lambda a, b, c: nvc.ragged_dot(a, b, c, strategy="kernel"))(lhs, rhs, gs)
    ref = np_ragged_dot(f64(lhs), f64(rhs), sizes)
    ok = within_rounding(got, ref)
    sw = jax.jit(lambda a, b, u, c: ragged_dot_swiglu(a, b, u, c, strategy="kernel"))(
        lhs, rhs, wu, gs)
    a, b = ref, np_ragged_dot(f64(lhs), f64(wu), sizes)
    ok_sw = within_rounding(sw, a / (1 + np.exp(-a)) * b)
    failed += (not ok) + (not ok_sw)
    rank_print(f"{'PASS' if ok else 'FAIL'} ragged_dot {name}")
    rank_print(f"{'PASS' if ok_sw else 'FAIL'} ragged_dot_swiglu {name}")

# chained calls in one jitted loop (a CUDA graph on GPUs), the sizes changing every step
m, g = 48, 6
x0 = jax.device_put(jnp.asarray(rng.standard_normal((m, K)), jnp.bfloat16), dev)
w = jax.device_put(jnp.asarray(rng.standard_normal((g, K, K)) / 16, jnp.bfloat16), dev)
steps = jnp.asarray(rng.integers(0, 10, size=(iters, g)), jnp.int32)


def step(x, gs):
    return (x + nvc.ragged_dot(x, w, gs, strategy="kernel")).astype(jnp.bfloat16)


looped = jax.jit(lambda x: lax.fori_loop(0, iters, lambda i, x: step(x, steps[i]), x))
one = jax.jit(step)
want = x0
for i in range(iters):
    want = one(want, steps[i])
got = looped(x0)
ok = bool(np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)))
failed += not ok
rank_print(f"{'PASS' if ok else 'FAIL'} {iters} chained calls in a jitted loop equal the calls "
           "one by one")
rank_print(f"{'PASS' if failed == 0 else 'FAIL'} ragged_dot_mp on {dev.platform}: {failed} "
           "failure(s)")
raise SystemExit(1 if failed else 0)
