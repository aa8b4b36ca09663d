"""The engine: wraps the user's model and drives one training iteration.

It builds the chunk layout, moves every parameter into the chunk lists (the
parameter objects stay; their ``.data`` becomes a view into the param chunk's
persistent device tensor, Note [persistent device storage] in
:mod:`chunkstar.chunk.chunk`), installs the hooks, and wires the parts that
react to them:

* a forward/backward pre-hook begins a *moment*: the module's chunks are made
  resident within that moment's budget and its tensors go to COMPUTE;
* a gradient hook folds the finished gradient into the parameter's own slot
  (or, while accumulating over micro-batches, into an fp32 host accumulator);
* a parameter touched anywhere else (another module's forward, the loss, user
  code between steps) reaches the runtime through its guard (Note [parameter
  guard], :mod:`chunkstar.runtime.param_access`);
* the first two training iterations are the warm-up: the memory probe
  measures non-model memory per moment (budgets use the live figure meanwhile),
  and at its end the trace is frozen and the hybrid-Adam placement is planned;
  later iterations are checked against the trace and re-traced when the run
  changes shape (Note [iteration]).

This module is the user-facing API (the model calls, state dicts, checkpoints,
stats) and the wiring of the parts; what each hook does is
:mod:`chunkstar.runtime.hook_targets`, the iteration's lifecycle
:mod:`chunkstar.runtime.iteration`, gradient folding and accumulation
:mod:`chunkstar.runtime.gradients`, where the iteration is
:mod:`chunkstar.memory.cursor` (written by :mod:`chunkstar.runtime.schedule`
only), moving bytes :class:`ChunkManager`'s job and choosing the policies'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from torch import nn

from chunkstar import checkpoint
from chunkstar.chunk.layout import TensorSlot, build_layout, search_chunk_size
from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.state import TensorState
from chunkstar.config import ActivationPolicy, EngineConfig, Precision
from chunkstar.construction.materialize import fill_chunks, origin_fingerprint
from chunkstar.construction.pretrained import PretrainedSource
from chunkstar.device.copy_engine import HostWorker, InlineWorker, debug_delay_from_env, make_copy_engine
from chunkstar.device.virtual import DeviceThread, strict_device
from chunkstar.distributed.comm import Comm
from chunkstar.distributed.grad_reduce import GroupReducer
from chunkstar.distributed.startup import agree_on_startup
from chunkstar.errors import ChunkStateError
from chunkstar.events import EventBus, Stage
from chunkstar.activations import BlockActivations, HostOffload, find_blocks
from chunkstar.activations.measure import SavedCounter
from chunkstar.hooks.module_hooks import EngineHook, hooked_modules, install_hooks
from chunkstar.hooks.param_guard import guarded_class, watched_class
from chunkstar.hooks.param_upcast import install_upcasts  # issue 18.5: Note [norm dtypes]
from chunkstar.memory.budget import Overrun
from chunkstar.memory.cursor import Cursor
from chunkstar.memory.host_heap import HostHeap, bound_heap_retention
from chunkstar.memory.probes import MemoryProbe, make_probe
from chunkstar.optim.loss_scaler import LossScaler
from chunkstar.optim.pipeline import GradientPipeline
from chunkstar.placement.module_dtype import upcast_dtype  # issue 18.5: Note [norm dtypes]
from chunkstar.runtime.chunk_manager import ChunkManager
from chunkstar.runtime.disk_tier import DiskParts, DiskTier
from chunkstar.runtime.hook_targets import HookTargets
from chunkstar.runtime.iteration import Iteration
from chunkstar.runtime.param_access import ParamAccess
from chunkstar.runtime.reads import ReadState
from chunkstar.runtime.schedule import Schedule
from chunkstar.runtime.start_checks import (
    check_inputs, check_units_fit, device_capacity_of, disk_chunk_cap, memory_chunk_cap, plan_host_memory, refuse_foreign_optimizers,
    refuse_sparse_gradients,
)  # fmt: skip
from chunkstar.runtime.state_dict import full_masters, match_values, tied_names, write_values

if TYPE_CHECKING:
    from chunkstar.optim.adam import ChunkAdam

__all__ = ["ChunkEngine"]



class ChunkEngine:
    def __init__(
        self,
        model: nn.Module,
        cfg: EngineConfig,
        *,
        model_func: Callable[[], nn.Module] | None = None,
        pretrained: str | os.PathLike[str] | None = None,
        comm: Comm | None = None,
        disk_parts: DiskParts | None = None,
    ) -> None:
        try:
            self._build(model, cfg, model_func=model_func, pretrained=pretrained, comm=comm, disk_parts=disk_parts)
        except BaseException:
            mgr: ChunkManager | None = self.__dict__.get("mgr")
            disk = mgr.chunks.disk if mgr is not None else None
            if disk is not None:
                disk.discard()  # a failed start leaves no chunk files or lock behind (Note [disk tier])
            raise

    def _build(
        self,
        model: nn.Module,
        cfg: EngineConfig,
        *,
        model_func: Callable[[], nn.Module] | None,
        pretrained: str | os.PathLike[str] | None,
        comm: Comm | None,
        disk_parts: DiskParts | None,
    ) -> None:
        self.module = model
        self.config = cfg
        self.device = cfg.device
        if cfg.device.type == "cuda":
            # streams, events, the allocator and NCCL work on the current device: each rank's own
            # (cuda:<local_rank>), never every rank's on GPU 0
            torch.cuda.set_device(cfg.device)
        self.events = EventBus()
        dtype = cfg.precision.dtype

        named = list(model.named_parameters())  # unique parameters, registration order
        if not named:
            raise ValueError("the model has no parameters: there is nothing for chunkstar to manage")
        self._params: list[nn.Parameter] = [p for _, p in named]
        self._index: dict[int, int] = {id(p): i for i, p in enumerate(self._params)}
        # the process group (a dry run passes ranks it simulates: chunkstar/dryrun/comm.py)
        self.comm = comm if comm is not None else Comm.from_environment()
        world = self.comm.world_size
        numels = [p.numel() for p in self._params]
        # frozen parameters get chunks of their own with no optimizer state (Note [frozen chunks])
        frozen = [not p.requires_grad for p in self._params]
        self._frozen_params = [p for p, f in zip(self._params, frozen) if f]
        capacity = device_capacity_of(cfg)  # resolved once: the GPU's free memory is read here only
        if cfg.placement.chunk_size:
            chunk_size = cfg.placement.chunk_size
        else:
            # "auto": the least padding, in chunks a few groups of which fit the device at once
            caps = [memory_chunk_cap(cfg, world, self.comm.distributed and self.comm.on_device(cfg.device)), disk_chunk_cap(cfg)]
            cap = min((c for c in caps if c is not None), default=None)
            chunk_size = search_chunk_size(numels, world_size=world, frozen=frozen, max_size=cap)
        check_inputs(model, cfg, sum(numels), capacity)
        refuse_sparse_gradients(model)
        layout = build_layout(
            [n for n, _ in named], [tuple(p.shape) for p in self._params], chunk_size, world_size=world, frozen=frozen
        )
        self.chunk_size = chunk_size
        # host memory is planned before anything is built (Note [host memory plan]): a plan over
        # its budget is refused now; the disk lists, when left to the engine, are decided here
        credit = sum(p.numel() * p.element_size() for p in self._params if p.device.type == "cpu")
        disk_lists, self.host_plan, self.host_budget = plan_host_memory(cfg, layout, self.comm.rank, credit)
        for s, p in zip(layout.slots, self._params):
            if not p.is_floating_point():
                raise TypeError(f"parameter '{s.name}' has dtype {p.dtype}; chunkstar manages floating-point parameters")
        source = PretrainedSource(pretrained) if pretrained is not None else None
        try:
            # every rank checks it builds the same engine, before any chunk collective (Note
            # [start-up agreement]); values that are not all on every rank (a meta-device model,
            # a checkpoint each rank reads its share of) agree by where they come from
            meta = any(p.is_meta for p in self._params)
            weights = origin_fingerprint(model, source) if meta or source is not None else self._params
            self.run_id = agree_on_startup(self.comm, cfg, layout, weights)
            self._optimizer: ChunkAdam | None = None
            placement = cfg.placement
            cursor = Cursor()  # where the iteration is: the schedule writes it, the manager and the targets read it
            overrun = Overrun()  # a warm-up's allowance to go over the budget: the schedule sets it, the manager asks
            self.mgr = ChunkManager(
                layout, placement, capacity, dtype, probe=make_probe(cfg.device), events=self.events, comm=self.comm,
                copies=make_copy_engine(cfg.device, placement.overlap, placement.link_bandwidth), cursor=cursor,
                let_through=overrun.let_through, held_at_once=overrun.held_at_once,
            )  # fmt: skip
            self.heap_retention_bounded = False
            if cfg.disk is not None:  # Note [disk tier]: the state lists' chunks live in files
                # host memory is what the run is sized against: glibc keeps no large freed blocks
                self.heap_retention_bounded = bound_heap_retention()  # (Note [host heap])
                chunks = self.mgr.chunks
                chunks.attach_disk(DiskTier(
                    cfg.disk, chunks.disk_chunks(disk_lists), run_tag=self.run_id, rank=self.comm.rank,
                    on_move=self.mgr.counters.record_disk, quiet=self.mgr.probe.paused, parts=disk_parts,
                    used=layout.used_ends(),  # Note [a file holds what a chunk uses]
                ))  # fmt: skip
            # the chunks get their values (Note [construction]): host memory peaks at about the
            # chunks' own bytes, never at the whole model beside them
            self.construction = fill_chunks(
                model, self._params, layout, self.mgr, self.mgr.allocate_on_host, model_func=model_func, source=source,
                wave_bytes=self.mgr.chunks.disk.budget if self.mgr.chunks.disk is not None else 0,
            )  # fmt: skip
        finally:
            if source is not None:
                source.close()
        self._index = {id(p): i for i, p in enumerate(self._params)}  # a meta parameter may be a new object
        self._frozen_params = [p for p in self._params if not p.requires_grad]
        with torch.no_grad():
            for cid in range(layout.n_chunks):
                slots = self.mgr.slots_of(cid)
                for s in slots:
                    self.mgr.set_state(s.index, TensorState.HOLD)
                views = self.mgr.chunks.chunk(ChunkList.PARAM, cid).device_views([(s.offset, s.end, s.shape) for s in slots])
                for s, view in zip(slots, views):
                    self._params[s.index].data = view
        for mod in model.modules():
            for name, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[name] = b.to(cfg.device)

        self.scaler_enabled = cfg.precision is Precision.FP16
        self.scaler = LossScaler(cfg.optimizer.loss_scale, self.scaler_enabled)
        self.reducer = GroupReducer(self.mgr, self.comm, self.device, self._params, cfg.reduce_dtype)  # several processes only
        # host-side work (the optimizer's updates, gradient norms) off the compute thread
        # with overlap; in the calling thread on the serial reference path
        self.host_work: HostWorker | InlineWorker = (
            HostWorker(debug_delay_from_env(), device=cfg.device) if cfg.placement.overlap else InlineWorker()
        )
        # the strict CPU virtual device runs the backward on a device thread of its own, as autograd
        # does for CUDA tensors: hooks, evictions and frees off the caller's thread (Note [strict device])
        self._device_thread = DeviceThread() if cfg.device.type == "cpu" and strict_device() else None
        # what the device held before any chunk was on it (CUDA: the user's tensors, workspaces):
        # device_peak_bytes counts from here
        self._device_baseline = 0
        if cfg.device.type == "cuda":
            self._device_baseline = torch.cuda.memory_allocated(cfg.device) - self.mgr.memory.held_bytes
            torch.cuda.reset_peak_memory_stats(cfg.device)
            self.mgr.memory.peak_bytes = 0
        # "auto": four times the largest param chunk (ScheduleConfig.prefetch_window), resolved once
        self.prefetch_window = cfg.schedule.prefetch_window or 4 * max(c.nbytes for c in self.mgr.chunks.chunks_of(ChunkList.PARAM))

        # the parts: the gradient pipeline (the optimizer reads what it takes), the iteration (with
        # the schedule and the gradients), the hook targets, the guard's handler
        device_adam_chunks: set[int] = set()  # hybrid Adam's chunks: the iteration plans them when the trace freezes
        opt = cfg.optimizer
        self.gradient_pipeline = GradientPipeline(
            self.mgr, cfg.device, self.host_work, device_adam_chunks,
            norm_by_config=opt.gradient_clipping > 0 or self.scaler_enabled,
        )  # fmt: skip
        self._views = [p.data for p in self._params]  # each parameter's view into its param chunk's device tensor
        reads = ReadState(self.mgr)  # what parameter reads leave behind: the targets, the iteration and the access settle it
        self._iteration = Iteration(
            dataclasses.replace(cfg.schedule, prefetch_window=self.prefetch_window), self.mgr, cursor, self.comm,
            self.events, self.reducer, accumulation_steps=opt.accumulation_steps, consumer=self.gradient_pipeline,
            device_adam_chunks=device_adam_chunks, hybrid_adam=opt.hybrid_adam, loss_scaling=self.scaler_enabled,
            overrun=overrun, reads=reads,
        )  # fmt: skip
        self._gradients = self._iteration.gradients
        modules = hooked_modules(model, self._index)
        self._targets = HookTargets(
            self.mgr, cursor, self.comm, self.events, self._iteration, self._gradients, self.reducer, self._params, modules, reads
        )
        self.access = ParamAccess(self, self._targets, self._iteration, reads)
        self._unhook_optimizers = refuse_foreign_optimizers(self)
        self._handles, self._units = install_hooks(model, modules, self._index, self._targets)
        # issue 18.5: norm layers see their parameters in fp32 within their forward, as under
        # autocast over fp32 weights (Note [norm dtypes]); after install_hooks (Note [parameter upcast])
        self._handles += install_upcasts(model, lambda m: upcast_dtype(m, dtype))
        self._casts: dict[int, torch.dtype] = {}  # id(module) -> dtype it cast its parameters to (see_in_dtype)
        self.activations = self._wrap_blocks(model, cfg)  # Note [activation policies]
        self._iteration.activations = self.activations
        self._iteration.saved_counter = self._saved_counter(model, cfg)
        check_units_fit(modules, [u.key for u in self._units], self.mgr)
        # one guarded and one watched class per parameter class (Note [parameter guard], Note [data aliases])
        guarded: dict[type, tuple[type, type]] = {}
        for p in self._params:
            if type(p) not in guarded:
                guarded[type(p)] = (watched_class(type(p), self.access), guarded_class(type(p), self.access))
        classes = [guarded[type(p)] for p in self._params]
        self.mgr.install_guard(self._params, [w for w, _ in classes], [g for _, g in classes])
        # module.state_dict() serves the fp32 masters (runtime/param_access.py); the root's hooks
        # span a whole call, so tied names get one tensor
        for mod in [m for m in model.modules() if m is model or any(True for _ in m.parameters(recurse=False))]:
            self._handles.append(mod.register_state_dict_pre_hook(EngineHook(lambda *_: self.access.begin_state_dict())))
            self._handles.append(mod.register_state_dict_post_hook(EngineHook(lambda *_: self.access.end_state_dict())))

    def _wrap_blocks(self, model: nn.Module, cfg: EngineConfig) -> BlockActivations | None:
        """The blocks' activation policy (Note [activation policies]): None for ``keep``, which
        leaves every forward as it is."""
        act = cfg.activations
        if act.policy is ActivationPolicy.KEEP:
            return None
        chunk_storages = {c.device_view.untyped_storage()._cdata for c in self.mgr.chunks.chunks_of(ChunkList.PARAM)}
        cursor = self.mgr.cursor
        offload = HostOffload(
            cfg.device, lambda t: t.untyped_storage()._cdata in chunk_storages, quiet=self.mgr.probe.paused,
            copies=self.mgr.copies, events=self.events, moment=lambda: cursor.moment,
        )  # fmt: skip
        blocks = find_blocks(model, act.blocks)
        names = {id(m): n for n, m in model.named_modules()}
        return BlockActivations(blocks, act.policy, offload, [names[id(b)] for b in blocks])

    def _target_costs(
        self, forward_cost: Callable[[Callable[[], Any]], tuple[Any, float]], link: float, host_update_seconds: float
    ) -> None:
        """A dry run's stand-ins for what "auto" measures (Note [dry run]): a block's forward seconds
        from its FLOPs at the target's rate, the target's host link and host Adam update rate."""
        if self.activations is not None:
            self.activations.cost = forward_cost
        self._iteration.link_bandwidth = link
        self._iteration.host_update_seconds = host_update_seconds

    def _saved_counter(self, model: nn.Module, cfg: EngineConfig) -> SavedCounter | None:
        """Under ``keep``, the warm-up's count of what the blocks save (for its errors): None for a
        model without blocks, or under another policy (which wraps them itself)."""
        if cfg.activations.policy is not ActivationPolicy.KEEP:
            return None
        try:
            blocks = find_blocks(model, cfg.activations.blocks)
        except ValueError:
            if cfg.activations.blocks is not None:
                raise  # named classes the model does not have: said at start, as under the other policies
            return None
        names = {id(m): n for n, m in model.named_modules()}
        chunk_storages = {c.device_view.untyped_storage()._cdata for c in self.mgr.chunks.chunks_of(ChunkList.PARAM)}
        return SavedCounter(
            blocks, [names[id(b)] for b in blocks], cfg.device, lambda t: t.untyped_storage()._cdata in chunk_storages
        )

    # ------------------------------------------------------------------ the parts, read-only
    @property
    def optimizer(self) -> ChunkAdam | None:
        """The ChunkAdam over this engine (it attaches itself); checkpoints carry its state."""
        return self._optimizer

    @optimizer.setter
    def optimizer(self, opt: ChunkAdam | None) -> None:
        self._optimizer = opt

    @property
    def schedule(self) -> Schedule:
        return self._iteration.schedule

    @property
    def host_heap(self) -> HostHeap | None:
        """The CPU virtual device's heap (Note [host heap]); None on CUDA."""
        return self._iteration.host_heap

    @host_heap.setter
    def host_heap(self, heap: HostHeap | None) -> None:
        """None turns the heap releases off (the tests compare runs with and without them)."""
        self._iteration.host_heap = heap

    @property
    def micro_step(self) -> int:
        """Training iterations (micro-batches) completed."""
        return self._iteration.micro_step

    @property
    def device_adam_chunks(self) -> set[int]:
        """Chunks whose Adam update runs on the device (hybrid Adam, planned when the warm-up ends)."""
        return self._iteration.device_adam_chunks

    # ------------------------------------------------------------------ model API
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model. With autograd on this is (part of) a training iteration;
        under ``torch.no_grad()`` an evaluation forward that the schedule ignores."""
        if self.access.gathered_active():
            raise ChunkStateError("the model cannot run inside engine.gathered_parameters(): leave the block first")
        it = self._iteration
        training = torch.is_grad_enabled()
        if training:
            if not it.open:
                self._check_still_frozen()
            it.begin(args, kwargs)
        else:
            it.begin_untraced(args, kwargs)
        it.schedule.set_stage(Stage.FWD)
        try:
            with self._autocast():
                out = self.module(*args, **kwargs)
        except BaseException:
            if training:
                it.abort()
            else:
                it.end_untraced()
            raise
        if not training:
            it.end_untraced()
        return out

    def _check_still_frozen(self) -> None:
        """A parameter laid out as frozen has no master, no Adam state and no gradient
        hook (Note [frozen chunks]): it cannot start training later."""
        thawed = [p for p in self._frozen_params if p.requires_grad]
        if thawed:
            names = [self.mgr.slots[self.index_of(p)].name for p in thawed]
            raise ChunkStateError(
                f"requires_grad was turned on after initialize_engine for {len(names)} parameter(s) that were frozen "
                f"then ({', '.join(names[:5])}{' ...' if len(names) > 5 else ''}): chunkstar laid them out with no "
                "fp32 master and no optimizer state, so they cannot be trained. Set requires_grad as it should be "
                "for training inside model_func, before initialize_engine (turning it off later is allowed)"
            )

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.precision is Precision.FP32 or not torch.amp.is_autocast_available(self.device.type):
            return contextlib.nullcontext()  # torch has no autocast for the meta device (Note [the meta device])
        return torch.autocast(self.device.type, dtype=self.config.precision.dtype)

    def backward(self, loss: torch.Tensor, *, last: bool | None = None, divide: bool = True) -> None:
        """Back-propagate ``loss`` (divided by gradient_accumulation_steps, times the fp16 loss scale).

        For a loop that decides its accumulation windows itself (Note [windows the loop decides]
        in :mod:`chunkstar.runtime.gradients`): ``last=True`` makes this micro-batch the last
        before ``optimizer.step()`` even when fewer than gradient_accumulation_steps came since
        the last step (an epoch's short last window); ``last=False`` says it is not, and is
        refused where the window would grow past gradient_accumulation_steps; None (the
        default) counts. ``divide=False`` leaves the loss undivided, for a loop that normalised
        it over the window already (Lightning divides by ``accumulate_grad_batches``)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"engine.backward expects a scalar loss tensor, got {type(loss).__name__}")
        if last is not None and not isinstance(last, bool):
            raise TypeError(f"engine.backward(last=...) takes True, False or None, got {last!r}")
        if not isinstance(divide, bool):
            raise TypeError(f"engine.backward(divide=...) takes True or False, got {divide!r}")
        if not loss.requires_grad:
            raise ValueError("the loss does not require grad: was the forward run under torch.no_grad()?")
        if not self._iteration.open:
            raise ChunkStateError(
                "engine.backward(loss) with no training forward of the engine since the last backward: that "
                "backward used up the forward's graph (and its gradients wait for optimizer.step()); run the "
                "model again for each backward, or combine the losses of one forward into one before it"
            )
        self._gradients.check_last(last)
        if divide:
            loss = self._gradients.scale_loss(loss)
        if self.scaler_enabled:
            loss = loss * self.scaler.scale
        it = self._iteration
        it.begin_backward(last)
        try:
            if self._device_thread is not None:
                self._device_thread.run(loss.backward)
            else:
                loss.backward()
        except BaseException:
            it.abort()
            raise
        if self._gradients.arrived == 0 and self._trains_anything():
            # no engine hook ran: the loss does not depend on this engine's parameters
            it.abort()
            raise ChunkStateError(
                "engine.backward(loss): no gradient reached this engine's parameters, so the loss was not computed "
                "from its forward (another model's output, a tensor detached from the engine's, or a forward run "
                "under torch.no_grad()); compute the loss from engine(...)'s output"
            )
        it.end_backward()

    def train(self, mode: bool = True) -> ChunkEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ChunkEngine:
        return self.train(False)

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter(self._params)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters()

    @property
    def memory_probe(self) -> MemoryProbe:
        """The device tier's non-model memory probe. A tool that wants non-model
        figures in the memory samples after warm-up (a profiler) holds it:
        ``engine.memory_probe.acquire("profiler")`` ... ``release("profiler")``."""
        return self.mgr.probe

    # ------------------------------------------------------------------ parameters by slot index
    def index_of(self, p: torch.Tensor) -> int:
        try:
            return self._index[id(p)]
        except KeyError:
            raise ValueError("this tensor is not a parameter of the engine's model") from None

    def param_index(self, p: torch.Tensor) -> int | None:
        return self._index.get(id(p))

    def parameter(self, index: int) -> nn.Parameter:
        return self._params[index]

    def param_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s view into its param chunk's persistent device tensor."""
        return self._views[index]

    # ------------------------------------------------------------------ for the optimizer
    def begin_optimizer_step(self) -> None:
        self._iteration.begin_optimizer_step()

    def end_optimizer_step(self) -> None:
        self._iteration.end_optimizer_step()
        if self.mgr.chunks.disk is not None:
            self.mgr.chunks.disk.step_ended()

    def restore_params_from_master(self, slots_by_chunk: dict[int, list[TensorSlot]]) -> None:
        self._gradients.restore_params_from_master(slots_by_chunk)

    def drop_pending_grads(self) -> None:
        self._gradients.drop_pending()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient not consumed by a step, as DeepSpeed's ``engine.zero_grad()`` and
        ``optimizer.zero_grad()`` do (``set_to_none=False`` keeps them as zeros, as torch's)."""
        if self._optimizer is not None and set_to_none:
            self._optimizer.zero_grad()
        elif set_to_none:
            self._gradients.drop_pending()
        else:
            for i in range(len(self._params)):
                self._gradients.zero(i)

    # ------------------------------------------------------------------ for parameter access
    def check_thread(self, doing: str) -> None:
        """Refuse ``doing`` from a thread other than the one that trains (Note [the training
        thread] in optim/adam.py); an engine with no optimizer has no training thread."""
        if self._optimizer is not None:
            self._optimizer.check_thread(doing)

    def gradient_kept(self, index: int) -> torch.Tensor | None:
        return self._gradients.kept_value(index)

    def drop_gradients(self, indices: list[int]) -> None:
        self._gradients.drop(indices)

    def zero_gradient(self, index: int) -> None:
        self._gradients.zero(index)

    def see_in_dtype(self, index: int, dtype: torch.dtype) -> None:
        """A module cast parameter ``index`` to ``dtype`` in its forward (Note [a model casting
        its parameters] in runtime/param_access.py): every module that registered it sees its
        parameters in that dtype from its next call on."""
        p = self._params[index]
        for mod in self.module.modules():
            if not any(q is p for q in mod._parameters.values()):
                continue
            seen = self._casts.get(id(mod)) or upcast_dtype(mod, self.config.precision.dtype)
            if seen == dtype:
                continue  # it sees them so already (a norm layer cast to fp32)
            if seen is not None:
                raise ChunkStateError(
                    f"module {type(mod).__name__} casts parameter '{self.mgr.slots[index].name}' to {dtype} in its "
                    f"forward, but it already sees its parameters in another dtype: chunkstar can show a module its "
                    "parameters in one dtype only"
                )
            self._casts[id(mod)] = dtype

            def only(m: nn.Module, mod: nn.Module = mod) -> torch.dtype | None:
                return dtype if m is mod else None

            self._handles += install_upcasts(mod, only)

    def _trains_anything(self) -> bool:
        mgr = self.mgr
        return any(not mgr.chunks.frozen(c) for c in range(mgr.layout.n_chunks))

    def _has_pending_grads(self) -> bool:
        return self._gradients.has_pending()

    def gradients_pending(self) -> bool:
        """Whether a backward left gradients that no ``optimizer.step()`` or ``zero_grad()``
        has consumed yet (an accumulation window is open): a checkpoint cannot be saved now."""
        return self._gradients.has_pending() or self._gradients.has_kept()

    # ------------------------------------------------------------------ state

    def _slot_of_param(self) -> dict[int, TensorSlot]:
        return {id(p): self.mgr.slots[i] for i, p in enumerate(self._params)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's own keys; parameters as their fp32 masters, everything on the CPU.

        The same as ``engine.module.state_dict()`` with buffers copied to the CPU.
        With several processes this is a collective (every rank must call it): the
        masters, each kept by its owner only, are all-gathered group by group. Call it
        on the thread that trains (Note [the training thread] in :mod:`chunkstar.optim.adam`)."""
        if self._optimizer is not None:
            self._optimizer.check_thread("engine.state_dict()")
        return {k: v.detach().to("cpu", copy=True) if v.device.type != "cpu" else v for k, v in self.module.state_dict().items()}

    def full_masters(self) -> dict[int, torch.Tensor]:
        """Every chunk's fp32 values by id (a collective with several processes:
        :func:`chunkstar.runtime.state_dict.full_masters`)."""
        return full_masters(self.mgr, self.comm, self.device)

    def gathered_parameters(
        self,
        params: Iterable[torch.Tensor] | None = None,
        *,
        writeback: bool = True,
        device: torch.device | str | None = None,
    ) -> contextlib.AbstractContextManager[list[nn.Parameter]]:
        """Between steps, give ``params`` (default: all) their real fp32 values.

        Inside the block each named parameter's ``.data`` is an ordinary fp32 tensor
        holding its master value, on ``device`` (default: the engine's device), so any
        code may read it, alias it (``p.data``, ``p.detach()``, views) or change it in
        place. On exit, with ``writeback`` (the default), the values are written back
        to the masters and the param chunks; without it, changes are dropped. The
        model cannot run inside the block. With several processes every rank must
        enter it with the same parameters (the masters are gathered) and make the
        same changes (each rank writes back the chunks it owns).

        The anchors are DeepSpeed's ``GatheredParameters`` and FSDP's
        ``summon_full_params``. Yields the parameters, in the model's order."""
        if self.mgr.cursor.stage is not Stage.IDLE:
            raise ChunkStateError(
                f"gathered_parameters() is for use between steps, but the engine is in its {self.mgr.cursor.stage.value} stage"
            )
        if self._iteration.open:
            raise ChunkStateError(
                "gathered_parameters() is for use between steps, but a training iteration is open (a forward, or a "
                "parameter read with autograd on, since the last engine.backward()): call engine.backward() first, "
                "or read parameters under torch.no_grad()"
            )
        indices = sorted({self.index_of(p) for p in params}) if params is not None else list(range(len(self._params)))
        return self.access.gathered(indices, writeback=writeback, device=torch.device(device) if device else self.device)

    def gathered_active(self) -> bool:
        return self.access.gathered_active()

    def parameter_aliases(self) -> dict[str, list[str]]:
        """Tied parameters: first name -> the other names of the same tensor."""
        return tied_names(self.module)

    def save_checkpoint(
        self, directory: str, *, client_state: dict[str, Any] | None = None, drop_pending: bool = False
    ) -> str:
        """Write this rank's shard of master and Adam state, optimizer and loss-scaler
        state (call on every rank); :meth:`load_checkpoint` resumes from it bit for bit,
        ``chunkstar merge-checkpoint`` joins the shards. See :mod:`chunkstar.checkpoint`.
        Between steps only (Note [saving between steps]), on the thread that trains, and not
        after a step or load that was interrupted (Note [all or nothing]). ``client_state``
        (rank 0's) is the training loop's own state, saved and published with the shards;
        ``chunkstar.checkpoint.read_client_state(directory)`` reads it back. A save while
        gradients wait for a step is refused, unless ``drop_pending``: then it holds the state
        as of the last step, and a resume goes on without those gradients (as a loop whose
        checkpoints hold no gradients, Lightning's, resumes); they stay here for the step."""
        opt, grads = self._optimizer, self._gradients

        def check() -> None:  # in the save's first phase, so a refusal reaches every rank
            if opt is not None:
                opt.check_thread("engine.save_checkpoint()")
                opt.check_consistent("engine.save_checkpoint()")
            if not drop_pending and (grads.has_pending() or grads.has_kept()):
                raise checkpoint.pending_gradients(grads.since_step, grads.accumulation_steps)

        return checkpoint.save_checkpoint(self, directory, check=check, client_state=client_state)

    def load_checkpoint(self, directory: str) -> str:
        """Restore what :meth:`save_checkpoint` wrote into this engine and its optimizer
        (call on every rank; same model, precision, chunk size and world size). After a step
        or load that was interrupted (Note [all or nothing]) its gradients go with the rest."""
        opt = self._optimizer
        if opt is not None and opt.unfinished:
            self.drop_pending_grads()
        return checkpoint.load_checkpoint(
            self, directory, pending_grads=self._has_pending_grads() or self._gradients.has_kept(),
            check=None if opt is None else lambda: opt.check_thread("engine.load_checkpoint()"),
        )  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load fp32 values by the model's keys (a tied parameter needs one of its names).
        Any world size loads a full state dict: each rank takes its own chunks. Stopped once
        it has changed a chunk, it leaves an optimizer that refuses to go on until a load
        completes (Note [all or nothing])."""
        opt = self._optimizer
        if opt is not None:
            opt.check_thread("engine.load_state_dict()")
            if opt.unfinished:
                self.drop_pending_grads()  # an interrupted step's or load's: the values replace them
        if self._has_pending_grads() or self._gradients.has_kept():
            raise ChunkStateError("gradients are pending: call optimizer.step() or optimizer.zero_grad() before loading")
        own, values = match_values(self.module, state_dict, strict)  # checked: nothing changed yet

        def stopped(e: BaseException) -> None:
            if opt is not None:
                opt.interrupted(
                    f"engine.load_state_dict() was stopped by {type(e).__name__} after it had loaded some values and "
                    "not others",
                    "call engine.load_state_dict again and let it complete",
                    {"weights"},
                )

        write_values(self.mgr, own, values, self._slot_of_param(), on_stopped=stopped)
        if opt is not None:
            opt.restored({"weights"})

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        mgr = self.mgr
        counters = mgr.counters
        return {
            "device": str(self.device),
            "precision": self.config.precision.value,
            "device_budget_bytes": mgr.capacity,
            "device_chunk_bytes": counters.device_chunk_bytes,
            "device_chunk_bytes_peak": counters.device_chunk_bytes_peak,
            "device_peak_bytes": self.device_peak_bytes(),
            "device_first_overrun": mgr.memory.first_overrun,
            "warmup_went_over_budget": self.schedule.went_over,
            "device_pending_free_bytes": mgr.memory.pending_bytes,
            "deferred_frees": mgr.memory.frees_run,
            "deferred_frees_waited": mgr.memory.frees_settled,
            # payloads the allocator refused at first, tried again once every pending free ran
            # (Note [out of memory with frees pending] in device/memory.py)
            "device_out_of_memory_retries": mgr.memory.out_of_memory_retries,
            # threads of the host worker's ops (host Adam): the rank's share of the node's cores with
            # several processes per node (Note [the rank's share of the cores] in device/threads.py)
            "host_worker_threads": self.host_work.threads,
            "chunk_moves_to_device": counters.moves_to_device,
            "chunk_moves_to_host": counters.moves_to_host,
            "bytes_to_device": counters.bytes_to_device,
            "bytes_to_host": counters.bytes_to_host,
            "moves_by_reason": dict(counters.moves_by_reason),
            "clean_evictions": counters.clean_evictions,
            "model_data_bytes": mgr.chunks.model_data_bytes(),
            "master_and_adam_bytes": mgr.chunks.state_bytes(),
            "host_chunk_bytes_peak": counters.host_chunk_bytes_peak,  # this rank's chunk buffers on the host
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
            "all_gathers": mgr.gathers.gathers,
            "all_gathers_ahead": mgr.gathers.gathers_ahead,
            "bytes_gathered": counters.bytes_gathered,
            "heap_retention_bounded": self.heap_retention_bounded,
            "compiled_units": len(self._units),
            "compiled_calls": sum(u.compiled_calls for u in self._units),
            "n_params": sum(s.numel for s in mgr.slots),
            "n_frozen_params": sum(p.numel() for p in self._frozen_params),
            "n_chunks": mgr.layout.n_chunks,
            "chunk_size": self.chunk_size,
            "device_adam_chunks": len(self.device_adam_chunks),
            "warmup_non_model_peak_bytes": self.schedule.warmup_non_model_peak,  # the largest so far
            "minimum_budget_bytes": self.schedule.minimum_budget,  # the least device_memory_budget that held the warm-up
            "moments_per_micro_step": mgr.cursor.trace.n_moments,
            "micro_steps": self.micro_step,
            # optimizer.step() calls, and those skipped for a non-finite gradient norm (fp16 overflow,
            # or in any precision a NaN/inf loss when the norm is measured: clipping, measure_grad_norm)
            "optimizer_steps": self.optimizer.step_count if self.optimizer is not None else 0,
            "skipped_steps": self.optimizer.skipped_steps if self.optimizer is not None else 0,
            "stage": self.mgr.cursor.stage.value,
            "schedule": self.schedule.phase.value,
            "replans": self.schedule.replans,
            # forwards that found gradients waiting (a second backward before the step) and kept
            # them in the fp32 accumulators, and the bytes moved so (Note [gradients kept across a forward])
            "kept_gradient_forwards": self._gradients.kept_forwards,
            "kept_gradient_bytes": self._gradients.kept_bytes,
            # modules whose parameters the model casts in its forward, which see them so from then on
            # (Note [a model casting its parameters])
            "modules_cast_by_model": len(self._casts),
            # the host memory plan made at start (Note [host memory plan]): its bytes, its budget
            # (None: not known, or a dry run's auto), and its parts by name
            "host_memory_planned_bytes": self.host_plan.total,
            "host_memory_budget_bytes": self.host_budget,
            "host_memory_plan": dict(self.host_plan.parts),
            "params_on_disk": mgr.chunks.on_disk(ChunkList.PARAM),
            **(mgr.chunks.disk.stats() if mgr.chunks.disk is not None else {}),
            **self._activation_stats(),
        }

    def _activation_stats(self) -> dict[str, Any]:
        """What the blocks did with their saved activations (Note [activation policies]), and
        auto's plan (Note [activation plan])."""
        act = self.activations
        if act is None:
            return {"activation_policy": ActivationPolicy.KEEP.value, "activation_blocks": {}}
        it = self._iteration
        out: dict[str, Any] = {
            "activation_policy": self.config.activations.policy.value,
            "activation_blocks": act.counts(),
            "activation_blocks_checkpointed_by_model": act.model_checkpointed(),
            "activation_recomputed_calls": act.recomputed_calls,
            "activation_offloaded_calls": act.offloaded_calls,
            "activation_bytes_to_host": act.offload.bytes_to_host,
            "activation_bytes_to_device": act.offload.bytes_to_device,
            "activation_bytes_prefetched": act.offload.prefetched_bytes,
            # the last training iteration's (forward and backward): what one step moves each way
            "activation_step_bytes_to_host": it.activation_step_bytes[0],
            "activation_step_bytes_to_device": it.activation_step_bytes[1],
        }
        if act.auto:
            report = it.activation_plan
            out["activation_measuring"] = act.measuring
            out["activation_plan_fallbacks"] = it.activation_fallbacks
            if report is not None:
                out["activation_plan"] = {
                    "blocks": {b.name: p.value for b, p in zip(report.blocks, report.plan.policies)},
                    "saved_bytes": {b.name: b.saved for b in report.blocks},
                    "forward_seconds": {b.name: b.forward_s for b in report.blocks},
                    # the forward times planned on: the plan's first frozen step's, once it ran
                    # (the measuring run's include chunk loads a frozen step prefetches)
                    "timed_on_frozen_step": report.timed_on_frozen_step,
                    "predicted_step_seconds": report.plan.step_s,
                    "fits": report.plan.fits,
                    "least_room_bytes": report.plan.least_room,
                    "link_bytes_per_second": report.link,
                    # -1: the measuring run's own plan (every block offloaded, each copy waited for)
                    "predicted_chunk_bytes_to_device": report.plan.chunk_bytes_to_device,
                }
        return out

    def device_peak_bytes(self) -> int:
        """The most the device held at once for this engine: on the CPU virtual device its
        meter (chunk payload storages until they are really freed, plus the non-model bytes
        the memory probe saw at the same instant: Note [deferred free]); on CUDA the
        allocator's peak over what the device held before the engine's first chunk."""
        memory = self.mgr.memory
        if self.device.type == "cuda":
            return max(memory.peak_bytes, torch.cuda.max_memory_allocated(self.device)) - self._device_baseline
        return memory.peak_bytes

    def close(self) -> None:
        """Finish the work in flight and delete the disk tier's chunk files (if any). The
        engine is not usable afterwards; the files also go when the engine is collected."""
        self._iteration.closed = True  # Note [closed engine]
        self._unhook_optimizers()
        disk = self.mgr.chunks.disk
        if disk is not None:
            disk.finish_stepping()  # its updates go to the host worker closed next (Note [the step issued behind])
        if self.activations is not None:
            self.activations.offload.drain()  # its copies to the host run on the copy engines closed next
        self.host_work.close()
        self.mgr.copies.close()
        self.mgr.probe.release_all()
        self.mgr.memory.close()
        if self._device_thread is not None:
            self._device_thread.close()
        if disk is not None:
            disk.close()

    def remove_hooks(self) -> None:
        """Detach the engine from the model: hooks off, parameters back to their own class."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.activations is not None:
            self.activations.remove()
        if self._iteration.saved_counter is not None:
            self._iteration.saved_counter.remove()
        self.mgr.remove_guard()
