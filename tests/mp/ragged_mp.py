"""ragged_all_to_all across processes (or one process over several GPUs), bitwise against the
numpy reference of lax.ragged_all_to_all (tests/ragged_cases.py): fresh random calls each round
(nothing sent, everything to one rank, operands full, random counts), four configurations of
dtype / row shape / slices per peer, a loop of calls inside one program, one vmapped call, and
gradients against numpy (they run on this op itself, so also where ranks share one GPU and
XLA's collectives cannot run), then outputs of 64 x max_message_bytes (the chunked path: random
calls and a loop) on a 64 KiB communicator.
  python -m jax_nvcomm.launch -n 4 [--share-gpu] tests/mp/ragged_mp.py [--rounds=40]
--x64=1 passes int64 offsets and sizes (jax_enable_x64). --graph=1 turns on XLA command buffers
for custom calls and loops (on GPUs the loop then replays a CUDA graph: the handler runs fewer
times than the kernels, checked). --fault=1 runs only a bad call instead: the last rank's slice
1 ends past its operand; its record must name it, slice 1 and the bound, every other rank's
must name the last rank, within the deadline, and the next call must be refused everywhere
("PASS ragged fault").
"""
import os
import sys

_flags = os.environ.get("XLA_FLAGS", "")
if "--graph=1" in sys.argv and "xla_gpu_enable_command_buffer" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,"
                               "WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1").strip()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from common import arg, global_array, init, mesh1d, rank_print  # noqa: E402
from ragged_cases import make_call, np_grads, np_ragged_all_to_all  # noqa: E402

nvc = init()
fault = arg("fault", 0)
rounds = arg("rounds", 40)
graph = arg("graph", 0)
x64 = arg("x64", 0)
if x64:
    jax.config.update("jax_enable_x64", True)
IDX = np.int64 if x64 else np.int32
mesh = mesh1d()
W = mesh.shape["x"]
rng = np.random.default_rng(4321)
MODES = ("zero", "all_to_one", "full", "random")
# (dtype, row shape, k, N, M): prefill-sized bf16 rows, f32 with k > 1, 1-D fp8, int32 rows
CONFIGS = ((jnp.bfloat16, (512,), 1, 96, 128), (jnp.float32, (3, 5), 3, 40, 48),
           (jnp.float8_e4m3fn, (), 2, 64, 64), (jnp.int32, (8,), 1, 17, 23))


def stacked(dtype, shape):
    """Random bytes of dtype (any bit pattern: the op moves bytes), [W, ...] per rank."""
    dt = jnp.dtype(dtype)
    return rng.integers(0, 256, shape + (dt.itemsize,), dtype=np.uint8).view(dt).reshape(shape)


def blocks(arr):
    """{rank: numpy block} of this process's shards of a [W, ...] array sharded over 'x'."""
    return {s.index[0].start or 0: np.asarray(s.data)[0] for s in arr.addressable_shards}


def put(*arrays):
    return [global_array(mesh, P("x"), a) for a in arrays]


