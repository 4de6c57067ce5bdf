// One decoding step of one token through every layer of a Llama / Qwen3 decoder, as one
// persistent kernel.
//
// At one token a layer costs its weight bytes (30 MB for Qwen3-0.6B: about 7 us at HBM speed)
// plus the latency of its dependent stages. As separate kernels (decoder_layer.cu) every stage pays
// a launch, a ramp-up and a drain, about 2.5 us each and seven a layer. Here one resident block per
// SM runs every stage of every layer, with grid barriers between the stages, and each block's
// share of the weights streams through a ring of shared-memory stages filled by cp.async. Weights
// do not depend on the token, so the copies run ahead of the computation across stage boundaries
// and barriers: a barrier's latency hides under the weight stream instead of adding to it.
//
// A layer: qkv GEMV with its RMSNorm folded in | attention: q/k norms, rotary and the cache write,
// split over the cache (the last split of a KV head to finish merges them) | o GEMV + residual |
// gate_up GEMV with its RMSNorm and SiLU(gate) * up | down GEMV + residual. Values are rounded to T
// wherever fused_linear, rotary_cache_write and decode_attention round, so the step equals their
// composition up to the order of float32 sums.
#include <algorithm>

#include "kernels/common.cuh"

namespace flashhead {
namespace detail {
namespace {

constexpr int kStepThreads = 256;
constexpr int kStepWarps = kStepThreads / kWarpSize;
constexpr int kStageBytes = kDecoderStepStageBytes;
constexpr int kMaxStages = 8;
constexpr int kSplitMaxKeys = 512;  // keys of one attention work item: their scores sit in shared memory
constexpr int kSplitMinKeys = 32;
constexpr int kHeadDimPerLane = kDecoderStepMaxHeadDim / kWarpSize;

enum WeightPhase : int { kQkv = 0, kOut = 1, kGateUp = 2, kDown = 3, kPhases = 4 };

template <typename T>
struct StepParams {
  DecoderStepWeights<T> w;
  DecoderStepShape s;
  const T* x;
  T* out;  // the residual stream, updated in place from the second stage on
  T* k_cache;
  T* v_cache;
  const T* cos;
  const T* sin;
  const int64_t* length;
  T* qkv;                // [(H + 2 KV) hd]
  T* attn;               // [H hd]
  T* act;                // [I]: silu(gate) * up
  float* partial_out;    // [H][max_splits][hd]
  float* partial_stats;  // [H][max_splits][2]: max, sum
  unsigned* barrier;     // arrivals, counted up over the whole step
  unsigned* merged;      // [KV]: finished splits, counted up over the layers
  int stages, max_splits;
};

// A block's share of one weight phase: rows [row_lo, row_hi) of every layer's matrix (gate_up:
// units of two rows, gate i and up i), streamed rows_per_chunk at a time.
template <typename T>
struct PhasePlan {
  const T* weight;
  int64_t layer_stride;  // elements from one layer's matrix to the next
  int64_t second;        // gate_up: elements from gate row i to up row i
  int in_features, unit, row_lo, row_hi, rows_per_chunk, chunks;
};

template <typename T>
__device__ PhasePlan<T> phase_plan(const StepParams<T>& p, int phase) {
  const DecoderStepShape& s = p.s;
  PhasePlan<T> plan{};
  int rows = s.hidden;
  plan.unit = 1;
  if (phase == kQkv) {
    plan.weight = p.w.qkv;
    rows = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim;
    plan.in_features = s.hidden;
  } else if (phase == kOut) {
    plan.weight = p.w.o;
    plan.in_features = s.num_heads * s.head_dim;
  } else if (phase == kGateUp) {
    plan.weight = p.w.gate_up;
    rows = s.intermediate;
    plan.in_features = s.hidden;
    plan.unit = 2;
    plan.second = int64_t{s.intermediate} * s.hidden;
  } else {
    plan.weight = p.w.down;
    plan.in_features = s.intermediate;
  }
  plan.layer_stride = int64_t{rows} * plan.unit * plan.in_features;
  plan.row_lo = static_cast<int>(int64_t{blockIdx.x} * rows / gridDim.x);
  plan.row_hi = static_cast<int>(int64_t{blockIdx.x + 1} * rows / gridDim.x);
  plan.rows_per_chunk = kStageBytes / (plan.unit * plan.in_features * static_cast<int>(sizeof(T)));
  plan.chunks = ceil_div(plan.row_hi - plan.row_lo, plan.rows_per_chunk);
  return plan;
}

// cp.async with an explicit group count: the number of stages is a run-time value.
__device__ __forceinline__ void copy_async_16(void* dst, const void* src) {
  const unsigned dst_shared = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst_shared), "l"(src) : "memory");
}
__device__ __forceinline__ void commit_async() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void wait_async_except(int pending) {
  switch (pending) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
  }
}
static_assert(kMaxStages - 2 <= 6, "wait_async_except covers stages - 2 pending groups");

