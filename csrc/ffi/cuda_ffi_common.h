// CUDA-only decoding helper shared by the CUDA FFI handlers.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "../common/ffi_targets.h"
#include "ffi_common.h"

// Defines and registers one CUDA handler twice: as `name` with kCmdBufferCompatible (XLA may
// record the call into a command buffer, i.e. a CUDA graph, and replay it without this host
// code: every per-call state lives on the device) and as `name "_nograph"` without it (XLA then
// ends its command buffer before the call, launches the kernel itself, and starts a new one
// after it, as it does around NCCL collectives). Same implementation; which one a program uses is
// chosen at trace time (`graph_capture` in jax_nvcomm/_shard.py, docs/perf/step_speed.md). `binding`
// is the handler's ffi::Ffi::Bind() chain.
#define NVC_CUDA_HANDLER(symbol, name, impl, binding)                                      \
  XLA_FFI_DEFINE_HANDLER(symbol, impl, binding, {::xla::ffi::Traits::kCmdBufferCompatible}); \
  XLA_FFI_DEFINE_HANDLER(symbol##NoGraph, impl, binding);                                  \
  static const int nvc_ffi_reg_##symbol =                                                  \
      (::nvc::ffi_targets().push_back({name, reinterpret_cast<void*>(symbol)}), 0);          \
  static const int nvc_ffi_reg_##symbol##NoGraph =                                         \
      (::nvc::ffi_targets().push_back(                                                      \
           {name "_nograph", reinterpret_cast<void*>(symbol##NoGraph)}), 0)

namespace nvc {
// The CUDA handlers' binding prefix (ffi_signatures.h adds each op's operands): the stream XLA
// runs the call on and the device it is for.
inline auto cuda_bind() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::DeviceOrdinal>();
}

// A launch's cudaError_t as an FFI error naming what was launched.
inline ffi::Error launch_result(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_nvcomm: ") + what + ": " + cudaGetErrorString(e));
}
}  // namespace nvc
