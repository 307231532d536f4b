// CUDA-only decoding helper shared by the CUDA FFI handlers.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "ffi_common.h"

namespace nvc {
// A launch's cudaError_t as an FFI error naming what was launched.
inline ffi::Error launch_result(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_nvcomm: ") + what + ": " + cudaGetErrorString(e));
}
}  // namespace nvc
