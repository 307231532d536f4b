// Standalone test and timing of the CUDA ragged_dot / ragged_dot_swiglu (kernels/ragged_dot.cuh,
// cuda/ragged_dot.h), with no package build and no numpy: a float64 CPU reference of
// lax.ragged_dot's MoE semantics (rows of group g: [start_g, end_g), start/end the running sum of
// max(size, 0) clipped to M; rows past the last group are zero) computed here from the inputs
// copied back, never from the kernel's tiles.
//
// Build (from the repository root; the eight compile in parallel):
//   NV="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Icsrc"
//   $NV -c csrc/cuda/ragged_dot.cu ... (every csrc/cuda/ragged_dot*.cu: the 16-bit units and
//       the 8-bit weight units ragged_dot_w8_*.cu, which ragged_dot.cu dispatches to),
//   $NV -DRDOT_SWEEP_PART=0 -c tests/cuda_harness/ragged_dot_sweep.cu -o sweep0.o (and =1),
//   $NV -o build/rdot_h tests/cuda_harness/ragged_dot_harness.cu *.o   (scripts/gpu_check.sh rdot)
// Run:
//   build/rdot_h            correctness cases (PASS/FAIL lines; exit 1 on a failure): every
//                           edge case at small sizes, fully checked; each sweep variant and
//                           cluster size on one mid-size case; the decode shapes sampled
//   build/rdot_h --time     the table: us per call (CUDA-graph replays of 10 chained calls,
//                           median of 15) against the weight-read bound, decode shapes
//   build/rdot_h --sweep    every tile variant (cluster size 1) at the decode shapes, each
//                           result checked (sampled); a matrix of time / bound per variant and
//                           shape, then the best per shape
//   --no-variants           correctness without the sweep variants (compute-sanitizer runs)
//   --budget S              --sweep: start no variant after S seconds of sweeping
//   --variants SUBSTR       the cases: only the variants whose name contains SUBSTR
//   --skip A|B|*X           --sweep: leave out the variants named A, B and those whose name
//                           contains X
//   --seed N                random inputs from seed N (default 1)
//   --hbm GBS               the bound's bandwidth in GB/s (default: the device's peak,
//                           memory clock x bus width x 2, printed)
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <array>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/ragged_dot.h"
#include "ragged_dot_sweep.h"

using nvc::cuda::RaggedDotArgs;

std::vector<SweepVariant>& sweep_variants() {
  static std::vector<SweepVariant> v;
  return v;
}

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_),     \
                   __FILE__, __LINE__, #x);                                            \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

static int g_fail = 0;
static double g_budget_s = 0;
static const char* g_variants = "";  // --variants: only the variants whose name holds this
// --skip A|B|..: no variant named A, B, ...; an entry *X: none whose name contains X
static std::vector<std::string> g_skip;
static bool skipped(const char* name) {
  for (const std::string& x : g_skip) {
    if (x.size() > 1 && x[0] == '*' && std::strstr(name, x.c_str() + 1) != nullptr) return true;
    if (x == name) return true;
  }
  return false;
}  // --budget: seconds of sweep after which no variant starts
static uint64_t g_seed = 1;
// the bound's bandwidth, bytes/s: the device's peak (memory clock x bus width x 2, DDR), or
// --hbm GB/s
static double g_hbm = 0;
static double device_hbm() {
  int dev = 0, khz = 0, bits = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, dev));
  CK(cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, dev));
  return double(khz) * 1e3 * double(bits) / 8.0 * 2.0;
}

// ---- random device data (hash of the index: no host upload of gigabytes) ----
__device__ __forceinline__ float hash_uniform(uint64_t i, uint64_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;
  x ^= x >> 31; x *= 0xBF58476D1CE4E5B9ull; x ^= x >> 29; x *= 0x94D049BB133111EBull;
  x ^= x >> 32;
  return float(double(x & 0xFFFFFF) / double(0x1000000)) * 2.f - 1.f;
}
template <class T>
__global__ void fill_kernel(T* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = T(hash_uniform(i, seed) * scale);
}
template <class T> void fill(T* p, size_t n, uint64_t seed, float scale) {
  fill_kernel<T><<<1024, 256>>>(p, n, seed, scale);
  CK(cudaGetLastError());
}
__global__ void poison_kernel(uint32_t* p, size_t words) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = 0x7FC17FC1u;  // NaN in bf16, f16 (0x7FC1) and f32
}

// dst[s * k + j] = w[off[s] + j * n]: the weight column of sample s (2-byte elements)
__global__ void gather_cols(const uint16_t* w, const int64_t* off, int64_t k, int64_t n,
                            uint16_t* dst) {
  for (int64_t j = threadIdx.x; j < k; j += blockDim.x)
    dst[blockIdx.x * k + j] = w[off[blockIdx.x] + j * n];
}

