"""nvc.explain: every collective of a program with its source line, op, shape, dtype, axes, what
nvc.jit made of it and why, also the collectives XLA's partitioner inserts outside shard_map;
printable as a table, `.rows` for code."""
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
import tp_decoder as tpd
from test_jit import _moe_setup, mesh_of


def teardown_function(_):
    nvc.close_all()


def test_decoder_every_psum_fused_with_its_lines():
    mesh = mesh_of((8,), ("tp",))
    cfg = tpd.Config(layers=3)
    params = tpd.init_params(jax.random.key(1), cfg)
    x = jnp.ones((2, 4, cfg.hidden), cfg.dtype)
    e = nvc.explain(tpd.sharded_forward(mesh, cfg, ("tp",)), params, x)
    assert len(e.rows) == 2 * cfg.layers
    for r in e.rows:
        assert r["op"] == "psum" and r["axes"] == ("tp",) and r["dtype"] == "bfloat16"
        assert r["shape"] == (2, 4, cfg.hidden)
        assert r["source"].startswith("tp_decoder.py:")
        assert r["became"].startswith("all_reduce_rms_norm (")
        assert "add (tp_decoder.py:" in r["fused_with"] and "rms_norm (tp_decoder.py:" in \
            r["fused_with"]
    text = str(e)
    assert "all_reduce_rms_norm" in text and f"{2 * cfg.layers} collectives" in text


def test_moe_layer_rows():
    _, _, params, x, fwd, _, _, _ = _moe_setup()
    rows = nvc.explain(fwd, params, x).rows
    ops = sorted((r["op"], r["became"]) for r in rows)
    assert ops == [("all_gather", "all_gather"), ("ragged_all_to_all", "ragged_all_to_all"),
                   ("ragged_all_to_all", "ragged_all_to_all")] + \
        [("ragged_dot", "ragged_dot (kernel)")] * 3, ops   # the experts' gate, up, down
    assert all(r["source"].startswith("moe_ragged.py:") for r in rows)


def test_xla_paths_and_partitioner_collectives_named():
    mesh = mesh_of((8,), ("tp",))

    def f(a, b, x, n):
        y = a @ b   # sharded contraction outside shard_map: XLA inserts an all-reduce
        z = jax.shard_map(lambda v, k: (lax.psum(v, "tp"), lax.psum(k, "tp")), mesh=mesh,
                          in_specs=(P("tp"), P("tp")), out_specs=(P(), P()))(x, n)
        return y, z

    a = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P(None, "tp")))
    b = jax.device_put(jnp.ones((64, 16)), NamedSharding(mesh, P("tp", None)))
    e = nvc.explain(f, a, b, jnp.ones((64, 8)), jnp.arange(8, dtype=jnp.int32))
    by = {(r["op"], r["dtype"]): r for r in e.rows}
    assert by[("psum", "float32")]["became"].startswith("all_reduce (")
    assert "oneshot_max_bytes" in by[("psum", "float32")]["reason"]
    assert by[("psum", "int32")]["became"] == "xla"
    assert "int32 is not a float type" in by[("psum", "int32")]["reason"]
    (out,) = [r for r in e.rows if r["became"] == "xla (out of reach)"]
    assert out["op"] == "all-reduce" and "dot_general" in out["reason"]
    assert "shard_map" in out["reason"] and out["source"].startswith("test_explain.py:")
    assert "1 inserted by XLA outside any shard_map" in str(e)


def test_explain_of_a_jitted_function_is_what_it_runs():
    mesh = mesh_of((8,), ("tp",))
    f = jax.shard_map(lambda v: lax.psum(v, "tp"), mesh=mesh, in_specs=P(), out_specs=P())
    j = nvc.jit(f)
    x = jnp.ones((1024, 1024), jnp.float32)   # 4 MiB: above the one-shot size
    (row,) = nvc.explain(j, x).rows
    assert row["became"] == "all_reduce (twoshot)", row
    np.testing.assert_array_equal(np.asarray(j(x)), np.asarray(jax.jit(f)(x)))


