// MoE combine kernels: SEND (expert side) and RECV (token side) halves of one call.
// Layout, handle and invariants: common/moe_layout.h. Flag conventions: kernels/common.cuh.
//
// Both kernels: grid G = moe_grid_blocks(cfg, cap) x kMoeThreads, all blocks resident; flags and
// flag groups as moe_dispatch.cuh's (W x moe_blocks(cfg) flags per call whatever G).
// A fused call (moe_combine) runs both halves in one cooperative kernel (combine_kernel), or
// as the two kernels where ranks of one process share a GPU and their grids do not fit on
// it together (cuda/moe.cu fused_fits). At world 1 a fused call is one kernel that reads
// expert_y's rows where they are instead (moe_local.cuh), when its routing fits shared memory.
//
// SEND: each block computes pre[e] = prefix of expert_counts (block scan); one warp per expert
//   row g (grid-stride over all sum(counts) rows): e = last expert with pre[e] <= g, i = g-pre[e],
//   slot = expert_src[e][i] = (src*T + t)*K + k (range-checked); copies the row of expert_y
//   (16-B vectors, H * sizeof(y) bytes) into landing[t*K + k] of rank src's data slot of call s;
//   the row's first 32 * kCopyU vectors are requested together with its slot. Packed expert_y
//   (moe_layout.h PACKED EXPERT ROWS): the data row is row g itself; expert_src stays [e][i].
//   Packed whole calls request their first row (row b * kWarps + warp, inside the packed array
//   whatever the counts) before the counts' scan. Each landing slot has exactly one writer.
//   Then every block publishes (publish_all: its flag moe_flag(s, me, b) in every rank, or
//   through its flag group when G > moe_blocks). Call numbering and the in-flight / order
//   checks: moe_dispatch.cuh.
// RECV: waits for every rank's flags (bounded), then one warp per (token t < T, chunk of
//   32 * u columns, u = cols_per_lane (moe_dispatch.cuh): the rows spread over all the grid's
//   lanes, so at decode sizes a row's columns go to several warps): the valid k of
//   token_dest[t] (in k order) and their weights go to shared memory; each lane owns 16-B
//   columns and accumulates acc = fmaf(w_k, float(row_k), acc) for k ascending, starting from
//   +0.0f, rounds once to the y dtype (RNE). Rows with no valid slot (t >= num_tokens) are zero.
//   Loads of kCombU slots x 2 columns are issued together, their FMAs then run in k order per
//   column (same bits).
//   The conversions are moe_layout.h's, shared with the host protocol: bitwise-equal results.
//   The handle and weights of each warp's first item are loaded before the wait. The block with
//   the last arrival ticket advances Ctrl::seq (finish_recv, moe_dispatch.cuh).
// Failure: as moe_dispatch.cuh's. SEND: bad expert_counts (found after a barrier) poison and
//   leave as dispatch's bad ids do; a bad expert_src entry (kErrCapacity) makes its warp record,
//   poison and skip the row, and its block then leaves instead of publishing (publish_all's
//   vote), so the block's flag stays poison. RECV: a token_dest entry out of range
//   (kErrBadExpert, recorded) makes its warp skip the token (y's row unspecified).
// Bounded slots (moe_layout.h BOUNDED SLOTS): a call is rounds, each a combine_send_rounds_kernel
// then a combine_recv_rounds_kernel (the kRounds bodies; the round's tokens [round_lo,
// round_lo + round_tokens) are kernel parameters): SEND reads the slots of 32 rows per warp at
// once and copies only the rows whose token is in the round, to landing row (t - round_lo) * K
// + k; RECV sums the round's tokens. The whole-call kernels are the unbounded layout's, unchanged.
#pragma once
#include "moe_dispatch.cuh"

