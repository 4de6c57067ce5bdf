// Decoder-layer kernels for steps of a few tokens (the fast path's draft steps and verifies).
//
// At one to a few tokens a layer is bound by its weight bytes, and by how many dependent kernels
// it runs. So: the four matrix products are one GEMV kernel each that streams its weight rows at
// memory bandwidth, with the RMSNorm, the SiLU gate and the residual add folded into its prologue
// and epilogue; rotary + q/k norm + the cache write are one small kernel; attention is split over
// the cache (flash-decoding) and merged by a second small kernel. Every kernel is launched as a
// programmatic dependent of the previous one; the GEMV may issue its first weight loads before it
// waits (weight_before_wait: model weights), so the weight stream starts while the previous kernel
// drains.
#include <cuda_pipeline.h>

#include <algorithm>

#include "kernels/common.cuh"

namespace flashhead {
namespace detail {
namespace {

// ---- fused_linear -----------------------------------------------------------------------------

constexpr int kLinearThreads = 256;
constexpr int kLinearWarps = kLinearThreads / kWarpSize;
constexpr int kLinearMaxTokens = kFusedLinearTokensPerBlock;  // more tokens use more blocks in y
constexpr int kLinearSmemBytes = 40 * 1024;    // the staged input: under the 48 KB a block gets without opt-in

enum Prologue : int { kPlain = 0, kRmsNorm = 1, kSiluGate = 2 };

template <typename T>
struct LinearParams {
  const T* x;
  const T* weight;
  const T* norm_weight;
  const T* residual;
  const T* bias;
  T* out;
  int tokens, out_features, in_features;
  int prologue;
  float eps;
  int chunk;  // input columns staged in shared memory at a time (a multiple of 8)
  bool weight_before_wait;  // the previous kernel did not write weight: read it before waiting
};

// Where a warp is in its weight stream: a group of rows (one per block, strided by the grid), a
// chunk of input columns, and the first vector of the current load batch within the chunk.
struct LinearCursor {
  int group, col0, base;
};

// Each warp owns R weight rows of a group and computes them for MB tokens; the block stages the
// transformed input of its MB tokens in shared memory as float (chunk columns at a time) and
// streams weight rows through registers, the next batch of U vectors per row in flight while the
// current one is used. Blocks loop over row groups, so the staged input is reused (one stage per
// block when the input fits one chunk). RMSNorm is applied as y = inv_rms * (W . (x * g)): the
// sum of squares comes from the same staging pass, so the input is read once.
template <typename T, int W, int MB, int R>
__global__ void __launch_bounds__(kLinearThreads) fused_linear_kernel(LinearParams<T> p) {
  constexpr int U = (MB >= 4 ? 4 : 8) / R;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* staged = reinterpret_cast<float*>(smem_raw);  // [MB][chunk]
  __shared__ float inv_rms[MB];
  __shared__ float warp_partial[kLinearWarps][MB];

  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int token0 = blockIdx.y * MB;
  const int tokens = min(MB, p.tokens - token0);
  const int64_t k = p.in_features;
  const int groups = ceil_div(p.out_features, kLinearWarps * R);
  const int chunks = ceil_div(p.in_features, p.chunk);
  const int x_cols = p.prologue == kSiluGate ? 2 * p.in_features : p.in_features;
  auto vectors_of = [&](int col0) { return min(p.chunk, p.in_features - col0) / W; };
  auto row_of = [&](int group, int r) { return (int64_t{group} * kLinearWarps + warp) * R + r; };
  auto advance = [&](LinearCursor c) {
    c.base += kWarpSize * U;
    if (c.base >= vectors_of(c.col0)) {
      c.base = 0;
      c.col0 += p.chunk;
      if (c.col0 >= p.in_features) {
        c.col0 = 0;
        c.group += gridDim.x;
      }
    }
    return c;
  };
  auto load_weights = [&](const LinearCursor& c, Piece<T, W> (&w)[R][U]) {
    const int vectors = vectors_of(c.col0);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t row = row_of(c.group, r);
      const T* src = p.weight + row * k + c.col0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = c.base + u * kWarpSize + lane;
        w[r][u] = (row < p.out_features && v < vectors) ? load_piece<T, W>(src + int64_t{v} * W, nullptr) : Piece<T, W>{};
      }
    }
  };

