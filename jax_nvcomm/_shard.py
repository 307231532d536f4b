"""Helpers for ops traced inside `jax.shard_map`: checking that the communicator belongs to the
surrounding mesh, the host backend's slot operand, result types that carry the right
varying-manual-axes (vma) so `check_vma=True` types results like the lax collectives, the
one place that picks an op's FFI target for the communicator's backend, and the two wrappers
every op's kernel call goes through: `per_device` (partially manual shard_maps; `local_shape`:
the share of an argument each device's call gets) and `batching` (`jax.vmap`)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def axes(axis_name) -> frozenset:
    """The mesh axes of a communicator's axis_name (one axis or a tuple of them), as a set."""
    return frozenset((axis_name,) if isinstance(axis_name, str) else axis_name)


def axis_tuple(axis_name) -> tuple:
    """axis_name as a tuple of axes, in its order."""
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def check_context(comm, what: str) -> None:
    """Raise unless we are inside shard_map over the communicator's mesh axis (every axis of
    its tuple of axes)."""
    comm.check_usable(what)
    am = jax.sharding.get_abstract_mesh()
    for axis in axis_tuple(comm.axis_name):
        if am is None or am.empty or axis not in am.axis_names:
            raise ValueError(f"jax_nvcomm: {what} must be called inside jax.shard_map over a "
                             f"mesh with axis {axis!r}")
        if axis not in am.manual_axes:
            raise ValueError(f"jax_nvcomm: {what}: axis {axis!r} is not manual here; call it "
                             f"inside shard_map over {axis!r}")
    want = dict(comm.mesh.shape)
    have = dict(am.shape)
    if want != have:
        raise ValueError(f"jax_nvcomm: {what}: the communicator was made for mesh {want} but is "
                         f"used inside shard_map over mesh {have}")


def host_slot(comm):
    """int32 scalar: group * world + rank of this device (host backend registry slot): the
    group over the other mesh axes in mesh order, the rank over the communicator's axes as
    lax linearises them (_symmetric.groups_of)."""
    mesh = comm.mesh
    mine = axes(comm.axis_name)
    g = jnp.int32(0)
    for name in mesh.axis_names:
        if name in mine:
            continue
        g = g * jnp.int32(mesh.shape[name]) + lax.axis_index(name).astype(jnp.int32)
    r = lax.axis_index(comm.axis_name).astype(jnp.int32)
    return g * jnp.int32(comm.world_size) + r


