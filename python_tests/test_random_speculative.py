"""Speculative decoding (the driver and the fast path) on seeded random configurations (docs/speculative.md).

test_speculative.py and test_fast_decoder.py pin chosen configurations; these draw them over what
the docs support, on the tiny float64 models of those files (driver: Llama, tied Qwen3, Gemma-3
and Qwen2 with biases, the last two with windows of 5; fast path: Llama and Qwen3, also with
scaled RoPE, Qwen2 with and without sliding windows, Gemma-3): prompts of 1 to 40 tokens as
``[T]`` or ``[1, T]``, int32 or int64; K from 1 to 8, given or set later; budgets of 0 (refused),
1, a few, and around the end of a round that accepts all K (1 + m(K+1) tokens, one before, one
after: the tail step); drafts that are the target itself, its early exit of 1..L layers, unrelated
weights, or unrelated weights without the target's last vocabulary rows; dense heads and
FlashHeads over random clusterings (any cluster size, 1 to all probes, special tokens such as the
EOS ids, fp8 centroids); EOS ids that occur in the run, that do not, several of both, as an int,
a list or a tensor, or the model's own. The fast path also draws the draft's dtype and body
(eager; fused and persistent run flashhead's float32 CPU ops), both models' attention, ``max_len``
at its documented least (``prompt + n + K + 1``; baseline ``prompt + n - 1``), above it and one
short of it (refused, naming the model), and synthetic acceptance with any int64 seed.

Every draw runs every mode and checks: the tokens are the target's greedy tokens (recomputed over
the whole sequence at each step) cut at the first EOS or the budget; the counters add up
(helpers.check_counters); ordinary and deferred go through the same rounds, as the draft alone
decides how many tokens a round emits; each round's proposals are the draft's own greedy tokens
after the tokens emitted so far, recomputed without a cache (a stale draft cache costs acceptance
only, which the output never shows; fast path: float64 drafts, where no rounding can differ), so
a round accepts exactly their longest prefix that the target's tokens match; a draft with the
target's weights and a dense head has every emitted proposal accepted. Synthetic acceptance: the
modes agree, a round emits the draft's proposals and then the target's token, R = 0 accepts
nothing and R = 1 all, and the acceptances depend on the seed and the prompt's ids only (a dense
head, given the prompt in the other dtype, draws the same). Draws are seeded by their index, so a
failure names a reproducible configuration. ``FLASHHEAD_RANDOM_DRAWS`` sets how many are drawn for
each driver (default 32, as test_random_shapes.py). test_random_speculative_gpu.py draws the fast
path on CUDA with this file's drawing code and checks.
"""
from __future__ import annotations

import copy
import functools
import random
import traceback
from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch

import test_fast_decoder as fast_tests
import test_speculative as driver_tests
from flashhead_ext.fast import Decoder, FastSpeculativeDecoder
from flashhead_ext.speculative import MODES, SpeculativeDecoder, early_exit_draft, make_draft_head
from helpers import one_thread  # noqa: F401  (an autouse fixture)
from helpers import check_counters, greedy_tokens, stable_seed
from test_random_shapes import DRAWS, log_uniform

FP8 = torch.float8_e4m3fn
# Logits of O(1) that a float32 draft computes within ~1e-6 of float64: a proposal more than this
# below the best is no rounding's doing.
TIE_TOL = 1e-4


@dataclass(frozen=True)
class HeadDraw:
    """"dense": the drivers' default (the string); "DenseHead": one built by make_draft_head;
    "flashhead": over a random clustering of the draft's embedding."""
    kind: str
    cluster_size: int = 0
    probes: int = 0
    special: tuple = ()
    fp8: bool = False

    def __str__(self) -> str:
        if self.kind != "flashhead":
            return self.kind
        return (f"flashhead(b={self.cluster_size}, probes={self.probes}, special={list(self.special)}"
                f"{', fp8' if self.fp8 else ''})")

    def build(self, embedding: torch.Tensor, seed: int):
        if self.kind == "dense":
            return "dense"
        if self.kind == "DenseHead":
            return make_draft_head("dense", embedding)
        # Drawn on the CPU (random_partition's table is a CPU tensor); FlashHead copies it to the embedding's device.
        clustering = driver_tests.random_clustering(embedding.float().cpu(), self.cluster_size, seed)
        return make_draft_head("flashhead", embedding, clustering=clustering, probes=self.probes,
                               special_token_ids=list(self.special), centroid_dtype=FP8 if self.fp8 else None)


