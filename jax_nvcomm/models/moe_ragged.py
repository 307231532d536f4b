"""A dropless expert-parallel MoE layer on `ragged_all_to_all`, written the way JAX MoE code
(MaxText's sparse-matmul path and the like) writes it, with one switch between XLA's
`lax.ragged_all_to_all` and `jax_nvcomm.ragged_all_to_all`. Copy this file; it uses only jax
and jax_nvcomm's public API. Runner: examples/moe_ragged.py.

Everything below runs inside `jax.shard_map` over one expert axis (EP over all devices): rank
r holds its own T tokens and experts [r*L, (r+1)*L), L = E / W. Per rank:
  1. router: softmax, top-k, weights renormalised over the k;
  2. the T*K (token, expert) pairs sorted by expert: the rows for each destination rank are
     then one contiguous chunk, inside it one group per local expert of that rank;
  3. group sizes ([E] per rank) all-gathered: every rank knows who sends whom how many rows,
     so every rank computes the four offset/size vectors of both exchanges itself;
  4. ragged_all_to_all of the sorted rows into a buffer of R = W*T*min(K, L) rows (the most
     a rank can receive: nothing is ever dropped), ordered by (source rank, local expert);
  5. a local sort by expert, three `lax.ragged_dot`s (SwiGLU) over the local experts, the
     local sort undone;
  6. ragged_all_to_all back (sizes and offsets of step 4, mirrored), the pair sort undone,
     the k rows of each token weighted and summed in float32.
`lax.ragged_all_to_all` and `nvc.ragged_all_to_all` have the same semantics and gradients,
so `jax.grad` runs through either.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_nvcomm as nvc

IMPLS = ("lax", "nvc")


# ------------------------------------------------------------------------------ parameters
def init_params(key, *, hidden, ffn, experts, dtype=jnp.float32):
    """Seeded random weights, global shapes (shard them with `param_specs`).

    Args:
      key: a jax.random key; hidden (H), ffn (F), experts (E): sizes; dtype: expert weights.

    Returns:
      dict(router float32 [H, E], w_gate [E, H, F], w_up [E, H, F], w_down [E, F, H]).
    """
    kr, kg, ku, kd = jax.random.split(key, 4)

    def normal(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) / fan_in ** 0.5).astype(dtype)
    return dict(router=normal(kr, (hidden, experts), hidden).astype(jnp.float32),
                w_gate=normal(kg, (experts, hidden, ffn), hidden),
                w_up=normal(ku, (experts, hidden, ffn), hidden),
                w_down=normal(kd, (experts, ffn, hidden), ffn))


def param_specs(axis_name):
    """PartitionSpecs of `init_params`'s dict over `axis_name`: the router replicated, the
    experts split (rank r holds experts [r*L, (r+1)*L))."""
    return dict(router=P(), w_gate=P(axis_name), w_up=P(axis_name), w_down=P(axis_name))


def capacity(tokens_per_rank, top_k, experts, world):
    """Rows of the receive buffer, W * T * min(K, L): a token sends at most min(K, L) rows
    to one rank, so no rank ever receives more (dropless). Args: T, K, E, W."""
    return world * tokens_per_rank * min(top_k, experts // world)


def comm_bytes(tokens_per_rank, top_k, experts, world, hidden, dtype):
    """The `max_message_bytes` with which this layer's exchanges run in one round (the receive
    buffer's bytes). Any Communicator serves them (a default one too: larger outputs take
    ragged_all_to_all's chunked path through the same buffers; docs/DESIGN.md "Memory" weighs
    the two). Args: T, K, E, W, H and the token dtype."""
    rows = capacity(tokens_per_rank, top_k, experts, world)
    return max(4096, rows * hidden * jnp.dtype(dtype).itemsize)


# ------------------------------------------------------------------------------ the switch
class Collectives(NamedTuple):
    """The layer's collectives over the expert axis, from one switch (`collectives`)."""
    ragged_all_to_all: Callable  # lax.ragged_all_to_all's arguments, without axis_name
    all_gather: Callable         # a -> [W, *a.shape], every rank's a (lax.all_gather)
    psum: Callable               # a -> the sum over ranks (lax.psum; training only)


