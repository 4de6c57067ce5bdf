"""Shared test helpers: device list, problem factory, tolerances, comparators, frequency tests."""
from __future__ import annotations

import contextlib
import functools
import re
import zlib
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import pytest
import torch
from scipy import stats
from torch import Tensor

import reference as ref
from flashhead_ext import ops
from flashhead_ext.graphs import capture_graph

# "cuda" entries are marked gpu here; conftest also marks any test whose parameters name a CUDA
# device, and skips them when there is no GPU or no CUDA build.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# Tests of placement across GPUs (with pytest.mark.gpu): conftest skips them with fewer, and
# `pytest -m two_gpus` picks them (scripts/device_run.sh two).
TWO_GPUS = pytest.mark.two_gpus
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Tolerance between an op's float32 scores/logits and the reference's, relative to |h|.|e| (the sum
# of absolute products, which bounds the rounding error of any summation order). Inputs are upcast
# exactly (float16/bfloat16 products are exact in float32, float32 products round once), so every
# dtype differs from the reference by float32 summation order only and the tolerance is the same:
# a kernel that multiplied or accumulated in the input dtype (or in TF32) would fail it.
SUM_RTOL = {torch.float32: 3e-5, torch.float16: 3e-5, torch.bfloat16: 3e-5}
ATOL = 1e-6
# Extra slack on Gumbel keys: logf differs between glibc and CUDA by an ulp or two.
GUMBEL_ATOL = 1e-5

# Frequency tests reject at this p-value (fixed seeds, so each test is deterministic per device).
P_VALUE = 1e-3


def at_odd_offset(t: Tensor) -> Tensor:
    """Same values as ``t``, contiguous, starting one element past an aligned address."""
    out = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape).copy_(t)
    assert out.is_contiguous() and out.data_ptr() % 16 != 0
    return out


def raw_call(op: str, args: dict, **changes):
    """``torch.ops.flashhead.<op>`` itself (no Python wrapper), its arguments taken from ``args`` by
    their schema names (those absent keep their defaults), then ``changes``."""
    schema = getattr(torch.ops.flashhead, op).default._schema
    kwargs = {a.name: args[a.name] for a in schema.arguments if a.name in args}
    return getattr(torch.ops.flashhead, op)(**{**kwargs, **changes})


def required_tensor_arguments(op: str) -> list:
    """The arguments of ``torch.ops.flashhead.<op>`` typed ``Tensor`` (not ``Tensor?``)."""
    return [a.name for a in getattr(torch.ops.flashhead, op).default._schema.arguments if str(a.type) == "Tensor"]


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def stable_seed(*key) -> int:
    """An int derived from ``key``, the same in every run (unlike hash() of strings)."""
    return zlib.crc32(repr(key).encode())


def generator(*key) -> torch.Generator:
    """A CPU generator seeded from ``key``."""
    return torch.Generator().manual_seed(stable_seed(*key))


@dataclass(frozen=True)
class Shape:
    B: int
    D: int
    C: int
    b: int
    p: int
    pad: int = 0          # padding slots (-1) in the cluster table: V = C * b - pad
    extras: bool = False  # append special tokens (one already in a chosen cluster, one repeated)

    @property
    def V(self) -> int:
        return self.C * self.b - self.pad

    def __str__(self) -> str:
        return f"B{self.B}-D{self.D}-C{self.C}-b{self.b}-p{self.p}-pad{self.pad}{'-extra' if self.extras else ''}"


