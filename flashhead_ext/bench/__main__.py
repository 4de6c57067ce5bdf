"""``python -m flashhead_ext.bench <benchmark>``: each benchmark prints a table and writes its runs to JSON."""
import sys

from . import clusters, head, layer_ops, spec

# name: (entry point, what it measures)
BENCHMARKS = {
    "head": (head.main, "the output head alone: torch dense vs FlashHead (torch and the fused ops), eager and graph-replayed"),
    "clusters": (clusters.main, "time to build an equal-size k-means clustering of a head, at real head shapes"),
    "draft-step": (spec.draft_step_main, "one graph-replayed draft decode step of the fast path: dense vs FlashHead head"),
    "spec": (spec.spec_main, "end-to-end speculative decoding on the fast path, random weights (synthetic acceptance)"),
    "layer-ops": (layer_ops.main, "the decoder-layer ops (fused_linear, a whole fused layer) vs torch, graph-replayed (GPU only)"),
}
USAGE = f"usage: python -m flashhead_ext.bench {{{','.join(BENCHMARKS)}}} [options]"


def help_text() -> str:
    width = max(map(len, BENCHMARKS))
    rows = [f"  {name:<{width}}  {text}" for name, (_, text) in BENCHMARKS.items()]
    return "\n".join([USAGE, "", "Each benchmark prints a table and writes its runs to JSON (measured numbers: docs/benchmarks.md).",
                      "", "benchmarks:", *rows, "", "python -m flashhead_ext.bench <benchmark> --help lists its options."])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(help_text())
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        problem = "a benchmark is required" if not argv else f"unknown benchmark {argv[0]!r}"
        print(f"{USAGE}\npython -m flashhead_ext.bench: error: {problem} (--help lists them)", file=sys.stderr)
        return 2
    return BENCHMARKS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
