// Standalone test of the CUDA ragged_all_to_all (kernels/ragged.cuh, cuda/ragged.cu): W virtual
// ranks in one process on one GPU (one cudaMalloc'd communicator buffer, stream and host-mapped
// ErrorInfo per rank; every rank's CommView lists all buffers; context_ranks = W caps each
// rank's grid so all ranks' blocks are resident together), checked bitwise against a CPU
// reference of lax.ragged_all_to_all's semantics (ragged_layout.h): the receiver's output
// allocation (guard bytes around it included) is its initial bytes with every sender's slice
// memcpy'd in; the operand allocation is unchanged. The reference knows nothing of the kernel's
// frames, block shares or vector widths.
//
// Build (from the repository root):
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I csrc -o build/ragged_h
//        tests/cuda_harness/ragged_harness.cu csrc/cuda/ragged.cu
// Run:
//   build/ragged_h                every case, each in its own child process: one PASS/FAIL
//                                 line per case, then "PASS: 0 failure(s)" or "FAIL: n ...";
//                                 exit 1 on any failure
//   build/ragged_h --only 'A|B'   the cases whose name contains A or B
//   build/ragged_h --no-fork      all in this process (compute-sanitizer runs), the error cases
//                                 too: no kernel traps (kernels/common.cuh "Failure"), so the
//                                 cases after them also show that the CUDA context is healthy
//   build/ragged_h --error        the error cases only (bad slice, recv_sizes, timeout)
//   build/ragged_h --ab           chunked path vs one round at sizes both serve (world 1 and
//                                 2 / 4 virtual ranks, slot sweep): us per call in CUDA graphs
//   build/ragged_h --graph-time   us per call in CUDA graphs, decode and prefill shapes, W
//                                 virtual ranks on ONE GPU (the "peers" are local memory and
//                                 share the SMs: compares kernel variants, not NVLink)
//   --seed N                      random inputs from seed N (default 1; printed)
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "common/layout.h"
#include "common/ragged_layout.h"
#include "cuda/ragged.h"

using namespace nvc;

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, \
                  #x);                                                                         \
      std::fflush(stdout);                                                                     \
      std::exit(2);                                                                            \
    }                                                                                          \
  } while (0)

