// MoE expert-parallel dispatch / combine: configuration, symmetric-buffer layout, handle arrays.
// Shared by the CUDA kernels (kernels/moe_*.cuh), the host protocol (host/moe_host.*) and the
// FFI handlers, so every rank and both backends compute the same sizes and offsets.
//
// PROTOCOL (one MoE communicator = one symmetric buffer per rank, its own counters)
//   A call (a dispatch or a combine) is two halves on one stream: SEND (writes rows into the
//   peers' data slot, then raises its flag in every rank, itself included, even when it sent
//   nothing) and RECV (waits for every rank's flags, consumes its own slot). They run back to
//   back (moe_dispatch / moe_combine: one custom call; on CUDA one cooperative kernel running
//   SEND then RECV, moe_dispatch.cuh dispatch_kernel, where the ranks' grids can be resident
//   together, else SEND and RECV kernels; at world 1 one kernel with no slot and no flags,
//   kernels/moe_local.cuh, that gives the same outputs and advances both counters as the
//   two halves do) or as two custom calls with other work
//   in between (moe_*_send / moe_*_recv: "split", up to M = max_in_flight SENDs outstanding).
//   Two counters per rank, both advanced on the device by the last block of the kernel (so
//   CUDA-graph replays work without host code):
//     MoeCtrl::send_seq  SENDs issued;  a SEND gets s = send_seq + 1
//     Ctrl::seq          RECVs done;    a RECV consumes r = seq + 1 (FIFO: the oldest SEND)
//   Call s uses data slot s % N and flag slot s % N, N = moe_slots(cfg) = 2 * M (M = 1, 2, 4):
//   moe_flag(ctrl, cfg, s, src, block) in the receiving rank's Ctrl.
//   - SEND checks s - seq <= M (else kErrInFlight: more SENDs outstanding than the
//     communicator was made for; every rank runs the same calls, so every rank fails there)
//     and, split, writes s (low 32 bits) to its seq output.
//   - RECV, split, gets that s back and checks s == seq + 1 (kErrOrder: RECVs must come in the
//     order of their SENDs, once each); fused (no seq operand) it checks seq + 1 == send_seq
//     (kErrOrder: a fused call while split SENDs are outstanding).
//   dispatch: each source rank writes each of its tokens (t < num_tokens) ONCE to each
//     destination rank owning at least one of its top_k experts, into the region of that source
//     in the destination's slot, at row pos = number of earlier tokens of the source going to
//     that destination (deterministic prefix count). The row carries the payload, the scales and
//     the list of (local expert, k, idx) with idx = number of earlier tokens of the source routed
//     to that expert. Block G-1 (the one owning the last tokens) also writes the header: rows and
//     per-local-expert counts. RECV: off[e][src] = sum of counts of sources < src; row goes to
//     expert_x[e][off[e][src] + idx]: (source rank, token) order, no atomics decide placement.
//   combine: the expert side writes each expert row i < expert_counts[e] back to its token's
//     rank, into landing slot t*top_k + k of that rank's data slot (one writer per landing
//     slot). RECV sums y[t] = fma over k = 0..top_k-1 (valid slots only) of w[t,k] * row,
//     float32, k order.
//   All ranks must launch the same call sequence with the same config; a disagreement shows up
//   as kErrMismatch (same seq, another descriptor) instead of garbage.
//
// BUFFER LAYOUT (per rank, identical offsets everywhere; W = world, T = max_tokens, K = top_k,
// L = num_experts / W local experts, H = hidden, D = payload bytes per element, S = scale_cols,
// N = moe_slots = 2 * max_in_flight):
//   [0, kCtrlBytes)                     Ctrl (layout.h): seq, done_blocks; its flags array seen
//                                       flat as N x kMaxWorld x kMoeMaxBlocks flags (moe_flag);
//                                       MoeCtrl at kMoeCtrlOffset (send_seq, its block counter,
//                                       the flag groups' arrival counters)
//   [kCtrlBytes + i * half, +half)      data slot i (i = 0 .. N-1), used by dispatch OR combine:
//     dispatch view:  hdr[src]  (W x hdr_bytes: int32 rows, int32 count[L])
//                     rows[src][slot] (W x T x drow_bytes), row = [payload H*D | S f32 scales |
//                     meta int32: t, m, m x (le | k << 16, idx)] each part 16-B aligned
//     combine view:   landing[t * K + k] (T x K rows of H * sizeof(expert_y dtype))
//   half = align256(max(W*hdr_bytes + W*T*drow_bytes, T*K*H*4))   (combine sized for float32 y)
//   moe_buffer_bytes = kCtrlBytes + N * half
//   Bounded slots (BOUNDED SLOTS below): half = slot_bytes, N = 2, a region Td rows, a landing
//   area Tc * K rows.
//   Scales with W*T rows (dispatch) and T*K rows (combine), never with num_experts * T.
//
// INVARIANTS
// - N = 2M slots suffice. When rank A issues SEND j it has finished RECV j-M (in-flight check,
//   FIFO RECVs). That RECV saw every peer B's flag of call j-M, which B raised in SEND j-M, when
//   B had finished RECV j-2M. So B still reads (or will read) only slots of calls in
//   (j-2M, j): none of them is j mod N when N >= 2M, and B has read its flag slot of call
//   j-N <= j-2M. M = 1 is the fused protocol's two halves. Every RECV waits for every rank, so
//   no rank gets further ahead than that.
//   A call's data is consumed inside the call (RECV), so dispatch and combine share the slots;
//   everything combine needs from dispatch travels in the handle (XLA arrays), which is why any
//   number of dispatches may be received before their combines.
// - One MoE kernel runs at a time per rank (the order token chains every call, both halves),
//   so SEND and RECV may share nothing but the counters they own.
// - Regions never overflow: at most T rows per (source, destination), at most T tokens per
//   (source, expert) as ids are distinct per row (checked), so expert rows < W*T.
// - Expert ids are validated before any write that depends on them; an id outside [-1, E), a
//   duplicate within a row or num_tokens outside [0, T] fails the call (kErrBadExpert /
//   kErrCapacity). Before failing, the sender writes the POISON flag make_flag(s,kMoePoisonDesc)
//   into every rank's slots so peers fail fast (kErrMismatch, observed desc 0xFFFFFF) instead of
//   timing out. After any error the communicator is dead (reset Ctrl to zero on every rank).
// - Initial state: the control block (Ctrl, MoeCtrl) all zero on every rank; data slots need
//   no initialisation.
//
// BOUNDED SLOTS (slot_bytes > 0: a buffer bounded by a budget, not by W*T rows)
//   Why: the layout above holds a whole call per slot, W*T dispatch rows and T*K combine rows of
//   hidden x 4 bytes, whatever the routing: 2 * max_in_flight * 940 MB per rank at W 8, T 4096,
//   hidden 7168 (MoECommunicator's default max_in_flight 2: 3.5 GiB). With slot_bytes > 0 the
//   buffer is kCtrlBytes + 2 slots of slot_bytes, and a fused call (moe_dispatch /
//   moe_combine) runs as R consecutive calls of the protocol above, ROUNDS, each moving a range
//   of tokens that fits a slot:
//     dispatch round j: the source tokens [j*Td, min((j+1)*Td, n)) of every source rank,
//       Td = moe_dispatch_round_tokens = (slot_bytes - W*hdr) / (W*drow_bytes) (at most T),
//       R = ceil(T / Td) rounds on every rank (a function of the config, not of num_tokens:
//       no agreement needed; a round past a rank's num_tokens sends only its header);
//     combine round j: the destination tokens [j*Tc, min((j+1)*Tc, T)) of every rank,
//       Tc = moe_combine_round_tokens = slot_bytes / (K*H*sizeof(y)) (the landing rows have
//       expert_y's dtype, the same on every rank: a 16-bit y takes half the rounds of float32,
//       the size the whole-call layout reserves); the SEND walks all its expert rows
//       and copies those whose token is in the round (reading expert_src first), into landing
//       row (t - j*Tc)*K + k; the RECV sums the round's tokens.
//   Each round is an ordinary call: its own s (s = send_seq + 1, the counters advance once per
//   round), slot and flags s % 2, the same checks. What carries over between the rounds of a
//   dispatch is in the data: the header of every round holds the round's rows (<= Td: the
//   region of a source is Td rows, moe_drow) and the call's TOTAL per-expert counts (block G-1
//   counts the tokens after its round too, validating their ids, so an id out of range
//   anywhere fails the first round; a repeated id fails its round on CUDA, the first on the
//   host), so off[e][src] is the same in every round; a row's meta carries the
//   call's idx (tokens before the row's token, from token 0). Rows land where a one-round call
//   puts them: the results are bitwise those of the unbounded layout.
//   Flow control: none beyond the protocol's own, because the rounds of a call are calls with
//   one in flight (M = 1, N = 2 slots: the INVARIANTS' argument). Rank A writes round j+1
//   into B's slot (j+1) % 2 only after its RECV of round j saw the flags of every block of B's
//   SEND of round j, which B's blocks raised after B's RECV of round j-1, the last reader of
//   that slot. No acknowledgement flags, no rank-wide barrier, no memory past the 2 slots.
//   Cost: a flag exchange (and on CUDA a SEND and a RECV launch) per round; a round moves up to
//   slot_bytes (128 MiB at the default 256 MiB budget), so rounds exist only where a call
//   moves more than that. CUDA runs the rounds with their own kernels (*_rounds_kernel: the
//   round's token range as kernel parameters), so the one-kernel fused calls of the unbounded
//   layout keep their code and registers; a bounded call of one round is the unbounded call.
//   Split halves (moe_*_send / moe_*_recv): a SEND of several rounds cannot finish before its
//   RECV has run, so a split half of an op with R > 1 is refused (Python at trace time, the
//   handlers and launchers too); one of one round works, one outstanding (moe_in_flight = 1).
//   Against the other designs: sizing the slots by what arrives bounds nothing (one routing
//   sends all T tokens of every source to one rank: W*T rows), and a cap that fails the call
//   on a skewed routing would make a learned router's choice an error; the second round such
//   a cap needs is this protocol. Pulling from the senders' staged rows stages T x
//   destinations rows on the sender, the same size again.
//
// PACKED EXPERT ROWS (the form of lax.ragged_dot's lhs; moe_layer uses it): a dispatch may
// deliver expert_x as [P, H] (and expert_x_scale as [P, S]) instead of [L, W*T, H]: the rows of
// local expert e at [pre[e], pre[e] + counts[e]), pre = exclusive prefix of expert_counts over
// the local experts, in the same (source rank, token) order; rows >= sum(counts) unspecified.
// P = moe_packed_rows = W*T*min(K, L): a token reaches at most min(K, L) local experts, so
// sum(counts) <= P. A combine may take expert_y packed the same way (row g of the SEND's walk
// over sum(counts) rows is row g of the packed array). The handle keeps its layout below (
// expert_src [L, W*T], indexed by (e, i)), so a packed and a padded call share the handle and
// the protocol: only the address of a data row differs. The FFI handlers tell the two forms
// apart by the buffer's rank (2: packed, 3: padded; equal element counts when K >= L).
//
// HANDLE (written by dispatch, read by combine; fixed shapes, all int32):
//   token_dest  [T, K]      expert id routed for (t, k), -1 for unused slots and rows >= num_tokens
//   expert_src  [L, W*T]    row i < expert_counts[e]: (src * T + t) * K + k; rest unspecified
//   expert_counts [L]       the dispatch output itself (pass the same array to combine)
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "layout.h"

