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
// Row mapping: a row of nvr = hidden/E 16-byte vectors (E = Vec<T>::kElems) is owned by a group
// of `tpr` threads (a power of two in [32, kArThreads], the smallest >= nvr when possible);
// thread `lane` of the group handles vectors lane, lane + tpr, ... . A block processes
// kArThreads/tpr rows at a time. Between the two passes (sum of squares, then scaling) the
// float32 r lives in dynamic shared memory (rmsnorm_smem_bytes: hidden * 4 bytes for one row,
// <= 16 KiB for many short rows), so register use does not grow with hidden.
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

struct RowCfg {
  int nvr;  // 16-byte vectors per row
  int tpr;  // threads per row group
};

NVC_HD RowCfg make_row_cfg(int64_t hidden, int elems_per_vec) {
  RowCfg c;
  c.nvr = int(hidden / elems_per_vec);
  c.tpr = 32;
  while (c.tpr < c.nvr && c.tpr < kArThreads) c.tpr *= 2;
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
  return size_t(kArThreads / rc.tpr) * size_t(rc.nvr) * size_t(elems_per_vec) * sizeof(float);
}

// Residual add + RMSNorm over rows [row_begin, row_end). sum_vec(i) returns the T-packed sum of
// 16-byte vector i of the message (i = row * nvr + column). Every thread of the block must call
// it with the same row range (it contains __syncthreads). s_red: kArThreads/32 floats of shared
// memory; s_r: rmsnorm_smem_bytes(rc) bytes of shared memory holding r between the two passes
// (each thread reads back only what it wrote, so no extra barrier).
template <typename T, class SumFn>
__device__ __forceinline__ void rmsnorm_rows(const ArTensors& t, const RowCfg& rc,
                                             int64_t row_begin, int64_t row_end, float* s_red,
                                             float4* s_r, SumFn&& sum_vec) {
  constexpr int E = Vec<T>::kElems;
  constexpr int F4 = E / 4;  // float4s per vector
  constexpr int kB = 2;      // vectors in flight per thread
  const int group = threadIdx.x / rc.tpr;
  const int lane = threadIdx.x % rc.tpr;
  const int rows_per_iter = kArThreads / rc.tpr;
  const int warps_per_group = rc.tpr / 32;
  const int warp = threadIdx.x / 32;
  const char* res = static_cast<const char*>(t.residual);
  const char* wgt = static_cast<const char*>(t.weight);
  char* res_out = static_cast<char*>(t.residual_out);
  char* out = static_cast<char*>(t.out);
  float4* my_r = s_r + size_t(group) * rc.nvr * F4;

  for (int64_t row0 = row_begin; row0 < row_end; row0 += rows_per_iter) {
    const int64_t row = row0 + group;
    const bool active = row < row_end;
    const size_t row_vec = size_t(active ? row : 0) * rc.nvr;
    // Pass 1: r = sum + residual -> residual_out, shared memory, sum of squares.
    float ss = 0.f;
    if (active) {
      for (int c0 = lane; c0 < rc.nvr; c0 += kB * rc.tpr) {
        uint4 sv[kB], rv[kB];
#pragma unroll
        for (int u = 0; u < kB; ++u)
          if (c0 + u * rc.tpr < rc.nvr) sv[u] = sum_vec(row_vec + c0 + u * rc.tpr);
#pragma unroll
        for (int u = 0; u < kB; ++u)
          if (c0 + u * rc.tpr < rc.nvr)
            rv[u] = *reinterpret_cast<const uint4*>(res + (row_vec + c0 + u * rc.tpr) * 16);
#pragma unroll
        for (int u = 0; u < kB; ++u) {
          const int col = c0 + u * rc.tpr;
          if (col < rc.nvr) {
            float fs[E], fr[E], r[E];
            unpack<T>(sv[u], fs);
            unpack<T>(rv[u], fr);
#pragma unroll
            for (int e = 0; e < E; ++e) {
              r[e] = __fadd_rn(fs[e], fr[e]);
              ss = __fmaf_rn(r[e], r[e], ss);
            }
#pragma unroll
            for (int q = 0; q < F4; ++q)
              my_r[col * F4 + q] = make_float4(r[4 * q], r[4 * q + 1], r[4 * q + 2], r[4 * q + 3]);
            st_v4(res_out + (row_vec + col) * 16, pack<T>(r));
          }
        }
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xFFFFFFFFu, ss, off));
    if ((threadIdx.x & 31) == 0) s_red[warp] = ss;
    __syncthreads();
    float tot = s_red[group * warps_per_group];
    for (int w = 1; w < warps_per_group; ++w) tot = __fadd_rn(tot, s_red[group * warps_per_group + w]);
    __syncthreads();  // s_red is reused by the next row iteration
    // Pass 2: normed = (r * inv) * weight.
    if (active) {
      const float inv = rsqrtf(__fadd_rn(__fdiv_rn(tot, float(t.hidden)), t.eps));
      for (int col = lane; col < rc.nvr; col += rc.tpr) {
        float fw[E], o[E];
        unpack<T>(ld_nc_v4(wgt + size_t(col) * 16), fw);
#pragma unroll
        for (int q = 0; q < F4; ++q) {
          const float4 r4 = my_r[col * F4 + q];
          o[4 * q] = __fmul_rn(__fmul_rn(r4.x, inv), fw[4 * q]);
          o[4 * q + 1] = __fmul_rn(__fmul_rn(r4.y, inv), fw[4 * q + 1]);
          o[4 * q + 2] = __fmul_rn(__fmul_rn(r4.z, inv), fw[4 * q + 2]);
          o[4 * q + 3] = __fmul_rn(__fmul_rn(r4.w, inv), fw[4 * q + 3]);
        }
        st_v4(out + (row_vec + col) * 16, pack<T>(o));
      }
    }
  }
}

}  // namespace dev
}  // namespace nvc
