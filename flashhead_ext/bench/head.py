"""``python -m flashhead_ext.bench head``: the output head alone, dense vs FlashHead, in one run.

Compares, on the same device and in the same process: the torch dense head (matmul + argmax),
a plain-torch FlashHead (matmul, topk, index gather, einsum, argmax) and our fused ops (greedy
and sampling; ``*_fp8``: with float8_e4m3fn centroids and their scale, as
``FlashHead(centroid_dtype=torch.float8_e4m3fn)`` keeps them), eager and CUDA-graph
replayed. Each row also gives the memory an implementation costs besides the embedding it shares
with the dense head: the bytes it keeps (centroids, cluster table, special ids) and, on CUDA, the
peak bytes one eager call allocates (workspace, intermediates, output). Weights are random (timing
does not depend on trained values; never zeros). Each
timed sample runs ``--calls`` head calls that rotate over
several copies of the centroids and cluster table and over fresh hidden states (and over copies
of the embedding where it is smaller than three L2s), so, as in a real decode step where the
model body flushes L2 between head calls, the head reads its bytes from device memory rather
than from L2. The floor is the bytes the head must read over the measured copy bandwidth. Every
row's ``x dense`` is against the dense head's matmul + argmax, the sampling rows' too.
"""
from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass

import torch

from .. import ops
from ..assets import default_probes
from .._cli import (DefaultsHelpFormatter, choices_list, config_file, device_arg, doc_summary, first_of_each, model_config,
                    note, output_file, positive_int, positive_int_list, refuse_missing_cuda_kernels, refuse_shared_files,
                    shape_names, write_output)
from ..graphs import capture_graph
from .timing import copy_bandwidth_gbs, format_table, on_device, run_metadata, time_calls, usage_error_past_memory


@dataclass(frozen=True)
class VocabShape:
    vocab: int
    dim: int
    cluster_size: int = 16

    @property
    def num_clusters(self) -> int:
        return math.ceil(self.vocab / self.cluster_size)


SHAPES = {
    "qwen3-0.6b": VocabShape(151936, 1024),
    "llama3": VocabShape(128256, 2048),
    "gemma3-1b": VocabShape(262144, 1152),
    "tiny": VocabShape(4000, 64),  # for a quick check of the CLI itself, e.g. on a CPU
}
SHAPES_HELP = ("VOCABxDIM or VOCABxDIMxCLUSTER_SIZE for a head of one's own (49152x576: SmolLM2's; clusters of 16 unless "
               "given), or a transformers config.json or model directory (its vocabulary and hidden size)")
GOALS_SHAPE = SHAPES["qwen3-0.6b"]  # issue 3's goals are for this head, under any name
# The heads of the config files vocab_shape_list read, by the path given.
CONFIG_HEADS: dict = {}


def custom_shape(name: str) -> VocabShape | None:
    """The head ``VOCABxDIM[xCLUSTER_SIZE]`` names (``32000x4096x8``), or None for any other name."""
    match = re.fullmatch(r"(\d+)x(\d+)(?:x(\d+))?", name)
    if match is None:
        return None
    vocab, dim, cluster_size = match.groups()
    return VocabShape(int(vocab), int(dim), int(cluster_size or 16))


def named_shape(name: str, presets: dict = SHAPES) -> VocabShape | None:
    """The head a preset or ``VOCABxDIM[xCLUSTER_SIZE]`` names, or None (a config path)."""
    return presets[name] if name in presets else custom_shape(name)


def shape_of(name: str, presets: dict = SHAPES) -> VocabShape | None:
    return named_shape(name, presets) or CONFIG_HEADS.get(name)


def config_head(parser: argparse.ArgumentParser, path: str) -> VocabShape:
    """The output head of the causal LM whose config is at ``path``, as its module is (OPT's is
    narrower than its hidden size), in clusters of 16; a usage error where it has none."""
    config = model_config(parser, "--shapes", path)
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):  # the modules' shapes, no weights
            weight = AutoModelForCausalLM.from_config(config).get_output_embeddings().weight
    except Exception as error:  # not a causal LM, or one without an output head
        parser.error(f"--shapes {path}: its output head could not be read ({type(error).__name__}: {error})")
    return VocabShape(*weight.shape)


