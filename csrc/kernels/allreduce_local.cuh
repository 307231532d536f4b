// All-reduce over a group of one rank (world size 1): no communication, no protocol state.
//
// The sum over one rank is that rank's sanitised input (-0.0 -> +0.0, lamport.cuh), converted
// through float32 and back exactly as the one-shot / two-shot reduce does, so results are
// bitwise identical to those kernels at world size 1 (same RowCfg, same rmsnorm_rows code):
//   plain: out = T(float(sanitise(x)))
//   fused: the epilogue of rmsnorm.cuh with sum_vec(i) = that value, straight from x in HBM
//   (kQuant: its FP8 variant, e4m3fn out + float32 row scales).
// Nothing of the communication buffer is read or written and no Ctrl counter moves (a group of
// one never runs the one-shot or two-shot protocol, so their counters stay consistent).
//
// Grid: any size; blocks never wait on each other, so they need not be co-resident and the grid
// may exceed the SM count (several blocks per SM hide the epilogue's barrier between its two
// passes; the launch bounds make two of them fit an SM's registers). Fused: block b owns rows
// [tokens*b/G, tokens*(b+1)/G).
//
// Aliasing: out may alias x, residual_out may alias residual. Plain: each vector is read, then
// written, by one thread. Fused: rmsnorm_rows reads every sum_vec of a row (pass 1) before it
// writes that row's out (pass 2), and rows belong to exactly one thread group.
#pragma once
#include "lamport.cuh"
#include "rmsnorm.cuh"
#include "rmsnorm_regs.cuh"

namespace nvc {
namespace dev {

template <typename T>
__device__ __forceinline__ uint4 local_sum_v4(const char* x, size_t i) {
  float acc[Vec<T>::kElems];
  accumulate<T>(acc, sanitize_v4<T>(ld_nc_v4(x + i * 16)), true);
  return pack<T>(acc);
}

// Two resident blocks per SM (at most 64 registers) for the plain and fused kernels, so one
// block's loads run while the other sits in the epilogue's barrier between its passes. The
// fused one spills 16-20 bytes at 64 registers, and is still faster: 70-72% of the copy
// bandwidth against 59-63% with one block per SM and no spill (2 x H200, bench allreduce on one
// GPU, 2026-11-30); tests/test_build.py allows this kernel (only) up to 40 bytes. The quantised
// epilogue would spill far more and keeps one.
template <typename T, bool kFused, bool kQuant = false, bool kWf32 = false>
__global__ void __launch_bounds__(kArThreads, kQuant ? 1 : 2)
    local_kernel(const __grid_constant__ ArTensors t, RowCfg rc) {
  const char* x = static_cast<const char*>(t.x);
  if constexpr (!kFused) {
    constexpr int kU = 4;
    const size_t nv = size_t(t.tokens) * size_t(t.hidden) / Vec<T>::kElems;
    const size_t nthreads = size_t(gridDim.x) * kArThreads;
    char* out = static_cast<char*>(t.out);
    for (size_t i0 = size_t(blockIdx.x) * kArThreads + threadIdx.x; i0 < nv; i0 += nthreads * kU) {
      uint4 d[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (i0 + u * nthreads < nv) d[u] = local_sum_v4<T>(x, i0 + u * nthreads);
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (i0 + u * nthreads < nv) st_v4(out + (i0 + u * nthreads) * 16, d[u]);
    }
  } else {
    __shared__ float s_red[kEpiPairs * kArThreads / 32];
    extern __shared__ float4 s_dyn[];
    const int64_t rb = t.tokens * blockIdx.x / gridDim.x;
    const int64_t re = t.tokens * (blockIdx.x + 1) / gridDim.x;
    rmsnorm_rows<T, kQuant, kWf32>(t, rc, rb, re, s_red, s_dyn,
                            [&](size_t i) { return local_sum_v4<T>(x, i); });
  }
}

// ---- Fused rows held in registers (world 1, rows of tpr == kArThreads) ----------------------
// For rows of more than kArThreads / 2 vectors (hidden > 2048 for 16-bit types, > 1024 for f32)
// and at most kLocVecs vectors per thread (hidden <= 8192 for 16-bit types, <= 4096 for f32):
// one row group of kRowThreads threads per block (rmsnorm_regs.cuh: the same bits as
// local_kernel, r in registers, the next row's loads in flight across the barrier), block b
// taking rows b, b + G, ... (neighbouring blocks read neighbouring rows).
constexpr int kLocThreads = kRowThreads;
constexpr int kLocVecs = 8;

NVC_HD bool local_rows_ok(const RowCfg& rc) { return rows_regs_ok<kLocVecs>(rc); }

template <typename T, bool kQuant, bool kWf32>
__global__ void __launch_bounds__(kLocThreads)
    local_rows_kernel(const __grid_constant__ ArTensors t, RowCfg rc) {
  const char* x = static_cast<const char*>(t.x);
  rmsnorm_rows_regs<T, kQuant, kWf32, 1, kLocVecs, true, true>(
      t, rc, blockIdx.x, t.tokens, gridDim.x, [&](size_t i) { return ld_nc_v4(x + i * 16); });
}

}  // namespace dev
}  // namespace nvc
