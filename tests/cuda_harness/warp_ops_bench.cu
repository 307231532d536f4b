// Micro-benchmark (one warp, SM cycles per operation): match.any.sync against a 32-shuffle
// compare loop, a shared-memory atomicAdd + load, and a ballot. Answers whether the MoE
// dispatch's warp-aggregated counting (moe_dispatch.cuh) is bound by match.any.
// Build and run: nvcc -O2 -arch=sm_90a -o build/warp_ops tests/cuda_harness/warp_ops_bench.cu && build/warp_ops
#include <cstdio>
__global__ void k(const int* in, long long* out, int iters) {
  __shared__ int cnt[256];
  int lane = threadIdx.x & 31;
  for (int i = threadIdx.x; i < 256; i += blockDim.x) cnt[i] = 0;
  __syncwarp();
  int e = in[lane];
  int acc = 0;
  long long t0 = clock64();
  for (int i = 0; i < iters; ++i) {
    unsigned m = __match_any_sync(0xffffffffu, e + (acc & 1));
    acc += __popc(m);
  }
  long long t1 = clock64();
  for (int i = 0; i < iters; ++i) {
    int c = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) { int ej = __shfl_sync(0xffffffffu, e + (acc & 1), j); c += (j < lane && ej == e); }
    acc += c;
  }
  long long t2 = clock64();
  for (int i = 0; i < iters; ++i) { atomicAdd(&cnt[(e + acc) & 255], 1); acc += cnt[lane]; }
  long long t3 = clock64();
  for (int i = 0; i < iters; ++i) { unsigned b = __ballot_sync(0xffffffffu, (e + acc) & 1); acc += __popc(b); }
  long long t4 = clock64();
  if (lane == 0) { out[0] = (t1 - t0) / iters; out[1] = (t2 - t1) / iters; out[2] = (t3 - t2) / iters; out[3] = (t4 - t3) / iters; out[4] = acc; }
}
int main() {
  int h[32]; for (int i = 0; i < 32; ++i) h[i] = (i * 7) % 5;
  int* d; long long* o; cudaMalloc(&d, 128); cudaMalloc(&o, 64);
  cudaMemcpy(d, h, 128, cudaMemcpyHostToDevice);
  for (int r = 0; r < 3; ++r) k<<<1, 32>>>(d, o, 1000);
  long long ho[5]; cudaMemcpy(ho, o, 40, cudaMemcpyDeviceToHost);
  printf("cycles per op: match_any %lld | 32-shfl loop %lld | shared atomicAdd+ld %lld | ballot %lld\n", ho[0], ho[1], ho[2], ho[3]);
}
