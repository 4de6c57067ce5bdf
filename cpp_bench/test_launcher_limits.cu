// The torch-free launchers' own limits, for C++ callers that skip the ATen wrappers' checks, each
// returning cudaErrorInvalidValue before anything asks the device (so this runs without a GPU too):
// decoder_step_limit names the limit a shape breaks, and the plan refuses it, never a launch that
// divides by zero; launch_decode refuses probes outside [1, C], whose list entries would stay unset;
// launch_decoder_step refuses weights or caches off a 16-byte boundary (decoder_step_misaligned
// names the first); the decoder-layer launchers refuse grids past CUDA's 65,535 blocks in y or z
// (tokens of fused_linear, heads of rotary_cache_write, KV heads and query-row tiles of decode_attention).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>

#include "kernels/api.h"

namespace {

using flashhead::DecoderStepLimit;
using flashhead::DecoderStepPlan;
using flashhead::DecoderStepShape;

// A shape the kernel runs: 2 layers, hidden 64, intermediate 136, 4 heads over 2 KV heads of 16.
constexpr DecoderStepShape kGood{2, 64, 136, 4, 2, 16, 600, 1e-6f, 0.25f};

template <typename Change>
DecoderStepShape with(Change change) {
  DecoderStepShape shape = kGood;
  change(shape);
  return shape;
}

}  // namespace