namespace nvc {

enum MoeDtype : int { kMoeF32 = 0, kMoeBF16 = 1, kMoeF16 = 2, kMoeF8E4M3 = 3 };

struct MoeConfig {
  int world, rank, num_experts, top_k, max_tokens, hidden, dtype /*MoeDtype*/, scale_cols;
  int max_in_flight = 1;  // split SENDs outstanding at most (1: the fused protocol's layout)
  // 0: a data slot holds a whole call (W*T dispatch rows, T*K combine rows). Else the bytes of
  // one data slot (a multiple of 256): calls run in ROUNDS of at most moe_dispatch_round_tokens /
  // moe_combine_round_tokens tokens through two slots (BOUNDED SLOTS above).
  int64_t slot_bytes = 0;
};

constexpr int kMoeThreads = 256;       // threads per block, every MoE kernel
constexpr int kMoeMaxBlocks = 24;      // flag blocks per source and call (<= kMaxBlocks)
constexpr int kMoeMaxGrid = 1024;      // blocks per kernel (moe_grid_blocks)
constexpr int kMoeMaxTopK = 32;        // one warp holds a token's top_k slots
constexpr int kMoeMaxExperts = 4096;   // shared-memory counters
constexpr int kMoeSubTokens = 128;     // tokens routed per step in the dispatch send kernel
constexpr uint32_t kMoePoisonDesc = kPoisonDesc;  // layout.h
constexpr int kMoeMaxInFlight = 4;     // N = 8 flag slots of kMaxWorld x kMoeMaxBlocks in Ctrl::flags
static_assert(kMoeMaxBlocks <= kMaxBlocks, "flag slots");
static_assert(size_t(2) * kMoeMaxInFlight * kMaxWorld * kMoeMaxBlocks <=
                  sizeof(Ctrl::flags) / sizeof(uint64_t), "MoE flag slots must fit in Ctrl::flags");

// SEND-side counters of a MoE rank, in the zeroed control block after Ctrl.
struct MoeCtrl {
  uint64_t send_seq;          // SENDs issued by this rank (advanced by the SEND's last block)
  uint32_t send_done_blocks;  // last-block counter of the running SEND, 0 between calls
  uint32_t pad;
  // A SEND grid larger than moe_blocks: arrivals per flag group (moe_dispatch.cuh publish_all),
  // 0 between calls.
  uint32_t group_done[kMoeMaxBlocks];
};
constexpr size_t kMoeCtrlOffset = (sizeof(Ctrl) + 255) / 256 * 256;
static_assert(kMoeCtrlOffset + sizeof(MoeCtrl) <= kCtrlBytes, "MoeCtrl must fit in the control block");

// A power of two (max_in_flight is 1, 2 or 4), so the slot of call s is s & (slots - 1): a
// 64-bit modulo would call a division routine in every kernel (and spill around it).
NVC_HD bool moe_bounded(const MoeConfig& c) { return c.slot_bytes > 0; }
// SENDs that may be outstanding: bounded slots hold one round at a time (split calls of one
// round only, one outstanding), else max_in_flight.
NVC_HD int moe_in_flight(const MoeConfig& c) { return moe_bounded(c) ? 1 : c.max_in_flight; }
NVC_HD uint64_t moe_slots(const MoeConfig& c) { return uint64_t(2 * moe_in_flight(c)); }
NVC_HD size_t moe_slot(const MoeConfig& c, uint64_t s) { return size_t(s & (moe_slots(c) - 1)); }
NVC_HD MoeCtrl* moe_ctrl(char* buf) { return reinterpret_cast<MoeCtrl*>(buf + kMoeCtrlOffset); }
// Flag of call s raised by rank `src`, block `block`, in the Ctrl of the rank that receives.
NVC_HD uint64_t* moe_flag(Ctrl* ctrl, const MoeConfig& c, uint64_t s, int src, int block) {
  uint64_t* flat = reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(ctrl) + offsetof(Ctrl, flags));
  return flat + (moe_slot(c, s) * kMaxWorld + src) * kMoeMaxBlocks + block;
}
NVC_HD int moe_dtype_bytes(int dt) { return dt == kMoeF32 ? 4 : dt == kMoeF8E4M3 ? 1 : 2; }
NVC_HD int moe_local_experts(const MoeConfig& c) { return c.num_experts / c.world; }
NVC_HD int moe_max_entries(const MoeConfig& c) {
  int l = moe_local_experts(c);
  return c.top_k < l ? c.top_k : l;
}
// Flag blocks of a call (moe_flag's block index: blocks per source whose flags a RECV waits
// for): a pure function of the config, identical on every rank; the first moe_blocks of a
// grid of moe_grid_blocks (below). Enough blocks for the tokens (4 per block) and for the bytes
// one call may copy
// (max_tokens x top_k rows of hidden x max(2, dtype) bytes, kMoeBytesPerBlock per block), so
// that a small batch of wide rows (decode: 4 tokens x 7168) is copied by several SMs; the
// receive kernels split rows into chunks over all warps of the grid. 32 KiB per block (64 KiB
// until 2026-12-01): one H200, 2 virtual ranks, harness graph time, the example's decode
// (4 tokens x 2048, 128 experts top-8: 4 blocks instead of 2) dispatch 14.0 -> 13.1-13.2 us,
// combine 9.4 -> 8.1; EP2 4 tokens x 7168 24.4 -> 23.7-23.8 per pair; 16 KiB gave a pair within
// 0.1 us of it with a slower dispatch.
constexpr int64_t kMoeBytesPerBlock = 32 * 1024;
NVC_HD int moe_blocks(const MoeConfig& c) {
  const int64_t db = moe_dtype_bytes(c.dtype) < 2 ? 2 : moe_dtype_bytes(c.dtype);
  const int64_t bytes = int64_t(c.max_tokens) * c.top_k * c.hidden * db;
  int64_t b = (c.max_tokens + 3) / 4;
  const int64_t bb = (bytes + kMoeBytesPerBlock - 1) / kMoeBytesPerBlock;
  if (bb > b) b = bb;
  return int(b < 1 ? 1 : (b > kMoeMaxBlocks ? kMoeMaxBlocks : b));
}

