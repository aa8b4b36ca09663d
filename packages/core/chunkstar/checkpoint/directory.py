"""A checkpoint directory: atomic files, one step directory per save, and the pointer
that publishes a save once every rank has written its shard.

Note [atomic files]: a shard (the pointer, merge's output) is written to a
temporary file ``.NAME.<random>.tmp`` in the same directory (NAME cut short
where the whole would pass the filesystem's name limit), fsynced, renamed
over the final name with ``os.replace`` (atomic on POSIX), and the directory is
fsynced, so a reader sees the old file or the new one, never half of one. A
write that fails removes its temporary file; one killed leaves it behind, and
the save that removes its directory (or, in the flat layout, the next save or
load of the same file) removes it. Anything that cannot be read (a truncated
shard, a foreign file named like one) raises :class:`CheckpointError` naming
the file.

Note [multi-rank checkpoints]: one atomic file per rank does not make a save of
several ranks atomic: a rank killed after one save while another writes the
next leaves shards of two steps side by side, and no checkpoint is left whole.
So, as torch.distributed.checkpoint and DeepSpeed's ``latest`` tag do, every save
writes into a directory of its own and is published once complete:

    DIR/latest                       "step-6-<16 hex digits>\\n", replaced atomically by rank 0
    DIR/step-6-<token>/rank{r}-of-{W}.safetensors

:func:`save_step` runs, on every rank:

1. *prepare*: check ``DIR`` (a directory, or creatable) and build this rank's
   shard in memory;
2. all-gather ``[ok, token, step]``: rank 0's random token and step name the step
   directory (the token, because two saves at one step, say two before any step
   or around a ``load_state_dict``, must not write into the published one);
3. *write*: the shard into ``DIR/step-N-<token>/`` (Note [atomic files]);
4. all-gather ``[ok]``: a rank reports ok only once its shard is durable;
5. *publish* (rank 0, only if every rank wrote): fsync ``DIR`` (the step
   directory's entry), then replace ``DIR/latest`` atomically;
6. all-gather ``[ok]`` of rank 0's publication;
7. all-gather ``[ok]``: every rank reads ``DIR/latest`` and finds the new save
   there (Note [one folder for every rank]);
8. *clean up* (rank 0): remove every other step directory (the superseded save,
   saves that never finished) and flat shards of an earlier version.

Note [one folder for every rank]: a checkpoint is one folder every rank sees,
on one filesystem: rank 0 alone publishes ``latest`` and every rank loads
through it. Given a folder that is local to each node (the same path on
machines that do not share it), every rank would write its shard and report
the save done, and the checkpoint would be found missing or stale only when a
load is tried. So each rank reads the pointer back once rank 0 has published
it, and a rank that does not find the new save there fails the save on every
rank, saying the folder must be shared.

A failure in a rank (a full disk, a read-only directory, metadata that cannot be
saved, gradients no step consumed) becomes its ok = 0 at the next all-gather, so
every rank raises (the failing one its own :class:`CheckpointError`, the others
one naming it) and none waits alone. What a failed save wrote goes at once,
since nothing will ever read it and its space is what the next save needs (a
full disk kept full by an unpublished shard made every later save fail): after
step 4 each rank removes its shard, after step 5 (a disk full as the pointer
is written) rank 0 the whole step directory, unless ``latest`` names it
already (the rename went through, only the fsync after it failed). A rank that
dies makes the others' next all-gather raise
:class:`~chunkstar.distributed.comm.DistributedError` (under gloo at once, under
NCCL see Note [failures under NCCL]). A kill at any point leaves a loadable
checkpoint: before step 5's rename, ``latest`` names the previous save, whose
directory nothing touches; the new directory is ignored (never published) and
removed by the next save. The rename itself is atomic, and what it publishes is
complete: every shard was durable before step 4 let rank 0 go on. After it,
``latest`` names the new save, and the old directories left by a kill during
step 7 are ignored, then removed by the next save. Readers (:func:`resolve`)
follow ``latest`` only; a directory without it is read flat (shards directly in
``DIR``, as versions before step directories wrote them, or a step directory
named directly), so existing checkpoints load and merge as before, and the first
save into such a directory supersedes its flat shards.

Every rank must see the same ``DIR`` (a shared filesystem, as for
``merge-checkpoint``): rank 0 alone publishes and cleans up. With one process the
all-gathers are no-ops. This module moves files; it knows nothing of what a shard
holds.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import secrets
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from chunkstar.checkpoint.shard import SHARD_NAME, CheckpointError, check_regular, os_error

if TYPE_CHECKING:
    from chunkstar.distributed.comm import Comm

__all__ = ["POINTER", "fsync_dir", "remove_leftovers", "resolve", "save_step", "write_atomic", "write_error"]

POINTER = "latest"
_STEP_DIR = re.compile(r"step-(\d+)-([0-9a-f]{16})")


# ---------------------------------------------------------------------- files (Note [atomic files])
_TMP_SUFFIX = 18  # ".<12 hex digits>.tmp"
_TMP_NAME_MAX = 255  # bytes in a file name on every common filesystem (NAME_MAX)


def _tmp_prefix(path: Path) -> str:
    """``.NAME``, NAME cut (at a character) so that ``.NAME.<12 hex>.tmp`` fits a file name."""
    name = path.name
    while len(os.fsencode(name)) + 1 + _TMP_SUFFIX > _TMP_NAME_MAX:
        name = name[:-1]
    return f".{name}"


def _leftovers(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{glob.escape(_tmp_prefix(path))}.*.tmp"))


def remove_leftovers(path: Path) -> None:
    """Remove the temporary files a killed write of ``path`` left (best effort: a read-only
    directory keeps them, and they are never read)."""
    for f in _leftovers(path):
        with contextlib.suppress(OSError):
            f.unlink(missing_ok=True)


def fsync_dir(directory: Path) -> None:
    if not hasattr(os, "O_DIRECTORY"):  # pragma: no cover - Windows cannot open a directory
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[str], None]) -> None:
    """``write(tmp)`` a temporary file next to ``path``, make it durable, rename it to ``path``."""
    tmp = path.with_name(f"{_tmp_prefix(path)}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        write(str(tmp))
        # the permissions of any new file (safetensors creates its files 0600)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        fd = os.open(tmp, os.O_RDWR)  # the writer closed it; fsync its data through a new descriptor
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_error(path: Path, e: Exception, kept: str) -> CheckpointError | None:
    """The CheckpointError for a failed write of ``path`` (an OSError, or safetensors' error
    for one), or None when ``e`` is something else (a bug: it travels as it is)."""
    from safetensors import SafetensorError

    if not isinstance(e, (OSError, SafetensorError)):
        return None
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    error = CheckpointError(
        f"{path}: cannot write it ({type(e).__name__}: {why}): the disk may be full, the directory read-only or "
        f"a part of the path a file; {kept}"
    )
    error.__cause__ = e
    return error


# ---------------------------------------------------------------------- reading (Note [multi-rank checkpoints])
def resolve(directory: Path) -> Path:
    """The directory whose shards a load or merge of ``directory`` reads: the step directory
    that ``latest`` names, or ``directory`` itself where there is no ``latest`` (flat)."""
    try:
        if not directory.is_dir():
            raise CheckpointError(f"{directory}: no such checkpoint directory")
    except OSError as e:  # a name too long, a folder that cannot be searched
        raise os_error(directory, e, "read the checkpoint directory") from e
    pointer = directory / POINTER
    if not os.path.lexists(pointer):
        unpublished = sorted(f.name for f in directory.iterdir() if _STEP_DIR.fullmatch(f.name))
        if unpublished and not any(SHARD_NAME.fullmatch(f.name) for f in directory.iterdir()):
            raise CheckpointError(
                f"{directory}: no checkpoint was published here, only saves that did not finish ({', '.join(unpublished[:3])}"
                f"{' ...' if len(unpublished) > 3 else ''}: every rank must write its shard before one is): save again"
            )
        return directory
    check_regular(pointer, "the pointer to the latest save")
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{pointer}: cannot read the pointer to the latest save ({type(e).__name__}: {e})") from e
    if not _STEP_DIR.fullmatch(name):
        raise CheckpointError(
            f"{pointer}: names {name!r}, not a save's step directory (step-N-<16 hex digits>): the file is damaged; "
            f"point it at one of the step-* directories in {directory}, or save again"
        )
    target = directory / name
    if not target.is_dir():
        raise CheckpointError(
            f"{pointer}: names the save {name!r}, but there is no such directory in {directory}: it was removed or "
            "not copied along; copy the whole checkpoint directory"
        )
    return target


# ---------------------------------------------------------------------- the save protocol
def _prepare(directory: Path) -> None:
    try:
        if directory.exists() and not directory.is_dir():
            raise CheckpointError(f"{directory}: is a file; save_checkpoint writes a directory of per-rank shards")
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise os_error(directory, e, "create the checkpoint directory") from e
        raise CheckpointError(
            f"{directory}: cannot create the checkpoint directory ({type(e).__name__}: {e.strerror or e}): "
            "a part of the path is a file, or a folder above it read-only; give another directory"
        ) from e


def _agree(comm: Comm, device: torch.device, words: list[int], what: str) -> list[list[int]]:
    return comm.all_gather_ints(words, f"the checkpoint save ({what})", device)


def _failed(everyone: list[list[int]]) -> list[int]:
    return [r for r, w in enumerate(everyone) if w[0] == 0]


def save_step(
    comm: Comm,
    device: torch.device,
    directory: Path,
    step: int,
    name: str,
    prepare: Callable[[], Callable[[str], None]],
    extra: Callable[[], tuple[str, Callable[[str], None]] | None] | None = None,
) -> Path:
    """Save this rank's file ``name`` of one save at ``step`` (call on every rank):
    ``prepare()`` builds it and returns its writer (``write(path)``); returns the file,
    published once every rank has written its own (Note [multi-rank checkpoints]).
    ``extra()``, on rank 0, may return one more file of the save, ``(name, writer)``
    (a training loop's own state), written into the same step directory and published
    with the shards, so the two never come from different saves."""
    error: Exception | None = None
    write: Callable[[str], None] | None = None
    more: tuple[str, Callable[[str], None]] | None = None
    try:
        _prepare(directory)
        write = prepare()
        if extra is not None and comm.rank == 0:
            more = extra()
    except Exception as e:  # every rank learns of it at the next all-gather
        error = e
    everyone = _agree(comm, device, [int(error is None), secrets.randbits(62), step], "its step directory")
    if error is not None:
        raise error
    if _failed(everyone):
        raise CheckpointError(f"{directory}: rank(s) {_failed(everyone)} cannot save (see their errors); nothing was saved")
    assert write is not None
    step_dir = directory / f"step-{everyone[0][2]}-{everyone[0][1]:016x}"
    path = step_dir / name
    kept = "the previous checkpoint in the directory, if any, is kept"
    written = path
    try:
        step_dir.mkdir(exist_ok=True)
        write_atomic(path, write)
        if more is not None:
            written = step_dir / more[0]
            write_atomic(written, more[1])
    except Exception as e:
        error = write_error(written, e, kept) or e
    everyone = _agree(comm, device, [int(error is None)], "every shard written")
    if _failed(everyone):
        with contextlib.suppress(OSError):  # never published: give its space back now
            path.unlink(missing_ok=True)
            if more is not None:
                (step_dir / more[0]).unlink(missing_ok=True)
            if comm.rank == 0:
                step_dir.rmdir()  # empty unless another rank has not removed its shard yet (the next save will)
        if error is not None:
            raise error
        raise CheckpointError(
            f"{directory}: rank(s) {_failed(everyone)} could not write their shards (see their errors); this save "
            f"was not published, {kept}"
        )
    if comm.rank == 0:
        try:
            fsync_dir(directory)  # the step directory's entry, before the pointer names it
            pointer = directory / POINTER
            remove_leftovers(pointer)
            write_atomic(pointer, lambda tmp: _write_text(tmp, step_dir.name + "\n"))
        except Exception as e:
            error = write_error(directory / POINTER, e, f"this save was not published, {kept}") or e
    everyone = _agree(comm, device, [int(error is None)], "published")
    if _failed(everyone):
        # every rank is done with the step directory: unless the pointer names it after all (the
        # rename went through, the fsync after it failed), it will never be read, and its space is
        # what the next save needs (Note [multi-rank checkpoints])
        if comm.rank == 0 and _published_name(directory) != step_dir.name:
            shutil.rmtree(step_dir, ignore_errors=True)
        if error is not None:
            raise error
        raise CheckpointError(f"{directory}: rank 0 could not publish this save (see its error); {kept}")
    seen = _published_name(directory)  # Note [one folder for every rank]
    everyone = _agree(comm, device, [int(seen == step_dir.name)], "seen by every rank")
    if _failed(everyone):
        raise CheckpointError(
            f"{directory}: rank(s) {_failed(everyone)} do not see the save rank 0 published there ({step_dir.name}; "
            f"rank {comm.rank} reads {seen or 'no pointer'} in {directory / POINTER}): a checkpoint folder must be one "
            "folder every rank sees, on a filesystem the nodes share, since rank 0 alone publishes it and every rank "
            "loads through it. Save into a shared folder (NFS, Lustre, a mounted bucket with consistent reads)"
        )
    if comm.rank == 0:
        _remove_superseded(directory, step_dir.name)
    return path


def _published_name(directory: Path) -> str | None:
    """The step directory ``latest`` names now (None: none, or it cannot be read)."""
    try:
        check_regular(directory / POINTER, "the pointer to the latest save")
        return (directory / POINTER).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError, CheckpointError):
        return None


def _write_text(path: str, text: str) -> None:
    Path(path).write_text(text, encoding="utf-8")


def _remove_superseded(directory: Path, keep: str) -> None:
    """Every step directory but ``keep``, and the flat shards a version before step
    directories wrote (with their temporary files): ``latest`` names ``keep`` now."""
    for f in directory.iterdir():
        if f.name == keep:
            continue
        if _STEP_DIR.fullmatch(f.name) and f.is_dir() and not f.is_symlink():
            shutil.rmtree(f, ignore_errors=True)
        elif SHARD_NAME.fullmatch(f.name) or (f.name.startswith(".rank") and f.name.endswith(".tmp")):
            with contextlib.suppress(OSError):  # best effort: what is left, the next save removes
                f.unlink()
