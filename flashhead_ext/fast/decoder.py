"""An in-library Llama / Mistral / Ministral / Phi-3 / Granite / Qwen2 / Qwen3 / Gemma-2 / Gemma-3 decoder
with a static KV cache, for fixed-shape, graph-capturable steps.

transformers' own decode step costs tens of milliseconds of host time per token on a GPU, and its
static cache did not survive CUDA-graph capture (issue 6). This decoder holds the same weights in a
few fused matrices and runs ``forward(ids)`` over ``n`` new tokens with shapes that depend on ``n``
and ``max_len`` only: the cache length is a device tensor, the attention mask and the rotary
positions are derived from it on the device, so a forward never reads anything back to the host and
can be captured once and replayed. Rolling the cache back is setting that length; the entries beyond
it are simply overwritten later.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import re
import warnings
from dataclasses import dataclass, fields as dataclass_fields, replace
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import ops
from ..hf import check_plain_output_head, greedy_logit_settings, prompt_learning_kind, uncompiled

if TYPE_CHECKING:  # transformers is imported only when used
    from transformers import PretrainedConfig, PreTrainedModel

# SmolLM2 is a Llama; Mistral a Llama whose layers may all attend to a sliding window (Ministral:
# the layers its layer_types name; Phi-3 a Mistral with q/k/v and gate/up stored fused); Granite a
# Llama with multipliers on the embeddings, the residual branches, the softmax and the logits; Qwen2
# (and 2.5) adds biases to q, k and v; Qwen3 RMSNorm on q and k; Gemma-3 (text) also GELU, norms on
# the attention's and the MLP's outputs, scaled embeddings and sliding-window layers with their own
# rotary frequencies; Gemma-2 is Gemma-3 without the q/k norms or the sliding layers' own rotary,
# with caps on the attention scores and the logits.
SUPPORTED = ("llama", "mistral", "ministral", "phi3", "granite", "qwen2", "qwen3", "gemma2", "gemma3_text")
# Their families as messages and help texts name them (one string, so that none of them lags).
FAMILY_NAMES = "Llama/Mistral/Ministral/Phi-3/Granite/Qwen2/Qwen3/Gemma-2/Gemma-3"
# Rotary types whose frequencies transformers computes once (the decoder builds its tables from
# them); "dynamic" and "longrope" change them with the sequence length.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# "sdpa": torch's fused attention; "matmul": baddbmm + softmax + bmm, more parallel for a few
# query rows over a long cache (docs/benchmarks.md, issue 6, compares them). SDPA cannot cap the
# scores, so a model with attn_logit_softcapping (Gemma-2) runs the matmul path either way.
ATTENTION = ("sdpa", "matmul")
# The MLP's gate activation: transformers' "silu" and "gelu_pytorch_tanh".
ACTIVATIONS = ("silu", "gelu_tanh")
# The weights' dtypes the eager and compiled bodies run (the kernel bodies: the first three).
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SOFTCAPS = ("attn_logit_softcapping", "final_logit_softcapping")
# Factors the layers apply in float32 (the kernels take them so): each must stay positive and finite there.
# The value is what None means for the field, where it may be None.
FLOAT32_FACTORS = {"rope_attention_scaling": None, "sliding_rope_attention_scaling": None, "embed_scale": None,
                   "attention_scale": "1 / sqrt(head_dim)", "logits_scaling": None, **dict.fromkeys(SOFTCAPS, "no cap")}


def _finite_positive(value) -> bool:
    return ops._is_number(value) and math.isfinite(value) and value > 0


def _positive_in_float32(value) -> bool:
    """A number that is positive and finite as a float32: one that rounds to 0 or overflows there
    (1e-50, 1e39) would make a kernel's products 0, inf or NaN."""
    return _finite_positive(value) and 0 < torch.tensor(float(value), dtype=torch.float32, device="cpu").item() < math.inf


def _check_float32_factor(name: str, value, none_means: Optional[str] = None) -> None:
    if value is None and none_means is not None:
        return
    if not _positive_in_float32(value):
        allowed = f"None ({none_means}) or " if none_means is not None else ""
        raise ValueError(f"{name} must be {allowed}a positive number finite in float32, got {value!r}")


