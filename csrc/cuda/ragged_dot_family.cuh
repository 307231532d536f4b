// Internal to csrc/cuda: the package's tile choice for each rows tile R and the dispatch of one
// operand family over (R, out dtype); included by ragged_dot_bf16.cu, ragged_dot_f16.cu and
// ragged_dot_swiglu_{bf16,f16}.cu (each instantiates its own family). Each Kernel<...> must be
// instantiated in ONE translation unit only: without relocatable device code every unit holds
// its own copy of the kernel, and the per-device caches (shared-memory limit raised once) would
// then apply to one copy while another is launched (seen: "invalid argument").
// From the tile sweeps on one H200 (docs/perf/ragged_dot.md, 2026-12-02; x the weight-read
// bound at 32 experts x 8 / 32 tokens, 256 experts x 8 / 32 / 128 tokens; gate / down / swiglu):
//   kRows16 (decode, up to ~10 rows per group): BN 256 x BK 64, 4 stages, 8 warps of 2 m16
//        tiles (swiglu: BN 128 over two weights, 8 warps of 1 m16 tile), items dealt round
//        robin, TMA weights, the row-count loop, the last round's items split along K
//        (kSplitK), the epilogue's block barrier (kCtaSync): 1.25 / 1.21 / 1.21 / 1.17 / 1.16
//        (gate), 1.28 / 1.21 / 1.21 / 1.17 / 1.13 (down), 1.21 / 1.20 / 1.21 / 1.16 / 1.16
//        (swiglu). Without the split the swiglu pass at 32 x 8 took 1.38 (416 items on 132
//        SMs); the cp.async tiles and the balanced ranges many groups had: 1.2-1.45.
//   kRows64 (~32 rows per group): BN 256 x BK 64, 3 stages, 8 warps of 2 m16 tiles (swiglu
//        BN 128 x BK 64, 8 warps of 1), round robin, the row-count loop, TMA weights, the
//        block barrier: 32 experts x 128 tokens gate 1.19, down 1.22, swiglu 1.17 (BN 128 x
//        BK 128 with cluster barriers: 1.23 / 1.42 / 1.18; balanced ranges 1.48 / 1.67 / 1.41;
//        the split option compiled in cost ~10 % there although it never splits).
// Blocks per cluster: 1 (ragged_dot.cu ragged_dot_cluster): split-K over a cluster lost to it at
// every decode shape but one.
#pragma once
#include "ragged_dot_launch.cuh"

