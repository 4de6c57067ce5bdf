"""Masking and memory safety: out-of-range ids, padding, all-masked rows, NaN/inf inputs, empty batch.

The ops never read out of bounds for ids they cannot trust (the cluster table is validated once by
the heads, not per call): an out-of-range cluster id yields a row of -1, an out-of-range candidate id
a -inf logit, and a row with no valid candidate the token -1. NaN ranks like -inf.
Ids are compared exactly on every device where the arithmetic is exact or NaN/inf propagation
does not depend on the summation order; elsewhere with the usual CUDA near-tie comparators.
"""
import pytest
import torch

import reference as ref
from flashhead_ext import ops
from helpers import (DEVICES, Shape, assert_same_ids, assert_values_close, check_decode_greedy,
                     check_decoded_tokens, exact_on, generator, make_problem)

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
device_params = pytest.mark.parametrize("device", DEVICES)


@device_params
def test_out_of_range_cluster_ids_give_masked_rows(device):
    problem = make_problem(Shape(B=4, D=8, C=37, b=4, p=3, pad=2, extras=True), device=device)
    C = problem.cluster_tokens.shape[0]
    cluster_ids = torch.tensor([[0, -1, C], [INT32_MIN, 5, INT32_MAX], [C - 1, C + 100, -37], [2, 3, 4]],
                               dtype=torch.int32, device=device)
    got = ops.gather_candidates(cluster_ids, problem.cluster_tokens, problem.extra_ids)
    assert_same_ids(got, ref.gather_candidates(cluster_ids, problem.cluster_tokens, problem.extra_ids))
    b = problem.cluster_tokens.shape[1]
    rows = got[:, : 3 * b].reshape(4, 3, b).cpu()
    bad = ((cluster_ids < 0) | (cluster_ids >= C)).cpu()
    assert (rows[bad] == -1).all() and (rows[~bad] != -1).any()


@device_params
def test_out_of_range_candidate_ids_give_neg_inf(device):
    problem = make_problem(Shape(B=3, D=64, C=37, b=4, p=2), device=device)
    V = problem.vocab
    g = generator("candidates")
    candidates = torch.randint(0, V, (3, 11), generator=g, dtype=torch.int32)
    candidates[0, [1, 4]] = torch.tensor([-1, V], dtype=torch.int32)
    candidates[1, [0, 10]] = torch.tensor([INT32_MIN, INT32_MAX], dtype=torch.int32)
    candidates[2, [2, 3, 5]] = torch.tensor([V + 5, -2, -1], dtype=torch.int32)
    candidates = candidates.to(device)
    got = ops.candidate_logits(problem.hidden, problem.embedding, candidates)
    invalid = ((candidates < 0) | (candidates >= V)).cpu()
    assert (got.cpu()[invalid] == float("-inf")).all()
    assert torch.isfinite(got.cpu()[~invalid]).all()
    assert_values_close(got, ref.candidate_logits(problem.hidden, problem.embedding, candidates), problem.logit_tol())


def _table_with_invalid_cluster(problem, lead=0):
    """Cluster 0 holds only ids the ops must mask: padding, ids >= V and negative ids, the one at
    ``lead`` first."""
    table = problem.cluster_tokens.clone()
    b = table.shape[1]
    invalid = torch.tensor([-1, problem.vocab, -5, INT32_MAX, INT32_MIN, problem.vocab + 3, -1, -2][:b], dtype=torch.int32)
    table[0] = invalid.roll(-lead)
    # Make cluster 0 the best for every row: its centroid is each row's direction, scaled up.
    centroids = problem.centroids.clone()
    centroids[0] = problem.hidden.float().sum(0).to(centroids.dtype) * 10
    return problem.with_(cluster_tokens=table, centroids=centroids, probes=1)


# 64 rows make 2 choices or more a cluster of C = 21: on sm_90 the greedy decode then reads each
# chosen cluster once for every 4 rows that chose it (decode_claimed_kernel); here all 64 rows choose
# cluster 0, sixteen groups of it.
batch_params = pytest.mark.parametrize("batch", [3, 64])


@device_params
@batch_params
@pytest.mark.parametrize("lead", [0, 1, 3], ids=["padding-first", "V-first", "int32-max-first"])
def test_all_masked_rows_give_token_minus_one(device, batch, lead):
    # With every slot masked the best is slot 0 by the tie-break: its id must not leak out unchecked
    # (padding first had hidden that).
    base = make_problem(Shape(B=batch, D=16, C=21, b=8, p=1), device=device, integer=True)
    problem = _table_with_invalid_cluster(base.with_(hidden=base.hidden.abs() + 1), lead)
    assert (ref.select_clusters(problem.hidden, problem.centroids, 1)[0] == 0).all()
    tokens = ops.decode_greedy(*problem.args())
    assert tokens.tolist() == [-1] * batch
    check_decode_greedy(tokens, problem, exact=True)
    sampled, _ = ops.decode_sample(*problem.args()[:5], 1.0, None, seed=3)
    # The sampled cluster may differ, but a token is either a real token or -1, never garbage.
    assert ((sampled == -1) | ((sampled >= 0) & (sampled < problem.vocab))).all()
    # With that cluster alone the draw must take it: -1 for every row.
    alone = problem.with_(centroids=problem.centroids[:1], cluster_tokens=problem.cluster_tokens[:1])
    assert ops.decode_sample(*alone.args()[:5], 1.0, None, seed=3)[0].tolist() == [-1] * batch
    # An always-on extra token rescues every row.
    extra = torch.tensor([problem.vocab - 1, -1], dtype=torch.int32, device=device)
    rescued = ops.decode_greedy(*problem.args()[:5], extra)
    assert rescued.tolist() == [problem.vocab - 1] * batch


