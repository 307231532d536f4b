// CUDA transport: device buffers for the symmetric regions, CUDA IPC export/import between
// processes, peer access between devices of one process, and host-mapped error blocks.
// All functions throw std::runtime_error naming the failed CUDA call.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace nvc {
namespace cuda {
// Allocate `bytes` on `device`, zero the first `zero_bytes`, fill [fill_off, fill_off+fill_len)
// with the 32-bit word `fill_word` (the Lamport "empty" pattern). Synchronous (setup only).
void* alloc_buffer(int device, size_t bytes, size_t zero_bytes, size_t fill_off, size_t fill_len,
                   uint32_t fill_word);
// The same initialisation of a buffer allocated elsewhere (a VMM allocation, cuda_vmm.h).
void init_buffer(int device, void* p, size_t zero_bytes, size_t fill_off, size_t fill_len,
                 uint32_t fill_word);
void free_buffer(int device, void* p);
std::string ipc_export(int device, void* p);         // 64-byte cudaIpcMemHandle_t
void* ipc_import(int device, const std::string& h);  // maps a peer's buffer in this process
void ipc_close(int device, void* p);
void enable_peer_access(int device, int peer);       // idempotent; throws if unsupported
bool can_access_peer(int device, int peer);
void* alloc_mapped_host(size_t bytes, void** device_ptr);  // zeroed, portable + mapped
void free_mapped_host(void* p);
void synchronize(int device);
int device_count();
uint64_t read_u64(int device, const void* dev_ptr);  // synchronous copy (tests only)
}  // namespace cuda
}  // namespace nvc
