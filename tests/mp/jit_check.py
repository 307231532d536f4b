"""nvc.jit on the unchanged model code of tests/: the JetStream-style TP decoder
(tests/tp_decoder.py) and the MaxText-style MoE layer (jax_nvcomm/models/moe_ragged.py on lax's
collectives), one process or several of a `jax_nvcomm.launch` job (one device each):

  - agreement: nvc.jit vs jax.jit (one device: XLA runs there) vs the same program written with
    hand calls (jax_nvcomm's ops called by hand, under jax.jit) vs a dense reference on one
    device;
  - our custom calls in the compiled program (count), XLA collectives left (count);
  - loop-level time: a jitted loop of `--steps` forward passes, ms per pass, for nvc.jit, the
    hand-written program and (one process only: NCCL refuses ranks sharing a GPU) jax.jit.

    python tests/mp/jit_check.py                 # 8 CPU devices without a GPU (small sizes)
    python -m jax_nvcomm.launch -n 2 --share-gpu tests/mp/jit_check.py
"""
import os
import re
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if not os.environ.get("JAX_COORDINATOR_ADDRESS") and os.system("nvidia-smi -L >/dev/null 2>&1"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

from common import global_array, init  # noqa: E402

nvc = init()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import tp_decoder as tpd  # noqa: E402
from jax_nvcomm.models import moe_ragged as mr  # noqa: E402

GPU = jax.devices()[0].platform == "gpu"
ME = jax.process_index()
SOLO = jax.process_count() == 1
W = len(jax.devices())
STEPS = 10


def say(*a):
    if ME == 0:
        print(*a, flush=True)


def counts(text):
    ours = re.findall(r"custom_call_target=\"(nvc_\w+)\"", text)
    xla = re.findall(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|"
                     r"collective-permute)(?:-start)?\(", text)
    return len(ours), len(xla)


REPS = int(os.environ.get("JIT_CHECK_REPS", "7"))
TRACE_DIR = os.environ.get("JIT_CHECK_TRACE")  # a profiler trace per program, process 0


def traced(tag, rows, *args):
    """With JIT_CHECK_TRACE set: a profiler trace of 3 calls of each program (device time per
    kernel: ../shared/tools/trace_summary.py DIR/<tag>_<name>)."""
    if not TRACE_DIR or ME != 0:
        return
    for name, f in rows:
        jax.block_until_ready(f(*args))
        jax.profiler.start_trace(os.path.join(TRACE_DIR, f"{tag}_{name.replace('.', '_')}"),
                                 create_perfetto_trace=True)
        for _ in range(3):
            jax.block_until_ready(f(*args))
        jax.profiler.stop_trace()


def measured(tag, rows, *args):
    """timed() of the rows, with JIT_CHECK_HLO each compiled program written to
    /tmp/jit_check_<tag>_<name>.hlo and with JIT_CHECK_TRACE a profiler trace of each."""
    if os.environ.get("JIT_CHECK_HLO"):
        for name, f in rows:
            with open(f"/tmp/jit_check_{tag}_{name}.hlo", "w") as fh:
                fh.write(f.lower(*args).compile().as_text())
    times = timed(rows, *args)
    traced(tag, rows, *args)
    return times


def timed(rows, *args, reps=None):
    """{name: ms per pass} of the looped programs, measured in turns (one call of each per
    round, the median over rounds), so that drift on the machine hits them alike."""
    for _, f in rows:
        jax.block_until_ready(f(*args))
        jax.block_until_ready(f(*args))
    ts = {name: [] for name, _ in rows}
    for i in range(reps or REPS):
        for name, f in rows[i % len(rows):] + rows[:i % len(rows)]:  # each row first in turn
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) * 1e3 / STEPS for name, v in ts.items()}


def local(a):
    """This process's copy of a replicated array, as float64."""
    return np.asarray(a.addressable_shards[0].data, np.float64)


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def looped(fwd):
    """STEPS passes of fwd in one program (the output feeds the next pass)."""
    return lambda params, x: lax.fori_loop(0, STEPS, lambda i, h: fwd(params, h), x)


