"""No silent failures: a communicator's error records that nobody read are printed on stderr,
once, at the first of: the next call of any op on it (its FFI handler, csrc/ffi/ffi_common.h
`lookup`, or the op's wrapper while tracing), its close(), the end of the process.

A failed call ends with an error (or poisoned results) in arrays that a program may never read
(`print(y.shape)` waits for nothing), and every later call fails the same way; without this a
script could fail and exit 0 without a word. Records read through `check()` or `errors()`
count as reported. The C++ registry hands each communicator's records out once
(`take_unreported`), so the handler's print and these never repeat each other.

A failed call's error that reaches the user as an exception (XLA's `JaxRuntimeError`, raised
where a result is read) is read too: `watch()` installs a `sys.monitoring` RAISE hook that, for
such an exception of ours, marks the communicator's records as reported and puts every rank's
record on the exception (`e.records`, the root cause's first). The message itself comes from
the handler, which puts the root cause first (csrc/common/module_common.cc summarize_failure).

JAX_NVCOMM_STRICT=1: a process that reported an unread failure (at a call, close() or exit)
ends with status 1 (os._exit at exit; exit handlers registered before the package's do not
run)."""
from __future__ import annotations

import atexit
import os
import re
import sys
import time
import weakref

from . import _ffi

_open: "weakref.WeakSet" = weakref.WeakSet()  # communicators with buffers, not closed


_ours = re.compile(r"communicator (\d+); each rank's record")
_tool_id = None      # the sys.monitoring tool id of watch(), once installed
_quiet = False       # True while the exit hook itself reads results: those raises are not seen
_jax_error = None    # jax.errors.JaxRuntimeError


def _failures(comm_id: int):
    """(comm_id's failures in this process, one per failed group: (summary text, records with
    the root cause's first, the other failed ranks, the root's rank, the group's ranks here),
    the module that holds them), or None when no module knows a failure of comm_id."""
    for mod in (_ffi._host, _ffi._cuda):
        if mod is not None:
            summaries = mod.failures(comm_id)
            if summaries:
                return summaries, mod
    return None


def _root_first(comm_id: int, text: str) -> str:
    """comm_id's records as `take_unreported` gave them (by slot), the root cause's first."""
    found = _failures(comm_id)
    return text if found is None else "\n".join(r for _, recs, *_ in found[0] for r in recs)


def _seen(exc) -> None:
    """An exception is being raised: if it is a failure of ours, the user is shown it."""
    if _quiet or type(exc) is not _jax_error or getattr(exc, "records", None) is not None:
        return
    m = _ours.search(str(exc))
    if m is None:
        return
    comm_id = int(m.group(1))
    found = _failures(comm_id)
    if found is None:
        return
    summaries, mod = found
    # XLA may raise the first rank's error while other ranks still end the call (its handler
    # waited for them, up to 1 s): a last short wait so that `records` holds all of them
    deadline = time.monotonic() + 0.1
    while any(len(f[2]) + 1 < f[4] for f in summaries) and time.monotonic() < deadline:
        time.sleep(0.01)
        summaries = _failures(comm_id)[0]
    mod.take_unreported(comm_id)  # handed to the user: not printed again
    exc.records = [r for _, recs, *_ in summaries for r in recs]


def _on_raise(code, offset, exc):
    try:
        _seen(exc)
    except Exception:  # never turn a user's exception into ours
        pass


def watch() -> None:
    """Install the RAISE hook (once; at the first communicator with buffers)."""
    global _tool_id, _jax_error
    if _tool_id is not None or not hasattr(sys, "monitoring"):
        return
    import jax
    _jax_error = jax.errors.JaxRuntimeError
    mon = sys.monitoring
    for tool in (4, 3):
        if mon.get_tool(tool) is None:
            mon.use_tool_id(tool, "jax_nvcomm")
            mon.register_callback(tool, mon.events.RAISE, _on_raise)
            mon.set_events(tool, mon.events.RAISE)
            _tool_id = tool
            return


def strict() -> bool:
    """JAX_NVCOMM_STRICT=1: an unread failure at exit ends the process with status 1."""
    return os.environ.get("JAX_NVCOMM_STRICT", "0").strip().lower() in ("1", "true", "yes", "on")


_said = False        # an unread failure was printed here (JAX_NVCOMM_STRICT)


def say(comm_id: int, text: str, when: str) -> None:
    global _said
    _said = True
    print(f"jax_nvcomm: communicator {comm_id} failed in a call whose result was not read "
          f"(reported {when}):\n{text}\n(its later calls are refused; close() it and create a "
          "new one; check() after a result is ready raises this)", file=sys.stderr, flush=True)


def report(mod, comm_id: int, when: str) -> None:
    """Print comm_id's records unless they were handed out before."""
    if mod is None:
        return
    text = mod.take_unreported(comm_id)
    if text:
        say(comm_id, _root_first(comm_id, text), when)


def _wait_for_running_programs() -> None:
    """Let the programs still running finish (a failure is recorded when its call ends): wait
    for every live array. Only in a single-process job: every wait of our kernels is bounded by
    the communicator's timeout_s, but an XLA collective of a multi-process job may wait for a
    process that died, and threads (a bound of its own) cannot be started at exit."""
    import jax
    if jax.process_count() != 1:
        return
    for a in jax.live_arrays():
        try:
            a.block_until_ready()
        except Exception:  # a failed call's result, a deleted buffer: nothing to wait for
            pass


def _at_exit() -> None:
    global _quiet
    try:
        _quiet = True
        if any(not c.closed for c in list(_open)):
            _wait_for_running_programs()
        for mod in (_ffi._host, _ffi._cuda):
            if mod is not None:
                for comm_id, text in mod.take_all_unreported():
                    say(comm_id, _root_first(comm_id, text), "at exit")
    except Exception:  # the interpreter is going down; never turn the exit into a traceback
        pass
    printed = _said or any(m is not None and m.printed_unread() for m in (_ffi._host, _ffi._cuda))
    if printed and strict():
        print("jax_nvcomm: JAX_NVCOMM_STRICT=1: exiting with status 1 (a call failed and "
              "nobody read its error)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


atexit.register(_at_exit)
