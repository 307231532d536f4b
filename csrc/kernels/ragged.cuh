// ragged_all_to_all (lax.ragged_all_to_all's semantics) over the flag protocol: one kernel per
// call. Semantics, data-half layout (header of RaggedSlice entries + a landing frame that mirrors
// the receiver's output rows), flags, descriptor, error codes and the 4-step protocol are shared
// with the host protocol and live in common/ragged_layout.h; this header adds what is kernel's.
//
// Grid: G = ragged_blocks (cuda/ragged.cu: one block per ~32 KiB of the larger of operand and
// output, 1..kMaxBlocks; fewer for virtual ranks sharing a GPU) blocks of kRaggedThreads threads
// on every rank, a pure function of the static sizes. Block b of rank `me`, call s (p = s & 1):
//   0. a block of a failed communicator (Ctrl::failed, read with s) leaves at once, before
//      anything is read or written (kernels/common.cuh "Failure"), found with step 1's vote.
//   1. validate: the threads stride over all K = k * W slices (int32 or int64 offsets, widened
//      to int64; ragged_slice_field, the host protocol's test too). Any bad slice: thread 0
//      raises the poison flag of every block at every peer first (poison_flags), then the
//      threads find the first bad index together (each its first in its stride, the smallest
//      through a shared atomicMin: ragged_first_bad) and thread 0 records kErrRaggedSlice (that
//      index and field); the whole block returns. Every block reads the same inputs, so every
//      block fails alike and none has written anything.
//   2. push: for every peer d (me+1, me+2, ... so the ranks write to a permutation of the peers
//      at each step), in chunks of kRaggedChunk slices: threads j < chunk read slice d*k+j's
//      (offset, size, output offset) into shared memory and store its header entry
//      {output offset, size} at d with one 16-byte store; __syncthreads; the block copies its
//      ragged_cut share of each slice operand -> d's frame (block_copy: 16-byte vectors when
//      source and destination agree modulo 16, else 8/4/2/1; bytes at the unaligned ends; four
//      loads in flight per thread). Exactly the slice's bytes cross NVLink: nothing is padded
//      to a row capacity. Then __syncthreads and lanes t < W-1 of warp 0 publish flag
//      flags[p][0][me][b] at peer (me+1+t) % W with st.release.sys: one warp-wide release (one
//      MEMBAR.SYS per block and call, whatever W), cumulative over the block's stores by the
//      barrier before it.
//   self: the block copies its share of my own k slices operand -> out (no frame, no flag),
//      while the peers' pushes are in flight; a size that differs from my recv_sizes entry ->
//      kErrRaggedRecv naming me (the staging threads check, __syncthreads_or, ragged_first_bad
//      picks the first, thread 0 reports; my flags are already up, so no peer is left waiting).
//   3. receive: for every src != me (me-1, me-2, ...): thread 0 waits for flags[p][0][src][b]
//      (bounded, names src; gives up when another block of the rank failed, poll_flag);
//      __syncthreads_or broadcasts a failure (the block returns). Per
//      chunk: threads j < chunk read header entry src*k+j (ld.cg, L2: written by src over NVLink)
//      and recv_sizes[src*k+j]; a size that differs -> kErrRaggedRecv naming src, an entry
//      outside [0, M) rows (impossible after src's step 1: memory corruption) ->
//      kErrRaggedSlice naming src (ragged_slice_detail(me*k+j, 4): slice me*k+j of src's call,
//      as the host protocol); both found with __syncthreads_or, the first by ragged_first_bad,
//      reported by thread 0, the block returns. Else the
//      block copies its ragged_cut share of each slice my frame -> out (ld.cg loads; the same
//      byte offsets, as the frame mirrors out).
//   4. finish_call: the last block advances Ctrl::seq.
//
// Why it is safe (beyond ragged_layout.h's invariants):
// - Block b of the receiver reads exactly the frame bytes block b of the sender wrote: both cut
//   the same slice (output offset, size) with the same (G, b), the receiver taking offset and
//   size from the header entry, which equals the sender's arrays once the size check passed.
//   Block b's flag publishes them and the header entries (every block writes the same values).
// - A block never waits for another block of its own rank, and publishes before it waits: no
//   cycle, so no cooperative launch and no grid-wide barrier. Every failure (bad slice, wait
//   failure, size mismatch) is seen by the whole block through __syncthreads_or and ends it with
//   a plain return before any further data access (only finish_call is skipped, which the
//   failed communicator never needs again): no kernel traps, so the CUDA context stays usable
//   and out is unspecified after a failed call (the rows already copied, the rest untouched).
// - Nothing outside [0, M) rows of a frame or of out is written: step 1 runs before any push and
//   the receiver re-checks the header's rows. out is written only where slices land.
// - Shared staging arrays: every refill is preceded by a __syncthreads after the previous
//   chunk's readers, every read by the __syncthreads after the fill.
//
// Chunked path (ragged_chunked_kernel; protocol and slots in ragged_layout.h "Chunked path"):
// for outputs larger than the landing frame, chosen by the static chunk = C > 0.
// Design, against the alternatives:
// - pull from the senders' staged rows would stage what is sent (N rows per rank: no bound
//   either, MaxText's operand is as large as its dispatch output's real rows), and XLA-allocated
//   collective memory for the result (results_memory_spaces) would make XLA's allocator, not
//   the communicator, hold the call's size, with copies around the call; the chunked push keeps
//   the memory of the communicator as it is (one flag half), moves every byte over NVLink once
//   (as the single round) and adds one local copy per received byte (slot -> out, which the
//   single round does too: frame -> out).
// - per-(pair, block) round sequences, not a grid-wide round: no block waits for another block
//   of its rank, so there is no cooperative launch; a pair whose stream is short finishes early.
// - two slots per pair (double buffering): the sender pushes round r + 1 while the receiver
//   copies round r out; with one slot every round would cost a full round trip.
// Block b of rank `me`, call s:
//   0/1. as ragged_kernel (a failed communicator leaves; validation, poison, first bad slice),
//     the poison covering the round counters too (ragged_poison_chunked).
//   stream sizes: threads t < W sum my send_sizes for peer t and my recv_sizes from peer t
//     (negative entries as 0: the header check catches them) into shared memory: the rounds of
//     each pair, and the rank's number of rounds (their maximum over peers).
//   round r: sends to me+1, me+2, ... (skipping pairs that are done): thread 0 waits for the
//     ack of round r - 2 (r >= 2; poll_count), the block copies its piece of the round (the
//     stream bytes that land on its own slot bytes, the same in every round: ragged_layout.h;
//     ragged_cut of the round's own range would move in a shorter last round) operand -> slot (segments staged by thread 0: ragged_stage_walk,
//     which walks the pair's slices with a cursor in shared memory that only moves forward, so
//     the walk costs O(k + rounds) per pair and call), round 0 also the header entries; then
//     __syncthreads and thread 0 publishes (round 0 the descriptor flag, else ragged_data).
//     Round 0 then copies my own slices operand -> out (ragged_send_slices, as ragged_kernel).
//     Receives from me-1, me-2, ...: thread 0 waits (round 0 poll_flag, else poll_count; each
//     wait bounded by the communicator's timeout from its own start),
//     round 0 checks the k header entries (ragged_check_header: sizes against recv_sizes, rows
//     within [0, M)), the block copies its piece slot -> out (ld.cg), then if the sender still
//     needs the slot (r + 2 < rounds) __syncthreads and thread 0 acks (st.release.sys).
//   finish_call.
// Every failure poisons first (thread 0, ragged_poison_chunked: ragged_data and ragged_ack of
// every block at every peer, the descriptor flags too when it is step 1's, before any round-0
// flag went out), then records, and the block returns.
// Register and shared-memory use: the staging arrays (RaggedSegs, 1.5 KiB), 4 x kMaxWorld
// cursors and round counts: about 2.5 KiB of shared memory per block.
#pragma once
#include "common.cuh"
#include "../common/ragged_layout.h"