# --------------------------------------------------------------------------- the TP decoder
def decoder():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))
    cfg = (tpd.Config(hidden=2048, heads=16, head_dim=128, ffn=4096, layers=2) if GPU
           else tpd.Config(hidden=256, heads=8, head_dim=32, ffn=512, layers=2))
    B, S = (2, 128) if GPU else (2, 16)
    params_h = jax.tree.map(np.asarray, tpd.init_params(jax.random.key(1), cfg))
    x_h = np.asarray(jax.random.normal(jax.random.key(2), (B, S, cfg.hidden)).astype(cfg.dtype))
    specs = tpd.param_specs(params_h, ("tp",))
    params = jax.tree.map(lambda h, s: global_array(mesh, s, h), params_h, specs,
                          is_leaf=lambda v: isinstance(v, np.ndarray))
    x = global_array(mesh, P(), x_h)
    fwd = tpd.sharded_forward(mesh, cfg, ("tp",))

    comm = nvc.Communicator(mesh, "tp", max_message_bytes=max(1 << 20, x_h.nbytes))

    def hand_body(p, h):
        """The same decoder written with the fused op called by hand (the row-parallel
        linears return partial sums; the psum + add + norm is one call)."""
        n_heads = cfg.heads // W

        def fused(part, res, w):
            shp = part.shape
            n, r = nvc.all_reduce_rms_norm(part.reshape(-1, shp[-1]), res.reshape(-1, shp[-1]),
                                           w.astype(part.dtype), comm, eps=cfg.eps)
            return n.reshape(shp), r.reshape(shp)

        residual, partial_sum = h, None
        for lp in p["layers"]:
            layer = tpd.DecoderLayer(lp, cfg, None, n_heads)   # tp=None: no psum inside
            if partial_sum is None:
                a = layer.input_norm(h).astype(cfg.dtype)
            else:
                a, residual = fused(partial_sum, residual, lp["input_norm"])
            a, residual = fused(layer.attn(a), residual, lp["post_attn_norm"])
            partial_sum = layer.mlp(a)
        out, _ = fused(partial_sum, residual, p["final_norm"])
        return out

    def hand(p, h):
        return jax.shard_map(hand_body, mesh=mesh, in_specs=(specs, P()), out_specs=P())(p, h)

    dev = jax.local_devices()[0]  # the dense model on this process's first device
    dense = jax.jit(tpd.dense_forward(cfg))(jax.device_put(params_h, dev),
                                            jax.device_put(x_h, dev))
    dense = np.asarray(dense, np.float64)
    j = nvc.jit(fwd)
    got = local(j(params, x))
    got_hand = local(jax.jit(hand)(params, x))
    ours, xla = counts(j.lower(params, x).compile().as_text())
    say(f"decoder: W={W} hidden={cfg.hidden} rows={B * S} {cfg.dtype.__name__}: nvc.jit has "
        f"{ours} of our calls (want {2 * cfg.layers}), {xla} XLA collectives")
    say(f"decoder: nvc.jit vs dense rel {rel(got, dense):.2e}; vs hand {rel(got, got_hand):.2e}")
    rows = [("nvc.jit", nvc.jit(looped(fwd))), ("hand", jax.jit(looped(hand)))]
    if SOLO:
        want = local(jax.jit(fwd)(params, x))
        say(f"decoder: nvc.jit vs jax.jit rel {rel(got, want):.2e}")
        rows.append(("jax.jit", jax.jit(looped(fwd))))
    times = measured("decoder", rows, params, x)
    for name, t in times.items():
        say(f"decoder time  {name:8s} {t:8.3f} ms/pass")
    say(f"decoder: nvc.jit / hand = {times['nvc.jit'] / times['hand']:.3f}")
    comm.close()
    ok = ours == 2 * cfg.layers and xla == 0 and rel(got, dense) < 3e-2
    return ok


