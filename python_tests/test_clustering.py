"""build_clusters and calibrate_clusters: equal sizes, padding, determinism, recovery of planted clusters, bad input."""
import warnings

import numpy as np
import pytest
import torch

from flashhead_ext import FlashHead
from helpers import default_dtype
from flashhead_ext import clustering as clustering_mod
from flashhead_ext.clustering import (MIN_STATES_PER_DIM, build_clusters, calibrate_clusters, cluster_sizes, cluster_table,
                                   fit_max_logit_centroids)


def _embedding(vocab, dim, seed=0):
    return torch.randn(vocab, dim, generator=torch.Generator().manual_seed(seed))


def _check_partition(result, vocab):
    """Clusters are disjoint, cover every token once, and agree with the assignment vector."""
    table, assignments = result.cluster_tokens.cpu(), result.cluster_assignments.cpu()
    assert table.dtype == torch.int32
    members = table[table >= 0].long()
    assert torch.equal(members.sort().values, torch.arange(vocab))
    assert assignments.dtype == torch.int64 and assignments.shape == (vocab,)
    rows = torch.arange(table.shape[0]).unsqueeze(1).expand_as(table)
    assert torch.equal(assignments[members], rows[table >= 0])
    # Padding only at row ends, token ids ascending within a row.
    for row in table:
        real = row[row >= 0]
        assert torch.equal(row[: real.numel()], real) and torch.equal(real, real.sort().values)


