// MoE dispatch kernels: SEND (source side) and RECV (expert side) halves of one call.
// Layout, handle and invariants: common/moe_layout.h. Flag conventions: kernels/common.cuh.
//
// Both kernels: grid G = moe_grid_blocks(cfg, cap) x kMoeThreads (cuda/moe.cu moe_grid: up to
// the GPU's SMs, shared among the virtual ranks of one process), all blocks resident. Flags:
// Gs = moe_blocks(cfg) <= kMoeMaxBlocks per source and call, a function of the config, the same
// on every rank; G >= Gs may differ between ranks (local work only). Blocks b >= Gs publish
// through flag group b % Gs (publish_all); every receiver waits for W x Gs flags.
// A fused call (moe_dispatch) runs both halves in one cooperative kernel (dispatch_kernel), or
// as the two kernels where ranks of one process share a GPU and their grids do not fit on
// it together (cuda/moe.cu fused_fits). At world 1 a fused call is one kernel without a slot or
// flags instead (moe_local.cuh), when its routing fits shared memory.
//
// Call numbering (split or fused, moe_layout.h): SEND takes s = MoeCtrl::send_seq + 1, checks
// s - Ctrl::seq <= max_in_flight, writes s to its seq output when split, and its last block
// stores send_seq = s (finish_send; "last" = the holder of the last arrival ticket,
// send_ticket). RECV takes s = Ctrl::seq + 1, checks it against the SEND's seq (split) or
// against send_seq (fused), and its last block stores Ctrl::seq = s (finish_recv). Data and
// flags of call s live in slot s % moe_slots(cfg).
//
// SEND of a whole call whose bit masks fit shared memory (dispatch_masked_fits; decode sizes):
//   dispatch_send_masked: every block routes all n tokens (moe_route.cuh: per-expert masks, so a
//   token's idx and its row position in each destination are popcounts), then work items
//   (token, chunk of its row) over every warp of the grid copy each token once per destination;
//   the slot gets the same rows, metadata and headers as the counting SEND below writes.
// The counting SEND (bounded rounds, and masks too large), block b of G owns tokens
//   [n*b/G, n*(b+1)/G) (n = *num_tokens):
//   A. every thread takes one token of [0, t1): validates its ids (range) and, for tokens before
//      the block's chunk, adds them into shared counters cntE[expert] / cntD[dest rank] (warp-
//      aggregated shared atomics; integer sums, so the result is deterministic).
//   B. warp 0 walks the chunk in token order, 32/top_k tokens per step (lanes = (token, k)):
//      duplicate check, idx = cntE[e] + earlier lanes with the same e, pos = cntD[d] + earlier
//      tokens of the step going to d (__match_any_sync); whole block then copies each token once
//      per destination: payload (16-B vectors), scales, meta (entries in k order).
//   Block G-1 ends with the totals and writes the header of every destination. Then every
//   block: __syncthreads, st.release.sys moe_flag(s, me, b) in every rank (publish_all), or with
//   G > Gs: fence.acq_rel.sys, an arrival ticket on its flag group's counter, and the group's
//   last arrival raises flag b % Gs in every rank (publish_all).
// RECV: thread i waits for flag (src = i / Gs, block = i % Gs) (bounded, dev::wait_flag), then each
//   block stages the W headers in shared memory (one round of loads), off[src][e] = prefix
//   over sources (in place); one warp per (received row, chunk of 32 * u vectors, u <= kCopyU
//   spreading the rows over the grid's lanes) loads its part of the payload together with the
//   row's metadata, checks the metadata, and stores the part to every listed local expert row
//   off[src][e] + idx; the chunk-0 warp also copies the scales and writes the handle;
//   block 0 writes expert_counts. Packed (moe_layout.h PACKED EXPERT ROWS): every block also
//   scans tot into pre[e] (block_exclusive_scan) and the row of (le, src, idx) goes to packed
//   row pre[le] + off[src][le] + idx instead of le * W*T + off[src][le] + idx (the handle's
//   expert_src entry keeps the second index). The block with the last arrival ticket (taken after the
//   wait, common.cuh arrive_issue) advances Ctrl::seq at its end (finish_recv).
// Received metadata is range-checked before it is used as an address (kErrCapacity).
// Bounded slots (moe_layout.h BOUNDED SLOTS): a call is rounds, each a dispatch_send_rounds_kernel
// then a dispatch_recv_rounds_kernel (the <true> bodies): SEND takes the round's tokens
// [round_lo, round_lo + round_tokens) of [0, n) (a kernel parameter), blocks split them as
// above, A counts [0, t0) per expert (the call's idx) and [round_lo, t0) per destination (the
// round's positions), and block G-1 adds the tokens after the round to the per-expert totals it
// writes into the header (validating their ids); RECV reads regions of round_tokens rows. The
// whole-call kernels (<false>) are the unbounded layout's, unchanged.
//
// Failure (kernels/common.cuh; no kernel traps, so the CUDA context stays usable):
// - begin_send / begin_recv return 0 (every thread alike, by __syncthreads_or at the block's
//   first barrier) when Ctrl::failed is set, or for kErrInFlight / kErrOrder (recorded by one
//   thread; every rank runs the same calls, so every rank fails there alike): the block leaves.
// - SEND, bad input (num_tokens, an expert id, a duplicate): found after a __syncthreads, so
//   every thread of the block sees it; thread 0 records, raises the POISON flag of call s for
//   every block of this rank in every rank (poison_and_fail) and the block leaves before it
//   publishes its own flag. Blocks of the rank that did not see it publish normally; the
//   failing block's flag stays poison, so every receiver (this rank's RECV half included)
//   fails at once (kErrMismatch, "rank r failed this call").
// - RECV: wait_all_sources returns false (timeout, disagreement, poison, peer ahead; or
//   Ctrl::failed set elsewhere) to every thread of the block: the block leaves before it reads
//   the slot. Bad headers (recorded) make the block leave after the header barrier; a bad row's
//   metadata (recorded) makes its warp skip the row (warp vote), so nothing is written through
//   an unchecked index. Outputs of a failed call are unspecified.
// - The fused kernel leaves after a failed SEND half; its RECV half of a healthy block meets the
//   failing blocks' poison flags in its own slots and leaves there.
// Row copies (warp_copy): each lane keeps kCopyU 16-byte loads in flight before it stores them,
// so a row costs nvec / (32 * kCopyU) load latencies rather than nvec / 32.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "../common/moe_layout.h"
#include "common.cuh"
#include "moe_route.cuh"