// Reads a value another block wrote during this kernel: from L2, never from a stale L1 line.
template <typename T>
__device__ __forceinline__ float load_shared_result(const T* p) {
  if constexpr (sizeof(T) == 2) {
    const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(p));
    T value;
    memcpy(&value, &bits, sizeof(value));
    return to_float(value);
  } else {
    return __ldcg(p);
  }
}

// Every block arrives once per barrier; the arrivals only count up during a step (the launch
// zeroes them), so barrier number n waits for n * gridDim.x arrivals.
__device__ __forceinline__ void grid_barrier(unsigned* arrivals, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(arrivals, 1u);
    unsigned seen = 0;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(arrivals) : "memory");
    } while (seen < target);
  }
  __syncthreads();
}

// The block's weight chunks in the order they are used (layer by layer, phase by phase), copied
// stages - 1 chunks ahead into a ring of stages. Every issue commits one cp.async group, empty
// past the end, so "chunk i has landed" is always "all but the newest stages - 2 groups are done".
template <typename T>
struct WeightStream {
  const PhasePlan<T>* plans;
  unsigned char* ring;
  int stages, per_layer, total, issued;

  __device__ void issue() {
    if (issued < total) {
      const int layer = issued / per_layer;
      int c = issued - layer * per_layer, phase = 0;
      while (c >= plans[phase].chunks) c -= plans[phase++].chunks;
      const PhasePlan<T>& pl = plans[phase];
      const int row0 = pl.row_lo + c * pl.rows_per_chunk;
      const int rows = min(pl.rows_per_chunk, pl.row_hi - row0);
      const int bytes = rows * pl.in_features * static_cast<int>(sizeof(T));
      const T* src = pl.weight + layer * pl.layer_stride + int64_t{row0} * pl.in_features;
      unsigned char* dst = ring + (issued % stages) * kStageBytes;
      for (int part = 0; part < pl.unit; ++part) {
        const unsigned char* from = reinterpret_cast<const unsigned char*>(src + part * pl.second);
        for (int off = threadIdx.x * 16; off < bytes; off += kStepThreads * 16)
          copy_async_16(dst + part * bytes + off, from + off);
      }
    }
    commit_async();
    ++issued;
  }

  // Chunk `index` once it has landed for the whole block; then the next copy goes into the stage
  // the previous chunk used (every warp is past it: the __syncthreads here).
  __device__ const T* acquire(int index) {
    wait_async_except(stages - 2);
    __syncthreads();
    issue();
    return reinterpret_cast<const T*>(ring + (index % stages) * kStageBytes);
  }
};

// The phase's input as float in shared memory: the RMSNorm weight folded in (y = inv_rms * (W .
// (x * g))), so the input is read once. Returns inv_rms (1 without a norm).
template <typename T>
__device__ float stage_input(const StepParams<T>& p, int layer, int phase, float* xs, float* reduce) {
  const DecoderStepShape& s = p.s;
  const T* src = p.act;
  const T* norm = nullptr;
  int k = s.intermediate;
  if (phase == kQkv || phase == kGateUp) {
    src = phase == kQkv && layer == 0 ? p.x : p.out;
    norm = (phase == kQkv ? p.w.attn_norm : p.w.mlp_norm) + int64_t{layer} * s.hidden;
    k = s.hidden;
  } else if (phase == kOut) {
    src = p.attn;
    k = s.num_heads * s.head_dim;
  }
  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < k; i += kStepThreads) {
    float v = load_shared_result(src + i);
    if (norm) {
      sum_sq = fmaf(v, v, sum_sq);
      v *= to_float(norm[i]);
    }
    xs[i] = v;
  }
  if (!norm) return 1.0f;
  sum_sq = warp_sum(sum_sq);
  if (threadIdx.x % kWarpSize == 0) reduce[threadIdx.x / kWarpSize] = sum_sq;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kStepWarps; ++i) total += reduce[i];
  return rsqrtf(total / static_cast<float>(k) + s.eps);
}

