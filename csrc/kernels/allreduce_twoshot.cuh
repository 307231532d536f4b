// Two-shot all-reduce (flag protocol: reduce-scatter + all-gather), optionally fused with
// residual add + RMSNorm (and, with kQuant, the FP8 output of rmsnorm.cuh).
//
// Buffer layout: data half (seq & 1) of rank r, CommView::half(r, seq), flag_half bytes:
//   [0, W*S)            reduce-scatter landing zone: slot [src] (S = align_up(ceil(M/W), 256))
//                       holds src's sanitised copy of the owner's share
//   [W*S, W*S + M)      all-gather landing zone: the T-typed sum of the whole message, at the
//                       message's own offsets (M = max_message_bytes)
// Flags: Ctrl::flags[seq & 1][phase][src][block] in the receiver's control block, written with
// make_flag(seq, desc) (desc = op kind + sizes) by the sender's block after a __syncthreads, with
// a system-scope release store (publish_flag); waiters use wait_flag (deadline, disagreement
// check).
//
// Partition (by 16-byte vectors, not rows): the nv vectors of the message are split into W
// contiguous shares, owner o owns [nv*o/W, nv*(o+1)/W); each share is split into G contiguous
// chunks, chunk b handled by block b on every rank (identical grids). A share is at most
// ceil(nv/W) vectors, which always fits S. Splitting by vectors keeps every owner busy even when
// tokens < W, and the fused epilogue does not need rows here: it runs after the all-gather.
//
// Call with sequence number s = Ctrl::seq + 1 on rank `me`, block b:
//   phase 0 (reduce-scatter): for every owner o != me, push chunk b of share o of sanitised x to
//     o's RS slot [me]; publish flags[p][0][me][b] at every peer; wait for flags[p][0][j][b] from
//     every peer j (this is what keeps the two-halves proof of layout.h true: every call waits
//     for every peer).
//   phase 1 (reduce + all-gather): for chunk b of share me, sum in float32 in rank order 0..W-1
//     (own contribution read straight from x, sanitised the same way), round to T, store T(sum)
//     to the AG zone of every rank (plain: the own copy goes straight to `out`); publish
//     flags[p][1][me][b] at every rank, itself included.
//   phase 2: plain: wait flags[p][1][o][b] of every other owner and copy chunk b of every other
//     share from the own AG zone to `out`. Fused: block b owns rows [tokens*b/G, tokens*(b+1)/G),
//     waits for exactly the (owner, chunk) flags whose vectors intersect them, then runs the
//     epilogue (rmsnorm.cuh) on the gathered T-typed sums with this rank's own residual. The
//     epilogue thus runs on every rank for every row: it costs the same local traffic as copying
//     gathered normed + residual_out rows, halves the all-gather bytes, keeps the AG zone at M
//     bytes (no layout change) and gives one-shot's bits exactly.
//   end: the block with the last arrival ticket (taken by every block at its start, after
//   reading s: common.cuh arrive_issue) stores Ctrl::seq = s; no handshake on the tail.
//
// Failure (common.cuh): every block reads Ctrl::failed with s and leaves at once when it is set,
// as every block does for a message above max_message_bytes (kErrCapacity). A flag wait that
// fails (timeout, disagreement, peer ahead: recorded; or Ctrl::failed set elsewhere) makes its
// block leave at the __syncthreads_or that follows the wait, before it reads data that did not
// arrive: phase 1 (after phase 0's wait) or the copy / epilogue (after phase 2's). A block that
// leaves after phase 0 has its phase-0 flags up but will never raise flags[p][1][me][b]: every
// thread whose phase-0 wait failed raises the POISON flag make_flag(s, kPoisonDesc) there at
// every peer instead (twoshot_leave_phase0; relaxed: it publishes no data), so peers waiting
// for it in phase 2 fail at once naming this rank (kErrMismatch) instead of at their deadline.
// Outputs of a failed call are unspecified (partly written).
//
// Safety of data reuse (two halves): rank j writes half p of my region for call s+2 only after
// passing phase 0 of call s+1, which needs my phase-0 flag of call s+1, raised after my call s
// finished. All reads are of the own region (peers push).
//
// Aliasing: out may alias x and residual_out may alias residual (a block overwrites out only
// for vectors whose x it or its owner-side counterpart already consumed, see phase ordering).
#pragma once
#include "lamport.cuh"
#include "rmsnorm.cuh"
#include "rmsnorm_regs.cuh"

