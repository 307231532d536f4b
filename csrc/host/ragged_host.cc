// Host ragged_all_to_all (protocol in ragged_host.h, layout in common/ragged_layout.h).
#include "ragged_host.h"

#include <atomic>
#include <cstring>

#include "../common/ragged_layout.h"
#include "host_sync.h"

namespace nvc {
namespace host {
namespace {

int64_t at(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : int64_t(static_cast<const int32_t*>(p)[i]);
}

// The first field of slice i outside its bounds (ragged_slice_detail's codes), -1 if none.
int bad_field(const RaggedHostArgs& a, int64_t i) {
  return ragged_slice_field(at(a.input_offsets, a.offsets_64, i),
                            at(a.send_sizes, a.offsets_64, i),
                            at(a.output_offsets, a.offsets_64, i), a.n_rows, a.m_rows);
}

std::string slice_numbers(const RaggedHostArgs& a, int64_t i, int dest) {
  return " (input_offsets[" + std::to_string(i) + "]=" +
         std::to_string(at(a.input_offsets, a.offsets_64, i)) + ", send_sizes[" +
         std::to_string(i) + "]=" + std::to_string(at(a.send_sizes, a.offsets_64, i)) +
         ", output_offsets[" + std::to_string(i) + "]=" +
         std::to_string(at(a.output_offsets, a.offsets_64, i)) + "; operand rows N=" +
         std::to_string(a.n_rows) + ", output rows M=" + std::to_string(a.m_rows) +
         "; the slice goes to rank " + std::to_string(dest) + ")";
}

std::string recv_numbers(int64_t e, int64_t sent, int64_t want, int64_t k) {
  return " (sent " + std::to_string(sent) + " rows, recv_sizes[" + std::to_string(e) +
         "]=" + std::to_string(want) + ", k=" + std::to_string(k) + " slices per peer)";
}

int64_t load_relaxed(const int64_t* p) {
  return std::atomic_ref<int64_t>(*const_cast<int64_t*>(p)).load(std::memory_order_relaxed);
}

char* row(void* base, int64_t r, size_t row_bytes) {
  return static_cast<char*>(base) + size_t(r) * row_bytes;
}
const char* row(const void* base, int64_t r, size_t row_bytes) {
  return static_cast<const char*>(base) + size_t(r) * row_bytes;
}

}  // namespace

std::string ragged_all_to_all(const CommView& v, const RaggedHostArgs& a) {
  const int W = v.world, me = v.rank;
  const int64_t k = a.k, K = int64_t(W) * a.k;
  const size_t rb = a.row_bytes;
  const uint32_t desc = ragged_desc(a.n_rows, a.m_rows, rb, k);
  const uint64_t seq = begin_call(v);
  if (!ragged_fits(v.max_message_bytes, W, a.m_rows, rb, k))
    return record_error(v, kErrCapacity, desc, me, seq, uint64_t(a.m_rows) * rb);

  // 1. my slices, all of them before anything is pushed
  for (int64_t i = 0; i < K; ++i) {
    const int f = bad_field(a, i);
    if (f < 0) continue;
    publish(v, seq, kRaggedPoisonDesc, 0);
    return record_error(v, kErrRaggedSlice, desc, me, seq, ragged_slice_detail(i, uint32_t(f))) +
           slice_numbers(a, i, int(i / k));
  }

  // 2. push my rows and header entries into every peer's half, then raise my flags
  for (int d = 0; d < W; ++d) {
    if (d == me) continue;
    char* half = v.half(d, seq);
    char* frame = ragged_frame(half, W, k);
    RaggedSlice* hdr = ragged_header(half);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = d * k + j;
      const int64_t oo = at(a.output_offsets, a.offsets_64, i);
      const int64_t ss = at(a.send_sizes, a.offsets_64, i);
      std::memcpy(row(frame, oo, rb), row(a.operand, at(a.input_offsets, a.offsets_64, i), rb),
                  size_t(ss) * rb);
      hdr[me * k + j] = RaggedSlice{oo, ss};
    }
  }
  publish(v, seq, desc, 0);

  // 3. my slices to myself, then every peer's once its flag is up
  for (int64_t j = 0; j < k; ++j) {
    const int64_t i = me * k + j;
    const int64_t ss = at(a.send_sizes, a.offsets_64, i);
    const int64_t rs = at(a.recv_sizes, a.offsets_64, i);
    if (ss != rs)
      return record_error(v, kErrRaggedRecv, desc, me, seq, ragged_recv_detail(j, ss, rs)) +
             recv_numbers(i, ss, rs, k);
    std::memmove(row(a.out, at(a.output_offsets, a.offsets_64, i), rb),
                 row(a.operand, at(a.input_offsets, a.offsets_64, i), rb), size_t(ss) * rb);
  }
  std::string err = wait_all(v, seq, desc, 0);
  if (!err.empty()) return err;
  char* mine = v.half(me, seq);
  const char* frame = ragged_frame(mine, W, k);
  const RaggedSlice* hdr = ragged_header(mine);
  for (int src = 0; src < W; ++src) {
    if (src == me) continue;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = src * k + j;
      const int64_t off = load_relaxed(&hdr[e].offset);
      const int64_t size = load_relaxed(&hdr[e].size);
      const int64_t want = at(a.recv_sizes, a.offsets_64, e);
      if (size != want)
        return record_error(v, kErrRaggedRecv, desc, src, seq,
                            ragged_recv_detail(j, size, want)) + recv_numbers(e, size, want, k);
      if (off < 0 || off > a.m_rows - size)  // the sender validated it: memory corruption
        return record_error(v, kErrRaggedSlice, desc, src, seq,
                            ragged_slice_detail(int64_t(me) * k + j, 4));  // src's slice index
      std::memcpy(row(a.out, off, rb), row(frame, off, rb), size_t(size) * rb);
    }
  }
  end_call(v, seq);
  return "";
}

}  // namespace host
}  // namespace nvc
