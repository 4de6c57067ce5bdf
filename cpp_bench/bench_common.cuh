// Shared harness of the cpp_bench binaries: device buffers with random contents, a synthetic head
// (Qwen3-0.6B shapes by default), CUDA-graph replay timed with CUDA events (Google Benchmark's
// manual time), an L2 flush before each timed replay, and bytes/s, % of a peak bandwidth and the
// samples' median (median_us; Google Benchmark's own time is their mean) as counters. JSON comes
// from Google Benchmark's own flags (--benchmark_format=json, --benchmark_out=FILE). Extra flags
// of ours, read before Google Benchmark's:
//   --peak_gbps=N   peak memory bandwidth for the pct_of_peak counter (env FLASHHEAD_PEAK_GBPS)
//   --warm_l2       skip the L2 flush (the head then partly lives in L2 across iterations)
// Both, the GPU's name and its L2 size go to the JSON's context. floor_bytes is each binary's count
// of the bytes a call must move (its file says what it counts); bytes_per_second and pct_of_peak
// divide it by the samples' time.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "cuda_check.cuh"
#include "kernels/api.h"

namespace fhbench {

struct Flags {
  double peak_gbps = 0.0;
  bool warm_l2 = false;
};
inline Flags& flags() {
  static Flags f;
  return f;
}

template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t n) : n_(n) {
    if (n) FHB_CHECK(cudaMalloc(&ptr_, n * sizeof(T)));
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept : ptr_(o.ptr_), n_(o.n_) { o.ptr_ = nullptr; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(n_, o.n_);
    return *this;
  }
  ~DeviceArray() {
    if (ptr_) cudaFree(ptr_);
  }
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) {
    FHB_CHECK(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

__host__ __device__ inline uint32_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

// Uniform values in [-scale, scale): never zeros, which would hide unwritten outputs.
template <typename T>
__global__ void fill_uniform(T* out, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const float u = (mix(seed * 0x9e3779b97f4a7c15ull + i) >> 8) * (1.0f / 16777216.0f);
    out[i] = static_cast<T>((2.0f * u - 1.0f) * scale);
  }
}

template <typename T>
DeviceArray<T> random_array(size_t n, uint64_t seed, float scale) {
  DeviceArray<T> a(n);
  if (n) {
    fill_uniform<<<1024, 256>>>(a.get(), n, seed, scale);
    FHB_CHECK(cudaGetLastError());
  }
  return a;
}

// One value on the device (a scale the kernels read there).
template <typename T>
DeviceArray<T> constant_array(T value) {
  DeviceArray<T> a(1);
  a.upload({value});
  return a;
}

// Qwen3-0.6B head by default: V=151936, D=1024, C=9496, b=16.
struct Dims {
  int vocab = 151936, hidden_dim = 1024, num_clusters = 9496, cluster_size = 16;
};

// Random centroids [C, D]: in [-0.05, 0.05), or for fp8 e4m3 16x that, in e4m3's normal range,
// with kFp8CentroidScale as their scale.
constexpr float kFp8CentroidScale = 1.0f / 16.0f;
template <typename TC>
DeviceArray<TC> random_centroids(const Dims& d) {
  const float range = 0.05f / (sizeof(TC) == 1 ? kFp8CentroidScale : 1.0f);
  return random_array<TC>(size_t(d.num_clusters) * d.hidden_dim, 2, range);
}

// A synthetic head: random weights, and a cluster table that is a fixed permutation of the
// vocabulary (clusters of scattered rows, like a real clustering), with bf16 and fp8 centroids.
template <typename T>
struct Head {
  Dims dims;
  DeviceArray<T> embedding, centroids;
  DeviceArray<__nv_fp8_e4m3> fp8_centroids;
  DeviceArray<float> fp8_scale;
  DeviceArray<int32_t> cluster_tokens;

  explicit Head(const Dims& d) : dims(d) {
    embedding = random_array<T>(size_t(d.vocab) * d.hidden_dim, 1, 1.0f);
    centroids = random_centroids<T>(d);
    fp8_centroids = random_centroids<__nv_fp8_e4m3>(d);
    fp8_scale = constant_array(kFp8CentroidScale);
    const size_t slots = size_t(d.num_clusters) * d.cluster_size;
    std::vector<int32_t> table(slots);
    // i -> (i * a + c) mod V is a permutation when a is coprime with V.
    uint64_t a = 2654435761ull % d.vocab;
    while (std::gcd<uint64_t>(a, d.vocab) != 1) ++a;
    for (size_t i = 0; i < slots; ++i) table[i] = i < size_t(d.vocab) ? int32_t((i * a + 12345) % d.vocab) : -1;
    cluster_tokens = DeviceArray<int32_t>(slots);
    cluster_tokens.upload(table);
  }
};

// Reads n words so that L2 then holds clean lines of them only: a flush by writes (a memset) left
// dirty lines whose write-backs fell inside the next timed replay.
static __global__ void read_through(const int4* words, size_t n, int* sink) {
  int acc = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    const int4 w = __ldcg(words + i);
    acc ^= w.x ^ w.y ^ w.z ^ w.w;
  }
  if (acc == 0x7fffffff) *sink = acc;  // never true for the zeroed words; keeps the loads
}

