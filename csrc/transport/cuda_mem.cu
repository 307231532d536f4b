// CUDA transport implementation (see cuda_mem.h).
#include "cuda_mem.h"

#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>

namespace nvc {
namespace cuda {

static void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("jax_nvcomm: ") + what + " failed: " +
                             cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

__global__ void fill_u32(uint32_t* p, size_t n, uint32_t w) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = w;
}

void* alloc_buffer(int device, size_t bytes, size_t zero_bytes, size_t fill_off, size_t fill_len,
                   uint32_t fill_word) {
  check(cudaSetDevice(device), "cudaSetDevice");
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc of the communication buffer");
  init_buffer(device, p, zero_bytes, fill_off, fill_len, fill_word);
  return p;
}

void init_buffer(int device, void* p, size_t zero_bytes, size_t fill_off, size_t fill_len,
                 uint32_t fill_word) {
  check(cudaSetDevice(device), "cudaSetDevice");
  check(cudaMemset(p, 0, zero_bytes), "cudaMemset");
  if (fill_len > 0) {
    fill_u32<<<256, 256>>>(reinterpret_cast<uint32_t*>(static_cast<char*>(p) + fill_off),
                          fill_len / 4, fill_word);
    check(cudaGetLastError(), "fill kernel launch");
  }
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after buffer init");
}

void free_buffer(int device, void* p) {
  if (p == nullptr) return;
  cudaSetDevice(device);
  cudaFree(p);
}

std::string ipc_export(int device, void* p) {
  check(cudaSetDevice(device), "cudaSetDevice");
  cudaIpcMemHandle_t h;
  check(cudaIpcGetMemHandle(&h, p), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&h), sizeof h);
}

void* ipc_import(int device, const std::string& hs) {
  if (hs.size() != sizeof(cudaIpcMemHandle_t))
    throw std::runtime_error("jax_nvcomm: malformed CUDA IPC handle");
  check(cudaSetDevice(device), "cudaSetDevice");
  cudaIpcMemHandle_t h;
  std::memcpy(&h, hs.data(), sizeof h);
  void* p = nullptr;
  check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return p;
}

void ipc_close(int device, void* p) {
  if (p == nullptr) return;
  cudaSetDevice(device);
  cudaIpcCloseMemHandle(p);
}

bool can_access_peer(int device, int peer) {
  if (device == peer) return true;
  int ok = 0;
  check(cudaDeviceCanAccessPeer(&ok, device, peer), "cudaDeviceCanAccessPeer");
  return ok != 0;
}

void enable_peer_access(int device, int peer) {
  if (device == peer) return;
  if (!can_access_peer(device, peer))
    throw std::runtime_error("jax_nvcomm: GPU " + std::to_string(device) +
                             " cannot access GPU " + std::to_string(peer) +
                             " (no NVLink/P2P path); use strategy='xla'");
  check(cudaSetDevice(device), "cudaSetDevice");
  cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();
    return;
  }
  check(e, "cudaDeviceEnablePeerAccess");
}

void* alloc_mapped_host(size_t bytes, void** device_ptr) {
  void* p = nullptr;
  check(cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped), "cudaHostAlloc");
  std::memset(p, 0, bytes);
  check(cudaHostGetDevicePointer(device_ptr, p, 0), "cudaHostGetDevicePointer");
  return p;
}

void free_mapped_host(void* p) {
  if (p != nullptr) cudaFreeHost(p);
}

void synchronize(int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

uint64_t read_u64(int device, const void* dev_ptr) {
  check(cudaSetDevice(device), "cudaSetDevice");
  uint64_t v = 0;
  check(cudaMemcpy(&v, dev_ptr, sizeof v, cudaMemcpyDeviceToHost), "cudaMemcpy");
  return v;
}

}  // namespace cuda
}  // namespace nvc
