// Stage 2a: per-row top-p selection over C keys, one block of kSelectThreads per row.
//
// Latency is what counts here (one block, a chain of block-wide steps), so the work is cut
// before it starts:
//  1. Keys (order-preserving uint32) sit in registers. A lower bound of the p-th largest key
//     comes cheaply: with w = ceil(p / 32), every warp's w-th largest lane maximum is met by w
//     keys of that warp, so the minimum over the 32 warps is met by >= 32 w >= p keys. Keys below
//     it cannot be selected (p <= 1024; larger p skips the bound).
//  2. The survivors are compacted into shared memory by a block-wide prefix sum (a few hundred
//     keys for p = 256 of ~10k), with predicated stores: most warps have a survivor in most rounds.
//  3. A radix select over the survivors finds the p-th key: each pass splits the key range still
//     in question, [floor, row maximum] at first, into 4096 shared-histogram bins of 2^s keys, s
//     the smallest that covers the range, and keeps the bin holding the p-th key; it ends once
//     that bin holds exactly the keys still needed, or one key value. The first histogram is
//     counted from the compacted survivors (from the register keys if they overflowed), and each
//     pass costs about as much whatever its bin count (four bins a thread), so the wide bins
//     mostly leave no pass at all: at p = 256 the boundary bin usually holds the p-th key alone.
//     A last pass collects the winners as packed (key, id) pairs: by shared atomics, or, where the
//     list's order must be the same on every run, by a block-wide prefix sum; where only their ids
//     are read, it stores those straight to the output (ChosenIds). If the survivors
//     overflow shared memory, steps 3-4 read the register keys instead.
//  4. Only an exact tie at the boundary needs id order (ties go to the smaller cluster id):
//     a block-wide prefix count over the register keys, in id order, picks the smallest ids.
// Rank order, when asked for, is a bitonic sort of the p pairs: one pair per thread, shuffles
// within a warp, one barrier per step across warps; warps without pairs skip the work.
#pragma once

#include "kernels/block_candidates.cuh"

namespace flashhead {
namespace detail {

constexpr int kSelectThreads = 1024;
constexpr int kSelectWarps = kSelectThreads / kWarpSize;
static_assert(kSelectWarps == kWarpSize, "per-warp values are combined by a warp, one a lane");
// Keys a thread keeps in registers, at most: rows of up to 16384 clusters are read from memory
// once. The kernel is compiled for every count from kMinSelectCached (fewer would spill) and
// launched with the smallest that holds the row, since every register slot costs instructions in
// every pass.
constexpr int kSelectCached = 16;
constexpr int kMinSelectCached = 8;
// Longest selection list kept (and sorted) in shared memory; longer lists live in the workspace.
constexpr int kSmemListMax = 4096;
constexpr int kMaxSurvivors = 8192;
constexpr int kRadixBits = 12;
constexpr int kRadixBins = 1 << kRadixBits;
// Each thread scans (and clears) four consecutive bins with one 16-byte access.
static_assert(kRadixBins == 4 * kSelectThreads, "a thread owns one uint4 of bins");

struct SelectShared {
  alignas(16) uint32_t hist[kRadixBins];
  uint32_t warp_counts[kSelectWarps];
  uint32_t warp_bound[kSelectWarps], warp_max[kSelectWarps];
  uint32_t digit, need, tied;
  uint32_t count;
};

// Where an unranked selection goes: a list of packed (key, id) pairs, or (ChosenIds) the ids alone,
// stored straight to the op's output where nothing else reads the list.
struct ChosenIds {
  int32_t* ids;
};
__device__ __forceinline__ void put(uint64_t* list, uint32_t at, uint64_t pair) { list[at] = pair; }
__device__ __forceinline__ void put(const ChosenIds& out, uint32_t at, uint64_t pair) {
  store_relaxed(out.ids + at, packed_id(pair));  // each once, final: polled by the early decode
}

// The barrier after a list's last append, before any thread reads it: none for ChosenIds, which
// no thread of the block reads.
template <typename List>
__device__ __forceinline__ void barrier_for_list_readers() {
  if constexpr (!std::is_same_v<List, ChosenIds>) __syncthreads();
}

// Appends `value` for each lane with `take` to list[*count ...], one shared atomic per warp (the
// warps' order varies from run to run).
template <typename List>
__device__ __forceinline__ void warp_append(bool take, uint64_t value, List list, uint32_t* count) {
  const unsigned ballot = __ballot_sync(kFullMask, take);
  if (ballot == 0) return;
  const int lane = threadIdx.x % kWarpSize, leader = __ffs(ballot) - 1;
  uint32_t base = 0;
  if (lane == leader) base = atomicAdd(count, static_cast<uint32_t>(__popc(ballot)));
  base = __shfl_sync(kFullMask, base, leader);
  const uint32_t at = base + __popc(ballot & ((1u << lane) - 1));
  if (take) put(list, at, value);
}

// The keys of one row as seen by one thread: ids threadIdx.x + i * kSelectThreads, the first
// kCached of them in registers. Keys below `floor` do not take part. Ids past the row's end hold
// key 0 and real keys are > 0 (order_key(-inf) > 0), so with floor >= 1 a key is valid exactly
// when it reaches the floor: no bounds checks per key (they cost a predicate a round, which the
// compiler kept in a register and rebuilt in every pass).
template <int kCached>
struct RowKeys {
  const float* keys;
  int n;
  uint32_t floor;  // >= 1
  uint32_t cached[kCached];

