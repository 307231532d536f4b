// MoE dispatch / combine of a one-rank communicator (world 1), fused calls: one kernel each, no
// data slot, no flags. Layout, handle and invariants: common/moe_layout.h; the halves this
// replaces at world 1: moe_dispatch.cuh / moe_combine.cuh.
//
// Why: at world 1 a fused call's SEND writes every token into this rank's own slot and its RECV
// copies it out again (dispatch), or the SEND copies every expert row into a landing row that
// the RECV reads back (combine), with a flag exchange and a grid-wide wait in between. Here the
// rows go straight from x to expert_x, and the combine reads expert_y's rows where they are.
//
// Used by cuda/moe.cu for moe_dispatch / moe_combine when world == 1, the call is one round
// (moe_dispatch_rounds / moe_combine_rounds == 1) and the routing's shared memory fits
// (local_fits): otherwise the fused two-half kernels. Split calls (moe_*_send / moe_*_recv)
// always take the two-half kernels: a RECV of its own has no x / expert_y.
//
// ROUTING (every block, redundantly, no grid-wide dependency: moe_route.cuh route_masks): the
// block reads the ids of every token (dispatch: topk_ids of t < num_tokens; combine: token_dest,
// -1 past num_tokens) into bit masks per expert, pre = exclusive prefix of the per-expert counts.
// A token's index in expert e is idx(t, e) = route_idx: the number of earlier tokens routed to
// e, exactly the (source rank, token) order of the two-half protocol at world 1. Its row:
// packed pre[e] + idx, padded e * T + idx (the expert_x / expert_y row the two-half kernels
// use), so the results are bitwise those of the two-half kernels.
// dispatch: work items (token t < n, chunk of 32 * u vectors, u = cols_per_lane) over every
//   warp of the grid; lanes k < top_k hold the token's ids; each lane loads its u vectors of x[t]
//   and stores them to the token's rows (k order); the chunk-0 warp also writes the handle
//   (token_dest, expert_src = t * K + k) and the scales. token_dest rows >= n: -1; block 0 writes
//   expert_counts.
// combine: work items (token t < T, chunk) as combine_recv_body's; the token's valid slots in k
//   order, their weights and rows; the columns summed by combine_sum_columns (moe_combine.cuh:
//   fma in k order from +0.0f, rounded once), the rows read from expert_y itself.
// Counters: s = send_seq + 1 (begin_send: in-flight check), checked against Ctrl::seq + 1 as a
//   fused RECV (kErrOrder); the block with the last arrival ticket (send_done_blocks) stores
//   send_seq = s and then Ctrl::seq = s: the two halves' counters advance as a fused call's.
// Failure (as the two-half kernels', recorded with the same codes; no poison is needed at world
// 1 but the same poison_and_fail is used): num_tokens outside [0, T] (kErrCapacity), an id
// outside [-1, E) or repeated in a row (kErrBadExpert; a repeat shows as a mask bit already
// set): every block sees it in the routing, before any write, and leaves. Combine: expert_counts
// outside [0, T] or, packed, summing past the packed rows (kErrCapacity, before any read
// through them); a token_dest entry outside [-1, E) (kErrBadExpert); counts that disagree with
// token_dest, or an expert_src entry that does not name (t, k) (a handle not of this
// dispatch: kErrCapacity). Rows are only addressed from the masks, so every address stays inside
// expert_x / expert_y whatever the input.
#pragma once
#include "moe_combine.cuh"

