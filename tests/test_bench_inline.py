"""`python -m jax_nvcomm.bench inline` runs and prints its table: a row per implementation and
form with positive times, and the two ratios (what it measures is not checked here: no timed
tests)."""
import re

import pytest

import jax_nvcomm as nvc
from jax_nvcomm.bench import cli


@pytest.fixture(autouse=True)
def _closed_after():
    yield
    nvc.close_all()


@pytest.mark.parametrize("op", ["psum", "int-psum"])
def test_inline_prints_its_table(op, capsys):
    assert cli.main(["inline", "--calls", "3", "--rows", "2", "--hidden", "64", "--op", op]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^(jax\.jit\(f, \*\*kw\)\(x\)|g = jax\.jit\(f\); g\(x\)|"
                      r"jax_nvcomm\.jit\(f, \*\*kw\)\(x\)|g = jax_nvcomm\.jit\(f\); g\(x\))"
                      r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.MULTILINE)
    assert len(rows) == 4, out
    assert all(float(v) > 0 for r in rows for v in r[1:])
    assert re.search(r"ratio jax_nvcomm\.jit / jax\.jit, inline \(median\): [\d.]+x "
                     r"\(target <= 1\.2x\)", out), out
    assert re.search(r"ratio jax_nvcomm\.jit / jax\.jit, held \(median\): [\d.]+x", out), out
    assert f"{op} of 2 x 64 per device" in out
