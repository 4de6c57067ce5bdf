// CPU references of the decoder-layer ops (fused_linear, rotary_cache_write, decode_attention, and
// decoder_step, their composition over every layer of a decoder): plain ATen, float32 arithmetic
// where the semantics (docs/kernels.md) say so, rounded to the input dtype T exactly where they
// say so. The CUDA kernels are tested against these. Unlike the CUDA ops they read the cache
// length on the host, which is free on the CPU.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "cpu/float_rows.h"
#include "ops/decoder_checks.h"

namespace flashhead {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// RMSNorm over the last dimension, normalised and scaled in float32 and rounded once to the
// input's dtype (torch.nn.functional.rms_norm's fused kernels do the same; older composite ones
// rounded before the scale, hence no call to at::rms_norm here).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto xf = float_rows(x);  // a strided x (a head of qkv) was summed in another order
  auto inv_rms = at::rsqrt(xf.square().mean(-1, /*keepdim=*/true) + eps);
  return (xf * inv_rms * weight.to(at::kFloat)).to(x.scalar_type());
}

// fused_linear with GELU (tanh) as the gate's activation when `gelu` (decoder_step's Gemma-3 MLP).
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& norm_weight,
                  double eps, bool gated, const c10::optional<at::Tensor>& residual,
                  const c10::optional<at::Tensor>& bias, bool gelu) {
  at::Tensor h = x;
  if (norm_weight.has_value()) h = rms_norm(x, *norm_weight, eps);
  if (gated) {
    // Gate columns, then up columns, each made contiguous: the activation's vectorised and strided
    // loops round differently, so a column-major x changed the last bits.
    auto halves = x.chunk(2, 1);
    for (auto& half : halves) half = half.contiguous();
    h = (gelu ? at::gelu(halves[0], "tanh") : at::silu(halves[0])) * halves[1];
  }
  // Products of the stored values summed in float32, the bias added, rounded once (contiguous
  // float32 copies, so the summation order does not depend on the caller's layout).
  auto y = at::matmul(float_rows(h), float_rows(weight).t());
  if (bias.has_value()) y = y + bias->to(at::kFloat);
  y = y.to(x.scalar_type());
  return residual.has_value() ? (*residual + y).contiguous() : y;
}

at::Tensor fused_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& norm_weight,
                            double eps, bool gated, const c10::optional<at::Tensor>& residual,
                            const c10::optional<at::Tensor>& bias, bool /*static_weight: a CUDA launch hint*/) {
  check_fused_linear("fused_linear", x, weight, norm_weight, eps, gated, residual, bias);
  return linear(x, weight, norm_weight, eps, gated, residual, bias, false);
}

// The rotation of one head: x * cos + cat(-x2, x1) * sin, as torch.addcmul in the dtype of x.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  auto halves = x.chunk(2, -1);
  return at::addcmul(x * cos, at::cat({-halves[1], halves[0]}, -1), sin);
}

at::Tensor rotary_cache_write_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                  const at::Tensor& length, at::Tensor& k_cache, at::Tensor& v_cache,
                                  int64_t num_heads, const c10::optional<at::Tensor>& q_norm,
                                  const c10::optional<at::Tensor>& k_norm, double eps) {
  check_rotary_cache_write("rotary_cache_write", qkv, cos, sin, length, k_cache, v_cache, num_heads, q_norm, k_norm,
                           eps);
  const int64_t tokens = qkv.size(0), kv = k_cache.size(0), max_len = k_cache.size(1), hd = k_cache.size(2);
  auto heads = qkv.reshape({tokens, num_heads + 2 * kv, hd});
  auto q = heads.narrow(1, 0, num_heads), k = heads.narrow(1, num_heads, kv), v = heads.narrow(1, num_heads + kv, kv);
  if (q_norm.has_value()) {
    q = rms_norm(q, *q_norm, eps);
    k = rms_norm(k, *k_norm, eps);
  }
  // Token i sits at position length + i. Out-of-range positions read row 0 of the tables (any row
  // would do): their results are dropped.
  auto pos = at::arange(tokens, at::kLong) + length.item<int64_t>();
  auto in_range = (pos >= 0) & (pos < max_len);
  auto table_rows = pos.clamp(0, max_len - 1);
  auto cos_pos = cos.index_select(0, table_rows).unsqueeze(1), sin_pos = sin.index_select(0, table_rows).unsqueeze(1);
  auto q_rot = rotate(q, cos_pos, sin_pos).masked_fill(~in_range.view({tokens, 1, 1}), kNaN);
  auto rows = in_range.nonzero().squeeze(1);
  auto cache_pos = pos.index_select(0, rows);
  k_cache.index_copy_(1, cache_pos, rotate(k, cos_pos, sin_pos).index_select(0, rows).transpose(0, 1));
  v_cache.index_copy_(1, cache_pos, v.index_select(0, rows).transpose(0, 1));
  return q_rot.contiguous();
}