static double to_d(__nv_bfloat16 v) { return double(__bfloat162float(v)); }
static double to_d(__half v) { return double(__half2float(v)); }
static double to_d(float v) { return double(v); }
template <class T> static std::vector<double> host_copy(const void* d, size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<double> o(n);
  for (size_t i = 0; i < n; ++i) o[i] = to_d(h[i]);
  return o;
}
static std::vector<double> host_copy_dt(int dt, const void* d, size_t n) {
  return dt == 0 ? host_copy<float>(d, n) : dt == 1 ? host_copy<__nv_bfloat16>(d, n)
                                                    : host_copy<__half>(d, n);
}
static size_t dt_size(int dt) { return dt == 0 ? 4 : 2; }

// Group row ranges as lax defines them.
static std::vector<int64_t> group_starts(const std::vector<int>& sizes, int64_t m) {
  std::vector<int64_t> s(sizes.size() + 1);
  int64_t run = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    s[g] = std::min(run, m);
    run += std::max(sizes[g], 0);
  }
  s[sizes.size()] = std::min(run, m);
  return s;
}

// ---- one problem on the device ----
struct Problem {
  int64_t m, k, n, g;
  int dt, odt;
  bool swiglu;
  std::vector<int> sizes;
  void *lhs = nullptr, *rhs = nullptr, *rhs2 = nullptr, *out = nullptr;
  int32_t* gs = nullptr;
  void* ws = nullptr;  // the split-K workspace (ragged_dot_workspace_bytes), garbage-filled
  int64_t ws_bytes = 0;
  bool own_weights = true;  // false: rhs / rhs2 given (shared by the timing shapes)
  void alloc(uint64_t seed) {
    const size_t e = dt_size(dt);
    CK(cudaMalloc(&lhs, std::max<size_t>(16, m * k * e)));
    if (own_weights) {
      CK(cudaMalloc(&rhs, g * k * n * e));
      if (swiglu) CK(cudaMalloc(&rhs2, g * k * n * e));
    }
    CK(cudaMalloc(&out, std::max<size_t>(16, m * n * dt_size(odt))));
    CK(cudaMalloc(&gs, g * 4));
    CK(cudaMemcpy(gs, sizes.data(), g * 4, cudaMemcpyHostToDevice));
    ws_bytes = nvc::cuda::ragged_dot_workspace_bytes(m, n, g, swiglu);
    if (ws_bytes > 0) {
      CK(cudaMalloc(&ws, size_t(ws_bytes)));
      CK(cudaMemset(ws, 0xA5, size_t(ws_bytes)));  // no contents may be relied on
    }
    const float ws = 1.f / std::sqrt(float(k));  // outputs of order 1
    auto f = [&](void* p, size_t cnt, uint64_t sd, float sc) {
      if (dt == 1) fill(static_cast<__nv_bfloat16*>(p), cnt, sd, sc);
      else fill(static_cast<__half*>(p), cnt, sd, sc);
    };
    f(lhs, m * k, seed * 3 + 1, 1.f);
    if (own_weights) {
      f(rhs, g * k * n, seed * 3 + 2, ws * 1.7f);
      if (swiglu) f(rhs2, g * k * n, seed * 3 + 3, ws * 1.7f);
    }
    CK(cudaDeviceSynchronize());
  }
  void free_all() {
    cudaFree(lhs); cudaFree(out); cudaFree(gs);
    if (ws) cudaFree(ws);
    if (own_weights) { cudaFree(rhs); if (rhs2) cudaFree(rhs2); }
  }
  RaggedDotArgs args() const {
    RaggedDotArgs a;
    a.lhs = lhs; a.rhs = rhs; a.rhs2 = rhs2; a.group_sizes = gs; a.out = out;
    a.workspace = ws; a.workspace_bytes = ws_bytes;
    a.m = m; a.k = k; a.n = n; a.g = g; a.dtype = dt; a.out_dtype = odt;
    return a;
  }
  int active() const {
    auto s = group_starts(sizes, m);
    int c = 0;
    for (int64_t i = 0; i < g; ++i) c += s[i + 1] > s[i];
    return c;
  }
  double bound_us() const {
    return double(active()) * k * n * dt_size(dt) * (swiglu ? 2 : 1) / g_hbm * 1e6;
  }
  void poison() {
    const size_t bytes = std::max<size_t>(16, m * n * dt_size(odt));
    poison_kernel<<<256, 256>>>(static_cast<uint32_t*>(out), bytes / 4);
    CK(cudaGetLastError());
  }
};

static double silu(double x) { return x / (1.0 + std::exp(-x)); }

