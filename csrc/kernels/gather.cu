#include "kernels/gather.cuh"

namespace flashhead {
namespace detail {
namespace {

constexpr int kGatherThreads = 256;

struct GatherArgs {
  const int32_t* cluster_ids;  // [B, p]
  int probes;
  const int32_t* cluster_tokens;
  int num_clusters, cluster_size;
  const int32_t* extra_ids;
  int num_extra;
  int32_t* candidates;  // [B, p*b + E]
};

__global__ void __launch_bounds__(kGatherThreads) gather_candidates_kernel(GatherArgs a) {
  __shared__ GatherShared sh;
  const int64_t row = blockIdx.x;
  const int64_t width = int64_t{a.probes} * a.cluster_size + a.num_extra;
  gather_row(a.cluster_ids + row * a.probes, a.probes, a.cluster_tokens, a.num_clusters, a.cluster_size, a.extra_ids,
             a.num_extra, a.candidates + row * width, sh);
}

}  // namespace
}  // namespace detail

cudaError_t launch_gather_candidates(const int32_t* cluster_ids, int batch, int probes, const int32_t* cluster_tokens,
                                     int num_clusters, int cluster_size, const int32_t* extra_ids, int num_extra,
                                     int32_t* candidates, cudaStream_t stream) {
  if (batch == 0 || int64_t{probes} * cluster_size + num_extra == 0) return cudaSuccess;
  const detail::GatherArgs args{cluster_ids, probes, cluster_tokens, num_clusters, cluster_size,
                                extra_ids,   num_extra, candidates};
  return detail::launch_kernel(detail::gather_candidates_kernel, dim3(batch), dim3(detail::kGatherThreads), 0, stream,
                               false, args);
}

}  // namespace flashhead
