"""ragged_all_to_all (host backend) on 8 CPU devices, bitwise against a numpy reference of
lax.ragged_all_to_all's semantics (tests/ragged_cases.py) on fresh random calls: random counts,
zero sends, all to one rank, k > 1 slices per peer, every dtype, trailing dims and 1-D
operands, int32 and int64 offsets, 2-D meshes, many consecutive calls; gradients against JAX's
autodiff of an independent pure-JAX reference (reference.ragged_all_to_all_reference), vmap,
scan, checkpoint; bad input and capacity errors; and across processes through the launcher."""
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from helpers import mesh1d
from jax_nvcomm import reference
from ragged_cases import make_call, np_grads, np_ragged_all_to_all
from test_multiprocess import launch

W = 8


@pytest.fixture(scope="module")
def comm8():
    with nvc.Communicator(mesh1d(W), "x", max_message_bytes=1 << 16) as c:
        yield c


@functools.lru_cache(maxsize=None)
def runner(comm, check_vma=True, strategy="auto"):
    """jit(shard_map) taking [W, ...] stacks (row s: rank s's argument), returning [W, M, ...]."""
    def f(x, out, io, ss, oo, rs):
        return nvc.ragged_all_to_all(x[0], out[0], io[0], ss[0], oo[0], rs[0], comm,
                                     strategy=strategy)[None]
    return jax.jit(jax.shard_map(f, mesh=comm.mesh, in_specs=(P(comm.axis_name),) * 6,
                                 out_specs=P(comm.axis_name), check_vma=check_vma))


def data(rng, shape, dtype):
    """Random values of any dtype (every bit pattern of the float8 types included, NaNs too:
    the op moves bytes)."""
    dt = jnp.dtype(dtype)
    raw = rng.integers(0, 256, shape + (dt.itemsize,), dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def check(comm, rng, dtype, row_shape, k, N, M, mode, check_vma=True, idx_dtype=np.int32,
          strategy="auto"):
    Wc = comm.world_size
    io, ss, oo, rs = (a.astype(idx_dtype) for a in make_call(rng, Wc, k, N, M, mode))
    x = data(rng, (Wc, N) + row_shape, dtype)
    out = data(rng, (Wc, M) + row_shape, dtype)
    got = runner(comm, check_vma, strategy)(x, out, io, ss, oo, rs)
    want = np_ragged_all_to_all(x, out, io, ss, oo, rs)
    assert same_bits(got, want), (mode, dtype, row_shape, k)
    return ss


DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2,
          jnp.int32, jnp.uint8]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(comm8, rng, dtype):
    """Every dtype, rows of 7 elements (an odd byte count for the 1- and 2-byte types)."""
    ss = check(comm8, rng, dtype, (7,), 1, 20, 24, "random")
    assert ss.sum() > 0


@pytest.mark.parametrize("mode", ["random", "zero", "all_to_one", "full"])
@pytest.mark.parametrize("k,row_shape", [(1, (16,)), (3, ()), (2, (2, 3))])
def test_counts_and_slices_per_peer(comm8, rng, mode, k, row_shape):
    """k slices per peer, 1-D operands and 2-D rows, sends of nothing, everything to one rank,
    every sender's operand full."""
    check(comm8, rng, jnp.float32, row_shape, k, 24, 30, mode)


@pytest.mark.parametrize("check_vma", [True, False])
def test_check_vma_settings(comm8, rng, check_vma):
    check(comm8, rng, jnp.bfloat16, (8,), 2, 16, 20, "random", check_vma=check_vma)


def test_result_types_like_lax(comm8, rng):
    """check_vma=True: the result varies over the axis (whatever output's type), has output's
    shape and dtype; out_specs=P() is refused instead of silently taking rank 0's rows."""
    seen = {}

    def f(x, io, ss, oo, rs):
        out = jnp.zeros((6, 4), x.dtype)       # invariant across the axis
        r = nvc.ragged_all_to_all(x[0], out, io[0], ss[0], oo[0], rs[0], comm8)
        seen["t"] = jax.typeof(r)
        return r

    args = [np.zeros((W, 5, 4), np.float32)] + [np.zeros((W, W), np.int32)] * 4
    jax.jit(jax.shard_map(f, mesh=comm8.mesh, in_specs=(P("x"),) * 5,
                          out_specs=P("x"))).trace(*args)
    assert seen["t"].shape == (6, 4) and seen["t"].dtype == jnp.float32
    assert "x" in getattr(seen["t"], "vma", frozenset()) or "x" in str(seen["t"]), seen["t"]
    with pytest.raises(Exception, match="vary|varying|out_specs"):
        jax.jit(jax.shard_map(f, mesh=comm8.mesh, in_specs=(P("x"),) * 5,
                              out_specs=P())).trace(*args)