  LinearCursor cur{static_cast<int>(blockIdx.x), 0, 0};
  Piece<T, W> w[R][U];
  // Weights the previous kernel did not write start streaming before waiting for it.
  if (p.weight_before_wait && cur.group < groups) load_weights(cur, w);
  wait_for_previous_kernel();
  let_next_kernel_start();
  if (!p.weight_before_wait && cur.group < groups) load_weights(cur, w);

  float acc[R][MB];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < MB; ++t) acc[r][t] = 0.0f;
  bool staged_once = false;

  while (cur.group < groups) {
    if (cur.base == 0 && (chunks > 1 || !staged_once)) {
      staged_once = true;
      __syncthreads();  // every warp is done with the previous chunk
      const int cols = min(p.chunk, p.in_features - cur.col0);
      float sum_sq[MB];
#pragma unroll
      for (int t = 0; t < MB; ++t) sum_sq[t] = 0.0f;
#pragma unroll
      for (int t = 0; t < MB; ++t) {
        // Unrolled so that each thread's loads are in flight together: staging is latency-bound.
#pragma unroll 4
        for (int i = threadIdx.x; i < cols; i += kLinearThreads) {
          float v = 0.0f;
          if (t < tokens) {
            const T* xr = p.x + (token0 + t) * int64_t{x_cols} + cur.col0 + i;
            v = to_float(xr[0]);
            if (p.prologue == kSiluGate) {
              v = rounded<T>(rounded<T>(v / (1.0f + expf(-v))) * to_float(xr[p.in_features]));
            } else if (p.prologue == kRmsNorm) {
              sum_sq[t] = fmaf(v, v, sum_sq[t]);
              v *= to_float(p.norm_weight[cur.col0 + i]);
            }
          }
          staged[t * p.chunk + i] = v;
        }
      }
      if (p.prologue == kRmsNorm && cur.col0 == 0) {
        if (chunks > 1) {
          // The norm needs whole rows: a pass over the rest of the input (long rows only).
#pragma unroll 4
          for (int i = cols + threadIdx.x; i < p.in_features; i += kLinearThreads) {
#pragma unroll
            for (int t = 0; t < MB; ++t) {
              if (t < tokens) {
                const float v = to_float(p.x[(token0 + t) * int64_t{x_cols} + i]);
                sum_sq[t] = fmaf(v, v, sum_sq[t]);
              }
            }
          }
        }
#pragma unroll
        for (int t = 0; t < MB; ++t) {
          const float s = warp_sum(sum_sq[t]);
          if (lane == 0) warp_partial[warp][t] = s;
        }
        __syncthreads();
        if (threadIdx.x < MB) {
          float s = 0.0f;
#pragma unroll
          for (int i = 0; i < kLinearWarps; ++i) s += warp_partial[i][threadIdx.x];
          inv_rms[threadIdx.x] = rsqrtf(s / static_cast<float>(p.in_features) + p.eps);
        }
      }
      __syncthreads();
    }

    const LinearCursor next = advance(cur);
    Piece<T, W> w_next[R][U];
    if (next.group < groups) load_weights(next, w_next);

    const int vectors = vectors_of(cur.col0);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = cur.base + u * kWarpSize + lane;
      if (v >= vectors) continue;
#pragma unroll
      for (int e0 = 0; e0 < W; e0 += 4) {
        constexpr int E = W < 4 ? W : 4;
        float xv[MB][E];
#pragma unroll
        for (int t = 0; t < MB; ++t) {
          const float* src = staged + t * p.chunk + v * W + e0;
          if constexpr (E == 4) {
            const float4 f = *reinterpret_cast<const float4*>(src);
            xv[t][0] = f.x, xv[t][1] = f.y, xv[t][2] = f.z, xv[t][3] = f.w;
          } else {
#pragma unroll
            for (int e = 0; e < E; ++e) xv[t][e] = src[e];
          }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float wf[W];
          piece_floats(w[r][u], wf);
#pragma unroll
          for (int e = 0; e < E; ++e)
#pragma unroll
            for (int t = 0; t < MB; ++t) acc[r][t] = fmaf(wf[e0 + e], xv[t][e], acc[r][t]);
        }
      }
    }

