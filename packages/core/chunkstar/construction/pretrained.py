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

Note [reading a checkpoint]: a checkpoint is input from elsewhere (a download, a
colleague's directory), so nothing in it is trusted until checked, and every
refusal is a :class:`PretrainedError` raised before a byte reaches a chunk:

* only regular files are read. A FIFO, socket, device or directory in a shard's
  place is refused from ``os.stat``, never opened (opening a FIFO blocks until a
  writer comes; reading ``/dev/zero`` never ends), and each open is non-blocking
  and checked again with ``fstat``, should the path change in between;
* a directory's shards (the index's ``weight_map`` entries, ``model.safetensors``,
  or its one ``.safetensors`` file) must resolve, symlinks followed, inside the
  directory: an entry ``../../elsewhere/x.safetensors``, an absolute path or a
  link out is refused. The one exception is the Hugging Face hub cache, whose
  ``snapshots/<revision>/`` files link to ``../../blobs/``: that folder is part of
  the checkpoint. A file given directly as ``pretrained=`` is the user's choice;
* the header is held to the rules the ``safetensors`` library holds it to, so a
  file it would refuse is refused here too: a JSON object without repeated names,
  ``__metadata__`` a map of strings, each tensor a known dtype, a shape of
  non-negative ints and ``data_offsets`` two non-negative ints holding exactly
  ``numel * itemsize`` bytes; the tensors stored back to back from the start of
  the data to the end of the file (no overlap, no gap, nothing after). Negative or
  overlapping offsets would otherwise read the header, or one tensor's bytes, as
  another tensor's values;
* a tensor fills a parameter or buffer of another dtype only where the value
  survives (:meth:`PretrainedSource.check`): any float into any float (checkpoints
  hold fp32, fp16 or bf16 weights, read into fp32 masters or a frozen chunk's
  compute dtype), an integer or bool only into a dtype that holds all its values.
  An ``I32`` tensor is never read into a float parameter: the bytes would become
  numbers like 1065353216.0;
* messages name the file, the tensor and the rule, and never echo the file's bytes
  (a path given by mistake may be a private file).

Values are not judged, only reported: a tensor holding NaN or infinities loads,
and :attr:`PretrainedSource.nonfinite` names it (the engine warns).

This module reads; it does not decide which tensor goes where beyond matching
names (:func:`match_names`), and it writes no chunk state.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

