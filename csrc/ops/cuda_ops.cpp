// CUDA implementations of the flashhead ops: the argument checks shared with the CPU references
// (ops/checks.h), contiguous inputs, the tensors' device and its current stream, workspaces from
// the caching allocator sized by shapes alone, and a check of every launch. Nothing here reads
// tensor data on the host, so every op is free of host syncs and capturable in a CUDA graph.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>

#include "kernels/api.h"
#include "ops/checks.h"
#include "ops/decoder_checks.h"

namespace flashhead {
namespace {

// Calls f(static_cast<T*>(nullptr)) with T the CUDA element type of `dtype`; checks.h has already
// rejected every other dtype.
template <typename F>
void dispatch_float(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      return f(static_cast<float*>(nullptr));
    case at::kHalf:
      return f(static_cast<__half*>(nullptr));
    case at::kBFloat16:
      return f(static_cast<__nv_bfloat16*>(nullptr));
    default:
      TORCH_CHECK(false, "flashhead: no CUDA kernel for dtype ", dtype);
  }
}

// Calls f(tag) with tag a null pointer to the CUDA element type of centroids of `dtype`: T (tagged
// by hidden_tag) or fp8 e4m3.
template <typename T, typename F>
void dispatch_centroids(at::ScalarType dtype, T* hidden_tag, F&& f) {
  if (dtype == at::kFloat8_e4m3fn) return f(static_cast<__nv_fp8_e4m3*>(nullptr));
  f(hidden_tag);
}

template <typename T>
const T* data_as(const at::Tensor& t) {
  return static_cast<const T*>(t.data_ptr());
}

const int32_t* optional_ids(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->numel() > 0 ? t->data_ptr<int32_t>() : nullptr;
}

// The kernels index with int, and some loops step an int counter up to about 10^4 past a count
// before testing it: a count within that of 2^31 wrapped (out-of-bounds writes, wrong answers; the
// overflow audit of session 100). 2^30 leaves ample headroom. Every such check reads sizes only and
// comes before the inputs' contiguous copies: a stride-0 input of a huge size would otherwise be
// copied whole (or fail to allocate) before it is refused. `what` names the arguments the size
// comes from.
constexpr int64_t kMaxKernelCount = int64_t{1} << 30;  // flashhead_ext.ops.CUDA_COUNT_MAX: keep them equal

void check_fits_int(const char* op, int64_t value, const char* what) {
  FH_CHECK_VALUE(op, value <= kMaxKernelCount, what, " is ", num_str(value), ", above the CUDA kernels' limit of 2^30");
}

at::Tensor workspace(size_t bytes, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

HeadShape head_shape(const char* op, const at::Tensor& hidden, const at::Tensor& centroids, int64_t probes) {
  check_fits_int(op, hidden.size(0), "the batch size (hidden.size(0))");
  check_fits_int(op, hidden.size(1), "hidden_dim (hidden.size(1))");
  check_fits_int(op, centroids.size(0), "the number of clusters (centroids.size(0))");
  HeadShape s;
  s.batch = static_cast<int>(hidden.size(0));
  s.hidden_dim = static_cast<int>(hidden.size(1));
  s.num_clusters = static_cast<int>(centroids.size(0));
  s.probes = static_cast<int>(probes);
  return s;
}

void add_candidates(const char* op, HeadShape& s, const at::Tensor& cluster_tokens, const at::Tensor& embedding,
                    const c10::optional<at::Tensor>& extra_ids) {
  check_fits_int(op, cluster_tokens.size(1), "cluster_size (cluster_tokens.size(1))");
  check_fits_int(op, num_extra(extra_ids), "the number of extra ids (extra_ids.size(0))");
  check_fits_int(op, s.probes * cluster_tokens.size(1) + num_extra(extra_ids),
                 "the number of candidates per row (probes * cluster_tokens.size(1) + extra_ids.size(0))");
  s.cluster_size = static_cast<int>(cluster_tokens.size(1));
  s.vocab = static_cast<int>(embedding.size(0));
  s.num_extra = static_cast<int>(num_extra(extra_ids));
}

c10::optional<at::Tensor> contiguous(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? c10::optional<at::Tensor>(t->contiguous()) : c10::nullopt;
}

const float* optional_scale(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

std::tuple<at::Tensor, at::Tensor> cluster_select(const char* op, const at::Tensor& hidden_in,
                                                  const at::Tensor& centroids_in, int64_t probes,
                                                  const c10::optional<at::Tensor>& centroid_scale,
                                                  const Sampling* sampling) {
  // The ranked list rounds probes up to a power of two and sorts it with int strides: past 2^29
  // both wrapped, and the host's sizing loop never ended.
  FH_CHECK_VALUE(op, probes <= (int64_t{1} << 29), "probes is ", num_str(probes),
                 ", above the CUDA selection's limit of 2^29");
  const HeadShape shape = head_shape(op, hidden_in, centroids_in, probes);
  const c10::cuda::CUDAGuard guard(hidden_in.device());
  const at::Tensor hidden = hidden_in.contiguous(), centroids = centroids_in.contiguous();
  auto cluster_ids = at::empty({shape.batch, probes}, hidden.options().dtype(at::kInt));
  auto scores = at::empty({shape.batch, probes}, hidden.options().dtype(at::kFloat));
  auto ws = workspace(cluster_select_workspace_bytes(shape, sampling != nullptr), hidden);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_float(hidden.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dispatch_centroids(centroids.scalar_type(), tag, [&](auto* centroid_tag) {
      using TC = std::remove_pointer_t<decltype(centroid_tag)>;
      // Parenthesised: the template's comma would split the macro's argument.
      C10_CUDA_CHECK((launch_cluster_select<T, TC>(data_as<T>(hidden), data_as<TC>(centroids),
                                                   optional_scale(centroid_scale), shape, sampling,
                                                   cluster_ids.data_ptr<int32_t>(), scores.data_ptr<float>(),
                                                   ws.data_ptr(), stream)));
    });
  });
  return {cluster_ids, scores};
}

std::tuple<at::Tensor, at::Tensor> select_clusters_cuda(const at::Tensor& hidden, const at::Tensor& centroids,
                                                        int64_t probes, const c10::optional<at::Tensor>& centroid_scale) {
  constexpr const char* op = "select_clusters";
  check_centroids(op, hidden, centroids, centroid_scale);
  check_probes(op, probes, centroids.size(0));
  return cluster_select(op, hidden, centroids, probes, centroid_scale, nullptr);
}

std::tuple<at::Tensor, at::Tensor> sample_clusters_cuda(const at::Tensor& hidden, const at::Tensor& centroids,
                                                        int64_t probes, double temperature, const at::Tensor& seed,
                                                        const c10::optional<at::Tensor>& centroid_scale) {
  constexpr const char* op = "sample_clusters";
  check_centroids(op, hidden, centroids, centroid_scale);
  check_probes(op, probes, centroids.size(0));
  check_sampling(op, temperature, seed, hidden);
  const Sampling sampling{static_cast<float>(temperature), seed.data_ptr<int64_t>()};
  return cluster_select(op, hidden, centroids, probes, centroid_scale, &sampling);
}

at::Tensor gather_candidates_cuda(const at::Tensor& cluster_ids_in, const at::Tensor& cluster_tokens_in,
                                  const c10::optional<at::Tensor>& extra_ids_in) {
  constexpr const char* op = "gather_candidates";
  check_cluster_table(op, cluster_tokens_in, cluster_ids_in, "cluster_ids");
  check_cluster_ids(op, cluster_ids_in, cluster_tokens_in);
  check_extra_ids(op, extra_ids_in, cluster_ids_in, "cluster_ids");
  const int64_t batch = cluster_ids_in.size(0), probes = cluster_ids_in.size(1), extra = num_extra(extra_ids_in);
  check_fits_int(op, batch, "the batch size (cluster_ids.size(0))");
  // Before the product below, which a huge probes could overflow even in int64.
  check_fits_int(op, probes, "probes (cluster_ids.size(1))");
  check_fits_int(op, cluster_tokens_in.size(0), "the number of clusters (cluster_tokens.size(0))");
  check_fits_int(op, cluster_tokens_in.size(1), "cluster_size (cluster_tokens.size(1))");
  check_fits_int(op, probes * cluster_tokens_in.size(1) + extra,
                 "the number of candidates per row (cluster_ids.size(1) * cluster_tokens.size(1) + extra_ids.size(0))");
  const c10::cuda::CUDAGuard guard(cluster_ids_in.device());
  const at::Tensor cluster_ids = cluster_ids_in.contiguous(), cluster_tokens = cluster_tokens_in.contiguous();
  const auto extra_ids = contiguous(extra_ids_in);
  auto out = at::empty({batch, probes * cluster_tokens.size(1) + extra}, cluster_ids.options());
  C10_CUDA_CHECK(launch_gather_candidates(cluster_ids.data_ptr<int32_t>(), static_cast<int>(batch),
                                          static_cast<int>(probes), cluster_tokens.data_ptr<int32_t>(),
                                          static_cast<int>(cluster_tokens.size(0)),
                                          static_cast<int>(cluster_tokens.size(1)), optional_ids(extra_ids),
                                          static_cast<int>(extra), out.data_ptr<int32_t>(),
                                          at::cuda::getCurrentCUDAStream()));
  return out;
}

at::Tensor candidate_logits_cuda(const at::Tensor& hidden_in, const at::Tensor& embedding_in,
                                 const at::Tensor& candidate_ids_in) {
  constexpr const char* op = "candidate_logits";
  check_hidden_and_rows(op, hidden_in, embedding_in, "embedding");
  check_candidates(op, candidate_ids_in, hidden_in);
  check_fits_int(op, hidden_in.size(0), "the batch size (hidden.size(0))");
  check_fits_int(op, hidden_in.size(1), "hidden_dim (hidden.size(1))");
  check_fits_int(op, candidate_ids_in.size(1), "the number of candidates per row (candidate_ids.size(1))");
  const c10::cuda::CUDAGuard guard(hidden_in.device());
  const at::Tensor hidden = hidden_in.contiguous(), embedding = embedding_in.contiguous();
  const at::Tensor candidate_ids = candidate_ids_in.contiguous();
  auto logits = at::empty(candidate_ids.sizes(), hidden.options().dtype(at::kFloat));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_float(hidden.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    C10_CUDA_CHECK(launch_candidate_logits<T>(
        data_as<T>(hidden), data_as<T>(embedding), static_cast<int>(hidden.size(0)),
        static_cast<int>(embedding.size(0)), static_cast<int>(hidden.size(1)), candidate_ids.data_ptr<int32_t>(),
        static_cast<int>(candidate_ids.size(1)), logits.data_ptr<float>(), stream));
  });
  return logits;
}

// A fused decode's sizes, each checked against the kernels' limit: before its outputs are
// allocated, which for a stride-0 hidden of a huge batch failed first, naming nothing.
HeadShape decode_shape(const char* op, const at::Tensor& hidden, const at::Tensor& centroids,
                       const at::Tensor& cluster_tokens, const at::Tensor& embedding, int64_t probes,
                       const c10::optional<at::Tensor>& extra_ids) {
  HeadShape shape = head_shape(op, hidden, centroids, probes);
  add_candidates(op, shape, cluster_tokens, embedding, extra_ids);
  return shape;
}

// The fused decode, greedy (sampling == nullptr) or sampling; checks already done by the caller.
void decode(const HeadShape& shape, const at::Tensor& hidden_in, const at::Tensor& centroids_in,
            const at::Tensor& cluster_tokens_in, const at::Tensor& embedding_in,
            const c10::optional<at::Tensor>& extra_ids_in, const c10::optional<at::Tensor>& centroid_scale,
            const Sampling* sampling, at::Tensor& tokens, float* token_logprobs) {
  const c10::cuda::CUDAGuard guard(hidden_in.device());
  const at::Tensor hidden = hidden_in.contiguous(), centroids = centroids_in.contiguous();
  const at::Tensor cluster_tokens = cluster_tokens_in.contiguous(), embedding = embedding_in.contiguous();
  const auto extra_ids = contiguous(extra_ids_in);
  auto ws = workspace(decode_workspace_bytes(shape, sampling != nullptr), hidden);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_float(hidden.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    dispatch_centroids(centroids.scalar_type(), tag, [&](auto* centroid_tag) {
      using TC = std::remove_pointer_t<decltype(centroid_tag)>;
      HeadTensors<T, TC> t;
      t.hidden = data_as<T>(hidden);
      t.centroids = data_as<TC>(centroids);
      t.centroid_scale = optional_scale(centroid_scale);
      t.cluster_tokens = cluster_tokens.data_ptr<int32_t>();
      t.embedding = data_as<T>(embedding);
      t.extra_ids = optional_ids(extra_ids);
      C10_CUDA_CHECK((launch_decode<T, TC>(t, shape, sampling, tokens.data_ptr<int64_t>(), tokens.stride(0),
                                           token_logprobs, ws.data_ptr(), stream)));
    });
  });
}

