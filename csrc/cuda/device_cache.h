// Facts about the current device that the launchers ask the CUDA runtime for, cached per device
// so that a query runs once, not at every launch: the SM count, the resident blocks of a
// kernel. Host only, no stream work (fine inside graph capture). Internal to csrc/cuda.
#pragma once
#include <atomic>
#include <cstddef>

#include <cuda_runtime.h>

namespace nvc {
namespace cuda {

// Once per device: query(dev) (a count, > 0 when it worked), cached in cache[dev]; 0 when the
// query failed (also cached: it is not retried).
template <class Query>
int once_per_device(std::atomic<int> (&cache)[64], Query&& query) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  const int c = cache[dev].load(std::memory_order_relaxed);
  if (c != 0) return c < 0 ? 0 : c;
  const int n = query(dev);
  cudaGetLastError();  // a failed query's error is reported as 0, not left for the next check
  cache[dev].store(n > 0 ? n : -1, std::memory_order_relaxed);
  return n > 0 ? n : 0;
}

// Multiprocessors of the current device, once per device; 0 when the query failed.
inline int device_sm_count() {
  static std::atomic<int> cache[64];
  return once_per_device(cache, [](int dev) {
    int c = 0;
    return cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess ? c : 0;
  });
}

// Blocks of `kernel` (`threads` per block, `smem` bytes of dynamic shared memory) the current
// device holds at once: device_sm_count() x the occupancy API's blocks per SM; 0 when a query
// failed. The occupancy query runs at every call (its answer depends on smem):
// resident_blocks_cached keeps it for a fixed launch configuration.
inline int resident_blocks(const void* kernel, int threads, size_t smem) {
  const int sms = device_sm_count();
  int per_sm = 0;
  if (sms <= 0 ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) !=
          cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return sms * per_sm;
}

// resident_blocks(kKernel, kThreads, no dynamic shared memory), once per device.
template <auto kKernel, int kThreads>
int resident_blocks_cached() {
  static std::atomic<int> cache[64];
  return once_per_device(cache, [](int) {
    return resident_blocks(reinterpret_cast<const void*>(kKernel), kThreads, 0);
  });
}

}  // namespace cuda
}  // namespace nvc