namespace {

uint64_t g_seed = 1;
constexpr size_t kGuard = 64;  // guard bytes before and after every operand / output
constexpr uint64_t kTimeoutNs = 10'000'000'000ull;

// ---------------------------------------------------------------------------------------------
// Virtual ranks

struct World {
  int W;
  size_t msg;  // max_message_bytes
  uint64_t timeout_ns;
  std::vector<char*> bufs;
  std::vector<ErrorInfo*> err_h, err_d;
  std::vector<cudaStream_t> st;
  World(int w, size_t m, uint64_t tmo = kTimeoutNs) : W(w), msg(m), timeout_ns(tmo) {
    const size_t bytes = comm_buffer_bytes(msg, W);
    for (int r = 0; r < W; ++r) {
      char* b = nullptr;
      CK(cudaMalloc(&b, bytes));
      CK(cudaMemset(b, 0, kCtrlBytes));
      CK(cudaMemset(b + kCtrlBytes, 0xAB, bytes - kCtrlBytes));  // needs no init: be loud
      bufs.push_back(b);
      ErrorInfo* h = nullptr;
      CK(cudaHostAlloc(&h, sizeof(ErrorInfo), cudaHostAllocMapped));
      std::memset(h, 0, sizeof(ErrorInfo));
      ErrorInfo* d = nullptr;
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
    v.timeout_ns = timeout_ns;
    for (int i = 0; i < W; ++i) v.bufs[i] = bufs[i];
    v.err = err_d[r];
    v.max_message_bytes = msg;
    v.flag_half = flag_half_bytes(msg, W);
    v.lamport_off = lamport_offset(msg, W);
    v.lamport_slot = lamport_slot_bytes(msg, W);
    v.context_ranks = W;  // every virtual rank on this GPU, in this process
    return v;
  }
  uint64_t seq(int r) const {
    uint64_t s = 0;
    CK(cudaMemcpy(&s, bufs[r], sizeof s, cudaMemcpyDeviceToHost));
    return s;
  }
  cudaError_t wait() const {
    cudaError_t first = cudaSuccess;
    for (int r = 0; r < W; ++r) {
      const cudaError_t e = cudaStreamSynchronize(st[r]);
      if (first == cudaSuccess) first = e;
    }
    return first;
  }
  std::string errors() const {
    std::string s;
    char b[200];
    for (int r = 0; r < W; ++r) {
      const ErrorInfo& e = *err_h[r];
      if (e.code == 0) continue;
      std::snprintf(b, sizeof b, " [rank %d: code %u peer %d seq %llu op 0x%x observed 0x%llx]", r,
                    e.code, e.peer, (unsigned long long)e.seq, e.op,
                    (unsigned long long)e.observed);
      s += b;
    }
    return s;
  }
};

// ---------------------------------------------------------------------------------------------
// Calls: shapes, routing patterns, inputs and the reference

struct Shape {
  int64_t N, M;     // operand rows, output rows
  size_t rb;        // row bytes (trailing elements x itemsize)
  int64_t k;        // slices per peer
  bool i64;         // int64 offsets (else int32)
  int mis_in = 0;   // operand starts this many bytes past a 256-byte boundary
  int mis_out = 0;  // output likewise
  int64_t chunk = 0;  // 0: one round; > 0: the chunked path's slot; kChunkMax: the largest
};
constexpr int64_t kChunkMax = -1;  // resolved per World: ragged_chunk_max(msg, W, k)

enum Pattern {
  kRandom,    // random sizes (often 0, sometimes large), random placement with gaps
  kToOne,     // every rank sends only to rank 0
  kZero,      // every size 0
  kSelfOnly,  // slices only to oneself
  kTiny,      // slices of 0 or 1 row
  kPacked,    // lax's usual layout: input and output offsets are exclusive prefix sums
  kFull,      // every receiver's output exactly covered
};

// One call of every rank: whole allocations (guards included) and the four arrays.
struct CallIn {
  std::vector<std::vector<uint8_t>> opnd, out0;
  std::vector<std::vector<int64_t>> in_off, send, out_off, recv;
};

size_t alloc_bytes(int64_t rows, size_t rb, int mis) {
  return 2 * kGuard + size_t(mis) + size_t(rows) * rb;
}

void fill_random(std::vector<uint8_t>& b, std::mt19937_64& g) {
  size_t i = 0;
  for (; i + 8 <= b.size(); i += 8) {
    const uint64_t x = g();
    std::memcpy(&b[i], &x, 8);
  }
  for (; i < b.size(); ++i) b[i] = uint8_t(g());
}

int64_t uniform(std::mt19937_64& g, int64_t lo, int64_t hi) {  // [lo, hi], lo <= hi
  return lo + int64_t(g() % uint64_t(hi - lo + 1));
}

// Sizes n[(r * W + d) * k + j] (rows rank r sends to d in its slice j), then offsets.
CallIn make_call(const Shape& s, int W, Pattern pat, std::mt19937_64& g) {
  const int64_t k = s.k, N = s.N, M = s.M;
  auto at = [&](int r, int d, int64_t j) { return (size_t(r) * W + d) * size_t(k) + size_t(j); };
  std::vector<int64_t> n(size_t(W) * W * k, 0);
  std::vector<int64_t> send_left(W, N);  // kPacked: a sender's slices tile its operand
  const int64_t typical = std::max<int64_t>(1, 2 * M / (int64_t(W) * k));
  for (int d = 0; d < W; ++d) {
    int64_t room = M;
    std::vector<std::pair<int, int64_t>> pieces;  // (r, j) in random order
    for (int r = 0; r < W; ++r)
      for (int64_t j = 0; j < k; ++j) pieces.push_back({r, j});
    std::shuffle(pieces.begin(), pieces.end(), g);
    if (pat == kFull) {  // hand out M rows one random chunk at a time
      while (room > 0) {
        bool any = false;
        for (auto [r, j] : pieces) {
          const int64_t cap = std::min(room, N - n[at(r, d, j)]);
          if (cap <= 0) continue;
          const int64_t x = uniform(g, 1, std::min(cap, typical));
          n[at(r, d, j)] += x;
          room -= x;
          any = true;
          if (room == 0) break;
        }
        if (!any) break;  // N * W * k < M: as full as it gets
      }
      continue;
    }
    for (auto [r, j] : pieces) {
      int64_t x = 0;
      switch (pat) {
        case kZero: break;
        case kToOne: x = d == 0 ? uniform(g, 0, typical * W) : 0; break;
        case kSelfOnly: x = r == d ? uniform(g, 0, typical * W) : 0; break;
        case kTiny: x = int64_t(g() % 2); break;
        default:  // kRandom, kPacked: a third empty, some large
          x = g() % 3 == 0 ? 0 : g() % 8 == 0 ? uniform(g, 0, room) : uniform(g, 0, typical);
      }
      x = std::min({x, room, N});
      if (pat == kPacked) x = std::min(x, send_left[r]);
      n[at(r, d, j)] = x;
      room -= x;
      if (pat == kPacked) send_left[r] -= x;
    }
  }
  CallIn c;
  const int64_t K = k * W;
  c.in_off.assign(W, std::vector<int64_t>(K));
  c.send.assign(W, std::vector<int64_t>(K));
  c.out_off.assign(W, std::vector<int64_t>(K));
  c.recv.assign(W, std::vector<int64_t>(K));
  for (int r = 0; r < W; ++r)
    for (int d = 0; d < W; ++d)
      for (int64_t j = 0; j < k; ++j) {
        c.send[r][d * k + j] = n[at(r, d, j)];
        c.recv[d][r * k + j] = n[at(r, d, j)];
      }
  // input offsets: packed = exclusive prefix sums in slice order, else anywhere in the operand
  // (slices may overlap there: reading rows twice is allowed)
  for (int r = 0; r < W; ++r) {
    int64_t cursor = 0;
    for (int64_t i = 0; i < K; ++i) {
      const int64_t x = c.send[r][i];
      c.in_off[r][i] = pat == kPacked ? cursor : uniform(g, 0, N - x);
      cursor += x;
    }
  }
  // output offsets at each receiver: packed = prefix sums in (sender, slice) order; else the
  // slices in random order with random gaps, never overlapping (lax leaves overlaps unspecified)
  for (int d = 0; d < W; ++d) {
    std::vector<std::pair<int, int64_t>> order;
    int64_t used = 0;
    for (int r = 0; r < W; ++r)
      for (int64_t j = 0; j < k; ++j) {
        order.push_back({r, j});
        used += n[at(r, d, j)];
      }
    if (pat != kPacked) std::shuffle(order.begin(), order.end(), g);
    int64_t free_rows = M - used, cursor = 0, left = int64_t(order.size());
    for (auto [r, j] : order) {
      const int64_t gap = pat == kPacked || free_rows == 0
                              ? 0
                              : std::min(free_rows, uniform(g, 0, 2 * free_rows / left));
      free_rows -= gap;
      --left;
      c.out_off[r][d * k + j] = cursor + gap;
      cursor += gap + n[at(r, d, j)];
    }
  }
  c.opnd.resize(W);
  c.out0.resize(W);
  for (int r = 0; r < W; ++r) {
    c.opnd[r].resize(alloc_bytes(N, s.rb, s.mis_in));
    c.out0[r].resize(alloc_bytes(M, s.rb, s.mis_out));
    fill_random(c.opnd[r], g);
    fill_random(c.out0[r], g);
  }
  return c;
}

// What rank d's output allocation must hold after the call: lax.ragged_all_to_all's definition.
std::vector<uint8_t> reference(const Shape& s, const CallIn& c, int W, int d) {
  std::vector<uint8_t> out = c.out0[d];
  for (int r = 0; r < W; ++r)
    for (int64_t j = 0; j < s.k; ++j) {
      const int64_t i = d * s.k + j;
      std::memcpy(out.data() + kGuard + s.mis_out + size_t(c.out_off[r][i]) * s.rb,
                  c.opnd[r].data() + kGuard + s.mis_in + size_t(c.in_off[r][i]) * s.rb,
                  size_t(c.send[r][i]) * s.rb);
    }
  return out;
}

// Device buffers of one (rank, call).
struct Slot {
  Shape s;
  char *opnd = nullptr, *out = nullptr;
  void* arr[4] = {};  // input_offsets, send_sizes, output_offsets, recv_sizes
  Slot(const Shape& sh, int W) : s(sh) {
    CK(cudaMalloc(&opnd, alloc_bytes(s.N, s.rb, s.mis_in)));
    CK(cudaMalloc(&out, alloc_bytes(s.M, s.rb, s.mis_out)));
    for (void*& a : arr) CK(cudaMalloc(&a, size_t(s.k) * W * 8));
  }
  Slot(const Slot&) = delete;
  ~Slot() {
    cudaFree(opnd);
    cudaFree(out);
    for (void* a : arr) cudaFree(a);
  }
  cuda::RaggedArgs args() const {
    cuda::RaggedArgs a{};
    a.operand = opnd + kGuard + s.mis_in;
    a.out = out + kGuard + s.mis_out;
    a.input_offsets = arr[0];
    a.send_sizes = arr[1];
    a.output_offsets = arr[2];
    a.recv_sizes = arr[3];
    a.offsets_64 = s.i64;
    a.n_rows = s.N;
    a.m_rows = s.M;
    a.row_bytes = s.rb;
    a.k = s.k;
    a.chunk = s.chunk;
    return a;
  }
  void upload_arrays(const std::vector<int64_t>* v) const {
    for (int q = 0; q < 4; ++q) {
      if (s.i64) {
        CK(cudaMemcpy(arr[q], v[q].data(), v[q].size() * 8, cudaMemcpyHostToDevice));
      } else {
        std::vector<int32_t> n32(v[q].begin(), v[q].end());
        CK(cudaMemcpy(arr[q], n32.data(), n32.size() * 4, cudaMemcpyHostToDevice));
      }
    }
  }
  void upload(const CallIn& c, int r) const {
    CK(cudaMemcpy(opnd, c.opnd[r].data(), c.opnd[r].size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(out, c.out0[r].data(), c.out0[r].size(), cudaMemcpyHostToDevice));
    const std::vector<int64_t> v[4] = {c.in_off[r], c.send[r], c.out_off[r], c.recv[r]};
    upload_arrays(v);
  }
};

// The communicator size a case needs: every one-round shape's output (and header) fits, every
// chunked shape's slot (kChunkMax: any 256 bytes).
size_t msg_bytes_for(const std::vector<Shape>& shapes, int W) {
  size_t m = 4096;
  for (const Shape& s : shapes) {
    if (s.chunk == 0) {
      m = std::max(m, align_up(size_t(s.M) * s.rb + ragged_header_bytes(W, s.k), 256));
      continue;
    }
    const size_t want = s.chunk == kChunkMax ? 256 : size_t(s.chunk);
    while (ragged_chunk_max(m, W, s.k) < want) m *= 2;
  }
  return m;
}

// The shape with kChunkMax resolved for a communicator of msg bytes over W ranks.
Shape resolved(Shape s, size_t msg, int W) {
  if (s.chunk == kChunkMax) s.chunk = int64_t(ragged_chunk_max(msg, W, s.k));
  return s;
}

// First difference of a downloaded allocation from the expected one, described.
std::string diff(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want, size_t rb,
                 int mis, const char* what) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] == want[i]) continue;
    char b[200];
    const size_t base = kGuard + size_t(mis);
    if (i < base || i >= want.size() - kGuard)
      std::snprintf(b, sizeof b, "%s: guard byte %zu changed (0x%02x, want 0x%02x)", what, i,
                    got[i], want[i]);
    else
      std::snprintf(b, sizeof b, "%s row %zu byte %zu: 0x%02x, want 0x%02x", what,
                    (i - base) / rb, (i - base) % rb, got[i], want[i]);
    return b;
  }
  return "";
}

