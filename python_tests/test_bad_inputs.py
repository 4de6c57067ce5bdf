"""One test per class of bad input: the exception type and a message naming the argument.

The checks live in the C++ ops (shared by the CPU and CUDA paths) and in the Python wrappers, so
every op is called through flashhead_ext.ops on every device; a few classes are also checked on
the raw torch.ops.flashhead ops.
"""
import re

import pytest
import torch

from flashhead_ext import DenseHead, FlashHead, ops
from helpers import DEVICES, Shape, expect_compiled, make_problem, raw_call, required_tensor_arguments, seed_tensor

SHAPE = Shape(B=3, D=16, C=7, b=4, p=2, pad=1, extras=True)


def valid_args(device):
    problem = make_problem(SHAPE, device=device)
    return {
        "hidden": problem.hidden, "centroids": problem.centroids, "cluster_tokens": problem.cluster_tokens,
        "embedding": problem.embedding, "probes": problem.probes, "extra_ids": problem.extra_ids,
        "temperature": 0.8, "seed": seed_tensor(5, device),
        "cluster_ids": torch.tensor([[0, 6], [1, 2], [3, 3]], dtype=torch.int32, device=device),
        "candidate_ids": torch.tensor([[0, 5, 9], [1, 2, 3], [4, 4, -1]], dtype=torch.int32, device=device),
        "out": torch.empty(SHAPE.B, dtype=torch.int64, device=device),
    }


CALLS = {
    "select_clusters": lambda a: ops.select_clusters(a["hidden"], a["centroids"], a["probes"]),
    "sample_clusters": lambda a: ops.sample_clusters(a["hidden"], a["centroids"], a["probes"], a["temperature"], seed=a["seed"]),
    "gather_candidates": lambda a: ops.gather_candidates(a["cluster_ids"], a["cluster_tokens"], a["extra_ids"]),
    "candidate_logits": lambda a: ops.candidate_logits(a["hidden"], a["embedding"], a["candidate_ids"]),
    "decode_greedy": lambda a: ops.decode_greedy(a["hidden"], a["centroids"], a["cluster_tokens"], a["embedding"],
                                                 a["probes"], a["extra_ids"]),
    "decode_greedy_out": lambda a: ops.decode_greedy(a["hidden"], a["centroids"], a["cluster_tokens"], a["embedding"],
                                                     a["probes"], a["extra_ids"], out=a["out"]),
    "decode_sample": lambda a: ops.decode_sample(a["hidden"], a["centroids"], a["cluster_tokens"], a["embedding"],
                                                 a["probes"], a["temperature"], a["extra_ids"], seed=a["seed"]),
}
USES = {
    "select_clusters": {"hidden", "centroids", "probes"},
    "sample_clusters": {"hidden", "centroids", "probes", "temperature", "seed"},
    "gather_candidates": {"cluster_ids", "cluster_tokens", "extra_ids"},
    "candidate_logits": {"hidden", "embedding", "candidate_ids"},
    "decode_greedy": {"hidden", "centroids", "cluster_tokens", "embedding", "probes", "extra_ids"},
    "decode_greedy_out": {"hidden", "centroids", "cluster_tokens", "embedding", "probes", "extra_ids", "out"},
    "decode_sample": {"hidden", "centroids", "cluster_tokens", "embedding", "probes", "temperature", "seed", "extra_ids"},
}


def cases(*names):
    """(op, argument) pairs for every op taking one of ``names``."""
    return [(op, name) for op in CALLS for name in names if name in USES[op]]


def expect(error, fragment, op, args):
    with pytest.raises(error, match=re.escape(fragment)):
        CALLS[op](args)


device_params = pytest.mark.parametrize("device", DEVICES)


@device_params
@pytest.mark.parametrize("op", list(CALLS))
def test_valid_arguments_are_accepted(op, device):
    CALLS[op](valid_args(device))  # the baseline every bad-input test below perturbs


@device_params
@pytest.mark.parametrize("op,name", cases("hidden", "centroids", "cluster_tokens", "embedding", "cluster_ids",
                                          "candidate_ids", "extra_ids", "out"))
def test_non_tensor_argument(op, name, device):
    args = valid_args(device)
    args[name] = args[name].tolist()
    expect(TypeError, name, op, args)


@device_params
@pytest.mark.parametrize("op", [op for op in CALLS if "hidden" in USES[op]])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.bool, torch.float8_e4m3fn], ids=str)
def test_unsupported_float_dtype(op, dtype, device):
    args = valid_args(device)
    for name in ("hidden", "centroids", "embedding"):
        args[name] = args[name].to(dtype)
    expect(TypeError, "hidden must be float16, bfloat16 or float32", op, args)


@device_params
@pytest.mark.parametrize("op,name", cases("centroids", "embedding"))
def test_mismatched_float_dtypes(op, name, device):
    args = valid_args(device)
    args[name] = args[name].to(torch.bfloat16)
    # dtypes named as Python prints them, not as ATen's Float / BFloat16; centroids may also be fp8
    also = " or be torch.float8_e4m3fn" if name == "centroids" else ""
    expect(TypeError, f"{name} must have the dtype of hidden (torch.float32){also}, got torch.bfloat16", op, args)


