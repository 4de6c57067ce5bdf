"""torch.library.opcheck on every op: schema, fake kernel, autograd registration, AOT dispatch."""
import pytest
import torch

import reference as ref
from helpers import DEVICES, Shape, check_no_backward, compiled, make_problem, seed_tensor

OPS = torch.ops.flashhead
INPUTS = [
    (Shape(B=1, D=8, C=5, b=3, p=1), torch.float32),
    (Shape(B=3, D=7, C=37, b=4, p=2, pad=3, extras=True), torch.bfloat16),
    (Shape(B=17, D=64, C=37, b=16, p=37, pad=1, extras=True), torch.float16),
]
input_params = pytest.mark.parametrize("shape,dtype", INPUTS, ids=[f"{s}-{d}" for s, d in INPUTS])
device_params = pytest.mark.parametrize("device", DEVICES)


def op_arguments(op, problem):
    h, c, t, e, p, x = problem.args()
    seed = seed_tensor(1234, problem.device)
    cluster_ids = ref.select_clusters(h, c, p)[0]
    candidates = ref.gather_candidates(cluster_ids, t, x)
    return {
        "select_clusters": (h, c, p),
        "sample_clusters": (h, c, p, 0.7, seed),
        "gather_candidates": (cluster_ids, t, x),
        "candidate_logits": (h, e, candidates),
        "decode_greedy": (h, c, t, e, p, x),
        "decode_greedy_out": (h, c, t, e, p, x, torch.empty(h.shape[0], dtype=torch.int64, device=problem.device)),
        "decode_sample": (h, c, t, e, p, 0.7, seed, x),
    }[op]


@device_params
@input_params
@pytest.mark.parametrize("op", ["select_clusters", "sample_clusters", "gather_candidates", "candidate_logits",
                                "decode_greedy", "decode_greedy_out", "decode_sample"])
def test_opcheck(op, shape, dtype, device):
    problem = make_problem(shape, dtype, device)
    torch.library.opcheck(getattr(OPS, op).default, op_arguments(op, problem))


def test_every_op_has_the_autograd_kernel_that_refuses_a_backward():
    # torch_bindings.cpp lists the ops again for their autograd and autocast kernels: an op added to
    # the schema block but not to that list would fall back to torch's default, device-dependent
    # autograd, and its CPU reference's ATen calls would be autocast.
    ops = [name for name in torch._C._dispatch_get_all_op_names() if name.startswith("flashhead::")]
    ops.remove("flashhead::no_derivative")  # what their backwards call
    assert len(ops) == 11
    for key in ("Autograd", "AutocastCPU", "AutocastCUDA"):  # autocast: the ops run with it off
        assert [name for name in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(name, key)] == [], key


# The ops with float results (the selections' scores, the candidates' logits, sampling's log-probs).
FLOAT_RESULTS = [("select_clusters", 1), ("sample_clusters", 1), ("candidate_logits", 0), ("decode_sample", 1)]


def entry_point(op, problem):
    """``op``'s Python entry point (flashhead_ext.ops) as a function of hidden, giving its float result."""
    from flashhead_ext import ops
    h, c, t, e, p, x = problem.args()
    candidates = ref.gather_candidates(ref.select_clusters(h, c, p)[0], t, x)
    return {
        "select_clusters": lambda hidden: ops.select_clusters(hidden, c, p)[1],
        "sample_clusters": lambda hidden: ops.sample_clusters(hidden, c, p, 0.7, seed=5)[1],
        "candidate_logits": lambda hidden: ops.candidate_logits(hidden, e, candidates),
        "decode_sample": lambda hidden: ops.decode_sample(hidden, c, t, e, p, 0.7, x, seed=5)[1],
    }[op]


# Compiled: the ops' backward raises only when it runs (torch_bindings.cpp), so torch.compile, which
# traces a backward where an input requires grad, compiles a forward that runs as eager does.
@device_params
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("call", ["op", "entry_point"])
@pytest.mark.parametrize("op,output", FLOAT_RESULTS)
def test_backward_through_an_op_raises(op, output, call, compiled, device):
    problem = make_problem(INPUTS[1][0], torch.float32, device)
    if call == "entry_point":
        check_no_backward(op, entry_point(op, problem), {"hidden": problem.hidden}, grad_input="hidden", under_compile=compiled)
        return
    overload = getattr(OPS, op).default
    args = dict(zip((a.name for a in overload._schema.arguments), op_arguments(op, problem)))
    check_no_backward(op, overload, args, grad_input="hidden", output=output, under_compile=compiled)


@device_params
@pytest.mark.parametrize("op", [op for op, _ in FLOAT_RESULTS])
def test_forward_mode_ad_through_an_op_raises(op, device):
    problem = make_problem(INPUTS[1][0], torch.float32, device)
    hidden = problem.hidden
    with pytest.raises(NotImplementedError, match=f"forward AD with flashhead::{op} that does not support it"):
        torch.func.jvp(entry_point(op, problem), (hidden,), (torch.ones_like(hidden),))


