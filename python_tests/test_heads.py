"""FlashHead and DenseHead: agreement with each other and with the ops, shapes, out=, sampling."""
import copy
import io
import pickle
import re
import warnings
from dataclasses import replace
from typing import Optional, get_type_hints

import pytest
import torch
from torch import nn

import reference as ref
from flashhead_ext import DenseHead, FlashHead, ops
from helpers import (DEVICES, P_VALUE, Shape, assert_same_ids, check_decoded_tokens, chi_square_pvalue, counts_of,
                     default_dtype, exact_on, make_problem, softmax_np)

device_params = pytest.mark.parametrize("device", DEVICES)
SHAPE = Shape(B=17, D=64, C=37, b=16, p=3, pad=5, extras=True)


def flash_head(problem, probes=None, **kw):
    return FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens,
                     problem.probes if probes is None else probes,
                     special_token_ids=None if problem.extra_ids is None else problem.extra_ids.tolist(), **kw)


either_head = pytest.mark.parametrize("make_head", [flash_head, lambda p: DenseHead(p.embedding)], ids=["flash", "dense"])


@device_params
@pytest.mark.parametrize("integer", [False, True], ids=["random", "integer-ties"])
def test_all_probes_equals_dense_argmax(device, integer):
    problem = make_problem(SHAPE, torch.float32, device, integer=integer)
    dense = DenseHead(problem.embedding).next_token(problem.hidden)
    flash = flash_head(problem, probes=SHAPE.C).next_token(problem.hidden)
    assert flash.dtype == dense.dtype == torch.int64
    check_decoded_tokens(flash, ref.scores(problem.hidden, problem.centroids),
                         ref.dense_logits(problem.hidden, problem.embedding), problem.with_(probes=SHAPE.C), dense,
                         problem.score_tol(), problem.logit_tol(), exact_on(device, integer))


@device_params
def test_candidate_logits_consistent_with_ops(device):
    problem = make_problem(SHAPE, torch.float32, device)
    head = flash_head(problem)
    ids, logits = head.candidate_logits(problem.hidden)
    cluster_ids, _ = ops.select_clusters(problem.hidden, problem.centroids, problem.probes)
    expected_ids = ops.gather_candidates(cluster_ids, problem.cluster_tokens, head.extra_ids)
    assert_same_ids(ids, expected_ids, "candidate ids")
    assert torch.equal(logits, ops.candidate_logits(problem.hidden, problem.embedding, ids))
    assert ids.shape == logits.shape == (SHAPE.B, head.num_candidates)
    # next_token is the best of these candidates (ties to the smaller token id).
    _, best = ref.best_candidate(logits, ids, ref.valid_candidates(ids, problem.vocab))
    tokens = head.next_token(problem.hidden)
    if exact_on(device):
        assert_same_ids(tokens, best, "next_token vs argmax of candidate_logits")
    else:
        got = logits.gather(1, (ids.long() == tokens.unsqueeze(1)).int().argmax(1, keepdim=True)).squeeze(1)
        assert (got >= logits.amax(1) - problem.logit_tol().squeeze(1)).all()


@device_params
def test_dense_candidate_logits(device):
    problem = make_problem(SHAPE, torch.float32, device)
    ids, logits = DenseHead(problem.embedding).candidate_logits(problem.hidden)
    assert ids.dtype == torch.int32 and (ids.cpu() == torch.arange(problem.vocab, dtype=torch.int32)).all()
    torch.testing.assert_close(logits, ref.dense_logits(problem.hidden, problem.embedding), rtol=1e-5, atol=1e-5)
    ids[0, 0] = -1  # each row its own ids, as FlashHead's: a write to one row leaves the others
    assert (ids[1:, 0] == 0).all()


@device_params
def test_special_tokens_always_scored(device):
    # A special token outside every probed cluster wins when its logit is the largest.
    problem = make_problem(SHAPE, torch.float32, device)
    hidden = problem.hidden
    probed = ops.select_clusters(hidden, problem.centroids, 1)[0]
    special = next(t for t in range(problem.vocab) if not (problem.cluster_tokens[probed.long()] == t).any())
    embedding = problem.embedding.clone()
    embedding[special] = hidden.float().sum(0) / hidden.float().sum(0).norm() * 100
    # Rows where the special token's logit is positive and large: it must be chosen.
    head = FlashHead(embedding, problem.centroids, problem.cluster_tokens, 1, special_token_ids=torch.tensor([special]))
    ids, logits = head.candidate_logits(hidden)
    assert (ids[:, -1] == special).all()
    wins = logits[:, -1] > logits[:, :-1].amax(1)
    assert wins.any()
    tokens = head.next_token(hidden)
    assert (tokens[wins] == special).all() and (tokens[~wins] != special).all()
    # A set of ids is taken like a sequence.
    from_set = FlashHead(embedding, problem.centroids, problem.cluster_tokens, 1, special_token_ids={special, 0})
    assert from_set.extra_ids.tolist() == sorted({special, 0})


@device_params
def test_leading_batch_dims_preserved(device):
    problem = make_problem(SHAPE, torch.float32, device)
    hidden = problem.hidden[:6].reshape(2, 3, SHAPE.D)
    for head in (flash_head(problem), DenseHead(problem.embedding)):
        tokens = head.next_token(hidden)
        assert tokens.shape == (2, 3)
        assert torch.equal(tokens.reshape(6), head.next_token(problem.hidden[:6]))
        assert torch.equal(head(hidden), tokens)  # forward is next_token
        g = lambda: torch.Generator(device).manual_seed(3)
        drawn, logprobs = head.sample(hidden, 0.9, g())
        assert drawn.shape == logprobs.shape == (2, 3)
        flat = head.sample(problem.hidden[:6], 0.9, g())
        assert torch.equal(drawn.reshape(6), flat[0]) and torch.equal(logprobs.reshape(6), flat[1])
        ids, logits = head.candidate_logits(hidden)
        flat_ids, flat_logits = head.candidate_logits(problem.hidden[:6])
        assert ids.shape == logits.shape == (2, 3, flat_ids.shape[1])
        assert torch.equal(ids.reshape(flat_ids.shape), flat_ids)
        assert torch.equal(logits.reshape(flat_logits.shape), flat_logits)


@device_params
@either_head
def test_next_token_out_writes_into_a_strided_view(device, make_head):
    problem = make_problem(SHAPE, torch.float32, device)
    head = make_head(problem)
    buffer = torch.full((SHAPE.B, 5), -7, dtype=torch.int64, device=device)
    column = buffer[:, 2]
    assert not column.is_contiguous()
    returned = head.next_token(problem.hidden, out=column)
    assert returned.data_ptr() == column.data_ptr()
    assert torch.equal(buffer[:, 2], head.next_token(problem.hidden))
    assert (buffer[:, [0, 1, 3, 4]] == -7).all()
    # Leading dims: [2, 3, D] writes 6 tokens into a column of a [6, K] buffer.
    buffer6 = torch.full((6, 4), -7, dtype=torch.int64, device=device)
    head.next_token(problem.hidden[:6].reshape(2, 3, SHAPE.D), out=buffer6[:, 1])
    assert torch.equal(buffer6[:, 1], head.next_token(problem.hidden[:6]))
    assert (buffer6[:, [0, 2, 3]] == -7).all()