@device_params
@pytest.mark.parametrize("op,name", cases("cluster_tokens", "cluster_ids", "candidate_ids", "extra_ids"))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int16], ids=str)
def test_ids_must_be_int32(op, name, dtype, device):
    args = valid_args(device)
    args[name] = args[name].to(dtype)
    expect(TypeError, f"{name} must be int32, got {dtype}", op, args)


@device_params
@pytest.mark.parametrize("op,name", cases("hidden", "centroids", "embedding", "cluster_tokens", "cluster_ids",
                                          "candidate_ids", "extra_ids", "out"))
def test_wrong_rank(op, name, device):
    args = valid_args(device)
    value = args[name]
    args[name] = value.flatten() if value.dim() == 2 else value.unsqueeze(0)
    expect(ValueError, f"{name} must be a {value.dim()}-D tensor", op, args)


@pytest.mark.parametrize("op,name", cases("hidden", "centroids", "embedding", "cluster_tokens", "cluster_ids",
                                          "candidate_ids", "extra_ids", "out"))
def test_wrong_rank_compiled(op, name):
    # Fewer dimensions: the fake kernels index the sizes they read (more reach the C++ checks).
    args = valid_args("cpu")
    value = args[name]
    args[name] = value[0]
    expect_compiled(f"{name} must be a {value.dim()}-D tensor", CALLS[op], args)


@pytest.mark.parametrize("op", [op for op in CALLS if "probes" in USES[op]])
@pytest.mark.parametrize("probes", [0, -1])
def test_probes_below_one_compiled(op, probes):
    args = valid_args("cpu")
    args["probes"] = probes
    expect_compiled("probes must be", CALLS[op], args)


@device_params
@pytest.mark.parametrize("op,name", cases("centroids", "embedding"))
def test_hidden_dim_mismatch(op, name, device):
    args = valid_args(device)
    args[name] = torch.cat([args[name], args[name][:, :1]], dim=1)
    expect(ValueError, f"{name} must have hidden_dim {SHAPE.D} columns like hidden", op, args)


@device_params
@pytest.mark.parametrize("op,name", cases("centroids", "embedding"))
def test_row_count_past_int32_ids(op, name, device):
    # 2^31 rows (a stride-0 view: no memory) are one more than int32 ids can number; 2^31 - 1 is the bound.
    args = valid_args(device)
    args[name] = args[name][:1].expand(2**31, -1)
    expect(ValueError, f"{name} has 2147483648 rows; ids are int32, so at most 2^31 - 1", op, args)


@device_params
@pytest.mark.parametrize("op", [op for op in CALLS if "probes" in USES[op]])
@pytest.mark.parametrize("probes", [0, SHAPE.C + 1, -1])
def test_probes_out_of_range(op, probes, device):
    args = valid_args(device)
    args["probes"] = probes
    expect(ValueError, f"probes must be in 1..{SHAPE.C}", op, args)


@device_params
@pytest.mark.parametrize("op", [op for op in CALLS if "probes" in USES[op]])
@pytest.mark.parametrize("probes", [2.0, True, "2", torch.tensor(2)], ids=repr)
def test_probes_not_an_int(op, probes, device):
    args = valid_args(device)
    args["probes"] = probes
    expect(TypeError, "probes must be a Python int", op, args)


@device_params
@pytest.mark.parametrize("op", [op for op in CALLS if "temperature" in USES[op]])
@pytest.mark.parametrize("temperature", [0.0, -0.5, float("inf"), float("nan"), 0, 1e-40, 9.9e-7, 1.01e6, 1e300])
def test_temperature_out_of_range(op, temperature, device):
    args = valid_args(device)
    args["temperature"] = temperature
    expect(ValueError, "temperature must be in [1e-06, 1e+06]", op, args)


@device_params
def test_temperature_bounds_sample_correctly(device):
    # Inside the range the float32 arithmetic holds: at the lower bound the draw is the greedy
    # token with probability 1 (not the lowest id, as overflowed keys would give), and at the
    # upper bound masked slots (the repeated extra id) stay -inf rather than NaN.
    args = valid_args(device)
    low, high = ops.TEMPERATURE_RANGE
    greedy = CALLS["decode_greedy"](args)
    for seed in range(3):
        args["seed"] = seed_tensor(seed, device)
        args["temperature"] = low
        tokens, logprobs = CALLS["decode_sample"](args)
        assert torch.equal(tokens, greedy)
        assert torch.equal(logprobs, torch.zeros_like(logprobs))
        args["temperature"] = high
        tokens, logprobs = CALLS["decode_sample"](args)
        assert torch.isfinite(logprobs).all() and (logprobs < 0).all()


@device_params
@pytest.mark.parametrize("op", [op for op in CALLS if "temperature" in USES[op]])
def test_temperature_not_a_number(op, device):
    args = valid_args(device)
    args["temperature"] = "warm"
    expect(TypeError, "temperature must be a Python float or int", op, args)
    args["temperature"] = True  # an int to Python, but no temperature
    expect(TypeError, "temperature must be a Python float or int, got bool", op, args)


