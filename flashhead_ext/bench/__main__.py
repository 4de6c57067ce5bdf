"""``python -m flashhead_ext.bench <benchmark>``; each benchmark prints a table and writes JSON."""
import sys

from . import clusters, head, layer_ops, spec

BENCHMARKS = {"head": head.main, "clusters": clusters.main, "draft-step": spec.draft_step_main,
              "spec": spec.spec_main, "layer-ops": layer_ops.main}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m flashhead_ext.bench {{{','.join(BENCHMARKS)}}} [options]  (--help after the name)")
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return BENCHMARKS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
