// Stage 1: centroid scores, a skinny GEMM scores[B, C] = hidden[B, D] . centroids[C, D]^T, on CUDA
// cores (batches of bf16 or fp16 rows of whole 16-byte vectors take tensor cores past 4 rows with
// centroids of their dtype, past 2 with fp8 ones: centroid_scores_mma.cuh).
//
// Memory-bound at small B: the centroid matrix is read once, 16 bytes per lane, each warp
// streaming ROWS rows with several loads in flight. Hidden rows are re-read per chunk from L1
// (they are a few KB). B is processed in tiles of RB rows; the tile index varies fastest across
// warps so the tiles of one centroid group run side by side and share its loads in cache.
#pragma once

#include "kernels/block_candidates.cuh"

namespace flashhead {
namespace detail {

constexpr int kScoreThreads = 256;
constexpr int kScoreWarps = kScoreThreads / kWarpSize;
// Centroid rows a warp scores at once when a batch spans several tiles; one tile picks 2 to 5 to
// fit C (launch_tile).
constexpr int kScoreRowsPerWarp = 4;

template <typename T, typename TC>
struct ScoreArgs {
  const T* hidden;
  const TC* centroids;
  const float* centroid_scale;  // null: 1
  int batch, num_clusters, hidden_dim;
  float* scores;  // [B, C]
  float* keys;    // [B, C] Gumbel keys, only when sampling
  float temperature;
  const int64_t* seed;
  int row_offset;  // batch row of hidden[0] in the call (the Gumbel noise is indexed by the absolute row)
  WorkspacePresets presets;
};

// Batch rows a warp scores at once beyond batch 4 (batches of 2 and 3-4 have tiles of 2 and 4:
// the loads of a larger tile's empty rows are skipped, but its registers cost resident warps and
// loads in flight). An fp8 piece is 16 elements, so its hidden pieces take twice (bf16) or four
// times (float32) the registers: 8 rows of float32 spilled about 1 KB a thread, so fp8 tiles hold
// 4 rows (bf16 and half hidden spilled 60 bytes at 8). These counts are sm_90's: on sm_80, where
// e4m3 converts in software, the fp8 instances with 16-byte vectors spill 34-622 bytes a thread,
// the most in the tile of 2 (nvcc 13.0; fp8 centroids are not timed there).
template <typename T, typename TC>
constexpr int kScoreBatchTile = sizeof(TC) == 1 ? 4 : 8;

// Blocks per SM that stay resident (a register cap); the launcher sizes the grid to that, so the
// whole matrix streams in one wave with no tail of late blocks.
template <int RB>
constexpr int kScoreBlocksPerSm = RB <= 2 ? 3 : 2;
// Loads in flight per lane: ROWS * unroll centroid chunks plus RB * unroll hidden chunks.
template <int RB>
constexpr int kScoreUnroll = RB <= 2 ? 2 : 1;

// Score (b, c) from its dot product: scaled, written, and with its Gumbel key when sampling (the
// scale and seed are read only here, once the sums are in). Returns what the selection ranks: the
// key when sampling, else the score.
template <typename T, typename TC>
__device__ __forceinline__ float store_score(const ScoreArgs<T, TC>& a, int b, int c, float dot) {
  const float score = dot * (a.centroid_scale ? *a.centroid_scale : 1.0f);
  const int64_t at = int64_t{b} * a.num_clusters + c;
  a.scores[at] = score;
  // The presets beside the scores: word i by the lane that writes score i mod (B C). As a loop over
  // the grid at the kernel's end they made the fp8 decode about 0.1 us slower (session 56).
  const int64_t score_count = int64_t{a.batch} * a.num_clusters;
  for (int64_t i = at; i < a.presets.zeroed_words; i += score_count) a.presets.zeroed[i] = 0;
  for (int64_t i = at; i < a.presets.unset_count; i += score_count) a.presets.unset_ids[i] = -1;
  if (!a.keys) return score;
  const float key = score / a.temperature + gumbel_noise(static_cast<uint64_t>(*a.seed), kClusterStream,
                                                         static_cast<uint32_t>(a.row_offset + b),
                                                         static_cast<uint32_t>(c));
  a.keys[at] = key;
  return key;
}

// The block's keys ranked (block_candidates.cuh), one slot a thread: its best per_block to the
// candidates and the next one's key to the cutoff. Slots no score took hold their own index, below
// every packed key and unique, so the ranks are a permutation of the slots. A round's slots are
// read in one unrolled run of 16-byte loads (a loop of single loads, each waiting for the last,
// cost the scoring's end about 0.5 us).
template <int ROWS>
__device__ __forceinline__ void keep_block_candidates(const BlockCandidates& kept, const uint64_t* slot_keys) {
  constexpr int kRoundSlots = kScoreWarps * ROWS;
  static_assert(kRoundSlots % 2 == 0, "a round is whole pairs of slots");
  const int t = threadIdx.x;
  if (t >= kept.slots) return;
  const uint64_t mine = slot_keys[t];
  int rank = 0;
  for (int round = 0; round < kept.slots / kRoundSlots; ++round) {
    const ulonglong2* two = reinterpret_cast<const ulonglong2*>(slot_keys + round * kRoundSlots);
#pragma unroll
    for (int j = 0; j < kRoundSlots / 2; ++j) {
      const ulonglong2 pair = two[j];
      rank += (pair.x > mine) + (pair.y > mine);
    }
  }
  if (rank < kept.per_block)
    kept.pairs[int64_t{blockIdx.x} * kept.per_block + rank] = mine;
  else if (rank == kept.per_block)
    kept.cutoffs[blockIdx.x] = static_cast<uint32_t>(mine >> 32);
}

// Batch 1 is one tile (RB == 1), the case worth a short start: its loads issue after a few
// instructions, with no division, and the scale and seed are read only once the sums are in.
// kVec: rows of whole 16-byte vectors (rows_vectorizable), an instance without the scalar path.
// kKeep: batch 1 keeping candidates for the selection (`kept`), an instance of its own; `kept` is
// a parameter of its own so that the other instances' code stays as it was.
template <typename T, typename TC, int RB, int ROWS, bool kVec, bool kKeep = false>
__global__ void __launch_bounds__(kScoreThreads, kScoreBlocksPerSm<RB>)
    centroid_scores_kernel(ScoreArgs<T, TC> a, BlockCandidates kept) {
  static_assert(ROWS * RB <= kWarpSize, "a lane writes each of an item's scores");
  static_assert(!kKeep || RB == 1, "candidates are kept for batch 1");
  // The block's keys by slot, (round * kScoreWarps + warp) * ROWS + r.
  __shared__ __align__(16) uint64_t slot_keys[kKeep ? kBlockCandidateSlots : 2];
  if constexpr (kKeep) {
    for (int t = threadIdx.x; t < kept.slots; t += blockDim.x) slot_keys[t] = t;
    __syncthreads();
  }
  // Launched as a dependent of whatever kernel came before (an op's first kernel): every input may
  // be its output, so nothing is read before it ends. The launch itself overlaps its drain.
  wait_for_previous_kernel();
  // Let the selection kernel get resident while this one streams the centroids.
  let_next_kernel_start();
  const int lane = threadIdx.x % kWarpSize;
  const int tiles = RB == 1 ? 1 : ceil_div(a.batch, RB);
  // Fits in int, with a grid's stride past it: the launcher refuses shapes whose items would not.
  const int items = ceil_div(a.num_clusters, ROWS) * tiles;
  const uint64_t policy = row_policy(rows_read_once(RB == 1 ? 1 : a.batch));
  // One batch tile: items are dealt round-robin over the blocks, so every SM streams the same
  // share (the grid is whole waves of resident blocks). Several tiles: consecutive items (the
  // tiles of one centroid group) stay in one block, so they share its loads in cache.
  const int warp = threadIdx.x / kWarpSize;
  const int first_item = tiles == 1 ? warp * gridDim.x + blockIdx.x : blockIdx.x * kScoreWarps + warp;
  int round = 0;
  for (int item = first_item; item < items; item += gridDim.x * kScoreWarps, ++round) {
    const int c0 = item / tiles * ROWS;
    const int b0 = item % tiles * RB;
    const TC* rows[ROWS];
    const T* hid[RB];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
      rows[r] = c0 + r < a.num_clusters ? a.centroids + int64_t{c0 + r} * a.hidden_dim : nullptr;
#pragma unroll
    for (int b = 0; b < RB; ++b) hid[b] = b0 + b < a.batch ? a.hidden + int64_t{b0 + b} * a.hidden_dim : nullptr;
    float acc[ROWS][RB];
    warp_dot<TC, T, ROWS, RB, kScoreUnroll<RB>>(rows, hid, a.hidden_dim, kVec, policy, acc);
    // Lane r * RB + b writes score (c0 + r, b0 + b), so the Gumbel noise is drawn once per score.
    float flat[ROWS * RB];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int b = 0; b < RB; ++b) flat[r * RB + b] = acc[r][b];
    const int c = c0 + lane / RB, b = b0 + lane % RB;
    if (lane < ROWS * RB && c < a.num_clusters && b < a.batch) {
      const float ranked = store_score(a, b, c, pick(flat, lane));
      if constexpr (kKeep) slot_keys[(round * kScoreWarps + warp) * ROWS + lane] = pack_ranked(order_key(ranked), c);
    }
  }
  if constexpr (kKeep) {
    __syncthreads();
    keep_block_candidates<ROWS>(kept, slot_keys);
  }
}

}  // namespace detail
}  // namespace flashhead