// The grid the kernels launch (moe_blocks(c) <= it <= max(moe_blocks(c), cap)): blocks for the
// bytes one call may copy at kMoeBytesPerBlock each, at most `cap` (the launcher's: the GPU's
// SMs, divided among the ranks of one process that share the GPU), never fewer than the flag
// blocks. Only the first moe_blocks(c) blocks own a flag; the others publish through their
// flag group (moe_dispatch.cuh publish_all), so receivers wait for the same W x moe_blocks flags
// whatever the grid, and it may differ between ranks (it is local work only).
NVC_HD int moe_grid_blocks(const MoeConfig& c, int cap) {
  const int gs = moe_blocks(c);
  const int64_t db = moe_dtype_bytes(c.dtype) < 2 ? 2 : moe_dtype_bytes(c.dtype);
  const int64_t bytes = int64_t(c.max_tokens) * c.top_k * c.hidden * db;
  int64_t b = (bytes + kMoeBytesPerBlock - 1) / kMoeBytesPerBlock;
  if (b > cap) b = cap;
  if (b > kMoeMaxGrid) b = kMoeMaxGrid;
  // a grid of less than 1.5 Gs would gain a few SMs and put flag groups (a fence and a ticket
  // more) on the path of every call: the flag blocks alone
  return b >= gs + gs / 2 ? int(b) : gs;
}