int main() {
  struct Case {
    const char* what;
    DecoderStepShape shape;
    DecoderStepLimit broken;
  };
  // bf16: whole 16-byte vectors are multiples of 8 elements; a stage holds 32 KB of a row.
  const Case bad[] = {
      {"no layers", with([](DecoderStepShape& s) { s.layers = 0; }), DecoderStepLimit::kShape},
      {"hidden_size 60: not whole vectors", with([](DecoderStepShape& s) { s.hidden = 60; }),
       DecoderStepLimit::kWholeVectors},
      {"intermediate_size 132: not whole vectors", with([](DecoderStepShape& s) { s.intermediate = 132; }),
       DecoderStepLimit::kWholeVectors},
      {"head_dim 12: not whole vectors", with([](DecoderStepShape& s) { s.head_dim = 12; }),
       DecoderStepLimit::kWholeVectors},
      {"head_dim 264 > 256", with([](DecoderStepShape& s) { s.head_dim = 264; }), DecoderStepLimit::kHeadDim},
      {"no KV heads", with([](DecoderStepShape& s) { s.num_kv_heads = 0; }), DecoderStepLimit::kShape},
      {"heads not a multiple of KV heads", with([](DecoderStepShape& s) { s.num_heads = 5; }),
       DecoderStepLimit::kShape},
      {"16 query heads per KV head > 8", with([](DecoderStepShape& s) { s.num_heads = 32; }),
       DecoderStepLimit::kGroup},
      {"an intermediate row over a stage", with([](DecoderStepShape& s) { s.intermediate = 16392; }),
       DecoderStepLimit::kRowBytes},
      {"a gate_up unit over a stage", with([](DecoderStepShape& s) { s.hidden = 8200; }),
       DecoderStepLimit::kRowBytes},
      {"an o row over a stage",
       with([](DecoderStepShape& s) { s.num_heads = 72, s.num_kv_heads = 9, s.head_dim = 256; }),
       DecoderStepLimit::kRowBytes},
      {"max_len over 512 * 512", with([](DecoderStepShape& s) { s.max_len = 512 * 512 + 1; }),
       DecoderStepLimit::kMaxLen},
      {"a cache of 2^31 elements", with([](DecoderStepShape& s) { s.layers = 512, s.max_len = 512 * 512 / 2; }),
       DecoderStepLimit::kCacheElements},
  };
  int failures = 0;
  for (const Case& c : bad) {
    const DecoderStepLimit limit = flashhead::decoder_step_limit(c.shape, sizeof(__nv_bfloat16));
    DecoderStepPlan plan{};
    const cudaError_t got = flashhead::plan_decoder_step<__nv_bfloat16>(c.shape, &plan);
    if (limit != c.broken || got != cudaErrorInvalidValue) {
      std::printf("FAIL %s: limit %d (expected %d), %s (expected cudaErrorInvalidValue)\n", c.what,
                  static_cast<int>(limit), static_cast<int>(c.broken), cudaGetErrorName(got));
      ++failures;
    }
  }
  // Probes outside [1, C]: refused before any pointer is used (these are all null).
  int cases = static_cast<int>(sizeof(bad) / sizeof(bad[0])) + 1;
  for (const int probes : {0, 38}) {
    flashhead::HeadShape shape;
    shape.batch = 1, shape.hidden_dim = 64, shape.num_clusters = 37, shape.cluster_size = 4, shape.vocab = 148;
    shape.probes = probes;
    const cudaError_t got = flashhead::launch_decode(flashhead::HeadTensors<__nv_bfloat16>{}, shape, nullptr, nullptr,
                                                     1, nullptr, nullptr, nullptr);
    ++cases;
    if (got != cudaErrorInvalidValue) {
      std::printf("FAIL launch_decode with %d probes of 37 clusters: %s (expected cudaErrorInvalidValue)\n", probes,
                  cudaGetErrorName(got));
      ++failures;
    }
  }
  // A step whose weights or caches start off a 16-byte boundary: refused before the plan's pointers
  // or the device are used.
  {
    using bf16 = __nv_bfloat16;
    const auto* base = reinterpret_cast<bf16*>(std::uintptr_t{1} << 20);  // aligned, never dereferenced
    const flashhead::DecoderStepWeights<bf16> aligned{base, base, base, base, base, base, nullptr, nullptr, nullptr};
    flashhead::DecoderStepWeights<bf16> odd_down = aligned;
    odd_down.down = base + 1;
    bf16* const cache = const_cast<bf16*>(base);
    const struct {
      const char* what;
      cudaError_t got;
    } misaligned[] = {
        {"down_weight off by one element",
         flashhead::launch_decoder_step<bf16>(base, odd_down, cache, cache, nullptr, nullptr, nullptr, kGood,
                                              DecoderStepPlan{}, nullptr, nullptr, nullptr)},
        {"v_cache off by one element",
         flashhead::launch_decoder_step<bf16>(base, aligned, cache, cache + 1, nullptr, nullptr, nullptr, kGood,
                                              DecoderStepPlan{}, nullptr, nullptr, nullptr)},
    };
    for (const auto& m : misaligned) {
      ++cases;
      if (m.got != cudaErrorInvalidValue) {
        std::printf("FAIL decoder_step with %s: %s (expected cudaErrorInvalidValue)\n", m.what, cudaGetErrorName(m.got));
        ++failures;
      }
    }
    // What the ATen wrapper names: the first misaligned argument; nothing for aligned pointers.
    const std::pair<const char*, const char*> named[] = {
        {flashhead::decoder_step_misaligned<bf16>(odd_down, cache + 1, cache), "down_weight"},
        {flashhead::decoder_step_misaligned<bf16>(aligned, cache, cache + 1), "v_cache"},
        {flashhead::decoder_step_misaligned<bf16>(aligned, cache, cache), nullptr}};
    for (const auto& [got, expected] : named) {
      ++cases;
      if (expected ? got == nullptr || std::strcmp(got, expected) != 0 : got != nullptr) {
        std::printf("FAIL decoder_step_misaligned named %s (expected %s)\n", got ? got : "nothing",
                    expected ? expected : "nothing");
        ++failures;
      }
    }
  }
  // decode_attention's tiles of a KV head's query rows: one row a tile up to 16 rows, then as few
  // rows as keep 16 tiles, at most 32 and as many as fit beside the split's values (7 of 256 floats).
  struct Tiles {
    int tokens, heads, kv_heads, head_dim, element_bytes;
    int64_t expected;
  };
  const Tiles tiles[] = {{1, 16, 1, 128, 2, 16},       {1, 17, 1, 128, 2, 9},        {3, 32, 4, 64, 2, 12},
                         {8, 64, 1, 256, 4, 74},       {1, 2097120, 1, 1, 4, 65535}, {1, 2097121, 1, 1, 4, 65536}};
  for (const Tiles& t : tiles) {
    const int64_t got = flashhead::decode_attention_tiles(t.tokens, t.heads, t.kv_heads, t.head_dim, t.element_bytes);
    ++cases;
    if (got != t.expected) {
      std::printf("FAIL decode_attention_tiles(%d, %d, %d, %d, %d): %lld (expected %lld)\n", t.tokens, t.heads,
                  t.kv_heads, t.head_dim, t.element_bytes, static_cast<long long>(got),
                  static_cast<long long>(t.expected));
      ++failures;
    }
  }
  // Past the grid's limits the decoder-layer launchers refuse before any pointer is used.
  using bf16 = __nv_bfloat16;
  const int past_tokens = static_cast<int>(flashhead::kFusedLinearMaxTokens) + 1;
  const struct {
    const char* what;
    cudaError_t got;
  } grids[] = {
      {"fused_linear, 524,281 tokens",
       flashhead::launch_fused_linear<bf16>(nullptr, nullptr, nullptr, false, 1e-6f, nullptr, nullptr, nullptr,
                                            past_tokens, 64, 64, nullptr)},
      {"rotary_cache_write, 65,535 + 1 heads",
       flashhead::launch_rotary_cache_write<bf16>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1e-6f, nullptr,
                                                  nullptr, nullptr, 1, 65535, 1, 2, 8, nullptr)},
      {"decode_attention, 65,536 KV heads",
       flashhead::launch_decode_attention<bf16>(nullptr, nullptr, nullptr, nullptr, 1.0f, nullptr, 1, 65536, 65536, 8,
                                                8, nullptr, nullptr)},
      {"decode_attention, 65,536 tiles of 32 query rows",
       flashhead::launch_decode_attention<bf16>(nullptr, nullptr, nullptr, nullptr, 1.0f, nullptr, 1, 2097121, 1, 8,
                                                8, nullptr, nullptr)},
  };
  for (const auto& g : grids) {
    ++cases;
    if (g.got != cudaErrorInvalidValue) {
      std::printf("FAIL %s: %s (expected cudaErrorInvalidValue)\n", g.what, cudaGetErrorName(g.got));
      ++failures;
    }
  }
  // One element under 2^31 - 1's cache is within the limits.
  ++cases;
  if (flashhead::decoder_step_limit(with([](DecoderStepShape& s) { s.layers = 511, s.max_len = 512 * 512 / 2; }),
                                    sizeof(__nv_bfloat16)) != DecoderStepLimit::kNone) {
    std::printf("FAIL a cache of 511 * 2 * 131072 * 16 elements (under 2^31): refused\n");
    ++failures;
  }
  // Within the limits the plan goes on to the device: success on a GPU, a device error without one.
  DecoderStepPlan plan{};
  const cudaError_t good = flashhead::plan_decoder_step<__nv_bfloat16>(kGood, &plan);
  if (flashhead::decoder_step_limit(kGood, sizeof(__nv_bfloat16)) != DecoderStepLimit::kNone ||
      good == cudaErrorInvalidValue) {
    std::printf("FAIL a shape within the limits: cudaErrorInvalidValue\n");
    ++failures;
  }
  std::printf("test_launcher_limits: %d of %d cases failed (the valid decoder_step shape: %s)\n", failures, cases,
              cudaGetErrorName(good));
  return failures == 0 ? 0 : 1;
}
