"""Test setup: 8 CPU host devices unless the run targets GPUs (JAX_NVCOMM_TEST_GPU=1)."""
import hashlib
import os

if os.environ.get("JAX_NVCOMM_TEST_GPU") == "1":
    # the GPU tests start launcher jobs next to this process: leave them GPU memory
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

# the strategy table every test expects is the built-in one: no tuning file or threshold from
# the caller's environment, and a tuning cache of its own (tests/test_tuning.py sets its own)
for _var in ("JAX_NVCOMM_TUNING", "JAX_NVCOMM_ONESHOT_MAX_BYTES", "JAX_NVCOMM_TWOSHOT_MAX_BYTES",
             "JAX_NVCOMM_LOCAL_MIN_BYTES"):
    os.environ.pop(_var, None)
if "JAX_NVCOMM_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile
    os.environ["JAX_NVCOMM_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_nvcomm_test_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_NVCOMM_CACHE_DIR"], True)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def make_mesh(shape, names):
    n = int(np.prod(shape))
    devs = jax.devices()
    if len(devs) < n:
        pytest.skip(f"needs {n} devices, have {len(devs)}")
    return jax.sharding.Mesh(np.array(devs[:n]).reshape(shape), names)


def seed_of(nodeid: str) -> int:
    """Stable across processes and runs (unlike hash(), which Python salts per process)."""
    return int.from_bytes(hashlib.sha256(nodeid.encode()).digest()[:4], "little")


@pytest.fixture
def rng(request):
    # fresh random data per test (each test id its own seed), the same on every run: a failure
    # reports its seed, and rerunning the test id reproduces the data
    seed = seed_of(request.node.nodeid)
    request.node.user_properties.append(("rng_seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if rep.failed:
        for k, v in item.user_properties:
            if k == "rng_seed":
                rep.sections.append(("rng seed",
                                     f"rng = np.random.default_rng({v})  # {item.nodeid}"))
    return rep


def pytest_terminal_summary(terminalreporter):
    """The skipped tests, one line per reason with its count (instead of pytest's `-rs`, which
    prints a line per skipping test location: over a hundred GPU tests on a CPU machine).
    `pytest -rs` still lists them one by one."""
    if "s" in terminalreporter.reportchars:
        return
    counts: dict[str, int] = {}
    for rep in terminalreporter.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reason = reason.removeprefix("Skipped: ")
        counts[reason] = counts.get(reason, 0) + 1
    for reason, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"skipped {n}: {reason}")
