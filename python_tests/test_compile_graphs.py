"""torch.compile(fullgraph=True) and torch.export over the Python API, CUDA-graph capture and replay, and no host sync.

Compiled and captured results must equal eager ones exactly (same kernels, same inputs).
The inductor backend is used on both devices (about 5 s per compile on 2 CPU cores).
"""
import functools
import gc
import subprocess
import sys
import tempfile

import pytest
import torch

from flashhead_ext import DenseHead, FlashHead, ops
from flashhead_ext.graphs import capture_graph
from helpers import DEVICES, Shape, capture, compiled, generator, make_problem, random_partition, seed_tensor

device_params = pytest.mark.parametrize("device", DEVICES)
SHAPE = Shape(B=5, D=64, C=37, b=8, p=3, pad=2, extras=True)


def flash_head(problem):
    return FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, problem.probes,
                     special_token_ids=problem.extra_ids)


@pytest.mark.slow
@device_params
def test_compile_next_token(device):
    problem = make_problem(SHAPE, torch.bfloat16, device)
    head = flash_head(problem)
    step = compiled(head.next_token)
    for hidden in (problem.hidden, problem.hidden.flip(0).contiguous()):
        assert torch.equal(step(hidden), head.next_token(hidden))
    hidden3 = problem.hidden[:4].reshape(2, 2, SHAPE.D)
    assert torch.equal(compiled(head.next_token)(hidden3), head.next_token(hidden3))


@pytest.mark.slow
@device_params
def test_compile_next_token_out(device):
    # The destination-passing op inside a compiled function, writing into a column of a buffer.
    problem = make_problem(SHAPE, torch.float32, device)
    head = flash_head(problem)

    def step(hidden, buffer, column: int):
        head.next_token(hidden, out=buffer[:, column])
        return buffer

    buffer = torch.full((SHAPE.B, 4), -7, dtype=torch.int64, device=device)
    result = compiled(step)(problem.hidden, buffer, 2)
    expected = torch.full((SHAPE.B, 4), -7, dtype=torch.int64, device=device)
    expected[:, 2] = head.next_token(problem.hidden)
    assert torch.equal(result, expected) and torch.equal(buffer, expected)


@pytest.mark.slow
@device_params
def test_compile_dense_next_token_out(device):
    # Its check for an out made in inference mode (is_inference(), which dynamo cannot trace) must
    # not break the graph.
    problem = make_problem(SHAPE, torch.float32, device)
    head = DenseHead(problem.embedding)
    out = torch.full((SHAPE.B,), -7, dtype=torch.int64, device=device)
    assert compiled(lambda hidden: head.next_token(hidden, out=out))(problem.hidden) is out
    assert torch.equal(out, head.next_token(problem.hidden))
    # And a strided out, a column of a buffer, as FlashHead's test writes.
    buffer = torch.full((SHAPE.B, 3), -7, dtype=torch.int64, device=device)
    assert compiled(lambda hidden: head.next_token(hidden, out=buffer[:, 1]))(problem.hidden).data_ptr() == buffer[:, 1].data_ptr()
    expected = torch.full((SHAPE.B, 3), -7, dtype=torch.int64, device=device)
    expected[:, 1] = head.next_token(problem.hidden)
    assert torch.equal(buffer, expected)