@pytest.mark.parametrize("vocab,dim,size", [(96, 8, 16), (99, 5, 3), (64, 7, 1), (30, 4, 30)])
def test_equal_sizes_when_divisible(vocab, dim, size):
    result = build_clusters(_embedding(vocab, dim), size, iters=4, progress=False)
    assert result.cluster_tokens.shape == (vocab // size, size)
    assert (result.cluster_tokens >= 0).all()
    assert torch.equal(torch.bincount(result.cluster_assignments), torch.full((vocab // size,), size))
    _check_partition(result, vocab)


@pytest.mark.parametrize("vocab", [99, 104])  # 104: six clusters of 9 beside five of 10, their rows -1 padded
def test_centroids_are_unit_norm_means_of_member_unit_rows(vocab):
    emb = _embedding(vocab, 6, seed=3) * torch.rand(vocab, 1, generator=torch.Generator().manual_seed(4)) * 5
    result = build_clusters(emb, n_clusters=11, iters=3, progress=False)
    assert result.centroids.shape == (11, 6) and result.centroids.dtype == torch.float32
    assert ((result.cluster_tokens < 0).any(dim=1).sum() == 6) == (vocab == 104)
    torch.testing.assert_close(result.centroids.norm(dim=1), torch.ones(11))
    assert (result.raw_centroids.norm(dim=1) < 1).all()  # random directions never align exactly
    for c in range(11):  # a padding slot adds no row (not token 0's, nor the last one's)
        members = result.cluster_tokens[c][result.cluster_tokens[c] >= 0].long()
        unit = torch.nn.functional.normalize(emb[members], dim=1).mean(0)
        torch.testing.assert_close(result.raw_centroids[c], unit)
        torch.testing.assert_close(result.centroids[c], unit / unit.norm())


@pytest.mark.parametrize("vocab,kwargs,width,expected_pads", [
    # P = C*b - V missing slots, dealt one per cluster from the last backwards, wrapping.
    (101, {"cluster_size": 16}, 16, [1, 1, 1, 2, 2, 2, 2]),  # C = 7, P = 11
    (100, {"n_clusters": 7}, 15, [0, 0, 1, 1, 1, 1, 1]),  # b = 15, P = 5
    (10, {"cluster_size": 8}, 8, [3, 3]),  # P > C
    (17, {"cluster_size": 7}, 7, [1, 1, 2]),  # P > C, wrapping
    (96, {"cluster_size": 16}, 16, [0] * 6),
])
def test_padding_scheme(vocab, kwargs, width, expected_pads):
    b, sizes = cluster_sizes(vocab, **kwargs)
    assert b == width and sizes.tolist() == [width - p for p in expected_pads]
    result = build_clusters(_embedding(vocab, 4, seed=1), iters=3, progress=False, **kwargs)
    # The table is as wide as the largest cluster: narrower than b where none is full (P >= C).
    table_width = width - min(expected_pads)
    assert result.cluster_tokens.shape == (len(expected_pads), table_width)
    assert (result.cluster_tokens < 0).sum(dim=1).tolist() == [p - min(expected_pads) for p in expected_pads]
    _check_partition(result, vocab)


@pytest.mark.parametrize("fill", [0.0, 0.25])
def test_a_constant_embedding_is_split_at_once(fill, monkeypatch):
    # Every score ties: the greedy had placed 8 clusters a round, re-scoring every free row (minutes).
    # The tie is found once per build, so no iteration runs the greedy (nor compares every row again).
    monkeypatch.setattr(clustering_mod, "_assign", lambda *args: pytest.fail("the greedy ran on tied rows"))
    vocab, size = 3001, 2
    result = build_clusters(torch.full((vocab, 8), fill), size, iters=5, progress=False)
    _check_partition(result, vocab)
    assert result.cluster_assignments.tolist() == torch.arange(vocab).div(size, rounding_mode="floor").tolist()
    assert result.iterations == 2  # the second finds that no token moved and stops, as before


def test_strict_refuses_padding():
    with pytest.raises(ValueError, match="not a multiple of cluster_size=16 and strict=True"):
        build_clusters(_embedding(100, 4), 16, strict=True, progress=False)
    result = build_clusters(_embedding(96, 4), 16, strict=True, iters=2, progress=False)
    assert result.cluster_tokens.shape == (6, 16)


@pytest.mark.parametrize("seed", [-2**63, 2**63, 2**64 - 1])  # the ends of what torch.Generator takes
def test_every_seed_a_generator_takes_is_accepted(seed):
    emb = _embedding(40, 5, seed=2)
    a = build_clusters(emb, 8, iters=2, seed=seed, progress=False)
    b = build_clusters(emb, 8, iters=2, seed=seed, progress=False)
    _check_partition(a, 40)
    assert torch.equal(a.cluster_tokens, b.cluster_tokens)


def test_deterministic_for_a_seed():
    emb = _embedding(203, 9, seed=7)
    a = build_clusters(emb, 7, iters=5, seed=11, progress=False)
    b = build_clusters(emb, 7, iters=5, seed=11, progress=False)
    c = build_clusters(emb, 7, iters=5, seed=12, progress=False)
    assert torch.equal(a.cluster_tokens, b.cluster_tokens) and torch.equal(a.centroids, b.centroids)
    assert not torch.equal(a.cluster_assignments, c.cluster_assignments)


def test_recovers_planted_clusters():
    # 13 well-separated directions, 8 noisy tokens around each, shuffled: every recovered cluster
    # must be exactly one planted group, whatever the random start.
    gen = torch.Generator().manual_seed(5)
    groups, size, dim = 13, 8, 32
    centres = torch.nn.functional.normalize(torch.randn(groups, dim, generator=gen), dim=1) * 4
    labels = torch.arange(groups).repeat_interleave(size)
    perm = torch.randperm(groups * size, generator=gen)
    labels = labels[perm]
    emb = centres[labels] + 0.3 * torch.randn(groups * size, dim, generator=gen)
    for seed in range(3):
        result = build_clusters(emb, size, iters=20, seed=seed, progress=False)
        for row in result.cluster_tokens:
            assert labels[row.long()].unique().numel() == 1, f"seed {seed}: cluster mixes planted groups"


def test_more_iterations_do_not_lower_the_objective():
    emb = _embedding(160, 8, seed=2)

    def cohesion(result):
        unit = torch.nn.functional.normalize(emb, dim=1)
        return float((unit * result.centroids[result.cluster_assignments]).sum())

    one = build_clusters(emb, 10, iters=1, seed=4, progress=False)
    many = build_clusters(emb, 10, iters=12, seed=4, progress=False)
    assert cohesion(many) > cohesion(one)


def test_flash_head_with_all_probes_matches_dense():
    emb = _embedding(99, 16, seed=9)
    result = build_clusters(emb, 8, iters=3, progress=False)
    head = FlashHead(emb, result.centroids, result.cluster_tokens, probes=result.num_clusters)
    hidden = torch.randn(17, 16, generator=torch.Generator().manual_seed(1))
    assert torch.equal(head.next_token(hidden), (hidden @ emb.T).argmax(dim=1))


def test_cluster_table_from_assignments():
    assignments = torch.tensor([2, 0, 2, 1, 0, 2])
    assert cluster_table(assignments, 3).tolist() == [[1, 4, -1], [3, -1, -1], [0, 2, 5]]
    with pytest.raises(ValueError, match="more than the table width 2"):
        cluster_table(assignments, 3, width=2)


@pytest.mark.parametrize("assignments,n_clusters,width,error,match", [
    # A cast had truncated these to [0, 1, 0, 1] and [1, 0, 1, 0] silently.
    (torch.tensor([0.9, 1.7, 0.2, 1.1]), 2, None, TypeError, "assignments must hold integer cluster ids, got torch.float32"),
    (torch.tensor([True, False, True, False]), 2, None, TypeError, "assignments must hold integer cluster ids, got torch.bool"),
    (torch.tensor([[0, 1], [1, 0]]), 2, None, ValueError, r"assignments must be 1-D \[vocab\], got shape \(2, 2\)"),
    (torch.tensor([0, 1, 2, 1]), 2, None, ValueError, r"assignments\[2\] = 2 is not a cluster id in \[0, 2\)"),
    (torch.tensor([0, -1, 1]), 2, None, ValueError, r"assignments\[1\] = -1 is not a cluster id"),
    ([0, 1], 2, None, TypeError, "assignments must be a torch.Tensor"),
    (torch.tensor([0, 1]), 0, None, ValueError, "n_clusters must be >= 1"),
    (torch.tensor([0, 1]), 2.0, None, TypeError, "n_clusters must be an int"),
    (torch.tensor([0, 1]), 2, 0, ValueError, "width must be >= 1"),
    # A cast dropped the imaginary parts; a 0-d tensor and a meta tensor reached bincount and the
    # id check, whose errors named no argument.
    (torch.tensor([0, 1, 1, 0], dtype=torch.complex64), 2, None, TypeError,
     "assignments must hold integer cluster ids, got torch.complex64"),
    (torch.tensor(1), 2, None, ValueError, r"assignments must be 1-D \[vocab\], got shape \(\)"),
    (torch.zeros(5, dtype=torch.int64, device="meta"), 2, None, ValueError, "assignments is on the meta device"),
], ids=["float", "bool", "2-D", "id-past", "id-negative", "list", "no-clusters", "float-count", "zero-width", "complex",
        "0-d", "meta"])
def test_cluster_table_refuses_bad_input_by_name(assignments, n_clusters, width, error, match):
    with pytest.raises(error, match=match):
        cluster_table(assignments, n_clusters, width)


@pytest.mark.parametrize("change,error,match", [
    (lambda e, h, t: (e, h.bfloat16(), t), TypeError, "hidden must have the embedding's dtype torch.float32"),
    (lambda e, h, t: (e, h.unsqueeze(1).expand(-1, 2, -1), t), ValueError, "hidden must be a non-empty 2-D float tensor"),
    (lambda e, h, t: (e, h[:, :3], t), ValueError, "hidden must have the embedding's hidden size 4"),
    (lambda e, h, t: (e, h, t.float()), TypeError, "cluster_tokens must hold integer token ids"),
    (lambda e, h, t: (e, h, t + 1), ValueError, "cluster_tokens holds id 8"),
    # torch's split errors had named no argument.
    (lambda e, h, t: (e, h, t, 0), ValueError, "rows_per_chunk must be >= 1, got 0"),
    (lambda e, h, t: (e, h, t, 2.5), TypeError, "rows_per_chunk must be an int, got float"),
], ids=["dtypes", "rank-3", "hidden-size", "float-table", "id-past", "no-rows-a-chunk", "float-rows-a-chunk"])
def test_best_member_logits_refuses_bad_input_by_name(change, error, match):
    embedding, hidden = _embedding(8, 4), _embedding(5, 4, seed=1)
    table = cluster_table(torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), 4)
    with pytest.raises(error, match=match):
        clustering_mod.best_member_logits(*change(embedding, hidden, table))


@pytest.mark.parametrize("args,error,match", [
    ((10.5, 4), TypeError, "vocab_size must be an int, got float"),
    (("10", 4), TypeError, "vocab_size must be an int, got str"),
    ((0, 4), ValueError, "vocab_size must be >= 1, got 0"),
    ((10, 4, None, "false"), TypeError, "strict must be a bool, got str"),
    # numpy's scalars are named with their module: "must be a bool, got bool" read as a contradiction
    ((10, 4, None, np.bool_(False)), TypeError, r"strict must be a bool, got numpy\.bool"),
    ((np.int64(10), 4), TypeError, r"vocab_size must be an int, got numpy\.int64$"),
    ((10, np.int32(4)), TypeError, r"cluster_size must be an int, got numpy\.int32$"),
])
def test_cluster_sizes_refuses_bad_input_by_name(args, error, match):
    with pytest.raises(error, match=match):
        cluster_sizes(*args)


def test_fit_max_logit_centroids_refuses_a_rank_3_hidden():
    table = cluster_table(torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), 4)
    with pytest.raises(ValueError, match="hidden must be a non-empty 2-D float tensor"):
        fit_max_logit_centroids(_embedding(8, 4), _embedding(5, 4, seed=1).unsqueeze(1).expand(-1, 2, -1), table)


@pytest.mark.parametrize("change,error,match", [
    (lambda t: t.float(), TypeError, "cluster_tokens must hold integer token ids"),
    (lambda t: t + 1, ValueError, "cluster_tokens holds id 9"),
    (lambda t: torch.cat([t, torch.full((1, t.shape[1]), -1, dtype=t.dtype)]), ValueError,
     "cluster 4 of cluster_tokens holds only padding"),
], ids=["float-table", "id-past", "empty-cluster"])
def test_fit_max_logit_centroids_refuses_a_bad_table_by_name(change, error, match):
    # An id past the vocabulary reached the gather of the member logits, an index error naming nothing.
    table = cluster_table(torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 2]), 4)
    with pytest.raises(error, match=match):
        fit_max_logit_centroids(_embedding(9, 4), _embedding(13, 4, seed=1), change(table))


