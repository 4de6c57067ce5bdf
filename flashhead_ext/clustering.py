"""Equal-size spherical k-means over an output embedding: the clustering FlashHead retrieves from.

Every cluster holds exactly ``b`` tokens so the cluster table ``cluster_tokens[C, b]`` is dense
and the candidate gather has a fixed size.

Padding scheme (V not a multiple of b). With ``cluster_size=b``, ``C = ceil(V / b)``; with
``n_clusters=C``, ``b = ceil(V / C)``. The ``P = C*b - V`` missing slots are dealt one per
cluster from the last cluster backwards, wrapping round when ``P > C`` (tiny vocabularies only),
so cluster sizes differ by at most one; those rows of ``cluster_tokens`` end in ``-1``, the
padding value the ops mask. The table is as wide as the largest cluster: b, or less where no
cluster is full (P >= C), so a clustering saved and loaded again (which keeps no width) has the
table it was built with.
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

Calibrated clusterings (:func:`calibrate_clusters`, the better choice whenever the model's own
final hidden states are at hand) use those states twice. First, k-means runs on the rows
``E S^1/2``, with ``S`` the states' second moment: the dot product of two such rows is the
covariance of the two tokens' logits over the states, so clusters group tokens whose logits rise
and fall together. Second, each centroid is the ridge least-squares fit, over the states, of the
cluster's best member logit ``max_t E_t . h``, so ranking clusters by ``centroid . h`` estimates
ranking them by their best token. These centroids carry their meaning in their norms: greedy
decoding ranks them raw (``greedy_scoring="raw"``). Measured in docs/quality.md.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor
from tqdm.auto import tqdm

from . import ops
from ._stacklevel import callers_stacklevel

# Bump when build_clusters (or calibrate_clusters) gives a different result for the same
# arguments: it names cache entries.
ALGORITHM_VERSION = 2
GREEDY_SCORINGS = ("normalized", "raw")
# Centroids considered per token by the greedy pass: enough that few tokens are left over when
# their favourites fill up, few enough that the sequential greedy stays cheap (V * 8 pairs).
_CANDIDATES = 8
# Similarity chunk: at most this many float32 scores live at once (64 MiB).
_CHUNK_ELEMENTS = 1 << 24
# calibrate_clusters warns below this many states per hidden dimension D. Each centroid is a
# D-dimensional least-squares fit (and the whitening a D x D moment): with too few states it ranks
# clusters worse than plain k-means' mean directions. On SmolLM2 (D = 576; b = 16, 192 probes,
# 4,759 odd-id tokens; whole even-id prompts drawn with 5 seeds, docs/quality.md) calibration still
# fell below k-means in one draw of 5 at 1.97 D states, and beat it in all 5 by 2.7-3.2 points at
# 3.0-3.1 D: 3 leaves that margin, as the crossover need not sit at the same multiple of D elsewhere.
MIN_STATES_PER_DIM = 3


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
        method: ``"kmeans"`` (:func:`build_clusters`) or ``"calibrated"`` (:func:`calibrate_clusters`,
            whose ``raw_centroids`` are fitted max-logit estimators).
        greedy_scoring: ``"normalized"``: greedy decoding ranks clusters by the L2-normalised
            centroids (published FlashHead behaviour); ``"raw"``: by the centroids as they are.
    """

    raw_centroids: Tensor
    cluster_tokens: Tensor
    cluster_assignments: Tensor
    iterations: int
    method: str = "kmeans"
    greedy_scoring: str = "normalized"

    @property
    def centroids(self) -> Tensor:
        """float32 ``[C, D]``: what greedy decoding ranks clusters with (see ``greedy_scoring``)."""
        return greedy_centroids(self.raw_centroids, self.greedy_scoring)

    @property
    def num_clusters(self) -> int:
        return self.cluster_tokens.shape[0]

    @property
    def cluster_size(self) -> int:
        return self.cluster_tokens.shape[1]


def greedy_centroids(raw_centroids: Tensor, greedy_scoring: str) -> Tensor:
    """The centroids greedy decoding ranks with: ``raw_centroids`` L2-normalised, or as they are."""
    if greedy_scoring not in GREEDY_SCORINGS:
        raise ValueError(f"greedy_scoring must be one of {GREEDY_SCORINGS}, got {greedy_scoring!r}")
    return torch.nn.functional.normalize(raw_centroids, dim=1) if greedy_scoring == "normalized" else raw_centroids


