"""Subprocess half of test_checkpoint: resume a saved fp32 GPT-2 run in a fresh process.

usage: python _resume_worker.py CONFIG_JSON ENGINE_PT OPTIM_PT FIRST_STEP LAST_STEP

Builds an engine around a GPT-2 with *different* initial weights, loads both
state dicts with ``torch.load(weights_only=True)``, checks the engine now
reports exactly the loaded weights, trains steps FIRST_STEP..LAST_STEP-1 and
prints one JSON line: {"losses": [...], "state_dict_roundtrip": bool}.
"""

from __future__ import annotations

import json
import sys

import torch

import chunkstar
from _models import CASES, build_gpt2, train_engine


def main() -> None:
    config_path, engine_path, optim_path, first, last = sys.argv[1:6]
    engine, optimizer = chunkstar.initialize_engine(
        model_func=lambda: build_gpt2(seed=7), local_rank=0, config=config_path
    )
    engine_sd = torch.load(engine_path, weights_only=True)
    optim_sd = torch.load(optim_path, weights_only=True)
    engine.load_state_dict(engine_sd)
    optimizer.load_state_dict(optim_sd)
    now = engine.state_dict()
    roundtrip = now.keys() == engine_sd.keys() and all(torch.equal(now[k], engine_sd[k]) for k in now)
    losses = train_engine(engine, optimizer, CASES["gpt2"], range(int(first), int(last)))
    print(json.dumps({"losses": losses, "state_dict_roundtrip": roundtrip}))


if __name__ == "__main__":
    main()
