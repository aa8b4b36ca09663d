"""Which resident chunks to evict: pure policy over a read-only view.

The runtime builds one :class:`ResidentChunk` per chunk on the device that may
move (no tensor in COMPUTE, not needed by the current moment) and asks for
enough bytes. The policy never touches tensors; tests drive it with made-up
views.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, NamedTuple, Sequence

__all__ = ["ResidentChunk", "choose_evictions"]

NEVER = 1 << 62


class ResidentChunk(NamedTuple):
    """One chunk on the device that may move (a NamedTuple: the runtime builds one per
    resident chunk at every eviction, so it must be cheap to make)."""

    key: Hashable
    nbytes: int
    next_use: int | None
    """Moments until the chunk is needed again (None: not in the schedule / unknown)."""
    last_use: int
    """A monotonically growing clock value of its last access (for LRU)."""


def _furthest_next_use(c: ResidentChunk) -> tuple[int, int]:
    return (-(NEVER if c.next_use is None else c.next_use), c.last_use)


def _least_recent(c: ResidentChunk) -> int:
    return c.last_use


def choose_evictions(candidates: Sequence[ResidentChunk], need_bytes: int, policy: str) -> list[Hashable] | None:
    """Keys to evict so at least ``need_bytes`` are freed; None if even all of them are not enough.

    ``furthest_next_use`` (Belady): evict the chunk needed furthest in the future;
    chunks the schedule never uses go first, ties broken by LRU. When no
    candidate has a known next use, this is plain LRU. ``lru``: least recently used first.
    Remaining ties keep the candidates' order.
    """
    if need_bytes <= 0:
        return []
    if sum(c.nbytes for c in candidates) < need_bytes:
        return None
    key: Callable[[ResidentChunk], Any]
    if policy == "furthest_next_use":
        key = _furthest_next_use
    elif policy == "lru":
        key = _least_recent
    else:
        raise ValueError(f"unknown eviction policy {policy!r}")
    first = min(candidates, key=key)  # the first of the best, as a stable sort puts it first
    if first.nbytes >= need_bytes:
        return [first.key]  # the usual case: one chunk is enough, no sort needed
    chosen: list[Hashable] = []
    freed = 0
    for c in sorted(candidates, key=key):
        if freed >= need_bytes:
            break
        chosen.append(c.key)
        freed += c.nbytes
    return chosen