    if (next.group != cur.group) {  // the group's rows are complete
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int t = 0; t < MB; ++t) {
          const float sum = warp_sum(acc[r][t]);
          acc[r][t] = 0.0f;
          const int64_t row = row_of(cur.group, r);
          if (lane != 0 || row >= p.out_features || t >= tokens) continue;
          const int64_t at = (token0 + t) * int64_t{p.out_features} + row;
          float y = p.prologue == kRmsNorm ? sum * inv_rms[t] : sum;
          if (p.bias) y += to_float(p.bias[row]);
          y = rounded<T>(y);
          if (p.residual) y += to_float(p.residual[at]);
          p.out[at] = from_float<T>(y);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) w[r][u] = w_next[r][u];
    cur = next;
  }
}

template <typename T, int W, int MB, int R>
cudaError_t launch_linear(const LinearParams<T>& p, int sms, size_t smem, cudaStream_t stream, bool dependent) {
  const auto kernel = fused_linear_kernel<T, W, MB, R>;
  int per_sm = 0;
  if (const cudaError_t err = resident_blocks(kernel, kLinearThreads, smem, &per_sm); err != cudaSuccess) return err;
  // One wave of resident blocks that loop over the row groups: no tail wave, one staging each.
  const int groups = ceil_div(p.out_features, kLinearWarps * R);
  const dim3 grid(min(groups, max(1, per_sm) * sms), ceil_div(p.tokens, MB));
  return launch_kernel(kernel, grid, dim3(kLinearThreads), smem, stream, dependent, p);
}

template <typename T, int W, int MB>
cudaError_t launch_linear_rows(const LinearParams<T>& p, size_t smem, cudaStream_t stream, bool dependent) {
  // Two rows per warp when there are rows enough to fill the GPU twice over.
  int sms = 0;
  if (const cudaError_t err = multiprocessor_count(&sms); err != cudaSuccess) return err;
  if (ceil_div(p.out_features, kLinearWarps * 2) >= 2 * sms)
    return launch_linear<T, W, MB, 2>(p, sms, smem, stream, dependent);
  return launch_linear<T, W, MB, 1>(p, sms, smem, stream, dependent);
}

template <typename T, int W>
cudaError_t launch_linear_vec(const LinearParams<T>& p, int tokens_per_block, size_t smem, cudaStream_t stream,
                              bool dependent) {
  switch (tokens_per_block) {
    case 1:
      return launch_linear_rows<T, W, 1>(p, smem, stream, dependent);
    case 2:
      return launch_linear_rows<T, W, 2>(p, smem, stream, dependent);
    case 4:
      return launch_linear_rows<T, W, 4>(p, smem, stream, dependent);
    default:
      return launch_linear_rows<T, W, kLinearMaxTokens>(p, smem, stream, dependent);
  }
}

// ---- rotary_cache_write -----------------------------------------------------------------------

template <typename T>
struct RotaryParams {
  const T* qkv;
  const T* cos;
  const T* sin;
  const int64_t* length;
  const T* q_norm;
  const T* k_norm;
  T* k_cache;
  T* v_cache;
  T* q_out;
  int num_heads, num_kv_heads, head_dim, max_len;
  float eps;
};

