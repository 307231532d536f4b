// Shared arithmetic of the all-reduce kernels: the rank-order float32 sum of one 16-byte vector
// and the fused residual-add + RMSNorm epilogue. One-shot and two-shot both call these, with the
// same row configuration for the same (hidden, dtype), so their results are bitwise identical.
//
// Semantics (T = x's dtype; residual and outputs are T too; weight is T or float32):
//   sum          = T( x_0 + x_1 + ... + x_{W-1} )     float32, left to right in rank order,
//                                                     inputs with -0.0 replaced by +0.0
//   r            = float(sum) + float(residual)        float32
//   residual_out = T(r)
//   normed       = T( (r * rsqrt(sum(r^2) / n + eps)) * float(weight) )
// n = t.norm_hidden: the row's true width when the caller zero-padded the rows to a whole
// number of 16-byte vectors (padding adds +0.0 to the sum of squares: exact), else hidden; the
// launcher resolves it (never 0 here), so the kernels divide by float(n) whatever the padding
// and a padded width costs them nothing. The weight's form is a template parameter of every fused kernel
// (kWf32, chosen once by the launcher): a T weight (kWf32 false, the only form for float32 T)
// is widened exactly; a float32 weight (kWf32, 16-bit T only) is read as float32, 4 * E bytes
// per vector of the row, the product above with the weight unrounded (as model code that keeps
// its norm weights in float32 computes it). The two forms are separate instantiations, so the
// T-weight kernels hold no trace of the float32 one.
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
//
// Quantised variant (kQuant, jax_nvcomm.all_reduce_rms_norm_quant): the same r, residual_out and
// float32 normed (the same instructions in the same order, so normed is bitwise the float32 value
// the plain epilogue would round to T), but normed is NOT rounded to T: it goes to float8_e4m3fn
// with one float32 scale per row, as csrc/common/fp8.h defines (m = max(amax, floor),
// scale = m * fl(1/448), q = e4m3fn_rne(normed * (448 / m))). out is then [tokens, hidden]
// bytes of e4m3fn and t.scale float32 [tokens]. One pass over the inputs still: pass 2 computes normed, overwrites r with it
// in shared memory (each thread rewrites only what it wrote) and keeps a per-thread row amax as
// raw bits; the row amax is reduced with an integer max (warp butterfly, then the group's warps
// through shared memory: order-free and exact); pass 3 divides the shared-memory normed by the
// row's 448 / m and stores 8 (16-bit T) or 4 (f32) e4m3fn bytes per vector. One more __syncthreads
// per row iteration than the plain epilogue, no extra global reads.
#pragma once
#include <cuda_fp8.h>

#include "../common/fp8.h"
#include "common.cuh"

