"""nvc.moe_layer on GPUs (`pytest -m gpu`): tests/mp/moe_layer_mp.py (float64 reference over
random, skewed and token-less routings, rows past num_tokens zero, a CUDA-graph fori_loop of
layer calls) in one process over every local GPU, one process per GPU where there are 2+, and
2 and 4 processes sharing GPU 0 (our kernels only: NCCL refuses shared GPUs).
Run: JAX_NVCOMM_TEST_GPU=1 python -m pytest -m gpu tests/gpu/test_gpu_moe_layer.py
(skipped elsewhere, with the reason). Never uses NVLink multicast."""
import pytest

import gpu_env

pytestmark = gpu_env.MARKS

# one PASS line per config (4) + the graph loop + the script's last line, per process
PASSES = 6


def passed(rc, out, n):
    assert rc == 0, out[-6000:]
    assert out.count("PASS") == n * PASSES, out[-6000:]


def test_layer_one_process_all_gpus():
    rc, out = gpu_env.launch(0, "moe_layer_mp.py", "--rounds=2", "--graph_iters=20")
    passed(rc, out, 1)


@pytest.mark.parametrize("name,n,share", gpu_env.setups() + [("sh4", 4, True)],
                         ids=[s[0] for s in gpu_env.setups()] + ["sh4"])
def test_layer_processes(name, n, share):
    rc, out = gpu_env.launch(n, "moe_layer_mp.py", "--rounds=1", "--graph_iters=5",
                             share_gpu=share, timeout=240)
    passed(rc, out, n)
