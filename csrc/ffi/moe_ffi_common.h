// Decoding shared by the host and CUDA MoE handlers: the MoeConfig of a rank context and the
// shape checks of every buffer against it (so a mismatched call fails before any launch).
#pragma once
#include <string>

#include "../common/moe_layout.h"
#include "ffi_common.h"

namespace nvc {

// RankContext::params of a MoE communicator: num_experts, top_k, max_tokens, hidden, dtype,
// scale_cols, max_in_flight[, slot_bytes] (set at registration; 7 values: slot_bytes 0).
inline ffi::Error moe_config_of(const RankContext& ctx, MoeConfig* c) {
  if (ctx.params.size() != 7 && ctx.params.size() != 8)
    return precondition("jax_nvcomm: communicator is not a MoECommunicator");
  *c = MoeConfig{ctx.view.world, ctx.view.rank, int(ctx.params[0]), int(ctx.params[1]),
                 int(ctx.params[2]), int(ctx.params[3]), int(ctx.params[4]), int(ctx.params[5]),
                 int(ctx.params[6]), ctx.params.size() == 8 ? ctx.params[7] : 0};
  if (const char* why = moe_config_error(*c)) return precondition(std::string("jax_nvcomm: ") + why);
  return ffi::Error::Success();
}

// A split half (moe_*_send / moe_*_recv) must move its call in one round: a SEND of several
// rounds cannot finish before its RECV runs (moe_layout.h BOUNDED SLOTS). The Python ops refuse
// it at trace time; this is the handlers' own check.
inline ffi::Error check_split_rounds(const MoeConfig& c, bool dispatch, int y_dtype = kMoeF32) {
  const int rounds = dispatch ? moe_dispatch_rounds(c) : moe_combine_rounds(c, y_dtype);
  if (rounds == 1) return ffi::Error::Success();
  return precondition(std::string("jax_nvcomm: ") + (dispatch ? "moe_dispatch" : "moe_combine") +
                      " split halves need the call in one round; this communicator's slots take " +
                      std::to_string(rounds) + " rounds (use the fused op or a larger max_buffer_bytes)");
}

inline ffi::Error expect_elems(const ffi::AnyBuffer& b, size_t n, const char* name) {
  if (b.element_count() != n)
    return precondition(std::string("jax_nvcomm: ") + name + " has " +
                        std::to_string(b.element_count()) + " elements, expected " +
                        std::to_string(n));
  return ffi::Error::Success();
}

// SEND side of a dispatch: the inputs.
inline ffi::Error check_dispatch_in(const MoeConfig& c, const ffi::AnyBuffer& x,
                                    const ffi::AnyBuffer& x_scale, const ffi::AnyBuffer& ids) {
  const size_t T = c.max_tokens, H = c.hidden, K = c.top_k, S = c.scale_cols;
  if (dtype_code(x.element_type()) != c.dtype)
    return precondition("jax_nvcomm: moe_dispatch: x dtype differs from the communicator's");
  if (auto e = expect_elems(x, T * H, "x"); e.failure()) return e;
  if (auto e = expect_elems(x_scale, T * S, "x_scale"); e.failure()) return e;
  return expect_elems(ids, T * K, "topk_ids");
}

// Rows of expert_x / expert_y as the call passes them: packed [P, H] when `packed` is given
// and the buffer has rank 2 (moe_layout.h PACKED EXPERT ROWS; *packed set), else [L, W*T, H].
inline size_t expert_rows_of(const MoeConfig& c, const ffi::AnyBuffer& b, bool* packed) {
  const bool p = packed != nullptr && b.dimensions().size() == 2;
  if (packed) *packed = p;
  return p ? moe_packed_rows(c) : moe_local_experts(c) * moe_expert_rows(c);
}

// RECV side of a dispatch: the output rows (and their scales, in the same form).
inline ffi::Error check_dispatch_out(const MoeConfig& c, const ffi::AnyBuffer& expert_x,
                                     bool* packed = nullptr,
                                     const ffi::AnyBuffer* expert_x_scale = nullptr) {
  if (dtype_code(expert_x.element_type()) != c.dtype)
    return precondition("jax_nvcomm: moe_dispatch: expert_x dtype differs from the communicator's");
  const size_t rows = expert_rows_of(c, expert_x, packed);
  if (expert_x_scale)
    if (auto e = expect_elems(*expert_x_scale, rows * size_t(c.scale_cols), "expert_x_scale");
        e.failure())
      return e;
  return expect_elems(expert_x, rows * size_t(c.hidden), "expert_x");
}

inline ffi::Error check_dispatch(const MoeConfig& c, const ffi::AnyBuffer& x,
                                 const ffi::AnyBuffer& x_scale, const ffi::AnyBuffer& ids,
                                 const ffi::AnyBuffer& expert_x, bool* packed = nullptr,
                                 const ffi::AnyBuffer* expert_x_scale = nullptr) {
  if (auto e = check_dispatch_in(c, x, x_scale, ids); e.failure()) return e;
  return check_dispatch_out(c, expert_x, packed, expert_x_scale);
}

// SEND side of a combine: expert rows and the handle's routing back.
inline ffi::Error check_combine_send(const MoeConfig& c, const ffi::AnyBuffer& expert_y,
                                     const ffi::AnyBuffer& expert_src,
                                     const ffi::AnyBuffer& counts, int* y_dtype) {
  const size_t H = c.hidden, L = moe_local_experts(c), R = moe_expert_rows(c);
  *y_dtype = dtype_code(expert_y.element_type());
  if (!moe_y_dtype_ok(*y_dtype))
    return precondition("jax_nvcomm: moe_combine: expert_y must be f32, bf16 or f16");
  if (auto e = expect_elems(expert_y, L * R * H, "expert_y"); e.failure()) return e;
  if (auto e = expect_elems(expert_src, L * R, "handle.expert_src"); e.failure()) return e;
  return expect_elems(counts, L, "handle.expert_counts");
}

// RECV side of a combine: weights, the handle's token_dest and y (its dtype = expert_y's).
inline ffi::Error check_combine_recv(const MoeConfig& c, const ffi::AnyBuffer& w,
                                     const ffi::AnyBuffer& token_dest, const ffi::AnyBuffer& y,
                                     int* y_dtype) {
  const size_t T = c.max_tokens, H = c.hidden, K = c.top_k;
  *y_dtype = dtype_code(y.element_type());
  if (!moe_y_dtype_ok(*y_dtype))
    return precondition("jax_nvcomm: moe_combine: y must be f32, bf16 or f16");
  if (auto e = expect_elems(y, T * H, "y"); e.failure()) return e;
  if (auto e = expect_elems(w, T * K, "topk_weights"); e.failure()) return e;
  return expect_elems(token_dest, T * K, "handle.token_dest");
}

inline ffi::Error check_combine(const MoeConfig& c, const ffi::AnyBuffer& expert_y,
                                const ffi::AnyBuffer& w, const ffi::AnyBuffer& token_dest,
                                const ffi::AnyBuffer& expert_src, const ffi::AnyBuffer& counts,
                                int* y_dtype, bool* packed = nullptr) {
  const size_t T = c.max_tokens, H = c.hidden, K = c.top_k;
  const size_t L = moe_local_experts(c), R = moe_expert_rows(c);
  *y_dtype = dtype_code(expert_y.element_type());
  if (!moe_y_dtype_ok(*y_dtype))
    return precondition("jax_nvcomm: moe_combine: expert_y must be f32, bf16 or f16");
  if (auto e = expect_elems(expert_y, expert_rows_of(c, expert_y, packed) * H, "expert_y");
      e.failure())
    return e;
  if (auto e = expect_elems(w, T * K, "topk_weights"); e.failure()) return e;
  if (auto e = expect_elems(token_dest, T * K, "handle.token_dest"); e.failure()) return e;
  if (auto e = expect_elems(expert_src, L * R, "handle.expert_src"); e.failure()) return e;
  return expect_elems(counts, L, "handle.expert_counts");
}

}  // namespace nvc