def cluster_sizes(vocab_size: int, cluster_size: Optional[int] = None, n_clusters: Optional[int] = None,
                  strict: bool = False) -> tuple[int, Tensor]:
    """``(b, sizes)``: the cluster size b (given, or made from ``n_clusters``) and each cluster's token
    count (int64 ``[C]``) under the padding scheme of this module. A table built on it is ``sizes.max()``
    wide: b unless every cluster gets a padding slot."""
    ops._require_positive_int("vocab_size", vocab_size)
    ops._require_bool("strict", strict)  # "false" read as truthy had refused a padded split
    if (cluster_size is None) == (n_clusters is None):
        raise ValueError("give exactly one of cluster_size and n_clusters")
    given_name, given = ("cluster_size", cluster_size) if cluster_size is not None else ("n_clusters", n_clusters)
    if not ops._is_int(given):
        raise TypeError(f"{given_name} must be an int, got {ops._type_name(given)}")
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
    pads = torch.full((count,), pad // count, dtype=torch.int64, device="cpu")
    pads[count - pad % count:] += 1
    return size, size - pads


def check_cluster_ids(name: str, assignments: Tensor, n_clusters: int) -> None:
    """A ValueError naming the first token of integer ``assignments`` whose id is outside ``[0, n_clusters)``."""
    bad = (assignments < 0) | (assignments >= n_clusters)
    if bad.any():
        token = int(bad.nonzero()[0])
        raise ValueError(f"{name}[{token}] = {int(assignments[token])} is not a cluster id in [0, {n_clusters})")


def cluster_table(assignments: Tensor, n_clusters: int, width: Optional[int] = None) -> Tensor:
    """int32 ``[C, width]`` table of each cluster's token ids, ascending, right-padded with -1.

    ``width`` defaults to the largest cluster. Raises ValueError if a cluster is larger than ``width``.
    """
    ops._require_tensor("assignments", assignments)
    n_clusters = ops._require_positive_int("n_clusters", n_clusters)
    if width is not None:
        width = ops._require_positive_int("width", width)
    # A cast would truncate float ids and turn bools into 0/1 silently.
    if assignments.is_floating_point() or assignments.is_complex() or assignments.dtype == torch.bool:
        raise TypeError(f"assignments must hold integer cluster ids, got {assignments.dtype}")
    if assignments.dim() != 1:
        raise ValueError(f"assignments must be 1-D [vocab], got shape {tuple(assignments.shape)}")
    ops._require_values("assignments", assignments)
    assignments = assignments.to(torch.int64)
    check_cluster_ids("assignments", assignments, n_clusters)
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
        free = torch.tensor([t for t, c in enumerate(assignment) if c < 0], dtype=torch.int64, device="cpu")
        if free.numel() == 0:
            break
        open_ids = torch.tensor([c for c, room in enumerate(capacity) if room > 0], dtype=torch.int64, device=rows.device)
        free = free.to(rows.device)
        scores, local = _top_candidates(rows[free], centroids[open_ids], min(_CANDIDATES, open_ids.numel()))
        _greedy_fill(free, scores, open_ids[local], capacity, assignment)
    return torch.tensor(assignment, dtype=torch.int64, device=rows.device)


def member_means(rows: Tensor, table: Tensor) -> Tensor:
    """Mean member row per cluster, from the padded table (a gather and a sum: deterministic on CUDA
    too); a zero row for a cluster of padding alone."""
    members = table >= 0
    summed = (rows[table.clamp(min=0).long()] * members.unsqueeze(-1)).sum(dim=1)
    return summed / members.sum(dim=1, keepdim=True).clamp(min=1).to(rows.dtype)


def _check_matrix(name: str, value, shape: str, finite: bool = True) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(value).__name__}")
    if value.dim() != 2 or value.numel() == 0 or not value.is_floating_point():
        raise ValueError(f"{name} must be a non-empty 2-D float tensor {shape}, got shape "
                         f"{tuple(value.shape)} and dtype {value.dtype}")
    if value.element_size() < 2:  # torch.isfinite and the clustering's arithmetic have no fp8 kernels
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {value.dtype}")
    ops._require_values(name, value, "; clustering needs them: materialise it first")
    if finite and not torch.isfinite(value).all():
        raise ValueError(f"{name} holds NaN or infinite values; clustering needs finite rows")
    if finite and value.dtype == torch.float64:  # clustered in float32, where such values are infinite
        low, high = torch.aminmax(value)
        limit = torch.finfo(torch.float32).max
        if low < -limit or high > limit:
            raise ValueError(f"{name} holds values beyond float32's range (±{limit:.4g}), in which it is clustered, "
                             f"got {low.item():.4g} to {high.item():.4g}")