def note_slow_on_the_cpu(device: str, names: list[str], quick_flags: str, presets: dict = SHAPES) -> None:
    """A note where a CPU run would take minutes with nothing printed: one of ``names`` has over a
    million embedding elements (tiny's four times over, a real model's several hundred times)."""
    large = [name for name in names if shape_of(name, presets).vocab * shape_of(name, presets).dim > 2**20]
    if device == "cpu" and large:
        note(f"on the CPU the large shapes ({', '.join(large)}) take minutes; {quick_flags} takes seconds")


def vocab_shape_list(parser: argparse.ArgumentParser, names: str, outputs: dict, presets: dict = SHAPES) -> list[str]:
    """``--shapes``: each name a preset, a ``VOCABxDIM[xCLUSTER_SIZE]`` head or a model's config
    file (its output head, in clusters of 16), with counts the CUDA kernels take and clusters no larger
    than the vocabulary; a head named twice (``tiny,4000x64``) runs once, under its first name. A
    usage error where one of ``outputs`` (as refuse_shared_files') would overwrite a config file
    named, one whose head runs under an earlier name too."""
    picked = shape_names(parser, "--shapes", names, presets, SHAPES_HELP, lambda name: named_shape(name, presets) is not None)
    configs = [name for name in picked if named_shape(name, presets) is None]
    refuse_shared_files(parser, {"--shapes": [config_file(name) for name in configs]}, outputs)
    for name in configs:
        CONFIG_HEADS[name] = config_head(parser, name)
    for name in picked:
        shape = shape_of(name, presets)
        # Past the CUDA kernels' counts the ops refused such a head only once its tensors were made.
        if not (1 <= shape.cluster_size <= shape.vocab <= ops.CUDA_COUNT_MAX and 1 <= shape.dim <= ops.CUDA_COUNT_MAX):
            parser.error(f"shape {name!r}: the vocabulary and the hidden size must be in 1..2**30 (the CUDA kernels' limit "
                         "on a count) and the cluster size in 1..the vocabulary")
    return first_of_each("--shapes", picked, lambda name: shape_of(name, presets), "the same head")


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMPLS = ("dense", "torch_flash", "flash_greedy", "flash_sample", "flash_greedy_fp8", "flash_sample_fp8")
MODES = ("eager", "graph")


class HeadState:
    """Random head weights at one shape, with enough copies of the per-call bytes to defeat L2."""

    def __init__(self, shape: VocabShape, dtype: torch.dtype, device: str, max_batch: int, copies: int, seed: int = 0,
                 special_tokens: int = 0, embedding_copies: int = 1):
        gen = torch.Generator(device=device).manual_seed(seed)
        vocab, dim, b = shape.vocab, shape.dim, shape.cluster_size
        # Special tokens sit at the end of real vocabularies (EOS, chat markers); scored every step.
        self.extra_ids = (torch.arange(vocab - special_tokens, vocab, dtype=torch.int32, device=device)
                          if special_tokens else None)
        clusters = shape.num_clusters
        scale = dim ** -0.5
        # Real candidate rows are scattered in the embedding; copies of it only where it could stay in L2.
        embedding = (torch.randn(vocab, dim, generator=gen, device=device) * scale).to(dtype)
        self.embeddings = [embedding] + [embedding.clone() for _ in range(embedding_copies - 1)]
        self.centroids, self.fp8_centroids, self.tables, self.hidden = [], [], [], []
        for _ in range(copies):
            cents = torch.nn.functional.normalize(torch.randn(clusters, dim, generator=gen, device=device), dim=1)
            self.centroids.append(cents.to(dtype))
            self.fp8_centroids.append(ops.quantize_centroids(cents))
            order = torch.randperm(clusters * b, generator=gen, device=device)
            table = torch.where(order < vocab, order, torch.full_like(order, -1)).view(clusters, b)
            self.tables.append(table.to(torch.int32))
            self.hidden.append(torch.randn(max_batch, dim, generator=gen, device=device).to(dtype))
        self.seed = torch.zeros((), dtype=torch.int64, device=device).random_(0, 2**62, generator=gen)
        self.copies = copies

    def head_call(self, impl: str, batch: int, probes: int, index: int):
        """One head call of ``impl`` on copy ``index``; returns a callable with no arguments."""
        i = index % self.copies
        h, cents, table = self.hidden[i][:batch], self.centroids[i], self.tables[i]
        emb = self.embeddings[index % len(self.embeddings)]
        extra = self.extra_ids
        if impl == "dense":
            return lambda: (h @ emb.t()).argmax(dim=-1)
        if impl == "torch_flash":
            return lambda: torch_flash_greedy(h, cents, table, emb, probes, extra)
        scale = None
        if impl.endswith("_fp8"):
            cents, scale = self.fp8_centroids[i]
        if impl in ("flash_greedy", "flash_greedy_fp8"):
            return lambda: ops.decode_greedy(h, cents, table, emb, probes, extra, centroid_scale=scale)
        if impl in ("flash_sample", "flash_sample_fp8"):
            return lambda: ops.decode_sample(h, cents, table, emb, probes, 1.0, extra, seed=self.seed, centroid_scale=scale)
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")

    def kept_bytes(self, impl: str) -> int:
        """Bytes ``impl`` reads besides the embedding and hidden states and must keep between calls:
        one copy's centroids (with their scale in fp8), cluster table and special ids; 0 for dense."""
        if impl == "dense":
            return 0
        centroids = self.fp8_centroids[0] if impl.endswith("_fp8") else (self.centroids[0],)
        kept = [*centroids, self.tables[0]] + ([self.extra_ids] if self.extra_ids is not None else [])
        return sum(t.numel() * t.element_size() for t in kept)


