"""Copy engines: how chunk payloads travel between the host and the device tier.

Mechanism only (DESIGN §11, "streams and events, not syncs"). A copy engine
takes a copy ``dst <- src`` and returns a :class:`CopyEvent`; whoever next
reads or frees either buffer waits on that event, never on the whole device.
An optional ``then`` callback runs once the copy is done, in the engine's own
order (an eviction frees the device bytes it copied from there: a deferred
free). Three implementations:

* :class:`SerialCopies` - the copy runs in the calling thread before ``copy``
  returns (``overlap: false``: the reference path of tests and benchmarks);
* :class:`CopyThread` - the CPU virtual device's copy engine: copies run in
  order on one worker thread, overlapping the compute thread (two cores here);
* :class:`CudaCopies` - CUDA: host-to-device copies of prefetches run on a copy
  stream beside the compute stream and are ordered by events; the other copies
  stay on the compute stream (a device-to-host copy is waited for before its
  device bytes are freed).

Both CPU engines can emulate a PCIe-attached device: with a link bandwidth
each copy takes at least ``bytes / bandwidth`` (config ``device_link_bandwidth``),
and the debug setting ``CHUNKSTAR_DEBUG_COPY_DELAY_MS=lo-hi`` adds a random
delay before each copy, so a missing wait shows up on CPU as a wrong result.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
import weakref
from typing import Callable, Protocol

import torch

__all__ = [
    "DEBUG_DELAY_ENV",
    "CopyEngine",
    "CopyEvent",
    "CopyThread",
    "CudaCopies",
    "SerialCopies",
    "debug_delay_from_env",
    "make_copy_engine",
]

DEBUG_DELAY_ENV = "CHUNKSTAR_DEBUG_COPY_DELAY_MS"


class CopyEvent(Protocol):
    def wait(self) -> None:
        """Return once the copy (and its ``then``) is done; on CUDA, order the compute stream after it."""

    def done(self) -> bool: ...


class CopyEngine(Protocol):
    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, *, then: Callable[[], None] | None = None, prefetch: bool = False
    ) -> CopyEvent:
        """Start ``dst.copy_(src)`` (1-D tensors of equal size); ``prefetch`` marks a copy nobody waits for yet."""
        ...

    def close(self) -> None: ...


class _Done:
    """The event of a copy that finished before ``copy`` returned."""

    def wait(self) -> None:
        pass

    def done(self) -> bool:
        return True


_DONE = _Done()


def debug_delay_from_env() -> tuple[float, float] | None:
    """``CHUNKSTAR_DEBUG_COPY_DELAY_MS`` as (low, high) seconds: ``"5"`` or ``"0-20"``; unset or empty: None."""
    raw = os.environ.get(DEBUG_DELAY_ENV, "").strip()
    if not raw:
        return None
    try:
        lo_s, _, hi_s = raw.partition("-")
        lo, hi = float(lo_s), float(hi_s or lo_s)
    except ValueError:
        raise ValueError(f"{DEBUG_DELAY_ENV}={raw!r}: expected milliseconds as 'N' or 'LOW-HIGH', e.g. '0-20'") from None
    if not (0 <= lo <= hi <= 60_000):
        raise ValueError(f"{DEBUG_DELAY_ENV}={raw!r}: expected 0 <= LOW <= HIGH <= 60000 milliseconds")
    return lo / 1e3, hi / 1e3


class _Pace:
    """The emulated link: a random debug delay before a copy, and a floor of bytes/bandwidth on its duration."""

    def __init__(self, bandwidth: float | None, delay: tuple[float, float] | None, seed: int = 0) -> None:
        self.bandwidth = bandwidth
        self.delay = delay
        self._rng = random.Random(seed)

    def run(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.delay is not None:
            time.sleep(self._rng.uniform(*self.delay))
        t0 = time.perf_counter()
        with torch.no_grad():
            dst.copy_(src)
        if self.bandwidth:
            rest = src.numel() * src.element_size() / self.bandwidth - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)


class SerialCopies:
    """Copies in the calling thread: every copy is done when ``copy`` returns."""

    def __init__(self, bandwidth: float | None = None, delay: tuple[float, float] | None = None) -> None:
        self._pace = _Pace(bandwidth, delay)

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, *, then: Callable[[], None] | None = None, prefetch: bool = False
    ) -> CopyEvent:
        self._pace.run(dst, src)
        if then is not None:
            then()
        return _DONE

    def close(self) -> None:
        pass


class _ThreadEvent:
    def __init__(self) -> None:
        self._flag = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        self._flag.wait()
        if self.error is not None:
            raise RuntimeError(f"chunkstar: a chunk copy failed on the copy thread: {self.error!r}") from self.error

    def done(self) -> bool:
        return self._flag.is_set()


def _copy_worker(jobs: queue.SimpleQueue, pace: _Pace) -> None:  # type: ignore[type-arg]
    while True:
        job = jobs.get()
        if job is None:
            return
        dst, src, then, event = job
        try:
            pace.run(dst, src)
            if then is not None:
                then()
        except BaseException as e:  # handed to whoever waits on the event
            event.error = e
        finally:
            del dst, src, then, job  # the buffers may be freed as soon as the copy is done
            event._flag.set()


class CopyThread:
    """The CPU virtual device's copy engine: one worker thread runs the copies in order.

    The worker holds references to both buffers until the copy is done, so a
    caller may drop its own (an evicted chunk's device bytes are freed by the
    ``then`` callback, on the worker, after the copy). Torch ops on the worker
    run outside the compute thread's dispatch modes (they are thread-local), so
    the warm-up's memory probe does not count them."""

    def __init__(self, bandwidth: float | None = None, delay: tuple[float, float] | None = None) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        self._thread = threading.Thread(
            target=_copy_worker, args=(self._jobs, _Pace(bandwidth, delay)), name="chunkstar-copy", daemon=True
        )
        self._thread.start()
        # the worker must not outlive the engine that owns this object
        self._finalizer = weakref.finalize(self, self._jobs.put, None)

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, *, then: Callable[[], None] | None = None, prefetch: bool = False
    ) -> CopyEvent:
        event = _ThreadEvent()
        self._jobs.put((dst, src, then, event))
        return event

    def close(self) -> None:
        self._finalizer()


