// racecheck's intermittent bulk-copy warnings on the sampling decode with extra ids ("potential
// RAW hazard (invalid async operation synchronization)", docs/benchmarks.md, sessions 45-47 and
// 107), looked for outside the ops: the staged rows' loop of for_each_staged_slot_group
// (candidate_logits.cuh), with StagedRowBuffers itself, in variants that differ in who makes a
// buffer's expect_tx arrival and who copies which row. On an H100 (session 107) every correct
// variant, with and without the extras' divergent stores, had 0 hazards, and the positive control
// was flagged: this loop alone does not raise the warnings.
// Built with cpp_bench (CMakeLists.txt, sm_90 only). Run: racecheck_bulk_copy VARIANT DIVERGE [GROUPS]
// under compute-sanitizer --tool racecheck --racecheck-report all; exit status 1 when a logit of
// variants 0-3 differs from the host's or a CUDA call fails (named on stderr), 2 on bad arguments or a GPU older than sm_90.
// VARIANT 0: as the kernel (lane 0 arrives and copies row 0, lane 1 copies row 1); 1: lane 31
// arrives, lanes 0 and 1 copy; 2: lane 0 arrives and copies both rows (decoder_step's pattern);
// 3: as 0 without the proxy fence before a refill; 4: a positive control, one buffer refilled
// right after its wait, before its reads (a real race).
// DIVERGE 0: lanes 0 and 1 fold their slots' logits into a register max, as the greedy decode
// does, stored once at the end; 1: the lanes part after each group as the sampling decode with
// extra ids does (lanes 0..5 flag repeats in global memory, lanes 0 and 1 store their slot's logit).
#include <cuda_bf16.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda_check.cuh"
#include "kernels/candidate_logits.cuh"

using namespace flashhead::detail;
using bf16 = __nv_bfloat16;

constexpr int kRows = kCandRowsPerWarp, kWarps = kCandThreads / kWarpSize, kExtras = 6;

// StagedRowBuffers exists only in the device pass for sm_90 (FLASHHEAD_BULK_COPIES); the host pass
// sees the kernel's signature alone.
#ifdef FLASHHEAD_BULK_COPIES
template <int kVariant>
__device__ void issue_rows(StagedRowBuffers<bf16>& b, int buffer, const int32_t (&token)[kRows]) {
  const int lane = threadIdx.x % kWarpSize;
  if constexpr (kVariant == 0 || kVariant == 3 || kVariant == 4) {
    b.issue(buffer, token);
  } else {
    int bytes = 0;
    for (int r = 0; r < kRows; ++r) bytes += in_vocab(token[r], b.vocab) ? b.row_bytes : 0;
    const int arriving = kVariant == 1 ? kWarpSize - 1 : 0;
    if (lane == arriving) mbarrier_expect_bytes(b.landed + buffer, bytes);
    __syncwarp();
    for (int r = 0; r < kRows; ++r) {
      const bool mine = kVariant == 1 ? lane == r : lane == 0;
      if (mine && in_vocab(token[r], b.vocab))
        copy_bulk(b.rows + (buffer * kRows + r) * b.hidden_dim, b.embedding + int64_t{token[r]} * b.hidden_dim,
                  b.row_bytes, b.landed + buffer, b.policy);
    }
  }
}

#endif

