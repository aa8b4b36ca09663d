"""A real out-of-memory error while deferred frees are pending (Note [out of memory with frees
pending] in chunkstar/device/memory.py; issue 30, item 7).

The allocator may refuse a payload below the budget (another process on the GPU, fragmentation)
while evictions' frees still wait for their copies; settling them gives the bytes back, which
the allocator's own retry cannot do. So a growth that fails settles every pending free, empties
the cache (on CUDA), tries once more, and only then raises, as the usual ``DeviceMemoryError``
with its advice. No GPU here: the CUDA branch runs over fake storages and a monkeypatched
``torch.cuda.empty_cache``; the engine-level tests refuse growths on the CPU virtual device.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import chunkstar
from chunkstar.device.copy_engine import SerialCopies
from chunkstar.device.memory import DeviceMemory
from chunkstar.errors import DeviceMemoryError
from chunkstar.runtime import engine as engine_module

from tests.core._models import CASES, assert_losses_close, engine_config, eviction_budget, train_engine, train_reference

STEPS = 4


class _Storage:
    """Stands in for a device payload's ``UntypedStorage``: ``resize_`` asks ``allocate``, which
    raises ``torch.OutOfMemoryError`` as the CUDA caching allocator does when it has no room."""

    def __init__(self, allocate: Callable[[int], None], nbytes: int = 0) -> None:
        self._n = nbytes
        self._allocate = allocate

    def nbytes(self) -> int:
        return self._n

    def resize_(self, n: int) -> None:
        if n > self._n:
            self._allocate(n - self._n)
        self._n = n


class _CopyOut:
    """A copy to the host still running: a poll never sees it done; ordering after it is a stream wait."""

    def __init__(self) -> None:
        self.ordered = False

    def done(self) -> bool:
        return False

    def wait(self) -> None:
        self.ordered = True

    def order(self) -> None:
        self.ordered = True


class _Card:
    """A GPU of ``size`` bytes: what the allocator has handed out (the pending frees' bytes
    included, until they run) and the calls of ``empty_cache``."""

    def __init__(self, memory: DeviceMemory, size: int) -> None:
        self.memory = memory
        self.size = size
        self.empty_cache_calls = 0

    def allocate(self, n: int) -> None:
        if self.memory.held_bytes + n > self.size:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} bytes.")

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1


def _cuda_memory(monkeypatch: pytest.MonkeyPatch, size: int) -> tuple[DeviceMemory, _Card]:
    memory = DeviceMemory(torch.device("cuda"))  # builds nothing on the device
    card = _Card(memory, size)
    monkeypatch.setattr(torch.cuda, "empty_cache", card.empty_cache)
    return memory, card


def test_a_growth_the_allocator_refuses_while_frees_are_pending_settles_them_and_succeeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory, card = _cuda_memory(monkeypatch, size=3000)
    evicted = _Storage(card.allocate)
    memory.grow(evicted, 2000)  # type: ignore[arg-type]
    copy_out = _CopyOut()
    assert memory.free_after(evicted, copy_out) is not None  # type: ignore[arg-type]
    assert memory.pending_bytes == 2000 and memory.held_bytes == 2000
    incoming = _Storage(card.allocate)
    memory.grow(incoming, 2000)  # type: ignore[arg-type]  # 4000 > 3000 until the pending free runs
    assert incoming.nbytes() == 2000 and evicted.nbytes() == 0
    assert copy_out.ordered  # the compute stream was ordered after the copy before its bytes went back
    assert memory.pending_bytes == 0 and memory.held_bytes == 2000
    assert card.empty_cache_calls == 1 and memory.out_of_memory_retries == 1 and memory.frees_settled == 1


def test_a_growth_still_refused_after_the_retry_raises_the_hooks_error_and_tries_once(monkeypatch: pytest.MonkeyPatch) -> None:
    memory, card = _cuda_memory(monkeypatch, size=1000)
    made: list[tuple[int, BaseException]] = []

    def on_out_of_memory(nbytes: int, error: BaseException) -> BaseException:
        made.append((nbytes, error))
        return DeviceMemoryError(device="cuda", needed=nbytes, free=0, budget=1000, where="a test", advice="x")

    memory.on_out_of_memory = on_out_of_memory
    storage = _Storage(card.allocate)
    with pytest.raises(DeviceMemoryError) as info:
        memory.grow(storage, 4000)  # type: ignore[arg-type]
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert [n for n, _ in made] == [4000] and card.empty_cache_calls == 1 and memory.out_of_memory_retries == 1
    assert storage.nbytes() == 0 and memory.held_bytes == 0
    memory.on_out_of_memory = None  # no hook: the allocator's own error
    with pytest.raises(torch.OutOfMemoryError):
        memory.grow(storage, 4000)  # type: ignore[arg-type]


def test_a_refused_growth_reopens_the_probes_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA probe closes a window before each change of the chunk bytes and opens the next
    after it; a change the allocator refused must open it again (else the next window's peak
    starts from a stale reset)."""
    memory, card = _cuda_memory(monkeypatch, size=1000)
    edges: list[str] = []
    memory.before_held_change = lambda held: edges.append("close")
    memory.after_held_change = lambda: edges.append("open")
    with pytest.raises(torch.OutOfMemoryError):
        memory.grow(_Storage(card.allocate), 2000)  # type: ignore[arg-type]
    assert edges == ["close", "open", "close", "open"]


