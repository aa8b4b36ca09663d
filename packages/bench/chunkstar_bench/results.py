"""Benchmark results in SQLite: one row per run, appended, never rewritten.

A results file is a plain SQLite database (stdlib ``sqlite3``) with one table,
``runs``, whose layout is versioned with ``PRAGMA user_version``. Opening a
file written by a newer chunkstar-bench is refused with a sentence saying so
(an older reader would silently drop columns it does not know). Every write is
its own short transaction, so several processes (a suite and a max-scale search,
say) can append to one file; SQLite's file locking serialises them.

Readers that must not change anything (``chunkstar-bench report``, the
dashboard) open the file read-only (``ResultsDB(path, read_only=True)``): SQLite's
``mode=ro``, so no file, journal or table is ever created, and a file that is
missing, a directory, not SQLite, locked past a short wait, or of a foreign
schema raises :class:`ResultsFileError` with one sentence naming the path.

This module stores and queries; it does not run anything or format tables.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import stat
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

    from chunkstar_bench.runner import RunRecord

__all__ = ["COLUMNS", "READ_TIMEOUT_S", "SCHEMA_VERSION", "WRITE_TIMEOUT_S", "ResultsDB", "ResultsFileError", "SchemaVersionError"]

SCHEMA_VERSION = 1
"""Layout version of the ``runs`` table written by this code (``PRAGMA user_version``)."""

COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "INTEGER PRIMARY KEY AUTOINCREMENT"),
    ("created_utc", "TEXT NOT NULL"),
    ("suite", "TEXT NOT NULL"),
    ("system", "TEXT NOT NULL"),
    ("model", "TEXT NOT NULL"),
    ("n_params", "INTEGER"),
    ("hardware", "TEXT NOT NULL"),
    ("nprocs", "INTEGER NOT NULL"),
    ("batch", "INTEGER NOT NULL"),
    ("seq_len", "INTEGER NOT NULL"),
    ("status", "TEXT NOT NULL CHECK (status IN ('ok', 'oom', 'error'))"),
    ("message", "TEXT NOT NULL DEFAULT ''"),
    ("step_time_s", "REAL"),
    ("tokens_per_s", "REAL"),
    ("tflops_per_gpu_patrickstar", "REAL"),
    ("tflops_per_gpu_megatron", "REAL"),
    ("mfu", "REAL"),
    ("peak_device_bytes", "INTEGER"),
    ("peak_host_bytes", "INTEGER"),
    ("config_json", "TEXT NOT NULL"),
    ("versions_json", "TEXT NOT NULL"),
    ("git_commit", "TEXT NOT NULL DEFAULT ''"),
    ("host", "TEXT NOT NULL DEFAULT ''"),
)
"""The ``runs`` table, in order; the FLOP formula of each TFLOPS column is named in ``config_json``."""

_NAMES = tuple(name for name, _ in COLUMNS)
_FILTERABLE = frozenset(_NAMES) - {"config_json", "versions_json"}

READ_TIMEOUT_S = 2.0
"""How long a read-only reader waits for another process's write lock before giving up."""
WRITE_TIMEOUT_S = 60.0
"""How long a writer waits for another process's lock (appends are short; a suite must not lose a row)."""


class ResultsFileError(RuntimeError):
    """The file is not a readable results database (missing, a directory, not SQLite, locked, foreign); the message says which."""


class SchemaVersionError(ResultsFileError):
    """The database was written by a newer (or unknown) layout than this code reads."""


