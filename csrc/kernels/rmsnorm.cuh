// Shared arithmetic of the all-reduce kernels: the rank-order float32 sum of one 16-byte vector
// and the fused residual-add + RMSNorm epilogue. One-shot and two-shot both call these, with the
// same row configuration for the same (hidden, dtype), so their results are bitwise identical.
//
// Semantics (T = x's dtype; residual, weight and outputs are T too):
//   sum          = T( x_0 + x_1 + ... + x_{W-1} )     float32, left to right in rank order,
//                                                     inputs with -0.0 replaced by +0.0
//   r            = float(sum) + float(residual)        float32
//   residual_out = T(r)
//   normed       = T( (r * rsqrt(mean(r^2) + eps)) * float(weight) )
// The sum is rounded to T before the residual add, exactly as `lax.psum(x)` followed by the
// add + RMSNorm computes it (and as TensorRT-LLM's fused kernels do). This lets two-shot gather
// the T-typed sum (M bytes fit the all-gather zone) and run the epilogue on every rank with that
// rank's own residual, identical to one-shot even if residuals differ between ranks.
//
// Determinism: every float operation is an explicit round-to-nearest intrinsic (no contraction
// that could differ between the kernels that inline this code), and the row reduction has a fixed
// shape: each thread sums its elements in order, then a xor-butterfly over the warp, then the
// group's warps in order. rsqrtf is the same MUFU instruction everywhere.
//
// Row mapping: a row of nvr = hidden/E 16-byte vectors (E = Vec<T>::kElems) is handled by a
// group of `tpr` threads (a power of two in [32, kArThreads], the smallest >= nvr when possible);
// each group takes nr rows per iteration (2 or 4 when there are many rows and they fit
// kEpiSmemBudget of shared memory, else 1), and every thread keeps kEpiPairs vectors in flight.
// Between the two passes (sums of squares, then scaling) the float32 r lives in dynamic shared
// memory (rmsnorm_smem_bytes, at most max(64 KiB, hidden * 4 bytes)), so register use does not
// grow with hidden. The configuration is a function of (tokens, hidden, dtype) only, and the
// reduction order of a row of (hidden, dtype) only.
#pragma once
#include "common.cuh"

