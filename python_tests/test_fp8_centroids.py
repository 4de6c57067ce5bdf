"""Centroids in float8_e4m3fn with a centroid_scale: the ops, quantize_centroids and FlashHead.

The ops' contract is scores = (hidden . float(centroids)) * scale. The tests quantize with a
power-of-two scale, so the reference can score the dequantized float32 centroids instead: scaling
every product and partial sum by a power of two is exact, and the ops must then match the plain
reference as closely as they do for float centroids (exactly on the CPU).
"""
import itertools
import pickle
import re

import pytest
import torch

import reference as ref
from flashhead_ext import DenseHead, FlashHead, ops
from helpers import (DEVICES, Shape, assert_same_ids, assert_values_close, capture, check_decode_greedy,
                     check_decode_sample, check_ranked_selection, compiled, exact_on, make_problem, seed_tensor)

FP8 = torch.float8_e4m3fn
# D a multiple of 16 (16-byte fp8 chunks) and not (7, 1000: the one-element path); odd B, C, p.
CASES = [
    Shape(B=1, D=64, C=37, b=4, p=3),
    Shape(B=3, D=576, C=257, b=4, p=257 // 16, pad=3, extras=True),
    Shape(B=17, D=1024, C=989, b=16, p=61, pad=7, extras=True),
    Shape(B=9, D=1000, C=257, b=16, p=16, extras=True),
    Shape(B=3, D=7, C=37, b=4, p=37, extras=True),
]
case_params = pytest.mark.parametrize("shape", CASES, ids=str)
dtype_params = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
device_params = pytest.mark.parametrize("device", DEVICES)
TEMPERATURE = 0.8


def quantized(shape, dtype, device):
    """(problem with the dequantized float32 centroids, fp8 centroids, scale)."""
    return make_problem(shape, dtype, device).with_fp8_centroids()


def test_quantize_centroids_scale_range_and_error():
    g = torch.Generator().manual_seed(3)
    for magnitude in (1e-3, 0.05, 1.0, 300.0):
        centroids = torch.randn(99, 48, generator=g) * magnitude
        q, scale = ops.quantize_centroids(centroids)
        assert q.dtype == FP8 and q.shape == centroids.shape and scale.dtype == torch.float32 and scale.shape == (1,)
        mantissa, _ = torch.frexp(scale)
        assert float(mantissa) == 0.5, "the scale is a power of two"
        peak = float(q.float().abs().max())
        assert 128 <= peak <= 256  # [128, 256) before rounding to 3 mantissa bits
        # e4m3 rounds to 3 mantissa bits: half an ulp is 1/16 of the value in the normal range,
        # and 2^-10 absolute below it (its subnormals).
        error = (q.float() * scale - centroids).abs()
        assert bool((error <= centroids.abs() / 16 + 2.0 ** -10 * scale).all())


def test_quantize_centroids_refuses_what_it_cannot_quantize():
    with pytest.raises(TypeError, match="centroids must be a float16, bfloat16 or float32 tensor, got torch.int32"):
        ops.quantize_centroids(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"centroids must not be empty, got shape \(0, 4\)"):
        ops.quantize_centroids(torch.ones(0, 4))
    with pytest.raises(TypeError, match="got torch.float8_e4m3fn"):
        ops.quantize_centroids(torch.ones(3, 4).to(FP8))
    with pytest.raises(ValueError, match="centroids are too small to quantize"):
        ops.quantize_centroids(torch.full((3, 4), 2.0 ** -145))
    with pytest.raises(ValueError, match="finite and not all zero"):
        ops.quantize_centroids(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="finite and not all zero"):
        ops.quantize_centroids(torch.tensor([[1.0, float("nan")]]))
    # Not torch's "Tensor.item() cannot be called on meta tensors", which names nothing.
    with pytest.raises(ValueError, match="centroids is on the meta device, which holds no values"):
        ops.quantize_centroids(torch.ones(3, 4, device="meta"))


@device_params
@dtype_params
@case_params
def test_select_clusters_with_fp8_centroids(shape, dtype, device):
    problem, centroids, scale = quantized(shape, dtype, device)
    ids, scores = ops.select_clusters(problem.hidden, centroids, problem.probes, centroid_scale=scale)
    ref_scores = ref.scores(problem.hidden, problem.centroids)
    check_ranked_selection(ids, ref_scores, problem.probes, problem.score_tol(), exact_on(device))
    assert_values_close(scores, ref_scores.gather(1, ids.long()), problem.score_tol(), "scores")


@device_params
@dtype_params
@case_params
def test_decode_greedy_with_fp8_centroids(shape, dtype, device):
    problem, centroids, scale = quantized(shape, dtype, device)
    h, _, table, embedding, probes, extra = problem.args()
    tokens = ops.decode_greedy(h, centroids, table, embedding, probes, extra, centroid_scale=scale)
    check_decode_greedy(tokens, problem, exact_on(device))
    out = torch.full((shape.B,), -7, dtype=torch.int64, device=device)
    ops.decode_greedy(h, centroids, table, embedding, probes, extra, out=out, centroid_scale=scale)
    assert_same_ids(out, tokens, "decode_greedy_out vs decode_greedy")


@device_params
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@case_params
def test_sampling_with_fp8_centroids_matches_philox_reference(shape, dtype, device):
    problem, centroids, scale = quantized(shape, dtype, device)
    h, _, table, embedding, probes, extra = problem.args()
    seed = 31 + shape.C
    ids, raw = ops.sample_clusters(h, centroids, probes, TEMPERATURE, seed=seed, centroid_scale=scale)
    trace = ref.sample_clusters(h, problem.centroids, probes, TEMPERATURE, seed)
    check_ranked_selection(ids, trace.cluster_keys, probes, problem.score_tol() / TEMPERATURE + 1e-5, exact_on(device))
    assert_values_close(raw, trace.cluster_scores.gather(1, ids.long()), problem.score_tol(), "raw scores")
    tokens, logprobs = ops.decode_sample(h, centroids, table, embedding, probes, TEMPERATURE, extra, seed=seed,
                                         centroid_scale=scale)
    check_decode_sample(tokens, logprobs, problem, TEMPERATURE, seed, exact_on(device))


@device_params
def test_centroid_scale_multiplies_scores_of_float_centroids_too(device):
    # A scale that is not a power of two: the ops multiply each float32 score by it once.
    problem = make_problem(CASES[2], torch.float32, device)
    scale = torch.tensor([0.3], device=device)
    ids, scores = ops.select_clusters(problem.hidden, problem.centroids, problem.probes, centroid_scale=scale)
    expected = ref.scores(problem.hidden, problem.centroids) * scale
    check_ranked_selection(ids, expected, problem.probes, problem.score_tol(), exact_on(device))
    assert_values_close(scores, expected.gather(1, ids.long()), problem.score_tol(), "scores")


@device_params
def test_a_negative_centroid_scale_reverses_the_ranking(device):
    problem, centroids, scale = quantized(CASES[1], torch.bfloat16, device)
    best = ops.select_clusters(problem.hidden, centroids, 5, centroid_scale=scale)[0]
    worst = ops.select_clusters(problem.hidden, centroids, 5, centroid_scale=-scale)[0]
    check_ranked_selection(worst, -ref.scores(problem.hidden, problem.centroids), 5, problem.score_tol(),
                           exact_on(device))
    assert not torch.equal(best, worst)


@device_params
def test_bad_fp8_arguments_are_refused_by_name(device):
    problem, centroids, scale = quantized(CASES[1], torch.bfloat16, device)
    h, _, table, embedding, probes, extra = problem.args()
    with pytest.raises(TypeError, match="centroids must have the dtype of hidden .* or be torch.float8_e4m3fn, "
                                        "got torch.float8_e5m2"):
        ops.select_clusters(h, centroids.to(torch.float8_e5m2), probes)
    with pytest.raises(TypeError, match="embedding must have the dtype of hidden"):
        ops.decode_greedy(h, centroids, table, embedding.float().to(FP8), probes, extra)
    with pytest.raises(TypeError, match="centroid_scale must be a float32 tensor, got torch.float64"):
        ops.decode_greedy(h, centroids, table, embedding, probes, extra, centroid_scale=scale.double())
    with pytest.raises(ValueError, match=r"centroid_scale must hold exactly one value, got shape \[2\]"):
        ops.select_clusters(h, centroids, probes, centroid_scale=scale.repeat(2))
    with pytest.raises(TypeError, match="centroid_scale must be a torch.Tensor, got float"):
        ops.decode_sample(h, centroids, table, embedding, probes, centroid_scale=0.5)
    other = "meta" if device == "cpu" else "cpu"
    with pytest.raises(ValueError, match="centroid_scale must be on the same device as"):
        ops.sample_clusters(h, centroids, probes, centroid_scale=scale.to(other))
    out = torch.empty(2 * h.shape[0], dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="out must not share memory with centroid_scale"):
        ops.decode_greedy(h, centroids, table, embedding, probes, extra, out=out[: h.shape[0]],
                          centroid_scale=out.view(torch.float32)[:1])


def fp8_head(device, dtype=torch.bfloat16, shape=CASES[2]):
    problem = make_problem(shape, dtype, device)
    raw = problem.centroids.float() * 3.0  # sampling centroids of another scale than the greedy ones
    head = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, problem.probes,
                     special_token_ids=problem.extra_ids.tolist(), sampling_centroids=raw, centroid_dtype=FP8)
    return problem, raw, head


