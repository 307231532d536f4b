// Launchers of the MoE kernels: grid moe_grid (moe_grid_blocks of the config and the GPU's SMs)
// x kMoeThreads for every kernel; dynamic shared memory from the config
// (<= 41 KiB within moe_config_error's limits, so no opt-in attribute is needed).
#include "moe.h"

#include <algorithm>

#include "../kernels/moe_combine.cuh"
#include "../kernels/moe_dispatch.cuh"
#include "../kernels/moe_local.cuh"
#include "device_cache.h"

namespace nvc {
namespace cuda {
namespace {
bool usable(const CommView& v, const MoeConfig& c) {
  return moe_config_error(c) == nullptr && v.rank == c.rank && v.world == c.world;
}
// The grid of every MoE kernel of this call (moe_layout.h moe_grid_blocks): at most the GPU's
// SMs (one block of every MoE kernel fits an SM: kMoeThreads threads, launch bounds, <= 41 KiB
// of shared memory, so a cooperative launch of that many always fits), divided among the ranks
// of this process on this GPU (virtual ranks: every rank's blocks resident at once).
int moe_grid(const CommView& v, const MoeConfig& c) {
  int cap = device_sm_count();
  if (v.context_ranks > 1) cap /= v.context_ranks;
  return moe_grid_blocks(c, cap);
}
// Bounded slots (moe_layout.h BOUNDED SLOTS): a fused call of several rounds is that many calls
// of the protocol back to back on the stream, each a SEND kernel and a RECV kernel (the *_rounds
// kernels) advancing the counters as a call does; a call of one round is the whole-call path
// (same layout); a split half must be one round.
// A fused call's kernel (SEND then RECV in one launch): its RECV half waits for the flags of
// its own kernel's blocks, so the launch is cooperative: all moe_grid blocks are resident
// together or the kernel does not start. Ranks of one process on one GPU (v.context_ranks > 1,
// the harnesses' virtual ranks) also wait for each other's blocks with no preemption between
// them: the one-kernel call is used only when all their grids fit on the SMs at once
// (fused_fits); otherwise the call runs as its two kernels (SEND, then RECV), which never wait
// inside a SEND. Both forms use the same buffers, flags and counters.
template <class SendArgs, class RecvArgs>
bool fused_fits(void (*kernel)(CommView, MoeConfig, SendArgs, RecvArgs), size_t smem,
                const CommView& v, const MoeConfig& c) {
  if (v.context_ranks <= 1) return true;
  // the SM count cached per device; the occupancy asked each time (smem follows the config)
  const int resident = resident_blocks(reinterpret_cast<const void*>(kernel), kMoeThreads, smem);
  if (resident <= 0) return false;  // a query failed
  return int64_t(v.context_ranks) * moe_grid(v, c) <= int64_t(resident);
}
template <class SendArgs, class RecvArgs>
cudaError_t launch_fused(void (*kernel)(CommView, MoeConfig, SendArgs, RecvArgs), size_t smem,
                         cudaStream_t st, const CommView& v, const MoeConfig& c,
                         const SendArgs& sa, const RecvArgs& ra) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(moe_grid(v, c)));
  cfg.blockDim = dim3(kMoeThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, v, c, sa, ra);
  return e != cudaSuccess ? e : cudaGetLastError();
}
}  // namespace

#ifdef NVC_PROBE
cudaError_t moe_probe_take(unsigned long long* out) { return dev::take_probes(out); }
#endif

