"""Programs with many independent jax_nvcomm collectives (no data between them): XLA may run
them in any order on each device, or at once (XLA:CPU's thunk executor does), and they must
still pair across ranks (API.md, "Errors"). Every result is checked exactly against numpy on
every rank, 100 runs of each program with fresh data.

The programs mix all_reduce (one-shot / two-shot strategy codes), all_reduce_rms_norm,
all_gather and MoE dispatch + combine over three communicators, in one shard_map body and
inside a loop body. all_reduce and all_gather are compared bit for bit (the float32 rank-order
sum rounded once, as API.md defines it); the fused op to its dtype's rounding (its RMSNorm runs
in float32, the reference in float64); the MoE output to float32 rounding. The code before the
order token (jax_nvcomm/_order.py) failed this test at its first run."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from helpers import f64, mesh1d, rms_ref

W = 8
RUNS = 100
# (rows, cols, dtype) of the all_reduce / all_gather operands: different sizes and dtypes so a
# mispairing cannot go unnoticed (the sums differ in shape, value and dtype)
# (sizes above XLA:CPU's threshold for running a program's thunks one after another, 512 bytes
# per buffer, so its executor really runs independent calls concurrently)
AR_SHAPES = [(1, 256, jnp.float32), (2, 160, jnp.float32), (3, 256, jnp.bfloat16),
             (4, 320, jnp.float32), (5, 136, jnp.float16), (6, 160, jnp.float32),
             (7, 192, jnp.bfloat16)]
AG_SHAPES = [(1, 160, jnp.float32), (2, 256, jnp.float32), (3, 200, jnp.int32),
             (4, 136, jnp.bfloat16)]
RMS_SHAPES = [(2, 256, jnp.float32), (4, 160, jnp.float32), (1, 512, jnp.bfloat16)]
MOE = dict(num_experts=16, top_k=2, max_tokens=4, hidden=64, dtype=jnp.float32)


@pytest.fixture(scope="module")
def comms():
    c = make_comms(mesh1d(W))
    yield c
    for x in c[1:][::-1]:
        x.close()


def make_comms(mesh):
    """(mesh, communicator, second communicator, MoE communicator) of the programs."""
    c = nvc.Communicator(mesh, "x", max_message_bytes=1 << 17)
    c2 = nvc.Communicator(mesh, "x", max_message_bytes=1 << 15)
    m = nvc.MoECommunicator(mesh, "x", **MOE)
    return mesh, c, c2, m


def _draw(rng, shape, dtype):
    if jnp.dtype(dtype) == jnp.int32:
        return rng.integers(-1000, 1000, size=shape).astype(np.int32)
    return jnp.asarray(rng.standard_normal(shape), dtype)


def make_inputs(rng):
    ar = [_draw(rng, (W * r, c), d) for r, c, d in AR_SHAPES]
    ag = [_draw(rng, (W * r, c), d) for r, c, d in AG_SHAPES]
    rms = [(_draw(rng, (W * r, c), d), _draw(rng, (r, c), d), _draw(rng, (c,), d))
           for r, c, d in RMS_SHAPES]
    T, K, E, H = MOE["max_tokens"], MOE["top_k"], MOE["num_experts"], MOE["hidden"]
    x = jnp.asarray(rng.standard_normal((W * T, H)), jnp.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(W * T)]).astype(np.int32)
    w = jnp.asarray(rng.random((W * T, K)), jnp.float32)
    return ar, ag, rms, (x, jnp.asarray(ids), w)


def _body(c, c2, m, in_loop):
    """16 independent collectives (7 all_reduce, 3 fused, 4 all_gather, 1 dispatch, each on
    its own data) and a combine after the dispatch; the odd ones on the second communicator."""
    def body(ar, ag, rms, moe_in):
        out_ar = [nvc.all_reduce(a, c if i % 2 == 0 else c2,
                                 strategy="oneshot" if i % 3 else "twoshot")
                  for i, a in enumerate(ar)]
        out_ag = [nvc.all_gather(a, c2 if i % 2 == 0 else c) for i, a in enumerate(ag)]
        out_rms = [nvc.all_reduce_rms_norm(x, r, w, c if i % 2 else c2, eps=1e-6)
                   for i, (x, r, w) in enumerate(rms)]
        x, ids, w = moe_in
        d = nvc.moe_dispatch(x, ids, m)
        y = nvc.moe_combine(d.expert_x * 2.0, w, d.handle, m)
        return out_ar, out_ag, out_rms, y

    if not in_loop:
        return body

    def looped(ar, ag, rms, moe_in):
        # two iterations of the same independent calls; results of the second returned
        def step(i, carry):
            return body(ar, ag, rms, moe_in)
        init = jax.eval_shape(body, ar, ag, rms, moe_in)
        init = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), init)
        return jax.lax.fori_loop(0, 2, step, init)
    return looped


def program(mesh, c, c2, m, in_loop):
    rep = P()
    ar_spec = [P("x")] * len(AR_SHAPES)
    ag_spec = [P("x")] * len(AG_SHAPES)
    rms_spec = [(P("x"), rep, rep)] * len(RMS_SHAPES)
    moe_spec = (P("x"), P("x"), P("x"))
    # per-rank outputs (leading axis over ranks) so every rank's copy is compared
    out_specs = ([P("x")] * len(AR_SHAPES), [P("x")] * len(AG_SHAPES),
                 [(P("x"), P("x"))] * len(RMS_SHAPES), P("x"))
    body = _body(c, c2, m, in_loop)

    def per_rank(*args):
        ar, ag, rms, y = body(*args)
        ar = [a[None] for a in ar]
        ag = [a[None] for a in ag]
        rms = [(n[None], r[None]) for n, r in rms]
        return ar, ag, rms, y

    return jax.jit(jax.shard_map(per_rank, mesh=mesh,
                                 in_specs=(ar_spec, ag_spec, rms_spec, moe_spec),
                                 out_specs=out_specs, check_vma=False))


def _expected(inputs):
    """numpy results, in the outputs' structure and per-rank layout (leading axis: rank)."""
    ar_in, ag_in, rms_in, (x, ids, w) = inputs
    out_ar, out_ag, out_rms = [], [], []
    for (r, c, d), a in zip(AR_SHAPES, ar_in):
        acc = np.zeros((r, c), np.float32)
        for p in f64(a).reshape(W, r, c):  # float32 rank-order sum, rounded once to the dtype
            acc = acc + p.astype(np.float32)
        out_ar.append(np.broadcast_to(f64(jnp.asarray(acc).astype(d)), (W, r, c)))
    for (r, c, d), a in zip(AG_SHAPES, ag_in):
        full = np.asarray(a) if d == jnp.int32 else f64(a)
        out_ag.append(np.broadcast_to(full, (W,) + full.shape))
    for (r, c, d), (xa, res, wt) in zip(RMS_SHAPES, rms_in):
        s = f64(xa).reshape(W, r, c).sum(0) + f64(res)
        out_rms.append((np.broadcast_to(rms_ref(s, f64(wt), 1e-6), (W, r, c)),
                        np.broadcast_to(s, (W, r, c))))
    # every slot valid and every expert row is 2 * its token: y[t] = 2 x[t] sum_k w[t, k]
    y = 2.0 * np.asarray(x, np.float64) * np.asarray(w, np.float64).sum(1, keepdims=True)
    return out_ar, out_ag, out_rms, y


