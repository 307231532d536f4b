"""A tensor-parallel MLP decoder written the way Flax NNX code writes one (google/flax
`flax/nnx/nn/linear.py`, `flax/nnx/nn/normalization.py`); plain Python classes in that style,
no flax dependency.

What it imitates:
- `Linear(in_features, out_features, use_bias, dtype, param_dtype)`: a kernel [in, out] and a
  bias, promoted to one dtype, `lax.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)),
  ((), ())))` plus the bias; the kernel carries sharding metadata (`nnx.with_partitioning`'s
  logical names, e.g. ("embed", "mlp")) that `get_partition_spec` + logical rules turn into
  the parameters' shardings.
- `RMSNorm(num_features, epsilon, dtype, param_dtype, use_scale)`: `_compute_stats` (the mean
  square in float32) and `_normalize` (`y = x - mean` with a zero mean, `mul = rsqrt(var + eps)`,
  `mul *= scale`, `y *= mul`, cast to the promoted dtype).
- Two ways the same blocks are run on a mesh:
  - `shard_map` (the Megatron form people write by hand around NNX modules): each device holds
    its column / row slices, the row-parallel `Linear`'s partial sums are `lax.psum`-ed over the
    TP axis, then the residual add and the next `RMSNorm`;
  - sharding annotations on an Auto mesh: the parameters placed by their metadata, the
    activations constrained with `with_sharding_constraint` (as `nnx.with_sharding_constraint`
    does), and XLA's partitioner inserts the all-reduce.

Left out: attention (each block is norm -> up -> gelu -> down -> residual), `nnx.Rngs`, the
graph / state split (the modules are built from a parameter tree at each trace, as
`nnx.merge` does), initializers other than normal.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

# logical names -> mesh axes (the rules a Flax user passes to nnx.logical_to_mesh)
RULES = (("batch", "data"), ("embed", None), ("mlp", "model"), ("norm", None))


@dataclasses.dataclass(frozen=True)
class Config:
    features: int = 256
    hidden: int = 1024
    layers: int = 2
    epsilon: float = 1e-6
    dtype: object = jnp.bfloat16        # activations and kernels
    param_dtype: object = jnp.float32   # norm scales


def make_mesh(devices=None, data=2, axis_type=AxisType.Auto):
    devices = np.array(jax.devices() if devices is None else devices)
    return jax.sharding.Mesh(devices.reshape(data, -1), ("data", "model"),
                             axis_types=(axis_type, axis_type))


def logical_to_mesh(names, rules=RULES):
    table = dict(rules)
    return P(*[table.get(n) if n is not None else None for n in names])


# every parameter's logical axes (nnx.with_partitioning's metadata)
METADATA = {"norm": ("norm",), "up": ("embed", "mlp"), "up_bias": ("mlp",),
            "down": ("mlp", "embed")}


def init_params(key, cfg: Config, mesh=None):
    """[{norm, up, up_bias, down} per layer] + final norm; placed by METADATA
    on `mesh` (host arrays when mesh is None)."""
    keys = iter(jax.random.split(key, 6 * cfg.layers + 2))
    d, h = cfg.features, cfg.hidden

    def normal(shape, scale, dtype):
        return (np.asarray(jax.random.normal(next(keys), shape, jnp.float32)) * scale
                ).astype(dtype)

    p = {"layers": [], "final_norm": 1 + normal((d,), 0.1, cfg.param_dtype)}
    for _ in range(cfg.layers):
        p["layers"].append({"norm": 1 + normal((d,), 0.1, cfg.param_dtype),
                            "up": normal((d, h), d ** -0.5, cfg.dtype),
                            "up_bias": normal((h,), 0.1, cfg.dtype),
                            "down": normal((h, d), h ** -0.5, cfg.dtype)})
    if mesh is not None:
        p = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), p,
                         param_specs(p))
    return p


def param_specs(params):
    """The partition specs METADATA gives (nnx.get_partition_spec)."""
    return {"final_norm": logical_to_mesh(METADATA["norm"]),
            "layers": [{k: logical_to_mesh(METADATA[k]) for k in lp} for lp in
                       params["layers"]]}


# --------------------------------------------------------------------------- modules
def _promote_dtype(*args, dtype):
    dtype = dtype or jnp.result_type(*[a for a in args if a is not None])
    return [None if a is None else jnp.asarray(a, dtype) for a in args]


class Linear:
    def __init__(self, kernel, bias=None, *, dtype=None, psum_axis=None):
        self.kernel, self.bias, self.dtype = kernel, bias, dtype
        self.psum_axis = psum_axis      # the shard_map form: the row-parallel sum

    def __call__(self, inputs):
        inputs, kernel, bias = _promote_dtype(inputs, self.kernel, self.bias, dtype=self.dtype)
        y = lax.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())))
        if self.psum_axis is not None:
            y = lax.psum(y, self.psum_axis)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


def _compute_stats(x, axes, dtype):
    dtype = jnp.promote_types(dtype or jnp.result_type(x), jnp.float32)
    x = jnp.asarray(x, dtype)
    var = jnp.mean(lax.square(x), axes)
    return jnp.zeros_like(var), var


def _normalize(x, mean, var, scale, axes, dtype, epsilon):
    stats_shape = list(x.shape)
    for a in axes:
        stats_shape[a] = 1
    mean, var = mean.reshape(stats_shape), var.reshape(stats_shape)
    y = x - mean
    mul = lax.rsqrt(var + epsilon)
    args = [x]
    if scale is not None:
        mul *= scale.reshape((1,) * (x.ndim - 1) + (-1,))
        args.append(scale)
    y *= mul
    return jnp.asarray(y, dtype or jnp.result_type(*args))


class RMSNorm:
    def __init__(self, scale, *, epsilon=1e-6, dtype=None):
        self.scale, self.epsilon, self.dtype = scale, epsilon, dtype

    def __call__(self, x):
        axes = (x.ndim - 1,)
        mean, var = _compute_stats(x, axes, self.dtype)
        return _normalize(x, mean, var, self.scale, axes, self.dtype, self.epsilon)


class Block:
    """x -> RMSNorm -> Linear up -> gelu -> Linear down -> + x."""

    def __init__(self, lp, cfg: Config, *, psum_axis=None, constrain=None):
        self.norm = RMSNorm(lp["norm"], epsilon=cfg.epsilon, dtype=cfg.dtype)
        self.up = Linear(lp["up"], lp["up_bias"], dtype=cfg.dtype)
        self.down = Linear(lp["down"], None, dtype=cfg.dtype, psum_axis=psum_axis)  # no bias
        self.constrain = constrain or (lambda v, names: v)

    def __call__(self, x):
        h = self.constrain(self.up(self.norm(x)), ("batch", None, "mlp"))
        y = self.down(jax.nn.gelu(h))
        return self.constrain(x + y, ("batch", None, "embed"))


class Model:
    def __init__(self, params, cfg: Config, *, psum_axis=None, constrain=None):
        self.blocks = [Block(lp, cfg, psum_axis=psum_axis, constrain=constrain)
                       for lp in params["layers"]]
        self.final_norm = RMSNorm(params["final_norm"], epsilon=cfg.epsilon, dtype=cfg.dtype)

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return self.final_norm(x)


def annotated_forward(cfg: Config, mesh):
    """forward(params, x [B, T, features]) on an Auto mesh: params placed by their metadata,
    activations constrained; XLA partitions."""
    def constrain(v, names):
        return lax.with_sharding_constraint(v, NamedSharding(mesh, logical_to_mesh(names)))

    def forward(params, x):
        return Model(params, cfg, constrain=constrain)(constrain(x, ("batch", None, "embed")))
    return forward


def shard_map_forward(cfg: Config, mesh):
    """forward(params, x) with every block inside one shard_map over ("data", "model"):
    column slices of `up`, row slices of `down`, the psum over "model"."""
    def body(params, x):
        return Model(params, cfg, psum_axis="model")(x)

    def forward(params, x):
        specs = param_specs(params)
        return jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data")),
                             out_specs=P("data"))(params, x)
    return forward


def dense_reference(params, x, cfg: Config):
    f = lambda a: np.asarray(jax.device_get(a)).astype(np.float64)
    p = jax.tree.map(f, params)
    x = f(x)

    def norm(v, w):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + cfg.epsilon) * w

    def gelu(v):   # jax.nn.gelu's tanh form
        return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))

    for lp in p["layers"]:
        h = gelu(norm(x, lp["norm"]) @ lp["up"] + lp["up_bias"])
        x = x + h @ lp["down"]
    return norm(x, p["final_norm"])
