// Host all-gather and all-reduce (see collectives_host.h for the protocol).
#include "collectives_host.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "../common/fp8.h"
#include "dtypes.h"
#include "host_sync.h"

namespace nvc {
namespace host {

std::string all_gather(const CommView& v, const void* in, void* out, size_t bytes) {
  const uint32_t desc = make_desc(kOpAllGather, bytes);
  const uint64_t seq = begin_call(v);
  const size_t half_bytes = v.flag_half;
  if (bytes * size_t(v.world) > v.max_message_bytes || bytes > half_bytes)
    return record_error(v, kErrCapacity, desc, v.rank, seq, bytes);
  std::memcpy(v.half(v.rank, seq), in, bytes);
  publish(v, seq, desc, 0);
  std::string err = wait_all(v, seq, desc, 0);
  if (!err.empty()) return err;
  for (int r = 0; r < v.world; ++r)
    std::memcpy(static_cast<char*>(out) + size_t(r) * bytes, v.half(r, seq), bytes);
  end_call(v, seq);
  return "";
}

std::string all_reduce(const CommView& v, const AllReduceArgs& a) {
  const bool fused = a.residual != nullptr;
  const size_t n = size_t(a.tokens) * size_t(a.hidden);
  const size_t bytes = n * size_t(dtype_size(a.dtype));
  const bool quant = fused && a.scale != nullptr;
  // 0x100 tells the quantised epilogue apart, so ranks disagreeing on it are reported.
  const uint32_t desc = make_desc(fused ? kOpAllReduceRms : kOpAllReduce, bytes,
                                  uint64_t(a.dtype) | (quant ? 0x100u : 0u));
  const uint64_t seq = begin_call(v);
  if (bytes > v.max_message_bytes || bytes > v.flag_half)
    return record_error(v, kErrCapacity, desc, v.rank, seq, bytes);
  std::memcpy(v.half(v.rank, seq), a.x, bytes);
  publish(v, seq, desc, 0);
  std::string err = wait_all(v, seq, desc, 0);
  if (!err.empty()) return err;

  std::vector<const void*> src(v.world);
  for (int r = 0; r < v.world; ++r) src[r] = v.half(r, seq);
  std::vector<float> row(size_t(a.hidden));
  const int wdt = a.weight_dtype < 0 ? a.dtype : a.weight_dtype;
  const int64_t norm_cols = a.norm_hidden > 0 ? a.norm_hidden : a.hidden;
  for (int64_t t = 0; t < a.tokens; ++t) {
    const size_t base = size_t(t) * size_t(a.hidden);
    for (int64_t h = 0; h < a.hidden; ++h) {
      float acc = 0.0f;
      for (int r = 0; r < v.world; ++r) acc += load_f32(src[r], a.dtype, base + h);
      row[h] = acc;
    }
    if (!fused) {
      for (int64_t h = 0; h < a.hidden; ++h) store_f32(a.out, a.dtype, base + h, row[h]);
      continue;
    }
    // The sum is rounded to x's dtype before the residual add, as the CUDA kernels do
    // (kernels/rmsnorm.cuh) and as `lax.psum(x) + residual` computes it.
    float ss = 0.0f;
    for (int64_t h = 0; h < a.hidden; ++h) {
      float r = round_to(a.dtype, row[h]) + load_f32(a.residual, a.dtype, base + h);
      row[h] = r;
      ss += r * r;
      store_f32(a.residual_out, a.dtype, base + h, r);
    }
    const float inv = 1.0f / std::sqrt(ss / float(norm_cols) + a.eps);
    if (!quant) {
      for (int64_t h = 0; h < a.hidden; ++h)
        store_f32(a.out, a.dtype, base + h, row[h] * inv * load_f32(a.weight, wdt, h));
      continue;
    }
    // FP8 output (fp8.h): the same float32 normed, kept in float32; NaN-propagating amax on bits.
    uint32_t amax = 0;
    for (int64_t h = 0; h < a.hidden; ++h) {
      const float nv = row[h] * inv * load_f32(a.weight, wdt, h);
      row[h] = nv;
      uint32_t u;
      std::memcpy(&u, &nv, 4);
      amax = max_u32(amax, abs_bits_f32(u));
    }
    amax = max_u32(amax, kAmaxFloorBits);
    float m;
    std::memcpy(&m, &amax, 4);
    a.scale[t] = m * kInvFp8E4M3Max;
    const float qmul = kFp8E4M3Max / m;
    uint8_t* q = static_cast<uint8_t*>(a.out) + base;
    for (int64_t h = 0; h < a.hidden; ++h) {
      const float v = row[h] * qmul;
      uint32_t u;
      std::memcpy(&u, &v, 4);
      q[h] = f32_bits_to_e4m3fn(u);
    }
  }
  end_call(v, seq);
  return "";
}

}  // namespace host
}  // namespace nvc
