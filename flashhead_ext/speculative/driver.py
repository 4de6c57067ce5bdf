"""Greedy speculative decoding over transformers causal LMs: baseline, ordinary and deferred modes.

A round (docs/speculative.md has the full argument):

* the draft proposes K tokens greedily, each step fed the previous step's token as a device
  tensor, so the K proposals never wait on the host;
* the target scores them in one batched forward; the longest prefix that matches the target's own
  argmax is accepted and the target's token after it (a correction, or a bonus when all K match)
  is emitted too;
* both KV caches are cut back to the accepted prefix (``DynamicCache.crop`` with a negative count).

``ordinary`` appends that final token to the target with a single-token forward, which also yields
the target's next token: when it differs from the next round's first proposal the round emits it and
skips the verify. ``deferred`` instead puts the final token at the head of the next verify batch, so
no single-token forward is needed except the tail step (the last token of a generation).
"""
from __future__ import annotations

import inspect
import numbers
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import AbstractSet, Optional, Sequence, Union

import torch
from torch import Tensor

from .. import ops
from ..head import DenseHead, FlashHead, _HeadBase
from .._stacklevel import callers_stacklevel
from ..hf import (accelerate_hooks, check_plain_output_head, greedy_logit_settings, output_embedding,
                  prompt_learning_kind, unwrapped, warn_unapplied_generation_settings)
from .draft import keeps_recurrent_state, make_draft_head

MODES = ("baseline", "ordinary", "deferred")


@dataclass
class GenerationStats:
    """Counters and times of one generation (one prompt, one mode). Times in seconds.

    ``ttft_s`` covers both prefills and the first token; ``decode_s`` everything after it, of which
    ``draft_s`` (draft body + head; ``draft_head_s`` the head alone) and ``target_s`` are model
    calls and the rest is the loop's own overhead. Round ``i`` proposed ``k`` tokens (0 for the
    last token of a generation, when nothing it proposed could be emitted), emitted
    ``emitted_per_round[i]`` tokens, and ``accepted_per_round[i]`` of those were accepted proposals
    (proposals the verifier accepted beyond an EOS or the ``max_new_tokens`` cut are not counted).

    The fast path (:mod:`flashhead_ext.fast`) runs the draft head inside a CUDA graph with the body,
    so it leaves ``draft_head_s`` None; it fills ``phase_s`` (propose / verify / finalize, which tile
    the decode time) and, in timing runs with random weights, ``synthetic_acceptance``: then the
    tokens are not the target's greedy output.
    """

    mode: str
    prompt_tokens: int
    k: int
    new_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    verify_calls: int = 0
    skipped_verifies: int = 0
    append_calls: int = 0
    host_syncs: int = 0
    draft_s: float = 0.0
    draft_head_s: Optional[float] = 0.0
    target_s: float = 0.0
    accepted_per_round: list[int] = field(default_factory=list)
    emitted_per_round: list[int] = field(default_factory=list)
    phase_s: dict[str, float] = field(default_factory=dict)
    synthetic_acceptance: Optional[float] = None
    # The draft ran on another GPU, concurrently with the target: wall time is then no sum of the
    # two models' times, and the loop's overhead cannot be derived from them.
    draft_overlaps_target: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Generation:
    tokens: list[int]
    stats: GenerationStats


