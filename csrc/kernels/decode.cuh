// Stage 4, fused with stage 3: candidate logits reduced on the fly, never written out, to the
// greedy token (argmax, ties to the smaller token id) or to a Gumbel-max draw from
// softmax(logits / T) over the candidates, with that draw's log-probability.
//
// Each block folds its slots into one RowPartial; the last block of a row to finish (an atomic
// ticket taken after a __threadfence; the selection kernel zeroes the tickets) writes the result.
// Greedy: each block folds its packed (key, token) into the row's ticket with an atomic max, so
// the last block only reads it back. Sampling: blocks write their partials and the last block
// merges them: a max over packed (key, token), and an online-softmax merge of (max, sum of exp)
// for the log-normaliser. No memset, so replaying a captured graph is safe.
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

template <typename T, typename Tokens>
struct DecodeArgs {
  CandidateRows<T> rows;
  Tokens slot_tokens;
  int row_offset;  // batch row of blockIdx.y == 0 (the Gumbel noise is indexed by the absolute row)
  float temperature;
  const int64_t* seed;
  RowPartial* partials;  // [rows, gridDim.x], sampling
  RowTicket* tickets;    // [rows], zero on entry
  int64_t* tokens;
  int64_t token_stride;
  float* token_logprobs;
};

template <typename T, bool kSample, typename Tokens>
__global__ void __launch_bounds__(kCandThreads, kCandBlocksPerSm) decode_candidates_kernel(DecodeArgs<T, Tokens> a) {
  constexpr int kWarps = kCandThreads / kWarpSize;
  __shared__ RowPartial warp_partials[kWarps];
  __shared__ bool is_last_block;
  a.slot_tokens.warm_l2();
  wait_for_previous_kernel();
  const int64_t row = blockIdx.y;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const uint64_t seed = kSample ? static_cast<uint64_t>(*a.seed) : 0;

  // Lane r folds slot first + r of each group, so each slot draws its Gumbel noise once.
  RowPartial p = empty_partial();
  for_each_slot_group(a.rows, a.slot_tokens, row, [&](const WarpSlots& s, int first) {
    if (lane >= kCandRowsPerWarp || !pick(s.valid, lane)) return;
    const float logit = pick(s.logit, lane);
    const int32_t token = pick(s.token, lane);
    RowPartial slot = empty_partial();
    if constexpr (kSample) {
      const float x = logit / a.temperature;
      const float key = x + gumbel_noise(seed, kTokenStream, static_cast<uint32_t>(a.row_offset + row),
                                         static_cast<uint32_t>(first + lane));
      slot = {pack_ranked(order_key(key), token), x, isnan(x) ? -INFINITY : x,
              isnan(x) ? NAN : (x == -INFINITY ? 0.0f : 1.0f)};
    } else {
      slot.best = pack_ranked(order_key(logit), token);
    }
    p = merge<kSample>(p, slot);
  });
  p = warp_merge<kSample>(p, kCandRowsPerWarp);
  if (lane == 0) warp_partials[warp] = p;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) p = merge<kSample>(p, warp_partials[w]);
    if constexpr (kSample)
      a.partials[row * gridDim.x + blockIdx.x] = p;
    else
      atomicMax(&a.tickets[row].best, static_cast<unsigned long long>(p.best));
    __threadfence();  // publish the partial before taking a ticket
    is_last_block = atomicAdd(&a.tickets[row].arrivals, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last_block) return;

  __threadfence();
  if constexpr (!kSample) {
    if (threadIdx.x == 0) {
      const uint64_t best = __ldcg(&a.tickets[row].best);
      a.tokens[row * a.token_stride] = best == kNoneRanked ? -1 : packed_id(best);
    }
    return;
  }
  // Sampling: merge the row's partials.
  p = empty_partial();
  for (int i = threadIdx.x; i < static_cast<int>(gridDim.x); i += blockDim.x)
    p = merge<kSample>(p, load_partial(&a.partials[row * gridDim.x + i]));
  p = warp_merge<kSample>(p, kWarpSize);
  if (lane == 0) warp_partials[warp] = p;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kWarps; ++w) p = merge<kSample>(p, warp_partials[w]);
  a.tokens[row * a.token_stride] = p.best == kNoneRanked ? -1 : packed_id(p.best);
  const float log_norm = isnan(p.sum) ? NAN : (p.max == -INFINITY ? -INFINITY : p.max + logf(p.sum));
  a.token_logprobs[row] = p.best == kNoneRanked ? NAN : p.best_scaled - log_norm;
}

}  // namespace detail
}  // namespace flashhead
