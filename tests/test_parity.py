"""lax parity: every op, in every form a lax collective works in, against the lax collective in
the same program on fresh random data (host backend, 8 CPU devices).

Forms: plain shard_map; partially manual shard_map over the communicator's axis of a 2-D mesh
(("dp", "tp") with the rows split over dp by jit's in/out shardings, and ("tp", "dp") with
odd shapes that no auto axis divides: the whole-data case); vmap (in plain and partially manual
shard_map); scan over layers; checkpoint + grad; grad of vmap; vmap of grad; a uniform
lax.cond (our op in one branch, the lax code in the other: both typed alike); a mesh of
Explicit axes (and gradients there, the rows split over dp); jax.set_mesh. check_vma True
everywhere, False where typing differs most.

References (written here, from lax): psum; psum + add + RMSNorm; all_gather; a padded
all_gather + compaction (all_gather_v) and padded psum_scatter in float32 (reduce_scatter_v);
reference.moe_dispatch_xla / moe_combine_xla; reference.ragged_all_to_all_reference
(lax.ragged_all_to_all's semantics from lax.all_gather and a scatter, independent of the
emulation that the op's strategy="xla" runs on CPU devices). Gathers and dispatched rows are
compared bit for bit; sums within float32 tolerance (another summation order); FP8 outputs
within one FP8 step. The MoE ops cannot fold a batch into one call: vmap forms check the
named error. Each program also counts its kernel calls: ONE per op call in the plain, partial
and vmap forms."""
import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm._warn import XlaPathWarning
from jax_nvcomm import ragged, varlen
from jax_nvcomm.reference import (moe_combine_xla, moe_dispatch_xla,
                                  ragged_all_to_all_reference, rms_norm_reference)
from ragged_cases import make_call

W, DP, B, L = 4, 2, 2, 2          # tp size, dp size, micro-batches, scanned layers
E, K, T, H = 8, 2, 4, 32          # MoE: experts, top_k, tokens per rank, hidden
EPS = 1e-5


# ---------------------------------------------------------------------------------------------
# meshes and communicators

def _mesh(kind):
    devs = np.array(jax.devices()[:W * DP])
    if kind == "plain":
        return jax.sharding.Mesh(devs[:W], ("tp",))
    if kind == "dp_tp":
        return jax.sharding.Mesh(devs.reshape(DP, W), ("dp", "tp"))
    if kind == "tp_dp":
        return jax.sharding.Mesh(devs.reshape(W, DP), ("tp", "dp"))
    return jax.sharding.Mesh(devs.reshape(DP, W), ("dp", "tp"),
                             axis_types=(AxisType.Explicit,) * 2)


def make_comms():
    """{mesh kind: (Communicator, MoECommunicator)} over "tp" of each mesh."""
    out = {}
    for kind in ("plain", "dp_tp", "tp_dp", "explicit"):
        mesh = _mesh(kind)
        out[kind] = (nvc.Communicator(mesh, "tp", max_message_bytes=1 << 20),
                     nvc.MoECommunicator(mesh, "tp", num_experts=E, top_k=K, max_tokens=T,
                                         hidden=H, dtype=jnp.float32))
    return out


def close_comms(out):
    for c, m in out.values():
        c.close()
        m.close()


@pytest.fixture(scope="module")
def comms():
    out = make_comms()
    yield out
    close_comms(out)


# ---------------------------------------------------------------------------------------------
# the ops: arguments, our call, the lax reference, the comparison

@dataclasses.dataclass
class Arg:
    value: np.ndarray   # global: ranks' pieces stacked on the first (non-batch) dim, or "same"
    rank: bool          # split over tp (True) or the same on every rank (False)
    batched: bool       # carries the micro-batch dim in the vmap forms
    diff: bool = False  # differentiated in the gradient forms


