// Host (CPU devices) ragged_dot and ragged_dot_swiglu: the same semantics as the CUDA kernel
// (kernels/ragged_dot.cuh): group g owns rows [start_g, end_g) of lhs, the running sums of
// max(size, 0) clipped to M; out[r] = lhs[r] @ rhs[g] (swiglu: silu(lhs[r] @ w_gate[g]) *
// (lhs[r] @ w_up[g])) accumulated in float32 over k in order, rounded once to out's dtype; rows
// past the last group are zero. dtype codes of host/dtypes.h (0 f32, 1 bf16, 2 f16); operands
// share one dtype, out is that dtype or float32.
#pragma once
#include <cstdint>
#include <string>

namespace nvc {
namespace host {

struct RaggedDotHostArgs {
  const void* lhs = nullptr;            // [m, k]
  const void* rhs = nullptr;            // [g, k, n] (swiglu: w_gate)
  const void* rhs2 = nullptr;           // swiglu: w_up [g, k, n]; else nullptr
  const int32_t* group_sizes = nullptr; // [g]
  void* out = nullptr;                  // [m, n]
  int64_t m = 0, k = 0, n = 0, g = 0;
  int dtype = 0, out_dtype = 0;
};

// "" on success, else the reason (nothing written).
std::string ragged_dot(const RaggedDotHostArgs& a);

}  // namespace host
}  // namespace nvc
