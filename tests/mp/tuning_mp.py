"""Every process of a job takes process 0's tuning table (jax_nvcomm/tuning.py, shared at
Communicator setup), whatever its own environment says. Usage:
  python -m jax_nvcomm.launch -n 2 tests/mp/tuning_mp.py --dir=DIR [--case=agree|bad]
agree: each process points JAX_NVCOMM_TUNING at a file of its own (process 0's: one-shot to
  1 KiB, two-shot to 2 KiB; the others': one-shot to 1 MiB) and the others also set
  JAX_NVCOMM_ONESHOT_MAX_BYTES; every process must choose with process 0's file, and "auto"
  calls at sizes where the tables disagree run and match float64 numpy (ranks choosing
  differently would run different programs: a named error or a peer timeout).
bad: process 0's file is invalid: process 0 gets the ValueError naming it, every other process
  a RuntimeError naming process 0's failure (no hang).
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from common import arg, global_array, init, mesh1d, rank_print

nvc = init()
me = jax.process_index()
case = arg("case", "agree")
d = arg("dir", ".")
mine = os.path.join(d, f"tuning_{me}.json")
W = jax.device_count()
if case == "bad" and me == 0:
    rows = [dict(world_size=W, op="all_reduce", dtype="bf16", oneshot_max_bytes=0,
                 twoshot_max_bytes=0)]
elif me == 0:
    rows = [dict(world_size=W, op="all_reduce", dtype="bfloat16", oneshot_max_bytes=1024,
                 twoshot_max_bytes=2048)]
else:
    rows = [dict(world_size=W, op="*", dtype="*", oneshot_max_bytes=1 << 20,
                 twoshot_max_bytes=8 << 20)]
    os.environ["JAX_NVCOMM_ONESHOT_MAX_BYTES"] = str(1 << 20)
with open(mine, "w") as f:
    json.dump({"format": "jax_nvcomm.tuning/1", "machine": None, "allreduce": rows}, f)
os.environ["JAX_NVCOMM_TUNING"] = mine
mesh = mesh1d()

if case == "bad":
    try:
        nvc.Communicator(mesh, "x", max_message_bytes=1 << 20)
    except (ValueError, RuntimeError) as e:
        rank_print(f"GOT {type(e).__name__}: {e}")
        raise SystemExit(0)
    raise SystemExit("expected an error")

p0 = os.path.join(d, "tuning_0.json")
with nvc.Communicator(mesh, "x", max_message_bytes=1 << 20) as c:
    assert c.tuning.source == "file" and c.tuning.path == os.path.abspath(p0), c.tuning
    assert c.tuning.overrides == (), c.tuning.overrides  # process 0 set none
    want = {256: "oneshot", 768: "twoshot", 4096: "xla"}
    for h, s in want.items():
        why = nvc.select_strategy(c, (1, h), jnp.bfloat16, explain=True)
        assert why.strategy == s and os.path.abspath(p0) in why.source, (h, why)
    rng = np.random.default_rng(7)  # the same stream in every process
    for h in want:  # process 1's own table would say "oneshot" at every one of these sizes
        f = jax.jit(jax.shard_map(lambda v: nvc.all_reduce(v, c)[None], mesh=mesh,
                                  in_specs=P("x"), out_specs=P("x")))
        host = rng.standard_normal((W, h)).astype(jnp.bfloat16)
        out = f(global_array(mesh, P("x"), host))
        ref = host.astype(np.float64).sum(0)
        for s in out.addressable_shards:
            got = np.asarray(s.data, np.float64)[0, 0]
            np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2,
                                       err_msg=f"auto all_reduce 1 x {h}")
    rank_print("PASS tuning table of process 0 in every process")