__all__ = ["PretrainedError", "PretrainedSource", "match_names", "write_safetensors"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_NAMES = {v: k for k, v in _DTYPES.items()}
_PIECE = 64 << 20  # bytes per preadv call: large sequential reads
_FINITE_PIECE = 16 << 20  # elements per isfinite check: its bool temporary stays small beside a large tensor
_HEADER_LIMIT = 100 << 20  # a header (or an index) longer than this is not one (safetensors' own limit)
_DAMAGED = "the file is damaged (download or save it again)"
_KINDS = {
    stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
}  # fmt: skip


class PretrainedError(ValueError):
    """The checkpoint cannot be read, or does not fit the model (names the file and tensor)."""


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int


def _brief(x: object) -> str:
    """A name or value from a file, for a message: quoted and escaped (repr), and cut short."""
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _not_safetensors(path: Path, why: str) -> PretrainedError:
    # never with the file's bytes: a path given by mistake may be any file (Note [reading a checkpoint])
    return PretrainedError(
        f"{path}: not a safetensors file ({why}); pretrained= reads files written by safetensors or save_pretrained"
    )


def _regular(path: Path) -> None:
    """Refuse ``path`` unless it is a regular file, symlinks followed; it is not opened
    (Note [reading a checkpoint])."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise PretrainedError(f"{path}: no such file or directory") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the name
        raise PretrainedError(f"{path}: cannot read it ({getattr(e, 'strerror', None) or 'not a valid path'})") from None
    _refuse_special(path, mode)


def _refuse_special(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        what = _KINDS.get(stat.S_IFMT(mode), "a special file")
        raise PretrainedError(f"{path}: it is {what}, not a regular file; pretrained= reads only regular .safetensors files")


def _open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file ``path``; anything else is refused unopened."""
    _regular(path)
    try:
        # non-blocking: should the path have become a FIFO since the check, the open returns at once
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise PretrainedError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        _refuse_special(path, os.fstat(fd).st_mode)
    except PretrainedError:
        os.close(fd)
        raise
    return fd  # O_NONBLOCK does not change a regular file's reads


def _pread(fd: int, n: int, offset: int) -> bytes:
    """Up to ``n`` bytes at ``offset`` (fewer only at the end of the file)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        piece = os.pread(fd, min(n - got, _PIECE), offset + got)
        if not piece:
            break
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)


def _read_regular(path: Path, limit: int) -> tuple[bytes, int]:
    """The first ``limit`` bytes of the regular file ``path`` (all of a shorter one), and its size."""
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        return _pread(fd, min(size, limit), 0), size
    except OSError as e:
        raise PretrainedError(f"{path}: cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)


class _Repeated(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object that names nothing twice (json.loads would keep the last silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Repeated(k)
        out[k] = v
    return out


def _is_count(x: object) -> bool:
    return type(x) is int and x >= 0  # not a bool, not a float


def _read_header(path: Path) -> dict[str, _Entry]:
    """The tensors of the safetensors file ``path``, each checked as safetensors checks them
    (Note [reading a checkpoint])."""
    fd = _open_regular(path)
    try:
        size = os.fstat(fd).st_size
        head = _pread(fd, 8, 0)
        if len(head) != 8:
            raise _not_safetensors(path, "it is too short")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_LIMIT or 8 + n > size:  # n itself is not shown: it is the file's first 8 bytes
            raise _not_safetensors(path, "its first 8 bytes are not the length of a header it holds")
        raw = _pread(fd, n, 8)
    except OSError as e:
        raise PretrainedError(f"{path}: cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)
    try:
        meta = json.loads(raw.decode("utf-8"), object_pairs_hook=_object)
    except _Repeated as e:
        raise PretrainedError(f"{path}: its header names {_brief(e.name)} twice: {_DAMAGED}") from None
    except ValueError:  # not UTF-8, not JSON (the decoders' messages quote the bytes)
        raise _not_safetensors(path, "its header is not JSON") from None
    if not isinstance(meta, dict):
        raise _not_safetensors(path, "its header is not a JSON object")
    extra = meta.pop("__metadata__", None)
    if extra is not None and not (isinstance(extra, dict) and all(isinstance(v, str) for v in extra.values())):
        raise PretrainedError(f"{path}: its header's __metadata__ is not a map of strings: {_DAMAGED}")
    base = 8 + n
    out = {key: _entry(path, key, info, base) for key, info in meta.items()}
    # back to back from the start of the data to the end of the file, as safetensors writes
    # (and requires): no tensor reads another's bytes, the header's, or bytes past the end
    at = base
    for key, entry in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin != at:
            how = "overlap the tensor before it" if entry.begin < at else "leave a gap after the tensor before it"
            raise PretrainedError(f"{path}: the data_offsets of tensor {_brief(key)} {how}: {_DAMAGED}")
        at = entry.end
    if at > size:
        raise PretrainedError(
            f"{path}: its tensors take {at - base} bytes of data and the file holds {size - base}: "
            "the file is truncated (download or save it again)"
        )
    if at < size:
        raise PretrainedError(f"{path}: {size - at} bytes follow its last tensor: {_DAMAGED}")
    return out


def _entry(path: Path, key: str, info: object, base: int) -> _Entry:
    def bad(why: str) -> PretrainedError:
        return PretrainedError(f"{path}: tensor {_brief(key)} {why}: {_DAMAGED}")

    if not isinstance(info, dict):
        raise bad("has a header entry that is not a JSON object")
    name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(name, str):
        raise bad("has no dtype")
    if name not in _DTYPES:
        raise PretrainedError(
            f"{path}: tensor {_brief(key)} has dtype {_brief(name)}, which chunkstar does not read "
            f"(it reads {', '.join(_DTYPES)}); convert the checkpoint to one of them"
        )
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise bad("has a shape that is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(x) for x in offsets)):
        raise bad("has data_offsets that are not two non-negative integers [begin, end]")
    begin, end = offsets
    nbytes = math.prod(shape) * _DTYPES[name].itemsize
    if end - begin != nbytes:
        raise bad(f"has data_offsets {_brief(offsets)}, where {name} of shape {_brief(shape)} takes {nbytes} bytes")
    return _Entry(path, _DTYPES[name], tuple(shape), base + begin, base + end)


def _weight_map(index: Path) -> list[str]:
    """The shard file names a ``model.safetensors.index.json`` names."""
    raw, size = _read_regular(index, _HEADER_LIMIT)
    if size > _HEADER_LIMIT:
        raise PretrainedError(f"{index}: not a safetensors index (it is larger than {_HEADER_LIMIT >> 20} MiB)")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except ValueError:
        raise PretrainedError(f"{index}: not a safetensors index (it is not JSON)") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise PretrainedError(
            f"{index}: not a safetensors index (it needs a 'weight_map' object mapping each tensor name to its shard file)"
        )
    if not weight_map:
        raise PretrainedError(f"{index}: its weight_map names no tensors, so there is nothing to load")
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise PretrainedError(f"{index}: its weight_map's entry for {_brief(key)} is not a file name")
    return list(weight_map.values())


def _shards(directory: Path, names: Iterable[str], named_in: str) -> list[Path]:
    """The files ``names`` of a checkpoint directory, each once: regular files that resolve,
    symlinks followed, inside it (Note [reading a checkpoint])."""
    root = directory.resolve()
    inside = [root]
    if root.parent.name == "snapshots":  # the hub cache: snapshots/<revision>/<file> -> ../../blobs/<hash>
        inside.append(root.parent.parent / "blobs")
    out: dict[Path, Path] = {}
    for name in names:
        f = directory / name  # an absolute name replaces the directory: refused below
        try:
            real = f.resolve()
        except (OSError, RuntimeError, ValueError):  # a symlink loop; a NUL in the name
            raise PretrainedError(f"{directory}: file {_brief(name)} named in {named_in} is not a valid path") from None
        if not any(real.is_relative_to(r) for r in inside):
            raise PretrainedError(
                f"{directory}: file {_brief(name)} named in {named_in} resolves outside the checkpoint directory; "
                "pretrained= reads only files inside it (copy the file in)"
            )
        try:
            os.stat(f)
        except FileNotFoundError:
            raise PretrainedError(f"{directory}: file {_brief(name)} named in {named_in} is missing") from None
        except OSError:
            pass  # _regular says what
        _regular(f)
        out.setdefault(real, f)  # two names of one file: read once
    return sorted(out.values())


def _files_of(path: Path) -> list[Path]:
    if not path.is_dir():
        _regular(path)
        if path.suffix != ".safetensors":
            raise PretrainedError(
                f"{path}: pretrained= takes a .safetensors file or a Hugging Face checkpoint directory; other "
                "formats (pytorch_model.bin is a pickle) are not read. Convert it with safetensors' save_file"
            )
        return [path]
    index = path / INDEX_NAME
    if os.path.lexists(index):
        (index,) = _shards(path, [INDEX_NAME], "the directory")  # held to the same rules as the shards
        return _shards(path, _weight_map(index), f"{INDEX_NAME}'s weight_map")
    if os.path.lexists(path / SINGLE_NAME):
        return _shards(path, [SINGLE_NAME], "the directory")
    found = sorted(p.name for p in path.glob("*.safetensors"))
    if len(found) == 1:
        return _shards(path, found, "the directory")
    bins = sorted(p.name for p in path.glob("*.bin"))
    raise PretrainedError(
        f"{path}: no {SINGLE_NAME} or {INDEX_NAME} here"
        + (f" ({len(found)} other .safetensors files: say which)" if found else "")
        + (f"; {bins[:2]} are pickle files, which chunkstar does not load" if bins else "")
    )


def _as_path(path: object) -> Path:
    try:
        text = os.fspath(path)  # type: ignore[call-overload]
    except TypeError:
        text = None
    if not isinstance(text, str) or not text:
        got = "an empty string" if text == "" else type(text if text is not None else path).__name__
        raise PretrainedError(
            f"pretrained= takes the path (a str or os.PathLike) of a .safetensors file or a checkpoint directory, got {got}"
        )
    return Path(text)


def _converts(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a checkpoint tensor of ``src`` may fill a tensor of ``dst`` (Note [reading a
    checkpoint]): float into float, or an integer (bool) into a dtype holding all its values."""
    if src.is_floating_point or dst.is_floating_point:
        return src.is_floating_point and dst.is_floating_point
    return torch.promote_types(src, dst) == dst


def _all_finite(t: torch.Tensor) -> bool:
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i : i + _FINITE_PIECE]).all()) for i in range(0, flat.numel(), _FINITE_PIECE))


