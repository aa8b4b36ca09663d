"""Exceptions chunkstar raises on purpose.

Every error a user can cause carries a message that says what was wrong and
what to change; nothing here is raised for internal invariants (those use
``AssertionError`` / ``RuntimeError`` with a bug-report hint).
"""

from __future__ import annotations

__all__ = ["ConfigError", "DeviceMemoryError", "ChunkStateError", "HostMemoryError"]


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
        covers: str = "",
    ) -> None:  # fmt: skip
        self.device = device
        self.needed = needed
        self.free = free
        self.budget = budget
        self.where = where
        self.minimum = minimum
        """The smallest ``device_memory_budget`` (bytes) that holds what was measured, when known."""
        self.covers = covers
        """What ``minimum`` holds for, when it is a warm-up's: the paths through the model the
        warm-up has run so far (a run whose control flow changes can need more on another)."""
        least = (
            f" The smallest device_memory_budget that fits what was measured is {_fmt(minimum)} ({minimum} bytes)"
            + (f"; it holds for {covers}." if covers else ".")
            if minimum is not None
            else ""
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


class HostMemoryError(RuntimeError):
    """The host memory a run's plan needs is more than its budget (Note [host memory plan] in
    :mod:`chunkstar.memory.host`).

    Raised while the engine starts, *before* any chunk is allocated or any file created,
    so the process is left as it was: change what the message says and call again."""

    def __init__(self, needed: int, budget: int, parts: str, budget_from: str, advice: str) -> None:
        self.needed = needed
        """Host bytes the plan holds at most."""
        self.budget = budget
        """Host bytes it may hold (``host_memory_budget``, or what "auto" found)."""
        super().__init__(
            f"chunkstar's plan needs {_fmt(needed)} ({needed} bytes) of host memory, more than it may use: "
            f"{_fmt(budget)} ({budget_from}). The plan: {parts}. To fix: {advice}."
        )


class ChunkStateError(RuntimeError):
    """An operation was asked of a tensor in a state that does not allow it."""


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
