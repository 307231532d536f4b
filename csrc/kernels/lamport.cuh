// Lamport sentinel helpers for the one-shot protocol.
//
// Protocol: a Lamport slot is "empty" when every 32-bit word in it is 0x80000000 (the bit pattern
// of float -0.0). A writer pushes its payload with plain 16-byte stores; a reader knows a word
// has arrived as soon as it differs from the sentinel, so data and "flag" travel together and no
// fence or separate flag store is needed. Correctness therefore rests on two invariants:
//
// - No payload word may ever equal 0x80000000. Every element is sanitised before the push:
//   f32 -0.0 becomes +0.0; for 16-bit types every -0.0 half (0x8000) becomes +0.0, which is
//   enough because a 32-bit word equals 0x80000000 only if its high half is 0x8000.
//   Sanitising changes no value (it only drops the sign of zero), and the consumers (one-shot and
//   two-shot alike) sum sanitised inputs, so results stay bitwise identical across strategies.
// - A 16-byte store over NVLink is not atomic as a whole: readers test every 32-bit word. The
//   test compares raw bits; a float compare would treat a negative subnormal as -0.0 under
//   flush-to-zero and +0.0 == -0.0, and the poll would never end.
//
// Buffer rotation, clearing, counters, the call tags and the failure path (a poll that times
// out yields lamport_poison_v4) are handled by the one-shot kernel (allreduce_oneshot.cuh); this
// header only provides the per-vector primitives.
#pragma once
#include "common.cuh"

namespace nvc {
namespace dev {

// The empty 16-byte vector.
__device__ __forceinline__ uint4 lamport_empty_v4() {
  return make_uint4(kLamportEmpty, kLamportEmpty, kLamportEmpty, kLamportEmpty);
}

// True when any 32-bit word of v still holds the sentinel (raw bit compare).
__device__ __forceinline__ bool lamport_any_empty(const uint4& v) {
  return (v.x == kLamportEmpty) | (v.y == kLamportEmpty) | (v.z == kLamportEmpty) |
         (v.w == kLamportEmpty);
}

// One 32-bit word: replace every -0.0 element of T by +0.0.
template <typename T>
__device__ __forceinline__ uint32_t sanitize_word(uint32_t w) {
  if constexpr (std::is_same_v<T, float>) {
    return w == 0x80000000u ? 0u : w;
  } else {  // two 16-bit elements
    const uint32_t hi = (w & 0xFFFF0000u) == 0x80000000u ? 0xFFFF0000u : 0u;
    const uint32_t lo = (w & 0x0000FFFFu) == 0x00008000u ? 0x0000FFFFu : 0u;
    return w & ~(hi | lo);
  }
}

// A packed 16-byte vector of T with every -0.0 replaced by +0.0. Never equal to the sentinel in
// any word afterwards.
template <typename T>
__device__ __forceinline__ uint4 sanitize_v4(uint4 v) {
  v.x = sanitize_word<T>(v.x);
  v.y = sanitize_word<T>(v.y);
  v.z = sanitize_word<T>(v.z);
  v.w = sanitize_word<T>(v.w);
  return v;
}

// The poison of a failed poll: NaN in every element of T (f32 0x7FC00000, bf16 0x7FC0,
// f16 0x7E00), so a sum or an epilogue over it is NaN. Never the sentinel.
template <typename T>
__device__ __forceinline__ uint4 lamport_poison_v4() {
  const uint32_t w = std::is_same_v<T, float>           ? 0x7FC00000u
                     : std::is_same_v<T, __nv_bfloat16> ? 0x7FC07FC0u
                                                        : 0x7E007E00u;
  return make_uint4(w, w, w, w);
}

}  // namespace dev
}  // namespace nvc