// ---- sizes ---------------------------------------------------------------------------------
NVC_HD size_t moe_x_row_bytes(const MoeConfig& c) { return size_t(c.hidden) * moe_dtype_bytes(c.dtype); }
NVC_HD size_t moe_scale_off(const MoeConfig& c) { return align_up(moe_x_row_bytes(c), 16); }
NVC_HD size_t moe_meta_off(const MoeConfig& c) {
  return moe_scale_off(c) + align_up(size_t(c.scale_cols) * 4, 16);
}
NVC_HD size_t moe_drow_bytes(const MoeConfig& c) {
  return moe_meta_off(c) + align_up(8 + 8 * size_t(moe_max_entries(c)), 16);
}
NVC_HD size_t moe_hdr_bytes(const MoeConfig& c) {
  return align_up(4 * (1 + size_t(moe_local_experts(c))), 16);
}
NVC_HD size_t moe_y_row_bytes(const MoeConfig& c, int y_dtype) {
  return size_t(c.hidden) * moe_dtype_bytes(y_dtype);
}
// Bytes of a dispatch region set for `rows` rows per source (W headers + W x rows rows).
NVC_HD size_t moe_dispatch_region_rows_bytes(const MoeConfig& c, int64_t rows) {
  return size_t(c.world) * moe_hdr_bytes(c) + size_t(c.world) * size_t(rows) * moe_drow_bytes(c);
}
NVC_HD size_t moe_dispatch_region_bytes(const MoeConfig& c) {
  return moe_dispatch_region_rows_bytes(c, c.max_tokens);
}
NVC_HD size_t moe_combine_row_bytes(const MoeConfig& c) {  // one token's K landing rows (f32)
  return size_t(c.top_k) * moe_y_row_bytes(c, kMoeF32);
}
NVC_HD size_t moe_combine_region_bytes(const MoeConfig& c) {
  return size_t(c.max_tokens) * moe_combine_row_bytes(c);
}
// The data slot of the unbounded layout: a whole call (what slot_bytes = 0 gives).
NVC_HD size_t moe_full_half_bytes(const MoeConfig& c) {
  size_t d = moe_dispatch_region_bytes(c), m = moe_combine_region_bytes(c);
  return align_up(d > m ? d : m, 256);
}
NVC_HD size_t moe_half_bytes(const MoeConfig& c) {
  return moe_bounded(c) ? size_t(c.slot_bytes) : moe_full_half_bytes(c);
}
// Tokens of one round (source tokens per dispatch round, destination tokens per combine
// round): the most whose rows fit a slot, at most max_tokens; max_tokens when unbounded.
NVC_HD int moe_dispatch_round_tokens(const MoeConfig& c) {
  if (!moe_bounded(c)) return c.max_tokens;
  const size_t hdr = size_t(c.world) * moe_hdr_bytes(c), half = moe_half_bytes(c);
  if (half <= hdr) return 0;
  const size_t r = (half - hdr) / (size_t(c.world) * moe_drow_bytes(c));
  return r < size_t(c.max_tokens) ? int(r) : c.max_tokens;
}
// A combine's landing rows have expert_y's dtype (y_dtype: every rank's call has the same, its
// descriptor says so): a 16-bit y fits twice the tokens of the float32 the slot is sized for.
NVC_HD int moe_combine_round_tokens(const MoeConfig& c, int y_dtype = kMoeF32) {
  if (!moe_bounded(c)) return c.max_tokens;
  const size_t r = moe_half_bytes(c) / (size_t(c.top_k) * moe_y_row_bytes(c, y_dtype));
  return r < size_t(c.max_tokens) ? int(r) : c.max_tokens;
}
NVC_HD int moe_rounds(const MoeConfig& c, int round_tokens) {
  return round_tokens < 1 ? 0 : (c.max_tokens + round_tokens - 1) / round_tokens;
}
NVC_HD int moe_dispatch_rounds(const MoeConfig& c) { return moe_rounds(c, moe_dispatch_round_tokens(c)); }
NVC_HD int moe_combine_rounds(const MoeConfig& c, int y_dtype = kMoeF32) {
  return moe_rounds(c, moe_combine_round_tokens(c, y_dtype));
}
NVC_HD size_t moe_buffer_bytes(const MoeConfig& c) {
  return kCtrlBytes + size_t(moe_slots(c)) * moe_half_bytes(c);
}

