"""Plain-torch (and numpy) reference of the flashhead ops: the semantics the ops are tested against.

Written from the documented conventions (flashhead_ext/ops.py, csrc/torch_bindings.cpp), not from
the C++: nothing here calls ``torch.ops.flashhead``.

* scores and logits are float32: inputs are upcast, then a float32 matmul / einsum;
* ranking: higher first, NaN as -inf (below every finite number), ties to the smaller id
  (cluster id when selecting clusters, token id for the final argmax);
* ids are int32; a masked candidate slot is -1 (out-of-range cluster, padding, an extra id already
  among the candidates or repeated) and any candidate id outside [0, V) has logit -inf;
* a row with no valid candidate decodes to token -1;
* sampling is Gumbel-max / Gumbel-top-k with the counter-based Philox4x32-10 noise of
  csrc/kernels/philox.cuh: the noise of (seed, stream, row, column) is a fixed number, so the draws
  of an op can be recomputed here exactly (stream 0: clusters, column = cluster id; stream 1: tokens,
  column = token id).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

NEG_INF = float("-inf")
CLUSTER_STREAM = 0
TOKEN_STREAM = 1

# Bound on the float32 elements one einsum chunk materialises (keeps big CUDA shapes in memory).
_CHUNK_ELEMENTS = 1 << 27


def _matmul_f32(a: Tensor, b: Tensor) -> Tensor:
    """float32 ``a @ b`` with TF32 off: the reference must be a float32 computation on every device."""
    if a.is_cuda:
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return a @ b
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
    return a @ b


def scores(hidden: Tensor, rows: Tensor) -> Tensor:
    """float32 ``hidden [B, D] . rows [R, D]^T`` -> ``[B, R]``."""
    return _matmul_f32(hidden.float(), rows.float().t())


def abs_scores(hidden: Tensor, rows: Tensor) -> Tensor:
    """``|hidden| . |rows|^T``: the scale of the float32 rounding error of any summation order."""
    step = max(1, _CHUNK_ELEMENTS // rows.shape[1])
    h = hidden.float().abs()
    return torch.cat([_matmul_f32(h, rows[i:i + step].float().abs().t()) for i in range(0, rows.shape[0], step)], 1)


def nan_as_neg_inf(x: Tensor) -> Tensor:
    return torch.where(torch.isnan(x), torch.full_like(x, NEG_INF), x)


def ranking(keys: Tensor, ids: Optional[Tensor] = None) -> Tensor:
    """Per row, the column order: key descending (NaN as -inf), ties to the smaller id.

    ``ids`` (same shape as keys) defaults to the column index. Uses numpy's lexsort (primary key
    last), an ordering independent of torch.sort's stability.
    """
    k = nan_as_neg_inf(keys.detach().float().cpu()).numpy()
    i = (torch.arange(keys.shape[-1]).expand_as(keys) if ids is None else ids.detach().cpu()).numpy()
    return torch.from_numpy(np.lexsort((i, -k), axis=-1)).to(keys.device)


def select_clusters(hidden: Tensor, centroids: Tensor, probes: int) -> tuple[Tensor, Tensor]:
    s = scores(hidden, centroids)
    order = ranking(s)[:, :probes]
    return order.to(torch.int32), s.gather(1, order)


def gather_candidates(cluster_ids: Tensor, cluster_tokens: Tensor, extra_ids: Optional[Tensor] = None) -> Tensor:
    batch, probes = cluster_ids.shape
    num_clusters, size = cluster_tokens.shape
    ids = cluster_ids.long()
    in_range = (ids >= 0) & (ids < num_clusters)
    rows = cluster_tokens[ids.clamp(0, num_clusters - 1)]  # [B, p, b]
    rows = torch.where(in_range.unsqueeze(-1), rows, torch.full_like(rows, -1))
    candidates = rows.reshape(batch, probes * size).to(torch.int32)
    if extra_ids is None or extra_ids.numel() == 0:
        return candidates
    columns = []
    for j, token in enumerate(extra_ids.tolist()):
        # Masked when the row already holds it, or when an earlier extra id is the same token.
        seen = (candidates == token).any(dim=1) | (token in extra_ids[:j].tolist())
        columns.append(torch.where(seen, torch.full_like(seen, -1, dtype=torch.int32),
                                   torch.full_like(seen, token, dtype=torch.int32)))
    return torch.cat([candidates, torch.stack(columns, dim=1)], dim=1)


def valid_candidates(candidate_ids: Tensor, vocab: int) -> Tensor:
    return (candidate_ids >= 0) & (candidate_ids < vocab)


def candidate_logits(hidden: Tensor, embedding: Tensor, candidate_ids: Tensor) -> Tensor:
    """float32 ``einsum('bnd,bd->bn', E[ids], h)``, -inf where the id is outside [0, V)."""
    vocab, dim = embedding.shape
    valid = valid_candidates(candidate_ids, vocab)
    safe = candidate_ids.long().clamp(0, vocab - 1)
    step = max(1, _CHUNK_ELEMENTS // max(1, candidate_ids.shape[1] * dim))
    parts = []
    for start in range(0, hidden.shape[0], step):
        rows = embedding[safe[start:start + step]].float()
        parts.append(torch.einsum("bnd,bd->bn", rows, hidden[start:start + step].float()))
    logits = torch.cat(parts) if parts else hidden.new_empty(candidate_ids.shape, dtype=torch.float32)
    return logits.masked_fill(~valid, NEG_INF)


def best_candidate(keys: Tensor, candidate_ids: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: (position, token) of the best valid candidate, ties to the smallest token id.

    Tokens are int64; a row without a valid candidate gives token -1 (position unspecified, 0).
    """
    big = torch.iinfo(torch.int64).max
    k = nan_as_neg_inf(keys.float()).masked_fill(~valid, NEG_INF)
    ids = candidate_ids.long().masked_fill(~valid, big)
    # Rank by (key desc, id asc); masked slots sit behind every valid one with the largest id.
    order = ranking(k, ids)
    position = order[:, 0]
    token = ids.gather(1, position.unsqueeze(1)).squeeze(1)
    any_valid = valid.any(dim=1)
    return torch.where(any_valid, position, torch.zeros_like(position)), torch.where(any_valid, token, torch.full_like(token, -1))