def _require_dtype(dtype) -> None:
    # A string would reach Tensor.to(), which reads it as a device.
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (one of {MODEL_DTYPES}), got {type(dtype).__name__} {dtype!r}")


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    # A scaled RoPE (rope_type linear, llama3, yarn): its head_dim / 2 inverse frequencies and the
    # factor on cos and sin, as transformers computes them; None: rope_theta's default frequencies.
    rope_inv_freq: Optional[tuple] = None
    rope_attention_scaling: float = 1.0
    hidden_act: str = "silu"
    # Biases on the q, k and v projections (Qwen2).
    qkv_bias: bool = False
    # RMSNorms on the attention's and on the MLP's output before each residual add (Gemma-3).
    post_norms: bool = False
    # Embedding rows are multiplied by this (Gemma-3: sqrt(hidden_size), Granite: embedding_multiplier),
    # rounded to the model dtype first where transformers holds it in a buffer of that dtype (Gemma-3)
    # and taken as float32 where it multiplies by the float itself (Granite).
    embed_scale: float = 1.0
    embed_scale_in_model_dtype: bool = True
    # The attention's softmax scale; None: 1 / sqrt(head_dim) (Gemma-3: query_pre_attn_scalar ** -0.5).
    attention_scale: Optional[float] = None
    # Layers that attend to the last sliding_window positions only (a query sees keys pos - W < k <= pos),
    # with their own rotary frequencies and factor (None: the other layers').
    sliding_window: Optional[int] = None
    sliding_layers: tuple = ()
    sliding_rope_inv_freq: Optional[tuple] = None
    sliding_rope_attention_scaling: float = 1.0
    # The logits are the head's products divided by this (Granite's logits_scaling). Granite's
    # residual_multiplier has no field: from_state_dict folds it into the o and down weights.
    logits_scaling: float = 1.0
    # Gemma-2's caps, cap * tanh(x / cap), on the attention scores after the softmax scale and on the
    # logits; None: no cap. The logits' cap is monotonic, so it changes no argmax but where its
    # rounding or tanh's saturation makes logits that differed equal (in any dtype).
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None

    def __post_init__(self):
        for field in dataclass_fields(self):
            value = getattr(self, field.name)
            # A numpy float (a transformers config may hold one) stored as the Python float the ops take.
            if field.type in ("float", "Optional[float]") and isinstance(value, numbers.Real) and not isinstance(value, bool):
                try:
                    object.__setattr__(self, field.name, float(value))
                except OverflowError:
                    raise ValueError(f"{field.name} must be a float, got an int of {value.bit_length()} bits, too large "
                                     "for one") from None
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not ops._is_int(value) or not 1 <= value < 2**63:
                raise ValueError(f"{name} must be an int in 1..2**63 - 1, got {value!r:.40}")
        for name in ("qk_norm", "tie_word_embeddings", "qkv_bias", "post_norms", "embed_scale_in_model_dtype"):
            if not isinstance(getattr(self, name), bool):  # else a string "False" reads as true
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for prefix in ("", "sliding_"):
            freqs = getattr(self, f"{prefix}rope_inv_freq")
            if freqs is not None and (not isinstance(freqs, tuple) or len(freqs) != self.head_dim // 2 or not all(
                    isinstance(f, float) and _positive_in_float32(f) for f in freqs)):
                raise ValueError(f"{prefix}rope_inv_freq must be None or a tuple of head_dim / 2 = {self.head_dim // 2} "
                                 f"floats positive and finite in float32, got {freqs!r:.80}")
        if not _finite_positive(self.rope_theta):
            raise ValueError(f"rope_theta must be a finite positive float, got {self.rope_theta!r}")
        for name, none_means in FLOAT32_FACTORS.items():
            _check_float32_factor(name, getattr(self, name), none_means)
        # 0 is allowed, as by torch's rms_norm and the layer kernels: a state of zeros then normalises to NaN.
        if not ops._is_number(self.rms_norm_eps) or not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps >= 0):
            raise ValueError(f"rms_norm_eps must be a finite float >= 0, got {self.rms_norm_eps!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        layers = self.sliding_layers
        if not isinstance(layers, tuple) or len(set(layers)) != len(layers) or not all(
                ops._is_int(i) and 0 <= i < self.num_layers for i in layers):
            raise ValueError(f"sliding_layers must be a tuple of distinct layer indices in 0..{self.num_layers - 1}, "
                             f"got {layers!r:.80}")
        window = self.sliding_window
        if (layers or window is not None) and (not ops._is_int(window)
                                               or not 1 <= window < 2**63):
            raise ValueError(f"sliding_window must be an int in 1..2**63 - 1 (None where no layer slides), got {window!r}")
        # Sliding settings without sliding layers would apply to none: refused, not ignored.
        unused = [name for name, present in (("sliding_window", window is not None),
                                             ("sliding_rope_inv_freq", self.sliding_rope_inv_freq is not None)) if present]
        if unused and not layers:
            raise ValueError(f"{' and '.join(unused)} set, but sliding_layers names no layer for them")
        if self.sliding_rope_inv_freq is None and self.sliding_rope_attention_scaling != 1.0:
            raise ValueError(f"sliding_rope_attention_scaling is {self.sliding_rope_attention_scaling!r}, but it scales "
                             "sliding_rope_inv_freq's tables only, and that is None (the sliding layers rotate as the others)")

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.attention_scale is None else float(self.attention_scale)

    @classmethod
    def from_hf(cls, config: PretrainedConfig, num_layers: Optional[int] = None) -> "DecoderConfig":
        """From a transformers LlamaConfig / MistralConfig / MinistralConfig / Phi3Config / GraniteConfig /
        Qwen2Config / Qwen3Config / Gemma2Config / Gemma3TextConfig; ``num_layers`` keeps only the first layers.
        A Granite config's ``residual_multiplier`` is not a field: :meth:`Decoder.from_state_dict`
        folds it into the o and down weights, so weights given to ``Decoder`` directly must hold it."""
        if isinstance(config, Mapping):  # a config.json read as a dict: its model_type would read as missing
            raise TypeError("config must be a transformers config object (model.config, AutoConfig.from_pretrained(...)), "
                            "got a dict: AutoConfig.for_model(**config_dict) makes one")
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED:
            raise ValueError(f"config must be a {', '.join(SUPPORTED)} config (the fast decoder's family), "
                             f"got model_type {model_type!r}")
        gemma = model_type in ("gemma2", "gemma3_text")
        act_key, act = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
        if getattr(config, act_key, act) != act:
            raise ValueError(f"config.{act_key} must be {act!r}, got {getattr(config, act_key)!r}")
        # transformers' Mistral, Ministral and Phi-3 build no biases whatever these flags say, and
        # Qwen2 its q/k/v biases (which the decoder applies) and no others.
        biased = [] if model_type in ("mistral", "ministral", "phi3", "qwen2") else [
            name for name in ("attention_bias", "mlp_bias") if getattr(config, name, False)]
        if biased:
            raise ValueError(f"config.{' and config.'.join(biased)} set: attention or MLP biases, which the fast "
                             "decoder does not implement")
        # transformers' Gemma-3 attention (5.24) keeps attn_logit_softcapping but does not apply it:
        # refused, as the two could disagree.
        refused = ["use_bidirectional_attention"] + (["attn_logit_softcapping"] if model_type == "gemma3_text" else [])
        for name in refused:
            if getattr(config, name, None):
                raise ValueError(f"config.{name} is set ({getattr(config, name)!r}), which the fast decoder does not "
                                 f"implement for {model_type}")
        layers = config.num_hidden_layers
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if model_type in ("llama", "granite", "mistral", "phi3"):
            # transformers' Llama, Granite, Mistral and Phi-3 ignore any layer_types a config carries:
            # Mistral and Phi-3 mask every layer to their sliding window when they have one, Llama and
            # Granite none (Ministral is the alternating kind).
            window = config.sliding_window if model_type in ("mistral", "phi3") else None
            layer_types = ["full_attention" if window is None else "sliding_attention"] * layers
        else:
            layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)[:layers]
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"config.layer_types has {unknown}; the fast decoder runs full_attention and "
                             "sliding_attention layers")
        sliding = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
        fields = dict(sliding_window=config.sliding_window, sliding_layers=sliding) if sliding else {}
        if gemma:
            scalar = getattr(config, "query_pre_attn_scalar", None)
            if not _finite_positive(scalar):
                raise ValueError(f"config.query_pre_attn_scalar must be a finite positive number (the softmax scale "
                                 f"is its -1/2 power), got {scalar!r}")
            fields.update(hidden_act="gelu_tanh", post_norms=True, embed_scale=float(config.hidden_size ** 0.5),
                          attention_scale=float(scalar) ** -0.5)
            for name in SOFTCAPS:  # None in Gemma-3's published configs
                value = getattr(config, name, None) if name not in refused else None
                _check_float32_factor(f"config.{name}", value, FLOAT32_FACTORS[name])
                fields[name] = None if value is None else float(value)
        if model_type == "gemma3_text":
            theta, inv_freq, attention_scaling = _rope_from_hf(config, head_dim, "full_attention")
            if sliding:  # Gemma-3's sliding layers rotate by their own base
                _, fields["sliding_rope_inv_freq"], fields["sliding_rope_attention_scaling"] = _rope_from_hf(
                    config, head_dim, "sliding_attention")
        else:
            theta, inv_freq, attention_scaling = _rope_from_hf(config, head_dim)
        if model_type == "granite":
            for name in ("embedding_multiplier", "attention_multiplier", "logits_scaling"):
                # Checked here, else the error would name the field it becomes.
                _check_float32_factor(f"config.{name}", getattr(config, name))
            fields.update(embed_scale=float(config.embedding_multiplier), embed_scale_in_model_dtype=False,
                          attention_scale=float(config.attention_multiplier), logits_scaling=float(config.logits_scaling))
        full = cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_layers=layers, num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim, rms_norm_eps=config.rms_norm_eps,
            rope_theta=theta, qk_norm=model_type in ("qwen3", "gemma3_text"), qkv_bias=model_type == "qwen2",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            rope_inv_freq=inv_freq, rope_attention_scaling=attention_scaling, **fields,
        )
        return full if num_layers is None else full.first_layers(num_layers)

    def body_limit(self, body: str, dtype: torch.dtype) -> Optional[str]:
        """Why ``body`` cannot run this model in ``dtype``, or None: the fused and persistent bodies
        (flashhead's layer kernels) take float16, bfloat16 and float32; the fused ops run the Llama /
        Qwen layer."""
        if body not in ("fused", "persistent"):
            return None
        if dtype not in MODEL_DTYPES[:3]:
            return f"needs a float16, bfloat16 or float32 model, this one is {dtype}"
        if self.num_heads > ops.NUM_HEADS_MAX:
            return f"takes up to {ops.NUM_HEADS_MAX} query heads (the layer kernels' bound), this model has {self.num_heads}"
        if self.softmax_scale > ops.ATTENTION_SCALE_MAX:
            return (f"takes an attention_scale up to {ops.ATTENTION_SCALE_MAX:g} (the layer kernels' bound), this model's "
                    f"is {self.softmax_scale:g}")
        beyond = [what for what, present in (("GELU", self.hidden_act != "silu"), ("post-norms", self.post_norms),
                                             ("sliding-window layers", bool(self.sliding_layers)),
                                             ("capped attention scores", self.attn_logit_softcapping is not None))
                  if present]
        if body == "fused" and beyond:
            return (f"runs the Llama / Qwen layer; this model's {', '.join(beyond)} run on the 'eager', 'compiled' or "
                    "'persistent' body")
        return None

    def first_layers(self, num_layers: int) -> "DecoderConfig":
        """The model of this one's first ``num_layers`` layers (an early-exit draft, a shorter target)."""
        if not ops._is_int(num_layers) or not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"num_layers must be an int in 1..{self.num_layers} (the model's layers), got {num_layers!r}")
        sliding = tuple(i for i in self.sliding_layers if i < num_layers)
        if sliding:
            return replace(self, num_layers=num_layers, sliding_layers=sliding)
        return replace(self, num_layers=num_layers, sliding_layers=(), sliding_window=None, sliding_rope_inv_freq=None,
                       sliding_rope_attention_scaling=1.0)


