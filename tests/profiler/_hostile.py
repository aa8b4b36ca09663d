"""Builders of hostile profile files: a profile taken apart and rebuilt around one bad member or field.

``small_profile`` writes a readable profile from hand-made columns (no engine,
no torch) to start from.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Any, Callable, Mapping

from chunkstar_profiler.fileformat import write_profile
from chunkstar_profiler.profile import TABLES

MIB = 2**20

# ZIP header fields: (offset in the local file header, offset in the central directory entry, struct format)
FLAGS = (6, 8, "<H")
"""General-purpose flags; bit 0 means encrypted."""
METHOD = (8, 10, "<H")
"""Compression method (0 stored, 8 DEFLATE, 99 AES)."""
UNCOMPRESSED_SIZE = (22, 24, "<I")

_VALUES: dict[str, Callable[[int], Any]] = {
    "t_start": lambda i: i * 10**6, "t_end": lambda i: i * 10**6 + 5 * 10**5, "t": lambda i: i * 10**6,
    "iteration": lambda i: i // 2, "stage": lambda i: ("fwd", "bwd")[i % 2], "module": lambda i: f"layer.{i % 2}",
    "chunk_id": lambda i: i % 2, "chunk_list": lambda i: "param", "nbytes": lambda i: 4096,
    "src": lambda i: ("host", "device")[i % 2], "dst": lambda i: ("device", "host")[i % 2],
    "tier": lambda i: ("device", "host")[i % 2], "reason": lambda i: ("access", "eviction")[i % 2],
    "chunk_bytes": lambda i: 4096 * (i + 1), "non_model_bytes": lambda i: 100, "budget_bytes": lambda i: 2**20,
    "block": lambda i: f"h.{i % 2}", "prefetch": lambda i: i % 2,
}  # fmt: skip
SMALL_META = {
    "model_name": "tiny", "n_params": 2048, "precision": "fp32", "device": "cpu", "budget_bytes": 2**20,
    "chunk_size": 1024, "n_chunks": 2, "chunk_lists": ["param"], "iterations": 2, "config": {},
}  # fmt: skip


def small_profile(path: Path, rows: int = 4, meta: Mapping[str, Any] = SMALL_META) -> Path:
    """A readable profile of ``rows`` rows per table (times 1 ms apart, 0.5 ms long) written by ``write_profile``."""
    columns = {table: {col: [_VALUES.get(col, lambda i: i)(i) for i in range(rows)] for col in schema} for table, schema in TABLES.items()}
    return Path(write_profile(path, columns, meta))


def members(src: Path) -> dict[str, bytes]:
    """Every member's bytes, by name."""
    with zipfile.ZipFile(src) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def rebuild(src: Path, dst: Path, replace: dict[str, bytes | Callable[[Any], None]]) -> Path:
    """Copy ``src`` to ``dst``; a ``replace`` value is a member's new bytes or a function writing them to a stream."""
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as out:
        for name, data in members(src).items():
            new = replace.get(name, data)
            if callable(new):
                with out.open(name, "w") as f:
                    new(f)
            else:
                out.writestr(name, new)
    return dst


def with_manifest(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """Copy ``src`` to ``dst`` with its manifest passed through ``edit`` (which changes it in place)."""
    manifest = json.loads(members(src)["manifest.json"])
    edit(manifest)
    return rebuild(src, dst, {"manifest.json": json.dumps(manifest).encode()})


def zeros(n: int, prefix: bytes = b"") -> Callable[[Any], None]:
    """A member writer for :func:`rebuild`: ``prefix`` then ``n`` zero bytes (whole MiB), streamed."""
    def write(f: Any) -> None:
        f.write(prefix)
        block = bytes(MIB)
        for _ in range(n // MIB):
            f.write(block)

    return write


def patch_header(path: Path, member: str, field: tuple[int, int, str], value: int) -> None:
    """Set one header ``field`` of ``member`` (``FLAGS``, ``METHOD``, ...) to ``value``, in both ZIP headers."""
    local, central, fmt = field
    data = bytearray(path.read_bytes())
    name = member.encode()
    with zipfile.ZipFile(path) as zf:
        local_at = zf.getinfo(member).header_offset
    central_at = data.index(b"PK\x01\x02")
    while data[central_at + 46 : central_at + 46 + len(name)] != name:
        central_at = data.index(b"PK\x01\x02", central_at + 4)
    struct.pack_into(fmt, data, local_at + local, value)
    struct.pack_into(fmt, data, central_at + central, value)
    path.write_bytes(bytes(data))
