"""FlashHead clusterings on disk, in the layout of published FlashHead checkpoints.

Layout of an assets directory ``<dir>``::

    <dir>/flash_head_config.json                            config keys (below); written by us
    <dir>/<flash_head_cache_dir>/clustering_cache.safetensors
        centroids            float32 [D, C] (hidden x clusters; leading singleton dims accepted on load)
        cluster_assignments  int64 [V], the cluster id of each vocabulary token
        embedding_row_projections  float32 [V, 4], ours, optional (below)

Config keys: ``flash_head_cache_dir`` (default ``"flash_head_assets"``), ``n_clusters``,
``n_probes`` (default C/16), ``flash_head_special_token_ids`` (tokens scored at every step),
``enforce_equal_cluster_sizes`` (default true), and one key of ours,
``flash_head_greedy_scoring``: ``"normalized"`` (the default, and what published checkpoints
mean) or ``"raw"`` (calibrated clusterings, whose centroids are fitted max-logit estimators and
lose their meaning when normalised); and, where the clustering was built by
:func:`flash_head_for` (as :func:`~flashhead_ext.hf.attach` builds one),
``flash_head_embedding_fingerprint``: projections of a few rows of the output embedding it was
built for, so that loading it for other weights warns, with the tensor
``embedding_row_projections``: every row's projections, so that a fine-tune of a few rows (new
tokens trained) warns too; and, written by :func:`save_assets`, ``flash_head_tensors_sha256``,
the tensors file's digest, so that a config never loads with another save's tensors. A model directory that carries these keys
in its ``config.json`` instead, as published checkpoints do, loads the same way.

The stored centroids are raw, unnormalised cluster centroids (k-means: the mean of the members'
unit rows, see :mod:`flashhead_ext.clustering`). Greedy decoding ranks clusters with their
L2-normalised copies (or, with ``flash_head_greedy_scoring: "raw"``, the stored vectors), sampling
scores them raw; both are kept.

With ``enforce_equal_cluster_sizes`` every cluster must hold the same number of tokens. Without
it clusters may differ in size: the cluster table is as wide as the largest and shorter rows are
padded with -1 (what :mod:`flashhead_ext.clustering` produces when V is not a multiple of b).
"""
from __future__ import annotations

import hashlib
import json
import math
import operator
import os
import re
import secrets
import shutil
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes, save as save_bytes
from torch import Tensor

from .clustering import (ALGORITHM_VERSION, GREEDY_SCORINGS, Clustering, build_clusters, calibrate_clusters,
                         check_cluster_ids, check_clustering_inputs, check_kmeans_settings, cluster_sizes,
                         cluster_table, greedy_centroids)
from . import ops
from ._stacklevel import callers_stacklevel
from .head import SpecialTokenIds, FlashHead, _check_embedding, centroid_dtype_option, special_token_list

CONFIG_NAME = "flash_head_config.json"
TENSORS_NAME = "clustering_cache.safetensors"
DEFAULT_CACHE_DIR = "flash_head_assets"
CONFIG_KEYS = ("flash_head_cache_dir", "n_clusters", "n_probes", "flash_head_special_token_ids", "enforce_equal_cluster_sizes",
               "flash_head_greedy_scoring", "flash_head_embedding_fingerprint", "flash_head_tensors_sha256")
STALE_PARTIAL_S = 3600  # a partial file older than this was left by a killed write
FINGERPRINT_ROWS, FINGERPRINT_DIRECTIONS = 64, 4
# bf16 rounding moves a fingerprint by about 0.1% of its largest value; other weights by about 100%.
FINGERPRINT_TOLERANCE = 0.02
DIGEST_SLICE = 1 << 22  # values hashed at a time: 16 MB as float32
ROW_PROJECTIONS = "embedding_row_projections"
ROW_SLICE_VALUES = 1 << 21  # values projected at a time: 16 MB as float64
# What a cast can move a weight by: bfloat16's unit roundoff (the coarsest of the head's dtypes)
# times the value, plus half float16's smallest subnormal spacing (values near zero lose bits).
CAST_ROUNDING, CAST_FLUSH = 2.0 ** -8, 2.0 ** -25
STORED_ROUNDING = 2.0 ** -24  # float32's unit roundoff: the stored projections' own rounding

PathLike = Union[str, os.PathLike]


def user_cache_dir() -> Path:
    """Where flashhead_ext caches what it builds: $FLASHHEAD_CACHE_DIR, else $XDG_CACHE_HOME/flashhead_ext, else ~/.cache/flashhead_ext."""
    if os.environ.get("FLASHHEAD_CACHE_DIR"):
        return Path(os.environ["FLASHHEAD_CACHE_DIR"]).expanduser()  # "~/x" quoted in a shell stays unexpanded
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "flashhead_ext"


