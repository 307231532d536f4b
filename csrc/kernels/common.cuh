// Device-side building blocks shared by every protocol: system-scope release/acquire flag
// operations, the bounded wait, error reporting, the "last block advances the counter" pattern.
//
// Protocol conventions (every kernel follows them):
// - A call reads its sequence number s = ctrl->seq + 1 at the start, in every block; the last
//   block to finish (done_blocks reaches gridDim.x) stores ctrl->seq = s and resets done_blocks.
//   All blocks have read seq by then, so the update cannot race with a reader of this call, and
//   the next kernel on the stream sees it (kernel boundary).
// - Data written to a peer is published per block: __syncthreads(); thread 0 issues
//   fence.acq_rel.sys and then a relaxed system-scope store of the flag (st_release_sys).
// - A waiter polls with ld.acquire.sys and a deadline from %globaltimer. On a timeout, a
//   disagreement or bad data it records ErrorInfo (first error wins) and traps: the CUDA context
//   reports an error to XLA instead of the program hanging or computing on garbage.
#pragma once
#include <cstdint>
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
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"r"(v), "l"(p) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

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

// Record an error of this rank, then trap so the launch fails visibly. The error block lives
// in host-mapped memory (PCIe atomics are not guaranteed there), so it is claimed with plain
// stores: the fields first, then the code after a system fence. Racing failures may mix
// fields of two reports; each one alone is a true report.
__device__ __noinline__ void fail(ErrorInfo* err, uint32_t code, uint32_t op, int rank, int peer,
                                  uint64_t seq, uint64_t observed) {
  if (err != nullptr && *reinterpret_cast<volatile uint32_t*>(&err->code) == 0u) {
    volatile ErrorInfo* e = err;
    e->op = op;
    e->rank = rank;
    e->peer = peer;
    e->seq = seq;
    e->observed = observed;
    __threadfence_system();
    e->code = code;
    __threadfence_system();
  }
  __trap();
}

// Wait (one thread) until *flag == make_flag(seq, desc). Reports a timeout, a disagreement
// (same seq, other descriptor) or a peer that is ahead.
__device__ __forceinline__ void wait_flag(const uint64_t* flag, uint64_t seq, uint32_t desc,
                                          const CommView& v, int peer, uint64_t deadline) {
  const uint64_t want = make_flag(seq, desc);
  uint32_t spins = 0;
  while (true) {
    uint64_t f = ld_acquire_sys(flag);
    if (f == want) return;
    if (flag_seq(f) == seq) fail(v.err, kErrMismatch, desc, v.rank, peer, seq, f);
    if (flag_seq(f) > seq) fail(v.err, kErrAhead, desc, v.rank, peer, seq, f);
    if ((++spins & 255u) == 0u && globaltimer() > deadline)
      fail(v.err, kErrTimeout, desc, v.rank, peer, seq, f);
  }
}

// Per-call start: every block reads the call's sequence number.
__device__ __forceinline__ uint64_t call_seq(const CommView& v) {
  return *reinterpret_cast<volatile uint64_t*>(&v.ctrl()->seq) + 1;
}

// Per-call end: the last block to get here publishes ctrl->seq = seq. Call from all threads
// of every block, after the block's last access to communication buffers.
__device__ __forceinline__ void finish_call(const CommView& v, uint64_t seq) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    uint32_t prev = atomicAdd(&v.ctrl()->done_blocks, 1u);
    if (prev == gridDim.x - 1) {
      v.ctrl()->done_blocks = 0;
      *reinterpret_cast<volatile uint64_t*>(&v.ctrl()->seq) = seq;
      __threadfence();
    }
  }
}

}  // namespace dev
}  // namespace nvc
