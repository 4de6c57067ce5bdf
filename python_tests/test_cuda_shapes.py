"""GPU only: the issue-3 shapes (large D, C up to 16384 and not a power of two, b in 8/16/32,
p up to 1024, B up to 64) on a representative subset, against the float32 reference on the GPU.

Inputs are drawn on the GPU (seconds for a 2 GB embedding on the CPU, milliseconds there); the
comparators allow a different id only at a near-tie of the float32 reference (helpers.check_*).
"""
import concurrent.futures
import re
import threading

import pytest
import torch

import reference as ref
from flashhead_ext import BUILD_INFO, ops
from helpers import (Shape, assert_same_ids, assert_values_close, capture, check_decode_greedy, check_decode_sample,
                     check_ranked_selection, make_problem)

pytestmark = pytest.mark.gpu

CASES = [
    (Shape(B=1, D=4096, C=16000, b=16, p=1024, pad=9, extras=True), torch.bfloat16),  # V = 255991
    (Shape(B=64, D=1024, C=9496, b=16, p=593, extras=True), torch.bfloat16),          # Qwen3-0.6B, p = C/16
    (Shape(B=8, D=2048, C=8017, b=16, p=256, pad=15), torch.float16),
    (Shape(B=16, D=576, C=3073, b=32, p=97, pad=31, extras=True), torch.float32),
    (Shape(B=3, D=1024, C=16383, b=8, p=1), torch.bfloat16),
    (Shape(B=64, D=4096, C=4099, b=8, p=64, extras=True), torch.float32),
]
case_params = pytest.mark.parametrize("shape,dtype", CASES, ids=[f"{s}-{d}" for s, d in CASES])
T = 0.9


def problem_for(shape, dtype):
    return make_problem(shape, dtype, "cuda", build_on_device=True)


@case_params
def test_select_clusters_large(shape, dtype):
    problem = problem_for(shape, dtype)
    ids, scores = ops.select_clusters(problem.hidden, problem.centroids, problem.probes)
    ref_scores = ref.scores(problem.hidden, problem.centroids)
    check_ranked_selection(ids, ref_scores, problem.probes, problem.score_tol(), exact=False)
    assert_values_close(scores, ref_scores.gather(1, ids.long()), problem.score_tol(), "scores")


@case_params
def test_gather_and_logits_large(shape, dtype):
    problem = problem_for(shape, dtype)
    cluster_ids = ref.select_clusters(problem.hidden, problem.centroids, problem.probes)[0]
    candidates = ops.gather_candidates(cluster_ids, problem.cluster_tokens, problem.extra_ids)
    assert_same_ids(candidates, ref.gather_candidates(cluster_ids, problem.cluster_tokens, problem.extra_ids))
    logits = ops.candidate_logits(problem.hidden, problem.embedding, candidates)
    assert_values_close(logits, ref.candidate_logits(problem.hidden, problem.embedding, candidates),
                        problem.logit_tol(), "logits")


@case_params
def test_decode_greedy_large(shape, dtype):
    problem = problem_for(shape, dtype)
    tokens = ops.decode_greedy(*problem.args())
    check_decode_greedy(tokens, problem, exact=False)
    out = torch.empty(shape.B, 3, dtype=torch.int64, device="cuda")[:, 1]
    ops.decode_greedy(*problem.args(), out=out)
    assert torch.equal(out, tokens)


def check_sampling(problem, seed):
    """sample_clusters and decode_sample at temperature T against the Philox reference."""
    ids, _ = ops.sample_clusters(problem.hidden, problem.centroids, problem.probes, T, seed=seed)
    trace = ref.sample_clusters(problem.hidden, problem.centroids, problem.probes, T, seed)
    check_ranked_selection(ids, trace.cluster_keys, problem.probes, problem.score_tol() / T + 1e-5, exact=False)
    tokens, logprobs = ops.decode_sample(*problem.args()[:5], T, problem.extra_ids, seed=seed)
    check_decode_sample(tokens, logprobs, problem, T, seed, exact=False)


@case_params
def test_sampling_large(shape, dtype):
    check_sampling(problem_for(shape, dtype), seed=2 + shape.C)


