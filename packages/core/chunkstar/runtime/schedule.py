"""The iteration's schedule: warm-up tracing, checks against the frozen trace, re-planning.

Note [iteration]: an iteration runs from the first training forward after the
previous backward to the end of the next backward, however many forwards it
holds (R-Drop runs two); moments are numbered across all of them. The first
``WARMUP_PASSES`` iterations are traced (:attr:`TracePhase.WARMUP`); then the
trace is the schedule (``FROZEN``). Every later iteration is checked against
it: its inputs' bytes, each moment's module/stage/chunks, each module's output
bytes (and, on CUDA, the live non-model memory). A difference means the
schedule no longer describes the run: the rest of the iteration runs as in
warm-up (``DIVERGED``: only the moment's chunks on the device) and the next
iterations trace again, keeping the old trace's larger peaks. A run that keeps
changing (``MAX_REPLANS`` re-traces) runs ``UNSCHEDULED`` for good, measuring
live. With several processes the ranks agree on phase changes at the end of
each iteration (one small all-reduce), so collective decisions stay identical
(Note [collective schedule] in :mod:`chunkstar.distributed.grad_reduce`).

During warm-up every moment's chunk bytes plus its measured non-model peak is
checked against the device: a budget too small fails at the end of the first
warm-up iteration with the smallest budget that would hold what was measured.

Note [advice covers the paths seen]: a model whose control flow changes between
iterations (stochastic depth skips blocks at random, a router picks experts)
takes another path through its modules each pass, and the warm-up re-traces
every time its passes disagree. Each pass's moments are checked on their own
records (Note [every path measured] in memory/tracer.py), and the schedule keeps,
across the passes and re-traces of the warm-up (not across a failed iteration,
which leaves no trace behind), the largest non-model peak and the smallest budget
that held every moment measured: the error's minimum holds for every path seen,
and its message says how many that is, since no trace can know the paths it has
not run. ``warmup_non_model_peak`` reports the largest peak so far, which can
grow until the warm-up ends.

Note [evaluation budgets]: an evaluation forward (under ``torch.no_grad``) is not
on the schedule, and on the CPU device nothing measures it after the warm-up, so
each of its moments has to be budgeted from the trace. The trace's largest
non-model peak is safe for any evaluation, but it usually comes from the loss and
the start of backward, and it would deny an early forward moment (the embedding's
chunk) the room it had in training: a budget that trains could fail to evaluate.
So an evaluation that begins between steps, on inputs no bigger than the traced
ones, numbers its moments as the traced forward's and budgets the k-th with the
traced k-th moment's peak, as long as its moments are the forward's (module,
stage and chunks); without autograd it keeps no more than the training forward
kept at the same point. Anything else (an evaluation inside an iteration, larger
inputs, another path) gets the trace's largest peak from there on.

The schedule is also the one writer of the iteration's :class:`Cursor` (stage,
moment, module, the :class:`ScheduleMode`, the trace): the hook targets, the
iteration and the optimizer step move it through the methods below, and
everyone else reads it. The mode is derived in one place (``_update_mode``) from
the schedule's own facts: whether the trace is frozen, whether the running
iteration left it (``_safe``: it runs as in warm-up), whether an evaluation is
in flight and whether it follows the traced forward. The schedule decides; the
chunk manager acts.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from chunkstar.chunk.layout import TensorSlot
from chunkstar.chunk.lists import ChunkList
from chunkstar.device.memory import METER_ENV
from chunkstar.device.virtual import env_switch, strict_device
from chunkstar.distributed.comm import Comm
from chunkstar.errors import DeviceMemoryError
from chunkstar.events import EventBus, Stage, StageChanged
from chunkstar.memory.budget import Overrun, minimum_budget
from chunkstar.memory.cursor import Cursor
from chunkstar.memory.tracer import MemoryTrace, MomentRecord, ScheduleMode, TracePhase, check_phase_transition
from chunkstar.runtime.chunk_manager import ChunkManager

__all__ = ["MAX_REPLANS", "WARMUP_PASSES", "Schedule"]

WARMUP_PASSES = 2  # training iterations traced before the schedule is frozen (see memory/tracer.py)
MAX_REPLANS = 8  # re-traces before a run that keeps changing shape runs unscheduled
_WARMUP = "warm-up"  # the schedule's names as a holder of the memory probe: tracing,
_UNSCHEDULED = "unscheduled"  # and measuring live for lack of a schedule
_METER = "device-meter"  # the strict virtual device's meter: every forward and backward (METER_ENV)
_log = logging.getLogger("chunkstar")


class Schedule:
    def __init__(
        self, mgr: ChunkManager, cursor: Cursor, comm: Comm, device: torch.device, events: EventBus,
        overrun: Overrun, on_freeze: Callable[[], None],
        on_retrace: Callable[[], None] = lambda: None, on_too_small: Callable[[], bool] = lambda: False,
        activation_advice: Callable[[int, int], str] = lambda _moment, _need: "",
    ) -> None:  # fmt: skip
        self.mgr = mgr
        self.cursor = cursor  # the manager's, which reads it; written here only
        self.events = events
        self._untraced_depth = 0  # evaluation forwards running (not on the schedule)
        # the facts the cursor's mode is derived from (_update_mode), besides the trace's own
        # frozen state and the evaluations running: the iteration runs as in warm-up (a warm-up
        # pass, one that left the schedule, unscheduled), and an evaluation follows the traced forward
        self._safe = False
        self._eval_follows = False
        self._saved_moment = -1  # the training iteration's moment when the first of them began
        self.comm = comm
        self.device = device
        self._on_freeze = on_freeze  # the engine plans the activations and hybrid Adam on the new trace
        # the run changed shape and is traced again (the activation plan measures again); a warm-up
        # found its budget too small: True when the activation plan fell back to one that fit, and
        # the warm-up goes on with it instead of raising (Note [activation plan] in activations/plan.py)
        self._on_retrace = on_retrace
        self._on_too_small = on_too_small
        # what the blocks' saved activations were at a moment that did not fit, and what "auto" would do
        self._activation_advice = activation_advice
        self.phase = TracePhase.WARMUP
        self.replans = 0
        self._outgrown: MemoryTrace | None = None  # the trace a re-trace replaces (its peaks are kept)
        self._diverged_why = ""  # why this iteration left the schedule ("" while on it)
        self._warmup_disagrees = False  # a warm-up pass differed from the first one
        # (minimum budget, moment, its chunk bytes, its non-model peak, its chunks, its index): the worst warm-up moment that did not fit
        self._too_small: tuple[int, str, int, int, tuple[int, ...], int] | None = None
        # Note [advice covers the paths seen]: the completed warm-up passes, over every re-trace
        self._pass_need = 0  # the running pass's smallest budget holding each of its moments
        self._seen_need = 0  # the same over the completed passes
        self._seen_peak = 0  # their largest non-model peak
        self._seen_passes = 0
        self._seen_paths: set[int] = set()  # hashes of their sequences of moments
        # the CPU virtual device's meter measures every forward and backward, not the warm-up's
        # only (on the CPU every tensor is a host tensor: code between steps is not the device's);
        # the meta device's always does, as CUDA's allocator always counts (Note [the meta device])
        self._metered = device.type == "meta" or device.type == "cpu" and (env_switch(METER_ENV) or strict_device())
        self._meter_evaluation = False  # the meter was taken for an evaluation between steps
        # warm-up: a moment whose chunks do not fit is let through (the manager asks the
        # overrun) and the chunk bytes it held at once kept, so the error at the end of the
        # iteration can name the smallest budget for all of it instead of raising at once
        self._overrun = overrun
        self.went_over = False
        """A warm-up found its budget too small: it let moments go over it to measure the
        smallest that fits, then raised (the device held more than its budget meanwhile)."""

    # ------------------------------------------------------------------ the cursor
    def set_stage(self, stage: Stage) -> None:
        cur = self.cursor
        if cur.stage is not stage:
            cur.stage = stage
            if self.events.active:
                self.events.emit(StageChanged(stage, time.perf_counter_ns()))

    def begin_moment(self, module: str, chunk_ids: tuple[int, ...]) -> int:
        """A module's pre-hook (or a read outside modules) begins the next moment; its number."""
        cur = self.cursor
        cur.moment += 1
        cur.module = module
        if cur.mode.training:
            self.on_moment(module, cur.stage.value, chunk_ids)
        elif self._eval_follows and not cur.trace.matches(cur.moment, module, Stage.FWD.value, chunk_ids):
            self._eval_follows = False  # another path than the traced forward's: the trace's maximum from here
            self._update_mode()
        return cur.moment

    def begin_untraced(self, input_bytes: int | None = None, between_steps: bool = False) -> None:
        """An evaluation forward (under no_grad) begins: its moments are not the schedule's.
        ``input_bytes``: its tensor inputs' bytes, when known; ``between_steps``: no training
        iteration is open (Note [evaluation budgets])."""
        self._untraced_depth += 1
        if self._untraced_depth == 1:
            self._meter_evaluation = self._metered and between_steps
            if self._meter_evaluation:
                self.mgr.probe.acquire(_METER)
            cur = self.cursor
            self._saved_moment = cur.moment
            self._eval_follows = (
                between_steps and self.phase is TracePhase.FROZEN and input_bytes is not None
                and input_bytes <= cur.trace.input_bytes
            )  # fmt: skip
            self._update_mode()
            if self._eval_follows:
                cur.moment = -1  # numbered as the traced forward's moments, from the first

    def end_untraced(self) -> bool:
        """An evaluation forward ended; whether it was the outermost (the schedule's moments resume)."""
        self._untraced_depth -= 1
        if self._untraced_depth:
            return False
        if self._meter_evaluation:  # between steps (an iteration in flight keeps its own hold)
            self.mgr.probe.release(_METER)
            self._meter_evaluation = False
        self._eval_follows = False
        self._update_mode()
        self.cursor.moment = self._saved_moment
        return True

    def begin_optimizer_step(self) -> None:
        self.set_stage(Stage.OPTIM)
        self.cursor.moment = -1
        self.cursor.module = "optimizer"

    def end_optimizer_step(self) -> None:
        """The step is over (the stage goes back to IDLE after the caller's last samples)."""
        self.cursor.module = ""

    # ------------------------------------------------------------------ iteration
    def begin_iteration(self, input_bytes: int) -> None:
        mgr = self.mgr
        cur = self.cursor
        cur.moment = -1
        if self._metered:
            mgr.probe.acquire(_METER)
        if self.phase is TracePhase.FROZEN and cur.trace.grew(cur.trace.input_bytes, input_bytes):
            why = f"the inputs hold {input_bytes} bytes, the traced ones {cur.trace.input_bytes}"
            if self.comm.distributed:
                self.diverge(why)  # re-traced from the next iteration, when all ranks agree
            else:
                self._retrace(why)  # trace this very iteration
        if self.phase is TracePhase.WARMUP:
            mgr.probe.acquire(_WARMUP)
            cur.trace.input_bytes = max(cur.trace.input_bytes, input_bytes)
            self._overrun.measuring = True
            self._overrun.required_peak = 0
        elif self.phase is TracePhase.UNSCHEDULED:
            mgr.probe.acquire(_UNSCHEDULED)  # no trace to read budgets from: measure live
        self._safe = self.phase is not TracePhase.FROZEN
        self._update_mode()

    def end_iteration(self) -> None:
        """Close the iteration: merge a warm-up pass, freeze, or re-plan (all ranks alike).
        Raises :class:`DeviceMemoryError` when a warm-up moment did not fit the device."""
        mgr = self.mgr
        cur = self.cursor
        too_small = None
        covered = (self._seen_passes, len(self._seen_paths))  # passes, paths: what a minimum covers
        mgr.probe.release(_UNSCHEDULED)
        mgr.probe.release(_METER)
        self._overrun.measuring = False
        if mgr.probe.held_by(_WARMUP):
            self._close_traced_moment(cur.moment)  # the last moment's own peak (Note [the last moment's peak])
            mgr.probe.release(_WARMUP)
            too_small, self._too_small = self._too_small, None
            path, peak, need = hash(cur.trace.pass_path()), cur.trace.pass_peak, self._pass_need
            # what the error's minimum covers: the completed passes and this one
            covered = (self._seen_passes + 1, len(self._seen_paths | {path}))
            if too_small is None:  # a pass that failed leaves no trace behind (abort)
                self._seen_passes += 1
                self._seen_paths.add(path)
                self._seen_peak = max(self._seen_peak, peak)
                self._seen_need = max(self._seen_need, need)
            else:  # it holds every moment seen, this pass's and the completed passes'
                too_small = (max(too_small[0], self._seen_need), *too_small[1:])
            self._pass_need = 0
            if not cur.trace.end_pass(cur.moment + 1):
                self._warmup_disagrees = True
        elif self.phase is TracePhase.FROZEN and not self._diverged_why and cur.moment + 1 != cur.trace.n_moments:
            self.diverge(f"the iteration had {cur.moment + 1} moments, the trace {cur.trace.n_moments}")
        self._too_small = None
        self._safe = False
        self._update_mode()
        # several processes: every rank takes the same decision (one all-reduce per iteration)
        flags = [float(bool(self._diverged_why)), float(self._warmup_disagrees), float(too_small[0] if too_small else 0)]
        if self.comm.distributed:
            t = torch.tensor(flags, dtype=torch.float64)
            flags = self.comm.all_reduce_max(t, what="the schedule check", device=self.device).tolist()
        if flags[2] > 0:
            if self.phase is TracePhase.WARMUP and self._on_too_small():
                self.trace_again("the activation plan did not fit: every block offloaded, as measured")
                return
            self.went_over = True
            raise self._too_small_error(int(flags[2]), too_small, covered)
        if self.phase is TracePhase.WARMUP:
            if flags[1]:
                self._retrace("the warm-up iterations ran different sequences of moments")
            elif cur.trace.passes >= WARMUP_PASSES:
                if self._outgrown is not None:
                    cur.trace.absorb_peaks(self._outgrown)
                    self._outgrown = None
                cur.trace.freeze()
                self._set_phase(TracePhase.FROZEN)
                self._update_mode()
                self._on_freeze()
        elif self.phase in (TracePhase.FROZEN, TracePhase.DIVERGED) and flags[0]:
            self._retrace(self._diverged_why or "another rank left the schedule")

    def abort(self) -> None:
        """The iteration failed (an exception in forward or backward): stop measuring,
        drop a partial warm-up pass, stay on the schedule otherwise."""
        mgr = self.mgr
        cur = self.cursor
        self._untraced_depth = 0
        self._eval_follows = False
        mgr.probe.release(_WARMUP)
        mgr.probe.release(_UNSCHEDULED)
        mgr.probe.release(_METER)
        self._safe = False
        self._overrun.measuring = False
        self._too_small = None
        self._pass_need = 0
        if self.phase is TracePhase.WARMUP:
            cur.trace = MemoryTrace()
            self._warmup_disagrees = False
        elif self.phase is TracePhase.FROZEN:
            self._diverged_why = ""
        self._update_mode()

    # ------------------------------------------------------------------ checks
    def on_moment(self, module: str, stage: str, chunk_ids: tuple[int, ...]) -> None:
        """A moment of the running iteration began (its number is ``cur.moment``)."""
        mgr = self.mgr
        cur = self.cursor
        if mgr.probe.held_by(_WARMUP):
            self._close_traced_moment(cur.moment - 1)  # the moment before the one that begins
            if not cur.trace.record(cur.moment, MomentRecord(module, stage, chunk_ids)):
                self._warmup_disagrees = True
        elif self.phase is TracePhase.FROZEN and not self._diverged_why:
            if not cur.trace.matches(cur.moment, module, stage, chunk_ids):
                expected = cur.trace.records[cur.moment] if cur.moment < cur.trace.n_moments else None
                self.diverge(
                    f"moment {cur.moment} is '{module}' ({stage}) on chunks {list(chunk_ids)}, the trace has "
                    + (f"'{expected.module}' ({expected.stage}) on chunks {list(expected.chunks)}" if expected else "no such moment")
                )
            elif self.device.type == "cuda" and cur.moment > 0:
                live = mgr.probe.non_model_now(mgr.memory.held_bytes)
                traced = cur.trace.non_model_at(cur.moment - 1)
                if cur.trace.grew(traced, live):
                    self.diverge(f"{live} bytes of non-model memory at moment {cur.moment}, traced at most {traced}")

    def on_module_output(self, began: int, label: str, nbytes: int) -> None:
        """A module whose moment was ``began`` returned ``nbytes`` of tensors (forward)."""
        mgr = self.mgr
        cur = self.cursor
        if mgr.probe.held_by(_WARMUP):
            cur.trace.set_output_bytes(began, nbytes)
        elif self.phase is TracePhase.FROZEN and cur.trace.grew(cur.trace.output_bytes_at(began), nbytes):
            self.diverge(f"'{label}' returned {nbytes} bytes, traced {cur.trace.output_bytes_at(began)}")

    def on_more_chunks(self, began: int, chunk_ids: tuple[int, ...], why: str) -> None:
        """The moment ``began`` needs more chunks than it started with (a parameter read outside its module)."""
        mgr = self.mgr
        if mgr.probe.held_by(_WARMUP):
            self.cursor.trace.add_chunks(began, chunk_ids)
        elif self.phase is TracePhase.FROZEN and not self.cursor.trace.has_chunks(began, chunk_ids):
            self.diverge(f"{why}, which the trace did not see")

    @property
    def minimum_budget(self) -> int:
        """The smallest ``device_memory_budget`` that holds every moment the completed warm-up
        passes measured (their chunks, scratch and non-model peak): the figure a
        :class:`DeviceMemoryError` names as its minimum, also for a run that fits."""
        return self._seen_need

    @property
    def warmup_non_model_peak(self) -> int:
        """The largest non-model peak the warm-up has measured so far: over its completed
        passes, re-traces included, and the trace now read. It can still grow until the
        warm-up ends (Note [advice covers the paths seen])."""
        trace = self.cursor.trace
        return max(self._seen_peak, trace.max_non_model, 0 if trace.frozen else trace.pass_peak)

    @property
    def frozen(self) -> bool:
        """Whether budgets, eviction and prefetch follow the trace in the running iteration."""
        return self.phase is TracePhase.FROZEN and not self._safe

    def _update_mode(self) -> None:
        """Derive the cursor's :class:`ScheduleMode` from the facts it depends on: the one
        place it is written (called after each of them changes)."""
        cur = self.cursor
        trusted = cur.trace.frozen and not self._safe
        if not self._untraced_depth:
            cur.mode = ScheduleMode.FOLLOWING if trusted else ScheduleMode.TRACING
        elif not trusted:
            cur.mode = ScheduleMode.EVALUATING_UNTRACED
        else:
            cur.mode = ScheduleMode.EVALUATING_ALONG if self._eval_follows else ScheduleMode.EVALUATING_OFF

    # ------------------------------------------------------------------ phase changes
    def _set_phase(self, new: TracePhase) -> None:
        check_phase_transition(self.phase, new)
        self.phase = new

    def diverge(self, why: str) -> None:
        """This iteration left the schedule: finish it safely, re-trace from the next one."""
        if self.phase is not TracePhase.FROZEN or self._diverged_why:
            return
        self._diverged_why = why
        self._safe = True
        self._update_mode()
        if not self.comm.distributed:  # with several processes the phase changes when the ranks agree
            self._set_phase(TracePhase.DIVERGED)

    def _retrace(self, why: str) -> None:
        """Drop the schedule and trace again (keeping the old trace's larger peaks)."""
        self.replans += 1
        if self.phase is TracePhase.FROZEN:
            self._set_phase(TracePhase.DIVERGED)
        if self.replans > MAX_REPLANS:
            self._set_phase(TracePhase.UNSCHEDULED)
            _log.warning(
                "chunkstar: the run changed its shape %d times (last: %s); it now runs unscheduled "
                "(only each moment's chunks stay on the device, no prefetch)", self.replans, why,
            )  # fmt: skip
        else:
            self._set_phase(TracePhase.WARMUP)
            _log.warning("chunkstar: the warm-up trace no longer matches the run (%s); tracing again", why)
        if self.cursor.trace.frozen:
            self._outgrown = self.cursor.trace
        self.cursor.trace = MemoryTrace()
        self._diverged_why = ""
        self._warmup_disagrees = False
        self._update_mode()
        self._on_retrace()

    def trace_again(self, why: str) -> None:
        """Trace the next iterations afresh, the old trace's peaks dropped: the run itself changed
        what it holds (a new activation plan), so they no longer describe it. All ranks call it alike."""
        if self.phase is TracePhase.FROZEN:
            self._set_phase(TracePhase.WARMUP)
        _log.info("chunkstar: tracing again (%s)", why)
        self.cursor.trace = MemoryTrace()
        self._outgrown = None
        self._diverged_why = ""
        self._warmup_disagrees = False
        self._update_mode()

    # ------------------------------------------------------------------ budget too small
    def _close_traced_moment(self, m: int) -> None:
        """Warm-up: moment ``m`` is over (a new moment began, or the iteration ended after
        it); its peak is known. A moment whose chunks and non-model peak exceed the device
        is remembered for the error raised at the end of this warm-up iteration (with the
        whole minimum).

        Note [the last moment's peak]: the peak since the previous reading belongs to the
        moment that was running, which at the end of the iteration is the last one (the
        running moment), not the one before it. Closed as the one before, the last
        backward moment (the embedding's, where the embedding gradient and the loss's
        tensors peak) was traced at 0 bytes and the one before it took its peak: on the
        frozen schedule the last moment's chunk budget was the whole device, so it took
        its chunks without settling the frees still pending from the moment before, and
        the device held its peak beside them. Whether those copies were done by then was
        timing: with two busy processes on the machine, or slow copies, the meter went
        over the budget (docs/design.md, 'Budgets, eviction and prefetch')."""
        mgr = self.mgr
        cur = self.cursor
        cur.trace.set_peak(m, mgr.probe.take_peak(mgr.memory.held_bytes))
        # the collectives' flat buffers the moment held (under NCCL): scratch beside its chunks, not
        # in its non-model peak (Note [scratch counted once] in distributed/comm.py)
        scratch = self.comm.scratch_bytes_peak
        self.comm.reset_scratch_peak()
        rec = cur.trace.pass_moment(m)  # this pass's own moment (Note [every path measured])
        if rec is None:
            return
        # the moment's chunks, or more when it went over the budget with others pinned beside them
        chunks = max(self.moment_chunk_bytes(rec.chunks), self._overrun.required_peak) + scratch
        self._overrun.required_peak = 0
        need = minimum_budget(chunks, rec.non_model_peak, mgr.slack)
        self._pass_need = max(self._pass_need, need)
        if chunks + rec.non_model_peak > mgr.capacity:
            if self._too_small is None or need > self._too_small[0]:
                self._too_small = (need, f"'{rec.module}' ({rec.stage})", chunks, rec.non_model_peak, rec.chunks, m)

    def moment_chunk_bytes(self, chunk_ids: tuple[int, ...]) -> int:
        """Param chunk bytes a moment needs on the device (whole groups with several processes)."""
        mgr = self.mgr
        ids = {k for c in chunk_ids for k in mgr.layout.group(c)} if self.comm.distributed else set(chunk_ids)
        return sum(mgr.chunks.chunk(ChunkList.PARAM, c).nbytes for c in ids)

    def _too_small_error(
        self, minimum: int, too_small: tuple[int, str, int, int, tuple[int, ...], int] | None, covered: tuple[int, int]
    ) -> DeviceMemoryError:
        """The error for a warm-up that did not fit; ``covered``: the warm-up iterations and the
        distinct paths through the model the minimum holds for (Note [advice covers the paths seen])."""
        mgr = self.mgr
        if too_small is not None:
            _, where, chunks, non_model, chunk_ids, moment = too_small
        else:
            where, chunks, non_model, chunk_ids, moment = "a moment on another rank", minimum, 0, (), -1
        room = mgr.capacity - non_model  # chunk memory the moment had beside its non-model peak

        def bytes_of(s: TensorSlot) -> int:
            return s.numel * mgr.chunks.chunk(ChunkList.PARAM, s.chunk_id).dtype.itemsize

        # why smaller chunks cannot help, if they cannot: a parameter that takes much of the device
        # (it has a chunk of its own); non-model memory that fills the device by itself; or, in this
        # moment, a parameter larger than the room its non-model peak left
        biggest = max(mgr.slots, key=lambda s: s.numel)
        in_moment = max((s for c in chunk_ids for s in mgr.slots_of(c)), key=lambda s: s.numel, default=None)
        if bytes_of(biggest) * 2 > mgr.capacity:
            why = f"one parameter alone, '{biggest.name}' ({bytes_of(biggest)} bytes), takes much of the device"
        elif room <= 0:
            why = f"the non-model memory alone ({non_model} bytes) fills the device"
        elif in_moment is not None and bytes_of(in_moment) > room:
            why = (
                f"one parameter alone, '{in_moment.name}' ({bytes_of(in_moment)} bytes), is larger than the "
                "chunk memory left beside the non-model memory"
            )
        else:
            why = ""
        if why:
            advice = (
                f"raise 'device_memory_budget' to at least {minimum} bytes; {why}, so smaller chunks cannot help; "
                "or lower the batch size or sequence length (or set 'activations': {\"policy\": "
                "\"checkpoint\"} or \"offload\", or enable the model's own activation checkpointing) to shrink the "
                "non-model memory"
            )
        else:
            advice = (
                f"raise 'device_memory_budget' to at least {minimum} bytes; or lower the batch size or sequence "
                "length (or set 'activations': {\"policy\": \"checkpoint\"} or \"offload\") to shrink the non-model "
                "memory; or lower "
                "'default_chunk_size' so a moment needs fewer whole chunks"
            )
        activations = self._activation_advice(moment, chunks + non_model) if moment >= 0 else ""
        if activations:
            advice = f"{activations}. Otherwise: {advice}"
        return DeviceMemoryError(
            device=str(self.device), needed=chunks, free=max(0, mgr.capacity - non_model), budget=mgr.capacity,
            where=f"the warm-up iteration's moment {where}, whose non-model memory peaked at {non_model} bytes",
            minimum=minimum, advice=advice, covers=_covers(*covered),
        )  # fmt: skip


def _covers(passes: int, paths: int) -> str:
    """What a warm-up's minimum holds for, as the error says it (Note [advice covers the paths seen])."""
    its = "iteration" if passes == 1 else "iterations"
    if paths <= 1:
        return (
            f"the one path through the model that the {passes} warm-up {its} traced so far took: a model whose "
            "control flow changes between iterations (stochastic depth, random routing, data-dependent branches) "
            "can need more on a path not yet seen, so leave room above it"
        )
    return (
        f"the {paths} different paths through the model that the {passes} warm-up {its} traced so far took: its "
        "control flow changes between iterations, and a path not yet seen can need more, so leave room above it"
    )