// A chunk's rows against the staged input, two rows per warp at a time (gate_up: the gate and the
// up row of one unit) so each load of the input serves two rows. finish(first, a, has_b, b) gets
// the sums of rows first and first + 1 (gate_up: unit first's gate and up), on lane 0.
template <typename T, typename Finish>
__device__ __forceinline__ void gemv_chunk(const T* chunk, const float* xs, int k, int unit, int rows, Finish&& finish) {
  constexpr int V = kVecWidth<T>;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int pairs = unit == 2 ? rows : ceil_div(rows, 2);
  for (int pair = warp; pair < pairs; pair += kStepWarps) {
    const int first = unit == 2 ? pair : 2 * pair;
    const bool has_b = unit == 2 || first + 1 < rows;
    const T* a = chunk + first * k;
    const T* b = unit == 2 ? chunk + (rows + pair) * k : (has_b ? a + k : a);
    float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll 2
    for (int v = lane; v < k / V; v += kWarpSize) {
      const Chunk<T, V> wa = *reinterpret_cast<const Chunk<T, V>*>(a + v * V);
      const Chunk<T, V> wb = *reinterpret_cast<const Chunk<T, V>*>(b + v * V);
#pragma unroll
      for (int e = 0; e < V; e += 4) {
        const float4 x4 = *reinterpret_cast<const float4*>(xs + v * V + e);
        const float xe[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          sum_a = fmaf(to_float(wa.v[e + i]), xe[i], sum_a);
          sum_b = fmaf(to_float(wb.v[e + i]), xe[i], sum_b);
        }
      }
    }
    sum_a = warp_sum(sum_a);
    sum_b = warp_sum(sum_b);
    if (lane == 0) finish(first, sum_a, has_b, sum_b);
  }
}

