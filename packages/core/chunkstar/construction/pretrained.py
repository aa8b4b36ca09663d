"""Reading a safetensors checkpoint tensor by tensor, straight into chunk memory.

``initialize_engine(..., pretrained=PATH)`` fills the chunks from a checkpoint
without ever holding the whole model: :class:`PretrainedSource` opens one
``.safetensors`` file, or a Hugging Face checkpoint directory
(``model.safetensors``, or ``model.safetensors.index.json`` and its shards), and
:meth:`PretrainedSource.read_into` reads one tensor's bytes with ``os.preadv``
into the destination (a view into a chunk) when the dtypes match, or through a
buffer of that one tensor when they do not (a bf16 file into fp32 masters:
exact). The page cache is told to drop what was read, so a checkpoint larger
than host memory streams through it.

The format is read here, not through the ``safetensors`` package, so the core
keeps torch as its only dependency: an 8-byte little-endian header length,
a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``
(offsets from the end of the header) and the raw little-endian bytes. Pickle
checkpoints (``pytorch_model.bin``) are refused.

This module reads; it does not decide which tensor goes where beyond matching
names (:func:`match_names`), and it writes no chunk state.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch

__all__ = ["PretrainedError", "PretrainedSource", "match_names", "write_safetensors"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_PIECE = 64 << 20  # bytes per preadv call: large sequential reads
_HEADER_LIMIT = 100 << 20  # a header longer than this is not a safetensors file


class PretrainedError(ValueError):
    """The checkpoint cannot be read, or does not fit the model (names the file and tensor)."""


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def _read_header(path: Path) -> dict[str, _Entry]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise PretrainedError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > _HEADER_LIMIT:
                raise PretrainedError(f"{path}: not a safetensors file (header length {n})")
            header = f.read(n)
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise PretrainedError(f"{path}: cannot read it ({e.strerror})") from e
    try:
        meta = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PretrainedError(f"{path}: not a safetensors file (its header is not JSON: {e})") from e
    out: dict[str, _Entry] = {}
    base = 8 + n
    for key, info in meta.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise PretrainedError(f"{path}: tensor '{key}' has a malformed header entry ({info!r})") from e
        if end - begin != math.prod(shape) * dtype.itemsize or base + end > size:
            raise PretrainedError(
                f"{path}: tensor '{key}' ({info['dtype']} {list(shape)}) has {end - begin} bytes at "
                f"{base + begin}..{base + end} of a {size}-byte file: the file is truncated or damaged"
            )
        out[key] = _Entry(path, dtype, shape, base + begin, base + end)
    return out


def _files_of(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix != ".safetensors":
            raise PretrainedError(
                f"{path}: pretrained= takes a .safetensors file or a Hugging Face checkpoint directory; other "
                "formats (pytorch_model.bin is a pickle) are not read. Convert it with safetensors' save_file"
            )
        return [path]
    if not path.is_dir():
        raise PretrainedError(f"{path}: no such file or directory")
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise PretrainedError(f"{index}: not a safetensors index (it needs a 'weight_map'): {e}") from e
        files = sorted({path / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise PretrainedError(f"{index}: shards {missing[:3]} named in its weight_map are missing")
        return files
    if (path / SINGLE_NAME).is_file():
        return [path / SINGLE_NAME]
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found
    bins = sorted(p.name for p in path.glob("*.bin"))
    raise PretrainedError(
        f"{path}: no {SINGLE_NAME} or {INDEX_NAME} here"
        + (f" ({len(found)} other .safetensors files: say which)" if found else "")
        + (f"; {bins[:2]} are pickle files, which chunkstar does not load" if bins else "")
    )


def _writable_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without numpy."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class PretrainedSource:
    """The tensors of a safetensors checkpoint by name (shapes and dtypes from the headers),
    read one at a time."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.files = _files_of(self.path)
        self._entries: dict[str, _Entry] = {}
        for f in self.files:
            for key, e in _read_header(f).items():
                if key in self._entries:
                    raise PretrainedError(f"{self.path}: tensor '{key}' is in both {self._entries[key].file} and {f}")
                self._entries[key] = e
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0

    def __enter__(self) -> PretrainedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    @property
    def keys(self) -> set[str]:
        return set(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.end - e.begin for e in self._entries.values())

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entries[key].shape

    def dtype(self, key: str) -> torch.dtype:
        return self._entries[key].dtype

    def _fd(self, file: Path) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd

    def read_into(self, key: str, dst: torch.Tensor) -> None:
        """Tensor ``key``'s values into ``dst`` (a contiguous CPU tensor of as many elements,
        any floating dtype: converted exactly where the file's dtype is narrower)."""
        e = self._entries[key]
        if dst.numel() != math.prod(e.shape):
            raise PretrainedError(
                f"{e.file}: tensor '{key}' has shape {list(e.shape)}, the model's parameter {dst.numel()} elements"
            )
        if dst.device.type != "cpu" or not dst.is_contiguous():
            raise ValueError("read_into writes contiguous CPU tensors")
        target = dst if dst.dtype == e.dtype else torch.empty(dst.numel(), dtype=e.dtype)
        view = _writable_bytes(target)
        fd = self._fd(e.file)
        done = 0
        total = e.end - e.begin
        while done < total:
            got = os.preadv(fd, [view[done : done + _PIECE]], e.begin + done)
            if got <= 0:
                raise PretrainedError(f"{e.file}: tensor '{key}' ends early (read {done} of {total} bytes)")
            done += got
        if hasattr(os, "posix_fadvise"):  # the page cache need not keep a second copy of the model
            os.posix_fadvise(fd, e.begin, total, os.POSIX_FADV_DONTNEED)
        self.bytes_read += total
        if target is not dst:
            dst.copy_(target.reshape(dst.shape))

    def read(self, key: str) -> torch.Tensor:
        """Tensor ``key`` as a new CPU tensor of the file's dtype and shape."""
        e = self._entries[key]
        out = torch.empty(e.shape, dtype=e.dtype)
        self.read_into(key, out.reshape(-1))
        return out


