"""The pytrees the MoE ops return and take: `MoEHandle` (what moe_combine needs to route results
back) and `Dispatched` (moe_dispatch's result). A leaf module, so that the kernel path (moe.py),
the split halves (moe_split.py) and the XLA fallback (_fallback.py) share them without importing
each other."""
from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEHandle:
    """What moe_combine needs to route results back (device arrays; no hidden state)."""
    token_dest: jax.Array     # int32 [max_tokens, top_k]: expert id of (t, k), -1 unused
    expert_src: jax.Array     # int32 [L, W*T]: (src * T + t) * K + k of each expert row
    expert_counts: jax.Array  # int32 [L]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dispatched:
    expert_x: jax.Array
    expert_counts: jax.Array
    expert_x_scale: jax.Array | None
    handle: MoEHandle