// ---- offsets (buf = a rank's buffer base as mapped in this process) -------------------------
// Data slot of call s.
NVC_HD char* moe_half(char* buf, const MoeConfig& c, uint64_t s) {
  return buf + kCtrlBytes + moe_slot(c, s) * moe_half_bytes(c);
}
NVC_HD int32_t* moe_hdr(char* half, const MoeConfig& c, int src) {
  return reinterpret_cast<int32_t*>(half + size_t(src) * moe_hdr_bytes(c));
}
// Row `slot` of source src's region: regions hold moe_dispatch_round_tokens rows (max_tokens
// when unbounded).
// moe_drow_in: the same with the region's rows given (the kernels pass them as a parameter).
NVC_HD char* moe_drow_in(char* half, const MoeConfig& c, int region_rows, int src, int slot) {
  return half + size_t(c.world) * moe_hdr_bytes(c) +
         (size_t(src) * region_rows + slot) * moe_drow_bytes(c);
}
NVC_HD char* moe_drow(char* half, const MoeConfig& c, int src, int slot) {
  return moe_drow_in(half, c, moe_dispatch_round_tokens(c), src, slot);
}
// Landing row of (t, k), t relative to the combine round's first token: slot = t * K + k.
NVC_HD char* moe_landing(char* half, const MoeConfig& c, int y_dtype, size_t slot /*t*K+k*/) {
  return half + slot * moe_y_row_bytes(c, y_dtype);
}

