"""Who may use a disk-tier directory: rank locks, manifests, and what to do with stale files.

Mechanism only: :class:`~chunkstar.disk.files.ChunkFiles` claims its rank's
files here before it creates them, and gives them back here at the end. This
module does not read or write chunk data, and the choice between refusing and
wiping stale files is the caller's (config ``"disk": {"on_stale": ...}``).

Note [directory claim]: one directory may serve the ranks of one run (each
rank its own files, all named ``chunkstar-r<rank>...``), never two live runs.

* Every rank holds ``chunkstar-r<rank>.lock`` with ``fcntl.flock`` for its
  files' life; the lock file says who holds it (pid, run tag, host), so a
  second process can be told who is in its way. The kernel drops a flock when
  its holder dies, so a crashed run leaves its files but never its lock.
* Claims, wipes and removals happen under a short directory lock
  (``chunkstar-disk.lock``), one process at a time: a rank scanning the
  directory never sees a sibling half-way through writing its lock's holder,
  and two ranks never wipe the same stale files.
* Stale files are chunkstar's files that this run did not write: any of this
  rank's (nobody holds its lock: we do), and another rank's whose lock nobody
  holds and whose manifest names another run tag (a crashed or earlier run).
  Another rank's files whose lock is held by a live process of another run tag
  are an error whatever ``on_stale`` says: wiping them would pull the disk from
  under a running job. ``refuse`` raises :class:`DiskTierError` naming the
  files, the run that wrote them (from its manifest) and the fix; ``wipe``
  deletes them. Files whose names chunkstar does not recognise are never
  touched.
* A lock file is only unlinked by the process that holds it, and whoever
  acquires a lock checks that its path still names the file it locked, so an
  unlinked lock never grants two processes the same claim.

The files are a cache of one run's optimizer state, not a checkpoint: nothing
here reopens them, and nothing is fsynced. A directory deleted under a run
(its files open, their space held until they close) leaves the end of the run
nothing to delete: releasing the claim then closes the lock and warns, naming
the directory, rather than failing an ``engine.close()`` on a lock file it
cannot create.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import socket
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping

from chunkstar.disk.errors import DiskTierError
from chunkstar.errors import _fmt as _fmt_bytes

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "OnStale",
    "DirectoryClaim",
    "chunk_file_name",
    "claim_directory",
]

FORMAT = "chunkstar-disk-tier"
"""The manifest's ``format`` field."""
FORMAT_VERSION = 1

OnStale = Literal["refuse", "wipe"]
ON_STALE_CHOICES: tuple[OnStale, ...] = ("refuse", "wipe")

_DIR_LOCK = "chunkstar-disk.lock"
_DIR_LOCK_TIMEOUT_S = 30.0  # held for a directory scan only: far longer means a hung process
_RANK_FILE = re.compile(r"^chunkstar-r(?P<rank>\d+)(?:\.lock|\.manifest\.json|-(?P<list>[A-Za-z0-9_]+)\.chunks)$")
_TMP_MANIFEST = re.compile(r"^\.chunkstar-r(?P<rank>\d+)\.manifest\.json\.[0-9a-f]+\.tmp$")
_LIST_NAME = re.compile(r"^[A-Za-z0-9_]+$")
_FIX = (
    'set config "disk": {"on_stale": "wipe"} to have chunkstar delete them (it deletes only its own '
    "files), or delete them yourself"
)


def _lock_name(rank: int) -> str:
    return f"chunkstar-r{rank}.lock"


def _manifest_name(rank: int) -> str:
    return f"chunkstar-r{rank}.manifest.json"


def chunk_file_name(rank: int, list_name: str) -> str:
    """The file of one (rank, list): ``chunkstar-r<rank>-<list>.chunks``."""
    if not _LIST_NAME.match(list_name):
        raise ValueError(f"list name {list_name!r}: expected letters, digits and '_' only (it is part of a file name)")
    return f"chunkstar-r{rank}-{list_name}.chunks"


