"""Counting what blocks save for their backward, without changing what they do: for the errors.

Under ``"policy": "keep"`` the blocks run as they are, and nothing would know
how much of a moment's non-model memory is their saved activations. While the
warm-up traces, a :class:`SavedCounter` watches each block call through a pack
hook that counts the storages saved (each once per call) and hands every tensor
back untouched, so a :class:`~chunkstar.errors.DeviceMemoryError` of the warm-up
can say how many of the bytes that did not fit were activations the blocks kept,
and what ``"auto"`` would do about them. The hooks are a block's forward pre-hook
and its forward hook (``always_call``, so a forward that raises still pops the
pack hook), off outside the warm-up: a run at its step time pays nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from chunkstar.activations.offload import MIN_OFFLOAD_BYTES

__all__ = ["SavedCounter"]


class SavedCounter:
    """Per block, the bytes its calls of the running iteration saved: in storages of at least
    :data:`~chunkstar.activations.offload.MIN_OFFLOAD_BYTES` (what offloading would move) and in all."""

    def __init__(self, blocks: Sequence[nn.Module], names: Sequence[str], device: torch.device, model_data: Any) -> None:
        self.names = list(names)
        self.device = torch.device(device)
        self._model_data = model_data
        self.counting = False
        """Count the calls now (the schedule's warm-up passes)."""
        self.large = [0] * len(self.names)
        self.total = [0] * len(self.names)
        self._open: list[tuple[int, Any, set[int]]] = []  # the running calls: block, hooks context, storages seen
        self._handles = []
        for i, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(lambda _m, _a, i=i: self._enter(i)))
            self._handles.append(block.register_forward_hook(lambda _m, _a, _o, i=i: self._exit(i), always_call=True))

    def reset(self) -> None:
        """A new iteration: count from zero."""
        self.large = [0] * len(self.names)
        self.total = [0] * len(self.names)

    def _enter(self, index: int) -> None:
        if not self.counting or not torch.is_grad_enabled():
            return
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.device == self.device and not isinstance(t, nn.Parameter) and not self._model_data(t):
                storage = t.untyped_storage()
                if storage._cdata not in seen:
                    seen.add(storage._cdata)
                    nbytes = storage.nbytes()
                    self.total[index] += nbytes
                    if nbytes >= MIN_OFFLOAD_BYTES:
                        self.large[index] += nbytes
            return t

        ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        ctx.__enter__()
        self._open.append((index, ctx, seen))

    def _exit(self, index: int) -> None:
        if self._open and self._open[-1][0] == index:
            _, ctx, _ = self._open.pop()
            ctx.__exit__(None, None, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
