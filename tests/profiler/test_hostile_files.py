"""Hostile profile files: zip bombs, ZIP sizes that lie, encrypted members, fields of the wrong type.

The profiles here are written by ``write_profile`` from hand-made columns (no
engine, no torch: ``_hostile.small_profile``), then taken apart and rebuilt
around one bad member or field.
"""

from __future__ import annotations

import io
import json
import re
import tracemalloc
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import chunkstar_profiler
from chunkstar_profiler import ProfileFormatError
from chunkstar_profiler.fileformat import _MANIFEST_MAX, FORMAT_VERSION
from tests.profiler._hostile import FLAGS, METHOD, UNCOMPRESSED_SIZE, members, patch_header, rebuild, small_profile, with_manifest, zeros

ROWS = 3
MEMBER = "tables/moves/nbytes.npy"
MIB = 2**20
BOMB_BYTES = 200 * MIB


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return small_profile(tmp_path / "good.csprof", rows=ROWS)


def _load_traced(path: Path) -> tuple[BaseException | None, int]:
    """Load ``path``; the error raised (if any) and the peak of Python-allocated memory while loading."""
    tracemalloc.start()
    try:
        chunkstar_profiler.load(str(path))
        error: BaseException | None = None
    except Exception as err:  # noqa: BLE001
        error = err
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return error, peak


def test_files_written_today_still_load(good: Path) -> None:
    p = chunkstar_profiler.load(str(good))
    assert len(p.moves) == ROWS and p.meta["model_name"] == "tiny" and p.meta["version"] == FORMAT_VERSION
    assert list(p.moves["chunk_id"]) == [0, 1, 0] and list(p.moments["t_start_s"]) == [0.0, 0.001, 0.002]
    assert list(p.memory["tier"]) == ["device", "host", "device"]
    assert chunkstar_profiler.load(good.read_bytes(), name="up.csprof").meta["n_params"] == 2048


def test_zip_bomb_member_is_refused_before_it_is_read(good: Path, tmp_path: Path) -> None:
    """A member of a few hundred KB that inflates to 200 MB, declared as a 3-row column: refused unread."""
    bomb = rebuild(good, tmp_path / "bomb.csprof", {MEMBER: zeros(BOMB_BYTES)})
    assert bomb.stat().st_size < 2 * MIB
    error, peak = _load_traced(bomb)
    assert isinstance(error, ProfileFormatError), error
    assert f"{bomb}: member '{MEMBER}' (column 'moves.nbytes') inflates to {BOMB_BYTES:,} bytes" in str(error)
    assert "3 rows of <i8" in str(error)
    assert peak < 16 * MIB


def test_zip_bomb_that_lies_about_its_size_is_not_read_past_the_manifest(good: Path, tmp_path: Path) -> None:
    """The ZIP directory says the member is small; its stream inflates to 200 MB. Reading stops early."""
    header = members(good)[MEMBER][:128]  # the real member's NPY header: 3 rows of <i8
    bomb = rebuild(good, tmp_path / "liar.csprof", {MEMBER: zeros(BOMB_BYTES, prefix=header)})
    patch_header(bomb, MEMBER, UNCOMPRESSED_SIZE, 128 + ROWS * 8)
    with zipfile.ZipFile(bomb) as zf:
        assert zf.getinfo(MEMBER).file_size == 128 + ROWS * 8
    error, peak = _load_traced(bomb)
    assert isinstance(error, ProfileFormatError), error
    assert str(bomb) in str(error) and "corrupt" in str(error)
    assert peak < 16 * MIB


def test_manifest_bomb_is_refused(good: Path, tmp_path: Path) -> None:
    bomb = rebuild(good, tmp_path / "manifest_bomb.csprof", {"manifest.json": zeros(_MANIFEST_MAX + MIB)})
    error, peak = _load_traced(bomb)
    assert isinstance(error, ProfileFormatError) and "member 'manifest.json' (the manifest) inflates to" in str(error)
    assert peak < 16 * MIB


def test_a_member_longer_than_its_rows_is_refused(good: Path, tmp_path: Path) -> None:
    """Within the header slack, but more data than 3 rows: the reader stops at the declared rows and says so."""
    extra = rebuild(good, tmp_path / "extra.csprof", {MEMBER: members(good)[MEMBER] + bytes(64)})
    with pytest.raises(ProfileFormatError, match=r"holds more data than the manifest's 3 rows"):
        chunkstar_profiler.load(str(extra))


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        (FLAGS, 0x1, f"member '{MEMBER}' (column 'moves.nbytes') is encrypted"),
        (METHOD, 99, f"member '{MEMBER}' (column 'moves.nbytes') uses ZIP compression method 99"),
    ],
    ids=["encrypted", "method 99"],
)
def test_unreadable_zip_members(good: Path, tmp_path: Path, field: tuple[int, int, str], value: int, expected: str) -> None:
    bad = rebuild(good, tmp_path / "bad.csprof", {})
    patch_header(bad, MEMBER, field, value)
    with pytest.raises(ProfileFormatError, match=re.escape(expected)) as info:
        chunkstar_profiler.load(str(bad))
    assert str(info.value).startswith(f"{bad}: ")