// ---- handle ---------------------------------------------------------------------------------
NVC_HD size_t moe_handle_token_dest_elems(const MoeConfig& c) { return size_t(c.max_tokens) * c.top_k; }
NVC_HD size_t moe_handle_expert_src_elems(const MoeConfig& c) {
  return size_t(moe_local_experts(c)) * c.world * c.max_tokens;
}
NVC_HD size_t moe_expert_rows(const MoeConfig& c) { return size_t(c.world) * c.max_tokens; }
// Rows of a packed expert_x / expert_y (PACKED EXPERT ROWS above).
NVC_HD size_t moe_packed_rows(const MoeConfig& c) {
  return moe_expert_rows(c) * size_t(moe_max_entries(c));
}

// ---- call descriptors (24 bits, see layout.h) ------------------------------------------------
NVC_HD uint64_t moe_config_hash(const MoeConfig& c) {
  uint64_t h = uint64_t(c.world);
  const int f[7] = {c.num_experts, c.top_k, c.max_tokens, c.hidden, c.dtype, c.scale_cols,
                    c.max_in_flight};
  for (int i = 0; i < 7; ++i) h = (h ^ uint64_t(uint32_t(f[i]))) * 0x100000001B3ull + 0x9E37ull;
  if (c.slot_bytes != 0)  // the unbounded layout keeps its descriptors
    for (int i = 0; i < 2; ++i)
      h = (h ^ uint64_t(uint32_t(uint64_t(c.slot_bytes) >> (32 * i)))) * 0x100000001B3ull + 0x9E37ull;
  return h;
}
NVC_HD uint32_t moe_dispatch_desc(const MoeConfig& c) {
  return make_desc(kOpMoeDispatch, moe_config_hash(c), 0);
}
NVC_HD uint32_t moe_combine_desc(const MoeConfig& c, int y_dtype) {
  return make_desc(kOpMoeCombine, moe_config_hash(c), uint64_t(y_dtype) + 1);
}