// One block per (token, query or key head); thread t rotates the pair (t, t + head_dim / 2).
template <typename T>
__global__ void rotary_cache_write_kernel(RotaryParams<T> p) {
  __shared__ float warp_partial[32];
  wait_for_previous_kernel();
  let_next_kernel_start();
  const int token = blockIdx.x, head = blockIdx.y, t = threadIdx.x, half = p.head_dim / 2;
  const bool is_query = head < p.num_heads;
  const int64_t cols = int64_t{p.num_heads + 2 * p.num_kv_heads} * p.head_dim;
  const T* src = p.qkv + token * cols + int64_t{head} * p.head_dim;
  const bool active = t < half;
  float lo = active ? to_float(src[t]) : 0.0f, hi = active ? to_float(src[t + half]) : 0.0f;

  const T* norm = is_query ? p.q_norm : p.k_norm;
  if (norm) {
    const float s = warp_sum(lo * lo + hi * hi);
    if (t % kWarpSize == 0) warp_partial[t / kWarpSize] = s;
    __syncthreads();
    float total = 0.0f;
    for (int i = 0; i < ceil_div(static_cast<int>(blockDim.x), kWarpSize); ++i) total += warp_partial[i];
    const float inv_rms = rsqrtf(total / static_cast<float>(p.head_dim) + p.eps);
    if (active) {
      lo = rounded<T>(lo * inv_rms * to_float(norm[t]));
      hi = rounded<T>(hi * inv_rms * to_float(norm[t + half]));
    }
  }
  if (!active) return;

  const int64_t pos = *p.length + token;
  T* q_row = p.q_out + (int64_t{token} * p.num_heads + head) * p.head_dim;
  if (pos < 0 || pos >= p.max_len) {
    // Outside the cache: nothing is written, and the token's queries are NaN so the error shows.
    if (is_query) q_row[t] = q_row[t + half] = from_float<T>(NAN);
    return;
  }
  const T* cos = p.cos + pos * p.head_dim;
  const T* sin = p.sin + pos * p.head_dim;
  const T out_lo = from_float<T>(rounded<T>(lo * to_float(cos[t])) - hi * to_float(sin[t]));
  const T out_hi = from_float<T>(rounded<T>(hi * to_float(cos[t + half])) + lo * to_float(sin[t + half]));
  if (is_query) {
    q_row[t] = out_lo;
    q_row[t + half] = out_hi;
    return;
  }
  const int kv_head = head - p.num_heads;
  const int64_t at = (int64_t{kv_head} * p.max_len + pos) * p.head_dim;
  p.k_cache[at + t] = out_lo;
  p.k_cache[at + t + half] = out_hi;
  const T* v_src = src + int64_t{p.num_kv_heads} * p.head_dim;
  p.v_cache[at + t] = v_src[t];
  p.v_cache[at + t + half] = v_src[t + half];
}

// ---- decode_attention -------------------------------------------------------------------------

constexpr int kKeysPerSplit = kWarpSize;  // one key per lane
constexpr int kMaxRowsPerTile = 32;       // query rows (token, head of a KV group) per block, at most
constexpr int kTilesPerSplit = 16;        // tiles of a (split, KV head) once they hold several rows each
constexpr int kMaxHeadDim = kDecodeAttentionMaxHeadDim;
constexpr int kAttentionSmemBytes = 40 * 1024;
constexpr int kKeyPieceBytes = 256;       // key bytes a lane holds in registers at a time

// How a KV head's query rows (its query heads times the tokens) are tiled. A warp scores its
// tile's rows one after another, so tiles hold as few rows as keep their number to kTilesPerSplit
// (each tile reads the split's keys and values again, from L2), at most kMaxRowsPerTile and as
// many as fit in shared memory beside the split's values.
struct AttentionTiles {
  int group_rows, q_stride, rows_per_tile;  // q_stride: head_dim rounded up to whole key pieces
  size_t values_bytes, row_bytes;
  AttentionTiles(int tokens, int num_heads, int num_kv_heads, int head_dim, int element_bytes)
      : group_rows(num_heads / num_kv_heads * tokens),
        q_stride(ceil_div(head_dim, kKeyPieceBytes / element_bytes) * (kKeyPieceBytes / element_bytes)),
        rows_per_tile(0),
        values_bytes(size_t{kKeysPerSplit} * head_dim * element_bytes),
        row_bytes(kWarpSize * sizeof(float) + size_t{static_cast<unsigned>(q_stride)} * element_bytes) {
    const size_t fits = (kAttentionSmemBytes - values_bytes) / row_bytes;
    rows_per_tile = static_cast<int>(
        std::min<size_t>({kMaxRowsPerTile, fits, static_cast<size_t>(ceil_div(group_rows, kTilesPerSplit))}));
  }
  int count() const { return ceil_div(group_rows, rows_per_tile); }
  size_t smem_bytes() const { return values_bytes + rows_per_tile * row_bytes; }
};