# --------------------------------------------------------------------------- the MoE layer
def moe():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("ep",))
    T, H, F, E, K = (64, 1024, 512, 16, 4) if GPU else (8, 64, 32, 16, 2)
    E = max(E, W)
    params_h = jax.tree.map(np.asarray, mr.init_params(jax.random.key(3), hidden=H, ffn=F,
                                                       experts=E, dtype=jnp.float32))
    x_h = np.asarray(jax.random.normal(jax.random.key(4), (W * T, H), jnp.float32))
    specs = mr.param_specs("ep")
    params = {k: global_array(mesh, specs[k], v) for k, v in params_h.items()}
    x = global_array(mesh, P("ep"), x_h)
    lax_coll = mr.Collectives(partial(lax.ragged_all_to_all, axis_name="ep"),
                              partial(lax.all_gather, axis_name="ep"),
                              partial(lax.psum, axis_name="ep"))
    comm = nvc.Communicator(mesh, "ep", max_message_bytes=max(
        1 << 20, 2 * mr.comm_bytes(T, K, E, W, H, jnp.float32)))
    nvc_coll = mr.collectives("nvc", axis_name="ep", comm=comm)

    def fwd_of(coll):
        layer = partial(mr.moe_layer, top_k=K, axis_name="ep", coll=coll)
        return jax.shard_map(lambda p, v: layer(v, p), mesh=mesh, in_specs=(specs, P("ep")),
                             out_specs=P("ep"))

    fwd, hand = fwd_of(lax_coll), fwd_of(nvc_coll)
    j = nvc.jit(fwd)
    got = np.asarray(jax.device_get(j(params, x).addressable_shards[0].data), np.float64)
    got_hand = np.asarray(jax.jit(hand)(params, x).addressable_shards[0].data, np.float64)
    ours, xla = counts(j.lower(params, x).compile().as_text())
    say(f"moe: W={W} T={T} H={H} E={E} K={K}: nvc.jit has {ours} of our calls, {xla} XLA "
        "collectives")
    say(f"moe: nvc.jit vs hand max|d| {np.abs(got - got_hand).max():.2e}")
    rows = [("nvc.jit", nvc.jit(looped(fwd))), ("hand", jax.jit(looped(hand)))]
    from jax_nvcomm.jit import pool as _pool
    pool_comm, _ = _pool.lookup(mesh, ("ep",))
    if pool_comm is not None:  # the hand-written program on nvc.jit's own communicator
        rows.append(("hand@pool", jax.jit(looped(fwd_of(
            mr.collectives("nvc", axis_name="ep", comm=pool_comm))))))
        say(f"moe: communicators: hand {comm.max_message_bytes} B, nvc.jit's "
            f"{pool_comm.max_message_bytes} B")
    if SOLO and GPU:  # XLA:CPU has no ragged all-to-all
        want = np.asarray(jax.jit(fwd)(params, x), np.float64)
        say(f"moe: nvc.jit vs jax.jit rel {rel(got, want):.2e}")
        rows.append(("jax.jit", jax.jit(looped(fwd))))
    times = measured("moe", rows, params, x)
    for name, t in times.items():
        say(f"moe time      {name:8s} {t:8.3f} ms/pass")
    say(f"moe: nvc.jit / hand = {times['nvc.jit'] / times['hand']:.3f}")
    # gradients, both forms (jax.grad(nvc.jit(loss)) and nvc.jit(jax.grad(loss))), against
    # the hand-written program's: every collective of forward and backward ours (ranks that
    # share a GPU have no NCCL, so an XLA collective left would not even run there)
    target = global_array(mesh, P("ep"), np.asarray(
        jax.random.normal(jax.random.key(5), x_h.shape, jnp.float32)))

    def loss(f):  # the target an argument: a global array cannot be closed over
        return lambda p, v, t: jnp.mean(jnp.square(f(p, v) - t))

    g_outer = jax.jit(jax.grad(nvc.jit(loss(fwd))))
    g_inner = nvc.jit(jax.grad(loss(fwd)))
    # the reference: the hand-written program's gradient where XLA's collectives run (our
    # ops' own backward rules use lax's: on ranks sharing a GPU NCCL refuses them), else the
    # other nvc.jit form
    ref = jax.jit(jax.grad(loss(hand))) if SOLO or not GPU else g_inner
    want = {k: local(v) for k, v in ref(params, x, target).items()}
    grad_ok = True
    for name, g in (("grad(nvc.jit)", g_outer), ("nvc.jit(grad)", g_inner)):
        o, xl = counts(g.lower(params, x, target).compile().as_text())
        got_g = {k: local(v) for k, v in g(params, x, target).items()}
        err = max(rel(got_g[k], want[k]) for k in want)
        say(f"moe grad {name}: {o} of our calls, {xl} XLA collectives; vs "
            f"{'hand' if ref is not g_inner else 'nvc.jit(grad)'} rel {err:.2e}")
        grad_ok &= xl == 0 and o >= 4 and err < 1e-4
    comm.close()
    return ours >= 2 and xla == 0 and np.abs(got - got_hand).max() < 1e-4 and grad_ok


ok_d = decoder()
ok_m = moe()
nvc.close_all()
say(f"jit_check: decoder {'PASS' if ok_d else 'FAIL'}, moe {'PASS' if ok_m else 'FAIL'}")
sys.exit(0 if ok_d and ok_m else 1)
