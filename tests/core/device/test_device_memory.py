"""The strict virtual device: deferred frees shared by both devices, backward on a device
thread, and the meter of what the device really holds (chunkstar/device/memory.py,
chunkstar/device/virtual.py).

- an eviction's device bytes stay held (and counted) until its copy is done, and are
  freed by whichever thread polls first: a free must not wait for the thread that built
  the engine (on CUDA the backward, with its evictions, runs on autograd's own thread);
- a budget that needs bytes still in flight waits for exactly those copies;
- a chunk brought back before its free ran keeps its bytes and gets the right values;
- the backward runs off the caller's thread, as autograd runs it for CUDA tensors, with
  the caller's dispatch modes, and its exceptions reach the caller;
- the meter sees activations beside the chunks, and under a budget that forces evictions
  with random copy delays it never goes over the budget (warm-up included);
- the CUDA probe closes a window whenever the chunk bytes change, so a moment's peak
  never subtracts the chunk bytes of another instant.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import chunkstar
from chunkstar.chunk.chunk import Chunk
from chunkstar.device import threads as device_threads
from chunkstar.device.copy_engine import DEBUG_DELAY_ENV, CopyThread, HostWorker
from chunkstar.device.memory import METER_ENV, DeviceMemory
from chunkstar.device.virtual import STRICT_ENV, DeviceThread
from chunkstar.events import Tier
from chunkstar.memory.probes import CudaProbe
from chunkstar.memory.tracer import TracePhase

from tests.core._models import CASES, DTYPES, engine_config, eviction_budget, train_engine


def _chunk(memory: DeviceMemory, n: int = 1 << 16) -> Chunk:
    c = Chunk(0, "param", n, torch.float32, torch.device("cpu"), memory=memory)
    c.allocate(Tier.HOST)
    c.payload.copy_(torch.arange(float(n)))
    return c


def test_an_evictions_bytes_stay_held_until_its_copy_is_done_and_any_thread_frees_them() -> None:
    memory = DeviceMemory(torch.device("cpu"))
    copies = CopyThread(delay=(0.05, 0.05))
    c = _chunk(memory)
    c.move_to(Tier.DEVICE, copies)
    c.wait_ready()
    c.move_to(Tier.HOST, copies)  # the copy out waits 50 ms on the copy thread
    assert memory.held_bytes == c.nbytes and memory.pending_bytes == c.nbytes
    assert memory.reap() == 0  # not done yet: nothing may be freed
    assert c.device_view.untyped_storage().nbytes() == c.nbytes
    c.pending_copy.wait()
    freed: list[int] = []
    t = threading.Thread(target=lambda: freed.append(memory.reap()))  # not the thread that made the chunk
    t.start()
    t.join()
    assert freed == [c.nbytes] and memory.held_bytes == 0 and memory.pending_bytes == 0
    assert c.device_view.untyped_storage().nbytes() == 0
    copies.close()


class _Copy:
    """A copy out that finishes when it is waited for (``order``), or when ``finish`` says."""

    def __init__(self) -> None:
        self.finished = False
        self.ordered = False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.finished = True

    def order(self) -> None:
        self.ordered = self.finished = True


def test_settle_waits_for_the_oldest_copies_it_needs_and_reap_for_none() -> None:
    memory = DeviceMemory(torch.device("cpu"))
    storages = [torch.UntypedStorage(0) for _ in range(3)]
    copies = [_Copy() for _ in storages]
    for st, cp in zip(storages, copies):
        memory.grow(st, 1000)
        memory.free_after(st, cp)
    assert memory.held_bytes == 3000 and memory.pending_bytes == 3000
    copies[2].finished = True  # the newest copy is done: a poll frees it without waiting
    assert memory.reap() == 1000 and not any(c.ordered for c in copies)
    assert memory.settle(500) == 1000  # the oldest copy is waited for (ordered), its bytes freed
    assert copies[0].ordered and not copies[1].ordered
    assert memory.held_bytes == 1000 and memory.frees_settled == 1
    memory.close()
    assert memory.held_bytes == 0 and memory.pending_bytes == 0
    assert all(st.nbytes() == 0 for st in storages)


def test_a_chunk_brought_back_before_its_free_ran_keeps_its_bytes_and_its_values() -> None:
    memory = DeviceMemory(torch.device("cpu"))
    copies = CopyThread(delay=(0.02, 0.03))
    c = _chunk(memory)
    c.move_to(Tier.DEVICE, copies)
    c.wait_ready()
    c.payload.mul_(2)  # written on the device: the eviction must copy it out
    c.move_to(Tier.HOST, copies)
    c.move_to(Tier.DEVICE, copies)  # back at once, the copy out still in flight
    assert memory.reclaims == 1 and memory.pending_bytes == 0 and memory.held_bytes == c.nbytes
    c.wait_ready()
    assert torch.equal(c.payload, 2 * torch.arange(float(c.numel)))
    memory.reap()
    assert c.device_view.untyped_storage().nbytes() == c.nbytes  # a late poll frees nothing it should not
    copies.close()


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.threads: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.threads.add(threading.get_ident())
        return func(*args, **(kwargs or {}))


def test_the_device_thread_runs_the_backward_with_the_callers_modes_and_raises_its_errors() -> None:
    device = DeviceThread()
    x = torch.randn(8, requires_grad=True)
    seen: list[int] = []
    x.register_hook(lambda g: seen.append(threading.get_ident()) or g)
    loss = (x * 3).sum()
    with _CountOps() as mode:
        device.run(loss.backward)
    assert seen == [device.ident] and device.ident != threading.get_ident()
    assert device.ident in mode.threads  # the caller's dispatch mode saw the backward's ops
    assert torch.equal(x.grad, torch.full((8,), 3.0))

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):  # type: ignore[no-untyped-def]
            return t.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def]
            raise ValueError("boom in backward")

    with pytest.raises(ValueError, match="boom in backward"):
        device.run(Boom.apply(x).sum().backward)
    device.close()


def test_the_engines_backward_and_its_evictions_run_off_the_callers_thread() -> None:
    """On the virtual device as on CUDA: gradient hooks (and the evictions and gradient
    offloads they cause) run on the device thread, and their frees still happen."""
    case = CASES["gpt2"]
    budget = eviction_budget(case.build(), DTYPES["fp32"])
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config("fp32", budget=budget))
    threads: set[int] = set()
    for p in engine.module.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: threads.add(threading.get_ident()))
    train_engine(engine, optimizer, case, 3)
    assert threads and threading.get_ident() not in threads
    stats = engine.stats()
    assert stats["chunk_moves_to_host"] > 0 and stats["deferred_frees"] > 0
    assert stats["device_peak_bytes"] <= stats["device_budget_bytes"]


def test_without_the_strict_device_the_backward_runs_where_pytorch_runs_a_cpu_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [strict device]: the device thread (and its OpenMP team, Note [one OpenMP team])
    is the strict device's, which the suite turns on; a training run's backward runs on the
    caller's thread, and trains exactly as the strict device's does."""
    case = CASES["gpt2"]
    budget = eviction_budget(case.build(), DTYPES["fp32"])
    runs = []
    for strict in ("1", ""):
        monkeypatch.setenv(STRICT_ENV, strict)
        engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config("fp32", budget=budget))
        threads: set[int] = set()
        for p in engine.module.parameters():
            p.register_post_accumulate_grad_hook(lambda _p: threads.add(threading.get_ident()))
        losses = train_engine(engine, optimizer, case, 3)
        if strict:
            assert threads and threading.get_ident() not in threads
        else:
            assert threads == {threading.get_ident()}
        runs.append((losses, {k: v.clone() for k, v in engine.module.state_dict().items()}))
        assert engine.stats()["chunk_moves_to_host"] > 0
        engine.close()
    assert runs[0][0] == runs[1][0]
    for k, v in runs[0][1].items():
        assert torch.equal(v, runs[1][1][k]), k