# ---------------------------------------------------------------------------- through the engine


class _LateCopies(SerialCopies):
    """Copies at once, but a copy to the host is never seen done by a poll: every eviction's
    free stays pending until something settles it (the slowest copies there can be)."""

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        super().to_host(dst, src)
        return _CopyOut()


def _refusing(monkeypatch: pytest.MonkeyPatch, refuse: Callable[[DeviceMemory, int], bool]) -> list[int]:
    """Growths of the engine's payloads raise ``torch.OutOfMemoryError`` where ``refuse(memory,
    delta)`` says so (a card that is full); returns the list of refused sizes."""
    refused: list[int] = []
    resize = DeviceMemory._resize

    def guarded(self: DeviceMemory, storage: torch.UntypedStorage, nbytes: int) -> None:
        delta = nbytes - storage.nbytes()
        if delta > 0 and refuse(self, delta):
            refused.append(delta)
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {delta} bytes.")
        resize(self, storage, nbytes)

    monkeypatch.setattr(DeviceMemory, "_resize", guarded)
    monkeypatch.setattr(engine_module, "make_copy_engine", lambda device, overlap, bandwidth: _LateCopies(bandwidth))
    return refused


def test_training_goes_on_when_the_allocator_has_room_only_once_the_pending_frees_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding: an out-of-memory error while frees were pending ended the run. A card with no
    room beside the pending frees: every growth fails until they are settled, and the run
    trains exactly as PyTorch does."""
    refused = _refusing(monkeypatch, lambda memory, delta: memory.pending_bytes > 0)
    case = CASES["gpt2"]
    want = train_reference(case, STEPS)
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config("fp32", budget=eviction_budget(case.build(), torch.float32)))
    got = train_engine(engine, optimizer, case, STEPS)
    assert_losses_close(got, want, 1e-5, "gpt2 under out-of-memory retries")
    stats = engine.stats()
    assert refused and stats["device_out_of_memory_retries"] == len(refused), (refused, stats)
    assert stats["deferred_frees_waited"] > 0


def test_an_allocator_that_stays_out_of_memory_raises_device_memory_error_with_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES["gpt2"]
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config("fp32", budget=eviction_budget(case.build(), torch.float32)))
    train_engine(engine, optimizer, case, 3)  # the schedule is frozen: chunks move every step
    refused = _refusing(monkeypatch, lambda memory, delta: True)
    with pytest.raises(DeviceMemoryError) as info:
        train_engine(engine, optimizer, case, range(3, 4))
    message = str(info.value)
    assert "allocator said: CUDA out of memory" in message and "device_memory_budget" in message, message
    assert "even after every pending free ran and its cache was emptied" in message, message
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert len(refused) == 2 and engine.stats()["device_out_of_memory_retries"] == 1  # tried once more, then raised
