// ragged_all_to_all (lax.ragged_all_to_all's semantics) over the flag protocol of a
// Communicator (layout.h): layout of one data half, the call descriptor, the protocol and its
// invariants. Shared by the CUDA kernel (kernels/ragged.cuh), the host protocol
// (host/ragged_host.cc) and the Python capacity check (jax_nvcomm/ragged.py calls
// _host.ragged_fits, which is ragged_fits below).
//
// The call (every rank, SPMD: the same static shapes everywhere):
//   operand [N, ...], output [M, ...] (same dtype and trailing dims; row = trailing elements x
//   itemsize bytes), input_offsets / send_sizes / output_offsets / recv_sizes: K = k * W
//   integers each (int32 or int64, all four the same type), k >= 1 slices per peer.
//   Slice i of rank r (i in [0, K)) goes to peer d = i / k: rows operand[input_offsets[i] ..
//   + send_sizes[i]) land in d's result at rows [output_offsets[i] .. + send_sizes[i]) (the
//   offset is in the RECEIVER's frame, given by the sender). Receiver d expects
//   recv_sizes[r * k + j] rows from slice j (= i % k) of rank r. Rows of d's result that no slice
//   covers keep output's values. (lax: output_offsets_ = all_to_all(output_offsets).)
//
// Data half p of receiver d (CommView::half(d, p)):
//   [0, H)          header: RaggedSlice[W * k], entry [r * k + j] written by rank r: where its
//                   slice j to d lands in d's output (row offset) and how many rows it carries.
//                   H = ragged_header_bytes(W, k) = align256(W * k * sizeof(RaggedSlice)).
//   [H, H + F)      landing frame, F = align256(M * row_bytes): row t of d's output frame at
//                   H + t * row_bytes. Senders write their rows here at their output_offsets,
//                   so rows from different senders never share bytes unless the caller's slices
//                   overlap in d's output (lax leaves the result unspecified then; so do we).
// Flags: Ctrl::flags[p][0][src][b] in the receiver's control block, value make_flag(s, desc),
// desc = ragged_desc(N, M, row_bytes, k): static sizes only, never the traced offsets/sizes.
//
// Protocol, call s on rank `me` (p = s & 1), grid of G blocks (G a pure function of the static
// sizes, the same on every rank; the host protocol is one "block"):
//   1. Validate this rank's own slices: for every i, 0 <= input_offsets[i], 0 <= send_sizes[i],
//      input_offsets[i] + send_sizes[i] <= N, 0 <= output_offsets[i],
//      output_offsets[i] + send_sizes[i] <= M. A bad slice fails the call on this rank
//      (kErrRaggedSlice, observed = ragged_slice_detail(i, which field)) after raising the
//      poison flag make_flag(s, kRaggedPoisonDesc) of every block at every peer, so peers fail
//      at once (kErrMismatch naming this rank) instead of timing out.
//   2. Push: for every peer d != me and block b: copy block b's share of each of the slices
//      d*k .. d*k+k-1 from the operand into d's half p frame at the slice's output offset; write
//      all k header entries for d (every block writes the same values, so block b's flag alone
//      publishes them); __syncthreads; publish flags[p][0][me][b] at d (st.release.sys).
//      Block b's share of a slice landing at frame bytes [a, e) (a = output offset * row_bytes,
//      e = a + size * row_bytes) is bytes [ragged_cut(a, e, G, b), ragged_cut(a, e, G, b + 1)):
//      G near-equal byte ranges cut at 16-byte aligned frame offsets, so that a slice of one
//      long row (decode) still spreads over every block and each range starts vector-aligned.
//   3. Receive: slices to myself are copied straight from the operand into the result, after
//      checking send_sizes[me * k + j] == recv_sizes[me * k + j] (else kErrRaggedRecv, peer =
//      me, observed = ragged_recv_detail(j, sent, expected)). For every
//      src != me: wait (bounded, the communicator's deadline) for flags[p][0][src][b]; read
//      header[src * k + j]; check its size == recv_sizes[src * k + j], else fail
//      (kErrRaggedRecv, peer = src, observed = ragged_recv_detail(j, sent, expected)); copy block
//      b's share of the slice (the same ragged_cut ranges, from the header's offset and size)
//      from my frame to the same byte offsets of the result. A header offset outside
//      [0, M - size] cannot come from a sender that passed step 1 (memory corruption:
//      kErrRaggedSlice, peer = src, observed = ragged_slice_detail(me * k + j, 4): the index of
//      the slice in src's call).
//   4. finish_call: the last block advances Ctrl::seq (the kernel itself, so CUDA-graph
//      replays need no host code).
// The result buffer aliases `output` (XLA input_output_aliases), so rows nothing lands on keep
// their values without a copy; where XLA could not alias, it copies output first.
//
// Chunked path (calls of any output size; the static attribute chunk = C > 0 selects it, C = 0
// the single-round path above). The data half of receiver d is then:
//   [0, H)                    header, as above.
//   [H + (2 src + q) C, +C)   slot q (0, 1) of sender src: C bytes, C a multiple of 256, with
//                             H + 2 W C <= flag_half (ragged_chunk_fits; src = d unused).
// The k slices src sends to d, concatenated in slice order, form the pair's STREAM of
// S = row_bytes x sum_j send_sizes[d k + j] bytes; slice j is stream bytes [P_j, P_j + len_j),
// P_j its prefix sum. The receiver computes the same S from recv_sizes once round 0's header
// check passed. The pair runs R = ragged_rounds(S, C) rounds (at least one, so that the header
// and the descriptor travel even when S = 0) of c = ragged_round_bytes(S, C) <= C bytes (S
// spread evenly over the rounds, 256-byte multiples); round r carries stream bytes
// [r c, min(S, r c + c)) in slot r & 1, at slot byte (x - r c). Block b of G owns the same
// bytes [ragged_cut(0, c, G, b), ragged_cut(0, c, G, b + 1)) of the slot in every round (16-byte
// aligned) and carries the stream bytes that land there: so when it reuses the slot two rounds
// later, after ITS receiver block's acknowledgement, it overwrites only bytes that block read
// (pieces cut from each round's own range would move between blocks in a shorter last round,
// onto bytes another receiver block may still be reading). Every (sender, receiver, block)
// runs its own sequence of rounds; no rank needs another pair's round count, and there is no
// grid-wide or rank-wide agreement on the number of rounds.
//   sender, round r, for each peer d with r < R(me -> d):
//     r >= 2: wait until Ctrl::ragged_ack[d][b] (mine, written by d) >= ragged_count(s, r - 1)
//       (round r - 2, which used the same slot, consumed);
//     copy block b's piece operand -> d's slot (r & 1); round 0 also writes my k header entries;
//     publish: round 0 flags[p][0][me][b] = make_flag(s, desc) (as the single-round path, so a
//       peer in another op or with other sizes is caught by the descriptor), round r >= 1
//       Ctrl::ragged_data[me][b] at d = ragged_count(s, r) (release).
//   receiver, round r, for each src with r < R(src -> me):
//     wait: round 0 the descriptor flag, then check all k header entries (sizes == recv_sizes,
//       rows within [0, M), the errors of step 3); round r >= 1 ragged_data[src][b] >=
//       ragged_count(s, r);
//     copy block b's piece slot (r & 1) -> out (each slice's bytes at its header offset);
//     if r + 2 < R: publish Ctrl::ragged_ack[me][b] at src = ragged_count(s, r + 1) (release:
//       this block's loads of the slot are done before the sender may overwrite it).
//   Slices to myself are copied operand -> out at round 0, as above (no slot).
// A rank runs rounds 0 .. max over its pairs (send and receive) - 1, each round first all its
// sends, then all its receives. No deadlock: if every rank finished round r - 1, every send of
// round r waits only for consumption of round r - 2 (done), and every receive of round r only
// for the peer's send of round r (which waits for nothing more): by induction all finish.
// Failure in the chunked path (any: a bad slice, a size mismatch, a wait that failed): before
// recording, the block raises ragged_count(s, kRaggedPoison) in ragged_data and ragged_ack of
// every block at every peer (a bad slice of step 1, found before any round-0 flag went out,
// also the poison descriptor flags), so no peer waits for it until its deadline; a counter
// wait that sees ragged_count(s, kRaggedPoison) fails with kErrMismatch naming that peer.
// After step 1 the descriptor flags stay the real ones (every block publishes round 0 before
// it waits for anything), so a peer still reading them names the rank whose failure started
// the cascade, not one that followed it. A counter value of a later call (seq part > s) also satisfies a wait: a
// peer only gets there after it finished this call's part of the pair.
// Why the counters need no parity: a value written during call s is ragged_count(s, .), larger
// than every value of an earlier call, and a rank writes call s + 1's values only after it has
// finished call s, i.e. every round of every pair it takes part in; a waiter of call s that
// sees a call-(s + 1) value thus already has everything it waits for. Both halves' rule is the
// single-round path's: a rank at call s + 2 has seen every peer's round-0 flag of call s + 1.
// Memory: nothing is allocated; H + 2 W C <= flag_half whatever M, so comm.nbytes does not
// depend on the call. The slot size C is ragged_chunk_max by default (the largest the half
// holds), smaller on request (Communicator(ragged_chunk_bytes=...)).
//
// Invariants: every call waits for every peer (flag protocol), so two halves suffice (layout.h);
// a rank writes only the frame rows its own slices name and its own k header entries of a
// peer's half; G <= kMaxBlocks; every wait has the communicator's deadline and names the peer;
// nothing is written outside [0, M) rows of a frame (step 1 runs before any push).
// Capacity of the single-round path (ragged_fits): M * row_bytes <= max_message_bytes and
// H + F <= flag_half. Larger calls take the chunked path (jax_nvcomm/ragged.py decides); it
// needs only H + 2 W 256 <= flag_half (k not too large for the header).
#pragma once
#include <cstdint>

