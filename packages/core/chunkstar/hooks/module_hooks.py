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
Outputs may be tensors or any nesting of tuples, lists, dicts, dataclasses,
named tuples, Hugging Face ``ModelOutput``s and pytree-registered types; anything
else in a module's output is refused, naming the module (Note [output
containers]). Modules called several times, recomputation under activation
checkpointing (forward hooks fire again inside backward) and
``torch.no_grad()`` evaluation (no backward hook is registered) all go
through the same paths. A hook fired by a *copy* of a hooked module
(``copy.deepcopy(model)`` for an EMA model copies the hook dicts) is ignored.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import numbers
import weakref
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.hooks import RemovableHandle

from chunkstar.hooks.compiled import CompiledUnit, UnitHandle, compiled_modules

__all__ = ["AfterBackward", "EngineHook", "HookTarget", "HookedModule", "hooked_modules", "install_hooks", "output_tensors", "substitute"]


@dataclass(frozen=True)
class HookedModule:
    key: int
    """Position in the list :func:`hooked_modules` returns."""
    label: str
    """Qualified name in the model (the model's class name for the root)."""
    own: tuple[int, ...]
    """Slot indices of the parameters the module registered itself (a compiled unit: all of its own)."""
    module: nn.Module = field(compare=False, repr=False)
    compiled: bool = False
    """A compiled module, hooked as one unit (Note [compiled units])."""


