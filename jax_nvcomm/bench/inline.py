"""`python -m jax_nvcomm.bench inline`: what `jax_nvcomm.jit(f, **kw)(x)` costs per call when
it is written inline, made anew at every call (as some model code writes `jax.jit(forward,
donate_argnums=..., out_shardings=...)(...)` in its step function), against the same inline
`jax.jit(f, **kw)(x)`.

The function: one `shard_map` over every device whose body is a psum of a float32 [rows,
hidden] block (jax_nvcomm.jit serves it with its all-reduce; jax.jit with XLA's). Both are
called once first (trace, compile, communicators made), then `--calls` times each, in turns
(so drift of the machine falls on both alike), each call waited for (`block_until_ready`).
The same is timed for each function made once and called again ("held"): inline - held is
what writing it inline adds per call (the cache lookup; a trace and compile if it missed).
Printed: the median wall time per call in microseconds (p10, p90), and the ratios
jax_nvcomm.jit / jax.jit of the inline calls (target: at most 1.2) and of the held ones (the
collectives' own difference: our kernel against XLA's). The time is what the caller waits:
the host's dispatch and the collective. On CPU devices the host backend's all-reduce is not
XLA's speed, so compare the inline ratio with the held one there; `--op int-psum` (an int32
psum: XLA's under both) leaves the host cost alone.
"""
from __future__ import annotations

import time

import numpy as np


def add_arguments(s):
    s.add_argument("--calls", type=int, default=200,
                   help="timed inline calls of each (default 200; the first, untimed call "
                        "comes before)")
    s.add_argument("--rows", type=int, default=8,
                   help="rows of each device's block (default 8)")
    s.add_argument("--hidden", type=int, default=1024,
                   help="columns of the block (default 1024: 32 KiB per device in float32)")
    s.add_argument("--op", choices=("psum", "int-psum"), default="psum",
                   help="the body: psum (float32: our all-reduce under jax_nvcomm.jit) or "
                        "int-psum (int32: XLA's under both; the same program, so only the "
                        "host cost differs) (default psum)")


def measure(calls: int, rows: int, hidden: int, op: str = "psum") -> list[dict]:
    """[{impl, form, median_us, p10_us, p90_us}]: jax.jit and jax_nvcomm.jit, each inline
    (made at every call) and held (made once)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jax_nvcomm as nvc

    devs = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devs), ("x",))

    def f(x):
        return jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"),
                             out_specs=P())(x)

    dtype = jnp.float32 if op == "psum" else jnp.int32
    x = jnp.ones((rows * len(devs), hidden), dtype)
    impls = {"jax.jit": jax.jit, "jax_nvcomm.jit": nvc.jit}
    held = {name: make(f, donate_argnums=()) for name, make in impls.items()}
    calls_of = {}
    for name, make in impls.items():
        calls_of[(name, "inline")] = lambda make=make: make(f, donate_argnums=())(x)
        calls_of[(name, "held")] = lambda g=held[name]: g(x)
    for call in calls_of.values():  # trace, compile, make the communicators
        call().block_until_ready()
    times = {k: [] for k in calls_of}
    for _ in range(max(calls, 1)):
        for k, call in calls_of.items():
            t0 = time.perf_counter()
            call().block_until_ready()
            times[k].append(time.perf_counter() - t0)
    rows_out = []
    for (name, form), ts in times.items():
        us = np.asarray(ts) * 1e6
        rows_out.append(dict(impl=name, form=form, median_us=float(np.median(us)),
                             p10_us=float(np.percentile(us, 10)),
                             p90_us=float(np.percentile(us, 90))))
    return rows_out


def table(rows) -> str:
    """The printed table: one line per implementation and form, then the ratios."""
    lines = [f"{'call':<32}{'median us':>11}{'p10 us':>10}{'p90 us':>10}"]
    for r in rows:
        call = (f"{r['impl']}(f, **kw)(x)" if r["form"] == "inline"
                else f"g = {r['impl']}(f); g(x)")
        lines.append(f"{call:<32}{r['median_us']:>11.1f}{r['p10_us']:>10.1f}"
                     f"{r['p90_us']:>10.1f}")
    by = {(r["impl"], r["form"]): r["median_us"] for r in rows}
    for form in ("inline", "held"):
        ratio = by[("jax_nvcomm.jit", form)] / by[("jax.jit", form)]
        target = " (target <= 1.2x)" if form == "inline" else ""
        lines.append(f"ratio jax_nvcomm.jit / jax.jit, {form} (median): {ratio:.2f}x{target}")
    return "\n".join(lines)


def run_inline(a) -> int:
    import jax
    rows = measure(a.calls, a.rows, a.hidden, a.op)
    if jax.process_index() == 0:
        print(f"inline calls on {jax.device_count()} {jax.devices()[0].platform} devices, "
              f"{a.op} of {a.rows} x {a.hidden} per device, {a.calls} calls each")
        print(table(rows))
    return 0
