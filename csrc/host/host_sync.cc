// Error recording for the host protocols (see host_sync.h).
#include "host_sync.h"

#include "../common/registry.h"

namespace nvc {
namespace host {

std::string record_error(const CommView& v, uint32_t code, uint32_t desc, int peer, uint64_t seq,
                         uint64_t observed) {
  ErrorInfo e{code, desc, v.rank, peer, seq, observed};
  if (v.err != nullptr) {
    std::atomic_ref<uint32_t> c(v.err->code);
    uint32_t expected = 0;
    if (c.compare_exchange_strong(expected, code)) {
      v.err->op = desc; v.err->rank = v.rank; v.err->peer = peer;
      v.err->seq = seq; v.err->observed = observed;
    }
  }
  return describe_error(e);
}

}  // namespace host
}  // namespace nvc
