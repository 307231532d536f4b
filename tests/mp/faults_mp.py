"""One rank of a fault case of the fault matrix (scripts/faults.py starts the jobs, with or
without the launcher, and prints the table). Every rank warms up with a good call; then the
FAULTY rank (the last one: never rank 0, which hosts jax's coordination service) injects the
fault while the others make their call, and every rank still alive reports one line

  FAULTROW {"case", "rank", "faulty", "noticed" ("call" | "check" | ""), "error", "seconds",
            "silent_wrong", "next", "usable", "closed", "close_s", "recreated", ...}

and exits 0 (os._exit: jax's atexit shutdown would wait for a dead peer).
  noticed       where the faulted call's error reached this rank: its exception ("call": the
                call or its block_until_ready raised) or comm.check() right after it
  silent_wrong  the faulted call returned a result that differs from the reference and no
                error was noticed (must never be true)
  next          what the next call on the same communicator did ("refused: ..." or "ran")
  usable        a fresh jitted computation (no communicator) ran and was right afterwards
  recreated     close(), then a new Communicator over the same devices ran two correct
                all-reduces (cases where every process is still alive; else null)

Cases (--case=NAME), the faulty rank F = W - 1:
  kill           F exits (os._exit) instead of its call; one-shot all_reduce
  kill-twoshot   the same with a two-shot all_reduce
  raise          F raises an uncaught exception instead of its call
  stall          F sleeps timeout_s + 2 s, then makes its call
  ragged-stall   the same with a ragged_all_to_all whose output exceeds max_message_bytes (its
                 chunked path: rounds acknowledged between the ranks)
  sizes-oneshot  F calls all_reduce (one-shot) with twice the rows of the others
  sizes-twoshot  the same, two-shot
  order          F calls all_gather while the others call all_reduce
  expert         F's topk_ids hold expert id E (of E experts) at its token 1, slot 0
  rows           F passes num_rows = max_rows + 1 (traced) to all_gather_v
  ragged         F's ragged_all_to_all slice to rank 0 starts past its operand
  nan            no fault: NaN and +-inf inputs to all_reduce (one-shot, two-shot, fused with
                 RMSNorm) and all_gather; every result must equal the reference, NaN included
JAX_NVCOMM_TIMEOUT_S is the communicators' timeout_s (default here 3).
"""
import faulthandler
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from common import arg, global_array, init, mesh1d, rank_print

nvc = init()
CASE = arg("case", "kill")
TMO = float(os.environ.get("JAX_NVCOMM_TIMEOUT_S", "3"))
mesh = mesh1d()
W = mesh.shape["x"]
ME = jax.process_index()
F = W - 1
FAULTY = ME == F
ALIVE_AFTER = CASE not in ("kill", "kill-twoshot", "raise")  # every process still there
ROWS, COLS = 4, 256
SEED = arg("seed", 1234)
_draws = [0]


def fresh_rng():
    """A generator per op, the same on every rank for the same op number (ranks that build a
    faulty op draw other amounts; later ops must still agree)."""
    _draws[0] += 1
    return np.random.default_rng((SEED, _draws[0]))
faulthandler.dump_traceback_later(6 * TMO + 60, exit=False)  # where a rank hangs, if ever


def first_line(e):
    lines = [ln for ln in str(e).splitlines() if "jax_nvcomm" in ln] or str(e).splitlines()
    return (lines[0] if lines else type(e).__name__)[:400]


def clear_tokens():
    """Drop JAX's failed runtime tokens after an expected error (else the next effects barrier
    re-raises it)."""
    from jax._src import dispatch
    dispatch.runtime_tokens.clear()


def smap(fn, n_in=1):
    specs = P("x") if n_in == 1 else (P("x"),) * n_in
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("x")))


def mine(arr):
    """This process's block of an array sharded over 'x' (one device per process)."""
    return np.asarray(arr.addressable_shards[0].data)


def rank_sum(host, rows):
    """float32 sum over ranks in rank order (the kernels' and the host protocol's order)."""
    blocks = host.reshape(W, rows, -1)
    acc = blocks[0].copy()
    for r in range(1, W):
        acc = acc + blocks[r]
    return acc


