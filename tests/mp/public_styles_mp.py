"""The models of tests/public_styles/ (sglang-jax, jax-llm-examples, Flax NNX, MaxText styles)
under nvc.jit, one process or several of a `jax_nvcomm.launch` job (one device each): each
model's output against a float64 numpy model of the same weights (and, in one process, against
jax.jit of the same code), one PASS / FAIL line per model from process 0, and the count of
our calls / XLA collectives in its compiled program.

Every weight and input is made on the host in numpy (the same seeded values in every process)
and placed with `jax.make_array_from_callback` (no collective); the float64 references are
computed from those host copies, and each process checks its own shards of the output.

Processes sharing one GPU have no NCCL (it refuses two ranks on one GPU), so there only
programs whose collectives are all ours can run: a model whose compiled program keeps an XLA
collective prints SKIP naming those collectives (only with several processes on a GPU).

    python tests/mp/public_styles_mp.py              # world 1 on a GPU, or 8 CPU devices
    python -m jax_nvcomm.launch -n 2 tests/mp/public_styles_mp.py   # CPU: one device a process
    python -m jax_nvcomm.launch -n 2 --share-gpu tests/mp/public_styles_mp.py
    python -m jax_nvcomm.launch -n 4 --share-gpu tests/mp/public_styles_mp.py
    python tests/mp/public_styles_mp.py --time       # + loop time per call, jax.jit vs nvc.jit
    python tests/mp/public_styles_mp.py --time --trace DIR   # + each program's kernels

--time (one process only): each model's call time under jax.jit and under nvc.jit, the same
inputs called 20 times back to back then one wait, median of 9 runs, the two taking turns
run by run; the ratio nvc.jit / jax.jit per model and the worst. A loop-level number
(Python dispatch included, which at these small sizes may be most of it).
"""
import os
import re
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
if not os.environ.get("JAX_COORDINATOR_ADDRESS") and os.system("nvidia-smi -L >/dev/null 2>&1"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

from common import init  # noqa: E402

nvc = init()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from public_styles import llm_examples_style as le  # noqa: E402
from public_styles import maxtext_style as mt  # noqa: E402
from public_styles import nnx_style as nn  # noqa: E402
from public_styles import sglang_style as sg  # noqa: E402

ME = jax.process_index()
SOLO = jax.process_count() == 1
W = len(jax.devices())
GPU = jax.devices()[0].platform == "gpu"
if GPU:  # float32 products in float32 (XLA's GPU default is TF32: 1e-3 off the float64 model)
    jax.config.update("jax_default_matmul_precision", "highest")


def say(*a):
    if ME == 0:
        print(*a, flush=True)


def counts(text):
    """(our custom calls, the XLA collectives by name) in a compiled program's text."""
    ours = re.findall(r"custom_call_target=\"(nvc_\w+)\"", text)
    xla = re.findall(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|"
                     r"collective-permute)(?:-start)?\(", text)
    return len(ours), xla


def on_mesh(mesh, host, spec_or_sharding):
    """A global array of `host` (numpy, the same in every process): each process fills its own
    shards from its copy, so no collective runs."""
    sharding = spec_or_sharding
    if not isinstance(sharding, jax.sharding.Sharding):
        sharding = jax.sharding.NamedSharding(mesh, spec_or_sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def place(host, shardings):
    """A tree of host arrays placed by the matching tree of shardings."""
    return jax.tree.map(lambda a, s: on_mesh(None, a, s), host, shardings)


REP = jax.sharding.PartitionSpec()

# --time (world 1): each model's call time under jax.jit and nvc.jit, loop level (the same
# inputs called `calls` times back to back, then one wait; median over `reps` runs, the two
# functions taking turns run by run)
TIME = "--time" in sys.argv
TIMES = []
# --trace DIR (with --time): a profiler trace of each model's two programs under DIR/<model>/,
# and their device time and top kernels printed (jax_nvcomm/_trace.py)
TRACE = sys.argv[sys.argv.index("--trace") + 1] if "--trace" in sys.argv else None


def kernels(name, tag, fn, args):
    """Device time and the top kernels of one run of fn's program, from a profiler trace."""
    from jax_nvcomm import _trace
    path = _trace.record(fn, args, os.path.join(TRACE, name, tag), steps=3)
    s = _trace.device_time(path) if path else None
    if not s or s["busy_us"] is None:
        return f"    {tag}: no device kernels traced"
    top = "; ".join(f"{k['name'][:48]} {k['us']:.1f} us x{k['count']}" for k in s["top"][:6])
    return f"    {tag}: device busy {s['busy_us']:.1f} us, {s['kernels']} kernels: {top}"


def loop_us(fns, args, calls=20, reps=9):
    """Median us per call of each function in `fns`, their runs alternating (a, b, a, b, ...:
    a drift of the device's clocks falls on both)."""
    for fn in fns:
        jax.block_until_ready(fn(*args))
    out = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            for _ in range(calls):
                r = fn(*args)
            jax.block_until_ready(r)
            out[i].append((time.perf_counter() - t) / calls * 1e6)
    return [float(np.median(o)) for o in out]


def max_rel(out, ref, keep=None):
    """max |out - ref| / max |ref| over this process's shards of `out` (where `keep`, a bool
    array of out's shape, is True)."""
    err = 0.0
    for s in out.addressable_shards:
        got = np.asarray(s.data).astype(np.float64)
        d = np.abs(got - ref[s.index])
        err = max(err, float((d if keep is None else d * keep[s.index]).max(initial=0.0)))
    return err / max(float(np.abs(ref).max()), 1e-30)


def run(name, mesh, f, args, ref_fn, dtype, ref_dtype=None, keep_fn=None):
    """ref_dtype: the precision the model computes in, where lower than its dtype's (both
    comparisons, float64 and jax.jit, are then at that precision's tolerance); keep_fn: () ->
    the output's elements compared (tokens whose MoE routing is decided)."""
    low = (ref_dtype or dtype) != jnp.float32
    tol = 3e-2 if low else 1e-4
    status = "FAIL"
    try:
        with jax.set_mesh(mesh):
            j = nvc.jit(f)
            ours, xla = counts(j.lower(*args).compile().as_text())
            kinds = ", ".join(f"{k} x{xla.count(k)}" for k in sorted(set(xla)))
            line = f"{name}: W={W} {ours} of our calls, {len(xla)} XLA collectives" + \
                   (f" ({kinds})" if xla else "")
            if xla and GPU and not SOLO:
                # NCCL refuses ranks sharing a GPU: any XLA collective would fail here
                say(line)
                say(f"public_styles {name}: SKIP (XLA collectives left: {kinds}; processes "
                    f"sharing a GPU have no NCCL)")
                return None
            out = jax.tree.leaves(j(*args))[0]
            keep = None if keep_fn is None else keep_fn()
            err = max_rel(out, ref_fn(), keep)
            line += f"; vs float64 rel {err:.2e}"
            ok = err <= tol
            if SOLO:
                jj = jax.jit(f)
                want = jax.tree.leaves(jj(*args))[0]
                d = max_rel(out, np.asarray(jax.device_get(want)).astype(np.float64), keep)
                line += f"; vs jax.jit rel {d:.2e}"
                ok &= d <= (3e-2 if low else 1e-5)
                if TIME:
                    tj, tn = loop_us((jj, j), args)
                    TIMES.append((name, tj, tn))
                    line += f"; loop us per call jax.jit {tj:.1f}, nvc.jit {tn:.1f} " \
                            f"(ratio {tn / tj:.3f})"
                    if TRACE:
                        line += "\n" + kernels(name, "jax.jit", jj, args) + "\n" + \
                            kernels(name, "nvc.jit", j, args)
        say(line)
        status = "PASS" if ok else "FAIL"
    except Exception as e:  # noqa: BLE001 - reported as this model's FAIL
        if ME == 0:
            traceback.print_exc()
        say(f"{name}: error {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    say(f"public_styles {name}: {status}")
    if ME != 0 and status != "PASS":   # process 0 speaks for all; a failure elsewhere too
        print(f"[p{ME}] public_styles {name}: {status} on this process's shards", flush=True)
    return status == "PASS"


def sglang(moe, dtype):
    ep = W if moe else 1
    cfg = sg.Config(moe=moe, ep_size=ep, dtype=dtype, num_experts=max(16, W),
                    num_heads=max(8, W))
    mesh = sg.make_mesh()
    host = sg.init_params_host(jax.random.key(1), cfg, mesh)
    ids_host = np.arange(8, dtype=np.int32) * 37 % cfg.vocab_size
    params, ids = place(*host), on_mesh(mesh, ids_host, REP)
    return run(f"sglang_{'moe' if moe else 'dense'}_{jnp.dtype(dtype).name}", mesh,
               sg.forward_fn(cfg, mesh), (params, ids),
               lambda: sg.dense_reference(host[0], ids_host, cfg), dtype)


NEAR_TIE = 2.0 ** -5   # as tests/test_public_styles.py: a router-score gap within the rounding


def decided(tok, seg, weights, cfg, shape):
    """(the float64 logits, a 0/1 array of their shape: the tokens whose output no near-tied
    routing reaches: not one of this token's MoE layers, nor one of an earlier token's before
    the last layer (causal attention carries it on); a near tie is either expert)."""
    margins = []
    ref = le.dense_reference(tok, seg, weights, cfg, margins=margins)
    ties = [m < NEAR_TIE for m in margins]
    last = ties.pop() if (cfg.num_layers - 1) not in cfg.mlp_layer_idxs else False
    earlier = np.any(ties, axis=0) if ties else np.zeros(shape[:2], bool)
    reached = np.logical_or.accumulate(earlier, axis=1) | last  # (the last layer's: its own)
    say(f"  {int((~reached).sum())} of {reached.size} tokens with decided routing compared")
    return ref, np.broadcast_to((~reached)[..., None], shape).astype(np.float64)


def llm_examples_run(name, cfg, key, batch, seq, mult):
    """jax-llm-examples' forward on tokens (batch, seq) made on the host, against its float64
    model where the routing is decided. Its rms_norm returns bfloat16 whatever the dtype, so
    the model computes in bfloat16: both comparisons (float64, jax.jit) at bfloat16's
    tolerance."""
    host = le.init_weights_host(jax.random.key(key), cfg)
    tok_host = (np.arange(batch * seq, dtype=np.int32).reshape(batch, seq) * mult) % 511 + 1
    seg_host = np.ones((batch, seq), np.int32)
    mesh = cfg.mesh
    tok, seg, weights = on_mesh(mesh, tok_host, REP), on_mesh(mesh, seg_host, REP), place(*host)
    ref, keep = decided(tok_host, seg_host, host[0], cfg, (batch, seq, cfg.vocab_size))
    return run(name, mesh, lambda t, s, w: le.forward(t, s, w, cfg), (tok, seg, weights),
               lambda: ref, cfg.dtype, ref_dtype=jnp.bfloat16, keep_fn=lambda: keep)


def llm_examples(dense, dtype):
    cfg = le.Config(mesh=le.make_mesh(), dtype=dtype, mlp_layer_idxs=(0, 1) if dense else (),
                    moe_num_experts=max(8, W))
    return llm_examples_run(f"llm_examples_{'dense' if dense else 'moe'}_"
                            f"{jnp.dtype(dtype).name}", cfg, 2, 2, 8, 31)


def llm_examples_moe_prefill():
    """One MoE layer at prefill (64 tokens, bf16), the tokens with decided routing."""
    cfg = le.Config(mesh=le.make_mesh(), num_layers=1, dtype=jnp.bfloat16,
                    moe_num_experts=max(8, W))
    return llm_examples_run("llm_examples_moe_prefill_bfloat16", cfg, 7, 1, 64, 29)


def nnx(form, dtype):
    cfg = nn.Config(dtype=dtype)
    mesh = nn.make_mesh(data=1)
    host = nn.init_params(jax.random.key(3), cfg)            # numpy arrays (no mesh)
    x_host = np.random.default_rng(4).standard_normal((2, 16, cfg.features)).astype(dtype)
    params = jax.tree.map(lambda a, s: on_mesh(mesh, a, s), host, nn.param_specs(host))
    x = on_mesh(mesh, x_host, REP)
    build = nn.shard_map_forward if form == "shard_map" else nn.annotated_forward
    return run(f"nnx_{form}_{jnp.dtype(dtype).name}", mesh, build(cfg, mesh), (params, x),
               lambda: nn.dense_reference(host, x_host, cfg), dtype)


def maxtext(dtype):
    cfg = mt.Config(dtype=dtype)
    mesh = mt.make_mesh(shape=(1, 1, W))
    host = mt.init_params_host(jax.random.key(5), cfg, mesh)
    y_host = np.random.default_rng(6).standard_normal((2, 16, cfg.emb_dim)).astype(np.float32)
    params, y = place(*host), on_mesh(mesh, y_host, REP)
    return run(f"maxtext_{jnp.dtype(dtype).name}", mesh, mt.forward_fn(cfg, mesh), (params, y),
               lambda: mt.dense_reference(host[0], y_host, cfg), dtype)


results = []
for dt in (jnp.bfloat16, jnp.float32):
    results += [nnx("shard_map", dt), nnx("annotated", dt), maxtext(dt),
                sglang(False, dt), sglang(True, dt), llm_examples(True, dt),
                llm_examples(False, dt)]
results.append(llm_examples_moe_prefill())
nvc.close_all()
ran = [r for r in results if r is not None]
say(f"public_styles: {sum(ran)} of {len(ran)} PASS, {len(results) - len(ran)} SKIP")
if TIMES:
    name, tj, tn = max(TIMES, key=lambda r: r[2] / r[1])
    say(f"public_styles --time: worst nvc.jit / jax.jit loop time {tn / tj:.3f} ({name}); "
        f"median over models {float(np.median([r[2] / r[1] for r in TIMES])):.3f}")
sys.exit(0 if all(ran) else 1)
