#!/usr/bin/env python
"""The dropless expert-parallel MoE layer of jax_nvcomm/models/moe_ragged.py (ragged_all_to_all,
ragged_dot, the way JAX MoE code writes it): a forward pass and a training step (loss, gradients
w.r.t. the weights and the tokens) with XLA's collectives (`--impl lax`) and with jax_nvcomm's
(`--impl nvc`), compared with each other and with a dense reference of the same layer that
exchanges no tokens (every rank runs all experts on its own tokens); ms per step.

    python examples/moe_ragged.py                       # both impls; 8 CPU devices without GPU
    python examples/moe_ragged.py --devices 1 --save-ref /tmp/moe_ragged_ref.npz
    python -m jax_nvcomm.launch -n 2 --share-gpu examples/moe_ragged.py --impl nvc \\
        --ref /tmp/moe_ragged_ref.npz                   # ranks sharing a GPU: no NCCL, nvc only

`--tokens` counts the tokens of all ranks, so the results do not depend on the world size: a
reference stored on one device compares with a run on several.

On CPU devices the timings mean nothing for GPUs (the host backend and XLA share this machine's
cores, and XLA:CPU's ragged all-to-all is an emulation): there the example shows that the code
runs and that the layers agree; the agreement holds on any device.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
from functools import partial

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # relative L2 error of outputs and gradients


def setup(cpu_devices=8):
    """Before jax starts: join a `jax_nvcomm.launch` job; without a GPU, `cpu_devices` CPU
    devices."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):  # started by jax_nvcomm.launch
        # XLA's ragged-all-to-all between processes goes through NCCL only with this flag
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_allow_"
                                   "ragged_all_to_all_nccl_send_recv_fallback=true").strip()
        import jax_nvcomm as nvc
        nvc.distributed_initialize()
        return
    try:
        gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except OSError:
        gpu = False
    if not gpu and not os.environ.get("JAX_PLATFORMS"):
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={cpu_devices}")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("lax", "nvc", "both"), default="both",
                   help="which collectives (both: compare them; lax also runs the dense "
                        "reference)")
    p.add_argument("--tokens", type=int, help="tokens of all ranks (GPU 4096, CPU 256)")
    p.add_argument("--hidden", type=int, help="GPU 2048, CPU 64")
    p.add_argument("--experts", type=int, help="GPU 128, CPU 16")
    p.add_argument("--top-k", type=int, help="GPU 8, CPU 4")
    p.add_argument("--ffn", type=int, help="expert intermediate size (GPU 768, CPU 64)")
    p.add_argument("--dtype", choices=tuple(TOLERANCE), help="GPU bfloat16, CPU float32")
    p.add_argument("--devices", type=int, help="use the first N devices (default: all)")
    p.add_argument("--iters", type=int, default=None, help="timed steps (GPU 20, CPU 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-ref", metavar="F.npz", help="store the lax results (or nvc's)")
    p.add_argument("--ref", metavar="F.npz", help="compare with a stored reference")
    return p.parse_args(argv)


