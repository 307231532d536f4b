// float16 ragged_dot kernels (out float16 or float32): see ragged_dot_parts.h.
#include "ragged_dot_family.cuh"
#include "ragged_dot_parts.h"

namespace nvc {
namespace cuda {
namespace rdot_parts {
using H = __half;
cudaError_t f16(const RaggedDotArgs& a, int tile, int cluster, cudaStream_t s) {
  return a.out_dtype == 0 ? rdot_launch::launch_rows<H, float, false>(a, tile, cluster, s)
                          : rdot_launch::launch_rows<H, H, false>(a, tile, cluster, s);
}
cudaError_t load_f16() {
  if (cudaError_t e = rdot_launch::load_rows<H, float, false>(); e != cudaSuccess) return e;
  return rdot_launch::load_rows<H, H, false>();
}
}  // namespace rdot_parts
}  // namespace cuda
}  // namespace nvc
