// Host-memory all_gather_v / reduce_scatter_v for CPU devices: the protocols of
// kernels/varlen.cuh in the pull model of host_sync.h (one phase, every call waits for every
// peer). Layout: common/varlen_layout.h, except that each rank writes only its own half:
//   all_gather_v: header[0] = my count, slot 0 = my rows; readers place rank src's rows at
//     offset(src) = sum of the counts of ranks < src; rows past the total are zeroed when
//     zero_tail.
//   reduce_scatter_v: header[0 .. W] = my offsets (readers check they give them the count they
//     expect), slot area = my y rows [0, total); owner `me` sums rows offsets[me] .. of every
//     rank's copy in float32 in rank order 0..W-1 from +0.0, as the CUDA kernel does.
// Bad counts / offsets: this rank's flag is poisoned (peers report "rank X failed this call") and
// the call returns the error text (kErrRowCount); offsets that differ between ranks:
// kErrOffsetsDiffer on the rank that finds it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "../common/layout.h"

namespace nvc {
namespace host {

std::string all_gather_v(const CommView& v, const void* in, int32_t num_rows, void* out,
                         int32_t* offsets, int32_t* total, int64_t max_rows, size_t row_bytes,
                         bool zero_tail);
// dtype: 0 f32, 1 bf16, 2 f16 (dtypes.h codes).
std::string reduce_scatter_v(const CommView& v, const void* y, const int32_t* offsets, void* out,
                             int64_t max_rows, size_t row_bytes, int dtype);

}  // namespace host
}  // namespace nvc
