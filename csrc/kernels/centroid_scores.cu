#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernels/centroid_scores_mma.cuh"

namespace flashhead {

namespace {

// The scoring grid for `items` items in `tiles` batch tiles, as the kernel deals them: round-robin
// over the blocks for one tile (a block per item, at most), else to a block's warps in turn (a
// block per kScoreWarps items); no more blocks than stay resident.
template <int RB>
int score_blocks(int64_t items, int tiles, int sms) {
  using namespace detail;
  const int64_t wanted = tiles == 1 ? items : ceil_div<int64_t>(items, kScoreWarps);
  return static_cast<int>(std::min<int64_t>(wanted, int64_t{sms} * kScoreBlocksPerSm<RB>));
}

template <typename T, typename TC, int RB, int ROWS>
cudaError_t launch_scores(const detail::ScoreArgs<T, TC>& args, const detail::BlockCandidates& kept, bool vec, int sms,
                          cudaStream_t stream, bool dependent) {
  using namespace detail;
  const int tiles = ceil_div(args.batch, RB);
  const int64_t items = int64_t{ceil_div(args.num_clusters, ROWS)} * tiles;
  const int blocks = score_blocks<RB>(items, tiles, sms);
  // The kernel's item index, an int, steps past the last item by at most a grid's warps.
  if (items > INT32_MAX - int64_t{blocks} * kScoreWarps) return cudaErrorInvalidValue;
  // Kept candidates are planned for this grid (plan_block_candidates sizes it through score_blocks).
  if (kept.per_block > 0 && kept.blocks != blocks) return cudaErrorInvalidValue;
  // Every batch in these tiles that tensor cores take reaches them with 16-byte rows
  // (launch_mma_scores): only rows without are left, so no vector instance is built.
  if constexpr (kScoresOnTensorCores<T, TC> && RB >= kMmaMinBatch<TC>) {
    return launch_kernel(centroid_scores_kernel<T, TC, RB, ROWS, false>, dim3(blocks), dim3(kScoreThreads), 0, stream,
                         dependent, args, kept);
  } else {
    if constexpr (RB == 1) {
      if (kept.per_block > 0) {
        const auto kernel = vec ? centroid_scores_kernel<T, TC, 1, ROWS, true, true>
                                : centroid_scores_kernel<T, TC, 1, ROWS, false, true>;
        return launch_kernel(kernel, dim3(blocks), dim3(kScoreThreads), 0, stream, dependent, args, kept);
      }
    }
    const auto kernel =
        vec ? centroid_scores_kernel<T, TC, RB, ROWS, true> : centroid_scores_kernel<T, TC, RB, ROWS, false>;
    return launch_kernel(kernel, dim3(blocks), dim3(kScoreThreads), 0, stream, dependent, args, kept);
  }
}

// The most centroid rows a warp scores at once in one tile: an item's scores fit the warp's lanes,
// a lane keeps at most 8 16-byte centroid chunks in flight (5 rows with two loads in flight
// spilled the fp8 tile of 2), and five rows at most, the most measured.
template <int RB>
constexpr int kScoreMaxRows = std::min({5, detail::kWarpSize / RB, 8 / detail::kScoreUnroll<RB>});

// A batch of one tile (batch <= RB): the centroid rows a warp scores at once, from 2 to
// kScoreMaxRows, that leave the fewest rows for the busiest warp of the resident grid (each warp's
// rows are a chain of loads and sums); the larger on a tie. The
// Qwen3-0.6B head's 9,496 clusters make 3 at batch 1: one item for every warp of 132 SMs, where 4
// left a quarter of the warps idle (the scoring 0.16 µs slower with bf16 centroids, 0.3 with fp8).
template <int RB>
int tile_rows(int num_clusters, int sms) {
  using namespace detail;
  const int64_t warps = int64_t{sms} * kScoreBlocksPerSm<RB> * kScoreWarps;
  int best = 2;
  int64_t best_rows = INT64_MAX;
  for (int rows = 2; rows <= kScoreMaxRows<RB>; ++rows) {
    const int64_t busiest = ceil_div<int64_t>(ceil_div(num_clusters, rows), warps) * rows;
    if (busiest <= best_rows) best = rows, best_rows = busiest;
  }
  return best;
}
template <typename T, typename TC, int RB>
cudaError_t launch_tile(const detail::ScoreArgs<T, TC>& args, const detail::BlockCandidates& kept, bool vec, int sms,
                        cudaStream_t stream, bool dependent) {
  using namespace detail;
  static_assert(kScoreMaxRows<RB> >= 2 && kScoreMaxRows<RB> <= 5, "the switch below has an instance for each pick");
  switch (tile_rows<RB>(args.num_clusters, sms)) {
    case 2:
      return launch_scores<T, TC, RB, 2>(args, kept, vec, sms, stream, dependent);
    case 3:
      return launch_scores<T, TC, RB, 3>(args, kept, vec, sms, stream, dependent);
    case 4:
      return launch_scores<T, TC, RB, 4>(args, kept, vec, sms, stream, dependent);
    case 5:
      if constexpr (kScoreMaxRows<RB> >= 5) return launch_scores<T, TC, RB, 5>(args, kept, vec, sms, stream, dependent);
      [[fallthrough]];
    default:
      return cudaErrorInvalidValue;  // not reached: the loop picks 2 to kScoreMaxRows
  }
}

template <typename T, typename TC, int NT>
cudaError_t launch_mma_instance(const detail::ScoreArgs<T, TC>& args, int tiles, int chunks, cudaStream_t stream,
                                bool dependent) {
  using namespace detail;
  return launch_kernel(centroid_scores_mma_kernel<T, TC, NT>, dim3(tiles, chunks), dim3(kMmaThreads), 0, stream, dependent,
                       args);
}

// The tensor-core kernel, where it applies (kScoresOnTensorCores, kMmaMinBatch, 16-byte rows;
// mma.sync on 16-bit floats needs sm_80, which the kernels' L2 cache hints need anyway).
// *launched says whether it ran; otherwise the CUDA-core kernel scores.
template <typename T, typename TC>
cudaError_t launch_mma_scores(const detail::ScoreArgs<T, TC>& args, bool vec, cudaStream_t stream, bool dependent,
                              bool* launched) {
  using namespace detail;
  *launched = false;
  if constexpr (kScoresOnTensorCores<T, TC>) {
    if (args.batch < kMmaMinBatch<TC> || !vec) return cudaSuccess;
    *launched = true;
    constexpr int kChunkRows = kMmaMaxTiles<TC> * kMmaTileBatch;
    constexpr int64_t kSliceRows = int64_t{kMaxGridRows} * kChunkRows;
    const int tiles = static_cast<int>(ceil_div<int64_t>(args.num_clusters, kMmaTileRows));
    const int rows = std::min(args.batch, kChunkRows);  // in a chunk
    // Batches past kMaxGridRows chunks go in slices, a launch each.
    for (int64_t first = 0; first < args.batch; first += kSliceRows) {
      ScoreArgs<T, TC> slice = args;
      slice.batch = static_cast<int>(std::min<int64_t>(args.batch - first, kSliceRows));
      slice.row_offset = static_cast<int>(first);
      slice.hidden += first * args.hidden_dim;
      slice.scores += first * args.num_clusters;
      if (slice.keys) slice.keys += first * args.num_clusters;
      if (first > 0) slice.presets = {};  // set by the first slice's launch
      const int chunks = ceil_div(slice.batch, kChunkRows);
      // The fewest n-tiles, in powers of two, that hold a chunk.
      const cudaError_t err =
          rows <= kMmaTileBatch       ? launch_mma_instance<T, TC, 1>(slice, tiles, chunks, stream, dependent)
          : rows <= 2 * kMmaTileBatch ? launch_mma_instance<T, TC, 2>(slice, tiles, chunks, stream, dependent)
          : rows <= 4 * kMmaTileBatch ? launch_mma_instance<T, TC, 4>(slice, tiles, chunks, stream, dependent)
                                      : launch_mma_instance<T, TC, kMmaMaxTiles<TC>>(slice, tiles, chunks, stream, dependent);
      if (err != cudaSuccess) return err;
    }
  }
  return cudaSuccess;
}

}  // namespace

// Batches past 4 rows of bf16 or fp16 with centroids of their dtype, or past 2 with fp8 ones, go to
// tensor cores when their rows are whole 16-byte vectors (launch_mma_scores). Otherwise, batch
// tiles: one row is the memory-bound case worth its own instantiation; batches of 2 and 3-4 share
// each centroid load in tiles of 2 and 4, larger ones among 8 rows (4 with fp8 centroids:
// kScoreBatchTile). In one tile of 8, batch 2 took 6.6 µs longer (the Qwen3-0.6B head, bf16).
template <typename T, typename TC>
cudaError_t detail::launch_scores_keeping(const T* hidden, const TC* centroids, const float* centroid_scale, int batch,
                                          int num_clusters, int hidden_dim, float* scores, const Sampling* sampling,
                                          float* keys, cudaStream_t stream, const WorkspacePresets& presets,
                                          const LaunchOptions& options, const BlockCandidates& kept) {
  if (batch == 0) return cudaSuccess;
  if (kept.per_block > 0 && batch != 1) return cudaErrorInvalidValue;  // the batch-1 kernel keeps them
  ScoreArgs<T, TC> args{hidden, centroids, centroid_scale, batch, num_clusters, hidden_dim,
                        scores, sampling ? keys : nullptr, sampling ? sampling->temperature : 1.0f,
                        sampling ? sampling->seed : nullptr, 0, presets};
  // A chunk is 16 bytes of centroids: with fp8 that is 16 elements, 32 bytes of bf16 hidden.
  const bool vec = rows_vectorizable<T>(hidden, hidden_dim) && rows_vectorizable<TC>(centroids, hidden_dim);
  const bool dependent = options.dependent_launch;
  bool on_tensor_cores = false;
  const cudaError_t mma_err = launch_mma_scores(args, vec, stream, dependent, &on_tensor_cores);
  if (mma_err != cudaSuccess || on_tensor_cores) return mma_err;
  int sms = 0;
  const cudaError_t err = multiprocessor_count(&sms);
  if (err != cudaSuccess) return err;
  if (batch == 1) return launch_tile<T, TC, 1>(args, kept, vec, sms, stream, dependent);
  if (batch == 2) return launch_tile<T, TC, 2>(args, kept, vec, sms, stream, dependent);
  if (batch <= 4) return launch_tile<T, TC, 4>(args, kept, vec, sms, stream, dependent);
  if (batch <= kScoreBatchTile<T, TC>)
    return launch_tile<T, TC, kScoreBatchTile<T, TC>>(args, kept, vec, sms, stream, dependent);
  return launch_scores<T, TC, kScoreBatchTile<T, TC>, kScoreRowsPerWarp>(args, kept, vec, sms, stream, dependent);
}

template <typename T, typename TC>
cudaError_t launch_centroid_scores(const T* hidden, const TC* centroids, const float* centroid_scale, int batch,
                                   int num_clusters, int hidden_dim, float* scores, const Sampling* sampling, float* keys,
                                   cudaStream_t stream, const WorkspacePresets& presets, const LaunchOptions& options) {
  return detail::launch_scores_keeping(hidden, centroids, centroid_scale, batch, num_clusters, hidden_dim, scores,
                                       sampling, keys, stream, presets, options, {});
}

namespace detail {
namespace {
// A row's p best keys are taken to fall among its clusters as a random sample would: a block of
// n keys then holds about binomial(n, p / C) of them. Blocks keep as few candidates as make the
// chance that any block holds more, which sends the row to the whole-row selection, at most this.
constexpr double kRareWholeRowSelection = 1e-3;
int candidates_a_block(int keys_a_block, int blocks, double share) {
  if (share >= 0.5) return keys_a_block;
  double term = std::pow(1.0 - share, keys_a_block), at_most_k = term;
  for (int k = 0; k < keys_a_block; ++k) {
    if (blocks * (1.0 - at_most_k) <= kRareWholeRowSelection) return k;
    term *= double(keys_a_block - k) / (k + 1) * share / (1.0 - share);
    at_most_k += term;
  }
  return keys_a_block;
}
}  // namespace

// The batch-1 grid as launch_tile and launch_scores deal it. Candidates pay where they are at most
// half the row: the selection's bound and compaction then run on a few keys a thread.
BlockCandidates plan_block_candidates(int num_clusters, int probes, int sms) {
  const int rows = tile_rows<1>(num_clusters, sms);
  const int items = ceil_div(num_clusters, rows);
  const int blocks = score_blocks<1>(items, 1, sms);
  const int slots = ceil_div(items, blocks * kScoreWarps) * kScoreWarps * rows;
  const int keys_a_block = ceil_div(items, blocks) * rows;
  if (slots > kBlockCandidateSlots || blocks > kBlockCandidateBlocksMax) return {};
  const int k = candidates_a_block(keys_a_block, blocks, double(probes) / num_clusters);
  if (k >= keys_a_block || int64_t{blocks} * k > std::min(kBlockCandidatesMax, num_clusters / 2)) return {};
  BlockCandidates plan;
  plan.blocks = blocks;
  plan.per_block = k;
  plan.slots = slots;
  return plan;
}
}  // namespace detail

#define FLASHHEAD_INSTANTIATE(T, TC)                                                                            \
  template cudaError_t launch_centroid_scores<T, TC>(const T*, const TC*, const float*, int, int, int, float*, \
                                                     const Sampling*, float*, cudaStream_t,                          \
                                                     const WorkspacePresets&, const LaunchOptions&);            \
  template cudaError_t detail::launch_scores_keeping<T, TC>(const T*, const TC*, const float*, int, int, int,  \
                                                            float*, const Sampling*, float*, cudaStream_t,     \
                                                            const WorkspacePresets&, const LaunchOptions&,     \
                                                            const BlockCandidates&);
FLASHHEAD_FOR_EACH_CENTROID_PAIR(FLASHHEAD_INSTANTIATE)
#undef FLASHHEAD_INSTANTIATE

}  // namespace flashhead
