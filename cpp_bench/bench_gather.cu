// Stage 2b: equal-cluster gather of p clusters' tokens per row, plus 4 extra ids.
#include "bench_common.cuh"

using namespace fhbench;

__global__ void random_ids(int32_t* out, size_t n, int bound) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x)
    out[i] = static_cast<int32_t>(mix(i + 77) % bound);
}

static void BM_gather(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0)), probes = static_cast<int>(state.range(1));
  const Dims d;
  constexpr int kExtra = 4;
  DeviceArray<int32_t> table(size_t(d.num_clusters) * d.cluster_size), ids(size_t(batch) * probes), extra(kExtra);
  random_ids<<<256, 256>>>(table.get(), table.size(), d.vocab);
  random_ids<<<256, 256>>>(ids.get(), ids.size(), d.num_clusters);
  random_ids<<<1, 32>>>(extra.get(), extra.size(), d.vocab);
  FHB_CHECK(cudaGetLastError());
  const int width = probes * d.cluster_size + kExtra;
  DeviceArray<int32_t> candidates(size_t(batch) * width);
  const double bytes = 4.0 * batch * (probes + 2.0 * probes * d.cluster_size + kExtra);
  run_timed(state, bytes, [&](cudaStream_t s) {
    FHB_CHECK(flashhead::launch_gather_candidates(ids.get(), batch, probes, table.get(), d.num_clusters,
                                                  d.cluster_size, extra.get(), kExtra, candidates.get(), s));
  });
}
BENCHMARK(BM_gather)->Apply(head_args);

FHBENCH_MAIN()
