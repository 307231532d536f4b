"""Communicator setup, properties and misuse errors (API.md "Setup")."""
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from helpers import mesh1d


def test_properties_and_memory_formula():
    mesh = mesh1d(8)
    M = 1 << 20
    with nvc.Communicator(mesh, "x", max_message_bytes=M) as c:
        assert c.world_size == 8 and c.axis_name == "x" and c.mesh is mesh
        assert c.max_message_bytes == M and c.backend == "host"
        W = 8
        slot = -(-(-(-M // W)) // 256) * 256
        half = -(-(slot * W) // 256) * 256 + -(-M // 256) * 256
        L = min(M, 4 * M // (3 * W), 1 << 20) // 256 * 256
        assert c.nbytes == 65536 + 2 * half + 3 * W * L
        assert c.nbytes <= 8 * M + 65536
    assert c.closed


def test_axis_not_in_mesh():
    with pytest.raises(ValueError, match=r"axis_name 'y' is not an axis of the mesh"):
        nvc.Communicator(mesh1d(8), "y")


def test_bad_arguments():
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        nvc.Communicator("mesh", "x")
    with pytest.raises(ValueError, match="backend must be 'auto', 'cuda' or 'host'"):
        nvc.Communicator(mesh1d(2), "x", backend="nccl")
    with pytest.raises(ValueError, match="max_message_bytes must be >= 4096"):
        nvc.Communicator(mesh1d(2), "x", max_message_bytes=16)
    with pytest.raises(ValueError, match="does not match the mesh's cpu devices"):
        nvc.Communicator(mesh1d(2), "x", backend="cuda")


def test_created_inside_trace():
    mesh = mesh1d(2)

    @jax.jit
    def f(x):
        nvc.Communicator(mesh, "x")
        return x

    with pytest.raises(RuntimeError, match="must be created outside jax.jit"):
        f(jnp.ones(2))


def test_closed_communicator_used():
    mesh = mesh1d(2)
    c = nvc.Communicator(mesh, "x", max_message_bytes=1 << 16)
    c.close()
    f = jax.jit(jax.shard_map(lambda v: nvc.all_gather(v, c), mesh=mesh, in_specs=P("x"),
                              out_specs=P("x")))
    with pytest.raises(RuntimeError, match="was closed"):
        f(jnp.ones(4))


def test_communicator_of_another_mesh():
    c = nvc.Communicator(mesh1d(4), "x", max_message_bytes=1 << 16)
    other = mesh1d(2)
    f = jax.jit(jax.shard_map(lambda v: nvc.all_reduce(v, c), mesh=other, in_specs=P("x"),
                              out_specs=P()))
    with pytest.raises(ValueError, match="made for mesh"):
        f(jnp.ones(4))
    c.close()


def test_used_outside_shard_map():
    with nvc.Communicator(mesh1d(2), "x", max_message_bytes=1 << 16) as c:
        with pytest.raises(ValueError, match="inside jax.shard_map"):
            jax.jit(lambda v: nvc.all_reduce(v, c))(jnp.ones(4))


def test_many_communicators_open_and_close():
    mesh = mesh1d(8)
    for i in range(20):
        with nvc.Communicator(mesh, "x", max_message_bytes=1 << 14) as c:
            x = jnp.arange(8 * 2, dtype=jnp.float32)
            out = jax.jit(jax.shard_map(lambda v: nvc.all_gather(v, c), mesh=mesh,
                                        in_specs=P("x"), out_specs=P("x")))(x + i)
            np.testing.assert_array_equal(np.asarray(out).reshape(8, -1),
                                          np.tile(np.asarray(x + i), (8, 1)))


def test_closed_after_compilation_and_closed_moe(rng):
    """A program compiled while the communicator was open fails with a named error once it is
    closed (never touches freed buffers); tracing with a closed MoECommunicator is refused."""
    import pytest
    from jax_nvcomm import moe as _moe  # noqa: F401
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    c = nvc.Communicator(mesh, "x", max_message_bytes=1 << 16)
    f = jax.jit(jax.shard_map(lambda v: nvc.all_reduce(v, c, strategy="oneshot")[None],
                              mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = rng.standard_normal((2, 1, 8)).astype(np.float32)
    for r in range(2):
        np.testing.assert_allclose(np.asarray(f(x))[r].ravel(), x.sum(0).ravel(), rtol=1e-6)
    c.close()
    with pytest.raises(Exception, match=r"has no rank at slot .* \(closed, or used with another "
                                        r"mesh\)"):
        jax.block_until_ready(f(x))
    from helpers import clear_error_tokens
    clear_error_tokens()
    moe = nvc.MoECommunicator(mesh, "x", num_experts=2, top_k=1, max_tokens=2, hidden=8,
                              dtype=jnp.float32)
    moe.close()
    assert moe.closed and moe.errors() == []
    with pytest.raises(RuntimeError, match="moe_dispatch: the MoECommunicator was closed"):
        jax.jit(jax.shard_map(lambda v, i: nvc.moe_dispatch(v, i, moe).expert_x[None],
                              mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x"))).lower(
            np.zeros((4, 8), np.float32), np.zeros((4, 1), np.int32))


def test_close_while_a_call_still_runs(rng):
    """close() while a jitted program using the communicator still runs (XLA:CPU dispatches
    asynchronously): the behaviour is defined as follows, and it is never a crash.
    - host backend: close() does not wait. The shared memory stays mapped until the last call
      still inside the protocol returns (module_host.cc unmap_after_last_use; it used to be
      unmapped at once: SIGSEGV in the running handler). Ranks whose next call starts after
      close() fail with the named error "has no rank at slot ... (closed ...)", their peers
      inside the protocol with it or the peer timeout, within timeout_s; so the program's
      result is that error, or, if every call had finished before close(), the right sum.
    - CUDA backend: close() synchronises every local device first, so it waits for
      outstanding work (communicator.py close())."""
    from helpers import clear_error_tokens
    W, n = 4, 200
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:W]), ("x",))
    c = nvc.Communicator(mesh, "x", max_message_bytes=1 << 20, timeout_s=2)

    def body(v):
        step = lambda i, a: jax.lax.pcast(nvc.all_reduce(a, c, strategy="twoshot") * (1 / W),
                                          "x", to="varying")
        return jax.lax.fori_loop(0, n, step, v)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = rng.standard_normal((W * 8, 256)).astype(np.float32)
    want = x.reshape(W, 8, 256).mean(0)  # every iteration averages over the ranks: a fixed point
    np.testing.assert_allclose(np.asarray(f(x)).reshape(W, 8, 256), np.tile(want, (W, 1, 1)),
                               rtol=1e-4, atol=1e-5)
    out = f(x)           # returns at once; the loop of n all-reduces runs in XLA's threads
    t0 = time.monotonic()
    c.close()
    assert c.closed and time.monotonic() - t0 < 1.0  # close() does not wait on the host
    try:
        got = np.asarray(out)
    except Exception as e:  # noqa: BLE001 - the named error is the check
        assert re.search(r"has no rank at slot \d+ in this process \(closed|timed out", str(e)), e
        assert time.monotonic() - t0 < 2 + 10, "bounded by the communicator's timeout"
    else:
        np.testing.assert_allclose(got.reshape(W, 8, 256), np.tile(want, (W, 1, 1)),
                                   rtol=1e-4, atol=1e-5)
    clear_error_tokens()
    with pytest.raises(Exception, match="has no rank at slot"):  # later calls: named error
        jax.block_until_ready(f(x))
    clear_error_tokens()
    with nvc.Communicator(mesh, "x", max_message_bytes=1 << 16) as c2:  # the process is fine
        g = jax.jit(jax.shard_map(lambda v: nvc.all_reduce(v, c2)[None], mesh=mesh,
                                  in_specs=P("x"), out_specs=P("x")))
        np.testing.assert_allclose(np.asarray(g(x)).reshape(W, 8, 256),
                                   np.tile(x.reshape(W, 8, 256).sum(0), (W, 1, 1)), rtol=1e-5,
                                   atol=1e-5)


def test_check_raises_the_records_and_the_survivors_get_a_new_communicator(rng):
    """After a failed call (rank 1 of 4 routes a token to expert 8 of 8): comm.check() raises
    CommunicatorError with one line per rank of this process, naming op, call, rank and peer;
    the records survive close(); close() is prompt; and a new communicator over the other
    devices (or all of them) runs a correct all-reduce in the same process."""
    from helpers import clear_error_tokens
    W, E, K, T, H = 4, 8, 2, 3, 16
    mesh = mesh1d(W)
    moe = nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                              dtype=jnp.float32, timeout_s=5)
    moe.check()  # nothing failed yet
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(W * T)]).astype(np.int32)
    ids[T + 2, 1] = E  # rank 1, token 2, slot 1
    f = jax.jit(jax.shard_map(lambda v, i: nvc.moe_dispatch(v, i, moe).expert_counts[None],
                              mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
    x = rng.standard_normal((W * T, H)).astype(np.float32)
    # the host protocol raises at the call itself, naming the id found on rank 1 first
    # (rank 1's own text, or its record where XLA raises another rank's error)
    with pytest.raises(Exception, match=r"^[^\n]*rank 1[^\n]*topk_ids\[2, 1\] = 8, "
                                        r"outside"):
        jax.block_until_ready(f(x, ids))
    clear_error_tokens()
    with pytest.raises(nvc.CommunicatorError) as ei:
        moe.check()
    recs = ei.value.records
    assert isinstance(ei.value, RuntimeError) and len(recs) == W, recs
    assert ("jax_nvcomm: moe_dispatch call #1: rank 1: topk_ids[2, 1] = 8, outside "
            "[-1, num_experts)") in recs, recs
    for r in (0, 2, 3):
        assert f"moe_dispatch call #1: rank {r}: rank 1 failed this call" in "\n".join(recs)
    assert "unusable after this error" in str(ei.value)
    t0 = time.monotonic()
    moe.close()
    assert time.monotonic() - t0 < 5 and moe.closed
    with pytest.raises(nvc.CommunicatorError):  # the records outlive close()
        moe.check()
    for devs in ([0, 2, 3], [0, 1, 2, 3]):
        sub = jax.sharding.Mesh(np.array(jax.devices())[devs], ("x",))
        with nvc.Communicator(sub, "x", max_message_bytes=1 << 16) as c:
            g = jax.jit(jax.shard_map(lambda v: nvc.all_reduce(v, c)[None], mesh=sub,
                                      in_specs=P("x"), out_specs=P("x")))
            y = rng.standard_normal((len(devs) * 2, 64)).astype(np.float32)
            got = np.asarray(g(y))
            want = y.reshape(len(devs), 2, 64).sum(0)
            for r in range(len(devs)):
                np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-6)
            c.check()
