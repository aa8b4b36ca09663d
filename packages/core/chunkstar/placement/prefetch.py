"""Which chunks to bring ahead of time, and what to evict for them: pure policy.

The runtime calls :func:`plan_prefetch` when a moment begins on the frozen
schedule (and once after the optimizer step, for the next forward's first
moments). It looks ahead over the trace's next moments by a byte window, not
one moment, so a copy starts early enough to land behind compute even on a
slow link: the window is the bytes of the distinct chunks the next moments
need, resident or not, so it also bounds the bytes a prefetch can have in
flight and the work of one call (at most ``MAX_LOOKAHEAD`` moments).

A chunk is brought for moment ``j`` only if it fits the chunk budget of every
moment from now to ``j`` (the non-model memory differs per moment), evicting if
needed, and only chunks whose next use is later than ``j`` (Belady's rule: a
prefetch never evicts something needed sooner than what it brings). Loads are
planned in the order they are needed; the plan stops at the first chunk that
cannot be brought, so a far chunk never takes the room of a near one.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, NamedTuple, Sequence

from chunkstar.placement.eviction import NEVER

__all__ = ["MAX_LOOKAHEAD", "PrefetchView", "Upcoming", "plan_prefetch"]

MAX_LOOKAHEAD = 64
"""Moments one plan looks at, at most (many moments may share a few chunks)."""

ChunkKey = Any
"""Whatever the runtime names chunks by (hashable); the policy only compares them."""


class Upcoming(NamedTuple):
    """One moment ahead: its index, its chunk budget (capacity less its non-model bytes)
    and the chunks it needs."""

    moment: int
    budget: int
    chunks: Sequence[ChunkKey]


class PrefetchView(NamedTuple):
    """What the planner may read about the device now."""

    device_bytes: int
    """Bytes the chunks on the device occupy (loads in flight included)."""
    budget_now: int
    """Chunk budget of the running moment."""
    nbytes: Callable[[ChunkKey], int]
    resident: Callable[[ChunkKey], bool]
    movable: Callable[[], Sequence[tuple[ChunkKey, int | None]]]
    """Chunks on the device that may be evicted (not in use), with their next use
    counted in moments from now (None: never used again by the schedule); asked
    only when a load needs room."""


def plan_prefetch(
    view: PrefetchView, upcoming: Iterable[Upcoming], now: int, window_bytes: int
) -> list[tuple[ChunkKey, list[ChunkKey]]]:
    """``[(chunk, evictions), ...]`` in the order to act: evict the listed chunks, then
    load ``chunk``. ``upcoming`` lists the moments after ``now`` in order."""
    plan: list[tuple[ChunkKey, list[ChunkKey]]] = []
    device = view.device_bytes
    room = view.budget_now
    ahead = 0  # bytes of the distinct chunks the moments looked at need
    seen: set[ChunkKey] = set()  # those chunks: every one is needed before the moment being planned
    victims: list[tuple[int, ChunkKey]] | None = None  # furthest next use first, once asked
    gone: set[ChunkKey] = set()
    for n, up in enumerate(upcoming):
        if n >= MAX_LOOKAHEAD:
            break
        room = min(room, up.budget)
        for c in up.chunks:
            if c in seen:
                continue
            seen.add(c)
            size = view.nbytes(c)
            ahead += size
            if ahead > window_bytes:
                return plan
            if view.resident(c):
                continue
            evict: list[ChunkKey] = []
            excess = device + size - room
            if excess > 0:
                if victims is None:
                    # ties keep the given order
                    victims = sorted(((NEVER if nu is None else nu, k) for k, nu in view.movable()), key=lambda t: -t[0])
                distance = up.moment - now
                for nu, k in victims:
                    if excess <= 0:
                        break
                    if k in gone or k in seen or nu <= distance:
                        continue
                    evict.append(k)
                    excess -= view.nbytes(k)
                if excess > 0:
                    return plan  # it does not fit before it is needed: the access will make room
                for k in evict:
                    gone.add(k)
                    device -= view.nbytes(k)
            plan.append((c, evict))
            device += size
    return plan
