"""nvc.jit on model code written in the styles of public JAX codebases (tests/public_styles/:
sglang-jax, jax-llm-examples, Flax NNX, MaxText), unchanged, on 8 CPU devices: it runs; its
results equal jax.jit's (float32 within 1e-5 relative, bfloat16 within the fused kernel's
rounding) and a float64 numpy model's; every psum or XLA-inserted all-reduce that a residual
add and an RMSNorm follow is one fused call; no XLA all-reduce / all-gather / reduce-scatter
over more than one device is left where we have a kernel (unless `explain` gives a reason the
caller cannot fix); the outputs' shardings are jax.jit's; gradients equal, with no more
collective ops; `explain` lists every replacement at the model's line with its axis names;
inline `nvc.jit(f, **kw)(x)` traces `f` once.

One test per (model, property): the name says which property (and so which part of nvc.jit)
it needs. Programs are built once per module and shared by the tests that read them."""
import functools
import inspect
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from public_styles import llm_examples_style as le
from public_styles import maxtext_style as mt
from public_styles import nnx_style as nn
from public_styles import sglang_style as sg

STYLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "public_styles")
OUR_TARGETS = re.compile(r"custom_call @(nvc_\w+)")
COMPILED_OURS = re.compile(r'custom_call_target="(nvc_\w+)"')
HLO_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<shape>.+?)\s+(?P<op>all-reduce|all-gather|reduce-scatter|"
    r"all-to-all|ragged-all-to-all|collective-permute)(?:-start)?\((?P<rest>.*)$", re.M)
FLOATS = ("f32", "bf16", "f16")


@pytest.fixture(scope="module", autouse=True)
def _closed_after_module():
    yield
    nvc.close_all()


# --------------------------------------------------------------------------- reading programs
def fused_calls(text):
    """How many of our custom calls in a lowered program are a fused all-reduce + RMSNorm."""
    return sum(1 for t in OUR_TARGETS.findall(text) if "_rms" in t)  # nvc_all_reduce_rms[_quant]


def _group_size(rest, n_devices):
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{(\{[^}]*\})", rest)
    if m:
        return len(m.group(1).strip("{}").split(","))
    return n_devices   # replica_groups={} (or none): every device


def xla_collectives_over_devices(compiled_text, ops=("all-reduce", "all-gather",
                                                     "reduce-scatter")):
    """[(op, dtype, group size)] of the XLA collectives of a compiled program that span more
    than one device, for the ops we have a kernel for, on float operands."""
    out = []
    for m in HLO_COLLECTIVE.finditer(compiled_text):
        dt = re.match(r"\(?\s*([a-z0-9]+)\[", m.group("shape"))
        dtype = dt.group(1) if dt else "?"
        size = _group_size(m.group("rest"), len(jax.devices()))
        if m.group("op") in ops and dtype in FLOATS and size > 1:
            out.append((m.group("op"), dtype, size))
    return out


def collective_ops(compiled_text):
    """The arrays the collectives of a compiled program move: one per our custom call, one
    per element of an XLA collective (XLA's combiner merges independent all-reduces into one
    of a tuple; our calls stay one each)."""
    return (sum(m.group("shape").count("[") for m in HLO_COLLECTIVE.finditer(compiled_text))
            + len(COMPILED_OURS.findall(compiled_text)))


def excused(explanation):
    """Rows explain leaves to XLA with a reason the caller cannot fix (XLA's own insertions
    marked "out of reach" are not excuses: that is what the type-sharding regions serve)."""
    return [r for r in explanation.rows if r["became"].startswith("xla") and not r["fixable"]
            and r["became"] != "xla (out of reach)"]


def _f64(a):
    return np.asarray(jax.device_get(a)).astype(np.float64)