def torch_flash_greedy(hidden, centroids, cluster_tokens, embedding, probes, extra_ids=None):
    """FlashHead in plain torch ops, the path our kernels replace (as in the 2026 thesis)."""
    cluster_ids = (hidden @ centroids.t()).topk(probes, dim=-1).indices
    candidates = cluster_tokens[cluster_ids].flatten(1)
    if extra_ids is not None:  # a repeated id scores like its twin: the argmax needs no masking
        candidates = torch.cat([candidates, extra_ids.expand(candidates.shape[0], -1)], dim=1)
    candidates = candidates.long()
    logits = torch.einsum("bnd,bd->bn", embedding[candidates.clamp(min=0)], hidden)
    logits = logits.masked_fill(candidates < 0, float("-inf"))
    return candidates.gather(1, logits.argmax(dim=1, keepdim=True)).squeeze(1)


@dataclass(frozen=True)
class CandidatesRead:
    clusters: float  # distinct clusters the batch chose, mean over the copies
    rows: float      # distinct vocabulary rows among their tokens and the special ids, the same


def floor_bytes(impl: str, shape: VocabShape, batch: int, dtype: torch.dtype, read: CandidatesRead) -> int:
    """Fewest bytes a call must read: the whole embedding for dense; otherwise the centroids (one
    byte an element in fp8), the table entries of the chosen clusters and the embedding rows of
    their tokens and the special ids, each once however many rows chose it."""
    es = torch.finfo(dtype).bits // 8
    if impl == "dense":
        return shape.vocab * shape.dim * es + batch * shape.dim * es
    centroid_bytes = 1 if impl.endswith("_fp8") else es
    return (shape.num_clusters * shape.dim * centroid_bytes + round(read.clusters * shape.cluster_size * 4
            + read.rows * shape.dim * es) + batch * shape.dim * es)


def candidates_read(state: HeadState, batch: int, probes: int) -> CandidatesRead:
    """What the batch's rows choose at one point: the greedy path's own selection and candidates
    (the ops; fp8 centroids may swap a boundary cluster, which leaves the counts about the same).
    Rows of a batch often choose the same clusters, which a call need read only once."""
    clusters, rows = [], []
    for i in range(state.copies):
        cluster_ids, _ = ops.select_clusters(state.hidden[i][:batch], state.centroids[i], probes)
        tokens = ops.gather_candidates(cluster_ids, state.tables[i], state.extra_ids)
        clusters.append(cluster_ids.unique().numel())
        rows.append(tokens[tokens >= 0].unique().numel())
    return CandidatesRead(sum(clusters) / len(clusters), sum(rows) / len(rows))


