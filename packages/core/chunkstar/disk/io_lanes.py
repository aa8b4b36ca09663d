"""Asynchronous chunk reads and writes: the disk tier's read-ahead lane and write-behind lane.

Mechanism only (docs/design.md, 'The data path' and 'The disk tier'): a :class:`DiskLanes` queues transfers of
:class:`~chunkstar.disk.files.ChunkFiles` chunks on two lanes, one for
reads and one for writes (a disk reads and writes at once, and a write behind
must not hold up the read ahead), each starting its jobs in the order they were
queued: the write lane one at a time, the read lane two at a time (Note [two
reads at once]). Each transfer returns an event with ``wait()`` and
``done()`` (a :class:`~chunkstar.device.copy_engine.CopyEvent`), so a consumer
waits for one chunk, never for the disk. What to read ahead and how far is
not decided here: the runtime does, bounded by the host buffers of
:class:`~chunkstar.disk.staging.StagingBuffers`.

Ordering is the caller's to state: ``after=`` makes a job wait for an event
first (a write-behind waits for the optimizer's update of its buffer; a read
of a chunk whose write-behind is still queued waits for that write). An
``after`` must belong to another lane or be queued earlier on this one: a lane
waiting for a later job of its own would wait forever. The debug setting
``CHUNKSTAR_DEBUG_COPY_DELAY_MS=lo-hi`` (as for the copy engines) sleeps a
random time before each transfer, so a missing wait shows up in tests as a
wrong result rather than on a customer's disk.

A transfer that fails raises, to everyone who waits on its event, a
:class:`~chunkstar.disk.errors.DiskTierError` that names the file (a full disk
stays a :class:`~chunkstar.disk.errors.DiskFullError`; Note [errors across
workers] in :mod:`chunkstar.device.copy_engine`), and so does one whose
``after`` failed: it is not done. Every failure is also handed to
``on_failure`` on the lane thread (the runtime fails its staging pool with
it, so that the step waiting there hears of it at once). The worker carries
on with the next job: the run is failing, but its other events still resolve,
so no waiter, and no :meth:`DiskLanes.close`, waits forever. A write's
``then`` runs however the write ended (it gives the buffer back: a failed
write must not keep it from the next taker); a write that did not put its
bytes on disk, failed or not done, leaves the chunk lost in the files
(Note [chunk checks] in :mod:`chunkstar.disk.files`), so nothing reads the
file's older bytes as if they were the chunk's.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Protocol

import torch

from chunkstar.device.copy_engine import CopyEvent, debug_delay_from_env, relayed
from chunkstar.device.threads import ops_on_this_thread_only
from chunkstar.disk.errors import DiskTierError

__all__ = ["READERS", "BusyClock", "DiskEvent", "DiskLanes", "LaneFiles"]

READERS = 2
"""Reads in flight at once on the read lane (Note [two reads at once])."""


class LaneFiles(Protocol):
    """What the lanes move bytes with: :class:`~chunkstar.disk.files.ChunkFiles`, or a dry
    run's files that record bytes and move none (``device`` "meta": buffers with no bytes)."""

    device: str
    """The device type of the buffers the files read into and write from."""

    def read_into(self, list_name: str, chunk_id: int, dst: torch.Tensor, pieces: range | None = None) -> None: ...
    def write_from(self, list_name: str, chunk_id: int, src: torch.Tensor, pieces: range | None = None) -> None: ...
    def mark_lost(self, list_name: str, chunk_id: int, why: str, pieces: range | None = None) -> None: ...
    def nbytes(self, list_name: str, chunk_id: int, pieces: range | None = None) -> int: ...
    def path(self, list_name: str) -> Path: ...


def _as_disk_error(error: BaseException, text: str) -> BaseException:
    """``error`` if it is a DiskTierError (it names its file), else a DiskTierError saying
    ``text`` (what failed, and where), caused by ``error``."""
    if isinstance(error, DiskTierError):
        return error
    out = DiskTierError(f"chunkstar disk tier: {text}: {error!r}")
    out.__cause__ = error
    return out


