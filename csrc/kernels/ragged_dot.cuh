// Grouped matrix product of MoE experts for decode and small prefill (lax.ragged_dot's MoE form):
//   out[r, :] = lhs[r, :] @ rhs[g(r), :, :]    for r < total = min(sum(max(group_sizes, 0)), M)
//   out[r, :] = 0                               for total <= r < M
// lhs [M, K] with rows sorted by group, rhs [G, K, N], group_sizes int32 [G] (device memory),
// out [M, N]. Group g owns rows [start_g, end_g): start_g = min(sum of max(sizes) before g, M),
// end_g = min(start_g + max(size_g, 0), M) (a sum past M is clipped as lax does). bf16 or f16
// operands, float32 accumulation, the result rounded once to out's dtype (T or float32).
// ragged_dot_swiglu is the same pass over two weights of one shape: out = silu(lhs@Wg) *
// (lhs@Wu), both products summed in float32, silu(x) = x / (1 + exp(-x)) in float32, rounded once.
//
// The two numbers (one H200; hidden 7168, F 2048, top-8, bf16; measured ceilings in the bench):
//   bytes: only the weights of groups that have rows must be read: 29.4 MB per expert matrix
//     (7168 x 2048 x 2 B). 32 experts, 128 tokens: all 32 have rows, 940 MB -> 196 us at
//     4.8 TB/s; 8 tokens: ~28 of 32 -> ~171 us; 256 experts, 8 / 32 / 128 tokens: ~56 / ~163 /
//     ~251 experts -> 0.34 / 1.0 / 1.54 ms. lhs and out are < 30 MB and are re-read from L2.
//   flops: 2 x rows per weight element: at 32 rows per group 32 FLOP per weight byte, i.e.
//     4.8 TB/s x 32 = 154 TFLOP/s to keep pace with the stream; at 64 rows 307 TFLOP/s. FFMA
//     gives ~60; mma.sync m16n8k16 (~600 TFLOP/s dense bf16) keeps the product bandwidth-bound
//     up to ~64 rows per group, which is where this kernel stops and XLA's GEMM takes over.
//
// Work decomposition ("swap AB": the weight tile is the MMA's M side, the few token rows its N
// side, so one n8 tile serves 1..8 rows without padding them to 16 or 64):
//   item = (group g with rows, N tile of BN columns, row chunk of up to R rows); items of one
//   group are numbered N tile major, row chunk minor (the chunks of one tile run together and
//   share its weights through L2). Items are enumerated on the device from group_sizes (every
//   block scans them into shared memory: no host sync, the grid does not depend on them).
//   A cluster of CS blocks (thread-block cluster) takes items cid, cid + clusters, ...; block
//   rank c of the cluster streams K steps [c*KT/CS, (c+1)*KT/CS) of the item (split-K, KT =
//   ceil(K / BK), CS <= KT so that every rank has one): several MB of weights in flight across
//   the persistent grid (max resident clusters) without any item being larger than ~1/CS of
//   a tile.
//   Each block: STAGES-deep cp.async (16-byte, L1-bypassing) pipeline of [BK x BN] weight tiles
//   (and the item's [R x BK] lhs rows), running ahead across item boundaries, so the epilogue of
//   one item overlaps the loads of the next (measured: cp.async streams the weights at
//   ~3.9 TB/s here; 256-byte bulk copies issued by one warp, cp.async.bulk + mbarrier, ran
//   3-10x slower). Warps split the BN columns (MT m16 tiles each); ldmatrix.trans gives the weight
//   fragments from the [k][n] layout, ldmatrix the row fragments, mma.sync.m16n8k16 (f32
//   accumulators) only for the row tiles that hold rows.
//   That is the kernel with OPT = 0. The package's tiles (cuda/ragged_dot_family.cuh) load the
//   weights by TMA (kTma), compile the MMA loop per row count (kSpecRows), run clusters of one
//   block with a block-barrier epilogue (kCtaSync) and at R 16 split the last round's items
//   along K (kSplitK): 1.13-1.26x the weight-read bound per product at the decode shapes above
//   (docs/perf/ragged_dot.md, v4).
//
// Balanced ranges (option kBalanced): whole items dealt round-robin leave the grid unevenly loaded
// when the item count is not a multiple of the clusters (32 experts x 8 tokens, gate: ~28 groups
// x 8 N tiles = 224 items on 132 SMs, two rounds for 1.7 rounds of work: ~0.85 of the stream).
// Instead the work is counted in units of UW columns (64, or 32 with kUnit32) of one row chunk
// of one group: U = sum over groups of chunks x ceil(N / UW), numbered group, chunk, column strip.
// Cluster c takes units [c*U/ncl, (c+1)*U/ncl) (a difference of at most one unit between
// clusters) and walks them as pieces: maximal runs of units in one (group, chunk), at most BN / UW
// units (one tile) wide. A piece is an item of width nw <= BN: the weight columns past nw are not
// loaded (zeros), warps whose columns all lie past nw skip their MMAs, and the epilogue stores
// columns < nw only. Neighbouring clusters stream neighbouring column strips of one group, so the
// chunks of a group with more than R rows (numbered next to each other) meet in L2 as before.
// Measured (one H200, cp.async weights): slower than round robin at every decode shape (32 x 8
// gate 2.37x the bound against 1.49x). A reading: round robin has the CTAs of one group's N
// tiles streaming the same K rows together, so each weight row is read whole while its DRAM
// pages are open; contiguous strip ranges start ~5 CTAs per group at different strips. The
// package uses it only where it measured faster, always with TMA weights (R 64; R 16 gate-shaped
// products over >= 128 groups: cuda/ragged_dot_family.cuh).
//
// Split-K units (option kSplitK; round-robin items, clusters of one block): the I items of a
// call are few at decode sizes (32 experts x 8 tokens, gate: ~26 groups x 8 N tiles = 208 items
// on 132 SMs, two rounds for 1.6 rounds of work). The items of the full rounds (the first
// DI = I - I % blocks) stay whole; only the TL = I % blocks items of the last round are cut
// along K into KS units each (the "data-parallel + split" hybrid: the split's cost is paid on
// the tail only). KS (1 .. ks_max, each unit at least 4 K steps) is chosen on the device, the
// same in every block, as the count that minimises ceil(TL x KS / blocks) x (1 / KS + e) (the
// tail's rounds in items' time, e = a split unit's epilogue over an item's stream time). Units:
// u < DI is item u; then the tail's, numbered split, item: item DI + j % TL, split j / TL
// (j = u - DI), dealt on round robin with the rest, so the blocks of one round stream the same
// K rows of the tail items' N tiles together. A split unit owns K steps
// [ks x KT / KS, (ks + 1) x KT / KS) of its item. Its epilogue writes its float32 partial (the
// item's rows x columns) into plane ks of the workspace, then (block barrier; the last thread:
// fence.acq_rel.gpu, atomicAdd on the tail item's counter, fence) the unit that counts KS - 1
// sums the KS planes in split order 0 .. KS-1 (its own from shared memory: the same values),
// applies the epilogue, rounds once and stores: the same bits whichever unit comes last, and
// every unit's result reaches out exactly once. The last thread counts because with TMA weights
// it has no copies of its own in flight (measured: a fence in a thread with cp.async in flight
// waits for them, a pipeline drain per unit). Workspace (launcher, ragged_dot.h): counters
// [counters_n] int32, zeroed by one memset before the kernel (a graph node under capture), then
// planes [ks_max][NW][M][N] float32; no plane needs zeroing (a unit reads only its item's
// region, which every unit of that item writes before it counts). KS = 1 (no workspace, no
// tail, or no split pays) is the round-robin kernel as above.
//
// Per-row-count MMA loop (option kSpecRows): the loop over the n8 row tiles of an item (1 .. R/8)
// compiled once per count and picked per item, instead of R/8 runtime tests inside the k loop
// (behind which the compiler cannot hoist the next tile's ldmatrix).
//
// TMA weights (option kTma): thread 0 arms the stage's mbarrier with its bytes (boxes x BK x 128
// B x weights) and issues one cp.async.bulk.tensor.3d per box of 64 columns (the map is [G, K, N]
// with N innermost: rows past K and columns past N are out of bounds and arrive as zeros, never
// the next group's rows); every thread waits on the stage's mbarrier (parity = (stage / STAGES)
// & 1) after the block barrier that also retires the cp.async lhs rows. A slot is re-armed only
// after the block barrier of the next iteration, which every thread passes after its wait on the
// slot's previous phase, so no thread waits on a phase already overtaken. The smem weight tile
// is [BN / 64 boxes][BK rows][128 B] with 16-byte chunk c of row k at chunk c ^ (k % 8) (the
// 128-byte swizzle; stages aligned to 1 KB): the eight rows one ldmatrix reads sit in distinct
// bank groups.
//
// Hopper wgmma (option kWgmma, with kTma; kernels/ragged_dot_wgmma.cuh): the stage's MMAs as
// warpgroup-wide wgmma.mma_async m64nNk16 reading both operands from shared memory, one
// warpgroup per 64-column TMA box (MT = 1: warp w still owns columns [16 w, 16 w + 16), and the
// accumulators keep the mma.sync fragment layout, so the partial stores and the epilogue are
// the same). A = the weight box as it arrives by TMA (M-major, 128-byte swizzle); B = the lhs
// rows, written by cp.async as 8-row x 16-byte core matrices (no swizzle) instead of [R][BK+8]
// rows; N = 8 x the item's row tiles (an immediate: compiled per count, always). Per stage:
// cp.async wait, fence.proxy.async, block barrier, mbarrier wait; per warpgroup wgmma.fence,
// the instructions, commit, wait_group 0 (the slot is free at the next barrier). In balanced
// mode a whole warpgroup skips its MMAs when its box lies past the piece's width.
//
// 8-bit weights (template argument TW = int8_t or __nv_fp8_e4m3; Tile WB = 1; kTma, mma.sync,
// the per-count loop, round robin): the same work list, split-K units and graph capture as the
// 16-bit kernel; the weight stream, the MMA operands and the accumulation change.
//   Stream: TMA boxes of 128 columns (128 B) x BK rows, 128-byte swizzle (w8_off): half the
//   bytes of the 16-bit stage at the same BN x BK.
//   Operands, in registers (no dequantised copy in shared memory, no extra barrier): the mma's
//   m16 rows are tile columns in a thread-owned order. A warp owns columns [col0, col0 + 16 MT)
//   as before; thread (g = lane / 4, t = lane % 4) owns the 2 MT consecutive columns
//   [w8c, w8c + 2 MT), w8c = col0 + 2 MT g, and byte b of them is m row g + 8 (b % 2) of
//   m16 tile b / 2 (mcol). A k16 step reads, per weight, the thread's bytes of rows 2t, 2t + 1,
//   2t + 8, 2t + 9 (one 32-bit load a row for MT 2, 16-bit for MT 1: conflict-free, w8_off),
//   and w8_pair turns byte pairs of rows (2t, 2t + 1) and (2t + 8, 2t + 9) into the 16-bit
//   pairs of the A fragment by integer and half-precision bit tricks, exactly (int8 -> T and
//   e4m3 -> T are exact for bf16 and f16: |int8| <= 128 needs 8 significant bits; e4m3 has 4
//   and exponents 2^-9 .. 2^8). The k order of the fragment is the mma's own, so the lhs
//   rows' ldmatrix is unchanged.
//   Accumulation: the MMAs accumulate into float32 tmp; a promotion acc += s x tmp per column
//   (one FFMA), tmp = 0, comes at the end of each 128-row K block of scales for scale_mode 2
//   (s = scale[g, k / 128, n / 128]; BK divides 128, so a stage lies in one block: DeepGEMM's
//   promotion of a float32 partial) and at the end of the unit for modes 0 (s = 1) and 1
//   (s = scale[g, n], applied once). The scales come into the stage's shared memory by
//   cp.async with its lhs rows, STAGES - 1 stages before their use (mode 2: [NW][BN / 128] every
//   stage; mode 1: [NW][BN] at the unit's last stage; measured: a block scale read from global
//   memory at the promotion cost an L2 round trip a stage, ~+0.3 x the bound). Exact up to
//   float32 summation order for every mode (no rounding of w x s to 16 bits). The epilogue
//   (split-K sums, swiglu, rounding once) is the 16-bit kernel's, with the 8-bit column order
//   (mcol). Needs K % 16 == 0 and N % 16 == 0 (the map's 16-byte row stride;
//   ragged_dot_check).
//   wgmma (option kWgmmaRA; kernels/ragged_dot_w8_wgmma.cuh has its protocol): the same
//   fragments feed wgmma.mma_async m64nNk16 with A from registers (warp w of a warpgroup gives
//   rows [16 (w % 4), 16 (w % 4) + 16) of the m64: its m16 tile i) and B = the lhs rows from
//   shared memory in kWgmma's core-matrix layout; the conversion of k16 step s + 1 runs while
//   the MMAs of step s do (two A register sets, wait_group 1), the next stage's step 0 while
//   the stage's last ones do; the promotion reads tmp after wait_group 0 at the stage's end.
//   Selected in the harness's A/B builds by NVC_W8_R64_WG (cuda/ragged_dot_family.cuh).
// Measured (one H100, docs/perf/ragged_dot.md "8-bit weights v2"): 1.09-1.30x the 8-bit
// bound at the decode shapes with column scales, 1.11-1.45x with block scales, 1.43-1.78x at
// ~32 rows a group (the R 64 tile: the warps' conversion + mma.sync chain per stage bounds it);
// 1.6-2.2x faster than the 16-bit kernel on 16-bit weights.
// History (docs/perf/ragged_dot.md "8-bit weights v1"): the first version converted each stage
// into a 16-bit swizzled copy in shared memory behind a block barrier (conversion units:
// I2F, f8 -> f16 -> f32 -> T) and ran the 16-bit ldmatrix path on it: 2.5-4.1x the 8-bit
// bound, the conversion and its barrier the limit.
//
// Reduction of the split-K partials: deterministic, through distributed shared memory. Each
// block writes its float32 partial [rows x BN] to its own shared memory; cluster barrier; block
// c sums slice c of the tile over ranks 0..CS-1 in that order (remote shared-memory reads),
// applies the epilogue (swiglu), rounds once and stores its slice of out; cluster arrive, whose
// wait comes before the partial buffer is written again (or before the block exits). Chosen
// over float32 atomics into a workspace: bitwise reproducible, no workspace, no memset, no
// extra pass over out, and the partials never leave the GPC. (Measured on one H200: the package
// runs CS = 1, where the reduction is a read of the block's own partials; split-K over 2-8
// blocks cost more than the balance it bought at the decode shapes: cuda/ragged_dot_family.cuh.)
//
// Shared memory (dynamic, one block): STAGES x { W [BK][BN+8] T (x2 for swiglu), L [R][BK+8] T }
// (8-bit weights: W [BN/128][BK][128] bytes, swizzled; after L the scales [NW][BN] float32) then P [NW][R][BN+4] float32 (NW = 2 for swiglu), then int32 gstart[kMaxGroups+1],
// istart[kMaxGroups+1] (row and item / unit prefixes). The +8 / +4 pads make ldmatrix rows and
// the partial stores conflict-free. kTma: W is [BN/64][BK][64] swizzled (above), the stages are
// rounded up to 1 KB and start at the first 1 KB boundary, and STAGES mbarriers (8 B) follow
// istart. kWgmma, kWgmmaRA: L is [BK / 8 chunks][R / 8 row groups][8 rows][16 B] (wgmma core
// matrices).
//
// Invariants (checked by the launcher, cuda/ragged_dot.cu): K % 8 == 0 and N % 8 == 0 (16-byte
// rows for cp.async); lhs, rhs, out 16-byte aligned; 1 <= G <= kMaxGroups; M, items < 2^31;
// CS <= KT. Out-of-range K columns and N columns load as zeros (cp.async src-size 0) and are
// never stored; row slots past an item's rows load as zeros and their results are discarded.
// Every block of a cluster walks the same item list, so the cluster barriers pair up. The tail
// rows [total, M) are zeroed by all blocks, before any item (disjoint from the items' rows).
// Graph-capturable: one launch, no host state, nothing read back.
#pragma once
#include <cooperative_groups.h>
#include <cuda.h>  // CUtensorMap (a plain struct: no driver call from here)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ragged_dot_w8_wgmma.cuh"
#include "ragged_dot_wgmma.cuh"