// Host-side validation: nullptr when usable, else what is wrong. (Checked by the launchers.)
inline const char* moe_config_error(const MoeConfig& c) {
  if (c.world < 1 || c.world > kMaxWorld) return "world must be in [1, 16]";
  if (c.rank < 0 || c.rank >= c.world) return "rank out of range";
  if (c.num_experts < 1 || c.num_experts % c.world != 0) return "num_experts must be a positive multiple of world";
  if (c.num_experts > kMoeMaxExperts) return "num_experts above 4096";
  if (c.top_k < 1 || c.top_k > kMoeMaxTopK || c.top_k > c.num_experts) return "top_k must be in [1, min(32, num_experts)]";
  if (c.max_tokens < 1) return "max_tokens must be positive";
  if (uint64_t(c.world) * c.max_tokens * c.top_k >= (uint64_t(1) << 31)) return "world*max_tokens*top_k must be < 2^31";
  if (c.dtype < 0 || c.dtype > 3) return "dtype must be 0 (f32), 1 (bf16), 2 (f16) or 3 (f8e4m3)";
  if (c.hidden < 1 || c.hidden % 8 != 0 || moe_x_row_bytes(c) % 16 != 0)
    return "hidden must be a multiple of 8 and of 16 bytes of payload";
  if (c.scale_cols < 0) return "scale_cols must be >= 0";
  if (c.max_in_flight != 1 && c.max_in_flight != 2 && c.max_in_flight != 4)
    return "max_in_flight must be 1, 2 or 4";
  if (c.slot_bytes < 0 || c.slot_bytes % 256 != 0)
    return "slot_bytes must be 0 or a positive multiple of 256";
  if (moe_bounded(c) && (moe_dispatch_round_tokens(c) < 1 || moe_combine_round_tokens(c) < 1))
    return "slot_bytes too small for one token's rows";
  return nullptr;
}
inline bool moe_y_dtype_ok(int y_dtype) { return y_dtype >= kMoeF32 && y_dtype <= kMoeF16; }