def test_encrypted_manifest(good: Path, tmp_path: Path) -> None:
    bad = rebuild(good, tmp_path / "enc.csprof", {})
    patch_header(bad, "manifest.json", FLAGS, 0x1)
    with pytest.raises(ProfileFormatError, match="'manifest.json' \\(the manifest\\) is encrypted"):
        chunkstar_profiler.load(bad.read_bytes(), name="upload.csprof")


WRONG_TYPES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "meta as a list": (lambda m: m.update(meta=["a"]), "the manifest's 'meta' is list \\['a'\\], expected an object"),
    "meta null": (lambda m: m.update(meta=None), "'meta' is NoneType None, expected an object"),
    "meta key of the wrong type": (lambda m: m["meta"].update(n_params="lots"), "meta 'n_params' is str 'lots', expected an integer"),
    "chunk_lists not strings": (lambda m: m["meta"].update(chunk_lists=[1]), "meta 'chunk_lists' is list \\[1\\], expected a list of strings"),
    "disk_stats a list": (lambda m: m["meta"].update(disk_stats=[1]), "meta 'disk_stats' is list \\[1\\], expected an object of finite numbers"),
    "disk_stats not numbers": (
        lambda m: m["meta"].update(disk_stats={"disk_bytes_read": "lots"}), "meta 'disk_stats' is dict .*expected an object of finite numbers"
    ),
    "disk_stats a bool": (lambda m: m["meta"].update(disk_stats={"disk_direct_io": True}), "expected an object of finite numbers"),
    "predicted not an object": (lambda m: m["meta"].update(predicted="yes"), "meta 'predicted' is str 'yes', expected an object"),
    "version a bool": (lambda m: m.update(version=True), "no valid format version \\(True\\)"),
    "writer a number": (lambda m: m.update(writer=3), "'writer' is int 3, expected a string"),
    "tables a list": (lambda m: m.update(tables=[]), "'tables' is list \\[\\], expected an object"),
    "table a string": (lambda m: m["tables"].update(moves="x"), "table 'moves' is str 'x', expected an object"),
    "rows a string": (lambda m: m["tables"]["moves"].update(rows="3"), "'moves.rows' is str '3', expected an integer"),
    "rows a float": (lambda m: m["tables"]["moves"].update(rows=3.0), "'moves.rows' is float 3.0, expected an integer"),
    "rows negative": (lambda m: m["tables"]["moves"].update(rows=-1), "'moves.rows' is -1, expected a count"),
    "columns a list": (lambda m: m["tables"]["moves"].update(columns=["nbytes"]), "'moves.columns' is list"),
    "column a string": (lambda m: m["tables"]["moves"]["columns"].update(nbytes="x"), "column 'moves.nbytes' is str"),
    "member not a string": (
        lambda m: m["tables"]["moves"]["columns"]["nbytes"].update(member=7), "column 'moves.nbytes' member is int 7, expected a string"
    ),
    "dtype changed": (
        lambda m: m["tables"]["moves"]["columns"]["nbytes"].update(dtype="|O"), "column 'moves.nbytes' has dtype '\\|O', expected '<i8'"
    ),
    "unknown encoding": (lambda m: m["tables"]["moves"]["columns"]["nbytes"].update(encoding="zstd"), "unknown encoding 'zstd'"),
    "dictionaries a list": (lambda m: m.update(dictionaries=[]), "'dictionaries' is list \\[\\], expected an object"),
    "dictionary of numbers": (lambda m: m["dictionaries"].update({"moves.src": [1]}), "dictionary of 'moves.src' is list \\[1\\], expected a list of strings"),
    "member is a directory": (
        lambda m: m["tables"]["moves"]["columns"]["nbytes"].update(member="tables/"), "'tables/' \\(column 'moves.nbytes'\\) is a directory entry"
    ),
    "member missing": (
        lambda m: m["tables"]["moves"]["columns"]["nbytes"].update(member="nope.npy"), "corrupt: it has no member 'nope.npy'"
    ),
}