def _tol(a, b, rtol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.linalg.norm((a - b).ravel()) / max(np.linalg.norm(b.ravel()), 1e-30)
    assert err < rtol, f"relative error {err} >= {rtol}"


def _same(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class AllReduce:
    name, calls, grads, vmap_error = "all_reduce", 1, True, None

    def args(self, rng, odd, nb):
        rows, cols = (3, 5) if odd else (4, 32)  # odd: the padded view, no auto axis divides
        return [Arg(_rand(rng, nb, (W * rows, cols)), True, True, True)]

    def ours(self, c, m, x):
        return (nvc.all_reduce(x, c),)

    def ref(self, x):
        return (lax.psum(x, "tp"),)

    def compare(self, a, b):
        _tol(a[0], b[0], 1e-6)


class Fused:
    name, calls, grads, vmap_error = "all_reduce_rms_norm", 1, True, None

    def __init__(self, batched_weight=False):
        self.batched_weight = batched_weight
        if batched_weight:
            self.name += "[batched weight]"

    def args(self, rng, odd, nb):
        rows = 3 if odd else 4
        return [Arg(_rand(rng, nb, (W * rows, H)), True, True, True),
                Arg(_rand(rng, nb, (W * rows, H)), True, True, True),
                Arg(1 + 0.1 * _rand(rng, nb if self.batched_weight else None, (H,)), False,
                    self.batched_weight, True)]

    def ours(self, c, m, x, r, w):
        return nvc.all_reduce_rms_norm(x, r, w, c, eps=EPS)

    def ref(self, x, r, w):
        rr = lax.psum(x, "tp").astype(jnp.float32) + r.astype(jnp.float32)
        return (rms_norm_reference(rr, w, EPS).astype(x.dtype), rr.astype(r.dtype))

    def compare(self, a, b):
        _tol(a[0], b[0], 1e-5)
        _tol(a[1], b[1], 1e-6)


class Quant(Fused):
    name, calls, grads = "all_reduce_rms_norm_quant", 1, False

    def __init__(self):
        super().__init__(False)

    def ours(self, c, m, x, r, w):
        q, s, ro = nvc.all_reduce_rms_norm_quant(x, r, w, c, eps=EPS)
        return q.astype(jnp.float32), s, ro

    def ref(self, x, r, w):
        rr = lax.psum(x, "tp").astype(jnp.float32) + r.astype(jnp.float32)
        n = rms_norm_reference(rr, w, EPS)
        m = jnp.maximum(jnp.max(jnp.abs(n), -1, keepdims=True), np.float32(448 * 2.0 ** -126))
        return ((n * (448 / m)).astype(jnp.float8_e4m3fn).astype(jnp.float32), m / 448, rr)

    def compare(self, a, b):
        _tol(a[1], b[1], 1e-5)
        _tol(a[2], b[2], 1e-6)
        # within one FP8 step of the reference (a sum rounded differently may cross a tie)
        step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(np.asarray(b[0])), 2.0 ** -6))) - 3)
        assert np.all(np.abs(np.asarray(a[0]) - np.asarray(b[0])) <= step)


class AllGather:
    name, calls, grads, vmap_error = "all_gather", 2, True, None
    no_explicit_grad = ("lax.all_gather(tiled=False)'s own transpose (psum_scatter) fails to "
                        "type in a partially manual region of Explicit axes (jax 0.12)")

    def args(self, rng, odd, nb):
        rows, cols = (3, 5) if odd else (4, 6)
        return [Arg(_rand(rng, nb, (W * rows, cols)), True, True, True)]

    def ours(self, c, m, x):
        return (nvc.all_gather(x, c), nvc.all_gather(x, c, axis=1, tiled=False))

    def ref(self, x):
        return (lax.all_gather(x, "tp", tiled=True), lax.all_gather(x, "tp", axis=1))

    def compare(self, a, b):
        _same(a[0], b[0])
        _same(a[1], b[1])


class AllGatherV:
    name, calls, grads, vmap_error = "all_gather_v", 1, True, None

    def args(self, rng, odd, nb):
        max_rows = 3 if odd else 4
        counts = rng.integers(0, max_rows + 1, W).astype(np.int32)
        counts[rng.integers(W)] = max_rows
        return [Arg(_rand(rng, nb, (W * max_rows, 8)), True, True, True),
                Arg(counts, True, False)]

    def ours(self, c, m, x, n):
        return nvc.all_gather_v(x, n[0], c)

    def ref(self, x, n):
        """Padded lax.all_gather of the rows and the counts, then compaction."""
        g = lax.all_gather(x, "tp", tiled=False, to="invarying")       # [W, max_rows, ...]
        cnt = lax.all_gather(n[0], "tp", to="invarying")               # [W]
        off = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(cnt).astype(jnp.int32)])
        i = jnp.arange(x.shape[0])
        dest = jnp.where(i[None, :] < cnt[:, None], off[:-1, None] + i[None, :], W * x.shape[0])
        out = jnp.zeros((W * x.shape[0],) + x.shape[1:], x.dtype)
        return out.at[dest.reshape(-1)].set(g.reshape((-1,) + x.shape[1:]), mode="drop"), \
            off, off[-1]

    def compare(self, a, b):
        for u, v in zip(a, b):
            _same(u, v)