@device_params
@batch_params
def test_masked_slots_never_win(device, batch):
    # Invalid ids in the best cluster, next to valid ones whose logits are low: a valid one wins.
    base = make_problem(Shape(B=batch, D=16, C=21, b=8, p=1), device=device, integer=True)
    problem = _table_with_invalid_cluster(base.with_(hidden=base.hidden.abs() + 1))
    table = problem.cluster_tokens.clone()
    table[0, 3] = base.cluster_tokens[0, 3]  # a real token of the original cluster 0
    problem = problem.with_(cluster_tokens=table)
    tokens = ops.decode_greedy(*problem.args())
    assert (tokens == int(table[0, 3])).all()
    check_decode_greedy(tokens, problem, exact=True)


@device_params
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_padding_when_vocab_not_multiple_of_cluster_size(device, dtype):
    # V = 10 tokens in 3 clusters of 4; with p = C the candidates are the whole vocabulary, so the
    # answer is the dense argmax (first index on ties, as torch.argmax).
    problem = make_problem(Shape(B=17, D=7, C=3, b=4, p=3, pad=2), dtype, device)
    assert (problem.cluster_tokens == -1).sum() == 2
    tokens = ops.decode_greedy(*problem.args())
    dense = ref.dense_logits(problem.hidden, problem.embedding)
    check_decoded_tokens(tokens, ref.scores(problem.hidden, problem.centroids), dense, problem, dense.argmax(1),
                         problem.score_tol(), problem.logit_tol(), exact_on(device))
    candidates = ops.gather_candidates(ops.select_clusters(problem.hidden, problem.centroids, 3)[0], problem.cluster_tokens)
    assert ((candidates == -1).sum(1) == 2).all()
    logits = ops.candidate_logits(problem.hidden, problem.embedding, candidates)
    assert torch.equal((logits == float("-inf")).cpu(), (candidates == -1).cpu())


def _special_rows(D, device, dtype):
    """Hidden rows with NaN / inf entries (each row exercises one case)."""
    g = generator("special", D)
    rows = torch.randn(7, D, generator=g)
    rows[0] = float("nan")               # every score NaN
    rows[1, 3] = float("nan")            # one NaN component: still every score NaN
    rows[2, 0] = float("inf")            # scores +-inf by the sign of column 0
    rows[3, 1] = float("-inf")
    rows[4, 0], rows[4, 1] = float("inf"), float("-inf")  # +inf + -inf: NaN where signs agree
    rows[5] = float("inf")
    rows[6, 2] = float("inf")
    rows[6, 5] = float("nan")
    return rows.to(device, dtype)


@device_params
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_nan_and_inf_hidden_states(device, dtype):
    problem = make_problem(Shape(B=7, D=16, C=37, b=4, p=5, pad=3, extras=True), dtype, device)
    problem = problem.with_(hidden=_special_rows(16, device, dtype))
    # NaN / inf propagation does not depend on the summation order: exact on every device.
    ids, _ = ops.select_clusters(problem.hidden, problem.centroids, problem.probes)
    assert_same_ids(ids, ref.select_clusters(problem.hidden, problem.centroids, problem.probes)[0])
    tokens = ops.decode_greedy(*problem.args())
    check_decode_greedy(tokens, problem, exact=True)
    assert ((tokens >= 0) & (tokens < problem.vocab)).all()
    # Every score NaN: NaN ties with NaN, so the smallest cluster ids win.
    assert ids[0].tolist() == list(range(problem.probes))
    drawn, _ = ops.decode_sample(*problem.args()[:5], 0.9, problem.extra_ids, seed=11)
    trace = ref.decode_sample(*problem.args()[:5], 0.9, 11, problem.extra_ids)
    assert_same_ids(drawn[:2], trace.tokens[:2], "sampled tokens of all-NaN rows (deterministic)")
    assert ((drawn >= 0) & (drawn < problem.vocab)).all()