def _try_flock(path: Path, *, create: bool) -> int | None:
    """An fd holding an exclusive flock on ``path``, or None if another open file holds
    it. Raises FileNotFoundError if ``path`` is missing and not ``create``."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        # the holder we waited for unlinked it: what we locked is no longer the lock
        os.close(fd)
        if not create:
            raise FileNotFoundError(errno.ENOENT, "lock file was removed", str(path))


def _unlink_if_unused_dir_lock(directory: Path) -> None:
    """Delete the directory lock once no chunkstar rank file is left (called holding it)."""
    if not _scan(directory):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(directory / _DIR_LOCK)


@contextlib.contextmanager
def _directory_locked(directory: Path, *, tidy: bool = False) -> Iterator[None]:
    """Hold the directory lock (Note [directory claim]); ``tidy``: delete it on the way
    out if no chunkstar file is left, so a clean end leaves a clean directory."""
    path = directory / _DIR_LOCK
    deadline = time.monotonic() + _DIR_LOCK_TIMEOUT_S
    while (fd := _try_flock(path, create=True)) is None:
        if time.monotonic() > deadline:
            raise DiskTierError(
                f"chunkstar disk tier: another process has held {path} for more than {_DIR_LOCK_TIMEOUT_S:.0f} s "
                f"(it is held only while a run claims or removes its files): is a chunkstar process hung there?"
            )
        time.sleep(0.01)
    try:
        yield
    finally:
        try:
            if tidy:
                _unlink_if_unused_dir_lock(directory)
        finally:
            os.close(fd)  # releases the flock


def _scan(directory: Path) -> dict[int, list[str]]:
    """chunkstar's rank files in ``directory``, by rank (names only, sorted)."""
    found: dict[int, list[str]] = {}
    for name in sorted(os.listdir(directory)):
        m = _RANK_FILE.match(name) or _TMP_MANIFEST.match(name)
        if m is not None:
            found.setdefault(int(m.group("rank")), []).append(name)
    return found


def _read_json(path: Path) -> dict[str, Any]:
    """A small JSON object, or {} for a missing, empty or unreadable file (a crash mid-write)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 20) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _who(info: Mapping[str, Any]) -> str:
    if not info:
        return "an unknown run (no readable manifest or lock record)"
    return (
        f"run tag {info.get('run_tag')!r} (pid {info.get('pid')} on host {info.get('host')}, "
        f"since {info.get('created') or info.get('since')})"
    )


def _held_message(path: Path, holder: Mapping[str, Any], run_tag: str, rank: int) -> str:
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        return (
            f"chunkstar disk tier: {path} is held by another engine of this very process ({_who(holder)}), "
            f"still open: two live runs must not share a disk-tier directory, and each rank of a run needs its "
            f"own files. To fix: call close() on that engine (or drop every reference to it) before this one "
            f"uses {path.parent}, or give this one a directory of its own."
        )
    return (
        f"chunkstar disk tier: {path} is locked by another live process: {_who(holder)}. This run "
        f"(run tag {run_tag!r}, rank {rank}, pid {os.getpid()}) cannot use {path.parent}: two live runs must "
        f"not share a disk-tier directory, and each rank of a run needs its own files. To fix: give this run "
        f"a directory of its own, or stop the other process."
    )


@dataclass
class _Stale:
    rank: int
    names: list[str]
    writer: dict[str, Any]  # the manifest of whoever wrote them, {} if unreadable
    lock_fd: int | None = None  # held while we decide, so nobody claims them meanwhile


def _describe(directory: Path, stale: list[_Stale]) -> str:
    lines = []
    for s in stale:
        sizes = []
        for name in s.names[:12]:
            try:
                sizes.append(f"{name} ({_fmt_bytes(os.stat(directory / name).st_size)})")
            except OSError:
                sizes.append(name)
        more = f", and {len(s.names) - 12} more" if len(s.names) > 12 else ""
        lines.append(f"  rank {s.rank}: {', '.join(sizes)}{more}; written by {_who(s.writer)}")
    return "\n".join(lines)


@dataclass
class DirectoryClaim:
    """This process's claim on its rank's files in ``directory``: the rank lock, held until released."""

    directory: Path
    rank: int
    run_tag: str
    _lock_fd: int | None = field(repr=False)

    @property
    def held(self) -> bool:
        return self._lock_fd is not None

    def write_manifest(self, body: Mapping[str, Any]) -> Path:
        """Write this rank's manifest (format, version, run tag, pid, host, created, and
        ``body``) atomically: a reader sees the old one or the new one, never half."""
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "run_tag": self.run_tag,
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "created": _now(),
            "note": "a cache of one run's optimizer state, not a checkpoint: delete it when no run uses it",
            **body,
        }
        path = self.directory / _manifest_name(self.rank)
        tmp = self.directory / f".{path.name}.{uuid.uuid4().hex}.tmp"
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, path)
        return path

    def release(self, *, delete: list[Path]) -> None:
        """Delete ``delete`` and this rank's manifest and lock file (a clean end, or a
        creation that failed half-way), then release the lock; idempotent."""
        if self._lock_fd is None:
            return
        try:
            with _directory_locked(self.directory, tidy=True):
                for path in [*delete, self.directory / _manifest_name(self.rank)]:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.directory / _lock_name(self.rank))  # unlinked while held: Note [directory claim]
        except FileNotFoundError:
            if self.directory.is_dir():
                raise
            warnings.warn(
                f"chunkstar disk tier: the directory {self.directory} no longer exists (it was deleted while the run "
                "used it): its chunk files went with it, so there was nothing left to delete",
                RuntimeWarning,
                stacklevel=2,
            )
        finally:
            self.close()

    def close(self) -> None:
        """Release the lock and keep the files (the next run finds them stale); idempotent."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)