def collectives(impl, *, axis_name, comm=None):
    """The one switch between XLA's collectives and jax_nvcomm's (drop-ins with the same
    semantics and gradients).

    Args:
      impl: "lax" (`lax.ragged_all_to_all`, `lax.all_gather`, `lax.psum`) or "nvc"
        (`nvc.ragged_all_to_all`, `nvc.all_gather`, `nvc.all_reduce` on `comm`'s buffers:
        no XLA collective at all, so it also runs where NCCL cannot, e.g. ranks sharing a GPU).
      axis_name: the expert axis.
      comm: a `jax_nvcomm.Communicator` over `axis_name` (impl "nvc"); with
        `max_message_bytes >= comm_bytes(...)` the exchanges run in one round, with less
        (the default 32 MiB, say) in rounds through the same buffers.

    Returns:
      A `Collectives`.

    Raises:
      ValueError: an unknown impl, or "nvc" without a communicator.
    """
    if impl == "nvc":
        if comm is None:
            raise ValueError("collectives: impl 'nvc' needs comm (a jax_nvcomm.Communicator)")
        return Collectives(lambda *args: nvc.ragged_all_to_all(*args, comm),
                           lambda a: nvc.all_gather(a, comm, tiled=False),
                           lambda a: nvc.all_reduce(a, comm))
    if impl == "lax":
        ragged = partial(lax.ragged_all_to_all, axis_name=axis_name)
        if jax.default_backend() == "cpu":
            # XLA:CPU has no ragged-all-to-all: an emulation that moves the same rows
            from jax_nvcomm.reference import ragged_all_to_all_xla
            ragged = partial(ragged_all_to_all_xla, axis_name=axis_name)
        return Collectives(ragged, partial(lax.all_gather, axis_name=axis_name),
                           partial(lax.psum, axis_name=axis_name))
    raise ValueError(f"collectives: impl must be one of {IMPLS}, got {impl!r}")


# ------------------------------------------------------------------------------ the layer
def route(x, router, top_k):
    """Softmax router, top-k, weights renormalised: (float32 [T, K], int32 [T, K]). The
    logits in full float32 (no TF32 on GPUs): near-tied top-k choices stay the same when the
    token count per rank, hence the matmul's shape, changes with the world size."""
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST)
    probs = jax.nn.softmax(logits, axis=-1)
    w, ids = lax.top_k(probs, top_k)
    return w / w.sum(-1, keepdims=True), ids.astype(jnp.int32)


def swiglu(x, w_gate, w_up, w_down, matmul):
    g = matmul(x, w_gate).astype(jnp.float32)
    u = matmul(x, w_up).astype(jnp.float32)
    return matmul((jax.nn.silu(g) * u).astype(x.dtype), w_down)


def _exclusive_cumsum(a, axis=0):
    return jnp.cumsum(a, axis=axis) - a


