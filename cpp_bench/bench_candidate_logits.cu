// Stage 3: exact logits of p * b scattered candidate rows per row, written out as fp32.
#include <vector>

#include "bench_common.cuh"

using namespace fhbench;

__host__ __device__ int32_t random_token(size_t i, int vocab) { return static_cast<int32_t>(mix(i * 31 + 5) % vocab); }

__global__ void random_tokens(int32_t* out, size_t n, int vocab) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    out[i] = random_token(i, vocab);
}

static void BM_candidate_logits(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0)), probes = static_cast<int>(state.range(1));
  const Dims d;
  const int n = probes * d.cluster_size;
  auto embedding = random_array<__nv_bfloat16>(size_t(d.vocab) * d.hidden_dim, 1, 1.0f);
  auto hidden = random_array<__nv_bfloat16>(size_t(batch) * d.hidden_dim, 3, 1.0f);
  DeviceArray<int32_t> candidates(size_t(batch) * n);
  random_tokens<<<256, 256>>>(candidates.get(), candidates.size(), d.vocab);
  FHB_CHECK(cudaGetLastError());
  DeviceArray<float> logits(size_t(batch) * n);
  // Each distinct embedding row once (the rows of a batch repeat ids: at B = 64, p = 1024 each row
  // about 6.9 times), the ids read and the logits written, and the hidden rows.
  std::vector<char> seen(d.vocab, 0);
  for (size_t i = 0; i < candidates.size(); ++i) seen[random_token(i, d.vocab)] = 1;
  const double rows = static_cast<double>(std::count(seen.begin(), seen.end(), 1));
  state.counters["distinct_rows"] = rows;
  const double bytes = 2.0 * d.hidden_dim * (rows + batch) + 8.0 * double(batch) * n;
  run_timed(state, bytes, [&](cudaStream_t s) {
    FHB_CHECK(flashhead::launch_candidate_logits(hidden.get(), embedding.get(), batch, d.vocab, d.hidden_dim,
                                                 candidates.get(), n, logits.get(), s));
  });
}
BENCHMARK(BM_candidate_logits)->Apply(head_args);

FHBENCH_MAIN()
