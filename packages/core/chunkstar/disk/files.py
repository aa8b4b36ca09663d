"""The chunk files of the disk tier: one preallocated file per (rank, list), one aligned slot per chunk.

Mechanism only. :class:`ChunkFiles` knows *how* to move one chunk's bytes
between a host tensor and its slot on disk, exactly and at disk bandwidth; it
does not decide which lists live on disk, when a chunk is read or written back,
or where its host buffer comes from (the runtime, :mod:`chunkstar.disk.io_lanes`
and :mod:`chunkstar.disk.staging` do). It is not a checkpoint: the files are a
cache of one run's state, never reopened, never fsynced, and deleted at a
clean end (:meth:`ChunkFiles.remove`).

Layout: the file of list ``L`` of rank ``r`` is ``chunkstar-r<r>-<L>.chunks``;
this rank's chunk ids (it may own only some: ZeRO-style sharding) are stored in
increasing order, each at an offset that is a multiple of 4096
(:data:`~chunkstar.disk.blockio.ALIGNMENT`), its slot padded up to the next
multiple. Each list has its own sizes (a bf16 param list beside fp32 state). A
slot never written reads as zeros (the file is preallocated with
``posix_fallocate``). Who may use the directory, and what happens to stale
files of an earlier run, is Note [directory claim] in :mod:`chunkstar.disk.claim`.

Reads and writes go through ``O_DIRECT`` (``direct=True``, the default:
Note [direct I/O] in :mod:`chunkstar.disk.blockio`) when the buffer's address is
4096-aligned; an unaligned buffer is moved through the page cache instead (and
counted in :attr:`DiskIOStats.buffered_fallbacks`), and a filesystem that
refuses ``O_DIRECT`` (``EINVAL``: tmpfs, some network filesystems) turns it off
for good, the reason kept in :attr:`ChunkFiles.direct_fallback`. Buffered
transfers drop their pages afterwards (``POSIX_FADV_DONTNEED``; a write is
first written back): the page cache must not hold a second copy of the state.

Every chunk is checked when it is read (Note [chunk checks]): a chunk whose
bytes on disk are not the ones last written there raises a
:class:`~chunkstar.disk.errors.DiskTierError` naming the file and the chunk.

Note [chunk pieces]: a list may be given a piece size (``piece_nbytes``, a
multiple of 4096): each of its chunks is then a run of pieces of that many
bytes (the last one shorter), and a transfer may move a run of whole pieces
(``pieces=range(i, j)``) instead of the whole chunk. Each piece has its own
checksum and its own lost mark, so a piece read alone is checked as a whole
chunk is. This is what lets the optimizer step stage a chunk larger than its
share of the staging budget a slice at a time (Note [the step in slices] in
:mod:`chunkstar.runtime.disk_tier`): the lists' piece sizes hold the same
number of elements, so piece ``i`` of every list is the same elements.

Thread-safety: reads and writes may run on several threads at once (positional
I/O on shared descriptors; the counters are locked), but two transfers of the
same slot, or one of a tensor another thread is changing, must be ordered by
the caller (the I/O lanes' ``after``). :meth:`close` and :meth:`remove` must
come after every transfer has finished.

Note [chunk checks]: the files are this run's only copy of the optimizer
state, and nothing else may touch them; if something does (a truncation, a
stray write, another tool), or the disk returns other bytes than it was
given, training must stop with an error, not go on from garbage (0xFF bytes
are NaN masters; zeroed moments train on quietly, only worse). So
:class:`ChunkFiles` keeps, in memory, the checksum (Note [chunk checksum] in
:mod:`chunkstar.disk.checksum`) of the bytes last written to every slot (a
slot never written holds zeros, and has their sum), and
:meth:`~ChunkFiles.read_into` compares the sum of what it read before it
returns, on the thread that read it (an I/O lane's), so a chunk that fails
its check is never used: its read raises, and so does its event. A write
that did not complete (it failed half-way, say, or an I/O lane did not do it
because the update it waited for failed: :meth:`~ChunkFiles.mark_lost`)
leaves the slot *lost*: the file holds older bytes, or some of the new ones,
and neither is the chunk, so a read raises saying so even when the older
bytes would pass their check. A later write that completes supersedes it:
the slot holds that write's bytes, checked against their sum. The sums are
not written to disk: the files are never reopened (a cache of one run), and
their owner, this object, lives as long as they do.

The sum runs on a check thread beside the transfer, one per direction: over
the bytes of a write while the write goes to disk, over each 4 MiB piece of
a read while the next piece is read. A transfer then takes about as long as
without the check (a read, one piece's sum longer), but the sum costs CPU:
about 0.35 CPU-seconds per GB moved beyond the 0.06 of the transfer itself
(``benchmarks/disk_checks.py``), which a step whose host Adam is short of cores
feels. ``verify=False`` (config ``disk.verify``) leaves the sums out; a write
that did not complete still makes its chunk lost.
"""

