// Internal to csrc/cuda: the package's tile choice for each rows tile R and the dispatch of one
// operand family over (R, out dtype); included by ragged_dot_bf16.cu, ragged_dot_f16.cu and
// ragged_dot_swiglu_{bf16,f16}.cu (each instantiates its own family).
//   ragged_dot: BN 128 weight columns x BK 64 per stage, 4 stages, 4 warps of 2 m16 tiles.
//   swiglu:     the same tile over two weights, 8 warps of 1 m16 tile (twice the accumulators),
//               3 stages at R 64 (shared memory).
#pragma once
#include "ragged_dot_launch.cuh"

namespace nvc {
namespace cuda {
namespace rdot_launch {

template <class T, class TO, int R, bool SW>
using Default = Kernel<T, TO, 128, 64, R, (SW && R == 64) ? 3 : 4, SW ? 1 : 2, SW>;

template <class T, class TO, bool SW>
cudaError_t launch_rows(const RaggedDotArgs& a, int rows_tile, int cs, cudaStream_t s) {
  switch (rows_tile) {
    case 16: return Default<T, TO, 16, SW>::launch(a, cs, s);
    case 32: return Default<T, TO, 32, SW>::launch(a, cs, s);
    default: return Default<T, TO, 64, SW>::launch(a, cs, s);
  }
}

template <class T, class TO, bool SW>
cudaError_t load_rows() {
  for (cudaError_t e : {Default<T, TO, 16, SW>::load(), Default<T, TO, 32, SW>::load(),
                        Default<T, TO, 64, SW>::load()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace rdot_launch
}  // namespace cuda
}  // namespace nvc
