"""Every command line of the package describes itself: `--help` of the example
(`python -m jax_nvcomm.demo`), the benchmarks (`python -m jax_nvcomm.bench` and each
subcommand), the tuning (`python -m jax_nvcomm.tune`), the launcher and the topology report
names the command's purpose and gives every flag a description; `python -m
jax_nvcomm.topology` on a machine without GPUs says so and exits 0 without any warning."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jax_nvcomm import tune
from jax_nvcomm.bench import cli as bench_cli
from jax_nvcomm.models import moe_transformer

HERE = Path(__file__).resolve().parent


def _undescribed(parser: argparse.ArgumentParser) -> list[str]:
    """The flags of `parser` (and of its subcommands) without a help text."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [f"{name} {flag}" for flag in _undescribed(sub)]
        elif not action.help and action.option_strings:
            out.append("/".join(action.option_strings))
    return out


def _subcommands(parser):
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub


def test_demo_help_describes_every_flag():
    p = moe_transformer.arg_parser("python -m jax_nvcomm.demo")
    assert "MoE" in p.description
    assert _undescribed(p) == []


def test_tune_help_describes_every_flag():
    p = tune._parser()
    assert "tuning file" in p.description
    assert _undescribed(p) == []


def test_bench_help_describes_every_subcommand_and_flag():
    p = bench_cli._parser()
    assert _undescribed(p) == []
    sub = _subcommands(p)
    listed = {a.dest: a.help for a in sub._choices_actions}
    assert set(listed) == set(sub.choices) == {"allreduce", "moe", "moelayer", "varlen", "ragged",
                                               "step"}
    for name, parser in sub.choices.items():
        assert listed[name], f"bench {name}: no line in the list of subcommands"
        assert parser.description and f"bench {name}" in parser.description, name


def _run(args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-W", "error", *args], capture_output=True,
                          text=True, cwd=HERE, env=env, timeout=timeout)


def test_launcher_help_describes_every_option():
    out = _run(["-m", "jax_nvcomm.launch", "--help"])
    assert out.returncode == 0, out.stderr
    for flag in ("--nproc", "--share-gpu", "--timeout", "-m MODULE", "JAX_NVCOMM_CPU_DEVICES",
                 "JAX_NVCOMM_FAST_EXIT", "distributed_initialize"):
        assert flag in out.stdout, flag


def test_topology_without_gpus_says_so_and_exits_0(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    out = _run(["-m", "jax_nvcomm.topology"], env=env)
    # -W error: the runpy warning of a module run with -m that its package already imported
    # would be an error here
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr
    assert "no NVIDIA GPU" in out.stdout


def test_topology_help():
    out = _run(["-m", "jax_nvcomm.topology", "--help"])
    assert out.returncode == 0 and "link" in out.stdout and "exits 0" in out.stdout
