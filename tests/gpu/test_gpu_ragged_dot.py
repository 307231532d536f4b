"""nvc.ragged_dot on GPUs (`pytest -m gpu`): tests/mp/ragged_dot_mp.py (float64 reference,
swiglu, a CUDA-graph fori_loop of chained calls, bitwise against the calls one by one) in one
process, and in 2 and 4 processes sharing GPU 0 (a local op: each process its own inputs).
Run: JAX_NVCOMM_TEST_GPU=1 python -m pytest -m gpu tests/gpu/test_gpu_ragged_dot.py (skipped
elsewhere, with the reason). Never uses NVLink multicast."""
import pytest

import gpu_env

pytestmark = gpu_env.MARKS

PASSES = 8  # per process: 3 cases x (ragged_dot, swiglu), the loop, the last line


def test_ragged_dot_one_process():
    rc, out = gpu_env.launch(0, "ragged_dot_mp.py", "--iters=20")
    assert rc == 0 and out.count("PASS") == PASSES, out[-6000:]


@pytest.mark.parametrize("n", [2, 4])
def test_ragged_dot_processes_sharing_gpu0(n):
    rc, out = gpu_env.launch(n, "ragged_dot_mp.py", "--iters=10", share_gpu=True, timeout=240)
    assert rc == 0 and out.count("PASS") == n * PASSES, out[-6000:]
