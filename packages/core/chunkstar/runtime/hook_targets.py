"""What the runtime does when a hook fires: the targets of module, gradient and guard hooks.

:func:`chunkstar.hooks.module_hooks.install_hooks` calls :meth:`HookTargets.on_pre_forward`,
:meth:`HookTargets.on_post_forward` and ``on_grad`` (the bound method of
:class:`chunkstar.runtime.gradients.Gradients`); the parameter guard's handler
(:mod:`chunkstar.runtime.param_access`) calls the ``*_outside_modules`` and
``attach_to_running_module`` targets. Each access is a *moment*: the
schedule numbers it, the chunk manager makes the chunks resident within the
moment's budget, the tensors go to COMPUTE; a release puts them in
HOLD_AFTER_FWD (or HOLD) so they may move again.

This object is internal: users see :class:`chunkstar.runtime.engine.ChunkEngine`,
whose methods stay the model API. It is on the hot path (every module call
runs two targets, and a third per module in backward), so it binds what it
reads in the constructor and keeps to one method call per decision.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn

from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.state import TensorState
from chunkstar.distributed.comm import Comm
from chunkstar.distributed.grad_reduce import GroupReducer
from chunkstar.events import EventBus, MomentBegin, MomentEnd, MoveReason, Stage
from chunkstar.hooks.module_hooks import AfterBackward, HookedModule, output_tensors, substitute
from chunkstar.memory.cursor import Cursor
from chunkstar.memory.host_heap import release_at_moment
from chunkstar.memory.tracer import TracePhase
from chunkstar.runtime.chunk_manager import ChunkManager
from chunkstar.runtime.gradients import Gradients
from chunkstar.runtime.iteration import Iteration
from chunkstar.runtime.reads import ReadState, alias_written

__all__ = ["HookTargets"]

_PARAM = ChunkList.PARAM  # read per moment


# the phases in which the engine does not measure (the warm-up and an unscheduled run do)
_COMPILED_PHASES = frozenset({TracePhase.FROZEN, TracePhase.DIVERGED})


class HookTargets:
    def __init__(
        self, mgr: ChunkManager, cursor: Cursor, comm: Comm, events: EventBus, iteration: Iteration,
        gradients: Gradients, reducer: GroupReducer, params: Sequence[nn.Parameter], modules: list[HookedModule], reads: ReadState,
    ) -> None:  # fmt: skip
        """``modules``: the hooked modules (:func:`chunkstar.hooks.module_hooks.hooked_modules`),
        whose hooks the engine points here once this is built; each accesses its own
        parameters to begin with; ``reads``: what parameter reads left behind, settled at
        module boundaries here (runtime/reads.py)."""
        self.mgr = mgr
        self.cursor = cursor
        self.comm = comm
        self.events = events
        self.iteration = iteration
        self.schedule = iteration.schedule
        self.reducer = reducer  # several processes only
        self._params = params
        self._stack = iteration.stack  # the same list: the iteration clears it
        self.gradients = gradients
        self.on_grad = gradients.on_grad  # the gradient hook's target (a bound method: no extra call)
        self.modules = modules
        self._access_sets: list[tuple[int, ...]] = [m.own for m in modules]
        self._access_chunks = [self._chunk_ids(m.own) for m in modules]  # the sorted chunk ids of each access set
        # slot index -> (its parameter's version counter when noted, stack position of the module
        # that noted it) while a module or op that holds it runs (Note [writes in a forward])
        self._versions: dict[int, tuple[int, int]] = {}
        # .data aliases a forward took and parameters held loose outside every module (Note [data
        # aliases]): the read state's own dicts, checked where the versions are
        self._reads = reads
        self._aliases = reads.aliases
        self._loose = reads.loose

    def _chunk_ids(self, indices: Sequence[int]) -> tuple[int, ...]:
        slots = self.mgr.slots
        return tuple(sorted({slots[i].chunk_id for i in indices}))

    # ------------------------------------------------------------------ moments
    def _begin_moment(self, module: str, chunk_ids: tuple[int, ...]) -> None:
        cur = self.cursor
        moment = self.schedule.begin_moment(module, chunk_ids)
        if cur.mode.training and release_at_moment(self.iteration.heap_plan, moment, cur.stage is Stage.FWD):
            self.iteration.release_heap_at_peak()
        if self.events.active:
            self.events.emit(MomentBegin(moment, module, cur.stage, time.perf_counter_ns()))

    def _access(self, module: str, indices: tuple[int, ...], chunk_ids: tuple[int, ...] | None = None) -> None:
        """A moment on ``indices`` (whose sorted chunk ids are ``chunk_ids``, if known)."""
        mgr = self.mgr
        if chunk_ids is None:
            chunk_ids = self._chunk_ids(indices)
        self._begin_moment(module, chunk_ids)
        if torch.is_inference_mode_enabled():
            # Note [engine tensors outside inference mode]: an evaluation under
            # torch.inference_mode() (Lightning's validation loop, many eval scripts) moves chunks
            # too, and a buffer or view made under the mode is an inference tensor, which no copy
            # or update may write outside the mode afterwards: the copy threads, the optimizer
            # and the next training step would fail on it. The engine's own work runs with the
            # mode off; the model's ops stay inside it.
            with torch.inference_mode(False):
                self._make_resident(module, indices, chunk_ids)
        else:
            self._make_resident(module, indices, chunk_ids)
        if self.cursor.stage is not Stage.BWD:
            self._note_versions(indices, len(self._stack))

    def _make_resident(self, module: str, indices: tuple[int, ...], chunk_ids: tuple[int, ...]) -> None:
        mgr = self.mgr
        with mgr.probe.paused():
            mgr.make_resident(
                [(_PARAM, c) for c in chunk_ids], MoveReason.ACCESS, where=f"module '{module}'", gather_groups=True
            )
            for i in indices:
                mgr.set_state(i, TensorState.COMPUTE)
            if self.comm.distributed and self.cursor.mode.training and self.cursor.trace.frozen and self.iteration.prefetch:
                # the trace alone decides, never this rank's memory or whether this rank's iteration
                # left the schedule (the ranks agree on that at its end): every rank gathers the same
                mgr.gathers.ahead(self.cursor.trace.chunks_at(self.cursor.moment + 1))
            if self.iteration.prefetching():
                mgr.prefetch(self.iteration.prefetch_window)
            mgr.memory_sample()

    # ------------------------------------------------------------------ writes inside a forward
    # Note [writes in a forward]: a module may write its own parameters in place inside its
    # forward, where they are plain tensors in COMPUTE and no guard sees the op:
    # nn.Embedding(max_norm=...) renormalises the rows it looks up, a module clamps its gain,
    # weight normalisation by hand. Such a write lands in the param chunk only; the next
    # optimizer step would rebuild the parameter from its fp32 master and undo it. Autograd's
    # version counter sees every in-place write to a tensor (a parameter has its own: the engine
    # sets its .data, which keeps the counter, and never writes through the parameter itself);
    # so each access records the counters of its parameters (outside the backward), each
    # module's end compares them while they are still in COMPUTE, and a parameter written in
    # between has what changed copied into its master (ChunkManager.absorb_writes). A write to a
    # parameter outside COMPUTE goes through the guard instead (runtime/param_access.py).
    def _note_versions(self, indices: Sequence[int], depth: int) -> None:
        """Record the parameters' counters for the module at stack position ``depth`` (one an
        outer running module noted keeps its owner; a write seen now is absorbed first)."""
        params = self._params
        versions = self._versions
        for i in indices:
            now = params[i]._version
            seen = versions.get(i)
            if seen is None or depth == 0:  # (no module runs: what is left is an aborted forward's)
                versions[i] = (now, depth)
            elif seen[0] != now:
                self.mgr.absorb_writes([i])
                versions[i] = (now, seen[1])

    def check_writes(self, indices: Sequence[int], depth: int) -> bool:
        """At the end of the module at stack position ``depth`` (or of an op outside modules),
        while its parameters are still in COMPUTE: absorb what was written into them (through
        the parameters or their .data aliases), forget those it noted; whether any was written."""
        params = self._params
        versions = self._versions
        aliases = self._aliases
        written = []
        for i in indices:
            seen = versions.get(i)
            if seen is None:
                if aliases and i in aliases and i not in self._loose:
                    if alias_written(aliases.pop(i)):  # noted with no version (an op's own moment)
                        written.append(i)
                continue
            now = params[i]._version
            wrote = now != seen[0]
            kept = seen[1] < depth  # an outer module noted it: it checks again at its end
            if kept:
                versions[i] = (now, seen[1])
            else:
                del versions[i]
            if aliases and i in aliases:
                taken = aliases[i]
                wrote = alias_written(taken) or wrote
                if kept:
                    aliases[i] = [(a, a._version) for a, _ in taken]
                else:
                    del aliases[i]
            if wrote:
                written.append(i)
        if written:
            self.mgr.absorb_writes(written)
        return bool(written)

    def on_pre_forward(self, module_key: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
        if self._loose:
            self._reads.flush_loose()
        if self.cursor.stage is Stage.IDLE:
            self.iteration.begin_implicit()
        mod = self.modules[module_key]
        indices = self._access_sets[module_key]
        # Note [repeated use]: a parameter's gradient is folded (and its chunk freed to
        # move) when autograd has run all its uses. A parameter already used in this
        # forward (tied weights, a second forward for R-Drop, an L2 term before the
        # forward) would stay in COMPUTE from this use's backward until that fold, and
        # with every parameter used twice the whole model would be pinned at once. So a
        # repeated use marks its own end: an identity on the module's inputs whose
        # backward releases the parameters. First uses need none (the fold releases them).
        # Frozen parameters (requires_grad=False: LoRA's base weights) get no gradient, so no
        # fold ever releases them: they too are released when the module's backward is over.
        grad = torch.is_grad_enabled()
        repeated = grad and any(self.mgr.states[i] is TensorState.HOLD_AFTER_FWD for i in indices)
        self._access(mod.label, indices, self._access_chunks[module_key])
        self._stack.append((module_key, self.cursor.moment))
        # read once the parameters are in COMPUTE: their plain class, no guard to go through
        release = list(indices) if repeated else [i for i in indices if not self._params[i].requires_grad] if grad else []
        if release:
            inputs = [t for t in output_tensors((args, kwargs)) if t.requires_grad]
            if inputs:
                aliases = AfterBackward.apply(lambda: self.release_after_backward(release), *inputs)
                subs = {id(t): a for t, a in zip(inputs, aliases)}
                return substitute(args, subs), substitute(kwargs, subs)
        return None

    def on_post_forward(self, module_key: int, output: Any) -> None:
        if self._loose:
            self._reads.flush_loose()
        mgr = self.mgr
        cur = self.cursor
        mod = self.modules[module_key]
        indices = self._access_sets[module_key]
        grad = torch.is_grad_enabled()
        began = cur.moment
        depth = len(self._stack)
        for pos in range(len(self._stack) - 1, -1, -1):
            if self._stack[pos][0] == module_key:
                began = self._stack.pop(pos)[1]
                depth = pos
                break
        if cur.stage is not Stage.BWD and self._versions:
            self.check_writes(indices, depth)  # while they are in COMPUTE (plain tensors, no guard)
        after = TensorState.HOLD_AFTER_FWD if grad else TensorState.HOLD
        for i in indices:
            if mgr.states[i] is TensorState.COMPUTE:
                mgr.set_state(i, after)
        outs = list(output_tensors(output, refuse=mod.label))  # Note [output containers]
        if cur.mode.training and cur.stage is Stage.FWD:
            self.schedule.on_module_output(began, mod.label, sum(t.nbytes for t in outs))
        if self.comm.distributed and cur.stage is not Stage.BWD:
            self.reducer.release_after_forward(indices)
        if self.events.active:
            self.events.emit(MomentEnd(cur.moment, mod.label, cur.stage, time.perf_counter_ns()))
            mgr.memory_sample()  # the module's activations now exist
        if grad:
            needing = [t for t in outs if t.requires_grad]
            chunks = self._access_chunks[module_key]
            if len(needing) == 1:
                # one tensor (the usual module): its own hook fires when its gradient is ready,
                # once per backward, as the multi-grad hook below would (which is built of such
                # hooks, at three times the cost)
                needing[0].register_hook(
                    lambda _grad, label=mod.label, indices=indices, chunks=chunks: self._backward_access(label, indices, chunks)
                )
            elif needing:
                torch.autograd.graph.register_multi_grad_hook(
                    needing,
                    lambda _grads, label=mod.label, indices=indices, chunks=chunks: self._backward_access(label, indices, chunks),
                    mode="any",
                )
        if self.iteration.implicit and not self._stack:
            self.iteration.end_implicit()

    def _backward_access(self, label: str, indices: tuple[int, ...], chunks: tuple[int, ...]) -> None:
        """A module's output gradient is ready: its parameters are needed again (a plain
        loss.backward() begins here when it is the first hook: Note [plain backward])."""
        if self._loose:
            self._reads.flush_loose()
        if self.cursor.stage is not Stage.BWD:
            self.iteration.backward_hook([self._params[i] for i in indices])
        else:
            self.gradients.note_task()
        self._access(label, indices, chunks)

    def run_compiled(self) -> bool:
        """Whether a compiled unit may run its compiled forward now: not in the first warm-up
        pass, nor in a run gone unscheduled (Note [compiled units] in :mod:`chunkstar.hooks.compiled`)."""
        phase = self.schedule.phase
        return phase in _COMPILED_PHASES or phase is TracePhase.WARMUP and self.cursor.trace.passes >= 1

    # ------------------------------------------------------------------ guarded parameter reads
    def running_module(self) -> int | None:
        """Key of the innermost module whose forward is running, if any."""
        return self._stack[-1][0] if self._stack else None

    def attach_to_running_module(self, indices: list[int], what: str) -> None:
        """A running module reads parameters it does not own: they join its access set
        for good (its post-forward releases them, its pre-backward brings them back, its
        next pre-forward brings them along) and are made resident now."""
        mgr = self.mgr
        key, began = self._stack[-1]
        label = self.modules[key].label
        held = set(self._access_sets[key])
        self._access_sets[key] = tuple(sorted(set(self._access_sets[key]) | set(indices)))
        self._access_chunks[key] = self._chunk_ids(self._access_sets[key])
        chunk_ids = tuple(sorted({mgr.slots[i].chunk_id for i in indices}))
        if self.cursor.mode.training:
            self.schedule.on_more_chunks(began, chunk_ids, f"'{label}' read {what}")
        with mgr.probe.paused(), torch.inference_mode(False):  # Note [engine tensors outside inference mode]
            mgr.make_resident(
                [(_PARAM, c) for c in chunk_ids], MoveReason.ACCESS, where=f"{what} read in '{label}'", gather_groups=True
            )
            for i in indices:
                mgr.set_state(i, TensorState.COMPUTE)
        if self.cursor.stage is not Stage.BWD:
            self._note_versions([i for i in indices if i not in held], len(self._stack) - 1)

    def access_outside_modules(self, label: str, indices: list[int], backward: bool = False) -> None:
        """Parameters read by code outside any module (a moment of their own)."""
        if self._loose:
            self._reads.flush_loose()
        if backward and self.cursor.stage is not Stage.BWD:
            self.iteration.backward_hook([self._params[i] for i in indices])  # Note [plain backward]
            if self.cursor.stage is not Stage.BWD:
                return
        if backward:
            # A parameter whose gradient is complete already: autograd ran every op that
            # differentiates with respect to it, so this op's backward takes nothing from it
            # (``x.type_as(p)``, ``x.expand_as(p)``: Gemma3n's AltUp reads its scale so before
            # multiplying by it, and the product's backward completes the gradient first)
            states = self.mgr.states
            indices = [i for i in indices if states[i] is not TensorState.HOLD_AFTER_BWD]
            if not indices:
                return
        self._access(label, tuple(indices))

    def release_outside_modules(self, indices: list[int], prior: dict[int, TensorState], building_graph: bool) -> None:
        for i in indices:
            if self.mgr.states[i] is TensorState.COMPUTE:
                back = TensorState.HOLD_AFTER_FWD if building_graph else prior[i]
                self.mgr.set_state(i, TensorState.HOLD if back is TensorState.COMPUTE else back)
        if self.comm.distributed and self.cursor.stage is not Stage.BWD:
            self.reducer.release_after_forward(tuple(indices))

    def release_after_backward(self, indices: list[int]) -> None:
        """The backward of an op outside modules is over: its parameters may move again."""
        for i in indices:
            if self.mgr.states[i] is TensorState.COMPUTE:
                self.mgr.set_state(i, TensorState.HOLD_AFTER_FWD)
