// Extension module `jax_nvcomm._host`: the host (CPU devices) backend. Shared-memory transport,
// rank-context registration, and the XLA:CPU FFI handlers (registered from Python).
#include <nanobind/nanobind.h>

#include "common/bindings.h"
#include "common/ragged_layout.h"
#include "transport/host_shm.h"

namespace nb = nanobind;
using namespace nvc;

NB_MODULE(_host, m) {
  add_common_bindings(m);
  m.def("shm_create", [](const std::string& name, uint64_t bytes) {
    return reinterpret_cast<uint64_t>(host::shm_create(name, bytes));
  });
  m.def("shm_map", [](const std::string& name, uint64_t bytes) {
    return reinterpret_cast<uint64_t>(host::shm_map(name, bytes));
  });
  m.def("shm_unlink", [](const std::string& name) { host::shm_unlink(name); });
  m.def("shm_unmap", [](uint64_t addr, uint64_t bytes) {
    host::shm_unmap(reinterpret_cast<void*>(addr), bytes);
  });
  m.def("register_rank", [](int64_t comm_id, int64_t slot, int rank, int world,
                            std::vector<uint64_t> bufs, uint64_t timeout_ns,
                            uint64_t max_message_bytes) {
    auto c = std::make_shared<RankContext>();
    c->comm_id = comm_id;
    c->slot = slot;
    c->owned_err = std::make_unique<ErrorInfo>();
    *c->owned_err = ErrorInfo{};
    c->err_host = c->owned_err.get();
    c->view = make_view(rank, world, bufs, timeout_ns, max_message_bytes, c->err_host);
    registry().add(std::move(c));
  });
  // close() while calls may still run (XLA:CPU executes asynchronously): the mappings are
  // unmapped when the last context of comm_id is released, i.e. after unregister() and after
  // any handler still holding one returns (its peers' later calls fail the lookup instead).
  m.def("unmap_after_last_use", [](int64_t comm_id, std::vector<uint64_t> addrs,
                                   std::vector<uint64_t> sizes) {
    struct Mappings {
      std::vector<uint64_t> addrs, sizes;
      ~Mappings() {
        for (size_t i = 0; i < addrs.size(); ++i)
          host::shm_unmap(reinterpret_cast<void*>(addrs[i]), sizes[i]);
      }
    };
    auto keep = std::make_shared<Mappings>();  // built in place: a temporary would unmap
    keep->addrs = std::move(addrs);
    keep->sizes = std::move(sizes);
    registry().for_each(comm_id, [&](RankContext& c) { c.resources = keep; });
  });
  // ragged_layout.h ragged_fits: whether a ragged_all_to_all with an output of m_rows rows of
  // row_bytes and k slices per peer fits a Communicator's buffers (jax_nvcomm/ragged.py).
  m.def("ragged_fits", [](uint64_t max_message_bytes, int world, int64_t m_rows,
                          uint64_t row_bytes, int64_t k) {
    return ragged_fits(max_message_bytes, world, m_rows, row_bytes, k);
  });
  // ragged_layout.h ragged_chunk_max: the largest slot of the chunked path (0: none fits).
  m.def("ragged_chunk_max", [](uint64_t max_message_bytes, int world, int64_t k) {
    return uint64_t(ragged_chunk_max(max_message_bytes, world, k));
  });
  m.def("read_seq", [](uint64_t buf_addr) {
    return reinterpret_cast<const Ctrl*>(buf_addr)->seq;
  });
}
