"""``python -m flashhead_ext.bench clusters``: time to build an equal-size clustering of a head.

Random embeddings at real head shapes, correlated (low rank plus noise) as trained heads are:
independent Gaussian rows are each nearly orthogonal to all others, so k-means on them stops
after two iterations and would under-measure. Wall time of ``build_clusters`` including the
device work, one run per shape after a small warm-up build that loads kernels and libraries.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from .._cli import DefaultsHelpFormatter, device_arg, doc_summary, note, output_file, positive_int, write_output
from ..clustering import build_clusters
from .head import SHAPES_HELP, VocabShape, note_slow_on_the_cpu, shape_of, vocab_shape_list
from .timing import format_table, run_metadata, usage_error_past_memory

# The heads issue 4 names, in clusters of 16: 9,496 and 3,072 of them.
SHAPES = {"qwen3-0.6b": VocabShape(151936, 1024), "smollm2": VocabShape(49152, 576), "tiny": VocabShape(2000, 32)}


def correlated_embedding(vocab: int, dim: int, gen: torch.Generator, device: str, rank: int = 64) -> torch.Tensor:
    factors = torch.randn(vocab, rank, generator=gen, device=device) @ torch.randn(rank, dim, generator=gen, device=device)
    return factors / rank**0.5 + 0.5 * torch.randn(vocab, dim, generator=gen, device=device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashhead_ext.bench clusters", description=doc_summary(__doc__),
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-0.6b,smollm2", help=f"comma list of {sorted(SHAPES)} or {SHAPES_HELP}")
    parser.add_argument("--iters", type=positive_int, default=15, help="k-means iterations (build_clusters' iters)")
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the clustering runs")
    parser.add_argument("--json", type=output_file, default="results/bench_clusters.json",
                        help="where the result JSON is written")
    args = parser.parse_args(argv)
    names = vocab_shape_list(parser, args.shapes, {"--json": args.json}, SHAPES)
    note_slow_on_the_cpu(args.device, names, "--shapes tiny --iters 2", SHAPES)
    meta = dict(run_metadata(args.device), args=vars(args))  # the code and date the run started with

    gen = torch.Generator(device=args.device).manual_seed(0)
    tiny = SHAPES["tiny"]
    warm = torch.randn(tiny.vocab, tiny.dim, generator=gen, device=args.device)
    build_clusters(warm, n_clusters=tiny.num_clusters, iters=2, device=args.device, progress=False)
    # Every CUDA device, "cuda:1" too: k-means' last kernels would otherwise fall outside the timing.
    sync = (lambda: torch.cuda.synchronize(args.device)) if torch.device(args.device).type == "cuda" else (lambda: None)
    rows = []
    for name in names:
        shape = shape_of(name, SHAPES)
        with usage_error_past_memory(parser, f"--shapes {name}", args.device):
            embedding = correlated_embedding(shape.vocab, shape.dim, gen, args.device)
            sync()
            start = time.perf_counter()
            result = build_clusters(embedding, shape.cluster_size, iters=args.iters, device=args.device, progress=False)
            sync()
        seconds = time.perf_counter() - start
        sizes = (result.cluster_tokens >= 0).sum(1)
        clusters, width = result.cluster_tokens.shape
        # The table built, which is narrower than asked where the rows leave every cluster a padding slot.
        if width != shape.cluster_size:
            note(f"--shapes {name}: {shape.vocab} rows make {clusters} clusters of at most {width} tokens, "
                 f"so b is {width}, not {shape.cluster_size}")
        # k-means stops early once no token moves, so report the iterations it ran.
        rows.append(dict(shape=name, vocab=shape.vocab, dim=shape.dim, cluster_size=width,
                         cluster_size_asked=shape.cluster_size, clusters=clusters, iters=result.iterations, device=args.device,
                         threads=torch.get_num_threads(), seconds=seconds, seconds_per_iter=seconds / result.iterations,
                         equal_sizes=bool(sizes.min() >= sizes.max() - 1)))
    print(format_table(rows, [("shape", "shape", ""), ("vocab", "V", "d"), ("dim", "D", "d"), ("cluster_size", "b", "d"),
                              ("clusters", "C", "d"),
                              ("iters", "iters run", "d"), ("device", "device", ""), ("threads", "threads", "d"),
                              ("seconds", "seconds", ".1f"), ("seconds_per_iter", "s/iter", ".2f"), ("equal_sizes", "equal", "")]))
    out = write_output(args.json, json.dumps({"meta": meta, "rows": rows}, indent=1))
    note(f"wrote {out}")
    return 0