template <typename T>
struct AttentionParams {
  const T* q;
  const T* k_cache;
  const T* v_cache;
  const int64_t* length;
  float* partial_out;  // [splits, tokens * heads, head_dim]
  float* partial_max;  // [splits, tokens * heads]
  float* partial_sum;  // [splits, tokens * heads]
  T* out;              // [tokens, heads * head_dim]
  int tokens, num_heads, num_kv_heads, head_dim, max_len;
  float scale;
  int rows_per_tile;
  int q_stride;  // head_dim rounded up to whole key pieces
};

// length is clamped first, so a length near 2^63 sees the whole cache instead of overflowing.
__device__ __forceinline__ int64_t last_visible_key(int64_t length, int token, int max_len) {
  return min(min(length, int64_t{max_len}) + token, int64_t{max_len} - 1);
}

// 16-byte global -> shared copy that does not wait for its data (cp.async), or a plain copy of
// one element on the scalar path.
template <typename T, int W>
__device__ __forceinline__ void copy_to_shared(T* dst, const T* src) {
  if constexpr (W > 1) {
    __pipeline_memcpy_async(dst, src, 16);
  } else {
    *dst = *src;
  }
}

// One warp per (split of 32 cache positions, KV head, tile of query rows). The split's values
// and the tile's queries are copied to shared memory asynchronously while lane j loads key
// split*32 + j and scores it against every row (rows broadcast from shared memory); then each
// row's softmax-weighted values of the split go to the partials.
template <typename T, int W>
__global__ void __launch_bounds__(kWarpSize) decode_attention_kernel(AttentionParams<T> p) {
  constexpr int kPieceDims = kKeyPieceBytes / sizeof(T);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int hd = p.head_dim;
  float* weights = reinterpret_cast<float*>(smem_raw);                  // [rows_per_tile][32]
  T* values = reinterpret_cast<T*>(weights + p.rows_per_tile * kWarpSize);  // [32][head_dim]
  T* rows_q = values + kKeysPerSplit * hd;                                // [rows_per_tile][q_stride]
  wait_for_previous_kernel();
  let_next_kernel_start();

  const int split = blockIdx.x, kv_head = blockIdx.y, lane = threadIdx.x;
  const int group = p.num_heads / p.num_kv_heads;
  const int row0 = blockIdx.z * p.rows_per_tile;
  const int rows = min(p.rows_per_tile, group * p.tokens - row0);
  const int64_t length = *p.length;
  const int key0 = split * kKeysPerSplit;
  // The merge reads a split only for tokens that see its first key; others need nothing from it.
  if (key0 > last_visible_key(length, (row0 + rows - 1) / group, p.max_len)) return;

  // Tile row r: token (row0 + r) / group, head kv_head * group + (row0 + r) % group.
  auto head_row = [&](int r) {
    const int row = row0 + r;
    return int64_t{row / group} * p.num_heads + kv_head * group + row % group;
  };
  const T* kv_base = p.v_cache + int64_t{kv_head} * p.max_len * hd;
  // hd % W == 0 whenever W > 1, so a chunk never straddles two rows. Keys past the cache are
  // clamped to its last row: their weight is 0.
  for (int i = lane * W; i < kKeysPerSplit * hd; i += kWarpSize * W)
    copy_to_shared<T, W>(values + i, kv_base + int64_t{min(key0 + i / hd, p.max_len - 1)} * hd + i % hd);
  // Query rows are padded with zeros to whole key pieces, so the scoring loop needs no bound.
  const int q_stride = p.q_stride;
  for (int i = lane * W; i < rows * q_stride; i += kWarpSize * W) {
    const int r = i / q_stride, d = i % q_stride;
    if (d < hd) {
      copy_to_shared<T, W>(rows_q + i, p.q + head_row(r) * hd + d);
    } else {
#pragma unroll
      for (int e = 0; e < W; ++e) rows_q[i + e] = from_float<T>(0.0f);
    }
  }
  if constexpr (W > 1) __pipeline_commit();
  for (int r = 0; r < rows; ++r) weights[r * kWarpSize + lane] = 0.0f;

  const int key = key0 + lane;
  const T* key_row = key < p.max_len ? p.k_cache + (int64_t{kv_head} * p.max_len + key) * hd : nullptr;
  for (int d0 = 0; d0 < hd; d0 += kPieceDims) {
    Piece<T, W> k_piece[kPieceDims / W];
#pragma unroll
    for (int c = 0; c < kPieceDims / W; ++c)
      k_piece[c] = key_row && d0 + c * W < hd ? load_piece<T, W>(key_row + d0 + c * W, nullptr) : Piece<T, W>{};
    if (d0 == 0) {
      if constexpr (W > 1) __pipeline_wait_prior(0);
      __syncwarp();
    }
    for (int r = 0; r < rows; ++r) {
      const T* qr = rows_q + r * q_stride + d0;
      float s = weights[r * kWarpSize + lane];
#pragma unroll
      for (int c = 0; c < kPieceDims / W; ++c) {
        float kf[W];
        piece_floats(k_piece[c], kf);
#pragma unroll
        for (int e = 0; e < W; ++e) s = fmaf(to_float(qr[c * W + e]), kf[e], s);
      }
      weights[r * kWarpSize + lane] = s;
    }
  }

  const int64_t all_rows = int64_t{p.tokens} * p.num_heads;
  for (int r = 0; r < rows; ++r) {
    const int token = (row0 + r) / group;
    const bool visible = key <= last_visible_key(length, token, p.max_len);
    const float s = visible ? weights[r * kWarpSize + lane] * p.scale : -INFINITY;
    const float m = warp_max(s);
    const float e = visible ? expf(s - m) : 0.0f;
    const float sum = warp_sum(e);
    weights[r * kWarpSize + lane] = e;
    if (lane == 0) {
      p.partial_max[split * all_rows + head_row(r)] = m;
      p.partial_sum[split * all_rows + head_row(r)] = sum;
    }
  }
  __syncwarp();

  // Lane owns dimensions lane, lane + 32, ...: conflict-free reads of the staged values.
  constexpr int kDimsPerLane = kMaxHeadDim / kWarpSize;
  for (int r = 0; r < rows; ++r) {
    // The row's visible keys only: an invisible key weighs 0, but 0 times a NaN or an infinite
    // value left in the cache past them is NaN (found in session 67; test_decoder_ops.py checks it).
    const int64_t last_key = last_visible_key(length, (row0 + r) / group, p.max_len);
    const int visible_keys = last_key < key0 ? 0 : static_cast<int>(min(int64_t{kKeysPerSplit}, last_key - key0 + 1));
    float o[kDimsPerLane];
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) o[i] = 0.0f;
#pragma unroll 8
    for (int j = 0; j < visible_keys; ++j) {
      const float wj = weights[r * kWarpSize + j];
      const T* value_row = values + j * hd;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int d = lane + i * kWarpSize;
        if (d < hd) o[i] = fmaf(wj, to_float(value_row[d]), o[i]);
      }
    }
    float* out = p.partial_out + (split * all_rows + head_row(r)) * hd;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) {
      const int d = lane + i * kWarpSize;
      if (d < hd) out[d] = o[i];
    }
  }
}

