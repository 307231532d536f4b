// Device-side building blocks shared by every protocol: system-scope release/acquire flag
// operations, the bounded wait, error reporting, the "last block advances the counter" pattern.
//
// Protocol conventions (every kernel follows them):
// - A call reads its sequence number s = ctrl->seq + 1 at the start, in every block; the last
//   block to finish (done_blocks reaches gridDim.x) stores ctrl->seq = s and resets done_blocks.
//   All blocks have read seq by then, so the update cannot race with a reader of this call, and
//   the next kernel on the stream sees it (kernel boundary).
// - Data written to a peer is published per block: __syncthreads(), then one thread per flag
//   stores it with st.release.sys (publish_flag). The release covers the whole block's writes
//   (bar.sync orders them before it; PTX release is cumulative) and compiles to one
//   MEMBAR.ALL.SYS before the store. A fence.acq_rel.sys in front of it, as before 2026-12-01,
//   added a second MEMBAR.ALL.SYS and an L1 invalidate (CCTL.IVALL) per flag, with nothing to
//   order. Where one thread stores several flags it issues one fence.acq_rel.sys and relaxed
//   stores instead (a release pattern too), so the MEMBAR is paid once.
// - A waiter polls with ld.acquire.sys and a deadline from %globaltimer (wait_flag).
//
// Failure (every kernel; the CUDA context must stay usable, so nothing traps):
// - On a timeout, a disagreement or bad data a kernel calls fail(): it records ErrorInfo (the
//   first error of the rank wins; host-mapped, so the host reads it without synchronising),
//   sets Ctrl::failed and RETURNS. The kernel then ends normally: waits return false
//   (wait_flag) or a poisoned value (Lamport polls: NaN, lamport.cuh); the block agrees with
//   __syncthreads_or (or a warp vote) and leaves before it writes anything that depends on the
//   missing or bad data, or (Lamport) computes on the NaN it got.
// - Every wait also gives up, without recording, once Ctrl::failed is set by another thread of
//   the rank (flag waits: checked with the deadline; Lamport polls: once they have waited
//   kLamportPatientNs, allreduce_oneshot.cuh), so one failure ends the whole grid at once
//   instead of at every block's deadline. No kernel has a grid-wide barrier (the
//   cooperative MoE launch only guarantees residency), so a block that leaves early leaves
//   nobody waiting but flag waits, which are bounded.
// - Every kernel reads Ctrl::failed at its start, with its counters, and exits at once when it
//   is set (block-uniform: __syncthreads_or; the cluster kernel, whose blocks must all reach
//   its cluster barriers, instead pushes nothing and gives up every poll at once): a failed
//   communicator does no more work, which also covers CUDA-graph replays, where no host code
//   runs. Peers waiting for such a rank time
//   out (bounded) or see its poison flags.
// - A failed call advances no counter reliably and leaves buffers in any state: the
//   communicator is dead. The FFI handlers refuse every later call with the record's text
//   (ffi/ffi_common.h lookup); results of the failed call are unspecified (docs/API.md).
// - Bad input of one rank (an expert id, a row count, a slice) also raises POISON flags
//   (descriptor 0xFFFFFF) in its peers before the rank leaves, so they fail at once naming it.
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../common/layout.h"

