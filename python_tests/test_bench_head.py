"""The head benchmark's CLI on a tiny shape (CPU): its rows, floors and special tokens."""
import argparse
import json
import re

import pytest
import torch

from flashhead_ext.bench.__main__ import main
from flashhead_ext import ops
from flashhead_ext.bench import timing
from flashhead_ext.bench.head import (SHAPES, CandidatesRead, HeadState, VocabShape, add_ratios, call_bytes, candidates_read,
                                      copies_needed, copy_bytes, embedding_copies_needed, floor_bytes, plan, summary,
                                      warm_l2_warning, whole_rotations)
from flashhead_ext.bench.timing import on_device, run_metadata
from helpers import TWO_GPUS, commit_made_during


def test_head_bench_cli_with_special_tokens(tmp_path, capsys):
    out = tmp_path / "head.json"
    assert main(["head", "--shapes", "tiny", "--device", "cpu", "--dtype", "fp32", "--probes", "7,31",
                 "--batches", "1,3", "--samples", "2", "--calls", "2", "--special-tokens", "5", "--json", str(out)]) == 0
    assert "5 special tokens scored at every step" in capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["meta"]["warm_l2_shapes"] == []  # a CPU has no L2 to size copies by
    shape = SHAPES["tiny"]
    points = {(r["batch"], r["probes"]) for r in rows}
    batch_probes = min(256, shape.num_clusters)  # --batch-probes' default, capped
    assert points == {(1, 7), (1, 31), (1, batch_probes), (3, batch_probes)}
    assert all(r["special_tokens"] == 5 and r["us"] > 0 and r["x_vs_dense"] > 0 for r in rows)
    assert len(rows) == 6 * len(points)  # every impl at every point (eager only on a CPU)
    greedy, fp8 = (next(r for r in rows if r["impl"] == impl and r["batch"] == 1 and r["probes"] == 7)
                   for impl in ("flash_greedy", "flash_greedy_fp8"))
    # The floor reads each chosen cluster's table entries and its tokens' rows (with the special
    # ids') once: here from the ops on the run's own data (the same seed, one copy on a CPU).
    state = HeadState(shape, torch.float32, "cpu", max_batch=3, copies=1, special_tokens=5)
    cluster_ids, _ = ops.select_clusters(state.hidden[0][:1], state.centroids[0], 7)
    candidates = ops.gather_candidates(cluster_ids, state.tables[0], state.extra_ids)
    rows_read = candidates[candidates >= 0].unique().numel()
    assert greedy["clusters_read"] == 7 and greedy["copies"] == 1
    assert greedy["floor_bytes"] == (shape.num_clusters * shape.dim * 4 + 7 * shape.cluster_size * 4
                                     + rows_read * shape.dim * 4 + shape.dim * 4)
    # fp8 centroids: one byte an element instead of four
    assert greedy["floor_bytes"] - fp8["floor_bytes"] == shape.num_clusters * shape.dim * 3
    # Kept besides the embedding: centroids (fp8: a byte an element and a float32 scale), the int32
    # table and the special ids; nothing for dense. The CPU keeps no allocator statistics.
    table_and_extras = shape.num_clusters * shape.cluster_size * 4 + 5 * 4
    kept = {r["impl"]: r["kept_bytes"] for r in rows}
    assert kept["dense"] == 0
    assert kept["flash_greedy"] == kept["torch_flash"] == shape.num_clusters * shape.dim * 4 + table_and_extras
    assert kept["flash_sample_fp8"] == shape.num_clusters * shape.dim + 4 + table_and_extras
    assert all(r["call_bytes"] is None for r in rows)