namespace nvc {
namespace dev {

constexpr int kArThreads = 512;  // threads per block of every all-reduce kernel

// The tensors of one all-reduce call (device pointers, per rank). residual == nullptr: plain.
struct ArTensors {
  const void* x;
  void* out;               // sum (plain), normed (fused) or e4m3fn q (fused + quantised)
  const void* residual;
  void* residual_out;
  const void* weight;
  int64_t tokens;
  int64_t hidden;
  float eps;
  float* scale;            // quantised epilogue: float32 [tokens] row scales (else unused)
  int64_t norm_hidden;     // the mean's divisor: the row width before zero padding (<= hidden)
};

// Whether the fused kernel of x's dtype T exists with a float32 weight (16-bit T only).
template <typename T, bool kWf32>
constexpr bool kWeightFormOk = !kWf32 || !std::is_same<T, float>::value;

// Address of the weights of 16-byte vector `col` of a row: 16 bytes of T, or 4 * E bytes of
// float32 (kWf32).
template <typename T, bool kWf32>
__device__ __forceinline__ const char* weight_at(const char* wgt, int col) {
  static_assert(kWeightFormOk<T, kWf32>, "a float32 weight goes with 16-bit x only");
  return wgt + size_t(col) * (kWf32 ? size_t(Vec<T>::kElems) * 4 : 16);
}

// The E = Vec<T>::kElems float32 weights of vector `col` (exact widening of a T weight).
template <typename T, bool kWf32>
__device__ __forceinline__ void load_weight(const char* wgt, int col, float* fw) {
  constexpr int E = Vec<T>::kElems;
  if constexpr (!kWf32) {
    unpack<T>(ld_nc_v4(weight_at<T, false>(wgt, col)), fw);
  } else {
    const char* p = weight_at<T, true>(wgt, col);
#pragma unroll
    for (int i = 0; i < E / 4; ++i) unpack<float>(ld_nc_v4(p + 16 * i), fw + 4 * i);
  }
}

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

// v[0] op v[1] op ... op v[n-1], left to right (1 <= n <= kWarps): a row's warp partials from
// shared memory. The loads, 4 at a time at least, are issued before the ops that use them (the
// ops depend on each other, the loads do not): the same ops in the same order as one load-op
// at a time.
template <int kWarps, typename V, class Op>
__device__ __forceinline__ V fold_warp_partials(const V* v, int n, Op op) {
  V acc = V(0);
#pragma unroll
  for (int w0 = 0; w0 < kWarps; w0 += 4) {
    V part[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) part[j] = w0 + j < n ? v[w0 + j] : V(0);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (w0 + j < n) acc = w0 + j == 0 ? part[j] : op(acc, part[j]);
  }
  return acc;
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

// e4m3fn of the kElems float32 values n * inv (inv = 448 / m of the row; then the hardware's
// round-to-nearest-even cvt; satfinite never engages: |n * inv| < 464, see fp8.h), stored as
// kElems bytes at dst (8-byte aligned for 8 elements, 4-byte for 4).
template <int kElems>
__device__ __forceinline__ void store_e4m3(char* dst, const float* n, float inv) {
  uint32_t w[kElems / 4];
#pragma unroll
  for (int i = 0; i < kElems / 4; ++i) {
    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(n[4 * i], inv), __fmul_rn(n[4 * i + 1], inv)), __NV_SATFINITE,
        __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(n[4 * i + 2], inv), __fmul_rn(n[4 * i + 3], inv)),
        __NV_SATFINITE, __NV_E4M3);
    w[i] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  if constexpr (kElems == 8)
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  else
    *reinterpret_cast<uint32_t*>(dst) = w[0];
}

// Passes 2 and 3 of the quantised epilogue for the rows of one iteration (rmsnorm_rows: same
// (row, column) pairs per thread as its pass 2). inv[p]: the row's rsqrt of pair p. Contains a
// __syncthreads: every thread of the block calls it.
template <typename T, bool kWf32>
__device__ __forceinline__ void quant_pass(const ArTensors& t, const RowCfg& rc, int64_t rbase,
                                           int64_t row_end, const float* inv, float4* grp_r,
                                           uint32_t* s_amax) {
  constexpr int E = Vec<T>::kElems;
  constexpr int F4 = E / 4;
  constexpr int kP = kEpiPairs;
  constexpr int kWarps = kArThreads / 32;
  const int nr = rc.nr, kb = kP / rc.nr, tpr = rc.tpr, nvr = rc.nvr;
  const int group = threadIdx.x / tpr;
  const int lane = threadIdx.x % tpr;
  const int warps_per_group = tpr / 32;
  const int warp = threadIdx.x / 32;
  const char* wgt = static_cast<const char*>(t.weight);
  char* out = static_cast<char*>(t.out);
  // Pass 2: normed = (r * inv) * weight (the plain epilogue's instructions) over r in shared
  // memory; am[p]: this thread's amax bits of pair p's row.
  uint32_t am[kP];
#pragma unroll
  for (int p = 0; p < kP; ++p) am[p] = 0u;
  for (int c0 = lane; c0 < nvr; c0 += kb * tpr) {
#pragma unroll
    for (int p = 0; p < kP; ++p) {
      const int q = p % nr;
      const int64_t row = rbase + q;
      const int col = c0 + (p / nr) * tpr;
      if (row < row_end && col < nvr) {
        float fw[E];
        load_weight<T, kWf32>(wgt, col, fw);
        float4* src = grp_r + (size_t(q) * nvr + col) * F4;
#pragma unroll
        for (int f = 0; f < F4; ++f) {
          const float4 r4 = src[f];
          float4 o;
          o.x = __fmul_rn(__fmul_rn(r4.x, inv[p]), fw[4 * f]);
          o.y = __fmul_rn(__fmul_rn(r4.y, inv[p]), fw[4 * f + 1]);
          o.z = __fmul_rn(__fmul_rn(r4.z, inv[p]), fw[4 * f + 2]);
          o.w = __fmul_rn(__fmul_rn(r4.w, inv[p]), fw[4 * f + 3]);
          src[f] = o;
          am[p] = max_u32(am[p], max_u32(max_u32(abs_bits_f32(__float_as_uint(o.x)),
                                                 abs_bits_f32(__float_as_uint(o.y))),
                                         max_u32(abs_bits_f32(__float_as_uint(o.z)),
                                                 abs_bits_f32(__float_as_uint(o.w)))));
        }
      }
    }
  }
  probe(13);
  // Row q's amax: pairs p = q, q + nr, ... of this thread, then the warp, then the group's warps.
#pragma unroll
  for (int p = 0; p < kP; ++p)
#pragma unroll
    for (int p2 = p + 1; p2 < kP; ++p2)
      if (p2 % nr == p % nr) am[p] = max_u32(am[p], am[p2]);
#pragma unroll
  for (int p = 0; p < kP; ++p) {
    if (p < nr) {
      uint32_t m = am[p];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) m = max_u32(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
      if ((threadIdx.x & 31) == 0) s_amax[p * kWarps + warp] = m;
    }
  }
  __syncthreads();
  // Row q's amax (an integer max: order-free), once per row, not per pair.
  float qrow[kP];  // 448 / m of row q
#pragma unroll
  for (int q = 0; q < kP; ++q) {
    if (q < nr) {
      const uint32_t mb = max_u32(  // the floor; NaN bits exceed it: NaN propagates
          kAmaxFloorBits,
          fold_warp_partials<kWarps>(s_amax + q * kWarps + group * warps_per_group,
                                     warps_per_group,
                                     [](uint32_t a, uint32_t b) { return max_u32(a, b); }));
      const float m = __uint_as_float(mb);
      qrow[q] = __fdiv_rn(kFp8E4M3Max, m);
      if (lane == 0 && rbase + q < row_end) t.scale[rbase + q] = __fmul_rn(m, kInvFp8E4M3Max);
    }
  }
  float qmul[kP];  // 448 / m of pair p's row (p % nr)
#pragma unroll
  for (int p = 0; p < kP; ++p)
    qmul[p] = nr == 1 ? qrow[0] : nr == 2 ? qrow[p & 1] : qrow[p & 3];
  probe(14);
  // Pass 3: q = e4m3fn(normed * (448 / m)), E bytes per 16-byte input vector.
  for (int c0 = lane; c0 < nvr; c0 += kb * tpr) {
#pragma unroll
    for (int p = 0; p < kP; ++p) {
      const int q = p % nr;
      const int64_t row = rbase + q;
      const int col = c0 + (p / nr) * tpr;
      if (row < row_end && col < nvr) {
        float n[E];
        const float4* src = grp_r + (size_t(q) * nvr + col) * F4;
#pragma unroll
        for (int f = 0; f < F4; ++f) {
          const float4 n4 = src[f];
          n[4 * f] = n4.x;
          n[4 * f + 1] = n4.y;
          n[4 * f + 2] = n4.z;
          n[4 * f + 3] = n4.w;
        }
        store_e4m3<E>(out + (size_t(row) * nvr + col) * E, n, qmul[p]);
      }
    }
  }
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
template <typename T, bool kQuant, bool kWf32, class SumFn>
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
  // Quantised: per (row of the iteration, warp) amax bits (written and read between the same
  // barriers of one iteration; the next iteration writes them only after its pass-1 barrier).
  __shared__ uint32_t s_amax[kQuant ? kP * kWarps : 1];

  // The weight vectors of this thread's first pass-2 step into L1 now, while pass 1 waits for
  // the sum (the same columns for every row): pass 2 then does not wait for L2 after the
  // barrier. Costs no registers.
  if (row_begin < row_end) {
#pragma unroll
    for (int p = 0; p < kP; ++p) {
      const int col = lane + (p / nr) * tpr;
      if (col < nvr) prefetch_l1(weight_at<T, kWf32>(wgt, col));
    }
  }

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
        // The residual first: its loads do not depend on the peers, so their latency overlaps
        // the wait in sum_vec (a one-shot poll) instead of following it. Same values, same
        // arithmetic; aliasing (residual_out == residual) is unaffected: reading earlier.
#pragma unroll
        for (int p = 0; p < kP; ++p) {
          const int64_t row = rbase + p % NR;
          const int col = c0 + (p / NR) * tpr;
          if (row < row_end && col < nvr)
            rv[p] = *reinterpret_cast<const uint4*>(res + (size_t(row) * nvr + col) * 16);
        }
#pragma unroll
        for (int p = 0; p < kP; ++p) {
          const int64_t row = rbase + p % NR;
          const int col = c0 + (p / NR) * tpr;
          if (row < row_end && col < nvr) sv[p] = sum_vec(size_t(row) * nvr + col);
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
    probe(3);
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
    // Row q's total: the group's warp partials added in warp order, once per row, not per pair.
    float inv_row[kP];
#pragma unroll
    for (int q = 0; q < kP; ++q) {
      if (q < nr) {
        const float tot = fold_warp_partials<kWarps>(
            s_red + q * kWarps + group * warps_per_group, warps_per_group,
            [](float a, float b) { return __fadd_rn(a, b); });
        inv_row[q] = rsqrtf(__fadd_rn(__fdiv_rn(tot, float(t.norm_hidden)), t.eps));
      }
    }
    float inv[kP];  // pair p's row is p % nr (p is a constant after unrolling: no local memory)
#pragma unroll
    for (int p = 0; p < kP; ++p)
      inv[p] = nr == 1 ? inv_row[0] : nr == 2 ? inv_row[p & 1] : inv_row[p & 3];
    __syncthreads();  // s_red is reused by the next iteration
    probe(4);
    if constexpr (kQuant) {
      quant_pass<T, kWf32>(t, rc, rbase, row_end, inv, grp_r, s_amax);
      continue;
    }
    // Pass 2: normed = (r * inv) * weight.
    for (int c0 = lane; c0 < nvr; c0 += kb * tpr) {
#pragma unroll
      for (int p = 0; p < kP; ++p) {
        const int q = p % nr;
        const int64_t row = rbase + q;
        const int col = c0 + (p / nr) * tpr;
        if (row < row_end && col < nvr) {
          float fw[E], o[E];
          load_weight<T, kWf32>(wgt, col, fw);
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
    probe(5);
  }
}

}  // namespace dev
}  // namespace nvc
