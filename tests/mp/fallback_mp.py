"""Groups beyond one host: every `--ranks_per_host` processes claim one host of their own
(JAX_NVCOMM_TEST_HOSTNAME, the test-only override of the host identity, set here before any
communicator exists), so a communicator whose group spans them cannot use our buffers. With
backend="auto" it falls back to XLA's collectives for every op; the results must equal
independent float64 numpy references (and XLA's own ops, bitwise). An explicit backend is
refused, naming the hosts. With 2 ranks per host, a mixed mesh ("node", "local") keeps our
buffers on "local" and falls back on "node" only.
  python -m jax_nvcomm.launch -n 2 tests/mp/fallback_mp.py
  python -m jax_nvcomm.launch -n 4 tests/mp/fallback_mp.py --ranks_per_host=2
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P

from common import arg, backend_name, global_array, init, mesh1d, rank_print

per_host = arg("ranks_per_host", 1)
# one process per GPU: XLA runs lax.ragged_all_to_all (the MoE fallback) across processes only
# through NCCL send/recv, which this flag allows (set before the backend starts; a multi-host
# user of the fallback sets it too: docs/API.md)
_flag = "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true"
if "ragged_all_to_all_nccl_send_recv_fallback" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ["JAX_NVCOMM_TEST_HOSTNAME"] = f"fakehost{int(os.environ['JAX_PROCESS_ID']) // per_host}"
nvc = init()
from jax_nvcomm import reference  # noqa: E402

mesh = mesh1d()
W = mesh.shape["x"]
hosts = sorted({f"fakehost{p // per_host}" for p in range(jax.process_count())})
assert len(hosts) > 1, f"needs processes on at least 2 fake hosts, got {hosts}"
rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
seed = int(np.asarray(multihost_utils.broadcast_one_to_all(
    np.int32(rng.integers(1 << 30)))))
rng = np.random.default_rng(seed)  # the same fresh data in every process
T, H = 8, 64


def run(f, in_specs, out_specs, *args, m=mesh):
    return jax.jit(jax.shard_map(f, mesh=m, in_specs=in_specs, out_specs=out_specs))(*args)


def host(a):
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


comm = nvc.Communicator(mesh, "x", max_message_bytes=1 << 20)
assert comm.xla_fallback, comm.transport_reason
assert all(h in comm.transport_reason for h in hosts), comm.transport_reason
rank_print(f"fallback on: {comm.transport_reason}")

# all_reduce: float64 reference, bitwise lax.psum
xs = rng.standard_normal((W * T, H)).astype(np.float32)
x = global_array(mesh, P("x"), xs)
got = host(run(lambda v: nvc.all_reduce(v, comm), P("x"), P(), x))
xla = host(run(lambda v: lax.psum(v, "x"), P("x"), P(), x))
want = xs.astype(np.float64).reshape(W, T, H).sum(0)
np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
assert np.array_equal(got, xla), "all_reduce differs from lax.psum"

# all_reduce_rms_norm: float64 reference, bitwise the XLA reference path
res = rng.standard_normal((T, H)).astype(np.float32)
w = rng.standard_normal(H).astype(np.float32)
args = (x, global_array(mesh, P(), res), global_array(mesh, P(), w))
n_got, r_got = map(host, run(lambda a, b, c: nvc.all_reduce_rms_norm(a, b, c, comm, eps=1e-5),
                             (P("x"), P(), P()), (P(), P()), *args))
n_xla, r_xla = map(host, run(lambda a, b, c: reference.all_reduce_rms_norm_xla(
    a, b, c, axis_name="x", eps=1e-5), (P("x"), P(), P()), (P(), P()), *args))
r64 = want + res
n64 = r64 / np.sqrt(np.mean(r64 * r64, -1, keepdims=True) + 1e-5) * w
np.testing.assert_allclose(r_got, r64, rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(n_got, n64, rtol=1e-4, atol=1e-4)
assert np.array_equal(n_got, n_xla) and np.array_equal(r_got, r_xla), "fused differs from XLA"

# all_gather, tiled and stacked
got = host(run(lambda v: nvc.all_gather(v, comm)[None], P("x"), P("x"), x))
assert all(np.array_equal(g, xs) for g in got), "all_gather"
got = host(run(lambda v: nvc.all_gather(v, comm, axis=1, tiled=False)[None], P("x"), P("x"), x))
assert all(np.array_equal(g, np.moveaxis(xs.reshape(W, T, H), 0, 1)) for g in got), \
    "all_gather axis=1"

# MoE dispatch + combine: rows vs numpy, y = sum_k w * (expert id + 1) * x (closed form)
E, K = 2 * W, 2
moe = nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                          dtype=jnp.float32)
assert moe.xla_fallback
ids = np.stack([rng.choice(E, K, replace=False) for _ in range(W * T)]).astype(np.int32)
ids[rng.random(ids.shape) < 0.1] = -1
nt = rng.integers(0, T + 1, W).astype(np.int32)
tw = rng.random((W * T, K)).astype(np.float32)
L = E // W


def moe_step(v, i, n, wt):
    d = nvc.moe_dispatch(v, i, moe, num_tokens=n[0])
    e0 = lax.axis_index("x") * L
    scale = (e0 + jnp.arange(L, dtype=jnp.float32) + 1)[:, None, None]
    y = nvc.moe_combine(d.expert_x * scale, wt, d.handle, moe)
    return d.expert_x[None], d.expert_counts[None], y


ex, cnt, y = map(host, run(moe_step, (P("x"), P("x"), P("x"), P("x")),
                           (P("x"), P("x"), P("x")), x, global_array(mesh, P("x"), ids),
                           global_array(mesh, P("x"), nt), global_array(mesh, P("x"), tw)))
ref = reference.np_moe_dispatch(xs.reshape(W, T, H), ids.reshape(W, T, K), nt, E)
for r in range(W):
    ex_r, cnt_r = ref[r]
    assert np.array_equal(cnt[r], cnt_r), f"counts of rank {r}"
    for e in range(L):
        c = int(cnt_r[e])
        assert np.array_equal(ex[r][e, :c], ex_r[e, :c]), f"rows of rank {r} expert {e}"
live = (np.arange(T)[None, :] < nt[:, None]).reshape(W * T, 1) & (ids >= 0)
y_want = ((tw * (ids + 1) * live)[..., None] * xs[:, None, :].astype(np.float64)).sum(1)
np.testing.assert_allclose(y.reshape(W * T, H), y_want, rtol=1e-5, atol=1e-5)

# an explicit backend is refused, naming the hosts
try:
    nvc.Communicator(mesh, "x", backend=backend_name())
except ValueError as e:
    assert all(h in str(e) for h in hosts) and "backend='auto'" in str(e), str(e)
else:
    raise AssertionError("an explicit backend over several hosts was not refused")

checked = "all_reduce, all_reduce_rms_norm, all_gather, moe_dispatch/combine, refusal"
if per_host > 1:  # mixed mesh: our buffers inside each host, XLA between hosts
    mesh2 = jax.sharding.Mesh(np.array(jax.devices()).reshape(W // per_host, per_host),
                              ("node", "local"))
    c_local = nvc.Communicator(mesh2, "local", max_message_bytes=1 << 20)
    c_node = nvc.Communicator(mesh2, "node", max_message_bytes=1 << 20)
    assert not c_local.xla_fallback, c_local.transport_reason
    assert c_node.xla_fallback, c_node.transport_reason
    x2 = global_array(mesh2, P(("node", "local")), xs)
    got = host(run(lambda v: nvc.all_reduce(nvc.all_reduce(v, c_local), c_node),
                   P(("node", "local")), P(), x2, m=mesh2))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    c_local.close()
    c_node.close()
    checked += ", mixed mesh"
moe.close()
comm.close()
rank_print(f"OK {W} ranks on {len(hosts)} fake hosts: {checked} agree with XLA and float64")