// ---------------------------------------------------------------------------------------------
// Cases

struct Case {
  std::string name;
  int W;
  std::vector<Shape> shapes;  // call c of a round uses shapes[c % size]
  Pattern pat = kRandom;
  int rounds = 3;
  int calls = 2;              // calls per rank per round, enqueued back to back
  bool graph = false;         // capture each rank's round into a CUDA graph and replay it
  size_t msg = 0;             // max_message_bytes (0: msg_bytes_for)
};

std::string run_case(const Case& cs) {
  const int W = cs.W;
  std::mt19937_64 g(g_seed * 1000003u + std::hash<std::string>()(cs.name));
  World w(W, cs.msg ? cs.msg : msg_bytes_for(cs.shapes, W));
  std::vector<Shape> shapes;
  for (const Shape& s : cs.shapes) shapes.push_back(resolved(s, w.msg, W));
  for (const Shape& s : shapes)
    if (const char* why = cuda::ragged_check(w.view(0), Slot(s, W).args()))
      return std::string("ragged_check refused a shape: ") + why;
  std::vector<std::vector<Slot*>> slots(W);  // [rank][call]
  for (int r = 0; r < W; ++r)
    for (int c = 0; c < cs.calls; ++c)
      slots[r].push_back(new Slot(shapes[c % shapes.size()], W));
  auto enqueue_call = [&](int c, int r) {
    CK(cuda::ragged_all_to_all(w.view(r), slots[r][c]->args(), w.st[r]));
  };
  std::vector<cudaGraphExec_t> execs;
  if (cs.graph)
    for (int r = 0; r < W; ++r) {  // rank by rank: nothing runs during capture
      cudaGraph_t gr;
      CK(cudaStreamBeginCapture(w.st[r], cudaStreamCaptureModeThreadLocal));
      for (int c = 0; c < cs.calls; ++c) enqueue_call(c, r);
      CK(cudaStreamEndCapture(w.st[r], &gr));
      cudaGraphExec_t ge;
      CK(cudaGraphInstantiate(&ge, gr, 0));
      CK(cudaGraphDestroy(gr));
      execs.push_back(ge);
    }
  std::string result;
  uint64_t calls = 0;
  for (int round = 0; round < cs.rounds && result.empty(); ++round) {
    std::vector<CallIn> in;
    for (int c = 0; c < cs.calls; ++c) {
      in.push_back(make_call(slots[0][c]->s, W, cs.pat, g));
      for (int r = 0; r < W; ++r) slots[r][c]->upload(in[c], r);
    }
    CK(cudaDeviceSynchronize());
    // graph cases: every third round runs directly, interleaving replays and direct calls
    if (cs.graph && round % 3 != 2) {
      for (int r = 0; r < W; ++r) CK(cudaGraphLaunch(execs[r], w.st[r]));
    } else {
      for (int c = 0; c < cs.calls; ++c)  // step by step across ranks
        for (int r = 0; r < W; ++r) enqueue_call(c, r);
    }
    if (cudaError_t e = w.wait(); e != cudaSuccess) {
      std::printf("  %s: round %d: %s%s\n", cs.name.c_str(), round, cudaGetErrorString(e),
                  w.errors().c_str());
      std::fflush(stdout);
      std::exit(3);  // the context is gone
    }
    calls += uint64_t(cs.calls);
    for (int c = 0; c < cs.calls && result.empty(); ++c) {
      const Shape& s = slots[0][c]->s;
      for (int r = 0; r < W && result.empty(); ++r) {
        std::vector<uint8_t> got(in[c].out0[r].size()), op(in[c].opnd[r].size());
        CK(cudaMemcpy(got.data(), slots[r][c]->out, got.size(), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(op.data(), slots[r][c]->opnd, op.size(), cudaMemcpyDeviceToHost));
        std::string e = diff(got, reference(s, in[c], W, r), s.rb, s.mis_out, "output");
        if (e.empty()) e = diff(op, in[c].opnd[r], s.rb, s.mis_in, "operand");
        if (!e.empty())
          result = "round " + std::to_string(round) + " call " + std::to_string(c) + " rank " +
                   std::to_string(r) + ": " + e;
      }
    }
    for (int r = 0; r < W && result.empty(); ++r)
      if (w.seq(r) != calls)
        result = "Ctrl::seq of rank " + std::to_string(r) + " = " + std::to_string(w.seq(r)) +
                 ", want " + std::to_string(calls);
  }
  for (auto ge : execs) cudaGraphExecDestroy(ge);
  for (auto& v : slots)
    for (Slot* s : v) delete s;
  if (result.empty() && !w.errors().empty()) result = "ErrorInfo set:" + w.errors();
  return result;
}

std::vector<Case> cases() {
  // row sizes: bf16 x 7168 = 14336 (decode/prefill hidden), bf16 x 3 = 6, f32 x 3 = 12,
  // int8 x 1 = 1, int8 x 5 = 5, bf16 x 7 = 14, f64 x 2 = 16, f32 x 10 = 40, bf16 x 520 = 1040
  std::vector<Case> v;
  auto add = [&](std::string name, int W, std::vector<Shape> sh, Pattern p, int rounds = 3,
                 int calls = 2, bool graph = false, size_t msg = 0) {
    v.push_back({std::move(name), W, std::move(sh), p, rounds, calls, graph, msg});
  };
  add("W1 self only, k=3, bf16 x 8", 1, {{40, 64, 16, 3, false}}, kRandom);
  add("W2 k=1, f64 x 2 (16 B rows)", 2, {{64, 96, 16, 1, false}}, kRandom);
  add("W2 k=4, bf16 x 3 (6 B rows), int64", 2, {{50, 80, 6, 4, true}}, kRandom);
  add("W4 k=2, bf16 x 7 (14 B rows)", 4, {{64, 128, 14, 2, false}}, kRandom);
  add("W4 k=8, 0/1-row slices, 14336 B rows", 4, {{64, 64, 14336, 8, true}}, kTiny);
  add("W8 k=3, f32 x 3 (12 B rows), int64", 8, {{48, 160, 12, 3, true}}, kRandom);
  add("W8 all-to-one, k=2, f32 x 10", 8, {{32, 400, 40, 2, false}}, kToOne);
  add("W4 all sizes 0", 4, {{16, 16, 32, 2, true}}, kZero, 2);
  add("W4 self-sends only, k=2", 4, {{40, 60, 24, 2, false}}, kSelfOnly);
  add("W8 packed (lax layout), k=4, 256 B rows", 8, {{256, 256, 256, 4, false}}, kPacked);
  add("W4 full output, k=2, int8 rows (1 B)", 4, {{40, 100, 1, 2, true}}, kFull);
  add("W4 full output, int8 x 5 (5 B rows)", 4, {{30, 57, 5, 1, false}}, kFull);
  add("W2 misaligned buffers +3/+5, 24 B rows", 2, {{60, 90, 24, 2, false, 3, 5}}, kRandom);
  add("W4 misaligned buffers +8/+4, 16 B rows", 4, {{60, 90, 16, 3, true, 8, 4}}, kRandom);
  add("W4 misaligned +2/+6, bf16 x 9, 0/1 rows", 4, {{30, 40, 18, 2, false, 2, 6}}, kTiny);
  add("W2 k=70 (two staging chunks), 8 B rows", 2, {{300, 400, 8, 70, false}}, kRandom);
  add("W4 k=130, 2 B rows, int64", 4, {{600, 900, 2, 130, true}}, kRandom);
  add("W2 4096 x 1040 B rows, k=2 (many blocks)", 2, {{4096, 4096, 1040, 2, false}}, kPacked);
  add("W4 8000 x 37 B rows, +3/+1, k=3 (many blocks)", 4, {{8000, 8000, 37, 3, true, 3, 1}},
      kRandom);
  add("W2 200000 x 1 B rows, +7/+0, k=2 (many blocks)", 2, {{200000, 200000, 1, 2, false, 7, 0}},
      kPacked);
  add("W8 256 x 14336 B rows, k=1 (prefill-like)", 8, {{256, 256, 14336, 1, true}}, kPacked);
  add("W4 N=0 / M=0 / both, alternating", 4,
      {{0, 50, 32, 2, false}, {50, 0, 32, 2, true}, {0, 0, 8, 1, false}, {20, 30, 8, 1, true}},
      kRandom, 2, 4);
  add("W4 150 calls, 3 shapes, int32/int64", 4,
      {{64, 100, 48, 2, false}, {33, 47, 14336, 1, true}, {200, 120, 6, 5, false, 2, 4}},
      kRandom, 50, 3);
  add("W8 graph replay x30, 3 calls per graph", 8,
      {{40, 80, 64, 2, false}, {24, 40, 14336, 1, true}, {90, 60, 10, 3, true}}, kRandom, 30, 3,
      true);
  add("W2 graph replay x30, misaligned, k=5", 2, {{80, 120, 22, 5, true, 1, 7}}, kRandom, 30, 2,
      true);
  add("W3 odd world, k=2", 3, {{50, 70, 30, 2, false}}, kRandom, 5);
  add("W16 max world, k=1", 16, {{40, 64, 128, 1, true}}, kRandom);
  add("W16 max world, 0/1 rows, k=2", 16, {{32, 64, 14336, 2, false}}, kTiny);
  // chunked path (ragged_chunked_kernel): outputs many times max_message_bytes (msg), through
  // slots of 256 B .. the largest; {N, M, rb, k, i64, mis_in, mis_out, chunk}
  add("chunked W1 self only, out 65 x msg", 1, {{4096, 4096, 1040, 2, false, 0, 0, kChunkMax}},
      kRandom, 3, 2, false, 65536);
  add("chunked W2 k=1, 14 B rows, 256 B slots", 2, {{300, 400, 14, 1, false, 0, 0, 256}},
      kRandom, 3, 2, false, 4096);
  add("chunked W2 k=3 packed, out 65 x msg", 2, {{4096, 4096, 1040, 3, false, 0, 0, kChunkMax}},
      kPacked, 3, 2, false, 65536);
  add("chunked W4 k=2 +3/+5, 24 B rows, 4 KiB slots", 4,
      {{8000, 8000, 24, 2, false, 3, 5, 4096}}, kRandom, 3, 2, false, 65536);
  add("chunked W4 full output, int8 x 5, 256 B slots", 4, {{3000, 5700, 5, 1, false, 0, 0, 256}},
      kFull, 3, 2, false, 8192);
  add("chunked W8 k=1 14336 B rows, out 70 x msg", 8,
      {{640, 640, 14336, 1, true, 0, 0, kChunkMax}}, kRandom, 2, 2, false, 131072);
  add("chunked W8 k=3, 12 B rows, int64, 512 B slots", 8, {{480, 1600, 12, 3, true, 0, 0, 512}},
      kRandom, 3, 2, false, 8192);
  add("chunked W2 k=200 0/1 rows, > 64 segments a piece", 2,
      {{300, 400, 2, 200, false, 0, 0, 4096}}, kTiny, 3, 2, false, 16384);
  add("chunked W4 all sizes 0", 4, {{16, 16, 32, 2, true, 0, 0, 256}}, kZero, 2, 2, false, 4096);
  add("chunked W16 max world, k=1", 16, {{400, 640, 128, 1, true, 0, 0, kChunkMax}}, kRandom, 3,
      2, false, 16384);
  add("chunked W4 90 calls, one-round and chunked mixed", 4,
      {{64, 100, 48, 2, false}, {400, 600, 48, 2, true, 0, 0, 1024},
       {33, 47, 14336, 1, true, 0, 0, kChunkMax}},
      kRandom, 30, 3, false, 65536);
  add("chunked W8 graph replay x30, mixed", 8,
      {{400, 600, 64, 2, false, 0, 0, 1024}, {40, 80, 64, 2, false},
       {300, 200, 14336, 1, true, 0, 0, kChunkMax}},
      kRandom, 30, 3, true, 65536);
  add("chunked W2 graph replay x30, +1/+7, k=5, 768 B", 2,
      {{800, 1200, 22, 5, true, 1, 7, 768}}, kRandom, 30, 2, true, 8192);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Error cases: the failing kernel records and ends normally (no trap): the context stays usable,
// so they run in-process with --no-fork as well.

const char* kFieldName[5] = {"input_offsets < 0", "send_sizes < 0", "input_offsets + size > N",
                             "output_offsets < 0", "output_offsets + size > M"};

// A good call (seq 1, checked) then a call (seq 2) where `spoil` changed one rank's arrays.
// Returns the launch status of the second call; `w` holds every rank's ErrorInfo.
struct ErrRun {
  cudaError_t status;
  std::string first;  // the good call's check
};
ErrRun two_calls(World& w, const Shape& s, const std::function<void(CallIn&)>& spoil,
                 int skip_rank = -1) {
  const int W = w.W;
  std::mt19937_64 g(g_seed * 7919u + 17u);
  std::vector<Slot*> slot;
  for (int r = 0; r < W; ++r) slot.push_back(new Slot(s, W));
  ErrRun res{cudaSuccess, ""};
  for (int call = 0; call < 2; ++call) {
    CallIn c = make_call(s, W, kRandom, g);
    if (call == 1) spoil(c);
    for (int r = 0; r < W; ++r) slot[r]->upload(c, r);
    CK(cudaDeviceSynchronize());
    for (int r = 0; r < W; ++r)
      if (call == 0 || r != skip_rank)
        CK(cuda::ragged_all_to_all(w.view(r), slot[r]->args(), w.st[r]));
    if (call == 1) {
      res.status = w.wait();
      break;
    }
    CK(w.wait());
    for (int r = 0; r < W && res.first.empty(); ++r) {
      std::vector<uint8_t> got(c.out0[r].size());
      CK(cudaMemcpy(got.data(), slot[r]->out, got.size(), cudaMemcpyDeviceToHost));
      res.first = diff(got, reference(s, c, W, r), s.rb, s.mis_out, "first call output");
    }
  }
  for (Slot* sl : slot) delete sl;
  return res;
}

bool same_record(const ErrorInfo& e, uint32_t code, int rank, int peer, uint64_t seq,
                 uint32_t op, uint64_t observed) {
  return e.code == code && e.rank == rank && e.peer == peer && e.seq == seq && e.op == op &&
         e.observed == observed;
}

// Every rank but `bad` recorded bad's poison (kErrMismatch naming it, call 2, the poison
// descriptor) and the launch ended with cudaSuccess; *peers lists what each one recorded.
bool peers_poisoned(const World& w, const ErrRun& run, int bad, uint32_t desc,
                    std::string* peers) {
  bool ok = true;
  for (int r = 0; r < w.W; ++r) {
    if (r == bad) continue;
    const ErrorInfo& e = *w.err_h[r];
    const bool poisoned = same_record(e, kErrMismatch, r, bad, 2, desc, e.observed) &&
                          flag_seq(e.observed) == 2 && flag_desc(e.observed) == kRaggedPoisonDesc;
    ok = ok && poisoned && run.status == cudaSuccess;
    *peers += " " + std::to_string(r) + (poisoned ? ":poisoned" : e.code == 0 ? ":none" : ":OTHER");
  }
  return ok;
}

// A rank with a bad slice: kErrRaggedSlice on it; the peers see its poison (kErrMismatch naming
// it, poison descriptor), and every launch ends with cudaSuccess (no trap).
int error_bad_slice(int field, int64_t chunk = 0) {
  const Shape s = chunk ? Shape{640, 960, 48, 2, field % 2 == 1, 0, 0, chunk}
                        : Shape{64, 96, 48, 2, field % 2 == 1};
  const int W = 4, bad = 2;
  const int64_t i = 3;  // slice 3 of rank 2: to peer 1, j = 1
  World w(W, msg_bytes_for({s}, W));
  ErrRun run = two_calls(w, s, [&](CallIn& c) {
    int64_t& in = c.in_off[bad][i];
    int64_t& n = c.send[bad][i];
    int64_t& out = c.out_off[bad][i];
    switch (field) {
      case 0: in = -1; break;
      case 1: n = -3; break;
      case 2: in = s.N - n + 1; break;
      case 3: out = -1; break;
      default: out = s.M - n + 1;
    }
  });
  const uint32_t desc = ragged_desc(s.N, s.M, s.rb, s.k, s.chunk);
  bool ok = run.first.empty() && same_record(*w.err_h[bad], kErrRaggedSlice, bad, bad, 2, desc,
                                             ragged_slice_detail(i, uint32_t(field)));
  std::string peers;
  ok = peers_poisoned(w, run, bad, desc, &peers) && ok;
  std::printf("  bad slice (%s) on rank %d: launch -> %s;%s; peers' records:%s\n",
              kFieldName[field], bad, cudaGetErrorString(run.status), w.errors().c_str(),
              peers.c_str());
  if (!run.first.empty()) std::printf("  %s\n", run.first.c_str());
  return ok ? 0 : 1;
}

// Three bad slices on rank 2, k = 300 (K = 1200 > the block's 512 threads): thread 88 finds
// slice 600 (send_sizes < 0) in its second stride, threads 6 and 76 find 1030 and 1100 in their
// third; the record names the first, 600, and the peers see the poison.
int error_bad_slices_first() {
  const Shape s{64, 96, 48, 300, false};
  const int W = 4, bad = 2;
  World w(W, msg_bytes_for({s}, W));
  ErrRun run = two_calls(w, s, [&](CallIn& c) {
    c.out_off[bad][1100] = -1;
    c.in_off[bad][1030] = -1;
    c.send[bad][600] = -3;
  });
  const uint32_t desc = ragged_desc(s.N, s.M, s.rb, s.k);
  bool ok = run.first.empty() && same_record(*w.err_h[bad], kErrRaggedSlice, bad, bad, 2, desc,
                                             ragged_slice_detail(600, 1));
  std::string peers;
  ok = peers_poisoned(w, run, bad, desc, &peers) && ok;
  std::printf("  bad slices 600, 1030, 1100 on rank %d: launch -> %s;%s; peers' records:%s\n",
              bad, cudaGetErrorString(run.status), w.errors().c_str(), peers.c_str());
  if (!run.first.empty()) std::printf("  %s\n", run.first.c_str());
  return ok ? 0 : 1;
}

// recv_sizes of rank 1 expect one more row from rank src's slice j (src = 3, or 1: its own
// slice to itself) and, where j + 5 < k, from its slice j + 5 (same chunk of 64 when j % 64 <
// 59): kErrRaggedRecv on rank 1 naming src and (the first slice j, sent, expected), j read back
// from the record's bits 48..63; nobody else records anything.
// Chunked (chunk > 0): rank 1 also poisons its peers' round counters, so they record nothing
// (done before) or kErrMismatch (naming rank 1 or a rank that failed after it), at once.
int error_recv(int src, int64_t k = 2, int64_t j = 1, int64_t chunk = 0) {
  const Shape s = chunk ? Shape{640, 960, 48, k, src == 1, 0, 0, chunk}
                        : Shape{64, 96, 48, k, src == 1};
  const int W = 4, me = 1;
  int64_t sent = 0;
  World w(W, msg_bytes_for({s}, W));
  ErrRun run = two_calls(w, s, [&](CallIn& c) {
    sent = c.recv[me][src * s.k + j];
    c.recv[me][src * s.k + j] = sent + 1;
    if (j + 5 < k) c.recv[me][src * s.k + j + 5] += 2;
  });
  const uint64_t observed = w.err_h[me]->observed;
  bool ok = run.first.empty() && run.status == cudaSuccess &&
            same_record(*w.err_h[me], kErrRaggedRecv, me, src, 2,
                        ragged_desc(s.N, s.M, s.rb, s.k, s.chunk),
                        ragged_recv_detail(j, sent, sent + 1)) &&
            (observed >> 48) == uint64_t(j);
  for (int r = 0; r < W; ++r)
    ok = ok && (r == me || w.err_h[r]->code == 0 ||
                (chunk > 0 && w.err_h[r]->code == kErrMismatch &&
                 flag_desc(w.err_h[r]->observed) == kRaggedPoisonDesc));
  std::printf("  recv_sizes of rank %d: %lld rows from rank %d's slice %lld, sent %lld: launch -> "
              "%s;%s\n",
              me, (long long)sent + 1, src, (long long)j, (long long)sent,
              cudaGetErrorString(run.status), w.errors().c_str());
  if (!run.first.empty()) std::printf("  %s\n", run.first.c_str());
  return ok ? 0 : 1;
}

// Rank 1 never calls a second time: rank 0 reports kErrTimeout naming rank 1 after 300 ms.
int error_timeout(int64_t chunk = 0) {
  const Shape s = chunk ? Shape{320, 480, 64, 1, true, 0, 0, chunk} : Shape{32, 48, 64, 1, true};
  World w(2, msg_bytes_for({s}, 2), 300'000'000ull);
  const auto t0 = std::chrono::steady_clock::now();
  ErrRun run = two_calls(w, s, [](CallIn&) {}, 1);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const ErrorInfo& e = *w.err_h[0];
  const bool ok = run.first.empty() && run.status == cudaSuccess && e.code == kErrTimeout &&
                  e.rank == 0 && e.peer == 1 && e.seq == 2 && w.err_h[1]->code == 0;
  std::printf("  rank 1 absent: launch -> %s after %.0f ms;%s\n", cudaGetErrorString(run.status),
              ms, w.errors().c_str());
  return ok ? 0 : 1;
}

// ---------------------------------------------------------------------------------------------
// --graph-time

struct TimedShape {
  const char* kind;
  int W;
  int64_t tokens;  // per rank; rows = tokens x top-8, split evenly over the W destinations
  int64_t k;
  int calls;       // per graph
};

void run_graph_time() {
  const size_t rb = 7168 * 2;  // hidden 7168, bf16
  const TimedShape ts[] = {
      {"decode", 2, 1, 1, 100},   {"decode", 2, 2, 1, 100},  {"decode", 2, 4, 1, 100},
      {"decode", 2, 8, 1, 100},   {"decode", 4, 1, 1, 100},  {"decode", 4, 4, 1, 100},
      {"decode", 4, 8, 1, 100},   {"decode", 8, 1, 1, 100},  {"decode", 8, 4, 1, 100},
      {"decode", 8, 8, 1, 100},   {"decode", 8, 8, 4, 100},  {"prefill", 2, 512, 1, 20},
      {"prefill", 2, 1024, 1, 10}, {"prefill", 2, 4096, 1, 5}, {"prefill", 8, 512, 1, 10},
      {"prefill", 8, 4096, 1, 3},
  };
  int dev = 0;
  cudaDeviceProp prop;
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  std::printf("\ngraph-time: %s, W virtual ranks on ONE GPU (peers are local memory, ranks share "
              "the SMs and HBM): compares kernel variants, not NVLink.\nrows per rank = tokens x "
              "top-8, hidden 7168 bf16 (14336 B), split evenly over the W destinations (self "
              "included), k slices each; us per call = best of 3 graph launches / calls per "
              "graph\n",
              prop.name);
  std::printf("%-8s %3s %6s %3s %9s %10s %7s %10s %9s\n", "shape", "W", "tokens", "k",
              "rows/peer", "KiB/peer", "blocks", "us/call", "GB/s/rank");
  for (const TimedShape& t : ts) {
    const int W = t.W;
    const int64_t rows = t.tokens * 8, per_slice = rows / (W * t.k);
    const Shape s{rows, rows, rb, t.k, false};
    World w(W, msg_bytes_for({s}, W));
    std::vector<Slot*> slot;
    std::vector<int64_t> in_off(t.k * W), send(t.k * W, per_slice), out_off(t.k * W);
    for (int64_t i = 0; i < t.k * W; ++i) in_off[i] = i * per_slice;
    for (int r = 0; r < W; ++r) {
      slot.push_back(new Slot(s, W));
      // rank r's slice j to d lands at d's rows (r * k + j) * per_slice: packed, like lax
      for (int d = 0; d < W; ++d)
        for (int64_t j = 0; j < t.k; ++j) out_off[d * t.k + j] = (r * t.k + j) * per_slice;
      const std::vector<int64_t> v[4] = {in_off, send, out_off, send};
      slot[r]->upload_arrays(v);
      CK(cudaMemset(slot[r]->opnd, 0x3C, alloc_bytes(s.N, rb, 0)));
    }
    std::vector<cudaGraphExec_t> ge(W);
    for (int r = 0; r < W; ++r) {
      cudaGraph_t gr;
      CK(cudaStreamBeginCapture(w.st[r], cudaStreamCaptureModeThreadLocal));
      for (int c = 0; c < t.calls; ++c)
        CK(cuda::ragged_all_to_all(w.view(r), slot[r]->args(), w.st[r]));
      CK(cudaStreamEndCapture(w.st[r], &gr));
      CK(cudaGraphInstantiate(&ge[r], gr, 0));
      CK(cudaGraphDestroy(gr));
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
      if (cudaError_t e = w.wait(); e != cudaSuccess) {
        std::printf("%s W%d: %s%s\n", t.kind, W, cudaGetErrorString(e), w.errors().c_str());
        std::exit(3);
      }
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (rep > 0) best = std::min(best, ms);
    }
    const double us = double(best) * 1000.0 / t.calls;
    std::printf("%-8s %3d %6lld %3lld %9lld %10.1f %7d %10.2f %9.1f\n", t.kind, W,
                (long long)t.tokens, (long long)t.k, (long long)(per_slice * t.k),
                double(per_slice * t.k * rb) / 1024.0,
                cuda::ragged_blocks(w.view(0), slot[0]->args()), us,
                double(rows * rb) / (us * 1e3));
    std::fflush(stdout);
    for (auto g : ge) CK(cudaGraphExecDestroy(g));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaEventDestroy(ej));
    for (Slot* p : slot) delete p;
  }
  std::printf("sanity only: build/moe_h --graph-time on the same GPU (MoE dispatch, 2 virtual "
              "ranks, 4 tokens x top-8, hidden 7168: one copy per token and destination rank) "
              "against the decode W=2 tokens=4 row\n");
}

// ---------------------------------------------------------------------------------------------
// --ab: the chunked path against the single round at sizes both serve (the communicator holds
// the whole output), us per call in CUDA graphs; at world 1 (no peers: both copy a rank's own
// slices) and with 2 / 4 virtual ranks (local "peers": overheads, not NVLink), with a slot sweep.

// us per call of `calls` back-to-back calls of every rank's args, best of 3 graph launches.
double graph_us(World& w, const std::vector<cuda::RaggedArgs>& args, int calls) {
  const int W = w.W;
  std::vector<cudaGraphExec_t> ge(W);
  for (int r = 0; r < W; ++r) {
    cudaGraph_t gr;
    CK(cudaStreamBeginCapture(w.st[r], cudaStreamCaptureModeThreadLocal));
    for (int c = 0; c < calls; ++c) CK(cuda::ragged_all_to_all(w.view(r), args[r], w.st[r]));
    CK(cudaStreamEndCapture(w.st[r], &gr));
    CK(cudaGraphInstantiate(&ge[r], gr, 0));
    CK(cudaGraphDestroy(gr));
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
    if (cudaError_t e = w.wait(); e != cudaSuccess) {
      std::printf("ab W%d: %s%s\n", W, cudaGetErrorString(e), w.errors().c_str());
      std::exit(3);
    }
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (rep > 0) best = std::min(best, ms);
  }
  for (auto g : ge) CK(cudaGraphExecDestroy(g));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaEventDestroy(ej));
  if (!w.errors().empty()) {
    std::printf("ab W%d: ErrorInfo set:%s\n", W, w.errors().c_str());
    std::exit(3);
  }
  return double(best) * 1000.0 / calls;
}