def test_best_member_logits_computes_in_float64_beyond_float32s_range():
    # Only the clustering runs in float32: the member logits of float64 inputs are float64 products,
    # so rows past float32's range are no error, and scaling the rows by 2**200 and the states by
    # 2**-200 (exact in float64) gives the same logits.
    gen = torch.Generator().manual_seed(21)
    embedding = torch.randn(37, 6, generator=gen, dtype=torch.float64)
    hidden = torch.randn(11, 6, generator=gen, dtype=torch.float64)
    table = cluster_table(torch.randperm(37, generator=gen) % 5, 5)
    expected = clustering_mod.best_member_logits(embedding, hidden, table)
    scaled = clustering_mod.best_member_logits(embedding * 2.0**200, hidden * 2.0**-200, table)
    assert torch.equal(scaled, expected)


def test_a_float64_embedding_at_float32s_largest_value_is_clustered_as_its_float32_copy():
    # float32's largest finite value is in range: only values past it are refused.
    embedding = _embedding(99, 8, seed=23).double()
    embedding[5, 3], embedding[40, 1] = torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max
    got, want = (build_clusters(e, 7, iters=3, progress=False) for e in (embedding, embedding.float()))
    assert torch.equal(got.cluster_tokens, want.cluster_tokens) and torch.equal(got.raw_centroids, want.raw_centroids)


