// Internal to csrc/cuda: the ragged_dot kernel instantiations, one translation unit per operand
// family so that they compile in parallel (ragged_dot_bf16.cu, ragged_dot_f16.cu,
// ragged_dot_swiglu_bf16.cu, ragged_dot_swiglu_f16.cu; 8-bit weights, both forms, one unit per
// operand x weight dtype: ragged_dot_w8_{bf16,f16}_{i8,e4m3}.cu); ragged_dot.cu checks the arguments
// and picks one. `tile` is a RaggedDotTile (ragged_dot.h), `cluster` the blocks per cluster.
#pragma once
#include <cuda_runtime.h>

#include "ragged_dot.h"

namespace nvc {
namespace cuda {
namespace rdot_parts {
cudaError_t bf16(const RaggedDotArgs& a, int tile, int cluster, cudaStream_t s);
cudaError_t f16(const RaggedDotArgs& a, int tile, int cluster, cudaStream_t s);
cudaError_t swiglu_bf16(const RaggedDotArgs& a, int tile, int cluster, cudaStream_t s);
cudaError_t swiglu_f16(const RaggedDotArgs& a, int tile, int cluster, cudaStream_t s);
cudaError_t load_bf16();
cudaError_t load_f16();
cudaError_t load_swiglu_bf16();
cudaError_t load_swiglu_f16();
cudaError_t w8_bf16_i8(const RaggedDotArgs& a, bool swiglu, int tile, int cluster, cudaStream_t s);
cudaError_t w8_bf16_e4m3(const RaggedDotArgs& a, bool swiglu, int tile, int cluster,
                         cudaStream_t s);
cudaError_t w8_f16_i8(const RaggedDotArgs& a, bool swiglu, int tile, int cluster, cudaStream_t s);
cudaError_t w8_f16_e4m3(const RaggedDotArgs& a, bool swiglu, int tile, int cluster,
                        cudaStream_t s);
cudaError_t load_w8_bf16_i8();
cudaError_t load_w8_bf16_e4m3();
cudaError_t load_w8_f16_i8();
cudaError_t load_w8_f16_e4m3();
}  // namespace rdot_parts
}  // namespace cuda
}  // namespace nvc