@dataclass(frozen=True)
class Common:
    """What both drivers draw alike."""
    arch: str
    layers: int  # the target's
    prompt_seed: int
    prompt_len: int
    batched: bool  # [1, T] rather than [T]
    int32: bool
    k: int
    k_first: Optional[int]  # built with this K, then set to k (None: built with k)
    draft: str  # "self", "early:N", "other", "short:R" (other weights without the target's last R rows)
    head: HeadDraw
    max_new: int
    eos: tuple
    eos_as: str  # "int", "list", "tensor" or "model" (None given: the target's own setting holds them)

    def __str__(self) -> str:
        eos = f"{list(self.eos)} as " + ("the model's own" if self.eos_as == "model" else self.eos_as)
        k_first = f" (set after {self.k_first})" if self.k_first else ""
        return (f"{self.arch}, prompt {self.prompt_seed} of {self.prompt_len} ({'[1, T]' if self.batched else '[T]'} "
                f"{'int32' if self.int32 else 'int64'}), K={self.k}{k_first}, "
                f"draft {self.draft}, head {self.head}, max_new_tokens={self.max_new}, eos {eos}")

    def ids(self, prompt_of) -> torch.Tensor:
        ids = prompt_of(self.prompt_seed, self.prompt_len).to(torch.int32 if self.int32 else torch.int64)
        return ids.view(1, -1) if self.batched else ids

    def eos_argument(self):
        if self.eos_as == "model":
            return None
        if self.eos_as == "int":
            return self.eos[0]
        return torch.tensor(self.eos) if self.eos_as == "tensor" else list(self.eos)

    @property
    def perfect_draft(self) -> bool:
        """The target's own weights with a dense head: every proposal is the target's greedy token."""
        return self.draft in ("self", f"early:{self.layers}") and self.head.kind != "flashhead"


@functools.lru_cache(maxsize=256)
def reference(model_of, prompt_of, arch: str, prompt_seed: int, prompt_len: int, new_tokens: int, **model_kwargs) -> tuple:
    return greedy_tokens(model_of(arch, **model_kwargs), prompt_of(prompt_seed, prompt_len), new_tokens)


def draw_budget(rng: random.Random, k: int) -> int:
    """0 (refused), 1, a few, or around the end of round m when every proposal is accepted: the
    prefill's token, then K + 1 a round."""
    end_of_round = 1 + rng.randint(1, 3) * (k + 1)
    return rng.choice([0, 1, 1, 2, rng.randint(3, 12), end_of_round - 1, end_of_round, end_of_round, end_of_round + 1,
                       rng.randint(1, 40)])


def draw_eos(rng: random.Random, run: tuple, vocab: int, model_eos: Optional[tuple]):
    """(ids, how they are passed): none, one that occurs in the greedy run (the generation ends
    there), one that does not, several of both, or the model's own: ``model_eos``, or where that is
    None ids of the other kinds set on the model."""
    absent = [t for t in range(vocab) if t not in run]
    kind = rng.choice(["none", "occurs", "occurs", "absent", "several", "model"])
    if kind == "model":
        ids = model_eos if model_eos is not None else draw_eos(rng, run, vocab, ())[0]
        return ids, "model"
    if kind == "none":
        return (), rng.choice(["list", "tensor"])
    if kind == "occurs":
        return (rng.choice(run),), rng.choice(["int", "list", "tensor"])
    if kind == "absent":
        return (rng.choice(absent),), rng.choice(["int", "list", "tensor"])
    ids = rng.sample(absent, rng.randint(1, 3)) + rng.sample(run, min(len(run), rng.randint(0, 2)))
    rng.shuffle(ids)
    return tuple(ids), rng.choice(["list", "tensor"])