@pytest.mark.parametrize("op", [op for op in CALLS if "temperature" in USES[op]])
def test_numpy_scalars_are_refused_by_name(op):
    # Python numbers only (torch.compile traces numpy scalars as arrays); the message says how to convert.
    np = pytest.importorskip("numpy")
    args = valid_args("cpu")
    expect(TypeError, "probes must be a Python int, got numpy.int64 (convert it with int())", op,
           dict(args, probes=np.int64(args["probes"])))
    expect(TypeError, "temperature must be a Python float or int, got numpy.float32 (convert it with float())", op,
           dict(args, temperature=np.float32(args["temperature"])))
    # numpy.float64 too, though it is a float subclass: compiled, it is an array all the same.
    expect(TypeError, "temperature must be a Python float or int, got numpy.float64 (convert it with float())", op,
           dict(args, temperature=np.float64(args["temperature"])))


@pytest.mark.parametrize("op", [op for op in CALLS if "temperature" in USES[op]])
@pytest.mark.parametrize("temperature", [10**400, -10**400], ids=["huge", "-huge"])
def test_temperature_beyond_float64(op, temperature):
    # An int that float() cannot convert: its OverflowError named no argument.
    args = dict(valid_args("cpu"), temperature=temperature)
    expect(ValueError, "temperature must fit in a float64, got an int of 1329 bits", op, args)


@pytest.mark.parametrize("op", [op for op in CALLS if "probes" in USES[op]])
def test_probes_beyond_int64(op):
    args = valid_args("cpu")
    args["probes"] = 2**63
    expect(ValueError, "probes must fit in int64", op, args)


@device_params
@pytest.mark.parametrize("op", [op for op in CALLS if "seed" in USES[op]])
def test_seed_and_generator(op, device):
    a = valid_args(device)
    operands = {"sample_clusters": ("hidden", "centroids", "probes"),
                "decode_sample": ("hidden", "centroids", "cluster_tokens", "embedding", "probes")}[op]

    def call(**seeding):
        return getattr(ops, op)(*(a[name] for name in operands), **seeding)

    with pytest.raises(TypeError, match="generator must be a torch.Generator, got int"):
        call(generator=5)
    with pytest.raises(ValueError, match="give seed or generator, not both"):
        call(seed=3, generator=torch.Generator(device))
    with pytest.raises(ValueError, match="seed must fit in int64"):
        call(seed=2**64)
    assert all(torch.equal(x, y) for x, y in zip(call(seed=3), call(seed=3)))  # each alone is fine


@device_params
@pytest.mark.parametrize("op", [op for op in CALLS if "seed" in USES[op]])
@pytest.mark.parametrize("seed,error,fragment", [
    (lambda d: torch.tensor(5, dtype=torch.int32, device=d), TypeError, "seed must be an int64 tensor"),
    (lambda d: torch.tensor(5.0, device=d), TypeError, "seed must be an int64 tensor"),
    (lambda d: torch.tensor([5, 6], device=d), ValueError, "seed must hold exactly one value"),
    (lambda d: torch.empty(0, dtype=torch.int64, device=d), ValueError, "seed must hold exactly one value"),
    (lambda d: 5.5, TypeError, "seed must be a Python int"),
    (lambda d: "5", TypeError, "seed must be a Python int"),
], ids=["int32", "float", "two-values", "empty", "float-scalar", "string"])
def test_bad_seed(op, seed, error, fragment, device):
    args = valid_args(device)
    args["seed"] = seed(device)
    expect(error, fragment, op, args)


@device_params
@pytest.mark.parametrize("op", [op for op in CALLS if "seed" in USES[op]])
def test_seed_of_shape_one_and_python_int_are_accepted(op, device):
    args = valid_args(device)
    reference = CALLS[op](args)
    for seed in (torch.tensor([5], device=device), 5):
        args["seed"] = seed
        for got, want in zip(CALLS[op](args), reference):
            assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("op,name", cases("centroids", "embedding", "cluster_tokens", "cluster_ids", "candidate_ids",
                                          "extra_ids", "seed", "out"))
def test_device_mismatch(op, name):
    args = valid_args("cuda")
    args[name] = args[name].cpu()
    with pytest.raises(ValueError, match="must be on the same device as") as error:
        CALLS[op](args)
    assert name in str(error.value)


@pytest.mark.gpu
@pytest.mark.parametrize("op", [op for op in CALLS if "hidden" in USES[op]])
def test_hidden_on_another_device(op):
    args = valid_args("cuda")
    args["hidden"] = args["hidden"].cpu()
    with pytest.raises(ValueError, match="must be on the same device as") as error:
        CALLS[op](args)
    assert "hidden" in str(error.value)


@pytest.mark.parametrize("op", list(CALLS))
def test_meta_argument_among_cpu_ones(op):
    # One meta tensor sends the call to the fake kernel (a weight left on meta by lazy loading),
    # which must reject it as the C++ ops reject a tensor on another device, not return
    # uninitialised memory.
    args = valid_args("cpu")
    name = next(n for n in ("embedding", "centroids", "cluster_tokens", "candidate_ids") if n in USES[op])
    args[name] = args[name].to("meta")
    expect(ValueError, f"{name} must be on the same device as", op, args)
    everything_meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    result = CALLS[op](everything_meta)  # shapes only: what torch.compile's fake tensors rely on
    assert all(t.device.type == "meta" for t in (result if isinstance(result, tuple) else (result,)))