  __device__ __forceinline__ void load(const float* row_keys, int num) {
    keys = row_keys;
    n = num;
    floor = 1;
    // Every load first, so all of them are in flight together, from one address plus constant
    // offsets (a clamped index cost each key its own 64-bit address arithmetic).
    const float* mine = row_keys + threadIdx.x;
    float raw[kCached];
#pragma unroll
    for (int i = 0; i < kCached; ++i)
      raw[i] = i * kSelectThreads + static_cast<int>(threadIdx.x) < n ? mine[i * kSelectThreads] : 0.0f;
#pragma unroll
    for (int i = 0; i < kCached; ++i)
      cached[i] = i * kSelectThreads + static_cast<int>(threadIdx.x) < n ? order_key(raw[i]) : 0;
  }

  // g(id, key, valid) once per round of kSelectThreads consecutive ids, in increasing id, every
  // thread of the block taking part in every round (so g may vote and synchronise the block).
  template <typename G>
  __device__ __forceinline__ void for_each_round(G g) const {
    const int rounds = ceil_div(n, kSelectThreads);
#pragma unroll
    for (int i = 0; i < kCached; ++i)
      if (i < rounds) g(i * kSelectThreads + static_cast<int>(threadIdx.x), cached[i], cached[i] >= floor);
    for_each_uncached_round(g);
  }

  // f(id, key) for each key this thread holds, valid or not (0 past the row's end), in no step with
  // the other threads (f must not vote or synchronise the block).
  template <typename F>
  __device__ __forceinline__ void for_each_key(F f) const {
#pragma unroll
    for (int i = 0; i < kCached; ++i) f(i * kSelectThreads + static_cast<int>(threadIdx.x), cached[i]);
    for_each_uncached_round([&](int idx, uint32_t key, bool) { f(idx, key); });
  }

  // for_each_key over the valid keys only.
  template <typename F>
  __device__ __forceinline__ void for_each_valid(F f) const {
    for_each_key([&](int idx, uint32_t key) {
      if (key >= floor) f(idx, key);
    });
  }

  // The rounds past the cached ones, read from memory (rows of over kCached rounds), in step like
  // for_each_round; for_each_key and thread_max take them through here too.
  template <typename G>
  __device__ __forceinline__ void for_each_uncached_round(G g) const {
    for (int i = kCached; i < ceil_div(n, kSelectThreads); ++i) {
      const int idx = i * kSelectThreads + threadIdx.x;
      const uint32_t key = idx < n ? order_key(keys[idx]) : 0u;
      g(idx, key, key >= floor);
    }
  }

