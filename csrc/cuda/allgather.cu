// Launch configuration of the CUDA all-gather: a pure function of (n, world), identical on
// every rank; few blocks, all resident.
#include "allgather.h"

#include "../kernels/allgather.cuh"

namespace nvc {
namespace cuda {

cudaError_t all_gather(const CommView& v, const void* in, void* out, size_t n, cudaStream_t s) {
  const size_t slot = align_up((v.max_message_bytes + v.world - 1) / v.world, 256);
  if (n > slot || n * size_t(v.world) > v.max_message_bytes) return cudaErrorInvalidValue;
  const int threads = 512;
  // ~32 KiB per block, at most 32 blocks (more does not help over NVLink).
  size_t blocks = (n + 32767) / 32768;
  if (blocks < 1) blocks = 1;
  if (blocks > 32) blocks = 32;
  size_t chunk = align_up((n + blocks - 1) / blocks, 16);
  if (chunk == 0) chunk = 16;
  const uint32_t desc = make_desc(kOpAllGather, n);
  dev::all_gather_kernel<<<unsigned(blocks), threads, 0, s>>>(
      v, static_cast<const char*>(in), static_cast<char*>(out), n, slot, chunk, desc);
  return cudaGetLastError();
}

cudaError_t all_gather_load_kernels() {
  cudaFuncAttributes a;
  return cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(dev::all_gather_kernel));
}

}  // namespace cuda
}  // namespace nvc
