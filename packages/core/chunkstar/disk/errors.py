"""The errors the disk tier raises on purpose.

Each names the path involved and what to change. They are ``RuntimeError``s:
the disk, not the caller's arguments, is what went wrong (a bad argument, such
as a tensor of the wrong size, raises ``ValueError`` as anywhere else).
"""

from __future__ import annotations

from pathlib import Path

from chunkstar.errors import _fmt as _fmt_bytes  # the one byte formatter of chunkstar's messages

__all__ = ["DiskFullError", "DiskTierError"]


class DiskTierError(RuntimeError):
    """The disk tier cannot use its directory or its files: stale files, a lock
    another process holds, a failed read or write (the message names the path)."""


class DiskFullError(DiskTierError):
    """There is not room on the disk for the chunk files (found before allocating,
    or by the allocation or a write hitting ``ENOSPC``/``EDQUOT``)."""

    def __init__(self, path: str | Path, needed: int, free: int, where: str = "the disk tier's chunk files") -> None:
        self.path = Path(path)
        self.needed = needed
        """Bytes the disk tier needed at that moment."""
        self.free = free
        """Bytes free for this user at ``path`` (``shutil.disk_usage``) when it was found."""
        super().__init__(
            f"chunkstar disk tier: not enough disk space at {self.path} for {where}: "
            f"{_fmt_bytes(needed)} ({needed} bytes) needed, {_fmt_bytes(free)} ({free} bytes) free. "
            f"To fix: free space there, point the disk tier at a directory on a larger disk, "
            f"or keep fewer state lists on disk."
        )