def test_nothing_can_land(comm8, rng):
    """An output of no rows, or rows of no bytes: the result is output (no kernel call)."""
    for n, m, row in ((4, 0, (3,)), (4, 5, (0,))):
        x = rng.standard_normal((W, n) + row).astype(np.float32)
        out = rng.standard_normal((W, m) + row).astype(np.float32)
        idx = [np.zeros((W, W), np.int32)] * 4
        f = runner(comm8)
        assert "nvc_ragged_all_to_all" not in f.lower(x, out, *idx).as_text()
        assert same_bits(f(x, out, *idx), out)


def test_int64_offsets(rng):
    """int64 offsets and sizes (x64 on for this test only)."""
    jax.config.update("jax_enable_x64", True)
    try:
        with nvc.Communicator(mesh1d(4), "x", max_message_bytes=1 << 16) as c:
            check(c, rng, jnp.float32, (3,), 2, 12, 15, "random", idx_dtype=np.int64)
            check(c, rng, jnp.float64, (), 1, 9, 9, "full", idx_dtype=np.int64)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_strategy_xla_and_reference_agree(comm8, rng):
    """strategy="xla" (the dense emulation on CPU) and reference.ragged_all_to_all_reference
    against numpy, so both can serve as references."""
    check(comm8, rng, jnp.float32, (4,), 2, 14, 18, "random", strategy="xla")
    check(comm8, rng, jnp.float8_e5m2, (3,), 1, 10, 12, "random", strategy="xla")  # NaN bits
    io, ss, oo, rs = (a.astype(np.int32) for a in make_call(rng, W, 2, 14, 18))
    x = data(rng, (W, 14, 4), jnp.float32)
    out = data(rng, (W, 18, 4), jnp.float32)

    def f(x, out, io, ss, oo, rs):
        return reference.ragged_all_to_all_reference(x[0], out[0], io[0], ss[0], oo[0], rs[0],
                                                     axis_name="x")[None]
    got = jax.jit(jax.shard_map(f, mesh=comm8.mesh, in_specs=(P("x"),) * 6,
                                out_specs=P("x")))(x, out, io, ss, oo, rs)
    assert same_bits(got, np_ragged_all_to_all(x, out, io, ss, oo, rs))


