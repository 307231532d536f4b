// The fused epilogue with each row held in registers by a group of kRowThreads threads: the
// variant of rmsnorm.cuh's rmsnorm_rows for rows of tpr == kArThreads (more than kArThreads / 2
// vectors: hidden > 2048 for 16-bit types, > 1024 for f32) and at most kVecs vectors per thread
// (kVecs = 8: hidden <= 8192 for 16-bit types, <= 4096 for f32; kVecs = 4: half that). Used by the world-1 row kernel
// (allreduce_local.cuh, one group per block) and the two-shot epilogue (allreduce_twoshot.cuh,
// kArThreads / kRowThreads groups per block), both of which read a row's sums from memory.
// (In the one-shot kernel, with Lamport polls as the sums, it spilled 84 bytes at 128
// registers: not used there.)
//
// Same bits as rmsnorm_rows: thread t of a group plays the virtual lanes t + kRowThreads * j
// (j < kRowLanes) of rmsnorm_rows' row group of kArThreads lanes, so every row is reduced in
// its shape: virtual lane l sums its columns l, l + kArThreads, ... in increasing order (fmaf
// from +0.0f), the virtual warp l / 32 with the xor butterfly (the group's physical warp
// t / 32 holds the virtual warps t / 32 + (kRowThreads / 32) * j), then the kArThreads / 32
// warp partials in warp order; r, residual_out, normed, and the FP8 amax (integer max:
// order-free), scale and q as rmsnorm.cuh defines them.
//
// Protocol of a group: the weights of the thread's columns are loaded once; rows rb + g,
// rb + g + G, ... (g = group, G = groups) each: the row's sums and residual (with kAhead
// requested one row ahead: the next row's loads fly during this row's barrier and pass 2), r,
// residual_out,
// partials into s_part[g][row parity], group barrier, total, normed (and for FP8 the amax into
// s_amax[g][parity], a second group barrier, q and the scale). Double-buffered partials make
// one barrier per row enough: row i writes buffer i % 2 only after every thread of the group
// passed row i - 1's barrier, i.e. finished reading buffer i % 2 of row i - 2.
// Group barriers: bar.sync 1 + g, kRowThreads (named barriers; 0 is __syncthreads), or
// __syncthreads when the block is one group.
// Aliasing (out / x, residual_out / residual): a thread writes only its own columns of a row,
// after it read them.
#pragma once
#include "rmsnorm.cuh"

