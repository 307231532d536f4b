// XLA:CPU FFI handlers of the split MoE calls (moe_dispatch_send / _recv, moe_combine_send /
// _recv) on the host backend: one custom call per half (protocol and call numbering:
// common/moe_layout.h). The SEND returns its call's sequence number (uint32 scalar array) for
// the RECV, which checks it; everything else a RECV needs travels as arrays too.
#include "../common/ffi_targets.h"
#include "../host/moe_host.h"
#include "moe_ffi_common.h"
#include "ffi_signatures.h"

namespace nvc {
namespace {

using sig::Seq;

ffi::Error DispatchSendHostImpl(ffi::Buffer<ffi::S32> slot, ffi::AnyBuffer x,
                                ffi::AnyBuffer x_scale, ffi::AnyBuffer ids,
                                ffi::Buffer<ffi::S32> num_tokens, OrderIn,
                                ffi::Result<ffi::AnyBuffer> token_dest, ffi::Result<Seq> seq,
                                OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  MoeConfig c;
  if (auto e = moe_config_of(*ctx, &c); e.failure()) return e;
  if (auto e = check_split_rounds(c, true); e.failure()) return e;
  if (auto e = check_dispatch_in(c, x, x_scale, ids); e.failure()) return e;
  if (auto e = expect_elems(*token_dest, size_t(c.max_tokens) * c.top_k, "token_dest"); e.failure())
    return e;
  const bool sc = c.scale_cols > 0;
  return from_text(*ctx, host::moe_dispatch_send_host(
      ctx->view, c, x.untyped_data(), sc ? static_cast<const float*>(x_scale.untyped_data()) : nullptr,
      static_cast<const int32_t*>(ids.untyped_data()), num_tokens.typed_data(),
      static_cast<int32_t*>(token_dest->untyped_data()), seq->typed_data()));
}

ffi::Error DispatchRecvHostImpl(ffi::Buffer<ffi::S32> slot, Seq seq, OrderIn,
                                ffi::Result<ffi::AnyBuffer> expert_x,
                                ffi::Result<ffi::AnyBuffer> counts,
                                ffi::Result<ffi::AnyBuffer> expert_x_scale,
                                ffi::Result<ffi::AnyBuffer> expert_src, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  MoeConfig c;
  if (auto e = moe_config_of(*ctx, &c); e.failure()) return e;
  if (auto e = check_split_rounds(c, true); e.failure()) return e;
  if (auto e = check_dispatch_out(c, *expert_x); e.failure()) return e;
  const bool sc = c.scale_cols > 0;
  return from_text(*ctx, host::moe_dispatch_recv_host(
      ctx->view, c, expert_x->untyped_data(), static_cast<int32_t*>(counts->untyped_data()),
      sc ? static_cast<float*>(expert_x_scale->untyped_data()) : nullptr,
      static_cast<int32_t*>(expert_src->untyped_data()), seq.typed_data()));
}

ffi::Error CombineSendHostImpl(ffi::Buffer<ffi::S32> slot, ffi::AnyBuffer expert_y,
                               ffi::AnyBuffer expert_src, ffi::AnyBuffer counts, OrderIn,
                               ffi::Result<Seq> seq, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  MoeConfig c;
  if (auto e = moe_config_of(*ctx, &c); e.failure()) return e;
  int yd = 0;
  if (auto e = check_combine_send(c, expert_y, expert_src, counts, &yd); e.failure()) return e;
  if (auto e = check_split_rounds(c, false, yd); e.failure()) return e;
  return from_text(*ctx, host::moe_combine_send_host(
      ctx->view, c, expert_y.untyped_data(), yd,
      static_cast<const int32_t*>(expert_src.untyped_data()),
      static_cast<const int32_t*>(counts.untyped_data()), seq->typed_data()));
}

ffi::Error CombineRecvHostImpl(ffi::Buffer<ffi::S32> slot, Seq seq, ffi::AnyBuffer w,
                               ffi::AnyBuffer token_dest, OrderIn, ffi::Result<ffi::AnyBuffer> y,
                               OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  MoeConfig c;
  if (auto e = moe_config_of(*ctx, &c); e.failure()) return e;
  int yd = 0;
  if (auto e = check_combine_recv(c, w, token_dest, *y, &yd); e.failure()) return e;
  if (auto e = check_split_rounds(c, false, yd); e.failure()) return e;
  return from_text(*ctx, host::moe_combine_recv_host(
      ctx->view, c, yd, static_cast<const float*>(w.untyped_data()),
      static_cast<const int32_t*>(token_dest.untyped_data()), y->untyped_data(),
      seq.typed_data()));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kMoeDispatchSendHost, DispatchSendHostImpl,
                       sig::moe_dispatch_send(sig::host_bind));
XLA_FFI_DEFINE_HANDLER(kMoeDispatchRecvHost, DispatchRecvHostImpl,
                       sig::moe_dispatch_recv(sig::host_bind));
XLA_FFI_DEFINE_HANDLER(kMoeCombineSendHost, CombineSendHostImpl,
                       sig::moe_combine_send(sig::host_bind));
XLA_FFI_DEFINE_HANDLER(kMoeCombineRecvHost, CombineRecvHostImpl,
                       sig::moe_combine_recv(sig::host_bind));
NVC_REGISTER_FFI("nvc_moe_dispatch_send", kMoeDispatchSendHost);
NVC_REGISTER_FFI("nvc_moe_dispatch_recv", kMoeDispatchRecvHost);
NVC_REGISTER_FFI("nvc_moe_combine_send", kMoeCombineSendHost);
NVC_REGISTER_FFI("nvc_moe_combine_recv", kMoeCombineRecvHost);

}  // namespace nvc