@device_params
def test_flash_head_with_fp8_centroids(device):
    problem, raw, head = fp8_head(device)
    assert head.centroid_dtype == FP8 and head.sampling_centroids.dtype == FP8
    assert "centroid_dtype=torch.float8_e4m3fn" in repr(head)
    greedy_c, greedy_s = ops.quantize_centroids(problem.centroids.float())
    assert torch.equal(head.centroids.float(), greedy_c.float()) and torch.equal(head.centroid_scale, greedy_s)
    tokens = head.next_token(problem.hidden)
    check_decode_greedy(tokens, problem.with_(centroids=greedy_c.float() * greedy_s), exact_on(device))
    ids, logits = head.candidate_logits(problem.hidden)
    assert ids.shape == (problem.hidden.shape[0], head.num_candidates)
    sample_c, sample_s = ops.quantize_centroids(raw)
    g = torch.Generator(device).manual_seed(5)
    tokens, logprobs = head.sample(problem.hidden, TEMPERATURE, generator=g)
    g = torch.Generator(device).manual_seed(5)
    seed = ops.make_seed(torch.device(device), generator=g)
    expected = ops.decode_sample(problem.hidden, sample_c, problem.cluster_tokens, problem.embedding, problem.probes,
                                 TEMPERATURE, head._extra_ids, seed=seed, centroid_scale=sample_s)
    assert_same_ids(tokens, expected[0], "sampled tokens")


