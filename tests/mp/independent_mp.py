"""Independent collectives on GPUs (or CPU devices): the programs of tests/test_independent.py
(16 collectives with no data between them: 6 all_reduce one-/two-shot, 3 fused, 4 all_gather,
dispatch + combine, over three communicators; flat and inside a fori_loop), run --runs times
with fresh data, every shard compared with numpy.
  python tests/mp/independent_mp.py                              one process, all devices
  python -m jax_nvcomm.launch -n 2 tests/mp/independent_mp.py    one process per GPU
  python -m jax_nvcomm.launch -n 2 --share-gpu tests/mp/independent_mp.py
With --concurrent=1 it sets the XLA flags that allow the most concurrency on the GPU: every
op kind in command buffers (custom calls, loops, conditionals), graphs from 1 node, and
command-buffer scheduling CONCURRENT (independent commands become parallel graph branches).
"""
import os
import sys

from common import arg  # noqa: E402

if arg("concurrent", 0):
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (flags + " --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,"
                               "CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
                               " --xla_gpu_command_buffer_scheduling_mode=CONCURRENT").strip()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

from common import init, mesh1d, rank_print  # noqa: E402

nvc = init()
import test_independent as ti  # noqa: E402  (after init: jax.distributed first)

runs = arg("runs", 100)
mesh = mesh1d()
ti.W = mesh.shape["x"]
mesh_, c, c2, m = ti.make_comms(mesh)
ok = True
try:
    for in_loop in (False, True):
        f = ti.program(mesh, c, c2, m, in_loop)
        rng = np.random.default_rng(11 + in_loop)  # the same data in every process
        for i in range(runs):
            inputs = ti.make_inputs(rng)
            ti.check(f(*ti.global_inputs(mesh, inputs)), inputs)
        rank_print(f"PASS independent collectives ({'loop' if in_loop else 'flat'}): {runs} "
                   f"runs, {ti.W} ranks, handler runs {c.host_calls()}, "
                   f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    for x in (c, c2, m):
        assert not x.errors(), x.errors()
finally:
    for x in (m, c2, c):
        x.close()
