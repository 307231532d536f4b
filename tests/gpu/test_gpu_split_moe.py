"""Split-phase MoE on GPUs (`pytest -m gpu`): tests/mp/split_moe_mp.py (split == fused bitwise,
float64 reference, two micro-batches in flight, ragged num_tokens, -1 ids, FP8 with scales, a
shared expert between the halves unchanged, the scheduled program, a fori_loop of split calls)
in one process over every local GPU (with and without command buffers / CUDA graphs), one
process per GPU and two processes sharing GPU 0; and a profiler trace showing the shared
expert's kernels on the GPU between the dispatch send and receive kernels.
Run: JAX_NVCOMM_TEST_GPU=1 python -m pytest -m gpu tests/gpu/test_gpu_split_moe.py
(skipped elsewhere, with the reason). Never uses NVLink multicast."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gpu_env
import jax_nvcomm as nvc

pytestmark = gpu_env.MARKS


def passed(rc, out, n):
    assert rc == 0, out[-6000:]
    assert out.count("PASS") == n, out[-6000:]
    assert out.count("SCHEDULE shared expert between send and receive OK") == n, out[-6000:]


@pytest.mark.parametrize("graph", [False, True], ids=["streams", "cuda_graphs"])
def test_split_one_process_all_gpus(graph):
    args = ["--rounds=8", "--iters=20"] + (["--graph"] if graph else [])
    rc, out = gpu_env.launch(0, "split_moe_mp.py", *args)
    passed(rc, out, 1)
    if graph:  # the loop body was replayed from a CUDA graph: handlers ran fewer times
        assert "split loop:" in out and "(CUDA graph replay)" in out.split("split loop:")[1] \
            .splitlines()[0], out[-6000:]


@pytest.mark.parametrize("name,n,share", gpu_env.setups(), ids=[s[0] for s in gpu_env.setups()])
def test_split_processes(name, n, share):
    rc, out = gpu_env.launch(n, "split_moe_mp.py", "--rounds=5", "--iters=10", share_gpu=share)
    passed(rc, out, n)


def test_trace_shows_shared_expert_between_halves(tmp_path):
    """Profiler trace of device 0: between the end of the dispatch send kernel and the start of
    the dispatch receive kernel, the shared expert's GEMM kernels ran (not only MoE kernels)."""
    from jax_nvcomm import _trace
    from jax_nvcomm.moe_split import kernels_between
    n = len(jax.devices())
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    E, K, T, H, F = 8 * n, 4, 128, 2048, 4096
    rng = np.random.default_rng(5)
    with nvc.MoECommunicator(mesh, "x", num_experts=E, top_k=K, max_tokens=T, hidden=H,
                             dtype=jnp.bfloat16) as moe:
        def f(x, ids, w1, w2):
            sent = nvc.moe_dispatch_send(x, ids, moe)
            (h,) = nvc.moe_overlap(sent, x)
            shared = jnp.dot(jax.nn.silu(jnp.dot(h, w1)), w2)
            d = nvc.moe_dispatch_recv(sent, moe, after=shared)
            return d.expert_x[:, :T].sum(0) + shared

        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P("x"), P(), P()),
                                  out_specs=P("x")))
        x = jnp.asarray(rng.standard_normal((n * T, H)), jnp.bfloat16)
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n * T)]).astype(np.int32)
        w1 = jnp.asarray(rng.standard_normal((H, F)) / np.sqrt(H), jnp.bfloat16)
        w2 = jnp.asarray(rng.standard_normal((F, H)) / np.sqrt(F), jnp.bfloat16)
        for _ in range(3):
            jax.block_until_ready(g(x, ids, w1, w2))
        path = _trace.record(g, (x, ids, w1, w2), str(tmp_path), steps=3)
        assert path is not None, "no profiler trace written"
        between = kernels_between(path, "dispatch_send_kernel", "dispatch_recv_kernel")
        print("kernels between the halves (device 0):", between[-1] if between else None)
        assert between, "no dispatch send/receive kernel pair in the trace"
        others = [k for k in between[-1] if "moe" not in k]
        assert others, f"nothing ran between send and receive: {between[-1]}"
        assert not moe.errors(), moe.errors()
