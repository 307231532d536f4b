// Self-registration of XLA FFI handlers: each handler file adds its symbols with
// NVC_REGISTER_FFI("name", symbol); the module exports them all from targets() and the
// Python side registers every one with jax.ffi.register_ffi_target at import.
#pragma once
#include <string>
#include <vector>

namespace nvc {
struct FfiTarget {
  std::string name;
  void* handler;
};
std::vector<FfiTarget>& ffi_targets();
}  // namespace nvc

#define NVC_FFI_CAT2(a, b) a##b
#define NVC_FFI_CAT(a, b) NVC_FFI_CAT2(a, b)
#define NVC_REGISTER_FFI(name, symbol)                                                   \
  static const int NVC_FFI_CAT(nvc_ffi_reg_, __LINE__) =                                 \
      (::nvc::ffi_targets().push_back({name, reinterpret_cast<void*>(symbol)}), 0)