namespace nvc {
namespace dev {
namespace rdot {

constexpr int kMaxGroups = 1024;

// Kernel options (the OPT template argument, a bit set; 0 is the kernel described first above):
//   kBalanced: equal work ranges per cluster in units of kUnitCols columns (see "Balanced
//     ranges" above) instead of whole BN items dealt round-robin.
//   kSpecRows: the MMA loop compiled once per count of n8 row tiles (1 .. R/8) and picked per
//     item, so that no ldmatrix of the rows waits behind a runtime branch.
//   kPf256: the weight cp.async ask L2 for 256-byte sectors (.L2::256B prefetch size).
//   kUnit32: balanced units of 32 columns instead of 64.
//   kTma: the weight tiles by TMA (cp.async.bulk.tensor.3d over [G, K, N], boxes of BK x 64
//     columns, 128-byte swizzle, one mbarrier per stage armed with the stage's bytes by thread
//     0); the lhs rows stay on cp.async. See "TMA weights" above.
//   kSplitK: the last round's items split along K into KS units, dealt round-robin, summed
//     through a global float32 workspace by the unit that finishes last (see "Split-K units"
//     above; round-robin items only, clusters of one block).
//   kWgmma: the MMAs by wgmma (with kTma, MT = 1, R <= 64; per-count loop implied). See "Hopper
//     wgmma" above.
//   kCtaSync: clusters of one block (the launcher forces cs = 1), so the epilogue orders its
//     partials with one block barrier and reads them from its own shared memory, instead of
//     two cluster barriers and reads through the cluster window (distributed shared memory).
//   kWgmmaRA: 8-bit weights only: the MMAs by wgmma with A (the converted weight fragments)
//     from registers and B (the lhs rows, wgmma core-matrix layout as kWgmma's) from shared
//     memory, the conversion of k16 step s + 1 overlapping the MMAs of step s (a multiple of
//     4 warps, BK / 16 even). See kernels/ragged_dot_w8_wgmma.cuh.
// The package's tiles (cuda/ragged_dot_family.cuh) use kSpecRows | kTma | kCtaSync, and at
// R 16 kSplitK; the other options are the sweep's (measured slower at the decode shapes).
constexpr int kBalanced = 1, kSpecRows = 2, kPf256 = 4, kUnit32 = 8, kTma = 16, kSplitK = 32,
              kWgmma = 64, kCtaSync = 128, kWgmmaRA = 256;
// Split-K units: at most this many per item (the workspace's planes; ragged_dot.h).
constexpr int kMaxSplits = 8;
template <int OPT>
constexpr int unit_cols() { return (OPT & kUnit32) ? 32 : 64; }

struct Params {
  const void* lhs;             // [M, K] T
  const void* rhs;             // [G, K, N] T (swiglu: the gate weights)
  const void* rhs2;            // swiglu: the up weights [G, K, N]; else nullptr
  const int32_t* group_sizes;  // [G]
  void* out;                   // [M, N] TO
  int m, k, n, g;
  // kTma kernels: the tensor maps of rhs and rhs2 (3-d: N, K, G; box 64 x BK x 1, 128-byte
  // swizzle), encoded by the launcher; unused otherwise
  CUtensorMap tmap[2];
  // kSplitK kernels: partial planes [ks_max][NW][M][N] float32 and one arrival counter per item
  // (zeroed by the launcher before the kernel), counters_n of them; ks_max <= kMaxSplits
  // planes fit in the workspace (1: no split). Unused otherwise.
  float* ws;
  int* counters;
  int counters_n, ks_max;
  // 8-bit weight kernels (TW of one byte; see "8-bit weights" above): the float32 scales of
  // rhs and rhs2 and their mode (0 none, 1 [G, N] per output channel, 2 [G, ceil(K / 128),
  // ceil(N / 128)] per 128 x 128 block). Unused by the 16-bit kernels.
  const float* scale;
  const float* scale2;
  int scale_mode;
};

template <int BN, int BK, int R, int STAGES, int MT, bool SWIGLU, int OPT = 0, int WB = 2>
struct Tile {
  static constexpr bool kTmaW = (OPT & 16) != 0;  // kTma
  static constexpr bool kWg = (OPT & 64) != 0;    // kWgmma
  static constexpr bool kWgRA = (OPT & 256) != 0;  // kWgmmaRA
  static constexpr bool kLCore = kWg || kWgRA;      // lhs rows as wgmma core matrices
  static constexpr int kWarps = BN / (16 * MT);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kNW = SWIGLU ? 2 : 1;
  static constexpr int kWStride = kTmaW ? BN : BN + 8;  // elements per smem weight row (cp.async)
  static constexpr int kLStride = kLCore ? BK : BK + 8;  // elements per smem lhs row (wgmma: none)
  static constexpr int kPStride = BN + 4;   // floats per partial row
  static constexpr int kWBytes = BK * kWStride * 2;
  static constexpr int kLBytes = R * kLStride * 2;
  static constexpr int kAlign = kTmaW ? 1024 : 16;  // TMA: 128-byte-swizzle atoms of 1 KB
  // 8-bit weights (WB == 1): a stage holds the [BN / 128][BK][128] byte boxes as TMA brings
  // them (128-byte swizzle), read by the MMA loop straight into registers (no other buffer)
  static constexpr bool kW8 = WB == 1;
  static constexpr int kWSBytes = kW8 ? BK * BN : kWBytes;  // one weight's tile in a stage
  // 8-bit weights: the stage's scales after its lhs rows (see "8-bit weights"): [kNW][BN]
  // float32 (scale_mode 1, the unit's last stage) or [kNW][BN / 128] (mode 2, every stage)
  static constexpr int kSBytes = kW8 ? kNW * BN * 4 : 0;
  static constexpr int kStageBytes =
      (kNW * kWSBytes + kLBytes + kSBytes + kAlign - 1) / kAlign * kAlign;
  static constexpr int kPBytes = kNW * R * kPStride * 4;
  // TMA: up to 1 KB to align the stages, and one 8-byte mbarrier per stage
  static constexpr int kSmem = (kTmaW ? 1024 + STAGES * 8 : 0) + STAGES * kStageBytes +
                               kPBytes + 2 * (kMaxGroups + 1) * 4;
  static_assert(WB == 2 || (WB == 1 && kTmaW && !kWg && 128 % BK == 0 && BN % 128 == 0 &&
                            (MT == 1 || MT == 2) && (OPT & 3) == 2),
                "8-bit weights: TMA boxes of 128 columns, mma.sync of 1 or 2 m16 tiles a warp, "
                "the per-count loop, round robin, K steps within one 128-row scale block");
  static_assert(BN % (16 * MT) == 0 && BK % 16 == 0 && R % 8 == 0, "tile shape");
  static_assert(!kTmaW || (BN % 64 == 0 && BK <= 256), "TMA boxes of 64 columns, BK rows");
  static_assert(!kWg || (kTmaW && MT == 1 && R <= 64), "wgmma: TMA weights, a warpgroup a box");
  static_assert(!kWgRA || (kW8 && kWarps % 4 == 0 && (BK / 16) % 2 == 0 && R <= 64),
                "wgmma with register A: 8-bit weights, whole warpgroups, an even count of k16 "
                "steps a stage");
  static_assert(kStageBytes % 16 == 0 && kPBytes % 16 == 0, "16-byte smem sections");
  static_assert(kSmem <= 227 * 1024 - 1024, "shared memory of one block (static: 128 B)");
};

template <class T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp16_pf(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// One box of a 3-d tensor map into shared memory; completion counted on `bar` (bytes).
__device__ __forceinline__ void tma_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1,
                                       int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(uint32_t& r0, uint32_t& r1, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r0), "=r"(r1)
               : "r"(addr));
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

template <class TO> __device__ __forceinline__ void store4(TO* dst, float4 v);
template <> __device__ __forceinline__ void store4<float>(float* dst, float4 v) {
  *reinterpret_cast<float4*>(dst) = v;
}
template <> __device__ __forceinline__ void store4<__nv_bfloat16>(__nv_bfloat16* dst, float4 v) {
  __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
  uint2 u;
  u.x = *reinterpret_cast<uint32_t*>(&a);
  u.y = *reinterpret_cast<uint32_t*>(&b);
  *reinterpret_cast<uint2*>(dst) = u;
}
template <> __device__ __forceinline__ void store4<__half>(__half* dst, float4 v) {
  __half2 a = __floats2half2_rn(v.x, v.y), b = __floats2half2_rn(v.z, v.w);
  uint2 u;
  u.x = *reinterpret_cast<uint32_t*>(&a);
  u.y = *reinterpret_cast<uint32_t*>(&b);
  *reinterpret_cast<uint2*>(dst) = u;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

// 8-bit weights straight into mma.sync A fragments (see "8-bit weights"). w8_pair<T, TW>(a, b,
// J): the pair of T (low half: byte J of a, high half: byte J of b), exactly (J a constant after
// unrolling: PRMT immediates); 3-5 integer / half-precision operations a pair.
//   f16 x int8:  0x6400 | (byte ^ 0x80) is the f16 1024 + u (u = v + 128 < 1024: step 1), one
//                LOP3 builds both halves; minus 1152 (HADD2) is v.
//   bf16 x int8: v = (v & 0x7f) - 128 s (s its sign bit): 0x4300 | (v & 0x7f) is the bf16
//                128 + (v & 0x7f) (step 1 in [128, 256)), 0x4300 | (s << 7) is 128 + 128 s; their
//                difference (HSUB2; both exact integers, the result has <= 8 bits) is v.
//   f16 x e4m3:  cvt.rn.f16x2.e4m3x2 (exact: f16 holds every e4m3 value).
//   bf16 x e4m3: s.eeee.mmm -> s | eeeemmm << 4 is the bf16 whose value is v x 2^-120 for every
//                v, subnormals included (bias 127 against 7; e4m3 subnormal m x 2^-9 lands on
//                the bf16 subnormal m x 2^-129); x 2^120 (HMUL2, exact: a power of two, the
//                result normal) gives v.
template <class T, class TW>
__device__ __forceinline__ uint32_t w8_pair(uint32_t a, uint32_t b, int j) {
  // bytes 0 and 1 of the result: byte j of a, byte j of b (2 and 3: the same again)
  const uint32_t lo_hi = uint32_t(j) | (uint32_t(j + 4) << 4) | (uint32_t(j) << 8) |
                         (uint32_t(j + 4) << 12);
  // bytes 0 and 1: byte j of a; bytes 2 and 3: byte j of b (each 16-bit half holds its
  // weight in both bytes; the conversions keep the byte they need and mask the other)
  const uint32_t dup = uint32_t(j) | (uint32_t(j) << 4) | (uint32_t(j + 4) << 8) |
                       (uint32_t(j + 4) << 12);
  if constexpr (std::is_same_v<TW, int8_t> && std::is_same_v<T, __half>) {
    const uint32_t x = (__byte_perm(a, b, dup) & 0x00ff00ffu) ^ 0x64806480u;
    const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&x),
                              __half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480)));
    return *reinterpret_cast<const uint32_t*>(&h);
  } else if constexpr (std::is_same_v<TW, int8_t>) {
    const uint32_t x = __byte_perm(a, b, dup);
    const uint32_t lo7 = (x & 0x007f007fu) | 0x43004300u, sgn = (x & 0x00800080u) | 0x43004300u;
    const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&lo7),
                                     *reinterpret_cast<const __nv_bfloat162*>(&sgn));
    return *reinterpret_cast<const uint32_t*>(&r);
  } else if constexpr (std::is_same_v<T, __half>) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
        __nv_fp8x2_storage_t(__byte_perm(a, b, lo_hi) & 0xffffu), __NV_E4M3);
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
  } else {
    const uint32_t x = __byte_perm(a, b, dup);
    const uint32_t y = (x & 0x80008000u) | ((x >> 4) & 0x07f007f0u);
    const __nv_bfloat162 r =
        __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&y),
                __nv_bfloat162(__ushort_as_bfloat16(0x7B80), __ushort_as_bfloat16(0x7B80)));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
}

