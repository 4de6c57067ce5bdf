// Stage 3: candidate logits, logits[row, j] = embedding[candidates[row, j]] . hidden[row] in fp32.
//
// A gather-GEMV: each warp takes kCandRowsPerWarp candidate slots of one row at a time and
// streams their embedding rows (1-8 KB each, read in place) with 16-byte loads; the blocks of a
// row split its N slots, the grid's y dimension walks the rows. The grid is sized to what stays
// resident (kCandBlocksPerSm per SM), each warp looping over slot groups. A slot whose id is outside [0, V) is masked:
// its row is never read and its logit is -inf.
#pragma once

#include <algorithm>

#include "kernels/common.cuh"

namespace flashhead {
namespace detail {

constexpr int kCandThreads = 256;
constexpr int kCandRowsPerWarp = 2;
constexpr int kCandUnroll = 4;
constexpr int kCandSlotsPerBlock = kCandThreads / kWarpSize * kCandRowsPerWarp;
constexpr int kCandBlocksPerSm = 2;
// gridDim.y limit; larger batches are launched in slices.
constexpr int kMaxGridRows = 65535;

// Blocks per row: enough slot groups for every block, and no more blocks than stay resident.
inline int candidate_blocks_per_row(int num_candidates, int rows, int sms) {
  const int wanted = ceil_div(num_candidates, kCandSlotsPerBlock);
  return std::max(1, std::min(wanted, sms * kCandBlocksPerSm / rows));
}

template <typename T>
struct CandidateRows {
  const T* hidden;     // [B, D]
  const T* embedding;  // [V, D]
  int vocab, hidden_dim;
  bool vec;
  int num_candidates;  // N slots a row
  bool rows_once;      // rows_read_once(batch)
};

// The slot tokens of for_each_slot_group come from a policy: token(row, slot) for slot < N, and
// warm_l2(), which a block may run before its inputs are ready.
// ListedTokens: a written list of candidates [B, N].
struct ListedTokens {
  const int32_t* candidates;
  int num_candidates;
  __device__ __forceinline__ int32_t token(int64_t row, int slot) const {
    return candidates[row * num_candidates + slot];
  }
  __device__ __forceinline__ void warm_l2() const {}
};

// Token i of the k-th chosen cluster for slot k * b + i, read from the cluster table itself (the
// selection's chosen ids are always in range), then the extra ids as given: the fused decode
// deals with repeated extras itself (decode.cuh).
struct ClusterTokens {
  const int32_t* cluster_ids;     // [B, p]
  const int32_t* cluster_tokens;  // [C, b]
  const int32_t* extra_ids;       // [E]
  int probes, cluster_size, num_clusters;
  __device__ __forceinline__ int32_t token(int64_t row, int slot) const {
    const int gathered = probes * cluster_size;
    if (slot >= gathered) return extra_ids[slot - gathered];
    const int k = slot / cluster_size;
    const int32_t cluster = cluster_ids[row * probes + k];
    return cluster_tokens[int64_t{cluster} * cluster_size + (slot - k * cluster_size)];
  }
  // The table is an input of the op, never written by the kernels before this one, so its lines
  // can be pulled into L2 while the selection still runs; the slots' lookups then hit L2.
  __device__ __forceinline__ void warm_l2() const {
    constexpr int kLine = 128;
    const int64_t lines = ceil_div<int64_t>(int64_t{num_clusters} * cluster_size * sizeof(int32_t), kLine);
    const int64_t blocks = int64_t{gridDim.x} * gridDim.y, block = int64_t{blockIdx.y} * gridDim.x + blockIdx.x;
    const int64_t per_block = ceil_div<int64_t>(lines, blocks), end = min(lines, (block + 1) * per_block);
    const char* base = reinterpret_cast<const char*>(cluster_tokens);
    for (int64_t line = block * per_block + threadIdx.x; line < end; line += blockDim.x)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(base + line * kLine));
  }
};

// Logits of kCandRowsPerWarp consecutive slots, in every lane of the warp.
struct WarpSlots {
  int32_t token[kCandRowsPerWarp];
  bool valid[kCandRowsPerWarp];
  float logit[kCandRowsPerWarp];
};

// Calls f(slots, first_slot) for each group of kCandRowsPerWarp slots of `row` this warp owns
// (token ids from `tokens`):
// a grid-stride loop over the row's slots, so a grid sized to the GPU pays each block's fixed
// costs once. The next group's ids are loaded before the current group's rows are read, so the
// two latencies overlap.
template <typename T, typename Tokens, typename F>
__device__ __forceinline__ void for_each_slot_group(const CandidateRows<T>& a, const Tokens& tokens, int64_t row, F f) {
  const int stride = gridDim.x * kCandSlotsPerBlock;
  auto fetch = [&](int first, int32_t (&token)[kCandRowsPerWarp]) {
#pragma unroll
    for (int r = 0; r < kCandRowsPerWarp; ++r)
      token[r] = first + r < a.num_candidates ? tokens.token(row, first + r) : -1;
  };
  const T* hid[1] = {a.hidden + row * a.hidden_dim};
  const uint64_t policy = row_policy(a.rows_once);
  int first = blockIdx.x * kCandSlotsPerBlock + threadIdx.x / kWarpSize * kCandRowsPerWarp;
  int32_t token[kCandRowsPerWarp];
  fetch(first, token);
  for (; first < a.num_candidates; first += stride) {  // uniform within the warp
    int32_t next[kCandRowsPerWarp];
    fetch(first + stride, next);
    WarpSlots s;
    const T* rows[kCandRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kCandRowsPerWarp; ++r) {
      s.token[r] = token[r];
      s.valid[r] = token[r] >= 0 && token[r] < a.vocab;
      rows[r] = s.valid[r] ? a.embedding + int64_t{token[r]} * a.hidden_dim : nullptr;
    }
    float acc[kCandRowsPerWarp][1];
    warp_dot<T, kCandRowsPerWarp, 1, kCandUnroll>(rows, hid, a.hidden_dim, a.vec, policy, acc);
#pragma unroll
    for (int r = 0; r < kCandRowsPerWarp; ++r) {
      s.logit[r] = s.valid[r] ? acc[r][0] : -INFINITY;
      token[r] = next[r];
    }
    f(s, first);
  }
}

}  // namespace detail
}  // namespace flashhead
