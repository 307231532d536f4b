// XLA:CUDA FFI handlers of ragged_dot / ragged_dot_swiglu (kernels/ragged_dot.cuh): decode,
// check, launch on XLA's stream. Local ops: no rank context, no order token. group_sizes is a
// device operand the kernel reads, nothing is kept on the host, so both are command-buffer
// compatible (NVC_CUDA_HANDLER also registers a "_nograph" twin).
#include <cuda_runtime.h>

#include "../common/ffi_targets.h"
#include "../cuda/ragged_dot.h"
#include "cuda_ffi_common.h"
#include "ffi_signatures.h"
#include "ragged_dot_ffi_common.h"

namespace nvc {
namespace {

ffi::Error run(cudaStream_t stream, const char* what, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
               const ffi::AnyBuffer* rhs2, ffi::Buffer<ffi::S32> group_sizes,
               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws) {
  RaggedDotDims d;
  if (auto e = check_ragged_dot(what, lhs, rhs, rhs2, group_sizes, *out, &d); e.failure())
    return e;
  cuda::RaggedDotArgs a;
  a.lhs = lhs.untyped_data();
  a.rhs = rhs.untyped_data();
  a.rhs2 = rhs2 != nullptr ? rhs2->untyped_data() : nullptr;
  a.group_sizes = group_sizes.typed_data();
  a.out = out->untyped_data();
  a.m = d.m;
  a.k = d.k;
  a.n = d.n;
  a.g = d.g;
  a.dtype = d.dtype;
  a.out_dtype = d.out_dtype;
  // the split-K workspace (a second result XLA allocates; any size: a smaller one means fewer
  // or no splits, never a wrong result)
  a.workspace = ws->untyped_data();
  a.workspace_bytes = int64_t(ws->size_bytes());
  // the Python op sends only what the kernel takes (jax_nvcomm/ragged_dot.py supported())
  if (const char* why = cuda::ragged_dot_check(a, rhs2 != nullptr))
    return precondition(std::string("jax_nvcomm: ") + what + ": " + why);
  return launch_result(rhs2 != nullptr ? cuda::ragged_dot_swiglu(a, stream)
                                       : cuda::ragged_dot(a, stream),
                       what);
}

ffi::Error RaggedDotCudaImpl(cudaStream_t stream, int32_t, ffi::AnyBuffer lhs,
                             ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> group_sizes,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws) {
  return run(stream, "ragged_dot", lhs, rhs, nullptr, group_sizes, out, ws);
}

ffi::Error RaggedDotSwigluCudaImpl(cudaStream_t stream, int32_t, ffi::AnyBuffer lhs,
                                   ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up,
                                   ffi::Buffer<ffi::S32> group_sizes,
                                   ffi::Result<ffi::AnyBuffer> out,
                                   ffi::Result<ffi::AnyBuffer> ws) {
  return run(stream, "ragged_dot_swiglu", lhs, w_gate, &w_up, group_sizes, out, ws);
}

}  // namespace

NVC_CUDA_HANDLER(kRaggedDotCuda, "nvc_cuda_ragged_dot", RaggedDotCudaImpl,
                 sig::ragged_dot_cuda(cuda_bind));
NVC_CUDA_HANDLER(kRaggedDotSwigluCuda, "nvc_cuda_ragged_dot_swiglu", RaggedDotSwigluCudaImpl,
                 sig::ragged_dot_swiglu_cuda(cuda_bind));

}  // namespace nvc
