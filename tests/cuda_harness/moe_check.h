// Shared by the MoE tests (tests/cuda_harness/moe_harness.cu on a GPU, moe_host_test.cc on the
// host protocol): test cases, random inputs and the independent reference check. The reference:
// rows of expert le on rank r are the (src, t, k) with ids[src][t, k] = r * L + le, in (src, t)
// order, with their scales and handles; y[src][t] = float32 fma over k in k order of
// w[t, k] * expert_y row, rounded to y's dtype, compared bitwise.
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/moe_layout.h"

namespace nvc {
namespace moe_check {

struct Case {
  const char* name;
  int W, E, K, T, H, dtype, S, ydt;
  int rounds = 1;
  int inflight = 1;     // dispatches issued before their combines
  float p_neg = 0.1f;   // probability of a -1 slot
  int hot = -1;         // >= 0: every valid token routes to this expert (slot 0)
  int zero_rank = -1;   // this rank sends 0 tokens
  bool full = false;    // num_tokens pointer null (= T)
  bool split = false;   // use the send/recv entry points
  bool mixed = false;   // alternate: even ops (and rounds) fused, odd ones split, one communicator
  int graph = 0;        // > 0: capture one round per rank into a CUDA graph, replay `rounds` times
  bool packed = false;  // expert_x / expert_x_scale / expert_y in the packed form (moe_layout.h)
  float slot_frac = 0;  // > 0: bounded slots (moe_layout.h BOUNDED SLOTS) of about this fraction
                        // of the smaller op's whole call, so both ops run in rounds
};

// The case's config for rank r (slot_bytes from slot_frac, at least one token's rows).
inline MoeConfig case_config(const Case& cs, int r) {
  MoeConfig c{cs.W, r, cs.E, cs.K, cs.T, cs.H, cs.dtype, cs.S};
  if (cs.slot_frac > 0) {
    const size_t d = moe_dispatch_region_bytes(c), m = moe_combine_region_bytes(c);
    const size_t one = std::max(moe_dispatch_region_rows_bytes(c, 1), moe_combine_row_bytes(c));
    c.slot_bytes = int64_t(align_up(std::max(size_t(double(std::min(d, m)) * cs.slot_frac), one), 256));
  }
  return c;
}
// "" when the case's config runs as it means to: a bounded case in rounds for both ops.
inline std::string case_config_check(const Case& cs, const MoeConfig& c) {
  if (const char* e = moe_config_error(c)) return std::string("bad case config: ") + e;
  if (cs.slot_frac > 0 && (moe_dispatch_rounds(c) < 2 || moe_combine_rounds(c, cs.ydt) < 2))
    return "bounded case without rounds (dispatch " + std::to_string(moe_dispatch_rounds(c)) +
           ", combine " + std::to_string(moe_combine_rounds(c, cs.ydt)) + ")";
  return "";
}
// Protocol calls (sequence numbers) of one dispatch + combine pair.
inline uint64_t calls_per_pair(const MoeConfig& c, int y_dtype) {
  return uint64_t(moe_dispatch_rounds(c) + moe_combine_rounds(c, y_dtype));
}

struct RankIn {
  int n;
  std::vector<int32_t> ids;
  std::vector<uint8_t> x;
  std::vector<float> xs, w;
  std::vector<uint8_t> ey;
};
struct RankOut {
  std::vector<uint8_t> ex, y;
  std::vector<int32_t> cnt, td, es;
  std::vector<float> exs;
  std::string err;  // a protocol error the rank reported instead of results (host test)
};

inline std::mt19937 rng(4321);  // the test program reseeds it

void fill_vals(std::vector<uint8_t>& b, int dt) {
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  const int sz = moe_dtype_bytes(dt);
  for (size_t i = 0; i < b.size() / sz; ++i) {
    if (dt == kMoeF8E4M3) { b[i] = uint8_t(rng()); continue; }
    const uint32_t bits = moe_from_f32(u(rng), dt);
    std::memcpy(&b[i * sz], &bits, sz);
  }
}

RankIn make_input(const Case& cs, const MoeConfig& c, int r) {
  const int T = cs.T, K = cs.K, L = cs.E / cs.W;
  RankIn in;
  in.n = cs.full ? T : (r == cs.zero_rank ? 0 : int(rng() % (T + 1)));
  in.ids.assign(size_t(T) * K, -1);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  std::vector<int> perm(cs.E);
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < cs.E; ++e) perm[e] = e;
    for (int k = 0; k < K; ++k) std::swap(perm[k], perm[k + rng() % (cs.E - k)]);  // partial shuffle
    if (cs.hot >= 0) std::swap(perm[0], *std::find(perm.begin(), perm.end(), cs.hot));
    for (int k = 0; k < K; ++k) {
      const bool neg = cs.hot >= 0 ? (k > 0 && u(rng) < cs.p_neg) : u(rng) < cs.p_neg;
      in.ids[size_t(t) * K + k] = neg ? -1 : perm[k];
    }
    if (t >= in.n)  // rows past num_tokens are never read: make them loud
      for (int k = 0; k < K; ++k) in.ids[size_t(t) * K + k] = (t & 1) ? 7777 : -5;
  }
  in.x.resize(size_t(T) * moe_x_row_bytes(c));
  fill_vals(in.x, cs.dtype);
  in.xs.resize(size_t(T) * cs.S);
  for (auto& f : in.xs) f = u(rng);
  in.w.resize(size_t(T) * K);
  for (auto& f : in.w) f = u(rng);
  in.ey.resize(size_t(L) * cs.W * T * moe_y_row_bytes(c, cs.ydt));
  fill_vals(in.ey, cs.ydt);
  return in;
}

