// Standalone test and timing of the CUDA ragged_dot / ragged_dot_swiglu with 8-bit weights
// (cuda/ragged_dot.h RaggedDotArgs::w_dtype, kernels/ragged_dot.cuh "8-bit weights"), with no
// package build: a float64 CPU reference of the spec's semantics
//   out[r, n] = sum_k lhs[r, k] * float(w[g(r), k, n]) * s(g, k, n)   (rows past the groups: 0)
// s = 1 (scale_mode 0), scale[g, n] (1), scale[g, k / 128, n / 128] (2); swiglu: silu(gate) * up,
// each with its own scale. The reference is computed here from the inputs made on the host.
//
// Build (from the repository root; the nine units compile in parallel):
//   NV="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Icsrc"
//   $NV -c csrc/cuda/ragged_dot.cu (and ragged_dot_{bf16,f16,swiglu_bf16,swiglu_f16}.cu,
//       ragged_dot_w8_{bf16,f16}_{i8,e4m3}.cu)
//   $NV -o build/rdot_w8 tests/cuda_harness/ragged_dot_w8_harness.cu *.o
// Run:
//   build/rdot_w8            correctness (PASS/FAIL lines, exit 1 on a failure): every scale
//                            mode x lhs dtype x weight dtype x out dtype x form on small shapes
//                            with empty / negative groups, one group with all rows, M not a
//                            multiple of the tile, sizes past M, a decode shape with split-K,
//                            more items than blocks at both row tiles (every row-tile count);
//                            the refusals of ragged_dot_check
//   build/rdot_w8 --quick    a few of those cases (for compute-sanitizer)
//   build/rdot_w8 --time     decode shapes (hidden 7168, F 2048, top-8; 32 / 256 experts x 8 /
//                            32 / 128 tokens): us per call against the 8-bit bound (weight
//                            + scale bytes of the groups with rows / bandwidth), beside the
//                            16-bit kernel and its bound
//   --hbm GBS                the bound's bandwidth (default: the device's peak, memory clock x
//                            bus width x 2, printed)
// A/B of the MMA loops (mma.sync against wgmma with register A, -DNVC_W8_R64_WG=1 / 2 on the
// four 8-bit units): tests/cuda_harness/run_w8_ab.sh builds and runs all of the above per variant.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "cuda/ragged_dot.h"

using nvc::cuda::RaggedDotArgs;

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_),     \
                   __FILE__, __LINE__, #x);                                            \
      std::exit(2);                                                                    \
    }                                                                                  \
  } while (0)

static int g_fail = 0, g_pass = 0;
static double g_hbm = 0;

static double device_hbm() {
  int dev = 0, khz = 0, bits = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, dev));
  CK(cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, dev));
  return double(khz) * 1e3 * double(bits) / 8.0 * 2.0;
}

// ---- host values ----
static uint16_t to16(int dt, float v) {
  if (dt == 1) {
    __nv_bfloat16 b = __float2bfloat16_rn(v);
    return *reinterpret_cast<uint16_t*>(&b);
  }
  __half h = __float2half_rn(v);
  return *reinterpret_cast<uint16_t*>(&h);
}
static double from16(int dt, uint16_t u) {
  if (dt == 1) return double(__bfloat162float(*reinterpret_cast<__nv_bfloat16*>(&u)));
  return double(__half2float(*reinterpret_cast<__half*>(&u)));
}
// wd: nvc::cuda::kWInt8 or kWE4M3
static uint8_t to8(int wd, float v) {
  if (wd == nvc::cuda::kWInt8) {
    const float r = std::nearbyint(std::max(-127.f, std::min(127.f, v)));
    return uint8_t(int8_t(r));
  }
  __nv_fp8_e4m3 f(v);
  return *reinterpret_cast<uint8_t*>(&f);
}
static double from8(int wd, uint8_t u) {
  if (wd == nvc::cuda::kWInt8) return double(int8_t(u));
  __nv_fp8_e4m3 f;
  *reinterpret_cast<uint8_t*>(&f) = u;
  return double(float(f));
}

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