from __future__ import annotations

import enum
import errno
import os
import shutil
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Mapping, Sequence

import torch

from chunkstar.disk.blockio import (
    ALIGNMENT,
    FADV_DONTNEED,
    FADV_SEQUENTIAL,
    FADV_WILLNEED,
    O_DIRECT,
    advise,
    aligned_empty,
    byte_view,
    is_aligned,
    pread_full,
    pwrite_full,
    round_up,
    write_back,
)
from chunkstar.disk.checksum import ChunkSum, zeros_sum
from chunkstar.disk.claim import DirectoryClaim, OnStale, chunk_file_name, claim_directory
from chunkstar.disk.errors import DiskFullError, DiskTierError

__all__ = ["ChunkFiles", "DiskIOStats", "FilesState", "piece_count", "piece_extent"]

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_CHECK_PIECE = 4 << 20
"""A read moves a chunk in pieces of this many bytes, each summed while the next is read (Note
[chunk checks]): small, so that little of the sum is left when the read ends; as fast to read as
larger pieces (measured with O_DIRECT here: 1, 2, 4 and 16 MiB pieces all read at 0.95-1.24 GB/s)."""


class FilesState(enum.Enum):
    OPEN = "open"
    """The rank lock is held and the files are open: chunks can be read and written."""
    CLOSED = "closed"
    """Lock released, descriptors closed; the files stay on disk (a later run finds them stale)."""
    REMOVED = "removed"
    """The files, the manifest and the lock file are deleted; nothing is left on disk."""


@dataclass(frozen=True)
class DiskIOStats:
    """What the files have moved so far (a snapshot)."""

    bytes_read: int
    bytes_written: int
    read_seconds: float
    """Wall time inside :meth:`ChunkFiles.read_into`, summed over threads."""
    write_seconds: float
    """Wall time inside :meth:`ChunkFiles.write_from`, write-back included, summed over threads."""
    reads: int
    writes: int
    buffered_fallbacks: int
    """Transfers that went through the page cache although direct I/O was on: an unaligned buffer."""


@dataclass(frozen=True)
class _Slot:
    offset: int
    nbytes: int