_NAMES = {v: k for k, v in _DTYPES.items()}


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
    fill: Callable[[str, torch.Tensor], None],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write a safetensors file one tensor at a time, never holding more than one: the header
    comes from ``tensors`` (name, shape, dtype; written in that order), then each tensor's
    bytes from ``fill(name, out)``, which writes the values into ``out`` (a 1-D CPU tensor of
    that many elements and that dtype). Written to a temporary name and renamed at the end.
    Returns the file's size in bytes."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, shape, dtype in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned
    final = Path(path)
    tmp = final.with_name(f".{final.name}.partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in tensors:
            out = torch.empty(math.prod(shape), dtype=dtype)
            fill(name, out)
            f.write(_writable_bytes(out))
            del out
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final.stat().st_size


def match_names(names: Sequence[str], keys: Iterable[str], prefixes: Sequence[str] = ()) -> dict[str, str]:
    """Model name -> checkpoint key, for the names the checkpoint holds.

    Names match exactly, or after adding or removing one of ``prefixes`` (a Hugging
    Face ``base_model_prefix`` such as ``transformer``: a base model's checkpoint
    loaded into its LM-head model, or the other way round; PEFT's ``base_model.model``),
    and a PEFT layer's ``.base_layer.`` dropped (LoRA on a base model's checkpoint);
    the rule that matches most names wins, so one checkpoint is never read under two
    conventions."""
    keyset = set(keys)
    rules: list[tuple[str, str]] = [("", "")]  # (strip from the name, add to the name)
    for p in prefixes:
        if p:
            rules += [(f"{p}.", ""), ("", f"{p}.")]
    best: dict[str, str] = {}
    for strip, add in rules:
        got: dict[str, str] = {}
        for n in names:
            if strip and not n.startswith(strip):
                continue
            k = add + n[len(strip) :]
            if k not in keyset and ".base_layer." in k:
                k = k.replace(".base_layer.", ".")  # a PEFT-wrapped layer's base weight, as the base model names it
            if k in keyset:
                got[n] = k
        if len(got) > len(best):
            best = got
    return best