// The attention of one layer. Work items are (KV head, split of the keys 0..pos); each gets the
// group's queries and the new key ready (RMSNorm, rotary: rotary_cache_write's arithmetic), scores
// its keys (warp per key), and leaves a softmax partial; the last split of a KV head to finish
// merges them (decode_attention's merge) into attn.
template <typename T>
__device__ void attention(const StepParams<T>& p, int layer, float* scratch, int* merge_here) {
  const DecoderStepShape& s = p.s;
  const int hd = s.head_dim, half = hd / 2, kv_heads = s.num_kv_heads, group = s.num_heads / kv_heads;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t pos = *p.length;
  if (pos < 0 || pos >= s.max_len) {  // outside the cache: nothing is written, the step's result is NaN
    if (blockIdx.x == 0)
      for (int i = threadIdx.x; i < s.num_heads * hd; i += kStepThreads) p.attn[i] = from_float<T>(NAN);
    return;
  }
  const int keys = static_cast<int>(pos) + 1;
  // Enough items to fill the grid, each at least kSplitMinKeys keys and at most kSplitMaxKeys.
  const int splits = max(ceil_div(keys, kSplitMaxKeys),
                         min(ceil_div(keys, kSplitMinKeys), max(1, static_cast<int>(gridDim.x) / kv_heads)));
  float* q_rows = scratch;                     // [group][hd]
  float* k_new = q_rows + group * hd;          // [hd]
  float* v_new = k_new + hd;                   // [hd]
  float* scores = v_new + hd;                  // [group][kSplitMaxKeys]
  float* stats = scores + group * kSplitMaxKeys;  // [group][2]
  const T* cos = p.cos + pos * hd;
  const T* sin = p.sin + pos * hd;
  const int64_t layer_cache = int64_t{kv_heads} * s.max_len * hd;

  for (int item = blockIdx.x; item < kv_heads * splits; item += gridDim.x) {
    const int kv = item / splits, split = item % splits;
    const int key0 = static_cast<int>(int64_t{split} * keys / splits);
    const int key1 = static_cast<int>(int64_t{split + 1} * keys / splits);
    __syncthreads();  // the previous item is done with the scratch

    for (int vec = warp; vec <= group; vec += kStepWarps) {  // vec == group: the new key
      const bool is_key = vec == group;
      const int head = is_key ? s.num_heads + kv : kv * group + vec;
      const T* src = p.qkv + int64_t{head} * hd;
      const T* norm = is_key ? p.w.k_norm : p.w.q_norm;
      float lo[kHeadDimPerLane / 2], hi[kHeadDimPerLane / 2];
      float sum_sq = 0.0f;
#pragma unroll
      for (int i = 0; i < kHeadDimPerLane / 2; ++i) {
        const int t = lane + i * kWarpSize;
        lo[i] = t < half ? load_shared_result(src + t) : 0.0f;
        hi[i] = t < half ? load_shared_result(src + t + half) : 0.0f;
        sum_sq += lo[i] * lo[i] + hi[i] * hi[i];
      }
      const float inv_rms = norm ? rsqrtf(warp_sum(sum_sq) / static_cast<float>(hd) + s.eps) : 1.0f;
      float* dst = is_key ? k_new : q_rows + vec * hd;
#pragma unroll
      for (int i = 0; i < kHeadDimPerLane / 2; ++i) {
        const int t = lane + i * kWarpSize;
        if (t >= half) continue;
        float l = lo[i], h = hi[i];
        if (norm) {
          l = rounded<T>(l * inv_rms * to_float(norm[int64_t{layer} * hd + t]));
          h = rounded<T>(h * inv_rms * to_float(norm[int64_t{layer} * hd + t + half]));
        }
        dst[t] = rounded<T>(rounded<T>(l * to_float(cos[t])) - h * to_float(sin[t]));
        dst[t + half] = rounded<T>(rounded<T>(h * to_float(cos[t + half])) + l * to_float(sin[t + half]));
        if (is_key) {
          const T* v_src = p.qkv + int64_t{s.num_heads + kv_heads + kv} * hd;
          v_new[t] = load_shared_result(v_src + t);
          v_new[t + half] = load_shared_result(v_src + t + half);
        }
      }
    }
    __syncthreads();

    T* k_cache = p.k_cache + layer * layer_cache + int64_t{kv} * s.max_len * hd;
    T* v_cache = p.v_cache + layer * layer_cache + int64_t{kv} * s.max_len * hd;
    if (key1 == keys) {  // the split holding the new token stores it
      for (int d = threadIdx.x; d < hd; d += kStepThreads) {
        k_cache[pos * hd + d] = from_float<T>(k_new[d]);
        v_cache[pos * hd + d] = from_float<T>(v_new[d]);
      }
    }
    const int n = key1 - key0;
    for (int j = warp; j < n; j += kStepWarps) {
      const int key = key0 + j;
      float k_reg[kHeadDimPerLane];
#pragma unroll
      for (int i = 0; i < kHeadDimPerLane; ++i) {
        const int d = lane + i * kWarpSize;
        k_reg[i] = d >= hd ? 0.0f : key == pos ? k_new[d] : to_float(k_cache[int64_t{key} * hd + d]);
      }
      for (int h = 0; h < group; ++h) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < kHeadDimPerLane; ++i) {
          const int d = lane + i * kWarpSize;
          if (d < hd) dot = fmaf(q_rows[h * hd + d], k_reg[i], dot);
        }
        dot = warp_sum(dot);
        if (lane == 0) scores[h * kSplitMaxKeys + j] = dot * s.scale;
      }
    }
    __syncthreads();
    for (int h = warp; h < group; h += kStepWarps) {
      float* row = scores + h * kSplitMaxKeys;
      float m = -INFINITY;
      for (int j = lane; j < n; j += kWarpSize) m = fmaxf(m, row[j]);
      m = warp_max(m);
      float sum = 0.0f;
      for (int j = lane; j < n; j += kWarpSize) {
        const float e = expf(row[j] - m);
        row[j] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      if (lane == 0) stats[2 * h] = m, stats[2 * h + 1] = sum;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < group * hd; idx += kStepThreads) {
      const int h = idx / hd, d = idx % hd;
      const float* weights = scores + h * kSplitMaxKeys;
      float o = 0.0f;
#pragma unroll 4
      for (int j = 0; j < n; ++j) {
        const int key = key0 + j;
        o = fmaf(weights[j], key == pos ? v_new[d] : to_float(v_cache[int64_t{key} * hd + d]), o);
      }
      const int64_t at = int64_t{kv * group + h} * p.max_splits + split;
      p.partial_out[at * hd + d] = o;
      if (d == 0) p.partial_stats[2 * at] = stats[2 * h], p.partial_stats[2 * at + 1] = stats[2 * h + 1];
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *merge_here = atomicAdd(p.merged + kv, 1u) + 1 == static_cast<unsigned>(layer + 1) * splits;
    __syncthreads();
    if (!*merge_here) continue;
    __threadfence();
    for (int idx = threadIdx.x; idx < group * hd; idx += kStepThreads) {
      const int h = idx / hd, d = idx % hd;
      const int64_t row = int64_t{kv * group + h} * p.max_splits;
      float m = -INFINITY;
      for (int sp = 0; sp < splits; ++sp) m = fmaxf(m, __ldcg(p.partial_stats + 2 * (row + sp)));
      float total = 0.0f, o = 0.0f;
      for (int sp = 0; sp < splits; ++sp) {
        const float weight = expf(__ldcg(p.partial_stats + 2 * (row + sp)) - m);
        total = fmaf(weight, __ldcg(p.partial_stats + 2 * (row + sp) + 1), total);
        o = fmaf(__ldcg(p.partial_out + (row + sp) * hd + d), weight, o);
      }
      p.attn[int64_t{kv * group + h} * hd + d] = from_float<T>(o / total);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kStepThreads, 1) decoder_step_kernel(StepParams<T> p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  float* scratch = reinterpret_cast<float*>(smem_raw + size_t{static_cast<unsigned>(p.stages)} * kStageBytes);
  __shared__ PhasePlan<T> plans[kPhases];
  __shared__ float reduce[kStepWarps];
  __shared__ int merge_here;
  if (threadIdx.x < kPhases) plans[threadIdx.x] = phase_plan(p, threadIdx.x);
  __syncthreads();

  int per_layer = 0;
#pragma unroll
  for (int phase = 0; phase < kPhases; ++phase) per_layer += plans[phase].chunks;
  WeightStream<T> stream{plans, smem_raw, p.stages, per_layer, per_layer * p.s.layers, 0};
  for (int i = 0; i < p.stages - 1; ++i) stream.issue();

  int consumed = 0;
  unsigned barriers = 0;
  for (int layer = 0; layer < p.s.layers; ++layer) {
    for (int phase = 0; phase < kPhases; ++phase) {
      if (phase == kOut) {
        attention(p, layer, scratch, &merge_here);
        grid_barrier(p.barrier, ++barriers * gridDim.x);
      }
      const PhasePlan<T>& pl = plans[phase];
      const float inv_rms = pl.chunks > 0 ? stage_input(p, layer, phase, scratch, reduce) : 1.0f;
      for (int c = 0; c < pl.chunks; ++c) {
        const T* chunk = stream.acquire(consumed++);
        const int row0 = pl.row_lo + c * pl.rows_per_chunk;
        const int rows = min(pl.rows_per_chunk, pl.row_hi - row0);
        gemv_chunk(chunk, scratch, pl.in_features, pl.unit, rows, [&](int first, float a, bool has_b, float b) {
          if (phase == kGateUp) {
            const float gate = rounded<T>(a * inv_rms), up = rounded<T>(b * inv_rms);
            p.act[row0 + first] = from_float<T>(rounded<T>(gate / (1.0f + expf(-gate))) * up);
            return;
          }
          for (int r = 0; r < (has_b ? 2 : 1); ++r) {
            const int row = row0 + first + r;
            const float sum = r == 0 ? a : b;
            if (phase == kQkv) {
              p.qkv[row] = from_float<T>(sum * inv_rms);
            } else {  // o and down: + the residual stream (the input token's row in the first layer)
              const T* residual = phase == kOut && layer == 0 ? p.x : p.out;
              p.out[row] = from_float<T>(rounded<T>(sum) + load_shared_result(residual + row));
            }
          }
        });
      }
      if (layer + 1 < p.s.layers || phase != kDown) grid_barrier(p.barrier, ++barriers * gridDim.x);
    }
  }
  wait_async_except(0);  // the trailing empty groups
}

}  // namespace
}  // namespace detail

