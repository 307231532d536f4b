// Launchers of the MoE kernels: grid moe_blocks(cfg) x kMoeThreads for all four kernels, a pure
// function of the config (identical on every rank); dynamic shared memory from the config
// (<= 41 KiB within moe_config_error's limits, so no opt-in attribute is needed).
#include "moe.h"

#include "../kernels/moe_combine.cuh"
#include "../kernels/moe_dispatch.cuh"

namespace nvc {
namespace cuda {
namespace {
bool usable(const CommView& v, const MoeConfig& c) {
  return moe_config_error(c) == nullptr && v.rank == c.rank && v.world == c.world;
}
}  // namespace

#ifdef NVC_PROBE
cudaError_t moe_probe_take(unsigned long long* out) { return dev::take_probes(out); }
#endif

cudaError_t moe_load_kernels() {
  cudaFuncAttributes a;
  const void* fns[] = {(const void*)moe::dispatch_send_kernel, (const void*)moe::dispatch_recv_kernel,
                       (const void*)moe::combine_send_kernel,
                       (const void*)moe::combine_recv_kernel<kMoeF32>,
                       (const void*)moe::combine_recv_kernel<kMoeBF16>,
                       (const void*)moe::combine_recv_kernel<kMoeF16>};
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
                              uint32_t* seq_out) {
  if (!usable(v, c) || !x || !topk_ids || !token_dest || (c.scale_cols > 0 && !x_scale))
    return cudaErrorInvalidValue;
  moe::DispatchSendArgs a{static_cast<const uint8_t*>(x), x_scale, topk_ids, num_tokens, token_dest,
                          seq_out};
  moe::dispatch_send_kernel<<<moe_blocks(c), kMoeThreads, moe::dispatch_send_smem(c), st>>>(v, c, a);
  return cudaGetLastError();
}

cudaError_t moe_dispatch_recv(const CommView& v, const MoeConfig& c, void* expert_x,
                              int32_t* expert_counts, float* expert_x_scale, int32_t* expert_src,
                              cudaStream_t st, const uint32_t* seq_in) {
  if (!usable(v, c) || !expert_x || !expert_counts || !expert_src ||
      (c.scale_cols > 0 && !expert_x_scale))
    return cudaErrorInvalidValue;
  moe::DispatchRecvArgs a{static_cast<uint8_t*>(expert_x), expert_counts, expert_x_scale, expert_src,
                          seq_in};
  moe::dispatch_recv_kernel<<<moe_blocks(c), kMoeThreads, moe::dispatch_recv_smem(c), st>>>(v, c, a);
  return cudaGetLastError();
}

cudaError_t moe_dispatch(const CommView& v, const MoeConfig& c, const void* x, const float* x_scale,
                         const int32_t* topk_ids, const int32_t* num_tokens, void* expert_x,
                         int32_t* expert_counts, float* expert_x_scale, int32_t* token_dest,
                         int32_t* expert_src, cudaStream_t st) {
  if (!usable(v, c) || !expert_x || !expert_counts || !expert_src || (c.scale_cols > 0 && !expert_x_scale))
    return cudaErrorInvalidValue;  // checked before SEND: never launch half a call
  cudaError_t e = moe_dispatch_send(v, c, x, x_scale, topk_ids, num_tokens, token_dest, st);
  if (e != cudaSuccess) return e;
  return moe_dispatch_recv(v, c, expert_x, expert_counts, expert_x_scale, expert_src, st);
}

cudaError_t moe_combine_send(const CommView& v, const MoeConfig& c, const void* expert_y,
                             int y_dtype, const int32_t* expert_src, const int32_t* expert_counts,
                             cudaStream_t st, uint32_t* seq_out) {
  if (!usable(v, c) || !moe_y_dtype_ok(y_dtype) || !expert_y || !expert_src || !expert_counts)
    return cudaErrorInvalidValue;
  moe::CombineSendArgs a{static_cast<const uint8_t*>(expert_y), expert_src, expert_counts, y_dtype,
                         seq_out};
  moe::combine_send_kernel<<<moe_blocks(c), kMoeThreads, moe::combine_send_smem(c), st>>>(v, c, a);
  return cudaGetLastError();
}

cudaError_t moe_combine_recv(const CommView& v, const MoeConfig& c, int y_dtype,
                             const float* topk_weights, const int32_t* token_dest, void* y,
                             cudaStream_t st, const uint32_t* seq_in) {
  if (!usable(v, c) || !moe_y_dtype_ok(y_dtype) || !topk_weights || !token_dest || !y)
    return cudaErrorInvalidValue;
  moe::CombineRecvArgs a{topk_weights, token_dest, static_cast<uint8_t*>(y), seq_in};
  const int g = moe_blocks(c);
  switch (y_dtype) {
    case kMoeF32: moe::combine_recv_kernel<kMoeF32><<<g, kMoeThreads, 0, st>>>(v, c, a); break;
    case kMoeBF16: moe::combine_recv_kernel<kMoeBF16><<<g, kMoeThreads, 0, st>>>(v, c, a); break;
    default: moe::combine_recv_kernel<kMoeF16><<<g, kMoeThreads, 0, st>>>(v, c, a); break;
  }
  return cudaGetLastError();
}

cudaError_t moe_combine(const CommView& v, const MoeConfig& c, const void* expert_y, int y_dtype,
                        const float* topk_weights, const int32_t* token_dest,
                        const int32_t* expert_src, const int32_t* expert_counts, void* y,
                        cudaStream_t st) {
  if (!usable(v, c) || !moe_y_dtype_ok(y_dtype) || !topk_weights || !token_dest || !y)
    return cudaErrorInvalidValue;
  cudaError_t e = moe_combine_send(v, c, expert_y, y_dtype, expert_src, expert_counts, st);
  if (e != cudaSuccess) return e;
  return moe_combine_recv(v, c, y_dtype, topk_weights, token_dest, y, st);
}

}  // namespace cuda
}  // namespace nvc
