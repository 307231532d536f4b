// The operands, results and attributes of every FFI target, in the order jax_nvcomm's Python
// passes them (jax_nvcomm/_shard.py ffi_call): one function per op, used by both backends, so
// that the host and CUDA handlers of one op cannot drift apart. Each backend puts its own
// prefix in front (host_bind: the slot operand; cuda_bind: the stream and device ordinal)
// and may append attributes only it takes (the CUDA all-reduces' "strategy").
// Every op ends its operands with the order token and its results with the next one
// (ffi_common.h OrderIn / OrderOut: never read, never written). Each function takes the
// prefix as a function returning a fresh binding (bindings cannot be copied or moved outside
// their own chain).
#pragma once
#include <cstdint>

#include "ffi_common.h"

namespace nvc {
namespace sig {

using Seq = ffi::Buffer<ffi::U32>;  // split MoE: the SEND's call number, for its RECV

inline auto host_bind() { return ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>(); }  // slot

// x -> out
template <class P> auto all_reduce(P prefix) {
  return prefix().template Arg<ffi::AnyBuffer>()   // x
      .template Arg<ffi::AnyBuffer>()       // order_in
      .template Ret<ffi::AnyBuffer>()       // out
      .template Ret<ffi::AnyBuffer>()       // order_out
      .template Attr<int64_t>("comm_id");
}
// x -> gathered (same operands and results as the all-reduce)
template <class P> auto all_gather(P prefix) { return all_reduce(prefix); }

// x, residual, weight (the operands of both fused all-reduces)
template <class P> auto rms_operands(P prefix) {
  return prefix().template Arg<ffi::AnyBuffer>()   // x
      .template Arg<ffi::AnyBuffer>()       // residual
      .template Arg<ffi::AnyBuffer>()       // weight
      .template Arg<ffi::AnyBuffer>();      // order_in
}

// x, residual, weight -> normed, residual_out. weight: x's dtype or float32; norm_hidden: the
// mean's divisor, the row width before the caller's zero padding (1..hidden).
template <class P> auto all_reduce_rms(P prefix) {
  return rms_operands(prefix)
      .template Ret<ffi::AnyBuffer>()       // normed
      .template Ret<ffi::AnyBuffer>()       // residual_out
      .template Ret<ffi::AnyBuffer>()       // order_out
      .template Attr<int64_t>("comm_id")
      .template Attr<float>("eps")
      .template Attr<int64_t>("norm_hidden");
}

// x, residual, weight -> q (float8_e4m3fn [T, H]), scale (float32 [T, 1]), residual_out
template <class P> auto all_reduce_rms_quant(P prefix) {
  return rms_operands(prefix)
      .template Ret<ffi::AnyBuffer>()       // q
      .template Ret<ffi::Buffer<ffi::F32>>()  // scale
      .template Ret<ffi::AnyBuffer>()       // residual_out
      .template Ret<ffi::AnyBuffer>()       // order_out
      .template Attr<int64_t>("comm_id")
      .template Attr<float>("eps")
      .template Attr<int64_t>("norm_hidden");  // as all_reduce_rms
}

// x, x_scale, topk_ids, num_tokens -> expert_x, expert_counts, expert_x_scale, and the handle
// (token_dest, expert_src)
template <class P> auto moe_dispatch(P prefix) {
  return prefix().template Arg<ffi::AnyBuffer>()   // x
      .template Arg<ffi::AnyBuffer>()       // x_scale
      .template Arg<ffi::AnyBuffer>()       // topk_ids
      .template Arg<ffi::Buffer<ffi::S32>>()  // num_tokens
      .template Arg<ffi::AnyBuffer>()       // order_in
      .template Ret<ffi::AnyBuffer>()       // expert_x
      .template Ret<ffi::AnyBuffer>()       // expert_counts
      .template Ret<ffi::AnyBuffer>()       // expert_x_scale
      .template Ret<ffi::AnyBuffer>()       // token_dest (handle)
      .template Ret<ffi::AnyBuffer>()       // expert_src (handle)
      .template Ret<ffi::AnyBuffer>()       // order_out
      .template Attr<int64_t>("comm_id");
}

// expert_y, topk_weights, handle (token_dest, expert_src, expert_counts) -> y
template <class P> auto moe_combine(P prefix) {
  return prefix().template Arg<ffi::AnyBuffer>()   // expert_y
      .template Arg<ffi::AnyBuffer>()       // topk_weights
      .template Arg<ffi::AnyBuffer>()       // handle.token_dest
      .template Arg<ffi::AnyBuffer>()       // handle.expert_src
      .template Arg<ffi::AnyBuffer>()       // handle.expert_counts
      .template Arg<ffi::AnyBuffer>()       // order_in
      .template Ret<ffi::AnyBuffer>()       // y
      .template Ret<ffi::AnyBuffer>()       // order_out
      .template Attr<int64_t>("comm_id");
}

// x, x_scale, topk_ids, num_tokens -> token_dest (handle), seq
template <class P> auto moe_dispatch_send(P prefix) {
  return prefix().template Arg<ffi::AnyBuffer>()   // x
      .template Arg<ffi::AnyBuffer>()       // x_scale
      .template Arg<ffi::AnyBuffer>()       // topk_ids
      .template Arg<ffi::Buffer<ffi::S32>>()  // num_tokens
      .template Arg<ffi::AnyBuffer>()       // order_in
      .template Ret<ffi::AnyBuffer>()       // token_dest (handle)
      .template Ret<Seq>()                  // seq, for the RECV
      .template Ret<ffi::AnyBuffer>()       // order_out
      .template Attr<int64_t>("comm_id");
}

// seq -> expert_x, expert_counts, expert_x_scale, expert_src (handle)
template <class P> auto moe_dispatch_recv(P prefix) {
  return prefix().template Arg<Seq>()              // seq of the SEND
      .template Arg<ffi::AnyBuffer>()       // order_in
      .template Ret<ffi::AnyBuffer>()       // expert_x
      .template Ret<ffi::AnyBuffer>()       // expert_counts
      .template Ret<ffi::AnyBuffer>()       // expert_x_scale
      .template Ret<ffi::AnyBuffer>()       // expert_src (handle)
      .template Ret<ffi::AnyBuffer>()       // order_out
      .template Attr<int64_t>("comm_id");
}

// expert_y, handle (expert_src, expert_counts) -> seq
template <class P> auto moe_combine_send(P prefix) {
  return prefix().template Arg<ffi::AnyBuffer>()   // expert_y
      .template Arg<ffi::AnyBuffer>()       // handle.expert_src
      .template Arg<ffi::AnyBuffer>()       // handle.expert_counts
      .template Arg<ffi::AnyBuffer>()       // order_in
      .template Ret<Seq>()                  // seq, for the RECV
      .template Ret<ffi::AnyBuffer>()       // order_out
      .template Attr<int64_t>("comm_id");
}

// seq, topk_weights, handle.token_dest -> y
template <class P> auto moe_combine_recv(P prefix) {
  return prefix().template Arg<Seq>()              // seq of the SEND
      .template Arg<ffi::AnyBuffer>()       // topk_weights
      .template Arg<ffi::AnyBuffer>()       // handle.token_dest
      .template Arg<ffi::AnyBuffer>()       // order_in
      .template Ret<ffi::AnyBuffer>()       // y
      .template Ret<ffi::AnyBuffer>()       // order_out
      .template Attr<int64_t>("comm_id");
}

// x, num_rows -> gathered, offsets, total
template <class P> auto all_gather_v(P prefix) {
  return prefix().template Arg<ffi::AnyBuffer>()   // x
      .template Arg<ffi::Buffer<ffi::S32>>()  // num_rows
      .template Arg<ffi::AnyBuffer>()       // order_in
      .template Ret<ffi::AnyBuffer>()       // gathered
      .template Ret<ffi::Buffer<ffi::S32>>()  // offsets
      .template Ret<ffi::Buffer<ffi::S32>>()  // total
      .template Ret<ffi::AnyBuffer>()       // order_out
      .template Attr<int64_t>("comm_id")
      .template Attr<int64_t>("zero_tail");
}

// y, offsets -> this rank's rows
template <class P> auto reduce_scatter_v(P prefix) {
  return prefix().template Arg<ffi::AnyBuffer>()   // y
      .template Arg<ffi::Buffer<ffi::S32>>()  // offsets
      .template Arg<ffi::AnyBuffer>()       // order_in
      .template Ret<ffi::AnyBuffer>()       // out
      .template Ret<ffi::AnyBuffer>()       // order_out
      .template Attr<int64_t>("comm_id");
}

// operand, output, input_offsets, send_sizes, output_offsets, recv_sizes -> out (aliases
// output: jax_nvcomm/ragged.py passes input_output_aliases). Offsets and sizes: int32 or int64,
// all four alike (ragged_layout.h).
template <class P> auto ragged_all_to_all(P prefix) {
  return prefix().template Arg<ffi::AnyBuffer>()   // operand
      .template Arg<ffi::AnyBuffer>()       // output
      .template Arg<ffi::AnyBuffer>()       // input_offsets
      .template Arg<ffi::AnyBuffer>()       // send_sizes
      .template Arg<ffi::AnyBuffer>()       // output_offsets
      .template Arg<ffi::AnyBuffer>()       // recv_sizes
      .template Arg<ffi::AnyBuffer>()       // order_in
      .template Ret<ffi::AnyBuffer>()       // out
      .template Ret<ffi::AnyBuffer>()       // order_out
      .template Attr<int64_t>("comm_id")
      .template Attr<int64_t>("chunk_bytes");  // 0: single round; > 0: chunked, slot bytes
}

// Local ops (no communicator, no order token: pure functions of their operands, which XLA may
// merge or drop like any other): the plain binding for the host targets.
inline auto local_bind() { return ffi::Ffi::Bind(); }

// lhs [M, K], rhs [G, K, N], group_sizes int32 [G] -> out [M, N]
template <class P> auto ragged_dot(P prefix) {
  return prefix().template Arg<ffi::AnyBuffer>()   // lhs
      .template Arg<ffi::AnyBuffer>()       // rhs
      .template Arg<ffi::Buffer<ffi::S32>>()  // group_sizes
      .template Ret<ffi::AnyBuffer>();      // out
}

// lhs [M, K], w_gate [G, K, F], w_up [G, K, F], group_sizes int32 [G] -> out [M, F]
template <class P> auto ragged_dot_swiglu(P prefix) {
  return prefix().template Arg<ffi::AnyBuffer>()   // lhs
      .template Arg<ffi::AnyBuffer>()       // w_gate
      .template Arg<ffi::AnyBuffer>()       // w_up
      .template Arg<ffi::Buffer<ffi::S32>>()  // group_sizes
      .template Ret<ffi::AnyBuffer>();      // out
}

// The CUDA targets' forms: the same operands, then the split-K workspace as a second result
// (uint8, cuda/ragged_dot.h ragged_dot_workspace_bytes; at least 16 bytes).
template <class P> auto ragged_dot_cuda(P prefix) {
  return ragged_dot(prefix).template Ret<ffi::AnyBuffer>();  // workspace
}
template <class P> auto ragged_dot_swiglu_cuda(P prefix) {
  return ragged_dot_swiglu(prefix).template Ret<ffi::AnyBuffer>();  // workspace
}

// 8-bit expert weights (CUDA; the host targets bind their own form in
// host_ragged_dot_w8_handlers.cc): lhs [M, K] bf16 / f16, rhs [G, K, N] int8 or
// float8_e4m3fn, rhs_scale float32 (scale_mode 0: [1]; 1: [G, N]; 2: [G, ceil(K / 128),
// ceil(N / 128)]), group_sizes int32 [G] -> out [M, N], the split-K workspace
template <class P> auto ragged_dot_w8_cuda(P prefix) {
  return prefix().template Arg<ffi::AnyBuffer>()   // lhs
      .template Arg<ffi::AnyBuffer>()       // rhs
      .template Arg<ffi::AnyBuffer>()       // rhs_scale
      .template Arg<ffi::Buffer<ffi::S32>>()  // group_sizes
      .template Ret<ffi::AnyBuffer>()       // out
      .template Ret<ffi::AnyBuffer>()       // workspace
      .template Attr<int64_t>("scale_mode");
}
// lhs, w_gate, w_up (w_gate's shape and dtype), gate_scale, up_scale, group_sizes -> out,
// the split-K workspace
template <class P> auto ragged_dot_swiglu_w8_cuda(P prefix) {
  return prefix().template Arg<ffi::AnyBuffer>()   // lhs
      .template Arg<ffi::AnyBuffer>()       // w_gate
      .template Arg<ffi::AnyBuffer>()       // w_up
      .template Arg<ffi::AnyBuffer>()       // gate_scale
      .template Arg<ffi::AnyBuffer>()       // up_scale
      .template Arg<ffi::Buffer<ffi::S32>>()  // group_sizes
      .template Ret<ffi::AnyBuffer>()       // out
      .template Ret<ffi::AnyBuffer>()       // workspace
      .template Attr<int64_t>("scale_mode");
}

}  // namespace sig
}  // namespace nvc
