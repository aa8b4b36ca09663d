"""Gradient accumulation: 4 micro-batches per step equal plain PyTorch with loss / 4.

Gradients normally overwrite the param chunk (docs/design.md, 'Chunks' and 'The optimizer step'), so accumulation
needs a separate accumulator while micro-batches are summed; this checks that,
with eviction on and clipping applied to the accumulated gradient.
"""

from __future__ import annotations

import pytest

import chunkstar

from tests.core._models import CASES, DTYPES, assert_losses_close, engine_config, eviction_budget, train_engine, train_reference

ACCUM = 4
STEPS = 3


@pytest.mark.parametrize("name", ["gpt2", "mlp"])
def test_accumulated_steps_match_pytorch(name: str) -> None:
    case = CASES[name]
    want = train_reference(case, STEPS, accum=ACCUM)
    budget = eviction_budget(case.build(), DTYPES["fp32"])
    engine, optimizer = chunkstar.initialize_engine(
        model_func=case.build, local_rank=0, config=engine_config("fp32", budget=budget, accum=ACCUM)
    )
    got = train_engine(engine, optimizer, case, STEPS, accum=ACCUM)
    assert len(got) == STEPS * ACCUM
    assert_losses_close(got, want, 1e-5, f"{name}/fp32 x{ACCUM} accumulation")
    assert engine.stats()["chunk_moves_to_host"] > 0