// The whole float64 reference [m, n] (rows past the groups: 0), row by row.
static std::vector<double> reference_all(const Problem& p) {
  const auto starts = group_starts(p.sizes, p.m);
  const std::vector<double> lhs = host_copy_dt(p.dt, p.lhs, p.m * p.k);
  const std::vector<double> w1 = host_copy_dt(p.dt, p.rhs, p.g * p.k * p.n);
  std::vector<double> w2;
  if (p.swiglu) w2 = host_copy_dt(p.dt, p.rhs2, p.g * p.k * p.n);
  std::vector<double> ref(p.m * p.n, 0.0), a(p.n), b(p.n);
  for (int64_t g = 0; g < p.g; ++g)
    for (int64_t r = starts[g]; r < starts[g + 1]; ++r) {
      std::fill(a.begin(), a.end(), 0.0);
      std::fill(b.begin(), b.end(), 0.0);
      for (int64_t k = 0; k < p.k; ++k) {
        const double x = lhs[r * p.k + k];
        const double* w = &w1[(g * p.k + k) * p.n];
        for (int64_t c = 0; c < p.n; ++c) a[c] += x * w[c];
        if (p.swiglu) {
          const double* u = &w2[(g * p.k + k) * p.n];
          for (int64_t c = 0; c < p.n; ++c) b[c] += x * u[c];
        }
      }
      for (int64_t c = 0; c < p.n; ++c) ref[r * p.n + c] = p.swiglu ? silu(a[c]) * b[c] : a[c];
    }
  return ref;
}

static double tolerance(int odt) {
  // bf16 / f16 operands in float32 accumulation: the rounding of the result (bf16 2^-9
  // relative, f16 2^-12) dominates; float32 results are near 1e-6
  return odt == 0 ? 1e-5 : odt == 1 ? 8e-3 : 2e-3;
}

// The device result against the whole reference: every element written (no NaN from the
// poison), rows past the groups exactly 0, ||out - ref|| / ||ref|| within the dtype's rounding.
static bool compare_all(const Problem& p, const std::vector<double>& ref, const char* name) {
  const auto starts = group_starts(p.sizes, p.m);
  const std::vector<double> out = host_copy_dt(p.odt, p.out, p.m * p.n);
  const int64_t total = starts[p.g];
  double err2 = 0, ref2 = 0, maxrel = 0;
  int64_t bad_tail = 0, nan = 0;
  for (int64_t i = 0; i < p.m * p.n; ++i) {
    const double got = out[i];
    if (std::isnan(got)) { ++nan; continue; }
    if (i / p.n >= total) { if (got != 0.0) ++bad_tail; continue; }
    err2 += (got - ref[i]) * (got - ref[i]);
    ref2 += ref[i] * ref[i];
    maxrel = std::max(maxrel, std::fabs(got - ref[i]) / (std::fabs(ref[i]) + 1e-2));
  }
  const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  const bool ok = nan == 0 && bad_tail == 0 && rel < tolerance(p.odt);
  std::printf("%s %-58s rel %.2e max %.2e nan %lld tail!=0 %lld (all %lld)\n", ok ? "PASS" : "FAIL",
              name, rel, maxrel, (long long)nan, (long long)bad_tail, (long long)(p.m * p.n));
  if (!ok) ++g_fail;
  return ok;
}

