// Host-memory ragged_all_to_all for CPU devices: the protocol of common/ragged_layout.h on the
// host transport, one "block" per rank (G = 1), flags as in host_sync.h.
//   1. validate my K = W * k slices (bad one: poison my flags at every rank, kErrRaggedSlice);
//   2. push: for every peer d != me, copy the rows of my slices d*k .. d*k+k-1 into d's half p
//      frame at their output offsets, write my k header entries there, then raise my flag at
//      every rank (publish);
//   3. copy my slices to myself straight from the operand; wait (bounded) for every peer's flag;
//      for each src != me and slice j, check the header's size against recv_sizes[src*k + j]
//      (kErrRaggedRecv naming src, j and both sizes) and copy its rows from my frame to `out`;
//   4. end_call.
// With chunk > 0 the chunked path of ragged_layout.h runs instead (any output size; memory:
// the communicator's flag half, ragged_chunk_fits): per pair, rounds of at most chunk bytes
// through two slots, each round's copy out acknowledged before its slot is reused.
// `out` holds `output`'s values on entry (the FFI handler copies them when XLA did not alias
// the two); only the rows slices land on are written. Error texts from this protocol add the
// numbers of the bad slice (its offsets and sizes, N, M and the receiving rank) to the record's
// text (describe_error), which carries only the slice and the field.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "../common/layout.h"

namespace nvc {
namespace host {

struct RaggedHostArgs {
  const void* operand;         // [n_rows, row_bytes]
  void* out;                   // [m_rows, row_bytes], output's values on entry
  const void* input_offsets;   // [W * k] int32 or int64 (offsets_64), all four alike
  const void* send_sizes;
  const void* output_offsets;
  const void* recv_sizes;
  bool offsets_64;
  int64_t n_rows;
  int64_t m_rows;
  size_t row_bytes;            // > 0
  int64_t k;                   // slices per peer, >= 1
  int64_t chunk = 0;           // 0: single round (ragged_fits); > 0: chunked path, slot bytes
};

// "" on success, else the error text (also recorded in v.err, first error wins).
std::string ragged_all_to_all(const CommView& v, const RaggedHostArgs& a);

}  // namespace host
}  // namespace nvc
