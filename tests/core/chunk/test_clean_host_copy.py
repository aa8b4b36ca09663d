"""Clean host copies in the engine (Note [clean host copy] in chunk/chunk.py).

On the frozen schedule a param chunk brought to the device for the forward
keeps its host buffer, so evicting it later copies nothing back; a write to
the chunk on the device (a gradient, or a module writing its own weight in
place while it computes) makes the host copy stale and the eviction copies.
"""

from __future__ import annotations

import torch

import chunkstar
from chunkstar.chunk.lists import ChunkList
from chunkstar.events import MoveReason, Tier

from tests.core._models import CASES, DTYPES, engine_config, eviction_budget, train_engine


def test_forward_evictions_under_pressure_copy_nothing_back() -> None:
    case = CASES["gpt2"]
    engine, optimizer = chunkstar.initialize_engine(
        case.build, 0, engine_config("fp32", budget=eviction_budget(case.build(), DTYPES["fp32"]))
    )
    train_engine(engine, optimizer, case, 3)  # warm-up, then frozen steps
    before = engine.stats()
    train_engine(engine, optimizer, case, range(3, 5))
    after = engine.stats()
    clean = after["clean_evictions"] - before["clean_evictions"]
    moved = after["chunk_moves_to_host"] - before["chunk_moves_to_host"]
    copied = after["bytes_to_host"] - before["bytes_to_host"]
    assert clean > 0, "no eviction of an unmodified chunk on the frozen schedule"
    chunk_bytes = engine.mgr.chunks.chunk(ChunkList.PARAM, 0).nbytes
    assert copied <= (moved - clean) * chunk_bytes  # clean evictions added no bytes


def test_a_parameter_written_in_place_on_the_device_is_copied_back() -> None:
    """A module writing its own weight while it computes is not guarded (Note [parameter
    guard]); its version counter tells the manager the host copy is stale."""
    case = CASES["gpt2"]
    engine, optimizer = chunkstar.initialize_engine(
        case.build, 0, engine_config("fp32", budget=eviction_budget(case.build(), DTYPES["fp32"]))
    )
    train_engine(engine, optimizer, case, 3)
    mgr = engine.mgr
    cid = mgr.layout.n_chunks - 1
    key = (ChunkList.PARAM, cid)
    if mgr.resident(key):
        mgr.move(key, Tier.HOST, MoveReason.EVICTION)
    mgr.move(key, Tier.DEVICE, MoveReason.ACCESS)  # on the frozen schedule: keeps the host copy
    chunk = mgr.chunks.chunk(ChunkList.PARAM, cid)
    chunk.wait_ready()
    assert chunk.clean
    slot = mgr.slots_of(cid)[0]
    param = engine.parameter(slot.index)
    mgr.set_guarded(slot.index, False)  # as in COMPUTE: the write reaches the view directly
    with torch.no_grad():
        param.add_(1.0)
    mgr.set_guarded(slot.index, True)
    want = param.detach().reshape(-1).clone()
    copied = mgr.counters.bytes_to_host
    mgr.move(key, Tier.HOST, MoveReason.EVICTION)
    assert mgr.counters.bytes_to_host == copied + chunk.nbytes
    assert torch.equal(chunk.payload[slot.offset : slot.end], want)