# --------------------------------------------------------------------------- every replacement
def _line(marker):
    """The line number of this file's line holding `marker` (a comment)."""
    with open(__file__) as f:
        for n, text in enumerate(f, 1):
            if marker in text and "_line(" not in text:
                return n
    raise AssertionError(marker)


def _counts(summary):
    m = re.match(r"(\d+) collectives: (\d+) on jax_nvcomm's kernels \((\d+) fused", summary)
    assert m, summary
    return tuple(int(g) for g in m.groups())


def _balanced(text):
    depth = 0
    for c in text:
        depth += (c == "(") - (c == ")")
        if depth < 0:
            return False
    return depth == 0


def test_rows_and_summary_count_every_replacement():
    """psum, psum -> add -> RMSNorm, all_gather, psum_scatter along dim 1, ragged_all_to_all
    and a lax.ragged_dot in one body: a row per collective (and one per replaced ragged_dot,
    where the rewrite replaces it), the summary counts every row on our ops, fused ones too."""
    mesh = mesh_of((8,), ("tp",))
    W, n = 8, 2

    def body(x, res, w, op, out, lhs, rhs):
        y = lax.psum(x, "tp")
        h = lax.psum(x * 2, "tp") + res
        hf = h.astype(jnp.float32)
        normed = hf * lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + 1e-6) * w
        g = lax.all_gather(x, "tp", axis=0, tiled=True)
        s = lax.psum_scatter(x.reshape(2, 8, -1), "tp", scatter_dimension=1, tiled=True)
        i32 = jnp.arange(W, dtype=jnp.int32)
        me = lax.axis_index("tp").astype(jnp.int32)
        sizes = jnp.full((W,), n, jnp.int32)
        r = lax.ragged_all_to_all(op, out, i32 * n, sizes, jnp.full((W,), me * n, jnp.int32),
                                  sizes, axis_name="tp")
        d = lax.ragged_dot(lhs, rhs, jnp.array([4, 4], jnp.int32))
        return y, normed, g, s, r, d

    f = jax.shard_map(body, mesh=mesh,
                      in_specs=(P("tp"), P(), P(), P("tp"), P("tp"), P("tp"), P()),
                      out_specs=(P(), P(), P("tp"), P("tp"), P("tp"), P("tp")))
    k = jax.random.split(jax.random.key(7), 6)
    args = (jax.random.normal(k[0], (64, 32)), jax.random.normal(k[1], (8, 32)),
            jnp.ones((32,)), jax.random.normal(k[2], (8 * 16, 8)), jnp.zeros((8 * 16, 8)),
            jax.random.normal(k[3], (8 * 8, 16)), jax.random.normal(k[4], (2, 16, 8)))
    e = nvc.explain(f, *args)
    collectives = [r for r in e.rows if r["op"] != "ragged_dot"]
    by_op = sorted((r["op"], r["became"].split(" (")[0]) for r in collectives)
    assert by_op == [("all_gather", "all_gather"), ("psum", "all_reduce"),
                     ("psum", "all_reduce_rms_norm"), ("psum_scatter", "reduce_scatter_v"),
                     ("ragged_all_to_all", "ragged_all_to_all")], by_op
    for r in e.rows:  # a ragged_dot is local: no axes, but the body's mesh
        assert r["axes"] == (() if r["op"] == "ragged_dot" else ("tp",)), r
        assert r["mesh"] == "mesh(tp=8)", r
        assert r["source"].startswith("test_explain.py:") and r["stack"], r
        assert _balanced(r["reason"]), r["reason"]
    ours = [r for r in e.ours if r["op"] != "ragged_dot"]
    assert _counts(e.summary()) == (len(collectives), len(ours), 1)
    replaced_dots = [r for r in e.ours if r["op"] == "ragged_dot"]
    if replaced_dots:   # the rewrite records its ragged_dot replacements
        assert f"{len(replaced_dots)} on jax_nvcomm's kernel" in e.summary()
        assert f"{len(e.ours)} replacements in all" in e.summary()


