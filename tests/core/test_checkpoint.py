"""Checkpoints: save after step 3, resume in a new process, continue bit for bit.

The resumed process starts from different initial weights, so steps 4-6 can
only match the uninterrupted run if the engine's and the optimizer's state
dicts carry everything (fp32 weights, Adam moments, step counts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import chunkstar

from ._models import CASES, DTYPES, build_gpt2, engine_config, eviction_budget, train_engine

SAVE_AFTER = 3
STEPS = 6
WORKER = Path(__file__).with_name("_resume_worker.py")


def test_resume_in_new_process_is_bit_exact(tmp_path: Path) -> None:
    case = CASES["gpt2"]
    config = engine_config("fp32", budget=eviction_budget(build_gpt2(), DTYPES["fp32"]))
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    engine_pt, optim_pt = tmp_path / "engine.pt", tmp_path / "optim.pt"

    engine, optimizer = chunkstar.initialize_engine(model_func=case.build, local_rank=0, config=config)
    saved: dict[str, torch.Tensor] = {}

    def save(step: int) -> None:
        if step == SAVE_AFTER - 1:
            sd = engine.state_dict()
            saved.update(sd)
            torch.save(sd, engine_pt)
            torch.save(optimizer.state_dict(), optim_pt)

    uninterrupted = train_engine(engine, optimizer, case, STEPS, after_step=save)

    # The engine's state dict is the model's own, in fp32.
    own = build_gpt2().state_dict()
    assert saved.keys() == own.keys(), f"keys differ: {sorted(set(saved) ^ set(own))}"
    for k, v in saved.items():
        assert v.shape == own[k].shape, k
        if v.is_floating_point():
            assert v.dtype == torch.float32, f"{k} saved as {v.dtype}"
    assert torch.equal(saved["lm_head.weight"], saved["transformer.wte.weight"])

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(WORKER.parent), *sys.path]))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(config_path), str(engine_pt), str(optim_pt), str(SAVE_AFTER), str(STEPS)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, f"resume worker failed:\n{proc.stderr[-4000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["state_dict_roundtrip"], "engine.state_dict() after load_state_dict differs from what was loaded"
    assert result["losses"] == uninterrupted[SAVE_AFTER:], (
        f"resumed losses {result['losses']} != uninterrupted {uninterrupted[SAVE_AFTER:]}"
    )
