"""Every op against the plain-torch reference over odd shapes and all dtypes, on each device.

Ids must match exactly on the CPU; on CUDA (another summation order) exactly wherever the float32
reference has no near-tie (see helpers.check_*). Integer-valued inputs make the arithmetic exact on
every device: there ids must match exactly everywhere, ties included.
"""
import subprocess
import sys

import pytest
import torch

import reference as ref
from flashhead_ext import ops
from helpers import (DEVICES, DTYPES, TWO_GPUS, Problem, Shape, assert_same_ids, assert_values_close,
                     check_decode_greedy, check_decode_sample, check_ranked_selection, exact_on, generator, make_problem,
                     seed_tensor)

# B in 1, 3, 17; D in 64, 576 and odd 7 and 1; C not a power of two; p in 1, C//16, C; b in 1, 4, 16;
# padded tables (V not a multiple of b); extra ids (one already a candidate, one repeated).
CASES = [
    Shape(B=1, D=64, C=37, b=1, p=1),
    Shape(B=3, D=64, C=37, b=4, p=37 // 16, pad=3, extras=True),
    Shape(B=17, D=64, C=37, b=16, p=37, pad=5, extras=True),
    Shape(B=3, D=576, C=257, b=4, p=257 // 16),
    Shape(B=17, D=576, C=257, b=1, p=257, extras=True),
    Shape(B=1, D=576, C=989, b=16, p=989 // 16, pad=7, extras=True),
    Shape(B=17, D=576, C=989, b=4, p=1),
    Shape(B=3, D=64, C=989, b=16, p=989, pad=100, extras=True),
    Shape(B=17, D=7, C=257, b=16, p=16, pad=1, extras=True),
    Shape(B=3, D=1, C=37, b=4, p=37, extras=True),
]
# Integer-valued inputs: many exact ties in scores and logits.
TIE_CASES = [
    Shape(B=17, D=64, C=37, b=4, p=2, pad=3, extras=True),
    Shape(B=3, D=7, C=257, b=16, p=16, extras=True),
    Shape(B=17, D=576, C=257, b=1, p=1),
]

case_params = pytest.mark.parametrize("shape", CASES, ids=str)
tie_params = pytest.mark.parametrize("shape", TIE_CASES, ids=str)
dtype_params = pytest.mark.parametrize("dtype", DTYPES, ids=str)
device_params = pytest.mark.parametrize("device", DEVICES)
TEMPERATURE = 0.7


def _select_and_check(problem, exact):
    ids, scores = ops.select_clusters(problem.hidden, problem.centroids, problem.probes)
    assert ids.dtype == torch.int32 and scores.dtype == torch.float32
    assert ids.device == problem.device and ids.shape == (problem.hidden.shape[0], problem.probes)
    ref_scores = ref.scores(problem.hidden, problem.centroids)
    check_ranked_selection(ids, ref_scores, problem.probes, problem.score_tol(), exact)
    # The returned scores are the float32 scores of the returned ids.
    assert_values_close(scores, ref_scores.gather(1, ids.long()), problem.score_tol(), "scores")


@device_params
@dtype_params
@case_params
def test_select_clusters(shape, dtype, device):
    problem = make_problem(shape, dtype, device)
    _select_and_check(problem, exact_on(device))


@device_params
@dtype_params
@tie_params
def test_select_clusters_ties(shape, dtype, device):
    _select_and_check(make_problem(shape, dtype, device, integer=True), exact=True)


@device_params
@case_params
def test_gather_candidates(shape, device):
    problem = make_problem(shape, torch.float32, device)
    cluster_ids = ref.select_clusters(problem.hidden, problem.centroids, problem.probes)[0]
    got = ops.gather_candidates(cluster_ids, problem.cluster_tokens, problem.extra_ids)
    expected = ref.gather_candidates(cluster_ids, problem.cluster_tokens, problem.extra_ids)
    assert got.dtype == torch.int32 and got.device == problem.device
    assert_same_ids(got, expected, "candidate ids")
    # Each valid token appears at most once per row (an extra id is never doubled).
    for row in got.cpu():
        kept = row[row >= 0]
        assert kept.unique().numel() == kept.numel()


@device_params
@dtype_params
@case_params
def test_candidate_logits(shape, dtype, device):
    problem = make_problem(shape, dtype, device)
    candidates = ref.gather_candidates(ref.select_clusters(problem.hidden, problem.centroids, problem.probes)[0],
                                       problem.cluster_tokens, problem.extra_ids)
    got = ops.candidate_logits(problem.hidden, problem.embedding, candidates)
    assert got.dtype == torch.float32 and got.shape == candidates.shape and got.device == problem.device
    expected = ref.candidate_logits(problem.hidden, problem.embedding, candidates)
    assert torch.equal(torch.isinf(got).cpu(), (candidates < 0).cpu()), "-inf exactly at the masked slots"
    assert_values_close(got, expected, problem.logit_tol(), "logits")


def test_candidate_logits_in_row_blocks():
    # The CPU op gathers about 64 MB of float32 embedding rows at a time (at once, a forward over a
    # whole sequence took 7 MB a position): every block's rows are their own.
    g = generator("candidate logits in row blocks")
    V, D, width, B = 5003, 64, 4100, 130  # 63 rows a block: three blocks, the last of 4 rows
    embedding, hidden = torch.randn(V, D, generator=g), torch.randn(B, D, generator=g)
    candidates = torch.randint(-1, V, (B, width), generator=g, dtype=torch.int32)
    got = ops.candidate_logits(hidden, embedding, candidates)
    torch.testing.assert_close(got, ref.candidate_logits(hidden, embedding, candidates), rtol=1e-5, atol=1e-4)


_PEAK_MEMORY_OF_CANDIDATE_LOGITS = """
import resource, torch
from flashhead_ext import ops
g = torch.Generator().manual_seed(5)
B, width, D = 256, 4096, 512  # at once: 256 x 4096 rows of 512 floats, 2.1 GB
embedding, hidden = torch.randn(5003, D, generator=g), torch.randn(B, D, generator=g)
candidates = torch.randint(-1, 5003, (B, width), generator=g, dtype=torch.int32)
ops.candidate_logits(hidden[:1], embedding, candidates[:1])  # loads what a first call loads
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
logits = ops.candidate_logits(hidden, embedding, candidates)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024, bool(torch.isfinite(logits).any()))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in kilobytes is Linux's")
def test_candidate_logits_row_blocks_bound_its_memory():
    # Its peak, in a process of its own: the gathered rows of a whole call at once were 2.1 GB here.
    run = subprocess.run([sys.executable, "-c", _PEAK_MEMORY_OF_CANDIDATE_LOGITS], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    peak, finite = run.stdout.split()
    assert finite == "True" and int(peak) < 400e6, f"candidate_logits raised the peak resident memory by {int(peak) / 1e6:.0f} MB"


@device_params
@dtype_params
@case_params
def test_decode_greedy(shape, dtype, device):
    problem = make_problem(shape, dtype, device)
    tokens = ops.decode_greedy(*problem.args())
    assert tokens.dtype == torch.int64 and tokens.shape == (shape.B,) and tokens.device == problem.device
    check_decode_greedy(tokens, problem, exact_on(device))
    out = torch.full((shape.B,), -7, dtype=torch.int64, device=device)
    assert ops.decode_greedy(*problem.args(), out=out) is out
    assert_same_ids(out, tokens, "decode_greedy_out vs decode_greedy")


@device_params
@dtype_params
@tie_params
def test_decode_greedy_ties(shape, dtype, device):
    problem = make_problem(shape, dtype, device, integer=True)
    check_decode_greedy(ops.decode_greedy(*problem.args()), problem, exact=True)


@device_params
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@case_params
def test_sample_clusters_matches_philox_reference(shape, dtype, device):
    problem = make_problem(shape, dtype, device)
    seed = 1000 + shape.C
    ids, raw = ops.sample_clusters(problem.hidden, problem.centroids, problem.probes, TEMPERATURE, seed=seed)
    trace = ref.sample_clusters(problem.hidden, problem.centroids, problem.probes, TEMPERATURE, seed)
    key_tol = problem.score_tol() / TEMPERATURE + 1e-5
    check_ranked_selection(ids, trace.cluster_keys, problem.probes, key_tol, exact_on(device))
    assert_values_close(raw, trace.cluster_scores.gather(1, ids.long()), problem.score_tol(), "raw scores")


@device_params
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@case_params
def test_decode_sample_matches_philox_reference(shape, dtype, device):
    problem = make_problem(shape, dtype, device)
    seed = 77 + shape.B
    tokens, logprobs = ops.decode_sample(*problem.args()[:5], TEMPERATURE, problem.extra_ids, seed=seed)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32 and tokens.shape == (shape.B,)
    check_decode_sample(tokens, logprobs, problem, TEMPERATURE, seed, exact_on(device))


@device_params
@dtype_params
def test_duplicate_rows_tie_to_smaller_id(dtype, device):
    # Exact ties on purpose, with random float data: a centroid row copied to a larger cluster id, and
    # an embedding row copied to a larger token id placed *earlier* in the candidate list. Identical
    # rows give bit-identical scores on any device, so the smaller id must win on every device.
    problem = make_problem(Shape(B=3, D=576, C=257, b=4, p=2), dtype, "cpu")
    hidden, centroids, table, embedding = problem.hidden, problem.centroids.clone(), problem.cluster_tokens, problem.embedding.clone()
    scores = ref.scores(hidden, centroids)
    best = int(scores[0].argmax())
    low, high = sorted([best, (best + 100) % 257])
    # The duplicated pair becomes the best two clusters of every row (10x the other scores' scale).
    direction = hidden.float().sum(0)
    centroids[low] = centroids[high] = (direction / direction.norm() * 10).to(dtype)
    ids, _ = ops.select_clusters(hidden.to(device), centroids.to(device), 2)
    assert ids.cpu().tolist() == [[low, high]] * 3
    # Tokens: one of cluster `low` (earlier in the candidate list) and one of `high` get the same
    # row; below, swapping the two clusters' tokens puts the smaller id first, then last.
    t_low, t_high = int(table[low, 1]), int(table[high, 2])
    winner, loser = min(t_low, t_high), max(t_low, t_high)
    embedding[t_low] = embedding[t_high] = (direction / direction.norm() * 10).to(dtype)
    tokens = ops.decode_greedy(hidden.to(device), centroids.to(device), table.to(device), embedding.to(device), 2)
    assert tokens.cpu().tolist() == [winner] * 3
    candidates = ops.gather_candidates(ids, table.to(device))
    logits = ops.candidate_logits(hidden.to(device), embedding.to(device), candidates)
    pos = lambda t: int((candidates[0] == t).nonzero()[0, 0])
    assert logits[0, pos(winner)] == logits[0, pos(loser)]  # bit-identical
    swapped = table.clone()
    swapped[[low, high]] = table[[high, low]]
    tokens = ops.decode_greedy(hidden.to(device), centroids.to(device), swapped.to(device), embedding.to(device), 2)
    assert tokens.cpu().tolist() == [winner] * 3


# The decodes list their clusters unranked, so the tests above see that list only through the
# argmax. Here the argmax is the list's boundary: scores take six values, so the p-th cluster ties
# with others and is taken by its smaller id; the best token is in it and a better one in the first
# cluster left out. Dropping the p-th cluster, or keeping the wrong one of a tie, changes the token.
@device_params
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("B,C,p", [(1, 37, 1), (3, 2049, 257), (8, 9496, 1000), (9, 9496, 1000), (2, 16384, 8192),
                                   (1, 16385, 593)])
def test_decode_greedy_selection_boundary(B, C, p, dtype, device):
    gen = torch.Generator().manual_seed(C + p)
    b, D = 4, 3
    # Scores from coordinate 0 (one per cluster), logits from coordinate 2 (one per token).
    levels = torch.randint(0, 6, (C,), generator=gen).float()
    centroids = torch.zeros(C, D)
    centroids[:, 0] = levels
    hidden = torch.tensor([[1.0, 0.0, 1.0]]).repeat(B, 1)
    table = (torch.arange(C * b) + 7).view(C, b).int()  # token ids 7 .. 7 + C*b - 1
    embedding = torch.zeros(C * b + 7, D)
    ranked = sorted(range(C), key=lambda c: (-levels[c].item(), c))
    boundary = ranked[p - 1]
    embedding[table[boundary, 1], 2] = 3.0
    if p < C:
        embedding[table[ranked[p], 2], 2] = 5.0
    args = [t.to(dtype).to(device) for t in (hidden, centroids)] + [table.to(device), embedding.to(dtype).to(device), p]
    expected = [int(table[boundary, 1])] * B
    assert ref.decode_greedy(*args).tokens.cpu().tolist() == expected
    assert ops.decode_greedy(*args).cpu().tolist() == expected


# The selection kernel is compiled for every count of register-cached keys a thread (one key a
# round of 1024 clusters, 8 to 16 rounds) and runs the one that holds the row: rows of 8 to 17
# rounds reach every instance of both list orders (17: a round past the cache, read from memory).
@device_params
@pytest.mark.parametrize("rounds", range(8, 18))
def test_selection_at_every_cached_row_length(rounds, device):
    problem = make_problem(Shape(B=2, D=7, C=1024 * rounds - 5 * rounds, b=1, p=301), torch.float32, device)
    _select_and_check(problem, exact_on(device))
    check_decode_greedy(ops.decode_greedy(*problem.args()), problem, exact_on(device))
    seed = 5 + rounds
    tokens, logprobs = ops.decode_sample(*problem.args()[:5], TEMPERATURE, problem.extra_ids, seed=seed)
    check_decode_sample(tokens, logprobs, problem, TEMPERATURE, seed, exact_on(device))


# The selection's radix passes: one far outlier stretches the first pass's bins (4096 over the
# range from the lower bound to the row maximum) so wide that 600 keys a few ulps apart around the
# p-th share one bin, and two more passes must split it; five of them tie with the p-th key, so the
# smaller ids must win after the passes. D = 1 in float32 and hidden values that are powers of two
# make every score and logit exact, so ids must match the reference on every device.
@device_params
@pytest.mark.parametrize("p", [256, 593])
def test_selection_splits_a_crowded_boundary_bin(p, device):
    gen = torch.Generator().manual_seed(p)
    C = 9496
    values = torch.rand(C, generator=gen) * 1.5 - 1.0  # below the crowd: [-1, 0.5)
    crowd = 1.0 + torch.arange(600, dtype=torch.float32) * 2.0 ** -23  # consecutive floats from 1.0
    where = torch.randperm(C, generator=gen)
    values[where[:600]] = crowd
    values[where[600]] = 1.0e6
    values[where[601:606]] = crowd[600 - (p - 1)]  # ties with the p-th key
    problem = Problem(hidden=torch.tensor([[1.0], [2.0], [0.5]]), centroids=values[:, None],
                      cluster_tokens=torch.arange(C, dtype=torch.int32)[:, None],
                      embedding=torch.rand(C, 1, generator=gen) * 2.0 - 1.0, probes=p, extra_ids=None).to(device)
    _select_and_check(problem, exact=True)
    check_decode_greedy(ops.decode_greedy(*problem.args()), problem, exact=True)


@pytest.mark.gpu
@TWO_GPUS
@dtype_params
def test_ops_run_on_their_inputs_gpu_not_the_current_one(dtype):
    """With cuda:0 current, every op on cuda:1 inputs returns on cuda:1 the bits it returns on
    cuda:0 (the same deterministic kernels on the same kind of GPU)."""
    shape = Shape(B=3, D=576, C=989, b=16, p=989 // 16, pad=7, extras=True)

    def every_op(problem):
        ids, scores = ops.select_clusters(problem.hidden, problem.centroids, problem.probes)
        sampled = ops.sample_clusters(problem.hidden, problem.centroids, problem.probes, TEMPERATURE, seed=5)
        candidates = ops.gather_candidates(ids, problem.cluster_tokens, problem.extra_ids)
        logits = ops.candidate_logits(problem.hidden, problem.embedding, candidates)
        tokens = ops.decode_greedy(*problem.args())
        sampled_tokens = ops.decode_sample(*problem.args()[:5], TEMPERATURE, problem.extra_ids, seed=5)
        return dict(select=(ids, scores), sample_clusters=sampled, gather=(candidates,), logits=(logits,),
                    decode_greedy=(tokens,), decode_sample=sampled_tokens)

    with torch.cuda.device(0):
        first = every_op(make_problem(shape, dtype, "cuda:0"))
        second = every_op(make_problem(shape, dtype, "cuda:1"))
    for name, outputs in second.items():
        for output, expected in zip(outputs, first[name]):
            assert output.device == torch.device("cuda:1"), name
            assert torch.equal(output.cpu(), expected.cpu()), name


@device_params
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ops_run_as_outside_autocast(dtype, device):
    # Inside torch.autocast the ops run as outside it: float32 scores and logits, the same ids (the
    # CPU references' own matmuls had been autocast).
    problem = make_problem(Shape(B=3, D=576, C=257, b=4, p=257 // 16, pad=3, extras=True), dtype, device)
    hidden, centroids, table, embedding, probes, extra = problem.args()
    seed = seed_tensor(11, device)
    candidates = ops.gather_candidates(ops.select_clusters(hidden, centroids, probes)[0], table, extra)
    # 3 queries of 12 heads over a cache of 4 KV heads and 12 positions, head_dim 48.
    queries, keys, values = hidden.view(3, 12, 48), embedding[:4].reshape(4, 12, 48), embedding[4:8].reshape(4, 12, 48)

    def run_all():
        return (*ops.select_clusters(hidden, centroids, probes), *ops.sample_clusters(hidden, centroids, probes, 0.7, seed=seed),
                ops.candidate_logits(hidden, embedding, candidates), ops.decode_greedy(*problem.args()),
                *ops.decode_sample(*problem.args()[:5], 0.7, extra, seed=seed),
                ops.fused_linear(hidden, embedding[:40]),
                ops.decode_attention(queries, keys, values, torch.tensor(5, device=device)))

    plain = run_all()
    with torch.autocast(torch.device(device).type, dtype=torch.float16 if dtype == torch.bfloat16 else torch.bfloat16):
        cast = run_all()
    for i, (a, b) in enumerate(zip(plain, cast)):
        assert a.dtype == b.dtype and torch.equal(a, b), i
