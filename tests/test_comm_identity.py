"""A call uses the communicator it was handed, whatever ran before it: after nvc.jit made its
communicators for a program on one mesh, a jax.jit program on another mesh with its own
Communicator (forward mode through ragged_all_to_all, whose tangent is a primitive of its own
carrying the communicator) calls that communicator only, and computes what lax's emulation
does; and the other way round, nvc.jit's program calls only the pool's."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm import reference
from jax_nvcomm.jit import pool

COMM_IDS = re.compile(r"comm_id = (\d+)")
W, N, H = 8, 2, 8


@pytest.fixture(autouse=True)
def _closed_after():
    yield
    nvc.close_all()


def _nvc_jit_program(x):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    f = nvc.jit(jax.shard_map(lambda v: lax.psum(v, ("a", "b")), mesh=mesh,
                              in_specs=P(("a", "b")), out_specs=P()))
    np.testing.assert_allclose(np.asarray(f(x)),
                               np.asarray(x).reshape(8, -1, x.shape[1]).sum(0), rtol=1e-5,
                               atol=1e-5)
    return f


def _jvp_program(mesh, sizes, exchange):
    def body(op, t):
        me = lax.axis_index("x")
        send = sizes[me]
        io = (jnp.cumsum(send) - send).astype(jnp.int32)
        oo = (jnp.cumsum(sizes, axis=0) - sizes)[me].astype(jnp.int32)
        rs = sizes[:, me].astype(jnp.int32)
        out = jnp.zeros((W * N, H), op.dtype)
        return jax.jvp(lambda o: exchange(o, out, io, send.astype(jnp.int32), oo, rs),
                       (op,), (t,))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                                 out_specs=(P("x"), P("x"))))


def _case(rng):
    sizes = jnp.asarray(rng.integers(0, N + 1, (W, W)), jnp.int32)
    op = jnp.asarray(rng.standard_normal((W * W * N, H)), jnp.float32)
    t = jnp.asarray(rng.standard_normal((W * W * N, H)), jnp.float32)
    return sizes, op, t


def test_own_communicator_after_an_nvc_jit_program(rng):
    _nvc_jit_program(jnp.asarray(rng.standard_normal((16, 32)), jnp.float32))
    sizes, op, t = _case(rng)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    comm = nvc.Communicator(mesh, "x", max_message_bytes=1 << 16)
    try:
        ours = _jvp_program(mesh, sizes, lambda *a: nvc.ragged_all_to_all(*a, comm))
        ids = set(COMM_IDS.findall(ours.lower(op, t).as_text()))
        assert ids == {str(comm.comm_id)}
        want = _jvp_program(mesh, sizes, lambda *a: reference.ragged_all_to_all_xla(
            *a, axis_name="x"))(op, t)
        got = ours(op, t)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    finally:
        comm.close()


def test_nvc_jit_program_after_an_own_communicator(rng):
    sizes, op, t = _case(rng)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    comm = nvc.Communicator(mesh, "x", max_message_bytes=1 << 16)
    try:
        _jvp_program(mesh, sizes, lambda *a: nvc.ragged_all_to_all(*a, comm))(op, t)
        x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
        f = _nvc_jit_program(x)
        ids = set(COMM_IDS.findall(f.lower(x).as_text()))
        assert ids and ids <= {str(c.comm_id) for c in pool.held()}
        assert str(comm.comm_id) not in ids
    finally:
        comm.close()