class DiskEvent:
    """The event of one queued transfer: :meth:`wait` returns once it is done, or raises its failure."""

    def __init__(self, future: Future[None], what: str) -> None:
        self._future = future
        self._what = what

    def wait(self) -> None:
        try:
            self._future.result()
        except BaseException as e:
            raise relayed(e, self._what)  # a DiskTierError, its subclass kept (the job made it one)

    def done(self) -> bool:
        return self._future.done()

    order = wait  # host memory only: the caller's thread waits

    def __repr__(self) -> str:
        return f"DiskEvent({self._what}, done={self.done()})"


class BusyClock:
    """Note [disk busy time]: the wall time during which at least one transfer is moving
    bytes, on either lane (a read and a write at once count once), and the time each lane
    spends moving them. Waiting for a transfer's ``after`` is not busy: the disk is idle
    then, and a step whose disk is idle while something waits is what the figures show.
    Thread-safe; read :attr:`busy_seconds` at any time (a transfer running now counts
    up to now)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._since = 0.0
        self._busy = 0.0

    def start(self) -> None:
        with self._lock:
            if self._running == 0:
                self._since = time.perf_counter()
            self._running += 1

    def stop(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self._busy += time.perf_counter() - self._since

    @property
    def busy_seconds(self) -> float:
        with self._lock:
            return self._busy + (time.perf_counter() - self._since if self._running else 0.0)


class _Lane:
    """``workers`` threads starting transfers in the order they were queued (with one, each
    ends before the next starts), each after a random debug delay if one is set."""

    def __init__(
        self,
        name: str,
        delay: tuple[float, float] | None,
        seed: int,
        on_failure: Callable[[BaseException], None] | None,
        clock: BusyClock | None = None,
        workers: int = 1,
    ) -> None:
        # I/O beside the compute thread: torch ops here run on this thread alone (Note [one OpenMP team])
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=ops_on_this_thread_only)
        self._delay = delay
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()  # submitters may be on several threads
        self._on_failure = on_failure
        self._clock = clock or BusyClock()

    def submit(
        self,
        fn: Callable[[], None],
        after: CopyEvent | None,
        what: str,
        finally_: Callable[[BaseException | None], None] | None = None,
    ) -> DiskEvent:
        """Queue ``fn`` once ``after`` is done; ``finally_(failure)`` runs on the lane however
        it ended (``failure``: None once ``fn`` ran to its end)."""
        pause = 0.0
        if self._delay is not None:
            with self._rng_lock:
                pause = self._rng.uniform(*self._delay)
        on_failure = self._on_failure
        clock = self._clock

        def job() -> None:
            failure: BaseException | None = None
            try:
                if after is not None:
                    try:
                        after.wait()
                    except BaseException as e:
                        raise _as_disk_error(e, f"{what}: not done, the work it waited for failed")
                if pause:
                    time.sleep(pause)
                clock.start()
                try:
                    fn()
                except BaseException as e:
                    raise _as_disk_error(e, f"{what} failed on the I/O thread")
                finally:
                    clock.stop()
            except BaseException as e:
                failure = e
                if on_failure is not None:
                    on_failure(e)
                raise
            finally:
                if finally_ is not None:
                    finally_(failure)

        try:
            return DiskEvent(self._pool.submit(job), what)
        except RuntimeError as e:  # the executor's "cannot schedule new futures after shutdown"
            raise DiskTierError(f"chunkstar disk tier: {what}: the I/O lanes are closed ({e})") from e

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # queued transfers finish: a write-behind is not dropped


class DiskLanes:
    """A read lane and a write lane over one :class:`ChunkFiles` (see the module docstring).

    ``delay``: a random pause of (low, high) seconds before each transfer; None takes the
    debug setting ``CHUNKSTAR_DEBUG_COPY_DELAY_MS`` (unset: no pause). ``on_failure(error)``:
    called on the lane thread with each transfer's failure (the DiskTierError its waiters get)."""

    def __init__(
        self,
        files: LaneFiles,
        *,
        delay: tuple[float, float] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.files = files
        if delay is None:
            delay = debug_delay_from_env()
        self.delay = delay
        self.clock = BusyClock()
        """When the disk was busy (Note [disk busy time])."""
        # Note [two reads at once]: reads run two at a time (started in order, ending in any);
        # a disk serves one stream of O_DIRECT reads far below what two give it (measured on this
        # project's machine: one reader 0.3-0.5 GB/s, two 2.2 GB/s together), while a second
        # writer adds nothing (two writers 0.5 GB/s together, as one)
        self._reads = _Lane("chunkstar-disk-read", delay, 2, on_failure, self.clock, workers=READERS)
        self._writes = _Lane("chunkstar-disk-write", delay, 3, on_failure, self.clock)

    @property
    def busy_seconds(self) -> float:
        """Wall seconds so far during which a transfer moved bytes (Note [disk busy time])."""
        return self.clock.busy_seconds

    def read(
        self, list_name: str, chunk_id: int, dst: torch.Tensor, after: CopyEvent | None = None, pieces: range | None = None
    ) -> DiskEvent:
        """Queue ``files.read_into(list_name, chunk_id, dst, pieces)`` once ``after`` is done;
        ``dst`` must not be read (nor written) until the event is. A chunk whose bytes on disk
        are not what was last written there fails the read (the check runs before the event
        is done). ``pieces``: a run of the chunk's pieces only (Note [chunk pieces])."""
        self._check(list_name, chunk_id, dst, pieces)
        files = self.files
        what = f"reading chunk {chunk_id}{_run(pieces)} of list {list_name!r} from {files.path(list_name)}"
        return self._reads.submit(lambda: files.read_into(list_name, chunk_id, dst, pieces), after, what)

    def write(
        self,
        list_name: str,
        chunk_id: int,
        src: torch.Tensor,
        after: CopyEvent | None = None,
        then: Callable[[], None] | None = None,
        pieces: range | None = None,
    ) -> DiskEvent:
        """Queue ``files.write_from(list_name, chunk_id, src)`` once ``after`` is done (the update
        that wrote ``src``); ``then`` runs on the write lane once the job is over, whether the bytes
        got to disk or not (giving the buffer back, say). A write not done, because ``after``
        failed, leaves the chunk lost, as a failed write does. ``src`` must not change until the
        event is done. ``pieces``: a run of the chunk's pieces only (Note [chunk pieces])."""
        self._check(list_name, chunk_id, src, pieces)
        files = self.files
        what = f"writing chunk {chunk_id}{_run(pieces)} of list {list_name!r} to {files.path(list_name)}"

        def over(failure: BaseException | None) -> None:
            try:
                if failure is not None:  # the file holds the chunk's older bytes, or some of the new
                    files.mark_lost(list_name, chunk_id, f"its last write-behind did not complete ({failure})", pieces)
            finally:
                if then is not None:
                    then()

        return self._writes.submit(lambda: files.write_from(list_name, chunk_id, src, pieces), after, what, over)

    def drain(self) -> None:
        """Return once every transfer queued so far has finished (failures are raised to their
        own events' waiters, not here)."""
        marks = [lane.submit(lambda: None, None, "drain") for lane in (self._reads, self._writes)]
        for mark in marks:
            mark.wait()

    def close(self) -> None:
        """Finish the queued transfers and stop both threads (the files stay open: their owner closes them)."""
        self._reads.close()
        self._writes.close()

    def _check(self, list_name: str, chunk_id: int, t: torch.Tensor, pieces: range | None) -> None:
        # in the caller's thread: a wrong buffer is the caller's bug, raised where it was made
        nbytes = self.files.nbytes(list_name, chunk_id, pieces)
        if t.device.type != self.files.device or t.dim() != 1 or not t.is_contiguous() or t.numel() * t.element_size() != nbytes:
            raise ValueError(
                f"chunk {chunk_id}{_run(pieces)} of list {list_name!r} is {nbytes} bytes; expected a contiguous 1-D {self.files.device} tensor of "
                f"exactly that, got shape {tuple(t.shape)} of {t.dtype} on {t.device}"
            )


def _run(pieces: range | None) -> str:
    return "" if pieces is None else f" (pieces {pieces.start}-{pieces.stop - 1})"
