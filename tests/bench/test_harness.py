"""The harness's share of every system's step (Note [what one step is]): the torch.optim tail and the record."""

from __future__ import annotations

import pytest
import torch

from chunkstar_bench.harness import ADAMW, Context, timed_record, torch_optim_step
from chunkstar_bench.runner import RunSpec


def _model_and_loss() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, (model(torch.randn(16, 8)) * 100).square().mean()  # a gradient norm far above 1


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_torch_optim_step_is_backward_clip_step_zero(clip: float) -> None:
    model, loss = _model_and_loss()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, **ADAMW)
    value = torch_optim_step(loss, params, optimizer, clip)

    want_model, want_loss = _model_and_loss()
    want_params = list(want_model.parameters())
    want_optimizer = torch.optim.AdamW(want_params, **ADAMW)
    want_loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in want_params if p.grad is not None])
    assert norm > 10 * max(clip, 1.0)  # the clipping is seen, or its absence
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(want_params, clip)
    want_optimizer.step()

    assert value == pytest.approx(want_loss.item()) and isinstance(value, float)
    assert all(p.grad is None for p in params)  # zeroed, set to None
    for got, want in zip(params, want_params):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    exp_avg = [optimizer.state[p]["exp_avg"] for p in params]
    want_exp_avg = [want_optimizer.state[p]["exp_avg"] for p in want_params]
    for got, want in zip(exp_avg, want_exp_avg):  # the moments saw the clipped (or unclipped) gradient
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_timed_record_times_the_steps_and_names_the_optimizer() -> None:
    ctx = Context(RunSpec(system="pytorch", model="cpu-tiny", batch=2, seq_len=16, steps=2, warmup=1))
    seen: list[tuple[int, ...]] = []
    calls: list[str] = []

    def step(ids: torch.Tensor) -> float:
        seen.append(tuple(ids.shape))
        return 1.0 / len(seen)

    record = timed_record(ctx, step, "my AdamW", before_timed=lambda: calls.append(f"after {len(seen)} steps"))
    assert seen == [(2, 16)] * 3 and calls == ["after 1 steps"]
    assert record["losses"] == [1.0, 0.5, 1.0 / 3] and len(record["step_times_s"]) == 2
    assert (record["peak_device_bytes"], record["peak_device_kind"], record["optimizer"]) == (None, None, "my AdamW")
