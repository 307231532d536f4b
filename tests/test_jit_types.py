"""nvc.jit on models sharded by type (Explicit mesh axes, no shard_map in the user's code): the
all-reduce XLA's partitioner would insert after each row-parallel product becomes our kernel,
fused with the residual add and the RMSNorm after it (2 per decoder layer). Against jax.jit of
the same unchanged model: values (f32 within 1e-5 relative, bf16 within the rounding of the
kernel's float32 norm), the outputs' shardings and types, and no XLA collective left in the
compiled program."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm.models.typed_decoder import Config, EinsumStyle, MaxTextStyle, SglStyle
from jax_nvcomm.models.typed_decoder import explicit_mesh as _explicit_mesh

XLA_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all)(-start)?\(")


def _hlo_collectives(text):
    return [ln.strip()[:160] for ln in text.splitlines() if XLA_COLLECTIVE.search(ln)]


def _fused_calls(text):
    # host target nvc_all_reduce_rms, CUDA nvc_cuda_all_reduce_rms[_nograph]
    return len(re.findall(r'custom_call_target="nvc_(?:cuda_)?all_reduce_rms(?:_nograph)?"', text))


def explicit_mesh(shape, names):
    """The models' Explicit mesh, or a skip where the job has fewer devices (one GPU)."""
    if len(jax.devices()) < int(np.prod(shape)):
        pytest.skip(f"needs {int(np.prod(shape))} devices, have {len(jax.devices())}")
    return _explicit_mesh(shape, names)


def auto_mesh(shape, names):
    """A mesh of Auto axes, or a skip where the job has fewer devices."""
    if len(jax.devices()) < int(np.prod(shape)):
        pytest.skip(f"needs {int(np.prod(shape))} devices, have {len(jax.devices())}")
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _close(a, b, dtype):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if dtype == jnp.float32:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
    else:  # XLA:CPU adds bf16 in bf16, the kernel normalises in float32: a few bf16 ulps
        np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2 * np.abs(b).max())


def _check(model, params, args, dtype, layers):
    f = model.__call__
    ref = jax.jit(f)(params, *args)
    got = nvc.jit(f)(params, *args)
    for r, g in zip(ref, got):
        assert jax.typeof(g) == jax.typeof(r)
        assert g.sharding == r.sharding
        _close(g, r, dtype)
    text = nvc.jit(f).lower(params, *args).compile().as_text()
    assert _hlo_collectives(text) == []
    assert _fused_calls(text) == 2 * layers
    ex = nvc.explain(f, params, *args)
    fused = [r for r in ex.rows if r["became"].startswith("all_reduce_rms_norm")]
    assert len(fused) == 2 * layers, str(ex)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tokens", [8, 128])
def test_sglang_style_row_parallel_fused(rng, dtype, tokens):
    cfg = Config(dtype=dtype)
    mesh = explicit_mesh((2, 4), ("data", "tensor"))
    with jax.set_mesh(mesh):
        model = SglStyle(cfg, mesh, rng)
        act = NamedSharding(mesh, P("data", None))
        h = jax.device_put(jnp.asarray(rng.normal(size=(tokens, cfg.hidden)), dtype), act)
        r = jax.device_put(jnp.asarray(rng.normal(size=(tokens, cfg.hidden)), dtype), act)
        _check(model, model.params(), (h, r), dtype, cfg.layers)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch,seq", [(2, 1), (4, 2), (2, 64)])
def test_einsum_style_row_parallel_fused(rng, dtype, batch, seq):
    cfg = Config(dtype=dtype)
    mesh = explicit_mesh((2, 2, 2), ("x", "y", "z"))
    with jax.set_mesh(mesh):
        model = EinsumStyle(cfg, mesh, rng)
        act = NamedSharding(mesh, P("x", None, None))
        shape = (batch, seq, cfg.hidden)
        x = jax.device_put(jnp.asarray(rng.normal(size=shape), dtype), act)
        r = jax.device_put(jnp.asarray(rng.normal(size=shape), dtype), act)
        _check(model, model.params(), (x, r), dtype, cfg.layers)


