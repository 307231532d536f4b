// XLA:CPU FFI handlers of all_gather_v / reduce_scatter_v for the host backend (protocol:
// host/varlen_host.h): decode, look up the rank by the slot operand, run the host protocol.
#include "../common/ffi_targets.h"
#include "../host/varlen_host.h"
#include "ffi_common.h"

namespace nvc {
namespace {

ffi::Error AllGatherVHostImpl(ffi::Buffer<ffi::S32> slot, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::S32> num_rows, OrderIn,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::Buffer<ffi::S32>> offsets,
                              ffi::Result<ffi::Buffer<ffi::S32>> total, OrderOut,
                              int64_t comm_id, int64_t zero_tail) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  auto dims = x.dimensions();
  if (dims.size() < 1 || dims[0] < 1)
    return precondition("jax_nvcomm: all_gather_v: x must be [max_rows >= 1, ...]");
  const int W = ctx->view.world;
  if (out->size_bytes() != x.size_bytes() * size_t(W) || offsets->element_count() != size_t(W + 1))
    return precondition("jax_nvcomm: all_gather_v: output sizes do not match world * x");
  const int64_t max_rows = dims[0];
  return from_text(host::all_gather_v(ctx->view, x.untyped_data(), num_rows.typed_data()[0],
                                      out->untyped_data(), offsets->typed_data(),
                                      total->typed_data(), max_rows,
                                      x.size_bytes() / size_t(max_rows), zero_tail != 0));
}

ffi::Error ReduceScatterVHostImpl(ffi::Buffer<ffi::S32> slot, ffi::AnyBuffer y,
                                  ffi::Buffer<ffi::S32> offsets, OrderIn,
                                  ffi::Result<ffi::AnyBuffer> out, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  auto dims = out->dimensions();
  const int W = ctx->view.world;
  if (dims.size() < 1 || dims[0] < 1)
    return precondition("jax_nvcomm: reduce_scatter_v: output must be [max_rows >= 1, ...]");
  if (y.size_bytes() != out->size_bytes() * size_t(W) || offsets.element_count() != size_t(W + 1))
    return precondition("jax_nvcomm: reduce_scatter_v: y must be [world * max_rows, ...] and "
                        "offsets [world + 1]");
  const int dt = dtype_code(y.element_type());
  if (dt < 0 || dt > 2)
    return precondition("jax_nvcomm: reduce_scatter_v: y must be float32, bfloat16 or float16");
  const int64_t max_rows = dims[0];
  return from_text(host::reduce_scatter_v(ctx->view, y.untyped_data(), offsets.typed_data(),
                                          out->untyped_data(), max_rows,
                                          out->size_bytes() / size_t(max_rows), dt));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kAllGatherVHost, AllGatherVHostImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::AnyBuffer>()  // order_in: _order.py, never read
                           .Ret<ffi::AnyBuffer>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::AnyBuffer>()  // order_out: never written
                           .Attr<int64_t>("comm_id")
                           .Attr<int64_t>("zero_tail"));
XLA_FFI_DEFINE_HANDLER(kReduceScatterVHost, ReduceScatterVHostImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::AnyBuffer>()  // order_in: _order.py, never read
                           .Ret<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()  // order_out: never written
                           .Attr<int64_t>("comm_id"));

NVC_REGISTER_FFI("nvc_all_gather_v", kAllGatherVHost);
NVC_REGISTER_FFI("nvc_reduce_scatter_v", kReduceScatterVHost);

}  // namespace nvc
