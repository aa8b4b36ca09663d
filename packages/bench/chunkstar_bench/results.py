"""Benchmark results in SQLite: one row per run, appended, never rewritten.

A results file is a plain SQLite database (stdlib ``sqlite3``) with one table,
``runs``, whose layout is versioned with ``PRAGMA user_version``. Opening a
file written by a newer chunkstar-bench is refused with a sentence saying so
(an older reader would silently drop columns it does not know). Every write is
its own short transaction, so several processes (a suite and a max-scale search,
say) can append to one file; SQLite's file locking serialises them.

Opening checks the file before anything uses it (see Note [Checking a results
file when it is opened]): ``ResultsDB(path)`` for writing, and
``ResultsDB(path, read_only=True)`` for readers that must not change anything
(``chunkstar-bench report``, the dashboard: SQLite's ``mode=ro``, so no file,
journal or table is ever created). A file that cannot serve raises
:class:`ResultsFileError` with one sentence naming the path; a row whose values
are not of its column's type makes :meth:`ResultsDB.runs` raise
:class:`BadRowsError`, which names the rows and carries the others.

This module stores and queries; it does not run anything or format tables.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import stat
import tempfile
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

    from chunkstar_bench.runner import RunRecord

__all__ = [
    "COLUMNS", "JSON_COLUMNS", "READ_TIMEOUT_S", "SCHEMA_VERSION", "STATUSES", "WRITE_TIMEOUT_S", "BadRow", "BadRowsError",
    "ResultsDB", "ResultsFileError", "SchemaVersionError", "record_row", "runs_frame", "set_aside",
]  # fmt: skip

SCHEMA_VERSION = 1
"""Layout version of the ``runs`` table written by this code (``PRAGMA user_version``)."""

STATUSES = ("ok", "oom", "error")
"""The values of the ``status`` column (``chunkstar_bench.runner.Status``)."""

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
    ("status", f"TEXT NOT NULL CHECK (status IN ({', '.join(repr(s) for s in STATUSES)}))"),
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

JSON_COLUMNS = ("config_json", "versions_json")
"""Text columns holding a JSON object."""

_NAMES = tuple(name for name, _ in COLUMNS)
_NUMERIC = tuple(name for name, decl in COLUMNS if decl.startswith(("INTEGER", "REAL")))
_NULLABLE = frozenset(name for name, decl in COLUMNS if "NOT NULL" not in decl and "PRIMARY KEY" not in decl)
_FILTERABLE = frozenset(_NAMES) - set(JSON_COLUMNS)

READ_TIMEOUT_S = 2.0
"""How long a reader, and the check of a file opened for writing, wait for another process's lock before giving up."""
WRITE_TIMEOUT_S = 60.0
"""How long an append waits for another process's lock (appends are short; a suite must not lose a row)."""


class ResultsFileError(RuntimeError):
    """The file is not a usable results database (missing, a directory, not SQLite, damaged, locked, read-only,
    foreign); the message, one sentence naming the file, says which."""


class SchemaVersionError(ResultsFileError):
    """The database was written by a newer (or unknown) layout than this code reads."""


@dataclass(frozen=True)
class BadRow:
    """A value of a row that is not of its column's type (a file edited by hand, or by another program)."""

    row_id: int
    """The row's ``id`` (its SQLite rowid)."""
    column: str
    problem: str
    """What is wrong with the value, without the value ("holds text, not a number")."""


class BadRowsError(ResultsFileError):
    """Some rows of the file cannot be read; :attr:`bad` names them, :attr:`good` holds every other row.

    A caller that can do with the good rows (a report, the dashboard) says which were left out and goes
    on; one that cannot treats the file as unusable (it is a :class:`ResultsFileError`).
    """

    def __init__(self, path: Path, bad: list[BadRow], good: pd.DataFrame) -> None:
        rows = sorted({b.row_id for b in bad})
        shown = ", ".join(f"row id {b.row_id} ({b.column} {b.problem})" for b in bad[:5])
        more = f", and {len(bad) - 5} more" if len(bad) > 5 else ""
        super().__init__(f"{path}: {len(rows)} row{'s' if len(rows) != 1 else ''} cannot be read: {shown}{more}")
        self.bad = tuple(bad)
        self.good = good