namespace nvc {
namespace moe {

// Dynamic shared memory of both kernels: the routing's mask [E][words], pre [E + 1].
__host__ __device__ inline size_t local_smem(const MoeConfig& c) { return route_smem(c); }
inline bool local_fits(const MoeConfig& c) { return c.world == 1 && local_smem(c) <= kRouteMaxSmem; }

// SEND and RECV counters at once: s (0 when refused: failed communicator, kErrInFlight, or
// kErrOrder when split SENDs are outstanding), the same in every thread.
__device__ __forceinline__ uint64_t begin_local(const CommView& v, const MoeConfig& c, uint32_t desc) {
  const uint64_t s = begin_send(v, c, desc, nullptr);
  if (s == 0) return 0;
  const uint64_t next = recvs_done(v) + 1;
  if (next == s) return s;
  if (blockIdx.x == 0 && threadIdx.x == 0) dev::fail_inline(v, kErrOrder, desc, -1, s, next);
  return 0;
}
// The last block (ticket of send_done_blocks, taken after every block read both counters):
// send_seq = s, then Ctrl::seq = s.
__device__ __forceinline__ void finish_local(const CommView& v, uint64_t s, uint32_t ticket) {
  MoeCtrl* mc = moe_ctrl(v.bufs[v.rank]);
  if (threadIdx.x == 0 && dev::arrive_is_last(&mc->send_done_blocks, ticket)) {
    *reinterpret_cast<volatile uint64_t*>(&mc->send_seq) = s;
    *reinterpret_cast<volatile uint64_t*>(&v.ctrl()->seq) = s;
  }
}

// ---- dispatch ----------------------------------------------------------------------------------
__device__ __forceinline__ void dispatch_local_body(const CommView& v, const MoeConfig& c,
                                                    const DispatchSendArgs& sa,
                                                    const DispatchRecvArgs& ra) {
  extern __shared__ int32_t smem[];
  const int E = c.num_experts, K = c.top_k, T = c.max_tokens, nw = route_words(c);
  uint32_t* mask = reinterpret_cast<uint32_t*>(smem);  // [E][nw]
  int32_t* pre = smem + E * nw;                          // [E + 1]
  __shared__ RouteBad s_bad;
  __shared__ size_t s_row[kWarps][32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, b = blockIdx.x, G = gridDim.x;
  const uint32_t desc = moe_dispatch_desc(c);
  dev::probe(0);
  const int n = sa.num_tokens ? __ldg(sa.num_tokens) : T;
  const uint64_t s = begin_local(v, c, desc);
  const bool bad_n = n < 0 || n > T;  // the same in every block
  if (__syncthreads_or(s == 0 || bad_n)) {
    if (s != 0 && tid == 0) poison_and_fail(v, c, s, kErrCapacity, desc, n, uint64_t(T));
    return;
  }
  const uint32_t ticket = send_ticket(v);  // after the barrier: every block read both counters
  dev::probe(1);
  const size_t xrow = moe_x_row_bytes(c), erows = moe_expert_rows(c);
  const int nvec = int(xrow / 16), S = c.scale_cols;
  const int cw = 32 * cols_per_lane(n, nvec, G), nch = (nvec + cw - 1) / cw;
  const int first = b * kWarps + warp;  // this warp's first work item
  uint4 val[kCopyU];
  auto load_x = [&](int item) {  // the item's payload vectors of this lane
    const int t = item / nch, ch = item - t * nch, i0 = ch * cw + lane, iend = min(nvec, (ch + 1) * cw);
    const uint8_t* xr = sa.x + size_t(t) * xrow;
#pragma unroll
    for (int u = 0; u < kCopyU; ++u)
      if (i0 + 32 * u < iend) val[u] = ld_nc_v4(xr + size_t(i0 + 32 * u) * 16);
  };
  if (first < n * nch) load_x(first);  // requested before the routing: its address needs n only
  route_masks(sa.ids, n, E, K, nw, mask, pre, s_bad);
  if (s_bad.flag) {  // block-uniform (after the routing's barriers)
    if (tid == 0) poison_and_fail(v, c, s, kErrBadExpert, desc, s_bad.val,
                                  bad_expert_detail(s_bad.tok, s_bad.slot, s_bad.rep != 0));
    return;
  }
  dev::probe(2);
  if (b == 0)
    for (int e = tid; e < E; e += blockDim.x) ra.expert_counts[e] = pre[e + 1] - pre[e];
  for (size_t i = size_t(n) * K + size_t(b) * blockDim.x + tid; i < size_t(T) * K; i += size_t(G) * blockDim.x)
    sa.token_dest[i] = -1;

  for (int item = first; item < n * nch; item += G * kWarps) {
    const int t = item / nch, ch = item - t * nch;
    const int e = lane < K ? __ldg(sa.ids + size_t(t) * K + lane) : -1;  // checked in the routing
    const int i0 = ch * cw + lane, iend = min(nvec, (ch + 1) * cw);
    if (item != first) load_x(item);
    const uint32_t bal = __ballot_sync(0xFFFFFFFFu, e >= 0);
    const int m = __popc(bal);
    if (e >= 0) {
      const int idx = route_idx(mask, nw, e, t);
      const size_t er = size_t(e) * erows + idx;
      s_row[warp][__popc(bal & lanemask_lt())] = ra.packed ? size_t(pre[e]) + idx : er;
      if (ch == 0) ra.expert_src[er] = t * K + lane;
    }
    if (ch == 0 && lane < K) sa.token_dest[size_t(t) * K + lane] = e;
    __syncwarp();
#pragma unroll
    for (int u = 0; u < kCopyU; ++u) {
      const int i = i0 + 32 * u;
      if (i < iend)
        for (int j = 0; j < m; ++j)
          dev::st_v4(reinterpret_cast<char*>(ra.expert_x + s_row[warp][j] * xrow) + size_t(i) * 16,
                     val[u]);
    }
    for (int i = lane; ch == 0 && i < S; i += 32) {
      const float f = __ldg(sa.x_scale + size_t(t) * S + i);
      for (int j = 0; j < m; ++j) ra.expert_x_scale[s_row[warp][j] * S + i] = f;
    }
    __syncwarp();
  }
  dev::probe(7);
  finish_local(v, s, ticket);
}

__global__ void __launch_bounds__(kMoeThreads, 1) dispatch_local_kernel(CommView v, MoeConfig c,
                                                                  DispatchSendArgs sa,
                                                                  DispatchRecvArgs ra) {
  dispatch_local_body(v, c, sa, ra);
}

// ---- combine -----------------------------------------------------------------------------------
template <int YT>
__device__ __forceinline__ void combine_local_body(const CommView& v, const MoeConfig& c,
                                                   const CombineSendArgs& sa,
                                                   const CombineRecvArgs& ra) {
  extern __shared__ int32_t smem[];
  const int E = c.num_experts, K = c.top_k, T = c.max_tokens, nw = route_words(c);
  uint32_t* mask = reinterpret_cast<uint32_t*>(smem);  // [E][nw]
  int32_t* pre = smem + E * nw;                          // [E + 1]
  __shared__ RouteBad s_bad;
  __shared__ int s_cbad;
  __shared__ const char* s_rowp[kWarps][32];
  __shared__ float s_w[kWarps][32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, b = blockIdx.x, G = gridDim.x;
  const uint32_t desc = moe_combine_desc(c, YT);
  dev::probe(0);
  const uint64_t s = begin_local(v, c, desc);
  const int64_t erows = int64_t(moe_expert_rows(c));
  if (tid == 0) s_cbad = -1;
  if (__syncthreads_or(s == 0)) return;
  const uint32_t ticket = send_ticket(v);
  // expert_counts as the two-half SEND checks them
  for (int e = tid; e < E; e += blockDim.x) {
    const int x = __ldg(sa.expert_counts + e);
    if (x < 0 || x > erows) s_cbad = e;
  }
  route_masks(ra.token_dest, T, E, K, nw, mask, pre, s_bad);  // its barriers cover s_cbad
  if (s_cbad >= 0) {
    if (tid == 0) poison_and_fail(v, c, s, kErrCapacity, desc, s_cbad,
                                  uint64_t(__ldg(sa.expert_counts + s_cbad)));
    return;
  }
  if (s_bad.flag) {  // a token_dest entry out of range (or repeated: not a handle of a dispatch)
    if (tid == 0) {
      if (s_bad.rep) poison_and_fail(v, c, s, kErrCapacity, desc, s_bad.val, bad_expert_detail(s_bad.tok, s_bad.slot, true));
      else poison_and_fail(v, c, s, kErrBadExpert, desc, s_bad.val, bad_expert_detail(s_bad.tok, s_bad.slot, false));
    }
    return;
  }
  // the counts the handle's token_dest gives must be expert_counts (else: another dispatch's)
  bool mism = false;
  for (int e = tid; e < E; e += blockDim.x) mism |= pre[e + 1] - pre[e] != __ldg(sa.expert_counts + e);
  if (__syncthreads_or(mism)) {
    if (tid == 0) poison_and_fail(v, c, s, kErrCapacity, desc, E, uint64_t(uint32_t(pre[E])));
    return;
  }
  dev::probe(8);

  const size_t yrow = moe_y_row_bytes(c, YT);
  const int nvec = int(yrow / 16);
  const int cw = 32 * cols_per_lane(T, nvec, G), nch = (nvec + cw - 1) / cw;
  for (int item = b * kWarps + warp; item < T * nch; item += G * kWarps) {
    const int t = item / nch, ch = item - t * nch;
    const int e = lane < K ? __ldg(ra.token_dest + size_t(t) * K + lane) : -1;  // checked
    const uint32_t bal = __ballot_sync(0xFFFFFFFFu, e >= 0);
    const int m = __popc(bal);
    bool bad = false;
    if (e >= 0) {
      const int idx = route_idx(mask, nw, e, t);
      const int64_t er = int64_t(e) * erows + idx;
      const int slot = __ldg(sa.expert_src + er);
      if (slot != t * K + lane) {  // the handle's rows are not this token's: not one dispatch's
        dev::fail_inline(v, kErrCapacity, desc, e, s, uint64_t(uint32_t(slot)));
        bad = true;
      }
      const int q = __popc(bal & lanemask_lt());
      s_rowp[warp][q] = reinterpret_cast<const char*>(sa.expert_y) +
                        size_t(sa.packed ? int64_t(pre[e]) + idx : er) * yrow;
      s_w[warp][q] = __ldg(ra.weights + size_t(t) * K + lane);
    }
    if (__any_sync(0xFFFFFFFFu, bad)) continue;  // y's row unspecified (the call failed)
    __syncwarp();
    combine_sum_columns<YT>(ch * cw + lane, min(nvec, (ch + 1) * cw), m,
                            [&](int j) { return s_rowp[warp][j]; },
                            [&](const void* p) { return ld_nc_v4(p); },
                            [&](int j) { return s_w[warp][j]; }, ra.y + size_t(t) * yrow);
    __syncwarp();
  }
  dev::probe(12);
  finish_local(v, s, ticket);
}

template <int YT>
__global__ void __launch_bounds__(kMoeThreads) combine_local_kernel(CommView v, MoeConfig c,
                                                                 CombineSendArgs sa,
                                                                 CombineRecvArgs ra) {
  combine_local_body<YT>(v, c, sa, ra);
}

}  // namespace moe
}  // namespace nvc