@pytest.mark.parametrize("scale", [1e25, 1e-25], ids=["length-overflows", "length-underflows"])
@pytest.mark.parametrize("rows", ["all", "one"])
def test_rows_are_clustered_whatever_their_scale(scale, rows):
    # Rows are L2-normalised: a row whose length overflowed float32 became a zero row, and one
    # under 1e-12 stayed short, so the clusters depended on the scale.
    embedding = _embedding(97, 8, seed=29)
    scaled = embedding.clone()
    picked = slice(None) if rows == "all" else slice(40, 41)
    scaled[picked] *= scale
    got, want = (build_clusters(e, 6, iters=4, seed=5, progress=False) for e in (scaled, embedding))
    assert torch.equal(got.cluster_tokens, want.cluster_tokens)
    torch.testing.assert_close(got.raw_centroids, want.raw_centroids, rtol=1e-5, atol=1e-6)


def test_unit_rows_leave_the_callers_embedding_and_zero_rows_alone():
    embedding = _embedding(10, 4, seed=30)
    embedding[2] *= 1e30
    embedding[7] = 0
    before = embedding.clone()
    unit = clustering_mod._unit_rows(embedding)
    assert torch.equal(embedding, before)
    lengths = torch.linalg.vector_norm(unit, dim=1)
    assert torch.equal(unit[7], torch.zeros(4))
    torch.testing.assert_close(lengths[torch.arange(10) != 7], torch.ones(9))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_an_embedding_of_another_dtype_is_clustered_in_float32(dtype):
    # As documented: k-means runs on the rows cast to float32, and gives float32 centroids.
    embedding = _embedding(131, 9, seed=24).to(dtype)
    got, want = (build_clusters(e, 6, iters=4, seed=3, progress=False) for e in (embedding, embedding.float()))
    assert got.raw_centroids.dtype == torch.float32
    assert torch.equal(got.cluster_tokens, want.cluster_tokens) and torch.equal(got.raw_centroids, want.raw_centroids)