# Note [Checking a results file when it is opened]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A suite trains for minutes to hours before its first append, so everything an append
# needs is checked when the file is opened, not when the first row is written:
#
# * the path, with stat() and before SQLite opens it: a directory, a FIFO or a device is
#   refused at once (SQLite would block forever reading a FIFO);
# * the layout: SQLite's own header check ("not a database", "malformed" for a truncated
#   file), the schema version, and the ``runs`` table's columns -- a foreign ``runs`` table
#   under our version number used to fail only at the first INSERT; a writer also runs
#   ``PRAGMA quick_check`` (a file damaged in the middle; milliseconds for a results file);
# * for a writer, that it can write: the whole check runs inside ``BEGIN IMMEDIATE`` (the
#   write lock, so two processes creating one file cannot both create the table), and an
#   existing file gets a write that changes nothing (``PRAGMA user_version`` set to itself,
#   rolled back), which needs both a writable file and a writable folder for the journal:
#   a read-only file, folder or mount is refused now, whoever the user is (root's access()
#   says yes to a file of mode 444, but a read-only mount refuses root too);
# * a lock held by another process: the check waits READ_TIMEOUT_S (short, a person is
#   waiting), then says the file is locked; appends later wait WRITE_TIMEOUT_S.
#
# Rows are checked when they are read (runs()): SQLite stores any value in any column, so
# a row edited by hand can hold text where a number belongs; such rows are named in a
# BadRowsError, which carries the good rows for a caller that can go on without them.