def test_summary_counts_ragged_dot_rows():
    """The summary over rows of both kinds: collectives (plain, fused, XLA's) and replaced
    ragged_dots (not collectives: counted apart and in the total)."""
    base = dict(source="m.py:1", shape=(8, 8), dtype="float32", axes=("x",), mesh="",
                fused_with="", reason="", fixable=False, stack=())
    rows = [dict(base, op="psum", became="all_reduce (oneshot)"),
            dict(base, op="psum", became="all_reduce_rms_norm (oneshot)",
                 fused_with="add (m.py:2) + rms_norm (m.py:3)"),
            dict(base, op="psum", became="xla"),
            dict(base, op="ragged_dot", became="ragged_dot"),
            dict(base, op="ragged_dot", became="ragged_dot"),
            dict(base, op="ragged_dot", became="lax")]
    s = nvc.Explanation(rows).summary()
    assert s.startswith("3 collectives: 2 on jax_nvcomm's kernels (1 fused with add + "
                        "RMSNorm), 1 XLA's"), s
    assert "3 ragged_dot: 2 on jax_nvcomm's kernel; 4 replacements in all" in s, s
    assert len(nvc.Explanation(rows).ours) == 4


# --------------------------------------------------------------------------- the user's line
def einsum(subscripts, x, w, axis=None):
    """A model's thin wrapper (jax-llm-examples writes one around jnp.einsum)."""
    if axis is None:
        return jnp.einsum(subscripts, x, w)
    return lax.psum(jnp.einsum(subscripts, x, w), axis)


def test_row_names_the_caller_of_a_thin_helper():
    mesh = mesh_of((8,), ("tp",))

    def body(x, w):
        y = einsum("td,df->tf", x, w, "tp")  # CALLER-1
        return y

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp")), out_specs=P())
    x, w = jnp.ones((8, 64)), jnp.ones((64, 16))
    j = nvc.jit(f)
    sites, _ = j.explain_rows(x, w)
    (site,) = sites
    assert site.source == f"test_explain.py:{_line('# CALLER-1')}", site.source
    assert site.where[1] == _line("# CALLER-1")                    # the warning's line too
    assert site.stack[0].startswith(f"test_explain.py:{_line('return lax.psum(jnp.einsum')} "
                                    "(einsum)"), site.stack
    assert site.stack[1].startswith(f"test_explain.py:{_line('# CALLER-1')} "), site.stack
    text = nvc.explain(j, x, w).format(stack=True)
    assert f"at test_explain.py:{_line('return lax.psum(jnp.einsum')} (einsum)" in text


def test_body_jax_calls_is_not_a_helper():
    """A shard_map body that returns the psum is the user's line: jax calls it, no user line
    calls it by name."""
    mesh = mesh_of((8,), ("tp",))

    def body(x):
        return lax.psum(x, "tp")  # BODY-RETURN

    f = jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P())
    (row,) = nvc.explain(f, jnp.ones((64, 8))).rows
    assert row["source"] == f"test_explain.py:{_line('# BODY-RETURN')}", row


def test_xla_row_names_the_caller_of_a_thin_helper():
    """A contraction XLA's partitioner turns into an all-reduce, written through the einsum
    wrapper: the row names the model line that called the wrapper."""
    mesh = mesh_of((8,), ("tp",))

    def model(a, b):
        h = einsum("ij,jk->ik", a, b)  # CALLER-2
        return h * 2

    a = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P(None, "tp")))
    b = jax.device_put(jnp.ones((64, 16)), NamedSharding(mesh, P("tp", None)))
    (row,) = nvc.explain(model, a, b).rows
    assert row["became"] == "xla (out of reach)" and row["op"] == "all-reduce", row
    assert row["source"] == f"test_explain.py:{_line('# CALLER-2')}", row
    assert row["stack"][0].endswith("(einsum)"), row["stack"]


