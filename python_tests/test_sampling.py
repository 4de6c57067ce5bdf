"""Sampling ops: reproducibility, distinctness, and the laws they sample from (chi-square tests).

Frequency tests draw many identical rows in one call (each row has its own noise), with a fixed
seed, and reject at p < helpers.P_VALUE. Expected probabilities come from the reference's float32
scores, in float64.
"""
import itertools
import math

import numpy as np
import pytest
import torch

import reference as ref
from flashhead_ext import ops
from helpers import (DEVICES, P_VALUE, Shape, check_decode_sample, chi_square_pvalue, counts_of, exact_on, generator,
                     make_problem, seed_tensor, softmax_np, stable_seed)

device_params = pytest.mark.parametrize("device", DEVICES)
SHAPE = Shape(B=17, D=64, C=257, b=4, p=16, pad=3, extras=True)


def _sample_both(problem, **seed_kw):
    ids, scores = ops.sample_clusters(problem.hidden, problem.centroids, problem.probes, 0.8, **seed_kw)
    tokens, logprobs = ops.decode_sample(*problem.args()[:5], 0.8, problem.extra_ids, **seed_kw)
    return ids, scores, tokens, logprobs


def _assert_all_equal(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _differ(a, b):
    return any(not torch.equal(x, y) for x, y in zip(a, b))


@device_params
def test_same_seed_same_draw_and_different_seeds_differ(device):
    problem = make_problem(SHAPE, device=device)
    first = _sample_both(problem, seed=123)
    _assert_all_equal(first, _sample_both(problem, seed=123))
    _assert_all_equal(first, _sample_both(problem, seed=seed_tensor(123, device)))
    other = _sample_both(problem, seed=124)
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[2], other[2])
    # The seed is read when the op runs: the same tensor updated in place gives a new draw.
    seed = seed_tensor(123, device)
    _assert_all_equal(first, _sample_both(problem, seed=seed))
    seed.fill_(124)
    _assert_all_equal(other, _sample_both(problem, seed=seed))


@device_params
def test_generator_gives_reproducible_draws(device):
    problem = make_problem(SHAPE, device=device)
    draws = [_sample_both(problem, generator=torch.Generator(device).manual_seed(s)) for s in (7, 7, 8)]
    _assert_all_equal(draws[0], draws[1])
    assert _differ(draws[0], draws[2])
    # Without seed or generator the draw comes from torch's default generator.
    torch.manual_seed(99)
    a = _sample_both(problem)
    torch.manual_seed(99)
    b = _sample_both(problem)
    _assert_all_equal(a, b)
    assert _differ(a, _sample_both(problem))


@device_params
def test_make_seed(device):
    assert ops.make_seed(device, 17).item() == 17
    t = seed_tensor(3, device)
    assert ops.make_seed(device, t) is t
    drawn = ops.make_seed(device, generator=torch.Generator(device).manual_seed(1))
    assert drawn.dtype == torch.int64 and drawn.numel() == 1 and drawn.device.type == torch.device(device).type
    assert drawn.item() == ops.make_seed(device, generator=torch.Generator(device).manual_seed(1)).item()


@device_params
@pytest.mark.parametrize("probes", [2, 37, 257])
def test_drawn_clusters_are_distinct(device, probes):
    problem = make_problem(SHAPE, device=device)
    ids, scores = ops.sample_clusters(problem.hidden, problem.centroids, probes, 1.5, seed=probes)
    assert ids.shape == (SHAPE.B, probes) and ids.dtype == torch.int32
    ordered = ids.sort(dim=1).values.cpu()
    assert ((ordered >= 0) & (ordered < SHAPE.C)).all()
    assert (ordered[:, 1:] > ordered[:, :-1]).all(), "a cluster was drawn twice in one row"
    if probes == SHAPE.C:
        assert (ordered == torch.arange(SHAPE.C, dtype=torch.int32)).all()
    # The scores returned are the raw (unscaled) centroid scores of the drawn clusters.
    raw = ref.scores(problem.hidden, problem.centroids).gather(1, ids.long())
    torch.testing.assert_close(scores, raw, rtol=1e-5, atol=1e-5)


