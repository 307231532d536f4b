"""jax_nvcomm: NVLink all-reduce (fused with residual-add + RMSNorm) and MoE dispatch/combine
as XLA FFI custom calls for `jax.jit` + `jax.shard_map` programs. See API.md / README.md."""
from . import _ffi  # registers the FFI targets
from ._dist import distributed_initialize
from .allgather import all_gather
from .communicator import Communicator

__version__ = "0.1.0"
CUDA_BUILT = _ffi.CUDA_BUILT

__all__ = ["Communicator", "all_gather", "distributed_initialize", "CUDA_BUILT"]
