// Host-protocol test of MoE dispatch/combine: W threads (one per rank) over malloc'd buffers,
// checked against an independent reference (exact rows in (source, token) order, counts, scales,
// handles; combine bitwise = float32 fma in k order).
// Build: g++ -std=c++17 -O2 -pthread -I csrc tests/cuda_harness/moe_host_test.cc csrc/host/moe_host.cc
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/moe_layout.h"
#include "host/moe_host.h"
#include "moe_check.h"

using namespace nvc;
using namespace nvc::moe_check;

namespace {

struct World {
  int W;
  std::vector<char*> bufs;
  std::vector<ErrorInfo> err;
  size_t bytes;
  World(const MoeConfig& c) : W(c.world), err(c.world) {
    bytes = moe_buffer_bytes(c);
    for (int r = 0; r < W; ++r) {
      bufs.push_back(static_cast<char*>(std::aligned_alloc(256, align_up(bytes, 256))));
      std::memset(bufs[r], 0xAB, bytes);  // halves need no init: make stale data loud
    }
    reset();
  }
  void reset() {
    for (int r = 0; r < W; ++r) std::memset(bufs[r], 0, kCtrlBytes);
    std::memset(err.data(), 0, sizeof(ErrorInfo) * W);
  }
  ~World() { for (char* b : bufs) std::free(b); }
  CommView view(int r, uint64_t timeout_ns = 20'000'000'000ull) {
    CommView v{};
    v.rank = r;
    v.world = W;
    v.timeout_ns = timeout_ns;
    for (int i = 0; i < W; ++i) v.bufs[i] = bufs[i];
    v.err = &err[r];
    return v;
  }
};

void run_ranks(int W, const std::function<void(int)>& f) {
  std::vector<std::thread> th;
  for (int r = 0; r < W; ++r) th.emplace_back(f, r);
  for (auto& t : th) t.join();
}

MoeConfig cfg_of(const Case& cs, int r) { return case_config(cs, r); }

std::string run_case(const Case& cs) {
  MoeConfig c0 = cfg_of(cs, 0);
  if (std::string e = case_config_check(cs, c0); !e.empty()) return e;
  World world(c0);
  const int W = cs.W, L = cs.E / W;
  const size_t erows = size_t(W) * cs.T;
  for (int round = 0; round < cs.rounds; ++round) {
    std::vector<std::vector<RankIn>> in(cs.inflight);
    std::vector<std::vector<RankOut>> out(cs.inflight, std::vector<RankOut>(W));
    for (int j = 0; j < cs.inflight; ++j)
      for (int r = 0; r < W; ++r) {
        in[j].push_back(make_input(cs, c0, r));
        RankOut& o = out[j][r];
        o.ex.assign(L * erows * moe_x_row_bytes(c0), 0xCD);
        o.cnt.assign(L, -7);
        o.td.assign(size_t(cs.T) * cs.K, -7);
        o.es.assign(L * erows, -7);
        o.exs.assign(L * erows * cs.S, -7.f);
        o.y.assign(size_t(cs.T) * moe_y_row_bytes(c0, cs.ydt), 0xCD);
      }
    run_ranks(W, [&](int r) {
      CommView v = world.view(r);
      MoeConfig c = cfg_of(cs, r);
      for (int j = 0; j < cs.inflight; ++j) {
        RankIn& i = in[j][r];
        RankOut& o = out[j][r];
        std::string e = host::moe_dispatch_host(v, c, i.x.data(), cs.S ? i.xs.data() : nullptr, i.ids.data(),
                                                cs.full ? nullptr : &i.n, o.ex.data(), o.cnt.data(),
                                                cs.S ? o.exs.data() : nullptr, o.td.data(), o.es.data(),
                                                cs.packed);
        if (!e.empty()) { o.err = e; return; }
      }
      for (int j = 0; j < cs.inflight; ++j) {
        RankIn& i = in[j][r];
        RankOut& o = out[j][r];
        std::string e = host::moe_combine_host(v, c, i.ey.data(), cs.ydt, i.w.data(), o.td.data(),
                                               o.es.data(), o.cnt.data(), o.y.data(), cs.packed);
        if (!e.empty()) { o.err = e; return; }
      }
    });
    for (int j = 0; j < cs.inflight; ++j) {
      std::string e = verify(cs, c0, in[j], out[j]);
      if (!e.empty()) return "round " + std::to_string(round) + " op " + std::to_string(j) + ": " + e;
    }
    for (int r = 0; r < W; ++r) {
      const uint64_t want = uint64_t(round + 1) * calls_per_pair(c0, cs.ydt) * cs.inflight;
      if (reinterpret_cast<Ctrl*>(world.bufs[r])->seq != want)
        return "seq did not advance once per call (round)";
    }
  }
  return "";
}

// Error paths: every rank must return an error (none may hang); returns "" when they do.
std::string run_error_case(const char* kind) {
  Case cs{"err", 4, 8, 2, 8, 16, kMoeBF16, 0, kMoeBF16};
  MoeConfig c0 = cfg_of(cs, 0);
  World world(c0);
  std::vector<RankIn> in;
  for (int r = 0; r < cs.W; ++r) in.push_back(make_input(cs, c0, r));
  for (auto& i : in) i.n = cs.T;
  for (int t = 0; t < cs.T; ++t) for (int k = 0; k < cs.K; ++k) for (auto& i : in) i.ids[t * cs.K + k] = (t + 3 * k) % cs.E;
  const std::string k = kind;
  if (k == "bad_expert") in[2].ids[5] = cs.E;
  if (k == "neg_expert") in[1].ids[3] = -2;
  if (k == "duplicate") { in[3].ids[4 * cs.K] = 1; in[3].ids[4 * cs.K + 1] = 1; }
  if (k == "num_tokens") in[0].n = cs.T + 1;
  std::vector<std::string> errs(cs.W);
  const uint64_t timeout = k == "timeout" ? 300'000'000ull : 20'000'000'000ull;
  auto t0 = std::chrono::steady_clock::now();
  run_ranks(cs.W, [&](int r) {
    CommView v = world.view(r, timeout);
    MoeConfig c = cfg_of(cs, r);
    std::vector<uint8_t> ex(size_t(2) * cs.W * cs.T * cs.H * 2), y(size_t(cs.T) * cs.H * 2);
    std::vector<int32_t> cnt(4), td(cs.T * cs.K), es(2 * cs.W * cs.T);
    if (k == "timeout" && r == 1) return;  // rank 1 never calls
    if (k == "mismatch" && r == 3) {       // rank 3 combines while the others dispatch
      cnt.assign(4, 0);
      errs[r] = host::moe_combine_host(v, c, in[r].ey.data(), kMoeBF16, in[r].w.data(), td.data(), es.data(), cnt.data(), y.data());
      return;
    }
    errs[r] = host::moe_dispatch_host(v, c, in[r].x.data(), nullptr, in[r].ids.data(), &in[r].n,
                                      ex.data(), cnt.data(), nullptr, td.data(), es.data());
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string msgs;
  for (int r = 0; r < cs.W; ++r) {
    if (k == "timeout" && r == 1) continue;
    if (errs[r].empty()) return "rank " + std::to_string(r) + " returned success";
    msgs += "\n      " + errs[r];
  }
  const uint32_t want = k == "timeout" ? kErrTimeout : k == "mismatch" ? kErrMismatch
                        : k == "num_tokens" ? kErrCapacity : kErrBadExpert;
  bool seen = false;
  for (auto& e : world.err) seen |= e.code == want;
  if (!seen) return "no rank recorded the expected error code";
  if (k != "timeout" && secs > 5) return "errors took too long (peers did not fail fast)";
  std::printf("    %s (%.2f s):%s\n", kind, secs, msgs.c_str());
  return "";
}

}  // namespace

int main() {
  rng.seed(12345);
  std::vector<Case> cases = {
      {"W2 bf16 scales", 2, 8, 2, 16, 32, kMoeBF16, 2, kMoeBF16},
      {"W4 f16 -> f32 y", 4, 16, 4, 32, 64, kMoeF16, 0, kMoeF32},
      {"W8 fp8 top8 scales", 8, 64, 8, 24, 32, kMoeF8E4M3, 4, kMoeBF16},
      {"W8 f32 top1 -> f16 y", 8, 8, 1, 32, 16, kMoeF32, 0, kMoeF16},
      {"W1", 1, 4, 2, 16, 32, kMoeBF16, 1, kMoeBF16},
      {"W3 odd world", 3, 9, 3, 10, 24, kMoeBF16, 3, kMoeF32},
  };
  Case c;
  c = {"W4 all tokens to one expert", 4, 8, 3, 32, 32, kMoeBF16, 1, kMoeBF16}; c.hot = 5; c.full = true; cases.push_back(c);
  c = {"W4 all to one expert top1", 4, 8, 1, 32, 32, kMoeBF16, 0, kMoeBF16}; c.hot = 0; c.p_neg = 0; c.full = true; cases.push_back(c);
  c = {"W4 half -1 slots", 4, 16, 4, 32, 32, kMoeBF16, 0, kMoeBF16}; c.p_neg = 0.5f; cases.push_back(c);
  c = {"W4 rank 2 zero tokens", 4, 16, 2, 32, 32, kMoeBF16, 2, kMoeBF16}; c.zero_rank = 2; c.rounds = 3; cases.push_back(c);
  c = {"W8 two dispatches in flight", 8, 32, 4, 16, 32, kMoeBF16, 2, kMoeF32}; c.inflight = 2; c.rounds = 4; cases.push_back(c);
  c = {"W4 200 rounds", 4, 16, 4, 16, 16, kMoeBF16, 1, kMoeBF16}; c.rounds = 200; cases.push_back(c);
  c = {"W8 40 rounds in flight 3", 8, 16, 2, 8, 16, kMoeF8E4M3, 0, kMoeBF16}; c.rounds = 40; c.inflight = 3; cases.push_back(c);
  // packed expert rows (moe_layout.h PACKED EXPERT ROWS)
  c = {"packed W4 bf16 scales", 4, 16, 4, 32, 32, kMoeBF16, 2, kMoeBF16}; c.packed = true; c.rounds = 3; cases.push_back(c);
  c = {"packed W4 all to one expert", 4, 8, 3, 32, 32, kMoeBF16, 0, kMoeF32}; c.hot = 5; c.full = true; c.packed = true; cases.push_back(c);
  c = {"packed W4 rank 2 zero tokens", 4, 16, 2, 32, 32, kMoeBF16, 0, kMoeBF16}; c.zero_rank = 2; c.packed = true; c.rounds = 3; cases.push_back(c);
  c = {"packed W4 K > L", 4, 8, 4, 16, 16, kMoeBF16, 0, kMoeBF16}; c.packed = true; c.rounds = 2; cases.push_back(c);
  // bounded slots: every call in rounds (moe_layout.h BOUNDED SLOTS)
  c = {"bounded W4 scales zero rank", 4, 16, 4, 40, 32, kMoeBF16, 2, kMoeBF16}; c.slot_frac = 0.3f; c.zero_rank = 2; c.rounds = 3; cases.push_back(c);
  c = {"bounded W8 top8 f32 y", 8, 64, 8, 64, 32, kMoeBF16, 0, kMoeF32}; c.slot_frac = 0.2f; c.rounds = 2; cases.push_back(c);
  c = {"bounded W4 one token per round", 4, 8, 2, 9, 16, kMoeF16, 0, kMoeF16}; c.slot_frac = 0.01f; c.rounds = 2; cases.push_back(c);
  c = {"bounded W4 all to one expert", 4, 8, 3, 32, 32, kMoeBF16, 0, kMoeBF16}; c.slot_frac = 0.3f; c.hot = 5; c.full = true; cases.push_back(c);
  c = {"bounded packed W4 in flight 2", 4, 16, 2, 32, 32, kMoeBF16, 1, kMoeBF16}; c.slot_frac = 0.4f; c.packed = true; c.inflight = 2; c.rounds = 3; cases.push_back(c);
  c = {"bounded W2 T=4096", 2, 8, 2, 4096, 16, kMoeBF16, 0, kMoeBF16}; c.slot_frac = 0.15f; cases.push_back(c);

  int fails = 0;
  std::printf("%-36s %s\n", "case", "result");
  for (const Case& cs : cases) {
    auto t0 = std::chrono::steady_clock::now();
    std::string e = run_case(cs);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%-36s %s (%.0f ms)%s%s\n", cs.name, e.empty() ? "PASS" : "FAIL", ms, e.empty() ? "" : ": ", e.c_str());
    fails += !e.empty();
  }
  for (const char* k : {"bad_expert", "neg_expert", "duplicate", "num_tokens", "mismatch", "timeout"}) {
    std::string e = run_error_case(k);
    std::printf("%-36s %s%s%s\n", (std::string("error: ") + k).c_str(), e.empty() ? "PASS" : "FAIL", e.empty() ? "" : ": ", e.c_str());
    fails += !e.empty();
  }
  std::printf("%s: %d failure(s)\n", fails ? "FAIL" : "PASS", fails);
  return fails ? 1 : 0;
}
