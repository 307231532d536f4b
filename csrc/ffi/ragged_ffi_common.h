// Shape and dtype checks of the ragged_all_to_all FFI handlers, shared by the host and CUDA
// backends: operand [N, ...] and output [M, ...] of one dtype and the same trailing dims (a
// whole number of bytes per element), the result like output, and the four index arrays 1-D of
// one length K = W * k (k >= 1), all int32 or all int64 (common/ragged_layout.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "ffi_common.h"
#include "../common/ragged_layout.h"

namespace nvc {

struct RaggedShape {
  int64_t n_rows;
  int64_t m_rows;
  size_t row_bytes;
  int64_t k;         // slices per peer
  bool offsets_64;   // the index arrays are int64 (else int32)
};

inline bool ragged_subbyte(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::S1: case ffi::DataType::S2: case ffi::DataType::S4:
    case ffi::DataType::U1: case ffi::DataType::U2: case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN: case ffi::DataType::TOKEN: case ffi::DataType::INVALID:
      return true;
    default:
      return false;
  }
}

inline std::string ragged_dims(const ffi::AnyBuffer& b) {
  std::string s = "[";
  for (int64_t d : b.dimensions()) s += (s.size() > 1 ? ", " : "") + std::to_string(d);
  return s + "]";
}

// The FFI error "jax_nvcomm: ragged_all_to_all: " + msg (error branches only: the checks of
// a valid call allocate nothing).
inline ffi::Error ragged_error(const std::string& msg) {
  return precondition("jax_nvcomm: ragged_all_to_all: " + msg);
}

inline ffi::Error check_ragged(int world, const ffi::AnyBuffer& operand,
                               const ffi::AnyBuffer& output, const ffi::AnyBuffer* idx[4],
                               const ffi::AnyBuffer& out, RaggedShape* r) {
  static const char* kNames[4] = {"input_offsets", "send_sizes", "output_offsets", "recv_sizes"};
  auto od = operand.dimensions(), md = output.dimensions();
  if (od.size() < 1 || md.size() != od.size())
    return ragged_error("operand and output must be [N, ...] and [M, ...] of one rank, got " +
                        ragged_dims(operand) + " and " + ragged_dims(output));
  for (size_t i = 1; i < od.size(); ++i)
    if (od[i] != md[i])
      return ragged_error("operand and output must have the same trailing dims, got " +
                          ragged_dims(operand) + " and " + ragged_dims(output));
  if (operand.element_type() != output.element_type() || ragged_subbyte(operand.element_type()))
    return ragged_error("operand and output must have one dtype of whole bytes");
  if (out.element_type() != output.element_type() || out.size_bytes() != output.size_bytes())
    return ragged_error("the result must be shaped like output " + ragged_dims(output) +
                        ", got " + ragged_dims(out));
  const ffi::DataType it = idx[0]->element_type();
  if (it != ffi::DataType::S32 && it != ffi::DataType::S64)
    return ragged_error("input_offsets must be int32 or int64");
  const size_t K = idx[0]->element_count();
  for (int a = 0; a < 4; ++a) {
    if (idx[a]->element_type() != it)
      return ragged_error(std::string(kNames[a]) + " must have input_offsets' integer type "
                          "(all four int32 or all four int64)");
    if (idx[a]->dimensions().size() != 1 || idx[a]->element_count() != K)
      return ragged_error(std::string(kNames[a]) + " must be 1-D of input_offsets' length " +
                          std::to_string(K) + ", got " + ragged_dims(*idx[a]));
  }
  if (K == 0 || K % size_t(world) != 0)
    return ragged_error("the index arrays must hold k * world (world=" + std::to_string(world) +
                        ", k >= 1) entries, got " + std::to_string(K));
  size_t row = ffi::ByteWidth(operand.element_type());
  for (size_t i = 1; i < od.size(); ++i) row *= size_t(od[i]);
  if (row == 0) return ragged_error("rows of zero bytes (a zero trailing dim)");
  *r = RaggedShape{od[0], md[0], row, int64_t(K / size_t(world)), it == ffi::DataType::S64};
  return ffi::Error::Success();
}

// The chunk_bytes attribute against the communicator: ragged_layout.h ragged_size_problem.
inline const char* ragged_chunk_check(size_t max_message_bytes, int world, const RaggedShape& r,
                                      int64_t chunk) {
  return ragged_size_problem(max_message_bytes, world, r.n_rows, r.m_rows, r.row_bytes, r.k,
                             chunk);
}

}  // namespace nvc