@pytest.mark.slow
@device_params
def test_compile_decode_sample_and_candidate_logits(device):
    problem = make_problem(SHAPE, torch.float16, device)
    head = flash_head(problem)

    def sample(hidden, seed):
        return ops.decode_sample(hidden, problem.centroids, problem.cluster_tokens, problem.embedding,
                                 problem.probes, 0.7, problem.extra_ids, seed=seed)

    fn = compiled(sample)
    for value in (11, 12):
        seed = seed_tensor(value, device)
        got, want = fn(problem.hidden, seed), sample(problem.hidden, seed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ids, logits = compiled(head.candidate_logits)(problem.hidden)
    eager_ids, eager_logits = head.candidate_logits(problem.hidden)
    assert torch.equal(ids, eager_ids) and torch.equal(logits, eager_logits)


@pytest.mark.slow
@device_params
def test_compile_dense_sample_on_a_dynamic_batch(device):
    # Its draw passed generator=None to torch.rand, which fake tensors refuse on symbolic sizes: the
    # recompile for a second batch size failed, as did torch.export with a dynamic batch.
    problem = make_problem(SHAPE, torch.float32, device)
    head = DenseHead(problem.embedding)
    torch._dynamo.reset()
    sample = torch.compile(lambda hidden: head.sample(hidden, 0.8), fullgraph=True, dynamic=True)
    for rows in (1, 3, SHAPE.B):
        hidden = problem.hidden[:rows]
        tokens, logprobs = sample(hidden)
        expected = ((hidden @ problem.embedding.T).float() / 0.8).log_softmax(-1).gather(1, tokens[:, None])[:, 0]
        assert tokens.shape == (rows,) and ((0 <= tokens) & (tokens < problem.embedding.shape[0])).all()
        torch.testing.assert_close(logprobs, expected)


# A package of a plain nn.Linear on the device argv[2] names, compiled and loaded in a process of its own.
PLAIN_PACKAGE = """
import sys, torch
linear = torch.nn.Linear(8, 8, device=sys.argv[2])
program = torch.export.export(linear, (torch.randn(2, 8, device=sys.argv[2]),))
package = torch._inductor.aoti_compile_and_package(program, package_path=sys.argv[1])
torch._inductor.aoti_load_package(package)(torch.randn(2, 8, device=sys.argv[2]))
"""


@functools.cache
def plain_package_probe(device: str) -> subprocess.CompletedProcess:
    """A plain nn.Linear's AOTInductor package for ``device``, compiled and run in a process of its own:
    torch 2.11.0+cu130 on a lent H100 crashed (a segfault, no error) loading any CUDA package
    (session 101), and any CPU package too (session 112)."""
    with tempfile.TemporaryDirectory() as directory:
        return subprocess.run([sys.executable, "-c", PLAIN_PACKAGE, f"{directory}/linear.pt2", device], capture_output=True,
                              text=True, timeout=600)


@pytest.mark.slow
@device_params
def test_unseeded_sampling_under_aot_inductor_and_cpp_wrapper(device, tmp_path):
    # The seed's draw passed generator=None to torch.randint, which records an overload that an
    # AOTInductor package failed to run (an internal assert) and inductor's cpp_wrapper to compile.
    probe = plain_package_probe(device)
    if probe.returncode < 0:  # killed by a signal: torch's crash, not ours
        pytest.skip(f"torch {torch.__version__}'s AOTInductor cannot load a {device} package here: a plain "
                    f"nn.Linear's crashes its process (signal {-probe.returncode})")
    # An error (no compiler, say) is a failure that says so, not a skip.
    assert probe.returncode == 0, f"a plain nn.Linear's {device} AOTInductor package failed:\n{probe.stderr[-2000:]}"
    problem = make_problem(SHAPE, torch.float32, device)
    head = flash_head(problem)

    class Sample(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = head

        def forward(self, hidden):
            return self.head.sample(hidden, 0.8)

    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(Sample(), (problem.hidden[:3],), dynamic_shapes=({0: batch},))
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "sample.pt2"))
    torch._dynamo.reset()
    with torch._inductor.config.patch(cpp_wrapper=True):
        runs = {"aoti": torch._inductor.aoti_load_package(package),
                "cpp_wrapper": torch.compile(Sample(), fullgraph=True)}
        for name, run in runs.items():
            for rows in (2, SHAPE.B):
                hidden = problem.hidden[:rows]
                tokens, logprobs = run(hidden)
                assert tokens.shape == (rows,) and logprobs.shape == (rows,), name
                assert ((0 <= tokens) & (tokens < problem.embedding.shape[0])).all(), name
                assert torch.isfinite(logprobs).all() and (logprobs <= 0).all(), name


@device_params
@pytest.mark.parametrize("centroid_dtype", [None, torch.float8_e4m3fn], ids=str)
def test_export_flash_head(centroid_dtype, device):
    # Non-strict export (the default) had failed on the scale buffers a head without fp8 centroids left None.
    problem = make_problem(SHAPE, torch.bfloat16, device)
    head = FlashHead(problem.embedding, problem.centroids, problem.cluster_tokens, problem.probes,
                     special_token_ids=problem.extra_ids, centroid_dtype=centroid_dtype)
    exported = torch.export.export(head, (problem.hidden,)).module()
    for hidden in (problem.hidden, problem.hidden.flip(0).contiguous()):
        assert torch.equal(exported(hidden), head(hidden))