@dataclass
class GreedyTrace:
    """Every intermediate of the reference greedy path (comparators need them)."""
    cluster_scores: Tensor  # [B, C] float32
    cluster_ids: Tensor     # [B, p] int32
    candidates: Tensor      # [B, N] int32
    logits: Tensor          # [B, N] float32
    tokens: Tensor          # [B] int64


def decode_greedy(hidden, centroids, cluster_tokens, embedding, probes, extra_ids=None) -> GreedyTrace:
    cluster_scores = scores(hidden, centroids)
    cluster_ids = ranking(cluster_scores)[:, :probes].to(torch.int32)
    candidates = gather_candidates(cluster_ids, cluster_tokens, extra_ids)
    logits = candidate_logits(hidden, embedding, candidates)
    _, tokens = best_candidate(logits, candidates, valid_candidates(candidates, embedding.shape[0]))
    return GreedyTrace(cluster_scores, cluster_ids, candidates, logits, tokens)


# ---------------------------------------------------------------------------------------------
# Philox4x32-10 (Salmon et al., SC'11) and the Gumbel noise derived from it, in numpy uint64.

_MASK32 = np.uint64(0xFFFFFFFF)
_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))


def philox4x32_10(counter, key) -> tuple[np.ndarray, ...]:
    """The four output words for counter words (c0..c3) and key words (k0, k1), broadcast."""
    c0, c1, c2, c3 = np.broadcast_arrays(*[np.asarray(c, dtype=np.uint64) for c in counter])
    k0, k1 = (np.asarray(k, dtype=np.uint64) for k in key)
    for _ in range(10):
        p0 = _PHILOX_M[0] * c0
        p1 = _PHILOX_M[1] * c2
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _MASK32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _MASK32
        k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
    return c0, c1, c2, c3


def philox_bits_at(seed: int, stream: int, columns: np.ndarray) -> np.ndarray:
    """First Philox word for counter (columns[r, c], r, stream, 0), key (seed low, seed high)."""
    seed &= (1 << 64) - 1
    col = np.asarray(columns).astype(np.uint64)
    row = np.arange(col.shape[0], dtype=np.uint64)[:, None]
    return philox4x32_10((col, row, stream, 0), (seed & 0xFFFFFFFF, seed >> 32))[0]