void decode_greedy_out_cuda(const at::Tensor& hidden, const at::Tensor& centroids, const at::Tensor& cluster_tokens,
                            const at::Tensor& embedding, int64_t probes, const c10::optional<at::Tensor>& extra_ids,
                            at::Tensor& out, const c10::optional<at::Tensor>& centroid_scale) {
  constexpr const char* op = "decode_greedy_out";
  check_decode(op, hidden, centroids, cluster_tokens, embedding, probes, extra_ids, centroid_scale);
  check_decode_out(op, out, hidden, centroids, cluster_tokens, embedding, extra_ids, centroid_scale);
  const HeadShape shape = decode_shape(op, hidden, centroids, cluster_tokens, embedding, probes, extra_ids);
  decode(shape, hidden, centroids, cluster_tokens, embedding, extra_ids, centroid_scale, nullptr, out, nullptr);
}

at::Tensor decode_greedy_cuda(const at::Tensor& hidden, const at::Tensor& centroids, const at::Tensor& cluster_tokens,
                              const at::Tensor& embedding, int64_t probes, const c10::optional<at::Tensor>& extra_ids,
                              const c10::optional<at::Tensor>& centroid_scale) {
  constexpr const char* op = "decode_greedy";
  check_decode(op, hidden, centroids, cluster_tokens, embedding, probes, extra_ids, centroid_scale);
  const HeadShape shape = decode_shape(op, hidden, centroids, cluster_tokens, embedding, probes, extra_ids);
  auto out = at::empty({hidden.size(0)}, hidden.options().dtype(at::kLong));  // what decode_greedy_out writes
  decode(shape, hidden, centroids, cluster_tokens, embedding, extra_ids, centroid_scale, nullptr, out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> decode_sample_cuda(const at::Tensor& hidden, const at::Tensor& centroids,
                                                      const at::Tensor& cluster_tokens, const at::Tensor& embedding,
                                                      int64_t probes, double temperature, const at::Tensor& seed,
                                                      const c10::optional<at::Tensor>& extra_ids,
                                                      const c10::optional<at::Tensor>& centroid_scale) {
  constexpr const char* op = "decode_sample";
  check_decode(op, hidden, centroids, cluster_tokens, embedding, probes, extra_ids, centroid_scale);
  check_sampling(op, temperature, seed, hidden);
  const HeadShape shape = decode_shape(op, hidden, centroids, cluster_tokens, embedding, probes, extra_ids);
  auto tokens = at::empty({hidden.size(0)}, hidden.options().dtype(at::kLong));
  auto token_logprobs = at::empty({hidden.size(0)}, hidden.options().dtype(at::kFloat));
  const Sampling sampling{static_cast<float>(temperature), seed.data_ptr<int64_t>()};
  decode(shape, hidden, centroids, cluster_tokens, embedding, extra_ids, centroid_scale, &sampling, tokens,
         token_logprobs.data_ptr<float>());
  return {tokens, token_logprobs};
}

template <typename T>
const T* optional_data(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? data_as<T>(*t) : nullptr;
}

at::Tensor fused_linear_cuda(const at::Tensor& x_in, const at::Tensor& weight_in,
                             const c10::optional<at::Tensor>& norm_weight_in, double eps, bool gated,
                             const c10::optional<at::Tensor>& residual_in, const c10::optional<at::Tensor>& bias_in,
                             bool static_weight) {
  constexpr const char* op = "fused_linear";
  check_fused_linear(op, x_in, weight_in, norm_weight_in, eps, gated, residual_in, bias_in);
  check_fits_int(op, x_in.size(0), "the number of tokens (x.size(0))");
  check_fits_int(op, x_in.size(1), "x.size(1)");
  check_fits_int(op, weight_in.size(0), "out_features (weight.size(0))");
  FH_CHECK_VALUE(op, x_in.size(0) <= kFusedLinearMaxTokens, "the CUDA kernel takes at most ",
                 num_str(kFusedLinearMaxTokens), " tokens (x.size(0)), got ", num_str(x_in.size(0)));
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  const auto norm_weight = contiguous(norm_weight_in), residual = contiguous(residual_in), bias = contiguous(bias_in);
  // A weight that was not contiguous was just copied by the kernel before the GEMV's.
  const bool weight_before_wait = static_weight && weight_in.is_contiguous();
  auto out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (x.size(0) == 0) return out;
  dispatch_float(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    C10_CUDA_CHECK(launch_fused_linear<T>(data_as<T>(x), data_as<T>(weight), optional_data<T>(norm_weight), gated,
                                          static_cast<float>(eps), optional_data<T>(residual), optional_data<T>(bias),
                                          static_cast<T*>(out.data_ptr()), static_cast<int>(x.size(0)),
                                          static_cast<int>(weight.size(0)), static_cast<int>(weight.size(1)),
                                          at::cuda::getCurrentCUDAStream(), {}, weight_before_wait));
  });
  return out;
}

at::Tensor rotary_cache_write_cuda(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                   const at::Tensor& length, at::Tensor& k_cache, at::Tensor& v_cache,
                                   int64_t num_heads, const c10::optional<at::Tensor>& q_norm_in,
                                   const c10::optional<at::Tensor>& k_norm_in, double eps) {
  constexpr const char* op = "rotary_cache_write";
  check_rotary_cache_write(op, qkv_in, cos_in, sin_in, length, k_cache, v_cache, num_heads, q_norm_in, k_norm_in, eps);
  const int64_t kv = k_cache.size(0), max_len = k_cache.size(1), hd = k_cache.size(2);
  check_fits_int(op, qkv_in.size(0), "the number of tokens (qkv.size(0))");
  FH_CHECK_VALUE(op, num_heads + kv <= kRotaryMaxHeads, "the CUDA kernel takes at most ", num_str(kRotaryMaxHeads),
                 " heads (num_heads + num_kv_heads), got ", num_str(num_heads), " + ", num_str(kv));
  check_fits_int(op, max_len, "max_len (k_cache.size(1))");
  FH_CHECK_VALUE(op, hd <= 2048, "head_dim (k_cache.size(2)) must be at most 2048 for the CUDA kernel, got ",
                 num_str(hd));
  const c10::cuda::CUDAGuard guard(qkv_in.device());
  const at::Tensor qkv = qkv_in.contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const auto q_norm = contiguous(q_norm_in), k_norm = contiguous(k_norm_in);
  auto q = at::empty({qkv.size(0), num_heads, hd}, qkv.options());
  dispatch_float(qkv.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    C10_CUDA_CHECK(launch_rotary_cache_write<T>(
        data_as<T>(qkv), data_as<T>(cos), data_as<T>(sin), length.data_ptr<int64_t>(), optional_data<T>(q_norm),
        optional_data<T>(k_norm), static_cast<float>(eps), static_cast<T*>(k_cache.data_ptr()),
        static_cast<T*>(v_cache.data_ptr()), static_cast<T*>(q.data_ptr()), static_cast<int>(qkv.size(0)),
        static_cast<int>(num_heads), static_cast<int>(kv), static_cast<int>(hd), static_cast<int>(max_len),
        at::cuda::getCurrentCUDAStream()));
  });
  return q;
}

