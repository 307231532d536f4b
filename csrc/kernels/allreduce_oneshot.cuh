// One-shot all-reduce (Lamport protocol), optionally fused with residual add + RMSNorm (and, with
// kQuant, the FP8 output of rmsnorm.cuh: out is then e4m3fn bytes plus float32 row scales).
//
// Buffer layout (per rank, see layout.h): three rotating Lamport buffers, each W slots of
// L = CommView::lamport_slot bytes; slot [src] of buffer b in rank r's region receives src's
// message: CommView::lamport(r, b, src). A message (tokens * hidden * sizeof(T) bytes, in 16-byte
// vectors) must fit one slot; the host API refuses larger ones and the kernel reports
// kErrCapacity if one gets through.
//
// Call k = Ctrl::lamport_seq + 1 on rank `me` (every block reads the counters and
// Ctrl::failed at its start, after requesting its first input vectors):
//   1. push: threads 0..W-1 of the grid store the call's tag (layout.h lamport_tag: k and the
//      descriptor, i.e. op, dtype and sizes) to Ctrl::lamport_tags[k % 3][me] of every rank;
//      every 16-byte vector of x is sanitised (-0.0 -> +0.0, lamport.cuh) and stored to
//      slot [me] of buffer k % 3 of every rank, itself included (unicast: W stores; multicast:
//      one multimem.st). Vectors are spread over all blocks of the grid.
//   2. clear: buffer (k - 1) % 3 of this rank's own region (W slots x Ctrl::lamport_bytes, the
//      size the previous call wrote) is reset to 0x80000000 words, its W tags to 0. Done while
//      peers' data is in flight.
//   3. the block holding the last arrival ticket (taken by every block after reading the
//      counters, common.cuh arrive_issue) stores lamport_bytes = this call's bytes and
//      lamport_seq = k, while the peers' data is in flight: nothing on the kernel's tail.
//   4. check: threads 0..W-1 of the grid poll the peers' tags of buffer k % 3 (bounded) and
//      compare them with their own: a tag of another op, dtype, size or call number is
//      kErrMismatch / kErrAhead naming the peer. Without it, a rank whose peer pushed a longer
//      message of another call would sum it silently.
//   5. reduce: poll the W slots of own buffer k % 3 (volatile 16-byte loads, every 32-bit word
//      compared with the sentinel as raw bits, deadline from %globaltimer -> kErrTimeout), sum in
//      float32 in rank order 0..W-1 (rmsnorm.cuh), write T(sum) or run the fused epilogue. Fused:
//      block b owns rows [tokens*b/G, tokens*(b+1)/G) so each row's reduction stays in a block.
//
// Failure (common.cuh): a kernel of a failed communicator (Ctrl::failed) leaves at its start,
// every block alike (__syncthreads_or), pushing nothing; so does every block of a call whose
// size exceeds the slot (kErrCapacity, uniform over the grid). A poll that passes its deadline
// records kErrTimeout naming the first missing rank (only the rank's first error is kept) and
// gives up: the sums of the vectors it polled are NaN (lamport_poison_v4) and the kernel
// computes on, so every barrier of the epilogue is still met. A poll that has waited
// kLamportPatientNs also checks Ctrl::failed at every round and gives up the same way (without
// recording) once another thread of the rank failed, e.g. on a tag of another call (step 4):
// data of that call would never complete this one. Below that wait the poll reads nothing but
// its slots and the timer (the fast path costs nothing; a check inlined into every round cost
// the fused epilogue registers). The tag wait of step 4 checks Ctrl::failed with its deadline
// every 256 rounds while the tag is missing and gives up the same way. Results of a failed
// call: NaN where data was missing, else unspecified.
//
// Why three buffers suffice: a peer writes buffer (k+1) % 3 of my region only in its call k+1,
// i.e. after it consumed my call-k push, which I issued after finishing call k-1, whose step 2
// cleared exactly that buffer (= (k-2) % 3). It cannot reach call k+2 (buffer (k-1) % 3, which I
// clear in call k) before consuming my push of call k+1. I only ever read my own region.
// Ordering between the clear (in an earlier kernel) and a peer's later stores relies on kernel
// boundaries, as every Lamport implementation does.
//
// Aliasing: out may alias x and residual_out may alias residual: an output vector is written
// only after this rank's own pushed copy of every input vector it depends on has been observed
// in its own slot, i.e. after the input was read.
//
// Grid: any number of blocks (identical on every rank), all co-resident: blocks poll data pushed
// by other blocks of the same rank.
#pragma once
#include "lamport.cuh"
#include "rmsnorm.cuh"

