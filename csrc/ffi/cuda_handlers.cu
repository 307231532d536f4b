// XLA:CUDA FFI handlers: decode buffers and attributes, look up the rank context by device
// ordinal, launch on XLA's stream. No allocation, mapping or synchronisation here, and no
// per-call host state (the kernels advance their counters on the device), so every handler is
// marked command-buffer compatible: XLA may capture it into a CUDA graph and replay it.
#include <cuda_runtime.h>

#include "../common/ffi_targets.h"
#include "../cuda/allgather.h"
#include "ffi_common.h"

namespace nvc {
namespace {

ffi::Error launch_error(cudaError_t e, const char* what) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_nvcomm: ") + what + ": " + cudaGetErrorString(e));
}

ffi::Error AllGatherCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                             ffi::Result<ffi::AnyBuffer> out, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  const size_t n = x.size_bytes();
  if (out->size_bytes() != n * size_t(ctx->view.world))
    return precondition("jax_nvcomm: all_gather output size does not match world * input");
  if (n * size_t(ctx->view.world) > ctx->view.max_message_bytes)
    return precondition("jax_nvcomm: all_gather of " + std::to_string(n) +
                        " bytes per rank exceeds max_message_bytes");
  cudaError_t e = cuda::all_gather(ctx->view, x.untyped_data(), out->untyped_data(), n, stream);
  return e == cudaSuccess ? ffi::Error::Success() : launch_error(e, "all_gather launch");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kAllGatherCuda, AllGatherCudaImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Attr<int64_t>("comm_id"),
                       {ffi::Traits::kCmdBufferCompatible});

NVC_REGISTER_FFI("nvc_cuda_all_gather", kAllGatherCuda);

}  // namespace nvc
