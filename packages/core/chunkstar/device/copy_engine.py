"""Copy engines: how chunk payloads travel between the host and the device tier.

Mechanism only ("streams and events, not syncs"). A copy engine takes a copy
``dst <- src`` and returns a :class:`CopyEvent`; whoever next reads or frees
either buffer waits on that event, never on the whole device. The device-specific
part is only this: issuing a copy (on a stream, or on a copy thread) and its
event. When the device bytes a copy to the host read are freed, who frees them
and how pending frees are counted is one piece of code both devices share
(Note [deferred free] in :mod:`chunkstar.device.memory`). Three implementations:

* :class:`SerialCopies` - the copy runs in the calling thread before it
  returns (``overlap: false``: the reference path of tests and benchmarks);
* :class:`CopyThread` - the CPU virtual device's copy engine: copies run in
  order on one worker thread per direction, overlapping the compute thread;
* :class:`CudaCopies` - CUDA: prefetches run on a copy stream and copies to
  the host on another, beside the compute stream, ordered by events. With
  ``overlap: false`` every copy stays on the compute stream.

Both CPU engines can emulate a PCIe-attached device: with a link bandwidth
each copy takes at least ``bytes / bandwidth`` (config ``device_link_bandwidth``),
and the debug setting ``CHUNKSTAR_DEBUG_COPY_DELAY_MS=lo-hi`` adds a random
delay before each copy, so a missing wait shows up on CPU as a wrong result.

Note [errors across workers]: a job that fails on a worker thread (a copy, an
update, a disk transfer) fails its event, and whoever waits on the event raises
:func:`relayed` of the error, its ``__cause__`` the original with the worker's
traceback. chunkstar's own errors keep their type and message: they already
say what failed and what to do, and their type is the API (``except
DiskTierError`` must catch a disk read that failed on an I/O thread, however
many workers the failure crossed: an update that waited for the read, then the
copy that waited for the update). Anything else (a bug, a torch error) becomes
a ``RuntimeError`` saying it failed on a worker thread. An error relayed again
relays the original, so the chain is never longer than one.
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

from chunkstar.device.threads import host_worker_width, ops_on_this_thread_only, set_ops_width

__all__ = [
    "DEBUG_DELAY_ENV",
    "CopyEngine",
    "CopyEvent",
    "CopyThread",
    "CudaCopies",
    "HostWorker",
    "InlineWorker",
    "Issued",
    "SerialCopies",
    "debug_delay_from_env",
    "make_copy_engine",
    "relayed",
]

DEBUG_DELAY_ENV = "CHUNKSTAR_DEBUG_COPY_DELAY_MS"


class CopyEvent(Protocol):
    def wait(self) -> None:
        """Return once the calling thread may use the copy's destination: for a copy to the
        host, once it is done; for a copy to a CUDA device, once the compute stream is
        ordered after it (no host sync)."""

    def order(self) -> None:
        """Order the compute stream after the copy: the next device work (a copy in, a
        kernel reusing the source's freed bytes) runs after it. CUDA: a stream wait, never a
        host sync; the CPU virtual device: the calling thread waits (it is the stream)."""

    def done(self) -> bool: ...


class CopyEngine(Protocol):
    def to_device(
        self, dst: torch.Tensor, src: torch.Tensor, *, prefetch: bool = False, after: CopyEvent | None = None
    ) -> CopyEvent:
        """Start ``dst.copy_(src)`` (1-D, equal sizes) from a host buffer the caller keeps
        alive, once ``after`` (host-side work on ``src``) is done; ``prefetch`` marks a copy
        nobody waits for yet."""
        ...

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        """Start ``dst.copy_(src)`` into a host buffer; ``src`` must stay allocated until the
        event is done (an eviction hands its free to :meth:`chunkstar.device.memory.DeviceMemory.free_after`)."""
        ...

    def close(self) -> None: ...


class _Done:
    """The event of a copy that finished before ``copy`` returned."""

    def wait(self) -> None:
        pass

    def order(self) -> None:
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
    """Copies in the calling thread: every copy is done when it returns."""

    def __init__(self, bandwidth: float | None = None, delay: tuple[float, float] | None = None) -> None:
        self._pace = _Pace(bandwidth, delay)

    def to_device(
        self, dst: torch.Tensor, src: torch.Tensor, *, prefetch: bool = False, after: CopyEvent | None = None
    ) -> CopyEvent:
        if after is not None:
            after.wait()
        self._pace.run(dst, src)
        return _DONE

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        self._pace.run(dst, src)
        return _DONE

    def close(self) -> None:
        pass


_RELAYED_FROM = "_chunkstar_relayed_from"  # the attribute of a relayed error naming its original


def _is_chunkstar_error(error: BaseException) -> bool:
    module = type(error).__module__
    return module == "chunkstar" or module.startswith("chunkstar.")


def relayed(error: BaseException, what: str = "a chunk copy or update") -> BaseException:
    """The exception to raise in a thread that waited for a job that failed with ``error``
    on a worker (Note [errors across workers]): a copy of a chunkstar error (same type,
    message and attributes), else a ``RuntimeError`` saying ``what`` failed on a worker
    thread; its ``__cause__`` is the original error, also when ``error`` was relayed before."""
    original: BaseException = getattr(error, _RELAYED_FROM, error)
    out: BaseException
    if _is_chunkstar_error(original):
        cls = type(original)
        out = cls.__new__(cls, *original.args)  # not cls(...): an __init__ takes its own arguments
        out.__dict__.update(original.__dict__)
    else:
        out = RuntimeError(f"chunkstar: {what} failed on a worker thread: {original!r}")
    setattr(out, _RELAYED_FROM, original)
    out.__cause__ = original
    return out


class Issued:
    """The event of work another thread issues later (a chunk's update, queued by the disk
    tier's step thread: Note [the step issued behind] in :mod:`chunkstar.runtime.disk_tier`):
    :meth:`wait` waits for it to be issued, then for the work itself; a failure to issue it
    is raised to the waiter."""

    def __init__(self) -> None:
        self._issued = threading.Event()
        self._event: CopyEvent | None = None
        self._error: BaseException | None = None

    def issue(self, event: CopyEvent | None) -> None:
        self._event = event
        self._issued.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._issued.set()

    def wait(self) -> None:
        self._issued.wait()
        if self._error is not None:
            raise relayed(self._error, "the disk tier's step")
        if self._event is not None:
            self._event.wait()

    order = wait  # host work: the calling thread waits

    def done(self) -> bool:
        return self._issued.is_set() and (self._event is None or self._event.done())


class _ThreadEvent:
    def __init__(self) -> None:
        self._flag = threading.Event()
        self.error: BaseException | None = None

    def wait(self) -> None:
        self._flag.wait()
        if self.error is not None:
            raise relayed(self.error)  # Note [errors across workers]

    def order(self) -> None:
        self.wait()  # the CPU virtual device: the calling thread is the compute stream

    def done(self) -> bool:
        return self._flag.is_set()


def _worker_loop(jobs: queue.SimpleQueue, device: torch.device | None) -> None:  # type: ignore[type-arg]
    if device is None or device.type == "cpu":
        # beside the compute thread, not competing with it for every core (Note [one OpenMP team])
        ops_on_this_thread_only()
    if device is not None and device.type == "cuda":
        # this thread waits on CUDA events (cudaEventSynchronize): on the engine's device, not
        # in a context of its own on GPU 0
        torch.cuda.set_device(device)
    while True:
        job = jobs.get()
        if job is None:
            return
        fn, after, event = job
        try:
            if after is not None:
                after.wait()
            with torch.no_grad():  # grad mode is per thread: chunk buffers are plain data here
                fn()
        except BaseException as e:  # handed to whoever waits on the event
            event.error = e
        finally:
            del fn, after, job  # the buffers may be freed as soon as the job is done
            event._flag.set()
            del event  # nor may this idle thread keep the last job's event (and what it holds) alive


def _stop_lane(jobs: queue.SimpleQueue, thread: threading.Thread) -> None:  # type: ignore[type-arg]
    jobs.put(None)
    if thread is not threading.current_thread():
        thread.join()


class _Lane:
    """One worker thread running jobs in the order they were queued."""

    def __init__(self, name: str, device: torch.device | None = None) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        self._thread = threading.Thread(target=_worker_loop, args=(self._jobs, device), name=name, daemon=True)
        self._thread.start()
        # The worker must not outlive the object that owns it, nor the interpreter: at exit
        # (finalize runs at exit too) its queued jobs finish before torch is torn down.
        self._finalizer = weakref.finalize(self, _stop_lane, self._jobs, self._thread)

    def submit(self, fn: Callable[[], None], after: CopyEvent | None = None) -> CopyEvent:
        if not self._finalizer.alive:  # its thread is gone: the job would never run, nor its waiters wake
            raise RuntimeError(f"chunkstar: work queued on the worker thread {self._thread.name} after it was closed")
        event = _ThreadEvent()
        self._jobs.put((fn, after, event))
        return event

    def close(self) -> None:
        self._finalizer()


class CopyThread:
    """The CPU virtual device's copy engine: one worker thread per direction (a PCIe
    link copies both ways at once), each running its copies in order.

    A worker holds references to both buffers until the copy is done; an evicted
    chunk's device bytes are freed by whoever polls the pending free after that,
    as on CUDA (Note [deferred free]), never by the copy thread. Torch ops on the workers
    run outside the compute thread's dispatch modes (they are thread-local), so
    the warm-up's memory probe does not count them. Copies of one chunk in
    opposite directions are ordered by the chunk (it waits for its pending copy
    before the next move)."""

    def __init__(self, bandwidth: float | None = None, delay: tuple[float, float] | None = None) -> None:
        self._pace = _Pace(bandwidth, delay)
        self._to_device = _Lane("chunkstar-copy-h2d")
        self._to_host = _Lane("chunkstar-copy-d2h")

    def to_device(
        self, dst: torch.Tensor, src: torch.Tensor, *, prefetch: bool = False, after: CopyEvent | None = None
    ) -> CopyEvent:
        pace = self._pace
        return self._to_device.submit(lambda: pace.run(dst, src), after)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        pace = self._pace
        return self._to_host.submit(lambda: pace.run(dst, src))

    def close(self) -> None:
        self._to_device.close()
        self._to_host.close()


class HostWorker:
    """Host-side work off the compute thread, in order: the optimizer's updates and
    gradient norms (``overlap: true``). Each job's event is set when it is done; a
    failure is raised to whoever waits on it. ``delay`` (the debug setting
    ``CHUNKSTAR_DEBUG_COPY_DELAY_MS``) sleeps a random time before each job, so a
    reader that forgot to wait for an update sees the old value."""

    def __init__(
        self, delay: tuple[float, float] | None = None, device: torch.device | None = None, width: int | None = None
    ) -> None:
        self._lane = _Lane("chunkstar-host-work", device)
        self._delay = delay
        self._rng = random.Random(1)
        # how wide its ops run once wide: torch's width, or with several processes per node, where
        # torchrun leaves torch one thread, the rank's share of the cores (Note [the rank's share of
        # the cores] in device/threads.py)
        self._width = host_worker_width() if width is None else max(1, width)
        # on the CPU device the worker starts narrow (Note [one OpenMP team]); on CUDA it is wide from
        # its first job (a new thread's OpenMP width is the process's: 1 under torchrun)
        self._narrow = device is None or device.type == "cpu"
        if not self._narrow:
            self._set_width()

    @property
    def threads(self) -> int:
        """The threads torch's ops run on in this worker's jobs (1 while narrow)."""
        return 1 if self._narrow else self._width

    def _set_width(self) -> None:
        width = self._width

        def wide() -> None:
            set_ops_width(width)

        self._lane.submit(wide)

    def widen(self) -> None:
        """From the next job on, run torch's ops at the worker's width: the frozen schedule
        gave the worker optimizer updates, whose throughput matters more than the compute
        thread's OpenMP spin (Note [one OpenMP team]). Once; nothing to do on CUDA."""
        if self._narrow:
            self._narrow = False
            self._set_width()

    def submit(self, fn: Callable[[], None], after: CopyEvent | None = None) -> CopyEvent:
        if self._delay is not None:
            pause = self._rng.uniform(*self._delay)

            def delayed() -> None:
                time.sleep(pause)
                fn()

            return self._lane.submit(delayed, after)
        return self._lane.submit(fn, after)

    def close(self) -> None:
        self._lane.close()


class InlineWorker:
    """The serial reference of :class:`HostWorker`: each job runs before ``submit`` returns."""

    def submit(self, fn: Callable[[], None], after: CopyEvent | None = None) -> CopyEvent:
        if after is not None:
            after.wait()
        with torch.no_grad():
            fn()
        return _DONE

    def widen(self) -> None:
        """The jobs run on the compute thread, at its width already."""

    @property
    def threads(self) -> int:
        """The threads torch's ops run on in these jobs: the compute thread's width."""
        return torch.get_num_threads()

    def close(self) -> None:
        pass


class _CudaEvent:
    """A copy to the device on a copy stream: the compute stream waits for it (no host sync)."""

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self._event = event
        self._device = device

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)

    order = wait

    def done(self) -> bool:
        return bool(self._event.query())

    def for_host(self) -> _CudaToHost:
        """The same copy as host-side work must wait for it: its source is a host buffer that
        host code (an update on the host worker) may write only once the copy has read it."""
        return _CudaToHost(self._event, self._device)