@pytest.mark.parametrize("env", [STRICT_ENV, METER_ENV])
@pytest.mark.parametrize("value", ["true", "yes", "2"])
def test_a_misspelt_strict_or_meter_switch_is_refused(env: str, value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A switch that says something else than 1 or 0 would leave the run quietly without the
    strict device (or the meter) it asked for."""
    monkeypatch.setenv(env, value)
    case = CASES["mlp"]
    with pytest.raises(ValueError, match=f"{env}='{value}': expected 1 \\(on\\) or 0 \\(off\\)"):
        chunkstar.initialize_engine(case.build, 0, engine_config("fp32", budget="1GB"))
    monkeypatch.setenv(env, "0")
    monkeypatch.setenv(STRICT_ENV if env == METER_ENV else METER_ENV, "0")
    engine, _ = chunkstar.initialize_engine(case.build, 0, engine_config("fp32", budget="1GB"))
    assert engine._device_thread is None
    engine.close()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: nothing to narrow")
@pytest.mark.skipif(device_threads._OMP_SET_NUM_THREADS is None, reason="torch without a global OpenMP runtime: no teams to keep")
def test_the_cpu_devices_helper_threads_run_torch_ops_on_themselves_alone() -> None:
    """Note [one OpenMP team]: a copy lane or the host worker that ran a multi-threaded op would
    keep an OpenMP team for life, and every later op of the compute thread would wake its own
    team from a futex; their ops run on one thread, the compute thread keeps its width."""
    width = torch.get_num_threads()
    copies = CopyThread()
    seen: list[int] = []
    dst, src = torch.empty(1 << 20), torch.randn(1 << 20)
    copies.to_device(dst, src).wait()
    copies.to_host(src, dst).wait()
    worker = HostWorker(device=torch.device("cpu"))
    worker.submit(lambda: seen.append(torch.get_num_threads())).wait()
    for lane in (copies._to_device, copies._to_host):
        lane.submit(lambda: seen.append(torch.get_num_threads())).wait()
    assert seen == [1, 1, 1] and torch.get_num_threads() == width
    copies.close()
    worker.close()


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: nothing to narrow")
@pytest.mark.skipif(device_threads._OMP_SET_NUM_THREADS is None, reason="torch without a global OpenMP runtime: no teams to keep")
@pytest.mark.parametrize("hybrid", [True, False])
def test_the_host_worker_widens_only_when_the_frozen_schedule_gives_it_updates(hybrid: bool) -> None:
    """Note [one OpenMP team]: everything fits, so hybrid Adam puts every update on the device and
    the worker stays narrow (no team to slow the compute thread); with hybrid Adam off every
    update runs on the worker, at the process's width once the trace froze."""
    case = CASES["mlp"]
    config = {**engine_config("fp32", budget="1GB"), "hybrid_adam": hybrid}
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, config)
    width = torch.get_num_threads()
    widths: list[int] = []
    for step in range(4):
        train_engine(engine, optimizer, case, range(step, step + 1))
        engine.host_work.submit(lambda: widths.append(torch.get_num_threads())).wait()
    assert engine.schedule.phase is TracePhase.FROZEN
    assert widths[0] == 1  # warm-up: narrow either way
    assert widths[-1] == (1 if hybrid else width), widths
    assert torch.get_num_threads() == width
    engine.close()


