// Internal to csrc/cuda: the package's tile choice for each rows tile R and the dispatch of one
// operand family over (R, out dtype); included by ragged_dot_bf16.cu, ragged_dot_f16.cu and
// ragged_dot_swiglu_{bf16,f16}.cu (each instantiates its own family). Each Kernel<...> must be
// instantiated in ONE translation unit only: without relocatable device code every unit holds
// its own copy of the kernel, and the per-device caches (shared-memory limit raised once) would
// then apply to one copy while another is launched (seen: "invalid argument").
// From the tile sweeps on one H200 (docs/perf/ragged_dot.md):
//   R 16 (decode, up to ~10 rows per group): BN 256 x BK 64, 4 stages, 8 warps of 2 m16 tiles,
//        items dealt round-robin, cp.async weights: 1.25-1.49x the weight-read bound (gate),
//        1.26-1.35x (down); balanced ranges were slower at every shape (1.3-2.4x), the
//        row-count loop alone within +-10%.
//   R 64 (~32 rows per group): BN 128 x BK 128, 3 stages, 4 warps of 2 m16 tiles, balanced
//        ranges, the row-count loop and TMA weights: 1.58x / 1.79x at 32 experts x 128 tokens
//        (was 1.99x / 2.16x; the row-count loop alone 1.75x / 1.92x).
//   swiglu: BN 128 x BK 64 over two weights, 8 warps of 1 m16 tile, 4 stages (R 16); at the
//        R 64 tier a rows tile of 48, 3 stages, balanced, the row-count loop: 1.73x (was 1.85x).
// Blocks per cluster: 1 (ragged_dot.cu ragged_dot_cluster): split-K over a cluster lost to it at
// every decode shape but one.
#pragma once
#include "ragged_dot_launch.cuh"

namespace nvc {
namespace cuda {
namespace rdot_launch {

template <class T, class TO, int R, bool SW>
struct DefaultTile;
template <class T, class TO>
struct DefaultTile<T, TO, 16, false> { using K = Kernel<T, TO, 256, 64, 16, 4, 2, false>; };
template <class T, class TO>
struct DefaultTile<T, TO, 64, false> {
  using K = Kernel<T, TO, 128, 128, 64, 3, 2, false,
                   dev::rdot::kBalanced | dev::rdot::kSpecRows | dev::rdot::kTma>;
};
template <class T, class TO>
struct DefaultTile<T, TO, 16, true> { using K = Kernel<T, TO, 128, 64, 16, 4, 1, true>; };
template <class T, class TO>
struct DefaultTile<T, TO, 64, true> {  // rows tile 48: a group past 48 rows takes two chunks
  using K = Kernel<T, TO, 128, 64, 48, 3, 1, true, dev::rdot::kBalanced | dev::rdot::kSpecRows>;
};

template <class T, class TO, int R, bool SW>
using Default = typename DefaultTile<T, TO, R, SW>::K;

template <class T, class TO, bool SW>
cudaError_t launch_rows(const RaggedDotArgs& a, int rows_tile, int cs, cudaStream_t s) {
  return rows_tile <= 16 ? Default<T, TO, 16, SW>::launch(a, cs, s)
                         : Default<T, TO, 64, SW>::launch(a, cs, s);
}

template <class T, class TO, bool SW>
cudaError_t load_rows() {
  if (cudaError_t e = Default<T, TO, 16, SW>::load(); e != cudaSuccess) return e;
  return Default<T, TO, 64, SW>::load();
}

}  // namespace rdot_launch
}  // namespace cuda
}  // namespace nvc