def assert_close(got, want, dtype, what=""):
    """float32: within 1e-5 of the largest magnitude; 16-bit: the fused kernel rounds the
    normed value once in float32 where XLA rounds its steps: a few bf16 ulps at most, about
    one bf16 ulp (2^-8 relative) on average once that difference has gone through a layer or
    two (a wrong result differs by O(1))."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = _f64(g), _f64(w)
        assert g.shape == w.shape, (what, g.shape, w.shape)
        scale = max(np.abs(w).max(), 1e-30)
        err = np.abs(g - w)
        if jnp.dtype(dtype) == jnp.float32:
            assert err.max() <= 1e-5 * scale, f"{what}: max|d| {err.max():.3e} vs {scale:.3e}"
        else:
            assert err.max() <= 3e-2 * scale, f"{what}: max|d| {err.max():.3e} vs {scale:.3e}"
            assert err.mean() <= 8e-3 * np.abs(w).mean(), f"{what}: mean|d| {err.mean():.3e}"


def assert_near_reference(got, ref, dtype, what=""):
    g = _f64(got).reshape(ref.shape)
    tol = 1e-4 if jnp.dtype(dtype) == jnp.float32 else 3e-2
    err = np.abs(g - ref).max() / np.abs(ref).max()
    assert err <= tol, f"{what}: max|d| / max|ref| = {err:.3e} (tolerance {tol})"


def assert_same_shardings(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)


class _Memo:
    """A value computed once per case, or the exception that computing it raised (re-raised
    to every test that reads it)."""

    def __init__(self, fn):
        self.fn, self.name = fn, fn.__name__

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        memo = obj.__dict__.setdefault("_memo", {})
        if self.name not in memo:
            try:
                memo[self.name] = (True, self.fn(obj))
            except Exception as e:  # noqa: BLE001 - handed to each test that reads it
                memo[self.name] = (False, e)
        ok, v = memo[self.name]
        if not ok:
            raise v
        return v


class Case:
    """One program (f, args) on one mesh: what jax.jit and nvc.jit make of it."""

    def __init__(self, f, args, mesh, dtype, reference=None, grad_argnum=0, ref_dtype=None):
        self.f, self.args, self.mesh, self.dtype = f, args, mesh, dtype
        self.ref_dtype = ref_dtype or dtype   # the precision the model computes in
        self.reference = reference   # () -> float64 numpy of the output
        self.grad_argnum = grad_argnum   # the parameters' position

    def under_mesh(self, fn, *a):
        with jax.set_mesh(self.mesh):
            return fn(*a)

    @_Memo
    def want(self):
        return self.under_mesh(lambda: jax.jit(self.f)(*self.args))

    @_Memo
    def jitted(self):
        return nvc.jit(self.f)

    @_Memo
    def got(self):
        return self.under_mesh(lambda: self.jitted(*self.args))

    @_Memo
    def text(self):
        return self.under_mesh(lambda: self.jitted.lower(*self.args).as_text())

    @_Memo
    def compiled(self):
        return self.under_mesh(lambda: self.jitted.lower(*self.args).compile().as_text())

    @_Memo
    def explanation(self):
        return self.under_mesh(lambda: nvc.explain(self.f, *self.args))

    def grad_programs(self):
        def loss(*a):
            return jnp.mean(jnp.square(jax.tree.leaves(self.f(*a))[0].astype(jnp.float32)))
        grad = jax.grad(loss, argnums=self.grad_argnum)
        return jax.jit(grad), nvc.jit(grad)


def check_runs(case, what):
    got, want = case.got, case.want
    assert_close(got, want, case.ref_dtype, what + ": nvc.jit vs jax.jit")
    if case.reference is not None:
        assert_near_reference(jax.tree.leaves(got)[0], case.reference(), case.ref_dtype,
                               what + ": nvc.jit vs float64")


def check_no_xla_left(case):
    left = xla_collectives_over_devices(case.compiled)
    allowed = excused(case.explanation)
    assert len(left) <= len(allowed), (
        f"XLA collectives left {left}; rows explain excuses: "
        f"{[(r['op'], r['source'], r['reason']) for r in allowed]}")


def check_grad(case, rtol):
    g_jax, g_nvc = case.grad_programs()
    want = case.under_mesh(lambda: g_jax(*case.args))
    got = case.under_mesh(lambda: g_nvc(*case.args))
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                            jax.tree.leaves(want)):
        g, w = _f64(g), _f64(w)
        err = np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)
        assert err <= rtol, f"gradient {jax.tree_util.keystr(path)}: rel {err:.3e}"
    n_jax = collective_ops(case.under_mesh(lambda: g_jax.lower(*case.args).compile().as_text()))
    n_nvc = collective_ops(case.under_mesh(lambda: g_nvc.lower(*case.args).compile().as_text()))
    assert n_nvc <= n_jax, f"nvc.jit(grad) has {n_nvc} collective ops, jax.jit(grad) {n_jax}"


def check_explain_lines(case, axis_names, helpers=()):
    """Every replacement row: at a line of a file of tests/public_styles/ (not inside one of
    `helpers`, functions the model calls its ops through), its axes in the model's names."""
    rows = case.explanation.ours
    assert rows, "explain lists no replacement"
    helper_lines = []
    for h in helpers:
        lines, first = inspect.getsourcelines(h)
        helper_lines.append((inspect.getsourcefile(h), first, first + len(lines) - 1))
    for r in rows:
        path, _, line = str(r["source"]).rpartition(":")
        assert os.path.isfile(os.path.join(STYLES_DIR, os.path.basename(path))), r
        for file, lo, hi in helper_lines:
            same = os.path.basename(path) == os.path.basename(file)
            assert not (same and lo <= int(line) <= hi), (
                f"row at a helper's line: {r}")
        axes = str(r["axes"])
        if r["op"] != "ragged_dot":
            assert "axis_" not in axes and any(a in axes for a in axis_names), r


