"""Speculative decoding on :class:`~flashhead_ext.fast.decoder.Decoder` models with CUDA-graph steps.

The same modes, exactness argument and host-sync rules as :mod:`flashhead_ext.speculative.driver`
(docs/speculative.md), but every per-round step is a fixed-shape function over static buffers,
captured once as a CUDA graph on the GPU (run eagerly on the CPU):

* ``propose`` / ``propose_pair`` (draft device): K draft steps. The draft cache is always cut back
  to ``len(sequence) - 2`` entries and the next input is the last two emitted tokens. When the last
  round accepted fewer than K proposals, the draft already fed the second-to-last token, so
  ``propose`` keeps its entry and feeds one token (the step the draft body is fastest at); when all
  K were accepted (and after the prefill) ``propose_pair``'s first step feeds both. The host knows
  ``a`` from the round's one read, so picking the graph adds no sync.
* ``verify`` (target device): the K proposals after the cached context (deferred: the pending last
  token first), the target's argmax at every position.
* ``append`` (target): one token, its argmax (baseline, ordinary's append, deferred's tail step).
* ``finalize`` (target): the accepted length ``a`` from the argmaxes (or, with
  ``synthetic_acceptance``, from seeded uniforms), the emitted tokens, the target cache cut back by
  setting its length, the draft's next input; then ``rewind`` (draft device) cuts the draft cache.

The host reads one small tensor per round (ordinary: two when it verifies), as the driver does.
With the draft on another GPU (``Decoder`` built on that device), ordinary mode's append of the
round's last token runs on the target GPU while the draft GPU already proposes the next block.
"""
from __future__ import annotations

import time
import weakref
import zlib
from contextlib import nullcontext
from typing import AbstractSet, Optional, Sequence, Union

import torch
from torch import Tensor

from .. import ops
from .._exclusive import ExclusiveUse
from ..graphs import capture_graph
from ..head import DenseHead, FlashHead
from ..hf import warn_unapplied_generation_settings
from ..speculative.driver import (Clock, Emitter, Generation, GenerationStats, check_mode, check_prompt, draft_input,
                                  eos_ids, require_no_draft_options, resolve_draft_head, sync)
from .decoder import Decoder