def _tolerances():
    """Per-leaf (rtol, atol), in the outputs' structure: all_reduce and all_gather exact,
    the fused op to its dtype's rounding, the MoE output to float32 rounding."""
    exact = (0.0, 0.0)
    rms = [((1e-5, 1e-5) if d == jnp.float32 else (2e-2, 2e-2),) * 2 for _, _, d in RMS_SHAPES]
    return [exact] * len(AR_SHAPES), [exact] * len(AG_SHAPES), rms, (1e-6, 1e-6)


def check(outs, inputs):
    """Compare every shard this process holds (every rank, in one process) with numpy."""
    want = _expected(inputs)
    flat_out = jax.tree.leaves(outs)
    flat_want = jax.tree.leaves(want)
    flat_tol = jax.tree.leaves(_tolerances(), is_leaf=lambda t: isinstance(t, tuple)
                               and len(t) == 2 and isinstance(t[0], float))
    assert len(flat_out) == len(flat_want) == len(flat_tol)
    for o, e, (rtol, atol) in zip(flat_out, flat_want, flat_tol):
        assert o.shape == e.shape, (o.shape, e.shape)
        for sh in o.addressable_shards:
            got = np.asarray(sh.data)
            got = got if got.dtype == np.int32 else f64(got)
            np.testing.assert_allclose(got, e[sh.index], rtol=rtol, atol=atol)