cudaError_t moe_load_kernels() {
  cudaFuncAttributes a;
  const void* fns[] = {(const void*)moe::dispatch_send_kernel, (const void*)moe::dispatch_recv_kernel,
                       (const void*)moe::dispatch_kernel, (const void*)moe::combine_kernel<kMoeF32>,
                       (const void*)moe::combine_kernel<kMoeBF16>,
                       (const void*)moe::combine_kernel<kMoeF16>,
                       (const void*)moe::combine_send_kernel,
                       (const void*)moe::combine_recv_kernel<kMoeF32>,
                       (const void*)moe::combine_recv_kernel<kMoeBF16>,
                       (const void*)moe::combine_recv_kernel<kMoeF16>,
                       (const void*)moe::dispatch_send_rounds_kernel,
                       (const void*)moe::dispatch_recv_rounds_kernel,
                       (const void*)moe::combine_send_rounds_kernel,
                       (const void*)moe::combine_recv_rounds_kernel<kMoeF32>,
                       (const void*)moe::combine_recv_rounds_kernel<kMoeBF16>,
                       (const void*)moe::combine_recv_rounds_kernel<kMoeF16>,
                       (const void*)moe::dispatch_local_kernel,
                       (const void*)moe::combine_local_kernel<kMoeF32>,
                       (const void*)moe::combine_local_kernel<kMoeBF16>,
                       (const void*)moe::combine_local_kernel<kMoeF16>};
  for (const void* f : fns) {
    if (cudaError_t e = cudaFuncGetAttributes(&a, f); e != cudaSuccess) return e;
    // One shared-memory carveout for every MoE kernel: an SM changes its L1/shared split only
    // when idle, so with spinning RECV blocks on every SM a SEND that wants another split would
    // never be scheduled (seen with 8 ranks on one GPU).
    if (cudaError_t e = cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             int(cudaSharedmemCarveoutMaxShared));
        e != cudaSuccess)
      return e;
  }
  return cudaSuccess;
}

cudaError_t moe_dispatch_send(const CommView& v, const MoeConfig& c, const void* x,
                              const float* x_scale, const int32_t* topk_ids,
                              const int32_t* num_tokens, int32_t* token_dest, cudaStream_t st,
                              uint32_t* seq_out, int round) {
  if (!usable(v, c) || !x || !topk_ids || !token_dest || (c.scale_cols > 0 && !x_scale))
    return cudaErrorInvalidValue;
  const int rounds = moe_dispatch_rounds(c);
  if ((seq_out != nullptr && rounds != 1) || round < 0 || round >= rounds)
    return cudaErrorInvalidValue;
  moe::DispatchSendArgs a{static_cast<const uint8_t*>(x), x_scale, topk_ids, num_tokens, token_dest,
                          seq_out};
  const int g = moe_grid(v, c);
  if (rounds == 1) {  // the whole call (one bounded round has regions of max_tokens rows too)
    moe::dispatch_send_kernel<<<g, kMoeThreads, moe::dispatch_whole_send_smem(c), st>>>(v, c, a);
  } else {
    moe::dispatch_round_args(c, round, &a, nullptr);
    moe::dispatch_send_rounds_kernel<<<g, kMoeThreads, moe::dispatch_send_smem(c), st>>>(v, c, a);
  }
  return cudaGetLastError();
}

cudaError_t moe_dispatch_recv(const CommView& v, const MoeConfig& c, void* expert_x,
                              int32_t* expert_counts, float* expert_x_scale, int32_t* expert_src,
                              cudaStream_t st, const uint32_t* seq_in, bool packed) {
  if (!usable(v, c) || !expert_x || !expert_counts || !expert_src ||
      (c.scale_cols > 0 && !expert_x_scale))
    return cudaErrorInvalidValue;
  const int rounds = moe_dispatch_rounds(c);
  if (seq_in != nullptr && rounds != 1) return cudaErrorInvalidValue;
  moe::DispatchRecvArgs a{static_cast<uint8_t*>(expert_x), expert_counts, expert_x_scale, expert_src,
                          seq_in, packed};
  const int g = moe_grid(v, c);
  const size_t smem = moe::dispatch_recv_smem(c);
  if (rounds == 1) {
    moe::dispatch_recv_kernel<<<g, kMoeThreads, smem, st>>>(v, c, a);
  } else {
    moe::dispatch_round_args(c, 0, nullptr, &a);
    moe::dispatch_recv_rounds_kernel<<<g, kMoeThreads, smem, st>>>(v, c, a);
  }
  return cudaGetLastError();
}

