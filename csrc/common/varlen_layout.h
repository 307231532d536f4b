// Layout of the variable-length gather / reduce-scatter (all_gather_v, reduce_scatter_v) inside
// one flag-protocol data half of a Communicator's buffer (layout.h), shared by the CUDA kernels
// (kernels/varlen.cuh), the host protocols (host/varlen_host.cc) and the Python capacity check
// (jax_nvcomm/varlen.py repeats varlen_fits).
//
// Data half p of rank r (CommView::half(r, p)), for a call over rows of `row_bytes` bytes with a
// static capacity of `max_rows` rows per rank:
//   [0, kVarlenHeaderBytes)                       header: int32 count[kMaxWorld], entry [src]
//                                                 written by rank src (what it says about the
//                                                 call: its own row count, or the count it
//                                                 sends to this rank)
//   [kVarlenHeaderBytes + src * S, ... + S)       slot of source src, S = align256(max_rows *
//                                                 row_bytes): src's rows, row i at i * row_bytes
// Invariant: kVarlenHeaderBytes + W * S <= flag_half and W * max_rows * row_bytes <=
// max_message_bytes (varlen_fits); larger calls take the XLA path in Python.
#pragma once
#include "layout.h"

namespace nvc {

constexpr size_t kVarlenHeaderBytes = 256;
static_assert(kVarlenHeaderBytes >= sizeof(int32_t) * kMaxWorld, "header too small");

// Poison descriptor: a rank that found bad input raises flags with it, so its peers report
// "rank X failed this call" at once instead of timing out (layout.h kPoisonDesc).
constexpr uint32_t kVarlenPoisonDesc = kPoisonDesc;

NVC_HD size_t varlen_slot_bytes(int64_t max_rows, size_t row_bytes) {
  return align_up(size_t(max_rows) * row_bytes, 256);
}
NVC_HD bool varlen_fits(size_t max_message_bytes, int world, int64_t max_rows,
                        size_t row_bytes) {
  if (max_rows < 0) return false;
  const size_t half = flag_half_bytes(max_message_bytes, world);
  return size_t(world) * size_t(max_rows) * row_bytes <= max_message_bytes &&
         kVarlenHeaderBytes + size_t(world) * varlen_slot_bytes(max_rows, row_bytes) <= half;
}
NVC_HD int32_t* varlen_header(char* half) { return reinterpret_cast<int32_t*>(half); }
NVC_HD char* varlen_slot(char* half, int src, size_t slot_bytes) {
  return half + kVarlenHeaderBytes + size_t(src) * slot_bytes;
}
// Rows [begin, end) of `count` that block b of a grid of g handles (every rank alike).
NVC_HD int64_t varlen_split(int64_t count, int g, int b) { return count * b / g; }

}  // namespace nvc
