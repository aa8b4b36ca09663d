"""Parameter upcasts: within one module's forward, its parameters seen in another dtype.

Mechanism only: which modules, and in which dtype, is the policy's decision
(:mod:`chunkstar.placement.module_dtype`, Note [norm dtypes]).

Note [parameter upcast]: a forward pre-hook puts a differentiable copy of each
of the module's own floating parameters (``p.to(dtype)``) in the module's
``_parameters`` in place of the parameter, and a forward hook puts the
parameters back (``torch.func.functional_call`` swaps tensors in the same
place). So:

* the module's forward reads ``self.weight`` and gets the copy; its op saves
  the copy for backward, not a view of a param chunk, and the gradient flows
  through the cast into the parameter's own ``.grad`` in its own dtype, where
  the post-accumulate-grad hook takes it as for any parameter;
* the hooks are installed after the engine's module hooks
  (:mod:`chunkstar.hooks.module_hooks`): the pre-hook runs once the
  engine's has put the parameters in COMPUTE, so the copy reads the resident
  chunk without the parameter guard; the restoring hook is prepended, so it
  runs before the engine's post-forward, and with ``always_call``, so a forward
  that raises still leaves the module holding its parameters;
* outside the forward nothing changes: ``named_parameters()``, ``state_dict()``,
  the optimizer and the checkpoints see the parameter objects themselves;
* a recomputation under activation checkpointing fires the hooks again and
  makes fresh copies; calls nest (a stack of the saved parameters), and a
  copy of the model (``copy.deepcopy``) shares the hooks harmlessly: each call
  restores the module it swapped.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from chunkstar.hooks.module_hooks import EngineHook

__all__ = ["ParamUpcast", "install_upcasts"]


class ParamUpcast:
    """The pre/post-forward pair of one module: its floating parameters seen as ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        # (module, its parameters by name) of each call in flight, innermost last
        self._saved: list[tuple[nn.Module, dict[str, nn.Parameter]]] = []

    def pre(self, module: nn.Module, _args: Any) -> None:
        own = {n: p for n, p in module._parameters.items() if p is not None and p.is_floating_point()}
        self._saved.append((module, own))
        for n, p in own.items():
            # a plain tensor where the Parameter was, as functional_call puts one
            module._parameters[n] = p.to(self.dtype)  # type: ignore[assignment]

    def post(self, module: nn.Module, _args: Any, _output: Any) -> None:
        # nothing saved for this call when a pre-hook before ours raised (always_call runs us then too)
        if self._saved and self._saved[-1][0] is module:
            module._parameters.update(self._saved.pop()[1])


def install_upcasts(model: nn.Module, dtype_of: Callable[[nn.Module], torch.dtype | None]) -> list[RemovableHandle]:
    """Hook every module of ``model`` for which ``dtype_of`` names a dtype (Note [parameter
    upcast]); call it after the engine's module hooks are installed."""
    handles: list[RemovableHandle] = []
    for mod in model.modules():
        dtype = dtype_of(mod)
        if dtype is None:
            continue
        upcast = ParamUpcast(dtype)
        handles.append(mod.register_forward_pre_hook(EngineHook(upcast.pre)))
        handles.append(mod.register_forward_hook(EngineHook(upcast.post), prepend=True, always_call=True))
    return handles
