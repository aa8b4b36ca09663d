"""fp16 dynamic loss scaling: overflowing steps are skipped and leave no trace.

Starting at 2**32 the scaled gradients overflow fp16, so the first steps must
be skipped (masters untouched, param chunks restored) while the scale halves
(hysteresis 1: every overflow halves, DeepSpeed's meaning) until steps go
through; a fixed scale that overflows every step says so.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import chunkstar

from tests.core._models import CASES, DTYPES, engine_config, eviction_budget, train_engine

INITIAL_POWER = 32
STEPS = 24


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_overflow_skips_steps_and_lowers_the_scale() -> None:
    case = CASES["gpt2"]
    config = engine_config(
        "fp16",
        budget=eviction_budget(case.build(), DTYPES["fp16"]),
        fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": INITIAL_POWER,
              "loss_scale_window": 1000, "hysteresis": 1, "min_loss_scale": 1},
    )
    engine, optimizer = chunkstar.initialize_engine(model_func=case.build, local_rank=0, config=config)
    assert optimizer.loss_scale == 2.0**INITIAL_POWER
    assert optimizer.skipped_steps == 0
    initial = engine.state_dict()

    losses, scales, skipped = [], [], []
    for step in range(STEPS):
        loss = case.loss(engine, case.batch(step), torch.float16)
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        scales.append(optimizer.loss_scale)
        skipped.append(optimizer.skipped_steps)
        if step == 0:
            assert optimizer.skipped_steps == 1, "a 2**32 loss scale must overflow fp16 gradients"
        if optimizer.skipped_steps == step + 1:  # every step so far was skipped
            assert _same(engine.state_dict(), initial), f"skipped step {step} changed the weights"

    assert all(math.isfinite(x) for x in losses), losses
    assert optimizer.skipped_steps > 0
    assert optimizer.loss_scale < 2.0**INITIAL_POWER
    assert optimizer.skipped_steps < STEPS, f"every step overflowed; scales {scales}"
    # With hysteresis 1 and no growth window reached, each overflow halves the scale.
    assert optimizer.loss_scale == 2.0 ** (INITIAL_POWER - optimizer.skipped_steps), (scales, skipped)
    assert not _same(engine.state_dict(), initial), "the steps after the skipped ones changed nothing"
    assert losses[-1] < losses[0], losses


def test_a_fixed_scale_that_overflows_every_step_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A fixed scale never comes down: a step it overflows is skipped, and so is every later
    one. A dynamic scale's skips are how it finds its level; a fixed scale's are logged."""
    case = CASES["mlp"]
    config = engine_config("fp16", budget=1 << 24, fp16={"enabled": True, "loss_scale": 2.0**36})
    engine, optimizer = chunkstar.initialize_engine(model_func=case.build, local_rank=0, config=config)
    initial = engine.state_dict()
    with caplog.at_level(logging.WARNING, logger="chunkstar"):
        train_engine(engine, optimizer, case, 3, dtype="fp16")
    assert optimizer.skipped_steps == 3 and _same(engine.state_dict(), initial)
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(said) == 1 and "fixed fp16 loss scale" in said[0] and "fp16.loss_scale" in said[0], said
