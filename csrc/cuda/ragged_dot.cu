// The launcher of ragged_dot / ragged_dot_swiglu (ragged_dot.h): argument checks, the tile and
// split-K choice, dispatch to the instantiation of the operand family (ragged_dot_parts.h).
#include "ragged_dot.h"

#include <cstdint>

#include "ragged_dot_parts.h"

namespace nvc {
namespace cuda {

namespace {
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// 8-bit weights: the unit of the operand x weight dtype pair (ragged_dot_parts.h)
cudaError_t w8(const RaggedDotArgs& a, bool swiglu, int t, int c, cudaStream_t s) {
  const bool i8 = a.w_dtype == kWInt8;
  if (a.dtype == 1)
    return i8 ? rdot_parts::w8_bf16_i8(a, swiglu, t, c, s)
              : rdot_parts::w8_bf16_e4m3(a, swiglu, t, c, s);
  return i8 ? rdot_parts::w8_f16_i8(a, swiglu, t, c, s)
            : rdot_parts::w8_f16_e4m3(a, swiglu, t, c, s);
}
}  // namespace

const char* ragged_dot_check(const RaggedDotArgs& a, bool swiglu) {
  if (a.dtype != 1 && a.dtype != 2) return "operands must be bfloat16 or float16";
  if (a.out_dtype != a.dtype && a.out_dtype != 0)
    return "the result dtype must be the operands' or float32";
  if (a.m < 0 || a.k < 1 || a.n < 0) return "sizes must be m >= 0, k >= 1, n >= 0";
  if (a.k % 8 != 0 || a.n % 8 != 0) return "k and n must be multiples of 8";
  if (a.w_dtype != kW16) {
    if (a.w_dtype != kWInt8 && a.w_dtype != kWE4M3)
      return "the weights must be 16-bit (the operands' dtype), int8 or float8_e4m3fn";
    // 8-bit weights: TMA rows of n bytes (a multiple of 16), K steps of 16
    if (a.k % 16 != 0 || a.n % 16 != 0)
      return "k and n must be multiples of 16 for 8-bit weights";
    if (a.scale_mode < 0 || a.scale_mode > 2) return "scale_mode must be 0, 1 or 2";
    if (a.scale_mode != 0 && (a.scale == nullptr || (swiglu && a.scale2 == nullptr)))
      return "the scales are missing for scale_mode 1 or 2";
  }
  if (a.g < 1 || a.g > 1024) return "the group count must be in [1, 1024]";
  if (a.m > (int64_t(1) << 20)) return "m must be at most 2^20 rows";
  if (a.k > (int64_t(1) << 30) || a.n > (int64_t(1) << 20)) return "k must be < 2^30, n <= 2^20";
  // the item count (kernels/ragged_dot.cuh) must fit int32: (m / 16 + g) x ceil(n / 64)
  if ((a.m / 16 + a.g) * ((a.n + 63) / 64) >= (int64_t(1) << 31)) return "m x n too large";
  if (swiglu != (a.rhs2 != nullptr)) return "rhs2 (w_up) is given exactly for swiglu";
  if (!aligned16(a.lhs) || !aligned16(a.rhs) || !aligned16(a.rhs2) || !aligned16(a.out))
    return "lhs, rhs and out must be 16-byte aligned";
  if (a.group_sizes == nullptr && a.m > 0) return "group_sizes is missing";
  return nullptr;
}

int64_t ragged_dot_counter_bytes(int64_t m, int64_t n, int64_t g) {
  const int64_t items = ((n + 63) / 64) * (m / 16 + (g < m ? g : m) + 1);
  return (items * 4 + 255) / 256 * 256;
}

int ragged_dot_planes(int64_t bytes, int64_t m, int64_t n, int64_t g, bool swiglu) {
  const int64_t plane = m * n * 4 * (swiglu ? 2 : 1);
  const int64_t room = bytes - ragged_dot_counter_bytes(m, n, g);
  if (plane <= 0 || room < 2 * plane) return 0;
  const int64_t k = room / plane;
  return int(k > kRaggedDotMaxSplits ? kRaggedDotMaxSplits : k);
}

int64_t ragged_dot_workspace_bytes(int64_t m, int64_t n, int64_t g, bool swiglu) {
  constexpr int64_t kBudget = int64_t(32) << 20;
  const int64_t plane = m * n * 4 * (swiglu ? 2 : 1);
  if (plane <= 0) return 0;
  int64_t k = kBudget / plane;
  if (k > kRaggedDotMaxSplits) k = kRaggedDotMaxSplits;
  if (k < 2) return 0;
  return ragged_dot_counter_bytes(m, n, g) + k * plane;
}

int ragged_dot_rows_tile(const RaggedDotArgs& a) {
  // rows per group with rows: at least m / g on average; random routing spreads the counts to
  // ~3x that. R 16 while that fits (a group past 16 rows takes a second chunk, which re-reads
  // its weights, mostly from L2: still the faster tile at ~8 rows per group), else R 64.
  const int64_t avg = (a.m + a.g - 1) / (a.g > 0 ? a.g : 1);
  return 3 * avg <= 32 ? 16 : 64;
}

int ragged_dot_tile(const RaggedDotArgs& a, bool) {
  return ragged_dot_rows_tile(a) > 16 ? kRows64 : kRows16;
}

int ragged_dot_cluster(const RaggedDotArgs&) {
  // split-K over a cluster cost more (its reduction, the co-scheduling of the cluster's blocks)
  // than the better balance gained at every decode shape measured but one (ragged_dot_family.cuh)
  return 1;
}

cudaError_t ragged_dot(const RaggedDotArgs& a, cudaStream_t s) {
  if (ragged_dot_check(a, false) != nullptr) return cudaErrorInvalidValue;
  const int t = ragged_dot_tile(a, false), c = ragged_dot_cluster(a);
  if (a.w_dtype != kW16) return w8(a, false, t, c, s);
  return a.dtype == 1 ? rdot_parts::bf16(a, t, c, s) : rdot_parts::f16(a, t, c, s);
}

cudaError_t ragged_dot_swiglu(const RaggedDotArgs& a, cudaStream_t s) {
  if (ragged_dot_check(a, true) != nullptr) return cudaErrorInvalidValue;
  const int t = ragged_dot_tile(a, true), c = ragged_dot_cluster(a);
  if (a.w_dtype != kW16) return w8(a, true, t, c, s);
  return a.dtype == 1 ? rdot_parts::swiglu_bf16(a, t, c, s) : rdot_parts::swiglu_f16(a, t, c, s);
}

cudaError_t ragged_dot_load_kernels() {
  for (cudaError_t e : {rdot_parts::load_bf16(), rdot_parts::load_f16(),
                        rdot_parts::load_swiglu_bf16(), rdot_parts::load_swiglu_f16(),
                        rdot_parts::load_w8_bf16_i8(), rdot_parts::load_w8_bf16_e4m3(),
                        rdot_parts::load_w8_f16_i8(), rdot_parts::load_w8_f16_e4m3()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace nvc
