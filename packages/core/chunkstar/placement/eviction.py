"""Which resident chunks to evict: pure policy over a read-only view.

The runtime builds one :class:`ResidentChunk` per chunk on the device that may
move (no tensor in COMPUTE, not needed by the current moment) and asks for
enough bytes. The policy never touches tensors; tests drive it with made-up
views.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

__all__ = ["ResidentChunk", "choose_evictions"]

NEVER = 1 << 62


@dataclass(frozen=True)
class ResidentChunk:
    key: Hashable
    nbytes: int
    next_use: int | None
    """Moments until the chunk is needed again (None: not in the schedule / unknown)."""
    last_use: int
    """A monotonically growing clock value of its last access (for LRU)."""


def choose_evictions(candidates: Sequence[ResidentChunk], need_bytes: int, policy: str) -> list[Hashable] | None:
    """Keys to evict so at least ``need_bytes`` are freed; None if even all of them are not enough.

    ``furthest_next_use`` (Belady): evict the chunk needed furthest in the future;
    chunks the schedule never uses go first, ties broken by LRU. When no
    candidate has a known next use, this is plain LRU. ``lru``: least recently used first.
    """
    if need_bytes <= 0:
        return []
    if sum(c.nbytes for c in candidates) < need_bytes:
        return None
    if policy == "furthest_next_use":
        order = sorted(candidates, key=lambda c: (-(NEVER if c.next_use is None else c.next_use), c.last_use))
    elif policy == "lru":
        order = sorted(candidates, key=lambda c: c.last_use)
    else:
        raise ValueError(f"unknown eviction policy {policy!r}")
    chosen: list[Hashable] = []
    freed = 0
    for c in order:
        if freed >= need_bytes:
            break
        chosen.append(c.key)
        freed += c.nbytes
    return chosen