def test_two_dim_mesh(rng):
    """A Communicator over "ep" of a ("dp", "ep") mesh: one group per dp coordinate, each with
    its own data and call; and one over "dp" (groups of 2)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "ep"))
    for axis, groups, Wg in (("ep", 2, 4), ("dp", 4, 2)):
        with nvc.Communicator(mesh, axis, max_message_bytes=1 << 16) as c:
            k, N, M, h = 2, 10, 12, 3
            calls = [make_call(rng, Wg, k, N, M) for _ in range(groups)]
            x = data(rng, (groups, Wg, N, h), jnp.float32)
            out = data(rng, (groups, Wg, M, h), jnp.float32)
            stack = [np.stack([cl[a] for cl in calls]).astype(np.int32) for a in range(4)]
            other = "dp" if axis == "ep" else "ep"
            if axis == "dp":  # arrays are [groups (ep), Wg (dp), ...]; mesh order is dp, ep
                x, out = x.swapaxes(0, 1), out.swapaxes(0, 1)
                stack = [a.swapaxes(0, 1) for a in stack]

            def f(x, out, io, ss, oo, rs):
                return nvc.ragged_all_to_all(x[0, 0], out[0, 0], io[0, 0], ss[0, 0], oo[0, 0],
                                             rs[0, 0], c)[None, None]
            spec = P("dp", "ep")
            got = np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 6,
                                                   out_specs=spec))(x, out, *stack))
            if axis == "dp":
                got, x, out = got.swapaxes(0, 1), x.swapaxes(0, 1), out.swapaxes(0, 1)
            for g in range(groups):
                want = np_ragged_all_to_all(x[g], out[g], *calls[g])
                assert same_bits(got[g], want), f"{axis}: group {g} ({other} = {g})"


def test_many_consecutive_calls(comm8, rng):
    """One program of four calls of different shapes, dtypes and k (the second uses the first's
    result), run 25 times with fresh calls; and a fori_loop of 40 calls that rotate rows."""
    shapes = [(jnp.float32, (4,), 1, 10, 12), (jnp.bfloat16, (), 3, 30, 36),
              (jnp.int32, (2, 2), 2, 8, 8), (jnp.float8_e4m3fn, (5,), 1, 6, 9)]

    def body(*a):
        outs = []
        for n in range(4):
            x, out, io, ss, oo, rs = (v[0] for v in a[6 * n: 6 * n + 6])
            if n == 1:
                x = x + outs[0][0, :1, 0].astype(x.dtype)[0]
            outs.append(nvc.ragged_all_to_all(x, out, io, ss, oo, rs, comm8)[None])
        return tuple(outs)

    f = jax.jit(jax.shard_map(body, mesh=comm8.mesh, in_specs=(P("x"),) * 24,
                              out_specs=(P("x"),) * 4))
    for it in range(25):
        args, wants = [], []
        for dtype, row, k, N, M in shapes:
            io, ss, oo, rs = (a.astype(np.int32) for a in make_call(rng, W, k, N, M))
            x = (rng.integers(-20, 20, (W, N) + row)).astype(jnp.dtype(dtype))
            out = (rng.integers(-20, 20, (W, M) + row)).astype(jnp.dtype(dtype))
            args += [x, out, io, ss, oo, rs]
        got = f(*args)
        first = np.asarray(got[0])
        for n, (dtype, row, k, N, M) in enumerate(shapes):
            x, out, io, ss, oo, rs = args[6 * n: 6 * n + 6]
            if n == 1:
                x = (x.astype(np.float32) + first[:, 0, 0].astype(np.float32)[:, None]
                     ).astype(x.dtype)
            want = np_ragged_all_to_all(x, out, io, ss, oo, rs)
            assert same_bits(got[n], want), f"run {it} call {n}"

    # a loop of 40 calls in one program, each moving the previous one's result (rows nothing
    # lands on become -1), against 40 numpy steps
    k, N = 1, 16
    io, ss, oo, rs = (a.astype(np.int32) for a in make_call(rng, W, k, N, N, "full",
                                                            max_size=2))

    def loop(x, io, ss, oo, rs):
        def step(_, v):
            return nvc.ragged_all_to_all(v, v * 0 - 1, io[0], ss[0], oo[0], rs[0], comm8)
        return lax.fori_loop(0, 40, step, x[0])[None]
    x = rng.standard_normal((W, N, 3)).astype(np.float32)
    got = jax.jit(jax.shard_map(loop, mesh=comm8.mesh, in_specs=(P("x"),) * 5,
                                out_specs=P("x")))(x, io, ss, oo, rs)
    want = x
    for _ in range(40):
        want = np_ragged_all_to_all(want, np.full_like(want, -1), io, ss, oo, rs)
    assert same_bits(got, want)


# ---------------------------------------------------------------------------------------------
# gradients and transformations

def grad_setup(rng, Wc=W, k=2, N=14, M=18, h=4):
    io, ss, oo, rs = (a.astype(np.int32) for a in make_call(rng, Wc, k, N, M))
    x = rng.standard_normal((Wc, N, h)).astype(np.float32)
    out = rng.standard_normal((Wc, M, h)).astype(np.float32)
    t = rng.standard_normal((Wc, M, h)).astype(np.float32)
    return x, out, io, ss, oo, rs, t


def op_of(comm, which):
    if which == "ours":
        return lambda *a: nvc.ragged_all_to_all(*a, comm)
    return lambda *a: reference.ragged_all_to_all_reference(*a, axis_name=comm.axis_name)


@pytest.mark.parametrize("check_vma", [True, False])
def test_gradients(comm8, rng, check_vma):
    """grad to operand and output: against numpy and against JAX's autodiff of the reference
    (all_gather + scatter), under both check_vma settings."""
    args = grad_setup(rng)

    def make(which):
        op = op_of(comm8, which)

        def loss(x, out, io, ss, oo, rs, t):
            return jnp.sum(op(x[0], out[0], io[0], ss[0], oo[0], rs[0]) * t[0])[None]
        f = jax.shard_map(loss, mesh=comm8.mesh, in_specs=(P("x"),) * 7, out_specs=P("x"),
                          check_vma=check_vma)
        return jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1)))

    dx, dout = make("ours")(*args)
    rx, rout = make("reference")(*args)
    nx, nout = np_grads(*args)
    np.testing.assert_array_equal(np.asarray(dx), nx)
    np.testing.assert_array_equal(np.asarray(dout), nout)
    np.testing.assert_array_equal(np.asarray(rx), nx)      # the reference agrees too
    np.testing.assert_array_equal(np.asarray(rout), nout)
    assert np.abs(nx).sum() > 0 and (nout == 0).any() and (nout != 0).any()


def test_vmap_folds_into_one_call(comm8, rng):
    """jax.vmap inside shard_map: one kernel call for the batch (lax's folding), each example
    equal to numpy; with batched and with shared (unbatched) output / offsets; nested vmap."""
    B, k, N, M, h = 3, 2, 10, 12, 3
    calls = [[a.astype(np.int32) for a in make_call(rng, W, k, N, M)] for _ in range(B)]
    idx = [np.stack([c[a] for c in calls], 1) for a in range(4)]            # [W, B, K]
    x = data(rng, (W, B, N, h), jnp.float32)
    out = data(rng, (W, B, M, h), jnp.float32)

    def body(x, out, io, ss, oo, rs):
        op = jax.vmap(lambda *a: nvc.ragged_all_to_all(*a, comm8))
        return op(x[0], out[0], io[0], ss[0], oo[0], rs[0])[None]
    f = jax.jit(jax.shard_map(body, mesh=comm8.mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
    hlo = f.lower(x, out, *idx).as_text()
    assert hlo.count("@nvc_ragged_all_to_all(") == 1, hlo.count("@nvc_ragged_all_to_all(")
    got = np.asarray(f(x, out, *idx))
    for b in range(B):
        want = np_ragged_all_to_all(x[:, b], out[:, b], *calls[b])
        assert same_bits(got[:, b], want), f"example {b}"

    # output and offsets shared by the batch (in_axes None): the same call per example
    def shared(x, out, io, ss, oo, rs):
        op = jax.vmap(lambda v: nvc.ragged_all_to_all(v, out[0], io[0], ss[0], oo[0], rs[0],
                                                      comm8))
        return op(x[0])[None]
    g = jax.jit(jax.shard_map(shared, mesh=comm8.mesh, in_specs=(P("x"),) * 6,
                              out_specs=P("x")))
    c0 = calls[0]
    got = np.asarray(g(x, out[:, 0], *c0))
    for b in range(B):
        assert same_bits(got[:, b], np_ragged_all_to_all(x[:, b], out[:, 0], *c0)), b

    # nested: vmap(vmap(.)) over [2, B] is one call too
    def nested(x, out, io, ss, oo, rs):
        inner = jax.vmap(lambda *a: nvc.ragged_all_to_all(*a, comm8))
        return jax.vmap(inner)(x[0], out[0], io[0], ss[0], oo[0], rs[0])[None]
    two = [np.stack([a, a[:, ::-1]], 1) for a in (x, out) + tuple(idx)]       # [W, 2, B, ...]
    h2 = jax.jit(jax.shard_map(nested, mesh=comm8.mesh, in_specs=(P("x"),) * 6,
                               out_specs=P("x")))
    assert h2.lower(*two).as_text().count("@nvc_ragged_all_to_all(") == 1
    got = np.asarray(h2(*two))
    for a in range(2):
        for b in range(B):
            bb = b if a == 0 else B - 1 - b
            want = np_ragged_all_to_all(x[:, bb], out[:, bb], *calls[bb])
            assert same_bits(got[:, a, b], want), (a, b)


def test_grad_under_vmap_scan_checkpoint(comm8, rng):
    """grad of a scan of (ragged_all_to_all -> tanh(. * w)) steps, with jax.checkpoint around
    each step, under vmap, and vmap of the gradient: equal to the same program on the
    reference (JAX autodiff), to 1e-6."""
    B, k, N, h, steps = 2, 1, 12, 4, 3
    calls = [[a.astype(np.int32) for a in make_call(rng, W, k, N, N, "full")] for _ in range(B)]
    idx = [np.stack([c[a] for c in calls], 1) for a in range(4)]            # [W, B, K]
    x = rng.standard_normal((W, B, N, h)).astype(np.float32)
    w = rng.standard_normal((W, h)).astype(np.float32)

    def make(which, mode):
        op = op_of(comm8, which)

        def one(x, w, io, ss, oo, rs):                # one example: scalar loss
            @jax.checkpoint
            def step(v, _):
                r = op(v, jnp.zeros_like(v), io, ss, oo, rs)
                return jnp.tanh(r * w), None
            v, _ = lax.scan(step, x, None, length=steps)
            return jnp.sum(v * v)

        def body(x, w, io, ss, oo, rs):
            args = (x[0], w[0], io[0], ss[0], oo[0], rs[0])
            if mode == "vmap_of_grad":
                g = jax.vmap(jax.grad(one, argnums=(0, 1)), in_axes=(0, None, 0, 0, 0, 0))
                gx, gw = g(*args)
                return gx[None], gw.sum(0)[None]
            gx, gw = jax.grad(lambda *a: jax.vmap(one, in_axes=(0, None, 0, 0, 0, 0))(
                *a).sum(), argnums=(0, 1))(*args)
            return gx[None], gw[None]
        return jax.jit(jax.shard_map(body, mesh=comm8.mesh, in_specs=(P("x"),) * 6,
                                     out_specs=(P("x"), P("x"))))

    for mode in ("vmap_of_grad", "grad_of_vmap"):
        f = make("ours", mode)
        assert f.lower(x, w, *idx).as_text().count("@nvc_ragged_all_to_all(") >= 1
        gx, gw = f(x, w, *idx)
        rx, rw = make("reference", mode)(x, w, *idx)
        np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-6, atol=1e-6,
                                   err_msg=mode)
        np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), rtol=1e-6, atol=1e-6,
                                   err_msg=mode)
        assert np.abs(np.asarray(gx)).sum() > 0


# ---------------------------------------------------------------------------------------------
# errors

def run_once(comm, x, out, io, ss, oo, rs):
    return np.asarray(runner(comm)(x, out, io, ss, oo, rs))


@pytest.mark.parametrize("case", ["input_past_n", "output_negative", "sizes_disagree"])
def test_bad_input_fails_named(rng, case):
    """A slice outside operand/output on rank 2 fails the call there (the record names rank 2,
    the slice and the bound it breaks; the others report rank 2 at once), and a recv_sizes entry
    of rank 0 that disagrees with what rank 1 sends fails on rank 0 naming rank 1, the slice and
    both counts. Never garbage, never a hang (the 5 s timeout is never reached); the
    communicators of the poisoned calls refuse later calls."""
    Wc, k, N, M = 4, 2, 10, 12
    io, ss, oo, rs = (a.astype(np.int32) for a in make_call(rng, Wc, k, N, M, max_size=2))
    x = rng.standard_normal((Wc, N, 3)).astype(np.float32)
    out = rng.standard_normal((Wc, M, 3)).astype(np.float32)
    if case == "input_past_n":
        io[2, 3], ss[2, 3] = N - 1, 3          # slice 3 of rank 2 (to rank 1) ends past N
        rs[1, 2 * k + 1] = 3
        want = (r"rank 2: slice i=3 of rank 2's call lies outside operand/output: "
                r"input_offsets\[i\] \+ send_sizes\[i\] > N")
    elif case == "output_negative":
        oo[2, 6] = -1                          # slice 6 of rank 2 (to rank 3) lands at -1
        want = (r"rank 2: slice i=6 of rank 2's call lies outside operand/output: "
                r"output_offsets\[i\] < 0")
    else:
        sent = int(ss[1, 0 * k + 1])           # rank 1's slice 1 to rank 0
        rs[0, 1 * k + 1] = sent + 2
        want = (rf"rank 0: rank 1 sends {sent} rows in its slice j=1 to rank 0, but rank 0's "
                rf"recv_sizes expects {sent + 2}")
    with nvc.Communicator(mesh1d(Wc), "x", max_message_bytes=1 << 16, timeout_s=5) as c:
        t0 = time.monotonic()
        with pytest.raises(Exception, match="ragged_all_to_all call #1: rank"):
            run_once(c, x, out, io, ss, oo, rs)
        assert time.monotonic() - t0 < 4, "waited for a timeout instead of failing at once"
        errs = "\n".join(c.errors())
        assert re.search(want, errs), (want, errs)
        if case != "sizes_disagree":           # the others learn it from rank 2's poisoned flag
            for r in (0, 1, 3):
                assert f"rank {r}: rank 2 failed this call (bad input found there" in errs
            with pytest.raises(Exception, match="communicator is unusable after this error"):
                run_once(c, x, out, io, ss, oo, rs)


@pytest.mark.parametrize("k", [3, 300])
def test_recv_error_names_the_slice(rng, k):
    """A recv_sizes entry that disagrees with what its sender sends: the record names the
    sender's slice j (of its k slices to the receiver) and both counts, for k > 1 and for
    k > 256 (j past 8 bits), from a peer's slice (rank 0 expects more from rank 1's slice j0)
    and from the rank's own (rank 1 expects more from its own slice j1)."""
    Wc, N, M = 2, 4 * k, 4 * k
    io, ss, oo, rs = (a.astype(np.int32) for a in make_call(rng, Wc, k, N, M, max_size=2))
    j0, j1 = (int(rng.integers(max(1, k - 40), k)) for _ in range(2))  # > 256 when k = 300
    sent0 = int(ss[1, 0 * k + j0])             # rank 1's slice j0 to rank 0
    sent1 = int(ss[1, 1 * k + j1])             # rank 1's slice j1 to itself
    rs[0, 1 * k + j0] = sent0 + 2
    rs[1, 1 * k + j1] = sent1 + 1
    x = rng.standard_normal((Wc, N, 2)).astype(np.float32)
    out = rng.standard_normal((Wc, M, 2)).astype(np.float32)
    with nvc.Communicator(mesh1d(Wc), "x", max_message_bytes=1 << 16, timeout_s=5) as c:
        with pytest.raises(Exception, match="ragged_all_to_all call #1: rank"):
            run_once(c, x, out, io, ss, oo, rs)
        errs = c.errors()
    assert len(errs) == 2, errs
    want0 = (f"rank 0: rank 1 sends {sent0} rows in its slice j={j0} to rank 0, but rank 0's "
             f"recv_sizes expects {sent0 + 2}:")
    want1 = (f"rank 1: rank 1 sends {sent1} rows in its slice j={j1} to rank 1, but rank 1's "
             f"recv_sizes expects {sent1 + 1}:")
    assert any(want0 in e for e in errs), (want0, errs)
    assert any(want1 in e for e in errs), (want1, errs)