def on_device(device: torch.device):
    """Makes ``device`` current for CUDA calls that use the current device (events, graph replay)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


class _Step:
    """``method(*args)`` run eagerly, or captured once as a CUDA graph on ``device`` and replayed.

    The method's runner is held weakly: the runner holds its steps, and a cycle back to it would
    keep a dropped runner, its models and its graphs alive until a garbage collection, which may
    come during another graph's capture, where destroying a graph fails that capture.
    """

    def __init__(self, method, device: torch.device, *args):
        self.method, self.args, self.device, self.graph = weakref.WeakMethod(method), args, device, None

    def run(self) -> None:
        self.method()(*self.args)

    def capture(self, prepare) -> None:
        """``prepare`` puts the state where a run is in bounds (the warm-ups really execute and move
        cache lengths)."""
        self.graph = capture_graph(self.run, device=self.device, prepare=prepare, warmups=2)

    def __call__(self) -> None:
        if self.graph is None:
            self.run()
        else:
            with on_device(self.device):
                self.graph.replay()


class _HostCopy:
    """A device tensor's values read by the host without waiting for work queued after the read."""

    def __init__(self, src: Tensor):
        cuda = src.device.type == "cuda"
        self.src, self.host = src, torch.zeros(src.shape, dtype=src.dtype, device="cpu", pin_memory=cuda)
        self.ready = torch.cuda.Event() if cuda else None

    def start(self) -> None:
        with on_device(self.src.device):
            self.host.copy_(self.src, non_blocking=True)
            if self.ready is not None:
                self.ready.record()

    def wait(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


class _Marks:
    """Phase boundaries on the target's timeline: CUDA events read once per generation (no syncs),
    or a host clock on the CPU. The time from one mark to the next goes to the first mark's phase."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks = []

    def __call__(self, phase: Optional[str]) -> None:
        if self.cuda:
            with on_device(self.device):
                event = torch.cuda.Event(enable_timing=True)
                event.record()
        else:
            event = time.perf_counter()
        self.marks.append((phase, event))

    def resolve(self) -> dict:
        totals = {}
        for (phase, start), (_, stop) in zip(self.marks, self.marks[1:]):
            if phase is not None:
                seconds = start.elapsed_time(stop) / 1000.0 if self.cuda else stop - start
                totals[phase] = totals.get(phase, 0.0) + seconds
        return totals


# Two threads' generations over one driver, or over drivers sharing a model, overwrote each other's
# caches and buffers: wrong tokens, no error.
_GENERATING = ExclusiveUse(lambda: RuntimeError(
    "this FastSpeculativeDecoder or one of its Decoders is generating in another thread: their caches, buffers and "
    "graphs serve one generation at a time; build a driver and Decoders for each thread"))


class FastSpeculativeDecoder:
    """Greedy speculative decoding of ``target`` with ``draft`` proposing ``k`` tokens a round.

    Args:
        target, draft: two :class:`Decoder` objects with one tokenizer (``draft`` None: baseline only;
            the draft's vocabulary may lack padding rows the target's has: see
            :func:`~flashhead_ext.speculative.driver.draft_input`); each holds its own cache, so a
            draft with the target's weights is a second Decoder built from them. They may sit on different devices: build the draft Decoder (and its
            head) on the other one (the CLIs' ``--draft-device`` does this). With graphs, both
            need ``max_len >= 3 * (k + 2)``.
        draft_head: ``"dense"`` (the draft's own output embedding; a float32 copy of a float64 one)
            or a DenseHead / FlashHead on the draft's device. A FlashHead's ``probes`` and special
            tokens may be changed between generations (on a GPU the next one captures the steps'
            graphs again for them).
        k: proposals per round; it may be changed later (the steps are rebuilt for it).
        eos_token_id: int or ints that end a generation (emitted, then stop). None: the target's
            ``eos_token_id`` (``Decoder.from_hf``: the model's ``generation_config.eos_token_id``, as
            :class:`SpeculativeDecoder`); an empty list: never stop early, which also lets deferred
            mode with a ``"persistent"`` draft body launch a round's proposals before the host has
            read the last round (timing runs).
        synthetic_acceptance: None for the exact greedy verifier; a probability R in [0, 1] makes the
            verifier accept each proposal independently with probability R (seeded by ``seed``, an int
            given only with ``synthetic_acceptance``; 0 when not given), for
            timing at real shapes with random weights; a generation's draws depend on ``seed`` and
            its prompt only. The round then emits the draft's proposals up
            to the first rejection plus the target's token at that position; the output is not the
            target's greedy decoding, and the stats say so.
        graphs: capture the steps as CUDA graphs; default: when the target is on a GPU. The steps are
            built for the models' ``body`` and ``attention`` at construction: set those first
            (``generate`` refuses a later change).

    ``generate(prompt, max_new_tokens=n)`` needs ``max_len`` of both models ``>= prompt + n + k + 1``
    (baseline: the target's ``>= prompt + n - 1``), checked per call.
    """

    def __init__(self, target: Decoder, draft: Optional[Decoder] = None,
                 draft_head: Union[str, DenseHead, FlashHead] = "dense", *, k: int = 6,
                 eos_token_id: Union[int, Sequence[int], AbstractSet[int], Tensor, None] = None, synthetic_acceptance: Optional[float] = None,
                 seed: Optional[int] = None, graphs: Optional[bool] = None):
        if not isinstance(target, Decoder):
            raise TypeError(f"target must be a flashhead_ext.fast.Decoder, got {type(target).__name__}")
        if draft is not None and not isinstance(draft, Decoder):
            raise TypeError(f"draft must be a flashhead_ext.fast.Decoder or None, got {type(draft).__name__}")
        self.target, self.draft, self._k = target, draft, ops._require_positive_int("k", k)
        self.eos = eos_ids(eos_token_id, target.eos_token_id, target.config.vocab_size)
        warn_unapplied_generation_settings(target.generation_settings)
        if synthetic_acceptance is not None:
            synthetic_acceptance = ops._require_float("synthetic_acceptance", synthetic_acceptance)
            if not 0.0 <= synthetic_acceptance <= 1.0:
                raise ValueError(f"synthetic_acceptance must be a probability in [0, 1] or None, got {synthetic_acceptance!r}")
        self._synthetic = synthetic_acceptance
        if seed is not None:
            seed = ops._require_int("seed", seed)  # an int64: it is hashed as 8 signed bytes
            if synthetic_acceptance is None:  # else a seed meant to vary the timing runs changed nothing
                raise ValueError("seed seeds synthetic_acceptance's draws, and synthetic_acceptance is None (the exact "
                                 "verifier draws nothing): leave seed out or give synthetic_acceptance")
        self.seed = 0 if seed is None else seed
        if graphs is not None and not isinstance(graphs, bool):  # "false" read as a truth value captured graphs
            raise TypeError(f"graphs must be True, False or None (the default: graphs when the target is on a GPU), "
                            f"got {graphs!r}")
        self.graphs = target.device.type == "cuda" if graphs is None else graphs
        if self.graphs and target.device.type != "cuda":
            raise ValueError(f"graphs=True needs the models on a CUDA device, the target is on {target.device}")
        self.head: Union[DenseHead, FlashHead, None] = None
        if draft is None:
            require_no_draft_options(draft_head, synthetic_acceptance=synthetic_acceptance)
        else:
            self.head = self._check_draft(draft, draft_head)
        with _GENERATING(*self._models_if_capturing()):
            self._build()

    @property
    def synthetic(self) -> Optional[float]:
        """``synthetic_acceptance``, fixed at construction: the steps and buffers are built for it."""
        return self._synthetic

    @property
    def k(self) -> int:
        """Proposals per round. Setting another value rebuilds the steps (on a GPU, recaptures their
        graphs) for it and for the models' current ``body`` and ``attention``; if that fails, the
        steps are rebuilt for the old value before the error is raised."""
        return self._k

    @k.setter
    def k(self, value: int) -> None:
        value = ops._require_positive_int("k", value)
        if value == self._k:
            return
        # A rebuild replaces the buffers and steps a generation in another thread may be using.
        with _GENERATING(self, *self._models_if_capturing()):
            old, self._k = self._k, value
            try:
                self._build()
            except BaseException:
                self._k = old
                self._build()
                raise

    def _models_if_capturing(self) -> tuple:
        """The models a build uses besides the driver's own buffers: capturing the steps' graphs
        runs them and resets their caches, which a generation in another thread may be using."""
        return (self.target, self.draft) if self.graphs else ()

    def _check_draft(self, draft: Decoder, head) -> Union[DenseHead, FlashHead]:
        if draft.length is self.target.length:  # the same Decoder, or a copy of it
            # The KV cache and its length live in the Decoder: the draft's steps would overwrite the target's.
            raise ValueError("draft must be another Decoder than target (each Decoder holds one KV cache and length); "
                             "to draft with the target's own weights, build a second Decoder from the same weights, "
                             "e.g. Decoder.from_hf(model, max_len=...)")
        if self.graphs and draft.device.type != "cuda":
            raise ValueError(f"draft must be on a CUDA device like the target when graphs are used, got {draft.device}")
        head = resolve_draft_head(head, draft.lm_head, self.target.config.vocab_size)
        if head.embedding.device != draft.device:
            raise ValueError(f"draft_head must be on the draft's device {draft.device}, got {head.embedding.device}")
        return head

    # ---- static buffers and steps ------------------------------------------------------------

    @ops._autocast_off  # its graphs capture the steps' products: not in a caller's autocast dtype
    def _build(self) -> None:
        # Read before the captures, and recorded only once all succeed: a capture that fails leaves
        # the next generate to build again, and a change during the captures is not taken as built.
        head_state, self._built_for_head = self._head_state(), None
        t, k = self.target, self.k
        dev = t.device
        i64 = dict(dtype=torch.int64, device=dev)
        self.vin = torch.zeros(k + 1, **i64)     # [last emitted token, d1..dK]
        self.checks = torch.zeros(k + 1, **i64)  # target argmax per position; checks[0] is the known next token
        self.out = torch.zeros(k + 2, **i64)     # [a, emitted tokens (the first a + 1 are valid)]
        self.out_host = _HostCopy(self.out)
        self.send = torch.zeros(3, **i64)        # [a, next draft input pair], for the draft device
        self.round = torch.zeros((), **i64)
        # The synthetic verifier's draws, a row a round (max_len * k: none for the exact one).
        self.uniform = torch.zeros(t.max_len if self.synthetic is not None else 0, k, dtype=torch.float32, device=dev)
        self._slots = torch.arange(k + 1, device=dev)
        self.steps = dict(append=_Step(self._append, dev), baseline=_Step(self._baseline_step, dev))
        self.one_propose = False
        if self.draft is not None:
            d = self.draft
            self.pair = torch.zeros(2, dtype=torch.int64, device=d.device)  # the draft's first input of a round
            self.proposals = torch.zeros(k, dtype=torch.int64, device=d.device)
            self.recv = self.send if d.device == dev else torch.zeros(3, dtype=torch.int64, device=d.device)
            # The persistent body skips a step at an out-of-range position for the cost of a launch,
            # so one graph serves both kinds of round: the first step feeds the second-to-last token
            # where the last round accepted all K (recv[0], on the device), and the host can launch
            # the next round's proposals before it reads this round's result.
            self.one_propose = d.body == "persistent"
            if self.one_propose:
                self._outside = torch.full((), -1, dtype=torch.int64, device=d.device)
                self.steps["propose"] = _Step(self._propose_either, d.device)
            else:
                self.steps.update(propose=_Step(self._propose, d.device, False),
                                  propose_pair=_Step(self._propose, d.device, True))
            self.steps.update(
                rewind=_Step(self._rewind, d.device),
                verify_deferred=_Step(self._verify, dev, self.vin),
                verify_ordinary=_Step(self._verify, dev, self.vin[1:]),
                finalize_deferred=_Step(self._finalize, dev, 1),
                finalize_ordinary=_Step(self._finalize, dev, 0),
            )
        if self.graphs:
            for step in self.steps.values():
                step.capture(self._warmup_state)
        self._built_for = self._model_settings()
        self._built_for_head = head_state

    def _head_state(self) -> tuple:
        """What the draft head's captured calls depend on: its probes (a FlashHead's) and the memory
        of its tensors."""
        if self.head is None:
            return ()
        return (getattr(self.head, "probes", None), *(tensor.data_ptr() for tensor in self.head.buffers()))

    def _model_settings(self) -> dict:
        """The models' settings that the steps were built (on a GPU: captured) for."""
        return {f"{role}.{name}": getattr(model, name) for role, model in (("target", self.target), ("draft", self.draft))
                if model is not None for name in ("body", "attention")}

    def _check_model_settings(self) -> None:
        for key, value in self._model_settings().items():
            if value != self._built_for[key]:
                # A captured graph would silently run the old setting; the draft's steps depend on its body.
                raise ValueError(f"{key} changed from {self._built_for[key]!r} to {value!r} after this FastSpeculativeDecoder "
                                 f"was built, and its steps were built for the old value: set {key} back, or build a new "
                                 f"FastSpeculativeDecoder")

    def _warmup_state(self) -> None:
        """Lengths with room on both sides (finalize moves them by up to k), valid token ids."""
        for model in (self.target, self.draft):
            if model is not None:
                if model.max_len < 3 * (self.k + 2):
                    raise ValueError(f"max_len must be >= 3 * (k + 2) = {3 * (self.k + 2)} for graph capture, got {model.max_len}")
                model.reset(self.k + 2)
        self.round.zero_()

    def _append(self) -> None:
        """The target runs the last emitted token; ``checks[0]`` becomes the token after it."""
        t = self.target
        self.checks[:1].copy_(t.argmax(t.forward(self.vin[:1])))
        t.length += 1

    def _baseline_step(self) -> None:
        self._append()
        self.vin[:1].copy_(self.checks[:1])

    def _propose(self, pair: bool) -> None:
        """K draft steps from the rewound cache (``len(sequence) - 2`` entries). Without ``pair``
        the second-to-last token's entry is already there: keep it and feed the last token only."""
        d, head = self.draft, self.head
        ids = self.pair
        if not pair:
            d.length += 1
            ids = self.pair[1:]
        for i in range(self.k):
            hidden = d.forward(ids)[-1:].to(head.embedding.dtype)
            d.length += ids.shape[0]
            slot = self.proposals[i:i + 1]
            head.next_token(hidden, out=slot)
            ids = slot

    def _propose_either(self) -> None:
        """``_propose`` with the pair chosen on the device: the second-to-last token is fed at the
        cache length when the last round accepted all K (``recv[0] == k``; the prefill counts as
        such a round), else at an out-of-range position (a skipped step)."""
        d = self.draft
        d.forward(self.pair[:1], start=torch.where(self.recv[0] == self.k, d.length, self._outside))
        self._propose(pair=False)

    def _verify(self, ids: Tensor) -> None:
        """Writes the target's KV entries of ``ids`` (the length stays: finalize keeps the accepted)
        and its argmax at each; ordinary's ``ids`` are the K proposals, after the known ``checks[0]``."""
        t = self.target
        self.checks[self.k + 1 - ids.shape[0]:].copy_(t.argmax(t.forward(ids)))

    def _matches(self) -> Tensor:
        """bool ``[K]``: would proposal i be accepted, given proposals 1..i-1 were."""
        if self.synthetic is None:
            return self.vin[1:] == self.checks[:self.k]
        return self.uniform.index_select(0, self.round.view(1))[0] < self.synthetic

    def _finalize(self, pending: int) -> None:
        """Accepted length, emitted tokens, target cache cut back. ``pending``: 1 when the verify
        batch began with the last emitted token (deferred), whose entry is kept too."""
        a = self._matches().to(torch.int64).cumprod(0).sum()
        final = self.checks.gather(0, a.view(1))
        self.out[0] = a
        self.out[1:].copy_(torch.where(self._slots == a, final, torch.cat([self.vin[1:], final])))
        self.send[0] = a
        self.send[1:].copy_(torch.cat([self.vin.gather(0, a.view(1)), final]))
        self.vin[:1].copy_(final)
        self.target.length += a + pending
        self.round += 1

    def _rewind(self) -> None:
        """The draft cache kept its proposals' entries; keep those of the accepted ones only, minus
        the second-to-last emitted token, which ``propose_pair`` re-feeds and ``propose`` keeps."""
        self.draft.length -= self.k - self.recv[0]
        self.pair.copy_(self._draft_input(self.recv[1:]))

    def _draft_input(self, ids: Tensor) -> Tensor:
        return draft_input(ids, self.head.vocab_size, self.target.config.vocab_size)

    # ---- generation --------------------------------------------------------------------------

    def _check_room(self, prompt_len: int, max_new_tokens: int, speculative: bool) -> None:
        # Baseline writes the target entries of all tokens but the last; a speculative round's
        # verify and proposals may write up to k + 1 entries past the emitted tokens.
        need = prompt_len + max_new_tokens + (self.k + 1 if speculative else -1)
        for role, model in (("target", self.target), ("draft", self.draft if speculative else None)):
            if model is not None and model.max_len < need:
                setting = f"and k={self.k}" if speculative else "in baseline mode"
                raise ValueError(f"max_new_tokens={max_new_tokens} with a {prompt_len}-token prompt {setting} needs "
                                 f"max_len >= {need}, the {role}'s is {model.max_len}")

    def generate(self, input_ids: Tensor, *, mode: str = "deferred", max_new_tokens: int = 64) -> Generation:
        """As :meth:`SpeculativeDecoder.generate`: the target's greedy tokens (unless synthetic), with
        stats. One generation at a time: the driver's buffers and graphs and the models' caches
        serve one, so a call while another thread generates with this driver or its models raises."""
        with _GENERATING(self, self.target, self.draft):
            self._check_model_settings()
            if self.graphs and self._head_state() != self._built_for_head:
                # A captured graph replays the probes and reads the tensors it was captured with: the
                # head's new probes (or special tokens, loaded with a state dict of another count)
                # were ignored until k changed. Captured again, as for a new k.
                self._build()
            return self._generate(input_ids, mode, max_new_tokens)

    @torch.inference_mode()
    @ops._autocast_off
    def _generate(self, input_ids: Tensor, mode: str, max_new_tokens: int) -> Generation:
        check_mode(mode, self.draft is not None)
        max_new_tokens = ops._require_positive_int("max_new_tokens", max_new_tokens)
        t, d, k = self.target, self.draft, self.k
        prompt = check_prompt(input_ids, t.device, t.config.vocab_size)[0]
        speculative = mode != "baseline"
        self._check_room(prompt.shape[0], max_new_tokens, speculative)
        stats = GenerationStats(mode=mode, prompt_tokens=prompt.shape[0], k=k if speculative else 0,
                                synthetic_acceptance=self.synthetic if speculative else None,
                                draft_head_s=None if speculative else 0.0,
                                draft_overlaps_target=speculative and d.device != t.device)
        output = Emitter(stats, self.eos, max_new_tokens)
        if self.synthetic is not None:
            # Seeded by the seed and the prompt, so every mode and head draws the same acceptances for
            # the same prompt. Drawn before the clock starts; rounds never outnumber the new tokens.
            # (One 32-bit hash: torch's CPU generator keeps only the low 32 bits of a seed.)
            key = zlib.crc32(prompt.cpu().numpy().tobytes(), zlib.crc32(self.seed.to_bytes(8, "little", signed=True)))
            draws = torch.rand(max_new_tokens, k, dtype=torch.float32, device="cpu",
                               generator=torch.Generator().manual_seed(key))
            self.uniform[:max_new_tokens].copy_(draws)
        steps = self.steps
        sync(t.device)

        start = time.perf_counter()
        t.reset()
        self.vin[:1].copy_(t.argmax(t.forward(prompt)[-1:]))  # prefill: reported as TTFT only
        t.reset(prompt.shape[0])
        if speculative:
            d.reset()
            if prompt.shape[0] > 1:
                d.forward(self._draft_input(prompt[:-1].to(d.device)))
            d.reset(prompt.shape[0] - 1)
            self.pair.copy_(self._draft_input(torch.cat([prompt[-1:], self.vin[:1]])))
            self.recv[:1].fill_(k)  # like a round that accepted all K: the pair is fed (one-graph propose)
            self.round.zero_()
        # The draft has no entry of the prompt's last token yet, nor, after a round that accepted
        # all K, of the last proposal (proposals are fed one step behind).
        pair_needed, proposed_ahead = True, False
        done = output.first(int(self.vin[0]))
        stats.ttft_s = time.perf_counter() - start

        clock, marks = Clock(t.device), _Marks(t.device)
        draft_clock = clock if d is None or d.device == t.device else Clock(d.device)

        def propose():
            marks("propose")
            with on_device(d.device), draft_clock("draft"):
                steps["propose" if self.one_propose or not pair_needed else "propose_pair"]()

        decode_start = time.perf_counter()
        if mode == "ordinary" and not done:
            marks("finalize")  # the prefill token's append, as every round's in the finalize phase
            with clock("target"):
                steps["append"]()
            stats.append_calls += 1
        while not done:
            if mode == "baseline":
                marks("verify")
                with clock("target"):
                    steps["baseline"]()
                marks("finalize")
                stats.append_calls += 1
                stats.host_syncs += 1
                done = output.emit([int(self.checks[0])], 0, 0)
                continue
            if output.left == 1:
                # Only the target's next token is still wanted: proposals could not be emitted.
                marks("finalize")
                if mode == "deferred":  # the tail step: the last token has not been through the target
                    with clock("target"):
                        steps["append"]()
                    stats.append_calls += 1
                stats.host_syncs += 1
                done = output.emit([int(self.checks[0])], 0, 0)
                continue

            if not proposed_ahead:
                propose()
            proposed_ahead = False
            self.vin[1:].copy_(self.proposals)
            marks("verify")
            verified = True
            if mode == "ordinary":
                first_match, known = torch.stack([self._matches()[0].to(torch.int64), self.checks[0]]).tolist()
                stats.host_syncs += 1
                # A refuted first proposal means the verify could accept nothing: skip it.
                verified = bool(first_match)
                if verified:
                    with clock("target"):
                        steps["verify_ordinary"]()
                else:
                    stats.skipped_verifies += 1
            else:
                with clock("target"):
                    steps["verify_deferred"]()
            marks("finalize")
            steps[f"finalize_{mode}"]()  # on a skipped round: a = 0 and the known token, no cache to cut
            if self.recv is not self.send:
                self.recv.copy_(self.send)
            steps["rewind"]()
            if verified:
                stats.verify_calls += 1
                # The next proposals go in before the host waits, unless this round may end the
                # generation: by length, or by an EOS (a wasted propose costs K draft steps).
                if self.one_propose and mode == "deferred" and output.left >= k + 3 and not self.eos:
                    self.out_host.start()
                    propose()
                    proposed_ahead = True
                    packed = self.out_host.wait()
                else:
                    packed = self.out.tolist()
                stats.host_syncs += 1
                accepted, emitted = packed[0], packed[1:packed[0] + 2]
            else:
                accepted, emitted = 0, [known]
            pair_needed = accepted == k
            done = output.emit(emitted, k, accepted)
            if mode == "ordinary" and not done:
                # On two GPUs this runs while the draft GPU proposes the next block.
                with clock("target"):
                    steps["append"]()
                stats.append_calls += 1
        marks(None)
        sync(t.device)
        if d is not None and d.device != t.device:
            sync(d.device)
        stats.decode_s = time.perf_counter() - decode_start
        stats.new_tokens = len(output.tokens)
        totals = clock.resolve()
        stats.target_s, stats.draft_s = totals["target"], draft_clock.resolve()["draft"]
        stats.phase_s = marks.resolve()
        return Generation(output.tokens, stats)


__all__ = ["FastSpeculativeDecoder"]