int run_ab() {
  const size_t rb = 7168 * 2;  // hidden 7168, bf16
  std::printf("\nab: chunked vs one round, rows = tokens x top-8 per rank of 14336 B, packed "
              "evenly over the W destinations; us per call in CUDA graphs (best of 3); ratio = "
              "chunked / one round (done-means: <= 1.10 at world 1)\n");
  std::printf("%3s %6s %10s %12s %10s %7s\n", "W", "tokens", "out MiB", "slot", "us/call",
              "ratio");
  int bad = 0;
  for (int W : {1, 2, 4})
    for (int64_t tokens : {16, 64, 512}) {
      const int64_t rows = tokens * 8, per = rows / W;
      const Shape s{rows, rows, rb, 1, false};
      const size_t msg = msg_bytes_for({s}, W);
      World w(W, msg);
      std::vector<Slot*> slot;
      std::vector<int64_t> in_off(W), send(W, per), out_off(W);
      for (int i = 0; i < W; ++i) in_off[i] = i * per;
      for (int r = 0; r < W; ++r) {
        slot.push_back(new Slot(s, W));
        for (int d = 0; d < W; ++d) out_off[d] = r * per;
        const std::vector<int64_t> v[4] = {in_off, send, out_off, send};
        slot[r]->upload_arrays(v);
        CK(cudaMemset(slot[r]->opnd, 0x3C, alloc_bytes(s.N, rb, 0)));
      }
      const int calls = tokens >= 512 ? 10 : 50;
      const int64_t top = int64_t(ragged_chunk_max(msg, W, 1));
      double base = 0;
      for (int64_t chunk : {int64_t(0), top, int64_t(1) << 20, int64_t(256) << 10}) {
        if (chunk > top) continue;
        std::vector<cuda::RaggedArgs> args;
        for (int r = 0; r < W; ++r) {
          args.push_back(slot[r]->args());
          args.back().chunk = chunk;
        }
        const double us = graph_us(w, args, calls);
        if (chunk == 0) base = us;
        char name[32];
        std::snprintf(name, sizeof name, "%s", chunk == 0 ? "one round" : chunk == top ? "max" : "");
        if (chunk != 0 && chunk != top)
          std::snprintf(name, sizeof name, "%lld KiB", (long long)(chunk >> 10));
        const double ratio = chunk == 0 ? 1.0 : us / base;
        std::printf("%3d %6lld %10.2f %12s %10.2f %7.3f\n", W, (long long)tokens,
                    double(rows * rb) / (1 << 20), name, us, ratio);
        std::fflush(stdout);
        if (W == 1 && chunk != 0 && ratio > 1.10) ++bad;
      }
      for (Slot* p : slot) delete p;
    }
  std::printf("%s: world-1 chunked within 10%% of one round: %s\n", bad ? "FAIL" : "PASS",
              bad ? "no" : "yes");
  return bad ? 1 : 0;
}