def measure(state: HeadState, impl: str, batch: int, probes: int, mode: str, calls: int, samples: int, device: str) -> float:
    fns = [state.head_call(impl, batch, probes, i) for i in range(calls)]

    def run_all():
        for fn in fns:
            fn()

    if mode == "graph":
        graph = capture_graph(run_all)
        return time_calls(graph.replay, calls_per_sample=calls, samples=samples, device=device)
    return time_calls(run_all, calls_per_sample=calls, samples=samples, device=device)


def copy_bytes(shape: VocabShape, dtype: torch.dtype, impls: list, max_batch: int) -> int:
    """Bytes of one copy of the per-call data (centroids, table, hidden rows) as the implementation
    reading the fewest of them (fp8 centroids where timed) reads it."""
    centroid_bytes = 1 if any(impl.endswith("_fp8") for impl in impls) else torch.finfo(dtype).bits // 8
    return (shape.num_clusters * (shape.dim * centroid_bytes + shape.cluster_size * 4)
            + max_batch * shape.dim * torch.finfo(dtype).bits // 8)


def whole_rotations(copies: int, calls: int) -> int:
    """The fewest copies, at least ``copies`` (or all ``calls``), that divide ``calls``: each replay
    then ends a rotation, and its next replay's first calls do not reuse copies that its last calls
    read a few calls before (16 calls over 13 copies reused three after 3 calls)."""
    return next(n for n in range(max(1, min(copies, calls)), calls + 1) if calls % n == 0)


def copies_needed(per_copy: int, calls: int, l2: int) -> int:
    """Copies to rotate over, so that at least three L2s' worth of other copies pass between two
    uses of one copy; more than the calls a sample makes would go unused."""
    return whole_rotations(math.ceil(3 * l2 / per_copy) + 1, calls) if l2 else 1


def embedding_copies_needed(shape: VocabShape, dtype: torch.dtype, calls: int, l2: int) -> int:
    """Copies of the embedding to rotate over, so that three L2s pass between two reads of one row
    (the rest of its copy and the other copies): one where it is three L2s or more (every preset).
    SmolLM2's 57 MB would otherwise stay in an H200's 63 MB L2, and the dense head, which reads all
    of it, would be timed from there."""
    embedding_bytes = shape.vocab * shape.dim * torch.finfo(dtype).bits // 8
    return whole_rotations(math.ceil(3 * l2 / embedding_bytes), calls) if l2 else 1


def warm_l2_warning(shape_name: str, copies: int, per_copy: int, l2: int, calls: int):
    """The warning a run whose ``--calls`` leave too few copies to pass two L2s between uses gets:
    its calls then read partly from L2, faster than in a decode step. None when the copies suffice."""
    if not l2 or copies * per_copy >= 2 * l2:
        return None
    return (f"warning: --calls {calls} rotates {copies} copies ({copies * per_copy / 1e6:.0f} MB) at {shape_name}, "
            f"less than twice the {l2 / 1e6:.0f} MB L2: its calls read partly from L2, so its times are below a decode "
            f"step's; use --calls {math.ceil(2 * l2 / per_copy)} or more")


def call_bytes(fn, device: str):
    """Peak bytes one eager call of ``fn`` allocates on top of what was allocated before it (its
    workspace, intermediates and output), as the CUDA caching allocator counts them (in blocks of
    512 bytes); None on the CPU, which keeps no such statistics. A first call runs before, so that
    what a library keeps after its first use (cuBLAS's workspace) counts as allocated before."""
    if not str(device).startswith("cuda"):
        return None
    fn()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    del out
    return torch.cuda.max_memory_allocated(device) - before


def capped_probes(probes: int, shape: VocabShape) -> int:
    """A point's probes: at most the shape's clusters."""
    return min(probes, shape.num_clusters)


def plan(args) -> list[dict]:
    """The configurations to time: (shape, batch, probes) points, each with every impl and mode.
    Probes are capped at a shape's clusters; a point that capping repeats is timed once (the
    ratios pair rows by point)."""
    points = []
    for name in args.shapes:
        shape = shape_of(name)
        main = name == args.shapes[0]
        probes_list = args.probes if main else sorted({256, default_probes(shape.num_clusters)})
        wanted = [(1, p) for p in probes_list]
        if main:
            wanted += [(batch, args.batch_probes) for batch in args.batches]
        for batch, p in wanted:
            point = dict(shape=name, batch=batch, probes=capped_probes(p, shape))
            if point not in points:
                points.append(point)
    return points


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashhead_ext.bench head", description=doc_summary(__doc__),
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-0.6b,llama3,gemma3-1b",
                        help=f"comma list of {sorted(SHAPES)} or {SHAPES_HELP}; the first gets the probes and "
                             "batch sweeps")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="the head's weights and hidden states")
    parser.add_argument("--probes", type=positive_int_list, default="32,256,593,1024",
                        help="probes swept at batch 1 on the first shape (capped at its clusters)")
    parser.add_argument("--batches", type=positive_int_list, default="1,2,4,8,16,32,64",
                        help="batch sizes swept on the first shape, at --batch-probes")
    parser.add_argument("--batch-probes", type=positive_int, default=256, help="probes used in the batch sweep")
    parser.add_argument("--special-tokens", type=int, default=0,
                        help="ids scored at every step besides the clusters' (the last N of the vocabulary), "
                             "as FlashHead(special_token_ids=...) does")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma list of the implementations compared")
    parser.add_argument("--modes", default="eager,graph", help="comma list: eager calls, CUDA-graph replays or both")
    parser.add_argument("--calls", type=positive_int, default=16, help="head calls per timed sample (rotating copies)")
    parser.add_argument("--samples", type=positive_int, default=25, help="timed samples (the median is reported)")
    parser.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where it runs (a GPU when there is one; the CPU runs the references, slowly)")
    parser.add_argument("--json", type=output_file, default="results/bench_head.json", help="where the result JSON is written")
    args = parser.parse_args(argv)
    args.shapes = vocab_shape_list(parser, args.shapes, {"--json": args.json})
    for name in args.shapes:
        if not 0 <= args.special_tokens < shape_of(name).vocab:
            parser.error(f"--special-tokens must be in [0, {shape_of(name).vocab}) for {name}, got {args.special_tokens}")
    impls = choices_list(parser, args.impls, IMPLS, "implementation")
    modes = choices_list(parser, args.modes, MODES, "mode")
    # Every run's floors take the candidates the ops select, whichever --impls are timed.
    refuse_missing_cuda_kernels(parser, "--device", args.device, "bench head needs")
    if args.device == "cpu" and "graph" in modes:
        if modes == ["graph"]:
            parser.error("--modes graph needs a CUDA device (CUDA graphs); on the CPU use --modes eager")
        modes = [m for m in modes if m != "graph"]
        note("graph mode skipped: CUDA graphs need a CUDA device")
    note_slow_on_the_cpu(args.device, args.shapes, "--shapes tiny --samples 3 --calls 4")
    with on_device(args.device):
        return run(parser, args, impls, modes)


