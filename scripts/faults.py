"""The fault matrix: inject each fault into a fresh multi-process job and print a table.

usage: python scripts/faults.py [--platform cpu|gpu|gpus] [-n N [N ...]] [--cases C [C ...]]
                                [--timeout S] [--start direct|launcher] [--json FILE]
                                [--table FILE]

Every row is one job of N processes running tests/mp/faults_mp.py --case=C (that file lists
the cases and what each rank reports); the faulty rank is the last one. --start direct (the
default) starts the ranks itself, with the jax.distributed variables set, as a user's job
script would and as the launcher does not: no rank is ended because another one failed.
--start launcher runs them through `python -m jax_nvcomm.launch` (--share-gpu on GPUs); the
launcher ends a job when a rank exits non-zero, so the `raise` case is skipped there.
--platform cpu: one CPU device per process (the host backend); gpu: every process on GPU 0
(CUDA_VISIBLE_DEVICES=0, no preallocation): the CUDA kernels, time-sliced on one GPU; gpus:
process r on GPU r (N GPUs).

Columns: the fault; which ranks noticed it and where ("call": the call or its
block_until_ready raised; "check": comm.check() after it); the first error text; the slowest
noticing rank's seconds from its call; whether every reporting rank ran a fresh jitted
computation afterwards and returned nothing wrong silently; the next call on the failed
communicator; close() and a new communicator (where every process is still alive); PASS/FAIL.
A row passes when every rank that must notice did, within timeout + 5 s, naming the faulty
rank where the case says so, every live rank reported, exited 0, stayed usable, returned
nothing wrong silently, closed, and (live jobs) ran a new communicator. Exit status 0 when
every row passes.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mp", "faults_mp.py")
CASES = ["kill", "kill-twoshot", "raise", "stall", "ragged-stall", "sizes-oneshot",
         "sizes-twoshot", "order", "expert", "rows", "ragged", "nan"]
# Not the repository root: `python -m` there would import the source folder of jax_nvcomm, not
# the installed package.
CWD = os.path.join(ROOT, "tests")
LIVE = {"stall", "ragged-stall", "sizes-oneshot", "sizes-twoshot", "order", "expert", "rows", "ragged", "nan"}


def expectation(case: str, w: int):
    """(ranks that must notice, a pattern each one's error must match) of a case."""
    f = w - 1
    if case in ("kill", "kill-twoshot", "raise", "stall", "ragged-stall"):
        return list(range(f)), rf"timed out waiting for rank {f}\b"
    if case == "nan":
        return [], None
    if case == "expert":
        # the record's text (CUDA) or the host protocol's own (CPU), or a peer's
        e = 2 * w
        return list(range(w)), rf"(\] = {e}, outside|rank {f} failed this call)"
    if case == "rows":
        return list(range(w)), rf"(row count|rank {f} failed this call)"
    if case == "ragged":
        return list(range(w)), rf"(lies outside operand/output|rank {f} failed this call)"
    # sizes / order: every rank, with a named disagreement (or, where the protocols differ,
    # a timeout naming a peer)
    return list(range(w)), r"(disagree|out of step|received a|timed out waiting for rank)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(platform: str, timeout: float) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(ROOT, "tests", "mp"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env["JAX_NVCOMM_TIMEOUT_S"] = str(timeout)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = flags.strip()
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.pop("JAX_PLATFORMS", None)
        env["CUDA_VISIBLE_DEVICES"] = "0"  # gpus: rank r's own, set per rank
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def run_direct(case, n, platform, timeout, limit):
    """Start n ranks directly; return ({rank: output}, {rank: exit code or None if killed})."""
    env = base_env(platform, timeout)
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES=str(n))
    procs, files = [], []
    for r in range(n):
        f = tempfile.TemporaryFile(mode="w+")
        files.append(f)
        procs.append(subprocess.Popen(
            [sys.executable, "-u", WORKER, f"--case={case}"],
            env=dict(env, JAX_PROCESS_ID=str(r),
                     **({"CUDA_VISIBLE_DEVICES": str(r)} if platform == "gpus" else {})),
            stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=CWD))
    deadline = time.monotonic() + limit
    # The ranks that report: all but a killed / raising faulty rank. When they are done, a
    # faulty rank still inside jax's shutdown (after its exception) is ended.
    reporters = range(n - 1) if case in ("kill", "kill-twoshot", "raise") else range(n)
    while time.monotonic() < deadline and any(procs[r].poll() is None for r in reporters):
        time.sleep(0.1)
    if case in ("kill", "kill-twoshot", "raise"):
        grace = time.monotonic() + 10
        while time.monotonic() < grace and procs[n - 1].poll() is None:
            time.sleep(0.1)
    codes = {}
    for r, p in enumerate(procs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            codes[r] = None
        else:
            codes[r] = p.returncode
    outs = {}
    for r, f in enumerate(files):
        f.seek(0)
        outs[r] = f.read()
        f.close()
    return outs, codes


def run_launcher(case, n, platform, timeout, limit):
    env = base_env(platform, timeout)
    if platform != "cpu":
        env.pop("CUDA_VISIBLE_DEVICES", None)  # the launcher sets it
    cmd = [sys.executable, "-m", "jax_nvcomm.launch", "-n", str(n), "--timeout", str(int(limit))]
    if platform == "gpu":
        cmd.append("--share-gpu")
    p = subprocess.run(cmd + [WORKER, f"--case={case}"], env=env, capture_output=True, text=True,
                       timeout=limit + 60, cwd=CWD)
    outs = {r: "" for r in range(n)}
    for line in (p.stdout + p.stderr).splitlines():
        m = re.match(r"\[rank (\d+)\] ?(.*)", line)
        if m:
            outs[int(m.group(1))] += m.group(2) + "\n"
    # the launcher reports one exit status for the job
    return outs, {r: p.returncode for r in range(n)}


def judge(case, n, timeout, outs, codes):
    """One table row (dict) from the ranks' outputs."""
    must, pattern = expectation(case, n)
    reports = {}
    for r, text in outs.items():
        for line in text.splitlines():
            if line.startswith("FAULTROW "):
                reports[r] = json.loads(line[len("FAULTROW "):])
    problems = []
    dead = {n - 1} if case in ("kill", "kill-twoshot", "raise") else set()
    for r in range(n):
        if r in dead:
            continue
        if r not in reports:
            problems.append(f"rank {r} did not report (exit {codes.get(r)})")
            continue
        if codes.get(r) != 0:
            problems.append(f"rank {r} exited {codes.get(r)}")
        rep = reports[r]
        if rep["silent_wrong"]:
            problems.append(f"rank {r} returned a wrong result silently")
        if not rep.get("usable"):
            problems.append(f"rank {r} not usable afterwards: {rep.get('usable_error', '')}")
        if not rep.get("closed"):
            problems.append(f"rank {r} close() failed: {rep.get('close_error', '')}")
        if case in LIVE and rep.get("recreated") is not True:
            problems.append(f"rank {r}: new communicator failed: {rep.get('recreate_error', '')}")
        if r in must:
            if not rep["noticed"]:
                problems.append(f"rank {r} noticed nothing")
            elif pattern and not re.search(pattern, rep["error"]):
                problems.append(f"rank {r}: unexpected error text")
            elif rep["seconds"] is not None and rep["seconds"] > timeout + 5:
                problems.append(f"rank {r} noticed after {rep['seconds']} s")
        elif case == "nan" and rep["noticed"]:
            problems.append(f"rank {r} got an error for finite-or-NaN inputs")
    noticed = [f"r{r}:{rep['noticed']}" for r, rep in sorted(reports.items()) if rep["noticed"]]
    first = next((rep["error"] for r, rep in sorted(reports.items()) if rep["error"]), "")
    secs = [rep["seconds"] for rep in reports.values() if rep["seconds"] is not None]
    live = [rep for rep in reports.values()]
    return {
        "case": case, "n": n, "noticed": " ".join(noticed) or "-",
        "error": first, "seconds": max(secs) if secs else None,
        "usable": all(rep.get("usable") for rep in live) and bool(live),
        "silent": any(rep["silent_wrong"] for rep in live),
        "next": "refused" if live and all(rep["next"].startswith("refused") for rep in live
                                          if rep["noticed"]) and any(rep["noticed"] for rep in live)
                else ("ran" if live else "-"),
        "close_s": max((rep.get("close_s", 0) for rep in live), default=None),
        "recreated": (all(rep.get("recreated") for rep in live) if case in LIVE else None),
        "result": "PASS" if not problems else "FAIL", "problems": problems,
        "reports": reports,
    }


def fmt(row, setup):
    s = "-" if row["seconds"] is None else f"{row['seconds']:.1f}"
    rec = {None: "-", True: "yes", False: "NO"}[row["recreated"]]
    err = row["error"].replace("jax_nvcomm: ", "")
    return (f"| {setup} | {row['case']} | {row['noticed']} | {err[:110]} | {s} | "
            f"{'yes' if row['usable'] else 'NO'} | {'YES' if row['silent'] else 'no'} | "
            f"{row['next']} | {rec} | {row['result']} |")


HEADER = ("| setup | fault | noticed by (where) | error (first) | s | usable after | "
          "silent wrong | next call | new comm | result |\n|" + "---|" * 10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--platform", choices=["cpu", "gpu", "gpus"], default="cpu")
    ap.add_argument("-n", type=int, nargs="+", default=[2], help="processes per job (2 4)")
    ap.add_argument("--cases", nargs="+", default=CASES, choices=CASES, metavar="CASE",
                    help="default: all (" + " ".join(CASES) + ")")
    ap.add_argument("--timeout", type=float, default=3.0,
                    help="the communicators' timeout_s (JAX_NVCOMM_TIMEOUT_S); default 3")
    ap.add_argument("--start", choices=["direct", "launcher"], default="direct")
    ap.add_argument("--json", help="write every row (with each rank's report) to this file")
    ap.add_argument("--table", help="append the table's rows (markdown) to this file")
    a = ap.parse_args(argv)
    rows = []
    table = open(a.table, "a") if a.table else None
    if table is not None and table.tell() == 0:
        table.write(HEADER + "\n")

    def say(line):
        print(line, flush=True)
        if table is not None:
            table.write(line + "\n")
            table.flush()
    print(HEADER, flush=True)
    for n in a.n:
        for case in a.cases:
            setup = f"{a.platform} {n}p {a.start}"
            if a.start == "launcher" and case == "raise":
                say(f"| {setup} | raise | - | skipped: the launcher ends the job when a rank "
                    "fails | - | - | - | - | - | - |")
                continue
            limit = 8 * a.timeout + 120
            t0 = time.monotonic()
            run = run_direct if a.start == "direct" else run_launcher
            outs, codes = run(case, n, a.platform, a.timeout, limit)
            row = judge(case, n, a.timeout, outs, codes)
            row.update(setup=setup, wall_s=round(time.monotonic() - t0, 1))
            rows.append(row)
            say(fmt(row, setup))
            for p in row["problems"]:
                print(f"    {p}", flush=True)
            if row["result"] != "PASS":
                for r, text in outs.items():
                    tail = "\n".join(text.splitlines()[-12:])
                    print(f"    --- rank {r} (exit {codes.get(r)}), last lines:\n{tail}",
                          flush=True)
    bad = [r for r in rows if r["result"] != "PASS"]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} rows PASS", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
