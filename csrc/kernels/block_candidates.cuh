// Batch 1's selection from the scoring blocks' own best keys.
//
// Each block of the batch-1 scoring kernel holds a few dozen of the row's keys at its end. It
// keeps its per_block best as packed (key, id) candidates, and its next key as a cutoff. Every key
// above the largest cutoff is then a candidate, so when at least p candidates pass that cutoff, the
// row's p best are the p best of those. The one-SM selection then ranks a few candidates a thread
// instead of the whole row (docs/benchmarks.md, session 58). Where fewer pass, or the p-th key ties
// keys it did not see, it selects from the whole row as before (select.cuh).
#pragma once

#include "kernels/common.cuh"

namespace flashhead {
namespace detail {

// The most keys a scoring block ranks (its shared slots), scoring blocks a row, and candidates
// a row: the selection takes at most kBlockCandidatesPerThread a thread, and a cutoff a thread.
constexpr int kBlockCandidateSlots = 64;
constexpr int kBlockCandidatesPerThread = 4;
constexpr int kBlockCandidateBlocksMax = 1024;
constexpr int kBlockCandidatesMax = kBlockCandidateBlocksMax * kBlockCandidatesPerThread;

struct BlockCandidates {
  uint64_t* pairs = nullptr;     // [blocks, per_block]: each block's best packed (key, id), best first
  uint32_t* cutoffs = nullptr;   // [blocks]: each block's (per_block + 1)-th key, 0 where it has none
  int blocks = 0;                // the scoring grid
  int per_block = 0;             // 0: the scoring kernel keeps no candidates
  int slots = 0;                 // keys a block ranks: rounds of its warps' items, rows each
};

// The batch-1 scoring grid's candidates for p of C clusters on `sms` SMs (centroid_scores.cu):
// per_block 0 where they would not pay. The pointers are the caller's.
BlockCandidates plan_block_candidates(int num_clusters, int probes, int sms);

// launch_centroid_scores, with `kept` filled by the batch-1 scoring kernel where kept.per_block > 0
// (the grid must be the plan's: cudaErrorInvalidValue otherwise).
template <typename T, typename TC>
cudaError_t launch_scores_keeping(const T* hidden, const TC* centroids, const float* centroid_scale, int batch,
                                  int num_clusters, int hidden_dim, float* scores, const Sampling* sampling, float* keys,
                                  cudaStream_t stream, const WorkspacePresets& presets, const LaunchOptions& options,
                                  const BlockCandidates& kept);

// launch_select, from `kept` where kept.per_block > 0 (filled by launch_scores_keeping just before).
cudaError_t launch_select_keeping(const float* keys, const HeadShape& shape, SelectOrder order, const SelectOutputs& out,
                                  void* workspace, cudaStream_t stream, const LaunchOptions& options,
                                  const BlockCandidates& kept);

}  // namespace detail
}  // namespace flashhead
