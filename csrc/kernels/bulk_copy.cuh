// Bulk copies (sm_90's copy engine, TMA) from global into shared memory, counted on an mbarrier:
// one instruction moves a whole row or chunk, so a few threads keep many bytes in flight without
// holding them in registers. Defined only when compiling for sm_90 or later
// (FLASHHEAD_BULK_COPIES); callers keep a path for older GPUs.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FLASHHEAD_BULK_COPIES 1

namespace flashhead {
namespace detail {

__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// A barrier with one expected arrival a phase; fence_mbarrier_init must follow before copies signal it.
__device__ __forceinline__ void mbarrier_init(uint64_t* barrier) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(barrier)) : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// The one expected arrival of the barrier's phase, which then also waits for `bytes` to land.
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* barrier, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) under the L2 policy `policy`.
__device__ __forceinline__ void copy_bulk(void* dst, const void* src, int bytes, uint64_t* barrier, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          shared_address(dst)),
      "l"(src), "r"(bytes), "r"(shared_address(barrier)), "l"(policy)
      : "memory");
}
// Waits until the barrier's phase number `use` (counted from 0) has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, unsigned use) {
  unsigned done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(shared_address(barrier)), "r"(use & 1u)
        : "memory");
  } while (!done);
}
// Orders this thread's earlier shared-memory accesses before later bulk copies into the same bytes.
__device__ __forceinline__ void fence_before_bulk_copies() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

}  // namespace detail
}  // namespace flashhead
#endif
