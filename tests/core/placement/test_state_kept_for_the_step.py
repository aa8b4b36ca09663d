"""Optimizer state hybrid Adam keeps on the device (issue 30, item 7).

- Note [state kept for the step] (placement/eviction.py): such a chunk is reserved: it goes
  only when the others cannot make the room the moment must have, never first (the trace
  never uses it, so furthest-next-use took it before anything else), and never to reach a
  warm-up moment's lower target;
- Note [pinned once it travels] (chunk/chunk.py): a state chunk starts in plain host memory
  and is pinned once it comes back from the device, so every later move is asynchronous on
  CUDA (a pageable one is a blocking copy plus a stream sync). No GPU here: a recording
  pool stands in for the pinned buffers, and the store's wiring is read with a recording
  ``Chunk``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import chunkstar
from chunkstar.chunk import store as store_module
from chunkstar.chunk.chunk import Chunk
from chunkstar.chunk.layout import build_layout
from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.state import ChunkLocation
from chunkstar.device.copy_engine import SerialCopies
from chunkstar.device.memory import DeviceMemory
from chunkstar.events import Tier
from chunkstar.placement.eviction import ResidentChunk, choose_evictions

from tests.core._models import CASES, engine_config, gpt2_batch, n_unique_params, train_engine


# ---------------------------------------------------------------------------- the policy


def _c(key: str, nbytes: int, next_use: int | None, reserved: bool = False) -> ResidentChunk:
    return ResidentChunk(key, nbytes, next_use, 0, reserved)


@pytest.mark.parametrize("policy", ["furthest_next_use", "lru"])
def test_reserved_state_goes_only_when_the_others_cannot_make_the_room(policy: str) -> None:
    cands = [_c("master0", 30, None, reserved=True), _c("p1", 10, 3), _c("p2", 10, 7), _c("exp_avg0", 30, None, reserved=True)]
    # before: the state chunks (never used by the trace) went first
    assert choose_evictions(cands, 10, policy) == (["p2"] if policy == "furthest_next_use" else ["p1"])
    assert sorted(choose_evictions(cands, 20, policy) or []) == ["p1", "p2"]
    # the params are not enough: the state goes, as little of it as must
    assert choose_evictions(cands, 40, policy) == (["p2", "p1", "master0"] if policy == "furthest_next_use" else ["p1", "p2", "master0"])
    assert choose_evictions(cands, 81, policy) is None


def test_a_lower_target_than_the_budget_does_not_take_reserved_state() -> None:
    """A warm-up moment keeps only its own chunks (target 0): the params go, the state stays
    while the budget holds it (``must_bytes``: what the budget itself asks)."""
    cands = [_c("master0", 30, None, reserved=True), _c("p1", 10, 3), _c("p2", 10, 7)]
    assert sorted(choose_evictions(cands, 50, "furthest_next_use", must_bytes=0) or []) == ["p1", "p2"]
    assert choose_evictions(cands, 50, "furthest_next_use", must_bytes=25) == ["p2", "p1", "master0"]
    assert choose_evictions([_c("master0", 30, None, reserved=True)], 50, "lru", must_bytes=0) == []
    assert choose_evictions([], 50, "lru", must_bytes=0) == []
    assert choose_evictions([], 50, "lru", must_bytes=1) is None


# ---------------------------------------------------------------------------- through the engine


def _state_on_device(engine: chunkstar.ChunkEngine) -> dict[ChunkList, set[int]]:
    lists = (ChunkList.MASTER, ChunkList.EXP_AVG, ChunkList.EXP_AVG_SQ)
    return {n: {c.chunk_id for c in engine.mgr.chunks.chunks_of(n) if c.location is ChunkLocation.DEVICE} for n in lists}


def test_a_forward_that_traces_again_keeps_hybrid_adams_state_on_the_device() -> None:
    """Finding: the state hybrid Adam placed on the device was the first thing evicted in the
    forward (a re-traced iteration evicted all of it, and the step brought it back). A bigger
    batch makes the iteration trace again; the state stays where the plan put it."""
    case = CASES["gpt2"]
    budget = 6 * n_unique_params(case.build()) * 4  # roomy: hybrid Adam keeps state on the device
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config("fp32", budget=budget))
    train_engine(engine, optimizer, case, 3)
    placed = _state_on_device(engine)
    assert engine.stats()["device_adam_chunks"] > 0 and all(placed.values()), placed
    evictions = engine.stats()["moves_by_reason"].get("eviction", 0)
    out = engine(**gpt2_batch(3, batch=8))  # inputs far larger than traced: this iteration traces again
    engine.backward(out.loss)
    assert engine.stats()["replans"] == 1
    assert _state_on_device(engine) == placed
    optimizer.step()
    optimizer.zero_grad()
    stats = engine.stats()
    assert stats["device_peak_bytes"] <= stats["device_budget_bytes"], stats["device_first_overrun"]
    assert stats["moves_by_reason"].get("eviction", 0) > evictions  # the params did move: the test is not vacuous


# ---------------------------------------------------------------------------- pinned once it travels


class _Pool:
    """Stands in for :class:`chunkstar.device.pinned.PinnedBuffers`: records what it hands out."""

    def __init__(self) -> None:
        self.taken: list[torch.Tensor] = []

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        self.taken.append(t)
        return t


def _is(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.data_ptr() == b.data_ptr()


def test_a_state_chunk_is_pinned_once_it_comes_back_and_keeps_that_buffer() -> None:
    pool = _Pool()
    memory = DeviceMemory(torch.device("cpu"))
    c = Chunk(0, "master", 256, torch.float32, torch.device("cpu"), pinned=pool, memory=memory, pin_from_start=False)  # type: ignore[arg-type]
    copies = SerialCopies()
    c.allocate(Tier.HOST)
    c.payload.copy_(torch.arange(256.0))
    assert c.has_host_buffer and pool.taken == []  # plain memory first
    c.move_to(Tier.DEVICE, copies)
    assert not c.has_host_buffer  # the plain buffer went with the trip (the device copy is the payload)
    c.device_view.mul_(2)
    c.move_to(Tier.HOST, copies)
    assert len(pool.taken) == 1 and _is(c.payload, pool.taken[0])  # back: into a pinned buffer
    torch.testing.assert_close(c.payload, torch.arange(256.0) * 2)
    for _ in range(3):  # every later trip reuses it, both ways
        c.move_to(Tier.DEVICE, copies)
        assert c.has_host_buffer
        c.device_view.add_(1)
        c.mark_dirty()
        c.move_to(Tier.HOST, copies)
        assert len(pool.taken) == 1 and _is(c.payload, pool.taken[0])
    torch.testing.assert_close(c.payload, torch.arange(256.0) * 2 + 3)


def test_a_param_chunk_is_pinned_from_its_first_placement() -> None:
    pool = _Pool()
    c = Chunk(0, "param", 64, torch.float32, torch.device("cpu"), pinned=pool, memory=DeviceMemory(torch.device("cpu")))  # type: ignore[arg-type]
    c.allocate(Tier.HOST)
    assert len(pool.taken) == 1 and _is(c.payload, pool.taken[0])
    c.move_to(Tier.DEVICE, SerialCopies())
    assert c.has_host_buffer  # kept for the next trip


def test_the_store_gives_state_chunks_the_pinned_pool_to_use_once_they_travel(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA every list's chunks get the engine's pinned buffers; only the param chunks pin
    from the start. (A recording ``Chunk``: no CUDA memory is made.)"""
    made: list[dict[str, Any]] = []

    class Recording:
        def __init__(self, chunk_id: int, list_name: str, numel: int, dtype: torch.dtype, device: torch.device,
                     pinned: Any = None, memory: Any = None, pin_from_start: bool = True) -> None:  # fmt: skip
            made.append({"list": list_name, "pinned": pinned, "pin_from_start": pin_from_start})

    monkeypatch.setattr(store_module, "Chunk", Recording)
    layout = build_layout(["w", "b"], [(64,), (64,)], chunk_size=64)
    chunks = store_module.Chunks(layout, torch.bfloat16, torch.device("cuda"), DeviceMemory(torch.device("cuda")), 0)
    pool = chunks.pinned_buffers
    assert pool is not None and made and all(m["pinned"] is pool for m in made)
    assert {(m["list"], m["pin_from_start"]) for m in made} == {
        ("param", True), ("master", False), ("exp_avg", False), ("exp_avg_sq", False)
    }
