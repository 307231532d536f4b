// Host-memory MoE dispatch / combine: see moe_host.h and common/moe_layout.h for the protocol.
#include "moe_host.h"

#include <chrono>
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

namespace nvc {
namespace host {
namespace {

using u64 = unsigned long long;

uint64_t ld_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void st_release(uint64_t* p, uint64_t x) { __atomic_store_n(p, x, __ATOMIC_RELEASE); }

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

const char* op_name(uint32_t desc) {
  return (desc & 0xFu) == kOpMoeDispatch ? "moe_dispatch" : "moe_combine";
}

// Record (first error wins) and format: "jax_nvcomm moe_x: rank R (seq S): <what>".
std::string report(const CommView& v, uint32_t code, uint32_t desc, int peer, uint64_t seq,
                   uint64_t observed, const std::string& what) {
  if (v.err != nullptr) {
    uint32_t zero = 0;
    if (__atomic_compare_exchange_n(&v.err->code, &zero, code, false, __ATOMIC_ACQ_REL,
                                    __ATOMIC_ACQUIRE)) {
      v.err->op = desc;
      v.err->rank = v.rank;
      v.err->peer = peer;
      v.err->seq = seq;
      v.err->observed = observed;
    }
  }
  return fmt("jax_nvcomm %s: rank %d (seq %llu): ", op_name(desc), v.rank, u64(seq)) + what;
}

// Bad input found by a sender: poison call s in every rank (peers fail at once), then report.
std::string poison(const CommView& v, const MoeConfig& c, uint64_t s, uint32_t code, uint32_t desc,
                   int peer, uint64_t observed, const std::string& what) {
  for (int r = 0; r < v.world; ++r)
    st_release(moe_flag(v.peer_ctrl(r), c, s, v.rank, 0), make_flag(s, kMoePoisonDesc));
  return report(v, code, desc, peer, s, observed, what);
}

void publish(const CommView& v, const MoeConfig& c, uint64_t s, uint32_t desc) {
  for (int r = 0; r < v.world; ++r)
    st_release(moe_flag(v.peer_ctrl(r), c, s, v.rank, 0), make_flag(s, desc));
}

// Call numbering (moe_layout.h): a SEND takes s = MoeCtrl::send_seq + 1 and fails when it would
// be more than max_in_flight SENDs ahead of this rank's RECVs; split, it hands s to its RECV.
std::string begin_send(const CommView& v, const MoeConfig& c, uint32_t desc, uint32_t* seq_out,
                       uint64_t* s_out) {
  const uint64_t s = ld_acquire(&moe_ctrl(v.bufs[v.rank])->send_seq) + 1;
  const uint64_t done = ld_acquire(&v.ctrl()->seq);
  *s_out = s;
  if (s - done > uint64_t(moe_in_flight(c)))
    return poison(v, c, s, kErrInFlight, desc, moe_in_flight(c), s - done,
                  fmt("%llu split sends outstanding, more than the communicator's max_in_flight=%d:"
                      " receive one (moe_*_recv) before the next send", u64(s - done),
                      moe_in_flight(c)));
  if (seq_out != nullptr) *seq_out = uint32_t(s);
  return "";
}
void finish_send(const CommView& v, uint64_t s) { st_release(&moe_ctrl(v.bufs[v.rank])->send_seq, s); }

// A RECV consumes s = Ctrl::seq + 1: the SEND's s when split (seq_in), else (fused) the SEND
// just issued, which must be the only one outstanding.
std::string begin_recv(const CommView& v, uint32_t desc, const uint32_t* seq_in, uint64_t* s_out) {
  const uint64_t s = ld_acquire(&v.ctrl()->seq) + 1;
  *s_out = s;
  if (seq_in != nullptr) {
    if (*seq_in != uint32_t(s))
      return report(v, kErrOrder, desc, 0, s, *seq_in,
                    fmt("receive out of order: it belongs to send #%u, the oldest outstanding send "
                        "is #%llu (receives must come once each, in the order of their sends)",
                        *seq_in, u64(s)));
  } else {
    const uint64_t issued = ld_acquire(&moe_ctrl(v.bufs[v.rank])->send_seq);
    if (issued != s)
      return report(v, kErrOrder, desc, -1, s, issued,
                    fmt("a fused call while %llu split sends are outstanding: receive them "
                        "(moe_*_recv) first", u64(issued - s)));
  }
  return "";
}

// Wait (bounded, yielding) for slot 0 of every source's flag of call s.
std::string wait_all(const CommView& v, const MoeConfig& c, uint64_t s, uint32_t desc) {
  using clock = std::chrono::steady_clock;
  const uint64_t want = make_flag(s, desc);
  const auto start = clock::now();
  const auto deadline = start + std::chrono::nanoseconds(v.timeout_ns);
  for (int src = 0; src < v.world; ++src) {
    const uint64_t* fp = moe_flag(v.ctrl(), c, s, src, 0);
    for (uint32_t spins = 0;; ++spins) {
      const uint64_t f = ld_acquire(fp);
      if (f == want) break;
      if (flag_seq(f) == s) {
        if (flag_desc(f) == kMoePoisonDesc)
          return report(v, kErrMismatch, desc, src, s, f, fmt("rank %d failed this call", src));
        return report(v, kErrMismatch, desc, src, s, f,
                      fmt("rank %d runs another call at this sequence number (descriptor 0x%06x, "
                          "expected 0x%06x): every rank must make the same MoE calls with the "
                          "same configuration", src, flag_desc(f), desc));
      }
      if (flag_seq(f) > s)
        return report(v, kErrAhead, desc, src, s, f,
                      fmt("rank %d is ahead (its seq %llu)", src, u64(flag_seq(f))));
      if ((spins & 15u) == 15u && clock::now() > deadline)
        return report(v, kErrTimeout, desc, src, s, f,
                      fmt("timed out after %.3f s waiting for rank %d (its last flag has seq %llu)",
                          std::chrono::duration<double>(clock::now() - start).count(), src,
                          u64(flag_seq(f))));
      if (spins < 20000) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  return "";
}

std::string check(const CommView& v, const MoeConfig& c, uint32_t op) {
  const char* name = op == kOpMoeDispatch ? "moe_dispatch" : "moe_combine";
  if (const char* e = moe_config_error(c)) return fmt("jax_nvcomm %s: bad config: %s", name, e);
  if (v.rank != c.rank || v.world != c.world)
    return fmt("jax_nvcomm %s: view (rank %d of %d) and config (rank %d of %d) disagree", name,
               v.rank, v.world, c.rank, c.world);
  return "";
}

// A split half (seq pointer given) must be the call's one round; round in [0, rounds).
std::string check_round(const MoeConfig& c, uint32_t op, bool split, int round,
                        int y_dtype = kMoeF32) {
  const char* name = op == kOpMoeDispatch ? "moe_dispatch" : "moe_combine";
  const int rounds = op == kOpMoeDispatch ? moe_dispatch_rounds(c) : moe_combine_rounds(c, y_dtype);
  if (split && rounds != 1)
    return fmt("jax_nvcomm %s: split halves need the call in one round; this communicator's "
               "max_buffer_bytes gives %d rounds per call (use the fused op or a larger "
               "max_buffer_bytes)", name, rounds);
  if (round < 0 || round >= rounds)
    return fmt("jax_nvcomm %s: round %d outside [0, %d)", name, round, rounds);
  return "";
}

}  // namespace

std::string moe_dispatch_send_host(const CommView& v, const MoeConfig& c, const void* x,
                                   const float* x_scale, const int32_t* ids,
                                   const int32_t* num_tokens, int32_t* token_dest,
                                   uint32_t* seq_out, int round) {
  if (std::string e = check(v, c, kOpMoeDispatch); !e.empty()) return e;
  if (std::string e = check_round(c, kOpMoeDispatch, seq_out != nullptr, round); !e.empty())
    return e;
  const int E = c.num_experts, K = c.top_k, W = c.world, T = c.max_tokens, L = E / W, S = c.scale_cols;
  if (!x || !ids || !token_dest || (S > 0 && !x_scale))
    return "jax_nvcomm moe_dispatch: null input pointer";
  const uint32_t desc = moe_dispatch_desc(c);
  uint64_t s = 0;
  if (std::string e = begin_send(v, c, desc, seq_out, &s); !e.empty()) return e;
  const int n = num_tokens ? *num_tokens : T;
  if (n < 0 || n > T)
    return poison(v, c, s, kErrCapacity, desc, n, uint64_t(T),
                  fmt("num_tokens %d outside [0, max_tokens=%d]", n, T));
  for (int t = 0; t < n; ++t)
    for (int k = 0; k < K; ++k) {
      const int e = ids[size_t(t) * K + k];
      if (e < -1 || e >= E)
        return poison(v, c, s, kErrBadExpert, desc, e, bad_expert_detail(t, k, false),
                      fmt("topk_ids[%d, %d] = %d, outside [-1, num_experts=%d)", t, k, e, E));
      for (int k2 = 0; e >= 0 && k2 < k; ++k2)
        if (ids[size_t(t) * K + k2] == e)
          return poison(v, c, s, kErrBadExpert, desc, e, bad_expert_detail(t, k, true),
                        fmt("topk_ids[%d, %d] = %d repeats topk_ids[%d, %d]", t, k, e, t, k2));
    }

  const size_t xrow = moe_x_row_bytes(c), scale_off = moe_scale_off(c), meta_off = moe_meta_off(c);
  // This round's tokens [r0, r1) (all of [0, n) unbounded); idx counts from token 0, positions
  // from r0, and the header carries the call's per-expert totals (moe_layout.h BOUNDED SLOTS).
  const int Td = moe_dispatch_round_tokens(c);
  const int r0 = int(std::min<int64_t>(n, int64_t(round) * Td)), r1 = std::min(n, r0 + Td);
  std::vector<int32_t> cntE(E, 0), cntD(W, 0), totE(E, 0);
  for (int t = 0; t < n; ++t)
    for (int k = 0; k < K; ++k) {
      const int e = ids[size_t(t) * K + k];
      if (e >= 0) {
        ++totE[e];
        if (t < r0) ++cntE[e];
      }
    }
  int idx[kMoeMaxTopK];
  for (int t = r0; t < r1; ++t) {
    const int32_t* row = ids + size_t(t) * K;
    uint32_t dmask = 0;
    for (int k = 0; k < K; ++k)
      if (row[k] >= 0) { idx[k] = cntE[row[k]]++; dmask |= 1u << (row[k] / L); }
    for (int d = 0; d < W; ++d) {
      if (!((dmask >> d) & 1u)) continue;
      char* dst = moe_drow(moe_half(v.bufs[d], c, s), c, v.rank, cntD[d]++);
      std::memcpy(dst, static_cast<const char*>(x) + size_t(t) * xrow, xrow);
      if (S > 0) std::memcpy(dst + scale_off, x_scale + size_t(t) * S, size_t(S) * 4);
      int32_t* meta = reinterpret_cast<int32_t*>(dst + meta_off);
      int m = 0;
      for (int k = 0; k < K; ++k)
        if (row[k] >= 0 && row[k] / L == d) {
          meta[2 + 2 * m] = (row[k] - d * L) | (k << 16);
          meta[3 + 2 * m] = idx[k];
          ++m;
        }
      meta[0] = t;
      meta[1] = m;
    }
    std::memcpy(token_dest + size_t(t) * K, row, size_t(K) * 4);
  }
  for (size_t i = size_t(n) * K; i < size_t(T) * K; ++i) token_dest[i] = -1;
  for (int d = 0; d < W; ++d) {
    int32_t* hdr = moe_hdr(moe_half(v.bufs[d], c, s), c, v.rank);
    hdr[0] = cntD[d];
    for (int le = 0; le < L; ++le) hdr[1 + le] = totE[d * L + le];
  }
  publish(v, c, s, desc);
  finish_send(v, s);
  return "";
}

std::string moe_dispatch_recv_host(const CommView& v, const MoeConfig& c, void* expert_x,
                                   int32_t* expert_counts, float* expert_x_scale,
                                   int32_t* expert_src, const uint32_t* seq_in, bool packed) {
  if (std::string e = check(v, c, kOpMoeDispatch); !e.empty()) return e;
  const int E = c.num_experts, K = c.top_k, W = c.world, T = c.max_tokens, L = E / W, S = c.scale_cols;
  if (!expert_x || !expert_counts || !expert_src || (S > 0 && !expert_x_scale))
    return "jax_nvcomm moe_dispatch: null output pointer";
  if (std::string e = check_round(c, kOpMoeDispatch, seq_in != nullptr, 0); !e.empty()) return e;
  const uint32_t desc = moe_dispatch_desc(c);
  uint64_t s = 0;
  if (std::string e = begin_recv(v, desc, seq_in, &s); !e.empty()) return e;
  if (std::string e = wait_all(v, c, s, desc); !e.empty()) return e;

  char* half = moe_half(v.bufs[v.rank], c, s);
  std::vector<int32_t> rows(W), off(size_t(L) * W + 1), tot(L, 0);
  for (int src = 0; src < W; ++src) {
    const int32_t* hdr = moe_hdr(half, c, src);
    rows[src] = hdr[0];
    const int cap = moe_dispatch_round_tokens(c);  // a region's rows
    if (hdr[0] < 0 || hdr[0] > cap)
      return report(v, kErrCapacity, desc, src, s, uint64_t(uint32_t(hdr[0])),
                    fmt("rank %d announced %d rows (capacity %d)", src, hdr[0], cap));
    for (int le = 0; le < L; ++le) {
      if (hdr[1 + le] < 0 || hdr[1 + le] > T)
        return report(v, kErrCapacity, desc, src, s, uint64_t(uint32_t(hdr[1 + le])),
                      fmt("rank %d announced %d rows for expert %d", src, hdr[1 + le], le));
      off[size_t(le) * W + src] = tot[le];
      tot[le] += hdr[1 + le];
    }
  }
  const size_t xrow = moe_x_row_bytes(c), scale_off = moe_scale_off(c), meta_off = moe_meta_off(c);
  const size_t erows = moe_expert_rows(c);
  const int maxent = moe_max_entries(c);
  std::vector<size_t> pre(L, 0);  // packed: first packed row of each local expert
  for (int le = 1; le < L; ++le) pre[le] = pre[le - 1] + size_t(tot[le - 1]);
  if (packed && pre[L - 1] + size_t(tot[L - 1]) > moe_packed_rows(c))
    return report(v, kErrCapacity, desc, 0, s, pre[L - 1] + size_t(tot[L - 1]),
                  fmt("the ranks announced more rows than the %zu packed rows", moe_packed_rows(c)));
  for (int src = 0; src < W; ++src)
    for (int j = 0; j < rows[src]; ++j) {
      const char* row = moe_drow(half, c, src, j);
      const int32_t* meta = reinterpret_cast<const int32_t*>(row + meta_off);
      const int t = meta[0], m = meta[1];
      if (t < 0 || t >= T || m < 1 || m > maxent)
        return report(v, kErrCapacity, desc, src, s, uint64_t(j),
                      fmt("corrupt row %d from rank %d (token %d, %d experts)", j, src, t, m));
      for (int q = 0; q < m; ++q) {
        const int le = meta[2 + 2 * q] & 0xFFFF, k = meta[2 + 2 * q] >> 16, ix = meta[3 + 2 * q];
        const int cnt = le < L ? moe_hdr(half, c, src)[1 + le] : 0;
        if (le >= L || k >= K || ix < 0 || ix >= cnt)
          return report(v, kErrCapacity, desc, src, s, uint64_t(j),
                        fmt("corrupt row %d from rank %d (expert %d, k %d, index %d)", j, src, le, k, ix));
        const size_t er = size_t(le) * erows + off[size_t(le) * W + src] + ix;
        expert_src[er] = (src * T + t) * K + k;
        const size_t dr = packed ? pre[le] + off[size_t(le) * W + src] + ix : er;  // data row
        std::memcpy(static_cast<char*>(expert_x) + dr * xrow, row, xrow);
        if (S > 0) std::memcpy(expert_x_scale + dr * S, row + scale_off, size_t(S) * 4);
      }
    }
  for (int le = 0; le < L; ++le) expert_counts[le] = tot[le];
  st_release(&v.ctrl()->seq, s);
  return "";
}

std::string moe_dispatch_host(const CommView& v, const MoeConfig& c, const void* x,
                              const float* x_scale, const int32_t* topk_ids,
                              const int32_t* num_tokens, void* expert_x, int32_t* expert_counts,
                              float* expert_x_scale, int32_t* token_dest, int32_t* expert_src,
                              bool packed) {
  if (!expert_x || !expert_counts || !expert_src || (c.scale_cols > 0 && !expert_x_scale))
    return "jax_nvcomm moe_dispatch: null output pointer";  // before SEND: never half a call
  for (int r = 0; r < moe_dispatch_rounds(c); ++r) {  // one round unless the slots are bounded
    std::string e = moe_dispatch_send_host(v, c, x, x_scale, topk_ids, num_tokens, token_dest,
                                           nullptr, r);
    if (e.empty())
      e = moe_dispatch_recv_host(v, c, expert_x, expert_counts, expert_x_scale, expert_src,
                                 nullptr, packed);
    if (!e.empty()) return e;
  }
  return "";
}

std::string moe_combine_send_host(const CommView& v, const MoeConfig& c, const void* expert_y,
                                  int y_dtype, const int32_t* expert_src,
                                  const int32_t* expert_counts, uint32_t* seq_out, bool packed,
                                  int round) {
  if (std::string e = check(v, c, kOpMoeCombine); !e.empty()) return e;
  if (!moe_y_dtype_ok(y_dtype)) return fmt("jax_nvcomm moe_combine: bad expert_y dtype %d", y_dtype);
  if (std::string e = check_round(c, kOpMoeCombine, seq_out != nullptr, round, y_dtype);
      !e.empty())
    return e;
  if (!expert_y || !expert_src || !expert_counts) return "jax_nvcomm moe_combine: null input pointer";
  const int K = c.top_k, W = c.world, T = c.max_tokens, L = moe_local_experts(c);
  const uint32_t desc = moe_combine_desc(c, y_dtype);
  uint64_t s = 0;
  if (std::string e = begin_send(v, c, desc, seq_out, &s); !e.empty()) return e;
  const size_t erows = moe_expert_rows(c), yrow = moe_y_row_bytes(c, y_dtype);
  const int64_t slots = int64_t(T) * K;
  // This round's destination tokens [lo, lo + Tc) (all T unbounded); landing rows relative to lo
  const int64_t Tc = moe_combine_round_tokens(c, y_dtype), lo = int64_t(round) * Tc;
  size_t g = 0;  // packed: the data row of (le, i) is the g-th counted row
  for (int le = 0; le < L; ++le) {
    const int cnt = expert_counts[le];
    if (cnt < 0 || size_t(cnt) > erows)
      return poison(v, c, s, kErrCapacity, desc, le, uint64_t(uint32_t(cnt)),
                    fmt("expert_counts[%d] = %d outside [0, %zu]", le, cnt, erows));
    if (packed && g + size_t(cnt) > moe_packed_rows(c))
      return poison(v, c, s, kErrCapacity, desc, le, uint64_t(uint32_t(cnt)),
                    fmt("expert_counts sum past the %zu packed rows at expert %d", moe_packed_rows(c), le));
    for (int i = 0; i < cnt; ++i, ++g) {
      const size_t er = size_t(le) * erows + i;
      const int slot = expert_src[er];
      if (slot < 0 || slot >= W * slots)
        return poison(v, c, s, kErrCapacity, desc, le, uint64_t(uint32_t(slot)),
                      fmt("handle expert_src[%d, %d] = %d is not a row this dispatch received "
                          "(a handle of another call or communicator?)", le, i, slot));
      const int src = int(slot / slots);
      const int64_t q = slot - src * slots - lo * K;  // landing row within the round
      if (q < 0 || q >= Tc * K) continue;              // another round's token
      std::memcpy(moe_landing(moe_half(v.bufs[src], c, s), c, y_dtype, size_t(q)),
                  static_cast<const char*>(expert_y) + (packed ? g : er) * yrow, yrow);
    }
  }
  publish(v, c, s, desc);
  finish_send(v, s);
  return "";
}

std::string moe_combine_recv_host(const CommView& v, const MoeConfig& c, int y_dtype,
                                  const float* topk_weights, const int32_t* token_dest, void* y,
                                  const uint32_t* seq_in, int round) {
  if (std::string e = check(v, c, kOpMoeCombine); !e.empty()) return e;
  if (!moe_y_dtype_ok(y_dtype)) return fmt("jax_nvcomm moe_combine: bad expert_y dtype %d", y_dtype);
  if (std::string e = check_round(c, kOpMoeCombine, seq_in != nullptr, round, y_dtype);
      !e.empty())
    return e;
  if (!topk_weights || !token_dest || !y) return "jax_nvcomm moe_combine: null pointer";
  const int E = c.num_experts, K = c.top_k, T = c.max_tokens, H = c.hidden;
  const uint32_t desc = moe_combine_desc(c, y_dtype);
  uint64_t s = 0;
  if (std::string e = begin_recv(v, desc, seq_in, &s); !e.empty()) return e;
  if (std::string e = wait_all(v, c, s, desc); !e.empty()) return e;

  char* half = moe_half(v.bufs[v.rank], c, s);
  const size_t yrow = moe_y_row_bytes(c, y_dtype);
  std::vector<float> acc(H);
  const int Tc = moe_combine_round_tokens(c, y_dtype);
  const int lo = int(std::min<int64_t>(T, int64_t(round) * Tc));
  for (int t = lo; t < std::min(T, lo + Tc); ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < K; ++k) {
      const int e = token_dest[size_t(t) * K + k];
      if (e < -1 || e >= E)
        return report(v, kErrBadExpert, desc, e, s, bad_expert_detail(t, k, false),
                      fmt("handle token_dest[%d, %d] = %d is not an expert id", t, k, e));
      if (e < 0) continue;
      const float w = topk_weights[size_t(t) * K + k];
      const char* row = moe_landing(half, c, y_dtype, size_t(t - lo) * K + k);
      if (y_dtype == kMoeF32) {
        const float* p = reinterpret_cast<const float*>(row);
        for (int i = 0; i < H; ++i) acc[i] = std::fmaf(w, p[i], acc[i]);
      } else {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(row);
        if (y_dtype == kMoeBF16)
          for (int i = 0; i < H; ++i) acc[i] = std::fmaf(w, moe_bf16_to_f32(p[i]), acc[i]);
        else
          for (int i = 0; i < H; ++i) acc[i] = std::fmaf(w, moe_f16_to_f32(p[i]), acc[i]);
      }
    }
    char* out = static_cast<char*>(y) + size_t(t) * yrow;
    if (y_dtype == kMoeF32) {
      std::memcpy(out, acc.data(), yrow);
    } else {
      uint16_t* p = reinterpret_cast<uint16_t*>(out);
      for (int i = 0; i < H; ++i) p[i] = uint16_t(moe_from_f32(acc[i], y_dtype));
    }
  }
  st_release(&v.ctrl()->seq, s);
  return "";
}

std::string moe_combine_host(const CommView& v, const MoeConfig& c, const void* expert_y,
                             int y_dtype, const float* topk_weights, const int32_t* token_dest,
                             const int32_t* expert_src, const int32_t* expert_counts, void* y,
                             bool packed) {
  if (!topk_weights || !token_dest || !y) return "jax_nvcomm moe_combine: null pointer";
  for (int r = 0; r < moe_combine_rounds(c, y_dtype); ++r) {  // one round unless bounded
    std::string e = moe_combine_send_host(v, c, expert_y, y_dtype, expert_src, expert_counts,
                                          nullptr, packed, r);
    if (e.empty()) e = moe_combine_recv_host(v, c, y_dtype, topk_weights, token_dest, y, nullptr, r);
    if (!e.empty()) return e;
  }
  return "";
}

}  // namespace host
}  // namespace nvc