@dataclass
class Problem:
    hidden: Tensor          # [B, D]
    centroids: Tensor       # [C, D]
    cluster_tokens: Tensor  # [C, b] int32, -1 = padding
    embedding: Tensor       # [V, D]
    probes: int
    extra_ids: Optional[Tensor]  # [E] int32 or None

    @property
    def vocab(self) -> int:
        return self.embedding.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.hidden.dtype

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def args(self):
        """Positional arguments of decode_greedy (and of the reference greedy path)."""
        return self.hidden, self.centroids, self.cluster_tokens, self.embedding, self.probes, self.extra_ids

    def with_(self, **changes) -> "Problem":
        return replace(self, **changes)

    def with_fp8_centroids(self) -> tuple["Problem", Tensor, Tensor]:
        """(this problem with its centroids as float8_e4m3fn quantization gives them back in float32,
        so the reference scores what the ops see; the fp8 centroids; their scale)."""
        centroids, scale = ops.quantize_centroids(self.centroids)
        return self.with_(centroids=centroids.float() * scale), centroids, scale

    def to(self, device) -> "Problem":
        move = lambda t: None if t is None else t.to(device)
        return Problem(move(self.hidden), move(self.centroids), move(self.cluster_tokens), move(self.embedding),
                       self.probes, move(self.extra_ids))

    def score_tol(self) -> Tensor:
        """Per row [B, 1]: how far an op's centroid scores may be from the reference's."""
        return SUM_RTOL[self.dtype] * ref.abs_scores(self.hidden, self.centroids).amax(1, keepdim=True) + ATOL

    def logit_tol(self) -> Tensor:
        return SUM_RTOL[self.dtype] * ref.abs_scores(self.hidden, self.embedding).amax(1, keepdim=True) + ATOL


def cluster_table(C: int, b: int, pad: int, g: torch.Generator, device="cpu") -> Tensor:
    """A random partition of V = C*b - pad tokens into C clusters of b slots; the ``pad`` padding
    slots (-1) sit at random places in distinct clusters, so no cluster is empty."""
    assert 0 <= pad <= C and (b > 1 or pad == 0)
    V = C * b - pad
    slots = torch.zeros(C, b, dtype=torch.bool, device=device)
    padded = torch.randperm(C, generator=g, device=device)[:pad]
    slots[padded, torch.randint(0, b, (pad,), generator=g, device=device)] = True
    table = torch.full((C, b), -1, dtype=torch.int32, device=device)
    table[~slots] = torch.randperm(V, generator=g, device=device).to(torch.int32)
    return table


def _values(shape, g, integer: bool, scale: float, device) -> Tensor:
    if integer:
        # Small integers: every product and partial sum is exact in float32 whatever the order, so
        # results are exact on every device and ties are plentiful (the tie-break gets exercised).
        return torch.randint(-3, 4, shape, generator=g, device=device).float()
    return torch.randn(shape, generator=g, device=device) * scale


def _build_problem(shape: Shape, dtype: torch.dtype, seed: int, integer: bool, device) -> Problem:
    g = torch.Generator(device).manual_seed(stable_seed(shape, seed, integer))
    table = cluster_table(shape.C, shape.b, shape.pad, g, device)
    hidden = _values((shape.B, shape.D), g, integer, 1.0, device).to(dtype)
    # Rows scaled by 1/sqrt(D) keep scores and logits O(1) for every D.
    centroids = _values((shape.C, shape.D), g, integer, shape.D ** -0.5, device).to(dtype)
    embedding = _values((shape.V, shape.D), g, integer, shape.D ** -0.5, device).to(dtype)
    extra = None
    if shape.extras:
        # One token of row 0's best cluster (so it is already a candidate and must be masked), one
        # random token listed twice (the repeat must be masked), and the last token.
        best_cluster = ref.select_clusters(hidden[:1], centroids, 1)[0][0, 0]
        members = table[best_cluster][table[best_cluster] >= 0]
        in_best = int(members[torch.randint(0, members.numel(), (1,), generator=g, device=device)])
        other = int(torch.randint(0, shape.V, (1,), generator=g, device=device))
        extra = torch.tensor([other, in_best, other, shape.V - 1], dtype=torch.int32, device=device)
    return Problem(hidden, centroids, table, embedding, shape.p, extra)


_build_problem_cached = functools.lru_cache(maxsize=16)(_build_problem)


