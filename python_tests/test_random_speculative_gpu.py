"""Speculative decoding's fast path on CUDA, on seeded random configurations (docs/speculative.md, "Fast path").

test_random_speculative.py draws the fast path's configurations on the CPU in float64, where every
token can be checked exactly; these are drawn where the product runs, with that file's drawing code
and checks: its tiny models (also with sizes of whole 16-byte vectors, which the persistent body's
kernel needs), prompts of 1 to 40 tokens (on the CPU or the GPU), K (given or set later), budgets,
drafts, dense heads and FlashHeads (the CUDA head kernels; any probes, special tokens, fp8
centroids), EOS ids, both models' attention, max_len slack and synthetic acceptance. The target runs
in float32 on the eager, fused or persistent body (where the kernels take its layer and sizes), the
draft in float32, bfloat16 or float16 on the eager, fused (the Llama / Qwen layer) or persistent
body; the steps run as captured CUDA graphs (the product), eagerly, or both. Refused, with the
documented message: the persistent body over sizes that are not whole 16-byte vectors
(decoder_step's limit, refused as the body is set), a max_len below graph capture's 3 (K + 2), one short of a generation's room
(prompt + n + K + 1; baseline: prompt + n - 1), no budget.

CUDA computes in float32 at best, so the target's tokens are checked against its float64 logits,
recomputed on the CPU over the emitted sequence: every token within a near-tie (near_tie) of the
best after what precedes it, the run cut at the first EOS or the budget. The counters add up
(helpers.check_counters, with CUDA-event phases); ordinary and deferred go through the same rounds
wherever they emit the same tokens; replayed graphs emit what the same steps run eagerly emit, in
the same rounds; a float32 draft's proposals (dense head, or a FlashHead that probes every cluster)
are near-ties of its own float64 logits recomputed without a cache, and the target's token that
rejected one is not the draft's clear best; synthetic acceptance is checked as on the CPU
(check_synthetic), the target's tokens within a near-tie. Draws are seeded by their index, so a
failure names a reproducible configuration. ``FLASHHEAD_RANDOM_DRAWS`` sets how many are drawn
(default 16, fewer than on the CPU: a draw captures up to 18 graphs).
"""
from __future__ import annotations

import functools
import os
import random
import re
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import test_fast_decoder as fast_tests
from flashhead_ext import FlashHead
from flashhead_ext.fast import Decoder, FastSpeculativeDecoder
from flashhead_ext.speculative import MODES
from helpers import one_thread  # noqa: F401  (an autouse fixture)
from helpers import stable_seed
from test_random_speculative import (FAST_ARCHS, FastDraw, build_fast_models, check_dense_proposals, check_modes_agree,
                                     check_short_room, check_stops, check_synthetic, check_target_tokens, draw_fast,
                                     exact_draft_logits, fast_runner, fuses, refuses_no_budget, run_every_mode)

DEVICE = "cuda"
# The first 16 draws capture 130 graphs (9 a runner, 8 with a persistent draft; twice when K is set
# after the build), at 0.1 to 0.3 s each: with the float64 checks on the host, 30 to 60 s.
DRAWS = int(os.environ.get("FLASHHEAD_RANDOM_DRAWS", "16"))
# The odd sizes take the CUDA kernels' unaligned paths (the persistent body refuses them); the
# sizes of whole 16-byte vectors, drawn twice as often, run on every body.
CUDA_ARCHS = (*FAST_ARCHS, *[f"{arch}-aligned" for arch in FAST_ARCHS] * 2)
# How far below the best of the float64 logits a float32 token may be (a near-tie that rounding may
# break either way): NEAR_TIE_RTOL times the row's largest |logit|, at least 1. The float32 error
# grows with the hidden states the layers sum rather than with the logits: over 80 tokens the CPU's
# float32 bodies (a stand-in for CUDA's kernels, which sum in other orders) missed these models'
# float64 logits by up to 5.5e-5 (Qwen2, whose drawn biases make hidden states of up to 60 for
# logits of up to 8.5: 1.2e-5 of that scale) and 2e-7 (Llama, logits of up to 0.56). A token past
# the tolerance takes errors 12 times the largest seen; a wrong one (a position off, a stale cache)
# is typically 1e-2 or more below the best.
NEAR_TIE_RTOL = 3e-4


def near_tie(logits: torch.Tensor) -> float:
    return NEAR_TIE_RTOL * max(1.0, float(logits.abs().max()))


def cuda_draft(rng: random.Random, arch: str) -> tuple:
    """The draft's body and dtype: torch's ops (eager) or flashhead's decoder kernels (fused, the
    Llama / Qwen layer; persistent), in float32, whose proposals can be checked, or a 16-bit dtype.
    Not compiled: inductor compiles every token count, tens of seconds a draw (test_fast_decoder's
    GPU tests run it)."""
    body = rng.choice(["eager", "persistent", *(["fused"] if fuses(arch) else [])])
    return body, rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16])


@dataclass(frozen=True)
class CudaDraw:
    """What the CPU's draws lack: the target's body; the steps run as "graphs" (captured, the
    product), "eager" (the same steps, no capture) or "both" (compared); whose max_len is below
    graph capture's floor (0: the target's, 1: the draft's; refused); where the prompt is."""
    target_body: str
    steps: str
    below_floor: Optional[int]
    prompt_device: str

    def __str__(self) -> str:
        below = "" if self.below_floor is None else f", the {('target', 'draft')[self.below_floor]}'s max_len below capture's"
        return f"target body {self.target_body}, steps {self.steps}{below}, prompt on {self.prompt_device}"


