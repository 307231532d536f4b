// Symmetric buffer layout and the per-rank view every protocol works through.
//
// One header shared by the CUDA kernels, the host protocols and the transports, so that the
// sizes every rank computes are the same function of (max_message_bytes, world).
//
// Communicator buffer, per rank (identical offsets on every rank; peers map each other's):
//
//   [0, kCtrlBytes)                      Ctrl: counters this rank owns + flags its peers write
//   [flag_region_offset, +2*flag_half)   flag-protocol data, two halves selected by seq parity
//   [lamport_offset, +3*W*L)             Lamport one-shot slots, 3 rotating buffers x W slots x L
//                                        bytes, every 32-bit word is 0x80000000 when "empty"
//
// Invariants
// - `Ctrl::seq` counts the completed flag-protocol calls of this rank; a call with sequence number
//   s = seq + 1 uses data half (s & 1) and flag parity (s & 1), and the kernel itself advances seq
//   (last block to finish), so CUDA-graph replays advance it without host code.
// - Every flag-protocol call waits for every peer (all-to-all), so no rank is ever more than one
//   call ahead of another: two halves suffice (a rank at call s+2 has seen every peer's flag of
//   call s+1, which each peer raised only after finishing call s).
// - A flag value packs the call's sequence number and a descriptor of the call (op kind, sizes):
//   flag = (seq << 24) | (desc & 0xFFFFFF). A waiter that sees its own seq with another descriptor,
//   or a later seq, reports a disagreement instead of reading the data.
// - `Ctrl::lamport_seq` counts Lamport calls; call k (k = lamport_seq + 1) writes buffer k % 3 and
//   clears buffer (k - 1) % 3 of its own slots region back to 0x80000000. How much to clear
//   (bytes per slot written by call k - 1) is `Ctrl::lamport_bytes`, also advanced by the kernel.
// - Lamport calls also carry a tag (`Ctrl::lamport_tags`, lamport_tag below): call k of rank
//   src writes the tag of (k, descriptor) into lamport_tags[k % 3][src] of every rank, the
//   same buffer rotation and clearing as the data (0 is "empty" there), so a rank that sees a
//   peer's tag of another op, size or call number reports a disagreement instead of summing
//   data of another call.
// - `Ctrl::failed` is 0 until a kernel of this rank records an error (the ErrCode, never
//   reset): every later kernel of this rank exits at its start (kernels/common.cuh), so a
//   failed communicator stays failed, CUDA-graph replays included.
// - Initial state (set by the allocator before first use): Ctrl all zero, every 32-bit word of
//   the Lamport region 0x80000000. The flag halves need no initialisation.
#pragma once
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define NVC_HD __host__ __device__ __forceinline__
#else
#define NVC_HD inline
#endif

