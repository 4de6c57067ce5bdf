"""The fast path (flashhead_ext.fast): decoder vs transformers, static cache, exact runner, synthetic mode.

CPU tests run tiny Llama (untied, GQA), Mistral (a sliding window in every layer; Phi-3 too, with its
weights stored fused), Ministral (a sliding window in some layers), Granite (four multipliers), Qwen2
(q/k/v biases, optionally sliding windows), Qwen3 (tied, q/k norms, MHA), Gemma-3 (GELU, four norms a
layer, scaled embeddings, sliding-window layers with their own rotary) and Gemma-2 (Gemma-3's layer
without q/k norms, with capped attention scores and logits) models with odd sizes, eagerly, in float64
(the runner's exactness) and float32 (the decoder's logits). GPU tests capture the steps as
CUDA graphs and check them against eager runs and for host syncs.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import json
import math
import re
import subprocess
import sys
import warnings
import weakref
from typing import Optional

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from flashhead_ext import DenseHead, FlashHead, ops
from flashhead_ext.fast import Decoder, DecoderConfig, FastSpeculativeDecoder
from flashhead_ext.fast.decoder import BODIES
from flashhead_ext.speculative import MODES
from flashhead_ext.speculative.runner import plan_configs, run_interleaved, summarize
from helpers import one_thread  # noqa: F401  (an autouse fixture)
from helpers import (DEVICES, TWO_GPUS, PerTokenScaledHead, check_counters, default_dtype, greedy_tokens, random_partition,
                     random_prompt)

transformers = pytest.importorskip("transformers")

VOCAB = 97
NEW = 20


# Scaled RoPE as Llama 3.1 / 3.2 (llama3) and long-context Qwen3 (yarn) checkpoints set it, with an
# original context of 16 so that a short test runs past it.
ROPE_SCALINGS = {
    "linear": dict(rope_type="linear", factor=3.0),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
}


@functools.lru_cache(maxsize=None)
def hf_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float64, rope: str = "default"):
    """``arch`` "llama", "mistral", "ministral", "phi3", "granite", "qwen2", "qwen2-sliding", "qwen3", "gemma2" or "gemma3"
    (odd sizes); "-aligned":
    sizes that are whole 16-byte vectors of float32, which the CUDA decoder_step kernel needs.
    ``rope``: "default" or a ROPE_SCALINGS key (Llama and Qwen3)."""
    aligned = arch.endswith("-aligned")
    if arch.startswith("gemma3"):
        return _gemma3_model(seed, dtype, aligned)
    if arch.startswith("gemma2"):
        return _gemma2_model(seed, dtype, aligned)
    if arch.startswith("qwen2"):
        return _qwen2_model(seed, dtype, sliding=arch.startswith("qwen2-sliding"), aligned=aligned)
    theta = 500.0 if arch.startswith("llama") else 10000.0
    rope_parameters = dict(rope_type="default", rope_theta=theta) if rope == "default" else dict(ROPE_SCALINGS[rope], rope_theta=theta)
    if arch.startswith("mistral"):  # GQA 4:2, head_dim != hidden/heads, every layer's window of 5, untied head
        cls, config = transformers.MistralForCausalLM, transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=40, intermediate_size=56 if aligned else 53, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8 if aligned else 6, max_position_embeddings=256,
            sliding_window=5, rope_parameters=rope_parameters, tie_word_embeddings=False, initializer_range=0.3)
    elif arch.startswith("phi3"):  # GQA 6:2, fused q/k/v and gate/up weights, every layer's window of 5, untied head
        cls, config = transformers.Phi3ForCausalLM, transformers.Phi3Config(
            vocab_size=VOCAB, hidden_size=48, intermediate_size=56 if aligned else 53, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256, sliding_window=5,
            rope_parameters=rope_parameters, tie_word_embeddings=False, initializer_range=0.3, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
    elif arch.startswith("ministral"):  # Mistral's sizes, the window of 5 in the middle layer only
        cls, config = transformers.MinistralForCausalLM, transformers.MinistralConfig(
            vocab_size=VOCAB, hidden_size=40, intermediate_size=56 if aligned else 53, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8 if aligned else 6, max_position_embeddings=256,
            sliding_window=5, layer_types=["full_attention", "sliding_attention", "full_attention"],
            rope_parameters=rope_parameters, tie_word_embeddings=False, initializer_range=0.3)
    elif arch.startswith("granite"):  # GQA 6:2, every multiplier away from 1 (the embedding's not a bf16 value), tied head
        cls, config = transformers.GraniteForCausalLM, transformers.GraniteConfig(
            vocab_size=VOCAB, hidden_size=48, intermediate_size=72 if aligned else 71, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256, rope_parameters=rope_parameters,
            tie_word_embeddings=True, initializer_range=0.3, embedding_multiplier=3.7, residual_multiplier=0.37,
            attention_multiplier=0.29, logits_scaling=2.5)
    elif arch.startswith("llama"):  # GQA 6:2, head_dim 8 from hidden/heads, untied head
        cls, config = transformers.LlamaForCausalLM, transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=48, intermediate_size=72 if aligned else 71, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256, rope_parameters=rope_parameters,
            tie_word_embeddings=False)
    else:  # MHA 5:5 with head_dim != hidden/heads (odd sizes), q/k norms, tied head
        cls, config = transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
            vocab_size=VOCAB, hidden_size=40, intermediate_size=56 if aligned else 53, num_hidden_layers=3,
            num_attention_heads=5, num_key_value_heads=5, head_dim=8 if aligned else 6, max_position_embeddings=256,
            rope_parameters=rope_parameters, tie_word_embeddings=True, initializer_range=0.3)
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # the references are fixed-length greedy runs (Llama's config says 2)
    return model


def _gemma3_model(seed: int, dtype: torch.dtype, aligned: bool):
    """GQA 4:2 with head_dim 6 (aligned: 8), a sliding window of 5 in layers 1 and 2 (rotary base 50) and a
    linearly scaled rotary in layers 0 and 3, a softmax scale from query_pre_attn_scalar, tied head.
    Norm weights are drawn (transformers starts them at 0, which would hide Gemma's 1 + weight)."""
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=56 if aligned else 53, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8 if aligned else 6, query_pre_attn_scalar=11, max_position_embeddings=256, sliding_window=5,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1000.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=50.0)})
    # transformers' default initializer_range (0.02): with larger weights the embeddings, scaled by
    # sqrt(hidden), make the greedy tokens one token repeated.
    return _drawn(transformers.Gemma3ForCausalLM, config, seed, dtype, "norm.weight", std=0.1)


def _gemma2_model(seed: int, dtype: torch.dtype, aligned: bool):
    """Gemma-3's sizes without q/k norms, a sliding window of 5 in layers 0 and 2 (Gemma-2's default
    alternation) rotating as the others, weights of std 0.1 and both caps low enough (transformers'
    defaults: 50 and 30) that they change these random models' scores and logits. Norm weights drawn.
    Eager attention: transformers 5.17 ran Gemma-2 through SDPA by default, which drops the cap."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=56 if aligned else 53, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8 if aligned else 6, query_pre_attn_scalar=11,
        max_position_embeddings=256, sliding_window=5, rope_parameters=dict(rope_type="default", rope_theta=1000.0),
        attn_logit_softcapping=0.5, final_logit_softcapping=5.0, initializer_range=0.1)
    config._attn_implementation = "eager"
    return _drawn(transformers.Gemma2ForCausalLM, config, seed, dtype, "norm.weight", std=0.1)


def _qwen2_model(seed: int, dtype: torch.dtype, sliding: bool, aligned: bool):
    """GQA 5:1 with q/k/v biases (drawn: transformers starts them at 0), untied head; ``sliding``: a
    window of 5 in layers 1 and 2 (use_sliding_window from max_window_layers = 1)."""
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=56 if aligned else 53, num_hidden_layers=3,
        num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=256, use_sliding_window=sliding,
        sliding_window=5, max_window_layers=1, rope_parameters=dict(rope_type="default", rope_theta=300.0),
        tie_word_embeddings=False, initializer_range=0.3)
    return _drawn(transformers.Qwen2ForCausalLM, config, seed, dtype, "proj.bias", std=0.5)


def _drawn(cls, config, seed: int, dtype: torch.dtype, redrawn: str, std: float):
    """``cls(config)`` seeded, with the parameters named ``*redrawn`` drawn again (transformers starts
    them at 0), in float32 before the cast: every dtype then holds the same model."""
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(redrawn):
                weight.normal_(0.0, std)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def prompt(seed: int, length: int = 7) -> torch.Tensor:
    return random_prompt(seed, VOCAB, length)


@functools.lru_cache(maxsize=None)
def reference(arch: str, prompt_seed: int, new_tokens: int = NEW) -> tuple:
    return greedy_tokens(hf_model(arch), prompt(prompt_seed), new_tokens)


def random_flash_head(embedding: torch.Tensor, cluster_size: int = 4, probes: int = 1) -> FlashHead:
    """A meaningless clustering, so that FlashHead's proposals are often wrong."""
    table = random_partition(embedding.shape[0], cluster_size).to(embedding.device)
    centroids = torch.nn.functional.normalize(torch.randn(table.shape[0], embedding.shape[1], generator=torch.Generator().manual_seed(1)), dim=1)
    return FlashHead(embedding, centroids.to(embedding.device), table, probes)


def head_for(decoder: Decoder, kind: str):
    embedding = decoder.lm_head.float()  # the heads take no float64
    return DenseHead(embedding) if kind == "dense" else random_flash_head(embedding)


# ---- the decoder -------------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("arch", ["llama", "mistral", "ministral", "phi3", "granite", "qwen2", "qwen2-sliding", "qwen3", "gemma2",
                                  "gemma3"])
def test_logits_match_transformers_prefill_and_step_by_step(arch, dtype, attention):
    model = hf_model(arch, dtype=dtype)
    decoder = Decoder.from_hf(model, max_len=24)
    decoder.attention = attention
    assert decoder.config.qk_norm == (arch in ("qwen3", "gemma3")) and decoder.config.qkv_bias == arch.startswith("qwen2")
    assert (decoder.lm_head is decoder.embed) == (arch in ("qwen3", "gemma2", "gemma3", "granite"))
    ids = prompt(1, length=13)  # past the window of 5 (mistral, ministral, phi3, qwen2-sliding, gemma2, gemma3)
    with torch.no_grad():
        expected = model(input_ids=ids.view(1, -1)).logits[0]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_prefill_then_steps(decoder, ids, 6), expected, **tol)
    assert int(decoder.length) == 13


