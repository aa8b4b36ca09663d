"""Copy engines (chunkstar.device): the CPU copy thread, the serial path, the emulated link,
and the host worker that runs the optimizer's updates off the compute thread.

- the copy thread overlaps: queued copies return at once, waits are real, and
  the two directions run at once (a PCIe link copies both ways);
- a copy handed host-side work as ``after`` starts once that work is done;
- ``device_link_bandwidth`` makes every copy take at least bytes / bandwidth;
- random copy delays (``CHUNKSTAR_DEBUG_COPY_DELAY_MS``) leave training exact: a
  missing wait would read half a copy and change the losses;
- ``overlap: false`` (the serial reference) trains exactly like the overlapped path.
"""

from __future__ import annotations

import time

import pytest
import torch

import chunkstar
from chunkstar.device.copy_engine import (
    DEBUG_DELAY_ENV,
    CopyThread,
    HostWorker,
    InlineWorker,
    SerialCopies,
    debug_delay_from_env,
)

from tests.core._models import CASES, DTYPES, assert_losses_close, engine_config, eviction_budget, train_engine, train_reference


def test_the_copy_thread_overlaps_and_its_events_wait() -> None:
    copies = CopyThread(bandwidth=100e6)  # 100 MB/s: 4 MB take >= 40 ms each
    src = torch.arange(1 << 20, dtype=torch.float32)
    dsts = [torch.empty_like(src) for _ in range(3)]
    t0 = time.perf_counter()
    events = [copies.to_device(d, src) for d in dsts]
    queued = time.perf_counter() - t0
    assert queued < 0.03, f"queueing three copies took {queued:.3f} s: the copies ran in the caller"
    for e in events:
        e.wait()
    took = time.perf_counter() - t0
    assert took >= 3 * 0.04 * 0.95, f"three 4 MB copies at 100 MB/s took {took:.3f} s"
    assert all(torch.equal(d, src) for d in dsts)
    copies.close()


def test_the_serial_path_copies_before_returning_at_the_link_bandwidth() -> None:
    copies = SerialCopies(bandwidth=200e6)
    src = torch.ones(1 << 20)
    dst = torch.zeros_like(src)
    t0 = time.perf_counter()
    event = copies.to_host(dst, src)
    assert time.perf_counter() - t0 >= 4e6 / 200e6 * 0.95
    assert event.done() and torch.equal(dst, src)


def test_a_failed_copy_is_raised_where_it_is_waited_for() -> None:
    copies = CopyThread()
    event = copies.to_host(torch.empty(4), torch.empty(5))  # sizes differ: copy_ fails on the thread
    with pytest.raises(RuntimeError, match="worker thread"):
        event.wait()
    copies.close()


def test_the_copy_thread_copies_both_ways_at_once() -> None:
    copies = CopyThread(bandwidth=100e6)  # 4 MB: >= 40 ms each way
    src = torch.ones(1 << 20)
    up, down = torch.zeros_like(src), torch.zeros_like(src)
    t0 = time.perf_counter()
    events = [copies.to_device(up, src), copies.to_host(down, src)]
    for e in events:
        e.wait()
    took = time.perf_counter() - t0
    assert 0.04 * 0.95 <= took < 0.075, f"a copy each way took {took:.3f} s together: the directions did not overlap"
    assert torch.equal(up, src) and torch.equal(down, src)
    copies.close()


@pytest.mark.parametrize("engine", [CopyThread, SerialCopies])
def test_a_copy_starts_after_the_host_work_it_is_given(engine: type) -> None:
    worker = HostWorker()
    src = torch.zeros(1000)

    def update() -> None:
        time.sleep(0.05)  # the copy must not read the old values meanwhile
        src.fill_(7.0)

    work = worker.submit(update)
    dst = torch.empty_like(src)
    engine().to_device(dst, src, after=work).wait()
    assert torch.equal(dst, torch.full_like(src, 7.0))
    worker.close()


def test_host_work_runs_in_order_off_the_calling_thread_and_failures_reach_the_waiter() -> None:
    worker = HostWorker()
    seen: list[int] = []
    t0 = time.perf_counter()
    first = worker.submit(lambda: (time.sleep(0.05), seen.append(1)) and None)
    second = worker.submit(lambda: seen.append(2))
    assert time.perf_counter() - t0 < 0.03 and not second.done()
    second.wait()
    assert first.done() and seen == [1, 2]
    failed = worker.submit(lambda: torch.empty(4).copy_(torch.empty(5)) and None)
    with pytest.raises(RuntimeError, match="worker thread"):
        failed.wait()
    worker.submit(lambda: seen.append(3)).wait()  # the worker goes on after a failure
    assert seen == [1, 2, 3]
    worker.close()