def check_seed(seed) -> None:
    """A k-means seed: an int that torch.Generator.manual_seed takes, or a TypeError / ValueError."""
    if not ops._is_int(seed):
        raise TypeError(f"seed must be an int, got {ops._type_name(seed)}")
    if not -2**63 <= seed < 2**64:
        raise ValueError(f"seed must be in -2**63..2**64 - 1 (what torch.Generator.manual_seed takes), got {seed}")


def check_kmeans_settings(iters, seed, iters_name: str = "iters") -> None:
    """build_clusters' checks of its k-means ``iters`` and ``seed``: a TypeError or ValueError naming
    the argument (``iters_name`` where a caller calls it otherwise)."""
    check_seed(seed)
    ops._require_positive_int(iters_name, iters)


def check_clustering_inputs(embedding, hidden=None, *, finite: bool = True) -> None:
    """The checks build_clusters makes of ``embedding`` and, with ``hidden``, calibrate_clusters of
    both: a TypeError or ValueError naming the argument. ``finite=False`` leaves out the pass over
    every value for NaN and infinities, for a caller that clusters only through those two."""
    _check_matrix("embedding", embedding, "[vocab_size, hidden_dim]", finite)
    if hidden is not None:
        _check_matrix("hidden", hidden, f"[num_states, {embedding.shape[1]}]", finite)
        if hidden.shape[1] != embedding.shape[1]:
            raise ValueError(f"hidden must have the embedding's hidden size {embedding.shape[1]}, got shape {tuple(hidden.shape)}")


def _clustering_device(device, embedding: Tensor) -> torch.device:
    """Where the clustering runs: ``device``, or the embedding's with None."""
    # Else torch's error came from the first value read there, naming nothing (or only a driver).
    return ops._runnable_device(embedding.device if device is None else device, "clustering")


def _checked_sizes(vocab: int, cluster_size, n_clusters, iters, seed, strict, progress) -> Tensor:
    """build_clusters' checks of its settings, before any work: each cluster's token count
    (:func:`cluster_sizes`; clusters of 16 where neither size is given)."""
    check_kmeans_settings(iters, seed)
    ops._require_bool("progress", progress)
    if cluster_size is None and n_clusters is None:
        cluster_size = 16
    return cluster_sizes(vocab, cluster_size, n_clusters, strict)[1]


def _unit_rows(rows: Tensor) -> Tensor:
    """float32 ``rows`` scaled to unit length. A row whose length overflows float32 (past about
    1.8e19) or falls under normalize's 1e-12 is divided by its largest value first: else it became
    a zero row (or stayed short), and a row's scale is not to change its cluster."""
    lengths = torch.linalg.vector_norm(rows, dim=1)
    largest = rows.abs().amax(dim=1)
    rescale = (~torch.isfinite(lengths) | (lengths < 1e-12)) & (largest > 0)
    if rescale.any():  # out of place: rows may be the caller's tensor
        rows = rows.index_put((rescale,), rows[rescale] / largest[rescale, None])
    return torch.nn.functional.normalize(rows, dim=1)


