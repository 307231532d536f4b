"""`python -m jax_nvcomm.demo [flags]`: the MoE transformer example (jax_nvcomm/models/moe_transformer.py):
a few MoE decoder layers in a low-latency layout (tensor-parallel attention and experts, fused
all-reduce + RMSNorm) and a high-throughput layout (data-parallel attention, expert-parallel MoE
with dispatch/combine), decode and prefill, each with jax_nvcomm and with XLA's collectives;
prints timings and whether both agree. 8 CPU devices when no GPU is present. `--help` for flags.
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    from .models.moe_transformer import main as _main
    return _main(argv, prog="python -m jax_nvcomm.demo")


if __name__ == "__main__":
    sys.exit(main())