class _CudaToHost:
    """A device-to-host copy on the copy stream. Its readers are on the host, so
    :meth:`wait` synchronizes on it; :meth:`order` only makes the compute stream wait
    (a copy in of the same chunk, or a kernel reusing the bytes it read, runs after it)."""

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self._event = event
        self._device = device

    def wait(self) -> None:
        self._event.synchronize()

    def order(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)

    def done(self) -> bool:
        return bool(self._event.query())


class CudaCopies:
    """CUDA copies (``overlap: true``): prefetches (host to device) on a copy stream,
    device-to-host copies on another (a PCIe link copies both ways at once), each
    ordered after the compute stream's work so far and waited for by event: the
    compute stream waits for a prefetch before reading it, the host synchronizes on a
    copy to the host before reading it. The source of a copy to the host stays
    allocated until the copy is done (Note [deferred free]). Loads that were not
    prefetched run on the compute stream. Host-side work a copy must follow
    (``after``) is waited for in the calling thread: a stream cannot wait on a thread.

    Streams are per thread in torch: "the compute stream" is the calling thread's
    current stream (autograd's device thread uses the forward's stream).

    ``serial`` (``overlap: false``, the reference path): every copy on the compute
    stream, a copy to the host synchronized at once."""

    def __init__(self, device: torch.device, serial: bool = False) -> None:
        self.device = device
        self.serial = serial
        self.stream = None if serial else torch.cuda.Stream(device)  # prefetches (host to device)
        self.to_host_stream = None if serial else torch.cuda.Stream(device)  # evictions, gradient offloads

    def to_device(
        self, dst: torch.Tensor, src: torch.Tensor, *, prefetch: bool = False, after: CopyEvent | None = None
    ) -> CopyEvent:
        if after is not None:
            after.wait()
        if prefetch and self.stream is not None:
            # The destination was allocated on the compute stream, so the copy stream waits
            # for it first; the consumer waits on the event before reading (CopyEvent.wait).
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=src.is_pinned())
                event = torch.cuda.Event()
                event.record(self.stream)
            return _CudaEvent(event, self.device)
        if not src.is_pinned():
            dst.copy_(src)  # from pageable memory: the host waits for it
            return _DONE
        # on the compute stream, later than this call returns: host code writing the pinned source
        # (an update of the kept buffer) must wait for this event first (CopyEvent.for_host)
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return _CudaEvent(event, self.device)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        if self.to_host_stream is None or not dst.is_pinned():
            dst.copy_(src)
            torch.cuda.current_stream(self.device).synchronize()  # the host side reads it next
            return _DONE
        # after the kernels that wrote src; src's bytes stay allocated until the copy is done
        self.to_host_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.to_host_stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.to_host_stream)
        return _CudaToHost(event, self.device)

    def close(self) -> None:
        pass


def make_copy_engine(device: torch.device, overlap: bool, bandwidth: float | None) -> CopyEngine:
    """The copy engine for ``device``: CUDA streams, or on the CPU virtual device a copy
    thread (``overlap``) or the serial reference path, both paced by ``bandwidth`` (bytes/s)."""
    if device.type == "cuda":
        return CudaCopies(device, serial=not overlap)
    delay = debug_delay_from_env()
    return CopyThread(bandwidth, delay) if overlap else SerialCopies(bandwidth, delay)
