// Stage 4, fused with stage 3: candidate logits reduced on the fly, never written out, to the
// greedy token (argmax, ties to the smaller token id) or to a Gumbel-max draw from
// softmax(logits / T) over the candidates, with that draw's log-probability. Slot tokens come
// from the chosen clusters' table rows (ClusterTokens).
//
// Each block folds its slots into one RowPartial; the last block of a row to finish (an
// acquire-release arrival on the row's ticket; the selection kernel zeroes the tickets) writes the
// result. Greedy batch 1 with early clusters goes on without waiting for the selection to end: its
// blocks poll their list entries, and block 0 polls the blocks' posted bests (EarlyClusters).
// Greedy: each block folds its packed (key, token) into the row's ticket with an atomic max, so
// the last block only reads it back. Sampling: blocks write their partials and the last block
// merges them: a max over packed (key, token), and an online-softmax merge of (max, sum of exp)
// for the log-normaliser. No memset, so replaying a captured graph is safe.
//
// Extra ids, sampling: an extra id that repeats a gathered token or an earlier extra id would be
// drawn twice, so it is masked, as gather_candidates masks it. The blocks mark such extras as they
// meet their twins (flags the selection kernel zeroes) and set the extras' slot partials aside
// instead of folding them; the last block folds the unmarked ones with the blocks' partials (the
// same code: a second copy of the noise's arithmetic there cost that one SM a few µs, most likely
// in cold instruction fetches). Greedy folds every extra: a repeat has the same token and logit as its
// twin, so the argmax is the same.
#pragma once

#include "kernels/candidate_logits.cuh"

