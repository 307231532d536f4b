// CUDA VMM transport: symmetric buffers as physical allocations (cuMemCreate) mapped into a
// reserved VA range (cuMemMap + cuMemSetAccess), exportable to other processes as POSIX file
// descriptors. Used by the opt-in allocation mode JAX_NVCOMM_ALLOC=vmm and by the multicast
// transport (cuda_multicast.h), whose objects can only bind memory of this kind.
//
// Driver API: reached through the runtime's cudaGetDriverEntryPointByVersion (no link against
// libcuda, so the module still imports on machines without a driver); every entry point is
// requested at the ABI version of its PFN_*_v* type in cudaTypedefs.h.
//
// Protocol (multi-process): the owner exports its allocation as a POSIX fd and publishes
// (pid, fd, size); an importer duplicates that fd into itself with pidfd_open + pidfd_getfd
// (Linux >= 5.6; needs ptrace permission over the owner: Yama ptrace_scope 0 or CAP_SYS_PTRACE),
// imports it, closes its copy and maps it. The owner keeps its exported fd open until release(),
// so an importer may arrive at any time before that. Same process: peers use the owner's VA,
// after grant_access(peer device).
//
// Invariants: sizes are multiples of the allocation granularity (and of `align`); an object is
// released by release() only (idempotent; no destructor frees device memory, so interpreter
// shutdown order cannot matter); every failure throws std::runtime_error naming the call.
#pragma once
#include <cuda.h>

#if CUDA_VERSION < 12010
#error "jax_nvcomm needs the CUDA toolkit >= 12.1 (VMM multicast attribute and driver API)"
#endif

#include <cstddef>
#include <cstdint>
#include <string>

namespace nvc {
namespace cuda {
namespace vmm {

// Driver entry point `name` at ABI version `version` (e.g. 10020 for CUDA 10.2); throws if absent.
void* driver_entry(const char* name, unsigned version);
// Throws std::runtime_error "jax_nvcomm: <what> failed: <CUresult name>" unless r == CUDA_SUCCESS.
void check_cu(CUresult r, const char* what);
// The CUdevice of a runtime ordinal (no context change).
CUdevice cu_device(int device);
// Makes `device` current and its primary context live (runtime), returns its CUdevice.
CUdevice current_device(int device);
// Allocation granularity (recommended) of pinned device memory on `device`.
size_t allocation_granularity(int device, bool exportable);
// CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (a query only; creates nothing).
bool multicast_supported(int device);

// A file descriptor of process `pid`, duplicated into this process (pidfd_open + pidfd_getfd);
// the caller closes it. Throws with the reason (kernel too old, no ptrace permission, no process).
int fd_from_process(int pid, int fd);

// This rank's own buffer: physical memory on `device`, mapped at `ptr` with access for `device`.
class Allocation {
 public:
  // `bytes` rounded up to a multiple of lcm(allocation granularity, align) (align 0: none).
  Allocation(int device, size_t bytes, size_t align, bool exportable);
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;
  int device() const { return device_; }
  uint64_t ptr() const { return ptr_; }
  size_t size() const { return size_; }
  CUmemGenericAllocationHandle handle() const { return handle_; }
  int export_fd();                 // POSIX fd (created once, owned, closed by release())
  void grant_access(int device);   // read/write access to the mapping for another local device
  void release();                  // unmap, free the VA, release the handle, close the fd
 private:
  int device_ = -1;
  CUmemGenericAllocationHandle handle_ = 0;
  uint64_t ptr_ = 0;
  size_t size_ = 0;
  int fd_ = -1;
  bool exportable_ = false;
};

// A peer's buffer (another process) imported from (pid, fd) and mapped for `device`.
class Mapping {
 public:
  Mapping(int device, int pid, int fd, size_t size);
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  uint64_t ptr() const { return ptr_; }
  size_t size() const { return size_; }
  void release();  // unmap, free the VA, release the imported handle
 private:
  int device_ = -1;
  CUmemGenericAllocationHandle handle_ = 0;
  uint64_t ptr_ = 0;
  size_t size_ = 0;
};

// Building blocks shared with the multicast transport (cuda_multicast.cu).
// Reserve a VA range of `size` aligned to `align`, map `h` there, give `dev` read/write access;
// undoes its own steps on failure.
uint64_t map_handle(CUmemGenericAllocationHandle h, size_t size, size_t align, CUdevice dev);
void unmap_handle(uint64_t va, size_t size);              // unmap + free the VA (0: no-op)
void release_handle(CUmemGenericAllocationHandle h);      // cuMemRelease (0: no-op)
int export_handle(CUmemGenericAllocationHandle h);        // new POSIX fd, owned by the caller
CUmemGenericAllocationHandle import_handle(int pid, int fd);  // fd of `pid` -> handle

}  // namespace vmm
}  // namespace cuda
}  // namespace nvc