namespace nvc {

constexpr int kMaxWorld = 16;      // group size the flag arrays are sized for
constexpr int kMaxBlocks = 64;     // blocks per launch the flag arrays are sized for
constexpr int kMaxPhases = 2;      // flag-protocol phases per call (two-shot: reduce-scatter, all-gather)
constexpr uint32_t kLamportEmpty = 0x80000000u;

// Error codes reported through ErrorInfo (device or host).
enum ErrCode : uint32_t {
  kErrNone = 0,
  kErrTimeout = 1,       // a peer's flag/data did not arrive before the deadline
  kErrMismatch = 2,      // a peer published another call (other op or sizes) at this sequence number
  kErrAhead = 3,         // a peer published a later sequence number than ours
  kErrBadExpert = 4,     // an expert id outside [-1, num_experts)
  kErrCapacity = 5,      // a count exceeds a static capacity
  kErrRowCount = 6,      // all_gather_v / reduce_scatter_v: a row count outside [0, max_rows]
                         // (peer = the rank it belongs to, observed = count | max_rows << 32)
  kErrOffsetsDiffer = 7, // reduce_scatter_v: a peer's offsets give this rank another row count
                         // (peer = that rank, observed = its count | this rank's count << 32)
  kErrInFlight = 8,      // MoE split SEND: more SENDs outstanding than max_in_flight (observed: count)
  kErrOrder = 9,         // MoE RECV of another call than the oldest outstanding SEND (observed: its seq)
  kErrRaggedSlice = 10,  // ragged_all_to_all: a slice outside operand/output (ragged_layout.h;
                         // peer = this rank, observed = ragged_slice_detail)
  kErrRaggedRecv = 11,   // ragged_all_to_all: a peer sends another row count than recv_sizes says
                         // (peer = the sender, observed = ragged_recv_detail)
};

// Written once (first error wins) by a failing kernel or host protocol. For CUDA it lives in
// host-mapped pinned memory so the host can read it without synchronising with the device.
struct ErrorInfo {
  uint32_t code;      // ErrCode
  uint32_t op;        // descriptor of the failing call (OpKind in the low byte)
  int32_t rank;       // the rank that detected it
  int32_t peer;       // the peer it waited for / the offending value
  uint64_t seq;       // the call's sequence number
  uint64_t observed;  // the flag value observed (mismatch) or other detail (kErrBadExpert:
                      // bad_expert_detail; kErrCapacity: the size)
};

// kErrBadExpert: `peer` holds the bad expert id, `observed` packs where it was found: token in
// bits 0..31, top-k slot in bits 32..47, bit 48 set when the id repeats an earlier slot of the
// same row (in range, but a duplicate).
NVC_HD uint64_t bad_expert_detail(int token, int slot, bool repeat) {
  return uint64_t(uint32_t(token)) | (uint64_t(uint32_t(slot) & 0xFFFFu) << 32) |
         (repeat ? (uint64_t(1) << 48) : 0);
}
NVC_HD int bad_expert_token(uint64_t d) { return int(uint32_t(d)); }
NVC_HD int bad_expert_slot(uint64_t d) { return int((d >> 32) & 0xFFFFu); }
NVC_HD bool bad_expert_repeat(uint64_t d) { return (d >> 48) & 1u; }

enum OpKind : uint32_t {
  kOpAllGather = 1,
  kOpAllReduce = 2,
  kOpAllReduceRms = 3,
  kOpMoeDispatch = 4,
  kOpMoeCombine = 5,
  kOpAllGatherV = 6,
  kOpReduceScatterV = 7,
  kOpRaggedAllToAll = 8,
};

// 24-bit call descriptor: op kind in bits 0..3, a hash of the sizes in bits 4..23.
NVC_HD uint32_t make_desc(uint32_t op, uint64_t a, uint64_t b = 0) {
  uint64_t h = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull + (a << 6) + (a >> 2));
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return (op & 0xFu) | (uint32_t(h & 0xFFFFFu) << 4);
}
NVC_HD uint64_t make_flag(uint64_t seq, uint32_t desc) { return (seq << 24) | (desc & 0xFFFFFFu); }
NVC_HD uint64_t flag_seq(uint64_t flag) { return flag >> 24; }
NVC_HD uint32_t flag_desc(uint64_t flag) { return uint32_t(flag & 0xFFFFFFu); }
// The POISON descriptor: a rank that leaves a call raises make_flag(s, kPoisonDesc) where its
// peers would wait for its flags, so they fail at once (kErrMismatch naming it) instead of at
// their deadline. No call's descriptor equals it (op kind 0xF does not exist).
constexpr uint32_t kPoisonDesc = 0xFFFFFFu;

// The control block at offset 0 of every rank's buffer.
struct Ctrl {
  uint64_t seq;           // completed flag-protocol calls (owned by this rank)
  uint64_t lamport_seq;   // completed Lamport calls (owned by this rank)
  uint32_t done_blocks;   // last-block counter of the running kernel, 0 between calls
  uint32_t failed;        // 0, or the ErrCode a kernel of this rank recorded (never reset)
  uint64_t lamport_bytes; // bytes per slot the last Lamport call wrote (the next call clears them)
  uint64_t pad1[4];
  // flags[parity][phase][src][block]: written by rank `src` into this rank's buffer.
  uint64_t flags[2][kMaxPhases][kMaxWorld][kMaxBlocks];
  // lamport_tags[k % 3][src]: the tag of src's Lamport call k (lamport_tag), 0 when empty.
  uint32_t lamport_tags[3][kMaxWorld][4];
  // Round counters of ragged_all_to_all's chunked path (ragged_layout.h), both (seq << 32) |
  // count, so a value of an earlier call is always smaller: ragged_data[src][block] written by
  // sender src (rounds it published to this rank), ragged_ack[dst][block] written by receiver
  // dst (rounds of this rank's stream it consumed).
  uint64_t ragged_data[kMaxWorld][kMaxBlocks];
  uint64_t ragged_ack[kMaxWorld][kMaxBlocks];
};
constexpr size_t kCtrlBytes = 64 * 1024;
static_assert(sizeof(Ctrl) <= kCtrlBytes, "Ctrl too large");

