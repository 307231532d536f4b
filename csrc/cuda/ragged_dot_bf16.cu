// bfloat16 ragged_dot kernels (out bfloat16 or float32): see ragged_dot_parts.h.
#include "ragged_dot_family.cuh"
#include "ragged_dot_parts.h"

namespace nvc {
namespace cuda {
namespace rdot_parts {
using B = __nv_bfloat16;
cudaError_t bf16(const RaggedDotArgs& a, int tile, int cluster, cudaStream_t s) {
  return a.out_dtype == 0 ? rdot_launch::launch_rows<B, float, false>(a, tile, cluster, s)
                          : rdot_launch::launch_rows<B, B, false>(a, tile, cluster, s);
}
cudaError_t load_bf16() {
  if (cudaError_t e = rdot_launch::load_rows<B, float, false>(); e != cudaSuccess) return e;
  return rdot_launch::load_rows<B, B, false>();
}
}  // namespace rdot_parts
}  // namespace cuda
}  // namespace nvc
