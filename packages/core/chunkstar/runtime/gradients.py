"""Gradients: folding each finished gradient into its parameter's slot, and accumulation.

Gradients reuse the param chunk (docs/design.md, 'Chunks'): when autograd has run every use of
a parameter its post-accumulate-grad hook fires :meth:`Gradients.on_grad`,
which writes the gradient over the parameter's own slot and moves the slot to
HOLD_AFTER_BWD. With ``gradient_accumulation_steps`` > 1 the micro-batches
before the last one add their gradients into an fp32 host accumulator per
chunk instead (the slot still holds the value the next forward needs); the
last micro-batch folds accumulator plus gradient into the slot.

Note [accumulation across ranks]: with several processes the micro-batches
before the last accumulate locally, every rank for every chunk it computes
gradients of (its own and the other ranks', as DDP's ``no_sync`` does: one
reduction per step, at the cost of a full fp32 accumulator on each rank's
host), and the last micro-batch's folds start the usual group reductions, whose
average over ranks of the accumulated sums is the step's gradient. A parameter
that got gradients in earlier micro-batches only would need its accumulator
folded into a group that may not be gathered, on every rank alike: the ranks
agree on that at the boundary (one small all-reduce) and refuse it together.

Once a chunk's gradients are complete, the optimizer may take it during the
backward (Note [gradient pipeline] in :mod:`chunkstar.optim.adam`); with
several processes the reducer averages each group's gradients instead
(:mod:`chunkstar.distributed.grad_reduce`). This module decides neither where
the update runs nor how chunks move: it only writes slots and states.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from chunkstar.chunk.layout import TensorSlot
from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.state import TensorState
from chunkstar.distributed.comm import Comm
from chunkstar.distributed.grad_reduce import GroupReducer
from chunkstar.errors import ChunkStateError
from chunkstar.events import MoveReason, Stage
from chunkstar.runtime.chunk_manager import ChunkManager
from chunkstar.runtime.cursor import Cursor

__all__ = ["GradientConsumer", "Gradients"]

_PARAM = ChunkList.PARAM  # read per gradient


class GradientConsumer(Protocol):
    """Who takes finished gradient chunks during backward (the optimizer: Note [gradient
    pipeline]) and forgets what it took when the gradients are dropped."""

    def take_gradients(self, chunk_id: int) -> None: ...
    def forget_gradients(self) -> None: ...


class Gradients:
    def __init__(self, mgr: ChunkManager, cursor: Cursor, comm: Comm, reducer: GroupReducer, accumulation_steps: int) -> None:
        self.mgr = mgr
        self.cursor = cursor
        self.comm = comm
        self.reducer = reducer  # several processes only
        self.accumulation_steps = accumulation_steps
        self.optimizer: GradientConsumer | None = None  # takes complete chunks during backward (set by the engine)
        self.since_step = 0  # micro-batches since the last optimizer step
        self.boundary = False  # the running backward is the last micro-batch before a step
        self._accumulators: dict[int, torch.Tensor] = {}  # chunk id -> 1-D fp32 host, grads of earlier micro-batches
        self._accumulated: set[int] = set()  # slot indices with something in an accumulator
        # CUDA: accumulators are pinned and every copy to or from them is asynchronous, in stream order
        self._async = mgr.device.type == "cuda"
        # what each gradient is multiplied by as it arrives: 1/gradient_accumulation_steps in a plain
        # loss.backward() (engine.backward divides the loss instead; Note [plain backward])
        self.factor = 1.0
        # the graph task of the running backward (the first one a hook saw): a gradient from another
        # one comes from a reentrant checkpoint's inner backward (Note [reentrant regions])
        self.root_task: int | None = None
        # called when a gradient arrives outside the backward stage: a plain loss.backward() began
        self.on_plain_backward: Callable[[], None] = lambda: None
        self.arrived = 0  # gradients the running backward delivered (none: its loss is not the engine's)

    def begin_backward(self) -> None:
        self.boundary = self.since_step + 1 >= self.accumulation_steps
        self.root_task = None
        self.arrived = 0

    def note_task(self) -> bool:
        """Record the running backward's graph task if none is yet; whether the caller runs
        in another one (a reentrant checkpoint's inner backward: Note [reentrant regions])."""
        task = torch._C._current_graph_task_id()
        if self.root_task is None:
            self.root_task = task
        return task != self.root_task

    def on_grad(self, index: int, param: torch.Tensor) -> None:
        """Parameter ``index``'s gradient is complete (all its uses ran): fold it."""
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        if self.cursor.stage is not Stage.BWD:
            self.on_plain_backward()  # Note [plain backward]
        self.arrived += 1
        if self.factor != 1.0:
            grad = grad * self.factor
        mgr = self.mgr
        s = mgr.slots[index]
        # Note [reentrant regions]: a reentrant checkpoint (torch.utils.checkpoint(..., use_reentrant=True))
        # recomputes its region inside the outer backward and runs a backward of its own over it, so a
        # parameter used in two regions (or in a region and outside it) gets one "complete" gradient per
        # region, and a later region's recompute still reads its value. Folding the first one over the
        # slot would hand that recompute a gradient for a weight. A gradient from an inner backward goes
        # to the chunk's fp32 accumulator instead, as an earlier micro-batch's would; the slot keeps the
        # value, and end_backward (or this parameter's own fold in the outer backward) folds the sum.
        nested = self.note_task()
        if nested and self.comm.distributed:
            raise ChunkStateError(
                f"parameter '{s.name}' got its gradient from a reentrant activation checkpoint "
                "(torch.utils.checkpoint(..., use_reentrant=True), or a model's gradient_checkpointing_enable() "
                "without gradient_checkpointing_kwargs={'use_reentrant': False}): with several processes chunkstar "
                "reduces each gradient once, as the backward completes it, and an inner backward's gradient is not "
                "complete. Use use_reentrant=False, which gives the same gradients (one process takes both kinds)"
            )
        with torch.no_grad(), mgr.probe.paused():
            if not mgr.resident((_PARAM, s.chunk_id)):  # e.g. a parameter whose backward needed no data
                mgr.make_resident(
                    [(_PARAM, s.chunk_id)], MoveReason.ACCESS, where=f"the gradient of '{s.name}'", gather_groups=True
                )
            # through the chunk, not the parameter: payload waits for a prefetch copy still in flight
            slot = mgr.chunks.param_slot_view(s)
            if self.boundary and not nested:
                acc = self._accumulators.get(s.chunk_id)
                if index in self._accumulated and acc is not None:
                    earlier = acc[s.offset : s.end].to(slot.device, non_blocking=self._async)
                    slot.copy_(earlier + grad.float().reshape(-1))
                    self._accumulated.discard(index)
                else:
                    slot.copy_(grad.reshape(-1))
                if mgr.states[index] is not TensorState.COMPUTE:
                    mgr.set_state(index, TensorState.COMPUTE)
                mgr.set_state(index, TensorState.HOLD_AFTER_BWD)
                if self.comm.distributed:
                    self.reducer.gradient_folded(s.chunk_id)
                elif self._offload_early and mgr.settled(s.chunk_id):
                    self._grads_complete(s.chunk_id)
            else:
                acc = self._accumulators.get(s.chunk_id)
                if acc is None:
                    acc = self._accumulators[s.chunk_id] = torch.zeros(
                        mgr.layout.chunk_sizes[s.chunk_id], dtype=torch.float32, pin_memory=self._async
                    )
                view = acc[s.offset : s.end]
                if self._async:
                    # CUDA: the sum is taken on the device and written back into the pinned accumulator,
                    # all in stream order: no host sync per parameter (a plain add_ into the host tensor
                    # would wait for each gradient's copy). torch's pinned allocator keeps a buffer until
                    # the copies that use it are done, even once the accumulator is dropped.
                    total = grad.reshape(-1).float()
                    if index in self._accumulated:
                        total = total + view.to(grad.device, non_blocking=True)
                    view.copy_(total, non_blocking=True)
                else:
                    view.add_(grad.reshape(-1).float().to("cpu"))
                self._accumulated.add(index)
                if mgr.states[index] is TensorState.COMPUTE:
                    mgr.set_state(index, TensorState.HOLD_AFTER_FWD)
                if self.comm.distributed:
                    self.reducer.gradient_accumulated(s.chunk_id)

    @property
    def _offload_early(self) -> bool:
        """Whether a chunk's gradients go to the optimizer as soon as they are complete
        (Note [gradient pipeline]): one process, the last micro-batch before a step with no
        earlier micro-batches' gradients waiting, on the frozen schedule."""
        return self.optimizer is not None and self.boundary and not self._accumulated and self.cursor.follows_trace()

    def _grads_complete(self, chunk_id: int) -> None:
        """Note [gradient pipeline]: every tensor of the chunk is done with this backward
        (its gradient folded, or unused). Unless the schedule uses the chunk again in this
        backward, the optimizer takes it now: its copy to the host (where host Adam runs)
        and its gradient norm overlap the rest of the backward instead of starting after it."""
        cur = self.cursor
        nu = cur.trace.next_use(chunk_id, cur.moment)
        if nu is not None and cur.moment + nu < cur.trace.n_moments:
            return  # read again later in this backward
        assert self.optimizer is not None
        self.optimizer.take_gradients(chunk_id)

    def end_backward(self) -> None:
        """The backward is over: reduce what is left (several processes), release the
        tensors the backward did not reach, and at a boundary fold the accumulators of
        parameters that got gradients in earlier micro-batches only."""
        mgr = self.mgr
        if self.comm.distributed:
            if self.boundary and self.accumulation_steps > 1:
                self._check_accumulated_only()
            self.reducer.end_backward()
        # only the slots either branch below acts on: those in COMPUTE or HOLD_AFTER_FWD (the
        # manager finds them chunk by chunk) and, at a boundary, those with an accumulator
        todo = sorted(self._accumulated.union(mgr.slots_in_use()) if self.boundary else mgr.slots_in_use())
        with torch.no_grad(), mgr.probe.paused():
            for s in (mgr.slots[i] for i in todo):
                st = mgr.states[s.index]
                if self.boundary and s.index in self._accumulated and st is not TensorState.HOLD_AFTER_BWD:
                    # its gradients came from earlier micro-batches or inner backwards only
                    # (Note [reentrant regions]): its gradient is the accumulator
                    acc = self._accumulators[s.chunk_id]
                    mgr.chunks.slot_view(ChunkList.PARAM, s).copy_(acc[s.offset : s.end], non_blocking=self._async)
                    mgr.set_state(s.index, TensorState.COMPUTE)  # a value becomes a gradient only from COMPUTE
                    mgr.set_state(s.index, TensorState.HOLD_AFTER_BWD)
                elif st is TensorState.COMPUTE or st is TensorState.HOLD_AFTER_FWD:
                    mgr.set_state(s.index, TensorState.HOLD)
        if self.boundary:
            self._accumulators.clear()
            self._accumulated.clear()
        if self.comm.distributed:
            self.reducer.release_all()

    def _check_accumulated_only(self) -> None:
        """Several processes, at a boundary (Note [accumulation across ranks]): refuse, on every
        rank alike, parameters whose gradients came in earlier micro-batches only."""
        mgr = self.mgr
        late = [i for i in self._accumulated if mgr.states[i] is not TensorState.HOLD_AFTER_BWD]
        flag = torch.tensor([float(len(late))], dtype=torch.float64)
        if self.comm.all_reduce_max(flag, what="the accumulation check", device=mgr.device).item() > 0:
            names = ", ".join(mgr.slots[i].name for i in sorted(late)[:3]) or "(on another rank)"
            raise ChunkStateError(
                f"gradient accumulation over several processes: parameters got gradients in earlier micro-batches "
                f"but not in the last one before the step ({names}); chunkstar reduces gradients at the last "
                "micro-batch, so every parameter that trains must take part in it (keep the model's control flow "
                "the same in every micro-batch), or accumulate in one process"
            )

    def micro_batch_done(self) -> None:
        self.since_step += 1

    def step_taken(self) -> None:
        """The optimizer consumed the accumulated micro-batches."""
        self.since_step = 0

    def has_pending(self) -> bool:
        """Whether gradients sit in param slots (HOLD_AFTER_BWD) waiting for a step."""
        return any(st is TensorState.HOLD_AFTER_BWD for st in self.mgr.states)

    def restore_params_from_master(self, slots_by_chunk: dict[int, list[TensorSlot]]) -> None:
        """Write the fp32 masters back over ``slots_by_chunk`` (gradients dropped, or a
        checkpoint loaded) and put them in HOLD."""
        mgr = self.mgr
        chunks = mgr.chunks
        with torch.no_grad():
            for cid, slots in slots_by_chunk.items():
                if not chunks.own(cid):
                    # another rank's chunk (a gradient not reduced yet): its owner keeps the value;
                    # this rank's gathered copy is dropped with the group
                    for s in slots:
                        mgr.set_state(s.index, TensorState.HOLD)
                    continue
                p = chunks.chunk(ChunkList.PARAM, cid).payload
                with chunks.staged([(ChunkList.MASTER, cid)], write=False):  # from disk, if it lives there
                    master = chunks.chunk(ChunkList.MASTER, cid).payload.to(p.device)
                    for s in slots:
                        p[s.offset : s.end].copy_(master[s.offset : s.end])
                        mgr.set_state(s.index, TensorState.HOLD)

    def drop_pending(self) -> None:
        """Forget every gradient not consumed by a step (zero_grad without a step, a failed backward)."""
        pending: dict[int, list[TensorSlot]] = {}
        for s in self.mgr.slots:
            if self.mgr.states[s.index] is TensorState.HOLD_AFTER_BWD:
                pending.setdefault(s.chunk_id, []).append(s)
        if self.optimizer is not None:
            self.optimizer.forget_gradients()
        if pending:
            self.restore_params_from_master(pending)
        self._accumulators.clear()
        self._accumulated.clear()
        self.since_step = 0