@pytest.mark.parametrize("kind", list(WRONG_TYPES))
def test_manifest_fields_of_the_wrong_type(kind: str, good: Path, tmp_path: Path) -> None:
    edit, expected = WRONG_TYPES[kind]
    bad = with_manifest(good, tmp_path / "bad.csprof", edit)
    if kind == "member is a directory":
        with zipfile.ZipFile(bad, "a") as zf:
            zf.writestr(zipfile.ZipInfo("tables/"), b"")
    with pytest.raises(ProfileFormatError, match=expected) as info:
        chunkstar_profiler.load(str(bad))
    assert str(info.value).startswith(f"{bad}: ")


def test_pickled_npy_member_is_refused_by_its_header(good: Path, tmp_path: Path) -> None:
    buf = io.BytesIO()
    np.save(buf, np.array([object()] * ROWS, dtype=object), allow_pickle=True)
    bad = rebuild(good, tmp_path / "pickle.csprof", {MEMBER: buf.getvalue()})
    with pytest.raises(ProfileFormatError, match="'moves.nbytes' has shape \\(3,\\) and dtype object, expected \\(3,\\) int64"):
        chunkstar_profiler.load(str(bad))


def test_a_directory_is_not_a_profile(tmp_path: Path) -> None:
    with pytest.raises(ProfileFormatError, match=re.escape(f"{tmp_path}: a directory, not a profile file")):
        chunkstar_profiler.load(str(tmp_path))


def test_a_missing_path_is_a_format_error_and_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope.csprof"
    with pytest.raises(ProfileFormatError, match=re.escape(f"{missing}: no such file")) as info:
        chunkstar_profiler.load(missing)
    assert isinstance(info.value, FileNotFoundError)


SECRET = "hunter2-secret"
"""Text of a file that is not a profile, which no message may repeat (the viewer's path box reads any path)."""


def _zip_with_manifest(path: Path, manifest: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("manifest.json", manifest)
    return path


@pytest.mark.parametrize(
    "kind, make, expected",
    [
        ("shadow-like text", lambda p: p.write_text(f"root:{SECRET}:19000:0:99999:7:::\n"), "not a chunkstar profile"),
        ("binary", lambda p: p.write_bytes(b"\x80\x04" + SECRET.encode()), "not a chunkstar profile"),
        ("foreign manifest", lambda p: _zip_with_manifest(p, json.dumps({"format": SECRET}).encode()), "not a chunkstar profile"),
        ("manifest not UTF-8", lambda p: _zip_with_manifest(p, b"\xff" + SECRET.encode()), "not UTF-8 text"),
    ],
)
def test_a_file_that_is_not_a_profile_is_never_quoted(kind: str, make: Callable[[Path], Any], expected: str, tmp_path: Path) -> None:
    path = tmp_path / "secret"
    make(path)
    with pytest.raises(ProfileFormatError) as info:
        chunkstar_profiler.load(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: ") and expected in message, message
    said = message[len(f"{path}: ") :]  # what the reader says about the file, after its name
    for fragment in ("root", SECRET[:4], "\\x80", "\\xff", "0xff", "0x80"):
        assert fragment not in said, message


def test_a_predicted_profiles_fields_of_the_wrong_type_are_left_out(good: Path, tmp_path: Path) -> None:
    """``meta["predicted"]`` (an object) marks a predicted profile; ``Profile.prediction`` keeps only the fields
    that have their type (the viewer formats them), and a measured profile has none."""
    assert chunkstar_profiler.load(str(good)).prediction is None
    fields = {
        "seconds_per_step": 1.5, "binding": "compute", "rank": 1, "world_size": 8, "flops": 10**15,
        "busy": {"compute": 1.0, "h2d": "x", "d2h": True, "disk": float("nan")},
    }  # fmt: skip
    p = chunkstar_profiler.load(str(with_manifest(good, tmp_path / "pred.csprof", lambda m: m["meta"].update(predicted=fields))))
    assert p.prediction == {"seconds_per_step": 1.5, "binding": "compute", "rank": 1, "world_size": 8, "flops": 10**15, "busy": {"compute": 1.0}}
    assert p.meta["version"] == FORMAT_VERSION  # a meta key, no new values in any column: no new version
    wrong = {"seconds_per_step": "fast", "binding": ["**x**"], "rank": 1.0, "world_size": True, "busy": [1], "extra": 1}
    p = chunkstar_profiler.load(str(with_manifest(good, tmp_path / "odd.csprof", lambda m: m["meta"].update(predicted=wrong))))
    assert p.prediction == {}  # still a predicted profile: the viewer says so, without figures
    assert chunkstar_profiler.summarize(p).splitlines()[2] == "PREDICTED, not measured: a dry run's step on the time model's clock"
