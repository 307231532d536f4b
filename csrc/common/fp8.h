// Per-row FP8 (float8_e4m3fn) quantisation of the fused all-reduce + RMSNorm epilogue, shared by
// the CUDA kernels (rmsnorm.cuh) and the host backend (collectives_host.cc), so both compute the
// same scale from the same row amax and round the same way.
//
// Definition (jax_nvcomm.all_reduce_rms_norm_quant, docs/API.md), per row of float32 normed,
// every operation one float32 operation rounded to nearest even:
//   amax  = max_h |normed[h]|, NaN-propagating (a NaN anywhere makes amax NaN)
//   m     = max(amax, kAmaxFloor)                NaN-propagating
//   scale = m * kInvFp8Max                       kInvFp8Max = float32(1 / 448)
//   inv   = 448 / m                              IEEE division, once per row
//   q[h]  = e4m3fn(normed[h] * inv)              then round to nearest even into e4m3fn
// i.e. q = round(normed / scale) up to float32 rounding (a few ulps before the FP8 rounding).
// Multiplications rather than a division per element: cheaper in the kernel, and what XLA's
// "xla" strategy computes as written (XLA rewrites a division by a broadcast scalar into a
// multiplication by its reciprocal, so "normed / scale" would not be an IEEE division there).
// kAmaxFloor = 448 * 2^-126, so scale >= 2^-126 (fl(1/448) > 1/448), the smallest normal
// float32, and inv <= 2^126: never zero, subnormal or infinite; a row of zeros gets q = 0.
// amax is taken on raw bits: for non-negative floats (sign bit cleared) unsigned integer order is
// float order and every NaN pattern exceeds +inf, so an integer max is exact, order-free and
// NaN-propagating (fmaxf would drop NaN).
// Range: for finite normed, |normed * inv| <= 448 * (1 + 2^-24)^2 < 464, which rounds to at
// most 448: no value saturates. Non-finite rows: amax NaN -> scale, inv NaN -> q NaN in the
// whole row; amax +inf (only from an infinite weight) -> scale inf, inv 0 -> q NaN where
// normed is inf (inf * 0), 0 elsewhere. The conversion maps NaN to 0x7F (e4m3fn has no inf), and would map |v| > 464 to
// NaN as XLA and ml_dtypes do (never reached from the epilogue).
#pragma once
#include <cstdint>

#include "layout.h"  // NVC_HD

namespace nvc {

constexpr float kFp8E4M3Max = 448.0f;
constexpr float kInvFp8E4M3Max = 1.0f / 448.0f;   // rounded to float32 once, here
constexpr uint32_t kAmaxFloorBits = 0x04E00000u;  // 448 * 2^-126 = 1.75 * 2^-118

NVC_HD uint32_t abs_bits_f32(uint32_t u) { return u & 0x7FFFFFFFu; }
NVC_HD uint32_t max_u32(uint32_t a, uint32_t b) { return a > b ? a : b; }

// Round-to-nearest-even float32 -> float8_e4m3fn (bits), as XLA's convert and ml_dtypes do.
// The host backend's conversion; the kernels use the hardware cvt.rn.satfinite.e4m3x2.f32,
// which agrees on every value the epilogue produces (|v| < 464, or NaN).
NVC_HD uint8_t f32_bits_to_e4m3fn(uint32_t u) {
  const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7FFFFFFFu;
  if (a > 0x43E80000u) return 0x7Fu;  // NaN, or above 464 (rounds past 448): NaN
  if (a < 0x3C800000u) {              // below 2^-6: e4m3 subnormal, units of 2^-9
    const uint32_t e = a >> 23;
    if (e < 117) return uint8_t(sign);  // below 2^-10: rounds to zero
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u, sh = 141 - e;  // sh in [21, 24]
    uint32_t r = m >> sh;
    const uint32_t rest = m & ((1u << sh) - 1), half = 1u << (sh - 1);
    if (rest > half || (rest == half && (r & 1u))) ++r;
    return uint8_t(sign | r);  // r == 8 is the smallest normal, encoded alike
  }
  uint32_t h = (a >> 20) - (120u << 3);  // exponent rebiased 127 -> 7, top 3 mantissa bits
  const uint32_t rest = a & 0xFFFFFu;
  if (rest > 0x80000u || (rest == 0x80000u && (h & 1u))) ++h;
  return uint8_t(sign | h);
}

}  // namespace nvc
