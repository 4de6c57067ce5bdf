// One decoding step of one token through every layer of a Llama / Qwen2 / Qwen3 / Gemma-2 / Gemma-3 decoder,
// as one persistent kernel.
//
// At one token a layer costs its weight bytes (30 MB for Qwen3-0.6B: about 7 us at HBM speed)
// plus the latency of its dependent stages. As separate kernels (decoder_layer.cu) every stage pays
// a launch, a ramp-up and a drain, about 2.5 us each and seven a layer. Here one resident block per
// SM runs every stage of every layer, and each block's share of the weights streams through a ring
// of shared-memory stages filled by bulk copies (TMA; cp.async before sm_90). Weights do not
// depend on the token, so the copies run ahead of the computation across stage boundaries, and a
// phase's first chunk is read into registers while the block waits for the phase's input. A
// stage's results go to the next as posted values (post / await_posts): each carries the number of
// the stage that wrote it, so a block waits for exactly the values it reads, and their arrival is
// the signal, with no grid barrier between the stages.
//
// A layer: qkv GEMV with its RMSNorm folded in | attention: q/k norms, rotary and the cache write,
// split over the cache (a head's last splits merge its partials) | o GEMV + residual |
// gate_up GEMV with its RMSNorm and SiLU(gate) * up | down GEMV + residual. Values are rounded to T
// wherever fused_linear, rotary_cache_write and decode_attention round, so the step equals their
// composition up to the order of float32 sums.
//
// Gemma-3's layer: GELU (tanh) instead of SiLU; sliding-window layers attend to their last keys and
// rotate by their own tables; and an RMSNorm of the attention's and the MLP's outputs before each
// residual add (post-norms). Such a norm needs the whole output row, which no block has until the
// next stage reads it anyway: so with post-norms o and down post their outputs, and every block
// keeps the whole residual stream and adds each normed output as it stages the next input, with no
// stage more than the Llama layer's. Gemma-2's layer is Gemma-3's without q/k norms and with every
// attention score capped (attn_softcap). These options are compiled into a kernel of their own
// (Extended): in the Llama layer's their branches made Qwen3-0.6B's step 6% slower.
#include <algorithm>

#include "kernels/bulk_copy.cuh"
#include "kernels/common.cuh"

namespace flashhead {
namespace detail {
namespace {

constexpr int kStepThreads = 256;
constexpr int kStepWarps = kStepThreads / kWarpSize;
constexpr int kMaxStages = 8;
constexpr int kSplitMaxKeys = 512;  // keys of one attention work item: their scores sit in shared memory
constexpr int kSplitMinKeys = 32;
// The attention keeps a group's queries (dot products, accumulators) and a lane's share of a head
// in registers, sized for the largest geometry the kernel serves. One kernel per class of head
// geometry (the plan picks the smallest that fits) spares small models the largest one's code and
// registers: Qwen3-0.6B's step was 5.6% faster on its own class.
template <int MaxGroup, int MaxHeadDim>
struct HeadClass {
  static constexpr int kMaxGroup = MaxGroup;  // query heads per KV head
  static constexpr int kMaxHeadDim = MaxHeadDim;
  static constexpr int kHeadDimPerLane = MaxHeadDim / kWarpSize;
};
using SmallHeads = HeadClass<2, 128>;
using MidHeads = HeadClass<4, 128>;
// Many query heads on few KV heads (Qwen2.5-0.5B: 7 of 64, Qwen2.5-1.5B: 6 of 128), and few heads
// of 256 (the Gemma-3-270M dims): bodies 13%, 5% and 9% shorter than on AnyHeads.
using WideHeads = HeadClass<kDecoderStepMaxGroup, 64>;
using LargeHeads = HeadClass<kDecoderStepMaxGroup, 128>;
using DeepHeads = HeadClass<4, kDecoderStepMaxHeadDim>;
using AnyHeads = HeadClass<kDecoderStepMaxGroup, kDecoderStepMaxHeadDim>;
// A GEMV chunk is read from its stage into registers, a tile a warp, while the block waits for the
// phase's input, so what is left once the input arrives is its loads, the FMAs and the sums (for
// qkv, under half the cycles of a GEMV reading its weights from shared memory). A warp holds
// kTileRows rows of kTileVectors 16-byte vectors a lane: 64 registers.
constexpr int kTileRows = 4;
constexpr int kTileVectors = 4;
constexpr int kTilePieceVectors = kWarpSize * kTileVectors;  // a slice's vectors a tile holds
constexpr int kThreadsPerKey = 4;                 // threads that score one key together
constexpr int kValueKeys = 4;                     // keys whose values a warp loads at once
constexpr int kMergeSplits = 16;                  // splits whose partials a thread loads at once

enum WeightPhase : int { kQkv = 0, kOut = 1, kGateUp = 2, kDown = 3, kPhases = 4 };
// A layer's stages in order: the weight phases with the attention after qkv.
enum Stage : int { kQkvStage = 0, kAttentionStage = 1, kStages = 5 };
__device__ __forceinline__ int stage_of(int phase) { return phase == kQkv ? kQkvStage : phase + kAttentionStage; }
// The number that a stage's posted values carry, counted over the step: the token's row is post 1,
// and every stage reads the post numbered one less than its own (qkv reads the previous down's).
__device__ __forceinline__ unsigned post_number(int layer, int stage) {
  return static_cast<unsigned>(layer) * kStages + stage + 2;
}

template <typename T>
struct StepParams {
  DecoderStepWeights<T> w;
  DecoderStepShape s;
  const T* x;
  T* out;  // the residual stream after the last layer
  T* k_cache;
  T* v_cache;
  const T* cos;
  const T* sin;
  const int64_t* length;
  // Posted values (see post), zeroed by the launch.
  uint64_t* hidden;      // [D]: the residual stream (the token's row, then after each o and down);
                         // with post-norms o's and down's outputs instead
  uint64_t* qkv;         // [(H + 2 KV) hd]
  uint64_t* attn;        // [H hd]
  uint64_t* act;         // [I]: act(gate) * up
  uint64_t* partial_out;    // [H][max_splits][hd]
  uint64_t* partial_stats;  // [H][max_splits][2]: max, sum
  int stages, stage_bytes, max_splits;
};

// A block's share of one weight phase: rows [row_lo, row_hi) of every layer's matrix (gate_up:
// units of two rows, gate i and up i), streamed rows_per_chunk at a time. A chunk's tile rows
// (its rows, then gate_up's up rows) are split over `slices` parts of the input, one a warp group
// (WeightTile), each part read in `pieces` tiles.
template <typename T>
struct PhasePlan {
  const T* weight;
  int64_t layer_stride;  // elements from one layer's matrix to the next
  int64_t second;        // gate_up: elements from gate row i to up row i
  int in_features, unit, row_lo, row_hi, rows_per_chunk, chunks;
  int slices, slice_shift, slice_vectors, pieces;