def _inverse(perm):
    """The inverse of a permutation (a scatter, no second sort)."""
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def moe_experts(x, topk_weights, topk_ids, w_gate, w_up, w_down, *, axis_name, coll):
    """The routed experts of one rank's tokens (steps 2-6 of the module docstring).

    Args:
      x: [T, H] this rank's tokens; topk_weights: float32 [T, K]; topk_ids: int32 [T, K]
        expert ids in [0, E), distinct within a row.
      w_gate, w_up: [L, H, F]; w_down: [L, F, H]: this rank's experts.
      axis_name: the expert axis.
      coll: the collectives (`collectives`).

    Returns:
      [T, H] in x.dtype: sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]).
    """
    T, K = topk_ids.shape
    L = w_gate.shape[0]
    W = lax.axis_size(axis_name)
    E, R = W * L, capacity(T, K, W * L, W)
    me = lax.axis_index(axis_name)

    # 2. sort the (token, expert) pairs by expert: the chunk for rank d, then its experts
    flat_ids = topk_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    x_sorted = x[order // K]                                          # [T*K, H]

    # 3. everyone's group sizes -> sizes[s, d, e]: rows rank s sends rank d for its expert e
    group_sizes = jnp.bincount(flat_ids, length=E).astype(jnp.int32)
    sizes = coll.all_gather(group_sizes).reshape(W, W, L)
    chunk = sizes.sum(-1)                                             # [source, destination]
    send_sizes, recv_sizes = chunk[me], chunk[:, me]
    input_offsets = _exclusive_cumsum(send_sizes)
    # my chunk lands on rank d after the chunks of the ranks before me
    output_offsets = _exclusive_cumsum(chunk, axis=0)[me]

    # 4. exchange: received rows ordered by (source rank, local expert)
    buf = lax.pcast(jnp.zeros((R, x.shape[1]), x.dtype), axis_name, to="varying")
    recv = coll.ragged_all_to_all(x_sorted, buf, input_offsets, send_sizes, output_offsets,
                                  recv_sizes)

    # 5. local experts: group the received rows by expert, ragged_dot, ungroup
    seg_sizes = sizes[:, me, :].reshape(-1)                           # (source, expert) groups
    seg = jnp.searchsorted(jnp.cumsum(seg_sizes), jnp.arange(R), side="right")
    local_expert = jnp.where(seg < W * L, seg % L, L)                 # L: unused rows, last
    local_order = jnp.argsort(local_expert, stable=True)
    ragged = lambda a, w: lax.ragged_dot(a, w, sizes[:, me, :].sum(0))  # noqa: E731
    y = swiglu(recv[local_order], w_gate, w_up, w_down, ragged)
    y = y[_inverse(local_order)]                                      # back to the received order

    # 6. send the results back where the rows came from, unsort, weight the k rows, sum
    back = lax.pcast(jnp.zeros((T * K, x.shape[1]), y.dtype), axis_name, to="varying")
    y = coll.ragged_all_to_all(y, back, _exclusive_cumsum(recv_sizes), recv_sizes,
                               _exclusive_cumsum(chunk, axis=1)[:, me], send_sizes)
    y = y[_inverse(order)].reshape(T, K, -1).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", y, topk_weights).astype(x.dtype)


def moe_layer(x, params, *, top_k, axis_name, coll):
    """The layer on one rank's tokens (inside shard_map over `axis_name`).

    Args:
      x: [T, H] this rank's tokens; params: this rank's part of `init_params` (`param_specs`).
      top_k: experts per token; axis_name: the expert axis; coll: `collectives(impl, ...)`.

    Returns:
      [T, H] in x.dtype.
    """
    w, ids = route(x, params["router"], top_k)
    return moe_experts(x, w, ids, params["w_gate"], params["w_up"], params["w_down"],
                       axis_name=axis_name, coll=coll)


def dense_reference(x, params, *, top_k, axis_name):
    """The same layer without any token exchange: every rank gathers every expert's weights
    and runs all E experts on its own tokens, each token's output the router-weighted sum of
    its top-k experts (zero weight for the others). A check, not a layer: E times the
    expert work. Arguments and result as `moe_layer` (lax.all_gather: XLA's collectives)."""
    w, ids = route(x, params["router"], top_k)
    gate = jnp.zeros((x.shape[0], params["router"].shape[1]), jnp.float32)
    gate = gate.at[jnp.arange(x.shape[0])[:, None], ids].set(w)       # [T, E]
    weights = [lax.all_gather(params[n], axis_name, tiled=True)
               for n in ("w_gate", "w_up", "w_down")]

    def one_expert(acc, e):
        wg, wu, wd = (a[e] for a in weights)
        return acc + gate[:, e, None] * swiglu(x, wg, wu, wd, jnp.dot).astype(jnp.float32), None
    acc = lax.pcast(jnp.zeros(x.shape, jnp.float32), axis_name, to="varying")
    y, _ = lax.scan(one_expert, acc, jnp.arange(gate.shape[1]))
    return y.astype(x.dtype)


def loss_and_grads(forward, params, x, target, *, axis_name, psum, num_tokens):
    """One rank's part of a training step (inside shard_map): the loss
    sum((forward(x, params) - target)**2) / num_tokens over every rank's tokens and its
    gradients w.r.t. the parameters and x.

    The replicated router enters as a per-rank copy, and its per-rank gradients are summed
    with `psum` (the same library as the layer's exchange); the experts' and x's gradients
    come back to their ranks through the exchanges' own transposes.

    Args:
      forward: (x, params) -> y [T, H], e.g. `partial(moe_layer, top_k=..., axis_name=...,
        coll=...)`.
      params: this rank's parameters (`param_specs`); x, target: [T, H] this rank's rows.
      axis_name: the expert axis; psum: the sum over ranks (`Collectives.psum`).
      num_tokens: tokens of all ranks (the loss is a mean over them).

    Returns:
      (loss, parameter gradients (router: invariant, like after lax.psum), x's gradient).
    """
    def local_loss(p, x):
        y = forward(x, p).astype(jnp.float32)
        return jnp.sum((y - target.astype(jnp.float32)) ** 2) / num_tokens

    own = dict(params, router=lax.pcast(params["router"], axis_name, to="varying"))
    loss, (grads, dx) = jax.value_and_grad(local_loss, argnums=(0, 1))(own, x)
    grads["router"] = psum(grads["router"])
    return psum(loss), grads, dx
