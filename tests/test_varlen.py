"""all_gather_v / reduce_scatter_v (host backend) against float64 numpy references written here,
on 8 CPU devices: random counts (traced), zero rows on some ranks, all rows on one, several
dtypes and row shapes, both check_vma settings, gradients, consecutive and independent calls,
bad counts, the XLA path; and across processes through the launcher."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm._warn import XlaPathWarning
from helpers import mesh1d
from test_multiprocess import launch

W = 8


@pytest.fixture(scope="module")
def comm8():
    with nvc.Communicator(mesh1d(W), "x", max_message_bytes=1 << 20) as c:
        yield c


def np_gather(x, counts, max_rows):
    """x [W * max_rows, ...] (rank r's rows at r * max_rows): the compact rows, offsets."""
    rows = [x[r * max_rows: r * max_rows + counts[r]] for r in range(len(counts))]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return np.concatenate(rows, 0), offsets


def gather_fn(comm, check_vma=True):
    def f(x, n):
        g, off, tot = nvc.all_gather_v(x, n[0], comm)
        return g[None], off[None], tot[None]
    return jax.jit(jax.shard_map(f, mesh=comm.mesh, in_specs=(P("x"), P("x")),
                                 out_specs=(P("x"), P("x"), P("x")), check_vma=check_vma))


def check_gather(out, x, counts, max_rows, zero_tail=True):
    g, off, tot = (np.asarray(a) for a in out)
    want, want_off = np_gather(x, counts, max_rows)
    total = int(want_off[-1])
    for r in range(len(counts)):  # every rank holds the same gathered rows
        np.testing.assert_array_equal(off[r], want_off, err_msg=f"offsets on rank {r}")
        assert int(tot[r]) == total, (r, tot[r], total)
        np.testing.assert_array_equal(g[r][:total], want, err_msg=f"rows on rank {r}")
        if zero_tail:  # API.md: rows from total on are zero
            assert not np.asarray(g[r][total:], np.float64).any(), f"rows past {total} on rank {r}"


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("dtype,row_shape", [(jnp.float32, (16,)), (jnp.bfloat16, (3, 8)),
                                             (jnp.int32, ()), (jnp.int8, (5,))])
def test_all_gather_v_random_counts(comm8, rng, dtype, row_shape, check_vma):
    max_rows = 7
    counts = rng.integers(0, max_rows + 1, W).astype(np.int32)
    counts[int(rng.integers(W))] = 0
    counts[int(rng.integers(W))] = max_rows
    x = np.asarray(jnp.asarray(rng.integers(-1000, 1000, (W * max_rows,) + row_shape), dtype))
    out = gather_fn(comm8, check_vma)(x, counts)
    check_gather(out, x.astype(np.float64) if dtype != jnp.int8 else x, counts, max_rows)


def test_all_gather_v_without_zero_tail(comm8, rng):
    """zero_tail=False: the same rows, offsets and total (rows past the total unspecified)."""
    max_rows = 6
    counts = rng.integers(0, max_rows + 1, W).astype(np.int32)
    x = rng.standard_normal((W * max_rows, 8)).astype(np.float32)

    def f(v, n):
        g, off, tot = nvc.all_gather_v(v, n[0], comm8, zero_tail=False)
        return g[None], off[None], tot[None]
    out = jax.jit(jax.shard_map(f, mesh=comm8.mesh, in_specs=(P("x"), P("x")),
                                out_specs=(P("x"),) * 3))(x, counts)
    check_gather(out, x, counts, max_rows, zero_tail=False)


def test_bench_varlen_runs(tmp_path):
    """`python -m jax_nvcomm.bench varlen --quick` on 8 CPU devices: every method of every
    load has a time, the JSON and the table are written."""
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    p = subprocess.run([sys.executable, "-m", "jax_nvcomm.bench", "varlen", "--quick",
                        "--reps", "1", "--unroll", "1", "--steps", "1", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / "varlen.json").read_text())["rows"]
    assert len(rows) == 4 * 7 and all("median_us" in r for r in rows), rows
    assert "## all_gather_v" in p.stdout and "## reduce_scatter_v" in p.stdout


@pytest.mark.parametrize("case", ["all_on_one", "none", "full"])
def test_all_gather_v_extremes(comm8, rng, case):
    max_rows = 9
    counts = {"all_on_one": np.eye(W, dtype=np.int32)[3] * max_rows,
              "none": np.zeros(W, np.int32),
              "full": np.full(W, max_rows, np.int32)}[case]
    x = rng.standard_normal((W * max_rows, 24)).astype(np.float32)
    check_gather(gather_fn(comm8)(x, counts), x, counts, max_rows)


def scatter_fn(comm, check_vma=True):
    def f(y, off):
        return nvc.reduce_scatter_v(y[0], off, comm)[None]
    return jax.jit(jax.shard_map(f, mesh=comm.mesh, in_specs=(P("x"), P()),
                                 out_specs=P("x"), check_vma=check_vma))


def np_scatter(y, counts, max_rows):
    """y [W, W * max_rows, ...] partial results of every rank: [W, max_rows, ...] float64."""
    off = np.concatenate([[0], np.cumsum(counts)])
    out = np.zeros((len(counts), max_rows) + y.shape[2:])
    for r in range(len(counts)):
        out[r, :counts[r]] = y[:, off[r]:off[r + 1]].astype(np.float64).sum(0)
    return out


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2),
                                       (jnp.float16, 2e-3)])
