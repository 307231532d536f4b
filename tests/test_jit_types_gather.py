"""nvc.jit takes the all-gathers that shardings in types imply (Explicit mesh axes, no shard_map
in the user's code): a `reshard`, a `reshape(..., out_sharding=)` or a
`broadcast_in_dim(..., out_sharding=)` whose input has one dim sharded on a group of axes (one
axis or a tuple such as ("y", "z")) that the output no longer shards on becomes our all_gather,
for floats and integers, also inside a nested `jax.jit` (the router of jax-llm-examples' MoE
block). A gather is exact: against jax.jit of the same program the values are equal bit for
bit, the outputs' types and shardings equal, and no XLA all-gather is left in the compiled
program."""
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, reshard
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from public_styles import llm_examples_style as le

XLA_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|"
                            r"collective-permute)(-start)?\(")
OUR_GATHER = re.compile(r'custom_call_target="nvc_(?:cuda_)?all_gather"')


def mesh_of(shape, names):
    if len(jax.devices()) < int(np.prod(shape)):
        pytest.skip(f"needs {int(np.prod(shape))} devices, have {len(jax.devices())}")
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))


def xla_collectives(text):
    """The XLA collectives of a compiled program (any dtype)."""
    return [ln.strip()[:160] for ln in text.splitlines() if XLA_COLLECTIVE.search(ln)]


def random(rng, shape, dtype):
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-2 ** 31, 2 ** 31 - 1, size=shape), dtype)
    return jnp.asarray(rng.normal(size=shape), dtype)


def bits(a):
    """The array's bytes as unsigned integers of its width (bitwise comparison, NaN-safe)."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same(got, want):
    """nvc.jit's outputs are jax.jit's: types (shardings included) and bits."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert jax.typeof(g) == jax.typeof(w)
        assert g.sharding == w.sharding
        np.testing.assert_array_equal(bits(g), bits(w))


def gather_rows(f, *args):
    return [r for r in nvc.explain(f, *args).rows if r["op"] in ("all_gather", "all-gather")]


def check_ours(f, args, gathers, axes):
    """nvc.jit(f) equals jax.jit(f); its compiled program holds `gathers` of our all_gather
    calls and no XLA collective; explain's rows say all_gather over `axes`."""
    assert_same(nvc.jit(f)(*args), jax.jit(f)(*args))
    text = nvc.jit(f).lower(*args).compile().as_text()
    assert xla_collectives(text) == []
    assert len(OUR_GATHER.findall(text)) == gathers
    rows = gather_rows(f, *args)
    assert [(r["became"], tuple(r["axes"])) for r in rows] == [("all_gather", axes)] * gathers, rows