def run(parser: argparse.ArgumentParser, args, impls: list, modes: list) -> int:
    """Times every point of ``plan(args)``, prints the table and summary, writes the JSON."""
    dtype = DTYPES[args.dtype]
    meta = run_metadata(args.device)
    bandwidth = copy_bandwidth_gbs() if torch.device(args.device).type == "cuda" else None
    meta["copy_bandwidth_gbs"] = bandwidth
    l2 = meta.get("l2_bytes") or 0
    rows, warm_l2_shapes = [], []
    for name in args.shapes:
        shape = shape_of(name)
        points = [pt for pt in plan(args) if pt["shape"] == name]
        max_batch = max(pt["batch"] for pt in points)
        per_copy = copy_bytes(shape, dtype, impls, max_batch)
        copies = copies_needed(per_copy, args.calls, l2)
        warning = warm_l2_warning(name, copies, per_copy, l2, args.calls)
        if warning:
            note(warning)
            warm_l2_shapes.append(name)
        with usage_error_past_memory(parser, f"--shapes {name}", args.device):
            state = HeadState(shape, dtype, args.device, max_batch, copies, special_tokens=args.special_tokens,
                              embedding_copies=embedding_copies_needed(shape, dtype, args.calls, l2))
        for pt in points:
            read = candidates_read(state, pt["batch"], pt["probes"])
            for impl in impls:
                memory = dict(kept_bytes=state.kept_bytes(impl),
                              call_bytes=call_bytes(state.head_call(impl, pt["batch"], pt["probes"], 0), args.device))
                for mode in modes:
                    us = measure(state, impl, pt["batch"], pt["probes"], mode, args.calls, args.samples, args.device)
                    nbytes = floor_bytes(impl, shape, pt["batch"], dtype, read)
                    floor_us = nbytes / (bandwidth * 1e9) * 1e6 if bandwidth else None
                    rows.append(dict(pt, special_tokens=args.special_tokens, impl=impl, mode=mode, us=us, copies=state.copies,
                                     embedding_copies=len(state.embeddings),
                                     clusters_read=read.clusters, floor_bytes=nbytes, floor_us=floor_us, **memory,
                                     pct_of_floor=100.0 * floor_us / us if floor_us else None))
        del state
    add_ratios(rows)
    if args.special_tokens:
        print(f"{args.special_tokens} special tokens scored at every step")
    print(format_table([dict(r, **megabytes(r)) for r in rows], COLUMNS))
    main_shape = shape_of(args.shapes[0])
    meta["warm_l2_shapes"] = warm_l2_shapes
    # The goals are for bf16 weights, no special tokens and the head read from memory.
    unlike_goals = tuple(reason for reason, applies in ((f"{args.dtype} weights", args.dtype != "bf16"),
                                                        ("special tokens", args.special_tokens > 0),
                                                        ("a warm L2", args.shapes[0] in warm_l2_shapes)) if applies)
    print(summary(rows, args.shapes[0], capped_probes(args.batch_probes, main_shape), capped_probes(256, main_shape),
                  unlike_goals))
    # The implementations and modes that ran (graph mode is dropped on a CPU), not the flags' text.
    out = write_output(args.json, json.dumps({"meta": meta, "args": dict(vars(args), impls=impls, modes=modes), "rows": rows},
                                             indent=1))
    note(f"wrote {out}")
    return 0


