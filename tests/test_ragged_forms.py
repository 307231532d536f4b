"""ragged_all_to_all in the forms lax takes (docs/API.md "ragged_all_to_all"), after jax's own
ragged collective tests, in our words, with lax's call form kept (axis_name=,
axis_index_groups=, check_grads in both modes) on our op, on 8 CPU devices, against a numpy
reference written here: forward mode (jax.jvp, eager and jitted), axis_index_groups (lax's
semantics, degenerate groups of one too), vmap of multi-dim operands, mixed index dtypes, and
lax's error texts."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nvcomm as nvc
from conftest import make_mesh


@pytest.fixture(autouse=True)
def _clean():
    yield
    nvc.close_all()


def np_ragged(operands, outputs, io, ss, oo, rs, groups):
    """numpy float64 reference: per rank r, outputs[r] with every slice sent to it written at
    the sender's output offset (lax's semantics), within r's group."""
    outs = [np.array(o, np.float64, copy=True) for o in outputs]
    W = len(operands)
    for grp in groups:
        g = len(grp)
        k = len(io[grp[0]]) // g
        for js, s in enumerate(grp):
            for jr, r in enumerate(grp):
                for t in range(k):
                    i = jr * k + t
                    n = int(ss[s][i])
                    assert int(rs[r][js * k + t]) == n  # the case is consistent
                    outs[r][int(oo[s][i]):int(oo[s][i]) + n] = \
                        np.asarray(operands[s], np.float64)[int(io[s][i]):int(io[s][i]) + n]
    assert sorted(x for grp in groups for x in grp) == list(range(W))
    return outs


def random_case(rng, W, groups, k, row_shape=(), max_rows=3, dtype=np.float32):
    """Consistent per-rank index arrays [W, k * g] (group-local slots) and data: rank s sends
    n[s, r, t] rows to the j-th rank r of its group in slot j * k + t, packed in order in its
    operand; they land packed in (sender, slot) order in the receiver's output."""
    n = rng.integers(0, max_rows + 1, (W, W, k))
    g = len(groups[0])
    io = np.zeros((W, g * k), np.int32)
    ss = np.zeros((W, g * k), np.int32)
    oo = np.zeros((W, g * k), np.int32)
    rs = np.zeros((W, g * k), np.int32)
    N = M = 1
    for grp in groups:
        for s in grp:
            off = 0
            for jr, r in enumerate(grp):
                for t in range(k):
                    io[s, jr * k + t], ss[s, jr * k + t] = off, n[s, r, t]
                    off += n[s, r, t]
            N = max(N, off)
        for r in grp:
            off = 0
            for js, s in enumerate(grp):
                jr = grp.index(r)
                for t in range(k):
                    oo[s, jr * k + t] = off
                    rs[r, js * k + t] = n[s, r, t]
                    off += n[s, r, t]
            M = max(M, off)
    N, M = N + 1, M + 2  # spare rows: rows that keep their values / are never sent
    operand = rng.standard_normal((W, N) + row_shape).astype(dtype)
    output = rng.standard_normal((W, M) + row_shape).astype(dtype)
    return operand, output, io, ss, oo, rs


def sharded(mesh, f, n_in=6, check_vma=True, jit=True):
    """f on each rank's [1, ...] blocks of [W, ...] arrays, as jax's tests call it."""
    def body(*a):
        return f(*(x[0] for x in a))[None]
    g = jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * n_in, out_specs=P("x"),
                      check_vma=check_vma)
    return jax.jit(g) if jit else g


def ours(**kw):
    return lambda *a: nvc.ragged_all_to_all(*a, axis_name="x", **kw)


@pytest.mark.parametrize("W,k,row_shape", [(2, 1, ()), (8, 1, (3,)), (8, 2, (2, 2)),
                                           (4, 3, ())])
def test_forward_against_numpy(rng, W, k, row_shape):
    mesh = make_mesh((W,), ("x",))
    groups = [tuple(range(W))]
    case = random_case(rng, W, groups, k, row_shape)
    with nvc.communicators(mesh, max_message_bytes=1 << 16):
        f = sharded(mesh, ours())
        assert "nvc_ragged_all_to_all" in f.lower(*case).as_text()
        got = np.asarray(f(*case))
    want = np_ragged(*case, groups)
    for r in range(W):
        np.testing.assert_array_equal(got[r], want[r].astype(np.float32))


@pytest.mark.parametrize("check_vma", [True, False])
def test_check_grads_both_modes(rng, check_vma):
    """jax's gradient test's form: check_grads of the (not jitted) shard_mapped op in operand
    and output, forward and reverse mode (forward failed with "can't apply forward-mode
    autodiff (jvp) to a custom_vjp function", and eagerly with "unhashable type: 'list'")."""
    W = 4
    mesh = make_mesh((W,), ("x",))
    operand, output, *idx = random_case(rng, W, [tuple(range(W))], 2, (3,),
                                        dtype=np.float64 if jax.config.jax_enable_x64
                                        else np.float32)
    with nvc.communicators(mesh, max_message_bytes=1 << 16):
        f = sharded(mesh, ours(), check_vma=check_vma, jit=False)
        check_grads(lambda a, b: f(a, b, *idx), (operand, output), order=1,
                    modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)


