"""lax parity: every op, in every form a lax collective works in, against the lax collective in
the same program on fresh random data (host backend, 8 CPU devices).

Forms: plain shard_map; partially manual shard_map over the communicator's axis of a 2-D mesh
(("dp", "tp") with the rows split over dp by jit's in/out shardings, and ("tp", "dp") with
odd shapes that no auto axis divides: the whole-data case); vmap (in plain and partially manual
shard_map); scan over layers; checkpoint + grad; grad of vmap; vmap of grad; a uniform
lax.cond (our op in one branch, the lax code in the other: both typed alike); a mesh of
Explicit axes; jax.set_mesh. check_vma True everywhere, False where typing differs most.

References (written here, from lax): psum; psum + add + RMSNorm; all_gather; a padded
all_gather + compaction (all_gather_v) and padded psum_scatter in float32 (reduce_scatter_v);
reference.moe_dispatch_xla / moe_combine_xla. Gathers and dispatched rows are compared bit for
bit; sums within float32 tolerance (another summation order); FP8 outputs within one FP8 step.
The MoE ops cannot fold a batch into one call: vmap forms check the named error. Each program
also counts its kernel calls: ONE per op call in the plain, partial and vmap forms."""
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
from jax_nvcomm.reference import moe_combine_xla, moe_dispatch_xla, rms_norm_reference

W, DP, B, L = 4, 2, 2, 2          # tp size, dp size, micro-batches, scanned layers
E, K, T, H = 8, 2, 4, 32          # MoE: experts, top_k, tokens per rank, hidden
EPS = 1e-5


# ---------------------------------------------------------------------------------------------
# meshes and communicators

def _mesh(kind):
    devs = np.array(jax.devices()[:8])
    if kind == "plain":
        return jax.sharding.Mesh(devs[:W], ("tp",))
    if kind == "dp_tp":
        return jax.sharding.Mesh(devs.reshape(DP, W), ("dp", "tp"))
    if kind == "tp_dp":
        return jax.sharding.Mesh(devs.reshape(W, DP), ("tp", "dp"))
    return jax.sharding.Mesh(devs.reshape(DP, W), ("dp", "tp"),
                             axis_types=(AxisType.Explicit,) * 2)


@pytest.fixture(scope="module")
def comms():
    out = {}
    for kind in ("plain", "dp_tp", "tp_dp", "explicit"):
        mesh = _mesh(kind)
        out[kind] = (nvc.Communicator(mesh, "tp", max_message_bytes=1 << 20),
                     nvc.MoECommunicator(mesh, "tp", num_experts=E, top_k=K, max_tokens=T,
                                         hidden=H, dtype=jnp.float32))
    yield out
    for c, m in out.values():
        c.close()
        m.close()


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


OPS = [AllReduce(), Fused(), Fused(batched_weight=True), Quant(), AllGather(), AllGatherV(),
       ReduceScatterV(), MoE(), MoE(split=True)]


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
GRAD_FORMS = ("remat_grad", "grad_vmap", "vmap_grad")
MESH_OF = {"plain": "plain", "partial_dp_tp": "dp_tp", "partial_tp_dp": "tp_dp",
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
    if form == "remat_grad":
        return (lambda *a: _grads(jax.checkpoint(ours), a, diff),
                lambda *a: _grads(ref, a, diff))
    if form == "grad_vmap":
        return (lambda *a: _grads(jax.vmap(ours, in_axes=in_axes), a, diff),
                lambda *a: _grads(jax.vmap(ref, in_axes=in_axes), a, diff))
    if form == "vmap_grad":
        return (jax.vmap(lambda *a: _grads(ours, a, diff), in_axes=in_axes),
                jax.vmap(lambda *a: _grads(ref, a, diff), in_axes=in_axes))
    return ours, ref


def _program(form, op, comms, rng, check_vma):
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
    if not partial or form == "partial_tp_dp":
        return jax.jit(smap), values, mesh
    # rows split over dp too, by jit's in/out shardings (Explicit axes: the arrays' own types)
    shard_in = [NamedSharding(mesh, P())] + [
        NamedSharding(mesh, P(*[None] * d, ("tp", "dp")) if a.rank and
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
def test_parity(comms, rng, op, form, check_vma):
    if form in GRAD_FORMS and not op.grads:
        pytest.skip(f"{op.name} has no gradient (an inference op)")
    if op.vmap_error and form in VMAP_FORMS:
        with pytest.raises(NotImplementedError, match=re.escape(op.vmap_error)):
            jitted, values, mesh = _program(form, op, comms, rng, check_vma)
            with jax.set_mesh(mesh):
                jitted.lower(*values)
        return
    jitted, values, mesh = _program(form, op, comms, rng, check_vma)
    with jax.set_mesh(mesh):
        if form in ("plain", "partial_dp_tp", "partial_tp_dp", "vmap", "vmap_partial",
                    "explicit", "set_mesh"):  # ONE kernel call per op call, whatever the form
            assert _kernel_calls(jitted, values) == op.calls
        ours, ref = jitted(*values)
    if form in GRAD_FORMS:  # the gradients of every differentiated argument
        for a, b in zip(ours, ref, strict=True):
            _tol(a, b, 1e-5)
    else:
        op.compare(ours, ref)