namespace nvc {
namespace moe {

struct CombineSendArgs {
  const uint8_t* expert_y;       // [L, W*T, H] of y_dtype, or packed [P, H] (moe_layout.h)
  const int32_t* expert_src;     // handle [L, W*T]
  const int32_t* expert_counts;  // [L]
  int y_dtype;
  uint32_t* seq_out;             // split: the call's seq, for the RECV (scalar); null when fused
  bool packed = false;           // expert_y in the packed form
  // Bounded slots: this round's destination tokens [round_lo, round_lo + round_tokens)
  // (combine_round_args); round_tokens 0: unbounded, every token (the one round).
  int round_lo = 0, round_tokens = 0;
};

// The round fields (round_lo, round_tokens) of round r, for both halves' arguments: kernel
// parameters, so the loops read them from the constant bank instead of holding registers.
template <class Args>
inline void combine_round_args(const MoeConfig& c, int y_dtype, int r, Args* a) {
  if (!moe_bounded(c)) { a->round_lo = 0; a->round_tokens = 0; return; }
  const int Tc = moe_combine_round_tokens(c, y_dtype);
  a->round_lo = r * Tc;
  a->round_tokens = Tc < c.max_tokens - a->round_lo ? Tc : c.max_tokens - a->round_lo;
}

__host__ __device__ inline size_t combine_send_smem(const MoeConfig& c) {
  return 4 * (size_t(moe_local_experts(c)) + 1);
}

// The SEND half, every thread of the block; returns the call's s, or 0 (every thread alike)
// when the call failed or was refused here: the block then publishes nothing and leaves.
// kRounds: a round of a bounded call (a.round_tokens > 0; its own kernel, so the one-kernel
// fused call keeps its registers); else the whole call.
template <bool kRounds = false>
__device__ __forceinline__ uint64_t combine_send_body(const CommView& v, const MoeConfig& c,
                                                      const CombineSendArgs& a) {
  extern __shared__ int32_t pre[];  // [L + 1]
  __shared__ int32_t s_part[kMoeThreads];
  __shared__ int s_bad;
  const int K = c.top_k, W = c.world, T = c.max_tokens, L = moe_local_experts(c);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, b = blockIdx.x, G = gridDim.x;
  const uint32_t desc = moe_combine_desc(c, a.y_dtype);
  dev::probe(0);
  const uint64_t s = begin_send(v, c, desc, a.seq_out);
  const int64_t erows = int64_t(W) * T;
  const size_t yrow = moe_y_row_bytes(c, a.y_dtype);
  const int nvec = int(yrow / 16);
  // Packed whole calls: this warp's first row is row g0 of expert_y whatever the counts, so its
  // first 32 * kCopyU vectors are requested before the counts' scan (g0 < the packed rows: inside
  // the array; used only if g0 < the total).
  const int g0 = b * kWarps + warp;
  const bool pf = !kRounds && a.packed && int64_t(g0) < int64_t(moe_packed_rows(c));
  uint4 val[kCopyU];
  if (pf) {
#pragma unroll
    for (int u = 0; u < kCopyU; ++u)
      if (lane + 32 * u < nvec) val[u] = ld_nc_v4(a.expert_y + size_t(g0) * yrow + size_t(lane + 32 * u) * 16);
  }

  // pre = exclusive prefix of counts: per-thread segments, then warp 0 scans the partials.
  if (tid == 0) s_bad = -1;
  if (__syncthreads_or(s == 0)) return 0;
  const int per = (L + blockDim.x - 1) / blockDim.x, lo = min(tid * per, L), hi = min(lo + per, L);
  int sum = 0;
  for (int i = lo; i < hi; ++i) {
    const int x = __ldg(a.expert_counts + i);
    if (x < 0 || x > erows) s_bad = i;
    sum += x;
  }
  s_part[tid] = sum;
  __syncthreads();
  if (warp == 0) {
    constexpr int kPer = kMoeThreads / 32;
    int loc[kPer], tot = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) { loc[j] = s_part[lane * kPer + j]; tot += loc[j]; }
    int inc = tot;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int y = __shfl_up_sync(0xFFFFFFFFu, inc, d);
      if (lane >= d) inc += y;
    }
    int acc = inc - tot;
#pragma unroll
    for (int j = 0; j < kPer; ++j) { s_part[lane * kPer + j] = acc; acc += loc[j]; }
    if (lane == 31) pre[L] = inc;
  }
  __syncthreads();
  if (s_bad >= 0) {
    if (tid == 0) poison_and_fail(v, c, s, kErrCapacity, desc, s_bad, uint64_t(__ldg(a.expert_counts + s_bad)));
    return 0;
  }
  {
    int acc = s_part[tid];
    for (int i = lo; i < hi; ++i) { pre[i] = acc; acc += __ldg(a.expert_counts + i); }
  }
  __syncthreads();

