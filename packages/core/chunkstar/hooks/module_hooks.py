"""Module and gradient hooks: where training tells the runtime what it needs.

* forward pre-hook  -> ``on_pre_forward``: the module's parameters must be on
  the device now (a *moment* begins);
* forward hook      -> ``on_post_forward``: they may move again; and, when the
  output needs grad, a multi-grad hook on the output tensors (mode "any") fires
  ``on_pre_backward`` as soon as the first gradient reaches the module, i.e.
  before the module's own backward runs;
* post-accumulate-grad hook on every parameter -> ``on_grad``: its gradient is
  complete (autograd runs a leaf's AccumulateGrad once, after all its uses,
  tied uses included), so it can be folded into the parameter's slot.

Hooks go only on modules that own parameters directly, so nesting works and
each parameter is accessed by the module that registered it. Outputs may be
tensors, tuples, lists, dicts or Hugging Face ``ModelOutput`` (a dict).
Modules called several times, recomputation under activation checkpointing
(forward hooks fire again inside backward) and ``torch.no_grad()`` evaluation
(no backward hook is registered) all go through the same paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["HookTarget", "install_hooks"]


class HookTarget(Protocol):
    def on_pre_forward(self, module: str, indices: tuple[int, ...]) -> None: ...
    def on_post_forward(self, module: str, indices: tuple[int, ...]) -> None: ...
    def on_pre_backward(self, module: str, indices: tuple[int, ...]) -> None: ...
    def on_grad(self, index: int, param: torch.Tensor) -> None: ...


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, Mapping):
        for o in obj.values():
            yield from _tensors(o)


def install_hooks(model: nn.Module, index_of: Mapping[int, int], target: HookTarget) -> list[RemovableHandle]:
    """Hook every module owning parameters and every parameter needing grad.

    ``index_of`` maps ``id(param)`` to the parameter's slot index.
    """
    handles: list[RemovableHandle] = []
    for name, mod in model.named_modules():
        indices = tuple(sorted({index_of[id(p)] for p in mod.parameters(recurse=False)}))
        if not indices:
            continue
        label = name or type(mod).__name__

        def pre(_m: nn.Module, _args: Any, label: str = label, indices: tuple[int, ...] = indices) -> None:
            target.on_pre_forward(label, indices)

        def post(_m: nn.Module, _args: Any, output: Any, label: str = label, indices: tuple[int, ...] = indices) -> None:
            target.on_post_forward(label, indices)
            if not torch.is_grad_enabled():
                return
            outs = [t for t in _tensors(output) if t.requires_grad]
            if outs:
                torch.autograd.graph.register_multi_grad_hook(
                    outs, lambda _grads, label=label, indices=indices: target.on_pre_backward(label, indices), mode="any"
                )

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))

    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        idx = index_of[id(p)]
        handles.append(p.register_post_accumulate_grad_hook(lambda param, idx=idx: target.on_grad(idx, param)))
    return handles
