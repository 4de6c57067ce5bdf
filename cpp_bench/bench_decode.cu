// The fused path: centroid scores, selection + gather, candidate reduction to a token (greedy) or
// a Gumbel-max draw with its log-probability (sampling), with and without dependent launch, with
// bf16 or fp8 e4m3 centroids (fp8 = 1).
#include <algorithm>
#include <cmath>
#include <vector>

#include "bench_common.cuh"

using namespace fhbench;

// How many distinct clusters the batch's rows choose (greedy, or drawn with the decode's seed).
template <typename TC>
static int distinct_clusters(const flashhead::HeadTensors<__nv_bfloat16, TC>& t, const flashhead::HeadShape& shape,
                             const flashhead::Sampling* sampling) {
  const size_t chosen = size_t(shape.batch) * shape.probes;
  DeviceArray<int32_t> ids(chosen);
  DeviceArray<float> scores(chosen);
  DeviceArray<char> workspace(flashhead::cluster_select_workspace_bytes(shape, sampling != nullptr));
  FHB_CHECK(flashhead::launch_cluster_select(t.hidden, t.centroids, t.centroid_scale, shape, sampling, ids.get(),
                                             scores.get(), workspace.get(), nullptr));
  std::vector<int32_t> host(chosen);
  FHB_CHECK(cudaMemcpy(host.data(), ids.get(), chosen * sizeof(int32_t), cudaMemcpyDeviceToHost));
  std::sort(host.begin(), host.end());
  return static_cast<int>(std::unique(host.begin(), host.end()) - host.begin());
}

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
  // -1 and NaN until the kernels write them: the checks after timing see any that stay.
  FHB_CHECK(cudaMemset(tokens.get(), 0xff, batch * sizeof(int64_t)));
  FHB_CHECK(cudaMemset(logprobs.get(), 0xff, batch * sizeof(float)));
  const flashhead::Sampling smp{1.0f, seed.get()};
  DeviceArray<char> workspace(flashhead::decode_workspace_bytes(shape, sampling));
  // As bench head's floor: the centroids, the table entries and rows of the clusters the batch chose
  // (each once, however many rows chose it; the selection run once here to count them), and the
  // hidden rows.
  const int clusters = distinct_clusters(t, shape, sampling ? &smp : nullptr);
  state.counters["clusters_read"] = clusters;
  const double rows = double(clusters) * d.cluster_size;
  const double bytes = d.hidden_dim * (double(sizeof(TC)) * d.num_clusters + 2.0 * rows + 2.0 * batch) + 4.0 * rows;
  run_timed(state, bytes, [&](cudaStream_t s) {
    FHB_CHECK(flashhead::launch_decode(t, shape, sampling ? &smp : nullptr, tokens.get(), 1, logprobs.get(),
                                       workspace.get(), s, options));
  });
  if (!tokens_in_vocab(state, tokens, d.vocab) || !sampling) return;
  std::vector<float> host(batch);
  FHB_CHECK(cudaMemcpy(host.data(), logprobs.get(), batch * sizeof(float), cudaMemcpyDeviceToHost));
  if (!std::all_of(host.begin(), host.end(), [](float lp) { return std::isfinite(lp) && lp <= 0.0f; }))
    state.SkipWithError("a log-probability that is not finite and <= 0");
}

static void BM_decode(benchmark::State& state) {
  static Head<__nv_bfloat16> head{Dims{}};  // 341 MB: built once per process
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
