"""The whole cpu suite from one command (minutes: nightly job only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from chunkstar_bench.cli import main
from chunkstar_bench.results import ResultsDB


@pytest.mark.slow
def test_cpu_suite_runs_end_to_end(tmp_path: Path) -> None:
    path = tmp_path / "cpu.sqlite"
    assert main(["run", "--suite", "cpu", "--db", str(path)]) == 0
    df = ResultsDB(path).runs()
    assert set(df["system"]) == {"chunkstar", "deepspeed", "fsdp2", "pytorch"}
    assert (df["status"] == "ok").all(), df[["system", "model", "status", "message"]].to_string()
    assert main(["report", "--db", str(path)]) == 0
