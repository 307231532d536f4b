// Standalone protocol test of the CUDA all-reduce kernels: W virtual ranks in one process on one
// GPU (no JAX, no NCCL, no multicast object).
//
// Build (from the repository root):
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I csrc -o build/allreduce_harness
//        tests/cuda_harness/allreduce_harness.cu csrc/cuda/allreduce.cu csrc/cuda/allreduce_wf32.cu
// Run:
//   build/allreduce_harness                 full run (W = 1, 2, 4, 8), exit 0 on PASS
//   build/allreduce_harness --quick         fewer shapes
//   build/allreduce_harness --gpus 2        ranks spread over 2 GPUs (peer access, NVLink)
//   build/allreduce_harness --gpus 2 --bench  timing table, one rank per GPU (not a check):
//                                             plain, fused and FP8 one-/two-shot, hidden 4096/7168
//   --ranks N with --bench / --probe: N ranks over the --gpus GPUs (ranks sharing a GPU: the
//                                             numbers compare kernel variants, not hardware)
//   a build with -DNVC_PROBE [-DNVC_PROBE_LAST], --gpus 2 --probe: SM cycles per kernel phase
//                                             (kernels/common.cuh probe(); not a check)
//   build/allreduce_harness --error         the failure paths: a rank calling alone (timeout),
//                                           ranks calling other sizes (disagreement), each ends
//                                           with its record and no trap; then a normal case runs
//                                           in the same process (error_test below)
// Do not build with --use_fast_math: the exact checks assume IEEE float32 without flush-to-zero.
//
// Multicast kernels, emulated (allreduce_multicast.cuh "Emulation build"; never on real
// multicast here):
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a
//        -gencode=arch=compute_90a,code=compute_90a -I csrc -DNVC_MULTICAST_EMULATE
//        -o build/ar_mcemu tests/cuda_harness/allreduce_harness.cu csrc/cuda/allreduce.cu
//        csrc/cuda/allreduce_wf32.cu
//   (the PTX is embedded for the self-check below)
//   build/ar_mcemu --multicast            W = 2, 4, 8: every case of one-shot and two-shot, plain,
//                                         fused and FP8, unicast AND multicast (each rank's
//                                         multicast base is its own unicast buffer: no multicast
//                                         object, no driver multicast call), each against the
//                                         references, the multicast ones bitwise against the
//                                         unicast ones (the emulation sums in rank order);
//                                         queued calls mixing the four variants, CUDA-graph
//                                         replays (FP8 too); first checks that its own PTX and
//                                         SASS (cuobjdump) hold no multimem instruction
//   build/ar_mcemu --multicast --error    the failure paths above on the multicast kernels
//   build/ar_mcemu --multicast --tiny     a few shapes at W = 2, 4 (for compute-sanitizer)
// --multicast is refused by a build without -DNVC_MULTICAST_EMULATE.
// Real multicast, ONLY where NVLink SHARP may be used (scripts/gpu_check.sh multicast_real; never
// on machines shared with other users): a build with -DNVC_MULTICAST_REAL, linked with
// csrc/transport/cuda_multicast.cu and cuda_vmm.cu, run as `--gpus N --multicast-real [--error]`
// with JAX_NVCOMM_MULTICAST=1 (the transport's interlock) and JAX_NVCOMM_MULTICAST_REAL_OK=1
// (this harness refuses otherwise): one rank per GPU, one multicast object over the buffers.
//
// Each rank gets its own symmetric buffer (comm_buffer_bytes), its own stream and its own
// host-mapped ErrorInfo; every rank's CommView lists all buffers. The grid of each rank is capped
// at SMs / W (the launch API's sm_count argument), so all ranks' blocks are co-resident.
//
// Checks, per case: plain sum and residual_out bit-exact against a CPU float32 rank-order
// emulation (with the documented rounding of the sum to T before the residual add); sum,
// residual_out and normed within tolerance of a float64 reference; NaN/inf classes; outputs
// bitwise identical across ranks and across one-shot / two-shot. FP8 output: q * scale and the
// row scales within e4m3 / float32 rounding of the float64 reference, residual_out bit-exact,
// every variant the same bytes (quant_case). Plus: 240 queued calls with
// changing sizes and alternating strategies, per-rank CUDA graphs replayed with new inputs, the
// device counters (Ctrl::seq, Ctrl::lamport_seq) against the number of calls, host validation.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include "common/layout.h"
#include "cuda/allreduce.h"
#ifdef NVC_MULTICAST_REAL
#include <memory>
#include <stdexcept>

#include "transport/cuda_multicast.h"
#include "transport/cuda_vmm.h"
#endif
#if defined(NVC_MULTICAST_REAL) && defined(NVC_MULTICAST_EMULATE)
#error "NVC_MULTICAST_REAL and NVC_MULTICAST_EMULATE exclude each other"
#endif

using nvc::CommView;
using nvc::ErrorInfo;
using nvc::cuda::AllReduceArgs;
using nvc::cuda::Strategy;

namespace {

// ---------------------------------------------------------------------------------------------
// Errors

struct World;
World* g_world = nullptr;
void dump_errors();
int g_ngpu = 1;                                  // --gpus N: rank r lives on GPU r % N
int g_ranks = 0;                                 // --ranks N: --bench / --probe world (default: --gpus)
int dev_of(int r) { return r % g_ngpu; }
// The multicast variants (--multicast, only in a build with -DNVC_MULTICAST_EMULATE, see the
// file comment): every case also runs oneshot_mc_kernel / twoshot_mc_kernel, whose multimem
// instructions that build turns into unicast loads and stores (allreduce_multicast.cuh).
#ifdef NVC_MULTICAST_EMULATE
constexpr bool kMcEmulated = true;
#else
constexpr bool kMcEmulated = false;
#endif
#ifdef NVC_MULTICAST_REAL
constexpr bool kMcReal = true;
#else
constexpr bool kMcReal = false;
#endif
int g_nvar = 2;     // variants per case: 0 one-shot, 1 two-shot (unicast); 2, 3 the same multicast
bool g_mc = false;  // --multicast --error: the fault cases on the multicast kernels
// --multicast-real (a build with -DNVC_MULTICAST_REAL, only on a machine that allows multicast:
// scripts/gpu_check.sh multicast_real): one rank per GPU, buffers bound to a real multicast
// object. Inputs are small integers (sums exact in any order: every variant bitwise equal)
// except in the rounding pass, where the real switch's reduction order may change the last bit
// of the multicast two-shot (allreduce_multicast.cuh).
bool g_mc_real = false;
bool g_int_inputs = false;
void set_dev(int r);

#define CK(call)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (call);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__,       \
                  __LINE__, #call);                                                     \
      dump_errors();                                                                    \
      std::printf("RESULT: FAIL\n");                                                    \
      std::exit(2);                                                                     \
    }                                                                                   \
  } while (0)

void set_dev(int r) {
  const cudaError_t e = cudaSetDevice(dev_of(r));
  if (e != cudaSuccess) {
    std::printf("cudaSetDevice(%d) failed: %s\nRESULT: FAIL\n", dev_of(r), cudaGetErrorName(e));
    std::exit(2);
  }
}
// cudaDeviceSynchronize on every GPU in use.
void sync_devices() {
  for (int d = 0; d < g_ngpu; ++d) {
    CK(cudaSetDevice(d));
    CK(cudaDeviceSynchronize());
  }
}

// ---------------------------------------------------------------------------------------------
// Host dtype helpers (raw bits in uint32_t)

const char* dtype_name(int dt) { return dt == 0 ? "f32" : dt == 1 ? "bf16" : "f16"; }
int esize(int dt) { return dt == 0 ? 4 : 2; }
int vec_elems(int dt) { return dt == 0 ? 4 : 8; }

float to_f(int dt, uint32_t b) {
  float f;
  if (dt == 0) {
    std::memcpy(&f, &b, 4);
  } else if (dt == 1) {
    const uint32_t u = b << 16;
    std::memcpy(&f, &u, 4);
  } else {
    __half_raw r;
    r.x = uint16_t(b);
    f = __half2float(__half(r));
  }
  return f;
}
uint32_t from_f(int dt, float f) {  // round to nearest even
  if (dt == 0) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  }
  if (dt == 1) {
    const __nv_bfloat16_raw r = __nv_bfloat16_raw(__float2bfloat16_rn(f));
    return r.x;
  }
  const __half_raw r = __half_raw(__float2half_rn(f));
  return r.x;
}
uint32_t neg_zero(int dt) { return dt == 0 ? 0x80000000u : 0x8000u; }
uint32_t sanitize(int dt, uint32_t b) { return b == neg_zero(dt) ? 0u : b; }
double ulp_rel(int dt) { return dt == 0 ? 1e-5 : dt == 1 ? 1.0 / 128 : 1.0 / 1024; }
double tiny(int dt) { return dt == 0 ? 1e-37 : dt == 1 ? 1e-37 : 1e-7; }

// A host tensor of raw element bits.
struct HostT {
  int dt = 0;
  std::vector<uint32_t> v;
  size_t bytes() const { return v.size() * esize(dt); }
  std::vector<char> pack() const {
    std::vector<char> b(bytes());
    for (size_t i = 0; i < v.size(); ++i) {
      if (dt == 0) std::memcpy(&b[i * 4], &v[i], 4);
      else { const uint16_t h = uint16_t(v[i]); std::memcpy(&b[i * 2], &h, 2); }
    }
    return b;
  }
  void unpack(const std::vector<char>& b) {
    for (size_t i = 0; i < v.size(); ++i) {
      if (dt == 0) std::memcpy(&v[i], &b[i * 4], 4);
      else { uint16_t h; std::memcpy(&h, &b[i * 2], 2); v[i] = h; }
    }
  }
};

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s << 13; s ^= s >> 7; s ^= s << 17;
    return s;
  }
  double uni() { return double(next() >> 11) * (1.0 / 9007199254740992.0); }
  int below(int n) { return int(next() % uint64_t(n)); }
};

// ---------------------------------------------------------------------------------------------
// Virtual world

struct RankState {
  char* buf = nullptr;
  cudaStream_t st = nullptr;
  ErrorInfo* err = nullptr;  // host-mapped
  CommView v{};
};

struct World {
  int W = 0;
  size_t M = 0;
  int sms = 1;
  std::vector<RankState> r;
  uint64_t twoshot_calls = 0, oneshot_calls = 0;  // expected device counters
  std::vector<char*> mc_va;  // --multicast-real: each rank's multicast address of its buffer
#ifdef NVC_MULTICAST_REAL
  std::vector<std::unique_ptr<nvc::cuda::vmm::Allocation>> alloc;
  std::unique_ptr<nvc::cuda::mc::Multicast> mcobj;
#endif
};

void dump_errors() {
  if (g_world == nullptr) return;
  for (int i = 0; i < g_world->W; ++i) {
    const ErrorInfo* e = g_world->r[i].err;
    if (e != nullptr && e->code != 0)
      std::printf("  rank %d ErrorInfo: code=%u op=0x%x rank=%d peer=%d seq=%llu observed=0x%llx\n",
                  i, e->code, e->op, e->rank, e->peer, (unsigned long long)e->seq,
                  (unsigned long long)e->observed);
  }
}

__global__ void fill_u32(uint32_t* p, size_t n, uint32_t value) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = value;
}

#ifdef NVC_MULTICAST_REAL
// --multicast-real: every rank's buffer a VMM allocation on its GPU (mapped for every other GPU
// too: the unicast kernels' peer access), all bound to one multicast object, mapped once per
// rank (csrc/transport/cuda_multicast.h, the package's own transport and interlock).
void real_multicast_buffers(World& w, size_t total) {
  namespace vmm = nvc::cuda::vmm;
  namespace mcn = nvc::cuda::mc;
  try {
    const size_t gran = mcn::granularity(dev_of(0), total, w.W, false);
    for (int r = 0; r < w.W; ++r) {
      w.alloc.emplace_back(new vmm::Allocation(dev_of(r), total, gran, false));
      for (int d = 0; d < g_ngpu; ++d)
        if (d != dev_of(r)) w.alloc[r]->grant_access(d);
    }
    w.mcobj = mcn::Multicast::create(dev_of(0), w.alloc[0]->size(), w.W, false);
    for (int r = 0; r < w.W; ++r) w.mcobj->add_device(dev_of(r));
    for (int r = 0; r < w.W; ++r) {
      w.r[r].buf = reinterpret_cast<char*>(w.alloc[r]->ptr());
      w.mc_va[r] = reinterpret_cast<char*>(w.mcobj->bind_and_map(*w.alloc[r]));
    }
  } catch (const std::exception& e) {
    std::printf("multicast setup failed: %s\nRESULT: FAIL\n", e.what());
    std::exit(2);
  }
}
#endif

World make_world(int W, size_t M, uint64_t timeout_ns, int device_sms) {
  World w;
  w.W = W;
  w.M = M;
  const int per_gpu = (W + g_ngpu - 1) / g_ngpu;  // ranks sharing one GPU
  w.sms = device_sms / per_gpu > 0 ? device_sms / per_gpu : 1;
  w.r.resize(W);
  w.mc_va.assign(W, nullptr);
  const size_t total = nvc::comm_buffer_bytes(M, W);
  const size_t loff = nvc::lamport_offset(M, W);
  if (g_mc_real) {
    if (W > g_ngpu) {
      std::printf("--multicast-real: %d ranks need %d GPUs (one each)\nRESULT: FAIL\n", W, W);
      std::exit(2);
    }
#ifdef NVC_MULTICAST_REAL
    real_multicast_buffers(w, total);
#endif
  }
  for (int i = 0; i < W; ++i) {
    RankState& s = w.r[i];
    set_dev(i);
    if (!g_mc_real) CK(cudaMalloc(&s.buf, total));
    CK(cudaMemset(s.buf, 0, loff));
    fill_u32<<<256, 256>>>(reinterpret_cast<uint32_t*>(s.buf + loff), (total - loff) / 4,
                           nvc::kLamportEmpty);
    CK(cudaGetLastError());
    CK(cudaStreamCreateWithFlags(&s.st, cudaStreamNonBlocking));
    CK(cudaHostAlloc(&s.err, sizeof(ErrorInfo), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(s.err, 0, sizeof(ErrorInfo));
  }
  for (int i = 0; i < W; ++i) {
    CommView& v = w.r[i].v;
    std::memset(&v, 0, sizeof(v));
    v.rank = i;
    v.world = W;
    v.timeout_ns = timeout_ns;
    for (int j = 0; j < W; ++j) v.bufs[j] = w.r[j].buf;
    ErrorInfo* dev_err = nullptr;
    CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_err), w.r[i].err, 0));
    v.err = dev_err;
    v.max_message_bytes = M;
    v.flag_half = nvc::flag_half_bytes(M, W);
    v.lamport_off = loff;
    v.lamport_slot = nvc::lamport_slot_bytes(M, W);
  }
  sync_devices();
  return w;
}