def piece_count(nbytes: int, piece_nbytes: int) -> int:
    """How many pieces a chunk of ``nbytes`` is in a list of ``piece_nbytes`` pieces (0:
    one piece, the whole chunk; Note [chunk pieces])."""
    return 1 if piece_nbytes <= 0 else -(-nbytes // piece_nbytes)


def piece_extent(nbytes: int, piece_nbytes: int, pieces: range | None) -> tuple[int, int]:
    """(first byte, bytes) of the run ``pieces`` of a chunk of ``nbytes`` (None: the whole chunk)."""
    if pieces is None:
        return 0, nbytes
    n = piece_count(nbytes, piece_nbytes)
    if pieces.step != 1 or not 0 <= pieces.start < pieces.stop <= n:
        raise ValueError(f"pieces={pieces!r}: expected a run of the chunk's pieces, within range(0, {n})")
    if piece_nbytes <= 0:
        return 0, nbytes
    start = pieces.start * piece_nbytes
    return start, min(pieces.stop * piece_nbytes, nbytes) - start


@dataclass
class _ListFile:
    name: str
    path: Path
    size: int  # bytes, every slot padded to ALIGNMENT
    slots: dict[int, _Slot]
    piece: int = 0  # Note [chunk pieces]: bytes per piece, 0: a chunk is one piece
    fd: int = -1  # buffered descriptor
    direct_fd: int = -1  # O_DIRECT descriptor of the same file, -1 if none
    # Note [chunk checks]: (chunk id, piece) -> checksum of the bytes last written (absent: never
    # written, zeros), and (chunk id, piece) -> why the piece is lost (its last write did not complete)
    sums: dict[tuple[int, int], int] = field(default_factory=dict)
    lost: dict[tuple[int, int], str] = field(default_factory=dict)

    def pieces(self, cid: int, pieces: range | None) -> list[tuple[int, _Slot]]:
        """Each piece of the run (None: every piece of the chunk) with its place in the file."""
        slot = self.slots[cid]
        run = pieces if pieces is not None else range(piece_count(slot.nbytes, self.piece))
        piece_extent(slot.nbytes, self.piece, run)  # checks the run
        if self.piece <= 0:
            return [(0, slot)]
        out = []
        for k in run:
            start = k * self.piece
            out.append((k, _Slot(slot.offset + start, min(self.piece, slot.nbytes - start))))
        return out


def _close_fds(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


def _per_list(
    lists: Sequence[str], chunk_nbytes: Mapping[int, int] | Mapping[str, Mapping[int, int]]
) -> dict[str, dict[int, int]]:
    """``chunk_nbytes`` as list -> chunk id -> bytes, checked."""
    names = list(lists)
    if not names or len(set(names)) != len(names):
        raise ValueError(f"lists={names!r}: expected one or more distinct list names")
    keys = list(chunk_nbytes)
    per: dict[str, Mapping[int, int]]
    if keys and all(isinstance(k, str) for k in keys):
        per = dict(chunk_nbytes)  # type: ignore[arg-type]
        if set(per) != set(names):
            raise ValueError(f"chunk_nbytes has sizes for lists {sorted(per)}, expected exactly {sorted(names)}")
    else:
        per = {name: chunk_nbytes for name in names}  # type: ignore[misc]
    out: dict[str, dict[int, int]] = {}
    for name in names:
        chunk_file_name(0, name)  # checks the name can be part of a file name
        sizes: dict[int, int] = {}
        for cid, nbytes in per[name].items():
            if not isinstance(cid, int) or cid < 0 or not isinstance(nbytes, int) or nbytes <= 0:
                raise ValueError(
                    f"chunk_nbytes of list {name!r}: chunk {cid!r} -> {nbytes!r}: expected chunk id >= 0 -> bytes > 0"
                )
            sizes[cid] = nbytes
        out[name] = sizes
    return out


class ChunkFiles:
    """This rank's chunk files in one directory (see the module docstring); make one with :meth:`create`."""

    device = "cpu"
    """Chunks are read into and written from host buffers."""

    def __init__(
        self, claim: DirectoryClaim, files: dict[str, _ListFile], direct_fallback: str | None, verify: bool = True
    ) -> None:
        self._claim = claim
        self._verify = verify
        self._files = files
        self._direct_fallback = direct_fallback
        self._state = FilesState.OPEN
        self._lock = threading.Lock()  # guards the counters and the direct-I/O switch
        self._bytes_read = self._bytes_written = self._reads = self._writes = self._fallbacks = 0
        self._read_s = self._write_s = 0.0
        # the check threads (Note [chunk checks]), one per direction: a read's pieces do not
        # queue behind a write's whole chunk
        self._checks = {
            write: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"chunkstar-disk-check-{'w' if write else 'r'}")
            for write in (False, True)
        } if verify else {}  # fmt: skip
        self._fds = [fd for f in files.values() for fd in (f.fd, f.direct_fd) if fd >= 0]
        # descriptors (and with them the rank lock) must not outlive a ChunkFiles dropped unclosed
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)
        self._claim_finalizer = weakref.finalize(self, claim.close)

    @classmethod
    def create(
        cls,
        directory: str | os.PathLike[str],
        *,
        run_tag: str,
        rank: int,
        lists: Sequence[str],
        chunk_nbytes: Mapping[int, int] | Mapping[str, Mapping[int, int]],
        on_stale: OnStale = "refuse",
        direct: bool = True,
        verify: bool = True,
        piece_nbytes: Mapping[str, int] | None = None,
    ) -> ChunkFiles:
        """Claim ``directory`` for this rank (Note [directory claim]: stale files are refused or
        wiped as ``on_stale`` says), check the free space, preallocate one file per list and
        write the manifest. ``chunk_nbytes``: chunk id -> bytes of this rank's chunks, the same
        for every list, or list -> (chunk id -> bytes) when the lists differ. ``direct``: use
        ``O_DIRECT`` where the filesystem allows it (faster here: Note [direct I/O]); ``verify``:
        check every read against the sum of the chunk's last write (Note [chunk checks]);
        ``piece_nbytes``: list -> bytes per piece, a multiple of 4096 (Note [chunk pieces]; a
        list not named, or 0: a chunk is one piece)."""
        sizes = _per_list(lists, chunk_nbytes)
        pieces = dict(piece_nbytes or {})
        for name, n in pieces.items():
            if name not in sizes or not isinstance(n, int) or n < 0 or n % ALIGNMENT:
                raise ValueError(
                    f"piece_nbytes[{name!r}] = {n!r}: expected a list on disk and a multiple of {ALIGNMENT} bytes (0: none)"
                )
        root = Path(directory)
        files: dict[str, _ListFile] = {}
        for name, per_chunk in sizes.items():
            slots, offset = {}, 0
            for cid in sorted(per_chunk):
                slots[cid] = _Slot(offset, per_chunk[cid])
                offset += round_up(per_chunk[cid])
            files[name] = _ListFile(name, root / chunk_file_name(rank, name), offset, slots, pieces.get(name, 0))
        needed = sum(f.size for f in files.values())

        claim = claim_directory(root, run_tag=run_tag, rank=rank, on_stale=on_stale)
        opened: list[int] = []
        made: list[Path] = []
        try:
            free = shutil.disk_usage(root).free
            if needed > free:  # before anything is allocated
                raise DiskFullError(root, needed, free)
            remaining = needed
            for f in files.values():
                f.fd = os.open(f.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                opened.append(f.fd)
                made.append(f.path)
                _preallocate(f, remaining)
                remaining -= f.size
                advise(f.fd, 0, 0, FADV_SEQUENTIAL)
            fallback = None if direct else "direct=False"
            if direct:
                fallback = _open_direct(files, opened)
            claim.write_manifest(
                {
                    "alignment": ALIGNMENT,
                    "direct": fallback is None,
                    "lists": {
                        f.name: {
                            "file": f.path.name,
                            "bytes": f.size,
                            "piece_bytes": f.piece,
                            "chunks": {str(c): {"offset": s.offset, "nbytes": s.nbytes} for c, s in f.slots.items()},
                        }
                        for f in files.values()
                    },
                }
            )
        except BaseException as e:
            _close_fds(opened)
            claim.release(delete=made)
            if isinstance(e, OSError):  # a permission, a read-only filesystem, ...
                raise DiskTierError(f"chunkstar disk tier: creating the chunk files in {root} failed: {e}") from e
            raise
        return cls(claim, files, fallback, verify)

    # -- what is stored ----------------------------------------------------------------

    @property
    def state(self) -> FilesState:
        return self._state

    @property
    def directory(self) -> Path:
        return self._claim.directory

    @property
    def rank(self) -> int:
        return self._claim.rank

    @property
    def run_tag(self) -> str:
        return self._claim.run_tag

    @property
    def lists(self) -> tuple[str, ...]:
        return tuple(self._files)

    def chunk_ids(self, list_name: str) -> tuple[int, ...]:
        """This rank's chunk ids stored in ``list_name``, in increasing order."""
        return tuple(self._file(list_name).slots)

    def nbytes(self, list_name: str, chunk_id: int, pieces: range | None = None) -> int:
        """The bytes of one chunk, or of its run of ``pieces`` (Note [chunk pieces]): what
        :meth:`read_into` and :meth:`write_from` move."""
        f, slot = self._slot(list_name, chunk_id)
        return piece_extent(slot.nbytes, f.piece, pieces)[1]

    def piece_nbytes(self, list_name: str) -> int:
        """Bytes per piece of the list's chunks (0: a chunk is one piece)."""
        return self._file(list_name).piece

    def path(self, list_name: str) -> Path:
        return self._file(list_name).path

    @property
    def file_bytes(self) -> int:
        """Bytes preallocated on disk, all lists together (slots padded to 4096)."""
        return sum(f.size for f in self._files.values())

    @property
    def direct(self) -> bool:
        """Whether aligned buffers move by ``O_DIRECT`` (False once the filesystem refused it)."""
        return self._direct_fallback is None

    @property
    def direct_fallback(self) -> str | None:
        """Why direct I/O is off (asked off, or refused by the filesystem), None while it is on."""
        return self._direct_fallback

    @property
    def stats(self) -> DiskIOStats:
        with self._lock:
            return DiskIOStats(
                self._bytes_read,
                self._bytes_written,
                self._read_s,
                self._write_s,
                self._reads,
                self._writes,
                self._fallbacks,
            )

    # -- moving bytes ------------------------------------------------------------------

    def read_into(self, list_name: str, chunk_id: int, dst: torch.Tensor, pieces: range | None = None) -> None:
        """Fill ``dst`` (contiguous, 1-D, CPU, any dtype, exactly the chunk's bytes, or those
        of its run of ``pieces``: Note [chunk pieces]) with those bytes on disk, bit for bit;
        returns once they are in ``dst`` and checked (Note [chunk checks]: bytes other than
        those last written raise ``DiskTierError``)."""
        f, slot = self._slot(list_name, chunk_id)
        span = self._span(f, slot, pieces)
        view = _check_buffer(f, chunk_id, span, dst, "read_into")
        parts = f.pieces(chunk_id, pieces)
        with self._lock:
            lost = next((f.lost[(chunk_id, k)] for k, _ in parts if (chunk_id, k) in f.lost), None)
            want = [f.sums.get((chunk_id, k)) for k, _ in parts]
        if lost is not None:
            raise DiskTierError(
                f"chunkstar disk tier: reading {_where(f, chunk_id, span)}: the chunk is lost: {lost}, so the file "
                f"does not hold its bytes. The run cannot go on from this state: restart from a checkpoint."
            )
        t0 = time.perf_counter()
        try:
            got = self._transfer(f, span, parts, view, is_aligned(dst), write=False)
        except (OSError, EOFError) as e:
            raise self._failure(e, "reading", f, chunk_id, span) from e
        if self._verify:
            for (k, part), w, g in zip(parts, want, got):
                if w is None:
                    w = zeros_sum(part.nbytes)
                if g != w:
                    where = _where(f, chunk_id, part) + (f", piece {k}" if f.piece > 0 else "")
                    raise DiskTierError(
                        f"chunkstar disk tier: reading {where}: its bytes on disk are not the ones "
                        f"written there (crc32 {g:#010x}, expected {w:#010x}): something other than this run changed "
                        f"the file (a truncation, a write), or the disk returned bad data. The run cannot go on from "
                        f"this state: restart from a checkpoint, and leave the disk tier's directory to chunkstar."
                    )
        dt = time.perf_counter() - t0
        with self._lock:
            self._bytes_read += span.nbytes
            self._read_s += dt
            self._reads += 1

    def write_from(self, list_name: str, chunk_id: int, src: torch.Tensor, pieces: range | None = None) -> None:
        """Write ``src`` (contiguous, 1-D, CPU, exactly the chunk's bytes, or those of its run
        of ``pieces``) to its place in the chunk's slot; returns once the bytes are on the
        device, out of the page cache, so ``src`` may be reused."""
        f, slot = self._slot(list_name, chunk_id)
        span = self._span(f, slot, pieces)
        view = _check_buffer(f, chunk_id, span, src, "write_from")
        parts = f.pieces(chunk_id, pieces)
        t0 = time.perf_counter()
        try:
            written = self._transfer(f, span, parts, view, is_aligned(src), write=True)
        except BaseException as e:
            error = self._failure(e, "writing", f, chunk_id, span) if isinstance(e, (OSError, EOFError)) else e
            with self._lock:  # some of the new bytes may be on disk, or none: Note [chunk checks]
                for k, _ in parts:
                    f.lost[(chunk_id, k)] = f"its last write failed ({error})"
            if error is e:
                raise
            raise error from e
        dt = time.perf_counter() - t0
        with self._lock:
            for (k, _), value in zip(parts, written):
                f.sums[(chunk_id, k)] = value
                f.lost.pop((chunk_id, k), None)  # this write supersedes one that did not complete
            self._bytes_written += span.nbytes
            self._write_s += dt
            self._writes += 1

    def mark_lost(self, list_name: str, chunk_id: int, why: str, pieces: range | None = None) -> None:
        """Record that the chunk's bytes (or those of its run of ``pieces``) did not reach its
        slot (a write-behind that was not done: ``why``); reading them raises until a write
        completes (Note [chunk checks]). A piece lost already keeps the first reason."""
        f, _ = self._slot(list_name, chunk_id)
        parts = f.pieces(chunk_id, pieces)
        with self._lock:
            for k, _ in parts:
                f.lost.setdefault((chunk_id, k), why)

    @staticmethod
    def _span(f: _ListFile, slot: _Slot, pieces: range | None) -> _Slot:
        """Where the run ``pieces`` of the chunk in ``slot`` lies in the file."""
        start, n = piece_extent(slot.nbytes, f.piece, pieces)
        return _Slot(slot.offset + start, n)

    def _transfer(
        self, f: _ListFile, span: _Slot, parts: list[tuple[int, _Slot]], view: memoryview, aligned: bool, *, write: bool
    ) -> list[int]:
        """Move the bytes of ``span`` (the run of pieces ``parts``) and return each piece's
        checksum, summed on a check thread beside the transfer (Note [chunk checks]): a
        write's pieces whole, a read's a few MiB at a time."""
        if not aligned and self._direct_fallback is None and f.direct_fd >= 0:
            with self._lock:
                self._fallbacks += 1
        if not self._verify:
            self._move(f, span, view, aligned, write=write)
            return [0] * len(parts)
        sums = [ChunkSum(self._checks[write]) for _ in parts]
        try:
            if write:
                for total, (_, part) in zip(sums, parts):
                    a = part.offset - span.offset
                    total.add(view[a : a + part.nbytes])
                self._move(f, span, view, aligned, write=True)
            else:
                for total, (_, part) in zip(sums, parts):
                    a = part.offset - span.offset
                    for start in range(a, a + part.nbytes, _CHECK_PIECE):
                        piece = view[start : min(start + _CHECK_PIECE, a + part.nbytes)]
                        self._move(f, _Slot(span.offset + start, len(piece)), piece, aligned, write=False)
                        total.add(piece)
        finally:
            # on every path: no check may read the buffer once the caller has it back
            values = [total.value() for total in sums]
        return values

    def _move(self, f: _ListFile, slot: _Slot, view: memoryview, aligned: bool, *, write: bool) -> None:
        if aligned and self._direct_fallback is None and f.direct_fd >= 0:
            try:
                _move_direct(f.direct_fd, slot, view, write=write)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                reason = f"{f.path}: O_DIRECT transfers refused ({e.strerror}); buffered from then on"
                with self._lock:  # the filesystem took the open flag but refuses the I/O
                    self._direct_fallback = reason
        if write:
            pwrite_full(f.fd, view, slot.offset)
            write_back(f.fd, slot.offset, slot.nbytes)  # the pages must be clean to be dropped
        else:
            advise(f.fd, slot.offset, slot.nbytes, FADV_WILLNEED)
            pread_full(f.fd, view, slot.offset)
        advise(f.fd, slot.offset, slot.nbytes, FADV_DONTNEED)

    # -- lookups and errors --------------------------------------------------------------

    def _file(self, list_name: str) -> _ListFile:
        if self._state is not FilesState.OPEN:
            raise DiskTierError(f"chunkstar disk tier: the chunk files in {self.directory} are {self._state.value}")
        try:
            return self._files[list_name]
        except KeyError:
            on_disk = list(self._files)
            raise ValueError(f"list {list_name!r} is not on disk here; the lists on disk are {on_disk}") from None

    def _slot(self, list_name: str, chunk_id: int) -> tuple[_ListFile, _Slot]:
        f = self._file(list_name)
        try:
            return f, f.slots[chunk_id]
        except KeyError:
            ids = list(f.slots)
            shown = ", ".join(map(str, ids[:16])) + (", ..." if len(ids) > 16 else "")
            raise ValueError(
                f"chunk {chunk_id!r} of list {list_name!r} is not stored by rank {self.rank} (its chunks: {shown})"
            ) from None

    def _failure(self, e: BaseException, doing: str, f: _ListFile, cid: int, slot: _Slot) -> DiskTierError:
        where = _where(f, cid, slot)
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return DiskFullError(f.path, slot.nbytes, _free_bytes(f.path), where=where)
        if isinstance(e, EOFError):
            return DiskTierError(
                f"chunkstar disk tier: {doing} {where}: the file is shorter than its manifest says ({e})"
            )
        return DiskTierError(f"chunkstar disk tier: {doing} {where} failed: {e}")

    # -- the end -------------------------------------------------------------------------

    def close(self) -> None:
        """Close the files and release the rank lock, leaving the files on disk; idempotent."""
        if self._state is FilesState.OPEN:
            self._state = FilesState.CLOSED
            self._stop_checks()
            self._finalizer()
            self._claim_finalizer()

    def remove(self) -> None:
        """Delete this rank's files, manifest and lock (a clean end), then close; idempotent."""
        if self._state is FilesState.REMOVED:
            return
        if self._state is FilesState.CLOSED:
            raise DiskTierError(
                f"chunkstar disk tier: remove() after close(): the lock on {self.directory} is released, so "
                f"another run may own those files now; delete them by hand if they are this run's"
            )
        self._stop_checks()
        self._finalizer()
        self._state = FilesState.REMOVED
        self._claim.release(delete=[f.path for f in self._files.values()])

    def _stop_checks(self) -> None:
        for pool in self._checks.values():
            pool.shutdown(wait=True)

    def __enter__(self) -> ChunkFiles:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # The files cannot be reopened (a cache, not a checkpoint): leaving them would only
        # cost disk space and a stale-files refusal at the next start.
        self.remove()

    def __repr__(self) -> str:
        return (
            f"ChunkFiles({self.directory}, rank={self.rank}, lists={[str(n) for n in self._files]}, "
            f"bytes={self.file_bytes}, direct={self.direct}, state={self.state.value})"
        )


def _where(f: _ListFile, cid: int, slot: _Slot) -> str:
    return f"chunk {cid} of list {f.name!r} ({slot.nbytes} bytes at offset {slot.offset} of {f.path})"


def _check_buffer(f: _ListFile, cid: int, slot: _Slot, t: torch.Tensor, op: str) -> memoryview:
    nbytes = t.numel() * t.element_size()
    if t.dim() != 1 or nbytes != slot.nbytes or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"{op}: chunk {cid} of list {f.name!r} is {slot.nbytes} bytes; expected a contiguous 1-D CPU tensor "
            f"of exactly that, got shape {tuple(t.shape)} of {t.dtype} ({nbytes} bytes) on {t.device}, "
            f"contiguous: {t.is_contiguous()}"
        )
    return byte_view(t)