def _prefill_then_steps(decoder: Decoder, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of ``ids``: the first ``prefill`` in one forward, then one token a forward."""
    got = [decoder.logits(decoder.forward(ids[:prefill]))]
    decoder.length += prefill
    for i in range(prefill, ids.shape[0]):
        got.append(decoder.logits(decoder.forward(ids[i:i + 1])))
        decoder.length += 1
    return torch.cat(got)


@pytest.mark.parametrize("rope", sorted(ROPE_SCALINGS))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_scaled_rope_matches_transformers_past_the_original_context(arch, rope):
    model = hf_model(arch, rope=rope)
    decoder = Decoder.from_hf(model, max_len=40)
    ids = prompt(4, length=37)
    with torch.no_grad():
        expected = model(input_ids=ids.view(1, -1)).logits[0]
    torch.testing.assert_close(_prefill_then_steps(decoder, ids, 12), expected, rtol=1e-5, atol=1e-5)
    # The scaling matters here: the default frequencies miss the model's logits by far more.
    unscaled = Decoder(dataclasses.replace(decoder.config, rope_inv_freq=None, rope_attention_scaling=1.0),
                       dict(embed=decoder.embed, lm_head=decoder.lm_head, final_norm=decoder.final_norm, layers=decoder.stacked),
                       max_len=40)
    assert (unscaled.logits(unscaled.forward(ids)) - expected).abs().max() > 1e-4


def test_gemma3_layer_features_each_matter():
    """Each Gemma-3 feature of the config changes these logits: dropping any one (the window, the
    sliding layers' rotary, the GELU, the scaled embeddings, the softmax scale) misses transformers'
    logits by far more than the decoder does."""
    model = hf_model("gemma3")
    decoder = Decoder.from_hf(model, max_len=24)
    c = decoder.config
    assert (c.sliding_layers, c.sliding_window, c.hidden_act, c.post_norms) == ((1, 2), 5, "gelu_tanh", True)
    assert c.embed_scale == pytest.approx(40 ** 0.5) and c.softmax_scale == pytest.approx(11 ** -0.5)
    ids = prompt(2, length=17)
    with torch.no_grad():
        expected = model(input_ids=ids.view(1, -1)).logits[0]
    # transformers' RMSNorms compute in float32 whatever the model dtype: a 1e-6 difference here.
    torch.testing.assert_close(decoder.logits(decoder.forward(ids)), expected, rtol=1e-5, atol=1e-5)
    weights = dict(embed=decoder.embed, lm_head=decoder.lm_head, final_norm=decoder.final_norm, layers=decoder.stacked)
    for change in (dict(sliding_layers=(), sliding_window=None, sliding_rope_inv_freq=None), dict(sliding_rope_inv_freq=None),
                   dict(hidden_act="silu"),
                   dict(embed_scale=1.0), dict(attention_scale=None)):
        other = Decoder(dataclasses.replace(c, **change), weights, max_len=24)
        assert (other.logits(other.forward(ids)) - expected).abs().max() > 1e-3, change


def test_gemma2_layer_features_each_matter():
    """Gemma-2 is Gemma-3's layer without q/k norms, every layer rotating alike, and two caps: each
    cap, the window and the softmax scale change these logits (by far more than the decoder misses
    transformers' by), and the bodies that cannot cap the scores say so."""
    model = hf_model("gemma2")
    decoder = Decoder.from_hf(model, max_len=24)
    c = decoder.config
    assert (c.sliding_layers, c.sliding_window, c.hidden_act, c.post_norms, c.qk_norm) == ((0, 2), 5, "gelu_tanh", True, False)
    assert (c.attn_logit_softcapping, c.final_logit_softcapping, c.sliding_rope_inv_freq) == (0.5, 5.0, None)
    assert c.embed_scale == pytest.approx(40 ** 0.5) and c.softmax_scale == pytest.approx(11 ** -0.5)
    ids = prompt(2, length=17)
    with torch.no_grad():
        expected = model(input_ids=ids.view(1, -1)).logits[0]
    got = decoder.logits(decoder.forward(ids))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.abs().max() < 5.0  # the cap holds
    weights = dict(embed=decoder.embed, lm_head=decoder.lm_head, final_norm=decoder.final_norm, layers=decoder.stacked)
    for change in (dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None),
                   dict(sliding_layers=(), sliding_window=None),
                   dict(attention_scale=None)):
        other = Decoder(dataclasses.replace(c, **change), weights, max_len=24)
        assert (other.logits(other.forward(ids)) - expected).abs().max() > 1e-3, change
    # SDPA cannot cap the scores: the matmul path serves either choice.
    decoder.attention = "sdpa"
    decoder.reset()
    torch.testing.assert_close(decoder.logits(decoder.forward(ids)), expected, rtol=1e-5, atol=1e-5)
    float32 = Decoder.from_hf(hf_model("gemma2", dtype=torch.float32), max_len=8)
    assert float32.bodies == ("eager", "compiled", "persistent")
    with pytest.raises(ValueError, match="body 'fused' runs the Llama / Qwen layer; this model's GELU, post-norms, "
                                         "sliding-window layers, capped attention scores run on"):
        float32.body = "fused"


def test_gemma2_under_sdpa_is_warned_of():
    # transformers 5.17 ran Gemma-2 through SDPA by default, whose attention drops the cap: the
    # decoder's logits then differed from the model's without a word.
    model = copy.deepcopy(hf_model("gemma2"))
    model.config._attn_implementation = "sdpa"
    with pytest.warns(UserWarning, match="model runs its attention through SDPA, which does not apply attn_logit_softcapping"):
        decoder = Decoder.from_hf(model, max_len=8)
    assert decoder.config.attn_logit_softcapping == 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Decoder.from_hf(hf_model("gemma2"), max_len=8)


def test_gemma3_final_logit_cap_matches_transformers():
    # transformers' Gemma-3 applies final_logit_softcapping (None in its published configs); it was refused.
    model = copy.deepcopy(hf_model("gemma3"))
    model.config.final_logit_softcapping = 1.3
    decoder = Decoder.from_hf(model, max_len=24)
    assert decoder.config.final_logit_softcapping == 1.3
    ids = prompt(3, length=11)
    with torch.no_grad():
        expected = model(input_ids=ids.view(1, -1)).logits[0]
    torch.testing.assert_close(decoder.logits(decoder.forward(ids)), expected, rtol=1e-5, atol=1e-5)
    uncapped = Decoder.from_hf(hf_model("gemma3"), max_len=24)
    assert (uncapped.logits(uncapped.forward(ids)) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("name, value", [("attn_logit_softcapping", 0.0), ("final_logit_softcapping", -30.0),
                                         ("attn_logit_softcapping", float("nan")), ("final_logit_softcapping", float("inf")),
                                         # finite positive doubles that round to inf or 0 as the float32 the kernel takes
                                         ("attn_logit_softcapping", 1e39), ("final_logit_softcapping", 1e-50)])
def test_gemma2_caps_out_of_range_are_named_as_the_config_names_them(name, value):
    config = copy.deepcopy(hf_model("gemma2").config)
    setattr(config, name, value)
    expected = f"must be None \\(no cap\\) or a positive number finite in float32, got {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=f"config.{name} {expected}"):
        DecoderConfig.from_hf(config)
    good = DecoderConfig.from_hf(hf_model("gemma2").config)
    with pytest.raises(ValueError, match=f"^{name} {expected}"):
        dataclasses.replace(good, **{name: value})


@pytest.mark.parametrize("cap", [3.4e38, 1e-44])
def test_gemma2_caps_at_float32s_ends_are_kept(cap):
    good = DecoderConfig.from_hf(hf_model("gemma2").config)
    assert dataclasses.replace(good, attn_logit_softcapping=cap).attn_logit_softcapping == cap


@pytest.mark.parametrize("value", [None, 0, -4, float("nan"), "256"])
def test_gemma_query_pre_attn_scalar_out_of_range_is_named(value):
    for arch in ("gemma2", "gemma3"):
        config = copy.deepcopy(hf_model(arch).config)
        # Past the type check newer transformers make on assignment (0 and -4 pass it), as an older
        # release's config or one built otherwise may hold.
        vars(config)["query_pre_attn_scalar"] = value
        with pytest.raises(ValueError, match=f"config.query_pre_attn_scalar must be a finite positive number "
                                             f".*, got {re.escape(repr(value))}"):
            DecoderConfig.from_hf(config)


def test_granite_multipliers_each_matter():
    """Each of Granite's four multipliers changes these logits: leaving any one out (the residual
    multiplier folded into the o and down weights, the others config fields) misses transformers'
    logits by far more than the decoder does."""
    model = hf_model("granite")
    decoder = Decoder.from_hf(model, max_len=24)
    c = decoder.config
    assert (c.embed_scale, c.embed_scale_in_model_dtype, c.softmax_scale, c.logits_scaling) == (3.7, False, 0.29, 2.5)
    ids = prompt(2, length=17)
    with torch.no_grad():
        expected = model(input_ids=ids.view(1, -1)).logits[0]
    torch.testing.assert_close(decoder.logits(decoder.forward(ids)), expected, rtol=1e-5, atol=1e-5)
    weights = dict(embed=decoder.embed, lm_head=decoder.lm_head, final_norm=decoder.final_norm, layers=decoder.stacked)
    unfolded = copy.deepcopy(model.config)
    unfolded.residual_multiplier = 1.0
    others = [Decoder(dataclasses.replace(c, **change), weights, max_len=24)
              for change in (dict(embed_scale=1.0), dict(attention_scale=None), dict(logits_scaling=1.0))]
    others.append(Decoder.from_state_dict(unfolded, model.state_dict(), max_len=24))
    for other in others:
        assert (other.logits(other.forward(ids)) - expected).abs().max() > 1e-3, other.config
    # transformers multiplies a bfloat16 Granite's embeddings by the float 3.7 itself, a Gemma's by
    # its scale rounded to bfloat16 (3.703125 for 3.7).
    bf16 = Decoder.from_hf(hf_model("granite", dtype=torch.bfloat16), max_len=8)
    assert bf16._embed_scale == 3.7
    rounded = Decoder(dataclasses.replace(bf16.config, embed_scale_in_model_dtype=True), dict(
        embed=bf16.embed, lm_head=bf16.lm_head, final_norm=bf16.final_norm, layers=bf16.stacked), max_len=8)
    assert rounded._embed_scale == 3.703125


def test_granite_settings_out_of_range_are_named_as_the_config_names_them():
    # They were named as the DecoderConfig fields they become ("embed_scale must be ...").
    for name, value in (("embedding_multiplier", 0.0), ("attention_multiplier", -0.0625), ("logits_scaling", float("inf")),
                        ("embedding_multiplier", 1e39), ("logits_scaling", 1e-50)):  # inf and 0 in float32
        config = copy.deepcopy(hf_model("granite").config)
        setattr(config, name, value)
        with pytest.raises(ValueError, match=f"config.{name} must be a positive number finite in float32, got {re.escape(repr(value))}"):
            DecoderConfig.from_hf(config)
    config = copy.deepcopy(hf_model("granite").config)
    config.residual_multiplier = float("nan")
    with pytest.raises(ValueError, match="config.residual_multiplier must be a finite number, got nan"):
        Decoder.from_state_dict(config, hf_model("granite").state_dict(), max_len=8)
    config.residual_multiplier, config.attention_bias, config.mlp_bias = 1.0, True, True
    with pytest.raises(ValueError, match="config.attention_bias and config.mlp_bias set"):
        DecoderConfig.from_hf(config)
    # A flag given as a string read as true: "False" rounded Granite's embedding scale to the model dtype.
    good = DecoderConfig.from_hf(hf_model("granite").config)
    for flag in ("embed_scale_in_model_dtype", "qk_norm", "tie_word_embeddings", "qkv_bias", "post_norms"):
        with pytest.raises(TypeError, match=f"{flag} must be a bool, got 'False'"):
            dataclasses.replace(good, **{flag: "False"})


def test_qwen2_biases_and_sliding_window_each_matter():
    model = hf_model("qwen2-sliding")
    decoder = Decoder.from_hf(model, max_len=24)
    c = decoder.config
    assert (c.qkv_bias, c.sliding_layers, c.sliding_window, c.sliding_rope_inv_freq) == (True, (1, 2), 5, None)
    ids = prompt(2, length=17)
    with torch.no_grad():
        expected = model(input_ids=ids.view(1, -1)).logits[0]
    torch.testing.assert_close(decoder.logits(decoder.forward(ids)), expected, rtol=1e-5, atol=1e-5)
    weights = dict(embed=decoder.embed, lm_head=decoder.lm_head, final_norm=decoder.final_norm, layers=decoder.stacked)
    no_bias = dict(weights, layers={name: w for name, w in decoder.stacked.items() if name != "qkv_bias"})
    for change, given in ((dict(sliding_layers=(), sliding_window=None), weights), (dict(qkv_bias=False), no_bias)):
        other = Decoder(dataclasses.replace(c, **change), given, max_len=24)
        assert (other.logits(other.forward(ids)) - expected).abs().max() > 1e-3, change
    with pytest.raises(ValueError, match="body 'fused' runs the Llama / Qwen layer; this model's sliding-window "
                                         "layers run on the 'eager', 'compiled' or 'persistent' body"):
        Decoder.from_hf(hf_model("qwen2-sliding", dtype=torch.float32), max_len=8).body = "fused"
    assert Decoder.from_hf(hf_model("qwen2", dtype=torch.float32), max_len=8).bodies == BODIES


def test_mistral_window_covers_every_layer_or_none():
    """transformers' Mistral masks every layer to its sliding window (and none without one): the
    decoder's logits match it both ways, and dropping the window misses them."""
    model = hf_model("mistral")
    decoder = Decoder.from_hf(model, max_len=24)
    c = decoder.config
    assert (c.sliding_layers, c.sliding_window, c.qk_norm, c.qkv_bias) == ((0, 1, 2), 5, False, False)
    ids = prompt(5, length=17)
    with torch.no_grad():
        expected = model(input_ids=ids.view(1, -1)).logits[0]
    torch.testing.assert_close(decoder.logits(decoder.forward(ids)), expected, rtol=1e-5, atol=1e-5)
    weights = dict(embed=decoder.embed, lm_head=decoder.lm_head, final_norm=decoder.final_norm, layers=decoder.stacked)
    unwindowed = Decoder(dataclasses.replace(c, sliding_layers=(), sliding_window=None), weights, max_len=24)
    assert (unwindowed.logits(unwindowed.forward(ids)) - expected).abs().max() > 1e-3
    with pytest.raises(ValueError, match="body 'fused' runs the Llama / Qwen layer; this model's sliding-window "
                                         "layers run on the 'eager', 'compiled' or 'persistent' body"):
        Decoder.from_hf(hf_model("mistral", dtype=torch.float32), max_len=8).body = "fused"
    # Without a window (Mistral 7B v0.2 on, Mistral Small) it is a Llama layer, which every body runs.
    full = copy.deepcopy(model)
    full.config.sliding_window = None
    with torch.no_grad():
        expected = full(input_ids=ids.view(1, -1)).logits[0]
    decoder = Decoder.from_hf(full, max_len=24)
    assert (decoder.config.sliding_layers, decoder.config.sliding_window) == ((), None)
    torch.testing.assert_close(decoder.logits(decoder.forward(ids)), expected, rtol=1e-5, atol=1e-5)
    assert Decoder.from_hf(full.float(), max_len=8).bodies == BODIES
    # Ministral: a Llama layer with the window in the layers its layer_types name.
    assert DecoderConfig.from_hf(hf_model("ministral").config).sliding_layers == (1,)


@pytest.mark.parametrize("arch", ["mistral", "ministral", "phi3", "qwen2"])
def test_bias_flags_a_config_carries_are_ignored_where_transformers_builds_no_biases(arch):
    # They were refused (attention or MLP biases) for models that have none, or (Qwen2) only the
    # q/k/v biases the decoder applies, whatever the flags say.
    model = copy.deepcopy(hf_model(arch))
    model.config.attention_bias = model.config.mlp_bias = True
    biases = {name.split(".", 3)[-1] for name, _ in model.named_parameters() if name.endswith("bias")}
    assert biases == ({f"self_attn.{x}_proj.bias" for x in "qkv"} if arch == "qwen2" else set())
    decoder = Decoder.from_hf(model, max_len=24)
    ids = prompt(7, length=9)
    with torch.no_grad():
        expected = model(input_ids=ids.view(1, -1)).logits[0]
    torch.testing.assert_close(decoder.logits(decoder.forward(ids)), expected, rtol=1e-5, atol=1e-5)
    # A Llama's and a Granite's flags do build biases, which the decoder does not implement.
    for other in ("llama", "granite"):
        config = copy.deepcopy(hf_model(other).config)
        config.mlp_bias = True
        with pytest.raises(ValueError, match="config.mlp_bias set: attention or MLP biases, which the fast decoder does not "
                                             "implement"):
            DecoderConfig.from_hf(config)


@pytest.mark.parametrize("arch", ["llama", "granite", "mistral", "phi3"])
def test_layer_types_a_llama_or_mistral_config_carries_are_ignored_as_transformers_does(arch):
    """transformers' Llama and Granite mask no layer to a window and Mistral and Phi-3 every one (a config's
    layer_types aside): the decoder built the windows those layer_types named and missed
    transformers' logits."""
    model = copy.deepcopy(hf_model(arch))
    model.config.sliding_window = 5
    model.config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    decoder = Decoder.from_hf(model, max_len=24)
    assert decoder.config.sliding_layers == (() if arch in ("llama", "granite") else (0, 1, 2))
    ids = prompt(6, length=17)
    with torch.no_grad():
        expected = model(input_ids=ids.view(1, -1)).logits[0]
    torch.testing.assert_close(decoder.logits(decoder.forward(ids)), expected, rtol=1e-5, atol=1e-5)


def test_gemma3_early_exit_and_the_bodies_it_runs():
    model = hf_model("gemma3", dtype=torch.float32)
    one = Decoder.from_hf(model, max_len=16, num_layers=2)
    assert one.config.sliding_layers == (1,) and one.config.num_layers == 2
    ids = prompt(3, length=9)
    with torch.no_grad():
        hidden = model(input_ids=ids.view(1, -1), output_hidden_states=True).hidden_states[2][0]
        expected = model.model.norm(hidden)
    torch.testing.assert_close(one.forward(ids), expected, rtol=1e-5, atol=1e-5)
    first = Decoder.from_hf(model, max_len=16, num_layers=1).config  # a full-attention layer only
    assert (first.sliding_layers, first.sliding_window, first.sliding_rope_inv_freq) == ((), None, None)
    assert one.bodies == ("eager", "compiled", "persistent")
    assert Decoder.from_hf(hf_model("qwen3", dtype=torch.float32), max_len=8).bodies == BODIES
    with pytest.raises(ValueError, match="body 'fused' runs the Llama / Qwen layer; this model's GELU, post-norms, "
                                         "sliding-window layers run on the 'eager', 'compiled' or 'persistent' body"):
        one.body = "fused"
    assert one.body == "eager"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cache_roll_back_by_length_and_verify_argmaxes(arch):
    model = hf_model(arch)
    decoder = Decoder.from_hf(model, max_len=32)
    ids = prompt(2, length=12)
    decoder.forward(ids[:8])
    decoder.length += 8
    # A rejected block: written into the cache, then dropped by moving the length back.
    decoder.forward(prompt(3, length=4))
    decoder.length += 4
    decoder.length -= 4
    verify = decoder.argmax(decoder.forward(ids[8:]))
    with torch.no_grad():
        expected = model(input_ids=ids.view(1, -1)).logits[0, 8:].argmax(-1)
    assert verify.tolist() == expected.tolist()
    fresh = Decoder.from_hf(model, max_len=32)
    fresh.forward(ids[:8])
    fresh.length += 8
    torch.testing.assert_close(decoder.logits(decoder.forward(ids[8:])), fresh.logits(fresh.forward(ids[8:])), rtol=0, atol=0)


def test_early_exit_layers_and_state_dict_loading():
    model = hf_model("llama")
    one = Decoder.from_hf(model, max_len=16, num_layers=1)
    assert one.config.num_layers == 1 and len(one.layers) == 1
    ids = prompt(4, length=5)
    with torch.no_grad():
        hidden = model(input_ids=ids.view(1, -1), output_hidden_states=True).hidden_states[1][0]
        expected = model.model.norm(hidden)
    torch.testing.assert_close(one.forward(ids), expected, rtol=1e-6, atol=1e-6)
    # A state dict without the "model." prefix (the body's own) plus a separate head.
    body = {k[len("model."):]: v for k, v in model.state_dict().items() if k.startswith("model.")}
    loaded = Decoder.from_state_dict(model.config, {**body, "lm_head.weight": model.lm_head.weight}, max_len=16, dtype=torch.float32)
    assert loaded.dtype == torch.float32 and torch.equal(loaded.lm_head, model.lm_head.weight.float())
    # The config says untied: without the head's key, tying it to the input embedding would give wrong logits.
    with pytest.raises(ValueError, match="state_dict has no 'lm_head.weight'.*tie_word_embeddings=False"):
        Decoder.from_state_dict(model.config, body, max_len=16)
    # A torch.compile'd model: its wrapper's state dict prefixes every key with "_orig_mod.".
    compiled = Decoder.from_hf(torch.compile(model), max_len=16, num_layers=1)
    torch.testing.assert_close(compiled.forward(ids), expected, rtol=1e-6, atol=1e-6)


def test_a_decoder_built_in_inference_mode_runs_outside_it_and_ignores_autocast():
    # Its cache was made of inference tensors, which reset() and the eager layer's cache writes
    # refused outside inference mode; under autocast those writes failed on bfloat16 keys, and its
    # logits were autocast's.
    config = DecoderConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=8)
    ids = torch.randint(0, 97, (19,), generator=torch.Generator().manual_seed(4))  # past STEP_MAX_TOKENS: the eager layer
    with torch.inference_mode():
        built_there = Decoder.random(config, max_len=32, dtype=torch.float32, device="cpu", seed=3)
    plain = Decoder.random(config, max_len=32, dtype=torch.float32, device="cpu", seed=3)
    expected = plain.logits(plain.forward(ids))
    built_there.reset(0)
    assert torch.equal(built_there.logits(built_there.forward(ids)), expected)
    plain.reset(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = plain.logits(plain.forward(ids))
    assert under_autocast.dtype == torch.float32 and torch.equal(under_autocast, expected)
    runner = FastSpeculativeDecoder(plain, Decoder.random(config.first_layers(1), max_len=32, dtype=torch.float32,
                                                          device="cpu", seed=3), k=3)
    tokens = runner.generate(ids, max_new_tokens=6).tokens
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert runner.generate(ids, max_new_tokens=6).tokens == tokens


@pytest.mark.parametrize("tied", [True, False])
def test_nbytes_counts_every_weight_once(tied):
    config = DecoderConfig(vocab_size=23, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                           head_dim=4, tie_word_embeddings=tied)
    decoder = Decoder.random(config, max_len=4, dtype=torch.float32, device="cpu")
    layers = sum(t.numel() * t.element_size() for t in decoder.stacked.values())
    embedding, final_norm = 23 * 8 * 4, 8 * 4
    assert decoder.nbytes == layers + final_norm + embedding * (1 if tied else 2)  # a tied head is the embedding


def test_decoder_bad_arguments_name_the_argument(monkeypatch):
    model = hf_model("llama")
    for bad in (0, 2**63, 1.0):
        with pytest.raises(ValueError, match=rf"max_len must be an int in 1..2\*\*63 - 1, got {bad!r}"):
            Decoder.from_hf(model, max_len=bad)
    with pytest.raises(ValueError, match="attention must be one of"):
        Decoder.from_hf(model, max_len=8).attention = "flash"
    decoder = Decoder.from_hf(model, max_len=8)
    decoder.reset(8)  # a full cache
    for bad in (9, -1, 2.0, True):  # checked on the host: a forward past max_len cannot be (docstring)
        with pytest.raises(ValueError, match=r"length must be an int in 0..8 \(max_len\), got"):
            decoder.reset(bad)
    assert int(decoder.length) == 8
    with pytest.raises(ValueError, match="num_layers must be an int in 1..3"):
        Decoder.from_hf(model, max_len=8, num_layers=4)
    with pytest.raises(ValueError, match=r"the model's dtype \(its weights'\) must be one of .*, got torch.int32"):
        Decoder.from_hf(model, max_len=8, dtype=torch.int32)
    decoder.reset(0)
    for body in decoder.bodies:  # the ids are checked before any body reads them
        decoder.body = body
        for bad, what, error in ((torch.tensor([[1, 2]]), "a 2-d torch.int64 tensor of 2 ids", ValueError),
                                 ([1, 2], "list", TypeError),
                                 (torch.tensor([1.0]), "a 1-d torch.float32 tensor of 1 ids", ValueError),
                                 (torch.empty(0, dtype=torch.int64), "a 1-d torch.int64 tensor of 0 ids", ValueError)):
            with pytest.raises(error, match=f"ids must be a non-empty 1-d int32 or int64 tensor, got {what}"):
                decoder.forward(bad)
        with pytest.raises(ValueError, match="ids must be on the model's device cpu, got meta"):
            decoder.forward(torch.tensor([1], device="meta"))
        with pytest.raises(ValueError, match="ids holds 9 tokens, more than the cache's max_len 8"):
            decoder.forward(torch.arange(9))
    assert int(decoder.length) == 0
    full = decoder.forward(torch.arange(8))  # exactly max_len ids fill the whole cache
    assert full.shape == (8, decoder.config.hidden_size) and bool(torch.isfinite(full).all())
    with pytest.raises(TypeError, match="model must be a transformers causal LM"):
        Decoder.from_hf(torch.nn.Linear(2, 2), max_len=8)
    gemma = transformers.GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="config must be a llama, mistral, ministral, phi3, granite, qwen2, qwen3, gemma2, "
                                         "gemma3_text config .the fast decoder's family., got model_type 'gemma'"):
        DecoderConfig.from_hf(gemma)
    gemma3 = hf_model("gemma3").config
    # transformers' Gemma-3 keeps attn_logit_softcapping unapplied (5.24); Gemma-2 applies it.
    for name, value in (("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True)):
        with pytest.raises(ValueError, match=f"config.{name} is set .{value}., which the fast decoder does not implement "
                                             "for gemma3_text"):
            DecoderConfig.from_hf(gemma3.__class__(**{**gemma3.to_dict(), name: value}))
    gemma2 = hf_model("gemma2").config
    with pytest.raises(ValueError, match="config.use_bidirectional_attention is set .True., which the fast decoder does "
                                         "not implement for gemma2"):
        DecoderConfig.from_hf(gemma2.__class__(**{**gemma2.to_dict(), "use_bidirectional_attention": True}))
    with pytest.raises(ValueError, match="config.hidden_activation must be 'gelu_pytorch_tanh', got 'silu'"):
        DecoderConfig.from_hf(gemma3.__class__(**{**gemma3.to_dict(), "hidden_activation": "silu"}))
    dynamic_local = gemma3.to_dict()
    dynamic_local["rope_parameters"] = dict(dynamic_local["rope_parameters"], sliding_attention=dict(rope_type="dynamic", factor=2.0, rope_theta=50.0))
    with pytest.raises(ValueError, match="config's sliding_attention rope_type 'dynamic' is not implemented"):
        DecoderConfig.from_hf(gemma3.__class__(**dynamic_local))
    dynamic = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, rope_scaling=dict(rope_type="dynamic", factor=2.0))
    with pytest.raises(ValueError, match="rope_type 'dynamic' is not implemented by the fast decoder"):
        DecoderConfig.from_hf(dynamic)
    partial = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                                                                   partial_rotary_factor=0.5))
    with pytest.raises(ValueError, match="partial_rotary_factor is 0.5; the fast decoder rotates the whole head"):
        DecoderConfig.from_hf(partial)
    with pytest.raises(ValueError, match=r"rope_inv_freq must be None or a tuple of head_dim / 2 = 1 floats positive "
                                         "and finite in float32"):
        DecoderConfig(10, 8, 8, 1, 4, 4, 2, rope_inv_freq=(1.0, 0.5))
    for freq in (float("nan"), 1e39, 1e-50):  # the tables are float32: inf or 0 there
        with pytest.raises(ValueError, match=r"rope_inv_freq must be None or a tuple"):
            DecoderConfig(10, 8, 8, 1, 4, 4, 2, rope_inv_freq=(freq,))
    with pytest.raises(ValueError, match="num_heads .6. must be a multiple of num_kv_heads .4."):
        DecoderConfig(10, 8, 8, 1, 6, 4, 2)
    with pytest.raises(ValueError, match=r"sliding_rope_inv_freq must be None or a tuple of head_dim / 2 = 1"):
        DecoderConfig(10, 8, 8, 1, 4, 4, 2, sliding_rope_inv_freq=(1.0, 0.5))
    for name, bad in (("rope_theta", 0.0), ("rope_theta", float("nan")), ("rope_theta", True)):
        with pytest.raises(ValueError, match=f"{name} must be a finite positive float, got {bad}"):
            DecoderConfig(10, 8, 8, 1, 4, 4, 2, **{name: bad})
    # Factors the kernels take as float32: a finite double that is inf or 0 there (1e39, 1e-50) made
    # every body's logits NaN.
    sliding = dict(sliding_window=4, sliding_layers=(0,), sliding_rope_inv_freq=(0.5,))
    for name in ("rope_attention_scaling", "sliding_rope_attention_scaling", "embed_scale", "attention_scale",
                 "logits_scaling"):
        for bad in (0.0, -1.0, float("inf"), float("nan"), 1e39, 1e-50, "2.0"):
            with pytest.raises(ValueError, match=rf"^{name} must be (None \(1 / sqrt\(head_dim\)\) or )?a positive number "
                                                 rf"finite in float32, got {re.escape(repr(bad))}$"):
                DecoderConfig(10, 8, 8, 1, 4, 4, 2, **sliding, **{name: bad})
        assert getattr(DecoderConfig(10, 8, 8, 1, 4, 4, 2, **sliding, **{name: 3.4e38}), name) == 3.4e38
    # numpy floats (a transformers config may hold them) kept as the Python floats the ops take.
    numpy_config = DecoderConfig(10, 8, 8, 1, 4, 4, 2, rms_norm_eps=np.float64(1e-5), attention_scale=np.float32(0.5),
                                 rope_theta=np.float64(1e4), embed_scale=2)
    assert [type(getattr(numpy_config, name)) for name in ("rms_norm_eps", "attention_scale", "rope_theta", "embed_scale")] \
        == [float] * 4
    for name in ("vocab_size", "hidden_size", "num_layers"):
        with pytest.raises(ValueError, match=f"^{name} must be an int in 1..2\\*\\*63 - 1, got 18446744073709551616$"):
            DecoderConfig(**{**dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=4,
                                    num_kv_heads=4, head_dim=2), name: 2**64})
    for name in ("rope_theta", "rms_norm_eps", "embed_scale", "attn_logit_softcapping"):
        with pytest.raises(ValueError, match=f"^{name} must be a float, got an int of 1329 bits, too large for one$"):
            DecoderConfig(10, 8, 8, 1, 4, 4, 2, **{name: 10**400})
    for bad in (-1e-6, float("inf"), None, "1e-6"):
        with pytest.raises(ValueError, match=f"rms_norm_eps must be a finite float >= 0, got {bad!r}"):
            DecoderConfig(10, 8, 8, 1, 4, 4, 2, rms_norm_eps=bad)
    assert DecoderConfig(10, 8, 8, 1, 4, 4, 2, rms_norm_eps=0).rms_norm_eps == 0  # as torch's rms_norm takes it
    # A string would otherwise reach Tensor.to(), which reads it as a device.
    with pytest.raises(TypeError, match=r"dtype must be a torch.dtype .*, got str 'float32'"):
        Decoder.from_hf(model, max_len=8, dtype="float32")
    with pytest.raises(TypeError, match=r"dtype must be a torch.dtype .*, got str 'cpu'"):
        Decoder.random(decoder.config, max_len=8, dtype="cpu", device="cpu")
    # The default device is "cuda": named, not a driver error from torch. A machine without GPUs is
    # stood in for on any machine, so GPU machines check it too.
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "device_count", lambda: 0)
        patch.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(ValueError, match=r"device 'cuda' \(the default is 'cuda'\): no CUDA device here .*; pass "
                                             r"device='cpu'$"):
            Decoder.random(decoder.config, max_len=8, dtype=torch.float32)
        with pytest.raises(ValueError, match=r"device 'cuda': no CUDA device here .*; pass device='cpu'$"):
            Decoder.from_hf(model, max_len=8, device="cuda")
    for dtype, std in ((torch.float32, 0), (torch.float32, -1.0), (torch.float32, float("nan")), (torch.float32, "0.02"),
                       (torch.float32, 1e39), (torch.float32, 1e-50), (torch.float16, 1e4), (torch.float16, 1e-9),
                       (torch.float32, 10**400)):
        with pytest.raises(ValueError, match=rf"std must be a number in .* for {dtype} \(the weights are never zeros nor "
                                             rf"infinite\), got {re.escape(repr(std)[:40])}$"):
            Decoder.random(decoder.config, max_len=8, device="cpu", dtype=dtype, std=std)
    for dtype in (torch.int32, torch.bool, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match=rf"dtype must be one of .*, got {dtype}"):
            Decoder.random(decoder.config, max_len=8, device="cpu", dtype=dtype)
    with pytest.raises(ValueError, match="max_len must be an int in 1..2"):  # before the weights are drawn
        Decoder.random(DecoderConfig(10**9, 8, 8, 1, 4, 4, 2), max_len=0, device="cpu")
    with pytest.raises(ValueError, match="^device 'meta': a meta device holds no values; the fast decoder runs on 'cpu' or 'cuda'$"):
        Decoder.random(decoder.config, max_len=8, device="meta")
    # A scale finite in float32 but inf in a float16 model, which Gemma's embed_scale_in_model_dtype rounds it to.
    with pytest.raises(ValueError, match=r"embed_scale 100000.0 is inf in the model's dtype torch.float16"):
        Decoder.random(DecoderConfig(10, 8, 8, 1, 4, 4, 2, embed_scale=1e5), max_len=8, device="cpu", dtype=torch.float16)
    assert Decoder.random(DecoderConfig(10, 8, 8, 1, 4, 4, 2, embed_scale=1e5, embed_scale_in_model_dtype=False), max_len=8,
                          device="cpu", dtype=torch.float16)._embed_scale == 1e5
    with pytest.raises(TypeError, match="seed must be a Python int"):
        Decoder.random(decoder.config, max_len=8, device="cpu", seed=1.5)
    ids = torch.tensor([3, 1], device=decoder.device)
    for start, got in ((3, "int"), (torch.tensor(3, dtype=torch.int32), "a 0-d torch.int32 tensor on cpu"),
                       (torch.tensor([3]), "a 1-d torch.int64 tensor on cpu")):
        with pytest.raises(TypeError, match=rf"start must be a 0-d int64 tensor on the model's device cpu, got {re.escape(got)}"):
            decoder.forward(ids, start=start)
    with pytest.raises(ValueError, match=r"hidden_act must be one of \('silu', 'gelu_tanh'\), got 'gelu'"):
        DecoderConfig(10, 8, 8, 1, 4, 4, 2, hidden_act="gelu")
    for bad in ((2,), (0, 0), [0], (True,)):
        with pytest.raises(ValueError, match=r"sliding_layers must be a tuple of distinct layer indices in 0..1"):
            DecoderConfig(10, 8, 8, 2, 4, 4, 2, sliding_window=4, sliding_layers=bad)
    for bad in (None, 0, 2**63, True):
        with pytest.raises(ValueError, match=rf"sliding_window must be an int in 1..2\*\*63 - 1 \(None where no layer "
                                             rf"slides\), got {bad!r}"):
            DecoderConfig(10, 8, 8, 2, 4, 4, 2, sliding_window=bad, sliding_layers=(1,))
    with pytest.raises(ValueError, match=r"sliding_window must be an int in 1..2\*\*63 - 1 .*, got -1"):
        DecoderConfig(10, 8, 8, 2, 4, 4, 2, sliding_window=-1)
    # Sliding settings with no sliding layer would apply to none: refused rather than ignored.
    with pytest.raises(ValueError, match="^sliding_window set, but sliding_layers names no layer for them$"):
        DecoderConfig(10, 8, 8, 2, 4, 4, 2, sliding_window=2)
    with pytest.raises(ValueError, match="^sliding_window and sliding_rope_inv_freq set, but sliding_layers names no layer"):
        DecoderConfig(10, 8, 8, 2, 4, 4, 2, sliding_window=2, sliding_rope_inv_freq=(0.5,))
    with pytest.raises(ValueError, match=r"sliding_rope_attention_scaling is 50.0, but it scales sliding_rope_inv_freq's "
                                         r"tables only, and that is None"):
        DecoderConfig(10, 8, 8, 2, 4, 4, 2, sliding_window=2, sliding_layers=(1,), sliding_rope_attention_scaling=50.0)
    # The stacked weights must hold the norms the config names: the layer applies the ones it finds.
    weights = dict(embed=decoder.embed, lm_head=decoder.lm_head, final_norm=decoder.final_norm, layers=decoder.stacked)
    # A malformed weights mapping: named, not a KeyError from inside.
    for bad, got in ((list(weights.values()), "got list"), ({**weights, "layers": list(weights["layers"].values())},
                                                            "'layers' a list"),
                     ({k: v for k, v in weights.items() if k != "lm_head"}, "with keys ['embed', 'final_norm', 'layers']")):
        with pytest.raises(TypeError, match=rf"weights must be a mapping with keys \['embed', 'lm_head', 'final_norm', "
                                            rf"'layers'\].*{re.escape(got)}"):
            Decoder(decoder.config, bad, max_len=8)
    with pytest.raises(ValueError, match=r"weights\['layers'\] must hold .* \(qk_norm=True, qkv_bias=False, post_norms=False\), got"):
        Decoder(dataclasses.replace(decoder.config, qk_norm=True), weights, max_len=8)
    with pytest.raises(ValueError, match="state_dict has no 'model.layers.0.mlp.down_proj.weight'"):
        state = dict(model.state_dict())
        del state["model.layers.0.mlp.down_proj.weight"]
        Decoder.from_state_dict(model.config, state, max_len=8)
    # A transformers config where a DecoderConfig is taken: named, not an AttributeError from deep inside.
    for build in (lambda: Decoder.random(model.config, max_len=8, device="cpu"), lambda: Decoder(model.config, weights, max_len=8)):
        with pytest.raises(TypeError, match="config must be a flashhead_ext.fast.DecoderConfig .*, got LlamaConfig"):
            build()
    # More layers than the config's is another model's config, unless num_layers asks for an early exit.
    shorter = transformers.LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": 2})
    with pytest.raises(ValueError, match=r"state_dict holds layer 2 but the config has 2 layers .*pass num_layers=2"):
        Decoder.from_state_dict(shorter, model.state_dict(), max_len=8)
    assert Decoder.from_state_dict(shorter, model.state_dict(), max_len=8, num_layers=2).config.num_layers == 2
    # Weights of other sizes than the config's (which the kernels index by) are refused by name.
    wider = transformers.LlamaConfig(**{**model.config.to_dict(), "intermediate_size": model.config.intermediate_size + 2})
    with pytest.raises(ValueError, match=re.escape(f"state_dict's 'model.layers.0.mlp.gate_proj.weight' must be a floating-point "
                                                   f"tensor of shape [{wider.intermediate_size}, 48] (the config's sizes), "
                                                   f"got {decoder.dtype} [{model.config.intermediate_size}, 48]")):
        Decoder.from_state_dict(wider, model.state_dict(), max_len=8)
    for name, bad, error in (("final_norm", decoder.final_norm[:-1], ValueError), ("lm_head", decoder.lm_head.float(), ValueError),
                             ("embed", decoder.embed[:, :-1], ValueError), ("lm_head", decoder.lm_head.to("meta"), ValueError),
                             ("final_norm", [1.0] * 48, TypeError)):
        with pytest.raises(error, match=rf"weights {name} must be"):
            Decoder(decoder.config, {**weights, name: bad}, max_len=8)
    for name in ("qkv", "down", "attn_norm"):
        expected = list(decoder.stacked[name].shape)
        narrower = torch.ones(*expected[:-1], expected[-1] - 1, dtype=decoder.dtype)
        with pytest.raises(ValueError, match=re.escape(f"weights layers[{name!r}] must be {decoder.dtype} {expected}")):
            Decoder(decoder.config, {**weights, "layers": {**decoder.stacked, name: narrower}}, max_len=8)
    # Rows that disagree with config.vocab_size (which the runner's vocabulary checks read).
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        state = dict(model.state_dict(), **{key: model.state_dict()[key][:90]})
        with pytest.raises(ValueError, match=rf"state_dict's '{key}' must be .* of shape \[{VOCAB}, 48\] \(the config's "
                                             rf"sizes\), got .* \[90, 48\]"):
            Decoder.from_state_dict(model.config, state, max_len=8)