def test_each_public_clustering_function_ignores_a_callers_autocast():
    # Each computes in its tensors' own dtypes (build_clusters' candidate scores, the member logits'
    # and the fit's products ran in bfloat16 under autocast); calibrate_clusters is pinned above.
    gen = torch.Generator().manual_seed(25)
    embedding, hidden = torch.randn(331, 24, generator=gen), torch.randn(97, 24, generator=gen)
    table = cluster_table(torch.randperm(331, generator=gen) % 41, 41)
    calls = [lambda: build_clusters(embedding, 7, iters=3, seed=2, progress=False).cluster_tokens,
             lambda: clustering_mod.best_member_logits(embedding, hidden, table),
             lambda: fit_max_logit_centroids(embedding, hidden, table)]
    expected = [call() for call in calls]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = [call() for call in calls]
    for index, (a, b) in enumerate(zip(expected, got)):
        assert a.dtype == b.dtype and torch.equal(a, b), index


@pytest.mark.parametrize("kwargs,error,match", [
    ({"embedding": [[1.0]]}, TypeError, "embedding must be a torch.Tensor"),
    ({"embedding": torch.zeros(4)}, ValueError, "2-D float tensor"),
    ({"embedding": torch.zeros(4, 2, dtype=torch.int64)}, ValueError, "2-D float tensor"),
    ({"embedding": torch.ones(12, 3).to(torch.float8_e5m2)}, TypeError,
     "embedding must be float16, bfloat16, float32 or float64, got torch.float8_e5m2"),
    ({"cluster_size": 2, "n_clusters": 2}, ValueError, "exactly one of cluster_size and n_clusters"),
    ({"cluster_size": 0}, ValueError, r"cluster_size must be in 1..12"),
    ({"n_clusters": 13}, ValueError, r"n_clusters must be in 1..12"),
    ({"cluster_size": 2.0}, TypeError, "cluster_size must be an int"),
    ({"iters": 0}, ValueError, "iters must be >= 1"),
    ({"seed": "1"}, TypeError, "seed must be an int"),
    ({"seed": 2**64}, ValueError, r"seed must be in -2\*\*63..2\*\*64 - 1"),
    ({"seed": -2**63 - 1}, ValueError, r"seed must be in -2\*\*63..2\*\*64 - 1"),
    ({"embedding": torch.ones(12, 3, device="meta")}, ValueError, "embedding is on the meta device"),
    ({"device": "meta"}, ValueError, "device 'meta': a meta device holds no values; clustering runs on 'cpu' or 'cuda'"),
    # torch's errors had named no argument ("Found no NVIDIA driver", "Torch not compiled with XPU").
    ({"device": "xpu"}, ValueError, "device 'xpu': clustering runs on 'cpu' or 'cuda' devices"),
    ({"device": "cuda:99"}, ValueError, "device 'cuda:99': (no CUDA device here|this machine has)"),
    ({"device": "gpu0"}, ValueError, "device must be a torch.device or a device string such as 'cpu' or 'cuda:0', got 'gpu0'"),
    ({"device": 3.5}, ValueError, "device must be a torch.device or a device string such as 'cpu' or 'cuda:0', got 3.5"),
    ({"strict": "false"}, TypeError, "strict must be a bool, got str"),
    ({"progress": "no"}, TypeError, "progress must be a bool, got str"),
    ({"embedding": torch.full((12, 3), float("nan")), "cluster_size": 4}, ValueError, "NaN or infinite"),
    # float64 values past float32's range are infinite where it clusters: NaN centroids before.
    ({"embedding": _embedding(12, 3).double().index_fill(0, torch.tensor([5]), -1e39), "cluster_size": 4}, ValueError,
     r"embedding holds values beyond float32's range \(±3\.403e\+38\), in which it is clustered, got -1e\+39 to "),
])
def test_bad_input(kwargs, error, match):
    args = {"embedding": _embedding(12, 3), "progress": False, **kwargs}
    embedding = args.pop("embedding")
    with pytest.raises(error, match=match):
        build_clusters(embedding, **args)


