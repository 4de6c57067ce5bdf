// Stage 1: centroid scores [B, C] (plain, or with the Gumbel keys of sampling), bf16 centroids or
// fp8 e4m3 ones with a scale (fp8 = 1).
#include "bench_common.cuh"

using namespace fhbench;

template <typename TC>
static void time_scores(benchmark::State& state, int batch, bool sampling, const Dims& d, const float* scale) {
  auto centroids = random_centroids<TC>(d);
  auto hidden = random_array<__nv_bfloat16>(size_t(batch) * d.hidden_dim, 3, 1.0f);
  DeviceArray<float> scores(size_t(batch) * d.num_clusters), keys(size_t(batch) * d.num_clusters);
  DeviceArray<int64_t> seed(1);
  FHB_CHECK(cudaMemset(seed.get(), 0, sizeof(int64_t)));
  const flashhead::Sampling smp{1.0f, seed.get()};
  const double bytes =
      double(sizeof(TC)) * d.num_clusters * d.hidden_dim + 4.0 * batch * d.num_clusters * (sampling ? 2 : 1);
  run_timed(state, bytes, [&](cudaStream_t s) {
    FHB_CHECK(flashhead::launch_centroid_scores(hidden.get(), centroids.get(), scale, batch, d.num_clusters,
                                                d.hidden_dim, scores.get(), sampling ? &smp : nullptr, keys.get(), s));
  });
}

static void BM_centroid_scores(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  const bool sampling = state.range(1) != 0;
  const Dims d;
  if (state.range(2) == 0) return time_scores<__nv_bfloat16>(state, batch, sampling, d, nullptr);
  const DeviceArray<float> scale = constant_array(kFp8CentroidScale);
  time_scores<__nv_fp8_e4m3>(state, batch, sampling, d, scale.get());
}
BENCHMARK(BM_centroid_scores)
    ->ArgNames({"B", "sampling", "fp8"})
    ->ArgsProduct({{1, 8, 64}, {0, 1}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

FHBENCH_MAIN()
