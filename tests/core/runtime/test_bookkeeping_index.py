"""The manager's indexed bookkeeping agrees with a full scan, and eviction choices are unchanged.

The manager keeps derived caches so that per-step work does not grow with the
model: the ids of the chunks on the device per list (eviction candidates come
from there), and per chunk the tensors in COMPUTE / HOLD_AFTER_FWD /
HOLD_AFTER_BWD. These tests train under eviction pressure and, at every
eviction, compare the candidates and the policy's choice with the full scan
over every chunk of every list that the manager did before, and after each
step compare the caches with the states and locations they derive from.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import pytest

import chunkstar
from chunkstar.chunk.lists import CHUNK_LISTS, ChunkList
from chunkstar.chunk.state import ChunkLocation, TensorState
from chunkstar.placement import eviction
from chunkstar.placement.eviction import NEVER, ResidentChunk
from chunkstar.memory.tracer import ScheduleMode
from chunkstar.runtime.chunk_manager import ChunkManager

from tests.core._models import CASES, DTYPES, engine_config, eviction_budget, train_engine


def _reference_candidates(mgr: ChunkManager, protect: set[Any]) -> list[ResidentChunk]:
    """The candidates as the manager built them before the resident index: every chunk of every list."""
    out = []
    for name in CHUNK_LISTS:
        for c in mgr.chunks.chunks_of(name):
            key = (name, c.chunk_id)
            if c.location is not ChunkLocation.DEVICE or key in protect:
                continue
            if name == ChunkList.PARAM and (mgr.pinned(c.chunk_id) or not mgr.chunks.own(c.chunk_id)):
                continue
            next_use = None
            if name == ChunkList.PARAM and mgr.cursor.mode is ScheduleMode.FOLLOWING:
                after = -1 if mgr.cursor.stage.value in ("optim", "idle") else mgr.cursor.moment
                next_use = mgr.cursor.trace.next_use(c.chunk_id, after)
            # state on the device is hybrid Adam's, kept for the step (Note [state kept for the step])
            reserved = name != ChunkList.PARAM and mgr.cursor.stage.value != "optim"
            out.append(ResidentChunk(key, c.nbytes, next_use, mgr._last_use.get(key, 0), reserved))
    return out


def _reference_choice(
    candidates: Sequence[ResidentChunk], need: int, policy: str, must_bytes: int | None = None
) -> list[Hashable] | None:
    """choose_evictions as it was: a full stable sort, then a prefix; reserved chunks after the
    others, only as far as ``must_bytes`` (Note [state kept for the step])."""
    must = need if must_bytes is None else min(must_bytes, need)
    if need <= 0:
        return []
    if sum(c.nbytes for c in candidates) < must:
        return None
    if policy == "furthest_next_use":
        key: Any = lambda c: (-(NEVER if c.next_use is None else c.next_use), c.last_use)  # noqa: E731
    else:
        key = lambda c: c.last_use  # noqa: E731
    chosen: list[Hashable] = []
    freed = 0
    for c in sorted((c for c in candidates if not c.reserved), key=key):
        if freed >= need:
            break
        chosen.append(c.key)
        freed += c.nbytes
    for c in sorted((c for c in candidates if c.reserved), key=key):
        if freed >= must:
            break
        chosen.append(c.key)
        freed += c.nbytes
    return chosen


def _check_caches(mgr: ChunkManager) -> None:
    for name in CHUNK_LISTS:
        on_device = {c.chunk_id for c in mgr.chunks.chunks_of(name) if c.location is ChunkLocation.DEVICE}
        assert mgr._on_device[name] == on_device, name
    for cid in range(mgr.layout.n_chunks):
        states = [mgr.states[s.index] for s in mgr.slots_of(cid)]
        assert mgr.tensors.compute_count[cid] == states.count(TensorState.COMPUTE)
        assert mgr.tensors._fwd_count[cid] == states.count(TensorState.HOLD_AFTER_FWD)
        assert mgr.grads_in(cid) == states.count(TensorState.HOLD_AFTER_BWD)
    in_use = [s.index for s in mgr.slots if mgr.states[s.index] in (TensorState.COMPUTE, TensorState.HOLD_AFTER_FWD)]
    assert sorted(mgr.slots_in_use()) == in_use


@pytest.mark.parametrize("policy", ["furthest_next_use", "lru"])
@pytest.mark.parametrize("name", ["gpt2", "mlp"])
def test_evictions_match_the_full_scan(name: str, policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]
    budget = eviction_budget(case.build(), DTYPES["fp32"])
    engine, optimizer = chunkstar.initialize_engine(
        model_func=case.build, config=engine_config("fp32", budget=budget, eviction_policy=policy)
    )
    mgr = engine.mgr
    seen = {"evictions": 0, "frozen": 0}
    indexed = mgr._eviction_candidates
    choose = eviction.choose_evictions

    def checked_candidates(protect: set[Any], names: Sequence[str] = CHUNK_LISTS) -> list[ResidentChunk]:
        got = indexed(protect, names)
        assert got == [c for c in _reference_candidates(mgr, protect) if c.key[0] in names]
        return got

    def checked_choice(
        candidates: Sequence[ResidentChunk], need: int, pol: str, must_bytes: int | None = None
    ) -> list[Hashable] | None:
        got = choose(candidates, need, pol, must_bytes=must_bytes)
        assert got == _reference_choice(candidates, need, pol, must_bytes)
        seen["evictions"] += 1
        seen["frozen"] += mgr.cursor.trace.frozen
        return got

    monkeypatch.setattr(mgr, "_eviction_candidates", checked_candidates)
    monkeypatch.setattr("chunkstar.runtime.chunk_manager.choose_evictions", checked_choice)
    train_engine(engine, optimizer, case, 4, after_step=lambda _: _check_caches(mgr))
    assert seen["frozen"] > 0, "no eviction after the warm-up: the budget puts no pressure on the schedule"
    _check_caches(mgr)


def test_caches_follow_gradient_accumulation() -> None:
    case = CASES["mlp"]
    engine, optimizer = chunkstar.initialize_engine(
        model_func=case.build, config=engine_config("fp32", budget=eviction_budget(case.build(), DTYPES["fp32"]), accum=3)
    )
    mgr = engine.mgr
    for step in range(3):
        for micro in range(3):
            engine.backward(case.loss(engine, case.batch(step * 3 + micro), DTYPES["fp32"]))
            _check_caches(mgr)
        optimizer.step()
        _check_caches(mgr)
        optimizer.zero_grad()
    # gradients pending, then dropped by zero_grad without a step
    engine.backward(case.loss(engine, case.batch(9), DTYPES["fp32"]))
    engine.backward(case.loss(engine, case.batch(10), DTYPES["fp32"]))
    engine.backward(case.loss(engine, case.batch(11), DTYPES["fp32"]))
    assert any(mgr.grads_in(c) for c in range(mgr.layout.n_chunks))
    optimizer.zero_grad()
    _check_caches(mgr)
    assert not any(mgr.grads_in(c) for c in range(mgr.layout.n_chunks))
