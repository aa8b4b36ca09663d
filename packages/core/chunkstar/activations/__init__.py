"""Activations as data the engine places: per block, keep, recompute or offload.

Note [activation policies]: the engine manages model data in chunks and
measures everything else on the device as non-model memory, activations first.
This package lets it decide what a block's forward saves for the backward
(config ``activations``): keep it on the device (PyTorch's own behaviour, the
default), recompute it (non-reentrant checkpointing around the block), or
offload it to host memory (``saved_tensors_hooks``: Note [activation offload]
in :mod:`.offload`). The unit is a block, a repeated layer found on the model
as it is (:func:`find_blocks`), so a Hugging Face model needs no
``gradient_checkpointing_enable()`` and no change of its code.

All three give the same gradients as plain PyTorch: recomputation replays the
forward with the RNG state it had, and an offloaded tensor comes back with the
bytes it left with. The memory trace measures what a policy leaves on the
device like any other non-model memory, so budgets, eviction and prefetch
follow it as they follow activations today.

Each block's forward is wrapped (:class:`BlockActivations`, mechanism); which
policy each block runs is the config's, one for every block, or under
``"auto"`` the plan's (:func:`~chunkstar.activations.plan.plan_activations`,
policy, Note [activation plan]), made from the warm-up's measurements by the
runtime (:mod:`chunkstar.runtime.activation_planning`). Under ``"keep"`` a
:class:`~chunkstar.activations.measure.SavedCounter` counts what the blocks
save during the warm-up, for the errors only.
"""

from chunkstar.activations.blocks import find_blocks, repeated_classes
from chunkstar.activations.offload import MIN_OFFLOAD_BYTES, HostOffload
from chunkstar.activations.wrap import BlockActivations

__all__ = ["MIN_OFFLOAD_BYTES", "BlockActivations", "HostOffload", "find_blocks", "repeated_classes"]