def _rope_from_hf(config, head_dim: int, layer_type: Optional[str] = None) -> tuple[float, Optional[tuple], float]:
    """The rotary base, frequencies (None: the base's default ones) and cos/sin factor of ``config``
    (of its ``layer_type``'s layers, for a config with rotary parameters per layer type)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None:
        rope = dict(rope.get(layer_type) or {})
    where = "config's" if layer_type is None else f"config's {layer_type}"
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where} rope_type {rope_type!r} is not implemented by the fast decoder (one of {ROPE_TYPES}: "
                         "frequencies that do not change with the sequence length)")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where} partial_rotary_factor is {rope['partial_rotary_factor']}; the fast decoder rotates "
                         "the whole head (1.0)")
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    if rope_type == "default":
        # A per-type default is not the config's rope_theta: its frequencies are spelled out.
        return theta, None if layer_type is None else tuple(float(f) for f in _default_inv_freq(theta, head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # transformers' own function: the model's frequencies and factor, not a copy of its formulas.
    kwargs = {} if layer_type is None else dict(layer_type=layer_type)
    freqs, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return theta, tuple(float(f) for f in freqs.float()), float(attention_scaling)


def _default_inv_freq(theta: float, head_dim: int) -> Tensor:
    """RoPE's default inverse frequencies, computed as transformers computes them (float32)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))


def _require_config(config) -> None:
    if not isinstance(config, DecoderConfig):  # else an AttributeError from deep inside
        raise TypeError(f"config must be a flashhead_ext.fast.DecoderConfig (DecoderConfig.from_hf converts a transformers "
                        f"config), got {type(config).__name__}")


def _layer_shapes(c: DecoderConfig) -> dict:
    """Each stacked layer weight's shape ``[num_layers, ...]`` in the fused layout, for this config."""
    n, d, hd = c.num_layers, c.hidden_size, c.head_dim
    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * hd
    shapes = dict(qkv=(n, qkv_rows, d), o=(n, d, c.num_heads * hd), gate_up=(n, 2 * c.intermediate_size, d),
                  down=(n, d, c.intermediate_size), attn_norm=(n, d), mlp_norm=(n, d))
    if c.qk_norm:
        shapes.update(q_norm=(n, hd), k_norm=(n, hd))
    if c.qkv_bias:
        shapes.update(qkv_bias=(n, qkv_rows))
    if c.post_norms:
        shapes.update(post_attn_norm=(n, d), post_mlp_norm=(n, d))
    return shapes


def _check_weights(c: DecoderConfig, weights: Mapping[str, Any]) -> None:
    """ValueError unless ``weights['layers']`` holds the kinds the config names (the layer applies
    the biases and norms it finds, so the two must agree), then naming the first weight whose
    shape, dtype or device is not the config's and the embedding's: the fused kernels index them by
    the config's sizes, and a mismatch would read out of bounds or give a silently wrong model."""
    keys = ("embed", "lm_head", "final_norm", "layers")
    if not isinstance(weights, Mapping) or not isinstance(weights.get("layers"), Mapping) or any(
            key not in weights for key in keys):
        layers = type(weights.get("layers")).__name__ if isinstance(weights, Mapping) else None
        raise TypeError(f"weights must be a mapping with keys {list(keys)}, 'layers' a mapping of stacked layer "
                        f"weights; got {type(weights).__name__}" + (f" with keys {sorted(weights)}, 'layers' a {layers}"
                                                                    if layers is not None else ""))
    layer_shapes = _layer_shapes(c)
    if set(weights["layers"]) != set(layer_shapes):
        raise ValueError(f"weights['layers'] must hold {sorted(layer_shapes)} for this config (qk_norm={c.qk_norm}, "
                         f"qkv_bias={c.qkv_bias}, post_norms={c.post_norms}), got {sorted(weights['layers'])}")
    embed = weights["embed"]
    expected = dict(embed=(c.vocab_size, c.hidden_size), lm_head=(c.vocab_size, c.hidden_size), final_norm=(c.hidden_size,))
    named = [(name, weights[name], shape) for name, shape in expected.items()]
    named += [(f"layers[{name!r}]", weights["layers"][name], shape) for name, shape in layer_shapes.items()]
    for name, weight, shape in named:
        if not isinstance(weight, Tensor):
            raise TypeError(f"weights {name} must be a torch.Tensor {list(shape)}, got {type(weight).__name__}")
        if tuple(weight.shape) != shape or weight.dtype != embed.dtype or weight.device != embed.device:
            raise ValueError(f"weights {name} must be {embed.dtype} {list(shape)} on {embed.device} (the config's sizes, "
                             f"the embedding's dtype and device), got {weight.dtype} {list(weight.shape)} on {weight.device}")


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # One fused kernel that normalises in float32 (transformers also scales in float32, then
    # rounds once more: a last-bit difference in bf16, none in float32).
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat([-x[..., half:], x[..., :half]], dim=-1), sin)