# ------------------------------------------------------------------------------------- reshape

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("group", [("y", "z"), ("z", "y")])
def test_reshape_with_out_sharding_gathers_over_a_tuple_of_axes(rng, dtype, group):
    """`x.reshape(..., out_sharding=P("x", None, None))` of x [16@(y,z), 2] (the router's
    top-k output): XLA gathers over the group, the major axis first; so do we."""
    mesh = mesh_of((1, 4, 2), ("x", "y", "z"))

    def f(a):
        return a.reshape((4, 8, 2), out_sharding=P("x", None, None))

    with jax.set_mesh(mesh):
        a = jax.device_put(random(rng, (32, 2), dtype), NamedSharding(mesh, P(group, None)))
        check_ours(f, (a,), 1, group)
        np.testing.assert_array_equal(bits(nvc.jit(f)(a)), bits(np.asarray(a).reshape(4, 8, 2)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_reshape_merging_dims_keeps_the_other_axes(rng, dtype):
    """A merge of two dims, the first sharded on ("data", "tensor") [2, 4], the last dim kept
    on nothing: one gather over both axes, then the reshape."""
    mesh = mesh_of((2, 4), ("data", "tensor"))

    def f(a):
        return jnp.reshape(a, (64 * 3, 8), out_sharding=P(None, None))

    with jax.set_mesh(mesh):
        a = jax.device_put(random(rng, (64, 3, 8), dtype),
                           NamedSharding(mesh, P(("data", "tensor"), None, None)))
        check_ours(f, (a,), 1, ("data", "tensor"))


# ------------------------------------------------------------------------------------- reshard

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
@pytest.mark.parametrize("shape,names,in_spec,out_spec,group", [
    ((2, 4), ("data", "tensor"), P(("data", "tensor"), None), P(None, None),
     ("data", "tensor")),
    ((2, 4), ("data", "tensor"), P(("tensor", "data"), None), P(None, None),
     ("tensor", "data")),
    ((2, 4), ("data", "tensor"), P("data", "tensor", None), P("data", None, None), ("tensor",)),
    ((2, 2, 2), ("x", "y", "z"), P(None, ("x", "y"), "z"), P(None, None, "z"), ("x", "y")),
    ((1, 4, 2), ("x", "y", "z"), P(("x", "y", "z"), None), P("x", None), ("y", "z")),
], ids=["data,tensor", "tensor,data", "one-axis-other-dim-kept", "x,y-z-kept", "size-1-axis"])
def test_reshard_gathers_a_group_of_axes(rng, dtype, shape, names, in_spec, out_spec, group):
    """A `reshard` that takes one dim's group of axes off (the other dims as they were)."""
    mesh = mesh_of(shape, names)
    dims = (16, 8, 4)[:len(in_spec)]

    def f(a):
        return reshard(a, out_spec)

    with jax.set_mesh(mesh):
        a = jax.device_put(random(rng, dims, dtype), NamedSharding(mesh, in_spec))
        check_ours(f, (a,), 1, group)


# ----------------------------------------------------------------------------- broadcast_in_dim

@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32])
def test_broadcast_with_out_sharding_gathers(rng, dtype):
    mesh = mesh_of((1, 4, 2), ("x", "y", "z"))

    def f(a):
        return lax.broadcast_in_dim(a, (16, 3, 4), (0, 2), out_sharding=P(None, None, None))

    with jax.set_mesh(mesh):
        a = jax.device_put(random(rng, (16, 4), dtype), NamedSharding(mesh, P(("y", "z"), None)))
        check_ours(f, (a,), 1, ("y", "z"))


@pytest.mark.parametrize("dtype,to", [(jnp.bfloat16, jnp.float32), (jnp.int32, jnp.float32),
                                      (jnp.float32, jnp.int32)])
def test_convert_onto_a_sharding_gathers(rng, dtype, to):
    """`jnp.astype(x, dtype, device=NamedSharding(mesh, P()))` (a convert_element_type with
    a sharding): the gather, then the convert, on each rank."""
    mesh = mesh_of((2, 4), ("data", "tensor"))

    def f(a):
        return jnp.astype(a, to, device=NamedSharding(mesh, P(None, "data")))

    with jax.set_mesh(mesh):
        a = jax.device_put(random(rng, (16, 8), dtype) if dtype != jnp.float32 else
                           jnp.asarray(rng.integers(-1000, 1000, size=(16, 8)), dtype),
                           NamedSharding(mesh, P("tensor", "data")))
        check_ours(f, (a,), 1, ("tensor",))


# --------------------------------------------------------------------------- left as they were

@pytest.mark.parametrize("in_spec,out_spec", [
    (P(("y", "z"), None), P("y", None)),      # part of the group stays: not a whole gather
    (P("y", None), P(None, "y")),              # the axis moves to another dim: an all-to-all
])
def test_other_reshards_stay_xlas(rng, in_spec, out_spec):
    """Reshards that are more than a gather of one dim's whole group: left to XLA (values as
    jax.jit's; no all_gather of ours)."""
    mesh = mesh_of((1, 4, 2), ("x", "y", "z"))

    def f(a):
        return reshard(a, out_spec) * 2

    with jax.set_mesh(mesh):
        a = jax.device_put(random(rng, (16, 8), jnp.float32), NamedSharding(mesh, in_spec))
        assert_same(nvc.jit(f)(a), jax.jit(f)(a))
        assert not OUR_GATHER.search(nvc.jit(f).lower(a).compile().as_text())


