// Host-visible API of the torch-free FlashHead kernels: shapes, workspace sizes, launchers.
//
// Included by host C++ (csrc/ops/ wrappers, cpp_bench/) as well as by the .cu files. Launchers
// take raw pointers, sizes and a cudaStream_t and return the launch's cudaError_t; they never
// synchronise or allocate, so they are safe inside CUDA-graph capture. Scratch memory comes from
// the caller as one `workspace` of the size the matching *_workspace_bytes() returns, which
// depends on shapes only. Every launcher is instantiated for T = float, __half, __nv_bfloat16;
// the ones that score centroids also for centroids of fp8 e4m3 (TC = __nv_fp8_e4m3, torch's
// float8_e4m3fn) with hidden rows of any T: half the bytes of bf16 centroids, which the scoring reads
// at batch 1 in about half the time.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace flashhead {

// Sizes of one head call. The ATen wrappers refuse any count a kernel loops over above 2^30: some
// loops step an int counter a few thousand past a count before testing it, which wrapped within that
// of 2^31. The vocabulary, only compared with ids, may reach 2^31 - 1.
struct HeadShape {
  int batch = 0;         // B rows of hidden
  int hidden_dim = 0;    // D
  int num_clusters = 0;  // C
  int cluster_size = 0;  // b tokens per cluster (rows of cluster_tokens)
  int vocab = 0;         // V rows of the embedding
  int probes = 0;        // p clusters kept per row
  int num_extra = 0;     // E always-on extra token ids
  int num_candidates() const { return probes * cluster_size + num_extra; }
};

// The device tensors of a head (all contiguous, row-major).
template <typename T, typename TC = T>
struct HeadTensors {
  const T* hidden = nullptr;                  // [B, D]
  const TC* centroids = nullptr;              // [C, D]
  const float* centroid_scale = nullptr;      // one float on the device, or null for 1
  const int32_t* cluster_tokens = nullptr;    // [C, b]
  const T* embedding = nullptr;               // [V, D]
  const int32_t* extra_ids = nullptr;         // [E], may be null when E == 0
};

// Temperature sampling. The seed is read on the device so a captured graph can be replayed with
// fresh seeds written into the same tensor.
struct Sampling {
  float temperature = 1.0f;
  const int64_t* seed = nullptr;  // one int64 on the device
};

// Programmatic dependent launch lets each kernel of an op, the first one included, start while the
// stream's previous kernel drains; each waits for that kernel before reading anything it may have
// written (fused_linear's weight_before_wait aside). Used only where the device (compute capability
// 9.0+) and the kernel's build (PTX 9.0+) have it; false orders every kernel after all work before it.
struct LaunchOptions {
  bool dependent_launch = true;
};

// ---- Stages ---------------------------------------------------------------------------------

// scores[B, C] = (hidden . centroids^T) * *centroid_scale in fp32 (the scale is read on the device,
// so fp8 centroids quantized with one can be replaced in place under a captured graph; null for 1);
// with `sampling`, also Gumbel keys keys[B, C] = scores / T + gumbel(seed, kClusterStream, row, cluster).
// `presets`: words the kernel also sets, for kernels after it that poll or fold into them (the
// fused decode's, whose workspace is fresh memory on every call).
// With dependent launch the kernel may start while the stream's previous kernel drains; it waits
// for that kernel before its first memory access, so any input may be that kernel's output.
struct WorkspacePresets {
  unsigned long long* zeroed = nullptr;  // [zeroed_words], set to 0
  int64_t zeroed_words = 0;
  int32_t* unset_ids = nullptr;  // [unset_count], set to -1
  int64_t unset_count = 0;
};
template <typename T, typename TC>
cudaError_t launch_centroid_scores(const T* hidden, const TC* centroids, const float* centroid_scale, int batch,
                                   int num_clusters, int hidden_dim, float* scores, const Sampling* sampling, float* keys,
                                   cudaStream_t stream, const WorkspacePresets& presets = {},
                                   const LaunchOptions& options = {});

// How the selection lists a row's clusters: in any order (the fastest), in an order that is the
// same on every run (for a consumer whose float sums follow it), or in rank order (best first).
enum class SelectOrder { kAny, kStable, kRanked };