def vma_of(x) -> frozenset:
    """The manual axes x varies over (empty when check_vma is off)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", frozenset()))


def varying(x, axis):
    """x, marked varying over `axis` (one axis or a tuple of them) when check_vma tracks it
    (no-op otherwise)."""
    have = vma_of(x)
    missing = tuple(a for a in axis_tuple(axis) if a not in have)
    if not missing:
        return x
    try:
        return lax.pcast(x, missing if len(missing) > 1 else missing[0], to="varying")
    except (ValueError, TypeError, NameError):
        return x


def result_type(like, shape, dtype, vma):
    """A result type for ffi_call: shape/dtype varying over exactly `vma`."""
    aval = jax.typeof(like)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return aval.update(shape=tuple(shape), dtype=dtype, weak_type=False,
                           manual_axis_type=mat.update(varying=frozenset(vma)))
    return aval.update(shape=tuple(shape), dtype=dtype, vma=frozenset(vma))


# JAX_NVCOMM_GRAPH_CAPTURE=0 makes every call of a communicator whose `graph_capture` is not set
# use the "_nograph" registration of its CUDA target (csrc/ffi/cuda_ffi_common.h): XLA keeps
# our calls out of its command buffers and cuts them there, as at NCCL collectives.
_GRAPH_CAPTURE = os.environ.get("JAX_NVCOMM_GRAPH_CAPTURE", "1") != "0"


def graph_capture(comm) -> bool:
    """Whether comm's CUDA calls may be recorded into XLA's command buffers (CUDA graphs):
    comm.graph_capture when set (True / False), else JAX_NVCOMM_GRAPH_CAPTURE (default on)."""
    v = getattr(comm, "graph_capture", None)
    return _GRAPH_CAPTURE if v is None else bool(v)


# JAX_NVCOMM_DECLARE_EFFECT=1 declares every call side-effecting again, as before the order
# token existed: only to measure what that declaration costs a step (docs/perf/step_speed.md).
_DECLARE_EFFECT = os.environ.get("JAX_NVCOMM_DECLARE_EFFECT", "0") == "1"


def ffi_call(comm, op: str, results, *args, order, cuda_attrs=None, aliases=None, **attrs):
    """Call op's FFI target for comm's backend, with comm_id and `attrs`. Host targets
    ("nvc_<op>") take the rank's registry slot as first operand; CUDA targets
    ("nvc_cuda_<op>", or "nvc_cuda_<op>_nograph" when `graph_capture(comm)` is off) find the
    rank by device ordinal and also get `cuda_attrs`.

    `order` is the order token of `_order` (the previous call's); it goes in as the last
    operand and the call's own token comes back as the last result: returns
    (results, order_out), results shaped like `results` (one type or a tuple of types).
    `aliases` ({index into args: index into results}) makes those results share the buffer of
    those operands (XLA's input_output_aliases; the host targets' slot operand, which comes
    first, is accounted for here).
    Declared without a side effect (a declared effect costs JAX's fast dispatch path: see
    docs/perf/step_speed.md); the order token keeps our calls in program order instead."""
    attrs["comm_id"] = np.int64(comm.comm_id)
    effect = _DECLARE_EFFECT
    single = not isinstance(results, (tuple, list))
    rts = (results,) if single else tuple(results)
    tok_vma = vma_of(order)  # varying over the axis when check_vma tracks it (token())
    rts = rts + (result_type(order, order.shape, order.dtype, tok_vma),)
    if comm.backend == "host":
        slot = varying(host_slot(comm), comm.axis_name)
        io = {i + 1: o for i, o in (aliases or {}).items()} or None
        outs = jax.ffi.ffi_call(f"nvc_{op}", rts, has_side_effect=effect,
                                input_output_aliases=io)(slot, *args, order, **attrs)
    else:
        target = f"nvc_cuda_{op}" + ("" if graph_capture(comm) else "_nograph")
        outs = jax.ffi.ffi_call(target, rts, has_side_effect=effect,
                                input_output_aliases=dict(aliases) if aliases else None)(
            *args, order, **attrs, **(cuda_attrs or {}))
    outs, tok = tuple(outs[:-1]), outs[-1]
    return (outs[0] if single else outs), tok


# ---------------------------------------------------------------------------------------------
# Partially manual shard_map: every kernel call runs with every mesh axis manual

def _entries(e) -> tuple:
    """The mesh axes of one PartitionSpec entry, as a tuple."""
    if e is None:
        return ()
    return tuple(e) if isinstance(e, tuple) else (e,)


def _parts(dims, assign, keep=None) -> list:
    """Per dim (up to the last split one): the axes that split it, those in `keep` only when
    given; dims[k] is split over assign[k]."""
    out = [()] * (max(dims, default=-1) + 1)
    for d, axes in zip(dims, assign):
        out[d] = tuple(a for a in axes if keep is None or a in keep)
    return out


def _spec(parts):
    """PartitionSpec of `_parts`."""
    return jax.sharding.PartitionSpec(*[p[0] if len(p) == 1 else (p or None) for p in parts])


def _typed_spec(x, ndim, axes):
    """x's typed sharding over `axes` (Explicit mesh axes), one tuple per dim."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = tuple(getattr(sharding, "spec", ())) + (None,) * ndim
    return [tuple(a for a in _entries(e) if a in axes) for e in spec[:ndim]]


def _assign(mesh, auto, explicit, lead, dims):
    """Which auto axes split which candidate dim of the lead argument: a list over `dims` of
    axis tuples. Explicit axes follow the lead's typed sharding (when it splits a candidate
    dim; otherwise it is made whole); the others go, in mesh order, to the first candidate
    dim whose size they divide."""
    assign = [list() for _ in dims]
    if lead is None:
        return assign
    typed = _typed_spec(lead, lead.ndim, explicit)
    for k, d in enumerate(dims):
        assign[k].extend(typed[d])
    for a in auto:
        if a in explicit:
            continue
        for k, d in enumerate(dims):
            parts = int(np.prod([mesh.shape[b] for b in assign[k]], dtype=np.int64))
            if lead.shape[d] % (parts * mesh.shape[a]) == 0:
                assign[k].append(a)
                break
    return assign


def _as_split(x, parts, explicit):
    """x resharded over the Explicit axes as `parts` says, unless it is typed so already."""
    want = list(parts) + [()] * (x.ndim - len(parts))
    if _typed_spec(x, x.ndim, explicit) == want:
        return x
    return jax.sharding.reshard(x, _spec(want))


def _typed_like(y, typed, explicit):
    """y resharded over the Explicit axes as `typed` (per dim axis tuples) says, where y has
    as many dims and their sizes divide; else y."""
    if y.ndim != len(typed) or _typed_spec(y, y.ndim, explicit) == list(typed):
        return y
    mesh = jax.sharding.get_abstract_mesh()
    for size, axes in zip(y.shape, typed):
        if size % int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64)):
            return y
    return jax.sharding.reshard(y, _spec(typed))


