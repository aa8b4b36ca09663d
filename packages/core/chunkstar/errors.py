"""Exceptions chunkstar raises on purpose.

Every error a user can cause carries a message that says what was wrong and
what to change; nothing here is raised for internal invariants (those use
``AssertionError`` / ``RuntimeError`` with a bug-report hint).
"""

from __future__ import annotations

__all__ = ["ConfigError", "DeviceMemoryError", "ChunkStateError"]


class ConfigError(ValueError):
    """A config key is unknown, missing, or has a value outside what is allowed."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"config key '{key}': {message}")


class DeviceMemoryError(RuntimeError):
    """The device budget cannot hold what one moment of training needs.

    Raised by the engine *before* any allocation is attempted, so the process
    is left in a usable state (no allocator OOM deep inside a hook).
    """

    def __init__(
        self, device: str, needed: int, free: int, budget: int, where: str, minimum: int | None = None, advice: str = "",
        evaluation_minimum: int | None = None,
    ) -> None:  # fmt: skip
        self.device = device
        self.needed = needed
        self.free = free
        self.budget = budget
        self.where = where
        self.minimum = minimum
        """The smallest ``device_memory_budget`` (bytes) that holds what was measured, when known."""
        self.evaluation_minimum = evaluation_minimum
        """The smallest budget (bytes) under which evaluation forwards (``torch.no_grad``) after the
        warm-up fit too, when known and larger than ``minimum``: they plan every moment with the
        warm-up's largest non-model peak."""
        least = (
            f" The smallest device_memory_budget that fits what was measured is {_fmt(minimum)} ({minimum} bytes)."
            if minimum is not None
            else ""
        )
        if evaluation_minimum is not None:
            least += (
                f" Evaluation forwards (under torch.no_grad) after the warm-up plan every moment with the largest "
                f"non-model peak measured, so a run that evaluates needs at least {_fmt(evaluation_minimum)} "
                f"({evaluation_minimum} bytes)."
            )
        todo = advice or (
            "raise 'device_memory_budget'; or lower the batch size or sequence length, or enable activation "
            "checkpointing; or lower 'default_chunk_size' so a module's working set needs fewer whole chunks"
        )
        super().__init__(
            f"chunkstar cannot fit {where} on device '{device}': it needs {_fmt(needed)} "
            f"({needed} bytes) of chunk memory but only {_fmt(free)} ({free} bytes) is free "
            f"within the usable device memory of {_fmt(budget)} ({budget} bytes) after non-model memory "
            f"(activations, temporaries).{least} To fix: {todo}."
        )


class ChunkStateError(RuntimeError):
    """An operation was asked of a tensor in a state that does not allow it."""


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