// ---- float conversions, bit-identical on host and device (RNE; NaN -> quiet NaN) -------------
NVC_HD uint32_t moe_f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u; std::memcpy(&u, &f, 4); return u;
#endif
}
NVC_HD float moe_u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f; std::memcpy(&f, &u, 4); return f;
#endif
}
NVC_HD int moe_clz32(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __clz(x);
#else
  return x ? __builtin_clz(x) : 32;
#endif
}
NVC_HD float moe_bf16_to_f32(uint32_t h) { return moe_u2f((h & 0xFFFFu) << 16); }
NVC_HD uint32_t moe_f32_to_bf16(float f) {
  uint32_t u = moe_f2u(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return ((u >> 16) | 0x40u) & 0xFFFFu;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return u >> 16;
}
NVC_HD float moe_f16_to_f32(uint32_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1F) return moe_u2f(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return moe_u2f(sign);
    int sh = moe_clz32(man) - 21;  // bring the leading 1 to bit 10
    return moe_u2f(sign | (uint32_t(113 - sh) << 23) | (((man << sh) & 0x3FFu) << 13));
  }
  return moe_u2f(sign | ((exp + 112u) << 23) | (man << 13));
}
NVC_HD uint32_t moe_f32_to_f16(float f) {
  uint32_t u = moe_f2u(f), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // rounds to >= 65520: inf
  if (a < 0x38800000u) {                        // f16 subnormal: RNE on 2^-24 units
    uint32_t e = a >> 23;
    if (e < 102) return sign;                   // below 2^-25: rounds to zero
    uint32_t m = (a & 0x7FFFFFu) | 0x800000u, sh = 126 - e;  // sh in [14, 24]
    uint32_t r = m >> sh, rest = m & ((1u << sh) - 1), half = 1u << (sh - 1);
    if (rest > half || (rest == half && (r & 1u))) ++r;
    return sign | r;
  }
  uint32_t h = (a - 0x38000000u) >> 13, rest = a & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return sign | h;
}
// y element <-> float for y dtypes f32 / bf16 / f16 (raw bits in a uint32).
NVC_HD float moe_to_f32(uint32_t bits, int dt) {
  return dt == kMoeF32 ? moe_u2f(bits) : dt == kMoeBF16 ? moe_bf16_to_f32(bits) : moe_f16_to_f32(bits);
}
NVC_HD uint32_t moe_from_f32(float f, int dt) {
  return dt == kMoeF32 ? moe_f2u(f) : dt == kMoeBF16 ? moe_f32_to_bf16(f) : moe_f32_to_f16(f);
}

}  // namespace nvc