def test_head_bench_times_a_head_of_ones_own(tmp_path):
    # VOCABxDIMxCLUSTER_SIZE: 3001 tokens of 48 dimensions in 376 clusters of 8, the last padded.
    out = tmp_path / "head.json"
    assert main(["head", "--shapes", "3001x48x8,tiny", "--device", "cpu", "--dtype", "fp32", "--probes", "5,500",
                 "--batches", "2", "--samples", "2", "--calls", "2", "--impls", "dense,flash_greedy", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    own = [r for r in rows if r["shape"] == "3001x48x8"]
    # The first shape gets the sweeps: 500 probes capped at its 376 clusters, the batch at 256 probes.
    assert {(r["batch"], r["probes"]) for r in own} == {(1, 5), (1, 376), (2, 256)}
    greedy = next(r for r in own if r["impl"] == "flash_greedy" and r["probes"] == 5)
    assert greedy["kept_bytes"] == 376 * 48 * 4 + 376 * 8 * 4
    dense = next(r for r in own if r["impl"] == "dense" and r["probes"] == 5)
    assert dense["floor_bytes"] == 3001 * 48 * 4 + 48 * 4
    assert {r["shape"] for r in rows} == {"3001x48x8", "tiny"}
    # Clusters of 16 unless given.
    from flashhead_ext.bench.head import shape_of
    assert (shape_of("49152x576").num_clusters, shape_of("49152x576x32").num_clusters) == (3072, 1536)


def test_clusters_bench_builds_a_head_of_ones_own(tmp_path, capsys):
    out = tmp_path / "clusters.json"
    assert main(["clusters", "--shapes", "301x16x8,100x8x30", "--iters", "2", "--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    # Clusters of the size given (build_clusters' cluster_size), not of the vocabulary over their count;
    # the width is the table's: 100 rows make 4 clusters of 25, which the row had reported as 30.
    assert [(r["shape"], r["vocab"], r["dim"], r["cluster_size"], r["cluster_size_asked"], r["clusters"], r["equal_sizes"])
            for r in rows] == [("301x16x8", 301, 16, 8, 8, 38, True), ("100x8x30", 100, 8, 25, 30, 4, True)]
    captured = capsys.readouterr()
    assert "--shapes 100x8x30: 100 rows make 4 clusters of at most 25 tokens, so b is 25, not 30\n" in captured.err
    assert "--shapes 301x16x8:" not in captured.err
    table_row = next(line.split() for line in captured.out.splitlines() if line.split()[:1] == ["100x8x30"])
    assert table_row[1:5] == ["100", "8", "25", "4"]
    result = json.loads(out.read_text())
    assert result["meta"]["args"]["iters"] == 2
    for r in rows:  # the iterations run (at most --iters), the time of one, the threads and device it ran on
        assert 1 <= r["iters"] <= 2 and r["seconds_per_iter"] == pytest.approx(r["seconds"] / r["iters"])
        assert (r["threads"], r["device"]) == (torch.get_num_threads(), "cpu")
    # Four clusters of 30 converge well before 50 iterations: the row says how many ran, not how many were allowed.
    assert main(["clusters", "--shapes", "100x8x30", "--iters", "50", "--device", "cpu", "--json", str(out)]) == 0
    assert 1 <= json.loads(out.read_text())["rows"][0]["iters"] < 50


def test_clusters_bench_records_the_commit_the_run_started_with(tmp_path, monkeypatch):
    # Read when the JSON was written, a commit made (or a branch checked out) mid-run named the result.
    from flashhead_ext.bench import clusters

    checkout = commit_made_during(monkeypatch, timing, clusters, "build_clusters")
    out = tmp_path / "clusters.json"
    assert main(["clusters", "--shapes", "100x8x30", "--iters", "1", "--device", "cpu", "--json", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert checkout == ["after"] and (meta["commit"], meta["date"]) == ("before", "before UTC")
    assert meta["build_commit"] == timing.build_commit()


def test_spec_bench_records_the_commit_and_date_the_run_started_with(tmp_path, monkeypatch):
    # As clusters': read when the JSON was written, a commit made mid-run (or the clock) named the result.
    from flashhead_ext.bench import spec

    checkout = commit_made_during(monkeypatch, timing, spec, "run_interleaved")
    out = tmp_path / "spec.json"
    assert main(["spec", "--target", "tiny", "--draft", "tiny", "--dtype", "fp32", "--device", "cpu", "--num-prompts", "1",
                 "--prompt-tokens", "5", "--max-new-tokens", "3", "--warmup-tokens", "1", "--mode", "baseline",
                 "--seed", "3", "--json", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert checkout == ["after"] and (meta["commit"], meta["date"]) == ("before", "before UTC")
    assert meta["build_commit"] == timing.build_commit() and meta["args"]["seed"] == 3


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("[enforce fail at alloc_cpu.cpp:127] . DefaultCPUAllocator: can't allocate "
                                                "memory: you tried to allocate 33554432000 bytes.")])
@pytest.mark.parametrize("bench,allocates", [("head", "HeadState"), ("clusters", "correlated_embedding")])
def test_a_head_past_the_devices_memory_is_a_usage_error(bench, allocates, error, monkeypatch, capsys):
    # Simulated: a real one is refused by the allocator or, where the kernel overcommits memory,
    # killed by it (as the device's pytest was, session 76).
    import importlib

    def refuse(*args, **kwargs):
        raise error

    monkeypatch.setattr(importlib.import_module(f"flashhead_ext.bench.{bench}"), allocates, refuse)
    with pytest.raises(SystemExit) as exit_info:
        main([bench, "--shapes", "1000x64", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert f"error: --shapes 1000x64: its weights do not fit on cpu ({str(error).splitlines()[0]})" in capsys.readouterr().err


def test_floor_reads_a_cluster_chosen_by_several_rows_once():
    shape = SHAPES["tiny"]
    state = HeadState(shape, torch.float32, "cpu", max_batch=3, copies=2)
    every = candidates_read(state, 3, shape.num_clusters)  # each row chooses every cluster
    assert every == CandidatesRead(shape.num_clusters, shape.vocab)
    some = candidates_read(state, 3, 40)
    assert 40 < some.clusters < 3 * 40 and some.rows == some.clusters * shape.cluster_size  # no padded slots here
    assert (floor_bytes("flash_greedy", shape, 3, torch.float32, every)
            == shape.num_clusters * shape.dim * 4 + shape.num_clusters * shape.cluster_size * 4 + (shape.vocab + 3) * shape.dim * 4)
    assert floor_bytes("dense", shape, 3, torch.float32, every) == (shape.vocab + 3) * shape.dim * 4


def test_copies_rotate_three_l2s_past_the_smallest_reader():
    shape, l2 = SHAPES["qwen3-0.6b"], 60 << 20
    bf16_copy = shape.num_clusters * (shape.dim * 2 + 16 * 4) + shape.dim * 2
    fp8_copy = shape.num_clusters * (shape.dim + 16 * 4) + shape.dim * 2
    assert copy_bytes(shape, torch.bfloat16, ["dense", "flash_greedy"], 1) == bf16_copy
    assert copy_bytes(shape, torch.bfloat16, ["flash_greedy", "flash_greedy_fp8"], 1) == fp8_copy
    # 11 and 20 copies pass three L2s; the fewest at least that which divide the calls: 16 and 32.
    assert -(-3 * l2 // bf16_copy) + 1 == 11 and copies_needed(bf16_copy, 64, l2) == 16
    assert -(-3 * l2 // fp8_copy) + 1 == 20 and copies_needed(fp8_copy, 64, l2) == 32
    assert copies_needed(fp8_copy, 16, l2) == 16  # no more than a sample's calls
    assert copies_needed(bf16_copy, 11, l2) == 11 and copies_needed(bf16_copy, 13, l2) == 13  # a prime: all of them
    assert copies_needed(bf16_copy, 16, 0) == 1  # no L2 (a CPU)
    # n copies pass n - 1 others between two uses of one: 10 copies' bytes pass three L2s, so 11, then 12 to divide 60.
    assert -(-3 * l2 // bf16_copy) == 10 and copies_needed(bf16_copy, 60, l2) == 12
    # Fewer calls than copies to pass two L2s between uses time a warm L2: said, with the calls that suffice.
    assert warm_l2_warning("qwen3-0.6b", 16, fp8_copy, l2, 16) is None  # the default --calls
    warning = warm_l2_warning("qwen3-0.6b", 3, bf16_copy, l2, 3)
    assert warning.startswith("warning: --calls 3 rotates 3 copies (60 MB) at qwen3-0.6b, less than twice the 63 MB L2")
    assert warning.endswith(f"use --calls {-(-2 * l2 // bf16_copy)} or more") and -(-2 * l2 // bf16_copy) == 7
    assert warm_l2_warning("qwen3-0.6b", 1, bf16_copy, 0, 1) is None  # a CPU


def test_a_replays_calls_end_a_rotation():
    # Call i reads copy i % n and a replay runs calls 0..calls-1: unless n divides the calls, the next
    # replay's first calls reused copies its last calls had just read (13 of 16: three, after 3 calls).
    for copies, calls in ((13, 16), (3, 52), (4, 62), (1, 7), (5, 5), (9, 8)):
        n = whole_rotations(copies, calls)
        assert calls % n == 0 and min(copies, calls) <= n <= calls
        uses = [i % n for i in range(calls)] * 2  # two replays back to back
        next_use = [next(j for j in range(i + 1, 2 * calls) if uses[j] == uses[i]) - i for i in range(calls)]
        assert min(next_use) >= min(copies, calls)
    assert whole_rotations(13, 16) == 16 and whole_rotations(3, 52) == 4 and whole_rotations(4, 62) == 31


def test_an_embedding_that_could_stay_in_l2_is_rotated_too():
    # SmolLM2's head (57 MB in bf16) fits an H200's 60 MiB L2: one copy of it, re-read call after call,
    # timed the dense head from L2 even where --calls rotated enough copies of everything else.
    l2 = 60 << 20
    smollm2, qwen = VocabShape(49152, 576), SHAPES["qwen3-0.6b"]
    assert embedding_copies_needed(smollm2, torch.bfloat16, 64, l2) == -(-3 * l2 // (49152 * 576 * 2)) == 4
    assert embedding_copies_needed(smollm2, torch.bfloat16, 3, l2) == 3  # no more than a sample's calls
    assert embedding_copies_needed(smollm2, torch.bfloat16, 10, l2) == 5  # a whole number of rotations a sample
    assert embedding_copies_needed(smollm2, torch.bfloat16, 63, l2) == 7  # 3 would pass only two L2s, though 3 divide 63
    assert embedding_copies_needed(smollm2, torch.float32, 64, l2) == 2
    assert embedding_copies_needed(qwen, torch.bfloat16, 64, l2) == 1  # 311 MB: reading it through evicts it
    assert embedding_copies_needed(smollm2, torch.bfloat16, 64, 0) == 1  # no L2 (a CPU)
    state = HeadState(SHAPES["tiny"], torch.float32, "cpu", max_batch=2, copies=2, embedding_copies=3)
    assert len({e.data_ptr() for e in state.embeddings}) == 3
    assert all(torch.equal(e, state.embeddings[0]) for e in state.embeddings)  # copies of one head
    # Calls rotate over them: told apart here by giving each copy other values.
    gen = torch.Generator().manual_seed(3)
    for e in state.embeddings:
        e.copy_(torch.randn(e.shape, generator=gen))
    for i in range(5):
        expected = (state.hidden[i % 2][:2] @ state.embeddings[i % 3].t()).argmax(-1)
        assert torch.equal(state.head_call("dense", 2, 8, i)(), expected)


def test_a_run_with_an_l2_rotates_the_embedding_records_warm_l2_and_judges_no_goal_unlike_its_own(tmp_path, monkeypatch,
                                                                                                capsys):
    # A CPU has no L2: given one (1 MiB), a CPU run goes the way a GPU run does.
    from flashhead_ext.bench import head

    with_l2 = head.run_metadata
    monkeypatch.setattr(head, "run_metadata", lambda device: dict(with_l2(device), l2_bytes=1 << 20))
    judged = []
    monkeypatch.setattr(head, "summary", lambda *args, **kwargs: judged.append(args[4]) or "")
    out = tmp_path / "head.json"
    # tiny in fp32: a 1.0 MB embedding, under three L2s; --calls 2 leaves the other copies in L2.
    assert main(["head", "--shapes", "tiny", "--device", "cpu", "--dtype", "fp32", "--probes", "7", "--batches", "1",
                 "--samples", "1", "--calls", "2", "--special-tokens", "3", "--impls", "dense,flash_greedy",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["warm_l2_shapes"] == ["tiny"] and "warning: --calls 2" in capsys.readouterr().err
    assert {(r["copies"], r["embedding_copies"]) for r in result["rows"]} == {(2, 2)}
    assert judged == [("fp32 weights", "special tokens", "a warm L2")]
    judged.clear()
    # A second shape in a warm L2 (its 64 copies fit in one) leaves the first, the goals', judged.
    assert main(["head", "--shapes", "tiny,256x8x16", "--device", "cpu", "--dtype", "bf16", "--probes", "7", "--batches",
                 "1", "--samples", "1", "--calls", "64", "--impls", "dense,flash_greedy", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["warm_l2_shapes"] == ["256x8x16"] and judged == [()]
    # 0.5 MB: 7 pass three L2s, and 8 divide 64
    assert {r["embedding_copies"] for r in result["rows"] if r["shape"] == "tiny"} == {8}


def test_plain_torch_baseline_decodes_like_ours_with_special_tokens():
    state = HeadState(SHAPES["tiny"], torch.float32, "cpu", max_batch=3, copies=1, special_tokens=5)
    assert state.extra_ids.tolist() == list(range(SHAPES["tiny"].vocab - 5, SHAPES["tiny"].vocab))
    for probes in (1, 9, 40):
        plain = state.head_call("torch_flash", 3, probes, 0)()
        ours = state.head_call("flash_greedy", 3, probes, 0)()
        assert torch.equal(plain, ours), probes
    # With every cluster probed the fp8 centroids' rounding cannot change the candidates.
    every = SHAPES["tiny"].num_clusters
    assert torch.equal(state.head_call("flash_greedy_fp8", 3, every, 0)(), state.head_call("flash_greedy", 3, every, 0)())


def test_head_bench_refuses_bad_special_tokens():
    with pytest.raises(SystemExit):
        main(["head", "--shapes", "tiny", "--device", "cpu", "--special-tokens", "-1"])
    with pytest.raises(SystemExit):
        main(["head", "--shapes", "tiny", "--device", "cpu", "--special-tokens", str(SHAPES["tiny"].vocab)])


def test_bench_lists_its_benchmarks(capsys):
    assert main(["--help"]) == 0  # asked for: success
    assert "head,clusters,draft-step,spec,layer-ops" in capsys.readouterr().out
    assert main(["nonesuch"]) == 2


def test_other_shapes_are_timed_at_256_probes_and_the_published_default():
    args = argparse.Namespace(shapes=["tiny", "llama3"], probes=[32], batches=[1, 4], batch_probes=16)
    points = [(p["batch"], p["probes"]) for p in plan(args) if p["shape"] == "llama3"]
    assert points == [(1, 256), (1, 128256 // 16 // 16)]  # 8,016 clusters of 16: C/16 = 501 probes


def test_cpu_timing_reports_microseconds_a_call(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])

    def four_calls():  # one sample: 4 calls of 1 ms each
        clock[0] += 0.004

    assert timing.time_calls(four_calls, calls_per_sample=4, samples=5, warmup=1, device="cpu") == pytest.approx(1000.0)


def test_summary_names_a_baseline_that_was_not_run():
    point = dict(shape="qwen3-0.6b", batch=1, probes=256, mode="graph")
    rows = [dict(point, impl="dense", us=84.0), dict(point, impl="flash_greedy", us=21.0)]
    add_ratios(rows)
    text = summary(rows, "qwen3-0.6b")
    assert "flash_greedy 21.00 us (goal <= 15: not met)" in text and "4.00x dense (goal >= 6: not met)" in text
    assert "torch_flash not run" in text and "nan" not in text
    rows.append(dict(point, impl="torch_flash", us=63.0))
    rows.append(dict(point, impl="flash_greedy_fp8", us=16.8))
    add_ratios(rows)
    assert "3.00x torch_flash (goal >= 4: not met)" in summary(rows, "qwen3-0.6b")
    assert "flash_greedy_fp8 16.80 us, 5.00x dense" in summary(rows, "qwen3-0.6b")
    assert "nothing to summarize" in summary([dict(r, mode="eager") for r in rows], "qwen3-0.6b")
    # A run unlike the goals' (fp16, special tokens, a warm L2) is not judged against them.
    rows.append(dict(point, impl="flash_greedy", us=14.0))
    judged = summary(rows[-1:] + rows, "qwen3-0.6b")
    assert "14.00 us (goal <= 15: met)" in judged
    unjudged = summary(rows[-1:] + rows, "qwen3-0.6b", unlike_goals=("fp16 weights", "a warm L2"))
    assert "14.00 us (goal <= 15: not judged, fp16 weights, a warm L2)" in unjudged
    assert "met" not in unjudged
    # A batch sweep at other probes, without the summary's point, says that point is missing.
    elsewhere = [dict(r, probes=593) for r in rows]
    assert "the summary's point, qwen3-0.6b B=1 p=256 graph-replayed, was not run" in summary(elsewhere, "qwen3-0.6b", 593)
    assert "was not run" not in summary(rows, "qwen3-0.6b")
    # The goals are Qwen3-0.6B's head's, under any name: another head's summary has the same numbers and no goals.
    other = [dict(r, shape="32000x4096") for r in rows]
    assert "4.00x dense," in summary(other, "32000x4096") and "goal" not in summary(other, "32000x4096")
    assert "32000x4096 B=1 p=256 graph: flash_greedy 21.00 us, 4.00x dense, 3.00x torch_flash" in summary(other, "32000x4096")
    assert "4.00x dense (goal >= 6: not met)" in summary([dict(r, shape="151936x1024x16") for r in rows], "151936x1024x16")
    # A head of fewer than 256 clusters: its rows at the capped probes are the summary's point.
    capped = [dict(r, shape="32000x512x128", probes=250) for r in rows]
    assert "32000x512x128 B=1 p=250 graph: flash_greedy 21.00 us" in summary(capped, "32000x512x128", 250, 250)
    assert "was not run" not in summary(capped, "32000x512x128", 250, 250)


def test_summary_judges_the_goals_before_rounding():
    # 15.004 us, 5.996x and 3.996x print as 15.00, 6.00 and 4.00, and miss their goals all the same.
    point = dict(shape="qwen3-0.6b", batch=1, probes=256, mode="graph")
    rows = [dict(point, impl="dense", us=89.96), dict(point, impl="flash_greedy", us=15.004),
            dict(point, impl="torch_flash", us=59.956), dict(point, impl="flash_sample", us=22.52)]
    add_ratios(rows)
    text = summary(rows, "qwen3-0.6b")
    assert "flash_greedy 15.00 us (goal <= 15: not met)" in text and "6.00x dense (goal >= 6: not met)" in text
    assert "4.00x torch_flash (goal >= 4: not met)" in text and "1.50x (goal <= 1.5: not met)" in text
    met = [dict(r, us={"flash_greedy": 14.85, "flash_sample": 21.0}.get(r["impl"], r["us"])) for r in rows]
    add_ratios(met)
    text = summary(met, "qwen3-0.6b")
    assert "(goal <= 15: met)" in text and "x dense (goal >= 6: met)" in text and "(goal <= 1.5: met)" in text
    # A value exactly at its goal meets it.
    exact = [dict(r, us={"dense": 90.0, "flash_greedy": 15.0, "torch_flash": 60.0, "flash_sample": 22.5}[r["impl"]]) for r in rows]
    add_ratios(exact)
    text = summary(exact, "qwen3-0.6b")
    assert "flash_greedy 15.00 us (goal <= 15: met)" in text and "6.00x dense (goal >= 6: met)" in text
    assert "4.00x torch_flash (goal >= 4: met)" in text and "1.50x (goal <= 1.5: met)" in text


def test_summary_finds_where_dense_wins_at_the_batch_sweeps_probes():
    # Batch 1 also has a probes sweep; only its point at the sweep's probes counts, as at batch 2.
    timings = {(1, 1024): (84.0, 90.0), (1, 256): (84.0, 16.0), (2, 256): (85.0, 20.0), (4, 256): (86.0, 86.5)}
    rows = [dict(shape="qwen3-0.6b", batch=b, probes=p, mode="graph", impl=impl, us=us)
            for (b, p), pair in timings.items() for impl, us in zip(("dense", "flash_greedy"), pair)]
    assert "dense wins from batch: 4" in summary(rows, "qwen3-0.6b")
    assert "dense wins from batch: 1" in summary(rows, "qwen3-0.6b", batch_probes=1024)
    faster_at_4 = [dict(r, us=80.0) if (r["batch"], r["impl"]) == (4, "flash_greedy") else r for r in rows]
    assert "dense wins from batch: never up to 4" in summary(faster_at_4, "qwen3-0.6b")
    # As fast counts as winning, and the first batch that wins is named, not the last.
    tie_at_2 = [dict(r, us=20.0) if (r["batch"], r["impl"]) == (2, "dense") else r for r in rows]
    assert "dense wins from batch: 2" in summary(tie_at_2, "qwen3-0.6b")


@pytest.mark.gpu
def test_call_bytes_counts_what_each_head_allocates():
    # One eager call's peak allocation: dense holds [B, V] logits, plain-torch the [B, p*b, D]
    # gathered rows, ours a workspace and its output.
    shape, batch, probes = SHAPES["qwen3-0.6b"], 3, 37
    state = HeadState(shape, torch.bfloat16, "cuda", max_batch=batch, copies=1)
    allocated = {impl: call_bytes(state.head_call(impl, batch, probes, 0), "cuda")
                 for impl in ("dense", "torch_flash", "flash_greedy")}
    assert allocated["dense"] >= batch * shape.vocab * 2
    assert allocated["torch_flash"] >= batch * probes * shape.cluster_size * shape.dim * 2
    # Ours: per-row scores over C = V / 16 clusters and small lists, no row of the vocabulary.
    assert 0 < allocated["flash_greedy"] < min(allocated["dense"], allocated["torch_flash"] / 4)
    assert call_bytes(lambda: None, "cpu") is None


def test_summary_gives_the_memory_of_each_path():
    point = dict(shape="qwen3-0.6b", batch=1, probes=256, mode="graph")
    rows = [dict(point, impl="dense", us=84.0, kept_bytes=0, call_bytes=311_000),
            dict(point, impl="flash_greedy", us=14.0, kept_bytes=20_050_000, call_bytes=65_536),
            dict(point, impl="flash_greedy_fp8", us=13.0, kept_bytes=10_330_004, call_bytes=None)]
    add_ratios(rows)
    text = summary(rows, "qwen3-0.6b")
    assert ("memory, qwen3-0.6b B=1 p=256: flash_greedy keeps 20.1 MB besides the embedding (10.3 MB with fp8 "
            "centroids); one eager call allocates: dense 0.311 MB, flash_greedy 0.066 MB") in text
    assert "allocates" not in summary([dict(r, call_bytes=None) for r in rows], "qwen3-0.6b")
    # A small head's kept memory in three decimals: it had read "keeps 0.0 MB".
    small = [dict(r, kept_bytes=r["kept_bytes"] // 400) for r in rows]
    assert "flash_greedy keeps 0.050 MB besides the embedding (0.026 MB with fp8 centroids)" in summary(small, "qwen3-0.6b")


def test_head_bench_times_a_capped_probes_value_once(tmp_path):
    # Probes above the shape's clusters are capped; two capped to the same value are one point, so
    # each row's ratios compare it with its own point's dense row.
    out = tmp_path / "head.json"
    clusters = SHAPES["tiny"].num_clusters
    assert main(["head", "--shapes", "tiny", "--device", "cpu", "--dtype", "fp32", "--probes", f"{clusters + 1},{clusters + 50},7",
                 "--batches", "1", "--samples", "2", "--calls", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert sorted({r["probes"] for r in rows}) == [7, clusters]
    assert len(rows) == 6 * 2
    assert all(r["x_vs_dense"] == 1.0 for r in rows if r["impl"] == "dense")


@pytest.mark.parametrize("argv,message", [
    (["head", "--probes", "0"], "argument --probes: expected positive values"),
    (["head", "--probes", "abc"], "argument --probes: expected comma-separated integers"),
    (["head", "--batches", "2,0"], "argument --batches: expected positive values"),
    (["head", "--samples", "0"], "argument --samples: expected a positive integer"),
    (["head", "--calls", "-1"], "argument --calls: expected a positive integer"),
    (["head", "--impls", "dense,foo"], "unknown implementation 'foo'"),
    (["head", "--modes", "foo"], "unknown mode 'foo'"),
    (["head", "--modes", "graph"], "--modes graph needs a CUDA device"),
    (["head", "--shapes", ","], "no shape given"),
    *[([bench, "--shapes", f"tiny,{shape}"], f"unknown shape {shape!r}; choose from {presets} or VOCABxDIM or VOCABxDIMxCLUSTER_SIZE "
                                              "for a head of one's own")
      for bench, presets in (("head", "['gemma3-1b', 'llama3', 'qwen3-0.6b', 'tiny']"), ("clusters", "['qwen3-0.6b', 'smollm2', 'tiny']"))
      for shape in ("4000x64x", "4000X64", "4000x64x8x2", "-4000x64", "4000 x64")],
    # The CUDA kernels loop over counts up to 2^30; a cluster is no larger than the vocabulary.
    *[([bench, "--shapes", f"tiny, {shape}"], f"shape {shape!r}: the vocabulary and the hidden size must be in 1..2**30 (the "
                                               "CUDA kernels' limit on a count) and the cluster size in 1..the vocabulary")
      for bench in ("head", "clusters")
      for shape in ("0x64", "4000x0", "4000x64x0", "100x8x101", "1073741825x8", "2147483648x8", "99999999999999999999x2",
                    "8x1073741825", "8x2147483648")],
    (["clusters", "--iters", "0"], "argument --iters: expected a positive integer"),
    (["clusters", "--device", "meta"], "argument --device: 'meta' holds no values"),
    (["draft-step", "--context", "0"], "argument --context: expected a positive integer"),
    (["draft-step", "--shapes", "tiny", "--probes", "100000"], "--probes 100000 exceeds the 63 clusters of tiny"),
    # One cluster, mostly padding, was timed as a FlashHead.
    (["draft-step", "--shapes", "tiny", "--cluster-size", "5000"], "--cluster-size 5000 exceeds the vocabulary of tiny (1000 rows)"),
    (["spec", "--target", "tiny", "--draft", "tiny", "--cluster-size", "1001"],
     "--cluster-size 1001 exceeds the vocabulary of tiny (1000 rows)"),
    (["spec", "--target", "tiny", "--draft", "tiny", "--cluster-size", "0"], "argument --cluster-size: expected a positive integer"),
    (["spec", "--target", "tiny,tiny", "--draft", "tiny"], "argument --target: invalid choice: 'tiny,tiny'"),  # one shape
    (["spec", "--draft", "tiny,"], "argument --draft: invalid choice: 'tiny,'"),
    # Decoder.random takes an int64: 2**63 passed here and failed after the target was built.
    (["spec", "--seed", str(2**63)], "argument --seed: seed must fit in int64, got 9223372036854775808"),
    (["spec", "--seed", str(-2**63 - 1)], "argument --seed: seed must fit in int64, got -9223372036854775809"),
    (["layer-ops", "--tokens", "1,x"], "argument --tokens: expected comma-separated integers"),
    (["layer-ops", "--tokens", "1,9", "--context", "8"], "--tokens 9 exceeds --context 8: a call's tokens must fit in the cache"),
    (["layer-ops", "--shapes", "tiny-gemma3"], "--shapes tiny-gemma3: the fused body (these ops) runs the Llama / Qwen layer; this "
                                               "model's GELU, post-norms, sliding-window layers run on"),
    (["layer-ops", "--shapes", "gemma2-2b"], "--shapes gemma2-2b: the fused body (these ops) runs the Llama / Qwen layer; this "
                                             "model's GELU, post-norms, sliding-window layers, capped attention scores run "
                                             "on the 'eager', 'compiled' or 'persistent' body\n"),
    (["layer-ops", "--shapes", "gemma3-1b"], "in a Llama layer\n"),
    # Where the results could not be written: refused before the run, not after it.
    *[([name, "--json", "."], "argument --json: '.' is a directory")
      for name in ("head", "clusters", "draft-step", "spec", "layer-ops")],
])
def test_bench_refuses_bad_options(argv, message, capsys):
    # A usage error before anything is built or timed (on the CPU, where graphs cannot run).
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--device", "cpu"] if argv[0] in ("head", "draft-step", "spec", "clusters") else argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["draft-step", "--shapes", "tiny,gemma3-270m", "--device", "cpu"],
                                  ["spec", "--target", "gemma3-27b", "--draft", "tiny", "--device", "cpu"],
                                  ["layer-ops", "--shapes", "gemma3-1b"]])
def test_gemma3_shapes_without_transformers_are_a_usage_error(argv, monkeypatch, capsys):
    # The benchmarks over Decoder.random need no transformers, but Gemma-3's own layer is read from
    # its config: without it, a ModuleNotFoundError traceback.
    from flashhead_ext.bench import spec

    def no_transformers():
        raise ModuleNotFoundError("No module named 'transformers'")

    for name in ("gemma3-270m", "gemma3-1b", "gemma3-27b"):
        monkeypatch.setitem(spec.SHAPES._entries, name, no_transformers)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    flag = "--shapes" if argv[0] != "spec" else "--target"
    assert (f"error: {flag}: the gemma2-* and gemma3-* shapes read Gemma's layers from transformers' config, and transformers is not "
            "importable (No module named 'transformers'): pip install 'transformers>=5,<6', or use gemma3-270m-llama"
            in capsys.readouterr().err)


def test_model_shapes_on_the_cpu_say_they_take_minutes(monkeypatch, capsys):
    from flashhead_ext.bench import head as bench_head

    monkeypatch.setattr(bench_head, "run", lambda *args: 0)  # the note, not minutes of CPU timing
    assert main(["head", "--shapes", "tiny,qwen3-0.6b", "--device", "cpu"]) == 0
    printed = capsys.readouterr()  # a note, on stderr: stdout holds the report alone
    assert "on the CPU the large shapes (qwen3-0.6b) take minutes; --shapes tiny --samples 3 --calls 4 takes seconds" in printed.err
    assert "graph mode skipped: CUDA graphs need a CUDA device" in printed.err  # the default modes name it
    assert "take minutes" not in printed.out and "skipped" not in printed.out
    assert main(["head", "--shapes", "tiny,3001x48", "--device", "cpu"]) == 0
    assert "take minutes" not in capsys.readouterr().err
    assert main(["head", "--shapes", "49152x576", "--device", "cpu"]) == 0
    assert "the large shapes (49152x576) take minutes" in capsys.readouterr().err
    # Past a million elements, on the CPU only.
    from flashhead_ext.bench.head import note_slow_on_the_cpu

    for device, names, noted in (("cpu", ["1024x1024"], False), ("cpu", ["1025x1024"], True), ("cuda", ["qwen3-0.6b"], False)):
        note_slow_on_the_cpu(device, names, "--shapes tiny")
        assert ("take minutes" in capsys.readouterr().err) == noted, (device, names)
    # The clustering bench's default shapes: 15-25 minutes on two cores, nothing printed.
    from flashhead_ext.bench import clusters

    def stop(device):
        raise InterruptedError("the note, not minutes of clustering")

    monkeypatch.setattr(clusters, "run_metadata", stop)
    with pytest.raises(InterruptedError):
        main(["clusters", "--device", "cpu"])
    assert ("on the CPU the large shapes (qwen3-0.6b, smollm2) take minutes; --shapes tiny --iters 2 takes seconds"
            in capsys.readouterr().err)


def test_a_value_named_twice_in_a_comma_list_runs_once(capsys):
    from flashhead_ext._cli import choices_list, positive_int_list

    assert positive_int_list("32,7,32,7,5") == [32, 7, 5]  # in the order given
    assert choices_list(None, "tiny,qwen3-0.6b,tiny", SHAPES, "shape") == ["tiny", "qwen3-0.6b"]
    assert choices_list(None, " tiny, qwen3-0.6b ,tiny", SHAPES, "shape") == ["tiny", "qwen3-0.6b"]  # as --probes "32, 256"
    # A head under two names runs once, under the first.
    from flashhead_ext.bench.head import vocab_shape_list
    assert vocab_shape_list(None, "tiny,4000x64,100x8,100x8x16,151936x1024,qwen3-0.6b", {}) == ["tiny", "100x8", "151936x1024"]
    assert capsys.readouterr().err.splitlines() == ["--shapes 4000x64: the same head as tiny, run once under that name",
                                                    "--shapes 100x8x16: the same head as 100x8, run once under that name",
                                                    "--shapes qwen3-0.6b: the same head as 151936x1024, run once under that name"]
    # The largest counts the CUDA kernels take are taken (one past them is refused: test_bench_refuses_bad_options).
    assert vocab_shape_list(None, "1073741824x1073741824x1073741824", {}) == ["1073741824x1073741824x1073741824"]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("[enforce fail at alloc_cpu.cpp:127] . DefaultCPUAllocator: can't allocate "
                                                "memory: you tried to allocate 33554432000 bytes.")])
def test_spec_bench_weights_past_the_device_are_a_usage_error(error, monkeypatch, capsys):
    # The default Qwen3-32B-shaped target (about 66 GB) on a smaller device: a usage error naming the
    # flag, not the allocator's traceback (simulated: CI machines differ in memory).
    from flashhead_ext.bench import spec

    def random(config, **kwargs):
        raise error

    monkeypatch.setattr(spec.Decoder, "random", random)
    with pytest.raises(SystemExit) as exit_info:
        main(["spec", "--device", "cpu", "--head", "dense", "--mode", "baseline"])
    assert exit_info.value.code == 2
    assert f"--target qwen3-32b: its weights do not fit on cpu ({str(error).splitlines()[0]})" in capsys.readouterr().err
    monkeypatch.setattr(spec.Decoder, "random", lambda config, **kwargs: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="other"):  # any other failure is not a usage error
        main(["spec", "--device", "cpu", "--head", "dense", "--mode", "baseline"])


def test_cli_argument_types_at_their_edges(tmp_path):
    import argparse
    import os

    from flashhead_ext._cli import doc_summary, non_negative_int, output_file, positive_int_list, write_output

    assert non_negative_int("0") == 0 and positive_int_list("3,,5, 3") == [3, 5]
    assert doc_summary("The ``head`` bench.\n\nMore.") == "The head bench."
    # A file several missing directories down can be written once they are made; checking makes none of them.
    deep = tmp_path / "a" / "b" / "out.json"
    assert output_file(str(deep)) == str(deep) and not (tmp_path / "a").exists()
    assert write_output(deep, "{}") == deep and deep.read_text() == "{}"
    with pytest.raises(argparse.ArgumentTypeError, match="exists and is not a regular file"):
        output_file(os.devnull)  # a device: opened, it could block or act


def test_run_metadata_describes_the_device_the_run_uses():
    # A CPU run on a machine with a GPU is a CPU run: no GPU name, and no L2 to size the copies by
    # (a GPU's L2 once made `bench head --device cpu` rotate over copies there).
    meta = run_metadata("cpu")
    assert meta["device"] == "cpu" and "l2_bytes" not in meta and "sms" not in meta
    if torch.cuda.is_available():
        meta = run_metadata("cuda:0")
        assert meta["device"] == torch.cuda.get_device_name(0) and meta["l2_bytes"] > 0 and meta["sms"] > 0
        assert meta["cuda_index"] == 0 == run_metadata("cuda")["cuda_index"]


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["cuda:0", pytest.param("cuda:1", marks=TWO_GPUS)])
@pytest.mark.parametrize("bench", ["head", "draft-step"])
def test_benches_run_on_the_cuda_device_named(device, bench, tmp_path):
    # A device with an index is a CUDA run: its copy bandwidth and floors are measured (`bench head`
    # once did so only for "cuda"), and its graphs are captured and timed on that device's streams
    # (cuda:1's work captured through cuda:0's stream fails the capture).
    out = tmp_path / "run.json"
    argv = (["head", "--probes", "7", "--batches", "1", "--impls", "dense,flash_greedy", "--calls", "2"]
            if bench == "head" else ["draft-step", "--bodies", "eager", "--calls", "2"])
    assert main([*argv, "--shapes", "tiny", "--device", device, "--samples", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["copy_bandwidth_gbs"] > 0
    assert result["meta"]["device"] == torch.cuda.get_device_name(torch.device(device))
    floor = "floor_us" if bench == "head" else "body_floor_us"
    assert result["rows"] and all(r[floor] > 0 and r["step_us" if bench == "draft-step" else "us"] > 0
                                  for r in result["rows"])
    assert torch.cuda.current_device() == 0  # the device is current only for the run


def test_on_device_makes_a_cuda_device_current_for_its_block():
    with on_device("cpu"):
        pass  # no CUDA call: a CPU run on a machine without a GPU
    if torch.cuda.device_count() >= 2:
        with on_device("cuda:1"):
            assert torch.cuda.current_device() == 1
        assert torch.cuda.current_device() == 0


def test_a_cuda_device_this_machine_lacks_is_a_usage_error(monkeypatch):
    # Counted at the call, so any machine (this one has none) can stand in for one with 0, 1 or 2 GPUs.
    from flashhead_ext._cli import device_arg

    for count, missing, present in ((0, "cuda", None), (1, "cuda:1", "cuda:0"), (2, "cuda:2", "cuda:1")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        why = ("no CUDA device here (torch.cuda.is_available() is False)" if count == 0 else
               f"this machine has {count} CUDA device{'' if count == 1 else 's'}")
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"'{missing}': {why}")):
            device_arg(missing)
        if present:
            assert device_arg(present) == present


@pytest.mark.parametrize("bench", ["head", "clusters"])
def test_the_cpu_by_index_is_a_cpu_run(bench, tmp_path):
    # "cpu:0" passed the device check, then took the CUDA paths: graph mode, CUDA events, GPU floors.
    from flashhead_ext._cli import device_arg

    assert device_arg("cpu:0") == device_arg("cpu") == "cpu"
    out = tmp_path / "run.json"
    argv = (["head", "--probes", "7", "--batches", "1", "--impls", "dense,flash_greedy", "--calls", "2", "--samples", "2"]
            if bench == "head" else ["clusters", "--iters", "1"])
    assert main([*argv, "--shapes", "tiny", "--device", "cpu:0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["device"] == "cpu" and result["meta"].get("copy_bandwidth_gbs") is None
    assert {row.get("mode", "eager") for row in result["rows"]} == {"eager"}
    if bench == "head":  # what ran, as lists: graph mode dropped on the CPU (the flags' text said "eager,graph")
        assert result["args"]["modes"] == ["eager"] and result["args"]["impls"] == ["dense", "flash_greedy"]
    else:  # the iterations asked for, beside those k-means ran before it settled
        assert result["meta"]["args"]["iters"] == 1


@pytest.mark.gpu
@TWO_GPUS
def test_the_drivers_clock_times_the_models_device_not_the_current_one():
    # Its events were recorded on the current device's stream: a run on cuda:1 timed idle cuda:0.
    from flashhead_ext.speculative.driver import Clock

    clock = Clock(torch.device("cuda:1"))
    a = torch.randn(8192, 8192, device="cuda:1")
    with clock("matmuls"):
        for _ in range(8):
            a = a @ a / 8192
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize("cuda:1")
    assert clock.resolve()["matmuls"] > 5e-4  # 8 float32 GEMMs of 8192: milliseconds, not an idle device's microseconds


def test_layer_ops_rotates_copies_of_what_each_row_reads(monkeypatch):
    # Sized by the whole layer, a small matrix's copies had fit in an H200's L2 (o: 38 MB at Qwen3-0.6B).
    from flashhead_ext.bench import layer_ops
    from flashhead_ext.bench.layer_ops import L2_DEFEAT_BYTES, MAX_COPIES, _rotated

    small, large = torch.randn(64, 96), torch.randn(1024, 1024)
    copies = _rotated(dict(small=small, large=large), ["large"])
    assert len(copies) == L2_DEFEAT_BYTES // large.nbytes and copies[0]["large"] is large
    assert all(c["small"] is small for c in copies)  # what the row does not read is shared
    assert len({c["large"].data_ptr() for c in copies}) == len(copies) and all(torch.equal(c["large"], large) for c in copies)
    assert len(_rotated(dict(small=small, large=large), ["small"])) == MAX_COPIES
    # Copies of 600,000 bytes where 4 MB must pass between two uses: 6.67 of them, so 7.
    monkeypatch.setattr(layer_ops, "L2_DEFEAT_BYTES", 4_000_000)
    assert len(_rotated(dict(odd=torch.zeros(3, 50000)), ["odd"])) == 7


def test_layer_ops_without_a_gpu_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["layer-ops", "--shapes", "tiny", "--tokens", "1", "--samples", "1", "--calls", "1"])
    assert exit_info.value.code == 2 and "layer-ops times CUDA kernels and needs a GPU" in capsys.readouterr().err
    # As many tokens as the cache holds fit in it (the rows' call starts at position 0): past the
    # token check, to the GPU's.
    with pytest.raises(SystemExit) as exit_info:
        main(["layer-ops", "--shapes", "tiny", "--tokens", "1,7", "--context", "7", "--samples", "1", "--calls", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "needs a GPU" in err and "exceeds --context" not in err


@pytest.mark.gpu
def test_layer_ops_runs_its_rows(tmp_path):
    out = tmp_path / "layer_ops.json"
    assert main(["layer-ops", "--shapes", "tiny", "--tokens", "1", "--samples", "2", "--calls", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 5 and all(r["ours_us"] > 0 and r["torch_us"] > 0 and r["floor_us"] > 0 for r in rows)


def test_a_note_comes_after_what_stdout_printed_before_it(monkeypatch):
    # Both streams led to one file (a log, `2>&1 | tee`): stdout, piped, is buffered where stderr is
    # not, so "wrote FILE" came out before the table printed above it.
    import io
    import sys

    from flashhead_ext._cli import note

    class BufferedStdout(io.StringIO):
        def __init__(self, sink):
            super().__init__()
            self.sink = sink

        def flush(self):
            self.sink.write(self.getvalue())
            self.seek(0)
            self.truncate()

    combined = io.StringIO()
    monkeypatch.setattr(sys, "stdout", BufferedStdout(combined))
    monkeypatch.setattr(sys, "stderr", combined)
    print("the table")
    note("wrote out.json")
    assert combined.getvalue() == "the table\nwrote out.json\n"


SPEC = ["spec", "--target", "tiny", "--draft", "tiny", "--target-layers", "9"]  # refused last, for --target-layers
# Where each run calls flashhead ops: bench head's floors and draft-step's FlashHead rows always, bench
# spec's target for a fused or persistent --target-body, its draft for a FlashHead head or such a --body.
CPU_ONLY_BUILD_RUNS = [
    (["head", "--shapes", "tiny", "--impls", "dense,torch_flash", "--device", "cuda"], "--device cuda: bench head needs"),
    (["draft-step", "--shapes", "tiny", "--device", "cuda"], "--device cuda: draft-step's FlashHead rows need"),
    ([*SPEC, "--device", "cuda"], "--device cuda: a FlashHead draft needs"),
    ([*SPEC, "--device", "cpu", "--draft-device", "cuda"], "--draft-device cuda: a FlashHead draft needs"),
    ([*SPEC, "--device", "cuda", "--head", "dense"], "--device cuda: --body persistent needs"),
    ([*SPEC, "--device", "cuda", "--mode", "baseline", "--target-body", "fused"], "--device cuda: --target-body fused needs"),
    ([*SPEC, "--device", "cuda", "--mode", "baseline", "--target-body", "persistent"],
     "--device cuda: --target-body persistent needs"),
    ([*SPEC, "--device", "cuda", "--head", "dense", "--body", "compiled"], None),
    ([*SPEC, "--device", "cuda", "--mode", "baseline"], None),  # the compiled target
    ([*SPEC, "--device", "cuda", "--draft-device", "cpu"], None),
    (["layer-ops", "--shapes", "tiny"], "layer-ops times"),
]


@pytest.mark.parametrize("argv, refusal", CPU_ONLY_BUILD_RUNS)
def test_a_cpu_only_build_on_a_gpu_refuses_the_runs_that_need_its_kernels(argv, refusal, monkeypatch, capsys):
    # The first op raised mid-run (torch's "may not exist for this backend"); runs of torch's ops alone
    # go on. Any machine stands in for a GPU one with a CPU-only build: the GPU and the build are what
    # these read.
    import flashhead_ext._cli as cli

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "build_info", lambda: argparse.Namespace(WITH_CUDA=False))
    monkeypatch.setattr("flashhead_ext.bench.layer_ops.build_info", cli.build_info)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    if refusal is None:
        assert "CUDA kernels" not in error and "--target-layers: num_layers must be an int in 1..2" in error
    else:
        assert refusal in error and ("flashhead_ext's CUDA kernels, and this build has none (built with "
                                     "FLASHHEAD_SKIP_CUDA_BUILD=1 or without a CUDA toolkit): reinstall flashhead_ext "
                                     "with FLASHHEAD_SKIP_CUDA_BUILD unset") in error
