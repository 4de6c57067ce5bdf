// Stage 2a: per-row top-p selection from fp32 keys [B, C], listed in any order (greedy decode), in
// an order stable from run to run (sampling decode) or in rank order (select_clusters,
// sample_clusters): order 0, 1, 2.
#include "bench_common.cuh"

using namespace fhbench;

static void BM_select(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0)), probes = static_cast<int>(state.range(1));
  const auto order = static_cast<flashhead::SelectOrder>(state.range(2));
  const Dims d;
  flashhead::HeadShape shape;
  shape.batch = batch;
  shape.num_clusters = d.num_clusters;
  shape.probes = probes;
  auto keys = random_array<float>(size_t(batch) * d.num_clusters, 4, 1.0f);
  DeviceArray<int32_t> ids(size_t(batch) * probes);
  DeviceArray<char> workspace(flashhead::select_workspace_bytes(shape, order));
  flashhead::SelectOutputs out;
  out.cluster_ids = ids.get();
  const double bytes = 4.0 * batch * d.num_clusters + 4.0 * batch * probes;
  run_timed(state, bytes, [&](cudaStream_t s) {
    FHB_CHECK(flashhead::launch_select(keys.get(), shape, order, out, workspace.get(), s));
  });
}
BENCHMARK(BM_select)
    ->ArgNames({"B", "p", "order"})
    ->ArgsProduct({{1, 8, 64}, {32, 256, 593, 1024}, {0, 1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

FHBENCH_MAIN()
