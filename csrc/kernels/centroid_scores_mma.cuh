// Stage 1 on tensor cores: centroid scores for batches of bf16 or fp16 hidden rows with centroids
// of the same dtype or fp8 e4m3 ones, rows of whole 16-byte vectors. Past a few batch rows the
// CUDA-core kernel is bound by its FMAs, not its bytes (every centroid element meets every batch
// row); an mma.sync takes 16 centroid rows times 8 batch rows times 16 elements in one
// instruction, so the kernel streams the centroids once for up to 64 batch rows at about the
// speed of the read.
//
// A thread block scores one tile of 16 centroid rows for a chunk of up to 64 batch rows. Its warps
// split D into steps of 4E elements, E = 8 (16-bit centroids) or 16 (fp8): warp w takes steps w,
// w + 4, ..., and the block sums the warps' partial tiles in a fixed order (deterministic, no
// atomics). Within a step, lane (g, t) of the mma's fragment layout (g = lane / 4, t = lane % 4)
// loads 16 contiguous bytes, elements Et..Et+E-1, of centroid rows g and g + 8, and the same
// elements of batch row g of each 8-row n-tile: the step's E / 4 mmas take 4 of them each as
// their k = 2t, 2t+1, 2t+8, 2t+9. A and B see the same permutation of k, so the dot products are
// those of the rows, summed in the tensor cores' fp32 accumulation (another order and rounding
// than the CUDA-core kernel's: within 1.2e-7 of the sum of |products| where measured; exact for
// integer-valued inputs). e4m3 converts exactly to either 16-bit format.
#pragma once

#include <type_traits>

#include "kernels/centroid_scores.cuh"