def _grads(model, params, args, jit):
    def loss(p, *a):
        x, res = jit(model.__call__)(p, *a)
        return jnp.sum(x.astype(jnp.float32) ** 2) + jnp.sum(res.astype(jnp.float32) * 0.5)
    return jax.jit(jax.grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("style", ["sglang", "einsum"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_equal_jax_jit(rng, style, dtype):
    cfg = Config(dtype=dtype, layers=1)
    if style == "sglang":
        mesh = explicit_mesh((2, 4), ("data", "tensor"))
        act, shape, cls = P("data", None), (8, cfg.hidden), SglStyle
    else:
        mesh = explicit_mesh((2, 2, 2), ("x", "y", "z"))
        act, shape, cls = P("x", None, None), (2, 4, cfg.hidden), EinsumStyle
    with jax.set_mesh(mesh):
        model = cls(cfg, mesh, rng)
        h, r = (jax.device_put(jnp.asarray(rng.normal(size=shape), dtype),
                               NamedSharding(mesh, act)) for _ in range(2))
        params = model.params()
        ref = _grads(model, params, (h, r), jax.jit)(params, h, r)
        fn = _grads(model, params, (h, r), nvc.jit)
        got = fn(params, h, r)
        for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
            assert jax.typeof(b) == jax.typeof(a)
            assert b.sharding == a.sharding
            a = np.asarray(a, np.float64)
            b = np.asarray(b, np.float64)
            tol = 1e-5 if dtype == jnp.float32 else 6e-2
            np.testing.assert_allclose(b, a, rtol=tol, atol=tol * np.abs(a).max())
        text = fn.lower(params, h, r).compile().as_text()
        assert _hlo_collectives(text) == []
        assert _fused_calls(text) == 2 * cfg.layers


def test_fused_residual_is_jax_jits_bit_for_bit(rng):
    """A row-parallel product by type, the residual add and an RMSNorm in bf16: the residual
    nvc.jit returns is jax.jit's bit for bit (XLA rounds the all-reduce's float32 sum, then the
    add), the norm within one rounding of it (the kernel norms the float32 r). A last-bit
    difference in the residual is enough to flip a top-k router fed by the norm."""
    from jax_nvcomm.models.typed_decoder import rms_norm
    mesh = explicit_mesh((2, 4), ("data", "tensor"))
    dtype = jnp.bfloat16

    def f(x, w, res, g):
        h = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), out_sharding=P("data", None))
        r = h + res
        return rms_norm(r, g, 1e-6), r

    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.asarray(rng.normal(size=(64, 1024)), dtype),
                           NamedSharding(mesh, P("data", "tensor")))
        w = jax.device_put(jnp.asarray(rng.normal(size=(1024, 512)) / 32, dtype),
                           NamedSharding(mesh, P("tensor", None)))
        res = jax.device_put(jnp.asarray(rng.normal(size=(64, 512)), dtype),
                             NamedSharding(mesh, P("data", None)))
        g = jnp.asarray(1 + 0.1 * rng.normal(size=(512,)), jnp.float32)
        assert _fused_calls(nvc.jit(f).lower(x, w, res, g).compile().as_text()) == 1
        (n, r), (n0, r0) = nvc.jit(f)(x, w, res, g), jax.jit(f)(x, w, res, g)
        np.testing.assert_array_equal(np.asarray(r, np.float32), np.asarray(r0, np.float32))
        np.testing.assert_allclose(np.asarray(n, np.float64), np.asarray(n0, np.float64),
                                   rtol=2.0 ** -7, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch,seq", [(8, 1), (2, 64)])
def test_maxtext_style_auto_axes_fused(rng, dtype, batch, seq):
    """Auto axes: the shardings come from the weights' placement and the constraints; the
    products whose lhs and output shardings the program states are cut the same way."""
    cfg = Config(dtype=dtype)
    mesh = auto_mesh((2, 4), ("data", "tensor"))
    with jax.set_mesh(mesh):
        model = MaxTextStyle(cfg, mesh, rng)
        act = NamedSharding(mesh, P("data", None, None))
        shape = (batch, seq, cfg.hidden)
        x, r = (jax.device_put(jnp.asarray(rng.normal(size=shape), dtype), act)
                for _ in range(2))
        _check(model, model.params(), (x, r), dtype, cfg.layers)


def test_auto_product_with_unstated_output_is_explained(rng):
    """Auto axes, a row-parallel product whose output sharding nothing states: XLA chooses it,
    so nvc.jit leaves it (values as jax.jit's) and explain's row for XLA's all-reduce there
    says why."""
    mesh = auto_mesh((2, 4), ("data", "tensor"))

    def f(x, wi, wo):
        h = jax.lax.with_sharding_constraint(x @ wi, NamedSharding(mesh, P("data", "tensor")))
        return h @ wo

    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.asarray(rng.normal(size=(8, 256)), jnp.float32),
                           NamedSharding(mesh, P("data", None)))
        wi = jax.device_put(jnp.asarray(rng.normal(size=(256, 512)) / 16, jnp.float32),
                            NamedSharding(mesh, P(None, "tensor")))
        wo = jax.device_put(jnp.asarray(rng.normal(size=(512, 256)) / 22, jnp.float32),
                            NamedSharding(mesh, P("tensor", None)))
        _close(nvc.jit(f)(x, wi, wo), jax.jit(f)(x, wi, wo), jnp.float32)
        rows = [r for r in nvc.explain(f, x, wi, wo).rows if r["op"] == "all-reduce"]
        assert len(rows) == 1, rows
        assert rows[0]["became"] == "xla (out of reach)"
        assert "output sharding is chosen by XLA" in rows[0]["reason"], rows[0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vocab_parallel_embedding_all_reduce_is_ours(rng, dtype):
    """`table.at[ids].get(out_sharding=...)` of a table sharded on the vocab dim (sglang-jax's
    embedding): XLA makes it a masked local gather + all-reduce; under nvc.jit that all-reduce
    is ours. Rows exact (a sum of one row and zeros); the output's type as jax.jit's."""
    mesh = explicit_mesh((2, 4), ("data", "tensor"))
    vocab, hidden, tokens = 512, 256, 16

    def embed(table, ids):
        return table.at[ids].get(out_sharding=NamedSharding(mesh, P("data", None)))

    with jax.set_mesh(mesh):
        table = jax.device_put(jnp.asarray(rng.normal(size=(vocab, hidden)), dtype),
                               NamedSharding(mesh, P("tensor", None)))
        ids = jax.device_put(jnp.asarray(rng.integers(0, vocab, size=tokens), jnp.int32),
                             NamedSharding(mesh, P("data")))
        got, want = nvc.jit(embed)(table, ids), jax.jit(embed)(table, ids)
        assert jax.typeof(got) == jax.typeof(want) and got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(table, np.float32)[np.asarray(ids)])
        rows = nvc.explain(embed, table, ids).rows
        ours = [r for r in rows if r["became"].startswith("all_reduce")]
        assert len(ours) == 1 and ours[0]["axes"] == ("tensor",), rows
        # what XLA keeps: nothing of floats (the ids' integer gather, if any, is no op of ours)
        assert all(r["dtype"].startswith("s") for r in rows if r["became"].startswith("xla")), rows


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sequence_parallel_gather_and_scatter_are_ours(rng, dtype):
    """Sequence parallelism by type: tokens sharded on "tensor" are gathered by a `reshard`
    (XLA: all-gather) before the column-parallel product, and the row-parallel product's
    out_sharding puts the tokens back on "tensor" (XLA: reduce-scatter). Under nvc.jit both are
    ours (all_gather, reduce_scatter_v); values and output types as jax.jit's."""
    from jax.sharding import reshard
    from jax_nvcomm.models.typed_decoder import rms_norm
    mesh = explicit_mesh((2, 4), ("data", "tensor"))

    def f(x, wi, wo, g):
        xs = reshard(x, P(None, None))
        h = jax.nn.silu(jax.lax.dot_general(xs, wi, (((1,), (0,)), ((), ())),
                                            out_sharding=P(None, "tensor")))
        o = jax.lax.dot_general(h, wo, (((1,), (0,)), ((), ())),
                                out_sharding=P("tensor", None))
        r = o + x
        return r, rms_norm(r, g, 1e-6)

    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.asarray(rng.normal(size=(64, 256)), dtype),
                           NamedSharding(mesh, P("tensor", None)))
        wi = jax.device_put(jnp.asarray(rng.normal(size=(256, 512)) / 16, dtype),
                            NamedSharding(mesh, P(None, "tensor")))
        wo = jax.device_put(jnp.asarray(rng.normal(size=(512, 256)) / 22, dtype),
                            NamedSharding(mesh, P("tensor", None)))
        g = jnp.asarray(1 + 0.1 * rng.normal(size=(256,)), jnp.float32)
        got, want = nvc.jit(f)(x, wi, wo, g), jax.jit(f)(x, wi, wo, g)
        for a, b in zip(got, want):
            assert jax.typeof(a) == jax.typeof(b) and a.sharding == b.sharding
            _close(a, b, dtype)
        became = sorted(r["became"] for r in nvc.explain(f, x, wi, wo, g).rows)
        assert became == ["all_gather", "reduce_scatter_v"], became
        assert _hlo_collectives(nvc.jit(f).lower(x, wi, wo, g).compile().as_text()) == []


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nnx_style_row_parallel_fused(rng, dtype):
    """Flax-NNX-style modules (parameters with sharding metadata, `jnp.dot(...,
    out_sharding=)`): one fused call per block (its MLP's down projection)."""
    from jax_nvcomm.models.typed_decoder import NnxStyle
    cfg = Config(dtype=dtype)
    mesh = explicit_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(mesh):
        model = NnxStyle(cfg, mesh, rng)
        act = NamedSharding(mesh, P("data", None))
        x, r = (jax.device_put(jnp.asarray(rng.normal(size=(8, cfg.hidden)), dtype), act)
                for _ in range(2))
        params = model.params()
        ref = jax.jit(model.__call__)(params, x, r)
        got = nvc.jit(model.__call__)(params, x, r)
        for a, b in zip(got, ref):
            assert jax.typeof(a) == jax.typeof(b) and a.sharding == b.sharding
            _close(a, b, dtype)
        text = nvc.jit(model.__call__).lower(params, x, r).compile().as_text()
        assert _hlo_collectives(text) == []
        assert _fused_calls(text) == cfg.layers


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scanned_layers_are_cut_inside_the_scan(rng, dtype):
    """Layers under lax.scan (stacked weights, as MaxText's scan_layers): the scan body's
    row-parallel product + add + norm is one fused call (once in the body), nothing XLA's
    left; values and shardings as jax.jit's."""
    from jax_nvcomm.models.typed_decoder import rms_norm
    mesh = explicit_mesh((2, 4), ("data", "tensor"))
    L, H, F = 3, 256, 512
    dot = (((1,), (0,)), ((), ()))

    def f(ws, x, r):
        def layer(carry, w):
            x, r = carry
            h = jax.nn.silu(jax.lax.dot_general(x, w["up"], dot, out_sharding=P("data", "tensor")))
            r = jax.lax.dot_general(h, w["down"], dot, out_sharding=P("data", None)) + r
            return (rms_norm(r, w["g"], 1e-6), r), None
        return jax.lax.scan(layer, (x, r), ws)[0]

    with jax.set_mesh(mesh):
        ws = dict(up=jax.device_put(jnp.asarray(rng.normal(size=(L, H, F)) / 16, dtype),
                                    NamedSharding(mesh, P(None, None, "tensor"))),
                  down=jax.device_put(jnp.asarray(rng.normal(size=(L, F, H)) / 22, dtype),
                                      NamedSharding(mesh, P(None, "tensor", None))),
                  g=jnp.asarray(1 + 0.1 * rng.normal(size=(L, H)), jnp.float32))
        x, r = (jax.device_put(jnp.asarray(rng.normal(size=(8, H)), dtype),
                               NamedSharding(mesh, P("data", None))) for _ in range(2))
        got, want = nvc.jit(f)(ws, x, r), jax.jit(f)(ws, x, r)
        for a, b in zip(got, want):
            assert jax.typeof(a) == jax.typeof(b) and a.sharding == b.sharding
            _close(a, b, dtype)
        text = nvc.jit(f).lower(ws, x, r).compile().as_text()
        assert _hlo_collectives(text) == []
        assert _fused_calls(text) == 1