class ReduceScatterV:
    name, calls, grads, vmap_error = "reduce_scatter_v", 1, True, None

    def args(self, rng, odd, nb):
        max_rows = 3 if odd else 4
        counts = rng.integers(0, max_rows + 1, W).astype(np.int32)
        return [Arg(_rand(rng, nb, (W * W * max_rows, 8)), True, True, True),
                Arg(counts, False, False)]

    @staticmethod
    def _offsets(n):
        return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(n).astype(jnp.int32)])

    def ours(self, c, m, y, n):
        return (nvc.reduce_scatter_v(y, self._offsets(n), c),)

    def ref(self, y, n):
        """Segments padded to [W, max_rows, ...] in float32, lax.psum_scatter."""
        off, max_rows = self._offsets(n), y.shape[0] // W
        j = jnp.arange(max_rows)
        rows = jnp.where(j[None, :] < n[:, None], off[:-1, None] + j[None, :], y.shape[0])
        padded = jnp.take(y.astype(jnp.float32), rows.reshape(-1), axis=0, mode="fill",
                          fill_value=0)                                 # [W * max_rows, ...]
        am = jax.sharding.get_abstract_mesh()
        if AxisType.Explicit not in am.axis_types:
            return (lax.psum_scatter(padded, "tp", tiled=True).astype(y.dtype),)
        # jax 0.12 cannot type psum_scatter in a partially manual region of Explicit axes
        mine = lax.dynamic_slice_in_dim(lax.psum(padded, "tp"),
                                        lax.axis_index("tp") * max_rows, max_rows)
        return (mine.astype(y.dtype),)

    def compare(self, a, b):
        _tol(a[0], b[0], 1e-6)


class MoE:
    name, calls, grads = "moe_dispatch+moe_combine", 2, True
    no_explicit_grad = ("not supported: the backward passes index arrays typed split over "
                        "Explicit axes (docs/API.md, lax parity)")
    vmap_error = "moe_dispatch: jax.vmap is not supported"

    def __init__(self, split=False):
        self.split = split
        if split:
            self.name = "moe_dispatch_send/recv+moe_combine_send/recv"
            self.calls = 4
            self.vmap_error = "moe_dispatch_send: jax.vmap is not supported"

    def args(self, rng, odd, nb):
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(W * T)])
        ids = np.broadcast_to(ids, (B,) + ids.shape) if nb else ids
        return [Arg(_rand(rng, nb, (W * T, H)), True, True, True),
                Arg(np.ascontiguousarray(ids).astype(np.int32), True, True),
                Arg(rng.random((B, W * T, K) if nb else (W * T, K)).astype(np.float32), True,
                    True, True)]

    def ours(self, c, m, x, ids, w):
        if self.split:
            d = nvc.moe_dispatch_recv(nvc.moe_dispatch_send(x, ids, m), m)
            y = nvc.moe_combine_recv(nvc.moe_combine_send(jnp.tanh(d.expert_x), d.handle, m),
                                     w, m)
        else:
            d = nvc.moe_dispatch(x, ids, m)
            y = nvc.moe_combine(jnp.tanh(d.expert_x), w, d.handle, m)
        return self._rows(d.expert_x, d.expert_counts), d.expert_counts, y

    def ref(self, x, ids, w):
        ex, cnt, _, h = moe_dispatch_xla(x, ids, axis_name="tp", num_experts=E)
        return self._rows(ex, cnt), cnt, moe_combine_xla(jnp.tanh(ex), w, h, axis_name="tp",
                                                         num_experts=E)

    @staticmethod
    def _rows(ex, cnt):  # rows past an expert's count are unspecified (API.md)
        keep = jnp.arange(ex.shape[1])[None, :, None] < cnt[:, None, None]
        return jnp.where(keep, ex, 0)

    def compare(self, a, b):
        _same(a[0], b[0])
        _same(a[1], b[1])
        _tol(a[2], b[2], 1e-6)


