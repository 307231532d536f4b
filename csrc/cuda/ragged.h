// Launch API of the CUDA ragged_all_to_all (protocol and layout in common/ragged_layout.h,
// kernel in kernels/ragged.cuh).
//
// Contract: every rank calls with the same static sizes (n_rows, m_rows, row_bytes, k, offset
// type), in the same order, one stream per rank; the grid is a pure function of them. No
// allocation, no synchronisation, no host state (CUDA-graph capturable). Offsets and sizes are
// read by the kernel from device memory and validated there (ragged_layout.h step 1).
// `out` is XLA's result buffer, aliased with the `output` operand: the kernel writes only the
// rows that slices land on. chunk == 0 requires ragged_fits(M, W, m_rows, row_bytes, k) (one
// round, ragged_kernel), chunk > 0 ragged_chunk_fits (ragged_chunked_kernel, any output size;
// ragged_layout.h ragged_size_problem); invalid static arguments return cudaErrorInvalidValue
// before anything is launched (ragged_check says why).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

#include "../common/layout.h"

namespace nvc {
namespace cuda {

struct RaggedArgs {
  const void* operand;         // [n_rows, row_bytes]
  void* out;                   // [m_rows, row_bytes], holds `output`'s values on entry
  const void* input_offsets;   // device [W * k], int32 or int64 (offsets_64)
  const void* send_sizes;      // device [W * k]
  const void* output_offsets;  // device [W * k]
  const void* recv_sizes;      // device [W * k]
  bool offsets_64;             // the four arrays are int64 (else int32)
  int64_t n_rows;
  int64_t m_rows;
  size_t row_bytes;            // > 0
  int64_t k;                   // slices per peer, >= 1
  int64_t chunk = 0;           // 0: one round (ragged_fits); > 0: the chunked path's slot bytes
                               // (ragged_chunk_fits; any output size)
};

cudaError_t ragged_all_to_all(const CommView& v, const RaggedArgs& a, cudaStream_t s);
// nullptr when valid, else why not (static text).
const char* ragged_check(const CommView& v, const RaggedArgs& a);
// ragged_all_to_all for a caller that has just run ragged_check(v, a) == nullptr itself (the
// FFI handler, which reports why not): the launch without checking again.
cudaError_t ragged_launch(const CommView& v, const RaggedArgs& a, cudaStream_t s);
// Blocks per launch (pure function of the static sizes).
int ragged_grid(int64_t n_rows, int64_t m_rows, size_t row_bytes, int64_t k, int world);
// Blocks ragged_all_to_all launches for this call: ragged_grid, and with v.context_ranks > 1
// (virtual ranks of one process sharing a GPU: the harness) at most the GPU's resident blocks
// of this kernel / context_ranks, so that every rank's blocks run at once (a rank's blocks spin
// on its peers' flags with no preemption between them). Requires ragged_check(v, a) == nullptr.
int ragged_blocks(const CommView& v, const RaggedArgs& a);
cudaError_t ragged_load_kernels();

}  // namespace cuda
}  // namespace nvc
