"""``python -m flashhead_ext.bench draft-step`` and ``... spec``: the fast path at real shapes (issue 6).

Both build :class:`~flashhead_ext.fast.Decoder` models with random weights (allocated on the GPU)
at named shapes. FlashHead heads use random equal-size clusters (a random permutation of the
vocabulary, centroids the normalised member means): the greedy path's cost does not depend on
which tokens share a cluster, and a k-means build at 151936 x 1024 would take longer than the
benchmark. Every result file records this.

* ``draft-step``: one draft decode step (1 token -> body -> head -> token) replayed as a CUDA graph,
  dense vs FlashHead head, with the body alone timed the same way, and the body's traffic floor
  (:func:`step_read_bytes` at the copy bandwidth).
* ``spec``: end to end, a target and a draft at the given shapes, baseline / ordinary / deferred
  with dense and FlashHead drafts, interleaved (:mod:`flashhead_ext.speculative.runner`). Random
  weights cannot agree, so ``--synthetic-acceptance R`` (default 0.77: 3.65 tokens a round at K=6,
  about the thesis's 3.666) draws the acceptances; those rows are labelled synthetic everywhere. R is
  each proposal's chance of acceptance; the tables' ``accept`` (accepted / proposed) is lower, as
  proposals after a rejection count unaccepted (:func:`accepted_share`).
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from functools import partial
from typing import Optional

import torch

from ..assets import default_probes
from ..clustering import greedy_centroids, member_means
from .._cli import (DefaultsHelpFormatter, choices_list, config_file, device_arg, is_config_path, model_config, note,
                    note_shadowed_paths, note_unused_draft_options, options_given, output_file, positive_int,
                    refuse_draft_without_kernels, refuse_missing_cuda_kernels, refuse_shared_files, run_seed, shape_names,
                    write_output)
from ..fast import Decoder, DecoderConfig, FastSpeculativeDecoder
from ..fast.decoder import ATTENTION, BODIES, KERNEL_BODIES
from ..head import DenseHead, FlashHead
from ..speculative.driver import check_draft_vocab
from ..speculative.runner import format_summary, plan_configs, reading, run_interleaved, summarize, write_json
from ..graphs import capture_graph
from .timing import copy_bandwidth_gbs, format_table, on_device, run_metadata, time_calls, usage_error_past_memory


def gemma3_shape(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 query_pre_attn_scalar: int, sliding_window: int, global_rope_factor: float = 1.0,
                 vocab: int = 262144) -> DecoderConfig:
    """A Gemma-3 text model's own layer, read from transformers' config: every sixth layer global
    (RoPE theta 1e6, linearly scaled by ``global_rope_factor``), the others sliding (theta 1e4)."""
    from transformers import Gemma3TextConfig

    global_rope = dict(rope_type="linear", factor=global_rope_factor) if global_rope_factor != 1.0 else dict(rope_type="default")
    config = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        query_pre_attn_scalar=query_pre_attn_scalar, sliding_window=sliding_window,
        rope_parameters={"full_attention": dict(global_rope, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)})
    return DecoderConfig.from_hf(config)


def gemma2_shape(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 query_pre_attn_scalar: int) -> DecoderConfig:
    """A Gemma-2 model's own layer, read from transformers' config: every other layer sliding over
    4,096 keys, attention scores and logits capped at 50 and 30 (its defaults, as published)."""
    from transformers import Gemma2Config

    return DecoderConfig.from_hf(Gemma2Config(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, query_pre_attn_scalar=query_pre_attn_scalar))


class _Shapes(Mapping):
    """Named shapes; a callable entry is built on first use, so the benchmarks that need no
    Gemma shape need no transformers either."""

    def __init__(self, entries: dict):
        self._entries = entries

    def __getitem__(self, name: str) -> DecoderConfig:
        entry = self._entries[name]
        if callable(entry):
            entry = self._entries[name] = entry()
        return entry

    def __contains__(self, name) -> bool:  # Mapping's would build the shape
        return name in self._entries

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


# Named shapes. The "gemma2-*" and "gemma3-*" shapes are Gemma's own layers, which the fused body does not run;
# "gemma3-270m-llama" is a Llama layer with Gemma-3-270M's dimensions and head, which every body
# runs. Gemma-3-27B and Qwen2.5-7B have more vocabulary rows than their small drafts (padding and
# image tokens past the shared tokenizer's), as the published models do.
SHAPES = _Shapes({
    "qwen3-0.6b": DecoderConfig(151936, 1024, 3072, 28, 16, 8, 128, rope_theta=1e6, qk_norm=True, tie_word_embeddings=True),
    "qwen3-32b": DecoderConfig(151936, 5120, 25600, 64, 64, 8, 128, rope_theta=1e6, qk_norm=True),
    "qwen2.5-0.5b": DecoderConfig(151936, 896, 4864, 24, 14, 2, 64, rope_theta=1e6, qkv_bias=True, tie_word_embeddings=True),
    "qwen2.5-7b": DecoderConfig(152064, 3584, 18944, 28, 28, 4, 128, rope_theta=1e6, qkv_bias=True),
    "gemma3-270m": partial(gemma3_shape, 640, 2048, 18, 4, 1, 256, query_pre_attn_scalar=256, sliding_window=512),
    "gemma3-1b": partial(gemma3_shape, 1152, 6912, 26, 4, 1, 256, query_pre_attn_scalar=256, sliding_window=512),
    "gemma3-27b": partial(gemma3_shape, 5376, 21504, 62, 32, 16, 128, query_pre_attn_scalar=168, sliding_window=1024,
                          global_rope_factor=8.0, vocab=262208),
    "gemma3-270m-llama": DecoderConfig(262144, 640, 2048, 18, 4, 1, 256, tie_word_embeddings=True),
    "gemma2-2b": partial(gemma2_shape, 2304, 9216, 26, 8, 4, 256, query_pre_attn_scalar=256),
    "gemma2-27b": partial(gemma2_shape, 4608, 36864, 46, 32, 16, 128, query_pre_attn_scalar=144),
    # SmolLM2-135M's first 8 layers + norm + head: the README demo's early-exit draft.
    "smollm2-early-exit-8": DecoderConfig(49152, 576, 1536, 8, 9, 3, 64, rope_theta=1e5, tie_word_embeddings=True),
    "tiny": DecoderConfig(1000, 64, 96, 2, 4, 2, 16, qk_norm=True, tie_word_embeddings=True),  # CLI checks on a CPU
    "tiny-gemma3": DecoderConfig(1000, 64, 96, 2, 4, 2, 16, qk_norm=True, tie_word_embeddings=True, hidden_act="gelu_tanh",
                                 post_norms=True, embed_scale=8.0, sliding_window=8, sliding_layers=(0,)),
})
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


CONFIG_SHAPE_HELP = ("a transformers config.json, or a model directory holding one: a Llama / Mistral / Ministral / "
                     "Phi-3 / Granite / Qwen2 / Qwen3 / Gemma-2 / Gemma-3 model of one's own, at its shape with random "
                     "weights")


def shape_configs(parser: argparse.ArgumentParser, flag: str, names: list, outputs: dict) -> list:
    """Each name's DecoderConfig, a preset's or a config file's; a usage error where one cannot be
    built, or where building one needs transformers (Gemma's own layers, a config file), which
    the benchmarks over Decoder.random do not otherwise need, or where one of ``outputs`` (as
    refuse_shared_files') would overwrite a config file read."""
    refuse_shared_files(parser, {flag: [config_file(name) for name in names if name not in SHAPES]}, outputs)
    configs = []
    for name in names:
        if name in SHAPES:
            try:
                configs.append(SHAPES[name])
            except ImportError as error:
                parser.error(f"{flag}: the gemma2-* and gemma3-* shapes read Gemma's layers from transformers' config, "
                             f"and transformers is not importable ({error}): pip install 'transformers>=5,<6', or use "
                             "gemma3-270m-llama")
            continue
        config = model_config(parser, flag, name).get_text_config()  # a multimodal model's text part
        try:
            configs.append(DecoderConfig.from_hf(config))
        except Exception as error:  # a model the fast decoder does not run, or an inconsistent one
            parser.error(f"{flag} {name}: {type(error).__name__}: {error}")
    return configs


def decoder_shape_list(parser: argparse.ArgumentParser, flag: str, text: str, outputs: dict) -> tuple[list, list]:
    """The names of a comma list of shapes (presets or config files; one named twice runs once) and
    their DecoderConfigs (shape_configs)."""
    names = shape_names(parser, flag, text, SHAPES, CONFIG_SHAPE_HELP)
    return names, shape_configs(parser, flag, names, outputs)


def one_shape(parser: argparse.ArgumentParser, flag: str, name: str, outputs: dict) -> DecoderConfig:
    if name not in SHAPES and not is_config_path(name):
        parser.error(f"argument {flag}: invalid choice: {name!r} (choose from {sorted(SHAPES)} or {CONFIG_SHAPE_HELP})")
    note_shadowed_paths(flag, [name], lambda preset: preset in SHAPES)
    (config,) = shape_configs(parser, flag, [name], outputs)
    return config


CLUSTERS = "random equal-size clusters (timing only)"


def cache_read_bytes(model: Decoder, keys: int) -> int:
    """Bytes of the cached keys and values a query after ``keys`` positions reads in every layer of
    ``model``: a sliding-window layer's window at most."""
    c = model.config
    positions = sum(min(keys, c.sliding_window) if layer in c.sliding_layers else keys for layer in range(c.num_layers))
    return 2 * c.num_kv_heads * positions * c.head_dim * model.k_cache.element_size()


def step_read_bytes(model: Decoder, keys: int) -> int:
    """Bytes a one-token body step must read: every layer's weights, the final norm, one embedding
    row (not the table) and the cached keys and values of ``keys`` positions in every layer."""
    weights = sum(w.numel() * w.element_size() for w in model.stacked.values())
    weights += model.final_norm.numel() * model.final_norm.element_size()
    embedding_row = model.config.hidden_size * model.embed.element_size()
    return weights + embedding_row + cache_read_bytes(model, keys)


CENTROID_DTYPES = {"model": None, "fp8": torch.float8_e4m3fn}  # FlashHead's centroid_dtype


def random_cluster_count(vocab: int, cluster_size: int) -> int:
    """The clusters random_flash_head makes: the vocabulary in clusters of ``cluster_size``, the last padded."""
    return math.ceil(vocab / cluster_size)


def random_flash_head(embedding: torch.Tensor, cluster_size: int, probes, seed: int = 0,
                      centroid_dtype: Optional[torch.dtype] = None) -> FlashHead:
    """A FlashHead over ``embedding`` with a random partition of the vocabulary; ``probes`` None: C/16."""
    vocab = embedding.shape[0]
    clusters = random_cluster_count(vocab, cluster_size)
    gen = torch.Generator(device=embedding.device).manual_seed(seed)
    order = torch.randperm(clusters * cluster_size, generator=gen, device=embedding.device)
    table = torch.where(order < vocab, order, torch.full_like(order, -1)).view(clusters, cluster_size)
    centroids = greedy_centroids(member_means(embedding.float(), table), "normalized")
    return FlashHead(embedding, centroids, table, default_probes(clusters) if probes is None else probes,
                     centroid_dtype=centroid_dtype)


def check_clusters(parser: argparse.ArgumentParser, args, names: list, configs: list) -> None:
    """A parser error when --cluster-size exceeds a shape's vocabulary (one cluster, mostly padding),
    or --probes the clusters random_flash_head makes for it."""
    for name, config in zip(names, configs):
        if args.cluster_size > config.vocab_size:
            parser.error(f"--cluster-size {args.cluster_size} exceeds the vocabulary of {name} ({config.vocab_size} rows)")
        clusters = random_cluster_count(config.vocab_size, args.cluster_size)
        if args.probes is not None and args.probes > clusters:
            parser.error(f"--probes {args.probes} exceeds the {clusters} clusters of {name} "
                         f"(vocabulary {config.vocab_size}, --cluster-size {args.cluster_size})")


def make_head(kind: str, embedding: torch.Tensor, args):
    if kind == "dense":
        return DenseHead(embedding)
    return random_flash_head(embedding, args.cluster_size, args.probes, centroid_dtype=CENTROID_DTYPES[args.centroid_dtype])


def _common(parser: argparse.ArgumentParser, json_default: str) -> None:
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="the models' dtype")
    parser.add_argument("--probes", type=positive_int, default=None, help="FlashHead clusters per step (None: C/16)")
    parser.add_argument("--cluster-size", type=positive_int, default=16, help="tokens per FlashHead cluster")
    parser.add_argument("--centroid-dtype", default="model", choices=sorted(CENTROID_DTYPES),
                        help="FlashHead's centroids: in the model's dtype, or float8_e4m3fn with a scale")
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="the models' device")
    parser.add_argument("--attention", default="sdpa", choices=ATTENTION, help="the decoders' attention implementation")
    parser.add_argument("--json", type=output_file, default=json_default, help="where the result JSON is written")