def test_reduce_scatter_v_random_counts(comm8, rng, dtype, tol, check_vma):
    max_rows, h = 6, 32
    counts = rng.integers(0, max_rows + 1, W).astype(np.int32)
    counts[int(rng.integers(W))] = 0
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    y = jnp.asarray(rng.standard_normal((W, W * max_rows, h)), dtype)
    got = np.asarray(scatter_fn(comm8, check_vma)(y, off).astype(jnp.float32), np.float64)
    want = np_scatter(np.asarray(y.astype(jnp.float32)), counts, max_rows)
    for r in range(W):
        np.testing.assert_allclose(got[r], want[r], rtol=tol, atol=tol * 4,
                                   err_msg=f"rank {r}, count {counts[r]}")
        assert not got[r, counts[r]:].any(), f"rank {r}: rows past its count are not zero"


def test_reduce_scatter_v_all_rows_on_one(comm8, rng):
    max_rows, h = 10, 8
    counts = np.eye(W, dtype=np.int32)[5] * max_rows
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    y = rng.standard_normal((W, W * max_rows, h)).astype(np.float32)
    got = np.asarray(scatter_fn(comm8)(y, off))
    np.testing.assert_allclose(got, np_scatter(y, counts, max_rows), rtol=1e-6, atol=1e-6)


def test_gather_then_scatter_layer(comm8, rng):
    """DP attention -> TP layer -> back: gather the ranks' rows, multiply by this rank's weight
    shard (partial results), reduce-scatter; against numpy in float64, and every intermediate
    typed as the API says (gathered invariant: out_specs P() under check_vma)."""
    max_rows, h = 5, 16
    counts = rng.integers(0, max_rows + 1, W).astype(np.int32)
    x = rng.standard_normal((W * max_rows, h)).astype(np.float32)
    w = rng.standard_normal((W, h, h)).astype(np.float32) / 4  # rank r's partial weight

    def layer(x, n, w):
        g, off, tot = nvc.all_gather_v(x, n[0], comm8)
        y = g @ w[0]
        return nvc.reduce_scatter_v(y, off, comm8), g, off, tot

    out, g, off, tot = jax.jit(jax.shard_map(
        layer, mesh=comm8.mesh, in_specs=(P("x"), P("x"), P("x")),
        out_specs=(P("x"), P(), P(), P())))(x, counts, w)
    want_g, want_off = np_gather(x, counts, max_rows)
    np.testing.assert_array_equal(np.asarray(g)[:want_off[-1]], want_g)
    np.testing.assert_array_equal(np.asarray(off), want_off)
    wsum = w.astype(np.float64).sum(0)
    out = np.asarray(out).reshape(W, max_rows, h)
    for r in range(W):
        ref = x[r * max_rows: r * max_rows + counts[r]].astype(np.float64) @ wsum
        np.testing.assert_allclose(out[r, :counts[r]], ref, rtol=1e-4, atol=1e-4)
        assert not out[r, counts[r]:].any()


