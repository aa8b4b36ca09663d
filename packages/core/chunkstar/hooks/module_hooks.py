"""Module and gradient hooks: where training tells the runtime what it needs.

* forward pre-hook  -> ``on_pre_forward``: the module's parameters must be on
  the device now (a *moment* begins);
* forward hook      -> ``on_post_forward``: they may move again; and, when the
  output needs grad, it puts a multi-grad hook on the output tensors (mode
  "any") that accesses the module's parameters again (a backward moment) as
  soon as the first gradient reaches the module, i.e. before the module's own
  backward runs;
* post-accumulate-grad hook on every parameter -> ``on_grad``: its gradient is
  complete (autograd runs a leaf's AccumulateGrad once, after all its uses,
  tied uses included), so it can be folded into the parameter's slot.

The target is the runtime's internal :class:`chunkstar.runtime.hook_targets.HookTargets`
(``on_grad`` is the bound method of :class:`chunkstar.runtime.gradients.Gradients`).

Hooks go only on modules that own parameters directly, so nesting works and
each parameter is accessed by the module that registered it. A compiled module
(``block.compile()``, ``torch.compile(block)``) is the exception: it is hooked
as one unit, around its compiled call (Note [compiled units] in
:mod:`chunkstar.hooks.compiled`). A module is
named to the runtime by its position in ``modules`` (``module_key``); the
runtime keeps the set of parameters each module touches, which starts as
the module's own and grows when a module is seen reading another module's
parameter (Note [parameter guard] in :mod:`chunkstar.hooks.param_guard`).
Outputs may be tensors, tuples, lists, dicts or Hugging Face ``ModelOutput``
(a dict). Modules called several times, recomputation under activation
checkpointing (forward hooks fire again inside backward) and
``torch.no_grad()`` evaluation (no backward hook is registered) all go
through the same paths. A hook fired by a *copy* of a hooked module
(``copy.deepcopy(model)`` for an EMA model copies the hook dicts) is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from chunkstar.hooks.compiled import CompiledUnit, UnitHandle, compiled_modules

__all__ = ["AfterBackward", "EngineHook", "HookTarget", "HookedModule", "install_hooks", "output_tensors", "substitute"]


@dataclass(frozen=True)
class HookedModule:
    key: int
    """Position in the list :func:`install_hooks` returns."""
    label: str
    """Qualified name in the model (the model's class name for the root)."""
    own: tuple[int, ...]
    """Slot indices of the parameters the module registered itself."""


class HookTarget(Protocol):
    def on_pre_forward(self, module_key: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None: ...
    def on_post_forward(self, module_key: int, output: Any) -> None: ...
    def on_grad(self, index: int, param: torch.Tensor) -> None: ...
    def run_compiled(self) -> bool: ...


def output_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in a module's output: tensors, (nested) tuples/lists, dicts and ``ModelOutput``s."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from output_tensors(o)
    elif isinstance(obj, Mapping):
        for o in obj.values():
            yield from output_tensors(o)


class EngineHook:
    """A hook the engine puts on the user's model. Pickling the model (``torch.save(model)``)
    would pickle it too: it refuses with a sentence saying what to save instead."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> EngineHook:
        return self  # a copied model (an EMA) shares it; module hooks ignore modules that are not the engine's

    def __reduce__(self) -> Any:
        raise TypeError(
            "a model wrapped by a chunkstar engine cannot be pickled whole (torch.save(model)): its parameters live "
            "in the engine's chunks. Save torch.save(model.state_dict()) (the fp32 values under the model's own keys), "
            "model.save_pretrained(...) for a Hugging Face model, or engine.save_checkpoint(dir) to resume training"
        )


def substitute(obj: Any, subs: Mapping[int, torch.Tensor]) -> Any:
    """``obj`` with the tensors whose ``id`` is in ``subs`` replaced (through tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        return subs.get(id(obj), obj)
    if isinstance(obj, list):
        return [substitute(o, subs) for o in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(substitute(o, subs) for o in obj)
    if isinstance(obj, dict):
        return {k: substitute(v, subs) for k, v in obj.items()}
    return obj


class AfterBackward(torch.autograd.Function):
    """Identity on tensors; its backward calls ``callback`` and passes the gradients on.

    Put around a module's inputs, its backward runs once the module's backward has
    produced the inputs' gradients, i.e. when the module no longer needs its
    parameters' data (FSDP2 marks its post-backward the same way)."""

    @staticmethod
    def forward(ctx: Any, callback: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        ctx.callback()
        return (None, *grads)


def install_hooks(
    model: nn.Module, index_of: Mapping[int, int], target: HookTarget
) -> tuple[list[HookedModule], list[RemovableHandle | UnitHandle], list[CompiledUnit]]:
    """Hook every module owning parameters and every parameter needing grad; a
    compiled module is hooked as one unit (Note [compiled units]).

    ``index_of`` maps ``id(param)`` to the parameter's slot index.
    """
    handles: list[RemovableHandle | UnitHandle] = []
    modules: list[HookedModule] = []
    units: list[CompiledUnit] = []
    compiled = dict(compiled_modules(model))
    inside = tuple(f"{name}." if name else "" for name in compiled)
    for name, mod in model.named_modules():
        if name in compiled:
            own = tuple(sorted({index_of[id(p)] for p in mod.parameters()}))
            if own:
                key = len(modules)
                modules.append(HookedModule(key, name or type(mod).__name__, own))
                unit, handle = CompiledUnit.install(key, mod, target)
                units.append(unit)
                handles.append(handle)
            continue
        if any(name.startswith(p) for p in inside):
            continue  # inside a unit: its parameters are the unit's
        own = tuple(sorted({index_of[id(p)] for p in mod.parameters(recurse=False)}))
        if not own:
            continue
        key = len(modules)
        modules.append(HookedModule(key, name or type(mod).__name__, own))

        def pre(m: nn.Module, args: Any, kwargs: Any, key: int = key, mod: nn.Module = mod) -> tuple[Any, Any] | None:
            if m is mod:
                return target.on_pre_forward(key, args, kwargs)
            return None

        def post(m: nn.Module, _args: Any, output: Any, key: int = key, mod: nn.Module = mod) -> None:
            if m is mod:
                target.on_post_forward(key, output)

        handles.append(mod.register_forward_pre_hook(EngineHook(pre), with_kwargs=True))
        handles.append(mod.register_forward_hook(EngineHook(post)))

    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        idx = index_of[id(p)]
        handles.append(p.register_post_accumulate_grad_hook(lambda param, idx=idx: target.on_grad(idx, param)))
    return modules, handles, units
