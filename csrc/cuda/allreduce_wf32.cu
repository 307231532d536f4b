// The fused all-reduce kernels with a float32 norm weight and 16-bit x (rmsnorm.cuh kWf32):
// their instantiations and launch entry points (allreduce_launch.h), a translation unit of
// their own so that it compiles in parallel with allreduce.cu, which holds everything else
// (validation, dispatch, the kernels with a weight of x's dtype).
#include "allreduce_launch.h"

namespace nvc {
namespace cuda {
namespace ar_detail {

template <typename T>
cudaError_t launch_fused_wf32(bool quant, const CommView& v, const ArTensors& t, const RowCfg& rc,
                              uint32_t desc, Strategy s, char* mc, int grid, cudaStream_t st,
                              int sm_count) {
  return launch_fused<T, true>(quant, v, t, rc, desc, s, mc, grid, st, sm_count);
}

template <typename T>
cudaError_t local_variant_wf32(bool quant, const ArTensors& t, int dtype, bool rows,
                               cudaStream_t st, int sm_count) {
  return local_variant<T, true>(quant, t, dtype, rows, st, sm_count);
}

template <typename T>
cudaError_t load_fused_kernels_wf32() {
  return load_fused_kernels<T, true>();
}

#define NVC_AR_WF32(T)                                                                      \
  template cudaError_t launch_fused_wf32<T>(bool, const CommView&, const ArTensors&,         \
                                            const RowCfg&, uint32_t, Strategy, char*, int,   \
                                            cudaStream_t, int);                              \
  template cudaError_t local_variant_wf32<T>(bool, const ArTensors&, int, bool, cudaStream_t, \
                                             int);                                           \
  template cudaError_t load_fused_kernels_wf32<T>();
NVC_AR_WF32(__nv_bfloat16)
NVC_AR_WF32(__half)
#undef NVC_AR_WF32

}  // namespace ar_detail
}  // namespace cuda
}  // namespace nvc