@pytest.mark.parametrize("delay", ["", "0-4"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_meter_sees_activations_and_stays_under_the_budget_with_copy_delays(
    dtype: str, delay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DEBUG_DELAY_ENV, delay)
    case = CASES["gpt2"]
    budget = eviction_budget(case.build(), DTYPES[dtype])
    config = engine_config(dtype, budget=budget, device_link_bandwidth="2GB/s")
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, config)
    train_engine(engine, optimizer, case, 4, dtype=dtype)
    stats = engine.stats()
    assert stats["chunk_moves_to_host"] > 0
    # the meter counts the non-model bytes beside the chunks: more than the chunks alone
    assert stats["device_peak_bytes"] > stats["device_chunk_bytes_peak"]
    assert stats["device_peak_bytes"] <= budget, stats["device_first_overrun"]


class _FakeCudaAllocator:
    """``memory_allocated`` / ``max_memory_allocated`` / ``reset_peak_memory_stats`` over the
    device memory's chunk storages plus ``other`` bytes (the activations)."""

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory = memory
        self.other = 0
        self.peak = 0

    def allocated(self) -> int:
        return self.other + self.memory.held_bytes

    def alloc(self, n: int) -> None:
        self.other += n
        self.peak = max(self.peak, self.allocated())

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated())
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: max(self.peak, self.allocated()))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.allocated()))