namespace nvc {
namespace dev {

constexpr int kRaggedThreads = 512;
constexpr int kRaggedChunk = 64;  // slice descriptors staged in shared memory at a time
static_assert(kRaggedChunk <= kRaggedThreads, "one thread stages one slice");
static_assert(kMaxWorld <= 33, "lanes 0..W-2 of warp 0 publish the flags");

struct RaggedKernelArgs {
  const char* operand;      // [n_rows, row_bytes]
  char* out;                // [m_rows, row_bytes]
  const void* in_off;       // [K] int32 or int64, K = k * world
  const void* send;         // [K]
  const void* out_off;      // [K]
  const void* recv;         // [K]
  int64_t n_rows, m_rows;
  int64_t row_bytes;
  int64_t k;
  uint32_t desc;            // ragged_desc(n_rows, m_rows, row_bytes, k, chunk)
  int64_t chunk;            // 0: ragged_kernel (one round); > 0: ragged_chunked_kernel's slot
};

// Slices staged for the block's copies: this block's ragged_cut share [lo, hi) of each slice's
// frame (= out) bytes, and where its source starts relative to the frame offset (operand byte
// offset - frame byte offset for pushes and self slices, 0 for receives). The staging thread of
// a slice computes its cuts (two 64-bit divisions), so the block's copy loop has none.
struct RaggedStage {
  int64_t lo[kRaggedChunk];
  int64_t hi[kRaggedChunk];
  int64_t shift[kRaggedChunk];
  long long first;  // error paths only: the first bad index (ragged_first_bad)
};

// Error paths (the whole block, after the __syncthreads_or that found `bad` somewhere): the
// smallest `index` of the threads with bad set, or `none` when none has. Two barriers, one
// shared atomic per bad thread: no thread re-scans serially.
__device__ __forceinline__ long long ragged_first_bad(RaggedStage& st, bool bad, long long index,
                                                      long long none) {
  if (threadIdx.x == 0) st.first = none;
  __syncthreads();
  if (bad) atomicMin(&st.first, index);
  __syncthreads();
  return st.first;
}

// Thread t stages a slice whose frame bytes are [at, at + bytes) and source bytes start at
// at + shift.
__device__ __forceinline__ void ragged_stage(RaggedStage& st, int t, int64_t at, int64_t bytes,
                                             int64_t shift) {
  st.lo[t] = ragged_cut(at, at + bytes, gridDim.x, blockIdx.x);
  st.hi[t] = ragged_cut(at, at + bytes, gridDim.x, blockIdx.x + 1);
  st.shift[t] = shift;
}

template <typename I>
__device__ __forceinline__ int64_t ragged_index(const void* p, int64_t i) {
  return int64_t(__ldg(static_cast<const I*>(p) + i));
}

// The first field of slice i that breaks ragged_layout.h's step 1, or -1.
template <typename I>
__device__ __forceinline__ int ragged_bad_field(const RaggedKernelArgs& a, int64_t i) {
  return ragged_slice_field(ragged_index<I>(a.in_off, i), ragged_index<I>(a.send, i),
                            ragged_index<I>(a.out_off, i), a.n_rows, a.m_rows);
}

// Threads t < nj stage slices i0 + t of this rank's arrays (validated); with hdr, also store
// their header entries hdr[t] = {output offset, size} (a peer's header, 16-byte aligned);
// without (my slices to myself), check the size against recv_sizes: true when it differs.
template <typename I>
__device__ __forceinline__ bool ragged_stage_send(RaggedStage& st, const RaggedKernelArgs& a,
                                                  int64_t i0, int nj, longlong2* hdr) {
  const int t = threadIdx.x;
  if (t >= nj) return false;
  const int64_t in = ragged_index<I>(a.in_off, i0 + t), n = ragged_index<I>(a.send, i0 + t);
  const int64_t o = ragged_index<I>(a.out_off, i0 + t);
  if (hdr != nullptr) hdr[t] = make_longlong2(o, n);
  else if (n != ragged_index<I>(a.recv, i0 + t)) return true;
  ragged_stage(st, t, o * a.row_bytes, n * a.row_bytes, (in - o) * a.row_bytes);
  return false;
}

// Header entry h (sent by src) against recv_sizes entry `want`: kErrNone, kErrRaggedRecv (other
// size) or kErrRaggedSlice (rows outside [0, m_rows): memory corruption, src passed step 1).
__device__ __forceinline__ uint32_t ragged_recv_error(const longlong2& h, int64_t want,
                                                      int64_t m_rows) {
  if (h.y != want) return kErrRaggedRecv;
  if (h.x < 0 || h.y < 0 || h.y > m_rows - h.x) return kErrRaggedSlice;
  return kErrNone;
}

// The block copies its share of each of the nj staged slices: dst + [lo, hi) from
// src + shift + [lo, hi).
template <bool kCoherent>
__device__ __forceinline__ void ragged_copy_staged(const RaggedStage& st, int nj, char* dst,
                                                   const char* src) {
  for (int j = 0; j < nj; ++j) {
    const int64_t lo = st.lo[j], hi = st.hi[j];
    if (lo < hi) block_copy<kCoherent>(dst + lo, src + st.shift[j] + lo, size_t(hi - lo));
  }
}

// Push (hdr != nullptr: d's header row of this rank, dst = d's frame) or self-copy (hdr null,
// dst = out) of the k slices d*k .. d*k+k-1 of this rank's arrays. False (the block leaves):
// a self slice's size differs from my recv_sizes, recorded (kErrRaggedRecv naming me).
template <typename I>
__device__ __forceinline__ bool ragged_send_slices(const CommView& v, uint64_t seq,
                                                   RaggedStage& st, const RaggedKernelArgs& a,
                                                   int d, longlong2* hdr, char* dst) {
  for (int64_t j0 = 0; j0 < a.k; j0 += kRaggedChunk) {
    const int nj = int(a.k - j0 < kRaggedChunk ? a.k - j0 : kRaggedChunk);
    const int64_t i0 = int64_t(d) * a.k + j0;
    __syncthreads();  // the previous chunk's copies have read st
    const bool wrong =
        ragged_stage_send<I>(st, a, i0, nj, hdr != nullptr ? hdr + j0 : nullptr);
    if (__syncthreads_or(wrong)) {
      const long long j = ragged_first_bad(st, wrong, threadIdx.x, nj);  // the first wrong one
      if (threadIdx.x == 0 && j < nj) {
        const int64_t sent = ragged_index<I>(a.send, i0 + j);
        const int64_t want = ragged_index<I>(a.recv, i0 + j);
        if (sent != want)  // it does not: thread j found it so, from the same values
          fail(v, kErrRaggedRecv, a.desc, v.rank, seq, ragged_recv_detail(j0 + j, sent, want));
      }
      return false;
    }
    ragged_copy_staged<false>(st, nj, dst, a.operand);
  }
  return true;
}

template <typename I>
__global__ void __launch_bounds__(kRaggedThreads, 1) ragged_kernel(CommView v, RaggedKernelArgs a) {
  __shared__ RaggedStage st;
  const int t = threadIdx.x, b = blockIdx.x, G = gridDim.x, W = v.world, me = v.rank;
  const uint64_t seq = call_seq(v);
  const uint64_t p = seq & 1;
  const uint64_t deadline = globaltimer() + v.timeout_ns;
  const int64_t k = a.k, K = a.k * W;

  // 0. a failed communicator does nothing; 1. validate every slice of this rank before
  // anything is written.
  const bool dead = comm_failed(v);
  bool bad = false;
  for (int64_t i = t; !dead && i < K; i += blockDim.x) bad |= ragged_bad_field<I>(a, i) >= 0;
  if (__syncthreads_or(bad || dead)) {
    // A bad slice (unless another kernel or block of this rank already reported one): the
    // poison first, so peers fail at once; then every thread its first bad slice, the smallest
    // recorded (dead: nothing to do).
    bool report = false;
    if (t == 0 && !comm_failed(v)) {
      poison_flags(v, seq, G, kRaggedPoisonDesc);
      report = true;
    }
    if (__syncthreads_or(report)) {
      int64_t i = t;
      while (i < K && ragged_bad_field<I>(a, i) < 0) i += blockDim.x;
      const long long first = ragged_first_bad(st, i < K, i, K);
      if (t == 0 && first < K)
        fail(v, kErrRaggedSlice, a.desc, me, seq,
             ragged_slice_detail(first, uint32_t(ragged_bad_field<I>(a, first))));
    }
    return;
  }

  // 2. push my slices for every peer and their header entries, publish; then (r == W) my
  // slices for myself, straight into out (one call site: the copy code is inlined once).
  for (int r = 1; r <= W; ++r) {
    const int d = (me + r) % W;
    if (r == W) {
      __syncthreads();
      if (t < W - 1)
        publish_flag(&v.peer_ctrl((me + 1 + t) % W)->flags[p][0][me][b], make_flag(seq, a.desc));
    }
    char* h = v.half(d, p);
    if (!ragged_send_slices<I>(
            v, seq, st, a, d,
            d == me ? nullptr : reinterpret_cast<longlong2*>(ragged_header(h) + int64_t(me) * k),
            d == me ? a.out : ragged_frame(h, W, k)))
      return;
  }

  // 3. receive every peer's slices from my frame.
  char* mine = v.half(me, p);
  const longlong2* hdr = reinterpret_cast<const longlong2*>(ragged_header(mine));
  const char* frame = ragged_frame(mine, W, k);
  for (int r = 1; r < W; ++r) {
    const int src = (me + W - r) % W;
    uint32_t code = kErrNone;
    uint64_t seen = 0;
    if (t == 0) code = poll_flag(v, &v.ctrl()->flags[p][0][src][b], seq, a.desc, deadline, &seen);
    if (__syncthreads_or(code != kErrNone)) {
      if (t == 0) fail(v, code, a.desc, src, seq, seen);  // on the way out: no live state
      return;
    }
    for (int64_t j0 = 0; j0 < k; j0 += kRaggedChunk) {
      const int nj = int(k - j0 < kRaggedChunk ? k - j0 : kRaggedChunk);
      __syncthreads();  // the previous chunk's copies have read st
      bool wrong = false;
      if (t < nj) {
        const int64_t j = src * k + j0 + t;
        const longlong2 e = __ldcg(hdr + j);
        wrong = ragged_recv_error(e, ragged_index<I>(a.recv, j), a.m_rows) != kErrNone;
        if (!wrong) ragged_stage(st, t, e.x * a.row_bytes, e.y * a.row_bytes, 0);
      }
      if (__syncthreads_or(wrong)) {
        const long long f = ragged_first_bad(st, wrong, t, nj);  // the first wrong entry
        if (t == 0 && f < nj) {
          const int64_t j = j0 + f;  // src's slice j to me: slice me * k + j of its call
          const longlong2 e = __ldcg(hdr + src * k + j);
          const int64_t want = ragged_index<I>(a.recv, src * k + j);
          const uint32_t code = ragged_recv_error(e, want, a.m_rows);
          if (code != kErrNone)  // it is not: thread f found it so, from the same values
            fail(v, code, a.desc, src, seq,
                 code == kErrRaggedRecv ? ragged_recv_detail(j, e.y, want)
                                        : ragged_slice_detail(int64_t(me) * k + j, 4));
        }
        return;
      }
      ragged_copy_staged<true>(st, nj, a.out, frame);
    }
  }
  finish_call(v, seq);
}

// ---- chunked path ----------------------------------------------------------------------------

// Segments one staging gives the block to copy: n[i] bytes src[i] -> dst[i]; `next`, the stream
// position where the next staging resumes (the piece's end once the piece is done).
struct RaggedSegs {
  char* dst[kRaggedChunk];
  const char* src[kRaggedChunk];
  int64_t n[kRaggedChunk];
  int count;
  long long next;
};

// Per-block chunked state in shared memory: the pairs' stream bytes and walk cursors.
struct RaggedChunkState {
  int64_t send_bytes[kMaxWorld];
  int64_t recv_bytes[kMaxWorld];
  int64_t send_j[kMaxWorld], send_p[kMaxWorld];  // cursor: slice j starts at stream byte p
  int64_t recv_j[kMaxWorld], recv_p[kMaxWorld];
};

__device__ __forceinline__ int64_t ragged_min(int64_t a, int64_t b) { return a < b ? a : b; }

// Poll (one thread) until *p >= ragged_count(seq, n): kErrNone; the peer's poison
// (kErrMismatch), the deadline or another failure of this rank (kErrTimeout); *seen the value.
__device__ __forceinline__ uint32_t poll_count(const CommView& v, const uint64_t* p, uint64_t seq,
                                               uint32_t n, uint64_t deadline, uint64_t* seen) {
  const uint64_t want = ragged_count(seq, n), poison = ragged_count(seq, kRaggedPoison);
  uint32_t spins = 0;
  while (true) {
    const uint64_t c = ld_acquire_sys(p);
    *seen = c;
    if (c == poison) return kErrMismatch;
    if (c >= want) return kErrNone;
    if ((++spins & 255u) == 0u && (comm_failed(v) || globaltimer() > deadline))
      return kErrTimeout;
  }
}

// One thread: both round counters of every block < nblocks of this rank at every peer
// poisoned, with `flags` also the descriptor flags (no release: they publish no data). Only a
// failure before round 0's sends (validation) poisons the descriptor flags: after them every
// block has published its real round-0 flags, and overwriting them would make a peer that has
// not read one yet name this rank instead of the rank whose failure this one follows.
__device__ __forceinline__ void ragged_poison_chunked(const CommView& v, uint64_t s, int nblocks,
                                                      bool flags = false) {
  const uint64_t f = make_flag(s, kRaggedPoisonDesc), c = ragged_count(s, kRaggedPoison);
  for (int r = 0; r < v.world; ++r) {
    if (r == v.rank) continue;
    Ctrl* pc = v.peer_ctrl(r);
    for (int b = 0; b < nblocks; ++b) {
      if (flags) st_relaxed_sys(&pc->flags[s & 1][0][v.rank][b], f);
      st_relaxed_sys(&pc->ragged_data[v.rank][b], c);
      st_relaxed_sys(&pc->ragged_ack[v.rank][b], c);
    }
  }
}

// Thread 0: stage the segments of stream range [pos, hi) of a pair (at most kRaggedChunk),
// advancing the pair's cursor (j, p) past slices that end at or before pos. len(j): slice j's
// bytes; at(j, off, x): (dst, src) of stream byte x, which is byte off of slice j.
template <class Len, class At>
__device__ __forceinline__ void ragged_stage_walk(RaggedSegs& sg, int64_t& cj, int64_t& cp,
                                                  int64_t k, int64_t pos, int64_t hi, Len len,
                                                  At at) {
  while (cj < k) {
    const int64_t n = len(cj);
    if (cp + n > pos) break;
    cp += n;
    ++cj;
  }
  int c = 0;
  int64_t p = cp, next = hi;
  for (int64_t j = cj; j < k && p < hi; ++j) {
    const int64_t n = len(j);
    const int64_t a = p > pos ? p : pos, e = p + n < hi ? p + n : hi;
    if (a < e) {
      if (c == kRaggedChunk) {
        next = a;
        break;
      }
      at(j, a - p, a, &sg.dst[c], &sg.src[c]);
      sg.n[c] = e - a;
      ++c;
    }
    p += n;
  }
  sg.count = c;
  sg.next = next;
}

// The block moves its piece [lo, hi) of a pair's round (stage, copy, repeat). All threads.
template <bool kCoherent, class Len, class At>
__device__ __forceinline__ void ragged_move_piece(RaggedSegs& sg, int64_t& cj, int64_t& cp,
                                                  int64_t k, int64_t lo, int64_t hi, Len len,
                                                  At at) {
  int64_t pos = lo;
  while (pos < hi) {
    __syncthreads();  // the previous staging's copies have read sg (and the cursor settled)
    if (threadIdx.x == 0) ragged_stage_walk(sg, cj, cp, k, pos, hi, len, at);
    __syncthreads();
    const int c = sg.count;
    for (int i = 0; i < c; ++i) block_copy<kCoherent>(sg.dst[i], sg.src[i], size_t(sg.n[i]));
    pos = sg.next;
  }
}

// Round 0 of receiving from src: the k header entries against recv_sizes (the threads in
// strides; the first wrong one reported by thread 0 after poisoning). False: the block leaves.
template <typename I>
__device__ __forceinline__ bool ragged_check_header(const CommView& v, uint64_t seq,
                                                    RaggedStage& st, const RaggedKernelArgs& a,
                                                    const longlong2* hdr, int src) {
  const int64_t k = a.k;
  bool wrong = false;
  int64_t j = threadIdx.x;
  for (; j < k; j += blockDim.x) {
    const int64_t e = int64_t(src) * k + j;
    if (ragged_recv_error(__ldcg(hdr + e), ragged_index<I>(a.recv, e), a.m_rows) != kErrNone) {
      wrong = true;
      break;
    }
  }
  if (!__syncthreads_or(wrong)) return true;
  const long long f = ragged_first_bad(st, wrong, j, k);
  if (threadIdx.x == 0 && f < k) {
    const int64_t e = int64_t(src) * k + f;
    const longlong2 h = __ldcg(hdr + e);
    const int64_t want = ragged_index<I>(a.recv, e);
    const uint32_t code = ragged_recv_error(h, want, a.m_rows);
    ragged_poison_chunked(v, seq, gridDim.x);
    fail(v, code, a.desc, src, seq,
         code == kErrRaggedRecv ? ragged_recv_detail(f, h.y, want)
                                : ragged_slice_detail(int64_t(v.rank) * k + f, 4));
  }
  return false;
}

template <typename I>
__global__ void __launch_bounds__(kRaggedThreads, 1)
    ragged_chunked_kernel(CommView v, RaggedKernelArgs a) {
  __shared__ RaggedStage st;
  __shared__ RaggedSegs sg;
  __shared__ RaggedChunkState cs;
  const int t = threadIdx.x, b = blockIdx.x, G = gridDim.x, W = v.world, me = v.rank;
  const uint64_t seq = call_seq(v);
  const uint64_t p = seq & 1;
  const int64_t k = a.k, K = a.k * W, C = a.chunk, rb = a.row_bytes;
  // every wait gets the communicator's deadline from its own start (a call of many rounds may
  // take longer than one timeout in all; a peer that stops for a timeout fails it)

  // 0/1. as ragged_kernel, the poison covering the round counters
  const bool dead = comm_failed(v);
  bool bad = false;
  for (int64_t i = t; !dead && i < K; i += blockDim.x) bad |= ragged_bad_field<I>(a, i) >= 0;
  if (__syncthreads_or(bad || dead)) {
    bool report = false;
    if (t == 0 && !comm_failed(v)) {
      ragged_poison_chunked(v, seq, G, true);
      report = true;
    }
    if (__syncthreads_or(report)) {
      int64_t i = t;
      while (i < K && ragged_bad_field<I>(a, i) < 0) i += blockDim.x;
      const long long first = ragged_first_bad(st, i < K, i, K);
      if (t == 0 && first < K)
        fail(v, kErrRaggedSlice, a.desc, me, seq,
             ragged_slice_detail(first, uint32_t(ragged_bad_field<I>(a, first))));
    }
    return;
  }

  // stream bytes of every pair, and the cursors
  if (t < W) {
    int64_t ss = 0, rr = 0;
    for (int64_t j = 0; j < k; ++j) {
      ss += ragged_index<I>(a.send, int64_t(t) * k + j);
      const int64_t x = ragged_index<I>(a.recv, int64_t(t) * k + j);
      rr += x > 0 ? x : 0;
    }
    cs.send_bytes[t] = ss * rb;
    cs.recv_bytes[t] = rr * rb;
    cs.send_j[t] = cs.send_p[t] = cs.recv_j[t] = cs.recv_p[t] = 0;
  }
  __syncthreads();
  int64_t rounds = 1;
  for (int d = 0; d < W; ++d)
    if (d != me) {
      const int64_t x = ragged_rounds(cs.send_bytes[d], C), y = ragged_rounds(cs.recv_bytes[d], C);
      rounds = x > rounds ? x : rounds;
      rounds = y > rounds ? y : rounds;
    }

  char* mine = v.half(me, p);
  const longlong2* my_hdr = reinterpret_cast<const longlong2*>(ragged_header(mine));
  // block b's part of a pair's round: slot bytes [cut_lo, cut_hi) of the round's c bytes
  // (ragged_layout.h: the same slot bytes in every round)
  for (int64_t r = 0; r < rounds; ++r) {
    // sends of round r
    for (int q = 1; q < W; ++q) {
      const int d = (me + q) % W;
      const int64_t S = cs.send_bytes[d];
      if (r >= ragged_rounds(S, C)) continue;
      const int64_t c = ragged_round_bytes(S, C), lo_r = r * c;
      if (r >= 2) {
        uint32_t code = kErrNone;
        uint64_t seen = 0;
        if (t == 0)
          code = poll_count(v, &v.ctrl()->ragged_ack[d][b], seq, uint32_t(r - 1),
                            globaltimer() + v.timeout_ns, &seen);
        if (__syncthreads_or(code != kErrNone)) {
          if (t == 0) {
            ragged_poison_chunked(v, seq, G);
            fail(v, code, a.desc, d, seq, seen);
          }
          return;
        }
      }
      char* h = v.half(d, p);
      if (r == 0) {
        longlong2* hdr = reinterpret_cast<longlong2*>(ragged_header(h)) + int64_t(me) * k;
        for (int64_t j = t; j < k; j += blockDim.x)
          hdr[j] = make_longlong2(ragged_index<I>(a.out_off, int64_t(d) * k + j),
                                  ragged_index<I>(a.send, int64_t(d) * k + j));
      }
      char* slot = ragged_slot(h, W, k, C, me, int(r & 1));
      const int64_t dk = int64_t(d) * k;
      const int64_t hi = ragged_min(S, lo_r + ragged_cut(0, c, G, b + 1));
      ragged_move_piece<false>(
          sg, cs.send_j[d], cs.send_p[d], k, ragged_min(hi, lo_r + ragged_cut(0, c, G, b)), hi,
          [&](int64_t j) { return ragged_index<I>(a.send, dk + j) * rb; },
          [&](int64_t j, int64_t off, int64_t x, char** dst, const char** src) {
            *dst = slot + (x - lo_r);
            *src = a.operand + ragged_index<I>(a.in_off, dk + j) * rb + off;
          });
      __syncthreads();
      if (t == 0) {
        if (r == 0) publish_flag(&v.peer_ctrl(d)->flags[p][0][me][b], make_flag(seq, a.desc));
        else publish_flag(&v.peer_ctrl(d)->ragged_data[me][b], ragged_count(seq, uint32_t(r)));
      }
    }
    // my own slices, while round 0 travels
    if (r == 0 && !ragged_send_slices<I>(v, seq, st, a, me, nullptr, a.out)) {
      if (t == 0) ragged_poison_chunked(v, seq, G);
      return;
    }
    // receives of round r
    for (int q = 1; q < W; ++q) {
      const int src = (me + W - q) % W;
      const int64_t S = cs.recv_bytes[src];
      const int64_t R = ragged_rounds(S, C);
      if (r >= R) continue;
      const int64_t c = ragged_round_bytes(S, C), lo_r = r * c;
      uint32_t code = kErrNone;
      uint64_t seen = 0;
      if (t == 0) {
        const uint64_t deadline = globaltimer() + v.timeout_ns;
        code = r == 0 ? poll_flag(v, &v.ctrl()->flags[p][0][src][b], seq, a.desc, deadline, &seen)
                      : poll_count(v, &v.ctrl()->ragged_data[src][b], seq, uint32_t(r), deadline,
                                   &seen);
      }
      if (__syncthreads_or(code != kErrNone)) {
        if (t == 0) {
          ragged_poison_chunked(v, seq, G);
          fail(v, code, a.desc, src, seq, seen);
        }
        return;
      }
      if (r == 0 && !ragged_check_header<I>(v, seq, st, a, my_hdr, src)) return;
      const char* slot = ragged_slot(mine, W, k, C, src, int(r & 1));
      const longlong2* ph = my_hdr + int64_t(src) * k;
      const int64_t hi = ragged_min(S, lo_r + ragged_cut(0, c, G, b + 1));
      ragged_move_piece<true>(
          sg, cs.recv_j[src], cs.recv_p[src], k, ragged_min(hi, lo_r + ragged_cut(0, c, G, b)),
          hi, [&](int64_t j) { return __ldcg(ph + j).y * rb; },
          [&](int64_t j, int64_t off, int64_t x, char** dst, const char** srcp) {
            *dst = a.out + __ldcg(ph + j).x * rb + off;
            *srcp = slot + (x - lo_r);
          });
      if (r + 2 < R) {
        __syncthreads();  // the block's loads of the slot are done
        if (t == 0)
          publish_flag(&v.peer_ctrl(src)->ragged_ack[me][b], ragged_count(seq, uint32_t(r + 1)));
      }
    }
  }
  finish_call(v, seq);
}

}  // namespace dev
}  // namespace nvc
