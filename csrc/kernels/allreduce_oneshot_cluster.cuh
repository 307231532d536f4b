// Fused one-shot all-reduce + residual add + RMSNorm with each row split over a thread-block
// cluster: the small-token-count variant of allreduce_oneshot.cuh (the kernel-latency work). Same Lamport
// protocol, buffers, counters and per-element arithmetic; only the mapping of a row to threads
// differs, and the reduction keeps its shape, so the results are bitwise those of the one-block
// epilogue (rmsnorm.cuh), hence of two-shot, world 1 and every token count.
//
// Applies to rows whose RowCfg has tpr == kArThreads and nr == 1 (more than kArThreads / 2
// vectors per row: hidden > 2048 for 16-bit types, > 1024 for f32; nr == 1 below 128 tokens)
// and at most kClMaxCols vectors per virtual lane (hidden <= 16384 for 16-bit types), unicast,
// plain or FP8 (kQuant) output. The host (allreduce.cu) picks it when every row gets a cluster
// of its own (tokens <= co-resident clusters of 4 blocks, then of 2 blocks, at most 64; see
// cuda/allreduce_cluster.h for JAX_NVCOMM_AR_CLUSTER): with rows queued per cluster the
// one-block epilogue was faster (measured: 64 tokens, clusters of 4).
//
// Grid: G = C * nclusters blocks of kClThreads = kArThreads / C threads, cluster dims (C, 1, 1),
// C = kClBlocks (4 or 2, a template parameter: the host takes 4 while every row fits a cluster
// of 4, else 2 unless turned off); identical on every rank; all blocks co-resident (the host caps
// nclusters by the occupancy API and the SM budget).
//
// Steps 1-4 (push, clear, counters, tag check) and the failure path (polls that give up yield
// NaN, so every cluster barrier is still met) are those of allreduce_oneshot.cuh over the
// G * kClThreads threads of the grid. Step 5, cluster c (of nclusters) owns rows c,
// c + nclusters, ...; block j of the cluster plays virtual lanes l = j * kClThreads +
// threadIdx.x of the row group of rmsnorm.cuh (tpr = kArThreads). The weight vectors of the
// lane's columns are loaded into registers before the first row (every row uses the same
// columns); a float32 weight (kWf32, an instantiation of its own) is read per row in pass 2
// instead (from L1).
//   pass 1: lane l polls columns l, l + kArThreads, ... of the row two at a time
//     (lamport_sum_vecs: all slot loads of a round issued before any check), sums each in rank
//     order (float32), adds the residual (loaded before the poll), stores residual_out, keeps
//     r in registers and
//     accumulates its sum of squares over its columns in increasing order (fmaf, from +0.0f);
//   the virtual warp l / 32 reduces with the same xor butterfly; its lane 0 stores the partial
//     in this block's s_part; cluster barrier (arrive.release / wait.acquire);
//   every thread reads the kArThreads / 32 partials through distributed shared memory (partial
//     w lives in block w / warps-per-block) and adds them in order 0, 1, ...: the sums and the
//     order of rmsnorm.cuh's "group's warps in order";
//   pass 2: normed = (r * inv) * weight for the thread's columns, stored as T; or (kQuant) kept
//     as float32 with the lane's amax bits, which the virtual warps reduce as rmsnorm.cuh's
//     quant_pass does (integer max: order-free) into s_amax; second cluster barrier; every
//     thread folds the partials through distributed shared memory, m = max(amax, floor),
//     block 0's thread 0 writes scale = m / 448, and the lane stores e4m3fn(normed * (448 / m));
//   the row ends with a split cluster barrier: arrive (release) once the thread's last read of
//     a peer's shared memory is done, wait (acquire) before the next row writes s_part / s_amax
//     or the block exits, so no block overwrites or frees shared memory a peer still reads,
//     and the arrival's latency overlaps the stores.
// Aliasing (out / x, residual_out / residual): as allreduce_oneshot.cuh: a row's outputs are
// written after all of its W slot vectors (this rank's own pushed copy included) were observed.
#pragma once
#include <cooperative_groups.h>

#include "allreduce_oneshot.cuh"

