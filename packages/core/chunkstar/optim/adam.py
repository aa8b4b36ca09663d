"""Adam / AdamW over chunk quadruples with PyTorch's fused kernel.

The gradients sit in the param chunk (each in its parameter's slot), the fp32
master and the two moments in the three state chunks at the same offsets. One
step is two passes over the chunks that hold gradients:

1. *place and measure*: move each param chunk to where its update runs (the
   host for host Adam, the device with its state chunks for device Adam,
   see :mod:`chunkstar.placement.optimizer`) and take the L2 norm of its
   gradient ranges (the global norm for clipping; inf/nan means fp16 overflow);
2. *update*: fused Adam over the fp32 views of the chunks' runs of slots, then
   a foreach cast of the new masters back into the param slots.

Note [norm only when needed]: the global norm costs a pass over every gradient
(bf16 ones upcast to fp32 on the way), as long as the fused update itself on a
small model. A step takes it only when something uses it: clipping
(``gradient_clipping`` > 0), fp16 (its overflow check), or a caller that asked
for it (``ChunkAdam.measure_grad_norm``, which the Hugging Face Trainer sets, since
it logs the norm every step). Otherwise pass 1 only places the chunks and
``last_grad_norm`` is None; the update's arithmetic is the same either way (with
no clipping and no loss scale the gradients are not scaled), so the parameters
get the same bits. The decision is the engine config's and the attribute's, so
every rank makes the same one (the norm is a collective with several processes).

Note [gradient pipeline] (:mod:`chunkstar.optim.pipeline`): complete gradient
chunks leave for the host during backward with their norms taken on the way;
at the step, each host-Adam chunk's update is one job on the host worker,
queued in the order the next forward needs the chunks.

A step is all or nothing (Note [all or nothing] in
:mod:`chunkstar.interrupts`): a Ctrl-C waits for it to finish, and
anything else that stops it once it has changed a chunk leaves an optimizer
that refuses to go on until a load restores a whole state.

Note [the training thread]: the chunks move under a training step (evicted,
brought back, resized to nothing on the device), so reading or loading them
from another thread at the same time reads freed memory or half a value, and
its moves disturb the step's own: a monitoring thread reading ``engine.state_dict()``
while a GPT-2 trained re-traced the warm-up and, in one run of three, failed the
training thread on a storage resized to nothing (issue 30 saw a crash). The optimizer
knows which thread trains: the one of its last step (before any, the one that
built it). ``engine.state_dict()``, ``load_state_dict``, ``save_checkpoint``,
``load_checkpoint`` and the optimizer's own state dicts from any other thread,
while that one lives, raise a ChunkStateError saying so (:meth:`ChunkAdam.check_thread`).
A lock would not do: a forward and a backward move chunks from hooks spread over
the user's code, with no one call to hold it across. ``engine.stats()`` reads
counters only, and is safe from any thread. ``engine.module.state_dict()``
reaches the chunks through the parameter access (:mod:`chunkstar.runtime.param_access`)
and is not checked yet.

It subclasses ``torch.optim.Optimizer`` so LR schedulers work through
``param_groups`` (a queued update keeps the hyperparameters of its step).
Parameters that got no gradient are skipped, as ``torch.optim`` skips
parameters whose ``.grad`` is None.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from typing import Any, Callable, Protocol

import torch

from chunkstar.chunk.chunk import Chunk
from chunkstar.chunk.layout import TensorSlot
from chunkstar.chunk.lists import CHUNK_LISTS, ChunkList
from chunkstar.chunk.state import TensorState
from chunkstar.chunk.store import ChunkStore
from chunkstar.config import OptimizerConfig
from chunkstar.config.hyperparams import ADAM_HYPERPARAMS, validate_param_group
from chunkstar.device.copy_engine import CopyEvent, HostWorker, InlineWorker, Issued
from chunkstar.device.tiers import holds_values, host_device
from chunkstar.distributed.comm import Comm
from chunkstar.errors import ChunkStateError
from chunkstar.events import MoveReason, Tier
from chunkstar.interrupts import deferred_interrupts
from chunkstar.optim.loss_scaler import LossScaler
from chunkstar.optim.pipeline import GradientPipeline, range_norms, runs

_log = logging.getLogger("chunkstar")

__all__ = ["ChunkAdam", "OptimizerHost", "global_grad_norm"]


class OptimizerHost(Protocol):
    """What the optimizer needs of the engine it updates: the chunks (through the store's
    narrow door), the processes, where Adam runs (hybrid Adam's device chunks, the host
    worker), the gradient pipeline that takes complete chunks during backward, the loss scaler, the micro-step count (Note [a step consumes its
    gradients]), the parameters' slot indices, and the step's begin and end. It never
    sees the engine itself."""

    comm: Comm
    device: torch.device
    scaler: LossScaler
    host_work: HostWorker | InlineWorker

    @property
    def mgr(self) -> ChunkStore: ...
    @property
    def device_adam_chunks(self) -> set[int]: ...
    @property
    def gradient_pipeline(self) -> GradientPipeline: ...
    @property
    def micro_step(self) -> int: ...
    def index_of(self, p: torch.Tensor) -> int: ...
    def begin_optimizer_step(self) -> None: ...
    def end_optimizer_step(self) -> None: ...
    def drop_pending_grads(self) -> None: ...
    def restore_params_from_master(self, slots_by_chunk: dict[int, list[TensorSlot]]) -> None: ...

_FORMAT = "chunkstar.ChunkAdam/1"
_BATCH_ELEMENTS = 1 << 22  # gradient elements per batch of fused calls on CUDA (16 MiB of fp32 copies)
_HOST_BATCH_ELEMENTS = 1 << 20  # on the CPU: a batch's gradient copies, masters and moments (18 MiB)
# stay in the last-level cache from the gradients' fp32 copy through the fused kernel to the cast
# back (measured with a 49M GPT-2, hidden 768, 6 layers, vocab 8192, bf16, on 2 cores with a
# 32 MiB L3: the update of all its chunks 89 -> 68 ms at one thread, 83 -> 73 ms at two); a CUDA
# batch stays large (fewer launches).
# A run longer than a batch is cut every batch's worth of elements from its start, a multiple
# of any vector width: the fused kernel vectorises each tensor from its start and finishes the
# last (numel mod width) elements with scalar code that rounds differently (measured: a cut
# at element 997 changes exp_avg_sq bits, cuts at multiples of 8 do not).


def _batch_elements(device: torch.device) -> int:
    """Gradient elements per batch of fused calls for tensors on ``device``. The meta device
    batches as the host does: both of its tiers are meta (Note [the meta device]), and a
    host update's batches fill the host scratch (:meth:`ChunkAdam._scratch`), sized so."""
    return _HOST_BATCH_ELEMENTS if device.type in ("cpu", "meta") else _BATCH_ELEMENTS