static double silu(double x) { return x / (1.0 + std::exp(-x)); }

struct Case {
  int64_t m, k, n;
  std::vector<int> sizes;
  int dt, wd, mode, odt;
  bool swiglu;
};

static std::string name_of(const Case& c, const char* tag) {
  char b[200];
  std::snprintf(b, sizeof b, "%s m%lld k%lld n%lld g%zu %s x %s mode %d out %s %s", tag,
                (long long)c.m, (long long)c.k, (long long)c.n, c.sizes.size(),
                c.dt == 1 ? "bf16" : "f16", c.wd == nvc::cuda::kWInt8 ? "int8" : "e4m3", c.mode,
                c.odt == 0 ? "f32" : c.dt == 1 ? "bf16" : "f16", c.swiglu ? "swiglu" : "plain");
  return b;
}

// One case: host inputs, device run (outputs poisoned with NaN first, the workspace with
// garbage), float64 reference, ||out - ref|| / ||ref||, every tail row exactly 0, no NaN.
static void run_case(const Case& c, uint64_t seed, const char* tag) {
  const int64_t g = int64_t(c.sizes.size()), kb = (c.k + 127) / 128, nb = (c.n + 127) / 128;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f), su(0.5f, 1.5f);
  const int nw = c.swiglu ? 2 : 1;
  // lhs of order 1, or 1/127 where nothing scales int8 weights down (scale_mode 0): a product
  // of unscaled int8 weights overflows f16 (swiglu: ~1e6), which the kernel then rightly
  // rounds to inf
  const float lmag = c.mode != 0 ? 1.f : c.wd == nvc::cuda::kWInt8 ? 1.f / 127.f : 1.f / 64.f;
  std::vector<uint16_t> lhs(size_t(c.m * c.k));
  for (auto& x : lhs) x = to16(c.dt, u(rng) * lmag);
  // weights: int8 over the full range; e4m3 of order 1 (scaled below), and one in eight any
  // byte but NaN (every code: subnormals, -0, up to +-448; the in-register conversion's edges)
  std::vector<std::vector<uint8_t>> w(nw, std::vector<uint8_t>(size_t(g * c.k * c.n)));
  std::uniform_int_distribution<int> byte(0, 255), eighth(0, 7);
  for (auto& v : w)
    for (auto& x : v) {
      x = to8(c.wd, c.wd == nvc::cuda::kWInt8 ? u(rng) * 127.f : u(rng) * 2.f);
      if (c.wd != nvc::cuda::kWInt8 && eighth(rng) == 0) {
        const int b = byte(rng);
        if ((b & 0x7f) != 0x7f) x = uint8_t(b);
      }
    }
  // scales: outputs of order 1
  const double wmag = c.wd == nvc::cuda::kWInt8 ? 127.0 : 1.0;
  const float base = float(1.0 / (wmag * std::sqrt(double(c.k))));
  const size_t ns = c.mode == 0 ? 1 : c.mode == 1 ? size_t(g * c.n) : size_t(g * kb * nb);
  std::vector<std::vector<float>> sc(nw, std::vector<float>(ns));
  for (auto& v : sc)
    for (auto& x : v) x = c.mode == 0 ? 123.f : base * su(rng);  // mode 0: ignored
  const size_t osz = c.odt == 0 ? 4 : 2;
  void *dl, *dw[2] = {nullptr, nullptr}, *dout;
  float* ds[2] = {nullptr, nullptr};
  int32_t* dgs;
  CK(cudaMalloc(&dl, std::max<size_t>(16, lhs.size() * 2)));
  CK(cudaMemcpy(dl, lhs.data(), lhs.size() * 2, cudaMemcpyHostToDevice));
  for (int i = 0; i < nw; ++i) {
    CK(cudaMalloc(&dw[i], w[i].size()));
    CK(cudaMemcpy(dw[i], w[i].data(), w[i].size(), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&ds[i], ns * 4));
    CK(cudaMemcpy(ds[i], sc[i].data(), ns * 4, cudaMemcpyHostToDevice));
  }
  CK(cudaMalloc(&dout, std::max<size_t>(16, size_t(c.m * c.n) * osz)));
  CK(cudaMemset(dout, 0xFF, std::max<size_t>(16, size_t(c.m * c.n) * osz)));  // NaN
  CK(cudaMalloc(&dgs, g * 4));
  CK(cudaMemcpy(dgs, c.sizes.data(), g * 4, cudaMemcpyHostToDevice));
  const int64_t wsb = nvc::cuda::ragged_dot_workspace_bytes(c.m, c.n, g, c.swiglu);
  void* dws = nullptr;
  if (wsb > 0) {
    CK(cudaMalloc(&dws, size_t(wsb)));
    CK(cudaMemset(dws, 0xA5, size_t(wsb)));
  }
  RaggedDotArgs a;
  a.lhs = dl; a.rhs = dw[0]; a.rhs2 = dw[1]; a.group_sizes = dgs; a.out = dout;
  a.m = c.m; a.k = c.k; a.n = c.n; a.g = g; a.dtype = c.dt; a.out_dtype = c.odt;
  a.workspace = dws; a.workspace_bytes = wsb;
  a.w_dtype = c.wd; a.scale = ds[0]; a.scale2 = ds[1]; a.scale_mode = c.mode;
  const char* why = nvc::cuda::ragged_dot_check(a, c.swiglu);
  if (why != nullptr) {
    std::printf("FAIL %s: refused: %s\n", name_of(c, tag).c_str(), why);
    ++g_fail;
    return;
  }
  CK(c.swiglu ? nvc::cuda::ragged_dot_swiglu(a, 0) : nvc::cuda::ragged_dot(a, 0));
  CK(cudaDeviceSynchronize());
  std::vector<double> out(size_t(c.m * c.n));
  {
    std::vector<uint8_t> raw(size_t(c.m * c.n) * osz);
    CK(cudaMemcpy(raw.data(), dout, raw.size(), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = c.odt == 0 ? double(reinterpret_cast<float*>(raw.data())[i])
                          : from16(c.dt, reinterpret_cast<uint16_t*>(raw.data())[i]);
  }
  // the reference
  const auto st = group_starts(c.sizes, c.m);
  std::vector<std::vector<double>> wf(nw, std::vector<double>(size_t(g * c.k * c.n)));
  for (int i = 0; i < nw; ++i)
    for (int64_t gg = 0; gg < g; ++gg)
      for (int64_t k = 0; k < c.k; ++k)
        for (int64_t n = 0; n < c.n; ++n) {
          const size_t x = size_t((gg * c.k + k) * c.n + n);
          const double s = c.mode == 0   ? 1.0
                           : c.mode == 1 ? double(sc[i][size_t(gg * c.n + n)])
                                         : double(sc[i][size_t((gg * kb + k / 128) * nb + n / 128)]);
          wf[i][x] = from8(c.wd, w[i][x]) * s;
        }
  double err2 = 0, ref2 = 0, worst = -1, wgot = 0, wref = 0;
  int64_t nan = 0, tail = 0, wr = -1, wn = -1;
  std::vector<double> acc(size_t(nw * c.n));
  for (int64_t gg = 0; gg < g; ++gg)
    for (int64_t r = st[gg]; r < st[gg + 1]; ++r) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t k = 0; k < c.k; ++k) {
        const double x = from16(c.dt, lhs[size_t(r * c.k + k)]);
        for (int i = 0; i < nw; ++i) {
          const double* wr = &wf[i][size_t((gg * c.k + k) * c.n)];
          double* ar = &acc[size_t(i * c.n)];
          for (int64_t n = 0; n < c.n; ++n) ar[n] += x * wr[n];
        }
      }
      for (int64_t n = 0; n < c.n; ++n) {
        const double ref = c.swiglu ? silu(acc[size_t(n)]) * acc[size_t(c.n + n)] : acc[size_t(n)];
        const double got = out[size_t(r * c.n + n)];
        if (std::isnan(got)) { ++nan; continue; }
        err2 += (got - ref) * (got - ref);
        ref2 += ref * ref;
        if (std::fabs(got - ref) > worst) {
          worst = std::fabs(got - ref); wgot = got; wref = ref; wr = r; wn = n;
        }
      }
    }
  for (int64_t r = st[g]; r < c.m; ++r)
    for (int64_t n = 0; n < c.n; ++n) {
      const double got = out[size_t(r * c.n + n)];
      if (std::isnan(got)) ++nan;
      else if (got != 0.0) ++tail;
    }
  const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  // float32 accumulation: ~1e-6; a 16-bit result: its rounding (bf16 2^-9, f16 2^-12 relative)
  const double tol = c.odt == 0 ? 1e-5 : c.dt == 1 ? 8e-3 : 2e-3;
  const bool ok = nan == 0 && tail == 0 && rel < tol;
  std::printf("%s %-78s rel %.2e nan %lld tail!=0 %lld\n", ok ? "PASS" : "FAIL",
              name_of(c, tag).c_str(), rel, (long long)nan, (long long)tail);
  if (ok) ++g_pass; else ++g_fail;
  if (!ok)
    std::printf("     worst at row %lld col %lld: got %.6g ref %.6g\n", (long long)wr,
                (long long)wn, wgot, wref);
  cudaFree(dl); cudaFree(dout); cudaFree(dgs);
  if (dws) cudaFree(dws);
  for (int i = 0; i < nw; ++i) { cudaFree(dw[i]); cudaFree(ds[i]); }
}

