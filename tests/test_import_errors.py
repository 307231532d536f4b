"""A source folder without compiled modules that comes first on sys.path (Python started in a
checkout's root after a plain `pip install .` or the wheel's install): where its Python files
equal the install's (the wheel was built from that checkout) the package imports and runs from
the install; otherwise the import fails with an error naming both folders and the fix, instead
of a bare ModuleNotFoundError of `_host`."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax_nvcomm

PKG = os.path.dirname(os.path.abspath(jax_nvcomm.__file__))


# Python without the editable install's import hook (it maps jax_nvcomm to this checkout before
# any folder on sys.path), as after a plain install
NO_HOOK = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
           "if 'editable' not in type(f).__module__]; ")


def _install_and_checkout(tmp_path):
    """tmp/site/jax_nvcomm: the package with its compiled modules (an install);
    tmp/checkout/jax_nvcomm: the same Python files without them (a checkout's root)."""
    from jax_nvcomm import _ffi
    site, checkout = tmp_path / "site" / "jax_nvcomm", tmp_path / "checkout" / "jax_nvcomm"
    shutil.copytree(PKG, site, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copytree(PKG, checkout, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for mod in (_ffi._host, _ffi._cuda):
        if mod is not None:
            shutil.copy(mod.__file__, site)
    return site, checkout


def _import_from(cwd, site, code):
    env = {**os.environ, "PYTHONPATH": str(site.parent), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    return subprocess.run([sys.executable, "-c", NO_HOOK + code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_checkout_of_the_installed_wheel_runs_from_its_root(tmp_path):
    site, checkout = _install_and_checkout(tmp_path)
    code = ("import jax, numpy as np, jax_nvcomm as nvc; from jax.sharding import PartitionSpec "
            "as P; from jax_nvcomm import _ffi; print(_ffi._host.__file__); "
            "mesh = jax.sharding.Mesh(np.array(jax.devices()), ('x',)); "
            "c = nvc.Communicator(mesh, 'x', max_message_bytes=1 << 16); "
            "x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32); "
            "f = jax.jit(jax.shard_map(lambda v: nvc.all_reduce(v, c), mesh=mesh, "
            "in_specs=P('x'), out_specs=P())); "
            "np.testing.assert_allclose(np.asarray(f(x)), x[:2] + x[2:], rtol=1e-6); "
            "c.close(); print('agrees')")
    p = _import_from(checkout.parent, site, code)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines()[0].startswith(str(site)) and "agrees" in p.stdout, p.stdout


def test_a_checkout_with_other_sources_says_what_to_do(tmp_path):
    site, checkout = _install_and_checkout(tmp_path)
    with open(checkout / "_version.py", "a") as f:
        f.write("# edited\n")
    p = _import_from(checkout.parent, site, "import jax_nvcomm")
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert f"imported the source folder {checkout}" in last, p.stderr[-3000:]
    assert f"instead of the install in {site}, whose sources differ" in last, last
    assert "Run from another folder" in last and "bash scripts/dev.sh install" in last, last
