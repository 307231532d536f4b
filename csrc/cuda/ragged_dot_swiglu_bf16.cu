// ragged_dot_swiglu kernels with bfloat16 operands (out bfloat16 or float32): see ragged_dot_parts.h.
#include "ragged_dot_family.cuh"
#include "ragged_dot_parts.h"

namespace nvc {
namespace cuda {
namespace rdot_parts {
using E = __nv_bfloat16;
cudaError_t swiglu_bf16(const RaggedDotArgs& a, int tile, int cluster, cudaStream_t s) {
  return a.out_dtype == 0 ? rdot_launch::launch_rows<E, float, true>(a, tile, cluster, s)
                          : rdot_launch::launch_rows<E, E, true>(a, tile, cluster, s);
}
cudaError_t load_swiglu_bf16() {
  if (cudaError_t e = rdot_launch::load_rows<E, float, true>(); e != cudaSuccess) return e;
  return rdot_launch::load_rows<E, E, true>();
}
}  // namespace rdot_parts
}  // namespace cuda
}  // namespace nvc
