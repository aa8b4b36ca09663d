"""The engine: wraps the user's model and drives one training iteration.

It builds the chunk layout, moves every parameter into the chunk lists (the
parameter objects stay; their ``.data`` becomes a view into the param chunk's
persistent device tensor, Note [persistent device storage] in
:mod:`chunkstar.chunk.chunk`), installs the hooks, and reacts to them:

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

The orchestration lives here; moving bytes is :class:`ChunkManager`'s job and
choosing is the policies'.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch import nn

from chunkstar.chunk.layout import TensorSlot, build_layout, search_chunk_size
from chunkstar.chunk.state import TensorState
from chunkstar.config import EngineConfig, Precision
from chunkstar.device.copy_engine import HostWorker, InlineWorker, debug_delay_from_env, make_copy_engine
from chunkstar.distributed.comm import Comm
from chunkstar.distributed.grad_reduce import GroupReducer
from chunkstar.distributed.startup import agree_on_startup
from chunkstar.errors import ChunkStateError, ConfigError, DeviceMemoryError
from chunkstar.events import EventBus, MomentBegin, MomentEnd, MoveReason, Stage, StageChanged, Tier
from chunkstar.hooks.module_hooks import AfterBackward, EngineHook, install_hooks, output_tensors, substitute
from chunkstar.hooks.param_guard import guarded_class
from chunkstar.memory.host_heap import HostHeap, release_moment
from chunkstar.memory.probes import MemoryProbe, make_probe
from chunkstar.memory.tracer import TracePhase
from chunkstar.placement.optimizer import plan_device_adam
from chunkstar.runtime.chunk_manager import MASTER, PARAM, STATE_LISTS, ChunkManager
from chunkstar.runtime.param_access import ParamAccess
from chunkstar.runtime.schedule import Schedule

if TYPE_CHECKING:
    from chunkstar.optim.adam import ChunkAdam

__all__ = ["ChunkEngine"]



def _device_capacity(cfg: EngineConfig) -> int:
    """Bytes the engine plans with: the budget (cpu) or what the GPU gives this process,
    capped by the budget (cuda), less the ``device_memory_slack`` kept free."""
    if cfg.device.type == "cpu":
        assert cfg.device_memory_budget is not None
        full = cfg.device_memory_budget
    else:
        free, total = torch.cuda.mem_get_info(cfg.device)
        # what this process may use: what is free plus what torch already holds
        usable = free + torch.cuda.memory_reserved(cfg.device)
        full = min(cfg.device_memory_budget or usable, usable)
    return int(full * (1.0 - cfg.device_memory_slack))


def _check_inputs(model: nn.Module, cfg: EngineConfig, n_elements: int) -> None:
    """Refuse, before any chunk is built, what the engine cannot take: tensors on the meta
    device, and a ``default_chunk_size`` the device cannot hold or the model cannot fill."""
    for kind, tensors in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in tensors:
            if t.is_meta:
                raise ValueError(
                    f"{kind} '{name}' is on the meta device: building the model on the meta device is not "
                    "supported yet. Materialise it first (e.g. model.to_empty(device=\"cpu\"), then initialise "
                    "the weights, say with each module's reset_parameters()) and hand that model to chunkstar"
                )
    size = cfg.chunk_size
    if size is None:  # "auto" searches a size that fits the parameters
        return
    if size > n_elements:
        raise ConfigError(
            "default_chunk_size",
            f"{size} elements is more than the whole model has ({n_elements} parameter elements), so every chunk "
            f"would be mostly padding; use \"auto\" or a size <= {n_elements}",
        )
    chunk_bytes = size * cfg.precision.dtype.itemsize
    capacity = _device_capacity(cfg)
    if chunk_bytes > capacity:
        raise ConfigError(
            "default_chunk_size",
            f"one param chunk of {size} elements x {cfg.precision.dtype.itemsize} bytes ({cfg.precision.value}) is "
            f"{chunk_bytes} bytes, more than the device can hold: {capacity} bytes (device_memory_budget "
            f"{cfg.device_memory_budget} on {cfg.device}, less device_memory_slack {cfg.device_memory_slack}). "
            "Lower default_chunk_size, use \"auto\", or raise device_memory_budget",
        )


class ChunkEngine:
    def __init__(self, model: nn.Module, cfg: EngineConfig) -> None:
        self.module = model
        self.config = cfg
        self.device = cfg.device
        self.events = EventBus()
        dtype = cfg.precision.dtype

        named = list(model.named_parameters())  # unique parameters, registration order
        if not named:
            raise ValueError("the model has no parameters: there is nothing for chunkstar to manage")
        self._params: list[nn.Parameter] = [p for _, p in named]
        self._index: dict[int, int] = {id(p): i for i, p in enumerate(self._params)}
        self.comm = Comm.from_environment()
        world = self.comm.world_size
        if world > 1 and cfg.gradient_accumulation_steps > 1:
            raise ConfigError(
                "gradient_accumulation_steps",
                f"gradient accumulation is not supported yet with several processes (world size {world}); "
                "raise the per-rank batch instead",
            )
        numels = [p.numel() for p in self._params]
        chunk_size = cfg.chunk_size or search_chunk_size(numels, world_size=world)
        _check_inputs(model, cfg, sum(numels))
        layout = build_layout([n for n, _ in named], [tuple(p.shape) for p in self._params], chunk_size, world_size=world)
        self.chunk_size = chunk_size
        # every rank checks it builds the same engine, before any chunk collective (Note [start-up agreement])
        self.run_id = agree_on_startup(self.comm, cfg, layout, self._params)
        self.optimizer: ChunkAdam | None = None  # the ChunkAdam over this engine attaches itself; checkpoints carry it
        self.mgr = ChunkManager(
            layout, dtype, cfg.device, _device_capacity(cfg), cfg.eviction_policy, make_probe(cfg.device), self.events,
            self.comm, make_copy_engine(cfg.device, cfg.overlap, cfg.device_link_bandwidth),
        )  # fmt: skip
        # Chunk by chunk: copy the parameters in, then point them at their views, which
        # frees the model's own (fp32) storage as we go, so host memory peaks at about
        # one chunk above the chunks' own bytes, not at model + chunks.
        with torch.no_grad():
            for s, p in zip(layout.slots, self._params):
                if not p.is_floating_point():
                    raise TypeError(f"parameter '{s.name}' has dtype {p.dtype}; chunkstar manages floating-point parameters")
            for cid in range(layout.n_chunks):
                self.mgr.allocate_on_host(cid)
                slots = self.mgr.slots_of(cid)
                for s in slots:
                    self.mgr.set_state(s.index, TensorState.HOLD)
                    if self.mgr.own(cid):  # other ranks keep the rest; all built the same model from one seed
                        src = self._params[s.index].detach().reshape(-1)
                        self.mgr.chunks[MASTER][cid].payload[s.offset : s.end].copy_(src)
                        self.mgr.chunks[PARAM][cid].payload[s.offset : s.end].copy_(src)
                views = self.mgr.chunks[PARAM][cid].device_views([(s.offset, s.end, s.shape) for s in slots])
                for s, view in zip(slots, views):
                    self._params[s.index].data = view
        for mod in model.modules():
            for name, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[name] = b.to(cfg.device)

        self.scaler_enabled = cfg.precision is Precision.FP16
        from chunkstar.optim.loss_scaler import LossScaler  # local: optim depends on runtime

        self.scaler = LossScaler(cfg.loss_scale, self.scaler_enabled)
        self.device_adam_chunks: set[int] = set()
        self.micro_step = 0
        self._since_step = 0  # micro-steps since the last optimizer step
        self._accumulators: dict[int, torch.Tensor] = {}  # chunk id -> 1-D fp32 host, grads of earlier micro-batches
        self._accumulated: set[int] = set()  # slot indices with something in an accumulator
        self._boundary = False  # the running backward is the last micro-batch before a step
        self.reducer = GroupReducer(self.mgr, self.comm, self.device, self._params)  # several processes only
        # host-side work (the optimizer's updates, gradient norms) off the compute thread
        # with overlap; in the calling thread on the serial reference path
        self.host_work: HostWorker | InlineWorker = HostWorker(debug_delay_from_env()) if cfg.overlap else InlineWorker()
        self.prefetch_window = cfg.prefetch_window or 4 * max(c.nbytes for c in self.mgr.chunks[PARAM])

        # the iteration and its schedule (Note [iteration] in runtime/schedule.py)
        self.schedule = Schedule(self.mgr, self.comm, self.device, on_freeze=self._plan_adam)
        # CPU virtual device: the heap's free pages go back to the system right before each
        # iteration's non-model peak (Note [host heap] in memory/host_heap.py)
        self.host_heap: HostHeap | None = HostHeap() if cfg.device.type == "cpu" else None
        self._release_at: int | None = None  # this iteration's traced peak moment (None: no trace)
        self._release_each_moment = False  # no trace yet in warm-up: release at every forward moment
        self._heap_released = False  # the heap was released in this iteration
        self._heap_skip = False  # this iteration leaves the heap alone (under pressure)
        self._moves_at_iteration = 0  # param chunk loads (access, prefetch) when the iteration began
        self._frozen_before = False  # the iteration before ran on the frozen schedule
        self._iter_open = False  # a training forward began and its backward has not ended
        self._untraced_depth = 0  # evaluation forwards running (not on the schedule)
        self._implicit = False  # a module was called directly (not through the engine) at IDLE
        self._saved_moment = -1
        self._bytes_before_step = 0

        # modules, their access sets and the running ones (Note [parameter guard])
        self._modules, self._handles = install_hooks(model, self._index, self)
        self._access_sets: list[tuple[int, ...]] = [m.own for m in self._modules]
        self._stack: list[tuple[int, int]] = []  # (module key, moment of its pre-forward), innermost last
        self._views = [p.data for p in self._params]  # each parameter's view into its param chunk's device tensor
        self.access = ParamAccess(self)
        self.mgr.slack = cfg.device_memory_slack
        guarded: dict[type, type] = {}  # one guarded class per parameter class (Note [parameter guard])
        for p in self._params:
            if type(p) not in guarded:
                guarded[type(p)] = guarded_class(type(p), self.access)
        self.mgr.install_guard(self._params, [guarded[type(p)] for p in self._params])
        # module.state_dict() serves the fp32 masters (runtime/param_access.py); the root's hooks
        # span a whole call, so tied names get one tensor
        for mod in [m for m in model.modules() if m is model or any(True for _ in m.parameters(recurse=False))]:
            self._handles.append(mod.register_state_dict_pre_hook(EngineHook(lambda *_: self.access.begin_state_dict())))
            self._handles.append(mod.register_state_dict_post_hook(EngineHook(lambda *_: self.access.end_state_dict())))

    # ------------------------------------------------------------------ model API
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model. With autograd on this is (part of) a training iteration;
        under ``torch.no_grad()`` an evaluation forward that the schedule ignores."""
        if self.access.gathered_active():
            raise ChunkStateError("the model cannot run inside engine.gathered_parameters(): leave the block first")
        training = torch.is_grad_enabled()
        if training:
            self._begin_iteration(args, kwargs)
        else:
            self._begin_untraced()
        self._set_stage(Stage.FWD)
        try:
            with self._autocast():
                out = self.module(*args, **kwargs)
        except BaseException:
            if training:
                self._abort_iteration()
            else:
                self._end_untraced()
            raise
        if not training:
            self._end_untraced()
        return out

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.precision is Precision.FP32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.config.precision.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` (divided by gradient_accumulation_steps, times the fp16 loss scale)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"engine.backward expects a scalar loss tensor, got {type(loss).__name__}")
        if not loss.requires_grad:
            raise ValueError("the loss does not require grad: was the forward run under torch.no_grad()?")
        gas = self.config.gradient_accumulation_steps
        self._boundary = self._since_step + 1 >= gas
        if gas > 1:
            loss = loss / gas
        if self.scaler_enabled:
            loss = loss * self.scaler.scale
        if self._heap_skip:
            pass  # under pressure (Note [host heap])
        elif self._release_at is None or not self._heap_released and self._release_at <= self.mgr.moment:
            self._release_heap()  # no trace (or its peak moment was not reached): the turn stands in for the peak
        self._set_stage(Stage.BWD)
        try:
            loss.backward()
        except BaseException:
            self._abort_iteration()
            raise
        self._end_backward()

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

    def index_of(self, p: torch.Tensor) -> int:
        try:
            return self._index[id(p)]
        except KeyError:
            raise ValueError("this tensor is not a parameter of the engine's model") from None

    # ------------------------------------------------------------------ the iteration
    def _begin_iteration(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._iter_open:
            return  # another forward of the same iteration
        self._iter_open = True
        self.access.reset()
        self._stack.clear()
        mgr = self.mgr
        mgr.moment = -1
        self.schedule.begin_iteration(sum(t.nbytes for t in output_tensors((args, kwargs))))
        # where the peak is: in the latest trace (frozen, or the warm-up's earlier passes), or unknown
        self._heap_released = False
        heap = self.host_heap is not None
        # under pressure (the last frozen iteration moved chunks) the heap is left alone
        frozen = self.schedule.phase is TracePhase.FROZEN
        loads = mgr.moves_by_reason[MoveReason.ACCESS.value] + mgr.moves_by_reason[MoveReason.PREFETCH.value]
        # (the warm-up's safe mode moves chunks at every moment: only a frozen iteration tells)
        self._heap_skip = heap and frozen and self._frozen_before and loads > self._moves_at_iteration
        self._moves_at_iteration = loads
        self._frozen_before = frozen
        traced = heap and mgr.trace.passes > 0 and not self._heap_skip
        self._release_at = release_moment([r.non_model_peak for r in mgr.trace.records]) if traced else None
        self._release_each_moment = heap and self.schedule.phase is TracePhase.WARMUP

    def _release_heap(self) -> None:
        """Before the iteration's peak (Note [host heap] in memory/host_heap.py)."""
        if self.host_heap is not None:
            self.host_heap.release()
            self._heap_released = True

    def _begin_untraced(self) -> None:
        """An evaluation forward: its moments are not the schedule's."""
        self._untraced_depth += 1
        if self._untraced_depth == 1:
            self._saved_moment = self.mgr.moment
            self.mgr.on_schedule = False

    def _end_untraced(self) -> None:
        self._untraced_depth -= 1
        if self._untraced_depth == 0:
            self.mgr.on_schedule = True
            self.mgr.moment = self._saved_moment
            if not self._iter_open:
                self._set_stage(Stage.IDLE)

    def in_model_pass(self) -> bool:
        """Whether a forward or backward of the model is running (guarded reads then take part in it)."""
        return self.mgr.stage is Stage.FWD or self.mgr.stage is Stage.BWD

    # ------------------------------------------------------------------ moments
    def _begin_moment(self, module: str, chunk_ids: tuple[int, ...]) -> None:
        mgr = self.mgr
        mgr.moment += 1
        mgr.module = module
        if mgr.on_schedule:
            self.schedule.on_moment(module, mgr.stage.value, chunk_ids)
            if mgr.moment == self._release_at or self._release_each_moment and mgr.stage is Stage.FWD:
                self._release_heap()
        if self.events.active:
            self.events.emit(MomentBegin(mgr.moment, module, mgr.stage, time.perf_counter_ns()))

    def _access(self, module: str, indices: tuple[int, ...]) -> None:
        mgr = self.mgr
        chunk_ids = tuple(sorted({mgr.slots[i].chunk_id for i in indices}))
        self._begin_moment(module, chunk_ids)
        with mgr.probe.paused():
            mgr.make_resident(
                [(PARAM, c) for c in chunk_ids], MoveReason.ACCESS, where=f"module '{module}'", gather_groups=True
            )
            for i in indices:
                mgr.set_state(i, TensorState.COMPUTE)
            if self._prefetching():
                mgr.prefetch(self.prefetch_window)
            mgr.memory_sample()

    def _prefetching(self) -> bool:
        mgr = self.mgr
        return self.config.prefetch and mgr.trace.frozen and mgr.on_schedule and not mgr.safe_mode

    # ------------------------------------------------------------------ hook targets
    def on_pre_forward(self, module_key: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
        if self.mgr.stage is Stage.IDLE:
            self._begin_implicit()
        mod = self._modules[module_key]
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
        release = list(indices) if repeated else [i for i in indices if not self._params[i].requires_grad] if grad else []
        self._access(mod.label, indices)
        self._stack.append((module_key, self.mgr.moment))
        if release:
            inputs = [t for t in output_tensors((args, kwargs)) if t.requires_grad]
            if inputs:
                aliases = AfterBackward.apply(lambda: self.release_after_backward(release), *inputs)
                subs = {id(t): a for t, a in zip(inputs, aliases)}
                return substitute(args, subs), substitute(kwargs, subs)
        return None

    def _begin_implicit(self) -> None:
        """A module of the model was called directly, not through the engine."""
        if self.access.gathered_active():
            raise ChunkStateError("the model cannot run inside engine.gathered_parameters(): leave the block first")
        self._implicit = True
        if torch.is_grad_enabled():
            self._begin_iteration((), {})
        else:
            self._begin_untraced()
        self._set_stage(Stage.FWD)

    def begin_iteration_from_read(self) -> None:
        """A parameter read with autograd on between steps opens the next iteration."""
        self._begin_iteration((), {})
        self._set_stage(Stage.FWD)

    def on_post_forward(self, module_key: int, output: Any) -> None:
        mgr = self.mgr
        mod = self._modules[module_key]
        indices = self._access_sets[module_key]
        grad = torch.is_grad_enabled()
        after = TensorState.HOLD_AFTER_FWD if grad else TensorState.HOLD
        for i in indices:
            if mgr.states[i] is TensorState.COMPUTE:
                mgr.set_state(i, after)
        began = mgr.moment
        for pos in range(len(self._stack) - 1, -1, -1):
            if self._stack[pos][0] == module_key:
                began = self._stack.pop(pos)[1]
                break
        outs = list(output_tensors(output))
        if mgr.on_schedule and mgr.stage is Stage.FWD:
            self.schedule.on_module_output(began, mod.label, sum(t.nbytes for t in outs))
        if self.comm.distributed and mgr.stage is not Stage.BWD:
            self.reducer.release_after_forward(indices)
        if self.events.active:
            self.events.emit(MomentEnd(mgr.moment, mod.label, mgr.stage, time.perf_counter_ns()))
            mgr.memory_sample()  # the module's activations now exist
        if grad:
            needing = [t for t in outs if t.requires_grad]
            if needing:
                torch.autograd.graph.register_multi_grad_hook(
                    needing, lambda _grads, label=mod.label, indices=indices: self._access(label, indices), mode="any"
                )
        if self._implicit and not self._stack:
            self._implicit = False
            if not grad:
                self._end_untraced()

    def running_module(self) -> int | None:
        """Key of the innermost module whose forward is running, if any."""
        return self._stack[-1][0] if self._stack else None

    def attach_to_running_module(self, indices: list[int], what: str) -> None:
        """A running module reads parameters it does not own: they join its access set
        for good (its post-forward releases them, its pre-backward brings them back, its
        next pre-forward brings them along) and are made resident now."""
        mgr = self.mgr
        key, began = self._stack[-1]
        label = self._modules[key].label
        self._access_sets[key] = tuple(sorted(set(self._access_sets[key]) | set(indices)))
        chunk_ids = tuple(sorted({mgr.slots[i].chunk_id for i in indices}))
        if mgr.on_schedule:
            self.schedule.on_more_chunks(began, chunk_ids, f"'{label}' read {what}")
        with mgr.probe.paused():
            mgr.make_resident(
                [(PARAM, c) for c in chunk_ids], MoveReason.ACCESS, where=f"{what} read in '{label}'", gather_groups=True
            )
            for i in indices:
                mgr.set_state(i, TensorState.COMPUTE)

    def access_outside_modules(self, label: str, indices: list[int], backward: bool = False) -> None:
        """Parameters read by code outside any module (a moment of their own)."""
        if backward and self.mgr.stage is not Stage.BWD:
            return
        self._access(label, tuple(indices))

    def release_outside_modules(self, indices: list[int], prior: dict[int, TensorState], building_graph: bool) -> None:
        for i in indices:
            if self.mgr.states[i] is TensorState.COMPUTE:
                back = TensorState.HOLD_AFTER_FWD if building_graph else prior[i]
                self.mgr.set_state(i, TensorState.HOLD if back is TensorState.COMPUTE else back)
        if self.comm.distributed and self.mgr.stage is not Stage.BWD:
            self.reducer.release_after_forward(tuple(indices))

    def release_after_backward(self, indices: list[int]) -> None:
        """The backward of an op outside modules is over: its parameters may move again."""
        for i in indices:
            if self.mgr.states[i] is TensorState.COMPUTE:
                self.mgr.set_state(i, TensorState.HOLD_AFTER_FWD)

    def param_index(self, p: torch.Tensor) -> int | None:
        return self._index.get(id(p))

    def parameter(self, index: int) -> nn.Parameter:
        return self._params[index]

    def param_view(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s view into its param chunk's persistent device tensor."""
        return self._views[index]

    def on_grad(self, index: int, param: torch.Tensor) -> None:
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        mgr = self.mgr
        s = mgr.slots[index]
        with torch.no_grad(), mgr.probe.paused():
            if not mgr.resident((PARAM, s.chunk_id)):  # e.g. a parameter whose backward needed no data
                mgr.make_resident(
                    [(PARAM, s.chunk_id)], MoveReason.ACCESS, where=f"the gradient of '{s.name}'", gather_groups=True
                )
            # through the chunk, not the parameter: payload waits for a prefetch copy still in flight
            slot = mgr.chunks[PARAM][s.chunk_id].payload[s.offset : s.end]
            if self._boundary:
                acc = self._accumulators.get(s.chunk_id)
                if index in self._accumulated and acc is not None:
                    slot.copy_(acc[s.offset : s.end].to(slot.device) + grad.float().reshape(-1))
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
                    acc = self._accumulators[s.chunk_id] = torch.zeros(mgr.layout.chunk_sizes[s.chunk_id], dtype=torch.float32)
                acc[s.offset : s.end].add_(grad.reshape(-1).float().to("cpu"))
                self._accumulated.add(index)
                if mgr.states[index] is TensorState.COMPUTE:
                    mgr.set_state(index, TensorState.HOLD_AFTER_FWD)

    @property
    def _offload_early(self) -> bool:
        """Whether a chunk's gradients go to the optimizer as soon as they are complete
        (Note [gradient pipeline]): one process, the last micro-batch before a step with no
        earlier micro-batches' gradients waiting, on the frozen schedule."""
        mgr = self.mgr
        return (
            self.optimizer is not None and self._boundary and not self._accumulated
            and mgr.trace.frozen and mgr.on_schedule and not mgr.safe_mode
        )  # fmt: skip

    def _grads_complete(self, chunk_id: int) -> None:
        """Note [gradient pipeline]: every tensor of the chunk is done with this backward
        (its gradient folded, or unused). Unless the schedule uses the chunk again in this
        backward, the optimizer takes it now: its copy to the host (where host Adam runs)
        and its gradient norm overlap the rest of the backward instead of starting after it."""
        mgr = self.mgr
        nu = mgr.trace.next_use(chunk_id, mgr.moment)
        if nu is not None and mgr.moment + nu < mgr.trace.n_moments:
            return  # read again later in this backward
        assert self.optimizer is not None
        self.optimizer.take_gradients(chunk_id)

    # ------------------------------------------------------------------ iteration bookkeeping
    def _set_stage(self, stage: Stage) -> None:
        if self.mgr.stage is not stage:
            self.mgr.stage = stage
            if self.events.active:
                self.events.emit(StageChanged(stage, time.perf_counter_ns()))

    def _end_backward(self) -> None:
        mgr = self.mgr
        if self.comm.distributed:
            self.reducer.end_backward()
        # only the slots either branch below acts on: those in COMPUTE or HOLD_AFTER_FWD (the
        # manager finds them chunk by chunk) and, at a boundary, those with an accumulator
        todo = sorted(self._accumulated.union(mgr.slots_in_use()) if self._boundary else mgr.slots_in_use())
        with torch.no_grad(), mgr.probe.paused():
            for s in (mgr.slots[i] for i in todo):
                st = mgr.states[s.index]
                if self._boundary and s.index in self._accumulated and st is not TensorState.HOLD_AFTER_BWD:
                    # got gradients in earlier micro-batches only: its gradient is the accumulator
                    mgr.set_state(s.index, TensorState.HOLD)
                    acc = self._accumulators[s.chunk_id]
                    mgr.chunks[PARAM][s.chunk_id].payload[s.offset : s.end].copy_(acc[s.offset : s.end])
                    mgr.set_state(s.index, TensorState.HOLD_AFTER_BWD)
                elif st is TensorState.COMPUTE or st is TensorState.HOLD_AFTER_FWD:
                    mgr.set_state(s.index, TensorState.HOLD)
        if self._boundary:
            self._accumulators.clear()
            self._accumulated.clear()
        if self.comm.distributed:
            self.reducer.release_all()
        self._end_iteration()
        self.micro_step += 1
        self._since_step += 1
        self._set_stage(Stage.IDLE)

    def _end_iteration(self) -> None:
        self._iter_open = False
        self._implicit = False
        self._stack.clear()
        try:
            self.schedule.end_iteration()
        except DeviceMemoryError:
            # the warm-up found a moment that does not fit: drop this iteration's gradients and
            # trace, so the engine can go on with a smaller batch (or be rebuilt with a bigger budget)
            self._abort_iteration()
            raise

    def _abort_iteration(self) -> None:
        """Leave the engine usable after an exception inside forward or backward
        (say a DeviceMemoryError the user answers with a smaller batch): stop the
        warm-up probe so no dispatch mode outlives the failure, drop the partial
        trace so the next iteration warms up again, and put every tensor back in
        HOLD with its value (gradients of the failed iteration are dropped)."""
        mgr = self.mgr
        self.schedule.abort()
        self._iter_open = False
        self._implicit = False
        self._stack.clear()
        self._untraced_depth = 0
        mgr.on_schedule = True
        self.access.reset()
        if self.comm.distributed:
            self.reducer.reset()
        with torch.no_grad():
            self.drop_pending_grads()
            for s in mgr.slots:
                if mgr.states[s.index] in (TensorState.COMPUTE, TensorState.HOLD_AFTER_FWD):
                    mgr.set_state(s.index, TensorState.HOLD)
        self._set_stage(Stage.IDLE)

    def _plan_adam(self) -> None:
        if not self.config.hybrid_adam:
            return
        mgr = self.mgr
        n = mgr.layout.n_chunks
        state_bytes = [sum(mgr.chunks[name][i].nbytes for name in STATE_LISTS) for i in range(n)]
        self.device_adam_chunks = plan_device_adam(
            [mgr.chunks[PARAM][i].nbytes for i in range(n)], state_bytes, mgr.capacity, mgr.trace.max_non_model
        )

    def begin_optimizer_step(self) -> None:
        gas = self.config.gradient_accumulation_steps
        if self._since_step % gas != 0 or self._since_step == 0 and self._has_pending_grads():
            raise ChunkStateError(
                f"optimizer.step() after {self._since_step} micro-batch(es) but gradient_accumulation_steps is {gas}: "
                f"call engine.backward() {gas} times per optimizer step"
            )
        self._set_stage(Stage.OPTIM)
        self.mgr.moment = -1
        self.mgr.module = "optimizer"
        self._bytes_before_step = self.mgr.bytes_to_device + self.mgr.bytes_to_host
        if self.host_heap is not None and any(not self.mgr.resident((MASTER, c)) for c in self.device_adam_chunks):
            self._release_heap()  # the state is about to move to the device: start from a trimmed heap

    def end_optimizer_step(self) -> None:
        self._since_step = 0
        moved = self.mgr.bytes_to_device + self.mgr.bytes_to_host - self._bytes_before_step
        if self.host_heap is not None and moved > self.mgr.state_bytes() // 4:
            # the placement of the optimizer state changed (the first step after warm-up moves it
            # to the device when it fits): the host buffers it left are free heap pages now
            self._release_heap()
        if self._prefetching():
            # the next forward's first chunks travel while the updates of later chunks run
            self.mgr.prefetch(self.prefetch_window, now=-1)
        self.mgr.memory_sample()
        self.mgr.module = ""
        self._set_stage(Stage.IDLE)

    def _has_pending_grads(self) -> bool:
        return any(st is TensorState.HOLD_AFTER_BWD for st in self.mgr.states)

    def restore_params_from_master(self, slots_by_chunk: dict[int, list[TensorSlot]]) -> None:
        mgr = self.mgr
        with torch.no_grad():
            for cid, slots in slots_by_chunk.items():
                if not mgr.own(cid):
                    # another rank's chunk (a gradient not reduced yet): its owner keeps the value;
                    # this rank's gathered copy is dropped with the group
                    for s in slots:
                        mgr.set_state(s.index, TensorState.HOLD)
                    continue
                p = mgr.chunks[PARAM][cid].payload
                master = mgr.chunks[MASTER][cid].payload.to(p.device)
                for s in slots:
                    p[s.offset : s.end].copy_(master[s.offset : s.end])
                    mgr.set_state(s.index, TensorState.HOLD)

    def drop_pending_grads(self) -> None:
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
        self._since_step = 0

    # ------------------------------------------------------------------ state
    def _slot_of_param(self) -> dict[int, TensorSlot]:
        return {id(p): self.mgr.slots[i] for i, p in enumerate(self._params)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's own keys; parameters as their fp32 masters, everything on the CPU.

        The same as ``engine.module.state_dict()`` with buffers copied to the CPU.
        With several processes this is a collective (every rank must call it): the
        masters, each kept by its owner only, are all-gathered group by group."""
        return {k: v.detach().to("cpu", copy=True) if v.device.type != "cpu" else v for k, v in self.module.state_dict().items()}

    def full_masters(self) -> dict[int, torch.Tensor]:
        """Every master chunk by id (gathered from their owners with several processes: a collective)."""
        mgr = self.mgr
        if not self.comm.distributed:
            return {c.chunk_id: c.payload for c in mgr.chunks[MASTER]}
        where = self.comm.exchange_device(self.device)
        out: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for g in range(0, mgr.layout.n_chunks, self.comm.world_size):
                group = list(mgr.layout.group(g))
                own = mgr.chunks[MASTER][group[self.comm.rank]].payload.to(where)
                outs = [torch.empty_like(own) for _ in group]
                self.comm.all_gather_group(outs, own, what=f"master chunks {group[0]}..{group[-1]}")
                for k, t in zip(group, outs):
                    out[k] = t.to("cpu")
        return out

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
        if self.mgr.stage is not Stage.IDLE:
            raise ChunkStateError(
                f"gathered_parameters() is for use between steps, but the engine is in its {self.mgr.stage.value} stage"
            )
        if self._iter_open:
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
        first: dict[int, str] = {}
        out: dict[str, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) in first:
                out.setdefault(first[id(p)], []).append(name)
            else:
                first[id(p)] = name
        return out

    def save_checkpoint(self, directory: str) -> str:
        """Write this rank's shard of master and Adam state, optimizer and loss-scaler
        state (call on every rank); :meth:`load_checkpoint` resumes from it bit for bit,
        ``chunkstar merge-checkpoint`` joins the shards. See :mod:`chunkstar.checkpoint`."""
        from chunkstar.checkpoint import save_checkpoint

        return save_checkpoint(self, directory)

    def load_checkpoint(self, directory: str) -> str:
        """Restore what :meth:`save_checkpoint` wrote into this engine and its optimizer
        (call on every rank; same model, precision, chunk size and world size)."""
        from chunkstar.checkpoint import load_checkpoint

        return load_checkpoint(self, directory, pending_grads=self._has_pending_grads())

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load fp32 values by the model's keys (a tied parameter needs one of its names).
        Any world size loads a full state dict: each rank takes its own chunks."""
        if self._has_pending_grads():
            raise ChunkStateError("gradients are pending: call optimizer.step() or optimizer.zero_grad() before loading")
        slots = self._slot_of_param()
        own = self.module.state_dict(keep_vars=True)
        state_dict = dict(state_dict)
        for name, others in self.parameter_aliases().items():  # fill tied names from whichever is given
            for n in [name, *others]:
                if n in state_dict:
                    for m in [name, *others]:
                        state_dict.setdefault(m, state_dict[n])
                    break
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise KeyError(f"state dict mismatch: missing keys {missing}, unexpected keys {unexpected}")
        mgr = self.mgr
        with torch.no_grad(), mgr.probe.paused():
            for key, t in own.items():
                if key not in state_dict:
                    continue
                src = state_dict[key]
                if tuple(src.shape) != tuple(t.shape):
                    raise ValueError(f"'{key}': shape {tuple(src.shape)} in the state dict, {tuple(t.shape)} in the model")
                s = slots.get(id(t))
                if s is None:
                    t.data.copy_(src)
                    continue
                if not mgr.own(s.chunk_id):
                    continue  # its owner loads it (any world size can load a full state dict)
                mgr.chunks[MASTER][s.chunk_id].payload[s.offset : s.end].copy_(src.reshape(-1))
                mgr.chunks[PARAM][s.chunk_id].payload[s.offset : s.end].copy_(src.reshape(-1))

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        mgr = self.mgr
        return {
            "device": str(self.device),
            "precision": self.config.precision.value,
            "device_budget_bytes": mgr.capacity,
            "device_chunk_bytes": mgr.device_chunk_bytes,
            "device_chunk_bytes_peak": mgr.device_chunk_bytes_peak,
            "chunk_moves_to_device": mgr.moves_to_device,
            "chunk_moves_to_host": mgr.moves_to_host,
            "bytes_to_device": mgr.bytes_to_device,
            "bytes_to_host": mgr.bytes_to_host,
            "moves_by_reason": dict(mgr.moves_by_reason),
            "clean_evictions": mgr.clean_evictions,
            "model_data_bytes": mgr.model_data_bytes(),
            "master_and_adam_bytes": mgr.state_bytes(),
            "world_size": self.comm.world_size,
            "rank": self.comm.rank,
            "all_gathers": mgr.gathers,
            "bytes_gathered": mgr.bytes_gathered,
            "n_params": sum(s.numel for s in mgr.slots),
            "n_chunks": mgr.layout.n_chunks,
            "chunk_size": self.chunk_size,
            "device_adam_chunks": len(self.device_adam_chunks),
            "warmup_non_model_peak_bytes": mgr.trace.max_non_model,
            "moments_per_micro_step": mgr.trace.n_moments,
            "micro_steps": self.micro_step,
            "stage": self.mgr.stage.value,
            "schedule": self.schedule.phase.value,
            "replans": self.schedule.replans,
        }

    def remove_hooks(self) -> None:
        """Detach the engine from the model: hooks off, parameters back to their own class."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.mgr.remove_guard()
