// Launch API of the CUDA all-gather (protocol in kernels/allgather.cuh).
#pragma once
#include <cuda_runtime.h>

#include "../common/layout.h"

namespace nvc {
namespace cuda {
// out[W * n]: rank r's n bytes at offset r * n. Requires n * W <= v.max_message_bytes.
cudaError_t all_gather(const CommView& v, const void* in, void* out, size_t n, cudaStream_t s);
}  // namespace cuda
}  // namespace nvc