// ---------------------------------------------------------------------------------------------

// Whether name contains one of the '|'-separated parts of `only`.
bool matches(const std::string& name, const std::string& only) {
  size_t a = 0;
  while (true) {
    const size_t e = only.find('|', a);
    if (name.find(only.substr(a, e == std::string::npos ? e : e - a)) != std::string::npos)
      return true;
    if (e == std::string::npos) return false;
    a = e + 1;
  }
}

// Runs fn in a child process (no CUDA in this one before), its output first; 0 on PASS.
int in_child(const std::function<int()>& fn) {
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid < 0) return fn();  // no fork: run here
  if (pid == 0) {
    alarm(180);  // a hang past every deadline ends the child (SIGALRM), not the run
    const int rc = fn();
    std::fflush(stdout);
    _exit(rc);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  std::printf("  child ended by signal %d%s\n", WTERMSIG(status),
              WTERMSIG(status) == SIGALRM ? " (over 180 s)" : "");
  return 128 + WTERMSIG(status);
}

}  // namespace

int main(int argc, char** argv) {
  // One hardware queue per rank's stream: ranks sharing a queue would serialise behind a
  // spinning kernel. (Direct calls are also enqueued step by step across ranks.)
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);
  const char* only = nullptr;
  bool fork_cases = true, errors_only = false, graph_time = false, ab = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--seed") && i + 1 < argc)
      g_seed = std::strtoull(argv[++i], nullptr, 10);
    else if (!std::strcmp(argv[i], "--no-fork")) fork_cases = false;
    else if (!std::strcmp(argv[i], "--error")) errors_only = true;
    else if (!std::strcmp(argv[i], "--graph-time")) graph_time = true;
    else if (!std::strcmp(argv[i], "--ab")) ab = true;
    else {
      std::printf("unknown argument %s (see the top of ragged_harness.cu)\n", argv[i]);
      return 2;
    }
  }
  if (graph_time) {
    CK(cuda::ragged_load_kernels());
    run_graph_time();
    return 0;
  }
  if (ab) {
    CK(cuda::ragged_load_kernels());
    return run_ab();
  }
  struct Named {
    std::string name;
    std::function<int()> fn;
  };
  std::vector<Named> all;
  for (int f = 0; f < 5; ++f)
    all.push_back({std::string("error: bad slice, ") + kFieldName[f], [f] {
                     CK(cuda::ragged_load_kernels());
                     return error_bad_slice(f);
                   }});
  for (int src : {3, 1})
    all.push_back({src == 1 ? "error: recv_sizes disagree (own slice)"
                            : "error: recv_sizes disagree (a peer's slice)",
                   [src] {
                     CK(cuda::ragged_load_kernels());
                     return error_recv(src);
                   }});
  for (int src : {3, 1})
    all.push_back({src == 1 ? "error: recv_sizes disagree (own slices, k=300)"
                            : "error: recv_sizes disagree (a peer's slices, k=300)",
                   [src] {
                     CK(cuda::ragged_load_kernels());
                     return error_recv(src, 300, 270);
                   }});
  all.push_back({"error: bad slices, the first of three (k=300)", [] {
                   CK(cuda::ragged_load_kernels());
                   return error_bad_slices_first();
                 }});
  all.push_back({"error: a peer never calls", [] {
                   CK(cuda::ragged_load_kernels());
                   return error_timeout();
                 }});
  for (int f : {1, 4})
    all.push_back({std::string("error: chunked, bad slice, ") + kFieldName[f], [f] {
                     CK(cuda::ragged_load_kernels());
                     return error_bad_slice(f, 256);
                   }});
  for (int src : {3, 1})
    all.push_back({src == 1 ? "error: chunked, recv_sizes disagree (own slice)"
                            : "error: chunked, recv_sizes disagree (a peer's)",
                   [src] {
                     CK(cuda::ragged_load_kernels());
                     return error_recv(src, 2, 1, 512);
                   }});
  all.push_back({"error: chunked, a peer never calls", [] {
                   CK(cuda::ragged_load_kernels());
                   return error_timeout(256);
                 }});
  if (!errors_only)
    for (const Case& cs : cases())
      all.push_back({cs.name, [cs] {
                       CK(cuda::ragged_load_kernels());  // before any rank spins
                       const std::string e = run_case(cs);
                       if (!e.empty()) std::printf("  %s\n", e.c_str());
                       return e.empty() ? 0 : 1;
                     }});
  std::printf("ragged_all_to_all harness, seed %llu, %s\n", (unsigned long long)g_seed,
              fork_cases ? "one child process per case" : "in-process");
  int fails = 0, ran = 0;
  for (const Named& n : all) {
    if (only && !matches(n.name, only)) continue;
    const auto t0 = std::chrono::steady_clock::now();
    const int rc = fork_cases ? in_child(n.fn) : n.fn();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%-48s %s (%.0f ms)\n", n.name.c_str(), rc == 0 ? "PASS" : "FAIL", ms);
    std::fflush(stdout);
    fails += rc != 0;
    ++ran;
  }
  std::printf("%s: %d failure(s) in %d case(s)\n", fails ? "FAIL" : "PASS", fails, ran);
  return fails ? 1 : 0;
}
