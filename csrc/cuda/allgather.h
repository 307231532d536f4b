// Launch API of the CUDA all-gather (protocol in kernels/allgather.cuh).
#pragma once
#include <cuda_runtime.h>

#include "../common/layout.h"

namespace nvc {
namespace cuda {
// out[W * n]: rank r's n bytes at offset r * n. Requires n * W <= v.max_message_bytes.
cudaError_t all_gather(const CommView& v, const void* in, void* out, size_t n, cudaStream_t s);
// Load the kernel now (lazy loading at a first launch can wait for a device that a spinning
// peer kernel keeps busy).
cudaError_t all_gather_load_kernels();
}  // namespace cuda
}  // namespace nvc
