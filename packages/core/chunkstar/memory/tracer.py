"""The warm-up memory trace: per moment, what was accessed and how much
non-model memory the device held.

A *moment* is one access within a training iteration: a module's pre-hook
(forward or backward), or a parameter read outside its module (Note
[parameter guard]). An *iteration* runs from the first training forward
after the previous backward to the end of the next backward, however many
forwards it holds (R-Drop and consistency losses run two), and moments are
numbered across all of them.

The warm-up traces the first two iterations: the first alone would miss what
user code keeps alive *across* iterations (the previous step's outputs and
logits, say, which live on during the next forward), so each moment keeps
the larger peak of the two passes. Each pass also keeps its own records
(Note [every path measured]). :meth:`MemoryTrace.freeze` then turns the
records into the schedule the policies read: the chunk budget of each moment
and the next use of each chunk. Iterations repeat, so "next use" wraps
around into the next iteration.

After the freeze the runtime checks every iteration against the trace
(:meth:`MemoryTrace.matches`, :meth:`MemoryTrace.grew`): another sequence of
moments (new control flow) or more activation bytes than traced (a longer
sequence, a bigger batch) means the schedule no longer describes the run,
and the runtime re-plans (:class:`TracePhase`).
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field
from typing import Iterator

from chunkstar.errors import ChunkStateError

__all__ = ["GROWTH_MARGIN", "MomentRecord", "MemoryTrace", "ScheduleMode", "TracePhase", "check_phase_transition"]

GROWTH_MARGIN = 0.1
"""Activation bytes may exceed the traced figure by this fraction before the
trace counts as outgrown (allocator rounding and small shape jitter stay below it)."""


class TracePhase(enum.Enum):
    WARMUP = "warmup"
    """Tracing: the device keeps only the running moment's chunks; budgets use live measurements."""
    FROZEN = "frozen"
    """The trace is the schedule: per-moment budgets, furthest-next-use eviction, prefetch."""
    DIVERGED = "diverged"
    """This iteration left the schedule: it finishes as in warm-up, and the next one re-traces."""
    UNSCHEDULED = "unscheduled"
    """The run changed shape too often to schedule: every iteration runs as in warm-up, for good."""


class ScheduleMode(enum.Enum):
    """How the running moments relate to the warm-up trace (Note [iteration] and Note
    [evaluation budgets] in runtime/schedule.py). The schedule derives it from its phase,
    the running iteration and the evaluations in flight, and is the only writer."""

    TRACING = "tracing"
    """A training pass (or the time between passes) with no trace to trust: a warm-up pass,
    an iteration that left the schedule, a run gone unscheduled. Budgets are measured live
    and a moment keeps only its own chunks on the device."""
    FOLLOWING = "following"
    """A training pass (or the time between passes) on the frozen trace: its next uses,
    per-moment budgets, prefetch and clean host copies hold."""
    EVALUATING_ALONG = "evaluating-along"
    """An evaluation forward numbered as the traced forward's moments, each budgeted with
    its traced moment's peak (and the live figure, if larger)."""
    EVALUATING_OFF = "evaluating-off"
    """An evaluation forward the frozen trace does not describe (inside an iteration, larger
    inputs, another path): budgeted with the trace's largest peak (or the live figure)."""
    EVALUATING_UNTRACED = "evaluating-untraced"
    """An evaluation forward with no trace to trust (before the trace froze, inside an
    iteration off the schedule): budgets live, only the moment's chunks kept."""

    @property
    def training(self) -> bool:
        """The moments are a training pass's (the schedule's own), not an evaluation's."""
        return self is ScheduleMode.TRACING or self is ScheduleMode.FOLLOWING

    @property
    def trusts_trace(self) -> bool:
        """The frozen trace describes the running moments well enough to budget by."""
        return self is not ScheduleMode.TRACING and self is not ScheduleMode.EVALUATING_UNTRACED