@device_params
@either_head
def test_next_token_writes_an_out_made_in_inference_mode(device, make_head):
    # As the ops write one; DenseHead's torch.argmax refused to ("Inplace update to inference tensor
    # outside InferenceMode is not allowed").
    problem = make_problem(SHAPE, torch.float32, device)
    head = make_head(problem)
    with torch.inference_mode():
        out = torch.full((SHAPE.B,), -7, dtype=torch.int64, device=device)
    assert head.next_token(problem.hidden, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, head.next_token(problem.hidden))


@pytest.mark.parametrize("route", ["half", "assign"])
def test_a_state_into_inference_tensor_buffers_is_refused_whole(route):
    # Converted (or loaded with assign=True) inside inference mode, the buffers are inference tensors:
    # a load outside it raised only after copying the table and special tokens in.
    problem = make_problem(SHAPE, torch.float32, "cpu")
    head = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, SHAPE.p)
    state = head.state_dict()
    with torch.inference_mode():
        if route == "half":
            head.half().float()
        else:
            head.load_state_dict(state, assign=True)
    before = {name: buffer.clone() for name, buffer in head.state_dict().items()}
    other = FlashHead(problem.embedding, problem.centroids.flip(0), problem.cluster_tokens.flip(0), SHAPE.p,
                      special_token_ids=[0, 1])
    with pytest.raises(RuntimeError, match=re.escape("centroids was made inside torch.inference_mode()")):
        head.load_state_dict(other.state_dict())
    assert all(torch.equal(head.state_dict()[name], value) for name, value in before.items())
    with torch.inference_mode():
        head.load_state_dict(other.state_dict())
    assert torch.equal(head.cluster_tokens, other.cluster_tokens) and torch.equal(head.extra_ids, other.extra_ids)


@pytest.mark.parametrize("assign", [True, False])
def test_states_that_replace_inference_tensor_buffers_still_load(assign):
    # assign=True replaces every buffer, and a new count of special tokens replaces extra_ids: no copy
    # into an inference tensor happens, so neither load is refused.
    problem = make_problem(SHAPE, torch.float32, "cpu")
    head = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, SHAPE.p)
    with torch.inference_mode():
        if assign:
            head.half().float()
        else:
            head.extra_ids = torch.empty(0, dtype=torch.int32)
    other = FlashHead(problem.embedding, problem.centroids.flip(0), problem.cluster_tokens.flip(0), SHAPE.p,
                      special_token_ids=[0, 1])
    head.load_state_dict(other.state_dict(), assign=assign)
    assert torch.equal(head.cluster_tokens, other.cluster_tokens) and head.extra_ids.tolist() == [0, 1]
    assert torch.equal(head.next_token(problem.hidden), other.next_token(problem.hidden))


@either_head
def test_next_token_over_an_inference_mode_embedding_on_hidden_that_requires_grad(make_head):
    # DenseHead's product recorded autograd, and torch refused to save an inference tensor for it.
    problem = make_problem(SHAPE, torch.float32, "cpu")
    with torch.inference_mode():
        embedding = problem.embedding.clone()
    head = make_head(replace(problem, embedding=embedding))
    hidden = problem.hidden.clone().requires_grad_()
    assert torch.equal(head.next_token(hidden), make_head(problem).next_token(problem.hidden))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("hidden_needs_grad", [True, False], ids=["tied_states", "frozen_states"])
def test_dense_head_logits_differentiate_to_its_weight_as_lm_heads_do(hidden_needs_grad, compiled):
    # The head computed over its detached buffer: the head's term of the weight's gradient was
    # silently left out (with states from a tied input embedding), or the loss needed no grad.
    generator = torch.Generator().manual_seed(11)
    weight = nn.Parameter(torch.randn(53, 19, generator=generator))
    ids, labels = torch.randint(0, 53, (2, 5), generator=generator)
    head = DenseHead(weight)

    def loss(logits_of):
        hidden = weight[ids] * 0.5 if hidden_needs_grad else torch.randn(5, 19, generator=torch.Generator().manual_seed(2))
        return nn.functional.cross_entropy(logits_of(hidden), labels)

    candidate_logits = lambda hidden: head.candidate_logits(hidden)[1]
    if compiled:
        candidate_logits = torch.compile(candidate_logits, backend="aot_eager", fullgraph=True)
    expected = torch.autograd.grad(loss(lambda hidden: hidden @ weight.t()), weight)[0]
    torch.testing.assert_close(torch.autograd.grad(loss(candidate_logits), weight)[0], expected)
    hidden = torch.randn(5, 19, generator=generator)
    _, logprobs = head.sample(hidden, generator=torch.Generator().manual_seed(4))
    assert torch.autograd.grad(logprobs.sum(), weight)[0].abs().sum() > 0
    with torch.no_grad():
        assert not head.candidate_logits(hidden)[1].requires_grad


# torch 2.14 deprecates torch.jit; the tracer warns on every shape check it turns into a constant.
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::torch.jit.TracerWarning")
def test_a_module_over_a_dense_head_traced_with_grad_on_saves_and_loads():
    # torch.jit cannot save a Python autograd Function, which the head's gradient to its weight uses.
    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(19, 53, bias=False)  # its weight requires grad
            self.head = DenseHead(self.linear.weight)

        def forward(self, hidden):
            return self.head.candidate_logits(hidden)[1]

    torch.manual_seed(3)
    module, hidden = Logits(), torch.randn(4, 19)
    saved = io.BytesIO()
    torch.jit.save(torch.jit.trace(module, (hidden,)), saved)
    saved.seek(0)
    other = torch.randn(6, 19)
    torch.testing.assert_close(torch.jit.load(saved)(other), module(other))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("rows", [53, 60], ids=["same_shape", "other_shape"])
def test_dense_head_reads_its_buffer_after_the_weights_memory_was_replaced(rows, compiled):
    # weight.data = ...: the head keeps the memory it was given. Differentiable logits read the new
    # weight where torch.compile, which cannot compare data pointers, saw a weight of the same shape.
    generator = torch.Generator().manual_seed(5)
    weight = nn.Parameter(torch.randn(53, 19, generator=generator))
    head = DenseHead(weight)
    weight.data = torch.randn(rows, 19, generator=generator)
    hidden = torch.randn(4, 19, generator=generator)
    candidate_logits = lambda hidden: head.candidate_logits(hidden)[1]
    if compiled:
        candidate_logits = torch.compile(candidate_logits, backend="aot_eager", fullgraph=True)
    logits = candidate_logits(hidden)
    with torch.no_grad():
        torch.testing.assert_close(logits, head.candidate_logits(hidden)[1])
    assert torch.equal(logits.argmax(-1), head.next_token(hidden))
    assert logits.requires_grad == (rows == 53)  # a weight of the buffer's shape still gets the gradient