def _random_decoder(parser: argparse.ArgumentParser, flag: str, name: str, config: DecoderConfig, **kwargs) -> Decoder:
    """``Decoder.random(config, **kwargs)`` for shape ``name``, or a usage error naming ``flag`` where its
    weights do not fit the device (the default Qwen3-32B-shaped target needs about 66 GB in bf16)."""
    with usage_error_past_memory(parser, f"{flag} {name}", kwargs["device"]):
        return Decoder.random(config, **kwargs)


# ---- draft step ------------------------------------------------------------------------------

def draft_step_main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashhead_ext.bench draft-step",
                                     description="One draft decode step, graph-replayed: dense vs FlashHead head.",
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-0.6b,gemma3-270m-llama,smollm2-early-exit-8",
                        help=f"comma list of {sorted(SHAPES)} or {CONFIG_SHAPE_HELP}")
    parser.add_argument("--context", type=positive_int, default=1024, help="cache length attended over (max_len)")
    parser.add_argument("--samples", type=positive_int, default=30, help="timed samples (the median is reported)")
    parser.add_argument("--calls", type=positive_int, default=20,
                        help="graph replays per timed sample (CUDA; on the CPU each sample is one eager step)")
    parser.add_argument("--bodies", default="eager,fused,persistent",
                        help=f"comma list of {BODIES}: how the layers run (Decoder.body), each timed in this run")
    _common(parser, "results/bench_draft_step.json")
    args = parser.parse_args(argv)
    shapes, configs = decoder_shape_list(parser, "--shapes", args.shapes, {"--json": args.json})
    bodies = choices_list(parser, args.bodies, BODIES, "body")
    check_clusters(parser, args, shapes, configs)
    refuse_missing_cuda_kernels(parser, "--device", args.device, "draft-step's FlashHead rows need")
    with on_device(args.device):
        return _run_draft_step(parser, args, dict(zip(shapes, configs)), bodies)


