"""`python -m jax_nvcomm.demo`: a small tensor-parallel step with jax_nvcomm against XLA's
collectives (8 CPU devices when no GPU is present). Replaced by the MoE transformer example."""
from __future__ import annotations

import os
import sys
import time


def main(argv=None):
    if "jax" not in sys.modules and not os.environ.get("JAX_PLATFORMS"):
        try:
            import subprocess
            has_gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
        except OSError:
            has_gpu = False
        if not has_gpu:
            os.environ["JAX_PLATFORMS"] = "cpu"
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                       " --xla_force_host_platform_device_count=8").strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jax_nvcomm as nvc

    devs = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devs), ("tp",))
    n = len(devs)
    T, H, F = 16, 512, 1024
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((H, F)) / np.sqrt(H), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((F, H)) / np.sqrt(F), jnp.float32)
    g = jnp.ones((H,), jnp.float32)
    with nvc.Communicator(mesh, "tp", max_message_bytes=1 << 20) as comm:
        def layer(x, w1, w2, g, ours):
            h = jax.nn.silu(x @ w1) @ w2  # row-parallel partial sums
            if ours:
                return nvc.all_reduce_rms_norm(h, x, g, comm)
            r = jax.lax.psum(h, "tp") + x
            return (r * jax.lax.rsqrt(jnp.mean(r * r, -1, keepdims=True) + 1e-6) * g, r)

        def make(ours):
            return jax.jit(jax.shard_map(lambda *a: layer(*a, ours), mesh=mesh,
                                         in_specs=(P(), P(None, "tp"), P("tp", None), P()),
                                         out_specs=(P(), P())))
        results = {}
        for ours in (True, False):
            f = make(ours)
            out = f(x, w1, w2, g)
            jax.block_until_ready(out)
            t = time.perf_counter()
            for _ in range(20):
                out = f(x, w1, w2, g)
            jax.block_until_ready(out)
            results[ours] = (out, (time.perf_counter() - t) / 20)
        err = float(jnp.max(jnp.abs(results[True][0][0] - results[False][0][0])))
        print(f"devices: {n} x {devs[0].platform}; tokens {T}, hidden {H}")
        print(f"{'method':<28}{'ms/step':>10}")
        print(f"{'jax_nvcomm fused AR+RMSNorm':<28}{results[True][1] * 1e3:>10.3f}")
        print(f"{'lax.psum + RMSNorm':<28}{results[False][1] * 1e3:>10.3f}")
        print(f"max |difference| = {err:.2e} ({'agree' if err < 1e-4 else 'DISAGREE'})")
        return 0 if err < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