def test_flash_head_built_under_fake_tensor_mode_names_the_mode():
    # Its checks read values: torch's own error named a data-dependent op, neither the argument nor the mode.
    from torch._subclasses.fake_tensor import FakeTensorMode

    problem = make_problem(SHAPE, torch.float32, "cpu")
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(tensor) for tensor in (problem.embedding, problem.centroids, problem.cluster_tokens)]
        with pytest.raises(ValueError, match=r"centroids is a fake tensor \(FakeTensorMode's\)"):
            FlashHead(*fakes, SHAPE.p)


def test_a_tensor_subclass_holding_values_is_not_refused_as_fake():
    class Subclass(torch.Tensor):
        pass

    centroids = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    for got, expected in zip(ops.quantize_centroids(centroids.as_subclass(Subclass)), ops.quantize_centroids(centroids)):
        assert torch.equal(got.as_subclass(torch.Tensor), expected)


def test_flash_head_built_in_inference_mode_loads_states_outside_it():
    # Its buffers were inference tensors: a load outside inference mode raised torch's "Inplace update
    # to inference tensor" after copying the state in. A load inside it that changes the number of
    # special tokens makes a new buffer, which must not be one either.
    problem = make_problem(SHAPE, torch.float32, "cpu")
    with torch.inference_mode():
        head = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, SHAPE.p)
    other = FlashHead(problem.embedding, problem.centroids.flip(0), problem.cluster_tokens.flip(0), SHAPE.p,
                      special_token_ids=[0, 1, 2])
    with torch.inference_mode():
        head.load_state_dict(other.state_dict())
    assert not any(buffer.is_inference() for buffer in head.buffers())
    head.load_state_dict(FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, SHAPE.p,
                                   special_token_ids=[5]).state_dict())
    expected = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, SHAPE.p, special_token_ids=[5])
    assert torch.equal(head.next_token(problem.hidden), expected.next_token(problem.hidden))


def test_dense_next_token_refuses_a_bad_out():
    problem = make_problem(SHAPE, torch.float32, "cpu")
    head = DenseHead(problem.embedding)
    with pytest.raises(TypeError, match=r"out must be a torch.Tensor \(int64 \[17\]\), got list"):
        head.next_token(problem.hidden, out=[0] * SHAPE.B)
    # A wrong dtype is a TypeError, as FlashHead's ops raise it, so one except clause serves both heads.
    for bad, got, error in ((torch.zeros(SHAPE.B, dtype=torch.int32), "torch.int32 [17]", TypeError),
                            (torch.zeros(SHAPE.B + 1, dtype=torch.int64), "torch.int64 [18]", ValueError),
                            (torch.zeros(SHAPE.B, 1, dtype=torch.int64), "torch.int64 [17, 1]", ValueError),
                            (torch.zeros(SHAPE.B, dtype=torch.int64, device="meta"), "torch.int64 [17] on meta", ValueError)):
        with pytest.raises(error, match=re.escape(f"out must be int64 [17] on cpu (one token a row of hidden), got {got}")):
            head.next_token(problem.hidden, out=bad)
        assert bad.device.type == "meta" or not bad.bool().any()  # nothing written
    # As FlashHead's ops: tokens written into the weight's bytes would change every later call.
    wide = torch.cat([problem.hidden, problem.hidden], 1)  # hidden, a view of it, and out in its other half
    for bad, name, hidden in ((problem.embedding.view(torch.int64)[:SHAPE.B, 0], "embedding", problem.hidden),
                              (problem.embedding.view(torch.int64)[-SHAPE.B:, -1], "embedding", problem.hidden),
                              (wide.view(torch.int64)[:, -1], "hidden", wide[:, :SHAPE.D])):
        before = problem.embedding.clone()
        with pytest.raises(ValueError, match=f"out must not share memory with {name}"):
            head.next_token(hidden, out=bad)
        assert torch.equal(problem.embedding, before)
    # Fake tensors (a memory estimate under FakeTensorMode) have no memory to share: every data_ptr is 0.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = DenseHead(torch.randn(SHAPE.V, SHAPE.D))
        assert fake.next_token(torch.randn(3, SHAPE.D), out=torch.empty(3, dtype=torch.int64)).shape == (3,)


@device_params
@either_head
def test_an_out_beside_hidden_in_one_buffer_is_taken(device, make_head):
    # Bytes that only touch (out starts where hidden ends) are not shared.
    problem = make_problem(SHAPE, torch.float32, device)
    buffer = torch.empty(SHAPE.B * SHAPE.D * 4 + SHAPE.B * 8, dtype=torch.uint8, device=device)
    hidden = buffer[:SHAPE.B * SHAPE.D * 4].view(torch.float32).view(SHAPE.B, SHAPE.D)
    hidden.copy_(problem.hidden)
    out = buffer[SHAPE.B * SHAPE.D * 4:].view(torch.int64)
    head = make_head(problem)
    assert head.next_token(hidden, out=out) is out
    assert torch.equal(out, head.next_token(problem.hidden))


@device_params
@either_head
def test_sample_reproducible_with_generator(device, make_head):
    problem = make_problem(SHAPE, torch.float32, device)
    head = make_head(problem)
    draw = lambda s: head.sample(problem.hidden, 0.8, torch.Generator(device).manual_seed(s))
    a, b, c = draw(1), draw(1), draw(2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert a[0].dtype == torch.int64 and a[1].dtype == torch.float32
    assert ((a[0] >= 0) & (a[0] < problem.vocab)).all() and (a[1] <= 0).all()


@device_params
def test_flash_sample_uses_sampling_centroids(device):
    problem = make_problem(SHAPE, torch.float32, device)
    other = torch.flip(problem.centroids, dims=[0]).contiguous()
    head = flash_head(problem, sampling_centroids=other)
    drawn = head.sample(problem.hidden, 0.8, torch.Generator(device).manual_seed(5))
    seed = ops.make_seed(device, generator=torch.Generator(device).manual_seed(5))
    expected = ops.decode_sample(problem.hidden, other, problem.cluster_tokens, problem.embedding, problem.probes, 0.8,
                                 head.extra_ids, seed=seed)
    assert torch.equal(drawn[0], expected[0]) and torch.equal(drawn[1], expected[1])


@device_params
def test_dense_sample_follows_softmax(device):
    problem = make_problem(Shape(B=1, D=6, C=3, b=4, p=1, pad=1), torch.float32, device)
    rows = problem.hidden.expand(40000, -1).contiguous() * 1.5
    T = 0.7
    tokens, logprobs = DenseHead(problem.embedding).sample(rows, T, torch.Generator(device).manual_seed(12))
    logits = ref.dense_logits(rows[:1], problem.embedding)[0].cpu()
    assert chi_square_pvalue(counts_of(tokens, problem.vocab), softmax_np(logits, T)) > P_VALUE
    expected = torch.log_softmax(logits.double() / T, 0)[tokens.cpu()].float()
    torch.testing.assert_close(logprobs.cpu(), expected, rtol=1e-5, atol=1e-5)


@device_params
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_head(device, dtype):
    # Float32 centroids are cast to the embedding's dtype; results equal the ops on those tensors.
    problem = make_problem(SHAPE, dtype, device)
    head = FlashHead(problem.embedding, problem.centroids.float(), problem.cluster_tokens.long(), problem.probes,
                     special_token_ids=problem.extra_ids)
    assert head.centroids.dtype == dtype and head.cluster_tokens.dtype == torch.int32
    assert torch.equal(head.next_token(problem.hidden), ops.decode_greedy(*problem.args()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["centroids", "sampling_centroids"])
def test_a_cast_that_would_turn_centroids_into_inf_is_refused_before_anything_converts(name, dtype):
    # Their clusters then ranked last, silently, where a head built or loaded so is refused.
    problem = make_problem(SHAPE, seed=21)
    head = flash_head(problem)
    # Finite in float32, inf once rounded to dtype (bfloat16's range is float32's, less its top).
    big = min(torch.finfo(dtype).max * 1.01, torch.finfo(torch.float32).max)
    getattr(head, name)[4, 2] = big
    before = head.state_dict()
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), head)
    with pytest.raises(ValueError, match=re.escape(f"FlashHead.to({dtype}) would turn {name} past {dtype}'s range")
                       + f".* The head is unchanged, but in a model the modules registered before it are {dtype} already"):
        model.to(dtype)
    assert all(torch.equal(tensor, before[key]) and tensor.dtype == before[key].dtype
               for key, tensor in head.state_dict().items())
    assert model[0].weight.dtype == dtype  # as the error says
    getattr(head, name)[4, 2] = big / 1.02  # in range: converts
    assert model.to(dtype) is model and getattr(head, name)[4, 2].isfinite() and head.centroids.dtype == dtype


