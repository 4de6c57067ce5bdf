// The dense head FlashHead replaces: logits[V, B] = embedding . hidden through cuBLAS (a GEMV at
// B = 1), then a per-row argmax kernel. Floor: the embedding read once plus the logits written
// and read back.
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

constexpr int kArgmaxThreads = 1024;

// One block per batch row; the same packed (key, id) max as the FlashHead kernels, so ties go to
// the smaller token id like torch.argmax.
__global__ void __launch_bounds__(kArgmaxThreads) argmax_columns(const float* logits, int vocab, int64_t* tokens) {
  using namespace flashhead::detail;
  __shared__ uint64_t warp_best[kArgmaxThreads / kWarpSize];
  const float* col = logits + int64_t{blockIdx.x} * vocab;
  uint64_t best = kNoneRanked;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x) best = max(best, pack_ranked(order_key(col[i]), i));
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) best = max(best, __shfl_xor_sync(kFullMask, best, offset));
  if (threadIdx.x % kWarpSize == 0) warp_best[threadIdx.x / kWarpSize] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kArgmaxThreads / kWarpSize; ++w) best = max(best, warp_best[w]);
    tokens[blockIdx.x] = packed_id(best);
  }
}

static void BM_dense_baseline(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const Dims d;
  auto embedding = random_array<__nv_bfloat16>(size_t(d.vocab) * d.hidden_dim, 1, 1.0f);
  auto hidden = random_array<__nv_bfloat16>(size_t(batch) * d.hidden_dim, 3, 1.0f);
  DeviceArray<float> logits(size_t(d.vocab) * batch);
  DeviceArray<int64_t> tokens(batch);
  cublasHandle_t handle;
  FHB_CUBLAS(cublasCreate(&handle));
  const float one = 1.0f, zero = 0.0f;
  const double bytes = 2.0 * d.vocab * d.hidden_dim + 8.0 * d.vocab * batch;
  run_timed(state, bytes, [&](cudaStream_t s) {
    FHB_CUBLAS(cublasSetStream(handle, s));
    // Column-major view: embedding is [D, V] with ld D; op T gives V x D.
    FHB_CUBLAS(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, d.vocab, batch, d.hidden_dim, &one, embedding.get(),
                            CUDA_R_16BF, d.hidden_dim, hidden.get(), CUDA_R_16BF, d.hidden_dim, &zero, logits.get(),
                            CUDA_R_32F, d.vocab, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    argmax_columns<<<batch, kArgmaxThreads, 0, s>>>(logits.get(), d.vocab, tokens.get());
    FHB_CHECK(cudaGetLastError());
  });
  FHB_CUBLAS(cublasDestroy(handle));
}
BENCHMARK(BM_dense_baseline)->ArgName("B")->Arg(1)->Arg(8)->Arg(64)->UseManualTime()->Unit(benchmark::kMicrosecond);

FHBENCH_MAIN()
