"""nvc.jit's communicator pool sizes ragged communicators within its ragged budget
(JAX_NVCOMM_JIT_RAGGED_MAX_MESSAGE_BYTES, default a default Communicator's 32 MiB): a
ragged_all_to_all (or an all_to_all taken as one) whose output one round would need more for
runs the chunked path on the communicator as sized, instead of growing it; on 8 CPU devices,
against numpy (bitwise)."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm import ragged
from jax_nvcomm.jit import pool as _pool

W = 8


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:W]), ("ep",))


def _exchange(n, h):
    """Every rank sends n rows of width h to every rank (a transpose of [W, W, n, h])."""
    def body(op, out):
        i32 = jnp.arange(W, dtype=jnp.int32)
        me = lax.axis_index("ep").astype(jnp.int32)
        sizes = jnp.full((W,), n, jnp.int32)
        return lax.ragged_all_to_all(op, out, i32 * n, sizes, jnp.full((W,), me * n, jnp.int32),
                                     sizes, axis_name="ep")
    return jax.shard_map(body, mesh=_mesh(), in_specs=(P("ep"), P("ep")), out_specs=P("ep"))


def test_a_ragged_message_over_the_budget_takes_the_chunked_path(monkeypatch, rng):
    nvc.close_all()
    monkeypatch.setenv("JAX_NVCOMM_JIT_RAGGED_MAX_MESSAGE_BYTES", str(1 << 20))
    n, h = 256, 256                      # 8 x 256 rows x 1 KiB: a 2 MiB output per rank
    f = _exchange(n, h)
    op = jnp.asarray(rng.standard_normal((W * W * n, h)), jnp.float32)
    out = jnp.zeros_like(op)
    j = nvc.jit(f)
    got = np.asarray(j(op, out)).reshape(W, W, n, h)
    np.testing.assert_array_equal(got, np.asarray(op).reshape(W, W, n, h).transpose(1, 0, 2, 3))
    (comm,) = _pool.held()
    assert comm.max_message_bytes == 1 << 20, comm.max_message_bytes
    # one round would not fit this communicator: the call ran chunked
    assert not ragged.fits(comm, W * n, h * 4, 1)
    assert "nvc_ragged_all_to_all" in j.lower(op, out).as_text()
    before = comm.nbytes
    got = np.asarray(j(op * 2, out)).reshape(W, W, n, h)
    np.testing.assert_array_equal(got, 2 * np.asarray(op).reshape(W, W, n, h).transpose(
        1, 0, 2, 3))
    assert _pool.held() == [comm] and comm.nbytes == before
    nvc.close_all()


def test_a_ragged_message_within_the_budget_gets_one_round(monkeypatch, rng):
    nvc.close_all()
    monkeypatch.delenv("JAX_NVCOMM_JIT_RAGGED_MAX_MESSAGE_BYTES", raising=False)
    n, h = 16, 64                        # 64 KiB per rank: well inside 32 MiB
    f = _exchange(n, h)
    op = jnp.asarray(rng.standard_normal((W * W * n, h)), jnp.float32)
    got = np.asarray(nvc.jit(f)(op, jnp.zeros_like(op))).reshape(W, W, n, h)
    np.testing.assert_array_equal(got, np.asarray(op).reshape(W, W, n, h).transpose(1, 0, 2, 3))
    (comm,) = _pool.held()
    assert ragged.fits(comm, W * n, h * 4, 1)
    assert comm.max_message_bytes <= _pool.ragged_cap_bytes()
    nvc.close_all()


def test_an_all_to_all_over_the_budget_stays_ours(monkeypatch, rng):
    """lax.all_to_all along dim 0 becomes a ragged_all_to_all of equal slices at any size (the
    chunked path), not XLA's once one round would not fit."""
    nvc.close_all()
    monkeypatch.setenv("JAX_NVCOMM_JIT_RAGGED_MAX_MESSAGE_BYTES", str(1 << 20))
    f = jax.shard_map(lambda x: lax.all_to_all(x, "ep", 0, 0, tiled=True), mesh=_mesh(),
                      in_specs=P("ep"), out_specs=P("ep"))
    x = jnp.asarray(rng.standard_normal((W * W * 128, 512)), jnp.float32)  # 2 MiB per rank
    j = nvc.jit(f)
    np.testing.assert_array_equal(np.asarray(j(x)), np.asarray(jax.jit(f)(x)))
    assert "nvc_ragged_all_to_all" in j.lower(x).as_text()
    (comm,) = _pool.held()
    assert comm.max_message_bytes == 1 << 20
    nvc.close_all()