@pytest.mark.parametrize("check_vma", [True, False])
def test_gradients(comm8, rng, check_vma):
    """jax.grad through both ops against numpy: d/dx of sum(a * gathered[:total]) is a's rows
    at this rank's offset; d/dy of sum_r <b_r, y_mine_r> is b_r at every rank's copy of rank r's
    rows (each op the other's transpose)."""
    max_rows, h = 6, 8
    counts = rng.integers(0, max_rows + 1, W).astype(np.int32)
    counts[2] = 0
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    total = int(off[-1])
    x = rng.standard_normal((W * max_rows, h)).astype(np.float32)
    a = rng.standard_normal((W * max_rows, h)).astype(np.float32)
    y = rng.standard_normal((W, W * max_rows, h)).astype(np.float32)
    b = rng.standard_normal((W * max_rows, h)).astype(np.float32)
    valid = (np.arange(W * max_rows) < total)[:, None]

    def gloss(x, n, a):
        g, _, tot = nvc.all_gather_v(x, n[0], comm8)
        keep = (jnp.arange(g.shape[0]) < tot)[:, None]
        return jnp.sum(jnp.where(keep, g * a, 0.0))

    f = jax.shard_map(gloss, mesh=comm8.mesh, in_specs=(P("x"), P("x"), P()), out_specs=P(),
                      check_vma=check_vma)
    dx = np.asarray(jax.jit(jax.grad(f))(x, counts, a))
    want = np.zeros_like(x)
    for r in range(W):
        want[r * max_rows: r * max_rows + counts[r]] = a[off[r]: off[r + 1]]
    np.testing.assert_allclose(dx, want, rtol=1e-6, atol=1e-6)

    def sloss(y, off, b):
        return jnp.sum(nvc.reduce_scatter_v(y[0], off, comm8) * b)[None]

    fs = jax.shard_map(sloss, mesh=comm8.mesh, in_specs=(P("x"), P(), P("x")),
                       out_specs=P("x"), check_vma=check_vma)
    dy = np.asarray(jax.jit(jax.grad(lambda *a: fs(*a).sum()))(y, off, b))
    bb = b.reshape(W, max_rows, h)
    want_row = np.zeros((W * max_rows, h), np.float32)
    for r in range(W):
        want_row[off[r]: off[r + 1]] = bb[r, :counts[r]]
    for s in range(W):
        np.testing.assert_allclose(dy[s], want_row * valid, rtol=1e-6, atol=1e-6,
                                   err_msg=f"d/dy on rank {s}")


def test_gradient_of_layer_matches_xla(comm8, rng):
    """grad of gather -> per-rank weight -> reduce-scatter equals JAX's autodiff of the XLA
    path (padded lax.all_gather + psum_scatter), for x and for the weight shards."""
    from jax_nvcomm import varlen
    max_rows, h = 4, 16
    counts = rng.integers(0, max_rows + 1, W).astype(np.int32)
    x = rng.standard_normal((W * max_rows, h)).astype(np.float32)
    w = rng.standard_normal((W, h, h)).astype(np.float32) / 4
    t = rng.standard_normal((W * max_rows, h)).astype(np.float32)

    def make(ours):
        def body(x, n, w, t):
            if ours:
                g, off, _ = nvc.all_gather_v(x, n[0], comm8)
                out = nvc.reduce_scatter_v(g @ w[0], off, comm8)
            else:
                g, off, _ = varlen.xla_all_gather_v(x, n[0], "x", W)
                out = varlen.xla_reduce_scatter_v(g @ w[0], off, "x", W)
            return jnp.sum(out * t)[None]
        f = jax.shard_map(body, mesh=comm8.mesh, in_specs=(P("x"), P("x"), P("x"), P("x")),
                          out_specs=P("x"))
        return jax.jit(jax.grad(lambda x, n, w, t: f(x, n, w, t).sum(), argnums=(0, 2)))

    gx, gw = make(True)(x, counts, w, t)
    rx, rw = make(False)(x, counts, w, t)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(gx)).sum() > 0