def test_meta_argument_passed_by_keyword():
    args = valid_args("cpu")
    with pytest.raises(ValueError, match="centroids must be on the same device as hidden"):
        torch.ops.flashhead.select_clusters(hidden=args["hidden"], centroids=args["centroids"].to("meta"), probes=2)


@pytest.mark.gpu
def test_generator_on_another_device():
    args = valid_args("cuda")
    with pytest.raises(ValueError, match="generator must be a cuda generator"):
        ops.decode_sample(*[args[k] for k in ("hidden", "centroids", "cluster_tokens", "embedding", "probes")],
                          generator=torch.Generator("cpu"))


@device_params
@pytest.mark.parametrize("op", ["decode_greedy", "decode_greedy_out", "decode_sample"])
@pytest.mark.parametrize("rows", [SHAPE.C - 1, SHAPE.C + 1])
def test_cluster_table_rows_must_match_centroids(op, rows, device):
    args = valid_args(device)
    table = args["cluster_tokens"]
    args["cluster_tokens"] = table[:rows] if rows < SHAPE.C else torch.cat([table, table[:1]])
    expect(ValueError, f"cluster_tokens must have one row per centroid (centroids has {SHAPE.C} rows)", op, args)


@device_params
@pytest.mark.parametrize("op,name,fragment", [
    ("select_clusters", "centroids", "centroids must have at least one row"),
    ("candidate_logits", "embedding", "embedding must have at least one row"),
    ("gather_candidates", "cluster_tokens", "cluster_tokens must be non-empty"),
    ("decode_greedy", "hidden", "hidden_dim must be at least 1"),
])
def test_empty_tables(op, name, fragment, device):
    args = valid_args(device)
    args[name] = args[name][:0] if name != "hidden" else args[name][:, :0]
    expect(ValueError, fragment, op, args)


@device_params
@pytest.mark.parametrize("op", ["gather_candidates", "decode_greedy", "decode_sample"])
def test_cluster_table_without_slots(op, device):
    # One row per centroid but no token slots ([C, 0]): refused like an empty table, not taken as
    # clusters with nothing in them (the candidates would be the extra ids alone).
    args = valid_args(device)
    args["cluster_tokens"] = args["cluster_tokens"][:, :0]
    expect(ValueError, f"cluster_tokens must be non-empty, got shape [{SHAPE.C}, 0]", op, args)


@device_params
@pytest.mark.parametrize("name,value,error,fragment", [
    ("candidate_ids", lambda a: a["candidate_ids"][:2], ValueError, f"candidate_ids must have batch {SHAPE.B}"),
    ("out", lambda a: a["out"][:2], ValueError, f"out must have batch {SHAPE.B}"),
    ("out", lambda a: a["out"].int(), TypeError, "out must be int64"),
    # A float out that requires grad: the dtype is named, not autograd's in-place refusal of a leaf.
    ("out", lambda a: a["out"].float().requires_grad_(), TypeError, "out must be int64, got torch.float32"),
    # The CUDA kernel writes out element by element: two elements at one address would race.
    ("out", lambda a: a["out"][:1].expand(SHAPE.B), ValueError, "out must not have elements that share memory"),
    # ... nor share memory with an input: one row's token is written while others still read it.
    ("out", lambda a: a["hidden"].view(torch.int64).flatten()[:SHAPE.B], ValueError,
     "out must not share memory with hidden"),
    # ... also through a second storage object over the same memory, which storage identity misses,
    ("out", lambda a: torch.utils.dlpack.from_dlpack(a["embedding"]).view(torch.int64).flatten()[-SHAPE.B:],
     ValueError, "out must not share memory with embedding"),
], ids=["candidate-batch", "out-batch", "out-dtype", "out-dtype-requires-grad", "out-overlap", "out-aliases-hidden", "out-another-storage"])
def test_batch_and_out_mismatch(name, value, error, fragment, device):
    args = valid_args(device)
    args[name] = value(args)
    op = "candidate_logits" if name == "candidate_ids" else "decode_greedy_out"
    expect(error, fragment, op, args)


@device_params
def test_each_greedy_op_names_itself(device):
    # The out form's checks had named decode_greedy on CPU and CUDA, and decode_greedy_out on meta.
    args = valid_args(device)
    args["probes"] = SHAPE.C + 1
    for op in ("decode_greedy", "decode_greedy_out"):
        expect(ValueError, f"flashhead.{op}: probes must be", op, args)
    args = valid_args(device)
    args["out"] = args["out"][:2]
    expect(ValueError, f"flashhead.decode_greedy_out: out must have batch {SHAPE.B}", "decode_greedy_out", args)
    args["out"] = valid_args(device)["out"].to("meta")  # sent to the fake kernel, whose device check names it
    expect(ValueError, "flashhead.decode_greedy_out: out must be on the same device as hidden", "decode_greedy_out", args)