namespace nvc {
namespace dev {

__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Whether a kernel of this rank already failed (Ctrl::failed): read at every kernel's start
// and, with the deadline, in every wait.
__device__ __forceinline__ bool comm_failed(const CommView& v) {
  return *reinterpret_cast<volatile uint32_t*>(&v.ctrl()->failed) != 0u;
}

// Poll (one thread) until *flag == make_flag(seq, desc): kErrNone. Or a disagreement (same seq,
// other descriptor: kErrMismatch), a peer that is ahead (kErrAhead), the deadline passed
// (kErrTimeout), or another thread of this rank failed (Ctrl::failed, checked with the
// deadline: kErrTimeout too, which fail() then does not record: the rank's first error is
// kept), with the flag value last seen in *seen. Records nothing: for callers that report on
// their block's way out, where no state is live across fail()'s call.
__device__ __forceinline__ uint32_t poll_flag(const CommView& v, const uint64_t* flag,
                                              uint64_t seq, uint32_t desc, uint64_t deadline,
                                              uint64_t* seen) {
  const uint64_t want = make_flag(seq, desc);
  uint32_t spins = 0;
  while (true) {
    const uint64_t f = ld_acquire_sys(flag);
    *seen = f;
    if (f == want) return kErrNone;
    if (flag_seq(f) == seq) return kErrMismatch;
    if (flag_seq(f) > seq) return kErrAhead;
    if ((++spins & 255u) == 0u && (comm_failed(v) || globaltimer() > deadline))
      return kErrTimeout;
  }
}

// Volatile 16-byte load (bypasses L1: data written by peers since this SM last looked).
__device__ __forceinline__ uint4 ld_volatile_v4(const void* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
// Coherent-at-L2 16-byte load for data published by a flag we acquired.
__device__ __forceinline__ uint4 ld_cg_v4(const void* p) {
  return __ldcg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ void st_v4(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }
// Ask for the line holding p in this SM's L1 (no register holds the data; a later load of it
// then waits for L1, not L2 or HBM). Only for read-only data of the call.
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// Record an error of this rank and mark the communicator failed; returns (no trap). The first
// failure of the rank claims Ctrl::failed (a device-memory atomic) and alone writes ErrorInfo,
// which lives in host-mapped memory: the fields first, then the code after a system fence, so
// a host that sees the code sees the fields. Scalars only: a CommView passed by reference to
// an out-of-line function would be copied to local memory in kernels that take it by value.
__device__ __forceinline__ void record_failure_inline(uint32_t* failed, ErrorInfo* err, int rank,
                                                      uint32_t code, uint32_t op, int peer,
                                                      uint64_t seq, uint64_t observed) {
  if (*reinterpret_cast<volatile uint32_t*>(failed) != 0u || atomicCAS(failed, 0u, code) != 0u)
    return;
  volatile ErrorInfo* e = err;
  if (e == nullptr) return;
  e->op = op;
  e->rank = rank;
  e->peer = peer;
  e->seq = seq;
  e->observed = observed;
  __threadfence_system();
  e->code = code;
  __threadfence_system();
}
static __device__ __noinline__ void record_failure(uint32_t* failed, ErrorInfo* err, int rank,
                                                   uint32_t code, uint32_t op, int peer,
                                                   uint64_t seq, uint64_t observed) {
  record_failure_inline(failed, err, rank, code, op, peer, seq, observed);
}
// fail: out of line (the waits); fail_inline: inlined (MoE kernels: a call to a __noinline__
// function makes ptxas save registers around it).
__device__ __forceinline__ void fail(const CommView& v, uint32_t code, uint32_t op, int peer,
                                     uint64_t seq, uint64_t observed) {
  record_failure(&v.ctrl()->failed, v.err, v.rank, code, op, peer, seq, observed);
}
__device__ __forceinline__ void fail_inline(const CommView& v, uint32_t code, uint32_t op,
                                            int peer, uint64_t seq, uint64_t observed) {
  record_failure_inline(&v.ctrl()->failed, v.err, v.rank, code, op, peer, seq, observed);
}

// Wait (one thread) until *flag == make_flag(seq, desc): true. False when the call failed: a
// timeout, a disagreement (same seq, other descriptor, e.g. a poison flag) or a peer that is
// ahead (each recorded here), or another thread of this rank failed (recorded there: this
// fail() then records nothing).
__device__ __forceinline__ bool wait_flag(const uint64_t* flag, uint64_t seq, uint32_t desc,
                                          const CommView& v, int peer, uint64_t deadline) {
  uint64_t f = 0;
  const uint32_t code = poll_flag(v, flag, seq, desc, deadline, &f);
  if (code == kErrNone) return true;
  fail(v, code, desc, peer, seq, f);
  return false;
}

// Per-call start: every block reads the call's sequence number.
__device__ __forceinline__ uint64_t call_seq(const CommView& v) {
  return *reinterpret_cast<volatile uint64_t*>(&v.ctrl()->seq) + 1;
}

// Arrival tickets: how the blocks of a kernel pick the one that advances a counter every block
// reads at its start (Ctrl::seq, the Lamport counters, MoeCtrl::send_seq). Thread 0 of every
// block takes a ticket from the kernel's arrival counter (`done`: Ctrl::done_blocks or
// MoeCtrl::send_done_blocks) after a __syncthreads that follows the block's reads of the
// counters it will advance (their values already used); the holder of the last ticket resets
// `done` for the next call and stores the new counters, which this rank's later kernels read
// (kernel boundary). Taken early, the atomic's round trip overlaps the block's work; the
// result is only tested (arrive_is_last) where the counters are stored. One-block grids take
// ticket 0 without an atomic. No fence: nothing is published through an arrival.
__device__ __forceinline__ uint32_t arrive_issue(uint32_t* done) {
  return gridDim.x == 1 ? 0u : atomicAdd(done, 1u);
}
__device__ __forceinline__ bool arrive_is_last(uint32_t* done, uint32_t ticket) {
  if (ticket != gridDim.x - 1) return false;
  if (gridDim.x > 1) *done = 0;
  return true;
}

// Per-call end (kernels that take their ticket last): the last block to get here stores
// ctrl->seq = seq. Call from all threads of every block, after the block's last access to
// communication buffers.
__device__ __forceinline__ void finish_call(const CommView& v, uint64_t seq) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (gridDim.x > 1) __threadfence();
    uint32_t* done = &v.ctrl()->done_blocks;
    if (arrive_is_last(done, arrive_issue(done))) {
      *reinterpret_cast<volatile uint64_t*>(&v.ctrl()->seq) = seq;
      __threadfence();
    }
  }
}

// Publish data written by this block (to peers or locally) with a flag: call after a
// __syncthreads() that follows the block's data stores. One release store, no separate fence
// (see the conventions at the top).
__device__ __forceinline__ void publish_flag(uint64_t* flag, uint64_t value) {
  st_release_sys(flag, value);
}

// Raise the poison flag make_flag(s, poison_desc) of every block < nblocks of this rank at every
// peer (flag-protocol phase 0). One thread. A peer waiting for any of these flags then reports
// kErrMismatch naming this rank at once instead of timing out. No release: a poison flag
// publishes no data.
__device__ __forceinline__ void poison_flags(const CommView& v, uint64_t s, int nblocks,
                                             uint32_t poison_desc) {
  const uint64_t f = make_flag(s, poison_desc);
  for (int r = 0; r < v.world; ++r)
    if (r != v.rank)
      for (int b = 0; b < nblocks; ++b)
        st_relaxed_sys(&v.peer_ctrl(r)->flags[s & 1][0][v.rank][b], f);
}
// poison_flags, then record the error (fail; returns: the caller's block then leaves).
__device__ __forceinline__ void poison_fail(const CommView& v, uint64_t s, int nblocks,
                                            uint32_t poison_desc, uint32_t code, uint32_t desc,
                                            int peer, uint64_t observed) {
  poison_flags(v, s, nblocks, poison_desc);
  fail(v, code, desc, peer, s, observed);
}

// Phase probes (timing experiments only; compiled in with -DNVC_PROBE, never in the package):
// probe(i) syncs the block, then thread 0 of block 0 (-DNVC_PROBE_LAST: of the last block, which
// owns the fused one-shot's row when tokens < blocks) adds the SM cycles since the previous probe
// of this call to g_probe[i] (probe(0) starts a call and counts it in g_probe[kProbeN - 1]).
constexpr int kProbeN = 16;
#ifdef NVC_PROBE
__device__ unsigned long long g_probe[kProbeN];
__device__ __forceinline__ void probe(int i) {
  __shared__ long long s_probe_t;
  __syncthreads();
#ifdef NVC_PROBE_LAST
  const unsigned probe_block = gridDim.x - 1;
#else
  const unsigned probe_block = 0;
#endif
  if (threadIdx.x == 0 && blockIdx.x == probe_block) {
    const long long t = clock64();
    if (i > 0) atomicAdd(&g_probe[i], static_cast<unsigned long long>(t - s_probe_t));
    else atomicAdd(&g_probe[kProbeN - 1], 1ull);
    s_probe_t = t;
  }
}
// Host: copies this translation unit's probe sums to out[kProbeN] and zeroes them (each .cu has
// its own g_probe, hence static).
static inline cudaError_t take_probes(unsigned long long* out) {
  if (cudaError_t e = cudaMemcpyFromSymbol(out, g_probe, sizeof(g_probe)); e != cudaSuccess)
    return e;
  static const unsigned long long zero[kProbeN] = {};
  return cudaMemcpyToSymbol(g_probe, zero, sizeof(zero));
}
#else
__device__ __forceinline__ void probe(int) {}
#endif

// Read-only (non-coherent path) 16-byte load: for kernel inputs nobody writes during the call.
__device__ __forceinline__ uint4 ld_nc_v4(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// ---- block-wide byte copy --------------------------------------------------------------------
// One load of V (uint4, uint2, unsigned, unsigned short, unsigned char): kCoherent, data a peer
// wrote during this call and published by a flag this block acquired (ld.global.cg, L2); else
// data nobody writes during the call (ld.global.nc).
template <bool kCoherent, typename V>
__device__ __forceinline__ V ld_copy(const V* p) {
  if constexpr (kCoherent) return __ldcg(p);
  else return __ldg(p);
}

// The block copies n bytes at src to dst in accesses of V: bytes before dst's first V-aligned
// address and after the last whole V one by one, the V's between four per thread and round
// (four independent loads in flight before their stores). Needs dst == src modulo sizeof(V).
template <bool kCoherent, typename V>
__device__ __forceinline__ void block_copy_as(char* dst, const char* src, size_t n) {
  constexpr size_t w = sizeof(V);
  const size_t t = threadIdx.x, nt = blockDim.x;
  size_t head = (w - (reinterpret_cast<uintptr_t>(dst) & (w - 1))) & (w - 1);
  if (head > n) head = n;
  const size_t nv = (n - head) / w;
  const size_t tail = head + nv * w;
  const unsigned char* sb = reinterpret_cast<const unsigned char*>(src);
  if (t < head) dst[t] = char(ld_copy<kCoherent>(sb + t));
  if (t < n - tail) dst[tail + t] = char(ld_copy<kCoherent>(sb + tail + t));
  V* d = reinterpret_cast<V*>(dst + head);
  const V* s = reinterpret_cast<const V*>(src + head);
  size_t i = t;
  for (; i + 3 * nt < nv; i += 4 * nt) {
    const V a0 = ld_copy<kCoherent>(s + i), a1 = ld_copy<kCoherent>(s + i + nt);
    const V a2 = ld_copy<kCoherent>(s + i + 2 * nt), a3 = ld_copy<kCoherent>(s + i + 3 * nt);
    d[i] = a0;
    d[i + nt] = a1;
    d[i + 2 * nt] = a2;
    d[i + 3 * nt] = a3;
  }
  for (; i < nv; i += nt) d[i] = ld_copy<kCoherent>(s + i);
}

// The block copies n bytes at src to dst (any alignment) in the widest accesses both allow: 16
// bytes when dst == src modulo 16, else 8, 4, 2 or 1. Call from every thread of the block with
// the same arguments; no barrier inside. kCoherent: see ld_copy.
template <bool kCoherent>
__device__ __forceinline__ void block_copy(char* dst, const char* src, size_t n) {
  const uintptr_t mis = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  if ((mis & 15u) == 0) block_copy_as<kCoherent, uint4>(dst, src, n);
  else if ((mis & 7u) == 0) block_copy_as<kCoherent, uint2>(dst, src, n);
  else if ((mis & 3u) == 0) block_copy_as<kCoherent, unsigned>(dst, src, n);
  else if ((mis & 1u) == 0) block_copy_as<kCoherent, unsigned short>(dst, src, n);
  else block_copy_as<kCoherent, unsigned char>(dst, src, n);
}

// ---- 16-byte vectors of T (float, __nv_bfloat16, __half) <-> float32 --------------------
template <typename T> struct Vec;
template <> struct Vec<float> { static constexpr int kElems = 4; };
template <> struct Vec<__nv_bfloat16> { static constexpr int kElems = 8; };
template <> struct Vec<__half> { static constexpr int kElems = 8; };

__device__ __forceinline__ const uint32_t* words(const uint4& v) {
  return reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t* words(uint4& v) { return reinterpret_cast<uint32_t*>(&v); }

// Exact widening of the Vec<T>::kElems elements of v.
template <typename T>
__device__ __forceinline__ void unpack(const uint4& v, float* f) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w = words(v)[i];
    if constexpr (std::is_same_v<T, float>) {
      f[i] = __uint_as_float(w);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      f[2 * i] = __uint_as_float(w << 16);
      f[2 * i + 1] = __uint_as_float(w & 0xFFFF0000u);
    } else {
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&w));
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
}
// Round-to-nearest-even narrowing of Vec<T>::kElems floats.
template <typename T>
__device__ __forceinline__ uint4 pack(const float* f) {
  uint4 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      words(v)[i] = __float_as_uint(f[i]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const __nv_bfloat162 p = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      words(v)[i] = *reinterpret_cast<const uint32_t*>(&p);
    } else {
      const __half2 p = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
      words(v)[i] = *reinterpret_cast<const uint32_t*>(&p);
    }
  }
  return v;
}

}  // namespace dev
}  // namespace nvc
