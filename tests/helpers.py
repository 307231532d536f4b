"""Shared test helpers: meshes, float64 references, sharded runners."""
import jax
import jax.numpy as jnp
import numpy as np


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


def np_moe_reference(x, ids, nt, num_experts, world, weights=None, expert_y=None):
    """float64 numpy reference of dispatch (and combine when weights/expert_y given).
    x [W*T, H], ids [W*T, K], nt [W] -> per rank r: list over local experts of the rows routed
    to it in (source rank, token) order, and y [W*T, H] = sum_k w * expert_y[row(t,k)]."""
    WT, K = ids.shape
    T = WT // world
    L = num_experts // world
    rows = [[[] for _ in range(L)] for _ in range(world)]  # (src, t)
    where = {}
    for s in range(world):
        for t in range(int(nt[s])):
            for k in range(K):
                e = int(ids[s * T + t, k])
                if e < 0:
                    continue
                r, le = divmod(e, L)
                where[(s, t, k)] = (r, le, len(rows[r][le]))
                rows[r][le].append((s, t))
    out = {"rows": rows}
    if weights is not None:
        y = np.zeros((WT, x.shape[1]))
        for (s, t, k), (r, le, i) in where.items():
            y[s * T + t] += np.float64(weights[s * T + t, k]) * np.asarray(
                expert_y[r][le, i], np.float64)
        out["y"] = y
    return out


def clear_error_tokens():
    """After an expected runtime error of a side-effecting call, drop JAX's failed runtime
    tokens so the next effects barrier (and interpreter exit) does not re-raise it."""
    from jax._src import dispatch
    dispatch.runtime_tokens.clear()