def _layer(x: Tensor, w: dict, k_cache: Tensor, v_cache: Tensor, pos: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
           num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float, act: str, attention: str,
           softcap: Optional[float] = None) -> Tensor:
    """One decoder layer over ``n`` tokens at positions ``pos``; writes their K/V into the layer's
    cache. ``mask`` is additive over the whole cache (a sliding-window layer's hides the old keys);
    ``softcap`` caps the scaled scores before it, as transformers' Gemma-2 does, op by op."""
    n, kv, hd = x.shape[0], num_kv_heads, head_dim
    group = num_heads // kv
    h = _rms_norm(x, w["attn_norm"], eps)
    q, k, v = F.linear(h, w["qkv"], w.get("qkv_bias")).split([num_heads * hd, kv * hd, kv * hd], dim=-1)
    q, k, v = q.view(n, num_heads, hd), k.view(n, kv, hd), v.view(n, kv, hd)
    if "q_norm" in w:
        q, k = _rms_norm(q, w["q_norm"], eps), _rms_norm(k, w["k_norm"], eps)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k_cache.index_copy_(1, pos, k.transpose(0, 1))
    v_cache.index_copy_(1, pos, v.transpose(0, 1))
    # The query heads sharing a KV head are folded into the query rows (row g*n+i: head g of the
    # group, token i), so attention reads each cached KV head once.
    q = q.view(n, kv, group, hd).permute(1, 2, 0, 3).reshape(kv, group * n, hd)
    if softcap is not None:
        scores = torch.tanh(torch.bmm(q, k_cache.transpose(1, 2)) * scale / softcap) * softcap + mask
        o = torch.bmm(scores.softmax(dim=-1, dtype=torch.float32).to(x.dtype), v_cache)
    elif attention == "sdpa":
        o = F.scaled_dot_product_attention(q[None], k_cache[None], v_cache[None], attn_mask=mask, scale=scale)
    else:
        scores = torch.baddbmm(mask, q, k_cache.transpose(1, 2), alpha=scale)
        o = torch.bmm(scores.softmax(dim=-1, dtype=torch.float32).to(x.dtype), v_cache)
    o = F.linear(o.view(kv, group, n, hd).permute(2, 0, 1, 3).reshape(n, num_heads * hd), w["o"])
    x = x + (_rms_norm(o, w["post_attn_norm"], eps) if "post_attn_norm" in w else o)
    gate, up = F.linear(_rms_norm(x, w["mlp_norm"], eps), w["gate_up"]).chunk(2, dim=-1)
    gate = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    down = F.linear(gate * up, w["down"])
    return x + (_rms_norm(down, w["post_mlp_norm"], eps) if "post_mlp_norm" in w else down)


def _fused_layer(x: Tensor, w: dict, k_cache: Tensor, v_cache: Tensor, length: Tensor, cos: Tensor, sin: Tensor,
                 num_heads: int, eps: float, scale: float) -> Tensor:
    """``_layer`` as six flashhead ops (seven CUDA kernels): the norms, gate and residual adds ride
    in the GEMVs, rotary and the cache write are one kernel, attention reads only the cache up to
    ``length``. ``cos`` / ``sin`` are the whole tables: the ops index them by ``length``."""
    # The layer's weights are never written by the kernel before a projection.
    qkv = ops.fused_linear(x, w["qkv"], norm_weight=w["attn_norm"], eps=eps, bias=w.get("qkv_bias"),
                           static_weight=True)
    q = ops.rotary_cache_write(qkv, cos, sin, length, k_cache, v_cache, num_heads,
                               q_norm=w.get("q_norm"), k_norm=w.get("k_norm"), eps=eps)
    o = ops.decode_attention(q, k_cache, v_cache, length, scale)
    x = ops.fused_linear(o, w["o"], residual=x, static_weight=True)
    gate_up = ops.fused_linear(x, w["gate_up"], norm_weight=w["mlp_norm"], eps=eps, static_weight=True)
    return ops.fused_linear(gate_up, w["down"], gated=True, residual=x, static_weight=True)


# How a forward of at most STEP_MAX_TOKENS tokens (draft steps, verify batches, and prefills of
# prompts that short) runs its layers: "eager" the torch ops of ``_layer``, "compiled" ``_layer``
# through torch.compile, "fused" the flashhead decoder-layer ops, "persistent" one-token forwards
# as the single flashhead ``decoder_step`` (every layer in one kernel) and other short ones as
# "fused" (a model the fused ops cannot run, such as Gemma-3: one ``decoder_step`` a token).
# Longer forwards (prefills of longer prompts, whose length varies) always run eager.
BODIES = ("eager", "compiled", "fused", "persistent")
KERNEL_BODIES = ("fused", "persistent")  # those that run flashhead ops (a CPU-only build has no CUDA ones)
STEP_MAX_TOKENS = 16
# Graphs dynamo may keep for the compiled layer: one per token count and model shape. Its default of
# 8 per function is soon passed by a target and a draft with a few short prompt lengths, and a
# fullgraph compile past it raises.
COMPILED_GRAPHS = 256
_compiled_layer = None


def _get_compiled_layer():
    """``_layer`` through torch.compile (inductor fuses the norms, rotary, cache writes and residual
    adds around the matrix products); compiled once per token count and model shape, shared by
    every layer since only the weights differ."""
    global _compiled_layer
    if _compiled_layer is None:
        _compiled_layer = torch.compile(_layer, fullgraph=True, dynamic=False)
    return _compiled_layer


def _compiled_graphs_allowed():
    """A context in which dynamo keeps up to COMPILED_GRAPHS graphs of a function (the limit is read
    when a call compiles)."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # torch < 2.7
    return config.patch(**{name: COMPILED_GRAPHS})


def _require_max_len(max_len) -> None:
    if not ops._is_int(max_len) or not 1 <= max_len < 2**63:
        raise ValueError(f"max_len must be an int in 1..2**63 - 1, got {max_len!r}")


def _require_state_tensor(key: str, weight, shape: tuple) -> None:
    """A TypeError naming ``key`` where the state dict's ``weight`` is no tensor (a numpy array, a list)."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"state_dict's {key!r} must be a torch.Tensor {list(shape)}, got {type(weight).__name__}")


def _refuse_meta(key: str, weight) -> None:
    """A ValueError where the state dict's ``weight`` is on the meta device: torch's "Cannot copy out of
    meta tensor" named nothing."""
    if isinstance(weight, Tensor) and weight.is_meta:
        raise ValueError(f"state_dict's {key!r} is on the meta device, which holds no values (weights offloaded by "
                         "accelerate, or a model built under init_empty_weights): the Decoder copies the weights, so "
                         "load them first")


