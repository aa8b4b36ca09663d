"""The profile file: a versioned, self-describing, compact container. Never pickle.

Layout: a ZIP archive (DEFLATE) holding

* ``manifest.json`` — ``{"format": "chunkstar-profile", "version": 1, "writer": ...,
  "meta": {...}, "tables": {table: {"rows": n, "columns": {col: {"kind", "dtype",
  "unit", "member"}}}}}``; it names every member, its dtype and unit, so the
  file can be read without this package (any ZIP + NPY reader will do);
* one ``.npy`` array per column (read with ``allow_pickle=False``). Strings
  are dictionary-encoded: an ``int32`` code array plus the dictionary
  (a JSON list) under ``dictionaries`` in the manifest. Times are ``int64``
  microseconds since the profiler started, stored delta-encoded
  (``"encoding": "delta"``: the running sum gives the values back).

Reading checks everything before building tables: a truncated, corrupt,
foreign or newer-version file raises :class:`ProfileFormatError` with a
sentence saying which, never a parser's traceback.
"""

from __future__ import annotations

import io
import json
import os
import time
import zipfile
import zlib
from typing import Any, Mapping

import numpy as np

from chunkstar_profiler.profile import TABLES, Profile, build_profile

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "ProfileFormatError", "write_profile", "read_profile"]

FORMAT_NAME = "chunkstar-profile"
FORMAT_VERSION = 1
_MANIFEST = "manifest.json"
_DTYPES: dict[str, np.dtype[Any]] = {"i4": np.dtype("<i4"), "i8": np.dtype("<i8"), "time": np.dtype("<i8"), "str": np.dtype("<i4")}
_UNITS = {"time": "us since profiler start", "i8": "", "i4": "", "str": "dictionary code"}


class ProfileFormatError(ValueError):
    """The file is not a readable chunkstar profile; the message says why."""


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def write_profile(path: str | os.PathLike[str], columns: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any]) -> str:
    """Write ``columns`` (as the recorder keeps them) and ``meta``; returns the path written."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    from chunkstar_profiler import __version__

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
    then labels it in messages). Raises :class:`ProfileFormatError` for anything unreadable."""
    if isinstance(source, (bytes, bytearray)):
        path = name or "<bytes>"
        data: str | io.BytesIO = io.BytesIO(bytes(source))
        head = bytes(source[:4])
    else:
        path = os.fspath(source)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no profile at {path!r}")
        data = path
        with open(path, "rb") as f:
            head = f.read(4)
    try:
        zf = zipfile.ZipFile(data)
    except zipfile.BadZipFile:
        if head.startswith(b"PK"):
            raise ProfileFormatError(f"{path}: the file is truncated or damaged (its ZIP directory cannot be read)") from None
        raise ProfileFormatError(
            f"{path}: not a chunkstar profile (expected a {FORMAT_NAME} ZIP container, the file starts with {head!r})"
        ) from None
    with zf:
        try:
            raw = zf.read(_MANIFEST)
        except KeyError:
            raise ProfileFormatError(f"{path}: a ZIP file, but not a chunkstar profile (it has no {_MANIFEST})") from None
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as e:
            raise ProfileFormatError(f"{path}: the manifest is corrupt ({e})") from None
        try:
            manifest = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ProfileFormatError(f"{path}: the manifest is not valid JSON ({e})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
            fmt = manifest.get("format") if isinstance(manifest, dict) else None
            raise ProfileFormatError(f"{path}: not a chunkstar profile (format {fmt!r}, expected {FORMAT_NAME!r})")
        version = manifest.get("version")
        if not isinstance(version, int) or version < 1:
            raise ProfileFormatError(f"{path}: the manifest has no valid format version ({version!r})")
        if version > FORMAT_VERSION:
            raise ProfileFormatError(
                f"{path}: written by a newer chunkstar_profiler ({manifest.get('writer', '?')}, format version "
                f"{version}); this reader understands versions up to {FORMAT_VERSION}: upgrade chunkstar"
            )
        try:
            columns = _read_columns(zf, manifest)
        except ProfileFormatError as e:
            raise ProfileFormatError(f"{path}: {e}") from None
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, KeyError, TypeError) as e:
            # CRC mismatches, short members, bad NPY headers, a manifest of the wrong shape
            raise ProfileFormatError(f"{path}: the file is corrupt ({type(e).__name__}: {e})") from None
    meta = dict(manifest.get("meta") or {})
    meta.update(format=FORMAT_NAME, version=version, writer=manifest.get("writer"), created_unix=manifest.get("created_unix"))
    return build_profile(columns, meta, source=path if not isinstance(source, (bytes, bytearray)) else name)


def _read_columns(zf: zipfile.ZipFile, manifest: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    tables = manifest["tables"]
    dictionaries = manifest.get("dictionaries", {})
    out: dict[str, dict[str, Any]] = {}
    for table, schema in TABLES.items():
        if table not in tables:
            raise ProfileFormatError(f"table '{table}' is missing")
        tdesc = tables[table]
        rows = int(tdesc["rows"])
        cols: dict[str, Any] = {}
        for col, kind in schema.items():
            cdesc = tdesc["columns"].get(col)
            if cdesc is None:
                raise ProfileFormatError(f"column '{table}.{col}' is missing")
            arr = np.load(io.BytesIO(zf.read(cdesc["member"])), allow_pickle=False)
            if arr.shape != (rows,) or arr.dtype != _DTYPES[kind]:
                raise ProfileFormatError(
                    f"column '{table}.{col}' has shape {arr.shape} and dtype {arr.dtype}, expected ({rows},) {_DTYPES[kind]}"
                )
            if cdesc.get("encoding", "plain") == "delta":
                arr = np.cumsum(arr, dtype=arr.dtype)
            if kind == "time":
                arr = arr * 1000  # microseconds on disk, nanoseconds in the tables
            elif cdesc.get("encoding", "plain") != "plain":
                raise ProfileFormatError(f"column '{table}.{col}' has an unknown encoding {cdesc.get('encoding')!r}")
            if kind == "str":
                vocab = dictionaries.get(f"{table}.{col}")
                if not isinstance(vocab, list):
                    raise ProfileFormatError(f"the dictionary of '{table}.{col}' is missing")
                if rows and (arr.min() < 0 or arr.max() >= len(vocab)):
                    raise ProfileFormatError(f"column '{table}.{col}' has codes outside its dictionary")
                cols[col] = np.asarray(vocab, dtype=object)[arr] if rows else np.asarray([], dtype=object)
            else:
                cols[col] = arr
        out[table] = cols
    return out