@device_params
def test_func_transforms_through_the_ops(device):
    # torch.func differentiates through an op's int results (greedy ids indexing a differentiable
    # tensor) as through any index; through a float result it raises, as backward does.
    problem = make_problem(INPUTS[1][0], torch.float32, device)
    h, c, t, e, p, x = problem.args()
    logit_of_token = lambda hidden: (hidden * e[torch.ops.flashhead.decode_greedy(hidden, c, t, e, p, x)]).sum()
    tracked = h.clone().requires_grad_()
    logit_of_token(tracked).backward()
    assert torch.equal(torch.func.grad(logit_of_token)(h), tracked.grad)
    for op in [op for op, _ in FLOAT_RESULTS]:
        call = entry_point(op, problem)
        with pytest.raises(RuntimeError, match=f"derivative for flashhead::{op} is not implemented"):
            torch.func.grad(lambda hidden: call(hidden).float().sum())(h)


@device_params
def test_backward_raises_after_an_input_changed_in_place(device):
    # The backward raises for want of a derivative, not for a saved input's version: none is saved.
    problem = make_problem(INPUTS[1][0], torch.float32, device)
    hidden = problem.hidden.clone().requires_grad_()
    scores = torch.ops.flashhead.select_clusters(hidden, problem.centroids, problem.probes)[1]
    with torch.no_grad():
        hidden.add_(1)
    with pytest.raises(RuntimeError, match="derivative for flashhead::select_clusters is not implemented"):
        scores.sum().backward()


# A compiled backward passes zeros for the results a loss does not use, where eager autograd skips
# their nodes: those zeros pass through (zeros times any derivative), so a forward that also computes
# an op's float result, say for monitoring, trains compiled as it does eagerly.
@device_params
@pytest.mark.parametrize("compiled_forward", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("op", [op for op, _ in FLOAT_RESULTS])
def test_backward_around_an_op_gives_the_gradients_without_it(op, compiled_forward, device):
    problem = make_problem(INPUTS[1][0], torch.float32, device)
    call = entry_point(op, problem)
    weight = torch.randn(problem.hidden.shape[1], problem.hidden.shape[1], device=device,
                         generator=torch.Generator(device).manual_seed(11))

    def forward(x, with_op):
        hidden = x @ weight
        return hidden, call(hidden) if with_op else None

    grads = []
    for with_op in (False, True):
        x = problem.hidden.clone().requires_grad_()
        run = compiled(forward) if compiled_forward else forward
        hidden, result = run(x, with_op)
        hidden.pow(2).sum().backward()
        assert result is None or result.requires_grad
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@device_params
@pytest.mark.parametrize("compiled_forward", [False, True], ids=["eager", "compiled"])
def test_backward_names_the_op_it_passes_through(compiled_forward, device):
    # Both ops' results depend on hidden; only the logits reach the loss, and the error names their op.
    problem = make_problem(INPUTS[1][0], torch.float32, device)
    logits_of, log_probs_of = entry_point("candidate_logits", problem), entry_point("decode_sample", problem)
    forward = lambda hidden: (logits_of(hidden), log_probs_of(hidden))
    logits, _ = (compiled(forward) if compiled_forward else forward)(problem.hidden.clone().requires_grad_())
    with pytest.raises(RuntimeError, match="derivative for flashhead::candidate_logits is not implemented"):
        logits.sum().backward()


@device_params
def test_a_gradient_of_zeros_passes_zeros_and_any_other_raises(device):
    problem = make_problem(INPUTS[1][0], torch.float32, device)
    hidden = problem.hidden.clone().requires_grad_()
    logits = entry_point("candidate_logits", problem)(hidden)
    finite = logits.isfinite()  # masked candidates' -inf logits
    (logits.masked_fill(~finite, 0) * 0).sum().backward(retain_graph=True)
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    for poke in (1e-30, float("nan")):
        grad = torch.zeros_like(logits)
        grad[-1, finite[-1].nonzero()[-1]] = poke
        with pytest.raises(RuntimeError, match="derivative for flashhead::candidate_logits is not implemented"):
            logits.backward(grad, retain_graph=True)


@pytest.mark.gpu
def test_a_backward_under_graph_capture_raises_without_reading_its_gradient():
    # A captured stream cannot be synchronised with, so there every gradient raises, and says why.
    grad, like = torch.zeros(3, 4, device="cuda"), torch.zeros(3, 5, device="cuda")
    assert torch.equal(OPS.no_derivative("candidate_logits", grad, like), torch.zeros_like(like))
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        with torch.cuda.graph(graph):
            OPS.no_derivative("candidate_logits", grad, like)


@device_params
def test_opcheck_out_into_strided_view(device):
    problem = make_problem(INPUTS[1][0], INPUTS[1][1], device)
    buffer = torch.zeros(problem.hidden.shape[0], 4, dtype=torch.int64, device=device)
    torch.library.opcheck(OPS.decode_greedy_out.default, (*problem.args(), buffer[:, 3]))


@device_params
def test_opcheck_without_extra_ids_and_empty_extra_ids(device):
    problem = make_problem(INPUTS[1][0], INPUTS[1][1], device)
    h, c, t, e, p, _ = problem.args()
    for extra in (None, torch.empty(0, dtype=torch.int32, device=device)):
        torch.library.opcheck(OPS.decode_greedy.default, (h, c, t, e, p, extra))
        torch.library.opcheck(OPS.gather_candidates.default, (ref.select_clusters(h, c, p)[0], t, extra))
