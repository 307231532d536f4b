"""Split-phase MoE dispatch and combine (docs/API.md, "split phases"): each of `moe_dispatch`
and `moe_combine` as a send half and a receive half, two custom calls, so that independent
work (a shared expert, another micro-batch's attention) runs while the tokens travel.

    sent = moe_dispatch_send(x, topk_ids, moe)       # this rank's rows are on their way
    ... independent compute ...
    d = moe_dispatch_recv(sent, moe)                 # = moe_dispatch(x, topk_ids, moe)
    csent = moe_combine_send(expert_y, d.handle, moe)
    ... independent compute ...
    y = moe_combine_recv(csent, topk_weights, moe)   # = moe_combine(expert_y, w, d.handle, moe)

The halves run the fused call's two kernels (csrc/kernels/moe_dispatch.cuh, moe_combine.cuh;
csrc/host/moe_host.cc), so results are bitwise the same. Protocol: csrc/common/moe_layout.h:
call s uses slot s % (2 * max_in_flight) of every rank's buffer; the send returns s as a uint32
array that its receive checks on the device.

Rules (checked while tracing where the trace shows them, `_inflight.py`, and on the device
always): at most `moe.max_in_flight` sends outstanding per communicator; receives in the order
of their sends, each once; no fused moe_dispatch / moe_combine on the communicator while a
split send is outstanding.

Where the independent work runs: the halves depend on each other only, so XLA may schedule
independent ops before the send or after the receive. `overlap(sent, *xs)` (returns `xs`) ties
work to run after the send and `moe_*_recv(..., after=ys)` makes the receive wait for `ys`;
both are `lax.optimization_barrier` data dependences, which XLA's scheduler keeps (the
order of calls on a GPU stream is the schedule's).

Gradients (`jax.grad`): the receive halves carry the differentiation rule of the fused call
(its backward pass, XLA collectives from the handle); the sends pass their differentiable
inputs along in the `sent` pytree and contribute nothing themselves.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from . import _fallback, _inflight, _order, _shard
from .moe import (Dispatched, MoEHandle, _check_combine_args, _check_dispatch_args,
                  check_one_round,
                  _combine_grads, _dispatch_cotangents, _shape, moe_call, resolve_moe, scales_in,
                  scales_of)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchSent:
    """What `moe_dispatch_send` returns and `moe_dispatch_recv` takes (arrays only)."""
    seq: jax.Array                # uint32 [1]: the call's number on this rank
    token_dest: jax.Array         # int32 [max_tokens, top_k]: handle part written by the send
    x: jax.Array                  # the send's inputs, for the gradient (the kernel does not
    x_scale: jax.Array | None     #   read them again)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CombineSent:
    """What `moe_combine_send` returns and `moe_combine_recv` takes (arrays only)."""
    seq: jax.Array                # uint32 [1]: the call's number on this rank
    expert_y: jax.Array           # the send's input (its dtype is y's; for the gradient)
    handle: MoEHandle             # of the dispatch (token_dest for the receive)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _FallbackSent:
    """XLA fallback: the arguments, for the receive to run the XLA path."""
    args: tuple
    kind: str = dataclasses.field(metadata=dict(static=True))


def _check_moe(moe, axis_name, what, **sizes):
    """The call's MoECommunicator (`resolve_moe`: `moe` or the one registered for axis_name
    that fits `sizes`), checked for the context."""
    moe = resolve_moe(moe, axis_name, what, **sizes)
    _shard.check_context(moe, what)
    return moe


def _after(tree, after):
    """`tree`, tied by an optimization barrier to be computed no earlier than `after`."""
    if after is None:
        return tree
    tree, _ = lax.optimization_barrier((tree, after))
    return tree


def overlap(sent, *xs):
    """`xs`, scheduled after the send of `sent`: compute from the returned arrays to make XLA
    place it between the send and its receive (pass its results as `after=` to the receive).

    Example:
        sent = nvc.moe_dispatch_send(x, ids, moe)
        (h,) = nvc.moe_overlap(sent, h)
        shared = shared_expert(h)
        d = nvc.moe_dispatch_recv(sent, moe, after=shared)
    """
    if not isinstance(sent, (DispatchSent, CombineSent, _FallbackSent)):
        raise TypeError("jax_nvcomm: moe_overlap: sent must be what moe_dispatch_send or "
                        f"moe_combine_send returned, got {type(sent).__name__}")
    arrays = [a for a in jax.tree.leaves(sent) if isinstance(a, jax.Array)]
    _, out = lax.optimization_barrier((arrays, xs))
    return out


# ---------------------------------------------------------------------------------------------
# dispatch

def moe_dispatch_send(x, topk_ids, moe=None, *, axis_name=None, num_tokens=None,
                      x_scale=None) -> DispatchSent:
    """Send half of `moe_dispatch`: starts moving this rank's tokens and returns at once.

    Args: as `moe_dispatch`. Returns a `DispatchSent` (arrays) for `moe_dispatch_recv`, which
    returns the `Dispatched` that `moe_dispatch` would, bitwise.

    Raises:
      TypeError / ValueError: as `moe_dispatch`; also when this send would leave more than
        moe.max_in_flight sends of `moe` outstanding in this trace (on the device: the call
        fails, naming the count; one with bounded slots), or when the communicator's bounded
        slots take the dispatch in several rounds (`moe.dispatch_rounds` > 1: the error names
        the max_buffer_bytes that would do).
    """
    what = "moe_dispatch_send"
    moe = _check_moe(moe, axis_name, what, max_tokens=_shape(x, 0), hidden=_shape(x, -1),
                     top_k=_shape(topk_ids, -1), dtype=getattr(x, "dtype", None))
    x, topk_ids = jnp.asarray(x), jnp.asarray(topk_ids)
    x_scale = None if x_scale is None else jnp.asarray(x_scale)
    _check_dispatch_args(x, topk_ids, moe, num_tokens, x_scale, what)
    if moe.xla_fallback:
        return _FallbackSent((x, topk_ids, num_tokens, x_scale), "dispatch")
    check_one_round(moe, "dispatch", what)
    _inflight.check_send(moe, what)
    axis = moe.axis_name
    T, K = moe.max_tokens, moe.top_k
    nt = jnp.asarray(T if num_tokens is None else num_tokens).astype(jnp.int32)

    def kernel(x, ids, nt, *rest):
        scale, tok = scales_of(moe, rest)
        xv = _shard.varying(x, axis)
        vma = _shard.vma_of(xv) | _shard.vma_of(ids)
        rts = (_shard.result_type(xv, (T, K), jnp.int32, vma),
               _shard.result_type(xv, (1,), jnp.uint32, vma))
        args = [_shard.varying(a, axis) for a in (xv, scale, ids, nt)]
        (td, seq), tok = _shard.ffi_call(moe, "moe_dispatch_send", rts, *args, order=tok)
        return td, seq, tok

    call = moe_call(moe, what, kernel)

    @jax.custom_vjp
    def send(x, x_scale, ids, nt, tok):
        return call(x, ids, nt, *scales_in(x_scale), tok)

    def fwd(*args):
        return send(*args), None

    def bwd(_, cts):  # the receive's rule carries the gradient to x
        return None, None, None, None, None

    send.defvjp(fwd, bwd)
    td, seq, tok = send(x, x_scale, topk_ids, nt, _order.token(axis))
    _order.record(tok)
    _inflight.record_send(moe, seq)
    return DispatchSent(seq, td, x, x_scale)


def moe_dispatch_recv(sent, moe=None, *, axis_name=None, after=None) -> Dispatched:
    """Receive half of `moe_dispatch`: waits for the peers' tokens of the send `sent`.

    Args:
      sent: what `moe_dispatch_send` returned (the oldest outstanding send of `moe`).
      moe: the `MoECommunicator` of that send.
      axis_name: in place of moe: its axis (the registered MoECommunicator that fits the
        arrays' sizes, as for `moe_dispatch`).
      after: optional pytree of arrays the receive is scheduled after (work to overlap).

    Returns:
      The `Dispatched` of `moe_dispatch` (bitwise the same).

    Raises:
      TypeError / ValueError: `sent` not from moe_dispatch_send; a receive out of send order or
        repeated, where the trace shows it (on the device: the call fails).
    """
    what = "moe_dispatch_recv"
    sx = sent.args[0] if isinstance(sent, _FallbackSent) else getattr(sent, "x", None)
    moe = _check_moe(moe, axis_name, what, max_tokens=_shape(sx, 0), hidden=_shape(sx, -1),
                     dtype=getattr(sx, "dtype", None))
    if isinstance(sent, _FallbackSent) and sent.kind == "dispatch":
        x, ids, nt, xs = sent.args
        return _fallback.moe_dispatch(_after(x, after), ids, moe, nt, xs)
    if not isinstance(sent, DispatchSent):
        raise TypeError(f"jax_nvcomm: {what}: sent must be the DispatchSent of "
                        f"moe_dispatch_send, got {type(sent).__name__}")
    check_one_round(moe, "dispatch", what)
    _inflight.check_recv(moe, sent.seq, what)
    axis = moe.axis_name
    W, T, H, S = moe.world_size, moe.max_tokens, moe.hidden, moe.scale_cols
    L, R = moe.num_local_experts, W * T
    x, x_scale = sent.x, sent.x_scale
    seq_in = _after(sent.seq, after)

    def kernel(seq, tok):
        seq = _shard.varying(seq, axis)
        vma = _shard.vma_of(seq)
        rt = lambda shape, dt: _shard.result_type(seq, shape, dt, vma)
        rts = (rt((L, R, H), moe.dtype), rt((L,), jnp.int32), rt((L, R, S), jnp.float32),
               rt((L, R), jnp.int32))
        outs, tok = _shard.ffi_call(moe, "moe_dispatch_recv", rts, seq, order=tok)
        return (*outs, tok)

    call = moe_call(moe, what, kernel)

    @jax.custom_vjp
    def recv(x, x_scale, td, seq, tok):
        return call(seq, tok)

    def fwd(x, x_scale, td, seq, tok):
        out = recv(x, x_scale, td, seq, tok)
        return out, MoEHandle(td, out[3], out[1])

    def bwd(handle, cts):
        return (*_dispatch_cotangents(cts, handle, moe, x, x_scale), None, None, None)

    recv.defvjp(fwd, bwd)
    ex, cnt, exs, es, tok = recv(x, x_scale, sent.token_dest, seq_in, _order.token(axis))
    _order.record(tok)
    return Dispatched(ex, cnt, exs if S > 0 else None, MoEHandle(sent.token_dest, es, cnt))


# ---------------------------------------------------------------------------------------------
# combine

def moe_combine_send(expert_y, handle, moe=None, *, axis_name=None) -> CombineSent:
    """Send half of `moe_combine`: starts moving the expert outputs back to their tokens.

    Args:
      expert_y: as `moe_combine`.
      handle: `d.handle` of the dispatch whose rows expert_y holds.
      moe: the `MoECommunicator` of that dispatch.
      axis_name: in place of moe: its axis (the registered MoECommunicator that fits the
        arrays' sizes, as for `moe_dispatch`).

    Returns a `CombineSent` (arrays) for `moe_combine_recv`, which returns the y of
    `moe_combine` (bitwise).

    Raises:
      TypeError / ValueError: as `moe_combine`; more than moe.max_in_flight sends outstanding
        in this trace; a combine of several rounds (`moe.combine_rounds` > 1, as
        moe_dispatch_send).
    """
    what = "moe_combine_send"
    td = getattr(handle, "token_dest", None)
    moe = _check_moe(moe, axis_name, what, max_tokens=_shape(td, 0), top_k=_shape(td, -1),
                     hidden=_shape(expert_y, -1), num_local_experts=_shape(expert_y, 0))
    if not isinstance(handle, MoEHandle):
        raise TypeError(f"jax_nvcomm: {what}: handle must be the MoEHandle of a moe_dispatch "
                        f"(d.handle), got {type(handle).__name__}")
    expert_y = jnp.asarray(expert_y)
    _check_combine_args(expert_y, None, moe, what)
    if moe.xla_fallback:
        return _FallbackSent((expert_y, handle), "combine")
    check_one_round(moe, "combine", what, expert_y.dtype)
    _inflight.check_send(moe, what)
    axis = moe.axis_name

    def kernel(ey, es, cnt, tok):
        args = [_shard.varying(a, axis) for a in (ey, es, cnt)]
        vma = frozenset().union(*[_shard.vma_of(a) for a in args])
        rt = _shard.result_type(args[0], (1,), jnp.uint32, vma)
        return _shard.ffi_call(moe, "moe_combine_send", rt, *args, order=tok)

    call = moe_call(moe, what, kernel)

    @jax.custom_vjp
    def send(ey, es, cnt, tok):
        return call(ey, es, cnt, tok)

    def fwd(*args):
        return send(*args), None

    def bwd(_, cts):  # the receive's rule carries the gradient to expert_y
        return None, None, None, None

    send.defvjp(fwd, bwd)
    seq, tok = send(expert_y, handle.expert_src, handle.expert_counts, _order.token(axis))
    _order.record(tok)
    _inflight.record_send(moe, seq)
    return CombineSent(seq, expert_y, handle)


def moe_combine_recv(csent, topk_weights, moe=None, *, axis_name=None, after=None):
    """Receive half of `moe_combine`: waits for the rows of the send `csent` and sums them.

    Args:
      csent: what `moe_combine_send` returned (the oldest outstanding send of `moe`).
      topk_weights: float32 [max_tokens, top_k].
      moe: the `MoECommunicator` of that send.
      axis_name: in place of moe: its axis (the registered MoECommunicator that fits the
        arrays' sizes, as for `moe_dispatch`).
      after: optional pytree of arrays the receive is scheduled after (work to overlap).

    Returns:
      y: as `moe_combine` (bitwise the same), in expert_y's dtype.

    Raises:
      TypeError / ValueError: as `moe_combine`; a receive out of send order or repeated.
    """
    what = "moe_combine_recv"
    ey = csent.args[0] if isinstance(csent, _FallbackSent) else getattr(csent, "expert_y", None)
    moe = _check_moe(moe, axis_name, what, max_tokens=_shape(topk_weights, 0),
                     top_k=_shape(topk_weights, -1), hidden=_shape(ey, -1),
                     num_local_experts=_shape(ey, 0))
    topk_weights = jnp.asarray(topk_weights)
    _check_combine_args(None, topk_weights, moe, what)
    if isinstance(csent, _FallbackSent) and csent.kind == "combine":
        ey, handle = csent.args
        return _fallback.moe_combine(_after(ey, after), topk_weights, handle, moe)
    if not isinstance(csent, CombineSent):
        raise TypeError(f"jax_nvcomm: {what}: csent must be the CombineSent of "
                        f"moe_combine_send, got {type(csent).__name__}")
    check_one_round(moe, "combine", what, csent.expert_y.dtype)
    _inflight.check_recv(moe, csent.seq, what)
    axis = moe.axis_name
    seq_in = _after(csent.seq, after)

    def kernel(seq, w, td, tok):
        args = [_shard.varying(a, axis) for a in (seq, w, td)]
        vma = frozenset().union(*[_shard.vma_of(a) for a in args])
        rt = _shard.result_type(args[0], (moe.max_tokens, moe.hidden), y_dtype, vma)
        return _shard.ffi_call(moe, "moe_combine_recv", rt, *args, order=tok)

    call = moe_call(moe, what, kernel)
    y_dtype = csent.expert_y.dtype

    @jax.custom_vjp
    def recv(ey, w, handle, seq, tok):
        return call(seq, w, handle.token_dest, tok)

    def fwd(ey, w, handle, seq, tok):
        return recv(ey, w, handle, seq, tok), (ey, w, handle)

    def bwd(res, cts):
        ey, w, handle = res
        d_ey, dw = _combine_grads(ey, w, handle, cts[0], moe)
        return d_ey, dw, jax.tree.map(lambda _: None, handle), None, None

    recv.defvjp(fwd, bwd)
    y, tok = recv(csent.expert_y, topk_weights, csent.handle, seq_in, _order.token(axis))
    _order.record(tok)
    return y


# ---------------------------------------------------------------------------------------------
# checking where XLA scheduled the halves

def scheduled_order(hlo_text, patterns, last=False, positions=False):
    """Positions, in the schedule of a compiled program (`jitted.lower(...).compile()
    .as_text()`, printed in execution order: `is_scheduled=true`), of the first instruction
    matching each pattern: a substring of the instruction or of the computations it calls
    (fusions, custom-call bodies, metadata such as a `jax.named_scope`), with `call`s flattened
    into the sequence; `last=True`: of the last one. A pattern not found gives no entry:
    compare the result with `sorted(...)` and check its length. `positions=True`: for each
    pattern the list of every matching position (empty when none).

    Used by the tests and `bench moe --split` to check that work tied between a send and its
    receive (`moe_overlap` / `after=`) runs there on the device's stream."""
    comps, entry, cur = {}, None, None
    for line in hlo_text.splitlines():
        s = line.strip()
        if s.endswith("{") and ("(" in s or s.startswith("ENTRY")) and "=" not in s.split("(")[0]:
            name = s.split()[1] if s.startswith("ENTRY") else s.split()[0]
            cur = comps.setdefault(name.lstrip("%"), [])
            if s.startswith("ENTRY"):
                entry = name.lstrip("%")
        elif s == "}":
            cur = None
        elif cur is not None and s:
            cur.append(s)
    if entry is None:
        return []

    def callees(ins):
        import re
        return [n.lstrip("%") for n in re.findall(r"(?:calls|to_apply|body|condition)=(%?[\w.\-]+)", ins)]

    def text(ins, depth=0):
        out = [ins]
        if depth < 8:
            for c in callees(ins):
                for sub in comps.get(c, []):
                    out.append(text(sub, depth + 1))
        return "\n".join(out)

    seq = []

    def flatten(name, depth=0):
        for ins in comps.get(name, []):
            if " call(" in ins and depth < 8:
                for c in callees(ins):
                    flatten(c, depth + 1)
            else:
                seq.append(text(ins))

    flatten(entry)
    found = []
    for p in patterns:
        hits = [i for i, t in enumerate(seq) if p in t]
        if positions:
            found.append(hits)
        elif hits:
            found.append(hits[-1] if last else hits[0])
    return found


def kernels_between(trace_path, start, end, device=0):
    """From a profiler trace (`jax.profiler.start_trace(d, create_perfetto_trace=True)`): for
    each kernel of `device` whose name contains `start` (e.g. "dispatch_send_kernel"), the
    kernels that started after it ended and before the next kernel containing `end` started
    ("dispatch_recv_kernel"), as a list of lists of names. Shows what ran between the halves."""
    from . import _trace
    X, pname = _trace._load(trace_path)
    gpu = sorted((k for k in X if pname.get(k["pid"], "").endswith(f"GPU:{device}")),
                 key=lambda k: k["ts"])
    out = []
    for i, k in enumerate(gpu):
        if start not in k["name"]:
            continue
        t_end = k["ts"] + k["dur"]
        stop = next((j for j in range(i + 1, len(gpu)) if end in gpu[j]["name"]), None)
        if stop is None:
            continue
        out.append([g["name"] for g in gpu[i + 1:stop] if g["ts"] >= t_end])
    return out