NVC_HD size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// The tag of Lamport call k with descriptor desc, as four 32-bit words none of which is 0 (the
// empty tag): desc (bits 0..3 hold the op kind, never 0), k with bit 31 set, a constant, and
// ~desc. Two tags are equal exactly when the calls' numbers (mod 2^31) and descriptors are.
constexpr uint32_t kLamportTagMagic = 0x4E56434Cu;
NVC_HD void lamport_tag(uint64_t k, uint32_t desc, uint32_t* w) {
  w[0] = desc & 0xFFFFFFu;
  w[1] = uint32_t(k) | 0x80000000u;
  w[2] = kLamportTagMagic;
  w[3] = ~desc & 0xFFFFFFu;
}

// Flag-protocol half: one parity's share of the data area. Two-shot needs a reduce-scatter
// landing zone (W slots of ceil(M/W), 256-B aligned) and an all-gather landing zone (M).
NVC_HD size_t flag_half_bytes(size_t max_message_bytes, int world) {
  size_t slot = align_up((max_message_bytes + world - 1) / world, 256);
  return align_up(slot * world, 256) + align_up(max_message_bytes, 256);
}
// Lamport slot size L: the largest one-shot message; bounded so the whole buffer stays
// <= 8 x max_message_bytes (+ control block).
NVC_HD size_t lamport_slot_bytes(size_t max_message_bytes, int world) {
  size_t cap = (size_t(4) * max_message_bytes) / (size_t(3) * world);
  size_t l = cap < max_message_bytes ? cap : max_message_bytes;
  if (l > (size_t(1) << 20)) l = size_t(1) << 20;  // one-shot never pays above 1 MiB
  return l / 256 * 256;
}
NVC_HD size_t flag_region_offset() { return kCtrlBytes; }
NVC_HD size_t lamport_offset(size_t max_message_bytes, int world) {
  return kCtrlBytes + 2 * flag_half_bytes(max_message_bytes, world);
}
NVC_HD size_t comm_buffer_bytes(size_t max_message_bytes, int world) {
  return lamport_offset(max_message_bytes, world) +
         size_t(3) * world * lamport_slot_bytes(max_message_bytes, world);
}

// What a kernel or host protocol gets for one rank: by value, ~200 bytes.
struct CommView {
  int rank;
  int world;
  uint64_t timeout_ns;                // bounded wait for peers
  char* bufs[kMaxWorld];              // every rank's buffer base as mapped in this process
  ErrorInfo* err;                     // where to report (host-mapped for CUDA)
  size_t max_message_bytes;
  size_t flag_half;                   // flag_half_bytes(max_message_bytes, world)
  size_t lamport_off;                 // lamport_offset(...)
  size_t lamport_slot;                // lamport_slot_bytes(...)
  // Ranks of this process on this GPU, this one included: their kernels compete for the same
  // SMs with no preemption between them. 1 in the package (one GPU per rank in a process; ranks
  // of other processes sharing a GPU are time-sliced); the MoE harness's virtual ranks set W
  // (0 counts as 1). The MoE launcher uses it to keep a one-kernel fused call from starving
  // its peers.
  int context_ranks = 1;
  NVC_HD Ctrl* ctrl() const { return reinterpret_cast<Ctrl*>(bufs[rank]); }
  NVC_HD Ctrl* peer_ctrl(int r) const { return reinterpret_cast<Ctrl*>(bufs[r]); }
  // Start of data half `parity` in rank r's buffer.
  NVC_HD char* half(int r, uint64_t parity) const {
    return bufs[r] + flag_region_offset() + (parity & 1) * flag_half;
  }
  // Lamport buffer `which` (0..2), slot of source `src`, in rank r's buffer.
  NVC_HD char* lamport(int r, int which, int src) const {
    return bufs[r] + lamport_off + (size_t(which) * world + src) * lamport_slot;
  }
};

}  // namespace nvc
