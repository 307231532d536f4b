"""nvc.jit on a program with two meshes over the same devices: a dense layer under the outer
mesh (`jax.set_mesh`, Explicit axes), then an expert-parallel shard_map over a second `Mesh`
with other axis names, run under `jax.sharding.use_abstract_mesh` (the layout of sglang-jax's
EPMoE). The re-bound shard_map enters its own mesh; its psums are served by communicators of
the inner mesh; results equal jax.jit's bitwise."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc
from jax_nvcomm.jit import pool

OURS = re.compile(r"custom_call @(nvc_\w+)")


@pytest.fixture(autouse=True)
def _closed_after():
    yield
    nvc.close_all()


def _meshes(n_expert, n_tensor):
    devs = np.array(jax.devices()[:8])
    explicit = (AxisType.Explicit, AxisType.Explicit)
    outer = jax.sharding.Mesh(devs.reshape(1, 8), ("data", "tensor"), axis_types=explicit)
    moe = jax.sharding.Mesh(devs.reshape(n_expert, n_tensor), ("expert", "tensor"),
                            axis_types=explicit)
    return outer, moe


class _ExpertLayer:
    """Experts sharded over "expert" (their hidden dim over "tensor") of a mesh of its own;
    every token goes through this device's experts, the partial sums are reduced over
    "tensor", then over "expert"."""

    def __init__(self, moe_mesh, w_in, w_out):
        self.mesh = moe_mesh
        self.w_in = jax.device_put(w_in, NamedSharding(moe_mesh, P("expert", None, "tensor")))
        self.w_out = jax.device_put(w_out, NamedSharding(moe_mesh, P("expert", "tensor", None)))

    def _local(self, h, w_in, w_out):
        y = jnp.einsum("td,edf->tf", h, w_in)
        y = jnp.einsum("tf,efd->td", jax.nn.gelu(y), w_out)
        y = jax.lax.psum(y, "tensor")
        return jax.lax.psum(y, "expert")

    def __call__(self, h):
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            h = jax.sharding.reshard(h, P())
            y = jax.shard_map(
                self._local, mesh=self.mesh,
                in_specs=(P(), P("expert", None, "tensor"), P("expert", "tensor", None)),
                out_specs=P(), check_vma=False)(h, self.w_in, self.w_out)
            return h + y  # the residual, on the layer's mesh


def _model(outer, moe, rng):
    d, f, e = 32, 16, 8
    w_dense = jax.device_put(jnp.asarray(rng.standard_normal((d, d)) * 0.2, jnp.float32),
                             NamedSharding(outer, P()))
    layer = _ExpertLayer(moe, jnp.asarray(rng.standard_normal((e, d, f)) * 0.2, jnp.float32),
                         jnp.asarray(rng.standard_normal((e, f, d)) * 0.2, jnp.float32))

    def forward(x):
        h = jnp.tanh(x @ w_dense)      # under the outer mesh
        return layer(h)                # the second mesh's shard_map

    x = jax.device_put(jnp.asarray(rng.standard_normal((16, d)), jnp.float32),
                       NamedSharding(outer, P()))
    return forward, x


@pytest.mark.parametrize("n_expert,n_tensor", [(8, 1), (4, 2)])
def test_shard_map_over_a_second_mesh_under_use_abstract_mesh(n_expert, n_tensor, rng):
    outer, moe = _meshes(n_expert, n_tensor)
    forward, x = _model(outer, moe, rng)
    with jax.set_mesh(outer):
        want = jax.jit(forward)(x)
        got = nvc.jit(forward)(x)
        text = nvc.jit(forward).lower(x).as_text()
        rows = nvc.explain(forward, x).rows
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    served = [r for r in rows if r["became"].startswith("all_reduce")]
    # the "expert" psum always; the "tensor" one where that axis spans devices (a size-1
    # axis psum is the identity: XLA's, no communicator)
    assert {r["axes"] for r in served} == ({("expert",)} if n_tensor == 1
                                          else {("expert",), ("tensor",)})
    assert OURS.findall(text).count("nvc_all_reduce") == len(served)
    meshes = {(tuple(c.mesh.axis_names), c.axis_name) for c in pool.held()}
    assert (("expert", "tensor"), "expert") in meshes
    assert all(names == ("expert", "tensor") for names, _ in meshes)  # none on the outer mesh
    if n_tensor == 1:
        (one,) = [r for r in rows if r["axes"] == ("tensor",)]
        assert one["became"] == "xla" and "size 1" in one["reason"]