@pytest.mark.gpu
def test_cuda_matches_partition_rules():
    emb = _embedding(301, 12, seed=3).cuda()
    result = build_clusters(emb, 16, iters=4, progress=False)
    assert result.cluster_tokens.is_cuda and result.centroids.is_cuda
    _check_partition(result, 301)
    again = build_clusters(emb, 16, iters=4, progress=False)
    assert torch.equal(again.cluster_tokens, result.cluster_tokens)


def _planted(vocab=96, states=400, seed=0):
    """Logits decided in a 2-D subspace the states span, token rows dominated by 4 dimensions the
    states barely reach: plain k-means groups tokens by those irrelevant dimensions."""
    g = torch.Generator().manual_seed(seed)
    angle = torch.arange(vocab) * (2 * torch.pi / vocab)
    emb = torch.cat([torch.stack([angle.cos(), angle.sin()], 1), 3 * torch.randn(vocab, 4, generator=g)], 1)
    scale = torch.tensor([3.0, 3.0, 0.05, 0.05, 0.05, 0.05])
    return emb, torch.randn(states, 6, generator=g) * scale, torch.randn(states, 6, generator=g) * scale


def _agreement(clustering, emb, hidden, probes):
    head = FlashHead(emb, clustering.centroids, clustering.cluster_tokens, probes)
    return float((head.next_token(hidden) == (hidden @ emb.T).argmax(1)).float().mean())


def test_calibrated_beats_kmeans_on_a_planted_problem():
    emb, calibration, held_out = _planted()
    plain = build_clusters(emb, 8, iters=10, progress=False)
    calibrated = calibrate_clusters(emb, calibration, 8, iters=10, progress=False)
    assert calibrated.method == "calibrated" and calibrated.greedy_scoring == "raw"
    assert torch.equal(calibrated.centroids, calibrated.raw_centroids)  # ranked raw, not normalised
    plain_score, calibrated_score = _agreement(plain, emb, held_out, 2), _agreement(calibrated, emb, held_out, 2)
    assert calibrated_score >= 0.85 and calibrated_score > plain_score + 0.4, (plain_score, calibrated_score)


@pytest.mark.parametrize("vocab,size", [(96, 8), (99, 7)])
def test_calibrated_is_deterministic_with_equal_clusters(vocab, size):
    emb, calibration, _ = _planted(vocab, states=37, seed=5)
    first = calibrate_clusters(emb, calibration, size, iters=3, seed=2, progress=False)
    again = calibrate_clusters(emb, calibration, size, iters=3, seed=2, progress=False)
    assert torch.equal(first.cluster_tokens, again.cluster_tokens) and torch.equal(first.raw_centroids, again.raw_centroids)
    _check_partition(first, vocab)
    # Same sizes and padding scheme as plain k-means.
    assert torch.equal(torch.bincount(first.cluster_assignments), cluster_sizes(vocab, size)[1])


@pytest.mark.parametrize("setting", ["float64 default", "bfloat16 default", "autocast"])
def test_clusterings_are_those_of_float32_whatever_the_callers_dtype_settings(setting):
    # The fit's ridge took torch's default dtype (float64: a dtype error after k-means; bfloat16:
    # other centroids), and under autocast the products ran in bfloat16 (10 of 330 tokens moved):
    # the cache then served either to later callers.
    emb, calibration, _ = _planted(99, states=37, seed=6)
    want = [build_clusters(emb, 7, iters=3, seed=1, progress=False),
            calibrate_clusters(emb, calibration, 7, iters=3, seed=1, progress=False)]
    context = (torch.autocast("cpu", dtype=torch.bfloat16) if setting == "autocast"
               else default_dtype(torch.float64 if setting.startswith("float64") else torch.bfloat16))
    with context:
        got = [build_clusters(emb, 7, iters=3, seed=1, progress=False),
               calibrate_clusters(emb, calibration, 7, iters=3, seed=1, progress=False)]
    for a, b in zip(want, got):
        assert torch.equal(a.cluster_tokens, b.cluster_tokens) and torch.equal(a.raw_centroids, b.raw_centroids)