// Float64 reference of `samples` random output elements (the weight columns they need gathered
// on the device), compared with the device result. Returns true when it passes.
static bool check(const Problem& p, const char* name, int samples = 512, bool quiet = false) {
  const auto starts = group_starts(p.sizes, p.m);
  const std::vector<double> lhs = host_copy_dt(p.dt, p.lhs, p.m * p.k);
  const std::vector<double> out = host_copy_dt(p.odt, p.out, p.m * p.n);
  std::vector<std::pair<int64_t, int64_t>> pts;
  std::mt19937_64 rng(g_seed * 77 + p.m);
  for (int i = 0; i < samples; ++i) pts.push_back({int64_t(rng() % p.m), int64_t(rng() % p.n)});
  // the weight columns of the sampled points, gathered on the device
  std::vector<int64_t> grp(pts.size(), -1);
  for (size_t i = 0; i < pts.size(); ++i)
    for (int64_t g = 0; g < p.g; ++g)
      if (pts[i].first >= starts[g] && pts[i].first < starts[g + 1]) grp[i] = g;
  std::vector<double> c1, c2;
  {
    std::vector<int64_t> off(pts.size());
    for (size_t i = 0; i < pts.size(); ++i)
      off[i] = (std::max<int64_t>(grp[i], 0) * p.k) * p.n + pts[i].second;
    int64_t* doff;
    void* dcol;
    CK(cudaMalloc(&doff, off.size() * 8));
    CK(cudaMalloc(&dcol, off.size() * p.k * 2));
    CK(cudaMemcpy(doff, off.data(), off.size() * 8, cudaMemcpyHostToDevice));
    auto gather = [&](const void* w, std::vector<double>& dst) {
      gather_cols<<<int(off.size()), 256>>>(static_cast<const uint16_t*>(w), doff, p.k, p.n,
                                            static_cast<uint16_t*>(dcol));
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      dst = host_copy_dt(p.dt, dcol, off.size() * p.k);
    };
    gather(p.rhs, c1);
    if (p.swiglu) gather(p.rhs2, c2);
    cudaFree(doff);
    cudaFree(dcol);
  }
  double err2 = 0, ref2 = 0, maxrel = 0;
  int64_t bad_tail = 0, nan = 0;
  for (size_t pi = 0; pi < pts.size(); ++pi) {
    const int64_t r = pts[pi].first, c = pts[pi].second, g = grp[pi];
    const double got = out[r * p.n + c];
    if (std::isnan(got)) { ++nan; continue; }
    if (g < 0) { if (got != 0.0) ++bad_tail; continue; }
    std::vector<double> col1(p.k), col2(p.swiglu ? p.k : 0);
    for (int64_t k = 0; k < p.k; ++k) {
      col1[k] = c1[pi * p.k + k];
      if (p.swiglu) col2[k] = c2[pi * p.k + k];
    }
    double a = 0, b = 0;
    for (int64_t k = 0; k < p.k; ++k) {
      a += lhs[r * p.k + k] * col1[k];
      if (p.swiglu) b += lhs[r * p.k + k] * col2[k];
    }
    const double ref = p.swiglu ? silu(a) * b : a;
    err2 += (got - ref) * (got - ref);
    ref2 += ref * ref;
    maxrel = std::max(maxrel, std::fabs(got - ref) / (std::fabs(ref) + 1e-2));
  }
  const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  const bool ok = nan == 0 && bad_tail == 0 && rel < tolerance(p.odt);
  if (!ok || !quiet)
    std::printf("%s %-58s rel %.2e max %.2e nan %lld tail!=0 %lld (%zu pts)\n", ok ? "PASS" : "FAIL",
                name, rel, maxrel, (long long)nan, (long long)bad_tail, pts.size());
  if (!ok) ++g_fail;
  return ok;
}

using Launch = std::function<cudaError_t(const RaggedDotArgs&, cudaStream_t)>;

static Launch production(bool swiglu) {
  return [swiglu](const RaggedDotArgs& a, cudaStream_t s) {
    return swiglu ? nvc::cuda::ragged_dot_swiglu(a, s) : nvc::cuda::ragged_dot(a, s);
  };
}
static Launch variant(int v, int cs) {
  return [v, cs](const RaggedDotArgs& a, cudaStream_t s) {
    return sweep_variants()[size_t(v)].launch(a, cs, s);
  };
}
static int variant_count() { return int(sweep_variants().size()); }
static const char* variant_name(int v) { return sweep_variants()[size_t(v)].name; }
static bool variant_swiglu(int v) { return sweep_variants()[size_t(v)].swiglu; }
// the parts register in link order: sorted by part (stable: each part's own order), so that
// every run lists them alike
static void sort_variants() {
  std::stable_sort(sweep_variants().begin(), sweep_variants().end(),
                   [](const SweepVariant& a, const SweepVariant& b) { return a.part < b.part; });
}

// Watchdog: a measurement that does not finish within its alarm (a hung kernel) ends the
// process with the name of what it was measuring (what was printed before stays printed).
static char g_doing[160] = "";
static void on_alarm(int) {
  const char msg[] = "HANG (watchdog): no result within the alarm while measuring: ";
  (void)!write(1, msg, sizeof msg - 1);
  (void)!write(1, g_doing, std::strlen(g_doing));
  (void)!write(1, "\n", 1);
  _exit(3);
}
static double watched(const char* what, const std::function<double()>& f, int seconds = 20) {
  std::snprintf(g_doing, sizeof g_doing, "%s", what);
  alarm(unsigned(seconds));
  const double r = f();
  alarm(0);
  return r;
}

// Runs `launch` on `p` (poisoned first), checks, and checks that a second run gives the same bits.
static void run_case(Problem& p, const std::string& name, const Launch& launch,
                     const std::vector<double>& ref) {
  p.poison();
  CK(cudaDeviceSynchronize());
  std::snprintf(g_doing, sizeof g_doing, "case %s", name.c_str());
  alarm(20);
  cudaError_t e = launch(p.args(), 0);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  alarm(0);
  if (e != cudaSuccess) {  // a refused launch fails this case only
    std::printf("FAIL %-58s launch: %s\n", name.c_str(), cudaGetErrorString(e));
    cudaGetLastError();
    ++g_fail;
    return;
  }
  if (!compare_all(p, ref, name.c_str())) return;
  const size_t bytes = p.m * p.n * dt_size(p.odt);
  std::vector<char> a(bytes), b(bytes);
  CK(cudaMemcpy(a.data(), p.out, bytes, cudaMemcpyDeviceToHost));
  p.poison();
  CK(launch(p.args(), 0));
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(b.data(), p.out, bytes, cudaMemcpyDeviceToHost));
  if (a != b) {
    std::printf("FAIL %-58s second run differs (not deterministic)\n", name.c_str());
    ++g_fail;
  }
}

