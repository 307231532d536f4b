// Extension module `jax_nvcomm._cuda`: the CUDA backend. Device buffers, CUDA IPC and peer
// access, rank-context registration, and the XLA:CUDA FFI handlers (registered from Python).
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "common/bindings.h"
#include "cuda/allgather.h"
#include "cuda/allreduce.h"
#include "cuda/moe.h"
#include "transport/cuda_mem.h"

namespace nb = nanobind;
using namespace nvc;

NB_MODULE(_cuda, m) {
  add_common_bindings(m);
  m.def("device_count", &cuda::device_count);
  m.def("alloc_buffer", [](int device, uint64_t bytes, uint64_t zero_bytes, uint64_t fill_off,
                           uint64_t fill_len, uint32_t fill_word) {
    return reinterpret_cast<uint64_t>(
        cuda::alloc_buffer(device, bytes, zero_bytes, fill_off, fill_len, fill_word));
  });
  m.def("free_buffer", [](int device, uint64_t addr) {
    cuda::free_buffer(device, reinterpret_cast<void*>(addr));
  });
  m.def("ipc_export", [](int device, uint64_t addr) {
    std::string h = cuda::ipc_export(device, reinterpret_cast<void*>(addr));
    return nb::bytes(h.data(), h.size());
  });
  m.def("ipc_import", [](int device, nb::bytes h) {
    return reinterpret_cast<uint64_t>(
        cuda::ipc_import(device, std::string(static_cast<const char*>(h.data()), h.size())));
  });
  m.def("ipc_close", [](int device, uint64_t addr) {
    cuda::ipc_close(device, reinterpret_cast<void*>(addr));
  });
  m.def("can_access_peer", &cuda::can_access_peer);
  m.def("enable_peer_access", &cuda::enable_peer_access);
  m.def("synchronize", &cuda::synchronize);
  // Load every kernel of the package on `device` now, with one shared-memory carveout, so no
  // first launch waits on a device that a spinning peer kernel keeps busy.
  m.def("load_kernels", [](int device) {
    if (cudaSetDevice(device) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
    for (cudaError_t e : {cuda::all_gather_load_kernels(), cuda::all_reduce_load_kernels(),
                          cuda::moe_load_kernels()})
      if (e != cudaSuccess)
        throw std::runtime_error(std::string("jax_nvcomm: loading kernels: ") +
                                 cudaGetErrorString(e));
  });
  m.def("read_u64", [](int device, uint64_t addr) {
    return cuda::read_u64(device, reinterpret_cast<const void*>(addr));
  });
  m.def("register_rank", [](int64_t comm_id, int device, int rank, int world,
                            std::vector<uint64_t> bufs, uint64_t timeout_ns,
                            uint64_t max_message_bytes) {
    auto c = std::make_shared<RankContext>();
    c->comm_id = comm_id;
    c->slot = device;
    c->device = device;
    void* dev_err = nullptr;
    void* host_err = cuda::alloc_mapped_host(sizeof(ErrorInfo), &dev_err);
    c->resources = std::shared_ptr<void>(host_err, [](void* p) { cuda::free_mapped_host(p); });
    c->err_host = static_cast<ErrorInfo*>(host_err);
    c->view = make_view(rank, world, bufs, timeout_ns, max_message_bytes,
                        static_cast<ErrorInfo*>(dev_err));
    registry().add(std::move(c));
  });
}