def test_the_calibration_whitening_does_not_depend_on_the_thread_count():
    # LAPACK's eigh moved in its last bits between 1 and 2 threads (a 576-wide moment here), which
    # flipped near-tie k-means assignments: 24 of SmolLM2's 3,072 clusters.
    from flashhead_ext.clustering import _on_one_cpu_thread

    states = torch.randn(1731, 576, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.1, 3.0, 576)
    moment = states.T @ states / states.shape[0]
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 1):
            torch.set_num_threads(count)
            results.append(_on_one_cpu_thread(torch.linalg.eigh, moment))
            assert torch.get_num_threads() == count  # restored after it
    finally:
        torch.set_num_threads(threads)
    for values, vectors in results[1:]:
        assert torch.equal(values, results[0][0]) and torch.equal(vectors, results[0][1])
    torch.testing.assert_close(results[0][1] @ torch.diag(results[0][0]) @ results[0][1].T, moment, rtol=1e-4, atol=1e-4)


def test_fitted_centroids_do_not_depend_on_the_thread_count():
    # LAPACK's solve moved them by hundreds of ulps between 1 and 2 threads.
    gen = torch.Generator().manual_seed(4)
    states = torch.randn(1500, 576, generator=gen) * torch.linspace(0.1, 3.0, 576)
    emb = torch.randn(3000, 576, generator=gen)
    table = torch.randperm(3000, generator=gen).view(1500, 2)
    threads = torch.get_num_threads()
    try:
        fits = []
        for count in (1, 2):
            torch.set_num_threads(count)
            fits.append(fit_max_logit_centroids(emb, states, table))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(fits[0], fits[1])


def test_calibrated_clusters_do_not_depend_on_the_thread_count():
    # The states' second moment and Gram matrix, sums over the states that BLAS splits among
    # threads, moved every fitted centroid in its last bits between 1 and 2 threads (2,000 states
    # of 256 here).
    gen = torch.Generator().manual_seed(5)
    emb = torch.randn(1003, 256, generator=gen)
    states = torch.randn(2000, 256, generator=gen)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(calibrate_clusters(emb, states, 16, iters=2, progress=False))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0].cluster_tokens, results[1].cluster_tokens)
    assert torch.equal(results[0].raw_centroids, results[1].raw_centroids)


def test_fitted_centroids_solve_the_ridge_least_squares():
    emb, calibration, _ = _planted(48, states=50, seed=1)
    table = build_clusters(emb, 6, iters=2, progress=False).cluster_tokens
    fitted = fit_max_logit_centroids(emb, calibration, table, ridge=0.01)
    # Brute force: each cluster's best member logit per state, then the normal equations.
    targets = torch.stack([(calibration @ emb[row].T).amax(1) for row in table.long()], 1)
    gram = calibration.T @ calibration
    expected = torch.linalg.solve(gram + 0.01 * gram.diagonal().mean() * torch.eye(6), calibration.T @ targets).T
    torch.testing.assert_close(fitted, expected, rtol=1e-4, atol=1e-4)


def test_calibrated_centroids_are_the_fit_on_their_own_clusters():
    # calibrate_clusters hands the fit the Gram matrix it computed for the whitening; a scaled
    # one (the moment) would change the ridge's weight, not the checks.
    gen = torch.Generator().manual_seed(6)
    emb = torch.randn(203, 40, generator=gen)
    states = torch.randn(150, 40, generator=gen) * torch.linspace(0.2, 2.0, 40)
    calibrated = calibrate_clusters(emb, states, 7, iters=2, ridge=0.3, progress=False)
    assert torch.equal(calibrated.raw_centroids, fit_max_logit_centroids(emb, states, calibrated.cluster_tokens, ridge=0.3))


