"""What each rank runs in the multi-process tests (spawned, gloo on CPU)."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import chunkstar
from tests.core._models import CASES, engine_config, gpt2_batch
from tests.distributed._loop import train_slices

GLOBAL_BATCH = 4
CHUNK = 1 << 16  # the largest parameter of the tiny models: no chunk of its own, groups stay even
SEQ = 8


def bert_batch_equal_masks(step: int, batch: int = GLOBAL_BATCH) -> dict[str, torch.Tensor]:
    """BERT MLM batch with the same number of masked positions in every row, so the
    mean loss of the full batch equals the mean of the per-rank losses."""
    g = torch.Generator().manual_seed(20_000 + step)
    start = torch.randint(0, 64, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    ids = 5 + (start + torch.arange(SEQ) * stride) % 64
    masked = torch.zeros(batch, SEQ, dtype=torch.bool)
    masked[:, ::3] = True
    return {
        "input_ids": torch.where(masked, torch.full_like(ids, 4), ids),
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
        "labels": torch.where(masked, ids, torch.full_like(ids, -100)),
    }


def full_batch(case: str, step: int) -> dict[str, torch.Tensor]:
    return gpt2_batch(step, batch=GLOBAL_BATCH, seq=SEQ) if case == "gpt2" else bert_batch_equal_masks(step)


def train(rank: int, world: int, port: int, case: str, steps: int, budget: int, out: str, die_at: int = -1) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    result: dict[str, Any] = {"rank": rank}
    try:
        engine, optimizer = chunkstar.initialize_engine(
            CASES[case].build, rank, engine_config("fp32", budget=budget, chunk_size=CHUNK)
        )

        def batch_of(step: int) -> dict[str, torch.Tensor]:
            if step == die_at and rank == world - 1:
                os._exit(3)  # a rank dies without a word, as its step ``die_at`` begins
            return full_batch(case, step)

        result.update(losses=train_slices(engine, optimizer, batch_of, range(steps)), stats=engine.stats())
        sd = engine.state_dict()  # a collective: every rank takes part
        engine.save_checkpoint(str(Path(out) / "ckpt"))  # each rank its own shard
        with torch.no_grad():  # evaluation gathers too: every rank runs it
            logits = engine(**full_batch(case, 100)).logits
        if rank == 0:
            torch.save(sd, Path(out) / "state_dict.pt")
            torch.save(logits, Path(out) / "logits.pt")
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result.update(error=f"{type(e).__name__}: {e}", t_error=time.time())
    Path(out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    if "error" not in result:
        dist.destroy_process_group()