  dev::probe(8);
  const int total = pre[L];
  if (a.packed && int64_t(total) > int64_t(moe_packed_rows(c))) {  // would read past expert_y
    if (tid == 0) poison_and_fail(v, c, s, kErrCapacity, desc, L, uint64_t(uint32_t(total)));
    return 0;
  }
  const int64_t slots = int64_t(T) * K;
  bool bad_slot = false;  // this warp found a bad expert_src entry: the block must not publish
  if constexpr (kRounds) {
    // Only this round's destination tokens. The warp reads the slots of 32 rows at once (one
    // per lane: the walk over every row of the call in every round costs a load latency per
    // 32 rows, not per row), then copies the rows of the round among them, one after another
    // (landing rows are relative to the round; each has one writer). Lane l of warp w takes
    // row g0 + l * nw + w, so consecutive rows (an expert's rows of one round lie together)
    // spread over the warps as in the whole-call walk.
    const int qlo = a.round_lo * K, qn = a.round_tokens * K, nw = G * kWarps;
    for (int g0 = 0; g0 < total; g0 += 32 * nw) {
      const int g = g0 + lane * nw + b * kWarps + warp;
      int slot = 0, l = 0;
      bool in = false, bad = false;
      if (g < total) {
        int h = L - 1;  // last e with pre[e] <= g
        while (l < h) {
          const int mid = (l + h + 1) >> 1;
          if (pre[mid] <= g) l = mid; else h = mid - 1;
        }
        slot = __ldg(a.expert_src + int64_t(l) * erows + (g - pre[l]));
        bad = slot < 0 || slot >= W * slots;
        const int q = bad ? -1 : int(slot % slots) - qlo;
        in = q >= 0 && q < qn;
      }
      const uint32_t badm = __ballot_sync(0xFFFFFFFFu, bad);
      if (badm != 0) {  // recorded once, the row skipped; the block must not publish
        if (lane == __ffs(badm) - 1)
          poison_and_fail(v, c, s, kErrCapacity, desc, l, uint64_t(uint32_t(slot)));
        bad_slot = true;
      }
      for (uint32_t inm = __ballot_sync(0xFFFFFFFFu, in); inm != 0; inm &= inm - 1) {
        const int j = __ffs(inm) - 1;
        const int gj = __shfl_sync(0xFFFFFFFFu, g, j), sj = __shfl_sync(0xFFFFFFFFu, slot, j);
        const int src = int(sj / slots);
        int64_t row = gj;  // packed: row gj itself; else (e, i) of it (the search again: smem)
        if (!a.packed) {
          int le = 0, h = L - 1;
          while (le < h) {
            const int mid = (le + h + 1) >> 1;
            if (pre[mid] <= gj) le = mid; else h = mid - 1;
          }
          row = int64_t(le) * erows + (gj - pre[le]);
        }
        const uint8_t* yr = a.expert_y + size_t(row) * yrow;
        char* dst = moe_landing(moe_half(v.bufs[src], c, s), c, a.y_dtype,
                                size_t(int(sj - src * slots) - qlo));
        warp_copy(0, nvec, lane, 1, [&](int i) { return ld_nc_v4(yr + size_t(i) * 16); },
                  [&](int) { return dst; });
      }
    }
  } else {
    for (int g = b * kWarps + warp; g < total; g += G * kWarps) {
      int l = 0, h = L - 1;  // last e with pre[e] <= g
      while (l < h) {
        const int mid = (l + h + 1) >> 1;
        if (pre[mid] <= g) l = mid; else h = mid - 1;
      }
      const int64_t er = int64_t(l) * erows + (g - pre[l]);
      const uint8_t* yr = a.expert_y + size_t(a.packed ? int64_t(g) : er) * yrow;
      if (!(pf && g == g0)) {  // the row's first 32 * kCopyU vectors, requested with its slot
#pragma unroll
        for (int u = 0; u < kCopyU; ++u)
          if (lane + 32 * u < nvec) val[u] = ld_nc_v4(yr + size_t(lane + 32 * u) * 16);
      }
      const int slot = __ldg(a.expert_src + er);
      if (slot < 0 || slot >= W * slots) {  // the same in every lane: the warp skips the row
        if (lane == 0) poison_and_fail(v, c, s, kErrCapacity, desc, l, uint64_t(uint32_t(slot)));
        bad_slot = true;
        continue;
      }
      const int src = int(slot / slots);
      char* dst = moe_landing(moe_half(v.bufs[src], c, s), c, a.y_dtype, size_t(slot - src * slots));
#pragma unroll
      for (int u = 0; u < kCopyU; ++u)
        if (lane + 32 * u < nvec) dev::st_v4(dst + size_t(lane + 32 * u) * 16, val[u]);
      warp_copy(32 * kCopyU, nvec, lane, 1, [&](int i) { return ld_nc_v4(yr + size_t(i) * 16); },
                [&](int) { return dst; });
    }
  }
  dev::probe(9);
  const uint32_t ticket = send_ticket(v);  // its round trip overlaps publish_all's release
  if (!publish_all(v, c, s, desc, bad_slot)) return 0;
  finish_send(v, s, ticket);
  dev::probe(10);
  return s;
}