  // Largest key of this thread (0 when it has none).
  __device__ __forceinline__ uint32_t thread_max() const {
    uint32_t m = 0;
    for_each_key([&](int, uint32_t key) { m = max(m, key); });
    return m;
  }
};

// Survivors compacted in shared memory as packed (key, id) pairs, in no particular order.
struct SurvivorKeys {
  const uint64_t* pairs;
  int n;

  template <typename G>
  __device__ __forceinline__ void for_each_round(G g) const {
    for (int base = 0; base < n; base += kSelectThreads) {
      const int e = base + threadIdx.x;
      const uint64_t pair = e < n ? pairs[e] : kNoneRanked;
      g(packed_id(pair), static_cast<uint32_t>(pair >> 32), e < n);
    }
  }

  // f(id, key) for each pair this thread holds (all of them valid), in no step with the other
  // threads (f must not vote or synchronise the block).
  template <typename F>
  __device__ __forceinline__ void for_each_valid(F f) const {
    for (int e = threadIdx.x; e < n; e += kSelectThreads) {
      const uint64_t pair = pairs[e];
      f(packed_id(pair), static_cast<uint32_t>(pair >> 32));
    }
  }
};

// k-th largest (k in 1..32) of the lanes' values, in every lane: a bitonic sort across the warp.
__device__ __forceinline__ uint32_t warp_kth_largest(uint32_t v, int k) {
  if (k == kWarpSize) return __reduce_min_sync(kFullMask, v);  // the 32nd largest is the least: no sort
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int size = 2; size <= kWarpSize; size <<= 1) {
#pragma unroll
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      const uint32_t other = __shfl_xor_sync(kFullMask, v, stride);
      v = (((lane & size) == 0) == ((lane & stride) == 0)) ? max(v, other) : min(v, other);
    }
  }
  return __shfl_sync(kFullMask, v, k - 1);
}

// The range of keys that can be selected: a key every one of the p best keys reaches (step 1
// above) and the row's largest key; [0, 2^32) (no bound) when p > 1024.
struct KeyRange {
  uint32_t lo, hi;
};
template <typename Keys>
__device__ __forceinline__ KeyRange selection_range(const Keys& keys, int p, SelectShared& sh) {
  const int per_warp = ceil_div(p, kSelectWarps);
  if (per_warp > kWarpSize) return {0u, ~0u};
  const uint32_t mine = keys.thread_max();
  const uint32_t warp_max = __reduce_max_sync(kFullMask, mine);
  const uint32_t bound = per_warp == 1 ? warp_max : warp_kth_largest(mine, per_warp);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  if (lane == 0) {
    sh.warp_bound[warp] = bound;
    sh.warp_max[warp] = warp_max;
  }
  __syncthreads();
  return {__reduce_min_sync(kFullMask, sh.warp_bound[lane]), __reduce_max_sync(kFullMask, sh.warp_max[lane])};
}

// Inclusive prefix sum over the lanes of a warp.
__device__ __forceinline__ uint32_t warp_inclusive_sum(uint32_t value) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset <<= 1) {
    const uint32_t v = __shfl_up_sync(kFullMask, value, offset);
    if (lane >= offset) value += v;
  }
  return value;
}

// The sum of the per-warp counts of the warps before this one, and their total, from
// counts[kSelectWarps] in shared memory, a count a lane: two warp reductions, side by side (a
// shuffle scan was five dependent steps).
__device__ __forceinline__ uint32_t warps_before(const uint32_t* counts, uint32_t& total) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const uint32_t count = counts[lane];
  total = __reduce_add_sync(kFullMask, count);
  return __reduce_add_sync(kFullMask, lane < warp ? count : 0u);
}

