// The Hopper wgmma main loop of the 8-bit-weight ragged_dot kernels with A from registers
// (option kWgmmaRA of kernels/ragged_dot.cuh; included by it, not used alone): the same items,
// pipeline, scales, promotion, partial buffer and epilogue as the 8-bit mma.sync kernel ("8-bit
// weights" there); only a stage's MMAs change. Every thread still converts its own weight bytes
// into 16-bit A fragments in registers (w8_pair); the fragments feed warpgroup-wide
// wgmma.mma_async m64nNk16 instructions instead of mma.sync, which run asynchronously, so the
// conversion of k16 step s + 1 overlaps the MMAs of step s.
//
// Why (docs/perf/ragged_dot.md "8-bit weights v2"): at ~32 rows a group (the R 64 tile) the
// mma.sync kernel is bound by the warps' work per stage: per k16 step each warp converts its
// weights and then issues ldmatrix (the rows) + mma.sync in a dependent chain, two warps a
// scheduler to hide it. Here the rows come from shared memory through a descriptor (no
// ldmatrix, no B registers) and the tensor cores work while the warps convert.
// Measured: not yet (compile-checked: ptxas keeps the pipeline, no spills; the A/B on a GPU is
// tests/cuda_harness/run_w8_ab.sh, docs/perf/ragged_dot.md has the numbers once taken).
//
// Layout (swap AB as in the mma.sync kernel: D[m][n] = sum_k A[m][k] B[k][n], m a weight column,
// n a token row of the item):
//   Warpgroups: warps 4 v .. 4 v + 3 (the Tile needs a multiple of 4 warps). Warp w of a
//   warpgroup holds rows [16 (w % 4), 16 (w % 4) + 16) of each m64 instruction, i.e. its m16
//   tile i of the mma.sync kernel: instruction (weight, i) of a warpgroup multiplies the four
//   warps' m16 tiles i at once. Which tile column an m row stands for is each warp's business
//   (the 8-bit column order of ragged_dot.cuh, mcol): wgmma only needs each warp's A registers
//   and its D registers to agree, which they do, row for row.
//   A (registers): the wgmma m64nNk16 A fragment of warp w is the mma.sync m16n8k16 A fragment
//   ({a0, a1, a2, a3}: rows g / g + 8 x k 2t, 2t + 1 / 2t + 8, 2t + 9, g = lane / 4, t = lane %
//   4), exactly what the 8-bit conversion already writes.
//   B (shared memory): the item's token rows, K-major, no swizzle, 8-row x 16-byte core matrices
//   as the 16-bit wgmma loop lays them (kernels/ragged_dot_wgmma.cuh "Operand B", wg::l_off; the
//   same cp.async loads): descriptor start = tile + kk x 2 x R x 16 B, LBO = R x 16 (next 8 k),
//   SBO = 128 (next 8 rows); imm-trans-b = 0. N = 8 x the item's row tiles, an immediate (the
//   stage compiled once per count, picked per item).
//   D: float32, thread t of warp w holds D[16 (w % 4) + g (+ 8)][8 j + 2 t (+ 1)] in registers
//   4 j + {0, 1, 2, 3} = the mma.sync C fragment of row tile j of its m16 tile: the kernel's
//   tmp[w][i][j][e] as before, so the promotion, the partial stores and the epilogue are the
//   mma.sync kernel's.
//
// Ordering (per stage of BK / 16 = S k16 steps, S even; every thread of the warpgroup):
//   1. Entry: a[0] holds the fragments of step 0 (converted by the previous stage's tail, or by
//      the kernel before the block's first stage). The lhs rows of the stage were fenced for the
//      async proxy (fence.proxy.async after cp.async.wait_group) before the loop's block
//      barrier; the weights came by TMA (the stage's mbarrier wait).
//   2. Step s: wgmma.fence (orders this thread's writes of a[s % 2], and for s = 0 its
//      accesses of the accumulators: zeroing, the previous promotion's reads), the NW x MT
//      instructions (step 0 with scale-d 0 when the accumulators hold no sum) reading
//      a[s % 2], commit (one group a step). Then, if s + 1 < S: the weight bytes of step s + 1
//      loaded from shared memory into `raw` (registers no MMA reads, so before any wait: their
//      latency runs under the MMAs), wgmma.wait_group 1 (step s - 1 complete: a[(s + 1) % 2],
//      which it read, may be written) and the conversion of raw into a[(s + 1) % 2], while
//      step s runs.
//   3. Tail (after step S - 1's commit; steps S - 2 and S - 1 may be in flight): if the block has
//      a next stage, its mbarrier wait (its weights; no block barrier is needed for them: they
//      are TMA writes completed on the mbarrier, and the slot is re-armed only after a later
//      barrier) and the bytes of its step 0 into raw, then wait_group 1 (step S - 2, the last
//      reader of a[0], complete) and their conversion into a[0], while step S - 1 runs.
//   4. wgmma.wait_group 0: every MMA of the stage complete. Only now may (a) the promotion
//      acc += s x tmp (scale_mode 2: the stage is one 128-row K block, BK = 128; BK 64: every
//      second stage; modes 0 and 1: the unit's last stage) read tmp, for the item's NRT row
//      tiles only (compiled per count with the stage); tmp is not zeroed: the next stage's
//      first MMAs write it with scale-d 0 ("fresh"), (b) the epilogue store the accumulators,
//      (c) the next iteration's block barrier let thread 0 and the lhs loads refill this
//      stage's slot (the MMAs read its lhs rows from shared memory until they complete).
//   The accumulators pass through an empty asm ("+f", memory) before the first fence and after
//   the final wait, so the compiler moves no access of them into the asynchronous window; the
//   register A sets are asm inputs, written only at the places above (ptxas checks the
//   pipeline: no "wgmma.mma_async instructions are serialized" warning may appear).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "ragged_dot_wgmma.cuh"