# ----------------------------------------------------------------------- nested jit and top_k

def _router(mesh, k=2):
    @jax.jit
    def route(x, w):   # as jax-llm-examples' router: its own jit, tokens on ("y", "z")
        shape = x.shape
        x = reshard(x.reshape((-1, shape[-1])), P(("y", "z"), None))
        scores = jnp.einsum("Sk,kj->Sj", x, reshard(w, P(None, None))).astype(jnp.float32)
        wts, idx = lax.top_k(jax.nn.softmax(scores, axis=-1), k)
        wts = wts / jnp.sum(wts, axis=-1, keepdims=True)
        out = P("x", None, None)
        return (wts.reshape(shape[:-1] + (k,), out_sharding=out),
                idx.reshape(shape[:-1] + (k,), out_sharding=out))

    def f(x, w):
        wts, idx = route(x, w)
        return wts * 2, idx + 1
    return f


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch,seq", [(2, 8), (1, 64)])
def test_nested_jit_router_gathers_are_ours(rng, dtype, batch, seq):
    """The router under its own jax.jit: the top-k runs on each shard's tokens (XLA would
    all-gather its scores first), its weights (float32) and indices (int32) are gathered by
    our all_gather: no XLA collective left; values bit for bit jax.jit's."""
    mesh = mesh_of((1, 4, 2), ("x", "y", "z"))
    f = _router(mesh)
    with jax.set_mesh(mesh):
        x = jax.device_put(random(rng, (batch, seq, 64), dtype),
                           NamedSharding(mesh, P("x", None, None)))
        w = jax.device_put(random(rng, (64, 8), dtype), NamedSharding(mesh, P(None, None)))
        assert xla_collectives(jax.jit(f).lower(x, w).compile().as_text())  # (XLA's: gathers)
        check_ours(f, (x, w), 2, ("y", "z"))
        dtypes = sorted(r["dtype"] for r in gather_rows(f, x, w))
        assert dtypes == ["float32", "int32"], dtypes


@pytest.mark.parametrize("spec", [P(("y", "z"), None), P("y", None)])
def test_top_k_on_sharded_rows_runs_per_shard(rng, spec):
    """`lax.top_k` of scores whose rows are sharded by type: each shard selects among its own
    rows (no collective; XLA's partitioner all-gathers the scores for its TopK; jax refuses a
    top_k along a sharded dim). Values, types and the gradient of the selected values as
    jax.jit's."""
    mesh = mesh_of((1, 4, 2), ("x", "y", "z"))

    def f(s):
        return lax.top_k(s, 3)

    def loss_with(jit):
        return jax.jit(jax.grad(lambda s: jnp.sum(jit(f)(s)[0] ** 2)))

    with jax.set_mesh(mesh):
        s = jax.device_put(random(rng, (16, 8), jnp.float32), NamedSharding(mesh, spec))
        assert_same(nvc.jit(f)(s), jax.jit(f)(s))
        assert_same(loss_with(nvc.jit)(s), loss_with(jax.jit)(s))
        assert xla_collectives(jax.jit(f).lower(s).compile().as_text())
        assert xla_collectives(nvc.jit(f).lower(s).compile().as_text()) == []


# ------------------------------------------------------------------------------------ gradient

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_through_a_reshape_gather_equals_jax_jit(rng, dtype):
    """jax.grad through a reshape that gathers over ("y", "z"): the transpose hands each shard
    its rows back; the gradient equals jax.jit's."""
    mesh = mesh_of((1, 4, 2), ("x", "y", "z"))

    def f(a):
        return a.reshape((4, 8, 4), out_sharding=P("x", None, None))

    def loss_with(jit):
        def loss(a, c):
            return jnp.sum((jit(f)(a).astype(jnp.float32) * c) ** 2)
        return jax.jit(jax.grad(loss))

    with jax.set_mesh(mesh):
        a = jax.device_put(random(rng, (32, 4), dtype), NamedSharding(mesh, P(("y", "z"), None)))
        c = jax.device_put(random(rng, (4, 8, 4), jnp.float32),
                           NamedSharding(mesh, P("x", None, None)))
        assert_same(loss_with(nvc.jit)(a, c), loss_with(jax.jit)(a, c))