at::Tensor decode_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_cache_in, const at::Tensor& v_cache_in,
                                 const at::Tensor& length, double scale) {
  constexpr const char* op = "decode_attention";
  check_decode_attention(op, q_in, k_cache_in, v_cache_in, length, scale);
  const int64_t kv = k_cache_in.size(0), max_len = k_cache_in.size(1), hd = k_cache_in.size(2);
  FH_CHECK_VALUE(op, hd <= kDecodeAttentionMaxHeadDim, "head_dim (k_cache.size(2)) must be at most ",
                 num_str(kDecodeAttentionMaxHeadDim), " for the CUDA kernel, got ", num_str(hd));
  const int64_t tokens = q_in.size(0), heads = q_in.size(1);
  check_fits_int(op, tokens * heads, "tokens * num_heads (q.size(0) * q.size(1))");
  FH_CHECK_VALUE(op, kv <= kDecodeAttentionMaxGridYZ, "the CUDA kernel takes at most ",
                 num_str(kDecodeAttentionMaxGridYZ), " KV heads (k_cache.size(0)), got ", num_str(kv));
  const int64_t tiles = decode_attention_tiles(static_cast<int>(tokens), static_cast<int>(heads), static_cast<int>(kv),
                                               static_cast<int>(hd), static_cast<int>(q_in.element_size()));
  FH_CHECK_VALUE(op, tiles <= kDecodeAttentionMaxGridYZ, "the CUDA kernel takes at most ",
                 num_str(kDecodeAttentionMaxGridYZ), " tiles of a KV head's query rows, got ", num_str(tiles),
                 " (q.size(0) = ", num_str(tokens), " tokens x ", num_str(heads / kv), " query heads per KV head)");
  // The merge keeps two floats per split of 32 positions in shared memory: 48 KB at this limit, which
  // its launch opts in to. Longer caches would fit the opt-in limit; none was needed (128K-token
  // models) or tested.
  FH_CHECK_VALUE(op, max_len <= 32 * 6144, "max_len (k_cache.size(1)) must be at most 196608 for the CUDA kernel, got ",
                 num_str(max_len));
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous(), k_cache = k_cache_in.contiguous(), v_cache = v_cache_in.contiguous();
  auto out = at::empty({tokens, heads * hd}, q.options());
  auto ws = workspace(decode_attention_workspace_bytes(static_cast<int>(tokens), static_cast<int>(heads),
                                                       static_cast<int>(hd), static_cast<int>(max_len)),
                      q);
  dispatch_float(q.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    C10_CUDA_CHECK(launch_decode_attention<T>(
        data_as<T>(q), data_as<T>(k_cache), data_as<T>(v_cache), length.data_ptr<int64_t>(),
        static_cast<float>(scale), static_cast<T*>(out.data_ptr()), static_cast<int>(tokens),
        static_cast<int>(heads), static_cast<int>(kv), static_cast<int>(hd), static_cast<int>(max_len),
        ws.data_ptr(), at::cuda::getCurrentCUDAStream()));
  });
  return out;
}

