"""A real profile of a budget-constrained GPT-2 run, made once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
