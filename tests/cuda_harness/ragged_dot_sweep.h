// The harness's list of sweep variants (ragged_dot_sweep.cu adds to it, one part per
// translation unit; ragged_dot_harness.cu defines it and times them).
#pragma once
#include <vector>

#include <cuda_runtime.h>

#include "cuda/ragged_dot.h"

constexpr int kSweepParts = 11;  // RDOT_SWEEP_PART = 0 .. kSweepParts - 1

struct SweepVariant {
  const char* name;
  int part;     // RDOT_SWEEP_PART of its translation unit (the harness lists them by part)
  bool swiglu;  // a ragged_dot_swiglu tile (timed on the swiglu product)
  cudaError_t (*launch)(const nvc::cuda::RaggedDotArgs&, int cs, cudaStream_t);
  int cs = 1;  // blocks per cluster (split-K) the sweep times it with
};

std::vector<SweepVariant>& sweep_variants();
