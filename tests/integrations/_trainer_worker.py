"""One rank of the two-process Trainer test, started by torchrun.

``python -m torch.distributed.run --standalone --nproc_per_node 2 _trainer_worker.py OUT``:
every rank trains the tiny GPT-2 with ChunkstarTrainer (gloo; per-rank batch 1,
accumulation 2, so a step sees the single-process run's 2 x 2 rows), saving a
checkpoint at step 3; evaluates; saves the model; then a second ChunkstarTrainer
resumes from checkpoint-3 (each rank its own engine shard) and trains to the end.
Each rank writes ``OUT/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tests.* imports

import torch  # noqa: E402

from chunkstar.integrations.transformers import ChunkstarTrainer  # noqa: E402
from tests.integrations._trainer_case import (  # noqa: E402
    SAVE_AT, TWO_RANK_BUDGET_FRACTION, build_model, chunkstar_config, eval_rows, logged, train_rows, training_args,
)  # fmt: skip


def main(out: str) -> None:
    per_rank = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2}
    run = ChunkstarTrainer(
        model=build_model(), args=training_args(f"{out}/run", save_strategy="steps", save_steps=SAVE_AT, **per_rank),
        train_dataset=train_rows(), eval_dataset=eval_rows(), chunkstar_config=chunkstar_config(fraction=TWO_RANK_BUDGET_FRACTION),
    )  # fmt: skip
    run.train()
    ev = run.evaluate()
    run.save_model(f"{out}/final")  # every rank: the full state dict is a collective
    final = run.engine.state_dict()
    stats = run.engine.stats()

    resumed = ChunkstarTrainer(
        model=build_model(), args=training_args(f"{out}/resumed", **per_rank), train_dataset=train_rows(),
        chunkstar_config=chunkstar_config(fraction=TWO_RANK_BUDGET_FRACTION),
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=f"{out}/run/checkpoint-{SAVE_AT}")
    again = resumed.engine.state_dict()
    rank = int(os.environ["RANK"])
    record = {
        "world_size": stats["world_size"],
        "logged": logged(run),
        "eval_loss": ev["eval_loss"],
        "evictions": stats["moves_by_reason"].get("eviction", 0),
        "resumed_logged": logged(resumed),
        "resumed_equal": all(torch.equal(final[k], again[k]) for k in final),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(sys.argv[1])
