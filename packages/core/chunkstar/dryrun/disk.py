"""The disk tier in a dry run: files that record the bytes they would move and hold none.

Note [dry run disk]: with config ``disk``, a dry run builds the real
:class:`~chunkstar.runtime.disk_tier.DiskTier` from other parts
(:class:`SimulatedDisk`): a staging pool that lends meta buffers (budgeted, and
waited for, exactly as host ones), the real I/O lanes with their two threads and
their ordering (a read after the chunk's last write-behind, a write after its
update, a buffer given back once its write is over), and :class:`MetaFiles`,
which check every transfer's size as the real files do and count its bytes but
create no file, claim no directory and touch no disk. So the tier decides as in
a real run (which chunks are staged, when, how far reads run ahead of the
updates, the staging peak), and ``engine.stats()`` reports the disk bytes read
and written, the file bytes a rank would need and the staging budget, with the
staging moves in the step record for the time model's disk lane
(:mod:`chunkstar.dryrun.timing`). What a dry run cannot know, it does not
claim: whether the target's disk has the space (:attr:`MetaFiles.file_bytes`
says how much it needs), and its speed (the hardware description's).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

import torch

from chunkstar.config import DiskConfig
from chunkstar.disk import DiskIOStats, DiskLanes, StagingBuffers
from chunkstar.disk.blockio import round_up
from chunkstar.disk.claim import chunk_file_name
from chunkstar.disk.files import piece_extent
from chunkstar.runtime.disk_tier import TierFiles, TierLanes

__all__ = ["MetaFiles", "SimulatedDisk"]


class MetaFiles:
    """One rank's chunk files as sizes and counters: each list's slots padded to
    :data:`~chunkstar.disk.ALIGNMENT` as the real files lay them out."""

    device = "meta"

    def __init__(
        self, directory: Path, rank: int, sizes: dict[str, dict[int, int]], direct: bool, pieces: dict[str, int] | None = None
    ) -> None:
        self._rank = rank
        self._sizes = sizes
        self._pieces = dict(pieces or {})
        self._directory = directory
        self._direct = direct
        self._lock = threading.Lock()  # the lanes' two threads count at once
        self._read = self._written = self._reads = self._writes = 0
        self.lost: dict[tuple[str, int], str] = {}
        """Slots whose write-behind did not complete (as the real files keep them)."""

    @property
    def file_bytes(self) -> int:
        return sum(round_up(n) for per in self._sizes.values() for n in per.values())

    @property
    def stats(self) -> DiskIOStats:
        with self._lock:
            return DiskIOStats(self._read, self._written, 0.0, 0.0, self._reads, self._writes, 0)

    @property
    def direct(self) -> bool:
        return self._direct

    @property
    def directory(self) -> Path:
        return self._directory

    def nbytes(self, list_name: str, chunk_id: int, pieces: range | None = None) -> int:
        try:
            n = self._sizes[list_name][chunk_id]
        except KeyError:
            raise KeyError(f"no chunk {chunk_id} in disk list {list_name!r}") from None
        return piece_extent(n, self._pieces.get(list_name, 0), pieces)[1]

    def path(self, list_name: str) -> Path:
        return self._directory / f"{chunk_file_name(self._rank, list_name)} (not created: a dry run)"

    def read_into(self, list_name: str, chunk_id: int, dst: torch.Tensor, pieces: range | None = None) -> None:
        self._count(list_name, chunk_id, dst, pieces, write=False)

    def write_from(self, list_name: str, chunk_id: int, src: torch.Tensor, pieces: range | None = None) -> None:
        self._count(list_name, chunk_id, src, pieces, write=True)

    def mark_lost(self, list_name: str, chunk_id: int, why: str, pieces: range | None = None) -> None:
        with self._lock:
            self.lost.setdefault((list_name, chunk_id), why)

    def remove(self) -> None:
        """Nothing was created."""

    def _count(self, list_name: str, chunk_id: int, t: torch.Tensor, pieces: range | None, *, write: bool) -> None:
        n = self.nbytes(list_name, chunk_id, pieces)
        if t.numel() * t.element_size() != n:  # the real files refuse a wrong size too
            raise ValueError(f"chunk {chunk_id} of list {list_name!r} is {n} bytes; the buffer has {t.numel() * t.element_size()}")
        with self._lock:
            if write:
                self._written += n
                self._writes += 1
            else:
                self._read += n
                self._reads += 1


class SimulatedDisk:
    """:class:`~chunkstar.runtime.disk_tier.DiskParts` for a dry run (Note [dry run disk])."""

    def staging(self, budget: int) -> StagingBuffers:
        return StagingBuffers(budget, device="meta")

    def files(
        self, cfg: DiskConfig, *, run_tag: str, rank: int, lists: list[str], chunk_nbytes: dict[str, dict[int, int]],
        piece_nbytes: dict[str, int],
    ) -> TierFiles:
        return MetaFiles(Path(cfg.path), rank, {n: dict(chunk_nbytes[n]) for n in lists}, cfg.direct, piece_nbytes)

    def lanes(self, files: TierFiles, on_failure: Callable[[BaseException], None]) -> TierLanes:
        assert isinstance(files, MetaFiles)
        return DiskLanes(files, on_failure=on_failure)
