"""Every head op against the reference on seeded random configurations.

The other op tests pin chosen shapes; these draw them: batch (1 most often, where the GPU takes
its batch-1 paths), hidden size (odd ones, and multiples of 8 and 16 where the kernels read
vectors), cluster count, cluster size, probes (1 to C), padding slots, extra ids (none to past a
warp's 32, with repeats, tokens of chosen clusters and ids outside the vocabulary), dtype, fp8
centroids and integer-valued data (exact ties). Draws are seeded by their index, so a failure names
a reproducible configuration. ``FLASHHEAD_RANDOM_DRAWS`` sets how many are drawn (default 32).
"""
import math
import os
import random
from dataclasses import dataclass

import pytest
import torch

import reference as ref
from flashhead_ext import ops
from helpers import (DEVICES, DTYPES, Shape, assert_same_ids, assert_values_close, check_decode_greedy,
                     check_decode_sample, check_ranked_selection, is_cuda, make_problem, stable_seed)

DRAWS = int(os.environ.get("FLASHHEAD_RANDOM_DRAWS", "32"))
TEMPERATURES = (0.3, 0.8, 1.0, 1.7)
# The largest embedding a draw builds (V * D elements) and cluster count: the CPU references are
# loops over every product, the GPU takes the sizes.
LIMITS = {"cpu": (2_000_000, 4_000), "cuda": (250_000_000, 16_384)}


@dataclass(frozen=True)
class Draw:
    shape: Shape
    dtype: torch.dtype
    fp8: bool
    integer: bool
    extra_ids: tuple
    temperature: float
    seed: int

    def __str__(self) -> str:
        return (f"{self.shape}-{str(self.dtype)[6:]}{'-fp8' if self.fp8 else ''}{'-int' if self.integer else ''}"
                f"-E{len(self.extra_ids)}-T{self.temperature}")


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def draw(index: int, device: str) -> Draw:
    rng = random.Random(stable_seed("random-shapes", index, device))
    max_elements, max_clusters = LIMITS[device]
    B = rng.choice([1, 1, 1, 1, 2, 3, 5, 8, 9, 16, 17, 33, 64])
    # Half the draws near the largest cluster counts, half spread down to a single cluster.
    C = rng.randint(max_clusters // 8, max_clusters) if rng.random() < 0.5 else log_uniform(rng, 1, max_clusters)
    b = rng.choice([1, 2, 3, 5, 8, 8, 13, 16, 16, 16, 24, 32, 33])
    pad = rng.randint(0, min(C, b - 1)) if b > 1 else 0
    V = C * b - pad
    D = rng.choice([log_uniform(rng, 1, 4200), 8 * log_uniform(rng, 1, 512), 16 * log_uniform(rng, 1, 256),
                    rng.choice([576, 640, 1024, 1152, 2048, 4096])])
    if D > max_elements // V:  # kept a multiple of 16 where it was one, unless that leaves nothing
        cap = max_elements // V
        D = max(1, cap - cap % 16 if D % 16 == 0 and cap >= 16 else cap)
    p = rng.choice([1, C, log_uniform(rng, 1, C), max(1, C // 16), min(C, 256)])
    # Extra ids: tokens of the vocabulary (repeats likely when E is large against V), the last
    # token, and ids every op masks (-1 and past the vocabulary).
    E = rng.choice([0, 0, 1, 2, 4, 31, 32, 33, 45])
    pool = [rng.randrange(V) for _ in range(4)] + [V - 1, -1, V, V + 7]
    extra = tuple(rng.choice(pool) if rng.random() < 0.5 else rng.randrange(V) for _ in range(E))
    return Draw(Shape(B=B, D=D, C=C, b=b, p=p, pad=pad), rng.choice(DTYPES), rng.random() < 0.3,
                rng.random() < 0.3, extra, rng.choice(TEMPERATURES), rng.randrange(1 << 31))


def problem_and_centroids(d: Draw, device: str):
    """(the problem the reference scores, the centroids and scale the ops take)."""
    problem = make_problem(d.shape, d.dtype, device, seed=d.seed, integer=d.integer,
                           build_on_device=is_cuda(device))
    extra = torch.tensor(d.extra_ids, dtype=torch.int32, device=device) if d.extra_ids else None
    problem = problem.with_(extra_ids=extra)
    if d.fp8:
        return problem.with_fp8_centroids()
    return problem, problem.centroids, None


def exact(d: Draw, device: str, sampling: bool = False) -> bool:
    """Ids must match exactly on the CPU; on the GPU where integer data sums exactly in any order
    (fp8 centroids of small integers too: they are scaled by a power of two), but not in sampling,
    whose Gumbel noise takes a logf that may differ from the reference's by an ulp."""
    return not is_cuda(device) or (d.integer and not sampling)


@pytest.mark.parametrize("index", range(DRAWS))
@pytest.mark.parametrize("device", DEVICES)
def test_random_configuration(device, index):
    d = draw(index, device)
    problem, centroids, scale = problem_and_centroids(d, device)
    h, _, table, embedding, probes, extra = problem.args()
    is_exact, sampling_exact = exact(d, device), exact(d, device, sampling=True)
    context = f"draw {index}: {d}"

    ids, scores = ops.select_clusters(h, centroids, probes, centroid_scale=scale)
    ref_scores = ref.scores(h, problem.centroids)
    check_ranked_selection(ids, ref_scores, probes, problem.score_tol(), is_exact, what=f"{context}: cluster_ids")
    assert_values_close(scores, ref_scores.gather(1, ids.long()), problem.score_tol(), f"{context}: scores")

    candidates = ops.gather_candidates(ids, table, extra)
    assert_same_ids(candidates, ref.gather_candidates(ids, table, extra), f"{context}: candidates")
    logits = ops.candidate_logits(h, embedding, candidates)
    masked = ~ref.valid_candidates(candidates, problem.vocab)
    assert torch.equal(torch.isinf(logits).cpu(), masked.cpu()), f"{context}: -inf exactly at the masked slots"
    assert_values_close(logits, ref.candidate_logits(h, embedding, candidates), problem.logit_tol(),
                        f"{context}: logits")

    tokens = ops.decode_greedy(h, centroids, table, embedding, probes, extra, centroid_scale=scale)
    check_decode_greedy(tokens, problem, is_exact)
    # Deterministic: a second call gives the same bits.
    assert torch.equal(tokens, ops.decode_greedy(h, centroids, table, embedding, probes, extra, centroid_scale=scale))

    sampled, sampled_scores = ops.sample_clusters(h, centroids, probes, d.temperature, seed=d.seed, centroid_scale=scale)
    trace = ref.sample_clusters(h, problem.centroids, probes, d.temperature, d.seed)
    check_ranked_selection(sampled, trace.cluster_keys, probes, problem.score_tol() / d.temperature + 1e-5,
                           sampling_exact,
                           what=f"{context}: sampled cluster_ids")
    assert_values_close(sampled_scores, trace.cluster_scores.gather(1, sampled.long()), problem.score_tol(),
                        f"{context}: sampled clusters' scores")

    drawn, logprobs = ops.decode_sample(h, centroids, table, embedding, probes, d.temperature, extra, seed=d.seed,
                                        centroid_scale=scale)
    check_decode_sample(drawn, logprobs, problem, d.temperature, d.seed, sampling_exact)
    again = ops.decode_sample(h, centroids, table, embedding, probes, d.temperature, extra, seed=d.seed,
                              centroid_scale=scale)
    assert torch.equal(drawn, again[0]) and torch.equal(logprobs, again[1]), f"{context}: sampling not deterministic"
