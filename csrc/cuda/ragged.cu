// Launch configuration of the CUDA ragged_all_to_all (kernels/ragged.cuh): validation of the
// static arguments, the grid (a pure function of the static sizes, identical on every rank) and
// one launch per call.
#include "ragged.h"

#include <cstdint>

#include "../kernels/ragged.cuh"
#include "device_cache.h"

namespace nvc {
namespace cuda {
namespace {

// Bytes a block moves at most: a grid for ~32 KiB per block (as MoE and varlen), so decode
// (a few rows) takes a few blocks and prefill (tens of MiB) all kMaxBlocks.
constexpr uint64_t kRaggedBlockBytes = 32 << 10;

const void* kernel_of(bool offsets_64, bool chunked) {
  if (chunked)
    return offsets_64 ? reinterpret_cast<const void*>(dev::ragged_chunked_kernel<long long>)
                      : reinterpret_cast<const void*>(dev::ragged_chunked_kernel<int>);
  return offsets_64 ? reinterpret_cast<const void*>(dev::ragged_kernel<long long>)
                    : reinterpret_cast<const void*>(dev::ragged_kernel<int>);
}

}  // namespace

int ragged_grid(int64_t n_rows, int64_t m_rows, size_t row_bytes, int64_t k, int world) {
  (void)k;      // the slices of a call share the block's work whatever their number
  (void)world;  // a rank sends <= n_rows rows and receives <= m_rows rows, whatever W
  const uint64_t rows = uint64_t(n_rows > m_rows ? (n_rows > 0 ? n_rows : 0)
                                                 : (m_rows > 0 ? m_rows : 0));
  const uint64_t cap = uint64_t(kMaxBlocks) * kRaggedBlockBytes;
  const uint64_t bytes = row_bytes != 0 && rows > cap / row_bytes ? cap : rows * row_bytes;
  const uint64_t blocks = (bytes + kRaggedBlockBytes - 1) / kRaggedBlockBytes;
  return blocks < 1 ? 1 : blocks > uint64_t(kMaxBlocks) ? kMaxBlocks : int(blocks);
}

const char* ragged_check(const CommView& v, const RaggedArgs& a) {
  if (v.world < 1 || v.world > kMaxWorld || v.rank < 0 || v.rank >= v.world)
    return "rank or world outside the communicator's range (world 1..16)";
  if (a.k < 1) return "k (slices per peer) must be >= 1";
  if (a.row_bytes == 0) return "row_bytes must be > 0";
  if (a.n_rows < 0 || a.m_rows < 0) return "operand and output row counts must be >= 0";
  if (a.k > int64_t(INT32_MAX) / v.world) return "k * world exceeds int32";
  if (const char* why = ragged_size_problem(v.max_message_bytes, v.world, a.n_rows, a.m_rows,
                                            a.row_bytes, a.k, a.chunk))
    return why;
  if (!a.input_offsets || !a.send_sizes || !a.output_offsets || !a.recv_sizes)
    return "null offsets or sizes array";
  if ((a.n_rows > 0 && !a.operand) || (a.m_rows > 0 && !a.out)) return "null operand or output";
  return nullptr;
}

int ragged_blocks(const CommView& v, const RaggedArgs& a) {
  int g = ragged_grid(a.n_rows, a.m_rows, a.row_bytes, a.k, v.world);
  if (v.context_ranks <= 1) return g;
  const int resident =
      a.chunk > 0
          ? (a.offsets_64
                 ? resident_blocks_cached<dev::ragged_chunked_kernel<long long>,
                                          dev::kRaggedThreads>()
                 : resident_blocks_cached<dev::ragged_chunked_kernel<int>, dev::kRaggedThreads>())
          : (a.offsets_64
                 ? resident_blocks_cached<dev::ragged_kernel<long long>, dev::kRaggedThreads>()
                 : resident_blocks_cached<dev::ragged_kernel<int>, dev::kRaggedThreads>());
  if (resident <= 0) return 1;  // a query failed: every virtual rank gets the same answer
  const int cap = resident / v.context_ranks;
  if (g > cap) g = cap;
  return g < 1 ? 1 : g;
}

cudaError_t ragged_all_to_all(const CommView& v, const RaggedArgs& a, cudaStream_t s) {
  if (ragged_check(v, a) != nullptr) return cudaErrorInvalidValue;
  return ragged_launch(v, a, s);
}

cudaError_t ragged_launch(const CommView& v, const RaggedArgs& a, cudaStream_t s) {
  const dev::RaggedKernelArgs ka{static_cast<const char*>(a.operand),
                                 static_cast<char*>(a.out),
                                 a.input_offsets,
                                 a.send_sizes,
                                 a.output_offsets,
                                 a.recv_sizes,
                                 a.n_rows,
                                 a.m_rows,
                                 int64_t(a.row_bytes),
                                 a.k,
                                 ragged_desc(a.n_rows, a.m_rows, a.row_bytes, a.k, a.chunk),
                                 a.chunk};
  const unsigned g = unsigned(ragged_blocks(v, a));
  if (a.chunk > 0) {
    if (a.offsets_64)
      dev::ragged_chunked_kernel<long long><<<g, dev::kRaggedThreads, 0, s>>>(v, ka);
    else
      dev::ragged_chunked_kernel<int><<<g, dev::kRaggedThreads, 0, s>>>(v, ka);
    return cudaGetLastError();
  }
  if (a.offsets_64)
    dev::ragged_kernel<long long><<<g, dev::kRaggedThreads, 0, s>>>(v, ka);
  else
    dev::ragged_kernel<int><<<g, dev::kRaggedThreads, 0, s>>>(v, ka);
  return cudaGetLastError();
}

cudaError_t ragged_load_kernels() {
  cudaFuncAttributes attr;
  for (int variant = 0; variant < 4; ++variant) {
    const void* f = kernel_of(variant & 1, variant & 2);
    if (cudaError_t e = cudaFuncGetAttributes(&attr, f); e != cudaSuccess) return e;
    // the package's one shared-memory carveout (moe.cu, allreduce_prepare.h): an SM changes its
    // split only when idle, and spinning blocks of another kernel may keep every SM busy
    if (cudaError_t e = cudaFuncSetAttribute(f, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             int(cudaSharedmemCarveoutMaxShared));
        e != cudaSuccess)
      return e;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace nvc