def like(y, x):
    """y typed over the Explicit axes of the context mesh as x is (a cotangent made on whole
    per-device arrays, returned for an argument typed split): a no-op elsewhere."""
    am = jax.sharding.get_abstract_mesh()
    if am is None or am.empty:
        return y
    explicit = frozenset(a for a, t in zip(am.axis_names, am.axis_types)
                         if t == jax.sharding.AxisType.Explicit and a not in am.manual_axes)
    if not explicit:
        return y
    return _typed_like(y, _typed_spec(x, x.ndim, explicit), explicit)


def _auto_axes(comm):
    """(the context's abstract mesh, comm's mesh axes not manual here ("auto": left to XLA's
    partitioner), those of them of type Explicit)."""
    am = jax.sharding.get_abstract_mesh()
    auto = tuple(a for a in comm.mesh.axis_names if a not in am.manual_axes)
    types = dict(zip(am.axis_names, am.axis_types))
    explicit = frozenset(a for a in auto if types[a] == jax.sharding.AxisType.Explicit)
    return am, auto, explicit


def local_shape(comm, x, dims) -> tuple:
    """The shape of x's share in each device's kernel call: what `per_device` passes to it
    when x is the lead argument with candidate dims `dims` (x's own shape where every mesh axis
    is manual). An op decides what depends on the message size (strategy, whether the call
    fits the buffers) on this shape, the message each device's call moves."""
    am, auto, explicit = _auto_axes(comm)
    if not auto:
        return tuple(x.shape)
    shape = list(x.shape)
    for d, axes in zip(dims, _assign(am, auto, explicit, x, dims)):
        shape[d] //= int(np.prod([am.shape[a] for a in axes], dtype=np.int64))
    return tuple(shape)


def per_device(comm, fn, args, tok, in_dims, out_dims):
    """Run `fn(*args, tok) -> (*outs, tok)`, an op's kernel call, with every axis of comm's
    mesh manual, so that each device makes its own call.

    Inside `jax.shard_map` manual over every mesh axis (the plain case) this is `fn(*args,
    tok)`: nothing is added to the program. Inside a partially manual one (`axis_names` = the
    communicator's axis and maybe others; the rest, "auto", left to XLA's partitioner) a kernel
    call cannot run as is: the host backend's slot names the device's coordinate on every axis
    (`host_slot`), and on GPUs the partitioner would replicate a custom call of an auto region
    over the auto axes. So fn runs in a nested `jax.shard_map` over the auto axes, with the
    surrounding check_vma (read from the token, varying over the axis when tracked).

    How the data is split over the auto axes: `in_dims[i]` / `out_dims[j]` name, for each
    argument and result, its dims that the collective treats independently (an all-reduce's
    elements, a gather's non-gathered dims), aligned: the k-th entry of every tuple is the same
    logical dimension; () for one that is never split. Axes of type Explicit split what the
    lead argument's (the first with dims) typed sharding splits among those dims (others are
    made whole first, `jax.sharding.reshard`); Auto axes go to the first such dim their size
    divides. An axis that finds none leaves the data whole on it: every group along it then
    makes the same call on all of the data, which is correct but moves that axis's size times
    the bytes (docs/API.md, "lax parity"). The token goes in and comes out whole. An op's XLA
    path goes through here too (tok None: `fn(*args) -> outs`), so that its indexing runs on
    per-device arrays, which Explicit axes do not type.

    Args:
      comm: the op's communicator (its mesh names the axes).
      fn: the kernel call; runs on the per-device shards.
      args: tuple of arrays; tok: the order token, or None (fn takes and returns none).
      in_dims, out_dims: per argument / result (token excluded), tuples of dims as above;
        both None: every argument and result whole (ops that cannot split their data).

    Returns:
      fn's results, (*outs, tok), as arrays of the surrounding (partially manual) program.
    """
    am, auto, explicit = _auto_axes(comm)
    if not auto:
        return fn(*args) if tok is None else fn(*args, tok)
    whole = jax.sharding.PartitionSpec()
    toks = () if tok is None else (tok,)
    tracked = axes(comm.axis_name) <= vma_of(varying(args[0], comm.axis_name) if tok is None
                                            else tok)
    if in_dims is None:  # every argument and result whole
        in_dims, out_specs = ((),) * len(args), whole
    lead = next((i for i, d in enumerate(in_dims) if d), None)
    assign = _assign(am, auto, explicit, None if lead is None else args[lead],
                     in_dims[lead] if lead is not None else ())
    if out_dims is not None:
        out_specs = (*[_spec(_parts(d, assign)) for d in out_dims], *(whole for _ in toks))
    typed = None if lead is None else _typed_spec(args[lead], args[lead].ndim, explicit)
    if explicit:  # shard_map takes Explicit axes only as the arguments are typed
        args = [_as_split(x, _parts(d, assign, explicit), explicit)
                for x, d in zip(args, in_dims)]
    outs = tuple(jax.shard_map(
        fn, in_specs=(*[_spec(_parts(d, assign)) for d in in_dims], *(whole for _ in toks)),
        out_specs=out_specs, axis_names=frozenset(auto), check_vma=tracked)(*args, *toks))
    if explicit and typed is not None and out_dims is not None:
        # results typed as lax types them: split over Explicit axes like the lead argument
        outs = tuple(_typed_like(o, typed, explicit) if i < len(out_dims) and out_dims[i]
                     else o for i, o in enumerate(outs))
    return outs


