// Host side of the all-reduce kernels: validation, launch configuration, dispatch.
// Protocols: csrc/kernels/allreduce_oneshot.cuh, allreduce_twoshot.cuh, allreduce_multicast.cuh.
#include "allreduce.h"

#include <atomic>

#include "../kernels/allreduce_multicast.cuh"
#include "../kernels/allreduce_oneshot.cuh"
#include "../kernels/allreduce_twoshot.cuh"

namespace nvc {
namespace cuda {
namespace {

using dev::ArTensors;
using dev::kArThreads;
using dev::RowCfg;

// Fused rows keep float32 r in dynamic shared memory: hidden * 4 bytes for one row.
constexpr int64_t kMaxFusedHidden = 32768;
constexpr int kMaxDynSmem = int(kMaxFusedHidden * 4);

int elems_per_vec(int dtype) { return dtype == kF32 ? 4 : 8; }

int current_sm_count() {
  static std::atomic<int> cache[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (dev >= 0 && dev < 64) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int n = 1;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n < 1) n = 1;
  if (dev >= 0 && dev < 64) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

// Opt a kernel in to more than 48 KiB of dynamic shared memory, once per (kernel, device). A
// function attribute, no stream work: fine outside and inside CUDA-graph capture.
template <auto kKernel>
void allow_smem(int bytes) {
  static std::atomic<uint64_t> done{0};
  if (bytes <= 48 * 1024) return;
  int dev = 0;
  cudaGetDevice(&dev);
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if ((done.load(std::memory_order_relaxed) & bit) != 0) return;
  if (cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDynSmem) ==
      cudaSuccess)
    done.fetch_or(bit, std::memory_order_relaxed);
}

template <typename T, bool kFused>
void launch_one(const CommView& v, const ArTensors& t, const RowCfg& rc, uint32_t desc,
                Strategy s, char* mc, int grid, cudaStream_t st) {
  const int smem = kFused ? int(dev::rmsnorm_smem_bytes(rc, dev::Vec<T>::kElems)) : 0;
  if (s == Strategy::kOneShot) {
    if (mc == nullptr) {
      allow_smem<dev::oneshot_kernel<T, kFused>>(smem);
      dev::oneshot_kernel<T, kFused><<<grid, kArThreads, smem, st>>>(v, t, rc, desc);
    } else {
      allow_smem<dev::oneshot_mc_kernel<T, kFused>>(smem);
      dev::oneshot_mc_kernel<T, kFused><<<grid, kArThreads, smem, st>>>(v, t, rc, desc, mc);
    }
  } else {
    if (mc == nullptr) {
      allow_smem<dev::twoshot_kernel<T, kFused>>(smem);
      dev::twoshot_kernel<T, kFused><<<grid, kArThreads, smem, st>>>(v, t, rc, desc);
    } else {
      allow_smem<dev::twoshot_mc_kernel<T, kFused>>(smem);
      dev::twoshot_mc_kernel<T, kFused><<<grid, kArThreads, smem, st>>>(v, t, rc, desc, mc);
    }
  }
}

template <typename T>
void launch_typed(const CommView& v, const ArTensors& t, bool fused, uint32_t desc, Strategy s,
                  char* mc, int grid, cudaStream_t st) {
  const RowCfg rc = dev::make_row_cfg(t.hidden, dev::Vec<T>::kElems);
  if (fused)
    launch_one<T, true>(v, t, rc, desc, s, mc, grid, st);
  else
    launch_one<T, false>(v, t, rc, desc, s, mc, grid, st);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

size_t dtype_bytes(int dtype) { return dtype == kF32 ? 4 : 2; }
size_t oneshot_max_bytes(const CommView& v) { return v.lamport_slot; }
size_t twoshot_max_bytes(const CommView& v) { return v.max_message_bytes; }
int64_t max_fused_hidden(int) { return kMaxFusedHidden; }

int all_reduce_grid(int64_t tokens, int64_t hidden, int dtype, int world, Strategy s, bool fused,
                    int sm_count) {
  const int64_t nv = tokens * hidden / elems_per_vec(dtype);
  const int64_t per_block = int64_t(kArThreads) * 4;  // ~4 vectors (x W stores) per thread
  int64_t g = s == Strategy::kOneShot ? (nv * world + per_block - 1) / per_block
                                      : (nv + per_block - 1) / per_block;
  if (fused) {
    const RowCfg rc = dev::make_row_cfg(hidden, elems_per_vec(dtype));
    const int64_t rows_per_iter = kArThreads / rc.tpr;
    const int64_t gr = (tokens + rows_per_iter - 1) / rows_per_iter;
    if (gr > g) g = gr;
  }
  const int64_t cap = sm_count < kMaxArBlocks ? (sm_count < 1 ? 1 : sm_count) : kMaxArBlocks;
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
  ArTensors t{a.x, a.out, a.residual, a.residual_out, a.weight, a.tokens, a.hidden, a.eps};
  const uint32_t desc = make_desc(fused ? kOpAllReduceRms : kOpAllReduce, uint64_t(a.tokens),
                                  (uint64_t(a.hidden) << 4) | (uint64_t(a.dtype) << 1) |
                                      uint64_t(s == Strategy::kTwoShot));
  char* mc = const_cast<char*>(static_cast<const char*>(multicast_base));
  switch (a.dtype) {
    case kF32: launch_typed<float>(v, t, fused, desc, s, mc, grid, stream); break;
    case kBF16: launch_typed<__nv_bfloat16>(v, t, fused, desc, s, mc, grid, stream); break;
    default: launch_typed<__half>(v, t, fused, desc, s, mc, grid, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t all_reduce(const CommView& v, const AllReduceArgs& a, Strategy s,
                       const void* multicast_base, cudaStream_t stream) {
  return all_reduce(v, a, s, multicast_base, stream, current_sm_count());
}

}  // namespace cuda
}  // namespace nvc
