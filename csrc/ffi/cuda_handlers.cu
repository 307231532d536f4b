// XLA:CUDA FFI handlers: decode buffers and attributes, look up the rank context by device
// ordinal, launch on XLA's stream. No allocation, mapping or synchronisation here, and no
// per-call host state (the kernels advance their counters on the device), so every handler is
// registered command-buffer compatible (XLA may capture it into a CUDA graph and replay it) and
// once more without that trait ("_nograph", NVC_CUDA_HANDLER in cuda_ffi_common.h).
#include <cuda_runtime.h>

#include "../common/ffi_targets.h"
#include "../cuda/allgather.h"
#include "../cuda/allreduce.h"
#include "cuda_ffi_common.h"
#include "ffi_signatures.h"

namespace nvc {
namespace {

ffi::Error AllGatherCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, OrderIn,
                             ffi::Result<ffi::AnyBuffer> out, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  const size_t n = x.size_bytes();
  if (out->size_bytes() != n * size_t(ctx->view.world))
    return precondition("jax_nvcomm: all_gather output size does not match world * input");
  if (n * size_t(ctx->view.world) > ctx->view.max_message_bytes)
    return precondition("jax_nvcomm: all_gather of " + std::to_string(n) +
                        " bytes per rank exceeds max_message_bytes");
  return launch_result(
      cuda::all_gather(ctx->view, x.untyped_data(), out->untyped_data(), n, stream),
      "all_gather launch");
}

ffi::Error run_all_reduce(RankContext& ctx, cudaStream_t stream, const cuda::AllReduceArgs& a,
                          int64_t strategy) {
  if (strategy != 0 && strategy != 1)
    return precondition("jax_nvcomm: strategy attribute must be 0 (oneshot) or 1 (twoshot)");
  const auto s = static_cast<cuda::Strategy>(strategy);
  // ctx.multicast_base is nullptr (unicast) unless the communicator was set up with the opt-in
  // multicast transport (jax_nvcomm/_multicast.py decides, csrc/transport/cuda_multicast.h).
  // all_reduce validates the call itself; the reason text is looked up only when it refused.
  const cudaError_t e = cuda::all_reduce(ctx.view, a, s, ctx.multicast_base, stream);
  if (e == cudaErrorInvalidValue)
    if (const char* why = cuda::all_reduce_check(ctx.view, a, s))
      return precondition(std::string("jax_nvcomm: all_reduce: ") + why);
  return launch_result(e, "all_reduce launch");
}

ffi::Error AllReduceCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, OrderIn,
                             ffi::Result<ffi::AnyBuffer> out, OrderOut, int64_t comm_id,
                             int64_t strategy) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  auto dims = x.dimensions();
  if (dims.size() != 2) return precondition("jax_nvcomm: all_reduce expects [rows, cols]");
  cuda::AllReduceArgs a{x.untyped_data(), out->untyped_data(), nullptr, nullptr, nullptr,
                        dims[0], dims[1], dtype_code(x.element_type()), 0.0f};
  return run_all_reduce(*ctx, stream, a, strategy);
}

ffi::Error AllReduceRmsCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                ffi::AnyBuffer residual, ffi::AnyBuffer weight, OrderIn,
                                ffi::Result<ffi::AnyBuffer> normed,
                                ffi::Result<ffi::AnyBuffer> residual_out, OrderOut, int64_t comm_id,
                                float eps, int64_t norm_hidden, int64_t strategy) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  if (auto e = check_rms("all_reduce_rms_norm", x, residual, weight, norm_hidden); e.failure())
    return e;
  auto dims = x.dimensions();
  cuda::AllReduceArgs a{x.untyped_data(), normed->untyped_data(), residual.untyped_data(),
                        residual_out->untyped_data(), weight.untyped_data(),
                        dims[0], dims[1], dtype_code(x.element_type()), eps};
  a.weight_dtype = dtype_code(weight.element_type());
  a.norm_hidden = norm_hidden;
  return run_all_reduce(*ctx, stream, a, strategy);
}

// all_reduce_rms_norm_quant: the fused call with the FP8 epilogue (rmsnorm.cuh, fp8.h).
ffi::Error AllReduceRmsQuantCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                     ffi::AnyBuffer residual, ffi::AnyBuffer weight, OrderIn,
                                     ffi::Result<ffi::AnyBuffer> q,
                                     ffi::Result<ffi::Buffer<ffi::F32>> scale,
                                     ffi::Result<ffi::AnyBuffer> residual_out, OrderOut,
                                     int64_t comm_id, float eps, int64_t norm_hidden,
                                     int64_t strategy) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  if (auto e = check_quant(x, residual, weight, *q, *scale, norm_hidden); e.failure()) return e;
  auto dims = x.dimensions();
  cuda::AllReduceArgs a{x.untyped_data(), q->untyped_data(), residual.untyped_data(),
                        residual_out->untyped_data(), weight.untyped_data(),
                        dims[0], dims[1], dtype_code(x.element_type()), eps,
                        scale->typed_data()};
  a.weight_dtype = dtype_code(weight.element_type());
  a.norm_hidden = norm_hidden;
  return run_all_reduce(*ctx, stream, a, strategy);
}

}  // namespace

NVC_CUDA_HANDLER(kAllReduceCuda, "nvc_cuda_all_reduce", AllReduceCudaImpl,
                 sig::all_reduce(cuda_bind).Attr<int64_t>("strategy"));
NVC_CUDA_HANDLER(kAllReduceRmsCuda, "nvc_cuda_all_reduce_rms", AllReduceRmsCudaImpl,
                 sig::all_reduce_rms(cuda_bind).Attr<int64_t>("strategy"));
NVC_CUDA_HANDLER(kAllReduceRmsQuantCuda, "nvc_cuda_all_reduce_rms_quant", AllReduceRmsQuantCudaImpl,
                 sig::all_reduce_rms_quant(cuda_bind).Attr<int64_t>("strategy"));

NVC_CUDA_HANDLER(kAllGatherCuda, "nvc_cuda_all_gather", AllGatherCudaImpl,
                 sig::all_gather(cuda_bind));


}  // namespace nvc