@device_params
def test_flash_head_fp8_state_and_casts(device):
    problem, raw, head = fp8_head(device)
    tokens = head.next_token(problem.hidden)
    state = head.state_dict()
    assert state["centroids"].dtype == FP8 and state["centroid_scale"].dtype == torch.float32
    other = FlashHead(problem.embedding, problem.centroids.flip(0), problem.cluster_tokens, problem.probes,
                      centroid_dtype=FP8)
    other.load_state_dict(state)
    assert_same_ids(other.next_token(problem.hidden), tokens, "tokens after load_state_dict")
    plain = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, problem.probes)
    with pytest.raises(ValueError, match="build the head with the state's centroid_dtype"):
        plain.load_state_dict(state)
    with pytest.raises(ValueError, match="build the head with the state's centroid_dtype"):
        other.load_state_dict(plain.state_dict())
    bad = dict(state, centroid_scale=torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="centroid_scale in the state dict must be finite and positive"):
        other.load_state_dict(bad)
    # A sharded checkpoint may hold fp8 centroids and their scale in different shards: the half that
    # came waits for the other, since the head would score one set at the other's scale meanwhile.
    # With assign=True torch sets each buffer as an attribute (older transformers loaders did).
    pairs = (("centroids", "centroid_scale"), ("centroid_scale", "centroids"),
             ("sampling_centroids", "sampling_centroid_scale"), ("sampling_centroid_scale", "sampling_centroids"))
    for (came, later), assign in itertools.product(pairs, (False, True)):
        other = FlashHead(problem.embedding, problem.centroids.flip(0) * 3, problem.cluster_tokens, problem.probes,
                          centroid_dtype=FP8)
        other.load_state_dict({key: value for key, value in state.items() if key != later}, strict=False, assign=assign)
        for run in (other.next_token, other.sample):
            with pytest.raises(ValueError, match=re.escape(f"waits for {later} ({came} came in a state dict without it): ")):
                run(problem.hidden)
        other.load_state_dict({later: state[later]}, strict=False, assign=assign)
        assert all(torch.equal(other.state_dict()[key].float(), value.float()) for key, value in state.items())
        assert_same_ids(other.next_token(problem.hidden), tokens, f"tokens after {came}, then {later}")
    # A scale of another shape is refused whole, as centroids of another shape are: torch would copy
    # the centroids and skip the scale, leaving the new values with the old scale.
    before = {key: value.clone() for key, value in other.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"size mismatch for centroid_scale: copying a param with shape torch.Size\(\[\]\)"):
        other.load_state_dict(dict(state, centroids=state["centroids"].flip(0), centroid_scale=state["centroid_scale"][0]))
    assert all(torch.equal(other.state_dict()[key].float(), value.float()) for key, value in before.items())
    # A module cast changes the embedding's dtype, not the fp8 centroids or their float32 scales,
    # which only follow the device.
    head.double()
    assert head.embedding.dtype == torch.float64 and head.centroid_dtype == FP8
    assert head.centroid_scale.dtype == torch.float32 and head.centroid_scale.device == head.embedding.device
    head.half()
    assert head.embedding.dtype == torch.float16 and head.centroid_dtype == FP8
    assert head.centroid_scale.dtype == torch.float32 and head.sampling_centroid_scale.dtype == torch.float32
    assert_same_ids(head.next_token(problem.hidden.half()), FlashHead(
        problem.embedding.half(), problem.centroids, problem.cluster_tokens, problem.probes,
        special_token_ids=problem.extra_ids.tolist(), centroid_dtype=FP8).next_token(problem.hidden.half()),
        "tokens after head.half()")


