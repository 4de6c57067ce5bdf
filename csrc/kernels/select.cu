#include <algorithm>
#include <type_traits>

#include "kernels/select.cuh"

namespace flashhead {
namespace detail {
namespace {

struct SelectArgs {
  const float* keys;  // [B, C]
  int num_clusters, probes;
  SelectOrder order;
  int list_len;           // p, or the next power of two when sorting
  uint64_t* list_spill;   // [B, list_len] when the list does not fit in shared memory, else null
  uint32_t survivor_capacity;  // pairs of shared memory for the compacted keys
  SelectOutputs out;
  int num_extra;
};

// Sets the row's bit on each chosen cluster; a row whose bit opens a group of kClaimedGroupRows
// (the cluster's kClaimedGroupRows * g-th claim) lists the group (one atomic on the count a warp).
__device__ __forceinline__ void claim_clusters(const uint64_t* list, int probes, int row, const SelectOutputs& out) {
  for (int base = 0; base < probes; base += blockDim.x) {  // whole warps: the appends vote
    const int k = base + threadIdx.x;
    const int32_t id = k < probes ? packed_id(list[k]) : 0;
    const int earlier = k < probes ? __popcll(atomicOr(&out.claims[1 + id], 1ull << row)) : -1;
    const bool opens = earlier >= 0 && earlier % kClaimedGroupRows == 0;
    const unsigned ballot = __ballot_sync(kFullMask, opens);
    if (ballot == 0) continue;
    const int lane = threadIdx.x % kWarpSize, leader = __ffs(ballot) - 1;
    unsigned long long at = 0;
    if (lane == leader) at = atomicAdd(&out.claims[0], static_cast<unsigned long long>(__popc(ballot)));
    at = __shfl_sync(kFullMask, at, leader) + __popc(ballot & ((1u << lane) - 1));
    if (opens) out.claimed_groups[at] = id * kClaimedGroupsMax + earlier / kClaimedGroupRows;
  }
}

// kFromCandidates: batch 1 with the scoring blocks' kept candidates, from the row where they fall
// short; an instance of its own. `kept` is a parameter of its own too: as a field of SelectArgs it
// changed the code of every instance. kIdsOnly: an unranked list of which only the ids are read
// (the greedy decodes', but by claimed cluster), each stored to out.cluster_ids as it is found: no
// list in shared memory, no barrier and no copy after it (B = 1 at p = 32-1024 0.3-0.5 us sooner
// where the decode waits for this kernel's end, docs/benchmarks.md, session 59). Its launch bounds
// say one block an SM: unsaid, ptxas fitted some of its instances to 32 registers and spilled the
// row's keys (batches 2-32 were then 2-3 us slower); said for every instance, it changes their code.
template <int kCached, bool kStable, bool kFromCandidates, bool kIdsOnly>
__global__ void __launch_bounds__(kSelectThreads, kIdsOnly ? 1 : 0) select_kernel(SelectArgs a, BlockCandidates kept) {
  static_assert(!(kStable && kIdsOnly), "a stable list is read back");
  // [survivor_capacity pairs: compacted keys, then the sort's scratch][list_len pairs: the list,
  // when not spilled]
  extern __shared__ uint64_t smem[];
  __shared__ SelectShared sh;
  clear_histogram(sh);  // before the wait: nothing of the previous kernel's is touched
  wait_for_previous_kernel();
  // After the wait: the fused decode's candidate kernel reads the scores (and, in its early-cluster
  // instance, the scoring kernel's presets) before its own wait, and that instance polls the ids
  // written below while this kernel runs.
  let_next_kernel_start();
  const int64_t row = blockIdx.x;
  RowKeys<kCached> keys;
  if constexpr (!kFromCandidates) keys.load(a.keys + row * a.num_clusters, a.num_clusters);
  uint64_t* survivors = smem;
  const auto select_into = [&](auto list) {
    if constexpr (kFromCandidates) {
      if (select_top_from_candidates<kStable>(kept, a.probes, list, survivors, a.survivor_capacity, sh)) return;
      keys.load(a.keys + row * a.num_clusters, a.num_clusters);
    }
    select_top<kStable>(keys, a.probes, list, survivors, a.survivor_capacity, sh);
  };
  const SelectOutputs& out = a.out;
  if constexpr (kIdsOnly) {
    select_into(ChosenIds{out.cluster_ids + row * a.probes});
  } else {
    uint64_t* list = a.list_spill ? a.list_spill + row * a.list_len : smem + a.survivor_capacity;
    select_into(list);
    if (a.order == SelectOrder::kRanked) {
      for (int i = a.probes + threadIdx.x; i < a.list_len; i += blockDim.x) list[i] = kNoneRanked;
      __syncthreads();
      sort_descending(list, a.list_len, survivors);
    }
    if (out.cluster_ids || out.selected_scores) {
      for (int k = threadIdx.x; k < a.probes; k += blockDim.x) {
        const int32_t id = packed_id(list[k]);
        if (out.cluster_ids) store_relaxed(out.cluster_ids + row * a.probes + k, id);  // each once, final
        if (out.selected_scores) out.selected_scores[row * a.probes + k] = out.scores[row * a.num_clusters + id];
      }
    }
    if (out.claims) claim_clusters(list, a.probes, static_cast<int>(row), out);
  }
  if (out.row_tickets && threadIdx.x == 0) out.row_tickets[row] = RowTicket{};
  if (out.extra_repeats)
    for (int j = threadIdx.x; j < a.num_extra; j += blockDim.x) out.extra_repeats[row * a.num_extra + j] = 0;
}

// Launches the instance that caches the fewest keys a thread, from kCached up, that hold a row of
// `rounds` rounds (kSelectCached for longer rows). A register slot past the row's end still costs
// instructions in every pass: Qwen3-0.6B's 10 rounds took up to 3% longer on the 12-key instance.
template <int kCached, bool kStable, bool kFromCandidates, bool kIdsOnly, typename Launch>
cudaError_t launch_fitted(int rounds, Launch&& launch) {
  if constexpr (kCached < kSelectCached) {
    if (rounds > kCached) return launch_fitted<kCached + 1, kStable, kFromCandidates, kIdsOnly>(rounds, launch);
  }
  return launch(select_kernel<kCached, kStable, kFromCandidates, kIdsOnly>);
}
template <bool kStable, bool kIdsOnly, typename Launch>
cudaError_t launch_fitted(int rounds, bool from_candidates, Launch&& launch) {
  return from_candidates ? launch_fitted<kMinSelectCached, kStable, true, kIdsOnly>(rounds, launch)
                         : launch_fitted<kMinSelectCached, kStable, false, kIdsOnly>(rounds, launch);
}

int list_length(int probes, SelectOrder order) {
  if (order != SelectOrder::kRanked) return probes;
  int n = 1;
  while (n < probes) n <<= 1;
  return n;
}

uint64_t* carve_select(WorkspaceCarver& carver, const HeadShape& shape, SelectOrder order) {
  const int len = list_length(shape.probes, order);
  return len > kSmemListMax ? carver.take<uint64_t>(size_t(shape.batch) * len) : nullptr;
}

}  // namespace
}  // namespace detail

size_t select_workspace_bytes(const HeadShape& shape, SelectOrder order) {
  detail::WorkspaceCarver carver(nullptr);
  detail::carve_select(carver, shape, order);
  return carver.bytes();
}

cudaError_t launch_select(const float* keys, const HeadShape& shape, SelectOrder order, const SelectOutputs& out,
                          void* workspace, cudaStream_t stream, const LaunchOptions& options) {
  return detail::launch_select_keeping(keys, shape, order, out, workspace, stream, options, {});
}

cudaError_t detail::launch_select_keeping(const float* keys, const HeadShape& shape, SelectOrder order,
                                          const SelectOutputs& out, void* workspace, cudaStream_t stream,
                                          const LaunchOptions& options, const BlockCandidates& kept) {
  if (shape.batch == 0) return cudaSuccess;
  if (kept.per_block > 0 && shape.batch != 1) return cudaErrorInvalidValue;  // kept for batch 1's row
  if (out.claims && shape.batch > kClaimedMaxRows) return cudaErrorInvalidValue;  // a row's bit in one mask
  detail::WorkspaceCarver carver(workspace);
  const int len = detail::list_length(shape.probes, order);
  uint64_t* spill = detail::carve_select(carver, shape, order);
  // Shared memory: the list unless spilled, and as many survivor slots as the kernel's room
  // allows (at least the sort's scratch of 2 * kSelectThreads pairs).
  const size_t list_bytes = spill ? 0 : sizeof(uint64_t) * len;
  const int rounds = detail::ceil_div(shape.num_clusters, detail::kSelectThreads);
  const auto launch = [&](auto kernel) {
    detail::KernelSmem room;
    if (cudaError_t err = detail::kernel_smem(kernel, &room); err != cudaSuccess) return err;
    const size_t slots = room.max_dynamic > list_bytes ? (room.max_dynamic - list_bytes) / sizeof(uint64_t) : 0;
    const uint32_t capacity = static_cast<uint32_t>(std::min<size_t>(slots, detail::kMaxSurvivors));
    if (capacity < 2 * detail::kSelectThreads) return cudaErrorInvalidConfiguration;
    const size_t smem = list_bytes + sizeof(uint64_t) * capacity;
    const detail::SelectArgs args{keys, shape.num_clusters, shape.probes, order, len, spill, capacity, out,
                                  shape.num_extra};
    return detail::launch_kernel(kernel, dim3(shape.batch), dim3(detail::kSelectThreads), smem, stream,
                                 options.dependent_launch, args, kept);
  };
  // A stable list is its own instance: its prefix sums would cost the other orders registers.
  const bool from_candidates = kept.per_block > 0;
  if (order == SelectOrder::kStable) return detail::launch_fitted<true, false>(rounds, from_candidates, launch);
  const bool ids_only = order == SelectOrder::kAny && out.cluster_ids && !out.selected_scores && !out.claims;
  return ids_only ? detail::launch_fitted<false, true>(rounds, from_candidates, launch)
                  : detail::launch_fitted<false, false>(rounds, from_candidates, launch);
}

}  // namespace flashhead