@device_params
def test_out_back_to_back_with_an_input_is_apart(device):
    # Byte ranges that touch without overlapping share nothing: out right after hidden in one buffer.
    args = valid_args(device)
    hidden = args["hidden"]
    buffer = torch.empty(hidden.nbytes + SHAPE.B * 8, dtype=torch.uint8, device=device)
    args["hidden"] = buffer[:hidden.nbytes].view(hidden.dtype).view(hidden.shape).copy_(hidden)
    args["out"] = buffer[hidden.nbytes:].view(torch.int64)
    expected = CALLS["decode_greedy"](args)
    assert torch.equal(CALLS["decode_greedy_out"](args), expected)


@device_params
@pytest.mark.parametrize("name", ["hidden", "centroids", "cluster_tokens", "embedding", "extra_ids"])
def test_out_must_not_share_memory_with_any_input(name, device):
    # Each input in turn holds the first bytes of one buffer whose last B int64 are out (the int32
    # tables as well as the float rows): on CUDA one row's token is written while others still read it.
    args = valid_args(device)
    value = args[name]
    size = max(-(-value.nbytes // 8) * 8, SHAPE.B * 8)
    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    args[name] = buffer[:value.nbytes].view(value.dtype).view(value.shape).copy_(value)
    args["out"] = buffer[size - SHAPE.B * 8:].view(torch.int64)
    expect(ValueError, f"out must not share memory with {name}", "decode_greedy_out", args)


@device_params
@pytest.mark.parametrize("shared", ["hidden's last element", "out's last element"])
def test_out_sharing_one_element_at_an_end_is_refused(shared, device):
    # Spans end after their last element: a check one element short saw no overlap of one end.
    args = valid_args(device)
    hidden = args["hidden"]
    out_bytes = SHAPE.B * 8
    if shared == "hidden's last element":  # hidden's last 4 bytes are out's first
        buffer = torch.zeros(4 + hidden.nbytes + out_bytes, dtype=torch.uint8, device=device)
        hidden_at, out_at = 4, hidden.nbytes
    else:  # out's last int64 holds hidden's first 2 elements
        buffer = torch.zeros(out_bytes - 8 + hidden.nbytes, dtype=torch.uint8, device=device)
        hidden_at, out_at = out_bytes - 8, 0
    args["hidden"] = buffer[hidden_at:hidden_at + hidden.nbytes].view(hidden.dtype).view(hidden.shape).copy_(hidden)
    args["out"] = buffer[out_at:out_at + out_bytes].view(torch.int64)
    expect(ValueError, "out must not share memory with hidden", "decode_greedy_out", args)


@device_params
def test_raw_ops_check_too(device):
    # The C++ checks guard torch.ops.flashhead callers that bypass the Python wrappers.
    a = valid_args(device)
    raw = torch.ops.flashhead
    with pytest.raises(ValueError, match=re.escape("probes must be in 1..")):
        raw.select_clusters(a["hidden"], a["centroids"], 0)
    with pytest.raises(TypeError, match=re.escape("cluster_tokens must be int32")):
        raw.decode_greedy(a["hidden"], a["centroids"], a["cluster_tokens"].long(), a["embedding"], 2, None)
    with pytest.raises(ValueError, match=re.escape("temperature must be in [1e-06, 1e+06]")):
        raw.decode_sample(a["hidden"], a["centroids"], a["cluster_tokens"], a["embedding"], 2, 0.0, a["seed"], None)
    with pytest.raises(ValueError, match=re.escape("seed must hold exactly one value")):
        raw.sample_clusters(a["hidden"], a["centroids"], 2, 1.0, a["seed"].expand(2))


@device_params
@pytest.mark.parametrize("op,name", [(op, name) for op in CALLS for name in required_tensor_arguments(op)])
def test_raw_op_with_none_for_a_tensor(op, name, device):
    # torch.ops passes None for a Tensor argument as an undefined tensor, which the checks reported
    # as shape [0] or failed on with "tensor does not have a device" or "Unimplemented scalar type".
    with pytest.raises(TypeError, match=re.escape(f"{name} must be a tensor, got None")):
        raw_call(op, valid_args(device), **{name: None})


# ------------------------------------------------------------------------------------------
# validate_cluster_table and the heads.

@pytest.mark.parametrize("mutate,error,fragment", [
    (lambda t, V: t.index_put_((torch.tensor(2), torch.tensor(1)), torch.tensor(V, dtype=t.dtype)), ValueError,
     "ids must be in [0,"),
    (lambda t, V: t.index_put_((torch.tensor(0), torch.tensor(0)), torch.tensor(-2, dtype=t.dtype)), ValueError,
     "ids must be in [0,"),
    (lambda t, V: t.index_put_((torch.tensor(4), torch.tensor(3)), t[1][t[1] >= 0][0]), ValueError, "more than once"),
    (lambda t, V: t.index_fill_(0, torch.tensor(3), -1), ValueError, "holds only padding"),
    (lambda t, V: t.flatten(), ValueError, "must be a non-empty 2-D tensor"),
    (lambda t, V: t[:0], ValueError, "must be a non-empty 2-D tensor"),
    (lambda t, V: t.float(), TypeError, "cluster_tokens must hold integer token ids"),
    # Not torch's "Cannot copy out of meta tensor", which names nothing (a table left on meta by lazy loading).
    (lambda t, V: t.to("meta"), ValueError, "cluster_tokens is on the meta device, which holds no values"),
], ids=["id-too-large", "id-below-padding", "duplicate", "all-padding", "rank", "empty", "float", "meta"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_validate_cluster_table(mutate, error, fragment, dtype):
    problem = make_problem(SHAPE)
    table = problem.cluster_tokens.to(dtype)
    ops.validate_cluster_table(table, problem.vocab)  # the valid table passes (padding included)
    with pytest.raises(error, match=re.escape(fragment)):
        ops.validate_cluster_table(mutate(table.clone(), problem.vocab), problem.vocab)


def test_validate_cluster_table_argument_types():
    table = make_problem(SHAPE).cluster_tokens
    with pytest.raises(TypeError, match="cluster_tokens must be a torch.Tensor"):
        ops.validate_cluster_table(table.tolist(), 27)
    with pytest.raises(TypeError, match="vocab_size must be a Python int"):
        ops.validate_cluster_table(table, 27.0)
    with pytest.raises(ValueError, match="vocab_size must be at least 1, got 0"):
        ops.validate_cluster_table(table, 0)
    # Memory in the table's size: a vocabulary of 2^41 ids (16 TB of counts) is no problem.
    ops.validate_cluster_table(table, 2**41)


def head_args(device="cpu"):
    p = make_problem(SHAPE, device=device)
    return dict(embedding=p.embedding, centroids=p.centroids, cluster_tokens=p.cluster_tokens, probes=p.probes,
                special_token_ids=p.extra_ids.tolist())


@pytest.mark.parametrize("change,error,fragment", [
    (dict(special_token_ids=[SHAPE.V]), ValueError, "special_token_ids must be in [0, 27)"),
    (dict(special_token_ids=[-1, 3]), ValueError, "special_token_ids must be in [0, 27)"),
    (dict(special_token_ids=[1.5]), TypeError, "special_token_ids must be integer token ids"),
    (dict(special_token_ids="eos"), TypeError, "special_token_ids must be integer token ids"),
    # Past int64 still an id out of range, not ids of another type.
    (dict(special_token_ids=[2**64]), ValueError, "special_token_ids must be in [0, 27), got [18446744073709551616]"),
    (dict(special_token_ids=(3, -2**63 - 1)), ValueError, "special_token_ids must be in [0, 27), got [3, -9223372036854775809]"),
    (dict(special_token_ids=2**63), ValueError, "special_token_ids must be in [0, 27), got [9223372036854775808]"),
    (dict(special_token_ids={1, "eos"}), TypeError, "special_token_ids must be integer token ids"),
    (dict(special_token_ids={1.5, 2}), TypeError, "special_token_ids must be integer token ids"),
    (dict(special_token_ids=[True, 1]), TypeError, "special_token_ids must be integer token ids"),
    (dict(special_token_ids=[torch.tensor(True), 1]), TypeError, "special_token_ids must be integer token ids"),
    (dict(special_token_ids=[(1, False)]), TypeError, "special_token_ids must be integer token ids"),
    (dict(special_token_ids=[3 + 5j]), TypeError, "special_token_ids must be integer token ids"),
    (dict(special_token_ids=torch.tensor([1.7 + 2j])), TypeError,
     "special_token_ids must be integer token ids (a sequence or set of ints, or an integer tensor), got torch.complex64"),
    (dict(special_token_ids=torch.tensor([1, 0, 2]).to_sparse()), TypeError,
     "special_token_ids must be a dense tensor (layout torch.strided), got a torch.sparse_coo tensor"),
    (dict(centroid_dtype=torch.float8_e4m3fn, sampling_centroids=lambda a: torch.zeros_like(a["centroids"])), ValueError,
     "sampling_centroids must be finite and not all zero to be quantized"),
    (dict(centroid_dtype=torch.float8_e4m3fn, sampling_centroids=lambda a: torch.full_like(a["centroids"], 1e-45)),
     ValueError, "sampling_centroids are too small to quantize"),
    (dict(special_token_ids=[None]), TypeError, "special_token_ids must be integer token ids (a sequence or set of "
                                                "ints, or an integer tensor), got [None]"),
    (dict(special_token_ids=torch.tensor([1]).to("meta")), ValueError,
     "special_token_ids is a meta tensor: its ids have no values"),
    (dict(centroids=lambda a: a["centroids"][:, :-1]), ValueError, "centroids must have shape [num_clusters, 16]"),
    (dict(centroids=lambda a: a["centroids"][0]), ValueError, "centroids must have shape [num_clusters, 16]"),
    (dict(centroids=lambda a: a["centroids"][:0]), ValueError, "centroids must have shape [num_clusters, 16]"),
    (dict(centroids=lambda a: a["centroids"].int()), TypeError, "centroids must be a float16, bfloat16, float32 or float64 tensor"),
    (dict(centroids=lambda a: a["centroids"].index_fill(0, torch.tensor([2]), float("nan"))), ValueError,
     "centroids must be finite"),
    (dict(sampling_centroids=lambda a: a["centroids"].index_fill(1, torch.tensor([0]), float("inf"))), ValueError,
     "sampling_centroids must be finite"),
    (dict(centroids=lambda a: a["centroids"].tolist()), TypeError, "centroids must be a torch.Tensor"),
    (dict(sampling_centroids=lambda a: a["centroids"][:, :-1]), ValueError, "sampling_centroids must have shape"),
    (dict(sampling_centroids=lambda a: a["centroids"][:-1]), ValueError,
     f"sampling_centroids must have one row per cluster like centroids ({SHAPE.C})"),
    (dict(cluster_tokens=lambda a: a["cluster_tokens"][:-1]), ValueError, "cluster_tokens must have one row per centroid"),
    (dict(cluster_tokens=lambda a: a["cluster_tokens"].clamp(min=0)), ValueError, "more than once"),
    (dict(probes=0), ValueError, "probes must be in 1..7"),
    (dict(probes=SHAPE.C + 1), ValueError, "probes must be in 1..7"),
    (dict(probes=1.5), TypeError, "probes must be a Python int"),
    (dict(embedding=lambda a: a["embedding"][0]), ValueError, "embedding must be a non-empty 2-D tensor"),
    (dict(embedding=lambda a: a["embedding"].double()), TypeError, "embedding must be float16, bfloat16 or float32"),
    (dict(embedding=lambda a: a["embedding"].tolist()), TypeError, "embedding must be a torch.Tensor"),
    (dict(embedding=lambda a: a["embedding"].to("meta")), ValueError, "centroids is on the meta device, which holds no values (centroids are kept on the embedding's device, so a meta embedding puts them there too)"),
    (dict(centroids=lambda a: a["centroids"].to("meta")), ValueError, "centroids is on the meta device, which holds no values"),
    (dict(sampling_centroids=lambda a: a["centroids"].to("meta")), ValueError, "sampling_centroids is on the meta device"),
    (dict(cluster_tokens=lambda a: a["cluster_tokens"].to("meta")), ValueError, "cluster_tokens is on the meta device"),
], ids=lambda v: None)
def test_flashhead_constructor_errors(change, error, fragment):
    args = head_args()
    FlashHead(**args)  # baseline
    for key, value in change.items():
        args[key] = value(args) if callable(value) else value
    with pytest.raises(error, match=re.escape(fragment)):
        FlashHead(**args)


@pytest.mark.parametrize("make_head", [lambda a: FlashHead(**a), lambda a: DenseHead(a["embedding"])],
                         ids=["FlashHead", "DenseHead"])
def test_head_call_errors(make_head):
    head = make_head(head_args())
    hidden = make_problem(SHAPE).hidden
    for call in (head.next_token, head.sample, head.candidate_logits):
        with pytest.raises(ValueError, match=re.escape(f"hidden must have last dimension {SHAPE.D}")):
            call(hidden[:, :-1])
        with pytest.raises(ValueError, match="hidden must have last dimension"):
            call(torch.tensor(1.0))
        with pytest.raises(TypeError, match=re.escape("hidden must have the head's dtype torch.float32")):
            call(hidden.half())
        with pytest.raises(TypeError, match="hidden must be a torch.Tensor"):
            call(hidden.tolist())
    # One element for every row's token: DenseHead's argmax wrote them all there, the last one winning.
    for rows in (SHAPE.B, 2):
        with pytest.raises(ValueError, match=re.escape("out must not have elements that share memory")):
            head.next_token(hidden[:rows], out=torch.empty(1, dtype=torch.int64).expand(rows))
    for temperature in (0.0, -1.0, float("inf"), float("nan"), 1e-40, 1e300):
        with pytest.raises(ValueError, match=re.escape("temperature must be in [1e-06, 1e+06]")):
            head.sample(hidden, temperature)
    for temperature in ops.TEMPERATURE_RANGE:  # both ends are taken
        tokens, logprobs = head.sample(hidden, temperature, torch.Generator().manual_seed(1))
        assert tokens.shape == (SHAPE.B,) and bool((logprobs <= 0).all())
    with pytest.raises(TypeError, match="temperature must be a Python float or int"):
        head.sample(hidden, "hot")
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        head.sample(hidden, 1.0, generator="cpu")


def test_flashhead_cast_out_of_its_dtypes_is_named():
    # DenseHead runs in float64; FlashHead's ops do not, and the message must not blame hidden.
    head = FlashHead(**head_args()).double()
    hidden = make_problem(SHAPE).hidden.double()
    for call in (head.next_token, head.sample, head.candidate_logits):
        with pytest.raises(TypeError, match=re.escape("the head's dtype is torch.float64; FlashHead runs in float16, "
                                                      "bfloat16 or float32: cast it back (e.g. head.float())")):
            call(hidden)
    head.float()
    assert torch.equal(head.next_token(hidden.float()), FlashHead(**head_args()).next_token(hidden.float()))


def test_flashhead_probes_setter():
    head = FlashHead(**head_args())
    head.probes = SHAPE.C
    assert head.num_candidates == SHAPE.C * SHAPE.b + len(set(head_args()["special_token_ids"]))
    with pytest.raises(ValueError, match=re.escape("probes must be in 1..7")):
        head.probes = 0
    with pytest.raises(TypeError, match="probes must be a Python int"):
        head.probes = 2.0
    assert head.probes == SHAPE.C


@pytest.mark.gpu
def test_head_hidden_on_another_device():
    head = FlashHead(**head_args("cuda"))
    with pytest.raises(ValueError, match="hidden must be on the head's device"):
        head.next_token(make_problem(SHAPE).hidden)


def test_dense_head_checks_out_before_the_logits():
    # A hidden of another batch than out is refused by name before its logits (here [2^40, V]:
    # a stride-0 hidden costs nothing) are computed.
    head = DenseHead(head_args()["embedding"])
    hidden = make_problem(SHAPE).hidden[:1].expand(2**40, SHAPE.D)
    with pytest.raises(ValueError, match=re.escape(f"out must be int64 [{2**40}]")):
        head.next_token(hidden, out=torch.empty(SHAPE.B, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("make_head", [lambda a: FlashHead(**a), lambda a: DenseHead(a["embedding"])],
                         ids=["FlashHead", "DenseHead"])
@pytest.mark.parametrize("device,other", [("cpu", "cuda"), ("cuda", "cpu")])
def test_head_sample_generator_on_another_device(make_head, device, other):
    # DenseHead passed it to torch.rand, whose RuntimeError named no argument.
    head = make_head(head_args(device))
    with pytest.raises(ValueError, match=f"generator must be a {device} generator like hidden, got one on {other}"):
        head.sample(make_problem(SHAPE, device=device).hidden, generator=torch.Generator(other))


# (op, argument, a stride-0 value of a size past the CUDA kernels' int indices, the message)
CUDA_LIMIT_CASES = [
    ("select_clusters", "hidden", lambda t: t[:1].expand(2**40, -1), "the batch size (hidden.size(0)) is 1099511627776"),
    ("decode_sample", "cluster_tokens", lambda t: t[:, :1].expand(-1, 2**40), "cluster_size (cluster_tokens.size(1)) is"),
    ("decode_greedy", "extra_ids", lambda t: t[:1].expand(2**40), "the number of extra ids (extra_ids.size(0)) is"),
    ("gather_candidates", "cluster_tokens", lambda t: t[:1].expand(2**32 + 1, -1),
     "the number of clusters (cluster_tokens.size(0)) is 4294967297"),
    ("gather_candidates", "cluster_ids", lambda t: t[:, :1].expand(-1, 2**30),
     "the number of candidates per row (cluster_ids.size(1) * cluster_tokens.size(1) + extra_ids.size(0)) is"),
    ("candidate_logits", "candidate_ids", lambda t: t[:, :1].expand(-1, 2**40),
     "the number of candidates per row (candidate_ids.size(1)) is"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("op,name,huge,fragment", CUDA_LIMIT_CASES, ids=[f"{c[0]}-{c[1]}" for c in CUDA_LIMIT_CASES])
def test_cuda_limits_are_checked_before_inputs_are_copied(op, name, huge, fragment):
    # Refused by name, as the CPU ops take them. The checks came after the inputs' contiguous
    # copies, which allocated them whole (or failed to) first, and named no argument;
    # gather_candidates did not check the cluster count at all, and took 2^32 + 1 clusters as 1.
    args = valid_args("cuda")
    args[name] = huge(args[name])
    expect(ValueError, fragment, op, args)


@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR "in beta", quantization deprecated, nested prototype
@pytest.mark.parametrize("kind", ["sparse_coo", "sparse_csr", "quantized", "nested"])
def test_tensors_must_be_dense(kind):
    # The ops have kernels for dense tensors only: the dispatcher's NotImplementedError ("Could not
    # run 'flashhead::decode_sample' with arguments from the 'SparseCPU' backend") and the heads'
    # reshape named no argument.
    args = valid_args("cpu")
    hidden = args["hidden"]
    other = {"sparse_coo": hidden.to_sparse, "sparse_csr": hidden.to_sparse_csr,
             "quantized": lambda: torch.quantize_per_tensor(hidden, 0.1, 0, torch.qint8),
             "nested": lambda: torch.nested.nested_tensor(list(hidden))}[kind]()
    fragment = "hidden must be a dense tensor (layout torch.strided), got a "
    expect(TypeError, fragment, "decode_sample", dict(args, hidden=other))
    for head in (FlashHead(**head_args()), DenseHead(head_args()["embedding"])):
        with pytest.raises(TypeError, match=re.escape(fragment)):
            head.next_token(other)
    if kind == "sparse_coo":  # a seed tensor is passed on without _require_tensor
        expect(TypeError, "seed must be a dense tensor", "sample_clusters", dict(args, seed=args["seed"].to_sparse()))
        with pytest.raises(TypeError, match=re.escape("embedding must be a dense tensor")):
            DenseHead(head_args()["embedding"].to_sparse())