void free_world(World& w) {
#ifdef NVC_MULTICAST_REAL
  if (g_mc_real) {
    sync_devices();
    w.mcobj->release();  // unmap and unbind every rank, then the allocations
    for (auto& a : w.alloc) a->release();
  }
#endif
  for (int i = 0; i < w.W; ++i) {
    RankState& s = w.r[i];
    set_dev(i);
    if (!g_mc_real) CK(cudaFree(s.buf));
    CK(cudaStreamDestroy(s.st));
    CK(cudaFreeHost(s.err));
  }
  w.r.clear();
}

void sync_world(World& w) {
  for (auto& s : w.r) CK(cudaStreamSynchronize(s.st));
}

// The multicast base rank r passes (nullptr: the unicast kernels). Emulation build: the rank's
// own unicast buffer, the "multicast view" allreduce_multicast.cuh reads as its peer table;
// no multicast object exists. Any other build never selects the multicast kernels here.
const void* mc_base(const World& w, int r, bool mc) {
  if (!mc) return nullptr;
  if (g_mc_real) return w.mc_va[r];
  if (!kMcEmulated) {
    std::printf("multicast kernels requested in a build without -DNVC_MULTICAST_EMULATE\n"
                "RESULT: FAIL\n");
    std::exit(2);
  }
  return w.r[r].buf;
}
Strategy strat_of(int vi) { return (vi & 1) ? Strategy::kTwoShot : Strategy::kOneShot; }
bool mc_of(int vi) { return vi >= 2; }
const char* vname(Strategy s, bool mc) {
  return s == Strategy::kOneShot ? (mc ? "mc-oneshot" : "oneshot") : (mc ? "mc-twoshot" : "twoshot");
}

// ---------------------------------------------------------------------------------------------
// Test cases

struct Shape {
  int dt;
  int64_t T, H;
  bool fused;
  bool specials;
  bool distinct_residual;
  // Fused only: w32 = 1 a float32 weight of random values, 2 a float32 weight holding values
  // of dt (then bitwise the dt weight's results); Hn > 0: columns >= Hn of x, residual and
  // weight are zero (the package's padding of odd widths) and the mean divides by Hn.
  int w32 = 0;
  int64_t Hn = 0;
};

// Inputs of one case for every rank, their device copies and the expected outputs.
struct Case {
  Shape sh;
  int W = 0;
  std::vector<HostT> x, res;  // per rank
  HostT w;
  // expected (per rank when residuals differ)
  std::vector<HostT> exp_out, exp_rout;       // bit-exact plain sum / residual_out
  std::vector<std::vector<double>> ref_out;   // float64 reference (sum or normed)
  std::vector<std::vector<double>> ref_rout;
  std::vector<std::vector<double>> tol_out, tol_rout;
  // device
  std::vector<char*> d_x, d_res, d_out, d_rout;
  std::vector<char*> d_w;
};

uint32_t rand_val(int dt, Rng& g) {
  if (g_int_inputs) return from_f(dt, float(g.below(9) - 4));  // sums exact in any order
  return from_f(dt, float(g.uni() * 4.0 - 2.0));
}

// x of every rank, with the special values when the shape asks for them.
void gen_x(Case& c, uint64_t seed) {
  const Shape& s = c.sh;
  const size_t n = size_t(s.T) * s.H;
  Rng g(seed);
  c.x.assign(c.W, HostT{s.dt, std::vector<uint32_t>(n)});
  for (int r = 0; r < c.W; ++r)
    for (size_t i = 0; i < n; ++i) c.x[r].v[i] = rand_val(s.dt, g);
  if (!s.specials) return;
  const uint32_t nz = neg_zero(s.dt);
  const uint32_t nsub = s.dt == 0 ? 0x80000001u : 0x8001u;  // smallest negative subnormal
  const uint32_t psub = s.dt == 0 ? 0x00000003u : 0x0003u;
  for (size_t i = 0; i < n; ++i) {
    const int k = int((i / 2) % 11);
    for (int r = 0; r < c.W; ++r) {
      if (k == 0) c.x[r].v[i] = nz;                        // -0.0 on every rank
      if (k == 1) c.x[r].v[i] = (i & 1) ? nz : 0u;         // 16-bit: 0x80000000 words
      if (k == 2) c.x[r].v[i] = nsub;                      // negative subnormal everywhere
      if (k == 3) c.x[r].v[i] = r == 0 ? nsub : psub;      // mixed subnormals
      if (k == 4 && r == 0) c.x[r].v[i] = nz;              // -0.0 on one rank
    }
  }
  // A whole row of -0.0 (every word is the sentinel before sanitising).
  if (s.T >= 4)
    for (int r = 0; r < c.W; ++r)
      for (int64_t j = 0; j < s.H; ++j) c.x[r].v[size_t(3) * s.H + j] = nz;
  // Non-finite values in rows 0 and 1 (the whole row turns NaN in the fused result).
  const uint32_t pinf = s.dt == 0 ? 0x7F800000u : s.dt == 1 ? 0x7F80u : 0x7C00u;
  const uint32_t ninf = s.dt == 0 ? 0xFF800000u : s.dt == 1 ? 0xFF80u : 0xFC00u;
  const uint32_t qnan = s.dt == 0 ? 0x7FC00000u : s.dt == 1 ? 0x7FC0u : 0x7E00u;
  c.x[c.W - 1].v[std::min<size_t>(5, n - 1)] = qnan;
  if (s.T >= 2) {
    const size_t a = size_t(s.H) + 1, b = size_t(s.H) + 2;
    for (int r = 0; r < c.W; ++r) c.x[r].v[a] = pinf;     // +inf
    c.x[0].v[b] = pinf;
    c.x[c.W - 1].v[b] = ninf;                             // inf - inf = NaN (W >= 2)
  }
}

// residual (same on every rank unless distinct_residual) and weight.
void gen_rw(Case& c, uint64_t seed) {
  const Shape& s = c.sh;
  const size_t n = size_t(s.T) * s.H;
  Rng g(seed ^ 0xABCDEFull);
  c.res.assign(c.W, HostT{s.dt, std::vector<uint32_t>(n)});
  c.w = HostT{s.w32 ? 0 : s.dt, std::vector<uint32_t>(s.H)};
  for (size_t i = 0; i < n; ++i) c.res[0].v[i] = rand_val(s.dt, g);
  for (int r = 1; r < c.W; ++r)
    for (size_t i = 0; i < n; ++i)
      c.res[r].v[i] = s.distinct_residual ? rand_val(s.dt, g) : c.res[0].v[i];
  for (int64_t i = 0; i < s.H; ++i) {
    const float wf = float(0.5 + g.uni());
    c.w.v[i] = s.w32 == 2 ? from_f(0, to_f(s.dt, from_f(s.dt, wf))) : from_f(c.w.dt, wf);
  }
}

// The package's zero padding of rows to whole vectors: columns >= Hn hold zeros.
void zero_tail(Case& c) {
  const Shape& s = c.sh;
  if (s.Hn <= 0) return;
  for (int64_t row = 0; row < s.T; ++row)
    for (int64_t j = s.Hn; j < s.H; ++j)
      for (int r = 0; r < c.W; ++r) {
        c.x[r].v[size_t(row) * s.H + j] = 0u;
        if (s.fused) c.res[r].v[size_t(row) * s.H + j] = 0u;
      }
  for (int64_t j = s.Hn; j < s.H; ++j) c.w.v[j] = 0u;
}

void gen_inputs(Case& c, uint64_t seed) {
  gen_x(c, seed);
  gen_rw(c, seed);
  zero_tail(c);
}

// CPU references: exact float32 emulation and float64.
void compute_expected(Case& c) {
  const Shape& s = c.sh;
  const int dt = s.dt, W = c.W;
  const size_t n = size_t(s.T) * s.H;
  const int nranks_out = s.distinct_residual ? W : 1;
  c.exp_out.assign(nranks_out, HostT{dt, std::vector<uint32_t>(n)});
  c.exp_rout.assign(nranks_out, HostT{dt, std::vector<uint32_t>(s.fused ? n : 0)});
  c.ref_out.assign(nranks_out, std::vector<double>(n));
  c.tol_out.assign(nranks_out, std::vector<double>(n));
  c.ref_rout.assign(nranks_out, std::vector<double>(s.fused ? n : 0));
  c.tol_rout.assign(nranks_out, std::vector<double>(s.fused ? n : 0));
  std::vector<uint32_t> sumT(n);
  std::vector<double> sum_d(n), abs_d(n);
  for (size_t i = 0; i < n; ++i) {
    volatile float acc = to_f(dt, sanitize(dt, c.x[0].v[i]));
    double d = acc, a = std::fabs(double(acc));
    for (int r = 1; r < W; ++r) {
      const float f = to_f(dt, sanitize(dt, c.x[r].v[i]));
      acc = acc + f;
      d += f;
      a += std::fabs(double(f));
    }
    sumT[i] = from_f(dt, acc);
    sum_d[i] = d;
    abs_d[i] = a;
  }
  for (int q = 0; q < nranks_out; ++q) {
    if (!s.fused) {
      for (size_t i = 0; i < n; ++i) {
        c.exp_out[q].v[i] = sumT[i];
        c.ref_out[q][i] = sum_d[i];
        c.tol_out[q][i] = std::fabs(sum_d[i]) * ulp_rel(dt) + abs_d[i] * W * 1.2e-7 + tiny(dt);
      }
      continue;
    }
    const HostT& res = c.res[q];
    for (int64_t row = 0; row < s.T; ++row) {
      double ss = 0;
      std::vector<double> rr(s.H);
      for (int64_t j = 0; j < s.H; ++j) {
        const size_t i = size_t(row) * s.H + j;
        volatile float r32 = to_f(dt, sumT[i]);
        r32 = r32 + to_f(dt, res.v[i]);
        c.exp_rout[q].v[i] = from_f(dt, r32);
        // float64 reference of the documented semantics: r = T(sum) + residual
        const double rd = double(to_f(dt, from_f(dt, float(sum_d[i])))) + double(to_f(dt, res.v[i]));
        c.ref_rout[q][i] = rd;
        c.tol_rout[q][i] = (std::fabs(sum_d[i]) + std::fabs(rd)) * ulp_rel(dt) +
                           abs_d[i] * W * 1.2e-7 + tiny(dt);
        rr[j] = r32;  // exact r, as the kernels compute it
        ss += double(r32) * double(r32);
      }
      const double inv = 1.0 / std::sqrt(ss / double(s.Hn > 0 ? s.Hn : s.H) + 1e-6);
      for (int64_t j = 0; j < s.H; ++j) {
        const size_t i = size_t(row) * s.H + j;
        const double o = rr[j] * inv * double(to_f(c.w.dt, c.w.v[j]));
        c.ref_out[q][i] = o;
        c.tol_out[q][i] = std::fabs(o) * (ulp_rel(dt) + 4e-6) + tiny(dt);
      }
    }
  }
}

bool close_enough(double got, double ref, double tol) {
  if (std::isnan(ref)) return std::isnan(got);
  if (std::isinf(ref)) return got == ref;
  if (!std::isfinite(got)) return false;
  return std::fabs(got - ref) <= tol;
}

void upload(Case& c) {
  const size_t n = size_t(c.sh.T) * c.sh.H, bytes = n * esize(c.sh.dt);
  c.d_x.resize(c.W);
  c.d_res.resize(c.W);
  c.d_out.resize(c.W);
  c.d_rout.resize(c.W);
  c.d_w.assign(c.W, nullptr);
  for (int r = 0; r < c.W; ++r) {
    set_dev(r);
    CK(cudaMalloc(&c.d_x[r], bytes));
    CK(cudaMalloc(&c.d_out[r], bytes));
    auto hx = c.x[r].pack();
    CK(cudaMemcpy(c.d_x[r], hx.data(), bytes, cudaMemcpyHostToDevice));
    CK(cudaMemset(c.d_out[r], 0xFF, bytes));
    if (c.sh.fused) {
      CK(cudaMalloc(&c.d_res[r], bytes));
      CK(cudaMalloc(&c.d_rout[r], bytes));
      auto hr = c.res[r].pack();
      CK(cudaMemcpy(c.d_res[r], hr.data(), bytes, cudaMemcpyHostToDevice));
      CK(cudaMemset(c.d_rout[r], 0xFF, bytes));
      CK(cudaMalloc(&c.d_w[r], c.w.bytes()));
      auto hw = c.w.pack();
      CK(cudaMemcpy(c.d_w[r], hw.data(), c.w.bytes(), cudaMemcpyHostToDevice));
    }
  }
  sync_devices();
}

void release(Case& c) {
  for (int r = 0; r < c.W; ++r) {
    set_dev(r);
    CK(cudaFree(c.d_x[r]));
    CK(cudaFree(c.d_out[r]));
    if (c.sh.fused) {
      CK(cudaFree(c.d_res[r]));
      CK(cudaFree(c.d_rout[r]));
      CK(cudaFree(c.d_w[r]));
    }
  }
  c.d_w.clear();
}