# ------------------------------------------------------------------------------------------
# CUDA only: graph capture and host syncs.

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_graph_decode_greedy(dtype):
    problem = make_problem(SHAPE, dtype, "cuda")
    hidden = problem.hidden.clone()
    args = lambda: (hidden, *problem.args()[1:])
    buffer = torch.full((SHAPE.B, 3), -7, dtype=torch.int64, device="cuda")
    graph, tokens = capture(lambda: ops.decode_greedy(*args()))
    graph_out, _ = capture(lambda: ops.decode_greedy(*args(), out=buffer[:, 1]))
    other = make_problem(SHAPE, dtype, "cuda", seed=1).hidden
    for new_hidden in (problem.hidden, other):
        hidden.copy_(new_hidden)  # the graph reads its inputs at replay
        buffer.fill_(-7)
        graph.replay()
        graph_out.replay()
        expected = ops.decode_greedy(*args())
        assert torch.equal(tokens, expected)
        assert torch.equal(buffer[:, 1], expected) and (buffer[:, [0, 2]] == -7).all()


@pytest.mark.gpu
def test_cuda_graph_decode_sample_reads_seed_at_replay():
    problem = make_problem(SHAPE, torch.bfloat16, "cuda")
    seed = seed_tensor(100, "cuda")
    run = lambda: ops.decode_sample(*problem.args()[:5], 0.8, problem.extra_ids, seed=seed)
    graph, (tokens, logprobs) = capture(run)
    draws = {}
    for value in (100, 101, 100, 102):
        seed.fill_(value)
        graph.replay()
        replayed = (tokens.clone(), logprobs.clone())
        eager = run()
        assert torch.equal(replayed[0], eager[0]) and torch.equal(replayed[1], eager[1])
        if value in draws:
            assert torch.equal(draws[value][0], replayed[0])  # reproducible
        draws[value] = replayed
    assert not (torch.equal(draws[100][0], draws[101][0]) and torch.equal(draws[100][0], draws[102][0]))


@pytest.mark.gpu
def test_cuda_graph_fresh_seed_each_replay():
    # Without a seed, make_seed draws one on the device inside the graph: each replay differs.
    problem = make_problem(SHAPE, torch.float32, "cuda")
    graph, (tokens, _) = capture(lambda: ops.decode_sample(*problem.args()[:5], 1.0, problem.extra_ids))
    seen = set()
    for _ in range(4):
        graph.replay()
        seen.add(tuple(tokens.tolist()))
    assert len(seen) > 1