class ResultsDB:
    """A results database at ``path``: created with the current schema when new, unless ``read_only``.

    Opening checks the file (Note [Checking a results file when it is opened]): a file
    that cannot be read -- or, unless ``read_only``, written -- as a results database raises
    :class:`ResultsFileError`.
    """

    def __init__(self, path: str | Path, *, read_only: bool = False) -> None:
        self.path = Path(path)
        self.read_only = read_only
        if not self._check_path():
            if read_only:
                raise ResultsFileError(f"{self.path}: no such file")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ResultsFileError(f"{self.path}: cannot create its folder ({err.strerror or err})") from None
        with self._using(READ_TIMEOUT_S) as conn:
            if read_only:
                self._check_layout(conn)
            else:
                self._prepare(conn)

    def _check_path(self) -> bool:
        """Whether a regular file is at the path (False: nothing is); refuses anything else before SQLite opens it."""
        try:
            mode = self.path.stat().st_mode
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            raise ResultsFileError(f"{self.path}: a part of the path is a file, not a folder") from None
        except OSError as err:
            raise ResultsFileError(f"{self.path}: cannot be read ({err.strerror or err})") from None
        if stat.S_ISDIR(mode):
            raise ResultsFileError(f"{self.path}: a directory, not a results database")
        if not stat.S_ISREG(mode):
            raise ResultsFileError(f"{self.path}: not a regular file, so not a results database")
        return True

    def _connect(self, timeout_s: float) -> sqlite3.Connection:
        if self.read_only:
            # mode=ro: SQLite neither creates the file nor writes to it
            uri = f"file:{urllib.parse.quote(str(self.path.resolve()))}?mode=ro"
            conn = sqlite3.connect(uri, uri=True, timeout=timeout_s, isolation_level=None)
        else:
            conn = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None)
        # timeout: wait (not fail) while another process holds the lock
        conn.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
        return conn

    @contextlib.contextmanager
    def _using(self, timeout_s: float) -> Iterator[sqlite3.Connection]:
        """A connection whose SQLite errors become :class:`ResultsFileError` sentences naming the file."""
        conn: sqlite3.Connection | None = None
        try:
            conn = self._connect(timeout_s)
            yield conn
        except sqlite3.IntegrityError:
            raise  # a record this code built breaks a constraint: a bug here, not a fault of the file
        except sqlite3.Error as err:
            raise self._file_error(err, timeout_s) from None
        finally:
            if conn is not None:
                with contextlib.suppress(sqlite3.Error):  # the error already raised is the one to report
                    if conn.in_transaction:
                        conn.rollback()
                conn.close()

    def _file_error(self, err: BaseException, waited_s: float) -> ResultsFileError:
        """One sentence for an SQLite error (its text is SQLite's own, the same on every version)."""
        text = str(err)
        if "locked" in text or "busy" in text:
            return ResultsFileError(
                f"{self.path}: the database is locked by another process (waited {waited_s:g} s); try again when it is done"
            )
        if "not a database" in text:
            return ResultsFileError(f"{self.path}: not an SQLite database")
        if "malformed" in text or "corrupt" in text:
            return ResultsFileError(f"{self.path}: the database is damaged (truncated or corrupt); restore it or give a new file")
        if "readonly" in text or "read-only" in text:
            return ResultsFileError(
                f"{self.path}: cannot be written (a read-only file, folder or filesystem); give a writable path"
            )
        if "disk is full" in text:
            return ResultsFileError(f"{self.path}: cannot be written, the disk is full")
        if "unable to open" in text and not self.read_only:
            return ResultsFileError(f"{self.path}: cannot be opened for writing; check that its folder is writable")
        return ResultsFileError(f"{self.path}: cannot be used as an SQLite database ({text})")

    def _check_layout(self, conn: sqlite3.Connection) -> int:
        """This code's ``runs`` table, no newer layout; the schema version."""
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{self.path} has results schema version {version}, newer than the {SCHEMA_VERSION} this "
                "chunkstar-bench reads; upgrade chunkstar-bench (or use a new file)"
            )
        have = [row[1] for row in conn.execute("PRAGMA table_info(runs)")]
        if not have:
            raise ResultsFileError(f"{self.path}: an SQLite file, but not a chunkstar-bench results database (it has no 'runs' table)")
        missing = [name for name in _NAMES if name not in have]
        if missing:
            raise ResultsFileError(
                f"{self.path}: not a chunkstar-bench results database (its 'runs' table lacks the columns {', '.join(missing)})"
            )
        return version

    def _prepare(self, conn: sqlite3.Connection) -> None:
        """For a writer: create the table in a new file, or check an existing one and that it can be written."""
        conn.execute("BEGIN IMMEDIATE")
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        if version == 0:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")} - {"sqlite_sequence"}
            if tables:
                raise SchemaVersionError(
                    f"{self.path}: an SQLite file with tables of its own but no chunkstar-bench schema version; "
                    "refusing to write into it (give a new file)"
                )
            cols = ",\n  ".join(f"{name} {decl}" for name, decl in COLUMNS)
            conn.execute(f"CREATE TABLE runs (\n  {cols}\n)")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
            return
        self._check_layout(conn)
        if conn.execute("PRAGMA quick_check(1)").fetchone()[0] != "ok":
            raise ResultsFileError(f"{self.path}: the database is damaged (truncated or corrupt); restore it or give a new file")
        conn.execute(f"PRAGMA user_version = {version}")  # changes nothing; fails where the file or its journal cannot be written
        conn.execute("ROLLBACK")

    def append(self, record: RunRecord, *, suite: str) -> int:
        """Store one run's record under ``suite``; the new row's id. :class:`ResultsFileError` when the file
        cannot take it now (locked past :data:`WRITE_TIMEOUT_S`, the disk full, the file replaced)."""
        if self.read_only:
            raise ValueError(f"{self.path} was opened read-only; cannot append to it")
        row = record_row(record, suite=suite)
        names = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self._using(WRITE_TIMEOUT_S) as conn:
            cur = conn.execute(f"INSERT INTO runs ({names}) VALUES ({marks})", tuple(row.values()))
            return int(cur.lastrowid or 0)

    def runs(self, **filters: Any) -> pd.DataFrame:
        """All rows (oldest first) whose columns equal ``filters`` (a list/tuple value means "any of").

        :class:`BadRowsError` when a row holds a value not of its column's type; it carries the other rows.
        """
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
        columns = ", ".join(_NAMES)  # in COLUMNS' order, whatever order a file's table has them in
        with self._using(READ_TIMEOUT_S) as conn:
            try:
                df = pd.read_sql_query(f"SELECT rowid AS _rowid, {columns} FROM runs{where} ORDER BY id", conn, params=params)
            except pd.errors.DatabaseError as err:  # pandas wraps the sqlite3 error it met
                raise self._file_error(err.__cause__ or err, READ_TIMEOUT_S) from None
        bad = _bad_rows(df)
        bad_ids = {b.row_id for b in bad}
        good = _normalised(df[~df["_rowid"].isin(bad_ids)].drop(columns="_rowid").reset_index(drop=True))
        if bad:
            raise BadRowsError(self.path, bad, good)
        return good

    def __repr__(self) -> str:
        return f"ResultsDB({str(self.path)!r})"