std::string verify(const Case& cs, const MoeConfig& c0, const std::vector<RankIn>& in,
                   const std::vector<RankOut>& out) {
  const int W = cs.W, K = cs.K, T = cs.T, L = cs.E / W, S = cs.S;
  const size_t xrow = moe_x_row_bytes(c0), yrow = moe_y_row_bytes(c0, cs.ydt), erows = size_t(W) * T;
  const int ysz = moe_dtype_bytes(cs.ydt);
  // list[r][le] = (src, t, k) in (src, t) order; pos[src][t*K+k] = row index in that list
  std::vector<std::vector<std::vector<std::array<int, 3>>>> list(W, std::vector<std::vector<std::array<int, 3>>>(L));
  std::vector<std::vector<int>> pos(W, std::vector<int>(size_t(T) * K, -1));
  for (int src = 0; src < W; ++src)
    for (int t = 0; t < in[src].n; ++t)
      for (int k = 0; k < K; ++k) {
        const int e = in[src].ids[size_t(t) * K + k];
        if (e < 0) continue;
        pos[src][size_t(t) * K + k] = int(list[e / L][e % L].size());
        list[e / L][e % L].push_back({src, t, k});
      }
  // data row of (rank r, expert le, row i): padded le * erows + i, packed pre[r][le] + i
  std::vector<std::vector<size_t>> pre(W, std::vector<size_t>(L, 0));
  for (int r = 0; r < W; ++r)
    for (int le = 1; le < L; ++le) pre[r][le] = pre[r][le - 1] + list[r][le - 1].size();
  auto drow = [&](int r, int le, size_t i) { return cs.packed ? pre[r][le] + i : le * erows + i; };
  char buf[256];
  for (int r = 0; r < W; ++r) {
    if (!out[r].err.empty()) return "rank " + std::to_string(r) + " error: " + out[r].err;
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) {
        const int want = t < in[r].n ? in[r].ids[size_t(t) * K + k] : -1;
        if (out[r].td[size_t(t) * K + k] != want) {
          snprintf(buf, sizeof buf, "rank %d token_dest[%d,%d] = %d, want %d", r, t, k, out[r].td[size_t(t) * K + k], want);
          return buf;
        }
      }
    for (int le = 0; le < L; ++le) {
      const auto& lst = list[r][le];
      if (out[r].cnt[le] != int(lst.size())) {
        snprintf(buf, sizeof buf, "rank %d expert %d count %d, want %zu", r, le, out[r].cnt[le], lst.size());
        return buf;
      }
      for (size_t i = 0; i < lst.size(); ++i) {
        const auto [src, t, k] = lst[i];
        const size_t er = le * erows + i, dr = drow(r, le, i);
        if (std::memcmp(&out[r].ex[dr * xrow], &in[src].x[t * xrow], xrow) ||
            (S && std::memcmp(&out[r].exs[dr * S], &in[src].xs[size_t(t) * S], S * 4)) ||
            out[r].es[er] != (src * T + t) * K + k) {
          snprintf(buf, sizeof buf, "rank %d expert %d row %zu (src %d token %d k %d) differs", r, le, i, src, t, k);
          return buf;
        }
      }
    }
  }
  std::vector<float> acc(cs.H);
  for (int src = 0; src < W; ++src)
    for (int t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int k = 0; k < K && t < in[src].n; ++k) {
        const int e = in[src].ids[size_t(t) * K + k];
        if (e < 0) continue;
        const uint8_t* row = &in[e / L].ey[drow(e / L, e % L, pos[src][size_t(t) * K + k]) * yrow];
        for (int h = 0; h < cs.H; ++h) {
          uint32_t bits = 0;
          std::memcpy(&bits, row + size_t(h) * ysz, ysz);
          acc[h] = std::fmaf(in[src].w[size_t(t) * K + k], moe_to_f32(bits, cs.ydt), acc[h]);
        }
      }
      for (int h = 0; h < cs.H; ++h) {
        uint32_t want = moe_from_f32(acc[h], cs.ydt), got = 0;
        std::memcpy(&got, &out[src].y[t * yrow + size_t(h) * ysz], ysz);
        if (got != want) {
          snprintf(buf, sizeof buf, "rank %d y[%d,%d] = 0x%x, want 0x%x", src, t, h, got, want);
          return buf;
        }
      }
    }
  return "";
}

}  // namespace moe_check
}  // namespace nvc
