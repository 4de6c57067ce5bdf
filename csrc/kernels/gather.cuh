// Stage 2b: equal-cluster gather. Candidates of a row are the b tokens of each chosen cluster
// (a row of -1 for an out-of-range cluster id), then the extra ids, an extra id masked to -1
// when it is already among the gathered tokens or repeats an earlier extra id. One block per
// row (gather.cu); the fused decode calls gather_row from its selection block.
#pragma once

#include "kernels/common.cuh"

namespace flashhead {
namespace detail {

// Extra ids are deduplicated kExtraChunk at a time through shared memory.
constexpr int kExtraChunk = 1024;

struct GatherShared {
  int32_t extra[kExtraChunk];
  int present[kExtraChunk];
};

// cluster_at(k): the k-th chosen cluster id of this row (any int32; out of range is masked).
template <typename ClusterAt>
__device__ void gather_row(ClusterAt cluster_at, int probes, const int32_t* __restrict__ cluster_tokens,
                           int num_clusters, int cluster_size, const int32_t* __restrict__ extra_ids, int num_extra,
                           int32_t* __restrict__ out, GatherShared& sh) {
  const int gathered = probes * cluster_size;
  // f(j, token) for this thread's slots j = k * cluster_size + i, stepping (k, i) without a
  // division per slot.
  auto for_each_slot = [&](auto f) {
    const int step_k = blockDim.x / cluster_size, step_i = blockDim.x % cluster_size;
    int k = threadIdx.x / cluster_size, i = threadIdx.x % cluster_size;
    for (int j = threadIdx.x; j < gathered; j += blockDim.x) {
      const int32_t cluster = cluster_at(k);
      f(j, cluster >= 0 && cluster < num_clusters ? cluster_tokens[int64_t{cluster} * cluster_size + i] : -1);
      k += step_k;
      i += step_i;
      if (i >= cluster_size) {
        i -= cluster_size;
        ++k;
      }
    }
  };
  if (num_extra == 0) {
    for_each_slot([&](int j, int32_t token) { out[j] = token; });
    return;
  }
  for (int e0 = 0; e0 < num_extra; e0 += kExtraChunk) {
    const int chunk = min(kExtraChunk, num_extra - e0);
    for (int i = threadIdx.x; i < chunk; i += blockDim.x) {
      sh.extra[i] = extra_ids[e0 + i];
      sh.present[i] = 0;
    }
    __syncthreads();
    for_each_slot([&](int j, int32_t token) {
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
