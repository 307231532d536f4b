"""The tangent of `ragged_all_to_all` as a JAX primitive: a linear map with its transpose.

Why a primitive: the op is linear in (operand, output), so its tangent is the op on the
tangents, and reverse mode needs the transpose of that (lax's rule: the exchange with the
offsets swapped, and the output's cotangent zeroed where slices landed). A `custom_vjp` gives
reverse mode but refuses forward mode on a program traced before (`jax.jvp(jax.jit(f))`);
`jax.custom_derivatives.linear_call` gives both but has no batching rule (`jax.vmap` of a
gradient). This primitive has all four rules:

- forward (`transposed=False`): (t_operand, t_output, io, ss, oo, rs) -> [the op on them];
- transposed (`transposed=True`): (ct, io, ss, oo, rs) -> [d_operand, d_output];
- jvp: linear in the first inputs, so the same primitive on the tangents;
- transpose: the other mode (the transpose of the transpose is the forward map);
- batching: jax.vmap of the Python function (the op's own vmap rule folds the batch into ONE
  kernel call);
- lowering: the Python function (`mlir.lower_fun`): the op's kernel, with its own order token.

The index arrays are never differentiated (integers). Avals: inputs and outputs of one call
vary over the same manual axes (the public op casts operand and output to the union of every
argument's axes and the communicator's before the call), so the results take their types from
the linear inputs.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax._src import ad_util, core
from jax._src.interpreters import ad, batching, mlir

from . import _order, _shard

_p = core.Primitive("nvc_ragged_all_to_all_linear")
_p.multiple_results = True


def _fun(*args, fun, comm, n_rows, transposed):
    """The map itself: `fun` (ragged's `linear_map`, in terms of the public op: the kernel path
    and its checks), ordered after the order token it is given (the last input) and returning
    the token of its last call (the last output)."""
    *args, tok = args
    _order.record(tok)  # the calls fun makes take it (as the trace's latest)
    outs = fun(*args, comm=comm, n_rows=n_rows, transposed=transposed)
    return list(outs) + [_order.token(comm.axis_name)]


def _n_lin(transposed):
    return 1 if transposed else 2


def _abstract(*avals, fun, comm, n_rows, transposed):
    tok = avals[-1]
    if not transposed:
        return [avals[1].update(weak_type=False), tok]
    ct = avals[0]
    return [ct.update(shape=(n_rows,) + tuple(ct.shape[1:]), weak_type=False),
            ct.update(weak_type=False), tok]


def _jvp(primals, tangents, **params):
    n = _n_lin(params["transposed"])
    outs = _p.bind(*primals, **params)
    zeros = [ad_util.p2tz(o) for o in outs]
    if all(type(t) is ad.Zero for t in tangents[:n]):
        return outs, zeros
    lin = [ad.instantiate_zeros(t) for t in tangents[:n]]
    tan = _p.bind(*lin, *primals[n:-1], outs[-1], **params)  # after the primal's call
    return outs, list(tan[:-1]) + zeros[-1:]


def _transpose(cts, *args, fun, comm, n_rows, transposed):
    # A linear input that is not undefined is a tangent the jvp rule instantiated as zeros
    # (say, the output of a call differentiated in operand only): it gets no cotangent. The
    # order token of the forward program is not used: the transposed call takes the backward
    # program's chain (the trace this runs in) and extends it.
    n = _n_lin(transposed)
    assert not any(ad.is_undefined_primal(a) for a in args[n:-1])  # the token may be (its
    # tangent chains tangent calls): it gets no cotangent
    undefined = [ad.is_undefined_primal(a) for a in args[:n]]
    index = args[n:-1]
    cts = [ad.instantiate_zeros(c) for c in cts[:-1]]
    tok = _order.token(comm.axis_name)
    params = dict(fun=fun, comm=comm, n_rows=n_rows, transposed=not transposed)
    *outs, tok = _p.bind(*cts, *index, tok, **params)
    _order.record(tok)
    return [o if u else None for o, u in zip(outs, undefined)] + [None] * (len(index) + 1)


def _batch(args, dims, fun, comm, n_rows, transposed):
    """jax.vmap of the map: ONE call of this primitive on the batch folded into the slices per
    peer (the op's own vmap rule: example b's rows follow example b-1's, its offsets shifted
    by b * N and b * M, slice i of example b is folded slice i * B + b), so that what vmap
    makes of it stays transposable. The map is block-diagonal over the batch, so the folded
    transposed map is the fold of the transposed maps."""
    B = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    *args, tok = args
    *dims, tok_dim = dims
    if tok_dim is not None:  # the token carries no data
        tok = jnp.take(tok, 0, axis=tok_dim)

    def lead(a, d):  # the batch as the leading dim (broadcast where a is not batched)
        if d is None:
            return jnp.broadcast_to(a, (B,) + tuple(a.shape))
        return jnp.moveaxis(a, d, 0)

    n = _n_lin(transposed)
    lin = [lead(a, d) for a, d in zip(args[:n], dims[:n])]
    io, ss, oo, rs = (lead(a, d) for a, d in zip(args[n:], dims[n:]))   # [B, K]
    N = n_rows
    M = lin[1].shape[1] if not transposed else lin[0].shape[1]
    index = _shard.fold_slices(B, N, M, io, ss, oo, rs, "ragged_all_to_all")
    flat = [a.reshape((B * a.shape[1],) + a.shape[2:]) for a in lin]
    *outs, tok = _p.bind(*flat, *index, tok, fun=fun, comm=comm, n_rows=B * N,
                         transposed=transposed)
    outs = [o.reshape((B, o.shape[0] // B) + o.shape[1:]) for o in outs]
    return outs + [tok], [0] * len(outs) + [None]


_p.def_abstract_eval(_abstract)
ad.primitive_jvps[_p] = _jvp
ad.primitive_transposes[_p] = _transpose
batching.primitive_batchers[_p] = _batch
mlir.register_lowering(_p, mlir.lower_fun(_fun, multiple_results=True))


def tangent(fun, comm, n_rows, t_operand, t_output, io, ss, oo, rs, tok):
    """The op on the tangents (t_operand, t_output) with the call's index arrays, as the
    primitive, ordered after order token tok: (result, token). fun(*args, comm, n_rows,
    transposed) -> list computes either mode (the forward on (t_operand, t_output, io, ss, oo,
    rs), the transposed on (ct, io, ss, oo, rs)); n_rows: the operand's rows (the transposed
    mode's first result)."""
    res, tok = _p.bind(t_operand, t_output, io, ss, oo, rs, tok, fun=fun, comm=comm,
                       n_rows=int(n_rows), transposed=False)
    return res, tok