def test_consecutive_and_independent_calls(comm8, rng):
    """One program of independent calls (3 gathers of different sizes, 2 reduce-scatters, an
    all_reduce), run 60 times with fresh counts and data, every result against numpy."""
    mr = (3, 8, 1)

    def body(x0, x1, x2, n, y0, y1, off, z):
        outs = []
        for k, xk in enumerate((x0, x1, x2)):
            g, o, _ = nvc.all_gather_v(xk, jnp.minimum(n[0], mr[k]), comm8)
            outs += [g[None], o[None]]
        outs.append(nvc.reduce_scatter_v(y0[0], off, comm8)[None])
        outs.append(nvc.reduce_scatter_v(y1[0], off, comm8)[None])
        outs.append(nvc.all_reduce(z, comm8)[None])
        return tuple(outs)

    f = jax.jit(jax.shard_map(body, mesh=comm8.mesh,
                              in_specs=(P("x"),) * 6 + (P(), P("x")),
                              out_specs=(P("x"),) * 9))
    for it in range(60):
        n = rng.integers(0, 9, W).astype(np.int32)
        xs = [rng.standard_normal((W * m, 4)).astype(np.float32) for m in mr]
        c8 = np.minimum(n, 8)
        off = np.concatenate([[0], np.cumsum(c8)]).astype(np.int32)
        y0 = rng.standard_normal((W, W * 8, 8)).astype(np.float32)
        y1 = rng.standard_normal((W, W * 8, 4)).astype(np.float32)
        z = rng.standard_normal((W * 2, 8)).astype(np.float32)
        out = [np.asarray(o) for o in f(*xs, n, y0, y1, off, z)]
        for k, m in enumerate(mr):
            c = np.minimum(n, m)
            want, want_off = np_gather(xs[k], c, m)
            for r in range(W):
                np.testing.assert_array_equal(out[2 * k][r][:want_off[-1]], want,
                                              err_msg=f"run {it} gather {k} rank {r}")
                np.testing.assert_array_equal(out[2 * k + 1][r], want_off)
        np.testing.assert_allclose(out[6], np_scatter(y0, c8, 8), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[7], np_scatter(y1, c8, 8), rtol=1e-5, atol=1e-5)
        zr = z.reshape(W, 2, 8).astype(np.float64).sum(0)
        for r in range(W):
            np.testing.assert_allclose(out[8][r], zr, rtol=1e-5, atol=1e-5)


def test_loop_of_calls(comm8, rng):
    """fori_loop of gather -> scale -> reduce-scatter, 50 iterations in one program: the rows
    of every rank are multiplied by W each round (the W ranks' identical partials add up)."""
    max_rows, h = 5, 8
    counts = rng.integers(0, max_rows + 1, W).astype(np.int32)
    x = rng.integers(-3, 4, (W * max_rows, h)).astype(np.float32)

    def body(x, n):
        def step(_, v):
            g, off, _ = nvc.all_gather_v(v, n[0], comm8)
            return nvc.reduce_scatter_v(g * 0.125, off, comm8)
        return jax.lax.fori_loop(0, 50, step, x)

    out = np.asarray(jax.jit(jax.shard_map(body, mesh=comm8.mesh, in_specs=(P("x"), P("x")),
                                           out_specs=P("x")))(x, counts))
    want = x.reshape(W, max_rows, h).copy()
    for r in range(W):
        want[r, counts[r]:] = 0
    np.testing.assert_array_equal(out.reshape(W, max_rows, h), want)


