// Launch code of the all-reduce kernels, shared by the two translation units that instantiate
// them: allreduce.cu (every kernel with a weight of x's dtype, and the dispatch) and
// allreduce_wf32.cu (the fused kernels with a float32 weight, 16-bit x: rmsnorm.cuh kWf32).
// Each (T, fused, FP8 output, weight form) is its own kernel instantiation, chosen once per
// call; the float32-weight ones live in a unit of their own so that the two compile in
// parallel. Internal to csrc/cuda.
#pragma once
#include <atomic>
#include <cstdlib>

#include "../kernels/allreduce_local.cuh"
#include "../kernels/allreduce_multicast.cuh"
#include "../kernels/allreduce_oneshot.cuh"
#include "../kernels/allreduce_twoshot.cuh"
#include "allreduce.h"
#include "allreduce_cluster.h"
#include "allreduce_prepare.h"

namespace nvc {
namespace cuda {
namespace ar_detail {

using dev::ArTensors;
using dev::kArThreads;
using dev::RowCfg;

// The unicast kernels only: the multicast variants are prepared at their first launch, so on
// a machine where multicast is off (no multicast_base) they are never even loaded.
template <typename T, bool kFused, bool kQuant = false, bool kWf32 = false>
cudaError_t prepare_all() {
  for (cudaError_t e : {prepare_kernel<dev::local_kernel<T, kFused, kQuant, kWf32>>(),
                        prepare_kernel<dev::oneshot_kernel<T, kFused, kQuant, kWf32>>(),
                        prepare_kernel<dev::twoshot_kernel<T, kFused, kQuant, kWf32>>()})
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
inline bool local_rows_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("JAX_NVCOMM_AR_LOCAL_ROWS");
    return !(e != nullptr && e[0] == '0');
  }();
  return on;
}

// Resident blocks of local_rows_kernel per SM (occupancy API), once per device; 0 on failure.
template <typename T, bool kQuant, bool kWf32>
int local_rows_per_sm() {
  static std::atomic<int> cache[64];
  return once_per_device(cache, [](int) {
    int n = 0;
    if (prepare_kernel<dev::local_rows_kernel<T, kQuant, kWf32>>() != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &n, dev::local_rows_kernel<T, kQuant, kWf32>, dev::kLocThreads, 0) != cudaSuccess)
      return 0;
    return n;
  });
}

// World 1, fused: launches the row kernel when it takes the rows (one block per row, at most
// the resident blocks of sm_count SMs) and returns true; false, nothing launched, otherwise.
template <typename T, bool kQuant, bool kWf32>
bool launch_local_rows(const ArTensors& t, const RowCfg& rc, int sm_count, cudaStream_t st,
                       cudaError_t* err) {
  const int per_sm = dev::local_rows_ok(rc) ? local_rows_per_sm<T, kQuant, kWf32>() : 0;
  if (per_sm < 1) return false;
  const int64_t blocks = int64_t(per_sm) * sm_count;
  dev::local_rows_kernel<T, kQuant, kWf32>
      <<<int(t.tokens < blocks ? t.tokens : blocks), dev::kLocThreads, 0, st>>>(t, rc);
  *err = cudaGetLastError();
  return true;
}

// One call's kernel of the form (T, fused, FP8 output, weight form).
template <typename T, bool kFused, bool kQuant = false, bool kWf32 = false>
cudaError_t launch_one(const CommView& v, const ArTensors& t, const RowCfg& rc, uint32_t desc,
                       Strategy s, char* mc, int grid, cudaStream_t st, int sm_count) {
  const int smem = kFused ? int(dev::rmsnorm_smem_bytes(rc, dev::Vec<T>::kElems)) : 0;
  if (v.world == 1) {  // a group of one: no communication (allreduce_local.cuh)
    if constexpr (kFused) {
      cudaError_t e = cudaSuccess;
      if (local_rows_enabled() && launch_local_rows<T, kQuant, kWf32>(t, rc, sm_count, st, &e))
        return e;
    }
    return launch<dev::local_kernel<T, kFused, kQuant, kWf32>>(grid, smem, st, t, rc);
  }
  if constexpr (kFused) {  // small token counts: rows split over clusters (allreduce_cluster.h)
    cudaError_t e = cudaSuccess;
    if (launch_cluster<T, kQuant, kWf32>(v, t, rc, desc, s, mc, sm_count, st, &e)) return e;
  }
  if (s == Strategy::kOneShot)
    return mc == nullptr
               ? launch<dev::oneshot_kernel<T, kFused, kQuant, kWf32>>(grid, smem, st, v, t, rc,
                                                                       desc)
               : launch<dev::oneshot_mc_kernel<T, kFused, kQuant, kWf32>>(grid, smem, st, v, t,
                                                                          rc, desc, mc);
  return mc == nullptr
             ? launch<dev::twoshot_kernel<T, kFused, kQuant, kWf32>>(grid, smem, st, v, t, rc,
                                                                     desc)
             : launch<dev::twoshot_mc_kernel<T, kFused, kQuant, kWf32>>(grid, smem, st, v, t, rc,
                                                                        desc, mc);
}

// The fused call of weight form kWf32, plain or FP8 output (rc: make_row_cfg of the call).
template <typename T, bool kWf32>
cudaError_t launch_fused(bool quant, const CommView& v, const ArTensors& t, const RowCfg& rc,
                         uint32_t desc, Strategy s, char* mc, int grid, cudaStream_t st,
                         int sm_count) {
  return quant ? launch_one<T, true, true, kWf32>(v, t, rc, desc, s, mc, grid, st, sm_count)
               : launch_one<T, true, false, kWf32>(v, t, rc, desc, s, mc, grid, st, sm_count);
}

// World 1, fused, forced to the row kernel (rows) or the one-block epilogue
// (all_reduce_local_variant).
template <typename T, bool kWf32>
cudaError_t local_variant(bool quant, const ArTensors& t, int dtype, bool rows, cudaStream_t st,
                          int sm_count) {
  const RowCfg rc = dev::make_row_cfg(t.tokens, t.hidden, dev::Vec<T>::kElems);
  cudaError_t e = cudaSuccess;
  if (!rows) {
    const int grid =
        all_reduce_grid(t.tokens, t.hidden, dtype, 1, Strategy::kTwoShot, true, sm_count);
    const int smem = int(dev::rmsnorm_smem_bytes(rc, dev::Vec<T>::kElems));
    return quant ? launch<dev::local_kernel<T, true, true, kWf32>>(grid, smem, st, t, rc)
                 : launch<dev::local_kernel<T, true, false, kWf32>>(grid, smem, st, t, rc);
  }
  const bool took = quant ? launch_local_rows<T, true, kWf32>(t, rc, sm_count, st, &e)
                          : launch_local_rows<T, false, kWf32>(t, rc, sm_count, st, &e);
  return took ? e : cudaErrorInvalidValue;
}

// The fused kernels of one weight form, loaded and prepared (the world-1 row kernel's
// occupancy and the cluster kernels' cached too, so no first launch queries the runtime).
template <typename T, bool kWf32>
cudaError_t load_fused_kernels() {
  local_rows_per_sm<T, false, kWf32>();
  local_rows_per_sm<T, true, kWf32>();
  load_cluster_kernels<T, kWf32>();
  for (cudaError_t e : {prepare_all<T, true, false, kWf32>(), prepare_all<T, true, true, kWf32>()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

// The float32-weight forms (16-bit T: __nv_bfloat16, __half), defined and instantiated in
// allreduce_wf32.cu only: launch_fused, local_variant and load_fused_kernels with kWf32.
template <typename T>
cudaError_t launch_fused_wf32(bool quant, const CommView& v, const ArTensors& t, const RowCfg& rc,
                              uint32_t desc, Strategy s, char* mc, int grid, cudaStream_t st,
                              int sm_count);
template <typename T>
cudaError_t local_variant_wf32(bool quant, const ArTensors& t, int dtype, bool rows,
                               cudaStream_t st, int sm_count);
template <typename T>
cudaError_t load_fused_kernels_wf32();

}  // namespace ar_detail
}  // namespace cuda
}  // namespace nvc
