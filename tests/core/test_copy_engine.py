"""Copy engines (chunkstar.device): the CPU copy thread, the serial path, the emulated link.

- the copy thread overlaps: queued copies return at once, waits are real;
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
from chunkstar.device.copy_engine import DEBUG_DELAY_ENV, CopyThread, SerialCopies, debug_delay_from_env

from ._models import CASES, DTYPES, assert_losses_close, engine_config, eviction_budget, train_engine, train_reference


def test_the_copy_thread_overlaps_and_its_events_wait() -> None:
    copies = CopyThread(bandwidth=100e6)  # 100 MB/s: 4 MB take >= 40 ms each
    src = torch.arange(1 << 20, dtype=torch.float32)
    dsts = [torch.empty_like(src) for _ in range(3)]
    t0 = time.perf_counter()
    events = [copies.copy(d, src) for d in dsts]
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
    freed: list[bool] = []
    t0 = time.perf_counter()
    event = copies.copy(dst, src, then=lambda: freed.append(True))
    assert time.perf_counter() - t0 >= 4e6 / 200e6 * 0.95
    assert event.done() and freed == [True] and torch.equal(dst, src)


def test_a_failed_copy_is_raised_where_it_is_waited_for() -> None:
    copies = CopyThread()
    event = copies.copy(torch.empty(4), torch.empty(5))  # sizes differ: copy_ fails on the thread
    with pytest.raises(RuntimeError, match="copy thread"):
        event.wait()
    copies.close()


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
    assert engine.stats()["chunk_moves_to_host"] > 0


def test_the_serial_reference_path_trains_like_the_overlapped_one() -> None:
    case = CASES["gpt2"]
    budget = eviction_budget(case.build(), DTYPES["fp32"])
    losses = []
    for overlap in (True, False):
        engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config("fp32", budget=budget, overlap=overlap))
        losses.append(train_engine(engine, optimizer, case, 4))
    assert losses[0] == losses[1]


@pytest.mark.parametrize(("value", "bps"), [("16GB/s", 16e9), ("1.5 GiB/s", 1.5 * 2**30), (8_000_000, 8e6)])
def test_device_link_bandwidth_parses(value: object, bps: float) -> None:
    cfg = chunkstar.parse_config({"device": "cpu", "device_memory_budget": "1MB", "device_link_bandwidth": value})
    assert cfg.device_link_bandwidth == pytest.approx(bps)


@pytest.mark.parametrize("value", ["fast", 0, -5, "3 parsecs/s"])
def test_a_bad_device_link_bandwidth_names_the_key(value: object) -> None:
    with pytest.raises(chunkstar.ConfigError, match="device_link_bandwidth"):
        chunkstar.parse_config({"device": "cpu", "device_memory_budget": "1MB", "device_link_bandwidth": value})