def make_problem(shape: Shape, dtype=torch.float32, device="cpu", *, seed: int = 0, integer: bool = False,
                 build_on_device: bool = False) -> Problem:
    """Fresh seeded random inputs for ``shape``.

    Built on the CPU by default, so every device sees the same values (cached: callers must not
    modify the tensors); ``build_on_device`` draws them on ``device`` instead (large GPU shapes; not
    cached).
    """
    if build_on_device:
        return _build_problem(shape, dtype, seed, integer, torch.device(device))
    return _build_problem_cached(shape, dtype, seed, integer, "cpu").to(device)


# ---------------------------------------------------------------------------------------------
# Comparators. ``exact=True`` (CPU, or integer-valued data on any device) demands identical ids;
# otherwise (CUDA with a different summation order) an id may differ only where the float32
# reference itself has a near-tie: the op's choice must then be within tolerance of the best.

def assert_same_ids(actual: Tensor, expected: Tensor, what: str = "ids") -> None:
    actual, expected = actual.cpu(), expected.cpu().to(actual.dtype)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    bad = (actual != expected).reshape(actual.shape[0], -1).any(1) if actual.dim() else actual != expected
    if bad.any():
        row = int(bad.nonzero()[0, 0]) if actual.dim() else 0
        raise AssertionError(f"{what} differ in {int(bad.sum())} of {bad.numel()} rows; first row {row}: "
                             f"got {actual[row].tolist()}, expected {expected[row].tolist()}")


def _close(actual: Tensor, expected: Tensor, tol) -> Tensor:
    """Elementwise |a - e| <= tol, with equal infinities (and NaN vs NaN) counted as close."""
    same = (actual == expected) | (torch.isnan(actual) & torch.isnan(expected))
    return same | ((actual - expected).abs() <= tol)


def assert_values_close(actual: Tensor, expected: Tensor, tol, what: str = "values") -> None:
    actual, expected = actual.float().cpu(), expected.float().cpu()
    tol = tol.cpu() if isinstance(tol, Tensor) else tol
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    ok = _close(actual, expected, tol)
    if not ok.all():
        idx = tuple(int(i) for i in (~ok).nonzero()[0])
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.numel()} differ beyond tolerance; at {idx} "
                             f"got {actual[idx].item()}, expected {expected[idx].item()}")


def check_ranked_selection(ids: Tensor, keys: Tensor, probes: int, tol: Tensor, exact: bool, what="cluster_ids") -> None:
    """``ids [B, p]`` must be the ``probes`` best columns of reference ``keys [B, C]``, best first.

    Not exact: ids distinct and in range, and the key of the id at rank k within ``tol`` of the
    reference's k-th best key (so where the k-th key is separated from its neighbours by more than
    ``tol`` the id must be the reference's).
    """
    ids, keys, tol = ids.cpu().long(), ref.nan_as_neg_inf(keys.float().cpu()), tol.cpu()
    expected = ref.ranking(keys)[:, :probes]
    assert ids.shape == expected.shape, f"{what}: shape {tuple(ids.shape)} != {tuple(expected.shape)}"
    if exact:
        assert_same_ids(ids, expected, what)
        return
    assert ((ids >= 0) & (ids < keys.shape[1])).all(), f"{what}: id out of range"
    sorted_ids = ids.sort(dim=1).values
    assert (sorted_ids[:, 1:] != sorted_ids[:, :-1]).all(), f"{what}: an id repeats within a row"
    assert_values_close(keys.gather(1, ids), keys.gather(1, expected), tol, f"{what} (key of the id at each rank)")


def tokens_of(clusters: Tensor, cluster_tokens: Tensor) -> Tensor:
    table = cluster_tokens.cpu()
    members = table[clusters.cpu().long()].flatten()
    return members[members >= 0]


