"""The profile file: a versioned, self-describing, compact container. Never pickle.

Layout: a ZIP archive (DEFLATE) holding

* ``manifest.json`` — ``{"format": "chunkstar-profile", "version": 3, "writer": ...,
  "meta": {...}, "tables": {table: {"rows": n, "columns": {col: {"kind", "dtype",
  "unit", "member"}}}}}``; it names every member, its dtype and unit, so the
  file can be read without this package (any ZIP + NPY reader will do);
* one ``.npy`` array per column (read with ``allow_pickle=False``). Strings
  are dictionary-encoded: an ``int32`` code array plus the dictionary
  (a JSON list) under ``dictionaries`` in the manifest. Times are ``int64``
  microseconds since the profiler started, stored delta-encoded
  (``"encoding": "delta"``: the running sum gives the values back).

Reading checks everything before building tables: a truncated, corrupt,
foreign, newer-version or hostile file (a member that inflates past what the
manifest declares, an encrypted member, a field of the wrong type) raises
:class:`ProfileFormatError` with a sentence saying which, never a parser's
traceback; see the Note on hostile files below.

Versions (a reader reads its own and every older one; a newer one is refused,
so an old reader never misreads values it does not know):

* 1 — the device and host tiers.
* 2 — the disk tier: ``"disk"`` as a tier (``memory.tier``, ``placements.tier``,
  ``moves.src`` / ``moves.dst``), the move reasons ``"stage_in"`` and
  ``"stage_out"``, and ``meta["disk_stats"]`` (an object of numbers). The
  layout is version 1's, so a version 1 file reads as a version 2 file without
  a disk tier.
* 3 — the table ``activation_moves``: saved activations across the host link
  (``chunkstar.events.ActivationMoved``), a kind of move of their own, not chunk
  moves (``profile.TABLES_SINCE`` names the version that added a table). A
  version 1 or 2 file has no such table and reads as one without activation
  moves; a version 3 file must have it (one without is damaged). An older
  reader refuses a version 3 file rather than show its runs without them.

A meta key that puts no new value into any column needs no new version: a
reader keeps the keys it does not know as they are. So ``meta["predicted"]``
(an object: the predicted s/step, the resource that binds it, ...) marks a
*predicted* profile (:mod:`chunkstar_profiler.predicted`: a dry run's step,
its times the time model's, not measured) in a version 2 (or later) file; a reader that
predates the key shows it as a run whose ``device`` says "predicted on ...".
Readers that know it check that it is an object (``profile.META``) and read
its fields through ``Profile.prediction``.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
import struct
import time
import zipfile
import zlib
from dataclasses import dataclass
from typing import IO, Any, Callable, Mapping

import numpy as np
from numpy.lib import format as npy_format

from chunkstar_profiler._version import __version__
from chunkstar_profiler.profile import META, TABLES, TABLES_SINCE, Profile, build_profile

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "ProfileFormatError", "ProfileNotFoundError", "write_profile", "read_profile"]

FORMAT_NAME = "chunkstar-profile"
FORMAT_VERSION = 3
"""The version written; see the module docstring for what each one added."""
_MANIFEST = "manifest.json"
_DTYPES: dict[str, np.dtype[Any]] = {"i4": np.dtype("<i4"), "i8": np.dtype("<i8"), "time": np.dtype("<i8"), "str": np.dtype("<i4")}
_UNITS = {"time": "us since profiler start", "i8": "", "i4": "", "str": "dictionary code"}


class ProfileFormatError(ValueError):
    """The file is not a readable chunkstar profile; the message says why."""


class ProfileNotFoundError(ProfileFormatError, FileNotFoundError):
    """There is no file at the path given (a ``FileNotFoundError`` too)."""


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def write_profile(path: str | os.PathLike[str], columns: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any]) -> str:
    """Write ``columns`` (as the recorder keeps them) and ``meta``; returns the path written."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)

    manifest: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "writer": f"chunkstar_profiler {__version__}",
        "created_unix": time.time(),
        "meta": dict(meta),
        "tables": {},
        "dictionaries": {},
    }
    members: dict[str, bytes] = {}
    for table, schema in TABLES.items():
        cols = columns[table]
        rows = len(next(iter(cols.values()))) if cols else 0
        tdesc: dict[str, Any] = {"rows": rows, "columns": {}}
        for col, kind in schema.items():
            values = cols[col]
            if len(values) != rows:
                raise ValueError(f"table {table}: column {col} has {len(values)} values, expected {rows}")
            if kind == "str":
                vocab: dict[str, int] = {}
                codes = np.fromiter((vocab.setdefault(str(v), len(vocab)) for v in values), dtype=_DTYPES[kind], count=rows)
                manifest["dictionaries"][f"{table}.{col}"] = list(vocab)
                arr = codes
            else:
                arr = np.asarray(values, dtype=_DTYPES[kind]).reshape(rows)
            encoding = "plain"
            if kind == "time":
                # stored in microseconds (Chrome traces' own unit), delta-encoded: times grow
                # almost monotonically, so the differences are small and DEFLATE squeezes them
                arr = (arr + 500) // 1000
                arr = np.diff(arr, prepend=np.zeros(1, dtype=arr.dtype)) if rows else arr
                encoding = "delta"
            member = f"tables/{table}/{col}.npy"
            members[member] = _npy(arr)
            tdesc["columns"][col] = {
                "kind": kind, "dtype": _DTYPES[kind].str, "unit": _UNITS[kind], "encoding": encoding, "member": member,
            }  # fmt: skip
        manifest["tables"][table] = tdesc
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        zf.writestr(_MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        for name, data in members.items():
            zf.writestr(name, data)
    os.replace(tmp, path)  # never leave a half-written profile under the real name
    return path


def read_profile(source: str | os.PathLike[str] | bytes, name: str | None = None) -> Profile:
    """Load a profile from a path (or from the file's bytes, e.g. an upload; ``name``
    then labels it in messages). Raises :class:`ProfileFormatError` for anything unreadable
    (:class:`ProfileNotFoundError`, also a ``FileNotFoundError``, when there is no file at all)."""
    if isinstance(source, (bytes, bytearray)):
        label = name or "<bytes>"
        data: IO[bytes] = io.BytesIO(bytes(source))
    else:
        label = os.fspath(source)
        data = _open_file(label)
    with data:
        head = data.read(4)
        data.seek(0)
        try:
            zf = zipfile.ZipFile(data)
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, NotImplementedError, struct.error):
            if head.startswith(b"PK"):
                raise ProfileFormatError(f"{label}: the file is truncated or damaged (its ZIP directory cannot be read)") from None
            # never a byte of the file: the viewer's path box reads any file the server can (Note: hostile files)
            raise ProfileFormatError(f"{label}: not a chunkstar profile") from None
        with zf:
            try:
                manifest = _read_manifest(zf)
                columns = _check_columns(zf, manifest)  # every type and size, before any column is read
                tables = _read_columns(zf, columns, manifest["dictionaries"])
            except ProfileFormatError as e:
                raise ProfileFormatError(f"{label}: {e}") from None
            except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as e:
                # CRC mismatches, short or garbled members, bad NPY headers
                raise ProfileFormatError(f"{label}: the file is corrupt ({type(e).__name__}: {e})") from None
    meta = dict(manifest["meta"])
    meta.update(format=FORMAT_NAME, version=manifest["version"], writer=manifest["writer"], created_unix=manifest["created_unix"])
    return build_profile(tables, meta, source=label if not isinstance(source, (bytes, bytearray)) else name)


