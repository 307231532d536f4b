// Launch configuration of the CUDA all_gather_v / reduce_scatter_v: a pure function of the
// static sizes, identical on every rank; few blocks, all resident.
#include "varlen.h"

#include "../kernels/varlen.cuh"

namespace nvc {
namespace cuda {

int varlen_grid(int64_t max_rows, size_t row_bytes) {
  // ~32 KiB of capacity per block, at most 32 blocks (as all_gather: more does not help over
  // NVLink), and never more blocks than rows.
  const size_t cap = size_t(max_rows) * row_bytes;
  size_t blocks = (cap + 32767) / 32768;
  if (blocks > 32) blocks = 32;
  if (blocks > size_t(max_rows)) blocks = size_t(max_rows);
  if (blocks < 1) blocks = 1;
  return int(blocks);
}

const char* varlen_check(const CommView& v, int64_t max_rows, size_t row_bytes, int dtype) {
  if (max_rows < 1 || row_bytes == 0) return "empty rows";
  if (max_rows > int64_t(0x7FFFFFFF) / v.world) return "world * max_rows exceeds int32";
  if (!varlen_fits(v.max_message_bytes, v.world, max_rows, row_bytes))
    return "world * max_rows * row bytes exceeds the communicator's max_message_bytes";
  if (dtype >= 0) {
    if (row_bytes % 16 != 0) return "row bytes must be a multiple of 16";
    if (dtype > 2) return "dtype must be float32, bfloat16 or float16";
  }
  return nullptr;
}

cudaError_t all_gather_v(const CommView& v, const void* in, const int32_t* num_rows, void* out,
                         int32_t* offsets_out, int32_t* total_out, int64_t max_rows,
                         size_t row_bytes, bool zero_tail, cudaStream_t s) {
  if (varlen_check(v, max_rows, row_bytes, -1) != nullptr) return cudaErrorInvalidValue;
  const int g = varlen_grid(max_rows, row_bytes);
  const uint32_t desc = make_desc(kOpAllGatherV, uint64_t(max_rows), row_bytes);
  dev::all_gather_v_kernel<<<unsigned(g), dev::kVarlenThreads, 0, s>>>(
      v, static_cast<const char*>(in), num_rows, static_cast<char*>(out), offsets_out, total_out,
      max_rows, row_bytes, varlen_slot_bytes(max_rows, row_bytes), desc, zero_tail);
  return cudaGetLastError();
}

cudaError_t reduce_scatter_v(const CommView& v, const void* y, const int32_t* offsets, void* out,
                             int64_t max_rows, size_t row_bytes, int dtype, cudaStream_t s) {
  if (dtype < 0 || varlen_check(v, max_rows, row_bytes, dtype) != nullptr)
    return cudaErrorInvalidValue;
  const int g = varlen_grid(max_rows, row_bytes);
  const uint32_t desc = make_desc(kOpReduceScatterV, uint64_t(max_rows), row_bytes * 4 + dtype);
  const size_t slot = varlen_slot_bytes(max_rows, row_bytes);
  const char* yc = static_cast<const char*>(y);
  char* oc = static_cast<char*>(out);
  switch (dtype) {
    case 0:
      dev::reduce_scatter_v_kernel<float><<<unsigned(g), dev::kVarlenThreads, 0, s>>>(
          v, yc, offsets, oc, max_rows, row_bytes, slot, desc);
      break;
    case 1:
      dev::reduce_scatter_v_kernel<__nv_bfloat16><<<unsigned(g), dev::kVarlenThreads, 0, s>>>(
          v, yc, offsets, oc, max_rows, row_bytes, slot, desc);
      break;
    default:
      dev::reduce_scatter_v_kernel<__half><<<unsigned(g), dev::kVarlenThreads, 0, s>>>(
          v, yc, offsets, oc, max_rows, row_bytes, slot, desc);
  }
  return cudaGetLastError();
}

cudaError_t varlen_load_kernels() {
  cudaFuncAttributes a;
  for (const void* f : {reinterpret_cast<const void*>(dev::all_gather_v_kernel),
                        reinterpret_cast<const void*>(dev::reduce_scatter_v_kernel<float>),
                        reinterpret_cast<const void*>(dev::reduce_scatter_v_kernel<__nv_bfloat16>),
                        reinterpret_cast<const void*>(dev::reduce_scatter_v_kernel<__half>)})
    if (cudaError_t e = cudaFuncGetAttributes(&a, f); e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace nvc