@contextmanager
def uncached_on_failure(what: str):
    """A cache write that fails (a read-only cache, a file in a directory's place) warns, and the
    caller goes on with what it built: minutes of work are not lost to the cache."""
    try:
        yield
    except OSError as error:
        warnings.warn(f"{what} could not be cached under {user_cache_dir()} ({error}); going on without the cache. "
                      "Set FLASHHEAD_CACHE_DIR to a writable directory to keep it.", RuntimeWarning, stacklevel=3)


def default_probes(n_clusters: int) -> int:
    """C/16 (at least 1), the published default when ``n_probes`` is absent."""
    return max(1, n_clusters // 16)


@dataclass
class FlashHeadAssets:
    """A clustering with its FlashHead settings, as stored on disk.

    Attributes:
        raw_centroids: float32 ``[C, D]`` centroids as stored, unnormalised (sampling scores these).
        cluster_assignments: int64 ``[V]`` cluster id of each token.
        cluster_tokens: int32 ``[C, b]`` token ids per cluster, -1 padded.
        n_probes: clusters kept per step.
        special_token_ids: tokens scored at every step.
        enforce_equal_cluster_sizes: whether every cluster holds the same number of tokens.
        cache_dir: name of the sub-directory holding the tensors.
        greedy_scoring: ``"normalized"`` or ``"raw"``: which centroids greedy decoding ranks with.
        embedding_fingerprint: :func:`embedding_fingerprint` of the output embedding the
            clustering was built for, where known (None otherwise).
        row_projections: :func:`embedding_row_projections` of that embedding, where known
            (None otherwise): float32 ``[V, 4]``.
    """

    raw_centroids: Tensor
    cluster_assignments: Tensor
    cluster_tokens: Tensor
    n_probes: int
    special_token_ids: list[int] = field(default_factory=list)
    enforce_equal_cluster_sizes: bool = True
    cache_dir: str = DEFAULT_CACHE_DIR
    greedy_scoring: str = "normalized"
    embedding_fingerprint: Optional[list[float]] = None
    row_projections: Optional[Tensor] = None

    @property
    def centroids(self) -> Tensor:
        """Centroids ``[C, D]`` greedy decoding ranks clusters with: unit-norm, or raw (``greedy_scoring``)."""
        return greedy_centroids(self.raw_centroids, self.greedy_scoring)

    @property
    def num_clusters(self) -> int:
        return self.raw_centroids.shape[0]

    @classmethod
    def from_clustering(cls, clustering: Clustering, n_probes: Optional[int] = None,
                        special_token_ids: Optional[SpecialTokenIds] = (), cache_dir: str = DEFAULT_CACHE_DIR) -> "FlashHeadAssets":
        table = clustering.cluster_tokens
        return cls(
            raw_centroids=clustering.raw_centroids.float().cpu(),
            cluster_assignments=clustering.cluster_assignments.long().cpu(),
            cluster_tokens=table.cpu(),
            n_probes=default_probes(table.shape[0]) if n_probes is None else n_probes,
            special_token_ids=special_token_list(special_token_ids, clustering.cluster_assignments.numel()),
            enforce_equal_cluster_sizes=bool((table >= 0).all()),
            cache_dir=cache_dir,
            greedy_scoring=clustering.greedy_scoring,
        )

    def config(self) -> dict:
        config = {
            "flash_head_cache_dir": self.cache_dir,
            "n_clusters": self.num_clusters,
            "n_probes": self.n_probes,
            "flash_head_special_token_ids": [operator.index(t) for t in self.special_token_ids],  # refuses 3.7
            "enforce_equal_cluster_sizes": self.enforce_equal_cluster_sizes,
            "flash_head_greedy_scoring": self.greedy_scoring,
        }
        if self.embedding_fingerprint is not None:
            config["flash_head_embedding_fingerprint"] = self.embedding_fingerprint
        return config

    def head(self, embedding: Tensor, probes: Optional[int] = None, *,
             centroid_dtype: Optional[torch.dtype] = None) -> FlashHead:
        """A FlashHead over ``embedding`` (the model's output embedding, kept by reference), its
        centroids in ``centroid_dtype`` (FlashHead's argument: the embedding's, or float8_e4m3fn).
        Warns (UserWarning) where the assets record other weights than these (their fingerprint or
        rows: :meth:`warn_if_built_for_other_weights`)."""
        head = self._head(embedding, probes, centroid_dtype)
        self.warn_if_built_for_other_weights(embedding, "in these assets")
        return head

    @property
    def records_weights(self) -> bool:
        """Whether the assets record the weights they were built for (a fingerprint or row projections)."""
        return self.embedding_fingerprint is not None or self.row_projections is not None

    def warn_if_built_for_other_weights(self, embedding: Tensor, where: str) -> None:
        """A UserWarning when ``embedding`` is not the weights the clustering was built for, up to
        rounding (a cast to float32, bfloat16 or float16), as far as the assets record them:
        their sampled rows differ (another model's weights, or fine-tuned ones), or some rows do
        (tokens trained since). Weights of another shape are compared by the fingerprint alone
        (the head refuses them, naming the change). ``where`` completes "the FlashHead clustering ..."."""
        if embedding.is_meta:  # no values to compare
            return
        # Checked once, here, so that malformed ones are named whichever comparison speaks.
        projections = None if self.row_projections is None else _checked_row_projections(
            self.row_projections, self.cluster_assignments.numel(), "assets.row_projections")
        fix = ("its clusters do not fit them and FlashHead agrees less often with the dense head. Build one for these "
               "weights: flash_head_for(weight), or attach(model, flash_head_for(weight)[1])")
        if self.embedding_fingerprint is not None:
            change = fingerprint_change(self.embedding_fingerprint, embedding_fingerprint(embedding))
            if change > FINGERPRINT_TOLERANCE:
                warnings.warn(f"the FlashHead clustering {where} was built for other output weights than these (sampled "
                              f"rows differ by {_share(change)} of their scale: fine-tuned, or another model's): {fix}",
                              UserWarning, stacklevel=callers_stacklevel())
                return
        # Weights of another shape have no rows to compare: the head refuses them, saying why.
        if projections is not None and tuple(embedding.shape) == (self.cluster_assignments.numel(),
                                                                  self.raw_centroids.shape[1]):
            changed = changed_rows(projections, embedding)
            if changed.numel():
                shown = ", ".join(str(t) for t in changed[:8].tolist()) + (", ..." if changed.numel() > 8 else "")
                warnings.warn(f"the FlashHead clustering {where} was built for other output weights than these "
                              f"({changed.numel()} of their {embedding.shape[0]} rows differ by more than a cast's "
                              f"rounding: {shown}; tokens fine-tuned or trained since, or weights quantized otherwise): "
                              f"{fix}", UserWarning, stacklevel=callers_stacklevel())

    def _head(self, embedding: Tensor, probes: Optional[int], centroid_dtype: Optional[torch.dtype]) -> FlashHead:
        """``head`` without the comparison of weights, for callers that compare them themselves."""
        _check_against_embedding(self.raw_centroids.shape[1], self.cluster_assignments.numel(), embedding)
        return FlashHead(
            embedding, self.centroids, self.cluster_tokens, self.n_probes if probes is None else probes,
            special_token_ids=self.special_token_ids, sampling_centroids=self.raw_centroids,
            centroid_dtype=centroid_dtype,
        )


def _check_against_embedding(dim: int, vocab: int, embedding: Tensor) -> None:
    if not isinstance(embedding, Tensor):
        raise TypeError(f"embedding must be a torch.Tensor [vocab_size, hidden_dim], got {type(embedding).__name__}")
    if embedding.dim() != 2:
        raise ValueError(f"embedding must be 2-D [vocab_size, hidden_dim], got shape {tuple(embedding.shape)}")
    if embedding.shape[1] != dim:
        raise ValueError(f"assets have centroids of hidden size {dim} but the embedding has hidden size {embedding.shape[1]}")
    if embedding.shape[0] != vocab:
        raise ValueError(f"assets assign {vocab} tokens (cluster_assignments) but the embedding has vocab size {embedding.shape[0]}")


def _check_settings(probes, specials, clusters: int, vocab: int) -> None:
    """ValueError unless ``n_probes`` and the special token ids are what load_assets accepts."""
    if not ops._is_int(probes) or not 1 <= probes <= clusters:
        raise ValueError(f"n_probes must be an int in 1..{clusters} (n_clusters), got {probes!r}")
    if not isinstance(specials, list) or not all(ops._is_int(t) and 0 <= t < vocab
                                                 for t in specials):
        raise ValueError(f"flash_head_special_token_ids must be a list of token ids in [0, {vocab}), got {specials!r}")


def save_assets(directory: PathLike, assets: Union[FlashHeadAssets, Clustering], **settings) -> Path:
    """Writes ``assets`` (or a :class:`Clustering`, with ``settings`` as in
    :meth:`FlashHeadAssets.from_clustering`) under ``directory``; returns the directory. What
    :func:`load_assets` would refuse is refused before anything is written, and the tensors are
    stored in the published layout's dtypes (float32 centroids, int64 assignments)."""
    if not isinstance(assets, (FlashHeadAssets, Clustering)):
        raise TypeError(f"assets must be a FlashHeadAssets or a Clustering (save_assets(directory, assets)), "
                        f"got {type(assets).__name__}")
    if isinstance(assets, Clustering):
        assets = FlashHeadAssets.from_clustering(assets, **settings)
    elif settings:
        raise TypeError(f"settings {sorted(settings)} apply only when saving a Clustering")
    for name, shape in (("raw_centroids", "[clusters, hidden]"), ("cluster_assignments", "[vocab]")):
        value = getattr(assets, name)
        if not isinstance(value, Tensor):
            raise TypeError(f"assets.{name} must be a torch.Tensor {shape}, got {type(value).__name__}")
        if value.dim() != len(shape.split(",")):
            raise ValueError(f"assets.{name} must have shape {shape}, got {tuple(value.shape)}")
    stored = assets.config()
    checked = _checked_assets(assets.raw_centroids.detach().T.cpu(), assets.cluster_assignments.detach().cpu(), stored,
                              "the assets to save (assets.raw_centroids transposed)", row_projections=assets.row_projections)
    tensors = {"centroids": checked.raw_centroids.T.contiguous(), "cluster_assignments": checked.cluster_assignments.contiguous()}
    if checked.row_projections is not None:
        tensors[ROW_PROJECTIONS] = checked.row_projections
    data = save_bytes(tensors)
    # The config names the tensors it goes with: a save killed between the two files' renames, over
    # other assets, left the new tensors under the old config, which loaded without a word.
    stored["flash_head_tensors_sha256"] = hashlib.sha256(data).hexdigest()
    config = json.dumps(stored, indent=2) + "\n"  # first: a config that cannot be written leaves no files
    directory = Path(directory).expanduser()
    (directory / checked.cache_dir).mkdir(parents=True, exist_ok=True)
    write_replacing(directory / checked.cache_dir / TENSORS_NAME, lambda partial: partial.write_bytes(data))
    write_replacing(directory / CONFIG_NAME, lambda partial: partial.write_text(config))
    return directory


def write_replacing(path: Path, write) -> None:
    """``write(partial)``, then the partial file replaces ``path`` at once: a failed or killed
    write leaves the old file, never a truncated one. Each call writes a partial file of its own,
    so processes filling one cache entry at once (every rank of a job) do not remove each other's."""
    partial = new_partial(path.parent, f".{path.name}.")
    try:
        mode = partial.stat().st_mode  # the umask's: safetensors writes a file of its own, private to its owner
        write(partial)
        partial.chmod(mode)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def sweep_stale_partials(directory: Path) -> None:
    """Removes the partial files and staging directories (``.<name>.<random>.partial``) that killed
    writers left in ``directory``, an hour old. The caches call it at every read of a directory
    too: a finished entry is never written again, so a sweep at writes alone kept them for good."""
    try:
        found = list(directory.glob(".*.partial"))
    except OSError:  # a directory this user cannot read (another's, in a shared cache): none of ours to sweep
        return
    for stale in found:
        try:
            if time.time() - stale.stat().st_mtime > STALE_PARTIAL_S:
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        except OSError:  # removed meanwhile by another writer, or not ours to remove
            pass


def cached_entry(path: Path, *, is_dir: bool = False) -> bool:
    """Whether a cache entry (a file, or a directory) is there: False where it cannot be looked at
    either (another user's unreadable directory in a shared cache), which its caller then takes for
    a miss, building what it would have read and warning where the result cannot be cached."""
    try:
        return path.is_dir() if is_dir else path.is_file()
    except OSError:  # pathlib raises for EACCES, not for a missing path
        return False


def new_partial(directory: Path, prefix: str, *, is_dir: bool = False) -> Path:
    """A new empty file (or directory) ``<directory>/<prefix><random>.partial`` for a writer to
    fill and rename. Created as open() and mkdir() create, under the umask: mkstemp's and
    mkdtemp's are their owner's alone, which would hide a shared cache or a model directory's files
    from other users (and setting the umask to read it is not thread-safe). Those a killed writer
    left, an hour old, are removed first."""
    sweep_stale_partials(directory)
    while True:
        path = directory / f"{prefix}{secrets.token_hex(8)}.partial"
        try:
            if is_dir:
                os.mkdir(path, 0o777)
            else:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return path
        except FileExistsError:  # another writer's name: draw again
            continue


def read_tensors(path: Path, sha256: Optional[str] = None) -> dict:
    """A safetensors file's tensors, read into memory rather than memory-mapped: a file written
    over in place later (a copy over it, a shared cache refreshed from another host) would
    otherwise change them, or kill the process at their next read. With ``sha256``, a ValueError
    unless the file's bytes have that digest."""
    data = path.read_bytes()
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{path} is not the tensors file its config was saved with (flash_head_tensors_sha256 "
                         "differs: a save cut short between the two files, or files from two saves): save the assets again")
    return load_bytes(data)


def read_config(directory: Path) -> dict:
    """FlashHead keys from our config file, else from a model's config.json; empty if neither has them."""
    for name in (CONFIG_NAME, "config.json"):
        path = directory / name
        if path.exists() and not path.is_file():  # a directory in its place: the defaults were read silently
            raise ValueError(f"{path} must be a file, not a directory or a special file")
        if path.is_file():
            try:
                config = json.loads(path.read_text())
            except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
                raise ValueError(f"{path} is not a JSON file: {error}") from error
            if not isinstance(config, dict):
                raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
            found = {k: v for k, v in config.items() if k in CONFIG_KEYS}
            if found or name == CONFIG_NAME:
                return found
    return {}


def _squeeze_leading(name: str, tensor: Tensor, rank: int, expected: str, where: str) -> Tensor:
    while tensor.dim() > rank and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != rank:
        raise ValueError(f"{name} in {where} must have shape {expected}, got {tuple(tensor.shape)}")
    return tensor


def _cache_dir_setting(cache_dir) -> str:
    """``flash_head_cache_dir``, a directory inside the assets directory: a path out of it would
    write beside it (a copy of the directory then lacks its tensors) or read from anywhere."""
    if not isinstance(cache_dir, str):
        raise ValueError(f"flash_head_cache_dir must be a directory name (a string), got {cache_dir!r}")
    if Path(cache_dir).is_absolute() or ".." in Path(cache_dir).parts:  # "" and "." name the directory itself
        raise ValueError(f"flash_head_cache_dir must be a directory inside the assets directory (a relative path "
                         f"without '..'), got {cache_dir!r}")
    return cache_dir


def load_assets(directory: PathLike, embedding: Optional[Tensor] = None) -> FlashHeadAssets:
    """Reads an assets directory (ours or a published FlashHead checkpoint's) and checks it.

    With ``embedding`` the vocabulary size and hidden size are checked against it too, and so are
    the weights the clustering was built for, as far as they are recorded (their fingerprint and
    every row's projections: UserWarning if they differ; one pass over the embedding).
    ``assets.head(embedding)`` compares them in the same way, so ``load_assets(directory).head(embedding)``
    builds a head with one comparison.
    Raises FileNotFoundError for a missing directory or tensors file, NotADirectoryError for a
    file given as the directory, ValueError for malformed contents.
    """
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        if directory.exists():
            raise NotADirectoryError(f"FlashHead assets directory {directory} is a file; pass the directory holding "
                                     f"{CONFIG_NAME} (or a model's config.json) and {DEFAULT_CACHE_DIR}/")
        raise FileNotFoundError(f"FlashHead assets directory {directory} does not exist")
    config = read_config(directory)
    cache_dir = _cache_dir_setting(config.get("flash_head_cache_dir", DEFAULT_CACHE_DIR))
    path = directory / cache_dir / TENSORS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"expected FlashHead clustering tensors at {path} (flash_head_cache_dir={cache_dir!r})")
    sha256 = config.get("flash_head_tensors_sha256")
    if sha256 is not None and not (isinstance(sha256, str) and re.fullmatch("[0-9a-f]{64}", sha256)):
        raise ValueError(f"flash_head_tensors_sha256 must be a sha256 hex digest (64 lowercase hex digits), got {sha256!r:.80}")
    try:
        tensors = read_tensors(path, sha256)
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from error
    for name in ("centroids", "cluster_assignments"):
        if name not in tensors:
            raise ValueError(f"{path} has no tensor {name!r} (found {sorted(tensors)}); "
                             "expected 'centroids' [hidden, clusters] and 'cluster_assignments' [vocab]")
    return _checked_assets(tensors["centroids"], tensors["cluster_assignments"], config, str(path), embedding,
                           tensors.get(ROW_PROJECTIONS))


