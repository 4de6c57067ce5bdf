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
// Slots (or 16-byte quads of slots) whose cluster-table loads a thread keeps in flight at once.
constexpr int kGatherBatch = 4;
constexpr int kGatherQuadBatch = 2;

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
  // division per slot. kGatherBatch slots at a time: their table loads are unconditional (clamped
  // indices; a conditional load compiles to a branch, one round trip each), so they are in flight
  // together, and f runs once they are all back.
  auto for_each_slot = [&](auto f) {
    const int step_k = blockDim.x / cluster_size, step_i = blockDim.x % cluster_size;
    int k = threadIdx.x / cluster_size, i = threadIdx.x % cluster_size;
    for (int j0 = threadIdx.x; j0 < gathered; j0 += kGatherBatch * blockDim.x) {
      int32_t token[kGatherBatch];
      bool known[kGatherBatch];
#pragma unroll
      for (int u = 0; u < kGatherBatch; ++u) {
        const int32_t cluster = cluster_at(min(k, probes - 1));
        known[u] = cluster >= 0 && cluster < num_clusters;
        token[u] = cluster_tokens[int64_t{known[u] ? cluster : 0} * cluster_size + i];
        k += step_k;
        i += step_i;
        if (i >= cluster_size) {
          i -= cluster_size;
          ++k;
        }
      }
#pragma unroll
      for (int u = 0; u < kGatherBatch; ++u) {
        const int j = j0 + u * static_cast<int>(blockDim.x);
        if (j < gathered) f(j, known[u] ? token[u] : -1);
      }
    }
  };
  if (num_extra == 0) {
    if (rows_vectorizable<int32_t>(cluster_tokens, cluster_size) && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
      // Four tokens of a cluster per 16-byte load and store: a quarter of the slot arithmetic.
      const int quads_per_cluster = cluster_size / 4, quads = gathered / 4;
      for (int q0 = threadIdx.x; q0 < quads; q0 += kGatherQuadBatch * blockDim.x) {
        int4 tokens[kGatherQuadBatch];
        bool known[kGatherQuadBatch];
#pragma unroll
        for (int u = 0; u < kGatherQuadBatch; ++u) {  // clamped, unconditional loads (see above)
          const int q = min(q0 + u * static_cast<int>(blockDim.x), quads - 1);
          const int k = q / quads_per_cluster;
          const int32_t cluster = cluster_at(k);
          known[u] = cluster >= 0 && cluster < num_clusters;
          tokens[u] = *reinterpret_cast<const int4*>(cluster_tokens + int64_t{known[u] ? cluster : 0} * cluster_size +
                                                     4 * (q - k * quads_per_cluster));
        }
#pragma unroll
        for (int u = 0; u < kGatherQuadBatch; ++u) {
          const int q = q0 + u * static_cast<int>(blockDim.x);
          if (q < quads) reinterpret_cast<int4*>(out)[q] = known[u] ? tokens[u] : make_int4(-1, -1, -1, -1);
        }
      }
      return;
    }
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