def test_bad_slice_error_gives_the_numbers(rng):
    """The failing rank's own error adds the slice's numbers to the record's text (one rank, so
    the error raised is that rank's)."""
    io, ss, oo, rs = (np.array([[v]], np.int32) for v in (2, 4, 7, 4))
    x = rng.standard_normal((1, 5, 2)).astype(np.float32)
    out = rng.standard_normal((1, 9, 2)).astype(np.float32)
    with nvc.Communicator(mesh1d(1), "x", max_message_bytes=1 << 16, timeout_s=5) as c:
        with pytest.raises(Exception, match=re.escape(
                "rank 0: slice i=0 of rank 0's call lies outside operand/output: "
                "input_offsets[i] + send_sizes[i] > N (the operand's rows) (input_offsets[0]=2, "
                "send_sizes[0]=4, output_offsets[0]=7; operand rows N=5, output rows M=9; the "
                "slice goes to rank 0)")):
            run_once(c, x, out, io, ss, oo, rs)


def _custom_calls(f, *args):
    """The ragged custom calls of f's program and their chunk_bytes attributes."""
    hlo = f.lower(*args).as_text()
    return re.findall(r"custom_call @nvc_ragged_all_to_all\(.*?chunk_bytes = (\d+)", hlo)


@pytest.mark.parametrize("W_,k,chunk,idx", [(8, 1, None, np.int32), (8, 3, 256, np.int32),
                                             (4, 2, 1000, np.int64), (2, 1, 4096, np.int32)])