# --------------------------------------------------------------------------- axes and meshes
def test_axes_with_the_models_names_on_a_two_axis_mesh():
    mesh = mesh_of((4, 2), ("rows", "cols"))

    def f(x, a, b):
        y = jax.shard_map(lambda v: lax.psum(v, "cols"), mesh=mesh, in_specs=P("rows", "cols"),
                          out_specs=P("rows"))(x)
        return y, a @ b

    a = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P(None, "cols")))
    b = jax.device_put(jnp.ones((64, 16)), NamedSharding(mesh, P("cols", None)))
    e = nvc.explain(f, jnp.ones((32, 64)), a, b)
    assert len(e.rows) == 2, e
    for r in e.rows:
        assert r["axes"] == ("cols",) and r["mesh"] == "mesh(rows=4, cols=2)", r
    assert "axis_0" not in str(e) and "<=[" not in str(e)


def test_two_meshes_each_row_labelled_with_its_own():
    m1 = mesh_of((4, 2), ("data", "model"))
    m2 = mesh_of((8,), ("expert",))

    def f(x):
        y = jax.shard_map(lambda v: lax.psum(v, "model"), mesh=m1,
                          in_specs=P("data", "model"), out_specs=P("data"))(x)
        z = jax.shard_map(lambda v: lax.all_gather(v, "expert", tiled=True), mesh=m2,
                          in_specs=P("expert"), out_specs=P("expert"))(x)
        return y, z

    e = nvc.explain(f, jnp.ones((64, 64)))
    by = {r["op"]: r for r in e.rows if r["became"] != "xla (out of reach)"}
    assert set(by) == {"psum", "all_gather"}, e   # (and XLA's moves between the layouts)
    assert by["psum"]["axes"] == ("model",) and by["psum"]["mesh"] == "mesh(data=4, model=2)"
    assert by["all_gather"]["axes"] == ("expert",) and \
        by["all_gather"]["mesh"] == "mesh(expert=8)"


def test_xla_groups_read_and_matched_to_the_right_mesh():
    """XLA's three forms of replica groups, read into device groups and matched to the axes
    of a mesh; of two meshes over the same devices the preferred one (the row's shard_map's)
    wins, then the one whose names XLA printed."""
    from jax_nvcomm.jit import axes as ax
    m1 = mesh_of((4, 2), ("data", "model"))
    m2 = mesh_of((2, 4), ("x", "y"))
    ids = [d.id for d in jax.devices()]
    g, _ = ax.groups_of("[4,2]<=[8]", 8)
    assert g == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert ax.match(g, ids, [m2, m1])[1] == ("model",)
    g, _ = ax.groups_of("[2,4]<=[4,2]T(1,0)", 8)
    assert g == [[0, 2, 4, 6], [1, 3, 5, 7]]
    mesh, axes = ax.match(g, ids, [m1, m2])
    assert (mesh, axes) == (m1, ("data",))
    g, printed = ax.groups_of("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", 8)
    assert g == [[0, 2, 4, 6], [1, 3, 5, 7]] and printed == ("axis_0", "axis_1")
    g, _ = ax.groups_of("{{0,1,2,3,4,5,6,7}}", 8)
    assert ax.match(g, ids, [m1, m2]) == (m1, ("data", "model"))
    assert ax.match(g, ids, [m1, m2], prefer=[m2]) == (m2, ("x", "y"))
    assert ax.match([[0, 5]], ids, [m1, m2]) is None
    assert ax.attribute("x, replica_groups=mesh['a'=4,'b'=2] {'b'}, use_global_device_ids="
                        "true", "replica_groups") == "mesh['a'=4,'b'=2] {'b'}"


def test_reason_of_a_combined_xla_collective_is_whole():
    """XLA's combiner names the ops it merged "prefix/(a/op1:b/op2)", each a path with
    parentheses of its own: the reason names the ops, no stray parenthesis."""
    import importlib
    ex = importlib.import_module("jax_nvcomm.jit.explain")   # the module, not the function
    assert ex._parts("jit(f)/(jit(norm)/reduce_sum:jit(g)/dot_general)") == \
        ["reduce_sum", "dot_general"]
    assert ex._parts("jit(f)/jit(g)/dot_general") == ["dot_general"]
    assert ex._parts("jit(f)/(a:b)") == ["a", "b"]
