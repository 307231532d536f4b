// Fused one-shot all-reduce + residual add + RMSNorm with each row split over a thread-block
// cluster: the small-token-count variant of allreduce_oneshot.cuh (issue 13). Same Lamport
// protocol, buffers, counters and per-element arithmetic; only the mapping of a row to threads
// differs, and the reduction keeps its shape, so the results are bitwise those of the one-block
// epilogue (rmsnorm.cuh), hence of two-shot, world 1 and every token count.
//
// Applies to rows whose RowCfg has tpr == kArThreads and nr == 1 (more than kArThreads / 2
// vectors per row: hidden > 2048 for 16-bit types, > 1024 for f32; nr == 1 below 128 tokens),
// plain (not FP8) output, unicast. The host (allreduce.cu) picks it.
//
// Grid: G = C * nclusters blocks of kClThreads = kArThreads / C threads, cluster dims (C, 1, 1),
// C = kClBlocks; identical on every rank; all blocks co-resident (the host caps nclusters by the
// occupancy API and the SM budget).
//
// Steps 1-3 (push, clear, counters) are those of allreduce_oneshot.cuh over the G * kClThreads
// threads of the grid. Step 4, cluster c (of nclusters) owns rows c, c + nclusters, ...; block j
// of the cluster plays virtual lanes l = j * kClThreads + threadIdx.x of the row group of
// rmsnorm.cuh (tpr = kArThreads):
//   pass 1: lane l polls and sums (rank order, float32) columns l, l + kArThreads, ... of the row,
//     adds the residual, stores residual_out, keeps r in shared memory and accumulates its sum
//     of squares over its columns in increasing order (fmaf, from +0.0f);
//   the virtual warp l / 32 reduces with the same xor butterfly; its lane 0 stores the partial
//     in this block's s_part; cluster barrier (arrive.release / wait.acquire);
//   every thread reads the kArThreads / 32 partials through distributed shared memory (partial
//     w lives in block w / warps-per-block) and adds them in order 0, 1, ...: the sums and the
//     order of rmsnorm.cuh's "group's warps in order";
//   pass 2: normed = (r * inv) * weight for the thread's columns;
//   cluster barrier at the end of every row: the next row's partials overwrite s_part only
//     after every block of the cluster has read them, and no block exits while a peer may
//     still read its shared memory.
// Aliasing (out / x, residual_out / residual): as allreduce_oneshot.cuh: a row's outputs are
// written after all of its W slot vectors (this rank's own pushed copy included) were observed.
#pragma once
#include <cooperative_groups.h>

#include "allreduce_oneshot.cuh"

namespace nvc {
namespace dev {

constexpr int kClBlocks = 4;                        // blocks per cluster (one row)
constexpr int kClThreads = kArThreads / kClBlocks;  // threads per block
constexpr int kClMaxCols = 8;                       // columns per virtual lane (hidden <= 32768)

// Dynamic shared memory of one block: the float32 r of its columns of one row.
NVC_HD size_t cluster_smem_bytes(const RowCfg& rc, int elems_per_vec) {
  const int cols = (rc.nvr + kArThreads - 1) / kArThreads;
  return size_t(cols) * kClThreads * size_t(elems_per_vec) * sizeof(float);
}

// True when a fused call may use the cluster kernel (a function of the shape only, so every
// rank decides alike).
NVC_HD bool cluster_rows_ok(const RowCfg& rc, int64_t tokens) {
  return rc.tpr == kArThreads && rc.nr == 1 && rc.nvr <= kClMaxCols * kArThreads && tokens >= 1;
}

template <typename T>
__global__ void __launch_bounds__(kClThreads)
    oneshot_cluster_kernel(const __grid_constant__ CommView v, const __grid_constant__ ArTensors t,
                           RowCfg rc, uint32_t desc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // clusters need sm_90; the host never launches this kernel below it
#else
  namespace cg = cooperative_groups;
  constexpr int E = Vec<T>::kElems;
  constexpr int F4 = E / 4;
  constexpr int kWarpsPerBlock = kClThreads / 32;
  constexpr int kVWarps = kArThreads / 32;  // virtual warps of a row
  constexpr int kU = 4;
  __shared__ char* s_dst[kMaxWorld];
  __shared__ float s_part[kWarpsPerBlock];
  extern __shared__ float4 s_r[];  // [column k][thread][F4]

  cg::cluster_group cluster = cg::this_cluster();
  const int crank = int(cluster.block_rank());
  const int64_t cid = blockIdx.x / kClBlocks, ncl = gridDim.x / kClBlocks;

  const size_t nv = size_t(t.tokens) * size_t(t.hidden) / E;
  const size_t bytes = nv * 16;
  const size_t tid = size_t(blockIdx.x) * kClThreads + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * kClThreads;
  const char* x = static_cast<const char*>(t.x);
  uint4 d0[kU];  // first input vectors, requested before the counters (as in oneshot_body)
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
  if (threadIdx.x < v.world) OneShotUnicast::setup(v, nullptr, cur, s_dst);
  __syncthreads();
  const uint32_t ticket = threadIdx.x == 0 ? arrive_issue(&ctrl->done_blocks) : 0u;

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
      if (i < nv) OneShotUnicast::push(v, s_dst, i, d[u]);
    }
  }
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
  // 3. counters (see allreduce_oneshot.cuh)
  if (threadIdx.x == 0 && arrive_is_last(&ctrl->done_blocks, ticket)) {
    *reinterpret_cast<volatile uint64_t*>(&ctrl->lamport_bytes) = bytes;
    *reinterpret_cast<volatile uint64_t*>(&ctrl->lamport_seq) = k;
  }

