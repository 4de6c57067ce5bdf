"""Equal-size spherical k-means over an output embedding: the clustering FlashHead retrieves from.

Every cluster holds exactly ``b`` tokens so the cluster table ``cluster_tokens[C, b]`` is dense
and the candidate gather has a fixed size.

Padding scheme (V not a multiple of b). With ``cluster_size=b``, ``C = ceil(V / b)``; with
``n_clusters=C``, ``b = ceil(V / C)``. The ``P = C*b - V`` missing slots are dealt one per
cluster from the last cluster backwards, wrapping round when ``P > C`` (tiny vocabularies only),
so cluster sizes differ by at most one; those rows of ``cluster_tokens`` end in ``-1``, the
padding value the ops mask. The table keeps width b even when no cluster is full.
``strict=True`` refuses such sizes with a ValueError instead.

Algorithm. Rows are L2-normalised; centroids start at ``C`` distinct random rows (seeded). Each
iteration scores every token against every centroid in row chunks (so ``V x C`` similarities
never exist at once), keeps each token's ``_CANDIDATES`` best centroids, and assigns greedily:
(token, centroid) pairs in decreasing similarity, a pair taken when the token is free and the
centroid has room. Tokens whose candidates all filled up go, by the same greedy, to the nearest
centroids that still have room. Centroids become the normalised mean of their members' unit rows.
It stops after ``iters`` iterations or when no token moves.

The result keeps the unnormalised mean (``raw_centroids``) as the published FlashHead assets do:
greedy decoding ranks clusters by its direction, sampling scores it raw. Measured on
SmolLM2-135M's head (C=3072, b=16, 768 Spec-Bench tokens, probes 64..512): ranking by this
direction agreed with the dense head's top-1 0.2-1.6 points less often than ranking by the
unnormalised mean of the members' raw rows, and 0-0.7 points more often than by that mean's direction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor
from tqdm.auto import tqdm

# Bump when build_clusters gives a different result for the same arguments: it names cache entries.
ALGORITHM_VERSION = 2
# Centroids considered per token by the greedy pass: enough that few tokens are left over when
# their favourites fill up, few enough that the sequential greedy stays cheap (V * 8 pairs).
_CANDIDATES = 8
# Similarity chunk: at most this many float32 scores live at once (64 MiB).
_CHUNK_ELEMENTS = 1 << 24


@dataclass
class Clustering:
    """Result of :func:`build_clusters`.

    Attributes:
        raw_centroids: float32 ``[C, D]``, the mean of each cluster's L2-normalised embedding
            rows, unnormalised (its norm says how tight the cluster is): what sampling scores
            clusters with, and what the published asset layout stores.
        cluster_tokens: int32 ``[C, b]``, member token ids ascending, ``-1`` padding at row ends.
        cluster_assignments: int64 ``[V]``, the cluster of each token.
        iterations: k-means iterations run (fewer than asked when it converged).
    """

    raw_centroids: Tensor
    cluster_tokens: Tensor
    cluster_assignments: Tensor
    iterations: int

    @property
    def centroids(self) -> Tensor:
        """float32 ``[C, D]``, unit-norm: what greedy decoding ranks clusters with."""
        return torch.nn.functional.normalize(self.raw_centroids, dim=1)

    @property
    def num_clusters(self) -> int:
        return self.cluster_tokens.shape[0]

    @property
    def cluster_size(self) -> int:
        return self.cluster_tokens.shape[1]


def cluster_sizes(vocab_size: int, cluster_size: Optional[int] = None, n_clusters: Optional[int] = None,
                  strict: bool = False) -> tuple[int, Tensor]:
    """``(b, sizes)``: the table width b and each cluster's token count (int64 ``[C]``) under the
    padding scheme of this module."""
    if (cluster_size is None) == (n_clusters is None):
        raise ValueError("give exactly one of cluster_size and n_clusters")
    given_name, given = ("cluster_size", cluster_size) if cluster_size is not None else ("n_clusters", n_clusters)
    if isinstance(given, bool) or not isinstance(given, int):
        raise TypeError(f"{given_name} must be an int, got {type(given).__name__}")
    if not 1 <= given <= vocab_size:
        raise ValueError(f"{given_name} must be in 1..{vocab_size} (the vocabulary size), got {given}")
    if cluster_size is not None:
        size, count = cluster_size, math.ceil(vocab_size / cluster_size)
    else:
        size, count = math.ceil(vocab_size / n_clusters), n_clusters
    pad = count * size - vocab_size
    if pad and strict:
        raise ValueError(
            f"vocabulary size {vocab_size} is not a multiple of {given_name}={given} and strict=True; "
            f"pass strict=False to pad the last clusters with -1")
    # Missing slots dealt one per cluster from the last cluster backwards, wrapping when P > C.
    pads = torch.full((count,), pad // count, dtype=torch.int64)
    pads[count - pad % count:] += 1
    return size, size - pads


def cluster_table(assignments: Tensor, n_clusters: int, width: Optional[int] = None) -> Tensor:
    """int32 ``[C, width]`` table of each cluster's token ids, ascending, right-padded with -1.

    ``width`` defaults to the largest cluster. Raises ValueError if a cluster is larger than ``width``.
    """
    assignments = assignments.to(torch.int64)
    counts = torch.bincount(assignments, minlength=n_clusters)
    width = int(counts.max()) if width is None else width
    if int(counts.max()) > width:
        raise ValueError(f"cluster {int(counts.argmax())} holds {int(counts.max())} tokens, more than the table width {width}")
    # Stable sort by cluster keeps token ids ascending inside each cluster.
    tokens = torch.sort(assignments, stable=True).indices
    owner = assignments[tokens]
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(tokens.numel(), device=tokens.device) - starts[owner]
    table = torch.full((n_clusters, width), -1, dtype=torch.int32, device=assignments.device)
    table[owner, slot] = tokens.to(torch.int32)
    return table


def _chunk_rows(n_clusters: int) -> int:
    return max(1, _CHUNK_ELEMENTS // n_clusters)


def _top_candidates(rows: Tensor, centroids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Each row's k most similar centroids (scores, ids), computed in row chunks."""
    scores, ids = [], []
    for chunk in torch.split(rows, _chunk_rows(centroids.shape[0])):
        s, i = torch.topk(chunk @ centroids.T, k, dim=1)
        scores.append(s)
        ids.append(i)
    return torch.cat(scores), torch.cat(ids)


