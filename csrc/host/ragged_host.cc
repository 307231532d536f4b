// Host ragged_all_to_all (protocol in ragged_host.h, layout in common/ragged_layout.h).
#include "ragged_host.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "../common/ragged_layout.h"
#include "host_sync.h"

namespace nvc {
namespace host {
namespace {

int64_t at(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : int64_t(static_cast<const int32_t*>(p)[i]);
}

// The first field of slice i outside its bounds (ragged_slice_detail's codes), -1 if none.
int bad_field(const RaggedHostArgs& a, int64_t i) {
  return ragged_slice_field(at(a.input_offsets, a.offsets_64, i),
                            at(a.send_sizes, a.offsets_64, i),
                            at(a.output_offsets, a.offsets_64, i), a.n_rows, a.m_rows);
}

std::string slice_numbers(const RaggedHostArgs& a, int64_t i, int dest) {
  return " (input_offsets[" + std::to_string(i) + "]=" +
         std::to_string(at(a.input_offsets, a.offsets_64, i)) + ", send_sizes[" +
         std::to_string(i) + "]=" + std::to_string(at(a.send_sizes, a.offsets_64, i)) +
         ", output_offsets[" + std::to_string(i) + "]=" +
         std::to_string(at(a.output_offsets, a.offsets_64, i)) + "; operand rows N=" +
         std::to_string(a.n_rows) + ", output rows M=" + std::to_string(a.m_rows) +
         "; the slice goes to rank " + std::to_string(dest) + ")";
}

std::string recv_numbers(int64_t e, int64_t sent, int64_t want, int64_t k) {
  return " (sent " + std::to_string(sent) + " rows, recv_sizes[" + std::to_string(e) +
         "]=" + std::to_string(want) + ", k=" + std::to_string(k) + " slices per peer)";
}

int64_t load_relaxed(const int64_t* p) {
  return std::atomic_ref<int64_t>(*const_cast<int64_t*>(p)).load(std::memory_order_relaxed);
}

char* row(void* base, int64_t r, size_t row_bytes) {
  return static_cast<char*>(base) + size_t(r) * row_bytes;
}
const char* row(const void* base, int64_t r, size_t row_bytes) {
  return static_cast<const char*>(base) + size_t(r) * row_bytes;
}

// ---- chunked path (ragged_layout.h "Chunked path"; one block) ----

// Where a pair's stream walk stands: slice j (of the pair's k) starts at stream byte p.
struct Cursor {
  int64_t j = 0;
  int64_t p = 0;
};

// Calls f(j, a, e) for every slice j of the pair whose stream bytes [P_j, P_j + len(j)) meet
// [lo, hi), with [a, e) the common part; advances c past the slices that end at or before lo
// (the pieces of later rounds start at or after hi, so the walk is linear over the call).
template <class Len, class F>
void walk(Cursor& c, int64_t k, int64_t lo, int64_t hi, Len len, F f) {
  while (c.j < k && c.p + len(c.j) <= lo) {
    c.p += len(c.j);
    ++c.j;
  }
  int64_t p = c.p;
  for (int64_t j = c.j; j < k && p < hi; ++j) {
    const int64_t n = len(j);
    const int64_t a = p > lo ? p : lo, e = p + n < hi ? p + n : hi;
    if (a < e) f(j, a - p, e - a, a);
    p += n;
  }
}

// The round counters a peer of this call may wait for, poisoned at every peer; with `flags`
// (step 1 only: before any round-0 flag went out) the descriptor flags too (the kernel's
// ragged_poison_chunked says why not after).
void poison_chunked(const CommView& v, uint64_t seq, bool flags = false) {
  const uint64_t f = make_flag(seq, kRaggedPoisonDesc), c = ragged_count(seq, kRaggedPoison);
  for (int r = 0; r < v.world; ++r) {
    if (r == v.rank) continue;
    if (flags) store_release(&v.peer_ctrl(r)->flags[seq & 1][0][v.rank][0], f);
    store_release(&v.peer_ctrl(r)->ragged_data[v.rank][0], c);
    store_release(&v.peer_ctrl(r)->ragged_ack[v.rank][0], c);
  }
}

using Clock = std::chrono::steady_clock;

// Wait until *p == make_flag(seq, desc): "" or the recorded error (after poisoning).
std::string wait_flag_one(const CommView& v, const uint64_t* p, uint64_t seq, uint32_t desc,
                          int peer) {
  const auto deadline = Clock::now() + std::chrono::nanoseconds(v.timeout_ns);
  const uint64_t want = make_flag(seq, desc);
  for (uint32_t spins = 0;; ++spins) {
    const uint64_t f = load_acquire(p);
    if (f == want) return "";
    uint32_t code = kErrNone;
    if (flag_seq(f) == seq) code = kErrMismatch;
    else if (flag_seq(f) > seq) code = kErrAhead;
    else if ((spins & 63u) == 63u && Clock::now() > deadline) code = kErrTimeout;
    if (code != kErrNone) {
      poison_chunked(v, seq);
      return record_error(v, code, desc, peer, seq, f);
    }
    if (spins > 64) {
      if (spins < 4096) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

// Wait until *p >= ragged_count(seq, n) (a round counter): "" or the recorded error.
std::string wait_count(const CommView& v, const uint64_t* p, uint64_t seq, uint32_t n,
                       uint32_t desc, int peer) {
  const auto deadline = Clock::now() + std::chrono::nanoseconds(v.timeout_ns);
  const uint64_t want = ragged_count(seq, n), poison = ragged_count(seq, kRaggedPoison);
  for (uint32_t spins = 0;; ++spins) {
    const uint64_t c = load_acquire(p);
    uint32_t code = kErrNone;
    if (c == poison) code = kErrMismatch;
    else if (c >= want) return "";
    else if ((spins & 63u) == 63u && Clock::now() > deadline) code = kErrTimeout;
    if (code != kErrNone) {
      poison_chunked(v, seq);
      return record_error(v, code, desc, peer, seq, c);
    }
    if (spins > 64) {
      if (spins < 4096) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

std::string ragged_chunked(const CommView& v, const RaggedHostArgs& a) {
  const int W = v.world, me = v.rank;
  const int64_t k = a.k, K = int64_t(W) * a.k, C = a.chunk;
  const int64_t rb = int64_t(a.row_bytes);
  const uint32_t desc = ragged_desc(a.n_rows, a.m_rows, a.row_bytes, k, C);
  const uint64_t seq = begin_call(v);
  const uint64_t p = seq & 1;
  if (!ragged_chunk_fits(v.max_message_bytes, W, k, C))
    return record_error(v, kErrCapacity, desc, me, seq, uint64_t(C));
  const bool w64 = a.offsets_64;

  // 1. my slices, all of them before anything is pushed
  for (int64_t i = 0; i < K; ++i) {
    const int f = bad_field(a, i);
    if (f < 0) continue;
    poison_chunked(v, seq, true);
    return record_error(v, kErrRaggedSlice, desc, me, seq, ragged_slice_detail(i, uint32_t(f))) +
           slice_numbers(a, i, int(i / k));
  }

  // the rounds of every pair: from my send_sizes (validated) and my recv_sizes (checked
  // against the senders' header at round 0; a negative entry counts as 0 until then)
  int64_t rs_send[kMaxWorld] = {}, rs_recv[kMaxWorld] = {}, rounds = 1;
  int64_t ss_bytes[kMaxWorld] = {}, rr_bytes[kMaxWorld] = {};
  for (int d = 0; d < W; ++d) {
    int64_t ss = 0, rr = 0;
    for (int64_t j = 0; j < k; ++j) {
      ss += at(a.send_sizes, w64, d * k + j);
      const int64_t x = at(a.recv_sizes, w64, d * k + j);
      rr += x > 0 ? x : 0;
    }
    ss_bytes[d] = ss * rb;
    rr_bytes[d] = rr * rb;
    rs_send[d] = ragged_rounds(ss_bytes[d], C);
    rs_recv[d] = ragged_rounds(rr_bytes[d], C);
    if (d != me) rounds = std::max(rounds, std::max(rs_send[d], rs_recv[d]));
  }
  Cursor sc[kMaxWorld], rc[kMaxWorld];
  char* mine = v.half(me, p);
  const RaggedSlice* my_hdr = ragged_header(mine);

  for (int64_t r = 0; r < rounds; ++r) {
    // sends of round r
    for (int t = 1; t < W; ++t) {
      const int d = (me + t) % W;
      if (r >= rs_send[d]) continue;
      if (r >= 2) {
        std::string e = wait_count(v, &v.ctrl()->ragged_ack[d][0], seq, uint32_t(r - 1), desc,
                                   d);
        if (!e.empty()) return e;
      }
      char* half = v.half(d, p);
      char* slot = ragged_slot(half, W, k, C, me, int(r & 1));
      const int64_t c = ragged_round_bytes(ss_bytes[d], C), lo = r * c;
      walk(sc[d], k, lo, lo + c,
           [&](int64_t j) { return at(a.send_sizes, w64, d * k + j) * rb; },
           [&](int64_t j, int64_t in_slice, int64_t n, int64_t x) {
             std::memcpy(slot + (x - lo),
                         row(a.operand, at(a.input_offsets, w64, d * k + j), rb) + in_slice,
                         size_t(n));
           });
      if (r == 0) {
        RaggedSlice* hdr = ragged_header(half);
        for (int64_t j = 0; j < k; ++j)
          hdr[me * k + j] = RaggedSlice{at(a.output_offsets, w64, d * k + j),
                                        at(a.send_sizes, w64, d * k + j)};
        store_release(&v.peer_ctrl(d)->flags[p][0][me][0], make_flag(seq, desc));
      } else {
        store_release(&v.peer_ctrl(d)->ragged_data[me][0], ragged_count(seq, uint32_t(r)));
      }
    }
    // my slices to myself, while the peers' round 0 travels
    if (r == 0)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = me * k + j;
        const int64_t ss = at(a.send_sizes, w64, i), want = at(a.recv_sizes, w64, i);
        if (ss != want) {
          poison_chunked(v, seq);
          return record_error(v, kErrRaggedRecv, desc, me, seq, ragged_recv_detail(j, ss, want)) +
                 recv_numbers(i, ss, want, k);
        }
        std::memmove(row(a.out, at(a.output_offsets, w64, i), rb),
                     row(a.operand, at(a.input_offsets, w64, i), rb), size_t(ss * rb));
      }
    // receives of round r
    for (int t = 1; t < W; ++t) {
      const int src = (me + W - t) % W;
      if (r >= rs_recv[src]) continue;
      std::string e =
          r == 0 ? wait_flag_one(v, &v.ctrl()->flags[p][0][src][0], seq, desc, src)
                 : wait_count(v, &v.ctrl()->ragged_data[src][0], seq, uint32_t(r), desc, src);
      if (!e.empty()) return e;
      if (r == 0)
        for (int64_t j = 0; j < k; ++j) {
          const int64_t i = src * k + j;
          const int64_t off = load_relaxed(&my_hdr[i].offset);
          const int64_t size = load_relaxed(&my_hdr[i].size);
          const int64_t want = at(a.recv_sizes, w64, i);
          if (size != want) {
            poison_chunked(v, seq);
            return record_error(v, kErrRaggedRecv, desc, src, seq,
                                ragged_recv_detail(j, size, want)) + recv_numbers(i, size, want, k);
          }
          if (off < 0 || off > a.m_rows - size) {  // the sender validated it: memory corruption
            poison_chunked(v, seq);
            return record_error(v, kErrRaggedSlice, desc, src, seq,
                                ragged_slice_detail(int64_t(me) * k + j, 4));
          }
        }
      const char* slot = ragged_slot(mine, W, k, C, src, int(r & 1));
      const int64_t c = ragged_round_bytes(rr_bytes[src], C), lo = r * c;
      walk(rc[src], k, lo, lo + c,
           [&](int64_t j) { return load_relaxed(&my_hdr[src * k + j].size) * rb; },
           [&](int64_t j, int64_t in_slice, int64_t n, int64_t x) {
             std::memcpy(row(a.out, load_relaxed(&my_hdr[src * k + j].offset), rb) + in_slice,
                         slot + (x - lo), size_t(n));
           });
      if (r + 2 < rs_recv[src])
        store_release(&v.peer_ctrl(src)->ragged_ack[me][0], ragged_count(seq, uint32_t(r + 1)));
    }
  }
  end_call(v, seq);
  return "";
}

}  // namespace

std::string ragged_all_to_all(const CommView& v, const RaggedHostArgs& a) {
  if (a.chunk > 0) return ragged_chunked(v, a);
  const int W = v.world, me = v.rank;
  const int64_t k = a.k, K = int64_t(W) * a.k;
  const size_t rb = a.row_bytes;
  const uint32_t desc = ragged_desc(a.n_rows, a.m_rows, rb, k);
  const uint64_t seq = begin_call(v);
  if (!ragged_fits(v.max_message_bytes, W, a.m_rows, rb, k))
    return record_error(v, kErrCapacity, desc, me, seq, uint64_t(a.m_rows) * rb);

  // 1. my slices, all of them before anything is pushed
  for (int64_t i = 0; i < K; ++i) {
    const int f = bad_field(a, i);
    if (f < 0) continue;
    publish(v, seq, kRaggedPoisonDesc, 0);
    return record_error(v, kErrRaggedSlice, desc, me, seq, ragged_slice_detail(i, uint32_t(f))) +
           slice_numbers(a, i, int(i / k));
  }

  // 2. push my rows and header entries into every peer's half, then raise my flags
  for (int d = 0; d < W; ++d) {
    if (d == me) continue;
    char* half = v.half(d, seq);
    char* frame = ragged_frame(half, W, k);
    RaggedSlice* hdr = ragged_header(half);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = d * k + j;
      const int64_t oo = at(a.output_offsets, a.offsets_64, i);
      const int64_t ss = at(a.send_sizes, a.offsets_64, i);
      std::memcpy(row(frame, oo, rb), row(a.operand, at(a.input_offsets, a.offsets_64, i), rb),
                  size_t(ss) * rb);
      hdr[me * k + j] = RaggedSlice{oo, ss};
    }
  }
  publish(v, seq, desc, 0);

  // 3. my slices to myself, then every peer's once its flag is up
  for (int64_t j = 0; j < k; ++j) {
    const int64_t i = me * k + j;
    const int64_t ss = at(a.send_sizes, a.offsets_64, i);
    const int64_t rs = at(a.recv_sizes, a.offsets_64, i);
    if (ss != rs)
      return record_error(v, kErrRaggedRecv, desc, me, seq, ragged_recv_detail(j, ss, rs)) +
             recv_numbers(i, ss, rs, k);
    std::memmove(row(a.out, at(a.output_offsets, a.offsets_64, i), rb),
                 row(a.operand, at(a.input_offsets, a.offsets_64, i), rb), size_t(ss) * rb);
  }
  std::string err = wait_all(v, seq, desc, 0);
  if (!err.empty()) return err;
  char* mine = v.half(me, seq);
  const char* frame = ragged_frame(mine, W, k);
  const RaggedSlice* hdr = ragged_header(mine);
  for (int src = 0; src < W; ++src) {
    if (src == me) continue;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = src * k + j;
      const int64_t off = load_relaxed(&hdr[e].offset);
      const int64_t size = load_relaxed(&hdr[e].size);
      const int64_t want = at(a.recv_sizes, a.offsets_64, e);
      if (size != want)
        return record_error(v, kErrRaggedRecv, desc, src, seq,
                            ragged_recv_detail(j, size, want)) + recv_numbers(e, size, want, k);
      if (off < 0 || off > a.m_rows - size)  // the sender validated it: memory corruption
        return record_error(v, kErrRaggedSlice, desc, src, seq,
                            ragged_slice_detail(int64_t(me) * k + j, 4));  // src's slice index
      std::memcpy(row(a.out, off, rb), row(frame, off, rb), size_t(size) * rb);
    }
  }
  end_call(v, seq);
  return "";
}

}  // namespace host
}  // namespace nvc
