"""Start N processes of one ``jax.distributed`` job on this machine.

Usage::

    python -m jax_nvcomm.launch -n N [--share-gpu] [--timeout SECONDS] script.py [args...]
    python -m jax_nvcomm.launch -n N [--share-gpu] [--timeout SECONDS] -m module [args...]

Each child gets ``JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT`` (a free port),
``JAX_NUM_PROCESSES=N``, ``JAX_PROCESS_ID=i`` and ``JAX_NVCOMM_LAUNCHED=1``; in
the script, ``jax_nvcomm.distributed_initialize()`` picks these up.  Every
output line of rank i is prefixed with ``[rank i] ``.  When a rank exits
non-zero, or the timeout passes, the other ranks are ended (SIGTERM to their
process groups, SIGKILL after a grace period) and the launcher exits non-zero
(the failing rank's code, 124 on timeout, 130 on Ctrl-C) with a one-line summary
on stderr.

Devices:
  * ``--share-gpu``: every rank sees GPU 0 only (``CUDA_VISIBLE_DEVICES=0``),
    with ``XLA_PYTHON_CLIENT_PREALLOCATE=false``.  Falls back to the CPU setup
    (with a note) when the machine has no GPU or ``JAX_PLATFORMS=cpu``.
  * no GPU, or ``JAX_PLATFORMS=cpu`` in the launcher's environment: each rank
    gets one CPU device (``JAX_PLATFORMS=cpu``; any
    ``--xla_force_host_platform_device_count`` is removed from ``XLA_FLAGS``),
    or K CPU devices with ``JAX_NVCOMM_CPU_DEVICES=K`` in the launcher's
    environment (set as ``JAX_NUM_CPU_DEVICES=K`` for each rank).
  * otherwise rank i gets GPU i (``CUDA_VISIBLE_DEVICES=i``, counted within the
    launcher's own ``CUDA_VISIBLE_DEVICES`` if set); N must not exceed the
    number of GPUs.

Failures: each rank runs its target through a small bootstrap so that an
uncaught exception or ``sys.exit(non-zero)`` ends that rank at once (jax's
atexit shutdown barrier would otherwise hold it until every other rank ends);
``JAX_NVCOMM_FAST_EXIT=0`` runs plain ``python -u script.py`` instead.  Ctrl-C
sends SIGINT to every rank, then SIGTERM after 1 s, then SIGKILL.

With ``--share-gpu`` XLA's own GPU collectives (``lax.psum`` over the GPU
mesh) fail: NCCL refuses two ranks on one GPU ("Duplicate GPU detected").
Cross-process CPU collectives (gloo, over ``jax.devices("cpu")``) still work
there and can serve as a reference.

Also usable as a library: ``run(n, argv, share_gpu=False, timeout=None, env=None)``.

This module imports nothing from jax (nor from the jax_nvcomm package) so that
the launcher starts fast; it also runs as a plain script
(``python path/to/launch.py -n 2 script.py``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = ["run", "main", "free_port", "gpu_list"]

GRACE_SECONDS = 3.0
TIMEOUT_EXIT_CODE = 124
INTERRUPT_EXIT_CODE = 130
_POLL_SECONDS = 0.05

_USAGE = """\
usage: python -m jax_nvcomm.launch -n N [--share-gpu] [--timeout SECONDS] script.py [args...]
       python -m jax_nvcomm.launch -n N [--share-gpu] [--timeout SECONDS] -m module [args...]

Start N processes of one jax.distributed job on this machine: rank i gets GPU i (one CPU
device each on a machine without GPUs or with JAX_PLATFORMS=cpu). In the script, call
jax_nvcomm.distributed_initialize() before touching devices. Each output line of rank i is
prefixed with "[rank i] ". When a rank fails, the others are ended and the launcher exits
with that rank's code.

options:
  -n N, --nproc N     number of processes (ranks)
  --share-gpu         every rank uses GPU 0 (CUDA_VISIBLE_DEVICES=0, no preallocation): tests
                      of several ranks on one GPU; XLA's NCCL collectives cannot run there
  --timeout SECONDS   end all ranks and exit 124 when the job runs longer
  -m MODULE           run a module (like python -m) instead of a script
  -h, --help          show this help