// Times `launch` (a sequence of kernel launches on `stream`) captured once in a CUDA graph and
// replayed each iteration between two events; `bytes` per iteration feed the counters.
inline void run_timed(benchmark::State& state, double bytes, const std::function<void(cudaStream_t)>& launch) {
  // The inputs were filled on the legacy stream, which the non-blocking one below does not wait for.
  FHB_CHECK(cudaDeviceSynchronize());
  cudaStream_t stream;
  FHB_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  launch(stream);  // warm-up, outside capture
  FHB_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FHB_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  launch(stream);
  FHB_CHECK(cudaStreamEndCapture(stream, &graph));
  FHB_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  int device = 0, l2 = 0;
  FHB_CHECK(cudaGetDevice(&device));
  FHB_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  DeviceArray<int4> flush(flags().warm_l2 ? 0 : size_t(l2) * 4 / sizeof(int4));
  DeviceArray<int> flush_sink(1);
  if (flush.size()) FHB_CHECK(cudaMemsetAsync(flush.get(), 0, flush.size() * sizeof(int4), stream));
  cudaEvent_t start, stop;
  FHB_CHECK(cudaEventCreate(&start));
  FHB_CHECK(cudaEventCreate(&stop));
  double seconds = 0.0;
  std::vector<double> sample_us;  // for the median, which bench head reports (Google Benchmark's time is the mean)
  for (auto _ : state) {
    if (flush.size()) {
      read_through<<<1024, 256, 0, stream>>>(flush.get(), flush.size(), flush_sink.get());
      FHB_CHECK(cudaGetLastError());
    }
    FHB_CHECK(cudaEventRecord(start, stream));
    FHB_CHECK(cudaGraphLaunch(exec, stream));
    FHB_CHECK(cudaEventRecord(stop, stream));
    FHB_CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    FHB_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(ms * 1e-3);
    seconds += ms * 1e-3;
    sample_us.push_back(ms * 1e3);
  }
  FHB_CHECK(cudaGetLastError());
  state.counters["bytes_per_second"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  if (flags().peak_gbps > 0 && seconds > 0)
    state.counters["pct_of_peak"] = 100.0 * bytes * state.iterations() / seconds / (flags().peak_gbps * 1e9);
  state.counters["floor_bytes"] = bytes;
  if (!sample_us.empty()) {
    auto middle = sample_us.begin() + sample_us.size() / 2;
    std::nth_element(sample_us.begin(), middle, sample_us.end());
    state.counters["median_us"] = *middle;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The replays' tokens, each an id of the vocabulary: a benchmark whose outputs are not is skipped
// with an error (its time would be that of a kernel that did not do its work).
inline bool tokens_in_vocab(benchmark::State& state, const DeviceArray<int64_t>& tokens, int vocab) {
  // (tokens were set to -1 before timing: a kernel that wrote nothing fails here.)
  std::vector<int64_t> host(tokens.size());
  FHB_CHECK(cudaMemcpy(host.data(), tokens.get(), host.size() * sizeof(int64_t), cudaMemcpyDeviceToHost));
  if (std::all_of(host.begin(), host.end(), [&](int64_t t) { return 0 <= t && t < vocab; })) return true;
  state.SkipWithError("a token outside the vocabulary");
  return false;
}

// Batch sizes x probes of the Qwen3-0.6B head that every binary reports.
inline void head_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"B", "p"});
  for (int batch : {1, 8, 64})
    for (int probes : {32, 256, 593, 1024}) b->Args({batch, probes});
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

inline int main_with_flags(int argc, char** argv) {
  if (const char* env = std::getenv("FLASHHEAD_PEAK_GBPS")) flags().peak_gbps = std::atof(env);
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--peak_gbps=", 12) == 0) {
      flags().peak_gbps = std::atof(argv[i] + 12);
    } else if (std::strcmp(argv[i], "--warm_l2") == 0) {
      flags().warm_l2 = true;
    } else {
      rest.push_back(argv[i]);
    }
  }
  // Listing the benchmarks needs no GPU (read before Initialize, which takes its own flags out).
  const bool listing = std::any_of(rest.begin(), rest.end(), [](const char* arg) {
    return std::strcmp(arg, "--benchmark_list_tests") == 0 || std::strcmp(arg, "--benchmark_list_tests=true") == 0;
  });
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  if (benchmark::ReportUnrecognizedArguments(n, rest.data())) return 1;
  if (listing) {
    benchmark::RunSpecifiedBenchmarks();
    return 0;
  }
  int devices = 0;
  if (const cudaError_t err = cudaGetDeviceCount(&devices); err != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "no usable CUDA device: %s\n", err != cudaSuccess ? cudaGetErrorString(err) : "none found");
    return 1;
  }
  int device = 0, l2 = 0;
  cudaDeviceProp prop{};
  FHB_CHECK(cudaGetDevice(&device));
  FHB_CHECK(cudaGetDeviceProperties(&prop, device));
  FHB_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  benchmark::AddCustomContext("device", prop.name);
  benchmark::AddCustomContext("l2_bytes", std::to_string(l2));
  benchmark::AddCustomContext("l2_flushed", flags().warm_l2 ? "no (--warm_l2)" : "yes, before each sample");
  benchmark::AddCustomContext("peak_gbps", flags().peak_gbps > 0 ? std::to_string(flags().peak_gbps) : "not given");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace fhbench

#define FHBENCH_MAIN() \
  int main(int argc, char** argv) { return fhbench::main_with_flags(argc, argv); }