namespace nvc {
namespace dev {
namespace rdot {
namespace wg {

template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// D[64 x N] = A (registers a, the warp's m16 rows) x B (descriptor b, K-major) + (acc ? D : 0),
// float32 accumulators d[0 .. N/8 - 1].
template <class T, int N>
struct MmaRA;

#define NVC_WGRA_ONE(N, TY, REGS, A0, A1, A2, A3, IB, IS, ...)                             \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" IS ", 0;\n"                           \
               " wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" REGS "},"  \
               " {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, %" IB ", p, 1, 1, 0;\n}\n"              \
               : __VA_ARGS__                                                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(acc)               \
               : "memory")
// the shapes of kernels/ragged_dot_wgmma.cuh (NVC_WG_SHAPES): a0 .. a3 the four operands
// after the accumulators, then b, then scale-d (acc: a predicate set from a register, as that
// file's form does)
#define NVC_WGRA_DEF(N, REGS, O0, O1, O2, O3, O4, O5, ...)                                   \
  template <>                                                                                \
  struct MmaRA<__nv_bfloat16, N> {                                                           \
    template <int J>                                                                         \
    static __device__ __forceinline__ void run(float (&d)[J][4], const uint32_t (&a)[4],     \
                                               uint64_t b, int acc) {                        \
      static_assert(J * 8 >= N, "accumulators");                                             \
      NVC_WGRA_ONE(N, "bf16", REGS, O0, O1, O2, O3, O4, O5, __VA_ARGS__);                     \
    }                                                                                        \
  };                                                                                         \
  template <>                                                                                \
  struct MmaRA<__half, N> {                                                                  \
    template <int J>                                                                         \
    static __device__ __forceinline__ void run(float (&d)[J][4], const uint32_t (&a)[4],     \
                                               uint64_t b, int acc) {                        \
      static_assert(J * 8 >= N, "accumulators");                                             \
      NVC_WGRA_ONE(N, "f16", REGS, O0, O1, O2, O3, O4, O5, __VA_ARGS__);                      \
    }                                                                                        \
  };

NVC_WG_SHAPES(NVC_WGRA_DEF)
#undef NVC_WGRA_DEF
#undef NVC_WGRA_ONE

// One stage of one warp's share of its warpgroup's MMAs (steps 1-4 of "Ordering" above):
// S = BK / 16 k16 steps, NW weights x MT m16 tiles an instruction set, N = 8 x NRT rows.
//   d: the accumulators [NW][MT][R / 8][4] (tmp of the 8-bit kernel); fresh: they hold no sum
//     (the first step writes rows 0 .. NRT - 1 with scale-d 0 instead of adding to them);
//   a: the two A register sets; a[0] holds step 0's fragments on entry;
//   lbase: the stage's lhs tile (wg::l_off<R> layout);
//   load(raw, kk): the weight bytes [NW][4] of step kk of this stage into raw (shared-memory
//     loads only); conv(a_set, raw): the A fragments [NW][MT][4] they make, into a_set;
//   next(raw): called once, after step S - 1 is issued: if the block has a next stage, the
//     bytes of its step 0 into raw (after its mbarrier wait) and true; else false.
// Returns with every MMA of the stage complete.
template <class T, int NW, int MT, int BK, int R, int NRT, class Load, class Conv, class Next>
__device__ __forceinline__ void ra_stage(float (&d)[NW][MT][R / 8][4],
                                         uint32_t (&a)[2][NW][MT][4], uint32_t lbase,
                                         bool fresh, Load&& load, Conv&& conv, Next&& next) {
  constexpr int S = BK / 16;
  static_assert(S % 2 == 0, "an even count of k16 steps a stage: step 0 always in a[0]");
  static_assert(NRT >= 1 && NRT * 8 <= R && R <= 64, "wgmma N = 8 .. R <= 64");
#pragma unroll
  for (int w = 0; w < NW; ++w)
#pragma unroll
    for (int i = 0; i < MT; ++i) pin(d[w][i]);
#pragma unroll
  for (int kk = 0; kk < S; ++kk) {
    fence();
    const uint64_t b = desc(lbase + uint32_t(kk * 2 * R * 16), R * 16, 128, kNoSwizzle);
#pragma unroll
    for (int w = 0; w < NW; ++w)
#pragma unroll
      for (int i = 0; i < MT; ++i)
        MmaRA<T, NRT * 8>::run(d[w][i], a[kk & 1][w][i], b, kk > 0 || !fresh);
    commit();
    uint32_t raw[NW][4];
    bool more = true;
    if (kk + 1 < S) load(raw, kk + 1);
    else more = next(raw);
    wait<1>();
    if (more) conv(a[(kk + 1) & 1], raw);  // step S's set is a[0]: the next stage's step 0
  }
  wait<0>();
#pragma unroll
  for (int w = 0; w < NW; ++w)
#pragma unroll
    for (int i = 0; i < MT; ++i) pin(d[w][i]);
}

}  // namespace wg
}  // namespace rdot
}  // namespace dev
}  // namespace nvc
