// Extension module `jax_nvcomm._cuda`: the CUDA backend. Device buffers (cudaMalloc + CUDA IPC,
// or VMM allocations passed as POSIX fds), peer access, the opt-in multicast transport (its C++
// functions refuse to run unless the environment allows it, see cuda_multicast.h), rank-context
// registration, and the XLA:CUDA FFI handlers (registered from Python).
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <optional>

#include "common/bindings.h"
#include "cuda/allgather.h"
#include "cuda/allreduce.h"
#include "cuda/build_info.h"
#include "cuda/moe.h"
#include "cuda/ragged.h"
#include "cuda/ragged_dot.h"
#include "cuda/varlen.h"
#include "transport/cuda_mem.h"
#include "transport/cuda_multicast.h"
#include "transport/cuda_vmm.h"

namespace nb = nanobind;
using namespace nvc;

NB_MODULE(_cuda, m) {
  add_common_bindings(m);
  // nvcc's __CUDA_ARCH_LIST__ of this build as ints, e.g. [900, 1000]
  m.def("compiled_archs", [] {
    int n = 0;
    const int* a = cuda::compiled_archs(&n);
    nb::list out;
    for (int i = 0; i < n; ++i) out.append(a[i]);
    return out;
  });
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
  m.def("enable_peer_access", &cuda::enable_peer_access);
  m.def("synchronize", &cuda::synchronize);
  // Load every kernel of the package on `device` now, with one shared-memory carveout, so no
  // first launch waits on a device that a spinning peer kernel keeps busy.
  m.def("load_kernels", [](int device) {
    if (cudaSetDevice(device) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
    for (cudaError_t e : {cuda::all_gather_load_kernels(), cuda::all_reduce_load_kernels(),
                          cuda::moe_load_kernels(), cuda::varlen_load_kernels(),
                          cuda::ragged_load_kernels(), cuda::ragged_dot_load_kernels()})
      if (e != cudaSuccess)
        throw std::runtime_error(std::string("jax_nvcomm: loading kernels: ") +
                                 cudaGetErrorString(e));
  });
  // The ragged_dot kernels alone on `device` (dynamic shared-memory limits raised, modules
  // loaded): jax_nvcomm/ragged_dot.py calls it once per device at trace time, so that the first
  // call, which XLA may record into a CUDA graph, does no module loading.
  m.def("ragged_dot_load_kernels", [](int device) {
    int prev = 0;
    cudaGetDevice(&prev);
    if (cudaSetDevice(device) != cudaSuccess) throw std::runtime_error("cudaSetDevice failed");
    const cudaError_t e = cuda::ragged_dot_load_kernels();
    cudaSetDevice(prev);
    if (e != cudaSuccess)
      throw std::runtime_error(std::string("jax_nvcomm: loading the ragged_dot kernels: ") +
                               cudaGetErrorString(e));
  });
  // The split-K workspace's bytes (cuda/ragged_dot.h): tests compare it with the Python op's
  // own computation (jax_nvcomm/ragged_dot.py _workspace_bytes).
  m.def("ragged_dot_workspace_bytes", &cuda::ragged_dot_workspace_bytes);
  m.def("read_u64", [](int device, uint64_t addr) {
    return cuda::read_u64(device, reinterpret_cast<const void*>(addr));
  });
  m.def("init_buffer", [](int device, uint64_t addr, uint64_t zero_bytes, uint64_t fill_off,
                          uint64_t fill_len, uint32_t fill_word) {
    cuda::init_buffer(device, reinterpret_cast<void*>(addr), zero_bytes, fill_off, fill_len,
                      fill_word);
  });

  // ---- VMM allocations and POSIX fd passing (cuda_vmm.h) ----
  using cuda::vmm::Allocation;
  using cuda::vmm::Mapping;
  nb::class_<Allocation>(m, "VmmAllocation")
      .def(nb::init<int, size_t, size_t, bool>(), nb::arg("device"), nb::arg("bytes"),
           nb::arg("align"), nb::arg("exportable"))
      .def_prop_ro("device", &Allocation::device)
      .def_prop_ro("ptr", &Allocation::ptr)
      .def_prop_ro("size", &Allocation::size)
      .def("export_fd", &Allocation::export_fd)
      .def("grant_access", &Allocation::grant_access)
      .def("release", &Allocation::release);
  nb::class_<Mapping>(m, "VmmMapping")
      .def(nb::init<int, int, int, size_t>(), nb::arg("device"), nb::arg("pid"), nb::arg("fd"),
           nb::arg("size"))
      .def_prop_ro("ptr", &Mapping::ptr)
      .def_prop_ro("size", &Mapping::size)
      .def("release", &Mapping::release);
  m.def("fd_from_process", &cuda::vmm::fd_from_process, nb::arg("pid"), nb::arg("fd"));
  // Device facts (UUID, multicast support, peer access) reach Python through cuda-python
  // (jax_nvcomm/topology/); C++ keeps only the checks its transports make themselves.

  // ---- multicast (cuda_multicast.h): every creating/joining call re-checks the environment ----
  m.def("multicast_env_allows",
        [](std::optional<std::string> multicast, std::optional<std::string> nvls) {
          std::string why;
          bool ok = cuda::mc::env_allows(multicast ? multicast->c_str() : nullptr,
                                         nvls ? nvls->c_str() : nullptr, &why);
          return std::make_pair(ok, why);
        },
        nb::arg("multicast").none(), nb::arg("nvls").none());
  m.def("multicast_granularity", &cuda::mc::granularity, nb::arg("device"), nb::arg("bytes"),
        nb::arg("world"), nb::arg("exportable"));
  using cuda::mc::Multicast;
  nb::class_<Multicast>(m, "Multicast")
      .def_static("create", &Multicast::create, nb::arg("device"), nb::arg("size"),
                  nb::arg("world"), nb::arg("exportable"))
      .def_static("import_from", &Multicast::import, nb::arg("device"), nb::arg("pid"),
                  nb::arg("fd"), nb::arg("size"), nb::arg("world"))
      .def_prop_ro("size", &Multicast::size)
      .def("export_fd", &Multicast::export_fd)
      .def("add_device", &Multicast::add_device, nb::call_guard<nb::gil_scoped_release>())
      .def("bind_and_map", &Multicast::bind_and_map, nb::call_guard<nb::gil_scoped_release>())
      .def("release", &Multicast::release);

  m.def("register_rank", [](int64_t comm_id, int device, int rank, int world,
                            std::vector<uint64_t> bufs, uint64_t timeout_ns,
                            uint64_t max_message_bytes, uint64_t multicast_base) {
    auto c = std::make_shared<RankContext>();
    c->comm_id = comm_id;
    c->slot = device;
    c->device = device;
    // the multicast kernels run only with a multicast address: none gets registered unless
    // the environment allows multicast (the same interlock as creating the object)
    if (multicast_base != 0) cuda::mc::multicast_interlock("registering a multicast address");
    c->multicast_base = reinterpret_cast<void*>(multicast_base);
    void* dev_err = nullptr;
    void* host_err = cuda::alloc_mapped_host(sizeof(ErrorInfo), &dev_err);
    c->resources = std::shared_ptr<void>(host_err, [](void* p) { cuda::free_mapped_host(p); });
    c->err_host = static_cast<ErrorInfo*>(host_err);
    c->view = make_view(rank, world, bufs, timeout_ns, max_message_bytes,
                        static_cast<ErrorInfo*>(dev_err));
    registry().add(std::move(c));
  }, nb::arg("comm_id"), nb::arg("device"), nb::arg("rank"), nb::arg("world"), nb::arg("bufs"),
     nb::arg("timeout_ns"), nb::arg("max_message_bytes"), nb::arg("multicast_base") = 0);
}