@ops._autocast_off
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
    Thousands of identical rows (untrained padding rows) slow the capacity-constrained assignment,
    which fills their few shared best clusters a round at a time: SmolLM2's embedding with 4,000
    zero rows added took 8x as long an iteration on a CPU.
    """
    check_clustering_inputs(embedding)
    device = _clustering_device(device, embedding)
    sizes = _checked_sizes(embedding.shape[0], cluster_size, n_clusters, iters, seed, strict, progress)
    vocab = embedding.shape[0]
    width = int(sizes.max())
    count = sizes.numel()

    rows = _unit_rows(embedding.detach().to(device, torch.float32))
    # Seeds drawn on the CPU so the initial centroids do not depend on the device's generator.
    generator = torch.Generator().manual_seed(seed)
    start = torch.randperm(vocab, generator=generator, device="cpu")[:count].to(rows.device)
    centroids = rows[start]
    # Every score ties where every row is the same (a constant or all-zero embedding, e.g. an
    # untrained head): any equal-size split is as good, and the greedy would place only _CANDIDATES
    # clusters' worth a round, re-scoring every free row each time (minutes at 49k rows). The rows
    # never change, so this is checked once, not each iteration.
    in_order = (torch.repeat_interleave(torch.arange(count, device=rows.device), sizes.to(rows.device))
                if bool((rows == rows[:1]).all()) else None)

    assignment = None
    iterations = 0
    bar = tqdm(range(iters), desc=f"k-means {vocab}x{rows.shape[1]} -> {count}x{width}", disable=not progress, leave=False)
    for _ in bar:
        new = _assign(rows, centroids, sizes) if in_order is None else in_order
        moved = vocab if assignment is None else int((new != assignment).sum())
        assignment = new
        table = cluster_table(assignment, count, width)
        means = member_means(rows, table)
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


def _check_ridge(ridge) -> None:
    if not ops._is_number(ridge):  # a numpy float32 or a tensor was told it was not finite and > 0
        raise TypeError(f"ridge must be a Python float or int, got {ops._type_name(ridge)} (convert it with float())")
    try:
        valid = math.isfinite(ridge) and ridge > 0
    except OverflowError:  # an int past float's range
        valid = False
    if not valid:
        raise ValueError(f"ridge must be a finite number > 0, got {ridge!r}")


def _on_one_cpu_thread(fn, *args):
    """``fn(*args)`` with torch on one thread where ``args`` are CPU tensors: LAPACK's eigh and solve
    move in their last bits with the thread count, which flipped near-tie k-means assignments (24
    of SmolLM2's 3,072 clusters between 1 and 2 threads) and moved fitted centroids by hundreds of
    ulps, while the cache keys a clustering by its inputs only. On D x D matrices: one thread took
    0.02 s at D = 576 and 6 s at 4096 for eigh (2 cores), against k-means' minutes. So do the
    products summed over the states (``states.T @ x``), whose sums BLAS splits among threads."""
    if any(arg.device.type != "cpu" for arg in args):
        return fn(*args)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


@ops._autocast_off
def best_member_logits(embedding: Tensor, hidden: Tensor, table: Tensor, rows_per_chunk: int = 256) -> Tensor:
    """float32 ``[N, C]``: for each state, each cluster's largest member logit ``max_t E_t . h``."""
    check_clustering_inputs(embedding, hidden, finite=False)
    if hidden.dtype != embedding.dtype:
        raise TypeError(f"hidden must have the embedding's dtype {embedding.dtype}, got {hidden.dtype}")
    ops.validate_cluster_table(table, embedding.shape[0])
    ops._require_positive_int("rows_per_chunk", rows_per_chunk)
    return _best_member_logits(embedding, hidden, table, rows_per_chunk)


def _best_member_logits(embedding: Tensor, hidden: Tensor, table: Tensor, rows_per_chunk: int = 256) -> Tensor:
    """best_member_logits after its checks."""
    index, real = table.clamp(min=0).long(), table >= 0
    out = []
    for rows in hidden.split(rows_per_chunk):
        logits = (rows @ embedding.T)[:, index]  # [rows, C, b]
        out.append(logits.masked_fill_(~real, float("-inf")).amax(dim=2))
    return torch.cat(out)


@ops._autocast_off
def fit_max_logit_centroids(embedding: Tensor, hidden: Tensor, cluster_tokens: Tensor, ridge: float = 1e-3) -> Tensor:
    """float32 ``[C, D]``: per cluster, the vector ``g`` minimising ``sum_h (g . h - max_t E_t . h)^2``
    over the states plus ``ridge * mean(diag(H^T H)) * |g|^2``, ``t`` ranging over the cluster's
    tokens in ``cluster_tokens`` ``[C, b]`` (-1 padding). Ranked raw, these estimate each
    cluster's best logit."""
    _check_ridge(ridge)
    check_clustering_inputs(embedding, hidden, finite=False)
    ops.validate_cluster_table(cluster_tokens, embedding.shape[0])
    rows, states = embedding.detach().float(), hidden.detach().to(embedding.device, torch.float32)
    return _fit_max_logit_centroids(rows, states, cluster_tokens, ridge, _on_one_cpu_thread(torch.matmul, states.T, states))


def _fit_max_logit_centroids(rows: Tensor, states: Tensor, cluster_tokens: Tensor, ridge: float, gram: Tensor) -> Tensor:
    """fit_max_logit_centroids after its checks, on float32 rows and states of one device, given the
    states' Gram matrix ``states.T @ states`` (calibrate_clusters has it already)."""
    targets = _best_member_logits(rows, states, cluster_tokens.to(rows.device))
    regularised = gram + ridge * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    moments = _on_one_cpu_thread(torch.matmul, states.T, targets)
    try:
        centroids = _on_one_cpu_thread(torch.linalg.solve, regularised, moments).T.contiguous()
    except torch.linalg.LinAlgError as error:  # all-zero (or vanishingly small) states leave nothing to fit
        raise ValueError(f"hidden gives a singular fit (the mean diagonal of its Gram matrix is "
                         f"{float(gram.diagonal().mean()):.3g}): the states are zero or too small to calibrate on") from error
    # A sync, once per fit: a huge ridge (or huge states) overflows float32 and the fit comes out NaN.
    if not torch.isfinite(centroids).all():
        raise ValueError(f"the fitted centroids are not finite: ridge ({ridge!r}) times the mean diagonal of the states' "
                         "Gram matrix (their squares summed over the states) overflows float32, or the states or "
                         "embedding are too large")
    return centroids


@ops._autocast_off
def calibrate_clusters(
    embedding: Tensor,
    hidden: Tensor,
    cluster_size: Optional[int] = None,
    *,
    n_clusters: Optional[int] = None,
    iters: int = 15,
    seed: int = 0,
    ridge: float = 1e-3,
    device: Union[str, torch.device, None] = None,
    strict: bool = False,
    progress: bool = True,
) -> Clustering:
    """Equal-size clusters and max-logit centroids calibrated on the model's final hidden states.

    ``hidden`` ``[N, D]``: states the head will see (e.g. recorded while the model generates on
    calibration text; never the text you evaluate on). K-means (as :func:`build_clusters`, same
    sizes, padding, ``iters`` and ``seed``) runs on the embedding whitened by the states' second
    moment; each centroid is then the least-squares fit of its cluster's best member logit over
    the states, with a ridge of ``ridge`` times the moment's mean diagonal (module docstring). The
    result has ``method="calibrated"`` and ``greedy_scoring="raw"``. Deterministic for a seed on
    one device, whatever torch's thread count. Warns with fewer than ``MIN_STATES_PER_DIM`` (3) times D states: on SmolLM2,
    fewer than about 2 D calibrated worse than plain k-means (:func:`build_clusters`).
    """
    check_clustering_inputs(embedding, hidden)
    # Before the whitening, minutes on a large vocabulary, not after it.
    _check_ridge(ridge)
    device = _clustering_device(device, embedding)
    _checked_sizes(embedding.shape[0], cluster_size, n_clusters, iters, seed, strict, progress)
    count, dim = hidden.shape
    enough = MIN_STATES_PER_DIM * dim
    if count < dim:
        # The whitening then keeps only the states' span, and k-means clusters a projection of the
        # embedding onto it; the fit that follows cannot recover what the clusters lost.
        warnings.warn(f"calibrate_clusters: {count} states for hidden size {dim}; their second moment has rank at "
                      f"most {count}, so the clusters see only that subspace. Record at least {enough} states "
                      f"({MIN_STATES_PER_DIM}x the hidden size), or use build_clusters.", stacklevel=callers_stacklevel())
    elif count < enough:
        warnings.warn(f"calibrate_clusters: {count} states for hidden size {dim}, fewer than {MIN_STATES_PER_DIM}x "
                      f"it ({enough}); with about 2x the hidden size or fewer, a calibrated clustering was measured "
                      "to agree with the dense head less often than plain k-means. Record more states, or use "
                      "build_clusters.", stacklevel=callers_stacklevel())
    rows = embedding.detach().to(device, torch.float32)
    states = hidden.detach().to(device, torch.float32)
    gram = _on_one_cpu_thread(torch.matmul, states.T, states)
    moment = gram / states.shape[0]
    if not torch.isfinite(moment).all():  # else LAPACK's "failed to converge"
        raise ValueError("the second moment of hidden (its states' squares, summed) overflows float32: states this "
                         f"large (up to {float(states.abs().max()):.3g}) are no final hidden states; pass the states the "
                         "head receives")
    values, vectors = _on_one_cpu_thread(torch.linalg.eigh, moment)
    root = (vectors * values.clamp(min=0).sqrt()) @ vectors.T
    clustering = build_clusters(rows @ root, cluster_size, n_clusters=n_clusters, iters=iters, seed=seed,
                                device=device, strict=strict, progress=progress)
    centroids = _fit_max_logit_centroids(rows, states, clustering.cluster_tokens, ridge, gram)
    return Clustering(raw_centroids=centroids, cluster_tokens=clustering.cluster_tokens,
                      cluster_assignments=clustering.cluster_assignments, iterations=clustering.iterations,
                      method="calibrated", greedy_scoring="raw")


__all__ = ["Clustering", "build_clusters", "calibrate_clusters", "cluster_sizes", "cluster_table", "greedy_centroids",
           "best_member_logits", "fit_max_logit_centroids"]
