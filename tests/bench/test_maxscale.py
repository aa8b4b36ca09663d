"""Max-scale search over real, isolated runs under a host-memory cap."""

from __future__ import annotations

from pathlib import Path

from chunkstar_bench.maxscale import SUITE, search
from chunkstar_bench.results import ResultsDB


def test_bisection_finds_the_largest_model_under_the_cap(tmp_path: Path) -> None:
    # cpu-tiny trains in well under 1.5 GiB; cpu-1.5b's fp32 weights alone are 6 GiB,
    # so the watchdog stops it while it is still being built.
    db = ResultsDB(tmp_path / "r.sqlite")
    best, records = search(
        "pytorch", ["cpu-1.5b", "cpu-tiny"], int(1.5 * 2**30), db=db, batch=1, seq_len=32, warmup=1, echo=False
    )
    assert best == "cpu-tiny"
    assert [(r.spec.model, r.status) for r in records] == [("cpu-tiny", "ok"), ("cpu-1.5b", "oom")]
    df = db.runs(suite=SUITE)
    assert list(df["status"]) == ["ok", "oom"]


def test_nothing_fits_gives_none(tmp_path: Path) -> None:
    best, records = search("pytorch", ["cpu-tiny"], 100 * 2**20, batch=1, seq_len=32, warmup=1, echo=False)
    assert best is None and records[0].status == "oom"