@device_params
def test_nan_rows_rank_below_every_number(device):
    # A NaN centroid is ranked after every scored cluster, a NaN embedding row after every token.
    base = make_problem(Shape(B=3, D=16, C=37, b=4, p=37), device=device)
    nan_cluster, best_cluster = 5, 9
    nan_token = int(base.cluster_tokens[best_cluster, 0])
    hidden = base.hidden.abs() + 1  # positive rows: a positive centroid scores highest
    centroids, embedding = base.centroids.clone(), base.embedding.clone()
    centroids[nan_cluster, 2] = float("nan")
    centroids[best_cluster] = 10.0
    embedding[nan_token, 0] = float("nan")
    problem = base.with_(hidden=hidden, centroids=centroids, embedding=embedding)
    ids, _ = ops.select_clusters(hidden, centroids, 37)
    assert (ids[:, 0] == best_cluster).all() and (ids[:, -1] == nan_cluster).all()
    candidates = ops.gather_candidates(ids, problem.cluster_tokens)
    logits = ops.candidate_logits(hidden, embedding, candidates)
    assert torch.isnan(logits[candidates == nan_token]).all()
    # Probing only the best cluster, the NaN token competes with its cluster's finite logits and loses.
    single = problem.with_(probes=1)
    tokens = ops.decode_greedy(*single.args())
    members = problem.cluster_tokens[best_cluster]
    assert (tokens != nan_token).all() and torch.isin(tokens, members.long()).all()
    check_decode_greedy(tokens, single, exact=exact_on(device))


@device_params
@pytest.mark.parametrize("finite,p", [(200, 300), (2000, 2100)], ids=["bounded", "unbounded"])
def test_selection_reaches_past_the_numbers(finite, p, device):
    # A row of 3000 clusters (three rounds of the selecting block, the last one partial), only
    # `finite` of them scored by a number: the rest by -inf or NaN, which rank alike below every
    # number, the smaller id first. The p best must take p - finite of those (p <= 1024 goes through
    # the kernel's lower bound, p > 1024 not), and never an id past the row's end, whose key slots
    # the kernel holds as 0. A hidden value of -1 turns the -inf scores into +inf, ranked first.
    gen = generator("past the numbers", finite, p)
    C = 3000
    values = torch.randn(C, generator=gen)
    unscored = torch.randperm(C, generator=gen)[: C - finite]
    values[unscored] = float("-inf")
    values[unscored[::3]] = float("nan")
    hidden = torch.tensor([[1.0], [-1.0]], device=device)
    centroids = values[:, None].to(device)
    ids, scores = ops.select_clusters(hidden, centroids, p)
    expected, expected_scores = ref.select_clusters(hidden, centroids, p)
    assert_same_ids(ids, expected)
    assert torch.equal(scores.isnan(), expected_scores.isnan())
    assert torch.equal(scores.nan_to_num(0.0), expected_scores.nan_to_num(0.0))


@device_params
def test_signed_zeros_tie(device):
    # -0 and +0 compare equal, so the smaller id wins among zero scores. On the CPU the scores keep
    # their signs (matmul), so this checks how the reference ranks -0; the CUDA kernels' sums start
    # from +0 and never produce -0, so there it checks the tie-break among zeros (and the zero
    # logits of the decode, all +0 on both devices, go to the smallest token).
    hidden = torch.tensor([[1.0], [-1.0]], device=device)
    centroids = torch.tensor([[-0.0], [0.0], [-0.0], [0.0], [-1.0], [-2.0]], device=device)
    ids, _ = ops.select_clusters(hidden, centroids, 3)
    assert ids.tolist() == [[0, 1, 2], [5, 4, 0]]
    assert_same_ids(ids, ref.select_clusters(hidden, centroids, 3)[0])
    cluster_tokens = torch.tensor([[5, 0], [3, 2], [1, 4], [7, 6], [9, 8], [11, 10]], dtype=torch.int32, device=device)
    embedding = torch.tensor([[-0.0 if v % 2 == 0 else 0.0] for v in range(12)], device=device)
    tokens = ops.decode_greedy(hidden[:1], centroids, cluster_tokens, embedding, 3)
    assert tokens.tolist() == [0]


@device_params
def test_empty_batch(device):
    problem = make_problem(Shape(B=1, D=8, C=5, b=3, p=2, extras=True), device=device)
    empty = problem.with_(hidden=problem.hidden[:0])
    assert ops.select_clusters(empty.hidden, empty.centroids, 2)[0].shape == (0, 2)
    assert ops.sample_clusters(empty.hidden, empty.centroids, 2, seed=1)[0].shape == (0, 2)
    assert ops.decode_greedy(*empty.args()).shape == (0,)
    assert ops.decode_sample(*empty.args()[:5], 1.0, empty.extra_ids, seed=1)[0].shape == (0,)
    no_ids = torch.empty(0, 2, dtype=torch.int32, device=device)
    assert ops.gather_candidates(no_ids, empty.cluster_tokens, empty.extra_ids).shape == (0, 2 * 3 + 4)
    assert ops.candidate_logits(empty.hidden, empty.embedding, no_ids).shape == (0, 2)
