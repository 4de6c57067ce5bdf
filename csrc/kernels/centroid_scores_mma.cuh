// Stage 1 on tensor cores: centroid scores for batches of bf16 or fp16 hidden rows with centroids of
// the same dtype. Past a few batch rows the CUDA-core kernel is bound by its FMAs, not its bytes
// (every centroid element meets every batch row); an mma.sync takes 16 centroid rows times 8 batch
// rows times 16 elements in one instruction, so the kernel streams the centroids once for up to
// 64 batch rows at the speed of the read.
//
// A block scores one tile of 16 centroid rows for a chunk of up to 64 batch rows. Its warps split
// D: warp w takes the 32-element blocks w, w + 4, ..., and the block sums the warps' partial
// tiles in a fixed order (deterministic, no atomics). Within a 32-element block, lane (g, t) of
// the mma's fragment layout (g = lane / 4, t = lane % 4) loads 16 contiguous bytes, elements
// 8t..8t+7, of centroid rows g and g + 8 and of batch row g of each 8-row n-tile: the two mmas
// of the block take elements 8t..8t+3 and 8t+4..8t+7 as their k = 2t, 2t+1, 2t+8, 2t+9. A and B
// see the same permutation of k, so the dot products are those of the rows (in another summation
// order than the CUDA-core kernel's: float32 sums of the same products).
#pragma once

#include <type_traits>

#include "kernels/centroid_scores.cuh"

namespace flashhead {
namespace detail {

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * kWarpSize;
constexpr int kMmaTileRows = 16;    // centroid rows a block (the mma's M)
constexpr int kMmaTileBatch = 8;    // batch rows an n-tile (the mma's N)
constexpr int kMmaBlockElems = 32;  // elements of D two mmas cover: 16 bytes a lane of each row
// 32-element blocks each warp keeps in flight: 4 blocks x 2 rows x 16 bytes a lane.
constexpr int kMmaUnroll = 4;
// n-tiles a block at most: 64 batch rows a chunk; a larger batch is several chunks (grid.y),
// each streaming the centroids again.
constexpr int kMmaMaxTiles = 8;
// Blocks an SM keeps resident (a register cap of 102): the Qwen3-0.6B head's 594 tiles in one wave
// on 132 SMs. No instance spills on sm_90; on sm_80 the one of 8 n-tiles spills 8 bytes a thread.
constexpr int kMmaBlocksPerSm = 5;

// D = A (16 x 16, row) . B (16 x 8, col) + D in float32; A and B of bf16 or fp16.
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, __half>, "bf16 or fp16");
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// NT n-tiles of 8 batch rows a block. Rows must be whole 16-byte vectors (rows_vectorizable).
template <typename T, int NT>
__global__ void __launch_bounds__(kMmaThreads, kMmaBlocksPerSm) centroid_scores_mma_kernel(ScoreArgs<T, T> a) {
  static_assert(NT >= 1 && NT <= kMmaMaxTiles, "one to eight n-tiles");
  // The warps' partial tiles, as the mma leaves them: [warp][n-tile][element of the lane][lane].
  __shared__ float partial[kMmaWarps][NT][4][kWarpSize];
  let_next_kernel_start();
  constexpr int W = kVecWidth<T>;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int c0 = blockIdx.x * kMmaTileRows, b0 = blockIdx.y * NT * kMmaTileBatch;
  const int64_t d = a.hidden_dim;
  // Rows past the matrix's end are read as zeros (never loaded).
  const T* row_lo = c0 + g < a.num_clusters ? a.centroids + (c0 + g) * d : nullptr;
  const T* row_hi = c0 + g + 8 < a.num_clusters ? a.centroids + (c0 + g + 8) * d : nullptr;
  const T* hid = a.hidden + (b0 + g) * d;
  bool hid_valid[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) hid_valid[n] = b0 + n * kMmaTileBatch + g < a.batch;
  // Each centroid row is read once a call unless the batch takes several chunks.
  const uint64_t policy = row_policy(gridDim.y == 1);
  float acc[NT][4] = {};
  const int blocks = ceil_div(a.hidden_dim, kMmaBlockElems);
  for (int first = warp; first < blocks; first += kMmaWarps * kMmaUnroll) {  // uniform within the warp
    Piece<T, W> lo[kMmaUnroll], hi[kMmaUnroll];
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int k = (first + u * kMmaWarps) * kMmaBlockElems + t * W;
      // D is a multiple of W, so a lane's 16 bytes lie wholly inside the row or wholly past it.
      const bool in_row = k < a.hidden_dim;
      lo[u] = in_row && row_lo ? load_piece<T, W>(row_lo + k, &policy) : Piece<T, W>{};
      hi[u] = in_row && row_hi ? load_piece<T, W>(row_hi + k, &policy) : Piece<T, W>{};
    }
#pragma unroll
    for (int u = 0; u < kMmaUnroll; ++u) {
      const int k = (first + u * kMmaWarps) * kMmaBlockElems + t * W;
      if (first + u * kMmaWarps >= blocks) break;  // uniform within the warp
      const bool in_row = k < a.hidden_dim;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const Piece<T, W> h = in_row && hid_valid[n] ? load_piece<T, W>(hid + n * kMmaTileBatch * d + k, nullptr)
                                                      : Piece<T, W>{};
        mma_16x8x16<T>(acc[n], lo[u].word[0], hi[u].word[0], lo[u].word[1], hi[u].word[1], h.word[0], h.word[1]);
        mma_16x8x16<T>(acc[n], lo[u].word[2], hi[u].word[2], lo[u].word[3], hi[u].word[3], h.word[2], h.word[3]);
      }
    }
  }
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) partial[warp][n][e][lane] = acc[n][e];
  __syncthreads();
  // One score a thread a round, centroid row fastest (a batch row's 16 scores are contiguous).
  // Element e of lane (g, t) holds centroid row g + 8 (e / 2), batch row 2t + e % 2 of its n-tile.
  for (int i = threadIdx.x; i < NT * kMmaTileBatch * kMmaTileRows; i += kMmaThreads) {
    const int r = i % kMmaTileRows, col = i / kMmaTileRows;
    const int n = col / kMmaTileBatch, j = col % kMmaTileBatch;
    const int src = (r % 8) * 4 + j / 2, e = (r / 8) * 2 + j % 2;
    float dot = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) dot += partial[w][n][e][src];
    const int c = c0 + r, b = b0 + col;
    if (c < a.num_clusters && b < a.batch) store_score(a, b, c, dot);
  }
}

}  // namespace detail
}  // namespace flashhead