namespace nvc {
namespace dev {

// Blocks per cluster (one row): 4 (128 threads each) while the rows fit a quarter of the SMs,
// 2 (256 threads each) up to half of them. kArThreads / C threads per block either way.
constexpr int kClBlocksSmall = 4;
constexpr int kClBlocksLarge = 2;
constexpr int kClMaxCols = 4;                       // columns per virtual lane (registers)

// True when a fused call may use the cluster kernel (a function of the shape only, so every
// rank decides alike).
NVC_HD bool cluster_rows_ok(const RowCfg& rc, int64_t tokens) {
  return rc.tpr == kArThreads && rc.nr == 1 && rc.nvr <= kClMaxCols * kArThreads && tokens >= 1;
}

// Every thread: the kVWarps warp partials of a row, partial w in arr[w % kWarpsPerBlock] of
// the cluster's block w / kWarpsPerBlock (distributed shared memory), folded left to right with
// op (fold_warp_partials, rmsnorm.cuh: the same ops in the same order as the one-block
// epilogue).
template <int kVWarps, int kWarpsPerBlock, typename V, class Op>
__device__ __forceinline__ V cluster_fold(cooperative_groups::cluster_group& cluster, V* arr,
                                          Op op) {
  V part[kVWarps];
#pragma unroll
  for (int w = 0; w < kVWarps; ++w)
    part[w] = cluster.map_shared_rank(arr, w / kWarpsPerBlock)[w % kWarpsPerBlock];
  return fold_warp_partials<kVWarps>(part, kVWarps, op);
}

__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

template <typename T, bool kQuant, int kClBlocks, bool kWf32>
__global__ void __launch_bounds__(kArThreads / kClBlocks, 1)
    oneshot_cluster_kernel(const __grid_constant__ CommView v, const __grid_constant__ ArTensors t,
                           RowCfg rc, uint32_t desc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // clusters need sm_90; the host never launches this kernel below it
#else
  namespace cg = cooperative_groups;
  constexpr int E = Vec<T>::kElems;
  constexpr int kClThreads = kArThreads / kClBlocks;
  constexpr int kWarpsPerBlock = kClThreads / 32;
  constexpr int kVWarps = kArThreads / 32;  // virtual warps of a row
  static_assert(kClMaxCols % 2 == 0, "columns are polled in pairs");
  __shared__ char* s_dst[kMaxWorld];
  __shared__ float s_part[kWarpsPerBlock];
  __shared__ uint32_t s_amax[kQuant ? kWarpsPerBlock : 1];

  cg::cluster_group cluster = cg::this_cluster();
  const int crank = int(cluster.block_rank());
  const int64_t cid = blockIdx.x / kClBlocks, ncl = gridDim.x / kClBlocks;

  // kUniformExit = false: a failed communicator does not make blocks leave here (a cluster's
  // blocks could read Ctrl::failed at different times and then miss each other at the cluster
  // barriers); its polls give up at once instead (deadline = start). ok == false only for
  // kErrCapacity, alike everywhere.
  const OneShotCall call =
      oneshot_exchange<T, OneShotUnicast, kClThreads, false>(v, t, desc, nullptr, s_dst);
  if (!call.ok) return;
  const uint64_t k = call.k, deadline = call.deadline;
  oneshot_check_tag<kClThreads>(v, call, desc);

  // 5. rows, split over the cluster
  const char* slot0 = call.slot0;
  const char* res = static_cast<const char*>(t.residual);
  const char* wgt = static_cast<const char*>(t.weight);
  char* res_out = static_cast<char*>(t.residual_out);
  char* out = static_cast<char*>(t.out);
  const int nvr = rc.nvr;
  const int vl = crank * kClThreads + int(threadIdx.x);  // virtual lane of the row group
  const int warp = int(threadIdx.x) / 32;
  uint4 wv[kWf32 ? 1 : kClMaxCols];  // the lane's T weight vectors: the same for every row
  if (!kWf32 && cid < t.tokens) {
#pragma unroll
    for (int c = 0; c < kClMaxCols; ++c) {
      const int col = vl + c * kArThreads;
      if (col < nvr) wv[kWf32 ? 0 : c] = ld_nc_v4(wgt + size_t(col) * 16);
    }
  }
  for (int64_t row = cid; row < t.tokens; row += ncl) {
    const size_t rbase = size_t(row) * nvr;
    uint4 rv[kClMaxCols];
#pragma unroll
    for (int c = 0; c < kClMaxCols; ++c) {  // the residual first: its latency overlaps the poll
      const int col = vl + c * kArThreads;
      if (col < nvr) rv[c] = *reinterpret_cast<const uint4*>(res + (rbase + col) * 16);
    }
    float ss = 0.f;
    float r[kClMaxCols][E];
#pragma unroll
    for (int c = 0; c < kClMaxCols; c += 2) {
      const int col = vl + c * kArThreads;
      if (col < nvr) {
        const bool two = col + kArThreads < nvr;
        const size_t idx[2] = {rbase + col, rbase + col + kArThreads};
        uint4 sv[2];
        lamport_sum_vecs<T, 4>(v, slot0, idx, two ? 2 : 1, k, desc, deadline, sv);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (h == 0 || two) {
            float fs[E], fr[E];
            unpack<T>(sv[h], fs);
            unpack<T>(rv[c + h], fr);
#pragma unroll
            for (int e = 0; e < E; ++e) {
              r[c + h][e] = __fadd_rn(fs[e], fr[e]);
              ss = __fmaf_rn(r[c + h][e], r[c + h][e], ss);
            }
            st_v4(res_out + (rbase + col + h * kArThreads) * 16, pack<T>(r[c + h]));
          }
        }
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xFFFFFFFFu, ss, off));
    if ((threadIdx.x & 31) == 0) s_part[warp] = ss;
    cluster.sync();
    // the 16 partials of the row from the cluster's shared memory, added in warp order
    const float tot = cluster_fold<kVWarps, kWarpsPerBlock>(
        cluster, s_part, [](float a, float b) { return __fadd_rn(a, b); });
    if constexpr (!kQuant) cluster_arrive();  // after the last read of a peer's shared memory
    const float inv = rsqrtf(__fadd_rn(__fdiv_rn(tot, float(t.norm_hidden)), t.eps));
    uint32_t am = 0u;
#pragma unroll
    for (int c = 0; c < kClMaxCols; ++c) {
      const int col = vl + c * kArThreads;
      if (col < nvr) {
        float fw[E], o[E];
        if constexpr (!kWf32) unpack<T>(wv[c], fw);
        else load_weight<T, true>(wgt, col, fw);  // float32: per row, from L1
#pragma unroll
        for (int e = 0; e < E; ++e) o[e] = __fmul_rn(__fmul_rn(r[c][e], inv), fw[e]);
        if constexpr (kQuant) {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            r[c][e] = o[e];
            am = max_u32(am, abs_bits_f32(__float_as_uint(o[e])));
          }
        } else {
          st_v4(out + (rbase + col) * 16, pack<T>(o));
        }
      }
    }
    if constexpr (kQuant) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) am = max_u32(am, __shfl_xor_sync(0xFFFFFFFFu, am, off));
      if ((threadIdx.x & 31) == 0) s_amax[warp] = am;
      cluster.sync();
      const uint32_t mb = max_u32(  // the floor; NaN bits exceed it: NaN propagates
          kAmaxFloorBits, cluster_fold<kVWarps, kWarpsPerBlock>(
                              cluster, s_amax, [](uint32_t a, uint32_t b) { return max_u32(a, b); }));
      cluster_arrive();  // after the last read of a peer's shared memory
      const float m = __uint_as_float(mb);
      const float qmul = __fdiv_rn(kFp8E4M3Max, m);
      if (vl == 0) t.scale[row] = __fmul_rn(m, kInvFp8E4M3Max);
#pragma unroll
      for (int c = 0; c < kClMaxCols; ++c) {
        const int col = vl + c * kArThreads;
        if (col < nvr) store_e4m3<E>(out + (rbase + col) * E, r[c], qmul);
      }
    }
    cluster_wait();  // s_part / s_amax reuse, and no block exits while a peer reads them
  }
#endif
}

}  // namespace dev
}  // namespace nvc