def test_outputs_many_times_the_buffers(rng, W_, k, chunk, idx):
    """Outputs of 64+ x max_message_bytes run our kernel (the chunked path: the custom call
    with chunk_bytes > 0 in the program), equal numpy bitwise, and leave comm.nbytes as it was;
    every routing pattern, int32 and int64 offsets, slots of 256 B to the largest."""
    if idx == np.int64:
        jax.config.update("jax_enable_x64", True)
    try:
        with nvc.Communicator(mesh1d(W_), "x", max_message_bytes=4096,
                              ragged_chunk_bytes=chunk) as c:
            nb = c.nbytes
            h = 64
            M = 64 * c.max_message_bytes // (h * 4) + 8     # >= 64 x max_message_bytes
            N = M
            for mode in ("random", "all_to_one", "full", "zero"):
                io, ss, oo, rs = (a.astype(idx) for a in make_call(rng, W_, k, N, M, mode))
                x, out = data(rng, (W_, N, h), np.float32), data(rng, (W_, M, h), np.float32)
                f = runner(c)
                attrs = _custom_calls(f, x, out, io, ss, oo, rs)
                want_chunk = nvc.ragged.chunk_bytes(c, M, h * 4, k)
                assert attrs == [str(want_chunk)] and want_chunk > 0, attrs
                if chunk is not None:
                    assert want_chunk == min(chunk // 256 * 256, nvc.ragged.chunk_max(c, k))
                assert M * h * 4 >= 64 * c.max_message_bytes
                got = f(x, out, io, ss, oo, rs)
                assert same_bits(got, np_ragged_all_to_all(x, out, io, ss, oo, rs)), mode
                assert c.nbytes == nb
            assert not c.errors()
    finally:
        jax.config.update("jax_enable_x64", False)


def test_chunked_equals_one_round(comm8, rng):
    """strategy="chunked" (the chunked path where one round would do) gives the one-round
    result bitwise, calls after calls, alternating the two paths on one communicator."""
    for i in range(6):
        mode = ("random", "full", "all_to_one")[i % 3]
        io, ss, oo, rs = (a.astype(np.int32) for a in make_call(rng, W, 2, 30, 40, mode))
        x, out = data(rng, (W, 30, 5), jnp.bfloat16), data(rng, (W, 40, 5), jnp.bfloat16)
        one, chunked = runner(comm8), runner(comm8, strategy="chunked")
        assert _custom_calls(one, x, out, io, ss, oo, rs) == ["0"]
        assert int(_custom_calls(chunked, x, out, io, ss, oo, rs)[0]) > 0
        a, b = one(x, out, io, ss, oo, rs), chunked(x, out, io, ss, oo, rs)
        assert same_bits(a, b) and same_bits(a, np_ragged_all_to_all(x, out, io, ss, oo, rs))


def test_big_vmap_gradient_and_world1(rng):
    """The chunked path under jax.vmap (a batch that folds into one call far beyond the
    buffers) and under jax.grad (both directions chunked, against numpy), and at world 1 (an
    output 64 x max_message_bytes: only the rank's own slices, no slot)."""
    Wc, k, N, M, h = 4, 1, 300, 400, 16
    with nvc.Communicator(mesh1d(Wc), "x", max_message_bytes=4096) as c:
        B = 3
        calls = [[a.astype(np.int32) for a in make_call(rng, Wc, k, N, M)] for _ in range(B)]
        idx = [np.stack([cl[a] for cl in calls], 1) for a in range(4)]
        xb, ob = data(rng, (Wc, B, N, h), np.float32), data(rng, (Wc, B, M, h), np.float32)
        fv = jax.jit(jax.shard_map(
            lambda *a: jax.vmap(lambda *b: nvc.ragged_all_to_all(*b, c))(*(v[0] for v in a))[None],
            mesh=c.mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
        assert len(_custom_calls(fv, xb, ob, *idx)) == 1
        got = np.asarray(fv(xb, ob, *idx))
        for b in range(B):
            assert same_bits(got[:, b], np_ragged_all_to_all(xb[:, b], ob[:, b], *calls[b])), b

        io, ss, oo, rs = calls[0]
        x = rng.standard_normal((Wc, N, h)).astype(np.float32)
        out = rng.standard_normal((Wc, M, h)).astype(np.float32)
        t = rng.standard_normal((Wc, M, h)).astype(np.float32)

        def loss(x, out, io, ss, oo, rs, t):
            r = nvc.ragged_all_to_all(x[0], out[0], io[0], ss[0], oo[0], rs[0], c)
            return jnp.sum(r * t[0])[None]
        f = jax.shard_map(loss, mesh=c.mesh, in_specs=(P("x"),) * 7, out_specs=P("x"))
        g = jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1)))
        assert set(_custom_calls(g, x, out, io, ss, oo, rs, t)) - {"0"}, "no chunked call"
        dx, dout = g(x, out, io, ss, oo, rs, t)
        want_dx, want_dout = np_grads(x, out, io, ss, oo, rs, t)
        np.testing.assert_array_equal(np.asarray(dx), want_dx)
        np.testing.assert_array_equal(np.asarray(dout), want_dout)
    with nvc.Communicator(mesh1d(1), "x", max_message_bytes=4096) as c1:
        M1 = 64 * 4096 // 64 + 3
        io, ss, oo, rs = (a.astype(np.int32) for a in make_call(rng, 1, 2, M1, M1, "full"))
        x, out = data(rng, (1, M1, 16), np.float32), data(rng, (1, M1, 16), np.float32)
        f = runner(c1)
        assert int(_custom_calls(f, x, out, io, ss, oo, rs)[0]) > 0
        assert same_bits(f(x, out, io, ss, oo, rs), np_ragged_all_to_all(x, out, io, ss, oo, rs))


