"""Compiled blocks: a module under ``torch.compile`` is hooked as one unit, from outside.

Users compile a model's blocks the way torchtitan and FSDP2 recipes do
(``for block in model.transformer.h: block.compile()`` inside ``model_func``),
or replace a block by ``torch.compile(block)`` (an ``OptimizedModule``). Module
hooks cannot stay per-module inside such a block: ``block.compile()`` compiles
``Module._call_impl``, so the hooks of the block and of everything in it would be
traced by Dynamo (the chunk manager's Python, which cannot be compiled).

Note [compiled units]:
* The outermost compiled module of a subtree is a *unit*. It is one hooked module
  whose own parameters are all the parameters of its subtree; nothing inside it
  is hooked. Its pre- and post-forward targets run around the compiled call, in
  plain Python, by replacing the callable the module calls (``_compiled_call_impl``
  for ``block.compile()``, ``forward`` for an ``OptimizedModule``). So a compiled
  block's moment brings all its chunks, and the compiled graph sees only plain
  parameters in COMPUTE, with no guard (Note [parameter guard]) and no hook in it.
* Backward is hooked as for any module: a multi-grad hook on the unit's outputs
  brings its chunks back before the compiled backward runs, and gradients still
  reach every parameter's post-accumulate-grad hook.
* In the first warm-up pass (and in every iteration of a run that went
  unscheduled) a unit calls its module's *eager* forward: the parameter guard
  then sees reads of parameters outside the unit, which join its access set.
  The second warm-up pass runs the compiled call (its graphs are captured then),
  so the trace keeps the larger of the eager and the compiled peaks of each
  moment: a compiled block's backward may hold more than the eager one (the
  strict virtual device's meter saw tests/core/hooks/test_compile.py's GPT-2 under
  inductor hold 2.49 MB against a 2.07 MB budget planned from eager peaks alone,
  first over at a block's backward), so eager peaks alone would go over the
  budget on every step. The CPU probe's dispatch mode sets
  ``ignore_compile_internals``, so Dynamo compiles under it (without that it
  marks ``Module._call_impl`` to skip, for every compiled block, for good).
* A copy of the model (``copy.deepcopy`` for an EMA) gets no unit: the copy's
  module runs eager, since the compiled callable belongs to the original.

This module is mechanism only: which calls may run compiled is the runtime's
decision (:meth:`UnitTarget.run_compiled`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from torch import nn

__all__ = ["CompiledUnit", "UnitHandle", "UnitTarget", "compiled_modules", "is_compiled"]


class UnitTarget(Protocol):
    def on_pre_forward(self, module_key: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None: ...
    def on_post_forward(self, module_key: int, output: Any) -> None: ...
    def run_compiled(self) -> bool: ...


def _optimized_module_class() -> type | None:
    # torch._dynamo is imported by torch.compile: without it nothing can be compiled yet,
    # and importing it here would cost every engine start a second
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None) if eval_frame is not None else None


def is_compiled(mod: nn.Module) -> bool:
    """Whether ``mod`` runs a compiled forward: ``mod.compile()`` or ``torch.compile(mod)``."""
    if getattr(mod, "_compiled_call_impl", None) is not None:
        return True
    opt = _optimized_module_class()
    return opt is not None and isinstance(mod, opt)


def compiled_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The outermost compiled modules of ``model`` (qualified name, module), in module order."""
    inside: list[str] = []
    for name, mod in model.named_modules():
        if any(name.startswith(p) for p in inside):
            continue
        if is_compiled(mod):
            inside.append(f"{name}." if name else "")
            yield name, mod


@dataclass
class UnitHandle:
    """Puts the module's own compiled callable back (like a hook's ``RemovableHandle``)."""

    module: nn.Module
    attr: str
    original: Any

    def remove(self) -> None:
        if isinstance(self.module.__dict__.get(self.attr), CompiledUnit):
            setattr(self.module, self.attr, self.original)


class CompiledUnit:
    """The callable a compiled module calls in place of its compiled forward: the
    engine's pre-forward target, the compiled (or, while the engine measures, the
    eager) forward, the post-forward target (Note [compiled units])."""

    def __init__(self, key: int, compiled: Callable[..., Any], eager: Callable[..., Any], target: UnitTarget) -> None:
        self.key = key
        self.compiled = compiled
        self.eager = eager
        self.target = target
        self.compiled_calls = 0
        """Calls routed to the compiled forward (the rest ran eager); Dynamo itself may still
        fall back to eager inside, e.g. under non-reentrant activation checkpointing."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        target = self.target
        subs = target.on_pre_forward(self.key, args, kwargs)
        if subs is not None:
            args, kwargs = subs
        if target.run_compiled():
            self.compiled_calls += 1
            out = self.compiled(*args, **kwargs)
        else:
            out = self.eager(*args, **kwargs)
        target.on_post_forward(self.key, out)
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # a copied module runs eager (Note [compiled units])

    def __reduce__(self) -> Any:
        raise TypeError(
            "a model wrapped by a chunkstar engine cannot be pickled whole (torch.save(model)): its parameters live "
            "in the engine's chunks. Save torch.save(model.state_dict()), model.save_pretrained(...) for a Hugging "
            "Face model, or engine.save_checkpoint(dir) to resume training"
        )

    @staticmethod
    def install(key: int, mod: nn.Module, target: UnitTarget) -> tuple[CompiledUnit, UnitHandle]:
        """Route ``mod``'s compiled calls through a unit."""
        compiled: Callable[..., Any] | None = getattr(mod, "_compiled_call_impl", None)
        eager: Callable[..., Any]
        if compiled is not None:
            # mod.compile(): Module._wrapped_call_impl calls _compiled_call_impl (hooks and all compiled)
            attr, eager = "_compiled_call_impl", mod._call_impl
        else:
            # torch.compile(mod): the OptimizedModule's forward is the compiled call of the original
            # module (its hooks included); the eager call is the original module itself
            attr, compiled, eager = "forward", mod.forward, mod._orig_mod  # type: ignore[assignment]
        unit = CompiledUnit(key, compiled, eager, target)
        handle = UnitHandle(mod, attr, mod.__dict__.get(attr, compiled))
        # object.__setattr__: OptimizedModule forwards attributes it does not own to the original module
        object.__setattr__(mod, attr, unit)
        return unit, handle