COLUMNS = [("shape", "shape", ""), ("batch", "B", "d"), ("probes", "p", "d"), ("impl", "impl", ""),
           ("mode", "mode", ""), ("us", "us", ".1f"), ("floor_us", "floor_us", ".1f"),
           ("pct_of_floor", "%floor", ".0f"), ("x_vs_dense", "x dense", ".2f"), ("x_vs_torch_flash", "x torch_flash", ".2f"),
           ("kept_mb", "kept MB", ".2f"), ("call_mb", "call MB", ".3f")]


def megabytes(row: dict) -> dict:
    """The row's memory columns in MB (10^6 bytes) for the table; the JSON keeps bytes."""
    return {f"{key}_mb": row[f"{key}_bytes"] / 1e6 for key in ("kept", "call") if row.get(f"{key}_bytes") is not None}


def add_ratios(rows: list[dict]) -> None:
    """Speedups against the dense and plain-torch FlashHead paths measured at the same point and mode."""
    index = {(r["shape"], r["batch"], r["probes"], r["mode"], r["impl"]): r["us"] for r in rows}
    for r in rows:
        key = (r["shape"], r["batch"], r["probes"], r["mode"])
        for base in ("dense", "torch_flash"):
            if (*key, base) in index:
                r[f"x_vs_{base}"] = index[(*key, base)] / r["us"]


