// Host ragged_dot / ragged_dot_swiglu (ragged_dot_host.h): per group with rows its weights
// widened to float32 once, then per row k outer and n inner (float32 row accumulators).
#include "ragged_dot_host.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "dtypes.h"

namespace nvc {
namespace host {

namespace {
// n floats of row `row` of a [rows, n] array of dtype dt, widened.
void load_row(const void* p, int dt, int64_t row, int64_t n, float* dst) {
  const size_t base = size_t(row) * size_t(n);
  for (int64_t j = 0; j < n; ++j) dst[j] = load_f32(p, dt, base + size_t(j));
}
}  // namespace

std::string ragged_dot(const RaggedDotHostArgs& a) {
  if (a.dtype < kF32 || a.dtype > kF16) return "operands must be float32, bfloat16 or float16";
  if (a.out_dtype != a.dtype && a.out_dtype != kF32)
    return "the result dtype must be the operands' or float32";
  if (a.m < 0 || a.k < 0 || a.n < 0 || a.g < 1) return "sizes must be >= 0 and g >= 1";
  const bool swiglu = a.rhs2 != nullptr;
  const size_t kn = size_t(a.k) * size_t(a.n);
  // the weights of a group with rows, widened once for all its rows
  std::vector<float> acc(size_t(a.n)), acc2(swiglu ? size_t(a.n) : 0), x(size_t(a.k)), w1(kn),
      w2(swiglu ? kn : 0);
  int64_t row = 0;  // the running sum of max(size, 0), clipped to m
  for (int64_t g = 0; g < a.g; ++g) {
    const int64_t end = std::min<int64_t>(row + std::max<int32_t>(a.group_sizes[g], 0), a.m);
    if (end > row) {
      for (size_t i = 0; i < kn; ++i) w1[i] = load_f32(a.rhs, a.dtype, size_t(g) * kn + i);
      if (swiglu)
        for (size_t i = 0; i < kn; ++i) w2[i] = load_f32(a.rhs2, a.dtype, size_t(g) * kn + i);
    }
    for (int64_t r = row; r < end; ++r) {
      load_row(a.lhs, a.dtype, r, a.k, x.data());
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(acc2.begin(), acc2.end(), 0.f);
      for (int64_t kk = 0; kk < a.k; ++kk) {
        const float xv = x[size_t(kk)];
        const float* wr = &w1[size_t(kk) * size_t(a.n)];
        for (int64_t j = 0; j < a.n; ++j) acc[size_t(j)] += xv * wr[j];
        if (swiglu) {
          const float* ur = &w2[size_t(kk) * size_t(a.n)];
          for (int64_t j = 0; j < a.n; ++j) acc2[size_t(j)] += xv * ur[j];
        }
      }
      const size_t base = size_t(r) * size_t(a.n);
      for (int64_t j = 0; j < a.n; ++j) {
        float v = acc[size_t(j)];
        if (swiglu) v = v / (1.0f + std::exp(-v)) * acc2[size_t(j)];
        store_f32(a.out, a.out_dtype, base + size_t(j), v);
      }
    }
    row = end;
  }
  for (size_t i = size_t(row) * size_t(a.n); i < size_t(a.m) * size_t(a.n); ++i)
    store_f32(a.out, a.out_dtype, i, 0.f);
  return "";
}

}  // namespace host
}  // namespace nvc
