"""What each rank runs in test_reduce_counters (spawned, gloo on CPU)."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import chunkstar
from chunkstar.chunk.lists import CHUNK_LISTS
from chunkstar.chunk.state import ChunkLocation, TensorState
from chunkstar.runtime.chunk_manager import ChunkManager
from tests.core._models import CASES, engine_config, eviction_budget, gpt2_batch
from tests.core.runtime.test_bookkeeping_index import _reference_candidates

STEPS = 4
FROZEN = "transformer.h.1.mlp.c_fc.weight"  # stops requiring grad after the first two steps


def index_matches(mgr: ChunkManager, result: dict[str, Any]) -> None:
    """The resident index against the chunks' locations (gathered copies of other ranks' chunks included)."""
    for name in CHUNK_LISTS:
        scan = {c.chunk_id for c in mgr.chunks.chunks_of(name) if c.location is ChunkLocation.DEVICE}
        if mgr._on_device[name] != scan:
            result["mismatches"].append([name, sorted(mgr._on_device[name]), sorted(scan)])


def reduce_counters(rank: int, world: int, port: int, out: str) -> None:
    """Train GPT-2 under eviction and check every gradient_folded call against the scan of
    the group's slots that decided it before the counters (Note [pending gradients])."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    result: dict[str, Any] = {"rank": rank, "mismatches": [], "reduced_early": 0, "evictions": 0}
    try:
        case = CASES["gpt2"]
        engine, optimizer = chunkstar.initialize_engine(
            case.build, rank, engine_config("fp32", budget=eviction_budget(case.build(), torch.float32, 0.9))
        )
        mgr, reducer = engine.mgr, engine.reducer
        params = list(engine.parameters())
        folded = reducer.gradient_folded

        def checked(chunk_id: int) -> None:
            group = mgr.layout.group(chunk_id)
            before = group.start in reducer._reduced
            complete = all(
                not params[s.index].requires_grad or mgr.states[s.index] is TensorState.HOLD_AFTER_BWD
                for k in group
                for s in mgr.slots_of(k)
            )
            folded(chunk_id)
            after = group.start in reducer._reduced
            if after != (before or complete):
                result["mismatches"].append([chunk_id, before, complete, after])
            result["reduced_early"] += after and not before

        reducer.gradient_folded = checked  # type: ignore[method-assign]
        indexed = mgr._eviction_candidates

        def checked_candidates(protect: set[Any], names: Any = CHUNK_LISTS) -> Any:
            got = indexed(protect, names)
            if got != [c for c in _reference_candidates(mgr, protect) if c.key[0] in names]:
                result["mismatches"].append(["candidates", mgr.cursor.moment, [c.key for c in got]])
            result["evictions"] += 1
            return got

        mgr._eviction_candidates = checked_candidates  # type: ignore[method-assign]
        names = dict(engine.module.named_parameters())
        losses = []
        for step in range(STEPS):
            if step == 2:
                names[FROZEN].requires_grad_(False)
            loss = engine(**{k: v[rank : rank + 1] for k, v in gpt2_batch(step).items()}).loss
            engine.backward(loss)
            index_matches(mgr, result)
            optimizer.step()
            optimizer.zero_grad()
            index_matches(mgr, result)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        result["losses"] = losses
        result["moves"] = engine.stats()["chunk_moves_to_host"]
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result["error"] = f"{type(e).__name__}: {e}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    if "error" not in result:
        dist.destroy_process_group()