// Top-k routing of `tokens` tokens over `e` experts (distinct per token), as group sizes.
static std::vector<int> routed_sizes(int tokens, int e, int top_k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> sizes(e, 0), perm(e);
  for (int t = 0; t < tokens; ++t) {
    for (int i = 0; i < e; ++i) perm[i] = i;
    for (int j = 0; j < top_k; ++j) {
      const int x = j + int(rng() % (e - j));
      std::swap(perm[j], perm[x]);
      ++sizes[perm[j]];
    }
  }
  return sizes;
}

// w1 / w2: weights to share (not owned, not filled), or nullptr (allocated and filled here).
static Problem make(int64_t m, int64_t k, int64_t n, std::vector<int> sizes, int dt, int odt,
                    bool swiglu, void* w1 = nullptr, void* w2 = nullptr) {
  Problem p;
  p.m = m; p.k = k; p.n = n; p.g = int64_t(sizes.size()); p.dt = dt; p.odt = odt;
  p.swiglu = swiglu; p.sizes = std::move(sizes);
  if (w1 != nullptr) { p.own_weights = false; p.rhs = w1; p.rhs2 = w2; }
  p.alloc(g_seed * 1000 + m * 7 + k + n);
  return p;
}

static void correctness(bool variants) {
  struct C {
    const char* name;
    int64_t m, k, n;
    std::vector<int> sizes;
    int dt, odt;
    bool sw;
  };
  std::mt19937_64 rng(g_seed);
  std::vector<int> rnd8(8);
  for (int& s : rnd8) s = int(rng() % 9);  // 0..8 rows, some groups empty
  int sum8 = 0;
  for (int s : rnd8) sum8 += s;
  const std::vector<C> cases = {
      {"bf16 random groups (empty ones), tail rows", sum8 + 5, 256, 256, rnd8, 1, 1, false},
      {"bf16 one group", 40, 128, 128, {40}, 1, 1, false},
      {"bf16 all rows in one group of 6", 24, 192, 136, {0, 0, 24, 0, 0, 0}, 1, 1, false},
      {"bf16 sum > M (clipped)", 20, 128, 128, {8, 9, 10}, 1, 1, false},
      {"bf16 all groups empty", 12, 64, 64, {0, 0, 0}, 1, 1, false},
      {"bf16 K 72, N 200 (tails)", 30, 72, 200, {7, 0, 13, 10}, 1, 1, false},
      {"bf16 K 8, N 8", 9, 8, 8, {4, 5}, 1, 1, false},
      {"bf16 150 rows in a group (chunks)", 170, 256, 128, {150, 3, 17}, 1, 1, false},
      {"bf16 -> f32", sum8 + 3, 320, 264, rnd8, 1, 0, false},
      {"f16", sum8, 256, 192, rnd8, 2, 2, false},
      {"f16 -> f32", 50, 512, 128, {20, 0, 30}, 2, 0, false},
      {"swiglu bf16", sum8 + 2, 256, 256, rnd8, 1, 1, true},
      {"swiglu f16 -> f32, chunks", 100, 128, 136, {70, 0, 30}, 2, 0, true},
      {"bf16 m 0", 0, 64, 64, {0, 0}, 1, 1, false},
      {"bf16 K 7168 N 256, 16 groups", 64, 7168, 256, routed_sizes(8, 16, 8, g_seed), 1, 1, false},
  };
  for (const C& c : cases) {
    Problem p = make(c.m, c.k, c.n, c.sizes, c.dt, c.odt, c.sw);
    if (c.m == 0) {
      CK(production(c.sw)(p.args(), 0));
      CK(cudaDeviceSynchronize());
      std::printf("PASS %-58s (launches nothing)\n", c.name);
    } else {
      run_case(p, c.name, production(c.sw), reference_all(p));
    }
    p.free_all();
  }
  // the split-K tiles without a workspace (no split) and with one too small for two planes
  for (int64_t wsb : {int64_t(0), int64_t(4096)}) {
    Problem p = make(64, 1088, 392, {7, 0, 9, 8, 6, 10, 12, 8}, 1, 1, false);  // R 16 tiles
    if (wsb == 0) { cudaFree(p.ws); p.ws = nullptr; }
    p.ws_bytes = wsb;
    run_case(p, wsb == 0 ? "bf16 no workspace (no split)" : "bf16 workspace of 4 KB (no split)",
             production(false), reference_all(p));
    p.free_all();
  }
  // every sweep variant and cluster size on one mid-size case (and the edge tails)
  Problem vp = make(150, 1088, 392, {30, 0, 41, 9, 0, 60, 5}, 1, 1, false);
  Problem vs = make(150, 1088, 392, {30, 0, 41, 9, 0, 60, 5}, 1, 1, true);
  const std::vector<double> vref = reference_all(vp), sref = reference_all(vs);
  for (int v = 0; v < (variants ? variant_count() : 0); ++v) {
    if (std::strstr(variant_name(v), g_variants) == nullptr) continue;
    const bool sw = variant_swiglu(v);
    for (int cs : {1, 2, 4, 8})
      run_case(sw ? vs : vp,
               std::string("variant ") + variant_name(v) + " cluster " + std::to_string(cs),
               variant(v, cs), sw ? sref : vref);
  }
  vp.free_all();
  vs.free_all();
}

