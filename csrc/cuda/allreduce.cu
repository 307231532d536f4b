// Host side of the all-reduce kernels: validation, launch configuration, dispatch.
// Protocols: csrc/kernels/allreduce_oneshot.cuh, allreduce_twoshot.cuh, allreduce_multicast.cuh.
#include "allreduce.h"

#include <atomic>
#include <cstdlib>

#include "../kernels/allreduce_local.cuh"
#include "../kernels/allreduce_multicast.cuh"
#include "../kernels/allreduce_oneshot.cuh"
#include "../kernels/allreduce_oneshot_cluster.cuh"
#include "../kernels/allreduce_twoshot.cuh"

namespace nvc {
namespace cuda {
namespace {

using dev::ArTensors;
using dev::kArThreads;
using dev::RowCfg;

static_assert(kMaxArBlocks <= kMaxBlocks, "flag arrays are sized for kMaxBlocks blocks");
static_assert(kMaxArBlocks <= dev::kEpiMaxBlocks, "row configuration assumes at most this grid");

// Fused rows keep float32 r in dynamic shared memory: hidden * 4 bytes for one row.
constexpr int64_t kMaxFusedHidden = 32768;
constexpr int kMaxDynSmem = int(kMaxFusedHidden * 4);

// 16-byte vectors per thread (x W stores for one-shot's push) that size the grids: the push is
// bound by each SM's store rate, so one-shot spreads small messages over one block per
// kArThreads stores (2 x H200: 16-64 KiB one-shot 5.0-5.7 -> 4.2-4.4 us with 1 instead of 4
// vectors per thread); two-shot measured best at 4 (1, 2 and 4 tried). -DNVC_AR_ONESHOT_VECS /
// -DNVC_AR_TWOSHOT_VECS override them for experiments (tests/cuda_harness builds).
#ifndef NVC_AR_ONESHOT_VECS
#define NVC_AR_ONESHOT_VECS 1
#endif
#ifndef NVC_AR_TWOSHOT_VECS
#define NVC_AR_TWOSHOT_VECS 4
#endif
constexpr int64_t kOneShotVecs = NVC_AR_ONESHOT_VECS;
constexpr int64_t kTwoShotVecs = NVC_AR_TWOSHOT_VECS;

// World size 1: blocks per SM of the local kernel's grid (several hide the epilogue's barrier).
constexpr int64_t kLocalBlocksPerSm = 4;

int elems_per_vec(int dtype) { return dtype == kF32 ? 4 : 8; }

int current_sm_count() {
  static std::atomic<int> cache[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (dev >= 0 && dev < 64) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int n = 1;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n < 1) n = 1;
  if (dev >= 0 && dev < 64) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

// Load a kernel and set its attributes, once per (kernel, device): the dynamic shared memory
// limit (fused rows need up to 128 KiB) and the same carveout as every other kernel of the
// package (an SM changes its L1/shared split only when idle, so a kernel that wants another
// split may never be scheduled next to spinning blocks). Loading early also keeps lazy module
// loading out of the first launch. Attributes only, no stream work: fine inside graph capture.
template <auto kKernel>
cudaError_t prepare_kernel() {
  static std::atomic<uint64_t> done{0};
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if ((done.load(std::memory_order_relaxed) & bit) != 0) return cudaSuccess;
  const void* f = reinterpret_cast<const void*>(kKernel);
  cudaFuncAttributes a;
  if (cudaError_t e = cudaFuncGetAttributes(&a, f); e != cudaSuccess) return e;
  if (cudaError_t e = cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           kMaxDynSmem);
      e != cudaSuccess)
    return e;
  if (cudaError_t e = cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           int(cudaSharedmemCarveoutMaxShared));
      e != cudaSuccess)
    return e;
  done.fetch_or(bit, std::memory_order_relaxed);
  return cudaSuccess;
}

// The unicast kernels only: the multicast variants are prepared at their first launch, so on
// a machine where multicast is off (no multicast_base) they are never even loaded.
template <typename T, bool kFused, bool kQuant = false>
cudaError_t prepare_all() {
  for (cudaError_t e : {prepare_kernel<dev::local_kernel<T, kFused, kQuant>>(),
                        prepare_kernel<dev::oneshot_kernel<T, kFused, kQuant>>(),
                        prepare_kernel<dev::twoshot_kernel<T, kFused, kQuant>>()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

// Prepare (once per device) and launch one kernel.
template <auto kKernel, typename... Args>
cudaError_t launch(int grid, int smem, cudaStream_t st, const Args&... args) {
  if (cudaError_t e = prepare_kernel<kKernel>(); e != cudaSuccess) return e;
  kKernel<<<grid, kArThreads, smem, st>>>(args...);
  return cudaGetLastError();
}

// World 1, fused, rows of tpr == kArThreads up to kLocVecsPerThread vectors per thread: one
// row per block of kLocThreads, held in registers (allreduce_local.cuh local_rows_kernel; same
// bits as local_kernel). JAX_NVCOMM_AR_LOCAL_ROWS=0 keeps local_kernel (A/B measurements).
bool local_rows_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("JAX_NVCOMM_AR_LOCAL_ROWS");
    return !(e != nullptr && e[0] == '0');
  }();
  return on;
}

// Resident blocks of local_rows_kernel per SM (occupancy API), once per device; 0 on failure.
template <typename T, bool kQuant>
int local_rows_per_sm() {
  static std::atomic<int> cache[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  const int c = cache[dev].load(std::memory_order_relaxed);
  if (c != 0) return c < 0 ? 0 : c;
  int n = 0;
  if (prepare_kernel<dev::local_rows_kernel<T, kQuant>>() != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, dev::local_rows_kernel<T, kQuant>,
                                                    dev::kLocThreads, 0) != cudaSuccess)
    n = 0;
  cudaGetLastError();
  cache[dev].store(n > 0 ? n : -1, std::memory_order_relaxed);
  return n;
}

template <typename T, bool kFused, bool kQuant = false>
cudaError_t launch_one(const CommView& v, const ArTensors& t, const RowCfg& rc, uint32_t desc,
                       Strategy s, char* mc, int grid, cudaStream_t st, int sm_count) {
  const int smem = kFused ? int(dev::rmsnorm_smem_bytes(rc, dev::Vec<T>::kElems)) : 0;
  if (v.world == 1) {  // a group of one: no communication (allreduce_local.cuh)
    if constexpr (kFused) {
      const int per_sm = local_rows_enabled() && dev::local_rows_ok(rc)
                             ? local_rows_per_sm<T, kQuant>() : 0;
      if (per_sm > 0) {
        const int64_t blocks = int64_t(per_sm) * sm_count;
        const int g = int(t.tokens < blocks ? t.tokens : blocks);
        dev::local_rows_kernel<T, kQuant><<<g, dev::kLocThreads, 0, st>>>(t, rc);
        return cudaGetLastError();
      }
    }
    return launch<dev::local_kernel<T, kFused, kQuant>>(grid, smem, st, t, rc);
  }
  if (s == Strategy::kOneShot)
    return mc == nullptr
               ? launch<dev::oneshot_kernel<T, kFused, kQuant>>(grid, smem, st, v, t, rc, desc)
               : launch<dev::oneshot_mc_kernel<T, kFused, kQuant>>(grid, smem, st, v, t, rc,
                                                                   desc, mc);
  return mc == nullptr
             ? launch<dev::twoshot_kernel<T, kFused, kQuant>>(grid, smem, st, v, t, rc, desc)
             : launch<dev::twoshot_mc_kernel<T, kFused, kQuant>>(grid, smem, st, v, t, rc, desc,
                                                                 mc);
}

template <typename T>
cudaError_t launch_typed(const CommView& v, const ArTensors& t, bool fused, uint32_t desc, Strategy s,
                  char* mc, int grid, cudaStream_t st, int sm_count) {
  const RowCfg rc = dev::make_row_cfg(t.tokens, t.hidden, dev::Vec<T>::kElems);
  if (fused && t.scale != nullptr)
    return launch_one<T, true, true>(v, t, rc, desc, s, mc, grid, st, sm_count);
  return fused ? launch_one<T, true>(v, t, rc, desc, s, mc, grid, st, sm_count)
               : launch_one<T, false>(v, t, rc, desc, s, mc, grid, st, sm_count);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- Fused one-shot with rows split over clusters (allreduce_oneshot_cluster.cuh) ----------
// Used for fused (plain or FP8 output), unicast one-shot calls whose rows qualify
// (cluster_rows_ok) when every row gets a cluster of its own: clusters of 4 blocks while the
// rows fit (about 33 on an H200), and with JAX_NVCOMM_AR_CLUSTER=2 also of 2 blocks (about 66)
// beyond that. With two rows per cluster in turn the one-block epilogue was faster (measured,
// 2 x H200: 64 x 4096 9.1 us against 6.3). JAX_NVCOMM_AR_CLUSTER: 0 = off, 2 = clusters of 4,
// then of 2, unset or anything else = clusters of 4 only (the measured default: clusters of 2
// are checked bitwise but not yet timed on 2 GPUs). Every rank of a job must see the same
// setting only for speed: all variants run the same protocol on the same buffers and give the
// same bits.
int cluster_mode() {
  static const int mode = [] {
    const char* e = std::getenv("JAX_NVCOMM_AR_CLUSTER");
    return e == nullptr ? 4 : e[0] == '0' ? 0 : e[0] == '2' ? 2 : 4;
  }();
  return mode;
}

template <typename T, bool kQuant, int kC>
cudaLaunchConfig_t cluster_config(unsigned clusters, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(clusters * kC);
  cfg.blockDim = dim3(dev::kArThreads / kC);
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = kC;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// Clusters of the kernel that fit the device at once (occupancy API), once per device; 0 when
// the query fails or the device has no clusters (then the cluster kernel is not used).
template <typename T, bool kQuant, int kC>
int max_active_clusters() {
  static std::atomic<int> cache[64];
  int dev = 0, major = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return 0;
  const int c = cache[dev].load(std::memory_order_relaxed);
  if (c != 0) return c < 0 ? 0 : c;
  int n = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
      major >= 9 && prepare_kernel<dev::oneshot_cluster_kernel<T, kQuant, kC>>() == cudaSuccess) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_config<T, kQuant, kC>(1, &attr);
    if (cudaOccupancyMaxActiveClusters(&n, dev::oneshot_cluster_kernel<T, kQuant, kC>, &cfg) !=
        cudaSuccess)
      n = 0;
  }
  cudaGetLastError();
  cache[dev].store(n > 0 ? n : -1, std::memory_order_relaxed);
  return n;
}

// Clusters of kC blocks for a call: one per row, and enough threads for the push (one 16-byte
// vector x W stores per thread, as all_reduce_grid); at most what is co-resident within the SM
// budget. 0 (not used) when the rows outnumber that.
template <int kC>
int cluster_count(int64_t tokens, size_t nv, int world, int sm_count, int max_active) {
  const int64_t push = (int64_t(nv) * world + dev::kArThreads - 1) / dev::kArThreads;
  int64_t cap = sm_count / kC;
  if (cap > max_active) cap = max_active;
  if (cap > kMaxArBlocks) cap = kMaxArBlocks;  // clusters (no per-block flags in one-shot)
  if (tokens > cap) return 0;
  const int64_t n = tokens > push ? tokens : push;
  return int(n > cap ? cap : n);
}

template <typename T, bool kQuant, int kC>
bool try_launch_cluster(const CommView& v, const ArTensors& t, const RowCfg& rc, uint32_t desc,
                        int sm_count, cudaStream_t st, cudaError_t* err) {
  const int max_active = max_active_clusters<T, kQuant, kC>();  // 0 below sm_90
  if (max_active < 1) return false;
  const size_t nv = size_t(t.tokens) * size_t(t.hidden) / dev::Vec<T>::kElems;
  const int ncl = cluster_count<kC>(t.tokens, nv, v.world, sm_count, max_active);
  if (ncl < 1) return false;
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg = cluster_config<T, kQuant, kC>(unsigned(ncl), &attr);
  cfg.stream = st;
  *err = cudaLaunchKernelEx(&cfg, dev::oneshot_cluster_kernel<T, kQuant, kC>, v, t, rc, desc);
  if (*err == cudaSuccess) *err = cudaGetLastError();
  return true;
}

// Launches the cluster kernel and returns true, or returns false (nothing launched) when the
// call does not qualify.
template <typename T, bool kQuant>
bool launch_cluster(const CommView& v, const ArTensors& t, uint32_t desc, int sm_count,
                    cudaStream_t st, cudaError_t* err) {
  const int mode = cluster_mode();
  if (mode == 0 || v.world < 2) return false;
  const RowCfg rc = dev::make_row_cfg(t.tokens, t.hidden, dev::Vec<T>::kElems);
  if (!dev::cluster_rows_ok(rc, t.tokens)) return false;
  if (try_launch_cluster<T, kQuant, dev::kClBlocksSmall>(v, t, rc, desc, sm_count, st, err))
    return true;
  return mode == 2 &&
         try_launch_cluster<T, kQuant, dev::kClBlocksLarge>(v, t, rc, desc, sm_count, st, err);
}

template <typename T>
bool launch_cluster(const CommView& v, const ArTensors& t, uint32_t desc, int sm_count,
                    cudaStream_t st, cudaError_t* err) {
  return t.scale != nullptr ? launch_cluster<T, true>(v, t, desc, sm_count, st, err)
                            : launch_cluster<T, false>(v, t, desc, sm_count, st, err);
}

template <typename T>
void load_cluster_kernels() {  // loads and prepares them (0 clusters below sm_90)
  max_active_clusters<T, false, dev::kClBlocksSmall>();
  max_active_clusters<T, true, dev::kClBlocksSmall>();
  max_active_clusters<T, false, dev::kClBlocksLarge>();
  max_active_clusters<T, true, dev::kClBlocksLarge>();
}

}  // namespace

size_t dtype_bytes(int dtype) { return dtype == kF32 ? 4 : 2; }
size_t oneshot_max_bytes(const CommView& v) { return v.lamport_slot; }
size_t twoshot_max_bytes(const CommView& v) { return v.max_message_bytes; }
int64_t max_fused_hidden(int) { return kMaxFusedHidden; }

int all_reduce_grid(int64_t tokens, int64_t hidden, int dtype, int world, Strategy s, bool fused,
                    int sm_count) {
  const int64_t nv = tokens * hidden / elems_per_vec(dtype);
  // Blocks by data volume (kOneShotVecs / kTwoShotVecs above), and for the fused epilogue at
  // least one block per iteration's worth of rows.
  const int64_t per_block =
      int64_t(kArThreads) * (s == Strategy::kOneShot ? kOneShotVecs : kTwoShotVecs);
  int64_t g = (nv * (world > 1 && s == Strategy::kOneShot ? world : 1) + per_block - 1) / per_block;
  if (fused) {
    const RowCfg rc = dev::make_row_cfg(tokens, hidden, elems_per_vec(dtype));
    const int64_t rows_per_iter = int64_t(kArThreads / rc.tpr) * rc.nr;
    const int64_t gr = (tokens + rows_per_iter - 1) / rows_per_iter;
    g = world == 1 ? gr : (gr > g ? gr : g);
  }
  const int64_t sms = sm_count < 1 ? 1 : sm_count;
  // World 1 never waits on other blocks, so its grid may exceed the SM count; the protocol
  // kernels spin-wait, so all their blocks must be resident.
  const int64_t cap = world == 1 ? sms * kLocalBlocksPerSm : (sms < kMaxArBlocks ? sms : kMaxArBlocks);
  return int(g < 1 ? 1 : (g > cap ? cap : g));
}

const char* all_reduce_check(const CommView& v, const AllReduceArgs& a, Strategy s) {
  if (v.world < 1 || v.world > kMaxWorld) return "world size out of range [1, 16]";
  if (v.rank < 0 || v.rank >= v.world) return "rank out of range";
  if (v.err == nullptr) return "CommView.err is null";
  if (a.dtype != kF32 && a.dtype != kBF16 && a.dtype != kF16) return "dtype must be f32, bf16 or f16";
  if (s != Strategy::kOneShot && s != Strategy::kTwoShot) return "unknown strategy";
  if (a.tokens < 0) return "tokens must be >= 0";
  if (a.hidden <= 0) return "hidden must be > 0";
  if (a.hidden % elems_per_vec(a.dtype) != 0)
    return "hidden must be a multiple of the 16-byte vector width (4 for f32, 8 for bf16/f16)";
  if (a.tokens > 0 && (a.x == nullptr || a.out == nullptr)) return "x and out must be non-null";
  if (!aligned16(a.x) || !aligned16(a.out)) return "x and out must be 16-byte aligned";
  const bool fused = a.residual != nullptr;
  if (fused) {
    if (a.residual_out == nullptr || a.weight == nullptr)
      return "fused call needs residual_out and weight";
    if (!aligned16(a.residual) || !aligned16(a.residual_out) || !aligned16(a.weight))
      return "residual, residual_out and weight must be 16-byte aligned";
    if (a.hidden > max_fused_hidden(a.dtype)) return "hidden too large for the fused kernel";
  } else if (a.scale != nullptr) {
    return "scale (FP8 output) needs a fused call (residual, residual_out, weight)";
  }
  if (a.tokens > (int64_t(1) << 40) / a.hidden) return "message too large";
  const size_t bytes = size_t(a.tokens) * size_t(a.hidden) * dtype_bytes(a.dtype);
  if (s == Strategy::kOneShot && bytes > oneshot_max_bytes(v))
    return "message larger than the one-shot Lamport slot";
  if (s == Strategy::kTwoShot && bytes > twoshot_max_bytes(v))
    return "message larger than max_message_bytes";
  return nullptr;
}

cudaError_t all_reduce(const CommView& v, const AllReduceArgs& a, Strategy s,
                       const void* multicast_base, cudaStream_t stream, int sm_count) {
  if (all_reduce_check(v, a, s) != nullptr) return cudaErrorInvalidValue;
  if (a.tokens == 0) return cudaSuccess;  // every rank skips alike: no counter moves
  const bool fused = a.residual != nullptr;
  const int grid = all_reduce_grid(a.tokens, a.hidden, a.dtype, v.world, s, fused, sm_count);
  ArTensors t{a.x,      a.out,    a.residual, a.residual_out, a.weight,
              a.tokens, a.hidden, a.eps,      a.scale};
  // Bit 3 tells the quantised epilogue apart, so ranks disagreeing on it are reported.
  const uint32_t desc = make_desc(fused ? kOpAllReduceRms : kOpAllReduce, uint64_t(a.tokens),
                                  (uint64_t(a.hidden) << 4) | (uint64_t(a.scale != nullptr) << 3) |
                                      (uint64_t(a.dtype) << 1) | uint64_t(s == Strategy::kTwoShot));
  char* mc = const_cast<char*>(static_cast<const char*>(multicast_base));
  if (fused && s == Strategy::kOneShot && mc == nullptr) {
    cudaError_t e = cudaSuccess;
    const bool done = a.dtype == kF32    ? launch_cluster<float>(v, t, desc, sm_count, stream, &e)
                      : a.dtype == kBF16 ? launch_cluster<__nv_bfloat16>(v, t, desc, sm_count, stream, &e)
                                         : launch_cluster<__half>(v, t, desc, sm_count, stream, &e);
    if (done) return e;
  }
  switch (a.dtype) {
    case kF32: return launch_typed<float>(v, t, fused, desc, s, mc, grid, stream, sm_count);
    case kBF16: return launch_typed<__nv_bfloat16>(v, t, fused, desc, s, mc, grid, stream, sm_count);
    default: return launch_typed<__half>(v, t, fused, desc, s, mc, grid, stream, sm_count);
  }
}

namespace {
template <typename T, bool kQuant>
cudaError_t local_variant(const ArTensors& t, bool rows, cudaStream_t st, int sm_count) {
  const RowCfg rc = dev::make_row_cfg(t.tokens, t.hidden, dev::Vec<T>::kElems);
  if (!rows) {
    const int grid = all_reduce_grid(t.tokens, t.hidden, dev::Vec<T>::kElems == 4 ? kF32 : kBF16, 1,
                                     Strategy::kTwoShot, true, sm_count);
    return launch<dev::local_kernel<T, true, kQuant>>(
        grid, int(dev::rmsnorm_smem_bytes(rc, dev::Vec<T>::kElems)), st, t, rc);
  }
  const int per_sm = dev::local_rows_ok(rc) ? local_rows_per_sm<T, kQuant>() : 0;
  if (per_sm < 1) return cudaErrorInvalidValue;
  const int64_t blocks = int64_t(per_sm) * sm_count;
  dev::local_rows_kernel<T, kQuant>
      <<<int(t.tokens < blocks ? t.tokens : blocks), dev::kLocThreads, 0, st>>>(t, rc);
  return cudaGetLastError();
}
}  // namespace

cudaError_t all_reduce_local_variant(const AllReduceArgs& a, bool rows, cudaStream_t stream,
                                     int sm_count) {
  if (a.residual == nullptr || a.tokens < 1) return cudaErrorInvalidValue;
  const ArTensors t{a.x,      a.out,    a.residual, a.residual_out, a.weight,
                    a.tokens, a.hidden, a.eps,      a.scale};
  const bool q = a.scale != nullptr;
  switch (a.dtype) {
    case kF32: return q ? local_variant<float, true>(t, rows, stream, sm_count)
                        : local_variant<float, false>(t, rows, stream, sm_count);
    case kBF16: return q ? local_variant<__nv_bfloat16, true>(t, rows, stream, sm_count)
                         : local_variant<__nv_bfloat16, false>(t, rows, stream, sm_count);
    default: return q ? local_variant<__half, true>(t, rows, stream, sm_count)
                      : local_variant<__half, false>(t, rows, stream, sm_count);
  }
}

cudaError_t all_reduce_load_kernels() {
  local_rows_per_sm<float, false>();  // loads and prepares the world-1 row kernels
  local_rows_per_sm<float, true>();
  local_rows_per_sm<__nv_bfloat16, false>();
  local_rows_per_sm<__nv_bfloat16, true>();
  local_rows_per_sm<__half, false>();
  local_rows_per_sm<__half, true>();
  load_cluster_kernels<float>();
  load_cluster_kernels<__nv_bfloat16>();
  load_cluster_kernels<__half>();
  for (cudaError_t e : {prepare_all<float, false>(), prepare_all<float, true>(),
                        prepare_all<float, true, true>(), prepare_all<__nv_bfloat16, false>(),
                        prepare_all<__nv_bfloat16, true>(), prepare_all<__nv_bfloat16, true, true>(),
                        prepare_all<__half, false>(), prepare_all<__half, true>(),
                        prepare_all<__half, true, true>()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

#ifdef NVC_PROBE
cudaError_t probe_take(unsigned long long* out) {
  if (cudaError_t e = cudaMemcpyFromSymbol(out, dev::g_probe, sizeof(dev::g_probe)); e != cudaSuccess)
    return e;
  static const unsigned long long zero[dev::kProbeN] = {};
  return cudaMemcpyToSymbol(dev::g_probe, zero, sizeof(zero));
}
#endif

cudaError_t all_reduce(const CommView& v, const AllReduceArgs& a, Strategy s,
                       const void* multicast_base, cudaStream_t stream) {
  return all_reduce(v, a, s, multicast_base, stream, current_sm_count());
}

}  // namespace cuda
}  // namespace nvc
