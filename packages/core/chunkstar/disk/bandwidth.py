"""How fast a directory's disk writes and reads chunks: a short measurement with a temporary file.

A disk-tier step is bound by disk bandwidth (24 bytes/param of state traffic
per step, docs/design.md, 'The disk tier'), so a planner needs the figure of the disk it is given,
not a published one. :func:`measure_disk_bandwidth` writes and reads back a
temporary file in large sequential blocks with the same primitives as the
chunk files (:mod:`chunkstar.disk.blockio`), defeating the page cache (by
``O_DIRECT``; failing that, by writing back and dropping the pages before
reading), and deletes it. It is a measurement, not a benchmark suite: one
access pattern (sequential, one request at a time, as the I/O lanes do), a
second or less by default.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from chunkstar.disk.blockio import (
    FADV_DONTNEED,
    O_DIRECT,
    advise,
    aligned_empty,
    byte_view,
    pread_full,
    pwrite_full,
    round_up,
)
from chunkstar.disk.errors import DiskFullError, DiskTierError

__all__ = ["DiskBandwidth", "measure_disk_bandwidth"]


@dataclass(frozen=True)
class DiskBandwidth:
    write_bytes_per_s: float
    """Sequential writes of ``block`` bytes into a preallocated file, written through to the device."""
    read_bytes_per_s: float
    """Sequential reads of ``block`` bytes from the device (not the page cache)."""
    direct: bool
    """Whether it was measured with ``O_DIRECT`` (False: buffered, pages written back and dropped)."""
    nbytes: int
    block: int
    directory: str


def measure_disk_bandwidth(
    directory: str | os.PathLike[str], nbytes: int = 256 << 20, block: int = 16 << 20, *, direct: bool = True
) -> DiskBandwidth:
    """Write ``nbytes`` (rounded up to whole ``block``s) to a temporary file in ``directory``
    twice (the first pass turns preallocated blocks into written ones, as a run's first
    step does; the second is timed), read them back (timed), and delete the file."""
    if nbytes <= 0 or block <= 0:
        raise ValueError(f"nbytes={nbytes}, block={block}: expected both > 0")
    block = round_up(block)  # direct I/O moves whole 4096-byte blocks
    nbytes = round_up(nbytes, block)
    root = Path(directory)
    free = shutil.disk_usage(root).free
    if nbytes > free:
        raise DiskFullError(root, nbytes, free, where="a disk bandwidth measurement")
    path = root / f".chunkstar-bandwidth-{uuid.uuid4().hex}.tmp"
    buf = aligned_empty(block)  # 1-D uint8 host, 4096-aligned
    buf.copy_(torch.randint(0, 256, (block,), dtype=torch.uint8))  # not zeros: a disk may compress those
    view = byte_view(buf)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    dfd = -1
    try:
        os.posix_fallocate(fd, 0, nbytes)
        if direct and O_DIRECT:
            try:
                dfd = os.open(path, os.O_RDWR | O_DIRECT | os.O_CLOEXEC)
                pwrite_full(dfd, view, 0)  # some filesystems take the flag and refuse the I/O
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                if dfd >= 0:
                    os.close(dfd)
                dfd = -1
        used_direct = dfd >= 0
        io_fd = dfd if used_direct else fd

        def write_all() -> float:
            t0 = time.perf_counter()
            for off in range(0, nbytes, block):
                pwrite_full(io_fd, view, off)
            if not used_direct:
                os.fdatasync(fd)  # buffered writes count once they are on the device
            return time.perf_counter() - t0

        write_all()
        write_s = write_all()
        advise(fd, 0, nbytes, FADV_DONTNEED)  # clean after the fdatasync: the read must come from the disk
        t0 = time.perf_counter()
        for off in range(0, nbytes, block):
            pread_full(io_fd, view, off)
        read_s = time.perf_counter() - t0
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(path, nbytes, shutil.disk_usage(root).free, where="a disk bandwidth measurement") from e
        raise DiskTierError(f"chunkstar disk tier: measuring the disk bandwidth with {path} failed: {e}") from e
    finally:
        if dfd >= 0:
            os.close(dfd)
        advise(fd, 0, nbytes, FADV_DONTNEED)
        os.close(fd)
        os.unlink(path)
    return DiskBandwidth(nbytes / write_s, nbytes / read_s, used_direct, nbytes, block, str(root))