// The `probes` best clusters per row by `keys` [B, C] (ties to the smaller cluster id, NaN as -inf),
// listed in `order`. Writes any of the non-null outputs:
// cluster_ids / selected_scores [B, p] (the latter read from `scores` [B, C]). row_tickets [B]
// and extra_repeats [B, shape.num_extra] are zeroed for a kernel that follows (the fused
// decode's candidate kernel).
struct RowTicket {
  uint32_t arrivals;        // blocks of the row done
  unsigned long long best;  // greedy: the packed (key, token) maximum they fold into
};
struct SelectOutputs {
  int32_t* cluster_ids = nullptr;
  float* selected_scores = nullptr;
  const float* scores = nullptr;  // needed with selected_scores
  RowTicket* row_tickets = nullptr;
  uint32_t* extra_repeats = nullptr;
  // Greedy decodes by claimed cluster (batches of up to kClaimedMaxRows rows, decode.cuh):
  // claims[1 + c] gets bit r where row r chose cluster c. The rows of a cluster go in groups of
  // kClaimedGroupRows, in the order their bits land: the row that opens a group lists it in
  // claimed_groups as c * kClaimedGroupsMax + g, counting in claims[0]. Zero on entry.
  unsigned long long* claims = nullptr;
  int32_t* claimed_groups = nullptr;
};
constexpr int kClaimedMaxRows = 64;  // a cluster's claims are one 64-bit mask
constexpr int kClaimedGroupRows = 4;
constexpr int kClaimedGroupsMax = kClaimedMaxRows / kClaimedGroupRows;
size_t select_workspace_bytes(const HeadShape& shape, SelectOrder order);
cudaError_t launch_select(const float* keys, const HeadShape& shape, SelectOrder order, const SelectOutputs& out,
                          void* workspace, cudaStream_t stream, const LaunchOptions& options = {});

// candidates[B, probes*b + E]: the tokens of the given clusters, a row of -1 for an out-of-range
// cluster id, then the extra ids, each masked to -1 if already present or repeated.
cudaError_t launch_gather_candidates(const int32_t* cluster_ids, int batch, int probes, const int32_t* cluster_tokens,
                                     int num_clusters, int cluster_size, const int32_t* extra_ids, int num_extra,
                                     int32_t* candidates, cudaStream_t stream);

// logits[B, N] = embedding[candidates] . hidden in fp32; -inf where the id is outside [0, V).
template <typename T>
cudaError_t launch_candidate_logits(const T* hidden, const T* embedding, int batch, int vocab, int hidden_dim,
                                    const int32_t* candidates, int num_candidates, float* logits, cudaStream_t stream);

// ---- Whole ops ------------------------------------------------------------------------------

// select_clusters / sample_clusters: cluster_ids and scores [B, p] in rank order.
size_t cluster_select_workspace_bytes(const HeadShape& shape, bool sampling);
template <typename T, typename TC>
cudaError_t launch_cluster_select(const T* hidden, const TC* centroids, const float* centroid_scale,
                                  const HeadShape& shape, const Sampling* sampling, int32_t* cluster_ids, float* scores,
                                  void* workspace, cudaStream_t stream, const LaunchOptions& options = {});

// decode_greedy: token id per row into tokens[row * token_stride] (-1 when every candidate is masked).
// decode_sample (sampling non-null): a Gumbel-max draw from softmax(logits / T) over the
// candidates of p clusters drawn without replacement, plus its log-probability token_logprobs[B].
// cudaErrorInvalidValue for probes outside [1, C], before anything is read or launched.
size_t decode_workspace_bytes(const HeadShape& shape, bool sampling);
template <typename T, typename TC>
cudaError_t launch_decode(const HeadTensors<T, TC>& tensors, const HeadShape& shape, const Sampling* sampling,
                          int64_t* tokens, int64_t token_stride, float* token_logprobs, void* workspace,
                          cudaStream_t stream, const LaunchOptions& options = {});

// ---- Decoder-layer ops (csrc/kernels/decoder_layer.cu) ------------------------------------------

