"""Budget arithmetic for the device tier: pure functions of numbers.

How many bytes the engine plans with, how many chunks may occupy in a moment,
how far room is made during warm-up, and the smallest budget that would hold
what was measured (the figure the memory errors name). Measuring belongs to
:mod:`chunkstar.memory.probes` (the CUDA figures are read there); acting on the
answers belongs to the chunk manager. No tensors, no devices: tests call these
with made-up numbers.
"""

from __future__ import annotations

import math

__all__ = ["device_capacity", "minimum_budget", "room_target"]


def device_capacity(budget: int | None, slack: float, usable: int | None = None) -> int:
    """Bytes the engine plans with, less the ``slack`` fraction kept free (config
    ``device_memory_slack``): the ``budget`` on the CPU virtual device (``usable`` None);
    on CUDA what the GPU gives this process (``usable``: free plus what torch already
    holds, :func:`chunkstar.memory.probes.cuda_usable_bytes`), capped by the budget."""
    if usable is None:
        assert budget is not None, "the CPU virtual device needs a device_memory_budget"
        full = budget
    else:
        full = min(budget or usable, usable)
    return int(full * (1.0 - slack))


def room_target(budget: int, safe_mode: bool, in_model_pass: bool) -> int:
    """Chunk bytes to make room down to when a moment begins (Note [budget per moment]).

    During a warm-up pass (or off the traced schedule) the budget only knows the
    non-model memory *now*, not what the module is about to allocate, so in forward
    and backward the device keeps nothing but what the moment needs: the target is 0
    and every other movable chunk goes. That costs moves in the first micro-steps
    only and leaves the activations all the room there is."""
    return 0 if safe_mode and in_model_pass else budget


def minimum_budget(chunk_bytes: int, non_model: int, slack: float) -> int:
    """The smallest ``device_memory_budget`` that holds ``chunk_bytes`` of chunks beside
    ``non_model`` bytes of non-model memory once the slack is kept free."""
    return math.ceil((chunk_bytes + non_model) / (1.0 - slack))
