// Host side of the cluster-split fused one-shot (kernels/allreduce_oneshot_cluster.cuh): when
// to use it, its grid, its launch. Internal to csrc/cuda (included by allreduce.cu only).
#pragma once
#include <atomic>
#include <cstdlib>

#include "../kernels/allreduce_oneshot_cluster.cuh"
#include "allreduce.h"
#include "allreduce_prepare.h"

namespace nvc {
namespace cuda {
namespace ar_detail {

using dev::ArTensors;
using dev::RowCfg;

// ---- Fused one-shot with rows split over clusters (allreduce_oneshot_cluster.cuh) ----------
// Used for fused (plain or FP8 output), unicast one-shot calls whose rows qualify
// (cluster_rows_ok) when every row gets a cluster of its own: clusters of 4 blocks while the
// rows fit (about 33 on an H200), then of 2 blocks (about 66). With two rows per cluster in
// turn the one-block epilogue was faster (measured, 2 x H200: 64 x 4096 9.1 us against 6.3).
// JAX_NVCOMM_AR_CLUSTER: 0 = off, 4 = clusters of 4 only, unset or anything else = clusters
// of 4, then of 2. Clusters of 2 are the default since 2026-12-01 on a one-GPU measurement
// (2 ranks sharing an H200, so half the SMs per rank, harness graph time): at 32 tokens, where
// clusters of 4 no longer fit there, 32 x 4096 6.5 -> 4.6 us and 32 x 7168 7.7 -> 5.2 against
// the one-block epilogue, no shape slower. Not yet timed on 2 GPUs. Every rank of a job must
// see the same setting only for speed: all variants run the same protocol on the same buffers
// and give the same bits.
inline int cluster_mode() {
  static const int mode = [] {
    const char* e = std::getenv("JAX_NVCOMM_AR_CLUSTER");
    return e == nullptr ? 2 : e[0] == '0' ? 0 : e[0] == '4' ? 4 : 2;
  }();
  return mode;
}

// Launch configuration of `clusters` clusters of kC blocks (kArThreads / kC threads each).
template <int kC>
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
template <typename T, bool kQuant, int kC, bool kWf32>
int max_active_clusters() {
  static std::atomic<int> cache[64];
  return once_per_device(cache, [](int dev) {
    int major = 0, n = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        major < 9 ||
        prepare_kernel<dev::oneshot_cluster_kernel<T, kQuant, kC, kWf32>>() != cudaSuccess)
      return 0;
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cluster_config<kC>(1, &attr);
    if (cudaOccupancyMaxActiveClusters(&n, dev::oneshot_cluster_kernel<T, kQuant, kC, kWf32>,
                                       &cfg) != cudaSuccess)
      return 0;
    return n;
  });
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

template <typename T, bool kQuant, int kC, bool kWf32>
bool try_launch_cluster(const CommView& v, const ArTensors& t, const RowCfg& rc, uint32_t desc,
                        int sm_count, cudaStream_t st, cudaError_t* err) {
  const int max_active = max_active_clusters<T, kQuant, kC, kWf32>();  // 0 below sm_90
  if (max_active < 1) return false;
  const size_t nv = size_t(t.tokens) * size_t(t.hidden) / dev::Vec<T>::kElems;
  const int ncl = cluster_count<kC>(t.tokens, nv, v.world, sm_count, max_active);
  if (ncl < 1) return false;
  cudaLaunchAttribute attr;
  cudaLaunchConfig_t cfg = cluster_config<kC>(unsigned(ncl), &attr);
  cfg.stream = st;
  *err = cudaLaunchKernelEx(&cfg, dev::oneshot_cluster_kernel<T, kQuant, kC, kWf32>, v, t, rc,
                            desc);
  if (*err == cudaSuccess) *err = cudaGetLastError();
  return true;
}

// Launches the cluster kernel and returns true, or returns false (nothing launched) when the
// call does not qualify: a one-shot call of 2+ ranks, unicast (mc, the multicast base, null:
// the kernel has no multicast variant), rows that cluster_rows_ok takes. rc: make_row_cfg of
// the call; kWf32: the weight's form (rmsnorm.cuh).
template <typename T, bool kQuant, bool kWf32>
bool launch_cluster(const CommView& v, const ArTensors& t, const RowCfg& rc, uint32_t desc,
                    Strategy s, const char* mc, int sm_count, cudaStream_t st, cudaError_t* err) {
  const int mode = cluster_mode();
  if (mode == 0 || s != Strategy::kOneShot || mc != nullptr || v.world < 2 ||
      !dev::cluster_rows_ok(rc, t.tokens))
    return false;
  if (try_launch_cluster<T, kQuant, dev::kClBlocksSmall, kWf32>(v, t, rc, desc, sm_count, st,
                                                                err))
    return true;
  return mode == 2 && try_launch_cluster<T, kQuant, dev::kClBlocksLarge, kWf32>(
                          v, t, rc, desc, sm_count, st, err);
}

template <typename T, bool kWf32>
void load_cluster_kernels() {  // loads and prepares them (0 clusters below sm_90)
  max_active_clusters<T, false, dev::kClBlocksSmall, kWf32>();
  max_active_clusters<T, true, dev::kClBlocksSmall, kWf32>();
  max_active_clusters<T, false, dev::kClBlocksLarge, kWf32>();
  max_active_clusters<T, true, dev::kClBlocksLarge, kWf32>();
}

}  // namespace ar_detail
}  // namespace cuda
}  // namespace nvc