# =========================================================================== sglang-jax
def _sg_case(moe, ep_size, dtype, tokens, seed):
    cfg = sg.Config(moe=moe, ep_size=ep_size, dtype=dtype)
    mesh = sg.make_mesh()
    with jax.set_mesh(mesh):
        params = sg.init_params(jax.random.key(seed), cfg, mesh)
        ids = jax.random.randint(jax.random.key(seed + 1), (tokens,), 0, cfg.vocab_size)
    return Case(sg.forward_fn(cfg, mesh), (params, ids), mesh, dtype,
                lambda: sg.dense_reference(params, ids, cfg)), cfg


@functools.cache
def sg_case(name):
    return {"ep8_decode_bf16": lambda: _sg_case(True, 8, jnp.bfloat16, 8, 10),
            "ep4tp2_prefill_f32": lambda: _sg_case(True, 4, jnp.float32, 64, 20),
            "dense_decode_f32": lambda: _sg_case(False, 8, jnp.float32, 4, 30),
            "dense_prefill_bf16": lambda: _sg_case(False, 8, jnp.bfloat16, 128, 40)}[name]()


@pytest.mark.parametrize("name", ["ep8_decode_bf16", "ep4tp2_prefill_f32"])
def test_sglang_ep_moe_runs_under_nvc_jit(name):
    """EPMoE's second mesh ("expert", "tensor") and its shard_map under use_abstract_mesh."""
    case, _ = sg_case(name)
    check_runs(case, f"sglang {name}")


def test_sglang_ep_moe_explain_lists_the_moe_psums():
    case, cfg = sg_case("ep4tp2_prefill_f32")
    # the EPMoE body's psum("tensor") and psum("expert") (the rows of the row-parallel
    # linears sharded by type are psums too, at their own lines)
    rows = [r for r in case.explanation.rows
            if r["op"] == "psum" and set(r["axes"]) <= {"expert", "tensor"} and
            r["mesh"].startswith("mesh(expert")]
    assert len(rows) == 2 * cfg.num_hidden_layers, rows
    check_explain_lines(case, ("expert", "tensor"))


@pytest.mark.parametrize("name", ["dense_decode_f32", "dense_prefill_bf16"])
def test_sglang_dense_runs_under_nvc_jit(name):
    case, _ = sg_case(name)
    check_runs(case, f"sglang {name}")