def test_traced_count_out_of_range_fails_named(rng):
    """A traced num_rows above max_rows fails the call on that rank with a named error; the
    others report that rank; a constant one is refused at trace time."""
    mesh = mesh1d(4)
    with nvc.Communicator(mesh, "x", max_message_bytes=1 << 16, timeout_s=5) as c:
        x = rng.standard_normal((4 * 3, 8)).astype(np.float32)
        f = jax.jit(jax.shard_map(lambda v, n: nvc.all_gather_v(v, n[0], c)[0][None],
                                  mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
        with pytest.raises(Exception, match="row count is 5, outside \\[0, max_rows=3\\]|"
                                            "rank 2 failed this call"):
            np.asarray(f(x, np.array([1, 2, 5, 0], np.int32)))
        errs = c.errors()
        assert any("rank 2's row count is 5, outside [0, max_rows=3]" in e for e in errs), errs
    with nvc.Communicator(mesh, "x", max_message_bytes=1 << 16) as c:
        g = jax.shard_map(lambda v: nvc.all_gather_v(v, 4, c)[0], mesh=mesh, in_specs=P("x"),
                          out_specs=P())
        with pytest.raises(ValueError, match=r"num_rows must be in \[0, max_rows=3\], got 4"):
            jax.jit(g).lower(x)
        h = jax.shard_map(lambda v: nvc.reduce_scatter_v(v, jnp.zeros(4, jnp.int32), c),
                          mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        with pytest.raises(ValueError, match=r"offsets must be int32 of shape \(5,\)"):
            jax.jit(h).lower(np.zeros((4 * 4 * 3, 8), np.float32))


@pytest.mark.parametrize("count", [0, 3, 5])
def test_group_of_one(rng, count):
    """A group of one (XLA path): the rank's own rows, zero past the count, and the scatter is
    the identity on the leading rows."""
    with nvc.Communicator(mesh1d(1), "x") as c:
        max_rows, h = 5, 8
        x = (rng.standard_normal((max_rows, h)) + 2.0).astype(np.float32)  # no zero rows
        counts = np.array([count], np.int32)
        check_gather(gather_fn(c)(x, counts), x, counts, max_rows)
        off = np.array([0, count], np.int32)
        got = np.asarray(scatter_fn(c)(x[None], off))
        np.testing.assert_array_equal(got, np_scatter(x[None], counts, max_rows))


def test_group_of_one_in_a_loop(rng):
    """A group of one inside a fori_loop: gather then scatter is a loop carry, so the scatter's
    result must be typed varying over the axis like lax.psum_scatter's (it was not once, and
    only a loop's carry check showed it)."""
    with nvc.Communicator(mesh1d(1), "x") as c:
        def loop(x, n):
            def step(_, v):
                g, off, _ = nvc.all_gather_v(v, n[0], c)
                return nvc.reduce_scatter_v(g * 0.5, off, c)
            return jax.lax.fori_loop(0, 3, step, x)
        x = rng.standard_normal((6, 8)).astype(np.float32)
        f = jax.jit(jax.shard_map(loop, mesh=c.mesh, in_specs=(P("x"), P("x")),
                                  out_specs=P("x")))
        got = np.asarray(f(x, np.array([4], np.int32)))
        want = np.concatenate([x[:4] * 0.125, np.zeros((2, 8), np.float32)])
        np.testing.assert_array_equal(got, want)


def test_large_calls_take_the_xla_path(rng):
    """world * max_rows * row bytes above max_message_bytes: no kernel call, same results."""
    mesh = mesh1d(4)
    with nvc.Communicator(mesh, "x", max_message_bytes=4096) as c:
        max_rows, h = 64, 8  # 4 * 64 * 32 B = 8 KiB gathered
        counts = rng.integers(0, max_rows + 1, 4).astype(np.int32)
        x = rng.standard_normal((4 * max_rows, h)).astype(np.float32)
        f = gather_fn(c)
        with pytest.warns(XlaPathWarning, match=r"all_gather_v: 4 x 64 rows of 32 bytes"):
            assert "nvc_all_gather_v" not in f.lower(x, counts).as_text()
        check_gather(f(x, counts), x, counts, max_rows)
        off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        y = rng.standard_normal((4, 4 * max_rows, h)).astype(np.float32)
        s = scatter_fn(c)
        with pytest.warns(XlaPathWarning, match=r"reduce_scatter_v: "):
            assert "nvc_reduce_scatter_v" not in s.lower(y, off).as_text()
        np.testing.assert_allclose(np.asarray(s(y, off)), np_scatter(y, counts, max_rows),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("n,rounds", [(2, 200), (4, 60)])
def test_varlen_across_processes(n, rounds):
    rc, out = launch(n, "varlen_mp.py", f"--rounds={rounds}", timeout=400)
    assert rc == 0, out[-4000:]
    assert out.count("PASS varlen") == n, out[-4000:]