@pytest.mark.parametrize("case", ["bad_slice", "sizes_disagree", "world1_send_past_n"])
def test_chunked_errors_named(rng, case):
    """On the chunked path: a bad slice on rank 2 (named there; the others name rank 2 at
    once), a recv_sizes entry that disagrees (named on the receiver; the sender, which waits
    for that receiver's acknowledgements, names it at once instead of timing out), and at
    world 1 a send size far beyond the operand (the named error, as at every world size)."""
    Wc = 1 if case.startswith("world1") else 4
    k, N, M, h = 1, 400, 500, 16
    io, ss, oo, rs = (a.astype(np.int32) for a in make_call(rng, Wc, k, N, M, "full"))
    x = rng.standard_normal((Wc, N, h)).astype(np.float32)
    out = rng.standard_normal((Wc, M, h)).astype(np.float32)
    if case == "bad_slice":
        oo[2, 1] = M - ss[2, 1] + 1
        want = [r"rank 2: slice i=1 of rank 2's call lies outside operand/output: "
                r"output_offsets\[i\] \+ send_sizes\[i\] > M"]
        # found before any round-0 flag went out: the others read rank 2's poison there (a
        # rank failing after it poisons only its round counters, never the flags)
        want += [rf"rank {r}: rank 2 failed this call" for r in (0, 1, 3)]
    elif case == "sizes_disagree":
        sent = int(ss[1, 0])                   # rank 1's slice to rank 0
        rs[0, 1] = sent + 5
        want = [rf"rank 0: rank 1 sends {sent} rows in its slice j=0 to rank 0, but rank 0's "
                rf"recv_sizes expects {sent + 5}", r"rank 1: rank \d failed this call"]
    else:
        ss[0, 0] = 10 ** 6
        rs[0, 0] = 10 ** 6
        want = [r"rank 0: slice i=0 of rank 0's call lies outside operand/output: "
                r"input_offsets\[i\] \+ send_sizes\[i\] > N"]
    with nvc.Communicator(mesh1d(Wc), "x", max_message_bytes=4096, timeout_s=5) as c:
        assert int(_custom_calls(runner(c), x, out, io, ss, oo, rs)[0]) > 0
        t0 = time.monotonic()
        with pytest.raises(Exception, match="ragged_all_to_all call #1: rank"):
            run_once(c, x, out, io, ss, oo, rs)
        assert time.monotonic() - t0 < 4, "waited for a timeout instead of failing at once"
        errs = "\n".join(c.errors())
        for w_ in want:
            assert re.search(w_, errs), (w_, errs)
        with pytest.raises(Exception, match="communicator is unusable after this error"):
            run_once(c, x, out, io, ss, oo, rs)