namespace nvc {
namespace dev {

// The tag of call k as a 16-byte vector (layout.h lamport_tag).
__device__ __forceinline__ uint4 lamport_tag_v4(uint64_t k, uint32_t desc) {
  uint4 t;
  lamport_tag(k, desc, words(t));
  return t;
}
// This rank's tag slot of buffer `which` in rank r's control block.
__device__ __forceinline__ uint32_t* lamport_tag_at(const CommView& v, int r, int which, int src) {
  return v.peer_ctrl(r)->lamport_tags[which][src];
}

// Unicast push: W plain 16-byte stores.
struct OneShotUnicast {
  // s_dst[r] = destination slot base in rank r; called by threads < world.
  __device__ static void setup(const CommView& v, char* /*mc*/, int cur, char** s_dst) {
    s_dst[threadIdx.x] = v.lamport(threadIdx.x, cur, v.rank);
  }
  // The call's tag to rank r (called by one thread per rank r < world).
  __device__ static void push_tag(const CommView& v, char* /*mc*/, int cur, int r,
                                  const uint4& tag) {
    st_v4(lamport_tag_at(v, r, cur, v.rank), tag);
  }
  __device__ static void push(const CommView& v, char* const* s_dst, size_t i, const uint4& d) {
    int r = v.rank;
    for (int n = 0; n < v.world; ++n) {  // start with the next rank: spread the traffic
      r = (r + 1 == v.world) ? 0 : r + 1;
      st_v4(s_dst[r] + i * 16, d);
    }
  }
};

// A poll still missing data after this long (from the call's start) also checks Ctrl::failed.
constexpr uint64_t kLamportPatientNs = 100 * 1000;

// Whether a poll that has waited kLamportPatientNs gives up: 2 past the deadline, 1 when another
// thread of the rank failed (Ctrl::failed), else 0. Out of line, so the fused epilogue keeps
// its registers; v is a __grid_constant__ kernel parameter in every Lamport kernel, so passing
// it by reference copies nothing.
static __device__ __noinline__ int lamport_give_up(const CommView& v, uint64_t deadline) {
  return globaltimer() > deadline ? 2 : comm_failed(v) ? 1 : 0;
}

// Poll the W slots of the nv <= kN vectors i[0..nv) (slot stride L) and write their T-packed
// rank-order sums to out[0..nv). Loads kChunk slots of every vector at once (all issued before
// any check); while any word of them is still empty, reloads them all (polls are local). A
// vector's sum is the same float32 additions in rank order whatever kN, kChunk and nv are.
template <typename T, int kChunk, int kN>
__device__ __forceinline__ void lamport_sum_vecs(const CommView& v, const char* slot0,
                                                 const size_t (&i)[kN], int nv, uint64_t k,
                                                 uint32_t desc, uint64_t deadline,
                                                 uint4 (&out)[kN]) {
  float acc[kN][Vec<T>::kElems];
  bool gave_up = false;
  for (int s0 = 0; s0 < v.world; s0 += kChunk) {
    const int n = v.world - s0 < kChunk ? v.world - s0 : kChunk;
    uint4 d[kN][kChunk];
    bool empty;
    do {
      empty = false;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        if (j < nv) {
          const char* p = slot0 + i[j] * 16 + size_t(s0) * v.lamport_slot;
#pragma unroll
          for (int c = 0; c < kChunk; ++c) {
            if (c < n) {
              d[j][c] = ld_volatile_v4(p + size_t(c) * v.lamport_slot);
              empty |= lamport_any_empty(d[j][c]);
            }
          }
        }
      }
      if (empty && globaltimer() > deadline - v.timeout_ns + kLamportPatientNs) {
        const int why = lamport_give_up(v, deadline);
        if (why == 2) {  // report the first rank still missing (fail keeps the first error)
          int c = 0;
          auto missing = [&](int cc) {
            bool m = false;
#pragma unroll
            for (int j = 0; j < kN; ++j) m |= j < nv && lamport_any_empty(d[j][cc]);
            return m;
          };
          while (c + 1 < n && !missing(c)) ++c;
          fail(v, kErrTimeout, desc, s0 + c, k, 0);
        }
        gave_up = why != 0;  // the sums are NaN (see the header)
      }
    } while (empty && !gave_up);
#pragma unroll
    for (int j = 0; j < kN; ++j)
#pragma unroll
      for (int c = 0; c < kChunk; ++c)
        if (j < nv && c < n) accumulate<T>(acc[j], d[j][c], s0 + c == 0);
  }
#pragma unroll
  for (int j = 0; j < kN; ++j)
    if (j < nv) out[j] = gave_up ? lamport_poison_v4<T>() : pack<T>(acc[j]);
}

// The T-packed rank-order sum of vector i (lamport_sum_vecs for one vector).
template <typename T, int kChunk>
__device__ __forceinline__ uint4 lamport_sum_v4(const CommView& v, const char* slot0, size_t i,
                                                uint64_t k, uint32_t desc, uint64_t deadline) {
  const size_t idx[1] = {i};
  uint4 out[1];
  lamport_sum_vecs<T, kChunk>(v, slot0, idx, 1, k, desc, deadline, out);
  return out[0];
}

// The call's number, deadline, own receive buffer (this rank's slots of buffer k % 3) and
// whether steps 1-3 ran (false: the block must not go on, see oneshot_exchange).
struct OneShotCall {
  uint64_t k;
  uint64_t deadline;
  const char* slot0;
  int cur;
  bool ok;
};

// Steps 1-3 of a call over the whole grid (blocks of kThreads threads; the cluster-split
// kernel, allreduce_oneshot_cluster.cuh, shares them): push x to every rank's slot, clear the
// previous call's own buffer, advance the counters. s_dst: kMaxWorld pointers of shared memory.
// Returns ok == false, having done nothing, when the message exceeds the slot (kErrCapacity;
// the same in every block, so every block returns) or the communicator already failed: then
// the caller leaves at once. kUniformExit == false (the cluster kernel, whose blocks must meet
// at cluster barriers): a failed communicator is not a reason to leave, since blocks could
// read Ctrl::failed at different times; the call then returns ok == true, having pushed
// nothing, with its deadline at its start, so the caller's polls give up at once (NaN).
template <typename T, class Policy, int kThreads, bool kUniformExit = true>
__device__ __forceinline__ OneShotCall oneshot_exchange(const CommView& v, const ArTensors& t,
                                                        uint32_t desc, char* mc, char** s_dst) {
  constexpr int kU = 4;  // input vectors in flight per thread
  probe(0);
  const size_t nv = size_t(t.tokens) * size_t(t.hidden) / Vec<T>::kElems;
  const size_t bytes = nv * 16;
  const size_t tid = size_t(blockIdx.x) * kThreads + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * kThreads;
  // This thread's first kU input vectors are requested before the counters: neither depends on
  // the other, so the two load latencies overlap instead of adding up.
  const char* x = static_cast<const char*>(t.x);
  uint4 d0[kU];
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const size_t i = tid + u * nthreads;
    if (i < nv) d0[u] = ld_nc_v4(x + i * 16);
  }
  Ctrl* ctrl = v.ctrl();
  const uint64_t k = *reinterpret_cast<volatile uint64_t*>(&ctrl->lamport_seq) + 1;
  const size_t prev_bytes = *reinterpret_cast<volatile uint64_t*>(&ctrl->lamport_bytes);
  const bool dead = comm_failed(v);
  const int cur = int(k % 3), prv = int((k + 2) % 3);
  const bool too_big = bytes > v.lamport_slot || prev_bytes > v.lamport_slot;
  if (too_big && !dead && tid == 0) fail(v, kErrCapacity, desc, -1, k, bytes);
  const uint64_t deadline = globaltimer() + v.timeout_ns;
  const OneShotCall call{k, deadline, v.lamport(v.rank, cur, 0), cur, true};

