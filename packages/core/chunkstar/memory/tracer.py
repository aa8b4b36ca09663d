"""The warm-up memory trace: per moment, what was accessed and how much
non-model memory the device held.

A *moment* is one module pre-hook (forward or backward) within a micro-step.
The warm-up spans the first two training micro-steps: the first alone would
miss what user code keeps alive *across* iterations (the previous step's
outputs and logits, say, which live on during the next forward), so each
moment keeps the larger peak of the two passes. :meth:`MemoryTrace.freeze` then
turns the records into the schedule the policies read: the chunk budget of
each moment and the next use of each chunk. Micro-steps repeat, so "next use"
wraps around into the next micro-step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

__all__ = ["MomentRecord", "MemoryTrace"]


@dataclass
class MomentRecord:
    module: str
    stage: str
    chunks: tuple[int, ...]
    """Param chunk ids the moment accessed."""
    non_model_peak: int = 0
    """Peak non-model device bytes from this moment's start to the next moment's start."""


@dataclass
class MemoryTrace:
    records: list[MomentRecord] = field(default_factory=list)
    frozen: bool = False
    passes: int = 0
    """Completed warm-up micro-steps merged into the records."""
    _uses: dict[int, list[int]] = field(default_factory=dict)

    def record(self, index: int, rec: MomentRecord) -> None:
        """Moment ``index`` of the running pass. A later pass merges into the first
        pass's record of the same index (keeping the larger peak, see
        :meth:`set_peak`); moments beyond the first pass's are appended."""
        assert not self.frozen, "the trace is frozen after warm-up"
        if index < len(self.records) and self.passes > 0:
            return
        self.records.append(rec)

    def end_pass(self) -> None:
        self.passes += 1

    def set_peak(self, index: int, peak: int) -> None:
        if 0 <= index < len(self.records):
            r = self.records[index]
            r.non_model_peak = max(r.non_model_peak, peak)

    def freeze(self) -> None:
        uses: dict[int, list[int]] = {}
        for i, r in enumerate(self.records):
            for c in r.chunks:
                uses.setdefault(c, []).append(i)
        self._uses = uses
        self.frozen = True

    @property
    def n_moments(self) -> int:
        return len(self.records)

    @property
    def max_non_model(self) -> int:
        return max((r.non_model_peak for r in self.records), default=0)

    def non_model_at(self, moment: int) -> int:
        """Expected peak non-model bytes during ``moment`` (the trace's maximum when off-schedule)."""
        if 0 <= moment < len(self.records):
            return self.records[moment].non_model_peak
        return self.max_non_model

    def matches(self, moment: int, chunks: tuple[int, ...]) -> bool:
        return 0 <= moment < len(self.records) and self.records[moment].chunks == chunks

    def next_use(self, chunk: int, after: int) -> int | None:
        """Moments from ``after`` until ``chunk`` is accessed again (wrapping into the
        next micro-step); None if the trace never accesses it."""
        uses = self._uses.get(chunk)
        if not uses:
            return None
        i = bisect.bisect_right(uses, after)
        if i < len(uses):
            return uses[i] - after
        return uses[0] + len(self.records) - after

    def chunks_at(self, moment: int) -> tuple[int, ...]:
        if 0 <= moment < len(self.records):
            return self.records[moment].chunks
        return ()