def test_head_buffers():
    problem = make_problem(SHAPE)
    head = flash_head(problem)
    state = head.state_dict()
    assert "embedding" not in state  # the model's own weight, shared and not saved twice
    assert {"centroids", "sampling_centroids", "cluster_tokens", "extra_ids"} <= set(state)
    assert head.embedding.data_ptr() == problem.embedding.data_ptr()
    assert head.extra_ids.tolist() == sorted(set(problem.extra_ids.tolist()))
    assert (head.vocab_size, head.hidden_dim, head.num_clusters, head.cluster_size) == (SHAPE.V, SHAPE.D, SHAPE.C, SHAPE.b)
    assert "probes=3" in repr(head)


@pytest.mark.parametrize("centroid_dtype", [None, torch.float8_e4m3fn], ids=["model-dtype", "fp8"])
def test_every_buffer_is_typed_for_type_checkers(centroid_dtype):
    # The package ships py.typed: without a class annotation, mypy and pyright type a buffer as
    # nn.Module's attribute lookup does (Tensor | Module), and a user's `head.centroids.shape` fails their check.
    problem = make_problem(SHAPE)
    for head in (flash_head(problem, centroid_dtype=centroid_dtype), DenseHead(problem.embedding)):
        hints = get_type_hints(type(head))
        # The scales are buffers only with fp8 centroids, plain None attributes otherwise.
        scales = set(FlashHead._SCALES.values()) if isinstance(head, FlashHead) else set()
        for name in {name for name, _ in head.named_buffers(recurse=False)} | scales:
            hint = hints.get(name)
            assert hint in (torch.Tensor, Optional[torch.Tensor]), f"{type(head).__name__}.{name} is typed {hint}"
            if getattr(head, name) is None:
                assert hint == Optional[torch.Tensor], f"{type(head).__name__}.{name} is None but typed {hint}"


def test_buffers_are_the_heads_own():
    # Loading a state into one head must change neither the tensors it was built from nor another
    # head built from them, and its greedy and sampling centroids stay two tensors.
    problem = make_problem(SHAPE, seed=3)
    centroids, table = problem.centroids.clone(), problem.cluster_tokens.clone()
    head, twin = (FlashHead(problem.embedding, centroids, table, problem.probes) for _ in range(2))
    other = flash_head(make_problem(SHAPE, seed=4).with_(embedding=problem.embedding))
    expected = twin.next_token(problem.hidden)
    head.load_state_dict(other.state_dict())
    assert torch.equal(centroids, problem.centroids) and torch.equal(table, problem.cluster_tokens)
    assert torch.equal(twin.next_token(problem.hidden), expected)
    assert head.centroids.data_ptr() != head.sampling_centroids.data_ptr()


def test_state_dict_round_trip_keeps_distinct_sampling_centroids_and_special_tokens():
    problem = make_problem(SHAPE, seed=5)
    source = flash_head(problem, sampling_centroids=problem.centroids.flip(0))
    plain = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, problem.probes)
    assert plain.extra_ids.numel() == 0 and source.extra_ids.numel() > 0
    plain.load_state_dict(source.state_dict())
    for name, tensor in source.state_dict().items():
        assert torch.equal(plain.state_dict()[name], tensor), name
    assert torch.equal(plain.next_token(problem.hidden), source.next_token(problem.hidden))
    assert plain.num_candidates == source.num_candidates
    # ... and back: a state without special tokens leaves none.
    without = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, problem.probes)
    source.load_state_dict(without.state_dict())
    assert source.extra_ids.numel() == 0
    assert torch.equal(source.next_token(problem.hidden), without.next_token(problem.hidden))


@pytest.mark.parametrize("name,corrupt,fragment", [
    ("cluster_tokens", lambda t, V: t.fill_(0), "more than once"),
    ("cluster_tokens", lambda t, V: t.index_fill_(1, torch.tensor([0]), V), "ids must be in [0,"),
    ("centroids", lambda t, V: t.index_fill_(0, torch.tensor([2]), float("nan")), "must be finite"),
    ("sampling_centroids", lambda t, V: t.index_fill_(1, torch.tensor([1]), float("inf")), "must be finite"),
    ("extra_ids", lambda t, V: t.fill_(V), "special_token_ids must be in [0,"),
])
def test_load_state_dict_checks_what_it_loads(name, corrupt, fragment):
    problem = make_problem(SHAPE, seed=6)
    head = flash_head(problem)
    before = {key: tensor.clone() for key, tensor in head.state_dict().items()}
    state = {key: tensor.clone() for key, tensor in head.state_dict().items()}
    corrupt(state[name], SHAPE.V)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        head.load_state_dict(state)
    for key, tensor in head.state_dict().items():  # refused before anything was copied in
        assert torch.equal(tensor, before[key]), key


@pytest.mark.parametrize("name", ["centroids", "sampling_centroids"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float8_e5m2])
def test_load_state_dict_refuses_centroids_the_constructor_refuses(name, dtype):
    # They were cast: integer values ranked other clusters, with all keys matched.
    problem = make_problem(SHAPE, seed=8)
    head = flash_head(problem)
    before = head.next_token(problem.hidden)
    state = dict(head.state_dict())
    state[name] = (state[name] * 3).to(dtype)
    with pytest.raises(TypeError, match=re.escape(f"{name} in the state dict must be a float16, bfloat16, float32 or "
                                                  f"float64 tensor (centroid_dtype=torch.float8_e4m3fn quantizes them), "
                                                  f"got {dtype}")):
        head.load_state_dict(state)
    assert torch.equal(head.next_token(problem.hidden), before)