def test_from_hf_shares_the_vocabulary_matrices_and_copies_the_layers():
    # As the docstrings say (they said every weight was copied): a target and its early-exit draft
    # built from one model hold one copy of the embedding and head, the model's; the layers are the
    # decoders' own.
    model = hf_model("llama")
    target, draft = Decoder.from_hf(model, max_len=16), Decoder.from_hf(model, max_len=16, num_layers=1)
    for name, weight in (("embed", model.model.embed_tokens.weight), ("lm_head", model.lm_head.weight),
                         ("final_norm", model.model.norm.weight)):
        assert getattr(target, name).data_ptr() == getattr(draft, name).data_ptr() == weight.data_ptr(), name
    model_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not {w.untyped_storage().data_ptr() for w in [*target.stacked.values(), *draft.stacked.values()]} & model_storages
    # A cast or move makes them the decoder's own.
    assert Decoder.from_hf(model, max_len=16, dtype=torch.float32).embed.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    # So does a view that is not contiguous: the heads and ops take contiguous rows (a DenseHead over
    # such a head warns that every call copies it).
    state = model.state_dict()
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        state[key] = state[key].T.contiguous().T
        assert not state[key].is_contiguous() and torch.equal(state[key], model.state_dict()[key])
    from_views = Decoder.from_state_dict(model.config, state, max_len=16)
    for name, weight in (("embed", model.model.embed_tokens.weight), ("lm_head", model.lm_head.weight)):
        assert getattr(from_views, name).is_contiguous() and torch.equal(getattr(from_views, name), weight), name


def test_from_state_dict_checks_every_layers_weights():
    # Layers past the first were copied into layer 0's shape, which broadcast a smaller weight,
    # and integer tensors were rounded into weights, without a word.
    model = hf_model("llama")
    state = model.state_dict()
    d, inter = model.config.hidden_size, model.config.intermediate_size
    q_rows = model.config.num_attention_heads * model.config.head_dim
    for key, bad, shape in (("model.layers.1.input_layernorm.weight", torch.ones(1, dtype=torch.float64), [d]),
                            ("model.layers.2.mlp.down_proj.weight", torch.ones(d, 1, dtype=torch.float64), [d, inter]),
                            ("model.layers.1.self_attn.q_proj.weight", torch.ones(q_rows, d, dtype=torch.int64), [q_rows, d]),
                            ("model.layers.0.self_attn.o_proj.weight", torch.tensor(1.0, dtype=torch.float64), [d, q_rows]),
                            ("model.norm.weight", torch.ones(d + 1, dtype=torch.float64), [d])):
        with pytest.raises(ValueError, match=re.escape(f"state_dict's {key!r} must be a floating-point tensor of shape "
                                                       f"{shape} (the config's sizes), got {bad.dtype} {list(bad.shape)}")):
            Decoder.from_state_dict(model.config, {**state, key: bad}, max_len=8)
    key = "model.layers.1.post_attention_layernorm.weight"
    for bad in (np.ones(d), None):
        with pytest.raises(TypeError, match=re.escape(f"state_dict's {key!r} must be a torch.Tensor [{d}], got "
                                                      f"{type(bad).__name__}")):
            Decoder.from_state_dict(model.config, {**state, key: bad}, max_len=8)
    # The embedding's dtype and device are the defaults: read from a numpy array (a state dict of
    # safetensors.numpy) or a list, they gave torch's "empty(): argument 'dtype' must be torch.dtype"
    # or an AttributeError.
    key, shape = "model.embed_tokens.weight", [model.config.vocab_size, d]
    for bad_state in ({name: w.numpy() for name, w in state.items()}, {**state, key: state[key].tolist()}):
        with pytest.raises(TypeError, match=re.escape(f"state_dict's {key!r} must be a torch.Tensor {shape}, got "
                                                      f"{type(bad_state[key]).__name__}")):
            Decoder.from_state_dict(model.config, bad_state, max_len=8)
    for bad in (None, list(state.items())):
        with pytest.raises(TypeError, match=f"state_dict must be a mapping of weight names to torch.Tensors .*, got "
                                            f"{type(bad).__name__}"):
            Decoder.from_state_dict(model.config, bad, max_len=8)
    with pytest.raises(TypeError, match=re.escape("config must be a transformers config object (model.config, "
                                                  "AutoConfig.from_pretrained(...)), got a dict")):
        Decoder.from_state_dict(model.config.to_dict(), state, max_len=8)