namespace flashhead {
namespace detail {

struct RowPartial {
  uint64_t best;      // packed (order_key(key), token); kNoneRanked when the slots are all masked
  float best_scaled;  // logit / T of the best slot (sampling)
  float max;          // online softmax over logit / T (sampling): running max ...
  float sum;          // ... and sum of exp(x - max); NaN once a NaN logit was seen
};

__device__ __forceinline__ RowPartial empty_partial() { return {kNoneRanked, -INFINITY, -INFINITY, 0.0f}; }

template <bool kSample>
__device__ __forceinline__ RowPartial merge(const RowPartial& a, const RowPartial& b) {
  RowPartial out;
  const bool take_b = b.best > a.best;
  out.best = take_b ? b.best : a.best;
  out.best_scaled = take_b ? b.best_scaled : a.best_scaled;
  if constexpr (kSample) {
    out.max = fmaxf(a.max, b.max);
    out.sum = out.max == -INFINITY ? a.sum + b.sum : a.sum * expf(a.max - out.max) + b.sum * expf(b.max - out.max);
  } else {
    out.max = -INFINITY;
    out.sum = 0.0f;
  }
  return out;
}

// Merges the partials of lanes that differ only in the low log2(width) bits.
template <bool kSample>
__device__ __forceinline__ RowPartial warp_merge(RowPartial p, int width) {
  for (int offset = width / 2; offset > 0; offset >>= 1) {
    RowPartial other;
    other.best = __shfl_xor_sync(kFullMask, p.best, offset);
    other.best_scaled = __shfl_xor_sync(kFullMask, p.best_scaled, offset);
    if constexpr (kSample) {
      other.max = __shfl_xor_sync(kFullMask, p.max, offset);
      other.sum = __shfl_xor_sync(kFullMask, p.sum, offset);
    }
    p = merge<kSample>(p, other);
  }
  return p;
}

__device__ __forceinline__ RowPartial load_partial(const RowPartial* p) {
  // Written by other blocks of this grid: read through L2, past this SM's L1.
  return {__ldcg(&p->best), __ldcg(&p->best_scaled), __ldcg(&p->max), __ldcg(&p->sum)};
}

// Clusters scored early, greedy batch 1 (launch_decode says where): the candidate blocks are
// resident about 4 us before the one-SM selection has its list, and the memory is idle then. So
// each block first takes one cluster likely to be chosen, the rank-t best of a slice of the
// centroid scores (slices of slice_width ids, kEarlyRanks ranks each, one per block up to
// `items`), reads its rows and stores the cluster's packed (key, token) best. After the
// selection, a chosen cluster with a stored best is folded as that value, its rows not read
// again: at the Qwen3-0.6B head (p = 256), with three quarters of the blocks taking one, about two
// thirds of the chosen clusters' rows were then read before the list existed (docs/benchmarks.md,
// session 53). Any set of early clusters gives the
// same token: a stored best is the exact maximum over that cluster's slots (group_logits sums them
// as the slot loop does).
// Nor does this instance wait for the selection kernel to end (0.5-1.3 us after its list, in a
// trace): each block polls its own list entries, which the scoring kernel set to -1, and posts its
// best in its own word, which the scoring kernel zeroed; block 0 polls those and writes the token,
// one L2 round trip after the last post, where an atomic maximum, an arrival and a read-back took
// three. Each block waits for the selection to end before it exits, so a kernel after this one
// (which waits for this grid alone) never runs beside the selection.
constexpr int kEarlyRanks = 3;
constexpr int kEarlyLaneKeys = 8;  // slices of up to 8 * 32 scores
// The share of blocks with an early cluster: three quarters, or half where the selection works
// from the scoring blocks' kept candidates (block_candidates.cuh). Its list then comes about a
// microsecond sooner, when with three quarters most blocks were still reading their early rows
// (the Qwen3-0.6B head at p = 256: 14.22-14.32 us against 14.67-14.69). Where half the blocks'
// slices would not fit, the selection takes the whole row and three quarters keep early clusters:
// kept candidates with three quarters made Gemma-3-1B's head (16,384 clusters, p = 256) 0.55 us
// slower, 0.8 with fp8 centroids (docs/benchmarks.md, session 58).
struct BlockShare {
  int num, den;
};
constexpr BlockShare kEarlyShare{3, 4}, kEarlyShareAfterKept{1, 2};
// launch_decode's plan (items 0: no early clusters).
struct EarlyClusters {
  const float* scores;       // [C]: the row's centroid scores
  unsigned long long* best;  // [C]: each cluster's best once scored early, else 0 (the scoring kernel clears it)
  // [blocks]: each block's posted best, 0 until posted (the scoring kernel clears them); a block
  // with no slot posts kNoBlockBest.
  uint64_t* block_bests;
  int slice_width, items;
};
constexpr uint64_t kNoBlockBest = 1;  // below every packed best (their keys are > 0)
struct EarlyClusterTokens : ClusterTokens {
  static constexpr bool kKnownBests = true;
  EarlyClusters early;
  // Another block may store a best while this one reads it from L2: 0 or the whole best.
  __device__ __forceinline__ SlotToken slot(int64_t row, int slot) const {
    return slot_with<true>(row, slot, early.best);
  }
};

// The id of the rank-t best score of [lo, hi) (at most kEarlyLaneKeys * 32 ids), equal scores in
// any order, or -1 where the slice holds t or fewer. Every warp of the block computes it alike.
__device__ __forceinline__ int32_t early_cluster(const float* scores, int lo, int hi, int t) {
  const int lane = threadIdx.x % kWarpSize;
  uint32_t key[kEarlyLaneKeys];
#pragma unroll
  for (int i = 0; i < kEarlyLaneKeys; ++i) {
    const int id = lo + i * kWarpSize + lane;
    // Written by the scoring kernel, which finished before the selection kernel let this grid start.
    key[i] = id < hi ? order_key(__ldcg(scores + id)) : 0;  // real keys are > 0
  }
  int32_t id = -1;
  for (int r = 0; r <= t; ++r) {
    uint32_t mine = 0;
#pragma unroll
    for (int i = 0; i < kEarlyLaneKeys; ++i) mine = max(mine, key[i]);
    const uint32_t top = __reduce_max_sync(kFullMask, mine);
    if (top == 0) return -1;
    const int owner = __ffs(__ballot_sync(kFullMask, mine == top)) - 1;
    int at = 0;
#pragma unroll
    for (int i = kEarlyLaneKeys - 1; i >= 0; --i) at = key[i] == top ? i : at;
    if (lane == owner) {
#pragma unroll
      for (int i = 0; i < kEarlyLaneKeys; ++i) key[i] = i == at ? 0 : key[i];
    }
    id = __shfl_sync(kFullMask, lo + at * kWarpSize + lane, owner);
  }
  return id;
}

// This block's early cluster (batch row 0): its slots' logits, as the slot loop computes them,
// folded into its stored best.
template <typename T>
__device__ __forceinline__ void score_early_cluster(const CandidateRows<T>& a, const EarlyClusterTokens& t,
                                                    uint64_t* warp_best) {
  constexpr int kWarps = kCandThreads / kWarpSize;
  const EarlyClusters& e = t.early;
  const int item = blockIdx.x;
  if (item >= e.items) return;  // alike in the block, as is every return below
  const int slice = item / kEarlyRanks;
  const int lo = slice * e.slice_width, hi = min(t.num_clusters, lo + e.slice_width);
  const int32_t cluster = lo < hi ? early_cluster(e.scores, lo, hi, item % kEarlyRanks) : -1;
  if (cluster < 0) return;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  uint64_t best = kNoneRanked;
  for (int slot = warp * kCandRowsPerWarp; slot < t.cluster_size; slot += kCandSlotsPerBlock) {
    int32_t token[kCandRowsPerWarp];
    bool valid[kCandRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kCandRowsPerWarp; ++r) {
      token[r] = slot + r < t.cluster_size ? t.cluster_tokens[int64_t{cluster} * t.cluster_size + slot + r] : -1;
      valid[r] = in_vocab(token[r], a.vocab);
    }
    float acc[kCandRowsPerWarp][1];
    group_logits(a, a.hidden, token, valid, acc);
#pragma unroll
    for (int r = 0; r < kCandRowsPerWarp; ++r)
      if (valid[r]) {
        const uint64_t slot_best = pack_ranked(order_key(acc[r][0]), token[r]);
        best = slot_best > best ? slot_best : best;
      }
  }
  if (lane == 0) warp_best[warp] = best;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 0; w < kWarps; ++w) best = warp_best[w] > best ? warp_best[w] : best;
  if (best != kNoneRanked) __stcg(e.best + cluster, static_cast<unsigned long long>(best));
}

// The end of the early instance: thread 0 of each block posts the block's best; warp 0 of block 0
// polls every block's word and writes the token.
__device__ __forceinline__ void post_block_best(const EarlyClusters& e, uint64_t best) {
  store_relaxed(e.block_bests + blockIdx.x, best > kNoBlockBest ? best : kNoBlockBest);
}
__device__ __forceinline__ void write_best_of_blocks(const EarlyClusters& e, int64_t* token) {
  const int lane = threadIdx.x % kWarpSize;
  uint64_t best;
  bool all_posted;
  do {
    best = 0;
    all_posted = true;
    for (int i = lane; i < gridDim.x; i += kWarpSize) {
      const uint64_t posted = load_relaxed(e.block_bests + i);
      all_posted &= posted != 0;
      best = max(best, posted);
    }
  } while (!__all_sync(kFullMask, all_posted));
  best = warp_max(best);
  if (lane == 0) *token = best == kNoBlockBest ? -1 : packed_id(best);
}

// The extra ids' side state in sampling, [rows, E] each (null when greedy or E == 0).
struct ExtraSlots {
  int count;             // E
  uint32_t* repeated;    // nonzero: the extra id repeats a gathered token or an earlier extra id
  RowPartial* partials;  // each extra's slot partial, set aside for the last block
};

template <typename T>
struct DecodeArgs {
  CandidateRows<T> rows;
  EarlyClusterTokens slot_tokens;  // its early fields for the kEarly instance only
  ExtraSlots extras;
  int row_offset;  // batch row of blockIdx.y == 0 (the Gumbel noise is indexed by the absolute row)
  float temperature;
  const int64_t* seed;
  RowPartial* partials;  // [rows, gridDim.x], sampling
  RowTicket* tickets;    // [rows], zero on entry (unused by the kEarly instance)
  int64_t* tokens;
  int64_t token_stride;
  float* token_logprobs;
};

// A slot's share of a sampling row: its Gumbel key (the noise indexed by row and token id, so a
// token's key does not depend on where its cluster ranks) and its term of the softmax.
__device__ __forceinline__ RowPartial sampled_slot(float logit, int32_t token, float temperature, uint64_t seed,
                                                   int64_t abs_row) {
  const float x = logit / temperature;
  const float key = x + gumbel_noise(seed, kTokenStream, static_cast<uint32_t>(abs_row), static_cast<uint32_t>(token));
  return {pack_ranked(order_key(key), token), x, isnan(x) ? -INFINITY : x,
          isnan(x) ? NAN : (x == -INFINITY ? 0.0f : 1.0f)};
}

// Flags the extra ids that repeat a token of this warp's slot group: any extra for a gathered
// slot, the later extras for an extra slot. The whole warp takes part, an extra a lane; the first
// kWarpSize extras come from `lane_extra` (extra `lane`, loaded once), the rest from memory.
__device__ __forceinline__ void mark_repeated_extras(const ClusterTokens& tokens, const ExtraSlots& extras,
                                                     int32_t lane_extra, const WarpSlots& s, int first, int64_t row) {
  const int lane = threadIdx.x % kWarpSize, gathered = tokens.probes * tokens.cluster_size;
  uint32_t* repeated = extras.repeated + row * extras.count;
#pragma unroll
  for (int r = 0; r < kCandRowsPerWarp; ++r) {
    if (!s.valid[r]) continue;  // uniform; also every slot past the row's end
    const int after = first + r < gathered ? 0 : first + r - gathered + 1;
    if (lane >= after && lane < extras.count && lane_extra == s.token[r]) repeated[lane] = 1;
    for (int j = max(after, kWarpSize) + lane; j < extras.count; j += kWarpSize)
      if (tokens.extra_ids[j] == s.token[r]) repeated[j] = 1;
  }
}

// kExtrasAside: sampling with extra ids (the extras' flags and partials); its own instance, so the
// other decodes' slot loop carries none of it. kStaged: as for_each_slot_group. kEarly: greedy
// batch 1 with clusters scored early (EarlyClusterTokens), register rows.
template <typename T, bool kSample, bool kExtrasAside, bool kStaged, bool kEarly = false>
__global__ void __launch_bounds__(kCandThreads, kCandBlocksPerSm) decode_candidates_kernel(DecodeArgs<T> a) {
  static_assert(kSample || !kExtrasAside, "greedy folds every extra id");
  static_assert(!kEarly || (!kSample && !kStaged), "early clusters fold greedy bests");
  using Tokens = std::conditional_t<kEarly, EarlyClusterTokens, ClusterTokens>;
  const Tokens& tokens = a.slot_tokens;
  constexpr int kWarps = kCandThreads / kWarpSize;
  __shared__ RowPartial warp_partials[kWarps];
  __shared__ bool is_last_block;
  tokens.warm_l2();
  if constexpr (kEarly) {
    __shared__ uint64_t warp_best[kWarps];
    score_early_cluster(a.rows, a.slot_tokens, warp_best);
  }
  if constexpr (!kEarly) wait_for_previous_kernel();  // the early instance polls instead
  const int64_t row = blockIdx.y, abs_row = a.row_offset + row;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int gathered = a.slot_tokens.probes * a.slot_tokens.cluster_size;
  const uint64_t seed = kSample ? static_cast<uint64_t>(*a.seed) : 0;
  const int32_t lane_extra = kExtrasAside && lane < a.extras.count ? a.slot_tokens.extra_ids[lane] : -1;

  // Lane r folds slot first + r of each group.
  RowPartial p = empty_partial();
  for_each_slot_group<kStaged>(a.rows, tokens, row, [&](const WarpSlots& s, int first) {
    if constexpr (kExtrasAside) mark_repeated_extras(a.slot_tokens, a.extras, lane_extra, s, first, row);
    if (lane >= kCandRowsPerWarp) return;
    if constexpr (kEarly) {
      const uint64_t known = pick(s.known, lane);
      p.best = known > p.best ? known : p.best;
    }
    if (!pick(s.valid, lane)) return;
    const int slot = first + lane;
    const float logit = pick(s.logit, lane);
    const int32_t token = pick(s.token, lane);
    RowPartial mine = empty_partial();
    if constexpr (kSample)
      mine = sampled_slot(logit, token, a.temperature, seed, abs_row);
    else
      mine.best = pack_ranked(order_key(logit), token);
    if (kExtrasAside && slot >= gathered) {
      a.extras.partials[row * a.extras.count + slot - gathered] = mine;
      return;
    }
    p = merge<kSample>(p, mine);
  });
  p = warp_merge<kSample>(p, kCandRowsPerWarp);
  if (lane == 0) warp_partials[warp] = p;
  __syncthreads();  // also orders this block's extra flags and partials before the arrival below
  if (threadIdx.x == 0)
    for (int w = 1; w < kWarps; ++w) p = merge<kSample>(p, warp_partials[w]);
  if constexpr (kEarly) {
    if (threadIdx.x == 0) post_block_best(tokens.early, p.best);
    if (blockIdx.x == 0 && warp == 0) write_best_of_blocks(tokens.early, a.tokens);
    if (threadIdx.x == 0) wait_for_previous_kernel();
    return;
  }
  if (threadIdx.x == 0) {
    if constexpr (kSample)
      a.partials[row * gridDim.x + blockIdx.x] = p;
    else
      atomicMax(&a.tickets[row].best, static_cast<unsigned long long>(p.best));
    is_last_block = arrive(&a.tickets[row].arrivals) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last_block) return;

  if constexpr (!kSample) {
    if (threadIdx.x == 0) {
      const uint64_t best = __ldcg(&a.tickets[row].best);
      a.tokens[row * a.token_stride] = best == kNoneRanked ? -1 : packed_id(best);
    }
    return;
  }
  // Sampling: merge the row's partials and the extras no block marked as repeats. An extra id
  // outside the vocabulary wrote no partial, so its word is never read (initcheck found the
  // unwritten reads on random configurations, session 67).
  p = empty_partial();
  const int blocks = gridDim.x, extras = kExtrasAside ? a.extras.count : 0;
  for (int i = threadIdx.x; i < blocks + extras; i += blockDim.x) {
    const int64_t extra = row * extras + i - blocks;
    const bool is_block = i < blocks;
    bool take = is_block;
    if (!is_block) {
      const int32_t id = a.slot_tokens.extra_ids[i - blocks];
      take = in_vocab(id, a.rows.vocab) && !__ldcg(&a.extras.repeated[extra]);
    }
    if (take) p = merge<kSample>(p, load_partial(is_block ? &a.partials[row * blocks + i] : &a.extras.partials[extra]));
  }
  p = warp_merge<kSample>(p, kWarpSize);
  if (lane == 0) warp_partials[warp] = p;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kWarps; ++w) p = merge<kSample>(p, warp_partials[w]);
  a.tokens[row * a.token_stride] = p.best == kNoneRanked ? -1 : packed_id(p.best);
  // (best - max) - log(sum), not best - (max + log(sum)): at small temperatures the scaled max is
  // large enough to absorb log(sum) in float32 (a 1/3 token got log-probability 0 at T = 1e-6).
  // Every valid logit -inf (the drawn one too) leaves no probability to normalise: NaN, as the CPU's log_softmax.
  const float logprob = isnan(p.sum) || p.max == -INFINITY ? NAN : (p.best_scaled - p.max) - logf(p.sum);
  a.token_logprobs[row] = p.best == kNoneRanked ? NAN : logprob;
}