constexpr int kMergeThreads = 128;
constexpr int kMergeUnroll = 32;

// Each of the merge's two shared arrays holds one float per split, rounded up to whole unrolled
// iterations: the unrolled loop may load ahead of the last split.
__host__ __device__ inline int merge_array_floats(int max_len) {
  return ceil_div(ceil_div(max_len, kKeysPerSplit), kMergeUnroll) * kMergeUnroll;
}

template <typename Op>
__device__ __forceinline__ float block_reduce(float x, Op op, float* scratch) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) x = op(x, __shfl_xor_sync(kFullMask, x, offset));
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  x = scratch[0];
  for (int i = 1; i < blockDim.x / kWarpSize; ++i) x = op(x, scratch[i]);
  __syncthreads();  // scratch is reused by the next reduction
  return x;
}

// One block per (token, head): the softmax merge of the splits that token sees. The splits'
// maxima and sums are read in one pass into shared memory, each split's weight exp(m_s - m) is
// computed once, then thread d sums its dimension over the splits with the loads unrolled.
template <typename T>
__global__ void __launch_bounds__(kMergeThreads) merge_attention_kernel(AttentionParams<T> p) {
  extern __shared__ float merge_smem[];  // [2][splits]
  __shared__ float scratch[kMergeThreads / kWarpSize];
  wait_for_previous_kernel();
  let_next_kernel_start();
  const int64_t row = blockIdx.x, all_rows = int64_t{p.tokens} * p.num_heads;
  const int token = static_cast<int>(row / p.num_heads);
  const int64_t last = last_visible_key(*p.length, token, p.max_len);
  T* out = p.out + row * p.head_dim;
  if (last < 0) {  // no visible key
    for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) out[d] = from_float<T>(NAN);
    return;
  }
  const int splits = static_cast<int>(last / kKeysPerSplit) + 1;
  float* split_weight = merge_smem;
  float* split_sum = merge_smem + merge_array_floats(p.max_len);
  float m = -INFINITY;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
    split_weight[s] = p.partial_max[s * all_rows + row];
    split_sum[s] = p.partial_sum[s * all_rows + row];
    m = fmaxf(m, split_weight[s]);
  }
  m = block_reduce(m, [](float a, float b) { return fmaxf(a, b); }, scratch);
  float total = 0.0f;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
    split_weight[s] = expf(split_weight[s] - m);
    total += split_weight[s] * split_sum[s];
  }
  total = block_reduce(total, [](float a, float b) { return a + b; }, scratch);
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float o = 0.0f;
#pragma unroll kMergeUnroll
    for (int s = 0; s < splits; ++s) o = fmaf(p.partial_out[(s * all_rows + row) * p.head_dim + d], split_weight[s], o);
    out[d] = from_float<T>(o / total);
  }
}

}  // namespace
}  // namespace detail

