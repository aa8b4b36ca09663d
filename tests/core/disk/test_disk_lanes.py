"""The disk tier's I/O lanes (chunkstar.disk.io_lanes).

- transfers queue and return at once; their events wait; each lane starts its jobs in
  order (reads two at a time);
- ``after`` holds a job until the event it names is done (write-behind after an
  update), and a failure of that event fails the job;
- a failure on an I/O thread reaches every waiter, naming the file, and the
  lanes' ``on_failure``; a full disk stays a DiskFullError; ``then`` runs once
  the write is over, however it ended (it gives the buffer back), and a write
  that did not get its bytes to disk leaves the chunk lost;
- a disk error keeps its type across the worker threads it crosses (an update
  that waited for a read, then a copy that waited for the update);
- random debug delays (``CHUNKSTAR_DEBUG_COPY_DELAY_MS``) are real (a missing wait
  sees the old bytes) and leave waited-for results exact.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from chunkstar.device.copy_engine import DEBUG_DELAY_ENV, CopyThread, HostWorker
from chunkstar.disk import ChunkFiles, DiskFullError, DiskLanes, DiskTierError, aligned_empty
from chunkstar.disk.io_lanes import READERS

NBYTES = 256 << 10  # 64 Ki fp32 per chunk
CHUNKS = list(range(8))


class Gate:
    """An event someone opens by hand (the optimizer's update of a buffer, say)."""

    def __init__(self) -> None:
        self._flag = threading.Event()
        self.error: BaseException | None = None

    def open(self, error: BaseException | None = None) -> None:
        self.error = error
        self._flag.set()

    def wait(self) -> None:
        self._flag.wait()
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        return self._flag.is_set()


@pytest.fixture
def files(tmp_path: Path) -> Iterator[ChunkFiles]:
    with ChunkFiles.create(
        tmp_path, run_tag="lanes", rank=0, lists=["master", "exp_avg"], chunk_nbytes={c: NBYTES for c in CHUNKS}
    ) as f:
        yield f


def _values(seed: int) -> torch.Tensor:
    t = aligned_empty(NBYTES, torch.float32)
    t.copy_(torch.randn(NBYTES // 4, generator=torch.Generator().manual_seed(seed)))
    return t


def test_transfers_return_at_once_and_their_events_wait(files: ChunkFiles) -> None:
    lanes = DiskLanes(files, delay=(0.03, 0.03))  # eight writes in the caller would take 0.24 s
    try:
        srcs = {c: _values(c) for c in CHUNKS}
        t0 = time.perf_counter()
        writes = [lanes.write("master", c, srcs[c]) for c in CHUNKS]
        assert time.perf_counter() - t0 < 0.12, "queueing ran the writes in the caller"
        assert not writes[0].done()
        dsts = {c: aligned_empty(NBYTES, torch.float32) for c in CHUNKS}
        reads = [lanes.read("master", c, dsts[c], after=w) for c, w in zip(CHUNKS, writes)]
        reads[-1].wait()
        # reads start in the order they were queued, READERS at a time (Note [two reads at once]):
        # the last one started once every read but the READERS - 1 before it had ended
        assert all(r.done() for r in reads[: len(reads) - READERS]), "a lane starts its jobs in the order they were queued"
        assert all(w.done() for w in writes)
        for c in CHUNKS:
            assert torch.equal(dsts[c].view(torch.int32), srcs[c].view(torch.int32))
    finally:
        lanes.close()


def test_a_write_behind_waits_for_its_after_event(files: ChunkFiles) -> None:
    lanes = DiskLanes(files, delay=(0.0, 0.0))
    try:
        buf = _values(1)
        update = Gate()
        written = lanes.write("exp_avg", 3, buf, after=update)
        time.sleep(0.05)
        assert not written.done(), "the write ran before the update it was told to wait for"
        buf.mul_(2.0)  # the update
        expected = buf.clone()
        update.open()
        written.wait()
        back = aligned_empty(NBYTES, torch.float32)
        lanes.read("exp_avg", 3, back).wait()
        assert torch.equal(back.view(torch.int32), expected.view(torch.int32))
    finally:
        lanes.close()


def test_random_debug_delays_are_real_and_keep_results_exact(
    files: ChunkFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DEBUG_DELAY_ENV, "0-8")
    lanes = DiskLanes(files)
    assert lanes.delay == (0.0, 0.008)
    try:
        # write-behind -> read back, chunk after chunk, two lists, several rounds of updates
        state = {(name, c): _values(10 * c + i) for i, name in enumerate(files.lists) for c in CHUNKS}
        pending = {}
        for _ in range(3):
            for key, buf in state.items():
                buf.add_(1.0)
                pending[key] = lanes.write(*key, buf)
            backs = {key: aligned_empty(NBYTES, torch.float32) for key in state}
            events = [lanes.read(*key, backs[key], after=pending[key]) for key in state]
            for e in events:
                e.wait()
            for key in state:
                assert torch.equal(backs[key].view(torch.int32), state[key].view(torch.int32)), key
    finally:
        lanes.close()

    # ... and a reader that forgets to wait sees the old bytes
    slow = DiskLanes(files, delay=(0.25, 0.25))
    try:
        dst = torch.zeros(NBYTES // 4)
        event = slow.read("master", 0, dst)
        assert torch.count_nonzero(dst) == 0
        event.wait()
        assert torch.count_nonzero(dst) > 0
    finally:
        slow.close()


def test_a_failure_on_the_io_thread_reaches_every_waiter_with_the_path(files: ChunkFiles) -> None:
    lanes = DiskLanes(files, delay=(0.0, 0.0))
    try:
        # (1) the event a write waits for fails: the write is not done, its `then` still runs
        # (the buffer must come back), and the chunk is lost: the file does not hold its bytes
        lanes.write("master", 0, _values(0)).wait()
        gate, ran_then = Gate(), []
        failed = lanes.write("master", 0, _values(1), after=gate, then=lambda: ran_then.append(1))
        gate.open(RuntimeError("the update blew up"))
        with pytest.raises(
            DiskTierError, match=r"writing chunk 0 of list 'master' to .*chunkstar-r0-master\.chunks: not done.*blew up"
        ):
            failed.wait()
        assert ran_then == [1]
        with pytest.raises(DiskTierError, match="chunk 0 of list 'master' .* is lost: its last write-behind did not"):
            lanes.read("master", 0, aligned_empty(NBYTES, torch.float32)).wait()

        # (2) a real ENOSPC on the write lane, seen by two waiting threads; the lane carries on
        f = files._files["exp_avg"]  # its descriptors become /dev/full (writes fail ENOSPC)
        saved = (f.fd, f.direct_fd)
        f.fd, f.direct_fd = os.open("/dev/full", os.O_WRONLY), -1
        try:
            full = lanes.write("exp_avg", 2, _values(2))
            seen: list[BaseException] = []

            def waiter() -> None:
                try:
                    full.wait()
                except BaseException as e:
                    seen.append(e)

            threads = [threading.Thread(target=waiter) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            os.close(f.fd)
            f.fd, f.direct_fd = saved
        assert len(seen) == 2 and all(isinstance(e, DiskFullError) for e in seen)
        assert str(files.path("exp_avg")) in str(seen[0]) and "chunk 2 of list 'exp_avg'" in str(seen[0])

        done: list[int] = []
        lanes.write("exp_avg", 2, _values(3), then=lambda: done.append(2)).wait()
        assert done == [2], "then runs once the bytes are on disk"

        # (3) a wrong buffer is refused in the caller's thread, not on the worker
        with pytest.raises(ValueError, match="exactly that"):
            lanes.read("master", 1, torch.empty(7))
    finally:
        lanes.close()


def test_drain_waits_for_everything_queued(files: ChunkFiles) -> None:
    lanes = DiskLanes(files, delay=(0.005, 0.01))
    events = [lanes.write("master", c, _values(c)) for c in CHUNKS]
    events += [lanes.read("exp_avg", c, aligned_empty(NBYTES, torch.float32)) for c in CHUNKS]
    lanes.drain()
    assert all(e.done() for e in events)
    lanes.close()
    assert files.stats.writes == len(CHUNKS) and files.stats.reads == len(CHUNKS)


def test_every_failure_reaches_on_failure_and_the_lanes_go_on(files: ChunkFiles) -> None:
    seen: list[BaseException] = []
    lanes = DiskLanes(files, delay=(0.0, 0.0), on_failure=seen.append)
    try:
        lanes.write("master", 5, _values(5)).wait()
        lanes.write("master", 6, _values(6)).wait()
        os.truncate(files.path("master"), 5 * NBYTES + 4096)  # chunk 5 is cut short, 6 is gone
        back = aligned_empty(NBYTES, torch.float32)
        events = [lanes.read("master", c, back) for c in (5, 6)]
        for c, e in zip((5, 6), events):
            with pytest.raises(DiskTierError, match=f"reading chunk {c} of list 'master' .*shorter than its manifest"):
                e.wait()
        assert [type(e) for e in seen] == [DiskTierError, DiskTierError]
        # (reads run two at a time, Note [two reads at once]: their failures come in either order)
        assert sorted("chunk 5" in str(e) for e in seen) == [False, True] and any("chunk 6" in str(e) for e in seen)
        lanes.read("exp_avg", 0, back).wait()  # another file: the lane goes on
        assert len(seen) == 2
    finally:
        lanes.close()


def test_a_disk_error_keeps_its_type_across_the_worker_threads(files: ChunkFiles) -> None:
    lanes = DiskLanes(files, delay=(0.0, 0.0))
    worker, copies = HostWorker(), CopyThread()
    try:
        lanes.write("master", 2, _values(2)).wait()
        os.truncate(files.path("master"), 0)
        dst = aligned_empty(NBYTES, torch.float32)
        read = lanes.read("master", 2, dst)
        update = worker.submit(read.wait)  # the update waits for its read, on the host worker
        copy = copies.to_device(torch.empty(4), torch.ones(4), after=update)  # the next copy waits for the update
        for event in (read, update, copy):
            with pytest.raises(DiskTierError, match=r"reading chunk 2 of list 'master' .*chunkstar-r0-master\.chunks") as info:
                event.wait()
            original = info.value.__cause__
            assert isinstance(original, DiskTierError) and str(original) == str(info.value)
            assert isinstance(original.__cause__, EOFError)  # the failure itself, with the I/O thread's traceback
    finally:
        copies.close()
        worker.close()
        lanes.close()


def test_the_busy_clock_counts_moving_bytes_once_and_never_a_wait(files: ChunkFiles) -> None:
    """Note [disk busy time]: a transfer waiting for its ``after`` is not busy; two at once count once."""
    from chunkstar.disk.io_lanes import BusyClock

    clock = BusyClock()
    t0 = time.perf_counter()
    clock.start()
    clock.start()  # a read and a write at once
    time.sleep(0.05)
    clock.stop()
    time.sleep(0.05)
    clock.stop()
    span = time.perf_counter() - t0
    assert 0.1 <= clock.busy_seconds <= span  # the union: the sum of the two would pass the span
    lanes = DiskLanes(files)
    gate = Gate()
    event = lanes.read("master", 0, aligned_empty(NBYTES, torch.float32), after=gate)
    time.sleep(0.2)
    assert not event.done() and lanes.busy_seconds == 0.0  # waiting for its update is not the disk's time
    opened = time.perf_counter()
    gate.open()
    event.wait()
    assert 0.0 < lanes.busy_seconds <= time.perf_counter() - opened
    lanes.close()