def _refuse_unread_weights(state_dict: Mapping[str, Tensor], read: set, prefix: str, config: DecoderConfig,
                           model_type: str) -> None:
    """ValueError for weights of the built layers, the final norm or the head that the config left
    unread: another model's config (a Llama config over Qwen3's q/k norms or Qwen2's biases)
    would otherwise build a wrong model without a word. Layers past an early exit may stay."""
    layer = re.compile(rf"{re.escape(prefix)}layers\.(\d+)\.")
    unread = []
    for key in state_dict:
        if key in read or key.endswith("rotary_emb.inv_freq"):  # a buffer older transformers saved
            continue
        built_layer = (match := layer.match(key)) is not None and int(match.group(1)) < config.num_layers
        if built_layer or key.startswith((f"{prefix}norm.", "lm_head.")):
            unread.append(key)
    tied_head = state_dict.get("lm_head.weight")
    if config.tie_word_embeddings and tied_head is not None:  # never read: the head is the embedding
        unread.remove("lm_head.weight")
        embed = state_dict[f"{prefix}embed_tokens.weight"]
        if tied_head.shape != embed.shape or not torch.equal(tied_head, embed.to(tied_head.device, tied_head.dtype)):
            raise ValueError("the config ties the head to the input embedding (tie_word_embeddings=True) but state_dict's "
                             "'lm_head.weight' differs from it: another model's config?")
    if unread:
        raise ValueError(f"state_dict holds weights a {model_type} config with these settings does not use, e.g. "
                         f"{sorted(unread)[:4]}: another model's config? (Qwen3's q/k norms, Qwen2's biases and Gemma-3's "
                         "norms each need their own config)")