// out[M, N] = (residual +) round(h . weight^T (+ bias)), h = x (plain), RMSNorm(x) * norm_weight
// (norm_weight non-null), or silu(gate) * up with x = [gate | up] of 2K columns (gated).
// Bandwidth-bound GEMV for a few tokens; any M works, each 8 tokens re-read the weight.
// With dependent launch the kernel waits for the previous kernel before reading any input, except,
// with weight_before_wait, the weight: for a caller that knows that kernel did not write it (model
// weights), the first weight loads then overlap its drain.
// Tokens go to the grid's y in blocks of up to 8, and y takes at most 65,535 blocks: the launcher
// returns cudaErrorInvalidValue past them, as do the two below past theirs.
constexpr int kFusedLinearTokensPerBlock = 8;
constexpr int64_t kFusedLinearMaxTokens = int64_t{65535} * kFusedLinearTokensPerBlock;
template <typename T>
cudaError_t launch_fused_linear(const T* x, const T* weight, const T* norm_weight, bool gated, float eps,
                                const T* residual, const T* bias, T* out, int tokens, int out_features,
                                int in_features, cudaStream_t stream, const LaunchOptions& options = {},
                                bool weight_before_wait = false);

// Rotary embedding (after the optional q/k RMSNorms) of the query and key heads of qkv
// [M, (H + 2 KV) hd] at positions *length + i; keys and values go to the caches [KV, max_len, hd],
// the rotated queries to q_out [M, H, hd]. A position outside the cache writes nothing and
// gives NaN queries. The heads (H + KV) are the grid's y: at most 65,535.
constexpr int64_t kRotaryMaxHeads = 65535;
template <typename T>
cudaError_t launch_rotary_cache_write(const T* qkv, const T* cos, const T* sin, const int64_t* length, const T* q_norm,
                                      const T* k_norm, float eps, T* k_cache, T* v_cache, T* q_out, int tokens,
                                      int num_heads, int num_kv_heads, int head_dim, int max_len, cudaStream_t stream,
                                      const LaunchOptions& options = {});

// out[M, H hd]: token i's heads attend to cache positions 0 .. *length + i (clipped to the cache).
// head_dim <= 256.
constexpr int kDecodeAttentionMaxHeadDim = 256;
size_t decode_attention_workspace_bytes(int tokens, int num_heads, int head_dim, int max_len);
// The KV heads are the grid's y and the tiles of a KV head's query rows (num_heads / num_kv_heads
// * tokens rows, up to 32 a tile) its z: at most 65,535 each.
constexpr int64_t kDecodeAttentionMaxGridYZ = 65535;
int64_t decode_attention_tiles(int tokens, int num_heads, int num_kv_heads, int head_dim, int element_bytes);
template <typename T>
cudaError_t launch_decode_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* length, float scale,
                                    T* out, int tokens, int num_heads, int num_kv_heads, int head_dim, int max_len,
                                    void* workspace, cudaStream_t stream, const LaunchOptions& options = {});

// ---- One-token decoder step (csrc/kernels/decoder_step.cu) -------------------------------------

// A Llama / Qwen2 / Qwen3 / Gemma-2 / Gemma-3 decoder's shape; its weights stacked over layers, [layers, rows,
// columns]: qkv [(H + 2 KV) hd, D], o [D, H hd], gate_up [2 I, D] (gate rows, then up rows), down
// [D, I], attn_norm / mlp_norm [D], q_norm / k_norm [hd] (both null when the model has none),
// qkv_bias [(H + 2 KV) hd] (null when the model has none: Qwen2 has them), post_attn_norm /
// post_mlp_norm [D] (Gemma-3's norms of the attention's and the MLP's outputs before their residual
// adds; both null when the model has none, and post_norms says which).
// Sliding-window layers (bit i of sliding_layers for layer i) attend to the last sliding_window
// positions only and rotate by sliding_cos / sliding_sin (cos / sin when those are null).
// The first layer's input is x times input_scale, rounded to T (Gemma-3's embedding scale, which
// would otherwise cost a kernel of its own before the step). attn_softcap > 0 caps every attention
// score s (after the softmax scale) as attn_softcap * tanh(s / attn_softcap) (Gemma-2); 0: no cap.
constexpr int kDecoderStepMaxSlidingLayers = 256;
enum class DecoderStepActivation : int { kSilu = 0, kGeluTanh = 1 };
struct DecoderStepShape {
  int layers, hidden, intermediate, num_heads, num_kv_heads, head_dim, max_len;
  float eps, scale;
  DecoderStepActivation activation = DecoderStepActivation::kSilu;
  bool post_norms = false;
  int sliding_window = 0;
  uint64_t sliding_layers[kDecoderStepMaxSlidingLayers / 64] = {};
  float input_scale = 1.0f;
  float attn_softcap = 0.0f;
};
template <typename T>
struct DecoderStepWeights {
  const T* qkv;
  const T* o;
  const T* gate_up;
  const T* down;
  const T* attn_norm;
  const T* mlp_norm;
  const T* q_norm;
  const T* k_norm;
  const T* qkv_bias;
  const T* post_attn_norm = nullptr;
  const T* post_mlp_norm = nullptr;
  const T* sliding_cos = nullptr;
  const T* sliding_sin = nullptr;
};