def global_grad_norm(norms: list[torch.Tensor], comm: Comm, device: torch.device) -> torch.Tensor:
    """The L2 norm of every rank's gradients from their per-range norms (1-D fp32
    tensors, :func:`range_norms`, on any device): a 0-dim fp32 CPU tensor, inf or nan
    when a gradient overflowed.

    The parts travel to ``comm.exchange_device(device)`` (``device`` is the engine's: the
    sum is all-reduced there, on the GPU under NCCL, which reduces CUDA tensors only),
    and the total comes to the CPU once: one sync per step, not one per chunk."""
    where = comm.exchange_device(device)
    parts = [n.to(where) for n in norms if n.numel()]
    flat = torch.cat(parts) if parts else torch.zeros(0, device=where)  # 1-D fp32 on `where`
    if comm.distributed:
        # every rank joins, even one without gradients (Note [collective schedule])
        sq = flat.square().sum().reshape(1)
        total = comm.all_reduce_sum(sq, what="the gradient norm", device=device).sqrt()[0]
    else:
        total = torch.linalg.vector_norm(flat)
    return total.cpu()


class ChunkAdam(torch.optim.Optimizer):
    def __init__(
        self, engine: OptimizerHost, config: OptimizerConfig, param_groups: list[dict[str, Any]], defaults: dict[str, Any]
    ) -> None:
        """``config``: the config's optimizer section (Note [config sections]); ``param_groups``
        checked against it (:func:`chunkstar.config.hyperparams.validate_param_group`)."""
        super().__init__(param_groups, defaults)
        self._engine = engine
        self._config = config
        self._store: ChunkStore = engine.mgr  # the chunks, through the store's narrow door only
        # chunks handed over during backward and their per-range gradient norms (Note [gradient
        # pipeline] in optim/pipeline.py): built with the engine, read here at the step
        self._pipeline = engine.gradient_pipeline
        self._decoupled = config.decoupled
        self._steps: list[int] = [0] * len(engine.mgr.slots)
        self._group_of: list[int] = [0] * len(engine.mgr.slots)
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                self._group_of[engine.index_of(p)] = g
        self.skipped_steps = 0
        self._warned_skip = False
        # the engine's micro-step count when a step last applied gradients (None: none since the
        # last zero_grad or load): a step at the same count would have torch.optim step again
        self._applied_at: int | None = None
        self.last_grad_norm: float | None = None
        """The global gradient norm of the last step (before clipping, the fp16 loss scale
        divided out), or None when that step did not measure it (Note [norm only when
        needed]) or overflowed (fp16: the step was skipped, ``skipped_steps`` counts it)."""
        self.step_count = 0  # optimizer.step() calls, skipped ones included (a checkpoint's "step")
        self._order: tuple[int, list[int]] | None = None  # (id of the trace, chunk ids in next-forward order)
        self._scratch_bufs: dict[str, torch.Tensor] = {}  # see _scratch
        self._disk = engine.mgr.chunks.disk  # the disk tier, if the state lives on disk (Note [disk tier])
        self._thread = threading.current_thread()  # the one that trains (Note [the training thread])
        self._writing = False  # the running step has begun to change chunks (Note [all or nothing])
        # what an interrupted step or load left half-changed, and what is still to be restored
        # ("weights", "optimizer"); None: every chunk is whole (Note [all or nothing])
        self._unfinished: tuple[str, str] | None = None  # (what was interrupted, how to restore)
        self._to_restore: set[str] = set()

    # ------------------------------------------------------------------ public
    @property
    def loss_scale(self) -> float:
        return self._engine.scaler.scale

    @property
    def measure_grad_norm(self) -> bool:
        """Measure the global gradient norm (``last_grad_norm``) at every step even when
        neither clipping nor fp16 needs it (Note [norm only when needed]); set it alike on
        every rank."""
        return self._pipeline.measure_grad_norm

    @measure_grad_norm.setter
    def measure_grad_norm(self, value: bool) -> None:
        self._pipeline.measure_grad_norm = bool(value)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        eng = self._engine
        # Note [a step consumes its gradients]: a gradient lives in its parameter's param-chunk
        # slot (14 bytes per parameter, not 16), and the step turns the slot back into the value,
        # so after a step no gradient is left. torch.optim keeps p.grad, and a second step()
        # with no backward in between applies it again; the engine cannot, so it refuses rather
        # than differ. zero_grad() makes a step a no-op again, as torch.optim's after zero_grad.
        # The micro-step count is alike on every rank, so the refusal is too.
        if self._applied_at == eng.micro_step:
            raise ChunkStateError(
                "optimizer.step() again with no backward since the last step: the gradients live in the parameter "
                "chunks and that step consumed them, while torch.optim would apply the same gradients a second time; "
                "run a backward before each step (or call optimizer.zero_grad() first, after which a step changes "
                "nothing, as in torch.optim)"
            )
        self.check_consistent("optimizer.step()")
        # a scheduler (or the user) may have changed a group since the config was checked: the
        # same checks, on the values this step uses (a NaN lr would turn every weight NaN)
        for i, g in enumerate(self.param_groups):
            validate_param_group(
                {k: g[k] for k in ADAM_HYPERPARAMS}, f"param_groups[{i}] at step {self.step_count + 1}",
                decoupled=self._decoupled,
            )  # fmt: skip
        self._thread = threading.current_thread()  # Note [the training thread]
        with deferred_interrupts():  # Note [all or nothing]
            eng.begin_optimizer_step()
            try:
                self._writing = False
                if self._step():
                    self._applied_at = eng.micro_step
                self.step_count += 1
                self._writing = False
            except BaseException as e:
                self._step_failed(e)
                raise
            finally:
                eng.end_optimizer_step()
        return loss

    def _step_failed(self, e: BaseException) -> None:
        """A step stopped (Note [all or nothing]): once it had changed a chunk, nothing goes on
        until a load; before, it is no step. Either way its gradients go, as by ``zero_grad()``
        (the load that follows must not find them pending); failing that, the load takes them."""
        if self._writing:
            self._writing = False
            self.interrupted(
                f"optimizer step {self.step_count + 1} was stopped by {type(e).__name__} after it had updated some chunks "
                "and not others",
                "load a checkpoint saved before (engine.load_checkpoint), or load both engine.load_state_dict and "
                "optimizer.load_state_dict of state dicts saved before, or build the engine again",
                {"weights", "optimizer"},
            )
        try:
            self._engine.drop_pending_grads()
        except Exception:  # noqa: BLE001 - the step's own error is the one to see
            _log.debug("chunkstar: dropping the gradients of an interrupted step failed", exc_info=True)
        self._applied_at = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the param slots and are consumed by ``step``; if
        some are still pending (no step was taken), drop them and restore the
        parameter values from the fp32 masters."""
        self.check_consistent("optimizer.zero_grad()")
        self._engine.drop_pending_grads()
        self._applied_at = None  # a step now has no gradients, as torch.optim's after zero_grad

    # ------------------------------------------------------------------ whole states and the training thread
    def interrupted(self, what: str, restore: str, parts: set[str]) -> None:
        """``what`` stopped half-way, leaving ``parts`` ("weights", "optimizer") half-changed:
        refuse to go on until they are restored (Note [all or nothing])."""
        self._unfinished = (what, restore)
        self._to_restore |= parts

    def restored(self, parts: set[str]) -> None:
        """A load completed ``parts`` ("weights", "optimizer"): once all are, training may go on."""
        self._to_restore -= parts
        if not self._to_restore:
            self._unfinished = None

    @property
    def unfinished(self) -> bool:
        """Whether an interrupted step or load left chunks half-changed (Note [all or nothing])."""
        return self._unfinished is not None

    def check_consistent(self, doing: str) -> None:
        """Refuse ``doing`` while an interrupted step or load left chunks half-changed."""
        if self._unfinished is None:
            return
        what, restore = self._unfinished
        raise ChunkStateError(
            f"{doing} refused: {what}, so the weights and the optimizer state are a mix of two states, and training "
            f"on (or saving) would go on from neither. To go on, {restore}"
        )

    def check_thread(self, doing: str) -> None:
        """Refuse ``doing`` from a thread other than the one that trains, while that one lives
        (Note [the training thread])."""
        here, owner = threading.current_thread(), self._thread
        if here is owner or not owner.is_alive():
            return
        raise ChunkStateError(
            f"{doing} from thread '{here.name}' while the engine trains on thread '{owner.name}': its chunks move under "
            "a training step, so a read or a load from another thread could see half a value or freed memory, and "
            f"disturb the step. Call it on thread '{owner.name}' (between steps, say every N steps), or save a "
            "checkpoint there; engine.stats() is safe from any thread"
        )

    def _forward_order(self) -> list[int]:
        """Chunk ids in the order the next forward first needs them (the frozen trace's
        order; chunks it never uses, or no trace yet, in id order after them)."""
        mgr = self._store
        trace = mgr.cursor.trace
        if self._order is None or self._order[0] != id(trace):
            seen: dict[int, None] = {}
            if trace.frozen:
                for j in range(trace.n_moments):
                    for c in trace.chunks_at(j):
                        seen.setdefault(c, None)
            for c in range(mgr.layout.n_chunks):
                seen.setdefault(c, None)
            self._order = (id(trace), list(seen))
        return self._order[1]

    # ------------------------------------------------------------------ step
    def _step(self) -> bool:
        """One step; whether it applied gradients (not: none pending, or skipped)."""
        eng = self._engine
        mgr = self._store
        scaler = eng.scaler
        comm = eng.comm
        grad_slots: dict[int, list[TensorSlot]] = {}
        for s in mgr.slots:
            if mgr.states[s.index] is TensorState.HOLD_AFTER_BWD:  # only own chunks hold gradients
                grad_slots.setdefault(s.chunk_id, []).append(s)
        if not grad_slots and not comm.distributed:
            self._pipeline.forget()
            return False

        # pass 1: place, then (only when the step needs it: Note [norm only when needed]) the
        # global gradient norm
        for cid in grad_slots:
            self._place(cid)
        self.last_grad_norm = None
        clip = self._config.gradient_clipping
        factor: float | None = None  # what the gradients are multiplied by; None: nothing
        # on the meta device there are no values to take a norm of: the step runs without it, as
        # one that needs none (clipping and loss scaling change values, never what moves: Note
        # [the meta device] in device/tiers.py)
        if self._pipeline.needs_norm() and holds_values(eng.device):
            total = self._global_norm(grad_slots)  # 0-dim fp32, CPU
            total_f = float(total)
            if not math.isfinite(total_f):  # fp16 overflow, or a non-finite loss or gradient
                eng.restore_params_from_master(grad_slots)  # first: stopped in it, the step is no step
                self.skipped_steps += 1
                if not (scaler.enabled and scaler.cfg.dynamic) and not self._warned_skip:
                    # a dynamic fp16 scale skips as it finds its level; a fixed one never moves
                    self._warned_skip = True
                    _log.warning(
                        "chunkstar: optimizer step %d skipped: the global gradient norm is %s (%s); "
                        "engine.stats()['skipped_steps'] counts skipped steps, and later ones are not logged",
                        self.step_count + 1, total_f,
                        f"the fixed fp16 loss scale {scaler.scale:g} overflows the gradients, and every step it does is "
                        "skipped: set fp16.loss_scale lower, or 0 for dynamic scaling" if scaler.enabled else
                        "a non-finite loss or gradient; too high a learning rate?",
                    )  # fmt: skip
                scaler.update(overflow=True)
                return False
            self.last_grad_norm = total_f / scaler.scale
            if clip > 0 or scaler.enabled:
                # torch.nn.utils.clip_grad_norm_'s coefficient, applied with the same op order; an
                # fp32 value, multiplied in as a Python float (the same bits as the 0-dim fp32
                # tensor, and no copy to the device or sync on CUDA)
                coef = torch.tensor(1.0)
                if clip > 0:
                    coef = torch.clamp(torch.tensor(clip) / (total / scaler.scale + 1e-6), max=1.0)
                if scaler.enabled:
                    coef = coef / scaler.scale
                factor = float(coef)
        else:
            self._pipeline.partials.clear()
        on_device = {cid: slots for cid, slots in grad_slots.items() if mgr.chunks.chunk(ChunkList.PARAM, cid).tier is Tier.DEVICE}
        steps = self._step_tensors(grad_slots)
        self._writing = True  # from here a stop leaves some chunks stepped (Note [all or nothing])
        self._update(on_device, factor, steps)
        # (a host buffer a copy to the device may still read is waited for by its own update:
        # the chunk's pending event, Note [pending copy]; no device-wide sync here)
        for cid in self._forward_order():
            if cid in grad_slots and cid not in on_device:
                self._update_on_host(cid, grad_slots[cid], factor, steps)
        for slots in grad_slots.values():
            for s in slots:
                self._steps[s.index] += 1
                mgr.set_state(s.index, TensorState.HOLD)
        scaler.update(overflow=False)
        return bool(grad_slots) or comm.distributed  # alike on every rank, as the next step's refusal must be

    def _global_norm(self, grad_slots: dict[int, list[TensorSlot]]) -> torch.Tensor:
        """The global norm of the gradients in ``grad_slots`` (placed), every rank's: the norm
        of every contiguous gradient range, handed over during backward, or now with one
        foreach call per device (a model of many chunks must not pay a kernel call per
        chunk); the parts are joined in chunk order either way. A 0-dim fp32 CPU tensor."""
        mgr = self._store
        batched: dict[torch.device, list[torch.Tensor]] = {}
        pieces: list[tuple[int, torch.device | None, int, int]] = []  # (chunk, device or None: a partial, start, count)
        for cid, slots in grad_slots.items():
            if self._pipeline.has_norm(cid):
                pieces.append((cid, None, 0, 0))
                continue
            # not handed over, or handed over by a backward that needed no norm (measure_grad_norm
            # turned on since): measured here, where the chunk now lies; one whose home is a file
            # is read for it, alone (Note [param chunks on disk])
            if mgr.chunks.chunk(ChunkList.PARAM, cid).tier is Tier.DISK:
                with mgr.chunks.staged([(ChunkList.PARAM, cid)], write=False):
                    g = mgr.chunks.chunk(ChunkList.PARAM, cid).payload
                    pieces.append((cid, None, 0, 0))
                    self._pipeline.partials[cid] = (None, [range_norms([g[a:b] for _, a, b in runs(slots, lambda s: 0)])])
                continue
            g = mgr.chunks.chunk(ChunkList.PARAM, cid).payload
            ranges = batched.setdefault(g.device, [])
            spans = [g[a:b] for _, a, b in runs(slots, lambda s: 0)]
            pieces.append((cid, g.device, len(ranges), len(spans)))
            ranges.extend(spans)
        stacked = {dev: range_norms(rs) for dev, rs in batched.items()}
        norms: list[torch.Tensor] = []
        for cid, dev, start, count in pieces:
            if dev is None:
                norms.append(self._pipeline.norm_of(cid))
            else:
                norms.append(stacked[dev][start : start + count])
        self._pipeline.partials.clear()
        eng = self._engine
        return global_grad_norm(norms, eng.comm, eng.device)

    def _step_tensors(self, grad_slots: dict[int, list[TensorSlot]]) -> dict[tuple[torch.device, int], torch.Tensor]:
        """The fused kernel's step counts for this step, one 0-dim fp32 tensor per (device,
        step count) the updates use, made once per step (a fill on the device: no copy from
        the host, no sync on CUDA) and shared read-only by every call and queued job."""
        counts = {self._steps[s.index] + 1 for slots in grad_slots.values() for s in slots}
        devices = {self._engine.device, torch.device("cpu")}
        return {
            (dev, n): torch.full((), float(n), dtype=torch.float32, device=dev) for dev in devices for n in counts
        }

    def _place(self, cid: int) -> None:
        eng = self._engine
        mgr = self._store
        if cid in eng.device_adam_chunks:
            keys = [(name, cid) for name in CHUNK_LISTS]
            if all(mgr.resident(k) for k in keys):
                return  # the usual case after the first step: its state lives on the device
            mgr.make_resident(keys, MoveReason.OPTIMIZER, where=f"the optimizer step of chunk {cid}")
        else:
            for name in CHUNK_LISTS:
                mgr.to_host((name, cid), MoveReason.OPTIMIZER)

    def _buckets(
        self,
        buckets: dict[tuple[torch.device, int, int], tuple[list[torch.Tensor], ...]],
        tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        slots: list[TensorSlot],
        step_of: Callable[[int], int],
        flush: Callable[[], None],
        pending: int,
        scratch: torch.Tensor | None,
    ) -> int:
        """Add one chunk's runs (params, master, exp_avg, exp_avg_sq views) to ``buckets``
        by (device, group, step), in pieces of at most a batch (:func:`_batch_elements`) from
        each run's start, calling ``flush`` before a batch would exceed that; returns the
        elements pending.
        A bf16/fp16 gradient's fp32 copy goes into ``scratch`` (a batch's worth of fp32,
        reused by every batch) where given, else into a new tensor."""
        p, master, m, v = tensors
        convert = p.dtype != torch.float32
        group_of = self._group_of
        batch = _batch_elements(p.device)
        for (gi, step), a, b in runs(slots, lambda s: (group_of[s.index], step_of(s.index))):
            for lo in range(a, b, batch):
                hi = min(lo + batch, b)
                if pending + hi - lo > batch:
                    flush()
                    pending = 0
                lists = buckets.setdefault((p.device, gi, step), ([], [], [], [], []))
                lists[0].append(master[lo:hi])
                if not convert:
                    lists[1].append(p[lo:hi])
                elif scratch is not None:
                    lists[1].append(scratch[pending : pending + hi - lo].copy_(p[lo:hi]))  # fp32 gradient
                else:
                    lists[1].append(p[lo:hi].float())
                lists[2].append(m[lo:hi])
                lists[3].append(v[lo:hi])
                lists[4].append(p[lo:hi])
                pending += hi - lo
        return pending

    def _flusher(
        self,
        buckets: dict[tuple[torch.device, int, int], tuple[list[torch.Tensor], ...]],
        factor: float | None,
        steps: dict[tuple[torch.device, int], torch.Tensor],
        hyper: list[tuple[float, float, float, float, float]],
    ) -> Callable[[], None]:
        """One fused Adam call per bucket, then the foreach cast of the masters into the param
        slots; ``factor`` (None: none) scales the (fp32) gradients first, ``steps`` holds the
        step tensors (:meth:`_step_tensors`)."""
        decoupled = self._decoupled

        def flush() -> None:
            fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
            for (device, gi, step), (masters, grads, ms, vs, params) in buckets.items():
                lr, beta1, beta2, weight_decay, eps = hyper[gi]
                if factor is not None:
                    torch._foreach_mul_(grads, factor)
                step_t = steps.get((device, step + 1))  # read-only in the kernel: shared
                if step_t is None:  # a device spelled otherwise than the engine's
                    step_t = steps[(device, step + 1)] = torch.full((), float(step + 1), device=device)
                fused(
                    masters, grads, ms, vs, [], [step_t] * len(masters),
                    lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
                )  # fmt: skip
                torch._foreach_copy_(params, masters)
            buckets.clear()

        return flush

    def _scratch(self, where: str, elements: int) -> torch.Tensor | None:
        """A reused fp32 host buffer of at least ``min(elements, _HOST_BATCH_ELEMENTS)`` for
        gradients' fp32 copies, one per thread that updates (``where``: "host" for the host
        worker, "device" for the CPU virtual device's in-place updates). A new tensor per
        batch would be freed and faulted in again every step (more so after the heap's
        pages are handed back, Note [host heap]); CUDA's caching allocator keeps its own."""
        need = min(elements, _HOST_BATCH_ELEMENTS)
        if self._store.chunks.compute_dtype == torch.float32 or need <= 0:
            return None
        buf = self._scratch_bufs.get(where)
        if buf is None or buf.numel() < need:
            # kept for the run, used inside the optimizer step only: not the non-model memory
            # of the moments the memory probe measures (the fp32 copies it replaces were
            # temporaries of the step)
            with self._store.paused_probe():
                buf = self._scratch_bufs[where] = torch.empty(need, dtype=torch.float32, device=host_device(self._engine.device))
        return buf

    def _hyper(self) -> list[tuple[float, float, float, float, float]]:
        """Each group's (lr, beta1, beta2, weight_decay, eps) now: a queued update keeps them."""
        return [(g["lr"], *g["betas"], g["weight_decay"], g["eps"]) for g in self.param_groups]

    def _update(
        self, grad_slots: dict[int, list[TensorSlot]], factor: float | None, steps: dict[tuple[torch.device, int], torch.Tensor]
    ) -> None:
        """Pass 2 for chunks whose update runs where they are now (the device): fused Adam
        over the fp32 views of many chunks' runs at once, one call per (device, parameter
        group, step count), then a foreach cast of the masters back into the param slots.
        Runs are taken in batches of at most :func:`_batch_elements` gradient elements, a
        longer run in pieces of that size: bf16/fp16 gradients need fp32 copies, and all
        of them at once would cost 4 bytes per parameter of extra memory (one chunk's
        worth, too, when a chunk is large: a tied embedding alone in its chunk). Which
        batch a piece joins does not change its bits."""
        mgr = self._store
        buckets: dict[tuple[torch.device, int, int], tuple[list[torch.Tensor], ...]] = {}
        flush = self._flusher(buckets, factor, steps, self._hyper())
        pending = 0
        on_cpu = self._engine.device.type == "cpu"
        scratch = self._scratch("device", sum(s.numel for ss in grad_slots.values() for s in ss)) if on_cpu else None
        for cid, slots in grad_slots.items():
            tensors = tuple(mgr.chunks.chunk(name, cid).payload for name in CHUNK_LISTS)
            pending = self._buckets(buckets, tensors, slots, self._steps.__getitem__, flush, pending, scratch)  # type: ignore[arg-type]
        flush()

    def _update_on_host(
        self, cid: int, slots: list[TensorSlot], factor: float | None, steps: dict[tuple[torch.device, int], torch.Tensor]
    ) -> None:
        """Pass 2 for one host-Adam chunk, as a job on the host worker (Note [gradient
        pipeline]); the four chunks' readers and the param chunk's next copy wait for it.
        With the disk tier and overlap, its staging is issued behind, on the tier's step
        thread (Note [the step issued behind] in :mod:`chunkstar.runtime.disk_tier`)."""
        eng = self._engine
        mgr = self._store
        chunks: list[Chunk] = [mgr.chunks.chunk(name, cid) for name in CHUNK_LISTS]
        disk = self._disk
        hyper = self._hyper()
        slots = list(slots)
        # the step counts of this update, read now: the main thread counts on
        counts = {s.index: self._steps[s.index] for s in slots}
        scratch = self._scratch("host", sum(s.numel for s in slots))  # the worker's alone: its jobs run in turn
        if mgr.cursor.follows_trace():
            eng.host_work.widen()  # the host's updates are the schedule's now (Note [one OpenMP team])

        def update(tensors: tuple[torch.Tensor, ...], reads: list[CopyEvent], cut: list[TensorSlot] = slots) -> Callable[[], None]:
            def job() -> None:
                for r in reads:
                    r.wait()
                buckets: dict[tuple[torch.device, int, int], tuple[list[torch.Tensor], ...]] = {}
                flush = self._flusher(buckets, factor, steps, hyper)
                self._buckets(buckets, tensors, cut, counts.__getitem__, flush, 0, scratch)  # type: ignore[arg-type]
                flush()

            return job

        param = chunks[0]
        behind = [c for c in chunks if c.tier is Tier.DISK]
        if disk is not None and behind and len(disk.slices(param)) > 1:
            self._update_in_slices(chunks, behind, slots, update)
            return
        if disk is None or not isinstance(eng.host_work, HostWorker):
            # in this thread (no disk tier, or the serial reference path)
            reads: list[CopyEvent] = []
            # a param chunk too, when its home is a file (Note [param chunks on disk])
            staged = [c for c in chunks if c.tier is Tier.DISK]
            if staged:
                assert disk is not None
                with mgr.paused_probe():  # a staging buffer is model memory, kept for the run
                    disk.stage_in_all(staged)  # read ahead on the read lane (Note [disk tier]); the job waits for it
            for c in chunks:
                if c in staged:
                    assert c.pending_copy is not None
                    reads.append(c.pending_copy)
                else:
                    c.wait_ready()  # state chunks in memory: nothing in flight, normally
            tensors = tuple(c.host_buffer for c in chunks)
            # (a param chunk read from its file was waited for among the reads: its pending copy is that read)
            event = eng.host_work.submit(update(tensors, reads), after=None if param in staged else param.pending_copy)
            for c in chunks:
                c.set_work(event)
            if disk is not None:
                for c in staged:
                    disk.stage_out(c, write=True)  # written behind once the update is done
            return

        # Note [the step issued behind]: what is in host memory is read here; what lives on disk
        # is staged by the tier's step thread, which may wait for staging buffers without holding
        # up this thread (the next forward starts while the step's reads and writes go on)
        for c in chunks[1:]:
            if c.tier is not Tier.DISK:
                c.wait_ready()  # state in memory: nothing in flight, normally
        # a param chunk in host memory: its offload's copy may still be landing; the update follows it
        after = param.pending_copy if param.tier is not Tier.DISK else None
        in_memory = {id(c): c.host_buffer for c in chunks if c.tier is not Tier.DISK}
        issued = Issued()
        if param.tier is not Tier.DISK:
            param.set_work(issued)  # its readers and its next copy wait for the update, once issued
        for c in chunks[1:]:
            if c.tier is not Tier.DISK:
                c.set_work(issued)

        def issue() -> None:
            try:
                # (no probe to pause on this thread: a dispatch mode is per thread)
                disk.stage_in_all(behind)  # the buffers at once (Note [all or nothing])
                reads = []
                for c in behind:
                    assert c.pending_copy is not None
                    reads.append(c.pending_copy)
                tensors = tuple(in_memory[id(c)] if id(c) in in_memory else c.host_buffer for c in chunks)
                event = eng.host_work.submit(update(tensors, reads), after=after)
                for c in behind:
                    c.set_work(event)
                    disk.stage_out(c, write=True)  # written behind once the update is done
            except BaseException as e:
                issued.fail(e)
                raise
            issued.issue(event)

        disk.issue_behind(behind, issue)

    def _update_in_slices(
        self,
        chunks: list[Chunk],
        behind: list[Chunk],
        slots: list[TensorSlot],
        update: Callable[[tuple[torch.Tensor, ...], list[CopyEvent], list[TensorSlot]], Callable[[], None]],
    ) -> None:
        """Pass 2 for a chunk longer than the disk tier's slice (Note [the step in slices] in
        :mod:`chunkstar.runtime.disk_tier`): each slice of its lists on disk (``behind``) is
        staged into a buffer of its own, updated over the parameters' runs cut to it, and
        written behind; its lists in host memory are updated through views. The chunks on disk
        stay there; their next read waits for the last slice's write. With overlap, the
        staging runs on the tier's step thread as a whole chunk's does (Note [the step issued
        behind]); without, here."""
        eng = self._engine
        disk = self._disk
        assert disk is not None
        param = chunks[0]
        for c in chunks[1:]:
            if c.tier is not Tier.DISK:
                c.wait_ready()  # state in memory: nothing in flight, normally
        # a param chunk in host memory: its offload's copy may still be landing; the updates follow it
        after = param.pending_copy if param.tier is not Tier.DISK else None
        in_memory = {id(c): c.host_buffer for c in chunks if c.tier is not Tier.DISK}
        cuts = [(a, b, cut) for a, b in disk.slices(param) if (cut := _cut(slots, a, b))]

        def issue() -> CopyEvent:
            last: CopyEvent | None = None
            written: dict[int, CopyEvent] = {}
            for a, b, cut in cuts:
                staged = disk.stage_slices(behind, a, b)  # the slice's buffers at once (Note [all or nothing])
                bufs = {id(c): buf for c, (buf, _) in zip(behind, staged)}
                reads = [read for _, read in staged]
                tensors = tuple(bufs[id(c)] if id(c) in bufs else in_memory[id(c)][a:b] for c in chunks)
                last = eng.host_work.submit(update(tensors, reads, cut), after=after)
                for c in behind:
                    written[id(c)] = disk.write_slice(c, a, b, bufs[id(c)], last)
            for c in behind:  # one write lane, in order: the last slice's write is the chunk's
                if id(c) in written:
                    c.set_disk_write(written[id(c)])
            assert last is not None
            return last

        if not isinstance(eng.host_work, HostWorker):  # the serial reference path: here
            with self._store.paused_probe():  # staging buffers are model memory, kept for the run
                event = issue()
            for c in chunks:
                if c.tier is not Tier.DISK:
                    c.set_work(event)
            return
        issued = Issued()
        for c in chunks:
            if c.tier is not Tier.DISK:
                c.set_work(issued)  # readers and the next copy wait for the updates, once issued

        def behind_job() -> None:
            try:
                event = issue()
            except BaseException as e:
                issued.fail(e)
                raise
            issued.issue(event)

        disk.issue_behind(behind, behind_job)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        self.check_thread("optimizer.state_dict()")
        mgr = self._store
        state: dict[int, dict[str, torch.Tensor]] = {}
        for cid in range(mgr.layout.n_chunks):
            slots = [s for s in mgr.slots_of(cid) if self._steps[s.index] > 0]
            if not slots or not mgr.chunks.own(cid):
                continue  # with several processes each rank saves the state of its own chunks
            for s in slots:
                state[s.index] = {"step": torch.tensor(float(self._steps[s.index]))}
            # one list at a time: between steps, a chunk's moments are never staged together
            # (Note [the step in slices] in chunkstar.runtime.disk_tier)
            for name, key in ((ChunkList.EXP_AVG, "exp_avg"), (ChunkList.EXP_AVG_SQ, "exp_avg_sq")):
                with mgr.chunks.staged([(name, cid)], write=False):
                    for s in slots:
                        state[s.index][key] = mgr.chunks.slot_view(name, s).detach().to("cpu", copy=True).view(s.shape)
        groups = []
        for g, group in enumerate(self.param_groups):
            entry = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
            entry["params"] = [self._engine.index_of(p) for p in group["params"]]
            groups.append(entry)
        return {
            "format": _FORMAT,
            "state": state,
            "param_groups": groups,
            "loss_scaler": self._engine.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.check_thread("optimizer.load_state_dict()")
        if state_dict.get("format") != _FORMAT:
            raise ValueError(
                f"not a chunkstar optimizer state dict (format {state_dict.get('format')!r}, expected {_FORMAT!r})"
            )
        LossScaler.check_state_dict(state_dict.get("loss_scaler"))  # every check before anything changes
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} parameter groups, this optimizer {len(self.param_groups)}")
        for mine, theirs in zip(self.param_groups, groups):
            if [self._engine.index_of(p) for p in mine["params"]] != list(theirs["params"]):
                raise ValueError("parameter groups of the state dict do not match this optimizer's")
        mgr = self._store
        for s in mgr.slots:
            st = state_dict["state"].get(s.index)
            for key in ("exp_avg", "exp_avg_sq"):
                if st is not None and st[key].numel() != s.numel:
                    raise ValueError(
                        f"optimizer state '{key}' of parameter '{s.name}' has {st[key].numel()} elements, expected {s.numel}"
                    )
        with deferred_interrupts():  # checked: now things change (Note [all or nothing])
            try:
                self._load_state(state_dict, groups)
            except BaseException as e:
                self.interrupted(
                    f"optimizer.load_state_dict() was stopped by {type(e).__name__} after it had loaded some chunks' Adam "
                    "state and not others",
                    "call optimizer.load_state_dict again and let it complete",
                    {"optimizer"},
                )
                raise
        self.restored({"optimizer"})

    def _load_state(self, state_dict: dict[str, Any], groups: list[dict[str, Any]]) -> None:
        mgr = self._store
        for mine, theirs in zip(self.param_groups, groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = tuple(v) if k == "betas" else v
        with torch.no_grad():
            self._steps = [0] * len(mgr.slots)
            for cid in range(mgr.layout.n_chunks):
                if not mgr.chunks.own(cid) or mgr.chunks.frozen(cid):
                    continue  # another rank's, or frozen (no Adam state: Note [frozen chunks])
                for name, key in ((ChunkList.EXP_AVG, "exp_avg"), (ChunkList.EXP_AVG_SQ, "exp_avg_sq")):
                    with mgr.chunks.staged([(name, cid)], write=True):  # one list at a time, as saved
                        for s in mgr.slots_of(cid):
                            st = state_dict["state"].get(s.index)
                            view = mgr.chunks.slot_view(name, s)
                            if st is None:
                                view.zero_()
                            else:
                                view.copy_(st[key].reshape(-1))
                for s in mgr.slots_of(cid):
                    st = state_dict["state"].get(s.index)
                    if st is not None:
                        self._steps[s.index] = int(st["step"])
        self._engine.scaler.load_state_dict(state_dict["loss_scaler"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self._applied_at = None

    def scalar_state(self) -> dict[str, Any]:
        """The optimizer's state apart from its chunks, JSON-ready (a checkpoint shard
        stores it next to the moment chunks): its kind ("AdamW" or "Adam": a checkpoint
        of one does not resume the other), this rank's Adam step count per parameter
        slot (0 for other ranks' slots), the parameter groups' settings and members
        (slot indices), the skipped steps and the steps taken."""
        mgr = self._store
        groups = []
        for group in self.param_groups:
            entry = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
            entry["params"] = [self._engine.index_of(p) for p in group["params"]]
            groups.append(entry)
        return {
            "kind": self._config.type_name,
            "steps": [self._steps[s.index] if mgr.chunks.own(s.chunk_id) else 0 for s in mgr.slots],
            "param_groups": groups,
            "skipped_steps": self.skipped_steps,
            "step_count": self.step_count,
        }

    def load_scalar_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`scalar_state` (the caller checked that the groups' members match)."""
        mgr = self._store
        for mine, theirs in zip(self.param_groups, state["param_groups"]):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = tuple(v) if isinstance(v, list) else v
        self._steps = [int(n) if mgr.chunks.own(s.chunk_id) else 0 for s, n in zip(mgr.slots, state["steps"])]
        self.skipped_steps = int(state["skipped_steps"])
        self.step_count = int(state["step_count"])
        self._applied_at = None


def _cut(slots: list[TensorSlot], first: int, end: int) -> list[TensorSlot]:
    """The parts of ``slots`` within elements ``first:end`` of their chunk, their offsets from
    ``first`` (a slice's own buffer; Note [the step in slices])."""
    out = []
    for s in slots:
        lo, hi = max(s.offset, first), min(s.end, end)
        if lo < hi:
            out.append(dataclasses.replace(s, offset=lo - first, numel=hi - lo))
    return out
