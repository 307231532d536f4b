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
template <typename T, bool kFused, bool kQuant = false>
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
    rmsnorm_rows<T, kQuant>(t, rc, rb, re, s_red, s_dyn,
                            [&](size_t i) { return local_sum_v4<T>(x, i); });
  }
}

// ---- Fused rows held in registers (world 1, rows of tpr == kArThreads) ----------------------
// For rows of more than kArThreads / 2 vectors (hidden > 2048 for 16-bit types, > 1024 for f32)
// and at most kLocVecsPerThread vectors per thread (hidden <= 8192), the fused epilogue runs one
// row per block of kLocThreads threads (grid-stride over rows): thread t plays the virtual lanes
// t + kLocThreads * j (j < kLocLanes) of rmsnorm.cuh's row group of kArThreads lanes, so every
// row is reduced in rmsnorm_rows' shape and the results are bitwise those of local_kernel (and of
// one-shot / two-shot): virtual lane l sums its columns l, l + kArThreads, ... in increasing
// order (fmaf from +0.0f), the virtual warp (l / 32) with the xor butterfly (the physical warp
// t / 32 holds virtual warps t / 32 + (kLocThreads / 32) * j), then the kArThreads / 32 warp
// partials in warp order. r stays in registers (no shared-memory round trip), the weight
// vectors of the thread's columns are loaded once per block, and the next row's x and
// residual are requested before this row's barrier (two rows in flight per thread).
// Partials: double-buffered in shared memory, so one __syncthreads per row suffices (row i
// writes buffer i % 2 only after every thread passed row i - 1's barrier, i.e. finished
// reading buffer i % 2 of row i - 2). kQuant: the row amax bits per physical warp (integer
// max: order-free) go through a second barrier, then q = e4m3fn(normed * (448 / m)) from
// registers, as rmsnorm.cuh's quant_pass defines it.
// Aliasing (out / x, residual_out / residual): a thread writes only its own columns, after it
// read them.
constexpr int kLocThreads = 128;
constexpr int kLocLanes = kArThreads / kLocThreads;  // virtual lanes per thread
constexpr int kLocVecsPerThread = 8;                 // 16-byte vectors of a row per thread

NVC_HD bool local_rows_ok(const RowCfg& rc) {
  return rc.tpr == kArThreads && rc.nvr <= kLocVecsPerThread * kLocThreads;
}

template <typename T, bool kQuant>
__global__ void __launch_bounds__(kLocThreads)
    local_rows_kernel(const __grid_constant__ ArTensors t, RowCfg rc) {
  constexpr int E = Vec<T>::kElems;
  constexpr int kC = kLocVecsPerThread / kLocLanes;  // columns per virtual lane
  constexpr int kPW = kLocThreads / 32;              // physical warps
  constexpr int kVW = kArThreads / 32;               // virtual warps
  __shared__ float s_part[2][kVW];
  __shared__ uint32_t s_amax[2][kQuant ? kPW : 1];
  const int nvr = rc.nvr;
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid & 31;
  const char* x = static_cast<const char*>(t.x);
  const char* res = static_cast<const char*>(t.residual);
  const char* wgt = static_cast<const char*>(t.weight);
  char* res_out = static_cast<char*>(t.residual_out);
  char* out = static_cast<char*>(t.out);
  // vector v = j * kC + c of this thread: virtual lane tid + kLocThreads * j, column
  // (tid + kLocThreads * j) + kArThreads * c
  auto col_of = [&](int v) { return tid + kLocThreads * (v / kC) + kArThreads * (v % kC); };
  uint4 wv[kLocVecsPerThread], xv[kLocVecsPerThread], rv[kLocVecsPerThread];
#pragma unroll
  for (int v = 0; v < kLocVecsPerThread; ++v)
    if (col_of(v) < nvr) wv[v] = ld_nc_v4(wgt + size_t(col_of(v)) * 16);
  auto load_row = [&](int64_t row) {
    if (row >= t.tokens) return;
#pragma unroll
    for (int v = 0; v < kLocVecsPerThread; ++v) {
      if (col_of(v) < nvr) {
        const size_t i = size_t(row) * nvr + col_of(v);
        xv[v] = ld_nc_v4(x + i * 16);
        rv[v] = *reinterpret_cast<const uint4*>(res + i * 16);
      }
    }
  };
  load_row(blockIdx.x);
  int buf = 0;
  for (int64_t row = blockIdx.x; row < t.tokens; row += gridDim.x, buf ^= 1) {
    const size_t rbase = size_t(row) * nvr;
    float r[kLocVecsPerThread][E];
    float ss[kLocLanes];
#pragma unroll
    for (int j = 0; j < kLocLanes; ++j) ss[j] = 0.f;
#pragma unroll
    for (int v = 0; v < kLocVecsPerThread; ++v) {  // columns of a lane in increasing order
      if (col_of(v) < nvr) {
        float fs[E], fr[E];
        unpack<T>(sanitize_v4<T>(xv[v]), fs);
        unpack<T>(rv[v], fr);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          r[v][e] = __fadd_rn(fs[e], fr[e]);
          ss[v / kC] = __fmaf_rn(r[v][e], r[v][e], ss[v / kC]);
        }
        st_v4(res_out + (rbase + col_of(v)) * 16, pack<T>(r[v]));
      }
    }
    load_row(row + gridDim.x);  // the next row's loads fly during the barrier and pass 2
#pragma unroll
    for (int j = 0; j < kLocLanes; ++j) {
      float p = ss[j];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) p = __fadd_rn(p, __shfl_xor_sync(0xFFFFFFFFu, p, off));
      if (lane == 0) s_part[buf][warp + kPW * j] = p;
    }
    __syncthreads();
    const float tot = fold_warp_partials<kVW>(s_part[buf], kVW,
                                              [](float a, float b) { return __fadd_rn(a, b); });
    const float inv = rsqrtf(__fadd_rn(__fdiv_rn(tot, float(t.hidden)), t.eps));
    uint32_t am = 0u;
#pragma unroll
    for (int v = 0; v < kLocVecsPerThread; ++v) {
      if (col_of(v) < nvr) {
        float fw[E];
        unpack<T>(wv[v], fw);
#pragma unroll
        for (int e = 0; e < E; ++e) r[v][e] = __fmul_rn(__fmul_rn(r[v][e], inv), fw[e]);
        if constexpr (kQuant) {
#pragma unroll
          for (int e = 0; e < E; ++e) am = max_u32(am, abs_bits_f32(__float_as_uint(r[v][e])));
        } else {
          st_v4(out + (rbase + col_of(v)) * 16, pack<T>(r[v]));
        }
      }
    }
    if constexpr (kQuant) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) am = max_u32(am, __shfl_xor_sync(0xFFFFFFFFu, am, off));
      if (lane == 0) s_amax[buf][warp] = am;
      __syncthreads();
      uint32_t mb = kAmaxFloorBits;  // the floor; NaN bits exceed it: NaN propagates
#pragma unroll
      for (int w = 0; w < kPW; ++w) mb = max_u32(mb, s_amax[buf][w]);
      const float m = __uint_as_float(mb);
      const float qmul = __fdiv_rn(kFp8E4M3Max, m);
      if (tid == 0) t.scale[row] = __fmul_rn(m, kInvFp8E4M3Max);
#pragma unroll
      for (int v = 0; v < kLocVecsPerThread; ++v)
        if (col_of(v) < nvr) store_e4m3<E>(out + (rbase + col_of(v)) * E, r[v], qmul);
    }
  }
}

}  // namespace dev
}  // namespace nvc