def fault_case():
    """A slice of the last rank ends past its operand: every rank ends with a named error."""
    import time
    k, N, M = 2, 12, 16
    idx = [a.astype(IDX) for a in make_call(rng, W, k, N, M, max_size=2)]
    idx[0][W - 1, 1], idx[1][W - 1, 1] = N - 1, 3   # slice 1 (to rank 0): rows 11..13 of 12
    idx[3][0, (W - 1) * k + 1] = 3
    x, out = stacked(jnp.float32, (W, N, 4)), stacked(jnp.float32, (W, M, 4))
    comm = nvc.Communicator(mesh, "x", max_message_bytes=1 << 20, timeout_s=10)

    def one(x, out, io, ss, oo, rs):
        return nvc.ragged_all_to_all(x[0], out[0], io[0], ss[0], oo[0], rs[0], comm)[None]
    f = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
    t0 = time.monotonic()
    try:   # the host backend fails this call; a device may report it at the next one
        jax.block_until_ready(f(*put(x, out, *idx)))
    except Exception as e:  # noqa: BLE001 - the text is what is checked
        rank_print(f"GOT {str(e).splitlines()[0][:300]}")
    records = comm.errors()
    while not records and time.monotonic() - t0 < 20:
        time.sleep(0.05)
        records = comm.errors()
    text = "\n".join(records)
    bad = (f"rank {W - 1}: slice i=1 of rank {W - 1}'s call lies outside operand/output: "
           "input_offsets[i] + send_sizes[i] > N")
    mine = [int(s.index[0].start or 0) for s in put(x)[0].addressable_shards]
    for r in mine:
        want = bad if r == W - 1 else f"rank {r}: rank {W - 1} failed this call"
        assert want in text, (want, text)
    try:
        jax.block_until_ready(f(*put(x, out, *idx)))
        raise AssertionError("a call after the error was not refused")
    except Exception as e:  # noqa: BLE001
        assert "unusable" in str(e) or "failed this call" in str(e), str(e)[:500]
    rank_print(f"recorded within {time.monotonic() - t0:.1f} s: {text[:300]}")
    rank_print("PASS ragged fault")
    sys.stdout.flush()
    # rank 0 hosts the coordination service, whose end kills the others: it leaves last
    from jax_nvcomm import _exchange
    me = jax.process_index()
    if me != 0:
        _exchange.put(f"ragged_mp/fault/{me}", b"1")
    else:
        for r in range(1, jax.process_count()):
            _exchange.get(f"ragged_mp/fault/{r}", 30, f"rank {r}'s fault report")
    os._exit(0)  # the communicator is unusable: no collective close()


if fault:
    fault_case()