  // Units of the block's chunk that starts at row0.
  __device__ __forceinline__ int chunk_rows(int row0) const { return min(rows_per_chunk, row_hi - row0); }
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
  // A chunk fills a stage, up to what the warps' tiles hold.
  plan.rows_per_chunk = min(p.stage_bytes / (plan.unit * plan.in_features * static_cast<int>(sizeof(T))),
                            kTileRows * kStepWarps / plan.unit);
  plan.chunks = ceil_div(plan.row_hi - plan.row_lo, plan.rows_per_chunk);
  // The most slices whose warp groups still hold a chunk's tile rows: a warp then reads the fewest
  // input values (few rows a block would leave each warp one row of the whole input to read).
  const int tile_rows = plan.unit * plan.chunk_rows(plan.row_lo);
  plan.slice_shift = 3;
  static_assert(kStepWarps == 1 << 3, "slices are powers of two up to the warps");
  while (plan.slice_shift > 0 && (kStepWarps >> plan.slice_shift) * kTileRows < tile_rows) --plan.slice_shift;
  plan.slices = 1 << plan.slice_shift;
  plan.slice_vectors = ceil_div(plan.in_features / kVecWidth<T>, plan.slices);
  plan.pieces = ceil_div(plan.slice_vectors, kTilePieceVectors);
  return plan;
}

// Copies into shared memory that the block waits for. On sm_90 a weight chunk (or an attention
// split's keys and values) is one bulk copy per piece, moved by the copy engine (TMA) and counted
// on an mbarrier, issued by one thread. Before sm_90 every thread issues 16-byte cp.async into
// commit groups.
#ifdef FLASHHEAD_BULK_COPIES
// The issuing thread is in the last warp: the GEMVs deal rows to warps from the first, so that
// warp has the fewest, and the issue's instructions delay it least.
constexpr int kBulkThread = kStepThreads - 1;
// Streamed bytes are marked first to leave L2: they pass through once a step, and what they would
// evict (norms, activations, the kernel's code and parameters) is then read from L2, not HBM
// (Qwen3-0.6B's step 2.4% faster).
__device__ __forceinline__ void copy_bulk(void* dst, const void* src, int bytes, uint64_t* barrier) {
  uint64_t evict_first;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(evict_first));
  detail::copy_bulk(dst, src, bytes, barrier, evict_first);
}
#else
// cp.async with an explicit group count: the number of stages is a run-time value.
__device__ __forceinline__ void copy_async_16(void* dst, const void* src) {
  const unsigned dst_shared = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst_shared), "l"(src) : "memory");
}
// bytes (whole 16-byte vectors) from global src to shared dst, spread over threads 0..threads-1.
__device__ __forceinline__ void copy_async(void* dst, const void* src, int bytes, int threads) {
  for (int off = threadIdx.x * 16; off < bytes; off += threads * 16)
    copy_async_16(static_cast<unsigned char*>(dst) + off, static_cast<const unsigned char*>(src) + off);
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

#endif

// A value handed from one block to others within the step: one 64-bit word, the float's bits low
// and the post number of the stage that wrote it high, stored and loaded whole (single-copy atomic).
// A reader loads the words it needs and spins on those without the number it expects, so the
// value's arrival is its own signal: no fence, arrival count or grid barrier between the stages.
// Readers of a post are done before its words are written again, stages later: o waits for every
// head's attention and each other GEMV for every block's results, which each block posts only
// after its own reads, so no block writes a word again before all its readers are past it. Post 0
// is never written (the launch zeroes the words), and post numbers grow over the step, so no stale
// word matches.
__device__ __forceinline__ void post(uint64_t* word, float value, unsigned number) {
  store_relaxed(word, (uint64_t{number} << 32) | __float_as_uint(value));
}
__device__ __forceinline__ uint64_t load_post(const uint64_t* word) { return load_relaxed(word); }
__device__ __forceinline__ bool has_post(uint64_t bits, unsigned number) {
  return static_cast<unsigned>(bits >> 32) == number;
}
__device__ __forceinline__ float posted_value(uint64_t bits) { return __uint_as_float(static_cast<unsigned>(bits)); }
// Waits until every one of N loaded words carries post `number`, reloading those without it
// together (word(j) is the j-th's address), so the values that arrive late cost one more round
// trip, not one each.
template <int N, typename Word>
__device__ __forceinline__ void await_posts(uint64_t (&bits)[N], unsigned number, Word&& word) {
  for (;;) {
    bool all = true;
#pragma unroll
    for (int j = 0; j < N; ++j) all = all && has_post(bits[j], number);
    if (all) return;
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (!has_post(bits[j], number)) bits[j] = load_post(word(j));
  }
}
// Loads the N words (all in flight together), then waits as await_posts.
template <int N, typename Word>
__device__ __forceinline__ void load_posts(uint64_t (&bits)[N], unsigned number, Word&& word) {
#pragma unroll
  for (int j = 0; j < N; ++j) bits[j] = load_post(word(j));
  await_posts(bits, number, word);
}

// Makes the loads of v complete here: the compiler sinks a load to its first use, which would put
// loads issued beside polled ones after the polls, a round trip more once the polled values arrive.
template <int N>
__device__ __forceinline__ void hold_values(float (&v)[N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) asm volatile("" : "+f"(v[j])::"memory");
}

// The block's weight chunks in the order they are used (layer by layer, phase by phase), copied
// stages - 1 chunks ahead into a ring of stages. Both ends keep counted-up positions: a division
// by a run-time count is a chain of ~30 dependent instructions, and the thread that issues holds
// its warp (the phase's last) back by every instruction it runs between __syncthreads and copy.
// On sm_90 the chunk in a stage lands on that stage's barrier, in the phase numbered by how often
// the stage was filled before. Before sm_90 every issue commits one cp.async group, empty past the
// end, so "the chunk acquired next has landed" is always "all but the newest stages - 2 groups are
// done".
template <typename T>
struct WeightStream {
  const PhasePlan<T>* plans;
  unsigned char* ring;
  uint64_t* landed;  // [stages] mbarriers (sm_90)
  int stages, stage_bytes, layers;
  int issue_layer, issue_phase, issue_chunk, issue_stage;  // the next chunk to copy
  int acquire_stage;                                      // the next chunk to use
  unsigned acquire_fills;                                 // fills of its stage before it

  __device__ WeightStream(const PhasePlan<T>* plans, unsigned char* ring, uint64_t* landed, int stages, int stage_bytes,
                          int layers, int chunks_per_layer)
      : plans(plans), ring(ring), landed(landed), stages(stages), stage_bytes(stage_bytes),
        layers(chunks_per_layer > 0 ? layers : 0), issue_layer(0), issue_phase(0), issue_chunk(-1), issue_stage(0),
        acquire_stage(0), acquire_fills(0) {
    if (this->layers > 0) next_chunk();
  }

  // Steps the issue position to the next chunk, past phases in which the block has no rows.
  __device__ void next_chunk() {
    while (++issue_chunk >= plans[issue_phase].chunks) {
      issue_chunk = -1;
      if (++issue_phase == kPhases) issue_phase = 0, ++issue_layer;
    }
  }

  __device__ void issue() {
#ifdef FLASHHEAD_BULK_COPIES
    const bool copies = threadIdx.x == kBulkThread;  // one thread issues the bulk copies
#else
    const bool copies = true;  // every thread issues its share of 16-byte copies
#endif
    if (issue_layer < layers) {
      if (copies) {
        const PhasePlan<T>& pl = plans[issue_phase];
        const int row0 = pl.row_lo + issue_chunk * pl.rows_per_chunk;
        const int rows = pl.chunk_rows(row0);
        const int bytes = rows * pl.in_features * static_cast<int>(sizeof(T));
        const T* src = pl.weight + issue_layer * pl.layer_stride + int64_t{row0} * pl.in_features;
        unsigned char* dst = ring + issue_stage * stage_bytes;
#ifdef FLASHHEAD_BULK_COPIES
        uint64_t* barrier = landed + issue_stage;
        mbarrier_expect_bytes(barrier, pl.unit * bytes);
        for (int part = 0; part < pl.unit; ++part) copy_bulk(dst + part * bytes, src + part * pl.second, bytes, barrier);
#else
        for (int part = 0; part < pl.unit; ++part)
          copy_async(dst + part * bytes, src + part * pl.second, bytes, kStepThreads);
#endif
      }
      next_chunk();
      if (++issue_stage == stages) issue_stage = 0;
    }
#ifndef FLASHHEAD_BULK_COPIES
    commit_async();
#endif
  }

  // The stage of the chunk acquired last: free until the next issue refills it.
  __device__ unsigned char* last_stage() const {
    return ring + (acquire_stage == 0 ? stages - 1 : acquire_stage - 1) * stage_bytes;
  }

  // The next chunk, once it has landed for the whole block. The caller issues the copy that refills
  // the previous chunk's stage (issue), once every warp is done with that chunk.
  __device__ const T* wait_next() {
    const int stage = acquire_stage;
#ifdef FLASHHEAD_BULK_COPIES
    mbarrier_wait(landed + stage, acquire_fills);
#else
    wait_async_except(stages - 2);
    __syncthreads();  // every thread's copies are visible to the block
#endif
    if (++acquire_stage == stages) acquire_stage = 0, ++acquire_fills;
    return reinterpret_cast<const T*>(ring + stage * stage_bytes);
  }

  // wait_next, and the refill of the previous chunk's stage.
  __device__ const T* acquire() {
#ifdef FLASHHEAD_BULK_COPIES
    __syncthreads();
    issue();
    return wait_next();
#else
    const T* chunk = wait_next();  // first: the pending groups it counts are the ones before the refill's
    issue();
    return chunk;
#endif
  }
};

// The sum over the block of every thread's v. reduce: kStepWarps floats, not read again before the
// block's next barrier.
__device__ __forceinline__ float block_sum(float v, float* reduce) {
  v = warp_sum(v);
  if (threadIdx.x % kWarpSize == 0) reduce[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < kStepWarps; ++i) total += reduce[i];
  return total;
}

// k posted values (post `number`) into xs as float, each times its gain (none: 1); with
// `sum_squares`, returns the thread's sum of squares of the values before the gain (else 0). Thread
// t stages the values t + 256 j.
template <typename T>
__device__ float load_posted(const uint64_t* src, int k, unsigned number, const T* gain_weights, bool sum_squares,
                             float* xs) {
  float sum_sq = 0.0f;
  // Up to kInputWords words a thread in flight at once: k <= kInputWords * kStepThreads is one round
  // trip once posted. Words past k count as posted. One 8-byte load a word: 16-byte loads of word
  // pairs made a hand-off between all blocks 0.1-0.9 us slower (measured apart from the step).
  constexpr int kInputWords = 16;
  for (int base = 0; base < k; base += kInputWords * kStepThreads) {
    const auto word_index = [&](int j) { return base + j * kStepThreads + static_cast<int>(threadIdx.x); };
    float gain[kInputWords];  // loaded in the polls' first round trip
#pragma unroll
    for (int j = 0; j < kInputWords; ++j)
      gain[j] = gain_weights && word_index(j) < k ? to_float(gain_weights[word_index(j)]) : 1.0f;
    uint64_t bits[kInputWords];
#pragma unroll
    for (int j = 0; j < kInputWords; ++j) {
      if (word_index(j) < k)
        bits[j] = load_post(src + word_index(j));
      else
        bits[j] = uint64_t{number} << 32;
    }
    hold_values(gain);
    await_posts(bits, number, [&](int j) { return src + word_index(j); });
#pragma unroll
    for (int j = 0; j < kInputWords; ++j) {
      const int i = word_index(j);
      if (i >= k) break;
      float v = posted_value(bits[j]);
      if (sum_squares) {
        sum_sq = fmaf(v, v, sum_sq);
        v *= gain[j];
      }
      xs[i] = v;
    }
  }
  return sum_sq;
}

// With post-norms: the residual stream (every block's whole copy) gains the RMSNorm of the output
// posted at `src` (post `number`), rounded as rms_norm and the residual add round. Returns the
// thread's sum of squares of the new stream; xs then holds it, each value times its gain (none:
// 1). It loads the posts itself, so that load is compiled without a gain. reduce: kStepWarps floats.
template <typename T>
__device__ float add_post_normed(const DecoderStepShape& s, const uint64_t* src, unsigned number, const T* post_norm,
                                 const T* gain_weights, float* xs, float* residual, float* reduce) {
  const int k = s.hidden;
  const float sum_sq = load_posted<T>(src, k, number, nullptr, true, xs);
  const float inv_rms = rsqrtf(block_sum(sum_sq, reduce) / static_cast<float>(k) + s.eps);
  float new_sum_sq = 0.0f;
  for (int i = threadIdx.x; i < k; i += kStepThreads) {  // the values this thread staged
    const float x = rounded<T>(residual[i] + rounded<T>(xs[i] * inv_rms * to_float(post_norm[i])));
    residual[i] = x;
    new_sum_sq = fmaf(x, x, new_sum_sq);
    xs[i] = gain_weights ? x * to_float(gain_weights[i]) : x;
  }
  return new_sum_sq;
}

// The phase's input as float in shared memory, as the previous stage posts it (post `number`): the
// RMSNorm weight folded in (y = inv_rms * (W . (x * g))), so the input is read once. Returns inv_rms
// (1 without a norm). With post-norms, qkv (past the first layer) and gate_up read the outputs of
// down and o and add them, normed, to the residual stream first. reduce: 2 kStepWarps floats.
template <typename T, bool Extended>
__device__ float stage_input(const StepParams<T>& p, int layer, int phase, unsigned number, float* xs, float* reduce,
                             float* residual) {
  const DecoderStepShape& s = p.s;
  const uint64_t* src = p.act;
  const T* norm = nullptr;
  const T* post_norm = nullptr;
  int k = s.intermediate;
  if (phase == kQkv || phase == kGateUp) {
    src = p.hidden;
    norm = (phase == kQkv ? p.w.attn_norm : p.w.mlp_norm) + int64_t{layer} * s.hidden;
    k = s.hidden;
    if (Extended && s.post_norms && phase == kGateUp) post_norm = p.w.post_attn_norm + int64_t{layer} * s.hidden;
    if (Extended && s.post_norms && phase == kQkv && layer > 0)
      post_norm = p.w.post_mlp_norm + int64_t{layer - 1} * s.hidden;
  } else if (phase == kOut) {
    src = p.attn;
    k = s.num_heads * s.head_dim;
  }
  float sum_sq;
  if (Extended && post_norm) {
    sum_sq = add_post_normed(s, src, number, post_norm, norm, xs, residual, reduce);
    reduce += kStepWarps;
  } else {
    sum_sq = load_posted(src, k, number, norm, norm != nullptr, xs);
  }
  if (!norm) return 1.0f;
  return rsqrtf(block_sum(sum_sq, reduce) / static_cast<float>(k) + s.eps);
}

// Sums of N values a lane over the warp's lanes in N + 4 - log2(N) shuffles, not the 5 N of N
// warp_sums: each step halves the values a lane keeps. Lane l ends with the whole sum of value
// `which_value(l)`, the lane's bits 16, 8, ... read as a number.
template <int N>
__device__ __forceinline__ float warp_sums(float (&v)[N]) {
  static_assert((N & (N - 1)) == 0 && N <= kWarpSize, "a power of two values");
  const int lane = threadIdx.x % kWarpSize;
  int offset = kWarpSize / 2;
#pragma unroll
  for (int n = N; n > 1; n /= 2, offset /= 2) {
    const bool upper = lane & offset;
#pragma unroll
    for (int j = 0; j < n / 2; ++j) {
      const float keep = upper ? v[j + n / 2] : v[j], give = upper ? v[j] : v[j + n / 2];
      v[j] = keep + __shfl_xor_sync(kFullMask, give, offset);
    }
  }
  float sum = v[0];
#pragma unroll
  for (; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFullMask, sum, offset);
  return sum;
}
template <int N>
__device__ __forceinline__ int which_value(int lane) {
  int which = 0;
#pragma unroll
  for (int offset = kWarpSize / 2, n = N; n > 1; n /= 2, offset /= 2) which = 2 * which + ((lane & offset) ? 1 : 0);
  return which;
}

// A warp's share of a chunk in registers. The chunk's tile rows (gate_up: the gate rows, then the up
// rows) times the phase's slices of the input are dealt to the warps: warp w takes slice
// w % slices of tile rows w / slices + (kStepWarps / slices) j, j < kTileRows; a lane holds
// vectors lane + 32 i of the slice's current piece. Every warp's rows share its slice, so a lane
// loads each input value once. The geometry is worked out once a phase (slices is a power of two:
// shifts, not divisions, which are long dependent chains at run-time counts).
template <typename T>
struct WeightTile {
  static constexpr int V = kVecWidth<T>;
  Piece<T, V> w[kTileRows][kTileVectors];
  int slice, first_row, row_step;
  int begin, end;  // the lane's first vector of the slice (in a row), and the slice's end

  __device__ __forceinline__ explicit WeightTile(const PhasePlan<T>& pl) {
    const int warp = threadIdx.x / kWarpSize;
    slice = warp & (pl.slices - 1);
    first_row = warp >> pl.slice_shift;
    row_step = kStepWarps >> pl.slice_shift;
    begin = slice * pl.slice_vectors + static_cast<int>(threadIdx.x % kWarpSize);
    end = min((slice + 1) * pl.slice_vectors, pl.in_features / V);
  }

  // Loads piece `piece` of the warp's rows of a chunk of `rows` units (rows past them repeat the
  // last, unused; vectors past the slice repeat its first, not used).
  __device__ __forceinline__ void load(const T* chunk, const PhasePlan<T>& pl, int rows, int piece) {
    const int last_row = pl.unit * rows - 1, first = begin + piece * kTilePieceVectors;
#pragma unroll
    for (int j = 0; j < kTileRows; ++j) {
      const T* row = chunk + int64_t{min(first_row + row_step * j, last_row)} * pl.in_features;
#pragma unroll
      for (int i = 0; i < kTileVectors; ++i) {
        const int v = first + kWarpSize * i;
        w[j][i] = plain_piece<T, V>(row + (v < end ? v : begin) * V);
      }
    }
  }

  // Keeps the loads above where this is called: the compiler would otherwise sink them to their
  // first use, past the polls for the input (Qwen3-0.6B's step 2% slower).
  __device__ __forceinline__ void hold() {
#pragma unroll
    for (int j = 0; j < kTileRows; ++j)
#pragma unroll
      for (int i = 0; i < kTileVectors; ++i)
#pragma unroll
        for (int k = 0; k < Piece<T, V>::kWords; ++k) asm volatile("" : "+r"(w[j][i].word[k])::"memory");
  }

  // acc[j] += tile row j . the input's matching values (xs: the staged input as float).
  __device__ __forceinline__ void accumulate(const float* xs, int piece, float (&acc)[kTileRows]) const {
#pragma unroll
    for (int i = 0; i < kTileVectors; ++i) {
      const int v = begin + piece * kTilePieceVectors + kWarpSize * i;
      if (v >= end) break;
      float x[V];
#pragma unroll
      for (int e = 0; e < V; e += 4) {
        const float4 x4 = *reinterpret_cast<const float4*>(xs + v * V + e);
        x[e] = x4.x, x[e + 1] = x4.y, x[e + 2] = x4.z, x[e + 3] = x4.w;
      }
#pragma unroll
      for (int j = 0; j < kTileRows; ++j) {
        float wf[V];
        piece_floats(w[j][i], wf);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[j] = fmaf(wf[e], x[e], acc[j]);
      }
    }
  }
};
static_assert(kVecWidth<float> % 4 == 0, "inputs are read as float4");

// A chunk's rows against the staged input: the tile (loaded with piece 0 by the caller, possibly
// before the input was ready) is summed over its pieces, the lanes and then the slices (through
// partials[], kTileRows * kStepWarps floats). finish(unit, a, b) gets each row's sum (gate_up: unit
// `unit`'s gate and up sums), called by thread `unit` of the block.
template <typename T, typename Finish>
__device__ __forceinline__ void gemv_chunk(WeightTile<T>& tile, const T* chunk, const float* xs, const PhasePlan<T>& pl,
                                           int rows, float* partials, Finish&& finish) {
  float acc[kTileRows];
#pragma unroll
  for (int j = 0; j < kTileRows; ++j) acc[j] = 0.0f;
  for (int piece = 0; piece < pl.pieces; ++piece) {
    if (piece > 0) tile.load(chunk, pl, rows, piece);
    tile.accumulate(xs, piece, acc);
  }
  const int lane = threadIdx.x % kWarpSize;
  const float sum = warp_sums(acc);
  const int row = tile.first_row + tile.row_step * which_value<kTileRows>(lane);
  if (lane % (kWarpSize / kTileRows) == 0 && row < pl.unit * rows) partials[row * pl.slices + tile.slice] = sum;
  __syncthreads();
  const int unit = threadIdx.x;
  if (unit >= rows) return;
  float a = 0.0f, b = 0.0f;
  for (int s = 0; s < pl.slices; ++s) {  // a fixed order
    a += partials[unit * pl.slices + s];
    if (pl.unit == 2) b += partials[(rows + unit) * pl.slices + s];
  }
  finish(unit, a, b);
}

// Shared-memory floats of the attention stage: the group's queries, the new key and value, the
// scores of one item, per-head stats, and each warp's share of the weighted values.
__host__ __device__ inline size_t attention_scratch_floats(int group, int head_dim) {
  const size_t g = static_cast<size_t>(group), hd = static_cast<size_t>(head_dim);
  // warp_values also holds the merge's per-split sums, up to kSplitMaxKeys a head.
  return g * hd + 2 * hd + g * kSplitMaxKeys + 2 * g + g * max(size_t{kStepWarps} * hd, size_t{kSplitMaxKeys});
}

// One warp over a row of n floats in shared memory: each x becomes exp(x - max); returns the max
// and the sum of the new values (each times weight[j] when weight is given). The split softmax
// and the merge's split weights.
__device__ __forceinline__ float2 warp_exp_shift(float* row, int n, const float* weight) {
  const int lane = threadIdx.x % kWarpSize;
  float m = -INFINITY;
  for (int j = lane; j < n; j += kWarpSize) m = fmaxf(m, row[j]);
  m = warp_max(m);
  float sum = 0.0f;
  for (int j = lane; j < n; j += kWarpSize) {
    row[j] = expf(row[j] - m);
    sum = weight ? fmaf(row[j], weight[j], sum) : sum + row[j];
  }
  return make_float2(m, warp_sum(sum));
}

// The block's residual rows follow the larger of a stage's input and the attention's scratch.
__host__ __device__ inline size_t residual_rows_offset(const DecoderStepShape& s) {
  const size_t input_floats = max(max(s.hidden, s.num_heads * s.head_dim), s.intermediate);
  const size_t floats = max(input_floats, attention_scratch_floats(s.num_heads / s.num_kv_heads, s.head_dim));
  return (floats + 31) / 32 * 32;
}

// A layer's attention work items: (KV head, split of its keys: positions key_lo..pos). Enough to
// fill the grid, each at least kSplitMinKeys keys and at most kSplitMaxKeys. They depend on pos
// and on whether the layer has a sliding window only.
struct SplitItem {
  int kv, split, key0, n;  // key0: a position
};
__device__ __forceinline__ int attention_splits(int keys, int kv_heads) {
  return max(ceil_div(keys, kSplitMaxKeys),
             min(ceil_div(keys, kSplitMinKeys), max(1, static_cast<int>(gridDim.x) / kv_heads)));
}
__device__ __forceinline__ SplitItem split_item(int item, int splits, int keys, int key_lo) {
  // 32-bit arithmetic (split * keys < kSplitMaxKeys * kDecoderStepMaxLen): 64-bit division is a call.
  const unsigned kv = static_cast<unsigned>(item) / splits, split = item - kv * splits;
  const unsigned key0 = split * keys / splits, key_end = (split + 1) * keys / splits;
  return {static_cast<int>(kv), static_cast<int>(split), key_lo + static_cast<int>(key0),
          static_cast<int>(key_end - key0)};
}
static_assert(int64_t{kSplitMaxKeys} * kDecoderStepMaxLen <= int64_t{UINT32_MAX}, "split_item's 32-bit products");
// The keys of the layers with and without a sliding window: `keys` from position key_lo, their
// number of splits and the block's first item. Worked out once a step (divisions by run-time
// counts are long dependent chains).
struct KeyRange {
  int key_lo, keys, splits;
  SplitItem first;
};
__device__ __forceinline__ KeyRange key_range(int key_lo, int keys, int kv_heads) {
  const int splits = attention_splits(keys, kv_heads);
  return {key_lo, keys, splits, split_item(blockIdx.x, splits, keys, key_lo)};
}
__device__ __forceinline__ bool is_sliding(const DecoderStepShape& s, int layer) {
  uint64_t word = 0;
#pragma unroll
  for (int i = 0; i < kDecoderStepMaxSlidingLayers / 64; ++i)  // constant indices: the shape stays in parameter space
    if (i == layer / 64) word = s.sliding_layers[i];
  return (word >> (layer % 64)) & 1;
}

// An attention score after the softmax scale, capped as Gemma-2 caps it (softcap > 0) in the
// Extended kernel.
template <bool Extended>
__device__ __forceinline__ float capped_score(float score, float softcap) {
  return Extended && softcap > 0.0f ? softcap * tanhf(score / softcap) : score;
}

// The layer's cache of KV head kv.
template <typename T>
__device__ __forceinline__ T* head_cache(const StepParams<T>& p, T* cache, int layer, int kv) {
  return cache + (int64_t{layer} * p.s.num_kv_heads + kv) * p.s.max_len * p.s.head_dim;
}

// Whether a split's keys and values fit one weight stage.
template <typename T>
__device__ __forceinline__ bool split_fits(const StepParams<T>& p, int n) {
  return 2 * n * p.s.head_dim * static_cast<int>(sizeof(T)) <= p.stage_bytes;
}

// The split's cached keys and values do not depend on this step, so when they fit the weight ring's
// free stage (the one the last consumed chunk used, refilled only at the next chunk) they are
// copied there: the scores and the weighted values then read shared memory instead of waiting on
// two or three round trips to the cache. The block's first item is copied as soon as its qkv GEMV
// is done, while the attention waits for the queries; its later items while their queries are made
// ready. On sm_90 the copies land on their own barrier (phase `staged_items`, counted over the
// step); before sm_90 they are one extra cp.async group, waited for in full before the next chunk
// is acquired, so the weight stream's group count stays right.
template <typename T>
__device__ void stage_split(const StepParams<T>& p, int layer, const SplitItem& it, T* free_stage,
                            uint64_t* split_landed) {
  const int hd = p.s.head_dim;
  const int split_bytes = it.n * hd * static_cast<int>(sizeof(T));
  const T* k_src = head_cache(p, p.k_cache, layer, it.kv) + int64_t{it.key0} * hd;
  const T* v_src = head_cache(p, p.v_cache, layer, it.kv) + int64_t{it.key0} * hd;
#ifdef FLASHHEAD_BULK_COPIES
  if (threadIdx.x == kBulkThread) {
    mbarrier_expect_bytes(split_landed, 2 * split_bytes);
    copy_bulk(free_stage, k_src, split_bytes, split_landed);
    copy_bulk(free_stage + it.n * hd, v_src, split_bytes, split_landed);
  }
#else
  copy_async(free_stage, k_src, split_bytes, kStepThreads);
  copy_async(free_stage + it.n * hd, v_src, split_bytes, kStepThreads);
  commit_async();
#endif
}

// The attention of one layer. Work items are (KV head, split of the layer's keys); each gets the
// group's queries and the new key ready (RMSNorm, rotary: rotary_cache_write's arithmetic), scores
// a key per thread, weights the values with a warp per key and lanes over dimensions, and posts a
// softmax partial; a KV head's last splits merge its partials (decode_attention's merge) into attn.
// Every loop over keys keeps its loads independent, so they are in flight together.
template <typename T, typename Heads, bool Extended>
__device__ void attention(const StepParams<T>& p, int layer, int64_t pos, bool sliding, const KeyRange& range,
                          float* scratch, T* free_stage, uint64_t* split_landed, unsigned& staged_items) {
  constexpr int V = kVecWidth<T>, kMaxGroup = Heads::kMaxGroup, kHeadDimPerLane = Heads::kHeadDimPerLane;
  const DecoderStepShape& s = p.s;
  const int hd = s.head_dim, half = hd / 2, kv_heads = s.num_kv_heads, group = s.num_heads / kv_heads;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  // Without sliding windows every layer attends to keys 0..pos: known here, not read.
  const int keys = Extended ? range.keys : static_cast<int>(pos) + 1, key_lo = Extended ? range.key_lo : 0;
  const int splits = range.splits;
  const SplitItem& first = range.first;
  float* q_rows = scratch;                        // [group][hd]
  float* k_new = q_rows + group * hd;             // [hd]
  float* v_new = k_new + hd;                      // [hd]
  float* scores = v_new + hd;                     // [group][kSplitMaxKeys]; the merge's split weights
  float* stats = scores + group * kSplitMaxKeys;  // [group][2]
  float* warp_values = stats + 2 * group;         // [kStepWarps][group][hd]
  const bool own_tables = Extended && sliding && p.w.sliding_cos;
  const T* cos = (own_tables ? p.w.sliding_cos : p.cos) + pos * hd;
  const T* sin = (own_tables ? p.w.sliding_sin : p.sin) + pos * hd;
  const unsigned attn_post = post_number(layer, kAttentionStage), qkv_post = attn_post - 1;

  for (int item = blockIdx.x; item < kv_heads * splits; item += gridDim.x) {
    const SplitItem it = item == static_cast<int>(blockIdx.x) ? first : split_item(item, splits, keys, key_lo);
    const int kv = it.kv, split = it.split, key0 = it.key0, n = it.n;
    // The previous item is done with the scratch and the free stage. The first needs no barrier:
    // the block's last one (qkv's GEMV's own, or the previous phase's end when the block has no qkv
    // rows) follows every read of the scratch and of the stage its copies go to.
    if (item != static_cast<int>(blockIdx.x)) __syncthreads();
    T* k_cache = head_cache(p, p.k_cache, layer, kv);
    T* v_cache = head_cache(p, p.v_cache, layer, kv);
    const bool staged = split_fits(p, n);
    // The first item's copies were issued at the end of the qkv phase.
    if (staged && item != static_cast<int>(blockIdx.x)) stage_split(p, layer, it, free_stage, split_landed);
    // Rows j = 0..n-1 of the split (key key0 + j).
    T* k_rows = staged ? free_stage : k_cache + int64_t{key0} * hd;
    T* v_rows = staged ? free_stage + n * hd : v_cache + int64_t{key0} * hd;

    for (int vec = warp; vec <= group; vec += kStepWarps) {  // vec == group: the new key
      const bool is_key = vec == group;
      const int head = is_key ? s.num_heads + kv : kv * group + vec;
      const uint64_t* src = p.qkv + int64_t{head} * hd;
      const T* norm = is_key ? p.w.k_norm : p.w.q_norm;
      // The lane's words of the head: dimension lane + 32 i at 2 i, its partner + half at 2 i + 1.
      const auto offset = [&](int j) { return min(lane + (j / 2) * kWarpSize, half - 1) + (j % 2) * half; };
      const auto word = [&](int j) { return src + offset(j); };
      const uint64_t* v_src = p.qkv + int64_t{s.num_heads + kv_heads + kv} * hd;
      const auto v_word = [&](int j) { return v_src + offset(j); };
      // Everything the rotation reads (and the key's warp, the new value) is loaded together with
      // the polled words: one round trip, not three.
      float lo[kHeadDimPerLane / 2], hi[kHeadDimPerLane / 2], norm_lo[kHeadDimPerLane / 2],
          norm_hi[kHeadDimPerLane / 2], c[kHeadDimPerLane], sn[kHeadDimPerLane];
#pragma unroll
      for (int i = 0; i < kHeadDimPerLane / 2; ++i) {
        const int t = lane + i * kWarpSize;
        const bool active = t < half;
        norm_lo[i] = active && norm ? to_float(norm[int64_t{layer} * hd + t]) : 1.0f;
        norm_hi[i] = active && norm ? to_float(norm[int64_t{layer} * hd + t + half]) : 1.0f;
        c[2 * i] = active ? to_float(cos[t]) : 0.0f;
        c[2 * i + 1] = active ? to_float(cos[t + half]) : 0.0f;
        sn[2 * i] = active ? to_float(sin[t]) : 0.0f;
        sn[2 * i + 1] = active ? to_float(sin[t + half]) : 0.0f;
      }
      uint64_t bits[kHeadDimPerLane], v_bits[kHeadDimPerLane];
#pragma unroll
      for (int j = 0; j < kHeadDimPerLane; ++j) bits[j] = load_post(word(j));
      if (is_key)
#pragma unroll
        for (int j = 0; j < kHeadDimPerLane; ++j) v_bits[j] = load_post(v_word(j));
      hold_values(norm_lo), hold_values(norm_hi), hold_values(c), hold_values(sn);
      await_posts(bits, qkv_post, word);
      if (is_key) await_posts(v_bits, qkv_post, v_word);
      float sum_sq = 0.0f;
#pragma unroll
      for (int i = 0; i < kHeadDimPerLane / 2; ++i) {
        const bool active = lane + i * kWarpSize < half;
        lo[i] = active ? posted_value(bits[2 * i]) : 0.0f;
        hi[i] = active ? posted_value(bits[2 * i + 1]) : 0.0f;
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
          l = rounded<T>(l * inv_rms * norm_lo[i]);
          h = rounded<T>(h * inv_rms * norm_hi[i]);
        }
        dst[t] = rounded<T>(rounded<T>(l * c[2 * i]) - h * sn[2 * i]);
        dst[t + half] = rounded<T>(rounded<T>(h * c[2 * i + 1]) + l * sn[2 * i + 1]);
        if (is_key) {
          v_new[t] = posted_value(v_bits[2 * i]);
          v_new[t + half] = posted_value(v_bits[2 * i + 1]);
        }
      }
    }
#ifdef FLASHHEAD_BULK_COPIES
    if (staged) mbarrier_wait(split_landed, staged_items++);
#else
    if (staged) wait_async_except(0);
#endif
    __syncthreads();

    if (key0 + n == key_lo + keys) {
      // The split holding the new token stores it (in the cache, and over its stale staged row),
      // and then reads it back like every other key: no per-key branch, so the loops below issue
      // their loads together.
      for (int d = threadIdx.x; d < hd; d += kStepThreads) {
        const T key = from_float<T>(k_new[d]), value = from_float<T>(v_new[d]);
        k_cache[pos * hd + d] = key;
        v_cache[pos * hd + d] = value;
        if (staged) k_rows[(n - 1) * hd + d] = key, v_rows[(n - 1) * hd + d] = value;
      }
#ifdef FLASHHEAD_BULK_COPIES
      if (staged) fence_before_bulk_copies();  // the stage's next chunk lands over these rows
#endif
      __syncthreads();
    }
    // Scores: kThreadsPerKey threads per key, each a few 16-byte vectors of its row (all loaded at
    // once), dotted with every query of the group and summed over the key's threads.
    constexpr int kMaxVectorsPerThread = Heads::kMaxHeadDim / V / kThreadsPerKey;
    for (int j0 = 0; j0 < n; j0 += kStepThreads / kThreadsPerKey) {
      const int j = j0 + threadIdx.x / kThreadsPerKey, part = threadIdx.x % kThreadsPerKey;
      const T* k_row = k_rows + int64_t{min(j, n - 1)} * hd;  // threads past the split repeat its last key, unused
      float dot[kMaxGroup];
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h) dot[h] = 0.0f;
      // Loads are unconditional (clamped indices; the surplus is never used): a conditional load
      // is compiled as a branch, and the loads then go one round trip at a time.
      Piece<T, V> k_vec[kMaxVectorsPerThread];
#pragma unroll
      for (int i = 0; i < kMaxVectorsPerThread; ++i) {
        const int v = min(part + i * kThreadsPerKey, hd / V - 1);
        k_vec[i] = plain_piece<T, V>(k_row + v * V);
      }
#pragma unroll
      for (int i = 0; i < kMaxVectorsPerThread; ++i) {
        const int v = part + i * kThreadsPerKey;
        if (v >= hd / V) break;
#pragma unroll
        for (int h = 0; h < kMaxGroup; ++h) {
          if (h >= group) break;
          // Converted again for each query head: held across the heads, the floats made the largest
          // head classes spill more.
          float kf[V];
          piece_floats(k_vec[i], kf);
#pragma unroll
          for (int e = 0; e < V; ++e) dot[h] = fmaf(q_rows[h * hd + v * V + e], kf[e], dot[h]);
        }
      }
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h) {
#pragma unroll
        for (int offset = kThreadsPerKey / 2; offset > 0; offset >>= 1)
          dot[h] += __shfl_xor_sync(kFullMask, dot[h], offset);
        if (h < group && part == 0 && j < n)
          scores[h * kSplitMaxKeys + j] = capped_score<Extended>(dot[h] * s.scale, s.attn_softcap);
      }
    }
    __syncthreads();
    for (int h = warp; h < group; h += kStepWarps) {
      const float2 max_sum = warp_exp_shift(scores + h * kSplitMaxKeys, n, nullptr);
      if (lane == 0) stats[2 * h] = max_sum.x, stats[2 * h + 1] = max_sum.y;
    }
    __syncthreads();
    // Weighted values: warp w takes keys w, w + 8, ...; lane owns dimensions lane, lane + 32, ...
    float acc[kMaxGroup][kHeadDimPerLane];
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h)
#pragma unroll
      for (int i = 0; i < kHeadDimPerLane; ++i) acc[h][i] = 0.0f;
    // Batches of kValueKeys keys a warp, loaded together: unconditional loads at clamped indices
    // (keys past the split and dimensions past hd are loaded but not used).
    for (int base = warp; base < n; base += kStepWarps * kValueKeys) {
      T v[kValueKeys][kHeadDimPerLane];
#pragma unroll
      for (int u = 0; u < kValueKeys; ++u) {
        const T* value_row = v_rows + int64_t{min(base + u * kStepWarps, n - 1)} * hd;
#pragma unroll
        for (int i = 0; i < kHeadDimPerLane; ++i) v[u][i] = value_row[min(lane + i * kWarpSize, hd - 1)];
      }
#pragma unroll
      for (int u = 0; u < kValueKeys; ++u) {
        const int j = base + u * kStepWarps;
        if (j >= n) break;
#pragma unroll
        for (int h = 0; h < kMaxGroup; ++h) {
          if (h >= group) break;
          const float weight = scores[h * kSplitMaxKeys + j];
#pragma unroll
          for (int i = 0; i < kHeadDimPerLane; ++i) acc[h][i] = fmaf(weight, to_float(v[u][i]), acc[h][i]);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h) {
      if (h >= group) break;
#pragma unroll
      for (int i = 0; i < kHeadDimPerLane; ++i) {
        const int d = lane + i * kWarpSize;
        if (d < hd) warp_values[(warp * group + h) * hd + d] = acc[h][i];
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < group * hd; idx += kStepThreads) {
      float o = 0.0f;
#pragma unroll
      for (int w = 0; w < kStepWarps; ++w) o += warp_values[w * group * hd + idx];  // a fixed order
      const int h = idx / hd, d = idx % hd;
      if (splits == 1) {  // the whole softmax is here: no partials, no merge (the merge's result exactly)
        post(p.attn + int64_t{kv * group + h} * hd + d, rounded<T>(o / stats[2 * h + 1]), attn_post);
        continue;
      }
      const int64_t at = int64_t{kv * group + h} * p.max_splits + split;
      post(p.partial_out + at * hd + d, o, attn_post);
      if (d == 0) post(p.partial_stats + 2 * at, stats[2 * h], attn_post), post(p.partial_stats + 2 * at + 1, stats[2 * h + 1], attn_post);
    }
  }
  if (splits == 1) return;
  // The merge: each KV head's last `mergers` splits (the one holding the new token, which has the
  // most work, last) merge a share of the head's group * hd outputs each, a thread an output, so
  // that a thread's loads of partials stay within a batch or two of kMergeSplits: one block
  // merging a head of many outputs and splits took a round trip a batch, up to 8 at the Gemma-3
  // dims. It follows all of the block's items: a later item's partials may be among those merged.
  const int outputs = group * hd;
  const int mergers = min(splits, ceil_div(outputs * splits, kStepThreads * kMergeSplits));
  for (int item = blockIdx.x; item < kv_heads * splits; item += gridDim.x) {
    const SplitItem it = item == static_cast<int>(blockIdx.x) ? first : split_item(item, splits, keys, key_lo);
    const int merger = it.split - (splits - mergers), kv = it.kv;
    if (merger < 0) continue;
    __syncthreads();  // the scratch below is the last item's scores and weighted values
    // Every split's stats in one round of loads (maxima in scores, sums in warp_values), then a warp
    // per head weighs the splits (exp(m_s - m), kept in scores) and sums them up.
    for (int i = threadIdx.x; i < group * splits; i += kStepThreads) {
      const int h = i / splits, sp = i % splits;
      const uint64_t* at = p.partial_stats + 2 * (int64_t{kv * group + h} * p.max_splits + sp);
      uint64_t bits[2];
      load_posts(bits, attn_post, [&](int j) { return at + j; });
      scores[h * kSplitMaxKeys + sp] = posted_value(bits[0]);
      warp_values[h * kSplitMaxKeys + sp] = posted_value(bits[1]);
    }
    __syncthreads();
    for (int h = warp; h < group; h += kStepWarps) {
      const float2 max_total = warp_exp_shift(scores + h * kSplitMaxKeys, splits, warp_values + h * kSplitMaxKeys);
      if (lane == 0) stats[2 * h + 1] = max_total.y;
    }
    __syncthreads();
    // A lone merger (every head at Qwen3-0.6B, context 1024) takes the whole head, no divisions.
    const bool whole = mergers == 1;
    const int share_begin = whole ? 0 : merger * outputs / mergers;
    const int share_end = whole ? outputs : (merger + 1) * outputs / mergers;
    for (int idx = share_begin + threadIdx.x; idx < share_end; idx += kStepThreads) {
      const int h = idx / hd, d = idx % hd;
      const uint64_t* partial = p.partial_out + int64_t{kv * group + h} * p.max_splits * hd + d;
      float o = 0.0f;
      for (int base = 0; base < splits; base += kMergeSplits) {  // kMergeSplits unconditional loads in flight
        const auto word = [&](int u) { return partial + int64_t{min(base + u, splits - 1)} * hd; };
        uint64_t part[kMergeSplits];
        load_posts(part, attn_post, word);
#pragma unroll
        for (int u = 0; u < kMergeSplits; ++u)
          if (base + u < splits) o = fmaf(posted_value(part[u]), scores[h * kSplitMaxKeys + base + u], o);
      }
      post(p.attn + int64_t{kv * group + h} * hd + d, rounded<T>(o / stats[2 * h + 1]), attn_post);
    }
  }
}

// Extended: Gemma-3's options (post-norms, GELU, sliding windows) and Gemma-2's cap, as the shape sets them.
template <typename T, typename Heads, bool Extended>
__global__ void __launch_bounds__(kStepThreads, 1) decoder_step_kernel(StepParams<T> p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  float* scratch =
      reinterpret_cast<float*>(smem_raw + size_t{static_cast<unsigned>(p.stages)} * static_cast<unsigned>(p.stage_bytes));
  // The block's rows of the residual stream; with post-norms the whole stream.
  float* residual_rows = scratch + residual_rows_offset(p.s);
  __shared__ PhasePlan<T> plans[kPhases];
  __shared__ float reduce[2 * kStepWarps];
  __shared__ float partials[kTileRows * kStepWarps];  // gemv_chunk's per-slice sums
  __shared__ uint64_t landed[kMaxStages + 1];  // sm_90: the weight stages', then the staged split's
  // The attention's keys: those of the full-attention layers, then the sliding-window layers'.
  __shared__ KeyRange key_ranges[2];
  const int64_t pos = *p.length;
  if (pos < 0 || pos >= p.s.max_len) {
    // Outside the cache: nothing is written and the result is NaN, at the cost of a launch (a
    // caller can skip a step on the device by passing such a length).
    for (int i = blockIdx.x * kStepThreads + threadIdx.x; i < p.s.hidden; i += gridDim.x * kStepThreads)
      p.out[i] = from_float<T>(NAN);
    return;
  }
  if (threadIdx.x < kPhases) plans[threadIdx.x] = phase_plan(p, threadIdx.x);
  if (threadIdx.x == kPhases) {
    const int keys = static_cast<int>(pos) + 1;
    const int window_keys = p.s.sliding_window > 0 ? min(keys, p.s.sliding_window) : keys;
    key_ranges[0] = key_range(0, keys, p.s.num_kv_heads);
    key_ranges[1] = key_range(keys - window_keys, window_keys, p.s.num_kv_heads);
  }
#ifdef FLASHHEAD_BULK_COPIES
  if (threadIdx.x == 0) {
    for (int i = 0; i <= p.stages; ++i) mbarrier_init(landed + i);
    fence_mbarrier_init();  // before the copy engine signals them
  }
#endif
  __syncthreads();
  // The residual stream's rows that o and down add to are the block's own: o and down split the
  // hidden rows alike, so each adds to what the block itself wrote last, kept here in shared memory
  // rather than read back from L2. The first layer's o adds to the token's row, which the block
  // also posts for every block's first qkv. With post-norms every block keeps the whole stream.
  // The token's row is x * input_scale: the float32 product rounded to T, as the CPU reference.
  const auto input = [&](int row) { return rounded<T>(to_float(p.x[row]) * p.s.input_scale); };
  for (int row = plans[kOut].row_lo + threadIdx.x; row < plans[kOut].row_hi; row += kStepThreads) {
    const float x = input(row);
    if (!(Extended && p.s.post_norms)) residual_rows[row - plans[kOut].row_lo] = x;
    post(p.hidden + row, x, 1);
  }
  if (Extended && p.s.post_norms)
    for (int i = threadIdx.x; i < p.s.hidden; i += kStepThreads) residual_rows[i] = input(i);

  int per_layer = 0;
#pragma unroll
  for (int phase = 0; phase < kPhases; ++phase) per_layer += plans[phase].chunks;
  WeightStream<T> stream(plans, smem_raw, landed, p.stages, p.stage_bytes, p.s.layers, per_layer);
  for (int i = 0; i < p.stages - 1; ++i) stream.issue();

  unsigned staged_items = 0;
  for (int layer = 0; layer < p.s.layers; ++layer) {
    const bool sliding = Extended && is_sliding(p.s, layer);
    const KeyRange& range = key_ranges[sliding];
    for (int phase = 0; phase < kPhases; ++phase) {
      if (phase == kOut) {
        // The stage of the last chunk consumed: its GEMV is done, and the next issue refills it.
        T* free_stage = reinterpret_cast<T*>(stream.last_stage());
        attention<T, Heads, Extended>(p, layer, pos, sliding, range, scratch, free_stage, landed + p.stages,
                                      staged_items);
        __syncthreads();  // the attention's scratch is the next input's
      }
      const PhasePlan<T>& pl = plans[phase];
      const unsigned output_post = post_number(layer, stage_of(phase));
      if (pl.chunks > 0) {
        // The first chunk goes to registers while the block waits for its input. The copy that
        // refills the previous chunk's stage waits until the input is here: issued before the
        // polls, it made Qwen3-0.6B's step 11% slower.
        WeightTile<T> tile(pl);
        const T* chunk = stream.wait_next();
        tile.load(chunk, pl, pl.chunk_rows(pl.row_lo), 0);
        tile.hold();
        const float inv_rms =
            stage_input<T, Extended>(p, layer, phase, output_post - 1, scratch, reduce, residual_rows);
        __syncthreads();  // every thread's share of the input is staged
        stream.issue();
        for (int c = 0; c < pl.chunks; ++c) {
          const int row0 = pl.row_lo + c * pl.rows_per_chunk;
          const int rows = pl.chunk_rows(row0);
          if (c > 0) {
            chunk = stream.acquire();
            tile.load(chunk, pl, rows, 0);
          }
          gemv_chunk(tile, chunk, scratch, pl, rows, partials, [&](int r, float a, float b) {
            const int row = row0 + r;
            if (phase == kGateUp) {
              const float gate = rounded<T>(a * inv_rms), up = rounded<T>(b * inv_rms);
              const float activated = Extended && p.s.activation == DecoderStepActivation::kGeluTanh
                                          ? gelu_tanh(gate)
                                          : gate / (1.0f + expf(-gate));
              post(p.act + row, rounded<T>(rounded<T>(activated) * up), output_post);
            } else if (phase == kQkv) {
              float y = a * inv_rms;
              if (p.w.qkv_bias) {  // rounded once after the bias, as fused_linear rounds
                const int qkv_rows = (p.s.num_heads + 2 * p.s.num_kv_heads) * p.s.head_dim;
                y += to_float(p.w.qkv_bias[int64_t{layer} * qkv_rows + row]);
              }
              post(p.qkv + row, rounded<T>(y), output_post);
            } else if (Extended && p.s.post_norms) {  // o and down: the output, normed and added by its readers
              post(p.hidden + row, rounded<T>(a), output_post);
            } else {  // o and down: + the residual stream
              float& residual = residual_rows[row - pl.row_lo];
              const T result = from_float<T>(rounded<T>(a) + residual);
              residual = to_float(result);
              post(p.hidden + row, residual, output_post);
              if (phase == kDown && layer + 1 == p.s.layers) p.out[row] = result;
            }
          });
        }
      }
      if (phase == kQkv) {
        // The copies of the block's first attention item, if it has one, into the stage of the
        // chunk acquired last, which no warp reads past the block's last barrier. With no barrier
        // here the issuing warp (the last, not needed until the scores) issues them while the
        // others poll for the queries.
        if (static_cast<int>(blockIdx.x) < p.s.num_kv_heads * range.splits && split_fits(p, range.first.n))
          stage_split(p, layer, range.first, reinterpret_cast<T*>(stream.last_stage()), landed + p.stages);
        continue;
      }
      __syncthreads();  // every warp is done with the input before the next one is staged
    }
  }
  if (Extended && p.s.post_norms && plans[kOut].row_lo < plans[kOut].row_hi) {
    // The last down's output, normed and added: each block writes its rows of the result.
    const int last = p.s.layers - 1;
    add_post_normed<T>(p.s, p.hidden, post_number(last, stage_of(kDown)), p.w.post_mlp_norm + int64_t{last} * p.s.hidden,
                       nullptr, scratch, residual_rows, reduce);
    __syncthreads();  // other threads added the block's rows
    for (int row = plans[kOut].row_lo + threadIdx.x; row < plans[kOut].row_hi; row += kStepThreads)
      p.out[row] = from_float<T>(residual_rows[row]);
  }
#ifndef FLASHHEAD_BULK_COPIES
  wait_async_except(0);  // the trailing empty groups
#endif
}

// The kernel of the smallest head class that holds the shape's group and head_dim.
template <typename T, bool Extended>
auto step_kernel_of_class(const DecoderStepShape& s) -> void (*)(StepParams<T>) {
  const int group = s.num_heads / s.num_kv_heads;
  if (group <= SmallHeads::kMaxGroup && s.head_dim <= SmallHeads::kMaxHeadDim)
    return decoder_step_kernel<T, SmallHeads, Extended>;
  if (group <= MidHeads::kMaxGroup && s.head_dim <= MidHeads::kMaxHeadDim) return decoder_step_kernel<T, MidHeads, Extended>;
  if (s.head_dim <= WideHeads::kMaxHeadDim) return decoder_step_kernel<T, WideHeads, Extended>;
  if (s.head_dim <= LargeHeads::kMaxHeadDim) return decoder_step_kernel<T, LargeHeads, Extended>;
  if (group <= DeepHeads::kMaxGroup) return decoder_step_kernel<T, DeepHeads, Extended>;
  return decoder_step_kernel<T, AnyHeads, Extended>;
}
template <typename T>
auto step_kernel(const DecoderStepShape& s) -> void (*)(StepParams<T>) {
  const bool extended =
      s.post_norms || s.activation != DecoderStepActivation::kSilu || s.sliding_window > 0 || s.attn_softcap > 0.0f;
  return extended ? step_kernel_of_class<T, true>(s) : step_kernel_of_class<T, false>(s);
}

}  // namespace
}  // namespace detail

