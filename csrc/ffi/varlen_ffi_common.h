// Shape checks of the varlen FFI handlers (all_gather_v / reduce_scatter_v), shared by the host
// and CUDA backends: the operands and results against the group's world size, and the row
// geometry both protocols take (max_rows rows of `row` bytes).
#pragma once
#include <cstddef>
#include <cstdint>

#include "ffi_common.h"

namespace nvc {

struct VarlenRows {
  int64_t max_rows;
  size_t row;  // bytes per row
};

// all_gather_v: x [max_rows >= 1, ...], out world times x, offsets [world + 1].
inline ffi::Error check_gather_v(int world, const ffi::AnyBuffer& x, size_t out_bytes,
                                 size_t offsets_elems, VarlenRows* r) {
  auto dims = x.dimensions();
  if (dims.size() < 1 || dims[0] < 1)
    return precondition("jax_nvcomm: all_gather_v: x must be [max_rows >= 1, ...]");
  if (out_bytes != x.size_bytes() * size_t(world) || offsets_elems != size_t(world + 1))
    return precondition("jax_nvcomm: all_gather_v: output sizes do not match world * x");
  *r = VarlenRows{dims[0], x.size_bytes() / size_t(dims[0])};
  return ffi::Error::Success();
}

// reduce_scatter_v: out [max_rows >= 1, ...], y world times out (float32, bfloat16 or float16),
// offsets [world + 1]. *dt: the protocols' dtype code of y.
inline ffi::Error check_scatter_v(int world, const ffi::AnyBuffer& y, const ffi::AnyBuffer& out,
                                  size_t offsets_elems, VarlenRows* r, int* dt) {
  auto dims = out.dimensions();
  if (dims.size() < 1 || dims[0] < 1)
    return precondition("jax_nvcomm: reduce_scatter_v: output must be [max_rows >= 1, ...]");
  if (y.size_bytes() != out.size_bytes() * size_t(world) || offsets_elems != size_t(world + 1))
    return precondition("jax_nvcomm: reduce_scatter_v: y must be [world * max_rows, ...] and "
                        "offsets [world + 1]");
  *dt = dtype_code(y.element_type());
  if (*dt < 0 || *dt > 2)
    return precondition("jax_nvcomm: reduce_scatter_v: y must be float32, bfloat16 or float16");
  *r = VarlenRows{dims[0], out.size_bytes() / size_t(dims[0])};
  return ffi::Error::Success();
}

}  // namespace nvc