// Exclusive prefix sum of one value per thread over the block, and the total. The block must pass
// a barrier before the next call (sh.warp_counts is rewritten): the callers' own barriers do.
__device__ __forceinline__ uint32_t block_exclusive_sum(uint32_t value, uint32_t& total, SelectShared& sh) {
  const uint32_t inclusive = warp_inclusive_sum(value);
  if (threadIdx.x % kWarpSize == kWarpSize - 1) sh.warp_counts[threadIdx.x / kWarpSize] = inclusive;
  __syncthreads();
  return warps_before(sh.warp_counts, total) + inclusive - value;
}

// The selected set is the keys above hi plus `need` of the `tied` keys in [lo, hi] (all of them
// when need == tied; lo == hi otherwise).
struct Threshold {
  uint32_t lo, hi, need, tied;
};

// Bins of 2^shift keys that cover [lo, hi] in kRadixBins bins: (hi - lo) >> shift < kRadixBins.
__device__ __forceinline__ int radix_shift(uint32_t lo, uint32_t hi) { return max(0, 32 - __clz(hi - lo) - kRadixBits); }

// Where key >= floor: pack_ranked(key, id) (the words ~id, key) to shared address pairs + 8 at, and
// ++at. Predicated instructions from one shared address: as C++ the compiler branched around each
// key's store and rebuilt the shared window's base inside every branch.
__device__ __forceinline__ void append_if_valid(uint32_t key, uint32_t floor, int32_t id, uint32_t pairs, uint32_t& at) {
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "setp.ge.u32 p, %1, %2;\n\t"
      "@p st.shared.v2.u32 [%3], {%4, %1};\n\t"
      "@p add.u32 %0, %0, 1;\n\t}"
      : "+r"(at)
      : "r"(key), "r"(floor), "r"(pairs + 8 * at), "r"(~static_cast<uint32_t>(id))
      : "memory");
}

// Counts a valid key of [lo, hi] into sh.hist at radix_shift(lo, hi).
__device__ __forceinline__ void count_key(uint32_t key, uint32_t lo, int shift, SelectShared& sh) {
  atomicAdd(&sh.hist[(key - lo) >> shift], 1u);
}

// The k-th largest of the valid keys, all of them in `range`. On entry sh.hist holds their
// histogram over `range` (count_key at radix_shift(range)) and every thread has passed a barrier
// since.
template <typename Keys>
__device__ __forceinline__ Threshold radix_select(const Keys& keys, uint32_t k, KeyRange range, SelectShared& sh) {
  uint32_t lo = range.lo, hi = range.hi, need = k, tied = 0;
  uint4* bins = reinterpret_cast<uint4*>(sh.hist);
  for (;;) {
    const int shift = radix_shift(lo, hi);
    // Thread t scans bins 4 (1023 - t) + 3 down to 4 (1023 - t): a block-wide prefix sum from the
    // top bin down finds the bin holding the need-th largest key. Only this thread reads its bins,
    // so it clears them at once for the next pass.
    const int owned = kSelectThreads - 1 - static_cast<int>(threadIdx.x);
    const uint4 v = bins[owned];
    bins[owned] = make_uint4(0u, 0u, 0u, 0u);
    const uint32_t counts[4] = {v.w, v.z, v.y, v.x};
    const uint32_t total = v.x + v.y + v.z + v.w;
    uint32_t all;
    uint32_t before = block_exclusive_sum(total, all, sh);
    if (before < need && need <= before + total) {
      bool found = false;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (!found && before + counts[q] >= need) {
          found = true;
          sh.digit = 4 * owned + 3 - q;
          sh.need = need - before;
          sh.tied = counts[q];
        }
        if (!found) before += counts[q];
      }
    }
    __syncthreads();
    lo += sh.digit << shift;  // <= hi: the bin holds a key
    hi = lo + min(hi - lo, (1u << shift) - 1);
    need = sh.need;
    tied = sh.tied;
    if (tied == need || shift == 0) break;
    const int next = radix_shift(lo, hi);
    keys.for_each_valid([&](int, uint32_t key) {
      if (key >= lo && key <= hi) count_key(key, lo, next, sh);
    });
    __syncthreads();
  }
  return {lo, hi, need, tied};
}

