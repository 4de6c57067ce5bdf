#include <algorithm>

#include "kernels/centroid_scores.cuh"

namespace flashhead {

namespace {

template <typename T, typename TC, int RB>
cudaError_t launch_scores(const detail::ScoreArgs<T, TC>& args, int sms, cudaStream_t stream) {
  using namespace detail;
  const int tiles = ceil_div(args.batch, RB);
  const int64_t items = int64_t{ceil_div(args.num_clusters, kScoreRowsPerWarp)} * tiles;
  if (items > INT32_MAX) return cudaErrorInvalidValue;
  // As the kernel deals items: round-robin over the blocks for one tile (a block per item, at
  // most), else to a block's warps in turn (a block per kScoreThreads / kWarpSize items).
  const int64_t wanted = tiles == 1 ? items : ceil_div<int64_t>(items, kScoreThreads / kWarpSize);
  const int blocks = static_cast<int>(std::min<int64_t>(wanted, int64_t{sms} * kScoreBlocksPerSm<RB>));
  return launch_kernel(centroid_scores_kernel<T, TC, RB>, dim3(blocks), dim3(kScoreThreads), 0, stream, false, args);
}

}  // namespace

// Batch tiles: one row is the memory-bound case worth its own instantiation; larger batches
// share each centroid load among 8 rows (4 with fp8 centroids: kScoreBatchTile).
template <typename T, typename TC>
cudaError_t launch_centroid_scores(const T* hidden, const TC* centroids, const float* centroid_scale, int batch,
                                   int num_clusters, int hidden_dim, float* scores, const Sampling* sampling, float* keys,
                                   cudaStream_t stream) {
  using namespace detail;
  if (batch == 0) return cudaSuccess;
  // A chunk is 16 bytes of centroids: with fp8 that is 16 elements, 32 bytes of bf16 hidden.
  ScoreArgs<T, TC> args{hidden, centroids, centroid_scale, batch, num_clusters, hidden_dim,
                        rows_vectorizable<T>(hidden, hidden_dim) && rows_vectorizable<TC>(centroids, hidden_dim),
                        scores, sampling ? keys : nullptr, sampling ? sampling->temperature : 1.0f,
                        sampling ? sampling->seed : nullptr};
  int sms = 0;
  const cudaError_t err = multiprocessor_count(&sms);
  if (err != cudaSuccess) return err;
  return batch == 1 ? launch_scores<T, TC, 1>(args, sms, stream)
                    : launch_scores<T, TC, detail::kScoreBatchTile<T, TC>>(args, sms, stream);
}

#define FLASHHEAD_INSTANTIATE(T, TC)                                                                            \
  template cudaError_t launch_centroid_scores<T, TC>(const T*, const TC*, const float*, int, int, int, float*, \
                                                     const Sampling*, float*, cudaStream_t);
FLASHHEAD_FOR_EACH_CENTROID_PAIR(FLASHHEAD_INSTANTIATE)
#undef FLASHHEAD_INSTANTIATE

}  // namespace flashhead
