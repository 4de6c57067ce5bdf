// Stage 2b: equal-cluster gather. Candidates of a row are the b tokens of each chosen cluster
// (a row of -1 for an out-of-range cluster id), then the extra ids, an extra id masked to -1
// when it is already among the gathered tokens or repeats an earlier extra id. One block per
// row (gather.cu).
#pragma once

#include "kernels/common.cuh"

namespace flashhead {
namespace detail {

// Extra ids are deduplicated kExtraChunk at a time through shared memory.
constexpr int kExtraChunk = 1024;
// Slots (or 16-byte quads of slots) whose cluster-table loads a thread keeps in flight at once.
constexpr int kGatherBatch = 4;
constexpr int kGatherQuadBatch = 2;

// A masked unit of slots: -1 in each.
template <typename Unit>
__device__ __forceinline__ Unit masked_unit() {
  if constexpr (sizeof(Unit) == sizeof(int32_t)) {
    return -1;
  } else {
    return make_int4(-1, -1, -1, -1);
  }
}

struct GatherShared {
  int32_t extra[kExtraChunk];
  int present[kExtraChunk];
};

// cluster_ids[k]: the k-th chosen cluster id of this row (any int32; out of range is masked).
__device__ inline void gather_row(const int32_t* __restrict__ cluster_ids, int probes,
                                  const int32_t* __restrict__ cluster_tokens, int num_clusters, int cluster_size,
                                  const int32_t* __restrict__ extra_ids, int num_extra, int32_t* __restrict__ out,
                                  GatherShared& sh) {
  const int gathered = probes * cluster_size;
  // f(j, unit) for this thread's units of the slots: one token (Unit int32_t) or, where rows are
  // whole 16-byte vectors, four (int4: a quarter of the slot arithmetic); unit j is unit i of
  // chosen cluster k, with (k, i) stepped without a division per unit. A batch of units at a
  // time: their table loads are unconditional (clamped indices; a conditional load compiles to a
  // branch, one round trip each), so they are in flight together, and f runs once they are back.
  auto for_each_unit = [&](auto unit_type, auto f) {
    using Unit = decltype(unit_type);
    constexpr int kWidth = sizeof(Unit) / sizeof(int32_t);
    constexpr int kBatch = kWidth == 1 ? kGatherBatch : kGatherQuadBatch;
    const int per_cluster = cluster_size / kWidth, units = gathered / kWidth;
    const int step_k = blockDim.x / per_cluster, step_i = blockDim.x % per_cluster;
    int k = threadIdx.x / per_cluster, i = threadIdx.x % per_cluster;
    for (int j0 = threadIdx.x; j0 < units; j0 += kBatch * blockDim.x) {
      Unit unit[kBatch];
      bool known[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int32_t cluster = cluster_ids[min(k, probes - 1)];
        known[u] = cluster >= 0 && cluster < num_clusters;
        unit[u] = reinterpret_cast<const Unit*>(cluster_tokens + int64_t{known[u] ? cluster : 0} * cluster_size)[i];
        k += step_k;
        i += step_i;
        if (i >= per_cluster) {
          i -= per_cluster;
          ++k;
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int j = j0 + u * static_cast<int>(blockDim.x);
        if (j < units) f(j, known[u] ? unit[u] : masked_unit<Unit>());
      }
    }
  };
  if (num_extra == 0) {
    if (rows_vectorizable<int32_t>(cluster_tokens, cluster_size) && reinterpret_cast<uintptr_t>(out) % 16 == 0)
      for_each_unit(int4{}, [&](int j, int4 quad) { reinterpret_cast<int4*>(out)[j] = quad; });
    else
      for_each_unit(int32_t{}, [&](int j, int32_t token) { out[j] = token; });
    return;
  }
  for (int e0 = 0; e0 < num_extra; e0 += kExtraChunk) {
    const int chunk = min(kExtraChunk, num_extra - e0);
    for (int i = threadIdx.x; i < chunk; i += blockDim.x) {
      sh.extra[i] = extra_ids[e0 + i];
      sh.present[i] = 0;
    }
    __syncthreads();
    for_each_unit(int32_t{}, [&](int j, int32_t token) {
      if (e0 == 0) out[j] = token;
      for (int i = 0; i < chunk; ++i)
        if (sh.extra[i] == token) atomicOr(&sh.present[i], 1);
    });
    __syncthreads();
    for (int i = threadIdx.x; i < chunk; i += blockDim.x) {
      const int32_t token = sh.extra[i];
      bool keep = !sh.present[i];
      for (int q = 0; keep && q < e0 + i; ++q) keep = extra_ids[q] != token;
      out[gathered + e0 + i] = keep ? token : -1;
    }
    __syncthreads();  // the next chunk overwrites sh
  }
}

}  // namespace detail
}  // namespace flashhead