def record_row(record: RunRecord, *, suite: str) -> dict[str, Any]:
    """The row :meth:`ResultsDB.append` writes for ``record``: every column of :data:`COLUMNS` but the id."""
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
    }  # fmt: skip
    assert set(row) == set(_NAMES) - {"id"}, "record_row() fills every column of COLUMNS but the id"
    return row


def set_aside(db_path: str | Path, row: Mapping[str, Any]) -> Path | None:
    """Keep a row that could not be appended to ``db_path``: one JSON line added to ``DB.unsaved.jsonl``
    beside it, or in the temporary folder when that folder cannot be written; the file written (None: neither
    could be)."""
    name = f"{Path(db_path).name}.unsaved.jsonl"
    line = json.dumps(dict(row), sort_keys=True, default=str) + "\n"
    for where in (Path(db_path).parent / name, Path(tempfile.gettempdir()) / name):
        try:
            with open(where, "a", encoding="utf-8") as f:
                f.write(line)
            return where
        except OSError:
            continue
    return None


def runs_frame(rows: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """``rows`` (dicts of the columns of :data:`COLUMNS`, those missing empty) as :meth:`ResultsDB.runs` returns them."""
    import pandas as pd

    return _normalised(pd.DataFrame.from_records(list(rows), columns=list(_NAMES)))


def _normalised(df: pd.DataFrame) -> pd.DataFrame:
    """Numeric columns as numbers (an all-empty one as NaN, not ``None`` objects), whatever the rows' history."""
    import pandas as pd

    for name in _NUMERIC:
        if df[name].dtype == object:
            df[name] = pd.to_numeric(df[name])
    return df


def _problem(name: str, value: Any) -> str | None:
    """What is wrong with ``value`` in column ``name`` (None: nothing); never the value itself."""
    if value is None or (isinstance(value, float) and value != value):  # NULL, or NaN in a numeric frame
        return None if name in _NULLABLE else "is empty"
    if isinstance(value, bytes):
        return f"holds binary data, not {'a number' if name in _NUMERIC else 'text'}"
    if name in _NUMERIC:
        return None if isinstance(value, (int, float)) else "holds text, not a number"
    if not isinstance(value, str):
        return "holds a number, not text"
    if name == "status" and value not in STATUSES:
        return f"is not one of {', '.join(STATUSES)}"
    if name in JSON_COLUMNS:
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            return "is not a JSON object"
    return None


def _bad_rows(df: pd.DataFrame) -> list[BadRow]:
    """Every value of ``df`` (a ``SELECT rowid AS _rowid, ...`` frame) not of its column's type, by row then column."""
    bad: list[BadRow] = []
    for name in _NAMES:
        col = df[name]
        if col.dtype.kind in "iuf":  # numbers throughout: only an empty value can be wrong
            if name in _NULLABLE or not col.isna().any():
                continue
        for rowid, value in zip(df["_rowid"], col):
            problem = _problem(name, value)
            if problem is not None:
                bad.append(BadRow(int(rowid), name, problem))
    return sorted(bad, key=lambda b: (b.row_id, _NAMES.index(b.column)))
