"""The disk tier at run time: this rank's chunks of the chosen lists in files, staged through host buffers.

Note [disk tier]: with config ``disk``, the chunks of the chosen lists (by
default the state lists: fp32 master, exp_avg, exp_avg_sq; the param list too
when named, Note [param chunks on disk] below; docs/design.md, 'The disk tier')
live in preallocated files, one per list (:class:`chunkstar.disk.ChunkFiles`);
their location is DISK and they hold no host or device bytes. Host memory is only a staging area of
``staging_budget`` bytes (:class:`chunkstar.disk.StagingBuffers`):

* at the optimizer step, for each chunk in the order the next forward needs
  it, the state chunks are read ahead into staging buffers on the read lane,
  the Adam update waits for its reads (and its gradient's copy) on the host
  worker, and the updated chunks are written behind on the write lane, their
  buffers given back when the bytes are on disk. The main thread only queues
  this work; it waits when the staging budget is spent, until a write-behind
  gives a buffer back, so reads run at most a budget ahead of the writes. Disk
  reads, host Adam and disk writes of different chunks overlap, and so does
  the next forward (its param chunks wait for their own updates only);
* between steps, code that reads or writes a state chunk (checkpoints, state
  dicts, ``gathered_parameters``, writes through to a master) stages it in for
  the moment, one chunk at a time (:meth:`chunkstar.chunk.store.Chunks.staged`), and writes it
  back when it changed;
* device Adam (hybrid Adam) is off: the state lives on disk and is updated on
  the host.

The same arithmetic runs on the same values in the same order as without the
disk tier, so results are bit-identical. The files are a cache of this run,
not a checkpoint (``save_checkpoint`` writes the real thing): they are deleted
when the engine is closed or collected, or when its start fails once they
exist (:meth:`DiskTier.discard`: the same call, corrected, must not find them
stale), and a later run refuses or wipes files a dead run left (Note
[directory claim] in :mod:`chunkstar.disk.claim`).

Failures: every chunk read is checked against what was written (Note [chunk
checks] in :mod:`chunkstar.disk.files`). A transfer that fails fails its
event, raising a :class:`~chunkstar.disk.DiskTierError` that names the file
and the chunk in whoever waits on it, its type kept across the worker threads
(Note [errors across workers] in :mod:`chunkstar.device.copy_engine`); it
also fails the staging pool, so the step, which waits there for buffers,
raises it at once, and so does every later stage-in: the state on disk is no
longer whole, and the run cannot go on. A buffer comes back on every path (a
failed write-behind's too), so no wait is left without an end.

Note [param chunks on disk]: with ``"param"`` among the lists, a param chunk's
home is its file too, and host memory holds no param chunk between uses. The
chunk store moves such a chunk (:meth:`ChunkManager._move_through_disk
<chunkstar.runtime.chunk_manager.ChunkManager>`):

* to the device (an access, a prefetch along the trace): a staging buffer is
  filled on the read lane, the copy to the device is queued after that read (the
  read is the copy's ``after``: on the CPU virtual device the copy thread waits,
  not the compute), and the buffer goes back to the pool once the copy no longer
  reads it (:meth:`DiskTier.give_back_after`, on the tier's own thread: a taker
  waiting for room is never the one who must give it back);
* off the device (an eviction, a gradient's offload): if nothing wrote the
  payload since it was read from the file (the chunk's ``file_clean``, the
  parameters' version counters checked as for a clean host copy), the device
  bytes are simply freed; otherwise they are copied into a staging buffer and
  written behind, as an optimizer chunk is.

So a forward reads each param chunk it does not hold, a backward reads them
again and writes the gradients, and the step reads the gradient with the state
and writes the updated values behind: per step about 5 x 2 bytes per parameter
in bf16 on top of the state's 2 x 12. The gradient pipeline takes a chunk's
gradient norms on the device before it leaves (Note [gradient pipeline]), since
the chunk goes straight on to its file; between steps a param chunk is staged
like a state chunk (gradients read or written, values written through, frozen
values in checkpoints and state dicts). The default staging budget counts a
chunk's param bytes with its state. The arithmetic and its order are unchanged,
so results are bit-identical to the same run without the tier.

Note [the step issued behind]: with overlap on, ``optimizer.step()`` does not
stage the state itself. Once the global norm is known it queues, chunk by chunk
in the order the next forward needs them, a job on the tier's step thread
(:meth:`DiskTier.issue_behind`) that stages the chunk's disk lists in, queues its
update on the host worker and stages them out to be written behind; then it
returns. The step thread is the one that waits for staging buffers, so the next
forward runs while the step's reads and writes go on, and a step bound by its
disk costs about the larger of its compute and its I/O, not their sum. What
keeps it exact:

* a param chunk in host memory gets an :class:`~chunkstar.device.copy_engine.Issued`
  event as its pending work at once: its next copy to the device, and any reader,
  waits for the update once the step thread has issued it;
* a chunk the step thread stages (a state chunk, a param chunk whose home is a
  file) is the step thread's until its job has run: the chunk store's moves wait
  for it (:meth:`DiskTier.wait_for`), and anything that stages chunks between
  steps (checkpoints, state dicts, writes through, the next step's norms) first
  waits for the thread to finish what it was given (:meth:`DiskTier.settle`);
* the same updates run on the same values in the same order, so the bits are
  those of the serial path.

A transfer that fails now reaches whoever waits next: the end of the step, or the
forward after it, and every later step (the thread keeps its first failure).
The engine lets the thread finish before it closes the host worker.

Note [the step in slices]: no single parameter may set the staging budget. A
parameter larger than the chunk size has a chunk of its own (a tied embedding:
128M elements in a 4B GPT-2, 525M in Llama 3 8B), and staging its whole state for
its update took 14 bytes per element at once (1.8 GB, 7.3 GB). So the update works
in slices (:func:`staging_shape`): the chunk files' pieces
(Note [chunk pieces] in :mod:`chunkstar.disk.files`) hold ``slice_elements``
elements in every list, the most that lets two slices' state (one read ahead, one
updated) fit half the budget each, and the step stages a larger chunk a run of
pieces at a time: the slice of each of its lists on disk is read into a buffer of
its own (:meth:`DiskTier.stage_slice`), its update runs over the parameters' runs
cut to the slice, and the slice is written behind (:meth:`DiskTier.write_slice`)
while the next one is read. Adam is elementwise and each element is updated once,
by the same arithmetic, so the bits are those of the whole chunk's update. The
chunk stays on disk throughout (its pieces are never all in host memory); its next
read waits for the last slice's write (one write lane, in order).

What still stages whole chunks sets the least budget that works
(:attr:`StagingShape.least`): between steps, a write through a parameter and a
loaded state dict stage its master and param chunks together, and everything else
one list at a time; with the param list on disk, a param chunk goes to the device
whole. The default budget is two slices of a chunk of the layout's usual size, or
that least if it is more; no longer the largest chunk's state and the next.

Note [a file holds what a chunk uses]: a chunk's slot in its file holds its
elements up to its last parameter's end, not the padding after it. A layout
pads a chunk when the next parameter does not fit (a 4B GPT-2's layers at 19.7M
elements per chunk left 22% of the elements padding), and padding read and
written every step is disk time for nothing. A staged chunk's padding is zeros,
as a chunk's is from its first placement (filled in the buffer before the read
is issued); nothing reads it but whole-chunk copies. The slices of the step
cover the used elements only.

This module is the mechanism; which chunks to stage and when is decided by the
optimizer's step, by the chunk store's moves (param chunks) and, between steps,
by whoever reads or writes a chunk through
:meth:`chunkstar.chunk.store.Chunks.staged`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

import torch

from chunkstar.chunk.chunk import Chunk
from chunkstar.chunk.lists import ChunkList
from chunkstar.config import DiskConfig
from chunkstar.device.copy_engine import CopyEvent, relayed
from chunkstar.disk import ChunkFiles, DiskIOStats, DiskLanes, StagingBuffers
from chunkstar.errors import ChunkStateError

__all__ = ["DiskParts", "DiskTier", "RealDisk", "StagingShape", "staging_shape"]


class TierFiles(Protocol):
    """What the tier asks of its files (:class:`chunkstar.disk.ChunkFiles`, or a dry run's)."""

    @property
    def file_bytes(self) -> int: ...
    @property
    def stats(self) -> DiskIOStats: ...
    @property
    def direct(self) -> bool: ...
    @property
    def directory(self) -> Path: ...
    def write_from(self, list_name: str, chunk_id: int, src: torch.Tensor) -> None: ...
    def remove(self) -> None: ...


class TierLanes(Protocol):
    """What the tier asks of its I/O lanes (:class:`chunkstar.disk.DiskLanes`, or a dry run's)."""

    def read(
        self, list_name: str, chunk_id: int, dst: torch.Tensor, after: CopyEvent | None = None, pieces: range | None = None
    ) -> CopyEvent: ...
    def write(
        self, list_name: str, chunk_id: int, src: torch.Tensor, after: CopyEvent | None = None,
        then: Callable[[], None] | None = None, pieces: range | None = None,
    ) -> CopyEvent: ...  # fmt: skip
    def drain(self) -> None: ...
    def close(self) -> None: ...
    @property
    def busy_seconds(self) -> float: ...


class DiskParts(Protocol):
    """What a :class:`DiskTier` is built from: its staging pool, files and I/O lanes.
    :class:`RealDisk` makes the real ones; a dry run passes parts that record bytes and
    move none (Note [dry run disk] in :mod:`chunkstar.dryrun.disk`)."""

    def staging(self, budget: int) -> StagingBuffers: ...
    def files(
        self, cfg: DiskConfig, *, run_tag: str, rank: int, lists: list[str], chunk_nbytes: dict[str, dict[int, int]],
        piece_nbytes: dict[str, int],
    ) -> TierFiles: ...
    def lanes(self, files: TierFiles, on_failure: Callable[[BaseException], None]) -> TierLanes: ...


class RealDisk:
    """The disk tier's real parts: aligned host buffers, preallocated files under the
    config's path (claimed for this run), and two I/O threads."""

    def staging(self, budget: int) -> StagingBuffers:
        return StagingBuffers(budget, aligned=True)

    def files(
        self, cfg: DiskConfig, *, run_tag: str, rank: int, lists: list[str], chunk_nbytes: dict[str, dict[int, int]],
        piece_nbytes: dict[str, int],
    ) -> TierFiles:
        return ChunkFiles.create(
            cfg.path, run_tag=run_tag, rank=rank, lists=lists, chunk_nbytes=chunk_nbytes,
            on_stale="wipe" if cfg.on_stale == "wipe" else "refuse", direct=cfg.direct, verify=cfg.verify,
            piece_nbytes=piece_nbytes,
        )  # fmt: skip

    def lanes(self, files: TierFiles, on_failure: Callable[[BaseException], None]) -> TierLanes:
        assert isinstance(files, ChunkFiles)
        return DiskLanes(files, on_failure=on_failure)


SLICE_ALIGN = 2048
"""A slice's elements are a multiple of this: a slice of a bf16, fp16 or fp32 list is then
whole 4096-byte blocks, as direct I/O moves them (Note [the step in slices])."""

_TOGETHER = (ChunkList.PARAM, ChunkList.MASTER)
"""The lists a between-step access stages together: a write through a parameter, a loaded
state dict (the rest stage one list at a time)."""


@dataclasses.dataclass(frozen=True)
class StagingShape:
    """The staging budget and how the step cuts chunks to it (Note [the step in slices])."""

    budget: int
    """Bytes of host staging buffers."""
    least: int
    """The least budget that works: what a between-step access or a param chunk's way to the
    device stages at once, for the largest chunk."""
    slice_elements: int
    """The step updates a chunk of more elements in slices of this many (a multiple of
    :data:`SLICE_ALIGN`)."""
    piece_nbytes: dict[str, int]
    """The chunk files' piece size of each list that has a chunk longer than a slice."""

    def slices(self, elements: int) -> list[tuple[int, int]]:
        """The (first, end) elements of each slice of a chunk of ``elements``; one for a
        chunk no longer than a slice."""
        e = self.slice_elements
        if elements <= e:
            return [(0, elements)]
        return [(a, min(a + e, elements)) for a in range(0, elements, e)]


def staging_shape(sizes: Mapping[ChunkList, Mapping[int, tuple[int, int]]], budget: int | None) -> StagingShape:
    """The staging budget (``budget``, or None for the default) and the step's slices for chunks
    of ``sizes`` (disk list -> chunk id -> (elements, bytes per element)). Raises a
    :class:`~chunkstar.errors.ChunkStateError` for a budget below the least that works."""
    elements: dict[int, int] = {}
    per_element: dict[int, int] = {}
    together: dict[int, int] = {}
    for name, per in sizes.items():
        for cid, (n, item) in per.items():
            elements[cid] = n
            per_element[cid] = per_element.get(cid, 0) + item
            alone = n * item
            if name in _TOGETHER:
                together[cid] = together.get(cid, 0) + alone
            together[cid] = max(together.get(cid, 0), alone)
    if not elements:
        return StagingShape(budget or 0, 0, 0, {})
    widest = max(per_element.values())  # a trainable chunk's bytes per element, over its disk lists
    least = max(max(together.values()), SLICE_ALIGN * widest)
    if budget is None:
        usual = sorted(elements.values())[len(elements) // 2]  # the layout's usual chunk: a huge parameter's is not
        budget = max(least, 2 * _round_slice(usual) * widest)
    if budget < least:
        raise ChunkStateError(
            f"disk.staging_budget is {budget} bytes, less than the least that works ({least} bytes: the master and "
            f"param chunks of the largest chunk, which a write through a parameter stages together between steps, "
            f"or one slice of a chunk's state): raise it to at least that, or lower default_chunk_size"
        )  # before any file exists: a refused start leaves nothing behind
    # two slices in half the budget each: one read ahead while the other is updated and written
    longest = max(elements.values())
    if budget // 2 // widest >= longest:
        e = _round_slice(longest)  # every chunk whole
    else:
        e = (budget // 2 // widest) // SLICE_ALIGN * SLICE_ALIGN or (budget // widest) // SLICE_ALIGN * SLICE_ALIGN
    pieces = {
        name.value: e * next(iter(per.values()))[1]
        for name, per in sizes.items()
        if per and any(n > e for n, _ in per.values())
    }
    return StagingShape(budget, least, e, pieces)


def _round_slice(n: int) -> int:
    return -(-n // SLICE_ALIGN) * SLICE_ALIGN


class _Worker:
    """One daemon thread running jobs in the order they were queued; a job's failure is kept
    (the first one) for :meth:`settle` to raise, and the jobs after it still run. Stopped by
    :meth:`stop` (its queued jobs run first), or at exit."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - kept for settle, and for the waiters of the job's chunks
                if self.failure is None:
                    self.failure = e
            # the job's closure holds the optimizer, and through it the engine: a dropped engine
            # must be collectable (its finalizer deletes the chunk files) while this thread waits
            job = None

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def settle(self) -> None:
        """Return once every job queued so far has run; raise the first failure, if any."""
        if threading.current_thread() is self._thread:
            return
        mark = threading.Event()
        self._jobs.put(mark.set)
        mark.wait()
        if self.failure is not None:
            raise relayed(self.failure, "the disk tier's step")

    def stop(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join()


def _host_wait(event: CopyEvent) -> None:
    """Wait, in this thread, until the copy of ``event`` no longer reads its host source (a
    CUDA copy to the device: a host sync on it, not the compute stream's wait)."""
    for_host = getattr(event, "for_host", None)
    (for_host() if for_host is not None else event).wait()


def _close(workers: tuple[_Worker, ...], lanes: TierLanes, files: TierFiles) -> None:
    for w in workers:
        w.stop()
    lanes.close()
    files.remove()


class DiskTier:
    def __init__(
        self,
        cfg: DiskConfig,
        chunks: Mapping[ChunkList, Mapping[int, Chunk]],
        *,
        run_tag: str,
        rank: int,
        on_move: Callable[[Chunk, bool, int, int, int], None] | None = None,
        quiet: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
        parts: DiskParts | None = None,
        used: Mapping[int, int] | None = None,
    ) -> None:
        """``chunks``: this rank's chunks of each disk list by chunk id (frozen chunks have none);
        ``parts``: what the tier is built from (default :class:`RealDisk`).
        ``on_move(chunk, to_disk, nbytes, t_ns, held)`` hears of every staging move as it is issued
        (``held``: the staging bytes it takes or gives back: a slice's, or the chunk's)
        (the store turns them into events). :meth:`staged` stages inside ``quiet()`` (the
        memory probe paused: staging buffers are model memory). ``used``: chunk id -> the
        elements its parameters use (Note [a file holds what a chunk uses]; default: all)."""
        self._on_move = on_move
        self._quiet = quiet
        self.lists = tuple(chunks)
        self._used = dict(used or {})
        sizes = {name.value: {cid: self.used(c) * c.dtype.itemsize for cid, c in per.items()} for name, per in chunks.items()}
        # before any file exists: a refused budget leaves nothing behind (Note [the step in slices])
        self.shape = staging_shape(
            {name: {cid: (c.numel, c.dtype.itemsize) for cid, c in per.items()} for name, per in chunks.items()},
            cfg.staging_budget,
        )
        self.budget = self.shape.budget
        parts = parts or RealDisk()
        self.staging = parts.staging(self.budget)
        self.files = parts.files(
            cfg, run_tag=run_tag, rank=rank, lists=[n.value for n in self.lists], chunk_nbytes=sizes,
            piece_nbytes=self.shape.piece_nbytes,
        )  # fmt: skip
        # a failed transfer fails the pool: the step waiting in take raises it (Note [disk tier])
        self.lanes = parts.lanes(self.files, self.staging.fail)
        # the files go at a clean end of the engine (close), when it is collected, or at a failed start
        # two threads of its own (Note [the step issued behind]): one gives staging buffers back
        # once the copies to the device that read them are done, one issues the step's staging
        self._returner = _Worker("chunkstar-disk-return")
        self._stepper = _Worker("chunkstar-disk-step")
        self._busy: dict[int, threading.Event] = {}  # id(chunk) -> set once the stepper is done with it
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close, (self._stepper, self._returner), self.lanes, self.files)
        self.stage_ins = 0
        self.stage_outs = 0
        self.clean_stage_outs = 0  # staged out without a write (nothing changed)
        self.wait_s = 0.0  # main-thread seconds waiting for a staging buffer
        self._mark: dict[str, float] | None = None  # the totals when the last step ended
        self.last_step: dict[str, float | int | None] = {}
        """The disk's figures over the last whole iteration (:meth:`step_ended`)."""

    @property
    def file_bytes(self) -> int:
        return self.files.file_bytes

    def on_disk(self, name: ChunkList) -> bool:
        return name in self.lists

    @contextlib.contextmanager
    def staged(self, chunks: list[Chunk], *, write: bool) -> Iterator[None]:
        """Inside the block, ``chunks`` (all on disk) are staged into host buffers, their payloads
        readable and writable as usual; at its end they go back to disk, written back with
        ``write``. One chunk at a time is the rule: their bytes must fit the staging budget."""
        need = sum(c.nbytes for c in chunks)
        if need > self.budget:
            raise ChunkStateError(
                f"staging {len(chunks)} chunks from disk at once needs {need} bytes, more than disk.staging_budget "
                f"({self.budget} bytes)"
            )
        self.settle()  # the last step's staging is all issued (Note [the step issued behind])
        quiet = self._quiet
        done: list[Chunk] = []
        try:
            with quiet():
                for c in chunks:
                    self.stage_in(c)
                    done.append(c)
            yield
        finally:
            error: BaseException | None = None
            with quiet():
                for c in done:  # every chunk goes back, even after one failed (the pool fails with it)
                    try:
                        self.stage_out(c, write=write)
                    except BaseException as e:
                        error = error or e
            if error is not None:
                raise error

    def take(self, chunk: Chunk) -> torch.Tensor:
        """A staging buffer for ``chunk``'s bytes, once the budget has room (write-behinds and
        copies to the device give buffers back on their own threads)."""
        return self._take_all([(chunk.nbytes, chunk.dtype)])[0]

    def _take_all(self, wanted: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
        """Buffers for all of ``wanted`` at once (Note [all or nothing] in :mod:`chunkstar.disk.staging`)."""
        t0 = time.perf_counter()
        bufs = self.staging.take_all(wanted)  # raises once a transfer has failed
        with self._lock:
            self.wait_s += time.perf_counter() - t0
        return bufs

    def give_back_after(self, buf: torch.Tensor, event: CopyEvent | None) -> None:
        """``buf``, a staging buffer a copy to the device (``event``) reads, goes back to the
        pool once that copy is done (Note [param chunks on disk]), on the tier's own thread."""
        staging = self.staging

        def back() -> None:
            try:
                if event is not None:
                    _host_wait(event)
            finally:  # a failed copy's waiters raise its error; the buffer comes back all the same
                staging.give_back(buf)

        self._returner.submit(back)

    # ------------------------------------------------------------------ the step issued behind
    def issue_behind(self, chunks: list[Chunk], job: Callable[[], None]) -> None:
        """Run ``job`` (staging ``chunks`` in, queueing their update, staging them out) on the
        tier's step thread, in order (Note [the step issued behind]); until it has run,
        :meth:`wait_for` holds whoever else would move one of ``chunks``."""
        done = threading.Event()
        with self._lock:
            for c in chunks:
                self._busy[id(c)] = done
        busy, lock = self._busy, self._lock

        def run() -> None:
            try:
                job()
            finally:
                with lock:
                    for c in chunks:
                        if busy.get(id(c)) is done:
                            del busy[id(c)]
                done.set()

        self._stepper.submit(run)

    def wait_for(self, chunk: Chunk) -> None:
        """Return once the step thread is done with ``chunk`` (at once if it has none queued)."""
        with self._lock:
            done = self._busy.get(id(chunk))
        if done is not None:
            done.wait()

    def settle(self) -> None:
        """Return once the step thread has issued everything queued to it; raises its first failure."""
        self._stepper.settle()

    def finish_stepping(self) -> None:
        """Let the step thread issue what is queued to it and stop (the engine closes: a failure
        is the one the step's waiters saw, not raised again here)."""
        self._stepper.stop()

    def stage_in(self, chunk: Chunk, *, for_device: bool = False) -> None:
        """DISK -> HOST: a staging buffer, filled on the read lane after the chunk's last
        write-behind; readers wait on the read as on any pending copy. ``for_device``: the
        chunk goes on to the device, whose copy is ordered after the read (not this thread)."""
        self._stage_in(chunk, self.take(chunk), for_device)

    def stage_in_all(self, chunks: list[Chunk]) -> None:
        """:meth:`stage_in` for each of ``chunks``, their buffers taken at once (Note [all or
        nothing]: what an update or a between-step access needs together)."""
        bufs = self._take_all([(c.nbytes, c.dtype) for c in chunks])
        for i, (c, buf) in enumerate(zip(chunks, bufs)):
            try:
                self._stage_in(c, buf, False)
            except BaseException:
                for rest in bufs[i + 1 :]:
                    self.staging.give_back(rest)
                raise

    def used(self, chunk: Chunk) -> int:
        """The elements of ``chunk`` its file holds (Note [a file holds what a chunk uses])."""
        return min(self._used.get(chunk.chunk_id, chunk.numel), chunk.numel)

    def _stage_in(self, chunk: Chunk, buf: torch.Tensor, for_device: bool) -> None:
        n = self.used(chunk)
        try:
            if n < chunk.numel:
                buf[n:].zero_()  # the padding (Note [a file holds what a chunk uses])
            event = self.lanes.read(chunk.list_name, chunk.chunk_id, buf[:n], after=chunk.pending_copy)
        except BaseException:
            self.staging.give_back(buf)
            raise
        chunk.attach_host(buf, event, as_work=for_device)
        self._moved(chunk, False, n * chunk.dtype.itemsize, chunk.nbytes)

    def slices(self, chunk: Chunk) -> list[tuple[int, int]]:
        """The (first, end) elements of each slice the step stages of ``chunk``'s used elements
        (one, all of them, if they are no more than a slice: Note [the step in slices])."""
        return self.shape.slices(self.used(chunk))

    def stage_slices(self, chunks: list[Chunk], first: int, end: int) -> list[tuple[torch.Tensor, CopyEvent]]:
        """For each of ``chunks`` (on disk, and left there), a staging buffer being filled with
        its elements ``first:end``, a slice of :attr:`shape`, and the read's event (Note [the
        step in slices]); the buffers are taken at once (Note [all or nothing])."""
        runs = [self._pieces(c, first, end) for c in chunks]
        bufs = self._take_all([((end - first) * c.dtype.itemsize, c.dtype) for c in chunks])  # raises once a transfer failed
        out = []
        for i, (c, buf, pieces) in enumerate(zip(chunks, bufs, runs)):
            try:
                event = self.lanes.read(c.list_name, c.chunk_id, buf, after=c.pending_copy, pieces=pieces)
            except BaseException:
                for rest in bufs[i:]:
                    self.staging.give_back(rest)
                raise
            nbytes = buf.numel() * buf.element_size()
            self._moved(c, False, nbytes, nbytes)
            out.append((buf, event))
        return out

    def write_slice(self, chunk: Chunk, first: int, end: int, buf: torch.Tensor, after: CopyEvent) -> CopyEvent:
        """Write ``buf`` (from :meth:`stage_slices`) back as elements ``first:end`` of ``chunk``
        once ``after`` (its update) is done; the buffer goes back to the pool when the write is
        over. The caller hands the chunk's last slice write to ``set_disk_write``."""
        staging = self.staging
        try:
            event = self.lanes.write(
                chunk.list_name, chunk.chunk_id, buf, after=after, then=lambda: staging.give_back(buf),
                pieces=self._pieces(chunk, first, end),
            )  # fmt: skip
        except BaseException:
            staging.give_back(buf)
            raise
        nbytes = buf.numel() * buf.element_size()
        self._moved(chunk, True, nbytes, nbytes)
        return event

    def _moved(self, chunk: Chunk, to_disk: bool, nbytes: int, held: int) -> None:
        """Count a staging move (``nbytes`` travelling, ``held`` bytes of staging taken or
        given back) and tell ``on_move`` of it."""
        with self._lock:
            if to_disk:
                self.stage_outs += 1
            else:
                self.stage_ins += 1
        if self._on_move is not None:
            self._on_move(chunk, to_disk, nbytes, time.perf_counter_ns(), held)

    def _pieces(self, chunk: Chunk, first: int, end: int) -> range:
        e, n = self.shape.slice_elements, self.used(chunk)
        if first % e or not (end == n or end % e == 0) or not 0 <= first < end <= n:
            raise ValueError(f"elements {first}:{end} of {chunk!r} are not a run of whole slices of {e} elements")
        return range(first // e, -(-end // e))

    def stage_out(self, chunk: Chunk, *, write: bool) -> None:
        """HOST -> DISK: with ``write``, the buffer is written behind once the last work on it
        is done and given back when its bytes are on disk; without, given back at once."""
        buf, last = chunk.detach_host()
        self._moved(chunk, True, self.used(chunk) * chunk.dtype.itemsize if write else 0, chunk.nbytes)
        if write:
            staging = self.staging
            try:  # given back once the write is over, whether its bytes got to disk or not
                event = self.lanes.write(
                    chunk.list_name, chunk.chunk_id, buf[: self.used(chunk)], after=last, then=lambda: staging.give_back(buf)
                )
            except BaseException:
                staging.give_back(buf)
                raise
            chunk.set_disk_write(event)
            return
        try:
            if last is not None:
                last.wait()
        except Exception as e:
            # the read failed (or the work after it): its waiters have raised it, and the pool
            # fails with it, so every later stage-in does; raising it here, where chunks are put
            # back (often in a finally), would leave the next chunks out
            self.staging.fail(e)
        finally:
            self.staging.give_back(buf)
        with self._lock:
            self.clean_stage_outs += 1

    def drain(self) -> None:
        self._stepper.settle()
        self.lanes.drain()
        self._returner.settle()

    def close(self) -> None:
        """Finish the transfers in flight and delete this run's chunk files."""
        self._finalizer()

    def discard(self) -> None:
        """:meth:`close` for a start that failed once the tier existed: its files and lock go
        now, so the same call, corrected, finds nothing stale (in this process or another).
        A failure of this cleanup is a warning: the start's own error is what the caller sees."""
        try:
            self.close()
        except Exception as e:
            warnings.warn(
                f"chunkstar disk tier: deleting the chunk files of a failed start in {self.files.directory} failed "
                f"({e}); delete them by hand, or start with disk.on_stale 'wipe'",
                RuntimeWarning,
                stacklevel=2,
            )

    def _totals(self) -> dict[str, float]:
        s = self.files.stats
        return {
            "t": time.perf_counter(), "bytes_read": s.bytes_read, "bytes_written": s.bytes_written,
            "read_s": s.read_seconds, "write_s": s.write_seconds, "busy_s": self.lanes.busy_seconds, "wait_s": self.wait_s,
        }  # fmt: skip

    def step_ended(self) -> None:
        """An optimizer step returned: the disk's figures over the iteration since the last one
        (its forward, backward and step, and the transfers that ran meanwhile), for
        :meth:`stats` (Note [disk busy time] in :mod:`chunkstar.disk.io_lanes`)."""
        now = self._totals()
        before, self._mark = self._mark, now
        if before is None:
            return
        d = {k: now[k] - before[k] for k in now}
        span = d.pop("t")
        self.last_step = {
            "seconds": span,
            "bytes_read": int(d["bytes_read"]),
            "bytes_written": int(d["bytes_written"]),
            "read_s": d["read_s"],
            "write_s": d["write_s"],
            "busy_s": d["busy_s"],
            "busy_fraction": d["busy_s"] / span if span > 0 else 0.0,
            # bytes per second while the lane moved them: the disk's speed as this run sees it
            "read_bytes_per_s": d["bytes_read"] / d["read_s"] if d["read_s"] > 0 else None,
            "write_bytes_per_s": d["bytes_written"] / d["write_s"] if d["write_s"] > 0 else None,
            "staging_wait_s": d["wait_s"],
        }

    def stats(self) -> dict[str, Any]:
        s = self.files.stats
        return {
            "disk_bytes_read": s.bytes_read,
            "disk_bytes_written": s.bytes_written,
            "disk_read_s": s.read_seconds,
            "disk_write_s": s.write_seconds,
            "disk_file_bytes": self.files.file_bytes,
            "disk_direct_io": int(self.files.direct),
            "disk_staging_budget_bytes": self.budget,
            "disk_staging_peak_bytes": self.staging.peak_in_use_bytes,
            "disk_staging_wait_s": self.wait_s,
            "disk_busy_s": self.lanes.busy_seconds,
            "disk_last_step": dict(self.last_step),  # {} before two steps have ended
        }
