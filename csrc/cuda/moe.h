// Launch API of MoE dispatch / combine (protocol, layout and handle: common/moe_layout.h;
// kernels: kernels/moe_dispatch.cuh, kernels/moe_combine.cuh).
//
// v: the MoE communicator's view (bufs[] = every rank's MoE buffer of moe_buffer_bytes(cfg),
// Ctrl zeroed once at allocation; v.rank == cfg.rank). Pointers are device pointers; the
// launchers validate the config, enqueue kernels on `stream` and return cudaGetLastError() (or
// cudaErrorInvalidValue for a bad config / missing pointer). No allocation, no host sync, no
// host-side per-call state: capturable into CUDA graphs.
//
// One call = SEND then RECV on one stream. moe_dispatch / moe_combine enqueue both (fused); the
// split entry points enqueue one half, so other work can run between them: up to
// cfg.max_in_flight SENDs may be outstanding, RECVs come in the order of their SENDs. A split
// SEND writes its call's seq to *seq_out (device uint32 scalar), which its RECV takes as seq_in;
// with seq_out / seq_in null a SEND/RECV pair behaves as the fused call (moe_layout.h).
// Bounded slots (cfg.slot_bytes > 0, moe_layout.h BOUNDED SLOTS): moe_dispatch / moe_combine
// enqueue moe_*_rounds(cfg) rounds; a split half of more than one round is refused
// (cudaErrorInvalidValue); `round` (SEND/RECV pairs without seq, as the fused call's fallback
// runs them) selects the round's tokens.
//
// Device-detected errors (expert id out of range or repeated, num_tokens outside [0, T], a peer
// that never arrives or runs another call) are written to *v.err and the kernel traps.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "../common/layout.h"
#include "../common/moe_layout.h"

namespace nvc {
namespace cuda {

// Call once per device (current device) at communicator creation, before any MoE call:
// - loads the MoE kernels now: with CUDA lazy module loading (the default) the first launch of a
//   kernel can wait for the device to go idle, which stalls behind a spinning RECV;
// - gives every MoE kernel the same shared-memory carveout (max shared): an SM changes its split
//   only when idle, so with RECV blocks spinning on every SM (several ranks per GPU) a SEND that
//   wants another split is never scheduled and the call times out.
// Both matter when several ranks share a GPU; harmless otherwise.
cudaError_t moe_load_kernels();
#ifdef NVC_PROBE
// Timing experiments only (-DNVC_PROBE): the MoE kernels' phase probe sums on this device
// (kernels/common.cuh dev::g_probe of this file's kernels), then zeroes them.
cudaError_t moe_probe_take(unsigned long long* out);
#endif

// x [T,H] of cfg.dtype; x_scale [T,S] f32 (null iff S == 0); topk_ids [T,K] int32;
// num_tokens: device int32 scalar (null = T). Outputs: expert_x [L, W*T, H] of cfg.dtype,
// expert_counts [L], expert_x_scale [L, W*T, S] (null iff S == 0), handle token_dest [T,K],
// handle expert_src [L, W*T]. packed: expert_x [P, H] and expert_x_scale [P, S] in the packed
// form instead (moe_layout.h PACKED EXPERT ROWS, P = moe_packed_rows(cfg)).
cudaError_t moe_dispatch(const CommView& v, const MoeConfig& cfg, const void* x, const float* x_scale,
                         const int32_t* topk_ids, const int32_t* num_tokens, void* expert_x,
                         int32_t* expert_counts, float* expert_x_scale, int32_t* token_dest,
                         int32_t* expert_src, cudaStream_t stream, bool packed = false);
cudaError_t moe_dispatch_send(const CommView& v, const MoeConfig& cfg, const void* x,
                              const float* x_scale, const int32_t* topk_ids,
                              const int32_t* num_tokens, int32_t* token_dest, cudaStream_t stream,
                              uint32_t* seq_out = nullptr, int round = 0);
cudaError_t moe_dispatch_recv(const CommView& v, const MoeConfig& cfg, void* expert_x,
                              int32_t* expert_counts, float* expert_x_scale, int32_t* expert_src,
                              cudaStream_t stream, const uint32_t* seq_in = nullptr,
                              bool packed = false);

// expert_y [L, W*T, H] of y_dtype (kMoeF32 / kMoeBF16 / kMoeF16); topk_weights [T,K] f32;
// token_dest, expert_src, expert_counts: the dispatch's handle; y [T,H] of y_dtype.
// packed: expert_y [P, H] in the packed form (moe_layout.h PACKED EXPERT ROWS).
cudaError_t moe_combine(const CommView& v, const MoeConfig& cfg, const void* expert_y, int y_dtype,
                        const float* topk_weights, const int32_t* token_dest,
                        const int32_t* expert_src, const int32_t* expert_counts, void* y,
                        cudaStream_t stream, bool packed = false);
cudaError_t moe_combine_send(const CommView& v, const MoeConfig& cfg, const void* expert_y,
                             int y_dtype, const int32_t* expert_src, const int32_t* expert_counts,
                             cudaStream_t stream, uint32_t* seq_out = nullptr,
                             bool packed = false, int round = 0);
cudaError_t moe_combine_recv(const CommView& v, const MoeConfig& cfg, int y_dtype,
                             const float* topk_weights, const int32_t* token_dest, void* y,
                             cudaStream_t stream, const uint32_t* seq_in = nullptr, int round = 0);

}  // namespace cuda
}  // namespace nvc