class _CudaEvent:
    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self._event = event
        self._device = device

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)

    def done(self) -> bool:
        return bool(self._event.query())


class CudaCopies:
    """CUDA: prefetches (host to device) on a copy stream ordered by events; other copies
    on the compute stream, where later kernels are ordered after them. A device-to-host
    copy is synchronous: its ``then`` (freeing the device bytes) and the host-side
    readers (CPU Adam, state_dict) need it finished."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # prefetch copies run here, overlapping the compute stream's kernels
        self.stream = torch.cuda.Stream(device)

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, *, then: Callable[[], None] | None = None, prefetch: bool = False
    ) -> CopyEvent:
        if prefetch and dst.device.type == "cuda" and src.device.type == "cpu":
            # The destination was allocated on the compute stream, so the copy stream waits
            # for it first; the consumer waits on the event before reading (CopyEvent.wait).
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=src.is_pinned())
                event = torch.cuda.Event()
                event.record(self.stream)
            if then is not None:
                then()
            return _CudaEvent(event, self.device)
        dst.copy_(src, non_blocking=src.is_pinned() and dst.device.type == "cuda")
        if dst.device.type == "cpu" and src.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the host side reads it next
        if then is not None:
            then()
        return _DONE

    def close(self) -> None:
        pass


def make_copy_engine(device: torch.device, overlap: bool, bandwidth: float | None) -> CopyEngine:
    """The copy engine for ``device``: CUDA streams, or on the CPU virtual device a copy
    thread (``overlap``) or the serial reference path, both paced by ``bandwidth`` (bytes/s)."""
    if device.type == "cuda":
        return CudaCopies(device)
    delay = debug_delay_from_env()
    return CopyThread(bandwidth, delay) if overlap else SerialCopies(bandwidth, delay)