// ---- launchers --------------------------------------------------------------------------------

template <typename T>
cudaError_t launch_fused_linear(const T* x, const T* weight, const T* norm_weight, bool gated, float eps,
                                const T* residual, const T* bias, T* out, int tokens, int out_features,
                                int in_features, cudaStream_t stream, const LaunchOptions& options,
                                bool weight_before_wait) {
  using namespace detail;
  if (tokens > kFusedLinearMaxTokens) return cudaErrorInvalidValue;
  LinearParams<T> p{x, weight, norm_weight, residual, bias, out, tokens, out_features, in_features,
                    gated ? kSiluGate : (norm_weight ? kRmsNorm : kPlain), eps, 0, weight_before_wait};
  int tokens_per_block = 1;
  while (tokens_per_block < min(tokens, kLinearMaxTokens)) tokens_per_block *= 2;
  const int max_chunk = kLinearSmemBytes / (tokens_per_block * static_cast<int>(sizeof(float))) / 8 * 8;
  p.chunk = min(max_chunk, ceil_div(in_features, 8) * 8);
  const size_t smem = static_cast<size_t>(tokens_per_block) * p.chunk * sizeof(float);
  if (rows_vectorizable<T>(weight, in_features))
    return launch_linear_vec<T, kVecWidth<T>>(p, tokens_per_block, smem, stream, options.dependent_launch);
  return launch_linear_vec<T, 1>(p, tokens_per_block, smem, stream, options.dependent_launch);
}

template <typename T>
cudaError_t launch_rotary_cache_write(const T* qkv, const T* cos, const T* sin, const int64_t* length, const T* q_norm,
                                      const T* k_norm, float eps, T* k_cache, T* v_cache, T* q_out, int tokens,
                                      int num_heads, int num_kv_heads, int head_dim, int max_len, cudaStream_t stream,
                                      const LaunchOptions& options) {
  using namespace detail;
  if (int64_t{num_heads} + num_kv_heads > kRotaryMaxHeads) return cudaErrorInvalidValue;
  const RotaryParams<T> p{qkv, cos, sin, length, q_norm, k_norm, k_cache, v_cache, q_out,
                          num_heads, num_kv_heads, head_dim, max_len, eps};
  const dim3 grid(tokens, num_heads + num_kv_heads);
  const dim3 block(ceil_div(head_dim / 2, kWarpSize) * kWarpSize);
  return launch_kernel(rotary_cache_write_kernel<T>, grid, block, 0, stream, options.dependent_launch, p);
}

