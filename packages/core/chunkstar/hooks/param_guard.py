"""Parameter guards: every op on a parameter that is not in COMPUTE reaches the runtime.

Module hooks cover the parameters a module *owns*. Real code also touches
parameters elsewhere: ``nn.MultiheadAttention`` reads ``out_proj.weight``
inside its own forward (``out_proj`` is never called), a parent does
``F.linear(x, self.shared.weight)``, a loss adds an L2 term over
``model.parameters()``, and between steps users print parameters, log their
norms, keep an EMA or load new values. Outside COMPUTE a parameter's data may
live on the other tier (its device storage is 0 bytes) or be its gradient, so
such an op would crash or read the wrong thing.

Note [parameter guard]: a parameter's Python class is swapped to a
*guarded* subclass whenever its tensor state leaves COMPUTE, and to a *watched*
one when it enters COMPUTE (a ``__class__`` assignment, ~50 ns; the watched class
differs from the plain one only in ``data``: Note [data aliases]). The guarded class defines
``__torch_function__``, so every torch function, method or property access
that takes the parameter calls :meth:`GuardTarget.on_param_access` first. A
module's own parameters are in COMPUTE while the module runs, so the hot path
(a module computing with its own weights) never pays anything; only accesses
the hooks did not foresee do. Metadata (shape, dtype, device, hooks...)
passes through untouched; ``grad`` and its setter go to the runtime, where a
gradient may sit in the chunk (``module.zero_grad()`` sets it to None).

This module is mechanism only: *what* an access does (make the chunk
resident, substitute a readable value, write through to the fp32 master) is
the runtime's decision (:mod:`chunkstar.runtime.param_access`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

import torch
from torch import nn

from chunkstar.errors import ChunkStateError

__all__ = [
    "GuardTarget",
    "ReadOnlyGradient",
    "ReadOnlySnapshot",
    "guarded_class",
    "watched_class",
    "is_metadata",
    "mutated_tensors",
    "op_name",
    "plain",
    "tensor_args",
]


class GuardTarget(Protocol):
    def on_param_access(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...
    def grad_of(self, p: torch.Tensor) -> torch.Tensor | None: ...
    def set_grad(self, p: torch.Tensor, value: Any) -> None: ...
    def set_data(self, p: torch.Tensor, value: Any) -> None: ...
    def data_of(self, p: torch.Tensor) -> torch.Tensor: ...
    def param_index(self, p: torch.Tensor) -> int | None: ...


# Properties and methods that read or set metadata only (never the data).
_METADATA = frozenset(
    {
        "shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "names", "layout", "grad_fn",
        "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "itemsize", "nbytes",
        "output_nr", "_version", "_base", "is_complex", "is_floating_point", "numel", "dim", "size", "stride",
        "element_size", "nelement", "is_contiguous", "get_device", "data_ptr", "untyped_storage", "storage_offset",
        "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "retains_grad",
        "__len__", "__hash__", "__sizeof__", "_is_view", "is_shared", "is_pinned", "is_inference", "has_names",
        "_post_accumulate_grad_hooks", "_backward_hooks", "is_conj", "is_neg", "_is_zerotensor",
        "_has_compatible_shallow_copy_type", "is_same_size", "is_set_to", "dim_order", "__dlpack_device__",
    }
)  # fmt: skip

# In-place operators spelled as dunders (``p += x``); other in-place ops end in "_".
_INPLACE_DUNDERS = frozenset(
    {
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
        "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
    }
)  # fmt: skip


def op_name(func: Callable[..., Any]) -> str:
    """The op's name; a property access is named after the property (``__get__`` -> ``data``)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", name)
    return name


def is_metadata(func: Callable[..., Any]) -> bool:
    return op_name(func) in _METADATA


def _is_setter(func: Callable[..., Any]) -> bool:
    return getattr(func, "__name__", "") in ("__set__", "__delete__")