__global__ void __launch_bounds__(kMoeThreads) combine_send_kernel(CommView v, MoeConfig c, CombineSendArgs a) {
  combine_send_body(v, c, a);
}
__global__ void __launch_bounds__(kMoeThreads) combine_send_rounds_kernel(CommView v, MoeConfig c,
                                                                       CombineSendArgs a) {
  combine_send_body<true>(v, c, a);
}

struct CombineRecvArgs {
  const float* weights;       // [T, K]
  const int32_t* token_dest;  // handle [T, K]
  uint8_t* y;                 // [T, H] of y_dtype
  const uint32_t* seq_in;     // split: the SEND's seq output; null when fused
  // Bounded slots: this round's tokens [round_lo, round_lo + round_tokens) (kernel parameters,
  // as CombineSendArgs'); round_tokens 0: unbounded, every token.
  int round_lo = 0, round_tokens = 0;
};

constexpr int kCombU = 8;  // landing slots' loads in flight per lane in the combine receive

// acc[q] = fmaf(w, float(element q of v), acc[q]) for the kElems elements of one 16-byte vector.
template <int YT>
__device__ __forceinline__ void combine_fma(float* acc, const uint4& v, float w) {
  constexpr int kElems = YT == kMoeF32 ? 4 : 8;
  const uint32_t* wd = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
  for (int q = 0; q < kElems; ++q) {
    const uint32_t bits = kElems == 4 ? wd[q] : (wd[q >> 1] >> (16 * (q & 1))) & 0xFFFFu;
    acc[q] = fmaf(w, moe_to_f32(bits, YT), acc[q]);
  }
}

// The kElems sums rounded to the y dtype (RNE), packed into one 16-byte vector.
template <int YT>
__device__ __forceinline__ uint4 combine_pack(const float* acc) {
  constexpr int kElems = YT == kMoeF32 ? 4 : 8;
  uint4 out;
  uint32_t* od = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int q = 0; q < 4; ++q)
    od[q] = kElems == 4 ? moe_from_f32(acc[q], YT)
                        : moe_from_f32(acc[2 * q], YT) | (moe_from_f32(acc[2 * q + 1], YT) << 16);
  return out;
}

// One lane's columns of one output row: for columns i = i0, i0 + 32, ... < iend (16-B vectors)
// out[i] = the y dtype of fma over j = 0..m-1 (k order) of w(j) * row(j)[i], from +0.0f. Two
// columns i and i + 32 per step: kCombU slots x 2 columns of loads in flight, then each
// column's FMAs in k order (the order of the sum and so the bits are those of one slot and one
// column at a time). row(j): the slot's row (char*), ld: the 16-B load for it.
template <int YT, class Row, class Ld, class Wt>
__device__ __forceinline__ void combine_sum_columns(int i0, int iend, int m, Row&& row, Ld&& ld,
                                                    Wt&& weight, uint8_t* out) {
  constexpr int kElems = YT == kMoeF32 ? 4 : 8;  // per 16-B vector
  for (int i = i0; i < iend; i += 64) {
    const bool two = i + 32 < iend;
    float acc0[kElems], acc1[kElems];
#pragma unroll
    for (int q = 0; q < kElems; ++q) acc0[q] = acc1[q] = 0.0f;
    for (int j0 = 0; j0 < m; j0 += kCombU) {
      uint4 v0[kCombU], v1[kCombU];
#pragma unroll
      for (int u = 0; u < kCombU; ++u) {
        if (j0 + u < m) {
          const char* base = row(j0 + u);
          v0[u] = ld(base + size_t(i) * 16);
          if (two) v1[u] = ld(base + size_t(i + 32) * 16);
        }
      }
#pragma unroll
      for (int u = 0; u < kCombU; ++u) {
        if (j0 + u < m) {
          const float w = weight(j0 + u);
          combine_fma<YT>(acc0, v0[u], w);
          if (two) combine_fma<YT>(acc1, v1[u], w);
        }
      }
    }
    dev::st_v4(out + size_t(i) * 16, combine_pack<YT>(acc0));
    if (two) dev::st_v4(out + size_t(i + 32) * 16, combine_pack<YT>(acc1));
  }
}