def _move_direct(fd: int, slot: _Slot, view: memoryview, *, write: bool) -> None:
    """One chunk by O_DIRECT: the aligned body straight to or from the buffer, the tail (a
    chunk of a size that is not a multiple of 4096) through an aligned block of padding."""
    body = slot.nbytes - slot.nbytes % ALIGNMENT
    tail = slot.nbytes - body
    if body:
        (pwrite_full if write else pread_full)(fd, view[:body], slot.offset)
    if tail:
        block = aligned_empty(ALIGNMENT)  # 1-D uint8 host, 4096-aligned
        bview = byte_view(block)
        if write:
            block.zero_()
            bview[:tail] = view[body:]
            pwrite_full(fd, bview, slot.offset + body)
        else:
            pread_full(fd, bview, slot.offset + body)  # the slot is padded: the block is in the file
            view[body:] = bview[:tail]


def _free_bytes(path: Path) -> int:
    try:
        return shutil.disk_usage(path.parent).free
    except OSError:
        return -1


def _preallocate(f: _ListFile, still_needed: int) -> None:
    """Reserve the file's blocks now, so that a full disk shows at start-up, not mid-step."""
    if f.size == 0:
        return
    try:
        os.posix_fallocate(f.fd, 0, f.size)
    except OSError as e:
        if e.errno in _NO_SPACE:
            raise DiskFullError(f.path, still_needed, _free_bytes(f.path)) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise DiskTierError(f"chunkstar disk tier: allocating {f.size} bytes for {f.path} failed: {e}") from e
        # a filesystem without fallocate: a sparse file (a full disk then shows at the first write)
        os.ftruncate(f.fd, f.size)


def _open_direct(files: dict[str, _ListFile], opened: list[int]) -> str | None:
    """Open an O_DIRECT descriptor beside each buffered one; the reason if it cannot be done."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    for f in files.values():
        try:
            f.direct_fd = os.open(f.path, os.O_RDWR | O_DIRECT | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise DiskTierError(f"chunkstar disk tier: opening {f.path} for direct I/O failed: {e}") from e
            for g in files.values():
                if g.direct_fd >= 0:
                    opened.remove(g.direct_fd)
                    os.close(g.direct_fd)
                    g.direct_fd = -1
            return f"the filesystem of {f.path} refused O_DIRECT ({e.strerror})"
        opened.append(f.direct_fd)
    return None