with nvc.Communicator(mesh, "x", max_message_bytes=4 << 20) as comm:
    def one(x, out, io, ss, oo, rs):
        return nvc.ragged_all_to_all(x[0], out[0], io[0], ss[0], oo[0], rs[0], comm)[None]

    f = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
    for i in range(rounds):
        dtype, row, k, N, M = CONFIGS[i % len(CONFIGS)]
        mode = MODES[(i // len(CONFIGS)) % len(MODES)]
        idx = [a.astype(IDX) for a in make_call(rng, W, k, N, M, mode)]
        x, out = stacked(dtype, (W, N) + row), stacked(dtype, (W, M) + row)
        want = np_ragged_all_to_all(x, out, *idx)
        for r, b in blocks(f(*put(x, out, *idx))).items():
            assert b.tobytes() == want[r].tobytes(), f"round {i} ({mode}, {dtype}) rank {r}"
    rank_print(f"{rounds} rounds of random calls OK ({W} ranks, offsets {IDX.__name__})")

    # a loop of calls in one program (a CUDA-graph replay under command buffers on GPUs)
    k, N, iters = 2, 32, 40
    idx = [a.astype(IDX) for a in make_call(rng, W, k, N, N, "full")]

    def loop(x, io, ss, oo, rs):
        def step(_, v):
            return nvc.ragged_all_to_all(v, v * 0 - 1, io[0], ss[0], oo[0], rs[0], comm) + 1
        return lax.fori_loop(0, iters, step, x[0])[None]
    fl = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x")))
    x = rng.integers(-50, 50, (W, N, 16)).astype(np.float32)
    want = x
    for _ in range(iters):
        want = np_ragged_all_to_all(want, np.full_like(want, -1), *idx) + 1
    execs = 3
    before = sum(comm.host_calls().values())
    for e in range(execs):
        for r, b in blocks(fl(*put(x, *idx))).items():
            assert np.array_equal(b, want[r]), f"loop {e}: rank {r}"
    calls = sum(comm.host_calls().values()) - before
    kernels = execs * iters * len(comm.host_calls())
    replay = " (CUDA graph replay)" if calls < kernels else ""
    rank_print(f"loop of {iters} calls OK; graph check: {calls} handler runs for {kernels} "
               f"kernel calls{replay}")
    if graph and jax.devices()[0].platform == "gpu":
        assert calls < kernels, "command buffers on, but every kernel call ran the handler"

    # one vmapped call: a batch of 3 independent calls folded into one kernel call
    B, k, N, M = 3, 2, 20, 24
    calls = [[a.astype(IDX) for a in make_call(rng, W, k, N, M)] for _ in range(B)]
    idx = [np.stack([c[a] for c in calls], 1) for a in range(4)]
    x, out = stacked(jnp.bfloat16, (W, B, N, 64)), stacked(jnp.bfloat16, (W, B, M, 64))
    fv = jax.jit(jax.shard_map(
        lambda *a: jax.vmap(lambda *b: nvc.ragged_all_to_all(*b, comm))(*(v[0] for v in a))[None],
        mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
    got = blocks(fv(*put(x, out, *idx)))
    for b in range(B):
        want = np_ragged_all_to_all(x[:, b], out[:, b], *calls[b])
        for r, blk in got.items():
            assert blk[b].tobytes() == want[r].tobytes(), f"vmap example {b} rank {r}"
    rank_print("vmap of 3 calls (one kernel call) OK")

    # gradients to operand and output against numpy
    k, N, M, h = 2, 24, 30, 32
    idx = [a.astype(IDX) for a in make_call(rng, W, k, N, M)]
    x = rng.standard_normal((W, N, h)).astype(np.float32)
    out = rng.standard_normal((W, M, h)).astype(np.float32)
    t = rng.standard_normal((W, M, h)).astype(np.float32)

    def loss(x, out, io, ss, oo, rs, t):
        return jnp.sum(one(x, out, io, ss, oo, rs) * t)[None]
    fg = jax.shard_map(loss, mesh=mesh, in_specs=(P("x"),) * 7, out_specs=P("x"))
    dx, dout = jax.jit(jax.grad(lambda *a: fg(*a).sum(), argnums=(0, 1)))(*put(x, out, *idx, t))
    want_dx, want_dout = np_grads(x, out, *idx, t)
    for r, b in blocks(dx).items():
        assert np.array_equal(b, want_dx[r]), f"d operand rank {r}"
    for r, b in blocks(dout).items():
        assert np.array_equal(b, want_dout[r]), f"d output rank {r}"
    rank_print("gradients OK")
    assert not comm.errors(), comm.errors()

# outputs 64+ x max_message_bytes: the chunked path, random calls and a loop (a CUDA-graph
# replay under command buffers), in the communicator's memory as it is
with nvc.Communicator(mesh, "x", max_message_bytes=1 << 16) as big:
    nb = big.nbytes

    def one_big(x, out, io, ss, oo, rs):
        return nvc.ragged_all_to_all(x[0], out[0], io[0], ss[0], oo[0], rs[0], big)[None]
    fb = jax.jit(jax.shard_map(one_big, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
    h, k, N, M = 256, 2, 4200, 4200                 # 4200 x 1 KiB rows > 64 x 64 KiB
    assert M * h * 4 >= 64 * big.max_message_bytes
    for i, mode in enumerate(("random", "full", "all_to_one")):
        idx = [a.astype(IDX) for a in make_call(rng, W, k, N, M, mode)]
        x, out = stacked(jnp.float32, (W, N, h)), stacked(jnp.float32, (W, M, h))
        want = np_ragged_all_to_all(x, out, *idx)
        for r, b in blocks(fb(*put(x, out, *idx))).items():
            assert b.tobytes() == want[r].tobytes(), f"big call {i} ({mode}) rank {r}"
    iters, n = 10, 2100
    idx = [a.astype(IDX) for a in make_call(rng, W, 1, n, n, "full")]

    def loop_big(x, io, ss, oo, rs):
        def step(_, v):
            return nvc.ragged_all_to_all(v, v * 0 - 1, io[0], ss[0], oo[0], rs[0], big) + 1
        return lax.fori_loop(0, iters, step, x[0])[None]
    flb = jax.jit(jax.shard_map(loop_big, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=P("x")))
    x = rng.integers(-50, 50, (W, n, 512)).astype(np.float32)   # 2 KiB rows: 64 x 64 KiB
    want = x
    for _ in range(iters):
        want = np_ragged_all_to_all(want, np.full_like(want, -1), *idx) + 1
    for e in range(2):
        for r, b in blocks(flb(*put(x, *idx))).items():
            assert np.array_equal(b, want[r]), f"big loop {e}: rank {r}"
    assert big.nbytes == nb and not big.errors(), big.errors()
    rank_print(f"outputs of 64 x max_message_bytes (chunked path) OK, nbytes {nb} unchanged")
rank_print("PASS ragged")
