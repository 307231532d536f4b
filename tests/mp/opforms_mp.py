"""The ops' new argument forms across processes (CPU devices, one GPU, or processes sharing GPU
0), against float64 numpy written here: communicators by axis name, a Communicator over a tuple
of mesh axes, the fused all-reduce + RMSNorm with x [B, S, H], odd widths and float32 weights
(a float32 weight holding bf16 values gives the bf16 weight's bits), its FP8 variant, and
ragged_all_to_all with axis_index_groups, mixed index dtypes and forward mode.
  python tests/mp/opforms_mp.py                      (world 1: every device of one process)
  python -m jax_nvcomm.launch -n 2|4 [--share-gpu] tests/mp/opforms_mp.py
Each check prints one line; the script ends with PASS."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from common import check_shards, global_array, init, rank_print

nvc = init()
N = jax.device_count()
EPS = 1e-6
rng = np.random.default_rng(7)
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
a = 2 if N % 2 == 0 and N > 2 else 1
mesh2 = jax.sharding.Mesh(np.array(jax.devices()).reshape(a, N // a), ("X", "Y"))


def run(f, m, specs, out_specs, *host):
    args = [global_array(m, s, h) for s, h in zip(specs, host)]
    return jax.jit(jax.shard_map(f, mesh=m, in_specs=tuple(specs), out_specs=out_specs))(*args)


def bf(a):
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32),
                      np.float64)


def fused_ref(xs, res, w):
    s = bf(np.asarray(xs, np.float64).sum(0))        # psum rounded to bf16
    r = s + np.asarray(res, np.float64)
    return r / np.sqrt(np.mean(r * r, -1, keepdims=True) + EPS) * np.asarray(w, np.float64), r


with nvc.communicators(mesh, max_message_bytes=1 << 22), \
        nvc.communicators(mesh2, axes=("X", "Y"), max_message_bytes=1 << 22):
    # 1. all_reduce by axis name, over one axis and over the tuple
    x = rng.standard_normal((N, 3, 40)).astype(np.float32)
    out = run(lambda v: nvc.all_reduce(v, axis_name="x"), mesh, [P("x")], P(), x)
    check_shards(out, x.astype(np.float64).sum(0, keepdims=True), rtol=1e-5, atol=1e-5,
                 what="all_reduce(axis_name='x')")
    out = run(lambda v: nvc.all_reduce(v, ("X", "Y")), mesh2, [P(("X", "Y"))], P(), x)
    check_shards(out, x.astype(np.float64).sum(0, keepdims=True), rtol=1e-5, atol=1e-5,
                 what="all_reduce over ('X', 'Y')")
    g = run(lambda v: nvc.all_gather(v, axis_name=("X", "Y"), axis=0, tiled=True),
            mesh2, [P(("X", "Y"))], P(("X", "Y")), x)
    check_shards(g, np.concatenate([x] * N, 0), what="all_gather over ('X', 'Y')")
    rank_print("axis_name forms: all_reduce (one axis, tuple), all_gather (tuple) ok")

    # 2. fused: [B, S, H] x, odd widths, float32 weight, both kernel strategies
    strategies = ["twoshot"] if N == 1 else ["oneshot", "twoshot"]  # world 1: the local kernel
    for hidden in (64, 4100, 7, 1):
        shape = (2, 3, hidden)
        xs = np.asarray(jnp.asarray(rng.standard_normal((N,) + shape)).astype(jnp.bfloat16))
        res = np.asarray(jnp.asarray(rng.standard_normal(shape)).astype(jnp.bfloat16))
        w32 = (0.5 + rng.random(hidden)).astype(np.float32)
        n_ref, r_ref = fused_ref(xs.astype(np.float64), res.astype(np.float64), w32)
        for strat in strategies:
            def f(v, r, w, strat=strat):
                return nvc.all_reduce_rms_norm(v[0], r, w, axis_name="x", eps=EPS,
                                               strategy=strat)
            normed, r_out = run(f, mesh, [P("x"), P(), P()], (P(), P()), xs, res, w32)
            check_shards(r_out, r_ref, rtol=2e-2, atol=2e-2, what=f"residual_out H={hidden}")
            check_shards(normed, n_ref, rtol=2e-2, atol=2e-2, what=f"normed H={hidden} {strat}")
            # a float32 weight holding bf16 values: the bf16 weight's bits exactly
            wb = np.asarray(jnp.asarray(w32).astype(jnp.bfloat16))
            nb, _ = run(f, mesh, [P("x"), P(), P()], (P(), P()), xs, res, wb)
            n32, _ = run(f, mesh, [P("x"), P(), P()], (P(), P()), xs, res,
                         wb.astype(np.float32))
            check_shards(n32, np.asarray(nb.addressable_shards[0].data),
                         what=f"f32 weight of bf16 values H={hidden}")
            q, scale, rq = run(lambda v, r, w, strat=strat: nvc.all_reduce_rms_norm_quant(
                v[0], r, w, axis_name="x", eps=EPS, strategy=strat), mesh,
                [P("x"), P(), P()], (P(), P(), P()), xs, res, w32)
            check_shards(rq, np.asarray(r_out.addressable_shards[0].data),
                         what=f"quant residual_out H={hidden}")
            deq = (np.asarray(q.addressable_shards[0].data).astype(np.float64)
                   * np.asarray(scale.addressable_shards[0].data))
            assert np.all(np.abs(deq - n_ref) <= 0.07 * np.abs(n_ref) + 1e-2), \
                f"quant H={hidden} {strat}"
        rank_print(f"fused [2, 3, {hidden}] bf16 x, float32 weight, {'/'.join(strategies)}: ok")

    # 3. ragged: groups, mixed index dtypes, forward mode
    k, rows = 1, 2
    groups = tuple((i,) for i in range(N)) if N > 1 else ((0,),)
    for grp in ([None, groups] if N > 1 else [None]):
        op_ = rng.standard_normal((N, N * rows, 3)).astype(np.float32)
        io = np.tile(np.arange(N, dtype=np.int32) * rows, (N, 1))
        ss = np.full((N, N), rows, np.int32)
        oo = np.broadcast_to((np.arange(N, dtype=np.int32) * rows)[:, None], (N, N)).copy()
        if grp is not None:  # groups of one: each rank sends its slot 0 rows to itself
            io, ss, oo = io[:, :1], ss[:, :1], np.zeros((N, 1), np.int32)

        def rag(o, i, s, d, r, grp=grp):
            out = nvc.ragged_all_to_all(o[0], jnp.zeros_like(o[0]), i[0], s[0].astype(jnp.int16),
                                        d[0], r[0], axis_name="x", axis_index_groups=grp)
            return out[None]
        got = run(rag, mesh, [P("x")] * 5, P("x"), op_, io, ss, oo, ss)
        want = np.zeros_like(op_)
        for rcv in range(N):
            for snd in range(N):
                if grp is None:
                    want[rcv, snd * rows:(snd + 1) * rows] = op_[snd, rcv * rows:(rcv + 1) * rows]
                elif snd == rcv:
                    want[rcv, :rows] = op_[rcv, :rows]
        check_shards(got, want, what=f"ragged groups={grp}")

        def jvp_fn(o, t, i, s, d, r, grp=grp):
            f = lambda u: nvc.ragged_all_to_all(u, jnp.zeros_like(u), i[0], s[0], d[0], r[0],
                                                axis_name="x", axis_index_groups=grp)
            y, ty = jax.jvp(f, (o[0],), (t[0],))
            return y[None], ty[None]
        tan = rng.standard_normal(op_.shape).astype(np.float32)
        y, ty = run(jvp_fn, mesh, [P("x")] * 6, (P("x"), P("x")), op_, tan, io, ss, oo, ss)
        check_shards(y, want, what="ragged jvp primal")
        want_t = np.zeros_like(tan)
        for rcv in range(N):
            for snd in range(N):
                if grp is None:
                    want_t[rcv, snd * rows:(snd + 1) * rows] = tan[snd, rcv * rows:(rcv + 1) * rows]
                elif snd == rcv:
                    want_t[rcv, :rows] = tan[rcv, :rows]
        check_shards(ty, want_t, what="ragged jvp tangent")
        rank_print(f"ragged (axis_index_groups={grp}, int16 sizes, jvp): ok")

rank_print("PASS opforms")
