"""Where the running iteration is: one small object, one writer.

The cursor says which stage runs (forward, backward, optimizer, idle), which
moment and module, whether the moments follow the schedule (an evaluation
forward does not) and whether the schedule's trace may be trusted (``safe_mode``
off). The chunk manager reads it to size budgets and rank evictions, the hook
targets to number moments, the reducer to keep gathered groups; only
:class:`chunkstar.runtime.schedule.Schedule` writes it, so "what moment is it"
has one answer and one place that changes it. It holds no policy and moves no
data.
"""

from __future__ import annotations

from chunkstar.events import Stage
from chunkstar.memory.tracer import MemoryTrace

__all__ = ["Cursor"]


class Cursor:
    # __slots__: read several times per module call on the hot path
    __slots__ = ("stage", "moment", "module", "on_schedule", "evaluation_follows", "safe_mode", "trace")

    def __init__(self) -> None:
        self.stage = Stage.IDLE
        self.moment = -1
        """Moments begun in the running iteration, minus one (-1: none yet, or the optimizer step)."""
        self.module = ""
        """Label of the module (or "optimizer") whose moment runs; "" between steps."""
        self.on_schedule = True
        """False during an untraced forward (evaluation): budgets then use the trace's maximum."""
        self.evaluation_follows = False
        """During an evaluation forward (``on_schedule`` False): its moments so far are the traced
        forward's, from the first, on inputs no bigger than the traced ones, so each may be
        budgeted with its traced moment's non-model peak (Note [evaluation budgets] in
        runtime/schedule.py)."""
        self.safe_mode = False
        """While tracing (or off the traced schedule) the device keeps only what the running
        moment needs, leaving activations all the room there is."""
        self.trace = MemoryTrace()
        """The warm-up trace (replaced when the schedule traces again)."""

    def follows_trace(self) -> bool:
        """Whether the running moments follow the frozen trace, so its next uses and budgets
        hold: clean host copies, Belady's eviction, prefetch and the gradient pipeline read it."""
        return self.trace.frozen and self.on_schedule and not self.safe_mode