def _checked_assets(centroids: Tensor, assignments: Tensor, config: dict, where: str,
                    embedding: Optional[Tensor] = None, row_projections: Optional[Tensor] = None) -> FlashHeadAssets:
    """Assets from stored-layout tensors (centroids ``[hidden, clusters]``) and config keys, after
    the checks that both loading and saving make; ``where`` names their source in messages."""
    cache_dir = _cache_dir_setting(config.get("flash_head_cache_dir", DEFAULT_CACHE_DIR))
    centroids = _squeeze_leading("centroids", centroids, 2, "[hidden, clusters]", where)
    assignments = _squeeze_leading("cluster_assignments", assignments, 1, "[vocab]", where)
    if not centroids.is_floating_point():
        raise ValueError(f"centroids in {where} must be floating point, got {centroids.dtype}")
    if 0 in centroids.shape or assignments.numel() == 0:
        raise ValueError(f"{where} hold no clustering: centroids {tuple(centroids.shape)} [hidden, clusters], "
                         f"cluster_assignments {tuple(assignments.shape)} [vocab]")
    if not torch.isfinite(centroids.float()).all():  # kept as float32: 1e300 in float64 became inf there
        raise ValueError(f"centroids in {where} hold NaN or infinite values (as float32, as they are kept)")
    if assignments.is_floating_point() or assignments.dtype == torch.bool:
        raise ValueError(f"cluster_assignments in {where} must hold integer cluster ids, got {assignments.dtype}")
    dim, count = centroids.shape
    used = int(assignments.max()) + 1
    # The ids fit the first dimension, not the second, and the second is the embedding's hidden
    # size where it is known: [clusters, hidden], also with fewer clusters than hidden values (then
    # some cluster looked empty).
    if used == dim != count and (embedding is None or embedding.shape[1] == count):
        raise ValueError(f"centroids in {where} have shape {tuple(centroids.shape)} but cluster_assignments use "
                         f"{used} cluster ids: the centroids look transposed; expected [hidden, clusters]")
    if embedding is not None:
        _check_against_embedding(dim, assignments.numel(), embedding)
    if "n_clusters" in config and config["n_clusters"] != count:
        raise ValueError(f"config says n_clusters={config['n_clusters']!r} but centroids in {where} have {count} clusters "
                         f"(shape {tuple(centroids.shape)}, expected [hidden, n_clusters])")
    assignments = assignments.long()
    check_cluster_ids("cluster_assignments", assignments, count)
    counts = torch.bincount(assignments, minlength=count)
    if (counts == 0).any():
        raise ValueError(f"cluster {int((counts == 0).nonzero()[0])} has no tokens in cluster_assignments; every cluster needs one")
    enforce = config.get("enforce_equal_cluster_sizes", True)
    if not isinstance(enforce, bool):  # bool("false") would be True
        raise ValueError(f"enforce_equal_cluster_sizes must be true or false, got {enforce!r}")
    if enforce and counts.min() != counts.max():
        raise ValueError(f"enforce_equal_cluster_sizes is set but cluster sizes range from {int(counts.min())} "
                         f"(cluster {int(counts.argmin())}) to {int(counts.max())} (cluster {int(counts.argmax())}); "
                         "expected every cluster to hold the same number of tokens")
    probes = config.get("n_probes", default_probes(count))
    specials = config.get("flash_head_special_token_ids")
    specials = [] if specials is None else specials  # a published config's null; 0 or "" are refused
    _check_settings(probes, specials, count, assignments.numel())
    scoring = config.get("flash_head_greedy_scoring", "normalized")
    if scoring not in GREEDY_SCORINGS:
        raise ValueError(f"flash_head_greedy_scoring must be one of {GREEDY_SCORINGS}, got {scoring!r}")
    fingerprint = config.get("flash_head_embedding_fingerprint")
    size = FINGERPRINT_ROWS * FINGERPRINT_DIRECTIONS
    if fingerprint is not None and not (isinstance(fingerprint, list) and len(fingerprint) == size and all(
            ops._is_number(x) and math.isfinite(x) for x in fingerprint)):
        raise ValueError(f"flash_head_embedding_fingerprint must be a list of {size} finite numbers")
    if row_projections is not None:
        row_projections = _checked_row_projections(row_projections, assignments.numel(), f"{ROW_PROJECTIONS} in {where}")
    assets = FlashHeadAssets(
        raw_centroids=centroids.T.float().contiguous(),
        cluster_assignments=assignments,
        cluster_tokens=cluster_table(assignments, count),
        n_probes=probes,
        special_token_ids=specials,
        enforce_equal_cluster_sizes=enforce,
        cache_dir=cache_dir,
        greedy_scoring=scoring,
        embedding_fingerprint=fingerprint,
        row_projections=row_projections,
    )
    if embedding is not None:
        assets.warn_if_built_for_other_weights(embedding, f"in {where}")
    return assets