def philox_bits(seed: int, stream: int, rows: int, cols: int) -> np.ndarray:
    """philox_bits_at for columns 0 .. cols - 1 of every row: [rows, cols]."""
    return philox_bits_at(seed, stream, np.broadcast_to(np.arange(cols, dtype=np.uint64), (rows, cols)))


def gumbel_from_bits(bits: np.ndarray) -> np.ndarray:
    """float32 -log(-log(u)), u = (top 23 bits + 0.5) / 2^23, each step rounded to float32 as the C
    code does (logs in float64 then rounded: glibc and CUDA logf are within an ulp of that)."""
    u = (np.float32(1.0 / 8388608.0) * ((bits >> np.uint64(9)).astype(np.float32) + np.float32(0.5))).astype(np.float32)
    with np.errstate(divide="ignore"):
        inner = (-np.log(u.astype(np.float64))).astype(np.float32)
        return (-np.log(inner.astype(np.float64))).astype(np.float32)


def gumbel(seed: int, stream: int, rows: int, cols: int, device="cpu") -> Tensor:
    return torch.from_numpy(gumbel_from_bits(philox_bits(seed, stream, rows, cols))).to(device)


def token_gumbel(seed: int, candidates: Tensor) -> Tensor:
    """The token draw's noise at each candidate, indexed by its token id (a masked -1 takes id 0)."""
    ids = candidates.clamp(min=0).cpu().numpy()
    return torch.from_numpy(gumbel_from_bits(philox_bits_at(seed, TOKEN_STREAM, ids))).to(candidates.device)


@dataclass
class SampleTrace:
    cluster_scores: Tensor  # [B, C] raw float32 scores
    cluster_keys: Tensor    # [B, C] scores / T + Gumbel noise
    cluster_ids: Tensor     # [B, p] int32, draw order
    candidates: Tensor      # [B, N]
    scaled_logits: Tensor   # [B, N] logits / T (-inf where masked)
    token_keys: Tensor      # [B, N] scaled logits + Gumbel noise
    tokens: Tensor          # [B] int64
    token_logprobs: Tensor  # [B] float32


def sample_clusters(hidden, centroids, probes, temperature, seed: int) -> SampleTrace:
    return decode_sample(hidden, centroids, None, None, probes, temperature, seed)


def decode_sample(hidden, centroids, cluster_tokens, embedding, probes, temperature, seed: int, extra_ids=None) -> SampleTrace:
    """Gumbel-top-k over clusters then Gumbel-max over their candidates, the token noise indexed
    by token id (clusters only when ``cluster_tokens`` is None)."""
    s = scores(hidden, centroids)
    keys = s / temperature + gumbel(seed, CLUSTER_STREAM, s.shape[0], s.shape[1], s.device)
    cluster_ids = ranking(keys)[:, :probes].to(torch.int32)
    if cluster_tokens is None:
        return SampleTrace(s, keys, cluster_ids, *([None] * 5))
    candidates = gather_candidates(cluster_ids, cluster_tokens, extra_ids)
    scaled = candidate_logits(hidden, embedding, candidates) / temperature
    token_keys = scaled + token_gumbel(seed, candidates)
    valid = valid_candidates(candidates, embedding.shape[0])
    position, tokens = best_candidate(token_keys, candidates, valid)
    logprobs = torch.log_softmax(scaled, dim=1).gather(1, position.unsqueeze(1)).squeeze(1)
    return SampleTrace(s, keys, cluster_ids, candidates, scaled, token_keys, tokens, logprobs)


def dense_logits(hidden: Tensor, embedding: Tensor) -> Tensor:
    """float32 logits of every token ``[B, V]``, in chunks of the vocabulary."""
    step = max(1, _CHUNK_ELEMENTS // embedding.shape[1])
    return torch.cat([scores(hidden, embedding[i:i + step]) for i in range(0, embedding.shape[0], step)], dim=1)


def plackett_luce_pair_probs(weights: np.ndarray) -> np.ndarray:
    """P(first draw = i, second draw = j) for two draws without replacement, prob. ~ weights."""
    p = weights / weights.sum()
    joint = p[:, None] * p[None, :] / (1.0 - p[:, None])
    np.fill_diagonal(joint, 0.0)
    return joint