def test_the_cuda_probe_takes_a_moments_peak_against_the_chunk_bytes_of_the_same_instant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A moment holds 4 MB of chunks and 1 MB of activations, then offloads the chunks and
    allocates 3 MB more: its non-model peak is 4 MB (1 + 3), not the 5 MB a peak taken
    against the chunk bytes at its end would say."""
    memory = DeviceMemory(torch.device("cpu"))  # its storages stand in for the GPU's
    fake = _FakeCudaAllocator(memory)
    fake.install(monkeypatch)
    probe = CudaProbe(torch.device("cuda"))
    probe.attach(memory)
    storage = torch.UntypedStorage(0)
    memory.grow(storage, 4 << 20)
    probe.acquire("warm-up")
    fake.alloc(1 << 20)  # activations beside the chunk
    memory.free(storage)  # the chunk leaves: a window closes (peak 5 MB against 4 MB of chunks)
    fake.alloc(3 << 20)  # more activations, no chunk on the device
    assert probe.take_peak(memory.held_bytes) == 4 << 20
    assert probe.non_model_now(memory.held_bytes) == 4 << 20
    # an eviction in flight: its bytes are still allocated, and they are not non-model memory
    memory.grow(storage, 2 << 20)
    memory.free_after(storage, _Copy())
    assert memory.pending_bytes == 2 << 20
    assert probe.non_model_now(memory.held_bytes) == 4 << 20
    probe.release("warm-up")
    assert memory.peak_bytes == 6 << 20  # the meter kept the allocator's peak across the resets


def test_a_chunk_brought_back_orders_its_copy_in_after_the_copy_out_without_a_host_wait() -> None:
    """Finding: a reload of a chunk whose copy to the host was in flight blocked the host
    (a synchronize). It now orders the compute stream after that copy (``order``), and the
    bytes whose free had not run are reclaimed rather than allocated again."""

    class HostWaitForbidden(_Copy):
        def wait(self) -> None:
            raise AssertionError("the host waited for the copy out")

    class Engine:
        def to_device(self, dst, src, *, prefetch=False, after=None):  # type: ignore[no-untyped-def]
            dst.copy_(src)
            return _Copy()

        def to_host(self, dst, src):  # type: ignore[no-untyped-def]
            dst.copy_(src)  # the bytes land at once; the event says "not done" until waited for
            return copy_out

        def close(self) -> None:
            pass

    memory = DeviceMemory(torch.device("cpu"))
    c = _chunk(memory, 64)
    copy_out = HostWaitForbidden()
    c.move_to(Tier.DEVICE, Engine())  # type: ignore[arg-type]
    c.device_view.mul_(3)
    c.mark_dirty()
    c.move_to(Tier.HOST, Engine())  # type: ignore[arg-type]
    assert memory.pending_bytes == c.nbytes
    c.move_to(Tier.DEVICE, Engine())  # type: ignore[arg-type]
    assert copy_out.ordered and memory.reclaims == 1 and memory.held_bytes == c.nbytes


def test_worker_threads_wait_on_cuda_events_on_the_engines_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding: the host worker synchronizes CUDA events with no device set (a context on GPU 0
    for every rank). Its thread now sets the engine's device first."""
    from chunkstar.device.copy_engine import HostWorker

    calls: list[tuple[object, int]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((d, threading.get_ident())))
    worker = HostWorker(device=torch.device("cuda", 1))
    seen: list[int] = []
    worker.submit(lambda: seen.append(threading.get_ident())).wait()
    worker.close()
    assert calls == [(torch.device("cuda", 1), seen[0])] and seen[0] != threading.get_ident()


def test_chunk_payloads_come_from_the_allocator_the_activations_use() -> None:
    """Finding: a private ``MemPool`` kept the bytes evicted chunks freed away from
    activations (a live pool's free blocks never serve other allocations). No part of the
    engine routes allocations to a pool of its own."""
    from pathlib import Path

    core = Path(chunkstar.__file__).parent
    users = [p.name for p in core.rglob("*.py") if "MemPool" in p.read_text() or "use_mem_pool" in p.read_text()]
    assert users == []