@pytest.mark.parametrize("name", ["dense_decode_f32", "dense_prefill_bf16"])
def test_sglang_dense_norm_fused_from_types(name):
    """LinearBase's row-parallel dot_general(out_sharding=P("data", None)) -> hidden +=
    residual -> RMSNorm: one fused call each, 2 per decoder layer (the first layer's input
    norm follows the embedding, with no residual add)."""
    case, cfg = sg_case(name)
    assert fused_calls(case.text) == 2 * cfg.num_hidden_layers
    check_runs(case, f"sglang {name}")


def test_sglang_ep_moe_norm_fused_across_exit():
    """EPMoE ends its shard_map with psum("tensor"), psum("expert"); the reshard back, the
    next layer's `hidden += residual` and its norm come after: one fused call per layer."""
    case, cfg = sg_case("ep4tp2_prefill_f32")
    fused = [r for r in case.explanation.rows if r["op"] == "psum" and r["fused_with"]]
    assert len(fused) >= cfg.num_hidden_layers, [
        (r["source"], r["became"], r["reason"]) for r in case.explanation.rows]
    check_runs(case, "sglang ep4tp2")


@pytest.mark.parametrize("name", ["ep4tp2_prefill_f32", "dense_prefill_bf16"])
def test_sglang_every_norm_fused(name):
    """Both kinds together: 2 fused calls per decoder layer."""
    case, cfg = sg_case(name)
    assert fused_calls(case.text) == 2 * cfg.num_hidden_layers


@pytest.mark.parametrize("name", ["ep8_decode_bf16", "dense_decode_f32"])
def test_sglang_no_xla_collectives_left(name):
    case, _ = sg_case(name)
    check_no_xla_left(case)


@pytest.mark.parametrize("name", ["ep4tp2_prefill_f32", "dense_decode_f32"])
def test_sglang_out_shardings_equal(name):
    case, _ = sg_case(name)
    assert_same_shardings(case.got, case.want)


def test_sglang_dense_grad_equal_and_no_more_collectives():
    case, _ = sg_case("dense_decode_f32")
    check_grad(case, 1e-4)


def test_sglang_vocab_parallel_embedding_served():
    """Embed's `.at[ids].get(out_sharding=P("data", None))` on a ("tensor", None) table: the
    all-reduce XLA inserts becomes ours."""
    mesh = sg.make_mesh()
    with jax.set_mesh(mesh):
        table = jax.device_put(np.random.default_rng(0).normal(size=(512, 256)).astype(
            np.float32), NamedSharding(mesh, P("tensor", None)))
        ids = jax.random.randint(jax.random.key(3), (8,), 0, 512)
    case = Case(lambda t, i: sg.Embed(t, mesh)(i), (table, ids), mesh, jnp.float32,
                lambda: np.asarray(table)[np.asarray(ids)].astype(np.float64))
    check_runs(case, "sglang embed")
    assert "nvc_all_reduce" in OUR_TARGETS.findall(case.text), OUR_TARGETS.findall(case.text)
    check_no_xla_left(case)


# =========================================================================== jax-llm-examples
def _le_case(dtype, batch, tokens, seed, **kw):
    mesh = le.make_mesh()
    cfg = le.Config(mesh=mesh, dtype=dtype, **kw)
    with jax.set_mesh(mesh):
        weights = le.init_weights(jax.random.key(seed), cfg)
        tok = jax.random.randint(jax.random.key(seed + 1), (batch, tokens), 1, cfg.vocab_size)
        seg = jnp.ones((batch, tokens), jnp.int32)
    f = lambda t, s, w: le.forward(t, s, w, cfg)
    return Case(f, (tok, seg, weights), mesh, dtype,
                lambda: le.dense_reference(tok, seg, weights, cfg), grad_argnum=2,
                ref_dtype=jnp.bfloat16), cfg   # its rms_norm returns bfloat16 always