@pytest.mark.parametrize("centroid_dtype", [None, torch.float8_e4m3fn], ids=["plain", "fp8"])
def test_float64_centroids_are_taken_in_the_constructor_and_a_state(centroid_dtype):
    # float64 centroids (a clustering fitted in float64) are float ones: cast as the head keeps them,
    # not refused with the integer dtypes.
    problem = make_problem(SHAPE, seed=8)
    head = flash_head(problem, centroid_dtype=centroid_dtype)
    built = flash_head(replace(problem, centroids=problem.centroids.double()), centroid_dtype=centroid_dtype)
    assert built.centroids.dtype == head.centroids.dtype and torch.equal(built.centroids, head.centroids)
    if centroid_dtype is None:  # an fp8 head's state holds fp8 centroids
        state = dict(head.state_dict())
        state["centroids"] = state["centroids"].flip(0).double()
        built.load_state_dict(state)
        assert built.centroids.dtype == torch.float32 and torch.equal(built.centroids, head.centroids.flip(0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_heads_sample_and_quantize_as_under_float32_whatever_the_default_dtype(dtype):
    # DenseHead drew its Gumbel noise in the default dtype (bfloat16 never drew a token 8 nats below
    # the top), and fp8 centroids' scale took it, which every later call refused.
    problem = make_problem(SHAPE, seed=9)
    dense, fp8 = DenseHead(problem.embedding), flash_head(problem, centroid_dtype=torch.float8_e4m3fn)
    draws = [dense.sample(problem.hidden, 0.7, generator=torch.Generator().manual_seed(3)), fp8.next_token(problem.hidden),
             fp8.sample(problem.hidden, 0.7, generator=torch.Generator().manual_seed(3))]
    with default_dtype(dtype):
        built = flash_head(problem, centroid_dtype=torch.float8_e4m3fn)
        assert built.centroid_scale.dtype == torch.float32 and ops.quantize_centroids(problem.centroids)[1].dtype == torch.float32
        again = [dense.sample(problem.hidden, 0.7, generator=torch.Generator().manual_seed(3)), built.next_token(problem.hidden),
                 built.sample(problem.hidden, 0.7, generator=torch.Generator().manual_seed(3))]
    for want, got in zip(draws, again):
        for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (want, got))):
            assert torch.equal(a, b)


def test_state_dicts_from_before_extra_ids_was_always_saved_still_load():
    problem = make_problem(SHAPE, seed=7)
    head = flash_head(problem)
    plain = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, problem.probes)
    old = plain.state_dict()
    del old["extra_ids"]  # a head without special tokens saved it as None, so not at all
    old._metadata[""]["version"] = 1
    head.load_state_dict(old)  # strict
    assert head.extra_ids.numel() == 0
    assert torch.equal(head.next_token(problem.hidden), plain.next_token(problem.hidden))
    # ... and pickled heads of that time hold None, and no centroid scales (before fp8 centroids);
    # later ones held the scales as None buffers, which are attributes now (torch.export).
    plain._buffers["extra_ids"] = None
    for scales in ({}, {"centroid_scale": None, "sampling_centroid_scale": None}):
        del plain.__dict__["centroid_scale"], plain.__dict__["sampling_centroid_scale"]
        plain._buffers.update(scales)
        restored = pickle.loads(pickle.dumps(plain))
        assert restored.extra_ids.numel() == 0 and restored.num_candidates == problem.probes * SHAPE.b
        assert restored.centroid_scale is None and "centroid_scale" not in restored._buffers
        assert torch.equal(restored.next_token(problem.hidden), head.next_token(problem.hidden))
        plain = restored


def test_a_state_dict_without_metadata_and_extra_ids_misses_them():
    # Only a state saved as version 1 (its metadata says so) may leave out extra_ids; a dict rebuilt
    # without the metadata (filtered, or read from safetensors) misses them instead of dropping EOS.
    problem = make_problem(SHAPE, seed=7)
    head = flash_head(problem)
    state = {key: tensor for key, tensor in head.state_dict().items() if key != "extra_ids"}
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "extra_ids"'):
        head.load_state_dict(state)
    assert head.load_state_dict(state, strict=False).missing_keys == ["extra_ids"]
    assert torch.equal(head.extra_ids, problem.extra_ids.to(torch.int32).unique())


def test_load_state_dict_with_assign_keeps_the_heads_dtypes():
    problem = make_problem(SHAPE, seed=9)
    head = flash_head(problem.with_(embedding=problem.embedding.bfloat16()))
    state = {**flash_head(problem).state_dict()}  # float32 centroids
    state["cluster_tokens"] = state["cluster_tokens"].long()
    head.load_state_dict(state, assign=True)
    assert head.centroids.dtype == head.sampling_centroids.dtype == torch.bfloat16
    assert head.cluster_tokens.dtype == torch.int32
    assert torch.equal(head.next_token(problem.hidden.bfloat16()), flash_head(problem.with_(
        embedding=problem.embedding.bfloat16(), centroids=problem.centroids.bfloat16())).next_token(problem.hidden.bfloat16()))


def test_a_state_of_tensors_that_need_grad_loads_as_the_heads_own_leaves():
    # Centroids refined as Parameters elsewhere: assign=True tied the buffers to their graph, so every
    # call built one and copy.deepcopy refused the head.
    problem = make_problem(SHAPE, seed=29)
    state = {name: value.clone().requires_grad_() if value.is_floating_point() else value
             for name, value in flash_head(problem).state_dict().items()}
    for assign in (False, True):
        head = flash_head(make_problem(SHAPE, seed=30).with_(embedding=problem.embedding))
        head.load_state_dict(state, assign=assign)
        for name, buffer in head.named_buffers():
            assert buffer.is_leaf and not buffer.requires_grad, (assign, name)
        tokens, logprobs = copy.deepcopy(head).sample(problem.hidden, 0.9, torch.Generator().manual_seed(3))
        assert logprobs.grad_fn is None
        assert torch.equal(head.next_token(problem.hidden), flash_head(problem).next_token(problem.hidden))


def test_a_cast_of_every_tensor_is_refused_before_it_rounds_the_token_ids():
    # Module.type() casts integer buffers too: float16 rounds token ids past 2048, and the error the
    # next call gave advised a cast back, which kept the rounded ids.
    problem = make_problem(SHAPE, seed=31)
    head = flash_head(problem)
    want = head.next_token(problem.hidden)
    for dtype in (torch.float16, torch.float64, torch.int64):
        with pytest.raises(TypeError, match=re.escape(f"FlashHead.type({dtype}) would cast cluster_tokens and extra_ids, "
                                                      f"the head's int32 token ids, to {dtype}: convert the head with "
                                                      ".to(dtype) or .half(), which cast only its float tensors. The "
                                                      "head is unchanged")):
            head.type(dtype)
        assert all(buffer.dtype == problem.embedding.dtype for buffer in (head.centroids, head.embedding))
        assert head.cluster_tokens.dtype == head.extra_ids.dtype == torch.int32
    assert torch.equal(head.next_token(problem.hidden), want)
    assert head.half().cluster_tokens.dtype == torch.int32  # the float casts go on


