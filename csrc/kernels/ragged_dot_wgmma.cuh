// The Hopper wgmma main loop of the ragged_dot kernels (option kWgmma of kernels/ragged_dot.cuh;
// included by it, not used alone): the same items, pipeline, partial buffer and epilogue as the
// mma.sync kernel, with the MMAs of one stage issued as warpgroup-wide asynchronous
// wgmma.mma_async instructions that read both operands straight from shared memory (no
// ldmatrix, no operand registers).
//
// Swap AB as in the mma.sync kernel: D[m][n] = sum_k A[m][k] B[k][n] with m an output column of
// the weight tile (M = 64 per instruction), n a token row of the item (N = 8 x its n8 row tiles,
// 8 .. R, an immediate: the stage is compiled once per row-tile count and picked per item, as
// kSpecRows does), k16 per instruction; BK / 16 instructions per stage and weight.
//
// Warpgroups: one per 64-column TMA box (BN / 64 warpgroups, the Tile's MT = 1 so that warp w
// holds columns [16 w, 16 w + 16) of the tile exactly as an mma.sync warp of one m16 tile
// does). Chosen over one warpgroup looping over the boxes: the same 64-column box is the unit of
// the TMA load, of wgmma's M and of the balanced mode's skip test (a warpgroup whose box lies
// past the piece's width skips its MMAs as one), the accumulators stay at R / 2 floats per
// weight per thread (<= 64 for swiglu at R 64), and 2-4 warpgroups keep 8-16 warps issuing the
// lhs loads and the epilogue as before.
//
// Operand A = W^T, [64 columns (M)] x [16 k (K)] per instruction, M-major ("transposed",
// imm-trans-a = 1) in the TMA box [BK rows][64 columns = 128 B] with the 128-byte swizzle
// (16-byte chunk c of row k at chunk c ^ (k % 8), boxes 1 KB aligned). Descriptor: layout
// SWIZZLE_128B, start = box + kk x 16 rows x 128 B (2048 B: a multiple of the 1 KB swizzle atom,
// so the base offset stays 0), stride byte offset (SBO) 1024 = the step between the two 8-row
// groups along K, leading byte offset (LBO) = the step to the next 64 columns (BK x 128 B; never
// used for M = 64, one swizzle width). This is the canonical M-major SW128 layout
// ((8 elements, 8 chunks, m), (8 rows, k)) : ((1, 8, LBO), (64, SBO)) of the PTX ISA's
// "shared memory matrix layout" (CUTLASS spells the same as Layout_MN_SW128).
//
// Operand B = the item's token rows, [16 k (K)] x [N rows], K-major (imm-trans-b = 0), no
// swizzle: core matrices of 8 rows x 16 bytes (8 k), each 128 contiguous bytes, chunk c (k / 8)
// of row r at byte (c x R / 8 + r / 8) x 128 + (r % 8) x 16 of the stage's lhs tile. Descriptor:
// layout INTERLEAVE (none), start = tile + kk x 2 chunks x R x 16 B, LBO = R x 16 (the next 8 k
// of the same rows), SBO = 128 (the next 8 rows). The cp.async loads write these addresses
// (ragged_dot.cuh load(): pairs of threads take the two chunks of a 32-byte sector of a row,
// sixteen threads eight rows, so one warp writes four whole 128-byte core matrices).
//
// Accumulators: float32, the m64nNk16 D fragment: thread t of warp w of the warpgroup holds
// D[16 w + t / 4 (+ 8)][8 j + 2 (t % 4) (+ 1)] in registers 4 j + {0, 1, 2, 3} (rows (m) +8 for
// 2 and 3, columns (n) +1 for 1 and 3), which is the mma.sync m16n8 C fragment of row tile j of
// the warp's m16 tile: the kernel keeps its acc[w][0][j][e] array and its partial-buffer stores.
//
// Ordering (per stage, every thread): cp.async.wait_group of the stage's lhs rows, then
// fence.proxy.async.shared::cta (the rows were written by the generic proxy, wgmma reads through
// the async proxy), then the block barrier (every thread's rows fenced); the stage's TMA weights
// are async-proxy writes completed on its mbarrier (the wait suffices). Then, per warpgroup:
// wgmma.fence (the accumulators were last touched by ordinary instructions: zeroing, partial
// stores), the BK / 16 x NW instructions, wgmma.commit_group, wgmma.wait_group 0 before the
// stage ends: the slot is reloaded only after the next iteration's block barrier, so no
// instruction still reads it. The accumulators pass through an empty asm ("+f", memory) before
// the fence and after the wait so that the compiler moves no access of them across.
//
// Measured (one H200, docs/perf/ragged_dot.md): correct, not faster than the mma.sync loop once
// the epilogue takes the block barrier: in the package's tiles 32 experts x 128 tokens gate /
// down / swiglu 1.22 / 1.26 / 1.29x the weight-read bound against 1.20 / 1.23 / 1.18x, and
// BK 64 stages lose most (each stage waits for its MMAs before the block barrier).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace nvc {
namespace dev {
namespace rdot {
namespace wg {

// A wgmma shared-memory matrix descriptor: start address, LBO and SBO in 16-byte units (bits
// 0-13, 16-29, 32-45), base offset 0 (bits 49-51), layout type in bits 62-63 (0 none, 1 128-byte
// swizzle, 2 64-byte, 3 32-byte).
constexpr uint64_t kSwizzle128 = 1, kNoSwizzle = 0;
__device__ __forceinline__ uint64_t desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo,
                                         uint64_t layout) {
  return uint64_t((smem_addr & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (layout << 62);
}

// Byte offset of lhs element (row r, column k; k % 8 == 0) in a stage's lhs tile of R rows.
template <int R>
__device__ __forceinline__ uint32_t l_off(int r, int k) {
  return uint32_t((((k >> 3) * (R / 8) + (r >> 3)) << 7) + ((r & 7) << 4));
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wait0() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
__device__ __forceinline__ void proxy_fence() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accesses of the accumulators across the asynchronous MMAs.
template <int J>
__device__ __forceinline__ void pin(float (&d)[J][4]) {
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

// D[64 x N] += A (descriptor a, M-major) x B (descriptor b, K-major), float32 accumulators in
// d[0 .. N/8 - 1] (the first N / 2 registers of d).
template <class T, int N>
struct Mma64;

// The m64nNk16 shapes of both wgmma forms (this file's, A from shared memory; the 8-bit
// kernel's, A from registers: ragged_dot_w8_wgmma.cuh): X(N, the N / 2 accumulator operands,
// the six operand numbers after them (A's first, then what each form needs: B, scale-d), the
// accumulators' constraints).
#define NVC_WG_D4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define NVC_WG_SHAPES(X)                                    \
  X(8, "%0, %1, %2, %3",                                    \
    "4", "5", "6", "7", "8", "9",                           \
    NVC_WG_D4(0))                                           \
  X(16, "%0, %1, %2, %3, %4, %5, %6, %7",                   \
    "8", "9", "10", "11", "12", "13",                       \
    NVC_WG_D4(0), NVC_WG_D4(1))                             \
  X(24, "%0, %1, %2, %3, %4, %5, %6, %7, "                  \
    "%8, %9, %10, %11",                                     \
    "12", "13", "14", "15", "16", "17",                     \
    NVC_WG_D4(0), NVC_WG_D4(1), NVC_WG_D4(2))               \
  X(32, "%0, %1, %2, %3, %4, %5, %6, %7, "                  \
    "%8, %9, %10, %11, %12, %13, %14, %15",                 \
    "16", "17", "18", "19", "20", "21",                     \
    NVC_WG_D4(0), NVC_WG_D4(1), NVC_WG_D4(2), NVC_WG_D4(3)) \
  X(40, "%0, %1, %2, %3, %4, %5, %6, %7, "                  \
    "%8, %9, %10, %11, %12, %13, %14, %15, "                \
    "%16, %17, %18, %19",                                   \
    "20", "21", "22", "23", "24", "25",                     \
    NVC_WG_D4(0), NVC_WG_D4(1), NVC_WG_D4(2), NVC_WG_D4(3), \
    NVC_WG_D4(4))                                           \
  X(48, "%0, %1, %2, %3, %4, %5, %6, %7, "                  \
    "%8, %9, %10, %11, %12, %13, %14, %15, "                \
    "%16, %17, %18, %19, %20, %21, %22, %23",               \
    "24", "25", "26", "27", "28", "29",                     \
    NVC_WG_D4(0), NVC_WG_D4(1), NVC_WG_D4(2), NVC_WG_D4(3), \
    NVC_WG_D4(4), NVC_WG_D4(5))                             \
  X(56, "%0, %1, %2, %3, %4, %5, %6, %7, "                  \
    "%8, %9, %10, %11, %12, %13, %14, %15, "                \
    "%16, %17, %18, %19, %20, %21, %22, %23, "              \
    "%24, %25, %26, %27",                                   \
    "28", "29", "30", "31", "32", "33",                     \
    NVC_WG_D4(0), NVC_WG_D4(1), NVC_WG_D4(2), NVC_WG_D4(3), \
    NVC_WG_D4(4), NVC_WG_D4(5), NVC_WG_D4(6))               \
  X(64, "%0, %1, %2, %3, %4, %5, %6, %7, "                  \
    "%8, %9, %10, %11, %12, %13, %14, %15, "                \
    "%16, %17, %18, %19, %20, %21, %22, %23, "              \
    "%24, %25, %26, %27, %28, %29, %30, %31",               \
    "32", "33", "34", "35", "36", "37",                     \
    NVC_WG_D4(0), NVC_WG_D4(1), NVC_WG_D4(2), NVC_WG_D4(3), \
    NVC_WG_D4(4), NVC_WG_D4(5), NVC_WG_D4(6), NVC_WG_D4(7))

#define NVC_WG_ONE(N, TY, REGS, IA, IB, IS, ...)                                          \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" IS ", 0;\n"                       \
               " wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " {" REGS "}," \
               " %" IA ", %" IB ", p, 1, 1, 1, 0;\n}\n"                                    \
               : __VA_ARGS__                                                              \
               : "l"(a), "l"(b), "r"(1)                                                   \
               : "memory")
#define NVC_WG_DEF(N, REGS, O0, O1, O2, O3, O4, O5, ...)                                   \
  template <>                                                                              \
  struct Mma64<__nv_bfloat16, N> {                                                         \
    template <int J>                                                                       \
    static __device__ __forceinline__ void run(float (&d)[J][4], uint64_t a, uint64_t b) { \
      static_assert(J * 8 >= N, "accumulators");                                           \
      NVC_WG_ONE(N, "bf16", REGS, O0, O1, O2, __VA_ARGS__);                                 \
    }                                                                                      \
  };                                                                                       \
  template <>                                                                              \
  struct Mma64<__half, N> {                                                                \
    template <int J>                                                                       \
    static __device__ __forceinline__ void run(float (&d)[J][4], uint64_t a, uint64_t b) { \
      static_assert(J * 8 >= N, "accumulators");                                           \
      NVC_WG_ONE(N, "f16", REGS, O0, O1, O2, __VA_ARGS__);                                  \
    }                                                                                      \
  };

NVC_WG_SHAPES(NVC_WG_DEF)
#undef NVC_WG_DEF
#undef NVC_WG_ONE

// One stage of one warpgroup: BK / 16 k16 steps over the Tl::kNW weights, N = 8 x NRT rows.
// wbase: the stage's first weight tile (each Tl::kWBytes, [BN / 64 boxes][BK][128 B]); box:
// the warpgroup's 64-column box; lbase: the stage's lhs tile (layout of l_off<R>). Returns
// with the MMAs complete (the slot may be reloaded after the next block barrier).
template <class T, class Tl, int BK, int R, int NRT>
__device__ __forceinline__ void stage(float (&acc)[Tl::kNW][1][R / 8][4], uint32_t wbase, int box,
                                      uint32_t lbase) {
  static_assert(NRT >= 1 && NRT * 8 <= R && R <= 64, "wgmma N = 8 .. R <= 64");
#pragma unroll
  for (int w = 0; w < Tl::kNW; ++w) pin(acc[w][0]);
  fence();
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) {
    const uint64_t b = desc(lbase + uint32_t(kk * 2 * R * 16), R * 16, 128, kNoSwizzle);
#pragma unroll
    for (int w = 0; w < Tl::kNW; ++w) {
      const uint32_t a_addr = wbase + uint32_t(w * Tl::kWBytes + box * BK * 128 + kk * 2048);
      Mma64<T, NRT * 8>::run(acc[w][0], desc(a_addr, BK * 128, 1024, kSwizzle128), b);
    }
  }
  commit();
  wait0();
#pragma unroll
  for (int w = 0; w < Tl::kNW; ++w) pin(acc[w][0]);
}

}  // namespace wg
}  // namespace rdot
}  // namespace dev
}  // namespace nvc