class Ragged:
    name, calls, grads, vmap_error = "ragged_all_to_all", 1, True, None
    no_explicit_grad = MoE.no_explicit_grad

    def args(self, rng, odd, nb):
        n, m = (5, 7) if odd else (6, 8)
        index = make_call(rng, W, 2, n, m)                         # [W, K] each, k = 2
        return [Arg(_rand(rng, nb, (W * n, 8)), True, True, True),
                Arg(_rand(rng, nb, (W * m, 8)), True, True, True)] + \
            [Arg(a.reshape(-1).astype(np.int32), True, False) for a in index]

    def ours(self, c, m, operand, output, *index):
        return (nvc.ragged_all_to_all(operand, output, *index, c),)

    def ref(self, operand, output, *index):
        """lax.ragged_all_to_all's semantics from lax.all_gather and a scatter (the independent
        reference: not the emulation that strategy="xla" runs on CPU devices)."""
        return (ragged_all_to_all_reference(operand, output, *index, axis_name="tp"),)

    def compare(self, a, b):
        _same(a[0], b[0])


OPS = [AllReduce(), Fused(), Fused(batched_weight=True), Quant(), AllGather(), AllGatherV(),
       ReduceScatterV(), MoE(), MoE(split=True), Ragged()]


def _whole(x):
    """x unsplit over Explicit mesh axes (the lax references index and sort whole arrays)."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if spec is None or all(e is None for e in spec):
        return x
    return jax.sharding.reshard(x, P())


def _rand(rng, nb, shape):
    return rng.standard_normal(((B,) if nb else ()) + shape).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# the forms

VMAP_FORMS = ("vmap", "vmap_partial", "grad_vmap", "vmap_grad")
GRAD_FORMS = ("remat_grad", "grad_vmap", "vmap_grad", "explicit_grad")
MESH_OF = {"plain": "plain", "partial_dp_tp": "dp_tp", "partial_tp_dp": "tp_dp", "explicit_grad": "explicit",
           "vmap": "plain", "vmap_partial": "dp_tp", "scan": "dp_tp", "remat_grad": "dp_tp",
           "grad_vmap": "plain", "vmap_grad": "plain", "cond": "dp_tp", "explicit": "explicit",
           "set_mesh": "dp_tp"}
FORMS = list(MESH_OF)


def _loss(outs):
    """A scalar of the float outputs, weighted so every element matters."""
    total = 0.0
    for o in outs:
        if jnp.issubdtype(o.dtype, jnp.floating):
            wgt = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
            total = total + jnp.sum(o.astype(jnp.float32) * wgt)
    return total


def _grads(f, args, diff):
    """Gradients of _loss(f(*args)) with respect to the args marked diff."""
    idx = [i for i, d in enumerate(diff) if d]

    def loss(*d):
        full = list(args)
        for i, v in zip(idx, d):
            full[i] = v
        return _loss(f(*full))

    return jax.grad(loss, argnums=tuple(range(len(idx))))(*[args[i] for i in idx])


def _body(form, op, c, m, args):
    """(our outputs, the lax reference's) of the op in `form`, on the local shards."""
    ours = lambda *a: tuple(op.ours(c, m, *a))
    ref = lambda *a: tuple(op.ref(*[_whole(v) for v in a]))
    in_axes = [0 if a.batched else None for a in args]
    diff = [a.diff for a in args]
    if form in ("vmap", "vmap_partial"):
        return jax.vmap(ours, in_axes=in_axes), jax.vmap(ref, in_axes=in_axes)
    if form == "scan":
        def layers(f):
            def run(*a):
                def step(_, scale):  # each layer scales the first argument: new data per layer
                    return None, f(a[0] * scale, *a[1:])
                return lax.scan(step, None, jnp.arange(1, L + 1, dtype=a[0].dtype))[1]
            return run
        return layers(ours), layers(ref)
    if form in ("remat_grad", "explicit_grad"):
        return (lambda *a: _grads(jax.checkpoint(ours), a, diff),
                lambda *a: _grads(ref, a, diff))
    if form == "grad_vmap":
        return (lambda *a: _grads(jax.vmap(ours, in_axes=in_axes), a, diff),
                lambda *a: _grads(jax.vmap(ref, in_axes=in_axes), a, diff))
    if form == "vmap_grad":
        return (jax.vmap(lambda *a: _grads(ours, a, diff), in_axes=in_axes),
                jax.vmap(lambda *a: _grads(ref, a, diff), in_axes=in_axes))
    return ours, ref


def _program(form, op, comms, rng, check_vma, shard_dp=True):
    """(jitted program, its global arguments, its mesh); the program returns (ours, ref) with
    every output stacked over tp ([W, ...]: each rank's copy)."""
    kind = MESH_OF[form]
    c, m = comms[kind]
    mesh = c.mesh
    nb = form in VMAP_FORMS
    args = op.args(rng, form == "partial_tp_dp", nb)
    tp_dim = [1 if (nb and a.batched) else 0 for a in args]
    specs = [P(*[None] * d, "tp") if a.rank else P() for a, d in zip(args, tp_dim)]
    values = [jnp.asarray(a.value) for a in args]
    f_ours, f_ref = _body(form, op, c, m, args)

    def body(flag, *local):
        if form == "cond":  # a uniform predicate: our op in one branch, the lax code in other
            got = lax.cond(flag[0] > 0, f_ours, f_ref, *local)
        else:
            got = f_ours(*local)
        return jax.tree.map(lambda o: o[None], (got, f_ref(*local)))

    partial = kind != "plain"
    kw = dict(in_specs=(P(), *specs), out_specs=P("tp"), check_vma=check_vma)
    if partial:
        kw["axis_names"] = {"tp"}
    if form != "set_mesh":
        kw["mesh"] = mesh
    smap = jax.shard_map(body, **kw)
    values = [jnp.ones((1,), jnp.int32)] + values
    if kind != "explicit" and (not partial or form == "partial_tp_dp" or not shard_dp):
        return jax.jit(smap), values, mesh
    # rows split over dp too, by jit's in/out shardings (Explicit axes: the arrays' own types)
    shard_in = [NamedSharding(mesh, P())] + [
        NamedSharding(mesh, P(*[None] * d, ("tp", "dp")) if a.rank and shard_dp and
                      v.shape[d] % (W * DP) == 0 else s)
        for a, d, s, v in zip(args, tp_dim, specs, values[1:])]
    values = [jax.device_put(v, s) for v, s in zip(values, shard_in)]
    if kind == "explicit":
        return jax.jit(smap), values, mesh
    with jax.set_mesh(mesh):
        out_shapes = jax.eval_shape(smap, *values)
    shard_out = jax.tree.map(
        lambda o: NamedSharding(mesh, P("tp", "dp") if o.ndim > 1 and o.shape[1] % DP == 0
                                else P("tp")), out_shapes)
    return jax.jit(smap, in_shardings=shard_in, out_shardings=shard_out), values, mesh


def _kernel_calls(jitted, values):
    return len(re.findall(r"custom_call @nvc_", jitted.lower(*values).as_text()))


CASES = [(op, form, True) for op in OPS for form in FORMS]
CASES += [(op, form, False) for op in OPS for form in ("plain", "partial_dp_tp", "vmap_partial",
                                                        "explicit")]


@pytest.mark.parametrize("op,form,check_vma", CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_parity(comms, rng, op, form, check_vma, shard_dp=True):
    if form in GRAD_FORMS and not op.grads:
        pytest.skip(f"{op.name} has no gradient (an inference op)")
    if form == "explicit_grad" and getattr(op, "no_explicit_grad", None):
        pytest.skip(op.no_explicit_grad)
    if op.vmap_error and form in VMAP_FORMS:
        with pytest.raises(NotImplementedError, match=re.escape(op.vmap_error)):
            jitted, values, mesh = _program(form, op, comms, rng, check_vma, shard_dp)
            with jax.set_mesh(mesh):
                jitted.lower(*values)
        return
    jitted, values, mesh = _program(form, op, comms, rng, check_vma, shard_dp)
    with jax.set_mesh(mesh):
        if W > 1 and form in ("plain", "partial_dp_tp", "partial_tp_dp", "vmap",
                              "vmap_partial", "explicit", "set_mesh"):
            # ONE kernel call per op call, whatever the form (a group of one may take XLA's
            # path: the GPU module runs this matrix with world 1 on one GPU)
            assert _kernel_calls(jitted, values) == op.calls
        ours, ref = jitted(*values)
    if form in GRAD_FORMS:  # the gradients of every differentiated argument
        for a, b in zip(ours, ref, strict=True):
            _tol(a, b, 1e-5)
    else:
        op.compare(ours, ref)


@pytest.fixture(scope="module")
def comms_of_one():
    """Communicators over a "tp" axis of one device (dp = 2): groups of one."""
    global W, DP
    saved, (W, DP) = (W, DP), (1, 2)
    try:
        out = make_comms()
    finally:
        W, DP = saved
    yield out
    close_comms(out)


@pytest.mark.parametrize("op,form", [(op, form) for op in OPS for form in
                                     ("plain", "partial_dp_tp", "vmap_partial", "cond",
                                      "explicit", "remat_grad")],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_parity_group_of_one(comms_of_one, rng, monkeypatch, op, form):
    """Groups of one (the XLA paths of all_gather and the v-ops, world-1 paths of the others)
    keep the parity, typing included (a cond's branches must agree). The arguments are not
    sharded over dp by jit here: XLA then refuses lax.psum over the manual axis of size 1
    ("Cross-partition allreduce must be in (partial) manual partitioning mode")."""
    monkeypatch.setitem(globals(), "W", 1)
    monkeypatch.setitem(globals(), "DP", 2)
    test_parity(comms_of_one, rng, op, form, True, shard_dp=False)


# ---------------------------------------------------------------------------------------------
# the mechanism itself: what the nested shard_map splits, and that a plain call has none

def _eqns(jaxpr):
    """Every equation of a (closed) jaxpr, sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else [v]):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from _eqns(sub)


def _norm(spec):
    """A PartitionSpec as a tuple without trailing Nones (P("dp", None) == P("dp"))."""
    t = tuple(spec)
    while t and t[-1] is None:
        t = t[:-1]
    return t


def _inner_specs(mesh, f, *args, axis_names=frozenset({"tp"})):
    """in_specs of the shard_maps nested in `f`'s partially manual body (the kernel calls')."""
    smap = jax.shard_map(f, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                         axis_names=set(axis_names))
    with jax.set_mesh(mesh):
        eqns = list(_eqns(jax.make_jaxpr(smap)(*args)))
    return [e.params["in_specs"] for e in eqns if e.primitive.name == "shard_map"
            and e.params["newly_manual_axes"] == frozenset({"dp"})]


@pytest.mark.parametrize("case,shape,want", [
    ("all_reduce", (4, 32), P("dp")),          # rows divide: split them
    ("all_reduce", (3, 32), P(None, "dp")),    # else the next dim that divides
    ("all_reduce", (3, 5), P()),               # none divides: whole (every dp group all data)
    ("fused", (3, 32), P()),                   # rows only (RMSNorm reads the whole row)
    ("fused", (4, 32), P("dp")),
    ("all_gather", (4, 6), P(None, "dp")),     # never the gathered dim
    ("ragged", (4, 8), P(None, "dp")),         # the dims after the rows
    ("moe", (T, H), P()),                      # routing orders all tokens: whole
])
def test_nested_shard_map_splits_an_independent_dim(comms, case, shape, want):
    c, m = comms["dp_tp"]
    x = jnp.zeros((W * shape[0],) + shape[1:], jnp.float32)
    ops = {
        "all_reduce": lambda v: nvc.all_reduce(v, c)[None],
        "fused": lambda v: nvc.all_reduce_rms_norm(v, v, jnp.ones(v.shape[1:]), c)[0][None],
        "all_gather": lambda v: nvc.all_gather(v, c)[None],
        "ragged": lambda v: nvc.ragged_all_to_all(v, v, *[jnp.zeros(W, jnp.int32)] * 4, c)[None],
        "moe": lambda v: nvc.moe_dispatch(v, jnp.zeros((T, K), jnp.int32) - 1, m).expert_x[None],
    }
    specs = _inner_specs(c.mesh, ops[case], x)
    assert specs and _norm(specs[0][0]) == _norm(want), specs


def test_explicit_axes_follow_the_typed_sharding(comms):
    """Explicit dp: the kernel call splits what the data's type splits (here the hidden dim,
    not the rows the Auto rule would pick), and the result keeps lax.psum's typed sharding."""
    c, _ = comms["explicit"]
    mesh = c.mesh
    x = jax.device_put(jnp.zeros((W * 4, 32), jnp.float32), NamedSharding(mesh, P("tp", "dp")))
    types = []

    def f(v):
        out, ref = nvc.all_reduce(v, c), lax.psum(v, "tp")
        types.append((jax.typeof(out).sharding.spec, jax.typeof(ref).sharding.spec))
        return out[None]

    assert _norm(_inner_specs(mesh, f, x)[0][0]) == _norm(P(None, "dp"))
    assert types[0][0] == types[0][1], types


def test_plain_call_adds_nothing(comms):
    """Fully manual: no nested shard_map, one FFI call, no reshape or transpose around it (the
    compiled HLO of these programs was diffed against the code before this wrapper: equal)."""
    c, _ = comms["plain"]
    x = jnp.zeros((W * 4, 32), jnp.float32)
    for f in (lambda v: nvc.all_reduce(v, c), lambda v: nvc.all_gather(v, c),
              lambda v: nvc.all_reduce_rms_norm(v, v, jnp.ones(32), c)[0]):
        smap = jax.shard_map(f, mesh=c.mesh, in_specs=P("tp"), out_specs=P("tp"))
        names = [e.primitive.name for e in _eqns(jax.make_jaxpr(smap)(x))]
        assert names.count("shard_map") == 1 and names.count("ffi_call") == 1, names
        assert not {"reshape", "transpose"} & set(names), names


class OneShot(AllReduce):
    name = "all_reduce[oneshot]"

    def ours(self, c, m, x):
        return (nvc.all_reduce(x, c, strategy="oneshot"),)


def test_partial_manual_decides_on_each_devices_share(rng):
    """Mesh (dp=2 Auto, tp=4), shard_map over tp only: what depends on the message size
    (strategy, whether the call fits the buffers) is decided on each device's share, split
    over dp, not on the unsplit array. Every call here fits per device but not unsplit: each
    makes its kernel call (an explicit "oneshot" too, above the Lamport slot unsplit, and
    ragged_all_to_all, which on CPU devices refuses a call that does not fit), with the lax
    results; a "oneshot" share above the slot is still refused."""
    mesh = _mesh("dp_tp")
    with nvc.Communicator(mesh, "tp", max_message_bytes=8192) as c:
        rows, n = 32, 8                        # 32 x 128 float32: 16 KiB unsplit, 8 KiB each
        big = lambda: _rand(rng, False, (W * rows, 128))          # noqa: E731
        small = lambda: _rand(rng, False, (W * n, 128))           # noqa: E731
        counts = rng.integers(0, n + 1, W).astype(np.int32)
        cases = [(AllReduce(), [big()]), (OneShot(), [small()]),
                 (Fused(), [big(), big(), 1 + 0.1 * _rand(rng, False, (128,))]),
                 (Quant(), [big(), big(), 1 + 0.1 * _rand(rng, False, (128,))]),
                 (AllGather(), [small()]), (AllGatherV(), [small(), counts]),
                 (ReduceScatterV(), [_rand(rng, False, (W * W * n, 128)), counts]),
                 (Ragged(), [_rand(rng, False, (W * 24, 128)), big()] +
                  [a.reshape(-1).astype(np.int32) for a in make_call(rng, W, 2, 24, rows)])]
        # unsplit, none of them fits: 16 KiB messages, a 4 KiB one-shot message, gathers of
        # 4 x 4 KiB, varlen rows of 512 bytes
        assert rows * 128 * 4 > c.max_message_bytes and n * 128 * 4 > c.lamport_slot_bytes
        assert W * n * 128 * 4 > c.max_message_bytes and not varlen.fits(c, n, 512)
        assert not ragged.fits(c, rows, 512, 2)  # 32 output rows of 512 bytes, 2 slices a peer
        assert varlen.fits(c, n, 256) and ragged.fits(c, rows, 256, 2)  # split over dp: fit
        rank = {ReduceScatterV: [True, False], AllGatherV: [True, True], Ragged: [True] * 6}
        specs, values, sizes = [], [], []
        for op, args in cases:
            sizes.append(len(args))
            for k, a in enumerate(args):
                split = rank.get(type(op), [True, True, False])[k]
                specs.append(P("tp") if split else P())
                values.append(jnp.asarray(a))

        def body(*local):
            outs, i = [], 0
            for (op, _), k in zip(cases, sizes):
                a = local[i:i + k]
                i += k
                outs.append((tuple(op.ours(c, None, *a)), tuple(op.ref(*a))))
            return jax.tree.map(lambda o: o[None], outs)

        prog = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=P("tp"),
                                     axis_names={"tp"}))
        with jax.set_mesh(mesh):
            hlo = prog.lower(*values).as_text()
            got = prog(*values)
        calls = collections.Counter(re.findall(r"custom_call @nvc_(\w+)\(", hlo))
        assert calls == {"all_reduce": 2, "all_reduce_rms": 1, "all_reduce_rms_quant": 1,
                         "all_gather": 2, "all_gather_v": 1, "reduce_scatter_v": 1,
                         "ragged_all_to_all": 1}, calls
        for (op, _), (ours, ref) in zip(cases, got):
            op.compare(ours, ref)

        def too_big(v):  # 16 x 128 float32: 4 KiB a device, above the 2560-byte slot
            return nvc.all_reduce(v, c, strategy="oneshot")[None]
        with pytest.raises(ValueError, match="strategy='oneshot' takes messages up to 2560 "
                                             "bytes on this communicator, got 4096"):
            with jax.set_mesh(mesh):
                jax.jit(jax.shard_map(too_big, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"),
                                      axis_names={"tp"})).lower(jnp.zeros((W * 16, 128)))