def test_header_too_big_on_cpu(rng):
    """Only a slice header (16 bytes x k x world) the flag half cannot hold is refused: a
    ValueError naming the sizes and the max_message_bytes that would hold it; with that size
    it runs. Bad ragged_chunk_bytes is refused at the Communicator."""
    Wc, k, h = 4, 300, 1
    io, ss, oo, rs = (a.reshape(Wc, -1).astype(np.int32)
                      for a in make_call(rng, Wc, k, 40, 40, max_size=1))
    x = rng.standard_normal((Wc, 40, h)).astype(np.float32)
    out = rng.standard_normal((Wc, 40, h)).astype(np.float32)
    with nvc.Communicator(mesh1d(Wc), "x", max_message_bytes=4096) as c:
        with pytest.raises(ValueError, match=r"k=300 slices per peer over 4 ranks need a slice "
                                             r"header of 19200 bytes.*max_message_bytes=4096.*"
                                             r"max_message_bytes >= (\d+)") as e:
            runner(c).lower(x, out, io, ss, oo, rs)
        need = int(re.search(r">= (\d+)", str(e.value)).group(1))
    with nvc.Communicator(mesh1d(Wc), "x", max_message_bytes=need) as c:
        assert same_bits(run_once(c, x, out, io, ss, oo, rs),
                         np_ragged_all_to_all(x, out, io, ss, oo, rs))
    for bad in (255, 1.5, True):
        with pytest.raises(ValueError, match="ragged_chunk_bytes must be None or an int >= 256"):
            nvc.Communicator(mesh1d(2), "x", ragged_chunk_bytes=bad)


