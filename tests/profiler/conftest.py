"""A real profile of a budget-constrained GPT-2 run, made once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import chunkstar
import chunkstar_profiler
from tests.core._models import CASES, DTYPES, engine_config, eviction_budget, gpt2_batch, hf_loss


def _step(engine: Any, optimizer: Any, i: int) -> None:
    engine.backward(hf_loss(engine, gpt2_batch(i), torch.bfloat16))
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture(scope="session")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    case = CASES["gpt2"]
    budget = eviction_budget(case.build(), DTYPES["bf16"])
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config("bf16", budget=budget))
    _step(engine, optimizer, 0)  # warm-up outside the recording
    before = engine.stats()
    with chunkstar_profiler.Profiler(engine) as prof:
        for i in range(1, 4):
            _step(engine, optimizer, i)
    after = engine.stats()
    path = Path(prof.save(tmp_path_factory.mktemp("prof") / "run.csprof"))
    return {"engine": engine, "optimizer": optimizer, "prof": prof, "path": path, "before": before, "after": after}


@pytest.fixture(scope="session")
def recorded_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The same GPT-2 run with the disk tier (optimizer state in chunk files, Note [disk tier]).

    The disk tier's reads and writes are drained before each stats snapshot, so the
    engine's disk counters over the recording cover exactly the recorded stage moves."""
    case = CASES["gpt2"]
    budget = 2 * eviction_budget(case.build(), DTYPES["bf16"])
    disk_dir = tmp_path_factory.mktemp("disk")
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config("bf16", budget=budget, disk={"path": str(disk_dir)}))
    try:
        _step(engine, optimizer, 0)  # warm-up outside the recording
        engine.mgr.chunks.disk.drain()
        before = engine.stats()
        with chunkstar_profiler.Profiler(engine) as prof:
            for i in range(1, 4):
                _step(engine, optimizer, i)
            engine.mgr.chunks.disk.drain()
        after = engine.stats()
        path = Path(prof.save(tmp_path_factory.mktemp("prof") / "disk.csprof"))
        yield {"engine": engine, "prof": prof, "path": path, "before": before, "after": after}
    finally:
        engine.close()