def check_decoded_tokens(tokens: Tensor, cluster_keys: Tensor, token_keys_dense: Tensor, problem: Problem,
                         expected: Tensor, cluster_tol: Tensor, token_tol: Tensor, exact: bool) -> None:
    """Tokens of the fused greedy path against the reference.

    ``cluster_keys [B, C]`` rank the clusters, ``token_keys_dense [B, V]`` rank the tokens
    (reference float32 values of every token), ``expected [B]`` is the reference's answer.
    Not exact: a different token is accepted only where the reference is near a tie: the token must
    belong to a cluster within ``cluster_tol`` of the p-th best (or be an extra id), and its key
    must be within ``token_tol`` of the best key over the clusters that any correct top-p holds.
    """
    tokens, expected = tokens.cpu().long(), expected.cpu().long()
    if exact:
        assert_same_ids(tokens, expected, "tokens")
        return
    keys = ref.nan_as_neg_inf(cluster_keys.float().cpu())
    tkeys = ref.nan_as_neg_inf(token_keys_dense.float().cpu())
    extra = problem.extra_ids.cpu().long() if problem.extra_ids is not None else torch.empty(0, dtype=torch.long)
    extra = extra[(extra >= 0) & (extra < problem.vocab)]
    p = problem.probes
    for row in range(tokens.shape[0]):
        got, want = int(tokens[row]), int(expected[row])
        if got == want:
            continue
        ordered = keys[row].sort(descending=True).values
        kth = ordered[p - 1]
        after = ordered[p] if p < ordered.numel() else torch.tensor(float("-inf"))
        tol_c = float(cluster_tol.reshape(-1)[row]) if cluster_tol.numel() > 1 else float(cluster_tol)
        admissible = (keys[row] >= kth - tol_c).nonzero().flatten()
        sure = (keys[row] > after + tol_c).nonzero().flatten()
        allowed = torch.cat([tokens_of(admissible, problem.cluster_tokens), extra])
        must = torch.cat([tokens_of(sure, problem.cluster_tokens), extra])
        assert got != -1 and bool((allowed == got).any()), (
            f"row {row}: token {got} is not a candidate of any admissible cluster (reference {want})")
        if must.numel():
            best = float(tkeys[row, must].max())
            tol_t = float(token_tol.reshape(-1)[row]) if token_tol.numel() > 1 else float(token_tol)
            assert float(tkeys[row, got]) >= best - tol_t, (
                f"row {row}: token {got} (key {float(tkeys[row, got])}) is not within {tol_t} of the best "
                f"key {best} (reference token {want})")


def check_decode_greedy(tokens: Tensor, problem: Problem, exact: bool) -> None:
    trace = ref.decode_greedy(*problem.args())
    if exact:
        assert_same_ids(tokens, trace.tokens, "tokens")
        return
    check_decoded_tokens(tokens, trace.cluster_scores, ref.dense_logits(problem.hidden, problem.embedding), problem,
                         trace.tokens, problem.score_tol(), problem.logit_tol(), exact=False)


