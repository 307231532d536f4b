// Host all_gather_v / reduce_scatter_v (protocol in varlen_host.h).
#include "varlen_host.h"

#include <cstring>
#include <vector>

#include "../common/varlen_layout.h"
#include "dtypes.h"
#include "host_sync.h"

namespace nvc {
namespace host {
namespace {

uint64_t count_detail(int64_t count, int64_t max_rows) {
  return uint64_t(uint32_t(int32_t(count))) | (uint64_t(uint32_t(max_rows)) << 32);
}

// Bad input on this rank: poison my flag of this call in every rank (peers stop waiting and
// report "rank X failed this call"), record the error, return its text.
std::string poison(const CommView& v, uint64_t seq, uint32_t code, uint32_t desc, int peer,
                   uint64_t observed) {
  publish(v, seq, kVarlenPoisonDesc, 0);
  return record_error(v, code, desc, peer, seq, observed);
}

int32_t read_i32(const int32_t* p) {
  return std::atomic_ref<int32_t>(*const_cast<int32_t*>(p)).load(std::memory_order_relaxed);
}

}  // namespace

std::string all_gather_v(const CommView& v, const void* in, int32_t num_rows, void* out,
                         int32_t* offsets, int32_t* total, int64_t max_rows, size_t row_bytes,
                         bool zero_tail) {
  const uint32_t desc = make_desc(kOpAllGatherV, uint64_t(max_rows), row_bytes);
  const uint64_t seq = begin_call(v);
  if (!varlen_fits(v.max_message_bytes, v.world, max_rows, row_bytes))
    return record_error(v, kErrCapacity, desc, v.rank, seq,
                        uint64_t(max_rows) * row_bytes * uint64_t(v.world));
  if (num_rows < 0 || num_rows > max_rows)
    return poison(v, seq, kErrRowCount, desc, v.rank, count_detail(num_rows, max_rows));
  const size_t slot = varlen_slot_bytes(max_rows, row_bytes);
  char* mine = v.half(v.rank, seq);
  std::memcpy(varlen_slot(mine, 0, slot), in, size_t(num_rows) * row_bytes);
  varlen_header(mine)[0] = num_rows;
  publish(v, seq, desc, 0);
  std::string err = wait_all(v, seq, desc, 0);
  if (!err.empty()) return err;
  int64_t off = 0;
  for (int src = 0; src < v.world; ++src) {
    char* h = v.half(src, seq);
    const int32_t c = src == v.rank ? num_rows : read_i32(varlen_header(h));
    if (c < 0 || c > max_rows)  // the sender validated it: memory corruption
      return record_error(v, kErrRowCount, desc, src, seq, count_detail(c, max_rows));
    std::memcpy(static_cast<char*>(out) + size_t(off) * row_bytes,
                src == v.rank ? in : varlen_slot(h, 0, slot), size_t(c) * row_bytes);
    offsets[src] = int32_t(off);
    off += c;
  }
  offsets[v.world] = int32_t(off);
  *total = int32_t(off);
  if (zero_tail)
    std::memset(static_cast<char*>(out) + size_t(off) * row_bytes, 0,
              size_t(int64_t(v.world) * max_rows - off) * row_bytes);  // rows past the total
  end_call(v, seq);
  return "";
}

std::string reduce_scatter_v(const CommView& v, const void* y, const int32_t* offsets, void* out,
                             int64_t max_rows, size_t row_bytes, int dtype) {
  const uint32_t desc = make_desc(kOpReduceScatterV, uint64_t(max_rows), row_bytes * 4 + dtype);
  const uint64_t seq = begin_call(v);
  const int W = v.world, me = v.rank;
  if (!varlen_fits(v.max_message_bytes, W, max_rows, row_bytes))
    return record_error(v, kErrCapacity, desc, me, seq,
                        uint64_t(max_rows) * row_bytes * uint64_t(W));
  for (int r = 0; r < W; ++r) {
    const int64_t c = int64_t(offsets[r + 1]) - offsets[r];
    if ((r == 0 && offsets[0] != 0) || c < 0 || c > max_rows)
      return poison(v, seq, kErrRowCount, desc, r, count_detail(c, max_rows));
  }
  const size_t slot = varlen_slot_bytes(max_rows, row_bytes);
  char* mine = v.half(me, seq);
  for (int r = 0; r <= W; ++r) varlen_header(mine)[r] = offsets[r];
  std::memcpy(varlen_slot(mine, 0, slot), y, size_t(offsets[W]) * row_bytes);
  publish(v, seq, desc, 0);
  std::string err = wait_all(v, seq, desc, 0);
  if (!err.empty()) return err;

  const int64_t cme = int64_t(offsets[me + 1]) - offsets[me];
  std::vector<const char*> src(W);
  for (int s = 0; s < W; ++s) {
    char* h = v.half(s, seq);
    const int32_t* ho = varlen_header(h);
    const int32_t lo = s == me ? offsets[me] : read_i32(ho + me);
    const int32_t c = s == me ? int32_t(cme) : read_i32(ho + me + 1) - lo;
    if (c != cme)
      return record_error(v, kErrOffsetsDiffer, desc, s, seq,
                          uint64_t(uint32_t(c)) | (uint64_t(uint32_t(int32_t(cme))) << 32));
    src[s] = (s == me ? static_cast<const char*>(y) : varlen_slot(h, 0, slot)) +
             size_t(lo) * row_bytes;
  }
  const size_t esz = size_t(dtype_size(dtype));
  const size_t per_row = row_bytes / esz;
  const size_t nval = size_t(cme) * per_row;
  for (size_t i = 0; i < nval; ++i) {
    float acc = 0.0f;
    for (int s = 0; s < W; ++s) acc += load_f32(src[s], dtype, i);
    store_f32(out, dtype, i, acc);
  }
  std::memset(static_cast<char*>(out) + size_t(cme) * row_bytes, 0,
              size_t(max_rows - cme) * row_bytes);
  end_call(v, seq);
  return "";
}

}  // namespace host
}  // namespace nvc
