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
backward (Note [gradient pipeline] in :mod:`chunkstar.optim.pipeline`); with
several processes the reducer averages each group's gradients instead
(:mod:`chunkstar.distributed.grad_reduce`). This module decides neither where
the update runs nor how chunks move: it only writes slots and states.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

import torch

from chunkstar.chunk.layout import TensorSlot
from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.state import TensorState
from chunkstar.device.tiers import host_device
from chunkstar.distributed.comm import Comm
from chunkstar.distributed.grad_reduce import GroupReducer
from chunkstar.errors import ChunkStateError
from chunkstar.events import MoveReason, Stage
from chunkstar.memory.cursor import Cursor
from chunkstar.runtime.chunk_manager import ChunkManager

__all__ = ["GradientConsumer", "Gradients"]

_PARAM = ChunkList.PARAM  # read per gradient


class GradientConsumer(Protocol):
    """Who takes finished gradient chunks during backward (the gradient pipeline: Note
    [gradient pipeline] in optim/pipeline.py) and forgets what it took when the gradients
    are dropped."""

    def take(self, chunk_id: int) -> None: ...
    def forget(self, chunk_ids: Iterable[int] | None = None) -> None: ...


class Gradients:
    def __init__(
        self, mgr: ChunkManager, cursor: Cursor, comm: Comm, reducer: GroupReducer, accumulation_steps: int,
        consumer: GradientConsumer, on_plain_backward: Callable[[], None],
    ) -> None:  # fmt: skip
        """``accumulation_steps``: the config's gradient_accumulation_steps, read here only (the
        engine and the iteration ask this object: :meth:`scale_loss`, :meth:`check_step`);
        ``consumer`` takes complete chunks during backward; ``on_plain_backward`` is called
        when a gradient arrives outside the backward stage (Note [plain backward])."""
        self.mgr = mgr
        self.cursor = cursor
        self.comm = comm
        self.reducer = reducer  # several processes only
        self.accumulation_steps = accumulation_steps
        self.consumer = consumer
        self.since_step = 0  # micro-batches since the last optimizer step
        self.boundary = False  # the running backward is the last micro-batch before a step
        self._short = False  # ... and it ends its window early (engine.backward(last=True))
        # chunk id -> 1-D fp32 host, grads of earlier micro-batches (or of backwards a forward
        # found waiting: Note [gradients kept across a forward]); made once per chunk and reused
        # (Note [accumulator buffers]), so what a slot's range holds is valid only for the slots
        # in _accumulated
        self._accumulators: dict[int, torch.Tensor] = {}
        self._accumulated: set[int] = set()  # slot indices with something in an accumulator
        # several processes: slots whose accumulator holds world_size x a reduced (averaged)
        # gradient (Note [gradients kept across a forward])
        self._scaled: set[int] = set()
        self.kept_forwards = 0  # forwards that found gradients waiting and kept them (engine.stats())
        self.kept_bytes = 0  # the gradient bytes those forwards moved into the accumulators
        # CUDA: accumulators are pinned and every copy to or from them is asynchronous, in stream order
        self._async = mgr.device.type == "cuda"
        # what each gradient is multiplied by as it arrives: 1/gradient_accumulation_steps in a plain
        # loss.backward() (engine.backward divides the loss instead; Note [plain backward])
        self.factor = 1.0
        # the graph task of the running backward (the first one a hook saw): a gradient from another
        # one comes from a reentrant checkpoint's inner backward (Note [reentrant regions])
        self.root_task: int | None = None
        self.on_plain_backward = on_plain_backward
        self.arrived = 0  # gradients the running backward delivered (none: its loss is not the engine's)

    # ------------------------------------------------------------------ accumulation's rules
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``engine.backward(loss)``: the loss a micro-batch back-propagates (divided by
        gradient_accumulation_steps, so N micro-batches sum to their mean)."""
        return loss / self.accumulation_steps if self.accumulation_steps > 1 else loss

    # Note [windows the loop decides]: by default a window is gradient_accumulation_steps
    # micro-batches, counted here. A loop that decides its own windows says which backward is
    # the last before a step (``engine.backward(loss, last=...)``): Lightning steps at the end of
    # an epoch whose last window is short. A short window ends as a full one does (the backward
    # folds the accumulators and starts the reductions) and then counts as full, so the step's
    # check and everything that asks whether a window is open see it closed. A window never
    # grows past gradient_accumulation_steps: the host memory plan sized the accumulators for
    # that many micro-batches, and the reductions of several processes wait for its last.
    def counted_last(self) -> bool:
        """Whether the count alone makes the next backward the last of its window."""
        return self.since_step + 1 >= self.accumulation_steps

    def check_last(self, last: bool | None) -> None:
        """``engine.backward(loss, last=...)``, before anything runs: ``last=False`` where the
        count makes this micro-batch the last would grow the window past its size."""
        if last is False and self.counted_last():
            raise ChunkStateError(
                f"engine.backward(loss, last=False) at micro-batch {self.since_step + 1} since the last step, but "
                f"gradient_accumulation_steps is {self.accumulation_steps}: a window cannot grow past it (the engine "
                "sized its accumulators for that many micro-batches); raise gradient_accumulation_steps in the config"
            )

    def begin_plain_backward(self) -> None:
        """A plain ``loss.backward()`` began: nobody divided its loss, so each gradient is
        divided as it arrives (Note [plain backward])."""
        self.factor = 1.0 / self.accumulation_steps if self.accumulation_steps > 1 else 1.0

    def check_step(self) -> None:
        """``optimizer.step()`` comes at an accumulation boundary, or raises."""
        gas = self.accumulation_steps
        since = self.since_step
        if since % gas != 0 or since == 0 and self.has_pending():
            raise ChunkStateError(
                f"optimizer.step() after {since} micro-batch(es) but gradient_accumulation_steps is {gas}: "
                f"call engine.backward() {gas} times per optimizer step"
            )

    def begin_backward(self, last: bool | None = None) -> None:
        """A backward begins; ``last`` as :meth:`check_last` allows (None: counted)."""
        counted = self.counted_last()
        self.boundary = counted or bool(last)
        self._short = self.boundary and not counted
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
        with torch._C.DisableTorchFunctionSubclass():  # autograd's own .grad, past the guard (Note [parameter guard])
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
                    self._scaled.discard(index)
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
                self._accumulate(index, grad.reshape(-1))
                if mgr.states[index] is TensorState.COMPUTE:
                    mgr.set_state(index, TensorState.HOLD_AFTER_FWD)
                if self.comm.distributed:
                    self.reducer.gradient_accumulated(s.chunk_id)

    @property
    def _offload_early(self) -> bool:
        """Whether a chunk's gradients go to the optimizer as soon as they are complete
        (Note [gradient pipeline]): one process, the last micro-batch before a step with no
        earlier micro-batches' gradients waiting, on the frozen schedule."""
        return self.boundary and not self._accumulated and self.cursor.follows_trace()

    def _grads_complete(self, chunk_id: int) -> None:
        """Note [gradient pipeline]: every tensor of the chunk is done with this backward
        (its gradient folded, or unused). Unless the schedule uses the chunk again in this
        backward, the optimizer takes it now: its copy to the host (where host Adam runs)
        and its gradient norm overlap the rest of the backward instead of starting after it."""
        cur = self.cursor
        nu = cur.trace.next_use(chunk_id, cur.moment)
        if nu is not None and cur.moment + nu < cur.trace.n_moments:
            return  # read again later in this backward
        self.consumer.take(chunk_id)

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
                    # its gradients came from earlier micro-batches, inner backwards or earlier
                    # backwards only (Note [reentrant regions], Note [gradients kept across a
                    # forward]): its gradient is the accumulator
                    self._fold_accumulated(s)
                elif st is TensorState.COMPUTE or st is TensorState.HOLD_AFTER_FWD:
                    mgr.set_state(s.index, TensorState.HOLD)
        if self.boundary:
            self._accumulated.clear()
            self._scaled.clear()
        if self.comm.distributed:
            self.reducer.release_all()

    def _check_accumulated_only(self) -> None:
        """Several processes, at a boundary (Note [accumulation across ranks]): refuse, on every
        rank alike, parameters whose gradients came in earlier micro-batches only."""
        mgr = self.mgr
        # (a gradient a forward kept after its reduction is an average already: it folds alone)
        late = [i for i in self._accumulated if mgr.states[i] is not TensorState.HOLD_AFTER_BWD and i not in self._scaled]
        flag = torch.tensor([float(len(late))], dtype=torch.float64)
        if self.comm.all_reduce_max(flag, what="the accumulation check", device=mgr.device).item() > 0:
            names = ", ".join(mgr.slots[i].name for i in sorted(late)[:3]) or "(on another rank)"
            raise ChunkStateError(
                f"gradient accumulation over several processes: parameters got gradients in earlier micro-batches "
                f"but not in the last one before the step ({names}); chunkstar reduces gradients at the last "
                "micro-batch, so every parameter that trains must take part in it (keep the model's control flow "
                "the same in every micro-batch), or accumulate in one process"
            )

    # ------------------------------------------------------------------ accumulators
    # Note [accumulator buffers]: an accumulator is one fp32 host buffer per param chunk, made
    # the first time the chunk needs one and kept for the engine's life: every later cycle
    # reuses it, and a slot's range is written whole by its first gradient of a cycle
    # (copied, never added to zeros), so nothing is zero-filled. On CUDA the buffers come from
    # the engine's exactly sized pinned buffers (device/pinned.py): torch's pinned allocator
    # would round each up to a power of two and never give the memory back, about twice the
    # bytes across a run's chunks, made again every cycle.
    def _accumulator(self, chunk_id: int) -> torch.Tensor:
        acc = self._accumulators.get(chunk_id)
        if acc is None:
            numel = self.mgr.layout.chunk_sizes[chunk_id]
            pool = self.mgr.chunks.pinned_buffers
            if self._async and pool is not None:
                acc = pool.take(numel, torch.float32)
            else:  # on the host tier's device: meta in a dry run, which must hold no fp32 copy of the model
                acc = torch.empty(numel, dtype=torch.float32, device=host_device(self.mgr.chunks.device))
            self._accumulators[chunk_id] = acc
        return acc

    def _accumulate(self, index: int, grad: torch.Tensor, scale: float = 1.0) -> None:
        """Add the flat gradient ``grad`` of slot ``index`` into its chunk's accumulator."""
        s = self.mgr.slots[index]
        view = self._accumulator(s.chunk_id)[s.offset : s.end]
        total = grad.float()
        if scale != 1.0:
            total = total * scale
        if self._async:
            # CUDA: the sum is taken on the device and written back into the pinned accumulator,
            # all in stream order: no host sync per parameter (a plain add_ into the host tensor
            # would wait for each gradient's copy)
            if index in self._accumulated:
                total = total + view.to(grad.device, non_blocking=True)
            view.copy_(total, non_blocking=True)
        elif index in self._accumulated:
            view.add_(total.to("cpu"))
        else:
            view.copy_(total)
        self._accumulated.add(index)

    def _fold_accumulated(self, s: TensorSlot) -> None:
        """Slot ``s`` got no gradient in this backward but has accumulated ones: they are its
        gradient (a value becomes a gradient only from COMPUTE)."""
        mgr = self.mgr
        acc = self._accumulators[s.chunk_id][s.offset : s.end]
        if s.index in self._scaled:
            acc = acc / self.comm.world_size  # reduced already (Note [gradients kept across a forward])
        with mgr.chunks.staged([(ChunkList.PARAM, s.chunk_id)], write=True):  # from its file, if there
            mgr.chunks.slot_view(ChunkList.PARAM, s).copy_(acc, non_blocking=self._async)
        mgr.set_state(s.index, TensorState.COMPUTE)
        mgr.set_state(s.index, TensorState.HOLD_AFTER_BWD)

    # ------------------------------------------------------------------ gradients a forward finds
    # Note [gradients kept across a forward]: PyTorch sums the gradients of every backward
    # until the gradients are dropped: DCGAN's tutorial calls errD_real.backward(), runs the
    # discriminator again and calls errD_fake.backward() before optimizerD.step(); accumulation
    # written by hand and a multi-task model that backwards each loss in turn are the same
    # loop; an evaluation between a backward and the step reads the weights too. Here a
    # backward leaves each gradient in its parameter's slot, where the next forward needs the
    # value. So a forward that starts while slots hold gradients first *keeps* them: each such
    # slot's gradient goes into its chunk's fp32 accumulator (the one gradient accumulation and
    # Note [reentrant regions] use), the slot gets its value back from the fp32 master, and
    # the next backward's folds add the accumulator in, as the last micro-batch of an
    # accumulation does. A step that comes with no backward after such a forward folds the
    # accumulators into the slots first (:meth:`fold_kept`). The sum is PyTorch's: each
    # backward's gradient is computed from the same values and added in fp32. The cost, shown
    # in engine.stats() as ``kept_gradient_forwards`` and ``kept_gradient_bytes``: 4 bytes of
    # host accumulator per parameter, made once (Note [accumulator buffers]), and per such
    # forward one read of each waiting gradient and one master-to-slot copy; the optimizer
    # cannot take gradients during the next backward (Note [gradient pipeline]), since they
    # are complete only at its end. With several processes the waiting gradients are the
    # reduced averages in their owners' chunks: the owner keeps world_size x the average, so
    # the average of the next fold's sums is the sum of the averages, and a slot that gets no
    # gradient in the next backward takes the average back unscaled.
    def keep_pending(self) -> None:
        """A forward starts while slots hold gradients: keep them in the accumulators and give
        the slots their values back (Note [gradients kept across a forward])."""
        mgr = self.mgr
        pending = {cid: [s for s in mgr.slots_of(cid) if mgr.states[s.index] is TensorState.HOLD_AFTER_BWD]
                   for cid in range(mgr.layout.n_chunks) if mgr.grads_in(cid)}  # fmt: skip
        if not pending:
            return
        self.consumer.forget(pending)  # what it took early is not the whole sum
        scale = float(self.comm.world_size) if self.comm.distributed else 1.0
        moved = 0
        with torch.no_grad(), mgr.probe.paused():
            for cid, slots in pending.items():
                with mgr.chunks.staged([(ChunkList.PARAM, cid)], write=False):  # from its file, if there
                    param = mgr.chunks.chunk(ChunkList.PARAM, cid).payload
                    for s in slots:
                        self._accumulate(s.index, param[s.offset : s.end], scale)
                        if scale != 1.0:
                            self._scaled.add(s.index)
                        moved += s.numel * 4
        self.restore_params_from_master(pending)
        self.kept_forwards += 1
        self.kept_bytes += moved

    def fold_kept(self) -> None:
        """Before a step: gradients a forward kept with no backward since (an evaluation between
        a backward and the step) go back into their slots."""
        if not self._accumulated or self.since_step % self.accumulation_steps != 0:
            return  # nothing kept, or an accumulation still open (the step refuses it)
        mgr = self.mgr
        with torch.no_grad(), mgr.probe.paused():
            for i in sorted(self._accumulated):
                if mgr.states[i] is not TensorState.HOLD_AFTER_BWD:
                    self._fold_accumulated(mgr.slots[i])
        self._accumulated.clear()
        self._scaled.clear()

    def kept_value(self, index: int) -> torch.Tensor | None:
        """Slot ``index``'s gradient waiting in an accumulator (fp32, flat), or None."""
        if index not in self._accumulated:
            return None
        s = self.mgr.slots[index]
        value = self._accumulators[s.chunk_id][s.offset : s.end].clone()
        return value / self.comm.world_size if index in self._scaled else value

    def has_kept(self) -> bool:
        """Whether gradients wait in the accumulators (kept by a forward, or accumulating)."""
        return bool(self._accumulated)

    # ------------------------------------------------------------------ dropping some gradients
    def drop(self, indices: Iterable[int]) -> None:
        """``p.grad = None`` for these slots (``module.zero_grad()`` of any module): their
        gradients, in the slot or an accumulator, are gone, as PyTorch's are."""
        mgr = self.mgr
        in_slot: dict[int, list[TensorSlot]] = {}
        for i in indices:
            s = mgr.slots[i]
            self._accumulated.discard(i)
            self._scaled.discard(i)
            if mgr.states[i] is TensorState.HOLD_AFTER_BWD:
                in_slot.setdefault(s.chunk_id, []).append(s)
        if in_slot:
            self.consumer.forget(in_slot)
            self.restore_params_from_master(in_slot)
        if not self._accumulated and not self.has_pending():
            self.since_step = 0  # no gradient is left: as after optimizer.zero_grad()

    def zero(self, index: int) -> None:
        """``p.grad.zero_()`` (``module.zero_grad(set_to_none=False)``): the gradient stays, as zeros."""
        mgr = self.mgr
        s = mgr.slots[index]
        self._accumulated.discard(index)
        self._scaled.discard(index)
        if mgr.states[index] is TensorState.HOLD_AFTER_BWD:
            self.consumer.forget([s.chunk_id])
            with torch.no_grad(), mgr.chunks.staged([(ChunkList.PARAM, s.chunk_id)], write=True):
                mgr.chunks.chunk(ChunkList.PARAM, s.chunk_id).payload[s.offset : s.end].zero_()

    def micro_batch_done(self) -> None:
        self.since_step += 1
        if self._short:  # Note [windows the loop decides]: a window ended early counts as full
            gas = self.accumulation_steps
            self.since_step = -(-self.since_step // gas) * gas
            self._short = False

    def step_taken(self) -> None:
        """The optimizer consumed the accumulated micro-batches."""
        self.since_step = 0

    def has_pending(self) -> bool:
        """Whether gradients sit in param slots (HOLD_AFTER_BWD) waiting for a step."""
        grads_in = self.mgr.grads_in
        return any(grads_in(c) for c in range(self.mgr.layout.n_chunks))

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
                with chunks.staged([(ChunkList.PARAM, cid)], write=True), chunks.staged([(ChunkList.MASTER, cid)], write=False):
                    p = chunks.chunk(ChunkList.PARAM, cid).payload  # (each staged from its file, if there)
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
        self.consumer.forget()
        if pending:
            self.restore_params_from_master(pending)
        self._accumulated.clear()
        self._scaled.clear()
        self.since_step = 0