# Greedy batches of 16 to 64 rows that make 2 choices or more a cluster (B p >= 2 C; 7/4 with three
# claimed blocks an SM, bf16 rows up to about 1,180 values), or 5/4 where an embedding of rows up to
# 2 KB, or of rows three blocks an SM take, is more than twice the L2, decode by claimed cluster on
# sm_90, where the rows can be staged (decode.cu): a cluster is read once for every 4 rows that
# chose it. The first four shapes take that path (a padded table, extra ids, B at both bounds,
# 16-bit and float32 rows; the fourth at 1.27 choices, its 164 MB embedding more than twice an
# H100's or H200's L2); over an 18 MB embedding bf16 rows take it at 1.84 choices and not at 1.60,
# fp16 ones (two blocks an SM) not at 1.84; 3 KB rows over a 148 MB embedding need 2 choices (2.01
# take it, 1.60 do not), 2.3 KB rows (three blocks) over a 136 MB one 5/4 (1.50 takes it); B = 65
# and B = 15 take the row-by-row kernel. On sm_90 (the H100 and H200 the bounds were set on, with
# 50-60 MiB of L2) the test checks which kernel ran. Rows repeat in runs of `repeat`: with 2 nearly
# every claimed cluster has two rows or more and the kernel's second row of a pair is used; with 20
# most clusters have more rows than one group holds. Repeated rows' tokens must match.
CLAIMED = [
    (Shape(B=16, D=576, C=301, b=16, p=57, pad=5, extras=True), torch.bfloat16, True),
    (Shape(B=64, D=1024, C=997, b=8, p=200), torch.float16, True),
    (Shape(B=33, D=256, C=129, b=32, p=100, pad=31, extras=True), torch.float32, True),
    (Shape(B=16, D=1024, C=5003, b=16, p=397, extras=True), torch.bfloat16, True),
    (Shape(B=16, D=576, C=1001, b=16, p=115), torch.bfloat16, True),
    (Shape(B=16, D=576, C=1001, b=16, p=115), torch.float16, False),
    (Shape(B=16, D=576, C=1001, b=16, p=100), torch.bfloat16, False),
    (Shape(B=16, D=1536, C=3001, b=16, p=376), torch.bfloat16, True),
    (Shape(B=16, D=1536, C=3001, b=16, p=300), torch.bfloat16, False),
    (Shape(B=16, D=1152, C=3700, b=16, p=347), torch.bfloat16, True),
    (Shape(B=65, D=256, C=129, b=16, p=100), torch.bfloat16, False),
    (Shape(B=15, D=576, C=301, b=16, p=57, extras=True), torch.bfloat16, False),
]
claimed_params = pytest.mark.parametrize("shape,dtype,claimed", CLAIMED, ids=[f"{s}-{d}" for s, d, _ in CLAIMED])


def claimed_blocks_per_sm(shape, dtype) -> int:
    """The claimed kernel's instance on an H100 or H200 (228 KB of shared memory an SM): bf16 rows
    whose staged buffers (64 D bytes a block) fit three blocks, up to about 1,180 values, run the
    three-block instance, wider bf16 rows and other dtypes the two-block one."""
    return 3 if dtype == torch.bfloat16 and shape.D <= 1180 else 2


MARKER_KERNEL = "spin_kernel"  # torch.cuda._sleep's


def kernels_run(call, calls: int = 3) -> set:
    """The names of the CUDA kernels that one run of `call` launches (the same kernels every run), or
    none where the profiler kept no whole run. The profiler may drop the kernel records at the start
    of a session (pytorch/pytorch#192021): records before some time, so a run whose first kernel it
    dropped would look like a run of other kernels. The runs go between marker kernels, and only
    those after the first marker kept count."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            torch.cuda._sleep(1)
            call()
        torch.cuda._sleep(1)
        torch.cuda.synchronize()
    kernels = sorted((event.time_range.start, event.name) for event in prof.events()
                     if event.device_type == torch.autograd.DeviceType.CUDA)
    markers = [start for start, name in kernels if MARKER_KERNEL in name]
    assert markers or not kernels, f"no {MARKER_KERNEL} among {kernels}"  # the last kernel, if any was kept
    if len(markers) < 2:
        return set()
    return {name for start, name in kernels if markers[0] < start < markers[-1] and MARKER_KERNEL not in name}


def runs_sm90_code() -> bool:
    """Whether this GPU runs the kernels' sm_90 code, whose bulk copies the staged, claimed and early
    paths need: an sm_90 GPU and sm_90 in the build. A build of sm_80's PTX alone (device_run.sh jit)
    runs there without them, so on other paths, rightly."""
    archs = (BUILD_INFO.CUDA_ARCH_LIST or "").replace(";", " ").split()
    sm90_built = any(arch.split("+")[0].rstrip("af") in ("9.0", "Hopper") for arch in archs)
    return torch.cuda.get_device_capability() == (9, 0) and sm90_built


def on_sm90_with_132_sms() -> bool:
    """The H100s and H200s the paths' bounds were set on, running their sm_90 code."""
    return runs_sm90_code() and torch.cuda.get_device_properties(0).multi_processor_count == 132


