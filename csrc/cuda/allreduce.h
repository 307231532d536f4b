// Launch API of the CUDA all-reduce kernels (one-shot Lamport, two-shot flag protocol, each
// plain or fused with residual add + RMSNorm, the fused one optionally with FP8 output;
// unicast, or multicast where a base is given).
//
// Contract for callers (the XLA FFI handlers):
// - Every rank of the communicator calls with the same (tokens, hidden, dtype, strategy,
//   fused-ness), in the same order, on one stream per rank. The launch configuration is a pure
//   function of (tokens, hidden, dtype, world, strategy, fused, SM count), so identical calls
//   give identical grids on every rank (same GPU model => same SM count).
// - No allocation, no synchronisation, no host-side state: every per-call counter lives in the
//   rank's Ctrl block and is advanced by the kernel, so the launch can be captured into a CUDA
//   graph and replayed. The symmetric buffer must have been initialised once (Ctrl all zero,
//   every 32-bit word of the Lamport region 0x80000000; see layout.h).
// - Tensors: x, out, residual, residual_out, weight are device pointers of x's dtype, 16-byte
//   aligned, row-major [tokens, hidden] ([hidden] for weight; weight may be float32 with a
//   16-bit x: weight_dtype). out may alias x and
//   residual_out may alias residual. hidden must be a multiple of 8 (16-bit types) or 4 (f32);
//   fused calls need hidden <= max_fused_hidden(dtype) (32768).
// - Quantised fused calls (scale != nullptr): out is float8_e4m3fn [tokens, hidden] (1 byte per
//   element, 16-byte aligned), scale float32 [tokens], as csrc/common/fp8.h defines them; r and
//   residual_out as in the fused call. out must not alias x then (other sizes).
// - Capacity: tokens * hidden * sizeof(dtype) <= oneshot_max_bytes(v) (one-shot) or
//   <= twoshot_max_bytes(v) (two-shot). Larger messages must take another path (lax.psum).
// - Errors: invalid arguments return cudaErrorInvalidValue before anything is launched
//   (all_reduce_check says why); a device-side failure (peer timeout, disagreement) records
//   ErrorInfo in v.err and traps, so the stream reports cudaErrorLaunchFailure.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include "../common/layout.h"

namespace nvc {
namespace cuda {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct AllReduceArgs {
  const void* x;
  void* out;
  const void* residual;   // nullptr => plain all-reduce (residual_out, weight ignored)
  void* residual_out;
  const void* weight;
  int64_t tokens;
  int64_t hidden;
  int dtype;              // DType
  float eps;
  float* scale = nullptr;  // fused only: non-null => out is e4m3fn q, scale float32 [tokens]
  int weight_dtype = -1;   // fused only: DType of weight, dtype or kF32 (-1: dtype)
  int64_t norm_hidden = 0;  // fused only: the mean's divisor, 1..hidden: the row width before
                            // the caller's zero padding to whole 16-byte vectors (0: hidden)
};

enum class Strategy : int { kOneShot = 0, kTwoShot = 1 };

constexpr int kMaxArBlocks = 64;  // blocks per all-reduce launch (<= kMaxBlocks; measured:
                                  // 64 beats 32 from 1 MiB up on 2 x H200)

// Launch on `stream`. multicast_base: multicast address of this rank's buffer start (nullptr =
// unicast). Uses the SM count of the current device (queried once per device and cached).
cudaError_t all_reduce(const CommView& v, const AllReduceArgs& a, Strategy s,
                       const void* multicast_base, cudaStream_t stream);
// Same with an explicit SM count budget (the grid never exceeds it).
cudaError_t all_reduce(const CommView& v, const AllReduceArgs& a, Strategy s,
                       const void* multicast_base, cudaStream_t stream, int sm_count);

// nullptr if the call is valid, else a static message saying what is wrong.
const char* all_reduce_check(const CommView& v, const AllReduceArgs& a, Strategy s);

// Tests only: the world-1 fused epilogue (a.residual set; a.scale for the FP8 output) with its
// kernel forced: rows = true the row kernel (allreduce_local.cuh local_rows_kernel; invalid
// value when the shape does not qualify), false the one-block epilogue (local_kernel). The
// package picks between them itself (all_reduce); both must give the same bits.
cudaError_t all_reduce_local_variant(const AllReduceArgs& a, bool rows, cudaStream_t stream,
                                     int sm_count);

// Number of blocks the call launches (pure function; exposed for tests and tuning).
int all_reduce_grid(int64_t tokens, int64_t hidden, int dtype, int world, Strategy s, bool fused,
                    int sm_count);

// Load the unicast all-reduce kernels on the current device and set their attributes (dynamic
// shared memory limit, the package-wide MaxShared carveout). Call once per device at
// communicator setup, next to all_gather_load_kernels / moe_load_kernels; all_reduce also does
// it lazily, and is the only path that touches the multicast variants (when given a base).
cudaError_t all_reduce_load_kernels();
#ifdef NVC_PROBE
// Timing experiments only (-DNVC_PROBE): the phase probes' cycle sums of this device
// (dev::g_probe, kernels/common.cuh), then zeroes them.
cudaError_t probe_take(unsigned long long* out);
#endif

size_t oneshot_max_bytes(const CommView& v);  // largest message one-shot can take (= slot L)
size_t twoshot_max_bytes(const CommView& v);  // largest message two-shot can take (= M)
int64_t max_fused_hidden(int dtype);
size_t dtype_bytes(int dtype);

}  // namespace cuda
}  // namespace nvc