// radix_select over compacted keys, all of them in `range`, their first histogram counted here;
// every thread has passed a barrier since they were stored.
__device__ __forceinline__ Threshold radix_select_compacted(const SurvivorKeys& compact, uint32_t k, KeyRange range,
                                                            SelectShared& sh) {
  const int shift = radix_shift(range.lo, range.hi);
  compact.for_each_valid([&](int, uint32_t key) { count_key(key, range.lo, shift, sh); });
  __syncthreads();
  return radix_select(compact, k, range, sh);
}

// Appends `value` where `take` to list[count ...] in thread order (a block-wide prefix sum: the
// same order on every run, at a barrier pair a round); returns the new count.
__device__ __forceinline__ uint32_t block_append(bool take, uint64_t value, uint64_t* list, uint32_t count,
                                                 SelectShared& sh) {
  uint32_t total;
  const uint32_t at = count + block_exclusive_sum(take, total, sh);
  if (take) list[at] = value;
  __syncthreads();  // the next round's prefix sum rewrites sh.warp_counts
  return count + total;
}

// Appends the selected keys above the boundary (and the boundary keys too when all of them are
// needed) to list[0 ...]: kStable in a stable order (block_append), returning how many; otherwise
// in any order (warp_append, counting in sh.count, which must be 0), returning 0.
template <bool kStable, typename Keys, typename List>
__device__ __forceinline__ uint32_t collect_above(const Keys& keys, const Threshold& th, List list,
                                                  SelectShared& sh) {
  // hi + 1 does not wrap: no key exceeds order_key(+inf) < 2^32 - 1.
  const uint32_t least = th.need == th.tied ? th.lo : th.hi + 1;
  uint32_t count = 0;
  keys.for_each_round([&](int idx, uint32_t key, bool valid) {
    const bool take = valid && key >= least;
    if constexpr (kStable)
      count = block_append(take, pack_ranked(key, idx), list, count, sh);
    else
      warp_append(take, pack_ranked(key, idx), list, &sh.count);
  });
  return count;
}

// More keys equal the boundary key than are needed: the smallest ids win, found by counting
// tied keys in id order, a round of kSelectThreads ids at a time; they follow the collect_above
// list (kStable: at list[count ...] in id order).
template <bool kStable, typename Keys, typename List>
__device__ __forceinline__ void collect_ties(const Keys& keys, const Threshold& th, List list, uint32_t count,
                                             SelectShared& sh) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  uint32_t taken = 0;
  keys.for_each_round([&](int idx, uint32_t key, bool valid) {
    if (taken >= th.need) return;  // uniform: every thread holds the same count
    const bool is_tied = valid && key == th.lo;
    const unsigned ballot = __ballot_sync(kFullMask, is_tied);
    if (lane == 0) sh.warp_counts[warp] = __popc(ballot);
    __syncthreads();
    uint32_t round_total;
    const uint32_t rank = taken + warps_before(sh.warp_counts, round_total) + __popc(ballot & ((1u << lane) - 1));
    const bool take = is_tied && rank < th.need;
    if constexpr (kStable) {
      if (take) list[count + rank] = pack_ranked(key, idx);
    } else {
      warp_append(take, pack_ranked(key, idx), list, &sh.count);
    }
    taken += round_total;
    __syncthreads();  // warp_counts is rewritten next round
  });
}

// select_top's first histogram starts from zero bins, each thread clearing its four; the barrier
// of the survivors' prefix sum, which every path passes, comes before any bin is counted.
__device__ __forceinline__ void clear_histogram(SelectShared& sh) {
  reinterpret_cast<uint4*>(sh.hist)[threadIdx.x] = make_uint4(0u, 0u, 0u, 0u);
}