# ---- the ops of the cases: (run(host) -> jax array, reference check(out) -> bool) ----------
def all_reduce_op(comm, strategy, rows=ROWS, host=None):
    rng = fresh_rng()
    host = rng.standard_normal((W * rows, COLS)).astype(np.float32) if host is None else host
    f = smap(lambda v: nvc.all_reduce(v, comm, strategy=strategy)[None])
    want = rank_sum(host, rows)
    return (lambda: f(global_array(mesh, P("x"), host)),
            lambda out: np.array_equal(mine(out)[0], want, equal_nan=True))


def all_gather_op(comm, rows=ROWS):
    host = fresh_rng().standard_normal((W * rows, COLS)).astype(np.float32)
    f = smap(lambda v: nvc.all_gather(v, comm)[None])
    return (lambda: f(global_array(mesh, P("x"), host)),
            lambda out: np.array_equal(mine(out)[0], host, equal_nan=True))


def rms_norm_op(comm, host, strategy):
    rng = fresh_rng()
    res = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    wgt = rng.standard_normal(COLS).astype(np.float32)
    f = smap(lambda v, r, w: nvc.all_reduce_rms_norm(v, r[0], w[0], comm,
                                                     strategy=strategy)[0][None], 3)
    r_all, w_all = np.tile(res[None], (W, 1, 1)), np.tile(wgt[None], (W, 1))
    r64 = rank_sum(host, ROWS).astype(np.float64) + res
    with np.errstate(invalid="ignore", over="ignore"):
        want = r64 / np.sqrt(np.mean(r64 ** 2, -1, keepdims=True) + 1e-6) * wgt

    def check(out):  # NaN exactly where float64 has NaN (a non-finite row), else close
        with np.errstate(invalid="ignore"):
            return np.allclose(mine(out)[0], want, rtol=1e-5, atol=1e-5, equal_nan=True)
    return (lambda: f(global_array(mesh, P("x"), host), global_array(mesh, P("x"), r_all),
                      global_array(mesh, P("x"), w_all)), check)


MOE = dict(num_experts=2 * W, top_k=2, max_tokens=4, hidden=16)


def moe_op(moe, bad=False):
    E, K, T, H = MOE["num_experts"], MOE["top_k"], MOE["max_tokens"], MOE["hidden"]
    rng = fresh_rng()
    ids = np.stack([rng.permutation(E)[:K] for _ in range(W * T)]).astype(np.int32)
    if bad:
        ids[F * T + 1, 0] = E  # rank F, its token 1, slot 0: one past the last expert
    x = rng.standard_normal((W * T, H)).astype(np.float32)
    f = smap(lambda v, i: nvc.moe_dispatch(v, i, moe).expert_counts[None], 2)
    L = E // W
    want = np.array([np.sum((ids >= ME * L + e) & (ids < ME * L + e + 1)) for e in range(L)])
    return (lambda: f(global_array(mesh, P("x"), x), global_array(mesh, P("x"), ids)),
            lambda out: np.array_equal(mine(out)[0], want))


def rows_op(comm, bad=False, max_rows=6):
    rng = fresh_rng()
    x = rng.standard_normal((W * max_rows, COLS)).astype(np.float32)
    n = rng.integers(0, max_rows + 1, W).astype(np.int32)
    if bad:
        n[F] = max_rows + 1
    f = smap(lambda v, k: nvc.all_gather_v(v, k[0], comm)[0][None], 2)
    blocks = x.reshape(W, max_rows, COLS)
    want = np.concatenate([blocks[r, :n[r]] for r in range(W)])
    return (lambda: f(global_array(mesh, P("x"), x), global_array(mesh, P("x"), n)),
            lambda out: np.array_equal(mine(out)[0][:len(want)], want))