DecoderStepLimit decoder_step_limit(const DecoderStepShape& s, int element_bytes) {
  const int64_t element = element_bytes, vector = 16 / element;
  if (s.layers <= 0 || s.hidden <= 0 || s.intermediate <= 0 || s.num_heads <= 0 || s.num_kv_heads <= 0 ||
      s.head_dim <= 0 || s.max_len <= 0 || s.num_heads % s.num_kv_heads != 0)
    return DecoderStepLimit::kShape;
  if (s.head_dim > kDecoderStepMaxHeadDim) return DecoderStepLimit::kHeadDim;
  if (s.hidden % vector != 0 || s.head_dim % vector != 0 || s.intermediate % vector != 0)
    return DecoderStepLimit::kWholeVectors;
  if (s.num_heads / s.num_kv_heads > kDecoderStepMaxGroup) return DecoderStepLimit::kGroup;
  if (s.max_len > kDecoderStepMaxLen) return DecoderStepLimit::kMaxLen;
  // A weight row (a gate and an up row for gate_up) must fit one shared-memory stage.
  if (2 * s.hidden * element > kDecoderStepStageBytes ||
      int64_t{s.num_heads} * s.head_dim * element > kDecoderStepStageBytes ||
      s.intermediate * element > kDecoderStepStageBytes)
    return DecoderStepLimit::kRowBytes;
  if (int64_t{s.layers} * s.num_kv_heads * s.max_len * s.head_dim > INT32_MAX) return DecoderStepLimit::kCacheElements;
  return DecoderStepLimit::kNone;
}