class Clock:
    """Sums time per phase. On CUDA it records events and reads them once at the end, so timing
    the phases adds no host sync to the rounds; on the CPU a host clock is exact."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.totals = defaultdict(float)
        self.events = []

    @contextmanager
    def __call__(self, phase: str):
        if self.cuda:
            # On the models' device's stream, which need not be the current device's (cuda:1).
            stream = torch.cuda.current_stream(self.device)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            stop.record(stream)
            self.events.append((phase, start, stop))
        else:
            start = time.perf_counter()
            yield
            self.totals[phase] += time.perf_counter() - start

    def resolve(self) -> dict:
        for phase, start, stop in self.events:
            self.totals[phase] += start.elapsed_time(stop) / 1000.0
        self.events.clear()
        return self.totals


def _untimed(phase: str):
    return nullcontext()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eos_ids(eos_token_id, default, vocab_size: int) -> frozenset:
    """``eos_token_id`` (an int, ints or an integer tensor) as a set of token ids; None: ``default``,
    the model's own setting (None: no EOS), whose ids outside the vocabulary are dropped as they
    are never generated (a given one is refused: a silent no-op)."""
    from_model = eos_token_id is None
    if from_model:
        eos_token_id = default
        if eos_token_id is None:
            return frozenset()
    given = eos_token_id
    if isinstance(eos_token_id, Tensor):
        eos_token_id = eos_token_id.reshape(-1).tolist()  # a float or bool tensor's items are refused below
    expected = f"eos_token_id must be an int or a sequence of ints, got {given!r}"
    if isinstance(eos_token_id, numbers.Integral):  # numpy's integers too
        ids = [eos_token_id]
    else:
        try:
            ids = list(eos_token_id)
        except TypeError:
            raise TypeError(expected) from None
    if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in ids):
        raise TypeError(expected)
    ids = [int(i) for i in ids]
    outside = sorted(i for i in ids if not 0 <= i < vocab_size)
    if outside and not from_model:
        raise ValueError(f"eos_token_id must be token ids in 0..{vocab_size - 1} (the vocabulary), got {outside}")
    return frozenset(i for i in ids if 0 <= i < vocab_size)


def check_prompt(input_ids, device: torch.device, vocab_size: int) -> Tensor:
    """One prompt as int64 ``[1, T]`` on ``device``, after checks that name the argument (reading
    its values: a host sync, before generation starts)."""
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must hold one prompt ([T] or [1, T]; run prompts one after another), got shape {tuple(input_ids.shape)}")
    if input_ids.dim() not in (1, 2) or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [T] or [1, T] tensor, got shape {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"input_ids must be int32 or int64 token ids, got {input_ids.dtype}")
    if input_ids.is_meta:  # else torch's error when its values are read below
        raise ValueError("input_ids are on the meta device, which holds no values: pass token ids on a CPU or CUDA device")
    # Out of range, the embedding lookup fails without naming the argument (on CUDA: a device assert).
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()
    if low < 0 or high >= vocab_size:
        raise ValueError(f"input_ids must be token ids in 0..{vocab_size - 1} (the vocabulary), got {low if low < 0 else high}")
    return input_ids.reshape(1, -1).to(device, torch.int64)


def check_mode(mode: str, has_draft: bool) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "baseline" and not has_draft:
        raise ValueError(f"mode {mode!r} needs a draft model; this decoder was built without one")


class Emitter:
    """The emitted tokens of one generation and the per-round counters; cuts at EOS or the budget."""

    def __init__(self, stats: GenerationStats, eos: frozenset, max_new_tokens: int):
        self.tokens: list = []
        self.stats, self.eos, self.max_new_tokens = stats, eos, max_new_tokens

    def first(self, token: int) -> bool:
        """The prefill's token; True when it already ends the generation."""
        self.tokens.append(token)
        return token in self.eos or self.max_new_tokens == 1

    @property
    def left(self) -> int:
        return self.max_new_tokens - len(self.tokens)

    def emit(self, tokens: list, proposed: int, accepted: int) -> bool:
        """Appends a round's tokens (``accepted`` proposals, then the target's token) up to EOS or the
        budget; True when the generation is over."""
        done = False
        for count, token in enumerate(tokens, 1):
            self.tokens.append(token)
            if token in self.eos or len(self.tokens) == self.max_new_tokens:
                done = True
                break
        # Accepted proposals that the cut left unemitted are not counted: they would inflate the
        # acceptance of short runs, and differ between heads whose emitted tokens are the same.
        accepted = min(accepted, count)
        s = self.stats
        s.rounds += 1
        s.proposed += proposed
        s.accepted += accepted
        s.accepted_per_round.append(accepted)
        s.emitted_per_round.append(count)
        return done


def _output_embedding(model, role: str) -> Tensor:
    try:
        return output_embedding(model)
    except ValueError as error:
        raise ValueError(f"{role}: {error}") from None


def check_draft_vocab(draft_rows: int, vocab: int) -> None:
    """The draft shares the target's tokenizer: its rows are the first of the target's ``vocab``
    (which may add padding rows, as Qwen2.5-7B's 152,064 to Qwen2.5-0.5B's 151,936)."""
    if draft_rows > vocab:
        raise ValueError(f"draft must share the target's tokenizer: its vocabulary has {draft_rows} rows, "
                         f"more than the target's {vocab}")


