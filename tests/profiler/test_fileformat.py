"""The profile file: round trip, version check and every kind of bad file."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import chunkstar_profiler
from chunkstar_profiler import ProfileFormatError
from chunkstar_profiler.fileformat import FORMAT_NAME, FORMAT_VERSION


def _rewrite(src: Path, dst: Path, edit: Callable[[dict[str, bytes]], None]) -> Path:
    with zipfile.ZipFile(src) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    edit(members)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, data in members.items():
            zf.writestr(n, data)
    return dst


def _manifest_edit(fn: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, bytes]], None]:
    def edit(members: dict[str, bytes]) -> None:
        m = json.loads(members["manifest.json"])
        fn(m)
        members["manifest.json"] = json.dumps(m).encode()

    return edit


def test_self_describing_and_never_pickle(recorded: dict[str, Any]) -> None:
    with zipfile.ZipFile(recorded["path"]) as zf:
        names = zf.namelist()
        manifest = json.loads(zf.read("manifest.json"))
        assert manifest["format"] == FORMAT_NAME and manifest["version"] == FORMAT_VERSION
        for table in manifest["tables"].values():
            for col in table["columns"].values():
                assert col["member"] in names and col["dtype"] and "kind" in col
                # plain NPY, loadable with pickle switched off
                arr = np.load(zf.open(col["member"]), allow_pickle=False)
                assert arr.dtype != object
    assert all(n == "manifest.json" or n.endswith(".npy") for n in names)


def test_load_needs_no_engine(recorded: dict[str, Any]) -> None:
    import subprocess
    import sys

    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'chunkstar'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import chunkstar_profiler\n"
        f"p = chunkstar_profiler.load({str(recorded['path'])!r})\n"
        "chunkstar_profiler.summarize(p)\n"
        "print(len(p.moves))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 0


BAD_FILES: dict[str, tuple[Callable[[Path, Path], Path], str]] = {
    "truncated": (lambda src, dst: dst.write_bytes(src.read_bytes()[: len(src.read_bytes()) // 2]) and dst, "truncated"),
    "empty": (lambda src, dst: dst.write_bytes(b"") or dst, "not a chunkstar profile"),
    "text file": (lambda src, dst: dst.write_text("hello, not a profile\n") and dst, "not a chunkstar profile"),
    "pickle": (lambda src, dst: dst.write_bytes(b"\x80\x04\x95\x00") and dst, "not a chunkstar profile"),
    "foreign zip": (
        lambda src, dst: _rewrite(src, dst, lambda m: [m.clear(), m.update({"readme.txt": b"hi"})]),
        "no manifest.json",
    ),
    "foreign format": (lambda src, dst: _rewrite(src, dst, _manifest_edit(lambda m: m.update(format="other"))), "not a chunkstar profile"),
    "newer version": (
        lambda src, dst: _rewrite(src, dst, _manifest_edit(lambda m: m.update(version=FORMAT_VERSION + 1))),
        "newer chunkstar_profiler",
    ),
    "manifest not json": (lambda src, dst: _rewrite(src, dst, lambda m: m.update({"manifest.json": b"{nope"})), "not valid JSON"),
    "missing table": (lambda src, dst: _rewrite(src, dst, _manifest_edit(lambda m: m["tables"].pop("moves"))), "'moves' is missing"),
    "missing member": (
        lambda src, dst: _rewrite(src, dst, lambda m: m.pop("tables/moves/nbytes.npy")),
        "corrupt",
    ),
    "wrong row count": (
        lambda src, dst: _rewrite(src, dst, _manifest_edit(lambda m: m["tables"]["moves"].update(rows=m["tables"]["moves"]["rows"] + 1))),
        "expected",
    ),
    "codes outside dictionary": (
        lambda src, dst: _rewrite(src, dst, _manifest_edit(lambda m: m["dictionaries"].update({"moves.reason": []}))),
        "outside its dictionary",
    ),
    "garbage member": (
        lambda src, dst: _rewrite(src, dst, lambda m: m.update({"tables/moves/nbytes.npy": b"\x00" * 40})),
        "corrupt",
    ),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_bad_files_give_clear_errors(kind: str, recorded: dict[str, Any], tmp_path: Path) -> None:
    make, expected = BAD_FILES[kind]
    bad = make(Path(recorded["path"]), tmp_path / "bad.csprof")
    with pytest.raises(ProfileFormatError, match=expected) as info:
        chunkstar_profiler.load(str(bad))
    assert str(bad) in str(info.value)


def test_flipped_bytes_inside_a_member_are_caught(recorded: dict[str, Any], tmp_path: Path) -> None:
    """Damage a compressed member in place: the ZIP CRC check reports it as corrupt."""
    bad = tmp_path / "flipped.csprof"
    shutil.copy(recorded["path"], bad)
    with zipfile.ZipFile(bad) as zf:
        info = zf.getinfo("tables/moves/nbytes.npy")
    data = bytearray(bad.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    for i in range(start, start + min(info.compress_size, 16)):
        data[i] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(ProfileFormatError, match="corrupt"):
        chunkstar_profiler.load(str(bad))


def test_version_1_files_still_load(tmp_path: Path) -> None:
    """Version 2 added values (the disk tier), not layout: a version 1 file reads as one without a disk tier
    (and, version 3's table unknown to it, without activation moves: tests/profiler/test_activation_moves.py)."""
    from tests.profiler._hostile import small_profile, with_manifest

    assert FORMAT_VERSION == 3
    v1 = with_manifest(small_profile(tmp_path / "now.csprof"), tmp_path / "v1.csprof", lambda m: m.update(version=1))
    p = chunkstar_profiler.load(str(v1))
    assert p.meta["version"] == 1 and len(p.moves) == 4 and set(p.memory["tier"]) == {"device", "host"}
    assert p.activation_moves.empty
    assert "disk tier" not in chunkstar_profiler.summarize(p)
    chunkstar_profiler.export_chrome_trace(p, tmp_path / "v1.json")
    for bad in (0, -1):
        with pytest.raises(ProfileFormatError, match="no valid format version"):
            chunkstar_profiler.load(str(with_manifest(v1, tmp_path / "bad.csprof", lambda m, b=bad: m.update(version=b))))


def test_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        chunkstar_profiler.load(str(tmp_path / "nope.csprof"))


def test_save_is_atomic_and_overwrites(recorded: dict[str, Any], tmp_path: Path) -> None:
    target = tmp_path / "sub" / "again.csprof"
    recorded["prof"].save(target)
    recorded["prof"].save(target)
    assert not (tmp_path / "sub" / "again.csprof.tmp").exists()
    assert len(chunkstar_profiler.load(str(target)).moves) == len(chunkstar_profiler.load(str(recorded["path"])).moves)


def test_load_from_bytes(recorded: dict[str, Any]) -> None:
    data = Path(recorded["path"]).read_bytes()
    p = chunkstar_profiler.load(data, name="upload.csprof")
    assert len(p.moves) == len(chunkstar_profiler.load(str(recorded["path"])).moves)
    with pytest.raises(ProfileFormatError, match="upload.csprof: the file is truncated"):
        chunkstar_profiler.load(data[: len(data) // 2], name="upload.csprof")
