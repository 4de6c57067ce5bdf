// Stage 3: candidate logits, logits[row, j] = embedding[candidates[row, j]] . hidden[row] in fp32.
//
// A gather-GEMV: each warp takes kCandRowsPerWarp candidate slots of one row at a time and reads
// their embedding rows (1-8 KB each, in place); the blocks of a row split its N slots, the grid's
// y dimension walks the rows. The grid is sized to what stays resident, each warp looping over
// slot groups. A slot whose id is outside [0, V) is masked: its row is never read and its logit
// is -inf.
//
// On sm_90 the rows can be staged in shared memory by bulk copies (the copy engine), each warp's
// next group landing while it reads the current one: a warp keeps two groups of rows in flight
// without holding them in registers (the Qwen3-0.6B head 4-6% faster at p = 593 and 1024, 6-21%
// at batch 8). Otherwise (staged_rows_smem says when) each lane loads its 16-byte pieces of the
// group's rows into registers.
#pragma once

#include <algorithm>

#include "kernels/bulk_copy.cuh"
#include "kernels/common.cuh"

namespace flashhead {
namespace detail {

constexpr int kCandThreads = 256;
constexpr int kCandRowsPerWarp = 2;
constexpr int kCandUnroll = 4;
constexpr int kCandSlotsPerBlock = kCandThreads / kWarpSize * kCandRowsPerWarp;
constexpr int kCandBlocksPerSm = 2;
// Staged rows: a warp's group being read and the next one landing.
constexpr int kCandBuffers = 2;
// A lane of the staged instance holds its 16-byte pieces of the hidden row in registers, at
// most this many: rows of up to 4 KB (two blocks of buffers fit rows of about 3.5 KB on an H200).
constexpr int kStagedHiddenChunks = 8;

// The dynamic shared memory of a kernel whose warps stage rows by bulk copies (StagedRowBuffers),
// or 0 where they cannot: the kernel compiled for sm_90 (its PTX version: a JIT from older PTX has
// no bulk copies), rows of whole 16-byte vectors (`vec`), and every warp's buffers fitting with
// kCandBlocksPerSm blocks on an SM (fewer blocks made Llama-3's head slower at batch 1); and, where
// asked, how many blocks with those buffers an SM holds.
template <typename Kernel>
cudaError_t staged_buffers_smem(Kernel kernel, bool vec, int hidden_dim, size_t element, size_t* staged_smem,
                                int* blocks_per_sm = nullptr) {
  *staged_smem = 0;
  if (blocks_per_sm) *blocks_per_sm = 0;
  if (!vec) return cudaSuccess;
  KernelSmem limits{};
  if (cudaError_t err = kernel_smem(kernel, &limits); err != cudaSuccess) return err;
  const size_t smem = size_t{kCandThreads / kWarpSize} * kCandBuffers * kCandRowsPerWarp * hidden_dim * element;
  if (limits.ptx_version < 90 || smem > limits.max_dynamic) return cudaSuccess;
  int per_sm = 0;
  if (cudaError_t err = resident_blocks(kernel, kCandThreads, smem, &per_sm); err != cudaSuccess) return err;
  if (per_sm >= kCandBlocksPerSm) *staged_smem = smem;
  if (blocks_per_sm) *blocks_per_sm = per_sm;
  return cudaSuccess;
}

// The dynamic shared memory of a candidate kernel's staged instance (`kernel`): its warps' buffers
// when rows are to be staged, else 0 (the register instance runs). Rows are staged when a warp
// has more than one slot group (one group gains nothing from the copy engine and pays the round
// trip through shared memory), a lane's pieces of the hidden row fit kStagedHiddenChunks, and
// staged_buffers_smem allows it.
template <typename Kernel>
cudaError_t staged_rows_smem(Kernel kernel, bool vec, int hidden_dim, size_t element, int num_candidates, int rows,
                             int sms, size_t* staged_smem) {
  *staged_smem = 0;
  const bool one_group_a_warp = ceil_div(num_candidates, kCandSlotsPerBlock) <= sms * kCandBlocksPerSm / rows;
  const bool row_in_registers = hidden_dim * element <= size_t{kStagedHiddenChunks} * kWarpSize * sizeof(int4);
  if (one_group_a_warp || !row_in_registers) return cudaSuccess;
  return staged_buffers_smem(kernel, vec, hidden_dim, element, staged_smem);
}

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

// A slot's token, and a packed (key, token) best already found for the slot's whole cluster (0:
// none; such a slot's row is not read).
struct SlotToken {
  int32_t token;
  uint64_t known;
};

// The slot tokens of for_each_slot_group come from a policy: slot(row, slot) for slot < N,
// warm_l2(), which a block may run before its inputs are ready, and kKnownBests, whether a slot
// may come with a known best.
// ListedTokens: a written list of candidates [B, N].
struct ListedTokens {
  static constexpr bool kKnownBests = false;
  const int32_t* candidates;
  int num_candidates;
  __device__ __forceinline__ SlotToken slot(int64_t row, int slot) const {
    return {candidates[row * num_candidates + slot], 0};
  }
  __device__ __forceinline__ void warm_l2() const {}
};

// Token i of the k-th chosen cluster for slot k * b + i, read from the cluster table itself (the
// selection's chosen ids are always in range), then the extra ids as given: the fused decode
// deals with repeated extras itself (decode.cuh).
struct ClusterTokens {
  static constexpr bool kKnownBests = false;
  const int32_t* cluster_ids;     // [B, p]
  const int32_t* cluster_tokens;  // [C, b]
  const int32_t* extra_ids;       // [E]
  int probes, cluster_size, num_clusters;
  __device__ __forceinline__ SlotToken slot(int64_t row, int slot) const { return slot_with(row, slot, nullptr); }
  // With the clusters' known bests [C] (null: none known), read beside the table entry.
  // kPolled: see chosen_cluster.
  template <bool kPolled = false>
  __device__ __forceinline__ SlotToken slot_with(int64_t row, int slot, const unsigned long long* known_bests) const {
    const int gathered = probes * cluster_size;
    if (slot >= gathered) return {extra_ids[slot - gathered], 0};
    const int k = slot / cluster_size;
    const int32_t cluster = chosen_cluster<kPolled>(row, k);
    return {cluster_tokens[int64_t{cluster} * cluster_size + (slot - k * cluster_size)],
            known_bests ? __ldcg(known_bests + cluster) : 0};
  }
  // The k-th cluster listed for `row`. kPolled: the list is -1 until the selection writes it (the
  // scoring kernel sets it so), and the entry is polled, not read once the selection has ended.
  template <bool kPolled>
  __device__ __forceinline__ int32_t chosen_cluster(int64_t row, int k) const {
    const int32_t* entry = cluster_ids + row * probes + k;
    if constexpr (kPolled) {
      int32_t cluster;
      do cluster = load_relaxed(entry);
      while (cluster < 0);
      return cluster;
    } else {
      return *entry;
    }
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

// Logits of kCandRowsPerWarp consecutive slots, in every lane of the warp. A slot with a known
// best (SlotToken) is not valid: its row was not read.
struct WarpSlots {
  int32_t token[kCandRowsPerWarp];
  bool valid[kCandRowsPerWarp];
  float logit[kCandRowsPerWarp];
  uint64_t known[kCandRowsPerWarp];
};

// The tokens of the kCandRowsPerWarp slots from `first` of `row` (-1 past the row's end), and
// where asked their known bests.
template <typename T, typename Tokens>
__device__ __forceinline__ void fetch_slot_tokens(const CandidateRows<T>& a, const Tokens& tokens, int64_t row,
                                                  int first, int32_t (&token)[kCandRowsPerWarp],
                                                  uint64_t (*known)[kCandRowsPerWarp] = nullptr) {
#pragma unroll
  for (int r = 0; r < kCandRowsPerWarp; ++r) {
    const SlotToken id = first + r < a.num_candidates ? tokens.slot(row, first + r) : SlotToken{-1, 0};
    token[r] = id.token;
    if (known) (*known)[r] = id.known;
  }
}

// A slot's token names a row of the embedding; any other id is a masked slot.
__device__ __forceinline__ bool in_vocab(int32_t token, int vocab) { return token >= 0 && token < vocab; }

template <typename T>
__device__ __forceinline__ WarpSlots slots_of(const CandidateRows<T>& a, const int32_t (&token)[kCandRowsPerWarp],
                                             const uint64_t (&known)[kCandRowsPerWarp]) {
  WarpSlots s;
#pragma unroll
  for (int r = 0; r < kCandRowsPerWarp; ++r) {
    s.token[r] = token[r];
    s.known[r] = known[r];
    s.valid[r] = known[r] == 0 && in_vocab(token[r], a.vocab);
  }
  return s;
}
template <typename T>
__device__ __forceinline__ WarpSlots slots_of(const CandidateRows<T>& a, const int32_t (&token)[kCandRowsPerWarp]) {
  return slots_of(a, token, {});
}

// The logits of a warp's kCandRowsPerWarp slots: the rows of `token` where `valid`, 0 elsewhere.
// The register slot loop and the fused decode's early clusters (decode.cuh) both sum through it, so
// a cluster's logits are the same bits either way. A group with no row to read skips the hidden
// row's loads too; `valid` must be the same in every lane (warp_dot's shuffles take the whole warp).
template <typename T>
__device__ __forceinline__ void group_logits(const CandidateRows<T>& a, const T* hidden_row,
                                             const int32_t (&token)[kCandRowsPerWarp],
                                             const bool (&valid)[kCandRowsPerWarp], float (&acc)[kCandRowsPerWarp][1]) {
  const T* rows[kCandRowsPerWarp];
  const T* hid[1] = {hidden_row};
  bool any_row = false;
#pragma unroll
  for (int r = 0; r < kCandRowsPerWarp; ++r) {
    rows[r] = valid[r] ? a.embedding + int64_t{token[r]} * a.hidden_dim : nullptr;
    any_row |= valid[r];
    acc[r][0] = 0.0f;
  }
  if (any_row)
    warp_dot<T, T, kCandRowsPerWarp, 1, kCandUnroll>(rows, hid, a.hidden_dim, a.vec, row_policy(a.rows_once), acc);
}

#ifdef FLASHHEAD_BULK_COPIES
// A warp's kCandBuffers buffers of kCandRowsPerWarp embedding rows in dynamic shared memory, each
// with an mbarrier; rows land there by bulk copies (the copy engine), so a warp keeps groups of
// rows in flight without holding them in registers.
template <typename T>
struct StagedRowBuffers {
  static constexpr int R = kCandRowsPerWarp;
  const T* embedding;  // [V, D]
  int vocab, hidden_dim, row_bytes;
  uint64_t policy;
  T* rows;             // [kCandBuffers][R][D] of this warp
  uint64_t* landed;    // [kCandBuffers]

  // Every lane of the warp; `barriers` holds kCandBuffers a warp.
  __device__ __forceinline__ StagedRowBuffers(const T* embedding_, int vocab_, int hidden_dim_, uint64_t policy_,
                                              uint64_t* barriers)
      : embedding(embedding_),
        vocab(vocab_),
        hidden_dim(hidden_dim_),
        row_bytes(hidden_dim_ * static_cast<int>(sizeof(T))),
        policy(policy_) {
    extern __shared__ __align__(128) unsigned char staged_rows[];
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    rows = reinterpret_cast<T*>(staged_rows) + size_t{static_cast<unsigned>(warp)} * kCandBuffers * R * hidden_dim;
    landed = barriers + warp * kCandBuffers;
    if (lane < kCandBuffers) mbarrier_init(landed + lane);
    fence_mbarrier_init();
    __syncwarp();
  }
  __device__ __forceinline__ const T* row(int buffer, int r) const { return rows + (buffer * R + r) * hidden_dim; }
  // The 16-byte piece `chunk` of row r of `buffer`, or zeros where the row is masked (`valid`
  // false): its buffer was not refilled, and its bytes from an older fill are not ordered by this
  // fill's barrier.
  __device__ __forceinline__ int4 piece(int buffer, int r, int chunk, bool valid) const {
    return valid ? reinterpret_cast<const int4*>(row(buffer, r))[chunk] : make_int4(0, 0, 0, 0);
  }
  // The copies of `token`'s rows into `buffer`, one arrival expecting the valid rows' bytes; lane
  // r copies row r. Ids outside [0, vocab) are masked: their rows are not copied. The whole warp
  // calls it, after its last reads of the buffer and fence_before_bulk_copies.
  __device__ __forceinline__ void issue(int buffer, const int32_t (&token)[R]) {
    const int lane = threadIdx.x % kWarpSize;
    int bytes = 0;
#pragma unroll
    for (int r = 0; r < R; ++r) bytes += in_vocab(token[r], vocab) ? row_bytes : 0;
    if (lane == 0) mbarrier_expect_bytes(landed + buffer, bytes);
    __syncwarp();  // the phase expects its bytes before any of them land
    if (lane < R) {
      const int32_t t = pick(token, lane);
      if (in_vocab(t, vocab))
        copy_bulk(rows + (buffer * R + lane) * hidden_dim, embedding + int64_t{t} * hidden_dim, row_bytes,
                  landed + buffer, policy);
    }
  }
  // Waits for the `use`-th fill of `buffer` (counted from 0).
  __device__ __forceinline__ void wait(int buffer, unsigned use) const { mbarrier_wait(landed + buffer, use); }
};

// for_each_slot_group with staged rows: group k lands in buffer k % kCandBuffers. Before reading
// group k the warp issues the copies of group k + kCandBuffers - 1 into the buffer it finished
// reading last.
template <typename T, typename Tokens, typename F>
__device__ __forceinline__ void for_each_staged_slot_group(const CandidateRows<T>& a, const Tokens& tokens,
                                                           int64_t row, F f) {
  constexpr int R = kCandRowsPerWarp, W = kVecWidth<T>, kWarps = kCandThreads / kWarpSize;
  __shared__ uint64_t landed[kWarps * kCandBuffers];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  StagedRowBuffers<T> buffers(a.embedding, a.vocab, a.hidden_dim, row_policy(a.rows_once), landed);
  auto issue = [&](int buffer, const int32_t (&token)[R]) { buffers.issue(buffer, token); };
  const int stride = gridDim.x * kCandSlotsPerBlock;
  const T* hid = a.hidden + row * a.hidden_dim;
  int first = blockIdx.x * kCandSlotsPerBlock + warp * R;
  int32_t ahead[kCandBuffers][R];  // the tokens of groups k .. k + kCandBuffers - 1
#pragma unroll
  for (int j = 0; j < kCandBuffers; ++j) fetch_slot_tokens(a, tokens, row, first + j * stride, ahead[j]);
#pragma unroll
  for (int j = 0; j + 1 < kCandBuffers; ++j)
    if (first + j * stride < a.num_candidates) issue(j, ahead[j]);
  // This lane's pieces of the hidden row, read once for all groups (batch 8: 3-9% faster than
  // reading them for every group), after the first copies are out (before them: batch 1 slower).
  Piece<T, W> h[kStagedHiddenChunks];
#pragma unroll
  for (int j = 0; j < kStagedHiddenChunks; ++j) {
    const int idx = lane + j * kWarpSize;
    h[j] = idx < a.hidden_dim / W ? load_piece<T, W>(hid + idx * W, nullptr) : Piece<T, W>{};
  }
  for (unsigned k = 0; first < a.num_candidates; first += stride, ++k) {  // uniform within the warp
    int32_t after[R];
    fetch_slot_tokens(a, tokens, row, first + kCandBuffers * stride, after);
    if (first + (kCandBuffers - 1) * stride < a.num_candidates) {
      fence_before_bulk_copies();  // the buffer's last reads (ordered across the warp by __syncwarp below)
      issue((k + kCandBuffers - 1) % kCandBuffers, ahead[kCandBuffers - 1]);
    }
    const int buffer = k % kCandBuffers;
    buffers.wait(buffer, k / kCandBuffers);
    WarpSlots s = slots_of(a, ahead[0]);
    // The same pieces in the same order as warp_dot. Not through warp_dot_chunks: with its loop
    // this instance was 8-60% slower at batch 8 (docs/benchmarks.md).
    float acc[R] = {};
#pragma unroll
    for (int j = 0; j < kStagedHiddenChunks; ++j) {
      const int idx = lane + j * kWarpSize;
      if (idx < a.hidden_dim / W) {
        float hf[W];
        piece_floats(h[j], hf);
#pragma unroll
        // A masked row's buffer holds bytes of an older fill or none, and its sum is dropped. Read
        // anyway, not through piece(): a predicate a piece made this kernel up to 6% slower at
        // batches 2-16 (docs/benchmarks.md, session 46).
        for (int r = 0; r < R; ++r) {
          Piece<T, W> c;
          const int4 raw = *reinterpret_cast<const int4*>(buffers.row(buffer, r) + idx * W);
          memcpy(c.word, &raw, sizeof(raw));
          float cf[W];
          piece_floats(c, cf);
#pragma unroll
          for (int e = 0; e < W; ++e) acc[r] = fmaf(cf[e], hf[e], acc[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float sum = warp_sum(acc[r]);
      s.logit[r] = s.valid[r] ? sum : -INFINITY;
#pragma unroll
      for (int j = 0; j + 1 < kCandBuffers; ++j) ahead[j][r] = ahead[j + 1][r];
      ahead[kCandBuffers - 1][r] = after[r];
    }
    f(s, first);
    __syncwarp();  // every lane is done with the buffer before the next issue refills it
  }
}
#endif

// Calls f(slots, first_slot) for each group of kCandRowsPerWarp slots of `row` this warp owns
// (token ids from `tokens`):
// a grid-stride loop over the row's slots, so a grid sized to the GPU pays each block's fixed
// costs once. The next group's ids are loaded before the current group's rows are read, so the
// two latencies overlap.
// kStaged: rows staged by bulk copies (for_each_staged_slot_group), its own kernel instance so that
// the other path's registers and code are its own. Compiled for a GPU without bulk copies, the
// staged instance reads rows into registers too (staged_rows_smem never picks it there).
template <bool kStaged, typename T, typename Tokens, typename F>
__device__ __forceinline__ void for_each_slot_group(const CandidateRows<T>& a, const Tokens& tokens, int64_t row, F f) {
#ifdef FLASHHEAD_BULK_COPIES
  if constexpr (kStaged) {
    for_each_staged_slot_group(a, tokens, row, f);
    return;
  }
#endif
  const int stride = gridDim.x * kCandSlotsPerBlock;
  const T* hidden_row = a.hidden + row * a.hidden_dim;
  int first = blockIdx.x * kCandSlotsPerBlock + threadIdx.x / kWarpSize * kCandRowsPerWarp;
  int32_t token[kCandRowsPerWarp];
  uint64_t known[kCandRowsPerWarp];
  fetch_slot_tokens(a, tokens, row, first, token, &known);
  for (; first < a.num_candidates; first += stride) {  // uniform within the warp
    int32_t next[kCandRowsPerWarp];
    uint64_t next_known[kCandRowsPerWarp];
    fetch_slot_tokens(a, tokens, row, first + stride, next, &next_known);
    // Lane 0's bests for the whole warp, taken here, not as they are fetched (the fetch is the next
    // group's, in flight while this one is summed): another block may store a best while the warp
    // reads it, and the lanes must agree on which rows they sum (group_logits' shuffles).
    if constexpr (Tokens::kKnownBests)
#pragma unroll
      for (int r = 0; r < kCandRowsPerWarp; ++r)
        known[r] = __shfl_sync(kFullMask, static_cast<unsigned long long>(known[r]), 0);
    WarpSlots s = slots_of(a, token, known);  // alike in every lane: the same ids, and lane 0's bests
    float acc[kCandRowsPerWarp][1];
    group_logits(a, hidden_row, token, s.valid, acc);
#pragma unroll
    for (int r = 0; r < kCandRowsPerWarp; ++r) {
      s.logit[r] = s.valid[r] ? acc[r][0] : -INFINITY;
      token[r] = next[r];
      known[r] = next_known[r];
    }
    f(s, first);
  }
}

}  // namespace detail
}  // namespace flashhead
