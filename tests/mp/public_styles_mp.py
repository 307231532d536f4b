"""The models of tests/public_styles/ (sglang-jax, jax-llm-examples, Flax NNX, MaxText styles)
under nvc.jit, one process or several of a `jax_nvcomm.launch` job (one device each): each
model's output against a float64 numpy model of the same weights (and, in one process, against
jax.jit of the same code), one PASS / FAIL line per model from process 0, and the count of
our calls / XLA collectives in its compiled program.

Processes sharing one GPU have no NCCL: there only programs whose collectives are all ours can
run; a model whose program keeps an XLA collective prints FAIL with the error.

    python tests/mp/public_styles_mp.py                                   # world 1 (GPU) or 8 CPU devices
    python -m jax_nvcomm.launch -n 2 --share-gpu tests/mp/public_styles_mp.py
    python -m jax_nvcomm.launch -n 4 --share-gpu tests/mp/public_styles_mp.py
"""
import os
import re
import sys
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
    ours = re.findall(r"custom_call_target=\"(nvc_\w+)\"", text)
    xla = re.findall(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|"
                     r"collective-permute)(?:-start)?\(", text)
    return len(ours), len(xla)


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
    """ref_dtype: the precision the model computes in, where lower than its dtype's; keep_fn:
    () -> the output's elements compared (tokens whose MoE routing is decided)."""
    tol = 1e-4 if (ref_dtype or dtype) == jnp.float32 else 3e-2
    try:
        with jax.set_mesh(mesh):
            j = nvc.jit(f)
            out = jax.tree.leaves(j(*args))[0]
            ours, xla = counts(j.lower(*args).compile().as_text())
            keep = None if keep_fn is None else keep_fn()
            err = max_rel(out, ref_fn(), keep)
            line = f"{name}: W={W} {ours} of our calls, {xla} XLA collectives; vs float64 " \
                   f"rel {err:.2e}"
            ok = err <= tol
            if SOLO:
                want = jax.tree.leaves(jax.jit(f)(*args))[0]
                d = max_rel(out, np.asarray(jax.device_get(want)).astype(np.float64), keep)
                line += f"; vs jax.jit rel {d:.2e}"
                ok &= d <= (1e-5 if (ref_dtype or dtype) == jnp.float32 else 3e-2)
        say(line)
    except Exception as e:  # noqa: BLE001 - reported as this model's FAIL
        if ME == 0:
            traceback.print_exc()
        say(f"{name}: error {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        ok = False
    say(f"public_styles {name}: {'PASS' if ok else 'FAIL'}")
    return ok


def sglang(moe, dtype):
    ep = W if moe else 1
    cfg = sg.Config(moe=moe, ep_size=ep, dtype=dtype, num_experts=max(16, W),
                    num_heads=max(8, W))
    mesh = sg.make_mesh()
    with jax.set_mesh(mesh):
        params = sg.init_params(jax.random.key(1), cfg, mesh)
        ids = jax.device_put(np.arange(8, dtype=np.int32) * 37 % cfg.vocab_size,
                             jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return run(f"sglang_{'moe' if moe else 'dense'}_{jnp.dtype(dtype).name}", mesh,
               sg.forward_fn(cfg, mesh), (params, ids),
               lambda: sg.dense_reference(params, ids, cfg), dtype)


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


def llm_examples(dense, dtype):
    mesh = le.make_mesh()
    cfg = le.Config(mesh=mesh, dtype=dtype, mlp_layer_idxs=(0, 1) if dense else (),
                    moe_num_experts=max(8, W))
    with jax.set_mesh(mesh):
        weights = le.init_weights(jax.random.key(2), cfg)
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        tok = jax.device_put((np.arange(16, dtype=np.int32).reshape(2, 8) * 31) % 511 + 1, rep)
        seg = jax.device_put(np.ones((2, 8), np.int32), rep)
    ref, keep = decided(tok, seg, weights, cfg, (2, 8, cfg.vocab_size))
    return run(f"llm_examples_{'dense' if dense else 'moe'}_{jnp.dtype(dtype).name}", mesh,
               lambda t, s, w: le.forward(t, s, w, cfg), (tok, seg, weights),
               lambda: ref, dtype, ref_dtype=jnp.bfloat16,   # its rms_norm returns bfloat16
               keep_fn=lambda: keep)


def llm_examples_moe_prefill():
    """One MoE layer at prefill (64 tokens, bf16), the tokens with decided routing."""
    mesh = le.make_mesh()
    cfg = le.Config(mesh=mesh, num_layers=1, dtype=jnp.bfloat16, moe_num_experts=max(8, W))
    with jax.set_mesh(mesh):
        weights = le.init_weights(jax.random.key(7), cfg)
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        tok = jax.device_put((np.arange(64, dtype=np.int32).reshape(1, 64) * 29) % 511 + 1, rep)
        seg = jax.device_put(np.ones((1, 64), np.int32), rep)
    ref, keep = decided(tok, seg, weights, cfg, (1, 64, cfg.vocab_size))
    return run("llm_examples_moe_prefill_bfloat16", mesh,
               lambda t, s, w: le.forward(t, s, w, cfg), (tok, seg, weights), lambda: ref,
               jnp.bfloat16, keep_fn=lambda: keep)


def nnx(form, dtype):
    cfg = nn.Config(dtype=dtype)
    mesh = nn.make_mesh(data=1)
    params = nn.init_params(jax.random.key(3), cfg, mesh)
    x = jax.device_put(np.asarray(jax.random.normal(jax.random.key(4), (2, 16, cfg.features)))
                       .astype(dtype), jax.sharding.NamedSharding(
                           mesh, jax.sharding.PartitionSpec()))
    build = nn.shard_map_forward if form == "shard_map" else nn.annotated_forward
    return run(f"nnx_{form}_{jnp.dtype(dtype).name}", mesh, build(cfg, mesh), (params, x),
               lambda: nn.dense_reference(params, x, cfg), dtype)


def maxtext(dtype):
    cfg = mt.Config(dtype=dtype)
    mesh = mt.make_mesh(shape=(1, 1, W))
    params = mt.init_params(jax.random.key(5), cfg, mesh)
    y = jax.device_put(np.asarray(jax.random.normal(jax.random.key(6), (2, 16, cfg.emb_dim))),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return run(f"maxtext_{jnp.dtype(dtype).name}", mesh, mt.forward_fn(cfg, mesh), (params, y),
               lambda: mt.dense_reference(params, y, cfg), dtype)


results = []
for dt in (jnp.bfloat16, jnp.float32):
    results += [nnx("shard_map", dt), nnx("annotated", dt), maxtext(dt),
                sglang(False, dt), sglang(True, dt), llm_examples(True, dt),
                llm_examples(False, dt)]
results.append(llm_examples_moe_prefill())
nvc.close_all()
say(f"public_styles: {sum(results)} of {len(results)} PASS")
sys.exit(0 if all(results) else 1)
