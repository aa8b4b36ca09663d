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


def _train_windows(model_or_engine: object, optimizer: object, case: object, windows: list[int], *, engine: bool) -> list[float]:
    """Windows of the given lengths, each micro-batch's loss divided by ACCUM by the loop (as
    Lightning does, short window included), a step after each window."""
    import torch

    losses: list[float] = []
    i = 0
    for size in windows:
        for micro in range(size):
            batch = case.batch(i)  # type: ignore[attr-defined]
            i += 1
            loss = case.loss(model_or_engine, batch, torch.float32)  # type: ignore[attr-defined]
            if engine:
                model_or_engine.backward(loss / ACCUM, last=micro == size - 1, divide=False)  # type: ignore[attr-defined]
            else:
                (loss / ACCUM).backward()
            losses.append(loss.item())
        if not engine:
            torch.nn.utils.clip_grad_norm_(model_or_engine.parameters(), 1.0)  # type: ignore[attr-defined]
        optimizer.step()  # type: ignore[attr-defined]
        optimizer.zero_grad()  # type: ignore[attr-defined]
    return losses


@pytest.mark.parametrize("name", ["gpt2", "mlp"])
def test_a_loop_may_end_a_window_early(name: str) -> None:
    """Note [windows the loop decides]: a short window (an epoch's last, as Lightning steps
    there) ends with ``last=True`` and trains as plain PyTorch stepping after it; the loop
    divided the loss itself (``divide=False``)."""
    import torch

    from tests.core._models import LR, WEIGHT_DECAY

    case = CASES[name]
    windows = [ACCUM, 2, ACCUM, 1]
    model = case.build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WEIGHT_DECAY, fused=True)
    want = _train_windows(model, opt, case, windows, engine=False)
    budget = eviction_budget(case.build(), DTYPES["fp32"])
    engine, optimizer = chunkstar.initialize_engine(
        model_func=case.build, local_rank=0, config=engine_config("fp32", budget=budget, accum=ACCUM)
    )
    got = _train_windows(engine, optimizer, case, windows, engine=True)
    assert_losses_close(got, want, 1e-5, f"{name}: windows {windows}")


def test_a_window_cannot_grow_past_its_size() -> None:
    case = CASES["mlp"]
    engine, optimizer = chunkstar.initialize_engine(model_func=case.build, local_rank=0, config=engine_config("fp32", budget="1GB", accum=2))
    import torch

    engine.backward(case.loss(engine, case.batch(0), torch.float32), last=False)
    with pytest.raises(chunkstar.ChunkStateError, match="cannot grow past"):
        engine.backward(case.loss(engine, case.batch(1), torch.float32), last=False)
    with pytest.raises(TypeError, match="last"):
        engine.backward(case.loss(engine, case.batch(1), torch.float32), last=1)  # type: ignore[arg-type]
