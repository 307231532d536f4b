// ragged_dot_swiglu kernels (bfloat16 or float16 operands, out of the operands' dtype or
// float32): see ragged_dot_parts.h.
#include "ragged_dot_family.cuh"
#include "ragged_dot_parts.h"

namespace nvc {
namespace cuda {
namespace rdot_parts {
using B = __nv_bfloat16;
using H = __half;
cudaError_t swiglu(const RaggedDotArgs& a, int rows_tile, int cluster, cudaStream_t s) {
  if (a.dtype == 1)
    return a.out_dtype == 0 ? rdot_launch::launch_rows<B, float, true>(a, rows_tile, cluster, s)
                            : rdot_launch::launch_rows<B, B, true>(a, rows_tile, cluster, s);
  return a.out_dtype == 0 ? rdot_launch::launch_rows<H, float, true>(a, rows_tile, cluster, s)
                          : rdot_launch::launch_rows<H, H, true>(a, rows_tile, cluster, s);
}
cudaError_t load_swiglu() {
  for (cudaError_t e : {rdot_launch::load_rows<B, float, true>(), rdot_launch::load_rows<B, B, true>(),
                        rdot_launch::load_rows<H, float, true>(), rdot_launch::load_rows<H, H, true>()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}
}  // namespace rdot_parts
}  // namespace cuda
}  // namespace nvc
