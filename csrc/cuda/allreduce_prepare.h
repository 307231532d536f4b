// Loading the all-reduce kernels and setting their attributes, once per (kernel, device): shared
// by the launch code of allreduce.cu and allreduce_cluster.h (which also cache per-device
// queries: device_cache.h). Internal to csrc/cuda.
#pragma once
#include <atomic>
#include <cstdint>

#include <cuda_runtime.h>

#include "device_cache.h"

namespace nvc {
namespace cuda {
namespace ar_detail {

// Fused rows keep float32 r in dynamic shared memory: hidden * 4 bytes for one row.
constexpr int64_t kMaxFusedHidden = 32768;
constexpr int kMaxDynSmem = int(kMaxFusedHidden * 4);

// Load a kernel and set its attributes, once per (kernel, device): the dynamic shared memory
// limit (fused rows need up to 128 KiB) and the same carveout as every other kernel of the
// package (an SM changes its L1/shared split only when idle, so a kernel that wants another
// split may never be scheduled next to spinning blocks). Loading early also keeps lazy module
// loading out of the first launch. Attributes only, no stream work: fine inside graph capture.
template <auto kKernel>
cudaError_t prepare_kernel() {
  static std::atomic<uint64_t> done{0};
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if ((done.load(std::memory_order_relaxed) & bit) != 0) return cudaSuccess;
  const void* f = reinterpret_cast<const void*>(kKernel);
  cudaFuncAttributes a;
  if (cudaError_t e = cudaFuncGetAttributes(&a, f); e != cudaSuccess) return e;
  if (cudaError_t e = cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           kMaxDynSmem);
      e != cudaSuccess)
    return e;
  if (cudaError_t e = cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           int(cudaSharedmemCarveoutMaxShared));
      e != cudaSuccess)
    return e;
  done.fetch_or(bit, std::memory_order_relaxed);
  return cudaSuccess;
}

}  // namespace ar_detail
}  // namespace cuda
}  // namespace nvc