def draw_head(rng: random.Random, vocab: int, eos: tuple) -> HeadDraw:
    """FlashHead's special tokens: none, random ones, or the EOS ids (as docs/speculative.md's example)."""
    kind = rng.choice(["dense", "DenseHead", "flashhead", "flashhead", "flashhead"])
    if kind != "flashhead":
        return HeadDraw(kind)
    cluster_size = rng.choice([1, 2, 3, 4, 7, 16, log_uniform(rng, 1, vocab), vocab])
    clusters = -(-vocab // cluster_size)
    probes = rng.choice([1, clusters, log_uniform(rng, 1, clusters)])
    special = tuple(rng.randrange(vocab) for _ in range(rng.choice([0, 0, 1, 2, 5])))
    if rng.random() < 0.3:
        special = tuple(t for t in eos if t < vocab)
    return HeadDraw(kind, cluster_size, probes, special, fp8=rng.random() < 0.2)


def draw_common(rng: random.Random, arch: str, vocab: int, model_of, model_kwargs: dict, prompt_of,
                model_eos: Optional[tuple]) -> Common:
    prompt_len = rng.choice([1, 1, 2, log_uniform(rng, 1, 40), rng.randint(5, 40)])
    k = rng.randint(1, 8)
    layers = model_of(arch, **model_kwargs).config.num_hidden_layers
    draft = rng.choice(["self", "self", f"early:{rng.randint(1, layers)}", f"early:{rng.randint(1, layers - 1)}",
                        f"early:{layers}", "other", f"short:{rng.choice([1, 3, 10])}"])
    max_new = draw_budget(rng, k)
    prompt_seed = rng.randrange(1000)
    run = reference(model_of, prompt_of, arch, prompt_seed, prompt_len, max_new, **model_kwargs) if max_new else ()
    eos, eos_as = draw_eos(rng, run, vocab, model_eos) if max_new else ((), "list")
    head = draw_head(rng, vocab - int(draft[6:]) if draft.startswith("short:") else vocab, eos)
    return Common(arch, layers, prompt_seed, prompt_len, rng.random() < 0.3, rng.random() < 0.3, k,
                  rng.choice([None, None, rng.randint(1, 8)]), draft, head, max_new, eos, eos_as)


def cut(run: tuple, eos) -> list:
    """The greedy run up to its first EOS (kept)."""
    end = next((i + 1 for i, t in enumerate(run) if t in eos), len(run))
    return list(run[:end])


def checked(context: str, check, *args) -> None:
    """``check(*args)``, its failure named by ``context`` (check_counters' assertions carry no message)."""
    try:
        check(*args)
    except AssertionError as error:
        failed = traceback.extract_tb(error.__traceback__)[-1]
        raise AssertionError(f"{context}: {failed.name} failed at {failed.line!r} {error}") from error


def proposing_rounds(d: Common, stats) -> list:
    """The tokens emitted by each round that proposed (all but a tail round, which proposes nothing)."""
    return stats.emitted_per_round[:stats.proposed // d.k]


def check_modes_agree(gens: dict, context: str) -> None:
    """Both speculative modes emit the same tokens in the same rounds: the draft decides how many
    tokens a round emits (synthetic: the draws), and it sees the same tokens in both."""
    rounds = {mode: (gens[mode].tokens, gens[mode].stats.accepted_per_round, gens[mode].stats.emitted_per_round)
              for mode in ("ordinary", "deferred")}
    assert rounds["ordinary"] == rounds["deferred"], (
        f"{context}: ordinary {rounds['ordinary']} != deferred {rounds['deferred']}")


def check_all_accepted(d: Common, gens: dict, context: str) -> None:
    """Every emitted proposal accepted (ordinary skips no verify)."""
    s = gens["deferred"].stats
    accepted = [min(e, d.k) for e in proposing_rounds(d, s)]
    assert s.accepted_per_round[:len(accepted)] == accepted, (
        f"{context}: accepted {s.accepted_per_round}, emitted {s.emitted_per_round}")
    skipped = gens["ordinary"].stats.skipped_verifies
    assert skipped == 0, f"{context}: ordinary skipped {skipped} verifies"


def check_proposals(d: Common, prompt: list, gen, next_token, context: str, synthetic: bool = False) -> None:
    """Each round's proposals are the draft's own greedy tokens after the tokens emitted before it,
    which ``next_token(ids)`` recomputes from scratch (a stale or misplaced draft cache entry shows
    here, though never in the output). Exact: the round accepted the longest prefix of them that the
    target's tokens match, up to the cut; synthetic: it emitted that many of them."""
    emitted_before = 1  # the prefill's token
    for accepted, emitted in zip(gen.stats.accepted_per_round, proposing_rounds(d, gen.stats)):
        proposals = []
        for _ in range(d.k):
            proposals.append(next_token(prompt + gen.tokens[:emitted_before] + proposals))
        after = gen.tokens[emitted_before:]
        where = f"{context}: round after {emitted_before} tokens, proposals {proposals}, then emitted {after[:emitted]}"
        if synthetic:
            assert after[:accepted] == proposals[:accepted], where
        else:
            matched = next((i for i, (p, t) in enumerate(zip(proposals, after)) if p != t), min(d.k, len(after)))
            assert accepted == matched, f"{where}: accepted {accepted}, the draft's own proposals {matched}"
        emitted_before += emitted


def check_dense_proposals(d: Common, prompt: list, gen, logits_of, context: str, exact: bool,
                          tie_tol=lambda logits: TIE_TOL) -> None:
    """check_proposals for a float32 draft with a dense head (the fused and persistent bodies), where
    a near-tie may go either way: an accepted proposal must be within ``tie_tol(logits)`` (TIE_TOL)
    of the best of the draft's float64 ``logits_of(ids)``, and (exact acceptance) the target's token
    that rejected the next one must not beat all others by more."""
    emitted_before = 1
    for accepted, emitted in zip(gen.stats.accepted_per_round, proposing_rounds(d, gen.stats)):
        after = gen.tokens[emitted_before:]
        for i in range(min(accepted + exact, d.k, len(after))):
            logits = logits_of(prompt + gen.tokens[:emitted_before + i])
            token = after[i]
            where = f"{context}: round after {emitted_before} tokens, its token {i}: {token}, draft logits {logits.tolist()}"
            tol = tie_tol(logits)
            if i < accepted:
                assert logits[token] >= logits.max() - tol, f"{where}: not the draft's proposal"
            elif token < logits.numel():  # a target token past the draft's rows cannot be proposed
                others = torch.cat([logits[:token], logits[token + 1:]])
                assert logits[token] <= others.max() + tol, f"{where}: the draft's proposal, but rejected"
        emitted_before += emitted


def draft_next_token(forward, head, draft_rows: int):
    """``next_token(ids)`` for check_proposals: ``forward(ids)`` gives the draft body's hidden states, and
    a target token past the draft's rows reaches it as its last row's id (docs/speculative.md)."""
    def next_token(ids: list) -> int:
        with torch.inference_mode():
            hidden = forward(torch.tensor(ids).clamp(max=draft_rows - 1))[-1:]
            return int(head.next_token(hidden.to(head.embedding.dtype)))
    return next_token


def check_tokens(expected, gen, where: str) -> None:
    """``expected``: the tokens, or a function ``(gen, where)`` that checks them."""
    if callable(expected):
        expected(gen, where)
    else:
        assert gen.tokens == expected, f"{where}: tokens {gen.tokens}, expected {expected}"


def run_every_mode(d: Common, decoder, ids, expected, context: str, synthetic: Optional[float] = None,
                   gpu_phases: bool = False) -> dict:
    """Every mode's generation, its tokens checked against ``expected`` (check_tokens; synthetic:
    baseline's only) and its counters (``gpu_phases``: check_counters')."""
    gens = {}
    for mode in MODES:
        gen = decoder.generate(ids, mode=mode, max_new_tokens=d.max_new)
        where = f"{context}, {mode}"
        if synthetic is None or mode == "baseline":
            check_tokens(expected, gen, where)
        k = 0 if mode == "baseline" else d.k
        assert (gen.stats.mode, gen.stats.k, gen.stats.prompt_tokens) == (mode, k, d.prompt_len), where
        checked(f"{where}: stats {gen.stats}", check_counters, gen, mode, k, d.max_new, gpu_phases)
        gens[mode] = gen
    return gens


def refuses_no_budget(decoder, ids, context: str) -> None:
    for mode in MODES:
        with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
            decoder.generate(ids, mode=mode, max_new_tokens=0)
            pytest.fail(f"{context}, {mode}: max_new_tokens=0 was not refused")


# ---- the driver ---------------------------------------------------------------------------------

# test_speculative's models, and test_fast_decoder's Qwen2 with biases and sliding windows (whose
# vocabulary has 97 tokens).
DRIVER_ARCHS = (*driver_tests.ARCHS, "qwen2-sliding")


def driver_tests_of(arch: str):
    """The test module whose models and prompts ``arch`` takes."""
    return fast_tests if arch == "qwen2-sliding" else driver_tests


@functools.lru_cache(maxsize=None)
def driver_model(arch: str, seed: int = 0, rows: Optional[int] = None):
    """``rows``: without the last vocabulary rows (a draft without the target's padding)."""
    if arch != "qwen2-sliding":
        return driver_tests.tiny_model(arch, seed, rows or driver_tests.VOCAB)
    model = fast_tests.hf_model(arch, seed)
    if rows is not None:
        model = copy.deepcopy(model)  # hf_model is cached
        model.resize_token_embeddings(rows)
    return model


def draw_driver(index: int) -> tuple:
    """(Common, target seed, draft seed): the target's and an unrelated draft's weights."""
    rng = random.Random(stable_seed("random-speculative-driver", index))
    arch = rng.choice(DRIVER_ARCHS)
    target_seed = rng.randrange(3)
    model_eos = driver_model(arch, target_seed).generation_config.eos_token_id  # Llama's and Gemma-3's set one
    model_eos = () if model_eos is None else (model_eos,) if isinstance(model_eos, int) else tuple(model_eos)
    tests = driver_tests_of(arch)
    d = draw_common(rng, arch, tests.VOCAB, driver_model, dict(seed=target_seed), tests.prompt, model_eos)
    return d, target_seed, target_seed + 1 + rng.randrange(3)


def driver_draft(d: Common, target, draft_seed: int):
    if d.draft == "self":
        return target  # the very same model object: the driver keeps a cache per role
    if d.draft.startswith("early:"):
        return early_exit_draft(target, int(d.draft[6:]))
    rows = driver_tests_of(d.arch).VOCAB - int(d.draft[6:]) if d.draft.startswith("short:") else None
    return driver_model(d.arch, draft_seed, rows)


@pytest.mark.parametrize("index", range(DRAWS))
def test_random_driver(index):
    d, target_seed, draft_seed = draw_driver(index)
    context = f"draw {index}: target seed {target_seed}, draft seed {draft_seed}, {d}"
    target = driver_model(d.arch, target_seed)
    draft = driver_draft(d, target, draft_seed)
    head = d.head.build(draft.get_output_embeddings().weight.detach(), seed=index)
    decoder = SpeculativeDecoder(target, draft, head, k=d.k_first or d.k, eos_token_id=d.eos_argument())
    decoder.k = d.k
    tests = driver_tests_of(d.arch)
    ids = d.ids(tests.prompt)
    if d.max_new == 0:
        refuses_no_budget(decoder, ids, context)
        return
    run = reference(driver_model, tests.prompt, d.arch, d.prompt_seed, d.prompt_len, d.max_new, seed=target_seed)
    gens = run_every_mode(d, decoder, ids, cut(run, d.eos), context)
    check_modes_agree(gens, context)
    if d.perfect_draft:
        check_all_accepted(d, gens, context)
    forward = lambda tokens: draft.base_model(input_ids=tokens.view(1, -1)).last_hidden_state[0]
    check_proposals(d, ids.view(-1).tolist(), gens["deferred"], draft_next_token(forward, decoder.head, decoder.draft_vocab),
                    context)


# ---- the fast path ------------------------------------------------------------------------------

FAST_ARCHS = ("llama", "mistral", "granite", "qwen2", "qwen2-sliding", "qwen3", "gemma2", "gemma3")


@dataclass(frozen=True)
class FastDraw:
    common: Common
    rope: str  # test_fast_decoder.hf_model's: "default", or scaled (Llama and Qwen3), past its original context of 16
    draft_dtype: torch.dtype
    draft_body: str
    attention: tuple  # the target's and the draft's
    slack: tuple  # max_len - (prompt + max_new_tokens + K + 1), the target's and the draft's; -1: one short
    synthetic: Optional[float]
    seed: int

    def model(self, seed: int = 0, dtype: torch.dtype = torch.float64):
        return fast_tests.hf_model(self.common.arch, seed, dtype, self.rope)

    def __str__(self) -> str:
        synthetic = f", synthetic acceptance {self.synthetic} seed {self.seed}" if self.synthetic is not None else ""
        return (f"{self.common}, rope {self.rope}, draft {str(self.draft_dtype)[6:]} {self.draft_body}, "
                f"attention {self.attention}, max_len slack {self.slack}{synthetic}")


def fuses(arch: str) -> bool:
    """Whether the fused body runs ``arch``: the fused ops run the plain Llama / Qwen layer only (test_fast_decoder)."""
    return fast_tests.fast_config(arch).body_limit("fused", torch.float32) is None


def cpu_draft(rng: random.Random, arch: str) -> tuple:
    """The draft's body and dtype on the CPU: the fused and persistent bodies run flashhead's float32
    CPU ops; the compiled one compiles for every token count, too slow here."""
    bodies = ["eager"] if rng.random() < 0.4 else ["fused", "persistent", "persistent"]
    if not fuses(arch) and "fused" in bodies:
        bodies.remove("fused")
    body = rng.choice(bodies)
    return body, torch.float64 if body == "eager" and rng.random() < 0.8 else torch.float32


def draw_fast(index: int, archs: tuple = FAST_ARCHS, draw_draft=cpu_draft, key: tuple = ()) -> FastDraw:
    """``draw_draft(rng, arch)``: the draft's body and dtype; ``key`` seeds the draws apart from the CPU's."""
    rng = random.Random(stable_seed("random-speculative-fast", index, *key))
    arch = rng.choice(archs)
    rope = rng.choice(["default", *sorted(fast_tests.ROPE_SCALINGS)]) if arch.startswith(("llama", "qwen3")) else "default"
    d = draw_common(rng, arch, fast_tests.VOCAB, fast_tests.hf_model, dict(rope=rope), fast_tests.prompt, model_eos=None)
    body, dtype = draw_draft(rng, arch)
    slack = tuple(rng.choice([-1, 0, 1, rng.randint(2, 8)]) if rng.random() < 0.15 else rng.choice([0, 1, 5])
                  for _ in range(2))
    synthetic = rng.choice([0.0, 0.5, 0.77, 1.0]) if rng.random() < 0.3 else None
    attention = tuple(rng.choice(["sdpa", "matmul"]) for _ in range(2))
    return FastDraw(d, rope, dtype, body, attention, slack, synthetic, rng.randrange(-2**63, 2**63))


def fast_draft(f: FastDraw, max_len: int, device: str = "cpu") -> Decoder:
    d = f.common
    if d.draft.startswith("short:"):
        return fast_tests.first_rows_decoder(f.model(1, f.draft_dtype), fast_tests.VOCAB - int(d.draft[6:]), max_len=max_len,
                                             device=device)
    model = f.model(1 if d.draft == "other" else 0, f.draft_dtype)
    return Decoder.from_hf(model, max_len=max_len, num_layers=int(d.draft[6:]) if d.draft.startswith("early:") else None,
                           device=device)


def build_fast_models(f: FastDraw, max_lens, device: str = "cpu", target_dtype: torch.dtype = torch.float64) -> tuple:
    """The draw's target and draft Decoders with these max_lens, its attention and the draft's body."""
    d = f.common
    target = Decoder.from_hf(f.model(0, target_dtype), max_len=max_lens[0], device=device)
    draft = fast_draft(f, max_lens[1], device)
    target.attention, draft.attention = f.attention
    draft.body = f.draft_body
    if d.eos_as == "model":  # the runner's default: the target's own setting (from_hf: the generation config's)
        target.eos_token_id = list(d.eos)
    return target, draft


def fast_runner(f: FastDraw, target: Decoder, draft: Decoder, head, **kwargs) -> FastSpeculativeDecoder:
    """The draw's runner, built with its first K and then set to K (``kwargs``: graphs)."""
    d = f.common
    runner = FastSpeculativeDecoder(target, draft, head, k=d.k_first or d.k, eos_token_id=d.eos_argument(),
                                    synthetic_acceptance=f.synthetic, seed=f.seed if f.synthetic is not None else None, **kwargs)
    runner.k = d.k
    return runner


def check_short_room(f: FastDraw, runner, ids, need: int, expected, baseline_runner, context: str) -> None:
    """A max_len short of a speculative generation's room, ``need``: ordinary and deferred refuse it,
    naming the first model short of it; baseline runs (it writes no proposals), and needs the
    entries of every token but the last (docs): ``baseline_runner(max_len)``, a baseline runner over
    a target of that max_len, runs at prompt + n - 1 and refuses one less. ``expected``: check_tokens'."""
    d = f.common
    role, max_len = next((role, model.max_len) for role, model in (("target", runner.target), ("draft", runner.draft))
                         if model.max_len < need)  # the target's is checked first
    for mode in ("ordinary", "deferred"):
        with pytest.raises(ValueError, match=rf"max_new_tokens={d.max_new} with a {d.prompt_len}-token prompt and "
                                             rf"k={d.k} needs max_len >= {need}, the {role}'s is {max_len}"):
            runner.generate(ids, mode=mode, max_new_tokens=d.max_new)
            pytest.fail(f"{context}, {mode}: a max_len short of the room was not refused")
    check_tokens(expected, runner.generate(ids, mode="baseline", max_new_tokens=d.max_new), f"{context}, baseline")
    least = d.prompt_len + d.max_new - 1
    for max_len in range(max(1, least - 1), least + 1):
        baseline = baseline_runner(max_len)
        if max_len == least:
            gen = baseline.generate(ids, mode="baseline", max_new_tokens=d.max_new)
            check_tokens(expected, gen, f"{context}, baseline at max_len {max_len}")
            continue
        with pytest.raises(ValueError, match=rf"max_new_tokens={d.max_new} with a {d.prompt_len}-token prompt in baseline "
                                             rf"mode needs max_len >= {least}, the target's is {max_len}"):
            baseline.generate(ids, mode="baseline", max_new_tokens=d.max_new)
            pytest.fail(f"{context}: baseline at max_len {max_len} was not refused")


def exact_draft_logits(f: FastDraw, max_len: int):
    """``logits_of(ids)`` for check_dense_proposals: the draft's weights in float64 (hf_model draws
    them in float32), whose logits are a float32 draft's within rounding, recomputed without a cache."""
    exact_draft = fast_draft(replace(f, draft_dtype=torch.float64), max_len)

    def logits_of(ids: list) -> torch.Tensor:
        exact_draft.reset(0)
        ids = torch.tensor(ids).clamp(max=exact_draft.config.vocab_size - 1)
        return exact_draft.logits(exact_draft.forward(ids)[-1])
    return logits_of


def check_target_tokens(f: FastDraw, gen, context: str, every: bool = False, tie_tol=None) -> None:
    """The prefill's token and the last token of every round that was not cut (it emitted more than
    it accepted), or ``every`` token, are the float64 target's greedy tokens after what precedes
    them: their logit is its best there, or within ``tie_tol(logits)`` of it."""
    d = f.common
    ids = torch.cat([fast_tests.prompt(d.prompt_seed, d.prompt_len), torch.tensor(gen.tokens, dtype=torch.int64)])
    with torch.no_grad():
        logits = f.model()(input_ids=ids.view(1, -1)).logits[0, d.prompt_len - 1:-1]
    ends, position = [0], 0
    for accepted, emitted in zip(gen.stats.accepted_per_round, gen.stats.emitted_per_round):
        position += emitted
        if emitted > accepted:
            ends.append(position)
    for i in range(len(gen.tokens)) if every else ends:
        row, token = logits[i], gen.tokens[i]
        tol = 0.0 if tie_tol is None else tie_tol(row)
        assert row[token] >= row.max() - tol, (
            f"{context}: tokens {gen.tokens}: token {i}, {token} (logit {float(row[token])}), is not within {tol} of the "
            f"target's best, {int(row.argmax())} (logit {float(row.max())})")


def check_stops(d: Common, tokens: list, context: str) -> None:
    """The tokens are cut at the first EOS or the budget, as in exact runs."""
    assert tokens == cut(tokens, d.eos), f"{context}: tokens {tokens} go on past an EOS"
    assert len(tokens) == d.max_new or tokens[-1] in d.eos, f"{context}: {tokens} stop early"


def check_synthetic(f: FastDraw, gens: dict, runner, ids, context: str, tie_tol=None, **runner_kwargs) -> None:
    """Synthetic acceptance: a round emits the draft's proposals and then the target's token
    (check_target_tokens with ``tie_tol``), cut at the first EOS or the budget; R = 0 accepts
    nothing and R = 1 all; the acceptances depend on the seed and the prompt's ids only
    (``runner_kwargs``: those of the runner that shows it)."""
    d = f.common
    deferred = gens["deferred"]
    s = deferred.stats
    assert s.synthetic_acceptance == gens["ordinary"].stats.synthetic_acceptance == f.synthetic, context
    # A perfect draft proposes the target's greedy tokens (a 16-bit one only within its rounding),
    # so that every token is one.
    check_target_tokens(f, deferred, context, d.perfect_draft and f.draft_dtype in (torch.float32, torch.float64), tie_tol)
    check_stops(d, deferred.tokens, context)
    if f.synthetic == 0.0:
        assert s.accepted == 0, f"{context}: accepted {s.accepted_per_round}"
    if f.synthetic == 1.0:
        check_all_accepted(d, gens, context)
    if not d.eos:
        # A dense head, given the prompt's ids in the other dtype, draws the same.
        other = FastSpeculativeDecoder(runner.target, runner.draft, "dense", k=d.k, eos_token_id=[],
                                       synthetic_acceptance=f.synthetic, seed=f.seed if f.synthetic is not None else None,
                                       **runner_kwargs)
        same_prompt = ids.view(-1).to(torch.int64 if d.int32 else torch.int32)
        again = other.generate(same_prompt, mode="deferred", max_new_tokens=d.max_new).stats
        assert (again.accepted_per_round, again.emitted_per_round) == (s.accepted_per_round, s.emitted_per_round), \
            f"{context}: with a dense head {again.accepted_per_round}, with {d.head} {s.accepted_per_round}"


@pytest.mark.parametrize("index", range(DRAWS))
def test_random_fast_path(index):
    f = draw_fast(index)
    d = f.common
    context = f"draw {index}: {f}"
    need = d.prompt_len + d.max_new + d.k + 1
    target, draft = build_fast_models(f, [max(1, need + slack) for slack in f.slack])
    runner = fast_runner(f, target, draft, d.head.build(draft.lm_head, seed=index))
    ids = d.ids(fast_tests.prompt)
    if d.max_new == 0:
        refuses_no_budget(runner, ids, context)
        return
    run = reference(fast_tests.hf_model, fast_tests.prompt, d.arch, d.prompt_seed, d.prompt_len, d.max_new, rope=f.rope)
    expected = cut(run, d.eos)
    if min(target.max_len, draft.max_len) < need:
        baseline_runner = lambda max_len: FastSpeculativeDecoder(Decoder.from_hf(f.model(), max_len=max_len),
                                                                 eos_token_id=list(d.eos))
        check_short_room(f, runner, ids, need, expected, baseline_runner, context)
        return
    gens = run_every_mode(d, runner, ids, expected, context, synthetic=f.synthetic)
    if f.draft_dtype == torch.float64:
        # Recomputed without the cache; a float32 draft could round a near-tie the other way.
        forward = lambda tokens: (draft.reset(0), draft.forward(tokens))[1]
        next_token = draft_next_token(forward, runner.head, runner.head.vocab_size)
        check_proposals(d, ids.view(-1).tolist(), gens["deferred"], next_token, context, synthetic=f.synthetic is not None)
    elif d.head.kind != "flashhead":
        check_dense_proposals(d, ids.view(-1).tolist(), gens["deferred"], exact_draft_logits(f, draft.max_len), context,
                              f.synthetic is None)
    check_modes_agree(gens, context)
    if f.synthetic is None:
        if d.perfect_draft:
            check_all_accepted(d, gens, context)
        return
    check_synthetic(f, gens, runner, ids, context)
