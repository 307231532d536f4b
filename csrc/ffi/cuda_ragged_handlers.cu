// XLA:CUDA FFI handler of ragged_all_to_all (protocol: common/ragged_layout.h, kernel:
// kernels/ragged.cuh behind cuda/ragged.h). Thin: decode, look up the rank by device ordinal,
// check the static arguments, launch on XLA's stream. The result aliases `output`
// (input_output_aliases from jax_nvcomm/ragged.py); where XLA gave it another buffer, output's
// values are copied into it on the stream first. Offsets and sizes are device operands the
// kernel reads and validates itself, so the handler keeps no per-call state and is marked
// command-buffer compatible.
#include <cuda_runtime.h>

#include "../common/ffi_targets.h"
#include "../cuda/ragged.h"
#include "cuda_ffi_common.h"
#include "ffi_signatures.h"
#include "ragged_ffi_common.h"

namespace nvc {
namespace {

ffi::Error RaggedCudaImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer operand,
                          ffi::AnyBuffer output, ffi::AnyBuffer input_offsets,
                          ffi::AnyBuffer send_sizes, ffi::AnyBuffer output_offsets,
                          ffi::AnyBuffer recv_sizes, OrderIn, ffi::Result<ffi::AnyBuffer> out,
                          OrderOut, int64_t comm_id, int64_t chunk_bytes) {
  std::shared_ptr<RankContext> ctx;
  if (auto e = lookup(comm_id, device, &ctx); e.failure()) return e;
  const ffi::AnyBuffer* idx[4] = {&input_offsets, &send_sizes, &output_offsets, &recv_sizes};
  RaggedShape r;
  if (auto e = check_ragged(ctx->view.world, operand, output, idx, *out, &r); e.failure())
    return e;
  cuda::RaggedArgs a{operand.untyped_data(), out->untyped_data(),
                     input_offsets.untyped_data(), send_sizes.untyped_data(),
                     output_offsets.untyped_data(), recv_sizes.untyped_data(),
                     r.offsets_64, r.n_rows, r.m_rows, r.row_bytes, r.k, chunk_bytes};
  if (const char* why = cuda::ragged_check(ctx->view, a)) return ragged_error(why);
  if (out->untyped_data() != output.untyped_data()) {
    cudaError_t e = cudaMemcpyAsync(out->untyped_data(), output.untyped_data(),
                                    output.size_bytes(), cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return launch_result(e, "ragged_all_to_all copy of output");
  }
  return launch_result(cuda::ragged_launch(ctx->view, a, stream), "ragged_all_to_all launch");
}

}  // namespace

NVC_CUDA_HANDLER(kRaggedAllToAllCuda, "nvc_cuda_ragged_all_to_all", RaggedCudaImpl,
                 sig::ragged_all_to_all(cuda_bind));

}  // namespace nvc
