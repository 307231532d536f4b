"""lax parity on GPUs (the CUDA kernels): tests/test_parity.py's matrix (every op in every form
next to its lax counterpart in the same program, gradients included) in this process over the
local GPUs (world = their number; 1 on a one-GPU machine, where all_gather and the v-ops take
their group-of-one XLA paths and the others run the world-1 kernels), and tests/mp/parity_mp.py
(the forward forms against float64 numpy) through the launcher: 2 and 4 processes sharing GPU 0,
and one process per GPU where there are 2.
Run: JAX_NVCOMM_TEST_GPU=1 python -m pytest -m gpu tests/gpu/test_gpu_parity.py"""
import pytest

import gpu_env
import test_parity as tp

pytestmark = gpu_env.MARKS


@pytest.fixture(scope="module")
def gpu_comms():
    """test_parity's communicators over the local GPUs: tp = every GPU, dp = 1."""
    saved = tp.W, tp.DP
    tp.W, tp.DP = gpu_env.num_gpus(), 1
    out = tp.make_comms()
    yield out
    tp.close_comms(out)
    tp.W, tp.DP = saved


@pytest.mark.parametrize("op,form,check_vma", tp.CASES,
                         ids=lambda v: getattr(v, "name", str(v)))
def test_parity_in_process(gpu_comms, rng, op, form, check_vma):
    tp.test_parity(gpu_comms, rng, op, form, check_vma)


@pytest.mark.parametrize("name,n,share", gpu_env.setups() + [("sh4", 4, True)],
                         ids=lambda v: v if isinstance(v, str) else None)
def test_parity_across_processes(name, n, share):
    """Every op in the forward forms (plain, partially manual in both axis orders, vmap,
    vmap in partially manual, scan, uniform cond, Explicit axes, set_mesh) against numpy."""
    rc, out = gpu_env.launch(n, "parity_mp.py", share_gpu=share, timeout=420)
    assert rc == 0, out[-6000:]
    assert out.count("PASS") >= n, out[-6000:]
