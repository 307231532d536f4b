// CUDA VMM transport implementation (see cuda_vmm.h for the protocol and invariants).
#include "cuda_vmm.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <stdexcept>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // same number on every architecture Linux assigns it on
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

namespace nvc {
namespace cuda {
namespace vmm {

namespace {

struct Api {
  PFN_cuGetErrorName_v6000 cuGetErrorName;
  PFN_cuDeviceGet_v2000 cuDeviceGet;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity;
  PFN_cuMemCreate_v10020 cuMemCreate;
  PFN_cuMemRelease_v10020 cuMemRelease;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree;
  PFN_cuMemMap_v10020 cuMemMap;
  PFN_cuMemUnmap_v10020 cuMemUnmap;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess;
  PFN_cuMemExportToShareableHandle_v10020 cuMemExportToShareableHandle;
  PFN_cuMemImportFromShareableHandle_v10020 cuMemImportFromShareableHandle;
};

#define NVC_LOAD(api, name, ver) \
  api.name = reinterpret_cast<PFN_##name##_v##ver>(driver_entry(#name, ver))

Api load_api() {
  Api a{};
  NVC_LOAD(a, cuGetErrorName, 6000);
  NVC_LOAD(a, cuDeviceGet, 2000);
  NVC_LOAD(a, cuDeviceGetAttribute, 2000);
  NVC_LOAD(a, cuMemGetAllocationGranularity, 10020);
  NVC_LOAD(a, cuMemCreate, 10020);
  NVC_LOAD(a, cuMemRelease, 10020);
  NVC_LOAD(a, cuMemAddressReserve, 10020);
  NVC_LOAD(a, cuMemAddressFree, 10020);
  NVC_LOAD(a, cuMemMap, 10020);
  NVC_LOAD(a, cuMemUnmap, 10020);
  NVC_LOAD(a, cuMemSetAccess, 10020);
  NVC_LOAD(a, cuMemExportToShareableHandle, 10020);
  NVC_LOAD(a, cuMemImportFromShareableHandle, 10020);
  return a;
}
#undef NVC_LOAD

// Loaded on first use (a failure throws and the next call tries again).
const Api& api() {
  static const Api a = load_api();
  return a;
}

void check_rt(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("jax_nvcomm: ") + what + " failed: " +
                             cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

CUmemAllocationProp alloc_prop(CUdevice dev, bool exportable) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = dev;
  p.requestedHandleTypes =
      exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  return p;
}

size_t round_up(size_t n, size_t unit) { return (n + unit - 1) / unit * unit; }

}  // namespace

void* driver_entry(const char* name, unsigned version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t e = cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &q);
#else
  (void)version;
  cudaError_t e = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &q);
#endif
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || fn == nullptr) {
    const char* why = e != cudaSuccess ? cudaGetErrorString(e)
                      : q == cudaDriverEntryPointVersionNotSufficent
                          ? "the installed driver is older than this entry point"
                          : "symbol not found in the driver";
    throw std::runtime_error(std::string("jax_nvcomm: CUDA driver entry point ") + name + " (v" +
                             std::to_string(version) + ") unavailable: " + why);
  }
  return fn;
}

void check_cu(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  if (api().cuGetErrorName(r, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown error";
  throw std::runtime_error(std::string("jax_nvcomm: ") + what + " failed: " + name + " (" +
                           std::to_string(int(r)) + ")");
}

CUdevice cu_device(int device) {
  CUdevice d = 0;
  check_cu(api().cuDeviceGet(&d, device), "cuDeviceGet");
  return d;
}

CUdevice current_device(int device) {
  check_rt(cudaSetDevice(device), "cudaSetDevice");
  check_rt(cudaFree(nullptr), "initialising the CUDA context");
  return cu_device(device);
}

size_t allocation_granularity(int device, bool exportable) {
  CUmemAllocationProp prop = alloc_prop(current_device(device), exportable);
  size_t g = 0;
  check_cu(api().cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
           "cuMemGetAllocationGranularity");
  return g;
}

bool multicast_supported(int device) {
  int v = 0;
  check_cu(api().cuDeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED,
                                      current_device(device)),
           "cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)");
  return v != 0;
}

int fd_from_process(int pid, int fd) {
  if (pid == static_cast<int>(getpid())) {
    int d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (d < 0)
      throw std::runtime_error("jax_nvcomm: duplicating file descriptor " + std::to_string(fd) +
                               " failed: " + std::strerror(errno));
    return d;
  }
  const std::string who = "process " + std::to_string(pid);
  int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) {
    const int e = errno;
    std::string hint = e == ENOSYS ? " (the kernel lacks pidfd_open: Linux >= 5.6 is needed)"
                       : e == ESRCH ? " (no such process here: every process of the group must "
                                      "run on this host, in one PID namespace)"
                                    : "";
    throw std::runtime_error("jax_nvcomm: pidfd_open(" + who + ") failed: " +
                             std::strerror(e) + hint);
  }
  int got = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, fd, 0));
  const int e = errno;
  close(pidfd);
  if (got < 0) {
    std::string hint =
        e == EPERM ? " (taking a file descriptor from another process needs ptrace access to "
                     "it: set /proc/sys/kernel/yama/ptrace_scope to 0 or grant CAP_SYS_PTRACE; "
                     "in a container the seccomp profile must also allow pidfd_getfd)"
        : e == ENOSYS ? " (the kernel lacks pidfd_getfd: Linux >= 5.6 is needed)"
        : e == EBADF  ? " (that process no longer holds the descriptor)"
                      : "";
    throw std::runtime_error("jax_nvcomm: pidfd_getfd(" + who + ", fd " + std::to_string(fd) +
                             ") failed: " + std::strerror(e) + hint);
  }
  return got;
}

