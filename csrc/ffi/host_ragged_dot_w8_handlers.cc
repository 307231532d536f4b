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

std::string dims_text(ffi::Span<const int64_t> d) { return rd_shape(d); }

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
               dims_text(d));
  return ffi::Error::Success();
}

ffi::Error run(const char* what, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, const ffi::AnyBuffer* rhs2,
               ffi::AnyBuffer scale, const ffi::AnyBuffer* scale2,
               ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out,
               int64_t scale_mode) {
  const bool swiglu = rhs2 != nullptr;
  const char* wname = swiglu ? "w_gate" : "rhs";
  auto ld = lhs.dimensions(), rdm = rhs.dimensions(), od = out->dimensions();
  if (ld.size() != 2) return bad(what, "lhs", "[M, K]", dims_text(ld));
  const ffi::DataType lt = lhs.element_type();
  if (lt != ffi::DataType::BF16 && lt != ffi::DataType::F16)
    return bad(what, "lhs", "bfloat16 or float16", dtype_name(lt));
  if (rdm.size() != 3 || rdm[1] != ld[1])
    return bad(what, wname, "[G, K, N] with K = " + std::to_string(ld[1]), dims_text(rdm));
  if (rdm[0] < 1) return bad(what, wname, "at least one group", dims_text(rdm));
  const ffi::DataType wt = rhs.element_type();
  if (wt != ffi::DataType::S8 && wt != ffi::DataType::F8E4M3FN)
    return bad(what, wname, "int8 or float8_e4m3fn", dtype_name(wt));
  if (swiglu) {
    auto ud = rhs2->dimensions();
    if (ud.size() != 3 || ud[0] != rdm[0] || ud[1] != rdm[1] || ud[2] != rdm[2])
      return bad(what, "w_up", "w_gate's shape " + dims_text(rdm), dims_text(ud));
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
               dims_text(od));
  const ffi::DataType ot = out->element_type();
  if (ot != lt && ot != ffi::DataType::F32)
    return bad(what, "out", dtype_name(lt) + " or float32", dtype_name(ot));
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
