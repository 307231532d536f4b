"""Helpers for multi-process test scripts (run through `python -m jax_nvcomm.launch`): a 1-D
mesh over every device of the job, global arrays built from the same seeded numpy data in
every process, and checks on this process's shards."""
import os
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding


def init():
    import jax_nvcomm as nvc
    nvc.distributed_initialize()
    return nvc


def mesh1d(name="x"):
    return jax.sharding.Mesh(np.array(jax.devices()), (name,))


def global_array(mesh, spec, host):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def check_shards(arr, expected, *, rtol=0.0, atol=0.0, what=""):
    """Compare every addressable shard of `arr` with the matching block of `expected`."""
    for s in arr.addressable_shards:
        got = np.asarray(s.data).astype(np.float64)
        exp = np.asarray(expected[s.index]).astype(np.float64)
        if rtol == 0 and atol == 0:
            if not np.array_equal(got, exp, equal_nan=True):
                raise AssertionError(f"{what}: shard {s.index} on {s.device} differs "
                                     f"(max abs diff {np.nanmax(np.abs(got - exp))})")
        else:
            np.testing.assert_allclose(got, exp, rtol=rtol, atol=atol,
                                       err_msg=f"{what}: shard {s.index} on {s.device}")


def rank_print(*a):
    print(f"[p{jax.process_index()}]", *a, flush=True)


def backend_name():
    return "cuda" if jax.devices()[0].platform == "gpu" else "host"


def arg(name, default):
    for a in sys.argv[1:]:
        if a.startswith(f"--{name}="):
            return type(default)(a.split("=", 1)[1])
    return type(default)(os.environ.get(f"MP_{name.upper()}", default))
