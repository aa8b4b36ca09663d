"""What an access to a guarded parameter does (Note [parameter guard] in
:mod:`chunkstar.hooks.param_guard` says how it is caught).

Three cases, decided from the engine's stage and the op:

* **a read during forward or backward** (``nn.MultiheadAttention`` reading
  ``out_proj.weight``, a parent's ``F.linear(x, self.shared.weight)``, an L2
  term in the loss): the parameter is made resident and put in COMPUTE, as a
  module access would. Inside a running module it joins that module's access
  set for good, so the module's next pre-forward and its pre-backward bring it
  along (the warm-up trace records it in the module's moment; after the
  freeze an unforeseen read is a change of schedule). Outside any module it is
  a moment of its own, and a hook on the op's outputs brings it back before
  the op's backward; an output that aliases the parameter keeps it in COMPUTE
  until its gradient is folded.
* **a write** (``p.copy_(x)``, ``p.mul_(s)``, ``nn.init.normal_(p)``,
  ``model.load_state_dict(sd)``): the op runs on the fp32 master slot and the
  param chunk's slot is refreshed from it, so the write survives the next
  optimizer step exactly as it would in plain PyTorch. With several processes
  each rank writes the chunks it owns (every rank runs the same code).
* **a read between steps** (``print(p)``, ``p.norm()``, an EMA, ``p.detach().clone()``):
  the op runs on the current value, read where it lies (the device view, the
  host payload, or the fp32 master while the slot holds a gradient), without
  moving any chunk. A result that would alias chunk memory (``p.data``,
  ``p.detach()``, a view) comes back as a :class:`ReadOnlySnapshot`: a copy
  that refuses writes, since a write to it could never reach the parameter.

``engine.module.state_dict()`` is served from the fp32 masters
(:meth:`ParamAccess.state_dict_value`), so ``torch.save(model.state_dict())``
and Hugging Face ``save_pretrained`` write the real values under the model's
own keys; tied parameters come back as one tensor, as in plain PyTorch.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch import nn

from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.state import ChunkLocation, TensorState
from chunkstar.distributed.comm import Comm
from chunkstar.errors import ChunkStateError, DeviceMemoryError
from chunkstar.events import Stage
from chunkstar.hooks.module_hooks import AfterBackward, output_tensors, substitute
from chunkstar.hooks.param_guard import (
    ReadOnlyGradient, ReadOnlySnapshot, mutated_tensors, op_name, plain, plain_data, snapshot, tensor_args,
)  # fmt: skip
from chunkstar.runtime.chunk_manager import ChunkManager
from chunkstar.runtime.reads import ReadState

__all__ = ["ParamAccess", "GATHER_HINT"]

GATHER_HINT = (
    "use `with engine.gathered_parameters([...]):` (every rank must enter it) to read or change them. A wrapper that "
    "syncs parameters across ranks as it is built (DistributedDataParallel, and so Accelerate's prepare(model)) reads "
    "them all: leave the engine's model unwrapped, the engine reduces gradients across ranks itself"
)
_READABLE = (TensorState.HOLD, TensorState.HOLD_AFTER_FWD)
# ops whose result never carries a gradient to the parameter: reads between steps, even with autograd on
_NOT_DIFFERENTIABLE = frozenset(
    {
        "detach", "data", "__repr__", "__str__", "__format__", "tolist", "item", "numpy", "__bool__", "__int__",
        "__float__", "__index__", "__array__", "__reduce_ex__", "__deepcopy__", "eq", "ne", "lt", "le", "gt", "ge",
        "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "argmax", "argmin", "isfinite", "isnan", "isinf",
        "equal", "allclose", "isclose", "count_nonzero", "nonzero", "sign", "any", "all",
    }
)  # fmt: skip


class AccessHost(Protocol):
    """What parameter access needs of the engine: its chunks, its parameters by slot index,
    and the fp32 values of every chunk (several processes)."""

    mgr: ChunkManager
    comm: Comm

    @property
    def device(self) -> torch.device: ...
    def index_of(self, p: torch.Tensor) -> int: ...
    def param_index(self, p: torch.Tensor) -> int | None: ...
    def parameter(self, index: int) -> nn.Parameter: ...
    def param_view(self, index: int) -> torch.Tensor: ...
    def full_masters(self) -> dict[int, torch.Tensor]: ...
    def gradient_kept(self, index: int) -> torch.Tensor | None: ...
    def drop_gradients(self, indices: list[int]) -> None: ...
    def zero_gradient(self, index: int) -> None: ...
    def see_in_dtype(self, index: int, dtype: torch.dtype) -> None: ...
    def check_thread(self, doing: str) -> None: ...


class ReadTargets(Protocol):
    """What a read inside a model pass needs of the hook targets (runtime/hook_targets.py)."""

    def running_module(self) -> int | None: ...
    def attach_to_running_module(self, indices: list[int], what: str) -> None: ...
    def access_outside_modules(self, label: str, indices: list[int], backward: bool = False) -> None: ...
    def release_outside_modules(self, indices: list[int], prior: dict[int, TensorState], building_graph: bool) -> None: ...
    def release_after_backward(self, indices: list[int]) -> None: ...
    def check_writes(self, indices: Sequence[int], depth: int) -> bool: ...


class ReadIteration(Protocol):
    """What a read needs of the iteration (runtime/iteration.py): whether a model pass runs,
    and to open one from a read between steps."""

    def in_model_pass(self) -> bool: ...
    def begin_from_read(self) -> None: ...


class ParamAccess:
    """The engine's handler for guarded parameter accesses (one per engine)."""

    def __init__(self, engine: AccessHost, targets: ReadTargets, iteration: ReadIteration, reads: ReadState) -> None:
        """``targets`` and ``iteration``: the parts a read during a model pass goes through,
        built before this one; ``reads``: what reads leave behind (aliases, loose holds, the
        gathered block, a state_dict()'s memo), which they settle too (runtime/reads.py)."""
        self.engine = engine
        self.mgr = engine.mgr
        self._targets = targets
        self._iteration = iteration
        self._reads = reads

    # ------------------------------------------------------------------ dispatch
    def param_index(self, p: torch.Tensor) -> int | None:
        return self.engine.param_index(p)

    def grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p.grad``: a read-only copy of the gradient while it sits in the slot (this
        rank's chunks) or waits in an accumulator (earlier micro-batches, or kept by a forward:
        Note [gradients kept across a forward]), else what autograd left there (None once
        folded). ``module.zero_grad()`` looks here first, so a kept gradient is not None."""
        i = self.engine.param_index(p)
        if i is not None:
            s = self.mgr.slots[i]
            value: torch.Tensor | None = None
            if self.mgr.states[i] is TensorState.HOLD_AFTER_BWD and self.mgr.chunks.own(s.chunk_id):
                with self.mgr.chunks.staged([(ChunkList.PARAM, s.chunk_id)], write=False):  # from its file, if there
                    value = self.mgr.chunks.slot_view(ChunkList.PARAM, s).detach().clone()
            elif self.mgr.states[i] is not TensorState.COMPUTE:
                value = self.engine.gradient_kept(i)
            if value is not None:
                value = value.to(device=self.engine.device, dtype=p.dtype).view(s.shape)
                return snapshot(value, ReadOnlyGradient, f"parameter '{s.name}'", write=lambda *_, i=i: self.engine.zero_gradient(i))
        with torch._C.DisableTorchFunctionSubclass():
            return p.grad

    def set_grad(self, p: torch.Tensor, value: Any) -> None:
        """``p.grad = value``: ``None`` (``module.zero_grad()``, any module's) drops the
        parameter's gradient wherever the engine keeps it, as PyTorch's does; a tensor is
        autograd's business (a backward adds to it) unless a gradient sits in the slot, which
        is then replaced."""
        i = self.engine.param_index(p)
        if i is not None:
            if value is None:
                self.engine.drop_gradients([i])
            elif self.mgr.states[i] is TensorState.HOLD_AFTER_BWD:
                s = self.mgr.slots[i]
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != s.shape:
                    raise ChunkStateError(f"parameter '{s.name}': .grad must be a tensor of shape {s.shape}")
                self.engine.zero_gradient(i)
                with torch.no_grad(), self.mgr.chunks.staged([(ChunkList.PARAM, s.chunk_id)], write=True):
                    self.mgr.chunks.slot_view(ChunkList.PARAM, s).copy_(value.detach().reshape(-1))
                return
        with torch._C.DisableTorchFunctionSubclass():
            p.grad = value

    def data_of(self, p: torch.Tensor) -> torch.Tensor:
        """``p.data`` of a parameter in COMPUTE (its watched class, Note [data aliases]): the
        real alias of its slot, noted for the running module's end during a forward."""
        alias = plain_data(p)
        i = self.engine.param_index(p)
        if i is not None and self.mgr.cursor.stage is Stage.FWD:
            self._reads.note_alias(i, alias)
        return alias

    def on_param_access(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        eng = self.engine
        found: dict[int, torch.Tensor] = {}
        for t in tensor_args(args, kwargs):
            i = eng.param_index(t)
            if i is not None and id(t) not in found and self.mgr.states[i] is not TensorState.COMPUTE:
                found[id(t)] = t
        if not found:
            return plain(func, args, kwargs)
        indices = {id(t): eng.index_of(t) for t in found.values()}
        mutated = [t for t in mutated_tensors(func, args, kwargs) if id(t) in found]
        if mutated:
            return self._write_through(func, args, kwargs, indices, {id(t) for t in mutated})
        if self._reads.sd_depth > 0 and op_name(func) == "detach" and len(indices) == 1:
            return self.state_dict_value(next(iter(indices.values())))
        readable = all(self.mgr.states[i] in _READABLE for i in indices.values())
        it = self._iteration
        if readable and not it.in_model_pass() and self._builds_graph(func, indices.values()):
            # between steps with autograd on (an L2 term computed before the forward, say):
            # the read may feed a loss, so it opens the next training iteration
            it.begin_from_read()
        if readable and it.in_model_pass():
            return self._forward_read(func, args, kwargs, sorted(set(indices.values())))
        return self._idle_read(func, args, kwargs, indices)

    def _builds_graph(self, func: Callable[..., Any], indices: Any) -> bool:
        return (
            torch.is_grad_enabled()
            and self.mgr.cursor.stage is Stage.IDLE
            and op_name(func) not in _NOT_DIFFERENTIABLE
            and any(self._param(i).requires_grad for i in indices)
        )

    def set_data(self, p: torch.Tensor, value: Any) -> None:
        """``p.data = value`` (``module.to()``, old-style weight loading): the parameter
        stays a view of its chunk, so the value is written through instead; what would
        change its shape, dtype or device (``model.half()``, ``model.cuda()`` on a CPU
        engine) is refused, since the engine owns those."""
        if value is p:
            return  # module._apply of a no-op conversion (model.to(the same device))
        i = self.engine.index_of(p)
        s = self.mgr.slots[i]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"parameter '{s.name}': .data must be a tensor, got {type(value).__name__}")
        in_pass = self._iteration.in_model_pass()
        cast = value.dtype != p.dtype and value.is_floating_point()
        if tuple(value.shape) != s.shape or value.device.type != p.device.type or value.dtype != p.dtype and not (cast and in_pass):
            raise ChunkStateError(
                f"cannot set parameter '{s.name}'.data to a {value.dtype} tensor of shape {tuple(value.shape)} on "
                f"{value.device}: chunkstar keeps it as {p.dtype} {s.shape} on {p.device} in its chunks (the config's "
                "precision and device decide those, so model.half()/.float()/.cuda() after initialize_engine cannot "
                "apply; a module that casts its own parameters inside its forward is followed instead). To load "
                "values, copy them in: `with torch.no_grad(): p.copy_(x)`"
            )
        if cast:
            # Note [a model casting its parameters]
            self.engine.see_in_dtype(i, value.dtype)
        if in_pass:
            self._forward_set(i, value)
        else:
            self._write_through(torch.Tensor.copy_, (p, value), {}, {id(p): i}, {id(p)})

    # Note [a model casting its parameters]: some models cast a parameter of their own inside
    # their forward: Switch Transformers' and NLLB-MoE's routers run ``self.classifier =
    # self.classifier.to(torch.float32)`` before computing router logits (router_dtype, fp32 by
    # default), which sets each parameter's .data to an fp32 copy. Under the reference (fp32
    # weights under autocast) that cast changes nothing, and autocast still decides each op's
    # dtype; here the parameter lives in its compute-dtype slot and cannot change dtype. So the
    # cast is read as the module asking to see that parameter in that dtype: every module that
    # registered it gets a parameter upcast to it (Note [parameter upcast] in
    # hooks/param_upcast.py, the mechanism norm layers use), from its next call on; the values
    # cast carry no change (an element that does differ from the slot reaches the master from
    # the value given, as a write in a forward does). The same cast outside a forward
    # (model.half() after initialize_engine) is the user's and stays refused.
    def _forward_set(self, index: int, value: torch.Tensor) -> None:
        """``p.data = value`` during a model pass: the parameter is made resident as a read
        would, and the elements that change reach the fp32 master exactly (Note [writes in a
        forward])."""
        mgr = self.mgr
        targets = self._targets
        if mgr.states[index] is not TensorState.COMPUTE:
            if targets.running_module() is not None:
                targets.attach_to_running_module([index], what=f"parameter '{mgr.slots[index].name}'")
            else:
                prior = {index: mgr.states[index]}
                targets.access_outside_modules(f"parameter '{mgr.slots[index].name}' outside modules", [index])
                try:
                    self.absorb_value(index, value)
                finally:
                    targets.release_outside_modules([index], prior, building_graph=False)
                return
        self.absorb_value(index, value)

    # ------------------------------------------------------------------ forward / backward
    def _forward_read(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], indices: list[int]) -> Any:
        targets = self._targets
        names = ", ".join(repr(self.mgr.slots[i].name) for i in indices[:3])
        data = getattr(func, "__name__", "") == "__get__" and op_name(func) == "data"
        if targets.running_module() is not None:
            targets.attach_to_running_module(indices, what=f"parameter {names}")
            out = plain(func, args, kwargs)
            if data and self.mgr.cursor.stage is Stage.FWD:
                self._reads.note_alias(indices[0], out)  # Note [data aliases]: the module's end checks it
            return out
        label = f"parameter {names} outside modules"
        prior = {i: self.mgr.states[i] for i in indices}
        targets.access_outside_modules(label, indices)
        if data:
            # Note [data aliases]: the real alias, so a write through it reaches the slot; the
            # parameter stays in COMPUTE (its chunk cannot move under the alias) until the next
            # module boundary, which checks the alias and releases it
            out = plain(func, args, kwargs)
            if self.mgr.cursor.stage is Stage.FWD:
                self._reads.note_alias(indices[0], out)
            self._reads.hold_loose(indices, prior)
            return out
        building = torch.is_grad_enabled() and any(self._param(i).requires_grad for i in indices)
        if building:
            # Each parameter goes through an identity node whose backward runs right after
            # this op's backward: that is when the op no longer needs the parameter's data.
            params = [self._param(i) for i in indices]
            aliases = AfterBackward.apply(lambda: targets.release_after_backward(indices), *params)
            subs = {id(p): a for p, a in zip(params, aliases)}
            args, kwargs = substitute(args, subs), substitute(kwargs, subs)
        chunk_ids = sorted({self.mgr.slots[i].chunk_id for i in indices})
        try:
            out = plain(func, args, kwargs)
        except RuntimeError as e:
            # autograd refuses an op that writes a parameter it reads through the aliases above
            if targets.check_writes(indices, 0):
                targets.release_outside_modules(indices, prior, building_graph=False)
                raise ChunkStateError(self._outside_write(func, names)) from e
            raise
        if targets.check_writes(indices, 0) and building:
            # the op wrote the parameter in place and its value reached the master (Note [writes in
            # a forward]); autograd would refuse the aliases it read through at the backward
            targets.release_outside_modules(indices, prior, building_graph=False)
            raise ChunkStateError(self._outside_write(func, names))
        storages = {self.mgr.chunks.chunk(ChunkList.PARAM, c).device_view.untyped_storage()._cdata for c in chunk_ids}

        def own_memory(t: Any) -> Any:
            # A view of the parameter (``p.t()``, ``p.float()`` of an fp32 p) would be read by
            # later ops after the parameter may have moved: hand out a copy (autograd-tracked,
            # so the gradient still reaches the parameter; a view's backward needs no data).
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in storages:
                # a write to it could never reach the parameter: refused, naming it
                return snapshot(t.clone(), ReadOnlySnapshot, f"parameter {names}", f"read outside its module by {op_name(func)}() in a forward")
            return t

        direct = [t for t in output_tensors(out) if t.requires_grad and t.untyped_storage()._cdata not in storages]
        out = type(out)(own_memory(o) for o in out) if isinstance(out, (list, tuple)) else own_memory(out)
        targets.release_outside_modules(indices, prior, building_graph=building)
        if direct:
            # the op's backward reads the parameter: it comes back just before that backward
            torch.autograd.graph.register_multi_grad_hook(
                direct, lambda _grads: targets.access_outside_modules(label, indices, backward=True), mode="any"
            )
        return out

    @staticmethod
    def _outside_write(func: Callable[..., Any], names: str) -> str:
        return (
            f"{op_name(func)}() wrote parameter {names} in place, outside the modules that own it, while autograd "
            "records the forward: chunkstar cannot follow that write through the graph. Call the module that owns "
            "the parameter (nn.Embedding(max_norm=...) renormalises inside its own forward), or run the op from a "
            "module of the model that owns parameters, or make the write a step of its own first, under "
            "torch.no_grad() (for max_norm: torch.embedding_renorm_(weight, ids, max_norm, 2.0)), then read the "
            "parameter without it"
        )

    def _param(self, index: int) -> torch.Tensor:
        return self.engine.parameter(index)

    # ------------------------------------------------------------------ writes
    def _write_through(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], indices: dict[int, int], mutated: set[int]
    ) -> Any:
        mgr = self.mgr
        chunks = mgr.chunks
        if self.gathered_active():
            raise ChunkStateError("parameters cannot be written through while gathered_parameters() is active")
        if not all(chunks.own(mgr.slots[indices[k]].chunk_id) for k in mutated):
            # its owner writes it: every rank runs the same code (Note [collective schedule])
            return args[0] if args else None
        for i in indices.values():
            s = mgr.slots[i]
            if not chunks.own(s.chunk_id):
                raise ChunkStateError(
                    f"{op_name(func)}() reads parameter '{s.name}', which another rank keeps; {GATHER_HINT}"
                )
        # chunks on disk are staged in for the op and written back (Note [disk tier])
        keys = [(ChunkList.PARAM, mgr.slots[i].chunk_id) for i in indices.values()]
        keys += [(ChunkList.MASTER, mgr.slots[i].chunk_id) for i in indices.values() if not chunks.frozen(mgr.slots[i].chunk_id)]
        with chunks.staged(keys, write=True):
            return self._write_through_staged(func, args, kwargs, indices, mutated)

    def _write_through_staged(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], indices: dict[int, int], mutated: set[int]
    ) -> Any:
        mgr = self.mgr
        masters = {key: mgr.chunks.value_view(mgr.slots[i]).view(mgr.slots[i].shape) for key, i in indices.items()}
        with torch.no_grad():
            out = plain(func, substitute(args, masters), substitute(kwargs, masters))
            for key in mutated:
                i = indices[key]
                s = mgr.slots[i]
                if mgr.states[i] is not TensorState.HOLD_AFTER_BWD and not mgr.chunks.frozen(s.chunk_id):
                    # (else the slot holds the gradient, or is itself the value written)
                    mgr.chunks.slot_view(ChunkList.PARAM, s).copy_(masters[key].reshape(-1))
        back = {id(m): t for t in tensor_args(args, kwargs) if id(t) in masters for m in [masters[id(t)]]}
        if isinstance(out, torch.Tensor):
            return back.get(id(out), out)
        if isinstance(out, (list, tuple)):
            return type(out)(back.get(id(o), o) if isinstance(o, torch.Tensor) else o for o in out)
        return out

    def absorb_value(self, index: int, value: torch.Tensor) -> None:
        """``p.data = value`` in a forward, parameter ``index`` in COMPUTE: the elements that
        differ from the slot go into the slot and, from ``value`` itself (exact, whatever its
        dtype), into the fp32 master (Note [writes in a forward])."""
        mgr = self.mgr
        s = mgr.slots[index]
        chunk = mgr.chunks.chunk(ChunkList.PARAM, s.chunk_id)
        with torch.no_grad():
            slot = plain_data(self._param(index)).reshape(-1)
            flat = value.detach().reshape(-1).to(slot.device)
            changed = flat.to(slot.dtype) != slot
            if not bool(changed.any()):
                return
            slot[changed] = flat[changed].to(slot.dtype)
            chunk.mark_dirty()
            if mgr.chunks.frozen(s.chunk_id) or not mgr.chunks.own(s.chunk_id):
                return  # no master (the param slot is the value), or another rank's chunk
            with mgr.chunks.staged([(ChunkList.MASTER, s.chunk_id)], write=True):
                master = mgr.chunks.slot_view(ChunkList.MASTER, s)
                where = changed.to(master.device)
                master[where] = flat.to(master.device)[where].to(master.dtype)

    # ------------------------------------------------------------------ reads between steps
    def current_value(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s value now, in the compute dtype on the engine's device,
        without moving its chunk (an alias of chunk memory where possible)."""
        mgr = self.mgr
        s = mgr.slots[index]
        chunk = mgr.chunks.chunk(ChunkList.PARAM, s.chunk_id)
        if mgr.states[index] is TensorState.HOLD_AFTER_BWD:
            if not mgr.chunks.own(s.chunk_id):
                raise ChunkStateError(f"parameter '{s.name}' is kept by another rank; {GATHER_HINT}")
            with mgr.chunks.staged([(ChunkList.MASTER, s.chunk_id)], write=False):
                master = mgr.chunks.slot_view(ChunkList.MASTER, s)
                return master.to(device=self.engine.device, dtype=chunk.dtype, copy=True).view(s.shape)
        if chunk.location is ChunkLocation.RELEASED:
            raise ChunkStateError(
                f"parameter '{s.name}' is kept by another rank (several processes shard the parameters); {GATHER_HINT}"
            )
        if chunk.location is ChunkLocation.DISK:  # its home is a file (Note [param chunks on disk]): a copy
            with mgr.chunks.staged([(ChunkList.PARAM, s.chunk_id)], write=False):
                return chunk.payload[s.offset : s.end].view(s.shape).to(self.engine.device, copy=True)
        return chunk.payload[s.offset : s.end].view(s.shape).to(self.engine.device)

    def _idle_read(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], indices: dict[int, int]) -> Any:
        values = {key: self.current_value(i) for key, i in indices.items()}
        chunk_storages = set()
        for i in indices.values():
            chunk = self.mgr.chunks.chunk(ChunkList.PARAM, self.mgr.slots[i].chunk_id)
            if chunk.location is not ChunkLocation.RELEASED and chunk.location is not ChunkLocation.DISK:
                chunk_storages.add(chunk.payload.untyped_storage()._cdata)
        with torch.no_grad():
            out = plain(func, substitute(args, values), substitute(kwargs, values))

        originals = {id(v): t for t in tensor_args(args, kwargs) if id(t) in values for v in [values[id(t)]]}

        name = op_name(func)
        whole = name in ("data", "detach") and len(indices) == 1  # the parameter's whole value, not a view
        param = next(t for t in tensor_args(args, kwargs) if id(t) in indices)

        def write(f: Callable[..., Any], a: tuple[Any, ...], k: dict[str, Any]) -> None:
            # ``p.data.clamp_(-c, c)`` between steps (WGAN's weight clipping): the op runs on the
            # parameter itself, written through to its fp32 master
            snap = next(t for t in mutated_tensors(f, a, k) if isinstance(t, ReadOnlySnapshot))
            sub = {id(snap): param}
            self.on_param_access(f, substitute(a, sub), substitute(k, sub))

        def safe(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and id(t) in originals:
                return originals[id(t)]  # the op returned its input (model.to(the same device)): the parameter
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in chunk_storages:
                names = ", ".join(repr(self.mgr.slots[i].name) for i in sorted(set(indices.values()))[:3])
                return snapshot(t.detach().clone(), ReadOnlySnapshot, f"parameter {names}", write=write if whole else None)
            return t

        if isinstance(out, (list, tuple)):
            return type(out)(safe(o) for o in out)
        return safe(out)

    # ------------------------------------------------------------------ gathered_parameters()
    def gathered_active(self) -> bool:
        return self._reads.gathered_active()

    @contextlib.contextmanager
    def gathered(self, indices: list[int], *, writeback: bool, device: torch.device) -> Iterator[list[nn.Parameter]]:
        """The body of ``engine.gathered_parameters()`` (the engine checks the stage):
        each parameter's ``.data`` becomes an fp32 copy of its master on ``device``,
        unguarded; on exit the values go back (``writeback``) and the views return."""
        eng = self.engine
        mgr = self.mgr
        if self._reads.gathered:
            raise ChunkStateError("gathered_parameters() blocks cannot be nested")
        need = sum(mgr.slots[i].numel * 4 for i in indices)
        if device.type == "cuda" and device == eng.device:
            # real device memory: evict chunks to make room for the fp32 values
            try:
                with mgr.probe.paused():
                    mgr.make_room(need, protect=set(), where="gathered_parameters()")
            except DeviceMemoryError:
                raise DeviceMemoryError(
                    device=str(eng.device), needed=need, free=max(0, mgr.chunk_budget() - mgr.pinned_bytes()),
                    budget=mgr.capacity, where=f"gathered_parameters() ({len(indices)} parameters in fp32)",
                    advice="gather fewer parameters at a time, or pass device=\"cpu\" to gather them in host memory",
                ) from None  # fmt: skip
        masters = eng.full_masters()
        params = [self._param(i) for i in indices]
        for i, p in zip(indices, params):
            s = mgr.slots[i]
            value = masters[s.chunk_id][s.offset : s.end].to(device, copy=True).view(s.shape)
            mgr.set_guarded(i, False)
            p.data = value
            self._reads.gathered.add(i)
        try:
            yield params  # type: ignore[misc]
        finally:
            try:
                if writeback:
                    with torch.no_grad():
                        by_chunk: dict[int, list[tuple[int, torch.Tensor]]] = {}
                        for i, p in zip(indices, params):
                            by_chunk.setdefault(mgr.slots[i].chunk_id, []).append((i, p))
                        for cid, members in by_chunk.items():
                            if not mgr.chunks.own(cid):
                                continue  # its owner writes it back
                            trainable = not mgr.chunks.frozen(cid)
                            keys = [(ChunkList.MASTER, cid), (ChunkList.PARAM, cid)] if trainable else [(ChunkList.PARAM, cid)]
                            with mgr.chunks.staged(keys, write=True):
                                for i, p in members:
                                    s = mgr.slots[i]
                                    src = p.data.reshape(-1)
                                    if trainable:
                                        mgr.chunks.slot_view(ChunkList.MASTER, s).copy_(src)
                                    if mgr.states[i] is not TensorState.HOLD_AFTER_BWD:  # else the slot holds the gradient
                                        mgr.chunks.slot_view(ChunkList.PARAM, s).copy_(src)
            finally:
                for i, p in zip(indices, params):
                    p.data = eng.param_view(i)
                    mgr.set_guarded(i, True)
                self._reads.gathered.clear()

    # ------------------------------------------------------------------ module.state_dict()
    def begin_state_dict(self) -> None:
        if self._reads.sd_depth == 0:
            self.engine.check_thread("module.state_dict()")  # Note [the training thread] in optim/adam.py
        self._reads.sd_depth += 1
        if self._reads.sd_depth == 1:
            self._reads.reset_state_dict()  # masters gathered on first use (every rank runs the same state_dict() calls)

    def end_state_dict(self) -> None:
        self._reads.sd_depth = max(0, self._reads.sd_depth - 1)
        if self._reads.sd_depth == 0:
            self._reads.reset_state_dict()

    def state_dict_value(self, index: int) -> torch.Tensor:
        """Parameter ``index``'s fp32 master value as a CPU tensor of its own (one
        object per slot within a state_dict() call, so tied names share it)."""
        got = self._reads.sd_memo.get(index)
        if got is not None:
            return got
        mgr = self.mgr
        s = mgr.slots[index]
        if self.engine.comm.distributed:
            if self._reads.sd_masters is None:
                self._reads.sd_masters = self.engine.full_masters()
            src = self._reads.sd_masters[s.chunk_id][s.offset : s.end]
        elif mgr.chunks.on_disk(which := ChunkList.PARAM if mgr.chunks.frozen(s.chunk_id) else ChunkList.MASTER):
            # staged in once per chunk: state_dict() visits the parameters in about chunk order
            if self._reads.sd_chunk is None or self._reads.sd_chunk[0] != s.chunk_id:
                with mgr.chunks.staged([(which, s.chunk_id)], write=False):
                    self._reads.sd_chunk = (s.chunk_id, mgr.chunks.chunk(which, s.chunk_id).payload.clone())
            src = self._reads.sd_chunk[1][s.offset : s.end]
        else:
            src = mgr.chunks.value_view(s)  # the master, or a frozen parameter's param slot
        value = src.detach().to("cpu", dtype=torch.float32, copy=True).view(s.shape)
        self._reads.sd_memo[index] = value
        return value