// Sizes of `groups` groups holding `rows` rows at random (some groups empty).
static std::vector<int> random_sizes(int groups, int rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> s(size_t(groups), 0);
  for (int r = 0; r < rows; ++r) ++s[size_t(rng() % uint64_t(groups))];
  return s;
}

// Sizes of `groups` groups, each uniform in [lo, hi].
static std::vector<int> uniform_sizes(int groups, int lo, int hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> d(lo, hi);
  std::vector<int> s(static_cast<size_t>(groups));
  for (auto& x : s) x = d(rng);
  return s;
}

static void refusals() {
  RaggedDotArgs a;
  int dummy[64] = {};
  a.lhs = a.rhs = a.out = dummy;
  a.group_sizes = dummy;
  a.m = 4; a.k = 256; a.n = 256; a.g = 2; a.dtype = 1; a.out_dtype = 1;
  a.w_dtype = nvc::cuda::kWInt8; a.scale_mode = 1; a.scale = reinterpret_cast<float*>(dummy);
  auto expect = [&](const char* what, bool refused) {
    const char* why = nvc::cuda::ragged_dot_check(a, false);
    const bool ok = (why != nullptr) == refused;
    std::printf("%s check %-40s -> %s\n", ok ? "PASS" : "FAIL", what, why ? why : "(taken)");
    if (ok) ++g_pass; else ++g_fail;
  };
  expect("int8, mode 1, k 256, n 256", false);
  a.k = 264; expect("k 264 (not a multiple of 16)", true); a.k = 256;
  a.n = 264; expect("n 264 (not a multiple of 16)", true); a.n = 256;
  a.scale_mode = 3; expect("scale_mode 3", true); a.scale_mode = 2;
  a.scale = nullptr; expect("mode 2 without scales", true);
  a.scale_mode = 0; expect("mode 0 without scales", false);
  a.w_dtype = 7; expect("weight code 7", true);
}