def _greedy_fill(tokens: Tensor, scores: Tensor, ids: Tensor, capacity: list, assignment: list) -> None:
    """Pairs (tokens[i], ids[i, j]) in decreasing score; take one when the token is free and the cluster has room."""
    order = torch.sort(scores.flatten(), descending=True, stable=True).indices.cpu()
    k = ids.shape[1]
    flat_tokens = tokens.cpu()[order // k].tolist()
    flat_clusters = ids.flatten().cpu()[order].tolist()
    unplaced = tokens.numel()
    for t, c in zip(flat_tokens, flat_clusters):
        if assignment[t] < 0 and capacity[c] > 0:
            assignment[t] = c
            capacity[c] -= 1
            unplaced -= 1
            if unplaced == 0:  # the tail of the list can only hold taken tokens
                break


def _assign(rows: Tensor, centroids: Tensor, sizes: Tensor) -> Tensor:
    """Capacity-constrained greedy assignment of every row; cluster c receives exactly sizes[c] rows."""
    vocab, n_clusters = rows.shape[0], centroids.shape[0]
    capacity = sizes.tolist()
    assignment = [-1] * vocab
    tokens = torch.arange(vocab, device=rows.device)
    scores, ids = _top_candidates(rows, centroids, min(_CANDIDATES, n_clusters))
    _greedy_fill(tokens, scores, ids, capacity, assignment)
    # Leftovers: their candidates filled up first. Retry against the clusters with room only;
    # each round assigns at least the best remaining pair, and total room equals the leftovers.
    while True:
        free = torch.tensor([t for t, c in enumerate(assignment) if c < 0], dtype=torch.int64)
        if free.numel() == 0:
            break
        open_ids = torch.tensor([c for c, room in enumerate(capacity) if room > 0], dtype=torch.int64, device=rows.device)
        free = free.to(rows.device)
        scores, local = _top_candidates(rows[free], centroids[open_ids], min(_CANDIDATES, open_ids.numel()))
        _greedy_fill(free, scores, open_ids[local], capacity, assignment)
    return torch.tensor(assignment, dtype=torch.int64, device=rows.device)


def _member_means(rows: Tensor, table: Tensor, sizes: Tensor) -> Tensor:
    """Mean member row per cluster, from the padded table (a gather and a sum: deterministic on CUDA too)."""
    members = rows[table.clamp(min=0).long()] * (table >= 0).unsqueeze(-1)
    return members.sum(dim=1) / sizes.to(rows.device, rows.dtype).unsqueeze(1)


def build_clusters(
    embedding: Tensor,
    cluster_size: Optional[int] = None,
    *,
    n_clusters: Optional[int] = None,
    iters: int = 15,
    seed: int = 0,
    device: Union[str, torch.device, None] = None,
    strict: bool = False,
    progress: bool = True,
) -> Clustering:
    """Equal-size spherical k-means of the rows of ``embedding`` ``[V, D]``.

    Give ``cluster_size`` (tokens per cluster, default 16) or ``n_clusters``. ``V`` not a multiple
    of the cluster size pads the last clusters with -1 (module docstring), or raises ValueError
    with ``strict=True``. Runs on ``device`` (default: the embedding's) in float32; the same seed
    gives the same clustering on the same device. Returns a :class:`Clustering` on that device.
    """
    if not isinstance(embedding, Tensor):
        raise TypeError(f"embedding must be a torch.Tensor [vocab_size, hidden_dim], got {type(embedding).__name__}")
    if embedding.dim() != 2 or embedding.numel() == 0 or not embedding.is_floating_point():
        raise ValueError(f"embedding must be a non-empty 2-D float tensor [vocab_size, hidden_dim], got shape "
                         f"{tuple(embedding.shape)} and dtype {embedding.dtype}")
    for name, value in (("iters", iters), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if cluster_size is None and n_clusters is None:
        cluster_size = 16
    vocab = embedding.shape[0]
    width, sizes = cluster_sizes(vocab, cluster_size, n_clusters, strict)
    count = sizes.numel()
    if not torch.isfinite(embedding).all():
        raise ValueError("embedding holds NaN or infinite values; k-means needs finite rows")

    rows = torch.nn.functional.normalize(embedding.detach().to(device or embedding.device, torch.float32), dim=1)
    # Seeds drawn on the CPU so the initial centroids do not depend on the device's generator.
    generator = torch.Generator().manual_seed(seed)
    start = torch.randperm(vocab, generator=generator)[:count].to(rows.device)
    centroids = rows[start]

    assignment = None
    iterations = 0
    bar = tqdm(range(iters), desc=f"k-means {vocab}x{rows.shape[1]} -> {count}x{width}", disable=not progress, leave=False)
    for _ in bar:
        new = _assign(rows, centroids, sizes)
        moved = vocab if assignment is None else int((new != assignment).sum())
        assignment = new
        table = cluster_table(assignment, count, width)
        means = _member_means(rows, table, sizes)
        centroids = torch.nn.functional.normalize(means, dim=1)
        iterations += 1
        bar.set_postfix(moved=moved)
        if moved == 0:
            break
    bar.close()
    return Clustering(
        raw_centroids=means,
        cluster_tokens=table,
        cluster_assignments=assignment,
        iterations=iterations,
    )


__all__ = ["Clustering", "build_clusters", "cluster_sizes", "cluster_table"]
