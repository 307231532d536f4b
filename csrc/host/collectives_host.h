// Host-memory all-gather and all-reduce (+ fused residual/RMSNorm) for CPU devices.
// Pull model over the flag protocol of host_sync.h: each rank copies its input into its own
// buffer's half (seq parity), raises its flag in every peer, waits for all flags, then reads
// every peer's half directly. One phase, every call waits for every peer.
// All-reduce sums in float32 in rank order 0..W-1 starting from +0.0 (so -0.0 inputs behave
// as in the sanitised CUDA kernels), identical on every rank.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "../common/layout.h"

namespace nvc {
namespace host {

// out[W * bytes]: rank r's `bytes` at offset r * bytes. Returns "" or an error message.
std::string all_gather(const CommView& v, const void* in, void* out, size_t bytes);

struct AllReduceArgs {
  const void* x; void* out;
  const void* residual; void* residual_out; const void* weight;  // residual == nullptr: plain
  int64_t tokens, hidden; int dtype; float eps;
  // Fused only: non-null => out is float8_e4m3fn q and scale float32 [tokens], from the float32
  // normed (not rounded to dtype first), as csrc/common/fp8.h defines them.
  float* scale = nullptr;
  // Fused only: weight's dtype code (dtype or 0 = float32; -1: dtype) and the mean's divisor,
  // the row width before the caller's zero padding (0: hidden).
  int weight_dtype = -1;
  int64_t norm_hidden = 0;
};
std::string all_reduce(const CommView& v, const AllReduceArgs& a);

}  // namespace host
}  // namespace nvc
