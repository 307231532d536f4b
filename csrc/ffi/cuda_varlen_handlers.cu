// XLA:CUDA FFI handlers of all_gather_v / reduce_scatter_v (protocol: kernels/varlen.cuh).
// Thin: decode, look up the rank by device ordinal, launch on XLA's stream. No per-call host
// state (counts and offsets are device operands the kernels read), so both are marked
// command-buffer compatible.
#include <cuda_runtime.h>

#include "../common/ffi_targets.h"
#include "../cuda/varlen.h"
#include "cuda_ffi_common.h"

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
  auto dims = x.dimensions();
  if (dims.size() < 1 || dims[0] < 1)
    return precondition("jax_nvcomm: all_gather_v: x must be [max_rows >= 1, ...]");
  const int64_t max_rows = dims[0];
  const size_t row = x.size_bytes() / size_t(max_rows);
  const int W = ctx->view.world;
  if (out->size_bytes() != x.size_bytes() * size_t(W) || offsets->element_count() != size_t(W + 1))
    return precondition("jax_nvcomm: all_gather_v: output sizes do not match world * x");
  if (const char* why = cuda::varlen_check(ctx->view, max_rows, row, -1))
    return precondition(std::string("jax_nvcomm: all_gather_v: ") + why);
  return launch_result(
      cuda::all_gather_v(ctx->view, x.untyped_data(), num_rows.typed_data(),
                         out->untyped_data(), offsets->typed_data(), total->typed_data(),
                         max_rows, row, zero_tail != 0, stream),
      "all_gather_v launch");
}

ffi::Error ReduceScatterVCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer y,
                                  ffi::Buffer<ffi::S32> offsets, OrderIn,
                                  ffi::Result<ffi::AnyBuffer> out, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  auto dims = out->dimensions();
  const int W = ctx->view.world;
  if (dims.size() < 1 || dims[0] < 1)
    return precondition("jax_nvcomm: reduce_scatter_v: output must be [max_rows >= 1, ...]");
  const int64_t max_rows = dims[0];
  const size_t row = out->size_bytes() / size_t(max_rows);
  if (y.size_bytes() != out->size_bytes() * size_t(W) || offsets.element_count() != size_t(W + 1))
    return precondition("jax_nvcomm: reduce_scatter_v: y must be [world * max_rows, ...] and "
                        "offsets [world + 1]");
  const int dt = dtype_code(y.element_type());
  if (const char* why = cuda::varlen_check(ctx->view, max_rows, row, dt < 0 ? 99 : dt))
    return precondition(std::string("jax_nvcomm: reduce_scatter_v: ") + why);
  return launch_result(cuda::reduce_scatter_v(ctx->view, y.untyped_data(), offsets.typed_data(),
                                              out->untyped_data(), max_rows, row, dt, stream),
                       "reduce_scatter_v launch");
}

}  // namespace

NVC_CUDA_HANDLER(kAllGatherVCuda, "nvc_cuda_all_gather_v", AllGatherVCudaImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::AnyBuffer>()  // order_in: _order.py, never read
                           .Ret<ffi::AnyBuffer>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::AnyBuffer>()  // order_out: never written
                           .Attr<int64_t>("comm_id")
                           .Attr<int64_t>("zero_tail"));
NVC_CUDA_HANDLER(kReduceScatterVCuda, "nvc_cuda_reduce_scatter_v", ReduceScatterVCudaImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::AnyBuffer>()  // order_in: _order.py, never read
                           .Ret<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()  // order_out: never written
                           .Attr<int64_t>("comm_id"));

}  // namespace nvc
