// XLA:CUDA FFI handlers of all_gather_v / reduce_scatter_v (protocol: kernels/varlen.cuh).
// Thin: decode, look up the rank by device ordinal, launch on XLA's stream. No per-call host
// state (counts and offsets are device operands the kernels read), so both are marked
// command-buffer compatible.
#include <cuda_runtime.h>

#include "../common/ffi_targets.h"
#include "../cuda/varlen.h"
#include "cuda_ffi_common.h"
#include "ffi_signatures.h"
#include "varlen_ffi_common.h"

namespace nvc {
namespace {

ffi::Error AllGatherVCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::S32> num_rows, OrderIn,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::Buffer<ffi::S32>> offsets,
                              ffi::Result<ffi::Buffer<ffi::S32>> total, OrderOut,
                              int64_t comm_id, int64_t zero_tail) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  VarlenRows r;
  if (auto e = check_gather_v(ctx->view.world, x, out->size_bytes(), offsets->element_count(), &r);
      e.failure())
    return e;
  if (const char* why = cuda::varlen_check(ctx->view, r.max_rows, r.row, -1))
    return precondition(std::string("jax_nvcomm: all_gather_v: ") + why);
  return launch_result(
      cuda::all_gather_v(ctx->view, x.untyped_data(), num_rows.typed_data(),
                         out->untyped_data(), offsets->typed_data(), total->typed_data(),
                         r.max_rows, r.row, zero_tail != 0, stream),
      "all_gather_v launch");
}

ffi::Error ReduceScatterVCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y,
                                  ffi::Buffer<ffi::S32> offsets, OrderIn,
                                  ffi::Result<ffi::AnyBuffer> out, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  VarlenRows r;
  int dt = 0;
  if (auto e = check_scatter_v(ctx->view.world, y, *out, offsets.element_count(), &r, &dt);
      e.failure())
    return e;
  if (const char* why = cuda::varlen_check(ctx->view, r.max_rows, r.row, dt))
    return precondition(std::string("jax_nvcomm: reduce_scatter_v: ") + why);
  return launch_result(cuda::reduce_scatter_v(ctx->view, y.untyped_data(), offsets.typed_data(),
                                              out->untyped_data(), r.max_rows, r.row, dt, stream),
                       "reduce_scatter_v launch");
}

}  // namespace

NVC_CUDA_HANDLER(kAllGatherVCuda, "nvc_cuda_all_gather_v", AllGatherVCudaImpl,
                 sig::all_gather_v(cuda_bind));
NVC_CUDA_HANDLER(kReduceScatterVCuda, "nvc_cuda_reduce_scatter_v", ReduceScatterVCudaImpl,
                 sig::reduce_scatter_v(cuda_bind));

}  // namespace nvc
