"""`python -m jax_nvcomm.bench compile`: compile time (trace + lower + compile) of dense decoder
layers sharded by type (jax_nvcomm/models/typed_decoder.py: the sglang-jax style and the einsum
style, Explicit mesh axes), under jax.jit and under nvc.jit, and their ratio (nvc.jit / jax.jit;
the aim: at most 1.5).

Each repetition builds a new function object (so neither jit's caches serve it) and times
`.lower(*args).compile()`; one warm-up repetition first (it makes nvc.jit's communicators,
which later calls reuse). Rows: style, dtype, phase (decode: 8 tokens, prefill: 256), the
median milliseconds of each and the ratio. Needs at least 8 devices (on CPU:
XLA_FLAGS=--xla_force_host_platform_device_count=8, which this command sets when jax has not
started). --json PATH also writes the rows.
"""
from __future__ import annotations

import json
import os
import statistics
import time


def add_arguments(s):
    """The flags of `bench compile`."""
    s.add_argument("--layers", type=int, default=2, help="decoder layers per model (default 2)")
    s.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    s.add_argument("--reps", type=int, default=3, help="timed repetitions per row (default 3)")
    s.add_argument("--styles", default="sglang,einsum",
                   help="models, comma-separated (default: sglang,einsum)")
    s.add_argument("--json", default=None, metavar="PATH", help="also write the rows here")


def _time(make, args, reps):
    out = []
    for _ in range(reps):
        f = make()
        t = time.perf_counter()
        f.lower(*args).compile()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def _cases(style, dtype, cfg, rng):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ..models import typed_decoder as td
    if style == "sglang":
        mesh = td.explicit_mesh((2, 4), ("data", "tensor"))
        act, cls = P("data", None), td.SglStyle
        shapes = {"decode": (8, cfg.hidden), "prefill": (256, cfg.hidden)}
    else:
        mesh = td.explicit_mesh((2, 2, 2), ("x", "y", "z"))
        act, cls = P("x", None, None), td.EinsumStyle
        shapes = {"decode": (8, 1, cfg.hidden), "prefill": (2, 128, cfg.hidden)}
    with jax.set_mesh(mesh):
        model = cls(cfg, mesh, rng)
    for phase, shape in shapes.items():
        with jax.set_mesh(mesh):
            h, r = (jax.device_put(jnp.asarray(rng.normal(size=shape), dtype),
                                   NamedSharding(mesh, act)) for _ in range(2))
        yield phase, mesh, model, (model.params(), h, r)


def run_compile(a) -> int:
    from .common import _setup_env
    _setup_env()
    flags = os.environ.get("XLA_FLAGS", "")  # read when the backend starts (not yet here)
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_nvcomm as nvc
    from ..models import typed_decoder as td
    if len(jax.devices()) < 8:
        print(f"bench compile: needs 8 devices, have {len(jax.devices())}")
        return 1
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'style':8} {'dtype':9} {'phase':8} {'jax.jit ms':>11} {'nvc.jit ms':>11} "
          f"{'ratio':>6}")
    for style in a.styles.split(","):
        for dtype in (jnp.float32, jnp.bfloat16):
            cfg = td.Config(hidden=a.hidden, ffn=2 * a.hidden, layers=a.layers, dtype=dtype)
            for phase, mesh, model, args in _cases(style, dtype, cfg, rng):
                with jax.set_mesh(mesh):
                    def jj():
                        return jax.jit(lambda *x: model(*x))

                    def nj():
                        return nvc.jit(lambda *x: model(*x))

                    _time(nj, args, 1)  # warm-up: the communicators
                    _time(jj, args, 1)
                    t_j, t_n = _time(jj, args, a.reps), _time(nj, args, a.reps)
                row = dict(style=style, dtype=jnp.dtype(dtype).name, phase=phase,
                           layers=a.layers, hidden=a.hidden, jax_jit_ms=t_j, nvc_jit_ms=t_n,
                           ratio=t_n / t_j)
                rows.append(row)
                print(f"{style:8} {row['dtype']:9} {phase:8} {t_j:11.1f} {t_n:11.1f} "
                      f"{row['ratio']:6.2f}")
    worst = max(r["ratio"] for r in rows)
    print(f"worst ratio nvc.jit / jax.jit: {worst:.2f} (aim: <= 1.5)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    nvc.close_all()
    return 0
