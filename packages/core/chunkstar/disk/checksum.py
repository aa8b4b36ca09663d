"""The checksum of a chunk's bytes on disk: zlib's crc32, summed on a check thread beside the transfer.

Mechanism only: :class:`~chunkstar.disk.files.ChunkFiles` sums what it writes
and what it reads and compares the two (Note [chunk checks] there says when);
this module only says what the sum of some bytes is and where it is computed.
It detects, it does not repair, and it is no defence against someone who
changes the files on purpose and their sums with them (the sums live in the
process's memory).

Note [chunk checksum]: crc32 catches every error burst up to 32 bits long
(so every flipped bit) and all but about 2**-32 of any other change (zeroed,
0xFF or truncated regions, blocks moved, the chunk's older bytes after a lost
write), and zlib's crc32 is the standard library's, releasing the GIL while
it runs. It is not free. Measured on the 2-core CI machine beside other load
by ``python benchmarks/disk_checks.py`` (16 chunks of 64 MiB, O_DIRECT, two
runs): crc32 alone on a thread 2.7-3.8 GB/s, 0.26-0.37 CPU seconds per GB;
checked writes 1.5-1.8 GB/s against 1.7-2.4 unchecked, checked reads 1.0-1.3
against 1.05-1.6 (as fast in the run whose disk read at 1.05-1.15), at
0.39-0.54 CPU seconds per GB against 0.05-0.07. The disk tier moves every
byte of the state twice per step, so that is about 0.8 CPU seconds per GB of
state per step: a disk-tier step of a 50M-parameter model (0.6 GB of
state each way, host Adam on the same two cores) took 1.88-2.11 s with the
check against 1.34-1.65 s without (3 runs each, interleaved). The sum runs
beside the transfer (:class:`ChunkSum`), so where the disk is the bottleneck
it costs little time; where the CPU is (host Adam on few cores) it costs that
CPU. A cheaper sum was tried and not kept: a position-weighted sum of 8-byte
words in torch (ZFS's fletcher4 is of that kind) took 0.13-0.15 CPU seconds
per GB, half, but misses changes that cancel inside a block, and needs its
reductions kept below torch's parallel grain (a parallel one, on a worker
thread, costs as much as crc32).
"""

from __future__ import annotations

import functools
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["ChunkSum", "zeros_sum"]


@functools.lru_cache(maxsize=16)
def zeros_sum(nbytes: int) -> int:
    """The sum of ``nbytes`` zero bytes: what a slot never written holds."""
    block = memoryview(bytes(min(nbytes, 1 << 20)))
    crc, left = 0, nbytes
    while left:
        n = min(left, len(block))
        crc = zlib.crc32(block[:n], crc)
        left -= n
    return crc


class ChunkSum:
    """The sum of a chunk's bytes (Note [chunk checksum]), fed in pieces in order and summed
    on ``pool`` (one worker, a check thread, so the pieces are summed in turn) while the
    caller moves the next piece."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._crc = 0
        self._pending: list[Future[None]] = []

    def add(self, piece: memoryview) -> None:
        """Sum ``piece``, the chunk's next bytes, on the check thread; the caller keeps its
        buffer alive until :meth:`value` returns."""
        self._pending.append(self._pool.submit(self._update, piece))

    def _update(self, piece: memoryview) -> None:
        self._crc = zlib.crc32(piece, self._crc)

    def value(self) -> int:
        """The sum of every piece added, once all are summed (from then on the check thread
        no longer reads their buffers)."""
        while self._pending:
            self._pending.pop(0).result()
        return self._crc