namespace nvc {
namespace dev {

constexpr int kArThreads = 512;  // threads per block of every all-reduce kernel

// The tensors of one all-reduce call (device pointers, per rank). residual == nullptr: plain.
struct ArTensors {
  const void* x;
  void* out;               // sum (plain) or normed (fused)
  const void* residual;
  void* residual_out;
  const void* weight;
  int64_t tokens;
  int64_t hidden;
  float eps;
};

constexpr int kEpiPairs = 4;                 // (row, column) vectors in flight per thread
constexpr size_t kEpiSmemBudget = 64 * 1024;  // shared memory for r when several rows fit

struct RowCfg {
  int nvr;  // 16-byte vectors per row
  int tpr;  // threads per row group
  int nr;   // rows per group per iteration (1, 2 or 4); kEpiPairs / nr columns per step
};

// A function of (tokens, hidden, dtype) only, never of the strategy or the grid: one-shot and
// two-shot reduce every row in the same shape, so their results are bitwise identical. Several
// rows per group only when there are enough rows for every group of kEpiMaxBlocks blocks.
constexpr int kEpiMaxBlocks = 64;
NVC_HD RowCfg make_row_cfg(int64_t tokens, int64_t hidden, int elems_per_vec) {
  RowCfg c;
  c.nvr = int(hidden / elems_per_vec);
  c.tpr = 32;
  while (c.tpr < c.nvr && c.tpr < kArThreads) c.tpr *= 2;
  const int64_t groups = int64_t(kEpiMaxBlocks) * (kArThreads / c.tpr);
  const size_t iter_bytes = size_t(kArThreads / c.tpr) * size_t(hidden) * sizeof(float);
  c.nr = 1;
  while (c.nr < kEpiPairs && tokens >= 2 * c.nr * groups && 2 * c.nr * iter_bytes <= kEpiSmemBudget)
    c.nr *= 2;
  return c;
}

// acc (+)= the elements of vector v, in the order callers present the ranks.
template <typename T>
__device__ __forceinline__ void accumulate(float* acc, const uint4& v, bool first) {
  float f[Vec<T>::kElems];
  unpack<T>(v, f);
#pragma unroll
  for (int e = 0; e < Vec<T>::kElems; ++e) acc[e] = first ? f[e] : __fadd_rn(acc[e], f[e]);
}

// Dynamic shared memory the epilogue needs: the float32 r of the rows in flight.
NVC_HD size_t rmsnorm_smem_bytes(const RowCfg& rc, int elems_per_vec) {
  return size_t(kArThreads / rc.tpr) * size_t(rc.nr) * size_t(rc.nvr) * size_t(elems_per_vec) *
         sizeof(float);
}

// Residual add + RMSNorm over rows [row_begin, row_end). sum_vec(i) returns the T-packed sum of
// 16-byte vector i of the message (i = row * nvr + column). Every thread of the block must call
// it with the same row range (it contains __syncthreads). s_red: kEpiPairs * kArThreads/32 floats
// of shared memory; s_r: rmsnorm_smem_bytes(rc) bytes of shared memory holding r between the two
// passes (each thread reads back only what it wrote, so no extra barrier).
//
// Group g of an iteration owns rows row0 + g*nr + q (q < nr). Each step of a thread handles
// kEpiPairs (row, column) pairs p: row q = p % nr, column lane + (p / nr + step*kb) * tpr with
// kb = kEpiPairs / nr, all loads issued before use. A thread's partial sum of squares of a row
// runs over its columns in increasing order, then butterfly, then the group's warps in order:
// the shape depends on (hidden, dtype) only, not on nr, so a row's result is also independent of
// the number of tokens in the call (batch invariant).
template <typename T, class SumFn>
__device__ __forceinline__ void rmsnorm_rows(const ArTensors& t, const RowCfg& rc,
                                             int64_t row_begin, int64_t row_end, float* s_red,
                                             float4* s_r, SumFn&& sum_vec) {
  constexpr int E = Vec<T>::kElems;
  constexpr int F4 = E / 4;  // float4s per vector
  constexpr int kP = kEpiPairs;
  constexpr int kWarps = kArThreads / 32;
  const int nr = rc.nr, kb = kP / rc.nr, tpr = rc.tpr, nvr = rc.nvr;  // nr in {1, 2, 4}
  const int group = threadIdx.x / tpr;
  const int lane = threadIdx.x % tpr;
  const int rows_per_iter = (kArThreads / tpr) * nr;
  const int warps_per_group = tpr / 32;
  const int warp = threadIdx.x / 32;
  const char* res = static_cast<const char*>(t.residual);
  const char* wgt = static_cast<const char*>(t.weight);
  char* res_out = static_cast<char*>(t.residual_out);
  char* out = static_cast<char*>(t.out);
  float4* grp_r = s_r + size_t(group) * nr * nvr * F4;

  for (int64_t row0 = row_begin; row0 < row_end; row0 += rows_per_iter) {
    const int64_t rbase = row0 + int64_t(group) * nr;
    // Pass 1: r = sum + residual -> residual_out, shared memory, sums of squares. Row q's
    // partial accumulates this thread's columns in increasing order whatever nr is.
    float ss[kP];
#pragma unroll
    for (int q = 0; q < kP; ++q) ss[q] = 0.f;
    auto pass1 = [&](auto nr_c) {
      constexpr int NR = decltype(nr_c)::value;
      for (int c0 = lane; c0 < nvr; c0 += (kP / NR) * tpr) {
        uint4 sv[kP], rv[kP];
#pragma unroll
        for (int p = 0; p < kP; ++p) {
          const int64_t row = rbase + p % NR;
          const int col = c0 + (p / NR) * tpr;
          if (row < row_end && col < nvr) sv[p] = sum_vec(size_t(row) * nvr + col);
        }
#pragma unroll
        for (int p = 0; p < kP; ++p) {
          const int64_t row = rbase + p % NR;
          const int col = c0 + (p / NR) * tpr;
          if (row < row_end && col < nvr)
            rv[p] = *reinterpret_cast<const uint4*>(res + (size_t(row) * nvr + col) * 16);
        }
#pragma unroll
        for (int p = 0; p < kP; ++p) {
          const int q = p % NR;
          const int64_t row = rbase + q;
          const int col = c0 + (p / NR) * tpr;
          if (row < row_end && col < nvr) {
            float fs[E], fr[E], r[E];
            unpack<T>(sv[p], fs);
            unpack<T>(rv[p], fr);
#pragma unroll
            for (int e = 0; e < E; ++e) {
              r[e] = __fadd_rn(fs[e], fr[e]);
              ss[q] = __fmaf_rn(r[e], r[e], ss[q]);
            }
            float4* dst = grp_r + (size_t(q) * nvr + col) * F4;
#pragma unroll
            for (int f = 0; f < F4; ++f)
              dst[f] = make_float4(r[4 * f], r[4 * f + 1], r[4 * f + 2], r[4 * f + 3]);
            st_v4(res_out + (size_t(row) * nvr + col) * 16, pack<T>(r));
          }
        }
      }
    };
    if (nr == 1) pass1(std::integral_constant<int, 1>());
    else if (nr == 2) pass1(std::integral_constant<int, 2>());
    else pass1(std::integral_constant<int, 4>());
    // Per-row totals: butterfly over the warp, then the group's warps in order.
#pragma unroll
    for (int q = 0; q < kP; ++q) {
      if (q < nr) {
        float v = ss[q];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
        if ((threadIdx.x & 31) == 0) s_red[q * kWarps + warp] = v;
      }
    }
    __syncthreads();
    float inv[kP];
#pragma unroll
    for (int p = 0; p < kP; ++p) {
      const float* red = s_red + (p % nr) * kWarps + group * warps_per_group;
      float tot = red[0];
      for (int w = 1; w < warps_per_group; ++w) tot = __fadd_rn(tot, red[w]);
      inv[p] = rsqrtf(__fadd_rn(__fdiv_rn(tot, float(t.hidden)), t.eps));
    }
    __syncthreads();  // s_red is reused by the next iteration
    // Pass 2: normed = (r * inv) * weight.
    for (int c0 = lane; c0 < nvr; c0 += kb * tpr) {
#pragma unroll
      for (int p = 0; p < kP; ++p) {
        const int q = p % nr;
        const int64_t row = rbase + q;
        const int col = c0 + (p / nr) * tpr;
        if (row < row_end && col < nvr) {
          float fw[E], o[E];
          unpack<T>(ld_nc_v4(wgt + size_t(col) * 16), fw);
          const float4* src = grp_r + (size_t(q) * nvr + col) * F4;
#pragma unroll
          for (int f = 0; f < F4; ++f) {
            const float4 r4 = src[f];
            o[4 * f] = __fmul_rn(__fmul_rn(r4.x, inv[p]), fw[4 * f]);
            o[4 * f + 1] = __fmul_rn(__fmul_rn(r4.y, inv[p]), fw[4 * f + 1]);
            o[4 * f + 2] = __fmul_rn(__fmul_rn(r4.z, inv[p]), fw[4 * f + 2]);
            o[4 * f + 3] = __fmul_rn(__fmul_rn(r4.w, inv[p]), fw[4 * f + 3]);
          }
          st_v4(out + (size_t(row) * nvr + col) * 16, pack<T>(o));
        }
      }
    }
  }
}

}  // namespace dev
}  // namespace nvc
