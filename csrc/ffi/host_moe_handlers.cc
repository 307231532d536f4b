// XLA:CPU FFI handlers for MoE dispatch / combine on the host backend (protocol in
// host/moe_host.h). The slot operand (group * world + rank) selects the rank context.
#include "../common/ffi_targets.h"
#include "../host/moe_host.h"
#include "moe_ffi_common.h"
#include "ffi_signatures.h"

namespace nvc {
namespace {

ffi::Error MoeDispatchHostImpl(ffi::Buffer<ffi::S32> slot, ffi::AnyBuffer x, ffi::AnyBuffer x_scale,
                               ffi::AnyBuffer ids, ffi::Buffer<ffi::S32> num_tokens, OrderIn,
                               ffi::Result<ffi::AnyBuffer> expert_x,
                               ffi::Result<ffi::AnyBuffer> counts,
                               ffi::Result<ffi::AnyBuffer> expert_x_scale,
                               ffi::Result<ffi::AnyBuffer> token_dest,
                               ffi::Result<ffi::AnyBuffer> expert_src, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  MoeConfig c;
  if (auto e = moe_config_of(*ctx, &c); e.failure()) return e;
  bool packed = false;  // expert_x [P, H] (rank 2): moe_layout.h PACKED EXPERT ROWS
  if (auto e = check_dispatch(c, x, x_scale, ids, *expert_x, &packed, &*expert_x_scale);
      e.failure())
    return e;
  const bool sc = c.scale_cols > 0;
  std::string err = host::moe_dispatch_host(
      ctx->view, c, x.untyped_data(), sc ? static_cast<const float*>(x_scale.untyped_data()) : nullptr,
      static_cast<const int32_t*>(ids.untyped_data()), num_tokens.typed_data(),
      expert_x->untyped_data(), static_cast<int32_t*>(counts->untyped_data()),
      sc ? static_cast<float*>(expert_x_scale->untyped_data()) : nullptr,
      static_cast<int32_t*>(token_dest->untyped_data()),
      static_cast<int32_t*>(expert_src->untyped_data()), packed);
  return from_text(*ctx, err);
}

ffi::Error MoeCombineHostImpl(ffi::Buffer<ffi::S32> slot, ffi::AnyBuffer expert_y, ffi::AnyBuffer w,
                              ffi::AnyBuffer token_dest, ffi::AnyBuffer expert_src,
                              ffi::AnyBuffer counts, OrderIn, ffi::Result<ffi::AnyBuffer> y,
                              OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  MoeConfig c;
  if (auto e = moe_config_of(*ctx, &c); e.failure()) return e;
  int yd = 0;
  bool packed = false;  // expert_y [P, H] (rank 2): moe_layout.h PACKED EXPERT ROWS
  if (auto e = check_combine(c, expert_y, w, token_dest, expert_src, counts, &yd, &packed);
      e.failure())
    return e;
  std::string err = host::moe_combine_host(
      ctx->view, c, expert_y.untyped_data(), yd, static_cast<const float*>(w.untyped_data()),
      static_cast<const int32_t*>(token_dest.untyped_data()),
      static_cast<const int32_t*>(expert_src.untyped_data()),
      static_cast<const int32_t*>(counts.untyped_data()), y->untyped_data(), packed);
  return from_text(*ctx, err);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kMoeDispatchHost, MoeDispatchHostImpl,
                       sig::moe_dispatch(sig::host_bind));
XLA_FFI_DEFINE_HANDLER(kMoeCombineHost, MoeCombineHostImpl,
                       sig::moe_combine(sig::host_bind));
NVC_REGISTER_FFI("nvc_moe_dispatch", kMoeDispatchHost);
NVC_REGISTER_FFI("nvc_moe_combine", kMoeCombineHost);

}  // namespace nvc
