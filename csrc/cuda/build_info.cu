// What the CUDA part of this build was compiled for: nvcc's architecture list.
#include "build_info.h"

namespace nvc {
namespace cuda {

const int* compiled_archs(int* count) {
#ifdef __CUDA_ARCH_LIST__
  static const int archs[] = {__CUDA_ARCH_LIST__};  // e.g. 900,1000
  *count = int(sizeof(archs) / sizeof(archs[0]));
  return archs;
#else
  *count = 0;
  return nullptr;
#endif
}

}  // namespace cuda
}  // namespace nvc
