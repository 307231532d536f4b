// XLA:CPU FFI handlers for the host backend: decode, look up the rank context (the traced
// program passes its slot = group * world + rank as an int32 operand), run the host protocol.
#include "../common/ffi_targets.h"
#include "../host/collectives_host.h"
#include "ffi_common.h"
#include "ffi_signatures.h"

namespace nvc {
namespace {

ffi::Error AllGatherHostImpl(ffi::Buffer<ffi::S32> slot, ffi::AnyBuffer x, OrderIn,
                             ffi::Result<ffi::AnyBuffer> out, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  if (out->size_bytes() != x.size_bytes() * size_t(ctx->view.world))
    return precondition("jax_nvcomm: all_gather output size does not match world * input");
  std::string err = host::all_gather(ctx->view, x.untyped_data(), out->untyped_data(),
                                     x.size_bytes());
  return from_text(*ctx, err);
}

ffi::Error AllReduceHostImpl(ffi::Buffer<ffi::S32> slot, ffi::AnyBuffer x, OrderIn,
                             ffi::Result<ffi::AnyBuffer> out, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  auto dims = x.dimensions();
  int64_t hidden = dims.size() == 0 ? 1 : dims.back();
  int64_t tokens = hidden == 0 ? 0 : int64_t(x.element_count()) / hidden;
  host::AllReduceArgs a{x.untyped_data(), out->untyped_data(), nullptr, nullptr, nullptr,
                        tokens, hidden, dtype_code(x.element_type()), 0.0f};
  std::string err = host::all_reduce(ctx->view, a);
  return from_text(*ctx, err);
}

ffi::Error AllReduceRmsHostImpl(ffi::Buffer<ffi::S32> slot, ffi::AnyBuffer x,
                                ffi::AnyBuffer residual, ffi::AnyBuffer weight, OrderIn,
                                ffi::Result<ffi::AnyBuffer> normed,
                                ffi::Result<ffi::AnyBuffer> residual_out, OrderOut, int64_t comm_id,
                                float eps, int64_t norm_hidden) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  if (auto e = check_rms("all_reduce_rms_norm", x, residual, weight, norm_hidden); e.failure())
    return e;
  auto dims = x.dimensions();
  host::AllReduceArgs a{x.untyped_data(), normed->untyped_data(), residual.untyped_data(),
                        residual_out->untyped_data(), weight.untyped_data(),
                        dims[0], dims[1], dtype_code(x.element_type()), eps};
  a.weight_dtype = dtype_code(weight.element_type());
  a.norm_hidden = norm_hidden;
  std::string err = host::all_reduce(ctx->view, a);
  return from_text(*ctx, err);
}

// all_reduce_rms_norm_quant: the fused protocol with the FP8 epilogue (fp8.h).
ffi::Error AllReduceRmsQuantHostImpl(ffi::Buffer<ffi::S32> slot, ffi::AnyBuffer x,
                                     ffi::AnyBuffer residual, ffi::AnyBuffer weight, OrderIn,
                                     ffi::Result<ffi::AnyBuffer> q,
                                     ffi::Result<ffi::Buffer<ffi::F32>> scale,
                                     ffi::Result<ffi::AnyBuffer> residual_out, OrderOut,
                                     int64_t comm_id, float eps, int64_t norm_hidden) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  if (auto e = check_quant(x, residual, weight, *q, *scale, norm_hidden); e.failure()) return e;
  auto dims = x.dimensions();
  host::AllReduceArgs a{x.untyped_data(), q->untyped_data(), residual.untyped_data(),
                        residual_out->untyped_data(), weight.untyped_data(),
                        dims[0], dims[1], dtype_code(x.element_type()), eps,
                        scale->typed_data()};
  a.weight_dtype = dtype_code(weight.element_type());
  a.norm_hidden = norm_hidden;
  return from_text(*ctx, host::all_reduce(ctx->view, a));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kAllGatherHost, AllGatherHostImpl,
                       sig::all_gather(sig::host_bind));
XLA_FFI_DEFINE_HANDLER(kAllReduceHost, AllReduceHostImpl,
                       sig::all_reduce(sig::host_bind));
XLA_FFI_DEFINE_HANDLER(kAllReduceRmsHost, AllReduceRmsHostImpl,
                       sig::all_reduce_rms(sig::host_bind));

XLA_FFI_DEFINE_HANDLER(kAllReduceRmsQuantHost, AllReduceRmsQuantHostImpl,
                       sig::all_reduce_rms_quant(sig::host_bind));

NVC_REGISTER_FFI("nvc_all_gather", kAllGatherHost);
NVC_REGISTER_FFI("nvc_all_reduce_rms_quant", kAllReduceRmsQuantHost);
NVC_REGISTER_FFI("nvc_all_reduce", kAllReduceHost);
NVC_REGISTER_FFI("nvc_all_reduce_rms", kAllReduceRmsHost);

}  // namespace nvc