# ----------------------------------------------------------------- the jax-llm-examples router

@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("batch,seq", [(2, 8), (1, 64)])
def test_llm_examples_router_no_xla_collective(rng, dtype, batch, seq):
    """jax-llm-examples' `_route_tokens_to_moe_experts` (its own jax.jit, tokens sharded over
    ("y", "z") where they divide the devices): top-k per shard, both reshapes' gathers ours."""
    mesh = le.make_mesh()
    if mesh.devices.size != 8:
        pytest.skip("needs 8 devices")
    cfg = le.Config(mesh=mesh, dtype=dtype, moe_num_experts=8)

    def f(x, w):
        return le._route_tokens_to_moe_experts(x, w, False, cfg)

    with jax.set_mesh(mesh):
        x = jax.device_put(random(rng, (batch, seq, cfg.embed), dtype),
                           NamedSharding(mesh, P("x", None, None)))
        w = jax.device_put(random(rng, (cfg.embed, cfg.moe_num_experts), dtype),
                           NamedSharding(mesh, P(None, None)))
        check_ours(f, (x, w), 2, ("y", "z"))


@pytest.mark.parametrize("dtype,batch,seq,kw", [
    (jnp.float32, 2, 8, {}),
    (jnp.bfloat16, 2, 8, {}),
    (jnp.bfloat16, 1, 64, dict(ep_strategy="prefill", mlp_layer_idxs=(1,))),
], ids=["decode-f32", "decode-bf16", "prefill-bf16"])
def test_llm_examples_moe_model_no_xla_all_gather_left(dtype, batch, seq, kw):
    """The whole jax-llm-examples-style model, unchanged: no XLA all-reduce, all-gather or
    reduce-scatter of any dtype left (jax.jit has at least the router's 3 all-gathers per MoE
    layer);
    explain lists the router's 2 gathers per MoE layer (weights float32, indices int32) as
    ours. Values against jax.jit: tests/test_public_styles.py."""
    mesh = le.make_mesh()
    if mesh.devices.size != 8:
        pytest.skip("needs 8 devices")
    cfg = le.Config(mesh=mesh, dtype=dtype, **kw)
    moe_layers = cfg.num_layers - len(cfg.mlp_layer_idxs)
    gathers = re.compile(r"\b(all-reduce|all-gather|reduce-scatter)(-start)?\(")
    with jax.set_mesh(mesh):
        weights = le.init_weights(jax.random.key(5), cfg)
        tok = jax.random.randint(jax.random.key(6), (batch, seq), 1, cfg.vocab_size)
        seg = jnp.ones((batch, seq), jnp.int32)

        def f(t, s, w):
            return le.forward(t, s, w, cfg)

        want = jax.jit(f).lower(tok, seg, weights).compile().as_text()
        assert sum("all-gather(" in ln for ln in want.splitlines()) >= 3 * moe_layers
        text = nvc.jit(f).lower(tok, seg, weights).compile().as_text()
        assert [ln for ln in text.splitlines() if gathers.search(ln)] == []
        src, first = inspect.getsourcelines(le._route_tokens_to_moe_experts)
        router = {f"llm_examples_style.py:{first + i}" for i, ln in enumerate(src)
                  if ".reshape(x_shape" in ln}
        assert len(router) == 2
        rows = [r for r in nvc.explain(f, tok, seg, weights).rows
                if r["op"] in ("all_gather", "all-gather") and r["source"] in router]
        assert sorted((r["became"], r["dtype"], tuple(r["axes"])) for r in rows) == sorted(
            [("all_gather", "float32", ("y", "z")), ("all_gather", "int32", ("y", "z"))]
            * moe_layers), rows
