// The fused path: centroid scores, selection + gather, candidate reduction to a token (greedy) or
// a Gumbel-max draw with its log-probability (sampling), with and without dependent launch, with
// bf16 or fp8 e4m3 centroids (fp8 = 1).
#include <algorithm>

#include "bench_common.cuh"

using namespace fhbench;

template <typename TC>
static void time_decode(benchmark::State& state, const Head<__nv_bfloat16>& head, const TC* centroids,
                        const float* scale) {
  const int batch = static_cast<int>(state.range(0)), probes = static_cast<int>(state.range(1));
  const bool sampling = state.range(2) != 0;
  flashhead::LaunchOptions options;
  options.dependent_launch = state.range(3) != 0;
  const Dims& d = head.dims;
  flashhead::HeadShape shape;
  shape.batch = batch;
  shape.hidden_dim = d.hidden_dim;
  shape.num_clusters = d.num_clusters;
  shape.cluster_size = d.cluster_size;
  shape.vocab = d.vocab;
  shape.probes = probes;
  auto hidden = random_array<__nv_bfloat16>(size_t(batch) * d.hidden_dim, 3, 1.0f);
  flashhead::HeadTensors<__nv_bfloat16, TC> t;
  t.hidden = hidden.get();
  t.centroids = centroids;
  t.centroid_scale = scale;
  t.cluster_tokens = head.cluster_tokens.get();
  t.embedding = head.embedding.get();
  DeviceArray<int64_t> tokens(batch), seed(1);
  DeviceArray<float> logprobs(batch);
  FHB_CHECK(cudaMemset(seed.get(), 0, sizeof(int64_t)));
  const flashhead::Sampling smp{1.0f, seed.get()};
  DeviceArray<char> workspace(flashhead::decode_workspace_bytes(shape, sampling));
  // As bench head's floor at batch 1 (a batch's rows may share clusters, which this leaves uncounted):
  // the centroids, the chosen clusters' table entries and rows, and the hidden rows.
  const double rows = std::min<double>(double(batch) * probes * d.cluster_size, d.vocab);
  const double bytes = d.hidden_dim * (double(sizeof(TC)) * d.num_clusters + 2.0 * rows + 2.0 * batch) + 4.0 * rows;
  run_timed(state, bytes, [&](cudaStream_t s) {
    FHB_CHECK(flashhead::launch_decode(t, shape, sampling ? &smp : nullptr, tokens.get(), 1, logprobs.get(),
                                       workspace.get(), s, options));
  });
}

static void BM_decode(benchmark::State& state) {
  static Head<__nv_bfloat16> head{Dims{}};  // 330 MB: built once per process
  if (state.range(4) == 0) return time_decode(state, head, head.centroids.get(), nullptr);
  time_decode(state, head, head.fp8_centroids.get(), head.fp8_scale.get());
}
BENCHMARK(BM_decode)
    ->ArgNames({"B", "p", "sampling", "pdl", "fp8"})
    ->ArgsProduct({{1, 8, 64}, {32, 256, 593, 1024}, {0, 1}, {1}, {0, 1}})
    ->ArgsProduct({{1}, {256}, {0, 1}, {0}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

FHBENCH_MAIN()
