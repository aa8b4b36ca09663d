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
from typing import Callable

from chunkstar.memory.tracer import ScheduleMode

__all__ = [
    "Overrun",
    "chunk_budget", "device_capacity", "memory_error_advice", "minimum_budget", "out_of_memory_advice", "room_target",
]  # fmt: skip


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


def chunk_budget(
    capacity: int, live: int, mode: ScheduleMode, in_model_pass: bool, traced_at_moment: Callable[[], int], traced_max: int
) -> int:
    """Bytes chunks may occupy on the device during the running moment (Note [budget per
    moment]): the capacity less the non-model bytes expected in it. ``live``: the non-model
    bytes measured now; ``traced_at_moment``: the frozen trace's figure for the running
    moment (read only when the mode budgets by it); ``traced_max``: its largest. Outside
    forward and backward (the optimizer step, between steps) and with no trace to trust,
    the live figure; a training pass on the trace, its moment's figure; an evaluation
    along the traced forward, the larger of the two (Note [evaluation budgets] in
    runtime/schedule.py); any other evaluation, the larger of live and the largest."""
    if not in_model_pass or not mode.trusts_trace:
        non_model = live
    elif mode is ScheduleMode.FOLLOWING:
        non_model = traced_at_moment()
    elif mode is ScheduleMode.EVALUATING_ALONG:
        non_model = max(live, traced_at_moment())
    else:  # EVALUATING_OFF
        non_model = max(live, traced_max)
    return capacity - non_model


def room_target(budget: int, mode: ScheduleMode, in_model_pass: bool) -> int:
    """Chunk bytes to make room down to when a moment begins (Note [budget per moment]).

    With no trace to trust (a warm-up pass, an iteration off the traced schedule, an
    evaluation among them) the budget only knows the non-model memory *now*, not what
    the module is about to allocate, so in forward and backward the device keeps
    nothing but what the moment needs: the target is 0 and every other movable chunk
    goes. That costs moves in the first micro-steps only and leaves the activations
    all the room there is."""
    return 0 if not mode.trusts_trace and in_model_pass else budget


def minimum_budget(chunk_bytes: int, non_model: int, slack: float) -> int:
    """The smallest ``device_memory_budget`` that holds ``chunk_bytes`` of chunks beside
    ``non_model`` bytes of non-model memory once the slack is kept free."""
    return math.ceil((chunk_bytes + non_model) / (1.0 - slack))


def memory_error_advice(free: int, biggest: tuple[str, int] | None) -> str:
    """What a :class:`~chunkstar.errors.DeviceMemoryError` for a moment's chunks that do not fit
    ``free`` chunk bytes advises; ``biggest``: the largest parameter among those chunks (its
    name and bytes), if any. A parameter larger than the free room cannot be helped by
    smaller chunks, so the advice then leaves them out."""
    if biggest is not None and biggest[1] > max(free, 0):
        name, nbytes = biggest
        return (
            f"one parameter alone, '{name}' ({nbytes} bytes), is larger than the free chunk memory, so smaller "
            "chunks cannot help: raise 'device_memory_budget', or lower the batch size or sequence length (or "
            "set 'activations': {\"policy\": \"checkpoint\"} or \"offload\") to shrink the non-model memory"
        )
    return (
        "raise 'device_memory_budget'; or lower the batch size or sequence length, or set 'activations': "
        "{\"policy\": \"checkpoint\"} or \"offload\", to shrink the non-model memory; or lower 'default_chunk_size' "
        "so this moment's working set needs fewer whole chunks"
    )


def out_of_memory_advice(free: int) -> str:
    """What a :class:`~chunkstar.errors.DeviceMemoryError` advises when the device's allocator
    ran out of memory below the budget, after every pending free ran and its cache was
    emptied (Note [out of memory with frees pending] in device/memory.py): the device gave
    less than the budget says it has, so the budget, not the model, is what to change first."""
    return (
        "the device's allocator ran out of memory although the budget had room for this, even after every "
        "pending free ran and its cache was emptied: the GPU gives this process less than "
        "'device_memory_budget' (another process holds part of it, or the budget is larger than the card), or "
        "its free memory is fragmented. Lower 'device_memory_budget' to what the GPU can give this process (or "
        "raise 'device_memory_slack'), or free the GPU of other processes; "
        + memory_error_advice(free, None)
    )


class Overrun:
    """A warm-up's allowance to go over the budget. While :attr:`measuring` (a warm-up pass:
    the schedule decides), a moment whose chunks do not fit is let through rather than
    refused, and the most chunk bytes a moment had to hold at once is kept, so the error at
    the end of the iteration names the smallest budget for all of it instead of failing at
    the first moment. The chunk manager asks (:meth:`let_through`), the schedule
    (:mod:`chunkstar.runtime.schedule`) turns it on and off and reads what it kept; built
    before both and handed to each."""

    def __init__(self) -> None:
        self.measuring = False
        self.required_peak = 0
        """The most chunk bytes a moment let through had to hold at once (since the last reset)."""

    def held_at_once(self, held: int) -> None:
        """A warm-up moment made its room by evicting all it could and still holds ``held``
        chunk bytes (its own, and what could not move: chunks in use, other ranks' gathered
        chunks, a group a reduction holds): kept like a moment let through, so the smallest
        budget the warm-up names holds them too, not only the moment's own chunks."""
        if self.measuring:
            self.required_peak = max(self.required_peak, held)

    def let_through(self, required: int) -> bool:
        """No room for a moment's chunks, ``required`` bytes of which must be held at once:
        whether to go over the budget (and keep ``required``)."""
        if self.measuring:
            self.required_peak = max(self.required_peak, required)
        return self.measuring