@functools.cache
def le_case(name):
    return {"moe_decode_bf16": lambda: _le_case(jnp.bfloat16, 2, 1, 50),
            "moe_quant_decode_bf16": lambda: _le_case(jnp.bfloat16, 2, 4, 60, quant_moe=True),
            "moe_prefill_bf16": lambda: _le_case(jnp.bfloat16, 1, 64, 70,
                                                 ep_strategy="prefill", mlp_layer_idxs=(1,)),
            "dense_decode_f32": lambda: _le_case(jnp.float32, 2, 8, 80, mlp_layer_idxs=(0, 1)),
            # 16 tokens: the router runs on tokens sharded over ("y", "z")
            "moe_decode_f32": lambda: _le_case(jnp.float32, 2, 8, 90),
            }[name]()


@pytest.mark.parametrize("name", ["moe_decode_bf16", "moe_quant_decode_bf16",
                                  "moe_prefill_bf16", "dense_decode_f32", "moe_decode_f32"])
def test_llm_examples_runs_under_nvc_jit(name):
    case, _ = le_case(name)
    check_runs(case, f"llm-examples {name}")


def test_llm_examples_quant_moe_products_ours():
    """quant_moe=True: `_moe_gmm` writes `lax.ragged_dot(x_bf16, w.quant_int8, sizes) *
    gathered scale`; under nvc.jit each of those mixed-dtype products (gate, up, down of every
    MoE layer) is our 8-bit-weight call, explain lists it at that line, and the model's
    results equal jax.jit's (and the float64 model's)."""
    case, cfg = le_case("moe_quant_decode_bf16")
    products = 3 * (cfg.num_layers - len(cfg.mlp_layer_idxs))
    names = [t for t in OUR_TARGETS.findall(case.text) if "ragged_dot" in t]
    assert len(names) == products and all(re.fullmatch(
        r"nvc_(cuda_)?ragged_dot_w8(_nograph)?", t) for t in names), names
    rows = [r for r in case.explanation.rows if r["op"] == "ragged_dot"]
    assert [(r["became"], r["dtype"]) for r in rows] == [
        ("ragged_dot_w8 (int8, no scale)", "bfloat16 x int8")] * products, rows
    line = inspect.getsourcelines(le._moe_gmm)
    gmm_lines = range(line[1], line[1] + len(line[0]))
    for r in rows:
        path, _, at = str(r["source"]).rpartition(":")
        assert path.endswith("llm_examples_style.py") and int(at) in gmm_lines, r["source"]
    check_runs(case, "llm-examples quant_moe")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_llm_examples_rms_norm_fused_in_shard_map(dtype):
    """Its `rms_norm` (`gamma * x / sqrt(mean(f32(x) ** 2) + eps)`, the weight before the
    division) after psum -> + residual inside a shard_map body: one fused call."""
    mesh = le.make_mesh()
    rng = np.random.default_rng(5)
    x, res = (jnp.asarray(rng.normal(size=(8, 8, 256)), dtype) for _ in range(2))
    gamma = jnp.asarray(1 + 0.1 * rng.normal(size=(256,)), dtype)

    def body(x, res, gamma):
        h = res + lax.psum(x, ("z", "y"))
        return le.rms_norm(h, gamma, 1e-6), h

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P()), out_specs=(P(), P()),
                      check_vma=False)
    case = Case(f, (x, res, gamma), mesh, dtype)
    assert fused_calls(case.text) == 1, OUR_TARGETS.findall(case.text)
    check_runs(case, "llm-examples rms_norm")


def test_llm_examples_moe_norm_fused_across_exit():
    """_expert_fn ends in psum over ("z", "y"); outside: the slice to the hidden width, the
    reshard, `x + ff_out` and the next layer's rms_norm: one fused call per MoE layer."""
    case, cfg = le_case("moe_decode_bf16")
    fused = [r for r in case.explanation.rows if r["op"] == "psum" and r["fused_with"] and
             set(r["axes"]) == {"y", "z"}]   # (the o projections' psums are over "y")
    assert len(fused) == cfg.num_layers, [
        (r["op"], r["source"], r["became"], r["reason"]) for r in case.explanation.rows]
    check_runs(case, "llm-examples moe decode")


