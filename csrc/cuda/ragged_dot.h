// Launch API of the grouped expert product for decode / small prefill (kernels/ragged_dot.cuh:
// the protocol, the layout and the two numbers). lax.ragged_dot's MoE form:
//   ragged_dot:        out[r] = lhs[r] @ rhs[g(r)]                      rhs  [G, K, N]
//   ragged_dot_swiglu: out[r] = silu(lhs[r] @ w_gate[g(r)]) * (lhs[r] @ w_up[g(r)])
//                                                                        w_gate, w_up [G, K, N]
// for r < min(sum(max(group_sizes, 0)), M); rows past that are zero. lhs [M, K] rows sorted by
// group; group_sizes: device int32 [G], read by the kernel (no host sync); out [M, N].
//
// Contract: no allocation (the split-K workspace is the caller's: RaggedDotArgs::workspace), no
// synchronisation, no host state beyond per-device caches of occupancy answers and the driver's
// tensor-map encoder (looked up once; TMA tiles encode their weights' maps on the host at each
// launch, into the kernel's parameters): CUDA-graph capturable (a memset of the workspace's
// counters and one kernel launch on `s`). Deterministic: the same inputs give the same bits
// (fixed-order split-K reduction, whichever unit finishes last). Arguments the kernel does not take
// (ragged_dot_check says why, as static text) return cudaErrorInvalidValue before anything is
// launched. M == 0 or N == 0 launches nothing.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace nvc {
namespace cuda {

// dtype codes (ffi_common.h dtype_code): 0 float32, 1 bfloat16, 2 float16.
// Weight codes (RaggedDotArgs::w_dtype): the operands' 16-bit dtype, or 8-bit weights.
enum RaggedDotWeights : int { kW16 = 0, kWInt8 = 1, kWE4M3 = 2 };
struct RaggedDotArgs {
  const void* lhs = nullptr;            // [m, k] of dtype
  const void* rhs = nullptr;            // [g, k, n] of dtype (swiglu: w_gate)
  const void* rhs2 = nullptr;           // swiglu: w_up [g, k, n]; ragged_dot: nullptr
  const int32_t* group_sizes = nullptr; // [g]
  void* out = nullptr;                  // [m, n] of out_dtype
  int64_t m = 0, k = 0, n = 0, g = 0;
  int dtype = 1;                        // operands: 1 bfloat16 or 2 float16
  int out_dtype = 1;                    // result: dtype or 0 (float32)
  // Split-K workspace (kernels/ragged_dot.cuh "Split-K units"): ragged_dot_workspace_bytes()
  // bytes, 256-byte aligned, no contents required (the launcher zeroes its counters on the
  // stream). nullptr / too small: no split (the tiles then run as round robin).
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  // 8-bit weights (w_dtype kWInt8 / kWE4M3: rhs, rhs2 [g, k, n] int8 / float8_e4m3fn):
  //   out[r, n] = sum_k lhs[r, k] * float(rhs[g, k, n]) * s(g, k, n), float32 accumulation,
  // s = 1 (scale_mode 0; scale unused), scale[g, n] (1), scale[g, k / 128, n / 128] (2:
  // [g, ceil(k / 128), ceil(n / 128)]); swiglu: scale2 for rhs2. kernels/ragged_dot.cuh
  // "8-bit weights" says how (exact up to float32 summation order).
  int w_dtype = kW16;
  const float* scale = nullptr;
  const float* scale2 = nullptr;
  int scale_mode = 0;
};

constexpr int kRaggedDotMaxSplits = 8;  // = dev::rdot::kMaxSplits (checked in ragged_dot_launch.cuh)

// The workspace the split-K tiles use for [m, n] outputs over g groups (swiglu: two partials):
// int32 arrival counters, one per possible item (ceil(n / 64) x (m / 16 + min(g, m) + 1)),
// rounded up to 256 bytes, then up to kMaxSplits = 8 float32 planes of m x n (x 2 for swiglu),
// as many as fit in 32 MiB; 0 when fewer than 2 fit (no split at that size). The Python op
// (jax_nvcomm/ragged_dot.py _workspace_bytes) computes the same numbers.
int64_t ragged_dot_workspace_bytes(int64_t m, int64_t n, int64_t g, bool swiglu);
// The counters' bytes of that layout (the part the launcher zeroes) and the planes that fit in
// `bytes` of workspace (<= 8; < 2 means no split).
int64_t ragged_dot_counter_bytes(int64_t m, int64_t n, int64_t g);
int ragged_dot_planes(int64_t bytes, int64_t m, int64_t n, int64_t g, bool swiglu);

// nullptr when the kernel takes `a` (bf16/f16 operands, out dtype = operands' or float32,
// k % 8 == 0, n % 8 == 0 (8-bit weights: k % 16 == 0, n % 16 == 0, scale_mode 0..2 with its
// scales given), 1 <= g <= 1024, m <= 2^20, 16-byte aligned pointers), else why not.
const char* ragged_dot_check(const RaggedDotArgs& a, bool swiglu);

// The products above with the launcher's own tile choice (rows per group estimated as m / g).
cudaError_t ragged_dot(const RaggedDotArgs& a, cudaStream_t s);
cudaError_t ragged_dot_swiglu(const RaggedDotArgs& a, cudaStream_t s);

// Rows per item (R: 16 or 64) and blocks per cluster (split-K) the launcher picks for `a`.
int ragged_dot_rows_tile(const RaggedDotArgs& a);
int ragged_dot_cluster(const RaggedDotArgs& a);

// The tile the launcher picks (cuda/ragged_dot_family.cuh: the tiles and their measurements):
// R 16 or R 64 rows per item (ragged_dot_rows_tile).
enum RaggedDotTile : int { kRows16 = 0, kRows64 = 2 };
int ragged_dot_tile(const RaggedDotArgs& a, bool swiglu);

// Load every kernel of this file on the current device (first launches then wait on nothing).
cudaError_t ragged_dot_load_kernels();

}  // namespace cuda
}  // namespace nvc
