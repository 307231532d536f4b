"""The command line of `python -m jax_nvcomm.bench`: one subcommand per benchmark."""
from __future__ import annotations

import argparse
import os

from . import __doc__ as _DOC
from . import ragged, step, varlen
from .allreduce import AR_METHODS, FUSED_METHODS, QUANT_METHODS, run_allreduce
from .common import _setup_env, add_loop_arguments, add_xla_best_argument
from .moe import run_moe


def _parser():
    p = argparse.ArgumentParser(prog="python -m jax_nvcomm.bench", description=_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("allreduce", "moe"):
        s = sub.add_parser(name)
        add_loop_arguments(s)
        add_xla_best_argument(s)
        if name == "allreduce":
            s.add_argument("--tune", action="store_true",
                           help="measure crossovers per world size; print them as tuning-file rows")
            s.add_argument("--hidden", type=int, nargs="*", help="hidden sizes")
            s.add_argument("--max-bytes", type=int, default=None)
            s.add_argument("--tokens", type=int, nargs="*",
                           help="only shapes with these tokens per rank")
            s.add_argument("--methods", nargs="*", choices=AR_METHODS + FUSED_METHODS
                           + QUANT_METHODS, help="only these methods (default: all)")
        else:
            s.add_argument("--tokens", type=int, nargs="*", help="tokens per rank")
            s.add_argument("--methods", nargs="*",
                           choices=("nvc", "nvc split", "xla ragged", "xla dense"),
                           help="only these methods (default: all; nvc split needs --split)")
            s.add_argument("--dtypes", nargs="*", choices=("bf16", "fp8"),
                           help="dispatch dtypes (default: both)")
            s.add_argument("--moe-hidden", type=int, default=None)
            s.add_argument("--experts", type=int, default=None)
            s.add_argument("--split", action="store_true",
                           help="also the split halves (moe_dispatch_send + _recv, "
                                "moe_combine_send + _recv) back to back, beside the fused calls")
    varlen.add_arguments(sub.add_parser(
        "varlen", help="all_gather_v / reduce_scatter_v vs padded all_gather and zero-filled "
                       "psum (jax_nvcomm/bench/varlen.py)"))
    ragged.add_arguments(sub.add_parser(
        "ragged", help="ragged_all_to_all vs lax.ragged_all_to_all at MoE shapes "
                       "(jax_nvcomm/bench/ragged.py)"))
    step.add_arguments(sub.add_parser(
        "step", help="whole jitted model steps, jax_nvcomm vs XLA (jax_nvcomm/bench/step.py)"))
    return p


def main(argv=None):
    a = _parser().parse_args(argv)
    if a.what == "step":
        return step.run_step(a)
    _setup_env()
    cpu_like = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    a.reps = a.reps or (3 if cpu_like else 7 if a.quick else 15)
    a.unroll = a.unroll or (4 if cpu_like else 25)
    a.steps = a.steps or (2 if cpu_like else 8)
    if a.what == "allreduce":
        return run_allreduce(a)
    if a.what == "varlen":
        return varlen.run_varlen(a)
    if a.what == "ragged":
        return ragged.run_ragged(a)
    return run_moe(a)