def test_decoder_over_parameters_keeps_its_cache_out_of_autograd():
    # Parameters given to Decoder() made every cache write part of an autograd graph that each
    # forward outside no_grad extended.
    decoder = Decoder.from_hf(hf_model("llama"), max_len=16)
    weights = dict(embed=torch.nn.Parameter(decoder.embed), lm_head=torch.nn.Parameter(decoder.lm_head),
                   final_norm=torch.nn.Parameter(decoder.final_norm),
                   layers={name: torch.nn.Parameter(w) for name, w in decoder.stacked.items()})
    over_parameters = Decoder(decoder.config, weights, max_len=16)
    for token in prompt(4, length=3):
        hidden = over_parameters.forward(token.view(1))
        over_parameters.length += 1
    assert not hidden.requires_grad and not over_parameters.k_cache.requires_grad and over_parameters.k_cache.grad_fn is None
    assert not over_parameters.logits(hidden).requires_grad  # the untied head too
    torch.testing.assert_close(hidden, decoder.forward(prompt(4, length=3))[-1:], rtol=1e-12, atol=1e-12)


def test_decoder_device_argument_is_named_when_unusable(monkeypatch):
    model = hf_model("llama")
    config = DecoderConfig.from_hf(model.config)
    for bad, why in (("cpu0", "a torch.device or a device string"), (None, "a torch.device or a device string"),
                     (3.5, "a torch.device or a device string"), ("mps", "runs on 'cpu' or 'cuda' devices"),
                     ("xpu", "runs on 'cpu' or 'cuda' devices")):
        with pytest.raises(ValueError, match=re.escape(why)):
            Decoder.random(config, max_len=8, device=bad)
    with pytest.raises(ValueError, match=re.escape("runs on 'cpu' or 'cuda' devices")):
        Decoder.from_hf(model, max_len=8, device="mps")
    # Past the last GPU: named, not an invalid-ordinal error while weights are copied. GPUs are counted at
    # the call, so any machine stands in for one with 1 or 2 (only GPU machines had run this). A device
    # the caller chose carries no note on the default, which it is not.
    for gpus, devices in ((1, "1 CUDA device"), (2, "2 CUDA devices")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        with pytest.raises(ValueError, match=re.escape(f"device 'cuda:{gpus}': this machine has {devices}")):
            Decoder.random(config, max_len=8, device=f"cuda:{gpus}")


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_from_state_dict_refuses_weights_the_config_leaves_unread(arch):
    # A Llama config of the same sizes over Qwen3's q/k norms or Qwen2's biases built a model that
    # skipped them, and decoded other tokens than the real one, without a word.
    model = hf_model(arch)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "tie_word_embeddings", "max_position_embeddings")
    llama = transformers.LlamaConfig(**{name: getattr(model.config, name) for name in fields
                                        if getattr(model.config, name, None) is not None})
    unread = "self_attn.q_norm.weight" if arch == "qwen3" else "self_attn.k_proj.bias"
    with pytest.raises(ValueError, match=f"state_dict holds weights a llama config .* does not use, e.g. .*{re.escape(unread)}"):
        Decoder.from_state_dict(llama, model.state_dict(), max_len=8)
    assert Decoder.from_state_dict(model.config, model.state_dict(), max_len=8).config.num_layers == 3
    # A tied config over an untied head: its lm_head.weight would have been ignored.
    untied = dict(model.state_dict(), **{"lm_head.weight": torch.randn_like(model.lm_head.weight)})
    if model.config.tie_word_embeddings:
        with pytest.raises(ValueError, match="ties the head to the input embedding .* 'lm_head.weight' differs from it"):
            Decoder.from_state_dict(model.config, untied, max_len=8)


def test_from_hf_warns_that_an_attached_flashhead_is_not_carried(tmp_path, monkeypatch):
    from flashhead_ext.hf import attach

    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model = copy.deepcopy(hf_model("llama")).float()
    attachment = attach(model, probes=2, cluster_size=8, progress=False)
    with pytest.warns(UserWarning, match="model has a FlashHead attached .* its tokens are the dense head's"):
        decoder = Decoder.from_hf(model, max_len=8)
    assert torch.equal(decoder.lm_head, model.lm_head.weight)  # the dense weight, as the warning says
    attachment.enabled = False  # the dense head again: nothing to warn of
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Decoder.from_hf(model, max_len=8)


# ---- the runner --------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def fast_models(arch: str):
    target = Decoder.from_hf(hf_model(arch), max_len=48)
    drafts = dict(self=Decoder.from_hf(hf_model(arch), max_len=48), early=Decoder.from_hf(hf_model(arch), max_len=48, num_layers=1),
                  other=Decoder.from_hf(hf_model(arch, seed=1), max_len=48))
    return target, drafts


