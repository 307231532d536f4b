"""jax_nvcomm: NVLink all-reduce (fused with residual-add + RMSNorm), MoE dispatch/combine,
variable-length gather / reduce-scatter and ragged all-to-all as XLA FFI custom calls for
`jax.jit` + `jax.shard_map` programs. Reference: the functions' docstrings and, in the
repository, docs/API.md; how to use them in model code: docs/guide.md."""
from . import _ffi  # registers the FFI targets
from ._dist import distributed_initialize
from ._registry import close_all, communicators, register, unregister
from ._version import __version__
from .allgather import all_gather
from .allreduce import all_reduce, all_reduce_rms_norm
from .allreduce_quant import all_reduce_rms_norm_quant
from .jit import Explanation, explain, jit  # the package jax_nvcomm/jit/ (the attribute: the function)
from .communicator import Communicator, CommunicatorError
from .moe import Dispatched, MoECommunicator, MoEHandle, moe_combine, moe_dispatch
from .moe_experts import moe_layer
from .moe_split import (CombineSent, DispatchSent, moe_combine_recv, moe_combine_send,
                        moe_dispatch_recv, moe_dispatch_send)
from .moe_split import overlap as moe_overlap
from .ragged import ragged_all_to_all
from .ragged_dot import ragged_dot, select_ragged_dot_strategy
from .strategy import select_strategy
from .varlen import all_gather_v, reduce_scatter_v

CUDA_BUILT = _ffi.CUDA_BUILT  # the CUDA part is compiled in and loaded (not: a GPU is here)
cuda_available = _ffi.cuda_available  # usable here: CUDA_BUILT and a CUDA device that jax sees

__all__ = [
    "Communicator", "CommunicatorError", "MoECommunicator", "all_gather", "all_reduce",
    "all_reduce_rms_norm",
    "all_reduce_rms_norm_quant",
    "select_strategy", "moe_dispatch", "moe_combine", "moe_layer", "Dispatched", "MoEHandle",
    "moe_dispatch_send", "moe_dispatch_recv", "moe_combine_send", "moe_combine_recv",
    "moe_overlap", "DispatchSent", "CombineSent",
    "distributed_initialize", "CUDA_BUILT", "cuda_available", "all_gather_v", "reduce_scatter_v",
    "ragged_all_to_all", "communicators", "close_all",
    "register", "unregister", "ragged_dot", "select_ragged_dot_strategy", "jit", "explain",
    "Explanation",
]
