// Launch API of the CUDA variable-length gather / reduce-scatter (protocol in
// kernels/varlen.cuh, layout in common/varlen_layout.h).
//
// Contract: every rank calls with the same static sizes (max_rows, row_bytes, dtype), in the same
// order, one stream per rank; the grid is a pure function of them. No allocation, no
// synchronisation, no host state (CUDA-graph capturable). Counts and offsets are read by the
// kernel from device memory. Requires varlen_fits(M, W, max_rows, row_bytes); reduce_scatter_v
// also row_bytes % 16 == 0 and dtype 0 (f32), 1 (bf16) or 2 (f16). Invalid arguments return
// cudaErrorInvalidValue before anything is launched (varlen_check says why).
#pragma once
#include <cuda_runtime.h>

#include "../common/layout.h"

namespace nvc {
namespace cuda {
// in [max_rows, row_bytes]; num_rows: device int32 scalar; out [W * max_rows, row_bytes];
// offsets_out: device int32 [W + 1]; total_out: device int32 scalar. zero_tail: zero the rows
// of out past the total.
cudaError_t all_gather_v(const CommView& v, const void* in, const int32_t* num_rows, void* out,
                         int32_t* offsets_out, int32_t* total_out, int64_t max_rows,
                         size_t row_bytes, bool zero_tail, cudaStream_t s);
// y [W * max_rows, row_bytes] (gathered layout); offsets: device int32 [W + 1];
// out [max_rows, row_bytes].
cudaError_t reduce_scatter_v(const CommView& v, const void* y, const int32_t* offsets, void* out,
                             int64_t max_rows, size_t row_bytes, int dtype, cudaStream_t s);
// nullptr when valid, else why not (static text).
const char* varlen_check(const CommView& v, int64_t max_rows, size_t row_bytes, int dtype);
// Blocks per launch (pure function of the static sizes).
int varlen_grid(int64_t max_rows, size_t row_bytes);
cudaError_t varlen_load_kernels();
}  // namespace cuda
}  // namespace nvc
