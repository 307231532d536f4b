"""Helpers for ops traced inside `jax.shard_map`: checking that the communicator belongs to the
surrounding mesh, the host backend's slot operand, result types that carry the right
varying-manual-axes (vma) so `check_vma=True` types results like the lax collectives, and the
one place that picks an op's FFI target for the communicator's backend."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def check_context(comm, what: str) -> None:
    """Raise unless we are inside shard_map over the communicator's mesh axis."""
    comm.check_usable(what)
    am = jax.sharding.get_abstract_mesh()
    axis = comm.axis_name
    if am is None or am.empty or axis not in am.axis_names:
        raise ValueError(f"jax_nvcomm: {what} must be called inside jax.shard_map over a mesh "
                         f"with axis {axis!r}")
    if axis not in am.manual_axes:
        raise ValueError(f"jax_nvcomm: {what}: axis {axis!r} is not manual here; call it inside "
                         f"shard_map over {axis!r}")
    want = dict(comm.mesh.shape)
    have = dict(am.shape)
    if want != have:
        raise ValueError(f"jax_nvcomm: {what}: the communicator was made for mesh {want} but is "
                         f"used inside shard_map over mesh {have}")


def host_slot(comm):
    """int32 scalar: group * world + rank of this device (host backend registry slot)."""
    mesh = comm.mesh
    g = jnp.int32(0)
    for name in mesh.axis_names:
        if name == comm.axis_name:
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
    """x, marked varying over `axis` when check_vma tracks it (no-op otherwise)."""
    if axis in vma_of(x):
        return x
    try:
        return lax.pcast(x, axis, to="varying")
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
