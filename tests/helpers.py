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


def oracle_dispatch(x_all, ids_all, nt, E):
    """API.md "MoE dispatch": for destination rank d and its local expert e (global id
    d * L + e), the rows routed to it ordered by (source rank, source token index); rows
    t >= num_tokens[s] and -1 slots are sent nowhere. x_all [W, T, cols] -> per rank d
    (list over e of float64 [count, cols], counts int [L])."""
    Wn, T, K = ids_all.shape
    L = E // Wn
    rows = [[[] for _ in range(L)] for _ in range(Wn)]
    for s in range(Wn):                  # source rank, then token index: the order of the rows
        for t in range(int(nt[s])):
            for k in range(K):
                e = int(ids_all[s, t, k])
                if e >= 0:
                    rows[e // L][e % L].append(np.asarray(x_all[s, t], np.float64))
    cols = x_all.shape[-1]
    return [([np.array(r).reshape(-1, cols) for r in rows[d]],
             np.array([len(r) for r in rows[d]])) for d in range(Wn)]


def oracle_combine(ey_all, w_all, ids_all, nt, E):
    """API.md "MoE combine": y[s, t] = sum_k w[s, t, k] * expert_y[row of (s, t, k)] over the
    slots that were sent (rows t >= num_tokens[s] and -1 slots give nothing), where the row of
    (s, t, k) is its position in expert ids[s, t, k]'s (source rank, token) order on its
    owner. ey_all [W, L, W*T, H] -> float64 [W, T, H]."""
    Wn, T, K = ids_all.shape
    L = E // Wn
    seen = np.zeros(E, int)              # rows handed out so far per expert, in (s, t) order
    y = np.zeros((Wn, T, ey_all.shape[-1]))
    for s in range(Wn):
        for t in range(int(nt[s])):
            for k in range(K):
                e = int(ids_all[s, t, k])
                if e >= 0:
                    y[s, t] += np.float64(w_all[s, t, k]) * np.asarray(
                        ey_all[e // L, e % L, seen[e]], np.float64)
                    seen[e] += 1
    return y


def clear_error_tokens():
    """After an expected runtime error of a side-effecting call, drop JAX's failed runtime
    tokens so the next effects barrier (and interpreter exit) does not re-raise it."""
    from jax._src import dispatch
    dispatch.runtime_tokens.clear()


def np_moe_layer_reference(x, ids, w, nt, wg, wu, wd, world):
    """float64 MoE layer: y[s*T+t] = sum_k w[s*T+t, k] * (silu(x Wg[e]) * (x Wu[e])) Wd[e],
    e = ids[s*T+t, k] >= 0, for t < nt[s] (later rows zero); x [W*T, H], weights [E, ...]."""
    WT, K = ids.shape
    T = WT // world
    y = np.zeros((WT, x.shape[1]))
    for s in range(world):
        for t in range(int(nt[s])):
            r = s * T + t
            for k in range(K):
                e = int(ids[r, k])
                if e < 0:
                    continue
                g, u = x[r] @ wg[e], x[r] @ wu[e]
                y[r] += np.float64(w[r, k]) * ((g / (1.0 + np.exp(-g)) * u) @ wd[e])
    return y


def tanh_expert_losses(moe, scale, ids, nt, check_vma=True):
    """(loss, loss_ref) of x [W*T, H], w [W*T, K] for a gradient check of dispatch + combine:
    each expert e applies tanh(x * scale[e]) (a stand-in FFN); loss runs nvc.moe_dispatch /
    nvc.moe_combine inside shard_map over `moe`'s mesh, loss_ref the same sum in pure JAX over
    the token rows each rank sends (rows past nt and ids of -1 contribute nothing)."""
    import jax_nvcomm as nvc
    from jax.sharding import PartitionSpec as P
    L, T, W = moe.num_local_experts, moe.max_tokens, moe.world_size

    def loss(x, w):
        def body(x, ids, w, nt):
            d = nvc.moe_dispatch(x, ids, moe, num_tokens=nt[0])
            s = jax.lax.dynamic_slice(scale, (jax.lax.axis_index("x") * L,), (L,))
            y = nvc.moe_combine(jnp.tanh(d.expert_x * s[:, None, None]), w, d.handle, moe)
            return jnp.sum(y * y)[None]
        return jnp.sum(jax.shard_map(body, mesh=moe.mesh, in_specs=(P("x"),) * 4,
                                     out_specs=P("x"), check_vma=check_vma)(x, ids, w, nt))

    def loss_ref(x, w):
        valid = (ids >= 0) & (np.arange(W * T)[:, None] % T < np.repeat(nt, T)[:, None])
        s = scale[np.maximum(ids, 0)]  # [N, K]
        contrib = w[..., None] * jnp.tanh(x[:, None, :] * s[..., None])
        y = jnp.sum(jnp.where(valid[..., None], contrib, 0.0), axis=1)
        return jnp.sum(y * y)

    return loss, loss_ref
