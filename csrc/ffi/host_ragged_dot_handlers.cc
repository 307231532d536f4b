// XLA:CPU FFI handlers of ragged_dot / ragged_dot_swiglu for the host backend
// (host/ragged_dot_host.h): decode, check, run the loop. Local ops: no rank, no order token.
#include "../common/ffi_targets.h"
#include "../host/ragged_dot_host.h"
#include "ffi_common.h"
#include "ffi_signatures.h"
#include "ragged_dot_ffi_common.h"

namespace nvc {
namespace {

ffi::Error run(const char* what, ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, const ffi::AnyBuffer* rhs2,
               ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out) {
  RaggedDotDims d;
  if (auto e = check_ragged_dot(what, lhs, rhs, rhs2, group_sizes, *out, &d); e.failure())
    return e;
  host::RaggedDotHostArgs a;
  a.lhs = lhs.untyped_data();
  a.rhs = rhs.untyped_data();
  a.rhs2 = rhs2 != nullptr ? rhs2->untyped_data() : nullptr;
  a.group_sizes = group_sizes.typed_data();
  a.out = out->untyped_data();
  a.m = d.m;
  a.k = d.k;
  a.n = d.n;
  a.g = d.g;
  a.dtype = d.dtype;
  a.out_dtype = d.out_dtype;
  const std::string err = host::ragged_dot(a);
  return err.empty() ? ffi::Error::Success()
                     : precondition(std::string("jax_nvcomm: ") + what + ": " + err);
}

ffi::Error RaggedDotHostImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> out) {
  return run("ragged_dot", lhs, rhs, nullptr, group_sizes, out);
}

ffi::Error RaggedDotSwigluHostImpl(ffi::AnyBuffer lhs, ffi::AnyBuffer w_gate,
                                   ffi::AnyBuffer w_up, ffi::Buffer<ffi::S32> group_sizes,
                                   ffi::Result<ffi::AnyBuffer> out) {
  return run("ragged_dot_swiglu", lhs, w_gate, &w_up, group_sizes, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kRaggedDotHost, RaggedDotHostImpl, sig::ragged_dot(sig::local_bind));
XLA_FFI_DEFINE_HANDLER(kRaggedDotSwigluHost, RaggedDotSwigluHostImpl,
                       sig::ragged_dot_swiglu(sig::local_bind));

NVC_REGISTER_FFI("nvc_ragged_dot", kRaggedDotHost);
NVC_REGISTER_FFI("nvc_ragged_dot_swiglu", kRaggedDotSwigluHost);

}  // namespace nvc