AllReduceArgs args_of(const Case& c, int r) {
  AllReduceArgs a{};
  a.x = c.d_x[r];
  a.out = c.d_out[r];
  a.residual = c.sh.fused ? c.d_res[r] : nullptr;
  a.residual_out = c.sh.fused ? c.d_rout[r] : nullptr;
  a.weight = c.sh.fused ? c.d_w[r] : nullptr;
  a.tokens = c.sh.T;
  a.hidden = c.sh.H;
  a.dtype = c.sh.dt;
  a.eps = 1e-6f;
  a.weight_dtype = c.sh.w32 ? 0 : -1;
  a.norm_hidden = c.sh.Hn;
  return a;
}

// Launch one call on every rank (no sync).
void launch(World& w, const Case& c, Strategy s, bool mc = false) {
  for (int r = 0; r < w.W; ++r) {
    set_dev(r);
    const cudaError_t e = nvc::cuda::all_reduce(w.r[r].v, args_of(c, r), s, mc_base(w, r, mc),
                                                w.r[r].st, w.sms);
    if (e != cudaSuccess) {
      std::printf("all_reduce launch failed: %s (%s)\n", cudaGetErrorName(e),
                  nvc::cuda::all_reduce_check(w.r[r].v, args_of(c, r), s));
      std::printf("RESULT: FAIL\n");
      std::exit(2);
    }
  }
  if (w.W > 1) (s == Strategy::kTwoShot ? w.twoshot_calls : w.oneshot_calls) += 1;  // W=1: no protocol
}

struct Outputs {
  std::vector<HostT> out, rout;  // per rank
};

Outputs download(const Case& c) {
  Outputs o;
  const size_t n = size_t(c.sh.T) * c.sh.H, bytes = n * esize(c.sh.dt);
  std::vector<char> b(bytes);
  for (int r = 0; r < c.W; ++r) {
    HostT t{c.sh.dt, std::vector<uint32_t>(n)};
    CK(cudaMemcpy(b.data(), c.d_out[r], bytes, cudaMemcpyDeviceToHost));
    t.unpack(b);
    o.out.push_back(t);
    if (c.sh.fused) {
      CK(cudaMemcpy(b.data(), c.d_rout[r], bytes, cudaMemcpyDeviceToHost));
      t.unpack(b);
      o.rout.push_back(t);
    }
  }
  return o;
}

int g_fail_lines = 0;

void note_fail(const char* what, const Case& c, Strategy s, bool mc, int rank, size_t i,
               uint32_t got, double ref) {
  if (g_fail_lines++ >= 12) return;
  std::printf("  FAIL %s W=%d %s %s %s T=%lld H=%lld rank=%d idx=%zu got=0x%x (%g) ref=%g\n", what,
              c.W, vname(s, mc), dtype_name(c.sh.dt),
              c.sh.fused ? "fused" : "plain", (long long)c.sh.T, (long long)c.sh.H, rank, i, got,
              double(to_f(c.sh.dt, got)), ref);
}

bool same_bits(const uint32_t a, const uint32_t b) { return a == b; }

// Check one strategy's outputs against the references.
// The real switch sums in its own order (allreduce_multicast.cuh): the multicast two-shot's bits
// on float inputs are held to the float64 tolerance, not to the rank-order float32 emulation.
bool order_free(Strategy s, bool mc) {
  return g_mc_real && !g_int_inputs && mc && s == Strategy::kTwoShot;
}

bool check(const Case& c, Strategy s, const Outputs& o, bool mc = false) {
  const int dt = c.sh.dt;
  const size_t n = size_t(c.sh.T) * c.sh.H;
  const bool exact_order = !order_free(s, mc);
  bool ok = true;
  for (int r = 0; r < c.W; ++r) {
    const int q = c.sh.distinct_residual ? r : 0;
    int bad = 0;
    for (size_t i = 0; i < n && bad < 3; ++i) {
      const uint32_t g = o.out[r].v[i];
      const double gf = to_f(dt, g);
      if (!c.sh.fused) {
        const uint32_t e = c.exp_out[q].v[i];
        const bool exact = !exact_order || (std::isnan(to_f(dt, e)) ? std::isnan(gf) : same_bits(g, e));
        if (!exact) { note_fail("sum!=f32-emulation", c, s, mc, r, i, g, to_f(dt, e)); ok = false; ++bad; }
      } else {
        const uint32_t g2 = o.rout[r].v[i];
        const uint32_t e2 = c.exp_rout[q].v[i];
        const bool exact = !exact_order ||
                           (std::isnan(to_f(dt, e2)) ? std::isnan(to_f(dt, g2)) : same_bits(g2, e2));
        if (!exact) { note_fail("residual_out!=f32-emulation", c, s, mc, r, i, g2, to_f(dt, e2)); ok = false; ++bad; }
        if (!close_enough(to_f(dt, g2), c.ref_rout[q][i], c.tol_rout[q][i])) {
          note_fail("residual_out!~f64", c, s, mc, r, i, g2, c.ref_rout[q][i]); ok = false; ++bad;
        }
      }
      if (!close_enough(gf, c.ref_out[q][i], c.tol_out[q][i])) {
        note_fail(c.sh.fused ? "normed!~f64" : "sum!~f64", c, s, mc, r, i, g, c.ref_out[q][i]);
        ok = false;
        ++bad;
      }
    }
    // bitwise identical across ranks (same residual => same result)
    if (!c.sh.distinct_residual && r > 0) {
      if (o.out[r].v != o.out[0].v || (c.sh.fused && o.rout[r].v != o.rout[0].v)) {
        if (g_fail_lines++ < 12)
          std::printf("  FAIL ranks differ W=%d %s %s %s T=%lld H=%lld rank=%d\n", c.W,
                      vname(s, mc), dtype_name(dt), c.sh.fused ? "fused" : "plain", (long long)c.sh.T,
                      (long long)c.sh.H, r);
        ok = false;
      }
    }
  }
  return ok;
}

