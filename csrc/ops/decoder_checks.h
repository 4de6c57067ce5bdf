// Argument checks of the decoder-layer ops (fused_linear, rotary_cache_write, decode_attention,
// decoder_step), shared by the CPU references and the CUDA wrappers. Metadata only: the cache length is a device
// tensor and is never read here, so the ops stay free of host syncs.
#pragma once

#include <c10/util/string_view.h>

#include <initializer_list>
#include <utility>
#include <vector>

#include "ops/checks.h"

namespace flashhead {

inline void check_float_tensor(const char* op, const at::Tensor& t, const char* name) {
  FH_CHECK_TYPE(op, is_float_dtype(t.scalar_type()), name, " must be float16, bfloat16 or float32, got ",
                dtype_str(t.scalar_type()));
}

inline void check_like(const char* op, const at::Tensor& t, const char* name, const at::Tensor& ref,
                       const char* ref_name) {
  check_defined(op, t, name);
  FH_CHECK_TYPE(op, t.scalar_type() == ref.scalar_type(), name, " must have the dtype of ", ref_name, " (",
                dtype_str(ref.scalar_type()), "), got ", dtype_str(t.scalar_type()));
  check_same_device(op, t, name, ref, ref_name);
}

inline void check_shape(const char* op, const at::Tensor& t, const char* name, at::IntArrayRef expected) {
  FH_CHECK_VALUE(op, t.sizes() == expected, name, " must have shape ", shape_str(expected), ", got ",
                 shape_str(t.sizes()));
}

// The same, for a shape worked out from other arguments: `layout` says from which.
inline void check_shape(const char* op, const at::Tensor& t, const char* name, const char* layout,
                        at::IntArrayRef expected) {
  FH_CHECK_VALUE(op, t.sizes() == expected, name, " must have shape ", layout, " = ", shape_str(expected),
                 ", got shape ", shape_str(t.sizes()));
}

// The cache length: one int64 on the device of the cache (read by the kernels, never by the host).
inline void check_length(const char* op, const at::Tensor& length, const at::Tensor& ref, const char* ref_name) {
  check_defined(op, length, "length");
  FH_CHECK_TYPE(op, length.scalar_type() == at::kLong, "length must be an int64 tensor, got ",
                dtype_str(length.scalar_type()));
  FH_CHECK_VALUE(op, length.numel() == 1, "length must hold exactly one value, got shape ",
                 shape_str(length.sizes()));
  check_same_device(op, length, "length", ref, ref_name);
}

// The K and V caches of one layer ([num_kv_heads, max_len, head_dim]) or of every layer (a leading
// num_layers): ref's dtype and device, one shape, non-empty.
inline void check_kv_cache(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& ref,
                           const char* ref_name, int64_t rank, const char* layout) {
  check_rank(op, k_cache, "k_cache", rank, layout);
  check_like(op, k_cache, "k_cache", ref, ref_name);
  check_like(op, v_cache, "v_cache", ref, ref_name);
  FH_CHECK_VALUE(op, v_cache.sizes() == k_cache.sizes(), "k_cache and v_cache must have one shape ", layout,
                 ", got ", shape_str(k_cache.sizes()), " and ", shape_str(v_cache.sizes()));
  FH_CHECK_VALUE(op, k_cache.numel() > 0, "k_cache must be non-empty, got shape ", shape_str(k_cache.sizes()));
}

// Caches the op writes in place: contiguous, and apart (one cache for both would hold the values
// over the keys).
inline void check_written_kv_cache(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  FH_CHECK_VALUE(op, k_cache.is_contiguous() && v_cache.is_contiguous(),
                 "k_cache and v_cache must be contiguous (they are written in place)");
  FH_CHECK_VALUE(op, !share_bytes(k_cache, v_cache),
                 "k_cache and v_cache must not share memory (the values would overwrite the keys)");
}

// What the op reads while it writes the caches: apart from both, as decode_greedy_out's out is
// from its inputs, since on CUDA one block's cache write may land where another block still reads.
inline void check_apart_from_caches(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    std::initializer_list<std::pair<const at::Tensor*, const char*>> inputs) {
  for (const auto& [input, name] : inputs) {
    if (input == nullptr) continue;
    for (const auto& [cache, cache_name] : {std::pair{&k_cache, "k_cache"}, std::pair{&v_cache, "v_cache"}})
      FH_CHECK_VALUE(op, !share_bytes(*input, *cache), name, " must not share memory with ", cache_name,
                     " (it is read while the caches are written)");
  }
}

inline const at::Tensor* optional_ptr(const c10::optional<at::Tensor>& t) { return t.has_value() ? &*t : nullptr; }

// Far above any model's head count; it keeps the shape products the checks compare (for example
// (num_heads + 2 * num_kv_heads) * head_dim) from overflowing int64.
constexpr int64_t kMaxHeads = int64_t{1} << 16;

inline void check_num_heads(const char* op, int64_t num_heads, int64_t kv, const char* kv_where) {
  FH_CHECK_VALUE(op, num_heads >= 1 && num_heads <= kMaxHeads && num_heads % kv == 0,
                 "num_heads must be a positive multiple of num_kv_heads (", num_str(kv), ", ", kv_where, ") up to ",
                 num_str(kMaxHeads), ", got ", num_str(num_heads));
}

// Scores are multiplied by the scale in float32, so a huge one overflows them (the attention then
// gives NaN). The bound keeps well inside that; softmax scales are 1 / sqrt(head_dim) or similar.
constexpr double kMaxAttentionScale = 1e6;

inline void check_attention_scale(const char* op, double scale) {
  FH_CHECK_VALUE(op, scale > 0.0 && scale <= kMaxAttentionScale, "scale must be in (0, ", num_str(kMaxAttentionScale),
                 "], got ", num_str(scale));
}

// x [M, K] (gated: [M, 2K] holding gate then up), weight [N, K], norm_weight [K], residual [M, N],
// bias [N].
inline void check_fused_linear(const char* op, const at::Tensor& x, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& norm_weight, double eps, bool gated,
                               const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& bias) {
  check_rank(op, x, "x", 2, "[tokens, in_features]");
  check_float_tensor(op, x, "x");
  check_rank(op, weight, "weight", 2, "[out_features, in_features]");
  check_like(op, weight, "weight", x, "x");
  // No tokens (x [0, K]) gives [0, N], as F.linear does.
  FH_CHECK_VALUE(op, weight.size(0) > 0 && weight.size(1) > 0, "weight must be non-empty, got shape ",
                 shape_str(weight.sizes()));
  const int64_t in_features = weight.size(1);
  FH_CHECK_VALUE(op, x.size(1) == (gated ? 2 : 1) * in_features, "x must have ",
                 gated ? "2 * in_features (gated: gate then up) = " : "in_features = ",
                 num_str((gated ? 2 : 1) * in_features), " columns for weight of shape ", shape_str(weight.sizes()),
                 ", got shape ", shape_str(x.sizes()));
  FH_CHECK_VALUE(op, !(gated && norm_weight.has_value()), "norm_weight and gated cannot be combined");
  if (norm_weight.has_value()) {
    check_like(op, *norm_weight, "norm_weight", x, "x");
    check_shape(op, *norm_weight, "norm_weight", {in_features});
    FH_CHECK_VALUE(op, std::isfinite(eps) && eps >= 0.0, "eps must be a finite number >= 0, got ", num_str(eps));
  }
  if (residual.has_value()) {
    check_like(op, *residual, "residual", x, "x");
    check_shape(op, *residual, "residual", "[x.size(0), weight.size(0)]", {x.size(0), weight.size(0)});
  }
  if (bias.has_value()) {
    check_like(op, *bias, "bias", x, "x");
    check_shape(op, *bias, "bias", "[weight.size(0)]", {weight.size(0)});
  }
}

// qkv [M, (H + 2 KV) hd], cos / sin [max_len, hd], q_norm / k_norm [hd] (both or neither).
inline void check_rotary_cache_write(const char* op, const at::Tensor& qkv, const at::Tensor& cos,
                                     const at::Tensor& sin, const at::Tensor& length, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, int64_t num_heads,
                                     const c10::optional<at::Tensor>& q_norm,
                                     const c10::optional<at::Tensor>& k_norm, double eps) {
  check_rank(op, qkv, "qkv", 2, "[tokens, (num_heads + 2 * num_kv_heads) * head_dim]");
  check_float_tensor(op, qkv, "qkv");
  check_kv_cache(op, k_cache, v_cache, qkv, "qkv", 3, "[num_kv_heads, max_len, head_dim]");
  check_length(op, length, qkv, "qkv");
  check_written_kv_cache(op, k_cache, v_cache);
  const int64_t kv = k_cache.size(0), max_len = k_cache.size(1), hd = k_cache.size(2);
  check_num_heads(op, num_heads, kv, "k_cache.size(0)");
  FH_CHECK_VALUE(op, hd % 2 == 0, "head_dim (k_cache.size(2)) must be even for rotary embeddings, got ", num_str(hd));
  FH_CHECK_VALUE(op, qkv.size(0) > 0 && qkv.size(1) == (num_heads + 2 * kv) * hd, "qkv must have (num_heads + 2 * ",
                 "num_kv_heads) * head_dim = ", num_str((num_heads + 2 * kv) * hd), " columns and at least one row, ",
                 "got shape ", shape_str(qkv.sizes()));
  check_like(op, cos, "cos", qkv, "qkv");
  check_shape(op, cos, "cos", {max_len, hd});
  check_like(op, sin, "sin", qkv, "qkv");
  check_shape(op, sin, "sin", {max_len, hd});
  FH_CHECK_VALUE(op, q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm must be given together");
  if (q_norm.has_value()) {
    check_like(op, *q_norm, "q_norm", qkv, "qkv");
    check_shape(op, *q_norm, "q_norm", {hd});
    check_like(op, *k_norm, "k_norm", qkv, "qkv");
    check_shape(op, *k_norm, "k_norm", {hd});
    FH_CHECK_VALUE(op, std::isfinite(eps) && eps >= 0.0, "eps must be a finite number >= 0, got ", num_str(eps));
  }
  check_apart_from_caches(op, k_cache, v_cache,
                          {{&qkv, "qkv"}, {&cos, "cos"}, {&sin, "sin"}, {&length, "length"},
                           {optional_ptr(q_norm), "q_norm"}, {optional_ptr(k_norm), "k_norm"}});
}

// q [M, H, hd] against one layer's cache; H a multiple of num_kv_heads.
inline void check_decode_attention(const char* op, const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& length, double scale) {
  check_rank(op, q, "q", 3, "[tokens, num_heads, head_dim]");
  check_float_tensor(op, q, "q");
  check_kv_cache(op, k_cache, v_cache, q, "q", 3, "[num_kv_heads, max_len, head_dim]");
  check_length(op, length, q, "q");
  FH_CHECK_VALUE(op, q.size(0) > 0 && q.size(1) > 0 && q.size(1) % k_cache.size(0) == 0 &&
                         q.size(2) == k_cache.size(2),
                 "q must be [tokens >= 1, a multiple of num_kv_heads (", num_str(k_cache.size(0)), "), head_dim ",
                 num_str(k_cache.size(2)), "], got shape ", shape_str(q.sizes()));
  check_attention_scale(op, scale);
}

// A per-layer stack of the decoder step, [num_layers, ...]: rank, x's dtype and device, shape.
inline void check_stacked(const char* op, const at::Tensor& t, const char* name, const char* layout,
                          at::IntArrayRef expected, const at::Tensor& x) {
  check_rank(op, t, name, static_cast<int64_t>(expected.size()), layout);
  check_like(op, t, name, x, "x");
  check_shape(op, t, name, layout, expected);
}

// decoder_step's arguments beyond the Llama layer's: Qwen2's q/k/v biases; Gemma-3's norms of the
// attention's and the MLP's outputs (post-norms), GELU, sliding-window layers with their own
// rotary tables, and the scale of the first layer's input (its embedding scale); Gemma-2's cap on
// the attention scores (0: none).
struct DecoderStepOptions {
  c10::optional<at::Tensor> qkv_bias, post_attn_norm, post_mlp_norm, sliding_cos, sliding_sin;
  bool gelu = false;
  int64_t sliding_window = 0;
  std::vector<int64_t> sliding_layers;
  double input_scale = 1.0;
  double attn_softcap = 0.0;
};

inline DecoderStepOptions decoder_step_options(const char* op, const c10::optional<at::Tensor>& qkv_bias,
                                               const c10::optional<at::Tensor>& post_attn_norm,
                                               const c10::optional<at::Tensor>& post_mlp_norm,
                                               c10::string_view activation, int64_t sliding_window,
                                               at::IntArrayRef sliding_layers,
                                               const c10::optional<at::Tensor>& sliding_cos,
                                               const c10::optional<at::Tensor>& sliding_sin, double input_scale,
                                               double attn_softcap) {
  FH_CHECK_VALUE(op, activation == "silu" || activation == "gelu_tanh",
                 "activation must be 'silu' or 'gelu_tanh', got '", std::string(activation.data(), activation.size()), "'");
  return {qkv_bias,
          post_attn_norm,
          post_mlp_norm,
          sliding_cos,
          sliding_sin,
          activation == "gelu_tanh",
          sliding_window,
          std::vector<int64_t>(sliding_layers.begin(), sliding_layers.end()),
          input_scale,
          attn_softcap};
}

// One token through every layer of a decoder, weights stacked per kind along a leading layer
// dimension. num_layers, num_kv_heads, max_len and head_dim are read from k_cache, hidden_size
// from x, intermediate_size from gate_up_weight; every other tensor must agree with them:
// x [1, D], qkv_weight [L, (H + 2 KV) hd, D], o_weight [L, D, H hd], gate_up_weight [L, 2 I, D]
// (gate rows, then up rows), down_weight [L, D, I], attn_norm / mlp_norm [L, D], q_norm / k_norm
// [L, hd] (both or neither), k_cache / v_cache [L, KV, max_len, hd] (contiguous, written in
// place), cos / sin [max_len, hd], length one int64 on x's device; the options' qkv_bias [L, (H +
// 2 KV) hd], post_attn_norm / post_mlp_norm [L, D] (both or neither), sliding_cos / sliding_sin
// [max_len, hd] (both or neither), sliding_layers distinct layer indices, sliding_window >= 1 when
// there are any (else >= 0), input_scale finite in float32 (the precision it is applied in),
// attn_softcap 0 (no cap) or positive and finite in float32.
inline void check_decoder_step(const char* op, const at::Tensor& x, const at::Tensor& qkv_weight,
                               const at::Tensor& o_weight, const at::Tensor& gate_up_weight,
                               const at::Tensor& down_weight, const at::Tensor& attn_norm,
                               const at::Tensor& mlp_norm, const c10::optional<at::Tensor>& q_norm,
                               const c10::optional<at::Tensor>& k_norm, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin,
                               const at::Tensor& length, int64_t num_heads, double eps, double scale,
                               const DecoderStepOptions& options) {
  const auto& qkv_bias = options.qkv_bias;
  check_rank(op, x, "x", 2, "[1, hidden_size] (one token)");
  check_float_tensor(op, x, "x");
  FH_CHECK_VALUE(op, x.size(0) == 1 && x.size(1) > 0, "x must have shape [1, hidden_size >= 1] (one token), got shape ",
                 shape_str(x.sizes()));
  const int64_t D = x.size(1);

  check_kv_cache(op, k_cache, v_cache, x, "x", 4, "[num_layers, num_kv_heads, max_len, head_dim]");
  check_written_kv_cache(op, k_cache, v_cache);
  const int64_t L = k_cache.size(0), kv = k_cache.size(1), max_len = k_cache.size(2), hd = k_cache.size(3);
  // Named apart from the weights' shapes below: either side may be the wrong one.
  FH_CHECK_VALUE(op, qkv_weight.dim() != 3 || qkv_weight.size(0) == L,
                 "qkv_weight and k_cache must have one num_layers (their size(0)), got ", num_str(qkv_weight.size(0)),
                 " and ", num_str(L));
  FH_CHECK_VALUE(op, qkv_weight.dim() != 3 || qkv_weight.size(2) == D,
                 "qkv_weight and x must have one hidden_size (qkv_weight.size(2) and x.size(1)), got ",
                 num_str(qkv_weight.size(2)), " and ", num_str(D));
  check_num_heads(op, num_heads, kv, "k_cache.size(1)");
  FH_CHECK_VALUE(op, hd % 2 == 0, "head_dim (k_cache.size(3)) must be even for rotary embeddings, got ", num_str(hd));
  check_length(op, length, x, "x");

  check_stacked(op, qkv_weight, "qkv_weight", "[num_layers, (num_heads + 2 * num_kv_heads) * head_dim, hidden_size]",
                {L, (num_heads + 2 * kv) * hd, D}, x);
  if (qkv_bias.has_value())
    check_stacked(op, *qkv_bias, "qkv_bias", "[num_layers, (num_heads + 2 * num_kv_heads) * head_dim]",
                  {L, (num_heads + 2 * kv) * hd}, x);
  check_stacked(op, o_weight, "o_weight", "[num_layers, hidden_size, num_heads * head_dim]", {L, D, num_heads * hd}, x);
  check_rank(op, gate_up_weight, "gate_up_weight", 3, "[num_layers, 2 * intermediate_size, hidden_size]");
  check_like(op, gate_up_weight, "gate_up_weight", x, "x");
  FH_CHECK_VALUE(op, gate_up_weight.size(0) == L && gate_up_weight.size(1) > 0 && gate_up_weight.size(1) % 2 == 0 &&
                         gate_up_weight.size(2) == D,
                 "gate_up_weight must have shape [num_layers = ", num_str(L), ", 2 * intermediate_size (gate rows, ",
                 "then up rows; even and >= 2), hidden_size = ", num_str(D), "], got shape ",
                 shape_str(gate_up_weight.sizes()));
  const int64_t I = gate_up_weight.size(1) / 2;
  // Named apart from down_weight's shape, as num_layers and hidden_size above: either may be wrong.
  FH_CHECK_VALUE(op, down_weight.dim() != 3 || down_weight.size(2) == I,
                 "gate_up_weight and down_weight must have one intermediate_size (gate_up_weight.size(1) / 2 and ",
                 "down_weight.size(2)), got ", num_str(I), " and ", num_str(down_weight.size(2)));
  check_stacked(op, down_weight, "down_weight", "[num_layers, hidden_size, intermediate_size]", {L, D, I}, x);
  check_stacked(op, attn_norm, "attn_norm", "[num_layers, hidden_size]", {L, D}, x);
  check_stacked(op, mlp_norm, "mlp_norm", "[num_layers, hidden_size]", {L, D}, x);
  FH_CHECK_VALUE(op, q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm must be given together");
  if (q_norm.has_value()) {
    check_stacked(op, *q_norm, "q_norm", "[num_layers, head_dim]", {L, hd}, x);
    check_stacked(op, *k_norm, "k_norm", "[num_layers, head_dim]", {L, hd}, x);
  }
  check_like(op, cos, "cos", x, "x");
  check_shape(op, cos, "cos", {max_len, hd});
  check_like(op, sin, "sin", x, "x");
  check_shape(op, sin, "sin", {max_len, hd});
  FH_CHECK_VALUE(op, options.post_attn_norm.has_value() == options.post_mlp_norm.has_value(),
                 "post_attn_norm and post_mlp_norm must be given together");
  if (options.post_attn_norm.has_value()) {
    check_stacked(op, *options.post_attn_norm, "post_attn_norm", "[num_layers, hidden_size]", {L, D}, x);
    check_stacked(op, *options.post_mlp_norm, "post_mlp_norm", "[num_layers, hidden_size]", {L, D}, x);
  }
  FH_CHECK_VALUE(op, options.sliding_cos.has_value() == options.sliding_sin.has_value(),
                 "sliding_cos and sliding_sin must be given together");
  if (options.sliding_cos.has_value()) {
    check_like(op, *options.sliding_cos, "sliding_cos", x, "x");
    check_shape(op, *options.sliding_cos, "sliding_cos", {max_len, hd});
    check_like(op, *options.sliding_sin, "sliding_sin", x, "x");
    check_shape(op, *options.sliding_sin, "sliding_sin", {max_len, hd});
  }
  std::vector<bool> seen(static_cast<size_t>(L), false);
  for (const int64_t layer : options.sliding_layers) {
    FH_CHECK_VALUE(op, layer >= 0 && layer < L, "sliding_layers must hold layer indices in [0, ", num_str(L),
                   "), got ", num_str(layer));
    FH_CHECK_VALUE(op, !seen[static_cast<size_t>(layer)], "sliding_layers must not repeat a layer, got ",
                   num_str(layer), " twice");
    seen[static_cast<size_t>(layer)] = true;
  }
  FH_CHECK_VALUE(op, options.sliding_window >= (options.sliding_layers.empty() ? 0 : 1),
                 "sliding_window must be ", options.sliding_layers.empty() ? ">= 0" : ">= 1 when sliding_layers are given",
                 ", got ", num_str(options.sliding_window));
  FH_CHECK_VALUE(op, std::isfinite(eps) && eps >= 0.0, "eps must be a finite number >= 0, got ", num_str(eps));
  check_attention_scale(op, scale);
  FH_CHECK_VALUE(op, std::isfinite(static_cast<float>(options.input_scale)),
                 "input_scale must be a number that is finite in float32, got ", num_str(options.input_scale));
  const float softcap = static_cast<float>(options.attn_softcap);
  FH_CHECK_VALUE(op, options.attn_softcap == 0.0 || (std::isfinite(softcap) && softcap > 0.0f),
                 "attn_softcap must be 0 (no cap) or a positive number finite in float32, got ",
                 num_str(options.attn_softcap));
  check_apart_from_caches(
      op, k_cache, v_cache,
      {{&x, "x"}, {&qkv_weight, "qkv_weight"}, {&o_weight, "o_weight"}, {&gate_up_weight, "gate_up_weight"},
       {&down_weight, "down_weight"}, {&attn_norm, "attn_norm"}, {&mlp_norm, "mlp_norm"},
       {optional_ptr(q_norm), "q_norm"}, {optional_ptr(k_norm), "k_norm"}, {&cos, "cos"}, {&sin, "sin"},
       {&length, "length"}, {optional_ptr(qkv_bias), "qkv_bias"},
       {optional_ptr(options.post_attn_norm), "post_attn_norm"}, {optional_ptr(options.post_mlp_norm), "post_mlp_norm"},
       {optional_ptr(options.sliding_cos), "sliding_cos"}, {optional_ptr(options.sliding_sin), "sliding_sin"}});
}

}  // namespace flashhead