def _open_file(path: str) -> IO[bytes]:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ProfileNotFoundError(f"{path}: no such file") from None
    except OSError as e:
        raise ProfileFormatError(f"{path}: cannot be read ({e.strerror or e})") from None
    if stat.S_ISDIR(mode):
        raise ProfileFormatError(f"{path}: a directory, not a profile file")
    if not stat.S_ISREG(mode):
        raise ProfileFormatError(f"{path}: not a regular file, so not a profile file")
    try:
        return open(path, "rb")
    except OSError as e:
        raise ProfileFormatError(f"{path}: cannot be read ({e.strerror or e})") from None


# Note: hostile files. A profile may come from anywhere (an upload to the dashboard), so
# nothing in it is trusted before it is checked. Nor is a message allowed to quote a file
# that has not shown itself to be a profile (its first bytes, a foreign manifest's fields):
# the viewer's path box opens any path the server can read (/etc/shadow starts with b'root'),
# and it may be shared with --address 0.0.0.0. The manifest's fields are type-checked, and
# each member's size is checked against what the manifest says it holds (rows x itemsize plus
# an NPY header) before any column is read. The ZIP directory's sizes can lie too, so columns
# are read through the NPY header into an array of the declared shape and reading stops there:
# a member that inflates past it is refused at its first extra byte, never read into memory.

_NPY_HEADER_MAX = 4096
"""Most bytes an NPY member may spend before its data (magic, version, header dict); numpy writes 128 for a 1-D array."""
_NPY_HEADER_MIN = 10
"""Magic, version and header length: the fewest bytes before an NPY member's data."""
_MANIFEST_MAX = 64 * 2**20
"""Largest manifest read (it holds the string dictionaries; a long run's is a few hundred KB)."""
_READ_CHUNK = 16 * 2**20
"""Bytes inflated per read while filling a column."""
_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "DEFLATE"}
"""ZIP compression methods read (the writer uses DEFLATE)."""
_JSON_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), "a finite number"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "list[str]": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "dict[number]": (
        lambda v: isinstance(v, dict) and all(_JSON_CHECKS["number"][0](x) for x in v.values()), "an object of finite numbers"
    ),
}