namespace nvc {
namespace dev {

// Share / chunk bounds in 16-byte vectors (pure functions of nv, W, G: identical on all ranks).
NVC_HD size_t share_begin(size_t nv, int world, int o) { return nv * size_t(o) / size_t(world); }
NVC_HD void chunk_bounds(size_t nv, int world, int grid, int o, int b, size_t* begin,
                         size_t* end) {
  const size_t s0 = share_begin(nv, world, o), len = share_begin(nv, world, o + 1) - s0;
  *begin = s0 + len * size_t(b) / size_t(grid);
  *end = s0 + len * size_t(b + 1) / size_t(grid);
}
// Reduce-scatter slot size S.
NVC_HD size_t rs_slot_bytes(size_t max_message_bytes, int world) {
  return align_up((max_message_bytes + world - 1) / world, 256);
}

// What a two-shot block knows about its call.
struct TwoShotCtx {
  const char* x;
  char* out;
  char* my_half;   // own data half of this call
  char* mc_half;   // multicast address of the same half (multicast variant only)
  size_t nv;
  size_t slot;     // S
  size_t ag;       // offset of the all-gather zone in a half (W * S)
  int me, world, grid, block;
};

// Copy vectors [a, e) with kU loads in flight per thread: dst(i) receives f(load(i)).
template <int kU, class Ld, class St>
__device__ __forceinline__ void block_stream(size_t a, size_t e, Ld&& ld, St&& st) {
  for (size_t i0 = a + threadIdx.x; i0 < e; i0 += size_t(kArThreads) * kU) {
    uint4 d[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t i = i0 + size_t(u) * kArThreads;
      if (i < e) d[u] = ld(i);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t i = i0 + size_t(u) * kArThreads;
      if (i < e) st(i, d[u]);
    }
  }
}

// Unicast transport: peers' halves through the mapped buffers, s_half[r] = half of rank r.
struct TwoShotUnicast {
  static constexpr bool kOwnDirect = true;  // plain: own share written straight to out

  template <typename T>
  __device__ static void scatter(const TwoShotCtx& c, char* const* s_half) {
    int o = c.me;
    for (int n = 1; n < c.world; ++n) {
      o = (o + 1 == c.world) ? 0 : o + 1;
      size_t a, e;
      chunk_bounds(c.nv, c.world, c.grid, o, c.block, &a, &e);
      char* dst = s_half[o] + size_t(c.me) * c.slot;
      const size_t sb = share_begin(c.nv, c.world, o);
      block_stream<4>(
          a, e, [&](size_t i) { return sanitize_v4<T>(ld_nc_v4(c.x + i * 16)); },
          [&](size_t i, const uint4& d) { st_v4(dst + (i - sb) * 16, d); });
    }
  }

  template <typename T, int kChunk>
  __device__ static uint4 reduce(const TwoShotCtx& c, char* const* /*s_half*/, size_t i) {
    float acc[Vec<T>::kElems];
    const char* p0 = c.my_half + (i - share_begin(c.nv, c.world, c.me)) * 16;
    for (int s0 = 0; s0 < c.world; s0 += kChunk) {
      uint4 d[kChunk];
#pragma unroll
      for (int q = 0; q < kChunk; ++q) {
        const int j = s0 + q;
        if (j < c.world)
          d[q] = j == c.me ? sanitize_v4<T>(ld_nc_v4(c.x + i * 16))
                           : ld_cg_v4(p0 + size_t(j) * c.slot);
      }
#pragma unroll
      for (int q = 0; q < kChunk; ++q)
        if (s0 + q < c.world) accumulate<T>(acc, d[q], s0 + q == 0);
    }
    return pack<T>(acc);
  }