def test_jvp_is_the_op_on_the_tangents(rng):
    """The op is linear: the tangent is the op applied to the tangents (bitwise), in ONE call
    of the kernel per op (primal and tangent rows travel together)."""
    W = 8
    mesh = make_mesh((W,), ("x",))
    operand, output, *idx = random_case(rng, W, [tuple(range(W))], 1, (4,))
    t_op = rng.standard_normal(operand.shape).astype(np.float32)
    t_out = rng.standard_normal(output.shape).astype(np.float32)
    with nvc.communicators(mesh, max_message_bytes=1 << 16):
        f = sharded(mesh, ours())
        g = sharded(mesh, ours(), jit=False)  # jax.jvp of the op's trace (inside one jit)
        jvp = jax.jit(lambda a, b, ta, tb: jax.jvp(lambda x, y: g(x, y, *idx), (a, b),
                                                     (ta, tb)))
        text = jvp.lower(operand, output, t_op, t_out).as_text()
        assert text.count("nvc_ragged_all_to_all") == 1
        y, ty = jvp(operand, output, t_op, t_out)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(f(operand, output, *idx)))
        np.testing.assert_array_equal(np.asarray(ty), np.asarray(f(t_op, t_out, *idx)))
        # eagerly (the shard_map outside jit), as jax's tests call it
        y2, ty2 = jax.jvp(lambda x, y: sharded(mesh, ours(), jit=False)(x, y, *idx),
                          (operand, output), (t_op, t_out))
        np.testing.assert_array_equal(np.asarray(ty2), np.asarray(ty))


def test_forward_mode_of_a_traced_program(rng):
    """jax.jvp of a program traced before (jax.jvp(jax.jit(f)), where lax's op works too; a
    custom_vjp was refused there), jacfwd of a gradient and vmap of a gradient: against the op
    on the tangents and lax's transpose rule (the numpy-checked forward, transposed)."""
    W = 4
    mesh = make_mesh((W,), ("x",))
    operand, output, *idx = random_case(rng, W, [tuple(range(W))], 2, (3,))
    t_op = rng.standard_normal(operand.shape).astype(np.float32)
    t_out = rng.standard_normal(output.shape).astype(np.float32)
    with nvc.communicators(mesh, max_message_bytes=1 << 16):
        f = sharded(mesh, ours())                      # jitted before jvp sees it
        text = jax.jit(lambda *a: jax.jvp(lambda a, b: f(a, b, *idx), a[:2], a[2:])).lower(
            operand, output, t_op, t_out).as_text()
        assert text.count("nvc_ragged_all_to_all") == 2   # the primal's call, the tangent's
        y, ty = jax.jvp(lambda a, b: f(a, b, *idx), (operand, output), (t_op, t_out))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(f(operand, output, *idx)))
        np.testing.assert_array_equal(np.asarray(ty), np.asarray(f(t_op, t_out, *idx)))
        want = np_ragged(t_op, t_out, *idx, [tuple(range(W))])
        for r in range(W):
            np.testing.assert_array_equal(np.asarray(ty)[r], want[r].astype(np.float32))
        c = rng.standard_normal(output.shape).astype(np.float32)

        def loss(a, b):
            return jnp.sum(c * f(a, b, *idx) ** 2)

        # against the gradient of the pure-JAX emulation from dense all_to_alls
        from jax_nvcomm import reference
        dense = sharded(mesh, lambda *a: reference.ragged_all_to_all_xla(*a, axis_name="x"))
        ga, gb = jax.jit(jax.grad(loss, argnums=(0, 1)))(operand, output)
        wa, wb = jax.grad(lambda a, b: jnp.sum(c * dense(a, b, *idx) ** 2),
                          argnums=(0, 1))(operand, output)
        np.testing.assert_allclose(np.asarray(ga), np.asarray(wa), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(gb), np.asarray(wb), rtol=1e-6, atol=1e-6)
        h = jax.jacfwd(jax.grad(lambda a: loss(a, output)))(operand)   # forward over reverse
        assert h.shape == operand.shape * 2 and np.isfinite(np.asarray(h)).all()
        # the Hessian of a quadratic form: symmetric
        hm = np.asarray(h).reshape(operand.size, operand.size)
        np.testing.assert_allclose(hm, hm.T, rtol=1e-5, atol=1e-5)
        gv = jax.vmap(jax.grad(lambda a, s: jnp.sum(c * f(a * s, output, *idx) ** 2)),
                      in_axes=(None, 0))(operand, jnp.array([1.0, 2.0]))
        np.testing.assert_allclose(np.asarray(gv[1]), 4 * np.asarray(gv[0]), rtol=1e-5,
                                   atol=1e-5)