def global_inputs(mesh, inputs):
    """The inputs as global arrays sharded like the program's in_specs (for multi-process
    jobs, where every process holds the same numpy inputs)."""
    from jax.sharding import NamedSharding
    ar, ag, rms, moe_in = inputs

    def put(a, spec):
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec),
                                            lambda idx: a[idx])
    return ([put(a, P("x")) for a in ar], [put(a, P("x")) for a in ag],
            [(put(x, P("x")), put(r, P()), put(w, P())) for x, r, w in rms],
            tuple(put(a, P("x")) for a in moe_in))


@pytest.mark.parametrize("in_loop", [False, True], ids=["flat", "loop"])
def test_independent_collectives_100_runs(comms, rng, in_loop):
    mesh, c, c2, m = comms
    f = program(mesh, c, c2, m, in_loop)
    for _ in range(RUNS):
        inputs = make_inputs(rng)
        check(f(*inputs), inputs)
    assert not c.errors() and not c2.errors() and not m.errors()


def _token_chains(hlo):
    """The chains of order tokens among the program's jax_nvcomm calls (stablehlo text, in
    program order): a call starts a new chain unless its token operand (its last) is the token
    result (the last) of an earlier call. Returns the chain lengths."""
    calls = re.findall(r"(%[\w.]+):\d+ = stablehlo\.custom_call @nvc_\w+\((.*?)\)", hlo)
    chains, owner = [], {}
    for res, ops in calls:
        tok = ops.split(",")[-1].strip()
        head, _, idx = tok.partition("#")
        if head in owner and idx:
            chains[owner[head]] += 1
            owner[res] = owner[head]
        else:
            owner[res] = len(chains)
            chains.append(1)
    return chains


def test_gradient_program_calls_in_one_order(comms, rng):
    """A training step's calls (jax.value_and_grad in the shard_map body): an all-gather of
    integers (no tangent: JAX evaluates it outside the AD trace), the differentiated all-reduce
    of the forward (and whatever its transpose calls in the backward pass), and an all-reduce
    of the gradient after it, the all-gather sharing data with none of them: all one chain of
    order tokens (jax_nvcomm/_order.py; before, the all-gather started a chain of its own), and
    the values as the same program with lax's collectives, 20 runs."""
    mesh, c, c2, _ = comms

    def make(gather, reduce, reduce2):
        def body(x, ints):
            def loss(x):
                g = gather(ints)
                y = reduce(x * 2.0)
                return jnp.sum(y * y), g
            (l, g), dx = jax.value_and_grad(loss, has_aux=True)(x)
            return l[None], g[None], dx, reduce2(dx)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P("x")),
                                     out_specs=(P("x"), P("x"), P("x"), P("x")),
                                     check_vma=False))

    f = make(lambda a: nvc.all_gather(a, c), lambda a: nvc.all_reduce(a, c),
             lambda a: nvc.all_reduce(a, c2))
    ref = make(lambda a: jax.lax.all_gather(a, "x", tiled=True),
               lambda a: jax.lax.psum(a, "x"), lambda a: jax.lax.psum(a, "x"))
    x = jnp.asarray(rng.standard_normal((W * 2, 256)), jnp.float32)
    ints = jnp.asarray(rng.integers(-9, 9, size=(W * 3, 200)), jnp.int32)
    hlo = f.lower(x, ints).as_text()
    chains = _token_chains(hlo)
    assert len(chains) == 1 and chains[0] >= 3, chains
    want = jax.block_until_ready(ref(x, ints))
    for _ in range(20):
        got = jax.block_until_ready(f(x, ints))
        assert (np.asarray(got[1]) == np.asarray(want[1])).all()
        for g, w in zip(got[:1] + got[2:], want[:1] + want[2:]):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
