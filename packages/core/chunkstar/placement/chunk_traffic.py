"""How many chunk bytes an iteration brings to the device, given the room each moment leaves them.

Note [chunk traffic under a plan]: the frozen schedule keeps a chunk on the
device after its moment for as long as the room allows, and when a moment needs
room it evicts the chunk needed furthest in the future
(:mod:`chunkstar.placement.eviction`). So the chunk traffic of an iteration is
not a constant: every byte something else holds on the device (a kept block's
activations, a recomputed block's inputs) is a byte the chunks cannot stay in,
and a chunk evicted for it is loaded again at its next use. The warm-up, which
keeps only each moment's own chunks, measures the most traffic there can be; the
activation plan (:mod:`chunkstar.activations.plan`) needs the traffic of each
plan it weighs, so this module replays the eviction policy over the traced
moments with each moment's room as the plan leaves it, and counts the loads.

It is a model, not the runtime: it replays the trace's chunk uses with Belady's
furthest-next-use and no prefetch margin, in steady state (the iteration is
replayed twice and the second counted, so what the end of one iteration leaves
resident serves the start of the next, as it does across steps). Only this
rank's own chunks are counted: another rank's chunks arrive through a collective
and leave after their moment, whatever the room (their bytes are part of the
moment's room already).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["CacheModel"]


@dataclass(frozen=True)
class CacheModel:
    """The own chunks each traced moment uses and the room it leaves them (module docstring).

    ``uses[m]``: the own chunk ids moment ``m`` needs on the device; ``sizes[c]``: chunk ``c``'s
    bytes; ``room[m]``: the bytes moment ``m`` leaves for own chunks with nothing else added (the
    capacity less the collectives' scratch, the non-model peak and other ranks' chunks);
    ``backward_from``: the first backward moment (loads before it are the forward's)."""

    uses: Sequence[tuple[int, ...]]
    sizes: Sequence[int]
    room: Sequence[int]
    backward_from: int
    _next: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _every: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.uses) != len(self.room):
            raise ValueError(f"{len(self.uses)} moments of uses but {len(self.room)} of room")
        # per moment and chunk used there, the moment of its next use in the cyclic run of
        # iterations (an index into the doubled sequence; beyond it: never again)
        n = len(self.uses)
        nxt: list[tuple[int, ...]] = [()] * n
        seen: dict[int, int] = {}
        for m in range(2 * n - 1, -1, -1):
            ids = self.uses[m % n]
            if m < n:
                nxt[m] = tuple(seen.get(c, 1 << 60) for c in ids)
            for c in ids:
                seen[c] = m
        object.__setattr__(self, "_next", tuple(nxt))
        # the bytes of every chunk used: where each moment's room holds them beside what is added,
        # nothing is ever loaded
        object.__setattr__(self, "_every", sum(self.sizes[c] for c in {c for ids in self.uses for c in ids}))

    def loads(self, added: Sequence[int] | None = None) -> tuple[int, int]:
        """Bytes loaded to the device in one steady-state iteration: (forward, backward), with
        ``added[m]`` more bytes held at moment ``m`` by something other than chunks."""
        n = len(self.uses)
        if not n or all(r - (added[m] if added is not None else 0) >= self._every for m, r in enumerate(self.room)):
            return 0, 0  # every chunk stays: the common case of a rank whose own chunks all fit
        resident: dict[int, int] = {}  # chunk -> its next use (a moment of the doubled run)
        held = 0
        heap: list[tuple[int, int]] = []  # (-next use, chunk), stale entries skipped
        fwd = bwd = 0
        for it in range(2):
            for m, ids in enumerate(self.uses):
                for c, nu in zip(ids, self._next[m]):
                    if c not in resident:
                        held += self.sizes[c]
                        if it:
                            if m < self.backward_from:
                                fwd += self.sizes[c]
                            else:
                                bwd += self.sizes[c]
                    # the next use seen from this moment of iteration ``it``
                    resident[c] = nu + it * n if nu < (1 << 60) else 1 << 60
                    heapq.heappush(heap, (-resident[c], c))
                room = self.room[m] - (added[m] if added is not None else 0)
                if held <= room:
                    continue
                keep: list[tuple[int, int]] = []
                needed = set(ids)
                while held > room and heap:
                    neg, c = heapq.heappop(heap)
                    if resident.get(c) != -neg:
                        continue  # stale
                    if c in needed:
                        keep.append((neg, c))  # the moment's own: it cannot go
                        continue
                    del resident[c]
                    held -= self.sizes[c]
                for item in keep:
                    heapq.heappush(heap, item)
        return fwd, bwd
