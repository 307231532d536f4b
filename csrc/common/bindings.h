// nanobind bindings shared by the host and CUDA extension modules: the FFI target table and
// the rank-context registry (register, unregister, read errors and debug counters).
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "ffi_targets.h"
#include "moe_layout.h"
#include "registry.h"

namespace nvc {
namespace nb = nanobind;

inline std::shared_ptr<RankContext> must_find(int64_t comm_id, int64_t slot) {
  auto c = registry().find(comm_id, slot);
  if (!c) throw std::runtime_error("jax_nvcomm: no rank context for communicator " +
                                   std::to_string(comm_id) + " slot " + std::to_string(slot));
  return c;
}

// Fill the layout fields of a CommView from (rank, world, buffers, max_message_bytes).
inline CommView make_view(int rank, int world, const std::vector<uint64_t>& bufs,
                          uint64_t timeout_ns, uint64_t max_message_bytes, ErrorInfo* err) {
  if (world < 1 || world > kMaxWorld)
    throw std::invalid_argument("jax_nvcomm: world size " + std::to_string(world) +
                                " outside [1, " + std::to_string(kMaxWorld) + "]");
  if (int(bufs.size()) != world)
    throw std::invalid_argument("jax_nvcomm: expected one buffer per rank");
  CommView v{};
  v.rank = rank;
  v.world = world;
  v.timeout_ns = timeout_ns;
  for (int r = 0; r < world; ++r) v.bufs[r] = reinterpret_cast<char*>(bufs[r]);
  v.err = err;
  v.max_message_bytes = max_message_bytes;
  v.flag_half = flag_half_bytes(max_message_bytes, world);
  v.lamport_off = lamport_offset(max_message_bytes, world);
  v.lamport_slot = lamport_slot_bytes(max_message_bytes, world);
  return v;
}

inline void add_common_bindings(nb::module_& m) {
  m.def("targets", []() {
    nb::dict d;
    for (auto& t : ffi_targets()) d[t.name.c_str()] = nb::capsule(t.handler);
    return d;
  });
  m.def("unregister", [](int64_t comm_id) { registry().remove(comm_id); });
  m.def("error_text", [](int64_t comm_id, int64_t slot) {
    auto c = must_find(comm_id, slot);
    return c->err_host ? describe_error(*c->err_host) : std::string();
  });
  // the failure of each group with a failed rank here, the root cause first (registry.h)
  m.def("failures", [](int64_t comm_id) {
    nb::list out;
    for (auto& f : summarize_failures(comm_id)) {
      nb::list records, seen;
      for (auto& r : f.records) records.append(r);
      for (int r : f.seen_by) seen.append(r);
      out.append(nb::make_tuple(f.text, records, seen, f.root_rank, f.group_ranks));
    }
    return out;
  });
  // the records nobody was told of yet, once (registry.h): close() and the exit hook print them
  m.def("take_unreported", [](int64_t comm_id) { return registry().take_unreported(comm_id); });
  m.def("printed_unread", []() { return registry().printed(); });
  m.def("take_all_unreported", []() {
    nb::list out;
    for (auto& [id, text] : registry().take_all_unreported()) out.append(nb::make_tuple(id, text));
    return out;
  });
  m.def("host_calls", [](int64_t comm_id, int64_t slot) {
    return must_find(comm_id, slot)->host_calls.load();
  });
  m.def("set_params", [](int64_t comm_id, int64_t slot, std::vector<int64_t> p) {
    must_find(comm_id, slot)->params = std::move(p);
  });
  m.def("buffer_bytes", [](uint64_t max_message_bytes, int world) {
    return comm_buffer_bytes(max_message_bytes, world);
  });
  m.def("moe_buffer_bytes", [](int world, int num_experts, int top_k, int max_tokens, int hidden,
                               int dtype, int scale_cols, int max_in_flight) {
    MoeConfig c{world, 0, num_experts, top_k, max_tokens, hidden, dtype, scale_cols, max_in_flight};
    if (const char* why = moe_config_error(c)) throw std::invalid_argument(why);
    return moe_buffer_bytes(c);
  });
  // Sizes of a MoE communicator's buffer for slot_bytes (0: slots that hold a whole call;
  // moe_layout.h BOUNDED SLOTS): total bytes, data slot bytes and count, tokens and rounds per
  // call of each op, and the slot of the unbounded layout (full_slot_bytes).
  m.def("moe_layout", [](int world, int num_experts, int top_k, int max_tokens, int hidden,
                         int dtype, int scale_cols, int max_in_flight, int64_t slot_bytes) {
    MoeConfig c{world, 0, num_experts, top_k, max_tokens, hidden, dtype, scale_cols, max_in_flight,
                slot_bytes};
    if (const char* why = moe_config_error(c)) throw std::invalid_argument(why);
    nb::dict d;
    d["total"] = moe_buffer_bytes(c);
    d["bounded"] = moe_bounded(c);
    d["ctrl_bytes"] = kCtrlBytes;
    d["slot_bytes"] = moe_half_bytes(c);
    d["slots"] = moe_slots(c);
    d["full_slot_bytes"] = moe_full_half_bytes(c);
    d["dispatch_call_bytes"] = moe_dispatch_region_bytes(c);  // a whole call's rows of each op
    d["combine_call_bytes"] = moe_combine_region_bytes(c);
    d["dispatch_round_tokens"] = moe_dispatch_round_tokens(c);
    d["combine_round_tokens"] = moe_combine_round_tokens(c);
    d["dispatch_rounds"] = moe_dispatch_rounds(c);
    d["combine_rounds"] = moe_combine_rounds(c);
    // with a 16-bit expert_y (landing rows of its dtype): twice the tokens per round
    d["combine_round_tokens_16"] = moe_combine_round_tokens(c, kMoeBF16);
    d["combine_rounds_16"] = moe_combine_rounds(c, kMoeBF16);
    // the smallest bounded slot: one token's rows of either op
    const size_t one_d = moe_dispatch_region_rows_bytes(c, 1), one_c = moe_combine_row_bytes(c);
    d["min_slot_bytes"] = align_up(one_d > one_c ? one_d : one_c, 256);
    return d;
  });
  m.def("layout", [](uint64_t max_message_bytes, int world) {
    nb::dict d;
    d["ctrl_bytes"] = kCtrlBytes;
    d["flag_half"] = flag_half_bytes(max_message_bytes, world);
    d["lamport_offset"] = lamport_offset(max_message_bytes, world);
    d["lamport_slot"] = lamport_slot_bytes(max_message_bytes, world);
    d["total"] = comm_buffer_bytes(max_message_bytes, world);
    d["max_world"] = kMaxWorld;
    return d;
  });
}

}  // namespace nvc
