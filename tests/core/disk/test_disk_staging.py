"""The disk tier's host staging buffers (chunkstar.disk.staging) and its bandwidth probe (chunkstar.disk.bandwidth).

- concurrent takers never hold more than the budget, lent and kept together,
  and no two lent buffers overlap;
- a take blocks until a give-back makes room, in arrival order, and times out;
  once the pool has failed (a transfer failed), waiting and later takes raise
  that failure, its type kept;
- a freed buffer is reused by a take of its size; kept buffers of other sizes
  are dropped when a new one needs their room;
- a buffer larger than the whole budget is refused, naming both sizes;
- several buffers taken at once are all taken, or none while the taker waits
  (Note [all or nothing]);
- the bandwidth probe returns positive figures and leaves no file behind.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from chunkstar.disk import ALIGNMENT, DiskFullError, DiskTierError, StagingBuffers, measure_disk_bandwidth

KiB = 1 << 10
MiB = 1 << 20


def test_concurrent_takers_never_exceed_the_budget() -> None:
    budget = 1 * MiB
    pool = StagingBuffers(budget, aligned=True)
    sizes = [64 * KiB, 128 * KiB, 192 * KiB, 512 * KiB]
    lock = threading.Lock()
    lent = [0]
    peak = [0]
    errors: list[str] = []

    def taker(i: int) -> None:
        rng = random.Random(i)
        for _ in range(60):
            n = rng.choice(sizes)
            t = pool.take(n, torch.float32 if n % 4 == 0 else torch.uint8, timeout=20)
            with lock:
                lent[0] += n
                peak[0] = max(peak[0], lent[0])
                if lent[0] > budget or pool.held_bytes > budget:
                    errors.append(f"lent {lent[0]}, held {pool.held_bytes} > {budget}")
            if t.data_ptr() % ALIGNMENT:
                errors.append("unaligned buffer")
            t.fill_(i)  # another taker's buffer overlapping this one would change it
            time.sleep(rng.uniform(0, 0.001))
            if not torch.all(t == i):
                errors.append(f"buffer of taker {i} changed under it")
            with lock:
                lent[0] -= n
            pool.give_back(t)

    threads = [threading.Thread(target=taker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.in_use_bytes == 0 and pool.held_bytes <= budget
    assert pool.peak_in_use_bytes <= budget and peak[0] > budget // 2, "the takers should have filled the budget"
    assert pool.allocations < 6 * 60, "freed buffers should have been reused"


def test_a_take_blocks_until_a_give_back_makes_room_in_arrival_order() -> None:
    pool = StagingBuffers(4 * MiB)
    a = pool.take(3 * MiB)
    order: list[str] = []

    def take(name: str, n: int) -> None:
        t = pool.take(n, timeout=10)
        order.append(name)
        time.sleep(0.02)
        pool.give_back(t)

    big = threading.Thread(target=take, args=("big", 4 * MiB))
    big.start()
    time.sleep(0.05)
    small = threading.Thread(target=take, args=("small", 1 * MiB))  # would fit now, but arrived later
    small.start()
    time.sleep(0.05)
    assert order == [], "a take went ahead of the budget"
    pool.give_back(a)
    big.join()
    small.join()
    assert order == ["big", "small"]
    assert pool.held_bytes <= 4 * MiB

    held = pool.take(4 * MiB)
    with pytest.raises(TimeoutError, match="lent out"):
        pool.take(1 * MiB, timeout=0.05)
    pool.give_back(held)


def test_a_failed_pool_ends_every_wait_with_the_failure() -> None:
    pool = StagingBuffers(4 * MiB)
    held = pool.take(4 * MiB)  # lent to a write-behind that will fail
    seen: list[BaseException] = []

    def waiter() -> None:
        try:
            pool.take(1 * MiB, timeout=10)
        except BaseException as e:
            seen.append(e)

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    failure = DiskFullError("/some/dir/chunkstar-r0-master.chunks", 4 * MiB, 0, where="chunk 3 of list 'master'")
    pool.fail(failure)
    pool.fail(DiskTierError("a later failure"))  # the first one is kept
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads), "a take still waits on a failed pool"
    assert len(seen) == 2 and all(isinstance(e, DiskFullError) and e.__cause__ is failure for e in seen)
    assert "chunk 3 of list 'master'" in str(seen[0]) and seen[0].path == failure.path
    with pytest.raises(DiskFullError, match="chunk 3"):
        pool.take(1 * MiB)  # later takes too, even with room
    pool.give_back(held)  # buffers still come back
    assert pool.in_use_bytes == 0 and pool.failure is failure


def test_freed_buffers_are_reused_and_kept_ones_make_room() -> None:
    pool = StagingBuffers(4 * MiB)
    a = pool.take(3 * MiB, torch.float32)
    ptr = a.data_ptr()
    pool.give_back(a)
    b = pool.take(3 * MiB, torch.bfloat16)
    assert b.data_ptr() == ptr and b.dtype == torch.bfloat16 and b.numel() == 3 * MiB // 2
    assert pool.allocations == 1
    pool.give_back(b)
    c = pool.take(2 * MiB)  # 3 MiB kept + 2 MiB new > 4 MiB: the kept one goes
    assert pool.held_bytes == 2 * MiB and pool.allocations == 2
    with pytest.raises(ValueError, match="not lent by this staging pool"):
        pool.give_back(torch.empty(4))
    pool.give_back(c)
    with pytest.raises(ValueError, match="given back already"):
        pool.give_back(c)
    pool.release_kept()
    assert pool.held_bytes == 0


def test_a_buffer_larger_than_the_budget_is_refused() -> None:
    pool = StagingBuffers(8 * MiB)
    with pytest.raises(ValueError) as info:
        pool.take(16 * MiB)
    msg = str(info.value)
    assert "16.00 MiB (16777216 bytes)" in msg and "8.00 MiB (8388608 bytes)" in msg
    with pytest.raises(ValueError, match="whole number of torch.float32"):
        pool.take(6, torch.float32)


@pytest.mark.parametrize("direct", [True, False])
def test_the_bandwidth_probe_returns_positive_figures_and_cleans_up(tmp_path: Path, direct: bool) -> None:
    (tmp_path / "keep.txt").write_text("x")
    bw = measure_disk_bandwidth(tmp_path, nbytes=24 * MiB, block=4 * MiB, direct=direct)
    assert bw.write_bytes_per_s > 0 and bw.read_bytes_per_s > 0
    assert bw.nbytes == 24 * MiB and bw.block == 4 * MiB and bw.directory == str(tmp_path)
    assert bw.direct is False or direct
    assert os.listdir(tmp_path) == ["keep.txt"]


def test_take_all_takes_every_buffer_at_once_or_none() -> None:
    """Note [all or nothing]: an update's buffers are taken together; a request that does not
    fit takes nothing while it waits, so it cannot hold part of the pool another taker needs."""
    pool = StagingBuffers(4 * MiB)
    a, b = pool.take_all([(1 * MiB, torch.float32), (2 * MiB, torch.bfloat16)])
    assert (a.dtype, a.numel(), b.dtype, b.numel()) == (torch.float32, MiB // 4, torch.bfloat16, MiB)
    assert pool.in_use_bytes == 3 * MiB
    with pytest.raises(TimeoutError):
        pool.take_all([(512 << 10, torch.uint8), (1 * MiB, torch.uint8)], timeout=0.05)  # 1.5 MiB: 1 MiB free
    assert pool.in_use_bytes == 3 * MiB  # the half that would have fitted was not taken
    pool.give_back(b)
    c, d = pool.take_all([(512 << 10, torch.uint8), (1 * MiB, torch.uint8)])
    assert pool.in_use_bytes == 3 * MiB - 2 * MiB + (3 * MiB) // 2
    for t in (a, c, d):
        pool.give_back(t)
    assert pool.in_use_bytes == 0 and pool.held_bytes <= 4 * MiB
    with pytest.raises(ValueError, match="at once cannot fit"):
        pool.take_all([(3 * MiB, torch.uint8), (2 * MiB, torch.uint8)])
    with pytest.raises(ValueError, match="whole number"):
        pool.take_all([(1 * MiB, torch.uint8), (3, torch.float32)])
    assert pool.in_use_bytes == 0