namespace nvc {
namespace moe {

constexpr int kWarps = kMoeThreads / 32;

__device__ __forceinline__ uint32_t lanemask_lt() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}
__device__ __forceinline__ uint4 ld_nc_v4(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

constexpr int kCopyU = 8;  // 16-byte loads in flight per lane in a row copy

// One warp copies vectors [begin, end) of a row, vector i = ld(i), to the n destinations
// dst(j) (char*, j < n): lane l handles i = begin + l, + 32, ...; kCopyU loads are issued
// before their stores. Same stores as a one-vector-at-a-time loop, in another order.
template <class Ld, class Dst>
__device__ __forceinline__ void warp_copy(int begin, int end, int lane, int n, Ld&& ld, Dst&& dst) {
  for (int i0 = begin + lane; i0 < end; i0 += 32 * kCopyU) {
    uint4 val[kCopyU];
#pragma unroll
    for (int u = 0; u < kCopyU; ++u)
      if (i0 + 32 * u < end) val[u] = ld(i0 + 32 * u);
#pragma unroll
    for (int u = 0; u < kCopyU; ++u) {
      const int i = i0 + 32 * u;
      if (i < end)
        for (int j = 0; j < n; ++j) dev::st_v4(dst(j) + size_t(i) * 16, val[u]);
    }
  }
}

// 16-byte vectors per lane of one receive work item (a chunk of a row, one warp): the `rows`
// rows' nvec vectors spread over the G * kWarps * 32 lanes of the grid, at least 1, at most
// kCopyU (one round of loads per lane; longer items balance worse over the warps: measured,
// combine at 128 tokens x 7168 lost 18% with whole-row items). Used by both receive kernels.
__device__ __forceinline__ int cols_per_lane(int rows, int nvec, int G) {
  const int64_t lanes = int64_t(G) * kWarps * 32;
  const int64_t u = (int64_t(rows) * nvec + lanes - 1) / lanes;
  return u < 1 ? 1 : u > kCopyU ? kCopyU : int(u);
}

// Record the error (dev::fail_inline: first error of the rank wins, Ctrl::failed set), then
// raise the poison flag of call s in all of this rank's slots of every rank; returns (the
// caller's block then leaves without publishing its own flag). Recording comes first: in a
// one-kernel fused call this rank's own RECV half (other blocks of the kernel) reads the poison
// from its own slots, and its kErrMismatch must not take ErrorInfo before the real cause.
__device__ __forceinline__ void poison_and_fail(const CommView& v, const MoeConfig& c, uint64_t s,
                                             uint32_t code, uint32_t desc, int peer,
                                             uint64_t observed) {
  dev::fail_inline(v, code, desc, peer, s, observed);
  const uint64_t f = make_flag(s, kMoePoisonDesc);
  const int nblocks = moe_blocks(c);  // every flag of this rank (the flag blocks, not the grid)
  for (int r = 0; r < v.world; ++r)
    for (int b = 0; b < nblocks; ++b) dev::st_release_sys(moe_flag(v.peer_ctrl(r), c, s, v.rank, b), f);
}

// Thread i < world * nblocks waits for flag (src, block); then the whole block syncs. True
// when every flag arrived; false (every thread alike) when the call failed or was refused
// (s == 0: begin_recv refused it; nothing is waited for).
__device__ __forceinline__ bool wait_all_sources(const CommView& v, const MoeConfig& c, uint64_t s,
                                                 uint32_t desc, int nblocks) {
  const uint64_t deadline = dev::globaltimer() + v.timeout_ns;
  const uint64_t* flags = moe_flag(v.ctrl(), c, s, 0, 0);  // [src][kMoeMaxBlocks] of call s
  bool ok = s != 0;
  for (int i = threadIdx.x; ok && i < v.world * nblocks; i += blockDim.x) {
    const int src = i / nblocks, blk = i - src * nblocks;
    ok = dev::wait_flag(flags + src * kMoeMaxBlocks + blk, s, desc, v, src, deadline);
  }
  return !__syncthreads_or(!ok);
}

// Every thread: unless some thread of the block passes failed = true, publish this block's
// writes for call s (after a __syncthreads) and return true; else false, nothing published (the
// block then leaves). Grid of Gs = moe_blocks(cfg) blocks: the block raises its flag
// moe_flag(s, me, b) in every rank. A larger grid (moe_grid_blocks): block b belongs to flag
// group g = b % Gs; thread 0 orders the block's writes (fence.acq_rel.sys, after the barrier)
// before its arrival ticket on MoeCtrl::group_done[g]; the group's last arrival (it has seen
// every member's ticket, each after that member's fence: fence-fence synchronization, then its
// own fence) resets the counter and raises flag g in every rank. So a flag still covers the
// writes of every block of its group, and receivers wait for W x Gs flags whatever the grid.
// A block that fails takes no ticket: its group's flag is never raised (it stays poison).
__device__ __forceinline__ bool publish_all(const CommView& v, const MoeConfig& c, uint64_t s,
                                            uint32_t desc, bool failed = false) {
  __shared__ int s_pub;
  if (__syncthreads_or(failed)) return false;
  const int gs = moe_blocks(c), G = gridDim.x;
  int grp = blockIdx.x;
  if (G > gs) {  // grid-uniform
    grp = blockIdx.x % gs;
    if (grp + gs < G) {  // block-uniform: 2+ members; a group of one publishes as a flag block
      if (threadIdx.x == 0) {
        const unsigned others = unsigned((G - 1 - grp) / gs);  // members (b < G, b % gs == grp) - 1
        uint32_t* cnt = &moe_ctrl(v.bufs[v.rank])->group_done[grp];
        dev::fence_acq_rel_sys();
        const bool last = atomicAdd(cnt, 1u) == others;
        if (last) {
          *cnt = 0;  // for the next SEND (a later kernel: stream order)
          dev::fence_acq_rel_sys();
        }
        s_pub = last;
      }
      __syncthreads();
      if (!s_pub) return true;
    }
  }
  if (threadIdx.x < v.world)
    dev::publish_flag(moe_flag(v.peer_ctrl(threadIdx.x), c, s, v.rank, grp), make_flag(s, desc));
  return true;
}

__device__ __forceinline__ uint64_t sends_issued(const CommView& v) {
  return *reinterpret_cast<volatile uint64_t*>(&moe_ctrl(v.bufs[v.rank])->send_seq);
}
__device__ __forceinline__ uint64_t recvs_done(const CommView& v) {
  return *reinterpret_cast<volatile uint64_t*>(&v.ctrl()->seq);
}

// SEND start, every thread: this call's s, or 0 when the communicator already failed or this
// call would be more than max_in_flight SENDs ahead of this rank's RECVs (kErrInFlight, recorded
// by one thread; the same in every thread). Split: block 0 writes s to seq_out.
__device__ __forceinline__ uint64_t begin_send(const CommView& v, const MoeConfig& c, uint32_t desc,
                                               uint32_t* seq_out) {
  const uint64_t s = sends_issued(v) + 1, done = recvs_done(v);
  if (dev::comm_failed(v)) return 0;
  // every rank runs the same program, so every rank fails here alike: no poison needed
  if (s - done > uint64_t(moe_in_flight(c))) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      dev::fail_inline(v, kErrInFlight, desc, moe_in_flight(c), s, s - done);
    return 0;
  }
  if (seq_out != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *seq_out = uint32_t(s);
  return s;
}

// SEND arrival (the arrival-ticket pattern of kernels/common.cuh arrive_issue, on the send
// counters): thread 0 of every block takes a ticket after a __syncthreads that follows the
// block's reads of send_seq (begin_send), just before publish_all, so the atomic's round trip
// overlaps the fence there; the block with the last ticket stores send_seq = s (finish_send).
// (Taken at the start, the ticket would live in a register across the error paths' calls and
// be spilled.)
__device__ __forceinline__ uint32_t send_ticket(const CommView& v) {
  return threadIdx.x == 0 ? dev::arrive_issue(&moe_ctrl(v.bufs[v.rank])->send_done_blocks) : 0u;
}
__device__ __forceinline__ void finish_send(const CommView& v, uint64_t s, uint32_t ticket) {
  MoeCtrl* mc = moe_ctrl(v.bufs[v.rank]);
  if (threadIdx.x == 0 && dev::arrive_is_last(&mc->send_done_blocks, ticket))
    *reinterpret_cast<volatile uint64_t*>(&mc->send_seq) = s;
}
// RECV arrival: the same on Ctrl::seq / done_blocks (common.cuh), ticket taken after
// wait_all_sources' __syncthreads (every block has read Ctrl::seq in begin_recv by then).
__device__ __forceinline__ uint32_t recv_ticket(const CommView& v) {
  return threadIdx.x == 0 ? dev::arrive_issue(&v.ctrl()->done_blocks) : 0u;
}
__device__ __forceinline__ void finish_recv(const CommView& v, uint64_t s, uint32_t ticket) {
  if (threadIdx.x == 0 && dev::arrive_is_last(&v.ctrl()->done_blocks, ticket))
    *reinterpret_cast<volatile uint64_t*>(&v.ctrl()->seq) = s;
}

// RECV start, every thread: this call's s = Ctrl::seq + 1, checked against the SEND's seq
// (split: seq_in) or against send_seq (fused: its own SEND must be the only one outstanding);
// 0 when the communicator already failed or the check fails (kErrOrder, recorded by one
// thread; the same in every thread). wait_all_sources then makes the block leave.
__device__ __forceinline__ uint64_t begin_recv(const CommView& v, uint32_t desc, const uint32_t* seq_in) {
  const uint64_t s = recvs_done(v) + 1;
  if (dev::comm_failed(v)) return 0;
  const uint64_t got = seq_in != nullptr ? uint64_t(__ldg(seq_in)) : sends_issued(v);
  if (seq_in != nullptr ? uint32_t(got) != uint32_t(s) : got != s) {
    if (blockIdx.x == 0 && threadIdx.x == 0)
      dev::fail_inline(v, kErrOrder, desc, seq_in != nullptr ? 0 : -1, s, got);
    return 0;
  }
  return s;
}

// RECV start inside a fused kernel: s is its SEND half's (send_seq may not be stored yet: the
// SEND's last block stores it); the RECV must still be the next one (Ctrl::seq + 1); 0 if not
// (kErrOrder).
__device__ __forceinline__ uint64_t begin_recv_fused(const CommView& v, uint32_t desc, uint64_t s) {
  const uint64_t next = recvs_done(v) + 1;
  if (next == s) return s;
  if (blockIdx.x == 0 && threadIdx.x == 0) dev::fail_inline(v, kErrOrder, desc, -1, s, next);
  return 0;
}

struct DispatchSendArgs {
  const uint8_t* x;          // [T, H] payload
  const float* x_scale;      // [T, S] or null when S == 0
  const int32_t* ids;        // [T, K]
  const int32_t* num_tokens; // device scalar, null = T
  int32_t* token_dest;       // handle [T, K]
  uint32_t* seq_out;         // split: the call's seq, for the RECV (scalar); null when fused
  // Rounds kernels only (bounded slots, dispatch_round_args): this round's source tokens
  // [round_lo, round_lo + round_tokens), cut at num_tokens.
  int round_lo = 0, round_tokens = 0;
};

__host__ __device__ inline size_t dispatch_send_smem(const MoeConfig& c) {
  return 4 * (size_t(c.num_experts) + 16 + size_t(kMoeSubTokens) * (16 + c.top_k));
}

// The masked SEND (whole calls whose masks fit: dispatch_masked_fits): shared memory emask
// [E][words] and pre [E + 1] (moe_route.cuh), dmask [W][words] (token t goes to rank d).
__host__ __device__ inline size_t dispatch_masked_smem(const MoeConfig& c) {
  return route_smem(c) + 4 * size_t(c.world) * route_words(c);
}
NVC_HD bool dispatch_masked_fits(const MoeConfig& c) { return dispatch_masked_smem(c) <= kRouteMaxSmem; }
// Dynamic shared memory of the whole-call SEND kernel (masked or counting).
__host__ __device__ inline size_t dispatch_whole_send_smem(const MoeConfig& c) {
  return dispatch_masked_fits(c) ? dispatch_masked_smem(c) : dispatch_send_smem(c);
}

// The SEND half of a whole call by bit-mask routing (moe_route.cuh), every thread of the block;
// returns s or 0 as dispatch_send_body. Every block routes all n tokens (route_masks: ids
// checked, repeats found, per-expert masks and counts), ORs the masks of each rank's experts
// into dmask, then takes work items (token t < n, chunk of 32 * u vectors, u = cols_per_lane)
// over every warp of the grid: lanes d < W find whether t goes to rank d and its row there, pos
// = route_idx(dmask[d], t) (the earlier tokens going to d); each lane loads its u vectors of x[t]
// and stores them to every destination row; the chunk-0 warp also writes the scales, the
// metadata (t, m, then (le | k << 16, idx = route_idx(emask[e], t)) in k order) and token_dest.
// Block G-1 writes the headers (rows = popcount of dmask[d], counts from pre). The slot then
// holds what the counting SEND writes (the same rows, positions, metadata and headers).
__device__ __forceinline__ uint64_t dispatch_send_masked(const CommView& v, const MoeConfig& c,
                                                         const DispatchSendArgs& a) {
  extern __shared__ int32_t smem[];
  const int E = c.num_experts, K = c.top_k, W = c.world, T = c.max_tokens, L = E / W;
  const int nw = route_words(c);
  uint32_t* emask = reinterpret_cast<uint32_t*>(smem);        // [E][nw]
  int32_t* pre = smem + E * nw;                                // [E + 1]
  uint32_t* dmask = reinterpret_cast<uint32_t*>(pre + E + 1);  // [W][nw]
  __shared__ RouteBad s_bad;
  __shared__ char* s_dst[kWarps][kMaxWorld];
  __shared__ int s_drank[kWarps][kMaxWorld];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, b = blockIdx.x, G = gridDim.x;
  const uint32_t desc = moe_dispatch_desc(c);
  dev::probe(0);
  const int n = a.num_tokens ? __ldg(a.num_tokens) : T;  // requested with the counters
  const uint64_t s = begin_send(v, c, desc, a.seq_out);
  const bool bad_n = n < 0 || n > T;  // the same in every block
  if (__syncthreads_or(s == 0 || bad_n)) {
    if (s != 0 && tid == 0) poison_and_fail(v, c, s, kErrCapacity, desc, n, uint64_t(T));
    return 0;
  }
  dev::probe(1);
  route_masks(a.ids, n, E, K, nw, emask, pre, s_bad);
  if (s_bad.flag) {  // block-uniform (after the routing's barriers)
    if (tid == 0) poison_and_fail(v, c, s, kErrBadExpert, desc, s_bad.val,
                                  bad_expert_detail(s_bad.tok, s_bad.slot, s_bad.rep != 0));
    return 0;
  }
  for (int i = tid; i < W * nw; i += blockDim.x) {
    const int d = i / nw, w = i - d * nw;
    uint32_t m = 0;
    for (int le = 0; le < L; ++le) m |= emask[(d * L + le) * nw + w];
    dmask[i] = m;
  }
  __syncthreads();
  dev::probe(2);
  for (size_t i = size_t(n) * K + size_t(b) * blockDim.x + tid; i < size_t(T) * K; i += size_t(G) * blockDim.x)
    a.token_dest[i] = -1;
  if (b == G - 1) {
    for (int i = tid; i < W * (1 + L); i += blockDim.x) {
      const int d = i / (1 + L), j = i - d * (1 + L);
      int val = 0;
      if (j == 0) {
        for (int w = 0; w < nw; ++w) val += __popc(dmask[d * nw + w]);
      } else {
        val = pre[d * L + j] - pre[d * L + j - 1];
      }
      moe_hdr(moe_half(v.bufs[d], c, s), c, v.rank)[j] = val;
    }
  }
  const size_t xrow = moe_x_row_bytes(c), scale_off = moe_scale_off(c), meta_off = moe_meta_off(c);
  const int nvec = int(xrow / 16), S = c.scale_cols;
  const int cw = 32 * cols_per_lane(n, nvec, G), nch = (nvec + cw - 1) / cw;
  for (int item = b * kWarps + warp; item < n * nch; item += G * kWarps) {
    const int t = item / nch, ch = item - t * nch;
    const int i0 = ch * cw + lane, iend = min(nvec, (ch + 1) * cw);
    const uint8_t* xr = a.x + size_t(t) * xrow;
    uint4 val[kCopyU];
#pragma unroll
    for (int u = 0; u < kCopyU; ++u)
      if (i0 + 32 * u < iend) val[u] = ld_nc_v4(xr + size_t(i0 + 32 * u) * 16);
    // destinations of this token, ascending rank (lane d)
    const bool to = lane < W && ((dmask[lane * nw + (t >> 5)] >> (t & 31)) & 1u) != 0u;
    const uint32_t dbal = __ballot_sync(0xFFFFFFFFu, to);
    const int nd = __popc(dbal);
    if (to) {
      const int q = __popc(dbal & lanemask_lt());
      s_dst[warp][q] = moe_drow_in(moe_half(v.bufs[lane], c, s), c, T, v.rank,
                                   route_idx(dmask, nw, lane, t));
      s_drank[warp][q] = lane;
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < kCopyU; ++u) {
      const int i = i0 + 32 * u;
      if (i < iend)
        for (int j = 0; j < nd; ++j) dev::st_v4(s_dst[warp][j] + size_t(i) * 16, val[u]);
    }
    if (ch == 0) {  // warp-uniform
      const int e = lane < K ? __ldg(a.ids + size_t(t) * K + lane) : -1;  // checked in the routing
      if (lane < K) a.token_dest[size_t(t) * K + lane] = e;
      const int idx = e >= 0 ? route_idx(emask, nw, e, t) : 0;
      for (int i = lane; i < S; i += 32) {
        const float f = __ldg(a.x_scale + size_t(t) * S + i);
        for (int j = 0; j < nd; ++j) reinterpret_cast<float*>(s_dst[warp][j] + scale_off)[i] = f;
      }
      for (int j = 0; j < nd; ++j) {
        const int d = s_drank[warp][j];
        const bool in = e >= 0 && e / L == d;
        const uint32_t bal = __ballot_sync(0xFFFFFFFFu, in);
        int32_t* meta = reinterpret_cast<int32_t*>(s_dst[warp][j] + meta_off);
        if (in) {
          const int q = __popc(bal & lanemask_lt());
          meta[2 + 2 * q] = (e - d * L) | (lane << 16);
          meta[3 + 2 * q] = idx;
        }
        if (lane == 0) { meta[0] = t; meta[1] = __popc(bal); }
      }
    }
    __syncwarp();  // s_dst[warp] is rewritten by the warp's next item
  }
  dev::probe(3);
  const uint32_t ticket = send_ticket(v);  // its round trip overlaps publish_all's release
  publish_all(v, c, s, desc);
  finish_send(v, s, ticket);
  dev::probe(4);
  return s;
}

// The SEND half, every thread of the block; returns the call's s, or 0 (every thread alike)
// when the call failed or was refused here: the block then publishes nothing and leaves.
// kRounds: a round of a bounded call (its own kernel, dispatch_send_rounds_kernel, so the
// whole-call kernels keep their registers); else the whole call (round_tokens 0).
template <bool kRounds = false>
__device__ __forceinline__ uint64_t dispatch_send_body(const CommView& v, const MoeConfig& c,
                                                       const DispatchSendArgs& a) {
  if (!kRounds && dispatch_masked_fits(c)) return dispatch_send_masked(v, c, a);
  extern __shared__ int32_t smem[];
  const int E = c.num_experts, K = c.top_k, W = c.world, T = c.max_tokens, L = E / W;
  int32_t* cntE = smem;                                 // [E] tokens before the cursor, per expert
  int32_t* cntD = cntE + E;                             // [16] tokens before the cursor, per dest rank
  int32_t* sub_pos = cntD + 16;                         // [kMoeSubTokens][16] slot in dest, -1 = none
  int32_t* sub_idx = sub_pos + kMoeSubTokens * 16;      // [kMoeSubTokens][K] idx within (me, expert)
  __shared__ int s_bad, s_badval, s_badtok, s_badslot, s_badrep;
  __shared__ char* s_dst[kWarps][kMaxWorld];
  __shared__ int s_drank[kWarps][kMaxWorld];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, b = blockIdx.x, G = gridDim.x;
  const uint32_t desc = moe_dispatch_desc(c);
  dev::probe(0);
  const int n = a.num_tokens ? __ldg(a.num_tokens) : T;  // requested with the counters
  const uint64_t s = begin_send(v, c, desc, a.seq_out);
  const bool bad_n = n < 0 || n > T;  // the same in every block
  // kRounds: this round's tokens [r0, r1) of [0, n); block b owns [t0, t1) of them.
  const int nn = kRounds && !bad_n ? n : 0, r0 = kRounds ? min(nn, a.round_lo) : 0;
  const int r1 = kRounds ? min(nn, r0 + a.round_tokens) : n;
  const int t0 = kRounds ? r0 + int(int64_t(r1 - r0) * b / G) : int(int64_t(n) * b / G);
  const int t1 = kRounds ? r0 + int(int64_t(r1 - r0) * (b + 1) / G) : int(int64_t(n) * (b + 1) / G);
  for (int i = tid; i < E; i += blockDim.x) cntE[i] = 0;
  if (tid < 16) cntD[tid] = 0;
  if (tid == 0) s_bad = 0;
  if (__syncthreads_or(s == 0 || bad_n)) {
    if (s != 0 && tid == 0) poison_and_fail(v, c, s, kErrCapacity, desc, n, uint64_t(T));
    return 0;
  }

  dev::probe(1);
  // A. validate [0, t1), count [0, t0) per expert (idx is the call's) and [r0, t0) per
  // destination (positions restart every round).
  for (int base = 0; base < t1; base += blockDim.x) {
    const int t = base + tid;
    const bool act = t < t1, before = t < t0;
    uint32_t dmask = 0;
    constexpr int kIdU = 8;  // ids requested together (the loop body syncs the warp)
    for (int k0 = 0; k0 < K; k0 += kIdU) {
      int ebuf[kIdU];
#pragma unroll
      for (int u = 0; u < kIdU; ++u)
        ebuf[u] = act && k0 + u < K ? __ldg(a.ids + size_t(t) * K + k0 + u) : -1;
#pragma unroll
      for (int u = 0; u < kIdU; ++u) {
        const int k = k0 + u;
        if (k >= K) break;  // K is the same in every lane: the warp stays converged
        int e = ebuf[u];
        if (e < -1 || e >= E) {
          if (atomicExch(&s_bad, 1) == 0) { s_badval = e; s_badtok = t; s_badslot = k; s_badrep = 0; }
          e = -1;
        }
        const bool use = before && e >= 0;
        if (__any_sync(0xFFFFFFFFu, use)) {  // warp-uniform: no match when nothing counts
          const uint32_t peers = __match_any_sync(0xFFFFFFFFu, use ? e : -2 - lane);
          if (use && lane == __ffs(peers) - 1) atomicAdd(&cntE[e], __popc(peers));
        }
        if (use && (!kRounds || t >= r0)) dmask |= 1u << (e / L);
      }
    }
    for (int d = 0; d < W; ++d) {
      const uint32_t bal = __ballot_sync(0xFFFFFFFFu, (dmask >> d) & 1u);
      if (lane == 0 && bal) atomicAdd(&cntD[d], __popc(bal));
    }
  }
  __syncthreads();
  if (s_bad) {
    if (tid == 0) poison_and_fail(v, c, s, kErrBadExpert, desc, s_badval,
                                    bad_expert_detail(s_badtok, s_badslot, s_badrep != 0));
    return 0;
  }

  dev::probe(2);
  const size_t xrow = moe_x_row_bytes(c), scale_off = moe_scale_off(c), meta_off = moe_meta_off(c);
  const int nvec = int(xrow / 16), S = c.scale_cols;
  // B. the chunk, kMoeSubTokens tokens at a time.
  for (int sb = t0; sb < t1; sb += kMoeSubTokens) {
    const int se = min(sb + kMoeSubTokens, t1);
    for (int i = tid; i < kMoeSubTokens * 16; i += blockDim.x) sub_pos[i] = -1;
    __syncthreads();
    if (warp == 0) {
      const int tpw = 32 / K, lt_in = lane / K, k = lane - lt_in * K;
      const uint32_t ltm = lanemask_lt();
      for (int tb = sb; tb < se; tb += tpw) {
        const int t = tb + lt_in;
        const bool act = lt_in < tpw && t < se;
        const int e = act ? __ldg(a.ids + size_t(t) * K + k) : -1;  // range checked in A
        const bool valid = e >= 0;
        const int d = valid ? e / L : 0;
        const uint32_t pdup = __match_any_sync(0xFFFFFFFFu, valid ? lt_in * kMoeMaxExperts + e : -2 - lane);
        if (valid && __popc(pdup) > 1 && atomicExch(&s_bad, 1) == 0) {
          s_badval = e; s_badtok = t; s_badslot = k; s_badrep = 1;
        }
        const uint32_t pe = __match_any_sync(0xFFFFFFFFu, valid ? e : -2 - lane);
        const uint32_t pd = __match_any_sync(0xFFFFFFFFu, valid ? lt_in * 16 + d : -2 - lane);
        const bool first = valid && lane == __ffs(pd) - 1;  // first slot of this token for rank d
        const uint32_t pf = __match_any_sync(0xFFFFFFFFu, first ? d : -2 - lane);
        if (valid) sub_idx[(t - sb) * K + k] = cntE[e] + __popc(pe & ltm);
        if (first) sub_pos[(t - sb) * 16 + d] = cntD[d] + __popc(pf & ltm);
        __syncwarp();
        if (valid && lane == 31 - __clz(pe)) cntE[e] += __popc(pe);
        if (first && lane == 31 - __clz(pf)) cntD[d] += __popc(pf);
        __syncwarp();
      }
    }
    __syncthreads();
    if (s_bad) {
      if (tid == 0) poison_and_fail(v, c, s, kErrBadExpert, desc, s_badval,
                                    bad_expert_detail(s_badtok, s_badslot, s_badrep != 0));
      return 0;
    }
    dev::probe(13);
    // Fewer tokens than warps (decode): a token's row is split over wpt warps (part p copies
    // vectors [nvec*p/wpt, nvec*(p+1)/wpt)); part 0 also writes scales, metadata and handle.
    const int ntok = se - sb, wpt = ntok >= kWarps ? 1 : kWarps / ntok;
    for (int wi = warp; wi < ntok * wpt; wi += kWarps) {
      const int lt = wi / wpt, part = wi - lt * wpt, t = sb + lt;
      // Destinations of this token, ascending rank.
      const int pos = lane < W ? sub_pos[lt * 16 + lane] : -1;
      const uint32_t dbal = __ballot_sync(0xFFFFFFFFu, pos >= 0);
      const int nd = __popc(dbal);
      if (pos >= 0) {
        const int q = __popc(dbal & lanemask_lt());
        s_dst[warp][q] = moe_drow_in(moe_half(v.bufs[lane], c, s), c,
                                     kRounds ? a.round_tokens : T, v.rank, pos);
        s_drank[warp][q] = lane;
      }
      __syncwarp();
      // before the copy
      const int e = part == 0 && lane < K ? __ldg(a.ids + size_t(t) * K + lane) : -1;
      const uint8_t* xr = a.x + size_t(t) * xrow;
      warp_copy(nvec * part / wpt, nvec * (part + 1) / wpt, lane, nd,
                [&](int i) { return ld_nc_v4(xr + size_t(i) * 16); },
                [&](int j) { return s_dst[warp][j]; });
      if (part != 0) {  // warp-uniform
        __syncwarp();   // s_dst[warp] is rewritten by the warp's next token
        continue;
      }
      for (int i = lane; i < S; i += 32) {
        const float f = __ldg(a.x_scale + size_t(t) * S + i);
        for (int j = 0; j < nd; ++j) reinterpret_cast<float*>(s_dst[warp][j] + scale_off)[i] = f;
      }
      if (lane < K) a.token_dest[size_t(t) * K + lane] = e;
      const int idx = e >= 0 ? sub_idx[lt * K + lane] : 0;
      for (int j = 0; j < nd; ++j) {
        const int d = s_drank[warp][j];
        const bool in = e >= 0 && e / L == d;
        const uint32_t bal = __ballot_sync(0xFFFFFFFFu, in);
        int32_t* meta = reinterpret_cast<int32_t*>(s_dst[warp][j] + meta_off);
        if (in) {
          const int q = __popc(bal & lanemask_lt());
          meta[2 + 2 * q] = (e - d * L) | (lane << 16);
          meta[3 + 2 * q] = idx;
        }
        if (lane == 0) { meta[0] = t; meta[1] = __popc(bal); }
      }
      __syncwarp();
    }
    dev::probe(14);
    __syncthreads();
  }
  dev::probe(3);
  // Handle rows past num_tokens.
  for (size_t i = size_t(n) * K + size_t(b) * blockDim.x + tid; i < size_t(T) * K; i += size_t(G) * blockDim.x)
    a.token_dest[i] = -1;
  // Block G-1 now holds the round's rows per destination and the per-expert counts of the
  // tokens [0, r1); a round before the last (bounded slots) adds those of [r1, n), validating
  // their ids: the header carries the call's totals in every round (the offsets off[e][src]).
  if (kRounds && b == G - 1 && r1 < nn) {  // block-uniform
    for (int t = r1 + tid; t < nn; t += blockDim.x)
      for (int k = 0; k < K; ++k) {
        const int e = __ldg(a.ids + size_t(t) * K + k);
        if (e < -1 || e >= E) {
          if (atomicExch(&s_bad, 1) == 0) { s_badval = e; s_badtok = t; s_badslot = k; s_badrep = 0; }
        } else if (e >= 0) {
          atomicAdd(&cntE[e], 1);
        }
      }
    __syncthreads();
    if (s_bad) {
      if (tid == 0) poison_and_fail(v, c, s, kErrBadExpert, desc, s_badval,
                                    bad_expert_detail(s_badtok, s_badslot, s_badrep != 0));
      return 0;
    }
  }
  if (b == G - 1) {
    for (int i = tid; i < W * (1 + L); i += blockDim.x) {
      const int d = i / (1 + L), j = i - d * (1 + L);
      moe_hdr(moe_half(v.bufs[d], c, s), c, v.rank)[j] = j == 0 ? cntD[d] : cntE[d * L + j - 1];
    }
  }
  const uint32_t ticket = send_ticket(v);  // its round trip overlaps publish_all's release
  publish_all(v, c, s, desc);
  finish_send(v, s, ticket);
  dev::probe(4);
  return s;
}

__global__ void __launch_bounds__(kMoeThreads) dispatch_send_kernel(CommView v, MoeConfig c, DispatchSendArgs a) {
  dispatch_send_body(v, c, a);
}
__global__ void __launch_bounds__(kMoeThreads) dispatch_send_rounds_kernel(CommView v, MoeConfig c,
                                                                        DispatchSendArgs a) {
  dispatch_send_body<true>(v, c, a);
}

struct DispatchRecvArgs {
  uint8_t* expert_x;       // [L, W*T, H], or packed [P, H] (moe_layout.h)
  int32_t* expert_counts;  // [L]
  float* expert_x_scale;   // [L, W*T, S] (packed: [P, S]) or null when S == 0
  int32_t* expert_src;     // handle [L, W*T]
  const uint32_t* seq_in;  // split: the SEND's seq output; null when fused
  bool packed = false;     // expert_x / expert_x_scale in the packed form
  int region_rows = 0;     // rounds kernels: rows of a source's region (moe_dispatch_round_tokens)
};

// The round fields of the dispatch arguments for round r (kernel parameters: read from the
// constant bank, no registers or divisions in the kernels).
inline void dispatch_round_args(const MoeConfig& c, int r, DispatchSendArgs* sa,
                                DispatchRecvArgs* ra) {
  const int Td = moe_dispatch_round_tokens(c);
  if (sa != nullptr) {
    sa->round_lo = moe_bounded(c) ? r * Td : 0;
    sa->round_tokens = moe_bounded(c) ? Td : 0;
  }
  if (ra != nullptr) ra->region_rows = moe_bounded(c) ? Td : 0;
}

__host__ __device__ inline size_t dispatch_recv_smem(const MoeConfig& c) {
  // tot [L], the W headers [W][1 + L] (their counts become the offsets off[src][le]), then
  // pre [L + 1] (packed: the first packed row of each local expert)
  return 4 * (size_t(moe_local_experts(c)) + size_t(c.world) * (1 + moe_local_experts(c)) +
              size_t(moe_local_experts(c)) + 1);
}

// The RECV half, every thread of the block. known_s: 0 = a kernel of its own (s from
// begin_recv); else the s of the SEND half that just ran in the same kernel (dispatch_kernel).
// kRounds: a round of a bounded call (regions of a.region_rows rows); else regions of T rows.
template <bool kRounds = false>
__device__ __forceinline__ void dispatch_recv_body(const CommView& v, const MoeConfig& c,
                                                   const DispatchRecvArgs& a, uint64_t known_s) {
  extern __shared__ int32_t smem[];
  const int E = c.num_experts, K = c.top_k, W = c.world, T = c.max_tokens, L = E / W;
  int32_t* tot = smem;     // [L] rows of each local expert
  int32_t* hdr = tot + L;  // [W][1 + L]: row count of src, then per expert the count, which the
                           // prefix over sources turns into off = the first expert row of src
  int32_t* pre = hdr + W * (1 + L);  // [L + 1] packed: first packed row of each local expert
  __shared__ int32_t s_rows[kMaxWorld + 1];
  __shared__ size_t s_erow[kWarps][32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, b = blockIdx.x, G = gridDim.x;
  const uint32_t desc = moe_dispatch_desc(c);
  if (known_s == 0) dev::probe(0);
  const uint64_t s = known_s == 0 ? begin_recv(v, desc, a.seq_in) : begin_recv_fused(v, desc, known_s);
  if (!wait_all_sources(v, c, s, desc, moe_blocks(c))) return;
  const uint32_t ticket = recv_ticket(v);
  dev::probe(5);

  char* half = moe_half(v.bufs[v.rank], c, s);
  // The W headers into shared memory in one round of loads (every word is independent), then
  // checked and summed from there.
  for (int i = tid; i < W * (1 + L); i += blockDim.x) {
    const int src = i / (1 + L);
    hdr[i] = __ldcg(moe_hdr(half, c, src) + (i - src * (1 + L)));
  }
  __syncthreads();
  bool bad = false;  // a header out of range (recorded): the block leaves after the barrier
  if (tid == 0) {
    int acc = 0;
    const int Td = kRounds ? a.region_rows : T;  // a region's rows
    for (int src = 0; src < W; ++src) {
      const int r = hdr[src * (1 + L)];
      if (r < 0 || r > Td) {
        dev::fail_inline(v, kErrCapacity, desc, src, s, uint64_t(uint32_t(r)));
        bad = true;
      }
      s_rows[src] = acc;
      acc += r;
    }
    s_rows[W] = acc;
  }
  for (int le = tid; le < L; le += blockDim.x) {
    int acc = 0;
    for (int src = 0; src < W; ++src) {
      int32_t* h = hdr + src * (1 + L) + 1 + le;  // this thread's column only: no race
      const int cnt = *h;
      if (cnt < 0 || cnt > T) {
        dev::fail_inline(v, kErrCapacity, desc, src, s, uint64_t(uint32_t(cnt)));
        bad = true;
      }
      *h = acc;
      acc += cnt;
    }
    tot[le] = acc;
    if (b == 0) a.expert_counts[le] = acc;
  }
  if (__syncthreads_or(bad)) return;
  if (a.packed) {  // the same branch in every thread
    block_exclusive_scan(tot, pre, L);
    if (pre[L] > int64_t(moe_packed_rows(c))) {  // headers a real sender cannot produce
      if (tid == 0) dev::fail_inline(v, kErrCapacity, desc, 0, s, uint64_t(uint32_t(pre[L])));
      return;  // every thread alike (pre is shared)
    }
  }

  const size_t xrow = moe_x_row_bytes(c), scale_off = moe_scale_off(c), meta_off = moe_meta_off(c);
  dev::probe(6);
  const size_t erows = moe_expert_rows(c);
  const int nvec = int(xrow / 16), S = c.scale_cols, maxent = moe_max_entries(c), R = s_rows[W];
  // work items (row g, chunk ch of cw = 32 * u vectors, u <= kCopyU the vectors per lane that
  // spread the R rows over the grid's lanes) over every warp of the grid; each lane issues its
  // u payload loads together with the row's metadata loads (the payload's address depends on
  // the headers only), then checks the metadata and stores; chunk 0 also writes the handle and
  // the scales
  const int cw = 32 * cols_per_lane(R, nvec, G);
  const int nch = (nvec + cw - 1) / cw;
  for (int item = b * kWarps + warp; item < R * nch; item += G * kWarps) {
    const int g = item / nch, ch = item - g * nch;
    int src = 0;
    while (g >= s_rows[src + 1]) ++src;
    const char* row = moe_drow_in(half, c, kRounds ? a.region_rows : T, src, g - s_rows[src]);
    const int32_t* meta = reinterpret_cast<const int32_t*>(row + meta_off);
    const int i0 = ch * cw + lane, iend = min(nvec, (ch + 1) * cw);
    uint4 val[kCopyU];
#pragma unroll
    for (int u = 0; u < kCopyU; ++u)
      if (i0 + 32 * u < iend) val[u] = dev::ld_cg_v4(row + size_t(i0 + 32 * u) * 16);
    const int t = __ldcg(meta), m = __ldcg(meta + 1);
    const int lek = lane < maxent ? __ldcg(meta + 2 + 2 * lane) : 0;
    const int idx = lane < maxent ? __ldcg(meta + 3 + 2 * lane) : 0;
    if (t < 0 || t >= T || m < 1 || m > maxent) {  // the same in every lane: the warp skips
      if (lane == 0)
        dev::fail_inline(v, kErrCapacity, desc, src, s,
                         (uint64_t(uint32_t(t)) << 32) | uint32_t(m));
      continue;
    }
    bool bad_meta = false;
    if (lane < m) {
      const int le = lek & 0xFFFF, k = lek >> 16;
      const int32_t* off = hdr + 1 + le;  // off[src * (1 + L)]: first row of (le, src)
      if (le >= L || k >= K || idx < 0 ||
          idx >= (src + 1 < W ? off[(src + 1) * (1 + L)] : tot[le]) - off[src * (1 + L)]) {
        dev::fail_inline(v, kErrCapacity, desc, src, s,
                         (uint64_t(uint32_t(lek)) << 32) | uint32_t(idx));
        bad_meta = true;
      } else {
        const size_t er = size_t(le) * erows + off[src * (1 + L)] + idx;
        if (ch == 0) a.expert_src[er] = (src * T + t) * K + k;
        s_erow[warp][lane] = a.packed ? size_t(pre[le]) + off[src * (1 + L)] + idx : er;
      }
    }
    if (__any_sync(0xFFFFFFFFu, bad_meta)) continue;  // nothing written through a bad entry
    __syncwarp();
#pragma unroll
    for (int u = 0; u < kCopyU; ++u) {
      const int i = i0 + 32 * u;
      if (i < iend)
        for (int j = 0; j < m; ++j)
          dev::st_v4(reinterpret_cast<char*>(a.expert_x + s_erow[warp][j] * xrow) + size_t(i) * 16,
                     val[u]);
    }
    for (int i = lane; ch == 0 && i < S; i += 32) {
      const float f = __ldcg(reinterpret_cast<const float*>(row + scale_off) + i);
      for (int j = 0; j < m; ++j) a.expert_x_scale[s_erow[warp][j] * S + i] = f;
    }
    __syncwarp();
  }
  dev::probe(7);
  finish_recv(v, s, ticket);
}

__global__ void __launch_bounds__(kMoeThreads) dispatch_recv_kernel(CommView v, MoeConfig c, DispatchRecvArgs a) {
  dispatch_recv_body(v, c, a, 0);
}
__global__ void __launch_bounds__(kMoeThreads) dispatch_recv_rounds_kernel(CommView v, MoeConfig c,
                                                                        DispatchRecvArgs a) {
  dispatch_recv_body<true>(v, c, a, 0);
}

// A fused dispatch in one kernel: the SEND half, then (after the block published its flags) the
// RECV half of the same call. The RECV half waits for the flags of every block of every rank,
// this kernel's own included, so the grid's blocks must all be resident (moe_grid: at most the SMs).
// Dynamic shared memory: max(dispatch_whole_send_smem, dispatch_recv_smem); the RECV half writes it
// only after wait_all_sources' barrier, when every thread of the block is past publish_all.
__global__ void __launch_bounds__(kMoeThreads, 1) dispatch_kernel(CommView v, MoeConfig c,
                                                               DispatchSendArgs sa,
                                                               DispatchRecvArgs ra) {
  const uint64_t s = dispatch_send_body(v, c, sa);
  if (s == 0) return;
  dispatch_recv_body(v, c, ra, s);
}

}  // namespace moe
}  // namespace nvc
