// Internal to csrc/cuda: the package's tile choice for each rows tile R and the dispatch of one
// operand family over (R, out dtype); included by ragged_dot_bf16.cu, ragged_dot_f16.cu and
// ragged_dot_swiglu_{bf16,f16}.cu (each instantiates its own family). Each Kernel<...> must be
// instantiated in ONE translation unit only: without relocatable device code every unit holds
// its own copy of the kernel, and the per-device caches (shared-memory limit raised once) would
// then apply to one copy while another is launched (seen: "invalid argument").
// From the tile sweep on one H200 (docs/perf/ragged_dot.md, round 1):
//   R 16 (decode, up to ~10 rows per group): BN 256 x BK 64, 4 stages, 8 warps of 2 m16 tiles,
//        no split-K: 1.23-1.52x the weight-read bound (the best of 14 variants x 4 cluster
//        sizes at 10 of the 12 decode shapes).
//   R 64 (~32 rows per group): BN 128 x BK 128, 3 stages, 4 warps of 2 m16 tiles, no split-K:
//        1.97x / 2.15x at 32 experts x 128 tokens (the best measured there).
//   swiglu: BN 128 x BK 64 over two weights, 8 warps of 1 m16 tile, 4 stages (3 at R 64).
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
struct DefaultTile<T, TO, 64, false> { using K = Kernel<T, TO, 128, 128, 64, 3, 2, false>; };
template <class T, class TO>
struct DefaultTile<T, TO, 16, true> { using K = Kernel<T, TO, 128, 64, 16, 4, 1, true>; };
template <class T, class TO>
struct DefaultTile<T, TO, 64, true> { using K = Kernel<T, TO, 128, 64, 64, 3, 1, true>; };

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