class HookTarget(Protocol):
    def on_pre_forward(self, module_key: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None: ...
    def on_post_forward(self, module_key: int, output: Any) -> None: ...
    def on_grad(self, index: int, param: torch.Tensor) -> None: ...
    def run_compiled(self) -> bool: ...


# Note [output containers]: the tensors of a module's output get the backward hook that
# brings the module's parameters back (runtime/hook_targets.py), and the tensors of its
# inputs the identity that releases them (``substitute``); a tensor the walk does not
# see gets neither, and the module's backward then reads a parameter whose data has
# moved (``setStorage: ... storage of size 0``). So the walk opens every container it can
# name, each by its structure, never by what the process happens to have imported:
#
# * tuples and lists (named tuples, ``torch.Size``, ``torch.return_types`` included);
# * ``Mapping``s (dicts, ``OrderedDict``, Hugging Face ``ModelOutput``, which is a
#   dict *and* a dataclass: it goes the Mapping way whatever else is registered);
# * dataclasses, frozen or not, through ``dataclasses.fields`` (every field, the
#   ``init=False`` ones too);
# * any other type registered with ``torch.utils._pytree`` (``deque``, a user's
#   ``register_pytree_node``), through its flatten function.
#
# The registry is read last and never cached: a type is found through it only when
# it is none of the above, so a registration (``import transformers`` registers every
# ``ModelOutput`` subclass) can turn a refusal into a find, never change what a known
# container yields. What is none of these and no known leaf (``None``, numbers,
# strings, enums, dtypes, devices) is *unknown*: it might hold tensors. In a hooked
# module's output it is refused, naming the module (``refuse``); inputs are walked
# leniently (unknown objects are opaque), since modules are handed objects that are
# no outputs of theirs (a Hugging Face ``Cache``, a config) and a refusal there would
# stop models that train correctly. ``substitute`` rebuilds exactly the containers
# the walk opens, as their own type.

_LEAVES = (type(None), bool, int, float, complex, str, bytes, numbers.Number, enum.Enum, torch.dtype, torch.device,
           torch.layout, torch.memory_format, type, slice, range, type(Ellipsis))  # fmt: skip
_SCALARS = frozenset({type(None), bool, int, float, str})  # the common leaves, found without an ABC check
_FIELDS: dict[type, tuple[str, ...]] = {}  # a dataclass's field names, by class (fields() costs a loop per call)


def _dataclass_fields(cls: type) -> tuple[str, ...] | None:
    names = _FIELDS.get(cls)
    if names is None and dataclasses.is_dataclass(cls):
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def output_tensors(obj: Any, refuse: str | None = None) -> Iterator[torch.Tensor]:
    """Tensors in ``obj`` (a module's output or its inputs), through every container
    Note [output containers] names. An object that may hold tensors but is no known
    container is skipped, or, with ``refuse`` (the module's name), a ``TypeError``."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):  # the hot path: a tensor or a tuple of them
        for o in obj:
            yield from output_tensors(o, refuse)
    elif type(obj) in _SCALARS:
        return
    elif isinstance(obj, Mapping):
        for o in obj.values():
            yield from output_tensors(o, refuse)
    elif (names := _dataclass_fields(type(obj))) is not None:
        for name in names:
            yield from output_tensors(getattr(obj, name, None), refuse)
    elif (node := pytree.SUPPORTED_NODES.get(type(obj))) is not None:
        for o in node.flatten_fn(obj)[0]:
            yield from output_tensors(o, refuse)
    elif refuse is not None and not isinstance(obj, _LEAVES):
        cls = type(obj)
        raise TypeError(
            f"module '{refuse}' returned an object of type {cls.__module__}.{cls.__qualname__} (in its output), "
            "which chunkstar cannot look into: a tensor inside it "
            "would get no backward hook, and the module's backward would read parameters that have moved. Return "
            "tensors in tuples, lists, dicts, dataclasses or NamedTuples, or register the type with "
            "torch.utils._pytree.register_pytree_node"
        )


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
    """``obj`` with the tensors whose ``id`` is in ``subs`` replaced, through the containers
    :func:`output_tensors` opens, each rebuilt as its own type (Note [output containers]);
    a container with nothing replaced inside is returned as it is."""
    if isinstance(obj, torch.Tensor):
        return subs.get(id(obj), obj)
    cls = type(obj)
    if cls is tuple:  # the hot path: plain containers are rebuilt, whatever changed
        return tuple(substitute(o, subs) for o in obj)
    if cls is list:
        return [substitute(o, subs) for o in obj]
    if cls is dict:
        return {k: substitute(v, subs) for k, v in obj.items()}
    if cls in _SCALARS:
        return obj
    if isinstance(obj, (tuple, list)):
        items = [substitute(o, subs) for o in obj]
        return obj if all(a is b for a, b in zip(items, obj)) else _rebuild_sequence(obj, items)
    node = pytree.SUPPORTED_NODES.get(cls)
    if isinstance(obj, Mapping) and (node is None or isinstance(obj, MutableMapping)):
        changed = {k: n for k, v in obj.items() if (n := substitute(v, subs)) is not v}
        return _rebuild_mapping(obj, changed) if changed else obj
    if (names := _dataclass_fields(cls)) is not None:
        changed = {n: new for n in names if (new := substitute(old := getattr(obj, n, None), subs)) is not old}
        return _rebuild_dataclass(obj, changed) if changed else obj
    if node is not None:  # a read-only mapping its registration rebuilds (immutable_dict), or any node
        children, context = node.flatten_fn(obj)
        items = [substitute(o, subs) for o in children]
        return obj if all(a is b for a, b in zip(items, children)) else node.unflatten_fn(items, context)
    return obj


def _rebuild_sequence(obj: tuple[Any, ...] | list[Any], items: list[Any]) -> Any:
    cls = type(obj)
    if hasattr(cls, "_make"):  # a named tuple
        return cls._make(items)  # type: ignore[union-attr]
    if (node := pytree.SUPPORTED_NODES.get(cls)) is not None:  # torch.return_types, immutable_list
        return node.unflatten_fn(items, node.flatten_fn(obj)[1])
    if isinstance(obj, tuple):
        return cls(items)  # torch.Size and other tuple subclasses take their items
    new = copy.copy(obj)  # a list subclass keeps its attributes
    new[:] = items
    return new


def _rebuild_mapping(obj: Mapping[Any, Any], changed: dict[Any, Any]) -> Any:
    if isinstance(obj, MutableMapping):
        # a copy keeps the type and whatever else it holds (OrderedDict order, a defaultdict's
        # factory, a ModelOutput's attributes, which its __setitem__ sets too)
        new = copy.copy(obj)
        for k, v in changed.items():
            new[k] = v
        return new
    try:
        return type(obj)({k: changed.get(k, v) for k, v in obj.items()})  # type: ignore[call-arg]
    except TypeError as e:
        raise TypeError(
            f"chunkstar cannot rebuild the read-only mapping {type(obj).__qualname__} with a tensor replaced ({e}): "
            "pass a dict, or register the type with torch.utils._pytree.register_pytree_node"
        ) from e


def _rebuild_dataclass(obj: Any, changed: dict[str, Any]) -> Any:
    init = {f.name for f in dataclasses.fields(obj) if f.init}
    new = dataclasses.replace(obj, **{k: v for k, v in changed.items() if k in init})
    for k, v in changed.items():
        if k not in init:  # a field __post_init__ sets; frozen or not
            object.__setattr__(new, k, v)
    return new


class _GradHook:
    """A parameter's post-accumulate-grad hook. autograd keeps it from C++, where the garbage
    collector cannot see it, so it holds the engine's target weakly: a strong reference
    would keep every dropped or closed engine (its chunks, its threads) alive for as long as
    the model lives."""

    __slots__ = ("_target", "_index")

    def __init__(self, target: HookTarget, index: int) -> None:
        self._target = weakref.ref(target)
        self._index = index

    def __call__(self, param: torch.Tensor) -> None:
        target = self._target()
        if target is not None:
            target.on_grad(self._index, param)


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


def hooked_modules(model: nn.Module, index_of: Mapping[int, int]) -> list[HookedModule]:
    """The modules whose hooks begin moments: every module owning parameters, and each
    compiled module as one unit with every parameter inside it (Note [compiled units]).
    ``index_of`` maps ``id(param)`` to the parameter's slot index. Installs nothing: the
    hook targets are built with this list, then :func:`install_hooks` points the hooks at
    them."""
    modules: list[HookedModule] = []
    compiled = dict(compiled_modules(model))
    inside = tuple(f"{name}." if name else "" for name in compiled)
    for name, mod in model.named_modules():
        if name in compiled:
            own = tuple(sorted({index_of[id(p)] for p in mod.parameters()}))
            if own:
                modules.append(HookedModule(len(modules), name or type(mod).__name__, own, mod, compiled=True))
            continue
        if any(name.startswith(p) for p in inside):
            continue  # inside a unit: its parameters are the unit's
        own = tuple(sorted({index_of[id(p)] for p in mod.parameters(recurse=False)}))
        if own:
            modules.append(HookedModule(len(modules), name or type(mod).__name__, own, mod))
    return modules


def install_hooks(
    model: nn.Module, modules: list[HookedModule], index_of: Mapping[int, int], target: HookTarget
) -> tuple[list[RemovableHandle | UnitHandle], list[CompiledUnit]]:
    """Hook the modules of :func:`hooked_modules` (a compiled one as one unit) and every
    parameter of ``model`` needing grad, all pointing at ``target``."""
    handles: list[RemovableHandle | UnitHandle] = []
    units: list[CompiledUnit] = []
    for hm in modules:
        key, mod = hm.key, hm.module
        if hm.compiled:
            unit, handle = CompiledUnit.install(key, mod, target)
            units.append(unit)
            handles.append(handle)
            continue

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
        handles.append(p.register_post_accumulate_grad_hook(_GradHook(target, idx)))
    return handles, units