@device_params
def test_draws_differ_across_identical_rows(device):
    # Each row has its own noise: identical rows must not all draw the same clusters / tokens.
    problem = make_problem(SHAPE, device=device)
    rows = problem.with_(hidden=problem.hidden[:1].expand(64, -1).contiguous())
    ids, _, tokens, _ = _sample_both(rows, seed=5)
    assert len({tuple(r) for r in ids.tolist()}) > 32
    assert tokens.unique().numel() > 8


def _identical_rows(D, C, rows, device, spread, key):
    """``rows`` copies of one hidden state h, and C random centroids shifted along h so that their
    scores are ``spread * linspace(-1, 1, C)`` in a random order (a well-spread, known law)."""
    g = generator(*key)
    h = torch.randn(D, generator=g, dtype=torch.float64)
    centroids = torch.randn(C, D, generator=g, dtype=torch.float64)
    target = spread * torch.linspace(-1, 1, C, dtype=torch.float64)[torch.randperm(C, generator=g)]
    centroids += torch.outer(target - centroids @ h, h / h.dot(h))
    return h.float().expand(rows, D).contiguous().to(device), centroids.float().to(device)


@device_params
@pytest.mark.parametrize("temperature", [0.5, 1.3])
def test_single_cluster_draw_follows_softmax(device, temperature):
    hidden, centroids = _identical_rows(D=5, C=7, rows=30000, device=device, spread=1.0, key=("p1", temperature))
    ids, _ = ops.sample_clusters(hidden, centroids, 1, temperature, seed=2024)
    probs = softmax_np(ref.scores(hidden[:1], centroids)[0], temperature)
    assert probs.min() * hidden.shape[0] > 100  # every category is expected often: a meaningful test
    assert chi_square_pvalue(counts_of(ids[:, 0], 7), probs) > P_VALUE


@device_params
def test_two_draws_follow_plackett_luce(device):
    # Without replacement: P(first i, then j) = p_i p_j / (1 - p_i).
    C, T = 5, 0.9
    hidden, centroids = _identical_rows(D=7, C=C, rows=40000, device=device, spread=1.0, key=("p2",))
    ids, _ = ops.sample_clusters(hidden, centroids, 2, T, seed=31337)
    weights = softmax_np(ref.scores(hidden[:1], centroids)[0], T)
    expected = ref.plackett_luce_pair_probs(weights)
    pairs = ids[:, 0].long() * C + ids[:, 1].long()
    assert chi_square_pvalue(counts_of(pairs, C * C), expected) > P_VALUE
    # The first draw alone follows softmax(scores / T) (its marginal).
    assert chi_square_pvalue(counts_of(ids[:, 0], C), weights) > P_VALUE


@device_params
def test_three_draws_inclusion_frequencies(device):
    # P(cluster in the drawn set of 3 of 6), summed over the ordered Plackett-Luce draws.
    C, p, T = 6, 3, 1.0
    hidden, centroids = _identical_rows(D=7, C=C, rows=30000, device=device, spread=1.5, key=("p3",))
    ids, _ = ops.sample_clusters(hidden, centroids, p, T, seed=4242)
    w = softmax_np(ref.scores(hidden[:1], centroids)[0], T)
    sets = {}
    for order in itertools.permutations(range(C), p):
        prob, left = 1.0, 1.0
        for c in order:
            prob *= w[c] / left
            left -= w[c]
        key = frozenset(order)
        sets[key] = sets.get(key, 0.0) + prob
    keys = sorted(sets, key=sorted)
    index = {k: i for i, k in enumerate(keys)}
    observed = np.zeros(len(keys))
    for row in ids.tolist():
        observed[index[frozenset(row)]] += 1
    assert chi_square_pvalue(observed, np.array([sets[k] for k in keys])) > P_VALUE


