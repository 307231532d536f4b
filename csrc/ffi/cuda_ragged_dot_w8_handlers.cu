// XLA:CUDA FFI handlers of ragged_dot_w8 / ragged_dot_swiglu_w8 (8-bit expert weights,
// kernels/ragged_dot.cuh "8-bit weights"): decode, check, launch on XLA's stream. Operands:
//   ragged_dot_w8:        lhs, rhs, rhs_scale, group_sizes
//   ragged_dot_swiglu_w8: lhs, w_gate, w_up, gate_scale, up_scale, group_sizes
// lhs [M, K] bf16 / f16; weights [G, K, N] int8 or float8_e4m3fn; scales float32 of the shape
// attribute scale_mode asks for (0: [1], ignored; 1: [G, N]; 2: [G, ceil(K/128), ceil(N/128)]);
// -> out [M, N] of lhs's dtype or float32, and the split-K workspace (as the 16-bit op's).
// Local ops with nothing kept on the host: command-buffer compatible (and a "_nograph" twin).
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "../common/ffi_targets.h"
#include "../cuda/ragged_dot.h"
#include "cuda_ffi_common.h"
#include "ffi_signatures.h"
#include "ragged_dot_ffi_common.h"

namespace nvc {
namespace {

ffi::Error run(cudaStream_t stream, const char* what, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
               const ffi::AnyBuffer* rhs2, ffi::AnyBuffer scale, const ffi::AnyBuffer* scale2,
               ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
               ffi::Result<ffi::AnyBuffer> ws, int64_t scale_mode) {
  if (auto e = w8::check(what, lhs, rhs, rhs2, scale, scale2, group_sizes, *out, scale_mode);
      e.failure())
    return e;
  const bool swiglu = rhs2 != nullptr;
  auto ld = lhs.dimensions(), rdm = rhs.dimensions();
  const int64_t g = rdm[0], k = rdm[1], n = rdm[2];
  const ffi::DataType lt = lhs.element_type(), ot = out->element_type(), wt = rhs.element_type();
  // the kernel's own multiples (the Python op checks them first: ragged_dot.py W8_CUDA_MULTIPLE)
  if (k % 16 != 0) return w8::bad(what, "K", "a multiple of 16", std::to_string(k));
  if (n % 16 != 0) return w8::bad(what, "N", "a multiple of 16", std::to_string(n));
  cuda::RaggedDotArgs a;
  a.lhs = lhs.untyped_data();
  a.rhs = rhs.untyped_data();
  a.rhs2 = swiglu ? rhs2->untyped_data() : nullptr;
  a.group_sizes = group_sizes.typed_data();
  a.out = out->untyped_data();
  a.m = ld[0];
  a.k = k;
  a.n = n;
  a.g = g;
  a.dtype = dtype_code(lt);
  a.out_dtype = dtype_code(ot);
  a.w_dtype = wt == ffi::DataType::S8 ? cuda::kWInt8 : cuda::kWE4M3;
  a.scale_mode = int(scale_mode);
  a.scale = static_cast<const float*>(scale.untyped_data());
  a.scale2 = swiglu ? static_cast<const float*>(scale2->untyped_data()) : nullptr;
  // the split-K workspace (a second result XLA allocates; a smaller one means fewer or no
  // splits, never a wrong result)
  a.workspace = ws->untyped_data();
  a.workspace_bytes = int64_t(ws->size_bytes());
  if (const char* why = cuda::ragged_dot_check(a, swiglu))
    return precondition(std::string("jax_nvcomm: ") + what + ": " + why);
  return launch_result(swiglu ? cuda::ragged_dot_swiglu(a, stream) : cuda::ragged_dot(a, stream),
                       what);
}

ffi::Error RaggedDotW8CudaImpl(cudaStream_t stream, int32_t, ffi::AnyBuffer lhs,
                               ffi::AnyBuffer rhs, ffi::AnyBuffer rhs_scale,
                               ffi::Buffer<ffi::S32> group_sizes,
                               ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> ws,
                               int64_t scale_mode) {
  return run(stream, "ragged_dot_w8", lhs, rhs, nullptr, rhs_scale, nullptr, group_sizes, out,
             ws, scale_mode);
}

ffi::Error RaggedDotSwigluW8CudaImpl(cudaStream_t stream, int32_t, ffi::AnyBuffer lhs,
                                     ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up,
                                     ffi::AnyBuffer gate_scale, ffi::AnyBuffer up_scale,
                                     ffi::Buffer<ffi::S32> group_sizes,
                                     ffi::Result<ffi::AnyBuffer> out,
                                     ffi::Result<ffi::AnyBuffer> ws, int64_t scale_mode) {
  return run(stream, "ragged_dot_swiglu_w8", lhs, w_gate, &w_up, gate_scale, &up_scale,
             group_sizes, out, ws, scale_mode);
}

}  // namespace

NVC_CUDA_HANDLER(kRaggedDotW8Cuda, "nvc_cuda_ragged_dot_w8", RaggedDotW8CudaImpl,
                 sig::ragged_dot_w8_cuda(cuda_bind));
NVC_CUDA_HANDLER(kRaggedDotSwigluW8Cuda, "nvc_cuda_ragged_dot_swiglu_w8",
                 RaggedDotSwigluW8CudaImpl, sig::ragged_dot_swiglu_w8_cuda(cuda_bind));

}  // namespace nvc
