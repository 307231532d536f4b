"""Trace-time count of split MoE sends (moe_*_send) not yet received, per communicator.

Why: a MoE communicator has buffers for `max_in_flight` outstanding sends (csrc/common/
moe_layout.h); receives must come in the order of their sends, once each; a fused call
(moe_dispatch / moe_combine) needs no split send outstanding. The device checks all of this
(kErrInFlight / kErrOrder, the communicator is dead afterwards); here the same rules are checked
while tracing, where the program shows them, so the mistake is a Python exception naming the
call instead of a device error.

Scope, as for `_order`: the sends and receives traced in one trace (a jit/shard_map body, one
loop or branch body). A receive of a send traced elsewhere (another jit, an enclosing trace) is
not known here and is left to the device check; so is a send whose receive is traced elsewhere.
"""
from __future__ import annotations

import collections
import weakref

from . import _order

# id(trace) -> (weak reference to the trace, {comm_id: _Calls})
_state: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()
_MAX_TRACES = 64


class _Calls:
    """A communicator's split calls in one trace: the seq results of the sends not yet received
    (oldest first) and of the last ones received."""
    __slots__ = ("pending", "received")

    def __init__(self):
        self.pending, self.received = [], collections.deque(maxlen=64)


def _calls(comm, create):
    trace = _order._current_trace()
    if trace is None:
        return None
    entry = _state.get(id(trace))
    if entry is None or entry[0]() is not trace:
        if not create:
            return None
        try:
            entry = (weakref.ref(trace), {})
        except TypeError:
            return None
        _state[id(trace)] = entry
        _state.move_to_end(id(trace))
        while len(_state) > _MAX_TRACES:
            _state.popitem(last=False)
    calls = entry[1].get(comm.comm_id)
    if calls is None and create:
        calls = entry[1][comm.comm_id] = _Calls()
    return calls


def check_send(comm, what):
    """Raise when a send now would leave more than comm.split_in_flight sends outstanding
    (max_in_flight; 1 where the communicator's slots are bounded)."""
    calls = _calls(comm, create=False)
    pending = [] if calls is None else calls.pending
    limit = comm.split_in_flight
    if len(pending) >= limit:
        bounded = (f" (its buffer is bounded by max_buffer_bytes={comm.max_buffer_bytes}: one "
                   f"send at a time)" if limit != comm.max_in_flight else "")
        raise ValueError(
            f"jax_nvcomm: {what}: {len(pending)} split sends of this communicator are already "
            f"outstanding (sent, not yet received) and max_in_flight={limit}{bounded}: "
            f"receive one (moe_dispatch_recv / moe_combine_recv) first, or make the "
            f"MoECommunicator with a larger max_in_flight")


def record_send(comm, seq):
    """Count the send whose `seq` result was just traced."""
    calls = _calls(comm, create=True)
    if calls is not None and _order._is_tracer_of(seq, _order._current_trace()):
        calls.pending.append(seq)


def check_recv(comm, seq, what):
    """A receive of the send that returned `seq`: must be the oldest outstanding one."""
    calls = _calls(comm, create=False)
    if calls is None:
        return
    if any(s is seq for s in calls.received):
        raise ValueError(f"jax_nvcomm: {what}: this send was received already; each send is "
                         "received once")
    pending = calls.pending
    pos = next((i for i, s in enumerate(pending) if s is seq), None)
    if pos is None:  # a send of another trace: the device checks
        return
    if pos != 0:
        raise ValueError(
            f"jax_nvcomm: {what}: receives must come in the order of their sends: this is the "
            f"receive of outstanding send #{pos + 1} of {len(pending)} (oldest first); receive "
            f"the older ones first")
    calls.received.append(pending.pop(0))


def check_fused(comm, what):
    """A fused call (send + receive at once) while split sends are outstanding is refused."""
    calls = _calls(comm, create=False)
    if calls is not None and calls.pending:
        raise ValueError(
            f"jax_nvcomm: {what}: {len(calls.pending)} split sends of this communicator are "
            f"outstanding; receive them (moe_dispatch_recv / moe_combine_recv) before a fused "
            f"moe_dispatch / moe_combine on it")
