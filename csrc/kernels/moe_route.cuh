// Bit-mask routing of one rank's tokens, for the MoE kernels that route every token in every
// block (no grid-wide dependency): the world-1 kernels (moe_local.cuh) and the dispatch SEND
// (moe_dispatch.cuh, whole calls whose masks fit shared memory).
//
// route_masks: the block reads the ids of rows [0, rows) ([T, K], -1 = no expert) into masks
// mask[e][t / 32] (bit t % 32: token t routes to expert e; shared atomicOr), then pre = the
// exclusive prefix of the per-expert counts (popcounts). route_idx(e, t) = the popcount of e's
// bits below t: the tokens before t routed to e, which is the protocol's idx (moe_layout.h: the
// number of earlier tokens of the source routed to that expert); the same masks ORed over a
// rank's experts give the protocol's row position of a token in that destination. Integer
// counts of a fixed set: the results do not depend on the order of the atomics.
// Checks: an id outside [-1, E), or an id repeated within a row (its bit already set when the
// atomicOr returns), sets RouteBad (the first such entry of the block); every block sees every
// entry, so every block can leave before it writes.
#pragma once
#include <cstdint>

#include "../common/moe_layout.h"
#include "common.cuh"

namespace nvc {
namespace moe {

// 32-bit words of one expert's token mask.
NVC_HD int route_words(const MoeConfig& c) { return (c.max_tokens + 31) / 32; }
// Shared memory of route_masks: mask [E][words], pre [E + 1].
__host__ __device__ inline size_t route_smem(const MoeConfig& c) {
  return 4 * (size_t(c.num_experts) * route_words(c) + size_t(c.num_experts) + 1);
}
// The most dynamic shared memory a routing kernel takes (no opt-in attribute below 48 KiB,
// static shared memory aside); configs above it keep the kernels that count instead.
constexpr size_t kRouteMaxSmem = 40 * 1024;

// pre[i] = v[0] + ... + v[i-1] for i in [0, n] (n <= 2^31 in sum): every thread of the block
// (blockDim.x == kMoeThreads) calls it; per-thread segments, warp 0 scans the partials. Ends
// with a barrier (pre is then visible to the whole block). pre may be v itself (in place).
__device__ __forceinline__ void block_exclusive_scan(const int32_t* v, int32_t* pre, int n) {
  __shared__ int32_t s_part[kMoeThreads];
  const int tid = threadIdx.x, lane = tid & 31;
  const int per = (n + kMoeThreads - 1) / kMoeThreads, lo = min(tid * per, n), hi = min(lo + per, n);
  int sum = 0;
  for (int i = lo; i < hi; ++i) sum += v[i];
  s_part[tid] = sum;
  __syncthreads();
  if (tid < 32) {
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
    if (lane == 31) pre[n] = inc;
  }
  __syncthreads();
  int acc = s_part[tid];
  for (int i = lo; i < hi; ++i) { const int x = v[i]; pre[i] = acc; acc += x; }
  __syncthreads();
}

// Shared results of the routing's checks (first bad entry of the block).
struct RouteBad {
  int flag, val, tok, slot, rep;
};

// The routing of the rows [0, rows) of ids ([T, K]): masks, then pre = exclusive prefix of the
// per-expert counts (pre[E] = the total). Every thread; ends with a barrier. An entry outside
// [-1, E) or a repeat within a row sets bad (bad.rep = 1 for a repeat); the masks are then
// incomplete (the caller leaves).
__device__ __forceinline__ void route_masks(const int32_t* ids, int rows, int E, int K, int nw,
                                            uint32_t* mask, int32_t* pre, RouteBad& bad) {
  const int tid = threadIdx.x;
  for (int i = tid; i < E * nw; i += blockDim.x) mask[i] = 0u;
  if (tid == 0) bad.flag = 0;
  __syncthreads();
  constexpr int kU = 8;  // ids requested together
  const int total = rows * K;
  for (int i0 = tid; i0 < total; i0 += kU * kMoeThreads) {
    int ev[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = i0 + u * kMoeThreads;
      ev[u] = i < total ? __ldg(ids + i) : -1;
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int i = i0 + u * kMoeThreads, e = ev[u];
      if (e == -1) continue;
      const int t = i / K;
      bool rep = false;
      if (e >= 0 && e < E) {
        const uint32_t bit = 1u << (t & 31);
        rep = (atomicOr(&mask[e * nw + (t >> 5)], bit) & bit) != 0u;
        if (!rep) continue;
      }
      if (atomicExch(&bad.flag, 1) == 0) {
        bad.val = e; bad.tok = t; bad.slot = i - t * K; bad.rep = rep;
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {
    int n = 0;
    for (int w = 0; w < nw; ++w) n += __popc(mask[e * nw + w]);
    pre[e] = n;
  }
  __syncthreads();
  block_exclusive_scan(pre, pre, E);
}

// idx(t, e): earlier tokens routed to e.
__device__ __forceinline__ int route_idx(const uint32_t* mask, int nw, int e, int t) {
  const uint32_t* m = mask + e * nw;
  int n = __popc(m[t >> 5] & ((1u << (t & 31)) - 1u));
  for (int w = 0; w < (t >> 5); ++w) n += __popc(m[w]);
  return n;
}

}  // namespace moe
}  // namespace nvc