def check_decode_sample(tokens: Tensor, logprobs: Tensor, problem: Problem, temperature: float, seed: int,
                        exact: bool) -> None:
    """decode_sample against the Philox reference draw for ``seed``.

    Not exact (another summation order): clusters whose Gumbel key is separated by more than the
    tolerance from every cluster on the other side of the p-th rank are certainly chosen by the op
    too; a near-tie group across that boundary may go either way. The token noise is indexed by
    token id, so a token's key does not depend on where its cluster ranks. The op's token must be
    reachable (its cluster's group reaches into the top p, or it is an extra id), and its key must
    be within tolerance of the best key over the certain candidates. Log-probabilities are
    compared where the candidate set is certain.
    """
    trace = ref.decode_sample(*problem.args()[:5], temperature, seed, problem.extra_ids)
    tokens, logprobs = tokens.cpu().long(), logprobs.cpu().float()
    logprob_tol = (2 * problem.logit_tol() / temperature + GUMBEL_ATOL).cpu().squeeze(1)
    if exact:
        assert_same_ids(tokens, trace.tokens, "tokens")
        assert_values_close(logprobs, trace.token_logprobs, logprob_tol, "token_logprobs")
        return
    B, p = tokens.shape[0], problem.probes
    table = problem.cluster_tokens.cpu().long()
    C, b = table.shape
    cluster_of = torch.full((problem.vocab,), -1, dtype=torch.long)
    members = table >= 0
    cluster_of[table[members]] = torch.arange(C).unsqueeze(1).expand(C, b)[members]
    extra = [] if problem.extra_ids is None else problem.extra_ids.tolist()
    scaled = ref.dense_logits(problem.hidden, problem.embedding).cpu() / temperature
    got_noise = ref.token_gumbel(seed, tokens.unsqueeze(1))[:, 0]  # each row's drawn token, at its row
    key_tol = problem.score_tol().cpu().squeeze(1) / temperature + GUMBEL_ATOL
    token_tol = problem.logit_tol().cpu().squeeze(1) / temperature + GUMBEL_ATOL
    candidates, token_keys = trace.candidates.cpu().long(), ref.nan_as_neg_inf(trace.token_keys.cpu())
    for row in range(B):
        got, want = int(tokens[row]), int(trace.tokens[row])
        order = ref.ranking(trace.cluster_keys[row:row + 1].cpu())[0]
        keys = ref.nan_as_neg_inf(trace.cluster_keys[row].cpu())[order]
        new_group = torch.cat([torch.tensor([True]), keys[:-1] - keys[1:] > key_tol[row]])
        group = torch.cumsum(new_group.long(), 0) - 1                     # group index of each rank
        first = torch.zeros(int(group[-1]) + 1, dtype=torch.long).scatter_reduce(0, group, torch.arange(C), "amin", include_self=False)
        last = torch.zeros_like(first).scatter_reduce(0, group, torch.arange(C), "amax", include_self=False)
        boundary_safe = p == C or bool(new_group[p])
        certain = torch.cat([(last[group[:p]] < p).repeat_interleave(b), torch.ones(len(extra), dtype=torch.bool)])
        valid = (candidates[row] >= 0) & (candidates[row] < problem.vocab) & certain
        best = float(token_keys[row][valid].max()) if valid.any() else float("-inf")
        if got >= 0 and boundary_safe:  # same candidate set: same normaliser
            # (logit - max) - log(sum), as log_softmax: logit - logsumexp loses log(sum) at small T
            row_logits = trace.scaled_logits[row].cpu()
            top = row_logits.max()
            expected = (scaled[row, got] - top) - torch.exp(row_logits - top).sum().log()
            assert_values_close(logprobs[row], expected, logprob_tol[row], f"row {row} logprob")
        if got == want:
            continue
        assert got != -1 and 0 <= got < problem.vocab, f"row {row}: token {got}, reference {want}"
        c = int(cluster_of[got])
        in_reach = c >= 0 and int(first[group[int((order == c).nonzero()[0, 0])]]) < p
        assert got in extra or in_reach, f"row {row}: token {got} cannot be a candidate (reference drew {want})"
        got_key = float(scaled[row, got]) + float(got_noise[row])
        assert got_key >= best - float(token_tol[row]), (
            f"row {row}: token {got} (key {got_key}) is not a near-tie of the reference draw {want} (key {best})")


def exact_on(device, integer: bool = False) -> bool:
    """Ids must match exactly on the CPU, and on any device when the arithmetic is exact."""
    return integer or not is_cuda(device)


# ---------------------------------------------------------------------------------------------
# Frequency tests.

