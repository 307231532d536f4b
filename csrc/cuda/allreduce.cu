// Host side of the all-reduce kernels: validation, launch configuration, dispatch (the
// per-kernel launch code: allreduce_launch.h; the cluster-split fused one-shot's:
// allreduce_cluster.h; the float32-weight kernels: allreduce_wf32.cu). Protocols:
// csrc/kernels/allreduce_oneshot.cuh, allreduce_oneshot_cluster.cuh, allreduce_twoshot.cuh,
// allreduce_multicast.cuh, allreduce_local.cuh.
#include "allreduce.h"

#include <type_traits>

#include "allreduce_launch.h"

namespace nvc {
namespace cuda {
namespace {

using dev::ArTensors;
using dev::kArThreads;
using dev::RowCfg;
using ar_detail::kMaxFusedHidden;
using ar_detail::launch_fused;
using ar_detail::launch_one;
using ar_detail::load_fused_kernels;
using ar_detail::local_variant;
using ar_detail::prepare_all;

static_assert(kMaxArBlocks <= kMaxBlocks, "flag arrays are sized for kMaxBlocks blocks");
static_assert(kMaxArBlocks <= dev::kEpiMaxBlocks, "row configuration assumes at most this grid");

// 16-byte vectors per thread (x W stores for one-shot's push) that size the grids: the push is
// bound by each SM's store rate, so one-shot spreads small messages over one block per
// kArThreads stores (2 x H200: 16-64 KiB one-shot 5.0-5.7 -> 4.2-4.4 us with 1 instead of 4
// vectors per thread); two-shot measured best at 4 (1, 2 and 4 tried). -DNVC_AR_ONESHOT_VECS /
// -DNVC_AR_TWOSHOT_VECS override them for experiments (tests/cuda_harness builds).
#ifndef NVC_AR_ONESHOT_VECS
#define NVC_AR_ONESHOT_VECS 1
#endif
#ifndef NVC_AR_TWOSHOT_VECS
#define NVC_AR_TWOSHOT_VECS 4
#endif
constexpr int64_t kOneShotVecs = NVC_AR_ONESHOT_VECS;
constexpr int64_t kTwoShotVecs = NVC_AR_TWOSHOT_VECS;

// World size 1: blocks per SM of the local kernel's grid (several hide the epilogue's barrier).
constexpr int64_t kLocalBlocksPerSm = 4;

int elems_per_vec(int dtype) { return dtype == kF32 ? 4 : 8; }

int current_sm_count() {
  const int n = device_sm_count();
  return n > 0 ? n : 1;
}

// The call's kernel: plain, or fused with the weight's form (w_f32: a float32 weight, 16-bit T
// only; allreduce_wf32.cu) and FP8 output or not, each its own instantiation.
template <typename T>
cudaError_t launch_typed(const CommView& v, const ArTensors& t, bool fused, bool w_f32,
                         uint32_t desc, Strategy s, char* mc, int grid, cudaStream_t st,
                         int sm_count) {
  const RowCfg rc = dev::make_row_cfg(t.tokens, t.hidden, dev::Vec<T>::kElems);
  if (!fused) return launch_one<T, false>(v, t, rc, desc, s, mc, grid, st, sm_count);
  const bool quant = t.scale != nullptr;
  if constexpr (!std::is_same<T, float>::value) {
    if (w_f32)
      return ar_detail::launch_fused_wf32<T>(quant, v, t, rc, desc, s, mc, grid, st, sm_count);
  }
  return launch_fused<T, false>(quant, v, t, rc, desc, s, mc, grid, st, sm_count);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// The weight's form of a fused call: float32 with 16-bit x (a float32 x's weight is float32).
bool weight_f32(const AllReduceArgs& a) { return a.dtype != kF32 && a.weight_dtype == kF32; }

ArTensors tensors_of(const AllReduceArgs& a) {
  // The mean's divisor resolved here, once (0: hidden): the kernels divide by it whatever the
  // padding, so a zero-padded width costs them nothing.
  const int64_t n = a.norm_hidden > 0 ? a.norm_hidden : a.hidden;
  return ArTensors{a.x,      a.out,    a.residual, a.residual_out, a.weight,
                   a.tokens, a.hidden, a.eps,      a.scale,        n};
}

}  // namespace

size_t dtype_bytes(int dtype) { return dtype == kF32 ? 4 : 2; }
size_t oneshot_max_bytes(const CommView& v) { return v.lamport_slot; }
size_t twoshot_max_bytes(const CommView& v) { return v.max_message_bytes; }
int64_t max_fused_hidden(int) { return kMaxFusedHidden; }

int all_reduce_grid(int64_t tokens, int64_t hidden, int dtype, int world, Strategy s, bool fused,
                    int sm_count) {
  const int64_t nv = tokens * hidden / elems_per_vec(dtype);
  // Blocks by data volume (kOneShotVecs / kTwoShotVecs above), and for the fused epilogue at
  // least one block per iteration's worth of rows.
  const int64_t per_block =
      int64_t(kArThreads) * (s == Strategy::kOneShot ? kOneShotVecs : kTwoShotVecs);
  int64_t g = (nv * (world > 1 && s == Strategy::kOneShot ? world : 1) + per_block - 1) / per_block;
  if (fused) {
    const RowCfg rc = dev::make_row_cfg(tokens, hidden, elems_per_vec(dtype));
    const int64_t rows_per_iter = int64_t(kArThreads / rc.tpr) * rc.nr;
    const int64_t gr = (tokens + rows_per_iter - 1) / rows_per_iter;
    g = world == 1 ? gr : (gr > g ? gr : g);
  }
  const int64_t sms = sm_count < 1 ? 1 : sm_count;
  // World 1 never waits on other blocks, so its grid may exceed the SM count; the protocol
  // kernels spin-wait, so all their blocks must be resident.
  const int64_t cap = world == 1 ? sms * kLocalBlocksPerSm : (sms < kMaxArBlocks ? sms : kMaxArBlocks);
  return int(g < 1 ? 1 : (g > cap ? cap : g));
}

const char* all_reduce_check(const CommView& v, const AllReduceArgs& a, Strategy s) {
  if (v.world < 1 || v.world > kMaxWorld) return "world size out of range [1, 16]";
  if (v.rank < 0 || v.rank >= v.world) return "rank out of range";
  if (v.err == nullptr) return "CommView.err is null";
  if (a.dtype != kF32 && a.dtype != kBF16 && a.dtype != kF16) return "dtype must be f32, bf16 or f16";
  if (s != Strategy::kOneShot && s != Strategy::kTwoShot) return "unknown strategy";
  if (a.tokens < 0) return "tokens must be >= 0";
  if (a.hidden <= 0) return "hidden must be > 0";
  if (a.hidden % elems_per_vec(a.dtype) != 0)
    return "hidden must be a multiple of the 16-byte vector width (4 for f32, 8 for bf16/f16)";
  if (a.tokens > 0 && (a.x == nullptr || a.out == nullptr)) return "x and out must be non-null";
  if (!aligned16(a.x) || !aligned16(a.out)) return "x and out must be 16-byte aligned";
  const bool fused = a.residual != nullptr;
  if (fused) {
    if (a.residual_out == nullptr || a.weight == nullptr)
      return "fused call needs residual_out and weight";
    if (!aligned16(a.residual) || !aligned16(a.residual_out) || !aligned16(a.weight))
      return "residual, residual_out and weight must be 16-byte aligned";
    if (a.hidden > max_fused_hidden(a.dtype)) return "hidden too large for the fused kernel";
    if (a.weight_dtype != -1 && a.weight_dtype != a.dtype && a.weight_dtype != kF32)
      return "weight must have x's dtype or float32";
    if (a.norm_hidden < 0 || a.norm_hidden > a.hidden)
      return "norm_hidden must be in [1, hidden] (0: hidden)";
  } else if (a.scale != nullptr) {
    return "scale (FP8 output) needs a fused call (residual, residual_out, weight)";
  }
  if (a.tokens > (int64_t(1) << 40) / a.hidden) return "message too large";
  const size_t bytes = size_t(a.tokens) * size_t(a.hidden) * dtype_bytes(a.dtype);
  if (s == Strategy::kOneShot && bytes > oneshot_max_bytes(v))
    return "message larger than the one-shot Lamport slot";
  if (s == Strategy::kTwoShot && bytes > twoshot_max_bytes(v))
    return "message larger than max_message_bytes";
  return nullptr;
}

cudaError_t all_reduce(const CommView& v, const AllReduceArgs& a, Strategy s,
                       const void* multicast_base, cudaStream_t stream, int sm_count) {
  if (all_reduce_check(v, a, s) != nullptr) return cudaErrorInvalidValue;
  if (a.tokens == 0) return cudaSuccess;  // every rank skips alike: no counter moves
  const bool fused = a.residual != nullptr;
  const int grid = all_reduce_grid(a.tokens, a.hidden, a.dtype, v.world, s, fused, sm_count);
  const ArTensors t = tensors_of(a);
  // Bit 3 tells the quantised epilogue apart, so ranks disagreeing on it are reported.
  const uint32_t desc = make_desc(fused ? kOpAllReduceRms : kOpAllReduce, uint64_t(a.tokens),
                                  (uint64_t(a.hidden) << 4) | (uint64_t(a.scale != nullptr) << 3) |
                                      (uint64_t(a.dtype) << 1) | uint64_t(s == Strategy::kTwoShot));
  char* mc = const_cast<char*>(static_cast<const char*>(multicast_base));
  switch (a.dtype) {
    case kF32:
      return launch_typed<float>(v, t, fused, false, desc, s, mc, grid, stream, sm_count);
    case kBF16:
      return launch_typed<__nv_bfloat16>(v, t, fused, weight_f32(a), desc, s, mc, grid, stream,
                                         sm_count);
    default:
      return launch_typed<__half>(v, t, fused, weight_f32(a), desc, s, mc, grid, stream,
                                  sm_count);
  }
}

cudaError_t all_reduce_local_variant(const AllReduceArgs& a, bool rows, cudaStream_t stream,
                                     int sm_count) {
  if (a.residual == nullptr || a.tokens < 1) return cudaErrorInvalidValue;
  const ArTensors t = tensors_of(a);
  const bool q = a.scale != nullptr;
  const bool w32 = weight_f32(a);
  switch (a.dtype) {
    case kF32: return local_variant<float, false>(q, t, a.dtype, rows, stream, sm_count);
    case kBF16:
      return w32 ? ar_detail::local_variant_wf32<__nv_bfloat16>(q, t, a.dtype, rows, stream,
                                                                sm_count)
                 : local_variant<__nv_bfloat16, false>(q, t, a.dtype, rows, stream, sm_count);
    default:
      return w32 ? ar_detail::local_variant_wf32<__half>(q, t, a.dtype, rows, stream, sm_count)
                 : local_variant<__half, false>(q, t, a.dtype, rows, stream, sm_count);
  }
}

cudaError_t all_reduce_load_kernels() {
  for (cudaError_t e :
       {prepare_all<float, false>(), prepare_all<__nv_bfloat16, false>(),
        prepare_all<__half, false>(), load_fused_kernels<float, false>(),
        load_fused_kernels<__nv_bfloat16, false>(), load_fused_kernels<__half, false>(),
        ar_detail::load_fused_kernels_wf32<__nv_bfloat16>(),
        ar_detail::load_fused_kernels_wf32<__half>()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

#ifdef NVC_PROBE
cudaError_t probe_take(unsigned long long* out) { return dev::take_probes(out); }
#endif

cudaError_t all_reduce(const CommView& v, const AllReduceArgs& a, Strategy s,
                       const void* multicast_base, cudaStream_t stream) {
  return all_reduce(v, a, s, multicast_base, stream, current_sm_count());
}

}  // namespace cuda
}  // namespace nvc