def _token_problem(C, b, pad, rows, device, key, extras=None):
    g = generator("tokens", *key)
    shape = Shape(B=1, D=6, C=C, b=b, p=1, pad=pad)
    base = make_problem(shape, seed=stable_seed("tokens", *key))
    hidden = (torch.randn(1, 6, generator=g) * 1.5).expand(rows, 6).contiguous()
    extra = None if extras is None else torch.tensor(extras, dtype=torch.int32)
    return base.with_(hidden=hidden, extra_ids=extra).to(device)


@device_params
@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_decode_sample_tokens_follow_softmax_over_all_tokens(device, temperature):
    # p = C: the candidates are the whole (padded) vocabulary, so tokens ~ softmax(logits / T).
    problem = _token_problem(C=3, b=4, pad=1, rows=40000, device=device, key=("all", temperature)).with_(probes=3)
    tokens, logprobs = ops.decode_sample(*problem.args()[:5], temperature, None, seed=555)
    logits = ref.dense_logits(problem.hidden[:1], problem.embedding)[0].cpu()
    probs = softmax_np(logits, temperature)
    assert chi_square_pvalue(counts_of(tokens, problem.vocab), probs) > P_VALUE
    # Each drawn token's log-probability is log_softmax(logits / T) at that token.
    expected = torch.log_softmax(logits.double() / temperature, 0)[tokens.cpu()].float()
    torch.testing.assert_close(logprobs.cpu(), expected, rtol=1e-5, atol=1e-5)


@device_params
@pytest.mark.parametrize("temperature", [1e-6, 1e-4, 1e-2])
def test_decode_sample_logprob_at_small_temperatures(device, temperature):
    # Three tokens tie, so the drawn one has probability 1/3 at every temperature. At small T the
    # scaled maximum (4e7 at 1e-6) absorbed log(sum) when added to it first: log-probability 0.
    embedding = torch.tensor([[40.0], [40.0], [40.0], [20.0]], device=device)
    table = torch.arange(4, dtype=torch.int32, device=device).unsqueeze(0)
    hidden = torch.ones(5, 1, device=device)
    tokens, logprobs = ops.decode_sample(hidden, torch.ones(1, 1, device=device), table, embedding, 1, temperature,
                                         seed=17)
    assert set(tokens.tolist()) <= {0, 1, 2}
    torch.testing.assert_close(logprobs.cpu(), torch.full((5,), math.log(1 / 3)), rtol=0, atol=1e-6)


def _two_stage_token_law(problem, temperature):
    """Exact P(token) for decode_sample: clusters by Plackett-Luce on softmax(scores / T), then a
    token from softmax(logits / T) over their tokens plus the extra ids (each token once)."""
    C, p = problem.cluster_tokens.shape[0], problem.probes
    w = softmax_np(ref.scores(problem.hidden[:1], problem.centroids)[0], temperature)
    logits = ref.dense_logits(problem.hidden[:1], problem.embedding)[0].cpu().double() / temperature
    table = problem.cluster_tokens.cpu()
    extra = set() if problem.extra_ids is None else set(problem.extra_ids.tolist())
    law = np.zeros(problem.vocab)
    for order in itertools.permutations(range(C), p):
        prob, left = 1.0, 1.0
        for c in order:
            prob *= w[c] / left
            left -= w[c]
        members = sorted(set(table[list(order)].flatten().tolist()) - {-1} | extra)
        law[members] += prob * torch.softmax(logits[members], 0).numpy()
    return law


@device_params
@pytest.mark.parametrize("extras", [None, [0, 5, 5]], ids=["no-extra", "extra"])
def test_decode_sample_two_stage_law(device, extras):
    T = 0.8
    problem = _token_problem(C=4, b=3, pad=1, rows=40000, device=device, key=("two", str(extras)),
                             extras=extras).with_(probes=2)
    tokens, _ = ops.decode_sample(*problem.args()[:5], T, problem.extra_ids, seed=8080)
    assert chi_square_pvalue(counts_of(tokens, problem.vocab), _two_stage_token_law(problem, T)) > P_VALUE