def embedding_fingerprint(embedding: Tensor) -> list:
    """Projections of 64 fixed rows of ``embedding`` on 4 fixed directions: casts of one weight
    (fp32, bf16, fp16) give nearly the same numbers, other weights far other ones. Read from a few
    rows, it costs nothing at any vocabulary size (a digest reads all of it). Rows and directions
    come from arithmetic, not torch's random streams, which no release promises to keep. A
    fine-tune of a few rows only (new tokens) is seen where it changes one of them."""
    vocab, dim = embedding.shape
    rows = torch.arange(FINGERPRINT_ROWS, dtype=torch.int64, device="cpu") * 2654435761 % vocab  # Knuth's multiplicative hash
    sampled = embedding.detach()[rows.to(embedding.device)].to("cpu", torch.float32)
    return [float(f"{x:.6g}") for x in (sampled @ _fingerprint_directions(dim)).flatten().tolist()]


def _fingerprint_directions(dim: int) -> Tensor:
    """float32 ``[dim, 4]``, spread in [-1, 1): from arithmetic, not torch's random streams, which
    no release promises to keep."""
    phases = torch.arange(dim * FINGERPRINT_DIRECTIONS, dtype=torch.float64, device="cpu").reshape(dim, FINGERPRINT_DIRECTIONS)
    return torch.frac(torch.sin(phases * 12.9898 + 1.0).abs() * 43758.5453).float() * 2 - 1