cudaError_t moe_dispatch(const CommView& v, const MoeConfig& c, const void* x, const float* x_scale,
                         const int32_t* topk_ids, const int32_t* num_tokens, void* expert_x,
                         int32_t* expert_counts, float* expert_x_scale, int32_t* token_dest,
                         int32_t* expert_src, cudaStream_t st, bool packed) {
  if (!usable(v, c) || !expert_x || !expert_counts || !expert_src || (c.scale_cols > 0 && !expert_x_scale))
    return cudaErrorInvalidValue;  // checked before SEND: never launch half a call
  const int rounds = moe_dispatch_rounds(c);
  if (rounds > 1) {  // bounded slots: each round its SEND and RECV kernels (two launches)
    for (int r = 0; r < rounds; ++r) {
      cudaError_t e = moe_dispatch_send(v, c, x, x_scale, topk_ids, num_tokens, token_dest, st,
                                        nullptr, r);
      if (e == cudaSuccess)
        e = moe_dispatch_recv(v, c, expert_x, expert_counts, expert_x_scale, expert_src, st,
                              nullptr, packed);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }
  if (moe::local_fits(c)) {  // world 1: one kernel, no slot, no flags (kernels/moe_local.cuh)
    moe::DispatchSendArgs sa{static_cast<const uint8_t*>(x), x_scale, topk_ids, num_tokens,
                             token_dest, nullptr};
    moe::DispatchRecvArgs ra{static_cast<uint8_t*>(expert_x), expert_counts, expert_x_scale,
                             expert_src, nullptr, packed};
    moe::dispatch_local_kernel<<<moe_grid(v, c), kMoeThreads, moe::local_smem(c), st>>>(v, c, sa, ra);
    return cudaGetLastError();
  }
  // SEND and RECV in one kernel (dispatch_kernel); the split ops launch them separately
  const size_t smem = std::max(moe::dispatch_whole_send_smem(c), moe::dispatch_recv_smem(c));
  if (!fused_fits(moe::dispatch_kernel, smem, v, c)) {
    cudaError_t e = moe_dispatch_send(v, c, x, x_scale, topk_ids, num_tokens, token_dest, st);
    if (e != cudaSuccess) return e;
    return moe_dispatch_recv(v, c, expert_x, expert_counts, expert_x_scale, expert_src, st,
                             nullptr, packed);
  }
  moe::DispatchSendArgs sa{static_cast<const uint8_t*>(x), x_scale, topk_ids, num_tokens,
                           token_dest, nullptr};
  moe::DispatchRecvArgs ra{static_cast<uint8_t*>(expert_x), expert_counts, expert_x_scale,
                           expert_src, nullptr, packed};
  return launch_fused(moe::dispatch_kernel, smem, st, v, c, sa, ra);
}

cudaError_t moe_combine_send(const CommView& v, const MoeConfig& c, const void* expert_y,
                             int y_dtype, const int32_t* expert_src, const int32_t* expert_counts,
                             cudaStream_t st, uint32_t* seq_out, bool packed, int round) {
  if (!usable(v, c) || !moe_y_dtype_ok(y_dtype) || !expert_y || !expert_src || !expert_counts)
    return cudaErrorInvalidValue;
  const int rounds = moe_combine_rounds(c, y_dtype);
  if ((seq_out != nullptr && rounds != 1) || round < 0 || round >= rounds)
    return cudaErrorInvalidValue;
  moe::CombineSendArgs a{static_cast<const uint8_t*>(expert_y), expert_src, expert_counts, y_dtype,
                         seq_out, packed};
  const int g = moe_grid(v, c);
  const size_t smem = moe::combine_send_smem(c);
  if (rounds == 1) {  // the whole call (a bounded call of one round has the same landing rows)
    moe::combine_send_kernel<<<g, kMoeThreads, smem, st>>>(v, c, a);
  } else {
    moe::combine_round_args(c, y_dtype, round, &a);
    moe::combine_send_rounds_kernel<<<g, kMoeThreads, smem, st>>>(v, c, a);
  }
  return cudaGetLastError();
}

cudaError_t moe_combine_recv(const CommView& v, const MoeConfig& c, int y_dtype,
                             const float* topk_weights, const int32_t* token_dest, void* y,
                             cudaStream_t st, const uint32_t* seq_in, int round) {
  if (!usable(v, c) || !moe_y_dtype_ok(y_dtype) || !topk_weights || !token_dest || !y)
    return cudaErrorInvalidValue;
  const int rounds = moe_combine_rounds(c, y_dtype);
  if ((seq_in != nullptr && rounds != 1) || round < 0 || round >= rounds)
    return cudaErrorInvalidValue;
  moe::CombineRecvArgs a{topk_weights, token_dest, static_cast<uint8_t*>(y), seq_in};
  moe::combine_round_args(c, y_dtype, round, &a);
  const int g = moe_grid(v, c);
  const bool r1 = rounds == 1;
  switch (y_dtype) {
    case kMoeF32:
      if (r1) moe::combine_recv_kernel<kMoeF32><<<g, kMoeThreads, 0, st>>>(v, c, a);
      else moe::combine_recv_rounds_kernel<kMoeF32><<<g, kMoeThreads, 0, st>>>(v, c, a);
      break;
    case kMoeBF16:
      if (r1) moe::combine_recv_kernel<kMoeBF16><<<g, kMoeThreads, 0, st>>>(v, c, a);
      else moe::combine_recv_rounds_kernel<kMoeBF16><<<g, kMoeThreads, 0, st>>>(v, c, a);
      break;
    default:
      if (r1) moe::combine_recv_kernel<kMoeF16><<<g, kMoeThreads, 0, st>>>(v, c, a);
      else moe::combine_recv_rounds_kernel<kMoeF16><<<g, kMoeThreads, 0, st>>>(v, c, a);
      break;
  }
  return cudaGetLastError();
}

cudaError_t moe_combine(const CommView& v, const MoeConfig& c, const void* expert_y, int y_dtype,
                        const float* topk_weights, const int32_t* token_dest,
                        const int32_t* expert_src, const int32_t* expert_counts, void* y,
                        cudaStream_t st, bool packed) {
  if (!usable(v, c) || !moe_y_dtype_ok(y_dtype) || !topk_weights || !token_dest || !y)
    return cudaErrorInvalidValue;
  if (!expert_y || !expert_src || !expert_counts) return cudaErrorInvalidValue;
  const int rounds = moe_combine_rounds(c, y_dtype);
  if (rounds > 1) {  // bounded slots: each round its SEND and RECV kernels (two launches)
    for (int r = 0; r < rounds; ++r) {
      cudaError_t e = moe_combine_send(v, c, expert_y, y_dtype, expert_src, expert_counts, st,
                                       nullptr, packed, r);
      if (e == cudaSuccess)
        e = moe_combine_recv(v, c, y_dtype, topk_weights, token_dest, y, st, nullptr, r);
      if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }
  // SEND and RECV in one kernel (combine_kernel); the split ops launch them separately
  moe::CombineSendArgs sa{static_cast<const uint8_t*>(expert_y), expert_src, expert_counts,
                          y_dtype, nullptr, packed};
  moe::CombineRecvArgs ra{topk_weights, token_dest, static_cast<uint8_t*>(y), nullptr};
  if (moe::local_fits(c)) {  // world 1: one kernel reading expert_y's rows (kernels/moe_local.cuh)
    auto* local = y_dtype == kMoeF32    ? moe::combine_local_kernel<kMoeF32>
                  : y_dtype == kMoeBF16 ? moe::combine_local_kernel<kMoeBF16>
                                        : moe::combine_local_kernel<kMoeF16>;
    local<<<moe_grid(v, c), kMoeThreads, moe::local_smem(c), st>>>(v, c, sa, ra);
    return cudaGetLastError();
  }
  const size_t smem = moe::combine_send_smem(c);
  auto* kernel = y_dtype == kMoeF32    ? moe::combine_kernel<kMoeF32>
                 : y_dtype == kMoeBF16 ? moe::combine_kernel<kMoeBF16>
                                       : moe::combine_kernel<kMoeF16>;
  if (!fused_fits(kernel, smem, v, c)) {
    cudaError_t e = moe_combine_send(v, c, expert_y, y_dtype, expert_src, expert_counts, st,
                                     nullptr, packed);
    if (e != cudaSuccess) return e;
    return moe_combine_recv(v, c, y_dtype, topk_weights, token_dest, y, st);
  }
  return launch_fused(kernel, smem, st, v, c, sa, ra);
}

}  // namespace cuda
}  // namespace nvc