def resolve_draft_head(draft_head, embedding: Tensor, vocab: int) -> Union[DenseHead, FlashHead]:
    """The draft's head, after the checks both drivers make: ``"dense"`` or None builds a DenseHead
    over the draft's output ``embedding [V, D]``; a DenseHead / FlashHead must cover the draft's V tokens and
    take its hidden size D (:func:`check_draft_vocab`: V at most ``vocab``)."""
    check_draft_vocab(embedding.shape[0], vocab)
    if draft_head is None:
        draft_head = "dense"
    if isinstance(draft_head, str):
        if draft_head != "dense":
            raise ValueError(f"draft_head must be 'dense' or a DenseHead/FlashHead instance (build a FlashHead with make_draft_head), got {draft_head!r}")
        draft_head = make_draft_head("dense", embedding)
    if not isinstance(draft_head, _HeadBase):
        raise TypeError(f"draft_head must be 'dense', a DenseHead or a FlashHead, got {type(draft_head).__name__}")
    if draft_head.vocab_size != embedding.shape[0]:
        raise ValueError(f"draft_head must cover the draft's vocabulary of {embedding.shape[0]} tokens, got {draft_head.vocab_size}")
    if draft_head.hidden_dim != embedding.shape[1]:  # what the draft body's final hidden states hold
        raise ValueError(f"draft_head must take the draft's hidden size {embedding.shape[1]}, got {draft_head.hidden_dim}")
    return draft_head


def require_no_draft_options(draft_head, **options) -> None:
    """ValueError when a driver built without a draft is given a draft's options, which it would
    silently ignore: a ``draft_head`` other than the default ``"dense"``, or one of ``options`` set."""
    given = [name for name, value in options.items() if value is not None]
    if not (draft_head is None or (isinstance(draft_head, str) and draft_head == "dense")):
        given.insert(0, "draft_head")
    if given:
        raise ValueError(f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to a draft, and no draft was "
                         "given (draft=None: baseline decoding only)")


def draft_input(ids: Tensor, draft_vocab: int, vocab: int) -> Tensor:
    """``ids`` as the draft takes them: a target token past the draft's ``draft_vocab`` rows (a padding
    row of the target's ``vocab``) becomes the draft's last id. That can cost the round its acceptance,
    never the output's exactness: the target decides every token."""
    return ids.clamp(max=draft_vocab - 1) if draft_vocab < vocab else ids


def _drop_last(cache, count: int) -> None:
    """Removes the cache's last ``count`` positions; none when ``count <= 0``."""
    # transformers before 5.15 reads crop(0) as "keep 0 positions".
    if count > 0:
        cache.crop(-count)


def cache_keyword(module) -> str:
    """The keyword ``module``'s forward takes its KV cache by: ``cache`` from transformers 5.24,
    which deprecates ``past_key_values`` (removed in 5.40), ``past_key_values`` before. A wrapper
    whose forward names neither (``torch.compile``'s, one passing ``**kwargs`` on) gets the
    installed transformers' keyword."""
    from transformers import LlamaForCausalLM

    for forward in (unwrapped(module).forward, LlamaForCausalLM.forward):
        name = _named_cache_keyword(forward)
        if name is not None:
            return name
    raise TypeError("the installed transformers' causal LM forward takes neither cache= nor past_key_values=")