# ---------------------------------------------------------------------------------------------
# jax.vmap: one call for the whole batch

def batching(fn, rule):
    """`fn(*args, tok) -> (*outs, tok)`, an op's kernel call (the innermost function: the one
    that makes the FFI call and returns the order token), as a
    `jax.custom_batching.custom_vmap` function: under `jax.vmap` it runs
    `rule(size, batched, *args, tok) -> (outs, outs_batched, tok)` instead, where `batched`
    says which of args carry the batch (as their leading dim, size `size`) and the rule folds
    it into ONE call (of this or another kernel function). The token is never batched: it
    goes in and comes out whole: when only the token carries the batch (none of the op's own
    arguments do), the rule is not called and ONE unbatched call is made. `rule` may also be a
    string: vmap of batched arguments then raises NotImplementedError with that text (an op
    whose batch cannot be folded).

    The op's own `jax.custom_jvp` / `custom_vjp` wraps the result (outside): custom_vmap
    alone has no reverse-mode rule.

    Returns:
      The custom_vmap function, called like fn.
    """
    f = jax.custom_batching.custom_vmap(fn)

    @f.def_vmap
    def _rule(size, in_batched, *args):
        *args, tok = args
        if in_batched[-1]:
            tok = tok[0]
        if not any(jax.tree.leaves(in_batched[:-1])):  # only the token was batched
            outs = f(*args, tok)
            return outs, jax.tree.map(lambda _: False, outs)
        if isinstance(rule, str):  # an op's own arguments are batched and it cannot fold them
            raise NotImplementedError(rule)
        outs, out_batched, tok = rule(size, tuple(in_batched[:-1]), *args, tok)
        return (*outs, tok), (*out_batched, False)

    return f


def fold_slices(B, N, M, io, ss, oo, rs, what):
    """ragged_all_to_all's index arrays [B, K] of a vmap batch folded into one call's (lax's
    batching: example b's operand rows follow example b-1's, its offsets shifted by b * N and
    b * M; slice i of example b is folded slice i * B + b, so the B * k slices to one peer stay
    together: k -> k * B). Returns the four [B * K] arrays.

    Raises:
      ValueError: int32 offsets that cannot address the B * max(N, M) folded rows.
    """
    if io.dtype == jnp.int32 and B * max(N, M) >= 2 ** 31:
        raise ValueError(f"jax_nvcomm: {what}: a vmap batch of {B} folds to {B * max(N, M)} "
                         "rows, more than int32 offsets address: pass int64 offsets and sizes "
                         "(x64)")
    shift = jnp.arange(B, dtype=io.dtype)[:, None]
    io, oo = io + shift * N, oo + shift * M
    return tuple(a.T.reshape(-1) for a in (io, ss, oo, rs))


def batched(size, batched_flag, x):
    """x with the batch as its leading dim: broadcast when it is not batched."""
    return x if batched_flag else jnp.broadcast_to(x, (size,) + tuple(jnp.shape(x)))