def _run_draft_step(parser: argparse.ArgumentParser, args, shapes: dict, bodies: list) -> int:
    cuda = args.device != "cpu"
    dtype = DTYPES[args.dtype]
    meta = dict(run_metadata(args.device), clusters=CLUSTERS, args=vars(args))
    bandwidth = copy_bandwidth_gbs() if cuda else None
    meta["copy_bandwidth_gbs"] = bandwidth
    rows = []
    for name, config in shapes.items():
        model = _random_decoder(parser, "--shapes", name, config, max_len=args.context, dtype=dtype, device=args.device)
        model.attention = args.attention
        # The last position: eager/compiled attend over the whole cache at any length, fused and
        # persistent read the cache up to the length, so this is their most expensive step.
        model.reset(args.context - 1)
        ids = torch.zeros(1, dtype=torch.int64, device=args.device)
        body_bytes = step_read_bytes(model, keys=args.context)
        heads = {kind: make_head(kind, model.lm_head, args) for kind in ("dense", "flashhead")}
        first_body_step = {}
        for body in bodies:
            if body not in model.bodies:
                note(f"{name}: body {body!r} skipped (this layer runs on {model.bodies})")
                continue
            model.body = body
            body_us = _time(lambda: model.forward(ids), args, cuda)
            for kind, head in heads.items():
                step_us = _time_draft_step(model, head, args, cuda)
                head_bytes = model.lm_head.numel() * model.lm_head.element_size() if kind == "dense" else None
                first_body_step.setdefault(kind, step_us)
                rows.append(dict(shape=name, body=body, head=kind, layers=config.num_layers, step_us=step_us,
                                 # A difference of two noisy timings: blank (None) where it is not positive.
                                 body_us=body_us, head_us=step_us - body_us if step_us > body_us else None,
                                 probes=getattr(head, "probes", None), clusters=getattr(head, "num_clusters", None),
                                 body_floor_us=body_bytes / (bandwidth * 1e3) if bandwidth else None,
                                 dense_head_floor_us=head_bytes / (bandwidth * 1e3) if bandwidth and head_bytes else None,
                                 speedup_vs_first_body=first_body_step[kind] / step_us))
            dense, flash = rows[-2], rows[-1]
            flash["dense_over_flash"] = dense["step_us"] / flash["step_us"]
    print(f"draft step, {'CUDA graph replay' if cuda else 'eager (CPU)'}, {args.dtype}, attention {args.attention} "
          f"(eager/compiled bodies), context {args.context}, FlashHead: {CLUSTERS}; "
          "x first body = the step time of the shape's first body run (in --bodies order; a body a shape's layer "
          "does not run is skipped) over this one's, same head")
    print(format_table(rows, STEP_COLUMNS))
    if any(row["head_us"] is None for row in rows):
        print("head us blank: the step timed no slower than the body alone (the head's time is within the timing noise)")
    _write(args.json, dict(meta=meta, rows=rows))
    return 0