static void correctness(bool quick) {
  refusals();
  struct Shape {
    const char* tag;
    int64_t m, k, n;
    std::vector<int> sizes;
    bool few;  // fewer combinations: scale modes 1 and 2, out in the lhs dtype
  };
  std::vector<Shape> shapes = {
      // empty and negative groups, K and N not multiples of 128 / 64, tail rows
      {"empty+neg+tail", 37, 400, 272, {10, 0, 20, -3, 5}, false},
      // one group holds every row (R 64 tile)
      {"one group", 100, 256, 512, {0, 0, 100, 0}, false},
      // M not a multiple of the tile, one group in three row chunks of the R 16 tile
      {"m%tile", 41, 1024, 384, {0, 0, 37, 0, 3, 0, 0, 0}, false},
      // sizes past M (clipped as lax does)
      {"past M", 50, 160, 208, {30, 40}, false},
      // decode-like: many groups, few rows, split-K of the last round
      {"decode split-K", 64, 1024, 512, random_sizes(32, 64, 7), false},
      // more items than blocks, so that each block runs several items one after the other
      // (state carried from one item's stages to the next: the wgmma loop's register A), every
      // row-tile count 1 .. 8 of the R 64 tile, and of the R 16 tile 0 .. 2 with empty groups
      {"R64 many items", 9600, 256, 128, uniform_sizes(300, 1, 63, 8), true},
      {"R16 many items", 1800, 384, 128, uniform_sizes(300, 0, 12, 9), true},
  };
  uint64_t seed = 1;
  for (const Shape& sh : shapes) {
    for (int sw = 0; sw < 2; ++sw)
      for (int dt = 1; dt <= 2; ++dt)
        for (int wd : {int(nvc::cuda::kWInt8), int(nvc::cuda::kWE4M3)})
          for (int mode = 0; mode < 3; ++mode)
            for (int odt : {dt, 0}) {
              ++seed;
              if (quick && (seed % 9 != 0)) continue;
              // the large shape: every mode and weight dtype, fewer out / lhs combinations
              if (sh.k >= 1024 && sh.sizes.size() > 8 && !quick && dt == 2 && odt == 0) continue;
              if (sh.few && (mode == 0 || odt != dt)) continue;
              Case c{sh.m, sh.k, sh.n, sh.sizes, dt, wd, mode, odt, sw == 1};
              run_case(c, seed, sh.tag);
            }
    std::fflush(stdout);
  }
}

