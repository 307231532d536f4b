"""Shared test helpers: meshes, float64 references, sharded runners."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


def mesh1d(n, name="x"):
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), (name,))


def run_sharded(f, mesh, in_specs, out_specs, *args, check_vma=True):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=check_vma))(*args)


def f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def rms_ref(r, w, eps):
    return r / np.sqrt(np.mean(r * r, axis=-1, keepdims=True) + eps) * w


def tol(dtype):
    return {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2,
            jnp.dtype(jnp.float16): 2e-3}[jnp.dtype(dtype)]


def rel_err(a, ref):
    a = np.asarray(a, np.float64)
    num = np.linalg.norm((a - ref).ravel())
    den = max(np.linalg.norm(ref.ravel()), 1e-30)
    return num / den