def draw_cuda(index: int) -> tuple:
    f = draw_fast(index, CUDA_ARCHS, cuda_draft, key=(DEVICE,))
    rng = random.Random(stable_seed("random-speculative-fast", index, DEVICE, "runner"))
    arch = f.common.arch
    bodies = ["eager", "eager", *(["fused"] if fuses(arch) else []),
              *(["persistent"] if fast_tests.persistent_refusal(arch, torch.float32) is None else [])]
    steps = rng.choice(["graphs", "graphs", "both", "eager"])
    below_floor = rng.randrange(2) if steps != "eager" and rng.random() < 0.1 else None
    return f, CudaDraw(rng.choice(bodies), steps, below_floor, rng.choice(["cpu", DEVICE]))


def check_near_greedy(f: FastDraw, gen, where: str) -> None:
    """The target decides the output: every token is a near-tie of the float64 target's best after
    what precedes it, and the tokens end at the first EOS or the budget."""
    check_stops(f.common, gen.tokens, where)
    check_target_tokens(f, gen, where, every=True, tie_tol=near_tie)


def scores_every_token(head) -> bool:
    """A dense head, or a FlashHead that probes every cluster: its token is the best of all logits."""
    return not isinstance(head, FlashHead) or head.probes >= head.cluster_tokens.shape[0]


def rounds(gen) -> tuple:
    return gen.tokens, gen.stats.accepted_per_round, gen.stats.emitted_per_round


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(DRAWS))
def test_random_fast_path_on_cuda(index):
    assert not torch.backends.cuda.matmul.allow_tf32, "near_tie is float32's, not TF32's"
    f, c = draw_cuda(index)
    d = f.common
    context = f"draw {index}: {f}, {c}"
    need = d.prompt_len + d.max_new + d.k + 1
    max_lens = [max(1, need + slack) for slack in f.slack]
    graphs = c.steps != "eager"
    if graphs:  # capture warms up with room for K proposals on both sides (the runner's docstring), at both Ks
        max_lens = [max(max_len, 3 * (max(d.k, d.k_first or 0) + 2)) for max_len in max_lens]
    refusal = fast_tests.persistent_refusal(d.arch, f.draft_dtype) if f.draft_body == "persistent" else None
    if refusal:  # setting the body asks the kernel's limits, before any step
        with pytest.raises(ValueError, match=re.escape(f"body 'persistent' cannot run this model on {DEVICE}") + ".*"
                                             + re.escape(refusal)):
            build_fast_models(f, max_lens, DEVICE, torch.float32)
            pytest.fail(f"{context}: the persistent body over these sizes was not refused")
        return
    floor = 3 * ((d.k_first or d.k) + 2)  # the runner captures its steps for the first K
    if c.below_floor is not None:
        max_lens[c.below_floor] = floor - 1
    target, draft = build_fast_models(f, max_lens, DEVICE, torch.float32)
    target.body = c.target_body
    head = d.head.build(draft.lm_head, seed=index)
    ids = d.ids(fast_tests.prompt).to(c.prompt_device)
    if c.below_floor is not None:
        with pytest.raises(ValueError, match=rf"max_len must be >= 3 \* \(k \+ 2\) = {floor} for graph capture, "
                                             rf"got {floor - 1}"):
            fast_runner(f, target, draft, head, graphs=True)
            pytest.fail(f"{context}: a max_len below capture's floor was not refused")
        return
    runner = fast_runner(f, target, draft, head, graphs=graphs)
    if d.max_new == 0:
        refuses_no_budget(runner, ids, context)
        return
    check = functools.partial(check_near_greedy, f)
    if min(target.max_len, draft.max_len) < need:
        # Eager steps: capture would need max_len >= 3 (k + 2), 24 at the default K, above most of these.
        baseline_runner = lambda max_len: FastSpeculativeDecoder(
            Decoder.from_hf(f.model(0, torch.float32), max_len=max_len, device=DEVICE), eos_token_id=list(d.eos), graphs=False)
        check_short_room(f, runner, ids, need, check, baseline_runner, context)
        return
    gens = run_every_mode(d, runner, ids, check, context, f.synthetic, gpu_phases=True)
    if c.steps == "both":
        # The graphs replay the very kernels the steps launch eagerly, on the same inputs.
        eager = run_every_mode(d, fast_runner(f, target, draft, runner.head, graphs=False), ids, check,
                               f"{context}, eager steps", f.synthetic, gpu_phases=True)
        for mode in MODES:
            assert rounds(eager[mode]) == rounds(gens[mode]), (
                f"{context}, {mode}: eager steps {rounds(eager[mode])}, replayed graphs {rounds(gens[mode])}")
    # A 16-bit draft rounds at every layer, to logits 1e-3 to 1e-2 of their size off its float64 ones:
    # near-ties that wide are common among 97 tokens, so its proposals need not be the float64 best,
    # and its acceptance is checked through the counters and the rounds only.
    if f.draft_dtype == torch.float32 and scores_every_token(runner.head):
        check_dense_proposals(d, ids.view(-1).tolist(), gens["deferred"], exact_draft_logits(f, draft.max_len), context,
                              f.synthetic is None, near_tie)
    # Verifies of K rows (ordinary) and K + 1 (deferred) round differently: at a float64 near-tie the
    # modes may part (each one's tokens were checked), the draft then proposing after other tokens.
    if gens["ordinary"].tokens == gens["deferred"].tokens:
        check_modes_agree(gens, context)
    if f.synthetic is not None:
        # The draws are made on the host: the other runner's eager steps draw what graphs would.
        check_synthetic(f, gens, runner, ids, context, near_tie, graphs=False)
