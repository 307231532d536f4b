"""Random ragged_all_to_all calls and a numpy reference of lax.ragged_all_to_all's semantics,
for tests/test_ragged.py, tests/mp/ragged_mp.py and tests/gpu/test_gpu_ragged.py.

A call over W ranks with k slices per peer is described by [W, K] arrays (K = W * k; row s is
rank s's argument): sizes[s, i] rows go from rank s to rank i // k. Senders place their slices
in their operand, receivers in their output, each in a random order with random gaps, so
nothing is contiguous by accident and untouched output rows stay between the slices."""
import numpy as np


def _place(rng, lengths, room):
    """Start rows for blocks of `lengths` inside `room` rows: random order, random gaps."""
    lengths = np.asarray(lengths, np.int64)
    free = room - int(lengths.sum())
    assert free >= 0, (lengths, room)
    order = rng.permutation(len(lengths))
    gap_before = np.sort(rng.integers(0, free + 1, len(lengths)))  # cumulative, <= free
    starts = np.zeros(len(lengths), np.int64)
    before = 0                                      # rows of the blocks placed so far
    for t, b in enumerate(order):
        starts[b] = gap_before[t] + before
        before += int(lengths[b])
    return starts


def make_call(rng, W, k, N, M, mode="random", max_size=None):
    """(input_offsets, send_sizes, output_offsets, recv_sizes), each int64 [W, K], valid for an
    operand of N rows and an output of M rows on every rank. mode: "random" (some slices empty),
    "zero" (nothing sent), "all_to_one" (every rank sends to rank W - 1 only), "full" (every
    sender's slices fill its operand when the receivers' outputs allow)."""
    K = W * k
    cap = max_size if max_size is not None else max(1, min(N, M) // max(1, k))
    sizes = rng.integers(0, cap + 1, (W, K))
    if mode == "random":
        sizes[rng.random((W, K)) < 0.25] = 0
    elif mode == "zero":
        sizes[:] = 0
    elif mode == "all_to_one":
        sizes[:, :(W - 1) * k] = 0
    elif mode != "full":
        raise ValueError(mode)
    # shrink until every sender fits N rows and every receiver M rows
    while True:
        send = sizes.sum(1)
        recv = np.array([sizes[:, d * k:(d + 1) * k].sum() for d in range(W)])
        if (send <= N).all() and (recv <= M).all():
            break
        s = int(np.argmax(send - N)) if (send > N).any() else None
        if s is not None:
            i = int(rng.choice(np.flatnonzero(sizes[s])))
        else:
            d = int(np.argmax(recv - M))
            s, j = divmod(int(rng.choice(np.flatnonzero(sizes[:, d * k:(d + 1) * k]))), k)
            i = d * k + j
        sizes[s, i] -= 1
    io = np.stack([_place(rng, sizes[s], N) for s in range(W)])
    oo = np.zeros((W, K), np.int64)
    rs = np.zeros((W, K), np.int64)
    for d in range(W):
        got = sizes[:, d * k:(d + 1) * k]                 # [W sources, k slices]
        starts = _place(rng, got.reshape(-1), M).reshape(W, k)
        oo[:, d * k:(d + 1) * k] = starts
        rs[d] = got.reshape(-1)
    return io, sizes.astype(np.int64), oo, rs


def np_ragged_all_to_all(operand, output, io, ss, oo, rs):
    """lax.ragged_all_to_all over W ranks, written from its docstring's receive loop: operand
    [W, N, ...], output [W, M, ...], index arrays [W, K]. Returns [W, M, ...]."""
    W, K = io.shape
    k = K // W
    result = np.array(output, copy=True)
    oo_ = np.zeros_like(oo)                 # all_to_all(output_offsets): receiver's frame
    for d in range(W):
        for r in range(W):
            oo_[d, r * k:(r + 1) * k] = oo[r, d * k:(d + 1) * k]
    for d in range(W):
        for i in range(K):
            src, j = divmod(i, k)
            sent = operand[src, io[src, d * k + j]: io[src, d * k + j] + ss[src, d * k + j]]
            assert len(sent) == rs[d, i], "inconsistent call"
            result[d, oo_[d, i]: oo_[d, i] + rs[d, i]] = sent
    return result


def landed(oo, rs, M):
    """[W, M] bool: the rows of each receiver that some slice lands on."""
    W, K = oo.shape
    k = K // W
    out = np.zeros((W, M), bool)
    for d in range(W):
        for r in range(W):
            for j in range(k):
                o = oo[r, d * k + j]
                out[d, o:o + rs[d, r * k + j]] = True
    return out


def np_grads(x, out, io, ss, oo, rs, t):
    """d/d(operand, output) of sum(result * t) over all ranks: for every sent row, t's row
    where it landed (zero on operand rows no slice sends), and t where nothing landed."""
    Wn, K = io.shape
    k = K // Wn
    dx = np.zeros_like(x)
    for s in range(Wn):
        for i in range(K):
            d = i // k
            dx[s, io[s, i]:io[s, i] + ss[s, i]] = t[d, oo[s, i]:oo[s, i] + ss[s, i]]
    dout = np.where(landed(oo, rs, out.shape[1])[:, :, None], 0.0, t).astype(t.dtype)
    return dx, dout