def chi_square_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of observed ``counts`` against ``probs``.

    Categories with zero probability must never be observed; those with small expected counts are
    pooled so the chi-square approximation holds.
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    assert counts.shape == probs.shape
    impossible = probs <= 0
    assert counts[impossible].sum() == 0, f"{int(counts[impossible].sum())} draws of zero-probability outcomes"
    counts, probs = counts[~impossible], probs[~impossible] / probs[~impossible].sum()
    n = counts.sum()
    expected = probs * n
    small = expected < min_expected
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if counts.size < 2:
        return 1.0
    return float(stats.chisquare(counts, expected).pvalue)


def softmax_np(x: Tensor, temperature: float) -> np.ndarray:
    """softmax(x / T) in float64."""
    x = x.double().cpu() / temperature
    return torch.softmax(x, dim=-1).numpy()


def counts_of(values: Tensor, n: int) -> np.ndarray:
    return torch.bincount(values.cpu().long().flatten(), minlength=n).numpy()


def compiled(fn):
    """``fn`` under torch.compile(fullgraph=True) with inductor, after a dynamo reset."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="inductor")


def expect_compiled(fragment: str, call, args) -> None:
    """``call(args)`` compiled must raise an error whose message holds ``fragment``.

    Tracing runs the fake kernels, which read the sizes of some arguments: a bad one must be named
    there as the op names it (dynamo wraps the error, keeping its message), not fail on an
    IndexError or a negative size.
    """
    torch._dynamo.reset()
    with pytest.raises(Exception, match=re.escape(fragment)):
        torch.compile(call, backend="eager", fullgraph=True)(args)


def capture(fn):
    """``fn`` captured in a CUDA graph by the library's capture_graph (one warm-up; the garbage
    collector paused, so a dead graph of an earlier test cannot fail it); returns (graph, the
    captured run's outputs)."""
    outputs = []
    graph = capture_graph(lambda: outputs.append(fn()), warmups=1)
    return graph, outputs[-1]


def seed_tensor(value: int, device) -> Tensor:
    return torch.tensor(value, dtype=torch.int64, device=device)


# ---------------------------------------------------------------------------------------------
# Speculative decoding tests (test_speculative.py, test_fast_decoder.py).

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a shared machine a second thread spins for ~5x the time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_prompt(seed: int, vocab: int, length: int = 7) -> Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def greedy_tokens(model, ids: Tensor, new_tokens: int) -> tuple:
    """Target-only greedy decoding by a transformers model, recomputing the whole sequence each step
    (no cache): the reference every speculative mode must reproduce."""
    ids = ids.view(1, -1)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tuple(ids[0, -new_tokens:].tolist())


def random_partition(vocab: int, cluster_size: int, seed: int = 0) -> Tensor:
    """A valid but meaningless cluster table ``[ceil(V / b), b]`` (int64): a random partition of the
    vocabulary, -1 padding at the end."""
    clusters = -(-vocab // cluster_size)
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    return torch.cat([order, order.new_full((clusters * cluster_size - vocab,), -1)]).view(clusters, cluster_size)


def check_counters(gen, mode: str, k: int, max_new: int, gpu_phases: bool = False) -> None:
    """Invariants every speculative generation (eager driver or fast path) must satisfy, whatever the
    draft proposed. ``gpu_phases``: the fast path ran on a GPU, which times its phases by CUDA events."""
    s = gen.stats
    assert s.new_tokens == len(gen.tokens) <= max_new
    # Each token is emitted once: the first by the prefill, every other one by exactly one round.
    assert sum(s.emitted_per_round) == len(gen.tokens) - 1
    assert len(s.emitted_per_round) == len(s.accepted_per_round) == s.rounds
    assert s.accepted == sum(s.accepted_per_round) <= s.proposed
    assert all(1 <= e <= k + 1 for e in s.emitted_per_round)
    proposing = s.proposed // k if k else 0
    # The slack is for float sums, not for negative times (both are 0 when the prefill's token ends it).
    assert s.draft_s >= 0 and s.target_s >= 0 and s.decode_s >= s.draft_s + s.target_s - 1e-9
    assert s.draft_head_s is None or s.draft_s >= s.draft_head_s  # the fast path does not time the head apart
    if mode == "baseline":
        assert (s.proposed, s.verify_calls, s.append_calls, s.host_syncs) == (0, 0, s.rounds, s.rounds)
    elif mode == "deferred":
        # Deferred appends nothing except the tail step, which ends the generation with one token.
        assert s.verify_calls == proposing and s.skipped_verifies == 0
        assert s.append_calls == (1 if s.proposed < k * s.rounds else 0)
        assert s.host_syncs == s.rounds  # one per round
    else:
        # Ordinary verifies unless the known next token refutes the first proposal: then it accepts 0.
        assert s.verify_calls + s.skipped_verifies == proposing
        assert s.skipped_verifies == sum(1 for a in s.accepted_per_round if a == 0) - (s.rounds - proposing)
        assert s.host_syncs == s.rounds + s.verify_calls
        # One append after the first token and one after every round but the last (which ends it).
        assert s.append_calls == s.rounds
    if s.phase_s and s.rounds:  # the fast path's phases tile the rounds
        assert set(s.phase_s) <= {"propose", "verify", "finalize"}
        # From the first mark to the last, within the decode's wall time. On a GPU the marks are
        # events, which may also wait for other processes' work on the same GPU (the test workers
        # share one), so only the host clock's marks must fill that time.
        assert sum(s.phase_s.values()) <= s.decode_s + 1e-6
        if not gpu_phases:
            assert sum(s.phase_s.values()) == pytest.approx(s.decode_s, rel=0.2, abs=2e-3)


def check_no_backward(op: str, call, args: dict, grad_input: str, output: int = 0, under_compile: bool = False) -> None:
    """``call(**args)`` with ``args[grad_input]`` requiring grad gives the values it gives without
    grad, and a backward through its ``output``-th float result raises naming ``flashhead::op`` (the
    ops are for inference; none is differentiated on any device). ``under_compile``: the call with grad
    runs through ``torch.compile(fullgraph=True)`` (inductor, whose partitioner may move what the
    backward computes from its inputs alone into the forward)."""
    pick = lambda result: result[output] if isinstance(result, (tuple, list)) else result
    fresh = lambda: {k: v.clone() if isinstance(v, Tensor) else v for k, v in args.items()}  # caches written in place
    with torch.no_grad():
        expected = pick(call(**fresh()))
    tracked = fresh()
    tracked[grad_input] = tracked[grad_input].detach().requires_grad_()
    got = pick((compiled(lambda **kw: call(**kw)) if under_compile else call)(**tracked))
    assert got.requires_grad and torch.equal(got.detach(), expected), op
    with pytest.raises(RuntimeError, match=f"derivative for flashhead::{op} is not implemented"):
        got.float().sum().backward()


class PerTokenScaledHead(torch.nn.Linear):
    """An output head that scales each token's logit (as transformers' Dory does): not hidden . weight."""

    def forward(self, hidden: Tensor) -> Tensor:
        return super().forward(hidden) * torch.linspace(0.5, 2.0, self.out_features, dtype=hidden.dtype)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to ``dtype`` inside (as a script building its models in bfloat16 sets it)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def commit_made_during(monkeypatch, commits, stages, stage: str) -> list:
    """Makes ``commits.source_commit`` name "before" until ``stages.<stage>`` is first called and
    "after" from then on, as a commit made mid-run would, and ``commits.utc_stamp`` give "before UTC"
    then "after UTC", as the clock moves on; returns the list whose one item it names."""
    checkout = ["before"]
    monkeypatch.setattr(commits, "source_commit", lambda mark_dirty=False: checkout[0])
    monkeypatch.setattr(commits, "utc_stamp", lambda: f"{checkout[0]} UTC")
    real = getattr(stages, stage)

    def stage_then_commit(*args, **kwargs):
        checkout[0] = "after"
        return real(*args, **kwargs)

    monkeypatch.setattr(stages, stage, stage_then_commit)
    return checkout
