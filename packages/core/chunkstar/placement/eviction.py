"""Which resident chunks to evict: pure policy over a read-only view.

The runtime builds one :class:`ResidentChunk` per chunk on the device that may
move (no tensor in COMPUTE, not needed by the current moment) and asks for
enough bytes. The policy never touches tensors; tests drive it with made-up
views.

Note [state kept for the step]: hybrid Adam keeps the fp32 state of some chunks
on the device for good (:mod:`chunkstar.placement.optimizer`), because the
margin beside every param chunk and the non-model peak holds it. No moment of
the trace uses those chunks, so furthest-next-use would take them first, in
the very forward after the step that placed them, and the step would bring them
back: 12 bytes per parameter each way every step, for memory the plan had set
aside. So such a chunk is *reserved*: it goes only when the others cannot make
the room the moment must have (``must_bytes``), never to reach a lower target
(a warm-up moment keeping only its own chunks).
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
    reserved: bool = False
    """Kept for a later stage (Note [state kept for the step]): evicted only when the others
    cannot make the room that must be made."""


def _furthest_next_use(c: ResidentChunk) -> tuple[int, int]:
    return (-(NEVER if c.next_use is None else c.next_use), c.last_use)


def _least_recent(c: ResidentChunk) -> int:
    return c.last_use


def choose_evictions(
    candidates: Sequence[ResidentChunk], need_bytes: int, policy: str, must_bytes: int | None = None
) -> list[Hashable] | None:
    """Keys to evict so at least ``need_bytes`` are freed; None if even all of them cannot free
    ``must_bytes`` (default: ``need_bytes``; at most ``need_bytes``).

    ``furthest_next_use`` (Belady): evict the chunk needed furthest in the future;
    chunks the schedule never uses go first, ties broken by LRU. When no
    candidate has a known next use, this is plain LRU. ``lru``: least recently used first.
    Remaining ties keep the candidates' order. Reserved chunks (Note [state kept for the
    step]) come after all the others, in the same order, and only as far as ``must_bytes``
    needs them.
    """
    must = need_bytes if must_bytes is None else min(must_bytes, need_bytes)
    if need_bytes <= 0:
        return []
    if sum(c.nbytes for c in candidates) < must:
        return None
    if not candidates:
        return []  # nothing must go (the budget holds; a lower target cannot be reached)
    key: Callable[[ResidentChunk], Any]
    if policy == "furthest_next_use":
        key = _furthest_next_use
    elif policy == "lru":
        key = _least_recent
    else:
        raise ValueError(f"unknown eviction policy {policy!r}")
    free = [c for c in candidates if not c.reserved]
    if len(free) < len(candidates):
        chosen, freed = _take(free, key, need_bytes)
        if freed < must:
            more, _ = _take([c for c in candidates if c.reserved], key, must - freed)
            chosen += more
        return chosen
    first = min(candidates, key=key)  # the first of the best, as a stable sort puts it first
    if first.nbytes >= need_bytes:
        return [first.key]  # the usual case: one chunk is enough, no sort needed
    return _take(candidates, key, need_bytes)[0]


def _take(candidates: Sequence[ResidentChunk], key: Callable[[ResidentChunk], Any], need_bytes: int) -> tuple[list[Hashable], int]:
    """The first of ``candidates`` in ``key`` order until ``need_bytes`` are freed (all of them
    if they are not enough), and the bytes they free."""
    chosen: list[Hashable] = []
    freed = 0
    for c in sorted(candidates, key=key):
        if freed >= need_bytes:
            break
        chosen.append(c.key)
        freed += c.nbytes
    return chosen, freed
