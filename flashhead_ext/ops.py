"""Python entry points for the ``torch.ops.flashhead`` ops, and their fake kernels.

Argument checks (dtype, rank, shape, device, ranges of int arguments) live in the C++ ops so that
``torch.ops.flashhead.*`` callers get them too; they raise ``TypeError`` / ``ValueError`` naming
the argument and what was expected. They read metadata only, never tensor data, so the ops stay
free of host syncs. Data-dependent checks (ids inside a cluster table) cost a sync and run once,
when a head is built: see :func:`validate_cluster_table`. The kernels stay memory-safe even for
tables that skip it: an out-of-range id becomes a masked slot (-1, logit -inf), never a wild read.

Conventions shared by every op (docs/kernels.md):

* hidden ``[B, D]``; centroids ``[C, D]`` and embedding ``[V, D]`` of the same float dtype
  (float16, bfloat16 or float32); accumulation and all scores/logits in float32.
* ids are int32; ``-1`` in a candidate list is a masked slot whose logit is ``-inf``.
* ranking: higher score first, NaN below every number, ties to the smaller id (cluster id for
  cluster selection, token id for the final argmax, as ``torch.argmax`` on a dense row).
* non-contiguous inputs are copied to contiguous memory first.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

_ops = torch.ops.flashhead

SeedLike = Union[Tensor, int, None]


def _require_tensor(name: str, value) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _require_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def _require_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return float(value)


def make_seed(device: torch.device, seed: SeedLike = None, generator: Optional[torch.Generator] = None) -> Tensor:
    """A one-element int64 seed tensor on ``device`` for the sampling ops.

    Drawn on the device from ``generator`` (or torch's default generator) when ``seed`` is None,
    so no host sync happens and a captured CUDA graph draws a fresh seed at each replay.
    """
    if isinstance(seed, Tensor):
        return seed
    if seed is not None:
        return torch.full((), _require_int("seed", seed), dtype=torch.int64, device=device)
    if generator is not None and torch.device(generator.device).type != torch.device(device).type:
        raise ValueError(f"generator must be a {torch.device(device).type} generator like hidden, got one on {generator.device}")
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device, generator=generator)


def select_clusters(hidden: Tensor, centroids: Tensor, probes: int) -> tuple[Tensor, Tensor]:
    """The ``probes`` best clusters per row by centroid score, best first.

    Returns ``(cluster_ids int32 [B, probes], scores float32 [B, probes])``.
    """
    _require_tensor("hidden", hidden)
    _require_tensor("centroids", centroids)
    return _ops.select_clusters(hidden, centroids, _require_int("probes", probes))


def sample_clusters(
    hidden: Tensor,
    centroids: Tensor,
    probes: int,
    temperature: float = 1.0,
    *,
    seed: SeedLike = None,
    generator: Optional[torch.Generator] = None,
) -> tuple[Tensor, Tensor]:
    """``probes`` distinct clusters per row drawn without replacement from softmax(scores / T).

    Gumbel-top-k, in draw order. Returns ``(cluster_ids int32, raw scores float32)``, each
    ``[B, probes]``. The same seed gives the same draw.
    """
    _require_tensor("hidden", hidden)
    _require_tensor("centroids", centroids)
    seed_t = make_seed(hidden.device, seed, generator)
    return _ops.sample_clusters(
        hidden, centroids, _require_int("probes", probes), _require_float("temperature", temperature), seed_t
    )


def gather_candidates(cluster_ids: Tensor, cluster_tokens: Tensor, extra_ids: Optional[Tensor] = None) -> Tensor:
    """Candidate token ids ``int32 [B, probes * cluster_size + E]`` for the chosen clusters.

    ``extra_ids`` (E always-on tokens, e.g. special tokens) are appended to every row; an extra
    id already present among the row's candidates, or repeated, is masked to -1.
    """
    _require_tensor("cluster_ids", cluster_ids)
    _require_tensor("cluster_tokens", cluster_tokens)
    if extra_ids is not None:
        _require_tensor("extra_ids", extra_ids)
    return _ops.gather_candidates(cluster_ids, cluster_tokens, extra_ids)


def candidate_logits(hidden: Tensor, embedding: Tensor, candidate_ids: Tensor) -> Tensor:
    """Exact logits ``embedding[candidate_ids] . hidden`` as float32 ``[B, N]``; -inf where masked."""
    _require_tensor("hidden", hidden)
    _require_tensor("embedding", embedding)
    _require_tensor("candidate_ids", candidate_ids)
    return _ops.candidate_logits(hidden, embedding, candidate_ids)


def decode_greedy(
    hidden: Tensor,
    centroids: Tensor,
    cluster_tokens: Tensor,
    embedding: Tensor,
    probes: int,
    extra_ids: Optional[Tensor] = None,
    *,
    out: Optional[Tensor] = None,
) -> Tensor:
    """The whole greedy FlashHead path: int64 token id per row (argmax over the candidates).

    With ``out`` (int64 ``[B]``, may be a strided view, e.g. a column of a token buffer) the ids
    are written there and ``out`` is returned.
    """
    for name, value in (("hidden", hidden), ("centroids", centroids), ("cluster_tokens", cluster_tokens), ("embedding", embedding)):
        _require_tensor(name, value)
    if extra_ids is not None:
        _require_tensor("extra_ids", extra_ids)
    probes = _require_int("probes", probes)
    if out is None:
        return _ops.decode_greedy(hidden, centroids, cluster_tokens, embedding, probes, extra_ids)
    _require_tensor("out", out)
    _ops.decode_greedy_out(hidden, centroids, cluster_tokens, embedding, probes, extra_ids, out)
    return out


def decode_sample(
    hidden: Tensor,
    centroids: Tensor,
    cluster_tokens: Tensor,
    embedding: Tensor,
    probes: int,
    temperature: float = 1.0,
    extra_ids: Optional[Tensor] = None,
    *,
    seed: SeedLike = None,
    generator: Optional[torch.Generator] = None,
) -> tuple[Tensor, Tensor]:
    """The whole sampling FlashHead path.

    Clusters are drawn as in :func:`sample_clusters`, then one token from softmax(logits / T)
    over their candidates. Returns ``(tokens int64 [B], token_logprobs float32 [B])``: the log
    probability of each drawn token under that candidate distribution, which speculative
    sampling needs as the draft probability.
    """
    for name, value in (("hidden", hidden), ("centroids", centroids), ("cluster_tokens", cluster_tokens), ("embedding", embedding)):
        _require_tensor(name, value)
    if extra_ids is not None:
        _require_tensor("extra_ids", extra_ids)
    seed_t = make_seed(hidden.device, seed, generator)
    return _ops.decode_sample(
        hidden, centroids, cluster_tokens, embedding, _require_int("probes", probes),
        _require_float("temperature", temperature), seed_t, extra_ids,
    )


def validate_cluster_table(cluster_tokens: Tensor, vocab_size: int) -> None:
    """Checks a cluster table's ids (reads the data, so it syncs: call it once, not per step).

    Every entry must be a token id in ``[0, vocab_size)`` or the padding value -1, no token may
    appear twice, and every cluster must hold at least one token.
    """
    _require_tensor("cluster_tokens", cluster_tokens)
    vocab_size = _require_int("vocab_size", vocab_size)
    if cluster_tokens.dim() != 2 or cluster_tokens.numel() == 0:
        raise ValueError(f"cluster_tokens must be a non-empty 2-D tensor [num_clusters, cluster_size], got shape {tuple(cluster_tokens.shape)}")
    if cluster_tokens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cluster_tokens must hold integer token ids (int32 or int64), got {cluster_tokens.dtype}")
    table = cluster_tokens.detach().to("cpu", torch.int64)
    bad = (table < -1) | (table >= vocab_size)
    if bad.any():
        where = tuple(bad.nonzero()[0].tolist())
        raise ValueError(
            f"cluster_tokens holds id {int(table[where])} at {where}; ids must be in [0, {vocab_size}) or -1 for padding"
        )
    tokens = table[table >= 0]
    counts = torch.bincount(tokens, minlength=vocab_size)
    if (counts > 1).any():
        raise ValueError(f"cluster_tokens lists token {int((counts > 1).nonzero()[0])} more than once; clusters must be disjoint")
    empty = (table < 0).all(dim=1)
    if empty.any():
        raise ValueError(f"cluster {int(empty.nonzero()[0])} of cluster_tokens holds only padding; every cluster needs a token")


# Fake kernels: output shapes and dtypes only, for FakeTensor tracing (torch.compile, opcheck).
@torch.library.register_fake("flashhead::select_clusters")
def _select_clusters_fake(hidden, centroids, probes):
    shape = (hidden.shape[0], probes)
    return hidden.new_empty(shape, dtype=torch.int32), hidden.new_empty(shape, dtype=torch.float32)


@torch.library.register_fake("flashhead::sample_clusters")
def _sample_clusters_fake(hidden, centroids, probes, temperature, seed):
    return _select_clusters_fake(hidden, centroids, probes)


@torch.library.register_fake("flashhead::gather_candidates")
def _gather_candidates_fake(cluster_ids, cluster_tokens, extra_ids):
    width = cluster_ids.shape[1] * cluster_tokens.shape[1] + (0 if extra_ids is None else extra_ids.shape[0])
    return cluster_ids.new_empty((cluster_ids.shape[0], width), dtype=torch.int32)


@torch.library.register_fake("flashhead::candidate_logits")
def _candidate_logits_fake(hidden, embedding, candidate_ids):
    return hidden.new_empty(candidate_ids.shape, dtype=torch.float32)


@torch.library.register_fake("flashhead::decode_greedy")
def _decode_greedy_fake(hidden, centroids, cluster_tokens, embedding, probes, extra_ids):
    return hidden.new_empty((hidden.shape[0],), dtype=torch.int64)


@torch.library.register_fake("flashhead::decode_greedy_out")
def _decode_greedy_out_fake(hidden, centroids, cluster_tokens, embedding, probes, extra_ids, out):
    return None


@torch.library.register_fake("flashhead::decode_sample")
def _decode_sample_fake(hidden, centroids, cluster_tokens, embedding, probes, temperature, seed, extra_ids):
    batch = (hidden.shape[0],)
    return hidden.new_empty(batch, dtype=torch.int64), hidden.new_empty(batch, dtype=torch.float32)


__all__ = [
    "select_clusters", "sample_clusters", "gather_candidates", "candidate_logits",
    "decode_greedy", "decode_sample", "make_seed", "validate_cluster_table"
]