def main(argv=None):
    a = parse(argv)
    setup(max(8, a.devices or 0))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_nvcomm as nvc
    from jax_nvcomm.models import moe_ragged as mr

    devs = jax.devices()[:a.devices] if a.devices else jax.devices()
    cpu = devs[0].platform == "cpu"
    d = dict(tokens=256, hidden=64, experts=16, top_k=4, ffn=64, dtype="float32", iters=3) \
        if cpu else dict(tokens=4096, hidden=2048, experts=128, top_k=8, ffn=768,
                         dtype="bfloat16", iters=20)
    cfg = {k: getattr(a, k) if getattr(a, k, None) is not None else v for k, v in d.items()}
    W, N, E, K = len(devs), cfg["tokens"], cfg["experts"], cfg["top_k"]
    if N % W or E % W or not 1 <= K <= E:
        print(f"error: --tokens {N} and --experts {E} must be multiples of the {W} devices, "
              f"--top-k {K} in [1, {E}]", file=sys.stderr)
        return 2
    dtype = jnp.dtype(cfg["dtype"])
    model = repr(sorted((k, v) for k, v in dict(cfg, seed=a.seed).items() if k != "iters"))
    ref = None
    if a.ref:
        with np.load(a.ref) as z:
            ref = {k: z[k] for k in z.files}
        if str(ref.pop("config")) != model:
            print(f"error: --ref {a.ref} holds another model than {model}", file=sys.stderr)
            return 2
    main_proc = jax.process_index() == 0
    say = print if main_proc else (lambda *_: None)

    # data and weights: generated on the devices, each shard where it lives; the values do
    # not depend on the sharding (jax.random is partitionable), hence not on the world size
    axis = "ep"
    mesh = jax.sharding.Mesh(np.array(devs), (axis,))
    specs = mr.param_specs(axis)
    rows = NamedSharding(mesh, P(axis))
    params = jax.jit(partial(mr.init_params, hidden=cfg["hidden"], ffn=cfg["ffn"], experts=E,
                             dtype=dtype),
                     out_shardings={k: NamedSharding(mesh, s) for k, s in specs.items()})(
        jax.random.key(a.seed))
    x, target = jax.jit(lambda k: tuple(jax.random.normal(kk, (N, cfg["hidden"])).astype(dtype)
                                        for kk in jax.random.split(k)),
                        out_shardings=(rows, rows))(jax.random.key(a.seed + 1))

    impls = {"both": ["lax", "nvc"], "lax": ["lax"], "nvc": ["nvc"]}[a.impl]
    comm = None
    if "nvc" in impls:
        comm = nvc.Communicator(mesh, axis, max_message_bytes=mr.comm_bytes(
            N // W, K, E, W, cfg["hidden"], dtype))
    say(f"moe_ragged: {W} x {devs[0].device_kind} ({jax.process_count()} process(es)); "
        f"{N} tokens ({N // W} per rank), hidden {cfg['hidden']}, {E} experts top-{K} "
        f"({E // W} per rank), ffn {cfg['ffn']}, {dtype.name}")
    if cpu and "lax" in impls:
        say("NOTE: XLA:CPU has no ragged-all-to-all: on CPU devices the lax side runs "
            "jax_nvcomm.reference's emulation of it (the same rows to the same places)")

    def programs(impl):
        """(forward, train step), jitted; impl "dense": the reference without exchanges."""
        if impl == "dense":
            fwd = partial(mr.dense_reference, top_k=K, axis_name=axis)
            psum = partial(jax.lax.psum, axis_name=axis)
        else:
            coll = mr.collectives(impl, axis_name=axis, comm=comm)
            fwd = partial(mr.moe_layer, top_k=K, axis_name=axis, coll=coll)
            psum = coll.psum
        step = partial(mr.loss_and_grads, fwd, axis_name=axis, psum=psum, num_tokens=N)
        return (jax.jit(jax.shard_map(lambda x, p: fwd(x, p), mesh=mesh,
                                      in_specs=(P(axis), specs), out_specs=P(axis))),
                jax.jit(jax.shard_map(lambda p, x, t: step(p, x, t), mesh=mesh,
                                      in_specs=(specs, P(axis), P(axis)),
                                      out_specs=(P(), specs, P(axis)))))

    def timed(fn, *args):
        out = jax.block_until_ready(fn(*args))  # compile + warm-up
        ts = []
        for _ in range(cfg["iters"]):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - t0)
        return out, statistics.median(ts) * 1e3

    results = {}
    for impl in impls + (["dense"] if "lax" in impls else []):
        fwd, step = programs(impl)
        if impl == "dense":  # a check, not a contender: run once
            y, (loss, grads, dx) = fwd(x, params), step(params, x, target)
        else:
            y, ms_f = timed(fwd, x, params)
            (loss, grads, dx), ms_s = timed(step, params, x, target)
            say(f"{impl:4}: forward {ms_f:8.3f} ms, training step {ms_s:8.3f} ms, "
                f"loss {float(loss):.6f}")
        results[impl] = dict(y=y, dx=dx, **{f"grad_{k}": v for k, v in grads.items()})
    if comm is not None:
        comm.close()
    if cpu:
        say("CPU devices: these timings mean nothing for GPUs (the host backend and XLA share "
            "this machine's cores); they show that the code runs. The agreement below holds on "
            "any device.")

    def blocks(arr):
        """This process's part of a global array: [(index, float64 numpy)], one per block."""
        return [(s.index, np.asarray(s.data, np.float64)) for s in arr.addressable_shards
                if s.replica_id == 0]

    def rel_err(got, want):
        """(relative L2 error, array name) of got against want (a result dict or stored
        arrays), the largest over the output and the gradients; this process's blocks."""
        worst = (0.0, "-")
        for k, arr in got.items():
            num = den = 0.0
            for idx, v in blocks(arr):
                w = np.asarray(want[k][idx], np.float64)
                num, den = num + np.sum((v - w) ** 2), den + np.sum(w ** 2)
            worst = max(worst, (float(np.sqrt(num / max(den, 1e-300))), k))
        return worst

    tol = TOLERANCE[dtype.name]
    ok = True
    pairs = [("nvc", "lax"), ("lax", "dense"), ("nvc", "dense")]
    checks = [(c, b, results[b]) for c, b in pairs if c in results and b in results]
    if ref is not None:
        checks += [(c, "the reference", ref) for c in impls]
    for cand, base, want in checks:
        err, name = rel_err(results[cand], want)
        ok &= err < tol
        where = f" (process {jax.process_index()})" if jax.process_count() > 1 else ""
        print(f"{cand} vs {base}{where}: max relative L2 error of output and gradients "
              f"{err:.1e} ({name}): {'agree' if err < tol else 'DISAGREE'} (tolerance {tol:g})")
    if not checks:
        say("no comparison (one impl and no --ref)")
    if a.save_ref:
        if jax.process_count() > 1:
            print("error: --save-ref needs one process", file=sys.stderr)
            return 2
        np.savez(a.save_ref, config=np.array(model), **{
            k: np.asarray(v, np.float32) for k, v in results[impls[0]].items()})
        say(f"saved the {impls[0]} results to {a.save_ref}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
