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

// 8-bit weights (ragged_dot_w8 / ragged_dot_swiglu_w8): lhs of dtype bf16 or f16, rhs (and
// rhs2) int8 or float8_e4m3fn, each weight widened exactly to float32 and multiplied by its
// float32 scale s(g, k, n) (one float32 product) before the same row loop as above:
// scale_mode 0 none (s = 1), 1 per output channel (scale [g, n]), 2 per 128 x 128 block
// (scale [g, ceil(k / 128), ceil(n / 128)]). out is lhs's dtype or float32.
enum WeightDType : int { kW8E4M3 = 3, kW8Int8 = 4 };

struct RaggedDotW8HostArgs {
  RaggedDotHostArgs base;               // dtype: lhs's (kBF16 / kF16)
  int w_dtype = kW8Int8;                // kW8Int8 or kW8E4M3, rhs and rhs2 alike
  int scale_mode = 0;                   // 0, 1, 2
  const float* scale = nullptr;         // mode 1 / 2: rhs's scale (mode 0: unused)
  const float* scale2 = nullptr;        // swiglu: w_up's scale
};

std::string ragged_dot_w8(const RaggedDotW8HostArgs& a);

}  // namespace host
}  // namespace nvc