STEP_COLUMNS = [("shape", "shape", "s"), ("layers", "layers", "d"), ("body", "body", "s"), ("head", "head", "s"),
                ("probes", "p", "d"), ("step_us", "step us", ".1f"), ("body_us", "body us", ".1f"),
                ("head_us", "head us", ".1f"), ("body_floor_us", "body floor us", ".1f"),
                ("dense_over_flash", "dense/flash", ".3f"), ("speedup_vs_first_body", "x first body", ".2f")]


def _time(fn, args, cuda: bool) -> float:
    """µs a call of ``fn``: graph-replayed ``args.calls`` times a sample on CUDA, eager on the CPU."""
    if not cuda:
        return time_calls(fn, calls_per_sample=1, samples=args.samples, warmup=2, device="cpu")
    graph = capture_graph(fn)

    def replays():
        for _ in range(args.calls):
            graph.replay()

    return time_calls(replays, calls_per_sample=args.calls, samples=args.samples, warmup=2)


def _time_draft_step(model: Decoder, head, args, cuda: bool) -> float:
    """µs of one draft decode step at the model's current length: a token through the body, then
    the head's token written in place (as the fast path's proposals are)."""
    ids = torch.zeros(1, dtype=torch.int64, device=model.lm_head.device)
    token = torch.zeros(1, dtype=torch.int64, device=model.lm_head.device)
    return _time(lambda: head.next_token(model.forward(ids), out=token), args, cuda)


