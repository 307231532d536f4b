// XLA:CUDA FFI handlers of the split MoE calls (moe_dispatch_send / _recv, moe_combine_send /
// _recv): one custom call per half, so XLA can run other work between them (launch API in
// cuda/moe.h, protocol and call numbering in common/moe_layout.h). The SEND kernel writes its
// call's sequence number to a uint32 result that the RECV takes as operand; the counters live
// on the device, so the handlers keep no per-call state: command-buffer compatible.
#include <cuda_runtime.h>

#include "../common/ffi_targets.h"
#include "../cuda/moe.h"
#include "cuda_ffi_common.h"
#include "moe_ffi_common.h"
#include "ffi_signatures.h"

namespace nvc {
namespace {

using sig::Seq;

ffi::Error DispatchSendCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                ffi::AnyBuffer x_scale, ffi::AnyBuffer ids,
                                ffi::Buffer<ffi::S32> num_tokens, OrderIn,
                                ffi::Result<ffi::AnyBuffer> token_dest, ffi::Result<Seq> seq,
                                OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  MoeConfig c;
  if (auto e = moe_config_of(*ctx, &c); e.failure()) return e;
  if (auto e = check_split_rounds(c, true); e.failure()) return e;
  if (auto e = check_dispatch_in(c, x, x_scale, ids); e.failure()) return e;
  if (auto e = expect_elems(*token_dest, size_t(c.max_tokens) * c.top_k, "token_dest"); e.failure())
    return e;
  const bool sc = c.scale_cols > 0;
  return launch_result(
      cuda::moe_dispatch_send(ctx->view, c, x.untyped_data(),
                              sc ? static_cast<const float*>(x_scale.untyped_data()) : nullptr,
                              static_cast<const int32_t*>(ids.untyped_data()),
                              num_tokens.typed_data(),
                              static_cast<int32_t*>(token_dest->untyped_data()), stream,
                              seq->typed_data()),
      "moe_dispatch_send launch");
}

ffi::Error DispatchRecvCudaImpl(cudaStream_t stream, int32_t device, Seq seq, OrderIn,
                                ffi::Result<ffi::AnyBuffer> expert_x,
                                ffi::Result<ffi::AnyBuffer> counts,
                                ffi::Result<ffi::AnyBuffer> expert_x_scale,
                                ffi::Result<ffi::AnyBuffer> expert_src, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  MoeConfig c;
  if (auto e = moe_config_of(*ctx, &c); e.failure()) return e;
  if (auto e = check_split_rounds(c, true); e.failure()) return e;
  if (auto e = check_dispatch_out(c, *expert_x); e.failure()) return e;
  const bool sc = c.scale_cols > 0;
  return launch_result(
      cuda::moe_dispatch_recv(ctx->view, c, expert_x->untyped_data(),
                              static_cast<int32_t*>(counts->untyped_data()),
                              sc ? static_cast<float*>(expert_x_scale->untyped_data()) : nullptr,
                              static_cast<int32_t*>(expert_src->untyped_data()), stream,
                              seq.typed_data()),
      "moe_dispatch_recv launch");
}

ffi::Error CombineSendCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer expert_y,
                               ffi::AnyBuffer expert_src, ffi::AnyBuffer counts, OrderIn,
                               ffi::Result<Seq> seq, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  MoeConfig c;
  if (auto e = moe_config_of(*ctx, &c); e.failure()) return e;
  int yd = 0;
  if (auto e = check_combine_send(c, expert_y, expert_src, counts, &yd); e.failure()) return e;
  if (auto e = check_split_rounds(c, false, yd); e.failure()) return e;
  return launch_result(
      cuda::moe_combine_send(ctx->view, c, expert_y.untyped_data(), yd,
                             static_cast<const int32_t*>(expert_src.untyped_data()),
                             static_cast<const int32_t*>(counts.untyped_data()), stream,
                             seq->typed_data()),
      "moe_combine_send launch");
}

ffi::Error CombineRecvCudaImpl(cudaStream_t stream, int32_t device, Seq seq, ffi::AnyBuffer w,
                               ffi::AnyBuffer token_dest, OrderIn, ffi::Result<ffi::AnyBuffer> y,
                               OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  MoeConfig c;
  if (auto e = moe_config_of(*ctx, &c); e.failure()) return e;
  int yd = 0;
  if (auto e = check_combine_recv(c, w, token_dest, *y, &yd); e.failure()) return e;
  if (auto e = check_split_rounds(c, false, yd); e.failure()) return e;
  return launch_result(
      cuda::moe_combine_recv(ctx->view, c, yd, static_cast<const float*>(w.untyped_data()),
                             static_cast<const int32_t*>(token_dest.untyped_data()),
                             y->untyped_data(), stream, seq.typed_data()),
      "moe_combine_recv launch");
}

}  // namespace

NVC_CUDA_HANDLER(kMoeDispatchSendCuda, "nvc_cuda_moe_dispatch_send", DispatchSendCudaImpl,
                 sig::moe_dispatch_send(cuda_bind));
NVC_CUDA_HANDLER(kMoeDispatchRecvCuda, "nvc_cuda_moe_dispatch_recv", DispatchRecvCudaImpl,
                 sig::moe_dispatch_recv(cuda_bind));
NVC_CUDA_HANDLER(kMoeCombineSendCuda, "nvc_cuda_moe_combine_send", CombineSendCudaImpl,
                 sig::moe_combine_send(cuda_bind));
NVC_CUDA_HANDLER(kMoeCombineRecvCuda, "nvc_cuda_moe_combine_recv", CombineRecvCudaImpl,
                 sig::moe_combine_recv(cuda_bind));

}  // namespace nvc
