"""Test setup: 8 CPU host devices unless the run targets GPUs (JAX_NVCOMM_TEST_GPU=1)."""
import os

if os.environ.get("JAX_NVCOMM_TEST_GPU") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

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


@pytest.fixture
def rng(request):
    # fresh random data per test, reproducible from the test id
    seed = abs(hash(request.node.nodeid)) % (2**32)
    return np.random.default_rng(seed)