def test_flash_head_refuses_other_centroid_dtypes_and_fp8_input():
    problem = make_problem(CASES[0], torch.float32, "cpu")
    for dtype in (torch.float8_e5m2, torch.float16, "fp8"):
        with pytest.raises(TypeError, match="centroid_dtype must be None, the embedding's dtype torch.float32 or "
                                            "torch.float8_e4m3fn"):
            FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, 1, centroid_dtype=dtype)
    # The embedding's own dtype is taken, as None: centroids in that dtype, no scale, the same tokens.
    same = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, 2, centroid_dtype=torch.float32)
    assert same.centroid_dtype == torch.float32 and same.centroid_scale is None
    assert torch.equal(same.next_token(problem.hidden),
                       FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, 2).next_token(problem.hidden))
    # fp8 centroids would come without their scale: the head quantizes float ones itself.
    for name in ("centroids", "sampling_centroids"):
        args = dict(centroids=problem.centroids, sampling_centroids=problem.centroids)
        args[name] = problem.centroids.to(FP8)
        with pytest.raises(TypeError, match=f"{name} must be a float16, bfloat16, float32 or float64 tensor "
                                            r"\(centroid_dtype=torch.float8_e4m3fn quantizes them\), got torch.float8_e4m3fn"):
            FlashHead(problem.embedding, cluster_tokens=problem.cluster_tokens, probes=1, centroid_dtype=FP8, **args)


def test_a_tiny_scale_survives_module_casts():
    problem = make_problem(CASES[0], torch.float32, "cpu")
    head = FlashHead(problem.embedding, problem.centroids * 1e-6, problem.cluster_tokens, 2, centroid_dtype=FP8)
    scale = head.centroid_scale.clone()
    assert float(scale) < 2.0 ** -24  # below float16's smallest subnormal
    tokens = head.next_token(problem.hidden)
    head.half().float()
    assert torch.equal(head.centroid_scale, scale) and torch.equal(head.next_token(problem.hidden), tokens)


def test_a_scale_is_checked_as_the_head_will_hold_it():
    # Checked before its cast to float32: 1e-50 and 1e39 in float64 passed, then held 0 and inf.
    problem, _, head = fp8_head("cpu")
    for value in (1e-50, 1e39):
        state = dict(head.state_dict(), centroid_scale=torch.tensor([value], dtype=torch.float64))
        with pytest.raises(ValueError, match=r"centroid_scale in the state dict must be finite and positive in float32, "
                                             r"as the head keeps it, got " + re.escape(str([value]))):
            head.load_state_dict(state)


@pytest.mark.parametrize("fp8_centroids", [False, True])
def test_a_cast_of_a_head_to_fp8_is_refused_before_it_rounds_anything(fp8_centroids):
    # It was taken: the weight (and a plain head's centroids) rounded to 8 bits, and the next call
    # advised a cast back, after which the head ran on the rounded values.
    problem = make_problem(CASES[0], torch.float32, "cpu")
    head = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, 2,
                     centroid_dtype=FP8 if fp8_centroids else None)
    before = {name: tensor.clone() for name, tensor in head.named_buffers()}
    for dtype in (FP8, torch.float8_e5m2):
        with pytest.raises(TypeError, match=rf"FlashHead.to\({dtype}\) would round the output weight to 8 bits, .* "
                                            "centroid_dtype=torch.float8_e4m3fn"):
            head.to(dtype)
    assert all(torch.equal(tensor, before[name]) and tensor.dtype == before[name].dtype
               for name, tensor in head.named_buffers())
    with pytest.raises(TypeError, match=r"DenseHead.to\(torch.float8_e4m3fn\) would round") as refused:
        DenseHead(problem.embedding).to(FP8)
    assert "already" not in str(refused.value)  # a head alone: nothing converted


