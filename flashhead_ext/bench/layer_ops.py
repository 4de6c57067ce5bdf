"""``python -m flashhead_ext.bench layer-ops``: the decoder-layer ops alone, against torch, at model shapes.

Each op (and a whole layer) is captured ``--calls`` times in one CUDA graph and the replay is timed.
Each row rotates over enough copies of what its op reads (its weight; the whole layer's weights and
KV cache) that 256 MB pass between two uses of one copy, so every call streams them from memory as it
does inside a model. ``torch`` is the same computation with torch ops (the eager
decoder's: ``F.rms_norm``, ``F.linear``, ``F.silu``, a residual add; the whole layer is
:func:`flashhead_ext.fast.decoder._layer` with matmul attention over the whole cache). The floor
is the bytes an op must read (weights, or the cache up to the length for attention) over the
measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from .. import ops
from ..fast.decoder import Decoder, _fused_layer, _layer
from ..graphs import capture_graph
from .._cli import NO_CUDA_KERNELS, DefaultsHelpFormatter, output_file, positive_int, positive_int_list
from .._loader import build_info
from .spec import CONFIG_SHAPE_HELP, SHAPES, _write, cache_read_bytes, decoder_shape_list
from .timing import copy_bandwidth_gbs, format_table, run_metadata, time_calls

COLUMNS = [("shape", "shape", "s"), ("tokens", "M", "d"), ("op", "op", "s"), ("ours_us", "ours us", ".1f"),
           ("torch_us", "torch us", ".1f"), ("floor_us", "floor us", ".1f"), ("of_floor", "floor/ours", ".2f"),
           ("torch_over_ours", "torch/ours", ".2f")]
L2_DEFEAT_BYTES = 256 << 20
MAX_COPIES = 512  # SmolLM2's smallest matrix (576 x 576) needs 405; the tiny CLI-check shape's then fit in L2


def _timed_graph(calls, args) -> float:
    """Median µs per call of the ``calls`` (a list of closures, one per copy, cycled). A replay runs
    every copy at least once, so all the others pass between two uses of one."""
    count = max(args.calls, len(calls))

    def body():
        for i in range(count):
            calls[i % len(calls)]()

    graph = capture_graph(body)
    return time_calls(graph.replay, calls_per_sample=count, samples=args.samples, warmup=2)


def _rotated(tensors: dict, keys) -> list[dict]:
    """``tensors`` and copies of it, the tensors named ``keys`` cloned in each, enough that
    L2_DEFEAT_BYTES of them pass between two uses of one copy. Sized by what the row's op reads:
    sized by the whole layer, a small matrix's copies had fit in an H200's L2. At most MAX_COPIES."""
    nbytes = sum(tensors[key].numel() * tensors[key].element_size() for key in keys)
    return [tensors] + [{**tensors, **{key: tensors[key].clone() for key in keys}}
                        for _ in range(min(MAX_COPIES, math.ceil(L2_DEFEAT_BYTES / nbytes)) - 1)]


def _layer_rows(name: str, config, tokens: int, args, bandwidth: float) -> list[dict]:
    c = type(config)(**{**vars(config), "num_layers": 1})
    model = Decoder.random(c, max_len=args.context, dtype=torch.bfloat16, device="cuda")
    w = model.layers[0]
    layer_bytes = sum(t.numel() * t.element_size() for t in w.values())
    gen = torch.Generator("cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)

    x = rand(tokens, c.hidden_size)
    o = rand(tokens, c.num_heads * c.head_dim)
    gate_up = rand(tokens, 2 * c.intermediate_size)
    eps = c.rms_norm_eps
    gemvs = {
        "qkv: norm+linear": (lambda w: ops.fused_linear(x, w["qkv"], norm_weight=w["attn_norm"], eps=eps,
                                                        static_weight=True),
                             lambda w: F.linear(F.rms_norm(x, (c.hidden_size,), w["attn_norm"], eps), w["qkv"]), "qkv"),
        "o: linear+residual": (lambda w: ops.fused_linear(o, w["o"], residual=x, static_weight=True),
                               lambda w: x + F.linear(o, w["o"]), "o"),
        "gate_up: norm+linear": (lambda w: ops.fused_linear(x, w["gate_up"], norm_weight=w["mlp_norm"], eps=eps,
                                                            static_weight=True),
                                 lambda w: F.linear(F.rms_norm(x, (c.hidden_size,), w["mlp_norm"], eps), w["gate_up"]),
                                 "gate_up"),
        "down: silu gate+linear+residual": (
            lambda w: ops.fused_linear(gate_up, w["down"], gated=True, residual=x, static_weight=True),
            lambda w: x + F.linear(F.silu(gate_up[:, :c.intermediate_size]) * gate_up[:, c.intermediate_size:], w["down"]),
            "down"),
    }
    rows = []
    for op, (ours, reference, key) in gemvs.items():
        floor = w[key].numel() * w[key].element_size() / (bandwidth * 1e3)
        weights = _rotated(w, [key])
        rows.append(dict(op=op, floor_us=floor, ours_us=_timed_graph([lambda w=w: ours(w) for w in weights], args),
                         torch_us=_timed_graph([lambda w=w: reference(w) for w in weights], args)))
        del weights

    # The whole layer at the last positions of the cache (the fused body's most expensive step).
    model.reset(args.context - tokens)
    pos, cos, sin, mask = model.step_inputs(tokens, model.length)
    cache_bytes = cache_read_bytes(model, args.context)  # model has the one layer
    # The cache rotates with the weights: one shared cache stayed in L2 while the floor counts it read.
    layers = _rotated(dict(w, k_cache=model.k_cache[0], v_cache=model.v_cache[0]), [*w, "k_cache", "v_cache"])
    rows.append(dict(
        op="layer (fused ops vs eager torch)", floor_us=(layer_bytes + cache_bytes) / (bandwidth * 1e3),
        ours_us=_timed_graph([lambda w=w: _fused_layer(x, w, w["k_cache"], w["v_cache"], model.length, model._cos,
                                                       model._sin, c.num_heads, eps, c.softmax_scale) for w in layers], args),
        torch_us=_timed_graph([lambda w=w: _layer(x, w, w["k_cache"], w["v_cache"], pos, cos, sin, mask, c.num_heads,
                                                  c.num_kv_heads, c.head_dim, eps, c.softmax_scale, c.hidden_act,
                                                  "matmul") for w in layers], args)))
    for row in rows:
        row.update(shape=name, tokens=tokens, of_floor=row["floor_us"] / row["ours_us"],
                   torch_over_ours=row["torch_us"] / row["ours_us"])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashhead_ext.bench layer-ops",
                                     description="Decoder-layer ops (fused_linear, a whole fused layer) vs torch, bf16, graph-replayed.",
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-0.6b,gemma3-270m-llama,smollm2-early-exit-8,qwen3-32b",
                        help=f"comma list of {sorted(SHAPES)} or {CONFIG_SHAPE_HELP}; the fused ops run a Llama, "
                             "Granite, Qwen2 or Qwen3 layer without sliding windows, not Gemma-2's or Gemma-3's own "
                             "(gemma3-270m-llama has Gemma-3-270M's sizes in a Llama layer)")
    parser.add_argument("--tokens", type=positive_int_list, default="1,8", help="comma list of tokens per call (M)")
    parser.add_argument("--context", type=positive_int, default=1024, help="cache length (max_len); the layer row attends to all of it")
    parser.add_argument("--samples", type=positive_int, default=20, help="timed samples (the median is reported)")
    parser.add_argument("--calls", type=positive_int, default=32, help="calls per graph replay")
    parser.add_argument("--json", type=output_file, default="results/bench_layer_ops.json",
                        help="where the result JSON is written")
    args = parser.parse_args(argv)
    shapes, configs = decoder_shape_list(parser, "--shapes", args.shapes, {"--json": args.json})
    for name, config in zip(shapes, configs):
        # The rows time the fused ops, the Llama / Qwen layer: a gemma2-* or gemma3-* shape's own layer
        # failed building its one-layer model, and its sliding window set a floor its attention does not keep.
        limit = config.body_limit("fused", torch.bfloat16)
        if limit:
            hint = "; gemma3-270m-llama has Gemma-3-270M's sizes in a Llama layer" if name.startswith("gemma3-") else ""
            parser.error(f"--shapes {name}: the fused body (these ops) {limit}{hint}")
    tokens = args.tokens
    if max(tokens) > args.context:  # else a traceback after the first shape's GEMV rows were timed
        parser.error(f"--tokens {max(tokens)} exceeds --context {args.context}: a call's tokens must fit in the cache")
    if not torch.cuda.is_available():
        parser.error("layer-ops times CUDA kernels and needs a GPU")
    if not build_info().WITH_CUDA:
        parser.error(f"layer-ops times {NO_CUDA_KERNELS}")
    started = run_metadata("cuda")  # the code and date the run started with
    bandwidth = copy_bandwidth_gbs()
    rows = [row for name, config in zip(shapes, configs) for m in tokens for row in _layer_rows(name, config, m, args, bandwidth)]
    print(f"decoder-layer ops, bf16, CUDA graph replay, weights rotated past L2, context {args.context}, "
          f"copy bandwidth {bandwidth:.0f} GB/s")
    print(format_table(rows, COLUMNS))
    _write(args.json, dict(meta=dict(started, copy_bandwidth_gbs=bandwidth, args=vars(args)), rows=rows))
    return 0
