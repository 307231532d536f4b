// Tile variants of the ragged_dot kernel (bfloat16 -> bfloat16) for the harness's sweep
// (ragged_dot_harness.cu --sweep). Compiled twice, -DRDOT_SWEEP_PART=0 and =1 (half the variants
// each, so that the two compile in parallel). Variant names: BN x BK, rows tile R, stages, m16
// tiles per warp ("w"); "bulk": the weights by bulk copies (cp.async.bulk) instead of cp.async.
#include <cstdio>

#include "cuda/ragged_dot_launch.cuh"

#ifndef RDOT_SWEEP_PART
#define RDOT_SWEEP_PART 0
#endif

namespace {
using B = __nv_bfloat16;
using nvc::cuda::RaggedDotArgs;
template <int BN, int BK, int R, int ST, int MT, bool BULK = false>
using K = nvc::cuda::rdot_launch::Kernel<B, B, BN, BK, R, ST, MT, false, BULK>;
struct V {
  const char* name;
  cudaError_t (*launch)(const RaggedDotArgs&, int, cudaStream_t);
  int smem, threads;
};
#define RDOT_V(BN, BK, R, ST, MT)                                                           \
  V{"BN" #BN " BK" #BK " R" #R " st" #ST " w" #MT, &K<BN, BK, R, ST, MT>::launch,           \
    K<BN, BK, R, ST, MT>::Tl::kSmem, K<BN, BK, R, ST, MT>::Tl::kThreads}
// the same with the weight rows streamed by bulk copies (cp.async.bulk + mbarrier)
#define RDOT_VB(BN, BK, R, ST, MT)                                                          \
  V{"BN" #BN " BK" #BK " R" #R " st" #ST " w" #MT " bulk", &K<BN, BK, R, ST, MT, true>::launch, \
    K<BN, BK, R, ST, MT, true>::Tl::kSmem, K<BN, BK, R, ST, MT, true>::Tl::kThreads}
#if RDOT_SWEEP_PART == 0
const V kV[] = {
    RDOT_V(128, 64, 16, 4, 2), RDOT_V(128, 64, 16, 6, 2), RDOT_V(128, 128, 16, 4, 2),
    RDOT_V(64, 128, 16, 6, 1), RDOT_V(64, 64, 16, 4, 1), RDOT_VB(128, 64, 16, 4, 2),
    RDOT_VB(128, 64, 16, 6, 2),
};  // (the harness runs the bulk variants after all cp.async ones)
#else
const V kV[] = {
    RDOT_V(256, 64, 16, 4, 2), RDOT_V(128, 64, 32, 4, 2), RDOT_V(128, 64, 64, 4, 2),
    RDOT_V(128, 128, 64, 3, 2), RDOT_V(256, 32, 32, 6, 2), RDOT_VB(128, 128, 16, 4, 2),
    RDOT_VB(128, 64, 64, 4, 2),
};
#endif
}  // namespace

#define RDOT_CAT2(a, b) a##b
#define RDOT_CAT(a, b) RDOT_CAT2(a, b)
int RDOT_CAT(sweep_count_, RDOT_SWEEP_PART)() { return int(sizeof(kV) / sizeof(kV[0])); }
const char* RDOT_CAT(sweep_name_, RDOT_SWEEP_PART)(int v) { return kV[v].name; }
int RDOT_CAT(sweep_rows_, RDOT_SWEEP_PART)(int v) {
  // the R of the name (the third field)
  int bn, bk, r, st, w;
  std::sscanf(kV[v].name, "BN%d BK%d R%d st%d w%d", &bn, &bk, &r, &st, &w);
  return r;
}
cudaError_t RDOT_CAT(sweep_launch_, RDOT_SWEEP_PART)(int v, const RaggedDotArgs& a, int cs,
                                                     cudaStream_t s) {
  return kV[v].launch(a, cs, s);
}
