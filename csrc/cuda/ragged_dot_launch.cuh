// Internal to csrc/cuda: one launch of a ragged_dot kernel instantiation (kernels/ragged_dot.cuh)
// on a persistent grid of the most clusters the device holds at once. Shared by ragged_dot.cu
// and the kernel harness's tile sweep.
#pragma once
#include <atomic>

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled (the driver's, reached through the runtime)
#include <cuda_runtime.h>

#include "../kernels/ragged_dot.cuh"
#include "device_cache.h"
#include "ragged_dot.h"

namespace nvc {
namespace cuda {
namespace rdot_launch {

static_assert(kRaggedDotMaxSplits == dev::rdot::kMaxSplits, "one split limit");

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda);
// nullptr when the driver lacks it (looked up once per process).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static void* const fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      f = nullptr;
    }
    return f;
  }();
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

// The weights [g, k, n] (16-bit elements) as a 3-d tensor map (n innermost) with boxes of
// 64 columns x bk rows x 1 group and the 128-byte swizzle (kernels/ragged_dot.cuh kTma).
inline bool encode_weights(CUtensorMap* map, const void* w, int dtype, int64_t g, int64_t k,
                           int64_t n, int bk) {
  PFN_cuTensorMapEncodeTiled_v12000 enc = tensor_map_encoder();
  if (enc == nullptr) return false;
  const cuuint64_t dims[3] = {cuuint64_t(n), cuuint64_t(k), cuuint64_t(g)};
  const cuuint64_t strides[2] = {cuuint64_t(n) * 2, cuuint64_t(k) * cuuint64_t(n) * 2};
  const cuuint32_t box[3] = {64, cuuint32_t(bk), 1};
  const cuuint32_t estr[3] = {1, 1, 1};
  return enc(map, dtype == 2 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
             3, const_cast<void*>(w), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// 8-bit weights [g, k, n] (int8 or float8_e4m3fn, as bytes) as a 3-d tensor map with boxes of
// 128 columns (128 B) x bk rows x 1 group and the 128-byte swizzle (kernels/ragged_dot.cuh
// "8-bit weights", w8_off). n % 16 == 0 (the map's row stride is a multiple of 16 B).
inline bool encode_weights8(CUtensorMap* map, const void* w, int64_t g, int64_t k, int64_t n,
                            int bk) {
  PFN_cuTensorMapEncodeTiled_v12000 enc = tensor_map_encoder();
  if (enc == nullptr) return false;
  const cuuint64_t dims[3] = {cuuint64_t(n), cuuint64_t(k), cuuint64_t(g)};
  const cuuint64_t strides[2] = {cuuint64_t(n), cuuint64_t(k) * cuuint64_t(n)};
  const cuuint32_t box[3] = {128, cuuint32_t(bk), 1};
  const cuuint32_t estr[3] = {1, 1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(w), dims, strides, box,
             estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
         CUDA_SUCCESS;
}

// TW: the weights' element type (T, or int8_t / __nv_fp8_e4m3 for 8-bit weights).
template <class T, class TO, int BN, int BK, int R, int ST, int MT, bool SW, int OPT = 0,
          class TW = T>
struct Kernel {
  using Tl = dev::rdot::Tile<BN, BK, R, ST, MT, SW, OPT, int(sizeof(TW))>;
  static constexpr auto fn = dev::rdot::ragged_dot_kernel<T, TO, BN, BK, R, ST, MT, SW, OPT, TW>;

  // Raise the dynamic shared-memory limit (once per device; returns the error of the first try).
  static cudaError_t prepare() {
    static std::atomic<int> cache[64];
    const int r = once_per_device(cache, [](int) {
      return cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, Tl::kSmem) ==
                     cudaSuccess ? 1 : 0;
    });
    return r > 0 ? cudaSuccess : cudaErrorInvalidValue;
  }

  // Clusters of `cs` blocks resident at once (once per device and cs); 0 when the query failed.
  static int clusters(int cs) {
    static std::atomic<int> cache[4][64];
    const int ci = cs == 1 ? 0 : cs == 2 ? 1 : cs == 4 ? 2 : 3;
    return once_per_device(cache[ci], [cs](int) {
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(unsigned(cs) * 16);
      cfg.blockDim = dim3(Tl::kThreads);
      cfg.dynamicSmemBytes = Tl::kSmem;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = unsigned(cs);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      int n = 0;
      return cudaOccupancyMaxActiveClusters(&n, fn, &cfg) == cudaSuccess ? n : 0;
    });
  }

  static constexpr bool kSplit = (OPT & dev::rdot::kSplitK) != 0;
  static constexpr bool kOneBlock = kSplit || (OPT & dev::rdot::kCtaSync) != 0;

  static cudaError_t launch(const RaggedDotArgs& a, int cs, cudaStream_t s) {
    if (a.m == 0 || a.n == 0) return cudaSuccess;
    if (kOneBlock) cs = 1;  // split-K units, block barriers: clusters of one block
    const int kt = int((a.k + BK - 1) / BK);
    if (cs > kt) cs = kt >= 8 ? 8 : kt >= 4 ? 4 : kt >= 2 ? 2 : 1;
    if (cs < 1) cs = 1;
    if (cudaError_t e = prepare(); e != cudaSuccess) return e;
    int ncl = clusters(cs);
    if (ncl <= 0) {
      const int sms = device_sm_count();
      ncl = sms > 0 ? sms / cs : 1;
    }
    dev::rdot::Params p = {};
    if constexpr (Tl::kW8) {
      if (!encode_weights8(&p.tmap[0], a.rhs, a.g, a.k, a.n, BK) ||
          (SW && !encode_weights8(&p.tmap[1], a.rhs2, a.g, a.k, a.n, BK)))
        return cudaErrorInvalidValue;
      p.scale = a.scale;
      p.scale2 = a.scale2;
      p.scale_mode = a.scale_mode;
    } else if constexpr (Tl::kTmaW) {
      if (!encode_weights(&p.tmap[0], a.rhs, a.dtype, a.g, a.k, a.n, BK) ||
          (SW && !encode_weights(&p.tmap[1], a.rhs2, a.dtype, a.g, a.k, a.n, BK)))
        return cudaErrorInvalidValue;
    }
    p.lhs = a.lhs;
    p.rhs = a.rhs;
    p.rhs2 = a.rhs2;
    p.group_sizes = a.group_sizes;
    p.out = a.out;
    p.ks_max = 1;
    if constexpr (kSplit) {
      // the workspace's counters zeroed on the stream, then its planes (ragged_dot.h layout)
      const bool ok = a.workspace != nullptr && (reinterpret_cast<uintptr_t>(a.workspace) & 15u) == 0;
      const int planes = ok ? ragged_dot_planes(a.workspace_bytes, a.m, a.n, a.g, SW) : 0;
      if (planes >= 2) {
        const int64_t cb = ragged_dot_counter_bytes(a.m, a.n, a.g);
        if (cudaError_t e = cudaMemsetAsync(a.workspace, 0, size_t(cb), s); e != cudaSuccess)
          return e;
        p.counters = static_cast<int*>(a.workspace);
        p.counters_n = int(cb / 4);
        p.ws = reinterpret_cast<float*>(static_cast<char*>(a.workspace) + cb);
        p.ks_max = planes;
      }
    }
    p.m = int(a.m);
    p.k = int(a.k);
    p.n = int(a.n);
    p.g = int(a.g);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(unsigned(ncl * cs));
    cfg.blockDim = dim3(Tl::kThreads);
    cfg.dynamicSmemBytes = Tl::kSmem;
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = unsigned(cs);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, fn, p, cs);
  }

  // Module loaded, shared-memory limit raised, the occupancy of the package's cluster size (1)
  // cached (and for TMA kernels the tensor-map encoder found): a first launch then makes no
  // runtime query (it may be inside a graph capture).
  static cudaError_t load() {
    cudaFuncAttributes fa;
    if (cudaError_t e = cudaFuncGetAttributes(&fa, fn); e != cudaSuccess) return e;
    if (cudaError_t e = prepare(); e != cudaSuccess) return e;
    clusters(1);
    // TMA kernels: the driver's tensor-map encoder looked up now, not inside a graph capture
    if constexpr (Tl::kTmaW)
      if (tensor_map_encoder() == nullptr) return cudaErrorNotSupported;
    return cudaSuccess;
  }
};

}  // namespace rdot_launch
}  // namespace cuda
}  // namespace nvc