  if (threadIdx.x < v.world) Policy::setup(v, mc, cur, s_dst);
  // one barrier decides for the whole block (too_big is the same everywhere already)
  const bool stop = __syncthreads_or(kUniformExit ? too_big || dead : dead);
  if (too_big || (kUniformExit && stop)) return OneShotCall{k, 0, nullptr, cur, false};
  if (stop) return OneShotCall{k, deadline - v.timeout_ns, call.slot0, cur, true};
  const uint32_t ticket = threadIdx.x == 0 ? arrive_issue(&ctrl->done_blocks) : 0u;  // step 3
  probe(12);

  // 1. push: the tag first (threads 0..W-1 of the grid), then the data
  if (tid < size_t(v.world)) Policy::push_tag(v, mc, cur, int(tid), lamport_tag_v4(k, desc));
  for (size_t i0 = tid; i0 < nv; i0 += nthreads * kU) {
    uint4 d[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t i = i0 + u * nthreads;
      if (i < nv) d[u] = sanitize_v4<T>(i0 == tid ? d0[u] : ld_nc_v4(x + i * 16));
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const size_t i = i0 + u * nthreads;
      if (i < nv) Policy::push(v, s_dst, i, d[u]);
    }
  }

  probe(1);
  // 2. clear the previous call's buffer of the own region
  {
    const uint32_t nvp = uint32_t(prev_bytes / 16);
    const uint32_t total = nvp * uint32_t(v.world);
    char* base = v.lamport(v.rank, prv, 0);
    for (uint32_t i = uint32_t(tid); i < total; i += uint32_t(nthreads)) {
      const uint32_t s = i / nvp;
      st_v4(base + size_t(s) * v.lamport_slot + size_t(i - s * nvp) * 16, lamport_empty_v4());
    }
    if (tid < size_t(v.world))
      st_v4(lamport_tag_at(v, v.rank, prv, int(tid)), make_uint4(0, 0, 0, 0));
  }

