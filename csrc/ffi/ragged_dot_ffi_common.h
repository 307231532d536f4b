// Shape and dtype checks of ragged_dot / ragged_dot_swiglu shared by the host and CUDA FFI
// handlers (one message text for both backends).
#pragma once
#include <string>
#include <vector>

#include "ffi_common.h"

namespace nvc {

struct RaggedDotDims {
  int64_t m = 0, k = 0, n = 0, g = 0;
  int dtype = -1, out_dtype = -1;
};

inline std::string rd_shape(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// lhs [M, K], rhs (and rhs2 when given) [G, K, N] of lhs's dtype, group_sizes [G], out [M, N].
inline ffi::Error check_ragged_dot(const char* what, const ffi::AnyBuffer& lhs,
                                   const ffi::AnyBuffer& rhs, const ffi::AnyBuffer* rhs2,
                                   const ffi::Buffer<ffi::S32>& group_sizes,
                                   const ffi::AnyBuffer& out, RaggedDotDims* d) {
  const std::string op = std::string("jax_nvcomm: ") + what + ": ";
  auto ld = lhs.dimensions(), rdm = rhs.dimensions(), od = out.dimensions();
  if (ld.size() != 2) return precondition(op + "lhs must be [M, K], got " + rd_shape(ld));
  if (rdm.size() != 3 || rdm[1] != ld[1])
    return precondition(op + "rhs must be [G, K, N] with K = " + std::to_string(ld[1]) +
                        ", got " + rd_shape(rdm));
  if (rhs2 != nullptr && (rhs2->dimensions().size() != 3 || rhs2->dimensions()[0] != rdm[0] ||
                          rhs2->dimensions()[1] != rdm[1] || rhs2->dimensions()[2] != rdm[2]))
    return precondition(op + "w_up must have w_gate's shape " + rd_shape(rdm) + ", got " +
                        rd_shape(rhs2->dimensions()));
  if (int64_t(group_sizes.element_count()) != rdm[0])
    return precondition(op + "group_sizes must hold G = " + std::to_string(rdm[0]) +
                        " int32, got " + std::to_string(group_sizes.element_count()));
  if (od.size() != 2 || od[0] != ld[0] || od[1] != rdm[2])
    return precondition(op + "out must be [" + std::to_string(ld[0]) + ", " +
                        std::to_string(rdm[2]) + "], got " + rd_shape(od));
  d->dtype = dtype_code(lhs.element_type());
  d->out_dtype = dtype_code(out.element_type());
  if (d->dtype < 0 || d->dtype > 2 || rhs.element_type() != lhs.element_type() ||
      (rhs2 != nullptr && rhs2->element_type() != lhs.element_type()))
    return precondition(op + "lhs and rhs must share one dtype of float32, bfloat16, float16");
  if (d->out_dtype != d->dtype && d->out_dtype != 0)
    return precondition(op + "out must have the operands' dtype or float32");
  if (rdm[0] < 1) return precondition(op + "rhs must hold at least one group");
  d->m = ld[0];
  d->k = ld[1];
  d->n = rdm[2];
  d->g = rdm[0];
  return ffi::Error::Success();
}


// 8-bit weights (ragged_dot_w8 / ragged_dot_swiglu_w8): one check, one message text, for the
// host and CUDA handlers: "jax_nvcomm: <op>: <arg>: expected ..., got ...".
namespace w8 {

inline std::string dtype_name(ffi::DataType t) {
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

inline ffi::Error bad(const char* what, const std::string& arg, const std::string& expected,
               const std::string& got) {
  return precondition(std::string("jax_nvcomm: ") + what + ": " + arg + ": expected " +
                      expected + ", got " + got);
}

// The scale operand `name` for `mode` and weights [g, k, n].
inline ffi::Error check_scale(const char* what, const char* name, const ffi::AnyBuffer& s, int64_t mode,
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

// lhs [M, K] bf16 / f16, weights [G, K, N] int8 / e4m3 (w_up of w_gate's shape and dtype),
// scales for scale_mode, group_sizes [G], out [M, N] of lhs's dtype or float32.
inline ffi::Error check(const char* what, const ffi::AnyBuffer& lhs, const ffi::AnyBuffer& rhs,
                        const ffi::AnyBuffer* rhs2, const ffi::AnyBuffer& scale,
                        const ffi::AnyBuffer* scale2, const ffi::Buffer<ffi::S32>& group_sizes,
                        const ffi::AnyBuffer& out_buf, int64_t scale_mode) {
  const ffi::AnyBuffer* out = &out_buf;
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
  return ffi::Error::Success();
}

}  // namespace w8

}  // namespace nvc