def tensor_args(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Iterator[torch.Tensor]:
    """Tensors among the arguments, one level of lists/tuples deep (``_foreach_*`` ops)."""
    for a in (*args, *(kwargs.values() if kwargs else ())):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def mutated_tensors(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    """Tensors the op writes: ``self`` of an in-place op (all of them for ``_foreach_*_``), ``out=``."""
    name = op_name(func)
    out: list[torch.Tensor] = []
    if (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS:
        if args:
            first = args[0]
            if isinstance(first, torch.Tensor):
                out.append(first)
            elif isinstance(first, (list, tuple)):
                out.extend(t for t in first if isinstance(t, torch.Tensor))
    if kwargs and "out" in kwargs:
        o = kwargs["out"]
        out.extend([o] if isinstance(o, torch.Tensor) else [t for t in o if isinstance(t, torch.Tensor)])
    return out


def plain(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
    """Run ``func`` with every tensor subclass's ``__torch_function__`` disabled (results are plain tensors)."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


def guarded_class(base: type, target: GuardTarget) -> type:
    """A guarded subclass of ``base`` (``nn.Parameter`` or a subclass of it) whose
    accesses go to ``target``. The caller keeps one per base class (an engine owns its own)."""

    def __torch_function__(cls: type, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kind = getattr(func, "__name__", "")
        if kind == "__get__" and op_name(func) == "grad":
            return target.grad_of(args[0])  # the gradient may sit in the chunk (Note [parameter guard])
        if kind == "__set__" and op_name(func) == "data":
            return target.set_data(args[0], args[1])  # the parameter must stay a view of its chunk
        if kind == "__set__" and op_name(func) == "grad":
            return target.set_grad(args[0], args[1])  # module.zero_grad() drops a gradient in the slot
        if is_metadata(func) or _is_setter(func):
            return plain(func, args, kwargs)
        return target.on_param_access(func, args, kwargs or {})

    def __deepcopy__(self: nn.Parameter, memo: dict[int, Any]) -> nn.Parameter:
        # a copy (an EMA model, say) is an ordinary parameter holding the current value
        if id(self) in memo:
            return memo[id(self)]  # type: ignore[no-any-return]
        with torch.no_grad():  # a copy is a read between steps, never part of a graph
            value = target.on_param_access(torch.Tensor.clone, (self,), {})
        result = base(value.as_subclass(torch.Tensor), self.requires_grad)
        memo[id(self)] = result
        return result  # type: ignore[no-any-return]

    def __reduce_ex__(self: nn.Parameter, proto: Any) -> Any:
        with torch.no_grad():
            value = target.on_param_access(torch.Tensor.clone, (self,), {})
        return base(value.as_subclass(torch.Tensor), self.requires_grad).__reduce_ex__(proto)

    return type(
        base.__name__,  # repr and error messages keep the familiar name ("Parameter containing: ...")
        (base,),
        {
            "__torch_function__": classmethod(__torch_function__),
            "__deepcopy__": __deepcopy__,
            "__reduce_ex__": __reduce_ex__,
            "__module__": base.__module__,
            "_chunkstar_base": base,
        },
    )


# Note [data aliases]: ``p.data`` is the one alias of a parameter that autograd does not
# version with it: it has a version counter of its own, so an in-place write through it
# (``self.weight.data.clamp_(...)``, ``.mul_``, ``.copy_(normalize(...))``: the max-norm and
# non-negativity constraints of older code, Gemma3n's AltUp clipping a child's weight) leaves
# the parameter's own counter alone, and Note [writes in a forward] in
# runtime/hook_targets.py, which reads that counter, would never see it. A parameter in
# COMPUTE is a plain tensor that no guard sees, so its class there is not the plain one but
# a *watched* subclass that overrides only the ``data`` property: its getter hands out the
# real alias and the runtime notes it (with the alias's own counter), its setter writes the
# value through instead of replacing the parameter's storage. Nothing else changes: the
# watched class keeps its base's disabled ``__torch_function__``, so every op on the
# parameter runs as on the plain class (torch then looks up one class attribute per
# argument, tens of nanoseconds). Outside COMPUTE the guarded class catches ``data`` as any
# other access (runtime/param_access.py).


def watched_class(base: type, target: GuardTarget) -> type:
    """The class of a parameter in COMPUTE: ``base`` with ``data`` reaching ``target``
    (Note [data aliases]). The caller keeps one per base class."""

    def _get(self: torch.Tensor) -> torch.Tensor:
        return target.data_of(self)

    def _set(self: torch.Tensor, value: Any) -> None:
        target.set_data(self, value)

    return type(
        base.__name__,
        (base,),
        {"data": property(_get, _set), "__module__": base.__module__, "_chunkstar_base": base},
    )


def plain_data(p: torch.Tensor) -> torch.Tensor:
    """``p.data`` as the plain tensor class gives it, past any override of the property."""
    return torch._C.TensorBase.data.__get__(p)  # type: ignore[attr-defined,no-any-return]


def set_plain_data(p: torch.Tensor, value: torch.Tensor) -> None:
    """``p.data = value`` as the plain tensor class does it."""
    torch._C.TensorBase.data.__set__(p, value)  # type: ignore[attr-defined]


_WRITE_HINT = (
    "a write to it would be lost. Write to the parameter itself under torch.no_grad() (p.copy_(x), p.mul_(s), "
    "p.data.clamp_(...), nn.init.*: chunkstar writes through to the fp32 master), or use "
    "`with engine.gathered_parameters(): ...` where p.data is the real fp32 value"
)

WriteHook = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], None]


class ReadOnlySnapshot(torch.Tensor):
    """A copy of a parameter's value handed out for an aliasing read (``p.data``,
    ``p.detach()``, a view) where the parameter's own memory cannot be handed out: between
    steps, or outside its module in a forward. Reads work as on any tensor (their results
    are plain tensors, but views of a snapshot are snapshots). An in-place write to the
    snapshot itself goes through to the parameter where the engine gave it a write hook
    (``p.data`` and ``p.detach()`` between steps: ``p.data.clamp_(-c, c)`` after a step, as
    WGAN's weight clipping does); any other write raises, naming the parameter, because it
    could never reach it (never dropped in silence)."""

    _chunkstar_of = "a chunkstar parameter"  # what it is a copy of (an instance sets it)
    _chunkstar_when = "taken outside the model's forward and backward"
    _chunkstar_writes: frozenset[str] | None = None  # the in-place ops the write hook takes (None: any)

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if is_metadata(func):
            return plain(func, args, kwargs)
        hit = [t for t in mutated_tensors(func, args, kwargs) if isinstance(t, ReadOnlySnapshot)]
        if hit:
            target = hit[0]
            hook: WriteHook | None = target.__dict__.get("_chunkstar_write")
            allowed = target._chunkstar_writes
            if hook is None or len(hit) > 1 or allowed is not None and op_name(func) not in allowed:
                raise ChunkStateError(target._refusal(func))
            hook(func, args, kwargs or {})  # the parameter's value (its fp32 master, then its slot)
            plain(func, args, kwargs)  # and this copy, which the caller may read next
            return target
        out = plain(func, args, kwargs)
        return _views_stay_snapshots(out, args)

    def _refusal(self, func: Callable[..., Any]) -> str:
        return f"cannot {op_name(func)}() this tensor: it is a copy of {self._chunkstar_of}, {self._chunkstar_when}; {_WRITE_HINT}"


def snapshot(value: torch.Tensor, cls: type[ReadOnlySnapshot], of: str, when: str | None = None,
             write: WriteHook | None = None) -> torch.Tensor:  # fmt: skip
    """``value`` (a copy the caller owns) as a snapshot of ``of``; ``write`` makes an in-place
    write to it reach the parameter."""
    out = value.as_subclass(cls)
    out._chunkstar_of = of  # type: ignore[attr-defined]
    if when is not None:
        out._chunkstar_when = when  # type: ignore[attr-defined]
    if write is not None:
        out._chunkstar_write = write  # type: ignore[attr-defined]
    return out


def _views_stay_snapshots(out: Any, args: tuple[Any, ...]) -> Any:
    """A view of a snapshot (``p.data[0]``, ``.t()``) is one too, so a write to it is refused
    rather than lost; it never writes through (only the snapshot itself does)."""
    sources = {t.untyped_storage()._cdata: t for t in args if isinstance(t, ReadOnlySnapshot)}
    if not sources:
        return out

    def keep(o: Any) -> Any:
        if isinstance(o, torch.Tensor) and not isinstance(o, ReadOnlySnapshot):
            src = sources.get(o.untyped_storage()._cdata)
            if src is not None:
                return snapshot(o, type(src), src._chunkstar_of, src._chunkstar_when)
        return o

    if isinstance(out, (list, tuple)):
        return type(out)(keep(o) for o in out)
    return keep(out)


class ReadOnlyGradient(ReadOnlySnapshot):
    """A copy of a parameter's gradient, handed out by ``p.grad`` while the gradient
    sits in the parameter's slot (between ``engine.backward`` and ``optimizer.step``):
    norms and logging work; ``p.grad.zero_()`` (``module.zero_grad(set_to_none=False)``)
    zeroes the gradient in the slot through the engine's hook; other in-place changes
    (``clip_grad_norm_``) raise."""

    _chunkstar_when = "held in its chunk until optimizer.step()"
    _chunkstar_writes = frozenset({"zero_"})

    def _refusal(self, func: Callable[..., Any]) -> str:
        return (
            f"cannot {op_name(func)}() the gradient of {self._chunkstar_of}: chunkstar keeps gradients in its chunks "
            "and hands out read-only copies. Clip with the config key 'gradient_clipping' (global L2 norm, as "
            "torch.nn.utils.clip_grad_norm_), scale the loss instead of the gradients, or drop them with "
            "optimizer.zero_grad() or module.zero_grad()"
        )
