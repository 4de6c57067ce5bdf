"""The GPU fast path of speculative decoding (issue 6, docs/speculative.md "Fast path").

:class:`Decoder` holds a Llama / Mistral / Ministral / Phi-3 / Granite / Qwen2 / Qwen3 / Gemma-2 /
Gemma-3 (text) model's weights with a static KV cache and runs fixed-shape forwards;
:class:`FastSpeculativeDecoder` runs baseline / ordinary / deferred decoding on two of them with
every per-round step captured as a CUDA graph. Other transformers models use
:class:`flashhead_ext.speculative.SpeculativeDecoder`.
"""
from .decoder import SUPPORTED, Decoder, DecoderConfig
from .runner import FastSpeculativeDecoder

__all__ = ["Decoder", "DecoderConfig", "FastSpeculativeDecoder", "SUPPORTED"]
