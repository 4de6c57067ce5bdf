#include "kernels/common.cuh"

namespace flashhead {
namespace detail {

// Asked per launch (an attribute query, no synchronisation) so a process that switches devices
// gets the right answer.
bool dependent_launch_supported() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major >= 9;
}

cudaError_t multiprocessor_count(int* count) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  return err == cudaSuccess ? cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device) : err;
}

}  // namespace detail
}  // namespace flashhead
