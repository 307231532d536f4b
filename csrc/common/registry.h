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
#include <set>
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
  std::vector<std::shared_ptr<RankContext>> contexts(int64_t comm_id) {  // comm_id's slots
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::shared_ptr<RankContext>> out;
    for (auto& [key, c] : map_)
      if (key.first == comm_id) out.push_back(c);
    return out;
  }
  void remove(int64_t comm_id) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = map_.begin(); it != map_.end();) {
      if (it->first.first == comm_id) it = map_.erase(it); else ++it;
    }
  }

  // No silent failures: the error records of a communicator are handed out once, to whichever
  // asks first: the next call's handler (lookup, ffi_common.h), check() / errors() (the user
  // read them), close() or the exit hook (jax_nvcomm/_report.py), which print them. Returns
  // the records of comm_id's slots, one line each ("" when none or already handed out).
  std::string take_unreported(int64_t comm_id) {
    std::lock_guard<std::mutex> g(mu_);
    return take_locked(comm_id);
  }
  // The same for every communicator in the registry: one entry per communicator with records.
  std::vector<std::pair<int64_t, std::string>> take_all_unreported() {
    std::lock_guard<std::mutex> g(mu_);
    std::set<int64_t> ids;
    for (auto& [key, c] : map_) ids.insert(key.first);
    std::vector<std::pair<int64_t, std::string>> out;
    for (int64_t id : ids) {
      std::string t = take_locked(id);
      if (!t.empty()) out.emplace_back(id, std::move(t));
    }
    return out;
  }
  // True the first time a call names a communicator that is not (or no more) registered:
  // a compiled program run after close() is reported once, not on every call.
  // How many unread failures a handler printed (report_unread): JAX_NVCOMM_STRICT's exit status.
  void note_printed() { printed_.fetch_add(1, std::memory_order_relaxed); }
  int printed() const { return printed_.load(std::memory_order_relaxed); }
  bool first_call_after_close(int64_t comm_id) {
    std::lock_guard<std::mutex> g(mu_);
    return missing_reported_.insert(comm_id).second;
  }

 private:
  std::string take_locked(int64_t comm_id);  // module_common.cc
  std::mutex mu_;
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<RankContext>> map_;
  std::set<int64_t> reported_;          // communicators whose records were handed out
  std::set<int64_t> missing_reported_;  // communicators called after close(), reported
  std::atomic<int> printed_{0};
};

// One registry per extension module (host, cuda); defined in the module's source.
Registry& registry();

// Human-readable text for an ErrorInfo (empty when no error was recorded).
std::string describe_error(const ErrorInfo& e);

// A rank's failure as the user should read it (module_common.cc): the record of the rank that
// found the cause first (followed from "rank p failed this call" through the ranks of this
// process, waiting up to wait_s for a record not yet written), then the other ranks of the group
// in this process that failed, by rank. text: the root record, then one line "(seen by ranks
// ...)"; empty when `me` has no record.
struct FailureSummary {
  std::string text;
  std::vector<std::string> records;  // the root's record first
  std::vector<int> seen_by;          // the other failed ranks of this process, ascending
  int root_rank = -1;
  int group_ranks = 0;               // ranks of the group in this process
};
FailureSummary summarize_failure(const RankContext& me, double wait_s);
// One summary per group of comm_id with a failed rank in this process (no waiting).
std::vector<FailureSummary> summarize_failures(int64_t comm_id);
// summarize_failure(me, wait_s).text, or fallback when `me` has no record; where `me` itself
// found the cause, fallback (its protocol's own text) as the first line.
std::string describe_failure(const RankContext& me, const std::string& fallback, double wait_s);

// Print comm_id's error records on stderr unless they were handed out before (take_unreported).
void report_unread(int64_t comm_id);
// Print once per communicator that a compiled program called it after its close().
void report_call_after_close(int64_t comm_id);

}  // namespace nvc
