"""Self-checks of the test reference and helpers (so a wrong reference cannot pass silently)."""
import numpy as np
import pytest
import torch

import reference as ref
from helpers import Shape, chi_square_pvalue, cluster_table, generator, make_problem

INF = float("inf")
NAN = float("nan")

# Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter[4], key[2] -> result[4].
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in ref.philox4x32_10(counter, key)) == expected


def test_gumbel_noise_moments():
    # Standard Gumbel: mean = Euler-Mascheroni constant, variance = pi^2 / 6.
    g = ref.gumbel(seed=12345, stream=0, rows=256, cols=1024).double()
    assert abs(g.mean().item() - 0.5772156649) < 0.01
    assert abs(g.var().item() - np.pi ** 2 / 6) < 0.03
    assert not torch.equal(g, ref.gumbel(seed=12345, stream=1, rows=256, cols=1024).double())


def test_ranking_nan_last_and_ties_to_smaller_id():
    keys = torch.tensor([[1.0, NAN, 3.0, 3.0, -INF, INF], [0.0, 0.0, NAN, -0.0, 2.0, NAN]])
    order = ref.ranking(keys)
    assert order[0].tolist() == [5, 2, 3, 0, 1, 4]  # NaN ties with -inf, smaller id first
    assert order[1].tolist() == [4, 0, 1, 3, 2, 5]  # -0.0 == 0.0


def test_best_candidate_ties_to_smallest_token_and_masks():
    keys = torch.tensor([[2.0, 5.0, 5.0, 9.0], [NAN, NAN, NAN, NAN], [1.0, 1.0, 1.0, 1.0]])
    ids = torch.tensor([[3, 40, 7, 99], [8, 2, -1, 5], [-1, 12, -1, 3]], dtype=torch.int32)
    valid = ref.valid_candidates(ids, vocab=50)  # 99 is out of range: masked despite key 9
    position, token = ref.best_candidate(keys, ids, valid)
    assert token.tolist() == [7, 2, 3]
    assert position.tolist() == [2, 1, 3]
    none_valid = torch.zeros_like(valid)
    assert ref.best_candidate(keys, ids, none_valid)[1].tolist() == [-1, -1, -1]


def test_gather_candidates_reference_masks():
    table = torch.tensor([[0, 1, -1], [2, 3, 4], [5, 6, 7]], dtype=torch.int32)
    cluster_ids = torch.tensor([[1, 3], [-1, 0]], dtype=torch.int32)
    extra = torch.tensor([4, 9, 9, 1], dtype=torch.int32)
    got = ref.gather_candidates(cluster_ids, table, extra)
    assert got.tolist() == [[2, 3, 4, -1, -1, -1, -1, 9, -1, 1], [-1, -1, -1, 0, 1, -1, 4, 9, -1, -1]]


def test_cluster_table_is_a_partition():
    table = cluster_table(C=37, b=4, pad=5, g=generator("partition"))
    tokens = table[table >= 0]
    assert tokens.sort().values.tolist() == list(range(37 * 4 - 5))
    assert ((table >= 0).sum(1) >= 3).all()


def test_problem_extras_cover_masking_cases():
    problem = make_problem(Shape(B=3, D=64, C=37, b=4, p=2, extras=True))
    extra = problem.extra_ids.tolist()
    assert extra[0] == extra[2]  # a repeated extra id
    chosen = ref.select_clusters(problem.hidden[:1], problem.centroids, 1)[0]
    assert extra[1] in problem.cluster_tokens[chosen[0, 0]].tolist()  # already a candidate of row 0


def test_chi_square_helper_detects_a_wrong_law():
    probs = np.array([0.5, 0.3, 0.2, 0.0])
    assert chi_square_pvalue([5000, 3000, 2000, 0], probs) > 0.99
    assert chi_square_pvalue([5200, 2900, 1900, 0], probs) < 1e-3
    with pytest.raises(AssertionError, match="zero-probability"):
        chi_square_pvalue([5000, 3000, 1999, 1], probs)