// Weight rows stream through shared-memory stages of at least this many bytes: a row (a gate and
// an up row for gate_up) must fit one. Rows and heads must be whole 16-byte vectors; head_dim at
// most 256, at most 8 query heads per KV head, max_len at most 512 * 512 (the merge's split weights).
constexpr int kDecoderStepStageBytes = 32 * 1024;
// Stages grow up to this size while shared memory still holds three of them (the plan): every
// chunk costs a fixed wait, hand-over and issue, so fewer, larger chunks a layer are faster.
constexpr int kDecoderStepMaxStageBytes = 64 * 1024;
constexpr int kDecoderStepMaxHeadDim = 256;
constexpr int kDecoderStepMaxGroup = 8;
constexpr int kDecoderStepMaxLen = 512 * 512;

// The first of these limits a shape breaks with elements of `element_bytes` (kShape: a dimension
// not positive, or heads not a multiple of KV heads); the one statement of them, which the plan
// enforces and the ATen wrapper turns into its messages.
// kCacheElements: a cache of 2^31 elements or more (layers * KV heads * max_len * head_dim). The
// kernel's cache offsets are int64, but no cache that large was ever run: the limit stays the
// wrapper's, now here for every caller.
enum class DecoderStepLimit { kNone, kShape, kHeadDim, kWholeVectors, kGroup, kMaxLen, kRowBytes, kCacheElements };
DecoderStepLimit decoder_step_limit(const DecoderStepShape& shape, int element_bytes);

// The argument name of the first of the four weights and the two caches that does not start at a
// 16-byte aligned address, or null: the kernel moves their rows by bulk copies of whole 16-byte
// vectors (x and the norms it reads an element at a time, from anywhere). The one list of them:
// launch_decoder_step refuses such pointers, and the ATen wrapper names the argument.
template <typename T>
const char* decoder_step_misaligned(const DecoderStepWeights<T>& weights, const T* k_cache, const T* v_cache) {
  const struct {
    const void* data;
    const char* name;
  } pointers[] = {{weights.qkv, "qkv_weight"}, {weights.o, "o_weight"}, {weights.gate_up, "gate_up_weight"},
                  {weights.down, "down_weight"}, {k_cache, "k_cache"},  {v_cache, "v_cache"}};
  for (const auto& pointer : pointers)
    if (reinterpret_cast<uintptr_t>(pointer.data) % 16 != 0) return pointer.name;
  return nullptr;
}

// How a step runs on the current device: one resident block per SM, its shared memory, the
// workspace it needs. cudaErrorInvalidValue when the shape breaks a limit (decoder_step_limit) or
// does not fit shared memory.
struct DecoderStepPlan {
  int grid, stages, stage_bytes, max_splits;
  size_t smem_bytes, workspace_bytes;
};
template <typename T>
cudaError_t plan_decoder_step(const DecoderStepShape& shape, DecoderStepPlan* plan);

// out[D] = the residual stream of token x[D] at position *length after every layer (no final
// norm); each layer's K/V of the token go to k_cache / v_cache [layers, KV, max_len, hd]. The
// same values as fused_linear, rotary_cache_write, decode_attention and fused_linear again per
// layer (with post-norms, an RMSNorm of each output before its residual add), as one persistent
// (cooperative) kernel. A position outside the cache gives NaN and writes nothing. A shape past a
// limit, or pointers that decoder_step_misaligned names, give cudaErrorInvalidValue before anything
// asks the device.
template <typename T>
cudaError_t launch_decoder_step(const T* x, const DecoderStepWeights<T>& weights, T* k_cache, T* v_cache, const T* cos,
                                const T* sin, const int64_t* length, const DecoderStepShape& shape,
                                const DecoderStepPlan& plan, T* out, void* workspace, cudaStream_t stream);

}  // namespace flashhead