// Median us per call of `launch` on p: a CUDA graph of `chain` calls, replayed `reps` times.
static double time_graph(const Problem& p, const Launch& launch, int chain = 10, int reps = 15) {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // first launch outside the capture (per-device caches filled); a refused one: -1
  if (launch(p.args(), s) != cudaSuccess || cudaStreamSynchronize(s) != cudaSuccess) {
    cudaGetLastError();
    CK(cudaStreamDestroy(s));
    return -1.0;
  }
  cudaGraph_t graph;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < chain; ++i) CK(launch(p.args(), s));
  CK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaGraphLaunch(exec, s));
  CK(cudaStreamSynchronize(s));
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(e0, s));
    CK(cudaGraphLaunch(exec, s));
    CK(cudaEventRecord(e1, s));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  CK(cudaStreamDestroy(s));
  return double(t[t.size() / 2]) * 1000.0 / chain;
}

static double copy_bandwidth() {  // device-to-device copy, bytes read + written per second
  const size_t bytes = size_t(2) << 30;
  void *a, *b;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> t;
  for (int r = 0; r < 6; ++r) {
    CK(cudaEventRecord(e0));
    CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (t[t.size() / 2] * 1e-3);
}

struct Shape {
  int e, tokens;
};
static const Shape kShapes[] = {{32, 8}, {32, 32}, {32, 128}, {256, 8}, {256, 32}, {256, 128}};
constexpr int kHidden = 7168, kF = 2048, kTopK = 8;

// The decode shapes: per (experts, tokens) the gate-shaped product [M, 7168] x [E, 7168, 2048],
// the down-shaped one [M, 2048] x [E, 2048, 7168], swiglu, and the expert block. The weights of
// one expert count are shared by its token counts. --sweep: then every variant x cluster size
// (1, 2) on the gate and down products (swiglu tiles: the swiglu product) of every shape, and
// the best per shape and product last.
static void timing(bool sweep) {
  std::printf("copy bandwidth (D2D, read + write): %.0f GB/s\n", copy_bandwidth() / 1e9);
  struct Case {
    Shape sh;
    int64_t m;
    Problem gate, down, sw;
    double tg, td, ts;
  };
  std::vector<Case> cases;
  std::vector<void*> weights;
  std::printf("%-5s %-4s %-6s %-30s %9s %9s %7s\n", "E", "T", "M", "op", "us", "bound", "x");
  for (int e : {32, 256}) {
    void *wg, *wu, *wd;
    const size_t bytes = size_t(e) * kHidden * kF * 2;
    CK(cudaMalloc(&wg, bytes));
    CK(cudaMalloc(&wu, bytes));
    CK(cudaMalloc(&wd, bytes));
    const float sc = 1.7f / std::sqrt(float(kHidden)), sd = 1.7f / std::sqrt(float(kF));
    fill(static_cast<__nv_bfloat16*>(wg), bytes / 2, g_seed * 11 + e, sc);
    fill(static_cast<__nv_bfloat16*>(wu), bytes / 2, g_seed * 13 + e, sc);
    fill(static_cast<__nv_bfloat16*>(wd), bytes / 2, g_seed * 17 + e, sd);
    CK(cudaDeviceSynchronize());
    weights.insert(weights.end(), {wg, wu, wd});
    for (const Shape& sh : kShapes) {
      if (sh.e != e) continue;
      const int64_t m = int64_t(sh.tokens) * kTopK;
      auto sizes = routed_sizes(sh.tokens, sh.e, kTopK, g_seed + sh.e * 1000 + sh.tokens);
      Case c{sh, m, make(m, kHidden, kF, sizes, 1, 1, false, wg),
             make(m, kF, kHidden, sizes, 1, 1, false, wd),
             make(m, kHidden, kF, sizes, 1, 1, true, wg, wu), 0, 0, 0};
      const std::string tag = std::to_string(e) + " experts x " + std::to_string(sh.tokens) +
                              " tokens";
      for (Problem* p : {&c.gate, &c.down, &c.sw}) {
        p->poison();
        CK(production(p->swiglu)(p->args(), 0));
      }
      CK(cudaDeviceSynchronize());
      check(c.gate, (tag + " gate sampled").c_str());
      check(c.down, (tag + " down sampled").c_str(), 256);
      check(c.sw, (tag + " swiglu sampled").c_str(), 256);
      auto row = [&](const char* op, double us, double bound) {
        std::printf("%-5d %-4d %-6lld %-30s %9.1f %9.1f %7.2f\n", e, sh.tokens, (long long)m, op,
                    us, bound, us / bound);
      };
      c.tg = watched("production gate", [&] { return time_graph(c.gate, production(false)); });
      row("ragged_dot gate [7168->2048]", c.tg, c.gate.bound_us());
      c.td = watched("production down", [&] { return time_graph(c.down, production(false)); });
      row("ragged_dot down [2048->7168]", c.td, c.down.bound_us());
      c.ts = watched("production swiglu", [&] { return time_graph(c.sw, production(true)); });
      const double ts = c.ts;
      row("ragged_dot_swiglu gate+up", ts, c.sw.bound_us());
      const double bb = 2 * c.gate.bound_us() + c.down.bound_us();
      row("block: 3 x ragged_dot", 2 * c.tg + c.td, bb);
      row("block: swiglu + ragged_dot", ts + c.td, bb);
      std::fflush(stdout);
      cases.push_back(std::move(c));
    }
  }
  if (sweep) {
    // t[v][case][0 gate / 1 down / 2 swiglu] (us; -1 refused or not timed): plain tiles time the
    // gate and down products, "sw" tiles the swiglu one; each result is then checked (sampled,
    // float64) after the output was poisoned, so a variant that skips elements fails
    const int nv = variant_count();
    std::vector<std::vector<std::array<double, 3>>> t(
        size_t(nv), std::vector<std::array<double, 3>>(cases.size(), {-1.0, -1.0, -1.0}));
    auto bound = [&](size_t ci, int o) {
      const Case& c = cases[ci];
      return (o == 0 ? c.gate : o == 1 ? c.down : c.sw).bound_us();
    };
    auto cell = [](double us, double bd) {
      char b[16];
      if (us < 0) std::snprintf(b, sizeof b, "%7s", "-");
      else std::snprintf(b, sizeof b, "%7.2f", us / bd);
      return std::string(b);
    };
    // the matrix: x the bound per variant and shape; columns E x T
    std::string head;
    for (const Case& c : cases) {
      char b[16];
      std::snprintf(b, sizeof b, "%7s", (std::to_string(c.sh.e) + "x" + std::to_string(c.sh.tokens)).c_str());
      head += b;
    }
    auto prow = [&](const char* tag, const char* name, const char* op, int o, const std::function<double(size_t)>& us) {
      std::string r;
      for (size_t ci = 0; ci < cases.size(); ++ci) r += cell(us(ci), bound(ci, o));
      std::printf("%s%-34s %-6s%s\n", tag, name, op, r.c_str());
    };
    // each variant's row as soon as it is timed ("mrow"; a hang later keeps them), the whole
    // matrix again at the end
    std::printf("mrow %-34s %-6s%s\n", "variant", "op", head.c_str());
    const auto t_start = std::chrono::steady_clock::now();
    for (int v = 0; v < nv; ++v) {
      const bool sw = variant_swiglu(v);
      const double spent =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
      if (g_budget_s > 0 && spent > g_budget_s) {
        std::printf("  sweep: budget of %.0f s spent; %s and later variants not timed\n",
                    g_budget_s, variant_name(v));
        break;
      }
      if (skipped(variant_name(v))) {
        std::printf("  sweep %s skipped (--skip)\n", variant_name(v));
        continue;
      }
      for (size_t ci = 0; ci < cases.size(); ++ci)
        for (int o = sw ? 2 : 0; o < (sw ? 3 : 2); ++o) {
          Case& c = cases[ci];
          Problem& p = o == 0 ? c.gate : o == 1 ? c.down : c.sw;
          char what[160];
          std::snprintf(what, sizeof what, "%s E%d T%d %s", o == 0 ? "gate" : o == 1 ? "down" : "swiglu",
                        c.sh.e, c.sh.tokens, variant_name(v));
          p.poison();
          const double us = watched(
              what, [&] { return time_graph(p, variant(v, sweep_variants()[size_t(v)].cs), 5, 7); });
          if (us < 0) {
            std::printf("  sweep %s refused\n", what);
            continue;
          }
          if (!check(p, what, 96, /*quiet=*/true)) continue;
          t[size_t(v)][ci][size_t(o)] = us;
          std::printf("  sweep %-52s %9.1f us %6.2fx\n", what, us, us / p.bound_us());
        }
      for (int o = sw ? 2 : 0; o < (sw ? 3 : 2); ++o)
        prow("mrow ", variant_name(v), o == 0 ? "gate" : o == 1 ? "down" : "swiglu", o,
             [&](size_t ci) { return t[size_t(v)][ci][size_t(o)]; });
      std::fflush(stdout);
    }
    std::printf("sweep matrix (time / weight-read bound; cluster size 1 unless named; '-' refused "
                "or wrong):\n");
    std::printf("%-34s %-6s%s\n", "variant", "op", head.c_str());
    prow("", "production", "gate", 0, [&](size_t ci) { return cases[ci].tg; });
    prow("", "production", "down", 1, [&](size_t ci) { return cases[ci].td; });
    prow("", "production", "swiglu", 2, [&](size_t ci) { return cases[ci].ts; });
    for (int v = 0; v < nv; ++v)
      for (int o = variant_swiglu(v) ? 2 : 0; o < (variant_swiglu(v) ? 3 : 2); ++o)
        prow("", variant_name(v), o == 0 ? "gate" : o == 1 ? "down" : "swiglu", o,
             [&](size_t ci) { return t[size_t(v)][ci][size_t(o)]; });
    // best per shape and product, and the two expert blocks from the best tiles
    std::printf("best per shape (x the bound; production in brackets):\n");
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      const Case& c = cases[ci];
      double bt[3] = {1e30, 1e30, 1e30};
      int bv[3] = {-1, -1, -1};
      for (int v = 0; v < nv; ++v)
        for (int o = 0; o < 3; ++o)
          if (t[size_t(v)][ci][size_t(o)] > 0 && t[size_t(v)][ci][size_t(o)] < bt[o]) {
            bt[o] = t[size_t(v)][ci][size_t(o)];
            bv[o] = v;
          }
      const double prod[3] = {c.tg, c.td, c.ts};
      for (int o = 0; o < 3; ++o) {
        if (bv[o] < 0 || prod[o] < bt[o]) { bt[o] = prod[o]; }
        std::printf("best E%-3d T%-3d %-6s %-34s %5.2fx (%5.2fx)\n", c.sh.e, c.sh.tokens,
                    o == 0 ? "gate" : o == 1 ? "down" : "swiglu",
                    bv[o] >= 0 && bt[o] < prod[o] ? variant_name(bv[o]) : "production",
                    bt[o] / bound(ci, o), prod[o] / bound(ci, o));
      }
      const double bb = 2 * bound(ci, 0) + bound(ci, 1);
      std::printf("best E%-3d T%-3d blocks: 3 x ragged_dot %5.2fx (%5.2fx), swiglu + down %5.2fx (%5.2fx)\n",
                  c.sh.e, c.sh.tokens, (2 * bt[0] + bt[1]) / bb, (2 * c.tg + c.td) / bb,
                  (bt[2] + bt[1]) / bb, (c.ts + c.td) / bb);
    }
  }
  for (Case& c : cases) {
    c.gate.free_all();
    c.down.free_all();
    c.sw.free_all();
  }
  for (void* w : weights) cudaFree(w);
}

