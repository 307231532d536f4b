// NVLink SHARP (multicast) variants of the one-shot and two-shot all-reduce (sm_90+).
//
// NEVER RUN ON MACHINES SHARED WITH OTHER USERS: a program that uses multicast can take a host's
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
//
// Emulation build (-DNVC_MULTICAST_EMULATE; a test build only: never the default, never the
// package's, and the multicast transport refuses to compile in it): the two multimem helpers
// below are the only code that differs between the builds (the policies hand them the peer
// table, McPeers, which the real instructions ignore). multimem.st becomes one plain 16-byte store per rank,
// in rank order, at that rank's copy of the address; multimem.ld_reduce becomes an L2 load
// (ld.cg) of every rank's copy, summed in float32 in rank order 0..W-1 and rounded to T. The
// multicast address is read as an address in the caller's own buffer: `mc` must be the own
// unicast buffer start, bufs[rank], and McPeers gives every rank's copy of it (the unicast
// peer table; no multicast object exists). Slots, flags, phases, epilogues and failure paths
// are the kernels' own source. tests/cuda_harness/allreduce_harness.cu runs this build (its
// multicast cases, scripts/gpu_check.sh part mcemu) and first checks that the binary holds no
// multimem instruction: none in its PTX, and in its SASS none of the spellings multimem has
// there on sm_90a (LDGMC for multimem.ld_reduce, STG.E.128.STRONG.SYS for this multimem.st;
// "multimem" itself never appears in SASS). Its two-shot sums in rank order, so it is bitwise
// equal to the unicast two-shot, which the real switch need not be.
//
// What the emulation cannot show (run `scripts/gpu_check.sh multicast_real` on a machine with
// NVLink SHARP, by hand; it refuses to start unless JAX_NVCOMM_MULTICAST_REAL_OK=1):
//   - memory ordering of the real instructions: that a multimem.st (relaxed, system scope)
//     reaches every rank's memory before the flag that follows it is seen there (the release
//     of publish_flag), that each 32-bit word of it lands whole (the one-shot's sentinel polls
//     read words, not vectors), and that a
//     multimem.ld_reduce issued after the phase-0 flags were acquired reads every rank's copy
//     written before that rank's fence.acq_rel.sys; in the emulation both are ordinary
//     loads/stores of one GPU, ordered by the same fences and flags;
//   - the switch's reduction order and rounding for bf16/f16 with .acc::f32 (the last-bit
//     freedom above), and that every rank still reads the owner's one result;
//   - multicast object setup: granularity, binding every rank's buffer at offset 0, the mapped
//     address (csrc/transport/cuda_multicast.h), and the multicast address arithmetic
//     mc + (p - bufs[rank]) against a real mapping;
//   - the traffic and timing of the in-switch path (none of the emulation's numbers mean
//     anything: it issues W stores or loads where the hardware issues one).
#pragma once
#include "allreduce_oneshot.cuh"
#include "allreduce_twoshot.cuh"

namespace nvc {
namespace dev {

// Every rank's copy of a multicast address range, for the emulation build: rank r's copy of
// the multicast address a is at[r] + (a - mc). The real instructions do not read it (and the
// compiler drops it); the emulation reads and writes these unicast addresses instead.
struct McPeers {
  char* const* at;  // at[r]: the range's start in rank r's buffer
  const char* mc;   // the range's start as the kernel addresses it (emulation: at[rank])
  int world;
};
// The whole buffer: at = bufs, so `mc` (the emulation: bufs[rank]) is the buffer's start.
__device__ __forceinline__ McPeers mc_peers(const CommView& v) {
  return McPeers{v.bufs, v.bufs[v.rank], v.world};
}

// Stores v at mc in every rank's buffer.
__device__ __forceinline__ void multimem_st_v4(void* mc, const uint4& v, const McPeers& p) {
#if defined(NVC_MULTICAST_EMULATE)
  const size_t off = static_cast<const char*>(mc) - p.mc;
  for (int r = 0; r < p.world; ++r) st_v4(p.at[r] + off, v);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
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
__device__ __forceinline__ uint4 multimem_ld_reduce_v4(const void* mc, const McPeers& p) {
  uint4 v = make_uint4(0, 0, 0, 0);
#if defined(NVC_MULTICAST_EMULATE)
  const size_t off = static_cast<const char*>(mc) - p.mc;
  float acc[Vec<T>::kElems];
  for (int r = 0; r < p.world; ++r) accumulate<T>(acc, ld_cg_v4(p.at[r] + off), r == 0);
  v = pack<T>(acc);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
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
  __device__ static void push(const CommView& v, char* const* s_dst, size_t i, const uint4& d) {
    multimem_st_v4(s_dst[0] + i * 16, d, mc_peers(v));
  }
  // One multimem.st of the tag reaches every rank (thread r == 0 issues it).
  __device__ static void push_tag(const CommView& v, char* mc, int cur, int r, const uint4& tag) {
    if (r == 0)
      multimem_st_v4(
          mc + (reinterpret_cast<char*>(lamport_tag_at(v, v.rank, cur, v.rank)) - v.bufs[v.rank]),
          tag, mc_peers(v));
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
  __device__ static uint4 reduce(const TwoShotCtx& c, char* const* s_half, size_t i) {
    return multimem_ld_reduce_v4<T>(c.mc_half + i * 16, McPeers{s_half, c.mc_half, c.world});
  }

  __device__ static void gather(const TwoShotCtx& c, char* const* s_half, size_t i,
                                const uint4& s, bool) {
    multimem_st_v4(c.mc_half + c.ag + i * 16, s, McPeers{s_half, c.mc_half, c.world});
  }
};

template <typename T, bool kFused, bool kQuant = false, bool kWf32 = false>
__global__ void __launch_bounds__(kArThreads, 1)
    oneshot_mc_kernel(const __grid_constant__ CommView v, const __grid_constant__ ArTensors t,
                      RowCfg rc, uint32_t desc, char* mc) {
  oneshot_body<T, kFused, OneShotMulticast, kQuant, kWf32>(v, t, rc, desc, mc);
}

template <typename T, bool kFused, bool kQuant = false, bool kWf32 = false>
__global__ void __launch_bounds__(kArThreads, 1)
    twoshot_mc_kernel(const __grid_constant__ CommView v, const __grid_constant__ ArTensors t,
                      RowCfg rc, uint32_t desc, char* mc) {
  twoshot_body<T, kFused, TwoShotMulticast, kQuant, kWf32>(v, t, rc, desc, mc);
}

}  // namespace dev
}  // namespace nvc