// ---- building blocks shared with the multicast transport ----

// Read/write access to [va, va + size) for `dev`.
static CUresult set_rw_access(CUdeviceptr va, size_t size, CUdevice dev) {
  CUmemAccessDesc d{};
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = dev;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return api().cuMemSetAccess(va, size, &d, 1);
}

uint64_t map_handle(CUmemGenericAllocationHandle h, size_t size, size_t align, CUdevice dev) {
  const Api& a = api();
  CUdeviceptr va = 0;
  check_cu(a.cuMemAddressReserve(&va, size, align, 0, 0), "cuMemAddressReserve");
  CUresult r = a.cuMemMap(va, size, 0, h, 0);
  if (r != CUDA_SUCCESS) {
    a.cuMemAddressFree(va, size);
    check_cu(r, "cuMemMap");
  }
  r = set_rw_access(va, size, dev);
  if (r != CUDA_SUCCESS) {
    a.cuMemUnmap(va, size);
    a.cuMemAddressFree(va, size);
    check_cu(r, "cuMemSetAccess");
  }
  return static_cast<uint64_t>(va);
}

void unmap_handle(uint64_t va, size_t size) {
  if (va == 0) return;
  api().cuMemUnmap(static_cast<CUdeviceptr>(va), size);
  api().cuMemAddressFree(static_cast<CUdeviceptr>(va), size);
}

void release_handle(CUmemGenericAllocationHandle h) {
  if (h != 0) api().cuMemRelease(h);
}

// Unmap *va (on `device`) and release *h; both zeroed (idempotent).
static void unmap_and_release(int device, uint64_t* va, size_t size, CUmemGenericAllocationHandle* h) {
  if (*va != 0 || *h != 0) cudaSetDevice(device);
  unmap_handle(*va, size);
  *va = 0;
  release_handle(*h);
  *h = 0;
}

int export_handle(CUmemGenericAllocationHandle h) {
  int fd = -1;
  check_cu(api().cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                              0),
           "cuMemExportToShareableHandle (POSIX file descriptor)");
  return fd;
}

CUmemGenericAllocationHandle import_handle(int pid, int fd) {
  int local = fd_from_process(pid, fd);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = api().cuMemImportFromShareableHandle(
      &h, reinterpret_cast<void*>(static_cast<uintptr_t>(local)),
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  close(local);  // the imported handle holds its own reference
  check_cu(r, "cuMemImportFromShareableHandle (POSIX file descriptor)");
  return h;
}

// ---- Allocation ----

Allocation::Allocation(int device, size_t bytes, size_t align, bool exportable)
    : device_(device), exportable_(exportable) {
  const Api& a = api();
  CUdevice dev = current_device(device);
  CUmemAllocationProp prop = alloc_prop(dev, exportable);
  size_t gran = 0;
  check_cu(a.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
           "cuMemGetAllocationGranularity");
  const size_t unit = align > 0 ? std::lcm(gran, align) : gran;
  size_ = round_up(bytes > 0 ? bytes : 1, unit);
  check_cu(a.cuMemCreate(&handle_, size_, &prop, 0), "cuMemCreate of the communication buffer");
  try {
    ptr_ = map_handle(handle_, size_, unit, dev);
  } catch (...) {
    release();
    throw;
  }
}

int Allocation::export_fd() {
  if (!exportable_)
    throw std::logic_error("jax_nvcomm: this VMM allocation was created without export");
  if (handle_ == 0) throw std::logic_error("jax_nvcomm: VMM allocation already released");
  if (fd_ < 0) fd_ = export_handle(handle_);
  return fd_;
}

void Allocation::grant_access(int device) {
  if (device == device_) return;
  if (ptr_ == 0) throw std::logic_error("jax_nvcomm: VMM allocation already released");
  const CUdevice peer = cu_device(device);
  current_device(device_);
  check_cu(set_rw_access(static_cast<CUdeviceptr>(ptr_), size_, peer),
           "cuMemSetAccess for a peer device");
}

void Allocation::release() {
  unmap_and_release(device_, &ptr_, size_, &handle_);
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

// ---- Mapping ----

Mapping::Mapping(int device, int pid, int fd, size_t size) : device_(device), size_(size) {
  CUdevice dev = current_device(device);
  const size_t gran = allocation_granularity(device, true);
  if (size_ == 0 || size_ % gran != 0)
    throw std::invalid_argument("jax_nvcomm: imported VMM size " + std::to_string(size) +
                                " is not a multiple of the allocation granularity");
  handle_ = import_handle(pid, fd);
  try {
    ptr_ = map_handle(handle_, size_, gran, dev);
  } catch (...) {
    release();
    throw;
  }
}

void Mapping::release() { unmap_and_release(device_, &ptr_, size_, &handle_); }

}  // namespace vmm
}  // namespace cuda
}  // namespace nvc
