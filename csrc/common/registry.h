// Process-wide registry of rank contexts: what a communicator set up for one of this process's
// ranks (buffers mapped, error block, configuration), looked up by the FFI handlers.
//
// Key: (communicator id, slot). CUDA handlers use the device ordinal as the slot (one rank per
// local device and communicator); host handlers use group * world + rank, which the traced
// program passes as an operand (XLA:CPU runs every local device's program in one process).
// Entries are shared_ptr: a handler that looked one up keeps it alive while it runs, and
// removing a communicator never frees memory under a running call (CUDA: close() synchronises
// first; host: close() hands the shared-memory mappings to the contexts, `resources`, so the
// last running handler unmaps them).
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "layout.h"

namespace nvc {

struct RankContext {
  int64_t comm_id = 0;
  int64_t slot = 0;
  int device = -1;                 // CUDA ordinal, -1 for host
  CommView view{};                 // rank, world, buffers, timeouts, layout sizes
  ErrorInfo* err_host = nullptr;   // host-readable error block (== view.err on host)
  std::vector<int64_t> params;     // op-family parameters (e.g. MoE config), checked per call
  std::atomic<uint64_t> host_calls{0};  // handler executions (graph replays do not count)
  std::unique_ptr<ErrorInfo> owned_err; // host backend: the error block itself
  std::shared_ptr<void> resources;      // CUDA backend: the host-mapped error block; host
                                        // backend after close(): the mappings to unmap
  // CUDA backend: multicast address of this rank's buffer start (cuda_multicast.h), or nullptr
  // (the default: unicast kernels). Set at registration only when the multicast gate is on.
  void* multicast_base = nullptr;
};

class Registry {
 public:
  void add(std::shared_ptr<RankContext> c) {
    std::lock_guard<std::mutex> g(mu_);
    map_[{c->comm_id, c->slot}] = std::move(c);
  }
  std::shared_ptr<RankContext> find(int64_t comm_id, int64_t slot) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = map_.find({comm_id, slot});
    return it == map_.end() ? nullptr : it->second;
  }
  template <class F>
  void for_each(int64_t comm_id, F&& f) {  // f(RankContext&) for every slot of comm_id
    std::lock_guard<std::mutex> g(mu_);
    for (auto& [key, c] : map_)
      if (key.first == comm_id) f(*c);
  }
  void remove(int64_t comm_id) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = map_.begin(); it != map_.end();) {
      if (it->first.first == comm_id) it = map_.erase(it); else ++it;
    }
  }
 private:
  std::mutex mu_;
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<RankContext>> map_;
};

// One registry per extension module (host, cuda); defined in the module's source.
Registry& registry();

// Human-readable text for an ErrorInfo (empty when no error was recorded).
std::string describe_error(const ErrorInfo& e);

}  // namespace nvc
