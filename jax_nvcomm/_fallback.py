"""The ops of a communicator in XLA fallback mode (`comm.xla_fallback`, decided at setup by
topology/: groups over several hosts, or GPUs without peer access): XLA's collectives, which
run over NCCL (and the network) on GPUs and gloo on CPUs, with the public ops' semantics.

Each public op checks its arguments as usual, then hands over here when `comm.xla_fallback`:
- all_reduce: `lax.psum`; all_reduce_rms_norm: `lax.psum` + XLA's add + RMSNorm (the "xla"
  strategy); all_gather: `lax.all_gather`;
- moe_dispatch / moe_combine: `reference.moe_dispatch_xla` / `moe_combine_xla` with
  impl="ragged" (`lax.ragged_all_to_all`; emulated on CPU). The routing arrays of that path
  travel in an `XlaMoEHandle`, a `MoEHandle` whose `expert_src` is not filled (-1): it carries
  the reference's own arrays instead. Gradients are JAX's autodiff of those functions.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from . import reference
from .moe_types import Dispatched, MoEHandle
from .reference import xla_all_reduce_rms_norm


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class XlaMoEHandle(MoEHandle):
    """MoEHandle of the XLA fallback: token_dest and expert_counts as usual, expert_src -1,
    `xla` the routing arrays of reference.moe_dispatch_xla."""
    xla: dict = dataclasses.field(default_factory=dict)


def all_reduce(x, comm):
    return lax.psum(x, comm.axis_name)


def all_reduce_rms_norm(x, residual, weight, comm, eps):
    return xla_all_reduce_rms_norm(x, residual, weight, comm.axis_name, eps)


def all_gather(x, comm, axis, tiled):
    return lax.all_gather(x, comm.axis_name, axis=axis, tiled=tiled)


def moe_dispatch(x, topk_ids, moe, num_tokens, x_scale) -> Dispatched:
    ex, counts, exs, h = reference.moe_dispatch_xla(
        x, topk_ids, axis_name=moe.axis_name, num_experts=moe.num_experts,
        num_tokens=num_tokens, x_scale=x_scale, impl="ragged")
    token_dest = jnp.where(h["valid"], topk_ids, -1).astype(jnp.int32)
    src = jnp.full((moe.num_local_experts, moe.world_size * moe.max_tokens), -1, jnp.int32)
    handle = XlaMoEHandle(token_dest, src, counts, xla=h)
    return Dispatched(ex, counts, exs if moe.scale_cols > 0 else None, handle)


def moe_combine(expert_y, topk_weights, handle, moe):
    if not isinstance(handle, XlaMoEHandle):
        raise TypeError("jax_nvcomm: moe_combine: handle must come from moe_dispatch on this "
                        f"XLA-fallback communicator, got a {type(handle).__name__} of a kernel "
                        "dispatch")
    return reference.moe_combine_xla(expert_y, topk_weights, handle.xla, axis_name=moe.axis_name,
                                     num_experts=moe.num_experts, impl="ragged")
