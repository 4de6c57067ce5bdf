// The greedy decode by claimed cluster, for batches whose rows share clusters: each cluster any
// row chose (SelectOutputs::claims) is read once for every kClaimedGroupRows rows that chose it,
// and its logits computed for each of them, where decode_candidates_kernel reads a cluster once
// for each row. Items are a listed row group's tokens kCandRowsPerWarp at a time, then each row's
// extra ids; each warp stages its items' rows by bulk copies, two items in flight, and folds
// (key, token) maxima per row in shared memory; the last block to arrive writes every row's token.
// Groups bound an item's work: real batches share a few clusters among nearly all their rows,
// and one item for all of them made its warp the grid's last (docs/benchmarks.md, session 47).
// Its own translation unit: beside decode.cu's kernels it changed how nvcc inlined theirs (one
// instance grew by half).
#include <algorithm>
#include <type_traits>

#include "kernels/decode.cuh"

namespace flashhead {
namespace detail {
namespace {

template <typename T>
struct ClaimedArgs {
  CandidateRows<T> rows;             // hidden [B, D], the embedding
  const int32_t* cluster_tokens;     // [C, b]
  const unsigned long long* claims;  // [1 + C]
  const int32_t* claimed_groups;     // [claims[0]]
  const int32_t* extra_ids;          // [E], every row's
  int cluster_size, num_extra, batch;
  RowTicket* tickets;  // [B], zero on entry: each row's best; tickets[0].arrivals counts the blocks
  int64_t* tokens;
  int64_t token_stride;
};

struct ClaimedItem {
  int32_t token[kCandRowsPerWarp];  // -1: none
  // The rows to fold its logits into: group `group` of `chose` (group_rows, taken when the item's
  // turn comes: the claims' load then has two items' time to land).
  unsigned long long chose;
  int group;
};

#ifdef FLASHHEAD_BULK_COPIES
__device__ __forceinline__ ClaimedItem no_item() {
  ClaimedItem it;
#pragma unroll
  for (int j = 0; j < kCandRowsPerWarp; ++j) it.token[j] = -1;
  it.chose = 0;
  it.group = 0;
  return it;
}

// Group `group` of the rows in `chose`: its set bits from the (group G)-th to the (group G + G - 1)-th,
// counted from the lowest (G = kClaimedGroupRows). Most clusters have one group.
__device__ __forceinline__ unsigned long long group_rows(unsigned long long chose, int group) {
  if (__popcll(chose) <= kClaimedGroupRows) return chose;
  for (int i = 0; i < group * kClaimedGroupRows; ++i) chose &= chose - 1;
  unsigned long long later = chose;
  for (int i = 0; i < kClaimedGroupRows; ++i) later &= later - 1;
  return chose ^ later;
}

template <typename T>
__device__ __forceinline__ ClaimedItem claimed_item(const ClaimedArgs<T>& a, int item, int listed_items) {
  ClaimedItem it;
  const int per_cluster = ceil_div(a.cluster_size, kCandRowsPerWarp);
  if (item < listed_items) {
    const int32_t listed = __ldcg(a.claimed_groups + item / per_cluster);
    const int32_t cluster = listed / kClaimedGroupsMax;
    const int first = (item % per_cluster) * kCandRowsPerWarp;
    it.chose = __ldcg(a.claims + 1 + cluster);
    it.group = listed % kClaimedGroupsMax;
#pragma unroll
    for (int j = 0; j < kCandRowsPerWarp; ++j)
      it.token[j] = first + j < a.cluster_size ? a.cluster_tokens[int64_t{cluster} * a.cluster_size + first + j] : -1;
  } else {
    const int extra = item - listed_items, row = extra / a.num_extra;
    it = no_item();
    it.chose = 1ull << row;
    it.token[0] = a.extra_ids[extra - row * a.num_extra];
  }
  return it;
}
#endif

// bfloat16 rows: three blocks an SM where their buffers fit (rows up to about 1,180 values), 1-7%
// faster than two at every point of session 48's sweep (real and random batches of 16-64 rows). At
// the 80 registers that three allow, the half and float instances spill, so they keep two. Wider
// bfloat16 rows fit two blocks only and run an instance compiled for two: the three-block one's 80
// registers cost them 1.0-3.1% (docs/benchmarks.md, session 50).
template <typename T>
constexpr int kClaimedMostBlocksPerSm = std::is_same_v<T, __nv_bfloat16> ? 3 : kCandBlocksPerSm;

template <typename T, int kBlocksPerSm>
__global__ void __launch_bounds__(kCandThreads, kBlocksPerSm) decode_claimed_kernel(ClaimedArgs<T> a) {
#ifdef FLASHHEAD_BULK_COPIES
  constexpr int R = kCandRowsPerWarp, W = kVecWidth<T>, kWarps = kCandThreads / kWarpSize;
  __shared__ unsigned long long row_best[kClaimedMaxRows];
  __shared__ uint64_t landed[kWarps * kCandBuffers];
  __shared__ bool is_last_block;
  for (int r = threadIdx.x; r < a.batch; r += blockDim.x) row_best[r] = kNoneRanked;
  StagedRowBuffers<T> buffers(a.rows.embedding, a.rows.vocab, a.rows.hidden_dim, row_policy(false), landed);
  wait_for_previous_kernel();
  __syncthreads();
  const int lane = threadIdx.x % kWarpSize, d = a.rows.hidden_dim;
  const int warps = gridDim.x * kWarps;
  const int listed_items = static_cast<int>(__ldcg(a.claims)) * ceil_div(a.cluster_size, R);
  const int items = listed_items + a.batch * a.num_extra;
  auto item_or_none = [&](int item) {
    return item < items ? claimed_item(a, item, listed_items) : no_item();
  };
  // Item k of this warp lands in buffer k % 2; its copies go out while the warp reads item k - 1.
  int item = blockIdx.x * kWarps + threadIdx.x / kWarpSize;
  ClaimedItem it = item_or_none(item), next = item_or_none(item + warps);
  buffers.issue(0, it.token);
  for (unsigned k = 0; item < items; item += warps, ++k) {  // uniform within the warp
    const ClaimedItem after = item_or_none(item + 2 * warps);
    fence_before_bulk_copies();  // the buffer's last reads (ordered across the warp by __syncwarp below)
    buffers.issue((k + 1) % kCandBuffers, next.token);
    const int buffer = k % kCandBuffers;
    buffers.wait(buffer, k / kCandBuffers);
    bool valid[R];
#pragma unroll
    for (int r = 0; r < R; ++r) valid[r] = in_vocab(it.token[r], a.rows.vocab);
    // Two of the rows that chose the item at a time; the pieces in warp_dot's order, so a logit
    // is the row-by-row kernel's to the bit.
    for (unsigned long long chose = group_rows(it.chose, it.group); chose;) {
      const int r0 = __ffsll(chose) - 1;
      chose &= chose - 1;
      const int r1 = chose ? __ffsll(chose) - 1 : -1;
      chose &= chose - 1;
      const T* h0 = a.rows.hidden + int64_t{r0} * d;
      const T* h1 = a.rows.hidden + int64_t{max(r1, r0)} * d;
      float acc[R][2] = {};
#pragma unroll 4
      for (int idx = lane; idx < d / W; idx += kWarpSize) {
        float hf[2][W];
        piece_floats(load_piece<T, W>(h0 + idx * W, nullptr), hf[0]);
        piece_floats(load_piece<T, W>(h1 + idx * W, nullptr), hf[1]);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          Piece<T, W> c;
          const int4 raw = buffers.piece(buffer, r, idx, valid[r]);
          memcpy(c.word, &raw, sizeof(raw));
          float cf[W];
          piece_floats(c, cf);
#pragma unroll
          for (int e = 0; e < W; ++e) {
            acc[r][0] = fmaf(cf[e], hf[0][e], acc[r][0]);
            acc[r][1] = fmaf(cf[e], hf[1][e], acc[r][1]);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float logit0 = warp_sum(acc[r][0]), logit1 = warp_sum(acc[r][1]);
        if (lane != 0 || !valid[r]) continue;
        atomicMax(&row_best[r0], static_cast<unsigned long long>(pack_ranked(order_key(logit0), it.token[r])));
        if (r1 >= 0)
          atomicMax(&row_best[r1], static_cast<unsigned long long>(pack_ranked(order_key(logit1), it.token[r])));
      }
    }
    __syncwarp();  // every lane is done with the buffer before the next issue refills it
    it = next;
    next = after;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < a.batch; r += blockDim.x)
    if (row_best[r] != kNoneRanked) atomicMax(&a.tickets[r].best, row_best[r]);
  __syncthreads();  // orders the block's maxima before the arrival below
  if (threadIdx.x == 0) is_last_block = arrive(&a.tickets[0].arrivals) == gridDim.x - 1;
  __syncthreads();
  if (!is_last_block) return;
  for (int r = threadIdx.x; r < a.batch; r += blockDim.x) {
    const uint64_t best = __ldcg(&a.tickets[r].best);
    a.tokens[r * a.token_stride] = best == kNoneRanked ? -1 : packed_id(best);
  }
#else
  __trap();  // launch_decode picks this kernel only where its rows can be staged (sm_90)
#endif
}

}  // namespace

// The instance for `blocks_per_sm` blocks an SM: the one compiled for the most where they fit.
template <typename T>
auto claimed_kernel(int blocks_per_sm) {
  return blocks_per_sm >= kClaimedMostBlocksPerSm<T> ? decode_claimed_kernel<T, kClaimedMostBlocksPerSm<T>>
                                                     : decode_claimed_kernel<T, kCandBlocksPerSm>;
}

template <typename T>
cudaError_t plan_claimed_decode(const T* hidden, const T* embedding, int hidden_dim, ClaimedPlan* plan) {
  *plan = {};
  const bool vec = rows_vectorizable<T>(hidden, hidden_dim) && rows_vectorizable<T>(embedding, hidden_dim);
  // The most blocks first; where fewer fit, the instance for fewer plans (and raises its own
  // shared-memory limit) again.
  for (const int most : {kClaimedMostBlocksPerSm<T>, kCandBlocksPerSm}) {
    int per_sm = 0;
    const cudaError_t err =
        staged_buffers_smem(claimed_kernel<T>(most), vec, hidden_dim, sizeof(T), &plan->smem, &per_sm);
    plan->blocks_per_sm = std::min(per_sm, most);
    if (err != cudaSuccess || plan->smem == 0 || plan->blocks_per_sm == most) return err;
  }
  return cudaSuccess;
}

template <typename T>
cudaError_t launch_decode_claimed(const T* hidden, const T* embedding, const int32_t* cluster_tokens,
                                  const int32_t* extra_ids, const HeadShape& shape, const unsigned long long* claims,
                                  const int32_t* claimed_groups, RowTicket* tickets, const ClaimedPlan& plan,
                                  int64_t* tokens, int64_t token_stride, cudaStream_t stream, bool dependent) {
  int sms = 0;
  if (cudaError_t err = multiprocessor_count(&sms); err != cudaSuccess) return err;
  ClaimedArgs<T> args{};
  // Rows of whole 16-byte vectors (vec): plan_claimed_decode gave no shared memory otherwise.
  args.rows = {hidden, embedding, shape.vocab, shape.hidden_dim, true, shape.num_candidates(), false};
  args.cluster_tokens = cluster_tokens;
  args.claims = claims;
  args.claimed_groups = claimed_groups;
  args.extra_ids = extra_ids;
  args.cluster_size = shape.cluster_size;
  args.num_extra = shape.num_extra;
  args.batch = shape.batch;
  args.tickets = tickets;
  args.tokens = tokens;
  args.token_stride = token_stride;
  // Items for the most groups the rows' claims can list, whatever they list this time.
  const int64_t wanted = ceil_div<int64_t>(most_claimed_items(shape), kCandThreads / kWarpSize);
  const int64_t resident = int64_t{sms} * plan.blocks_per_sm;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(resident, wanted)));
  return launch_kernel(claimed_kernel<T>(plan.blocks_per_sm), dim3(blocks), dim3(kCandThreads), plan.smem, stream,
                       dependent, args);
}

#define FLASHHEAD_INSTANTIATE(T)                                                                                  \
  template cudaError_t plan_claimed_decode<T>(const T*, const T*, int, ClaimedPlan*);                             \
  template cudaError_t launch_decode_claimed<T>(const T*, const T*, const int32_t*, const int32_t*,              \
                                                const HeadShape&, const unsigned long long*, const int32_t*,     \
                                                RowTicket*, const ClaimedPlan&, int64_t*, int64_t, cudaStream_t,   \
                                                bool);
FLASHHEAD_INSTANTIATE(float)
FLASHHEAD_INSTANTIATE(__half)
FLASHHEAD_INSTANTIATE(__nv_bfloat16)
#undef FLASHHEAD_INSTANTIATE

}  // namespace detail
}  // namespace flashhead