def test_jvp_of_integer_rows_has_no_tangent(rng):
    W = 4
    mesh = make_mesh((W,), ("x",))
    operand, output, *idx = random_case(rng, W, [tuple(range(W))], 1)
    operand, output = operand.astype(np.int32) * 7, output.astype(np.int32)
    with nvc.communicators(mesh, max_message_bytes=1 << 16):
        f = sharded(mesh, ours())
        g = sharded(mesh, ours(), jit=False)
        y, ty = jax.jvp(lambda x: g(x, output, *idx), (operand,),
                        (np.zeros(operand.shape, jax.dtypes.float0),))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(f(operand, output, *idx)))
        assert ty.dtype == jax.dtypes.float0


@pytest.mark.parametrize("groups", [((0, 1), (2, 3)), ((0,), (1,)), ((1, 0), (3, 2)),
                                    ((0, 2, 4, 6), (1, 3, 5, 7)), ((5, 1), (0, 7), (2, 6),
                                                                   (4, 3))])
def test_axis_index_groups(rng, groups):
    """lax's axis_index_groups: the exchange runs within each group, ranks numbered by their
    position in the group (the groups of one: each rank to itself)."""
    W = max(max(g) for g in groups) + 1
    mesh = make_mesh((W,), ("x",))
    case = random_case(rng, W, [tuple(g) for g in groups], 2, (3,))
    with nvc.communicators(mesh, max_message_bytes=1 << 16):
        f = sharded(mesh, ours(axis_index_groups=groups))
        assert "nvc_ragged_all_to_all" in f.lower(*case).as_text()
        got = np.asarray(f(*case))
        g = sharded(mesh, ours(axis_index_groups=groups), jit=False)
        if len(groups) == 2:  # (eager check_grads is slow: the two-group cases)
            check_grads(lambda a, b: g(a, b, *case[2:]), case[:2], order=1,
                        modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)
    want = np_ragged(*case, [tuple(g) for g in groups])
    for r in range(W):
        np.testing.assert_array_equal(got[r], want[r].astype(np.float32))


def test_axis_index_groups_as_in_jax_test():
    """jax's grouped case: 4 ranks in groups (0, 1) and (2, 3), the 2-rank exchange in each."""
    mesh = make_mesh((4,), ("x",))
    operand = np.array([[1, 2, 2], [3, 4, 0], [10, 20, 20], [30, 40, 0]], np.int32)
    output = np.zeros((4, 4), np.int32)
    io = np.array([[0, 1]] * 4, np.int32)
    ss = np.array([[1, 2], [1, 1], [1, 2], [1, 1]], np.int32)
    oo = np.array([[0, 0], [1, 2], [0, 0], [1, 2]], np.int32)
    rs = np.array([[1, 1], [2, 1], [1, 1], [2, 1]], np.int32)
    with nvc.communicators(mesh, max_message_bytes=1 << 16):
        got = sharded(mesh, ours(axis_index_groups=((0, 1), (2, 3))))(operand, output, io, ss,
                                                                      oo, rs)
        want = np_ragged(operand, output, io, ss, oo, rs, [(0, 1), (2, 3)])
        np.testing.assert_array_equal(np.asarray(got), np.stack(want).astype(np.int32))


def test_vmap_multi_dim_operand_and_groups(rng):
    """vmap over a batch of calls (lax's batching: one call), with and without groups (lax
    refuses vmap with groups; ours folds them too)."""
    W, B = 4, 3
    mesh = make_mesh((W,), ("x",))
    for groups in (None, ((0, 3), (1, 2))):
        gl = [tuple(range(W))] if groups is None else [tuple(g) for g in groups]
        cases = [random_case(rng, W, gl, 1, (2,)) for _ in range(B)]
        # one shape for every batch element
        N = max(c[0].shape[1] for c in cases)
        M = max(c[1].shape[1] for c in cases)
        cases = [(np.pad(c[0], ((0, 0), (0, N - c[0].shape[1]), (0, 0))),
                  np.pad(c[1], ((0, 0), (0, M - c[1].shape[1]), (0, 0))), *c[2:]) for c in cases]
        stacked = [np.stack([c[i] for c in cases], axis=1) for i in range(6)]  # [W, B, ...]
        with nvc.communicators(mesh, max_message_bytes=1 << 17):
            def body(*a):
                return jax.vmap(ours(axis_index_groups=groups))(*(x[0] for x in a))[None]
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6,
                                      out_specs=P("x")))
            assert f.lower(*stacked).as_text().count("nvc_ragged_all_to_all") == 1
            got = np.asarray(f(*stacked))
        for b, c in enumerate(cases):
            want = np_ragged(*c, gl)
            for r in range(W):
                np.testing.assert_array_equal(got[r, b], want[r].astype(np.float32))