template <typename T>
cudaError_t plan_decoder_step(const DecoderStepShape& s, DecoderStepPlan* plan) {
  using namespace detail;
  const auto kernel = decoder_step_kernel<T>;
  int device = 0, sms = 0, max_smem = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device); err != cudaSuccess)
    return err;
  if (cudaError_t err = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
      err != cudaSuccess)
    return err;
  cudaFuncAttributes attributes{};
  if (cudaError_t err = cudaFuncGetAttributes(&attributes, kernel); err != cudaSuccess) return err;
  const int group = s.num_heads / s.num_kv_heads;
  const size_t input_floats = std::max({s.hidden, s.num_heads * s.head_dim, s.intermediate});
  const size_t attention_floats =
      size_t{static_cast<unsigned>(group)} * (s.head_dim + kSplitMaxKeys + 2) + 2 * size_t{static_cast<unsigned>(s.head_dim)};
  const size_t scratch_bytes = (std::max(input_floats, attention_floats) * sizeof(float) + 127) / 128 * 128;
  const long long room = static_cast<long long>(max_smem) - static_cast<long long>(attributes.sharedSizeBytes) -
                         static_cast<long long>(scratch_bytes);
  plan->stages = static_cast<int>(std::min<long long>(kMaxStages, room / kStageBytes));
  if (plan->stages < 2) return cudaErrorInvalidValue;
  plan->smem_bytes = size_t{static_cast<unsigned>(plan->stages)} * kStageBytes + scratch_bytes;
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(plan->smem_bytes));
      err != cudaSuccess)
    return err;
  int per_sm = 0;
  if (cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kStepThreads, plan->smem_bytes);
      err != cudaSuccess)
    return err;
  if (per_sm < 1) return cudaErrorInvalidValue;
  plan->grid = sms * per_sm;
  plan->max_splits = std::max(ceil_div(s.max_len, kSplitMaxKeys), std::max(1, plan->grid / s.num_kv_heads));
  WorkspaceCarver carver(nullptr);
  const size_t heads = static_cast<size_t>(s.num_heads), splits = static_cast<size_t>(plan->max_splits);
  carver.take<T>(size_t{static_cast<unsigned>(s.num_heads + 2 * s.num_kv_heads)} * s.head_dim);
  carver.take<T>(heads * s.head_dim);
  carver.take<T>(static_cast<size_t>(s.intermediate));
  carver.take<float>(heads * splits * s.head_dim);
  carver.take<float>(heads * splits * 2);
  carver.take<unsigned>(1 + static_cast<size_t>(s.num_kv_heads));
  plan->workspace_bytes = carver.bytes();
  return cudaSuccess;
}

