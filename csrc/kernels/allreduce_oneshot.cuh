// One-shot all-reduce (Lamport protocol), optionally fused with residual add + RMSNorm (and, with
// kQuant, the FP8 output of rmsnorm.cuh: out is then e4m3fn bytes plus float32 row scales).
//
// Buffer layout (per rank, see layout.h): three rotating Lamport buffers, each W slots of
// L = CommView::lamport_slot bytes; slot [src] of buffer b in rank r's region receives src's
// message: CommView::lamport(r, b, src). A message (tokens * hidden * sizeof(T) bytes, in 16-byte
// vectors) must fit one slot; the host API refuses larger ones and the kernel reports
// kErrCapacity if one gets through.
//
// Call k = Ctrl::lamport_seq + 1 on rank `me` (every block reads the counters at its start,
// after requesting its first input vectors):
//   1. push: every 16-byte vector of x is sanitised (-0.0 -> +0.0, lamport.cuh) and stored to
//      slot [me] of buffer k % 3 of every rank, itself included (unicast: W stores; multicast:
//      one multimem.st). Vectors are spread over all blocks of the grid.
//   2. clear: buffer (k - 1) % 3 of this rank's own region (W slots x Ctrl::lamport_bytes, the
//      size the previous call wrote) is reset to 0x80000000 words. Done while peers' data is in
//      flight.
//   3. the block holding the last arrival ticket (taken by every block after reading the
//      counters, common.cuh arrive_issue) stores lamport_bytes = this call's bytes and
//      lamport_seq = k, while the peers' data is in flight: nothing on the kernel's tail.
//   4. reduce: poll the W slots of own buffer k % 3 (volatile 16-byte loads, every 32-bit word
//      compared with the sentinel as raw bits, deadline from %globaltimer -> kErrTimeout), sum in
//      float32 in rank order 0..W-1 (rmsnorm.cuh), write T(sum) or run the fused epilogue. Fused:
//      block b owns rows [tokens*b/G, tokens*(b+1)/G) so each row's reduction stays in a block.
//
// Why three buffers suffice: a peer writes buffer (k+1) % 3 of my region only in its call k+1,
// i.e. after it consumed my call-k push, which I issued after finishing call k-1, whose step 2
// cleared exactly that buffer (= (k-2) % 3). It cannot reach call k+2 (buffer (k-1) % 3, which I
// clear in call k) before consuming my push of call k+1. I only ever read my own region.
// Ordering between the clear (in an earlier kernel) and a peer's later stores relies on kernel
// boundaries, as every Lamport implementation does.
//
// Aliasing: out may alias x and residual_out may alias residual: an output vector is written
// only after this rank's own pushed copy of every input vector it depends on has been observed
// in its own slot, i.e. after the input was read.
//
// Grid: any number of blocks (identical on every rank), all co-resident: blocks poll data pushed
// by other blocks of the same rank.
#pragma once
#include "lamport.cuh"
#include "rmsnorm.cuh"