def test_argument_errors(comm8):
    """Bad arguments are refused at trace time, naming the argument, expected and actual."""
    x = np.zeros((W, 5, 3), np.float32)
    out = np.zeros((W, 6, 3), np.float32)
    idx = np.zeros((W, W), np.int32)

    def lower(fn, *a):
        return jax.jit(jax.shard_map(fn, mesh=comm8.mesh, in_specs=(P("x"),) * len(a),
                                     out_specs=P("x"))).lower(*a)

    cases = [
        (lambda x, o, i: nvc.ragged_all_to_all(x[0], o[0].astype(jnp.bfloat16), i[0], i[0],
                                               i[0], i[0], comm8),
         TypeError, "output must have operand's dtype float32, got bfloat16"),
        (lambda x, o, i: nvc.ragged_all_to_all(x[0], o[0, :, :2], i[0], i[0], i[0], i[0],
                                               comm8),
         ValueError, r"output must have operand's trailing dims \(3,\), got shape \(6, 2\)"),
        (lambda x, o, i: nvc.ragged_all_to_all(x[0], o[0], i[0, :5], i[0, :5], i[0, :5],
                                               i[0, :5], comm8),
         ValueError, "k \\* world_size entries \\(world_size=8, k >= 1 slices per peer\\), got 5"),
        (lambda x, o, i: nvc.ragged_all_to_all(x[0], o[0], i[0], i[0, :4], i[0], i[0], comm8),
         ValueError, "send_sizes must have input_offsets' length 8, got 4"),
        (lambda x, o, i: nvc.ragged_all_to_all(x[0], o[0], i[0], i[0].astype(jnp.float32),
                                               i[0], i[0], comm8),
         ValueError, r"ragged_all_to_all send_sizes must be integer type\."),
        (lambda x, o, i: nvc.ragged_all_to_all(x[0], o[0], i[0], i[0], i[0], i[0], comm8,
                                               strategy="fast"),
         ValueError, "strategy must be one of \\('auto', 'xla', 'chunked'\\), got 'fast'"),
        (lambda x, o, i: nvc.ragged_all_to_all(x[0], o[0], i[0], i[0], i[0], i[0], "y"),
         ValueError, r"no Communicator for axis_name 'y'"),  # lax's positional form
        (lambda x, o, i: nvc.ragged_all_to_all(x[0], o[0], i[0], i[0], i[0], i[0], 3),
         TypeError, "comm must be a jax_nvcomm.Communicator, got int"),
        (lambda x, o, i: nvc.ragged_all_to_all(x[0, 0, 0], o[0], i[0], i[0], i[0], i[0], comm8),
         ValueError, r"operand and output must be arrays \[N, ...\] and \[M, ...\]"),
    ]
    for fn, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            lower(fn, x, out, idx)
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        nvc.ragged_all_to_all(x[0], out[0], idx[0], idx[0], idx[0], idx[0], comm8)
    # mixed integer dtypes (lax takes them) are accepted: test_ragged_forms.py


@pytest.mark.multiprocess
def test_bad_slice_across_processes():
    """ragged_mp.py --fault=1: the last rank's bad slice ends the call on both processes with
    records naming it (and its slice and bound), and later calls are refused."""
    rc, out = launch(2, "ragged_mp.py", "--fault=1", timeout=120)
    assert rc == 0, out[-4000:]
    assert out.count("PASS ragged fault") == 2, out[-4000:]
    assert "rank 0: rank 1 failed this call" in out, out[-4000:]
    assert "(input_offsets[1]=11, send_sizes[1]=3" in out, out[-4000:]


@pytest.mark.multiprocess
@pytest.mark.parametrize("n,rounds,x64", [(2, 40, 0), (4, 16, 1)])
def test_ragged_across_processes(n, rounds, x64):
    """tests/mp/ragged_mp.py: random calls, a loop, vmap and gradients, one rank per process;
    int64 offsets in the 4-process run."""
    rc, out = launch(n, "ragged_mp.py", f"--rounds={rounds}", f"--x64={x64}", timeout=400)
    assert rc == 0, out[-4000:]
    assert out.count("PASS ragged") == n, out[-4000:]
