// The dense head FlashHead replaces: logits[V, B] = embedding . hidden through cuBLAS (a GEMV at
// B = 1), then a per-row argmax kernel. The logits are bf16, as torch's dense head writes them in
// the model's dtype. Floor: the embedding read once plus the logits written and read back.
#include <cublas_v2.h>

#include "bench_common.cuh"
#include "kernels/common.cuh"

using namespace fhbench;

#define FHB_CUBLAS(call)                                                            \
  do {                                                                              \
    const cublasStatus_t st_ = (call);                                              \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                             \
      std::fprintf(stderr, "%s:%d: %s failed: %d\n", __FILE__, __LINE__, #call, st_); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

constexpr int kArgmaxThreads = 256;
constexpr int kArgmaxChunk = 4096;  // logits a block ranks: many blocks a row, as torch's argmax spreads it

// The block's largest packed value, in every thread; `warp_best` is free again on return.
__device__ uint64_t block_max(uint64_t best, uint64_t* warp_best) {
  using namespace flashhead::detail;
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) best = max(best, __shfl_xor_sync(kFullMask, best, offset));
  if (threadIdx.x % kWarpSize == 0) warp_best[threadIdx.x / kWarpSize] = best;
  __syncthreads();
  for (int w = 0; w < kArgmaxThreads / kWarpSize; ++w) best = max(best, warp_best[w]);
  __syncthreads();
  return best;
}

// Each row's argmax over blocks of kArgmaxChunk logits (grid: chunks x rows). A block posts its
// best packed (key, id), the same packing as the FlashHead kernels', so ties go to the smaller id
// like torch.argmax; the row's last block to arrive folds the posts and resets the row's ticket
// for the next replay.
__global__ void __launch_bounds__(kArgmaxThreads) argmax_rows(const __nv_bfloat16* logits, int vocab, uint64_t* posts,
                                                              unsigned* tickets, int64_t* tokens) {
  using namespace flashhead::detail;
  __shared__ uint64_t warp_best[kArgmaxThreads / kWarpSize];
  __shared__ bool last;
  const int row = blockIdx.y;
  const __nv_bfloat16* logits_row = logits + int64_t{row} * vocab;
  uint64_t* row_posts = posts + int64_t{row} * gridDim.x;
  const int end = min(vocab, static_cast<int>(blockIdx.x + 1) * kArgmaxChunk);
  uint64_t best = kNoneRanked;
  for (int i = blockIdx.x * kArgmaxChunk + threadIdx.x; i < end; i += kArgmaxThreads)
    best = max(best, pack_ranked(order_key(__bfloat162float(logits_row[i])), i));
  best = block_max(best, warp_best);
  if (threadIdx.x == 0) {
    row_posts[blockIdx.x] = best;
    __threadfence();  // the post before the arrival
    last = atomicAdd(tickets + row, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // every arrival, so every post, before the reads
  best = kNoneRanked;
  for (int b = threadIdx.x; b < static_cast<int>(gridDim.x); b += kArgmaxThreads) best = max(best, __ldcg(row_posts + b));
  best = block_max(best, warp_best);
  if (threadIdx.x == 0) {
    tokens[row] = packed_id(best);
    tickets[row] = 0;
  }
}

static void BM_dense_baseline(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const Dims d;
  auto embedding = random_array<__nv_bfloat16>(size_t(d.vocab) * d.hidden_dim, 1, 1.0f);
  auto hidden = random_array<__nv_bfloat16>(size_t(batch) * d.hidden_dim, 3, 1.0f);
  DeviceArray<__nv_bfloat16> logits(size_t(d.vocab) * batch);
  DeviceArray<int64_t> tokens(batch);
  const dim3 argmax_grid((d.vocab + kArgmaxChunk - 1) / kArgmaxChunk, batch);
  DeviceArray<uint64_t> posts(size_t(argmax_grid.x) * batch);
  DeviceArray<unsigned> tickets(batch);
  FHB_CHECK(cudaMemset(tickets.get(), 0, sizeof(unsigned) * batch));
  FHB_CHECK(cudaMemset(tokens.get(), 0xff, sizeof(int64_t) * batch));  // -1 until the argmax writes them
  cublasHandle_t handle;
  FHB_CUBLAS(cublasCreate(&handle));
  const float one = 1.0f, zero = 0.0f;
  // The embedding, and the bf16 logits this GEMM writes and the argmax reads back.
  const double bytes = 2.0 * d.vocab * d.hidden_dim + 4.0 * d.vocab * batch;
  run_timed(state, bytes, [&](cudaStream_t s) {
    FHB_CUBLAS(cublasSetStream(handle, s));
    // Column-major view: embedding is [D, V] with ld D; op T gives V x D.
    FHB_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, d.vocab, batch, d.hidden_dim, &one, embedding.get(),
                            CUDA_R_16BF, d.hidden_dim, hidden.get(), CUDA_R_16BF, d.hidden_dim, &zero, logits.get(),
                            CUDA_R_16BF, d.vocab, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    argmax_rows<<<argmax_grid, kArgmaxThreads, 0, s>>>(logits.get(), d.vocab, posts.get(), tickets.get(), tokens.get());
    FHB_CHECK(cudaGetLastError());
  });
  FHB_CUBLAS(cublasDestroy(handle));
  tokens_in_vocab(state, tokens, d.vocab);
}
BENCHMARK(BM_dense_baseline)->ArgName("B")->Arg(1)->Arg(8)->Arg(64)->UseManualTime()->Unit(benchmark::kMicrosecond);

FHBENCH_MAIN()
