// Host ragged_dot / ragged_dot_swiglu and their 8-bit-weight forms (ragged_dot_host.h): per
// group with rows its weights widened to float32 once (8-bit: times their scale), then per
// row k outer and n inner (float32 row accumulators).
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

// The row loop of both entry points; widen(g, w, which) fills w [k * n] with group g's
// weights (which 0: rhs, 1: rhs2) as float32.
template <class Widen>
void rows_loop(const RaggedDotHostArgs& a, Widen widen) {
  const bool swiglu = a.rhs2 != nullptr;
  const size_t kn = size_t(a.k) * size_t(a.n);
  // the weights of a group with rows, widened once for all its rows
  std::vector<float> acc(size_t(a.n)), acc2(swiglu ? size_t(a.n) : 0), x(size_t(a.k)), w1(kn),
      w2(swiglu ? kn : 0);
  int64_t row = 0;  // the running sum of max(size, 0), clipped to m
  for (int64_t g = 0; g < a.g; ++g) {
    const int64_t end = std::min<int64_t>(row + std::max<int32_t>(a.group_sizes[g], 0), a.m);
    if (end > row) {
      widen(g, w1.data(), 0);
      if (swiglu) widen(g, w2.data(), 1);
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
}

// float8_e4m3fn bits -> float32, exact: bias 7, subnormals in units of 2^-9, 0x7F / 0xFF NaN.
float e4m3fn_to_f32(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 0x7;
  float v;
  if (e == 0xF && m == 0x7) v = std::nanf("");
  else if (e == 0) v = std::ldexp(float(m), -9);
  else v = std::ldexp(float(8 + m), e - 10);
  return (b & 0x80) ? -v : v;
}
}  // namespace

std::string ragged_dot(const RaggedDotHostArgs& a) {
  if (a.dtype < kF32 || a.dtype > kF16) return "operands must be float32, bfloat16 or float16";
  if (a.out_dtype != a.dtype && a.out_dtype != kF32)
    return "the result dtype must be the operands' or float32";
  if (a.m < 0 || a.k < 0 || a.n < 0 || a.g < 1) return "sizes must be >= 0 and g >= 1";
  const size_t kn = size_t(a.k) * size_t(a.n);
  rows_loop(a, [&](int64_t g, float* w, int which) {
    const void* src = which ? a.rhs2 : a.rhs;
    for (size_t i = 0; i < kn; ++i) w[i] = load_f32(src, a.dtype, size_t(g) * kn + i);
  });
  return "";
}

std::string ragged_dot_w8(const RaggedDotW8HostArgs& w8) {
  const RaggedDotHostArgs& a = w8.base;
  if (a.dtype != kBF16 && a.dtype != kF16) return "lhs must be bfloat16 or float16";
  if (a.out_dtype != a.dtype && a.out_dtype != kF32)
    return "the result dtype must be lhs's or float32";
  if (w8.w_dtype != kW8Int8 && w8.w_dtype != kW8E4M3)
    return "the weights must be int8 or float8_e4m3fn";
  if (w8.scale_mode < 0 || w8.scale_mode > 2) return "scale_mode must be 0, 1 or 2";
  if (a.m < 0 || a.k < 0 || a.n < 0 || a.g < 1) return "sizes must be >= 0 and g >= 1";
  const int64_t kb = (a.k + 127) / 128, nb = (a.n + 127) / 128;
  rows_loop(a, [&](int64_t g, float* w, int which) {
    const void* src = which ? a.rhs2 : a.rhs;
    const float* sc = which ? w8.scale2 : w8.scale;
    const int8_t* i8 = static_cast<const int8_t*>(src);
    const uint8_t* f8 = static_cast<const uint8_t*>(src);
    const size_t base = size_t(g) * size_t(a.k) * size_t(a.n);
    for (int64_t kk = 0; kk < a.k; ++kk) {
      for (int64_t j = 0; j < a.n; ++j) {
        const size_t i = size_t(kk) * size_t(a.n) + size_t(j);
        float v = w8.w_dtype == kW8Int8 ? float(i8[base + i]) : e4m3fn_to_f32(f8[base + i]);
        if (w8.scale_mode == 1) v *= sc[size_t(g) * size_t(a.n) + size_t(j)];
        else if (w8.scale_mode == 2)
          v *= sc[(size_t(g) * size_t(kb) + size_t(kk / 128)) * size_t(nb) + size_t(j / 128)];
        w[i] = v;
      }
    }
  });
  return "";
}

}  // namespace host
}  // namespace nvc
