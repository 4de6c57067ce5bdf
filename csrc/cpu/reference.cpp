// CPU reference implementations of every flashhead op: plain ATen, float32 arithmetic, written
// for clarity rather than speed. The CUDA kernels are tested against these.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "cpu/float_rows.h"
#include "kernels/philox.cuh"
#include "ops/checks.h"

namespace flashhead {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int32_t kNoToken = std::numeric_limits<int32_t>::max();

// Contiguous float32 copies first (as the CUDA ops do): the matmul's summation order, hence the
// last bits of every score, must not depend on the caller's memory layout.
at::Tensor row_scores(const at::Tensor& hidden, const at::Tensor& rows) {
  return at::matmul(float_rows(hidden), float_rows(rows).t());
}

// Centroid scores [B, C], times the centroids' scale when one is given (float32, as the kernels).
at::Tensor centroid_scores(const at::Tensor& hidden, const at::Tensor& centroids,
                           const c10::optional<at::Tensor>& centroid_scale) {
  auto scores = row_scores(hidden, centroids);
  return centroid_scale.has_value() ? scores * centroid_scale->reshape({}) : scores;
}

// NaN ranks like -inf: mapped to -inf before a stable sort, ties (among -inf and NaN too)
// stay in index order, i.e. the smaller id wins.
at::Tensor nan_to_neg_inf(const at::Tensor& x) { return at::where(at::isnan(x), at::full({}, kNegInf), x); }

at::Tensor top_indices(const at::Tensor& keys, int64_t k) {
  auto order = std::get<1>(at::sort(nan_to_neg_inf(keys), /*stable=*/true, /*dim=*/1, /*descending=*/true));
  return order.narrow(1, 0, k).contiguous();
}

// Noise [rows, n] with Philox counter (columns[r][c], r): cluster ids for the cluster draw, token
// ids for the token draw (a masked candidate, -1, takes column 0; it is never drawn).
at::Tensor gumbel(int64_t seed, RandomStream stream, const at::Tensor& columns) {
  const auto cols = columns.to(at::kLong).clamp_min(0).contiguous();
  auto noise = at::empty(cols.sizes(), at::kFloat);
  auto acc = noise.accessor<float, 2>();
  const auto col = cols.accessor<int64_t, 2>();
  for (int64_t r = 0; r < cols.size(0); ++r)
    for (int64_t c = 0; c < cols.size(1); ++c)
      acc[r][c] = gumbel_noise(static_cast<uint64_t>(seed), stream, static_cast<uint32_t>(r),
                               static_cast<uint32_t>(col[r][c]));
  return noise;
}

std::tuple<at::Tensor, at::Tensor> clusters_by_key(const at::Tensor& scores, const at::Tensor& keys, int64_t probes) {
  auto idx = top_indices(keys, probes);
  return {idx.to(at::kInt), scores.gather(1, idx)};
}

// Position of the best candidate per row: highest key, ties to the smallest token id; masked
// slots never win unless every slot is masked (then the position of a masked slot, token -1).
at::Tensor best_position(const at::Tensor& keys, const at::Tensor& candidate_ids, const at::Tensor& valid) {
  auto clean = nan_to_neg_inf(keys).masked_fill(~valid, kNegInf);
  auto best_key = clean.amax(1, /*keepdim=*/true);
  auto is_best = valid & (clean == best_key);
  auto best_token = at::where(is_best, candidate_ids, at::full({}, kNoToken, at::kInt)).amin(1, /*keepdim=*/true);
  return (is_best & (candidate_ids == best_token)).to(at::kInt).argmax(1);
}

at::Tensor tokens_at(const at::Tensor& candidate_ids, const at::Tensor& valid, const at::Tensor& position) {
  auto pos = position.unsqueeze(1);
  auto token = candidate_ids.gather(1, pos).to(at::kLong);
  return at::where(valid.gather(1, pos), token, at::full({}, -1, at::kLong)).squeeze(1);
}

at::Tensor valid_candidates(const at::Tensor& candidate_ids, int64_t vocab) {
  return (candidate_ids >= 0) & (candidate_ids < vocab);
}

std::tuple<at::Tensor, at::Tensor> select_clusters_cpu(const at::Tensor& hidden, const at::Tensor& centroids,
                                                       int64_t probes, const c10::optional<at::Tensor>& centroid_scale) {
  constexpr const char* op = "select_clusters";
  check_centroids(op, hidden, centroids, centroid_scale);
  check_probes(op, probes, centroids.size(0));
  auto scores = centroid_scores(hidden, centroids, centroid_scale);
  return clusters_by_key(scores, scores, probes);
}

// Gumbel-top-k: the p largest of scores/T + Gumbel noise are p draws without replacement from
// softmax(scores / T), in draw order.
std::tuple<at::Tensor, at::Tensor> sample_clusters_cpu(const at::Tensor& hidden, const at::Tensor& centroids,
                                                       int64_t probes, double temperature, const at::Tensor& seed,
                                                       const c10::optional<at::Tensor>& centroid_scale) {
  constexpr const char* op = "sample_clusters";
  check_centroids(op, hidden, centroids, centroid_scale);
  check_probes(op, probes, centroids.size(0));
  check_sampling(op, temperature, seed, hidden);
  auto scores = centroid_scores(hidden, centroids, centroid_scale);
  const auto cluster_ids = at::arange(scores.size(1), at::kLong).expand({scores.size(0), scores.size(1)});
  auto keys = scores / temperature + gumbel(seed.item<int64_t>(), kClusterStream, cluster_ids);
  return clusters_by_key(scores, keys, probes);
}

at::Tensor gather_candidates_cpu(const at::Tensor& cluster_ids, const at::Tensor& cluster_tokens,
                                 const c10::optional<at::Tensor>& extra_ids) {
  constexpr const char* op = "gather_candidates";
  check_cluster_table(op, cluster_tokens, cluster_ids, "cluster_ids");
  check_cluster_ids(op, cluster_ids, cluster_tokens);
  check_extra_ids(op, extra_ids, cluster_ids, "cluster_ids");
  const int64_t batch = cluster_ids.size(0), probes = cluster_ids.size(1);
  const int64_t num_clusters = cluster_tokens.size(0), cluster_size = cluster_tokens.size(1);

  // An out-of-range cluster id contributes a row of masked slots instead of reading out of bounds.
  auto ids = cluster_ids.to(at::kLong);
  auto in_range = (ids >= 0) & (ids < num_clusters);
  auto gathered = cluster_tokens.index_select(0, ids.clamp(0, num_clusters - 1).flatten()).view({batch, probes, cluster_size});
  gathered = gathered.masked_fill(~in_range.unsqueeze(2), -1).view({batch, probes * cluster_size});
  if (!extra_ids.has_value() || extra_ids->numel() == 0) return gathered.contiguous();

  // An extra token already among the candidates (or repeated in extra_ids) is masked, so each
  // token appears once and sampling probabilities are not doubled.
  auto extra = extra_ids->to(at::kInt).unsqueeze(0).expand({batch, -1});
  auto in_gathered = (gathered.unsqueeze(2) == extra.unsqueeze(1)).any(1);
  auto repeats = (extra_ids->unsqueeze(0) == extra_ids->unsqueeze(1)).tril(-1).any(1).unsqueeze(0);
  auto extra_kept = extra.masked_fill(in_gathered | repeats, -1);
  return at::cat({gathered, extra_kept}, 1).contiguous();
}

at::Tensor candidate_logits_cpu(const at::Tensor& hidden, const at::Tensor& embedding, const at::Tensor& candidate_ids) {
  constexpr const char* op = "candidate_logits";
  check_hidden_and_rows(op, hidden, embedding, "embedding");
  check_candidates(op, candidate_ids, hidden);
  const int64_t vocab = embedding.size(0), batch = candidate_ids.size(0), width = candidate_ids.size(1);
  auto valid = valid_candidates(candidate_ids, vocab);
  auto ids = candidate_ids.to(at::kLong).clamp(0, vocab - 1);
  auto hidden_rows = float_rows(hidden);
  // Rows in blocks of about 64 MB of gathered float32 embedding rows: at once, a forward over every
  // position of a sequence (HF labels, perplexity) took 7 MB a position at SmolLM2's shapes.
  // Divided in turn rather than by width * hidden_dim, which overflows int64 for huge empty or stride-0
  // inputs (batch 0): floor(floor(a / b) / c) == floor(a / (b * c)); hidden_dim >= 1 is checked.
  const int64_t block =
      std::max<int64_t>(1, width == 0 ? (int64_t{1} << 24) : (int64_t{1} << 24) / width / embedding.size(1));
  auto logits = at::empty({batch, width}, hidden.options().dtype(at::kFloat));
  for (int64_t start = 0; start < batch; start += block) {
    const int64_t n = std::min(block, batch - start);
    auto rows = embedding.index_select(0, ids.narrow(0, start, n).flatten())
                    .view({n, width, embedding.size(1)})
                    .to(at::kFloat);
    logits.narrow(0, start, n).copy_(at::matmul(rows, hidden_rows.narrow(0, start, n).unsqueeze(2)).squeeze(2));
  }
  return logits.masked_fill(~valid, kNegInf);
}

// The greedy path's tokens, int64 [B], for arguments already checked.
at::Tensor greedy_tokens(const at::Tensor& hidden, const at::Tensor& centroids, const at::Tensor& cluster_tokens,
                         const at::Tensor& embedding, int64_t probes, const c10::optional<at::Tensor>& extra_ids,
                         const c10::optional<at::Tensor>& centroid_scale) {
  auto cluster_ids = std::get<0>(select_clusters_cpu(hidden, centroids, probes, centroid_scale));
  auto candidates = gather_candidates_cpu(cluster_ids, cluster_tokens, extra_ids);
  auto logits = candidate_logits_cpu(hidden, embedding, candidates);
  auto valid = valid_candidates(candidates, embedding.size(0));
  return tokens_at(candidates, valid, best_position(logits, candidates, valid));
}

void decode_greedy_out_cpu(const at::Tensor& hidden, const at::Tensor& centroids, const at::Tensor& cluster_tokens,
                           const at::Tensor& embedding, int64_t probes, const c10::optional<at::Tensor>& extra_ids,
                           at::Tensor& out, const c10::optional<at::Tensor>& centroid_scale) {
  constexpr const char* op = "decode_greedy_out";
  check_decode(op, hidden, centroids, cluster_tokens, embedding, probes, extra_ids, centroid_scale);
  check_decode_out(op, out, hidden, centroids, cluster_tokens, embedding, extra_ids, centroid_scale);
  out.copy_(greedy_tokens(hidden, centroids, cluster_tokens, embedding, probes, extra_ids, centroid_scale));
}

at::Tensor decode_greedy_cpu(const at::Tensor& hidden, const at::Tensor& centroids, const at::Tensor& cluster_tokens,
                             const at::Tensor& embedding, int64_t probes, const c10::optional<at::Tensor>& extra_ids,
                             const c10::optional<at::Tensor>& centroid_scale) {
  check_decode("decode_greedy", hidden, centroids, cluster_tokens, embedding, probes, extra_ids, centroid_scale);
  return greedy_tokens(hidden, centroids, cluster_tokens, embedding, probes, extra_ids, centroid_scale);
}

// Gumbel-max over the candidates: argmax of logits/T + noise (indexed by token id) is a draw from
// softmax(logits/T) restricted to the candidate set; its log-probability under that distribution
// comes along.
std::tuple<at::Tensor, at::Tensor> decode_sample_cpu(const at::Tensor& hidden, const at::Tensor& centroids,
                                                     const at::Tensor& cluster_tokens, const at::Tensor& embedding,
                                                     int64_t probes, double temperature, const at::Tensor& seed,
                                                     const c10::optional<at::Tensor>& extra_ids,
                                                     const c10::optional<at::Tensor>& centroid_scale) {
  constexpr const char* op = "decode_sample";
  check_decode(op, hidden, centroids, cluster_tokens, embedding, probes, extra_ids, centroid_scale);
  check_sampling(op, temperature, seed, hidden);
  auto cluster_ids = std::get<0>(sample_clusters_cpu(hidden, centroids, probes, temperature, seed, centroid_scale));
  auto candidates = gather_candidates_cpu(cluster_ids, cluster_tokens, extra_ids);
  auto scaled = candidate_logits_cpu(hidden, embedding, candidates) / temperature;
  auto valid = valid_candidates(candidates, embedding.size(0));
  auto keys = scaled + gumbel(seed.item<int64_t>(), kTokenStream, candidates);
  auto position = best_position(keys, candidates, valid);
  // log_softmax subtracts the row's max first: at small temperatures max + log(sum) rounds log(sum) away.
  auto token_logprobs = at::log_softmax(scaled, 1).gather(1, position.unsqueeze(1)).squeeze(1);
  return {tokens_at(candidates, valid, position), token_logprobs};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashhead, CPU, m) {
  m.impl("select_clusters", &select_clusters_cpu);
  m.impl("sample_clusters", &sample_clusters_cpu);
  m.impl("gather_candidates", &gather_candidates_cpu);
  m.impl("candidate_logits", &candidate_logits_cpu);
  m.impl("decode_greedy", &decode_greedy_cpu);
  m.impl("decode_greedy_out", &decode_greedy_out_cpu);
  m.impl("decode_sample", &decode_sample_cpu);
}

}  // namespace flashhead