def test_a_non_contiguous_embedding_warns():
    # The ops read contiguous rows, so each call would copy the whole embedding.
    problem = make_problem(SHAPE, seed=14)
    strided = problem.embedding.t().contiguous().t()
    with pytest.warns(UserWarning, match="is not contiguous, so every call copies it whole"):
        head = FlashHead(strided, problem.centroids, problem.cluster_tokens, problem.probes)
    assert torch.equal(head.next_token(problem.hidden), flash_head(problem.with_(extra_ids=None)).next_token(problem.hidden))
    # So does a strided weight given to a head: the README's way to swap the weight.
    head = flash_head(problem)
    with pytest.warns(UserWarning, match="is not contiguous, so every call copies it whole") as record:
        head.embedding = strided
    assert record[0].filename == __file__


class _WithHead(torch.nn.Module):
    """A model's output layer and a head built over its weight (an nn.Parameter)."""

    def __init__(self, problem, kind, **kw):
        super().__init__()
        self.lm_head = torch.nn.Linear(SHAPE.D, SHAPE.V, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(problem.embedding)
        self.head = (DenseHead(self.lm_head.weight) if kind == "dense" else
                     FlashHead(self.lm_head.weight, problem.centroids, problem.cluster_tokens, SHAPE.C, **kw))


def _saved_and_loaded(module):
    # torch.save, not pickle.dumps: plain pickle cannot hold float8 tensors (torch 2.14).
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _shares_weight(model) -> bool:
    return model.head.embedding.data_ptr() == model.lm_head.weight.data_ptr()


@pytest.mark.parametrize("kind", ["dense", "flash", "flash-fp8"])
def test_a_head_follows_its_models_weight_through_copies_and_conversions(kind):
    # Built over an nn.Parameter, the head uses that weight after copy.deepcopy and torch.save /
    # torch.load of the model (which copy the two apart) and after its half() (which converts them apart).
    fp8 = {"centroid_dtype": torch.float8_e4m3fn} if kind == "flash-fp8" else {}
    problem, other = make_problem(SHAPE, seed=10), make_problem(SHAPE, seed=11)
    model, source = _WithHead(problem, kind[:5], **fp8), _WithHead(other, kind[:5], **fp8)
    want = source.head.next_token(problem.hidden)
    for copied in (copy.deepcopy(model), _saved_and_loaded(model)):
        assert _shares_weight(copied)
        copied.load_state_dict(source.state_dict())
        assert torch.equal(copied.head.next_token(problem.hidden), want)
    model.half()
    assert torch.equal(model.head.next_token(problem.hidden.half()), _WithHead(problem, kind[:5], **fp8).half().head
                       .next_token(problem.hidden.half())) and _shares_weight(model)
    # load_state_dict(assign=True) gives the model a new weight: the head runs on what it is given.
    model.float().load_state_dict(source.state_dict(), assign=True)
    model.head.embedding = model.lm_head.weight.detach()
    for converted in (model.float(), copy.deepcopy(model)):
        assert torch.equal(converted.head.next_token(problem.hidden), want)


@pytest.mark.parametrize("kind", ["dense", "flash", "flash-fp8"])
def test_a_head_follows_its_models_weight_through_share_memory(kind):
    # share_memory() moved the weight's storage, and the buffer's with it, away from the address the
    # head had noted: the head let the weight go, and the next half() gave it a copy of its own.
    fp8 = {"centroid_dtype": torch.float8_e4m3fn} if kind == "flash-fp8" else {}
    problem = make_problem(SHAPE, seed=14)
    model = _WithHead(problem, kind[:5], **fp8)
    assert _shares_weight(model.share_memory()) and model.lm_head.weight.is_shared()
    assert _shares_weight(model.half())
    with torch.no_grad():
        model.lm_head.weight.neg_()
    assert torch.equal(model.head.next_token(problem.hidden.half()),
                       _WithHead(problem, kind[:5], **fp8).half().head.next_token(-problem.hidden.half()))


@pytest.mark.parametrize("kind", ["dense", "flash"])
def test_a_weight_given_as_a_parameter_is_followed_as_the_constructors_is(kind):
    # Assigned as given, the Parameter became a parameter of the head's: in its state dict (which a
    # fresh head then refused), and its next conversion failed with a bare KeyError: 'embedding'.
    problem, other = make_problem(SHAPE, seed=12), make_problem(SHAPE, seed=13)
    model, source = _WithHead(problem, kind), _WithHead(other, kind)
    keys = set(model.state_dict())
    model.head.embedding = source.lm_head.weight  # not detached
    assert list(model.head.named_parameters()) == [] and set(model.state_dict()) == keys
    assert torch.equal(model.head.next_token(problem.hidden), source.head.next_token(problem.hidden))
    model.head.embedding = model.lm_head.weight  # its own model's: shared again, and through half()
    assert _shares_weight(model) and _shares_weight(model.half())
    assert torch.equal(model.head.next_token(problem.hidden.half()),
                       _WithHead(problem, kind).half().head.next_token(problem.hidden.half()))
    model.head.to(torch.bfloat16)  # a conversion of the head alone: its own copy from then on
    assert model.head.embedding.dtype == torch.bfloat16 and model.lm_head.weight.dtype == torch.float16


class _OwnWeight(torch.nn.Module):
    """A module whose own nn.Parameter is the output weight, registered before its head."""

    def __init__(self, problem, kind):
        super().__init__()
        self.weight = torch.nn.Parameter(problem.embedding.clone())
        self.head = (DenseHead(self.weight) if kind == "dense" else
                     FlashHead(self.weight, problem.centroids, problem.cluster_tokens, SHAPE.C))


@pytest.mark.parametrize("kind", ["dense", "flash"])
def test_a_modules_own_weight_is_converted_after_its_head(kind):
    # As the docs say: torch converts a module's children before its own parameters, so the head
    # converts first and keeps a copy of its own, which in-place updates of the weight miss.
    problem = make_problem(SHAPE, seed=14)
    model = _OwnWeight(problem, kind)
    assert model.head.embedding.data_ptr() == model.weight.data_ptr()
    model.half()
    assert model.head.embedding.data_ptr() != model.weight.data_ptr()
    assert torch.equal(model.head.embedding, model.weight.detach())
    want = model.head.next_token(problem.hidden.half())
    with torch.no_grad():
        model.weight.mul_(-1)
    assert torch.equal(model.head.next_token(problem.hidden.half()), want)


@pytest.mark.parametrize("kind", ["dense", "flash", "flash-fp8"])
@pytest.mark.parametrize("alone", [False, True], ids=["in-model", "alone"])
def test_a_head_refuses_to_run_on_the_empty_embedding_of_to_empty(kind, alone):
    # A move to the meta device replaces a module's weight by a new Parameter, and to_empty() leaves
    # the buffer without values, which no state dict refills (it is not persistent): the head
    # raises until it is given the weight again.
    fp8 = {"centroid_dtype": torch.float8_e4m3fn} if kind == "flash-fp8" else {}
    problem, other = make_problem(SHAPE, seed=12), make_problem(SHAPE, seed=13)
    model, source = _WithHead(problem, kind[:5], **fp8), _WithHead(other, kind[:5], **fp8)
    target = model.head if alone else model
    target.to("meta").to_empty(device="cpu")
    model.load_state_dict(source.state_dict())
    with pytest.raises(ValueError, match="embedding was emptied by to_empty"):
        model.head.next_token(problem.hidden)
    model.head.embedding = model.lm_head.weight.detach()
    want = source.head.next_token(problem.hidden)
    assert torch.equal(model.head.next_token(problem.hidden), want)
    # What it was given stays: no conversion or copy takes the head back to a weight it had before.
    model.float()
    assert torch.equal(model.head.next_token(problem.hidden), want)
    assert torch.equal(copy.deepcopy(model).head.next_token(problem.hidden), want)


@pytest.mark.parametrize("kind", ["dense", "flash", "flash-fp8"])
@pytest.mark.parametrize("alone", [False, True], ids=["in-model", "alone"])
@pytest.mark.parametrize("from_meta", [False, True], ids=["materialised", "from-meta"])
def test_a_head_emptied_by_to_empty_runs_only_once_its_clusters_and_weight_are_back(kind, alone, from_meta):
    # to_empty() gives every tensor new storage without values, off the meta device as from it. A
    # model's own checkpoint then restores its weight but not the head's clusters, and the head
    # decoded from whatever the memory held, or, given the weight again, ran on its emptied tables.
    fp8 = {"centroid_dtype": torch.float8_e4m3fn} if kind == "flash-fp8" else {}
    problem = make_problem(SHAPE, seed=15)
    model = _WithHead(problem, kind[:5], **fp8)
    state = copy.deepcopy(model.state_dict())
    want = model.head.next_token(problem.hidden)
    target = model.head if alone else model
    (target.to("meta") if from_meta else target).to_empty(device="cpu")
    model.load_state_dict({"lm_head.weight": state["lm_head.weight"]}, strict=False)  # the model's checkpoint alone
    if kind != "dense":
        model.head.embedding = model.lm_head.weight
        with pytest.raises(ValueError, match=r"waits for .*centroids \(emptied by to_empty\(\), it has no values\)"):
            model.head.next_token(problem.hidden)
        # Filled in parts (a sharded checkpoint's loads, or assignments as transformers' loaders make):
        # the head says what still has no values, and runs once everything has. The empty extra_ids (no
        # special tokens) had no values to lose.
        first = "head.cluster_tokens"  # fp8 centroids load with their scale
        rest = sorted(key for key in state if key.startswith("head.") and key not in (first, "head.extra_ids"))
        model.load_state_dict({first: state[first]}, strict=False)
        missing = "; ".join(f"{key.removeprefix('head.')} (emptied by to_empty(), it has no values)" for key in rest)
        with pytest.raises(ValueError, match=re.escape(f"waits for {missing}: ")):
            model.head.sample(problem.hidden)
        if alone:
            for key in rest:
                setattr(model.head, key.removeprefix("head."), state[key].clone())
        else:
            for key in rest:  # one tensor a shard: fp8 scales come before their centroids
                model.load_state_dict({key: state[key]}, strict=False)
    else:
        with pytest.raises(ValueError, match="embedding was emptied by to_empty"):
            model.head.next_token(problem.hidden)
        model.head.embedding = model.lm_head.weight
    assert torch.equal(model.head.next_token(problem.hidden), want)


@either_head
def test_a_new_embedding_is_checked_when_given(make_head):
    problem = make_problem(SHAPE, torch.float32, "cpu")
    head = make_head(problem)
    for bad, error, message in ((None, TypeError, "embedding must be a torch.Tensor"),
                                (problem.embedding.double(), TypeError, "embedding must be float16, bfloat16 or float32"),
                                (problem.embedding[:, :0], ValueError, "embedding must be a non-empty 2-D tensor")):
        with pytest.raises(error, match=message):
            head.embedding = bad
    fewer_rows = problem.embedding[:-3].clone()
    if isinstance(head, FlashHead):  # its cluster tables index the rows: fewer would silently never be chosen
        with pytest.raises(ValueError, match=re.escape(f"embedding must have the head's shape [{SHAPE.V}, {SHAPE.D}] "
                                                       f"(its clusters index those rows), got [{SHAPE.V - 3}, {SHAPE.D}]")):
            head.embedding = fewer_rows
    else:
        head.embedding = fewer_rows
        assert head.vocab_size == SHAPE.V - 3
    head.embedding = problem.embedding.clone()  # a weight of the head's shape is taken
    assert torch.equal(head.next_token(problem.hidden), make_head(problem).next_token(problem.hidden))
    # FlashHead's centroids keep their dtype: a bfloat16 weight (load_state_dict(assign=True) from a
    # bfloat16 checkpoint) failed its next call with an error about centroids.
    bf16 = problem.embedding.bfloat16()
    if isinstance(head, FlashHead):
        with pytest.raises(TypeError, match=re.escape("embedding must have the dtype and device of the head's centroids "
                                                      "(torch.float32 on cpu), got torch.bfloat16 on cpu: convert the head "
                                                      "first")):
            head.embedding = bf16
        head.to(torch.bfloat16)
    head.embedding = bf16
    assert torch.equal(head.next_token(problem.hidden.bfloat16()),
                       make_head(problem).to(torch.bfloat16).next_token(problem.hidden.bfloat16()))
    if isinstance(head, FlashHead):  # fp8 centroids score hidden states of any float dtype
        fp8 = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, SHAPE.p,
                        centroid_dtype=torch.float8_e4m3fn)
        want = fp8.next_token(problem.hidden)
        fp8.embedding = bf16
        assert fp8.next_token(problem.hidden.bfloat16()).shape == want.shape


