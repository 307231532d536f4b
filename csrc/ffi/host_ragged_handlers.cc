// XLA:CPU FFI handler of ragged_all_to_all for the host backend (protocol: host/ragged_host.h):
// decode, look up the rank by the slot operand, run the host protocol. The result aliases
// `output` (input_output_aliases from jax_nvcomm/ragged.py); where XLA gave it another buffer,
// output's values are copied into it first, so rows nothing lands on keep them.
#include <cstring>

#include "../common/ffi_targets.h"
#include "../host/ragged_host.h"
#include "ffi_common.h"
#include "ffi_signatures.h"
#include "ragged_ffi_common.h"

namespace nvc {
namespace {

ffi::Error RaggedHostImpl(ffi::Buffer<ffi::S32> slot, ffi::AnyBuffer operand,
                          ffi::AnyBuffer output, ffi::AnyBuffer input_offsets,
                          ffi::AnyBuffer send_sizes, ffi::AnyBuffer output_offsets,
                          ffi::AnyBuffer recv_sizes, OrderIn, ffi::Result<ffi::AnyBuffer> out,
                          OrderOut, int64_t comm_id, int64_t chunk_bytes) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, slot.typed_data()[0], &ctx); e.failure()) return e;
  const ffi::AnyBuffer* idx[4] = {&input_offsets, &send_sizes, &output_offsets, &recv_sizes};
  RaggedShape r;
  if (auto e = check_ragged(ctx->view.world, operand, output, idx, *out, &r); e.failure())
    return e;
  if (const char* why = ragged_chunk_check(ctx->view.max_message_bytes, ctx->view.world, r,
                                           chunk_bytes))
    return ragged_error(std::string(why) + " (chunk_bytes=" + std::to_string(chunk_bytes) +
                        ", max_message_bytes=" + std::to_string(ctx->view.max_message_bytes) +
                        ", world=" + std::to_string(ctx->view.world) + ", k=" +
                        std::to_string(r.k) + ")");
  if (out->untyped_data() != output.untyped_data())
    std::memcpy(out->untyped_data(), output.untyped_data(), output.size_bytes());
  host::RaggedHostArgs a{operand.untyped_data(), out->untyped_data(),
                         input_offsets.untyped_data(), send_sizes.untyped_data(),
                         output_offsets.untyped_data(), recv_sizes.untyped_data(),
                         r.offsets_64, r.n_rows, r.m_rows, r.row_bytes, r.k, chunk_bytes};
  return from_text(*ctx, host::ragged_all_to_all(ctx->view, a));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kRaggedAllToAllHost, RaggedHostImpl,
                       sig::ragged_all_to_all(sig::host_bind));

NVC_REGISTER_FFI("nvc_ragged_all_to_all", kRaggedAllToAllHost);

}  // namespace nvc
