// Stage 1: centroid scores [B, C] (plain, or with the Gumbel keys of sampling).
#include "bench_common.cuh"

using namespace fhbench;

static void BM_centroid_scores(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const bool sampling = state.range(1) != 0;
  const Dims d;
  auto centroids = random_array<__nv_bfloat16>(size_t(d.num_clusters) * d.hidden_dim, 2, 0.05f);
  auto hidden = random_array<__nv_bfloat16>(size_t(batch) * d.hidden_dim, 3, 1.0f);
  DeviceArray<float> scores(size_t(batch) * d.num_clusters), keys(size_t(batch) * d.num_clusters);
  DeviceArray<int64_t> seed(1);
  FHB_CHECK(cudaMemset(seed.get(), 0, sizeof(int64_t)));
  const flashhead::Sampling smp{1.0f, seed.get()};
  const double bytes = 2.0 * d.num_clusters * d.hidden_dim + 4.0 * batch * d.num_clusters * (sampling ? 2 : 1);
  run_timed(state, bytes, [&](cudaStream_t s) {
    FHB_CHECK(flashhead::launch_centroid_scores(hidden.get(), centroids.get(), batch, d.num_clusters, d.hidden_dim,
                                                scores.get(), sampling ? &smp : nullptr, keys.get(), s));
  });
}
BENCHMARK(BM_centroid_scores)
    ->ArgNames({"B", "sampling"})
    ->ArgsProduct({{1, 8, 64}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

FHBENCH_MAIN()
