"""Typed events the engine emits: the observability seam.

The core never imports a profiler. Anything that wants to watch training
(``chunkstar_profiler``, a test, a logger) calls ``engine.events.subscribe(fn)``
and receives these frozen dataclasses synchronously, in order. With no
subscriber the engine does not even build the event objects
(``EventBus.active`` is checked first), so watching is free when nobody
watches.

Times are ``time.perf_counter_ns()`` values; byte counts are exact payload
sizes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Union

__all__ = [
    "Stage",
    "Tier",
    "MoveReason",
    "StageChanged",
    "MomentBegin",
    "MomentEnd",
    "ChunkMoved",
    "ChunkAllocated",
    "ChunkFreed",
    "ActivationMoved",
    "MemorySample",
    "Event",
    "EventBus",
]


class Stage(enum.Enum):
    """What the engine is doing."""

    IDLE = "idle"
    FWD = "fwd"
    BWD = "bwd"
    OPTIM = "optim"


class Tier(enum.Enum):
    """A memory tier a chunk payload can live in."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class MoveReason(enum.Enum):
    """Why a chunk moved between tiers."""

    ACCESS = "access"
    """A module (or the optimizer) needs it on the device now."""
    EVICTION = "eviction"
    """Room was needed on the device; the policy chose this chunk."""
    PREFETCH = "prefetch"
    """The recorded schedule says it is needed soon."""
    OPTIMIZER = "optimizer"
    """Placed where its Adam update runs (host for CPU Adam, device for device Adam)."""
    OFFLOAD = "offload"
    """Its gradients were complete during backward: sent to the host, where its Adam update runs."""
    STAGE_IN = "stage_in"
    """Read from its file on disk into a host staging buffer (Note [disk tier]): for its Adam
    update, or for code between steps that reads it."""
    STAGE_OUT = "stage_out"
    """Written back from its staging buffer to its file on disk (``nbytes`` 0: unchanged, dropped)."""


@dataclass(frozen=True)
class StageChanged:
    stage: Stage
    t_ns: int


@dataclass(frozen=True)
class MomentBegin:
    """A moment began: a module's pre-hook (forward or backward), or a parameter read
    outside its module (Note [parameter guard]). Optimizer steps are stages, not moments."""

    index: int
    """Position of the moment within the current iteration (0-based)."""
    module: str
    stage: Stage
    t_ns: int


@dataclass(frozen=True)
class MomentEnd:
    index: int
    module: str
    stage: Stage
    t_ns: int


@dataclass(frozen=True)
class ChunkMoved:
    chunk_id: int
    chunk_list: str
    """"param", "master", "exp_avg" or "exp_avg_sq"."""
    nbytes: int
    src: Tier
    dst: Tier
    reason: MoveReason
    moment: int
    """Index of the moment during which the move was issued (-1 outside moments)."""
    module: str
    """The module whose moment caused the move ("" outside moments)."""
    t_start_ns: int
    t_end_ns: int
    gathered: bool = False
    """Another rank's chunk arriving by an all-gather (over the interconnect, not the host link)."""


@dataclass(frozen=True)
class ChunkAllocated:
    chunk_id: int
    chunk_list: str
    tier: Tier
    nbytes: int
    t_ns: int


@dataclass(frozen=True)
class ChunkFreed:
    chunk_id: int
    chunk_list: str
    tier: Tier
    nbytes: int
    t_ns: int


@dataclass(frozen=True)
class ActivationMoved:
    """One storage of a block's saved activations crossed the host link (Note [activation
    offload] in :mod:`chunkstar.activations.offload`): to the host as the block's forward saved
    it, or back to the device for its backward. Emitted once the copy is known to be done."""

    block: str
    """The block's qualified module name ("h.3")."""
    nbytes: int
    src: Tier
    dst: Tier
    prefetch: bool
    """A copy back issued ahead of the block's backward (False: the backward waited for it)."""
    moment: int
    """The moment during which the copy was issued (-1 outside moments)."""
    t_start_ns: int
    """When the copy was issued."""
    t_end_ns: int
    """When it was found done (its end, or later: a copy nobody waited for is checked at the next chance)."""


@dataclass(frozen=True)
class MemorySample:
    """Memory of one tier at a moment boundary."""

    tier: Tier
    total_bytes: int
    """Chunk bytes + non-model bytes (as measured by the tier's probe)."""
    chunk_bytes: int
    non_model_bytes: int
    budget_bytes: int
    """The tier's capacity for chunks + non-model data (0 when unbounded)."""
    moment: int
    t_ns: int


Event = Union[StageChanged, MomentBegin, MomentEnd, ChunkMoved, ChunkAllocated, ChunkFreed, ActivationMoved, MemorySample]
Subscriber = Callable[[Event], None]


class EventBus:
    """Synchronous fan-out of engine events to subscribers."""

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    @property
    def active(self) -> bool:
        """True when at least one subscriber listens; check before building an event."""
        return bool(self._subscribers)

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Register ``fn``; returns a function that unsubscribes it."""
        self._subscribers.append(fn)

        def unsubscribe() -> None:
            if fn in self._subscribers:
                self._subscribers.remove(fn)

        return unsubscribe

    def emit(self, event: Event) -> None:
        for fn in tuple(self._subscribers):
            fn(event)
