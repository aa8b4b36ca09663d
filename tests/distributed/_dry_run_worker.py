"""What each rank runs in test_dry_run_two_ranks (spawned, gloo on CPU): the real run the
dry run of two ranks is checked against."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import chunkstar
from tests.core.dryrun.test_dry_run import _COUNTERS, _MODELS, _config, _inputs

STEPS = 3
KEYS = (*_COUNTERS, "all_gathers", "bytes_gathered", "device_peak_bytes", "minimum_budget_bytes")


def real_run(rank: int, world: int, port: int, out: str, name: str, budget: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    result: dict[str, Any] = {"rank": rank}
    try:
        torch.manual_seed(0)
        engine, opt = chunkstar.initialize_engine(_MODELS[name], rank, _config(budget))
        steps = []
        for _ in range(STEPS):
            engine.backward(engine(**_inputs(name)).loss)  # every rank the same shapes, as the dry run's
            opt.step()
            opt.zero_grad()
            stats = engine.stats()
            steps.append({k: stats[k] for k in KEYS})
        result["steps"] = steps
        engine.close()
    except Exception as e:  # noqa: BLE001 - the test reads the message
        import traceback

        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