  // 3. advance the counters: every block read them before its arrival (issued after the
  // first __syncthreads), so the block with the last ticket stores this call's values now, while
  // the peers' data is in flight, instead of on the kernel's tail (arrive_issue, common.cuh).
  if (threadIdx.x == 0 && arrive_is_last(&ctrl->done_blocks, ticket)) {
    *reinterpret_cast<volatile uint64_t*>(&ctrl->lamport_bytes) = bytes;
    *reinterpret_cast<volatile uint64_t*>(&ctrl->lamport_seq) = k;
  }
  return call;
}

// Step 4 (threads 0..W-1 of the grid, thread `src` for source src): wait for src's tag of this
// call in the own control block and compare it with this rank's; another op, dtype or size is
// kErrMismatch, another call number kErrAhead (observed: make_flag(its k, its descriptor));
// the data polls then give up (Ctrl::failed). Bounded like the data polls; while the tag is
// missing, every 256th round also checks Ctrl::failed and gives up without recording once
// another thread of the rank failed (e.g. on another peer's tag), so one failure ends the
// grid at once (common.cuh), not at this thread's deadline. Returns at once in other threads.
template <int kThreads>
__device__ __forceinline__ void oneshot_check_tag(const CommView& v, const OneShotCall& call,
                                                  uint32_t desc) {
  const size_t src = size_t(blockIdx.x) * kThreads + threadIdx.x;
  if (src >= size_t(v.world) || int(src) == v.rank) return;
  const char* p = reinterpret_cast<const char*>(lamport_tag_at(v, v.rank, call.cur, int(src)));
  const uint4 want = lamport_tag_v4(call.k, desc);
  uint4 got = ld_volatile_v4(p);
  uint32_t spins = 0;
  while ((got.x == 0u) | (got.y == 0u) | (got.z == 0u) | (got.w == 0u)) {
    if ((++spins & 255u) == 0u) {
      if (comm_failed(v)) return;  // recorded by the thread that failed
      if (globaltimer() > call.deadline) {
        fail(v, kErrTimeout, desc, int(src), call.k, 0);
        return;
      }
    }
    got = ld_volatile_v4(p);
  }
  if (got.x != want.x || got.y != want.y || got.z != want.z || got.w != want.w) {
    const uint32_t peer_desc = got.x & 0xFFFFFFu;
    fail(v, peer_desc == (desc & 0xFFFFFFu) ? kErrAhead : kErrMismatch, desc, int(src), call.k,
         make_flag(got.y & 0x7FFFFFFFu, peer_desc));
  }
}

