// The whole-op launchers: select_clusters / sample_clusters (scores, then an ordered selection)
// and the fused decode (scores, selection, candidate reduction), three kernels chained with
// programmatic dependent launch where the device has it. The candidate kernel reads each slot's
// token from the chosen clusters' table rows.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/block_candidates.cuh"
#include "kernels/decode.cuh"

namespace flashhead {
namespace detail {
namespace {

struct DecodeWorkspace {
  float* scores;
  float* keys;
  int32_t* cluster_ids;        // [B, p]
  RowTicket* tickets;
  unsigned long long* claims;  // [1 + C], greedy by claimed cluster
  int32_t* claimed_groups;     // [most_claimed_groups]
  RowPartial* partials;
  uint32_t* extra_repeats;     // [B, E], sampling
  RowPartial* extra_partials;  // [B, E], sampling
  unsigned long long* early_best;  // greedy batch 1: [early_words], the clusters' bests, then
  uint64_t* block_bests;           // the blocks' bests (early_best + C)
  void* select;
  BlockCandidates kept;
};

// The decodes' clusters are unranked: the greedy argmax does not depend on their order, nor does
// the sampled draw, whose Gumbel noise is indexed by token id. Sampling's log-normaliser is a
// float sum in slot order, though, so its list keeps one order from run to run.
SelectOrder decode_order(bool sampling) { return sampling ? SelectOrder::kStable : SelectOrder::kAny; }

// Greedy batches of kClaimedMinRows rows or more read each chosen cluster once for every
// kClaimedGroupRows rows that chose it when the rows make, between them, enough choices a cluster
// (B p / C). That is 2 with two claimed blocks an SM: on real SmolLM2-135M batches (54 MiB of
// rows, an H200's 60 MiB L2) the claimed kernel was faster from there on at every measured point
// but one (by up to 22%; 1% slower at that one) and up to 14% slower below, as the row-by-row
// kernel's reads of shared rows hit L2. With three (bfloat16 rows up to about 1,180 values) it is
// 7/4: 2.4-6.2% faster there at batches 16, 32 and 64, from 3.8% faster to 1.3% slower at 1.5.
// Embeddings of more than twice the L2 with rows of up to 2 KB stream from DRAM, and there it
// gains from 5/4: the same real choices over Qwen3-0.6B's 151,936 rows of 2 KB were 1-13% faster
// from 1.3 choices and within 2% either way at 1.15 (random rows gained from 0.7). So do the wider
// rows of three blocks: at 1,088 and 1,152 values (2.1 and 2.3 KB) the claimed kernel was 0.4-1.4%
// faster at 1.3 choices, 0.6% slower to 4.3% faster at 1.5, 2.7-10.4% faster from 1.75, and
// 0.7-8.2% slower below 1.3. Wider rows at two blocks gain less: with 2.5 and 3 KB rows batch 64
// was 1.4-7.3% slower from 1.3 to 1.75 choices (0.2-3.4% at 2), batch 16 0.2-7.3% faster from 1.5,
// so they keep the bound of their blocks. Fewer rows do not pay for the claims' memset and atomics
// (docs/benchmarks.md, sessions 46-50).
constexpr int kClaimedMinRows = 16;
struct ChoicesBound {
  int numerator, denominator;  // choices a cluster
};
constexpr ChoicesBound kClaimedMinChoicesStreamed{5, 4}, kClaimedMinChoicesTwoBlocks{2, 1},
    kClaimedMinChoicesThreeBlocks{7, 4};
// The widest rows measured to gain from 5/4 at two blocks an SM.
constexpr size_t kClaimedStreamedRowBytes = 2048;
constexpr bool three_claimed_blocks(int blocks_per_sm) { return blocks_per_sm >= 3; }
constexpr ChoicesBound claimed_min_choices(int blocks_per_sm) {
  return three_claimed_blocks(blocks_per_sm) ? kClaimedMinChoicesThreeBlocks : kClaimedMinChoicesTwoBlocks;
}
constexpr bool at_most(ChoicesBound lower, ChoicesBound upper) {
  return lower.numerator * upper.denominator <= upper.numerator * lower.denominator;
}
// The workspace sets the lists aside from kClaimedMinChoicesStreamed, so it must be the lowest.
static_assert(at_most(kClaimedMinChoicesStreamed, kClaimedMinChoicesTwoBlocks) &&
              at_most(kClaimedMinChoicesStreamed, kClaimedMinChoicesThreeBlocks));
bool makes_choices(const HeadShape& shape, ChoicesBound bound) {
  return bound.denominator * int64_t{shape.batch} * shape.probes >= bound.numerator * int64_t{shape.num_clusters};
}
// Where the claimed kernel may run, at the lowest bound: the workspace then holds its lists, and
// launch_decode takes it if its plan and the embedding's size against the L2 allow.
bool may_decode_by_claimed_cluster(const HeadShape& shape, bool sampling) {
  // The kernel counts its items in an int, with room for a grid stride or two past them; a listed
  // group, c * kClaimedGroupsMax + g, is an int too.
  const bool items_fit = most_claimed_items(shape) <= INT32_MAX / 2;
  const bool groups_fit = int64_t{shape.num_clusters} * kClaimedGroupsMax <= INT32_MAX;
  return !sampling && shape.batch >= kClaimedMinRows && shape.batch <= kClaimedMaxRows && items_fit && groups_fit &&
         makes_choices(shape, kClaimedMinChoicesStreamed);
}
// For a shape may_decode_by_claimed_cluster allows, with the kernel's plan.
template <typename T>
bool decodes_by_claimed_cluster(const HeadShape& shape, const ClaimedPlan& plan) {
  if (plan.smem == 0) return false;
  int l2_bytes = 0;
  const size_t row_bytes = size_t(shape.hidden_dim) * sizeof(T);
  const bool streamed = l2_cache_bytes(&l2_bytes) == cudaSuccess && double(shape.vocab) * row_bytes > 2.0 * l2_bytes;
  const bool gains_from_streaming =
      streamed && (row_bytes <= kClaimedStreamedRowBytes || three_claimed_blocks(plan.blocks_per_sm));
  return makes_choices(shape,
                       gains_from_streaming ? kClaimedMinChoicesStreamed : claimed_min_choices(plan.blocks_per_sm));
}

// SelectOutputs::claims: the count of listed groups, then each cluster's mask of the rows that chose it.
size_t claims_words(const HeadShape& shape) { return 1 + size_t(shape.num_clusters); }

// Upper bound of the candidate kernel's blocks per row (the grid is smaller on small GPUs or
// large batches): sizes the partials from shapes alone.
int max_candidate_blocks(const HeadShape& shape) { return ceil_div(shape.num_candidates(), kCandSlotsPerBlock); }

// Greedy batch 1 may score clusters early (decode.cuh, EarlyClusters): with dependent launch,
// while the selection runs; without it they would only lengthen the candidate kernel.
bool may_score_early(const HeadShape& shape, bool sampling) { return !sampling && shape.batch == 1; }
// Its workspace words, zeroed together by the scoring kernel: the clusters' bests [C], then the
// candidate blocks' [max_candidate_blocks].
int64_t early_words(const HeadShape& shape) { return int64_t{shape.num_clusters} + max_candidate_blocks(shape); }
template <typename T>
bool scores_early(const HeadShape& shape, bool sampling, const LaunchOptions& options) {
  const auto early_instance = decode_candidates_kernel<T, false, false, false, true>;
  return may_score_early(shape, sampling) && options.dependent_launch &&
         dependent_launch_compiled(reinterpret_cast<const void*>(early_instance));
}

// The early clusters' slices for the candidate kernel's grid, or none (items 0): they need one slot
// group a warp in the register instance (a block's rows are then its early cluster's and its
// chosen ones'; only that was measured), and slices that fit early_cluster. *kept: whether the
// selection works from kept candidates; it is cleared where early clusters run and half the blocks'
// slices would not fit (kEarlyShareAfterKept).
EarlyClusters plan_early_clusters(const HeadShape& shape, int blocks, bool staged, bool* kept) {
  EarlyClusters plan{};
  const bool one_group_a_warp = int64_t{blocks} * kCandSlotsPerBlock >= shape.num_candidates();
  const auto slice_width = [&](int items) {
    return ceil_div<int64_t>(int64_t{kEarlyRanks} * shape.num_clusters, std::max(items, 1));
  };
  const int half = blocks * kEarlyShareAfterKept.num / kEarlyShareAfterKept.den;
  const bool half_fits = half >= kEarlyRanks && slice_width(half) <= kEarlyLaneKeys * kWarpSize;
  const int items = *kept && half_fits ? half : blocks * kEarlyShare.num / kEarlyShare.den;
  if (staged || !one_group_a_warp || items < kEarlyRanks) return plan;
  const int64_t width = slice_width(items);
  if (width > kEarlyLaneKeys * kWarpSize) return plan;
  *kept = *kept && half_fits;
  plan.slice_width = static_cast<int>(width);
  plan.items = static_cast<int>(ceil_div<int64_t>(shape.num_clusters, width)) * kEarlyRanks;
  return plan;
}

// Scores and (sampling) keys [B, C], then what the selection kernel needs: at batch 1 the words
// for the scoring blocks' candidates too.
template <typename Carve>
void carve_scores(WorkspaceCarver& carver, const HeadShape& shape, bool sampling, SelectOrder order, Carve& ws) {
  const size_t scores = size_t(shape.batch) * shape.num_clusters;
  ws.scores = carver.take<float>(scores);
  ws.keys = sampling ? carver.take<float>(scores) : nullptr;
  ws.select = carver.take<char>(select_workspace_bytes(shape, order));
  if (shape.batch == 1) {
    ws.kept.pairs = carver.take<uint64_t>(kBlockCandidatesMax);
    ws.kept.cutoffs = carver.take<uint32_t>(kBlockCandidateBlocksMax);
  }
}

// The scoring and selection of a batch-1 row keep candidates where they pay (block_candidates.cuh),
// in the words carve_scores set aside.
cudaError_t plan_kept(const HeadShape& shape, BlockCandidates* kept) {
  if (shape.batch != 1) return cudaSuccess;
  int sms = 0;
  if (const cudaError_t err = multiprocessor_count(&sms); err != cudaSuccess) return err;
  BlockCandidates plan = plan_block_candidates(shape.num_clusters, shape.probes, sms);
  plan.pairs = kept->pairs;
  plan.cutoffs = kept->cutoffs;
  *kept = plan;
  return cudaSuccess;
}

DecodeWorkspace carve_decode(WorkspaceCarver& carver, const HeadShape& shape, bool sampling) {
  DecodeWorkspace ws{};
  carve_scores(carver, shape, sampling, decode_order(sampling), ws);
  ws.cluster_ids = carver.take<int32_t>(size_t(shape.batch) * shape.probes);
  ws.tickets = carver.take<RowTicket>(shape.batch);
  if (may_score_early(shape, sampling)) {
    ws.early_best = carver.take<unsigned long long>(static_cast<size_t>(early_words(shape)));
    if (ws.early_best) ws.block_bests = reinterpret_cast<uint64_t*>(ws.early_best + shape.num_clusters);
  }
  if (may_decode_by_claimed_cluster(shape, sampling)) {
    ws.claims = carver.take<unsigned long long>(claims_words(shape));
    ws.claimed_groups = carver.take<int32_t>(static_cast<size_t>(most_claimed_groups(shape)));
  }
  if (sampling) {
    ws.partials = carver.take<RowPartial>(size_t(shape.batch) * max_candidate_blocks(shape));
    if (shape.num_extra > 0) {
      const size_t extras = size_t(shape.batch) * shape.num_extra;
      ws.extra_repeats = carver.take<uint32_t>(extras);
      ws.extra_partials = carver.take<RowPartial>(extras);
    }
  }
  return ws;
}

struct SelectWorkspace {
  float* scores;
  float* keys;
  void* select;
  BlockCandidates kept;
};

// The candidate kernel's grid for a chunk of `rows` rows: its staged rows' shared memory (0: the
// register instance) and blocks a row.
struct CandidateGrid {
  bool vec;
  size_t smem;
  int blocks;
};
template <typename T, typename TC, typename Kernel>
cudaError_t plan_candidate_grid(const HeadTensors<T, TC>& t, const HeadShape& shape, Kernel staged_instance, int rows,
                                CandidateGrid* grid) {
  const int n = shape.num_candidates(), d = shape.hidden_dim;
  grid->vec = rows_vectorizable<T>(t.hidden, d) && rows_vectorizable<T>(t.embedding, d);
  int sms = 0;
  if (const cudaError_t err = multiprocessor_count(&sms); err != cudaSuccess) return err;
  grid->blocks = candidate_blocks_per_row(n, rows, sms);
  return staged_rows_smem(staged_instance, grid->vec, d, sizeof(T), n, rows, sms, &grid->smem);
}

// The early clusters of a greedy batch-1 decode (items 0: none), their scores and bests in `ws`;
// ws->kept dropped where plan_early_clusters says.
template <typename T, typename TC>
cudaError_t plan_early(const HeadTensors<T, TC>& t, const HeadShape& shape, DecodeWorkspace* ws,
                       EarlyClusters* early) {
  CandidateGrid grid{};
  const cudaError_t err = plan_candidate_grid(t, shape, decode_candidates_kernel<T, false, false, true>, 1, &grid);
  if (err != cudaSuccess) return err;
  bool kept = ws->kept.per_block > 0;
  *early = plan_early_clusters(shape, grid.blocks, grid.smem > 0, &kept);
  if (!kept) ws->kept.per_block = 0;
  early->scores = ws->scores;
  early->best = ws->early_best;
  early->block_bests = ws->block_bests;
  return cudaSuccess;
}

template <typename T, typename TC, bool kSample>
cudaError_t launch_decode_candidates(const HeadTensors<T, TC>& t, const HeadShape& shape, const Sampling* sampling,
                                     const DecodeWorkspace& ws, const EarlyClusters& early, int64_t* tokens,
                                     int64_t token_stride, float* token_logprobs, cudaStream_t stream,
                                     bool dependent) {
  const int n = shape.num_candidates(), d = shape.hidden_dim, max_blocks = max_candidate_blocks(shape);
  const auto instance = [&](auto staged) {
    constexpr bool kStaged = decltype(staged)::value;
    if constexpr (kSample) {
      if (ws.extra_repeats) return decode_candidates_kernel<T, true, true, kStaged>;
    } else if constexpr (!kStaged) {
      if (early.items > 0) return decode_candidates_kernel<T, false, false, false, true>;
    }
    return decode_candidates_kernel<T, kSample, false, kStaged>;
  };
  for (int r0 = 0; r0 < shape.batch; r0 += kMaxGridRows) {
    const int rows = std::min(kMaxGridRows, shape.batch - r0);
    CandidateGrid grid{};
    const cudaError_t planned = plan_candidate_grid(t, shape, instance(std::true_type{}), rows, &grid);
    if (planned != cudaSuccess) return planned;
    const size_t smem = grid.smem;
    const auto kernel = smem > 0 ? instance(std::true_type{}) : instance(std::false_type{});
    const int64_t extras_from = int64_t{r0} * shape.num_extra;
    DecodeArgs<T> args{};
    args.rows = {t.hidden + int64_t{r0} * d, t.embedding, shape.vocab, d, grid.vec, n, rows_read_once(shape.batch)};
    args.slot_tokens = {{ws.cluster_ids + int64_t{r0} * shape.probes, t.cluster_tokens, t.extra_ids, shape.probes,
                         shape.cluster_size, shape.num_clusters},
                        early};
    if (ws.extra_repeats)
      args.extras = {shape.num_extra, ws.extra_repeats + extras_from, ws.extra_partials + extras_from};
    args.row_offset = r0;
    args.temperature = kSample ? sampling->temperature : 1.0f;
    args.seed = kSample ? sampling->seed : nullptr;
    args.partials = kSample ? ws.partials + int64_t{r0} * max_blocks : nullptr;
    args.tickets = ws.tickets + r0;
    args.tokens = tokens + r0 * token_stride;
    args.token_stride = token_stride;
    args.token_logprobs = kSample ? token_logprobs + r0 : nullptr;
    const cudaError_t err =
        launch_kernel(kernel, dim3(grid.blocks, rows), dim3(kCandThreads), smem, stream, dependent, args);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace
}  // namespace detail

size_t cluster_select_workspace_bytes(const HeadShape& shape, bool sampling) {
  detail::WorkspaceCarver carver(nullptr);
  detail::SelectWorkspace ws{};
  detail::carve_scores(carver, shape, sampling, SelectOrder::kRanked, ws);
  return carver.bytes();
}

template <typename T, typename TC>
cudaError_t launch_cluster_select(const T* hidden, const TC* centroids, const float* centroid_scale,
                                  const HeadShape& shape, const Sampling* sampling, int32_t* cluster_ids, float* scores,
                                  void* workspace, cudaStream_t stream, const LaunchOptions& options) {
  if (shape.batch == 0) return cudaSuccess;
  detail::WorkspaceCarver carver(workspace);
  detail::SelectWorkspace ws{};
  detail::carve_scores(carver, shape, sampling != nullptr, SelectOrder::kRanked, ws);
  cudaError_t err = detail::plan_kept(shape, &ws.kept);
  if (err != cudaSuccess) return err;
  err = detail::launch_scores_keeping(hidden, centroids, centroid_scale, shape.batch, shape.num_clusters,
                                      shape.hidden_dim, ws.scores, sampling, ws.keys, stream, {}, options, ws.kept);
  if (err != cudaSuccess) return err;
  SelectOutputs out;
  out.cluster_ids = cluster_ids;
  out.selected_scores = scores;
  out.scores = ws.scores;
  return detail::launch_select_keeping(sampling ? ws.keys : ws.scores, shape, SelectOrder::kRanked, out, ws.select,
                                       stream, options, ws.kept);
}

size_t decode_workspace_bytes(const HeadShape& shape, bool sampling) {
  detail::WorkspaceCarver carver(nullptr);
  detail::carve_decode(carver, shape, sampling);
  return carver.bytes();
}

template <typename T, typename TC>
cudaError_t launch_decode(const HeadTensors<T, TC>& tensors, const HeadShape& shape, const Sampling* sampling,
                          int64_t* tokens, int64_t token_stride, float* token_logprobs, void* workspace,
                          cudaStream_t stream, const LaunchOptions& options) {
  if (shape.batch == 0) return cudaSuccess;
  // The ops check this; a C++ caller past C would leave list entries unset (-1): the early
  // instance would poll them forever, the others read the table before its start.
  if (shape.probes < 1 || shape.probes > shape.num_clusters) return cudaErrorInvalidValue;
  detail::WorkspaceCarver carver(workspace);
  detail::DecodeWorkspace ws = detail::carve_decode(carver, shape, sampling != nullptr);
  if (const cudaError_t err = detail::plan_kept(shape, &ws.kept); err != cudaSuccess) return err;
  detail::ClaimedPlan claimed{};
  if (detail::may_decode_by_claimed_cluster(shape, sampling != nullptr)) {
    const cudaError_t err = detail::plan_claimed_decode(tensors.hidden, tensors.embedding, shape.hidden_dim, &claimed);
    if (err != cudaSuccess) return err;
    if (!detail::decodes_by_claimed_cluster<T>(shape, claimed)) claimed = {};
  }
  const bool by_claimed_cluster = claimed.smem > 0;
  detail::EarlyClusters early{};
  if (detail::scores_early<T>(shape, sampling != nullptr, options)) {  // batch 1: never by claimed cluster
    const cudaError_t err = detail::plan_early(tensors, shape, &ws, &early);
    if (err != cudaSuccess) return err;
  }
  if (by_claimed_cluster) {
    const cudaError_t err =
        cudaMemsetAsync(ws.claims, 0, sizeof(unsigned long long) * detail::claims_words(shape), stream);
    if (err != cudaSuccess) return err;
  }
  // The early instance's words (decode.cuh, EarlyClusters): the clusters' and the blocks' bests
  // zeroed, the list it polls unset.
  WorkspacePresets presets;
  if (early.items > 0)
    presets = {ws.early_best, detail::early_words(shape), ws.cluster_ids, int64_t{shape.batch} * shape.probes};
  cudaError_t err = detail::launch_scores_keeping(tensors.hidden, tensors.centroids, tensors.centroid_scale,
                                                  shape.batch, shape.num_clusters, shape.hidden_dim, ws.scores,
                                                  sampling, ws.keys, stream, presets, options, ws.kept);
  if (err != cudaSuccess) return err;
  SelectOutputs out;
  out.cluster_ids = ws.cluster_ids;
  if (early.items == 0) out.row_tickets = ws.tickets;  // the early instance posts block bests instead
  if (by_claimed_cluster) {
    out.claims = ws.claims;
    out.claimed_groups = ws.claimed_groups;
  }
  out.extra_repeats = ws.extra_repeats;
  err = detail::launch_select_keeping(sampling ? ws.keys : ws.scores, shape, detail::decode_order(sampling != nullptr),
                                     out, ws.select, stream, options, ws.kept);
  if (err != cudaSuccess) return err;
  if (by_claimed_cluster)
    return detail::launch_decode_claimed(tensors.hidden, tensors.embedding, tensors.cluster_tokens, tensors.extra_ids,
                                         shape, ws.claims, ws.claimed_groups, ws.tickets, claimed, tokens,
                                         token_stride, stream, options.dependent_launch);
  return sampling ? detail::launch_decode_candidates<T, TC, true>(tensors, shape, sampling, ws, early, tokens,
                                                                  token_stride, token_logprobs, stream,
                                                                  options.dependent_launch)
                  : detail::launch_decode_candidates<T, TC, false>(tensors, shape, sampling, ws, early, tokens,
                                                                   token_stride, token_logprobs, stream,
                                                                   options.dependent_launch);
}

#define FLASHHEAD_INSTANTIATE(T, TC)                                                                               \
  template cudaError_t launch_cluster_select<T, TC>(const T*, const TC*, const float*, const HeadShape&,            \
                                                    const Sampling*, int32_t*, float*, void*, cudaStream_t,         \
                                                    const LaunchOptions&);                                          \
  template cudaError_t launch_decode<T, TC>(const HeadTensors<T, TC>&, const HeadShape&, const Sampling*, int64_t*, \
                                            int64_t, float*, void*, cudaStream_t, const LaunchOptions&);
FLASHHEAD_FOR_EACH_CENTROID_PAIR(FLASHHEAD_INSTANTIATE)
#undef FLASHHEAD_INSTANTIATE

}  // namespace flashhead
