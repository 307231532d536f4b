// MoE dispatch / combine on host memory for CPU devices: the protocol, buffer layout, handle
// and arithmetic of the CUDA kernels (common/moe_layout.h, kernels/moe_*.cuh), run by one thread
// per rank. Results are bitwise identical to the CUDA backend (same row order, same float32 fma
// sequence in k order, same RNE conversions from moe_layout.h).
//
// Differences from CUDA, none visible in the results:
// - a SEND is one "block": it raises moe_flag(s, me, 0) only, RECV waits for that one flag of
//   every source (the CUDA grid raises moe_blocks(cfg) flags).
// - Split calls (seq_out / seq_in non-null) as in cuda/moe.h: the SEND writes its call's seq,
//   the RECV checks it; null = the fused call's checks.
// - Synchronisation: flags and Ctrl::seq through GCC/Clang __atomic builtins (acquire/release,
//   lock-free 64-bit, valid between threads and between processes mapping the same memory);
//   payload with plain memcpy ordered by those release/acquire pairs.
// - Bounded waits: std::chrono::steady_clock against CommView::timeout_ns, yielding the CPU
//   while spinning (many ranks on few cores).
// - Errors are returned as text ("" = success) naming the rank, the peer and the seq, and also
//   recorded in *v.err when non-null (first error wins). A sender that finds bad input raises the
//   poison flag in every rank before returning, so peers fail at once instead of timing out.
//
// v.bufs[r]: rank r's MoE buffer (moe_buffer_bytes(cfg) bytes, Ctrl zeroed before first use) as
// mapped in this process; v.rank == cfg.rank. Array shapes as in cuda/moe.h; all host pointers.
// num_tokens: pointer to the int32 scalar, null = max_tokens. Plain C++17.
// Bounded slots (cfg.slot_bytes > 0, moe_layout.h BOUNDED SLOTS): moe_dispatch_host /
// moe_combine_host run moe_*_rounds(cfg) rounds; a split half (seq pointer given) must be the
// call's one round; `round` selects the SEND's (and the combine RECV's) tokens.
#pragma once
#include <cstdint>
#include <string>

#include "../common/layout.h"
#include "../common/moe_layout.h"

namespace nvc {
namespace host {

std::string moe_dispatch_host(const CommView& v, const MoeConfig& cfg, const void* x,
                              const float* x_scale, const int32_t* topk_ids,
                              const int32_t* num_tokens, void* expert_x, int32_t* expert_counts,
                              float* expert_x_scale, int32_t* token_dest, int32_t* expert_src,
                              bool packed = false);
std::string moe_dispatch_send_host(const CommView& v, const MoeConfig& cfg, const void* x,
                                   const float* x_scale, const int32_t* topk_ids,
                                   const int32_t* num_tokens, int32_t* token_dest,
                                   uint32_t* seq_out = nullptr, int round = 0);
std::string moe_dispatch_recv_host(const CommView& v, const MoeConfig& cfg, void* expert_x,
                                   int32_t* expert_counts, float* expert_x_scale,
                                   int32_t* expert_src, const uint32_t* seq_in = nullptr,
                                   bool packed = false);

std::string moe_combine_host(const CommView& v, const MoeConfig& cfg, const void* expert_y,
                             int y_dtype, const float* topk_weights, const int32_t* token_dest,
                             const int32_t* expert_src, const int32_t* expert_counts, void* y,
                             bool packed = false);
std::string moe_combine_send_host(const CommView& v, const MoeConfig& cfg, const void* expert_y,
                                  int y_dtype, const int32_t* expert_src,
                                  const int32_t* expert_counts, uint32_t* seq_out = nullptr,
                                  bool packed = false, int round = 0);
std::string moe_combine_recv_host(const CommView& v, const MoeConfig& cfg, int y_dtype,
                                  const float* topk_weights, const int32_t* token_dest, void* y,
                                  const uint32_t* seq_in = nullptr, int round = 0);

}  // namespace host
}  // namespace nvc
