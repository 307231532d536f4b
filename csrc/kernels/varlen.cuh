// Variable-length all-gather (all_gather_v) and reduce-scatter (reduce_scatter_v) over the flag
// protocol (push model), for data-parallel attention in front of a tensor-parallel layer: each
// rank holds num_rows <= max_rows rows (a traced count, read from device memory).
//
// Buffer layout: csrc/common/varlen_layout.h (data half p = seq & 1: a 256-byte header of int32
// counts, one per source, then W slots of S = align256(max_rows * row_bytes) bytes).
// Flags: Ctrl::flags[p][0][src][b] in the receiver's control block, make_flag(seq, desc) with
// desc = op kind + static sizes (max_rows, row_bytes): never the counts, which may differ per
// rank and per call. Grid: G blocks on every rank, G a pure function of the static sizes.
//
// all_gather_v, call s on rank `me`, block b (n = *num_rows, validated in [0, max_rows]):
//   1. for every peer r: copy my rows [n*b/G, n*(b+1)/G) into slot[me] of r's half p, and (thread
//      0) header[me] = n there; __syncthreads; thread 0: fence.acq_rel.sys, then
//      flags[p][0][me][b] = make_flag(s, desc) in every peer. One phase: the rows go out before
//      anyone knows the offsets; the receiver places them (it copies its half to `out` anyway,
//      since XLA's output buffer is not symmetric).
//   2. for src = 0 .. W-1 in rank order: offset(src) = sum of the counts of ranks < src. src == me:
//      copy my rows [n*b/G, n*(b+1)/G) straight from the input to out[offset(me) + ...]. Else
//      thread 0 waits for flags[p][0][src][b] (bounded) and reads header[src] (the count src
//      published with that very flag); the block copies src's rows [c*b/G, c*(b+1)/G) from
//      slot[src] of my half p to out[offset(src) + ...].
//   3. block 0 writes offsets[0..W] and total; with zero_tail (the default of the Python op)
//      every block zeroes its share of the rows past the total (API.md leaves them unspecified;
//      zeros keep NaN garbage out of gradients that a caller computes over the whole buffer);
//      finish_call advances Ctrl::seq.
// reduce_scatter_v, call s on rank `me`, block b (offsets read from device memory; validated:
// offsets[0] == 0, every count in [0, max_rows], else every flag of this rank is poisoned and
// the call fails naming the rank and count):
//   1. for every peer r: copy rows [c_r*b/G, c_r*(b+1)/G) of segment r of y (rows offsets[r] ..
//      offsets[r+1]) into slot[me] of r's half p, header[me] = c_r there (my view of r's count);
//      publish flags[p][0][me][b] at every peer.
//   2. wait for flags[p][0][src][b] of every peer; check header[src] == c_me (ranks that passed
//      other offsets are reported, kErrOffsetsDiffer); then for my rows [c_me*b/G, ..) sum in
//      float32 in rank order 0..W-1 starting from +0.0 (my own part read straight from y), round
//      to T once, store to out; zero out's rows [c_me + (max_rows - c_me)*b/G, ...).
//   3. finish_call.
// Invariants: every call waits for every peer (two halves suffice, layout.h); a rank writes only
// its own slot and header entry of a peer's half; G <= kMaxBlocks; every wait has the
// communicator's deadline and reports the peer (timeout, disagreement, peer ahead, poisoned).
// Failure (common.cuh): blocks of a failed communicator leave at their start; a rank with a bad
// count poisons its flags at every peer, records and leaves before pushing anything (every
// block alike: the count is the same for all); a failed wait or a bad header (recorded, or
// Ctrl::failed set elsewhere) makes the block leave at the __syncthreads_or after it, before
// reading that source. Outputs of a failed call are unspecified (partly written).
#pragma once
#include "common.cuh"
#include "../common/varlen_layout.h"