@pytest.mark.parametrize("kind", ["flash", "flash-fp8"])
def test_a_head_loaded_onto_a_meta_model_takes_the_materialised_weight(kind):
    # load_state_dict(assign=True) materialises the centroids, not the (non-persistent) embedding
    # buffer, which stays on meta: the weight given afterwards is checked against the centroids.
    fp8 = {"centroid_dtype": torch.float8_e4m3fn} if kind == "flash-fp8" else {}
    problem = make_problem(SHAPE, seed=15)
    source = _WithHead(problem, "flash", **fp8)
    model = _WithHead(problem, "flash", **fp8).to("meta")
    model.load_state_dict(source.state_dict(), assign=True)
    model.head.embedding = model.lm_head.weight.detach()
    assert torch.equal(model.head.next_token(problem.hidden), source.head.next_token(problem.hidden))


def test_a_meta_head_given_a_weight_is_told_to_take_memory_first():
    # It was told to head.to('cpu'), which torch refuses from meta.
    problem = make_problem(SHAPE, seed=16)
    head = flash_head(problem).to("meta")
    with pytest.raises(TypeError, match=re.escape("got torch.float32 on cpu: give the head memory and its clusters first "
                                                  "(head.to_empty(device='cpu'), then head.load_state_dict(...) with its "
                                                  "centroids and cluster table), then give it the weight")):
        head.embedding = problem.embedding
    head.to_empty(device="cpu")
    head.load_state_dict(flash_head(problem).state_dict())
    head.embedding = problem.embedding
    assert torch.equal(head.next_token(problem.hidden), flash_head(problem).next_token(problem.hidden))