// Exclusive prefix of v over the block, one element per thread per call (any block size that
// is a multiple of 32, <= 1024); returns the exclusive prefix, *total the block's sum.
__device__ __forceinline__ int block_exclusive_scan(int v, int* scratch, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) scratch[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < nw ? scratch[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    if (lane < nw) scratch[lane] = w;  // inclusive prefix of the warp sums
  }
  __syncthreads();
  const int before = (warp > 0 ? scratch[warp - 1] : 0) + x - v;
  *total = scratch[nw - 1];
  __syncthreads();  // scratch is reused by the next call
  return before;
}

// One item's coordinates: group g, its rows [r0, r0 + rows), columns [n0, n0 + nw) (nw = BN in
// the round-robin mode; a multiple of the unit in the balanced one; both clipped to N on use).
struct Item {
  int g, r0, rows, n0, nw;
};

// The largest group with istart[grp] <= u (u < istart[g]: groups without work share their
// successor's istart and are never picked).
__device__ __forceinline__ int group_of(int u, const int* istart, int g) {
  int lo = 0, hi = g - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (istart[mid] <= u) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Round-robin mode: item -> (group, N tile, row chunk), N tile major, chunk minor.
template <int BN, int R>
__device__ __forceinline__ Item decode(int item, const int* gstart, const int* istart, int g) {
  const int lo = group_of(item, istart, g);
  const int rows = gstart[lo + 1] - gstart[lo];
  const int chunks = (rows + R - 1) / R;
  const int local = item - istart[lo];
  const int nt = local / chunks, c = local - nt * chunks;
  Item it;
  it.g = lo;
  it.r0 = gstart[lo] + c * R;
  it.rows = min(R, rows - c * R);
  it.n0 = nt * BN;
  it.nw = BN;
  return it;
}

// Balanced mode: the piece of the range [u, u1) that starts at unit u: units of one group and
// row chunk (units numbered group, chunk, column strip), at most BN / UW of them; *next its end.
template <int BN, int R, int UW>
__device__ __forceinline__ Item piece_at(int u, int u1, int nu, const int* gstart,
                                         const int* istart, int g, int* next) {
  const int lo = group_of(u, istart, g);
  const int rows = gstart[lo + 1] - gstart[lo];
  const int local = u - istart[lo];
  const int c = local / nu, s = local - c * nu;
  const int end = min(min(u1, istart[lo] + (c + 1) * nu), u + BN / UW);
  Item it;
  it.g = lo;
  it.r0 = gstart[lo] + c * R;
  it.rows = min(R, rows - c * R);
  it.n0 = s * UW;
  it.nw = (end - u) * UW;
  *next = end;
  return it;
}

// Byte offset of weight element (k row, n column; n % 8 == 0) in a stage's weight tile: rows of
// kWStride elements (cp.async), or TMA boxes of BK rows x 128 B, one per 64 columns, each 16-byte
// chunk c of row k stored at chunk c ^ (k % 8) (128-byte swizzle; boxes 1 KB aligned).
template <class Tl, int BK>
__device__ __forceinline__ uint32_t w_off(int k, int n) {
  if constexpr (Tl::kTmaW)
    return uint32_t((n >> 6) * (BK * 128) + k * 128 + ((((n & 63) >> 3) ^ (k & 7)) << 4));
  else
    return uint32_t((k * Tl::kWStride + n) * 2);
}

// 8-bit weights: byte offset of weight (k row, n column) in a stage's tile of one weight: TMA
// boxes of BK rows x 128 B, one per 128 columns, each 16-byte chunk c of row k stored at chunk
// c ^ (k % 8) (128-byte swizzle; boxes 1 KB aligned). The MMA loop's loads (rows 2t, 2t + 1,
// 2t + 8, 2t + 9 of a k16 step, 2 x MT bytes at column w8c) are then free of bank conflicts:
// the four rows' XORs 2t differ in bits 1-2 of the chunk, the eight lanes' columns in the rest.
template <int BK>
__device__ __forceinline__ uint32_t w8_off(int k, int n) {
  return uint32_t((n >> 7) * (BK * 128) + k * 128 + ((((n & 127) >> 4) ^ (k & 7)) << 4) +
                  (n & 15));
}

// Calls f(std::integral_constant<int, n>) for the runtime n in [1, N] (nothing for other n).
template <int N, class F>
__device__ __forceinline__ void with_count(int n, F&& f) {
  if constexpr (N >= 1) {
    if (n == N) {
      f(std::integral_constant<int, N>{});
      return;
    }
    with_count<N - 1>(n, f);
  }
}

template <class T, class TO, int BN, int BK, int R, int STAGES, int MT, bool SWIGLU, int OPT = 0,
          class TW = T>
__global__ void __launch_bounds__(BN / (16 * MT) * 32, 1)  // Tile::kThreads
    ragged_dot_kernel(const __grid_constant__ Params p, int cs) {
  using Tl = Tile<BN, BK, R, STAGES, MT, SWIGLU, OPT, int(sizeof(TW))>;
  static_assert(sizeof(TW) == 2 ? std::is_same_v<TW, T> : Tl::kW8, "weights: T or 8 bits");
  constexpr bool kT = Tl::kTmaW;
  constexpr bool kBal = (OPT & kBalanced) != 0;
  constexpr bool kSplit = (OPT & kSplitK) != 0;
  constexpr bool kCta = (OPT & kCtaSync) != 0;
  constexpr int UW = unit_cols<OPT>();
  static_assert(!kBal || BN % UW == 0, "a piece is at most one tile wide");
  static_assert(!(kBal && kSplit), "split-K units are dealt round robin");
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ __align__(128) unsigned char smem_raw[];
  // TMA: the stages start on a 1 KB boundary (the 128-byte swizzle repeats every 8 rows x 128 B)
  unsigned char* smem = smem_raw + (kT ? (1024 - (smem_u32(smem_raw) & 1023)) & 1023 : 0);
  float* part = reinterpret_cast<float*>(smem + STAGES * Tl::kStageBytes);
  int* gstart =
      reinterpret_cast<int*>(smem + STAGES * Tl::kStageBytes + Tl::kPBytes);
  int* istart = gstart + (kMaxGroups + 1);
  // TMA: full[s], the mbarrier of slot s (8-byte aligned: the sections above are 16-byte)
  const uint32_t full0 = smem_u32(istart + (kMaxGroups + 1));
  __shared__ int scan_scratch[32];
  __shared__ int last_unit;  // kSplitK: this block's unit arrived last at its item's counter

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int M = p.m, K = p.k, N = p.n, G = p.g;
  // work units per row chunk of a group: N tiles (round robin) or column strips (balanced)
  const int NU = kBal ? (N + UW - 1) / UW : (N + BN - 1) / BN;
  const T* lhs = static_cast<const T*>(p.lhs);
  const T* rhs = static_cast<const T*>(p.rhs);
  const T* rhs2 = static_cast<const T*>(p.rhs2);
  TO* out = static_cast<TO*>(p.out);

  // ---- group row offsets and work-unit prefixes (every block the same) ----
  int carry_rows = 0, carry_items = 0;
  for (int base = 0; base < G; base += blockDim.x) {
    const int gi = base + tid;
    const int sz = gi < G ? max(p.group_sizes[gi], 0) : 0;
    int tot = 0;
    // sizes clipped so the running sum never passes M (lax: rows past M do not exist)
    const int ex = block_exclusive_scan(min(sz, M), scan_scratch, &tot);
    const int s0 = min(carry_rows + ex, M), s1 = min(carry_rows + ex + min(sz, M), M);
    const int rows = s1 - s0;
    const int items = rows > 0 ? ((rows + R - 1) / R) * NU : 0;
    int itot = 0;
    const int iex = block_exclusive_scan(items, scan_scratch, &itot);
    if (gi < G) {
      gstart[gi] = s0;
      istart[gi] = carry_items + iex;
    }
    carry_rows = min(carry_rows + tot, M);
    carry_items += itot;
  }
  if (tid == 0) {
    gstart[G] = carry_rows;
    istart[G] = carry_items;
  }
  __syncthreads();
  const int total_rows = gstart[G], total_items = istart[G];

  // ---- rows past the groups: zeros ----
  {
    const size_t b0 = size_t(total_rows) * N * sizeof(TO), b1 = size_t(M) * N * sizeof(TO);
    char* ob = reinterpret_cast<char*>(out);
    for (size_t o = b0 + (size_t(blockIdx.x) * blockDim.x + tid) * 16; o < b1;
         o += size_t(gridDim.x) * blockDim.x * 16)
      *reinterpret_cast<uint4*>(ob + o) = make_uint4(0, 0, 0, 0);
  }

  const int crank = int(cluster.block_rank());
  const int cid = int(blockIdx.x) / cs, ncl = int(gridDim.x) / cs;
  const int KT = (K + BK - 1) / BK;
  // kSplitK: the D = I - I % ncl items of the full rounds stay whole; the TL = I % ncl items of
  // the last round are split KS ways, KS (1 .. ks_max, each unit at least 4 K steps) the same in
  // every block: the count that minimises the tail's rounds in items' time, ceil(TL x KS / ncl)
  // x (1 / KS + e), e = a split unit's epilogue (partial out, count, sum: ~3 us, measured)
  // over an item's stream time (~96 KB of weights per block at ~31 GB/s per SM); ties keep
  // the fewer splits.
  int KS = 1, DI = total_items, TL = 0;
  if constexpr (kSplit) {
    TL = total_items % ncl;
    if (TL > 0 && TL <= p.counters_n) {
      const float e = 98304.f / (float(K) * float(BN) * float(sizeof(TW)) * float(Tl::kNW));
      float best = 1.f;
      for (int k2 = 2; k2 <= p.ks_max && KT / k2 >= 4; ++k2) {
        const float c = float((TL * k2 + ncl - 1) / ncl) * (1.f / float(k2) + e);
        if (c < best) { best = c; KS = k2; }
      }
    }
    if (KS > 1) DI = total_items - TL;
    else TL = 0;
  }
  const int total_units = DI + TL * KS;
  // this cluster's work: round robin, units cid, cid + ncl, ...; balanced, units [u0, u1) cut
  // into pieces. Every rank of a cluster computes the same list.
  const int u0 = int((int64_t(cid) * total_items) / ncl);
  const int u1 = int((int64_t(cid + 1) * total_items) / ncl);
  int n_my;
  if constexpr (kBal) {
    n_my = 0;
    for (int u = u0; u < u1; ++n_my) piece_at<BN, R, UW>(u, u1, NU, gstart, istart, G, &u);
  } else {
    n_my = cid < total_units ? (total_units - cid + ncl - 1) / ncl : 0;
  }
  if (n_my == 0) return;  // the whole cluster leaves together: no barrier is pending
  if constexpr (kT) {
    if (tid == 0) {
      for (int st = 0; st < STAGES; ++st) mbar_init(full0 + 8 * st, 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncthreads();
  }
  // split-K over the cluster: rank c streams K steps [kt0, kt1) of each item (cs == 1: all)
  const int kt0 = int((int64_t(crank) * KT) / cs), kt1 = int((int64_t(crank + 1) * KT) / cs);

  // A walk over this cluster's pieces (the producer and the consumer each have one): the item,
  // its K steps [kb, ke), the split index ks of its unit (kSplitK, else 0), the item's index,
  // and the step within the unit.
  struct Cursor {
    int pi, next, kb, ke, ks, item, step;
    Item it;
  };
  // unit u (kSplitK) -> its item and K steps: u < DI the whole item u; then the tail's units
  // numbered split, item (the units of one round stream the same K rows of the tail items'
  // N tiles together), item DI + j % TL, split j / TL of KS (j = u - DI)
  auto unit_at = [&](Cursor& c, int u) {
    if (u < DI) {
      c.ks = 0;
      c.item = u;
      c.kb = 0;
      c.ke = KT;
    } else {
      const int j = u - DI;
      c.ks = j / TL;
      c.item = DI + (j - c.ks * TL);
      c.kb = int((int64_t(c.ks) * KT) / KS);
      c.ke = int((int64_t(c.ks + 1) * KT) / KS);
    }
    c.it = decode<BN, R>(c.item, gstart, istart, G);
  };
  auto first = [&](Cursor& c) {
    c.pi = 0;
    c.step = 0;
    c.ks = 0;
    c.kb = kt0;
    c.ke = kt1;
    if constexpr (kBal) c.it = piece_at<BN, R, UW>(u0, u1, NU, gstart, istart, G, &c.next);
    else if constexpr (kSplit) unit_at(c, cid);
    else c.it = decode<BN, R>(cid, gstart, istart, G);
  };
  auto advance = [&](Cursor& c) {
    ++c.pi;
    c.step = 0;
    if constexpr (kBal) c.it = piece_at<BN, R, UW>(c.next, u1, NU, gstart, istart, G, &c.next);
    else if constexpr (kSplit) unit_at(c, cid + c.pi * ncl);
    else c.it = decode<BN, R>(cid + c.pi * ncl, gstart, istart, G);
  };
  // the K steps of this cluster's work (the loop's length)
  int q_total = n_my * (kt1 - kt0);
  if constexpr (kSplit) {
    if (KS > 1) {
      q_total = 0;
      Cursor c;
      first(c);
      for (int i = 0; i < n_my; ++i) {
        if (i > 0) advance(c);
        q_total += c.ke - c.kb;
      }
    }
  }

  // ---- producer: stage q's loads into slot q % STAGES (q increases by one per call) ----
  Cursor lc;
  first(lc);
  auto load = [&](int q) {
    if (lc.step == lc.ke - lc.kb) advance(lc);
    const Item& it = lc.it;
    const int k0 = (lc.kb + lc.step) * BK;
    ++lc.step;
    unsigned char* st = smem + (q % STAGES) * Tl::kStageBytes;
    constexpr int kWChunks = BK * (BN / 8);
    const int nend = min(it.n0 + it.nw, N);
    if constexpr (kT) {
      // boxes (64 columns, 8-bit weights 128) that hold columns of the item; rows past K and
      // columns past N
      // arrive as zeros (out of the map's bounds) and still count as box bytes
      if (tid == 0) {
        constexpr int kBoxC = Tl::kW8 ? 128 : 64;  // columns of one box (rows of 128 B)
        const int nb = (nend - it.n0 + kBoxC - 1) / kBoxC;
        const uint32_t bar = full0 + 8 * (q % STAGES);
        mbar_expect_tx(bar, uint32_t(nb * BK * 128 * Tl::kNW));
        for (int w = 0; w < Tl::kNW; ++w)
          for (int bx = 0; bx < nb; ++bx)
            tma_3d(smem_u32(st + w * Tl::kWSBytes + bx * BK * 128), &p.tmap[w],
                   it.n0 + bx * kBoxC, k0, it.g, bar);
      }
    } else {
#pragma unroll
      for (int w = 0; w < Tl::kNW; ++w) {
        const T* src = (w == 0 ? rhs : rhs2) + size_t(it.g) * K * N;
        const uint32_t dst = smem_u32(st + w * Tl::kWBytes);
#pragma unroll 4
        for (int c = tid; c < kWChunks; c += Tl::kThreads) {
          const int row = c / (BN / 8), col = (c % (BN / 8)) * 8;
          const int kk = k0 + row, nn = it.n0 + col;
          const bool ok = kk < K && nn < nend;
          const T* a = src + (ok ? size_t(kk) * N + nn : 0);
          if constexpr ((OPT & kPf256) != 0) cp16_pf(dst + (row * Tl::kWStride + col) * 2, a, ok);
          else cp16(dst + (row * Tl::kWStride + col) * 2, a, ok);
        }
      }
    }
    const int lrows = ((it.rows + 7) / 8) * 8;
    const uint32_t ldst = smem_u32(st + Tl::kNW * Tl::kWSBytes);
    if constexpr (Tl::kLCore) {
      // core-matrix layout (wg::l_off): thread pairs take the two 16-byte chunks of a 32-byte
      // sector of one row, consecutive pairs consecutive rows (whole 128-byte core matrices)
      for (int c = tid; c < lrows * (BK / 8); c += Tl::kThreads) {
        const int row = (c >> 1) % lrows, col = ((c / (2 * lrows)) * 2 + (c & 1)) * 8;
        const bool ok = row < it.rows && k0 + col < K;
        cp16(ldst + wg::l_off<R>(row, col), lhs + (ok ? size_t(it.r0 + row) * K + k0 + col : 0),
             ok);
      }
    } else {
      for (int c = tid; c < lrows * (BK / 8); c += Tl::kThreads) {
        const int row = c / (BK / 8), col = (c % (BK / 8)) * 8;
        const bool ok = row < it.rows && k0 + col < K;
        cp16(ldst + (row * Tl::kLStride + col) * 2,
             lhs + (ok ? size_t(it.r0 + row) * K + k0 + col : 0), ok);
      }
    }
    if constexpr (Tl::kW8) {
      // the scales this stage's promotion applies, with its lhs rows (STAGES - 1 stages ahead
      // of their use): mode 2, block scales [w][BN / 128] of K block k0 / 128, every stage;
      // mode 1, the unit's column scales [w][BN] at its last stage (16 B a copy: N % 16 == 0)
      const uint32_t sdst = ldst + Tl::kLBytes;
      const int mode = p.scale_mode;
      if (mode == 2) {
        constexpr int kSB = BN / 128;
        if (tid < Tl::kNW * kSB) {
          const int w = tid / kSB, n = it.n0 + (tid % kSB) * 128;
          const int KB = (K + 127) >> 7, NB = (N + 127) >> 7;
          const float* sc = w == 0 ? p.scale : p.scale2;
          const bool ok = n < N;
          cp4(sdst + tid * 4, ok ? sc + (size_t(it.g) * KB + (k0 >> 7)) * NB + (n >> 7) : sc, ok);
        }
      } else if (mode == 1 && lc.step == lc.ke - lc.kb) {
        for (int c = tid; c < Tl::kNW * (BN / 4); c += Tl::kThreads) {
          const int w = c / (BN / 4), n = it.n0 + (c % (BN / 4)) * 4;
          const float* sc = w == 0 ? p.scale : p.scale2;
          const bool ok = n < N;
          cp16(sdst + c * 16, ok ? sc + size_t(it.g) * N + n : sc, ok);
        }
      }
    }
  };

  float acc[Tl::kNW][MT][R / 8][4];
  auto zero_acc = [&]() {
#pragma unroll
    for (int w = 0; w < Tl::kNW; ++w)
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < R / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[w][i][j][e] = 0.f;
  };
  zero_acc();
  // 8-bit weights: the MMAs of one 128-row K block of scales accumulate here, then are scaled
  // per column into acc (unused, and compiled away, for 16-bit weights)
  float tmp[Tl::kNW][MT][R / 8][4];
  if constexpr (Tl::kW8) {
#pragma unroll
    for (int w = 0; w < Tl::kNW; ++w)
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < R / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) tmp[w][i][j][e] = 0.f;
  }
  auto& mac = Tl::kW8 ? tmp : acc;  // where the MMAs accumulate

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < q_total) load(s);
    cp_commit();
  }

  bool pending = false;  // a cluster arrive whose wait has not come yet
  Cursor cc;
  first(cc);
  const int col0 = warp * MT * 16;  // this warp's first column in the tile
  // the tile column of accumulator half h (0: elements 0, 1; 1: elements 2, 3) of m16 tile i:
  // 16-bit weights, the ldmatrix fragment's m row (lane / 4 + 8 h); 8-bit weights, the
  // thread's byte 2i + h of its columns (w8_col)
  auto mcol = [&](int i, int h) {
    return Tl::kW8 ? col0 + 2 * MT * (lane >> 2) + 2 * i + h : col0 + i * 16 + (lane >> 2) + 8 * h;
  };
  // 8-bit weights, the A fragments of k16 step kk of a stage tile: w8_load, the thread's bytes
  // of one weight tile wb: r[x] = row 2t + (x & 1) + 8 (x >> 1) of the step (t = lane % 4) at
  // its 2 MT columns [w8c, w8c + 2 MT); w8_conv, the fragments [i] they make: fragment i takes
  // bytes 2i (m row g) and 2i + 1 (m row g + 8); w8_frags, both for every weight of stage st
  auto w8_load = [&](uint32_t (&r)[4], const unsigned char* wb, int kk) {
    const int w8c = col0 + 2 * MT * (lane >> 2);
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int krow = kk * 16 + 2 * (lane & 3) + (x & 1) + ((x >> 1) << 3);
      const unsigned char* src = wb + w8_off<BK>(krow, w8c);
      r[x] = MT == 2 ? *reinterpret_cast<const uint32_t*>(src)
                     : uint32_t(*reinterpret_cast<const uint16_t*>(src));
    }
  };
  auto w8_conv = [&](uint32_t (&a)[MT][4], const uint32_t (&r)[4]) {
    if constexpr (Tl::kW8) {
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        a[i][0] = w8_pair<T, TW>(r[0], r[1], 2 * i);
        a[i][1] = w8_pair<T, TW>(r[0], r[1], 2 * i + 1);
        a[i][2] = w8_pair<T, TW>(r[2], r[3], 2 * i);
        a[i][3] = w8_pair<T, TW>(r[2], r[3], 2 * i + 1);
      }
    }
  };
  auto w8_frags = [&](uint32_t (&a)[Tl::kNW][MT][4], const unsigned char* st, int kk) {
#pragma unroll
    for (int w = 0; w < Tl::kNW; ++w) {
      uint32_t r[4];
      w8_load(r, st + w * Tl::kWSBytes, kk);
      w8_conv(a[w], r);
    }
  };
  // kWgmmaRA: the two A register sets of kernels/ragged_dot_w8_wgmma.cuh (set 0 carries the
  // next stage's step 0 from one stage to the next)
  uint32_t wa[2][Tl::kNW][MT][4];
  // kWgmmaRA: tmp holds no sum (the block's start, or promoted): the next stage's first MMAs
  // write it with scale-d 0 instead of adding to it
  bool tmp_fresh = true;
  for (int q = 0; q < q_total; ++q) {
    cp_wait<STAGES - 2>();
    if constexpr (Tl::kLCore) wg::proxy_fence();  // this thread's lhs rows, before wgmma reads them
    __syncthreads();
    if (q + STAGES - 1 < q_total) load(q + STAGES - 1);
    cp_commit();

    if constexpr (kT) mbar_wait(full0 + 8 * (q % STAGES), uint32_t((q / STAGES) & 1));
    if (cc.step == cc.ke - cc.kb) advance(cc);
    const bool last_step = cc.step == cc.ke - cc.kb - 1;
    ++cc.step;
    const Item& cur = cc.it;
    const int nrt = (cur.rows + 7) >> 3;
    const unsigned char* st = smem + (q % STAGES) * Tl::kStageBytes;
    const uint32_t lbase = smem_u32(st + Tl::kNW * Tl::kWSBytes);
    // 8-bit weights: this thread's 2 x MT columns of the tile, [w8c, w8c + 2 MT) (see
    // w8_col), bytes of one row in one load
    const int w8c = col0 + 2 * MT * (lane >> 2);
    // 8-bit weights: whether this stage ends a promotion of tmp into acc (scale_mode 2: a
    // 128-row K block of scales, or the unit; modes 0 and 1: the unit only, the per-column scale
    // applied once), and the scales sv it applies, loaded here so that their latency hides
    // behind the stage's MMAs: mode 0: 1; 1: scale[g, n]; 2: scale[g, k / 128, n / 128] (one
    // value a weight: the thread's 2 MT columns lie in one 128-column block)
    bool promote = false;
    if constexpr (Tl::kW8) {
      const int kstep = cc.kb + cc.step - 1;  // this stage's K step
      promote = last_step || (p.scale_mode == 2 && ((kstep + 1) * BK) % 128 == 0);
    }
    // the scales sv of this stage's promotion, from its shared memory (both promotions below)
    auto stage_scales = [&](float (&sv)[Tl::kNW][MT][2]) {
      const float* ss =
          reinterpret_cast<const float*>(st + Tl::kNW * Tl::kWSBytes + Tl::kLBytes);
      const int mode = p.scale_mode;
#pragma unroll
      for (int w = 0; w < Tl::kNW; ++w)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            sv[w][i][h] = mode == 0   ? 1.f
                          : mode == 2 ? ss[w * (BN / 128) + (w8c >> 7)]
                                      : ss[w * BN + mcol(i, h)];
    };
    // kWgmmaRA, the promotion: acc += sv x tmp per column for the first `nrt_c` row tiles (the
    // item's), sv from the stage's scales; tmp is not zeroed (the next stage's first MMAs write
    // it with scale-d 0); the other row tiles' tmp is stale, their acc never promoted nor stored
    auto promote_rows = [&](auto nrt_c) {
      constexpr int NRT = decltype(nrt_c)::value;
      float sv[Tl::kNW][MT][2];
      stage_scales(sv);
#pragma unroll
      for (int w = 0; w < Tl::kNW; ++w)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int j = 0; j < NRT; ++j)
#pragma unroll
              for (int e = 2 * h; e < 2 * h + 2; ++e)
                acc[w][i][j][e] = fmaf(sv[w][i][h], tmp[w][i][j][e], acc[w][i][j][e]);
    };
    // the MMAs of this stage for the first `nrt_c` row tiles (n8 each)
    auto mma_stage = [&](auto nrt_c) {
      constexpr int NRT = decltype(nrt_c)::value;
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        uint32_t a[Tl::kNW][MT][4];
        if constexpr (Tl::kW8) {
          w8_frags(a, st, kk);
        } else {
#pragma unroll
          for (int w = 0; w < Tl::kNW; ++w) {
            const uint32_t wbase = smem_u32(st + w * Tl::kWBytes);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
              const int mi = lane >> 3, rr = lane & 7;
              const int krow = kk * 16 + rr + ((mi >> 1) << 3);
              const int ncol = col0 + i * 16 + ((mi & 1) << 3);
              ldsm_x4_trans(a[w][i], wbase + w_off<Tl, BK>(krow, ncol));
            }
          }
        }