@pytest.mark.parametrize("repeat", [1, 2, 20])
@claimed_params
def test_decode_by_claimed_cluster(shape, dtype, claimed, repeat):
    problem = problem_for(shape, dtype)
    first_of_run = torch.arange(shape.B, device=problem.hidden.device) // repeat * repeat
    problem = problem.with_(hidden=problem.hidden[first_of_run].clone())
    tokens = ops.decode_greedy(*problem.args())
    check_decode_greedy(tokens, problem, exact=False)
    assert torch.equal(tokens, tokens[first_of_run])
    if runs_sm90_code():
        names = kernels_run(lambda: ops.decode_greedy(*problem.args()))
        if names:  # none where the profiler cannot attach (e.g. the suite under ncu or nsys)
            assert any("decode_candidates_kernel" in n or "decode_claimed_kernel" in n for n in names), names
            assert any("decode_claimed_kernel" in n for n in names) == claimed, names
            instances = {int(m.group(1)) for m in (re.search(r"decode_claimed_kernel<[^,>]*,\s*(?:\(int\))?(\d+)>", n)
                                                   for n in names) if m}
            assert instances == ({claimed_blocks_per_sm(shape, dtype)} if claimed else set()), names
    # No host sync, and a graph (its claims' memset a node) gives the eager tokens at every replay.
    check_sync_free_and_replayed(lambda: ops.decode_greedy(*problem.args()), tokens)