@pytest.mark.gpu
def test_no_host_sync():
    problem = make_problem(SHAPE, torch.bfloat16, "cuda")
    seed = seed_tensor(3, "cuda")
    generator = torch.Generator("cuda").manual_seed(3)
    out = torch.empty(SHAPE.B, dtype=torch.int64, device="cuda")
    cluster_ids = torch.randint(0, SHAPE.C, (SHAPE.B, 3), dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.decode_greedy(*problem.args())
        ops.decode_greedy(*problem.args(), out=out)
        ops.decode_sample(*problem.args()[:5], 0.9, problem.extra_ids)  # seed drawn by make_seed
        ops.decode_sample(*problem.args()[:5], 0.9, problem.extra_ids, generator=generator)
        ops.decode_sample(*problem.args()[:5], 0.9, problem.extra_ids, seed=seed)
        ops.select_clusters(problem.hidden, problem.centroids, 3)
        ops.sample_clusters(problem.hidden, problem.centroids, 3, 0.9, seed=seed)
        candidates = ops.gather_candidates(cluster_ids, problem.cluster_tokens, problem.extra_ids)
        ops.candidate_logits(problem.hidden, problem.embedding, candidates)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    head = flash_head(problem)  # building a head validates its table (a sync, once): not in the checked region
    torch.cuda.set_sync_debug_mode("error")
    try:
        head.next_token(problem.hidden)
        head.sample(problem.hidden, 0.9, generator)
        head.candidate_logits(problem.hidden)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("producer", ["sample_clusters", "fused_linear"])
@pytest.mark.parametrize("batch", [1, 6])
def test_ops_read_what_the_kernel_before_them_wrote(producer, batch):
    # An op's first kernel (the centroid scoring, fused_linear's GEMV) starts while the stream's
    # previous kernel drains (dependent launch) and must wait for it before reading any input. The
    # producers' last kernels (the selection, the GEMV) let their dependents start before they
    # write, so a consumer fed their output as hidden states, or as fused_linear's weight, reads it
    # as it is written unless it waits. sample_clusters' scores (float32, in draw order, so rows
    # differ) reach the CUDA-core scoring; a bfloat16 projection at batch 6 the tensor-core one.
    g = generator("kernel before", producer, batch)
    D, C, b = 320, 451, 8
    dtype = torch.float32 if producer == "sample_clusters" else torch.bfloat16
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).cuda()
    width = 96 if producer == "sample_clusters" else 4096  # a long GEMV: its rows are written late
    weight_in = torch.randn(700, width, generator=g).cuda() if producer == "sample_clusters" else rand(D, width) / 64
    centroids, embedding, probe = rand(C, D), rand(C * b - 5, D), rand(5, D)
    table = random_partition(C * b - 5, b, seed=batch).int().cuda()
    inputs = [rand(batch, width) for _ in range(3)]
    seed = seed_tensor(5, "cuda")

    def produce(x):  # [batch, D], written by the producer's last kernel
        if producer == "sample_clusters":
            return ops.sample_clusters(x, weight_in, D, 20.0, seed=seed)[1]
        return ops.fused_linear(x, weight_in)

    consumers = (lambda h: ops.select_clusters(h, centroids, 17),
                 lambda h: ops.decode_greedy(h, centroids, table, embedding, 9),
                 lambda h: ops.decode_sample(h, centroids, table, embedding, 9, 0.7, seed=seed),
                 lambda h: ops.fused_linear(probe, h))

    def chained(x):  # each consumer right after the producer's kernels
        return [consume(produce(x)) for consume in consumers]

    def expected(x):
        outputs = []
        for consume in consumers:
            hidden = produce(x)
            torch.cuda.synchronize()
            outputs.append(consume(hidden))
        return outputs

    def check(actual, wanted):
        for got, want in zip(actual, wanted):
            for a, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                assert torch.equal(a, w)

    wanted = [expected(x) for x in inputs]
    assert len({tuple(w[1].tolist()) for w in wanted}) > 1  # the inputs lead to different tokens
    # Fresh outputs reuse freed blocks that held another input's values, so a read too early shows.
    # The GPU first sleeps, so the launches queue up behind it instead of each finding it idle.
    for x, want in zip(inputs + inputs, wanted + wanted):
        torch.cuda._sleep(2_000_000)
        check(chained(x), want)
    static_x = inputs[0].clone()
    graph, outputs = capture(lambda: chained(static_x))
    for x, want in zip(inputs[1:] + inputs, wanted[1:] + wanted):
        static_x.copy_(x)
        graph.replay()
        check(outputs, want)


class _Cycle:
    def __init__(self, payload):
        self.payload, self.itself = payload, self


@pytest.mark.gpu
def test_capture_is_not_failed_by_collecting_a_dead_graph():
    """A captured graph that only a reference cycle holds, dropped during another capture while
    Python objects are allocated: an automatic collection there would destroy the graph, which
    CUDA does not permit while a stream captures, and the capture would fail. torch.cuda.graph no
    longer collects before a capture (torch 2.9+), so capture_graph pauses the collector."""
    x = torch.randn(37, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    doomed = [capture_graph(lambda: x.mul(2))]
    results = []

    def fn():
        if torch.cuda.is_current_stream_capturing():
            _Cycle(doomed.pop())  # unreachable at once, freed only by a collection
            garbage = [[i] for i in range(5 * gc.get_threshold()[0])]  # past the youngest generation's threshold
            del garbage
        results.append(x * 3 + 1)

    graph = capture_graph(fn)
    assert not doomed
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(results[-1], x * 3 + 1)
    gc.collect()  # the dead graph is destroyed now, outside any capture


def test_capture_pauses_the_collector_and_leaves_it_as_the_caller_had_it():
    """capture_graph's pause of the cyclic collector (CPU-checkable): off inside, then as it was
    before, enabled or not, and also when the capture raises."""
    from flashhead_ext.graphs import _no_automatic_collection

    was = gc.isenabled()
    try:
        for before in (True, False):
            (gc.enable if before else gc.disable)()
            with _no_automatic_collection():
                assert not gc.isenabled()
            assert gc.isenabled() == before
            with pytest.raises(RuntimeError, match="capture failed"), _no_automatic_collection():
                raise RuntimeError("capture failed")
            assert gc.isenabled() == before
    finally:
        (gc.enable if was else gc.disable)()
