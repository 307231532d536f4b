// XLA:CPU FFI handlers of all_gather_v / reduce_scatter_v for the host backend (protocol:
// host/varlen_host.h): decode, look up the rank by the slot operand, run the host protocol.
#include "../common/ffi_targets.h"
#include "../host/varlen_host.h"
#include "ffi_common.h"
#include "ffi_signatures.h"
#include "varlen_ffi_common.h"

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
  VarlenRows r;
  if (auto e = check_gather_v(ctx->view.world, x, out->size_bytes(), offsets->element_count(), &r);
      e.failure())
    return e;
  return from_text(*ctx, host::all_gather_v(ctx->view, x.untyped_data(), num_rows.typed_data()[0],
                                      out->untyped_data(), offsets->typed_data(),
                                      total->typed_data(), r.max_rows, r.row,
                                      zero_tail != 0));
}

ffi::Error ReduceScatterVHostImpl(ffi::Buffer<ffi::S32> slot, ffi::AnyBuffer y,
                                  ffi::Buffer<ffi::S32> offsets, OrderIn,
                                  ffi::Result<ffi::AnyBuffer> out, OrderOut, int64_t comm_id) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  VarlenRows r;
  int dt = 0;
  if (auto e = check_scatter_v(ctx->view.world, y, *out, offsets.element_count(), &r, &dt);
      e.failure())
    return e;
  return from_text(*ctx, host::reduce_scatter_v(ctx->view, y.untyped_data(), offsets.typed_data(),
                                          out->untyped_data(), r.max_rows, r.row, dt));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kAllGatherVHost, AllGatherVHostImpl,
                       sig::all_gather_v(sig::host_bind));
XLA_FFI_DEFINE_HANDLER(kReduceScatterVHost, ReduceScatterVHostImpl,
                       sig::reduce_scatter_v(sig::host_bind));

NVC_REGISTER_FFI("nvc_all_gather_v", kAllGatherVHost);
NVC_REGISTER_FFI("nvc_reduce_scatter_v", kReduceScatterVHost);

}  // namespace nvc