# ---------------------------------------------------------------------------------------------
# vmap: the rules' other branches

@pytest.mark.parametrize("what", ["all_gather_v", "reduce_scatter_v"])
def test_vmap_of_batched_counts_is_a_named_error(comms, what):
    c, _ = comms["plain"]

    def f(x, n):
        if what == "all_gather_v":
            return jax.vmap(lambda v, k: nvc.all_gather_v(v, k, c)[0])(x, n)[None]
        off = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), jnp.cumsum(n[:, None] *
                                                                        jnp.ones((B, W),
                                                                                 jnp.int32),
                                                                        axis=1)], axis=1)
        return jax.vmap(lambda v, o: nvc.reduce_scatter_v(v, o, c))(x, off)[None]

    arg = "num_rows" if what == "all_gather_v" else "offsets"
    x = jnp.zeros((B, W * W * 4, 8), jnp.float32)
    smap = jax.shard_map(f, mesh=c.mesh, in_specs=(P(None, "tp"), P()), out_specs=P("tp"))
    with pytest.raises(NotImplementedError, match=f"{what}: vmap with a batched {arg}"):
        jax.jit(smap).lower(x, jnp.ones((B,), jnp.int32))


def test_vmap_batch_past_the_buffers_takes_xla(rng):
    """A batch folded into one message larger than max_message_bytes: lax.psum /
    lax.all_gather (as for any large message), same results; a "oneshot" request whose folded
    message outgrew the Lamport slot runs the other kernel."""
    mesh = _mesh("plain")
    with nvc.Communicator(mesh, "tp", max_message_bytes=8192) as c:
        x = jnp.asarray(rng.standard_normal((8, W * 2, 256)), jnp.float32)  # 2 KiB a call
        s = x[:2]  # a gather of 8 KiB (two of 16 KiB), a one-shot message of 2 KiB (two: 4)

        def f(v, u):
            return (jax.vmap(lambda a: nvc.all_reduce(a, c, strategy="twoshot"))(v)[None],
                    jax.vmap(lambda a: nvc.all_gather(a, c))(u)[None],
                    jax.vmap(lambda a: nvc.all_reduce(a, c, strategy="oneshot"))(u)[None],
                    lax.psum(v, "tp")[None], lax.all_gather(u, "tp", axis=1, tiled=True)[None],
                    lax.psum(u, "tp")[None])

        prog = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(None, "tp"), out_specs=P("tp")))
        assert 2 * 2 * 256 * 4 > c.lamport_slot_bytes  # the folded one-shot message outgrew it
        with pytest.warns(XlaPathWarning, match=r"all_reduce: a message of 16384 bytes"):
            assert _kernel_calls(prog, (x, s)) == 1  # only the one-shot request, as two-shot
        a, g, o, ra, rg, ro = prog(x, s)
        _tol(a, ra, 1e-6)
        _same(g, rg)
        _tol(o, ro, 1e-6)


def test_vmap_fused_unbatched_x_reduces_once(comms, rng):
    """x unbatched, residual batched: ONE all-reduce of x, then XLA's add + RMSNorm per
    batch element (residual_out differs per element, the sum does not)."""
    c, _ = comms["plain"]
    x = jnp.asarray(rng.standard_normal((W * 4, H)), jnp.float32)
    r = jnp.asarray(rng.standard_normal((B, W * 4, H)), jnp.float32)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(H), jnp.float32)

    def f(v, rr, ww):
        ours = jax.vmap(lambda q: nvc.all_reduce_rms_norm(v, q, ww, c, eps=EPS))(rr)
        ref = jax.vmap(lambda q: Fused().ref(v, q, ww))(rr)
        return jax.tree.map(lambda o: o[None], (ours, ref))

    prog = jax.jit(jax.shard_map(f, mesh=c.mesh, in_specs=(P("tp"), P(None, "tp"), P()),
                                 out_specs=P("tp")))
    assert _kernel_calls(prog, (x, r, w)) == 1
    ours, ref = prog(x, r, w)
    Fused().compare(ours, ref)