def _writable_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without numpy."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class PretrainedSource:
    """The tensors of a safetensors checkpoint by name (shapes and dtypes from the headers),
    read one at a time. Every file is checked as it is opened (Note [reading a checkpoint])."""

    @staticmethod
    def check_path(path: object) -> None:
        """Refuse a ``pretrained=`` that is not a path to a readable checkpoint (its type, that it
        exists, its files) without reading any header: initialize_engine asks before it builds
        the model, which can take long."""
        _files_of(_as_path(path))

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = _as_path(path)
        self.files = _files_of(self.path)
        self._entries: dict[str, _Entry] = {}
        for f in self.files:
            for key, e in _read_header(f).items():
                if key in self._entries:
                    raise PretrainedError(
                        f"{self.path}: tensor {_brief(key)} is in both {self._entries[key].file} and {f}"
                    )
                self._entries[key] = e
        self._fds: dict[Path, int] = {}
        self.bytes_read = 0
        self.nonfinite: list[str] = []
        """Tensors read so far that hold a NaN or an infinity."""

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

    def check(self, key: str, shape: Sequence[int], dtype: torch.dtype, what: str) -> None:
        """Refuse tensor ``key`` for the model's ``what`` (``parameter 'name'``), of ``shape`` and
        ``dtype``, unless it has that shape and a dtype that converts (Note [reading a checkpoint])."""
        e = self._entries[key]
        if e.shape != tuple(shape):
            raise PretrainedError(f"{e.file}: tensor {key!r} is {list(e.shape)}, the model's {what} {list(shape)}")
        self._check_dtype(key, dtype, what)

    def _check_dtype(self, key: str, dtype: torch.dtype, what: str) -> None:
        e = self._entries[key]
        if not _converts(e.dtype, dtype):
            raise PretrainedError(
                f"{e.file}: tensor {key!r} is {_NAMES[e.dtype]} and the model's {what} is {dtype}, which it does not "
                "convert to as it is (floats fill floats, integers only wider integers); convert the checkpoint"
            )

    def _fd(self, file: Path) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = _open_regular(file)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd

    def read_into(self, key: str, dst: torch.Tensor) -> None:
        """Tensor ``key``'s values into ``dst`` (a contiguous CPU tensor of as many elements, of a
        dtype it converts to: any float for a float tensor, exact where the file's is narrower)."""
        e = self._entries[key]
        if dst.numel() != math.prod(e.shape):
            raise PretrainedError(
                f"{e.file}: tensor {key!r} has shape {list(e.shape)}, the model's parameter {dst.numel()} elements"
            )
        if dst.device.type != "cpu" or not dst.is_contiguous():
            raise ValueError("read_into writes contiguous CPU tensors")
        self._check_dtype(key, dst.dtype, "tensor")
        target = dst if dst.dtype == e.dtype else torch.empty(dst.numel(), dtype=e.dtype)
        view = _writable_bytes(target)
        fd = self._fd(e.file)
        done = 0
        total = e.end - e.begin
        while done < total:
            got = os.preadv(fd, [view[done : done + _PIECE]], e.begin + done)
            if got <= 0:
                raise PretrainedError(f"{e.file}: tensor {key!r} ends early (read {done} of {total} bytes)")
            done += got
        if hasattr(os, "posix_fadvise"):  # the page cache need not keep a second copy of the model
            os.posix_fadvise(fd, e.begin, total, os.POSIX_FADV_DONTNEED)
        self.bytes_read += total
        if target.is_floating_point() and not _all_finite(target):
            self.nonfinite.append(key)
        if target is not dst:
            dst.copy_(target.reshape(dst.shape))

    def read(self, key: str) -> torch.Tensor:
        """Tensor ``key`` as a new CPU tensor of the file's dtype and shape."""
        e = self._entries[key]
        out = torch.empty(e.shape, dtype=e.dtype)
        self.read_into(key, out.reshape(-1))
        return out


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
