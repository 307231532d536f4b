// NVLink SHARP (multicast) variants of the one-shot and two-shot all-reduce (sm_90+).
//
// NEVER RUN ON THE LENT TEST MACHINES: a program that uses multicast can take a shared host's
// GPUs out of service. These kernels are compiled, and selected by the host API only when the
// caller passes a multicast base pointer (nullptr = unicast); nothing in this project creates a
// multicast object by default (see DESIGN.md for the conditions).
//
// `mc` is the multicast address of the start of the symmetric buffer: for any address p inside
// this rank's buffer, mc + (p - bufs[rank]) addresses the same offset in every rank's buffer.
//
// One-shot (multicast push): identical to allreduce_oneshot.cuh except step 1, where each
// sanitised vector (and the call's tag) is stored once with multimem.st to slot [me] of buffer
// k % 3 of every rank. The failure paths are the unicast kernels' (shared bodies).
// Polling, clearing, the rank-order float32 sum and the counters are shared, so results are
// bitwise identical to the unicast one-shot.
//
// Two-shot (in-switch reduction): same halves, flags and partition as allreduce_twoshot.cuh,
// but
//   phase 0: block b copies chunk b of every share of sanitised x into its OWN reduce-scatter
//            zone, used as one flat area at the message's offsets (W*S >= M), then publishes
//            flags[p][0][me][b] at every peer and waits for every peer's;
//   phase 1: the owner reads the sum of all ranks' copies of its chunk with
//            multimem.ld_reduce (f32: .add.v4.f32; bf16/f16: .add.acc::f32 with float32
//            accumulation), and stores it once with multimem.st into every rank's AG zone;
//   phase 2: as unicast (the own share is copied from the AG zone too).
// The switch reduces in an unspecified order, so multicast two-shot results are identical on
// every rank (each rank reads the owner's result) but may differ in the last bit from the
// unicast kernels, which sum in rank order.
#pragma once
#include "allreduce_oneshot.cuh"
#include "allreduce_twoshot.cuh"

namespace nvc {
namespace dev {

__device__ __forceinline__ void multimem_st_v4(void* mc, const uint4& v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("multimem.st.relaxed.sys.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(mc),
               "f"(__uint_as_float(v.x)), "f"(__uint_as_float(v.y)), "f"(__uint_as_float(v.z)),
               "f"(__uint_as_float(v.w))
               : "memory");
#else
  __trap();
#endif
}

// Sum over every rank of the 16-byte vector of T at mc, rounded to T.
template <typename T>
__device__ __forceinline__ uint4 multimem_ld_reduce_v4(const void* mc) {
  uint4 v = make_uint4(0, 0, 0, 0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (std::is_same_v<T, float>) {
    float a, b, c, d;
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(a), "=f"(b), "=f"(c), "=f"(d)
                 : "l"(mc)
                 : "memory");
    v = make_uint4(__float_as_uint(a), __float_as_uint(b), __float_as_uint(c), __float_as_uint(d));
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(mc)
        : "memory");
  } else {
    asm volatile(
        "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(mc)
        : "memory");
  }
#else
  __trap();
#endif
  return v;
}

struct OneShotMulticast {
  __device__ static void setup(const CommView& v, char* mc, int cur, char** s_dst) {
    if (threadIdx.x == 0) s_dst[0] = mc + (v.lamport(v.rank, cur, v.rank) - v.bufs[v.rank]);
  }
  __device__ static void push(const CommView&, char* const* s_dst, size_t i, const uint4& d) {
    multimem_st_v4(s_dst[0] + i * 16, d);
  }
  // One multimem.st of the tag reaches every rank (thread r == 0 issues it).
  __device__ static void push_tag(const CommView& v, char* mc, int cur, int r, const uint4& tag) {
    if (r == 0)
      multimem_st_v4(
          mc + (reinterpret_cast<char*>(lamport_tag_at(v, v.rank, cur, v.rank)) - v.bufs[v.rank]),
          tag);
  }
};

struct TwoShotMulticast {
  static constexpr bool kOwnDirect = false;

  template <typename T>
  __device__ static void scatter(const TwoShotCtx& c, char* const*) {
    for (int o = 0; o < c.world; ++o) {
      size_t a, e;
      chunk_bounds(c.nv, c.world, c.grid, o, c.block, &a, &e);
      block_stream<4>(
          a, e, [&](size_t i) { return sanitize_v4<T>(ld_nc_v4(c.x + i * 16)); },
          [&](size_t i, const uint4& d) { st_v4(c.my_half + i * 16, d); });
    }
    fence_acq_rel_sys();  // own copies before the multimem reads that follow the flags
  }

  template <typename T, int kChunk>
  __device__ static uint4 reduce(const TwoShotCtx& c, size_t i) {
    return multimem_ld_reduce_v4<T>(c.mc_half + i * 16);
  }

  __device__ static void gather(const TwoShotCtx& c, char* const*, size_t i, const uint4& s,
                                bool) {
    multimem_st_v4(c.mc_half + c.ag + i * 16, s);
  }
};

template <typename T, bool kFused, bool kQuant = false>
__global__ void __launch_bounds__(kArThreads, 1)
    oneshot_mc_kernel(const __grid_constant__ CommView v, const __grid_constant__ ArTensors t,
                      RowCfg rc, uint32_t desc, char* mc) {
  oneshot_body<T, kFused, OneShotMulticast, kQuant>(v, t, rc, desc, mc);
}

template <typename T, bool kFused, bool kQuant = false>
__global__ void __launch_bounds__(kArThreads, 1)
    twoshot_mc_kernel(const __grid_constant__ CommView v, const __grid_constant__ ArTensors t,
                      RowCfg rc, uint32_t desc, char* mc) {
  twoshot_body<T, kFused, TwoShotMulticast, kQuant>(v, t, rc, desc, mc);
}

}  // namespace dev
}  // namespace nvc
