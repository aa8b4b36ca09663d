"""The collectives' flat buffers under NCCL are counted once, as scratch (Note [scratch counted
once] in chunkstar/distributed/comm.py; issue 30, item 7).

They were counted as non-model memory too (the CUDA probe reads the allocator, which sees
them like activations) and as scratch by the budgets. Besides the double count, how many
reductions were in flight when a moment began was timing, and the frozen schedule's check
of the live non-model memory could find it grown and re-trace for that alone. Now the probe
leaves the scratch in flight out, the temporaries are allocated and released between the
probe's windows, and a reduction makes room for its own scratch before it starts. No GPU,
no NCCL: collectives are faked (tests/distributed/test_comm_nccl_calls.py), the allocator
too (tests/core/device/test_device_memory.py's way).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch

import chunkstar
from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.state import ChunkLocation, TensorState
from chunkstar.device.memory import DeviceMemory
from chunkstar.distributed.comm import Comm
from chunkstar.distributed.grad_reduce import GroupReducer
from chunkstar.memory.probes import CudaProbe

from tests.core._models import CASES, engine_config
from tests.distributed.test_comm_nccl_calls import WORLD, FakeWorld, world  # noqa: F401  (the fixture)

MB = 1 << 20


def _recording_edge(comm: Comm, seen: list[tuple[str, int]]) -> None:
    @contextlib.contextmanager
    def edge() -> Iterator[None]:
        seen.append(("enter", comm.scratch_bytes_in_flight))
        yield
        seen.append(("exit", comm.scratch_bytes_in_flight))

    comm.scratch_edge = edge


def test_temporaries_start_and_stop_counting_inside_the_edge(world: FakeWorld) -> None:  # noqa: F811
    comm = Comm(0, WORLD, "nccl")
    seen: list[tuple[str, int]] = []
    _recording_edge(comm, seen)
    own = torch.randn(6)
    gather = comm.all_gather_group_async([None, torch.empty_like(own)], own, what="param chunks 0..1")
    flat = comm.gather_scratch_bytes(6, torch.float32, own.device)
    assert seen == [("enter", 0), ("exit", flat)]
    gather.wait()
    gather.wait()  # every chunk of a group waits on it: the release happens once
    assert seen[2:] == [("enter", flat), ("exit", 0)]
    seen.clear()
    reduce = comm.reduce_group_async([torch.randn(8), torch.randn(8)], what="param chunks 2..3")
    scratch = comm.reduce_scratch_bytes(8, torch.float32, torch.device("cpu"))
    assert seen == [("enter", 0), ("exit", scratch)]
    reduce.wait()
    assert seen[2:] == [("enter", scratch), ("exit", 0)]
    # under gloo the temporaries are host memory: no device scratch, no edge
    seen.clear()
    gloo = Comm(0, WORLD, "gloo")
    _recording_edge(gloo, seen)
    gloo.reduce_group_async([torch.randn(8), torch.randn(8)], what="g").wait()
    assert seen == []


class _FakeCudaAllocator:
    """``memory_allocated`` and its peak over the chunk storages, the scratch and ``other`` bytes."""

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory = memory
        self.scratch = 0
        self.other = 0
        self.peak = 0

    def allocated(self) -> int:
        return self.other + self.scratch + self.memory.held_bytes

    def add(self, what: str, n: int) -> None:
        setattr(self, what, getattr(self, what) + n)
        self.peak = max(self.peak, self.allocated())

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated())
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: max(self.peak, self.allocated()))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.allocated()))


def test_the_cuda_probe_counts_scratch_in_flight_apart_from_non_model_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = DeviceMemory(torch.device("cpu"))  # its storages stand in for the GPU's
    fake = _FakeCudaAllocator(memory)
    fake.install(monkeypatch)
    memory.scratch_in_flight = lambda: fake.scratch
    probe = CudaProbe(torch.device("cuda"))
    probe.attach(memory)
    probe.acquire("warm-up")
    fake.add("other", 3 * MB)  # activations
    assert probe.non_model_now(memory.held_bytes) == 3 * MB
    # a reduction starts (its flat buffer and output, allocated inside the edge), then more activations
    with memory.scratch_edge():
        fake.add("scratch", 5 * MB)
    fake.add("other", 1 * MB)
    # the moment begins with the reduction in flight or landed: the same live non-model memory,
    # so the frozen schedule's check cannot see growth in timing alone
    assert probe.non_model_now(memory.held_bytes) == 4 * MB
    with memory.scratch_edge():
        fake.add("scratch", -5 * MB)
    assert probe.non_model_now(memory.held_bytes) == 4 * MB
    # the moment's peak: 4 MB of activations, never the scratch (which budgets count on their own)
    assert probe.take_peak(memory.held_bytes) == 4 * MB
    probe.release("warm-up")


def test_a_reduction_makes_room_for_its_scratch_before_it_starts(world: FakeWorld) -> None:  # noqa: F811
    """The measured non-model memory leaves the scratch out, so the reduction, which starts in
    the middle of a backward moment, makes room for its own flat buffers first."""
    comm = Comm(0, WORLD, "nccl")
    log: list[Any] = []
    n = 16
    payloads = {0: torch.randn(n), 1: torch.randn(n)}
    slots = {k: [SimpleNamespace(index=k, offset=0, end=n)] for k in payloads}
    states = [TensorState.HOLD_AFTER_BWD, TensorState.HOLD_AFTER_BWD]
    mgr = SimpleNamespace(
        layout=SimpleNamespace(group=lambda c: range(0, WORLD), world_size=WORLD),
        chunks=SimpleNamespace(
            chunk=lambda name, k: SimpleNamespace(numel=n, payload=payloads[k], location=ChunkLocation.DEVICE),
            staged=lambda keys, write: contextlib.nullcontext(),
        ),
        resident=lambda key: True,
        # the collectives issued by then (the fake world records each as it is called)
        make_room=lambda need, protect, where, required=(): log.append((need, sorted(protect), world.names())),
        paused_probe=contextlib.nullcontext,
        grads_in=lambda k: 1,
        slots_of=lambda k: slots[k],
        states=states,
        set_state=lambda i, s: states.__setitem__(i, s),
        pinned=lambda k: False,
        gathers=SimpleNamespace(release=lambda g: None),
    )
    reducer = GroupReducer(mgr, comm, torch.device("meta"), params=[])  # type: ignore[arg-type]
    reducer._reduce(0)
    scratch = comm.reduce_scratch_bytes(n, torch.float32, torch.device("meta"))
    assert scratch == (WORLD + 1) * n * 4
    keys = [(ChunkList.PARAM, 0), (ChunkList.PARAM, 1)]
    assert log == [(scratch, keys, [])], log  # room made before anything was issued
    assert world.names() == ["reduce_scatter_flat"]


def test_the_chunk_manager_wires_the_scratch_to_the_probe_and_the_edge_to_the_comm() -> None:
    case = CASES["mlp"]
    engine, _ = chunkstar.initialize_engine(case.build, 0, engine_config("fp32", budget="1GB"))
    mgr = engine.mgr
    assert mgr.comm.scratch_edge == mgr.memory.scratch_edge
    assert mgr.memory.scratch_in_flight() == mgr.comm.scratch_bytes_in_flight == 0
    engine.close()