def fingerprint_change(stored: list, current: list) -> float:
    """How far fingerprint ``current`` is from ``stored``, as a fraction of the stored one's largest
    value (rounding moves it by well under FINGERPRINT_TOLERANCE, other weights by far more);
    infinite where ``current`` is not finite (a NaN weight made it NaN, which passed every tolerance)."""
    stored_values = torch.tensor(stored, dtype=torch.float64, device="cpu")
    change = float((torch.tensor(current, dtype=torch.float64, device="cpu") - stored_values).abs().max()
                   / stored_values.abs().max().clamp(min=1e-30))
    return math.inf if math.isnan(change) else change


def _share(change: float) -> str:
    """A fingerprint's change in words: a zero stored fingerprint made it a 30-digit percentage."""
    return f"{change:.0%}" if change < 10 else "more than 1000%"


def _row_slices(embedding: Tensor):
    """``(start, rows)``: ``embedding``'s rows as float64, 16 MB at a time, on its device (a whole
    float64 copy took 4x a bf16 embedding's memory)."""
    values = embedding.detach()
    step = max(1, ROW_SLICE_VALUES // max(1, values.shape[1]))
    for start in range(0, values.shape[0], step):
        yield start, values[start:start + step].double()


def embedding_row_projections(embedding: Tensor) -> Tensor:
    """float32 ``[V, 4]``: every row of ``embedding`` projected on the fingerprint's 4 directions,
    in float64. Stored with a clustering, they tell which rows changed since it was built
    (:meth:`FlashHeadAssets.warn_if_built_for_other_weights`), where the fingerprint's 64 rows see a
    fine-tune of a few rows only when it changes one of them."""
    directions = _fingerprint_directions(embedding.shape[1]).double().to(embedding.device)
    return torch.cat([(rows @ directions).float() for _, rows in _row_slices(embedding)]).cpu()  # one copy back


def _checked_row_projections(projections, vocab: int, name: str) -> Tensor:
    """``projections`` as float32 on the CPU, after checks that name them as ``name``. Coarser
    dtypes are refused: their rounding is past what the comparison allows for."""
    expected = f"a float32 or float64 torch.Tensor of shape {[vocab, FINGERPRINT_DIRECTIONS]} ([vocab, " \
               f"{FINGERPRINT_DIRECTIONS}], embedding_row_projections of the embedding)"
    if not isinstance(projections, Tensor):
        raise TypeError(f"{name} must be {expected}, got {type(projections).__name__}")
    if projections.dtype not in (torch.float32, torch.float64) or list(projections.shape) != [vocab, FINGERPRINT_DIRECTIONS]:
        raise ValueError(f"{name} must be {expected}, got {projections.dtype} {tuple(projections.shape)}")
    projections = projections.detach().to("cpu", torch.float32).contiguous()
    if not torch.isfinite(projections).all():  # compared as float32
        raise ValueError(f"{name} hold NaN or infinite values (as float32, as they are kept)")
    return projections


def changed_rows(stored: Tensor, embedding: Tensor) -> Tensor:
    """int64 ids of the rows of ``embedding`` whose projections differ from ``stored``'s (float32
    ``[V, 4]``, as ``_checked_row_projections`` returns them) by more than casting their weights
    could: each weight rounds by at most CAST_ROUNDING of its value plus CAST_FLUSH, so a row's projection by at most that bound
    times the sum of its products' sizes, for any rows (repeated ones too); doubled, for weights
    rounded twice (float32 to float16 to bfloat16, against projections of a bfloat16 cast), plus
    the stored float32's own rounding. Non-finite rows count. Reads every row once."""
    directions = _fingerprint_directions(embedding.shape[1]).double().to(embedding.device)
    flush = CAST_FLUSH * directions.abs().sum(0)
    outside = torch.empty(embedding.shape[0], dtype=torch.bool, device=embedding.device)  # one copy back, at the end
    for start, rows in _row_slices(embedding):
        expected = stored[start:start + rows.shape[0]].to(embedding.device, torch.float64)
        bound = 2 * (CAST_ROUNDING * (rows.abs() @ directions.abs()) + flush) + STORED_ROUNDING * expected.abs()
        # An infinite weight makes its bound infinite too, and NaN compares false: both count as changed.
        within = ((rows @ directions - expected).abs() <= bound).all(1) & torch.isfinite(rows).all(1)
        outside[start:start + rows.shape[0]] = ~within
    return outside.nonzero().flatten().cpu()


def update_digest(digest, tensor: Tensor) -> None:
    """Feeds ``tensor``'s values as float32 bytes, in row-major order, to a hashlib ``digest``, a
    slice at a time: a whole float32 copy, and its bytes, took 4x a bf16 embedding's memory."""
    values = tensor.detach().flatten()
    for start in range(0, values.numel(), DIGEST_SLICE):
        digest.update(values[start:start + DIGEST_SLICE].to("cpu", torch.float32).numpy())


def embedding_digest(embedding: Tensor) -> str:
    """sha256 of a tensor's float32 values and shape (an embedding, calibration states): names a clustering in the cache."""
    digest = hashlib.sha256(repr(tuple(embedding.shape)).encode())
    update_digest(digest, embedding)
    return digest.hexdigest()


def _cached_assets(directory: Path, embedding: Tensor, fingerprint: list, sizes: Tensor) -> FlashHeadAssets:
    """A cache entry's assets, or a ValueError where they are not what the entry's name says: a
    clustering of other cluster sizes, or of other weights (``fingerprint``: the embedding's; an
    entry copied or synced in from elsewhere), which the caller would otherwise take, and record
    this embedding's fingerprint for."""
    assets = load_assets(directory)
    _check_against_embedding(assets.raw_centroids.shape[1], assets.cluster_assignments.numel(), embedding)
    counts = torch.bincount(assets.cluster_assignments, minlength=assets.num_clusters)
    if not torch.equal(counts.sort().values, sizes.sort().values):
        raise ValueError(f"it holds {assets.num_clusters} clusters, not the {sizes.numel()} of its cluster size")
    if assets.embedding_fingerprint is not None:
        change = fingerprint_change(assets.embedding_fingerprint, fingerprint)
        if change > FINGERPRINT_TOLERANCE:
            raise ValueError(f"it was built for other output weights: sampled rows differ by {_share(change)} of their scale")
    return assets


def flash_head_for(
    embedding: Tensor,
    cluster_size: int = 16,
    probes: Optional[int] = None,
    *,
    special_token_ids: Optional[SpecialTokenIds] = (),
    hidden: Optional[Tensor] = None,
    iters: int = 15,
    seed: int = 0,
    cache: bool = True,
    progress: bool = True,
    centroid_dtype: Optional[torch.dtype] = None,
) -> tuple[FlashHead, FlashHeadAssets]:
    """A ready FlashHead for ``embedding``, clustering it unless a cached clustering exists.

    With ``hidden``, final hidden states of the model on calibration text ``[N, D]``, the
    clustering is calibrated on them (:func:`~flashhead_ext.clustering.calibrate_clusters`: far
    higher agreement with the dense head at the same cost, docs/quality.md); without, it is plain
    k-means. It is cached under :func:`user_cache_dir` in the published layout, keyed by the
    method, the embedding's (and states') values and the settings; ``cache=False`` rebuilds and
    overwrites it. ``centroid_dtype`` is the head's (:class:`FlashHead`); the cache keeps float
    centroids either way. Returns the head and its assets, whose ``n_probes`` and special tokens
    are this head's (``assets.head(embedding)`` makes more such heads cheaply).
    """
    _check_embedding(embedding)  # the head's checks, before minutes of clustering
    ops._require_bool("cache", cache)  # "no" read as truthy read and wrote the cache
    ops._require_bool("progress", progress)
    # Before the digests, which read their values. Finiteness is left to the clustering on a miss: a
    # cached entry was built, so checked, from the values its key digests.
    check_clustering_inputs(embedding, hidden, finite=False)
    # And the settings the key names, which a cache hit would otherwise take unchecked.
    _, sizes = cluster_sizes(embedding.shape[0], cluster_size)
    check_kmeans_settings(iters, seed)
    special_token_ids = special_token_list(special_token_ids, embedding.shape[0])
    centroid_dtype = centroid_dtype_option(centroid_dtype, embedding.dtype)
    if probes is not None:
        ops._require_probes(probes, sizes.numel())
    # Plain k-means keeps the key it always had, so its cached entries stay valid; a calibrated
    # clustering is named by its states too, so neither method ever reads the other's entry.
    method = "" if hidden is None else f"-calibrated-{embedding_digest(hidden)[:16]}"
    key = f"{embedding_digest(embedding)[:16]}{method}-b{cluster_size}-i{iters}-s{seed}-v{ALGORITHM_VERSION}"
    directory = user_cache_dir() / "clusters" / key
    for written in (directory, directory / DEFAULT_CACHE_DIR):  # where save_assets writes
        sweep_stale_partials(written)
    fingerprint = embedding_fingerprint(embedding)
    assets = None
    if cache and cached_entry(directory / CONFIG_NAME):
        try:
            assets = _cached_assets(directory, embedding, fingerprint, sizes)
            # Entries cached before they were recorded have none; the entry's name is this embedding's
            # digest, so stored projections are of these values (computing them again took 1.9 s for
            # Qwen3-0.6B's head on a 2-core CPU, beside the digest's 1.3 s).
            assets.embedding_fingerprint = fingerprint
            if assets.row_projections is None:
                assets.row_projections = embedding_row_projections(embedding)
        except (ValueError, OSError) as error:  # a damaged entry (a full disk, a copy cut short) is built again
            warnings.warn(f"the cached clustering at {directory} is unreadable or not what its name says ({error}); "
                          "building it again", RuntimeWarning, stacklevel=2)
    if assets is None:
        clustering = (build_clusters(embedding, cluster_size, iters=iters, seed=seed, progress=progress) if hidden is None
                      else calibrate_clusters(embedding, hidden, cluster_size, iters=iters, seed=seed, progress=progress))
        assets = FlashHeadAssets.from_clustering(clustering)
        assets.embedding_fingerprint, assets.row_projections = fingerprint, embedding_row_projections(embedding)
        with uncached_on_failure("the clustering"):
            save_assets(directory, assets)
    assets.special_token_ids = special_token_ids
    head = assets._head(embedding, probes, centroid_dtype)  # the fingerprint is this embedding's
    assets.n_probes = head.probes  # so that save_assets(dir, assets) keeps this head's settings
    return head, assets


__all__ = [
    "FlashHeadAssets", "save_assets", "load_assets", "flash_head_for", "user_cache_dir", "default_probes",
    "embedding_digest", "embedding_fingerprint", "embedding_row_projections", "CONFIG_NAME", "TENSORS_NAME", "DEFAULT_CACHE_DIR",
]
