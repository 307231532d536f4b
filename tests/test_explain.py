"""nvc.explain: every collective of a program with its source line, op, shape, dtype, axes, what
nvc.jit made of it and why, also the collectives XLA's partitioner inserts outside shard_map;
printable as a table, `.rows` for code."""
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
