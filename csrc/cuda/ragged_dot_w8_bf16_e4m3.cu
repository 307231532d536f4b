// bf16 x float8_e4m3fn ragged_dot and ragged_dot_swiglu kernels (8-bit weights; out bf16 or float32):
// see ragged_dot_parts.h.
#include "ragged_dot_family.cuh"
#include "ragged_dot_parts.h"

namespace nvc {
namespace cuda {
namespace rdot_parts {
cudaError_t w8_bf16_e4m3(const RaggedDotArgs& a, bool swiglu, int tile, int cluster,
                       cudaStream_t s) {
  return rdot_launch::launch_w8<__nv_bfloat16, __nv_fp8_e4m3>(a, swiglu, tile, cluster, s);
}
cudaError_t load_w8_bf16_e4m3() { return rdot_launch::load_w8<__nv_bfloat16, __nv_fp8_e4m3>(); }
}  // namespace rdot_parts
}  // namespace cuda
}  // namespace nvc
