"""`jax_nvcomm.jit` and `jax_nvcomm.explain`: the compile pass that puts our kernels into
unchanged model code.

One module per job (each states at its top what it matches and what it refuses):
  entry.py    the `jit` entry point and its caches (`Jitted`)
  rewrite.py  the jaxpr walk: re-binds every equation, our ops in place of XLA's collectives
  sharding.py which products outside shard_map need an all-reduce, from the avals' shardings
              (Explicit axes) or the stated constraints (Auto axes)
  regions.py  cuts those into shard_map regions (product, psum, the add + norm after it) that
              the rewrite then serves
  type_gather.py  the all-gathers the avals' shardings imply (reshard, reshape / broadcast /
              convert with out_sharding, over an axis or a tuple of axes) and a top_k per shard
  norm.py     the psum -> add -> RMSNorm pattern (the fused all-reduce)
  pool.py     the communicators the pass makes (one per mesh and axes), made outside traces
  gather_scatter.py  all_gather / psum_scatter (any dim) / all_to_all / ragged_all_to_all
  explain.py  `explain`: one row per collective and per replaced op, and why
  axes.py     the model's axis names and mesh of a row (XLA's replica groups read back)
  userline.py the user's line of a row: jax, jax_nvcomm and thin helpers skipped
  eqn.py      small helpers on jaxpr equations (source lines, avals)

`jax_nvcomm.jit` (the attribute of the package) is the function; the modules are reached as
`from jax_nvcomm.jit import rewrite`.
"""
from .entry import Jitted, jit
from .explain import Explanation, explain

__all__ = ["Jitted", "jit", "Explanation", "explain"]