int64_t decode_attention_tiles(int tokens, int num_heads, int num_kv_heads, int head_dim, int element_bytes) {
  return detail::AttentionTiles(tokens, num_heads, num_kv_heads, head_dim, element_bytes).count();
}

size_t decode_attention_workspace_bytes(int tokens, int num_heads, int head_dim, int max_len) {
  detail::WorkspaceCarver carver(nullptr);
  const size_t rows = size_t{static_cast<unsigned>(tokens)} * num_heads;
  const size_t splits = detail::ceil_div(max_len, detail::kKeysPerSplit);
  carver.take<float>(splits * rows * head_dim);
  carver.take<float>(splits * rows);
  carver.take<float>(splits * rows);
  return carver.bytes();
}

template <typename T>
cudaError_t launch_decode_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* length, float scale,
                                    T* out, int tokens, int num_heads, int num_kv_heads, int head_dim, int max_len,
                                    void* workspace, cudaStream_t stream, const LaunchOptions& options) {
  using namespace detail;
  if (head_dim > kMaxHeadDim || num_kv_heads > kDecodeAttentionMaxGridYZ) return cudaErrorInvalidValue;
  const AttentionTiles tiles(tokens, num_heads, num_kv_heads, head_dim, static_cast<int>(sizeof(T)));
  if (tiles.count() > kDecodeAttentionMaxGridYZ) return cudaErrorInvalidValue;
  const size_t rows = size_t{static_cast<unsigned>(tokens)} * num_heads;
  const int splits = ceil_div(max_len, kKeysPerSplit);
  WorkspaceCarver carver(workspace);
  float* partial_out = carver.take<float>(size_t{static_cast<unsigned>(splits)} * rows * head_dim);
  float* partial_max = carver.take<float>(splits * rows);
  float* partial_sum = carver.take<float>(splits * rows);
  AttentionParams<T> p{q, k_cache, v_cache, length, partial_out, partial_max, partial_sum, out,
                       tokens, num_heads, num_kv_heads, head_dim, max_len, scale, 0, 0};
  p.q_stride = tiles.q_stride;
  p.rows_per_tile = tiles.rows_per_tile;
  const dim3 grid(splits, num_kv_heads, tiles.count());
  const size_t smem = tiles.smem_bytes();
  const bool vec = rows_vectorizable<T>(k_cache, head_dim) && rows_vectorizable<T>(v_cache, head_dim) &&
                   rows_vectorizable<T>(q, head_dim);
  cudaError_t err = vec ? launch_kernel(decode_attention_kernel<T, kVecWidth<T>>, grid, dim3(kWarpSize), smem, stream,
                                        options.dependent_launch, p)
                        : launch_kernel(decode_attention_kernel<T, 1>, grid, dim3(kWarpSize), smem, stream,
                                        options.dependent_launch, p);
  if (err != cudaSuccess) return err;
  const size_t merge_smem = 2 * merge_array_floats(max_len) * sizeof(float);
  return launch_kernel(merge_attention_kernel<T>, dim3(static_cast<unsigned>(rows)), dim3(kMergeThreads), merge_smem,
                       stream, options.dependent_launch, p);
}

#define FLASHHEAD_INSTANTIATE_DECODER_LAYER(T)                                                                      \
  template cudaError_t launch_fused_linear<T>(const T*, const T*, const T*, bool, float, const T*, const T*, T*, int,  \
                                              int, int, cudaStream_t, const LaunchOptions&, bool);                  \
  template cudaError_t launch_rotary_cache_write<T>(const T*, const T*, const T*, const int64_t*, const T*, const T*, \
                                                    float, T*, T*, T*, int, int, int, int, int, cudaStream_t,       \
                                                    const LaunchOptions&);                                          \
  template cudaError_t launch_decode_attention<T>(const T*, const T*, const T*, const int64_t*, float, T*, int, int, \
                                                  int, int, int, void*, cudaStream_t, const LaunchOptions&);
FLASHHEAD_INSTANTIATE_DECODER_LAYER(float)
FLASHHEAD_INSTANTIATE_DECODER_LAYER(__half)
FLASHHEAD_INSTANTIATE_DECODER_LAYER(__nv_bfloat16)
#undef FLASHHEAD_INSTANTIATE_DECODER_LAYER

}  // namespace flashhead
