#include <map>
#include <mutex>
#include <utility>

#include "kernels/common.cuh"

namespace flashhead {
namespace detail {

namespace {
// Asked per launch (an attribute query, no synchronisation) so a process that switches devices
// gets the right answer.
bool dependent_launch_supported() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major >= 9;
}

cudaError_t current_device_attribute(cudaDeviceAttr attribute, int* value) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  return err == cudaSuccess ? cudaDeviceGetAttribute(value, attribute, device) : err;
}
}  // namespace

cudaError_t multiprocessor_count(int* count) { return current_device_attribute(cudaDevAttrMultiProcessorCount, count); }
cudaError_t l2_cache_bytes(int* bytes) { return current_device_attribute(cudaDevAttrL2CacheSize, bytes); }

namespace {
bool programmatic_launch_allowed(const KernelSmem& smem) {
  return smem.ptx_version >= 90 && dependent_launch_supported();
}
}  // namespace

bool dependent_launch_compiled(const void* kernel) {
  KernelSmem smem{};
  return kernel_smem(kernel, &smem) == cudaSuccess && programmatic_launch_allowed(smem);
}

namespace {

struct KernelOnDevice {
  KernelSmem smem;
  size_t allowed;                                   // the dynamic shared memory limit as set now
  std::map<std::pair<int, size_t>, int> resident;  // (threads, dynamic bytes) -> blocks an SM
};

struct KernelRegistry {
  std::mutex mutex;  // held across the queries and the sets, so two threads never interleave them
  std::map<std::pair<const void*, int>, KernelOnDevice> by_device;
};

// Never destroyed: a launch made while other static objects are torn down still finds it.
KernelRegistry& registry() {
  static KernelRegistry* const kernels = new KernelRegistry;
  return *kernels;
}

// `kernel` on the current device, queried on first use; the caller holds the registry's mutex.
cudaError_t kernel_on_device(const void* kernel, KernelOnDevice** found) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const auto key = std::make_pair(kernel, device);
  auto& kernels_by_device = registry().by_device;
  if (const auto it = kernels_by_device.find(key); it != kernels_by_device.end()) {
    *found = &it->second;
    return cudaSuccess;
  }
  cudaFuncAttributes attributes{};
  int optin = 0;
  if (cudaError_t err = cudaFuncGetAttributes(&attributes, kernel); err != cudaSuccess) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
      err != cudaSuccess)
    return err;
  const size_t optin_bytes = static_cast<size_t>(optin);
  const size_t max_dynamic = optin_bytes > attributes.sharedSizeBytes ? optin_bytes - attributes.sharedSizeBytes : 0;
  KernelOnDevice entry{{attributes.ptxVersion, max_dynamic},
                       static_cast<size_t>(attributes.maxDynamicSharedSizeBytes), {}};
  *found = &kernels_by_device.emplace(key, std::move(entry)).first->second;
  return cudaSuccess;
}

// The caller holds the registry's mutex.
cudaError_t raise_dynamic_limit(const void* kernel, KernelOnDevice* entry, size_t bytes) {
  if (bytes <= entry->allowed) return cudaSuccess;
  if (bytes > entry->smem.max_dynamic) return cudaErrorInvalidValue;  // as the runtime's own check
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
      err != cudaSuccess)
    return err;
  entry->allowed = bytes;
  return cudaSuccess;
}

}  // namespace

cudaError_t kernel_smem(const void* kernel, KernelSmem* smem) {
  const std::lock_guard<std::mutex> lock(registry().mutex);
  KernelOnDevice* entry = nullptr;
  if (cudaError_t err = kernel_on_device(kernel, &entry); err != cudaSuccess) return err;
  *smem = entry->smem;
  return cudaSuccess;
}

cudaError_t prepare_launch(const void* kernel, size_t smem, bool dependent, bool* programmatic) {
  *programmatic = false;
  if (smem == 0 && !dependent) return cudaSuccess;
  const std::lock_guard<std::mutex> lock(registry().mutex);
  KernelOnDevice* entry = nullptr;
  if (cudaError_t err = kernel_on_device(kernel, &entry); err != cudaSuccess) return err;
  if (cudaError_t err = raise_dynamic_limit(kernel, entry, smem); err != cudaSuccess) return err;
  *programmatic = dependent && programmatic_launch_allowed(entry->smem);
  return cudaSuccess;
}

cudaError_t resident_blocks(const void* kernel, int threads, size_t smem, int* blocks) {
  const std::lock_guard<std::mutex> lock(registry().mutex);
  KernelOnDevice* entry = nullptr;
  if (cudaError_t err = kernel_on_device(kernel, &entry); err != cudaSuccess) return err;
  const auto key = std::make_pair(threads, smem);
  if (const auto it = entry->resident.find(key); it != entry->resident.end()) {
    *blocks = it->second;
    return cudaSuccess;
  }
  // The occupancy of a launch that needs more than the limit is none, so the limit comes first.
  if (cudaError_t err = raise_dynamic_limit(kernel, entry, smem); err != cudaSuccess) return err;
  if (cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernel, threads, smem); err != cudaSuccess)
    return err;
  entry->resident.emplace(key, *blocks);
  return cudaSuccess;
}

}  // namespace detail
}  // namespace flashhead