namespace detail {
namespace {
// The workspace: posted words, which the launch zeroes. Sets p's pointers (null without a workspace).
template <typename T>
size_t carve_workspace(const DecoderStepShape& s, const DecoderStepPlan& plan, void* workspace,
                       StepParams<T>* p) {
  WorkspaceCarver carver(workspace);
  const size_t heads = static_cast<size_t>(s.num_heads), splits = static_cast<size_t>(plan.max_splits);
  p->hidden = carver.take<uint64_t>(static_cast<size_t>(s.hidden));
  p->qkv = carver.take<uint64_t>(size_t{static_cast<unsigned>(s.num_heads + 2 * s.num_kv_heads)} * s.head_dim);
  p->attn = carver.take<uint64_t>(heads * s.head_dim);
  p->act = carver.take<uint64_t>(static_cast<size_t>(s.intermediate));
  p->partial_out = carver.take<uint64_t>(heads * splits * s.head_dim);
  p->partial_stats = carver.take<uint64_t>(heads * splits * 2);
  return carver.bytes();
}
}  // namespace
}  // namespace detail

template <typename T>
cudaError_t plan_decoder_step(const DecoderStepShape& s, DecoderStepPlan* plan) {
  using namespace detail;
  // Checked here too, before anything asks the device, for callers that skip the ATen wrapper.
  if (decoder_step_limit(s, sizeof(T)) != DecoderStepLimit::kNone) return cudaErrorInvalidValue;
  const auto kernel = step_kernel<T>(s);
  int sms = 0;
  if (cudaError_t err = multiprocessor_count(&sms); err != cudaSuccess) return err;
  KernelSmem limits{};
  if (cudaError_t err = kernel_smem(kernel, &limits); err != cudaSuccess) return err;
  // A block's residual rows: o and down have hidden_size rows over at least one block per SM; with
  // post-norms the whole stream.
  const size_t residual_floats = s.post_norms ? s.hidden : ceil_div(s.hidden, sms) + 1;
  const size_t scratch_bytes = (residual_rows_offset(s) + residual_floats) * sizeof(float);
  const long long room = static_cast<long long>(limits.max_dynamic) - static_cast<long long>(scratch_bytes);
  // The largest stage (in 16 KB steps) that leaves three of them; otherwise the smallest, at least two.
  plan->stage_bytes = kDecoderStepMaxStageBytes;
  while (plan->stage_bytes > kDecoderStepStageBytes && room < 3LL * plan->stage_bytes) plan->stage_bytes -= 16 * 1024;
  plan->stages = static_cast<int>(std::min<long long>(kMaxStages, room / plan->stage_bytes));
  if (plan->stages < 2) return cudaErrorInvalidValue;
  plan->smem_bytes = size_t{static_cast<unsigned>(plan->stages)} * static_cast<unsigned>(plan->stage_bytes) + scratch_bytes;
  int per_sm = 0;
  if (cudaError_t err = resident_blocks(kernel, kStepThreads, plan->smem_bytes, &per_sm); err != cudaSuccess)
    return err;
  if (per_sm < 1) return cudaErrorInvalidValue;
  plan->grid = sms * per_sm;
  // With post-norms every block adds o's and down's normed outputs to its stream as it stages qkv's
  // and gate_up's inputs. A block must then have rows in both: its posts there follow its reads,
  // which is how the writers of the next outputs know that it has read the last.
  if (s.post_norms)
    plan->grid = std::min({plan->grid, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim, s.intermediate});
  plan->max_splits = std::max(ceil_div(s.max_len, kSplitMaxKeys), std::max(1, plan->grid / s.num_kv_heads));
  if (plan->max_splits > kSplitMaxKeys) return cudaErrorInvalidValue;  // the merge keeps split weights in scores
  StepParams<T> p{};
  plan->workspace_bytes = carve_workspace(s, *plan, nullptr, &p);
  return cudaSuccess;
}