template <typename T, bool kFused, class Policy, bool kQuant = false, bool kWf32 = false>
__device__ __forceinline__ void oneshot_body(const CommView& v, const ArTensors& t,
                                             const RowCfg& rc, uint32_t desc, char* mc) {
  constexpr int kChunk = kFused ? 4 : 8;  // slot loads in flight (x kEpiPairs when fused)
  __shared__ char* s_dst[kMaxWorld];
  __shared__ float s_red[kEpiPairs * kArThreads / 32];
  extern __shared__ float4 s_dyn[];  // fused epilogue rows (rmsnorm_smem_bytes)

  const OneShotCall call = oneshot_exchange<T, Policy, kArThreads>(v, t, desc, mc, s_dst);
  if (!call.ok) return;  // every block alike (oneshot_exchange)
  const uint64_t k = call.k, deadline = call.deadline;
  oneshot_check_tag<kArThreads>(v, call, desc);
  probe(2);
  // 5. reduce
  const char* slot0 = call.slot0;
  if constexpr (!kFused) {
    const size_t nv = size_t(t.tokens) * size_t(t.hidden) / Vec<T>::kElems;
    const size_t nthreads = size_t(gridDim.x) * kArThreads;
    char* out = static_cast<char*>(t.out);
    for (size_t i = size_t(blockIdx.x) * kArThreads + threadIdx.x; i < nv; i += nthreads)
      st_v4(out + i * 16, lamport_sum_v4<T, kChunk>(v, slot0, i, k, desc, deadline));
  } else {
    const int64_t rb = t.tokens * blockIdx.x / gridDim.x;
    const int64_t re = t.tokens * (blockIdx.x + 1) / gridDim.x;
    rmsnorm_rows<T, kQuant, kWf32>(t, rc, rb, re, s_red, s_dyn, [&](size_t i) {
      return lamport_sum_v4<T, kChunk>(v, slot0, i, k, desc, deadline);
    });
  }

  probe(6);
}

template <typename T, bool kFused, bool kQuant = false, bool kWf32 = false>
__global__ void __launch_bounds__(kArThreads, 1)
    oneshot_kernel(const __grid_constant__ CommView v, const __grid_constant__ ArTensors t,
                   RowCfg rc, uint32_t desc) {
  oneshot_body<T, kFused, OneShotUnicast, kQuant, kWf32>(v, t, rc, desc, nullptr);
}

}  // namespace dev
}  // namespace nvc