// Writes the p best (key, id) pairs of the row, packed, to list[0, p), unranked: in an order set
// by the keys alone (kStable), else in any order. `survivors` is shared scratch for up to
// `capacity` pairs; sh.hist is zero on entry (clear_histogram).
template <bool kStable, typename Keys, typename List>
__device__ __forceinline__ void select_top(Keys& keys, int p, List list, uint64_t* survivors,
                                           uint32_t capacity, SelectShared& sh) {
  const KeyRange range = selection_range(keys, p, sh);
  keys.floor = max(range.lo, 1u);
  // Compaction without atomics: each thread's count, a block-wide exclusive scan, then writes.
  // Counted against a copy of the floor the compiler cannot see through: otherwise it keeps each
  // compare's result for the loops below as a bit of a register (two more instructions a key). The
  // copy holds keys.floor's value, which the writes below compare against: the prefix sum's places
  // and the writes agree.
  uint32_t floor = keys.floor, mine = 0;
  asm("" : "+r"(floor));
  keys.for_each_key([&](int, uint32_t key) { mine += key >= floor; });
  uint32_t num_survivors;
  uint32_t at = block_exclusive_sum(mine, num_survivors, sh);
  const int shift = radix_shift(range.lo, range.hi);
  const bool compacted = num_survivors <= capacity;
  if (compacted) {
    const uint32_t pairs = static_cast<uint32_t>(__cvta_generic_to_shared(survivors));
    keys.for_each_key([&](int idx, uint32_t key) { append_if_valid(key, keys.floor, idx, pairs, at); });
  } else {
    keys.for_each_valid([&](int, uint32_t key) { count_key(key, range.lo, shift, sh); });
  }
  if (threadIdx.x == 0) sh.count = 0;  // warp_append's fill count
  __syncthreads();
  Threshold th;
  uint32_t count;
  if (compacted) {
    // The first histogram from the compacted keys, a few a thread: counted in the loop above it
    // cost a branch around each register key's atomic, since most warps have a survivor in most
    // rounds.
    const SurvivorKeys compact{survivors, static_cast<int>(num_survivors)};
    th = radix_select_compacted(compact, p, range, sh);
    count = collect_above<kStable>(compact, th, list, sh);
  } else {
    th = radix_select(keys, p, range, sh);
    count = collect_above<kStable>(keys, th, list, sh);
  }
  if (th.need != th.tied) collect_ties<kStable>(keys, th, list, count, sh);
  barrier_for_list_readers<List>();
}

static_assert(kBlockCandidateBlocksMax <= kSelectThreads, "a thread reads a block's cutoff");
static_assert(kBlockCandidatesMax <= kBlockCandidatesPerThread * kSelectThreads, "candidates fit the threads");