def test_heads_loaded_with_assign_from_one_state_keep_buffers_of_their_own():
    # assign=True would keep the state's tensors where they fit: the two heads and the source would
    # then share them, and a later load into one would change the others' tokens.
    problem = make_problem(SHAPE, seed=21)
    other = make_problem(SHAPE, seed=22).with_(embedding=problem.embedding)  # another clustering
    source = flash_head(problem)
    state = source.state_dict()
    loaded = [flash_head(other), flash_head(other)]
    for head in loaded:
        head.load_state_dict(state, assign=True)
    for name, _ in source.named_buffers():
        if name != "embedding":  # the weight, kept by reference
            pointers = {head.get_buffer(name).data_ptr() for head in (source, *loaded)}
            assert len(pointers) == 3, name
    want = source.next_token(problem.hidden)
    loaded[0].load_state_dict(flash_head(other).state_dict())
    assert torch.equal(loaded[1].next_token(problem.hidden), want)
    assert torch.equal(source.next_token(problem.hidden), want)


def test_a_meta_head_loaded_with_assign_takes_the_states_special_tokens():
    problem = make_problem(SHAPE, seed=23)
    source = flash_head(problem)
    head = flash_head(problem).to("meta")
    head.load_state_dict(source.state_dict(), assign=True)
    head.embedding = problem.embedding
    assert not head.extra_ids.is_meta and torch.equal(head.extra_ids, source.extra_ids)
    assert torch.equal(head.next_token(problem.hidden), source.next_token(problem.hidden))
    flash_head(problem).load_state_dict(head.state_dict())  # its state loads elsewhere


def test_a_state_that_leaves_tokens_out_of_every_cluster_warns():
    # A head over a vocabulary 5 tokens smaller has a table of the same shape (it pads 5 slots more):
    # loaded here, it leaves this head's last 5 tokens in no cluster, so they can never be produced.
    problem = make_problem(SHAPE, seed=24)
    smaller = make_problem(replace(SHAPE, pad=SHAPE.pad + 5, extras=False), seed=24)
    head = flash_head(problem.with_(extra_ids=None))
    with pytest.warns(UserWarning, match=f"leave 5 of this head's {SHAPE.V} tokens in no cluster") as record:
        head.load_state_dict(flash_head(smaller).state_dict())
    assert record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        head.load_state_dict(flash_head(problem.with_(extra_ids=None)).state_dict())  # a table covering every token
        # A token moved from its cluster to the special tokens is still produced.
        state = head.state_dict()
        table, moved = state["cluster_tokens"].clone(), int(state["cluster_tokens"][0, 0])
        table[0, 0] = -1
        head.load_state_dict({**state, "cluster_tokens": table, "extra_ids": torch.tensor([moved], dtype=torch.int32)})
    # One token left out warns too.
    with pytest.warns(UserWarning, match=rf"leave 1 of this head's {SHAPE.V} tokens in no cluster .*\({moved}\)"):
        head.load_state_dict({**state, "cluster_tokens": table, "extra_ids": torch.zeros(0, dtype=torch.int32)})
    # And while fp8 centroids wait for their scale (a sharded load): the head's own tables still hold values.
    fp8 = flash_head(problem.with_(extra_ids=None), centroid_dtype=torch.float8_e4m3fn)
    fp8_state = fp8.state_dict()
    fp8.load_state_dict({"centroids": fp8_state["centroids"]}, strict=False)
    with pytest.warns(UserWarning, match=rf"leave 1 of this head's {SHAPE.V} tokens in no cluster .*\({moved}\)"):
        fp8.load_state_dict({"cluster_tokens": table, "centroid_scale": fp8_state["centroid_scale"]}, strict=False)


@pytest.mark.parametrize("strict", [True, False])
def test_a_state_of_other_shapes_is_refused_whole(strict):
    # torch copied what fitted before failing on the rest: a state of another hidden size left its
    # table and special tokens in the head (with a warning about the tokens that table left out),
    # and one of fewer clusters warned about its tokens, then failed.
    problem = make_problem(SHAPE, seed=25)
    fewer_clusters = make_problem(replace(SHAPE, C=SHAPE.C - 1), seed=25)
    narrower = make_problem(replace(SHAPE, D=SHAPE.D // 2, pad=SHAPE.pad + 5), seed=26)  # its table fits
    head = flash_head(problem.with_(extra_ids=None))
    before = {name: tensor.clone() for name, tensor in head.state_dict().items()}
    for other, mismatched in ((fewer_clusters, "centroids"), (narrower, "centroids")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RuntimeError, match=rf"size mismatch for {mismatched}: copying a param with shape "
                                                   rf"torch.Size\(\[{other.centroids.shape[0]}, {other.centroids.shape[1]}\]\)"):
                head.load_state_dict(flash_head(other).state_dict(), strict=strict)
        assert {name: tensor.shape for name, tensor in head.state_dict().items()} == \
            {name: tensor.shape for name, tensor in before.items()}
        assert all(torch.equal(tensor, before[name]) for name, tensor in head.state_dict().items())
    # Within a module, the message names the key under its prefix, as torch's own.
    holder = torch.nn.ModuleDict({"head": head})
    with pytest.raises(RuntimeError, match="size mismatch for head.cluster_tokens"):
        holder.load_state_dict({"head." + k: v for k, v in flash_head(fewer_clusters).state_dict().items()})


def test_loading_special_tokens_keeps_the_buffer_when_it_fits_and_drops_repeats():
    problem = make_problem(SHAPE, seed=8)
    head = flash_head(problem)
    count = head.extra_ids.numel()
    buffer = head.extra_ids.data_ptr()  # what a captured CUDA graph reads
    state = head.state_dict()
    state["extra_ids"] = torch.arange(count, dtype=torch.int32) * 3
    head.load_state_dict(state)
    assert head.extra_ids.data_ptr() == buffer and head.extra_ids.tolist() == list(range(0, 3 * count, 3))
    state["extra_ids"] = torch.tensor([7, 3, 7], dtype=torch.int32)
    head.load_state_dict(state)
    assert head.extra_ids.tolist() == [3, 7]  # as the constructor keeps them