namespace flashhead {
namespace detail {

// The (hidden, centroid) dtypes the tensor-core kernel takes, and the batches from which it runs
// (with 16-byte rows): past a tile of 4 with 16-bit centroids, past 2 with fp8. At the Qwen3-0.6B
// head on an H200 it took 8.8 µs at batch 8 against 12.4 on CUDA cores with bf16 centroids, but
// 8.6 against 8.2 at batch 4 (and 8.4 against 6.7 at batch 2); with fp8 centroids 5.3 µs from
// batch 3, against 6.5 at batch 3-4 and 5.0 at batch 2 on CUDA cores.
template <typename T, typename TC>
constexpr bool kScoresOnTensorCores = sizeof(T) == 2 && (std::is_same_v<T, TC> || std::is_same_v<TC, __nv_fp8_e4m3>);
template <typename TC>
constexpr int kMmaMinBatch = sizeof(TC) == 1 ? 3 : 5;

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * kWarpSize;
constexpr int kMmaTileRows = 16;    // centroid rows a thread block (the mma's M)
constexpr int kMmaTileBatch = 8;    // batch rows an n-tile (the mma's N)
// Steps of D each warp keeps in flight, 2 rows x 16 bytes a lane each: 4 with 16-bit centroids,
// 2 with fp8 (whose steps take twice the hidden words: 4 spilled up to 88 bytes a thread).
template <typename TC>
constexpr int kMmaUnroll = sizeof(TC) == 1 ? 2 : 4;
// n-tiles a thread block at most: 64 batch rows a chunk with 16-bit centroids, 32 with fp8 (whose
// 8 n-tiles spilled 40 bytes a thread); a larger batch is several chunks (grid.y), each streaming
// the centroids again.
template <typename TC>
constexpr int kMmaMaxTiles = sizeof(TC) == 1 ? 4 : 8;
// Thread blocks an SM keeps resident (at most 102 registers a thread; the instances use 52-96):
// the Qwen3-0.6B head's 594 tiles in one wave on 132 SMs. No instance spills on sm_90; on sm_80
// the 16-bit ones of 8 n-tiles spill 8 bytes a thread.
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

// Elements of a centroid row a lane loads at once (16 bytes) and 16-bit operand words they make.
template <typename TC>
constexpr int kMmaLaneElems = 16 / sizeof(TC);
template <typename TC>
constexpr int kMmaLaneWords = kMmaLaneElems<TC> / 2;

// A lane's 16 bytes of a centroid row as mma operand words of T, elements 2i and 2i + 1 in word i:
// as loaded for centroids of T; e4m3 converted exactly (its values are fp16 and bf16 values), to
// fp16 in one instruction a pair, to bf16 through float32.
template <typename T, typename TC>
__device__ __forceinline__ void operand_words(const Piece<TC, kVecWidth<TC>>& piece,
                                              uint32_t (&out)[kMmaLaneWords<TC>]) {
  if constexpr (std::is_same_v<T, TC>) {
#pragma unroll
    for (int i = 0; i < kMmaLaneWords<TC>; ++i) out[i] = piece.word[i];
  } else {
    static_assert(std::is_same_v<TC, __nv_fp8_e4m3>, "centroids of the hidden dtype or fp8 e4m3");
#pragma unroll
    for (int i = 0; i < kMmaLaneWords<TC>; ++i) {
      const auto bytes = static_cast<__nv_fp8x2_storage_t>(piece.word[i / 2] >> (16 * (i % 2)));
      const __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2(bytes, __NV_E4M3);
      if constexpr (std::is_same_v<T, __half>) {
        out[i] = uint32_t{pair.x} | uint32_t{pair.y} << 16;
      } else {
        const float2 f = __half22float2(__half2(pair));
        const __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
        memcpy(&out[i], &b, sizeof(b));
      }
    }
  }
}

// NT n-tiles of 8 batch rows a thread block. Rows must be whole 16-byte vectors (rows_vectorizable).
template <typename T, typename TC, int NT>
__global__ void __launch_bounds__(kMmaThreads, kMmaBlocksPerSm) centroid_scores_mma_kernel(ScoreArgs<T, TC> a) {
  static_assert(NT >= 1 && NT <= kMmaMaxTiles<TC>, "one to kMmaMaxTiles n-tiles");
  // The warps' partial tiles, as the mma leaves them: [warp][n-tile][element of the lane][lane].
  __shared__ float partial[kMmaWarps][NT][4][kWarpSize];
  wait_for_previous_kernel();  // as centroid_scores_kernel: a dependent of the kernel before
  let_next_kernel_start();
  constexpr int E = kMmaLaneElems<TC>, WC = kVecWidth<TC>, WH = kVecWidth<T>;
  constexpr int kStepElems = 4 * E;                  // a step of D: the lanes t = 0..3 of a row
  constexpr int kHiddenPieces = E * sizeof(T) / 16;  // 16-byte loads of a batch row a step
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int c0 = blockIdx.x * kMmaTileRows, b0 = blockIdx.y * NT * kMmaTileBatch;
  const int64_t d = a.hidden_dim;
  // Rows past the matrix's end are read as zeros (never loaded).
  const TC* row_lo = c0 + g < a.num_clusters ? a.centroids + (c0 + g) * d : nullptr;
  const TC* row_hi = c0 + g + 8 < a.num_clusters ? a.centroids + (c0 + g + 8) * d : nullptr;
  // Batch row g of the first n-tile; n-tile n's is n * 8 rows on (read only while in the batch).
  const T* hid = b0 + g < a.batch ? a.hidden + (b0 + g) * d : nullptr;
  bool hid_valid[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) hid_valid[n] = b0 + n * kMmaTileBatch + g < a.batch;
  // Each centroid row is read once a call unless the batch takes several chunks.
  const uint64_t policy = row_policy(gridDim.y == 1);
  float acc[NT][4] = {};
  const int steps = ceil_div(a.hidden_dim, kStepElems);
  for (int first = warp; first < steps; first += kMmaWarps * kMmaUnroll<TC>) {  // uniform within the warp
    Piece<TC, WC> lo[kMmaUnroll<TC>], hi[kMmaUnroll<TC>];
#pragma unroll
    for (int u = 0; u < kMmaUnroll<TC>; ++u) {
      const int k = (first + u * kMmaWarps) * kStepElems + t * E;
      // D is a multiple of E, so a lane's 16 bytes lie wholly inside the row or wholly past it.
      const bool in_row = k < a.hidden_dim;
      lo[u] = in_row && row_lo ? load_piece<TC, WC>(row_lo + k, &policy) : Piece<TC, WC>{};
      hi[u] = in_row && row_hi ? load_piece<TC, WC>(row_hi + k, &policy) : Piece<TC, WC>{};
    }
#pragma unroll
    for (int u = 0; u < kMmaUnroll<TC>; ++u) {
      const int k = (first + u * kMmaWarps) * kStepElems + t * E;
      if (first + u * kMmaWarps >= steps) break;  // uniform within the warp
      const bool in_row = k < a.hidden_dim;
      uint32_t a_lo[kMmaLaneWords<TC>], a_hi[kMmaLaneWords<TC>];
      operand_words<T>(lo[u], a_lo);
      operand_words<T>(hi[u], a_hi);
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        uint32_t b[kMmaLaneWords<TC>];
#pragma unroll
        for (int q = 0; q < kHiddenPieces; ++q) {
          const Piece<T, WH> h = in_row && hid_valid[n]
                                     ? load_piece<T, WH>(hid + n * kMmaTileBatch * d + k + q * WH, nullptr)
                                     : Piece<T, WH>{};
#pragma unroll
          for (int w = 0; w < 4; ++w) b[4 * q + w] = h.word[w];
        }
        // mma j takes words 2j and 2j + 1: elements E t + 4j .. E t + 4j + 3 as its k = 2t, 2t + 1,
        // 2t + 8, 2t + 9.
#pragma unroll
        for (int j = 0; j < kMmaLaneWords<TC> / 2; ++j)
          mma_16x8x16<T>(acc[n], a_lo[2 * j], a_hi[2 * j], a_lo[2 * j + 1], a_hi[2 * j + 1], b[2 * j], b[2 * j + 1]);
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