namespace nvc {
namespace dev {

constexpr int kRowThreads = 128;                     // threads of a row group
constexpr int kRowLanes = kArThreads / kRowThreads;  // virtual lanes per thread

// kVecs: 16-byte vectors of a row per thread (a multiple of kRowLanes; 8 where a thread may use
// ~230 registers, 4 inside the 512-thread two-shot kernel's 128).
// Vectors per thread inside the 512-thread two-shot kernel (128 registers): rows up to hidden
// 4096 for 16-bit types, 2048 for f32; wider rows take rmsnorm_rows.
constexpr int kRowVecsIn512 = 4;

template <int kVecs>
NVC_HD bool rows_regs_ok(const RowCfg& rc) {
  return rc.tpr == kArThreads && rc.nvr <= kVecs * kRowThreads;
}

// Constant barrier ids (1 + group), so ptxas reserves only those.
template <int kGroups>
__device__ __forceinline__ void group_sync(int group) {
  static_assert(kGroups == 1 || kGroups == 4, "one group per block, or kArThreads / kRowThreads");
  if constexpr (kGroups == 1) {
    __syncthreads();
  } else {
    switch (group) {
      case 0: asm volatile("bar.sync 1, %0;" ::"n"(kRowThreads) : "memory"); break;
      case 1: asm volatile("bar.sync 2, %0;" ::"n"(kRowThreads) : "memory"); break;
      case 2: asm volatile("bar.sync 3, %0;" ::"n"(kRowThreads) : "memory"); break;
      default: asm volatile("bar.sync 4, %0;" ::"n"(kRowThreads) : "memory"); break;
    }
  }
}

// Rows rb + group, rb + group + step, ... below re, one group of kRowThreads threads each
// (blockDim.x == kGroups * kRowThreads; step = kGroups for a block's own range [rb, re), or
// the grid's row stride with one group per block). Every thread of the block calls it with
// the same arguments.
// sum_vec(i) returns 16-byte vector i (i = row * nvr + column) of the T-packed sums, from
// memory. It is called one row ahead of its use, so it must not wait for anything: a raw load,
// converted only where the row uses it (a conversion at the call waits for the load there, and
// the next row's loads no longer fly across this row's barrier: the world-1 kernel ran at 44%
// of copy bandwidth that way, 91% now). kSanitize: the vector is a raw input (world 1),
// sanitised at its use.
// kAhead: the weights are held in registers and the next row's sums and residual are
// requested before this row's barrier (more registers); else the weights are prefetched into
// L1 and loaded per row, and a row's sums at its start. kWf32 (a float32 weight, rmsnorm.cuh):
// the weights are never held (twice the registers): prefetched into L1 and read per row.
template <typename T, bool kQuant, bool kWf32, int kGroups, int kVecs, bool kAhead,
          bool kSanitize, class SumFn>
__device__ __forceinline__ void rmsnorm_rows_regs(const ArTensors& t, const RowCfg& rc,
                                                  int64_t rb, int64_t re, int64_t step,
                                                  SumFn&& sum_vec) {
  constexpr int E = Vec<T>::kElems;
  constexpr int kC = kVecs / kRowLanes;  // columns per virtual lane
  static_assert(kVecs % kRowLanes == 0, "whole columns per virtual lane");
  constexpr int kPW = kRowThreads / 32;     // physical warps of a group
  constexpr int kVW = kArThreads / 32;      // virtual warps of a row
  __shared__ float s_part[kGroups][2][kVW];
  __shared__ uint32_t s_amax[kGroups][2][kQuant ? kPW : 1];
  const int nvr = rc.nvr;
  const int group = int(threadIdx.x) / kRowThreads;
  const int tid = int(threadIdx.x) % kRowThreads, warp = tid / 32, lane = tid & 31;
  const char* res = static_cast<const char*>(t.residual);
  const char* wgt = static_cast<const char*>(t.weight);
  char* res_out = static_cast<char*>(t.residual_out);
  char* out = static_cast<char*>(t.out);
  // vector v = j * kC + c of this thread: virtual lane tid + kRowThreads * j, column
  // (tid + kRowThreads * j) + kArThreads * c
  auto col_of = [&](int v) { return tid + kRowThreads * (v / kC) + kArThreads * (v % kC); };
  const int64_t first = rb + group;
  if (first >= re) return;  // no row for this group (its threads take no group barrier)
  constexpr bool kHoldW = kAhead && !kWf32;  // the weights in registers
  uint4 wv[kHoldW ? kVecs : 1], sv[kVecs], rv[kVecs];
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    if (col_of(v) < nvr) {
      if constexpr (kHoldW) wv[v] = ld_nc_v4(wgt + size_t(col_of(v)) * 16);
      else prefetch_l1(weight_at<T, kWf32>(wgt, col_of(v)));  // registers are short: L1
    }
  }
  auto load_row = [&](int64_t row) {
    if (row >= re) return;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      if (col_of(v) < nvr) {
        const size_t i = size_t(row) * nvr + col_of(v);
        sv[v] = sum_vec(i);
        rv[v] = *reinterpret_cast<const uint4*>(res + i * 16);
      }
    }
  };
  load_row(first);
  int buf = 0;
  for (int64_t row = first; row < re; row += step, buf ^= 1) {
    const size_t rbase = size_t(row) * nvr;
    if (!kAhead && row != first) load_row(row);
    float r[kVecs][E];
    float ss[kRowLanes];
#pragma unroll
    for (int j = 0; j < kRowLanes; ++j) ss[j] = 0.f;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {  // a lane's columns in increasing order
      if (col_of(v) < nvr) {
        float fs[E], fr[E];
        unpack<T>(kSanitize ? sanitize_v4<T>(sv[v]) : sv[v], fs);
        unpack<T>(rv[v], fr);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          r[v][e] = __fadd_rn(fs[e], fr[e]);
          ss[v / kC] = __fmaf_rn(r[v][e], r[v][e], ss[v / kC]);
        }
        st_v4(res_out + (rbase + col_of(v)) * 16, pack<T>(r[v]));
      }
    }
    if constexpr (kAhead) load_row(row + step);  // in flight during the barrier and pass 2
#pragma unroll
    for (int j = 0; j < kRowLanes; ++j) {
      float p = ss[j];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) p = __fadd_rn(p, __shfl_xor_sync(0xFFFFFFFFu, p, off));
      if (lane == 0) s_part[group][buf][warp + kPW * j] = p;
    }
    group_sync<kGroups>(group);
    const float tot = fold_warp_partials<kVW>(s_part[group][buf], kVW,
                                              [](float a, float b) { return __fadd_rn(a, b); });
    const float inv = rsqrtf(__fadd_rn(__fdiv_rn(tot, float(t.norm_hidden)), t.eps));
    uint32_t am = 0u;
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      if (col_of(v) < nvr) {
        float fw[E];
        if constexpr (kHoldW) unpack<T>(wv[v], fw);
        else load_weight<T, kWf32>(wgt, col_of(v), fw);
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
      if (lane == 0) s_amax[group][buf][warp] = am;
      group_sync<kGroups>(group);
      uint32_t mb = kAmaxFloorBits;  // the floor; NaN bits exceed it: NaN propagates
#pragma unroll
      for (int w = 0; w < kPW; ++w) mb = max_u32(mb, s_amax[group][buf][w]);
      const float m = __uint_as_float(mb);
      const float qmul = __fdiv_rn(kFp8E4M3Max, m);
      if (tid == 0) t.scale[row] = __fmul_rn(m, kInvFp8E4M3Max);
#pragma unroll
      for (int v = 0; v < kVecs; ++v)
        if (col_of(v) < nvr) store_e4m3<E>(out + (rbase + col_of(v)) * E, r[v], qmul);
    }
  }
}

}  // namespace dev
}  // namespace nvc
