"""lax parity across processes (CPU devices, one GPU per process, or processes sharing GPU 0):
every op in the forms that need no XLA collective next to it, against float64 numpy written
here from the ops' definitions. Ranks sharing one GPU cannot run XLA's collectives (NCCL), so
the lax-in-the-same-program comparison and the gradients stay in tests/test_parity.py (CPU)
and tests/gpu/test_gpu_parity.py (in-process).
  python -m jax_nvcomm.launch -n 2|4 [--share-gpu] tests/mp/parity_mp.py
Mesh ("dp", "tp") over every device of the job, tp = 2 (dp = devices / 2; 1 with 2 processes:
an auto axis of size 1 still makes the kernel call a nested shard_map's), and ("tp", "dp").
Forms: plain (every axis manual), partially manual over tp in both axis orders (jit shards the
rows over dp), vmap (plain and partially manual), scan over layers, a uniform lax.cond,
Explicit axes, jax.set_mesh. Each form's program prints one line; the script ends with PASS."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from common import global_array, init, rank_print

# tests/ragged_cases.py: the tests folder, whatever the working directory and PYTHONSAFEPATH
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ragged_cases import make_call, np_ragged_all_to_all  # noqa: E402

nvc = init()
from jax_nvcomm.reference import np_moe_combine, np_moe_dispatch  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
N = jax.device_count()
# Ranks sharing one GPU (the launcher's --share-gpu) cannot run XLA's own collectives (NCCL
# refuses two ranks on one device), and XLA moves data over the auto axis of a partially manual
# program with them: there every device is a tp rank and dp (size 1) stays an auto axis that
# still routes each kernel call through the nested shard_map, without XLA collectives.
SHARED = os.environ.get("JAX_NVCOMM_SHARE_GPU") == "1"
W = N if SHARED else 2 if N >= 2 else 1
DP = N // W
B, LAYERS, E, K, T, H = 2, 2, 4, 2, 4, 32
EPS = 1e-5
rng = np.random.default_rng(4321)  # the same stream in every process
devs = np.array(jax.devices()[:W * DP])
MESHES = {"dp_tp": jax.sharding.Mesh(devs.reshape(DP, W), ("dp", "tp")),
          "tp_dp": jax.sharding.Mesh(devs.reshape(W, DP), ("tp", "dp")),
          "explicit": jax.sharding.Mesh(devs.reshape(DP, W), ("dp", "tp"),
                                        axis_types=(AxisType.Explicit,) * 2)}
COMMS = {k: (nvc.Communicator(m, "tp", max_message_bytes=1 << 20),
             nvc.MoECommunicator(m, "tp", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                                 dtype=jnp.float32)) for k, m in MESHES.items()}
FORMS = {"plain": "dp_tp", "partial_dp_tp": "dp_tp", "partial_tp_dp": "tp_dp", "vmap": "dp_tp",
         "vmap_partial": "dp_tp", "scan": "dp_tp", "cond": "dp_tp", "explicit": "explicit",
         "set_mesh": "dp_tp"}


def f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def rms(r, w):
    return r / np.sqrt((r * r).mean(-1, keepdims=True) + EPS) * w


# ---------------------------------------------------------------------------------------------
# ops: per-rank inputs [W, ...] (or shared), our call, numpy's result per rank [W, ...]

def op_all_reduce():
    x = rng.standard_normal((W, 4, 32)).astype(np.float32)
    return ([x], [True], lambda c, m, v: (nvc.all_reduce(v, c),),
            lambda v: (np.broadcast_to(f64(v).sum(0), v.shape),), (1e-6,))


def op_fused():
    x, r = (rng.standard_normal((W, 4, H)).astype(np.float32) for _ in range(2))
    w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)

    def ref(x, r, w):
        rr = f64(x).sum(0)[None] + f64(r)
        return rms(rr, f64(w)), rr
    return ([x, r, w], [True, True, False],
            lambda c, m, a, b, ww: nvc.all_reduce_rms_norm(a, b, ww, c, eps=EPS), ref,
            (1e-5, 1e-6))


def op_quant():
    x, r = (rng.standard_normal((W, 4, H)).astype(np.float32) for _ in range(2))
    w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)

    def ours(c, m, a, b, ww):
        q, s, ro = nvc.all_reduce_rms_norm_quant(a, b, ww, c, eps=EPS)
        return q.astype(jnp.float32) * s, ro

    def ref(x, r, w):
        rr = f64(x).sum(0)[None] + f64(r)
        return rms(rr, f64(w)), rr
    return [x, r, w], [True, True, False], ours, ref, (2.0 ** -4, 1e-6)  # FP8: 2**-4


def op_all_gather():
    x = rng.standard_normal((W, 4, 6)).astype(np.float32)
    return ([x], [True], lambda c, m, v: (nvc.all_gather(v, c),),
            lambda v: (np.broadcast_to(v.reshape(-1, 6), (W, W * 4, 6)),), (0,))


def op_all_gather_v():
    x = rng.standard_normal((W, 4, 8)).astype(np.float32)
    n = rng.integers(0, 5, (W, 1)).astype(np.int32)

    def ref(x, n):
        rows = np.concatenate([x[r, :n[r, 0]] for r in range(W)])
        g = np.zeros((W * 4, 8), np.float32)
        g[:len(rows)] = rows
        return (np.broadcast_to(g, (W,) + g.shape),)
    return ([x, n], [True, True], lambda c, m, v, k: (nvc.all_gather_v(v, k[0], c)[0],), ref,
            (0,), [True, False])


def op_reduce_scatter_v():
    n = rng.integers(0, 5, W).astype(np.int32)
    y = rng.standard_normal((W, W * 4, 8)).astype(np.float32)
    off = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)

    def ref(y, off):
        s = f64(y).sum(0)
        out = np.zeros((W, 4, 8))
        for r in range(W):
            out[r, :n[r]] = s[off[r]:off[r + 1]]
        return (out,)
    return ([y, off], [True, False], lambda c, m, v, o: (nvc.reduce_scatter_v(v, o, c),), ref,
            (1e-6,), [True, False])


def op_ragged():
    io, ss, oo, rs = (a.astype(np.int32) for a in make_call(rng, W, 2, 6, 8))
    x = rng.standard_normal((W, 6, 8)).astype(np.float32)
    out = rng.standard_normal((W, 8, 8)).astype(np.float32)
    return ([x, out, io, ss, oo, rs], [True] * 6,
            lambda c, m, *a: (nvc.ragged_all_to_all(*a, c),),
            lambda *a: (np_ragged_all_to_all(*a),), (0,), [True, True] + [False] * 4)


def op_moe(split):
    x = rng.standard_normal((W, T, H)).astype(np.float32)
    ids = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)])
                    for _ in range(W)]).astype(np.int32)
    wt = rng.random((W, T, K)).astype(np.float32)

    def ours(c, m, v, i, w):
        if split:
            d = nvc.moe_dispatch_recv(nvc.moe_dispatch_send(v, i, m), m)
            y = nvc.moe_combine_recv(nvc.moe_combine_send(d.expert_x * 2, d.handle, m), w, m)
        else:
            d = nvc.moe_dispatch(v, i, m)
            y = nvc.moe_combine(d.expert_x * 2, w, d.handle, m)
        keep = jnp.arange(d.expert_x.shape[1])[None, :, None] < d.expert_counts[:, None, None]
        return jnp.where(keep, d.expert_x, 0), d.expert_counts, y

    def ref(x, ids, wt):
        disp = np_moe_dispatch(x, ids, None, E)
        ex = np.stack([d[0] for d in disp])
        return ex, np.stack([d[1] for d in disp]), np_moe_combine(2 * ex, wt, ids, None, E)
    return [x, ids, wt], [True] * 3, ours, ref, (0, 0, 1e-6)


OPS = {"all_reduce": op_all_reduce, "all_reduce_rms_norm": op_fused,
       "all_reduce_rms_norm_quant": op_quant, "all_gather": op_all_gather,
       "all_gather_v": op_all_gather_v, "reduce_scatter_v": op_reduce_scatter_v,
       "ragged_all_to_all": op_ragged, "moe": lambda: op_moe(False),
       "moe_split": lambda: op_moe(True)}
NO_VMAP = ("moe", "moe_split")


# ---------------------------------------------------------------------------------------------
# forms

def run(form, name):
    arrays, rank, ours, ref, tols, *batched = OPS[name]()
    batched = batched[0] if batched else rank  # which arguments carry the vmap batch
    kind = FORMS[form]
    mesh = MESHES[kind]
    c, m = COMMS[kind]
    vm = form in ("vmap", "vmap_partial")
    if vm and name in NO_VMAP:
        return "vmap refused by name (checked on CPU)"
    if vm:  # B micro-batches of the per-rank arguments: [B, W, ...] -> global [B, W*..., ...]
        scale = np.arange(1, B + 1, dtype=np.float32).reshape((B,) + (1,) * arrays[0].ndim)
        arrays = [np.stack([a] * B) * (scale if i == 0 else 1) if b else a
                  for i, (a, b) in enumerate(zip(arrays, batched))]
    lead = [1 if vm and b else 0 for b in batched]
    host = [a.reshape(a.shape[:d] + (-1,) + a.shape[d + 2:]) if r else a
            for a, r, d in zip(arrays, rank, lead)]
    specs = [P(*[None] * d, "tp") if r else P() for r, d in zip(rank, lead)]
    f = lambda *a: tuple(ours(c, m, *a))
    if vm:
        f = jax.vmap(f, in_axes=[0 if b else None for b in batched])
    if form == "scan":
        base = f
        f = lambda *a: lax.scan(lambda _, s: (None, base(a[0] * s, *a[1:])), None,
                                jnp.arange(1, LAYERS + 1, dtype=a[0].dtype))[1]

    def body(flag, *local):
        if form == "cond":
            out = lax.cond(flag[0] > 0, f, lambda *a: jax.tree.map(jnp.zeros_like, f(*a)),
                           *local)
        else:
            out = f(*local)
        return jax.tree.map(lambda o: o[None], out)

    kw = dict(in_specs=(P(), *specs), out_specs=P("tp"))
    if form != "plain":
        kw["axis_names"] = {"tp"}
    if form != "set_mesh":
        kw["mesh"] = mesh
    shard = [P()] + [P(*[None] * d, ("tp", "dp")) if r and a.shape[d] % (W * DP) == 0
                     else s for a, r, s, d in zip(host, rank, specs, lead)]
    if form in ("plain", "partial_tp_dp", "vmap"):
        shard = [P()] + specs
    args = [global_array(mesh, s, h) for s, h in
            zip(shard, [np.ones((1,), np.int32)] + host)]
    with jax.set_mesh(mesh):
        got = jax.jit(jax.shard_map(body, **kw))(*args)
    if vm:
        want = [ref(*[a[i] if bt else a for a, bt in zip(arrays, batched)]) for i in range(B)]
        want = [np.stack([w[i] for w in want], 1) for i in range(len(want[0]))]
    elif form == "scan":
        want = [ref(*([arrays[0] * (s + 1)] + arrays[1:])) for s in range(LAYERS)]
        want = [np.stack([w[i] for w in want], 1) for i in range(len(want[0]))]
    else:
        want = ref(*arrays)
    for i, (g, w, tol) in enumerate(zip(got, want, tols)):
        check(g, np.asarray(w), tol, f"{name} {form} output {i}")
    return "ok"


def check(arr, want, tol, what):
    """Every addressable shard of arr ([W, ...] over tp; replicated over dp) against want."""
    for s in arr.addressable_shards:
        got = np.asarray(jnp.asarray(s.data).astype(jnp.float32), np.float64)
        exp = np.asarray(want[s.index], np.float64)
        if tol == 0:
            assert np.array_equal(got, exp), f"{what}: shard {s.index} differs"
        else:
            err = np.linalg.norm(got - exp) / max(np.linalg.norm(exp), 1e-30)
            assert err < tol, f"{what}: shard {s.index} relative error {err} >= {tol}"


rank_print(f"layout: {jax.process_count()} processes, {N} devices: dp={DP} x tp={W}")
for form in FORMS:
    for name in OPS:
        rank_print(f"{form:14s} {name:26s} {run(form, name)}")
for c, m in COMMS.values():
    c.close()
    m.close()
rank_print("PASS")
