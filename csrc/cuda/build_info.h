// What the CUDA part of this build was compiled for (reported by jax_nvcomm, checked by tests).
#pragma once

namespace nvc {
namespace cuda {

// nvcc's __CUDA_ARCH_LIST__ of this build, e.g. {900, 1000} ('a' variants as their number):
// *count entries.
const int* compiled_archs(int* count);

}  // namespace cuda
}  // namespace nvc
