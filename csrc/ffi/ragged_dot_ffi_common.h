// Shape and dtype checks of ragged_dot / ragged_dot_swiglu shared by the host and CUDA FFI
// handlers (one message text for both backends).
#pragma once
#include <string>

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

}  // namespace nvc
