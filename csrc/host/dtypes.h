// Scalar conversions between float32 and the 16-bit / 8-bit storage types for host code
// (no CUDA headers): round-to-nearest-even, NaN kept NaN, subnormals exact.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace nvc {
namespace host {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kF8E4M3 = 3 };

inline int dtype_size(int dt) { return dt == kF32 ? 4 : dt == kF8E4M3 ? 1 : 2; }

inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float bf16_to_f32(uint16_t h) { return u2f(uint32_t(h) << 16); }
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f2u(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1F) return u2f(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    float v = std::ldexp(float(man), -24);
    return sign ? -v : v;
  }
  return u2f(sign | ((exp + 112u) << 23) | (man << 13));
}
inline uint16_t f32_to_f16(float f) {
  uint32_t u = f2u(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return uint16_t(sign | 0x7E00u);
  if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {  // below the smallest normal 2^-14: subnormal, RNE on 2^-24 units
    float v = u2f(a) * 16777216.0f;  // exact scaling by 2^24
    float r = std::nearbyint(v);     // default rounding mode: ties to even
    return uint16_t(sign | uint16_t(r));
  }
  uint32_t e = (a >> 23) - 112u, m = a & 0x7FFFFFu;
  uint32_t h = (e << 10) | (m >> 13);
  uint32_t rest = m & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return uint16_t(sign | h);
}

inline float load_f32(const void* p, int dt, size_t i) {
  switch (dt) {
    case kF32: return static_cast<const float*>(p)[i];
    case kBF16: return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}
inline void store_f32(void* p, int dt, size_t i, float v) {
  switch (dt) {
    case kF32: static_cast<float*>(p)[i] = v; break;
    case kBF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
    default: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
  }
}

}  // namespace host
}  // namespace nvc
