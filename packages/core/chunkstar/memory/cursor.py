"""Where the running iteration is: one small object, one writer.

The cursor says which stage runs (forward, backward, optimizer, idle), which
moment and module, and the schedule's :class:`ScheduleMode`: whether the
moments are a training pass or an evaluation, and whether the trace describes
them. The chunk manager reads it to size budgets and rank evictions, the hook
targets to number moments, the reducer to keep gathered groups; only
:class:`chunkstar.runtime.schedule.Schedule` writes it, so "what moment is it"
has one answer and one place that changes it. It holds no policy and moves no
data.
"""

from __future__ import annotations

from chunkstar.events import Stage
from chunkstar.memory.tracer import MemoryTrace, ScheduleMode

__all__ = ["Cursor", "ScheduleMode"]


class Cursor:
    # __slots__: read several times per module call on the hot path
    __slots__ = ("stage", "moment", "module", "mode", "trace")

    def __init__(self) -> None:
        self.stage = Stage.IDLE
        self.moment = -1
        """Moments begun in the running iteration, minus one (-1: none yet, or the optimizer step)."""
        self.module = ""
        """Label of the module (or "optimizer") whose moment runs; "" between steps."""
        self.mode = ScheduleMode.TRACING
        """How the running moments relate to the trace (:class:`ScheduleMode`)."""
        self.trace = MemoryTrace()
        """The warm-up trace (replaced when the schedule traces again)."""

    def follows_trace(self) -> bool:
        """Whether the running moments follow the frozen trace, so its next uses and budgets
        hold: clean host copies, Belady's eviction, prefetch and the gradient pipeline read it."""
        return self.mode is ScheduleMode.FOLLOWING