  // 4. rows, split over the cluster
  const char* slot0 = v.lamport(v.rank, cur, 0);
  const char* res = static_cast<const char*>(t.residual);
  const char* wgt = static_cast<const char*>(t.weight);
  char* res_out = static_cast<char*>(t.residual_out);
  char* out = static_cast<char*>(t.out);
  const int nvr = rc.nvr;
  const int vl = crank * kClThreads + int(threadIdx.x);  // virtual lane of the row group
  const int warp = int(threadIdx.x) / 32;
  for (int64_t row = cid; row < t.tokens; row += ncl) {
    const size_t rbase = size_t(row) * nvr;
    uint4 rv[kClMaxCols];
#pragma unroll
    for (int c = 0; c < kClMaxCols; ++c) {  // the residual first: its latency overlaps the poll
      const int col = vl + c * kArThreads;
      if (col < nvr) rv[c] = *reinterpret_cast<const uint4*>(res + (rbase + col) * 16);
    }
    float ss = 0.f;
#pragma unroll
    for (int c = 0; c < kClMaxCols; ++c) {
      const int col = vl + c * kArThreads;
      if (col < nvr) {
        float fs[E], fr[E], r[E];
        unpack<T>(lamport_sum_v4<T, 4>(v, slot0, rbase + col, k, desc, deadline), fs);
        unpack<T>(rv[c], fr);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          r[e] = __fadd_rn(fs[e], fr[e]);
          ss = __fmaf_rn(r[e], r[e], ss);
        }
        float4* dst = s_r + (size_t(c) * kClThreads + threadIdx.x) * F4;
#pragma unroll
        for (int f = 0; f < F4; ++f)
          dst[f] = make_float4(r[4 * f], r[4 * f + 1], r[4 * f + 2], r[4 * f + 3]);
        st_v4(res_out + (rbase + col) * 16, pack<T>(r));
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xFFFFFFFFu, ss, off));
    if ((threadIdx.x & 31) == 0) s_part[warp] = ss;
    cluster.sync();
    float part[kVWarps];
#pragma unroll
    for (int w = 0; w < kVWarps; ++w)
      part[w] = cluster.map_shared_rank(s_part, w / kWarpsPerBlock)[w % kWarpsPerBlock];
    float tot = part[0];
#pragma unroll
    for (int w = 1; w < kVWarps; ++w) tot = __fadd_rn(tot, part[w]);
    const float inv = rsqrtf(__fadd_rn(__fdiv_rn(tot, float(t.hidden)), t.eps));
#pragma unroll
    for (int c = 0; c < kClMaxCols; ++c) {
      const int col = vl + c * kArThreads;
      if (col < nvr) {
        float fw[E], o[E];
        unpack<T>(ld_nc_v4(wgt + size_t(col) * 16), fw);
        const float4* src = s_r + (size_t(c) * kClThreads + threadIdx.x) * F4;
#pragma unroll
        for (int f = 0; f < F4; ++f) {
          const float4 r4 = src[f];
          o[4 * f] = __fmul_rn(__fmul_rn(r4.x, inv), fw[4 * f]);
          o[4 * f + 1] = __fmul_rn(__fmul_rn(r4.y, inv), fw[4 * f + 1]);
          o[4 * f + 2] = __fmul_rn(__fmul_rn(r4.z, inv), fw[4 * f + 2]);
          o[4 * f + 3] = __fmul_rn(__fmul_rn(r4.w, inv), fw[4 * f + 3]);
        }
        st_v4(out + (rbase + col) * 16, pack<T>(o));
      }
    }
    cluster.sync();  // s_part reuse, and no block exits while a peer reads its shared memory
  }
#endif
}

}  // namespace dev
}  // namespace nvc