def test_calibration_with_fewer_states_than_the_hidden_size_warns():
    emb = _embedding(24, 6)
    with pytest.warns(UserWarning, match="5 states for hidden size 6; their second moment has rank at most 5, .* "
                                         f"Record at least {MIN_STATES_PER_DIM * 6} states") as caught:
        calibrate_clusters(emb, _embedding(5, 6, seed=1), 4, iters=1, progress=False)
    assert caught[0].filename == __file__  # the caller's line, not the autocast wrapper's in ops.py


def test_calibration_with_few_states_per_hidden_dimension_warns():
    # Random states: this checks where the warning starts, not the quality it warns about.
    emb, enough = _embedding(24, 6), MIN_STATES_PER_DIM * 6
    for states in (6, enough - 1):  # as many as the hidden size: full rank, still too few
        with pytest.warns(UserWarning, match=f"{states} states for hidden size 6, fewer than {MIN_STATES_PER_DIM}x it "
                                             f"\\({enough}\\); .* less often than plain k-means. .* build_clusters") as caught:
            calibrate_clusters(emb, _embedding(states, 6, seed=1), 4, iters=1, progress=False)
        assert len(caught) == 1 and "second moment" not in str(caught[0].message)  # the rank warning is for fewer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calibrate_clusters(emb, _embedding(enough, 6, seed=1), 4, iters=1, progress=False)  # enough: no warning


@pytest.mark.parametrize("kwargs,error,match", [
    ({"hidden": [[1.0]]}, TypeError, "hidden must be a torch.Tensor"),
    ({"hidden": torch.zeros(5, 4)}, ValueError, "hidden must have the embedding's hidden size 3"),
    ({"hidden": torch.zeros(0, 3)}, ValueError, "hidden must be a non-empty 2-D float tensor"),
    # torch.isfinite's NotImplementedError for e4m3 named nothing.
    ({"hidden": torch.ones(9, 3).to(torch.float8_e4m3fn)}, TypeError,
     "hidden must be float16, bfloat16, float32 or float64, got torch.float8_e4m3fn"),
    ({"hidden": torch.full((5, 3), float("inf"))}, ValueError, "hidden holds NaN or infinite"),
    ({"hidden": torch.full((5, 3), 1e300, dtype=torch.float64)}, ValueError, "hidden holds values beyond float32's range"),
    ({"hidden": torch.zeros(9, 3)}, ValueError, "hidden gives a singular fit .* the states are zero or too small"),
    # LAPACK's "failed to converge" before: their squares overflow float32.
    ({"hidden": torch.full((9, 3), 3e19)}, ValueError, r"the second moment of hidden .* overflows float32: .* \(up to 3e\+19\)"),
    ({"ridge": 0.0}, ValueError, "ridge must be a finite number > 0"),
    ({"ridge": float("inf")}, ValueError, "ridge must be a finite number > 0"),
    ({"ridge": 1e300}, ValueError, r"the fitted centroids are not finite: ridge \(1e\+300\)"),
    ({"ridge": 10**400}, ValueError, "ridge must be a finite number > 0"),  # past float's range
    # Told it was not finite and > 0.
    ({"ridge": torch.tensor(1e-3)}, TypeError, r"ridge must be a Python float or int, got torch.Tensor \(convert it with float\(\)\)"),
    ({"ridge": "0.001"}, TypeError, "ridge must be a Python float or int, got str"),
    ({"cluster_size": 0}, ValueError, r"cluster_size must be in 1..12"),
    ({"device": torch.device("meta")}, ValueError, "device 'meta': a meta device holds no values"),
    # Checked before the whitening too, not by build_clusters after it.
    ({"iters": 0}, ValueError, "iters must be >= 1"),
    ({"seed": "1"}, TypeError, "seed must be an int"),
    ({"cluster_size": 5, "strict": True}, ValueError, "not a multiple of cluster_size=5 and strict=True"),
    ({"strict": 1}, TypeError, "strict must be a bool, got int"),
    ({"device": "xpu"}, ValueError, "device 'xpu': clustering runs on 'cpu' or 'cuda' devices"),
])
def test_calibrated_bad_input(kwargs, error, match):
    args = {"hidden": _embedding(9, 3, seed=1), "cluster_size": 4, "progress": False, **kwargs}
    with pytest.raises(error, match=match):
        calibrate_clusters(_embedding(12, 3), args.pop("hidden"), **args)
