"""The device tier's chunk payload bytes as the device really holds them: growth, frees
deferred until their copy is done, and a meter of the device's peak.

Mechanism only, one piece of code for both devices (CUDA and the CPU virtual
device). Every payload storage on the device grows and shrinks through a
:class:`DeviceMemory`, so "how many bytes does the device hold for chunks" has
one answer, counted where the bytes are really allocated and freed, apart from
the chunk manager's bookkeeping of where chunks *are*.

Note [deferred free]: an eviction issues the copy of a chunk's device bytes to
its host buffer and returns at once (Note [pending copy] in chunk/chunk.py).
The device bytes may go back only once that copy has read them, so the free is
registered here with the copy's event (:meth:`DeviceMemory.free_after`). Until
it runs the bytes are *pending*: the device still holds them, budgets count
them (:attr:`held_bytes` = resident chunks + pending frees), and the CUDA probe
does not take them for non-model memory. Whoever polls first once the copy is
done frees them (:meth:`reap`, called at every move and every budget check),
from any thread, under one lock: on CUDA autograd runs the backward, and with
it every eviction and gradient offload of the backward, on a device thread of
its own; the CPU virtual device does the same (:mod:`chunkstar.device.virtual`).
When a budget needs the bytes before the copy is done, :meth:`settle` orders the
compute stream after the oldest copies and frees them: on CUDA a stream wait,
not a host sync (the block goes back to the compute stream's pool, and any
later compute-stream work that reuses it runs after the copy); on the CPU
virtual device the compute thread waits, as that thread is its stream. A chunk
brought back before its free ran reclaims its bytes (:meth:`reclaim`): the free
is dropped and nothing is allocated again.

Note [out of memory with frees pending]: the budget counts pending frees as held,
but the device's allocator may still run out below it: another process holds
part of the GPU, the caching allocator's blocks are fragmented, or the budget is
larger than the card gives. When a payload cannot grow (``torch.OutOfMemoryError``)
while frees are pending, settling them would give the bytes back, and the
allocator's own retry cannot (to it those blocks are still in use). So
:meth:`grow` settles every pending free (a stream wait on CUDA), empties the
allocator's cache on CUDA (``torch.cuda.empty_cache``: blocks cached for other
sizes go back to the driver; ``cudaFree`` synchronizes the device, so no copy
still reads a block it returns) and tries once more. Only when that fails too
does it raise, through :attr:`DeviceMemory.on_out_of_memory`: the chunk
manager's :class:`~chunkstar.errors.DeviceMemoryError` with its advice, never
a raw allocator error from inside a hook.

The meter (:attr:`peak_bytes`): on the CPU virtual device the peak over time of
the chunk bytes held plus the non-model bytes the memory probe sees live (the
probe reports every allocation it counts, :meth:`observe`); on CUDA the
allocator's own peak, which the probe folds in before it resets it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

__all__ = ["METER_ENV", "DeviceMemory", "PendingFree", "order_after"]

METER_ENV = "CHUNKSTAR_DEVICE_METER"
"""Set to 1, the CPU virtual device measures its non-model memory for the engine's whole life
(the memory probe held from the start), so the meter's peak covers every step, not only the
warm-up; the strict device (``CHUNKSTAR_STRICT_DEVICE=1``, the test suite's setting) does too."""


def order_after(event: Any) -> None:
    """Order the calling thread's compute stream after ``event`` (a copy event's ``order``:
    on CUDA a stream wait, without a host sync); events without one are waited for."""
    order = getattr(event, "order", None)
    if order is not None:
        order()
    else:
        event.wait()


class PendingFree:
    """The device bytes of a chunk whose copy out has not been seen done yet."""

    __slots__ = ("storage", "nbytes", "event", "live")

    def __init__(self, storage: torch.UntypedStorage, nbytes: int, event: Any) -> None:
        self.storage = storage
        self.nbytes = nbytes
        self.event = event  # the copy that reads the bytes (a CopyEvent)
        self.live = True  # not freed nor reclaimed yet


class DeviceMemory:
    def __init__(
        self,
        device: torch.device,
        *,
        limit: int | None = None,
        where: Callable[[], str] = lambda: "",
        scratch_in_flight: Callable[[], int] = lambda: 0,
        on_out_of_memory: Callable[[int, BaseException], BaseException] | None = None,
    ) -> None:
        """The owner (the chunk manager) hands in what it knows: the device's size, where the
        run is, the collectives' scratch in flight, and the error for a payload that cannot
        grow (each described with its attribute below)."""
        self.device = device
        self._lock = threading.Lock()
        self._pending: list[PendingFree] = []  # oldest first
        self.pending_bytes = 0
        """Bytes of frees registered and not run yet: still held by the device."""
        self.held_bytes = 0
        """Chunk payload bytes the device holds now: resident chunks and pending frees."""
        self.held_peak = 0
        """The largest :attr:`held_bytes` seen."""
        self.peak_bytes = 0
        """The meter: the largest held + non-model bytes seen (Note [deferred free])."""
        self.non_model_live: Callable[[], int] = lambda: 0
        """Non-model bytes live now, as the memory probe sees them (0 while nobody measures)."""
        self.before_held_change: Callable[[int], None] | None = None
        """Called with the held bytes before each change (the CUDA probe closes a window) ..."""
        self.after_held_change: Callable[[], None] | None = None
        """... and after it (the CUDA probe opens the next window)."""
        self.scratch_in_flight = scratch_in_flight
        """Device bytes of the collectives' temporaries in flight (under NCCL: Note [flat group
        buffers] in distributed/comm.py), the chunk manager's: budgets count them as scratch,
        so the CUDA probe counts them apart from non-model memory, as it does chunk payloads."""
        self.limit = limit
        """The device's size (the CPU virtual device's budget): the first time the meter goes
        over it is recorded in :attr:`first_overrun`."""
        self.first_overrun: str | None = None
        self.where = where
        """Where the run is now, for :attr:`first_overrun` (the chunk manager's cursor)."""
        self.frees_run = 0
        self.frees_settled = 0  # of them, run before their copy was seen done (a stream wait or a thread wait)
        self.reclaims = 0
        self.on_out_of_memory = on_out_of_memory
        """The error to raise when a payload of the given bytes still cannot grow after the retry
        (Note [out of memory with frees pending]; the chunk manager's DeviceMemoryError); None:
        the allocator's own."""
        self.out_of_memory_retries = 0
        """Growths the allocator refused at first and that were tried again after every pending
        free ran (Note [out of memory with frees pending])."""

    # ------------------------------------------------------------------ the meter
    def observe(self, non_model: int) -> None:
        """The probe counted a new allocation: ``non_model`` bytes live beside the chunks."""
        total = self.held_bytes + non_model
        if total > self.peak_bytes:
            self.peak_bytes = total
            if self.limit is not None and total > self.limit and self.first_overrun is None:
                self.first_overrun = (
                    f"{total} bytes held ({self.held_bytes} of chunk payloads, {self.pending_bytes} of them pending "
                    f"frees, {non_model} non-model) against {self.limit} at {self.where()}"
                )

    def observe_total(self, total: int) -> None:
        """A peak of everything the device held, read from the allocator (CUDA)."""
        if total > self.peak_bytes:
            self.peak_bytes = total

    def _resize(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Resize ``storage`` to ``nbytes`` and count the change; under the lock. The CUDA
        probe's window closes first, while the allocator still holds the old bytes, and the
        next one opens once it holds the new ones."""
        delta = nbytes - storage.nbytes()
        if self.before_held_change is not None:
            self.before_held_change(self.held_bytes)
        try:
            storage.resize_(nbytes)
        except BaseException:
            # nothing changed (the allocator refused): the window that closed opens again
            if self.after_held_change is not None:
                self.after_held_change()
            raise
        self.held_bytes += delta
        if self.after_held_change is not None:
            self.after_held_change()
        if delta > 0:
            if self.held_bytes > self.held_peak:
                self.held_peak = self.held_bytes
            self.observe(self.non_model_live())

    @contextlib.contextmanager
    def scratch_edge(self) -> Iterator[None]:
        """The collectives' scratch bytes change inside (a flat buffer is allocated and starts
        counting, or stops counting and is dropped): the CUDA probe closes its window before,
        as for chunk bytes, so no window's peak is set against the scratch of another instant."""
        with self._lock:
            if self.before_held_change is not None:
                self.before_held_change(self.held_bytes)
            try:
                yield
            finally:
                if self.after_held_change is not None:
                    self.after_held_change()

    # ------------------------------------------------------------------ growth and frees
    def grow(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give ``storage`` its ``nbytes`` on the device (allocated on the calling thread's stream).
        An allocator out of memory is retried once after every pending free ran and the cache
        was emptied, then raised as :attr:`on_out_of_memory` says (Note [out of memory with
        frees pending])."""
        if storage.nbytes() == nbytes:
            return
        try:
            with self._lock:
                self._resize(storage, nbytes)
            return
        except torch.OutOfMemoryError:
            pass  # retried below, outside this handler: its traceback keeps frames (and tensors) alive
        self.out_of_memory_retries += 1
        self.settle()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            with self._lock:
                self._resize(storage, nbytes)
        except torch.OutOfMemoryError as e:
            if self.on_out_of_memory is None:
                raise
            raise self.on_out_of_memory(nbytes, e) from e

    def free(self, storage: torch.UntypedStorage) -> None:
        """Free ``storage``'s device bytes now (nothing else reads them)."""
        if storage.nbytes() == 0:
            return
        with self._lock:
            self._resize(storage, 0)

    def free_after(self, storage: torch.UntypedStorage, event: Any) -> PendingFree | None:
        """Free ``storage``'s device bytes once ``event`` (the copy reading them) is done
        (Note [deferred free]); returns the pending free, None if it ran at once."""
        nbytes = storage.nbytes()
        if nbytes == 0:
            return None
        if event.done():
            self.free(storage)
            return None
        pf = PendingFree(storage, nbytes, event)
        with self._lock:
            self._pending.append(pf)
            self.pending_bytes += nbytes
        return pf

    def _run(self, pf: PendingFree) -> None:
        """Free ``pf`` (its copy is done or ordered before the compute stream); under the lock."""
        pf.live = False
        self.pending_bytes -= pf.nbytes
        self._resize(pf.storage, 0)
        self.frees_run += 1
        pf.event = None
        pf.storage = None  # type: ignore[assignment]

    def reap(self) -> int:
        """Run the pending frees whose copies are done; the bytes freed. Any thread."""
        if not self._pending:
            return 0
        freed = 0
        with self._lock:
            keep = []
            for pf in self._pending:
                if pf.live and pf.event.done():
                    freed += pf.nbytes
                    self._run(pf)
                elif pf.live:
                    keep.append(pf)
            self._pending = keep
        return freed

    def settle(self, nbytes: int | None = None) -> int:
        """Run pending frees, oldest first, until ``nbytes`` (default: all) are freed: the
        compute stream is ordered after each copy first (Note [deferred free]). The bytes freed."""
        freed = self.reap()
        while self._pending and (nbytes is None or freed < nbytes):
            with self._lock:
                if not self._pending:
                    break
                pf = self._pending[0]
                event = pf.event
            order_after(event)  # outside the lock: on the CPU device this waits for the copy thread
            with self._lock:
                if self._pending and self._pending[0] is pf:
                    self._pending.pop(0)
                    if pf.live:
                        freed += pf.nbytes
                        self.frees_settled += 1
                        self._run(pf)
        return freed

    def reclaim(self, pf: PendingFree) -> bool:
        """A chunk comes back before its free ran: keep its bytes (True), or False when the
        free already ran (the caller grows the storage again)."""
        with self._lock:
            if not pf.live:
                return False
            pf.live = False
            self.pending_bytes -= pf.nbytes
            self._pending = [p for p in self._pending if p is not pf]
            self.reclaims += 1
            return True

    def close(self) -> None:
        """Run every pending free (at the engine's end)."""
        self.settle()
