"""The warm-up trace as a schedule, and what happens when the run stops matching it.

- two forwards before one backward (R-Drop) are one iteration: the warm-up ends
  after two of them and training matches plain PyTorch;
- a longer sequence or a new control flow after the warm-up is detected and the
  run is re-traced: memory stays within the budget at every sample and the
  losses still match; a run that changes shape every iteration ends up
  unscheduled, still exact;
- a budget too small for what a moment measured fails in the first iteration,
  naming the smallest budget that works, and that budget does work.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chunkstar
import chunkstar_profiler
from chunkstar.runtime.schedule import MAX_REPLANS

from tests.core._models import CASES, DTYPES, assert_losses_close, engine_config, eviction_budget, gpt2_batch

D = 64


def _reference_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)


def _ref_step(model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> float:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _engine_step(engine: Any, optimizer: Any, loss: torch.Tensor) -> float:
    engine.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def test_two_forwards_before_one_backward_end_the_warm_up_and_match_pytorch() -> None:
    case = CASES["gpt2"]

    def rdrop(model: Any, step: int) -> torch.Tensor:
        batch = gpt2_batch(step)
        return 0.5 * (model(**batch).loss + model(**batch).loss)

    ref = case.build()
    opt = _reference_opt(ref)
    want = [_ref_step(ref, opt, rdrop(ref, s)) for s in range(5)]
    # the second forward's gradients wait in autograd until the first's backward: budget for them
    budget = eviction_budget(case.build(), torch.float32, 2.2)
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config("fp32", budget=budget))
    got = [_engine_step(engine, optimizer, rdrop(engine, s)) for s in range(5)]
    assert_losses_close(got, want, 1e-5, "gpt2 R-Drop")
    stats = engine.stats()
    assert stats["schedule"] == "frozen" and stats["replans"] == 0, stats
    single = chunkstar.initialize_engine(case.build, 0, engine_config("fp32", budget=budget))[0]
    out = single(**gpt2_batch(0))
    single.backward(out.loss)
    assert stats["moments_per_micro_step"] > single.mgr.cursor.trace.n_moments  # both forwards are in the trace
    assert stats["chunk_moves_to_host"] > 0, stats


def test_longer_sequences_after_the_warm_up_are_retraced_within_the_budget(caplog: pytest.LogCaptureFixture) -> None:
    """Before: the short sequences' trace stayed the schedule and chunks plus
    activations went 1.39x over the budget (208 samples over)."""
    case = CASES["gpt2"]
    seqs = [8, 8, 8, 8, 24, 24, 24, 24]
    ref = case.build()
    opt = _reference_opt(ref)
    want = []
    for s, seq in enumerate(seqs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ref(**gpt2_batch(s, seq=seq)).loss
        want.append(_ref_step(ref, opt, loss))
    budget = eviction_budget(case.build(), DTYPES["bf16"], 1.0)
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config("bf16", budget=budget))
    got = []
    with caplog.at_level(logging.WARNING, logger="chunkstar"), chunkstar_profiler.Profiler(engine) as prof:
        for s, seq in enumerate(seqs):
            got.append(_engine_step(engine, optimizer, engine(**gpt2_batch(s, seq=seq)).loss))
    assert_losses_close(got, want, 3e-2, "gpt2 bf16, longer sequences after warm-up")
    stats = engine.stats()
    assert stats["replans"] == 1 and stats["schedule"] == "frozen", stats
    assert "no longer matches" in caplog.text
    dev = prof.profile().memory.query("tier == 'device'")
    over = dev[dev["total_bytes"] > budget]
    assert over.empty, over[["chunk_bytes", "non_model_bytes", "module", "iteration"]].to_string()
    assert stats["chunk_moves_to_host"] > 0


class Gated(nn.Module):
    """Residual MLP blocks; ``skip_odd`` changes the control flow after the warm-up."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D), nn.GELU()) for _ in range(6))
        self.head = nn.Linear(D, 10)
        self.skip_odd = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if not (self.skip_odd and i % 2):
                x = x + block(x)
        return self.head(x)


def _gated_loss(model: Any, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(900 + step)
    x = torch.randn(4, D, generator=g)
    return F.cross_entropy(model(x), torch.randint(0, 10, (4,), generator=g))


def _gated_run(skip: list[bool]) -> tuple[list[float], list[float], dict[str, Any]]:
    ref = Gated()
    opt = _reference_opt(ref)
    want = []
    for s, flag in enumerate(skip):
        ref.skip_odd = flag
        want.append(_ref_step(ref, opt, _gated_loss(ref, s)))
    budget = eviction_budget(Gated(), torch.float32, 0.8)
    engine, optimizer = chunkstar.initialize_engine(Gated, 0, engine_config("fp32", budget=budget, chunk_size=2048))
    got = []
    for s, flag in enumerate(skip):
        engine.module.skip_odd = flag
        got.append(_engine_step(engine, optimizer, _gated_loss(engine, s)))
    return got, want, engine.stats()


def test_new_control_flow_after_the_warm_up_is_retraced() -> None:
    got, want, stats = _gated_run([False] * 4 + [True] * 4)
    assert_losses_close(got, want, 1e-5, "gated MLP, blocks skipped after warm-up")
    assert stats["replans"] == 1 and stats["schedule"] == "frozen", stats
    assert stats["chunk_moves_to_host"] > 0


def test_a_run_that_changes_every_iteration_runs_unscheduled_and_exact() -> None:
    skip = [bool(s % 2) for s in range(2 * MAX_REPLANS + 6)]
    got, want, stats = _gated_run(skip)
    assert_losses_close(got, want, 1e-5, "gated MLP, control flow alternating")
    assert stats["schedule"] == "unscheduled" and stats["replans"] == MAX_REPLANS + 1, stats


def test_too_small_a_budget_fails_in_the_first_iteration_with_a_budget_that_works() -> None:
    """Before: the warm-up passed and the error came at step 3, without a figure to use."""
    case = CASES["gpt2"]
    budget = eviction_budget(case.build(), DTYPES["bf16"], 0.4)
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config("bf16", budget=budget))
    with pytest.raises(chunkstar.DeviceMemoryError) as info:
        out = engine(**gpt2_batch(0))
        engine.backward(out.loss)
    err = info.value
    assert engine.micro_step == 0, "the error must come in the first iteration"
    assert err.minimum is not None and err.minimum > budget
    assert str(err.minimum) in str(err)
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config("bf16", budget=err.minimum))
    for s in range(4):
        _engine_step(engine, optimizer, engine(**gpt2_batch(s)).loss)
    assert engine.stats()["chunk_moves_to_host"] > 0


def test_one_tensor_larger_than_the_free_memory_does_not_suggest_smaller_chunks() -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(4096, 64), nn.Linear(64, 64))

    # the embedding (1 MiB in fp32) has a chunk of its own and cannot fit 600 KiB
    engine, optimizer = chunkstar.initialize_engine(build, 0, engine_config("fp32", budget=600 * 1024, chunk_size=4096))
    with pytest.raises(chunkstar.DeviceMemoryError) as info:
        out = engine(torch.randint(0, 4096, (2, 8)))
        engine.backward(out.pow(2).mean())
    msg = str(info.value)
    assert "'0.weight'" in msg and "smaller chunks cannot help" in msg, msg
    assert "lower 'default_chunk_size'" not in msg, msg
