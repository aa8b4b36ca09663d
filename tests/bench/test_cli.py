"""The CLI's exit statuses: ``report`` on files it cannot read, ``run`` when a run in the suite failed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

from chunkstar_bench import results, runner
from chunkstar_bench.cli import main
from chunkstar_bench.results import COLUMNS, SCHEMA_VERSION, ResultsDB
from chunkstar_bench.runner import RunRecord, RunSpec
from tests.bench._records import record


def _foreign(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE things (x)")


def _missing_column(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute(f"CREATE TABLE runs ({', '.join(name for name, _ in COLUMNS if name != 'mfu')})")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _newer(path: Path) -> None:
    ResultsDB(path)
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")


BAD_DATABASES: dict[str, tuple[Callable[[Path], Any], str]] = {
    "missing": (lambda p: None, "no such file"),
    "directory": (lambda p: p.mkdir(), "a directory, not a results database"),
    "text file": (lambda p: p.write_text("id,status\n1,ok\n" * 100), "not an SQLite database"),
    "empty file": (lambda p: p.write_bytes(b""), "has no 'runs' table"),
    "foreign schema": (_foreign, "has no 'runs' table"),
    "missing column": (_missing_column, "lacks the columns mfu"),
    "newer schema": (_newer, "newer than the"),
}


def _snapshot(path: Path) -> tuple[list[str], bytes | None, int | None]:
    """The names in ``path``'s folder, its bytes and its mtime: a read-only report changes none of them."""
    names = sorted(os.listdir(path.parent))
    if path.is_file():
        return names, path.read_bytes(), path.stat().st_mtime_ns
    return names, None, None


def _one_line(err: str, path: Path) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"chunkstar-bench report: {path}"), err
    return lines[0]


