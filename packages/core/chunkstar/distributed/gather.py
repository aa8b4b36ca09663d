"""All-gathers of chunk groups and the release of their copies (several processes).

With several processes each rank owns one chunk of every group of
``world_size`` consecutive param chunks (:meth:`chunkstar.chunk.layout.ChunkLayout.group`)
and keeps no payload for the others. A module's access gathers the groups of
the chunks it needs, and the copies of the other ranks' chunks are released
once no moment needs them (:mod:`chunkstar.distributed.grad_reduce` decides
when, on the schedule every rank shares: Note [collective schedule]). This is
the gathering half of the collectives, as ``grad_reduce`` is the reducing one;
the chunk store calls it from ``make_resident`` and asks it what is gathered.

Note [gather ahead]: on the frozen schedule the group the next moment needs is
gathered while the running moment computes. The collective is started without
waiting; the remote chunks' payloads and this rank's own chunk wait on it, so
the next access finds the group gathered and waits only for what has not
landed. It is called on every rank alike, from the trace and the gathered
groups only (both the same on every rank), and never fails for lack of room:
it goes over the budget until the next access instead, since a rank that
skipped it would leave the others waiting in the collective.
"""

from __future__ import annotations

import time
from typing import Iterable, Protocol, Sequence

import torch

from chunkstar.chunk.chunk import Chunk
from chunkstar.chunk.counters import ChunkCounters
from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.state import ChunkLocation
from chunkstar.chunk.store import Chunks
from chunkstar.distributed.comm import Comm
from chunkstar.events import MoveReason, Tier
from chunkstar.memory.probes import MemoryProbe

__all__ = ["GroupGathers"]

_PARAM = ChunkList.PARAM


class GatherStore(Protocol):
    """What the gathers tell and ask the chunk store: a remote copy came or went, and a
    gather ahead's chunks made resident."""

    def index_resident(self, key: tuple[ChunkList, int], on_device: bool) -> None: ...
    def make_resident(
        self, keys: Sequence[tuple[ChunkList, int]], reason: MoveReason, where: str, *, gather_groups: bool = False,
        ahead: bool = False,
    ) -> None: ...  # fmt: skip


class GroupGathers:
    def __init__(
        self, store: GatherStore, chunks: Chunks, comm: Comm, probe: MemoryProbe, counters: ChunkCounters
    ) -> None:
        self._store = store
        self._chunks = chunks  # read only: the payloads to gather into and to release
        self._layout = chunks.layout
        self._comm = comm
        self._probe = probe
        self._counters = counters
        self.gathered: set[int] = set()
        """First chunk ids of the groups whose remote copies are here."""
        self.gathers = 0
        """All-gathers of a group."""
        self.gathers_ahead = 0
        """Of them, started a moment early (Note [gather ahead])."""

    def missing(self, chunk_ids: Iterable[int]) -> list[int]:
        """The first chunk ids of the groups holding ``chunk_ids`` that are not gathered, in order."""
        if not self._comm.distributed:
            return []
        return sorted({self._layout.group(i).start for i in chunk_ids} - self.gathered)

    def scratch_bytes(self, start: int, device: torch.device) -> int:
        """Device bytes the gather of group ``start`` allocates beside its chunks (NCCL gathers into
        a flat temporary of the whole group first: distributed/comm.py)."""
        c = self._chunks.chunk(_PARAM, start)
        return self._comm.gather_scratch_bytes(c.numel, c.dtype, device)

    def gather(self, start: int, ahead: bool = False) -> None:
        """All-gather the param chunks of the group starting at ``start`` (this rank's own chunk
        resident); ``ahead``: return once it has started (Note [gather ahead])."""
        store = self._store
        chunks = self._chunks
        group = list(self._layout.group(start))
        own = chunks.chunk(_PARAM, group[self._comm.rank])
        own.wait_ready()  # its load may still be in flight: the collective reads it
        outputs: list[torch.Tensor | None] = []
        remote: list[Chunk] = []
        t0 = time.perf_counter_ns()
        with self._probe.paused(), torch.profiler.record_function("chunkstar::all_gather"):
            for k in group:
                c = chunks.chunk(_PARAM, k)
                if k == own.chunk_id:
                    outputs.append(None)  # it holds this rank's part already (the collective leaves it alone)
                else:
                    outputs.append(c.materialize_on_device())
                    store.index_resident((_PARAM, k), True)
                    remote.append(c)
            what = f"param chunks {group[0]}..{group[-1]}"
            if ahead:
                pending = self._comm.all_gather_group_async(outputs, own.device_view, what=what)
                for k in group:  # the remote copies are written, the own chunk read, until it lands
                    chunks.chunk(_PARAM, k).set_pending(pending)
            else:
                self._comm.all_gather_group(outputs, own.device_view, what=what)
        self.gathers += 1
        self.gathers_ahead += ahead
        self.gathered.add(start)
        t1 = time.perf_counter_ns()
        reason = MoveReason.PREFETCH if ahead else MoveReason.ACCESS
        for c in remote:  # the remote bytes came from the other ranks: this rank's host gave none
            self._counters.record(
                c.chunk_id, c.list_name, c.nbytes, src=Tier.HOST, dst=Tier.DEVICE, reason=reason, copied=c.nbytes,
                kept_src=True, gathered=True, t0=t0, t1=t1,
            )  # fmt: skip

    def ahead(self, chunk_ids: Iterable[int]) -> None:
        """Start the all-gathers of the groups holding ``chunk_ids`` (the next moment's, per the
        frozen trace) that are not gathered yet, without waiting (Note [gather ahead])."""
        if not self._comm.distributed:
            return
        keys = [(_PARAM, c) for c in chunk_ids if self._layout.group(c).start not in self.gathered]
        if keys:
            self._store.make_resident(keys, MoveReason.PREFETCH, where="the all-gather ahead", gather_groups=True, ahead=True)

    def release(self, start: int) -> None:
        """Drop this rank's copies of the other ranks' param chunks of a gathered group."""
        if start not in self.gathered:
            return
        self.gathered.discard(start)
        store = self._store
        chunks = self._chunks
        for k in self._layout.group(start):
            c = chunks.chunk(_PARAM, k)
            if chunks.own(k) or c.location is not ChunkLocation.DEVICE:
                continue
            with self._probe.paused():
                c.release()
            store.index_resident((_PARAM, k), False)
            self._counters.record(k, c.list_name, c.nbytes, src=Tier.DEVICE, dst=None, t0=time.perf_counter_ns())
