"""Non-contiguous inputs are accepted and give exactly the results of their contiguous copies."""
import pytest
import torch

import reference as ref
from flashhead_ext import ops
from helpers import DEVICES, Shape, at_odd_offset, make_problem, seed_tensor

SHAPE = Shape(B=6, D=24, C=37, b=4, p=5, pad=3, extras=True)


def noncontiguous(t: torch.Tensor, style: str) -> torch.Tensor:
    """Same values as ``t`` in a non-contiguous layout."""
    if style == "transposed" and t.dim() == 2:
        out = torch.empty(t.shape[1], t.shape[0], dtype=t.dtype, device=t.device).t()
    else:  # every other element of a wider buffer along the last dim
        wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        out = wide[..., ::2]
    out.copy_(t)
    assert not out.is_contiguous() and torch.equal(out, t)
    return out


def run_all(h, c, t, e, p, x, seed, cluster_ids, candidates):
    return (
        *ops.select_clusters(h, c, p),
        *ops.sample_clusters(h, c, p, 0.8, seed=seed),
        ops.gather_candidates(cluster_ids, t, x),
        ops.candidate_logits(h, e, candidates),
        ops.decode_greedy(h, c, t, e, p, x),
        *ops.decode_sample(h, c, t, e, p, 0.8, x, seed=seed),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("style", ["transposed", "strided"])
@pytest.mark.parametrize("which", ["hidden", "centroids", "cluster_tokens", "embedding", "extra_ids", "seed",
                                   "cluster_ids", "candidate_ids", "all"])
def test_noncontiguous_inputs(which, style, dtype, device):
    problem = make_problem(SHAPE, dtype, device)
    h, c, t, e, p, x = problem.args()
    cluster_ids = ref.select_clusters(h, c, p)[0]
    inputs = dict(hidden=h, centroids=c, cluster_tokens=t, embedding=e, extra_ids=x,
                  seed=seed_tensor(9, device), cluster_ids=cluster_ids,
                  candidate_ids=ref.gather_candidates(cluster_ids, t, x))
    expected = run_all(*[inputs[k] for k in ("hidden", "centroids", "cluster_tokens", "embedding")], p,
                       inputs["extra_ids"], inputs["seed"], inputs["cluster_ids"], inputs["candidate_ids"])
    for name in (inputs if which == "all" else [which]):
        if name == "seed":  # one element is always contiguous: read it through an offset view instead
            buffer = torch.tensor([-5, 9, -5], dtype=torch.int64, device=device)
            inputs[name] = buffer[1:2] if style == "strided" else buffer[1]
        else:
            inputs[name] = noncontiguous(inputs[name], style)
    got = run_all(*[inputs[k] for k in ("hidden", "centroids", "cluster_tokens", "embedding")], p,
                  inputs["extra_ids"], inputs["seed"], inputs["cluster_ids"], inputs["candidate_ids"])
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("which", ["hidden", "centroids", "embedding"])
def test_views_at_an_odd_offset(which):
    # Contiguous float32 views off the 16-byte alignment: the CPU references used them in place and
    # BLAS took another path (select_clusters' scores changed in their last bits). CPU only: the
    # CUDA kernels read such rows with an instance of their own.
    problem = make_problem(SHAPE, torch.float32)
    h, c, t, e, p, x = problem.args()
    cluster_ids = ref.select_clusters(h, c, p)[0]
    rest = (p, x, seed_tensor(9, "cpu"), cluster_ids, ref.gather_candidates(cluster_ids, t, x))
    expected = run_all(h, c, t, e, *rest)
    inputs = dict(hidden=h, centroids=c, embedding=e)
    inputs[which] = at_odd_offset(inputs[which])
    got = run_all(inputs["hidden"], inputs["centroids"], t, inputs["embedding"], *rest)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_expanded_hidden(device):
    # Stride-0 rows (one hidden state broadcast over the batch) behave as a materialised copy.
    problem = make_problem(SHAPE, torch.float32, device)
    expanded = problem.hidden[2:3].expand(SHAPE.B, -1)
    copied = expanded.contiguous()
    h, c, t, e, p, x = problem.args()
    assert torch.equal(ops.decode_greedy(expanded, c, t, e, p, x), ops.decode_greedy(copied, c, t, e, p, x))
    a = ops.decode_sample(expanded, c, t, e, p, 0.8, x, seed=4)
    b = ops.decode_sample(copied, c, t, e, p, 0.8, x, seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ids_a, scores_a = ops.select_clusters(expanded, c, p)
    assert torch.equal(ids_a, ops.select_clusters(copied, c, p)[0])
