"""XLA fallback of communicators whose groups span several hosts (jax_nvcomm/topology/,
_fallback.py): in one process on fake host facts (every op lowers to XLA's collectives, no
jax_nvcomm custom call, and gives float64-reference results; an explicit backend is refused;
a mixed mesh keeps our buffers inside each host), and across processes told they sit on
different hosts (JAX_NVCOMM_TEST_HOSTNAME)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm import topology
from conftest import make_mesh
from helpers import rms_ref

MP = Path(__file__).parent / "mp"


@pytest.fixture
def fake_hosts(monkeypatch):
    """Make topology.gather report the host of each device as host_of(device id)."""
    def install(host_of):
        def gather(prefix, groups, backend, timeout_s):
            facts = [topology.RankFacts(g, r, 0, host_of(int(groups[g, r].id)))
                     for g in range(groups.shape[0]) for r in range(groups.shape[1])]
            return facts, {}
        monkeypatch.setattr(topology, "gather", gather)
    return install


def _lowered(f, mesh, in_specs, out_specs, *args):
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    return fn(*args), fn.lower(*args).as_text()


def test_every_op_runs_xla_collectives_over_hosts(fake_hosts, rng):
    fake_hosts(lambda d: f"node{d // 2}")  # 4 devices, 2 per host
    mesh = make_mesh((4,), ("x",))
    W, T, H = 4, 4, 32
    comm = nvc.Communicator(mesh, "x", max_message_bytes=1 << 20)
    assert comm.xla_fallback and "node0, node1" in comm.transport_reason
    assert comm.topology["ranks"][3]["host"] == "node1"
    xs = rng.standard_normal((W * T, H)).astype(np.float32)
    res = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)

    def body(x, r, wt):
        s = nvc.all_reduce(x, comm)
        n, ro = nvc.all_reduce_rms_norm(x, r, wt, comm, eps=1e-6)
        g = nvc.all_gather(x, comm)
        return s, n, ro, g[None]

    (s, n, ro, g), text = _lowered(body, mesh, (P("x"), P(), P()), (P(), P(), P(), P("x")),
                                   xs, res, w)
    assert "nvc_" not in text and "custom_call" not in text
    assert "all_reduce" in text or "all-reduce" in text
    want = xs.astype(np.float64).reshape(W, T, H).sum(0)
    np.testing.assert_allclose(np.asarray(s), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ro), want + res, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(n), rms_ref(want + res, w, 1e-6), rtol=1e-4, atol=1e-4)
    assert all(np.array_equal(np.asarray(gi), xs) for gi in g)
    assert comm.errors() == [] and comm.host_calls() == {}
    comm.close()
    assert comm.closed


def test_moe_over_hosts_runs_the_ragged_xla_path(fake_hosts, rng):
    fake_hosts(lambda d: f"node{d % 2}")
    mesh = make_mesh((4,), ("x",))
    W, T, H, E, K = 4, 4, 16, 8, 2
    moe = nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                              dtype=jnp.float32)
    assert moe.xla_fallback
    xs = rng.standard_normal((W * T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(W * T)]).astype(np.int32)
    tw = rng.random((W * T, K)).astype(np.float32)
    L = E // W

    def body(x, i, wt):
        d = nvc.moe_dispatch(x, i, moe)
        scale = (jax.lax.axis_index("x") * L + jnp.arange(L, dtype=jnp.float32) + 1)
        y = nvc.moe_combine(d.expert_x * scale[:, None, None], wt, d.handle, moe)
        return d.expert_counts[None], y

    (cnt, y), text = _lowered(body, mesh, (P("x"), P("x"), P("x")), (P("x"), P("x")),
                              xs, ids, tw)
    assert "nvc_" not in text
    np.testing.assert_array_equal(np.asarray(cnt).reshape(-1), np.bincount(ids.ravel(),
                                                                            minlength=E))
    want = ((tw * (ids + 1))[..., None] * xs[:, None, :].astype(np.float64)).sum(1)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    moe.close()


def test_explicit_backend_over_hosts_is_refused(fake_hosts):
    fake_hosts(lambda d: f"rack{d}")
    mesh = make_mesh((2,), ("x",))
    with pytest.raises(ValueError, match=r"backend='host' cannot serve axis 'x'.*rack0, rack1"):
        nvc.Communicator(mesh, "x", backend="host")


def test_mixed_mesh_keeps_buffers_inside_hosts(fake_hosts, rng):
    fake_hosts(lambda d: f"node{d // 4}")  # mesh (2, 4): "node" across hosts, "local" inside
    mesh = make_mesh((2, 4), ("node", "local"))
    local = nvc.Communicator(mesh, "local", max_message_bytes=1 << 20)
    node = nvc.Communicator(mesh, "node", max_message_bytes=1 << 20)
    assert not local.xla_fallback and node.xla_fallback
    xs = rng.standard_normal((8 * 4, 16)).astype(np.float32)
    out, text = _lowered(lambda v: nvc.all_reduce(nvc.all_reduce(v, local), node), mesh,
                         P(("node", "local")), P(), xs)
    assert text.count("nvc_all_reduce") >= 1  # the intra-host axis still uses our kernel
    np.testing.assert_allclose(np.asarray(out), xs.astype(np.float64).reshape(8, 4, 16).sum(0),
                               rtol=1e-5, atol=1e-5)
    local.close()
    node.close()


@pytest.mark.multiprocess
def test_processes_on_different_hosts_fall_back_and_agree():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "jax_nvcomm.launch", "-n", "4", "--timeout", "300",
           "fallback_mp.py", "--ranks_per_host=2"]
    p = subprocess.run(cmd, cwd=MP, env=env, capture_output=True, text=True, timeout=400)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert out.count("OK 4 ranks on 2 fake hosts") == 4, out[-4000:]
    assert "mixed mesh" in out
    # said once per process and communicator kind, not per call
    for kind in ("Communicator over axis 'x'", "MoECommunicator over axis 'x'",
                 "Communicator over axis 'node'"):
        assert out.count(f"jax_nvcomm: {kind} uses XLA's collectives") == 4, kind
    assert "Communicator over axis 'local' uses" not in out
