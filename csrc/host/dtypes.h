// Element access for host code by dtype code (0 f32, 1 bf16, 2 f16): loads widen to float32,
// stores round to nearest even (NaN stays NaN, subnormals exact).
#pragma once
#include <cstdint>

#include "../common/moe_layout.h"

namespace nvc {
namespace host {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kF8E4M3 = 3 };

inline int dtype_size(int dt) { return dt == kF32 ? 4 : dt == kF8E4M3 ? 1 : 2; }

// The conversions themselves are shared with the MoE code (bit-identical on host and device).
inline float bf16_to_f32(uint16_t h) { return moe_bf16_to_f32(h); }
inline uint16_t f32_to_bf16(float f) { return uint16_t(moe_f32_to_bf16(f)); }
inline float f16_to_f32(uint16_t h) { return moe_f16_to_f32(h); }
inline uint16_t f32_to_f16(float f) { return uint16_t(moe_f32_to_f16(f)); }

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

// v rounded to dt and widened again (what a store then a load gives).
inline float round_to(int dt, float v) {
  switch (dt) {
    case kF32: return v;
    case kBF16: return bf16_to_f32(f32_to_bf16(v));
    default: return f16_to_f32(f32_to_f16(v));
  }
}

}  // namespace host
}  // namespace nvc
