// Counter-based random numbers shared by the CUDA kernels and the CPU references, so a seed
// names the same Gumbel noise on both. Philox4x32-10 (Salmon et al., SC'11): stateless, any
// (row, column) draws its own value without coordination between threads.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FH_HOST_DEVICE __host__ __device__ __forceinline__
#define FH_UNROLL _Pragma("unroll")
#else
#define FH_HOST_DEVICE inline
// A host compiler warned on nvcc's pragma at every CPU build (the references include this file).
#define FH_UNROLL
#endif

namespace flashhead {

// Separate counter streams keep the cluster draw and the token draw of one call independent.
enum RandomStream : uint32_t { kClusterStream = 0, kTokenStream = 1 };

FH_HOST_DEVICE uint32_t philox_first_word(uint64_t seed, uint32_t col, uint32_t row, uint32_t stream) {
  uint32_t c0 = col, c1 = row, c2 = stream, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  FH_UNROLL
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// Standard Gumbel sample from a uniform in the open interval (0, 1) with 23-bit resolution: with
// 24 bits, 2^24 - 0.5 rounds up to 2^24 in float32, u becomes 1 and the noise +inf. The truncated
// tails (g beyond about -2.8 or 16.6) carry under 1e-6 of the mass.
FH_HOST_DEVICE float gumbel_noise(uint64_t seed, uint32_t stream, uint32_t row, uint32_t col) {
  const uint32_t bits = philox_first_word(seed, col, row, stream);
  const float u = (static_cast<float>(bits >> 9) + 0.5f) * (1.0f / 8388608.0f);
  return -logf(-logf(u));
}

}  // namespace flashhead
