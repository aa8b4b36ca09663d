"""What each rank runs in test_scale_two_ranks (spawned, gloo on CPU): frozen parameters
(a LoRA Llama), and models built on the meta device or streamed from a checkpoint."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

import chunkstar
from tests.core._models import engine_config, eviction_budget, gpt2_batch

from ._loop import train_slices

STEPS = 3


def scale(rank: int, world: int, port: int, out: str, case: str, pretrained: str | None = None) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    result: dict[str, Any] = {"rank": rank}
    try:
        from tests.core.construction import test_construction
        from tests.core.runtime import test_frozen

        builders: dict[str, Callable[[], torch.nn.Module]] = {
            "lora": test_frozen.build_lora_llama,
            "meta": test_construction._on_meta(test_construction._gpt2),
            "meta-disk": test_construction._on_meta(test_construction._gpt2),  # the state on disk
            "meta-disk-params": test_construction._on_meta(test_construction._gpt2),  # the params too
        }
        build = builders[case]
        budget = eviction_budget(test_construction._gpt2() if case != "lora" else build(), torch.float32, 0.85)
        extra: dict[str, Any] = {}
        if case.startswith("meta-disk"):  # one directory, both ranks
            extra["disk"] = {"path": str(Path(out) / "disk")}
            if case == "meta-disk-params":
                extra["disk"]["lists"] = ["param", "master", "exp_avg", "exp_avg_sq"]
        torch.manual_seed(test_construction.SEED)  # the same seed on every rank
        engine, optimizer = chunkstar.initialize_engine(
            build, rank, engine_config("fp32", budget=budget, **extra), pretrained=pretrained
        )
        result["bytes_read"] = engine.construction.bytes_read
        result["host_chunk_bytes"] = engine.mgr.counters.host_chunk_bytes
        result["initial"] = {k: v.sum().item() for k, v in engine.state_dict().items()}
        result["losses"] = train_slices(engine, optimizer, gpt2_batch, range(STEPS))  # one sequence per rank
        stats = engine.stats()
        result["state_bytes"] = stats["master_and_adam_bytes"]
        result["trainable_elements"] = engine.mgr.layout.trainable_elements
        result["moves"] = stats["chunk_moves_to_host"]
        sd = engine.state_dict()  # a collective: every rank gathers
        if rank == 0:
            torch.save(sd, Path(out) / f"{case}_sd.pt")
        result["disk_bytes_written"] = stats.get("disk_bytes_written", 0)
        engine.close()
    except Exception as e:  # noqa: BLE001 - the test reads the message
        import traceback

        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    if "error" not in result:
        dist.destroy_process_group()