_P = TracePhase
_PHASE_EDGES: dict[TracePhase, frozenset[TracePhase]] = {
    _P.WARMUP: frozenset({_P.FROZEN, _P.WARMUP, _P.UNSCHEDULED}),
    _P.FROZEN: frozenset({_P.DIVERGED, _P.WARMUP}),
    _P.DIVERGED: frozenset({_P.WARMUP, _P.UNSCHEDULED}),
    _P.UNSCHEDULED: frozenset(),
}


def check_phase_transition(old: TracePhase, new: TracePhase) -> None:
    if new not in _PHASE_EDGES[old]:
        raise ChunkStateError(f"memory trace: illegal phase change {old.name} -> {new.name}")


@dataclass
class MomentRecord:
    module: str
    stage: str
    chunks: tuple[int, ...]
    """Param chunk ids the moment accessed (sorted)."""
    non_model_peak: int = 0
    """Peak non-model device bytes from this moment's start to the next moment's start."""
    output_bytes: int = 0
    """Bytes of the module's output tensors (forward moments of modules; the largest seen)."""


@dataclass
class MemoryTrace:
    records: list[MomentRecord] = field(default_factory=list)
    frozen: bool = False
    passes: int = 0
    """Completed warm-up iterations merged into the records."""
    input_bytes: int = 0
    """Largest total bytes of tensor arguments given to a traced forward."""
    _current: list[MomentRecord] = field(default_factory=list)
    """The running pass's own records (the first pass's are the merged ones themselves)."""
    _uses: dict[int, list[int]] = field(default_factory=dict)
    _run_end: list[int] = field(default_factory=list)
    _run_peak: list[int] = field(default_factory=list)

    # Note [every path measured]: the budget check of a warm-up moment (runtime/schedule.py)
    # reads the running pass's own record, never the merged one at the same index: a
    # pass that took another path (stochastic depth skips blocks at random) has other
    # modules and chunks there, and moments past the first pass's last, which the
    # merged records do not hold. Checked against the merged records, such a pass
    # was measured with another moment's chunks, or not at all, and the smallest
    # budget the warm-up advised did not hold for the paths it had run.

    def record(self, index: int, rec: MomentRecord) -> bool:
        """Moment ``index`` of the running pass. A later pass merges into the first
        pass's record of the same index (keeping the larger peak, see
        :meth:`set_peak`); moments beyond the first pass's are appended. Returns
        False when a later pass disagrees with the first (another module, stage
        or chunk set at this index, or more moments): the warm-up then starts over.
        The pass's own record is kept either way (Note [every path measured])."""
        assert not self.frozen, "the trace is frozen after warm-up"
        if index == len(self._current):
            self._current.append(rec)
        if self.passes > 0:
            return index < len(self.records) and self._same(self.records[index], rec)
        if index != len(self.records):
            return False
        self.records.append(rec)
        return True

    @staticmethod
    def _same(a: MomentRecord, b: MomentRecord) -> bool:
        return a.module == b.module and a.stage == b.stage and a.chunks == b.chunks

    def _merged(self, index: int) -> MomentRecord | None:
        """The merged record the running pass's moment ``index`` agrees with, if it does."""
        if 0 <= index < len(self.records) and index < len(self._current):
            r = self.records[index]
            return r if r is self._current[index] or self._same(r, self._current[index]) else None
        return None

    def add_chunks(self, index: int, chunks: tuple[int, ...]) -> None:
        """A moment accessed more chunks after it began (a parameter read outside its module)."""
        if self.frozen:
            return
        merged = self._merged(index)
        for r in (merged, self._current[index] if 0 <= index < len(self._current) else None):
            if r is not None:
                r.chunks = tuple(sorted(set(r.chunks) | set(chunks)))

    def end_pass(self, n_moments: int) -> bool:
        """A warm-up iteration ended after ``n_moments`` moments; False if it had fewer than the first."""
        self.passes += 1
        self._current = []
        return n_moments == len(self.records)

    def set_peak(self, index: int, peak: int) -> None:
        """The running pass's moment ``index`` peaked at ``peak``: its own record keeps it,
        and so does the merged one where the pass agrees with it."""
        merged = self._merged(index)
        if merged is not None:
            merged.non_model_peak = max(merged.non_model_peak, peak)
        if 0 <= index < len(self._current):
            r = self._current[index]
            r.non_model_peak = max(r.non_model_peak, peak)

    def pass_moment(self, index: int) -> MomentRecord | None:
        """The running pass's moment ``index``, with the larger of its own peak and the merged
        one where it agrees with the merged record (Note [every path measured])."""
        if not 0 <= index < len(self._current):
            return None
        own = self._current[index]
        merged = self._merged(index)
        if merged is None or merged is own:
            return own
        return MomentRecord(own.module, own.stage, own.chunks, max(own.non_model_peak, merged.non_model_peak), own.output_bytes)

    def pass_path(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """The running pass's sequence of moments (module, stage, chunks): its path through the model."""
        return tuple((r.module, r.stage, r.chunks) for r in self._current)

    @property
    def pass_peak(self) -> int:
        """The largest non-model peak of the running pass so far."""
        return max((r.non_model_peak for r in self._current), default=0)

    def set_output_bytes(self, index: int, nbytes: int) -> None:
        merged = self._merged(index)
        if merged is not None:
            merged.output_bytes = max(merged.output_bytes, nbytes)

    def freeze(self) -> None:
        uses: dict[int, list[int]] = {}
        for i, r in enumerate(self.records):
            for c in r.chunks:
                uses.setdefault(c, []).append(i)
        self._uses = uses
        # runs of consecutive moments with the same chunks (many small modules share a chunk):
        # for each moment, where its run ends and the largest non-model peak from it to there
        n = len(self.records)
        self._run_end = [n] * n
        self._run_peak = [0] * n
        for j in range(n - 1, -1, -1):
            r = self.records[j]
            if j + 1 < n and self.records[j + 1].chunks == r.chunks:
                self._run_end[j] = self._run_end[j + 1]
                self._run_peak[j] = max(r.non_model_peak, self._run_peak[j + 1])
            else:
                self._run_end[j] = j + 1
                self._run_peak[j] = r.non_model_peak
        self.frozen = True

    def runs_after(self, moment: int) -> Iterator[tuple[int, int, tuple[int, ...]]]:
        """The frozen schedule after ``moment``, run by run: (first moment, largest non-model
        peak until the run ends, chunks) for each stretch of moments that need the same chunks."""
        j = moment + 1
        while 0 <= j < len(self.records):
            yield j, self._run_peak[j], self.records[j].chunks
            j = self._run_end[j]

    def absorb_peaks(self, older: MemoryTrace) -> None:
        """Keep an outgrown trace's larger figures where the moments agree, so a
        re-trace never plans below what an earlier shape of the run needed."""
        for mine, old in zip(self.records, older.records):
            if self._same(mine, old):
                mine.non_model_peak = max(mine.non_model_peak, old.non_model_peak)
                mine.output_bytes = max(mine.output_bytes, old.output_bytes)
        self.input_bytes = max(self.input_bytes, older.input_bytes)

    # ------------------------------------------------------------------ checks against the frozen trace
    def matches(self, moment: int, module: str, stage: str, chunks: tuple[int, ...]) -> bool:
        return 0 <= moment < len(self.records) and self._same(self.records[moment], MomentRecord(module, stage, chunks))

    def has_chunks(self, moment: int, chunks: tuple[int, ...]) -> bool:
        return 0 <= moment < len(self.records) and set(chunks) <= set(self.records[moment].chunks)

    def grew(self, traced: int, now: int) -> bool:
        """Whether ``now`` bytes exceed the ``traced`` figure by more than the margin."""
        return now > traced * (1 + GROWTH_MARGIN) + 256

    # ------------------------------------------------------------------ schedule queries
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

    def output_bytes_at(self, moment: int) -> int:
        return self.records[moment].output_bytes if 0 <= moment < len(self.records) else 0

    def next_use(self, chunk: int, after: int) -> int | None:
        """Moments from ``after`` until ``chunk`` is accessed again (wrapping into the
        next iteration); None if the trace never accesses it."""
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