def test_the_inline_worker_is_done_when_submit_returns() -> None:
    seen: list[int] = []
    event = InlineWorker().submit(lambda: seen.append(1))
    assert event.done() and seen == [1]


@pytest.mark.parametrize(("raw", "want"), [("", None), ("5", (0.005, 0.005)), ("0-20", (0.0, 0.02))])
def test_debug_delay_setting(raw: str, want: tuple[float, float] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEBUG_DELAY_ENV, raw)
    assert debug_delay_from_env() == want


@pytest.mark.parametrize("raw", ["fast", "20-5", "-3"])
def test_a_bad_debug_delay_setting_names_the_variable(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEBUG_DELAY_ENV, raw)
    with pytest.raises(ValueError, match=DEBUG_DELAY_ENV):
        debug_delay_from_env()


@pytest.mark.parametrize(("name", "dtype"), [("gpt2", "fp32"), ("gpt2", "bf16"), ("bert", "fp32")])
def test_training_stays_exact_with_random_copy_delays(name: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEBUG_DELAY_ENV, "0-4")
    case = CASES[name]
    want = train_reference(case, 4, dtype=dtype)
    config = engine_config(dtype, budget=eviction_budget(case.build(), DTYPES[dtype]), device_link_bandwidth="2GB/s")
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, config)
    got = train_engine(engine, optimizer, case, 4, dtype=dtype)
    assert_losses_close(got, want, {"fp32": 1e-5, "bf16": 3e-2}[dtype], f"{name}/{dtype} with copy delays")
    stats = engine.stats()
    assert stats["chunk_moves_to_host"] > 0
    if name == "gpt2":  # gradients went to the host during backward (the gradient pipeline)
        assert stats["moves_by_reason"]["offload"] > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_serial_reference_path_trains_like_the_overlapped_one_bit_for_bit(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offloaded gradients, their norms and the host updates on the worker (with random
    delays) give the same bits as the serial path, which does the same work in place."""
    monkeypatch.setenv(DEBUG_DELAY_ENV, "0-3")
    case = CASES["gpt2"]
    budget = eviction_budget(case.build(), DTYPES[dtype])
    losses, states = [], []
    for overlap in (True, False):
        engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config(dtype, budget=budget, overlap=overlap))
        losses.append(train_engine(engine, optimizer, case, 5))
        states.append(engine.state_dict())
        assert engine.stats()["moves_by_reason"]["offload"] > 0
    assert losses[0] == losses[1]
    for k, v in states[0].items():
        assert torch.equal(v, states[1][k]), k


@pytest.mark.parametrize(("value", "bps"), [("16GB/s", 16e9), ("1.5 GiB/s", 1.5 * 2**30), (8_000_000, 8e6)])
def test_device_link_bandwidth_parses(value: object, bps: float) -> None:
    cfg = chunkstar.parse_config({"device": "cpu", "device_memory_budget": "1MB", "device_link_bandwidth": value})
    assert cfg.placement.link_bandwidth == pytest.approx(bps)


@pytest.mark.parametrize("value", ["fast", 0, -5, "3 parsecs/s", 1, "1KB/s", "999TB/s", 10**30])
def test_a_bad_device_link_bandwidth_names_the_key(value: object) -> None:
    with pytest.raises(chunkstar.ConfigError, match="device_link_bandwidth"):
        chunkstar.parse_config({"device": "cpu", "device_memory_budget": "1MB", "device_link_bandwidth": value})


def test_an_issued_event_waits_to_be_issued_then_for_its_work() -> None:
    """Issued (Note [the step issued behind]): a copy ``after`` it starts once another thread
    has issued the work and the work is done; a failure to issue reaches the waiter, typed."""
    import threading

    from chunkstar.device.copy_engine import Issued
    from chunkstar.disk import DiskTierError

    worker = HostWorker()
    issued = Issued()
    src, dst = torch.zeros(4), torch.empty(4)
    copies = CopyThread()
    copy = copies.to_device(dst, src, after=issued)  # queued before the update exists
    time.sleep(0.05)
    assert not copy.done() and not issued.done()
    gate = threading.Event()
    update = worker.submit(lambda: (gate.wait(), src.fill_(7.0)) and None)
    issued.issue(update)
    assert not issued.done()
    gate.set()
    copy.wait()
    assert torch.equal(dst, torch.full((4,), 7.0)) and issued.done()
    failed = Issued()
    failed.fail(DiskTierError("chunkstar disk tier: reading chunk 3 failed"))
    with pytest.raises(DiskTierError, match="reading chunk 3"):
        failed.wait()
    copies.close()
    worker.close()
    with pytest.raises(RuntimeError, match="after it was closed"):  # never a job that no thread runs
        worker.submit(lambda: None)