def test_llm_examples_dense_norm_fused_from_types():
    """einsum("bhtq,hqd->btd", out_sharding=P("x", None, None)) and the MLP's down
    projection -> x + out -> rms_norm: 2 fused calls per layer."""
    case, cfg = le_case("dense_decode_f32")
    assert fused_calls(case.text) == 2 * cfg.num_layers, OUR_TARGETS.findall(case.text)
    check_runs(case, "llm-examples dense")


def test_llm_examples_moe_every_norm_fused():
    case, cfg = le_case("moe_decode_bf16")
    assert fused_calls(case.text) == 2 * cfg.num_layers, OUR_TARGETS.findall(case.text)


# (prefill and moe_decode_f32: the router's top_k runs per shard on tokens sharded over
# ("y", "z"), where XLA's partitioner all-gathers the scores; the reshapes of its weights and
# indices with out_sharding are gathers over ("y", "z"), ours)
@pytest.mark.parametrize("name", ["moe_decode_bf16", "dense_decode_f32", "moe_prefill_bf16",
                                  "moe_decode_f32"])
def test_llm_examples_no_xla_collectives_left(name):
    case, _ = le_case(name)
    check_no_xla_left(case)


def test_llm_examples_prefill_psum_scatter_dim1_served():
    """ep_strategy="prefill": psum_scatter(scatter_dimension=1, tiled=True) over "y"."""
    case, cfg = le_case("moe_prefill_bf16")
    rows = [r for r in case.explanation.rows if r["op"] == "psum_scatter"]
    assert len(rows) == 1, rows                       # one MoE layer (layer 1 is dense)
    assert not rows[0]["became"].startswith("xla"), rows
    assert "reduce-scatter" not in [c[0] for c in xla_collectives_over_devices(case.compiled)]


def test_llm_examples_explain_rows():
    """A row per replaced lax.ragged_dot (3 per MoE layer), every replacement at the model's
    line (not inside its `einsum` helper), axes in the mesh's names."""
    case, cfg = le_case("moe_decode_bf16")
    rows = case.explanation.rows
    assert sum(1 for r in rows if r["op"] == "ragged_dot") == 3 * cfg.num_layers, [
        r["op"] for r in rows]
    check_explain_lines(case, ("x", "y", "z"), helpers=(le.einsum,))
    assert str(len(rows)) in case.explanation.summary()


# A router's top-k turns a last-bit difference of its input into another expert where two
# scores are closer than their rounding: the fused kernel's norm (rounded once from float32)
# and jax.jit's bf16 steps differ by one bf16 ulp in some elements of the router's input,
# which moves a score by up to ~0.01 (measured), and the model rounds the scores to bf16
# (ulp 2^-7 at scores of 1-2). Where the two best candidates are closer than NEAR_TIE, either
# choice is the model's within its precision, and that token's output differs by O(1): such
# tokens are compared with neither; every other token must agree.
NEAR_TIE = 2.0 ** -5   # router-score gap (float64) below which a token's routing is undecided


def routed_tokens(tokens, weights, cfg, pad_to):
    """[B, T] bool: the tokens whose top-k experts the float64 model chooses by a margin of
    at least NEAR_TIE in every MoE layer (the last layer is MoE: nothing mixes them after)."""
    chunk, seg = le.prepare_chunk(tokens, pad_to, le.PAD_ID)
    margins = []
    le.dense_reference(chunk, seg, weights, cfg, margins=margins)
    return np.all([m >= NEAR_TIE for m in margins], axis=0)


def assert_close_where_routed(got, want, decided, what):
    """assert_close on the tokens `decided` marks (logits [B, T, V]); at most 1 in 8 left out,
    so that a wrong result cannot hide among them."""
    assert decided.mean() >= 7 / 8, f"{what}: {np.sum(~decided)} near-tied tokens of {decided.size}"
    assert_close(_f64(got)[decided], _f64(want)[decided], jnp.bfloat16, what)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # CPU: no donation
