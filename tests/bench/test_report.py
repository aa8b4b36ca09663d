"""Report tables: ours beside published (always labelled so), max-scale summary, CLI."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from chunkstar_bench.cli import main
from chunkstar_bench.report import PUBLISHED_LABEL, maxscale_table, paper_tables, published_table, report
from chunkstar_bench.results import ResultsDB
from tests.bench._records import record


def test_published_table_is_per_gpu() -> None:
    table = published_table("a100x8_1tb", "patrickstar")
    assert table is not None
    assert table.loc["6B", 1] == pytest.approx(114.0)
    assert table.loc["6B", 8] == pytest.approx(1180 / 8)
    assert published_table("cpu", "chunkstar") is None


def test_paper_tables_put_ours_beside_published(tmp_path: Path) -> None:
    db = ResultsDB(tmp_path / "r.sqlite")
    db.append(record("chunkstar", "GPT3_6B", hardware="a100x8_1tb", step=2.0), suite="paper-a100")
    db.append(record("chunkstar", "GPT3_6B", hardware="a100x8_1tb", nprocs=2, status="oom"), suite="paper-a100")
    text = paper_tables(db.runs())
    assert "a100x8_1tb / chunkstar" in text and "ours:" in text
    assert f"the published columns: PatrickStar, {PUBLISHED_LABEL}" in text
    assert f"the published columns: DeepSpeed, {PUBLISHED_LABEL}" in text
    # a readable table: a header row of our and the published figure per GPU count, no pandas pivot axes
    assert "1 GPU ours  1 GPU published  2 GPUs ours" in text
    six = next(line for line in text.splitlines() if line.startswith("6B "))
    ours_1, published_1, ours_2 = six.split()[1:4]
    assert published_1 == "114.0" and ours_1 != "-" and ours_2 == "-"  # the oom run has no figure
    assert "nprocs" not in text and "NaN" not in text


def test_cpu_tables_say_there_is_nothing_published(tmp_path: Path) -> None:
    db = ResultsDB(tmp_path / "r.sqlite")
    db.append(record("pytorch", "cpu-small"), suite="cpu")
    db.append(record("fsdp2", "cpu-small", status="error"), suite="cpu")
    text = report(db.runs())
    assert "no paper-shaped table for CPU runs" in text
    assert "TFLOPS" not in text.split("# Paper-shaped tables")[0].split("## cpu on cpu")[1].split("TFLOPS/GPU (8NBs) =")[0]
    assert "fsdp2 cpu-small x1: error" in text
    assert PUBLISHED_LABEL not in text


def test_maxscale_table(tmp_path: Path) -> None:
    db = ResultsDB(tmp_path / "r.sqlite")
    cap = 8 * 2**30
    db.append(record("chunkstar", "cpu-355m", cap=cap), suite="max-scale")
    db.append(record("chunkstar", "cpu-430m", cap=cap, status="oom"), suite="max-scale")
    db.append(record("deepspeed", "cpu-250m", cap=cap), suite="max-scale")
    text = maxscale_table(db.runs())
    assert "cpu-355m (353.9M)" in text and "cpu-430m (429.5M, oom)" in text and "cpu-250m (253.1M)" in text
    assert "8.00" in text


def test_cli_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.sqlite"
    ResultsDB(path).append(record("pytorch", "cpu-small"), suite="cpu")
    assert main(["report", "--db", str(path)]) == 0
    out = capsys.readouterr().out
    assert "# Runs" in out and "cpu-small" in out and "# Max-scale search" in out
    assert main(["report", "--db", str(tmp_path / "missing.sqlite")]) == 2


def test_cli_report_leaves_out_a_row_it_cannot_read_and_says_which(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.sqlite"
    db = ResultsDB(path)
    db.append(record("pytorch", "cpu-small"), suite="cpu")
    db.append(record("deepspeed", "cpu-small"), suite="cpu")
    db.append(record("fsdp2", "cpu-small"), suite="cpu")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE runs SET tokens_per_s = 'garbage' WHERE system = 'deepspeed'")
        conn.execute("UPDATE runs SET config_json = 'garbage' WHERE system = 'fsdp2'")
    assert main(["report", "--db", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == (
        f"chunkstar-bench report: {path}: 2 rows cannot be read: row id 2 (tokens_per_s holds text, not a number), "
        "row id 3 (config_json is not a JSON object); the report leaves them out\n"
    )
    assert "pytorch" in out and "deepspeed" not in out and "fsdp2" not in out