template <int kVariant, bool kDiverge>
__global__ void __launch_bounds__(kCandThreads, kCandBlocksPerSm)
    staged_rows_kernel(const bf16* embedding, int vocab, int dim, const bf16* hidden, const int32_t* tokens, int n,
                       const int32_t* extras, uint32_t* repeated, float* logits, float* lane_best) {
#ifdef FLASHHEAD_BULK_COPIES
  __shared__ uint64_t landed[kWarps * kCandBuffers];
  StagedRowBuffers<bf16> buffers(embedding, vocab, dim, row_policy(true), landed);
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int stride = gridDim.x * kCandSlotsPerBlock;
  const int lane_extra = lane < kExtras ? extras[lane] : -1;
  auto fetch = [&](int first, int32_t (&token)[kRows]) {
    for (int r = 0; r < kRows; ++r) token[r] = first + r < n ? tokens[first + r] : -1;
  };
  // The kernel's buffers: group k in buffer k % 2, the next refill issued before the wait; the
  // positive control uses buffer 0 alone and refills it between its wait and its reads.
  constexpr int kUsed = kVariant == 4 ? 1 : kCandBuffers;
  int first = blockIdx.x * kCandSlotsPerBlock + warp * kRows;
  int32_t current[kRows], next[kRows];
  float best = -INFINITY;
  fetch(first, current);
  fetch(first + stride, next);
  if (first < n) issue_rows<kVariant>(buffers, 0, current);
  for (unsigned k = 0; first < n; first += stride, ++k) {
    int32_t after[kRows];
    fetch(first + 2 * stride, after);
    const int buffer = k % kUsed;
    if constexpr (kVariant != 4) {
      if (first + stride < n) {
        if constexpr (kVariant != 3) fence_before_bulk_copies();
        issue_rows<kVariant>(buffers, (k + 1) % kUsed, next);
      }
      buffers.wait(buffer, k / kUsed);
    } else {
      buffers.wait(buffer, k);
      if (first + stride < n) issue_rows<kVariant>(buffers, buffer, next);
    }
    float acc[kRows] = {};
    for (int idx = lane; idx < dim / 8; idx += kWarpSize) {
      const int4 h = reinterpret_cast<const int4*>(hidden)[idx];
      const bf16* hv = reinterpret_cast<const bf16*>(&h);
      for (int r = 0; r < kRows; ++r) {
        const int4 raw = *reinterpret_cast<const int4*>(buffers.row(buffer, r) + idx * 8);
        const bf16* rv = reinterpret_cast<const bf16*>(&raw);
        for (int e = 0; e < 8; ++e) acc[r] = fmaf(__bfloat162float(rv[e]), __bfloat162float(hv[e]), acc[r]);
      }
    }
    float sum[kRows];
    for (int r = 0; r < kRows; ++r) sum[r] = warp_sum(acc[r]);
    if constexpr (kDiverge) {
      for (int r = 0; r < kRows; ++r)
        if (in_vocab(current[r], vocab) && lane < kExtras && lane_extra == current[r]) repeated[lane] = 1;
    }
    if (lane < kRows && first + lane < n) {
      const float logit = in_vocab(pick(current, lane), vocab) ? pick(sum, lane) : -INFINITY;
      if constexpr (kDiverge)
        logits[first + lane] = logit;
      else
        best = fmaxf(best, logit);
    }
    for (int r = 0; r < kRows; ++r) {
      current[r] = next[r];
      next[r] = after[r];
    }
    __syncwarp();  // every lane is done with the buffer before the next issue refills it
  }
  if (!kDiverge && lane < kRows) lane_best[(blockIdx.x * kWarps + warp) * kRows + lane] = best;
#endif
}