def ragged_op(comm, bad=False, sz=3):
    """ragged_all_to_all, k = 1: rank r sends rows [d*sz, (d+1)*sz) of its operand to rank d,
    where they land at rows [r*sz, (r+1)*sz). bad: F's slice to rank 0 starts at row N."""
    rng = fresh_rng()
    n = W * sz
    x = rng.standard_normal((W * n, COLS)).astype(np.float32)
    out0 = rng.standard_normal((W * n, COLS)).astype(np.float32)
    ar = np.arange(W, dtype=np.int32)
    inp, size = np.tile(ar * sz, (W, 1)), np.full((W, W), sz, np.int32)
    outo = np.tile((ar * sz)[:, None], (1, W))  # [sender r, peer d] = r * sz
    if bad:
        inp[F, 0] = n
    f = smap(lambda v, o, a, b, c, d: nvc.ragged_all_to_all(v, o, a[0], b[0], c[0], d[0],
                                                            comm)[None], 6)
    blocks = x.reshape(W, n, COLS)
    want = np.concatenate([blocks[r, ME * sz:(ME + 1) * sz] for r in range(W)])
    args = [x, out0, inp, size, outo, size]
    return (lambda: f(*(global_array(mesh, P("x"), a) for a in args)),
            lambda out: np.array_equal(mine(out)[0], want))


def nan_inputs(rows=ROWS):
    host = fresh_rng().standard_normal((W * rows, COLS)).astype(np.float32)
    b = host.reshape(W, rows, COLS)
    b[0, 1, 1] = np.inf                      # inf - inf = NaN
    b[W - 1, 1, 1] = -np.inf
    b[W - 1, 0, 0] = np.nan                  # NaN propagates
    b[0, 2, 2] = np.inf                      # stays inf
    b[0, 3, 3] = -0.0                        # the Lamport sentinel's bits, sanitised
    return host


# ---- one attempt: the call, its result against the reference, then comm.check() ------------
def attempt(op, comms):
    run, check = op
    t0 = time.monotonic()
    res = {"noticed": "", "error": "", "seconds": None, "wrong": False}
    try:
        out = run()
        jax.block_until_ready(out)
    except Exception as e:  # noqa: BLE001 - the named error is what is recorded
        clear_tokens()
        res.update(noticed="call", error=first_line(e), seconds=time.monotonic() - t0)
        return res
    res["wrong"] = not check(out)
    try:
        for c in comms:
            c.check()
    except nvc.CommunicatorError as e:
        res.update(noticed="check", error=first_line(e), seconds=time.monotonic() - t0)
    return res