environment:
  JAX_NVCOMM_CPU_DEVICES=K   without GPUs: K CPU devices per rank (default 1)
  JAX_NVCOMM_FAST_EXIT=0     run plain `python -u script.py` in each rank (default: a small
                             bootstrap ends a failing rank at once instead of waiting in
                             jax's shutdown barrier for the others)
"""


# Each rank runs its script through this bootstrap (``python -u -c BOOTSTRAP
# script|module TARGET args...``).  It runs the target like ``python script.py``
# / ``python -m module`` would, but when the target ends with an exception or a
# non-zero SystemExit it prints the traceback, flushes stdio and leaves with
# os._exit.  Otherwise jax's atexit hook would run the jax.distributed shutdown
# barrier, which waits (up to 300 s by default) for every other rank to finish
# too, so the launcher would not see the failure.  JAX_NVCOMM_FAST_EXIT=0 turns
# the bootstrap off (plain ``python -u script.py``).
_BOOTSTRAP = r"""
import os, runpy, sys
_nvc_mode, _nvc_target = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[2:]
if not sys.flags.safe_path:  # as python script.py / -m would; under -P / PYTHONSAFEPATH the
    sys.path[0] = (os.path.dirname(os.path.abspath(_nvc_target))  # -c left no '' entry to
                   if _nvc_mode == "script" else os.getcwd())      # replace, and adds none
def _nvc_exit(code):
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            pass
    os._exit(code)
def _nvc_trim(tb):
    while tb is not None and (tb.tb_frame.f_code.co_filename == "<string>"
                              or tb.tb_frame.f_code.co_filename == runpy.__file__
                              or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")):
        tb = tb.tb_next
    return tb
try:
    if _nvc_mode == "script":
        runpy.run_path(_nvc_target, run_name="__main__")
    else:
        runpy.run_module(_nvc_target, run_name="__main__", alter_sys=True)
except SystemExit as e:
    if e.code is None or e.code == 0:
        raise
    if isinstance(e.code, int):
        _nvc_exit(e.code & 0xFF or 1)
    try:
        print(e.code, file=sys.stderr)
    except Exception:
        pass
    _nvc_exit(1)
except BaseException as e:
    try:
        _nvc_tb = _nvc_trim(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(_nvc_tb), _nvc_tb)
    except Exception:
        pass
    _nvc_exit(130 if isinstance(e, KeyboardInterrupt) else 1)
"""


class _LaunchError(Exception):
    pass


class _Terminated(Exception):
    """The launcher itself received SIGTERM/SIGHUP."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# --------------------------------------------------------------------------- helpers


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def gpu_list(env: dict | None = None) -> list[str]:
    """GPU ids usable as CUDA_VISIBLE_DEVICES entries (empty without an NVIDIA GPU).

    Honours ``CUDA_VISIBLE_DEVICES`` of ``env``: the entries returned are taken
    from it, so rank i's value names the i-th GPU the launcher itself sees.
    """
    env = os.environ if env is None else env
    count = 0
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            out = subprocess.run(
                [smi, "-L"], capture_output=True, text=True, timeout=15,
                env={k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"})
            if out.returncode == 0:
                count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            count = 0
    if count == 0 and os.path.exists("/dev/nvidia0"):
        try:
            count = sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name))
        except OSError:
            count = 0
    ids = [str(i) for i in range(count)]
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and count > 0:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        # Entries may be indices or UUIDs; keep the order the user gave, stop at
        # the first invalid entry (as CUDA does).
        ids = []
        for e in entries:
            if e.lstrip("-").isdigit() and (int(e) < 0 or int(e) >= count):
                break
            ids.append(e)
    return ids


def _strip_force_device_count(xla_flags: str) -> str:
    parts = [p for p in xla_flags.split()
             if not p.startswith("--xla_force_host_platform_device_count")]
    return " ".join(parts)


def _cpu_requested(env: dict) -> bool:
    platforms = env.get("JAX_PLATFORMS", env.get("JAX_PLATFORM_NAME", "")).strip().lower()
    return platforms == "cpu"


def _child_envs(n: int, share_gpu: bool, base: dict, log) -> list[dict]:
    """The environment of each rank."""
    port = free_port()
    coordinator = f"127.0.0.1:{port}"
    common = dict(base)
    common.update({
        "JAX_COORDINATOR_ADDRESS": coordinator,
        # jax reads this itself: bind the coordinator to loopback only (its
        # default is [::]:PORT, all interfaces).
        "JAX_COORDINATOR_BIND_ADDRESS": coordinator,
        "JAX_NUM_PROCESSES": str(n),
        "JAX_NVCOMM_LAUNCHED": "1",
        "PYTHONUNBUFFERED": "1",
    })
    common.pop("JAX_LOCAL_DEVICE_IDS", None)

    gpus = [] if _cpu_requested(base) else gpu_list(base)
    per_rank_gpu: list[str | None]
    if share_gpu and gpus:
        mode = "share-gpu"
        common["CUDA_VISIBLE_DEVICES"] = gpus[0]
        common["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        common["JAX_NVCOMM_SHARE_GPU"] = "1"
        per_rank_gpu = [None] * n
    elif gpus:
        if n > len(gpus):
            raise _LaunchError(
                f"-n {n} needs {n} GPUs (one per rank) but {len(gpus)} are visible; "
                "use --share-gpu to put all ranks on GPU 0")
        mode = "gpu"
        per_rank_gpu = gpus[:n]
    else:
        if share_gpu:
            why = "JAX_PLATFORMS=cpu" if _cpu_requested(base) else "no NVIDIA GPU found"
            log(f"[launch] --share-gpu: {why}; using one CPU device per rank\n")
        mode = "cpu"
        common["JAX_PLATFORMS"] = "cpu"
        common.pop("JAX_PLATFORM_NAME", None)
        common.pop("JAX_NUM_CPU_DEVICES", None)
        per = base.get("JAX_NVCOMM_CPU_DEVICES", "").strip()
        if per:  # several CPU devices per rank (jax's jax_num_cpu_devices)
            if not per.isdigit() or int(per) < 1:
                raise _LaunchError(f"JAX_NVCOMM_CPU_DEVICES must be an integer >= 1, got {per!r}")
            common["JAX_NUM_CPU_DEVICES"] = per
        if "XLA_FLAGS" in common:
            flags = _strip_force_device_count(common["XLA_FLAGS"])
            if flags:
                common["XLA_FLAGS"] = flags
            else:
                del common["XLA_FLAGS"]
        per_rank_gpu = [None] * n

    envs = []
    for i in range(n):
        e = dict(common)
        e["JAX_PROCESS_ID"] = str(i)
        e["JAX_NVCOMM_LOCAL_RANK"] = str(i)
        e["JAX_NVCOMM_DEVICE_MODE"] = mode
        if per_rank_gpu[i] is not None:
            e["CUDA_VISIBLE_DEVICES"] = per_rank_gpu[i]
        envs.append(e)
    return envs


class _Output:
    """Serialises prefixed lines from all ranks onto the launcher's streams."""

    def __init__(self, out=None):
        self._lock = threading.Lock()
        self._out = out  # one text stream for everything, or None for stdout/stderr

    def _stream(self, is_err: bool):
        if self._out is not None:
            return self._out
        return sys.stderr if is_err else sys.stdout

    def write(self, data: bytes, is_err: bool) -> None:
        with self._lock:
            stream = self._stream(is_err)
            try:
                buf = getattr(stream, "buffer", None)
                if buf is not None:
                    stream.flush()
                    buf.write(data)
                    buf.flush()
                else:
                    stream.write(data.decode("utf-8", "replace"))
                    stream.flush()
            except (OSError, ValueError):
                pass  # closed pipe: drop output, keep the job going

    def log(self, text: str) -> None:
        self.write(text.encode(), True)


def _pump(pipe, prefix: bytes, is_err: bool, output: _Output) -> None:
    try:
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            output.write(prefix + line, is_err)
    except (OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _signal_groups(procs, sig) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, sig)  # each child leads its own session/group
        except (ProcessLookupError, PermissionError):
            pass


def _end_all(procs, first_sig=signal.SIGTERM, grace: float = GRACE_SECONDS) -> None:
    """End every rank's process group: ``first_sig`` (SIGINT first gets one
    second, then SIGTERM), then SIGKILL for what is left after ``grace``."""

    def wait_alive(seconds):
        alive = [p for p in procs if p.poll() is None]
        deadline = time.monotonic() + seconds
        while alive and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
            alive = [p for p in alive if p.poll() is None]
        return alive

    # Groups of ranks that already exited may still hold stray grandchildren,
    # so every group is signalled, not only the live ranks.
    if first_sig != signal.SIGTERM:
        _signal_groups(procs, first_sig)
        # A rank blocked in a collective (C++) never runs Python's SIGINT handler.
        wait_alive(min(1.0, grace))
    _signal_groups(procs, signal.SIGTERM)
    wait_alive(grace)
    _signal_groups(procs, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass


class _no_sigint:
    """Ignore further Ctrl-C while cleaning up (main thread only)."""

    def __enter__(self):
        self._old = None
        if threading.current_thread() is threading.main_thread():
            try:
                self._old = signal.signal(signal.SIGINT, signal.SIG_IGN)
            except (ValueError, OSError):
                self._old = None
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


def _exit_code(rc: int) -> int:
    """Child return code -> launcher exit code (signals become 128+N)."""
    return 128 - rc if rc < 0 else rc


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"was killed by {name}"
    return f"exited with code {rc}"


def _ranks(ids) -> str:
    ids = list(ids)
    return ("rank " if len(ids) == 1 else "ranks ") + ", ".join(str(i) for i in ids)


# --------------------------------------------------------------------------- API


def run(n: int, argv, share_gpu: bool = False, timeout: float | None = None,
        env: dict | None = None, *, output=None, grace: float = GRACE_SECONDS) -> int:
    """Run ``argv`` as N ranks of one jax.distributed job; return the exit code.

    ``argv``: ``[script.py, args...]`` or ``["-m", module, args...]`` (run with
    this Python).  ``env``: base environment (default ``os.environ``).
    ``output``: a text stream to receive every prefixed line (default: the
    launcher's stdout/stderr).  Returns 0 when all ranks exit 0, the first
    failing rank's code (128+signal for a signal), or 124 on timeout.  A
    KeyboardInterrupt ends all ranks and is re-raised.
    """
    n = int(n)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    argv = [str(a) for a in argv]
    if not argv:
        raise ValueError("argv is empty: give a script (or -m module) to run")
    base = dict(os.environ if env is None else env)
    fast_exit = base.get("JAX_NVCOMM_FAST_EXIT", "1") != "0"
    if argv[0] == "-m":
        if len(argv) < 2:
            raise ValueError("-m needs a module name")
        if fast_exit:
            cmd = [sys.executable, "-u", "-c", _BOOTSTRAP, "module"] + argv[1:]
        else:
            cmd = [sys.executable, "-u", "-m"] + argv[1:]
    else:
        if fast_exit:
            cmd = [sys.executable, "-u", "-c", _BOOTSTRAP, "script"] + argv
        else:
            cmd = [sys.executable, "-u"] + argv

    out = _Output(output)
    try:
        envs = _child_envs(n, share_gpu, base, out.log)
    except _LaunchError as e:
        out.log(f"[launch] error: {e}\n")
        return 2

    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for i in range(n):
            p = subprocess.Popen(cmd, env=envs[i], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 start_new_session=True)
            procs.append(p)
            prefix = f"[rank {i}] ".encode()
            for pipe, is_err in ((p.stdout, False), (p.stderr, True)):
                t = threading.Thread(target=_pump, args=(pipe, prefix, is_err, out),
                                     daemon=True)
                t.start()
                pumps.append(t)

        start = time.monotonic()
        code = None
        summary = None
        while code is None:
            failed = [(i, p.returncode) for i, p in enumerate(procs)
                      if p.poll() is not None and p.returncode != 0]
            if failed:
                i, rc = failed[0]
                others = [j for j, p in enumerate(procs) if j != i and p.poll() is None]
                _end_all(procs, grace=grace)
                code = _exit_code(rc)
                summary = f"[launch] rank {i} {_describe(rc)}"
                if len(failed) > 1:
                    summary += "; also failed: " + ", ".join(
                        f"rank {j} ({_describe(c)})" for j, c in failed[1:])
                if others:
                    summary += f"; ended {_ranks(others)}"
                summary += f" (exit {code})"
                break
            if all(p.returncode == 0 for p in procs):
                code = 0
                break
            if timeout is not None and time.monotonic() - start > timeout:
                hung = [j for j, p in enumerate(procs) if p.poll() is None]
                _end_all(procs, grace=grace)
                code = TIMEOUT_EXIT_CODE
                summary = (f"[launch] timeout after {timeout:g}s: {_ranks(hung)} still "
                           f"running (hung?); ended all (exit {code})")
                break
            time.sleep(_POLL_SECONDS)
    except BaseException:
        # KeyboardInterrupt, launcher SIGTERM, or a launcher bug: never leave ranks behind.
        if procs:
            with _no_sigint():
                _end_all(procs, first_sig=signal.SIGINT, grace=grace)
        for t in pumps:
            t.join(timeout=1.0)
        raise

    for t in pumps:
        t.join(timeout=2.0)
    if summary:
        out.log(summary + "\n")
    return code


def _parse(args: list[str]):
    n = None
    share_gpu = False
    timeout = None
    i = 0

    def value(opt):
        nonlocal i
        if i + 1 >= len(args):
            raise _LaunchError(f"{opt} needs a value")
        i += 1
        return args[i]

    while i < len(args):
        a = args[i]
        if a in ("-h", "--help"):
            return None
        if a in ("-n", "--nproc", "--nprocs", "--num-processes"):
            n = value(a)
        elif a.startswith("--nproc=") or a.startswith("--num-processes="):
            n = a.split("=", 1)[1]
        elif a.startswith("-n") and a[2:].isdigit():
            n = a[2:]
        elif a == "--share-gpu":
            share_gpu = True
        elif a == "--timeout":
            timeout = value(a)
        elif a.startswith("--timeout="):
            timeout = a.split("=", 1)[1]
        elif a == "-m":
            if i + 1 >= len(args):
                raise _LaunchError("-m needs a module name")
            prog = ["-m"] + args[i + 1:]
            break
        elif a.startswith("-m") and len(a) > 2:
            prog = ["-m", a[2:]] + args[i + 1:]
            break
        elif a == "--":
            prog = args[i + 1:]
            break
        elif a.startswith("-"):
            raise _LaunchError(f"unknown option {a!r}")
        else:
            prog = args[i:]
            break
        i += 1
    else:
        prog = []
    if n is None:
        raise _LaunchError("-n N is required")
    try:
        n = int(n)
    except ValueError:
        raise _LaunchError(f"-n expects an integer, got {n!r}") from None
    if n < 1:
        raise _LaunchError(f"-n must be >= 1, got {n}")
    if timeout is not None:
        try:
            timeout = float(timeout)
        except ValueError:
            raise _LaunchError(f"--timeout expects seconds, got {timeout!r}") from None
        if timeout <= 0:
            raise _LaunchError(f"--timeout must be > 0, got {timeout:g}")
    if not prog:
        raise _LaunchError("no script (or -m module) given")
    return n, share_gpu, timeout, prog


def main(args: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else list(args)
    try:
        parsed = _parse(args)
    except _LaunchError as e:
        sys.stderr.write(_USAGE + f"error: {e}\n")
        return 2
    if parsed is None:
        sys.stdout.write(_USAGE)
        return 0
    n, share_gpu, timeout, prog = parsed

    def on_signal(signum, frame):
        raise _Terminated(signum)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, on_signal)
        except (ValueError, OSError):
            pass
    try:
        return run(n, prog, share_gpu=share_gpu, timeout=timeout)
    except KeyboardInterrupt:
        sys.stderr.write("[launch] interrupted; ended all ranks (exit 130)\n")
        return INTERRUPT_EXIT_CODE
    except _Terminated as t:
        sys.stderr.write(f"[launch] got {signal.Signals(t.signum).name}; ended all ranks\n")
        return 128 + t.signum
    finally:
        for sig, h in old.items():
            try:
                signal.signal(sig, h)
            except (ValueError, OSError):
                pass


if __name__ == "__main__":
    sys.exit(main())