namespace nvc {
namespace dev {

constexpr int kVarlenThreads = 512;

// Zero bytes [begin, end) of dst with the block (16-byte stores where aligned).
__device__ __forceinline__ void varlen_zero(char* dst, size_t begin, size_t end) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(dst);
  size_t a = ((base + begin + 15) & ~uintptr_t(15)) - base;  // first 16-byte aligned offset
  if (a > end) a = end;
  for (size_t o = begin + threadIdx.x; o < a; o += blockDim.x) dst[o] = 0;
  const size_t vend = a + (end - a) / 16 * 16;
  for (size_t o = a + size_t(threadIdx.x) * 16; o < vend; o += size_t(blockDim.x) * 16)
    st_v4(dst + o, make_uint4(0, 0, 0, 0));
  for (size_t o = vend + threadIdx.x; o < end; o += blockDim.x) dst[o] = 0;
}

__device__ __forceinline__ uint64_t count_detail(int64_t count, int64_t max_rows) {
  return uint64_t(uint32_t(int32_t(count))) | (uint64_t(uint32_t(max_rows)) << 32);
}

__global__ void __launch_bounds__(kVarlenThreads) all_gather_v_kernel(
    CommView v, const char* in, const int32_t* num_rows, char* out, int32_t* offsets_out,
    int32_t* total_out, int64_t max_rows, size_t row_bytes, size_t slot_bytes, uint32_t desc,
    bool zero_tail) {
  __shared__ int32_t s_cnt[kMaxWorld];
  const uint64_t seq = call_seq(v);
  const uint64_t p = seq & 1;
  const int b = blockIdx.x, G = gridDim.x;
  const uint64_t deadline = globaltimer() + v.timeout_ns;
  const int64_t n = __ldg(num_rows);
  const bool bad = n < 0 || n > max_rows;  // the same in every block
  if (__syncthreads_or(comm_failed(v) || bad)) {
    if (bad && b == 0 && threadIdx.x == 0 && !comm_failed(v))
      poison_fail(v, seq, G, kVarlenPoisonDesc, kErrRowCount, desc, v.rank,
                  count_detail(n, max_rows));
    return;
  }
  const size_t r0 = size_t(varlen_split(n, G, b)) * row_bytes;
  const size_t r1 = size_t(varlen_split(n, G, b + 1)) * row_bytes;

  // 1. push my rows (and my count) to every peer, publish.
  for (int i = 1; i < v.world; ++i) {
    const int r = (v.rank + i) % v.world;
    char* h = v.half(r, p);
    if (r0 < r1) block_copy<false>(varlen_slot(h, v.rank, slot_bytes) + r0, in + r0, r1 - r0);
    if (threadIdx.x == 0) varlen_header(h)[v.rank] = int32_t(n);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    const uint64_t flag = make_flag(seq, desc);
    for (int i = 1; i < v.world; ++i) {
      const int r = (v.rank + i) % v.world;
      st_relaxed_sys(&v.peer_ctrl(r)->flags[p][0][v.rank][b], flag);
    }
  }
  // 2. place every source's rows at its offset, in rank order.
  char* mine = v.half(v.rank, p);
  int64_t off = 0;
  for (int src = 0; src < v.world; ++src) {
    int64_t c;
    if (src == v.rank) {
      c = n;
      if (r0 < r1) block_copy<false>(out + size_t(off) * row_bytes + r0, in + r0, r1 - r0);
    } else {
      bool ok = true;
      if (threadIdx.x == 0) {
        ok = wait_flag(&v.ctrl()->flags[p][0][src][b], seq, desc, v, src, deadline);
        const int32_t got = ok ? __ldcg(varlen_header(mine) + src) : 0;
        if (got < 0 || got > max_rows) {  // the sender validated it: memory corruption
          fail(v, kErrRowCount, desc, src, seq, count_detail(got, max_rows));
          ok = false;
        }
        s_cnt[src] = got;
      }
      if (__syncthreads_or(!ok)) return;
      c = s_cnt[src];
      const size_t a = size_t(varlen_split(c, G, b)) * row_bytes;
      const size_t e = size_t(varlen_split(c, G, b + 1)) * row_bytes;
      if (a < e)
        block_copy<true>(out + size_t(off) * row_bytes + a, varlen_slot(mine, src, slot_bytes) + a,
                         e - a);
    }
    if (b == 0 && threadIdx.x == 0) offsets_out[src] = int32_t(off);
    off += c;
  }
  if (b == 0 && threadIdx.x == 0) {
    offsets_out[v.world] = int32_t(off);
    *total_out = int32_t(off);
  }
  // rows past the total: zeros (API.md leaves them unspecified; garbage there would reach
  // weight gradients as NaN * 0 through whatever the caller computes on the whole buffer).
  const int64_t cap = int64_t(v.world) * max_rows;
  const size_t za = size_t(off + varlen_split(cap - off, G, b)) * row_bytes;
  const size_t ze = size_t(off + varlen_split(cap - off, G, b + 1)) * row_bytes;
  if (zero_tail) varlen_zero(out, za, ze);
  finish_call(v, seq);
}

template <typename T>
__global__ void __launch_bounds__(kVarlenThreads) reduce_scatter_v_kernel(
    CommView v, const char* y, const int32_t* offsets, char* out, int64_t max_rows,
    size_t row_bytes, size_t slot_bytes, uint32_t desc) {
  __shared__ int32_t s_off[kMaxWorld + 1];
  __shared__ int s_bad;
  const uint64_t seq = call_seq(v);
  const uint64_t p = seq & 1;
  const int b = blockIdx.x, G = gridDim.x, W = v.world, me = v.rank;
  const uint64_t deadline = globaltimer() + v.timeout_ns;
  if (threadIdx.x <= W) s_off[threadIdx.x] = __ldg(offsets + threadIdx.x);
  if (threadIdx.x == 0) s_bad = -1;
  if (__syncthreads_or(comm_failed(v))) return;
  if (threadIdx.x == 0) {
    // offsets[0] == 0 and every count in [0, max_rows] bound every offset by W * max_rows.
    for (int r = 0; r < W && s_bad < 0; ++r) {
      const int64_t c = int64_t(s_off[r + 1]) - s_off[r];
      if ((r == 0 && s_off[0] != 0) || c < 0 || c > max_rows) s_bad = r;
    }
    if (s_bad >= 0 && b == 0)  // every block finds it; one poisons and records
      poison_fail(v, seq, G, kVarlenPoisonDesc, kErrRowCount, desc, s_bad,
                  count_detail(int64_t(s_off[s_bad + 1]) - s_off[s_bad], max_rows));
  }
  __syncthreads();
  if (s_bad >= 0) return;  // the same in every thread and block (the offsets are)

  // 1. push segment r (my partial results for rank r's rows) to slot[me] of rank r.
  for (int i = 1; i < W; ++i) {
    const int r = (me + i) % W;
    const int64_t c = int64_t(s_off[r + 1]) - s_off[r];
    const size_t a = size_t(varlen_split(c, G, b)) * row_bytes;
    const size_t e = size_t(varlen_split(c, G, b + 1)) * row_bytes;
    char* h = v.half(r, p);
    if (a < e)
      block_copy<false>(varlen_slot(h, me, slot_bytes) + a, y + size_t(s_off[r]) * row_bytes + a,
                        e - a);
    if (threadIdx.x == 0) varlen_header(h)[me] = int32_t(c);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    const uint64_t flag = make_flag(seq, desc);
    for (int i = 1; i < W; ++i)
      st_relaxed_sys(&v.peer_ctrl((me + i) % W)->flags[p][0][me][b], flag);
  }
  // 2. wait for every peer's part of my rows, check they agree on my count, sum in rank order.
  const int64_t cme = int64_t(s_off[me + 1]) - s_off[me];
  char* mine = v.half(me, p);
  bool ok = true;
  if (threadIdx.x < W && int(threadIdx.x) != me) {
    const int src = threadIdx.x;
    ok = wait_flag(&v.ctrl()->flags[p][0][src][b], seq, desc, v, src, deadline);
    const int32_t got = ok ? __ldcg(varlen_header(mine) + src) : int32_t(cme);
    if (got != cme) {
      fail(v, kErrOffsetsDiffer, desc, src, seq,
           uint64_t(uint32_t(got)) | (uint64_t(uint32_t(int32_t(cme))) << 32));
      ok = false;
    }
  }
  if (__syncthreads_or(!ok)) return;
  const size_t vpr = row_bytes / 16;  // row_bytes % 16 == 0 (checked at launch)
  const size_t va = size_t(varlen_split(cme, G, b)) * vpr;
  const size_t ve = size_t(varlen_split(cme, G, b + 1)) * vpr;
  const char* own = y + size_t(s_off[me]) * row_bytes;
  for (size_t i = va + threadIdx.x; i < ve; i += kVarlenThreads) {
    float acc[Vec<T>::kElems];
#pragma unroll
    for (int k = 0; k < Vec<T>::kElems; ++k) acc[k] = 0.0f;
    for (int src = 0; src < W; ++src) {
      const uint4 d = src == me ? ld_nc_v4(own + i * 16)
                                : ld_cg_v4(varlen_slot(mine, src, slot_bytes) + i * 16);
      float f[Vec<T>::kElems];
      unpack<T>(d, f);
#pragma unroll
      for (int k = 0; k < Vec<T>::kElems; ++k) acc[k] += f[k];
    }
    st_v4(out + i * 16, pack<T>(acc));
  }
  // zero the rows past my count
  varlen_zero(out, size_t(cme + varlen_split(max_rows - cme, G, b)) * row_bytes,
              size_t(cme + varlen_split(max_rows - cme, G, b + 1)) * row_bytes);
  finish_call(v, seq);
}

}  // namespace dev
}  // namespace nvc
