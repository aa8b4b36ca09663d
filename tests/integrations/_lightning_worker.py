"""One Lightning run for the two-process test: ``python -m tests.integrations._lightning_worker
OUT STRATEGY DEVICES BATCH``. With ``DEVICES`` 2, Lightning's launcher starts the second
process by running this command again. Each rank writes its micro-batch losses and the lrs
to ``OUT/rank{r}.json``; the run ends with ``trainer.save_checkpoint(OUT/last.ckpt)``.

The training rows go through the DistributedSampler Lightning adds (seeded by
``seed_everything``): one process over batches of 4 sees the same rows per step as two
processes over batches of 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L

from chunkstar.device.threads import rank_share_of_cores
from chunkstar.integrations.lightning import ChunkstarStrategy
from tests.integrations._lightning_case import Case, engine_config, loader, trainer


def main() -> None:
    out, strategy, devices, batch = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    L.seed_everything(0, verbose=False)
    module = Case("gpt2")
    chosen = ChunkstarStrategy(engine_config("gpt2", scale=1.6)) if strategy == "chunkstar" else strategy
    t = trainer(chosen, out, devices=devices, use_distributed_sampler=True, accumulate_grad_batches=2,
                gradient_clip_val=1.0)  # fmt: skip
    t.fit(module, loader("gpt2", batch=batch))
    t.save_checkpoint(out / "last.ckpt")
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {"losses": module.losses, "lrs": module.lrs}
    if isinstance(t.strategy, ChunkstarStrategy):  # what the engine took to be its share of the node
        stats = t.strategy.engine.stats()
        result.update(local_world_size=os.environ.get("LOCAL_WORLD_SIZE"), host_worker_threads=stats["host_worker_threads"],
                      share_of_two=rank_share_of_cores({"LOCAL_WORLD_SIZE": "2"}))  # fmt: skip
    (out / f"rank{t.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