def _many_extra_ids(problem, ids):
    """38 extra ids, more than a warp has lanes (the CUDA decode reads those past the 32nd from
    memory), with repeats on both sides of that boundary: tokens gathered for row 0 (``ids``) and
    ids repeating earlier extra ids, which must be masked as gather_candidates masks them."""
    fresh = torch.randperm(problem.vocab, generator=generator("many extras"))[:31].tolist()
    row0 = [t for t in ops.gather_candidates(ids, problem.cluster_tokens)[0].tolist() if t >= 0]
    extras = (fresh[:20] + [row0[0], fresh[3]] + fresh[20:30]  # 0..31
              + [row0[1], fresh[25], fresh[3], row0[2], fresh[30], fresh[30]])  # 32..37
    return torch.tensor(extras, dtype=torch.int32, device=problem.hidden.device)


@device_params
@pytest.mark.parametrize("many_extras", [False, True], ids=["4-extras", "38-extras"])
def test_decode_sample_uses_the_sample_clusters_draw(device, many_extras):
    # Same seed => decode_sample's clusters are sample_clusters' clusters; its token is one of
    # their candidates and its log-probability is log_softmax over exactly those candidates (a
    # repeated extra id counted once).
    problem = make_problem(SHAPE, device=device)
    T, seed = 0.8, 4321
    ids, _ = ops.sample_clusters(problem.hidden, problem.centroids, problem.probes, T, seed=seed)
    if many_extras:
        problem = problem.with_(extra_ids=_many_extra_ids(problem, ids))
    candidates = ops.gather_candidates(ids, problem.cluster_tokens, problem.extra_ids)
    scaled = ops.candidate_logits(problem.hidden, problem.embedding, candidates) / T
    tokens, logprobs = ops.decode_sample(*problem.args()[:5], T, problem.extra_ids, seed=seed)
    if many_extras:  # the reference draw as well (the 4 extras' case is in test_ops_equality)
        check_decode_sample(tokens, logprobs, problem, T, seed, exact_on(device))
    hit = candidates.long() == tokens.unsqueeze(1)
    assert (hit.sum(1) == 1).all(), "the token is exactly one of the row's candidates"
    position = hit.int().argmax(1, keepdim=True)
    expected = torch.log_softmax(scaled.double(), 1).gather(1, position).squeeze(1).float()
    torch.testing.assert_close(logprobs, expected, rtol=1e-5, atol=1e-5)


# (seed, column) pairs where the Philox word's top 24 bits are all ones, found by searching seeds
# with row 0 (reference.philox_bits); the test re-derives that property, so they are inputs, not answers.
# Such a word once gave u = 1.0 and infinite noise (24-bit uniforms rounded up in float32): the item
# was drawn whatever its probability.
ALL_ONES = {ref.CLUSTER_STREAM: (810476, 2), ref.TOKEN_STREAM: (974360, 2)}


@device_params
@pytest.mark.parametrize("stream", [ref.CLUSTER_STREAM, ref.TOKEN_STREAM], ids=["clusters", "tokens"])
def test_gumbel_noise_is_finite_for_every_draw(device, stream):
    seed, column = ALL_ONES[stream]
    assert int(ref.philox_bits(seed, stream, 1, column + 1)[0, column]) >> 8 == 2**24 - 1
    # Column `column` has probability ~ e^-60 against its neighbours: it must never be drawn.
    logits = torch.zeros(column + 2)
    logits[column] = -60.0
    hidden = torch.ones(1, 1, device=device)
    if stream == ref.CLUSTER_STREAM:
        ids, _ = ops.sample_clusters(hidden, logits.unsqueeze(1).to(device), 1, 1.0, seed=seed)
        assert int(ids[0, 0]) != column
    else:
        table = torch.arange(column + 2, dtype=torch.int32).unsqueeze(0).to(device)  # one cluster: position = id
        tokens, logprobs = ops.decode_sample(hidden, torch.ones(1, 1, device=device), table,
                                             logits.unsqueeze(1).to(device), 1, 1.0, seed=seed)
        assert int(tokens[0]) != column