template <typename T>
cudaError_t launch_decoder_step(const T* x, const DecoderStepWeights<T>& weights, T* k_cache, T* v_cache, const T* cos,
                                const T* sin, const int64_t* length, const DecoderStepShape& s,
                                const DecoderStepPlan& plan, T* out, void* workspace, cudaStream_t stream) {
  using namespace detail;
  WorkspaceCarver carver(workspace);
  const size_t heads = static_cast<size_t>(s.num_heads), splits = static_cast<size_t>(plan.max_splits);
  StepParams<T> p{};
  p.w = weights;
  p.s = s;
  p.x = x;
  p.out = out;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.cos = cos;
  p.sin = sin;
  p.length = length;
  p.qkv = carver.take<T>(size_t{static_cast<unsigned>(s.num_heads + 2 * s.num_kv_heads)} * s.head_dim);
  p.attn = carver.take<T>(heads * s.head_dim);
  p.act = carver.take<T>(static_cast<size_t>(s.intermediate));
  p.partial_out = carver.take<float>(heads * splits * s.head_dim);
  p.partial_stats = carver.take<float>(heads * splits * 2);
  unsigned* counters = carver.take<unsigned>(1 + static_cast<size_t>(s.num_kv_heads));
  p.barrier = counters;
  p.merged = counters + 1;
  p.stages = plan.stages;
  p.max_splits = plan.max_splits;
  if (cudaError_t err = cudaMemsetAsync(counters, 0, (1 + size_t{static_cast<unsigned>(s.num_kv_heads)}) * sizeof(unsigned),
                                        stream);
      err != cudaSuccess)
    return err;
  // Cooperative: the launch fails instead of deadlocking if the grid cannot be resident at once.
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(plan.grid);
  config.blockDim = dim3(kStepThreads);
  config.dynamicSmemBytes = plan.smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeCooperative;
  attribute[0].val.cooperative = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, decoder_step_kernel<T>, p);
}

#define FLASHHEAD_INSTANTIATE_DECODER_STEP(T)                                                                   \
  template cudaError_t plan_decoder_step<T>(const DecoderStepShape&, DecoderStepPlan*);                         \
  template cudaError_t launch_decoder_step<T>(const T*, const DecoderStepWeights<T>&, T*, T*, const T*, const T*, \
                                              const int64_t*, const DecoderStepShape&, const DecoderStepPlan&, T*, \
                                              void*, cudaStream_t);
FLASHHEAD_INSTANTIATE_DECODER_STEP(float)
FLASHHEAD_INSTANTIATE_DECODER_STEP(__half)
FLASHHEAD_INSTANTIATE_DECODER_STEP(__nv_bfloat16)
#undef FLASHHEAD_INSTANTIATE_DECODER_STEP

}  // namespace flashhead