// select_top from the scoring blocks' kept candidates (block_candidates.cuh) instead of the row:
// the keys above the largest cutoff are all candidates, and where p of them pass it they hold the
// row's p best. Returns false, with nothing written and sh as on entry, where fewer pass or where
// the p-th key ties keys the cutoff left out (ids order ties, so that takes the whole row).
// The few candidates a thread are compacted before they are ranked: counted straight from registers,
// the list came sooner yet the early-cluster decode (p = 256) took 0.25 us longer, its entries now
// ahead of the early clusters' bests; and a team of fewer threads was slower, as each step's chain
// of latencies, not the warps' issue, sets its time (docs/benchmarks.md, session 60).
template <bool kStable, typename List>
__device__ __forceinline__ bool select_top_from_candidates(const BlockCandidates& kept, int p, List list,
                                                           uint64_t* survivors, uint32_t capacity, SelectShared& sh) {
  const int count = kept.blocks * kept.per_block;
  uint64_t pair[kBlockCandidatesPerThread];
#pragma unroll
  for (int i = 0; i < kBlockCandidatesPerThread; ++i) {
    const int at = i * kSelectThreads + static_cast<int>(threadIdx.x);
    pair[i] = at < count ? kept.pairs[at] : kNoneRanked;
  }
  const uint32_t cutoff = static_cast<int>(threadIdx.x) < kept.blocks ? kept.cutoffs[threadIdx.x] : 0u;
  uint32_t top = 0;
#pragma unroll
  for (int i = 0; i < kBlockCandidatesPerThread; ++i) top = max(top, static_cast<uint32_t>(pair[i] >> 32));
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const uint32_t warp_cutoff = __reduce_max_sync(kFullMask, cutoff), warp_top = __reduce_max_sync(kFullMask, top);
  if (lane == 0) {
    sh.warp_bound[warp] = warp_cutoff;
    sh.warp_max[warp] = warp_top;
  }
  __syncthreads();
  // + 1 does not wrap: no key exceeds order_key(+inf) < 2^32 - 1.
  const uint32_t floor = __reduce_max_sync(kFullMask, sh.warp_bound[lane]) + 1;
  const KeyRange range{floor, max(floor, __reduce_max_sync(kFullMask, sh.warp_max[lane]))};
  uint32_t mine = 0;
#pragma unroll
  for (int i = 0; i < kBlockCandidatesPerThread; ++i) mine += static_cast<uint32_t>(pair[i] >> 32) >= floor;
  uint32_t passed;
  uint32_t at = block_exclusive_sum(mine, passed, sh);
  if (passed < static_cast<uint32_t>(p) || passed > capacity) {
    __syncthreads();  // every thread has read sh.warp_counts
    return false;
  }
#pragma unroll
  for (int i = 0; i < kBlockCandidatesPerThread; ++i)
    if (static_cast<uint32_t>(pair[i] >> 32) >= floor) survivors[at++] = pair[i];
  if (threadIdx.x == 0) sh.count = 0;  // warp_append's fill count
  __syncthreads();
  const SurvivorKeys compact{survivors, static_cast<int>(passed)};
  const Threshold th = radix_select_compacted(compact, p, range, sh);  // leaves sh.hist zero
  if (th.need != th.tied) {
    __syncthreads();  // every thread has read sh's threshold
    return false;
  }
  collect_above<kStable>(compact, th, list, sh);
  barrier_for_list_readers<List>();
  return true;
}

// Block-wide bitonic sort of list[0, n) (n a power of two), best first. Up to kSelectThreads
// pairs, one per thread: steps within a warp use shuffles, steps across warps one barrier each
// through `scratch` (2 * n pairs of shared memory). Longer lists sort in place.
__device__ inline void sort_descending(uint64_t* list, int n, uint64_t* scratch) {
  if (n > kSelectThreads) {
    for (int k = 2; k <= n; k <<= 1) {
      for (int j = k >> 1; j > 0; j >>= 1) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
          const int partner = i ^ j;
          if (partner > i) {
            const uint64_t x = list[i], y = list[partner];
            if ((i & k) == 0 ? x < y : x > y) {
              list[i] = y;
              list[partner] = x;
            }
          }
        }
        __syncthreads();
      }
    }
    return;
  }
  // Only the warps holding pairs do the work (all of warp 0 when n < 32); the others just keep
  // step with the barriers of the steps across warps.
  const int i = threadIdx.x;
  const bool active = i < max(n, kWarpSize);  // whole warps
  const bool mine = i < n;
  uint64_t v = mine ? list[i] : kNoneRanked;
  int buffer = 0;
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      uint64_t other = kNoneRanked;
      if (j >= kWarpSize) {  // n >= 64 here
        if (mine) scratch[buffer * n + i] = v;
        __syncthreads();
        if (mine) other = scratch[buffer * n + (i ^ j)];
        buffer ^= 1;
      } else if (active) {
        other = __shfl_xor_sync(kFullMask, v, j);
      }
      if (active) v = (((i & k) == 0) == ((i & j) == 0)) ? max(v, other) : min(v, other);
    }
  }
  if (mine) list[i] = v;
  __syncthreads();
}

}  // namespace detail
}  // namespace flashhead
