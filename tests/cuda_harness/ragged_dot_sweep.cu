// Tile variants of the ragged_dot kernels (bfloat16 -> bfloat16) for the harness's sweep
// (ragged_dot_harness.cu --sweep). Compiled once per part, -DRDOT_SWEEP_PART=0 .. kSweepParts-1
// (ragged_dot_sweep.h), so that the parts compile in parallel; each part adds its variants to the
// harness's list at static initialisation. Variant names: BN x BK, rows tile R, stages, m16 tiles
// per warp ("w"), then the kernel options (kernels/ragged_dot.cuh): "bal" balanced ranges of
// 64-column units ("u32": 32-column units), "spec" the MMA loop per row-tile count, "pf" the
// 256-byte L2 prefetch size on the weight loads, "tma" the weights by TMA, "split" split-K units
// of the last round, "cta" the epilogue's block barrier, "wgmma" the MMAs by wgmma (weights by
// TMA too, not named "tma" so that gpu_check's TMA rules leave them out; one warpgroup per 64
// columns: "w1"); "sw": a
// ragged_dot_swiglu tile (timed on the swiglu product only). Never a tile of the package (ragged_dot_family.cuh) with the same
// options: an instantiation in two translation units is two kernels, and the shared-memory limit
// raised for one is not raised for the other.
#include "ragged_dot_sweep.h"

#include "cuda/ragged_dot_launch.cuh"

#ifndef RDOT_SWEEP_PART
#define RDOT_SWEEP_PART 0
#endif

namespace {
using B = __nv_bfloat16;
using nvc::cuda::RaggedDotArgs;
namespace r = nvc::dev::rdot;
[[maybe_unused]] constexpr int kB = r::kBalanced, kS = r::kSpecRows, kP = r::kPf256, kU = r::kUnit32,
                                kT = r::kTma, kW = r::kWgmma;
template <int BN, int BK, int R, int ST, int MT, bool SW, int OPT>
using K = nvc::cuda::rdot_launch::Kernel<B, B, BN, BK, R, ST, MT, SW, OPT>;
#define RDOT_V(BN, BK, R, ST, MT, OPT, TAG)                                                   \
  SweepVariant{"BN" #BN " BK" #BK " R" #R " st" #ST " w" #MT TAG, RDOT_SWEEP_PART, false,                      \
               &K<BN, BK, R, ST, MT, false, OPT>::launch}
// the same timed with split-K over clusters of CS blocks
#define RDOT_VC(BN, BK, R, ST, MT, OPT, TAG, CS)                                               \
  SweepVariant{"BN" #BN " BK" #BK " R" #R " st" #ST " w" #MT TAG " cs" #CS, RDOT_SWEEP_PART,    \
               false, &K<BN, BK, R, ST, MT, false, OPT>::launch, CS}
#define RDOT_VS(BN, BK, R, ST, MT, OPT, TAG)                                                  \
  SweepVariant{"sw BN" #BN " BK" #BK " R" #R " st" #ST " w" #MT TAG, RDOT_SWEEP_PART, true,                    \
               &K<BN, BK, R, ST, MT, true, OPT>::launch}
// The package's previous tiles (cluster barriers in the epilogue), R 64 forms of BN 128 with
// the block barrier (kCtaSync, "cta"), the R 16 tiles without the last round's split; the
// candidates measured before them are in docs/perf/ragged_dot.md. The package's tiles (cuda/ragged_dot_family.cuh) are not repeated here.
[[maybe_unused]] constexpr int kK = r::kSplitK, kC = r::kCtaSync;
#if RDOT_SWEEP_PART == 0
const SweepVariant kV[] = {
    RDOT_V(256, 64, 16, 4, 2, kS | kT | kK, " spec tma split"),
};
#elif RDOT_SWEEP_PART == 1
const SweepVariant kV[] = {
    RDOT_VS(128, 64, 16, 4, 1, kS | kT | kK, " spec tma split"),
};
#elif RDOT_SWEEP_PART == 2
const SweepVariant kV[] = {
    RDOT_V(128, 128, 64, 3, 2, kS | kT | kC, " spec tma cta"),
};
#elif RDOT_SWEEP_PART == 3
const SweepVariant kV[] = {
    RDOT_VS(128, 64, 64, 3, 1, kS | kT, " spec tma"),
};
#elif RDOT_SWEEP_PART == 4
const SweepVariant kV[] = {
    RDOT_V(128, 128, 64, 3, 2, kS | kT, " spec tma"),
};
#elif RDOT_SWEEP_PART == 5
const SweepVariant kV[] = {
    RDOT_V(256, 64, 16, 4, 2, kS | kT | kC, " spec tma cta"),
};
#elif RDOT_SWEEP_PART == 6
const SweepVariant kV[] = {
    RDOT_V(128, 128, 64, 3, 1, kS | kT | kC, " spec tma cta"),
};
#elif RDOT_SWEEP_PART == 7
const SweepVariant kV[] = {
    RDOT_V(256, 64, 16, 4, 2, kS | kT, " spec tma"),
    RDOT_VS(128, 64, 16, 4, 1, kS | kT, " spec tma"),
};
// The wgmma main loop (kernels/ragged_dot_wgmma.cuh) in the package's tiles (the same options,
// one warpgroup per 64 columns: "w1") and their neighbours with deeper pipelines.
#elif RDOT_SWEEP_PART == 8
const SweepVariant kV[] = {
    RDOT_V(256, 64, 64, 3, 1, kS | kT | kC | kW, " spec cta wgmma"),
    RDOT_V(128, 128, 64, 3, 1, kS | kT | kC | kW, " spec cta wgmma"),
    RDOT_V(128, 64, 64, 6, 1, kS | kT | kC | kW, " spec cta wgmma"),
};
#elif RDOT_SWEEP_PART == 9
const SweepVariant kV[] = {
    RDOT_V(256, 64, 16, 4, 1, kS | kT | kK | kC | kW, " spec split cta wgmma"),
    RDOT_V(256, 64, 16, 5, 1, kS | kT | kK | kC | kW, " spec split cta wgmma"),
};
#else
const SweepVariant kV[] = {
    RDOT_VS(128, 64, 64, 3, 1, kS | kT | kC | kW, " spec cta wgmma"),
    RDOT_VS(128, 64, 16, 4, 1, kS | kT | kK | kC | kW, " spec split cta wgmma"),
    RDOT_VS(128, 64, 16, 5, 1, kS | kT | kK | kC | kW, " spec split cta wgmma"),
};
#endif
const int kRegistered = [] {
  for (const SweepVariant& v : kV) sweep_variants().push_back(v);
  return 0;
}();
}  // namespace