int main(int argc, char** argv) {
  bool time = false, sweep = false, variants = true;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--time")) time = true;
    else if (!std::strcmp(argv[i], "--sweep")) time = sweep = true;
    else if (!std::strcmp(argv[i], "--no-variants")) variants = false;
    else if (!std::strcmp(argv[i], "--budget") && i + 1 < argc) g_budget_s = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--variants") && i + 1 < argc) g_variants = argv[++i];
    else if (!std::strcmp(argv[i], "--skip") && i + 1 < argc) {
      std::string l = argv[++i];
      for (size_t a = 0, b; a <= l.size(); a = b + 1) {
        b = l.find('|', a);
        if (b == std::string::npos) b = l.size();
        g_skip.push_back(l.substr(a, b - a));
      }
    }
    else if (!std::strcmp(argv[i], "--seed") && i + 1 < argc) g_seed = std::strtoull(argv[++i], nullptr, 10);
    else if (!std::strcmp(argv[i], "--hbm") && i + 1 < argc) g_hbm = std::atof(argv[++i]) * 1e9;
    else { std::fprintf(stderr, "usage: %s [--time|--sweep] [--no-variants] [--variants SUBSTR] [--skip A|B] [--budget S] [--seed N] [--hbm GB/s]\n", argv[0]); return 2; }
  }
  if (g_hbm <= 0) g_hbm = device_hbm();
  std::printf("bound bandwidth %.0f GB/s (%s)\n", g_hbm / 1e9,
              g_hbm == device_hbm() ? "device peak: memory clock x bus width x 2" : "--hbm");
  sort_variants();
  std::printf("seed %llu, %d sweep variants\n", (unsigned long long)g_seed, variant_count());
  std::fflush(stdout);
  std::signal(SIGALRM, on_alarm);
  CK(nvc::cuda::ragged_dot_load_kernels());
  if (time) timing(sweep);
  else correctness(variants);
  if (g_fail) std::printf("FAIL: %d failure(s)\n", g_fail);
  else std::printf("PASS: 0 failure(s)\n");
  return g_fail ? 1 : 0;
}
