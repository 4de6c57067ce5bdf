"""compare-heads' table: its rows, and the note when asked probes exceed the clusters."""
import pytest

from flashhead_ext.__main__ import build_parser, format_table


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
    clamped = format_table(_result([(8, [8]), (64, [500, 100])])).splitlines()
    assert clamped[-1].startswith("probes 100, 500 exceed the 64 clusters: run with every cluster probed")
    assert clamped[4].split()[1] == "64"  # one row, the probes actually used


def test_probes_values_must_be_positive(capsys):
    parser = build_parser()
    assert parser.parse_args(["compare-heads", "--probes", "3,500"]).probes == [3, 500]
    with pytest.raises(SystemExit):
        parser.parse_args(["compare-heads", "--probes", "0"])
    assert "expected positive values" in capsys.readouterr().err


def test_an_unwritable_json_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compare-heads", "--json", str(tmp_path)])
    assert f"argument --json: '{tmp_path}' is a directory" in capsys.readouterr().err


def test_usage_names_the_command_as_typed(monkeypatch):
    monkeypatch.setattr("sys.argv", ["/opt/venv/bin/flashhead", "--help"])  # the console script
    assert build_parser().prog == "flashhead"
    monkeypatch.setattr("sys.argv", ["/repo/flashhead_ext/__main__.py", "--help"])  # python -m flashhead_ext
    assert build_parser().prog == "python -m flashhead_ext"