def test_mixed_index_dtypes(rng):
    """lax takes integer index arrays of different dtypes; so does ours (int64 and int32
    mixed, int16 / uint8 sizes), with the same result as all int32."""
    W = 4
    mesh = make_mesh((W,), ("x",))
    operand, output, io, ss, oo, rs = random_case(rng, W, [tuple(range(W))], 1, (2,))
    with nvc.communicators(mesh, max_message_bytes=1 << 16):
        f = sharded(mesh, ours())
        want = np.asarray(f(operand, output, io, ss, oo, rs))
        got = np.asarray(f(operand, output, io, ss.astype(np.int16), oo, rs.astype(np.uint8)))
        np.testing.assert_array_equal(got, want)
        jax.config.update("jax_enable_x64", True)
        try:
            got64 = np.asarray(f(operand, output, io.astype(np.int64), ss, oo.astype(np.int64),
                                 rs))
        finally:
            jax.config.update("jax_enable_x64", False)
        np.testing.assert_array_equal(got64, want)


LAX_ERRORS = [
    # (which argument, how it is broken, lax's text)
    (2, "float", "ragged_all_to_all input_offsets must be integer type."),
    (3, "float", "ragged_all_to_all send_sizes must be integer type."),
    (4, "float", "ragged_all_to_all output_offsets must be integer type."),
    (5, "float", "ragged_all_to_all recv_sizes must be integer type."),
    (2, "2d", "ragged_all_to_all input_offsets must be rank 1 with positive dimension size, "
              "but got shape (1, 3)"),
    (2, "empty", "ragged_all_to_all input_offsets must be rank 1 with positive dimension "
                 "size, but got shape (0,)"),
    (3, "2d", "ragged_all_to_all send_sizes must be rank 1 with positive dimension size, but "
              "got shape (1, 3)"),
    (3, "empty", "ragged_all_to_all send_sizes must be rank 1 with positive dimension size, "
                 "but got shape (0,)"),
    (4, "2d", "ragged_all_to_all output_offsets must be rank 1 with positive dimension size, "
              "but got shape (1, 3)"),
    (4, "empty", "ragged_all_to_all output_offsets must be rank 1 with positive dimension "
                 "size, but got shape (0,)"),
    (5, "2d", "ragged_all_to_all recv_sizes must be rank 1 with positive dimension size, but "
              "got shape (1, 3)"),
    (5, "empty", "ragged_all_to_all recv_sizes must be rank 1 with positive dimension size, "
                 "but got shape (0,)"),
]


@pytest.mark.parametrize("pos,how,text", LAX_ERRORS)
def test_lax_error_texts(pos, how, text):
    """jax's error cases, with lax's words (an empty input_offsets is reported as
    input_offsets, not as a send_sizes length mismatch)."""
    mesh = make_mesh((1,), ("x",))
    args = [jnp.arange(6.0), jnp.zeros(7), jnp.array([0, 1, 3]), jnp.array([1, 2, 3]),
            jnp.array([0, 1, 3]), jnp.array([1, 2, 3])]
    bad = {"float": lambda a: a.astype(jnp.float32), "2d": lambda a: a[None],
           "empty": lambda a: a[:0]}[how]
    args[pos] = bad(args[pos])
    with nvc.communicators(mesh, max_message_bytes=1 << 16):
        f = jax.jit(jax.shard_map(lambda *a: nvc.ragged_all_to_all(*a, axis_name="x"),
                                  mesh=mesh, in_specs=(P(),) * 6, out_specs=P(),
                                  check_vma=False))
        with pytest.raises(ValueError, match=re.escape(text)):
            f.lower(*args)


def test_bad_axis_index_groups():
    mesh = make_mesh((4,), ("x",))
    a = [np.zeros((4, 4), np.float32), np.zeros((4, 4), np.float32)] + \
        [np.zeros((4, 2), np.int32)] * 4
    with nvc.communicators(mesh, max_message_bytes=1 << 16):
        for groups in [((0, 1), (2,)), ((0, 1), (1, 2)), ((0, 1),), ((0, 1), (2, 5))]:
            with pytest.raises(ValueError, match=r"axis_index_groups must split the 4 indices "
                                                 r"of the axis into groups of one size"):
                sharded(mesh, ours(axis_index_groups=groups)).lower(*a)
        with pytest.raises(ValueError, match=r"k \* group size entries \(group size=2, k >= 1"
                                             r" slices per peer\), got 3"):
            b = a[:2] + [np.zeros((4, 3), np.int32)] * 4
            sharded(mesh, ours(axis_index_groups=((0, 1), (2, 3)))).lower(*b)