def main():
    comm = nvc.Communicator(mesh, "x", max_message_bytes=1 << 20, timeout_s=TMO)
    comms = [comm]
    moe = None
    if CASE == "expert":
        moe = nvc.MoECommunicator(mesh, "x", dtype=jnp.float32, timeout_s=TMO, **MOE)
        comms = [moe]
    strategy = "twoshot" if CASE.endswith("twoshot") else "oneshot"

    def good_op():
        if CASE == "expert":
            return moe_op(moe)
        if CASE == "rows":
            return rows_op(comm)
        if CASE == "ragged":
            return ragged_op(comm)
        if CASE == "ragged-stall":  # W x 600 rows of 1 KiB: beyond the 1 MiB frame
            return ragged_op(comm, sz=600)
        return all_reduce_op(comm, strategy)

    warm = attempt(good_op(), comms)
    if warm["noticed"] or warm["wrong"]:
        rank_print(f"warm-up call failed: {warm}")
        os._exit(4)
    rank_print("warm-up call OK")

    # the fault
    extra = []
    if FAULTY and CASE in ("kill", "kill-twoshot"):
        rank_print("fault: exiting instead of calling")
        os._exit(0)
    if FAULTY and CASE == "raise":
        rank_print("fault: raising instead of calling")
        raise RuntimeError(f"fault injected: rank {ME} raises instead of calling")
    if FAULTY and CASE in ("stall", "ragged-stall"):
        rank_print(f"fault: sleeping {TMO + 2:.0f} s before calling")
        time.sleep(TMO + 2)
    if CASE.startswith("sizes"):
        op = all_reduce_op(comm, strategy, rows=2 * ROWS if FAULTY else ROWS)
    elif CASE == "order":
        op = all_gather_op(comm) if FAULTY else all_reduce_op(comm, "auto")
    elif CASE == "expert":
        op = moe_op(moe, bad=True)
    elif CASE == "rows":
        op = rows_op(comm, bad=True)
    elif CASE == "ragged":
        op = ragged_op(comm, bad=True)
    elif CASE == "nan":
        op = all_reduce_op(comm, "oneshot", host=nan_inputs())
        for s in ("twoshot",):
            extra.append((f"all_reduce {s}", all_reduce_op(comm, s, host=nan_inputs())))
        extra.append(("all_reduce_rms_norm", rms_norm_op(comm, nan_inputs(), "oneshot")))
        extra.append(("all_reduce_rms_norm twoshot", rms_norm_op(comm, nan_inputs(), "twoshot")))
        extra.append(("all_gather", all_gather_op(comm)))
    else:
        op = good_op()
    got = attempt(op, comms)
    for name, o in extra:  # the nan case's other ops: each must be right, none an error
        r = attempt(o, comms)
        if r["noticed"] or r["wrong"]:
            got.update(noticed=got["noticed"] or r["noticed"], error=got["error"] or
                       f"{name}: {r['error']}", wrong=got["wrong"] or r["wrong"])
    row = {"case": CASE, "rank": ME, "world": W, "faulty": FAULTY, "timeout_s": TMO,
           "noticed": got["noticed"], "error": got["error"],
           "seconds": None if got["seconds"] is None else round(got["seconds"], 2),
           "wrong": got["wrong"], "silent_wrong": got["wrong"] and not got["noticed"],
           "platform": jax.devices()[0].platform}

    nxt = attempt(good_op(), comms)  # the next call on the same communicator
    row["next"] = (f"refused ({nxt['noticed']}): {nxt['error']}" if nxt["noticed"] else
                   "ran, right" if not nxt["wrong"] else "ran, WRONG")
    row["silent_wrong"] |= nxt["wrong"] and not nxt["noticed"]

    try:  # the process is still usable: a fresh jitted computation
        a = np.linspace(-3, 3, 4096, dtype=np.float32)
        v = float(jax.jit(lambda t: jnp.sum(jnp.sin(t) * t))(a))
        row["usable"] = bool(abs(v - float(np.sum(np.sin(a) * a))) < 1e-2)
    except Exception as e:  # noqa: BLE001
        row["usable"] = False
        row["usable_error"] = first_line(e)

    t0 = time.monotonic()
    try:
        for c in ([moe] if moe is not None else []) + [comm]:
            c.close()
        row["closed"] = True
    except Exception as e:  # noqa: BLE001
        row["closed"] = False
        row["close_error"] = first_line(e)
    row["close_s"] = round(time.monotonic() - t0, 2)

    row["recreated"] = None
    if ALIVE_AFTER:  # a new communicator over the same devices, every process alive
        try:
            from jax_nvcomm import _exchange
            _exchange.barrier("faults_mp/recreate", 6 * TMO + 60, "the recreate step")
            with nvc.Communicator(mesh, "x", max_message_bytes=1 << 20, timeout_s=TMO) as c2:
                ok = all(not r["noticed"] and not r["wrong"] for r in
                         (attempt(all_reduce_op(c2, s), [c2]) for s in ("oneshot", "twoshot")))
            row["recreated"] = ok
        except Exception as e:  # noqa: BLE001
            row["recreated"] = False
            row["recreate_error"] = first_line(e)
    print("FAULTROW " + json.dumps(row), flush=True)
    sys.stderr.flush()
    exit_in_order()


def exit_in_order():
    """os._exit(0), rank 0 last: it hosts jax's coordination service, and a process whose
    service goes away while it still talks to it aborts (a check failure in its agent)."""
    from jax_nvcomm import _exchange
    live = [r for r in range(W) if ALIVE_AFTER or r != F]
    try:
        if ME != 0:
            _exchange.put(f"faults_mp/exit/{ME}", b"1")
        else:
            for r in live[1:]:
                _exchange.get(f"faults_mp/exit/{r}", 6 * TMO + 60, f"rank {r}'s exit")
            time.sleep(1.0)  # the others' os._exit after their put
    except Exception as e:  # noqa: BLE001 - exiting anyway
        rank_print(f"exit handshake: {first_line(e)}")
    os._exit(0)


main()
