// Multicast (NVLink SHARP, "NVLS") transport: one multicast object per group, every rank's VMM
// buffer (cuda_vmm.h) bound to it, and the object mapped into each rank's address space. The
// mapped address is the `multicast_base` the all-reduce kernels take (allreduce_multicast.cuh):
// mc + (p - bufs[rank]) reaches offset p - bufs[rank] of every rank's buffer at once.
//
// NEVER ON MACHINES SHARED WITH OTHER USERS: multicast is switched off there, and creating a multicast
// object or running multimem instructions can take a shared host's GPUs out of service.
// Interlock: every function of this transport that creates, imports, exports, joins, binds or
// maps a multicast object (or queries its granularity) first re-reads the environment and throws
// unless JAX_NVCOMM_MULTICAST is "1" and NCCL_NVLS_ENABLE is not 0, whatever the Python gate
// (jax_nvcomm/_multicast.py) decided. Unbinding and releasing are not gated (nothing to undo
// otherwise). Driver API through the runtime's entry points (cuda_vmm.h), no libcuda link.
//
// Protocol (setup, all ranks of a group; jax_nvcomm/_symmetric.py drives it):
//   1. every rank allocates its buffer as a vmm::Allocation, size rounded to granularity();
//   2. the process of group rank 0 calls Multicast::create(numDevices = world, size = that
//      size) and, in a multi-process job, publishes (pid, export_fd(), size) in the key-value
//      store; every other process calls Multicast::import(pid, fd, size);
//   3. every rank calls add_device(its device) on its process's object;
//   4. barrier: every device of the group added (binding blocks until then);
//   5. every rank calls bind_and_map(its allocation): its memory joins the object at offset 0,
//      and the object is mapped at a fresh VA with access for its device; that VA is returned;
//   6. barrier before the first call that uses it.
// release(): for each bound device, unmap the VA, then unbind; release the handle; close the fd.
// Invariants: one object per (communicator, group); the bound size is the object's size, which
// every rank's allocation covers; offsets are 0, so buffer offsets and multicast offsets agree.
#pragma once
// The emulation build of the multicast kernels (allreduce_multicast.cuh) is a test build that
// must never hold code creating a multicast object.
#ifdef NVC_MULTICAST_EMULATE
#error "NVC_MULTICAST_EMULATE (the multicast kernels' test emulation) excludes the multicast transport"
#endif
#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda_vmm.h"

namespace nvc {
namespace cuda {
namespace mc {

// Pure: do these values of JAX_NVCOMM_MULTICAST and NCCL_NVLS_ENABLE (nullptr = unset) allow
// multicast? JAX_NVCOMM_MULTICAST must be exactly "1"; NCCL_NVLS_ENABLE must not be an integer
// equal to 0 (surrounding blanks allowed). On refusal, *why (if given) names the variable.
bool env_allows(const char* multicast, const char* nvls, std::string* why);

// Throws unless the environment allows multicast (env_allows on the process's variables);
// `what` names the refused action. Every interlocked function starts with it.
void multicast_interlock(const char* what);

// Minimum multicast granularity for an object of `bytes` over `world` devices (interlocked).
size_t granularity(int device, size_t bytes, int world, bool exportable);

class Multicast {
 public:
  // Interlocked. `size` must be a multiple of granularity(); exportable: multi-process group.
  static std::unique_ptr<Multicast> create(int device, size_t size, int world, bool exportable);
  // Interlocked. The object another process created and exported as fd `fd` of process `pid`.
  static std::unique_ptr<Multicast> import(int device, int pid, int fd, size_t size, int world);
  Multicast(const Multicast&) = delete;
  Multicast& operator=(const Multicast&) = delete;
  size_t size() const { return size_; }
  int export_fd();                              // interlocked; owned, closed by release()
  void add_device(int device);                  // interlocked
  uint64_t bind_and_map(vmm::Allocation& mem);  // interlocked; returns the multicast VA
  void release();                               // reverse order; idempotent
 private:
  Multicast() = default;
  struct Bound {
    int device;
    CUdevice cu;
    uint64_t va;
  };
  CUmemGenericAllocationHandle handle_ = 0;
  size_t size_ = 0;
  size_t gran_ = 0;
  int fd_ = -1;
  std::vector<Bound> bound_;
};

}  // namespace mc
}  // namespace cuda
}  // namespace nvc
