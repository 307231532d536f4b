// Error recording for the host protocols (see host_sync.h).
#include "host_sync.h"

#include "../common/registry.h"

namespace nvc {
namespace host {

std::string record_error(const CommView& v, uint32_t code, uint32_t desc, int peer, uint64_t seq,
                         uint64_t observed) {
  ErrorInfo e{code, desc, v.rank, peer, seq, observed};
  // As the kernels do (kernels/common.cuh record_failure): the first failure of the rank claims
  // Ctrl::failed and alone writes the record, the fields first and the code last (release), so
  // a reader that sees the code (another rank's handler, describe_failure) sees the fields.
  std::atomic_ref<uint32_t> claim(v.ctrl()->failed);
  uint32_t expected = 0;
  if (v.err != nullptr && claim.compare_exchange_strong(expected, code)) {
    v.err->op = desc; v.err->rank = v.rank; v.err->peer = peer;
    v.err->seq = seq; v.err->observed = observed;
    std::atomic_ref<uint32_t>(v.err->code).store(code, std::memory_order_release);
  }
  return describe_error(e);
}

}  // namespace host
}  // namespace nvc
