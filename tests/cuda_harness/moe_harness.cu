// Standalone CUDA test of MoE dispatch/combine: W virtual ranks in one process on one GPU (one
// cudaMalloc'd buffer and one stream per rank, every rank's grid small enough that all ranks are
// resident together), checked against a CPU reference: exact counts, rows in (source, token)
// order with their scales, handles, and combine bitwise equal to float32 fma in k order (the
// same numbers the host protocol produces).
//
// Build (from the repo root):
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I csrc
//        tests/cuda_harness/moe_harness.cu csrc/cuda/moe.cu -o build/moe_harness
// Run:  build/moe_harness            PASS/FAIL table, exit 1 on any failure
//       build/moe_harness --perf     + timing of one large EP8 configuration (all ranks share the GPU)
//       build/moe_harness --graph-time  us per call in CUDA graphs, fused and split, W=2 on ONE
//                                    GPU (compares kernel variants, not 2 GPUs)
//       build/moe_harness --probe    (a build with -DNVC_PROBE) SM cycles per phase of each MoE
//                                    kernel, block 0, mean over ranks and calls; W=2 on ONE GPU,
//                                    so waits show the other virtual rank, not NVLink
//       build/moe_harness --bounded-time  us per dispatch + combine pair in CUDA graphs, whole-call
//                                    slots against bounded ones (calls in 2-16 rounds), W=2 on
//                                    ONE GPU (the rounds' cost, not 2-GPU numbers)
//       build/moe_harness --layer-time [TAG]  us per fused packed dispatch / combine at
//                                    moe_layer's decode shapes (W 1 and 2 on ONE GPU, 8-128
//                                    tokens, H 7168, 32 / 256 experts per rank), lines tagged TAG
//       build/moe_harness --error    bad expert id (fused and split, W = 1, 2 and 4; fused with
//                                    bounded slots, the id in the last round): every rank's
//                                    call ends at once with its record and no trap (the context
//                                    stays usable: a normal case runs after it)
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "common/moe_layout.h"
#include "cuda/moe.h"
#include "moe_check.h"

using namespace nvc;
using namespace nvc::moe_check;

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