def _write(path, payload: dict) -> None:
    import json

    note(f"wrote {write_output(path, json.dumps(payload, indent=1))}")


# ---- end to end ------------------------------------------------------------------------------

def spec_main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashhead_ext.bench spec",
                                     description="End-to-end speculative decoding on the fast path, random weights.",
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--target", default="qwen3-32b", metavar="SHAPE",
                        help=f"target shape, one of {sorted(SHAPES)} or {CONFIG_SHAPE_HELP}")
    parser.add_argument("--draft", default="qwen3-0.6b", metavar="SHAPE",
                        help="draft shape, as --target (the target's vocabulary, or its first rows)")
    parser.add_argument("--target-layers", type=int, default=None,
                        help="keep only this many target layers (quick runs; reported numbers use the full shape)")
    parser.add_argument("--draft-device", type=device_arg, default=None, help="e.g. cuda:1 for the draft on a second GPU (None: the target's)")
    parser.add_argument("--synthetic-acceptance", type=float, default=0.77,
                        help="probability that the verifier accepts each proposal (random weights never agree)")
    parser.add_argument("--seed", type=run_seed, default=0, help="seed of the random weights, the synthetic acceptances and the prompts")
    parser.add_argument("--head", default="dense,flashhead", help="comma list of draft heads, each run in every speculative mode")
    parser.add_argument("--mode", default="baseline,ordinary,deferred", help="comma list of schedules (docs/speculative.md)")
    parser.add_argument("--k", type=int, default=6, help="proposals a round")
    parser.add_argument("--num-prompts", type=int, default=4, help="random prompts, each run in every configuration")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="tokens a prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated a prompt")
    parser.add_argument("--warmup-tokens", type=int, default=16, help="tokens of the untimed warm-up run of each configuration")
    parser.add_argument("--body", default="persistent", choices=BODIES, help="how the draft runs its layers (Decoder.body)")
    # The fused GEMV is built for one token; a verify of K+1 tokens is faster on cuBLAS (bench layer-ops).
    # On a GPU the compiled body is the faster target for both the baseline's steps and the verifies
    # (docs/benchmarks.md), so the baseline is not handicapped; on the CPU compiling would dominate.
    parser.add_argument("--target-body", default=None, choices=BODIES,
                        help="how the target runs its layers (None: compiled on a GPU, eager on the CPU)")
    _common(parser, "results/bench_spec.json")
    args = parser.parse_args(argv)
    target_shape = one_shape(parser, "--target", args.target, {"--json": args.json})
    draft_shape = one_shape(parser, "--draft", args.draft, {"--json": args.json})
    check_clusters(parser, args, [args.draft], [draft_shape])
    if args.target_body is None:
        args.target_body = "compiled" if torch.device(args.device).type == "cuda" else "eager"
    if not 0.0 <= args.synthetic_acceptance <= 1.0:
        parser.error(f"--synthetic-acceptance must be in [0, 1], got {args.synthetic_acceptance}")
    for name in ("k", "num_prompts", "prompt_tokens", "max_new_tokens", "warmup_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        configs = plan_configs([h for h in args.head.split(",") if h], [m for m in args.mode.split(",") if m])
    except ValueError as error:
        parser.error(str(error))
    if args.target_body in KERNEL_BODIES:
        refuse_missing_cuda_kernels(parser, "--device", args.device, f"--target-body {args.target_body} needs",
                                    "pass --target-body compiled")
    refuse_draft_without_kernels(parser, args, [c.head for c in configs if c.head], args.body, "--body")
    if not any(c.head for c in configs):
        # Said, as given, where set otherwise than by default: a baseline alone builds no draft.
        note_unused_draft_options(options_given(parser, args, ("draft", "draft_device", "synthetic_acceptance", "head", "k",
                                                               "body", "probes", "cluster_size", "centroid_dtype")),
                                  args.mode)
        args.synthetic_acceptance = None  # the JSON records what ran: a baseline alone verifies nothing
    try:  # fewer rows are allowed: the target's padding (docs/speculative.md)
        check_draft_vocab(draft_shape.vocab_size, target_shape.vocab_size)
    except ValueError as error:
        parser.error(f"--draft {args.draft}: {error}")
    if args.target_layers is not None:
        try:
            target_shape = target_shape.first_layers(args.target_layers)
        except ValueError as error:
            parser.error(f"--target-layers: {error}")

    with on_device(args.device):
        return _run_spec(parser, args, configs, target_shape, draft_shape)


def _run_spec(parser: argparse.ArgumentParser, args, configs: list, target_shape: DecoderConfig,
              draft_shape: DecoderConfig) -> int:
    dtype = DTYPES[args.dtype]
    drafting = any(c.head for c in configs)
    bodies = [("--target-body", target_shape, args.target_body)] + ([("--body", draft_shape, args.body)] if drafting else [])
    for flag, shape, body in bodies:
        limit = shape.body_limit(body, dtype)
        if limit:
            parser.error(f"{flag} {body!r} {limit}")
    started = run_metadata(args.device)  # the code and date the run started with
    max_len = args.prompt_tokens + args.max_new_tokens + args.k + 1
    max_len = max(8 * math.ceil(max_len / 8), 3 * (args.k + 2))  # a multiple of 8 keeps SDPA's mask aligned
    target = _random_decoder(parser, "--target", args.target, target_shape, max_len=max_len, dtype=dtype,
                             device=args.device, seed=args.seed)
    draft_device = args.draft_device or args.device
    # A baseline alone runs no draft: not built, its gigabytes not allocated.
    draft = _random_decoder(parser, "--draft", args.draft, draft_shape, max_len=max_len, dtype=dtype, device=draft_device,
                            seed=args.seed ^ 1) if drafting else None  # not the target's, and in range at every --seed
    models = [("--target-body", target, args.target_body)] + ([("--body", draft, args.body)] if drafting else [])
    for flag, model, body in models:
        model.attention = args.attention
        try:
            model.body = body
        except ValueError as error:  # on a GPU, the persistent kernel's own limits, asked of the built model
            parser.error(f"{flag}: {error}")
    decoders = {None: FastSpeculativeDecoder(target, k=args.k, eos_token_id=[])}
    for kind in dict.fromkeys(c.head for c in configs if c.head):
        # One seed for every config: a prompt gets the same acceptances in every mode and head.
        decoders[kind] = FastSpeculativeDecoder(target, draft, make_head(kind, draft.lm_head, args), k=args.k, eos_token_id=[],
                                                synthetic_acceptance=args.synthetic_acceptance, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [dict(input_ids=torch.randint(0, target_shape.vocab_size, (args.prompt_tokens,), generator=gen), question_id=i)
               for i in range(args.num_prompts)]
    records = run_interleaved(decoders, configs, prompts, args.max_new_tokens, warmup_tokens=args.warmup_tokens)
    rows = summarize(records, configs)
    step_us = {}
    # Decoders' devices, not the flags' spellings: --draft-device cuda:0 beside --device cuda is one GPU.
    if drafting and draft.device == target.device:  # a draft on its own GPU overlaps the target: no sum of parts to predict from
        # The draft step of each head at the draft's mean length while generating, timed as draft-step times it.
        draft.reset(args.prompt_tokens + args.max_new_tokens // 2)
        timing = argparse.Namespace(calls=20, samples=10)
        step_us = {kind: _time_draft_step(draft, decoders[kind].head, timing, torch.device(args.device).type == "cuda")
                   for kind in decoders if kind is not None}
    elif drafting:
        note(f"no draft-step prediction of the gain: the draft on {draft.device} overlaps the target on {target.device}")
    gains = head_gains(rows, args.k, args.synthetic_acceptance, step_us)
    flash = decoders.get("flashhead")
    meta = dict(started, args=vars(args), synthetic_acceptance=args.synthetic_acceptance, clusters=CLUSTERS, max_len=max_len,
                target_gb=target.nbytes / 1e9, draft_gb=draft.nbytes / 1e9 if drafting else None,
                probes_used=flash.head.probes if flash else None, num_clusters=flash.head.num_clusters if flash else None,
                graphs=decoders[None].graphs, draft_step_us=step_us, head_gains=gains)
    layers = f" ({args.target_layers} layers)" if args.target_layers else ""
    header = [f"target {args.target}{layers} {meta['target_gb']:.1f} GB",
              f"draft {args.draft} on {draft_device}, K={args.k}" if drafting else "no draft", args.dtype,
              f"draft body {args.body}" if drafting else None, f"target body {args.target_body}",
              f"attention {args.attention}", f"FlashHead {CLUSTERS}" if drafting else None, f"graphs={meta['graphs']}"]
    print(", ".join(part for part in header if part))
    print(format_summary(rows))
    print(reading(rows))
    for gain in gains:
        print(gain["reading"])
    note(f"wrote {write_json(args.json, meta, rows, records)}")
    return 0


def expected_emitted(acceptance: float, k: int) -> float:
    """Tokens a round emits on average when each of its k proposals is accepted with probability
    ``acceptance``, independently, up to the first rejection: the accepted ones and the target's next."""
    return float(k + 1) if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def accepted_share(acceptance: float, k: int) -> float:
    """The accepted / proposed the tables' ``accept`` column reads when each proposal is accepted
    with probability ``acceptance`` up to the first rejection: (expected_emitted - 1) / k."""
    return (expected_emitted(acceptance, k) - 1) / k


def break_even_acceptance(acceptance: float, k: int, time_ratio: float) -> float:
    """The acceptance at which a draft whose rounds take ``time_ratio`` of another's time emits as
    many tokens a second as the other at ``acceptance`` (rounds of fixed work, as deferred's)."""
    wanted = expected_emitted(acceptance, k) * time_ratio
    low, high = 0.0, 1.0
    for _ in range(60):  # expected_emitted rises with acceptance
        middle = (low + high) / 2
        low, high = (middle, high) if expected_emitted(middle, k) < wanted else (low, middle)
    return high


def head_gains(rows: list, k: int, acceptance: float, step_us: dict) -> list:
    """FlashHead's draft against the dense one in each mode where both ran and proposed: the decode-time gain
    measured end to end; the gain the draft-step microbenchmark predicts (its step-time difference
    over the draft steps the run proposed: k a round, none in a generation's last round, which only
    the target's token ends); and, for deferred, the acceptance FlashHead's
    draft may drop to before the gain is gone. Both drafts drew the same synthetic acceptances, so
    the measured gain is at equal acceptance: FlashHead's approximate top-1 costs nothing here."""
    by_label = {row["label"]: row for row in rows}
    gains = []
    for mode in dict.fromkeys(row["mode"] for row in rows):
        dense, flash = by_label.get(f"{mode}/dense"), by_label.get(f"{mode}/flashhead")
        # Without a draft step after warm-up (max_new_tokens 1 or 2) the decode time is the target's and
        # bookkeeping only: a ratio of noise, which had been read as FlashHead's gain.
        if not dense or not flash or not (dense["decode_s"] and flash["decode_s"] and dense["proposed"] and flash["proposed"]):
            continue
        gain = dict(mode=mode, measured=dense["decode_s"] / flash["decode_s"] - 1)
        text = f"{mode}: FlashHead draft {gain['measured']:+.2%} decode speed over dense at equal (synthetic) acceptance"
        if step_us.get("dense") and step_us.get("flashhead"):
            saved_s = flash["proposed"] * (step_us["dense"] - step_us["flashhead"]) * 1e-6
            steps = f"the draft steps (dense {step_us['dense']:.1f}, FlashHead {step_us['flashhead']:.1f} us, {flash['proposed']} proposed)"
            # A saving past the dense draft's own time in the run means the steps timed apart are not
            # this run's (small models on a busy CPU): the formula gave -1287% or +19205%.
            dense_draft_s = dense.get("draft_s") or dense["decode_s"]
            if saved_s < dense_draft_s:
                gain["predicted"] = dense["decode_s"] / (dense["decode_s"] - saved_s) - 1
                gain["of_predicted"] = gain["measured"] / gain["predicted"] if gain["predicted"] else None
                text += f"; {steps} predict {gain['predicted']:+.2%}"
                if gain["of_predicted"] is not None:
                    text += f" ({gain['of_predicted']:.0%} of it measured)"
            else:
                gain["predicted"] = gain["of_predicted"] = None
                text += (f"; no prediction: {steps} would save {saved_s:.3g} s, not less than the dense draft's "
                         f"{dense_draft_s:.3g} s in this run, so they were not timed as it ran")
        if mode == "deferred" and gain["measured"] > 0:
            gain["break_even_acceptance"] = break_even_acceptance(acceptance, k, flash["decode_s"] / dense["decode_s"])
            # Also in the table's units, which a user compares with their own draft's accept column.
            gain["break_even_accept"] = accepted_share(gain["break_even_acceptance"], k)
            text += (f"; it lasts while each FlashHead proposal is accepted with probability >= "
                     f"{gain['break_even_acceptance']:.3f} against dense's {acceptance} (the tables' accept "
                     f">= {gain['break_even_accept']:.3f} against {accepted_share(acceptance, k):.3f})")
        gain["reading"] = text
        gains.append(gain)
    return gains