// ---- timing ----
__device__ __forceinline__ uint32_t hash32(uint64_t i, uint64_t seed) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;
  x ^= x >> 31; x *= 0xBF58476D1CE4E5B9ull; x ^= x >> 29; x *= 0x94D049BB133111EBull;
  return uint32_t(x ^ (x >> 32));
}
// bytes of random weights: int8 any; e4m3 without NaN (mask 0x77: |v| < 16)
__global__ void fill_bytes(uint8_t* p, size_t n, uint64_t seed, uint8_t mask) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = uint8_t(hash32(i, seed)) & mask;
}
// 16-bit values (bf16 / f16 bit patterns) of magnitude < 1: sign, small exponent, mantissa
__global__ void fill_16(uint16_t* p, size_t n, uint64_t seed, int dt) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t h = hash32(i, seed);
    const float v = (float(h & 0xFFFF) / 65536.f - 0.5f) * 0.1f;
    if (dt == 1) {
      __nv_bfloat16 b = __float2bfloat16_rn(v);
      p[i] = *reinterpret_cast<uint16_t*>(&b);
    } else {
      __half b = __float2half_rn(v);
      p[i] = *reinterpret_cast<uint16_t*>(&b);
    }
  }
}
__global__ void fill_f32(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

// Token -> top-k distinct experts at random: the rows per expert.
static std::vector<int> routed(int tokens, int experts, int topk, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> s(size_t(experts), 0);
  for (int t = 0; t < tokens; ++t) {
    std::vector<int> pick;
    while (int(pick.size()) < topk) {
      const int e = int(rng() % uint64_t(experts));
      if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
    }
    for (int e : pick) ++s[size_t(e)];
  }
  return s;
}

// Median us per call of `a` over 7 timings of 10 launches.
static double time_us(const RaggedDotArgs& a, bool swiglu) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i)
    CK(swiglu ? nvc::cuda::ragged_dot_swiglu(a, 0) : nvc::cuda::ragged_dot(a, 0));
  std::vector<double> t;
  for (int rep = 0; rep < 7; ++rep) {
    CK(cudaEventRecord(e0, 0));
    for (int i = 0; i < 10; ++i)
      CK(swiglu ? nvc::cuda::ragged_dot_swiglu(a, 0) : nvc::cuda::ragged_dot(a, 0));
    CK(cudaEventRecord(e1, 0));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(double(ms) * 100.0);  // us per call
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

static void timing() {
  constexpr int kHidden = 7168, kF = 2048, kTopK = 8;
  std::printf("%-4s %-4s %-5s %-28s %8s %8s %6s   %8s %8s %6s  %s\n", "E", "T", "M", "op",
              "w8 us", "w8 bnd", "x", "16b us", "16b bnd", "x", "w8 speedup");
  for (int e : {32, 256}) {
    const size_t we = size_t(e) * kHidden * kF;
    // 8-bit weights: gate, up, down (int8; the e4m3 rows reuse them as bytes without NaN)
    uint8_t *g8, *u8, *d8;
    uint16_t *g16, *u16, *d16;
    CK(cudaMalloc(&g8, we)); CK(cudaMalloc(&u8, we)); CK(cudaMalloc(&d8, we));
    CK(cudaMalloc(&g16, we * 2)); CK(cudaMalloc(&u16, we * 2)); CK(cudaMalloc(&d16, we * 2));
    fill_bytes<<<2048, 256>>>(g8, we, 11, 0x77);
    fill_bytes<<<2048, 256>>>(u8, we, 12, 0x77);
    fill_bytes<<<2048, 256>>>(d8, we, 13, 0x77);
    fill_16<<<2048, 256>>>(g16, we, 14, 1);
    fill_16<<<2048, 256>>>(u16, we, 15, 1);
    fill_16<<<2048, 256>>>(d16, we, 16, 1);
    // scales: the largest form (mode 2 [E, 56, 16] or mode 1 [E, 7168]) for every product
    const size_t nsc = size_t(e) * kHidden;
    float *sg, *su, *sd;
    CK(cudaMalloc(&sg, nsc * 4)); CK(cudaMalloc(&su, nsc * 4)); CK(cudaMalloc(&sd, nsc * 4));
    fill_f32<<<256, 256>>>(sg, nsc, 0.01f);
    fill_f32<<<256, 256>>>(su, nsc, 0.01f);
    fill_f32<<<256, 256>>>(sd, nsc, 0.01f);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    for (int tokens : {8, 32, 128}) {
      const int64_t m = int64_t(tokens) * kTopK;
      auto sizes = routed(tokens, e, kTopK, 1000 + e * 7 + tokens);
      int active = 0;
      for (int s : sizes) active += s > 0;
      void *lhs, *out, *ws;
      int32_t* gs;
      CK(cudaMalloc(&lhs, size_t(m) * kHidden * 2));
      CK(cudaMalloc(&out, size_t(m) * kHidden * 4));
      CK(cudaMalloc(&gs, size_t(e) * 4));
      CK(cudaMemcpy(gs, sizes.data(), size_t(e) * 4, cudaMemcpyHostToDevice));
      fill_16<<<256, 256>>>(static_cast<uint16_t*>(lhs), size_t(m) * kHidden, 17, 1);
      const int64_t wsb = std::max(nvc::cuda::ragged_dot_workspace_bytes(m, kHidden, e, true),
                                   nvc::cuda::ragged_dot_workspace_bytes(m, kHidden, e, false));
      CK(cudaMalloc(&ws, size_t(std::max<int64_t>(wsb, 16))));
      CK(cudaDeviceSynchronize());
      struct Op {
        const char* name;
        int64_t k, n;
        bool sw;
        void *w8a, *w8b, *w16a, *w16b;
        float *sa, *sb;
      };
      const Op ops[] = {{"gate [7168->2048]", kHidden, kF, false, g8, nullptr, g16, nullptr, sg, nullptr},
                        {"down [2048->7168]", kF, kHidden, false, d8, nullptr, d16, nullptr, sd, nullptr},
                        {"swiglu gate+up", kHidden, kF, true, g8, u8, g16, u16, sg, su}};
      for (const Op& op : ops) {
        RaggedDotArgs a;
        a.lhs = lhs; a.group_sizes = gs; a.out = out;
        a.m = m; a.k = op.k; a.n = op.n; a.g = e; a.dtype = 1; a.out_dtype = 1;
        a.workspace = ws; a.workspace_bytes = std::max<int64_t>(wsb, 16);
        a.rhs = op.w16a; a.rhs2 = op.w16b;
        const double t16 = time_us(a, op.sw);
        const double nw = op.sw ? 2.0 : 1.0;
        const double b16 = double(active) * op.k * op.n * 2 * nw / g_hbm * 1e6;
        for (int wd : {int(nvc::cuda::kWInt8), int(nvc::cuda::kWE4M3)})
          for (int mode : {1, 2}) {
            a.rhs = op.w8a; a.rhs2 = op.w8b;
            a.w_dtype = wd; a.scale_mode = mode; a.scale = op.sa; a.scale2 = op.sb;
            if (const char* why = nvc::cuda::ragged_dot_check(a, op.sw)) {
              std::printf("refused: %s\n", why);
              ++g_fail;
              continue;
            }
            const double t8 = time_us(a, op.sw);
            const double sbytes =
                mode == 1 ? double(op.n) * 4 : double((op.k + 127) / 128) * ((op.n + 127) / 128) * 4;
            const double b8 = double(active) * (double(op.k) * op.n + sbytes) * nw / g_hbm * 1e6;
            char nm[64];
            std::snprintf(nm, sizeof nm, "%s %s m%d", op.name,
                          wd == nvc::cuda::kWInt8 ? "i8" : "e4m3", mode);
            std::printf("%-4d %-4d %-5lld %-28s %8.1f %8.1f %6.2f   %8.1f %8.1f %6.2f  %5.2fx\n", e,
                        tokens, (long long)m, nm, t8, b8, t8 / b8, t16, b16, t16 / b16, t16 / t8);
            std::fflush(stdout);
          }
      }
      cudaFree(lhs); cudaFree(out); cudaFree(gs); cudaFree(ws);
    }
    cudaFree(g8); cudaFree(u8); cudaFree(d8); cudaFree(g16); cudaFree(u16); cudaFree(d16);
    cudaFree(sg); cudaFree(su); cudaFree(sd);
  }
}

int main(int argc, char** argv) {
  bool time = false, quick = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--time")) time = true;
    else if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--hbm") && i + 1 < argc) g_hbm = std::atof(argv[++i]) * 1e9;
    else {
      std::fprintf(stderr, "usage: %s [--time] [--quick] [--hbm GB/s]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const double peak = device_hbm();
  if (g_hbm <= 0) g_hbm = peak;
  std::printf("%s: bound bandwidth %.0f GB/s (device peak, memory clock x bus width x 2: %.0f)\n",
              prop.name, g_hbm / 1e9, peak / 1e9);
  CK(nvc::cuda::ragged_dot_load_kernels());
  if (time) timing();
  else correctness(quick);
  std::printf("%s: %d passed, %d failed\n", g_fail ? "FAIL" : "PASS", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