// The RECV half, every thread of the block. known_s: 0 = a kernel of its own (s from
// begin_recv); else the s of the SEND half that just ran in the same kernel (combine_kernel).
template <int YT, bool kRounds = false>
__device__ __forceinline__ void combine_recv_body(const CommView& v, const MoeConfig& c,
                                                  const CombineRecvArgs& a, uint64_t known_s) {
  __shared__ int s_k[kWarps][32];
  __shared__ float s_w[kWarps][32];
  const int E = c.num_experts, K = c.top_k, T = c.max_tokens;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, b = blockIdx.x, G = gridDim.x;
  const uint32_t desc = moe_combine_desc(c, YT);
  if (known_s == 0) dev::probe(0);
  const uint64_t s = known_s == 0 ? begin_recv(v, desc, a.seq_in) : begin_recv_fused(v, desc, known_s);
  const size_t yrow = moe_y_row_bytes(c, YT);
  const int nvec = int(yrow / 16);
  // kRounds: this round's tokens, Tr from lo on (else T from 0); landing rows are relative to
  // the round.
  const int Tr = kRounds ? a.round_tokens : T, lo = kRounds ? a.round_lo : 0;
  // work items (token t, chunk ch of cw = 32 * u columns) over every warp of the grid, u the
  // columns per lane that spread the Tr rows over all of the grid's lanes (at decode sizes a
  // row's columns go to several warps instead of one warp walking them)
  const int cw = 32 * cols_per_lane(Tr, nvec, G);
  const int nch = (nvec + cw - 1) / cw;
  // The handle and weights of this warp's first item are local inputs: requested before the
  // wait for the peers, so their latency hides behind it.
  // Staged in shared memory (each lane reads back its own entry), not registers: values live
  // across the wait would be spilled around its error call.
  __shared__ int s_e0[kWarps][32];
  __shared__ float s_w0[kWarps][32];
  {
    const int item = b * kWarps + warp;
    const bool has = item < Tr * nch && lane < K;
    const int t = lo + item / nch;
    s_e0[warp][lane] = has ? __ldg(a.token_dest + size_t(t) * K + lane) : -1;
    s_w0[warp][lane] = has ? __ldg(a.weights + size_t(t) * K + lane) : 0.f;
  }
  if (!wait_all_sources(v, c, s, desc, moe_blocks(c))) return;
  const uint32_t ticket = recv_ticket(v);
  dev::probe(11);

  char* half = moe_half(v.bufs[v.rank], c, s);
  for (int item = b * kWarps + warp; item < Tr * nch; item += G * kWarps) {
    const int tr = item / nch, ch = item - tr * nch, t = lo + tr;
    const bool first = item == b * kWarps + warp;
    const int e = first    ? s_e0[warp][lane]
                  : lane < K ? __ldg(a.token_dest + size_t(t) * K + lane)
                             : -1;
    const bool bad = e < -1 || e >= E;  // a corrupt handle: recorded, the token is skipped
    if (bad) dev::fail_inline(v, kErrBadExpert, desc, e, s, bad_expert_detail(t, lane, false));
    if (__any_sync(0xFFFFFFFFu, bad)) continue;
    const uint32_t bal = __ballot_sync(0xFFFFFFFFu, e >= 0);
    const int m = __popc(bal);
    if (e >= 0) {
      const int q = __popc(bal & lanemask_lt());
      s_k[warp][q] = lane;
      s_w[warp][q] = first ? s_w0[warp][lane] : __ldg(a.weights + size_t(t) * K + lane);
    }
    __syncwarp();
    combine_sum_columns<YT>(ch * cw + lane, min(nvec, (ch + 1) * cw), m,
                            [&](int j) -> const char* {
                              return moe_landing(half, c, YT, size_t(tr) * K + s_k[warp][j]);
                            },
                            [&](const void* p) { return dev::ld_cg_v4(p); },
                            [&](int j) { return s_w[warp][j]; }, a.y + size_t(t) * yrow);
    __syncwarp();
  }
  dev::probe(12);
  finish_recv(v, s, ticket);
}

template <int YT>
__global__ void __launch_bounds__(kMoeThreads) combine_recv_kernel(CommView v, MoeConfig c, CombineRecvArgs a) {
  combine_recv_body<YT>(v, c, a, 0);
}
template <int YT>
__global__ void __launch_bounds__(kMoeThreads) combine_recv_rounds_kernel(CommView v, MoeConfig c,
                                                                        CombineRecvArgs a) {
  combine_recv_body<YT, true>(v, c, a, 0);
}

// A fused combine in one kernel: the SEND half, then the RECV half of the same call (as
// dispatch_kernel: all blocks resident; dynamic shared memory combine_send_smem, the RECV half
// uses static shared memory only).
template <int YT>
__global__ void __launch_bounds__(kMoeThreads) combine_kernel(CommView v, MoeConfig c,
                                                              CombineSendArgs sa,
                                                              CombineRecvArgs ra) {
  const uint64_t s = combine_send_body(v, c, sa);
  if (s == 0) return;
  combine_recv_body<YT>(v, c, ra, s);
}

}  // namespace moe
}  // namespace nvc
