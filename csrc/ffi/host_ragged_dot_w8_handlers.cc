// XLA:CPU FFI handlers of ragged_dot_w8 / ragged_dot_swiglu_w8 (8-bit expert weights) for the
// host backend (host/ragged_dot_host.h ragged_dot_w8): decode, check, run the loop. Operands:
//   ragged_dot_w8:        lhs, rhs, rhs_scale, group_sizes
//   ragged_dot_swiglu_w8: lhs, w_gate, w_up, gate_scale, up_scale, group_sizes
// lhs [M, K] bf16 / f16; weights [G, K, N] int8 or float8_e4m3fn; scales float32 of the shape
// attribute scale_mode asks for (0: [1], ignored; 1: [G, N]; 2: [G, ceil(K/128), ceil(N/128)]);
// group_sizes int32 [G] -> out [M, N] of lhs's dtype or float32. Local ops: no rank, no order
// token. The binding is this file's own (the CUDA targets add a workspace result).
#include <string>
#include <vector>

#include "../common/ffi_targets.h"
#include "../host/dtypes.h"
#include "../host/ragged_dot_host.h"
#include "ffi_common.h"
#include "ragged_dot_ffi_common.h"

namespace nvc {
namespace {

ffi::Error run(const char* what, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, const ffi::AnyBuffer* rhs2,
               ffi::AnyBuffer scale, const ffi::AnyBuffer* scale2,
               ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
               int64_t scale_mode) {
  if (auto e = w8::check(what, lhs, rhs, rhs2, scale, scale2, group_sizes, *out, scale_mode);
      e.failure())
    return e;
  const bool swiglu = rhs2 != nullptr;
  auto ld = lhs.dimensions(), rdm = rhs.dimensions();
  const int64_t g = rdm[0], k = rdm[1], n = rdm[2];
  const ffi::DataType lt = lhs.element_type(), ot = out->element_type(), wt = rhs.element_type();
  host::RaggedDotW8HostArgs a;
  a.base.lhs = lhs.untyped_data();
  a.base.rhs = rhs.untyped_data();
  a.base.rhs2 = swiglu ? rhs2->untyped_data() : nullptr;
  a.base.group_sizes = group_sizes.typed_data();
  a.base.out = out->untyped_data();
  a.base.m = ld[0];
  a.base.k = k;
  a.base.n = n;
  a.base.g = g;
  a.base.dtype = dtype_code(lt);
  a.base.out_dtype = dtype_code(ot);
  a.w_dtype = wt == ffi::DataType::S8 ? host::kW8Int8 : host::kW8E4M3;
  a.scale_mode = int(scale_mode);
  a.scale = static_cast<const float*>(scale.untyped_data());
  a.scale2 = swiglu ? static_cast<const float*>(scale2->untyped_data()) : nullptr;
  const std::string err = host::ragged_dot_w8(a);
  return err.empty() ? ffi::Error::Success()
                     : precondition(std::string("jax_nvcomm: ") + what + ": " + err);
}

ffi::Error RaggedDotW8HostImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::AnyBuffer rhs_scale,
                               ffi::Buffer<ffi::S32> group_sizes,
                               ffi::Result<ffi::AnyBuffer> out, int64_t scale_mode) {
  return run("ragged_dot_w8", lhs, rhs, nullptr, rhs_scale, nullptr, group_sizes, out,
             scale_mode);
}

ffi::Error RaggedDotSwigluW8HostImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer w_gate,
                                     ffi::AnyBuffer w_up, ffi::AnyBuffer gate_scale,
                                     ffi::AnyBuffer up_scale, ffi::Buffer<ffi::S32> group_sizes,
                                     ffi::Result<ffi::AnyBuffer> out, int64_t scale_mode) {
  return run("ragged_dot_swiglu_w8", lhs, w_gate, &w_up, gate_scale, &up_scale, group_sizes,
             out, scale_mode);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kRaggedDotW8Host, RaggedDotW8HostImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()           // lhs
                           .Arg<ffi::AnyBuffer>()           // rhs
                           .Arg<ffi::AnyBuffer>()           // rhs_scale
                           .Arg<ffi::Buffer<ffi::S32>>()    // group_sizes
                           .Ret<ffi::AnyBuffer>()           // out
                           .Attr<int64_t>("scale_mode"));
XLA_FFI_DEFINE_HANDLER(kRaggedDotSwigluW8Host, RaggedDotSwigluW8HostImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()           // lhs
                           .Arg<ffi::AnyBuffer>()           // w_gate
                           .Arg<ffi::AnyBuffer>()           // w_up
                           .Arg<ffi::AnyBuffer>()           // gate_scale
                           .Arg<ffi::AnyBuffer>()           // up_scale
                           .Arg<ffi::Buffer<ffi::S32>>()    // group_sizes
                           .Ret<ffi::AnyBuffer>()           // out
                           .Attr<int64_t>("scale_mode"));

NVC_REGISTER_FFI("nvc_ragged_dot_w8", kRaggedDotW8Host);
NVC_REGISTER_FFI("nvc_ragged_dot_swiglu_w8", kRaggedDotSwigluW8Host);

}  // namespace nvc
