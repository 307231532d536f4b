// Tile variants of the ragged_dot kernels (bfloat16 -> bfloat16) for the harness's sweep
// (ragged_dot_harness.cu --sweep). Compiled twice, -DRDOT_SWEEP_PART=0 and =1 (half the variants
// each, so that the two compile in parallel). Variant names: BN x BK, rows tile R, stages, m16
// tiles per warp ("w"); "sw": a ragged_dot_swiglu tile. (Round 1 also swept bulk-copy weight
// streams, 3-10x slower: gone.)
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda/ragged_dot_launch.cuh"

#ifndef RDOT_SWEEP_PART
#define RDOT_SWEEP_PART 0
#endif

namespace {
using B = __nv_bfloat16;
using nvc::cuda::RaggedDotArgs;
template <int BN, int BK, int R, int ST, int MT, bool SW = false>
using K = nvc::cuda::rdot_launch::Kernel<B, B, BN, BK, R, ST, MT, SW>;
struct V {
  const char* name;
  cudaError_t (*launch)(const RaggedDotArgs&, int, cudaStream_t);
  int smem, threads;
};
// Never a tile of the package (ragged_dot_family.cuh): an instantiation in two translation units
// is two kernels, and the shared-memory limit raised for one is not raised for the other.
#define RDOT_V(BN, BK, R, ST, MT)                                                           \
  V{"BN" #BN " BK" #BK " R" #R " st" #ST " w" #MT, &K<BN, BK, R, ST, MT>::launch,           \
    K<BN, BK, R, ST, MT>::Tl::kSmem, K<BN, BK, R, ST, MT>::Tl::kThreads}
// swiglu tiles ("sw" in the name: the harness times them on the swiglu problem only)
#define RDOT_VS(BN, BK, R, ST, MT)                                                          \
  V{"sw BN" #BN " BK" #BK " R" #R " st" #ST " w" #MT, &K<BN, BK, R, ST, MT, true>::launch,  \
    K<BN, BK, R, ST, MT, true>::Tl::kSmem, K<BN, BK, R, ST, MT, true>::Tl::kThreads}
#if RDOT_SWEEP_PART == 0
const V kV[] = {
    RDOT_V(256, 64, 16, 5, 2), RDOT_V(256, 96, 16, 3, 2), RDOT_V(256, 64, 16, 4, 1),
    RDOT_V(512, 32, 16, 4, 4), RDOT_V(256, 64, 32, 4, 2), RDOT_VS(256, 32, 16, 4, 2),
    RDOT_VS(128, 64, 16, 4, 2),
};
#else
const V kV[] = {
    RDOT_V(256, 64, 64, 3, 2), RDOT_V(256, 64, 64, 3, 1), RDOT_V(128, 64, 64, 4, 1),
    RDOT_V(128, 128, 64, 3, 1), RDOT_V(256, 32, 64, 4, 1), RDOT_VS(128, 64, 64, 3, 2),
    RDOT_V(128, 64, 16, 4, 2),
};
#endif
}  // namespace

#define RDOT_CAT2(a, b) a##b
#define RDOT_CAT(a, b) RDOT_CAT2(a, b)
int RDOT_CAT(sweep_count_, RDOT_SWEEP_PART)() { return int(sizeof(kV) / sizeof(kV[0])); }
const char* RDOT_CAT(sweep_name_, RDOT_SWEEP_PART)(int v) { return kV[v].name; }
int RDOT_CAT(sweep_rows_, RDOT_SWEEP_PART)(int v) {
  // the R of the name (the third field)
  const char* r = std::strstr(kV[v].name, " R");
  return r ? std::atoi(r + 2) : 0;
}
cudaError_t RDOT_CAT(sweep_launch_, RDOT_SWEEP_PART)(int v, const RaggedDotArgs& a, int cs,
                                                     cudaStream_t s) {
  return kV[v].launch(a, cs, s);
}
