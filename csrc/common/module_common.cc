// Definitions every extension module carries its own copy of: the registry, the FFI target
// list and error text. Compiled into each module separately (host, cuda).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ffi_targets.h"
#include "ragged_layout.h"
#include "registry.h"

namespace nvc {

Registry& registry() {
  static Registry r;
  return r;
}

std::vector<FfiTarget>& ffi_targets() {
  static std::vector<FfiTarget> t;
  return t;
}

static const char* op_name(uint32_t desc) {
  switch (desc & 0xFu) {
    case kOpAllGather: return "all_gather";
    case kOpAllReduce: return "all_reduce";
    case kOpAllReduceRms: return "all_reduce_rms_norm";
    case kOpMoeDispatch: return "moe_dispatch";
    case kOpMoeCombine: return "moe_combine";
    case kOpAllGatherV: return "all_gather_v";
    case kOpReduceScatterV: return "reduce_scatter_v";
    case kOpRaggedAllToAll: return "ragged_all_to_all";
    default: return "unknown op";
  }
}

std::string describe_error(const ErrorInfo& e) {
  char buf[512];
  switch (e.code) {
    case kErrNone: return "";
    case kErrTimeout:
      std::snprintf(buf, sizeof buf,
                    "jax_nvcomm: %s call #%llu: rank %d timed out waiting for rank %d "
                    "(peer dead, or ranks calling different collectives)",
                    op_name(e.op), (unsigned long long)e.seq, e.rank, e.peer);
      break;
    case kErrMismatch:
      if (flag_desc(e.observed) == kPoisonDesc) {
        // all-reduce: a two-shot block that failed its phase-0 wait (allreduce_twoshot.cuh);
        // every other op: bad input of that rank
        const uint32_t op = e.op & 0xFu;
        std::snprintf(buf, sizeof buf, "jax_nvcomm: %s call #%llu: rank %d: rank %d failed this "
                      "call (%s)", op_name(e.op), (unsigned long long)e.seq, e.rank, e.peer,
                      op == kOpAllReduce || op == kOpAllReduceRms
                          ? "it stopped waiting for a peer: its own error names why"
                      : op == kOpRaggedAllToAll
                          ? "bad input found there, or, on the chunked path, another failure "
                            "there: its own error names it"
                          : "bad input found there");
      } else {
        std::snprintf(buf, sizeof buf,
                      "jax_nvcomm: %s call #%llu: rank %d received a %s call from rank %d with "
                      "other sizes or op (descriptor 0x%06x, expected 0x%06x): ranks disagree "
                      "on the op or its sizes", op_name(e.op), (unsigned long long)e.seq, e.rank,
                      op_name(flag_desc(e.observed)), e.peer, (unsigned)flag_desc(e.observed),
                      (unsigned)(e.op & 0xFFFFFFu));
      }
      break;
    case kErrAhead:
      std::snprintf(buf, sizeof buf,
                    "jax_nvcomm: %s call #%llu: rank %d saw rank %d at call #%llu: ranks are out "
                    "of step", op_name(e.op), (unsigned long long)e.seq, e.rank, e.peer,
                    (unsigned long long)flag_seq(e.observed));
      break;
    case kErrBadExpert:
      if (bad_expert_repeat(e.observed)) {
        std::snprintf(buf, sizeof buf,
                      "jax_nvcomm: %s call #%llu: rank %d: topk_ids[%d, %d] = %d repeats an "
                      "expert id of an earlier column of that row", op_name(e.op),
                      (unsigned long long)e.seq, e.rank, bad_expert_token(e.observed),
                      bad_expert_slot(e.observed), e.peer);
      } else {
        std::snprintf(buf, sizeof buf,
                      "jax_nvcomm: %s call #%llu: rank %d: topk_ids[%d, %d] = %d, outside "
                      "[-1, num_experts)", op_name(e.op), (unsigned long long)e.seq,
                      e.rank, bad_expert_token(e.observed), bad_expert_slot(e.observed), e.peer);
      }
      break;
    case kErrCapacity:
      std::snprintf(buf, sizeof buf,
                    "jax_nvcomm: %s call #%llu: rank %d: size %llu exceeds the capacity of the "
                    "communication buffer", op_name(e.op), (unsigned long long)e.seq, e.rank,
                    (unsigned long long)e.observed);
      break;
    case kErrRowCount:
      std::snprintf(buf, sizeof buf,
                    "jax_nvcomm: %s call #%llu: rank %d: rank %d's row count is %d, outside "
                    "[0, max_rows=%u] (num_rows or offsets out of range)", op_name(e.op),
                    (unsigned long long)e.seq, e.rank, e.peer, int32_t(uint32_t(e.observed)),
                    unsigned(e.observed >> 32));
      break;
    case kErrOffsetsDiffer:
      std::snprintf(buf, sizeof buf,
                    "jax_nvcomm: %s call #%llu: rank %d: rank %d's offsets give this rank %d "
                    "rows, this rank's give %d: ranks passed different offsets", op_name(e.op),
                    (unsigned long long)e.seq, e.rank, e.peer, int32_t(uint32_t(e.observed)),
                    int32_t(uint32_t(e.observed >> 32)));
      break;
    case kErrInFlight:
      std::snprintf(buf, sizeof buf,
                    "jax_nvcomm: %s call #%llu: rank %d: %llu split sends outstanding, more than "
                    "the communicator's max_in_flight=%d: receive one (moe_*_recv) before the "
                    "next send", op_name(e.op), (unsigned long long)e.seq, e.rank,
                    (unsigned long long)e.observed, e.peer);
      break;
    case kErrOrder:
      std::snprintf(buf, sizeof buf,
                    "jax_nvcomm: %s call #%llu: rank %d: receive out of order: %s (receives must "
                    "come once each, in the order of their sends; fused calls only when no split "
                    "send is outstanding)", op_name(e.op), (unsigned long long)e.seq, e.rank,
                    e.peer < 0 ? "a fused call while split sends are outstanding"
                               : "the receive belongs to another send");
      break;
    case kErrRaggedSlice: {
      // ragged_slice_detail: the slice in bits 0..31, the field in bits 32..39
      static const char* kField[5] = {
          "input_offsets[i] < 0", "send_sizes[i] < 0",
          "input_offsets[i] + send_sizes[i] > N (the operand's rows)", "output_offsets[i] < 0",
          "output_offsets[i] + send_sizes[i] > M (the output's rows, in the receiver's frame)"};
      const unsigned field = unsigned((e.observed >> 32) & 0xFFu);
      std::snprintf(buf, sizeof buf,
                    "jax_nvcomm: %s call #%llu: rank %d: slice i=%u of rank %d's call lies "
                    "outside operand/output: %s", op_name(e.op), (unsigned long long)e.seq,
                    e.rank, unsigned(uint32_t(e.observed)), e.peer,
                    field < 5 ? kField[field] : "unknown field");
      break;
    }
    case kErrRaggedRecv: {
      // ragged_recv_detail: sent rows in bits 0..23, expected in 24..47, slice j in 48..63,
      // each clamped to its field ("+": at least that much)
      const uint64_t lim = kRaggedRecvSizeMax;
      const unsigned long long sent = e.observed & lim, want = (e.observed >> 24) & lim;
      const unsigned j = unsigned(e.observed >> 48);
      std::snprintf(buf, sizeof buf,
                    "jax_nvcomm: %s call #%llu: rank %d: rank %d sends %llu%s rows in its slice "
                    "j=%u%s to rank %d, but rank %d's recv_sizes expects %llu%s: ranks disagree "
                    "on the sizes (send_sizes must equal all_to_all(recv_sizes))", op_name(e.op),
                    (unsigned long long)e.seq, e.rank, e.peer, sent, sent == lim ? "+" : "", j,
                    j == kRaggedRecvSliceMax ? "+" : "", e.rank, e.rank, want,
                    want == lim ? "+" : "");
      break;
    }
    default:
      std::snprintf(buf, sizeof buf, "jax_nvcomm: error code %u on rank %d", e.code, e.rank);
  }
  return buf;
}

namespace {

// A rank that failed because a peer poisoned the call (kErrMismatch on the POISON descriptor):
// a bystander; the peer's own record holds the cause.
bool is_bystander(const ErrorInfo& e) {
  return e.code == kErrMismatch && flag_desc(e.observed) == kPoisonDesc;
}

// A copy of c's record, code kErrNone while there is none. Writers store the code last (after
// the fields: kernels/common.cuh record_failure, host/host_sync.cc record_error).
ErrorInfo snapshot(const RankContext& c) {
  ErrorInfo out{};
  if (c.err_host == nullptr) return out;
  if (*reinterpret_cast<volatile uint32_t*>(&c.err_host->code) == kErrNone) return out;
  std::atomic_thread_fence(std::memory_order_acquire);
  const volatile ErrorInfo* e = c.err_host;
  out.op = e->op; out.rank = e->rank; out.peer = e->peer;
  out.seq = e->seq; out.observed = e->observed; out.code = e->code;
  return out;
}

// Whether a and b are ranks of one group (this process maps a group's buffers once: a's view of
// b's buffer is b's own).
bool same_group(const RankContext& a, const RankContext& b) {
  return a.view.world == b.view.world && b.view.rank >= 0 && b.view.rank < a.view.world &&
         a.view.bufs[b.view.rank] == b.view.bufs[b.view.rank];
}

}  // namespace

FailureSummary summarize_failure(const RankContext& me, double wait_s) {
  FailureSummary s;
  ErrorInfo mine = snapshot(me);
  if (mine.code == kErrNone) return s;
  std::vector<std::shared_ptr<RankContext>> group;  // this process's ranks of me's group
  for (auto& c : registry().contexts(me.comm_id))
    if (same_group(me, *c)) group.push_back(c);
  auto rank_ctx = [&](int r) -> std::shared_ptr<RankContext> {
    for (auto& c : group)
      if (c && c->view.rank == r) return c;
    return nullptr;
  };
  // Follow "rank p failed this call" to the rank whose own record names the cause. A bystander
  // can fail before that rank has written its record (it poisons the call first): wait for it,
  // briefly, when it is a rank of this process.
  ErrorInfo root = mine;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::microseconds(int64_t(wait_s * 1e6));
  for (int hops = 0; is_bystander(root) && hops < kMaxWorld; ++hops) {
    auto c = rank_ctx(root.peer);
    if (c == nullptr || c->view.rank == root.rank) break;  // in another process
    ErrorInfo next = snapshot(*c);
    while (next.code == kErrNone && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      next = snapshot(*c);
    }
    if (next.code == kErrNone) break;
    root = next;
  }
  // The other ranks of the group here end the call at about the same time (a poisoned call
  // fails at once everywhere): wait for them the same bounded while, so that "seen by" names
  // every rank of this process that saw the failure.
  auto recorded = [&] {
    for (auto& c : group)
      if (snapshot(*c).code == kErrNone) return false;
    return true;
  };
  while (!recorded() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  s.root_rank = root.rank;
  s.records.push_back(describe_error(root));
  std::vector<std::pair<int, std::string>> others;
  for (auto& c : group) {
    if (c == nullptr || c->view.rank == root.rank) continue;
    ErrorInfo e = snapshot(*c);
    if (e.code != kErrNone) others.emplace_back(c->view.rank, describe_error(e));
  }
  std::sort(others.begin(), others.end());
  s.group_ranks = int(group.size());
  std::string seen;
  for (auto& [r, t] : others) {
    s.records.push_back(t);
    s.seen_by.push_back(r);
    seen += (seen.empty() ? "" : ", ") + std::to_string(r);
  }
  s.text = s.records[0] + "\n";
  if (!others.empty())
    s.text += "seen by rank" + std::string(others.size() > 1 ? "s " : " ") + seen + " ";
  s.text += "(communicator " + std::to_string(me.comm_id) +
            "; each rank's record: the exception's `records`, or comm.errors())";
  return s;
}

std::vector<FailureSummary> summarize_failures(int64_t comm_id) {
  std::vector<FailureSummary> out;
  std::vector<std::shared_ptr<RankContext>> done;  // one rank of each group summarised
  for (auto& c : registry().contexts(comm_id)) {
    if (snapshot(*c).code == kErrNone) continue;
    bool seen = false;
    for (auto& d : done) seen = seen || same_group(*d, *c);
    if (seen) continue;
    done.push_back(c);
    out.push_back(summarize_failure(*c, 0.0));
  }
  return out;
}

std::string describe_failure(const RankContext& me, const std::string& fallback, double wait_s) {
  FailureSummary s = summarize_failure(me, wait_s);
  if (s.text.empty()) return fallback;
  // this rank found the cause: its protocol's own text may say more than the record (the
  // values, on the host backend)
  if (s.root_rank == me.view.rank && !fallback.empty())
    return fallback + s.text.substr(s.records[0].size());
  return s.text;
}

std::string Registry::take_locked(int64_t comm_id) {
  if (reported_.count(comm_id)) return "";
  std::string out;
  for (auto& [key, c] : map_) {
    if (key.first != comm_id || c->err_host == nullptr) continue;
    std::string t = describe_error(*c->err_host);
    if (!t.empty()) out += (out.empty() ? "" : "\n") + t;
  }
  if (!out.empty()) reported_.insert(comm_id);
  return out;
}

void report_unread(int64_t comm_id) {
  std::string t = registry().take_unreported(comm_id);
  if (t.empty()) return;
  registry().note_printed();
  std::fprintf(stderr,
               "jax_nvcomm: communicator %lld failed in an earlier call whose result was not "
               "read; this and every later call on it are refused:\n%s\n(close() it and "
               "create a new one; check() after a result is ready raises this)\n",
               static_cast<long long>(comm_id), t.c_str());
  std::fflush(stderr);
}

void report_call_after_close(int64_t comm_id) {
  if (!registry().first_call_after_close(comm_id)) return;
  std::fprintf(stderr,
               "jax_nvcomm: a compiled program called communicator %lld, which is closed (or "
               "belongs to another mesh): the call fails and its results are errors. Create a "
               "new communicator and trace the program again\n",
               static_cast<long long>(comm_id));
  std::fflush(stderr);
}

}  // namespace nvc