template <int kVariant, bool kDiverge>
void launch(int blocks, size_t smem, const bf16* e, int vocab, int dim, const bf16* h, const int32_t* t, int n,
            const int32_t* x, uint32_t* rep, float* out, float* best) {
  auto kernel = staged_rows_kernel<kVariant, kDiverge>;
  FHB_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<blocks, kCandThreads, smem>>>(e, vocab, dim, h, t, n, x, rep, out, best);
}

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s VARIANT(0-4) DIVERGE(0|1) [GROUPS]\n", argv[0]);
    return 2;
  }
  const int variant = std::atoi(argv[1]), diverge = std::atoi(argv[2]), groups = argc > 3 ? std::atoi(argv[3]) : 4;
  if (variant < 0 || variant > 4 || diverge < 0 || diverge > 1 || groups < 1) {
    std::fprintf(stderr, "VARIANT in 0..4, DIVERGE 0 or 1, GROUPS >= 1\n");
    return 2;
  }
  const int vocab = 5003, dim = 1024;
  int sms = 0, major = 0;
  FHB_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  FHB_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major < 9) {
    std::fprintf(stderr, "bulk copies need sm_90 or later, this GPU is sm_%d\n", major * 10);
    return 2;
  }
  const int blocks = sms * kCandBlocksPerSm, n = blocks * kCandSlotsPerBlock * groups - 3;
  const size_t smem = size_t{kWarps} * kCandBuffers * kRows * dim * sizeof(bf16);

  std::mt19937 gen(1234 + variant);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> id(-40, vocab + 40);  // about 1.6% masked ids, both sides
  std::vector<bf16> embedding(size_t{vocab} * dim), hidden(dim);
  for (auto& v : embedding) v = __float2bfloat16(normal(gen));
  for (auto& v : hidden) v = __float2bfloat16(normal(gen));
  std::vector<int32_t> tokens(n), extras = {0, 5, 5, vocab - 1, -1, vocab};
  for (auto& t : tokens) t = id(gen);

  bf16 *d_embedding, *d_hidden;
  int32_t *d_tokens, *d_extras;
  uint32_t* d_repeated;
  float *d_logits, *d_best;
  const int lanes = blocks * kWarps * kRows;
  FHB_CHECK(cudaMalloc(&d_embedding, embedding.size() * sizeof(bf16)));
  FHB_CHECK(cudaMalloc(&d_hidden, hidden.size() * sizeof(bf16)));
  FHB_CHECK(cudaMalloc(&d_tokens, n * sizeof(int32_t)));
  FHB_CHECK(cudaMalloc(&d_extras, kExtras * sizeof(int32_t)));
  FHB_CHECK(cudaMalloc(&d_repeated, kExtras * sizeof(uint32_t)));
  FHB_CHECK(cudaMalloc(&d_logits, n * sizeof(float)));
  FHB_CHECK(cudaMalloc(&d_best, lanes * sizeof(float)));
  FHB_CHECK(cudaMemcpy(d_embedding, embedding.data(), embedding.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  FHB_CHECK(cudaMemcpy(d_hidden, hidden.data(), hidden.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  FHB_CHECK(cudaMemcpy(d_tokens, tokens.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice));
  FHB_CHECK(cudaMemcpy(d_extras, extras.data(), kExtras * sizeof(int32_t), cudaMemcpyHostToDevice));
  FHB_CHECK(cudaMemset(d_repeated, 0, kExtras * sizeof(uint32_t)));

  using Launch = void (*)(int, size_t, const bf16*, int, int, const bf16*, const int32_t*, int, const int32_t*,
                          uint32_t*, float*, float*);
  const Launch launches[5][2] = {{launch<0, false>, launch<0, true>},
                                 {launch<1, false>, launch<1, true>},
                                 {launch<2, false>, launch<2, true>},
                                 {launch<3, false>, launch<3, true>},
                                 {launch<4, false>, launch<4, true>}};
  launches[variant][diverge](blocks, smem, d_embedding, vocab, dim, d_hidden, d_tokens, n, d_extras, d_repeated,
                             d_logits, d_best);
  FHB_CHECK(cudaGetLastError());
  FHB_CHECK(cudaDeviceSynchronize());

  std::vector<float> want(n, -INFINITY), got(diverge ? n : lanes), want_best(lanes, -INFINITY);
  FHB_CHECK(cudaMemcpy(got.data(), diverge ? d_logits : d_best, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  const int stride = blocks * kCandSlotsPerBlock;
  for (int i = 0; i < n; ++i) {
    if (tokens[i] >= 0 && tokens[i] < vocab) {
      want[i] = 0.0f;
      for (int d = 0; d < dim; ++d)
        want[i] += __bfloat162float(embedding[static_cast<size_t>(tokens[i]) * dim + d]) * __bfloat162float(hidden[d]);
    }
    float& lane_want = want_best[i % stride];  // slot i's warp and lane: (i % stride) / kRows, i % kRows
    lane_want = std::fmax(lane_want, want[i]);
  }
  const std::vector<float>& expected = diverge ? want : want_best;
  int mismatches = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool same = std::isinf(expected[i]) ? got[i] == expected[i]
                                              : std::fabs(got[i] - expected[i]) <= 1e-3f * (1 + std::fabs(expected[i]));
    mismatches += !same;
  }
  std::printf("variant %d diverge %d: %d slots on %d blocks, %d mismatches\n", variant, diverge, n, blocks, mismatches);
  return variant != 4 && mismatches ? 1 : 0;
}