at::Tensor decoder_step_cuda(const at::Tensor& x_in, const at::Tensor& qkv_weight_in, const at::Tensor& o_weight_in,
                             const at::Tensor& gate_up_weight_in, const at::Tensor& down_weight_in,
                             const at::Tensor& attn_norm_in, const at::Tensor& mlp_norm_in,
                             const c10::optional<at::Tensor>& q_norm_in, const c10::optional<at::Tensor>& k_norm_in,
                             at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& cos_in,
                             const at::Tensor& sin_in, const at::Tensor& length, int64_t num_heads, double eps,
                             double scale, const c10::optional<at::Tensor>& qkv_bias_in,
                             const c10::optional<at::Tensor>& post_attn_norm_in,
                             const c10::optional<at::Tensor>& post_mlp_norm_in, c10::string_view activation,
                             int64_t sliding_window, at::IntArrayRef sliding_layers,
                             const c10::optional<at::Tensor>& sliding_cos_in,
                             const c10::optional<at::Tensor>& sliding_sin_in, double input_scale,
                             double attn_softcap) {
  constexpr const char* op = "decoder_step";
  const DecoderStepOptions options =
      decoder_step_options(op, qkv_bias_in, post_attn_norm_in, post_mlp_norm_in, activation, sliding_window,
                           sliding_layers, sliding_cos_in, sliding_sin_in, input_scale, attn_softcap);
  check_decoder_step(op, x_in, qkv_weight_in, o_weight_in, gate_up_weight_in, down_weight_in, attn_norm_in,
                     mlp_norm_in, q_norm_in, k_norm_in, k_cache, v_cache, cos_in, sin_in, length, num_heads, eps,
                     scale, options);
  const int64_t layers = k_cache.size(0), kv = k_cache.size(1), max_len = k_cache.size(2), hd = k_cache.size(3);
  const int64_t hidden = x_in.size(1), intermediate = down_weight_in.size(2), attn_cols = num_heads * hd;
  const int64_t element = x_in.element_size(), vector = 16 / element;
  // Saturated: a size past int breaks a kernel limit instead of wrapping around.
  const auto dim = [](int64_t size) {
    return static_cast<int>(std::min<int64_t>(size, std::numeric_limits<int>::max()));
  };
  DecoderStepShape shape{dim(layers), dim(hidden), dim(intermediate), dim(num_heads), dim(kv), dim(hd),
                         dim(max_len), static_cast<float>(eps), static_cast<float>(scale)};
  shape.activation = options.gelu ? DecoderStepActivation::kGeluTanh : DecoderStepActivation::kSilu;
  shape.post_norms = options.post_attn_norm.has_value();
  shape.input_scale = static_cast<float>(options.input_scale);
  shape.attn_softcap = static_cast<float>(options.attn_softcap);
  FH_CHECK_VALUE(op, options.sliding_layers.empty() || layers <= kDecoderStepMaxSlidingLayers,
                 "the CUDA kernel takes sliding_layers in models of at most ", num_str(kDecoderStepMaxSlidingLayers),
                 " layers, got ", num_str(layers));
  shape.sliding_window = options.sliding_layers.empty() ? 0 : dim(options.sliding_window);
  for (const int64_t layer : options.sliding_layers) shape.sliding_layers[layer / 64] |= uint64_t{1} << (layer % 64);
  // The kernel streams whole 16-byte vectors of rows through shared-memory stages of fixed size.
  const DecoderStepLimit limit = decoder_step_limit(shape, static_cast<int>(element));
  FH_CHECK_VALUE(op, limit != DecoderStepLimit::kHeadDim, "head_dim must be at most ",
                 num_str(kDecoderStepMaxHeadDim), " for the CUDA kernel, got ", num_str(hd));
  FH_CHECK_VALUE(op, limit != DecoderStepLimit::kWholeVectors,
                 "the CUDA kernel needs hidden_size, head_dim and intermediate_size to be multiples of ",
                 num_str(vector), " for ", dtype_str(x_in.scalar_type()), ", got ", num_str(hidden), ", ", num_str(hd), " and ",
                 num_str(intermediate));
  FH_CHECK_VALUE(op, limit != DecoderStepLimit::kGroup, "the CUDA kernel takes at most ",
                 num_str(kDecoderStepMaxGroup), " query heads per KV head, got num_heads ", num_str(num_heads), " and ",
                 num_str(kv), " KV heads (k_cache.size(1))");
  FH_CHECK_VALUE(op, limit != DecoderStepLimit::kMaxLen, "max_len (k_cache.size(2)) must be at most ",
                 num_str(kDecoderStepMaxLen), " for the CUDA kernel, got ", num_str(max_len));
  FH_CHECK_VALUE(op, limit != DecoderStepLimit::kRowBytes, "the CUDA kernel needs a weight row of at most ",
                 num_str(kDecoderStepStageBytes), " bytes (two for gate_up), got hidden_size ", num_str(hidden),
                 ", num_heads * head_dim ", num_str(attn_cols), " and intermediate_size ", num_str(intermediate), " in ",
                 dtype_str(x_in.scalar_type()));
  FH_CHECK_VALUE(op, limit != DecoderStepLimit::kCacheElements, "the number of elements of k_cache is ",
                 num_str(layers * kv * max_len * hd), ", above the CUDA kernels' limit of 2^31 - 1");
  TORCH_INTERNAL_ASSERT(limit == DecoderStepLimit::kNone, "check_decoder_step passed a shape the kernel rejects");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), qkv_weight = qkv_weight_in.contiguous(), o_weight = o_weight_in.contiguous(),
                   gate_up_weight = gate_up_weight_in.contiguous(), down_weight = down_weight_in.contiguous(),
                   attn_norm = attn_norm_in.contiguous(), mlp_norm = mlp_norm_in.contiguous(),
                   cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const auto q_norm = contiguous(q_norm_in), k_norm = contiguous(k_norm_in), qkv_bias = contiguous(qkv_bias_in),
             post_attn_norm = contiguous(post_attn_norm_in), post_mlp_norm = contiguous(post_mlp_norm_in),
             sliding_cos = contiguous(sliding_cos_in), sliding_sin = contiguous(sliding_sin_in);
  auto out = at::empty_like(x);
  dispatch_float(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const DecoderStepWeights<T> weights{data_as<T>(qkv_weight),        data_as<T>(o_weight),
                                        data_as<T>(gate_up_weight),    data_as<T>(down_weight),
                                        data_as<T>(attn_norm),         data_as<T>(mlp_norm),
                                        optional_data<T>(q_norm),      optional_data<T>(k_norm),
                                        optional_data<T>(qkv_bias),    optional_data<T>(post_attn_norm),
                                        optional_data<T>(post_mlp_norm), optional_data<T>(sliding_cos),
                                        optional_data<T>(sliding_sin)};
    T* const k_data = static_cast<T*>(k_cache.data_ptr());
    T* const v_data = static_cast<T*>(v_cache.data_ptr());
    const char* misaligned = decoder_step_misaligned(weights, k_data, v_data);
    FH_CHECK_VALUE(op, misaligned == nullptr, misaligned,
                   " must start at a 16-byte aligned address for the CUDA kernel (a view at an odd offset?)");
    DecoderStepPlan plan{};
    const cudaError_t planned = plan_decoder_step<T>(shape, &plan);
    FH_CHECK_VALUE(op, planned != cudaErrorInvalidValue, "hidden_size ", num_str(hidden), ", intermediate_size ",
                   num_str(intermediate), " and ", num_str(num_heads), " heads of ", num_str(hd),
                   " need more shared memory than this GPU has for the CUDA kernel");
    C10_CUDA_CHECK(planned);
    auto ws = workspace(plan.workspace_bytes, x);
    C10_CUDA_CHECK(launch_decoder_step<T>(data_as<T>(x), weights, k_data, v_data, data_as<T>(cos), data_as<T>(sin),
                                          length.data_ptr<int64_t>(), shape, plan, static_cast<T*>(out.data_ptr()),
                                          ws.data_ptr(), at::cuda::getCurrentCUDAStream()));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(flashhead, CUDA, m) {
  m.impl("select_clusters", &select_clusters_cuda);
  m.impl("sample_clusters", &sample_clusters_cuda);
  m.impl("gather_candidates", &gather_candidates_cuda);
  m.impl("candidate_logits", &candidate_logits_cuda);
  m.impl("decode_greedy", &decode_greedy_cuda);
  m.impl("decode_greedy_out", &decode_greedy_out_cuda);
  m.impl("decode_sample", &decode_sample_cuda);
  m.impl("fused_linear", &fused_linear_cuda);
  m.impl("rotary_cache_write", &rotary_cache_write_cuda);
  m.impl("decode_attention", &decode_attention_cuda);
  m.impl("decoder_step", &decoder_step_cuda);
}

}  // namespace flashhead