// The greedy decode by claimed cluster (decode_claimed.cu), for batches of up to
// kClaimedMaxRows rows whose selections listed SelectOutputs::claims and claimed_groups.
// The most row groups a batch's claims can list: what the list and the grid are sized for. A
// cluster that n rows chose has ceil(n / G) <= 1 + floor(n / G) groups; at most min(C, B p)
// clusters are chosen, by B p choices in all.
inline int64_t most_claimed_groups(const HeadShape& shape) {
  const int64_t choices = int64_t{shape.batch} * shape.probes;
  return std::min(choices, std::min<int64_t>(shape.num_clusters, choices) + choices / kClaimedGroupRows);
}
// The kernel's items for those groups: kCandRowsPerWarp of a group's tokens each, then one for each
// row's extra token.
inline int64_t most_claimed_items(const HeadShape& shape) {
  return most_claimed_groups(shape) * ceil_div(shape.cluster_size, kCandRowsPerWarp) +
         int64_t{shape.batch} * shape.num_extra;
}
// The kernel's staged rows' shared memory (0 where they cannot be staged: it does not run there)
// and the blocks an SM it runs with.
struct ClaimedPlan {
  size_t smem = 0;
  int blocks_per_sm = 0;
};
template <typename T>
cudaError_t plan_claimed_decode(const T* hidden, const T* embedding, int hidden_dim, ClaimedPlan* plan);
template <typename T>
cudaError_t launch_decode_claimed(const T* hidden, const T* embedding, const int32_t* cluster_tokens,
                                  const int32_t* extra_ids, const HeadShape& shape, const unsigned long long* claims,
                                  const int32_t* claimed_groups, RowTicket* tickets, const ClaimedPlan& plan,
                                  int64_t* tokens, int64_t token_stride, cudaStream_t stream, bool dependent);

}  // namespace detail
}  // namespace flashhead
