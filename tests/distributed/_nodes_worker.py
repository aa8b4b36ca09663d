"""One rank of the two-node test, started by torchrun (tests/distributed/test_two_nodes.py).

``python -m torch.distributed.run ... _nodes_worker.py OUT STEPS [--resume] [--die-after K]``:
trains the tiny GPT-2 on its slice of the global batch for steps up to STEPS, saving a
checkpoint into OUT/ckpt after every step, and writes OUT/rank{r}.json. ``--resume``
starts from the checkpoint's ``latest``; ``--die-after K``: the ranks of node 1 end their
process, without a word, right after step K's save (a node lost mid-run)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import chunkstar
from tests.core._models import build_gpt2, engine_config
from tests.distributed._loop import train_slices
from tests.distributed._worker import CHUNK, full_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("steps", type=int)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--die-after", type=int, default=-1)
    args = ap.parse_args()
    out = Path(args.out)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    engine, optimizer = chunkstar.initialize_engine(
        build_gpt2, int(os.environ["LOCAL_RANK"]), engine_config("fp32", budget="64MB", chunk_size=CHUNK)
    )
    ckpt = out / "ckpt"
    start = 0
    if args.resume:
        engine.load_checkpoint(str(ckpt))
        start = int((ckpt / "latest").read_text().split("-")[1])  # "step-<steps taken>-<id>"
    losses: list[float] = []
    for step in range(start, args.steps):
        losses += train_slices(engine, optimizer, lambda s: full_batch("gpt2", s), range(step, step + 1))
        engine.save_checkpoint(str(ckpt))
        if step == args.die_after and os.environ["GROUP_RANK"] == "1":
            os._exit(3)  # the node is gone: no clean-up, no message
    stats = engine.stats()
    result = {
        "rank": rank, "world": dist.get_world_size(), "local_rank": int(os.environ["LOCAL_RANK"]),
        "node": int(os.environ["GROUP_RANK"]), "start": start, "losses": losses,
        "stats_rank": stats["rank"], "stats_world": stats["world_size"],
    }  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
