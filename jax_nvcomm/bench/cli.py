"""The command line of `python -m jax_nvcomm.bench`: one subcommand per benchmark, each
described by its module's docstring (`python -m jax_nvcomm.bench SUBCOMMAND --help`)."""
from __future__ import annotations

import argparse

from . import __doc__ as _DOC
from . import allreduce, compile as compile_, inline, moe, moelayer, moelayer_layer, ragged, step, \
    varlen
from .common import _setup_env, loop_defaults

# name -> (module, one line for the list of subcommands)
SUBCOMMANDS = {
    "allreduce": (allreduce, "all_reduce / all_reduce_rms_norm (+ FP8 output) vs lax.psum "
                             "(+ XLA's add + RMSNorm) over message sizes (loop benchmark)"),
    "moe": (moe, "moe_dispatch / moe_combine vs lax.ragged_all_to_all and a dense all_to_all "
                 "(loop benchmark)"),
    "varlen": (varlen, "all_gather_v / reduce_scatter_v vs padded all_gather and zero-filled "
                       "psum (loop benchmark)"),
    "ragged": (ragged, "ragged_all_to_all vs lax.ragged_all_to_all at MoE shapes (loop "
                       "benchmark)"),
    "moelayer": (moelayer, "an MoE layer's expert compute at decode shapes on one device: "
                           "nvc.ragged_dot vs lax.ragged_dot, each with its weight-read bound"),
    "compile": (compile_, "compile time of dense layers sharded by type: nvc.jit vs jax.jit"),
    "step": (step, "whole jitted steps of the example model, jax_nvcomm vs XLA's collectives"),
    "inline": (inline, "per-call time of jax_nvcomm.jit(f, **kw)(x) made anew at every call vs "
                       "the same inline jax.jit"),
}


def _description() -> str:
    """The package docstring for --help: without its own list of the subcommands (argparse
    lists them once, with SUBCOMMANDS' lines) and its note for readers of the code."""
    head, rest = _DOC.split("\n\n", 1)
    rest = rest.split("\n\n", 1)[1]
    rest = rest.split("\n\nThis module is not imported")[0]
    return head.rstrip(":") + ".\n\n" + rest.rstrip() + "\n"


def _parser():
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="python -m jax_nvcomm.bench", description=_description(),
                                formatter_class=raw)
    sub = p.add_subparsers(dest="what", required=True, metavar="SUBCOMMAND")
    for name, (module, line) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=line, description=module.__doc__, formatter_class=raw)
        module.add_arguments(sp)
        if name == "moelayer":  # + the whole layer's rows (bench/moelayer_layer.py)
            moelayer_layer.add_layer_arguments(sp)
    return p


def main(argv=None):
    a = _parser().parse_args(argv)
    if a.what == "step":
        return step.run_step(a)
    if a.what == "compile":
        return compile_.run_compile(a)
    _setup_env()
    if a.what == "inline":
        return inline.run_inline(a)
    if a.what == "moelayer":
        rc = moelayer.run_moelayer(a)
        moelayer_layer.run_layer(a)
        return rc
    loop_defaults(a)
    if a.what == "allreduce":
        return allreduce.run_allreduce(a)
    if a.what == "varlen":
        return varlen.run_varlen(a)
    if a.what == "ragged":
        return ragged.run_ragged(a)
    return moe.run_moe(a)