def test_llm_examples_inline_prefill_traces_once():
    """prefill() writes `jit(forward, donate_argnums=..., out_shardings=...)(...)` at every
    call: with jit=nvc.jit, a second call traces nothing (a cache keyed on the function and its
    jit arguments), and its results are jax.jit's (where the routing is decided)."""
    mesh = le.make_mesh()
    cfg = le.Config(mesh=mesh, num_layers=1, dtype=jnp.bfloat16)
    with jax.set_mesh(mesh):
        weights = le.init_weights(jax.random.key(90), cfg)
        prompt = jax.random.randint(jax.random.key(91), (50,), 1, cfg.vocab_size)
        want = le.prefill(prompt, weights, cfg)
        _ = le.prefill(prompt, weights, cfg, jit=nvc.jit)
        before = le.TRACES["forward"]
        got = le.prefill(prompt, weights, cfg, jit=nvc.jit)
        assert le.TRACES["forward"] == before, "nvc.jit traced forward again"
    decided = routed_tokens(prompt, weights, cfg, got[1].shape[1])
    assert_close_where_routed(got[1], want[1], decided, "prefill logits")
    assert_same_shardings(got[1:], want[1:])


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # CPU: no donation
@pytest.mark.parametrize("ep_strategy", ["decode", "prefill"])
def test_llm_examples_moe_prefill_equals_jax_jit(ep_strategy):
    """The MoE layer at prefill (a 50-token prompt padded to 64, bf16) through prefill():
    attention's o projection by type -> psum -> + x -> rms_norm is one fused call, the MoE
    block's exit psum -> + x -> the final norm another; the logits equal jax.jit's within
    bf16 rounding and the float64 model's, token by token, where the routing is decided; the
    outputs' shardings are jax.jit's."""
    mesh = le.make_mesh()
    cfg = le.Config(mesh=mesh, num_layers=1, dtype=jnp.bfloat16, ep_strategy=ep_strategy)
    with jax.set_mesh(mesh):
        weights = le.init_weights(jax.random.key(92), cfg)
        prompt = jax.random.randint(jax.random.key(93), (50,), 1, cfg.vocab_size)
        want = le.prefill(prompt, weights, cfg)
        got = le.prefill(prompt, weights, cfg, jit=nvc.jit)
        chunk, seg = le.prepare_chunk(prompt, 64, le.PAD_ID)
        args = (jax.sharding.reshard(chunk, P("x", None)), jax.sharding.reshard(seg, P("x", None)),
                weights)
        text = nvc.jit(lambda t, s, w: le.forward(t, s, w, cfg)).lower(*args).as_text()
    # "prefill" ends the MoE block in a hidden dim sharded on "y" (psum_scatter): its exit
    # psum over "z" has no whole row to normalise, so it stays a plain all-reduce
    assert fused_calls(text) == (2 if ep_strategy == "decode" else 1), OUR_TARGETS.findall(text)
    decided = routed_tokens(prompt, weights, cfg, 64)
    assert_close_where_routed(got[1], want[1], decided, f"moe prefill ({ep_strategy}) logits")
    ref = le.dense_reference(chunk, seg, weights, cfg)
    assert_near_reference(_f64(got[1])[decided], ref[decided], jnp.bfloat16,
                          f"moe prefill ({ep_strategy}): nvc.jit vs float64")
    assert_same_shardings(got[1:], want[1:])


def test_llm_examples_dense_grad_equal_and_no_more_collectives():
    case, _ = le_case("dense_decode_f32")
    check_grad(case, 3e-2)   # its rms_norm returns bfloat16: bf16 precision, float32 model


def test_llm_examples_out_shardings_equal():
    case, _ = le_case("moe_decode_bf16")
    assert_same_shardings(case.got, case.want)