class ResultsDB:
    """A results database at ``path``: created with the current schema when new, unless ``read_only``.

    ``read_only`` opens an existing file without ever writing to it and checks
    that it holds a ``runs`` table with every column; otherwise
    :class:`ResultsFileError`.
    """

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        if read_only:
            self._check_readable()
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise SchemaVersionError(
                    f"{self.path} has results schema version {version}, newer than the {SCHEMA_VERSION} this "
                    "chunkstar-bench reads; upgrade chunkstar-bench (or write to a new file)"
                )
            if version == 0:
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                if tables - {"sqlite_sequence"}:
                    raise SchemaVersionError(
                        f"{self.path} is an SQLite file with tables {sorted(tables)} but no chunkstar-bench "
                        "schema version; refusing to write into it"
                    )
                cols = ",\n  ".join(f"{name} {decl}" for name, decl in COLUMNS)
                conn.execute(f"CREATE TABLE runs (\n  {cols}\n)")
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _connect(self) -> sqlite3.Connection:
        if self.read_only:
            # mode=ro: SQLite neither creates the file nor writes to it; a short wait for a writer's lock.
            uri = f"file:{urllib.parse.quote(str(self.path.resolve()))}?mode=ro"
            return sqlite3.connect(uri, uri=True, timeout=READ_TIMEOUT_S, isolation_level=None)
        # timeout: wait (not fail) while another process holds the write lock.
        conn = sqlite3.connect(self.path, timeout=WRITE_TIMEOUT_S, isolation_level=None)
        conn.execute(f"PRAGMA busy_timeout = {int(WRITE_TIMEOUT_S * 1000)}")
        return conn

    @contextlib.contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        """A connection whose SQLite errors become :class:`ResultsFileError` sentences naming the file."""
        conn: sqlite3.Connection | None = None
        try:
            conn = self._connect()
            yield conn
        except sqlite3.Error as err:
            raise self._unreadable(err) from None
        finally:
            if conn is not None:
                conn.close()

    def _unreadable(self, err: BaseException) -> ResultsFileError:
        text = str(err)
        if "locked" in text or "busy" in text:
            wait = READ_TIMEOUT_S if self.read_only else WRITE_TIMEOUT_S
            return ResultsFileError(f"{self.path}: the database is locked by another process (waited {wait:g} s); try again when it is done")
        if "not a database" in text:
            return ResultsFileError(f"{self.path}: not an SQLite database")
        return ResultsFileError(f"{self.path}: cannot be read as an SQLite database ({text})")

    def _check_readable(self) -> None:
        """For ``read_only``: the file exists, is SQLite and holds this code's ``runs`` table (no newer layout)."""
        try:
            mode = self.path.stat().st_mode
        except FileNotFoundError:
            raise ResultsFileError(f"{self.path}: no such file") from None
        except OSError as err:
            raise ResultsFileError(f"{self.path}: cannot be read ({err.strerror or err})") from None
        if stat.S_ISDIR(mode):
            raise ResultsFileError(f"{self.path}: a directory, not a results database")
        if not stat.S_ISREG(mode):
            raise ResultsFileError(f"{self.path}: not a regular file, so not a results database")
        with self._reading() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            have = [row[1] for row in conn.execute("PRAGMA table_info(runs)")]
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{self.path} has results schema version {version}, newer than the {SCHEMA_VERSION} this "
                "chunkstar-bench reads; upgrade chunkstar-bench"
            )
        if not have:
            raise ResultsFileError(f"{self.path}: an SQLite file, but not a chunkstar-bench results database (it has no 'runs' table)")
        missing = [name for name in _NAMES if name not in have]
        if missing:
            raise ResultsFileError(
                f"{self.path}: not a chunkstar-bench results database (its 'runs' table lacks the columns {', '.join(missing)})"
            )

    def append(self, record: RunRecord, *, suite: str) -> int:
        """Store one run's record under ``suite``; the new row's id."""
        if self.read_only:
            raise ValueError(f"{self.path} was opened read-only; cannot append to it")
        spec = record.spec
        row: dict[str, Any] = {
            "created_utc": record.created_utc,
            "suite": suite,
            "system": spec.system,
            "model": spec.model,
            "n_params": record.n_params,
            "hardware": spec.hardware,
            "nprocs": spec.nprocs,
            "batch": spec.batch,
            "seq_len": spec.seq,
            "status": record.status,
            "message": record.message,
            "step_time_s": record.step_time_s,
            "tokens_per_s": record.tokens_per_s,
            "tflops_per_gpu_patrickstar": record.tflops_per_gpu_patrickstar,
            "tflops_per_gpu_megatron": record.tflops_per_gpu_megatron,
            "mfu": record.mfu,
            "peak_device_bytes": record.peak_device_bytes,
            "peak_host_bytes": record.peak_host_bytes,
            "config_json": json.dumps(
                {**record.config(), "peak_device_kind": record.peak_device_kind, "wall_s": record.wall_s},
                sort_keys=True, default=str,
            ),
            "versions_json": json.dumps(record.versions, sort_keys=True),
            "git_commit": record.git_commit,
            "host": record.host,
        }
        assert set(row) == set(_NAMES) - {"id"}, "append() writes every column of COLUMNS but the id"
        names = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        conn = self._connect()
        try:
            cur = conn.execute(f"INSERT INTO runs ({names}) VALUES ({marks})", tuple(row.values()))
            return int(cur.lastrowid or 0)
        finally:
            conn.close()

    def runs(self, **filters: Any) -> pd.DataFrame:
        """All rows (oldest first) whose columns equal ``filters`` (a list/tuple value means "any of")."""
        import pandas as pd

        unknown = set(filters) - _FILTERABLE
        if unknown:
            raise KeyError(f"cannot filter on {sorted(unknown)}; filterable columns: {', '.join(sorted(_FILTERABLE))}")
        clauses: list[str] = []
        params: list[Any] = []
        for name, value in filters.items():
            if isinstance(value, (list, tuple, set, frozenset)):
                values = list(value)
                clauses.append(f"{name} IN ({', '.join('?' for _ in values)})")
                params.extend(values)
            else:
                clauses.append(f"{name} = ?")
                params.append(value)
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._reading() as conn:
            try:
                return pd.read_sql_query(f"SELECT * FROM runs{where} ORDER BY id", conn, params=params)
            except pd.errors.DatabaseError as err:  # pandas wraps the sqlite3 error it met
                raise self._unreadable(err.__cause__ or err) from None

    def __repr__(self) -> str:
        return f"ResultsDB({str(self.path)!r})"

