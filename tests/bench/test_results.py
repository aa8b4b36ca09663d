"""The SQLite results file: round trip, schema version, concurrent appends."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest

from chunkstar_bench.results import COLUMNS, SCHEMA_VERSION, BadRowsError, ResultsDB, ResultsFileError, SchemaVersionError
from tests.bench._records import record


def test_round_trip(tmp_path: Path) -> None:
    db = ResultsDB(tmp_path / "r.sqlite")
    rid = db.append(record("chunkstar", "cpu-small"), suite="cpu")
    db.append(record("deepspeed", "cpu-small", status="oom"), suite="cpu")
    df = db.runs()
    assert list(df.columns) == [name for name, _ in COLUMNS]
    assert len(df) == 2 and df.iloc[0]["id"] == rid
    row = df.iloc[0]
    assert (row["system"], row["model"], row["status"], row["suite"], row["seq_len"]) == ("chunkstar", "cpu-small", "ok", "cpu", 128)
    assert row["step_time_s"] == pytest.approx(0.5)
    config = json.loads(row["config_json"])
    assert config["spec"]["system"] == "chunkstar" and config["details"]["losses"] == [1.0, 0.9]
    assert "8*N*B*s" in config["flops_formulas"]["tflops_per_gpu_patrickstar"]
    assert json.loads(row["versions_json"]) == {"torch": "x"}
    assert df.iloc[1]["status"] == "oom" and df.iloc[1]["message"].startswith("MemoryError")
    assert df.iloc[1]["step_time_s"] != df.iloc[1]["step_time_s"]  # NaN: no figure for a failed run
    assert list(db.runs(system="deepspeed")["status"]) == ["oom"]
    assert len(db.runs(system=["deepspeed", "chunkstar"], suite="cpu")) == 2
    assert db.runs(model="cpu-base").empty
    with pytest.raises(KeyError, match="config_json"):
        db.runs(config_json="{}")


def test_reopen_keeps_rows_and_version(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    ResultsDB(path).append(record(), suite="a")
    ResultsDB(path).append(record(), suite="b")
    assert list(ResultsDB(path).runs()["suite"]) == ["a", "b"]
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    ResultsDB(path)
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(SchemaVersionError, match="newer"):
        ResultsDB(path)


def test_foreign_sqlite_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE things (x)")
    with pytest.raises(SchemaVersionError, match="no chunkstar-bench schema version"):
        ResultsDB(path)


def test_read_only_creates_and_changes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.sqlite"
    with pytest.raises(ResultsFileError, match="no such file"):
        ResultsDB(path, read_only=True)
    assert not (tmp_path / "sub").exists()
    ResultsDB(path).append(record(), suite="a")
    before = path.read_bytes()
    ro = ResultsDB(path, read_only=True)
    assert list(ro.runs()["suite"]) == ["a"] and list(ro.runs(suite="b")["suite"]) == []
    with pytest.raises(ValueError, match="read-only"):
        ro.append(record(), suite="b")
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == ["r.sqlite"]


def test_an_empty_file_is_refused_read_only_and_left_empty(tmp_path: Path) -> None:
    path = tmp_path / "empty.sqlite"
    path.touch()
    with pytest.raises(ResultsFileError, match="no 'runs' table"):
        ResultsDB(path, read_only=True)
    assert path.stat().st_size == 0


def test_status_must_be_known(tmp_path: Path) -> None:
    db = ResultsDB(tmp_path / "r.sqlite")
    with pytest.raises(sqlite3.IntegrityError):
        db.append(record(status="maybe"), suite="x")


def test_appends_from_two_connections_at_once(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    first, second = ResultsDB(path), ResultsDB(path)
    errors: list[BaseException] = []

    def writer(db: ResultsDB, suite: str) -> None:
        try:
            for _ in range(25):
                db.append(record(), suite=suite)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(first, "one")), threading.Thread(target=writer, args=(second, "two"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    df = ResultsDB(path).runs()
    assert len(df) == 50 and sorted(df["id"]) == list(range(1, 51))
    assert (df["suite"] == "one").sum() == 25


def _spoil(path: Path, sql: str) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute(sql)


def test_rows_of_the_wrong_type_are_named_and_the_others_kept(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    db = ResultsDB(path)
    for system in ("chunkstar", "deepspeed", "fsdp2", "pytorch"):
        db.append(record(system), suite="cpu")
    _spoil(path, "UPDATE runs SET step_time_s = 'garbage' WHERE id = 2")
    _spoil(path, "UPDATE runs SET config_json = '{not json' WHERE id = 3")
    for reader in (db, ResultsDB(path, read_only=True)):
        with pytest.raises(BadRowsError) as caught:
            reader.runs()
        err = caught.value
        assert str(err) == (
            f"{path}: 2 rows cannot be read: row id 2 (step_time_s holds text, not a number), "
            "row id 3 (config_json is not a JSON object)"
        )
        assert [(b.row_id, b.column) for b in err.bad] == [(2, "step_time_s"), (3, "config_json")]
        good = err.good
        assert list(good["system"]) == ["chunkstar", "pytorch"] and list(good.columns) == [name for name, _ in COLUMNS]
        assert good["step_time_s"].dtype == float  # as from a clean file: numbers, not objects
        assert isinstance(err, ResultsFileError)  # a caller that cannot use part of a file refuses it whole


def test_a_text_column_holding_a_number_or_an_unknown_status_is_a_bad_row(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite"
    cols = ", ".join(name for name, _ in COLUMNS)  # no type affinity: SQLite keeps whatever is written
    _spoil(path, f"CREATE TABLE runs ({cols})")
    _spoil(path, f"PRAGMA user_version = {SCHEMA_VERSION}")
    good = ResultsDB(tmp_path / "good.sqlite")
    good.append(record(), suite="cpu")
    row = good.runs().iloc[0].to_dict()
    with sqlite3.connect(path) as conn:
        for i, change in enumerate(({}, {"status": "maybe"}, {"nprocs": None}, {"model": 7}, {"versions_json": "[1]"}), 1):
            values = {**row, **change, "id": i}
            conn.execute(f"INSERT INTO runs ({cols}) VALUES ({', '.join('?' for _ in values)})", [values[n] for n, _ in COLUMNS])
    with pytest.raises(BadRowsError) as caught:
        ResultsDB(path, read_only=True).runs()
    assert [(b.row_id, b.column, b.problem) for b in caught.value.bad] == [
        (2, "status", "is not one of ok, oom, error"), (3, "nprocs", "is empty"), (4, "model", "holds a number, not text"),
        (5, "versions_json", "is not a JSON object"),
    ]  # fmt: skip
    assert list(caught.value.good["id"]) == [1]