namespace nvc {
namespace cuda {
namespace rdot_launch {

namespace o = dev::rdot;

// The package's tile for each tile kind of ragged_dot.h (RaggedDotTile) and family; TW: the
// weights' element type (T, or 8 bits: W8Tile below).
template <class T, class TO, int KIND, bool SW, class TW = T, bool W8 = sizeof(TW) == 1>
struct DefaultTile;
template <class T, class TO, class TW>
struct DefaultTile<T, TO, kRows16, false, TW, false> {
  using K = Kernel<T, TO, 256, 64, 16, 4, 2, false,
                   o::kSpecRows | o::kTma | o::kSplitK | o::kCtaSync, TW>;
};
template <class T, class TO, class TW>
struct DefaultTile<T, TO, kRows64, false, TW, false> {
  using K = Kernel<T, TO, 256, 64, 64, 3, 2, false, o::kSpecRows | o::kTma | o::kCtaSync, TW>;
};
template <class T, class TO, class TW>
struct DefaultTile<T, TO, kRows16, true, TW, false> {
  using K = Kernel<T, TO, 128, 64, 16, 4, 1, true,
                   o::kSpecRows | o::kTma | o::kSplitK | o::kCtaSync, TW>;
};
template <class T, class TO, class TW>
struct DefaultTile<T, TO, kRows64, true, TW, false> {
  using K = Kernel<T, TO, 128, 64, 64, 3, 1, true, o::kSpecRows | o::kTma | o::kCtaSync, TW>;
};

// 8-bit weights (kernels/ragged_dot.cuh "8-bit weights": operands converted in registers; boxes
// of 128 columns). A stage of BN x BK bytes is half the 16-bit one, so the decode tile takes
// K steps of W8_BK rows (one 128-row scale block at 128) to keep the bytes a stage streams;
// the swiglu decode tile streams two weights of BN 256 x 64 (the 16-bit one: two of 128 x 64).
// The macros exist for the kernel harness's A/B builds (-D...); the package builds the defaults.
#ifndef NVC_W8_BK
#define NVC_W8_BK 128
#endif
#ifndef NVC_W8_STAGES
#define NVC_W8_STAGES 5
#endif
#ifndef NVC_W8_SWIGLU_BN
#define NVC_W8_SWIGLU_BN 256
#endif
#ifndef NVC_W8_SWIGLU_STAGES
#define NVC_W8_SWIGLU_STAGES 4
#endif
#ifndef NVC_W8_SWIGLU_BK
#define NVC_W8_SWIGLU_BK 64
#endif
#ifndef NVC_W8_MT
#define NVC_W8_MT 2
#endif
#ifndef NVC_W8_R64_BK
#define NVC_W8_R64_BK 128
#endif
#ifndef NVC_W8_R64_STAGES
#define NVC_W8_R64_STAGES 3
#endif
#ifndef NVC_W8_R64_MT
#define NVC_W8_R64_MT 2
#endif
// NVC_W8_R64_WG: the MMAs by wgmma with A from registers (kWgmmaRA,
// kernels/ragged_dot_w8_wgmma.cuh) in the R 64 tiles (1) or in the R 64 and R 16 tiles (2);
// 0: mma.sync (the package's build until the wgmma loop measures faster)
#ifndef NVC_W8_R64_WG
#define NVC_W8_R64_WG 0
#endif
constexpr int kW8Wg64 = NVC_W8_R64_WG >= 1 ? o::kWgmmaRA : 0;
constexpr int kW8Wg16 = NVC_W8_R64_WG >= 2 ? o::kWgmmaRA : 0;
template <class T, class TO, class TW>
struct DefaultTile<T, TO, kRows16, false, TW, true> {
  using K = Kernel<T, TO, 256, NVC_W8_BK, 16, NVC_W8_STAGES, NVC_W8_MT, false,
                   o::kSpecRows | o::kTma | o::kSplitK | o::kCtaSync | kW8Wg16, TW>;
};
template <class T, class TO, class TW>
struct DefaultTile<T, TO, kRows64, false, TW, true> {
  using K = Kernel<T, TO, 256, NVC_W8_R64_BK, 64, NVC_W8_R64_STAGES, NVC_W8_R64_MT, false,
                   o::kSpecRows | o::kTma | o::kCtaSync | kW8Wg64, TW>;
};
template <class T, class TO, class TW>
struct DefaultTile<T, TO, kRows16, true, TW, true> {
  using K = Kernel<T, TO, NVC_W8_SWIGLU_BN, NVC_W8_SWIGLU_BK, 16, NVC_W8_SWIGLU_STAGES,
                   NVC_W8_MT * NVC_W8_SWIGLU_BN / 256, true,
                   o::kSpecRows | o::kTma | o::kSplitK | o::kCtaSync | kW8Wg16, TW>;
};
template <class T, class TO, class TW>
struct DefaultTile<T, TO, kRows64, true, TW, true> {
  using K = Kernel<T, TO, 128, NVC_W8_R64_BK, 64, NVC_W8_R64_STAGES, 1, true,
                   o::kSpecRows | o::kTma | o::kCtaSync | kW8Wg64, TW>;
};

template <class T, class TO, int KIND, bool SW, class TW = T>
using Default = typename DefaultTile<T, TO, KIND, SW, TW>::K;

template <class T, class TO, bool SW, class TW = T>
cudaError_t launch_rows(const RaggedDotArgs& a, int tile, int cs, cudaStream_t s) {
  return tile == kRows16 ? Default<T, TO, kRows16, SW, TW>::launch(a, cs, s)
                         : Default<T, TO, kRows64, SW, TW>::launch(a, cs, s);
}

template <class T, class TO, bool SW, class TW = T>
cudaError_t load_rows() {
  if (cudaError_t e = Default<T, TO, kRows16, SW, TW>::load(); e != cudaSuccess) return e;
  return Default<T, TO, kRows64, SW, TW>::load();
}

// 8-bit weights TW with operands T: every out dtype (T, float32) and both forms.
template <class T, class TW>
cudaError_t launch_w8(const RaggedDotArgs& a, bool swiglu, int tile, int cs, cudaStream_t s) {
  if (swiglu)
    return a.out_dtype == 0 ? launch_rows<T, float, true, TW>(a, tile, cs, s)
                            : launch_rows<T, T, true, TW>(a, tile, cs, s);
  return a.out_dtype == 0 ? launch_rows<T, float, false, TW>(a, tile, cs, s)
                          : launch_rows<T, T, false, TW>(a, tile, cs, s);
}
template <class T, class TW>
cudaError_t load_w8() {
  for (cudaError_t e : {load_rows<T, float, false, TW>(), load_rows<T, T, false, TW>(),
                        load_rows<T, float, true, TW>(), load_rows<T, T, true, TW>()})
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace rdot_launch
}  // namespace cuda
}  // namespace nvc
