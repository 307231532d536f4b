// Shared decoding helpers for the thin FFI handlers (host and CUDA).
#pragma once
#include <algorithm>
#include <string>

#include "xla/ffi/api/ffi.h"

#include "../common/registry.h"

namespace nvc {
namespace ffi = ::xla::ffi;

// Every handler takes one operand and returns one result that carry no data: the program-order
// token of jax_nvcomm/_order.py. Call n+1 reads the buffer call n "wrote", so XLA's executors
// (XLA:CPU's concurrent thunk executor, CUDA-graph dependencies from buffer uses) run our calls
// in the order they were traced, on every rank alike. Never read or written here (writing it
// would cost a graph node per call).
using OrderIn = ffi::AnyBuffer;
using OrderOut = ffi::Result<ffi::AnyBuffer>;

inline ffi::Error precondition(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, msg);
}

// A host protocol's result text ("" = success) as an FFI error.
inline ffi::Error from_text(const std::string& err) {
  return err.empty() ? ffi::Error::Success() : precondition(err);
}

// The same for a protocol run as the rank `ctx`: a failure that the rank recorded reads as
// describe_failure words it (registry.h): the record of the rank that found the cause first,
// whichever rank's error XLA raises.
inline ffi::Error from_text(const RankContext& ctx, const std::string& err) {
  // the failing call itself: its peers here end the call about now, wait for them (bounded)
  return err.empty() ? ffi::Error::Success() : precondition(describe_failure(ctx, err, 1.0));
}

// dtype code used by the protocols (0 f32, 1 bf16, 2 f16, 3 f8e4m3), -1 if unsupported.
inline int dtype_code(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return 0;
    case ffi::DataType::BF16: return 1;
    case ffi::DataType::F16: return 2;
    case ffi::DataType::F8E4M3FN: return 3;
    default: return -1;
  }
}

// The operands of both fused all-reduces (the host and CUDA handlers alike): x [T, H],
// residual of x's dtype and shape, weight [H] of x's dtype or float32, 1 <= norm_hidden <= H.
inline ffi::Error check_rms(const char* what, const ffi::AnyBuffer& x,
                            const ffi::AnyBuffer& residual, const ffi::AnyBuffer& weight,
                            int64_t norm_hidden) {
  auto dims = x.dimensions();
  if (dims.size() != 2) return precondition(std::string("jax_nvcomm: ") + what + " expects [T, H]");
  if (residual.element_type() != x.element_type() ||
      residual.element_count() != x.element_count())
    return precondition(std::string("jax_nvcomm: ") + what +
                        ": residual must have x's dtype and shape");
  if ((weight.element_type() != x.element_type() && weight.element_type() != ffi::DataType::F32) ||
      int64_t(weight.element_count()) != dims[1])
    return precondition(std::string("jax_nvcomm: ") + what +
                        ": weight must be [H] of x's dtype or float32");
  if (norm_hidden < 1 || norm_hidden > dims[1])
    return precondition(std::string("jax_nvcomm: ") + what + ": norm_hidden must be in [1, H]");
  return ffi::Error::Success();
}

// Shapes and dtypes of the fused FP8-output all-reduce (the host and CUDA handlers alike).
inline ffi::Error check_quant(const ffi::AnyBuffer& x, const ffi::AnyBuffer& residual,
                              const ffi::AnyBuffer& weight, const ffi::AnyBuffer& q,
                              const ffi::Buffer<ffi::F32>& scale, int64_t norm_hidden) {
  if (auto e = check_rms("all_reduce_rms_norm_quant", x, residual, weight, norm_hidden);
      e.failure())
    return e;
  auto dims = x.dimensions();
  if (q.element_type() != ffi::DataType::F8E4M3FN || q.element_count() != x.element_count())
    return precondition("jax_nvcomm: all_reduce_rms_norm_quant: q must be float8_e4m3fn of x's "
                        "shape");
  if (int64_t(scale.element_count()) != dims[0])
    return precondition("jax_nvcomm: all_reduce_rms_norm_quant: scale must hold one float32 per "
                        "token");
  return ffi::Error::Success();
}

// Look up the rank context or explain why it is missing. A rank whose kernel (or host
// protocol) recorded an error refuses every later call BEFORE anything is enqueued, with the
// record's text: the failed call's own results were poisoned or left unspecified, and the
// kernels of a failed communicator do no more work (kernels/common.cuh "Failure"). The check is
// one load of the host-mapped ErrorInfo::code; the record is complete once the code is set.
// Both refusals are also printed on stderr, once per communicator (registry.h, "No silent
// failures"): a program whose results nobody reads would otherwise fail without a word.
inline ffi::Error lookup(int64_t comm_id, int64_t slot, std::shared_ptr<RankContext>* out) {
  *out = registry().find(comm_id, slot);
  if (*out == nullptr) {
    report_call_after_close(comm_id);  // once: the error below may be in results nobody reads
    return precondition("jax_nvcomm: communicator " + std::to_string(comm_id) +
                        " has no rank at slot " + std::to_string(slot) +
                        " in this process (closed, or used with another mesh)");
  }
  ErrorInfo* e = (*out)->err_host;
  if (e != nullptr && *reinterpret_cast<volatile uint32_t*>(&e->code) != kErrNone) {
    report_unread(comm_id);  // the failed call's result may never be read: say it once here
    // the root cause's record, this note on its line, then the "seen by" line
    // a later call: the records were written long ago, no waiting
    std::string text = describe_failure(**out, describe_error(*e), 0.0);
    const size_t eol = std::min(text.find('\n'), text.size());
    text.insert(eol, " (communicator is unusable after this error: close it and create a new "
                     "one; results of that call and of any CUDA-graph replay since are "
                     "unspecified)");
    return precondition(text);
  }
  (*out)->host_calls.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

}  // namespace nvc