@functools.lru_cache(maxsize=None)
def persistent_self_draft():
    """qwen3's target weights in float32 (the body's dtypes) as a draft on the persistent body
    (one propose graph)."""
    draft = Decoder.from_hf(hf_model("qwen3", dtype=torch.float32), max_len=48)
    draft.body = "persistent"
    return draft


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["llama", "mistral", "phi3", "granite", "qwen2-sliding", "qwen3", "gemma2", "gemma3"])
def test_fast_runner_is_exact_in_every_mode(arch, mode):
    target, drafts = fast_models(arch)
    for k in range(1, 7):
        kind, head = ("self", "early", "other")[k % 3], ("dense", "flashhead")[(k // 3) % 2]
        runner = FastSpeculativeDecoder(target, drafts[kind], head_for(drafts[kind], head), k=k)
        gen = runner.generate(prompt(k), mode=mode, max_new_tokens=NEW)
        assert tuple(gen.tokens) == reference(arch, k), (k, kind, head)
        check_counters(gen, mode, 0 if mode == "baseline" else k, NEW)
        if kind == "self" and head == "dense" and mode != "baseline":
            # The target's own weights: every emitted token but a round's bonus is an accepted proposal
            # (the last round's budget cut leaves some proposals unemitted, hence not counted).
            assert gen.stats.accepted_per_round == [min(e, k) for e in gen.stats.emitted_per_round]
        if mode == "baseline":
            break


def test_from_hf_refuses_an_output_head_that_is_more_than_its_weight():
    # The decoder computes hidden . weight: a head with its own forward decoded other tokens without a word.
    model = copy.deepcopy(hf_model("llama"))
    scaled = PerTokenScaledHead(model.lm_head.in_features, model.lm_head.out_features, bias=False, dtype=model.lm_head.weight.dtype)
    scaled.weight = model.lm_head.weight
    model.lm_head = scaled
    with pytest.raises(ValueError, match="model's output head is a PerTokenScaledHead, whose forward is its own"):
        Decoder.from_hf(model, max_len=16)
    # A body without a head of its own (tied: its embedding serves) has nothing to refuse.
    body = copy.deepcopy(hf_model("llama"))
    body.config.tie_word_embeddings = True
    Decoder.from_hf(transformers.LlamaModel(body.config), max_len=16)


def test_from_hf_refuses_a_task_model_and_names_the_family_first():
    # A sequence classifier with a tied config was decoded with its input embedding as an LM head,
    # its own head ("score") unused; a Phi-2 was refused for its head's bias, as if that were all it lacked.
    config = copy.deepcopy(hf_model("llama").config)
    config.tie_word_embeddings, config.num_labels = True, 3
    with pytest.raises(ValueError, match=r"^model is a LlamaForSequenceClassification, whose head is no language-model head"):
        Decoder.from_hf(transformers.LlamaForSequenceClassification(config), max_len=16)
    phi = transformers.PhiForCausalLM(transformers.PhiConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                                            num_hidden_layers=1, num_attention_heads=4))
    assert phi.lm_head.bias is not None
    with pytest.raises(ValueError, match=r"\(the fast decoder's family\), got model_type 'phi'$"):
        Decoder.from_hf(phi, max_len=16)


def test_a_generation_while_another_thread_generates_with_the_same_driver_or_models_is_refused():
    # Both ran over one set of caches and buffers: wrong tokens without an error.
    import threading

    target, drafts = fast_models("llama")
    runner = FastSpeculativeDecoder(target, drafts["early"], k=3)
    inside, leave = threading.Event(), threading.Event()
    real = runner._generate

    def held(*args):
        inside.set()
        assert leave.wait(60)
        return real(*args)

    runner._generate = held
    results = []
    first = threading.Thread(target=lambda: results.append(runner.generate(prompt(1), max_new_tokens=NEW)))
    first.start()
    try:
        assert inside.wait(60)
        sharing_the_target = FastSpeculativeDecoder(target, drafts["self"], k=2)
        for busy in (runner, sharing_the_target):
            with pytest.raises(RuntimeError, match="is generating in another thread"):
                busy.generate(prompt(2), max_new_tokens=NEW)
        other = FastSpeculativeDecoder(*fast_models("qwen3")[:1], k=2)  # models of its own: free to run
        assert tuple(other.generate(prompt(2), mode="baseline", max_new_tokens=NEW).tokens) == reference("qwen3", 2)
    finally:
        leave.set()
        first.join(60)
    assert tuple(results[0].tokens) == reference("llama", 1)
    assert tuple(sharing_the_target.generate(prompt(2), max_new_tokens=NEW).tokens) == reference("llama", 2)


@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
def test_fast_runner_follows_a_changed_k(mode):
    # The steps' buffers are sized by k: a new k rebuilds them (a wrong size had failed mid-generate).
    target, drafts = fast_models("llama")
    runner = FastSpeculativeDecoder(target, drafts["early"], head_for(drafts["early"], "dense"), k=4)
    for k in (2, 6, 4):
        runner.k = k
        gen = runner.generate(prompt(k), mode=mode, max_new_tokens=NEW)
        assert tuple(gen.tokens) == reference("llama", k)
        check_counters(gen, mode, k, NEW)
    with pytest.raises(ValueError, match="k must be >= 1"):
        runner.k = 0
    assert runner.k == 4


@pytest.mark.parametrize("device", DEVICES)
def test_fast_runner_follows_its_draft_heads_new_probes_and_special_tokens(device):
    # A captured graph replays the probes and reads the tensors it was captured with: on a GPU a
    # head's new probes were ignored until k changed, and special tokens loaded with a state dict of
    # another count (a new tensor) were read from the old one.
    model = hf_model("qwen3", dtype=torch.float32)
    target = Decoder.from_hf(model, max_len=48, device=device)
    draft = Decoder.from_hf(model, max_len=48, num_layers=1, device=device)
    head = random_flash_head(draft.lm_head.float(), probes=1)
    runner = FastSpeculativeDecoder(target, draft, head, k=3)

    def accepted(driver) -> list:
        gen = driver.generate(prompt(6), mode="deferred", max_new_tokens=NEW)
        assert tuple(gen.tokens) == reference("qwen3", 6)
        return gen.stats.accepted_per_round

    before = accepted(runner)
    # The target's own tokens as special tokens: always candidates, so the proposals change.
    with_specials = FlashHead(head.embedding, head.centroids, head.cluster_tokens, 1,
                              special_token_ids=sorted(set(reference("qwen3", 6))))
    head.load_state_dict(with_specials.state_dict())
    with_special_tokens = accepted(runner)
    assert with_special_tokens == accepted(FastSpeculativeDecoder(target, draft, head, k=3)) != before
    head.probes = head.num_clusters
    assert accepted(runner) == accepted(FastSpeculativeDecoder(target, draft, head, k=3)) != with_special_tokens


def padded_target_and_short_draft(device: str, dtype: torch.dtype):
    """A Llama target whose last 3 output rows (padding beyond the draft's vocabulary, as Qwen2.5-7B's
    beyond Qwen2.5-0.5B's) are scaled up so that a quarter of its greedy tokens after prompt 5 land
    there, and a draft of its weights without those rows; with those tokens (float64)."""
    # A copy: hf_model is cached, and scaling it in place had changed later tests' references (reference()).
    model = copy.deepcopy(hf_model("llama-aligned"))  # sizes the CUDA persistent body takes
    with torch.no_grad():
        model.lm_head.weight[-3:] *= 1.4
    target = Decoder.from_hf(model, max_len=48, dtype=dtype, device=device)
    draft = first_rows_decoder(model, VOCAB - 3, max_len=48, dtype=dtype, device=device)
    return target, draft, greedy_tokens(model, prompt(5), NEW)


def first_rows_decoder(model, rows: int, **kwargs) -> Decoder:
    """A Decoder of ``model`` with its first ``rows`` vocabulary rows only (a draft without the
    target's padding rows); ``kwargs`` go to ``Decoder.from_state_dict``."""
    state = {name: w[:rows] if name in ("model.embed_tokens.weight", "lm_head.weight") else w
             for name, w in model.state_dict().items()}
    config = type(model.config)(**{**model.config.to_dict(), "vocab_size": rows})
    return Decoder.from_state_dict(config, state, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
def test_a_draft_without_the_targets_padding_rows_is_exact(mode, device):
    on_gpu = device == "cuda"
    target, draft, expected = padded_target_and_short_draft(device, torch.float32 if on_gpu else torch.float64)
    assert sum(t >= VOCAB - 3 for t in expected) >= 3  # the draft is fed ids it has no row for
    for k, body, head in ((2, "eager", "dense"), (4, "persistent" if on_gpu else "eager", "flashhead")):
        draft.body = body
        runner = FastSpeculativeDecoder(target, draft, head_for(draft, head), k=k)
        gen = runner.generate(prompt(5), mode=mode, max_new_tokens=NEW)
        assert tuple(gen.tokens) == expected, (k, body, head)
        if head == "dense":  # its own head's proposals still serve (the random FlashHead's rarely do)
            assert sum(gen.stats.accepted_per_round) > 0
    with pytest.raises(ValueError, match="draft_head must cover the draft's vocabulary of 94 tokens, got 97"):
        FastSpeculativeDecoder(target, draft, DenseHead(target.lm_head.float()))


def test_the_padded_target_leaves_the_cached_model_alone():
    model = hf_model("llama-aligned")
    before = {name: w.clone() for name, w in model.state_dict().items()}
    padded_target_and_short_draft("cpu", torch.float64)
    assert all(torch.equal(w, before[name]) for name, w in model.state_dict().items())


@pytest.mark.parametrize("body", ["eager", "persistent"])  # persistent: deferred launches proposals ahead
@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
def test_eos_inside_a_block_budget_and_tail_step(mode, body):
    arch, k = "qwen3", 4
    target, drafts = fast_models(arch)
    draft = drafts["self"] if body == "eager" else persistent_self_draft()
    ref = reference(arch, 3)
    runner = FastSpeculativeDecoder(target, draft, head_for(draft, "dense"), k=k)
    gen = runner.generate(prompt(3), mode=mode, max_new_tokens=8)  # 1 + 5 + 2: the second block cut
    assert gen.tokens == list(ref[:8]) and gen.stats.emitted_per_round == [5, 2]
    gen = runner.generate(prompt(3), mode=mode, max_new_tokens=7)  # 1 + 5 + 1: the tail step
    assert gen.tokens == list(ref[:7]) and gen.stats.emitted_per_round == [5, 1]
    assert gen.stats.append_calls == (2 if mode == "ordinary" else 1)
    j = next(j for j in range(2, NEW) if ref[j] not in ref[:j] and (j - 1) % (k + 1) != k)
    gen = FastSpeculativeDecoder(target, draft, head_for(draft, "flashhead"), k=k,
                                 eos_token_id=ref[j]).generate(prompt(3), mode=mode, max_new_tokens=NEW)
    assert gen.tokens == list(ref[:j + 1])
    check_counters(gen, mode, k, NEW)


def test_eos_defaults_to_the_models_generation_config():
    """As SpeculativeDecoder and transformers' generate: with no eos_token_id, the target's own EOS
    (kept by Decoder.from_hf from the model's generation config) ends a generation."""
    ref = reference("qwen3", 3)
    j = next(j for j in range(2, NEW) if ref[j] not in ref[:j])
    model = copy.deepcopy(hf_model("qwen3"))
    model.generation_config.eos_token_id = [ref[j], next(t for t in range(VOCAB) if t not in ref)]
    target, draft = Decoder.from_hf(model, max_len=48), Decoder.from_hf(model, max_len=48, num_layers=1)
    assert target.eos_token_id == model.generation_config.eos_token_id
    for mode in MODES:
        gen = FastSpeculativeDecoder(target, draft, head_for(draft, "dense"), k=3).generate(prompt(3), mode=mode, max_new_tokens=NEW)
        assert gen.tokens == list(ref[:j + 1]), mode
    # An explicit [] never stops early.
    assert tuple(FastSpeculativeDecoder(target, eos_token_id=[]).generate(prompt(3), mode="baseline", max_new_tokens=NEW).tokens) == ref
    # Without a generation config (a state dict and its config): the config's EOS, transformers' own fallback.
    model.config.eos_token_id = ref[j]
    assert Decoder.from_state_dict(model.config, model.state_dict(), max_len=8).eos_token_id == ref[j]


def test_logits_processors_of_the_generation_config_are_named_not_applied():
    model = copy.deepcopy(hf_model("llama"))
    model.generation_config.no_repeat_ngram_size = 3
    target = Decoder.from_hf(model, max_len=48)
    assert target.generation_settings == dict(no_repeat_ngram_size=3)
    with pytest.warns(UserWarning, match="the target's generation_config sets no_repeat_ngram_size=3, which generate"):
        FastSpeculativeDecoder(target, Decoder.from_hf(model, max_len=48, num_layers=1), k=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a draft's settings play no part in the tokens
        FastSpeculativeDecoder(Decoder.from_hf(hf_model("llama"), max_len=48), target, k=2)


def test_default_dense_head_of_a_float64_draft_is_float32():
    target, drafts = fast_models("llama")  # float64
    runner = FastSpeculativeDecoder(target, drafts["early"], k=3)
    assert runner.head.embedding.dtype == torch.float32
    assert tuple(runner.generate(prompt(2), mode="deferred", max_new_tokens=NEW).tokens) == reference("llama", 2)


def test_synthetic_acceptance_rate_and_determinism():
    k, rate, new = 4, 0.6, 300
    target = Decoder.from_hf(hf_model("llama"), max_len=312)
    draft = Decoder.from_hf(hf_model("llama", seed=1), max_len=312)  # proposals an argmax verifier would reject
    runner = FastSpeculativeDecoder(target, draft, head_for(draft, "dense"), k=k, synthetic_acceptance=rate, seed=5)
    accepted = tested = 0
    for p in range(2):
        gen = runner.generate(prompt(p), mode="deferred", max_new_tokens=new)
        assert gen.stats.synthetic_acceptance == rate and len(gen.tokens) == new
        # Rounds not cut by the budget (the last one may be, or propose nothing).
        full = gen.stats.accepted_per_round[:-1]
        accepted += sum(full)
        tested += sum(min(a + 1, k) for a in full)  # proposals drawn: up to the first rejection
    # Each drawn proposal is accepted with probability `rate`, independently.
    assert scipy_stats.binomtest(accepted, tested, rate).pvalue > 1e-3
    assert accepted / tested > 0.5  # an argmax verifier would accept almost none of these
    # Seeded: the same seed and prompt give the same rounds in every mode and run; another seed differs.
    again = FastSpeculativeDecoder(target, draft, head_for(draft, "flashhead"), k=k, synthetic_acceptance=rate, seed=5)
    first = runner.generate(prompt(0), mode="deferred", max_new_tokens=40).stats.accepted_per_round
    assert again.generate(prompt(0), mode="deferred", max_new_tokens=40).stats.accepted_per_round == first
    assert again.generate(prompt(0), mode="ordinary", max_new_tokens=40).stats.accepted_per_round == first
    draws = runner.uniform[:40].clone()
    with default_dtype(torch.bfloat16):  # the draws were made in it: rounded to 8 bits, so other acceptances
        assert runner.generate(prompt(0), mode="deferred", max_new_tokens=40).stats.accepted_per_round == first
    assert torch.equal(runner.uniform[:40], draws)
    other = FastSpeculativeDecoder(target, draft, head_for(draft, "dense"), k=k, synthetic_acceptance=rate, seed=6)
    # The draws take max_len x k floats, which the exact verifier, drawing nothing, does without.
    assert runner.uniform.shape == (312, k) and FastSpeculativeDecoder(target, draft, "dense", k=k).uniform.numel() == 0
    assert other.generate(prompt(0), mode="deferred", max_new_tokens=40).stats.accepted_per_round != first
    # The draws depend on the prompt too: seeded by the seed alone, every prompt would accept the
    # same rounds, and a timing over many prompts would average one sequence of draws.
    rounds = {tuple(runner.generate(prompt(p), mode="deferred", max_new_tokens=40).stats.accepted_per_round)
              for p in range(3)}
    assert len(rounds) == 3


def test_synthetic_tokens_are_proposals_then_the_targets_token():
    """With the target as its own draft, proposals are the target's greedy tokens, so whatever the
    draws accept, each round emits greedy tokens: a wrong position or a stale cache would show."""
    target, drafts = fast_models("qwen3")
    for rate in (0.0, 0.5, 1.0):
        for mode in ("ordinary", "deferred"):
            runner = FastSpeculativeDecoder(target, drafts["self"], head_for(drafts["self"], "dense"), k=3, synthetic_acceptance=rate)
            gen = runner.generate(prompt(5), mode=mode, max_new_tokens=NEW)
            assert tuple(gen.tokens) == reference("qwen3", 5)
            assert (gen.stats.accepted == 0) == (rate == 0.0) and (gen.stats.accepted == gen.stats.proposed) == (rate == 1.0)
            check_counters(gen, mode, 3, NEW)


def logged_steps(runner, log: list) -> None:
    """Every step call appends its name to ``log``, every read of a round's result "read"."""
    for name, step in runner.steps.items():
        runner.steps[name] = functools.partial(lambda step, name: (log.append(name), step()), step, name)
    wait = runner.out_host.wait
    runner.out_host.wait = lambda: (log.append("read"), wait())[1]


@pytest.mark.parametrize("body", ["eager", "persistent"])
@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
def test_first_draft_step_feeds_the_pair_only_after_all_k_were_accepted(mode, body):
    """After a round that accepted fewer than K, the draft cache already holds the second-to-last
    token's entry and the first step feeds one token; after the prefill and after a round that
    accepted all K it feeds both. The eager body has two graphs the host picks from (``propose``,
    ``propose_pair``); the persistent body one, whose extra step is skipped on the device unless
    the last round accepted all K (``recv[0] == k``, on the device). With the target as its own
    draft any stale or misplaced entry would change the proposals, hence the tokens."""
    k = 3
    target, drafts = fast_models("qwen3")
    draft = drafts["self"] if body == "eager" else persistent_self_draft()
    runner = FastSpeculativeDecoder(target, draft, head_for(draft, "dense"), k=k, synthetic_acceptance=0.6)
    assert runner.one_propose == (body == "persistent") and ("propose_pair" in runner.steps) == (body == "eager")
    calls = []
    for name in [n for n in ("propose", "propose_pair") if n in runner.steps]:
        runner.steps[name] = functools.partial(
            lambda step, name: (calls.append("propose_pair" if name == "propose_pair" or int(runner.recv[0]) == k else "propose"),
                                step()), runner.steps[name], name)
    gen = runner.generate(prompt(5), mode=mode, max_new_tokens=NEW)
    assert tuple(gen.tokens) == reference("qwen3", 5)
    after = gen.stats.accepted_per_round[:len(calls) - 1]
    assert calls == ["propose_pair"] + ["propose_pair" if a == k else "propose" for a in after]
    assert {"propose", "propose_pair"} <= set(calls[1:]), calls  # both kinds of round occurred


@pytest.mark.parametrize("max_new_tokens,eos", [(NEW, False), (9, False), (NEW, True)])
def test_deferred_rounds_launch_the_next_proposals_before_the_read(max_new_tokens, eos):
    """With one propose graph a deferred round launches the next round's proposals before the host
    reads its result, unless the round may end the generation: by length, or by an EOS (then no
    round reads ahead). Nothing is wasted."""
    k = 3
    target, _ = fast_models("qwen3")
    draft = persistent_self_draft()
    ref = reference("qwen3", 4)
    # An EOS that first occurs late (the generation ends there), or none.
    end = next(j for j in range(NEW // 2, NEW) if ref[j] not in ref[:j]) + 1 if eos else max_new_tokens
    eos_token_id = ref[end - 1] if eos else []
    runner = FastSpeculativeDecoder(target, draft, head_for(draft, "dense"), k=k, synthetic_acceptance=0.7,
                                    eos_token_id=eos_token_id)
    log = []
    logged_steps(runner, log)
    gen = runner.generate(prompt(4), mode="deferred", max_new_tokens=max_new_tokens)
    assert tuple(gen.tokens) == ref[:end]
    ahead, left = [], max_new_tokens - 1
    for emitted in gen.stats.emitted_per_round:
        ahead.append(left >= k + 3 and not eos)
        left -= emitted
    reads = [i for i, name in enumerate(log) if name == "read"]
    assert len(reads) == sum(ahead) and all(log[i - 2:i] == ["rewind", "propose"] for i in reads), log
    assert log.count("propose") == gen.stats.proposed // k  # one a round that proposed: none wasted


def test_runner_summary_labels_synthetic_runs():
    target, drafts = fast_models("llama")
    configs = plan_configs(["dense"], ["baseline", "deferred"])
    decoders = {None: FastSpeculativeDecoder(target),
                "dense": FastSpeculativeDecoder(target, drafts["other"], head_for(drafts["other"], "dense"), k=3, synthetic_acceptance=0.5)}
    records = run_interleaved(decoders, configs, [dict(input_ids=prompt(0))], max_new_tokens=10, warmup_tokens=2, progress=False)
    rows = {row["label"]: row for row in summarize(records, configs)}
    assert rows["deferred/dense"]["exact"] == "synthetic" and rows["deferred/dense"]["synthetic_acceptance"] == 0.5
    assert rows["baseline"]["exact"] == "1/1" and rows["baseline"]["synthetic_acceptance"] is None
    assert rows["deferred/dense"]["head_share"] is None  # the fast path does not time the head apart
    shares = [rows["deferred/dense"][f"{p}_share"] for p in ("propose", "verify", "finalize")]
    assert all(0 < s < 1 for s in shares) and sum(shares) == pytest.approx(1.0, abs=0.2)
    assert rows["deferred/dense"]["overhead_share"] is not None
    # A draft on another GPU overlaps the target: the loop's overhead is then not derivable.
    for record in records:
        record["draft_overlaps_target"] = record["mode"] != "baseline"
    rows = {row["label"]: row for row in summarize(records, configs)}
    assert rows["deferred/dense"]["overhead_share"] is None and rows["baseline"]["overhead_share"] is not None


def test_runner_bad_arguments_name_the_argument():
    target, drafts = fast_models("llama")
    draft = drafts["early"]
    head = head_for(draft, "dense")
    with pytest.raises(ValueError, match="k must be >= 1"):
        FastSpeculativeDecoder(target, draft, head, k=0)
    with pytest.raises(ValueError, match="synthetic_acceptance must be a probability"):
        FastSpeculativeDecoder(target, draft, head, synthetic_acceptance=1.5)
    for bad in (np.float32(0.5), torch.tensor(0.5), "0.5"):  # a probability all the same: named as a type
        with pytest.raises(TypeError, match="synthetic_acceptance must be a Python float or int"):
            FastSpeculativeDecoder(target, draft, head, synthetic_acceptance=bad)
    for bad in ("false", [0], 1):  # read as truth values, "false" captured graphs
        with pytest.raises(TypeError, match=re.escape(f"graphs must be True, False or None (the default: graphs when the "
                                                      f"target is on a GPU), got {bad!r}")):
            FastSpeculativeDecoder(target, draft, head, graphs=bad)
    runner = FastSpeculativeDecoder(target, draft, head, k=3)
    steps = runner.steps
    # Nor is k rebuilt under a generation in another thread (the claim it takes, held here).
    from flashhead_ext.fast import runner as runner_module
    with runner_module._GENERATING(runner):
        runner.k = 3  # the value it has: nothing to rebuild (on a GPU: no recapture), so nothing refused
        with pytest.raises(RuntimeError, match="is generating in another thread"):
            runner.k = 2
    assert runner.k == 3 and runner.steps is steps
    with pytest.raises(AttributeError):  # the steps and buffers are built for it
        runner.synthetic = 0.5
    # A draft's options without a draft would be silently ignored.
    for given, names in (((None, head), "draft_head"), ((None, "dense"), "synthetic_acceptance"),
                         ((None, head), "draft_head and synthetic_acceptance")):
        verb = "apply" if " and " in names else "applies"
        with pytest.raises(ValueError, match=rf"^{names} {verb} to a draft, and no draft was given"):
            FastSpeculativeDecoder(target, *given, synthetic_acceptance=None if names == "draft_head" else 0.5)
    with pytest.raises(TypeError, match="seed must be a Python int, got str"):
        FastSpeculativeDecoder(target, draft, head, seed="1")
    for seed in (2**63, -2**63 - 1):  # hashed as 8 signed bytes at each generate
        with pytest.raises(ValueError, match=f"seed must fit in int64, got {seed}"):
            FastSpeculativeDecoder(target, draft, head, synthetic_acceptance=0.5, seed=seed)
    with pytest.raises(ValueError, match=r"^seed seeds synthetic_acceptance's draws, and synthetic_acceptance is None"):
        FastSpeculativeDecoder(target, draft, head, seed=3)  # it was ignored: runs meant to differ did not
    with pytest.raises(TypeError, match="target must be a flashhead_ext.fast.Decoder"):
        FastSpeculativeDecoder(hf_model("llama"))
    with pytest.raises(ValueError, match="draft_head must be 'dense' or a DenseHead"):
        FastSpeculativeDecoder(target, draft, "sparse")
    with pytest.raises(ValueError, match="draft_head must cover the draft's vocabulary of 97"):
        FastSpeculativeDecoder(target, draft, DenseHead(torch.randn(50, 48)))
    with pytest.raises(ValueError, match="draft_head must take the draft's hidden size 48, got 16"):
        FastSpeculativeDecoder(target, draft, DenseHead(torch.randn(VOCAB, 16)))
    with pytest.raises(ValueError, match="graphs=True needs the models on a CUDA device"):
        FastSpeculativeDecoder(target, graphs=True)
    # One Decoder holds one cache and length: as its own draft, the draft steps would overwrite the target's.
    with pytest.raises(ValueError, match="draft must be another Decoder than target .* build a second Decoder from the same weights"):
        FastSpeculativeDecoder(target, target, head_for(target, "dense"))
    with pytest.raises(ValueError, match="draft must be another Decoder than target"):
        FastSpeculativeDecoder(target, copy.copy(target), head_for(target, "dense"))  # shares the cache and length
    runner = FastSpeculativeDecoder(target, draft, head, k=4)
    with pytest.raises(ValueError, match=r"max_new_tokens=40 with a 7-token prompt and k=4 needs max_len >= 52, the target's is 48"):
        runner.generate(prompt(0), max_new_tokens=40)
    with pytest.raises(ValueError, match="mode must be one of"):
        runner.generate(prompt(0), mode="fast")
    with pytest.raises(ValueError, match="mode 'ordinary' needs a draft model"):
        FastSpeculativeDecoder(target).generate(prompt(0), mode="ordinary")
    with pytest.raises(ValueError, match="input_ids must hold one prompt"):
        runner.generate(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=rf"input_ids must be token ids in 0..{VOCAB - 1} \(the vocabulary\), got {VOCAB}"):
        runner.generate(torch.tensor([3, VOCAB]), max_new_tokens=8)
    with pytest.raises(ValueError, match=rf"eos_token_id must be token ids in 0..{VOCAB - 1}"):
        FastSpeculativeDecoder(target, draft, head, eos_token_id=VOCAB)
    assert FastSpeculativeDecoder(target, eos_token_id=torch.tensor([5])).eos == {5}
    # Baseline writes the entries of all but the last token and proposes nothing: no k + 1 slack.
    baseline = FastSpeculativeDecoder(target, k=4)
    assert tuple(baseline.generate(prompt(0), mode="baseline", max_new_tokens=42).tokens) == reference("llama", 0, 42)
    with pytest.raises(ValueError, match=r"max_new_tokens=43 with a 7-token prompt in baseline mode needs max_len >= 49, the target's is 48"):
        baseline.generate(prompt(0), mode="baseline", max_new_tokens=43)


@pytest.mark.parametrize("qk_norm,tied", [(True, True), (False, False)])
def test_draft_step_floor_counts_layer_weights_one_embedding_row_and_the_cache(qk_norm, tied):
    from flashhead_ext.bench.spec import step_read_bytes

    c = DecoderConfig(211, 24, 40, 3, 6, 2, 8, qk_norm=qk_norm, tie_word_embeddings=tied)
    model = Decoder.random(c, max_len=37, dtype=torch.float16, device="cpu")
    d, hd = c.hidden_size, c.head_dim
    per_layer = ((c.num_heads + 2 * c.num_kv_heads) * hd * d + d * c.num_heads * hd + 2 * c.intermediate_size * d
                 + d * c.intermediate_size + 2 * d + (2 * hd if qk_norm else 0))
    weights = c.num_layers * per_layer + d + d  # the final norm and one embedding row, not the table
    cache = 2 * c.num_layers * c.num_kv_heads * 29 * hd
    assert step_read_bytes(model, keys=29) == 2 * (weights + cache)


def test_draft_step_floor_reads_a_sliding_layers_window_only():
    # It counted every cached position in every layer: Gemma-3-270M's at context 4096 as 75.5 MB, not 20.4.
    from flashhead_ext.bench.spec import cache_read_bytes

    c = DecoderConfig(211, 24, 40, 3, 6, 2, 8, sliding_window=5, sliding_layers=(0, 2))
    model = Decoder.random(c, max_len=37, dtype=torch.float16, device="cpu")
    per_position = 2 * c.num_kv_heads * c.head_dim * 2
    assert cache_read_bytes(model, 29) == (5 + 29 + 5) * per_position
    assert cache_read_bytes(model, 3) == 3 * 3 * per_position  # inside the window a layer reads what there is


def test_bench_help_describes_every_benchmark(capsys):
    from flashhead_ext.bench.__main__ import BENCHMARKS, main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, description) in BENCHMARKS.items():
        assert f"  {name}" in out and description in out, name
    assert main(["speculate"]) == 2 and "unknown benchmark 'speculate'" in capsys.readouterr().err


def test_draft_step_leaves_a_head_time_below_the_noise_blank(tmp_path, monkeypatch, capsys):
    from flashhead_ext.bench import spec
    from flashhead_ext.bench.__main__ import main

    # Per body: the body alone, then the dense and FlashHead steps; the dense step times faster than its body.
    timings = iter([50.0, 49.5, 53.0])
    monkeypatch.setattr(spec, "_time", lambda fn, args, cuda: next(timings))
    assert main(["draft-step", "--shapes", "tiny", "--dtype", "fp32", "--device", "cpu", "--bodies", "eager",
                 "--json", str(tmp_path / "step.json")]) == 0
    rows = json.loads((tmp_path / "step.json").read_text())["rows"]
    assert [r["head_us"] for r in rows] == [None, pytest.approx(3.0)]
    printed = capsys.readouterr().out
    assert "-0.5" not in printed and "head us blank: the step timed no slower than the body alone" in printed


def test_draft_step_rows_read_the_timings_of_each_body_and_head(tmp_path, monkeypatch):
    from flashhead_ext.bench import spec
    from flashhead_ext.bench.__main__ import main

    # Per body: the body alone, then the dense and FlashHead steps. A step timed equal to its body
    # alone leaves the head's time blank, as one timed faster does.
    timings = iter([50.0, 50.0, 40.0, 20.0, 30.0, 25.0])
    monkeypatch.setattr(spec, "_time", lambda fn, args, cuda: next(timings))
    assert main(["draft-step", "--shapes", "tiny", "--dtype", "fp32", "--device", "cpu", "--bodies", "eager,fused",
                 "--json", str(tmp_path / "step.json")]) == 0
    rows = json.loads((tmp_path / "step.json").read_text())["rows"]
    assert [(r["body"], r["head"], r["step_us"], r["body_us"], r["head_us"]) for r in rows] == [
        ("eager", "dense", 50.0, 50.0, None), ("eager", "flashhead", 40.0, 50.0, None),
        ("fused", "dense", 30.0, 20.0, 10.0), ("fused", "flashhead", 25.0, 20.0, 5.0)]
    assert [r["speedup_vs_first_body"] for r in rows] == pytest.approx([1.0, 1.0, 50 / 30, 40 / 25])
    assert [r.get("dense_over_flash") for r in rows] == [None, pytest.approx(50 / 40), None, pytest.approx(30 / 25)]


def test_spec_bench_options_at_their_bounds(monkeypatch, capsys):
    from argparse import Namespace

    from flashhead_ext.bench import spec
    from flashhead_ext.bench.__main__ import main

    ran = []
    monkeypatch.setattr(spec, "_run_spec", lambda parser, args, configs, target, draft: ran.append((args, target)) or 0)
    base = ["spec", "--target", "tiny", "--draft", "tiny", "--device", "cpu"]
    # The tiny shape's 1000 rows in clusters of 16: 63 clusters, all of which may be probed.
    for edge in (["--synthetic-acceptance", "0"], ["--synthetic-acceptance", "1"], ["--probes", "63"], ["--k", "1"]):
        assert main([*base, *edge]) == 0, edge
    for bad, message in ((["--k", "0"], "--k must be >= 1, got 0"), (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
                         (["--synthetic-acceptance", "-0.01"], "--synthetic-acceptance must be in [0, 1], got -0.01"),
                         (["--probes", "64"], "--probes 64 exceeds the 63 clusters of tiny"),
                         (["--target-layers", "0"], "--target-layers: num_layers must be an int in 1..2 (the model's layers), got 0")):
        with pytest.raises(SystemExit):
            main([*base, *bad])
        assert f"spec: error: {message}" in capsys.readouterr().err, bad
    assert len(ran) == 4
    # --probes reaches the FlashHead; None is C/16.
    head = spec.make_head("flashhead", torch.randn(99, 32), Namespace(cluster_size=4, probes=5, centroid_dtype="model"))
    assert (head.probes, head.num_clusters) == (5, 25)
    assert spec.make_head("flashhead", torch.randn(99, 32), Namespace(cluster_size=4, probes=None, centroid_dtype="model")).probes == 1


def test_spec_head_gains_of_ordinary_equal_steps_and_empty_runs():
    from flashhead_ext.bench.spec import head_gains

    row = lambda mode, head, decode_s, proposed: dict(label=f"{mode}/{head}", mode=mode, head=head, decode_s=decode_s,
                                                       proposed=proposed)
    # Ordinary's rounds are not of fixed work: no break-even acceptance. The prediction counts the
    # FlashHead run's own proposals (600 steps 80 us shorter: 48 ms of the dense run's 2 s).
    (gain,) = head_gains([row("ordinary", "dense", 2.0, 500), row("ordinary", "flashhead", 1.9, 600)], 6, 0.77,
                         {"dense": 600.0, "flashhead": 520.0})
    assert "break_even_acceptance" not in gain and gain["predicted"] == pytest.approx(2.0 / (2.0 - 0.048) - 1)
    # Draft steps timed equal predict no gain: no share of it measured (not a ZeroDivisionError).
    (even,) = head_gains([row("deferred", "dense", 2.0, 600), row("deferred", "flashhead", 1.9, 600)], 6, 0.77,
                         {"dense": 500.0, "flashhead": 500.0})
    assert even["predicted"] == 0 and even["of_predicted"] is None and "of it measured" not in even["reading"]
    # Steps timed apart that would save more than the dense draft took in the run predict nothing (the
    # formula had read -1287% where the saving passed the decode time, +19205% just under it).
    for dense_draft_s in (0.5, 0.05):
        (apart,) = head_gains([dict(row("deferred", "dense", 2.0, 600), draft_s=dense_draft_s),
                               row("deferred", "flashhead", 1.9, 600)], 6, 0.77, {"dense": 900.0, "flashhead": 50.0})
        assert apart["predicted"] is None and apart["of_predicted"] is None
        assert (f"; no prediction: the draft steps (dense 900.0, FlashHead 50.0 us, 600 proposed) would save 0.51 s, "
                f"not less than the dense draft's {dense_draft_s:.3g} s in this run") in apart["reading"]
    (fits,) = head_gains([dict(row("deferred", "dense", 2.0, 600), draft_s=0.6), row("deferred", "flashhead", 1.9, 600)],
                         6, 0.77, {"dense": 900.0, "flashhead": 50.0})
    assert fits["predicted"] == pytest.approx(2.0 / (2.0 - 0.51) - 1)
    # A run that took no decode time is no ratio, nor one that proposed nothing (max_new_tokens 1 or 2:
    # its decode time is the target's and bookkeeping only).
    for dense_s, flash_s, proposed in ((0.0, 1.9, 600), (2.0, 0.0, 600), (2.0, 1.7, 0)):
        assert head_gains([row("deferred", "dense", dense_s, proposed), row("deferred", "flashhead", flash_s, proposed)],
                          6, 0.77, {"dense": 600.0, "flashhead": 520.0}) == []


def test_bench_clis_on_tiny_shapes(tmp_path, capsys):
    from flashhead_ext.bench.__main__ import main

    assert main(["draft-step", "--shapes", "tiny,tiny-gemma3", "--dtype", "fp32", "--samples", "2", "--device", "cpu",
                 "--bodies", "eager,fused", "--json", str(tmp_path / "step.json")]) == 0
    rows = json.loads((tmp_path / "step.json").read_text())["rows"]
    # The Gemma-3 layer skips the fused body (the kernel bodies run the Llama / Qwen layer).
    assert [(r["shape"], r["body"], r["head"]) for r in rows] == [
        ("tiny", "eager", "dense"), ("tiny", "eager", "flashhead"), ("tiny", "fused", "dense"), ("tiny", "fused", "flashhead"),
        ("tiny-gemma3", "eager", "dense"), ("tiny-gemma3", "eager", "flashhead")]
    printed = capsys.readouterr()  # notes and the file written on stderr, the table on stdout
    assert "tiny-gemma3: body 'fused' skipped" in printed.err and f"wrote {tmp_path / 'step.json'}" in printed.err
    assert "body 'fused' skipped" not in printed.out and "wrote" not in printed.out and "dense/flash" in printed.out
    assert rows[1]["dense_over_flash"] > 0 and rows[0]["speedup_vs_first_body"] == 1.0 and rows[3]["speedup_vs_first_body"] > 0
    assert main(["draft-step", "--shapes", "tiny", "--dtype", "bf16", "--samples", "2", "--device", "cpu", "--bodies", "eager",
                 "--centroid-dtype", "fp8", "--json", str(tmp_path / "fp8.json")]) == 0
    assert json.loads((tmp_path / "fp8.json").read_text())["meta"]["args"]["centroid_dtype"] == "fp8"
    from argparse import Namespace
    from flashhead_ext.bench.spec import make_head
    fp8_args = Namespace(cluster_size=4, probes=None, centroid_dtype="fp8")
    assert make_head("flashhead", torch.randn(99, 32), fp8_args).centroid_dtype == torch.float8_e4m3fn
    with pytest.raises(SystemExit):
        main(["draft-step", "--bodies", "eager,jit", "--device", "cpu"])
    assert main(["spec", "--target", "tiny", "--draft", "tiny", "--dtype", "fp32", "--device", "cpu", "--num-prompts", "1",
                 "--prompt-tokens", "5", "--max-new-tokens", "12", "--warmup-tokens", "2", "--k", "3",
                 "--json", str(tmp_path / "spec.json")]) == 0
    result = json.loads((tmp_path / "spec.json").read_text())
    assert result["meta"]["clusters"].startswith("random") and result["meta"]["synthetic_acceptance"] == 0.77
    assert (result["meta"]["num_clusters"], result["meta"]["probes_used"]) == (63, 3)  # ceil(1000 / 16), C/16
    assert {r["label"]: r["exact"] for r in result["summary"]} == {
        "baseline": "1/1", "ordinary/dense": "synthetic", "deferred/dense": "synthetic",
        "ordinary/flashhead": "synthetic", "deferred/flashhead": "synthetic"}
    printed = capsys.readouterr().out
    assert "SYNTHETIC ACCEPTANCE R=0.77" in printed
    # FlashHead against dense in each speculative mode, with the draft-step prediction (CPU times: noise).
    assert set(result["meta"]["draft_step_us"]) == {"dense", "flashhead"}
    assert [g["mode"] for g in result["meta"]["head_gains"]] == ["ordinary", "deferred"]
    assert all("predicted" in g and g["reading"] in printed for g in result["meta"]["head_gains"])
    # A baseline alone verifies nothing: it was recorded as synthetic at the default 0.77 (or as given).
    capsys.readouterr()
    for given in ([], ["--synthetic-acceptance", "0.5"]):
        assert main(["spec", "--target", "tiny", "--draft", "tiny", "--dtype", "fp32", "--device", "cpu", "--num-prompts", "1",
                     "--prompt-tokens", "5", "--max-new-tokens", "3", "--warmup-tokens", "1", "--mode", "baseline", *given,
                     "--json", str(tmp_path / "baseline.json")]) == 0
        meta = json.loads((tmp_path / "baseline.json").read_text())["meta"]
        assert meta["synthetic_acceptance"] is None and meta["args"]["synthetic_acceptance"] is None
        # Nor is a draft built for it (a Qwen3-32B baseline had allocated the 0.6B draft too): the options
        # given for one are said, the header says none ran.
        assert meta["draft_gb"] is None and meta["draft_step_us"] == {}
        printed = capsys.readouterr()
        unused = "--draft tiny" + (", --synthetic-acceptance 0.5" if given else "")
        assert f"{unused}: the draft runs in the speculative modes only, and --mode baseline names none\n" in printed.err
        assert ", no draft, fp32, target body eager, attention sdpa, graphs=False\n" in printed.out
    for bad, message in ((["--synthetic-acceptance", "2"], "--synthetic-acceptance must be in [0, 1], got 2.0"),
                         (["--draft", "tiny-gemma3", "--target", "tiny-gemma3", "--body", "fused"],
                          "--body 'fused' runs the Llama / Qwen layer; this model's GELU, post-norms, sliding-window layers"),
                         (["--device", "cuda:99"], "argument --device: 'cuda:99': "),
                         (["--target", "tiny", "--draft", "tiny", "--target-layers", "3"],
                          "--target-layers: num_layers must be an int in 1..2 (the model's layers), got 3"),
                         (["--target", "tiny", "--draft", "smollm2-early-exit-8"],
                          "--draft smollm2-early-exit-8: draft must share the target's tokenizer: its vocabulary has 49152 "
                          "rows, more than the target's 1000")):
        with pytest.raises(SystemExit):
            main(["spec", "--device", "cpu", *bad])
        assert f"spec: error: {message}" in capsys.readouterr().err, bad


def test_bench_spec_takes_a_body_the_built_model_refuses_as_a_usage_error(monkeypatch, capsys):
    # On a GPU the persistent body's kernel limits are known only once the model is built (the
    # decoder asks the kernel); they had ended the run in a traceback. Simulated: CI has no GPU.
    from flashhead_ext.bench import spec
    from flashhead_ext.bench.__main__ import main

    refusal = "cannot run this model on cuda: hidden_size must be a multiple of 8"
    monkeypatch.setattr(spec.Decoder, "_body_limit", lambda self, body: refusal if body == "persistent" else None)
    for flag in ("--body", "--target-body"):
        with pytest.raises(SystemExit) as exit_info:
            main(["spec", "--target", "tiny", "--draft", "tiny", "--dtype", "fp32", "--device", "cpu", "--num-prompts", "1",
                  "--prompt-tokens", "5", "--max-new-tokens", "3", flag, "persistent"])
        assert exit_info.value.code == 2
        assert f"spec: error: {flag}: body 'persistent' {refusal}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["head", "clusters", "layer-ops", "draft-step", "spec --target", "spec --draft"])
def test_bench_json_at_a_shape_config_file_is_a_usage_error_before_the_run(tmp_path, capsys, command):
    # The result overwrote the model's config.json (through its directory's name or a hard link), also
    # where its head is a shape named before it (997x48), which runs in its stead.
    from transformers import Qwen3Config

    from flashhead_ext.bench.__main__ import main

    Qwen3Config(vocab_size=997, hidden_size=48, intermediate_size=80, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16).save_pretrained(tmp_path / "mine")
    config = tmp_path / "mine" / "config.json"
    before = config.read_text()
    (tmp_path / "hard.json").hardlink_to(config)
    subcommand, *flag = command.split()
    shape_flags = [flag[0], str(tmp_path / "mine"), "--draft" if flag == ["--target"] else "--target", "qwen3-0.6b"] \
        if flag else ["--shapes", f"{'997x48' if subcommand in ('head', 'clusters') else 'tiny'},{tmp_path / 'mine'}"]
    for output in (config, tmp_path / "hard.json"):
        with pytest.raises(SystemExit) as exit_info:
            main([subcommand, *shape_flags, *([] if subcommand == "layer-ops" else ["--device", "cpu"]), "--json", str(output)])
        assert exit_info.value.code == 2
        assert (f"error: --json {output}: the file {flag[0] if flag else '--shapes'} reads, which the run would overwrite"
                in capsys.readouterr().err)
    assert config.read_text() == before
    # Results beside the config file are written as ever.
    if subcommand == "clusters":
        assert main([subcommand, "--shapes", "tiny", "--iters", "1", "--device", "cpu",
                     "--json", str(tmp_path / "mine" / "results.json")]) == 0
        assert json.loads((tmp_path / "mine" / "results.json").read_text())["rows"]


def test_bench_clis_time_a_model_of_ones_own_from_its_config(tmp_path, monkeypatch, capsys):
    # A transformers config.json, or the model directory holding it: its shape, random weights.
    from transformers import GPT2Config, Qwen3Config

    from flashhead_ext.bench.__main__ import main

    Qwen3Config(vocab_size=997, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, tie_word_embeddings=True).save_pretrained(tmp_path / "mine")
    for shape in (str(tmp_path / "mine"), str(tmp_path / "mine" / "config.json")):
        # The same file under another spelling runs once, under its first name.
        again = f"{tmp_path / 'mine'}/" if shape.endswith("mine") else str(tmp_path / "mine")
        assert main(["draft-step", "--shapes", f"tiny,{shape},{again}", "--dtype", "fp32", "--samples", "2", "--device", "cpu",
                     "--bodies", "eager", "--cluster-size", "7", "--json", str(tmp_path / "step.json")]) == 0
        rows = json.loads((tmp_path / "step.json").read_text())["rows"]
        assert [r["shape"] for r in rows] == ["tiny", "tiny", shape, shape]
        assert f"--shapes {again}: the same config file as {shape}, run once under that name" in capsys.readouterr().err
        mine = [r for r in rows if r["shape"] == shape]
        assert [(r["layers"], r["head"]) for r in mine] == [(3, "dense"), (3, "flashhead")]
        assert mine[1]["clusters"] == 143 and mine[1]["probes"] == 8  # ceil(997 / 7) clusters, C/16 probes
    assert main(["spec", "--target", str(tmp_path / "mine"), "--draft", str(tmp_path / "mine"), "--dtype", "fp32",
                 "--device", "cpu", "--num-prompts", "1", "--prompt-tokens", "5", "--max-new-tokens", "6",
                 "--warmup-tokens", "2", "--k", "2", "--head", "dense", "--mode", "baseline,deferred",
                 "--json", str(tmp_path / "spec.json")]) == 0
    result = json.loads((tmp_path / "spec.json").read_text())
    assert {r["label"]: r["exact"] for r in result["summary"]} == {"baseline": "1/1", "deferred/dense": "synthetic"}
    # A model the fast decoder does not run, unreadable or inconsistent configs, a path that is not there.
    GPT2Config(n_layer=1).save_pretrained(tmp_path / "gpt2")
    config = json.loads((tmp_path / "mine" / "config.json").read_text())
    for name, text in (("broken", "{not json"), ("null", "null"), ("no-heads", json.dumps(dict(config, num_attention_heads=0))),
                       ("typed", json.dumps(dict(config, num_hidden_layers="2")))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
    (tmp_path / "empty").mkdir()
    for argv, message in (
            (["draft-step", "--shapes", str(tmp_path / "gpt2")], f"--shapes {tmp_path / 'gpt2'}: ValueError: config must be a "),
            (["spec", "--draft", str(tmp_path / "gpt2")], f"--draft {tmp_path / 'gpt2'}: ValueError: config must be a "),
            *[(["draft-step", "--shapes", f"tiny,{tmp_path / name}"], f"--shapes {tmp_path / name}: ")
              for name in ("broken", "null", "no-heads", "typed", "empty")],
            (["draft-step", "--shapes", str(tmp_path / "absent")],
             f"unknown shape {str(tmp_path / 'absent')!r}; choose from ['gemma2-27b', 'gemma2-2b', 'gemma3-1b', "),
            (["spec", "--target", str(tmp_path / "absent")], f"argument --target: invalid choice: {str(tmp_path / 'absent')!r}")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--device", "cpu"])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err, argv
    # A quantized model is timed unquantized, and a directory named as a preset is the preset: both said.
    (tmp_path / "quantized").mkdir()
    (tmp_path / "quantized" / "config.json").write_text(json.dumps(dict(config, quantization_config=dict(quant_method="awq", bits=4))))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").rename(tmp_path / "tiny")
    assert main(["draft-step", "--shapes", "quantized,tiny", "--dtype", "fp32", "--samples", "2", "--device", "cpu",
                 "--bodies", "eager", "--json", str(tmp_path / "step.json")]) == 0
    printed = capsys.readouterr().err
    assert "quantized: its quantization (awq) is not timed: the weights are random and unquantized" in printed
    assert "--shapes tiny: the named shape, not the path 'tiny' (give ./tiny for the path)" in printed
    layers = {r["shape"]: r["layers"] for r in json.loads((tmp_path / "step.json").read_text())["rows"]}
    assert layers == {"quantized": 3, "tiny": 2}
    # bench head and bench clusters read a config's output head: its vocabulary and hidden size, clusters of 16.
    assert main(["head", "--shapes", "quantized,997x48", "--device", "cpu", "--dtype", "fp32", "--probes", "5", "--batches", "1",
                 "--samples", "2", "--calls", "2", "--impls", "flash_greedy", "--json", str(tmp_path / "head.json")]) == 0
    rows = json.loads((tmp_path / "head.json").read_text())["rows"]
    assert {r["shape"] for r in rows} == {"quantized"}  # 997x48 is the same head
    assert rows[0]["kept_bytes"] == 63 * 48 * 4 + 63 * 16 * 4  # ceil(997 / 16) clusters
    assert main(["clusters", "--shapes", "./tiny", "--iters", "1", "--device", "cpu", "--json", str(tmp_path / "clusters.json")]) == 0
    (row,) = json.loads((tmp_path / "clusters.json").read_text())["rows"]
    assert (row["vocab"], row["dim"], row["clusters"]) == (997, 48, 63)
    (tmp_path / "headless").mkdir()
    (tmp_path / "headless" / "config.json").write_text(json.dumps(dict(model_type="vit")))  # an image model: no vocabulary
    for bench in ("head", "clusters"):
        for name, message in (("null", "TypeError: "), ("headless", "its output head could not be read (ValueError: ")):
            with pytest.raises(SystemExit):
                main([bench, "--shapes", str(tmp_path / name), "--device", "cpu"])
            assert f"error: --shapes {tmp_path / name}: {message}" in capsys.readouterr().err


def test_bench_draft_step_times_a_mistral_config_on_the_bodies_its_window_allows(tmp_path, capsys):
    from transformers import MistralConfig

    from flashhead_ext.bench.__main__ import main

    MistralConfig(vocab_size=997, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=4).save_pretrained(tmp_path / "mistral")
    assert main(["draft-step", "--shapes", str(tmp_path / "mistral"), "--dtype", "fp32", "--samples", "2", "--device", "cpu",
                 "--context", "32", "--bodies", "eager,fused,persistent", "--json", str(tmp_path / "step.json")]) == 0
    assert f"{tmp_path / 'mistral'}: body 'fused' skipped (this layer runs on ('eager', 'compiled', 'persistent'))" in \
        capsys.readouterr().err
    rows = json.loads((tmp_path / "step.json").read_text())["rows"]
    assert [(r["body"], r["head"], r["layers"]) for r in rows] == [
        ("eager", "dense", 2), ("eager", "flashhead", 2), ("persistent", "dense", 2), ("persistent", "flashhead", 2)]


def test_bench_draft_step_times_a_granite_config_on_every_short_step_body(tmp_path):
    from transformers import GraniteConfig

    from flashhead_ext.bench.__main__ import main

    GraniteConfig(vocab_size=997, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                  logits_scaling=8.0, tie_word_embeddings=True).save_pretrained(tmp_path / "granite")
    assert main(["draft-step", "--shapes", str(tmp_path / "granite"), "--dtype", "fp32", "--samples", "2", "--device", "cpu",
                 "--context", "32", "--bodies", "eager,fused,persistent", "--json", str(tmp_path / "step.json")]) == 0
    rows = json.loads((tmp_path / "step.json").read_text())["rows"]
    assert [(r["body"], r["head"]) for r in rows] == [(body, head) for body in ("eager", "fused", "persistent")
                                                      for head in ("dense", "flashhead")]
    assert all(r["step_us"] > 0 for r in rows)


def test_bench_shape_list_that_is_one_config_path_with_a_comma(tmp_path):
    # The comma list split it into two names, neither a shape.
    from transformers import LlamaConfig

    from flashhead_ext.bench.__main__ import main

    LlamaConfig(vocab_size=331, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path / "llama,tiny")
    for bench, args in (("draft-step", ["--bodies", "eager", "--dtype", "fp32", "--samples", "2"]),
                        ("head", ["--probes", "3", "--batches", "1", "--impls", "dense", "--calls", "2", "--samples", "2"])):
        assert main([bench, "--shapes", str(tmp_path / "llama,tiny"), "--device", "cpu", *args,
                     "--json", str(tmp_path / "out.json")]) == 0
        rows = json.loads((tmp_path / "out.json").read_text())["rows"]
        assert {r["shape"] for r in rows} == {str(tmp_path / "llama,tiny")}, bench


def test_bench_clis_read_each_config_once_and_its_head_as_built(tmp_path, monkeypatch, capsys):
    from transformers import OPTConfig, Qwen3Config

    from flashhead_ext.bench.__main__ import main

    # The Hugging Face cache's layout: a snapshot's config.json links into its blobs.
    Qwen3Config(vocab_size=997, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, quantization_config=dict(quant_method="awq", bits=4)).save_pretrained(tmp_path / "q")
    (tmp_path / "blobs").mkdir()
    (tmp_path / "q" / "config.json").rename(tmp_path / "blobs" / "c0ffee")
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "config.json").symlink_to(tmp_path / "blobs" / "c0ffee")
    spellings = f"{tmp_path / 'snapshot'},{tmp_path / 'snapshot'}/,{tmp_path / 'snapshot' / 'config.json'}"
    assert main(["draft-step", "--shapes", spellings, "--dtype", "fp32", "--samples", "2", "--device", "cpu", "--bodies", "eager",
                 "--json", str(tmp_path / "step.json")]) == 0
    assert {r["shape"] for r in json.loads((tmp_path / "step.json").read_text())["rows"]} == {str(tmp_path / "snapshot")}
    assert capsys.readouterr().err.count("its quantization (awq) is not timed") == 1
    assert main(["clusters", "--shapes", spellings, "--iters", "1", "--device", "cpu", "--json", str(tmp_path / "c.json")]) == 0
    assert len(json.loads((tmp_path / "c.json").read_text())["rows"]) == 1
    assert capsys.readouterr().err.count("its quantization (awq) is not timed") == 1
    # OPT's head is narrower than its hidden size: the head as the model builds it.
    OPTConfig(vocab_size=997, hidden_size=64, word_embed_proj_dim=32, ffn_dim=128, num_hidden_layers=1,
              num_attention_heads=4).save_pretrained(tmp_path / "opt")
    assert main(["clusters", "--shapes", str(tmp_path / "opt"), "--iters", "1", "--device", "cpu", "--json", str(tmp_path / "c.json")]) == 0
    (row,) = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert (row["vocab"], row["dim"]) == (997, 32)
    # A name that is a head's pattern and a path is the pattern, and says so; a name too long for a path is no path.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "snapshot").rename(tmp_path / "997x32")
    assert main(["clusters", "--shapes", "997x32", "--iters", "1", "--device", "cpu", "--json", str(tmp_path / "c.json")]) == 0
    assert "--shapes 997x32: the named shape, not the path '997x32' (give ./997x32 for the path)" in capsys.readouterr().err
    for bench in ("clusters", "draft-step"):
        with pytest.raises(SystemExit):
            main([bench, "--shapes", "x" * 300, "--device", "cpu"])
        assert f"unknown shape '{'x' * 300}'" in capsys.readouterr().err


def test_spec_reads_flashheads_gain_against_the_draft_steps_and_the_break_even_acceptance():
    from flashhead_ext.bench.spec import accepted_share, break_even_acceptance, expected_emitted, head_gains

    assert expected_emitted(0.0, 6) == 1.0 and expected_emitted(1.0, 6) == 7.0
    assert expected_emitted(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert break_even_acceptance(0.77, 6, 1.0) == pytest.approx(0.77)
    lower = break_even_acceptance(0.77, 6, 0.97)
    assert lower < 0.77 and expected_emitted(lower, 6) == pytest.approx(0.97 * expected_emitted(0.77, 6))
    # 104 rounds, of which 4 end a generation and propose nothing.
    row = lambda mode, head, decode_s: dict(label=f"{mode}/{head}", mode=mode, head=head, decode_s=decode_s, rounds=104,
                                            proposed=600)
    rows = [dict(label="baseline", mode="baseline", head=None, decode_s=9.0, rounds=300, proposed=0),
            row("deferred", "dense", 2.0), row("deferred", "flashhead", 1.95), row("ordinary", "dense", 3.0)]
    # 600 draft steps proposed, each 80 us shorter: 48 ms of the dense run's 2 s.
    (gain,) = head_gains(rows, 6, 0.77, {"dense": 600.0, "flashhead": 520.0})
    assert gain["mode"] == "deferred" and gain["measured"] == pytest.approx(2.0 / 1.95 - 1)
    assert gain["predicted"] == pytest.approx(2.0 / (2.0 - 0.048) - 1)
    assert gain["of_predicted"] == pytest.approx(gain["measured"] / gain["predicted"])
    assert gain["break_even_acceptance"] == pytest.approx(break_even_acceptance(0.77, 6, 1.95 / 2.0))
    assert gain["reading"].startswith("deferred: FlashHead draft +2.56% decode speed over dense at equal (synthetic) acceptance")
    assert "predict +2.46% (104% of it measured)" in gain["reading"] and ">= 0.76" in gain["reading"]
    # The table's accept column counts proposals after a rejection as unaccepted: 0.44 at R = 0.77, K = 6.
    assert accepted_share(0.77, 6) == pytest.approx((0.77 + 0.77**2 + 0.77**3 + 0.77**4 + 0.77**5 + 0.77**6) / 6)
    assert accepted_share(1.0, 6) == 1.0 and accepted_share(0.0, 6) == 0.0
    assert gain["break_even_accept"] == pytest.approx(accepted_share(gain["break_even_acceptance"], 6))
    assert f"(the tables' accept >= {gain['break_even_accept']:.3f} against 0.442)" in gain["reading"]
    assert "(dense 600.0, FlashHead 520.0 us, 600 proposed)" in gain["reading"]  # which step is which
    (slower,) = head_gains([row("deferred", "dense", 2.0), row("deferred", "flashhead", 2.1)], 6, 0.77, {})
    assert "predicted" not in slower and "break_even_acceptance" not in slower


def test_bench_gemma3_shapes_read_transformers_configs_and_share_one_vocabulary():
    # Read when first used: the benchmarks run without transformers until a Gemma-3 shape is named.
    lazy = "import sys, flashhead_ext.bench.__main__; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", lazy], capture_output=True, text=True, check=True).stdout == "False\n"
    from flashhead_ext.bench.spec import SHAPES

    gemmas = {name: SHAPES[name] for name in ("gemma3-270m", "gemma3-1b", "gemma3-27b")}
    # The drafts' vocabulary, and the 27B's with its 64 image tokens past it (a pair shares the first rows).
    assert [c.vocab_size for c in gemmas.values()] == [262144, 262144, 262208]
    for c in gemmas.values():
        assert c.post_norms and c.hidden_act == "gelu_tanh" and c.embed_scale == c.hidden_size ** 0.5
        assert [i for i in range(c.num_layers) if i not in c.sliding_layers] == list(range(5, c.num_layers, 6))
        assert c.sliding_rope_inv_freq[0] == 1.0 and c.sliding_rope_inv_freq[1] == pytest.approx(1e4 ** (-2 / c.head_dim))
    big = gemmas["gemma3-27b"]
    assert (big.hidden_size, big.num_layers, big.num_heads, big.num_kv_heads, big.sliding_window) == (5376, 62, 32, 16, 1024)
    # Its global layers' RoPE is linearly scaled by 8; the small models' is not.
    assert big.rope_inv_freq[1] == pytest.approx(1e6 ** (-2 / 128) / 8) and big.attention_scale == pytest.approx(168 ** -0.5)
    assert gemmas["gemma3-1b"].rope_inv_freq[1] == pytest.approx(1e6 ** (-2 / 256))
    # bench spec --target-layers 7: the first seven layers keep their kinds.
    short = big.first_layers(7)
    assert (short.num_layers, short.sliding_layers, short.sliding_window) == (7, (0, 1, 2, 3, 4, 6), 1024)
    with pytest.raises(ValueError, match=r"num_layers must be an int in 1..62 \(the model's layers\), got 63"):
        big.first_layers(63)


def test_bench_gemma2_shapes_are_the_published_models():
    from flashhead_ext.bench.spec import SHAPES

    small, big = SHAPES["gemma2-2b"], SHAPES["gemma2-27b"]
    for c in (small, big):  # Gemma-2's published caps and window, every other layer from the first sliding
        assert (c.vocab_size, c.attn_logit_softcapping, c.final_logit_softcapping, c.sliding_window) == (256000, 50.0, 30.0, 4096)
        assert c.sliding_layers == tuple(range(0, c.num_layers, 2)) and not c.qk_norm and c.sliding_rope_inv_freq is None
    assert (small.hidden_size, small.num_layers, small.num_heads, small.num_kv_heads, small.head_dim) == (2304, 26, 8, 4, 256)
    assert (big.hidden_size, big.num_layers, big.num_heads, big.num_kv_heads, big.head_dim) == (4608, 46, 32, 16, 128)
    assert big.softmax_scale == pytest.approx(144 ** -0.5) and big.body_limit("fused", torch.bfloat16)


# ---- GPU: graphs ---------------------------------------------------------------------------------

def _cuda_models(arch: str):
    model = hf_model(arch, dtype=torch.float32)
    return Decoder.from_hf(model, max_len=48, device="cuda"), Decoder.from_hf(model, max_len=48, num_layers=1, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("draft_device", ["cuda:0", pytest.param("cuda:1", marks=TWO_GPUS)])
def test_spec_predicts_from_draft_steps_for_a_draft_on_the_targets_gpu_however_spelled(tmp_path, capsys, draft_device):
    # "cuda:0" beside "cuda" (with cuda:0 current) is one GPU: compared as strings, the prediction was
    # silently dropped. A draft on its own GPU overlaps the target, and the run says why none is made.
    from flashhead_ext.bench.__main__ import main

    with torch.cuda.device(0):
        assert main(["spec", "--target", "tiny", "--draft", "tiny", "--device", "cuda", "--draft-device", draft_device,
                     "--num-prompts", "1", "--prompt-tokens", "5", "--max-new-tokens", "12", "--warmup-tokens", "2",
                     "--k", "3", "--mode", "deferred", "--json", str(tmp_path / "spec.json")]) == 0
    meta = json.loads((tmp_path / "spec.json").read_text())["meta"]
    same_gpu = draft_device == "cuda:0"
    assert set(meta["draft_step_us"]) == ({"dense", "flashhead"} if same_gpu else set())
    assert ("predicted" in meta["head_gains"][0]) == same_gpu
    assert ("no draft-step prediction of the gain: the draft on cuda:1 overlaps the target on cuda:0"
            in capsys.readouterr().err) != same_gpu


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("head,attention", [("dense", "sdpa"), ("flashhead", "matmul")])
def test_graph_replay_equals_eager(mode, head, attention):
    target, draft = _cuda_models("qwen3")
    target.attention = draft.attention = attention
    tokens = {}
    for graphs in (False, True):
        runner = FastSpeculativeDecoder(target, draft, head_for(draft, head), k=3, graphs=graphs)
        assert runner.graphs == graphs
        gen = runner.generate(prompt(6), mode=mode, max_new_tokens=NEW)
        check_counters(gen, mode, 0 if mode == "baseline" else 3, NEW, gpu_phases=True)
        tokens[graphs] = (gen.tokens, gen.stats.accepted_per_round)
    assert tokens[True] == tokens[False]
    # float32 weights on the GPU (no TF32): the float64 reference's tokens, whose margins are far wider.
    assert tuple(tokens[True][0]) == reference("qwen3", 6)
    if mode != "baseline":
        runner.k = 5  # the steps' graphs are captured again for it
        gen = runner.generate(prompt(6), mode=mode, max_new_tokens=NEW)
        check_counters(gen, mode, 5, NEW, gpu_phases=True)
        assert tuple(gen.tokens) == reference("qwen3", 6)
        with pytest.raises(ValueError, match=r"max_len must be >= 3 \* \(k \+ 2\) = 51 for graph capture"):
            runner.k = 15  # a capture that fails leaves the steps as they were
        assert runner.k == 5 and all(step.graph is not None for step in runner.steps.values())
        assert tuple(runner.generate(prompt(6), mode=mode, max_new_tokens=NEW).tokens) == reference("qwen3", 6)


@pytest.mark.gpu
def test_graphs_captured_under_a_callers_autocast_replay_the_models_dtype():
    # The steps' graphs were captured with autocast's bfloat16 products (a dense draft head's matmul),
    # which every later replay kept.
    target, draft = _cuda_models("qwen3")
    want = FastSpeculativeDecoder(target, draft, head_for(draft, "dense"), k=3).generate(prompt(6), max_new_tokens=NEW)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        runner = FastSpeculativeDecoder(target, draft, head_for(draft, "dense"), k=3)
    got = runner.generate(prompt(6), max_new_tokens=NEW)
    assert (got.tokens, got.stats.accepted_per_round) == (want.tokens, want.stats.accepted_per_round)


@pytest.mark.parametrize("device", DEVICES)
def test_a_dropped_runner_is_freed_without_a_garbage_collection(device):
    """No reference cycle keeps a dropped runner (its steps, graphs and buffers) alive until a
    collection, which could come during another graph's capture and fail it (graphs.py)."""
    target, draft = _cuda_models("qwen3") if device == "cuda" else (fast_models("qwen3")[0], fast_models("qwen3")[1]["early"])
    collecting = gc.isenabled()
    gc.disable()
    try:
        runner = FastSpeculativeDecoder(target, draft, head_for(draft, "flashhead"), k=3)
        assert runner.generate(prompt(6), mode="deferred", max_new_tokens=NEW).tokens
        runner.k = 4  # the steps are rebuilt
        dropped = weakref.ref(runner)
        del runner
        assert dropped() is None
    finally:
        if collecting:
            gc.enable()


def _check_short_step_body(target: Decoder, draft: Decoder, body: str, mode: str, arch: str) -> None:
    """``body`` gives the eager body's hidden states on a short step, and the runner stays exact."""
    for ids in (torch.tensor([3, 17, 5], device=target.device), torch.tensor([11], device=target.device)):
        target.body = "eager"
        target.reset(4)
        eager = target.forward(ids)
        target.body = body
        target.reset(4)
        # The fused ops accumulate in another order (GEMV rows, split softmax): float32 rounding only.
        torch.testing.assert_close(target.forward(ids), eager, rtol=1e-4, atol=1e-4)
    draft.body = body
    gen = FastSpeculativeDecoder(target, draft, head_for(draft, "flashhead"), k=3).generate(prompt(6), mode=mode,
                                                                                          max_new_tokens=NEW)
    assert tuple(gen.tokens) == reference(arch, 6)


@pytest.mark.parametrize("body", ["fused", "persistent"])
@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
@pytest.mark.parametrize("arch", ["llama", "granite", "qwen2", "qwen3"])
def test_fused_bodies_on_cpu_match_eager_and_are_exact(arch, mode, body):
    model = hf_model(arch, dtype=torch.float32)
    target, draft = Decoder.from_hf(model, max_len=48), Decoder.from_hf(model, max_len=48, num_layers=1)
    _check_short_step_body(target, draft, body, mode, arch)


@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen2-sliding", "mistral", "phi3"])
def test_persistent_body_on_cpu_runs_gemma_and_sliding_windows(arch, mode):
    """Their short forwards run one decoder_step a token (the fused ops run none). A draft of
    two layers holds a sliding one (Mistral's and Phi-3's: both); the generation runs far past the
    window of 5."""
    model = hf_model(arch, dtype=torch.float32)
    target, draft = Decoder.from_hf(model, max_len=48), Decoder.from_hf(model, max_len=48, num_layers=2)
    assert draft.config.sliding_layers == {"mistral": (0, 1), "phi3": (0, 1), "gemma2": (0,)}.get(arch, (1,))
    _check_short_step_body(target, draft, "persistent", mode, arch)


@pytest.mark.parametrize("body", ["fused", "persistent"])
def test_scaled_rope_in_the_short_step_bodies(body, device):
    """The fused and persistent bodies rotate by the scaled tables too (llama3, as Llama 3.2 drafts
    set it): a 12-token prefill, then one-token steps past the original context."""
    model = hf_model("llama-aligned", dtype=torch.float32, rope="llama3")
    decoder = Decoder.from_hf(model, max_len=40, device=device)
    decoder.body = body
    ids = prompt(5, length=37)
    with torch.no_grad():
        expected = model(input_ids=ids.view(1, -1)).logits[0]
    torch.testing.assert_close(_prefill_then_steps(decoder, ids.to(device), 12).cpu(), expected, rtol=1e-4, atol=1e-4)


def test_body_runs_forwards_of_at_most_16_tokens_prefills_included(monkeypatch):
    """As documented: a prompt of up to STEP_MAX_TOKENS tokens is prefilled by the chosen body, a
    longer one eagerly."""
    from flashhead_ext.fast import decoder as decoder_module

    calls = []
    fused_layer = decoder_module._fused_layer
    monkeypatch.setattr(decoder_module, "_fused_layer", lambda *args: (calls.append(args[0].shape[0]), fused_layer(*args))[1])
    decoder = Decoder.from_hf(hf_model("llama", dtype=torch.float32), max_len=48)
    decoder.body = "fused"
    for n in (decoder_module.STEP_MAX_TOKENS, decoder_module.STEP_MAX_TOKENS + 1):
        decoder.forward(prompt(n, length=n))
    assert calls == [decoder_module.STEP_MAX_TOKENS] * decoder.config.num_layers


def test_compiled_body_keeps_a_graph_per_token_count(monkeypatch):
    """dynamo keeps 8 graphs of a function by default, and a fullgraph compile past them raises: the
    compiled body runs forwards of every short length for two models, each equal to the eager
    body's. (dynamo with its eager backend, which traces and guards as inductor's does, in seconds.)"""
    from flashhead_ext.fast import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "_compiled_layer",
                        torch.compile(decoder_module._layer, fullgraph=True, dynamic=False, backend="eager"))
    for arch in ("llama", "gemma3"):
        decoder = Decoder.from_hf(hf_model(arch, dtype=torch.float32), max_len=48)
        ids = prompt(9, length=decoder_module.STEP_MAX_TOKENS)
        for n in range(1, decoder_module.STEP_MAX_TOKENS + 1):
            decoder.body = "eager"
            expected = decoder.forward(ids[:n])
            decoder.body = "compiled"
            torch.testing.assert_close(decoder.forward(ids[:n]), expected, rtol=0, atol=0)


def test_persistent_body_one_token_step_matches_eager():
    """A one-token step is where "persistent" differs from "fused" (one decoder_step call): hidden
    states and the cache entries it writes agree with the eager body's."""
    model = hf_model("qwen3", dtype=torch.float32)
    decoder = Decoder.from_hf(model, max_len=48)
    decoder.forward(torch.tensor([5, 9, 2, 11]))
    results = {}
    for body in ("eager", "persistent"):
        decoder.body = body
        decoder.reset(4)
        results[body] = decoder.forward(torch.tensor([7])), decoder.k_cache[:, :, 4].clone(), decoder.v_cache[:, :, 4].clone()
    for got, expected in zip(results["persistent"], results["eager"]):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_body_or_attention_changed_after_the_runner_was_built_is_refused():
    """The runner builds its steps (on a GPU: captures its graphs) for the models' body and attention:
    a later change must not run stale steps."""
    model = hf_model("qwen3", dtype=torch.float32)
    target, draft = Decoder.from_hf(model, max_len=48), Decoder.from_hf(model, max_len=48, num_layers=1)
    draft.body = "persistent"
    runner = FastSpeculativeDecoder(target, draft, head_for(draft, "dense"), k=3)
    draft.body = "eager"
    with pytest.raises(ValueError, match="draft.body changed from 'persistent' to 'eager' after this FastSpeculativeDecoder was built"):
        runner.generate(prompt(6), max_new_tokens=NEW)
    draft.body = "persistent"
    target.attention = "matmul"
    with pytest.raises(ValueError, match="target.attention changed from 'sdpa' to 'matmul'"):
        runner.generate(prompt(6), max_new_tokens=NEW)
    target.attention = "sdpa"
    assert tuple(runner.generate(prompt(6), max_new_tokens=NEW).tokens) == reference("qwen3", 6)


def test_decoder_body_is_checked():
    decoder = Decoder.from_hf(hf_model("llama"), max_len=8)  # float64
    with pytest.raises(ValueError, match="body must be one of"):
        decoder.body = "jit"
    for body in ("fused", "persistent"):
        with pytest.raises(ValueError, match=f"body '{body}' needs a float16, bfloat16 or float32 model"):
            decoder.body = body
    # The layer kernels take softmax scales up to ops.ATTENTION_SCALE_MAX: refused when the body is
    # set, not at the first forward; the eager body runs any finite scale.
    steep = dataclasses.replace(decoder.config, attention_scale=ops.ATTENTION_SCALE_MAX * 1.5)
    decoder = Decoder.random(steep, max_len=8, dtype=torch.float32, device="cpu")
    assert decoder.bodies == ("eager", "compiled")
    for body in ("fused", "persistent"):
        with pytest.raises(ValueError, match=f"body '{body}' takes an attention_scale up to 1e\\+06 .*, this model's is 1.5e\\+06"):
            decoder.body = body
    decoder.forward(torch.tensor([1, 2]))
    # So are more query heads than the layer ops take, by the config (the ops named a cache size).
    wide = dataclasses.replace(steep, attention_scale=None, num_heads=2 * ops.NUM_HEADS_MAX, num_kv_heads=2)
    for body in ("fused", "persistent"):
        assert wide.body_limit(body, torch.float32) == (
            f"takes up to 65536 query heads (the layer kernels' bound), this model has {2 * ops.NUM_HEADS_MAX}")
    assert dataclasses.replace(wide, num_heads=ops.NUM_HEADS_MAX).body_limit("persistent", torch.float32) is None
    assert wide.body_limit("eager", torch.float32) is None


@functools.lru_cache(maxsize=None)
def fast_config(arch: str) -> DecoderConfig:
    return DecoderConfig.from_hf(hf_model(arch).config)


def persistent_refusal(arch: str, dtype: torch.dtype) -> Optional[str]:
    """decoder_step's error for ``arch`` in ``dtype`` on CUDA, or None: its kernel streams rows of
    whole 16-byte vectors (docs/kernels.md, decoder_step's limits; the tiny models meet the others)."""
    c = fast_config(arch)
    vector = 16 // torch.empty((), dtype=dtype).element_size()
    sizes = (c.hidden_size, c.head_dim, c.intermediate_size)
    if all(size % vector == 0 for size in sizes):
        return None
    return (f"flashhead.decoder_step: the CUDA kernel needs hidden_size, head_dim and intermediate_size to be multiples "
            f"of {vector} for {dtype}, got {sizes[0]}, {sizes[1]} and {sizes[2]}")


@pytest.mark.gpu
def test_persistent_body_asks_the_cuda_kernel_limits():
    """decoder_step's CUDA limits (docs/kernels.md) are asked as the body is set: bodies lists what
    runs, and a model the kernel refuses fails there, not at its first draft step."""
    odd = Decoder.from_hf(hf_model("llama", dtype=torch.float32), max_len=8, device="cuda")
    assert "persistent" not in odd.bodies and "fused" in odd.bodies
    with pytest.raises(ValueError, match=re.escape(
            f"body 'persistent' cannot run this model on {odd.device}: {persistent_refusal('llama', torch.float32)}")):
        odd.body = "persistent"
    assert odd.body == "eager"
    longest = Decoder.from_hf(hf_model("llama-aligned", dtype=torch.float32), max_len=262145, device="cuda")
    with pytest.raises(ValueError, match=r"max_len \(k_cache.size\(2\)\) must be at most 262144 for the CUDA kernel"):
        longest.body = "persistent"
    aligned = Decoder.from_hf(hf_model("llama-aligned", dtype=torch.float32), max_len=8, device="cuda")
    aligned.body = "persistent"
    assert "persistent" in aligned.bodies
    # The step that asked wrote nothing: the caches and the length are as built.
    assert not aligned.k_cache.any() and not aligned.v_cache.any() and int(aligned.length) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
@pytest.mark.parametrize("arch,body", [("qwen3", "compiled"), ("qwen3", "fused"), ("llama", "fused"), ("gemma3", "compiled"),
                                       ("qwen2-sliding", "compiled"), ("qwen2", "fused"), ("qwen3-aligned", "persistent"),
                                       ("llama-aligned", "persistent"), ("qwen2-aligned", "persistent"),
                                       ("gemma3-aligned", "persistent"), ("qwen2-sliding-aligned", "persistent"),
                                       ("mistral", "compiled"), ("mistral-aligned", "persistent"),
                                       ("phi3-aligned", "persistent"), ("granite-aligned", "fused"),
                                       ("granite-aligned", "persistent"), ("gemma2", "compiled"),
                                       ("gemma2-aligned", "persistent")])
def test_short_step_bodies_match_eager_and_replay_exactly(arch, body, mode):
    _check_short_step_body(*_cuda_models(arch), body, mode, arch)


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("mode", MODES)
def test_draft_on_a_second_gpu_is_exact(mode, body):
    model = hf_model("llama-aligned", dtype=torch.float32)
    target = Decoder.from_hf(model, max_len=48, device="cuda:0")
    draft = Decoder.from_hf(model, max_len=48, num_layers=1, device="cuda:1")
    draft.body = body
    runner = FastSpeculativeDecoder(target, draft, head_for(draft, "flashhead"), k=3)
    gen = runner.generate(prompt(5), mode=mode, max_new_tokens=NEW)
    assert tuple(gen.tokens) == reference("llama-aligned", 5)


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("body", BODIES)
def test_decoder_runs_on_its_own_gpu_not_the_current_one(body):
    """With cuda:0 current, a decoder on cuda:1 gives the hidden states and cache of its twin on
    cuda:0: a prefill, a 3-token step and a 1-token step."""
    model = hf_model("llama-aligned", dtype=torch.float32)
    ids = prompt(8, length=13)
    runs = []
    with torch.cuda.device(0):
        for device in ("cuda:0", "cuda:1"):
            decoder = Decoder.from_hf(model, max_len=24, device=device)
            decoder.body = body
            decoder.reset(0)
            hidden = [decoder.forward(ids[i:j].to(device)) for i, j in ((0, 9), (9, 12), (12, 13))]
            runs.append([*hidden, decoder.k_cache[:, :, :13], decoder.v_cache[:, :, :13], decoder.length])
    for expected, actual in zip(*runs):
        assert actual.device == torch.device("cuda:1")
        torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("arch,body", [("llama-aligned", "eager"), ("llama-aligned", "fused"), ("llama-aligned", "persistent"),
                                       ("gemma3", "eager"), ("qwen2-sliding", "eager"),  # sliding windows' masks
                                       ("gemma3-aligned", "persistent"), ("mistral-aligned", "persistent"),
                                       ("gemma2-aligned", "persistent")])
def test_no_host_sync_inside_captured_steps(arch, body):
    target, draft = _cuda_models(arch)
    target.body = draft.body = body
    runner = FastSpeculativeDecoder(target, draft, head_for(draft, "flashhead"), k=4, synthetic_acceptance=0.5)
    runner.generate(prompt(7), mode="deferred", max_new_tokens=6)  # leaves the state of a real generation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, step in runner.steps.items():
            assert step.graph is not None, name
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_graph_capture_claims_the_models_another_thread_generates_with():
    # Capturing runs the models and resets their caches, under a generation in another thread that
    # holds them (held here as that generation holds them).
    from flashhead_ext.fast import runner as runner_module

    target, draft = _cuda_models("llama-aligned")
    runner = FastSpeculativeDecoder(target, draft, head_for(draft, "dense"), k=3)
    assert runner.graphs
    with runner_module._GENERATING(target):
        with pytest.raises(RuntimeError, match="is generating in another thread"):
            FastSpeculativeDecoder(target, draft, head_for(draft, "dense"), k=2)
        with pytest.raises(RuntimeError, match="is generating in another thread"):
            runner.k = 2
    assert runner.k == 3
    runner.k = 2
    assert tuple(runner.generate(prompt(5), mode="deferred", max_new_tokens=NEW).tokens) == reference("llama-aligned", 5)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7])
def test_fused_body_bf16_at_draft_shapes(tokens):
    """Qwen3-0.6B's and SmolLM2's layer shapes (2 layers), bf16, a cache of 700 entries: the fused
    and persistent bodies' hidden states and cache writes agree with the eager body's to bf16 rounding."""
    for config in (DecoderConfig(151936, 1024, 3072, 2, 16, 8, 128, rope_theta=1e6, qk_norm=True, tie_word_embeddings=True),
                   DecoderConfig(49152, 576, 1536, 2, 9, 3, 64, rope_theta=1e5, tie_word_embeddings=True)):
        model = Decoder.random(config, max_len=1024, dtype=torch.bfloat16, device="cuda", seed=3)
        model.k_cache.normal_(generator=torch.Generator("cuda").manual_seed(4))
        model.v_cache.normal_(generator=torch.Generator("cuda").manual_seed(5))
        ids = torch.randint(0, config.vocab_size, (tokens,), device="cuda", generator=torch.Generator("cuda").manual_seed(6))
        model.reset(700)
        results = {}
        for body in ("eager", "fused", "persistent"):
            model.body = body
            hidden = model.forward(ids).float()
            results[body] = hidden, model.k_cache[:, :, 700:700 + tokens].float().clone()
        eager, k_eager = results["eager"]
        for body in ("fused", "persistent"):
            hidden, k_body = results[body]
            assert torch.nn.functional.cosine_similarity(hidden, eager, dim=-1).min() > 0.999, body
            # Layer 0's keys come from the same inputs; later layers' inputs carry bf16 noise.
            torch.testing.assert_close(k_body[0], k_eager[0], rtol=2e-2, atol=2e-2, msg=body)
            cos = torch.nn.functional.cosine_similarity(k_body.flatten(2), k_eager.flatten(2), dim=-1)
            assert cos.min() > 0.999, body


@pytest.mark.gpu
def test_bf16_random_shape_graph_runner_is_deterministic():
    config = DecoderConfig(1000, 128, 256, 3, 4, 2, 32, qk_norm=True, tie_word_embeddings=True)
    target = Decoder.random(config, max_len=64, dtype=torch.bfloat16, device="cuda", seed=0)
    draft = Decoder.random(config, max_len=64, dtype=torch.bfloat16, device="cuda", seed=0)  # same weights
    runner = FastSpeculativeDecoder(target, draft, random_flash_head(draft.lm_head, 16, math.ceil(1000 / 16)), k=5)
    base = FastSpeculativeDecoder(target).generate(prompt(8), mode="baseline", max_new_tokens=NEW)
    for mode in ("ordinary", "deferred"):
        gen = runner.generate(prompt(8), mode=mode, max_new_tokens=NEW)
        # All probes: FlashHead scores the whole vocabulary, so the draft is the target; rounding of the
        # (K+1)-row verify may still flip a bf16 near-tie, so compare a prefix and the acceptance.
        assert gen.tokens[:4] == base.tokens[:4] and gen.stats.accepted > 0


def test_spec_cli_fast_path_default_draft_body_is_one_the_draft_runs():
    """--draft-body unset: persistent where the draft's dtype allows it (Gemma-3's layer too); a
    float64 draft, which the kernel bodies do not take, runs eager on a CPU (compiled on a GPU)."""
    from argparse import Namespace

    from flashhead_ext.speculative import cli

    for arch, dtype, body in (("llama", torch.float32, "persistent"), ("gemma3", torch.float32, "persistent"),
                              ("llama", torch.float64, "eager")):
        model = hf_model(arch, dtype=dtype)
        args = Namespace(max_new_tokens=4, k=3, device="cpu", draft_device=None, draft="a saved model", draft_body=None)
        _, draft = cli._fast_models(args, model, model, longest_prompt=5)
        assert draft.body == args.draft_body == body, arch


def test_spec_cli_fast_path_is_exact(tmp_path, monkeypatch):
    """``python -m flashhead_ext spec --fast``: a saved tiny Llama and its early-exit draft on the fast path."""
    from test_speculative import _save_tiny_model_with_tokenizer

    from flashhead_ext.speculative import cli

    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    _save_tiny_model_with_tokenizer(tmp_path / "model")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(dict(question_id=q, category="a", turns=[f"w{q} w7 w19 w{q + 20}"])) for q in (1, 3)))
    out = tmp_path / "spec.json"
    assert cli.main(["--target", str(tmp_path / "model"), "--draft", "early-exit:1", "--k", "3", "--prompts", str(questions),
                     "--num-prompts", "2", "--max-new-tokens", "6", "--kmeans-iters", "2", "--fast", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert all(row["exact"] == "2/2" for row in summary) and summary[-1]["verify_share"] is not None
    assert json.loads(out.read_text())["meta"]["draft_body"] == "persistent"  # the default
    for body in ("fused", "eager"):  # the draft's body is the user's to pick; each stays exact
        assert cli.main(["--target", str(tmp_path / "model"), "--draft", "early-exit:1", "--k", "3", "--prompts", str(questions),
                         "--num-prompts", "1", "--max-new-tokens", "4", "--kmeans-iters", "2", "--fast", "--draft-body", body,
                         "--json", str(out)]) == 0
        assert json.loads(out.read_text())["meta"]["draft_body"] == body
        assert all(row["exact"] == "1/1" for row in json.loads(out.read_text())["summary"])
    with pytest.raises(SystemExit):
        cli.main(["--target", str(tmp_path / "model"), "--draft-body", "fused", "--prompts", str(questions)])
    with pytest.raises(SystemExit):
        cli.main(["--target", str(tmp_path / "model"), "--synthetic-acceptance", "0.5", "--prompts", str(questions)])
