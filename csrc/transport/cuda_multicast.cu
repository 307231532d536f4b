// Multicast transport implementation (see cuda_multicast.h for the protocol and invariants).
//
// The only file of the package that creates multicast objects. Every function below that
// creates, imports, exports, joins, binds, maps or sizes one starts with multicast_interlock(),
// which re-reads the environment (tests/test_build.py checks this structure).
#include "cuda_multicast.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace nvc {
namespace cuda {
namespace mc {

namespace {

struct McApi {
  PFN_cuMulticastCreate_v12010 cuMulticastCreate;
  PFN_cuMulticastAddDevice_v12010 cuMulticastAddDevice;
  PFN_cuMulticastBindMem_v12010 cuMulticastBindMem;
  PFN_cuMulticastUnbind_v12010 cuMulticastUnbind;
  PFN_cuMulticastGetGranularity_v12010 cuMulticastGetGranularity;
};

#define NVC_LOAD(api, name, ver) \
  api.name = reinterpret_cast<PFN_##name##_v##ver>(vmm::driver_entry(#name, ver))

McApi load_mc_api() {
  McApi a{};
  NVC_LOAD(a, cuMulticastCreate, 12010);
  NVC_LOAD(a, cuMulticastAddDevice, 12010);
  NVC_LOAD(a, cuMulticastBindMem, 12010);
  NVC_LOAD(a, cuMulticastUnbind, 12010);
  NVC_LOAD(a, cuMulticastGetGranularity, 12010);
  return a;
}
#undef NVC_LOAD

const McApi& mc_api() {
  static const McApi a = load_mc_api();
  return a;
}

CUmulticastObjectProp mc_prop(size_t size, int world, bool exportable) {
  CUmulticastObjectProp p{};
  p.numDevices = static_cast<unsigned int>(world);
  p.size = size;
  p.handleTypes = exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  p.flags = 0;
  return p;
}

// NCCL_NVLS_ENABLE counts as "0" when it is a decimal integer equal to zero ("0", " 0", "00").
bool is_integer_zero(const char* s) {
  while (std::isspace(static_cast<unsigned char>(*s))) ++s;
  if (*s == '+' || *s == '-') ++s;
  if (!std::isdigit(static_cast<unsigned char>(*s))) return false;
  bool zero = true;
  for (; std::isdigit(static_cast<unsigned char>(*s)); ++s) zero &= (*s == '0');
  while (std::isspace(static_cast<unsigned char>(*s))) ++s;
  return *s == '\0' && zero;
}

}  // namespace

// THE INTERLOCK. Re-reads the environment on every call: multicast only with
// JAX_NVCOMM_MULTICAST=1 and NCCL_NVLS_ENABLE not 0, whatever the caller decided.
void multicast_interlock(const char* what) {
  const char* want = std::getenv("JAX_NVCOMM_MULTICAST");
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  std::string why;
  if (!env_allows(want, nvls, &why))
    throw std::runtime_error(std::string("jax_nvcomm: ") + what + " refused: " + why +
                             " (multicast is opt-in and must never run on machines where it is "
                             "switched off)");
}

bool env_allows(const char* multicast, const char* nvls, std::string* why) {
  if (multicast == nullptr || std::strcmp(multicast, "1") != 0) {
    if (why) *why = "JAX_NVCOMM_MULTICAST is not 1";
    return false;
  }
  if (nvls != nullptr && is_integer_zero(nvls)) {
    if (why) *why = "NCCL_NVLS_ENABLE=0 (NVLink SHARP is switched off on this machine)";
    return false;
  }
  return true;
}

size_t granularity(int device, size_t bytes, int world, bool exportable) {
  multicast_interlock("querying the multicast granularity");
  vmm::current_device(device);
  CUmulticastObjectProp prop = mc_prop(bytes, world, exportable);
  size_t g = 0;
  // Minimum, not recommended: the recommended granularity can be far larger than a buffer.
  vmm::check_cu(mc_api().cuMulticastGetGranularity(&g, &prop, CU_MULTICAST_GRANULARITY_MINIMUM),
                "cuMulticastGetGranularity");
  return g;
}

std::unique_ptr<Multicast> Multicast::create(int device, size_t size, int world,
                                             bool exportable) {
  multicast_interlock("creating a multicast object");
  if (world < 2) throw std::invalid_argument("jax_nvcomm: multicast needs a group of >= 2 GPUs");
  vmm::current_device(device);
  if (!vmm::multicast_supported(device))
    throw std::runtime_error("jax_nvcomm: GPU " + std::to_string(device) +
                             " does not report CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED");
  const size_t g = granularity(device, size, world, exportable);
  if (size == 0 || size % g != 0)
    throw std::invalid_argument("jax_nvcomm: multicast size " + std::to_string(size) +
                                " is not a multiple of the granularity " + std::to_string(g));
  std::unique_ptr<Multicast> m(new Multicast());
  m->size_ = size;
  m->gran_ = g;
  CUmulticastObjectProp prop = mc_prop(size, world, exportable);
  vmm::check_cu(mc_api().cuMulticastCreate(&m->handle_, &prop), "cuMulticastCreate");
  return m;
}

std::unique_ptr<Multicast> Multicast::import(int device, int pid, int fd, size_t size,
                                             int world) {
  multicast_interlock("importing a multicast object");
  vmm::current_device(device);
  if (!vmm::multicast_supported(device))
    throw std::runtime_error("jax_nvcomm: GPU " + std::to_string(device) +
                             " does not report CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED");
  const size_t g = granularity(device, size, world, true);
  if (size == 0 || size % g != 0)
    throw std::invalid_argument("jax_nvcomm: imported multicast size " + std::to_string(size) +
                                " is not a multiple of the granularity " + std::to_string(g));
  std::unique_ptr<Multicast> m(new Multicast());
  m->size_ = size;
  m->gran_ = g;
  m->handle_ = vmm::import_handle(pid, fd);
  return m;
}

int Multicast::export_fd() {
  multicast_interlock("exporting a multicast object");
  if (handle_ == 0) throw std::logic_error("jax_nvcomm: multicast object already released");
  if (fd_ < 0) fd_ = vmm::export_handle(handle_);
  return fd_;
}

void Multicast::add_device(int device) {
  multicast_interlock("adding a device to a multicast object");
  if (handle_ == 0) throw std::logic_error("jax_nvcomm: multicast object already released");
  CUdevice d = vmm::current_device(device);
  vmm::check_cu(mc_api().cuMulticastAddDevice(handle_, d), "cuMulticastAddDevice");
}

uint64_t Multicast::bind_and_map(vmm::Allocation& mem) {
  multicast_interlock("binding memory to a multicast object");
  if (handle_ == 0) throw std::logic_error("jax_nvcomm: multicast object already released");
  if (mem.size() < size_)
    throw std::invalid_argument("jax_nvcomm: buffer of " + std::to_string(mem.size()) +
                                " bytes is smaller than the multicast object (" +
                                std::to_string(size_) + " bytes)");
  CUdevice d = vmm::current_device(mem.device());
  vmm::check_cu(mc_api().cuMulticastBindMem(handle_, 0, mem.handle(), 0, size_, 0),
                "cuMulticastBindMem");
  bound_.push_back(Bound{mem.device(), d, 0});
  bound_.back().va = vmm::map_handle(handle_, size_, gran_, d);  // on failure: unbound in release
  return bound_.back().va;
}

void Multicast::release() {
  for (auto it = bound_.rbegin(); it != bound_.rend(); ++it) {
    cudaSetDevice(it->device);
    vmm::unmap_handle(it->va, size_);
    mc_api().cuMulticastUnbind(handle_, it->cu, 0, size_);
  }
  bound_.clear();
  vmm::release_handle(handle_);
  handle_ = 0;
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

}  // namespace mc
}  // namespace cuda
}  // namespace nvc