bool same_outputs(const Outputs& a, const Outputs& b) {
  for (size_t r = 0; r < a.out.size(); ++r) {
    if (a.out[r].v != b.out[r].v) return false;
    if (!a.rout.empty() && a.rout[r].v != b.rout[r].v) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Result table

struct Tally {
  int pass = 0, total = 0;
};
// [W index][variant: one-shot, two-shot, multicast one-shot, multicast two-shot][dtype][fused]
Tally g_tab[4][4][3][2];
Tally g_cross[4];  // one-shot vs two-shot bitwise
// --multicast: multicast one-shot vs unicast one-shot, multicast two-shot vs unicast two-shot,
// bitwise (the emulation sums in rank order, allreduce_multicast.cuh)
Tally g_mc_cross[4][2];
int widx(int W) { return W == 1 ? 0 : W == 2 ? 1 : W == 4 ? 2 : 3; }

// --multicast-real, float inputs: the multicast two-shot against the unicast one. Plain bf16/f16:
// every element within one ulp of T (the float32 sums of two orders, rounded once); f32 and the
// fused outputs: the float64 tolerance (check) alone. Prints how many elements differ.
bool rounding_close(const Case& c, const Outputs& uni, const Outputs& mc) {
  const int dt = c.sh.dt;
  size_t differ = 0, n = 0;
  uint32_t worst = 0;
  for (size_t r = 0; r < uni.out.size(); ++r)
    for (size_t i = 0; i < uni.out[r].v.size(); ++i, ++n) {
      const uint32_t a = uni.out[r].v[i], b = mc.out[r].v[i];
      if (a == b || (std::isnan(to_f(dt, a)) && std::isnan(to_f(dt, b)))) continue;
      ++differ;
      const bool same_sign = ((a ^ b) >> (dt == 0 ? 31 : 15)) == 0;
      worst = std::max(worst, same_sign ? (a > b ? a - b : b - a) : 0xFFFFFFFFu);
    }
  const bool ok = c.sh.fused || dt == 0 || worst <= 1;
  std::printf("  rounding W=%d %s %s T=%lld H=%lld: multicast two-shot differs from unicast in "
              "%zu of %zu elements (max %u ulp%s) %s\n", c.W, dtype_name(dt),
              c.sh.fused ? "fused" : "plain", (long long)c.sh.T, (long long)c.sh.H, differ, n,
              worst, worst == 0xFFFFFFFFu ? ", a sign" : "", ok ? "ok" : "FAIL");
  return ok;
}

bool run_case(World& w, const Shape& sh, uint64_t seed) {
  Case c;
  c.sh = sh;
  c.W = w.W;
  gen_inputs(c, seed);
  compute_expected(c);
  upload(c);
  const size_t bytes = size_t(sh.T) * sh.H * esize(sh.dt);
  Outputs res[4];
  bool ran[4] = {false, false, false, false};
  bool ok = true;
  for (int vi = 0; vi < g_nvar; ++vi) {
    const Strategy s = strat_of(vi);
    const bool mc = mc_of(vi);
    const size_t cap = s == Strategy::kOneShot ? nvc::cuda::oneshot_max_bytes(w.r[0].v)
                                               : nvc::cuda::twoshot_max_bytes(w.r[0].v);
    if (bytes > cap) continue;
    for (int r = 0; r < w.W; ++r) {  // poison outputs between variants
      set_dev(r);
      CK(cudaMemset(c.d_out[r], 0xFF, bytes));
      if (sh.fused) CK(cudaMemset(c.d_rout[r], 0xFF, bytes));
    }
    sync_devices();
    launch(w, c, s, mc);
    sync_world(w);
    res[vi] = download(c);
    ran[vi] = true;
    const bool good = check(c, s, res[vi], mc);
    Tally& t = g_tab[widx(w.W)][vi][sh.dt][sh.fused];
    t.total++;
    t.pass += good;
    ok &= good;
  }
  if (ran[0] && ran[1]) {
    const bool same = same_outputs(res[0], res[1]);
    g_cross[widx(w.W)].total++;
    g_cross[widx(w.W)].pass += same;
    if (!same && g_fail_lines++ < 12)
      std::printf("  FAIL oneshot!=twoshot bits W=%d %s %s T=%lld H=%lld\n", w.W,
                  dtype_name(sh.dt), sh.fused ? "fused" : "plain", (long long)sh.T,
                  (long long)sh.H);
    ok &= same;
  }
  for (int si = 0; si < 2; ++si) {  // a multicast variant against its unicast twin
    if (!ran[si] || !ran[si + 2]) continue;
    const bool same = order_free(strat_of(si), true) ? rounding_close(c, res[si], res[si + 2])
                                                     : same_outputs(res[si], res[si + 2]);
    Tally& t = g_mc_cross[widx(w.W)][si];
    t.total++;
    t.pass += same;
    if (!same && g_fail_lines++ < 12)
      std::printf("  FAIL %s!=%s bits W=%d %s %s T=%lld H=%lld\n", vname(strat_of(si), true),
                  vname(strat_of(si), false), w.W, dtype_name(sh.dt),
                  sh.fused ? "fused" : "plain", (long long)sh.T, (long long)sh.H);
    ok &= same;
  }
  release(c);
  return ok;
}

// ---------------------------------------------------------------------------------------------
// FP8 output (all_reduce_rms_norm_quant): every variant (one-shot: the cluster-split kernel where
// it applies, allreduce_oneshot_cluster.cuh; two-shot: the one-block epilogue; with --multicast
// the multicast kernels too) gives the same q, scale and residual_out bytes on every rank (one
// residual). Against references: residual_out bit-exact against the CPU float32 emulation; per
// row, scale within float32 rounding of max(amax, floor) / 448 of the float64 normed (fp8.h), and
// q * scale within the e4m3fn rounding (half an ulp: 2^-4 relative, 2^-10 scale below the
// normal range) of the float64 normed. replays > 0: per rank one CUDA graph of every variant's
// call (each variant its own outputs), replayed with two input sets in turn, every replay
// against the eager bytes of its set.
Tally g_quant[4], g_quant_ref[4], g_quant_graph[4];

double e4m3_to_d(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  const double v = e == 0 ? m * std::ldexp(1.0, -9) : (8 + m) * std::ldexp(1.0, e - 10);
  return (b & 0x80) ? -v : v;
}

// q | scale | residual_out of one rank against the references of c (computed for its x).
bool quant_ref_ok(const Case& c, const std::vector<uint8_t>& b, Strategy s, bool mc, int rank) {
  const int dt = c.sh.dt;
  const int64_t T = c.sh.T, H = c.sh.H;
  const size_t n = size_t(T) * H;
  int bad = 0;
  for (int64_t row = 0; row < T && bad < 3; ++row) {
    double amax = 0;
    for (int64_t j = 0; j < H; ++j) amax = std::max(amax, std::fabs(c.ref_out[0][row * H + j]));
    const double sref = std::max(amax, 448.0 * std::ldexp(1.0, -126)) / 448.0;
    float sc;
    std::memcpy(&sc, b.data() + n + row * 4, 4);
    if (!(std::fabs(double(sc) - sref) <= sref * 3e-5)) {
      if (g_fail_lines++ < 12)
        std::printf("  FAIL fp8 scale!~f64 W=%d %s %s T=%lld H=%lld rank=%d row=%lld got=%g ref=%g\n",
                    c.W, vname(s, mc), dtype_name(dt), (long long)T, (long long)H, rank,
                    (long long)row, double(sc), sref);
      ++bad;
      continue;
    }
    for (int64_t j = 0; j < H && bad < 3; ++j) {
      const size_t i = size_t(row) * H + j;
      const double ref = c.ref_out[0][i];
      const double got = e4m3_to_d(b[i]) * double(sc);
      const double tol = std::fabs(ref) * (0.0625 + 3e-5) + sref * std::ldexp(1.01, -10);
      if (!(std::fabs(got - ref) <= tol)) {
        if (g_fail_lines++ < 12)
          std::printf("  FAIL fp8 q*scale!~f64 W=%d %s %s T=%lld H=%lld rank=%d idx=%zu q=0x%02x got=%g ref=%g\n",
                      c.W, vname(s, mc), dtype_name(dt), (long long)T, (long long)H, rank, i,
                      b[i], got, ref);
        ++bad;
      }
    }
  }
  const size_t rb = n * esize(dt);
  std::vector<char> rbytes(b.begin() + n + T * 4, b.begin() + n + T * 4 + rb);
  HostT rout{dt, std::vector<uint32_t>(n)};
  rout.unpack(rbytes);
  for (size_t i = 0; i < n && bad < 3; ++i)
    if (rout.v[i] != c.exp_rout[0].v[i]) {
      if (g_fail_lines++ < 12)
        std::printf("  FAIL fp8 residual_out!=f32-emulation W=%d %s %s rank=%d idx=%zu\n", c.W,
                    vname(s, mc), dtype_name(dt), rank, i);
      ++bad;
    }
  return bad == 0;
}

bool quant_case(World& w, int dt, int64_t T, int64_t H, uint64_t seed, int replays) {
  Case c;
  c.sh = Shape{dt, T, H, true, false, false};
  c.W = w.W;
  gen_inputs(c, seed);
  upload(c);
  const int W = w.W, nv = g_nvar;
  const size_t n = size_t(T) * H, rbytes = n * esize(dt), total = n + size_t(T) * 4 + rbytes;
  // per variant and rank: out (q), residual_out, scale
  std::vector<std::vector<char*>> d_q(nv, std::vector<char*>(W)), d_r(nv, std::vector<char*>(W));
  std::vector<std::vector<float*>> d_s(nv, std::vector<float*>(W));
  for (int vi = 0; vi < nv; ++vi)
    for (int r = 0; r < W; ++r) {
      set_dev(r);
      CK(cudaMalloc(&d_q[vi][r], n));
      CK(cudaMalloc(&d_r[vi][r], rbytes));
      CK(cudaMalloc(&d_s[vi][r], size_t(T) * sizeof(float)));
    }
  auto args = [&](int vi, int r) {
    AllReduceArgs a = args_of(c, r);
    a.out = d_q[vi][r];
    a.residual_out = d_r[vi][r];
    a.scale = d_s[vi][r];
    return a;
  };
  auto count = [&](int vi) {
    if (W > 1) (strat_of(vi) == Strategy::kTwoShot ? w.twoshot_calls : w.oneshot_calls) += 1;
  };
  auto poison = [&]() {
    for (int vi = 0; vi < nv; ++vi)
      for (int r = 0; r < W; ++r) {
        set_dev(r);
        CK(cudaMemset(d_q[vi][r], 0xFF, n));
        CK(cudaMemset(d_r[vi][r], 0xFF, rbytes));
        CK(cudaMemset(d_s[vi][r], 0xFF, size_t(T) * sizeof(float)));
      }
    sync_devices();
  };
  auto fetch = [&](int vi, int r) {
    std::vector<uint8_t> b(total);
    set_dev(r);
    CK(cudaMemcpy(b.data(), d_q[vi][r], n, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data() + n, d_s[vi][r], size_t(T) * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data() + n + T * 4, d_r[vi][r], rbytes, cudaMemcpyDeviceToHost));
    return b;
  };
  // two input sets: eager runs of every variant, checked
  const int kSets = replays > 0 ? 2 : 1;
  std::vector<std::vector<char*>> pinned(kSets, std::vector<char*>(W, nullptr));
  std::vector<std::vector<std::vector<uint8_t>>> expect(kSets);  // [set][vi * W + r]
  bool same_ok = true, ref_ok = true;
  for (int set = 0; set < kSets; ++set) {
    if (set > 0) gen_x(c, seed * 31 + set);
    compute_expected(c);
    for (int r = 0; r < W; ++r) {
      const std::vector<char> hx = c.x[r].pack();
      CK(cudaMallocHost(&pinned[set][r], hx.size()));
      std::memcpy(pinned[set][r], hx.data(), hx.size());
      set_dev(r);
      CK(cudaMemcpy(c.d_x[r], pinned[set][r], hx.size(), cudaMemcpyHostToDevice));
    }
    poison();
    for (int vi = 0; vi < nv; ++vi) {
      for (int r = 0; r < W; ++r) {
        set_dev(r);
        const cudaError_t e = nvc::cuda::all_reduce(w.r[r].v, args(vi, r), strat_of(vi),
                                                    mc_base(w, r, mc_of(vi)), w.r[r].st, w.sms);
        if (e != cudaSuccess) {
          std::printf("quant all_reduce launch failed: %s\nRESULT: FAIL\n", cudaGetErrorName(e));
          std::exit(2);
        }
      }
      count(vi);
      sync_world(w);  // one variant at a time (each call a protocol round of all ranks)
    }
    for (int vi = 0; vi < nv; ++vi)
      for (int r = 0; r < W; ++r) {
        expect[set].push_back(fetch(vi, r));
        const std::vector<uint8_t>& b = expect[set].back();
        same_ok &= b == expect[set][0];
        if (r == 0) ref_ok &= quant_ref_ok(c, b, strat_of(vi), mc_of(vi), r);
      }
  }
  g_quant[widx(W)].total++;
  g_quant[widx(W)].pass += same_ok;
  g_quant_ref[widx(W)].total++;
  g_quant_ref[widx(W)].pass += ref_ok;
  if (!same_ok && g_fail_lines++ < 12)
    std::printf("  FAIL quant variants or ranks differ in bytes W=%d %s T=%lld H=%lld\n", W,
                dtype_name(dt), (long long)T, (long long)H);
  bool graph_ok = true;
  if (replays > 0) {
    std::vector<cudaGraphExec_t> exec(W);
    for (int r = 0; r < W; ++r) {
      cudaGraph_t graph;
      set_dev(r);
      CK(cudaStreamBeginCapture(w.r[r].st, cudaStreamCaptureModeRelaxed));
      for (int vi = 0; vi < nv; ++vi)
        CK(nvc::cuda::all_reduce(w.r[r].v, args(vi, r), strat_of(vi), mc_base(w, r, mc_of(vi)),
                                 w.r[r].st, w.sms));
      CK(cudaStreamEndCapture(w.r[r].st, &graph));
      CK(cudaGraphInstantiate(&exec[r], graph, 0));
      CK(cudaGraphDestroy(graph));
    }
    for (int rep = 0; rep < replays && graph_ok; ++rep) {
      const int set = rep % kSets;  // set 0 first: the eager runs ended with set 1
      poison();
      for (int r = 0; r < W; ++r) {
        set_dev(r);
        CK(cudaMemcpyAsync(c.d_x[r], pinned[set][r], c.x[r].bytes(), cudaMemcpyHostToDevice,
                           w.r[r].st));
        CK(cudaGraphLaunch(exec[r], w.r[r].st));
      }
      for (int vi = 0; vi < nv; ++vi) count(vi);
      sync_world(w);
      for (int vi = 0; vi < nv; ++vi)
        for (int r = 0; r < W; ++r)
          if (fetch(vi, r) != expect[set][vi * W + r]) {
            if (g_fail_lines++ < 12)
              std::printf("  FAIL quant graph replay %d %s W=%d %s T=%lld H=%lld rank %d differs "
                          "from the eager bytes\n", rep, vname(strat_of(vi), mc_of(vi)), W,
                          dtype_name(dt), (long long)T, (long long)H, r);
            graph_ok = false;
          }
    }
    for (int r = 0; r < W; ++r) {
      set_dev(r);
      CK(cudaGraphExecDestroy(exec[r]));
    }
    g_quant_graph[widx(W)].total++;
    g_quant_graph[widx(W)].pass += graph_ok;
  }
  for (auto& ps : pinned)
    for (char* p : ps) CK(cudaFreeHost(p));
  for (int vi = 0; vi < nv; ++vi)
    for (int r = 0; r < W; ++r) {
      set_dev(r);
      CK(cudaFree(d_q[vi][r]));
      CK(cudaFree(d_r[vi][r]));
      CK(cudaFree(d_s[vi][r]));
    }
  release(c);
  return same_ok && ref_ok && graph_ok;
}

// ---------------------------------------------------------------------------------------------
// World 1: the row kernel (local_rows_kernel) and the one-block epilogue (local_kernel) give the
// same bytes (normed or q + scales, residual_out), forced through all_reduce_local_variant.
// w32: the weight's form (Shape::w32; each form has kernels of its own).
Tally g_local_rows;

bool local_rows_cross(World& w, int dt, int64_t T, int64_t H, bool quant, uint64_t seed,
                      int w32 = 0) {
  Case c;
  c.sh = Shape{dt, T, H, true, (seed & 1) == 1, false, w32};
  c.W = 1;
  gen_inputs(c, seed);
  upload(c);
  const size_t n = size_t(T) * H, rbytes = n * esize(dt), obytes = quant ? n : rbytes;
  float* d_scale = nullptr;
  set_dev(0);
  if (quant) CK(cudaMalloc(&d_scale, size_t(T) * sizeof(float)));
  std::vector<uint8_t> got[2];
  for (int rows = 0; rows < 2; ++rows) {
    CK(cudaMemset(c.d_out[0], 0xFF, obytes));
    CK(cudaMemset(c.d_rout[0], 0xFF, rbytes));
    if (quant) CK(cudaMemset(d_scale, 0xFF, size_t(T) * sizeof(float)));
    AllReduceArgs a = args_of(c, 0);
    a.scale = d_scale;
    const cudaError_t e = nvc::cuda::all_reduce_local_variant(a, rows == 1, w.r[0].st, w.sms);
    if (e != cudaSuccess) {
      std::printf("  FAIL local variant %d launch: %s (T=%lld H=%lld)\n", rows,
                  cudaGetErrorName(e), (long long)T, (long long)H);
      release(c);
      return false;
    }
    sync_world(w);
    std::vector<uint8_t>& b = got[rows];
    b.resize(obytes + rbytes + (quant ? size_t(T) * 4 : 0));
    CK(cudaMemcpy(b.data(), c.d_out[0], obytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data() + obytes, c.d_rout[0], rbytes, cudaMemcpyDeviceToHost));
    if (quant) CK(cudaMemcpy(b.data() + obytes + rbytes, d_scale, size_t(T) * 4, cudaMemcpyDeviceToHost));
  }
  const bool ok = got[0] == got[1];
  g_local_rows.total++;
  g_local_rows.pass += ok;
  if (!ok && g_fail_lines++ < 12)
    std::printf("  FAIL world-1 row kernel != one-block bytes %s %s T=%lld H=%lld%s\n",
                dtype_name(dt), quant ? "fp8" : "fused", (long long)T, (long long)H,
                w32 ? " float32 weight" : "");
  if (d_scale != nullptr) CK(cudaFree(d_scale));
  release(c);
  return ok;
}

// ---------------------------------------------------------------------------------------------
// float32 weights with 16-bit x (weight_dtype) and zero-padded odd widths (norm_hidden), in
// every epilogue variant the shapes reach (cluster one-shot for few tokens, the register rows
// of two-shot and of world 1, the shared-memory rows, the FP8 epilogue): (a) the float64
// reference with the float32 weight and the mean over Hn (run_case: also one-shot == two-shot
// bitwise); (b) a float32 weight holding dt values gives the dt weight's bytes exactly (the
// float32 loads read the same values: addresses, layout); (c) the same for the FP8 epilogue;
// (d) world 1: the float32-weight row kernel gives its one-block epilogue's bytes (each weight
// form has kernels of its own).
Tally g_wtail;

// One call of c with strategy s on every rank (quantised when scale is set): the output bytes
// of every rank (out | residual_out | scale).
std::vector<std::vector<uint8_t>> run_bytes(World& w, Case& c, Strategy s, bool quant) {
  const size_t n = size_t(c.sh.T) * c.sh.H, rbytes = n * esize(c.sh.dt);
  const size_t obytes = quant ? n : rbytes;
  std::vector<float*> d_scale(w.W, nullptr);
  for (int r = 0; r < w.W; ++r) {
    set_dev(r);
    CK(cudaMemset(c.d_out[r], 0xFF, rbytes));
    CK(cudaMemset(c.d_rout[r], 0xFF, rbytes));
    if (quant) CK(cudaMalloc(&d_scale[r], size_t(c.sh.T) * 4));
  }
  sync_devices();
  for (int r = 0; r < w.W; ++r) {
    set_dev(r);
    AllReduceArgs a = args_of(c, r);
    a.scale = d_scale[r];
    const cudaError_t e = nvc::cuda::all_reduce(w.r[r].v, a, s, nullptr, w.r[r].st, w.sms);
    if (e != cudaSuccess) {
      std::printf("weight/tail all_reduce launch failed: %s (%s)\nRESULT: FAIL\n",
                  cudaGetErrorName(e), nvc::cuda::all_reduce_check(w.r[r].v, a, s));
      std::exit(2);
    }
  }
  if (w.W > 1) (s == Strategy::kTwoShot ? w.twoshot_calls : w.oneshot_calls) += 1;
  sync_world(w);
  std::vector<std::vector<uint8_t>> got(w.W);
  for (int r = 0; r < w.W; ++r) {
    set_dev(r);
    got[r].resize(obytes + rbytes + (quant ? size_t(c.sh.T) * 4 : 0));
    CK(cudaMemcpy(got[r].data(), c.d_out[r], obytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(got[r].data() + obytes, c.d_rout[r], rbytes, cudaMemcpyDeviceToHost));
    if (quant) {
      CK(cudaMemcpy(got[r].data() + obytes + rbytes, d_scale[r], size_t(c.sh.T) * 4,
                    cudaMemcpyDeviceToHost));
      CK(cudaFree(d_scale[r]));
    }
  }
  return got;
}

// (b) / (c): the float32 weight holding dt values against the dt weight, bytewise, for both
// strategies (where the message fits) and, with quant, the FP8 epilogue.
bool w32_same_bytes(World& w, int dt, int64_t T, int64_t H, int64_t Hn, bool quant,
                    uint64_t seed) {
  Case a, b;
  a.sh = Shape{dt, T, H, true, false, false, 0, Hn};
  b.sh = Shape{dt, T, H, true, false, false, 2, Hn};
  a.W = b.W = w.W;
  gen_inputs(a, seed);
  gen_inputs(b, seed);  // the same x and residual; b's weight: a's values as float32
  upload(a);
  upload(b);
  bool ok = true;
  const size_t bytes = size_t(T) * H * esize(dt);
  for (int si = 0; si < 2; ++si) {
    const Strategy s = si == 0 ? Strategy::kOneShot : Strategy::kTwoShot;
    if (bytes > (si == 0 ? nvc::cuda::oneshot_max_bytes(w.r[0].v)
                         : nvc::cuda::twoshot_max_bytes(w.r[0].v)))
      continue;
    ok &= run_bytes(w, a, s, quant) == run_bytes(w, b, s, quant);
  }
  if (!ok && g_fail_lines++ < 12)
    std::printf("  FAIL float32 weight of %s values != %s weight bytes W=%d T=%lld H=%lld Hn=%lld%s\n",
                dtype_name(dt), dtype_name(dt), w.W, (long long)T, (long long)H, (long long)Hn,
                quant ? " fp8" : "");
  release(a);
  release(b);
  return ok;
}

bool weight_tail_cases(World& w, uint64_t seed) {
  struct WT { int64_t T, H, Hn; };
  // (1, 4096) / (7, 7168): cluster one-shot (W >= 2) and world-1 register rows; (16, 3072):
  // two-shot register rows; (33, 520) / (1000, 64): shared-memory rows, several per group;
  // Hn: odd true widths inside the padded H (4100 -> 4104 for 16-bit, 7 -> 8, 1 -> 8)
  const WT cases[] = {{1, 4096, 0}, {7, 7168, 0}, {16, 3072, 0}, {33, 520, 0}, {1000, 64, 0},
                      {3, 4104, 4100}, {5, 8, 7}, {9, 8, 1}, {64, 4104, 4100}, {2, 1032, 1025}};
  bool ok = true;
  for (int dt = 0; dt < 3; ++dt)
    for (const WT& c : cases) {
      for (int w32 = 0; w32 < (dt == 0 ? 1 : 2); ++w32) {  // f32 x: the weight is f32 anyway
        if (w32 == 0 && c.Hn == 0) continue;              // the plain cases run elsewhere
        Shape sh{dt, c.T, c.H, true, false, false, w32, c.Hn};
        if (dt == 0 && c.H % 4) continue;
        const bool good = run_case(w, sh, ++seed);
        g_wtail.total++;
        g_wtail.pass += good;
        ok &= good;
      }
      if (dt != 0)
        for (int q = 0; q < 2; ++q) {
          const bool good = w32_same_bytes(w, dt, c.T, c.H, c.Hn, q == 1, ++seed);
          g_wtail.total++;
          g_wtail.pass += good;
          ok &= good;
        }
    }
  if (w.W == 1)  // the float32-weight row kernel against its one-block epilogue, bitwise
    for (int dt = 1; dt < 3; ++dt)
      for (const WT& c : {WT{1, 4096, 0}, WT{7, 7168, 0}, WT{300, 4096, 0}, WT{33, 2560, 0}})
        for (int q = 0; q < 2; ++q) {
          const bool good = local_rows_cross(w, dt, c.T, c.H, q == 1, ++seed, 1);
          g_wtail.total++;
          g_wtail.pass += good;
          ok &= good;
        }
  return ok;
}

// ---------------------------------------------------------------------------------------------
// Many queued calls with changing sizes and alternating strategies (no sync in between); with
// --multicast the four variants in turn (one protocol state: the same counters and buffers).

bool stress(World& w, int ncalls, uint64_t seed) {
  Rng g(seed);
  std::vector<Case> cs(ncalls);
  std::vector<Strategy> st(ncalls);
  std::vector<char> mcs(ncalls, 0);
  static const int64_t Hs[] = {64, 128, 256, 520, 1024, 2048, 4096, 8192};
  for (int k = 0; k < ncalls; ++k) {
    Shape sh;
    sh.dt = g.below(3);
    sh.H = Hs[g.below(8)];
    const int64_t maxT = std::max<int64_t>(1, (128 << 10) / (sh.H * esize(sh.dt)));
    sh.T = 1 + g.below(int(std::min<int64_t>(maxT, 64)));
    sh.fused = g.below(2) == 1;
    sh.specials = g.below(4) == 0;
    sh.distinct_residual = false;
    cs[k].sh = sh;
    cs[k].W = w.W;
    st[k] = strat_of(k % g_nvar);
    mcs[k] = mc_of(k % g_nvar);
    gen_inputs(cs[k], seed * 1000 + k);
    compute_expected(cs[k]);
    upload(cs[k]);
  }
  sync_devices();
  for (int k = 0; k < ncalls; ++k) launch(w, cs[k], st[k], mcs[k]);
  sync_world(w);
  bool ok = true;
  for (int k = 0; k < ncalls; ++k) {
    ok &= check(cs[k], st[k], download(cs[k]), mcs[k]);
    release(cs[k]);
  }
  return ok;
}

// ---------------------------------------------------------------------------------------------
// CUDA graphs: per rank, capture K calls on its stream; replay R times with new inputs each time.
// With --multicast every call but one (a unicast two-shot between them) is a multicast call.

bool graph_test(World& w, int replays, uint64_t seed) {
  const int K = 6;
  const int kSets = 3;
  const Shape shapes[K] = {{1, 4, 4096, false, false, false}, {1, 8, 1024, true, false, false},
                           {0, 3, 512, true, true, false},   {2, 16, 2048, false, false, false},
                           {0, 1, 64, false, true, false},    {2, 32, 8192, true, false, false}};
  const Strategy strat[K] = {Strategy::kOneShot, Strategy::kTwoShot, Strategy::kOneShot,
                             Strategy::kTwoShot, Strategy::kTwoShot, Strategy::kOneShot};
  bool mcg[K];
  for (int k = 0; k < K; ++k) mcg[k] = g_nvar == 4 && k != 3;
  std::vector<Case> cs(K);
  std::vector<std::vector<Outputs>> expect(kSets, std::vector<Outputs>(K));
  std::vector<std::vector<std::vector<char*>>> pinned(kSets, std::vector<std::vector<char*>>(K));
  bool ok = true;
  for (int k = 0; k < K; ++k) {
    cs[k].sh = shapes[k];
    cs[k].W = w.W;
    gen_inputs(cs[k], seed + k);
    upload(cs[k]);  // residual and weight stay; x changes per input set
  }
  // Expected outputs per input set: eager runs, validated against the references.
  for (int set = 0; set < kSets; ++set) {
    for (int k = 0; k < K; ++k) {
      gen_x(cs[k], seed * 77 + set * 1000 + k);
      compute_expected(cs[k]);
      for (int r = 0; r < w.W; ++r) {
        const std::vector<char> hx = cs[k].x[r].pack();
        char* p = nullptr;
        CK(cudaMallocHost(&p, hx.size()));
        std::memcpy(p, hx.data(), hx.size());
        pinned[set][k].push_back(p);
        CK(cudaMemcpy(cs[k].d_x[r], p, hx.size(), cudaMemcpyHostToDevice));
      }
    }
    sync_devices();
    for (int k = 0; k < K; ++k) launch(w, cs[k], strat[k], mcg[k]);
    sync_world(w);
    for (int k = 0; k < K; ++k) {
      expect[set][k] = download(cs[k]);
      ok &= check(cs[k], strat[k], expect[set][k], mcg[k]);
    }
  }
  // Capture the K calls of each rank into that rank's graph.
  std::vector<cudaGraphExec_t> exec(w.W);
  for (int r = 0; r < w.W; ++r) {
    cudaGraph_t graph;
    set_dev(r);
    CK(cudaStreamBeginCapture(w.r[r].st, cudaStreamCaptureModeRelaxed));
    for (int k = 0; k < K; ++k) {
      const cudaError_t e = nvc::cuda::all_reduce(w.r[r].v, args_of(cs[k], r), strat[k],
                                                  mc_base(w, r, mcg[k]), w.r[r].st, w.sms);
      if (e != cudaSuccess) {
        std::printf("  FAIL capture: %s\n", cudaGetErrorName(e));
        std::printf("RESULT: FAIL\n");
        std::exit(2);
      }
    }
    CK(cudaStreamEndCapture(w.r[r].st, &graph));
    CK(cudaGraphInstantiate(&exec[r], graph, 0));
    CK(cudaGraphDestroy(graph));
  }
  // Replays with changing inputs: right answers only if the device counters advance.
  for (int rep = 0; rep < replays && ok; ++rep) {
    const int set = rep % kSets;
    for (int r = 0; r < w.W; ++r) {
      set_dev(r);
      for (int k = 0; k < K; ++k)
        CK(cudaMemcpyAsync(cs[k].d_x[r], pinned[set][k][r], cs[k].x[r].bytes(),
                           cudaMemcpyHostToDevice, w.r[r].st));
      CK(cudaGraphLaunch(exec[r], w.r[r].st));
    }
    for (int k = 0; k < K; ++k)
      if (w.W > 1) (strat[k] == Strategy::kTwoShot ? w.twoshot_calls : w.oneshot_calls) += 1;
    sync_world(w);
    for (int k = 0; k < K; ++k) {
      if (!same_outputs(download(cs[k]), expect[set][k])) {
        if (g_fail_lines++ < 12)
          std::printf("  FAIL graph replay %d call %d %s (W=%d) differs from the eager result\n",
                      rep, k, vname(strat[k], mcg[k]), w.W);
        ok = false;
      }
    }
  }
  for (int r = 0; r < w.W; ++r) {
    set_dev(r);
    CK(cudaGraphExecDestroy(exec[r]));
  }
  for (auto& a : pinned)
    for (auto& b : a)
      for (char* p : b) CK(cudaFreeHost(p));
  for (auto& c : cs) release(c);
  return ok;
}

// A row's result must not depend on how many rows the call has (the epilogue processes 1, 2 or
// 4 rows per thread group depending on tokens): rows 0..6 of a 600-row fused call (two-shot)
// against the same 7 rows alone (one-shot and two-shot).
bool batch_invariance(World& w, uint64_t seed) {
  bool ok = true;
  for (int dt = 0; dt < 3; ++dt) {
    Case big, small;
    big.sh = {dt, 600, 2048, true, false, false};
    big.W = w.W;
    gen_inputs(big, seed + dt);
    small.sh = {dt, 7, 2048, true, false, false};
    small.W = w.W;
    const size_t n = size_t(7) * 2048;
    small.x = big.x;
    small.res = big.res;
    for (auto& h : small.x) h.v.resize(n);
    for (auto& h : small.res) h.v.resize(n);
    small.w = big.w;
    if (size_t(600) * 2048 * esize(dt) > nvc::cuda::twoshot_max_bytes(w.r[0].v)) continue;
    upload(big);
    upload(small);
    launch(w, big, Strategy::kTwoShot);
    sync_world(w);
    const Outputs ob = download(big);
    for (int vi = 0; vi < g_nvar; ++vi) {  // every variant's 7 rows against the big call's
      launch(w, small, strat_of(vi), mc_of(vi));
      sync_world(w);
      const Outputs os = download(small);
      for (int r = 0; r < w.W; ++r)
        for (size_t i = 0; i < n; ++i)
          if (os.out[r].v[i] != ob.out[r].v[i] || os.rout[r].v[i] != ob.rout[r].v[i]) {
            if (g_fail_lines++ < 12)
              std::printf("  FAIL batch invariance W=%d %s %s rank %d idx %zu\n", w.W,
                          vname(strat_of(vi), mc_of(vi)), dtype_name(dt), r, i);
            ok = false;
            break;
          }
    }
    release(big);
    release(small);
  }
  return ok;
}

// Device counters must equal the number of calls of each protocol.
bool counters_ok(World& w) {
  bool ok = true;
  for (int r = 0; r < w.W; ++r) {
    nvc::Ctrl head;
    CK(cudaMemcpy(&head, w.r[r].buf, 64, cudaMemcpyDeviceToHost));
    if (head.seq != w.twoshot_calls || head.lamport_seq != w.oneshot_calls ||
        head.done_blocks != 0) {
      std::printf("  FAIL counters W=%d rank %d: seq=%llu (want %llu) lamport_seq=%llu (want %llu) done_blocks=%u\n",
                  w.W, r, (unsigned long long)head.seq, (unsigned long long)w.twoshot_calls,
                  (unsigned long long)head.lamport_seq, (unsigned long long)w.oneshot_calls,
                  head.done_blocks);
      ok = false;
    }
  }
  return ok;
}

// Host validation: invalid calls are refused and launch nothing.
bool validation_ok(World& w) {
  bool ok = true;
  Case c;
  c.sh = {1, 4, 64, true, false, false};
  c.W = w.W;
  gen_inputs(c, 5);
  upload(c);
  AllReduceArgs a = args_of(c, 0);
  set_dev(0);
  auto refused = [&](AllReduceArgs b, Strategy s, const char* what) {
    if (nvc::cuda::all_reduce(w.r[0].v, b, s, nullptr, w.r[0].st, w.sms) != cudaErrorInvalidValue) {
      std::printf("  FAIL validation accepted: %s\n", what);
      ok = false;
    }
  };
  AllReduceArgs b = a;
  b.hidden = 60;  // not a multiple of 8
  refused(b, Strategy::kOneShot, "hidden % 8 != 0");
  b = a;
  b.tokens = int64_t(nvc::cuda::oneshot_max_bytes(w.r[0].v) / (64 * 2)) + 1;
  refused(b, Strategy::kOneShot, "message above one-shot capacity");
  b.tokens = int64_t(nvc::cuda::twoshot_max_bytes(w.r[0].v) / (64 * 2)) + 1;
  refused(b, Strategy::kTwoShot, "message above two-shot capacity");
  b = a;
  b.dtype = 7;
  refused(b, Strategy::kTwoShot, "bad dtype");
  b = a;
  b.weight = nullptr;
  refused(b, Strategy::kOneShot, "fused without weight");
  b = a;
  b.hidden = 32768 + 8;
  refused(b, Strategy::kTwoShot, "fused hidden too large");
  b = a;
  b.norm_hidden = a.hidden + 1;
  refused(b, Strategy::kOneShot, "norm_hidden > hidden");
  b = a;
  b.weight_dtype = a.dtype == 1 ? 2 : 1;  // a 16-bit weight of the other 16-bit type
  refused(b, Strategy::kOneShot, "weight of a third dtype");
  b = a;
  b.x = static_cast<const char*>(a.x) + 4;
  refused(b, Strategy::kOneShot, "misaligned x");
  b = a;
  b.tokens = 0;  // accepted, launches nothing (on every rank alike)
  if (nvc::cuda::all_reduce(w.r[0].v, b, Strategy::kTwoShot, nullptr, w.r[0].st, w.sms) != cudaSuccess) {
    std::printf("  FAIL validation: tokens == 0 refused\n");
    ok = false;
  }
  sync_devices();
  release(c);
  return ok;
}

// --error: the failure paths (kernels/common.cuh "Failure"), all in this one process, since no
// kernel traps any more: each fault must end with the named record, cudaSuccess from the
// stream, no hang, and a healthy context (the last check runs a normal case and compares it).
//   timeout      rank 0 of a 2-rank world calls alone (one-shot, two-shot, fused one-shot on the
//                cluster kernel): kErrTimeout naming rank 1, call #1; one-shot outputs NaN;
//                Ctrl::failed set; then a second call on that rank exits at its start (fast,
//                record unchanged)
//   sizes        both ranks call, rank 1 with twice the tokens (one-shot plain, fused on the
//                cluster kernel, two-shot): both record a disagreement (kErrMismatch, the other
//                rank) well before the deadline (the one-shot tag, layout.h lamport_tag); the
//                same in a 3-rank world whose rank 2 never calls (one-shot: the tag wait for
//                rank 2 gives up on Ctrl::failed)
//   poison       two-shot: rank 1 with a 1 us deadline leaves after phase 0; rank 0, calling
//                after it, records a mismatch with the poison descriptor naming rank 1 at
//                once (allreduce_twoshot.cuh), rank 1 a timeout naming rank 0
//   healthy      a fresh 2-rank world runs a random case after all of the above, checked as in
//                the full run
double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

uint32_t ctrl_failed(const World& w, int r) {
  nvc::Ctrl head;
  set_dev(r);
  CK(cudaMemcpy(&head, w.r[r].buf, sizeof(head), cudaMemcpyDeviceToHost));
  return head.failed;
}

bool all_nan(const HostT& t) {
  for (uint32_t b : t.v)
    if (!std::isnan(to_f(t.dt, b))) return false;
  return true;
}

// One fault: `ranks` of a fresh 2-rank world call (rank r with tokens T * (1 + r * grow));
// every calling rank must record `code` naming the other rank, within `max_s`.
bool fault_case(const char* what, int sms, Strategy s, bool fused, int64_t T, int64_t H,
                int ranks, int grow, uint32_t code, double max_s) {
  const std::string label = std::string(g_mc ? "mc " : "") + what;
  const char* name = label.c_str();
  const uint64_t timeout_ns = 2ull * 1000 * 1000 * 1000;
  World w = make_world(2, 1 << 20, timeout_ns, sms);
  g_world = &w;
  std::vector<Case> cs(2);
  for (int r = 0; r < 2; ++r) {
    cs[r].sh = {1, T * (1 + r * grow), H, fused, false, false};
    cs[r].W = 2;
    gen_inputs(cs[r], 7 + r);
    upload(cs[r]);
  }
  const double t0 = now_s();
  for (int r = 0; r < ranks; ++r) {
    set_dev(r);
    CK(nvc::cuda::all_reduce(w.r[r].v, args_of(cs[r], r), s, mc_base(w, r, g_mc), w.r[r].st,
                             w.sms));
  }
  bool ok = true;
  for (int r = 0; r < ranks; ++r) {
    set_dev(r);
    const cudaError_t e = cudaStreamSynchronize(w.r[r].st);
    const double dt = now_s() - t0;
    const ErrorInfo* info = w.r[r].err;
    const uint32_t failed = ctrl_failed(w, r);
    const bool good = e == cudaSuccess && info->code == code && info->rank == r &&
                      info->peer == 1 - r && info->seq == 1 && failed == code && dt < max_s;
    std::printf("  %-34s rank %d: sync %s after %.2f s, ErrorInfo code=%u rank=%d peer=%d "
                "seq=%llu, Ctrl::failed=%u %s\n", name, r, cudaGetErrorName(e), dt, info->code,
                info->rank, info->peer, (unsigned long long)info->seq, failed,
                good ? "ok" : "FAIL");
    ok &= good;
  }
  if (ranks == 1 && s == Strategy::kOneShot && !fused) {  // the poison of a failed poll: NaN
    const bool nan = all_nan(download(cs[0]).out[0]);
    std::printf("  %-34s rank 0 output all NaN: %s\n", name, nan ? "ok" : "FAIL");
    ok &= nan;
  }
  if (ranks == 1) {  // a failed communicator: the next call exits at its start
    const ErrorInfo before = *w.r[0].err;
    const double t1 = now_s();
    set_dev(0);
    CK(nvc::cuda::all_reduce(w.r[0].v, args_of(cs[0], 0), s, mc_base(w, 0, g_mc), w.r[0].st,
                             w.sms));
    const cudaError_t e = cudaStreamSynchronize(w.r[0].st);
    const double dt = now_s() - t1;
    const bool same = std::memcmp(&before, w.r[0].err, sizeof(before)) == 0;
    const bool good = e == cudaSuccess && dt < 0.5 && same;
    std::printf("  %-34s next call: sync %s after %.3f s, record unchanged %s: %s\n", name,
                cudaGetErrorName(e), dt, same ? "yes" : "no", good ? "ok" : "FAIL");
    ok &= good;
  }
  for (auto& c : cs) release(c);
  free_world(w);
  g_world = nullptr;
  return ok;
}

// What one rank of fault_world must record: code naming peer (poison: a mismatch whose
// observed descriptor is layout.h kPoisonDesc).
struct Expect {
  int rank;
  uint32_t code;
  int peer;
  bool poison;
};

// One fault in a fresh W-rank world: the ranks of `order` call, in that order (rank r with T *
// (1 + r * grow) tokens); rank `hasty` (if >= 0) gets a 1 us deadline and its stream is
// synchronised before the next rank launches. Every expectation must hold, call #1, within
// max_s of the first launch; every launch ends with cudaSuccess.
bool fault_world(const char* what, int sms, Strategy s, bool fused, int W, int64_t T, int64_t H,
                 int grow, const std::vector<int>& order, int hasty,
                 const std::vector<Expect>& expect, double max_s) {
  const std::string label = std::string(g_mc ? "mc " : "") + what;
  const char* name = label.c_str();
  World w = make_world(W, 1 << 20, 2ull * 1000 * 1000 * 1000, sms);
  g_world = &w;
  if (hasty >= 0) w.r[hasty].v.timeout_ns = 1000;
  std::vector<Case> cs(W);
  for (int r = 0; r < W; ++r) {
    cs[r].sh = {1, T * (1 + r * grow), H, fused, false, false};
    cs[r].W = W;
    gen_inputs(cs[r], 11 + r);
    upload(cs[r]);
  }
  bool ok = true;
  const double t0 = now_s();
  for (int r : order) {
    set_dev(r);
    CK(nvc::cuda::all_reduce(w.r[r].v, args_of(cs[r], r), s, mc_base(w, r, g_mc), w.r[r].st,
                             w.sms));
    if (r == hasty) ok &= cudaStreamSynchronize(w.r[r].st) == cudaSuccess;
  }
  for (const Expect& x : expect) {
    set_dev(x.rank);
    const cudaError_t e = cudaStreamSynchronize(w.r[x.rank].st);
    const double dt = now_s() - t0;
    const ErrorInfo* info = w.r[x.rank].err;
    const uint32_t failed = ctrl_failed(w, x.rank);
    const bool poisoned = nvc::flag_desc(info->observed) == nvc::kPoisonDesc;
    const bool good = e == cudaSuccess && info->code == x.code && info->rank == x.rank &&
                      info->peer == x.peer && info->seq == 1 && failed == x.code &&
                      (!x.poison || poisoned) && dt < max_s;
    std::printf("  %-34s rank %d: sync %s after %.2f s, ErrorInfo code=%u rank=%d peer=%d "
                "seq=%llu%s, Ctrl::failed=%u %s\n", name, x.rank, cudaGetErrorName(e), dt,
                info->code, info->rank, info->peer, (unsigned long long)info->seq,
                poisoned ? " (poison)" : "", failed, good ? "ok" : "FAIL");
    ok &= good;
  }
  for (auto& c : cs) release(c);
  free_world(w);
  g_world = nullptr;
  return ok;
}

int error_test(int sms) {
  bool ok = true;
  std::printf("fault checks (2 ranks, deadline 2 s; no kernel traps)%s:\n",
              g_mc ? ", multicast kernels (emulated)" : "");
  const uint32_t tmo = nvc::kErrTimeout, mis = nvc::kErrMismatch;
  ok &= fault_case("timeout one-shot", sms, Strategy::kOneShot, false, 2, 4096, 1, 0, tmo, 4.0);
  ok &= fault_case("timeout two-shot", sms, Strategy::kTwoShot, false, 2, 4096, 1, 0, tmo, 4.0);
  ok &= fault_case("timeout fused one-shot (cluster)", sms, Strategy::kOneShot, true, 1, 4096, 1,
                   0, tmo, 4.0);
  ok &= fault_case("timeout fused two-shot", sms, Strategy::kTwoShot, true, 4, 1024, 1, 0, tmo,
                   4.0);
  // Sizes: the tag check reports both ranks within far less than the 2 s deadline.
  ok &= fault_case("sizes one-shot", sms, Strategy::kOneShot, false, 2, 4096, 2, 1, mis, 1.0);
  ok &= fault_case("sizes fused one-shot (cluster)", sms, Strategy::kOneShot, true, 1, 4096, 2,
                   1, mis, 1.0);
  ok &= fault_case("sizes fused one-shot (rows)", sms, Strategy::kOneShot, true, 8, 1024, 2, 1,
                   mis, 1.0);
  ok &= fault_case("sizes two-shot", sms, Strategy::kTwoShot, false, 2, 4096, 2, 1, mis, 1.0);
  // Sizes with a third rank absent: the tag waits for it give up once the mismatch is
  // recorded (Ctrl::failed), not at the 2 s deadline.
  const std::vector<Expect> both_mis = {{0, mis, 1, false}, {1, mis, 0, false}};
  ok &= fault_world("sizes one-shot, rank 2 absent", sms, Strategy::kOneShot, false, 3, 2, 4096,
                    1, {0, 1}, -1, both_mis, 1.0);
  ok &= fault_world("sizes fused 1-shot (cl), 2 absent", sms, Strategy::kOneShot, true, 3, 1,
                    4096, 1, {0, 1}, -1, both_mis, 1.0);
  // Rank 1 (1 us deadline) runs alone and leaves after its phase-0 wait, its phase-0 flags up;
  // then rank 0 passes phase 0 and finds rank 1's poisoned phase-1 flags (not a 2 s timeout).
  const std::vector<Expect> poisoned = {{1, tmo, 0, false}, {0, mis, 1, true}};
  ok &= fault_world("two-shot phase 0 left (poison)", sms, Strategy::kTwoShot, false, 2, 2, 4096,
                    0, {1, 0}, 1, poisoned, 1.0);
  ok &= fault_world("fused two-shot phase 0 left (poison)", sms, Strategy::kTwoShot, true, 2, 4,
                    1024, 0, {1, 0}, 1, poisoned, 1.0);
  {  // the context is healthy: a normal case on a fresh world, checked as in the full run
    World w = make_world(2, 1 << 20, 2ull * 1000 * 1000 * 1000, sms);
    g_world = &w;
    const bool good = run_case(w, Shape{1, 7, 4096, true, true, false}, 4242) &&
                      run_case(w, Shape{0, 3, 1000, false, true, false}, 4243);
    std::printf("  %-34s %s\n", "healthy context afterwards", good ? "ok" : "FAIL");
    ok &= good;
    free_world(w);
    g_world = nullptr;
  }
  std::printf("RESULT: %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

// --bench: one rank per GPU, bf16; per rank a CUDA graph of `iters` calls; the time per call is
// the slowest rank's (graph time / iters), best of two timed rounds. Not a check: prints a table.
// Columns: plain / fused / fused + FP8 output (quant), one-shot and two-shot; the first line is
// the floor: a graph of `iters` empty kernels (the per-node cost every column includes).
__global__ void empty_kernel() {}

double time_graph(World& w, const std::function<void(int)>& body, int iters) {
  const int W = w.W;
  std::vector<cudaGraphExec_t> exec(W);
  std::vector<cudaEvent_t> e0(W), e1(W);
  for (int r = 0; r < W; ++r) {
    set_dev(r);
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(w.r[r].st, cudaStreamCaptureModeRelaxed));
    for (int i = 0; i < iters; ++i) body(r);
    CK(cudaStreamEndCapture(w.r[r].st, &g));
    CK(cudaGraphInstantiate(&exec[r], g, 0));
    CK(cudaGraphDestroy(g));
    CK(cudaEventCreate(&e0[r]));
    CK(cudaEventCreate(&e1[r]));
  }
  double best = -1;
  for (int rep = 0; rep < 4; ++rep) {  // warm-up, then three timed rounds (keep the best)
    for (int r = 0; r < W; ++r) {
      set_dev(r);
      CK(cudaEventRecord(e0[r], w.r[r].st));
      CK(cudaGraphLaunch(exec[r], w.r[r].st));
      CK(cudaEventRecord(e1[r], w.r[r].st));
    }
    sync_world(w);
    if (rep == 0) continue;
    float worst = 0;
    for (int r = 0; r < W; ++r) {
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0[r], e1[r]));
      worst = std::max(worst, ms);
    }
    const double t = 1000.0 * worst / iters;
    if (best < 0 || t < best) best = t;
  }
  for (int r = 0; r < W; ++r) {
    set_dev(r);
    CK(cudaGraphExecDestroy(exec[r]));
    CK(cudaEventDestroy(e0[r]));
    CK(cudaEventDestroy(e1[r]));
  }
  return best;
}

// One bf16 case of --bench / --probe on every rank: kind 0 plain, 1 fused, 2 fused with the
// FP8 output (float32 row scales); time(st) = time_graph of its calls.
struct TimedCase {
  World& w;
  Case c;
  std::vector<float*> sc;
  TimedCase(World& world, int64_t T, int64_t H, int kind) : w(world), sc(world.W, nullptr) {
    c.sh = {1, T, H, kind > 0, false, false};
    c.W = w.W;
    gen_inputs(c, 7);
    upload(c);
    for (int r = 0; kind == 2 && r < w.W; ++r) {
      set_dev(r);
      CK(cudaMalloc(&sc[r], size_t(T) * sizeof(float)));
    }
  }
  ~TimedCase() {
    for (int r = 0; r < w.W; ++r)
      if (sc[r] != nullptr) {
        set_dev(r);
        CK(cudaFree(sc[r]));
      }
    release(c);
  }
  bool fits(Strategy st) const {
    const size_t bytes = size_t(c.sh.T) * c.sh.H * 2;
    return bytes <= (st == Strategy::kTwoShot ? nvc::cuda::twoshot_max_bytes(w.r[0].v)
                                              : nvc::cuda::oneshot_max_bytes(w.r[0].v));
  }
  double time(Strategy st, int iters) {
    return time_graph(w, [&](int r) {
      AllReduceArgs a = args_of(c, r);
      a.scale = sc[r];
      CK(nvc::cuda::all_reduce(w.r[r].v, a, st, nullptr, w.r[r].st, w.sms));
    }, iters);
  }
};

// --bench-local: world 1 (one GPU, the epilogue alone), the fused and FP8 epilogues against a
// device-to-device copy of x (reads and writes every byte once: the bandwidth reference).
// Bytes of the epilogue = read x, residual + write normed, residual_out (4 x T x H x 2; the
// weight and, for FP8, the 1-byte q and scales are left out). JAX_NVCOMM_AR_LOCAL_ROWS=0 picks
// the one-block epilogue (local_kernel) instead of the row kernel, for an A/B.
void bench_local(int sms) {
  g_ngpu = 1;
  World w = make_world(1, size_t(256) << 20, 4ull * 1000 * 1000 * 1000, sms);
  g_world = &w;
  const int iters = 20;
  std::printf("\nbench-local: W=1, bf16, us per call (CUDA graph of %d calls, best of 3); "
              "JAX_NVCOMM_AR_LOCAL_ROWS=%s\n", iters,
              std::getenv("JAX_NVCOMM_AR_LOCAL_ROWS") ? std::getenv("JAX_NVCOMM_AR_LOCAL_ROWS") : "unset");
  std::printf("%-11s | %9s %7s | %9s %7s %6s | %9s %7s %6s\n", "shape", "copy us", "TB/s",
              "fused us", "TB/s", "/copy", "fp8 us", "TB/s", "/copy");
  const int64_t shapes[][2] = {{2048, 8192}, {4096, 7168}, {8192, 8192}, {512, 4096}};
  for (const auto& sh : shapes) {
    const int64_t T = sh[0], H = sh[1];
    const double bytes = double(T) * H * 2;
    double copy_us, us[2];
    {
      TimedCase tc(w, T, H, 1);
      copy_us = time_graph(w, [&](int r) {
        CK(cudaMemcpyAsync(tc.c.d_out[r], tc.c.d_x[r], size_t(bytes), cudaMemcpyDeviceToDevice,
                           w.r[r].st));
      }, iters);
      us[0] = tc.time(Strategy::kTwoShot, iters);
    }
    {
      TimedCase tc(w, T, H, 2);
      us[1] = tc.time(Strategy::kTwoShot, iters);
    }
    const double copy_bw = 2 * bytes / copy_us / 1e6, f_bw = 4 * bytes / us[0] / 1e6,
                 q_bw = 4 * bytes / us[1] / 1e6;
    std::printf("%5lldx%-5lld | %9.1f %7.2f | %9.1f %7.2f %5.0f%% | %9.1f %7.2f %5.0f%%\n",
                (long long)T, (long long)H, copy_us, copy_bw, us[0], f_bw, 100 * f_bw / copy_bw,
                us[1], q_bw, 100 * q_bw / copy_bw);
  }
  free_world(w);
  g_world = nullptr;
}

void bench(int sms) {
  const int W = g_ranks > 0 ? g_ranks : g_ngpu;
  const size_t M = 16 << 20;
  World w = make_world(W, M, 4ull * 1000 * 1000 * 1000, sms);
  g_world = &w;
  const int iters = 200;
  std::printf("\nbench: W=%d (%s), bf16, us per call (CUDA graph of %d calls, slowest "
              "rank, best of 3)\n", W,
              W > g_ngpu ? "ranks SHARE GPUs: compares kernel variants only" : "one rank per GPU", iters);
  std::printf("graph node floor (empty kernel): %.2f us\n",
              time_graph(w, [&](int r) { empty_kernel<<<1, 32, 0, w.r[r].st>>>(); }, iters));
  std::printf("%-12s %9s | %7s %7s | %7s %7s | %7s %7s\n", "shape", "bytes", "plain1", "plain2",
              "fused1", "fused2", "quant1", "quant2");
  const int64_t Hs[] = {4096, 7168};
  const int64_t Ts[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  for (int64_t H : Hs) {
    for (int64_t T : Ts) {
      const size_t bytes = size_t(T) * H * 2;
      if (bytes > (2u << 20)) continue;
      double us[3][2] = {{-1, -1}, {-1, -1}, {-1, -1}};
      for (int kind = 0; kind < 3; ++kind) {  // plain, fused, quant
        TimedCase tc(w, T, H, kind);
        for (int si = 0; si < 2; ++si) {
          const Strategy st = si ? Strategy::kTwoShot : Strategy::kOneShot;
          if (tc.fits(st)) us[kind][si] = tc.time(st, iters);
        }
      }
      auto cell = [](double v) {
        static char b[8][16];
        static int k = 0;
        char* p = b[k++ & 7];
        if (v < 0) std::snprintf(p, 16, "%7s", "-");
        else std::snprintf(p, 16, "%7.2f", v);
        return p;
      };
      char shape[32];
      std::snprintf(shape, sizeof shape, "%lldx%lld", (long long)T, (long long)H);
      std::printf("%-12s %9zu | %s %s | %s %s | %s %s\n", shape, bytes, cell(us[0][0]),
                  cell(us[0][1]), cell(us[1][0]), cell(us[1][1]), cell(us[2][0]), cell(us[2][1]));
    }
  }
  free_world(w);
  g_world = nullptr;
}

}  // namespace

#ifdef NVC_PROBE
// --probe (a build with -DNVC_PROBE): mean SM cycles per phase of block 0 of rank 0 (GPU 0),
// over graphs of 200 calls. Phases: 0-12 start (counters, setup) | 12-1 push (one-shot) |
// 1-2 clear | 2-3 poll + residual + pass 1 | 3-4 row sums, rsqrt | 4-5 pass 2 | ->6 end of the
// reduce | two-shot: 12-7 scatter | 7-8 flag wait 0 | 8-9 reduce + gather + flag | 9-10 flag
// wait 1 | 10-11 epilogue; FP8 (quant) epilogue: 4-13 pass 2, 13-14 row amax, 14-end pass 3.
void probe_run(int sms) {
  const int W = g_ranks > 0 ? g_ranks : g_ngpu;
  World w = make_world(W, 16 << 20, 4ull * 1000 * 1000 * 1000, sms);
  g_world = &w;
  int khz = 0;
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
  std::printf("\nprobe: W=%d, cycles per phase of block 0 / rank 0 (clock attr %d MHz)\n", W, khz / 1000);
  std::printf("%-10s %-6s %-7s %7s | %6s %6s %6s %6s %6s %6s %6s | %6s %6s %6s %6s %6s | %6s %6s\n",
              "shape", "kind", "strat", "us/call", "start", "push", "clear", "pass1", "sums", "pass2",
              "end", "scat", "wait0", "red+ag", "wait1", "epi", "q:p2", "q:amax");
  struct PS { int64_t T, H; };
  const PS shapes[] = {{1, 4096}, {2, 4096}, {8, 4096}, {64, 4096}, {1, 7168}, {64, 7168}, {128, 4096}};
  for (const PS& ps : shapes) {
    for (int kind = 0; kind < 3; ++kind) {
      TimedCase tc(w, ps.T, ps.H, kind);
      for (int si = 0; si < 2; ++si) {
        const Strategy st = si ? Strategy::kTwoShot : Strategy::kOneShot;
        if (!tc.fits(st)) continue;
        unsigned long long pr[16];
        set_dev(0);
        CK(nvc::cuda::probe_take(pr));  // zero
        const double us = tc.time(st, 200);
        set_dev(0);
        CK(nvc::cuda::probe_take(pr));
        const double n = pr[15] ? double(pr[15]) : 1.0;
        auto cyc = [&](int i) { return double(pr[i]) / n; };
        char shape[32];
        std::snprintf(shape, sizeof shape, "%lldx%lld", (long long)ps.T, (long long)ps.H);
        std::printf("%-10s %-6s %-7s %7.2f | %6.0f %6.0f %6.0f %6.0f %6.0f %6.0f %6.0f | %6.0f %6.0f %6.0f %6.0f %6.0f | %6.0f %6.0f\n",
                    shape, kind == 0 ? "plain" : kind == 1 ? "fused" : "quant", si ? "twoshot" : "oneshot", us,
                    cyc(12), cyc(1), cyc(2), cyc(3), cyc(4), cyc(5), cyc(6), cyc(7), cyc(8), cyc(9), cyc(10), cyc(11),
                    cyc(13), cyc(14));
      }
    }
  }
  free_world(w);
  g_world = nullptr;
}
#endif

// --multicast: this binary must hold no multimem instruction (the emulation build replaces
// every one, allreduce_multicast.cuh; one must never run here). Read back with cuobjdump from
// this executable (its path from /proc/self/exe, read here: in the child, that link would name
// cuobjdump): its PTX (built with code=compute_90a too) must not name multimem, and its SASS
// must hold none of the three spellings a multimem instruction has there: "multimem", LDGMC
// (multimem.ld_reduce) and STG.E.128.STRONG.SYS (what multimem.st.relaxed.sys.v4 assembles to
// on sm_90a, the same opcode as a relaxed system-scope 16-byte store, which no unicast kernel
// issues); and the multicast kernels must be there (else the check proves nothing). A missing
// cuobjdump or PTX is a failure.
bool no_multimem_in_binary() {
  struct Scan {
    size_t lines = 0, hits = 0, mc_fns = 0;
  };
  auto scan = [](const char* cmd, const char* const* pats, int npats, const char* fn_mark) {
    Scan sc;
    FILE* p = popen(cmd, "r");
    if (p == nullptr) return sc;
    char line[8192];
    while (std::fgets(line, sizeof line, p) != nullptr) {
      ++sc.lines;
      std::string l(line);
      std::transform(l.begin(), l.end(), l.begin(), [](unsigned char ch) { return std::tolower(ch); });
      for (int i = 0; i < npats; ++i) sc.hits += l.find(pats[i]) != std::string::npos;
      sc.mc_fns += l.find(fn_mark) != std::string::npos && l.find("_mc_kernel") != std::string::npos;
    }
    if (pclose(p) != 0) sc.lines = 0;
    return sc;
  };
  static const char* const kSass[] = {"multimem", "ldgmc", "stg.e.128.strong.sys"};
  static const char* const kPtx[] = {"multimem"};
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0 || std::memchr(self, '\'', size_t(len)) != nullptr) {
    std::printf("no multimem in this binary: cannot name this executable: FAIL\n");
    return false;
  }
  self[len] = 0;
  const std::string exe = std::string("'") + self + "'";
  const Scan sass = scan(("cuobjdump --dump-sass " + exe + " 2>/dev/null").c_str(), kSass, 3,
                         "function : ");
  const Scan ptx = scan(("cuobjdump --dump-ptx " + exe + " 2>/dev/null").c_str(), kPtx, 1,
                        ".entry ");
  const bool ok = sass.lines > 0 && ptx.lines > 0 && sass.mc_fns > 0 && ptx.mc_fns > 0 &&
                  sass.hits == 0 && ptx.hits == 0;
  std::printf("no multimem in this binary: SASS %zu lines, %zu multicast kernels, %zu lines with "
              "multimem|LDGMC|STG.E.128.STRONG.SYS; PTX %zu lines, %zu multicast kernels, %zu "
              "lines with multimem: %s\n", sass.lines, sass.mc_fns, sass.hits, ptx.lines,
              ptx.mc_fns, ptx.hits, ok ? "ok" : "FAIL (needs cuobjdump, a build with "
              "code=sm_90a and code=compute_90a, and -DNVC_MULTICAST_EMULATE)");
  return ok;
}

int main(int argc, char** argv) {
  bool quick = false, err = false, do_bench = false, do_probe = false, do_local = false;
  bool multicast = false, tiny = false, mc_real = false, wtail = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--wtail")) wtail = true;
    else if (!std::strcmp(argv[i], "--multicast")) multicast = true;
    else if (!std::strcmp(argv[i], "--multicast-real")) mc_real = true;
    else if (!std::strcmp(argv[i], "--tiny")) tiny = true;
    else if (!std::strcmp(argv[i], "--bench")) do_bench = true;
    else if (!std::strcmp(argv[i], "--bench-local")) do_local = true;
    else if (!std::strcmp(argv[i], "--probe")) do_probe = true;
    else if (!std::strcmp(argv[i], "--gpus") && i + 1 < argc) g_ngpu = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--ranks") && i + 1 < argc) g_ranks = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--error")) err = true;
    else {
      std::printf("usage: %s [--gpus N] [--ranks N] [--multicast | --multicast-real] "
                  "[--quick | --tiny | --wtail | --bench | --bench-local | --probe | --error]\n",
                  argv[0]);
      return 2;
    }
  }
  if (multicast) {
    if (!kMcEmulated) {
      std::printf("--multicast needs a build with -DNVC_MULTICAST_EMULATE (this binary would run "
                  "real multimem instructions)\nRESULT: FAIL\n");
      return 2;
    }
    if (do_bench || do_probe || do_local) {
      std::printf("--multicast: correctness runs only (emulated timings mean nothing)\n");
      return 2;
    }
    if (!no_multimem_in_binary()) {
      std::printf("RESULT: FAIL\n");
      return 1;
    }
    g_nvar = 4;
    g_mc = true;
  }
  if (mc_real) {  // scripts/gpu_check.sh multicast_real; the transport's interlock applies too
    if (!kMcReal || multicast) {
      std::printf("--multicast-real needs a build with -DNVC_MULTICAST_REAL (and no "
                  "--multicast)\nRESULT: FAIL\n");
      return 2;
    }
    const char* ok = std::getenv("JAX_NVCOMM_MULTICAST_REAL_OK");
    if (ok == nullptr || std::strcmp(ok, "1") != 0) {
      std::printf("--multicast-real: refused without JAX_NVCOMM_MULTICAST_REAL_OK=1 (a machine "
                  "with NVLink SHARP whose administrators allow multicast)\nRESULT: FAIL\n");
      return 2;
    }
    if (do_bench || do_probe || do_local || tiny || quick) {
      std::printf("--multicast-real: the full correctness run or --error only\n");
      return 2;
    }
    g_nvar = 4;
    g_mc = true;
    g_mc_real = true;
    g_int_inputs = true;
  }
  // Enough hardware queues for one stream per rank without false dependencies.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  int dev = 0, sms = 0;
  CK(cudaSetDevice(dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  if (g_ngpu < 1 || g_ngpu > ndev) {
    std::printf("--gpus %d: only %d GPU(s) visible\nRESULT: FAIL\n", g_ngpu, ndev);
    return 2;
  }
  for (int a = 0; a < g_ngpu; ++a)  // peers map each other's buffers (NVLink between GPUs)
    for (int b = 0; b < g_ngpu; ++b) {
      if (a == b) continue;
      int can = 0;
      CK(cudaDeviceCanAccessPeer(&can, a, b));
      if (!can) {
        std::printf("GPU %d cannot access GPU %d\nRESULT: FAIL\n", a, b);
        return 2;
      }
      CK(cudaSetDevice(a));
      const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CK(e);
      cudaGetLastError();
    }
  for (int d = 0; d < g_ngpu; ++d) {  // as the communicator setup does
    CK(cudaSetDevice(d));
    CK(nvc::cuda::all_reduce_load_kernels());
  }
  std::printf("device: %s, %d SMs, %d GPU(s) used (rank r on GPU r %% %d)%s\n", prop.name, sms,
              g_ngpu, g_ngpu,
              multicast ? "; multicast kernels EMULATED (unicast loads/stores, no multicast "
                          "object)"
              : mc_real ? "; REAL multicast (one object over every rank's buffer)" : "");
  if (err) return error_test(sms);
  if (do_bench) {
    bench(sms);
    return 0;
  }
  if (do_local) {
    bench_local(sms);
    return 0;
  }
  if (do_probe) {
#ifdef NVC_PROBE
    probe_run(sms);
    return 0;
#else
    std::printf("--probe needs a build with -DNVC_PROBE\n");
    return 2;
#endif
  }

  const size_t M = 8 << 20;  // max_message_bytes: one-shot slot 1 MiB, two-shot 8 MiB
  const uint64_t timeout_ns = 4ull * 1000 * 1000 * 1000;
  if (wtail) {  // the float32-weight / padded-width cases alone, W = 1, 2, 4, 8 (+ validation)
    bool ok = true, valid = true;
    for (int W : {1, 2, 4, 8}) {
      World w = make_world(W, M, timeout_ns, sms);
      g_world = &w;
      ok &= weight_tail_cases(w, 4242 + W);
      if (W == 2) valid = validation_ok(w);
      ok &= counters_ok(w);
      free_world(w);
      g_world = nullptr;
    }
    std::printf("\n W  strategy  dtype  fused (float32 weight / padded widths)\n");
    for (int W : {1, 2, 4, 8})
      for (int si = 0; si < 2; ++si)
        for (int dt = 0; dt < 3; ++dt) {
          const Tally& f = g_tab[widx(W)][si][dt][1];
          std::printf("%2d  %-8s  %-5s  %3d/%-3d %s\n", W, si ? "twoshot" : "oneshot",
                      dtype_name(dt), f.pass, f.total, f.pass == f.total ? "ok" : "FAIL");
        }
    std::printf("float32 weight / zero-padded widths (all W): %d/%d %s\n", g_wtail.pass,
                g_wtail.total, g_wtail.pass == g_wtail.total ? "ok" : "FAIL");
    std::printf("host validation %s\n", valid ? "ok" : "FAIL");
    ok &= valid;
    std::printf("RESULT: %s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 1;
  }
  struct TH { int64_t T, H; };
  std::vector<TH> shapes = {{1, 64},     {1, 4096},   {1, 16384}, {2, 72},    {3, 1000},
                            {5, 128},    {7, 4096},   {8, 8192},  {16, 2048}, {33, 520},
                            {64, 8192},  {128, 1024}, {200, 2048}, {1000, 64}, {4097, 64},
                            {2100, 64},  {600, 4096}, {4, 32768}, {48, 16384}, {256, 8192},
                            {2, 65536}};
  if (quick) shapes = {{1, 64}, {3, 1000}, {7, 4096}, {64, 8192}, {4097, 64}, {4, 32768}};
  std::vector<int> Ws = {1, 2, 4, 8};
  std::vector<TH> qs = {{1, 4096}, {7, 4096}, {3, 7168}, {33, 4096}, {5, 8192}, {34, 4096},
                        {64, 7168}, {65, 4096}, {16, 1024}};
  int nstress = quick ? 60 : 240, replays = quick ? 12 : 60, qreplays = 0;
  if (multicast) {  // the multicast variants next to the unicast ones, W = 2, 4, 8
    Ws = {2, 4, 8};
    shapes = {{1, 64}, {2, 72}, {3, 1000}, {7, 4096}, {33, 520}, {64, 8192}, {1, 16384},
              {4097, 64}, {600, 4096}, {4, 32768}};
    qs = {{1, 4096}, {7, 4096}, {3, 7168}, {33, 4096}, {65, 4096}};
    nstress = 80;
    replays = 12;
    qreplays = 4;
  }
  if (mc_real) {  // every GPU one rank; the multicast shapes
    if (g_ngpu < 2) {
      std::printf("--multicast-real needs --gpus N with N >= 2\nRESULT: FAIL\n");
      return 2;
    }
    Ws = {g_ngpu};
    shapes = {{1, 64}, {2, 72}, {3, 1000}, {7, 4096}, {33, 520}, {64, 8192}, {1, 16384},
              {4097, 64}, {600, 4096}, {4, 32768}};
    qs = {{1, 4096}, {7, 4096}, {3, 7168}, {33, 4096}, {65, 4096}};
    nstress = 240;
    replays = 60;
    qreplays = 8;
  }
  if (tiny) {  // the sanitizer runs: a few shapes of each kind
    if (multicast) Ws = {2, 4};
    shapes = {{1, 64}, {3, 1000}, {16, 2048}};
    qs = {{7, 4096}};
    nstress = 8;
    replays = 2;
    qreplays = multicast ? 2 : 0;
  }
  bool all_ok = true;
  bool stress_ok[4] = {true, true, true, true}, graph_ok[4] = {true, true, true, true},
       counters[4] = {true, true, true, true}, batch_ok[4] = {true, true, true, true},
       valid_ok = true;
  for (int W : Ws) {
    World w = make_world(W, M, timeout_ns, sms);
    g_world = &w;
    uint64_t seed = 1000 * W;
    for (int dt = 0; dt < 3; ++dt) {
      for (int fused = 0; fused < 2; ++fused) {
        int k = 0;
        for (const TH& th : shapes) {
          if (th.H % vec_elems(dt) != 0) continue;
          if (fused && th.H > nvc::cuda::max_fused_hidden(dt)) continue;
          if (size_t(th.T) * th.H * esize(dt) > M) continue;
          Shape sh{dt, th.T, th.H, fused == 1, (k++ % 2) == 1, false};
          all_ok &= run_case(w, sh, ++seed);
        }
        if (fused) {  // ranks with different residuals: per-rank results, same across strategies
          Shape sh{dt, 7, 4096, true, true, true};
          all_ok &= run_case(w, sh, ++seed);
        }
      }
    }
    {  // FP8 output: the cluster kernel's shapes (1 to 4 columns per lane) and one-block ones;
       // with --multicast the first and fourth in CUDA-graph replays too
      int qi = 0;
      for (const TH& th : qs) {
        for (int dt = 0; dt < 3; ++dt)
          if (size_t(th.T) * th.H * esize(dt) <= M / 8)
            all_ok &= quant_case(w, dt, th.T, th.H, ++seed, (qi % 3 == 0) ? qreplays : 0);
        ++qi;
      }
    }
    if (W == 1) {  // world 1: the row kernel against the one-block epilogue, bitwise
      const TH ls[] = {{1, 4096}, {7, 7168}, {64, 8192}, {300, 4096}, {33, 2560}, {513, 3072}};
      for (int dt = 0; dt < 3; ++dt)
        for (const TH& th : ls)
          for (int q = 0; q < 2; ++q)
            if (th.H / vec_elems(dt) <= 1024) all_ok &= local_rows_cross(w, dt, th.T, th.H, q, ++seed);
    }
    if (!tiny) all_ok &= weight_tail_cases(w, 4242 + W);  // with --multicast: every variant
    stress_ok[widx(W)] = stress(w, nstress, 77 + W);
    const bool inv_ok = tiny || batch_invariance(w, 555 + W);
    batch_ok[widx(W)] = inv_ok;
    graph_ok[widx(W)] = graph_test(w, replays, 99 + W);
    if (W == 2) valid_ok = validation_ok(w);
    counters[widx(W)] = counters_ok(w);
    all_ok &= stress_ok[widx(W)] && graph_ok[widx(W)] && counters[widx(W)] && valid_ok &&
              batch_ok[widx(W)];
    free_world(w);
    g_world = nullptr;
  }

  if (mc_real) {  // float inputs: the switch's own reduction order (rounding_close)
    g_int_inputs = false;
    World w = make_world(g_ngpu, M, timeout_ns, sms);
    g_world = &w;
    std::printf("\nrounding pass (float inputs, W=%d):\n", g_ngpu);
    uint64_t seed = 777;
    for (int dt = 0; dt < 3; ++dt)
      for (int fused = 0; fused < 2; ++fused)
        for (const TH& th : std::vector<TH>{{1, 4096}, {7, 4096}, {64, 8192}, {600, 4096}})
          all_ok &= run_case(w, Shape{dt, th.T, th.H, fused == 1, false, false}, ++seed);
    free_world(w);
    g_world = nullptr;
  }
  std::printf("\n W  variant     dtype  plain     fused\n");
  for (int W : Ws)
    for (int vi = 0; vi < g_nvar; ++vi)
      for (int dt = 0; dt < 3; ++dt) {
        const Tally& p = g_tab[widx(W)][vi][dt][0];
        const Tally& f = g_tab[widx(W)][vi][dt][1];
        std::printf("%2d  %-10s  %-5s  %3d/%-3d %s %3d/%-3d %s\n", W, vname(strat_of(vi), mc_of(vi)),
                    dtype_name(dt), p.pass, p.total, p.pass == p.total ? "ok  " : "FAIL", f.pass,
                    f.total, f.pass == f.total ? "ok" : "FAIL");
      }
  auto okf = [](const Tally& t) { return t.pass == t.total ? "ok" : "FAIL"; };
  for (int W : Ws) {
    const Tally& x = g_cross[widx(W)];
    const Tally& q = g_quant[widx(W)];
    const Tally& qr = g_quant_ref[widx(W)];
    std::printf("W=%d  one-shot == two-shot bitwise %d/%d %s | FP8 bytes %d/%d %s, vs f64 %d/%d %s | %d queued calls %s | graph replays %s | batch-invariant rows %s | counters %s\n",
                W, x.pass, x.total, okf(x), q.pass, q.total, okf(q), qr.pass, qr.total, okf(qr),
                nstress, stress_ok[widx(W)] ? "ok" : "FAIL", graph_ok[widx(W)] ? "ok" : "FAIL",
                tiny ? "skipped" : batch_ok[widx(W)] ? "ok" : "FAIL", counters[widx(W)] ? "ok" : "FAIL");
    if (multicast || mc_real) {
      const Tally& m1 = g_mc_cross[widx(W)][0];
      const Tally& m2 = g_mc_cross[widx(W)][1];
      const Tally& qg = g_quant_graph[widx(W)];
      std::printf("W=%d  multicast (%s) == unicast bitwise: one-shot %d/%d %s, two-shot %d/%d %s | FP8 graph replays %d/%d %s\n",
                  W, mc_real ? "real; two-shot float inputs: rounding_close" : "emulated", m1.pass, m1.total, okf(m1), m2.pass, m2.total, okf(m2), qg.pass, qg.total,
                  okf(qg));
    }
  }
  if (!multicast && !mc_real)
    std::printf("W=1  row kernel == one-block epilogue bitwise %d/%d %s\n", g_local_rows.pass,
                g_local_rows.total, g_local_rows.pass == g_local_rows.total ? "ok" : "FAIL");
  if (!tiny)
    std::printf("float32 weight / zero-padded widths (all W): %d/%d %s\n", g_wtail.pass,
                g_wtail.total, g_wtail.pass == g_wtail.total ? "ok" : "FAIL");
  std::printf("host validation %s\n", valid_ok ? "ok" : "FAIL");
  std::printf("RESULT: %s\n", all_ok ? "PASS" : "FAIL");
  return all_ok ? 0 : 1;
}