class Decoder:
    """Weights and a static KV cache of a Llama / Mistral / Ministral / Phi-3 / Granite / Qwen2 / Qwen3 /
    Gemma-2 / Gemma-3 decoder, on one device, in one dtype.

    ``forward(ids)`` runs ``ids`` (int64 ``[n]``, on the device) at positions ``length .. length+n-1``,
    writes their K/V entries there and returns the final-normed hidden states ``[n, D]``; it does
    not move ``length`` (an int64 0-d device tensor): callers advance or cut it back. ``logits``
    and ``argmax`` apply the model's own (dense) output head.

    ``body`` picks how forwards of at most ``STEP_MAX_TOKENS`` tokens run, a short prompt's prefill
    included (see ``BODIES``): ``"compiled"`` a torch.compile'd layer (the first call of each token
    count compiles, tens of seconds), ``"fused"`` flashhead's decoder-layer ops (float16 /
    bfloat16 / float32; on a GPU, bandwidth-bound GEMVs with the norms fused in), ``"persistent"``
    one-token steps as one kernel for all layers (docs/benchmarks.md compares them). The fused body
    runs the Llama / Qwen2 / Qwen3 layer; a Gemma model, or one with sliding-window layers, runs
    eager, compiled or persistent (``bodies``). Sliding-window layers keep every position in their
    cache and mask the old ones.

    Layout: per layer the q/k/v projections are one ``[(H + 2 KV) hd, D]`` matrix and gate/up one
    ``[2 I, D]`` matrix (fewer, larger GEMVs); each kind of weight is one tensor stacked over the
    layers (``stacked``, what ``decoder_step`` reads), and ``layers[i]`` holds views of layer i.
    The cache is ``[layers, KV, max_len, hd]`` for K and for V: heads before positions, so a
    layer's slice is SDPA's ``[batch=1, heads, keys, hd]`` without a copy.
    """

    def __init__(self, config: DecoderConfig, weights: Mapping[str, Any], *, max_len: int):
        _require_config(config)
        _require_max_len(max_len)
        _check_weights(config, weights)
        self.config = config
        # The model's EOS id(s) as transformers gives them (None, an int or ints): FastSpeculativeDecoder's
        # default, as SpeculativeDecoder's is the model's generation_config.eos_token_id.
        self.eos_token_id: Union[int, list[int], None] = None
        self.generation_settings: dict[str, Any] = {}  # from_hf: what the model's generate() would apply to its logits
        # Detached: parameters given here would make every cache write part of an autograd graph,
        # which each forward outside no_grad would extend, keeping every step's activations.
        self.embed: Tensor = weights["embed"].detach()
        self.lm_head: Tensor = self.embed if weights["lm_head"] is weights["embed"] else weights["lm_head"].detach()
        self.final_norm: Tensor = weights["final_norm"].detach()
        self.stacked = {name: w.detach() for name, w in weights["layers"].items()}
        self.layers = [{name: w[i] for name, w in self.stacked.items()} for i in range(config.num_layers)]
        self.dtype, self.device = self.embed.dtype, self.embed.device
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"the model's dtype (its weights') must be one of {MODEL_DTYPES}, got {self.dtype}")
        self.max_len = max_len
        self.attention = "sdpa"
        self._persistent_refusal: Optional[str] = None  # _cuda_step_limit's answer, once asked
        self.body = "eager"
        c = config
        shape = (c.num_layers, c.num_kv_heads, max_len, c.head_dim)
        with torch.inference_mode(False):  # written in place: built in inference mode, they refused that outside it
            self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.length = torch.zeros((), dtype=torch.int64, device=self.device)
        self._positions = torch.arange(max_len, device=self.device)
        inv_freq = _default_inv_freq(c.rope_theta, c.head_dim) if c.rope_inv_freq is None else c.rope_inv_freq
        self._cos, self._sin = self._rotary_tables(inv_freq, c.rope_attention_scaling)
        self._sliding_cos, self._sliding_sin = self._cos, self._sin
        if c.sliding_rope_inv_freq is not None:
            self._sliding_cos, self._sliding_sin = self._rotary_tables(c.sliding_rope_inv_freq, c.sliding_rope_attention_scaling)
        # transformers multiplies Gemma's embedding rows by the scale held in a float32 buffer, cast to
        # the model dtype, and Granite's by the float itself: as a Python float either value gives
        # transformers' products (decoder_step's input_scale takes it too, as float32).
        self._embed_scale = (torch.tensor(c.embed_scale, dtype=torch.float32, device="cpu").to(self.dtype).item()
                             if c.embed_scale_in_model_dtype else float(c.embed_scale))
        if not 0 < self._embed_scale < math.inf:
            raise ValueError(f"embed_scale {c.embed_scale!r} is {self._embed_scale} in the model's dtype {self.dtype}, "
                             "which embed_scale_in_model_dtype rounds it to: it must stay positive and finite there")

    def _rotary_tables(self, inv_freq, attention_scaling: float) -> tuple[Tensor, Tensor]:
        """cos and sin ``[max_len, head_dim]`` as transformers builds them: angles in float32, scaled
        by ``attention_scaling`` (yarn), then cast to the model dtype."""
        angles = torch.outer(torch.arange(self.max_len, dtype=torch.float32, device="cpu"),
                             torch.as_tensor(inv_freq, dtype=torch.float32, device="cpu"))
        angles = torch.cat([angles, angles], dim=-1)
        return ((angles.cos() * attention_scaling).to(self.device, self.dtype),
                (angles.sin() * attention_scaling).to(self.device, self.dtype))

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, model: PreTrainedModel, *, max_len: int, num_layers: Optional[int] = None,
                dtype: Optional[torch.dtype] = None, device: Union[str, torch.device, None] = None) -> "Decoder":
        """From a transformers Llama / Mistral / Ministral / Phi-3 / Granite / Qwen2 / Qwen3 / Gemma-2 /
        Gemma-3 text causal LM (its first ``num_layers`` layers when given: an early-exit draft). The layers'
        weights are copied into the fused layout, and the embedding, head and final norm shared with the
        model where no cast or move is needed (see :meth:`from_state_dict`); ``eos_token_id`` is the model's
        ``generation_config.eos_token_id``, ``generation_settings`` the logits processors it sets,
        which the runner does not apply (:func:`flashhead_ext.hf.greedy_logit_settings`). A
        FlashHead attached to ``model`` (:func:`flashhead_ext.hf.attach`) is not carried over (a
        warning says so): the decoder keeps the dense output weight."""
        model = uncompiled(model)  # a compiled model's state dict names every weight "_orig_mod."...
        kind = prompt_learning_kind(model)
        if kind is not None:  # it has no tuner layers to merge
            raise ValueError(f"model is a PEFT prompt-learning model ({kind}), whose virtual tokens PEFT adds in its own "
                             "forward, which the Decoder does not: decode it with its own generate(), or pass "
                             "model.get_base_model() to decode without them")
        if hasattr(model, "get_base_model") or any(hasattr(module, "base_layer") for module in model.modules()):
            # Else "state_dict has no ...": PEFT renames the weights it wraps (q_proj.base_layer.weight).
            raise ValueError(f"model carries PEFT adapters ({type(model).__name__}: LoRA or other tuner layers), whose terms "
                             "the Decoder's layers do not compute: merge them first, model = model.merge_and_unload()")
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "state_dict"):
            raise TypeError(f"model must be a transformers causal LM, got {type(model).__name__}")
        DecoderConfig.from_hf(config, num_layers)  # the family first: a Phi's head bias is not all it lacks
        if hasattr(model, "get_output_embeddings"):  # the decoder computes hidden . weight, nothing else
            if model.get_output_embeddings() is None and getattr(model, "base_model", model) is not model:
                # A task model (sequence classification...): the tied embedding decoded in its head's place.
                raise ValueError(f"model is a {type(model).__name__}, whose head is no language-model head "
                                 "(get_output_embeddings() is None): pass a causal LM (...ForCausalLM), or its body "
                                 "(model.base_model) to decode with its tied input embedding")
            check_plain_output_head(model)
        attachment = getattr(model, "flash_head", None)
        if attachment is not None and attachment.enabled:
            # Else the two drivers would silently disagree: the eager one decodes through the attachment.
            warnings.warn("model has a FlashHead attached (flashhead_ext.hf.attach), which the Decoder does not carry: it "
                          "copies the dense output weight, so its tokens are the dense head's (a draft's head is the "
                          "runner's draft_head)", stacklevel=2)
        decoder = cls.from_state_dict(config, model.state_dict(), max_len=max_len, num_layers=num_layers, dtype=dtype, device=device)
        if decoder.config.attn_logit_softcapping is not None and getattr(config, "_attn_implementation", None) == "sdpa":
            # transformers 5.17 ran Gemma-2 through SDPA by default, which drops the cap without a word.
            warnings.warn("model runs its attention through SDPA, which does not apply attn_logit_softcapping (transformers' "
                          "eager attention does); the Decoder applies the cap, so its tokens can differ from this model's: "
                          "load it with attn_implementation='eager' to compare", stacklevel=2)
        generation = getattr(model, "generation_config", None)
        if generation is not None:  # what generate() stops at, which may differ from the config's
            decoder.eos_token_id = generation.eos_token_id
        decoder.generation_settings = greedy_logit_settings(model)
        return decoder

    @classmethod
    def from_state_dict(cls, hf_config: PretrainedConfig, state_dict: Mapping[str, Tensor], *, max_len: int,
                        num_layers: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                        device: Union[str, torch.device, None] = None) -> "Decoder":
        """From a transformers config and state dict (keys as ``LlamaForCausalLM.state_dict()``, or the
        body's without the ``model.`` prefix plus ``lm_head.weight``; a tied config needs no head).
        ``eos_token_id`` is the config's. Two kinds of weight are stored changed, formed in float32
        (float64 from float64 weights) and then rounded to the model dtype: Gemma's norms as
        1 + weight, and Granite's o and down projections times its ``residual_multiplier``. In a
        16-bit model each is rounded once more than transformers rounds, an error the size of the
        output's own rounding. Every tensor must have the shape the config gives its key and a
        floating dtype, and is cast to ``dtype``, by default the input embedding's. The layers are
        copied into the fused layout; the embedding, the head and the final norm are ``state_dict``'s
        own tensors where they need no cast, move or change (so that a target and an early-exit draft
        built from one model hold one copy of the vocabulary matrices): an in-place change to those
        weights of the model (``load_state_dict``, an optimizer step) reaches them and not the
        layers, so build the decoder again after one."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of weight names to torch.Tensors (a model's state_dict()), "
                            f"got {type(state_dict).__name__}")
        c = DecoderConfig.from_hf(hf_config, num_layers)
        prefix = "model." if "model.embed_tokens.weight" in state_dict else ""
        embed_key = f"{prefix}embed_tokens.weight"
        if embed_key not in state_dict:
            raise ValueError(f"state_dict has no {embed_key!r}; expected the keys of a transformers {FAMILY_NAMES} causal LM")
        if num_layers is None and any(key.startswith(f"{prefix}layers.{c.num_layers}.") for key in state_dict):
            # Building the config's layers only would silently drop the rest: another model's config?
            raise ValueError(f"state_dict holds layer {c.num_layers} but the config has {c.num_layers} layers "
                             f"(num_hidden_layers); pass num_layers={c.num_layers} to keep only its first layers (an early exit)")
        # Before its dtype and device are read as the defaults.
        _require_state_tensor(embed_key, state_dict[embed_key], (c.vocab_size, c.hidden_size))
        if dtype is not None:
            _require_dtype(dtype)
        dtype = dtype or state_dict[embed_key].dtype
        if device is None:  # the embedding's, which on meta was refused as a device to pass
            _refuse_meta(embed_key, state_dict[embed_key])
        device = ops._runnable_device(device if device is not None else state_dict[embed_key].device, "the fast decoder")
        # Gemma's RMSNorms scale by 1 + weight, formed in float32 as transformers forms it; Granite's
        # residual branches are the o and down outputs times residual_multiplier, a factor of their weights.
        norm_offset = 1.0 if hf_config.model_type in ("gemma2", "gemma3_text") else 0.0
        residual_multiplier = hf_config.residual_multiplier if hf_config.model_type == "granite" else 1.0
        if not ops._is_number(residual_multiplier) or not math.isfinite(residual_multiplier):
            raise ValueError(f"config.residual_multiplier must be a finite number, got {residual_multiplier!r}")

        read = set()

        def get(key: str, shape: tuple) -> Tensor:
            """``state_dict[key]`` changed as its kind is stored, cast to ``dtype``, on ``device``."""
            if key not in state_dict:
                raise ValueError(f"state_dict has no {key!r}")
            source = state_dict[key]
            # Checked for each key: stacking copies a layer's weights into layer 0's shape, which
            # broadcasts a smaller one without a word, and a cast rounds integers into weights.
            _require_state_tensor(key, source, shape)
            _refuse_meta(key, source)  # only the weights read: an early exit's offloaded later layers are no matter
            if tuple(source.shape) != shape or not source.is_floating_point():
                raise ValueError(f"state_dict's {key!r} must be a floating-point tensor of shape {list(shape)} (the "
                                 f"config's sizes), got {source.dtype} {list(source.shape)}")
            read.add(key)
            w = source.detach().to(device)
            wide = torch.float64 if w.dtype == torch.float64 else torch.float32
            if norm_offset and key.endswith("norm.weight"):
                w = w.to(wide) + norm_offset
            if residual_multiplier != 1.0 and key.endswith(("o_proj.weight", "down_proj.weight")):
                w = w.to(wide) * residual_multiplier
            return w.to(dtype)

        d, hd, inter = c.hidden_size, c.head_dim, c.intermediate_size
        q_rows, kv_rows, vocab_rows = c.num_heads * hd, c.num_kv_heads * hd, (c.vocab_size, d)
        sources = dict(qkv=[("self_attn.q_proj.weight", (q_rows, d)), ("self_attn.k_proj.weight", (kv_rows, d)),
                            ("self_attn.v_proj.weight", (kv_rows, d))],
                       o=[("self_attn.o_proj.weight", (d, q_rows))],
                       gate_up=[("mlp.gate_proj.weight", (inter, d)), ("mlp.up_proj.weight", (inter, d))],
                       down=[("mlp.down_proj.weight", (d, inter))],
                       attn_norm=[("input_layernorm.weight", (d,))], mlp_norm=[("post_attention_layernorm.weight", (d,))])
        if hf_config.model_type == "phi3":  # stored as the fused layout's matrices already
            sources.update(qkv=[("self_attn.qkv_proj.weight", (q_rows + 2 * kv_rows, d))],
                           gate_up=[("mlp.gate_up_proj.weight", (2 * inter, d))])
        if c.post_norms:  # Gemma names its four norms by their place around the two blocks
            sources.update(mlp_norm=[("pre_feedforward_layernorm.weight", (d,))],
                           post_attn_norm=[("post_attention_layernorm.weight", (d,))],
                           post_mlp_norm=[("post_feedforward_layernorm.weight", (d,))])
        if c.qk_norm:
            sources.update(q_norm=[("self_attn.q_norm.weight", (hd,))], k_norm=[("self_attn.k_norm.weight", (hd,))])
        if c.qkv_bias:
            sources.update(qkv_bias=[("self_attn.q_proj.bias", (q_rows,)), ("self_attn.k_proj.bias", (kv_rows,)),
                                     ("self_attn.v_proj.bias", (kv_rows,))])
        # Each kind stacked over the layers, filled layer by layer (no second copy of the model).
        layer_shapes = _layer_shapes(c)
        layers = {name: torch.empty(layer_shapes[name], dtype=dtype, device=device) for name in sources}
        for name, keys in sources.items():
            for i in range(c.num_layers):
                layers[name][i].copy_(torch.cat([get(f"{prefix}layers.{i}.{key}", shape) for key, shape in keys]))
        embed = get(embed_key, vocab_rows).contiguous()
        if not c.tie_word_embeddings and "lm_head.weight" not in state_dict:
            raise ValueError("state_dict has no 'lm_head.weight', and the config says the head is untied "
                             "(tie_word_embeddings=False); pass the causal LM's full state dict, not its body's")
        lm_head = embed if c.tie_word_embeddings else get("lm_head.weight", vocab_rows).contiguous()
        final_norm = get(f"{prefix}norm.weight", (d,))
        _refuse_unread_weights(state_dict, read, prefix, c, hf_config.model_type)
        decoder = cls(c, dict(embed=embed, lm_head=lm_head, final_norm=final_norm, layers=layers), max_len=max_len)
        decoder.eos_token_id = getattr(hf_config, "eos_token_id", None)  # transformers' fallback without a generation config
        return decoder

    @classmethod
    def random(cls, config: DecoderConfig, *, max_len: int, dtype: torch.dtype = torch.bfloat16,
               device: Union[str, torch.device] = "cuda", seed: int = 0, std: float = 0.02) -> "Decoder":
        """Random weights allocated directly on ``device`` (default ``"cuda"``; a 32B-shaped model never
        passes through the host). For timing: the values are irrelevant, but never zeros, and norms are ones."""
        _require_config(config)
        _require_dtype(dtype)
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {dtype}")
        _require_max_len(max_len)  # before gigabytes of weights are drawn
        # The note explains a device the caller may not have chosen, so only the default carries it.
        default_note = " (the default is 'cuda')" if isinstance(device, str) and device == "cuda" else ""
        device = ops._runnable_device(device, "the fast decoder", default_note)
        seed = ops._require_int("seed", seed)
        info = torch.finfo(dtype)
        # From the smallest normal value to where a draw of 64 std would overflow: weights never zeros nor inf.
        if not ops._is_number(std) or not info.tiny <= std <= info.max / 64:
            raise ValueError(f"std must be a number in {info.tiny:.3g}..{info.max / 64:.3g} for {dtype} (the weights are "
                             f"never zeros nor infinite), got {std!r:.40}")
        gen = torch.Generator(device=device).manual_seed(seed)
        c = config
        d = c.hidden_size

        def normal(*shape):
            return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)

        def ones(*shape):
            return torch.ones(shape, dtype=dtype, device=device)

        layers = {name: (ones if "norm" in name else normal)(*shape) for name, shape in _layer_shapes(c).items()}
        embed = normal(c.vocab_size, d)
        lm_head = embed if c.tie_word_embeddings else normal(c.vocab_size, d)
        return cls(c, dict(embed=embed, lm_head=lm_head, final_norm=ones(d), layers=layers), max_len=max_len)

    # ---- the forward -------------------------------------------------------------------------

    @ops._autocast_off
    def forward(self, ids: Tensor, *, start: Optional[Tensor] = None) -> Tensor:
        """Hidden states ``[n, D]`` (after the final norm) of ``ids`` at positions ``start ..``
        (an int64 0-d device tensor; default ``length``).

        Host-sync free and allocation-shape fixed by ``n``: safe inside CUDA-graph capture. So the
        positions are not checked: callers keep ``start + n <= max_len`` (``reset`` checks its
        host int; ``FastSpeculativeDecoder.generate`` checks the room up front). Past ``max_len``
        the eager and compiled bodies fail to index their rotary tables (an IndexError on the CPU,
        a device-side assert on CUDA, after which the CUDA context is unusable); more than
        ``max_len`` ids, which no start fits, raise a ValueError. The fused and
        persistent bodies write nothing for a position outside ``[0, max_len)`` and give NaN
        hidden states there, which ``argmax`` reads as token 0; the persistent body's one-token
        step then costs only a launch, which lets a captured graph skip a step on the device.
        Nor are the ids' values checked: one outside the vocabulary fails the embedding lookup.
        """
        if not isinstance(ids, Tensor):
            raise TypeError(f"ids must be a non-empty 1-d int32 or int64 tensor, got {type(ids).__name__}")
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or not ids.numel():
            raise ValueError(f"ids must be a non-empty 1-d int32 or int64 tensor, got a {ids.dim()}-d {ids.dtype} tensor "
                             f"of {ids.numel()} ids")
        if ids.device != self.device:
            raise ValueError(f"ids must be on the model's device {self.device}, got {ids.device}")
        if start is not None and not (isinstance(start, Tensor) and start.dim() == 0 and start.dtype == torch.int64
                                      and start.device == self.device):
            got = (f"a {start.dim()}-d {start.dtype} tensor on {start.device}" if isinstance(start, Tensor)
                   else type(start).__name__)
            # Read on the device, so that a captured graph takes each replay's value; one body took an int.
            raise TypeError(f"start must be a 0-d int64 tensor on the model's device {self.device}, got {got}")
        c = self.config
        n = ids.shape[0]
        if n > self.max_len:
            raise ValueError(f"ids holds {n} tokens, more than the cache's max_len {self.max_len}")
        short = n <= STEP_MAX_TOKENS
        start = self.length if start is None else start
        x = self.embed.index_select(0, ids)
        stepped = self.body == "persistent" and short and (n == 1 or self.config.body_limit("fused", self.dtype))
        if self._embed_scale != 1.0 and not stepped:  # decoder_step applies it itself
            x = x * self._embed_scale
        if stepped:
            # One token, one step, no copy (the draft's step); otherwise one step a token.
            steps = [self._persistent_step(x[i:i + 1], start + i if i else start) for i in range(n)]
            x = steps[0] if n == 1 else torch.cat(steps)
        elif self.body in ("fused", "persistent") and short:
            for i, w in enumerate(self.layers):
                x = _fused_layer(x, w, self.k_cache[i], self.v_cache[i], start, self._cos, self._sin,
                                 c.num_heads, c.rms_norm_eps, c.softmax_scale)
        else:
            inputs = {sliding: self.step_inputs(n, start, sliding=sliding) for sliding in {False, bool(c.sliding_layers)}}
            compiled = self.body == "compiled" and short
            layer = _get_compiled_layer() if compiled else _layer
            sliding_layers = set(c.sliding_layers)
            with _compiled_graphs_allowed() if compiled else contextlib.nullcontext():
                for i, w in enumerate(self.layers):
                    x = layer(x, w, self.k_cache[i], self.v_cache[i], *inputs[i in sliding_layers], c.num_heads,
                              c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.softmax_scale, c.hidden_act, self.attention,
                              c.attn_logit_softcapping)
        return _rms_norm(x, self.final_norm, c.rms_norm_eps)

    def _persistent_step(self, x: Tensor, position: Tensor) -> Tensor:
        """The residual stream after every layer of the token ``x [1, D]`` at ``position``: one ``decoder_step``."""
        c = self.config
        own_tables = self._sliding_cos is not self._cos
        return ops.decoder_step(x, self.stacked, self.k_cache, self.v_cache, self._cos, self._sin, position, c.num_heads,
                                eps=c.rms_norm_eps, scale=c.softmax_scale, activation=c.hidden_act,
                                sliding_window=c.sliding_window or 0, sliding_layers=c.sliding_layers,
                                sliding_cos=self._sliding_cos if own_tables else None,
                                sliding_sin=self._sliding_sin if own_tables else None, input_scale=self._embed_scale,
                                attn_softcap=c.attn_logit_softcapping or 0.0)

    def step_inputs(self, n: int, start: Tensor, *, sliding: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """What ``_layer`` takes for ``n`` tokens from position ``start`` (an int64 0-d device
        tensor), derived on the device: their positions, rotary rows ``[n, 1, hd]`` and the
        additive attention mask; ``sliding``: a sliding-window layer's rotary rows and mask."""
        c = self.config
        pos = start + self._positions[:n]
        cos, sin = (self._sliding_cos, self._sliding_sin) if sliding else (self._cos, self._sin)
        cos, sin = cos.index_select(0, pos)[:, None], sin.index_select(0, pos)[:, None]
        # Query row g*n+i (head g of a KV group, token i) sees keys 0..pos[i] (in a sliding layer only
        # the last sliding_window of them). An additive mask built once per forward: a boolean one
        # would be converted in every layer.
        visible = self._positions[None, :] <= pos[:, None]
        if sliding:
            visible &= self._positions[None, :] > pos[:, None] - c.sliding_window
        visible = visible.repeat(c.num_heads // c.num_kv_heads, 1)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        return pos, cos, sin, mask

    @property
    def body(self) -> str:
        return self._body

    @body.setter
    def body(self, value: str) -> None:
        if value not in BODIES:
            raise ValueError(f"body must be one of {BODIES}, got {value!r}")
        limit = self._body_limit(value)
        if limit:
            raise ValueError(f"body {value!r} {limit}")
        self._body = value

    @property
    def bodies(self) -> tuple:
        """The bodies this model can run (of ``BODIES``)."""
        return tuple(body for body in BODIES if not self._body_limit(body))

    def _body_limit(self, body: str) -> Optional[str]:
        """config.body_limit, and on a GPU the persistent body's kernel limits (_cuda_step_limit)."""
        limit = self.config.body_limit(body, self.dtype)
        if limit or body != "persistent" or self.device.type != "cuda":
            return limit
        return self._cuda_step_limit()

    def _cuda_step_limit(self) -> Optional[str]:
        """Why the CUDA ``decoder_step`` kernel cannot run this model, or None: its limits (sizes of
        whole 16-byte vectors, head_dim, heads per KV head, row bytes, max_len; docs/kernels.md) are
        the op's own checks, asked once by a step at a position past the cache, which writes nothing
        and costs a launch. Found before any generation instead of at its first draft step."""
        if self._persistent_refusal is None:
            try:
                self._persistent_step(torch.zeros(1, self.config.hidden_size, dtype=self.dtype, device=self.device),
                                      torch.tensor(self.max_len, device=self.device))
                self._persistent_refusal = ""
            except ValueError as error:
                self._persistent_refusal = f"cannot run this model on {self.device}: {error}"
        return self._persistent_refusal or None

    @property
    def attention(self) -> str:
        return self._attention

    @attention.setter
    def attention(self, value: str) -> None:
        if value not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {value!r}")
        self._attention = value

    @ops._autocast_off
    def logits(self, hidden: Tensor) -> Tensor:
        c = self.config
        logits = F.linear(hidden, self.lm_head)
        # As transformers' Granite divides and Gemma-2 caps, op by op in the model dtype: the argmax
        # of the rounded results, ties included.
        if c.logits_scaling != 1.0:
            logits = logits / c.logits_scaling
        if c.final_logit_softcapping is not None:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def argmax(self, hidden: Tensor) -> Tensor:
        """The dense head's greedy token per row, int64 ``[n]``."""
        return self.logits(hidden).argmax(dim=-1)

    def reset(self, length: int = 0) -> None:
        """Sets the cache length; the entries beyond it are dropped (later overwritten)."""
        if not ops._is_int(length) or not 0 <= length <= self.max_len:
            raise ValueError(f"length must be an int in 0..{self.max_len} (max_len), got {length!r}")
        self.length.fill_(length)

    @property
    def nbytes(self) -> int:
        """Weight bytes (a tied head counted once)."""
        tensors = [self.embed, self.final_norm, *self.stacked.values()]
        if self.lm_head is not self.embed:
            tensors.append(self.lm_head)
        return sum(t.numel() * t.element_size() for t in tensors)


__all__ = ["BODIES", "Decoder", "DecoderConfig", "STEP_MAX_TOKENS", "SUPPORTED"]