@dataclass(frozen=True)
class _Column:
    """One column as the manifest describes it, checked against its ZIP member."""

    table: str
    name: str
    kind: str
    encoding: str
    rows: int
    member: zipfile.ZipInfo

    @property
    def dtype(self) -> np.dtype[Any]:
        return _DTYPES[self.kind]


def _json_type(value: Any, kind: str, what: str) -> Any:
    check, wanted = _JSON_CHECKS[kind]
    if not check(value):
        raise ProfileFormatError(f"the manifest's {what} is {type(value).__name__} {_short(value)}, expected {wanted}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _member(zf: zipfile.ZipFile, name: str, what: str, max_bytes: int, why: str) -> zipfile.ZipInfo:
    """The ZIP entry ``name`` (``what`` says what it is for), refused when it cannot be read safely
    or says it inflates past ``max_bytes`` (``why`` says where that bound comes from)."""
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise ProfileFormatError(f"the file is corrupt: it has no member {name!r} ({what})") from None
    if info.is_dir():
        raise ProfileFormatError(f"member {name!r} ({what}) is a directory entry, not a file")
    if info.flag_bits & 0x1:
        raise ProfileFormatError(f"member {name!r} ({what}) is encrypted; profiles are never encrypted")
    if info.compress_type not in _METHODS:
        raise ProfileFormatError(
            f"member {name!r} ({what}) uses ZIP compression method {info.compress_type}; "
            f"profiles use {' or '.join(_METHODS.values())}"
        )
    if info.file_size > max_bytes:
        raise ProfileFormatError(f"member {name!r} ({what}) inflates to {info.file_size:,} bytes, but {why}")
    return info


def _read_bounded(zf: zipfile.ZipFile, info: zipfile.ZipInfo, max_bytes: int) -> bytes:
    """The member's bytes, refused once more than ``max_bytes`` come out (whatever the ZIP directory says)."""
    with zf.open(info) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ProfileFormatError(f"member {info.filename!r} inflates to more than {max_bytes:,} bytes")
    return data


def _read_manifest(zf: zipfile.ZipFile) -> dict[str, Any]:
    """The manifest with its top-level fields checked (``meta`` and ``dictionaries`` defaulted to ``{}``)."""
    if _MANIFEST not in zf.namelist():
        raise ProfileFormatError(f"a ZIP file, but not a chunkstar profile (it has no {_MANIFEST})")
    info = _member(zf, _MANIFEST, "the manifest", _MANIFEST_MAX, f"a manifest may take at most {_MANIFEST_MAX:,}")
    try:
        raw = _read_bounded(zf, info, _MANIFEST_MAX)
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as e:
        raise ProfileFormatError(f"the manifest is corrupt ({e})") from None
    try:
        manifest = json.loads(raw)
    except json.JSONDecodeError as e:  # its message gives a position, never the text there
        raise ProfileFormatError(f"the manifest is not valid JSON ({e})") from None
    except UnicodeDecodeError:  # its message would quote the bytes it met
        raise ProfileFormatError("the manifest is not valid JSON (not UTF-8 text)") from None
    except RecursionError:
        raise ProfileFormatError("the manifest is not valid JSON (nested too deeply)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ProfileFormatError(f"a ZIP file, but not a chunkstar profile (its manifest does not say format {FORMAT_NAME!r})")
    version = manifest.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ProfileFormatError(f"the manifest has no valid format version ({_short(version)})")
    writer = manifest.get("writer")
    if version > FORMAT_VERSION:
        raise ProfileFormatError(
            f"written by a newer chunkstar_profiler ({writer if isinstance(writer, str) else '?'}, format version "
            f"{version}); this reader understands versions up to {FORMAT_VERSION}: upgrade chunkstar"
        )
    out: dict[str, Any] = {"version": version, "writer": None, "created_unix": None, "meta": {}, "dictionaries": {}}
    for key, kind in (("writer", "str"), ("created_unix", "number"), ("meta", "dict"), ("dictionaries", "dict")):
        if key in manifest:
            out[key] = _json_type(manifest[key], kind, f"'{key}'")
    for key, kind in META.items():
        if key in out["meta"]:
            _json_type(out["meta"][key], kind, f"meta '{key}'")
    out["tables"] = _json_type(manifest.get("tables"), "dict", "'tables'")
    return out


def _check_columns(zf: zipfile.ZipFile, manifest: Mapping[str, Any]) -> list[_Column]:
    """Every column the reader needs, its description type-checked and its member's size checked."""
    columns: list[_Column] = []
    for table, schema in TABLES.items():
        if manifest["version"] < TABLES_SINCE.get(table, 1):
            continue  # written before the table existed: it reads empty (a member of that name is not ours to read)
        if table not in manifest["tables"]:
            raise ProfileFormatError(f"table '{table}' is missing")
        tdesc = _json_type(manifest["tables"][table], "dict", f"table '{table}'")
        rows = _json_type(tdesc.get("rows"), "int", f"'{table}.rows'")
        if rows < 0:
            raise ProfileFormatError(f"the manifest's '{table}.rows' is {rows}, expected a count")
        cdescs = _json_type(tdesc.get("columns"), "dict", f"'{table}.columns'")
        for col, kind in schema.items():
            if col not in cdescs:
                raise ProfileFormatError(f"column '{table}.{col}' is missing")
            what = f"column '{table}.{col}'"
            cdesc = _json_type(cdescs[col], "dict", what)
            for key, want in (("kind", kind), ("dtype", _DTYPES[kind].str)):
                if key in cdesc and cdesc[key] != want:
                    raise ProfileFormatError(f"{what} has {key} {_short(cdesc[key])}, expected {want!r}")
            encoding = _json_type(cdesc.get("encoding", "plain"), "str", f"{what} encoding")
            if encoding not in ("plain", "delta"):
                raise ProfileFormatError(f"{what} has an unknown encoding {encoding!r}")
            if kind == "str":
                _json_type(manifest["dictionaries"].get(f"{table}.{col}"), "list[str]", f"dictionary of '{table}.{col}'")
            name = _json_type(cdesc.get("member"), "str", f"{what} member")
            data_bytes = rows * _DTYPES[kind].itemsize
            limit = data_bytes + _NPY_HEADER_MAX
            why = f"the manifest's {rows:,} rows of {_DTYPES[kind].str} need at most {limit:,} (with the NPY header)"
            info = _member(zf, name, what, limit, why)
            if info.file_size < data_bytes + _NPY_HEADER_MIN:
                raise ProfileFormatError(
                    f"the file is corrupt: member {name!r} ({what}) holds {info.file_size:,} bytes, "
                    f"too few for the manifest's {rows:,} rows"
                )
            columns.append(_Column(table, col, kind, encoding, rows, info))
    return columns


def _read_npy(zf: zipfile.ZipFile, col: _Column) -> np.ndarray:
    """The column's array: the NPY header checked first, then exactly ``rows`` values read into place."""
    what = f"member {col.member.filename!r} (column '{col.table}.{col.name}')"
    with zf.open(col.member) as f:
        version = npy_format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = npy_format.read_array_header_1_0(f, max_header_size=_NPY_HEADER_MAX)
        elif version == (2, 0):
            shape, _, dtype = npy_format.read_array_header_2_0(f, max_header_size=_NPY_HEADER_MAX)
        else:
            raise ProfileFormatError(f"{what} is NPY version {version[0]}.{version[1]}; profiles use 1.0 or 2.0")
        if shape != (col.rows,) or dtype != col.dtype:
            raise ProfileFormatError(
                f"column '{col.table}.{col.name}' has shape {shape} and dtype {dtype}, expected ({col.rows},) {col.dtype}"
            )
        arr = np.empty(col.rows, dtype=col.dtype)
        buf = arr.data.cast("B")
        done = 0
        while done < len(buf):
            chunk = f.read(min(_READ_CHUNK, len(buf) - done))
            if not chunk:
                raise ProfileFormatError(f"{what} ends after {done:,} of its {len(buf):,} data bytes")
            buf[done : done + len(chunk)] = chunk
            done += len(chunk)
        if f.read(1):
            raise ProfileFormatError(f"{what} holds more data than the manifest's {col.rows:,} rows")
    return arr


def _read_columns(zf: zipfile.ZipFile, columns: list[_Column], dictionaries: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {table: {} for table in TABLES}
    for col in columns:
        arr = _read_npy(zf, col)
        if col.encoding == "delta":
            arr = np.cumsum(arr, dtype=arr.dtype)
        if col.kind == "time":
            arr = arr * 1000  # microseconds on disk, nanoseconds in the tables
        if col.kind == "str":
            vocab = dictionaries[f"{col.table}.{col.name}"]
            if col.rows and (arr.min() < 0 or arr.max() >= len(vocab)):
                raise ProfileFormatError(f"column '{col.table}.{col.name}' has codes outside its dictionary")
            out[col.table][col.name] = np.asarray(vocab, dtype=object)[arr] if col.rows else np.asarray([], dtype=object)
        else:
            out[col.table][col.name] = arr
    return out