#pragma unroll
        for (int j = 0; j < NRT; ++j) {
          uint32_t b0, b1;
          const int l = lane & 15;
          ldsm_x2(b0, b1, lbase + ((j * 8 + (l & 7)) * Tl::kLStride + kk * 16 + ((l >> 3) << 3)) * 2);
#pragma unroll
          for (int w = 0; w < Tl::kNW; ++w)
#pragma unroll
            for (int i = 0; i < MT; ++i) Mma<T>::run(mac[w][i][j], a[w][i], b0, b1);
        }
      }
    };
    // warps whose columns lie past the piece's width have only zeros to multiply (balanced)
    if constexpr (Tl::kWg) {
      // wgmma: one warpgroup per 64-column box; a box past the piece's width skips as a whole
      const int box = warp >> 2;
      if (!kBal || box * 64 < cur.nw)
        with_count<R / 8>(nrt, [&](auto nrt_c) {
          wg::stage<T, Tl, BK, R, decltype(nrt_c)::value>(acc, smem_u32(st), box, lbase);
        });
    } else if constexpr (Tl::kWgRA) {
      // wgmma with A from registers (kernels/ragged_dot_w8_wgmma.cuh): step 0 of the block's
      // first stage converted here, of every later stage by the tail of the one before it
      // (after that stage's mbarrier wait, while its last MMAs run); the promotion after the
      // stage's MMAs completed, of the item's row tiles only
      if (q == 0) w8_frags(wa[0], st, 0);
      with_count<R / 8>(nrt, [&](auto nrt_c) {
        using Raw = uint32_t[Tl::kNW][4];
        wg::ra_stage<T, Tl::kNW, MT, BK, R, decltype(nrt_c)::value>(
            mac, wa, lbase, tmp_fresh,
            [&](Raw& raw, int kk) {
#pragma unroll
              for (int w = 0; w < Tl::kNW; ++w) w8_load(raw[w], st + w * Tl::kWSBytes, kk);
            },
            [&](uint32_t(&as)[Tl::kNW][MT][4], const Raw& raw) {
#pragma unroll
              for (int w = 0; w < Tl::kNW; ++w) w8_conv(as[w], raw[w]);
            },
            [&](Raw& raw) {
              if (q + 1 >= q_total) return false;
              const int s1 = (q + 1) % STAGES;
              mbar_wait(full0 + 8 * s1, uint32_t(((q + 1) / STAGES) & 1));
#pragma unroll
              for (int w = 0; w < Tl::kNW; ++w)
                w8_load(raw[w], smem + s1 * Tl::kStageBytes + w * Tl::kWSBytes, 0);
              return true;
            });
        if (promote) promote_rows(nrt_c);
      });
      tmp_fresh = promote;
    } else if (!kBal || col0 < cur.nw) {
      if constexpr ((OPT & kSpecRows) != 0) {
        with_count<R / 8>(nrt, mma_stage);
      } else {
        // one loop over R / 8 row tiles, each behind its runtime test (the first kernel)
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
          uint32_t a[Tl::kNW][MT][4];
#pragma unroll
          for (int w = 0; w < Tl::kNW; ++w) {
            const uint32_t wbase = smem_u32(st + w * Tl::kWBytes);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
              const int mi = lane >> 3, rr = lane & 7;
              const int krow = kk * 16 + rr + ((mi >> 1) << 3);
              const int ncol = col0 + i * 16 + ((mi & 1) << 3);
              ldsm_x4_trans(a[w][i], wbase + w_off<Tl, BK>(krow, ncol));
            }
          }
#pragma unroll
          for (int j = 0; j < R / 8; ++j) {
            if (j < nrt) {
              uint32_t b0, b1;
              const int l = lane & 15;
              ldsm_x2(b0, b1,
                      lbase + ((j * 8 + (l & 7)) * Tl::kLStride + kk * 16 + ((l >> 3) << 3)) * 2);
#pragma unroll
              for (int w = 0; w < Tl::kNW; ++w)
#pragma unroll
                for (int i = 0; i < MT; ++i) Mma<T>::run(mac[w][i][j], a[w][i], b0, b1);
            }
          }
        }
      }
    }

    if constexpr (Tl::kW8 && !Tl::kWgRA) {
      // the promotion: acc += sv x tmp per column, tmp zeroed (every row tile: promote_rows
      // above is the wgmma loop's)
      if (promote) {
        float sv[Tl::kNW][MT][2];
        stage_scales(sv);
#pragma unroll
        for (int w = 0; w < Tl::kNW; ++w)
#pragma unroll
          for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
              for (int j = 0; j < R / 8; ++j)
#pragma unroll
                for (int e = 2 * h; e < 2 * h + 2; ++e) {
                  acc[w][i][j][e] = fmaf(sv[w][i][h], tmp[w][i][j][e], acc[w][i][j][e]);
                  tmp[w][i][j][e] = 0.f;
                }
      }
    }

    if (last_step) {  // ---- epilogue of item `cur` (kSplitK: of its unit) ----
      // every rank has finished reading my previous partials (kCtaSync: the loop's barriers
      // since the previous epilogue already order them)
      if constexpr (!kCta) if (pending) cluster_wait();
#pragma unroll
      for (int w = 0; w < Tl::kNW; ++w)
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int j = 0; j < R / 8; ++j) {
            if (j < nrt) {
              float* pw = part + w * R * Tl::kPStride;
              const int row = j * 8 + 2 * (lane & 3), c0 = mcol(i, 0), c1 = mcol(i, 1);
              pw[row * Tl::kPStride + c0] = acc[w][i][j][0];
              pw[(row + 1) * Tl::kPStride + c0] = acc[w][i][j][1];
              pw[row * Tl::kPStride + c1] = acc[w][i][j][2];
              pw[(row + 1) * Tl::kPStride + c1] = acc[w][i][j][3];
            }
          }
      zero_acc();
      // every rank's partials of this item are in its shared memory
      if constexpr (kCta) {
        __syncthreads();
      } else {
        cluster_arrive();
        cluster_wait();
      }
      const int e4 = cur.rows * (BN / 4);
      if constexpr (kSplit) {
        if (cc.item >= DI) {  // a split unit of the tail (DI == I without a split)
          // this unit's partial into plane ks of the workspace (its item's rows and columns,
          // which no other unit of another item touches), then the item's arrival counter;
          // the unit that arrives last sums the KS planes in split order (its own from shared
          // memory: the same values), applies the epilogue and stores the item
          const size_t plane = size_t(M) * N;
          for (int x = tid; x < e4; x += Tl::kThreads) {
            const int row = x / (BN / 4), col = (x % (BN / 4)) * 4;
            const int nn = cur.n0 + col;
            if (nn >= N) continue;
#pragma unroll
            for (int w = 0; w < Tl::kNW; ++w)
              __stcg(reinterpret_cast<float4*>(p.ws + (size_t(cc.ks) * Tl::kNW + w) * plane +
                                               size_t(cur.r0 + row) * N + nn),
                     *reinterpret_cast<const float4*>(part + w * R * Tl::kPStride +
                                                      row * Tl::kPStride + col));
          }
          __syncthreads();
          // the last thread counts: with TMA weights it has no copies of its own in flight (the
          // lhs rows are loaded by the first threads, the weights by thread 0), so its fence
          // waits for nothing but the stores (a fence in a thread with cp.async in flight
          // waited for them: measured, a pipeline drain per unit)
          if (tid == Tl::kThreads - 1) {
            // the block's partial (cumulative over the barrier) before the count
            asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
            last_unit = atomicAdd(p.counters + (cc.item - DI), 1) == KS - 1;
            // the other units' partials (each counted after its own) before they are read
            asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
          }
          __syncthreads();
          if (last_unit) {
            for (int x = tid; x < e4; x += Tl::kThreads) {
              const int row = x / (BN / 4), col = (x % (BN / 4)) * 4;
              const int nn = cur.n0 + col;
              if (nn >= N) continue;
              float4 sm[Tl::kNW];
#pragma unroll
              for (int w = 0; w < Tl::kNW; ++w) {
                sm[w] = make_float4(0.f, 0.f, 0.f, 0.f);
                for (int j = 0; j < KS; ++j) {
                  const float4 v =
                      j == cc.ks
                          ? *reinterpret_cast<const float4*>(part + w * R * Tl::kPStride +
                                                             row * Tl::kPStride + col)
                          : __ldcg(reinterpret_cast<const float4*>(
                                p.ws + (size_t(j) * Tl::kNW + w) * plane +
                                size_t(cur.r0 + row) * N + nn));
                  sm[w].x += v.x; sm[w].y += v.y; sm[w].z += v.z; sm[w].w += v.w;
                }
              }
              float4 o = sm[0];
              if constexpr (SWIGLU) {
                o.x = silu(sm[0].x) * sm[1].x; o.y = silu(sm[0].y) * sm[1].y;
                o.z = silu(sm[0].z) * sm[1].z; o.w = silu(sm[0].w) * sm[1].w;
              }
              store4<TO>(out + size_t(cur.r0 + row) * N + nn, o);
            }
          }
          if constexpr (!kCta) {
            cluster_arrive();
            pending = true;
          }
          continue;
        }
      }
      const int b = int((int64_t(crank) * e4) / cs), e = int((int64_t(crank + 1) * e4) / cs);
      for (int x = b + tid; x < e; x += Tl::kThreads) {
        const int row = x / (BN / 4), col = (x % (BN / 4)) * 4;
        const int nn = cur.n0 + col;
        if (col >= cur.nw || nn >= N) continue;
        float4 s[Tl::kNW];
#pragma unroll
        for (int w = 0; w < Tl::kNW; ++w) {
          s[w] = make_float4(0.f, 0.f, 0.f, 0.f);
          for (int r = 0; r < cs; ++r) {
            const float* rp =
                (kCta ? part : cluster.map_shared_rank(part, r)) + w * R * Tl::kPStride;
            const float4 v = *reinterpret_cast<const float4*>(rp + row * Tl::kPStride + col);
            s[w].x += v.x; s[w].y += v.y; s[w].z += v.z; s[w].w += v.w;
          }
        }
        float4 o = s[0];
        if constexpr (SWIGLU) {
          o.x = silu(s[0].x) * s[1].x; o.y = silu(s[0].y) * s[1].y;
          o.z = silu(s[0].z) * s[1].z; o.w = silu(s[0].w) * s[1].w;
        }
        store4<TO>(out + size_t(cur.r0 + row) * N + nn, o);
      }
      if constexpr (!kCta) {
        cluster_arrive();
        pending = true;
      }
    }
  }
  cp_wait<0>();
  if (pending) cluster_wait();  // no rank still reads this block's shared memory
}

}  // namespace rdot
}  // namespace dev
}  // namespace nvc
