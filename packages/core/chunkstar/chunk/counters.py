"""The chunk store's byte and move counters, and the events of each move: one record per move.

Every path that gives a chunk a payload in a tier, takes one away or carries
one across (a move between device and host, an all-gather of other ranks'
chunks, the release of such a copy, a stage in from disk or out to it, a first
allocation) calls :meth:`ChunkCounters.record` once, naming the tier the bytes
leave and the tier they reach. The record derives everything else from that:
the bytes each tier holds for chunks (and the device's peak), the moves and
bytes each way, the per-reason counts, the clean evictions, and the three
events (:class:`ChunkAllocated`, :class:`ChunkMoved`, :class:`ChunkFreed`)
a profiler draws. So a counter cannot drift from the events, or one path from
another.
"""

from __future__ import annotations

import threading
import time

from chunkstar.chunk.chunk import Chunk
from chunkstar.events import ChunkAllocated, ChunkFreed, ChunkMoved, EventBus, MemorySample, MoveReason, Tier
from chunkstar.memory.cursor import Cursor

__all__ = ["ChunkCounters"]


class ChunkCounters:
    def __init__(self, events: EventBus, cursor: Cursor) -> None:
        self._events = events
        self._cur = cursor  # read for the moment and module a move happened in
        # the disk tier's step thread records its stage moves too (Note [the step issued behind])
        self._lock = threading.Lock()
        self.device_chunk_bytes = 0
        """Chunk payload bytes on the device (the bytes of an eviction in flight included until
        the eviction is issued; the device's own meter counts them until they are freed)."""
        self.device_chunk_bytes_peak = 0
        self.host_chunk_bytes = 0
        """Host buffers allocated for chunks (a clean copy kept beside a device payload counts)."""
        self.host_chunk_bytes_peak = 0
        self.moves_to_device = 0
        self.moves_to_host = 0
        self.bytes_to_device = 0
        self.bytes_to_host = 0
        self.moves_by_reason: dict[str, int] = {r.value: 0 for r in MoveReason}
        self.clean_evictions = 0
        """Evictions of clean param chunks: no bytes copied (Note [clean host copy])."""
        self.bytes_gathered = 0
        """Remote bytes received by all-gathers (several processes)."""

    def record(
        self,
        chunk_id: int,
        list_name: str,
        nbytes: int,
        *,
        src: Tier | None,
        dst: Tier | None,
        reason: MoveReason | None = None,
        copied: int = 0,
        kept_src: bool = False,
        had_dst: bool = False,
        gathered: bool = False,
        t0: int,
        t1: int | None = None,
    ) -> None:
        """A chunk's payload of ``nbytes`` left ``src`` (None: it had none there, as an
        allocation) and reached ``dst`` (None: it went nowhere, as a released remote copy),
        ``copied`` bytes travelling (0: a clean eviction, whose host copy already agreed).
        ``kept_src``: the source keeps its bytes (a clean copy left on the host, a file on
        disk, another rank's chunk); ``had_dst``: the destination had them already (a host
        buffer kept from an earlier trip, a chunk's file slot). ``gathered``: the bytes came
        from other ranks by an all-gather (counted as gathered, not as a move of this rank's).
        ``t0``/``t1``: when it began and ended (ns; ``t1`` None: at once)."""
        with self._lock:
            self._record(chunk_id, list_name, nbytes, src, dst, reason, copied, kept_src, had_dst, gathered, t0, t0 if t1 is None else t1)

    def _record(
        self, chunk_id: int, list_name: str, nbytes: int, src: Tier | None, dst: Tier | None, reason: MoveReason | None,
        copied: int, kept_src: bool, had_dst: bool, gathered: bool, t0: int, t1: int,
    ) -> None:  # fmt: skip
        if dst is not None and not had_dst:
            self._add(dst, nbytes)
        if src is not None and not kept_src:
            self._add(src, -nbytes)
        if gathered:
            self.bytes_gathered += copied
        elif src is not None and dst is not None:
            if reason is not None:
                self.moves_by_reason[reason.value] += 1
            if dst is Tier.DEVICE:
                self.moves_to_device += 1
                self.bytes_to_device += copied
            elif src is Tier.DEVICE:
                self.moves_to_host += 1
                if copied:
                    self.bytes_to_host += copied
                else:
                    self.clean_evictions += 1
        events = self._events
        if not events.active:
            return
        if dst is not None and not had_dst:
            events.emit(ChunkAllocated(chunk_id, list_name, dst, nbytes, t0))
        if src is not None and dst is not None:
            cur = self._cur
            assert reason is not None
            events.emit(ChunkMoved(chunk_id, list_name, copied, src, dst, reason, cur.moment, cur.module, t0, t1, gathered))
        if src is not None and not kept_src:
            events.emit(ChunkFreed(chunk_id, list_name, src, nbytes, t1))

    def record_disk(self, chunk: Chunk, to_disk: bool, nbytes: int, t_ns: int, held: int) -> None:
        """A chunk (or a slice of it: Note [the step in slices]) was staged in from disk or out
        to it (the disk tier calls this): ``nbytes`` issued now, travelling on the disk tier's
        I/O lanes (so the move ends when issued too), in ``held`` bytes of host staging. The
        file keeps its bytes when a chunk is staged in, and has its slot when one goes out."""
        if to_disk:
            self.record(chunk.chunk_id, chunk.list_name, held, src=Tier.HOST, dst=Tier.DISK,
                        reason=MoveReason.STAGE_OUT, copied=nbytes, had_dst=True, t0=t_ns)  # fmt: skip
        else:
            self.record(chunk.chunk_id, chunk.list_name, held, src=Tier.DISK, dst=Tier.HOST,
                        reason=MoveReason.STAGE_IN, copied=nbytes, kept_src=True, t0=t_ns)  # fmt: skip

    def sample(self, non_model: int, capacity: int, disk_file_bytes: int | None) -> None:
        """Memory samples of the tiers now: the device (chunks and ``non_model`` bytes beside
        them, against ``capacity``), the host's chunk buffers, and (with the disk tier) the
        chunk files, this rank's state whatever is staged."""
        events = self._events
        if not events.active:
            return
        moment = self._cur.moment
        device = self.device_chunk_bytes
        events.emit(MemorySample(Tier.DEVICE, device + non_model, device, non_model, capacity, moment, time.perf_counter_ns()))
        host = self.host_chunk_bytes
        events.emit(MemorySample(Tier.HOST, host, host, 0, 0, moment, time.perf_counter_ns()))
        if disk_file_bytes is not None:
            files = disk_file_bytes
            events.emit(MemorySample(Tier.DISK, files, files, 0, files, moment, time.perf_counter_ns()))

    def _add(self, tier: Tier, nbytes: int) -> None:
        if tier is Tier.DEVICE:
            self.device_chunk_bytes += nbytes
            if self.device_chunk_bytes > self.device_chunk_bytes_peak:
                self.device_chunk_bytes_peak = self.device_chunk_bytes
        elif tier is Tier.HOST:
            self.host_chunk_bytes += nbytes
            if self.host_chunk_bytes > self.host_chunk_bytes_peak:
                self.host_chunk_bytes_peak = self.host_chunk_bytes