// Token by token: each row reads exactly its visible keys (with a window W > 0, only the last W of
// them: decoder_step's sliding-window layers), so nothing beyond them (stale or non-finite cache
// entries) can reach its result. softcap > 0 caps the scaled scores (decoder_step's Gemma-2 cap).
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& length,
                  double scale, int64_t window, double softcap = 0.0) {
  const int64_t tokens = q.size(0), heads = q.size(1), kv = k_cache.size(0), max_len = k_cache.size(1),
                hd = k_cache.size(2);
  const int64_t first = length.item<int64_t>();
  // Query head h uses KV head h / group: heads [kv, group] share keys and values.
  auto qf = q.to(at::kFloat).reshape({tokens, kv, heads / kv, hd});
  auto kf = k_cache.to(at::kFloat), vf = v_cache.to(at::kFloat);
  auto out = at::full({tokens, kv, heads / kv, hd}, kNaN, at::kFloat);  // NaN: rows with no visible key
  for (int64_t i = 0; i < tokens; ++i) {
    // length is clamped first, so a length near 2^63 sees the whole cache instead of overflowing.
    const int64_t visible = std::min(std::min(first, max_len) + i, max_len - 1) + 1;
    if (visible <= 0) continue;
    const int64_t from = window > 0 ? std::max<int64_t>(0, visible - window) : 0;
    // [kv, group, keys]
    auto scores = at::matmul(qf[i], kf.narrow(1, from, visible - from).transpose(1, 2)) * scale;
    if (softcap > 0.0) scores = at::tanh(scores / softcap) * softcap;
    out[i].copy_(at::matmul(at::softmax(scores, -1), vf.narrow(1, from, visible - from)));
  }
  return out.view({tokens, heads * hd}).to(q.scalar_type());
}

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& length, double scale) {
  check_decode_attention("decode_attention", q, k_cache, v_cache, length, scale);
  return attend(q, k_cache, v_cache, length, scale, 0);
}

// One token through every layer: exactly the composition of the three ops above, layer by layer,
// on views of the stacked weights and caches (so the cache writes land in the caller's caches),
// with the options' changes: post-norms (the output normed, then added: x + rms_norm(out)), GELU,
// capped attention scores, and in sliding-window layers the window and their own rotary tables. No
// final norm: the result is the residual stream after the last layer.
at::Tensor decoder_step_cpu(const at::Tensor& x, const at::Tensor& qkv_weight, const at::Tensor& o_weight,
                            const at::Tensor& gate_up_weight, const at::Tensor& down_weight,
                            const at::Tensor& attn_norm, const at::Tensor& mlp_norm,
                            const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                            at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin,
                            const at::Tensor& length, int64_t num_heads, double eps, double scale,
                            const c10::optional<at::Tensor>& qkv_bias, const c10::optional<at::Tensor>& post_attn_norm,
                            const c10::optional<at::Tensor>& post_mlp_norm, c10::string_view activation,
                            int64_t sliding_window, at::IntArrayRef sliding_layers,
                            const c10::optional<at::Tensor>& sliding_cos, const c10::optional<at::Tensor>& sliding_sin,
                            double input_scale, double attn_softcap) {
  constexpr const char* op = "decoder_step";
  const DecoderStepOptions options = decoder_step_options(op, qkv_bias, post_attn_norm, post_mlp_norm, activation,
                                                          sliding_window, sliding_layers, sliding_cos, sliding_sin,
                                                          input_scale, attn_softcap);
  check_decoder_step(op, x, qkv_weight, o_weight, gate_up_weight, down_weight, attn_norm, mlp_norm, q_norm, k_norm,
                     k_cache, v_cache, cos, sin, length, num_heads, eps, scale, options);
  const auto layer = [](const c10::optional<at::Tensor>& t, int64_t i) -> c10::optional<at::Tensor> {
    return t.has_value() ? c10::optional<at::Tensor>(t->select(0, i)) : c10::nullopt;
  };
  // The attention's or the MLP's output added to the stream h (normed first with post-norms).
  const auto add = [&](const at::Tensor& h, const at::Tensor& out, const c10::optional<at::Tensor>& post_norm,
                       int64_t i) { return post_norm.has_value() ? h + rms_norm(out, post_norm->select(0, i), eps) : h + out; };
  const auto& sliding = options.sliding_layers;
  // The float32 product rounded to x's dtype: for an input_scale of that dtype, exactly a multiply
  // in it (the float32 product of two of its values is exact).
  at::Tensor h = (x.to(at::kFloat) * static_cast<float>(input_scale)).to(x.scalar_type());
  for (int64_t i = 0; i < k_cache.size(0); ++i) {
    at::Tensor k_layer = k_cache.select(0, i), v_layer = v_cache.select(0, i);  // views of the caller's caches
    const bool in_window = std::find(sliding.begin(), sliding.end(), i) != sliding.end();
    const bool own_tables = in_window && sliding_cos.has_value();
    auto qkv = linear(h, qkv_weight.select(0, i), attn_norm.select(0, i), eps, false, c10::nullopt, layer(qkv_bias, i),
                      false);
    auto q = rotary_cache_write_cpu(qkv, own_tables ? *sliding_cos : cos, own_tables ? *sliding_sin : sin, length,
                                    k_layer, v_layer, num_heads, layer(q_norm, i), layer(k_norm, i), eps);
    auto o = attend(q, k_layer, v_layer, length, scale, in_window ? sliding_window : 0,  // [1, H * hd]
                    options.attn_softcap);
    h = add(h, linear(o, o_weight.select(0, i), c10::nullopt, eps, false, c10::nullopt, c10::nullopt, false),
            post_attn_norm, i);
    auto gate_up = linear(h, gate_up_weight.select(0, i), mlp_norm.select(0, i), eps, false, c10::nullopt,
                          c10::nullopt, false);
    h = add(h, linear(gate_up, down_weight.select(0, i), c10::nullopt, eps, true, c10::nullopt, c10::nullopt,
                      options.gelu),
            post_mlp_norm, i);
  }
  return h.contiguous();
}

}  // namespace

TORCH_LIBRARY_IMPL(flashhead, CPU, m) {
  m.impl("fused_linear", &fused_linear_cpu);
  m.impl("rotary_cache_write", &rotary_cache_write_cpu);
  m.impl("decode_attention", &decode_attention_cpu);
  m.impl("decoder_step", &decoder_step_cpu);
}

}  // namespace flashhead
