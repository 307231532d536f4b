"""No silent failures: a communicator's error records that nobody read are printed on stderr,
once, at the first of: the next call of any op on it (its FFI handler, csrc/ffi/ffi_common.h
`lookup`, or the op's wrapper while tracing), its close(), the end of the process.

A failed call ends with an error (or poisoned results) in arrays that a program may never read
(`print(y.shape)` waits for nothing), and every later call fails the same way; without this a
script could fail and exit 0 without a word. Records read through `check()` or `errors()`
count as reported. The C++ registry hands each communicator's records out once
(`take_unreported`), so the handler's print and these never repeat each other."""
from __future__ import annotations

import atexit
import sys
import weakref

from . import _ffi

_open: "weakref.WeakSet" = weakref.WeakSet()  # communicators with buffers, not closed


def say(comm_id: int, text: str, when: str) -> None:
    print(f"jax_nvcomm: communicator {comm_id} failed in a call whose result was not read "
          f"(reported {when}):\n{text}\n(its later calls are refused; close() it and create a "
          "new one; check() after a result is ready raises this)", file=sys.stderr, flush=True)


def report(mod, comm_id: int, when: str) -> None:
    """Print comm_id's records unless they were handed out before."""
    if mod is None:
        return
    text = mod.take_unreported(comm_id)
    if text:
        say(comm_id, text, when)


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
    try:
        if any(not c.closed for c in list(_open)):
            _wait_for_running_programs()
        for mod in (_ffi._host, _ffi._cuda):
            if mod is not None:
                for comm_id, text in mod.take_all_unreported():
                    say(comm_id, text, "at exit")
    except Exception:  # the interpreter is going down; never turn the exit into a traceback
        pass


atexit.register(_at_exit)
