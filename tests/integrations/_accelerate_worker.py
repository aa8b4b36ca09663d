"""An Accelerate user's loop with chunkstar inside, for the Accelerate test:
``accelerate launch --multi_gpu --num_processes N -m tests.integrations._accelerate_worker OUT
{chunkstar|plain} BATCH`` (``--multi_gpu`` is Accelerate's torchrun launcher; on a machine
without a GPU the processes run on the CPU over gloo).

``Accelerator`` sets up the processes and shards the data (``prepare(dataloader)``: process
``i`` takes batch ``i`` of every ``N``); the engine holds the model, its optimizer and the
backward, and neither the model nor the optimizer goes through ``prepare`` (docs/trainer.md).
``plain`` is the reference: the same loop in plain PyTorch, in one process; ``wrapped``
passes the engine's model to ``prepare`` and records the engine's refusal on each process. Rank 0 writes
``OUT/result.json`` (each micro-batch's loss averaged over the processes) and the final
weights to ``OUT/weights.safetensors``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from chunkstar import initialize_engine
from chunkstar.errors import ChunkStateError
from tests.core._models import SMALL_CHUNK, build_gpt2
from tests.integrations._trainer_case import TokenRows

ROWS = 32
WINDOW = 2  # micro-batches per optimizer step
ADAMW = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}


def main() -> None:
    out, kind, batch = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    acc = Accelerator(cpu=True)
    loader = acc.prepare(DataLoader(TokenRows(ROWS), batch_size=batch, shuffle=False))
    losses: list[float] = []
    if kind == "wrapped":  # the model through prepare(): DDP reads every parameter as it is built
        engine, _ = initialize_engine(
            lambda: build_gpt2(n_layer=2), acc.local_process_index,
            {"device": "cpu", "device_memory_budget": 1_800_000, "default_chunk_size": SMALL_CHUNK},
        )  # fmt: skip
        try:
            acc.prepare(engine.module)
            refused = ""
        except ChunkStateError as e:
            refused = str(e)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"refused{acc.process_index}.txt").write_text(refused)
        engine.close()
        return
    if kind == "chunkstar":
        config = {
            "device": "cpu", "device_memory_budget": 1_800_000, "default_chunk_size": SMALL_CHUNK,
            "gradient_accumulation_steps": WINDOW, "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": ADAMW},
        }  # fmt: skip
        engine, opt = initialize_engine(lambda: build_gpt2(n_layer=2), acc.local_process_index, config)
        for batch_rows in loader:
            loss = engine(**batch_rows).loss
            losses.append(float(acc.gather(loss.detach()[None]).mean()))
            engine.backward(loss)  # divided by the window, reduced across the processes
            if len(losses) % WINDOW == 0:
                opt.step()
                opt.zero_grad()
        state = engine.state_dict()  # every process: the values are gathered
        moves = engine.stats()["chunk_moves_to_host"]
        engine.close()
    else:
        assert acc.num_processes == 1, "the plain reference runs in one process"
        model = build_gpt2(n_layer=2)
        opt = torch.optim.AdamW(model.parameters(), **{**ADAMW, "betas": tuple(ADAMW["betas"])})
        for batch_rows in loader:
            loss = model(**batch_rows).loss
            losses.append(float(loss.detach()))
            (loss / WINDOW).backward()
            if len(losses) % WINDOW == 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
        state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        moves = 0
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, out / "weights.safetensors")
        (out / "result.json").write_text(json.dumps({"losses": losses, "processes": acc.num_processes, "moves": moves}))
    acc.end_training()


if __name__ == "__main__":
    main()