def check_sync_free_and_replayed(call, expected):
    """`call` runs with no host sync and, captured in a graph, gives `expected` at every replay."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph, captured = capture(call)
    for _ in range(2):
        captured.fill_(-7)
        graph.replay()
        assert torch.equal(captured, expected)
    assert torch.equal(again, expected)


# Greedy batch 1 scores some clusters while the selection runs (decode.cuh, EarlyClusters): where
# each candidate warp takes one slot group (p b + E <= 32 * SMs, rows not staged) and a slice of
# 3 C / (3/4 of the blocks; 1/2, or as many as fit, where the selection keeps candidates) scores
# fits 256 ids. On a 132-SM GPU the first seven shapes do (the
# Qwen3-0.6B head at p = 256, a padded table with extra ids, clusters of 32 over two blocks,
# clusters of 8 at the widest slice, rows without 16-byte vectors, clusters of 5 and of 1); p =
# 593 there stages rows and p = 32 makes slices of 1,187 scores, so those two do not.
EARLY = [
    (Shape(B=1, D=1024, C=9496, b=16, p=256), torch.bfloat16, True),
    (Shape(B=1, D=576, C=3001, b=16, p=200, pad=7, extras=True), torch.float16, True),
    (Shape(B=1, D=2048, C=4099, b=32, p=100, pad=3), torch.float32, True),
    (Shape(B=1, D=1152, C=16384, b=8, p=512), torch.bfloat16, True),
    (Shape(B=1, D=1023, C=2000, b=16, p=128, extras=True), torch.bfloat16, True),
    (Shape(B=1, D=576, C=2001, b=5, p=400, pad=3, extras=True), torch.float16, True),
    (Shape(B=1, D=1024, C=4000, b=1, p=2000), torch.bfloat16, True),
    (Shape(B=1, D=1024, C=9496, b=16, p=593), torch.bfloat16, False),
    (Shape(B=1, D=1024, C=9496, b=16, p=32), torch.bfloat16, False),
]


def early_instance_ran(names) -> bool:
    return any(re.search(r"decode_candidates_kernel<[^>]*,\s*(?:true|\(bool\)1)>", n) for n in names)


@pytest.mark.parametrize("shape,dtype,early", EARLY, ids=[f"{s}-{d}" for s, d, _ in EARLY])
def test_decode_greedy_early_clusters(shape, dtype, early):
    # Integer values: every sum is exact, so the token must be the reference's, ties included.
    problem = make_problem(shape, dtype, "cuda", integer=True, build_on_device=True)
    hidden = problem.hidden[0]
    # The best cluster by far is rank 0 of its slice, so always scored early, and chosen; one of its
    # tokens gets the best chosen logit: a dropped early best changes the token.
    centroids = problem.centroids.clone()
    top = int(torch.randint(0, shape.C, (1,), generator=torch.Generator().manual_seed(shape.C)))
    centroids[top] = hidden
    embedding = problem.embedding.clone()
    members = problem.cluster_tokens[top][problem.cluster_tokens[top] >= 0].long()
    embedding[members[-1]] = (hidden * 10).to(dtype)
    # Tokens of clusters ranked well past p (extra ids aside) get logits far above every other: a
    # cluster scored early but not chosen must not reach the token.
    scores = ref.scores(problem.hidden, centroids)[0]
    left_out = scores.argsort(descending=True)[shape.p + 16:]
    planted = problem.cluster_tokens[left_out].flatten().long()
    planted = planted[planted >= 0]
    if problem.extra_ids is not None:
        planted = planted[~torch.isin(planted, problem.extra_ids.long())]
    embedding[planted] = (hidden * 50).to(dtype)
    problem = problem.with_(centroids=centroids, embedding=embedding)
    tokens = ops.decode_greedy(*problem.args())
    check_decode_greedy(tokens, problem, exact=True)
    if on_sm90_with_132_sms():
        names = kernels_run(lambda: ops.decode_greedy(*problem.args()))
        if names:
            assert early_instance_ran(names) == early, names
    check_sync_free_and_replayed(lambda: ops.decode_greedy(*problem.args()), tokens)
    # Replayed on other hidden states and back: no list entry, cluster best or block best stored
    # for the states before may be taken (the scoring kernel presets them every call).
    static = problem.hidden.clone()
    graph, captured = capture(lambda: ops.decode_greedy(static, *problem.args()[1:]))
    other = make_problem(shape, dtype, "cuda", seed=1, integer=True, build_on_device=True).hidden
    for states in (problem.hidden, other, problem.hidden):
        static.copy_(states)
        graph.replay()
        check_decode_greedy(captured, problem.with_(hidden=states), exact=True)
    # Eager calls on a used workspace: the caching allocator hands the op freed blocks, here ones
    # filled with all-ones bytes (a best not preset would read as the largest, token 0) or zeros
    # (a list entry not preset would read as cluster 0); the GPU sleeps first so that the calls queue.
    for fill in (0xFF, 0x00):
        for states in (other, problem.hidden):
            leave_stale_bytes(fill)
            torch.cuda._sleep(1_000_000)
            check_decode_greedy(ops.decode_greedy(states, *problem.args()[1:]), problem.with_(hidden=states), exact=True)


def leave_stale_bytes(fill=None, generator=None):
    """Leaves one whole 2 MiB segment of the caching allocator's small-block pool free and filled with
    byte ``fill``, or where None with random bytes drawn from ``generator``, so that an op's next small
    buffers (its workspace) start out holding them."""
    torch.cuda.empty_cache()
    shape = (1 << 20,)
    junk = [torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=generator) if fill is None
            else torch.full(shape, fill, dtype=torch.uint8, device="cuda") for _ in range(2)]
    del junk


# Batch 1 selects from the scoring blocks' kept candidates where they pay (block_candidates.cuh; on
# a 132-SM GPU the first four shapes: the Qwen3-0.6B head at p = 256, clusters of 8 over 16,384
# at p = 33 with extra ids, two centroid rows an item at p = 100, and clusters of 8 at p = 512,
# whose greedy decode keeps none, as half its candidate blocks' early slices would not fit; p =
# 1024 there keeps none) and from the whole row where they fall short. Rows: random integers; all
# scores equal (no candidate passes the largest cutoff); p - 1 scores far above the rest and three
# tied next (the p-th key ties keys the candidates leave unordered, so ids decide). The last two
# come through a one-hot hidden row, so every score is its centroid's first value, exactly.
# (shape, dtype, kept by select_clusters, kept by decode_greedy)
KEPT = [
    (Shape(B=1, D=1024, C=9496, b=16, p=256), torch.bfloat16, True, True),
    (Shape(B=1, D=1152, C=16384, b=8, p=33, pad=5, extras=True), torch.float32, True, True),
    (Shape(B=1, D=576, C=4099, b=32, p=100, pad=3), torch.float16, True, True),
    (Shape(B=1, D=1152, C=16384, b=8, p=512), torch.bfloat16, True, False),
    (Shape(B=1, D=1024, C=9496, b=16, p=1024), torch.bfloat16, False, False),
]


def kept_instances_ran(names) -> bool:
    # centroid_scores_kernel<T, TC, RB, ROWS, kVec, kKeep>
    keeps = any(re.search(r"centroid_scores_kernel<[^>]*,\s*(?:true|\(bool\)1)>", n) for n in names)
    # select_kernel<kCached, kStable, kFromCandidates, kIdsOnly>
    selects = any(re.search(r"select_kernel<[^,>]*,[^,>]*,\s*(?:true|\(bool\)1)\s*,", n) for n in names)
    assert keeps == selects, names
    return selects


def first_score_rows(problem, values):
    """``problem`` with scores[0, c] = values[c] exactly: a one-hot hidden row on the first value."""
    hidden = torch.zeros_like(problem.hidden)
    hidden[:, 0] = 1
    centroids = problem.centroids.clone()
    centroids[:, 0] = values.to(centroids.device, centroids.dtype)
    return problem.with_(hidden=hidden, centroids=centroids)


@pytest.mark.parametrize("row", ["random", "equal", "tied_at_p"])
@pytest.mark.parametrize("shape,dtype,kept_select,kept_greedy", KEPT, ids=[f"{s}-{d}" for s, d, _, _ in KEPT])
def test_batch1_selection_from_kept_candidates(shape, dtype, kept_select, kept_greedy, row):
    problem = make_problem(shape, dtype, "cuda", integer=True, build_on_device=True)
    generator = torch.Generator().manual_seed(shape.C + shape.p)
    if row == "equal":
        problem = first_score_rows(problem, torch.full((shape.C,), 3.0))
    elif row == "tied_at_p":
        values = torch.randint(-50, 50, (shape.C,), generator=generator).float()
        order = torch.randperm(shape.C, generator=generator)
        values[order[:shape.p - 1]] = 200.0
        values[order[shape.p - 1:shape.p + 2]] = 100.0
        problem = first_score_rows(problem, values)
    ref_scores = ref.scores(problem.hidden, problem.centroids)
    ids, scores = ops.select_clusters(problem.hidden, problem.centroids, problem.probes)
    check_ranked_selection(ids, ref_scores, problem.probes, problem.score_tol(), exact=True)
    assert_values_close(scores, ref_scores.gather(1, ids.long()), problem.score_tol(), "scores")
    tokens = ops.decode_greedy(*problem.args())
    check_decode_greedy(tokens, problem, exact=True)
    check_sampling(problem, seed=5 + shape.C)
    if on_sm90_with_132_sms():
        for call, kept in ((lambda: ops.select_clusters(problem.hidden, problem.centroids, problem.probes), kept_select),
                           (lambda: ops.decode_greedy(*problem.args()), kept_greedy)):
            names = kernels_run(call)
            if names:
                assert kept_instances_ran(names) == kept, names
    check_sync_free_and_replayed(lambda: ops.decode_greedy(*problem.args()), tokens)


# Batch 1 on the kept-candidate and early-cluster paths with what a head may meet there, on a workspace
# of random stale bytes: scores NaN, +-inf and -0 among repeated values ("special": each score is its
# centroid's first value, exact in the dtype), table entries outside the vocabulary (negative, V and
# past it) in a tenth of the slots, NaN rows in a twentieth of the embedding, extra ids out of range,
# and p up to C. On a 132-SM GPU the decode takes: kept candidates and early clusters (the Qwen3-0.6B
# head; 4 centroid rows a warp at 9,505 clusters), kept candidates only (4 rows a warp, rows without
# 16-byte vectors), early clusters only (clusters of one at p = C - 1 and p = C), neither (p = C - 1).
# (shape, dtype, kept by decode_greedy, early clusters)
EDGES = [
    (Shape(B=1, D=1024, C=9496, b=16, p=256, pad=11, extras=True), torch.bfloat16, True, True),
    (Shape(B=1, D=576, C=9505, b=16, p=226, pad=5, extras=True), torch.float16, True, True),
    (Shape(B=1, D=77, C=10007, b=16, p=333), torch.float32, True, False),
    (Shape(B=1, D=128, C=2000, b=1, p=1999), torch.bfloat16, False, True),
    (Shape(B=1, D=1024, C=700, b=1, p=700, extras=True), torch.bfloat16, False, True),
    (Shape(B=1, D=576, C=3001, b=8, p=3000, pad=3, extras=True), torch.float16, False, False),
]


def with_edge_values(problem, shape, dtype, special_scores, g):
    """``problem`` with the masked table slots, NaN embedding rows and out-of-range extra ids above,
    and with ``special_scores`` the scores too."""
    draw = lambda n, values: torch.tensor(values, device="cuda")[torch.randint(0, len(values), (n,), generator=g,
                                                                               device="cuda")]
    if special_scores:
        scores = torch.randn(shape.C, generator=g, device="cuda").to(dtype).float()
        scores[:shape.C // 8] = scores[shape.C // 8:shape.C // 8 * 2]
        specials = torch.randint(0, shape.C, (shape.C // 8,), generator=g, device="cuda")
        scores[specials] = draw(specials.numel(), [float("nan"), float("inf"), -float("inf"), -0.0])
        problem = first_score_rows(problem, scores)
    table = problem.cluster_tokens.clone()
    masked = torch.rand(table.shape, generator=g, device="cuda") < 0.1
    table[masked] = draw(int(masked.sum()), [-5, shape.V, shape.V + 7, 1 << 30]).to(table.dtype)
    embedding = problem.embedding.clone()
    embedding[torch.randint(0, shape.V, (shape.V // 20 + 1,), generator=g, device="cuda")] = float("nan")
    extra = problem.extra_ids
    if extra is not None:
        extra = torch.cat([extra, torch.tensor([-2, shape.V + 1], dtype=extra.dtype, device="cuda")])
    return problem.with_(cluster_tokens=table, embedding=embedding, extra_ids=extra)


@pytest.mark.parametrize("scores", ["integers", "special"])
@pytest.mark.parametrize("shape,dtype,kept,early", EDGES, ids=[f"{s}-{d}" for s, d, _, _ in EDGES])
def test_batch1_kept_and_early_paths_at_edge_values(shape, dtype, kept, early, scores):
    problem = make_problem(shape, dtype, "cuda", integer=True, build_on_device=True)
    g = torch.Generator("cuda").manual_seed(shape.C + shape.p)
    problem = with_edge_values(problem, shape, dtype, scores == "special", g)
    ref_scores = ref.scores(problem.hidden, problem.centroids)
    for _ in range(3):
        leave_stale_bytes(generator=g)
        check_decode_greedy(ops.decode_greedy(*problem.args()), problem, exact=True)
        leave_stale_bytes(generator=g)
        ids, values = ops.select_clusters(problem.hidden, problem.centroids, problem.probes)
        check_ranked_selection(ids, ref_scores, problem.probes, problem.score_tol(), exact=True)
        assert_values_close(values, ref_scores.gather(1, ids.long()), 0.0, "scores")
    if on_sm90_with_132_sms():
        names = kernels_run(lambda: ops.decode_greedy(*problem.args()))
        if names:
            assert kept_instances_ran(names) == kept, names
            assert early_instance_ran(names) == early, names


@pytest.mark.parametrize("shape,dtype", [c[:2] for c in CLAIMED[:2]], ids=[f"{s}-{d}" for s, d, _ in CLAIMED[:2]])
def test_decode_by_claimed_cluster_fp8_centroids(shape, dtype):
    problem, centroids, scale = problem_for(shape, dtype).with_fp8_centroids()
    head = (problem.hidden, centroids, problem.cluster_tokens, problem.embedding, problem.probes, problem.extra_ids)
    check_decode_greedy(ops.decode_greedy(*head, centroid_scale=scale), problem, exact=False)


def ops_centroids(problem, fp8):
    """(problem, the centroids and scale the ops take): fp8 ones quantized from the problem's, which
    the returned problem holds dequantized for the reference."""
    return problem.with_fp8_centroids() if fp8 else (problem, problem.centroids, None)


def check_all_scores(problem, centroids, scale, exact=False):
    # p = C: every score is checked (one written twice or not at all would show).
    clusters = centroids.shape[0]
    ids, scores = ops.select_clusters(problem.hidden, centroids, clusters, centroid_scale=scale)
    ref_scores = ref.scores(problem.hidden, problem.centroids)
    check_ranked_selection(ids, ref_scores, clusters, problem.score_tol(), exact=exact)
    assert_values_close(scores, ref_scores.gather(1, ids.long()), problem.score_tol(), "scores")


def check_every_score(problem, centroids, scale, exact=False):
    # Every score, then the greedy and the sampled decode (the Gumbel keys).
    check_all_scores(problem, centroids, scale, exact)
    head = (problem.hidden, centroids, problem.cluster_tokens, problem.embedding, problem.probes)
    check_decode_greedy(ops.decode_greedy(*head, centroid_scale=scale), problem, exact=exact)
    seed = 5 + centroids.shape[0]
    tokens, logprobs = ops.decode_sample(*head, T, seed=seed, centroid_scale=scale)
    check_decode_sample(tokens, logprobs, problem, T, seed, exact=exact)


# The CUDA-core scoring kernel's instances: a batch of one tile (1, 2, 3-4 or 5-8 rows with bf16
# centroids) has each warp score 2 to 5 centroid rows at once, whichever leaves the busiest warp of
# the resident grid the fewest (centroid_scores.cu). On a 132-SM GPU (H100 SXM, H200) these cluster
# counts pick, at batch 1, 2, 3, 4 and 3 rows (the last with two items a warp); at batch 2, 2, 3 and
# 4; at batches 3-4 (a tile of 4), 3, 4 and 5; at batches 5-8 (a tile of 8), 2 and 3 (the 3 with
# two items a warp); every one with a partial last item. Batches 3 and 5 leave tile rows empty; with fp8
# centroids batches 5 and 8 span tiles of 4. D 1001 takes the instances without 16-byte vectors.
# Hidden rows are bf16, but float32 where bf16 ones with 16-byte vectors would take tensor cores
# (batches from 5, from 3 with fp8 centroids; test_tensor_core_scoring): float32 centroids then
# stand for the bf16 ones.
@pytest.mark.parametrize("centroid_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("batch,clusters", [(1, 6001), (1, 9496), (1, 11999), (1, 16001), (2, 6001), (2, 9496),
                                            (2, 11999), (3, 6001), (4, 8001), (4, 9496), (5, 3001), (8, 9496)])
@pytest.mark.parametrize("dim", [1024, 1001])
def test_scoring_instances(dim, batch, clusters, centroid_dtype):
    fp8 = centroid_dtype == torch.float8_e4m3fn
    on_tensor_cores = dim % 16 == 0 and batch >= (3 if fp8 else 5)
    problem = problem_for(Shape(B=batch, D=dim, C=clusters, b=16, p=256),
                          torch.float32 if on_tensor_cores else torch.bfloat16)
    check_every_score(*ops_centroids(problem, fp8))


# The tensor-core scoring (bf16 or fp16 batches past 4 rows, past 2 with fp8 centroids; 16-byte
# rows): one, two, four or eight n-tiles of 8 batch rows a block (the last partial; fp8 up to four),
# larger batches in several chunks; tiles of 16 centroid rows (a partial last one, or a single row);
# D split over the block's 4 warps in blocks of 4 lanes' 16 bytes (a partial last block at D 1008,
# warps without a block at D 16 and 64). Integer-valued inputs make every sum exact: there the ids
# must match exactly, ties included.
@pytest.mark.parametrize("centroid_dtype", ["hidden", torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("batch,clusters,dim", [(3, 997, 1024), (5, 997, 1024), (8, 16, 64), (9, 1, 1008),
                                                (17, 4099, 576), (33, 31, 2048), (64, 9496, 1024), (130, 257, 16)])
@pytest.mark.parametrize("integer", [False, True], ids=["random", "integer"])
def test_tensor_core_scoring(batch, clusters, dim, dtype, centroid_dtype, integer):
    shape = Shape(B=batch, D=dim, C=clusters, b=4, p=min(clusters, 37))
    problem = make_problem(shape, dtype, "cuda", build_on_device=not integer, integer=integer)
    check_every_score(*ops_centroids(problem, centroid_dtype == torch.float8_e4m3fn), exact=integer)


# More batch rows than one launch's grid holds (65,535 chunks of 64 rows; of 32 with fp8 centroids):
# the tensor-core scoring goes in slices, and each row's Gumbel noise keeps its absolute index.
@pytest.mark.parametrize("centroid_dtype", ["hidden", torch.float8_e4m3fn], ids=str)
def test_tensor_core_scoring_in_slices(centroid_dtype):
    fp8 = centroid_dtype == torch.float8_e4m3fn
    problem = problem_for(Shape(B=65535 * (32 if fp8 else 64) + 3, D=16, C=2, b=1, p=1), torch.bfloat16)
    problem, centroids, scale = ops_centroids(problem, fp8)
    check_all_scores(problem, centroids, scale)
    seed = 11
    ids, _ = ops.sample_clusters(problem.hidden, centroids, 1, T, seed=seed, centroid_scale=scale)
    trace = ref.sample_clusters(problem.hidden, problem.centroids, 1, T, seed)
    check_ranked_selection(ids, trace.cluster_keys, 1, problem.score_tol() / T + 1e-5, exact=False)


def slots_past_one_pass():
    # More slots than one pass of the candidate grid covers at batch 1 (2 blocks an SM of 16 slots):
    # each warp has several slot groups, so rows are staged where the buffers fit.
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count * 2 * 16 * 4 + 7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("dim", [576, 1024, 1160])
def test_candidate_rows_staged_or_in_registers_agree(dim, dtype):
    # A row with more slots than one pass of the grid covers is staged in shared memory by bulk
    # copies on sm_90 (where two blocks of buffers fit: not float32 at D = 1024); its first 1,000
    # slots alone fit one pass and go through registers. Each lane sums the same pieces in the
    # same order either way, so the logits are bitwise equal.
    gen = torch.Generator(device="cuda").manual_seed(dim)
    vocab = 30011
    embedding = torch.randn(vocab, dim, generator=gen, device="cuda").to(dtype)
    hidden = torch.randn(1, dim, generator=gen, device="cuda").to(dtype)
    candidates = torch.randint(-3, vocab + 3, (1, slots_past_one_pass()), generator=gen, device="cuda", dtype=torch.int32)
    many = ops.candidate_logits(hidden, embedding, candidates)
    few = ops.candidate_logits(hidden, embedding, candidates[:, :1000].contiguous())
    assert torch.equal(many[:, :1000], few)
    assert_values_close(many, ref.candidate_logits(hidden, embedding, candidates), 1e-3 * dim ** 0.5, "logits")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                    reason="the staged instance (bulk copies) runs on sm_90 and later only")
def test_staged_rows_launched_from_two_threads_at_once():
    # A kernel's shared-memory limit is one per process. Two host threads launch the staged
    # instance with different row sizes at once (bf16 D = 1024 and 576: buffers of 64 KB and
    # 36 KB a block); a launcher that set the limit to its own size on each call could lower it
    # under the other thread's launch, which would then fail (it did, on the H200). Every launch
    # must succeed, with the logits of a launch made alone.
    gen = torch.Generator(device="cuda").manual_seed(11)
    vocab = 20011
    slots = slots_past_one_pass()
    problems = {}
    for dim in (1024, 576):
        embedding = torch.randn(vocab, dim, generator=gen, device="cuda").to(torch.bfloat16)
        hidden = torch.randn(1, dim, generator=gen, device="cuda").to(torch.bfloat16)
        candidates = torch.randint(0, vocab, (1, slots), generator=gen, device="cuda", dtype=torch.int32)
        problems[dim] = (hidden, embedding, candidates)
    alone = {dim: ops.candidate_logits(*args) for dim, args in problems.items()}
    start = threading.Barrier(len(problems), timeout=60)  # a thread that fails early ends the wait

    def launch_many(dim):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.default_stream())  # the inputs are written there
        with torch.cuda.stream(stream):
            start.wait()
            outputs = [ops.candidate_logits(*problems[dim]) for _ in range(300)]
        stream.synchronize()
        return outputs

    with concurrent.futures.ThreadPoolExecutor(len(problems)) as pool:
        results = dict(zip(problems, pool.map(launch_many, problems)))  # a failed launch raises here
    for dim, outputs in results.items():
        assert all(torch.equal(out, alone[dim]) for out in outputs), dim


@pytest.mark.parametrize("op", ["select_clusters", "sample_clusters"])
def test_the_selection_refuses_probes_past_2_to_the_29(op):
    # Its ranked list rounds probes up to a power of two: past 2^29 the host's sizing loop and the
    # kernel's sort wrapped an int (a hang). A stride-0 input: the check reads sizes only.
    centroids = torch.ones(1, 1, device="cuda").expand(2**29 + 1, 1)
    hidden = torch.ones(1, 1, device="cuda")
    call = (lambda p: ops.select_clusters(hidden, centroids, p)) if op == "select_clusters" else (
        lambda p: ops.sample_clusters(hidden, centroids, p, 1.0, seed=3))
    with pytest.raises(ValueError, match=rf"flashhead.{op}: probes is 536870913, above the CUDA selection's limit of 2\^29"):
        call(2**29 + 1)


def _row(dim, dtype=torch.bfloat16):
    return torch.ones(1, dim, device="cuda", dtype=dtype)


def _ids(*shape):
    return torch.zeros(1, device="cuda", dtype=torch.int32).view(*[1] * len(shape)).expand(*shape)


KERNEL_COUNT_LIMIT = 2**30
PAST = KERNEL_COUNT_LIMIT + 1
# One case per count a kernel loop steps an int through (stride-0 inputs: the checks read sizes
# only). Counts within about 10^4 of 2^31 wrapped those loops' counters on the H100 (session 100):
# illegal addresses in gather_candidates (cluster_size), candidate_logits (candidates, hidden_dim) and
# select_clusters (clusters), and a silently wrong fused_linear (in_features).
COUNT_LIMIT_CASES = {
    "gather_candidates cluster_size": (lambda: ops.gather_candidates(_ids(1, 1), _ids(1, PAST)),
                                       f"cluster_size (cluster_tokens.size(1)) is {PAST}"),
    "gather_candidates probes": (lambda: ops.gather_candidates(_ids(1, 2**33 + 5), _ids(1, 2**31 - 1)),
                                 f"probes (cluster_ids.size(1)) is {2**33 + 5}"),
    "candidate_logits candidates": (lambda: ops.candidate_logits(_row(8), _row(8), _ids(1, PAST)),
                                    f"the number of candidates per row (candidate_ids.size(1)) is {PAST}"),
    "candidate_logits hidden_dim": (lambda: ops.candidate_logits(_row(1).expand(1, PAST), _row(1).expand(1, PAST),
                                                                 _ids(1, 1)), f"hidden_dim (hidden.size(1)) is {PAST}"),
    "select_clusters clusters": (lambda: ops.select_clusters(_row(1), _row(1).expand(PAST, 1), 1),
                                 f"the number of clusters (centroids.size(0)) is {PAST}"),
    "decode_greedy candidates": (lambda: ops.decode_greedy(_row(1), _row(1).expand(2, 1), _ids(2, 2**29 + 1),
                                                           _row(1), 2), "the number of candidates per row"),
    # Far past: the outputs were allocated (8 TB) before this batch was checked.
    "decode_greedy batch": (lambda: ops.decode_greedy(_row(1).expand(2**40, 1), _row(1).expand(2, 1), _ids(2, 1), _row(1), 2),
                            f"the batch size (hidden.size(0)) is {2**40}"),
    "decode_sample batch": (lambda: ops.decode_sample(_row(1).expand(2**40, 1), _row(1).expand(2, 1), _ids(2, 1), _row(1), 2,
                                                      1.0, seed=3), f"the batch size (hidden.size(0)) is {2**40}"),
    "fused_linear in_features": (lambda: ops.fused_linear(_row(1).expand(1, PAST), _row(1).expand(1, PAST)),
                                 f"x.size(1) is {PAST}"),
}


@pytest.mark.parametrize("case", COUNT_LIMIT_CASES)
def test_counts_past_2_to_the_30_are_refused_by_name(case):
    call, fragment = COUNT_LIMIT_CASES[case]
    with pytest.raises(ValueError, match=re.escape(fragment) + r".*above the CUDA kernels' limit of 2\^30"):
        call()
