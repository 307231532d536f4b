"""Our own ops called with axis_name= inside a program run under nvc.jit, with no communicator
made by the caller: the pass has its pool make one over those axes of the shard_map's mesh
(found at the first trace, made outside it, the call traced again), as for lax's collectives.
Outside nvc.jit the same call still asks for a communicator."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm import reference
from jax_nvcomm.jit import pool

W, N, H = 4, 3, 16  # ranks along "x" (a 4 x 2 mesh), rows each sends to every peer, row width


@pytest.fixture(autouse=True)
def _closed_after():
    yield
    nvc.close_all()


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(W, 2), ("x", "y"))


def _index(sizes_row):
    """Offsets of an exchange where this rank sends sizes_row[j] rows to rank j (packed in
    its operand) and every receiver packs what it gets by sender."""
    me = lax.axis_index("x")
    send = sizes_row[me]                                          # [W]
    io = jnp.cumsum(send) - send
    recv = sizes_row[:, me]                                       # [W]: from each sender
    # output_offsets in the receiver's frame: sender me lands after senders 0 .. me-1
    oo = (jnp.cumsum(sizes_row, axis=0) - sizes_row)[me]
    return io.astype(jnp.int32), send.astype(jnp.int32), oo.astype(jnp.int32), \
        recv.astype(jnp.int32)


def _program(ours, sizes):
    def body(op, w, res):
        io, ss, oo, rs = _index(sizes)
        out = jnp.zeros((W * N, H), op.dtype)
        if ours:
            y = nvc.ragged_all_to_all(op, out, io, ss, oo, rs, axis_name="x")
            g = nvc.all_gather(y[:2], axis_name="x")
            z = nvc.all_reduce(y, axis_name="y")
            n, r = nvc.all_reduce_rms_norm(z, res, w, axis_name=("x", "y"))
        else:
            y = reference.ragged_all_to_all_xla(op, out, io, ss, oo, rs, axis_name="x")
            g = lax.all_gather(y[:2], "x", tiled=True)
            z = lax.psum(y, "y")
            r = lax.psum(z, ("x", "y")) + res
            v = jnp.mean(r * r, axis=-1, keepdims=True)
            n = r * lax.rsqrt(v + 1e-6) * w
        return n, r, g

    mesh = _mesh()
    return jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P("x")),
                         out_specs=(P("x"), P("x"), P("x")), check_vma=False)


def test_ops_with_axis_name_get_pool_communicators(rng):
    sizes = jnp.asarray(rng.integers(0, N + 1, (W, W)), jnp.int32)   # [sender, receiver]
    op = jnp.asarray(rng.standard_normal((W * N * W, H)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(H), jnp.float32)
    res = jnp.asarray(rng.standard_normal((W * W * N, H)), jnp.float32)
    ours = nvc.jit(_program(True, sizes))
    got = ours(op, w, res)
    want = jax.jit(_program(False, sizes))(op, w, res)
    for g, x in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(x), rtol=2e-5, atol=2e-5)
    made = {c.axis_name for c in pool.held()}
    assert {"x", "y", ("x", "y")} <= made
    text = ours.lower(op, w, res).as_text()
    for target in ("nvc_ragged_all_to_all", "nvc_all_gather", "nvc_all_reduce",
                   "nvc_all_reduce_rms"):
        assert f"custom_call @{target}(" in text, target


def test_lower_alone_makes_them_too(rng):
    sizes = jnp.asarray(rng.integers(0, N + 1, (W, W)), jnp.int32)
    op = jnp.asarray(rng.standard_normal((W * N * W, H)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(H), jnp.float32)
    res = jnp.asarray(rng.standard_normal((W * W * N, H)), jnp.float32)
    assert "nvc_ragged_all_to_all" in nvc.jit(_program(True, sizes)).lower(op, w, res).as_text()


def test_outside_nvc_jit_the_op_still_asks_for_a_communicator(rng):
    sizes = jnp.asarray(rng.integers(0, N + 1, (W, W)), jnp.int32)
    op = jnp.asarray(rng.standard_normal((W * N * W, H)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(H), jnp.float32)
    res = jnp.asarray(rng.standard_normal((W * W * N, H)), jnp.float32)
    with pytest.raises(ValueError, match="ragged_all_to_all: no Communicator for axis_name 'x'"):
        jax.jit(_program(True, sizes))(op, w, res)
    assert pool.held() == []
