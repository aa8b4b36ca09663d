"""The training iteration's lifecycle: begin, backward, end, abort, the optimizer step.

Note [iteration] in :mod:`chunkstar.runtime.schedule` says what an iteration
is. This object opens one at the first training forward (or at a module called
directly, or a parameter read with autograd on between steps), closes it when
the backward ends, and leaves the engine usable when a forward or backward
raises. Evaluation forwards (``torch.no_grad()``) run beside the schedule.
It owns the warm-up's consequences (the :class:`Schedule`, and the hybrid-Adam
placement planned when the trace freezes), the module stack the hook targets
push and pop, and, on the CPU virtual device, when the heap's free pages go
back to the system (Note [host heap] in :mod:`chunkstar.memory.host_heap`).

It is not the model API (:mod:`chunkstar.runtime.engine`) and not what a
module's hooks do (:mod:`chunkstar.runtime.hook_targets`); gradients are
:mod:`chunkstar.runtime.gradients`'.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch
from torch.autograd.graph import get_gradient_edge

from chunkstar.activations import MIN_OFFLOAD_BYTES, BlockActivations
from chunkstar.activations.measure import SavedCounter
from chunkstar.activations.plan import ActivationPlan, LinkLoad, StateRoom
from chunkstar.chunk.lists import STATE_LISTS, ChunkList
from chunkstar.chunk.state import TensorState
from chunkstar.config import ActivationPolicy, ScheduleConfig
from chunkstar.distributed.comm import Comm
from chunkstar.distributed.grad_reduce import GroupReducer
from chunkstar.errors import ChunkStateError, DeviceMemoryError
from chunkstar.events import EventBus, MoveReason, Stage
from chunkstar.hooks.module_hooks import output_tensors
from chunkstar.memory.host_heap import (
    NO_HEAP, HeapPlan, HostHeap, plan_heap_release, release_after_step, release_at_turn, release_before_step,
)  # fmt: skip
from chunkstar.memory.budget import Overrun, minimum_budget
from chunkstar.memory.cursor import Cursor
from chunkstar.memory.tracer import TracePhase
from chunkstar.placement.optimizer import moment_footprints, plan_device_adam, resident_footprint
from chunkstar.runtime.activation_planning import PlanReport, block_spans, measure_link, plan_blocks, refine
from chunkstar.runtime.chunk_manager import ChunkManager
from chunkstar.runtime.gradients import GradientConsumer, Gradients
from chunkstar.runtime.reads import ReadState
from chunkstar.runtime.schedule import Schedule

__all__ = ["Iteration"]

_log = logging.getLogger("chunkstar")


class Iteration:
    def __init__(
        self, schedule: ScheduleConfig, mgr: ChunkManager, cursor: Cursor, comm: Comm, events: EventBus,
        reducer: GroupReducer, *, accumulation_steps: int, consumer: GradientConsumer, device_adam_chunks: set[int],
        hybrid_adam: bool, loss_scaling: bool, overrun: Overrun, reads: ReadState,
    ) -> None:  # fmt: skip
        """``schedule``: the config's section, its prefetch window resolved (Note [config
        sections]); ``accumulation_steps`` and ``consumer`` go to the gradients this builds
        (:class:`Gradients`); ``device_adam_chunks``: the set hybrid Adam's plan is written
        into when the trace freezes (the gradient pipeline reads it); ``hybrid_adam``: the
        optimizer section's, resolved (off with the state on disk); ``loss_scaling``: fp16's
        dynamic loss scale is on, so a plain ``loss.backward()`` is refused; ``overrun``: the
        warm-up's allowance to go over the budget, shared with the chunk manager; ``reads``:
        what parameter reads left behind, settled when a forward or an iteration ends or
        aborts (runtime/reads.py)."""
        self.mgr = mgr
        self.cursor = cursor
        self.comm = comm
        self.reducer = reducer
        # gradient folding and accumulation, told when a gradient arrives outside the backward
        # stage (Note [plain backward])
        self.gradients = Gradients(
            mgr, cursor, comm, reducer, accumulation_steps, consumer, on_plain_backward=self._gradient_outside_backward
        )
        self.reads = reads
        self.prefetch = schedule.prefetch
        assert schedule.prefetch_window is not None, "the engine resolves the prefetch window"
        self.prefetch_window = schedule.prefetch_window
        self.hybrid_adam = hybrid_adam
        # the iteration and its schedule (Note [iteration] in runtime/schedule.py)
        self.schedule = Schedule(
            mgr, cursor, comm, mgr.device, events, overrun, on_freeze=self._on_freeze,
            on_retrace=self._measure_activations, on_too_small=self._activation_fallback,
            activation_advice=self._activation_advice,
        )  # fmt: skip
        # the blocks' activation policies (set by the engine once it has wrapped them), the plan
        # of "auto" and what it was planned from (Note [activation plan] in activations/plan.py)
        self.activations: BlockActivations | None = None
        self.saved_counter: SavedCounter | None = None  # "keep": the blocks' saved bytes, counted in warm-up
        self.activation_plan: PlanReport | None = None
        self.activation_fallbacks = 0
        self._frozen_times_due = False  # the plan's first frozen step is timed, then planned on again
        self.host_update_seconds: float | None = None
        """Seconds a host Adam update takes per parameter: measured in the warm-up's first optimizer
        step (a dry run sets its target's); what a byte of device room is worth to "auto"'s plan."""
        self._step_began = 0.0
        self.link_bandwidth: float | None = None
        """The host link's bytes/s for auto's plan: timed once when first needed (a dry run sets
        its target's instead)."""
        # the chunk bytes the running iteration moved each way, when it began and when its backward did
        self._traffic_at: tuple[int, int] = (0, 0)
        self._traffic_fwd: tuple[int, int] = (0, 0)
        self.chunk_traffic = LinkLoad()
        """The last training iteration's chunk bytes over the host link, by pass and direction."""
        self._activation_bytes_at = (0, 0)
        self.activation_step_bytes = (0, 0)
        """The last training iteration's offloaded activation bytes: (to the host, back to the device)."""
        self.device_adam_chunks = device_adam_chunks  # chunks whose Adam runs on the device (hybrid Adam)
        self.micro_step = 0
        self.open = False  # a training forward began and its backward has not ended
        self.implicit = False  # a module was called directly (not through the engine) at IDLE
        # (module key, moment of its pre-forward) of the running modules, innermost last; the
        # hook targets push and pop, the iteration clears it
        self.stack: list[tuple[int, int]] = []
        # CPU virtual device: the heap's free pages go back to the system right before each
        # iteration's non-model peak (Note [host heap] in memory/host_heap.py)
        self.host_heap: HostHeap | None = HostHeap() if mgr.device.type == "cpu" else None
        self.heap_plan: HeapPlan = NO_HEAP  # this iteration's (memory/host_heap.py decides)
        self._heap_released = False  # the heap was released in this iteration
        self._moves_at_iteration = 0  # param chunk loads (access, prefetch) when the iteration began
        self._frozen_before = False  # the iteration before ran on the frozen schedule
        self._bytes_before_step = 0
        # Note [plain backward]
        self.loss_scaling = loss_scaling
        self.plain_backward = False  # the running backward is a plain loss.backward()
        self._decided_task: int | None = None  # the graph task whose kind was last decided
        # Note [closed engine]: engine.close() stopped the copy threads and the host worker, so a
        # forward, backward or step would wait on them for ever; each refuses instead
        self.closed = False

    # ------------------------------------------------------------------ begin
    def _check_open(self) -> None:
        if self.closed:
            raise ChunkStateError(
                "this engine was closed (engine.close()): its copy threads and chunk memory are gone, so it cannot "
                "run the model or step again. Build a new one with initialize_engine (engine.module.state_dict() "
                "still reads the trained values, and a checkpoint saved before closing resumes the run)"
            )

    def begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._check_open()
        if self.open and self.cursor.stage is Stage.BWD and self.plain_backward:
            self.abort()  # a plain loss.backward() that raised never ended: start clean
        if self.open:
            return  # another forward of the same iteration
        if self.gradients.has_pending():
            self.gradients.keep_pending()  # a second backward before the step (Note [gradients kept across a forward])
        self.open = True
        self.reads.reset()
        self.stack.clear()
        mgr = self.mgr
        self._traffic_at = (mgr.counters.bytes_to_device, mgr.counters.bytes_to_host)
        if self.activations is not None:
            off = self.activations.offload
            self._activation_bytes_at = (off.bytes_to_host, off.bytes_to_device)
        self.schedule.begin_iteration(sum(t.nbytes for t in output_tensors((args, kwargs))))
        if self.saved_counter is not None:
            self.saved_counter.reset()
            self.saved_counter.counting = self.schedule.phase is TracePhase.WARMUP
        # where the peak is: in the latest trace (frozen, or the warm-up's earlier passes), or unknown
        self._heap_released = False
        phase = self.schedule.phase
        frozen = phase is TracePhase.FROZEN
        loads = mgr.counters.moves_by_reason[MoveReason.ACCESS.value] + mgr.counters.moves_by_reason[MoveReason.PREFETCH.value]
        if self.host_heap is not None:
            self.heap_plan = plan_heap_release(
                self.cursor.trace, warmup=phase is TracePhase.WARMUP, frozen=frozen,
                frozen_before=self._frozen_before, loaded=loads > self._moves_at_iteration,
            )  # fmt: skip
        self._moves_at_iteration = loads
        self._frozen_before = frozen

    def begin_untraced(self, args: tuple[Any, ...] | None = None, kwargs: dict[str, Any] | None = None) -> None:
        """An evaluation forward: its moments are not the schedule's (its inputs, when the
        engine's forward is called, let it budget by the traced forward's moments)."""
        self._check_open()
        if not self.open and self.gradients.has_pending():
            self.gradients.keep_pending()  # an evaluation between a backward and the step reads the values
        nbytes = sum(t.nbytes for t in output_tensors((args, kwargs))) if args is not None else None
        self.schedule.begin_untraced(nbytes, between_steps=not self.open)

    def end_untraced(self) -> None:
        self.reads.flush_loose()
        if self.schedule.end_untraced() and not self.open:
            self.schedule.set_stage(Stage.IDLE)

    def begin_implicit(self) -> None:
        """A module of the model was called directly, not through the engine."""
        if self.reads.gathered_active():
            raise ChunkStateError("the model cannot run inside engine.gathered_parameters(): leave the block first")
        self.implicit = True
        if torch.is_grad_enabled():
            self.begin((), {})
        else:
            self.begin_untraced()
        self.schedule.set_stage(Stage.FWD)

    def end_implicit(self) -> None:
        """The directly called module (and every module it called) returned."""
        self.implicit = False
        if not torch.is_grad_enabled():
            self.end_untraced()

    def begin_from_read(self) -> None:
        """A parameter read with autograd on between steps opens the next iteration."""
        self.begin((), {})
        self.schedule.set_stage(Stage.FWD)

    def in_model_pass(self) -> bool:
        """Whether a forward or backward of the model is running (guarded reads then take part in it)."""
        stage = self.cursor.stage
        return stage is Stage.FWD or stage is Stage.BWD

    def prefetching(self) -> bool:
        return self.prefetch and self.cursor.follows_trace()

    # ------------------------------------------------------------------ the host heap
    def release_heap(self) -> None:
        """Around an optimizer step that moves the optimizer state (Note [host heap] in memory/host_heap.py)."""
        if self.host_heap is not None:
            self.host_heap.release()
            self._heap_released = True

    def release_heap_at_peak(self) -> None:
        """Before the iteration's peak (the plan's moment, or the turn; Note [host heap]): when
        everything is resident, only if the iteration could raise the process's peak RSS."""
        heap = self.host_heap
        if heap is None:
            return
        margin = self.heap_plan.margin
        if margin is None or heap.could_raise_peak(margin):
            heap.release()
        self._heap_released = True  # decided for this iteration, released or not

    # ------------------------------------------------------------------ a plain loss.backward()
    # Note [plain backward]: ``loss.backward()`` instead of ``engine.backward(loss)`` (a loop
    # ported from plain PyTorch, a Lightning-style loop) must train the same. Nothing calls the
    # engine when such a backward starts, but every backward the model takes part in reaches the
    # engine's hooks: a module's output-gradient hook, an op's outside modules, a parameter's
    # gradient. The first of them that fires outside the backward stage asks the autograd engine
    # whether this graph task accumulates into parameters (``.backward()``) or only computes
    # gradients (``torch.autograd.grad`` for a gradient penalty inside the forward, which stays
    # part of the forward, as before); a backward begins the engine's backward there, and a
    # callback queued on the graph task ends it when autograd is done, as engine.backward would
    # after ``loss.backward()`` returns. What engine.backward does to the loss is done to the
    # gradients instead: 1/gradient_accumulation_steps multiplies each as it arrives (exact: the
    # backward is linear in the loss). fp16 loss scaling cannot be moved so: it must scale the
    # loss before the backward (scaling gradients afterwards would not keep them from
    # underflowing), so a plain backward under fp16 is refused, naming engine.backward.
    def backward_hook(self, params: Sequence[torch.Tensor]) -> None:
        """A backward hook fired outside the backward stage, for a module or op on ``params``."""
        if not self.open:
            return
        task = torch._C._current_graph_task_id()
        if task == self._decided_task:
            return
        for p in params:
            if p.requires_grad:
                self._decided_task = task
                with torch._C.DisableTorchFunctionSubclass():  # the parameter's own node, not a guarded read's
                    edge = get_gradient_edge(p)
                if torch._C._will_engine_execute_node(edge.node):
                    self._begin_plain_backward()
                return
        # no parameter here needs a gradient: a later hook decides

    def _gradient_outside_backward(self) -> None:
        """A gradient was accumulated (only a backward does that) outside the backward stage."""
        if self.open:
            self._decided_task = torch._C._current_graph_task_id()
            self._begin_plain_backward()

    def _begin_plain_backward(self) -> None:
        if self.loss_scaling:
            self.abort()
            raise ChunkStateError(
                "loss.backward() under fp16: chunkstar scales the loss before its backward (dynamic loss scaling), "
                "which a plain backward skips; call engine.backward(loss) instead"
            )
        self.plain_backward = True
        self.gradients.begin_plain_backward()
        self.begin_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_plain_backward)

    def _end_plain_backward(self) -> None:
        self.gradients.factor = 1.0
        self.plain_backward = False
        if self.open:
            self.end_backward()

    # ------------------------------------------------------------------ backward and end
    def begin_backward(self, last: bool | None = None) -> None:
        """``last``: whether this is the last micro-batch before a step (None: counted; Note
        [windows the loop decides] in :mod:`chunkstar.runtime.gradients`)."""
        self._check_open()
        self.reads.flush_loose()
        c = self.mgr.counters
        self._traffic_fwd = (c.bytes_to_device - self._traffic_at[0], c.bytes_to_host - self._traffic_at[1])
        self._traffic_at = (c.bytes_to_device, c.bytes_to_host)
        if self.activations is not None:
            self.activations.offload.drain()  # the forward's copies to the host: at the same point each time
        self.gradients.begin_backward(last)
        if release_at_turn(self.heap_plan, self._heap_released, self.cursor.moment):
            self.release_heap_at_peak()
        self.schedule.set_stage(Stage.BWD)

    def end_backward(self) -> None:
        self.gradients.end_backward()
        self._end()
        self.micro_step += 1
        self.gradients.micro_batch_done()
        self.schedule.set_stage(Stage.IDLE)

    def _end(self) -> None:
        self.open = False
        self.implicit = False
        self.stack.clear()
        c = self.mgr.counters
        self.chunk_traffic = LinkLoad(
            self._traffic_fwd[0], self._traffic_fwd[1],
            c.bytes_to_device - self._traffic_at[0], c.bytes_to_host - self._traffic_at[1],
        )  # fmt: skip
        if self.activations is not None:
            off = self.activations.offload
            self.activation_step_bytes = (
                off.bytes_to_host - self._activation_bytes_at[0], off.bytes_to_device - self._activation_bytes_at[1]
            )
            self.activations.close_iteration()
        try:
            self.schedule.end_iteration()
        except DeviceMemoryError:
            # the warm-up found a moment that does not fit: drop this iteration's gradients and
            # trace, so the engine can go on with a smaller batch (or be rebuilt with a bigger budget)
            self.abort()
            raise
        if self.schedule.frozen:
            self._refine_activations()

    def abort(self) -> None:
        """Leave the engine usable after an exception inside forward or backward
        (say a DeviceMemoryError the user answers with a smaller batch): stop the
        warm-up probe so no dispatch mode outlives the failure, drop the partial
        trace so the next iteration warms up again, and put every tensor back in
        HOLD with its value (gradients of the failed iteration are dropped)."""
        mgr = self.mgr
        self.schedule.abort()  # evaluation forwards too: the moments are the schedule's again
        self.gradients.factor = 1.0
        self.plain_backward = False
        self.open = False
        self.implicit = False
        self.stack.clear()
        self.reads.reset()
        if self.comm.distributed:
            self.reducer.reset()
        with torch.no_grad():
            self.gradients.drop_pending()
            for s in mgr.slots:
                if mgr.states[s.index] in (TensorState.COMPUTE, TensorState.HOLD_AFTER_FWD):
                    mgr.set_state(s.index, TensorState.HOLD)
        self.schedule.set_stage(Stage.IDLE)

    # ------------------------------------------------------------------ warm-up's end
    def _on_freeze(self) -> None:
        """The trace froze: plan the activations ("auto", once per shape of the run), then hybrid
        Adam. A new activation plan changes what the device holds, so the trace it was planned
        on no longer describes the run: it is traced again under the plan, and Adam is planned
        when that trace freezes."""
        act = self.activations
        if act is not None and act.measuring:
            report = self._plan_activations(act)
            self.activation_plan = report
            act.apply(report.plan.policies, overlap=report.plan.overlap)
            if not report.plan.as_measured:
                self._trace_plan(report.plan, "")
                return
        planned = self.activation_plan
        if act is not None and act.auto and act.cost is None and planned is not None and not planned.timed_on_frozen_step:
            act.time_frozen_step()  # the next iteration is the plan's first frozen one (Note [activation plan])
            self._frozen_times_due = True
        self._plan_adam()

    def _trace_plan(self, plan: ActivationPlan, why: str) -> None:
        self.schedule.trace_again(
            f"the activation plan{why} keeps {plan.count(ActivationPolicy.KEEP)}, recomputes "
            f"{plan.count(ActivationPolicy.CHECKPOINT)} and offloads {plan.count(ActivationPolicy.OFFLOAD)} blocks"
        )

    def _refine_activations(self) -> None:
        """The plan's first frozen step ended: plan again on its blocks' forward times (the
        measuring run's include chunk loads the frozen schedule prefetches) and, if that changes
        the plan, trace it afresh (once per shape of the run)."""
        act, report = self.activations, self.activation_plan
        if not self._frozen_times_due or act is None or report is None or act.timing:
            return
        self._frozen_times_due = False
        if act.measuring:
            return  # the run changed shape meanwhile: measured and planned afresh
        refined = refine(report, act.frozen_forward_s(), self.comm, self.mgr.device)
        self.activation_plan = refined
        if refined.plan.policies != report.plan.policies or refined.plan.overlap != report.plan.overlap:
            act.apply(refined.plan.policies, overlap=refined.plan.overlap)
            self._trace_plan(refined.plan, " on a frozen step's forward times")

    def _plan_activations(self, act: BlockActivations) -> PlanReport:
        mgr = self.mgr
        if self.link_bandwidth is None:
            self.link_bandwidth = measure_link(mgr.device, mgr.copies)
        trace = self.cursor.trace
        return plan_blocks(
            act, trace, mgr.capacity, lambda m: self.schedule.moment_chunk_bytes(trace.records[m].chunks),
            self._collective_scratch(), self.chunk_traffic, self.link_bandwidth, self.comm, mgr.device,
            room=self._room_value(), chunks=([c.nbytes for c in mgr.chunks.chunks_of(ChunkList.PARAM)], mgr.chunks.own),
        )  # fmt: skip

    def _room_value(self) -> tuple[float, StateRoom | None]:
        """What device room is worth to the optimizer's state, for "auto"'s plan (Note [activation
        plan]): a host update's seconds per parameter over the state's bytes per parameter, and
        where hybrid Adam would place the state. Nothing on the CPU device, where a host update
        and a device one run on the same cores, or without hybrid Adam."""
        mgr = self.mgr
        if not self.hybrid_adam or not self.host_update_seconds or mgr.device.type == "cpu":
            return 0.0, None
        chunks = mgr.chunks
        n = mgr.layout.n_chunks
        own = [i for i in range(n) if chunks.own(i) and not chunks.frozen(i)]
        params = sum(chunks.chunk(ChunkList.PARAM, i).numel for i in own)
        state_chunks = [sum(chunks.chunk(name, i).nbytes for name in STATE_LISTS) for i in own]
        state = sum(state_chunks)
        if not params or not state:
            return 0.0, None
        trace = self.cursor.trace
        param_bytes = [c.nbytes for c in chunks.chunks_of(ChunkList.PARAM)]
        base = moment_footprints(
            param_bytes, chunks.own, mgr.layout.group, [trace.chunks_at(m) for m in range(trace.n_moments)],
            [trace.non_model_at(m) for m in range(trace.n_moments)], self._collective_scratch(),
        )  # fmt: skip
        owned = sum(b for c, b in enumerate(param_bytes) if chunks.own(c))
        return self.host_update_seconds / (state / params), StateRoom(base, owned - mgr.capacity, state_chunks)

    def _measure_activations(self) -> None:
        """The run changed shape and is traced again: "auto" measures its blocks again and plans anew."""
        if self.activations is not None:
            self.activations.measure()

    def _activation_fallback(self) -> bool:
        """A warm-up under the activation plan did not fit the budget: go back to what was measured
        to fit (every block offloaded) and trace again; False when there is no plan to fall back from."""
        act = self.activations
        if act is None or not act.auto or act.measuring or all(p is ActivationPolicy.OFFLOAD for p in act.policies):
            return False
        _log.warning("chunkstar: the activation plan did not fit the device budget; every block is offloaded instead")
        act.measure()  # the measured run: it fit
        act.measuring = False
        self.activation_fallbacks += 1
        return True

    def _activation_advice(self, moment: int, need: int) -> str:
        """What a warm-up error says of the blocks' saved activations at ``moment`` (which needed
        ``need`` bytes of device memory in all), and of what "auto" would do (Note [activation plan])."""
        act, counter = self.activations, self.saved_counter
        trace = self.cursor.trace
        keep = '"activations": {"policy": "auto"}'
        if counter is not None:
            spans = block_spans(trace, counter.names)
            held = [i for i, sp in enumerate(spans) if sp.found and sp.after_fwd <= moment < sp.first_bwd]
            kept = sum(counter.total[i] for i in held)
            movable = sum(counter.large[i] for i in held)
            if not kept:
                return ""
            return (
                f"of its non-model memory, {kept} bytes were activations {len(held)} of the model's {len(counter.names)} "
                f"blocks had saved for their backward and kept on the device ('activations' policy 'keep'); {keep} "
                f"plans per block whether to keep, offload or recompute them: with every block offloaded ({movable} "
                f"bytes to host memory) this moment would need about {max(need - movable, 0)} bytes of device memory, "
                f"a 'device_memory_budget' of about {minimum_budget(max(need - movable, 0), 0, self.mgr.slack)} bytes "
                "(recomputing every block needs less where the blocks save many small tensors)"
            )
        if act is not None and act.auto and act.measuring:
            return (
                "this warm-up already ran every block offloaded ('auto' measures its blocks so): their saved "
                f"tensors of {MIN_OFFLOAD_BYTES} bytes and more were in host memory, the smaller ones stayed; "
                "'activations': {\"policy\": \"checkpoint\"} keeps only each block's inputs"
            )
        return ""

    def _collective_scratch(self) -> int:
        """The largest flat buffer a collective of one chunk takes beside it (0 under gloo)."""
        mgr = self.mgr
        return max(
            (max(self.comm.gather_scratch_bytes(c.numel, c.dtype, mgr.device),
                 self.comm.reduce_scratch_bytes(c.numel, self.reducer.reduce_dtype, mgr.device))
             for c in mgr.chunks.chunks_of(ChunkList.PARAM)),
            default=0,
        )  # fmt: skip

    def _plan_adam(self) -> None:
        """The trace froze: plan where each chunk's Adam runs (hybrid Adam)."""
        if not self.hybrid_adam:
            return
        mgr = self.mgr
        chunks = mgr.chunks
        n = mgr.layout.n_chunks
        trace = self.cursor.trace
        # only this rank's chunks have optimizer state, and a frozen chunk has none (Note [frozen chunks])
        state_bytes = {
            i: sum(chunks.chunk(name, i).nbytes for name in STATE_LISTS)
            for i in range(n)
            if chunks.own(i) and not chunks.frozen(i)
        }
        params = chunks.chunks_of(ChunkList.PARAM)
        # a collective's flat temporaries under NCCL sit beside a gathered group (0 under gloo)
        scratch = self._collective_scratch()
        footprint = resident_footprint(
            [c.nbytes for c in params],
            chunks.own,
            mgr.layout.group,
            [trace.chunks_at(m) for m in range(trace.n_moments)],
            [trace.non_model_at(m) for m in range(trace.n_moments)],
            scratch,
        )
        planned = plan_device_adam(state_bytes, mgr.capacity, footprint)
        self.device_adam_chunks.clear()  # in place: the gradient pipeline reads the same set
        self.device_adam_chunks.update(planned)

    # ------------------------------------------------------------------ the optimizer step
    def begin_optimizer_step(self) -> None:
        self._check_open()
        self._step_began = time.perf_counter()
        self.gradients.check_step()
        self.gradients.fold_kept()  # gradients a forward kept with no backward since
        self.schedule.begin_optimizer_step()
        mgr = self.mgr
        mgr.probe.drop_stale()  # a plain backward's measuring mode, stopped inside it (memory/probes.py)
        self._bytes_before_step = mgr.counters.bytes_to_device + mgr.counters.bytes_to_host
        state_moves = any(not mgr.resident((ChunkList.MASTER, c)) for c in self.device_adam_chunks)
        if self.host_heap is not None and release_before_step(self.schedule.phase is TracePhase.WARMUP, state_moves):
            self.release_heap()  # start the step (and a move of the state to the device) from a trimmed heap

    def end_optimizer_step(self) -> None:
        mgr = self.mgr
        if self.host_update_seconds is None and not self.device_adam_chunks and mgr.device.type == "cuda":
            params = sum(c.numel for c in mgr.chunks.chunks_of(ChunkList.PARAM) if mgr.chunks.own(c.chunk_id))
            if params:
                self.host_update_seconds = (time.perf_counter() - self._step_began) / params
        self.gradients.step_taken()
        moved = mgr.counters.bytes_to_device + mgr.counters.bytes_to_host - self._bytes_before_step
        if self.host_heap is not None and release_after_step(moved, mgr.chunks.state_bytes()):
            self.release_heap()  # the first step after warm-up moved the state to the device
        if self.prefetching():
            # the next forward's first chunks travel while the updates of later chunks run
            mgr.prefetch(self.prefetch_window, now=-1)
        mgr.memory_sample()
        self.schedule.end_optimizer_step()
        self.schedule.set_stage(Stage.IDLE)
