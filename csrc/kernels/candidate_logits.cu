#include <algorithm>

#include "kernels/candidate_logits.cuh"

namespace flashhead {
namespace detail {
namespace {

template <typename T, bool kStaged>
__global__ void __launch_bounds__(kCandThreads, kCandBlocksPerSm) candidate_logits_kernel(CandidateRows<T> a,
                                                                                         ListedTokens tokens,
                                                                                         float* logits) {
  const int64_t row = blockIdx.y;
  const int lane = threadIdx.x % kWarpSize;
  // Lane r writes slot first + r.
  for_each_slot_group<kStaged>(a, tokens, row, [&](const WarpSlots& s, int first) {
    if (lane < kCandRowsPerWarp && first + lane < a.num_candidates)
      logits[row * a.num_candidates + first + lane] = pick(s.logit, lane);
  });
}

}  // namespace
}  // namespace detail

template <typename T>
cudaError_t launch_candidate_logits(const T* hidden, const T* embedding, int batch, int vocab, int hidden_dim,
                                    const int32_t* candidates, int num_candidates, float* logits, cudaStream_t stream) {
  using namespace detail;
  if (batch == 0 || num_candidates == 0) return cudaSuccess;
  const bool vec = rows_vectorizable<T>(hidden, hidden_dim) && rows_vectorizable<T>(embedding, hidden_dim);
  int sms = 0;
  const cudaError_t attr = multiprocessor_count(&sms);
  if (attr != cudaSuccess) return attr;
  for (int r0 = 0; r0 < batch; r0 += kMaxGridRows) {
    const int rows = std::min(kMaxGridRows, batch - r0);
    size_t smem = 0;
    const cudaError_t planned = staged_rows_smem(candidate_logits_kernel<T, true>, vec, hidden_dim, sizeof(T),
                                                 num_candidates, rows, sms, &smem);
    if (planned != cudaSuccess) return planned;
    const CandidateRows<T> args{hidden + int64_t{r0} * hidden_dim, embedding, vocab, hidden_dim, vec, num_candidates,
                                rows_read_once(batch)};
    const ListedTokens tokens{candidates + int64_t{r0} * num_candidates, num_candidates};
    const dim3 grid(candidate_blocks_per_row(num_candidates, rows, sms), rows);
    const cudaError_t err =
        launch_kernel(smem > 0 ? candidate_logits_kernel<T, true> : candidate_logits_kernel<T, false>, grid,
                      dim3(kCandThreads), smem, stream, false, args, tokens, logits + int64_t{r0} * num_candidates);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

#define FLASHHEAD_INSTANTIATE(T)                                                                                   \
  template cudaError_t launch_candidate_logits<T>(const T*, const T*, int, int, int, const int32_t*, int, float*, \
                                                  cudaStream_t);
FLASHHEAD_INSTANTIATE(float)
FLASHHEAD_INSTANTIATE(__half)
FLASHHEAD_INSTANTIATE(__nv_bfloat16)
#undef FLASHHEAD_INSTANTIATE

}  // namespace flashhead
