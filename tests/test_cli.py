"""Every command line of the package describes itself: `--help` of the example
(`python -m jax_nvcomm.demo`), the benchmarks (`python -m jax_nvcomm.bench` and each
subcommand), the tuning (`python -m jax_nvcomm.tune`), the launcher and the topology report
names the command's purpose and gives every flag a description; `python -m
jax_nvcomm.topology` on a machine without GPUs says so and exits 0 without any warning."""
from __future__ import annotations

import argparse
import re
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
    assert set(listed) == set(sub.choices) == {"allreduce", "compile", "moe", "moelayer",
                                               "varlen", "ragged", "step", "inline"}
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


def _all_help(parser) -> str:
    """--help of `parser` and of each of its subcommands."""
    texts = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            texts += [sub.format_help() for sub in action.choices.values()]
    return "\n".join(texts)


def _parsers():
    return {"demo": moe_transformer.arg_parser("python -m jax_nvcomm.demo"),
            "tune": tune._parser(), "bench": bench_cli._parser()}


@pytest.mark.parametrize("name", ["demo", "tune", "bench"])
def test_help_names_no_internals(name):
    """Help is for users: no module files of the package, private names or Python calls."""
    text = _all_help(_parsers()[name])
    internal = re.compile(r"(?<![\w/])(?:bench|models|jax_nvcomm|topology)/\w+\.py|\b_\w+\.py"
                          r"|\b(?:tuning|tune|nvc|jax_nvcomm)\.\w+\(\)|\b[A-Z]+_MARGIN\b")
    assert not internal.findall(text), internal.findall(text)


def test_bench_help_lists_each_subcommand_once():
    text = bench_cli._parser().format_help()
    for name in ("allreduce", "moe", "varlen", "ragged", "step"):
        assert len(re.findall(rf"^\s+{name}\b", text, re.MULTILINE)) == 1, (name, text)


@pytest.mark.parametrize("text, value", [("1MiB", 1 << 20), ("64KiB", 64 << 10), ("64K", 64 << 10),
                                         ("1048576", 1 << 20), ("2mb", 2 << 20)])
def test_sizes_as_people_write_them(text, value):
    a = bench_cli._parser().parse_args(["allreduce", "--max-bytes", text])
    assert a.max_bytes == value
    assert tune._parser().parse_args(["--max-bytes", text, "--min-bytes", "4KiB"]).max_bytes \
        == value


def test_a_bad_size_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        bench_cli._parser().parse_args(["allreduce", "--max-bytes", "lots"])
    err = capsys.readouterr().err
    assert "--max-bytes" in err and "'lots'" in err and "1MiB" in err


def test_guide_sections_named_in_help_exist():
    """A help text that points to a section of docs/guide.md names one that is there."""
    guide = (HERE.parent / "docs" / "guide.md").read_text()
    titles = [line.lstrip("#").strip() for line in guide.splitlines() if line.startswith("#")]
    text = _all_help(moe_transformer.arg_parser("python -m jax_nvcomm.demo"))
    text = " ".join(text.split())
    named = re.findall(r"docs/guide\.md, '([^']+)'", text)
    assert named, "the demo's --no-split names a guide section"
    for title in named:
        assert any(t.startswith(title) for t in titles), (title, titles)


# words of the implementation a user of the commands has no use for
INTERNAL_WORDS = re.compile(r"\bslots?\b|\bkind=|\blamport\b|csrc/|\.cuh\b|\bprivate\b|"
                            r"\bmaintainers?\b|\btuning_builtin\.json\b", re.IGNORECASE)


def _commands():
    bench = [["-m", "jax_nvcomm.bench", name, "--help"]
             for name in _subcommands(bench_cli._parser()).choices]
    return ([["-m", "jax_nvcomm.bench", "--help"]] + bench +
            [["-m", mod, "--help"] for mod in ("jax_nvcomm.tune", "jax_nvcomm.topology",
                                               "jax_nvcomm.launch", "jax_nvcomm.demo")])


def test_every_help_runs_and_names_no_internal_term():
    """Every command's --help, as a user runs it: exit 0, and none of INTERNAL_WORDS."""
    for args in _commands():
        out = _run(args)
        assert out.returncode == 0, (args, out.stderr[-2000:])
        assert "usage:" in out.stdout, args
        found = INTERNAL_WORDS.findall(out.stdout)
        assert not found, (args[1:], found)


def _options_with_unexplained_defaults(parser, name=""):
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub_name, sub in a.choices.items():
                out += _options_with_unexplained_defaults(sub, f"{name} {sub_name}")
        elif (a.option_strings and a.help not in (None, argparse.SUPPRESS)
              and a.default not in (None, False, True, argparse.SUPPRESS)
              and "default" not in a.help.lower()):
            out.append(f"{name} {'/'.join(a.option_strings)}")
    return out


@pytest.mark.parametrize("name", ["demo", "tune", "bench"])
def test_every_default_is_explained(name):
    """An option with a default value says what the default is (or why it is what it is)."""
    assert _options_with_unexplained_defaults(_parsers()[name]) == []