@pytest.mark.parametrize("kind", list(BAD_DATABASES))
def test_report_on_a_bad_database_is_one_line_and_exit_2(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make, expected = BAD_DATABASES[kind]
    path = tmp_path / "results.sqlite"
    make(path)
    before = _snapshot(path)
    assert main(["report", "--db", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert expected in _one_line(err, path)
    assert _snapshot(path) == before  # nothing created, nothing written (no journal, no table)



@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Another process's exclusive lock on the database, for the block."""
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()

def test_report_on_a_locked_database(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "results.sqlite"
    ResultsDB(path).append(record(), suite="cpu")
    monkeypatch.setattr(results, "READ_TIMEOUT_S", 0.2)
    with _locked(path):
        assert main(["report", "--db", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "locked by another process (waited 0.2 s)" in _one_line(err, path)
    assert main(["report", "--db", str(path)]) == 0  # the lock gone, the same file reads


def test_report_never_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "results.sqlite"
    ResultsDB(path).append(record(), suite="cpu")
    path.chmod(0o444)
    before = _snapshot(path)
    try:
        assert main(["report", "--db", str(path)]) == 0
    finally:
        path.chmod(0o644)
    assert "cpu-tiny" in capsys.readouterr().out
    assert _snapshot(path) == before


def test_report_error_in_a_subprocess_has_no_traceback(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "chunkstar_bench.cli", "report", "--db", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip() == f"chunkstar-bench report: {tmp_path}: a directory, not a results database"


@pytest.fixture
def fake_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """``runner.run`` replaced by a record of the status given per system (ok when not given), no subprocess."""
    statuses: dict[str, str] = {}

    def fake(spec: RunSpec, timeout_s: float) -> RunRecord:
        made = record(spec.system, spec.model, status=statuses.get(spec.system, "ok"))
        return dataclasses.replace(made, spec=spec, wall_s=1.0)

    monkeypatch.setattr("chunkstar_bench.runner.run", fake)
    yield statuses


def test_run_exits_nonzero_when_a_run_failed(fake_runs: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_runs.update(deepspeed="oom", fsdp2="error")
    db = tmp_path / "r.sqlite"
    assert main(["run", "--suite", "nightly", "--db", str(db), "--model", "cpu-small"]) == 1
    out, err = capsys.readouterr()
    assert "runs of suite 'nightly' appended" in out  # the summary is printed first
    assert "deepspeed cpu-small x1: oom" in out
    assert err.splitlines()[-1].startswith("chunkstar-bench run: 2 of ") and err.endswith("runs failed (1 error, 1 oom)\n")
    assert set(ResultsDB(db).runs()["status"]) == {"ok", "oom", "error"}  # every run is still stored


def test_run_exits_zero_when_every_run_was_ok(fake_runs: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--suite", "nightly", "--db", str(tmp_path / "r.sqlite"), "--system", "pytorch"]) == 0
    out, err = capsys.readouterr()
    assert "1 runs of suite 'nightly' appended" in out and "failed" not in err


@pytest.mark.parametrize("flag, name", [("--system", "pytorh"), ("--model", "cpu-smal")])
def test_run_refuses_a_name_the_suite_does_not_have(flag: str, name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "r.sqlite"
    assert main(["run", "--suite", "nightly", "--db", str(db), flag, name]) == 2
    err = capsys.readouterr().err
    assert name in err and "not in suite 'nightly'" in err
    assert not db.exists()  # nothing ran, nothing was created


# ------------------------------------------------------------------ run: the database is checked before the first run


def _foreign_runs_table(path: Path) -> None:
    """A ``runs`` table of someone else's, under this schema's version number: used to train the whole suite first."""
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _truncated(path: Path) -> None:
    db = ResultsDB(path)
    for _ in range(100):
        db.append(record(), suite="cpu")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


BAD_RUN_DATABASES: dict[str, tuple[Callable[[Path], Any], str]] = {
    "directory": (lambda p: p.mkdir(), "a directory, not a results database"),
    "text file": (lambda p: p.write_text("id,status\n1,ok\n" * 100), "not an SQLite database"),
    "garbage": (lambda p: p.write_bytes(bytes(range(256)) * 16), "not an SQLite database"),
    "foreign schema": (_foreign, "no chunkstar-bench schema version"),
    "foreign runs table": (_foreign_runs_table, "lacks the columns created_utc"),
    "missing column": (_missing_column, "lacks the columns mfu"),
    "newer schema": (_newer, "newer than the"),
    "truncated": (_truncated, "damaged"),
    "fifo": (lambda p: os.mkfifo(p), "not a regular file"),
    "under a file": (lambda p: None, "a part of the path is a file, not a folder"),
}


def _assert_refused_before_any_run(path: Path, expected: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    before = _snapshot(path) if path.parent.is_dir() else None
    ran: list[str] = []
    monkeypatch.setattr("chunkstar_bench.runner.run", lambda spec, timeout: ran.append(spec.system))
    assert main(["run", "--suite", "nightly", "--db", str(path), "--system", "pytorch"]) == 2
    out, err = capsys.readouterr()
    assert ran == [] and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"chunkstar-bench run: {path}"), err
    assert expected in lines[0], err
    if before is not None:
        assert _snapshot(path) == before  # a refused file is left as it was, and no journal is left beside it


@pytest.mark.parametrize("kind", list(BAD_RUN_DATABASES))
def test_run_checks_the_database_before_the_first_run(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    make, expected = BAD_RUN_DATABASES[kind]
    path = tmp_path / "results.sqlite"
    if kind == "under a file":
        (tmp_path / "plain").write_text("a file, not a folder")
        path = tmp_path / "plain" / "results.sqlite"
    make(path)
    _assert_refused_before_any_run(path, expected, capsys, monkeypatch)


@pytest.fixture
def read_only_db(tmp_path: Path) -> Iterator[Path]:
    """A results file this user cannot write: mode 444, or, for root (who writes through a mode), immutable."""
    path = tmp_path / "results.sqlite"
    ResultsDB(path).append(record(), suite="cpu")
    path.chmod(0o444)
    immutable = False
    if os.access(path, os.W_OK):
        chattr = shutil.which("chattr")
        immutable = chattr is not None and subprocess.run([chattr, "+i", str(path)], capture_output=True).returncode == 0
        if not immutable:
            path.chmod(0o644)
            pytest.skip("this user writes through a mode of 444 and cannot make a file immutable")
    try:
        yield path
    finally:
        if immutable:
            subprocess.run([str(shutil.which("chattr")), "-i", str(path)], check=True)
        path.chmod(0o644)


def test_run_on_a_read_only_database(read_only_db: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _assert_refused_before_any_run(read_only_db, "cannot be written (a read-only file, folder or filesystem)", capsys, monkeypatch)


def test_run_on_a_locked_database_says_so_after_a_short_wait(
    fake_runs: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "results.sqlite"
    ResultsDB(path).append(record(), suite="cpu")
    monkeypatch.setattr(results, "READ_TIMEOUT_S", 0.2)
    with _locked(path):
        assert main(["run", "--suite", "nightly", "--db", str(path), "--system", "pytorch"]) == 2
    err = capsys.readouterr().err
    assert err == f"chunkstar-bench run: {path}: the database is locked by another process (waited 0.2 s); try again when it is done\n"
    assert len(ResultsDB(path).runs()) == 1


def test_run_on_a_fifo_returns_at_once_without_a_traceback(tmp_path: Path) -> None:
    fifo = tmp_path / "results.sqlite"
    os.mkfifo(fifo)
    # the runner is replaced by an exit: were the check to pass, the command would stop there, not train
    code = "import sys, chunkstar_bench.runner as r; r.run = lambda *a: sys.exit(99)\n" \
           "from chunkstar_bench.cli import main; sys.exit(main(sys.argv[1:]))"  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", code, "run", "--suite", "nightly", "--db", str(fifo), "--system", "pytorch"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip() == f"chunkstar-bench run: {fifo}: not a regular file, so not a results database"


def test_run_sets_a_row_aside_when_appending_fails(
    fake_runs: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "results.sqlite"
    monkeypatch.setattr(results, "WRITE_TIMEOUT_S", 0.2)
    holders: list[sqlite3.Connection] = []
    fake = runner.run  # the fixture's record maker

    def run_then_lock(spec: RunSpec, timeout_s: float) -> RunRecord:
        made = fake(spec, timeout_s)
        if spec.system == "deepspeed":  # another process takes the file for itself from the second run on
            holder = sqlite3.connect(path, isolation_level=None)
            holder.execute("BEGIN EXCLUSIVE")
            holders.append(holder)
        return made

    monkeypatch.setattr("chunkstar_bench.runner.run", run_then_lock)
    try:
        status = main(["run", "--suite", "nightly", "--db", str(path), "--model", "cpu-small"])
    finally:
        for holder in holders:
            holder.execute("ROLLBACK")
            holder.close()
    out, err = capsys.readouterr()
    assert status == 2
    aside = tmp_path / "results.sqlite.unsaved.jsonl"
    rows = [json.loads(line) for line in aside.read_text().splitlines()]
    stored = ResultsDB(path).runs()
    assert len(stored) + len(rows) == 4 and len(rows) >= 1  # every measurement kept, in the file or beside it
    assert {r["system"] for r in rows} | set(stored["system"]) == {"chunkstar", "deepspeed", "fsdp2", "pytorch"}
    assert set(rows[0]) == {name for name, _ in COLUMNS} - {"id"}
    assert f"{path}: the database is locked by another process" in err and str(aside) in err
    for system in ("chunkstar", "deepspeed", "fsdp2", "pytorch"):
        assert f"{system} " in out  # the summary table still shows every run