def summary(rows: list[dict], main_shape: str, batch_probes: int = 256, probes: int = 256,
            unlike_goals: tuple = ()) -> str:
    """Key numbers at batch 1 and ``probes`` (256, or the head's clusters where fewer: as capped in
    the rows), against the issue's goals where the head is theirs (Qwen3-0.6B's), and the batch at
    which dense starts to win (at the batch sweep's probes, ``batch_probes`` as capped).
    ``unlike_goals`` names what sets the run apart from the goals' (another dtype, special tokens,
    a warm L2): its numbers are then not judged against them."""
    def pick(**kw):
        return next((r for r in rows if all(r.get(k) == v for k, v in kw.items())), None)

    def goal(value: float, relation: str, bound: float) -> str:
        """The goal and whether ``value`` meets it, judged before rounding: 15.004 us prints as 15.00
        and misses "<= 15"."""
        if shape_of(main_shape) != GOALS_SHAPE:
            return ""
        if unlike_goals:
            return f" (goal {relation} {bound:g}: not judged, {', '.join(unlike_goals)})"
        met = value <= bound if relation == "<=" else value >= bound
        return f" (goal {relation} {bound:g}: {'met' if met else 'not met'})"

    lines = ["", "summary:"]
    greedy = pick(shape=main_shape, batch=1, probes=probes, impl="flash_greedy", mode="graph")
    sample = pick(shape=main_shape, batch=1, probes=probes, impl="flash_sample", mode="graph")
    if greedy:
        # A baseline left out by --impls has no ratio: say so rather than print nan.
        ratios = [f"{greedy[f'x_vs_{base}']:.2f}x {base}{goal(greedy[f'x_vs_{base}'], '>=', least)}"
                  if f"x_vs_{base}" in greedy else f"{base} not run" for base, least in (("dense", 6), ("torch_flash", 4))]
        lines.append(f"  {main_shape} B=1 p={probes} graph: flash_greedy {greedy['us']:.2f} us{goal(greedy['us'], '<=', 15)}, "
                     + ", ".join(ratios))
    if greedy and sample:
        slower = sample["us"] / greedy["us"]
        lines.append(f"  sampling/greedy: {slower:.2f}x{goal(slower, '<=', 1.5)}")
    fp8 = pick(shape=main_shape, batch=1, probes=probes, impl="flash_greedy_fp8", mode="graph")
    if fp8:
        ratio = f", {fp8['x_vs_dense']:.2f}x dense" if "x_vs_dense" in fp8 else ""
        lines.append(f"  fp8 centroids, B=1 p={probes} graph: flash_greedy_fp8 {fp8['us']:.2f} us{ratio}")
    # Rows that lack the memory columns print no memory line.
    memory = {impl: pick(shape=main_shape, batch=1, probes=probes, impl=impl) for impl in IMPLS}
    if memory["flash_greedy"] and "kept_bytes" in memory["flash_greedy"]:
        def megabytes(count: int) -> str:  # a small shape's 0.05 MB had read "0.0 MB"
            return f"{count / 1e6:.1f}" if count >= 1e6 else f"{count / 1e6:.3f}"

        kept = f"flash_greedy keeps {megabytes(memory['flash_greedy']['kept_bytes'])} MB besides the embedding"
        if memory["flash_greedy_fp8"]:
            kept += f" ({megabytes(memory['flash_greedy_fp8']['kept_bytes'])} MB with fp8 centroids)"
        calls = [f"{impl} {row['call_bytes'] / 1e6:.3f} MB" for impl, row in memory.items()
                 if row and row.get("call_bytes") is not None]
        lines.append(f"  memory, {main_shape} B=1 p={probes}: {kept}"
                     + (f"; one eager call allocates: {', '.join(calls)}" if calls else ""))
    sweep = dict(shape=main_shape, probes=batch_probes, mode="graph")
    batch_rows = sorted({r["batch"] for r in rows if r["impl"] == "dense" and all(r.get(k) == v for k, v in sweep.items())})
    wins = [b for b in batch_rows
            if (d := pick(**sweep, batch=b, impl="dense"))
            and (f := pick(**sweep, batch=b, impl="flash_greedy")) and d["us"] <= f["us"]]
    if batch_rows:
        lines.append(f"  dense wins from batch: {wins[0] if wins else 'never up to ' + str(batch_rows[-1])}")
    if not greedy and not batch_rows:
        lines.append(f"  nothing to summarize: the summary is of graph replay (CUDA), and there is no graph-replayed "
                     f"{main_shape} point at B=1, p={probes} and no graph-replayed dense batch sweep")
    elif not greedy:  # a sweep without the summary's point (--probes and --batch-probes without 256)
        lines.append(f"  the summary's point, {main_shape} B=1 p={probes} graph-replayed, was not run (add {probes} to --probes)")
    return "\n".join(lines)
