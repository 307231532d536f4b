// XLA:CUDA FFI handlers for MoE dispatch / combine (launch API in cuda/moe.h). Thin: decode,
// check shapes against the communicator's config, launch on XLA's stream. Command-buffer
// compatible: all per-call state lives on the device.
#include <cuda_runtime.h>

#include "../common/ffi_targets.h"
#include "../cuda/moe.h"
#include "cuda_ffi_common.h"
#include "moe_ffi_common.h"
#include "ffi_signatures.h"

namespace nvc {
namespace {

ffi::Error MoeDispatchCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                               ffi::AnyBuffer x_scale, ffi::AnyBuffer ids,
                               ffi::Buffer<ffi::S32> num_tokens, OrderIn,
                               ffi::Result<ffi::AnyBuffer> expert_x,
                               ffi::Result<ffi::AnyBuffer> counts,
                               ffi::Result<ffi::AnyBuffer> expert_x_scale,
                               ffi::Result<ffi::AnyBuffer> token_dest,
                               ffi::Result<ffi::AnyBuffer> expert_src, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  MoeConfig c;
  if (auto e = moe_config_of(*ctx, &c); e.failure()) return e;
  bool packed = false;  // expert_x [P, H] (rank 2): moe_layout.h PACKED EXPERT ROWS
  if (auto e = check_dispatch(c, x, x_scale, ids, *expert_x, &packed, &*expert_x_scale);
      e.failure())
    return e;
  const bool sc = c.scale_cols > 0;
  return launch_result(
      cuda::moe_dispatch(ctx->view, c, x.untyped_data(),
                         sc ? static_cast<const float*>(x_scale.untyped_data()) : nullptr,
                         static_cast<const int32_t*>(ids.untyped_data()), num_tokens.typed_data(),
                         expert_x->untyped_data(), static_cast<int32_t*>(counts->untyped_data()),
                         sc ? static_cast<float*>(expert_x_scale->untyped_data()) : nullptr,
                         static_cast<int32_t*>(token_dest->untyped_data()),
                         static_cast<int32_t*>(expert_src->untyped_data()), stream, packed),
      "moe_dispatch launch");
}

ffi::Error MoeCombineCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer expert_y,
                              ffi::AnyBuffer w, ffi::AnyBuffer token_dest,
                              ffi::AnyBuffer expert_src, ffi::AnyBuffer counts, OrderIn,
                              ffi::Result<ffi::AnyBuffer> y, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  MoeConfig c;
  if (auto e = moe_config_of(*ctx, &c); e.failure()) return e;
  int yd = 0;
  bool packed = false;  // expert_y [P, H] (rank 2): moe_layout.h PACKED EXPERT ROWS
  if (auto e = check_combine(c, expert_y, w, token_dest, expert_src, counts, &yd, &packed);
      e.failure())
    return e;
  return launch_result(
      cuda::moe_combine(ctx->view, c, expert_y.untyped_data(), yd,
                        static_cast<const float*>(w.untyped_data()),
                        static_cast<const int32_t*>(token_dest.untyped_data()),
                        static_cast<const int32_t*>(expert_src.untyped_data()),
                        static_cast<const int32_t*>(counts.untyped_data()), y->untyped_data(),
                        stream, packed),
      "moe_combine launch");
}

}  // namespace

NVC_CUDA_HANDLER(kMoeDispatchCuda, "nvc_cuda_moe_dispatch", MoeDispatchCudaImpl,
                 sig::moe_dispatch(cuda_bind));
NVC_CUDA_HANDLER(kMoeCombineCuda, "nvc_cuda_moe_combine", MoeCombineCudaImpl,
                 sig::moe_combine(cuda_bind));

}  // namespace nvc