def claim_directory(directory: str | os.PathLike[str], *, run_tag: str, rank: int, on_stale: OnStale) -> DirectoryClaim:
    """Claim ``rank``'s files in ``directory`` for run ``run_tag``, refusing or wiping stale
    files as ``on_stale`` says (Note [directory claim]); the claim holds the rank lock."""
    if on_stale not in ON_STALE_CHOICES:
        raise ValueError(f"on_stale={on_stale!r}: expected one of {', '.join(ON_STALE_CHOICES)}")
    if rank < 0:
        raise ValueError(f"rank={rank}: expected >= 0")
    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DiskTierError(f"chunkstar disk tier: cannot create the directory {root}: {e}") from e
    try:
        return _claim(root, run_tag, rank, on_stale)
    except OSError as e:  # a filesystem without flock (some network ones), a permission, ...
        raise DiskTierError(f"chunkstar disk tier: cannot claim {root} for rank {rank}: {e}") from e


def _claim(root: Path, run_tag: str, rank: int, on_stale: OnStale) -> DirectoryClaim:
    with _directory_locked(root, tidy=True):
        lock_path = root / _lock_name(rank)
        existed = lock_path.exists()
        fd = _try_flock(lock_path, create=True)
        if fd is None:
            raise DiskTierError(_held_message(lock_path, _read_json(lock_path), run_tag, rank))
        claim = DirectoryClaim(root, rank, run_tag, fd)
        stale: list[_Stale] = []
        try:
            os.ftruncate(fd, 0)
            holder = {"pid": os.getpid(), "run_tag": run_tag, "host": socket.gethostname(), "since": _now()}
            os.pwrite(fd, json.dumps(holder).encode(), 0)
            for r, names in _scan(root).items():
                writer = _read_json(root / _manifest_name(r))
                if r == rank:  # ours to claim, so anything already here is stale
                    names = [n for n in names if n != lock_path.name or existed]
                    if names:
                        stale.append(_Stale(r, names, writer))
                    continue
                other = _find_stale_rank(root, r, names, writer, run_tag, rank)
                if other is not None:
                    stale.append(other)
            if stale and on_stale == "refuse":
                raise DiskTierError(
                    f"chunkstar disk tier: the directory {root} holds chunkstar files that this run (run tag "
                    f"{run_tag!r}, rank {rank}) did not write, left by a run that crashed or ended without "
                    f"removing them:\n{_describe(root, stale)}\nThey are a cache of that run's optimizer state, "
                    f"not a checkpoint. To fix: {_FIX}."
                )
            for s in stale:
                for name in s.names:
                    if name.endswith(".lock"):
                        continue
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(root / name)
                if s.lock_fd is not None:  # unlinked while held: Note [directory claim]
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(root / _lock_name(s.rank))
        except BaseException:
            if not existed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock_path)
            claim.close()
            raise
        finally:
            for s in stale:
                if s.lock_fd is not None:
                    os.close(s.lock_fd)
    return claim


def _find_stale_rank(
    root: Path, r: int, names: list[str], writer: dict[str, Any], run_tag: str, rank: int
) -> _Stale | None:
    """Another rank's files: stale (returned with their lock held), this run's (None), or
    a live other run's (DiskTierError)."""
    lock_path = root / _lock_name(r)
    fd: int | None = None
    try:
        fd = _try_flock(lock_path, create=False)
    except FileNotFoundError:  # no lock: a wipe or removal that stopped half-way
        pass
    else:
        if fd is None:
            holder = _read_json(lock_path)
            if holder.get("run_tag") == run_tag:
                return None  # a live sibling rank of this run
            raise DiskTierError(_held_message(lock_path, holder, run_tag, rank))
    if writer.get("run_tag") == run_tag:  # a rank of this run that has closed its files
        if fd is not None:
            os.close(fd)
        return None
    return _Stale(r, names, writer, fd)