#include "layout.h"

namespace nvc {

// Poison descriptor (layout.h kPoisonDesc, as every protocol's).
constexpr uint32_t kRaggedPoisonDesc = kPoisonDesc;

// One header entry: where slice j of rank r lands in the receiver's output, and its row count.
struct RaggedSlice {
  int64_t offset;
  int64_t size;
};
static_assert(sizeof(RaggedSlice) == 16, "header entries are 16 bytes");

NVC_HD size_t ragged_header_bytes(int world, int64_t k) {
  return align_up(size_t(world) * size_t(k) * sizeof(RaggedSlice), 256);
}
NVC_HD size_t ragged_frame_bytes(int64_t m, size_t row_bytes) {
  return align_up(size_t(m) * row_bytes, 256);
}
// Whether a call with an output of m rows of row_bytes and k slices per peer fits the buffers.
NVC_HD bool ragged_fits(size_t max_message_bytes, int world, int64_t m, size_t row_bytes,
                        int64_t k) {
  if (m < 0 || k < 1) return false;
  const size_t half = flag_half_bytes(max_message_bytes, world);
  return size_t(m) * row_bytes <= max_message_bytes &&
         ragged_header_bytes(world, k) + ragged_frame_bytes(m, row_bytes) <= half;
}
NVC_HD RaggedSlice* ragged_header(char* half) { return reinterpret_cast<RaggedSlice*>(half); }
NVC_HD char* ragged_frame(char* half, int world, int64_t k) {
  return half + ragged_header_bytes(world, k);
}
// The call descriptor: op kind + a hash of the static sizes (and the chunk size of the chunked
// path: 0 for the single-round one, which keeps its descriptor of before the chunked path).
NVC_HD uint32_t ragged_desc(int64_t n, int64_t m, size_t row_bytes, int64_t k,
                            int64_t chunk = 0) {
  return make_desc(kOpRaggedAllToAll, uint64_t(n) * 0x100000001B3ull ^ uint64_t(m),
                   (uint64_t(row_bytes) * 0x10001ull ^ uint64_t(k)) +
                       uint64_t(chunk) * 0x9E3779B97F4A7C15ull);
}

// ---- chunked path ----
constexpr size_t kRaggedSlotAlign = 256;        // C is a multiple of this
constexpr uint32_t kRaggedPoison = 0xFFFFFFFFu;  // round count of a poisoned counter
NVC_HD uint64_t ragged_count(uint64_t seq, uint32_t n) { return (seq << 32) | uint64_t(n); }
// The largest slot size C the flag half holds for (world, k): 0 when not even 256 bytes fit.
NVC_HD size_t ragged_chunk_max(size_t max_message_bytes, int world, int64_t k) {
  if (k < 1 || world < 1) return 0;
  const size_t half = flag_half_bytes(max_message_bytes, world);
  const size_t h = ragged_header_bytes(world, k);
  if (h >= half) return 0;
  return (half - h) / (size_t(2) * size_t(world)) / kRaggedSlotAlign * kRaggedSlotAlign;
}
// Whether slot size `chunk` is valid for (max_message_bytes, world, k).
NVC_HD bool ragged_chunk_fits(size_t max_message_bytes, int world, int64_t k, int64_t chunk) {
  return chunk >= int64_t(kRaggedSlotAlign) && chunk % int64_t(kRaggedSlotAlign) == 0 &&
         size_t(chunk) <= ragged_chunk_max(max_message_bytes, world, k);
}
// Slot q of sender src in a receiver's half.
NVC_HD char* ragged_slot(char* half, int world, int64_t k, int64_t chunk, int src, int q) {
  return half + ragged_header_bytes(world, k) + (size_t(2) * src + size_t(q)) * size_t(chunk);
}
// Why a call of these static sizes cannot run with this chunk (0: the single round; > 0: the
// chunked path's slot), or nullptr: 0 needs ragged_fits, > 0 ragged_chunk_fits and fewer than
// 2^31 rounds per pair. Static text (the callers add the numbers).
inline const char* ragged_size_problem(size_t max_message_bytes, int world, int64_t n_rows,
                                       int64_t m_rows, size_t row_bytes, int64_t k,
                                       int64_t chunk) {
  if (chunk < 0) return "chunk_bytes must be >= 0";
  if (row_bytes == 0) return "row_bytes must be > 0";
  const int64_t rows = n_rows > m_rows ? n_rows : m_rows;
  if (rows > 0 && row_bytes > uint64_t(INT64_MAX) / uint64_t(rows))
    return "operand or output bytes exceed int64";
  if (chunk == 0) {
    if (uint64_t(m_rows) > max_message_bytes / row_bytes ||
        !ragged_fits(max_message_bytes, world, m_rows, row_bytes, k))
      return "output rows x row bytes (+ the slice header) exceed the communicator's "
             "max_message_bytes (ragged_fits): only the chunked path (chunk_bytes > 0) serves it";
    return nullptr;
  }
  if (!ragged_chunk_fits(max_message_bytes, world, k, chunk))
    return "chunk_bytes must be a multiple of 256 in [256, ragged_chunk_max] (the header of "
           "k * world slices and 2 * world slots of chunk_bytes within one flag half)";
  if (rows > 0 && uint64_t(rows) * row_bytes / uint64_t(chunk) >= (uint64_t(1) << 31))
    return "2^31 or more rounds of chunk_bytes per pair: use a larger chunk_bytes";
  return nullptr;
}

// Rounds of a pair whose stream is s bytes: at least 1.
NVC_HD int64_t ragged_rounds(int64_t s, int64_t chunk) {
  return s <= 0 ? 1 : (s + chunk - 1) / chunk;
}
// Bytes per round of such a pair: s spread over its rounds, rounded up to 256 (<= chunk, as chunk
// is a multiple of 256; (rounds - 1) x it < s, so no round is empty but for s = 0).
NVC_HD int64_t ragged_round_bytes(int64_t s, int64_t chunk) {
  if (s <= 0) return int64_t(kRaggedSlotAlign);
  const int64_t r = ragged_rounds(s, chunk);
  return int64_t(align_up(size_t((s + r - 1) / r), kRaggedSlotAlign));
}
// Block b's (of g) share of a slice at frame bytes [a, e) is [ragged_cut(a, e, g, b),
// ragged_cut(a, e, g, b + 1)): the g near-equal parts of [a, e), each cut rounded down to a
// multiple of 16 (never below a). Non-decreasing in b, ragged_cut(.., 0) = a, (.., g) = e, so
// the parts tile [a, e); a part may be empty. One block (the host protocol): the whole slice.
NVC_HD int64_t ragged_cut(int64_t a, int64_t e, int g, int b) {
  if (b <= 0) return a;
  if (b >= g) return e;
  const int64_t c = (a + (e - a) * b / g) & ~int64_t(15);
  return c < a ? a : c;
}

// Step 1 for one slice (input offset, size, output offset) of a call with n operand and m
// output rows: the first field out of bounds (ragged_slice_detail's field numbers), or -1.
// Written so that no sum can overflow.
NVC_HD int ragged_slice_field(int64_t in, int64_t size, int64_t out, int64_t n, int64_t m) {
  if (in < 0) return 0;
  if (size < 0) return 1;
  if (in > n - size) return 2;
  if (out < 0) return 3;
  if (out > m - size) return 4;
  return -1;
}

// kErrRaggedSlice detail: the slice index in bits 0..31, the field in bits 32..39
// (0 input_offsets, 1 send_sizes, 2 input_offsets + send_sizes > N, 3 output_offsets,
// 4 output_offsets + send_sizes > M).
NVC_HD uint64_t ragged_slice_detail(int64_t slice, uint32_t field) {
  return uint64_t(uint32_t(slice)) | (uint64_t(field & 0xFFu) << 32);
}
// kErrRaggedRecv detail: the sender's size in bits 0..23, the receiver's recv_sizes entry in
// bits 24..47, the slice j (of the sender's k slices to this receiver) in bits 48..63. Each is
// clamped to its field's largest value (sizes 2^24 - 1 rows, j 65535; a negative size too),
// which describe_error prints with a "+" (at least that much).
constexpr uint64_t kRaggedRecvSizeMax = (uint64_t(1) << 24) - 1;
constexpr uint64_t kRaggedRecvSliceMax = 0xFFFF;
NVC_HD uint64_t ragged_detail_clamp(int64_t x, uint64_t lim) {
  return x < 0 ? lim : (uint64_t(x) > lim ? lim : uint64_t(x));
}
NVC_HD uint64_t ragged_recv_detail(int64_t j, int64_t sent, int64_t expected) {
  return ragged_detail_clamp(sent, kRaggedRecvSizeMax) |
         (ragged_detail_clamp(expected, kRaggedRecvSizeMax) << 24) |
         (ragged_detail_clamp(j, kRaggedRecvSliceMax) << 48);
}

}  // namespace nvc
