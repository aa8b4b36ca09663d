"""Checkpoints: save after step 3, resume, continue bit for bit.

The resumed engine starts from different initial weights, so steps 4-6 can
only match the uninterrupted run if what is loaded carries everything (fp32
weights, Adam moments, step counts, parameter-group settings, the fp16 loss
scaler): through the state dicts in a new process, and through
``engine.save_checkpoint`` / ``engine.load_checkpoint`` (per-rank shards).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import chunkstar
from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.state import ChunkLocation

from tests.core._models import CASES, DTYPES, ModelCase, build_gpt2, engine_config, eviction_budget, n_unique_params, train_engine

SAVE_AFTER = 3
STEPS = 6
WORKER = Path(__file__).parents[1] / "_resume_worker.py"


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


# ---------------------------------------------------------------------- save_checkpoint / load_checkpoint
GROUP0_LR = 2e-3  # set on the optimizer, not in the config: only the checkpoint can bring it back
OTHER_SEED = 7

RESUME_CONFIGS = {
    # (precision, device budget as a multiple of the param bytes, extra config)
    "fp32-eviction": ("fp32", 0.6, {}),
    "bf16-eviction": ("bf16", 0.6, {}),
    # a short window doubles the scale during the first steps: the scaler's state matters
    "fp16-eviction": ("fp16", 0.6, {"fp16": {"enabled": True, "loss_scale_window": 2, "initial_scale_power": 12}}),
    # a roomy device: hybrid Adam keeps master and moment chunks on the device
    "fp32-hybrid-adam": ("fp32", 6.0, {}),
}


def _engine(case: ModelCase, dtype: str, budget: float, extra: dict[str, object], seed: int | None = None) -> tuple[
    chunkstar.ChunkEngine, chunkstar.ChunkAdam
]:
    model_bytes = n_unique_params(build_gpt2()) * DTYPES[dtype].itemsize
    config = engine_config(dtype, budget=int(budget * model_bytes), **extra)
    build = case.build if seed is None else (lambda: build_gpt2(seed=seed))
    return chunkstar.initialize_engine(build, 0, config, param_groups_fn=chunkstar.no_decay_param_groups)


def _on_device(engine: chunkstar.ChunkEngine, list_name: str) -> int:
    return sum(c.location is ChunkLocation.DEVICE for c in engine.mgr.chunks.chunks_of(ChunkList(list_name)))


@pytest.mark.parametrize("name", list(RESUME_CONFIGS))
def test_load_checkpoint_resumes_bit_exactly(name: str, tmp_path: Path) -> None:
    dtype, budget, extra = RESUME_CONFIGS[name]
    case = CASES["gpt2"]

    engine, optimizer = _engine(case, dtype, budget, extra)
    optimizer.param_groups[0]["lr"] = GROUP0_LR
    uninterrupted = train_engine(engine, optimizer, case, STEPS, dtype=dtype)

    engine, optimizer = _engine(case, dtype, budget, extra)
    optimizer.param_groups[0]["lr"] = GROUP0_LR
    first = train_engine(engine, optimizer, case, SAVE_AFTER, dtype=dtype)
    assert first == uninterrupted[:SAVE_AFTER]
    if name.endswith("hybrid-adam"):
        assert _on_device(engine, "master") > 0 and _on_device(engine, "exp_avg") > 0, "nothing saved from the device"
    else:
        assert engine.stats()["chunk_moves_to_host"] > 0, "no eviction happened"
    scale = engine.scaler.state_dict()
    engine.save_checkpoint(str(tmp_path / "ckpt"))

    # A new engine from other initial weights, which trains a little on its own first
    # (its own moments, step counts, loss scale; chunks moved by eviction and hybrid Adam).
    engine, optimizer = _engine(case, dtype, budget, extra, seed=OTHER_SEED)
    train_engine(engine, optimizer, case, range(100, 102), dtype=dtype)
    if name.endswith("hybrid-adam"):
        assert _on_device(engine, "master") > 0, "nothing loaded into device-resident chunks"
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert optimizer.param_groups[0]["lr"] == GROUP0_LR
    assert engine.scaler.state_dict() == scale
    resumed = train_engine(engine, optimizer, case, range(SAVE_AFTER, STEPS), dtype=dtype)
    assert resumed == uninterrupted[SAVE_AFTER:], f"resumed {resumed} != uninterrupted {uninterrupted[SAVE_AFTER:]}"
