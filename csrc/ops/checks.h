// Argument checks shared by the CPU references and the CUDA wrappers, so both reject the same
// inputs with the same messages. Every check is host-side metadata only (never reads tensor
// data), which keeps the ops free of host syncs and capturable in CUDA graphs.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>
#include <utility>

namespace flashhead {

// Numbers in messages are pre-formatted rather than streamed: on the lent H200 image (torch 2.11,
// Python 3.12) streaming an integer inside a check message segfaulted while streaming strings
// worked. Floats as %g, so 1e-07 and 1e+300 read as such.
template <typename N, typename = std::enable_if_t<std::is_arithmetic_v<N>>>
std::string num_str(N value) {
  if constexpr (std::is_floating_point_v<N>) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", static_cast<double>(value));
    return text;
  } else {
    return std::to_string(value);
  }
}

// A dtype as Python prints it (torch.int32, not ATen's Int), since the messages reach Python users.
inline std::string dtype_str(at::ScalarType type) {
  return "torch." + std::string(c10::getDtypeNames(type).first);
}

inline std::string shape_str(at::IntArrayRef sizes) {
  std::string text = "[";
  for (size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
  return text + "]";
}

// TORCH_CHECK_TYPE / TORCH_CHECK_VALUE surface in Python as TypeError / ValueError.
#define FH_CHECK_TYPE(op, cond, ...) TORCH_CHECK_TYPE(cond, "flashhead.", op, ": ", __VA_ARGS__)
#define FH_CHECK_VALUE(op, cond, ...) TORCH_CHECK_VALUE(cond, "flashhead.", op, ": ", __VA_ARGS__)

// torch.ops passes None for a Tensor argument as an undefined tensor: the checks below would report
// its sizes as [0], or fail on its dtype or device with a message that names nothing. Every check
// that a required tensor meets first starts with this one.
inline void check_defined(const char* op, const at::Tensor& t, const char* name) {
  FH_CHECK_TYPE(op, t.defined(), name, " must be a tensor, got None");
}

inline bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void check_rank(const char* op, const at::Tensor& t, const char* name, int64_t rank,
                       const char* layout) {
  check_defined(op, t, name);
  FH_CHECK_VALUE(op, t.dim() == rank, name, " must be a ", num_str(rank), "-D tensor ", layout, ", got shape ",
                 shape_str(t.sizes()));
}

inline void check_same_device(const char* op, const at::Tensor& t, const char* name,
                              const at::Tensor& ref, const char* ref_name) {
  check_defined(op, ref, ref_name);
  check_defined(op, t, name);
  FH_CHECK_VALUE(op, t.device() == ref.device(), name, " must be on the same device as ", ref_name,
                 " (", ref.device(), "), got ", t.device());
}

// hidden [B, D] and a row matrix [R, D] (centroids or embedding): same float dtype (or fp8 e4m3
// where fp8_allowed: centroids), device, D.
inline void check_hidden_and_rows(const char* op, const at::Tensor& hidden, const at::Tensor& rows,
                                  const char* rows_name, bool fp8_allowed = false) {
  check_rank(op, hidden, "hidden", 2, "[batch, hidden_dim]");
  check_rank(op, rows, rows_name, 2, "[rows, hidden_dim]");
  FH_CHECK_TYPE(op, is_float_dtype(hidden.scalar_type()),
                "hidden must be float16, bfloat16 or float32, got ", dtype_str(hidden.scalar_type()));
  FH_CHECK_TYPE(op, rows.scalar_type() == hidden.scalar_type() || (fp8_allowed && rows.scalar_type() == at::kFloat8_e4m3fn),
                rows_name, " must have the dtype of hidden (", dtype_str(hidden.scalar_type()), ")",
                fp8_allowed ? " or be torch.float8_e4m3fn" : "", ", got ", dtype_str(rows.scalar_type()));
  check_same_device(op, rows, rows_name, hidden, "hidden");
  FH_CHECK_VALUE(op, hidden.size(1) > 0, "hidden_dim must be at least 1");
  FH_CHECK_VALUE(op, rows.size(1) == hidden.size(1), rows_name, " must have hidden_dim ",
                 num_str(hidden.size(1)), " columns like hidden, got shape ", shape_str(rows.sizes()));
  FH_CHECK_VALUE(op, rows.size(0) > 0, rows_name, " must have at least one row");
  FH_CHECK_VALUE(op, rows.size(0) < (int64_t{1} << 31), rows_name, " has ", num_str(rows.size(0)),
                 " rows; ids are int32, so at most 2^31 - 1");
}

// Centroids [C, D] (hidden's dtype or fp8 e4m3) and their optional scale: one float32 on their device.
inline void check_centroids(const char* op, const at::Tensor& hidden, const at::Tensor& centroids,
                            const c10::optional<at::Tensor>& centroid_scale) {
  check_hidden_and_rows(op, hidden, centroids, "centroids", /*fp8_allowed=*/true);
  if (!centroid_scale.has_value()) return;
  FH_CHECK_TYPE(op, centroid_scale->scalar_type() == at::kFloat, "centroid_scale must be a float32 tensor, got ",
                dtype_str(centroid_scale->scalar_type()));
  FH_CHECK_VALUE(op, centroid_scale->numel() == 1, "centroid_scale must hold exactly one value, got shape ",
                 shape_str(centroid_scale->sizes()));
  check_same_device(op, *centroid_scale, "centroid_scale", hidden, "hidden");
}

inline void check_int32(const char* op, const at::Tensor& t, const char* name) {
  FH_CHECK_TYPE(op, t.scalar_type() == at::kInt, name, " must be int32, got ", dtype_str(t.scalar_type()),
                " (convert once with .to(torch.int32))");
}

inline void check_probes(const char* op, int64_t probes, int64_t num_clusters) {
  FH_CHECK_VALUE(op, probes >= 1 && probes <= num_clusters, "probes must be in 1..", num_str(num_clusters),
                 " (the number of clusters), got ", num_str(probes));
}

// Scores are divided by the temperature in float32: a tiny one overflows them to ±inf (the lowest
// id then wins) and a huge one rounds to inf (masked slots give NaN). The range keeps well inside
// those limits; below it the draw is greedy to within noise anyway. flashhead_ext.ops.TEMPERATURE_RANGE
// says the same.
constexpr double kMinTemperature = 1e-6;
constexpr double kMaxTemperature = 1e6;

inline void check_temperature(const char* op, double temperature) {
  FH_CHECK_VALUE(op, temperature >= kMinTemperature && temperature <= kMaxTemperature, "temperature must be in [",
                 num_str(kMinTemperature), ", ", num_str(kMaxTemperature), "] (decode greedily for temperature 0), got ",
                 num_str(temperature));
}

// An output written element by element must not have two elements at one address: the CUDA
// kernels would race on it.
inline void check_no_internal_overlap(const char* op, const at::Tensor& t, const char* name) {
  FH_CHECK_VALUE(op, at::has_internal_overlap(t) != at::MemOverlap::Yes, name,
                 " must not have elements that share memory (e.g. an expanded tensor), got strides ",
                 shape_str(t.strides()));
}

// The seed lives on the device so a captured graph reads a fresh value at every replay.
inline void check_seed(const char* op, const at::Tensor& seed, const at::Tensor& hidden) {
  check_defined(op, seed, "seed");
  FH_CHECK_TYPE(op, seed.scalar_type() == at::kLong, "seed must be an int64 tensor, got ",
                dtype_str(seed.scalar_type()));
  FH_CHECK_VALUE(op, seed.numel() == 1, "seed must hold exactly one value, got shape ", shape_str(seed.sizes()));
  check_same_device(op, seed, "seed", hidden, "hidden");
}

// The arguments every sampling op takes on top of its greedy twin's.
inline void check_sampling(const char* op, double temperature, const at::Tensor& seed, const at::Tensor& hidden) {
  check_temperature(op, temperature);
  check_seed(op, seed, hidden);
}

inline void check_cluster_table(const char* op, const at::Tensor& cluster_tokens, const at::Tensor& ref,
                                const char* ref_name) {
  check_rank(op, cluster_tokens, "cluster_tokens", 2, "[num_clusters, cluster_size]");
  check_int32(op, cluster_tokens, "cluster_tokens");
  check_same_device(op, cluster_tokens, "cluster_tokens", ref, ref_name);
  FH_CHECK_VALUE(op, cluster_tokens.size(0) > 0 && cluster_tokens.size(1) > 0,
                 "cluster_tokens must be non-empty, got shape ", shape_str(cluster_tokens.sizes()));
}

inline void check_extra_ids(const char* op, const c10::optional<at::Tensor>& extra_ids, const at::Tensor& ref,
                            const char* ref_name) {
  if (!extra_ids.has_value()) return;
  check_rank(op, *extra_ids, "extra_ids", 1, "[num_extra]");
  check_int32(op, *extra_ids, "extra_ids");
  check_same_device(op, *extra_ids, "extra_ids", ref, ref_name);
}

inline int64_t num_extra(const c10::optional<at::Tensor>& extra_ids) {
  return extra_ids.has_value() ? extra_ids->numel() : 0;
}

inline void check_cluster_ids(const char* op, const at::Tensor& cluster_ids, const at::Tensor& cluster_tokens) {
  check_rank(op, cluster_ids, "cluster_ids", 2, "[batch, probes]");
  check_int32(op, cluster_ids, "cluster_ids");
  check_same_device(op, cluster_ids, "cluster_ids", cluster_tokens, "cluster_tokens");
}

inline void check_candidates(const char* op, const at::Tensor& candidate_ids, const at::Tensor& hidden) {
  check_rank(op, candidate_ids, "candidate_ids", 2, "[batch, num_candidates]");
  check_int32(op, candidate_ids, "candidate_ids");
  check_same_device(op, candidate_ids, "candidate_ids", hidden, "hidden");
  FH_CHECK_VALUE(op, candidate_ids.size(0) == hidden.size(0), "candidate_ids must have batch ",
                 num_str(hidden.size(0)), " like hidden, got shape ", shape_str(candidate_ids.sizes()));
}

// Checks shared by the fused decode ops (greedy and sampling).
inline void check_decode(const char* op, const at::Tensor& hidden, const at::Tensor& centroids,
                         const at::Tensor& cluster_tokens, const at::Tensor& embedding, int64_t probes,
                         const c10::optional<at::Tensor>& extra_ids, const c10::optional<at::Tensor>& centroid_scale) {
  check_centroids(op, hidden, centroids, centroid_scale);
  check_hidden_and_rows(op, hidden, embedding, "embedding");
  check_cluster_table(op, cluster_tokens, hidden, "hidden");
  FH_CHECK_VALUE(op, cluster_tokens.size(0) == centroids.size(0), "cluster_tokens must have one row per centroid (",
                 "centroids has ", num_str(centroids.size(0)), " rows), got shape ", shape_str(cluster_tokens.sizes()));
  check_probes(op, probes, centroids.size(0));
  check_extra_ids(op, extra_ids, hidden, "hidden");
}

inline void check_token_out(const char* op, const at::Tensor& out, const at::Tensor& hidden) {
  check_rank(op, out, "out", 1, "[batch]");
  FH_CHECK_TYPE(op, out.scalar_type() == at::kLong, "out must be int64, got ", dtype_str(out.scalar_type()));
  check_same_device(op, out, "out", hidden, "hidden");
  FH_CHECK_VALUE(op, out.size(0) == hidden.size(0), "out must have batch ", num_str(hidden.size(0)),
                 " like hidden, got shape ", shape_str(out.sizes()));
  check_no_internal_overlap(op, out, "out");
}

// The bytes a tensor's elements span, from its lowest to one past its highest ({p, p} when empty).
// Comparing spans catches two storage objects over one buffer, which storage identity misses; a
// strided tensor interleaved with another without sharing an element counts as overlapping.
inline std::pair<const char*, const char*> byte_span(const at::Tensor& t) {
  const auto* first = static_cast<const char*>(t.const_data_ptr());
  if (t.numel() == 0) return {first, first};
  int64_t last_offset = 0;  // torch strides are never negative
  for (int64_t d = 0; d < t.dim(); ++d) last_offset += (t.size(d) - 1) * t.stride(d);
  return {first, first + (last_offset + 1) * static_cast<int64_t>(t.element_size())};
}

inline bool share_bytes(const at::Tensor& a, const at::Tensor& b) {
  const auto [a_begin, a_end] = byte_span(a);
  const auto [b_begin, b_end] = byte_span(b);
  return a_begin < b_end && b_begin < a_end;
}

// decode_greedy_out's checks. out must also be apart from the inputs: on CUDA one row's token is
// written while other rows' blocks may still read them.
inline void check_decode_out(const char* op, const at::Tensor& out, const at::Tensor& hidden,
                             const at::Tensor& centroids, const at::Tensor& cluster_tokens,
                             const at::Tensor& embedding, const c10::optional<at::Tensor>& extra_ids,
                             const c10::optional<at::Tensor>& centroid_scale) {
  check_token_out(op, out, hidden);
  const std::pair<const at::Tensor*, const char*> inputs[] = {
      {&hidden, "hidden"}, {&centroids, "centroids"}, {&cluster_tokens, "cluster_tokens"},
      {&embedding, "embedding"}, {extra_ids.has_value() ? &*extra_ids : nullptr, "extra_ids"},
      {centroid_scale.has_value() ? &*centroid_scale : nullptr, "centroid_scale"}};
  for (const auto& [input, name] : inputs) {
    if (input == nullptr) continue;
    FH_CHECK_VALUE(op, !share_bytes(out, *input), "out must not share memory with ", name,
                   " (the kernels read it while out is written)");
  }
}

}  // namespace flashhead