namespace nvc {
namespace dev {

// Unicast push: W plain 16-byte stores.
struct OneShotUnicast {
  // s_dst[r] = destination slot base in rank r; called by threads < world.
  __device__ static void setup(const CommView& v, char* /*mc*/, int cur, char** s_dst) {
    s_dst[threadIdx.x] = v.lamport(threadIdx.x, cur, v.rank);
  }
  __device__ static void push(const CommView& v, char* const* s_dst, size_t i, const uint4& d) {
    int r = v.rank;
    for (int n = 0; n < v.world; ++n) {  // start with the next rank: spread the traffic
      r = (r + 1 == v.world) ? 0 : r + 1;
      st_v4(s_dst[r] + i * 16, d);
    }
  }
};

// Poll the W slots of the nv <= kN vectors i[0..nv) (slot stride L) and write their T-packed
// rank-order sums to out[0..nv). Loads kChunk slots of every vector at once (all issued before
// any check); while any word of them is still empty, reloads them all (polls are local). A
// vector's sum is the same float32 additions in rank order whatever kN, kChunk and nv are.
template <typename T, int kChunk, int kN>
__device__ __forceinline__ void lamport_sum_vecs(const CommView& v, const char* slot0,
                                                 const size_t (&i)[kN], int nv, uint64_t k,
                                                 uint32_t desc, uint64_t deadline,
                                                 uint4 (&out)[kN]) {
  float acc[kN][Vec<T>::kElems];
  for (int s0 = 0; s0 < v.world; s0 += kChunk) {
    const int n = v.world - s0 < kChunk ? v.world - s0 : kChunk;
    uint4 d[kN][kChunk];
    bool empty;
    do {
      empty = false;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        if (j < nv) {
          const char* p = slot0 + i[j] * 16 + size_t(s0) * v.lamport_slot;
#pragma unroll
          for (int c = 0; c < kChunk; ++c) {
            if (c < n) {
              d[j][c] = ld_volatile_v4(p + size_t(c) * v.lamport_slot);
              empty |= lamport_any_empty(d[j][c]);
            }
          }
        }
      }
      if (empty && globaltimer() > deadline) {  // report the first rank still missing
        int c = 0;
        auto missing = [&](int cc) {
          bool m = false;
#pragma unroll
          for (int j = 0; j < kN; ++j) m |= j < nv && lamport_any_empty(d[j][cc]);
          return m;
        };
        while (c + 1 < n && !missing(c)) ++c;
        fail(v.err, kErrTimeout, desc, v.rank, s0 + c, k, 0);
      }
    } while (empty);
#pragma unroll
    for (int j = 0; j < kN; ++j)
#pragma unroll
      for (int c = 0; c < kChunk; ++c)
        if (j < nv && c < n) accumulate<T>(acc[j], d[j][c], s0 + c == 0);
  }
#pragma unroll
  for (int j = 0; j < kN; ++j)
    if (j < nv) out[j] = pack<T>(acc[j]);
}

// The T-packed rank-order sum of vector i (lamport_sum_vecs for one vector).
template <typename T, int kChunk>
__device__ __forceinline__ uint4 lamport_sum_v4(const CommView& v, const char* slot0, size_t i,
                                                uint64_t k, uint32_t desc, uint64_t deadline) {
  const size_t idx[1] = {i};
  uint4 out[1];
  lamport_sum_vecs<T, kChunk>(v, slot0, idx, 1, k, desc, deadline, out);
  return out[0];
}

// The call's number, deadline and own receive buffer (this rank's slots of buffer k % 3).
struct OneShotCall {
  uint64_t k;
  uint64_t deadline;
  const char* slot0;
};

// Steps 1-3 of a call over the whole grid (blocks of kThreads threads; the cluster-split
// kernel, allreduce_oneshot_cluster.cuh, shares them): push x to every rank's slot, clear the
// previous call's own buffer, advance the counters. s_dst: kMaxWorld pointers of shared memory.
template <typename T, class Policy, int kThreads>
__device__ __forceinline__ OneShotCall oneshot_exchange(const CommView& v, const ArTensors& t,
                                                        uint32_t desc, char* mc, char** s_dst) {
  constexpr int kU = 4;  // input vectors in flight per thread
  probe(0);
  const size_t nv = size_t(t.tokens) * size_t(t.hidden) / Vec<T>::kElems;
  const size_t bytes = nv * 16;
  const size_t tid = size_t(blockIdx.x) * kThreads + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * kThreads;
  // This thread's first kU input vectors are requested before the counters: neither depends on
  // the other, so the two load latencies overlap instead of adding up.
  const char* x = static_cast<const char*>(t.x);
  uint4 d0[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const size_t i = tid + u * nthreads;
    if (i < nv) d0[u] = ld_nc_v4(x + i * 16);
  }
  Ctrl* ctrl = v.ctrl();
  const uint64_t k = *reinterpret_cast<volatile uint64_t*>(&ctrl->lamport_seq) + 1;
  const size_t prev_bytes = *reinterpret_cast<volatile uint64_t*>(&ctrl->lamport_bytes);
  const int cur = int(k % 3), prv = int((k + 2) % 3);
  if (bytes > v.lamport_slot || prev_bytes > v.lamport_slot)
    fail(v.err, kErrCapacity, desc, v.rank, -1, k, bytes);
  const uint64_t deadline = globaltimer() + v.timeout_ns;

  if (threadIdx.x < v.world) Policy::setup(v, mc, cur, s_dst);
  __syncthreads();
  const uint32_t ticket = threadIdx.x == 0 ? arrive_issue(&ctrl->done_blocks) : 0u;  // step 3
  probe(12);

  // 1. push
  for (size_t i0 = tid; i0 < nv; i0 += nthreads * kU) {
    uint4 d[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t i = i0 + u * nthreads;
      if (i < nv) d[u] = sanitize_v4<T>(i0 == tid ? d0[u] : ld_nc_v4(x + i * 16));
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t i = i0 + u * nthreads;
      if (i < nv) Policy::push(v, s_dst, i, d[u]);
    }
  }

  probe(1);
  // 2. clear the previous call's buffer of the own region
  {
    const uint32_t nvp = uint32_t(prev_bytes / 16);
    const uint32_t total = nvp * uint32_t(v.world);
    char* base = v.lamport(v.rank, prv, 0);
    for (uint32_t i = uint32_t(tid); i < total; i += uint32_t(nthreads)) {
      const uint32_t s = i / nvp;
      st_v4(base + size_t(s) * v.lamport_slot + size_t(i - s * nvp) * 16, lamport_empty_v4());
    }
  }

  // 3. advance the counters: every block read them before its arrival (issued after the
  // first __syncthreads), so the block with the last ticket stores this call's values now, while
  // the peers' data is in flight, instead of on the kernel's tail (arrive_issue, common.cuh).
  if (threadIdx.x == 0 && arrive_is_last(&ctrl->done_blocks, ticket)) {
    *reinterpret_cast<volatile uint64_t*>(&ctrl->lamport_bytes) = bytes;
    *reinterpret_cast<volatile uint64_t*>(&ctrl->lamport_seq) = k;
  }
  return OneShotCall{k, deadline, v.lamport(v.rank, cur, 0)};
}

template <typename T, bool kFused, class Policy, bool kQuant = false>
__device__ __forceinline__ void oneshot_body(const CommView& v, const ArTensors& t,
                                             const RowCfg& rc, uint32_t desc, char* mc) {
  constexpr int kChunk = kFused ? 4 : 8;  // slot loads in flight (x kEpiPairs when fused)
  __shared__ char* s_dst[kMaxWorld];
  __shared__ float s_red[kEpiPairs * kArThreads / 32];
  extern __shared__ float4 s_dyn[];  // fused epilogue rows (rmsnorm_smem_bytes)

  const OneShotCall call = oneshot_exchange<T, Policy, kArThreads>(v, t, desc, mc, s_dst);
  const uint64_t k = call.k, deadline = call.deadline;
  probe(2);
  // 4. reduce
  const char* slot0 = call.slot0;
  if constexpr (!kFused) {
    const size_t nv = size_t(t.tokens) * size_t(t.hidden) / Vec<T>::kElems;
    const size_t nthreads = size_t(gridDim.x) * kArThreads;
    char* out = static_cast<char*>(t.out);
    for (size_t i = size_t(blockIdx.x) * kArThreads + threadIdx.x; i < nv; i += nthreads)
      st_v4(out + i * 16, lamport_sum_v4<T, kChunk>(v, slot0, i, k, desc, deadline));
  } else {
    const int64_t rb = t.tokens * blockIdx.x / gridDim.x;
    const int64_t re = t.tokens * (blockIdx.x + 1) / gridDim.x;
    rmsnorm_rows<T, kQuant>(t, rc, rb, re, s_red, s_dyn, [&](size_t i) {
      return lamport_sum_v4<T, kChunk>(v, slot0, i, k, desc, deadline);
    });
  }

  probe(6);
}

template <typename T, bool kFused, bool kQuant = false>
__global__ void __launch_bounds__(kArThreads, 1)
    oneshot_kernel(const __grid_constant__ CommView v, const __grid_constant__ ArTensors t,
                   RowCfg rc, uint32_t desc) {
  oneshot_body<T, kFused, OneShotUnicast, kQuant>(v, t, rc, desc, nullptr);
}

}  // namespace dev
}  // namespace nvc
