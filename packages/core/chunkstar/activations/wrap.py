"""Each block's forward, run as its activation policy says: mechanism.

The engine wraps the forward of every block (:func:`~chunkstar.activations.blocks.find_blocks`)
once, as an attribute of the block object, so neither the model's class nor its
code changes and :meth:`BlockActivations.remove` gives the model back as it was.
The wrapper reads the block's policy at each call, so a plan can change between
iterations without wrapping again:

* keep: the forward as it is;
* checkpoint: ``torch.utils.checkpoint.checkpoint`` around the forward, non-reentrant,
  with the RNG state preserved (a dropout draws the same mask again in the
  recomputation), so gradients equal keeping's; a key/value cache the forward
  would write is left out (:func:`_without_cache`);
* offload: the forward inside :meth:`HostOffload.block_call` (Note [activation offload]).

Without gradients (evaluation, ``torch.no_grad``, ``inference_mode``) nothing is
saved, and every block runs as kept. A block the model already checkpoints
(Hugging Face's ``gradient_checkpointing_enable()``) keeps its own
checkpointing: the wrapper runs inside it and does nothing more.

The block's own forward hooks (the engine's, which make its parameters resident)
sit outside the wrapped forward, in ``Module.__call__``; a recomputation runs the
forward alone, inside the block's backward, whose hooks have made them resident
again (Note [activation policies] in :mod:`chunkstar.activations`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from chunkstar.activations.offload import HostOffload
from chunkstar.config import ActivationPolicy

__all__ = ["BlockActivations"]


class BlockActivations:
    """The blocks of one model and the policy each runs under (the module docstring)."""

    def __init__(self, blocks: Sequence[nn.Module], policy: ActivationPolicy, offload: HostOffload) -> None:
        self.blocks = list(blocks)
        self.policies = [policy] * len(self.blocks)
        """Each block's policy, by position in :attr:`blocks` (read at every call)."""
        self.offload = offload
        self.recomputed_calls = 0
        self.offloaded_calls = 0
        self._originals: list[Callable[..., Any] | None] = []
        for i, block in enumerate(self.blocks):
            own = block.__dict__.get("forward")  # an instance forward the user set, kept under ours
            self._originals.append(own)
            block.forward = self._wrapped(i, own if own is not None else block.forward)  # type: ignore[method-assign]

    def _wrapped(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        block = self.blocks[index]

        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            policy = self.policies[index]
            # a block the model checkpoints itself (Hugging Face's GradientCheckpointingLayer, once
            # gradient_checkpointing_enable() ran) is recomputed already: read at each call
            if policy is ActivationPolicy.KEEP or not torch.is_grad_enabled() or getattr(block, "gradient_checkpointing", False):
                return forward(*args, **kwargs)
            if policy is ActivationPolicy.CHECKPOINT:
                self.recomputed_calls += 1
                return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **_without_cache(block, kwargs))
            self.offloaded_calls += 1
            with self.offload.block_call():
                return forward(*args, **kwargs)

        return run

    def model_checkpointed(self) -> int:
        """Blocks the model checkpoints itself now (Hugging Face's gradient checkpointing)."""
        return sum(1 for b in self.blocks if getattr(b, "gradient_checkpointing", False))

    def counts(self) -> dict[str, int]:
        """Blocks under each policy now (by the policies' names)."""
        out = {p.value: 0 for p in ActivationPolicy}
        for p in self.policies:
            out[p.value] += 1
        return out

    def remove(self) -> None:
        """Give every block its forward back."""
        for block, own in zip(self.blocks, self._originals):
            if own is not None:
                block.forward = own  # type: ignore[method-assign]
            else:
                block.__dict__.pop("forward", None)
        self._originals = [None] * len(self.blocks)


def _without_cache(block: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a recomputed block without a cache its forward would write.

    A decoder layer handed a key/value cache (T5's ``cache``, GPT-2's ``layer_past``, or
    ``use_cache=True``) writes it in the forward; replayed in the backward it would write
    it again, and read what the first forward wrote: torch's checkpoint then finds other
    tensors saved and stops. Hugging Face's own checkpointing drops them the same way (a
    layer that only reads a cache says so with ``_can_checkpoint_with_cache``); in training
    the cache is not read."""
    if getattr(block, "_can_checkpoint_with_cache", False):
        return kwargs
    out = dict(kwargs)
    if out.get("use_cache"):
        out["use_cache"] = False
    for name in ("cache", "layer_past"):
        if out.get(name) is not None:
            out[name] = None
    return out