def _named_cache_keyword(forward) -> Optional[str]:
    """The cache keyword ``forward``'s signature names (:func:`cache_keyword`'s two), or None."""
    parameters = inspect.signature(forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def resident_draft_device(draft) -> torch.device:
    """The device of ``draft``'s weights; a ValueError where they are on the meta device (not loaded,
    or offloaded): the draft's head reads its output weights at every step."""
    device = next(draft.parameters()).device
    if device.type == "meta":
        raise ValueError("draft's weights are on the meta device, which holds no values (a model built there and not "
                         "loaded yet, or offloaded, e.g. by accelerate's cpu_offload or a device_map with CPU or disk "
                         "entries): the draft's head reads them at every proposal, so load the draft and keep it on the "
                         "device that runs it")
    return device


def _hooked_execution_device(module) -> Optional[torch.device]:
    """The device an accelerate hook on ``module`` runs it on (a SequentialHook's first that names
    one), as torch names it: an int is the accelerator's index, and "cuda" the current GPU; or None."""
    for each in accelerate_hooks(module):
        device = getattr(each, "execution_device", None)
        if device is not None:
            device = torch.device(device)
            return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device
    return None


def input_embeddings(model) -> Optional[torch.nn.Module]:
    """``model``'s input embedding, or None where it names none (a plain module, or one wrapping a
    model: transformers raises NotImplementedError where it finds none)."""
    try:
        return model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None


def target_input_device(target) -> torch.device:
    """Where ``target`` takes its input ids: where accelerate's hooks run its input embedding (or the
    model: ``cpu_offload_with_hook`` keeps the weights on the CPU and moves the model at each call),
    else the embedding's own device. A ValueError for meta weights with no hook to load them."""
    base = unwrapped(target)
    weight = getattr(input_embeddings(base), "weight", None)
    if not isinstance(weight, Tensor):  # a module wrapping a model: its first weight takes the ids
        weight = next(base.parameters())
    # The hook is on the module owning the weight (a PEFT LoRA embedding's base_layer, not the wrapper),
    # or on the model: cpu_offload_with_hook's on the one it was given, which may be a PEFT wrapper.
    owners = [module for module in base.modules() if any(p is weight for p in module.parameters(recurse=False))]
    for module in (*owners, base, target):
        device = _hooked_execution_device(module)
        if device is not None:
            return device
    if not weight.is_meta:
        return weight.device
    raise ValueError("target's input embedding is on the meta device with no accelerate hook to load it, so it holds "
                     "no weights: load them, or offload the model with accelerate (cpu_offload, a device_map), whose "
                     "hooks this driver's calls run through")


def refuse_prompt_learning(model, role: str) -> None:
    """ValueError where ``model`` is a PEFT prompt-learning model (prompt, prefix or P-tuning): PEFT adds
    its virtual tokens in its own forward, which a draft's body call skipped (its proposals were the
    untuned model's) and a target's cached calls do not reproduce."""
    kind = prompt_learning_kind(model)
    if kind is not None:
        raise ValueError(f"{role} is a PEFT prompt-learning model ({kind}), "
                         "whose virtual tokens PEFT adds in its own forward, which this driver's calls do not "
                         "reproduce; adapters in the weights (LoRA) work, or decode it with its own generate()")


def require_dynamic_cache(model, role: str) -> None:
    """ValueError unless ``model`` (``role``: "target" or "draft") is a decoder-only model that keeps
    its context in a transformers ``DynamicCache``, which this driver gives it: an encoder-decoder
    failed deep in transformers; a model with a cache of its own kind (transformers'
    ``_supports_default_dynamic_cache``: RWKV, xLSTM, MiniMax...) failed there or, taking
    ``**kwargs``, ignored the cache and decoded every step without its context (RWKV), without a word."""
    base = unwrapped(model)
    name = type(base).__name__
    if getattr(getattr(base, "config", None), "is_encoder_decoder", False):
        raise ValueError(f"{role} must be a decoder-only causal LM, got the encoder-decoder {name}")
    supports_dynamic_cache = getattr(base, "_supports_default_dynamic_cache", None)
    from transformers import PreTrainedModel
    # A transformers model's own forward names its cache; a wrapper's may pass **kwargs on (cache_keyword).
    names_no_cache = isinstance(base, PreTrainedModel) and _named_cache_keyword(base.forward) is None
    if names_no_cache or (callable(supports_dynamic_cache) and not supports_dynamic_cache()):
        raise ValueError(f"{role} {name} keeps its context in a cache of its own kind, not the transformers DynamicCache "
                         f"this driver keeps: decode it with its own generate()")


def warn_if_dropout_active(model, role: str) -> None:
    """A warning when ``model`` is in training mode with a dropout that draws: its tokens are then
    random, not the greedy ones the driver promises (a model built as ``Cls(config)`` starts so).
    A dropout is a module or, applied functionally (Llama's attention, GPT-J's ``attn_pdrop``), a
    config setting (not a classification head's or a summary's, which a causal LM does not apply)."""
    if not model.training:
        return
    config = getattr(model, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else {}
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0 for m in model.modules()) or any(
            ("dropout" in key or key.endswith("pdrop")) and not key.startswith(("classifier", "summary"))
            and isinstance(value, numbers.Real)
            and not isinstance(value, bool) and value > 0 for key, value in settings.items()):
        warnings.warn(f"{role} is in training mode and its dropout is active, so its tokens are random, not its greedy "
                      f"ones: call {role}.eval() first", UserWarning, stacklevel=callers_stacklevel())


def length_dependent_rope(config) -> Optional[tuple]:
    """(rope_type, positions) where ``config``'s RoPE frequencies change once a forward's sequence
    passes ``positions`` (transformers picks them from each forward's length), else None. A cache
    kept across the change then holds keys rotated by other frequencies than the full sequence's."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    per_layer_type = [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]
    for parameters in per_layer_type:
        rope_type = parameters.get("rope_type", parameters.get("type"))
        if rope_type == "longrope":
            return rope_type, int(parameters.get("original_max_position_embeddings",
                                                 getattr(config, "original_max_position_embeddings", 0)))
        if rope_type == "dynamic":
            return rope_type, int(config.max_position_embeddings)
    return None


def longest_forward(prompt_tokens: int, max_new_tokens: int, k: int) -> tuple[int, str]:
    """The longest sequence the target's forwards see in a generation of ``max_new_tokens`` after
    ``prompt_tokens`` (``k`` proposals a round; 0 in baseline), and its sum in words: prompt +
    max_new_tokens - 1, and where rounds propose (k > 0, from 3 new tokens: a round proposes only
    while two are left to emit) prompt + max_new_tokens - 2 + k. The draft's see one fewer."""
    rounds = k > 0 and max_new_tokens >= 3
    proposals = f" - 2 + k ({k})" if rounds else " - 1"
    return (prompt_tokens + max_new_tokens + (k - 2 if rounds else -1),
            f"prompt ({prompt_tokens}) + max_new_tokens ({max_new_tokens}){proposals}")


def rope_switch_problem(rope_switch: Optional[tuple], prompt_tokens: int, max_new_tokens: int, k: int) -> Optional[str]:
    """Why a generation (:func:`longest_forward`'s arguments) would not give the target's greedy
    tokens under ``rope_switch`` (:func:`length_dependent_rope`), or None. ``longrope`` picks one of
    two sets: a prompt already past the switch uses the long set in every forward. ``dynamic``
    rescales at every length past it."""
    if rope_switch is None:
        return None
    rope_type, switch = rope_switch
    longest, reach = longest_forward(prompt_tokens, max_new_tokens, k)
    if longest <= switch or (rope_type == "longrope" and prompt_tokens > switch):
        return None
    past = " (or a prompt longer than that)" if rope_type == "longrope" else ""
    return (f"the target's {rope_type} RoPE changes its frequencies once a forward's sequence passes {switch} positions, "
            f"which a cache kept across the change does not reproduce: {reach} must be at most {switch}{past}")


def learned_positions(model) -> Optional[int]:
    """How many positions ``model``'s learned absolute position table takes (GPT-2's ``wpe``, OPT's
    ``embed_positions``: its config's ``max_position_embeddings``), or None for a model without one
    (rotary and ALiBi models take any position)."""
    inputs = input_embeddings(model)
    for name, module in model.named_modules():
        leaf = name.removesuffix(".base_layer").rsplit(".", 1)[-1]  # a PEFT LoRA layer's table is its base_layer
        if isinstance(module, torch.nn.Embedding) and module is not inputs and (leaf == "wpe" or "position" in leaf):
            return int(getattr(getattr(model, "config", None), "max_position_embeddings", None) or module.num_embeddings)
    return None


def position_table_problem(role: str, positions: Optional[int], prompt_tokens: int, max_new_tokens: int,
                           k: int) -> Optional[str]:
    """Why ``role``'s forwards (the target's, or the draft's, one fewer) would run past its learned
    position table of ``positions`` (:func:`learned_positions`) in a generation of
    :func:`longest_forward`'s arguments, or None: its forward would fail with an IndexError mid-run."""
    if positions is None:
        return None
    longest, reach = longest_forward(prompt_tokens, max_new_tokens, k)
    if role == "draft":
        longest, reach = longest - 1, f"{reach} - 1"
    if longest <= positions:
        return None
    return (f"the {role}'s learned position table takes {positions} positions (max_position_embeddings), and its "
            f"forwards would reach {longest}: {reach} must be at most {positions}")


def length_problem(rope_switch: Optional[tuple], positions: dict, prompt_tokens: int, max_new_tokens: int,
                   k: int) -> Optional[str]:
    """The first reason a generation (:func:`longest_forward`'s arguments) cannot be run, before any
    forward: the target's RoPE switch (:func:`rope_switch_problem`), or a position table of a role
    in ``positions`` (``{role: positions}``, :func:`position_table_problem`); or None."""
    problems = [rope_switch_problem(rope_switch, prompt_tokens, max_new_tokens, k)]
    problems += [position_table_problem(role, table, prompt_tokens, max_new_tokens, k) for role, table in positions.items()]
    return next(filter(None, problems), None)


class SpeculativeDecoder:
    """Greedy decoding of ``target``, optionally sped up by ``draft`` proposing ``k`` tokens a round.

    Args:
        target: a transformers causal LM (``model(input_ids, cache=...)`` gives logits;
            ``past_key_values=`` before transformers 5.24), resident, or offloaded or split over GPUs
            by accelerate (a ``device_map``): it is fed on the device that runs its input embedding.
        draft: a transformers causal LM with the target's tokenizer on that device, or None for baseline only (its
            vocabulary may lack padding rows the target has: see :func:`draft_input`). Its body
            (``draft.base_model``) gives the final hidden states; ``draft_head`` turns them into tokens.
        draft_head: None (the default: the head of a FlashHead attached to the draft by
            :func:`flashhead_ext.hf.attach` and enabled when the driver is built, followed through
            its ``probes`` and the draft's casts, else ``"dense"``), ``"dense"`` (a DenseHead over the draft's output embedding, a float32
            copy of a float64 one) or a DenseHead / FlashHead instance (see
            :func:`flashhead_ext.speculative.make_draft_head`). Hidden states are cast to the head's
            dtype, so a head may run in another dtype than the draft.
        k: proposals per round, >= 1.
        eos_token_id: int or ints that end a generation (emitted, then stop). None: the target's
            ``generation_config.eos_token_id``; an empty list: never stop early.
    """

    @property
    def k(self) -> int:
        """Proposals per round; may be changed between generations."""
        return self._k

    @k.setter
    def k(self, value: int) -> None:
        self._k = ops._require_positive_int("k", value)

    def __init__(self, target, draft=None, draft_head: Union[str, DenseHead, FlashHead, None] = None, *, k: int = 6,
                 eos_token_id: Union[int, Sequence[int], AbstractSet[int], Tensor, None] = None):
        self.target = target
        # First: it names a target that is no causal LM (a model name, a tokenizer), which the
        # forward's signature and parameters below would not.
        self.vocab_size = vocab = _output_embedding(target, "target").shape[0]
        require_dynamic_cache(target, "target")
        refuse_prompt_learning(target, "target")
        self._target_cache = cache_keyword(target)
        self.k = k
        # A device_map may split the target over GPUs or offload it: its inputs go where it embeds them,
        # and accelerate's hook on the model brings its logits back there.
        self.device = target_input_device(target)
        self.eos = eos_ids(eos_token_id, getattr(getattr(target, "generation_config", None), "eos_token_id", None), vocab)
        warn_unapplied_generation_settings(greedy_logit_settings(target))
        self._rope_switch = length_dependent_rope(getattr(target, "config", None))
        self._positions = {"target": learned_positions(unwrapped(target))}
        self.draft = draft
        self._head = self._attachment = None
        if draft is None:
            require_no_draft_options(draft_head)
            return
        require_dynamic_cache(draft, "draft")
        refuse_prompt_learning(draft, "draft")
        plain_draft = unwrapped(draft)
        for model, role in ((unwrapped(target), "target"), (plain_draft, "draft")):
            if keeps_recurrent_state(model):
                raise ValueError(f"{role} {type(model).__name__} keeps a recurrent state, which speculative decoding "
                                 "cannot cut back to the accepted tokens; decode it without a draft (draft=None, mode='baseline')")
        if draft_head is None:  # the draft's own FlashHead: drafting dense instead misreported its head's time
            attachment = getattr(plain_draft, "flash_head", None)
            if attachment is not None and attachment.enabled:
                self._attachment, draft_head = attachment, attachment.head()
        head = resolve_draft_head(draft_head, _output_embedding(draft, "draft"), vocab)
        self._head = None if self._attachment is not None else head  # else it kept a cast-away weight alive
        check_plain_output_head(draft, "draft")
        if plain_draft.base_model is plain_draft:  # else its head ran in every draft step's body, then a crash
            raise ValueError(f"draft {type(plain_draft).__name__}'s base_model is the causal LM itself "
                             f"(base_model_prefix {plain_draft.base_model_prefix!r} names no submodule), so its final "
                             "hidden states cannot be read before its head")
        draft_device = resident_draft_device(draft)
        if draft_device != self.device:  # else torch's device error mid-generation
            raise ValueError(f"draft must be on the target's device {self.device}, got {draft_device} (this driver runs "
                             "both on one device; flashhead_ext.fast's runner takes a draft Decoder built on another device)")
        if self.head.embedding.device != draft_device:
            raise ValueError(f"draft_head must be on the draft's device {draft_device}, got {self.head.embedding.device}")
        # The body whose final hidden states the head scores: a PEFT model's base_model is PEFT's
        # wrapper of the whole causal LM, which returned logits (a crash at the first proposal).
        self._draft_body = plain_draft.base_model
        self._positions["draft"] = learned_positions(plain_draft)
        self._draft_cache = cache_keyword(self._draft_body)
        self.draft_vocab = self.head.vocab_size

    @property
    def head(self) -> Union[DenseHead, FlashHead, None]:
        """The draft's head; a draft's attached FlashHead's as the attachment has it at each call (its
        ``probes``, the draft's casts and moves; whether it is enabled or attached is read once, when
        the driver is built)."""
        return self._head if self._attachment is None else self._attachment.head()

    # ---- model calls -------------------------------------------------------------------------

    def _target_argmax(self, ids: Tensor, cache, clock, *, every_position: bool = False) -> Tensor:
        """The target's greedy token after each position of ``ids`` (or only the last), int64 ``[n]``."""
        with clock("target"):
            logits = self.target(input_ids=ids.view(1, -1), **{self._target_cache: cache}, use_cache=True,
                                 logits_to_keep=0 if every_position else 1).logits
            return logits[0].argmax(dim=-1)

    def _draft_next(self, ids: Tensor, cache, clock) -> Tensor:
        """The draft head's token after ``ids`` (int64 ``[1]``, on the device)."""
        with clock("draft_body"):
            hidden = self._draft_body(input_ids=ids.view(1, -1), **{self._draft_cache: cache},
                                      use_cache=True).last_hidden_state
        with clock("draft_head"):
            head = self.head
            return head.next_token(hidden[0, -1:].to(head.embedding.dtype))

    def _propose(self, pending: Tensor, cache, clock, k: int) -> Tensor:
        """``k`` greedy proposals ``[k]``. The draft cache gains ``pending`` and the first k-1 proposals."""
        tokens, ids = [], draft_input(pending, self.draft_vocab, self.vocab_size)
        for _ in range(k):
            ids = self._draft_next(ids, cache, clock)
            tokens.append(ids)
        return torch.cat(tokens)

    # ---- generation --------------------------------------------------------------------------

    def _new_cache(self, model, croppable: bool):
        from transformers import DynamicCache

        if croppable:
            # Without a config every layer keeps all its entries, so the cache can be cut back by
            # any count; sliding-window layers still see only their window, through the mask. A
            # config's sliding-window layers drop old entries; recording them is missing before
            # transformers 5.15 and mis-sizes the mask before 5.18 (docs/speculative.md).
            return DynamicCache()
        return DynamicCache(config=model.config)

    @torch.inference_mode()
    def generate(self, input_ids: Tensor, *, mode: str = "deferred", max_new_tokens: int = 64) -> Generation:
        """Greedy continuation of one prompt; the tokens equal the target's own greedy decoding.

        Generation stops after ``max_new_tokens`` tokens or after an EOS token (which is emitted).
        """
        check_mode(mode, self.draft is not None)
        max_new_tokens = ops._require_positive_int("max_new_tokens", max_new_tokens)
        prompt = check_prompt(input_ids, self.device, self.vocab_size)
        # A draft's dropout costs acceptance only: the target decides every token.
        warn_if_dropout_active(self.target, "target")
        # k read once: another thread setting it mid-generation gave rounds of two sizes (wrong tokens).
        k = self.k if mode != "baseline" else 0
        positions = {role: table for role, table in self._positions.items() if role == "target" or mode != "baseline"}
        problem = length_problem(self._rope_switch, positions, prompt.shape[1], max_new_tokens, k)
        if problem:  # before any forward, not as an IndexError mid-run
            raise ValueError(problem)
        stats = GenerationStats(mode=mode, prompt_tokens=prompt.shape[1], k=k)
        output = Emitter(stats, self.eos, max_new_tokens)
        emit = output.emit

        speculative = mode != "baseline"
        start = time.perf_counter()
        target_cache = self._new_cache(self.target, speculative)
        first = self._target_argmax(prompt, target_cache, _untimed)  # prefill: reported as TTFT only
        if speculative:
            # The draft's prefill is part of the time to first token: a round cannot start without it.
            draft_cache = self._new_cache(self.draft, True)
            self._draft_body(input_ids=draft_input(prompt, self.draft_vocab, self.vocab_size),
                             **{self._draft_cache: draft_cache}, use_cache=True)
        done = output.first(int(first))
        stats.ttft_s = time.perf_counter() - start

        clock = Clock(self.device)
        decode_start = time.perf_counter()
        final = first  # the last emitted token, on the device
        known = None   # ordinary mode: the target's token after `final`, already computed
        pending_draft = first  # tokens the draft cache lacks, ending with `final`
        if mode == "ordinary" and not done:
            known = self._target_argmax(final, target_cache, clock)
            stats.append_calls += 1

        while not done:
            left = output.left
            if mode == "baseline":
                final = self._target_argmax(final, target_cache, clock)
                stats.append_calls += 1
                stats.host_syncs += 1
                done = emit([int(final)], 0, 0)
                continue
            if left == 1:
                # Only the target's next token is still wanted: proposals could not be emitted.
                if mode == "deferred":  # the tail step: `final` has not been through the target yet
                    known = self._target_argmax(final, target_cache, clock)
                    stats.append_calls += 1
                stats.host_syncs += 1
                done = emit([int(known)], 0, 0)
                continue

            proposals = self._propose(pending_draft, draft_cache, clock, k)
            verified = True
            if mode == "ordinary":
                first_pair = torch.cat([known, proposals[:1]]).tolist()
                stats.host_syncs += 1
                # A refuted first proposal means the verify could accept nothing: skip it.
                verified = first_pair[0] == first_pair[1]
                if verified:
                    # checks[i]: the target's token at proposal i's position; checks[k]: the bonus.
                    checks = torch.cat([known, self._target_argmax(proposals, target_cache, clock, every_position=True)])
                else:
                    stats.skipped_verifies += 1
                    checks, drafted, targeted, accepted = known, [], first_pair[:1], 0
            else:
                checks = self._target_argmax(torch.cat([final, proposals]), target_cache, clock, every_position=True)
            if verified:
                stats.verify_calls += 1
                packed = torch.cat([proposals, checks]).tolist()  # learns the accepted length
                stats.host_syncs += 1
                drafted, targeted = packed[:k], packed[k:]
                accepted = 0
                while accepted < k and drafted[accepted] == targeted[accepted]:
                    accepted += 1
                # The target cache gained the k proposals (deferred: `final` before them); keep the accepted.
                _drop_last(target_cache, k - accepted)
            # The draft cache gained proposals 1..k-1; with all k accepted it still lacks the k-th.
            _drop_last(draft_cache, k - 1 - accepted)
            final = checks[accepted:accepted + 1]
            pending_draft = torch.cat([proposals[k - 1:], final]) if accepted == k else final
            done = emit(drafted[:accepted] + [targeted[accepted]], k, accepted)
            if mode == "ordinary" and not done:
                known = self._target_argmax(final, target_cache, clock)
                stats.append_calls += 1

        sync(self.device)
        stats.decode_s = time.perf_counter() - decode_start
        stats.new_tokens = len(output.tokens)
        totals = clock.resolve()
        stats.target_s = totals["target"]
        stats.draft_head_s = totals["draft_head"]
        stats.draft_s = totals["draft_body"] + totals["draft_head"]
        return Generation(output.tokens, stats)