template <typename T>
cudaError_t launch_decoder_step(const T* x, const DecoderStepWeights<T>& weights, T* k_cache, T* v_cache, const T* cos,
                                const T* sin, const int64_t* length, const DecoderStepShape& s,
                                const DecoderStepPlan& plan, T* out, void* workspace, cudaStream_t stream) {
  using namespace detail;
  if (decoder_step_limit(s, sizeof(T)) != DecoderStepLimit::kNone || decoder_step_misaligned(weights, k_cache, v_cache))
    return cudaErrorInvalidValue;
  StepParams<T> p{};
  carve_workspace(s, plan, workspace, &p);
  p.w = weights;
  p.s = s;
  p.x = x;
  p.out = out;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.cos = cos;
  p.sin = sin;
  p.length = length;
  p.stages = plan.stages;
  p.stage_bytes = plan.stage_bytes;
  p.max_splits = plan.max_splits;
  const auto kernel = step_kernel<T>(s);
  // The plan raised the limit on the device it ran on; a caller may launch on another.
  if (cudaError_t err = allow_dynamic_smem(kernel, plan.smem_bytes); err != cudaSuccess) return err;
  if (cudaError_t err = cudaMemsetAsync(workspace, 0, plan.workspace_bytes, stream); err != cudaSuccess)
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
  return cudaLaunchKernelEx(&config, kernel, p);
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
