// bf16 x int8 ragged_dot and ragged_dot_swiglu kernels (8-bit weights; out bf16 or float32):
// see ragged_dot_parts.h.
#include "ragged_dot_family.cuh"
#include "ragged_dot_parts.h"

namespace nvc {
namespace cuda {
namespace rdot_parts {
cudaError_t w8_bf16_i8(const RaggedDotArgs& a, bool swiglu, int tile, int cluster,
                       cudaStream_t s) {
  return rdot_launch::launch_w8<__nv_bfloat16, int8_t>(a, swiglu, tile, cluster, s);
}
cudaError_t load_w8_bf16_i8() { return rdot_launch::load_w8<__nv_bfloat16, int8_t>(); }
}  // namespace rdot_parts
}  // namespace cuda
}  // namespace nvc
