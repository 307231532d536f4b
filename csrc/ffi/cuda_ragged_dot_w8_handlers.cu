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

std::string dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::S32: return "int32";
    default: return "dtype code " + std::to_string(int(t));
  }
}

ffi::Error bad(const char* what, const std::string& arg, const std::string& expected,
               const std::string& got) {
  return precondition(std::string("jax_nvcomm: ") + what + ": " + arg + ": expected " +
                      expected + ", got " + got);
}

// The scale operand `name` for `mode` and weights [g, k, n].
ffi::Error check_scale(const char* what, const char* name, const ffi::AnyBuffer& s, int64_t mode,
                       int64_t g, int64_t k, int64_t n) {
  if (s.element_type() != ffi::DataType::F32)
    return bad(what, name, "float32", dtype_name(s.element_type()));
  std::vector<int64_t> want;
  if (mode == 0) want = {1};
  else if (mode == 1) want = {g, n};
  else want = {g, (k + 127) / 128, (n + 127) / 128};
  auto d = s.dimensions();
  bool same = d.size() == want.size();
  for (size_t i = 0; same && i < want.size(); ++i) same = d[i] == want[i];
  if (!same && mode == 0 && s.element_count() == 1) same = true;
  if (!same)
    return bad(what, name,
               rd_shape(ffi::Span<const int64_t>(want.data(), want.size())) +
                   " for scale_mode " + std::to_string(mode),
               rd_shape(d));
  return ffi::Error::Success();
}

ffi::Error run(cudaStream_t stream, const char* what, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
               const ffi::AnyBuffer* rhs2, ffi::AnyBuffer scale, const ffi::AnyBuffer* scale2,
               ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
               ffi::Result<ffi::AnyBuffer> ws, int64_t scale_mode) {
  const bool swiglu = rhs2 != nullptr;
  const char* wname = swiglu ? "w_gate" : "rhs";
  auto ld = lhs.dimensions(), rdm = rhs.dimensions(), od = out->dimensions();
  if (ld.size() != 2) return bad(what, "lhs", "[M, K]", rd_shape(ld));
  const ffi::DataType lt = lhs.element_type();
  if (lt != ffi::DataType::BF16 && lt != ffi::DataType::F16)
    return bad(what, "lhs", "bfloat16 or float16", dtype_name(lt));
  if (rdm.size() != 3 || rdm[1] != ld[1])
    return bad(what, wname, "[G, K, N] with K = " + std::to_string(ld[1]), rd_shape(rdm));
  if (rdm[0] < 1) return bad(what, wname, "at least one group", rd_shape(rdm));
  const ffi::DataType wt = rhs.element_type();
  if (wt != ffi::DataType::S8 && wt != ffi::DataType::F8E4M3FN)
    return bad(what, wname, "int8 or float8_e4m3fn", dtype_name(wt));
  if (swiglu) {
    auto ud = rhs2->dimensions();
    if (ud.size() != 3 || ud[0] != rdm[0] || ud[1] != rdm[1] || ud[2] != rdm[2])
      return bad(what, "w_up", "w_gate's shape " + rd_shape(rdm), rd_shape(ud));
    if (rhs2->element_type() != wt)
      return bad(what, "w_up", "w_gate's dtype " + dtype_name(wt),
                 dtype_name(rhs2->element_type()));
  }
  if (scale_mode < 0 || scale_mode > 2)
    return bad(what, "scale_mode", "0, 1 or 2", std::to_string(scale_mode));
  const int64_t g = rdm[0], k = rdm[1], n = rdm[2];
  if (auto e = check_scale(what, swiglu ? "gate_scale" : "rhs_scale", scale, scale_mode, g, k, n);
      e.failure())
    return e;
  if (swiglu)
    if (auto e = check_scale(what, "up_scale", *scale2, scale_mode, g, k, n); e.failure())
      return e;
  if (int64_t(group_sizes.element_count()) != g)
    return bad(what, "group_sizes", "[" + std::to_string(g) + "] int32",
               "[" + std::to_string(group_sizes.element_count()) + "]");
  if (od.size() != 2 || od[0] != ld[0] || od[1] != n)
    return bad(what, "out", "[" + std::to_string(ld[0]) + ", " + std::to_string(n) + "]",
               rd_shape(od));
  const ffi::DataType ot = out->element_type();
  if (ot != lt && ot != ffi::DataType::F32)
    return bad(what, "out", dtype_name(lt) + " or float32", dtype_name(ot));
  // the kernel's own multiples (the Python op checks them first: ragged_dot.py W8_CUDA_MULTIPLE)
  if (k % 16 != 0) return bad(what, "K", "a multiple of 16", std::to_string(k));
  if (n % 16 != 0) return bad(what, "N", "a multiple of 16", std::to_string(n));
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