namespace {


template <typename T>
T* dalloc(size_t n) {
  T* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

// Device arrays of one (rank, in-flight op).
struct Slot {
  uint8_t *x, *ey, *ex, *y;
  float *xs, *w, *exs;
  int32_t *ids, *ntok, *cnt, *td, *es;
};

std::string hex(uint64_t x) {
  char b[32];
  snprintf(b, sizeof b, "%llx", (unsigned long long)x);
  return b;
}

struct World {
  int W;
  MoeConfig c0;
  std::vector<char*> bufs;
  std::vector<ErrorInfo*> err_h, err_d;
  std::vector<cudaStream_t> st;
  explicit World(const MoeConfig& c) : W(c.world), c0(c) {
    const size_t bytes = moe_buffer_bytes(c);
    for (int r = 0; r < W; ++r) {
      bufs.push_back(dalloc<char>(bytes));
      CK(cudaMemset(bufs[r], 0, kCtrlBytes));
      CK(cudaMemset(bufs[r] + kCtrlBytes, 0xAB, bytes - kCtrlBytes));  // no init needed: be loud
      ErrorInfo* h;
      CK(cudaHostAlloc(&h, sizeof(ErrorInfo), cudaHostAllocMapped));
      std::memset(h, 0, sizeof(ErrorInfo));
      ErrorInfo* d;
      CK(cudaHostGetDevicePointer(&d, h, 0));
      err_h.push_back(h);
      err_d.push_back(d);
      cudaStream_t s;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      st.push_back(s);
    }
    CK(cudaDeviceSynchronize());
  }
  ~World() {
    cudaDeviceSynchronize();
    for (int r = 0; r < W; ++r) {
      cudaFree(bufs[r]);
      cudaFreeHost(err_h[r]);
      cudaStreamDestroy(st[r]);
    }
  }
  CommView view(int r) const {
    CommView v{};
    v.rank = r;
    v.world = W;
    v.timeout_ns = 5'000'000'000ull;
    v.context_ranks = W;  // every virtual rank on this GPU, in this process
    for (int i = 0; i < W; ++i) v.bufs[i] = bufs[i];
    v.err = err_d[r];
    return v;
  }
  MoeConfig cfg(int r) const { MoeConfig c = c0; c.rank = r; return c; }
  uint64_t seq(int r) const {
    uint64_t s;
    CK(cudaMemcpy(&s, bufs[r], sizeof s, cudaMemcpyDeviceToHost));
    return s;
  }
  std::string errors() const {
    std::string s;
    for (int r = 0; r < W; ++r)
      if (err_h[r]->code)
        s += " [rank " + std::to_string(r) + " code " + std::to_string(err_h[r]->code) + " peer " +
             std::to_string(err_h[r]->peer) + " seq " + std::to_string(err_h[r]->seq) + " observed 0x" +
             hex(err_h[r]->observed) + "]";
    return s;
  }
};

Slot make_slot(const Case& cs, const MoeConfig& c) {
  const size_t L = cs.E / cs.W, erows = size_t(cs.W) * cs.T;
  Slot s;
  s.x = dalloc<uint8_t>(size_t(cs.T) * moe_x_row_bytes(c));
  s.ey = dalloc<uint8_t>(L * erows * moe_y_row_bytes(c, cs.ydt));
  s.ex = dalloc<uint8_t>(L * erows * moe_x_row_bytes(c));
  s.y = dalloc<uint8_t>(size_t(cs.T) * moe_y_row_bytes(c, cs.ydt));
  s.xs = dalloc<float>(size_t(cs.T) * cs.S);
  s.w = dalloc<float>(size_t(cs.T) * cs.K);
  s.exs = dalloc<float>(L * erows * cs.S);
  s.ids = dalloc<int32_t>(size_t(cs.T) * cs.K);
  s.ntok = dalloc<int32_t>(1);
  s.cnt = dalloc<int32_t>(L);
  s.td = dalloc<int32_t>(size_t(cs.T) * cs.K);
  s.es = dalloc<int32_t>(L * erows);
  return s;
}
void free_slot(Slot& s) {
  for (void* p : {(void*)s.x, (void*)s.ey, (void*)s.ex, (void*)s.y, (void*)s.xs, (void*)s.w, (void*)s.exs,
                  (void*)s.ids, (void*)s.ntok, (void*)s.cnt, (void*)s.td, (void*)s.es})
    cudaFree(p);
}

void upload(const Case& cs, const Slot& s, const RankIn& in) {
  CK(cudaMemcpy(s.x, in.x.data(), in.x.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(s.ey, in.ey.data(), in.ey.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(s.xs, in.xs.data(), in.xs.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(s.w, in.w.data(), in.w.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(s.ids, in.ids.data(), in.ids.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(s.ntok, &in.n, 4, cudaMemcpyHostToDevice));
  // poison outputs so stale results cannot pass
  const size_t L = cs.E / cs.W, erows = size_t(cs.W) * cs.T;
  CK(cudaMemset(s.cnt, 0xFF, L * 4));
  CK(cudaMemset(s.td, 0x7F, size_t(cs.T) * cs.K * 4));
  CK(cudaMemset(s.y, 0xCD, size_t(cs.T) * cs.H * moe_dtype_bytes(cs.ydt)));
  CK(cudaMemset(s.es, 0xEE, L * erows * 4));
}

RankOut download(const Case& cs, const MoeConfig& c, const Slot& s) {
  const size_t L = cs.E / cs.W, erows = size_t(cs.W) * cs.T;
  RankOut o;
  o.ex.resize(L * erows * moe_x_row_bytes(c));
  o.y.resize(size_t(cs.T) * moe_y_row_bytes(c, cs.ydt));
  o.cnt.resize(L);
  o.td.resize(size_t(cs.T) * cs.K);
  o.es.resize(L * erows);
  o.exs.resize(L * erows * cs.S);
  CK(cudaMemcpy(o.ex.data(), s.ex, o.ex.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(o.y.data(), s.y, o.y.size(), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(o.cnt.data(), s.cnt, o.cnt.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(o.td.data(), s.td, o.td.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(o.es.data(), s.es, o.es.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(o.exs.data(), s.exs, o.exs.size() * 4, cudaMemcpyDeviceToHost));
  return o;
}

// Enqueue one round of rank r: `inflight` dispatches, then their combines. only_op >= 0: just
// that op (0 .. 2*inflight-1), for step-major enqueueing across ranks. cs.mixed: op j + round
// odd runs split, even fused, so fused and split calls alternate on one communicator.
void enqueue(const Case& cs, const World& w, int r, const std::vector<Slot>& slots, int only_op = -1,
             int round = 0) {
  const CommView v = w.view(r);
  const MoeConfig c = w.cfg(r);
  cudaStream_t st = w.st[r];
  auto split = [&](int op) { return cs.split || (cs.mixed && (op + round) % 2 == 1); };
  int op = -1;
  for (const Slot& s : slots) {
    if (++op != only_op && only_op >= 0) continue;
    const float* xs = cs.S ? s.xs : nullptr;
    float* exs = cs.S ? s.exs : nullptr;
    const int32_t* nt = cs.full ? nullptr : s.ntok;
    if (split(op)) {
      CK(cuda::moe_dispatch_send(v, c, s.x, xs, s.ids, nt, s.td, st));
      CK(cuda::moe_dispatch_recv(v, c, s.ex, s.cnt, exs, s.es, st, nullptr, cs.packed));
    } else {
      CK(cuda::moe_dispatch(v, c, s.x, xs, s.ids, nt, s.ex, s.cnt, exs, s.td, s.es, st, cs.packed));
    }
  }
  for (const Slot& s : slots) {
    if (++op != only_op && only_op >= 0) continue;
    if (split(op)) {
      CK(cuda::moe_combine_send(v, c, s.ey, cs.ydt, s.es, s.cnt, st, nullptr, cs.packed));
      CK(cuda::moe_combine_recv(v, c, cs.ydt, s.w, s.td, s.y, st));
    } else {
      CK(cuda::moe_combine(v, c, s.ey, cs.ydt, s.w, s.td, s.es, s.cnt, s.y, st, cs.packed));
    }
  }
}

// Synchronise a round; if it is still running after 1 s, print which flags every rank holds
// (read through a separate stream while the kernels spin) before the bounded waits expire.
cudaError_t wait_round(const World& w) {
  auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(1)) {
    bool done = true;
    for (int r = 0; r < w.W; ++r) done &= cudaStreamQuery(w.st[r]) != cudaErrorNotReady;
    if (done) return cudaDeviceSynchronize();
  }
  cudaStream_t ps;
  Ctrl* h;
  if (cudaStreamCreateWithFlags(&ps, cudaStreamNonBlocking) == cudaSuccess &&
      cudaMallocHost(&h, sizeof(Ctrl)) == cudaSuccess) {
    for (int r = 0; r < w.W; ++r) {
      if (cudaMemcpyAsync(h, w.bufs[r], sizeof(Ctrl), cudaMemcpyDeviceToHost, ps) != cudaSuccess ||
          cudaStreamSynchronize(ps) != cudaSuccess) break;
      std::fprintf(stderr, "  stuck: rank %d seq %llu done_blocks %u stream %s; flags (src:blocks with seq %llu):",
                   r, (unsigned long long)h->seq, h->done_blocks,
                   cudaStreamQuery(w.st[r]) == cudaErrorNotReady ? "busy" : "idle", (unsigned long long)h->seq + 1);
      for (int src = 0; src < w.W; ++src) {
        int n = 0;
        for (int b = 0; b < kMoeMaxBlocks; ++b)
          n += flag_seq(*moe_flag(h, w.c0, h->seq + 1, src, b)) == h->seq + 1;
        std::fprintf(stderr, " %d:%d", src, n);
      }
      std::fprintf(stderr, " failed %u dbg %llu %llu\n", h->failed,
                   (unsigned long long)h->pad1[0], (unsigned long long)h->pad1[1]);
    }
  }
  return cudaDeviceSynchronize();
}

std::string run_case(const Case& cs) {
  const MoeConfig c0 = case_config(cs, 0);
  if (std::string e = case_config_check(cs, c0); !e.empty()) return e;
  World w(c0);
  std::vector<std::vector<Slot>> slots(cs.W);
  for (int r = 0; r < cs.W; ++r)
    for (int j = 0; j < cs.inflight; ++j) slots[r].push_back(make_slot(cs, c0));
  std::vector<cudaGraphExec_t> execs;
  if (cs.graph) {
    for (int r = 0; r < cs.W; ++r) {  // capture rank by rank: nothing runs during capture
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(w.st[r], cudaStreamCaptureModeThreadLocal));
      enqueue(cs, w, r, slots[r]);
      CK(cudaStreamEndCapture(w.st[r], &g));
      cudaGraphExec_t ge;
      CK(cudaGraphInstantiate(&ge, g, 0));
      CK(cudaGraphDestroy(g));
      execs.push_back(ge);
    }
  }
  std::string result;
  uint64_t calls = 0;
  for (int round = 0; round < cs.rounds && result.empty(); ++round) {
    std::vector<std::vector<RankIn>> in(cs.inflight);
    for (int j = 0; j < cs.inflight; ++j)
      for (int r = 0; r < cs.W; ++r) {
        in[j].push_back(make_input(cs, c0, r));
        upload(cs, slots[r][j], in[j][r]);
      }
    CK(cudaDeviceSynchronize());
    // graph cases: every third round runs directly, interleaving graph replays and direct calls
    const bool use_graph = cs.graph && round % 3 != 2;
    if (use_graph) {
      for (int r = 0; r < cs.W; ++r) CK(cudaGraphLaunch(execs[r], w.st[r]));
    } else {
      for (int op = 0; op < 2 * cs.inflight; ++op)
        for (int r = 0; r < cs.W; ++r) enqueue(cs, w, r, slots[r], op, round);
    }
    cudaError_t e = wait_round(w);
    if (e != cudaSuccess) {
      std::fprintf(stderr, "%s: %s%s\n", cs.name, cudaGetErrorString(e), w.errors().c_str());
      std::exit(3);  // the context is gone
    }
    calls += calls_per_pair(c0, cs.ydt) * cs.inflight;  // a protocol call per round
    for (int j = 0; j < cs.inflight && result.empty(); ++j) {
      std::vector<RankOut> out;
      for (int r = 0; r < cs.W; ++r) out.push_back(download(cs, c0, slots[r][j]));
      result = verify(cs, c0, in[j], out);
      if (!result.empty()) result = "round " + std::to_string(round) + " op " + std::to_string(j) + ": " + result;
    }
    for (int r = 0; r < cs.W && result.empty(); ++r)
      if (w.seq(r) != calls) result = "Ctrl::seq of rank " + std::to_string(r) + " = " + std::to_string(w.seq(r)) +
                                       ", want " + std::to_string(calls);
  }
  for (auto ge : execs) cudaGraphExecDestroy(ge);
  for (auto& v : slots) for (auto& s : v) free_slot(s);
  if (result.empty() && !w.errors().empty()) result = "ErrorInfo set:" + w.errors();
  return result;
}

// --error: a bad expert id (rank 0, token T-3, slot 1 = E), fused and split, W = 2 and 4: no
// kernel traps; every rank's call ends within 1 s (the deadline is 5 s: the poison flags make
// the peers fail at once) with cudaSuccess; rank 0 records kErrBadExpert with the token, slot
// and id, every other rank kErrMismatch naming rank 0 with the poison descriptor; Ctrl::failed
// is set on every rank; a second round on the failed communicators ends at once with the
// records unchanged. Then a normal case runs in the same process (a healthy CUDA context).
// bounded: slots bounded (fused only), the bad token in the call's last round; found in its
// first (every id is checked there: seq 1 on every rank all the same).
// wide: hidden 7168, top-8, so the grid exceeds moe_blocks (flag groups, moe_dispatch.cuh
// publish_all) where the GPU has the SMs.
bool error_case(int W, bool split, bool bounded = false, bool wide = false) {
  Case cs{"bad expert", W, wide ? 8 * W : 4 * W, wide ? 8 : 2, 32, wide ? 7168 : 64, kMoeBF16, 0, kMoeBF16};
  cs.full = true;
  cs.split = split;
  if (bounded) cs.slot_frac = 0.3f;
  const MoeConfig c0 = case_config(cs, 0);
  World w(c0);
  std::vector<std::vector<Slot>> slots(cs.W);
  for (int r = 0; r < cs.W; ++r) {
    slots[r].push_back(make_slot(cs, c0));
    RankIn in = make_input(cs, c0, r);
    if (r == 0) in.ids[size_t(cs.T - 3) * cs.K + 1] = cs.E;  // one id out of range
    upload(cs, slots[r][0], in);
  }
  CK(cudaDeviceSynchronize());
  bool ok = true;
  for (int round = 0; round < 2; ++round) {
    std::vector<ErrorInfo> before(cs.W);
    for (int r = 0; r < cs.W; ++r) before[r] = *w.err_h[r];
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < cs.W; ++r) enqueue(cs, w, r, slots[r]);
    const cudaError_t e = cudaDeviceSynchronize();
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    bool good = e == cudaSuccess && sec < 1.0;
    for (int r = 0; r < cs.W; ++r) {
      const ErrorInfo& x = *w.err_h[r];
      Ctrl head;
      CK(cudaMemcpy(&head, w.bufs[r], sizeof(head), cudaMemcpyDeviceToHost));
      good &= head.failed == x.code && x.rank == r && x.seq == 1;
      if (r == 0)
        good &= x.code == kErrBadExpert && x.peer == cs.E &&
                x.observed == bad_expert_detail(cs.T - 3, 1, false);
      else
        good &= x.code == kErrMismatch && x.peer == 0 && flag_desc(x.observed) == kMoePoisonDesc;
      if (round == 1) good &= std::memcmp(&before[r], &x, sizeof(x)) == 0;
    }
    std::printf("bad expert id, W=%d %s%s, %s: sync %s after %.3f s;%s %s\n", W,
                split ? "split" : bounded ? "fused, bounded slots (bad id in the last round)" : "fused",
                wide ? " (H 7168 top-8: flag groups)" : "",
                round == 0 ? "the call" : "next call",
                cudaGetErrorString(e), sec, w.errors().c_str(), good ? "ok" : "FAIL");
    ok &= good;
  }
  for (auto& v : slots)
    for (Slot& s : v) free_slot(s);
  return ok;
}

int run_error_mode() {
  bool ok = true;
  for (int W : {1, 2, 4})
    for (bool split : {false, true}) ok &= error_case(W, split);
  for (int W : {1, 2, 4}) ok &= error_case(W, false, true);
  for (bool split : {false, true}) ok &= error_case(2, split, false, true);
  Case healthy{"W2 bf16 scales", 2, 8, 2, 64, 256, kMoeBF16, 4, kMoeBF16};
  const std::string e = run_case(healthy);
  std::printf("a normal case afterwards (healthy context): %s%s\n", e.empty() ? "PASS" : "FAIL ",
              e.c_str());
  ok &= e.empty();
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

// One slot per rank with the case's inputs uploaded (expert_y zeroed), for the timing runs.
std::vector<std::vector<Slot>> timing_slots(const Case& cs, const MoeConfig& c0) {
  std::vector<std::vector<Slot>> slots(cs.W);
  for (int r = 0; r < cs.W; ++r) {
    slots[r].push_back(make_slot(cs, c0));
    RankIn in = make_input(cs, c0, r);
    CK(cudaMemcpy(slots[r][0].x, in.x.data(), in.x.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(slots[r][0].ids, in.ids.data(), in.ids.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(slots[r][0].w, in.w.data(), in.w.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(slots[r][0].ey, 0, in.ey.size()));
  }
  CK(cudaDeviceSynchronize());
  return slots;
}

void run_perf() {
  // EP8 on one GPU (all 8 ranks share one GPU's SMs and HBM): indicative only.
  Case cs{"perf", 8, 256, 8, 128, 7168, kMoeBF16, 0, kMoeBF16};
  cs.full = true;
  cs.p_neg = 0;
  MoeConfig c0{cs.W, 0, cs.E, cs.K, cs.T, cs.H, cs.dtype, cs.S};
  World w(c0);
  std::vector<std::vector<Slot>> slots = timing_slots(cs, c0);
  const int iters = 20;
  double tot[2] = {0, 0};
  for (int it = 0; it < iters + 2; ++it) {
    for (int phase = 0; phase < 2; ++phase) {
      auto t0 = std::chrono::steady_clock::now();
      for (int r = 0; r < cs.W; ++r) {
        const Slot& s = slots[r][0];
        if (phase == 0) CK(cuda::moe_dispatch(w.view(r), w.cfg(r), s.x, nullptr, s.ids, nullptr, s.ex, s.cnt, nullptr, s.td, s.es, w.st[r]));
        else CK(cuda::moe_combine(w.view(r), w.cfg(r), s.ey, cs.ydt, s.w, s.td, s.es, s.cnt, s.y, w.st[r]));
      }
      CK(cudaDeviceSynchronize());
      if (it >= 2) tot[phase] += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }
  }
  std::printf("perf EP8 on ONE GPU, 128 tok/rank, H 7168 bf16, top-8 of 256: dispatch %.1f us, combine %.1f us "
              "(wall incl. launch+sync, all 8 ranks share the GPU)\n", tot[0] / iters, tot[1] / iters);
}

// --graph-time: per configuration, a CUDA graph per rank of `rounds` calls (dispatch only,
// combine only, or both), the ranks' graphs launched together on their own streams; us per
// call, best of 3 launches, fused (moe_dispatch / moe_combine) and split (send + recv). W=2 on
// ONE GPU: both virtual ranks share its SMs and the "peer" is local memory, so these numbers
// compare variants of the kernels with each other, not with 2 GPUs over NVLink.
void run_graph_time() {
  struct PC { const char* name; int E, T, H; };
  const PC pcs[] = {{"example decode: 4 tok, H 2048, E 128", 128, 4, 2048},
                    {"EP2 4 tok, H 7168, E 64", 64, 4, 7168},
                    {"EP2 128 tok, H 7168, E 64", 64, 128, 7168}};
  std::printf("\ngraph-time: W=2 on one GPU, top-8, bf16, us per call (graph of 100 calls per rank, best of 3)\n");
  std::printf("%-38s | %9s %9s %9s | %9s %9s %9s\n", "config", "disp", "comb", "pair", "disp/spl",
              "comb/spl", "pair/spl");
  for (const PC& pc : pcs) {
    std::printf("%-38s |", pc.name);
    for (int split = 0; split < 2; ++split) {
      Case cs{pc.name, 2, pc.E, 8, pc.T, pc.H, kMoeBF16, 0, kMoeBF16};
      cs.full = true;
      cs.p_neg = 0;
      cs.split = split;
      MoeConfig c0{cs.W, 0, cs.E, cs.K, cs.T, cs.H, cs.dtype, cs.S};
      World w(c0);
      std::vector<std::vector<Slot>> slots = timing_slots(cs, c0);
      for (int r = 0; r < cs.W; ++r) enqueue(cs, w, r, slots[r]);  // a handle for combine-only
      CK(wait_round(w));
      const int rounds = 100;
      for (int which = 0; which < 3; ++which) {  // 0 dispatch, 1 combine, 2 both
        std::vector<cudaGraphExec_t> ge(cs.W);
        for (int r = 0; r < cs.W; ++r) {
          cudaGraph_t g;
          CK(cudaStreamBeginCapture(w.st[r], cudaStreamCaptureModeThreadLocal));
          for (int i = 0; i < rounds; ++i) enqueue(cs, w, r, slots[r], which == 2 ? -1 : which);
          CK(cudaStreamEndCapture(w.st[r], &g));
          CK(cudaGraphInstantiate(&ge[r], g, 0));
          CK(cudaGraphDestroy(g));
        }
        cudaEvent_t e0, e1, ej;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        CK(cudaEventCreateWithFlags(&ej, cudaEventDisableTiming));
        float best = 1e30f;
        for (int rep = 0; rep < 4; ++rep) {  // the first launch warms up
          CK(cudaEventRecord(e0, w.st[0]));
          for (int r = 1; r < cs.W; ++r) CK(cudaStreamWaitEvent(w.st[r], e0, 0));
          for (int r = 0; r < cs.W; ++r) CK(cudaGraphLaunch(ge[r], w.st[r]));
          for (int r = 1; r < cs.W; ++r) {
            CK(cudaEventRecord(ej, w.st[r]));
            CK(cudaStreamWaitEvent(w.st[0], ej, 0));
          }
          CK(cudaEventRecord(e1, w.st[0]));
          CK(wait_round(w));
          float ms = 0;
          CK(cudaEventElapsedTime(&ms, e0, e1));
          if (rep > 0) best = std::min(best, ms);
        }
        std::printf(" %9.2f", best * 1000.0f / rounds);
        for (auto g : ge) CK(cudaGraphExecDestroy(g));
        CK(cudaEventDestroy(e0));
        CK(cudaEventDestroy(e1));
        CK(cudaEventDestroy(ej));
      }
      std::printf(split ? "\n" : " |");
      for (auto& v : slots)
        for (Slot& s : v) free_slot(s);
    }
  }
}

// --bounded-time: a dispatch + combine pair in CUDA graphs (10 pairs per graph, best of 3
// launches), whole-call slots against bounded slots of 1/2, 1/4 and 1/8 of a dispatch call
// (the rounds' extra launches and flag exchanges), W = 2 virtual ranks on ONE GPU, top-8 bf16.
// Also the buffer bytes of each: what the bound buys.
void run_bounded_time() {
  struct PC { const char* name; int E, T, H; };
  const PC pcs[] = {{"EP2 512 tok, H 7168, E 16", 16, 512, 7168},
                    {"EP2 4096 tok, H 2048, E 16", 16, 4096, 2048}};
  std::printf("\nbounded-time: W=2 on one GPU, top-8, bf16, us per dispatch + combine pair "
              "(graph of 10 pairs per rank, best of 3)\n");
  std::printf("%-30s | %-10s %8s %8s %10s %8s\n", "config", "slots", "rounds", "MiB/rank",
              "us/pair", "vs whole");
  for (const PC& pc : pcs) {
    double base = 0;
    for (float frac : {0.f, 0.5f, 0.25f, 0.125f}) {
      Case cs{pc.name, 2, pc.E, 8, pc.T, pc.H, kMoeBF16, 0, kMoeBF16};
      cs.full = true;
      cs.p_neg = 0;
      cs.slot_frac = frac;
      const MoeConfig c0 = case_config(cs, 0);
      World w(c0);
      std::vector<std::vector<Slot>> slots = timing_slots(cs, c0);
      const int pairs = 10;
      std::vector<cudaGraphExec_t> ge(cs.W);
      for (int r = 0; r < cs.W; ++r) {
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(w.st[r], cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < pairs; ++i) enqueue(cs, w, r, slots[r]);
        CK(cudaStreamEndCapture(w.st[r], &g));
        CK(cudaGraphInstantiate(&ge[r], g, 0));
        CK(cudaGraphDestroy(g));
      }
      cudaEvent_t e0, e1, ej;
      CK(cudaEventCreate(&e0));
      CK(cudaEventCreate(&e1));
      CK(cudaEventCreateWithFlags(&ej, cudaEventDisableTiming));
      float best = 1e30f;
      for (int rep = 0; rep < 4; ++rep) {  // the first launch warms up
        CK(cudaEventRecord(e0, w.st[0]));
        for (int r = 1; r < cs.W; ++r) CK(cudaStreamWaitEvent(w.st[r], e0, 0));
        for (int r = 0; r < cs.W; ++r) CK(cudaGraphLaunch(ge[r], w.st[r]));
        for (int r = 1; r < cs.W; ++r) {
          CK(cudaEventRecord(ej, w.st[r]));
          CK(cudaStreamWaitEvent(w.st[0], ej, 0));
        }
        CK(cudaEventRecord(e1, w.st[0]));
        CK(wait_round(w));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (rep > 0) best = std::min(best, ms);
      }
      const double us = best * 1000.0 / pairs;
      if (frac == 0) base = us;
      char rounds[32];
      std::snprintf(rounds, sizeof rounds, "%d+%d", moe_dispatch_rounds(c0), moe_combine_rounds(c0, cs.ydt));
      std::printf("%-30s | %-10s %8s %8.1f %10.1f %7.2fx%s\n", pc.name,
                  frac == 0 ? "whole call" : frac == 0.5f ? "1/2 disp" : frac == 0.25f ? "1/4 disp" : "1/8 disp",
                  rounds, moe_buffer_bytes(c0) / 1048576.0, us, us / base,
                  w.errors().empty() ? "" : (" ERROR" + w.errors()).c_str());
      for (auto g : ge) CK(cudaGraphExecDestroy(g));
      CK(cudaEventDestroy(e0));
      CK(cudaEventDestroy(e1));
      CK(cudaEventDestroy(ej));
      for (auto& v : slots)
        for (Slot& sl : v) free_slot(sl);
    }
  }
}

// Light inputs for the layer-shape timings: distinct random ids per row (no -1), x and expert_y
// left as cudaMalloc gives them (timing only: no value is checked), packed buffers.
struct LayerSlot {
  uint8_t *x, *ey, *ex, *y;
  float* w;
  int32_t *ids, *cnt, *td, *es;
};
LayerSlot layer_slot(const Case& cs, const MoeConfig& c, int r) {
  const size_t L = cs.E / cs.W, P = moe_packed_rows(c);
  LayerSlot s;
  s.x = dalloc<uint8_t>(size_t(cs.T) * moe_x_row_bytes(c));
  s.ey = dalloc<uint8_t>(P * moe_y_row_bytes(c, cs.ydt));
  s.ex = dalloc<uint8_t>(P * moe_x_row_bytes(c));
  s.y = dalloc<uint8_t>(size_t(cs.T) * moe_y_row_bytes(c, cs.ydt));
  s.w = dalloc<float>(size_t(cs.T) * cs.K);
  s.ids = dalloc<int32_t>(size_t(cs.T) * cs.K);
  s.cnt = dalloc<int32_t>(L);
  s.td = dalloc<int32_t>(size_t(cs.T) * cs.K);
  s.es = dalloc<int32_t>(L * cs.W * cs.T);
  std::mt19937 g(1234 + r);
  std::vector<int32_t> ids(size_t(cs.T) * cs.K);
  std::vector<int> perm(cs.E);
  for (int t = 0; t < cs.T; ++t) {
    for (int e = 0; e < cs.E; ++e) perm[e] = e;
    for (int k = 0; k < cs.K; ++k) {
      std::swap(perm[k], perm[k + g() % (cs.E - k)]);
      ids[size_t(t) * cs.K + k] = perm[k];
    }
  }
  std::vector<float> w(size_t(cs.T) * cs.K, 0.125f);
  CK(cudaMemcpy(s.ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(s.w, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(s.ey, 0, P * moe_y_row_bytes(c, cs.ydt)));
  CK(cudaMemset(s.x, 0, size_t(cs.T) * moe_x_row_bytes(c)));
  return s;
}
void free_layer_slot(LayerSlot& s) {
  for (void* p : {(void*)s.x, (void*)s.ey, (void*)s.ex, (void*)s.y, (void*)s.w, (void*)s.ids,
                  (void*)s.cnt, (void*)s.td, (void*)s.es})
    cudaFree(p);
}

// --layer-time [tag]: nvc.moe_layer's dispatch and combine (fused calls, packed rows, all tokens)
// at its decode shapes: W = 1 and 2 (virtual ranks on ONE GPU: the peer is local memory), tokens
// 8 / 32 / 128, hidden 7168 bf16, top-8, 32 and 256 experts per rank. A CUDA graph per rank of
// 50 calls (dispatch only, then combine only: one dispatch before gives the handle), the ranks'
// graphs launched together; us per call, best of 3 launches. One line per shape, `tag` first
// (the build's name, for tables of two builds side by side).
void run_layer_time(const char* tag) {
  std::printf("\nlayer-time (%s): fused packed calls, top-8, bf16, H 7168; us per call (graph of 50 "
              "calls per rank, best of 3); W=2 = two virtual ranks on ONE GPU\n", tag);
  std::printf("%-8s %3s %5s %4s | %8s %8s\n", "build", "W", "L", "T", "disp", "comb");
  for (int W : {1, 2})
    for (int L : {32, 256})
      for (int T : {8, 32, 128}) {
        Case cs{"layer", W, L * W, 8, T, 7168, kMoeBF16, 0, kMoeBF16};
        cs.full = true;
        cs.packed = true;
        const MoeConfig c0 = case_config(cs, 0);
        World w(c0);
        std::vector<LayerSlot> sl;
        for (int r = 0; r < W; ++r) sl.push_back(layer_slot(cs, c0, r));
        auto call = [&](int r, int which) {
          const LayerSlot& s = sl[r];
          if (which == 0)
            CK(cuda::moe_dispatch(w.view(r), w.cfg(r), s.x, nullptr, s.ids, nullptr, s.ex, s.cnt,
                                  nullptr, s.td, s.es, w.st[r], true));
          else
            CK(cuda::moe_combine(w.view(r), w.cfg(r), s.ey, cs.ydt, s.w, s.td, s.es, s.cnt, s.y,
                                 w.st[r], true));
        };
        for (int r = 0; r < W; ++r) call(r, 0);  // the handle for the combines
        CK(wait_round(w));
        float us[2];
        for (int which = 0; which < 2; ++which) {
          const int calls = 50;
          std::vector<cudaGraphExec_t> ge(W);
          for (int r = 0; r < W; ++r) {
            cudaGraph_t g;
            CK(cudaStreamBeginCapture(w.st[r], cudaStreamCaptureModeThreadLocal));
            for (int i = 0; i < calls; ++i) call(r, which);
            CK(cudaStreamEndCapture(w.st[r], &g));
            CK(cudaGraphInstantiate(&ge[r], g, 0));
            CK(cudaGraphDestroy(g));
          }
          cudaEvent_t e0, e1, ej;
          CK(cudaEventCreate(&e0));
          CK(cudaEventCreate(&e1));
          CK(cudaEventCreateWithFlags(&ej, cudaEventDisableTiming));
          float best = 1e30f;
          for (int rep = 0; rep < 4; ++rep) {  // the first launch warms up
            CK(cudaEventRecord(e0, w.st[0]));
            for (int r = 1; r < W; ++r) CK(cudaStreamWaitEvent(w.st[r], e0, 0));
            for (int r = 0; r < W; ++r) CK(cudaGraphLaunch(ge[r], w.st[r]));
            for (int r = 1; r < W; ++r) {
              CK(cudaEventRecord(ej, w.st[r]));
              CK(cudaStreamWaitEvent(w.st[0], ej, 0));
            }
            CK(cudaEventRecord(e1, w.st[0]));
            CK(wait_round(w));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (rep > 0) best = std::min(best, ms);
          }
          us[which] = best * 1000.0f / calls;
          for (auto g : ge) CK(cudaGraphExecDestroy(g));
          CK(cudaEventDestroy(e0));
          CK(cudaEventDestroy(e1));
          CK(cudaEventDestroy(ej));
        }
        std::printf("%-8s %3d %5d %4d | %8.2f %8.2f%s\n", tag, W, L, T, us[0], us[1],
                    w.errors().empty() ? "" : (" ERROR" + w.errors()).c_str());
        std::fflush(stdout);
        for (auto& s : sl) free_layer_slot(s);
      }
}

#ifdef NVC_PROBE
// --probe: the phases of the four kernels of a fused dispatch + combine (probe indices in
// kernels/moe_dispatch.cuh and moe_combine.cuh), 200 rounds per configuration.
void run_probe() {
  struct PC { const char* name; int W, E, T, H; bool packed; };
  const PC pcs[] = {{"example decode: 4 tok, H 2048, E 128", 2, 128, 4, 2048, false},
                    {"EP2 4 tok, H 7168, E 64", 2, 64, 4, 7168, false},
                    {"EP2 128 tok, H 7168, E 64", 2, 64, 128, 7168, false},
                    {"layer W1 8 tok, H 7168, E 32, packed", 1, 32, 8, 7168, true},
                    {"layer W1 128 tok, H 7168, E 32, packed", 1, 32, 128, 7168, true},
                    {"layer W1 8 tok, H 7168, E 256, packed", 1, 256, 8, 7168, true}};
  int khz = 0;
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  std::printf("\nprobe: W=1/2 on one GPU, top-8, bf16; mean SM cycles per phase, block 0 (clock attr %d MHz)\n",
              khz / 1000);
  std::printf("%-38s | dsend: %5s %5s %5s %5s | drecv: %5s %5s %5s | csend: %5s %5s %5s | crecv: %5s %5s\n",
              "config", "begin", "A", "B", "pub", "wait", "hdrs", "copy", "scan", "copy", "pub", "wait", "sum");
  for (const PC& pc : pcs) {
    Case cs{pc.name, pc.W, pc.E, 8, pc.T, pc.H, kMoeBF16, 0, kMoeBF16};
    cs.full = true;
    cs.p_neg = 0;
    cs.packed = pc.packed;
    MoeConfig c0{cs.W, 0, cs.E, cs.K, cs.T, cs.H, cs.dtype, cs.S};
    World w(c0);
    std::vector<std::vector<Slot>> slots = timing_slots(cs, c0);
    unsigned long long pr[16];
    const int rounds = 200;
    for (int pass = 0; pass < 2; ++pass) {  // a warm-up pass, then the measured one
      CK(cuda::moe_probe_take(pr));
      for (int it = 0; it < rounds; ++it)
        for (int r = 0; r < cs.W; ++r) enqueue(cs, w, r, slots[r]);
      CK(cudaDeviceSynchronize());
    }
    CK(cuda::moe_probe_take(pr));
    // kernels per round and rank: 2 (a fused dispatch and a fused combine, one kernel each, as
    // W=2 grids fit on the GPU together: moe.cu's fused_fits)
    const double n = pr[15] ? double(pr[15]) / 2.0 : 1.0;
    auto cy = [&](int i) { return double(pr[i]) / n; };
    std::printf("%-38s | %12.0f %5.0f %5.0f %5.0f | %12.0f %5.0f %5.0f | %12.0f %5.0f %5.0f | %12.0f %5.0f"
                " | B: route %5.0f copy %5.0f\n",
                pc.name, cy(1), cy(2), cy(3), cy(4), cy(5), cy(6), cy(7), cy(8), cy(9), cy(10), cy(11),
                cy(12), cy(13), cy(14));
    for (auto& v : slots)
      for (Slot& s : v) free_slot(s);
  }
}
#endif

}  // namespace

int main(int argc, char** argv) {
  // One hardware queue per rank's stream: ranks sharing a queue would serialise behind a spinning
  // kernel. (Direct calls are also enqueued step by step across ranks, which is safe even then.)
  if (const char* m = getenv("CUDA_DEVICE_MAX_CONNECTIONS")) std::printf("CUDA_DEVICE_MAX_CONNECTIONS was %s\n", m);
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);
  bool perf = false;
  const char* only = nullptr;  // --only A|B|...: run the cases whose name contains A or B ...
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    if (!std::strcmp(argv[i], "--error")) {
      CK(cuda::moe_load_kernels());
      return run_error_mode();
    }
    if (!std::strcmp(argv[i], "--perf")) perf = true;
    if (!std::strcmp(argv[i], "--bounded-time")) {
      CK(cuda::moe_load_kernels());
      run_bounded_time();
      return 0;
    }
    if (!std::strcmp(argv[i], "--layer-time")) {
      CK(cuda::moe_load_kernels());
      run_layer_time(i + 1 < argc ? argv[i + 1] : "this");
      return 0;
    }
    if (!std::strcmp(argv[i], "--graph-time")) {
      CK(cuda::moe_load_kernels());
      run_graph_time();
      return 0;
    }
    if (!std::strcmp(argv[i], "--probe")) {
#ifdef NVC_PROBE
      CK(cuda::moe_load_kernels());
      run_probe();
      return 0;
#else
      std::printf("--probe needs a build with -DNVC_PROBE\n");
      return 2;
#endif
    }
  }
  std::vector<Case> cases = {
      {"W2 bf16 scales", 2, 8, 2, 64, 256, kMoeBF16, 4, kMoeBF16},
      {"W4 f16 -> f32 y", 4, 16, 4, 96, 512, kMoeF16, 0, kMoeF32},
      {"W8 fp8 top8 scales", 8, 64, 8, 128, 512, kMoeF8E4M3, 4, kMoeBF16},
      {"W8 f32 top1 -> f16 y", 8, 16, 1, 64, 128, kMoeF32, 0, kMoeF16},
      {"W1", 1, 4, 2, 16, 64, kMoeBF16, 1, kMoeBF16},
      {"W3 odd world, 3 scales", 3, 9, 3, 40, 24, kMoeBF16, 3, kMoeF32},
      {"W16 max world", 16, 32, 4, 32, 64, kMoeBF16, 2, kMoeBF16},
      {"W2 T=4096 (sub-chunks)", 2, 8, 2, 4096, 64, kMoeBF16, 1, kMoeBF16},
      {"W4 T=5 (tiny grid)", 4, 8, 2, 5, 32, kMoeBF16, 0, kMoeBF16},
  };
  Case c;
  c = {"W4 all tokens to one expert", 4, 8, 3, 64, 128, kMoeBF16, 1, kMoeBF16}; c.hot = 5; c.full = true; cases.push_back(c);
  c = {"W8 all to one expert top1", 8, 16, 1, 128, 128, kMoeBF16, 0, kMoeBF16}; c.hot = 0; c.p_neg = 0; c.full = true; cases.push_back(c);
  c = {"W4 half -1 slots", 4, 16, 4, 64, 128, kMoeBF16, 0, kMoeBF16}; c.p_neg = 0.5f; cases.push_back(c);
  c = {"W4 rank 2 zero tokens", 4, 16, 2, 64, 128, kMoeBF16, 2, kMoeBF16}; c.zero_rank = 2; c.rounds = 3; cases.push_back(c);
  c = {"W8 top8 of 256 E, 7168 H", 8, 256, 8, 32, 7168, kMoeBF16, 56, kMoeBF16}; c.full = true; cases.push_back(c);
  c = {"W8 two dispatches in flight", 8, 32, 4, 64, 128, kMoeBF16, 2, kMoeF32}; c.inflight = 2; c.rounds = 5; cases.push_back(c);
  c = {"W4 three dispatches in flight", 4, 16, 2, 32, 64, kMoeF8E4M3, 1, kMoeF16}; c.inflight = 3; c.rounds = 10; cases.push_back(c);
  c = {"W4 split send/recv", 4, 16, 4, 64, 128, kMoeF16, 0, kMoeF16}; c.split = true; c.rounds = 3; cases.push_back(c);
  c = {"W4 200 rounds changing routing", 4, 16, 4, 32, 64, kMoeBF16, 1, kMoeBF16}; c.rounds = 200; cases.push_back(c);
  c = {"W8 graph replay x30, 2 in flight", 8, 32, 4, 48, 128, kMoeBF16, 2, kMoeBF16}; c.graph = 1; c.rounds = 30; c.inflight = 2; cases.push_back(c);
  c = {"W4 fused and split alternate", 4, 16, 4, 32, 128, kMoeBF16, 1, kMoeBF16}; c.mixed = true; c.inflight = 2; c.rounds = 8; cases.push_back(c);
  c = {"W2 graph replay x30, split, fp8", 2, 8, 8, 64, 128, kMoeF8E4M3, 4, kMoeF32}; c.graph = 1; c.rounds = 30; c.split = true; cases.push_back(c);
  // packed expert rows (moe_layout.h PACKED EXPERT ROWS; moe_layer's form)
  c = {"packed W4 bf16 scales", 4, 16, 4, 64, 256, kMoeBF16, 2, kMoeBF16}; c.packed = true; c.rounds = 3; cases.push_back(c);
  c = {"packed W1 256 E top8 7168 H", 1, 256, 8, 32, 7168, kMoeBF16, 0, kMoeBF16}; c.packed = true; c.full = true; cases.push_back(c);
  c = {"packed W8 all to one expert", 8, 16, 3, 32, 128, kMoeBF16, 0, kMoeF32}; c.hot = 5; c.full = true; c.packed = true; cases.push_back(c);
  c = {"packed W4 rank 2 zero tokens split", 4, 16, 2, 64, 128, kMoeBF16, 0, kMoeBF16}; c.zero_rank = 2; c.split = true; c.packed = true; c.rounds = 3; cases.push_back(c);
  c = {"packed W2 graph replay x20", 2, 8, 2, 48, 128, kMoeBF16, 0, kMoeBF16}; c.graph = 1; c.rounds = 20; c.packed = true; cases.push_back(c);
  c = {"packed W4 K > L (P = L*W*T)", 4, 8, 4, 16, 64, kMoeBF16, 0, kMoeBF16}; c.packed = true; c.rounds = 2; cases.push_back(c);
  // small enough for compute-sanitizer (the 5 s peer deadline holds under its slowdown)
  c = {"packed tiny W4 T=5 scales zero rank", 4, 8, 2, 5, 32, kMoeBF16, 1, kMoeBF16}; c.zero_rank = 1; c.packed = true; c.rounds = 2; cases.push_back(c);
  c = {"packed tiny W2 T=4 split", 2, 4, 2, 4, 32, kMoeBF16, 0, kMoeF32}; c.split = true; c.packed = true; cases.push_back(c);
  c = {"packed tiny W2 T=4 graph x3", 2, 4, 4, 4, 32, kMoeBF16, 0, kMoeBF16}; c.graph = 1; c.rounds = 3; c.packed = true; cases.push_back(c);
  // grids past moe_blocks (flag groups: moe_dispatch.cuh publish_all) at W 2 and 3 (132 SMs:
  // 66 / 44 blocks per virtual rank against 24 flag blocks)
  c = {"groups W2 packed 64 E top8 7168 H T=64", 2, 64, 8, 64, 7168, kMoeBF16, 2, kMoeBF16}; c.packed = true; c.rounds = 2; cases.push_back(c);
  c = {"groups W2 split 7168 H T=32", 2, 32, 8, 32, 7168, kMoeBF16, 0, kMoeF32}; c.split = true; c.rounds = 2; cases.push_back(c);
  c = {"groups W3 fused and split alternate 7168 H", 3, 24, 8, 32, 7168, kMoeBF16, 1, kMoeBF16}; c.mixed = true; c.inflight = 2; c.rounds = 4; cases.push_back(c);
  c = {"groups W2 graph x10 H 4096 T=32", 2, 16, 8, 32, 4096, kMoeBF16, 1, kMoeBF16}; c.graph = 1; c.rounds = 10; c.packed = true; cases.push_back(c);
  c = {"groups W2 tiny H 4096 T=32 split", 2, 16, 8, 32, 4096, kMoeBF16, 0, kMoeBF16}; c.split = true; c.packed = true; cases.push_back(c);
  // routings whose bit masks do not fit shared memory: the counting SEND (and at world 1 the
  // two-half kernels)
  c = {"W2 counting SEND: E 256, T=4096", 2, 256, 2, 4096, 64, kMoeBF16, 1, kMoeBF16}; c.packed = true; cases.push_back(c);
  c = {"W1 two halves: E 1024, T=512", 1, 1024, 4, 512, 64, kMoeBF16, 0, kMoeF32}; c.rounds = 2; cases.push_back(c);
  // world 1: fused calls in one kernel each (kernels/moe_local.cuh), split calls in two halves
  c = {"local W1 packed 32 E top8 7168 H T=128", 1, 32, 8, 128, 7168, kMoeBF16, 0, kMoeBF16}; c.packed = true; c.full = true; c.p_neg = 0; cases.push_back(c);
  c = {"local W1 padded scales -> f32 y", 1, 16, 4, 64, 256, kMoeBF16, 3, kMoeF32}; c.rounds = 3; cases.push_back(c);
  c = {"local W1 fp8 scales packed -> f16 y", 1, 64, 8, 96, 512, kMoeF8E4M3, 4, kMoeF16}; c.packed = true; c.rounds = 2; cases.push_back(c);
  c = {"local W1 f32 top1", 1, 16, 1, 64, 128, kMoeF32, 0, kMoeF32}; c.rounds = 2; cases.push_back(c);
  c = {"local W1 K = E packed", 1, 4, 4, 40, 64, kMoeBF16, 1, kMoeBF16}; c.packed = true; c.rounds = 2; cases.push_back(c);
  c = {"local W1 all to one expert", 1, 8, 3, 64, 128, kMoeBF16, 1, kMoeBF16}; c.hot = 5; c.full = true; cases.push_back(c);
  c = {"local W1 T=4096 (long masks)", 1, 8, 2, 4096, 64, kMoeBF16, 1, kMoeBF16}; c.packed = true; cases.push_back(c);
  c = {"local W1 1024 experts T=8", 1, 1024, 8, 8, 256, kMoeBF16, 0, kMoeBF16}; c.packed = true; c.rounds = 3; cases.push_back(c);
  c = {"local W1 zero tokens", 1, 16, 4, 32, 128, kMoeBF16, 0, kMoeBF16}; c.zero_rank = 0; c.rounds = 2; cases.push_back(c);
  c = {"local W1 fused and split alternate", 1, 16, 4, 32, 128, kMoeBF16, 1, kMoeBF16}; c.mixed = true; c.inflight = 2; c.rounds = 8; cases.push_back(c);
  c = {"local W1 split", 1, 32, 8, 64, 512, kMoeBF16, 2, kMoeBF16}; c.split = true; c.packed = true; c.rounds = 2; cases.push_back(c);
  c = {"local W1 graph replay x20, 2 in flight", 1, 32, 4, 48, 128, kMoeBF16, 2, kMoeBF16}; c.graph = 1; c.rounds = 20; c.inflight = 2; c.packed = true; cases.push_back(c);
  c = {"local W1 200 rounds changing routing", 1, 16, 4, 32, 64, kMoeBF16, 1, kMoeF32}; c.rounds = 200; cases.push_back(c);
  c = {"packed tiny W1 T=6 local scales", 1, 8, 4, 6, 32, kMoeBF16, 2, kMoeBF16}; c.packed = true; c.rounds = 3; cases.push_back(c);
  c = {"packed tiny W1 T=5 local graph x3 mixed", 1, 4, 2, 5, 32, kMoeBF16, 0, kMoeF32}; c.graph = 1; c.rounds = 3; c.mixed = true; c.packed = true; cases.push_back(c);
  // bounded slots (moe_layout.h BOUNDED SLOTS): every call in rounds of SEND + RECV kernels
  c = {"bounded W4 scales zero rank", 4, 16, 4, 64, 256, kMoeBF16, 2, kMoeBF16}; c.slot_frac = 0.3f; c.zero_rank = 2; c.rounds = 3; cases.push_back(c);
  c = {"bounded W8 fp8 top8 f32 y", 8, 64, 8, 128, 512, kMoeF8E4M3, 4, kMoeF32}; c.slot_frac = 0.2f; c.rounds = 2; cases.push_back(c);
  c = {"bounded W8 H 7168 E 16 T=256", 8, 16, 4, 256, 7168, kMoeBF16, 0, kMoeBF16}; c.slot_frac = 0.25f; c.full = true; cases.push_back(c);
  c = {"bounded W2 T=4096", 2, 8, 2, 4096, 64, kMoeBF16, 1, kMoeBF16}; c.slot_frac = 0.1f; cases.push_back(c);
  c = {"bounded W4 all to one expert", 4, 8, 3, 64, 128, kMoeBF16, 1, kMoeBF16}; c.slot_frac = 0.3f; c.hot = 5; c.full = true; cases.push_back(c);
  c = {"bounded W8 graph x20, 2 in flight", 8, 32, 4, 48, 128, kMoeBF16, 2, kMoeBF16}; c.slot_frac = 0.3f; c.graph = 1; c.rounds = 20; c.inflight = 2; cases.push_back(c);
  c = {"bounded packed W4 f16 -> f32 y", 4, 16, 4, 96, 512, kMoeF16, 0, kMoeF32}; c.slot_frac = 0.25f; c.packed = true; c.rounds = 2; cases.push_back(c);
  c = {"bounded W16 max world", 16, 32, 4, 32, 64, kMoeBF16, 2, kMoeBF16}; c.slot_frac = 0.3f; cases.push_back(c);
  c = {"bounded W2 H 7168 T=64 (flag groups)", 2, 16, 8, 64, 7168, kMoeBF16, 1, kMoeBF16}; c.slot_frac = 0.3f; c.packed = true; c.rounds = 2; cases.push_back(c);
  // small enough for compute-sanitizer
  c = {"bounded tiny W2 T=8 one token per round", 2, 4, 2, 8, 32, kMoeBF16, 1, kMoeF32}; c.slot_frac = 0.01f; cases.push_back(c);
  c = {"bounded tiny W4 T=7 zero rank graph x3", 4, 8, 2, 7, 32, kMoeBF16, 0, kMoeBF16}; c.slot_frac = 0.4f; c.zero_rank = 1; c.graph = 1; c.rounds = 3; cases.push_back(c);
  c = {"bounded tiny packed W2 T=6", 2, 4, 4, 6, 32, kMoeBF16, 0, kMoeBF16}; c.slot_frac = 0.3f; c.packed = true; c.rounds = 2; cases.push_back(c);

  CK(cuda::moe_load_kernels());  // before any rank spins (lazy loading would stall the host)
  int dev;
  cudaDeviceProp prop;
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("device: %s, %d SMs\n%-36s %s\n", prop.name, prop.multiProcessorCount, "case", "result");
  int fails = 0;
  for (const Case& cs : cases) {
    if (only) {
      bool match = false;
      for (const char *p = only, *q; !match; p = q + 1) {
        q = std::strchr(p, '|');
        const std::string part = q ? std::string(p, q) : std::string(p);
        match = !part.empty() && std::strstr(cs.name, part.c_str()) != nullptr;
        if (!q) break;
      }
      if (!match) continue;
    }
    auto t0 = std::chrono::steady_clock::now();
    std::string e = run_case(cs);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%-36s %s (%.0f ms)%s%s\n", cs.name, e.empty() ? "PASS" : "FAIL", ms, e.empty() ? "" : ": ", e.c_str());
    std::fflush(stdout);
    fails += !e.empty();
  }
  if (perf) run_perf();
  std::printf("%s: %d failure(s)\n", fails ? "FAIL" : "PASS", fails);
  return fails ? 1 : 0;
}