  __device__ static void gather(const TwoShotCtx& c, char* const* s_half, size_t i,
                                const uint4& s, bool plain) {
    int r = c.me;
    for (int n = 0; n < c.world; ++n) {
      r = (r + 1 == c.world) ? 0 : r + 1;
      if (plain && r == c.me)
        st_v4(c.out + i * 16, s);
      else
        st_v4(s_half[r] + c.ag + i * 16, s);
    }
  }
};

// A phase-0 wait that failed (its block leaves): raise the POISON flag of call seq as this
// block's phase-1 flag at every peer (see the header), then record the error (fail). Out of line,
// everything computed inside from the kernel's __grid_constant__ v (a reference copies nothing).
static __device__ __noinline__ void twoshot_leave_phase0(const CommView& v, uint32_t code,
                                                         uint32_t desc, int peer, uint64_t seq,
                                                         uint64_t seen) {
  const uint64_t f = make_flag(seq, kPoisonDesc);
  for (int r = 0; r < v.world; ++r)
    if (r != v.rank) st_relaxed_sys(&v.peer_ctrl(r)->flags[seq & 1][1][v.rank][blockIdx.x], f);
  record_failure_inline(&v.ctrl()->failed, v.err, v.rank, code, desc, peer, seq, seen);
}

// wait_flag for phase 0: on failure, twoshot_leave_phase0 instead of fail (the same call site).
__device__ __forceinline__ bool twoshot_wait_phase0(const uint64_t* flag, uint64_t seq,
                                                    uint32_t desc, const CommView& v, int peer,
                                                    uint64_t deadline) {
  uint64_t seen = 0;
  const uint32_t code = poll_flag(v, flag, seq, desc, deadline, &seen);
  if (code == kErrNone) return true;
  twoshot_leave_phase0(v, code, desc, peer, seq, seen);
  return false;
}

template <typename T, bool kFused, class Policy, bool kQuant = false, bool kWf32 = false>
__device__ __forceinline__ void twoshot_body(const CommView& v, const ArTensors& t,
                                             const RowCfg& rc, uint32_t desc, char* mc) {
  constexpr int kChunk = 8;  // slot loads in flight
  __shared__ char* s_half[kMaxWorld];
  __shared__ float s_red[kEpiPairs * kArThreads / 32];
  extern __shared__ float4 s_dyn[];  // fused epilogue rows (rmsnorm_smem_bytes)

  probe(0);
  const uint64_t seq = call_seq(v);
  const bool dead = comm_failed(v);
  const int p = int(seq & 1);
  const uint64_t flag = make_flag(seq, desc);
  Ctrl* ctrl = v.ctrl();
  const int me = v.rank, W = v.world, b = blockIdx.x;
  const size_t nv = size_t(t.tokens) * size_t(t.hidden) / Vec<T>::kElems;
  const bool too_big = nv * 16 > v.max_message_bytes;
  if (too_big && !dead && b == 0 && threadIdx.x == 0) fail(v, kErrCapacity, desc, -1, seq, nv * 16);
  const uint64_t deadline = globaltimer() + v.timeout_ns;
  if (threadIdx.x < W) s_half[threadIdx.x] = v.half(threadIdx.x, seq);

  TwoShotCtx c;
  c.x = static_cast<const char*>(t.x);
  c.out = static_cast<char*>(t.out);
  c.my_half = v.half(me, seq);
  c.mc_half = mc == nullptr ? nullptr : mc + (c.my_half - v.bufs[me]);
  c.nv = nv;
  c.slot = rs_slot_bytes(v.max_message_bytes, W);
  c.ag = c.slot * size_t(W);
  c.me = me;
  c.world = W;
  c.grid = gridDim.x;
  c.block = b;
  if (__syncthreads_or(dead || too_big)) return;
  const uint32_t ticket = threadIdx.x == 0 ? arrive_issue(&ctrl->done_blocks) : 0u;  // the end
  probe(12);

  // Phase 0: reduce-scatter.
  Policy::template scatter<T>(c, s_half);
  probe(7);
  __syncthreads();
  bool ok = true;
  if (threadIdx.x < W && int(threadIdx.x) != me) {
    publish_flag(&v.peer_ctrl(threadIdx.x)->flags[p][0][me][b], flag);
    ok = twoshot_wait_phase0(&ctrl->flags[p][0][threadIdx.x][b], seq, desc, v, threadIdx.x,
                             deadline);
  }
  if (__syncthreads_or(!ok)) return;

  probe(8);
  // Phase 1: reduce own chunk, all-gather it.
  {
    size_t a, e;
    chunk_bounds(nv, W, gridDim.x, me, b, &a, &e);
    for (size_t i = a + threadIdx.x; i < e; i += kArThreads)
      Policy::gather(c, s_half, i, Policy::template reduce<T, kChunk>(c, s_half, i), !kFused);
  }
  __syncthreads();
  if (threadIdx.x < W) publish_flag(&v.peer_ctrl(threadIdx.x)->flags[p][1][me][b], flag);
  probe(9);

  // Phase 2.
  const char* ag = c.my_half + c.ag;
  if constexpr (!kFused) {
    if (threadIdx.x < W && !(Policy::kOwnDirect && int(threadIdx.x) == me))
      ok = wait_flag(&ctrl->flags[p][1][threadIdx.x][b], seq, desc, v, threadIdx.x, deadline);
    if (__syncthreads_or(!ok)) return;
    for (int o = 0; o < W; ++o) {
      if (Policy::kOwnDirect && o == me) continue;
      size_t a, e;
      chunk_bounds(nv, W, gridDim.x, o, b, &a, &e);
      block_stream<4>(
          a, e, [&](size_t i) { return ld_cg_v4(ag + i * 16); },
          [&](size_t i, const uint4& d) { st_v4(c.out + i * 16, d); });
    }
  } else {
    const int64_t rb = t.tokens * b / gridDim.x;
    const int64_t re = t.tokens * (b + 1) / gridDim.x;
    const size_t vs = size_t(rb) * rc.nvr, ve = size_t(re) * rc.nvr;
    for (int q = threadIdx.x; q < W * int(gridDim.x); q += kArThreads) {
      const int o = q / gridDim.x, bb = q % gridDim.x;
      size_t a, e;
      chunk_bounds(nv, W, gridDim.x, o, bb, &a, &e);
      if (ok && a < e && a < ve && e > vs)
        ok = wait_flag(&ctrl->flags[p][1][o][bb], seq, desc, v, o, deadline);
    }
    if (__syncthreads_or(!ok)) return;
    probe(10);
    if (rows_regs_ok<kRowVecsIn512>(rc))  // rows held in registers (rmsnorm_regs.cuh)
      rmsnorm_rows_regs<T, kQuant, kWf32, kArThreads / kRowThreads, kRowVecsIn512, false, false>(
          t, rc, rb, re, kArThreads / kRowThreads, [&](size_t i) { return ld_cg_v4(ag + i * 16); });
    else
      rmsnorm_rows<T, kQuant, kWf32>(t, rc, rb, re, s_red, s_dyn,
                                     [&](size_t i) { return ld_cg_v4(ag + i * 16); });
  }
  probe(11);
  // Every block read seq before taking its ticket: the last one advances Ctrl::seq (its atomic
  // was issued at the start, so no round trip waits here).
  if (threadIdx.x == 0 && arrive_is_last(&ctrl->done_blocks, ticket))
    *reinterpret_cast<volatile uint64_t*>(&ctrl->seq) = seq;
}

template <typename T, bool kFused, bool kQuant = false, bool kWf32 = false>
__global__ void __launch_bounds__(kArThreads, 1)
    twoshot_kernel(const __grid_constant__ CommView v, const __grid_constant__ ArTensors t,
                   RowCfg rc, uint32_t desc) {
  twoshot_body<T, kFused, TwoShotUnicast, kQuant, kWf32>(v, t, rc, desc, nullptr);
}

}  // namespace dev
}  // namespace nvc
