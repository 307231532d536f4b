// What the CUDA part of this build was compiled for: nvcc's architecture list, as a string.
#include "build_info.h"

#define NVC_STR2(...) #__VA_ARGS__
#define NVC_STR(...) NVC_STR2(__VA_ARGS__)

namespace nvc {
namespace cuda {

const char* compiled_archs() {
#ifdef __CUDA_ARCH_LIST__
  return NVC_STR(__CUDA_ARCH_LIST__);
#else
  return "";
#endif
}

}  // namespace cuda
}  // namespace nvc
