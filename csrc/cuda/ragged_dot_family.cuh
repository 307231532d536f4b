// Internal to csrc/cuda: the package's tile choice for each rows tile R and the dispatch of one
// operand family over (R, out dtype); included by ragged_dot_bf16.cu, ragged_dot_f16.cu and
// ragged_dot_swiglu_{bf16,f16}.cu (each instantiates its own family). Each Kernel<...> must be
// instantiated in ONE translation unit only: without relocatable device code every unit holds
// its own copy of the kernel, and the per-device caches (shared-memory limit raised once) would
// then apply to one copy while another is launched (seen: "invalid argument").
// From the tile sweeps on one H200 (docs/perf/ragged_dot.md, 2026-12-02; x the weight-read
// bound, gate / down / swiglu):
//   kRows16 (decode, up to ~10 rows per group): BN 256 x BK 64, 4 stages, 8 warps of 2 m16
//        tiles, items dealt round-robin, cp.async weights: 1.26-1.49 / 1.26-1.35; balanced
//        ranges were slower at every shape with cp.async (1.3-2.4). swiglu: BN 128 x BK 64
//        over two weights, 8 warps of 1 m16 tile, 4 stages: 1.32-1.62.
//   kRows16ManyGroups (the same rows, G >= 128): the gate-shaped product (N <= K) on balanced
//        ranges with the row-count loop and TMA weights: 1.37 / 1.27 / 1.23 at 256 experts x 8 /
//        32 / 128 tokens (round robin 1.45 / 1.28 / 1.26; down-shaped stays round robin: 1.29
//        against 1.40); swiglu with the row-count loop: 1.33 / 1.31 / 1.28 (1.32 / 1.34 / 1.35).
//   kRows64 (~32 rows per group): BN 128 x BK 128, 3 stages, 4 warps of 2 m16 tiles, balanced
//        ranges, the row-count loop and TMA weights: 1.58 / 1.79 at 32 experts x 128 tokens (was
//        1.99 / 2.16; the row-count loop alone 1.75 / 1.92); swiglu BN 128 x BK 64, 3 stages,
//        the same options: 1.60 (was 1.85).
// Blocks per cluster: 1 (ragged_dot.cu ragged_dot_cluster): split-K over a cluster lost to it at
// every decode shape but one.
#pragma once
#include "ragged_dot_launch.cuh"

namespace nvc {
namespace cuda {
namespace rdot_launch {

namespace o = dev::rdot;

// The package's tile for each tile kind of ragged_dot.h (RaggedDotTile) and family.
template <class T, class TO, int KIND, bool SW>
struct DefaultTile;
template <class T, class TO>
struct DefaultTile<T, TO, kRows16, false> {
  using K = Kernel<T, TO, 256, 64, 16, 4, 2, false, o::kSplitK>;
};
template <class T, class TO>
struct DefaultTile<T, TO, kRows16ManyGroups, false> {
  using K = Kernel<T, TO, 256, 64, 16, 4, 2, false, o::kBalanced | o::kSpecRows | o::kTma>;
};
template <class T, class TO>
struct DefaultTile<T, TO, kRows64, false> {
  using K = Kernel<T, TO, 128, 128, 64, 3, 2, false, o::kBalanced | o::kSpecRows | o::kTma>;
};
template <class T, class TO>
struct DefaultTile<T, TO, kRows16, true> {
  using K = Kernel<T, TO, 128, 64, 16, 4, 1, true, o::kSplitK>;
};
template <class T, class TO>
struct DefaultTile<T, TO, kRows16ManyGroups, true> {
  using K = Kernel<T, TO, 128, 64, 16, 4, 1, true, o::kSpecRows | o::kSplitK>;
};
template <class T, class TO>
struct DefaultTile<T, TO, kRows64, true> {
  using K = Kernel<T, TO, 128, 64, 64, 3, 1, true, o::kBalanced | o::kSpecRows | o::kTma>;
};

template <class T, class TO, int KIND, bool SW>
using Default = typename DefaultTile<T, TO, KIND, SW>::K;

template <class T, class TO, bool SW>
cudaError_t launch_rows(const RaggedDotArgs& a, int tile, int cs, cudaStream_t s) {
  switch (tile) {
    case kRows16: return Default<T, TO, kRows16, SW>::launch(a, cs, s);
    case kRows16ManyGroups: return Default<T, TO, kRows16ManyGroups, SW>::launch(a, cs, s);
    default: return Default<T, TO, kRows64, SW>::launch(a, cs, s);
  }
}

template <class T, class TO, bool SW>
cudaError_t load_rows() {
  if (cudaError_t e = Default<T, TO, kRows16, SW>::load(); e != cudaSuccess) return e;
  if (cudaError_t e = Default<T, TO, kRows16ManyGroups, SW>::load(); e != cudaSuccess) return e;
  return Default<T, TO, kRows64, SW>::load();
}

}  // namespace rdot_launch
}  // namespace cuda
}  // namespace nvc
