// All-gather over the flag protocol (push model).
//
// Layout: call s uses data half p = s & 1 of every rank's buffer; inside it, source rank `src`
// owns the slot at offset src * slot_bytes, slot_bytes = align_up(ceil(M / W), 256) (the
// reduce-scatter zone of layout.h), which holds the source's whole input (n <= M / W bytes).
//
// Protocol, grid of G blocks identical on every rank (G a pure function of n):
//   block b owns bytes [b * chunk, min(n, (b + 1) * chunk)) of every rank's input.
//   1. copy my chunk b into slot[me] of half p of every peer (16-byte stores over NVLink) and
//      straight into out[me] locally;
//   2. __syncthreads; thread 0: fence.acq_rel.sys, then flags[p][0][me][b] = make_flag(s, desc)
//      in every peer;
//   3. for every peer src: thread 0 waits for flags[p][0][src][b] == make_flag(s, desc) in my
//      Ctrl (bounded); then the block copies slot[src] chunk b of my half p into out[src];
//   4. finish_call: the last block advances Ctrl::seq to s.
// Invariants: G <= kMaxBlocks; every rank waits for every peer each call (so two halves
// suffice, see layout.h); descriptors carry n so ranks calling with other sizes are reported.
// Failure (common.cuh): a block of a failed communicator leaves at its start; a failed wait
// (recorded, or Ctrl::failed set elsewhere) makes the block leave at the __syncthreads_or after
// it, before copying from that source. out is then partly written (unspecified).
#pragma once
#include "common.cuh"

namespace nvc {
namespace dev {

__device__ __forceinline__ void copy_range(char* dst, const char* src, size_t begin, size_t end,
                                           bool coherent_src) {
  const bool aligned = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                         begin) & 15u) == 0;
  size_t i = begin;
  if (aligned) {
    const size_t vend = begin + (end - begin) / 16 * 16;
    for (size_t o = begin + size_t(threadIdx.x) * 16; o < vend; o += size_t(blockDim.x) * 16) {
      uint4 val = coherent_src ? ld_cg_v4(src + o) : *reinterpret_cast<const uint4*>(src + o);
      st_v4(dst + o, val);
    }
    i = vend;
  }
  for (size_t o = i + threadIdx.x; o < end; o += blockDim.x) {
    dst[o] = coherent_src ? static_cast<char>(__ldcg(reinterpret_cast<const signed char*>(src + o)))
                          : src[o];
  }
}

__global__ void __launch_bounds__(512) all_gather_kernel(CommView v, const char* in, char* out,
                                                         size_t n, size_t slot_bytes,
                                                         size_t chunk, uint32_t desc) {
  const uint64_t seq = call_seq(v);
  if (__syncthreads_or(comm_failed(v))) return;
  const uint64_t p = seq & 1;
  const int b = blockIdx.x;
  const size_t begin = size_t(b) * chunk;
  const size_t end = begin + chunk < n ? begin + chunk : n;
  const uint64_t deadline = globaltimer() + v.timeout_ns;
  const uint64_t flag = make_flag(seq, desc);

  // 1. push my chunk to every peer, and locally to out[me].
  for (int i = 1; i < v.world; ++i) {
    const int r = (v.rank + i) % v.world;
    if (begin < end) copy_range(v.half(r, p) + size_t(v.rank) * slot_bytes, in, begin, end, false);
  }
  if (begin < end) copy_range(out + size_t(v.rank) * n, in, begin, end, false);
  // 2. publish.
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    for (int i = 1; i < v.world; ++i) {
      const int r = (v.rank + i) % v.world;
      st_relaxed_sys(&v.peer_ctrl(r)->flags[p][0][v.rank][b], flag);
    }
  }
  // 3. receive.
  for (int i = 1; i < v.world; ++i) {
    const int src = (v.rank + v.world - i) % v.world;
    const bool ok =
        threadIdx.x != 0 || wait_flag(&v.ctrl()->flags[p][0][src][b], seq, desc, v, src, deadline);
    if (__syncthreads_or(!ok)) return;
    if (begin < end)
      copy_range(out + size_t(src) * n, v.half(v.rank, p) + size_t(src) * slot_bytes, begin, end,
                 true);
  }
  finish_call(v, seq);
}

}  // namespace dev
}  // namespace nvc