@pytest.mark.parametrize("kind", [DenseHead, FlashHead])
def test_a_module_cast_to_fp8_says_the_weight_converted_before_its_head_is_rounded(kind):
    # torch converts a module's children in order: the weight in a child registered before the head
    # is 8-bit by the time the head refuses, and the error read as if nothing had changed.
    problem = make_problem(CASES[0], torch.float32, "cpu")
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(problem.embedding.shape[1], problem.embedding.shape[0], bias=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(problem.embedding)
    model.head = (DenseHead(model.lm_head.weight) if kind is DenseHead else
                  FlashHead(model.lm_head.weight, problem.centroids, problem.cluster_tokens, 2))
    with pytest.raises(TypeError, match=rf"{kind.__name__}.to\(torch.float8_e4m3fn\) would round .* The output weight "
                                        r"this head follows is torch.float8_e4m3fn already \(a module converts its "
                                        r"children in order.*\), and a cast back does not restore its values"):
        model.to(FP8)
    assert model.lm_head.weight.dtype == FP8 and model.head.embedding.dtype == torch.float32  # as said


def test_fp8_buffers_follow_share_memory():
    # They followed the device only, so share_memory() left them out.
    _, _, head = fp8_head("cpu")
    head.share_memory()
    assert all(tensor.is_shared() for tensor in head.buffers())
    assert head.centroid_dtype == FP8 and head.centroid_scale.dtype == torch.float32


def test_multiprocessing_sends_a_head_with_fp8_centroids():
    # What the README says: torch's pickler (multiprocessing's) shares the tensors, which plain
    # pickle cannot read back for fp8 ones.
    from multiprocessing.reduction import ForkingPickler
    problem, _, head = fp8_head("cpu")
    received = pickle.loads(ForkingPickler.dumps(head))
    assert received.centroid_dtype == FP8 and torch.equal(received.centroid_scale, head.centroid_scale)
    assert torch.equal(received.next_token(problem.hidden), head.next_token(problem.hidden))


def test_state_dict_centroids_are_checked_as_the_head_will_hold_them():
    problem = make_problem(CASES[0], torch.float16, "cpu")
    head = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, 2)
    state = dict(head.state_dict(), centroids=head.centroids.float() * 1e6)  # finite in float32, not in float16
    with pytest.raises(ValueError, match=r"centroids in the state dict must be finite; it holds NaN or inf \(as torch.float16\)"):
        head.load_state_dict(state)


@pytest.mark.slow
@device_params
def test_compile_fp8_head(device):
    problem, _, head = fp8_head(device)
    assert torch.equal(compiled(head.next_token)(problem.hidden), head.next_token(problem.hidden))
    seed = seed_tensor(9, device)
    sample = lambda hidden: ops.decode_sample(hidden, head.sampling_centroids, head.cluster_tokens, head.embedding,
                                              head.probes, TEMPERATURE, head._extra_ids, seed=seed,
                                              centroid_scale=head.sampling_centroid_scale)
    compiled_tokens, compiled_logprobs = compiled(sample)(problem.hidden)
    tokens, logprobs = sample(problem.hidden)
    assert torch.equal(compiled_tokens, tokens) and torch.equal(compiled_logprobs, logprobs)


@pytest.mark.gpu
def test_cuda_graph_reads_the_centroid_scale_at_replay_and_never_syncs():
    problem, _, head = fp8_head("cuda")
    hidden = problem.hidden.clone()
    seed = seed_tensor(4, "cuda")
    run = lambda: (head.next_token(hidden),
                   ops.decode_sample(hidden, head.sampling_centroids, head.cluster_tokens, head.embedding, head.probes,
                                     TEMPERATURE, head._extra_ids, seed=seed, centroid_scale=head.sampling_centroid_scale))
    graph, (tokens, (sampled, logprobs)) = capture(run)
    for flip in (False, True):
        if flip:  # a negated scale ranks the clusters the other way round
            head.centroid_scale.neg_()
            head.sampling_centroid_scale.neg_()
        graph.replay()
        eager_tokens, (eager_sampled, eager_logprobs) = run()
        assert torch.equal(tokens, eager_tokens)
        assert torch.equal(sampled, eager_sampled) and torch.equal(logprobs, eager_logprobs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        head.next_token(problem.hidden)
        head.sample(problem.hidden, TEMPERATURE)
        head.candidate_logits(problem.hidden)
    finally:
        torch.cuda.set_sync_debug_mode("default")