# =========================================================================== Flax NNX
@functools.cache
def nnx_case(form, dtype):
    cfg = nn.Config(dtype=dtype)
    mesh = nn.make_mesh()
    params = nn.init_params(jax.random.key(100), cfg, mesh)
    x = jax.random.normal(jax.random.key(101), (4, 16, cfg.features)).astype(dtype)
    build = nn.shard_map_forward if form == "shard_map" else nn.annotated_forward
    return Case(build(cfg, mesh), (params, x), mesh, dtype,
                lambda: nn.dense_reference(params, x, cfg)), cfg


@pytest.mark.parametrize("form", ["shard_map", "annotated"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_nnx_runs_under_nvc_jit(form, dtype):
    case, _ = nnx_case(form, dtype)
    check_runs(case, f"nnx {form}")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_nnx_shard_map_norm_fused(dtype):
    """psum -> x + y -> nnx RMSNorm (`(x - mean) * (rsqrt(var + eps) * scale)`): one fused
    call per block."""
    case, cfg = nnx_case("shard_map", dtype)
    assert fused_calls(case.text) == cfg.layers, OUR_TARGETS.findall(case.text)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_nnx_annotated_norm_fused_from_types(dtype):
    """Auto mesh, sharding metadata and constraints: the all-reduce XLA would insert after
    the row-parallel Linear, the residual add and the RMSNorm: one fused call per block."""
    case, cfg = nnx_case("annotated", dtype)
    assert fused_calls(case.text) == cfg.layers, OUR_TARGETS.findall(case.text)


@pytest.mark.parametrize("form", ["shard_map", "annotated"])
def test_nnx_no_xla_collectives_left(form):
    case, _ = nnx_case(form, jnp.float32)
    check_no_xla_left(case)


@pytest.mark.parametrize("form", ["shard_map", "annotated"])
def test_nnx_out_shardings_equal(form):
    case, _ = nnx_case(form, jnp.bfloat16)
    assert_same_shardings(case.got, case.want)


def test_nnx_shard_map_explain_lines():
    case, _ = nnx_case("shard_map", jnp.float32)
    check_explain_lines(case, ("model",))


# =========================================================================== MaxText
@functools.cache
def mt_case(dtype, tokens):
    cfg = mt.Config(dtype=dtype)
    mesh = mt.make_mesh()
    params = mt.init_params(jax.random.key(200), cfg, mesh)
    y = jax.random.normal(jax.random.key(201), (4, tokens, cfg.emb_dim))
    return Case(mt.forward_fn(cfg, mesh), (params, y), mesh, dtype,
                lambda: mt.dense_reference(params, y, cfg)), cfg


@pytest.mark.parametrize("dtype,tokens", [(jnp.bfloat16, 64), (jnp.float32, 4)],
                         ids=["bf16_prefill", "f32_decode"])
def test_maxtext_dense_runs_under_nvc_jit(dtype, tokens):
    case, _ = mt_case(dtype, tokens)
    check_runs(case, "maxtext")


@pytest.mark.parametrize("dtype,tokens", [(jnp.bfloat16, 64), (jnp.float32, 4)],
                         ids=["bf16_prefill", "f32_decode"])
def test_maxtext_dense_norm_fused_from_types(dtype, tokens):
    """Auto axes, logical rules, with_sharding_constraint: the out projection's and wo's
    all-reduces -> residual add -> RMSNorm: 2 fused calls per layer."""
    case, cfg = mt_case(dtype, tokens)
    assert fused_calls(case.text) == 2 * cfg.num_layers, OUR_TARGETS.findall(case.text)


def test_maxtext_no_xla_collectives_left():
    case, _ = mt_case(jnp.float32, 4)
    check_no_xla_left(case)


def test_maxtext_out_shardings_equal():
    case, _ = mt_case(jnp.bfloat16, 64)
    assert_same_shardings(case.got, case.want)


def test_maxtext_grad_equal_and_no_more_collectives():
    case, _ = mt_case(jnp.float32, 4)
    check_grad(case, 1e-4)
